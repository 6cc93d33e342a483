#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   H200: the GPU cases of `l2_prefetch` (session 37; one of them with `narrow`) and of
#         the H100 default's option set (the shared-memory base changed at 582a98f), then
#         `check_kernels_cuda.py --only auto` (v5's defaults against the reference); then
#         the A/B at 2^26 ids of the H200 table's configs against the H100's
#         (`dispatch_v5.py --no-check`, W = 8 .. 2048; every timed call is still compared
#         with v4's output), then `kernels.py` with FREESCALE_V5_TABLE=H100: the H200
#         figure with the H100 table, to commit as `kernels.json` if the A/B adopts that
#         table whole (BENCHMARKS.md "Ready to run"). No H200 came in sessions 35-37.
#   H100: the GPU cases of `diag_skip` (session 40), then the timing diagnostic at 2^26
#         ids: the H100 table's 4096-, 8192- and 16384-id configs without their
#         write-out (`_nowo`), without their perm stores (`_noperm`) and without both
#         (`_nostore`), W = 256, 1024, 2048 (W = 1024 split into kernels by the profiler):
#         what the rest of the scatter costs, i.e. what overlapping the write-out with the
#         next tile's ranking could save at most. Session 40 ran it
#         (`dispatch_v5_diagskip_h100_b96ca4f.json`) after the `l2_ahead` A/B
#         (`dispatch_v5_l2ahead_h100_a19edf1.json`); the next H100 step is new work.
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
# when any failed. Results land under DIR (ab/, k/, *.log).
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
    echo "would run (${limit} s, > $log): $*"
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
mkdir -p "$OUT/ab" "$OUT/k"
case $CARD in
  *H200*)
    step 120 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernels_v5.py -k "on_gpu and (l2_prefetch or (16384 and prefetch))"
    step 70 "$OUT/check_kernels.log" python3 benchmarks/check_kernels_cuda.py --only auto
    step 120 "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
      --no-check --workloads large --worlds 8 64 256 512 1024 2048 --configs \
      v5_t2048_w4_u4 ranks_t2048_c4_s8_u4 ranks_t4096_c8_s16_u2 ranks_t4096_c8_s16_u2_sn16 \
      ranks_t8192_c8_s16_u2_v32_pf_sn16 ranks_t16384_c8_s16_u2_v32_pf_sn16
    FREESCALE_V5_TABLE=H100 step 290 "$OUT/k/kernels.log" \
      python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
    ;;
  *H100*)
    step 150 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernels_v5.py -k "on_gpu and diag_skip"
    configs=()
    for b in ranks_t4096_c8_s16_u2_sn16 ranks_t8192_c8_s16_u2_v32_pf_sn16 \
      ranks_t16384_c8_s16_u2_v32_pf_sn16; do
      configs+=("$b" "${b}_nowo" "${b}_noperm" "${b}_nostore")
    done
    step 300 "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
      --no-check --workloads large --worlds 256 1024 2048 --configs "${configs[@]}"
    ;;
esac
exit $fail
