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
. "$root/scripts/pinned-venv.sh"
pinned_venv ray-env "$req" "$venv" "$check" " (about 250 MB the first time)" ""
