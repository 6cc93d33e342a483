#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min;
# queued since session 47: session 48 got no device):
#
#   H200: session 47's table (`default_config_v5`; measured at 88bebc9,
#         `dispatch_v5_rev_h200_88bebc9.json`, two runs: the 2048-id ranks config with
#         `reverse=True` took 0.950x the table before at W = 32 and 0.989x at 128, 1.002x
#         at 64; the staged scatter reversed 0.942x at W = 16, one run; the 4096-id config
#         with int16 snapshots 0.951x at W = 256): `benchmarks/kernels.py` (the kernels
#         figure, k/kernels.json, ~200 s), then the table timed next to the staged scatter
#         unreversed at W = 8 (untimed there) and the W = 256 config reversed (ab3/).
#   H100: `benchmarks/kernels.py` (the H100 figure, k/kernels.json): session 47 gave the
#         H100 table the H200's reversed 2048-id config at W = 32..64 (0.971x / 0.979x the
#         4096-id config there, twice, `dispatch_v5_rev_h100_bf4a007.json`; reversing the
#         H100's own configs gained nothing: 1.000-1.010x at W = 32..256, 1.001x at 1024).
#   Earlier calls: session 46 timed three opt-in options of the ranks scatter on an H100
#   (`dispatch_v5_s46_h100_08354e1.json`: `match_ahead`, the ordered loop pipelined by one
#   chunk, 1.000x the base at W = 1024 (twice), 0.985x at 2048, 1.025x at 64;
#   `dests="aliased"`, 1.03-1.17x slower; `dispatch_v5_registers_h100_3346df7.json`:
#   `counters="registers"`, the ordered loop's counters in registers by ballots and
#   shuffles at W <= 64, 1.00-1.09x slower; equal bits; all reverted, the code is in git at
#   08354e1 and 3346df7); session 45 timed an opt-in radix scatter on an H100
#   (`dispatch_v5_radix_h100_041ce57.json`: equal bits, its scatter kernel 1.6-2.8x slower
#   than the ranks scatter at W = 1024; reverted, the code is in git at 041ce57);
#   session 42 timed `early_loads` (`dispatch_v5_early_h100_0f2871b.json`:
#   no effect; reverted) and the H100's small-W table (`dispatch_v5_smallw_h100_75402d3.json`);
#   session 41 (`dispatch_v5_ballot_persist_h100_4ad8887.json`) two options since
#   reverted; session 40 (`dispatch_v5_diagskip_h100_b96ca4f.json`) the scatter without
#   its stores.
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
# when any failed. Results land under DIR (ab*/, k/, *.log).
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
case $CARD in
  *H200*)
    # session 47's table (tiles last first below W = 256; the 4096-id config with int16
    # snapshots from 256) is v5_default: the kernels figure, then the table next to the
    # staged scatter unreversed at W = 8 and the W = 256 config reversed
    # (the figure first: a call cut short by the device budget keeps it)
    step 300 "$OUT/kernels.log" python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
    ab 90 ab3 "8 256" "v5_t2048_w4_u4 ranks_t4096_c8_s16_u2_sn16_rev"
    ;;
  *)
    # the H100 figure after session 47's table change at W = 32..64
    step 300 "$OUT/kernels.log" python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
    ;;
esac
exit $fail
