#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   Session 49's atomic scatter (`V5Config(scatter="atomic")`, opt-in, never run on a GPU
#   before this call; compiled for sm_90 on CPU by the tests) with session 50's LONG path
#   (tiles where a dest holds more than `run_limit` ids rank in input order): `dispatch_v5.py
#   --check-only` on one atomic config (chk/: W = 1 .. 64 there have LONG tiles, W >= 1000
#   short ones), then, if it matches the reference, the A/B of five atomic configs next
#   to the card's table at W = 128 .. 2048 (ab4/; the table's W = 1024 call took 1.253 ms
#   on an H200 at d4ce341, 0.355 of the floor), then the W = 1024 config with the LONG
#   path everywhere (_rl0), nowhere (_rlmax) and by default, on the large workload and on
#   power-law ids (hot/: 42% of the ids on the first shard), then `benchmarks/kernels.py`
#   under the card's table of record (k/kernels.json: on an H200 the figure of session
#   47's table, queued since session 47; ~195 s, here with a 170 s budget).
#   Session 47's H200 table (`default_config_v5`; measured at 88bebc9,
#         `dispatch_v5_rev_h200_88bebc9.json`, two runs: the 2048-id ranks config with
#         `reverse=True` took 0.950x the table before at W = 32 and 0.989x at 128, 1.002x
#         at 64; the staged scatter reversed 0.942x at W = 16, one run; the 4096-id config
#         with int16 snapshots 0.951x at W = 256).
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
# when any failed. Results land under DIR (ab4/, hot/, k/, steps.log: every step's log).
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
# both cards: the atomic scatter (session 49) checked bitwise against the reference
# (random inputs, W = 1 .. 4096, block and modulo, int32 and int64), then timed next to
# the card's table at W = 128 .. 2048 (ab4/, every timed call also compared with v4's
# output), then the card's kernels figure under its table of record (k/)
step 120 "$OUT/chk.log" python3 benchmarks/dispatch_v5.py --out "$OUT/chk" --git-sha "$SHA" \
  --check-only --check-configs atomic_t8192_c8_s16_u2_v32_pf_sn16
if [ $fail -eq 0 ]; then
  ab 175 ab4 "${AB_WORLDS:-128 256 512 1024 2048}" "atomic_t2048_c4_s8_u4_sn16 atomic_t4096_c8_s16_u2_sn16 \
atomic_t4096_c8_s16_u2_v32_pf_sn16 atomic_t8192_c8_s16_u2_v32_pf_sn16 \
atomic_t16384_c8_s16_u2_v32_pf_sn16"
  # the LONG path's cost and its guard: uniform and power-law ids at W = 1024
  step 75 "$OUT/hot.log" python3 benchmarks/dispatch_v5.py --out "$OUT/hot" --git-sha "$SHA" \
    --no-check --workloads large hot --worlds 1024 --configs atomic_t8192_c8_s16_u2_v32_pf_sn16 \
    atomic_t8192_c8_s16_u2_v32_pf_sn16_rl0 atomic_t8192_c8_s16_u2_v32_pf_sn16_rlmax
fi
# FIGURE=0: the check and the A/B only (less device time; AB_WORLDS narrows the A/B)
if [ "${FIGURE:-1}" != 0 ]; then
  step 220 "$OUT/kernels.log" python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA" \
    --budget-s 170
fi
# one log file: the device tool brings back at most 8 files (json x 4, the plot, this)
if [ -z "${DRY:-}" ]; then
  for f in "$OUT"/*.log; do
    [ "$f" = "$OUT/steps.log" ] || { echo "=== $f"; cat "$f"; rm -f "$f"; }
  done >> "$OUT/steps.log"
fi
exit $fail
