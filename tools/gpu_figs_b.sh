#!/usr/bin/env bash
# GPU call B: tier-1 check of prioritized updates on NCCL + side streams, the SM-free
# backends' self-check, and the SM-contention figure (GEMM only, no NCCL probe).
set -x
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
SHA=${SHA:-unknown}
RUN="python3 -m torch.distributed.run --nproc-per-node 2"
timeout 150 $RUN benchmarks/check_prioritized_cuda.py --steps 40 --out $OUT 2>&1 | grep -E "optimizer|check|Error|error" | cut -c1-400
timeout 100 $RUN benchmarks/gpu_check_comm.py 2>&1 | grep -v -i warn | tail -15
timeout 200 $RUN benchmarks/sm_contention.py --out $OUT --git-sha $SHA --no-probe --kernels gemm 2>&1 | grep -v -i warn | tail -25
