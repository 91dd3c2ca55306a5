#!/usr/bin/env bash
# A tour of tms on the simulator, no GPU needed (a few minutes, most of it the first build):
#   1. a C program allocating in tagged regions under libtms_hook.so, through 100 pause/resume
#      cycles with CPU backup: contents, addresses and device free memory checked each cycle
#      (CUDA, then Ascend);
#   2. relax-colocate run: 3 GRPO steps with a trainer and a rollout sharing one simulated
#      device, their phase table and checks.
# Everything it writes goes to a temporary folder, removed at the end.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --quiet
out="${CARGO_TARGET_DIR:-$root/target}/debug"
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
cc -O1 -DTMS_TEST_DLSYM -Itests/c -Iinclude -o "$scratch/hook_consumer" tests/c/hook_consumer.c tests/c/main_direct.c -ldl -lpthread
mkdir -p "$scratch/sim"
eval "$("$out/tms-sim" env --node "demo-$$" --memory 4GiB --dir "$scratch/sim")"
export TMS_CONTROL_DIR="$scratch/ctl"
echo "== 1. libtms_hook.so preloaded: 100 pause/resume cycles with CPU backup (CUDA, then Ascend)"
LD_PRELOAD="$out/libtms_hook.so" "$scratch/hook_consumer" cycle cuda 100
LD_PRELOAD="$out/libtms_hook.so" "$scratch/hook_consumer" cycle acl 100
echo "== 2. relax-colocate run: 3 GRPO steps, trainer and rollout on one simulated device"
"$out/relax-colocate" run --device sim --steps 3 --out "$scratch/run"
echo "(the tour's folder is removed now; relax-colocate run --out DIR keeps a run's files)"
