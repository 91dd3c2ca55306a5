#!/usr/bin/env bash
# Creates (once) and prints the path of the Python that the real-consumer tests use: a virtual
# environment holding the pinned packages of tests/torch-consumers/requirements.txt (PyTorch's CUDA 13.2
# build, torch_memory_saver 0.0.10, ...). About 3 GB is downloaded the first time (a few minutes);
# later runs reuse the environment and download nothing while the pins stay the same.
# `--cuda 12` does the same for requirements-cu12.txt (PyTorch 2.9.1, built for CUDA 12.8) in its own
# environment, so the simulator is also proven under the CUDA 12 runtime's callers.
#
# Where: $TMS_TORCH_VENV, else ${XDG_CACHE_HOME:-~/.cache}/tms/torch-venv (torch-venv-cu12 for --cuda 12;
#        $TMS_TORCH12_VENV overrides that one).
# Usage: scripts/torch-env.sh [--cuda 12|13]            prints the environment's python on stdout
#                                                       (progress on stderr)
#        scripts/torch-env.sh [--cuda 12|13] --check    exits 0 if the environment is ready, 1 if not
#                                                       (no install)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage() { echo "usage: scripts/torch-env.sh [--cuda 12|13] [--check]" >&2; exit 2; }
cuda=13
check=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) [ $# -ge 2 ] || usage; cuda="$2"; shift 2 ;;
    --check) check=1; shift ;;
    *) usage ;;
  esac
done
cache="${XDG_CACHE_HOME:-$HOME/.cache}/tms"
case "$cuda" in
  13) req="$root/tests/torch-consumers/requirements.txt"; venv="${TMS_TORCH_VENV:-$cache/torch-venv}" ;;
  12) req="$root/tests/torch-consumers/requirements-cu12.txt"; venv="${TMS_TORCH12_VENV:-$cache/torch-venv-cu12}" ;;
  *) echo "torch-env: --cuda takes 12 or 13, not '$cuda'" >&2; exit 2 ;;
esac
. "$root/scripts/pinned-venv.sh"
pinned_venv torch-env "$req" "$venv" "$check" " (about 3 GB the first time)" \
  " Set TMS_TORCH_TESTS=0 to skip the real-consumer tests."
