#!/usr/bin/env bash
# The Ascend kit: the same kit as gpu-check.sh, run through ACL on a machine with CANN (8 or 9)
# and an Ascend NPU (source CANN's set_env.sh first):
#   scripts/npu-check.sh prepare [--arch aarch64|x86_64] DIR
#                                             the same as gpu-check.sh prepare; Ascend hosts are
#                                             mostly Kunpeng (aarch64): pass --arch aarch64 when
#                                             preparing on an x86_64 machine
#   DIR/npu-check.sh run DIR OUTDIR           the C consumers through ACL, the colocated run and the bench on the NPU
#   DIR/npu-check.sh run --sim DIR OUTDIR     a dry run on the simulator's ACL side (what CI runs)
# Writes OUTDIR/summary.md and summary.json; send them back (docs/hardware.md says how).
here="$(cd "$(dirname "$0")" && pwd)"
case "${1:-}" in
  run) shift; exec "$here/gpu-check.sh" run --npu "$@" ;;
  -h|--help|"") sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; [ -n "${1:-}" ] || exit 2 ;;
  *) exec "$here/gpu-check.sh" "$@" ;;
esac
