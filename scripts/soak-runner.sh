#!/usr/bin/env bash
# Soak benchmark (not a test): `relax-colocate run` for STEPS steps on the simulator, printing the
# runner's resident memory every EVERY steps. A runner that keeps per-step state grows linearly;
# one that streams it to its run directory stays flat.
#
#   scripts/soak-runner.sh [STEPS=10000] [EVERY=500] [RUN ARGS...]   (RELAX_COLOCATE=path picks the binary)
#
# RUN ARGS go to `relax-colocate run` (e.g. `--set rollout.prompts_per_step=4`: a smaller batch
# changes the workers' compute, not what the runner keeps per step).
set -euo pipefail
steps=${1:-10000}
every=${2:-500}
shift $(( $# < 2 ? $# : 2 ))
bin=${RELAX_COLOCATE:-target/release/relax-colocate}
out=$(mktemp -d)
"$bin" run --device sim --quiet --steps "$steps" --out "$out" "$@" >/dev/null &
pid=$!
trap 'kill "$pid" 2>/dev/null || true; rm -rf "$out"' EXIT
next=$every
printf 'step\trunner_rss_kib\n'
while kill -0 "$pid" 2>/dev/null; do
    n=0
    [ -f "$out/metrics.jsonl" ] && n=$(wc -l <"$out/metrics.jsonl")
    if [ "$n" -ge "$next" ]; then
        printf '%s\t%s\n' "$n" "$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo gone)"
        next=$((next + every))
    fi
    sleep 0.2
done
wait "$pid"
