#!/usr/bin/env bash
# Issue 3's large-W probe in one GPU call (one H100 or H200, ~6 min): the v5 GPU tests of
# the opt-in scatter options, the A/B of those options at 2^26 ids, and Nsight Compute
# counters (speed of light, memory workload, scheduler, warp states, occupancy) of one
# ranks-scatter launch at W = 1024 and W = 64 for the int64 and int32 stagings.
# Usage (on the GPU machine, repository root):
#
#     OUT=DIR GIT_SHA=SHA bash benchmarks/v5_probe.sh
#
# Writes under DIR: v5_gpu_tests.log, dispatch_v5.json (+ .log), ncu_*.csv; each step has
# its own time limit and prints its exit status; the script's status is 1 when any failed.
set -x
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT}
SHA=${GIT_SHA:?set GIT_SHA (the device copy's .git is not the checkout's)}
fail=0
step() {  # step SECONDS LOG CMD...: run CMD under a time limit into LOG, record a failure
  local limit=$1 log=$2
  shift 2
  timeout "$limit" "$@" > "$log" 2>&1
  local rc=$?
  echo "step rc=$rc: $*"
  case $log in
    *ncu_*) grep -E '"(Duration|DRAM Throughput|Memory Throughput|L2 Cache Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Issued Warp Per Scheduler|No Eligible|Registers Per Thread)"' "$log" \
      | awk -F'","' '{print $13" ("$14"): "$15}' ;;
    *) tail -n 25 "$log" ;;
  esac
  [ $rc -eq 0 ] || fail=1
}
nvidia-smi --query-gpu=name --format=csv,noheader
step 200 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_kernels_v5.py -k "on_gpu and ${TESTS_K:-int32}"
CONFIGS=${CONFIGS:-ranks_t4096_c8_s16_u2 ranks_t4096_c8_s16_u2_v32 ranks_t4096_c8_s16_u2_v32_pos
  ranks_t8192_c8_s16_u2_v32 ranks_t8192_c8_s16_u4_v32 ranks_t4096_c8_s8_u4_v32
  ranks_t4096_c8_s16_u4_dst ranks_t2048_c4_s8_u4 ranks_t2048_c4_s8_u4_v32}
# shellcheck disable=SC2086
step 330 "$OUT/dispatch_v5.log" python3 benchmarks/dispatch_v5.py --out "$OUT" --git-sha "$SHA" \
  --no-check --workloads large --worlds ${WORLDS:-64 256 1024} --configs $CONFIGS
if command -v ncu > /dev/null && [ -z "${NO_NCU:-}" ]; then
  for cfg in ${NCU_CONFIGS:-ranks_t4096_c8_s16_u2 ranks_t4096_c8_s16_u2_v32}; do
    for w in 1024 64; do
      # the 3rd _v5_scatter_ranks launch: the first compiles, -s skips the check's v4 calls
      step 150 "$OUT/ncu_${cfg}_w${w}.log" ncu --clock-control none -k regex:_v5_scatter_ranks \
        -s 1 -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section SchedulerStats --section WarpStateStats --section Occupancy \
        --section LaunchStats --csv --page details \
        python3 benchmarks/dispatch_v5.py --ncu-config "$cfg" --worlds "$w"
      cp "$OUT/ncu_${cfg}_w${w}.log" "$OUT/ncu_${cfg}_w${w}.csv"
    done
  done
fi
exit $fail
