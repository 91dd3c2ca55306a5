#!/usr/bin/env bash
# Prints the environment that points a process at the simulator (libtms_sim.so under the names
# libcudart.so.12, libcuda.so.1 and libascendcl.so). Builds the simulator (release, as the
# README's main command does) when it is missing or its sources changed since; otherwise it only
# prints. TMS_PROFILE=debug uses (and builds) target/debug instead.
# Usage: eval "$(scripts/sim-env.sh [--node NAME] [--devices N] [--memory SIZE] [--dir DIR] ...)"
# (every option of `tms-sim env`: see `tms-sim env --help`)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
profile="${TMS_PROFILE:-release}"
flag=(); [ "$profile" = release ] && flag=(--release)
bin="${CARGO_TARGET_DIR:-$root/target}/$profile/tms-sim"
changed() {
  local d
  for d in tms-sim tms-proto tms-vendor; do
    [ -d "$root/$d" ] || continue
    [ -n "$(find "$root/$d" -newer "$bin" \( -name '*.rs' -o -name '*.toml' -o -name '*.map' \) -print -quit)" ] && return 0
  done
  return 1
}
if [ ! -x "$bin" ] || changed; then
  (cd "$root" && cargo build --quiet "${flag[@]}" -p tms-sim) >&2
fi
exec "$bin" env "$@"
