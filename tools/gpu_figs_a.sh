#!/usr/bin/env bash
# GPU call A: figures baseline_gpu (1 and 2 H200) and kernels (1 H200), one call.
set -x
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
SHA=${SHA:-unknown}
CUDA_VISIBLE_DEVICES=0 timeout 280 python3 benchmarks/kernels.py --out $OUT --git-sha $SHA --budget-s 150 2>&1 | tail -40
timeout 300 python3 benchmarks/baseline_gpu.py --out $OUT --git-sha $SHA --steps ${STEPS:-100} 2>&1 | grep -v -i warn | tail -40
