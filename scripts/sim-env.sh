#!/usr/bin/env bash
# Prints the environment that points a process at the simulator (libtms_sim.so under the names
# libcudart.so.12, libcuda.so.1 and libascendcl.so). Builds the simulator first if needed.
# Usage: eval "$(scripts/sim-env.sh [--node NAME] [--devices N] [--memory SIZE] [--dir DIR] ...)"
# (every option of `tms-sim env`: see `tms-sim env --help`)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
profile="${TMS_PROFILE:-debug}"
flag=(); [ "$profile" = release ] && flag=(--release)
(cd "$root" && cargo build --quiet "${flag[@]}" -p tms-sim) >&2
exec "${CARGO_TARGET_DIR:-$root/target}/$profile/tms-sim" env "$@"
