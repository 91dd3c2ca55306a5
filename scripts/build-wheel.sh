#!/usr/bin/env bash
# Builds the tms-memory-saver wheel (pyproject.toml, setup.py) into OUTDIR (default: dist/) and
# prints its path. The Rust parts are linked against glibc 2.17 with cargo-zigbuild, so the wheel
# is manylinux2014 like torch_memory_saver's own (Ubuntu 20.04, EL7/EL8, openEuler); the script
# refuses to finish if any library or program in it needs a newer glibc symbol.
#
# Tools (setuptools-rust, cargo-zigbuild with ziglang; scripts/build-requirements.txt) are
# installed once into $TMS_BUILD_VENV (default ${XDG_CACHE_HOME:-~/.cache}/tms/build-venv, about
# 450 MB). Cargo output goes to $TMS_WHEEL_TARGET_DIR (default $CARGO_TARGET_DIR/wheel, target/wheel).
# Usage: scripts/build-wheel.sh [OUTDIR]
# Exit: 0 built and checked; 1 a tool or the build failed; 2 usage; 3 a glibc symbol above 2.17.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; -*) echo "build-wheel.sh: unknown option $1" >&2; exit 2 ;; esac
[ $# -le 1 ] || { echo "usage: scripts/build-wheel.sh [OUTDIR]" >&2; exit 2; }
out="$(mkdir -p "${1:-$root/dist}" && cd "${1:-$root/dist}" && pwd)"
req="$root/scripts/build-requirements.txt"
venv="${TMS_BUILD_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tms/build-venv}"
py="$venv/bin/python"

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ! { [ -x "$py" ] && cmp -s "$req" "$venv/.tms-requirements"; }; then
  [ -x "$py" ] || python3 -m venv "$venv" >&2 || {
    echo "build-wheel: python3 -m venv failed; install the venv module (Debian: apt-get install python3-venv)" >&2
    exit 1
  }
  echo "build-wheel: installing the build tools into $venv" >&2
  "$py" -m pip install --disable-pip-version-check --progress-bar off -q -r "$req" >&2 || {
    echo "build-wheel: pip install failed (is the package index reachable?)" >&2
    exit 1
  }
  cp "$req" "$venv/.tms-requirements"
fi

# cargo-zigbuild runs `python3 -m ziglang`: the build environment's python has it.
export PATH="$venv/bin:$PATH"
export CARGO="$venv/bin/cargo-zigbuild"
export CARGO_BUILD_TARGET=x86_64-unknown-linux-gnu.2.17
export CARGO_TARGET_DIR="${TMS_WHEEL_TARGET_DIR:-${CARGO_TARGET_DIR:-$root/target}/wheel}"
build="$(mktemp -d)"
trap 'rm -rf "$build"' EXIT
# pip builds in the checkout; setuptools leaves build/ and an egg-info behind, removed below.
"$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -q -w "$build" "$root" >&2 || {
  echo "build-wheel: the wheel build failed (output above)" >&2
  exit 1
}
rm -rf "$root/build" "$root"/python/*.egg-info
wheel="$(ls "$build"/tms_memory_saver-*.whl)"

# Every ELF file in the wheel: no symbol version above GLIBC_2.17.
"$py" - "$wheel" <<'PY' >&2 || exit 3
import subprocess, sys, tempfile, zipfile, re
bad = []
with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        path = z.extract(name, d)
        with open(path, "rb") as f:
            if f.read(4) != b"\x7fELF":
                continue
        syms = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
        versions = sorted({tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", syms)})
        top = ".".join(map(str, versions[-1])) if versions else "none"
        print(f"build-wheel: {name}: highest glibc symbol version {top}")
        if versions and versions[-1] > (2, 17):
            bad.append(name)
if bad:
    print(f"build-wheel: needs a glibc newer than 2.17: {bad}", file=sys.stderr)
    sys.exit(1)
PY
mv -f "$wheel" "$out/"
echo "$out/$(basename "$wheel")"
