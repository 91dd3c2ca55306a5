#!/usr/bin/env bash
# The control-plane soak benchmark (scripts/soak-control.py): builds the hook and the simulator,
# points a hooked Python process at a private simulated node, and sends it N control requests
# while sampling its memory. Usage: scripts/soak-control.sh [--requests N] (default 100000).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
profile="${TMS_PROFILE:-release}"
flag=(); [ "$profile" = release ] && flag=(--release)
(cd "$root" && cargo build --quiet "${flag[@]}" -p tms-hook -p tms-sim) >&2
out="${CARGO_TARGET_DIR:-$root/target}/$profile"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
eval "$("$out/tms-sim" env --node "soak-$$" --memory 1GiB --dir "$scratch")"
export TMS_CONTROL_DIR="$scratch/ctl"
python3 "$root/scripts/soak-control.py" --hook "$out/libtms_hook.so" "$@"
