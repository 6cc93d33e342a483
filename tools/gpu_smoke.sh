#!/usr/bin/env bash
# First look on a GPU machine: environment, Triton kernels vs references (with what
# `ranged_dispatch` runs by default on this card), the CUDA tests that CI cannot run,
# the compile-counting check, and a short `freescale train` on 1 and all GPUs.
# Each step has its own time limit and its exit status is printed; the script's own
# status is 1 when any step failed.
set -x
export PYTHONPATH=src NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
fail=0
step() {  # step SECONDS CMD...: run CMD under a time limit, record a failure
  timeout "$@"
  local rc=$?
  echo "step rc=$rc: ${*:2}"
  [ $rc -eq 0 ] || fail=1
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.device_count())"
step 300 python3 benchmarks/check_kernels_cuda.py
step 180 python3 -m pytest -q -p no:cacheprovider tests/test_comm.py tests/test_accounting.py \
  tests/test_sparse_update.py tests/test_kernels_v5.py tests/test_copy_engine.py \
  -k "cuda or pinned or device_tally or on_gpu or two_gpus"
step 60 python3 benchmarks/check_compile_watch_cuda.py
STEPS=${STEPS:-12}
step 120 python3 -m freescale train --nproc 1 --device cuda --steps $STEPS --eval-every 0 \
  --no-progress --max-uih 16384 --median-uih 1024 --global-batch-size 128 \
  --summary ${OUT:-/tmp}/smoke1.json
step 120 python3 -m freescale train --device cuda --steps $STEPS --eval-every 0 --no-progress \
  --max-uih 16384 --median-uih 1024 --summary ${OUT:-/tmp}/smoke2.json
exit $fail
