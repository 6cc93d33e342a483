#!/usr/bin/env bash
# Run the test suite (CPU, gloo ranks in shared process pools; Triton kernels in
# interpreter mode). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
