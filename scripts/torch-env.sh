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
stamp="$venv/.tms-requirements"
py="$venv/bin/python"

ready() { [ -x "$py" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp"; }

if [ "$check" = 1 ]; then
  ready && exit 0 || exit 1
fi

mkdir -p "$(dirname "$venv")"
# One installer at a time (test binaries run in parallel); the others wait and reuse its work.
exec 9>"$venv.lock"
flock 9
if ! ready; then
  command -v python3 >/dev/null || { echo "torch-env: python3 is required" >&2; exit 1; }
  if [ ! -x "$py" ]; then
    echo "torch-env: creating $venv" >&2
    python3 -m venv "$venv" >&2 || {
      echo "torch-env: python3 -m venv failed; install the venv module (Debian: apt-get install python3-venv)" >&2
      exit 1
    }
  fi
  echo "torch-env: installing $(grep -cv '^#' "$req") pinned packages into $venv (about 3 GB the first time)" >&2
  "$py" -m pip install --disable-pip-version-check --progress-bar off -q -r "$req" >&2 || {
    echo "torch-env: pip install failed (is the package index reachable?). Set TMS_TORCH_TESTS=0 to skip the real-consumer tests." >&2
    exit 1
  }
  cp "$req" "$stamp"
fi
echo "$py"
