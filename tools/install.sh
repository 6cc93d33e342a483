#!/usr/bin/env bash
# Install FreeScale and what it needs on a fresh machine (CPU: Python 3.10+, pip).
#   bash tools/install.sh          # package + runtime deps (torch CPU build, triton)
#   bash tools/install.sh --dev    # + TorchRec/fbgemm (CPU), test and lint tools
# On a machine that already has a CUDA torch (>= 2.11), torch is left as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
quiet="-q"
if ! python3 -c "import torch, sys; sys.exit(0 if tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]) >= (2, 11) else 1)" 2>/dev/null; then
  # pinned: an unpinned torch pulls a multi-GB CUDA build
  $PIP install $quiet "torch==2.13.0"
fi
$PIP install $quiet "numpy>=1.24" "tqdm>=4.60" "triton==3.6.0"
$PIP install $quiet --no-deps -e .
if [[ "${1:-}" == "--dev" ]]; then
  # TorchRec's metadata asks for the CUDA fbgemm-gpu: take the CPU build, then
  # TorchRec itself without dependencies, then its real dependencies.
  $PIP install $quiet "fbgemm-gpu-cpu==1.8.0"
  $PIP install $quiet --no-deps "torchrec==1.8.0"
  $PIP install $quiet "tensordict==0.15.3" "torchmetrics==1.9.0" "pyre-extensions==0.0.32" "iopath==0.1.10" \
    "pytest>=8" "pytest-timeout>=2.3" "ruff==0.17.6" matplotlib
fi
