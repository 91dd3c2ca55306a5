#!/usr/bin/env bash
# The hardware kit: proves tms on a real GPU in one command, on a machine with no Rust toolchain
# and no network (NVIDIA driver, CUDA 12 or 13 runtime, Python 3 with PyTorch and pytest, gcc).
#
#   scripts/gpu-check.sh prepare [--arch x86_64|aarch64] DIR
#                                             on the build machine: release build, stripped, plus
#                                             the wheel, C test sources and Python tests, into DIR
#                                             (about 15 MiB; carry it to the GPU machine), for
#                                             the GPU machine's architecture (default: this one's;
#                                             aarch64 for Grace and Kunpeng hosts)
#   DIR/gpu-check.sh run DIR OUTDIR           on the GPU machine: every check, each with a timeout;
#                                             writes OUTDIR/summary.md, OUTDIR/summary.json, logs/
#   DIR/gpu-check.sh run --sim DIR OUTDIR     the same kit on the simulator (what CI runs), for the
#                                             checks that need no PyTorch
#   DIR/gpu-check.sh run --only REGEX DIR OUT only the checks whose names match REGEX (grep -E), to
#                                             rerun the failed ones; the others are recorded as skipped
#   DIR/npu-check.sh run [--sim] DIR OUTDIR   the Ascend checks (run --npu): the C consumers through
#                                             ACL, the colocated run and the bench on an NPU (CANN's
#                                             set_env.sh sourced), torch_npu programs through the
#                                             wheel in preload and torch modes
#
# What `run` checks: how the driver's free memory moves under each VMM, stream, event and
# host-memory call (a probe whose log is the record), the C consumers against the driver (100
# pause/resume cycles with backup: contents, addresses and free memory; one tag on every GPU when
# there are several; a thread without a context allocating with a margin; threads churning during pause; RDMA-capable region memory; a pause that must not wait for a
# stalled non-blocking stream; disk backup), real PyTorch through the installed wheel in preload
# and torch modes (tests/torch-consumers: torch_memory_saver programs and its examples'
# scenarios, SGLang's and slime's call sequences, MemPool isolation, a single-rank NCCL
# all-reduce on region memory across a pause, tag nccl suspending and resuming a torch.distributed
# program's two process groups (1-rank communicators: NCCL refuses two ranks on one GPU), our hook under torch_memory_saver's own package
# side by side with its library), `relax-colocate run` with the built-in workers and with PyTorch workers
# (scripts/torch_worker.py: a small transformer trained with AdamW, weights, KV cache and a
# captured CUDA graph in tags; weights through the host, then by CUDA IPC), `relax-colocate run
# --mode async` (two GPUs or more: trainer and rollout on one each, weights broadcast over NCCL;
# built-in and PyTorch workers), `relax-colocate run --mode elastic` on the same GPUs with a
# rollout-bound job (the waiting trainer lends its GPU to an engine and gets its exact bytes back;
# built-in and PyTorch workers) and `relax-colocate bench`.
# Exit: 0 every check passed (skips allowed), 1 a check failed, 2 usage or a missing prerequisite.
# TMS_KIT_PYTEST_K: a pytest -k expression narrowing torch-consumers to some of its tests (every
# file is still collected). The test suite's dry run of the kit sets it: the suite itself runs
# every one of those tests on the simulator.
set -uo pipefail

usage() { sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "gpu-check: $*" >&2; exit 2; }
host_arch() { case "$(uname -m)" in arm64|aarch64) echo aarch64 ;; *) uname -m ;; esac; }

