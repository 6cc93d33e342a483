#!/usr/bin/env bash
# Issue 3's next GPU call, whichever card the device tool lends (one call, < 10 min):
#
#   H200: the question no H200 came for in sessions 35-42: the H100's large-W options
#         (int32 staging, 8192/16384-id tiles, placement prefetch, int16 snapshots; on the
#         H100 13-34% less time than the H200 table's choices at W = 512 .. 2048) on the
#         H200. The A/B at 2^26 ids with FREESCALE_V5_TABLE=H200_H100BIG
#         (`triton_dispatch_v5.CANDIDATE_TABLE`: row "v5_default" runs the candidate, "v5_h200_table" the H200 table of record; every
#         timed call compared with v4's output); then the figure (`kernels.py`), under the
#         candidate table if it won at W = 1024 (the figure records FREESCALE_V5_TABLE, and
#         the next session adopts the candidate in `default_config_v5` to match), else the
#         H200 table (a fresh figure: the last H200 one is session 30's, `37c46f9`); the
#         A/B also times W = 64 .. 256 with int16 snapshots on the H200 table's 2048-id
#         config (`ranks_t2048_c4_s8_u4_sn16`);
#         then `check_kernels_cuda.py --only auto`.
#   H100: nothing (session 43 ran the H100 figure after session 42's table change below
#         W = 32: `kernels_h100_d37773f.json`).
#   Session 42's calls timed `early_loads` (`dispatch_v5_early_h100_0f2871b.json`: no
#   effect; reverted) and the H100's small-W table (`dispatch_v5_smallw_h100_75402d3.json`);
#   session 41's (`dispatch_v5_ballot_persist_h100_4ad8887.json`) two options since
#   reverted; session 40's (`dispatch_v5_diagskip_h100_b96ca4f.json`) the scatter without
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
mkdir -p "$OUT/ab" "$OUT/k"
ab() { # ab SECONDS WORLDS CONFIGS: dispatch_v5.py's A/B at 2^26 ids, no separate check
  step "$1" "$OUT/ab.log" python3 benchmarks/dispatch_v5.py --out "$OUT/ab" --git-sha "$SHA" \
    --no-check --workloads large --worlds $2 --configs $3
}
case $CARD in
  *H200*)
    # W = 1024 first: the figure's table is picked there, and dispatch_v5.py writes its
    # rows after every W, so a call cut short still decides it. At W = 64 .. 256 the
    # 2048-id config with int16 snapshots (never timed on an H200; on the H100 never
    # slower) runs next to v5_default, which is the H200 table there
    FREESCALE_V5_TABLE=H200_H100BIG ab 150 "1024 512 2048 256 128 64" \
      "ranks_t8192_c8_s16_u2_v32_pf_sn16 ranks_t4096_c8_s16_u2_sn16 ranks_t2048_c4_s8_u4_sn16"
    # the candidate's table for the figure if it beat the H200 table at W = 1024
    table=$(python3 - "$OUT/ab/dispatch_v5.json" << 'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
    ms = {r["impl"]: r["ms"] for r in rows if r["world"] == 1024}
    print("H200_H100BIG" if ms["v5_default"] < ms["v5_h200_table"] else "")
except Exception as e:  # no A/B: the table of record
    print(f"no A/B result ({e!r}): the H200 table", file=sys.stderr)
PY
    )
    echo "figure table: ${table:-H200 (of record)}"
    FREESCALE_V5_TABLE=$table step 290 "$OUT/k/kernels.log" python3 benchmarks/kernels.py \
      --out "$OUT/k" --git-sha "$SHA"
    # last, so that a call cut short by the device time left keeps the figure (kernels.py
    # checks every output it times against the reference itself)
    step 70 "$OUT/check_kernels.log" python3 benchmarks/check_kernels_cuda.py --only auto
    ;;
  *)
    # session 43 ran the H100 figure at d37773f (`kernels_h100_d37773f.json`): nothing
    # new to time on an H100 until the code changes, so a call that lands there costs
    # only its start
    echo "nothing queued for an H100 (its figure at d37773f is current): ask for an H200"
    ;;
esac
exit $fail
