#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   both: `check_kernels_cuda.py` first (every dispatch kernel, block and modulo, against the
#         reference; session 36's unsigned owner/row arithmetic has not run on a GPU yet).
#   H200: the A/B of the H100 table's options against the H200's own configs at 2^26 ids
#         (`dispatch_v5.py`, ~1.5 min), then `kernels.py` with FREESCALE_V5_TABLE=H100
#         (~4 min): the H200 figure with the H100 table, to commit as `kernels.json` if
#         the A/B adopts that table whole (BENCHMARKS.md "Ready to run").
#   H100: the GPU test case of the H100 table's W >= 512 option set, `kernels.py` again
#         (session 36's run had a slow host: per-rank ratios 36x / 507x against 72x /
#         1004x at the same device times), and Nsight Compute counters of the W = 1024
#         scatter with the new default.
#
# Usage (on the GPU machine, repository root; DRY=1 prints the steps instead):
#
#     OUT=DIR GIT_SHA=SHA bash benchmarks/v5_next.sh
#
# Each step has its own time limit and prints its exit status; the script's status is 1
# when any failed. Results land under DIR (ab/, k/, *.log, ncu_*.csv).
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
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
mkdir -p "$OUT/ab" "$OUT/k"
[ -z "$CARD" ] || step 150 "$OUT/check_kernels.log" python3 benchmarks/check_kernels_cuda.py
case $CARD in
  *H200*)
    step 150 "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
      --no-check --workloads large --worlds 8 64 256 512 1024 2048 --configs \
      v5_t2048_w4_u4 v5_t2048_w4_u4_sn16 ranks_t2048_c4_s8_u4 ranks_t2048_c4_s8_u4_sn16 \
      ranks_t4096_c8_s16_u2 ranks_t4096_c8_s16_u2_sn16 ranks_t8192_c8_s16_u2_v32 \
      ranks_t8192_c8_s16_u2_v32_pf_sn16 ranks_t16384_c8_s16_u2_v32_pf_sn16
    FREESCALE_V5_TABLE=H100 step 290 "$OUT/k/kernels.log" \
      python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
    ;;
  *H100*)
    step 60 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
      tests/test_kernels_v5.py -k "on_gpu and 16384 and prefetch"
    step 290 "$OUT/k/kernels.log" python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
    if command -v ncu > /dev/null; then
      # the 3rd _v5_scatter_ranks launch: the first compiles, -s skips the check's calls
      step 100 "$OUT/ncu_default_w1024.csv" ncu --clock-control none -k regex:_v5_scatter_ranks \
        -s 1 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section Occupancy \
        --section LaunchStats --csv --page details \
        python3 benchmarks/dispatch_v5.py --ncu-config ranks_t8192_c8_s16_u2_v32_pf_sn16 \
        --worlds 1024
    fi
    ;;
  *)
    echo "no H100 or H200 here: nothing to run" >&2
    exit 1
    ;;
esac
exit $fail
