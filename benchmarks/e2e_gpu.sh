#!/usr/bin/env bash
# End-to-end figure on the GPU machine, in phases that each fit one device call.
#   bash benchmarks/e2e_gpu.sh verify  # ~3.5 min: the CPU-tested-only changes on GPUs: the
#                                      # Triton per-row sum (bitwise + timing), the ahead and
#                                      # padded sparse updates (bitwise vs synchronous), tier-1
#                                      # prioritized check, the kernels, dispatch profile
#   bash benchmarks/e2e_gpu.sh first   # verify then host in one call (~5.5 min, one start-up)
#   bash benchmarks/e2e_gpu.sh vcheck  # verify then check in one call (~6 min)
#   bash benchmarks/e2e_gpu.sh kernels # ~3.5 min: segment-sum + dispatch bitwise checks, then
#                                      # benchmarks/kernels.py (the kernels figure)
#   bash benchmarks/e2e_gpu.sh kfig    # ~3 min: benchmarks/kernels.py alone (v1-v4, both v4
#                                      # paths; each checked against v3 before timing)
#   bash benchmarks/e2e_gpu.sh v5      # ~3.5 min: dispatch v5 (Gluon) checked and timed vs v4
#   bash benchmarks/e2e_gpu.sh kprof   # ~5 min: per-kernel profile of v3 / v4 / v4_columns
#                                      # at W = 8, 64, 1024, then kfig
#   bash benchmarks/e2e_gpu.sh sparse  # ~3 min: padded sparse update bitwise on CUDA + 150-step
#                                      # vanilla (sync vs padded update) and freescale runs
#   bash benchmarks/e2e_gpu.sh host    # ~2 min: where the host time goes (trace_host.py on a
#                                      # profiled 40-step run with stacks), vanilla and freescale
#   bash benchmarks/e2e_gpu.sh check   # new GPU paths + device-sync call sites (run first)
#   bash benchmarks/e2e_gpu.sh smoke   # kill-rank check (issue 8), 1-GPU baseline, 2-GPU smoke
#   bash benchmarks/e2e_gpu.sh verify1 # ~5 min, one H200: every one-GPU check at the defaults,
#                                      # then the 1-GPU e2e (vanilla, freescale)
#   bash benchmarks/e2e_gpu.sh compiles1 # ~4 min, one H200: the 1-GPU e2e at the defaults with
#                                      # every Triton compile logged (time, kernel, call site;
#                                      # OLD_SRC=<dir>: first the same with that source tree;
#                                      # COMPILES_STEPS / COMPILES_LIMIT: steps, time limit)
#   bash benchmarks/e2e_gpu.sh optim1  # ~5 min, one H200: the fused row-wise Adagrad's GPU
#                                      # check, then 1-GPU e2e with it on and off (NE bits)
#   bash benchmarks/e2e_gpu.sh main    # 2 GPUs: vanilla, two legal reorderings (noise floor), a
#                                      # cross-rank shuffle (cross-rank floor),
#                                      # sdd, freescale, freescale_fbs (the old default)
#                                      # (~6.5 min; MAIN_EXTRA= drops the last one)
#   bash benchmarks/e2e_gpu.sh update  # ~6 min: the sparse-update A/B in one run: vanilla and
#                                      # freescale (ahead update, the CUDA default) next to
#                                      # vanilla_sync_update, vanilla_padded_update,
#                                      # freescale_padded_update (same bits, other update)
#   bash benchmarks/e2e_gpu.sh ne      # ~8 min (6.5 with 4 variants): where balancing's NE distance comes from:
#                                      # vanilla, an in-rank reordering, the cross-rank shuffle,
#                                      # balance_fbs and balance (freescale's balancer since
#                                      # session 17), 150 steps, with the default bfloat16
#                                      # flex attention and with float32 attention
#   bash benchmarks/e2e_gpu.sh smfree  # ~8 min: tier-1 prioritized check (mask exchange now in
#                                      # the forward), then the copy engine's device-side
#                                      # completion: gpu_check_comm.py (bitwise vs NCCL, host and device
#                                      # completion, a mutant that must be CAUGHT), then one
#                                      # e2e run: vanilla, freescale (device completion, the default),
#                                      # freescale_host_completion, freescale_nccl_overlap
#   bash benchmarks/e2e_gpu.sh baldiag # ~6 min: what balancing costs the host-bound prioritized step
#   bash benchmarks/e2e_gpu.sh hang2   # ~5-8 min: prioritized then freescale_no_balance (the order
#                                      # that hung at c6be283) with the copy streams in the old
#                                      # low-priority pool and in the new high-priority one,
#                                      # stacks dumped after 20 s; then no_balance alone
#   bash benchmarks/e2e_gpu.sh sticky  # ~7 min: vanilla, freescale, freescale_sticky, 400 steps,
#                                      # profiler-free, 3 passes: does the sticky partitioner's
#                                      # smaller host cost (balance_host.json) show, and does it
#                                      # balance real step times (straggler share) as well as fbs?
#   bash benchmarks/e2e_gpu.sh partab  # ~6 min: vanilla, freescale (sticky on the cost model
#                                      # refitted online), freescale_fbs, freescale_sticky,
#                                      # freescale_sticky2, freescale_verify_plans, 300 steps,
#                                      # 3 passes
#   bash benchmarks/e2e_gpu.sh floor   # ~6.5 min: the NE noise band (session 18): vanilla, four
#                                      # in-rank reorderings (ne_noise_floor = the largest),
#                                      # freescale and freescale_again (a second run of it:
#                                      # ne_rel_diff_freescale_runs), 1,000 steps
#   bash benchmarks/e2e_gpu.sh rep3    # ~7 min: vanilla, freescale, freescale_no_balance, 400 steps,
#                                      # profiler-free, 3 passes (ABC/CBA/ABC): the run-to-run spread
#                                      # of freescale / vanilla within one invocation
#   bash benchmarks/e2e_gpu.sh prepab  # ~6 min: vanilla, freescale, freescale_local_prepare
#                                      # (the pre-c39168e rank-local prepare), 2 passes
#   bash benchmarks/e2e_gpu.sh hang    # ~3 min: freescale_no_balance (hung at ef8d370) with the
#                                      # prepare_blocks fix, and with --late-prepare
#   bash benchmarks/e2e_gpu.sh s13a    # ~7.5 min: smcheck, then main (the headline, CUPTI released)
#   bash benchmarks/e2e_gpu.sh s13b    # ~9 min: MERGE=<s13a's e2e.json> ablate, then dmet
#   bash benchmarks/e2e_gpu.sh smcheck # ~3 min: the two checks of smfree only
#   bash benchmarks/e2e_gpu.sh sme2e   # ~5 min: the e2e run of smfree only
#   bash benchmarks/e2e_gpu.sh checks9 # ~7 min (at most ~9.7), one call: bal64, then
#                                      # exposed_comm.py with and without prepare_backward
#                                      # (4 files in $OUT; the e2e summary now has host CPU)
#   bash benchmarks/e2e_gpu.sh gil     # ~6 min: GIL wait per variant; switch interval 0.5 ms
#                                      # vs 5 (vanilla, freescale); 2 passes (--repeats 2)
#   bash benchmarks/e2e_gpu.sh ncclov  # ~4 min: tier-1 check, freescale_nccl_overlap 1,000 steps
#   bash benchmarks/e2e_gpu.sh pin     # ~6 min: thread pinning A/B (pipeline/placement.py):
#                                      # vanilla, freescale, freescale_pinned, vanilla_pinned,
#                                      # 500 steps, 2 passes; prints the host's CPU topology
#   bash benchmarks/e2e_gpu.sh smc     # ~3 min: sm_contention.py (issue 6) with device completion
#   bash benchmarks/e2e_gpu.sh smc5    # ~4.5 min: sm_contention.py paced + paired + 100 ms cool-down
#                                      # (issue 6's canonical since session 15); with
#                                      # SMC_WORKLOAD_FROM=benchmarks/results/e2e.json the
#                                      # workload cell is the measured SM-free collective size
#   bash benchmarks/e2e_gpu.sh smc2    # ~2.5 min: smc with --reps 15, no NCCL probe, SM clocks and
#                                      # power sampled by nvidia-smi into smc2/clocks.csv
#   bash benchmarks/e2e_gpu.sh gloo    # ~40 s: gloo_host.py (gloo latency and bandwidth; does a
#                                      # gloo wait spin?), copy_engine_call.py --device cuda
#                                      # (the copy engine's per-call overhead, gloo vs shm handshake)
#   bash benchmarks/e2e_gpu.sh xcpin   # ~2.5 min: exposed_comm.py (issue 5) with --pin-threads:
#                                      # does host jitter make the ranks' issue skew?
#   bash benchmarks/e2e_gpu.sh kv4     # ~3 min: dispatch v4 in training: check_kernels_cuda (v4 at
#                                      # W=1..1024), then vanilla 300 steps with v3 and with v4
#                                      # (FREESCALE_TRITON_DISPATCH=v4: same eval NE expected)
#   bash benchmarks/e2e_gpu.sh cwait   # ~3 min: vanilla, freescale, freescale_nccl_overlap, 300 steps,
#                                      # 2 passes, with the training thread's host wait per collective
#   bash benchmarks/e2e_gpu.sh bal64   # ~2 min: tier 2 by parameters, float64 and float32
#                                      # (check_balance_cuda.py: vanilla, reorderings,
#                                      # shuffle, fbs): is FBS's NE distance rounding?
#   bash benchmarks/e2e_gpu.sh lowcoll # ~5 min: 20M items (fewer collisions): vanilla,
#                                      # prioritized, freescale, 500 steps
#   bash benchmarks/e2e_gpu.sh hostt   # ~1.5 min: host wall time per function and step
#                                      # (benchmarks/host_time), vanilla and freescale
#   MERGE=benchmarks/results/e2e.json bash benchmarks/e2e_gpu.sh ablate   # (main's e2e.json)
#                                      # 1-GPU baseline (vanilla, freescale), then 2 GPUs:
#                                      # prioritized, balance (freescale's balancer alone;
#                                      # balance_fbs until session 17), freescale_nccl_overlap
#                                      # merged into the main rows
# Results land under $OUT (the device tool brings them back); copy e2e.json/md/png into
# benchmarks/results/. STEPS / BASE_STEPS override the step counts. Workload: the GPU
# default of `freescale train` (max UIH 16K, median 1K, 128 samples per rank, dim 128)
# with 1M items, Zipf s=0.6 (item ids of step t+1 seen at step t: ~48% by occurrence; with
# the 4-row action table, ~74% of all ids collide). 20M items (~9% item collisions) made
# the synthetic loader the bottleneck on the GPU machine (~230 ms/step); the bounded
# guide-table search (session 8) cut a 20M-item global batch from 454 to 66 ms on the
# 2-core dev box: the `lowcoll` phase runs that workload.
# Set FREESCALE_GIT_SHA to the commit being run: the device copy's .git can be stale.
set -u
: "${OUT:?set OUT}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src
STEPS=${STEPS:-1000}
BASE_STEPS=${BASE_STEPS:-300}
# E2E_ARGS: extra flags for every bench e2e call (e.g. "--copy-engine-completion device")
E2E="python -m freescale.cli bench e2e --zipf-s 0.6 ${E2E_ARGS:-}"
# the headline runs (main, ablate: merged, so one config) without the GIL probe thread: one
# moving part less; the diagnostic phases keep it (session 12, BENCHMARKS.md e2e)
HEAD="$E2E --gil-probe-ms ${HEAD_GIL_PROBE_MS:-0}"
# three_passes NAME LIMIT STEPS VARIANTS...: one profiler-free e2e invocation with 3
# passes (ABC / CBA / ABC) into $OUT/NAME, then its per-pass summary (e2e_passes.py)
three_passes() {
  local name=$1 limit=$2 steps=$3; shift 3
  timeout "$limit" $HEAD --out "$OUT/$name" --nproc 2 --steps "$steps" --repeats 3 \
    --profile-steps 0 --timeout 60 --stall-dump-s 30 --variants "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$?"
  python benchmarks/e2e_passes.py "$OUT/$name/e2e.json" || true
  rm -rf "$OUT/$name/traces" "$OUT/$name"/*.png
}

case "${1:-}" in
first)
  bash "$0" verify
  bash "$0" host
  ;;
vcheck)
  bash "$0" verify
  bash "$0" check
  ;;
verify)
  timeout 90 python benchmarks/check_segment_sum_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | tail -3
  timeout 100 python benchmarks/check_sparse_update_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | tail -1
  timeout 240 python -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/check_prioritized_cuda.py > "$OUT/verify_prioritized.log" 2>&1
  echo "check_prioritized_cuda rc=$?"; tail -8 "$OUT/verify_prioritized.log"
  timeout 120 python benchmarks/check_kernels_cuda.py > "$OUT/verify_kernels.log" 2>&1
  echo "check_kernels_cuda rc=$?"; tail -5 "$OUT/verify_kernels.log"
  timeout 200 python benchmarks/profile_dispatch.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | grep -E "device; top|MISMATCH|wrote"
  ;;
kfig)
  # the kernels figure alone, with dispatch v4 (its kernels compile once per world size:
  # allow more than the `kernels` phase does)
  timeout 560 python benchmarks/kernels.py --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; tail -16 "$OUT/kernels.log"
  ;;
v5)
  # (~3.5 min) dispatch v5 (Gluon, opt-in): bitwise check, then timing against v4 at 2^26
  # ids and one rank's batch, W = 8..1024 (benchmarks/results/dispatch_v5.json)
  timeout 500 python benchmarks/dispatch_v5.py --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" \
    2>&1 | grep -vi warn | tail -40
  ;;
kprof)
  # (~2 min) per-kernel device time of v3 and both v4 paths at W = 8, 64, 1024 (which v4
  # kernel grows with W), then the kernels figure (both v4 paths timed; ~3 min)
  timeout 200 python benchmarks/profile_dispatch.py --out "$OUT" --versions v3 v4 v4_columns \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | grep -E "device; top|SKIPPED|MISMATCH|wrote"
  bash "$0" kfig
  ;;
kernels)
  # the Triton per-row sum / mask positions and the dispatch kernels bitwise on CUDA, then
  # the kernels figure (~3.5 min)
  timeout 90 python benchmarks/check_segment_sum_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | tail -3
  timeout 120 python benchmarks/check_kernels_cuda.py > "$OUT/verify_kernels.log" 2>&1
  echo "check_kernels_cuda rc=$?"; tail -5 "$OUT/verify_kernels.log"
  timeout 300 python benchmarks/kernels.py --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" \
    > "$OUT/kernels.log" 2>&1
  echo "kernels rc=$?"; tail -12 "$OUT/kernels.log"
  ;;
sparse)
  # the padded (read-back-free) sparse update: bitwise vs the synchronous one on CUDA,
  # then 150-step runs: vanilla with each update, freescale with the padded one (~3 min)
  timeout 100 python benchmarks/check_sparse_update_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | tail -4
  for run in vanilla:sync vanilla:padded freescale:padded; do
    mode=${run%%:*}; upd=${run##*:}
    FREESCALE_SPARSE_UPDATE=$upd timeout 120 python -m freescale.cli train --device cuda \
      --nproc 2 --steps 150 --mode "$mode" --timing events --profile-steps 5 --zipf-s 0.6 \
      --trace-dir "/tmp/trace_sparse_${mode}_${upd}" --no-progress > "$OUT/sparse_${mode}_$upd.log" 2>&1
    echo "== $mode update=$upd rc=$?"; grep -E "QPS|GPU per step|eval NE|Error" "$OUT/sparse_${mode}_$upd.log"
  done
  ;;
host)
  for mode in vanilla freescale; do
    FREESCALE_PROFILE_STACK=1 timeout 150 python -m freescale.cli train --device cuda --nproc 2 \
      --steps 40 --mode "$mode" --timing events --profile-steps 5 --zipf-s 0.6 \
      --trace-dir "/tmp/trace_host_$mode" --no-progress > "/tmp/host_$mode.log" 2>&1
    echo "== $mode rc=$?"; grep -E "QPS|GPU per step" "/tmp/host_$mode.log"
    python benchmarks/trace_host.py "/tmp/trace_host_$mode/trace_rank0.json" --steps 5 --top 20 \
      | cut -c1-180 | tee "$OUT/trace_host_$mode.txt"
  done
  ;;
check)
  # the GPU paths not yet run on GPUs (host counts, host balancing, SM-free overlap),
  # and every device-sync call site of a vanilla and a freescale step (~2 min)
  for mode in vanilla sdd freescale; do
    FREESCALE_SYNC_DEBUG=1 timeout 150 python -m freescale.cli train --device cuda --nproc 2 \
      --steps 30 --mode "$mode" --timing events --profile-steps 5 --zipf-s 0.6 \
      --trace-dir "/tmp/trace_check_$mode" --no-progress > "$OUT/check_$mode.log" 2>&1
    echo "$mode rc=$?"; grep -E "QPS|GPU per step|Error|error" "$OUT/check_$mode.log" | head -5
    # "<file>:<line>: UserWarning: called a synchronizing CUDA operation" (once per site)
    grep "synchronizing" "$OUT/check_$mode.log" | cut -c1-160 | sort | uniq -c | head -25
  done
  ;;
smoke)
  timeout 200 python benchmarks/kill_rank_gpu.py --out "$OUT/kill" > "$OUT/kill_stdout.log" 2>&1
  echo "kill_rank rc=$?"; grep -E '"passed"|seconds_fault_to_exit|message_source' "$OUT/kill_stdout.log"
  CUDA_VISIBLE_DEVICES=0 timeout 200 $E2E --out "$OUT/e2e_1gpu" --nproc 1 --steps "$BASE_STEPS" \
    --variants vanilla freescale > "$OUT/e2e_1gpu.log" 2>&1
  echo "1gpu rc=$?"; tail -25 "$OUT/e2e_1gpu.log"
  timeout 200 $E2E --out "$OUT/e2e_smoke" --nproc 2 --steps 40 --profile-steps 4 \
    --trace-dir "$OUT/e2e_smoke/traces" > "$OUT/e2e_smoke.log" 2>&1
  echo "smoke rc=$?"; tail -30 "$OUT/e2e_smoke.log"
  ;;
main)
  # freescale_fbs (diagnostic, session 17): freescale with the paper's fbs, its balancer
  # until session 17, next to the new default (sticky on the refitted cost model): its
  # 1,000-step NE sat 5x above the in-rank noise floor at d1cf677 and 570414c
  # (~7 variants x 50 s; MAIN_EXTRA= for the six of session 16; session 16's extras
  # were freescale_sticky freescale_sticky2)
  timeout 570 $HEAD --out "$OUT/e2e" --nproc 2 --steps "$STEPS" \
    --variants vanilla vanilla_reordered vanilla_reordered_b vanilla_shuffled sdd freescale \
    ${MAIN_EXTRA-freescale_fbs} \
    > "$OUT/e2e_main.log" 2>&1
  echo "main rc=$?"; tail -40 "$OUT/e2e_main.log"
  # CUPTI released after each profiled window? (Trainer sets TEARDOWN_CUPTI=1, dbde1b3)
  python -c "import json,sys; [print(r['variant'], round(r['qps']), 'cupti_teardown', \
(r.get('gpu_accounting') or {}).get('cupti_teardown'), 'exposed by kind', \
(r.get('gpu_accounting') or {}).get('exposed_by_kind_ms_this_rank')) for r in json.load(open(sys.argv[1]))['rows']]" \
    "$OUT/e2e/e2e.json" || true
  ;;
update)
  timeout 570 $E2E --out "$OUT/e2e_update" --nproc 2 --steps "$STEPS" \
    --variants vanilla vanilla_sync_update vanilla_padded_update freescale freescale_padded_update \
    > "$OUT/e2e_update.log" 2>&1
  echo "update rc=$?"; tail -40 "$OUT/e2e_update.log"
  ;;
ne)
  # float32 attention costs ~366 ms of dense time per step (vs ~32 ms bfloat16 flex; the
  # 1,000-step version of this phase ran out of time after one variant at 638f4a4), so
  # both dtypes run NE_STEPS (150) steps: compare the distances within each run
  for dt in bfloat16 float32; do
    timeout 400 $E2E --out "$OUT/e2e_ne_$dt" --nproc 2 --steps "${NE_STEPS:-150}" \
      --attention-dtype "$dt" --variants vanilla vanilla_reordered vanilla_shuffled balance_fbs balance \
      > "$OUT/e2e_ne_$dt.log" 2>&1
    echo "ne $dt rc=$?"; grep -E "ne_|qps_ratio" "$OUT/e2e_ne_$dt.log" | head -12
    rm -rf "$OUT/e2e_ne_$dt/traces" "$OUT"/e2e_ne_"$dt"/*.png
  done
  ;;
smcheck|smfree)
  [ "$1" = smfree ] && exec bash "$0" smcheck_then_e2e
  ;;&
smcheck|smcheck_then_e2e)
  # the prioritized mask exchange issued in the forward (f8f8ebf): tier 1 on CUDA first
  timeout 240 python -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/check_prioritized_cuda.py > "$OUT/verify_prioritized.log" 2>&1
  echo "check_prioritized_cuda rc=$?"; tail -3 "$OUT/verify_prioritized.log"
  timeout 150 python -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_check_comm.py \
    > "$OUT/gpu_check_comm.log" 2>&1
  echo "gpu_check_comm rc=$?"; grep -E "gpu_check_comm:|MISMATCH|UNAVAILABLE|device completions|handshake per|caught per" \
    "$OUT/gpu_check_comm.log" | head -20; grep -c CAUGHT "$OUT/gpu_check_comm.log"
  [ "$1" = smcheck ] && exit 0
  ;;&
smcheck_then_e2e|sme2e)
  timeout 420 $E2E --out "$OUT/e2e_smfree" --nproc 2 --steps "${SMFREE_STEPS:-600}" \
    --variants vanilla freescale freescale_host_completion freescale_nccl_overlap \
    > "$OUT/e2e_smfree.log" 2>&1
  echo "smfree e2e rc=$?"; grep -E "^\| " "$OUT/e2e_smfree/e2e.md" | cut -c1-220
  python -c "import json,sys; [print(r['variant'], r['activity'].get('copy_engine_completion'), \
r['activity'].get('copy_engine_device_completions')) for r in json.load(open(sys.argv[1]))['rows']]" \
    "$OUT/e2e_smfree/e2e.json"
  rm -rf "$OUT/e2e_smfree/traces" "$OUT"/e2e_smfree/*.png
  ;;
s9a)
  # session 9 first call (~6 min): prepare_backward's refactor (_gradient_free_part) re-checked
  # at tier 1 on CUDA, then bal64, then exposed_comm.py with prepare_backward
  timeout 240 python -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/check_prioritized_cuda.py > "$OUT/verify_prioritized.log" 2>&1
  echo "check_prioritized_cuda rc=$?"; tail -4 "$OUT/verify_prioritized.log"
  bash "$0" bal64
  mkdir -p "$OUT/xc_prepare"
  timeout 170 python -m torch.distributed.run --nproc-per-node 2 benchmarks/exposed_comm.py \
    --out "$OUT/xc_prepare" --git-sha "${FREESCALE_GIT_SHA:-}" > "/tmp/xc_prepare.log" 2>&1
  echo "exposed_comm prepare rc=$?"; grep -E '^\[|"reduction"|"fraction_of_floor"|"fit_r2"' /tmp/xc_prepare.log
  rm -f "$OUT/xc_prepare"/*.png
  ;;
s9b)
  # (~6.5 min) early vs late prepare_backward at 1,000 steps (freescale fell from 6,503 to
  # 6,047 QPS between 40571f4 and 0765dec), then freescale_nccl_overlap, which ran past
  # the ablate phase's limit at 0765dec: 200 steps each way with a 30 s collective timeout
  timeout 260 $E2E --out "$OUT/e2e_prep" --nproc 2 --steps "$STEPS" \
    --variants vanilla freescale freescale_late_prepare > "$OUT/e2e_prep.log" 2>&1
  echo "prep rc=$?"; grep -E "^\| " "$OUT/e2e_prep/e2e.md" | cut -c1-400
  rm -rf "$OUT/e2e_prep/traces" "$OUT"/e2e_prep/*.png
  for v in early late; do
    extra=""; [ "$v" = late ] && extra="--late-prepare"
    timeout 80 python -m freescale.cli train --device cuda --nproc 2 --steps 200 --mode freescale \
      --overlap-backend default --timeout 30 --timing events --zipf-s 0.6 --eval-every 0 $extra \
      > "$OUT/ncclov_$v.log" 2>&1
    echo "nccl overlap $v rc=$?"; grep -E "QPS|Error|error|timed out|Timeout" "$OUT/ncclov_$v.log" | tail -5
    tail -c 600 "$OUT/ncclov_$v.log"
  done
  ;;
gil)
  # (~6 min) the GIL question: every row has the GIL probe's wait; Python's switch interval
  # at 0.5 ms vs 5 (vanilla and freescale); two passes (A B C D A B C D) so each ratio
  # comes with its run-to-run spread; the profiled steps record GPU activity only
  # (--profile-activities cuda): does the profiler still stretch freescale's steps?
  timeout 560 $E2E --out "$OUT/e2e_gil" --nproc 2 --steps "${GIL_STEPS:-600}" --repeats 2 \
    --profile-activities "${GIL_PROFILE:-cuda}" \
    --variants vanilla freescale vanilla_fast_switch freescale_fast_switch \
    > "$OUT/e2e_gil.log" 2>&1
  echo "gil rc=$?"; grep -E "^\| " "$OUT/e2e_gil/e2e.md" | cut -c1-600
  rm -rf "$OUT/e2e_gil/traces" "$OUT"/e2e_gil/*.png
  ;;
pin)
  # (~6 min) does freescale's bimodal QPS (4,400-6,100 across runs of one code at e756e56)
  # come from where its host threads land? Pinned by role vs left to the scheduler, two
  # passes; the report's host_topology says whether the host has SMT
  lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node[0-9]* CPU|Model name)" || true
  nvidia-smi topo -m 2>/dev/null | head -5 || true
  python -c "from freescale.pipeline.placement import gpu_local_cpus as g; import torch; \
print('GPU local CPUs:', [sorted(g(i) or []) for i in range(torch.cuda.device_count())])" || true
  timeout 560 $E2E --out "$OUT/e2e_pin" --nproc 2 --steps "${PIN_STEPS:-500}" --repeats 2 \
    --profile-activities cuda --variants vanilla freescale freescale_pinned vanilla_pinned \
    > "$OUT/e2e_pin.log" 2>&1
  echo "pin rc=$?"; grep -E "^\| |^Host" "$OUT/e2e_pin/e2e.md" | cut -c1-400
  grep -h "placement" "$OUT/e2e_pin.log" | head -4
  rm -rf "$OUT/e2e_pin/traces" "$OUT"/e2e_pin/*.png
  ;;
gloo)
  timeout 120 python benchmarks/gloo_host.py --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" \
    2>&1 | tail -3
  # the copy engine's per-call overhead with each handshake (gloo vs shared memory), CUDA
  timeout 120 python benchmarks/copy_engine_call.py --device cuda --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" 2>&1 | tail -4
  ;;
xcpin)
  mkdir -p "$OUT/xc_pin"
  timeout 200 python -m torch.distributed.run --nproc-per-node 2 benchmarks/exposed_comm.py \
    --out "$OUT/xc_pin" --git-sha "${FREESCALE_GIT_SHA:-}" --pin-threads > "/tmp/xc_pin.log" 2>&1
  echo "exposed_comm pinned rc=$?"
  grep -E '^\[|"reduction"|"fraction_of_floor"|"fit_r2"|issue_skew' /tmp/xc_pin.log | head -20
  rm -f "$OUT/xc_pin"/*.png
  ;;
kv4)
  timeout 150 python benchmarks/check_kernels_cuda.py > "$OUT/verify_kernels.log" 2>&1
  echo "check_kernels_cuda rc=$?"; tail -5 "$OUT/verify_kernels.log"
  for v in v3 v4; do
    FREESCALE_TRITON_DISPATCH=$v timeout 150 python -m freescale.cli train --device cuda --nproc 2 \
      --steps 300 --mode vanilla --timing events --zipf-s 0.6 --no-progress > "$OUT/kv4_$v.log" 2>&1
    echo "== dispatch $v rc=$?"; grep -E "QPS|eval NE|stage ms|Error" "$OUT/kv4_$v.log"
  done
  ;;
smc)
  # (~3 min) issue 6's figure with the copy engine's device-side completion (the default)
  mkdir -p "$OUT/smc"
  timeout 400 python -m torch.distributed.run --nproc-per-node 2 benchmarks/sm_contention.py \
    --out "$OUT/smc" --git-sha "${FREESCALE_GIT_SHA:-}" > "$OUT/smc.log" 2>&1
  echo "sm_contention rc=$?"; tail -30 "$OUT/smc.log"
  rm -f "$OUT"/smc/*.png
  ;;
smc5)
  # (~4.5 min) issue 6, session 15's canonical: the copy engine paced to NCCL's byte rate
  # (copy_engine_paced, on by default), each overlapped window paired with its own alone
  # window plus a null row (the method's bias), and 100 ms of GPU idle before every timed
  # window (without it the GEMM's null row was +6%: the GEMM runs at the power limit)
  # SMC5_CLOCKS=1: SM clock and power sampled every 100 ms alongside (is the paced copy
  # engine's GEMM slowdown a clock drop? the rows' finished_unix line up with the CSV)
  # SMC_WORKLOAD_FROM=E2E_JSON: the workload cell is the size of one SM-free collective
  # measured in that e2e report (sm_contention.py --workload-from), not the 220e6 default
  mkdir -p "$OUT/smc5"
  wl=()
  [ -n "${SMC_WORKLOAD_FROM:-}" ] && wl=(--workload-from "$SMC_WORKLOAD_FROM")
  if [ "${SMC5_CLOCKS:-0}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
      --format=csv,noheader -lms 100 > "$OUT/smc5/clocks.csv" 2>/dev/null &
    smi=$!
  fi
  timeout 400 python -m torch.distributed.run --nproc-per-node 2 benchmarks/sm_contention.py \
    --out "$OUT/smc5" --git-sha "${FREESCALE_GIT_SHA:-}" --reps 15 --no-probe --paired-alone \
    --cooldown-ms 100 --time-budget-s 260 --total-budget-s 300 ${wl[@]+"${wl[@]}"} > "$OUT/smc5.log" 2>&1
  echo "sm_contention rc=$?"
  [ -n "${smi:-}" ] && kill "$smi" 2>/dev/null
  ;;
smc2)
  # (~2.5 min) issue 6 again with 3x the repetitions (the worst ratio cell at 1165645 was
  # attention at 64 MB, where NCCL's own slowdown was 1.5% +- 3.6%), without the known-
  # failing NCCL zero-CTA probe, and the GPUs' SM clock and power sampled every 100 ms
  # alongside (is the copy engine's GEMM slowdown a clock drop?)
  mkdir -p "$OUT/smc2"
  nvidia-smi --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 100 > "$OUT/smc2/clocks.csv" 2>/dev/null &
  smi=$!
  timeout 400 python -m torch.distributed.run --nproc-per-node 2 benchmarks/sm_contention.py \
    --out "$OUT/smc2" --git-sha "${FREESCALE_GIT_SHA:-}" --reps 15 --no-probe \
    --total-budget-s 380 > "$OUT/smc2.log" 2>&1
  echo "sm_contention rc=$?"; kill $smi 2>/dev/null
  grep -A12 '"headline"' "$OUT/smc2/sm_contention.json" | head -40
  rm -f "$OUT"/smc2/*.png
  ;;
gildata)
  # (~1 min) the data stage's lock hold on the GPU host (enough cores: the lock, not the
  # scheduler): loader and loader + FBS on a thread, a GIL probe on the main thread
  timeout 200 python benchmarks/gil_data_stage.py --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" \
    2>&1 | grep -E "^\{|wrote"
  ;;
ncclov)
  # (~4 min) the collective prepare_backward with a NCCL side group (64cecfa): tier 1 on
  # CUDA (rows say prepare_blocks), then freescale_nccl_overlap at 1,000 steps (it stalled
  # at 0765dec) next to vanilla
  timeout 240 python -m torch.distributed.run --nproc-per-node 2 \
    benchmarks/check_prioritized_cuda.py > "$OUT/verify_prioritized.log" 2>&1
  echo "check_prioritized_cuda rc=$?"; tail -3 "$OUT/verify_prioritized.log"
  timeout 300 $E2E --out "$OUT/e2e_ncclov" --nproc 2 --steps "$STEPS" --timeout 120 \
    --variants vanilla freescale_nccl_overlap > "$OUT/e2e_ncclov.log" 2>&1
  echo "ncclov rc=$?"; grep -E "^\| " "$OUT/e2e_ncclov/e2e.md" | cut -c1-300
  rm -rf "$OUT/e2e_ncclov/traces" "$OUT"/e2e_ncclov/*.png
  ;;
checks9)
  bash "$0" bal64
  for v in prepare late; do
    extra=""; [ "$v" = late ] && extra="--late-prepare"
    mkdir -p "$OUT/xc_$v"
    timeout 170 python -m torch.distributed.run --nproc-per-node 2 benchmarks/exposed_comm.py \
      --out "$OUT/xc_$v" --git-sha "${FREESCALE_GIT_SHA:-}" $extra > "/tmp/xc_$v.log" 2>&1
    echo "exposed_comm $v rc=$?"; grep -E '^\[|"reduction"|"fraction_of_floor"|"fit_r2"' "/tmp/xc_$v.log"
    rm -f "$OUT/xc_$v"/*.png
  done
  ;;
bal64)
  timeout 240 python -m torch.distributed.run --nproc-per-node 2 benchmarks/check_balance_cuda.py \
    --out "$OUT" --git-sha "${FREESCALE_GIT_SHA:-}" > "$OUT/balance_cuda_check.log" 2>&1
  echo "check_balance_cuda rc=$?"; grep -E "^\{|balance CUDA check" "$OUT/balance_cuda_check.log"
  ;;
lowcoll)
  timeout 560 $E2E --num-items 20000000 --out "$OUT/e2e_lowcoll" --nproc 2 \
    --steps "${LOWCOLL_STEPS:-500}" --variants vanilla prioritized freescale \
    > "$OUT/e2e_lowcoll.log" 2>&1
  echo "lowcoll rc=$?"; grep -E "^\| " "$OUT/e2e_lowcoll/e2e.md" | cut -c1-220
  grep -E "qps_ratio|reduction|ne_rel" "$OUT/e2e_lowcoll.log" | head -12
  rm -rf "$OUT/e2e_lowcoll/traces" "$OUT"/e2e_lowcoll/*.png
  ;;
hostt)
  for mode in vanilla freescale; do
    mkdir -p "$OUT/hostt_$mode"
    FS_HOSTT=1 FS_HOSTT_WARM=20 FS_HOSTT_OUT="$OUT/hostt_$mode" PYTHONPATH=benchmarks/host_time:src \
      timeout 100 python -m freescale.cli train --device cuda --nproc 2 --steps 60 --mode "$mode" \
      --timing events --zipf-s 0.6 --no-progress --eval-every 0 > "/tmp/hostt_$mode.log" 2>&1
    echo "$mode rc=$?"; grep -E "QPS|host CPU" "/tmp/hostt_$mode.log"; head -12 "$OUT"/hostt_"$mode"/*.txt
    grep -h -A8 "thread CPU" "$OUT"/hostt_"$mode"/*.txt
  done
  ;;
ablate)
  CUDA_VISIBLE_DEVICES=0 timeout 200 $HEAD --out "$OUT/e2e_1gpu" --nproc 1 --steps "$BASE_STEPS" \
    --variants vanilla freescale > "$OUT/e2e_1gpu.log" 2>&1
  echo "1gpu rc=$?"; tail -22 "$OUT/e2e_1gpu.log"
  timeout 380 $HEAD --out "$OUT/e2e" --nproc 2 --steps "$STEPS" --variants prioritized balance freescale_nccl_overlap \
    --merge "${MERGE:?set MERGE to the main e2e.json}" --baseline "$OUT/e2e_1gpu/e2e.json" \
    > "$OUT/e2e_ablate.log" 2>&1
  echo "ablate rc=$?"; tail -40 "$OUT/e2e_ablate.log"
  ;;
cwait)
  # (~3 min) where freescale's training thread blocks on the host: the copy engine vs a
  # NCCL side group for the overlapped traffic (freescale_nccl_overlap was 3.5% faster in
  # both passes at 1165645), with the "host wait ms training thread" column (host ms per
  # step inside collectives' wait(); per collective in each row's summary.host_cpu)
  timeout 380 $E2E --out "$OUT/e2e_cwait" --nproc 2 --steps "${CWAIT_STEPS:-300}" --repeats 2 \
    --profile-activities cuda \
    --variants vanilla freescale freescale_nccl_overlap \
    > "$OUT/e2e_cwait.log" 2>&1
  echo "cwait rc=$?"; grep -E "^\| " "$OUT/e2e_cwait/e2e.md" | cut -c1-600
  python - "$OUT/e2e_cwait/e2e.json" <<'PY' || true
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    hc = (r.get("summary") or {}).get("host_cpu") or {}
    top = sorted((hc.get("host_wait_training") or {}).items(), key=lambda kv: -kv[1]["ms_per_step"])
    print(r["variant"], [(k, round(v["ms_per_step"], 2)) for k, v in top[:6]])
PY
  rm -rf "$OUT/e2e_cwait/traces" "$OUT"/e2e_cwait/*.png
  ;;
s13a)
  # next session, first call (~7.5 min): the copy-engine checks (stream-gate variants gone),
  # then the headline main run with CUPTI released after each profiled window (dbde1b3)
  bash "$0" smcheck
  bash "$0" main
  ;;
s13b)
  # second call (~9 min): ablate (1-GPU baseline + prioritized / balance /
  # freescale_nccl_overlap merged into s13a's e2e.json, copied into the tree first), then
  # dmet (the deferred metrics all-gather A/B)
  bash "$0" ablate
  bash "$0" dmet
  ;;
dmet)
  # (~4.5 min) freescale with each step's record finished a step later still
  # (TrainConfig.defer_metrics: the per-step stage-times all-gather, 2.9 ms of freescale's
  # training-thread wait at 6bd6de1, in flight for a step instead of a host barrier);
  # two passes, A B C / C B A; same bits (tests/test_accounting.py)
  timeout 330 $HEAD --out "$OUT/e2e_dmet" --nproc 2 --steps "${DMET_STEPS:-300}" --repeats 2 \
    --variants vanilla freescale freescale_deferred_metrics > "$OUT/e2e_dmet.log" 2>&1
  echo "dmet rc=$?"; grep -E "^\| " "$OUT/e2e_dmet/e2e.md" | cut -c1-300
  python - "$OUT/e2e_dmet/e2e.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"] + d.get("repeat_rows", []):
    hc = (r.get("summary") or {}).get("host_cpu") or {}
    w = (hc.get("host_wait_training") or {}).get("gloo:stage_times", {}).get("ms_per_step")
    print(r["variant"], r.get("pass"), round(r["qps"]), "deferred", r["summary"].get("metrics_deferred"), "stage_times wait", w)
PY
  rm -rf "$OUT/e2e_dmet/traces" "$OUT"/e2e_dmet/*.png
  ;;
omp)
  # (~8 min) is freescale's host slowed by OpenMP teams spinning? 2 ranks x 2 teams
  # (training + data stage) x 8 threads = 32 spinning workers on 32 cores. Profiler-free
  # A/B/A-reversed, 200 steps: default; OMP_WAIT_POLICY=PASSIVE (libgomp workers sleep at
  # once); --cpu-threads 4
  for cfgname in default passive t4; do
    envs=""; extra=""
    [ "$cfgname" = passive ] && envs="OMP_WAIT_POLICY=PASSIVE"
    [ "$cfgname" = t4 ] && extra="--cpu-threads 4"
    env $envs timeout 160 $HEAD --out "$OUT/e2e_omp_$cfgname" --nproc 2 --steps "${OMP_STEPS:-200}" \
      --repeats 2 --profile-steps 0 $extra --variants vanilla freescale > "$OUT/e2e_omp_$cfgname.log" 2>&1
    echo "omp $cfgname rc=$?"
    python - "$OUT/e2e_omp_$cfgname/e2e.json" "$cfgname" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"] + d.get("repeat_rows", []):
    s = r.get("summary") or {}
    hc = s.get("host_cpu") or {}
    g = {k: round(v, 1) for k, v in (hc.get("by_group_ms_per_step") or {}).items()}
    dt = ((s.get("data_thread") or {}).get("timing") or {}).get("busy_ms")
    print(sys.argv[2], r["variant"], r.get("pass"), round(r["qps"]), "threads", s.get("cpu_threads"),
          "cpu/wall", round(hc.get("cpu_over_wall", 0), 2), g, "data busy", dt)
PY
    rm -rf "$OUT/e2e_omp_$cfgname/traces" "$OUT"/e2e_omp_"$cfgname"/*.png
  done
  ;;
hang2)
  # (~5-8 min) session 14: freescale_no_balance hung at ef8d370 and again at c6be283 (prepare
  # fix in) when it ran after vanilla and prioritized in one invocation; alone it ran 300
  # steps twice. Suspect (helper review + torch source): DDP's comm-hook `then` runs each
  # callback on a stream drawn round robin from torch's low-priority pool and makes it wait
  # on the all-reduce; the copy engine's copy stream came from the same pool, so an
  # all-reduce wait could land in a stream that holds waits on the peer. a42b837+ draws the
  # copy streams from the high-priority pool (CopyEngineConfig.stream_priority = -1).
  # 1: the old pool (FREESCALE_COPY_STREAM_PRIORITY=0), prioritized then no_balance, every
  #    thread's stack after 20 s without a finished step, collective timeout 60 s;
  # 2: the same with the new default; 3: no_balance alone, 1,000 steps, new default.
  FREESCALE_COPY_STREAM_PRIORITY=0 timeout 200 $HEAD --out "$OUT/e2e_hang2_pool0" --nproc 2 \
    --steps 200 --profile-steps 0 --timeout 60 --stall-dump-s 20 \
    --variants prioritized freescale_no_balance > "$OUT/e2e_hang2_pool0.log" 2>&1
  echo "old pool rc=$?"; grep -c "Timeout (" "$OUT/e2e_hang2_pool0.log"
  timeout 200 $HEAD --out "$OUT/e2e_hang2_hi" --nproc 2 --steps 200 --profile-steps 0 \
    --timeout 60 --stall-dump-s 20 --variants prioritized freescale_no_balance \
    > "$OUT/e2e_hang2_hi.log" 2>&1
  echo "high-priority pool rc=$?"; grep -c "Timeout (" "$OUT/e2e_hang2_hi.log"
  timeout 150 $HEAD --out "$OUT/e2e_hang2_alone" --nproc 2 --steps 1000 --profile-steps 0 \
    --timeout 60 --stall-dump-s 20 --variants freescale_no_balance \
    > "$OUT/e2e_hang2_alone.log" 2>&1
  echo "alone rc=$?"; grep -c "Timeout (" "$OUT/e2e_hang2_alone.log"
  rm -rf "$OUT"/e2e_hang2*/traces "$OUT"/e2e_hang2*/*.png
  ;;
sticky)
  # (~7 min) session 15: the sticky partitioner (equal-count swaps from home; 2.4 samples
  # moved per step instead of 127, 2.3x less balancer CPU on the dev box) against fbs
  three_passes e2e_sticky "${STICKY_LIMIT:-560}" "${STICKY_STEPS:-400}" \
    vanilla freescale_fbs freescale_sticky
  ;;
verify1)
  # (~5 min, one H200) the checks that run on one GPU, at the defaults (the fused Adagrad
  # update on since session 24): per-row sum, sparse update modes bitwise vs sync, every
  # kernel check (with the in-place Adagrad stress), then the 1-GPU e2e with no switch set
  timeout 90 python benchmarks/check_segment_sum_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" > "$OUT/verify_segment_sum.log" 2>&1
  echo "check_segment_sum rc=$?"; tail -2 "$OUT/verify_segment_sum.log"
  timeout 100 python benchmarks/check_sparse_update_cuda.py --out "$OUT" \
    --git-sha "${FREESCALE_GIT_SHA:-}" > "$OUT/verify_sparse_update.log" 2>&1
  echo "check_sparse_update rc=$?"; tail -2 "$OUT/verify_sparse_update.log"
  timeout 150 python benchmarks/check_kernels_cuda.py > "$OUT/verify_kernels.log" 2>&1
  echo "check_kernels_cuda rc=$?"; grep -E "MISMATCH|under load|mutant|kernel check" \
    "$OUT/verify_kernels.log"
  timeout 200 $HEAD --out "$OUT/e2e_1gpu" --nproc 1 --steps 200 --variants vanilla freescale \
    > "$OUT/e2e_1gpu.log" 2>&1
  echo "e2e rc=$?"
  grep -E "^\| (vanilla|freescale) " "$OUT/e2e_1gpu/e2e.md" | cut -d'|' -f1-6,16-18
  ;;
compiles1)
  # (~2 min a tree, one H200) Triton compiles by time and call site in the 1-GPU e2e at
  # the defaults (FS_TRITON_COMPILES, benchmarks/host_time/sitecustomize.py): a kernel
  # variant first used in the profiled last steps stalls the host for its whole compile,
  # which the report counts as bubble (session 25: freescale's was 197-325 ms per profiled
  # step in every 1-GPU run with the fused Adagrad on). OLD_SRC=<dir>: that tree first.
  # First the check that CompileWatch (the report's own count) sees real compiles.
  timeout 60 python benchmarks/check_compile_watch_cuda.py > "$OUT/check_compile_watch.log" 2>&1
  echo "check_compile_watch rc=$?"; tail -2 "$OUT/check_compile_watch.log"
  for tree in ${OLD_SRC:-} src; do
    name=now; [ "$tree" = src ] || name=old
    # fresh compile caches for each tree: the second run must not find the first's
    TORCHINDUCTOR_CACHE_DIR="/tmp/inductor_$name" TRITON_CACHE_DIR="/tmp/triton_$name" \
    FS_TRITON_COMPILES="$OUT/compiles_$name" PYTHONPATH="benchmarks/host_time:$tree" \
      timeout "${COMPILES_LIMIT:-200}" $HEAD --out "$OUT/e2e_1gpu_$name" --nproc 1 \
      --steps "${COMPILES_STEPS:-200}" \
      --variants vanilla freescale > "$OUT/e2e_1gpu_$name.log" 2>&1
    echo "$name rc=$?"
    grep -E "^\| (variant|vanilla|freescale) " "$OUT/e2e_1gpu_$name/e2e.md" | cut -d'|' -f1-6
    python - "$OUT/compiles_$name" "$OUT/e2e_1gpu_$name/e2e.json" <<'PY' | tee "$OUT/compiles_$name.txt"
import glob, json, os, sys
rep = json.load(open(sys.argv[2]))
for r in rep["rows"]:
    g = r.get("gpu_accounting") or {}
    print(r["variant"], "bubble_ms", g.get("bubble_ms"), "window_ms", g.get("window_ms"),
          "compiles in window (CompileWatch)", g.get("jit_compiles_in_window"),
          g.get("dynamo_graphs_in_window"))
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.jsonl"))):
    rows = [json.loads(x) for x in open(f)]
    t0, t1 = rows[0]["t_start"], max(r["t_start"] + r["seconds"] for r in rows)
    total = sum(r["seconds"] for r in rows)
    end = os.path.getmtime(sys.argv[2]) - t0
    print(f"{os.path.basename(f)}: {len(rows)} compiles, {total:.1f} s; report written "
          f"{end:.1f} s after the first; the last 6 (start s after the first; seconds; "
          f"kernel; caller):")
    for r in rows[-6:]:
        print(f"  {r['t_start'] - t0:8.1f} {r['seconds']:6.2f}  {r['kernel'].split('.')[-1]:34s} "
              f"{r['thread'][:12]:12s} {r['caller']}")
PY
  done
  ;;
optim1)
  # (~5 min, one H200) session 23's fused row-wise Adagrad before it becomes the default:
  # the bitwise check (unique rows in place, the padded update's repeats in two launches),
  # then the 1-GPU e2e with the kernel on (eval NE must be 0.991714 in both modes, as with
  # the PyTorch update) and the same run with it off, for the calls per step
  timeout 90 python benchmarks/check_kernels_cuda.py --only sparse_optim \
    > "$OUT/check_sparse_optim.log" 2>&1
  echo "check rc=$?"; tail -4 "$OUT/check_sparse_optim.log"
  for mode in auto reference; do
    FREESCALE_SPARSE_OPTIM=$mode timeout 200 $HEAD --out "$OUT/e2e_optim_$mode" --nproc 1 \
      --steps 200 --variants vanilla freescale > "$OUT/e2e_optim_$mode.log" 2>&1
    echo "e2e $mode rc=$?"
    grep -E "^\| (vanilla|freescale) " "$OUT/e2e_optim_$mode/e2e.md" | cut -d'|' -f1-6,16-18
  done
  ;;
floor)
  # (~6.5 min) is freescale's NE distance (3.1e-6 at 7bb1abe, 5.9e-5 at 80c5b3c) inside
  # the band of legal reorderings? Four in-rank orders instead of two, and freescale twice
  # (its plans follow its measured times, so two runs differ within tier 2)
  timeout 570 $HEAD --out "$OUT/e2e_floor" --nproc 2 --steps "$STEPS" \
    --variants vanilla vanilla_reordered vanilla_reordered_b vanilla_reordered_c \
    vanilla_reordered_d freescale freescale_again > "$OUT/e2e_floor.log" 2>&1
  echo "floor rc=$?"; grep -E "ne_|qps_ratio" "$OUT/e2e_floor.log" | tail -20
  ;;
partab)
  # (~6 min; 291 s with 5 variants at 570414c) session 16: the partitioners on GPUs. sticky balances exactly the costs it
  # plans with (on L^1.5 the simulator puts it at 2x fbs's straggler share from 64 ranks
  # up: sticky_robustness.json); freescale_sticky_cost refits a*L + b*L^2 + c from the
  # measured dense times every 20 steps (does the online fit work here, and what does it
  # fit: e2e_passes.py prints the row's activity.balance_cost_model); freescale_sticky2 balances total length
  # and total squared length at once (0.02-0.2% in the simulator under every such cost).
  # 300 steps, profiler-free, 3 passes. Ran at 570414c (e2e_partab_570414c.*); since
  # session 17 freescale IS sticky on the refitted model, so fbs runs as freescale_fbs;
  # freescale_verify_plans checks every plan's checksum across the ranks (the step-keyed
  # learning fix, 3f886e0, on GPUs) and shows what the check costs
  three_passes e2e_partab "${PARTAB_LIMIT:-570}" "${PARTAB_STEPS:-300}" \
    vanilla freescale freescale_fbs freescale_sticky freescale_sticky2 freescale_verify_plans
  ;;
rep3)
  # (~7 min) session 15: freescale / vanilla moved from 0.910 to 1.139 to 1.023 between
  # single-pass runs while vanilla stayed at 6,043-6,063; freescale_no_balance (no balancer)
  # gave 6,340-6,406 in three runs. Three passes in one invocation, profiler-free, give
  # the spread of the ratio within one call (per pass, and the median)
  three_passes e2e_rep3 "${REP3_LIMIT:-560}" "${REP3_STEPS:-400}" \
    vanilla freescale freescale_no_balance
  ;;
prepab)
  # (~6 min) session 14: did c39168e's blocking prepare_backward change freescale's QPS?
  # vanilla, freescale, freescale_local_prepare (the pre-c39168e rank-local choice; with
  # the balancer it never hung), profiler-free, 300 steps, 2 passes (A B C / C B A)
  timeout "${PREPAB_LIMIT:-500}" $HEAD --out "$OUT/e2e_prepab" --nproc 2 --steps "${PREPAB_STEPS:-300}" \
    --repeats 2 --profile-steps 0 --timeout 60 \
    --variants vanilla freescale freescale_local_prepare > "$OUT/e2e_prepab.log" 2>&1
  echo "prepab rc=$?"
  python - "$OUT/e2e_prepab/e2e.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("host_calibration", d.get("host_calibration"))
for r in d["rows"] + d.get("repeat_rows", []):
    s = r["summary"]; a = r["activity"]; hc = s.get("host_cpu") or {}
    g = hc.get("by_group_ms_per_step") or {}
    print(r["variant"], r.get("pass"), round(r["qps"]), "wall", round(hc.get("wall_ms_per_step", 0), 1),
          "train", round(g.get("training", 0), 1), "prepared", a.get("prepared_steps"),
          "blocks", a.get("prepare_blocks"), "ne", r.get("eval_ne"))
PY
  rm -rf "$OUT/e2e_prepab/traces" "$OUT"/e2e_prepab/*.png
  ;;
hang)
  # (~3 min) ef8d370 hung in freescale_no_balance (baldiag, session 14): the default group's
  # all-reduce stuck on both ranks (copy engine with device completion, prepare_backward
  # deciding rank-locally). Now prepare blocks when the side group orders on the device.
  # 1: that variant with the fix; 2: --late-prepare (the same order on every rank without
  # the fix's wait). A hang fails in 60 s (collective timeout), not 300.
  timeout 150 $HEAD --out "$OUT/e2e_hang_fixed" --nproc 2 --steps 300 --profile-steps 0 \
    --timeout 60 --variants freescale_no_balance > "$OUT/e2e_hang_fixed.log" 2>&1
  echo "fixed rc=$?"
  timeout 150 $HEAD --out "$OUT/e2e_hang_late" --nproc 2 --steps 300 --profile-steps 0 \
    --timeout 60 --late-prepare --variants freescale_no_balance > "$OUT/e2e_hang_late.log" 2>&1
  echo "late rc=$?"
  for f in fixed late; do
    python - "$OUT/e2e_hang_$f/e2e.json" "$f" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    a = r["activity"]
    print(sys.argv[2], r["variant"], round(r["qps"]), "steps", r["summary"].get("steps"),
          "prepared", a.get("prepared_steps"), "blocks", a.get("prepare_blocks"),
          "completion", a.get("copy_engine_completion"), "prioritized", a.get("prioritized_steps"))
PY
    rm -rf "$OUT/e2e_hang_$f/traces" "$OUT"/e2e_hang_"$f"/*.png
  done
  ;;
baldiag)
  # (~6 min) session 13: prioritized alone 1.044, balancing alone 1.062, together 0.910.
  # Profiler-free, 200 steps, 2 passes (A..F / F..A): is it the sample exchange (shadow
  # plans but moves nothing), the balanced batches, or the copy engine (no_balance)?
  # BALDIAG_VARIANTS / BALDIAG_REPEATS split it: ~1 min per variant and pass (session 14)
  timeout "${BALDIAG_LIMIT:-420}" $HEAD --out "$OUT/e2e_baldiag" --nproc 2 \
    --steps "${BALDIAG_STEPS:-200}" --repeats "${BALDIAG_REPEATS:-2}" --profile-steps 0 \
    --variants ${BALDIAG_VARIANTS:-vanilla prioritized freescale_no_balance \
    freescale_shadow_balance balance freescale} > "$OUT/e2e_baldiag.log" 2>&1
  echo "baldiag rc=$?"
  python - "$OUT/e2e_baldiag/e2e.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("host_calibration", d.get("host_calibration"))
for r in d["rows"] + d.get("repeat_rows", []):
    s = r["summary"]; dt = s.get("data_thread") or {}; hc = s.get("host_cpu") or {}
    g = hc.get("by_group_ms_per_step") or {}
    print(r["variant"], r.get("pass"), round(r["qps"]), "wall", round(hc.get("wall_ms_per_step", 0), 1),
          "train", round(g.get("training", 0), 1), "data", round(g.get("data", 0), 1),
          "busy", round((dt.get("timing") or {}).get("busy_ms", 0), 1),
          {k: round(v, 1) for k, v in (dt.get("phases_ms") or {}).items()},
          "moved", r["activity"].get("samples_moved"))
PY
  rm -rf "$OUT/e2e_baldiag/traces" "$OUT"/e2e_baldiag/*.png
  ;;
phases)
  # (~3 min) where the data stage's busy time goes (summary data_thread.phases_ms: load,
  # hook:BalanceHook, id_counts, pin) and how fast this host is (host_calibration)
  timeout 170 $HEAD --out "$OUT/e2e_phases" --nproc 2 --steps "${PHASES_STEPS:-150}" --warmup-steps 10 \
    --profile-steps 0 --variants freescale balance > "$OUT/e2e_phases.log" 2>&1
  echo "phases rc=$?"
  python - "$OUT/e2e_phases/e2e.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("host_calibration", d.get("host_calibration"))
for r in d["rows"]:
    s = r["summary"]; dt = s.get("data_thread") or {}
    hc = s.get("host_cpu") or {}
    print(r["variant"], round(r["qps"]), "busy", round((dt.get("timing") or {}).get("busy_ms", 0), 2),
          {k: round(v, 2) for k, v in (dt.get("phases_ms") or {}).items()},
          {k: round(v, 1) for k, v in (hc.get("by_group_ms_per_step") or {}).items()})
PY
  rm -rf "$OUT/e2e_phases/traces" "$OUT"/e2e_phases/*.png
  ;;
*) echo "usage: $0 optim1|floor|baldiag|phases|omp|s13a|s13b|dmet|first|vcheck|verify|kernels|sparse|host|check|smoke|main|update|ne|smfree|smcheck|sme2e|checks9|s9a|s9b|gil|gildata|ncclov|pin|smc|kv4|gloo|xcpin|kprof|v5|bal64|lowcoll|kfig|hostt|ablate|cwait|smc2" >&2; exit 2 ;;
esac