prepare() {
  local arch dir root
  arch="$(host_arch)"
  while [ $# -gt 0 ]; do
    case "$1" in
      --arch) [ $# -ge 2 ] || { usage >&2; exit 2; }; arch="$2"; shift 2 ;;
      --arch=*) arch="${1#--arch=}"; shift ;;
      -*) die "unknown option $1 for prepare" ;;
      *) break ;;
    esac
  done
  [ $# -eq 1 ] || { usage >&2; exit 2; }
  case "$arch" in x86_64|aarch64) ;; *) die "--arch must be x86_64 or aarch64 (not '$arch')" ;; esac
  dir="$1"
  root="$(cd "$(dirname "$0")/.." && pwd)"
  [ -f "$root/Cargo.toml" ] || die "prepare runs from a checkout (scripts/gpu-check.sh)"
  command -v cargo >/dev/null || die "prepare needs the Rust toolchain (cargo)"
  set -e
  mkdir -p "$dir"
  dir="$(cd "$dir" && pwd)"
  rm -rf "$dir/bin" "$dir/lib" "$dir/wheel" "$dir/src" "$dir/tests" "$dir/scripts" "$dir/python"
  mkdir -p "$dir/bin" "$dir/lib" "$dir/wheel" "$dir/src" "$dir/tests" "$dir/scripts" "$dir/python"
  # Everything is linked against glibc 2.17 with the wheel's tools (cargo-zigbuild): the GPU
  # machine's glibc may be older than this one's. build-wheel.sh adds the Rust target if needed.
  echo "gpu-check: building the $arch wheel" >&2
  "$root/scripts/build-wheel.sh" --arch "$arch" "$dir/wheel" >/dev/null
  echo "gpu-check: building the $arch binaries (release, glibc 2.17)" >&2
  local venv="${TMS_BUILD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tms/build-venv}"
  local target="${TMS_WHEEL_TARGET_DIR:-${CARGO_TARGET_DIR:-$root/target}/wheel}"
  # Without debug info (most of the size; the exported symbols stay), as the wheel is built: the
  # hook is then a cache hit, and no host strip has to read another architecture's files.
  (cd "$root" && PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$target" CARGO_PROFILE_RELEASE_DEBUG=0 \
    CARGO_PROFILE_RELEASE_STRIP=debuginfo "$venv/bin/cargo-zigbuild" zigbuild --release --quiet \
    --target "$arch-unknown-linux-gnu.2.17" -p tms-hook -p tms-sim -p tms-ctl -p relax-colocate)
  local out="$target/$arch-unknown-linux-gnu/release"
  for b in tms-ctl tms-sim relax-colocate; do cp "$out/$b" "$dir/bin/"; done
  for l in libtms_hook.so libtms_sim.so; do cp "$out/$l" "$dir/lib/"; done
  echo "$arch" >"$dir/ARCH"
  cp "$root"/tests/c/*.c "$root"/tests/c/*.h "$root"/include/*.h "$dir/src/"
  mkdir -p "$dir/tests/torch-consumers"
  cp "$root"/tests/torch-consumers/{conftest.py,variants.py,torch_build.py,test_wheel.py,test_frameworks.py,test_upstream_scenarios.py,test_tms_package.py,test_live_only.py,test_soak_verify.py,test_hook_under_torch.py,test_device_only.py,test_npu_programs.py,test_nccl_pause.py} "$dir/tests/torch-consumers/"
  # The PyTorch worker of relax-colocate run, and the tms package it imports (found in python/
  # beside scripts/, as in a checkout); relax-colocate gives it its worker-protocol client.
  cp "$root/scripts/torch_worker.py" "$root/scripts/soak-verify.py" "$dir/scripts/"
  cp -r "$root/python/tms" "$dir/python/"
  find "$dir/python" -name __pycache__ -prune -exec rm -rf {} +
  cp "$root/scripts/gpu-check.sh" "$root/scripts/npu-check.sh" "$dir/"
  # torch_memory_saver's own preload libraries (from the test environment, when it exists: it is
  # not installed for this), so the bench runs them side by side with ours on the GPU.
  rm -rf "$dir/upstream"
  local tpy
  if [ "$arch" = "$(host_arch)" ] && tpy="$("$root/scripts/torch-env.sh" --check >/dev/null 2>&1 && "$root/scripts/torch-env.sh" 2>/dev/null)"; then
    local tsite
    tsite="$("$tpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    # The whole package with its libraries, a site folder of its own: the PyTorch suite's `ours`
    # and `upstream` variants run torch_memory_saver's Python package on the GPU too.
    if [ -d "$tsite/torch_memory_saver" ] && ls "$tsite"/torch_memory_saver_hook_mode_*.abi3.so >/dev/null 2>&1; then
      mkdir -p "$dir/upstream"
      cp -r "$tsite/torch_memory_saver" "$tsite"/torch_memory_saver_hook_mode_*.abi3.so "$dir/upstream/"
      find "$dir/upstream" -name __pycache__ -prune -exec rm -rf {} +
    fi
  fi
  (cd "$root" && git describe --always --dirty 2>/dev/null || echo unknown) >"$dir/VERSION"
  set +e
  local size
  size=$(du -sm "$dir" | cut -f1)
  [ "$size" -lt 60 ] || die "$dir is $size MiB; the device tool carries at most 64 MiB"
  echo "gpu-check: $dir ready ($size MiB); on the GPU machine: $dir/gpu-check.sh run $dir OUTDIR" >&2
}

# ---- run ----------------------------------------------------------------------------------------

results=""
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$results"; }

# Checks chosen with --only (an extended regex); empty: all of them.
only=""
selected() { [ -z "$only" ] || [ "$1" = build-c-consumers ] || printf '%s\n' "$1" | grep -Eq -- "$only"; }

# check NAME TIMEOUT_S COMMAND...: runs COMMAND with a timeout, logs it, records pass/fail.
check() {
  local name="$1" limit="$2"
  shift 2
  if ! selected "$name"; then
    record "$name" skip 0 "not selected by --only"
    return 0
  fi
  local log="$outdir/logs/$name.log" start=$SECONDS rc
  echo "gpu-check: $name" >&2
  timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
  rc=$?
  local secs=$((SECONDS - start))
  if [ $rc -eq 0 ]; then
    record "$name" pass "$secs" ""
  else
    local why="exit $rc"
    [ $rc -eq 124 ] && why="timed out after ${limit}s"
    record "$name" fail "$secs" "$why: $(grep -v '^\s*$' "$log" | tail -n 5 | tr '\n\t' '  ' | cut -c1-400)"
  fi
}

skip() {
  selected "$1" || { record "$1" skip 0 "not selected by --only"; return 0; }
  echo "gpu-check: $1 skipped: $2" >&2
  record "$1" skip 0 "$2"
}

# Points this process and its children at the kit's simulator (a private node named NAME-PID).
use_simulator() {
  local vars
  mkdir -p "$outdir/sim"
  vars=$("$kit/bin/tms-sim" env --lib "$kit/lib" --node "$1-$$" --dir "$outdir/sim" --memory 2GiB --devices 1) ||
    die "tms-sim env failed"
  eval "$vars"
}

# A rollout-bound job for the built-in workers: a 4B model's decode at 1% of the modelled peak keeps
# the trainer waiting for samples about half the time, long past the switch, so elastic mode lends.
# The host link is left out of the model (h2d/d2h 0: the switch is charged what it really takes):
# a modelled switch of Qwen3-4B's full-scale state (about 3.5 s on the H100 figures) would use up
# those short waits, and these checks are about lending's mechanics, not its price.
ROLLOUT_BOUND=(--memory-profile qwen3-4b --set memory.scale=0.002 --set compute.model=true
  --set compute.rollout_mfu=0.01 --set compute.h2d_gbps=0 --set compute.d2h_gbps=0)

# `relax-colocate run --mode elastic` on 2 devices as check NAME, its run directory OUT, then check
# NAME-lent: the run lent the trainer's device at least once, no engine had to be paused from
# outside, and the reclaims' checks (the trainer's exact bytes back) are among those that passed.
elastic_run() {
  local name="$1" out="$2"
  shift 2
  check "$name" 420 "$kit/bin/relax-colocate" run --mode elastic --devices 2 --steps 3 --out "$out" "$@"
  [ -f "$out/summary.json" ] || return 0
  check "$name-lent" 30 python3 -c '
import json, sys
s = json.load(open(sys.argv[1]))
e = s["async"]["elastic"]
print(json.dumps(e, indent=1))
assert s["status"] == "ok" and s["checks"]["passed"] > 0, s.get("failure")
assert e["lends"] >= 1, "the trainer never lent its device"
assert e["lent_tokens"] > 0, "the lent engine generated nothing"
assert e["forced_reclaims"] == 0, "an engine was paused from outside: %s" % e["retired_engines"]
' "$out/summary.json"
}

# One tag's memory on every device, paused and resumed together (each device's free memory,
# addresses, contents; the caller's current device kept): on the simulator with two devices, on
# a machine where there are two or more, skipped with the count otherwise.
multi_device_check() {
  local name="$1" api="$2" kind="$3" sim="$4" consumer="$5" hook="$6" ndev
  if [ "$sim" = 1 ]; then
    check "$name" 120 env TMS_SIM_NODE="$TMS_SIM_NODE-multi" TMS_SIM_DEVICES=2 LD_PRELOAD="$hook" \
      "$consumer" multi-device "$api" 10
    return
  fi
  ndev=$("$consumer" device-count "$api" 2>/dev/null | sed -n 's/^devices=//p')
  if [ "${ndev:-0}" -ge 2 ]; then
    check "$name" 120 env LD_PRELOAD="$hook" "$consumer" multi-device "$api" 10
  else
    skip "$name" "${ndev:-no} $kind(s) here; the check needs two or more"
  fi
}

find_cudart() {
  # The runtime the C consumers load: CUDA 13 first, then 12; from the system or PyTorch's wheels.
  local so
  for so in libcudart.so.13 libcudart.so.12; do
    python3 -c "import ctypes; ctypes.CDLL('$so')" 2>/dev/null && { echo "$so"; return 0; }
  done
  local d
  d=$(python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
dirs = site.getsitepackages() + [site.getusersitepackages()]
for d in dirs:
    for pat in ("nvidia/cu13/lib", "nvidia/cuda_runtime/lib", "nvidia/cu12/lib"):
        for hit in glob.glob(os.path.join(d, pat)):
            if glob.glob(os.path.join(hit, "libcudart.so.1[23]")):
                print(hit); sys.exit(0)
PY
)
  [ -n "$d" ] || return 1
  export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  for so in libcudart.so.13 libcudart.so.12; do
    [ -e "$d/$so" ] && { echo "$so"; return 0; }
  done
  return 1
}

run() {
  local sim=0 npu=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --sim) sim=1; shift ;;
      --npu) npu=1; shift ;;
      --only) [ $# -ge 2 ] || { usage >&2; exit 2; }; only="$2"; shift 2 ;;
      --only=*) only="${1#--only=}"; shift ;;
      -*) die "unknown option $1 for run" ;;
      *) break ;;
    esac
  done
  [ $# -eq 2 ] || { usage >&2; exit 2; }
  kit="$(cd "$1" 2>/dev/null && pwd)" || die "no kit at $1 (make one with: scripts/gpu-check.sh prepare DIR)"
  outdir="$2"
  mkdir -p "$outdir/logs" || die "cannot create $outdir"
  outdir="$(cd "$outdir" && pwd)"
  results="$outdir/results.tsv"
  : >"$results"
  for f in bin/relax-colocate lib/libtms_hook.so src/hook_consumer.c; do
    [ -e "$kit/$f" ] || die "$kit/$f is missing: not a kit made by gpu-check.sh prepare"
  done
  local kit_arch
  kit_arch="$(cat "$kit/ARCH" 2>/dev/null || echo x86_64)"
  [ "$kit_arch" = "$(host_arch)" ] ||
    die "this kit is for $kit_arch and this machine is $(host_arch): make one with scripts/gpu-check.sh prepare --arch $(host_arch) DIR"
  command -v cc >/dev/null || die "a C compiler (cc) is needed"
  command -v python3 >/dev/null || die "python3 is needed"
  local hook="$kit/lib/libtms_hook.so" cudart device
  export TMS_CONTROL_DIR="$outdir/ctl"

  if [ $npu = 1 ]; then
    run_npu "$sim"
    return
  fi
  if [ $sim = 1 ]; then
    device=sim
    use_simulator gpu-check
    cudart=libcudart.so.12
    echo "simulator (tms-sim)" >"$outdir/device.txt"
  else
    device=cuda
    python3 -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null || die "libcuda.so.1 not loadable: no NVIDIA driver here (use run --sim)"
    cudart=$(find_cudart) || die "no libcudart.so.13 or .12 found (system or PyTorch's nvidia wheels)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$outdir/device.txt" 2>&1 || echo "nvidia-smi unavailable" >"$outdir/device.txt"
  fi
  echo "runtime: $cudart" >>"$outdir/device.txt"

  # 1. The C consumers against the driver.
  local consumer="$outdir/hook_consumer"
  check build-c-consumers 120 cc -O2 -DTMS_TEST_DLSYM "-DTMS_CUDART_SONAME=\"$cudart\"" -I"$kit/src" \
    -o "$consumer" "$kit/src/hook_consumer.c" "$kit/src/main_direct.c" -ldl -lpthread
  # How the driver's free-memory figure moves under each call the hook makes (its log is the
  # record; the simulator charges what this measured).
  check c-driver-memory-probe 60 sh -c 'cc -O2 -o "$1" "$2" -ldl && "$1"' probe "$outdir/driver_memory_probe" \
    "$kit/src/driver_memory_probe.c"
  if [ -x "$consumer" ]; then
    check c-cycles-100-with-backup 300 env LD_PRELOAD="$hook" "$consumer" cycle cuda 100
    check c-thread-without-context-margin 60 env LD_PRELOAD="$hook" "$consumer" margin-thread cuda
    check c-threads-churn-during-pause 300 env LD_PRELOAD="$hook" "$consumer" threads cuda 200
    check c-rdma-capable-region-memory 60 env LD_PRELOAD="$hook" "$consumer" rdma cuda
    check c-pause-ignores-stalled-nonblocking-stream 60 env LD_PRELOAD="$hook" "$consumer" pause-streams cuda
    mkdir -p "$outdir/disk"
    check c-disk-backup 120 env LD_PRELOAD="$hook" "$consumer" disk-backup cuda "$outdir/disk"
    multi_device_check c-multi-device cuda GPU "$sim" "$consumer" "$hook"
    if [ $sim = 1 ]; then
      # Fault injection and the simulator's introspection exist only there.
      check c-oom-on-resume-then-retry 60 env LD_PRELOAD="$hook" "$consumer" oom-resume cuda
      check c-faults-in-every-driver-call 300 env LD_PRELOAD="$hook" "$consumer" faults cuda
      check c-ascend-cycles 300 env LD_PRELOAD="$hook" "$consumer" cycle acl 20
      check c-ascend-malloc-policies 120 env LD_PRELOAD="$hook" "$consumer" acl-policies acl
    else
      skip c-oom-on-resume-then-retry "needs the simulator's fault injection (run --sim)"
    fi
  fi

  # 2. Real PyTorch through the wheel. One probe for both PyTorch parts (an import takes seconds).
  local torch_cuda=0 has_pytest=0
  if [ $sim = 0 ] && python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    torch_cuda=1
    python3 -c 'import pytest' 2>/dev/null && has_pytest=1
  fi
  # 3. The colocated cycle (built-in workers, then PyTorch workers) and 4. the benchmark.
  check relax-colocate-run 300 "$kit/bin/relax-colocate" run --device "$device" --steps 5 --out "$outdir/run"
  # Async mode puts trainer and rollout on devices of their own: two at least.
  local gpus=2
  [ $sim = 0 ] && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  if [ "${gpus:-0}" -ge 2 ]; then
    # Weights go over NCCL when the system's libnccl.so.2 loads, through the host otherwise.
    local transport=auto
    [ $sim = 0 ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2' && transport=host
    check relax-colocate-run-async 300 "$kit/bin/relax-colocate" run --device "$device" --mode async --devices 2 \
      --weight-transport "$transport" --steps 5 --out "$outdir/run-async"
    elastic_run relax-colocate-run-elastic "$outdir/run-elastic" --device "$device" --weight-transport "$transport" \
      "${ROLLOUT_BOUND[@]}"
  else
    skip relax-colocate-run-async "async mode needs 2 GPUs and this machine has ${gpus:-0}"
    skip relax-colocate-run-elastic "elastic mode needs 2 GPUs and this machine has ${gpus:-0}"
  fi
  if [ $sim = 1 ]; then
    skip relax-colocate-run-torch "PyTorch workers on the simulator run in the test suite (cargo test), not in the kit"
  elif [ $torch_cuda = 0 ]; then
    skip relax-colocate-run-torch "python3 has no PyTorch with CUDA"
  else
    local worker="python3 $kit/scripts/torch_worker.py"
    check relax-colocate-run-torch 420 "$kit/bin/relax-colocate" run --device "$device" --steps 10 \
      --memory-profile tiny --trainer-cmd "$worker" --rollout-cmd "$worker" --out "$outdir/run-torch"
    # The same hand-over by CUDA IPC: the trainer's cudaMalloc'd buffer opened by the rollout.
    check relax-colocate-run-torch-ipc 420 "$kit/bin/relax-colocate" run --device "$device" --steps 3 \
      --memory-profile tiny --trainer-cmd "$worker" --rollout-cmd "$worker" --weight-transport ipc \
      --out "$outdir/run-torch-ipc"
    # Async, the weights broadcast over torch.distributed with the NCCL PyTorch brings.
    if [ "${gpus:-0}" -ge 2 ]; then
      check relax-colocate-run-torch-async 420 "$kit/bin/relax-colocate" run --device "$device" --mode async \
        --devices 2 --steps 5 --memory-profile tiny --trainer-cmd "$worker" --rollout-cmd "$worker" \
        --out "$outdir/run-torch-async"
      # The lend's weights go by CUDA IPC; decoding at the pace of a 10-TFLOPS device at 0.1% MFU
      # keeps the trainer waiting for its batches.
      elastic_run relax-colocate-run-torch-elastic "$outdir/run-torch-elastic" --device "$device" \
        --memory-profile tiny --trainer-cmd "$worker" --rollout-cmd "$worker" --set compute.model=true \
        --set compute.tflops=10 --set compute.rollout_mfu=0.001 --set elastic.lend_after_s=0.05
    else
      skip relax-colocate-run-torch-async "async mode needs 2 GPUs and this machine has ${gpus:-0}"
      skip relax-colocate-run-torch-elastic "elastic mode needs 2 GPUs and this machine has ${gpus:-0}"
    fi
  fi
  # Side by side with torch_memory_saver's library when the kit carries it, for this machine's
  # CUDA major (the simulator serves either).
  local upstream=auto major=13
  [ $sim = 0 ] && major="${cudart##*.}"
  [ -f "$kit/upstream/torch_memory_saver_hook_mode_preload_cu$major.abi3.so" ] &&
    upstream="$kit/upstream/torch_memory_saver_hook_mode_preload_cu$major.abi3.so"
  check relax-colocate-bench 420 "$kit/bin/relax-colocate" bench --device "$device" --quick --upstream-lib "$upstream" \
    --out "$outdir/bench"

  # 5. The PyTorch suite last: the longest part, so a cap on the whole run never costs the rest.
  if [ $sim = 1 ]; then
    skip torch-consumers "PyTorch on the simulator runs in the test suite (cargo test), not in the kit"
  elif [ $torch_cuda = 0 ] || [ $has_pytest = 0 ]; then
    skip torch-consumers "python3 has no PyTorch with CUDA, or no pytest"
  else
    local wheel
    wheel=$(ls "$kit"/wheel/tms_memory_saver-*.whl 2>/dev/null | head -n 1)
    # torch_memory_saver's own package from the kit where the machine has none.
    local upstream_env=()
    python3 -c 'import torch_memory_saver' 2>/dev/null || [ ! -d "$kit/upstream/torch_memory_saver" ] ||
      upstream_env=(TMS_TEST_UPSTREAM_SITE="$kit/upstream" PYTHONPATH="$kit/upstream${PYTHONPATH:+:$PYTHONPATH}")
    local select=()
    [ -z "${TMS_KIT_PYTEST_K:-}" ] || select=(-k "$TMS_KIT_PYTEST_K")
    check torch-consumers 600 env -C "$kit/tests/torch-consumers" "${upstream_env[@]}" TMS_TEST_REAL_DEVICE=1 TMS_TEST_HOOK="$hook" \
      TMS_TEST_WHEEL="$wheel" TMS_TEST_TMP="$outdir/torch" python3 -m pytest -v -p no:cacheprovider -rfEs \
      --junitxml="$outdir/torch-consumers.xml" "${select[@]}" .
  fi

  summarize "$device"
  ! grep -q "	fail	" "$results"
}

# The Ascend half: the C consumers through ACL, the colocated and async runs and the bench on the NPU (or
# on the simulator's ACL side with --sim).
run_npu() {
  local sim="$1" hook="$kit/lib/libtms_hook.so" device
  if [ "$sim" = 1 ]; then
    device=sim
    use_simulator npu-check
    echo "simulator (tms-sim), Ascend ACL side" >"$outdir/device.txt"
  else
    device=npu
    python3 -c 'import ctypes; ctypes.CDLL("libascendcl.so")' 2>/dev/null ||
      die "libascendcl.so not loadable: source CANN's set_env.sh first (or use run --sim)"
    npu-smi info >"$outdir/device.txt" 2>&1 || echo "npu-smi unavailable" >"$outdir/device.txt"
  fi
  local consumer="$outdir/hook_consumer"
  check build-c-consumers 120 cc -O2 -DTMS_TEST_DLSYM -I"$kit/src" \
    -o "$consumer" "$kit/src/hook_consumer.c" "$kit/src/main_direct.c" -ldl -lpthread
  if [ -x "$consumer" ]; then
    check acl-cycles-100-with-backup 300 env LD_PRELOAD="$hook" "$consumer" cycle acl 100
    check acl-threads-churn-during-pause 300 env LD_PRELOAD="$hook" "$consumer" threads acl 200
    mkdir -p "$outdir/disk"
    check acl-disk-backup 120 env LD_PRELOAD="$hook" "$consumer" disk-backup acl "$outdir/disk"
    multi_device_check acl-multi-device acl NPU "$sim" "$consumer" "$hook"
    if [ "$sim" = 1 ]; then
      check acl-malloc-policies 120 env LD_PRELOAD="$hook" "$consumer" acl-policies acl
      check acl-oom-on-resume-then-retry 60 env LD_PRELOAD="$hook" "$consumer" oom-resume acl
      check acl-faults-in-every-driver-call 300 env LD_PRELOAD="$hook" "$consumer" faults acl
    else
      skip acl-malloc-policies "reads the simulator's record of each handle's memory attribute"
    fi
  fi
  if [ "$sim" = 1 ]; then
    skip torch-npu-consumers "the same programs run in the test suite (cargo test) on the simulator's CUDA side"
  elif ! python3 -c 'import torch, torch_npu, pytest; assert torch.npu.is_available()' 2>/dev/null; then
    skip torch-npu-consumers "python3 has no torch_npu that sees an NPU, or no pytest"
  else
    # torch_npu programs through the kit's wheel, preload and torch modes (tests/torch-consumers/
    # test_npu_programs.py): tags, pause freeing torch.npu.mem_get_info, same addresses and
    # contents after resume, 20 cycles under a matmul, freed memory usable by others.
    local wheel
    wheel="$(ls "$kit"/wheel/tms_memory_saver-*.whl 2>/dev/null | head -n 1)"
    check torch-npu-consumers 420 env -C "$kit/tests/torch-consumers" TMS_TEST_REAL_DEVICE=1 TMS_TEST_DEVICE=npu \
      TMS_TEST_HOOK="$hook" TMS_TEST_WHEEL="$wheel" TMS_TEST_TMP="$outdir/torch-npu" python3 -m pytest -q \
      -p no:cacheprovider -rfEs --junitxml="$outdir/torch-npu-consumers.xml" test_npu_programs.py
  fi
  if [ "$sim" = 1 ]; then
    check relax-colocate-run 300 "$kit/bin/relax-colocate" run --device sim --set sim.api=acl --steps 5 --out "$outdir/run"
  else
    check relax-colocate-run 300 "$kit/bin/relax-colocate" run --device npu --steps 5 --out "$outdir/run"
  fi
  # Async mode: trainer and rollout on an NPU each, weights broadcast over HCCL.
  if [ "$sim" = 1 ]; then
    check relax-colocate-run-async 300 "$kit/bin/relax-colocate" run --device sim --set sim.api=acl --mode async \
      --devices 2 --steps 5 --out "$outdir/run-async"
    elastic_run relax-colocate-run-elastic "$outdir/run-elastic" --device sim --set sim.api=acl "${ROLLOUT_BOUND[@]}"
  else
    local npus
    npus=$(npu-smi info -l 2>/dev/null | grep -c 'NPU ID' || true)
    if [ "${npus:-0}" -ge 2 ]; then
      check relax-colocate-run-async 300 "$kit/bin/relax-colocate" run --device npu --mode async --devices 2 \
        --steps 5 --out "$outdir/run-async"
      elastic_run relax-colocate-run-elastic "$outdir/run-elastic" --device npu "${ROLLOUT_BOUND[@]}"
    else
      skip relax-colocate-run-async "async mode needs 2 NPUs and this machine has ${npus:-0}"
      skip relax-colocate-run-elastic "elastic mode needs 2 NPUs and this machine has ${npus:-0}"
    fi
  fi
  if [ "$sim" = 1 ]; then
    check relax-colocate-bench 420 "$kit/bin/relax-colocate" bench --device sim --api acl --quick --out "$outdir/bench"
  else
    check relax-colocate-bench 420 "$kit/bin/relax-colocate" bench --device npu --quick --out "$outdir/bench"
  fi
  summarize "$device" npu-check
  ! grep -q "	fail	" "$results"
}

summarize() {
  python3 - "$results" "$outdir" "$1" "$kit" "${2:-gpu-check}" <<'PY'
import json, os, sys, datetime
results, outdir, device, kit, title = sys.argv[1:]
rows = [line.rstrip("\n").split("\t", 3) for line in open(results) if line.strip()]
checks = [{"check": r[0], "result": r[1], "seconds": int(r[2]), "detail": r[3]} for r in rows]
facts = open(os.path.join(outdir, "device.txt")).read().strip()
version = open(os.path.join(kit, "VERSION")).read().strip() if os.path.exists(os.path.join(kit, "VERSION")) else "unknown"
bench = None
for name in ("results.json",):
    p = os.path.join(outdir, "bench", name)
    if os.path.exists(p):
        bench = p
summary = {
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "device": device,
    "device_facts": facts,
    "tms_version": version,
    "passed": sum(c["result"] == "pass" for c in checks),
    "failed": sum(c["result"] == "fail" for c in checks),
    "skipped": sum(c["result"] == "skip" for c in checks),
    "checks": checks,
    "bench_results": bench,
}
json.dump(summary, open(os.path.join(outdir, "summary.json"), "w"), indent=2)
lines = [
    f"# {title}: {summary['passed']} passed, {summary['failed']} failed, {summary['skipped']} skipped",
    "",
    f"- date: {summary['date']}",
    f"- tms: {version}",
    "- device: " + facts.replace("\n", "; "),
    "",
    "| check | result | seconds | detail |",
    "|---|---|---|---|",
]
for c in checks:
    detail = c["detail"].replace("|", "\\|")
    lines.append(f"| {c['check']} | {c['result']} | {c['seconds']} | {detail} |")
lines.append("")
lines.append("Logs: logs/<check>.log; the benchmark's tables: bench/; the run's metrics: run/.")
open(os.path.join(outdir, "summary.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  -h|--help|"") usage; [ -n "${1:-}" ] || exit 2 ;;
  *) echo "gpu-check: unknown command $1" >&2; usage >&2; exit 2 ;;
esac
