#!/usr/bin/env bash
# Builds the tms-memory-saver wheel (pyproject.toml, setup.py) into OUTDIR (default: dist/) and
# prints its path, one line per architecture. The Rust parts are linked against glibc 2.17 with
# cargo-zigbuild, so the wheel is manylinux2014 like torch_memory_saver's own (Ubuntu 20.04,
# EL7/EL8, openEuler, Kylin): tms_memory_saver-*-manylinux2014_x86_64.whl for x86_64 hosts,
# tms_memory_saver-*-manylinux2014_aarch64.whl for aarch64 ones (Kunpeng + Ascend, Grace). The
# script refuses to finish if any library or program in it is for another architecture or needs a
# newer glibc symbol.
#
# --arch x86_64|aarch64|all   what to build for (default: this machine's, uname -m). Another
#                             architecture needs no cross compiler (zig links it); its Rust
#                             target is added with rustup when missing.
#
# Tools (setuptools-rust, cargo-zigbuild with ziglang; scripts/build-requirements.txt) are
# installed once into $TMS_BUILD_VENV (default ${XDG_CACHE_HOME:-~/.cache}/tms/build-venv, about
# 450 MB). Cargo output goes to $TMS_WHEEL_TARGET_DIR (default $CARGO_TARGET_DIR/wheel, target/wheel).
# Usage: scripts/build-wheel.sh [--arch x86_64|aarch64|all] [OUTDIR]
# Exit: 0 built and checked; 1 a tool or the build failed; 2 usage; 3 an ELF file for another
# architecture or with a glibc symbol above 2.17.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage="usage: scripts/build-wheel.sh [--arch x86_64|aarch64|all] [OUTDIR]"
host_arch() { case "$(uname -m)" in arm64|aarch64) echo aarch64 ;; *) uname -m ;; esac; }
arch="$(host_arch)"
outarg=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --arch) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; arch="$2"; shift 2 ;;
    --arch=*) arch="${1#--arch=}"; shift ;;
    -*) echo "build-wheel.sh: unknown option $1" >&2; echo "$usage" >&2; exit 2 ;;
    *) [ -z "$outarg" ] || { echo "$usage" >&2; exit 2; }; outarg="$1"; shift ;;
  esac
done
case "$arch" in
  x86_64|aarch64) arches=("$arch") ;;
  all) arches=(x86_64 aarch64) ;;
  *) echo "build-wheel.sh: --arch must be x86_64, aarch64 or all (not '$arch')" >&2; exit 2 ;;
esac
out="$(mkdir -p "${outarg:-$root/dist}" && cd "${outarg:-$root/dist}" && pwd)"
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
export CARGO_TARGET_DIR="${TMS_WHEEL_TARGET_DIR:-${CARGO_TARGET_DIR:-$root/target}/wheel}"
build="$(mktemp -d)"
trap 'rm -rf "$build"; rm -rf "$root/build" "$root"/python/*.egg-info' EXIT

# The Rust standard library for TRIPLE, added with rustup when it is missing.
ensure_rust_target() {
  local triple="$1"
  if command -v rustup >/dev/null; then
    rustup target list --installed 2>/dev/null | grep -qx "$triple" && return 0
    echo "build-wheel: adding the Rust target $triple (rustup target add)" >&2
    rustup target add "$triple" >&2 && return 0
    echo "build-wheel: rustup target add $triple failed; without it there is no $triple wheel (is the network reachable?)" >&2
    return 1
  fi
  # No rustup: a toolchain installed otherwise may still carry the target.
  [ -d "$(rustc --print sysroot)/lib/rustlib/$triple" ] && return 0
  echo "build-wheel: the Rust standard library for $triple is missing and rustup is not here to add it; install the target with your toolchain's installer" >&2
  return 1
}

for a in "${arches[@]}"; do
  triple="$a-unknown-linux-gnu"
  ensure_rust_target "$triple" || exit 1
  export CARGO_BUILD_TARGET="$triple.2.17"
  rm -rf "$root/build" "$root"/python/*.egg-info "$build"/*.whl
  # pip builds in the checkout; setuptools leaves build/ and an egg-info behind, removed on exit.
  "$py" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -q -w "$build" "$root" >&2 || {
    echo "build-wheel: the $a wheel build failed (output above)" >&2
    exit 1
  }
  wheel="$(ls "$build"/tms_memory_saver-*.whl)"
  case "$wheel" in
    *-manylinux2014_"$a".whl) ;;
    *) echo "build-wheel: $wheel is not tagged manylinux2014_$a" >&2; exit 3 ;;
  esac

  # Every ELF file in the wheel: built for this architecture, no symbol version above GLIBC_2.17.
  "$py" - "$wheel" "$a" <<'PY' >&2 || exit 3
import re, struct, subprocess, sys, tempfile, zipfile
wheel, arch = sys.argv[1:]
# ELF e_machine values (System V ABI): EM_X86_64 and EM_AARCH64.
machines = {62: "x86_64", 183: "aarch64"}
bad = []
with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        path = z.extract(name, d)
        with open(path, "rb") as f:
            head = f.read(20)
        if head[:4] != b"\x7fELF":
            continue
        machine = machines.get(struct.unpack_from("<H", head, 18)[0], "unknown")
        syms = subprocess.run(["objdump", "-T", path], capture_output=True, text=True, check=True).stdout
        versions = sorted({tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", syms)})
        top = ".".join(map(str, versions[-1])) if versions else "none"
        print(f"build-wheel: {name}: {machine}, highest glibc symbol version {top}")
        if machine != arch:
            bad.append(f"{name} is {machine}, not {arch}")
        if versions and versions[-1] > (2, 17):
            bad.append(f"{name} needs glibc {top} (above 2.17)")
if bad:
    print("build-wheel: the wheel does not fit manylinux2014_" + arch + ": " + "; ".join(bad), file=sys.stderr)
    sys.exit(1)
PY
  mv -f "$wheel" "$out/"
  echo "$out/$(basename "$wheel")"
done
