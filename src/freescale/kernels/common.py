"""Types, backend selection and input checks shared by every jagged index kernel backend.

Owns: the `Backend` literal, the `DispatchResult` dataclass, the environment variable that
forces a backend, the argument validation every backend runs before touching data, and
the host-side integer helpers of the Triton launch code (`cdiv`, `next_power_of_2`).
It holds no kernel and no op semantics (those live in `reference.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Optional, get_args

import torch

Backend = Literal["auto", "reference", "triton", "vectorized"]
"""Which implementation runs an op.

- ``"auto"``: ``$FREESCALE_KERNEL_BACKEND`` if set, else Triton for CUDA tensors, else the
  reference;
- ``"reference"``: the readable PyTorch code in ``reference.py`` (the semantics);
- ``"vectorized"``: best-effort PyTorch without Python loops over ranks (``vectorized.py``);
  for ops whose reference is already loop-free it *is* the reference;
- ``"triton"``: ``triton_impl.py``; on CPU tensors it needs ``TRITON_INTERPRET=1`` set before
  triton is first imported (tests and the benchmark's smoke mode do that).
"""

DispatchMode = Literal["block", "modulo"]


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: `triton.cdiv`'s value. Triton 3.6's helpers are
    constexpr-function objects that cost ~2.5 us a call on a fast host (~0.03 us here),
    paid several times per launch on the host path that bounds small calls."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (0 for 0): `triton.next_power_of_2`'s value."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


BACKEND_ENV_VAR = "FREESCALE_KERNEL_BACKEND"
_CONCRETE_BACKENDS = ("reference", "vectorized", "triton")
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class DispatchResult:
    """Ids bucketed by owner rank, ready for the id all-to-all (shard-major layout).

    Shapes use N input ids, W destinations, K keys, B samples (per key).

    values: (N,) local row ids (id minus the owner's first row), ordered
        [dest][key][sample], in-sample order preserved; dtype of the input ids.
    lengths: (W*K*B,) segment lengths in that order; dtype of the input lengths.
    splits: (W,) int64, ids sent to each destination (``lengths.view(W, -1).sum(1)``).
    key_counts: (W, K) int64, ids per (destination, key).
    unbucketize_permute: (N,) int64, ``unbucketize_permute[i]`` is the position in
        ``values`` of input id i (fbgemm's sequence-mode output). Rows received back in
        shard-major order go back to batch-major with ``ranged_combine``.
    weights: (N,) per-id weights permuted like ``values`` (None if none were given).
    """

    values: torch.Tensor
    lengths: torch.Tensor
    splits: torch.Tensor
    key_counts: torch.Tensor
    unbucketize_permute: torch.Tensor
    weights: Optional[torch.Tensor] = None


def triton_available() -> bool:
    """True if triton can be imported (it is an optional dependency)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, device: torch.device) -> str:
    """Turn ``backend`` (possibly "auto") into a concrete backend name for ``device``.

    An explicit argument wins over ``$FREESCALE_KERNEL_BACKEND``, which wins over the
    device default (Triton on CUDA when importable, else the reference).
    """
    if backend not in get_args(Backend):
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {get_args(Backend)}")
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV_VAR, "auto").strip() or "auto"
        if backend not in get_args(Backend):
            raise ValueError(f"${BACKEND_ENV_VAR}={backend!r} is not one of {get_args(Backend)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("kernel backend 'triton' requested but triton is not installed")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                "the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before triton "
                "is first imported"
            )
    return backend


def check_dispatch_inputs(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    mode: str,
    weights: Optional[torch.Tensor],
) -> tuple[int, int]:
    """Validate ``ranged_dispatch`` arguments (shapes/dtypes only, no device sync).

    Returns (K, B). Contents are not checked: ids must be >= 0 and block sizes >= 1.
    """
    if mode not in ("block", "modulo"):
        raise ValueError(f"mode must be 'block' or 'modulo', got {mode!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if values.dim() != 1 or lengths.dim() != 1 or block_sizes.dim() != 1:
        raise ValueError("values, lengths and block_sizes must be 1-D")
    for name, t in (("values", values), ("lengths", lengths), ("block_sizes", block_sizes)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != values.device:
            raise ValueError(f"{name} is on {t.device}, values on {values.device}")
    num_keys = block_sizes.numel()
    if num_keys == 0:
        if lengths.numel() != 0 or values.numel() != 0:
            raise ValueError("block_sizes is empty (K=0) but lengths/values are not")
        return 0, 0
    if lengths.numel() % num_keys != 0:
        raise ValueError(
            f"lengths has {lengths.numel()} entries, not a multiple of K={num_keys} keys"
        )
    if weights is not None:
        if weights.shape != values.shape:
            raise ValueError(f"weights shape {tuple(weights.shape)} != values shape")
        if weights.device != values.device:
            raise ValueError("weights must be on the same device as values")
    return num_keys, lengths.numel() // num_keys


def check_permutation_args(permute: torch.Tensor, lengths: torch.Tensor, values: torch.Tensor):
    """Validate ``indexed_permute`` arguments (shapes/dtypes only)."""
    if lengths.dim() != 2:
        raise ValueError(f"lengths must be 2-D (T, B), got shape {tuple(lengths.shape)}")
    if permute.dim() != 1 or values.dim() != 1:
        raise ValueError("permute and values must be 1-D")
    for name, t in (("permute", permute), ("lengths", lengths)):
        if t.dtype not in _INDEX_DTYPES:
            raise TypeError(f"{name} must be int32 or int64, got {t.dtype}")
        if t.device != values.device:
            raise ValueError(f"{name} is on {t.device}, values on {values.device}")
