#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and driver: build, run the hook against the real driver, run the
# benchmark there, and, where PyTorch is installed, check tensors in a region: pause frees their
# memory in torch.cuda.mem_get_info, resume brings them back intact at the same data_ptr.
# Usage: scripts/gpu-check.sh [OUT_DIR]   (default: runs/gpu-check-<date>)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$out"
log() { echo "== $*" | tee -a "$out/summary.txt"; }

command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null || { echo "gpu-check: libcuda.so.1 not loadable: no NVIDIA driver here" >&2; exit 1; }

log "build (release)"
cargo build --release -p tms-hook -p tms-sim -p tms-ctl -p relax-colocate
hook="$root/target/release/libtms_hook.so"

log "hook against the real driver: C consumer, 100 pause/resume cycles with backup"
cc -O2 -DTMS_TEST_DLSYM -Itests/c -Iinclude -o "$out/hook_consumer" tests/c/hook_consumer.c tests/c/main_direct.c -ldl -lpthread
# The real runtime must be findable: libcudart.so.12 from the CUDA toolkit or PyTorch's wheel.
if ! python3 -c 'import ctypes; ctypes.CDLL("libcudart.so.12")' 2>/dev/null; then
  cudart=$(python3 -c 'import nvidia.cuda_runtime, os; print(os.path.join(os.path.dirname(nvidia.cuda_runtime.__file__), "lib"))' 2>/dev/null || true)
  [ -n "$cudart" ] && export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
LD_PRELOAD="$hook" "$out/hook_consumer" cycle cuda 100 | tee -a "$out/summary.txt"
LD_PRELOAD="$hook" "$out/hook_consumer" oom-resume cuda | tee -a "$out/summary.txt" || echo "oom-resume needs the simulator's fault injection; skipped on real hardware" | tee -a "$out/summary.txt"

log "benchmark on the GPU"
target/release/relax-colocate bench --device cuda --out "$out/bench" | tee "$out/bench.txt"

if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  log "PyTorch: tensors in a region, pause/resume through the tms package"
  tmp=$(mktemp -d)
  scripts/install.sh --profile release --no-build "$tmp" >/dev/null
  LD_PRELOAD="$tmp/lib/torch_memory_saver_hook_mode_preload.abi3.so" PYTHONPATH="$tmp/lib/python" TMS_PREFIX="$tmp" \
    python3 -m unittest discover -v -s python/tests -k WithTorch 2>&1 | tee -a "$out/summary.txt"
else
  log "PyTorch with CUDA not installed: torch checks skipped"
fi
log "done: results in $out"
