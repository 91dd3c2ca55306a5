#!/usr/bin/env bash
# Creates (once) and prints the path of the Python that `relax-colocate run --launcher ray` uses: a
# virtual environment holding the pinned Ray of scripts/ray-requirements.txt (about 250 MB
# downloaded the first time; later runs reuse it while the pin stays the same).
#
# Where: $TMS_RAY_VENV, else ${XDG_CACHE_HOME:-~/.cache}/tms/ray-venv.
# Usage: scripts/ray-env.sh            prints the environment's python on stdout (progress on stderr)
#        scripts/ray-env.sh --check    exits 0 if the environment is ready, 1 if not (no install)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: scripts/ray-env.sh [--check]" >&2; exit 2 ;;
esac
req="$root/scripts/ray-requirements.txt"
venv="${TMS_RAY_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tms/ray-venv}"
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
  command -v python3 >/dev/null || { echo "ray-env: python3 is required" >&2; exit 1; }
  if [ ! -x "$py" ]; then
    echo "ray-env: creating $venv" >&2
    python3 -m venv "$venv" >&2 || {
      echo "ray-env: python3 -m venv failed; install the venv module (Debian: apt-get install python3-venv)" >&2
      exit 1
    }
  fi
  echo "ray-env: installing $(grep -cv '^#' "$req") pinned package(s) into $venv" >&2
  "$py" -m pip install --disable-pip-version-check --progress-bar off -q -r "$req" >&2 || {
    echo "ray-env: pip install failed (is the package index reachable?)" >&2
    exit 1
  }
  cp "$req" "$stamp"
fi
echo "$py"
