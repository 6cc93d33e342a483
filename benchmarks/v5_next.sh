#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   both cards: a tree A/B of session 41's change to the ranks scatter (the ordered loop's
#         first chunks of ids requested before the per-warp counters are zeroed, so that
#         their latency overlaps the zeroing and its barrier): first the GPU cases of the
#         ranks scatter's load options (`ahead`, `prefetch`), then `dispatch_v5.py
#         --no-check` at 2^26 ids (every timed call still compared with v4's output) on
#         the base tree (BASE, default e142538's full sha, extracted beforehand to _ab/BASE/src) and
#         on this tree, twice in turn (base, this, base, this; ROUNDS=1: once), on the card's table
#         configs (H200: both tables'), W = 64, 256, 1024, 2048.
#   Session 41's first call (`dispatch_v5_ballot_persist_h100_4ad8887.json`) timed two
#   options since reverted: `peers="ballot"` and `persist=True`.
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
BASE=${BASE:-e14253824fb00aad5df66eb6932fef1385060e3d}
AB=${AB:-_ab} # where `extract` put the base tree
if [ ! -d "$AB/$BASE/src" ]; then
  echo "$AB/$BASE/src is missing: run 'bash benchmarks/v5_next.sh extract $BASE' first" >&2
  exit 1
fi
mkdir -p "$OUT/ab"
step 80 "$OUT/v5_gpu_tests.log" python3 -m pytest -q -p no:cacheprovider \
  tests/test_kernels_v5.py -k "on_gpu and reference and (ahead or prefetch) and not (l2 or stored or 16384) and 1024"
configs=(ranks_t4096_c8_s16_u2_sn16 ranks_t8192_c8_s16_u2_v32_pf_sn16
  ranks_t16384_c8_s16_u2_v32_pf_sn16)
case $CARD in
  *H200*) configs+=(ranks_t2048_c4_s8_u4 ranks_t4096_c8_s16_u2) ;;
esac
for round in $(seq "${ROUNDS:-2}"); do
  for tree in base this; do
    src=src sha=$SHA
    [ $tree = base ] && src=$AB/$BASE/src sha=$BASE
    PYTHONPATH=$src step 70 "$OUT/ab/${tree}_$round.log" python3 benchmarks/dispatch_v5.py \
      --out "$OUT/ab/${tree}_$round" --git-sha "$sha" --no-check --workloads large \
      --worlds 256 1024 2048 --configs "${configs[@]}"
  done
done
exit $fail
