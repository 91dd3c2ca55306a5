# Sourced by torch-env.sh and ray-env.sh: a cached virtual environment holding the pinned
# packages of one requirements file, created once and reused while the pins stay the same.
#
#   pinned_venv TOOL REQUIREMENTS VENV CHECK SIZE_NOTE FAIL_HINT [PIP_OPTION...]
#
# PIP_OPTIONs go to pip install (--no-deps for a file that pins every package itself).
#
# CHECK=1: exit 0 if the environment is ready, 1 if not (no install). Otherwise install if needed
# (progress on stderr) and print the environment's python on stdout.
pinned_venv() {
  local tool="$1" req="$2" venv="$3" check="$4" size_note="$5" fail_hint="$6"
  shift 6
  local stamp="$venv/.tms-requirements" py="$venv/bin/python"
  ready() { [ -x "$py" ] && [ -f "$stamp" ] && cmp -s "$req" "$stamp"; }
  if [ "$check" = 1 ]; then
    ready && exit 0 || exit 1
  fi
  mkdir -p "$(dirname "$venv")"
  # One installer at a time (test binaries run in parallel); the others wait and reuse its work.
  exec 9>"$venv.lock"
  flock 9
  if ! ready; then
    command -v python3 >/dev/null || { echo "$tool: python3 is required" >&2; exit 1; }
    if [ ! -x "$py" ]; then
      echo "$tool: creating $venv" >&2
      python3 -m venv "$venv" >&2 || {
        echo "$tool: python3 -m venv failed; install the venv module (Debian: apt-get install python3-venv)" >&2
        exit 1
      }
    fi
    echo "$tool: installing $(grep -cv '^#' "$req") pinned package(s) into $venv$size_note" >&2
    "$py" -m pip install --disable-pip-version-check --progress-bar off -q "$@" -r "$req" >&2 || {
      echo "$tool: pip install failed (is the package index reachable?).$fail_hint" >&2
      exit 1
    }
    cp "$req" "$stamp"
  fi
  echo "$py"
}
