#!/usr/bin/env bash
# The main job while the colocate runner is not there yet: build the workspace and run a C program
# through a pause-like cycle (create, map, write; unmap+release; create+map at the same address,
# restore) on the simulator, printing device free memory at each step.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
cargo build --quiet
out="$root/target/demo"; mkdir -p "$out"
cc -O1 -DTMS_TEST_DLSYM -Itests/c -o "$out/sim_consumer" tests/c/sim_consumer.c tests/c/main_direct.c -ldl -lpthread
eval "$(target/debug/tms-sim env --node "demo-$$" --memory 4GiB)"
export TMS_SIM_DIR="${TMS_SIM_DIR:-$(mktemp -d)}"
echo "CUDA virtual-memory cycle on tms-sim (4 GiB device):"
"$out/sim_consumer" cuda-vmm
echo "Ascend virtual-memory cycle on tms-sim:"
"$out/sim_consumer" acl-vmm
echo "libtms_hook.so preloaded: 100 pause/resume cycles with CPU backup (CUDA, then Ascend):"
cc -O1 -DTMS_TEST_DLSYM -Itests/c -Iinclude -o "$out/hook_consumer" tests/c/hook_consumer.c tests/c/main_direct.c -ldl -lpthread
LD_PRELOAD="$root/target/debug/libtms_hook.so" "$out/hook_consumer" cycle cuda 100
LD_PRELOAD="$root/target/debug/libtms_hook.so" "$out/hook_consumer" cycle acl 100
