#!/usr/bin/env bash
# First look on a GPU machine: environment, Triton kernels vs references, the CUDA
# tests that CI cannot run, and a short `freescale train` on 1 and all GPUs.
set -x
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())"
python3 benchmarks/check_kernels_cuda.py
python3 -m pytest -q -x tests/test_comm.py -k cuda -p no:cacheprovider 2>&1 | tail -5
STEPS=${STEPS:-12}
python3 -m freescale train --nproc 1 --device cuda --steps $STEPS --eval-every 0 --no-progress \
  --max-uih 16384 --median-uih 1024 --global-batch-size 128 --summary ${OUT:-/tmp}/smoke1.json
python3 -m freescale train --device cuda --steps $STEPS --eval-every 0 --no-progress \
  --max-uih 16384 --median-uih 1024 --summary ${OUT:-/tmp}/smoke2.json
