#!/usr/bin/env bash
# Installs tms into PREFIX:
#   PREFIX/lib/libtms_hook.so            the hook (LD_PRELOAD it, or load it in torch mode)
#   PREFIX/lib/torch_memory_saver_hook_mode_{preload,preload_cu12,preload_cu13,torch_cu12,torch_cu13}.abi3.so
#                                        the file names torch_memory_saver's Python side looks for,
#                                        linked to libtms_hook.so
#   PREFIX/lib/libtms_sim.so             the simulator (tms-sim env points programs at it)
#   PREFIX/lib/tms-sim/python            its Python start-up hook (runs PyTorch on the simulator)
#   PREFIX/include/tms.h, tms_sim.h
#   PREFIX/bin/tms-ctl, tms-sim, relax-colocate
#   PREFIX/lib/python/{tms,torch_memory_saver}
#                                        the Python packages (PYTHONPATH=PREFIX/lib/python; the
#                                        wheel, scripts/build-wheel.sh, installs them with pip)
#   PREFIX/lib/python/relax_worker.py    relax-colocate's worker-protocol client, for workers it
#                                        does not start itself (it puts its own copy on the
#                                        PYTHONPATH of those it does); not in the wheel
#   PREFIX/lib/python/relax_compute_model.json
#                                        the compute model's figures, beside the client (where
#                                        torch_worker.py reads them)
#   PREFIX/share/tms/workers/            example_worker.py, torch_worker.py (--trainer-cmd ...)
#   PREFIX/share/man/man1/               tms-ctl.1, tms-sim.1, relax-colocate.1 (from the programs' own --help)
#   PREFIX/share/bash-completion/completions/  tms-ctl, relax-colocate
#   PREFIX/lib/debug/*.debug             the binaries' debug info, split off (they keep a
#                                        .gnu_debuglink to it, so gdb and perf find it)
# Usage: scripts/install.sh [--profile release|debug] [--no-build] [--keep-debug] PREFIX
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
profile=release
build=1
split_debug=1
prefix=""
while [ $# -gt 0 ]; do
  case "$1" in
    --profile) profile="${2:?--profile needs release or debug}"; shift 2 ;;
    --no-build) build=0; shift ;;
    --keep-debug) split_debug=0; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) [ -z "$prefix" ] || { echo "install.sh: one PREFIX only" >&2; exit 2; }; prefix="$1"; shift ;;
  esac
done
[ -n "$prefix" ] || { echo "usage: scripts/install.sh [--profile release|debug] [--no-build] [--keep-debug] PREFIX" >&2; exit 2; }
case "$profile" in release|debug) ;; *) echo "install.sh: --profile must be release or debug" >&2; exit 2 ;; esac

if [ "$build" = 1 ]; then
  flag=(); [ "$profile" = release ] && flag=(--release)
  (cd "$root" && cargo build "${flag[@]}" -p tms-hook -p tms-sim -p tms-ctl -p relax-colocate)
fi
out="${CARGO_TARGET_DIR:-$root/target}/$profile"
for f in libtms_hook.so libtms_sim.so tms-ctl tms-sim relax-colocate; do
  [ -e "$out/$f" ] || { echo "install.sh: $out/$f is missing; build first (or drop --no-build)" >&2; exit 1; }
done

mkdir -p "$prefix/lib" "$prefix/include" "$prefix/bin" "$prefix/lib/python"
install -m 0755 "$out/libtms_hook.so" "$out/libtms_sim.so" "$prefix/lib/"
install -m 0755 "$out/tms-ctl" "$out/tms-sim" "$out/relax-colocate" "$prefix/bin/"
install -m 0644 "$root/include/tms.h" "$root/include/tms_sim.h" "$prefix/include/"
# Debug info is most of each file (the release hook: 15.5 MB with it, 2.0 MB without); it goes
# beside, not away, so a crash in someone's training job can still be read. Exported symbols stay.
if [ "$split_debug" = 1 ]; then
  if command -v objcopy >/dev/null; then
    mkdir -p "$prefix/lib/debug"
    for f in lib/libtms_hook.so lib/libtms_sim.so bin/tms-ctl bin/tms-sim bin/relax-colocate; do
      debug="$prefix/lib/debug/$(basename "$f").debug"
      objcopy --only-keep-debug "$prefix/$f" "$debug"
      chmod 0644 "$debug"
      objcopy --strip-debug --add-gnu-debuglink="$debug" "$prefix/$f"
    done
  else
    echo "install.sh: objcopy (binutils) not found: binaries installed with their debug info" >&2
  fi
fi
for mode in preload preload_cu12 preload_cu13 torch_cu12 torch_cu13; do
  ln -sfn libtms_hook.so "$prefix/lib/torch_memory_saver_hook_mode_${mode}.abi3.so"
done
for pkg in tms torch_memory_saver; do
  rm -rf "$prefix/lib/python/$pkg"
  cp -R "$root/python/$pkg" "$prefix/lib/python/$pkg"
  find "$prefix/lib/python/$pkg" -name '__pycache__' -prune -exec rm -rf {} +
done
mkdir -p "$prefix/share/man/man1"
for b in tms-ctl tms-sim relax-colocate; do
  "$prefix/bin/$b" man >"$prefix/share/man/man1/$b.1"
done
# Shell completions of the two command-line tools people type (bash; zsh and fish: `TOOL
# completions zsh|fish`).
mkdir -p "$prefix/share/bash-completion/completions"
for b in tms-ctl relax-colocate; do
  "$prefix/bin/$b" completions bash >"$prefix/share/bash-completion/completions/$b"
done
install -m 0644 "$root/relax-colocate/python/relax_worker.py" "$prefix/lib/python/"
install -m 0644 "$root/relax-colocate/python/relax_compute_model.json" "$prefix/lib/python/"
mkdir -p "$prefix/share/tms/workers"
install -m 0755 "$root/scripts/example_worker.py" "$root/scripts/torch_worker.py" "$prefix/share/tms/workers/"
# The simulator's Python start-up hook and CPU compute layer (tms-sim env puts it on PYTHONPATH).
rm -rf "$prefix/lib/tms-sim/python"
mkdir -p "$prefix/lib/tms-sim"
cp -R "$root/tms-sim/python" "$prefix/lib/tms-sim/python"
rm -rf "$prefix/lib/tms-sim/python/tests"
find "$prefix/lib/tms-sim/python" -name '__pycache__' -prune -exec rm -rf {} +

cat <<MSG
tms installed in $prefix
  existing torch_memory_saver code:  LD_PRELOAD=$prefix/lib/torch_memory_saver_hook_mode_preload.abi3.so
  native name:                       LD_PRELOAD=$prefix/lib/libtms_hook.so
  Python packages (tms, torch_memory_saver): PYTHONPATH=$prefix/lib/python  (or the wheel: scripts/build-wheel.sh)
  control:                           $prefix/bin/tms-ctl list
  PyTorch workers for relax-colocate run: --trainer-cmd "python3 $prefix/share/tms/workers/torch_worker.py"
MSG
