#!/usr/bin/env bash
# Creates (once) and prints the path of the Python that the real-consumer tests use: a virtual
# environment holding the pinned packages of tests/torch-consumers/requirements.txt (PyTorch's CUDA 13.2
# build, torch_memory_saver 0.0.10, ...). About 3 GB is downloaded the first time (a few minutes);
# later runs reuse the environment and download nothing while the pins stay the same.
# `--cuda 12` does the same for requirements-cu12.txt (PyTorch 2.9.1, built for CUDA 12.8) in its own
# environment, so the simulator is also proven under the CUDA 12 runtime's callers.
# `--npu` does the same for requirements-npu.txt (torch_npu 2.9.1 beside PyTorch 2.9.1), the Ascend
# consumer, in an environment of its own: torch_npu loads itself into every `import torch` of its
# environment.
#
# Where: $TMS_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/tms/torch-venv (torch-venv-cu12 for --cuda 12;
#        $TMS_TORCH12_VENV overrides that one; torch-venv-npu for --npu, $TMS_TORCH_NPU_VENV).
# Usage: scripts/torch-env.sh [--cuda 12|13 | --npu]    prints the environment's python on stdout
#                                                       (progress on stderr)
#        scripts/torch-env.sh [--cuda 12|13 | --npu] --check  exits 0 if the environment is ready, 1 if not
#                                                       (no install)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() { echo "usage: scripts/torch-env.sh [--cuda 12|13 | --npu] [--check]" >&2; exit 2; }
cuda=13
check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) [ $# -ge 2 ] || usage; cuda="$2"; shift 2 ;;
    --npu) cuda=npu; shift ;;
    --check) check=1; shift ;;
    *) usage ;;
  esac
done
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tms"
case "$cuda" in
  13) req="$root/tests/torch-consumers/requirements.txt"; venv="${TMS_TORCH_VENV:-$cache/torch-venv}" ;;
  12) req="$root/tests/torch-consumers/requirements-cu12.txt"; venv="${TMS_TORCH12_VENV:-$cache/torch-venv-cu12}" ;;
  npu) req="$root/tests/torch-consumers/requirements-npu.txt"; venv="${TMS_TORCH_NPU_VENV:-$cache/torch-venv-npu}" ;;
  *) echo "torch-env: --cuda takes 12 or 13, not '$cuda'" >&2; exit 2 ;;
esac
. "$root/scripts/pinned-venv.sh"
# The NPU file pins every package (torch_npu's own requirement, torch==2.9.1+cpu, is not on the index).
no_deps=()
[ "$cuda" = npu ] && no_deps=(--no-deps)
pinned_venv torch-env "$req" "$venv" "$check" " (about 3 GB the first time)" \
  " Set TMS_TORCH_TESTS=0 to skip the real-consumer tests." "${no_deps[@]}"
