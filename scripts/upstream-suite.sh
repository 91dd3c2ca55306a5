#!/usr/bin/env bash
# Runs torch_memory_saver's own test suite (test/test_examples.py and
# test/test_configure_subprocess.py, unchanged) on the simulator, with real PyTorch, in three
# variants: "upstream" (torch_memory_saver 0.0.10 whole), "ours" (upstream's Python package with
# libtms_hook.so under its library names) and "wheel" (the tms-memory-saver wheel, built by
# scripts/build-wheel.sh and installed with pip: our Python package and hook). Two simulated
# devices, so the multi-device tests run.
#
# The suite's scenarios (test/examples/) are not in the package index's sdist, so this needs a
# checkout of the upstream repository: SRC is its root (the folder holding test/).
#
# Usage: scripts/upstream-suite.sh SRC [upstream|ours|wheel|both|all] [-- PYTEST_ARGS...]
#        (both: upstream and ours; all, the default: the three)
# Prints pytest's summary per variant; exits non-zero if any variant has failures.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
src="${1:?usage: scripts/upstream-suite.sh SRC [upstream|ours|wheel|both|all] [-- PYTEST_ARGS...]}"
shift
which=all
if [ $# -gt 0 ] && [ "$1" != -- ]; then which="$1"; shift; fi
[ "${1:-}" = -- ] && shift
[ -f "$src/test/test_examples.py" ] && [ -d "$src/test/examples" ] || {
  echo "upstream-suite: $src/test/test_examples.py or $src/test/examples/ is missing (SRC is a torch_memory_saver checkout)" >&2
  exit 2
}
case "$which" in upstream|ours|wheel|both|all) ;; *) echo "upstream-suite: variant must be upstream, ours, wheel, both or all" >&2; exit 2 ;; esac
wants() { [ "$which" = "$1" ] || [ "$which" = all ] || { [ "$which" = both ] && [ "$1" != wheel ]; }; }

py="$("$root/scripts/torch-env.sh")"
(cd "$root" && cargo build --quiet -p tms-sim -p tms-hook)
target="${CARGO_TARGET_DIR:-$root/target}/debug"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
eval "$("$target/tms-sim" env --devices 2 --memory 16GiB --node "upstream-suite-$$")"
export TMS_SIM_DIR="$work"

# Ours: upstream's Python package, unchanged, next to libraries that are our hook.
mkdir -p "$work/ours"
cp -R "$site/torch_memory_saver" "$work/ours/"
for lib in "$site"/torch_memory_saver_hook_mode_*.abi3.so; do
  ln -s "$target/libtms_hook.so" "$work/ours/$(basename "$lib")"
done

status=0
run() {
  local name="$1" extra_path="$2"
  shift 2
  echo "== torch_memory_saver's suite with $name libraries"
  local start=$SECONDS
  (cd "$src/test" && PYTHONPATH="$extra_path${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" -m pytest -q -p no:cacheprovider -rfEs test_examples.py test_configure_subprocess.py "$@") \
    || status=1
  echo "== $name: $((SECONDS - start)) s"
}
if wants wheel; then
  wheel="$("$root/scripts/build-wheel.sh" "$work/dist")"
  "$py" -m pip install --disable-pip-version-check -q --no-deps --no-index --target "$work/wheel" "$wheel"
fi
wants upstream && run upstream "" "$@"
wants ours && run ours "$work/ours" "$@"
wants wheel && run wheel "$work/wheel" "$@"
exit $status
