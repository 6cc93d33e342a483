"""Best-effort loop-free PyTorch versions of the jagged index ops (a benchmark baseline).

Owns: the fastest formulation we know with stock PyTorch ops (sort, cumsum, scatter), no
Python loop over ranks. Semantics are identical to `reference.py` (tests check it bitwise).
Only `ranged_dispatch` differs from the reference; the other ops' references are already
single vectorized gathers, so they are re-exported unchanged.
"""

from __future__ import annotations

from typing import Optional

import torch

from freescale.kernels.common import DispatchResult, check_dispatch_inputs
from freescale.kernels.reference import (
    indexed_permute,
    keyed_transpose,
    owner_and_local,
    ranged_combine,
    ranged_combine_backward,
    segment_ids,
)

__all__ = [
    "indexed_permute",
    "keyed_transpose",
    "ranged_combine",
    "ranged_combine_backward",
    "ranged_dispatch",
]


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
) -> DispatchResult:
    """Same result as `reference.ranged_dispatch`, computed with a narrow-key sort.

    The input is already ordered [key][sample], so a *stable* sort by owner alone yields
    [owner][key][sample]; sorting 16-bit owner keys needs fewer radix passes than the
    reference's 64-bit (owner, segment) keys. Segment counts use an integer scatter-add
    (exact, hence deterministic) instead of `bincount` (which syncs on CUDA).
    """
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    seg = segment_ids(lengths, n)
    key = seg // batch if batch > 0 else seg
    owner, local = owner_and_local(values, key, block_sizes, world_size, mode)

    narrow = torch.int16 if world_size <= torch.iinfo(torch.int16).max else torch.int32
    order = torch.sort(owner.to(narrow), stable=True).indices
    counts = torch.zeros(world_size * nseg, dtype=torch.int64, device=dev)
    counts.index_put_((owner * nseg + seg,), torch.ones_like(seg), accumulate=True)
    unbucketize_permute = torch.empty(n, dtype=torch.int64, device=dev)
    unbucketize_permute.scatter_(0, order, torch.arange(n, device=dev))
    return DispatchResult(
        values=local[order].to(values.dtype),
        lengths=counts.to(lengths.dtype),
        splits=counts.view(world_size, nseg).sum(1),
        key_counts=counts.view(world_size, num_keys, batch).sum(2),
        unbucketize_permute=unbucketize_permute,
        weights=None if weights is None else weights[order],
    )
