"""Jagged index kernels (ranged dispatch/combine, indexed permute, keyed transpose).

Owns: Triton kernels and their plain PyTorch references, dispatched by device. Product
code imports from here; see README.md in this folder for semantics and backends.
"""

from freescale.kernels.common import BACKEND_ENV_VAR, Backend, DispatchMode, DispatchResult
from freescale.kernels.ops import (
    indexed_permute,
    keyed_transpose,
    ranged_combine,
    ranged_combine_backward,
    ranged_dispatch,
)

__all__ = [
    "BACKEND_ENV_VAR",
    "Backend",
    "DispatchMode",
    "DispatchResult",
    "indexed_permute",
    "keyed_transpose",
    "ranged_combine",
    "ranged_combine_backward",
    "ranged_dispatch",
]
