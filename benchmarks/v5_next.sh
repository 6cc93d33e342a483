#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   Both cards: the opt-in radix scatter (session 45, `V5Config(scatter="radix")`),
#   written and compiled for sm_90 here but never run on a GPU before: timed at 2^26 ids
#   at W = 1024, 256, 64, 2048 next to the card's table, then checked bitwise.
#   Deferred: session 44's H200 small-W A/B (`ab` below; `dispatch_v5_candidate_h200_d4ce341.json`
#   has the one run: 0.968 against 1.030 ms at W = 256 for the 4096-id config with int16
#   snapshots, 0.867 against 0.901 at W = 128 for the 8192-id config, 0.774 against
#   0.777 at W = 64 for the 2048-id one, to be timed twice before the H200 table changes).
#   Earlier calls: session 43 ran the H100 figure (`kernels_h100_d37773f.json`); session
#   42 timed `early_loads` (`dispatch_v5_early_h100_0f2871b.json`: no effect; reverted)
#   and the H100's small-W table (`dispatch_v5_smallw_h100_75402d3.json`); session 41
#   (`dispatch_v5_ballot_persist_h100_4ad8887.json`) two options since reverted; session
#   40 (`dispatch_v5_diagskip_h100_b96ca4f.json`) the scatter without its stores.
#
# Usage (on the GPU machine, repository root; DRY=1 prints the steps instead):
#
#     OUT=DIR GIT_SHA=SHA bash benchmarks/v5_next.sh
#
# `bash benchmarks/v5_next.sh extract SHA` (here, before the call) writes SHA's src tree
# to _ab/SHA/src, which travels with the working tree (untracked): session 37 timed a
# base tree and this one in one call with PYTHONPATH=_ab/SHA/src for the first run.
#
# Each step has its own time limit and prints its exit status; the script's status is 1
# when any failed. Results land under DIR (radix_ab/, radix_check/, *.log).
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = extract ]; then
  rm -rf _ab && mkdir -p "_ab/$2" && git archive "$2" src | tar -x -C "_ab/$2" && ls "_ab/$2/src"
  exit $?
fi
OUT=${OUT:?set OUT}
SHA=${GIT_SHA:?set GIT_SHA (the device copy's .git is not the checkout's)}
CARD=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)}
echo "card: ${CARD:-none}"
fail=0
step() { # step SECONDS LOG CMD...: run CMD under a time limit into LOG, record a failure
  local limit=$1 log=$2
  shift 2
  if [ -n "${DRY:-}" ]; then
    echo "would run (${limit} s, > $log): ${FREESCALE_V5_TABLE:+FREESCALE_V5_TABLE=$FREESCALE_V5_TABLE }$*"
    return
  fi
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "step rc=$rc: $*"
  grep -E "W=|passed|failed|MISMATCH|OK|fraction_of_hbm_floor\"|speedup_vs" "$log" | tail -n 40
  [ $rc -eq 0 ] || fail=1
}
case $CARD in
  *H200* | *H100*) ;;
  *)
    echo "no H100 or H200 here: nothing to run" >&2
    exit 1
    ;;
esac
mkdir -p "$OUT"
ab() { # ab SECONDS DIR WORLDS CONFIGS: dispatch_v5.py's A/B at 2^26 ids, no separate check
  step "$1" "$OUT/$2.log" python3 benchmarks/dispatch_v5.py --out "$OUT/$2" --git-sha "$SHA" \
    --no-check --workloads large --worlds $3 --configs $4
}
# session 45: the opt-in radix scatter (`V5Config(scatter="radix")`), never run on a GPU
# before this call, on either card: first timed at 2^26 ids next to the card's table
# (every timed call compared bit for bit with v4's output; a mismatch ends the step),
# then checked against the reference on random inputs (W = 1 .. 4096, int32 / int64,
# block / modulo, tiles with K = 16 and 8 items per thread)
RADIX="radix_t8192_c8_s16_sn16 radix_t4096_c8_s16_sn16 radix_t4096_c8_s8_sn16 radix_t2048_c4_s8_sn16"
step 240 "$OUT/radix_ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/radix_ab" \
  --git-sha "$SHA" --no-check --workloads large --worlds 1024 256 64 2048 --configs $RADIX
step 200 "$OUT/radix_check.log" python3 benchmarks/dispatch_v5.py --out "$OUT/radix_check" \
  --git-sha "$SHA" --check-only --check-configs radix_t8192_c8_s16_sn16 radix_t256_c1_s1
exit $fail
