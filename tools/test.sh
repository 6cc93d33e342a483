#!/usr/bin/env bash
# Run the test suite (CPU, gloo ranks in shared process pools; Triton kernels in
# interpreter mode).
#
# With no arguments, on a machine with 2 or more cores: two pytest processes side by
# side, then one more. Every test runs in one process and one thread (conftest), so a
# single pytest keeps one of CI's two cores idle through the ~11 minutes of
# single-process tests (the Triton interpreter's kernel cases, the model and the
# partitioners). Group S (the files below, no ranks, no launcher) runs next to group M
# (every other file); the tests marked `alone` (a deadline checked against the wall
# clock: a killed or hung rank must end the job in time) run after both, by themselves.
# Each group prints its own summary; the exit status is 1 when any group failed.
#
# Session 39 measured this split slower than one pytest (1,622 and 1,872 s against
# 1,680) and dropped it; the rank pools then leaked a gloo group per task and group, each
# with a thread waking every 10 ms, which starved both groups of CPU. Session 40 stopped
# the leak (freescale.testing.DistPool) and measured again in clean-clone CI runs: the
# tests took 916 s split (group M 594 s beside group S 846 s, then 60 s alone; the whole
# of .ci/run 15.6 min), 1,124 s in one pytest with the fix, 1,815 s in one pytest before
# it. Then test_kernels_v5.py (~100 s alone) moved to group M: 817 s (M 727 s beside S
# 745 s, then 61 s alone; the whole of .ci/run 13.9 min).
#
# With arguments (or FREESCALE_TEST_SPLIT=0, or one core; `nproc` without the
# OMP_NUM_THREADS it honours, which is 1 here): one plain pytest run, the
# arguments passed to it.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
PYTEST=(python3 -m pytest -q -p no:cacheprovider)
if [ "$#" -gt 0 ] || [ "${FREESCALE_TEST_SPLIT:-1}" = 0 ] || [ "$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)" -lt 2 ]; then
  exec "${PYTEST[@]}" --durations=15 "$@"
fi
SINGLE=(tests/test_kernels.py tests/test_kernels_v4.py
  tests/test_model.py tests/test_data.py tests/test_partitioner_sticky.py
  tests/test_partitioner_sticky2.py tests/test_placement.py tests/test_projection.py
  tests/test_sparse_update.py tests/test_package.py tests/test_exposed_comm_helpers.py)
IGNORE=()
for f in "${SINGLE[@]}"; do IGNORE+=(--ignore "$f"); done
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$SECONDS
"${PYTEST[@]}" --durations=8 -m "not alone" "${SINGLE[@]}" > "$log" 2>&1 &
single=$!
echo "== group M (multi-rank and the rest; group S runs alongside, its log follows) =="
"${PYTEST[@]}" --durations=15 -m "not alone" "${IGNORE[@]}"
rc_m=$?
wait "$single"
rc_s=$?
echo "== group S (single-process tests, ran alongside group M) =="
cat "$log"
echo "== tests marked alone (wall-clock deadlines), by themselves =="
"${PYTEST[@]}" -m alone
rc_a=$?
echo "groups: M rc=$rc_m, S rc=$rc_s, alone rc=$rc_a; $((SECONDS - start)) s"
[ "$rc_m" -eq 0 ] && [ "$rc_s" -eq 0 ] && [ "$rc_a" -eq 0 ]
