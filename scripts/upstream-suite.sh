#!/usr/bin/env bash
# Runs torch_memory_saver's own test suite, unchanged, on the simulator with real PyTorch, in
# three variants: "upstream" (torch_memory_saver 0.0.10 whole), "ours" (upstream's Python package
# with libtms_hook.so under its library names) and "wheel" (the tms-memory-saver wheel, built by
# scripts/build-wheel.sh, or $TMS_UPSTREAM_WHEEL, and installed with pip: our Python package and
# hook). Two simulated devices, so the multi-device tests run.
#
# SRC is where the suite comes from:
#   a checkout of the upstream repository (the folder holding test/): test_examples.py and
#     test_configure_subprocess.py. The scenarios of test_examples.py (test/examples/) are only
#     in the repository.
#   --sdist: the pinned source distribution from the package index
#     (tests/torch-consumers/upstream-sdist.txt, checked by hash, cached in
#     ${XDG_CACHE_HOME:-~/.cache}/tms/upstream-sdist): test_configure_subprocess.py and
#     test_utils.py, the files that run without test/examples/. This is what CI runs.
#
# Usage: scripts/upstream-suite.sh SRC|--sdist [upstream|ours|wheel|both|all] [-- PYTEST_ARGS...]
#        (both: upstream and ours; all, the default: the three)
# Prints pytest's summary per variant; exits 1 if any variant has failures, 2 on bad usage.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
usage="usage: scripts/upstream-suite.sh SRC|--sdist [upstream|ours|wheel|both|all] [-- PYTEST_ARGS...]"
case "${1:-}" in -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; '') echo "$usage" >&2; exit 2 ;; esac
src="$1"
shift
which=all
if [ $# -gt 0 ] && [ "$1" != -- ]; then which="$1"; shift; fi
[ "${1:-}" = -- ] && shift
case "$which" in upstream|ours|wheel|both|all) ;; *) echo "upstream-suite: variant must be upstream, ours, wheel, both or all" >&2; exit 2 ;; esac
wants() { [ "$which" = "$1" ] || [ "$which" = all ] || { [ "$which" = both ] && [ "$1" != wheel ]; }; }

py="$("$root/scripts/torch-env.sh")"

if [ "$src" = --sdist ]; then
  pins="$root/tests/torch-consumers/upstream-sdist.txt"
  cache="${XDG_CACHE_HOME:-$HOME/.cache}/tms/upstream-sdist"
  mkdir -p "$cache"
  exec 8>"$cache.lock"
  flock 8
  if ! cmp -s "$pins" "$cache/.tms-pins"; then
    rm -rf "$cache/dl" "$cache/src"
    echo "upstream-suite: downloading the pinned torch_memory_saver sdist into $cache" >&2
    # Its setup.py refuses to describe itself without a CUDA major; 13 matches the pinned torch.
    TMS_CUDA_MAJOR=13 "$py" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
      --no-build-isolation --require-hashes -r "$pins" -d "$cache/dl" >&2 || {
      echo "upstream-suite: could not download the sdist (is the package index reachable?)" >&2
      exit 1
    }
    mkdir -p "$cache/src"
    tar -xzf "$cache"/dl/torch_memory_saver-*.tar.gz -C "$cache/src" --strip-components=1
    cp "$pins" "$cache/.tms-pins"
  fi
  exec 8>&-
  src="$cache/src"
fi
[ -d "$src/test" ] || { echo "upstream-suite: $src/test is missing (SRC is a torch_memory_saver checkout, or --sdist)" >&2; exit 2; }
tests=()
if [ -d "$src/test/examples" ]; then
  tests+=(test_examples.py test_configure_subprocess.py)
else
  [ -f "$src/test/test_examples.py" ] && echo "upstream-suite: $src/test/examples/ is missing: test_examples.py cannot run from here" >&2
  tests+=(test_configure_subprocess.py test_utils.py)
fi
for t in "${tests[@]}"; do
  [ -f "$src/test/$t" ] || { echo "upstream-suite: $src/test/$t is missing" >&2; exit 2; }
done
(cd "$root" && cargo build --quiet -p tms-sim -p tms-hook)
target="${CARGO_TARGET_DIR:-$root/target}/debug"
site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
eval "$("$target/tms-sim" env --devices 2 --memory 16GiB --node "upstream-suite-$$" --dir "$work")"
# The suite compares float32 means of up to 10^9 elements with `==`: a GPU's reduction tree gives
# the exact value, the CPU's float32 summation 101.000015. Sums and means add in float64 here
# (tms-sim/python/tms_sim_torch/_wide.py); TMS_SIM_WIDE_REDUCTIONS=0 gives the CPU's numbers.
export TMS_SIM_WIDE_REDUCTIONS="${TMS_SIM_WIDE_REDUCTIONS:-1}"

# Ours: upstream's Python package, unchanged, next to libraries that are our hook.
mkdir -p "$work/ours"
cp -R "$site/torch_memory_saver" "$work/ours/"
for lib in "$site"/torch_memory_saver_hook_mode_*.abi3.so; do
  ln -s "$target/libtms_hook.so" "$work/ours/$(basename "$lib")"
done

# The suite runs from a private copy, so neither a checkout nor the cache is written to.
cp -R "$src/test" "$work/suite"
export PYTHONDONTWRITEBYTECODE=1

status=0
run() {
  local name="$1" extra_path="$2"
  shift 2
  echo "== torch_memory_saver's suite with $name libraries"
  # A variant that silently imported another variant's package would prove nothing.
  local loaded
  loaded="$(cd "$work/suite" && PYTHONPATH="$extra_path${PYTHONPATH:+:$PYTHONPATH}" "$py" -c \
    'import os, torch_memory_saver as m; print(os.path.dirname(os.path.dirname(os.path.realpath(m.__file__))))')"
  if [ "$loaded" != "$(realpath "${extra_path:-$site}")" ]; then
    echo "upstream-suite: the $name variant imported torch_memory_saver from $loaded, not ${extra_path:-$site}" >&2
    status=1
    return
  fi
  local start=$SECONDS
  (cd "$work/suite" && PYTHONPATH="$extra_path${PYTHONPATH:+:$PYTHONPATH}" \
    "$py" -m pytest -q -p no:cacheprovider -rfEs "${tests[@]}" "$@") \
    || status=1
  echo "== $name: $((SECONDS - start)) s"
}
if wants wheel; then
  wheel="${TMS_UPSTREAM_WHEEL:-}"
  [ -n "$wheel" ] || wheel="$("$root/scripts/build-wheel.sh" "$work/dist")"
  "$py" -m pip install --disable-pip-version-check -q --no-deps --no-index --target "$work/wheel" "$wheel"
fi
wants upstream && run upstream "" "$@"
wants ours && run ours "$work/ours" "$@"
wants wheel && run wheel "$work/wheel" "$@"
exit $status
