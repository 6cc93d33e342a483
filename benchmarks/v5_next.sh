#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   1. the GPU cases of session 37's `V5Config(l2_prefetch=True)` (each warp of the ranks
#      scatter asks for its ids in L2 with one bulk prefetch) and `narrow=True`, bitwise
#      against the reference;
#   2. `check_kernels_cuda.py` (every dispatch kernel's defaults against the reference);
#   3. the A/B at 2^26 ids (`dispatch_v5.py --no-check`; every timed call is still
#      compared with v4's output): this card's table configs and their `_l2` twins.
#      (Session 37's first call timed the `_nr` twins against the base commit's tree,
#      extracted to _ab/BASE/src by `bash benchmarks/v5_next.sh extract BASE`; with
#      BASE set that step runs again.)
#
# Usage (on the GPU machine, repository root; DRY=1 prints the steps instead):
#
#     OUT=DIR GIT_SHA=SHA [BASE=SHA] bash benchmarks/v5_next.sh
#
# Each step has its own time limit and prints its exit status; the script's status is 1
# when any failed. Results land under DIR (ab/, ab_base/, *.log).
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
if [ "${1:-}" = extract ]; then
  rm -rf _ab && mkdir -p "_ab/$2" && git archive "$2" src | tar -x -C "_ab/$2" && ls "_ab/$2/src"
  exit $?
fi
OUT=${OUT:?set OUT}
SHA=${GIT_SHA:?set GIT_SHA (the device copy's .git is not the checkout's)}
BASE=${BASE:-}
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
  *H200*)
    WORLDS="8 64 256 512 1024 2048"
    CONFIGS="ranks_t2048_c4_s8_u4 ranks_t4096_c8_s16_u2 ranks_t8192_c8_s16_u2_v32_pf_sn16"
    ;;
  *H100*)
    WORLDS="64 256 512 1024 2048"
    CONFIGS="ranks_t4096_c8_s16_u2_sn16 ranks_t8192_c8_s16_u2_v32_pf_sn16"
    CONFIGS="$CONFIGS ranks_t16384_c8_s16_u2_v32_pf_sn16"
    ;;
  *)
    echo "no H100 or H200 here: nothing to run" >&2
    exit 1
    ;;
esac
TWINS=""
for c in $CONFIGS; do TWINS="$TWINS ${c}_l2"; done
mkdir -p "$OUT/ab" "$OUT/ab_base"
step 120 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_v5.py -k "on_gpu and l2_prefetch"
step 150 "$OUT/check_kernels.log" python3 benchmarks/check_kernels_cuda.py
# shellcheck disable=SC2086  # word splitting of the lists is intended
[ -z "$BASE" ] || PYTHONPATH="_ab/$BASE/src" step 100 "$OUT/ab_base.log" \
  python3 benchmarks/dispatch_v5.py --out "$OUT/ab_base" --git-sha "$BASE" --no-check \
  --workloads large --worlds $WORLDS --configs $CONFIGS
# shellcheck disable=SC2086
step 160 "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
  --no-check --workloads large --worlds $WORLDS --configs $CONFIGS $TWINS
exit $fail
