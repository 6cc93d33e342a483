#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   both cards: session 41's `early_loads` (the ranks scatter's ordered loop requests its
#         first chunks of ids before the per-warp counters are zeroed; written, but no
#         device came to time it): its GPU cases, then the A/B at 2^26 ids
#         (`dispatch_v5.py --no-check`, every timed call still compared with v4's output)
#         of the card's table configs with and without it (`_early`), W = 64 .. 2048.
#   H200: also `check_kernels_cuda.py --only auto`, and the A/B holds both tables'
#         configs (the H200 table's against the H100's: the question no H200 came for in
#         sessions 35-41). The figure is a second call (`v5_next.sh figure`, with
#         FREESCALE_V5_TABLE if the A/B picks the H100 table) once the A/B is read.
#   Session 41's first call (`dispatch_v5_ballot_persist_h100_4ad8887.json`) timed two
#   options since reverted; session 40's (`dispatch_v5_diagskip_h100_b96ca4f.json`) the
#   scatter without its stores.
#
# Usage (on the GPU machine, repository root; DRY=1 prints the steps instead):
#
#     OUT=DIR GIT_SHA=SHA bash benchmarks/v5_next.sh [figure]
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
if [ "${1:-}" = figure ]; then
  step 290 "$OUT/k/kernels.log" python3 benchmarks/kernels.py --out "$OUT/k" --git-sha "$SHA"
  exit $fail
fi
step 100 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_v5.py -k "on_gpu and early_loads"
bases=(ranks_t4096_c8_s16_u2_sn16 ranks_t8192_c8_s16_u2_v32_pf_sn16
  ranks_t16384_c8_s16_u2_v32_pf_sn16)
configs=()
case $CARD in
  *H200*)
    step 70 "$OUT/check_kernels.log" python3 benchmarks/check_kernels_cuda.py --only auto
    bases+=(ranks_t2048_c4_s8_u4 ranks_t4096_c8_s16_u2)
    configs+=(v5_t2048_w4_u4)
    ;;
esac
for b in "${bases[@]}"; do
  configs+=("$b" "${b}_early")
done
step 250 "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
  --no-check --workloads large --worlds 64 256 512 1024 2048 --configs "${configs[@]}"
exit $fail
