"""Naive eager versions of the jagged index ops: the code a user writes first.

Owns: benchmark baselines only (a Python loop over ranks with one boolean mask per rank,
per-block slicing and `torch.cat`). Their cost grows linearly with the world size and they
synchronise with the device inside the loop. Semantics are identical to `reference.py`;
tests check it. Not selectable as a `Backend`: nothing in the product calls this module.
"""

from __future__ import annotations

from typing import Optional

import torch

from freescale.kernels.common import DispatchResult, check_dispatch_inputs, check_permutation_args
from freescale.kernels.reference import owner_and_local, segment_ids


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
) -> DispatchResult:
    """One mask per destination rank; boolean indexing keeps the input order."""
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    seg = segment_ids(lengths, n)
    key = seg // batch if batch > 0 else seg
    owner, local = owner_and_local(values, key, block_sizes, world_size, mode)

    out_values, out_lengths, out_weights = [], [], []
    unbucketize_permute = torch.empty(n, dtype=torch.int64, device=dev)
    offset = 0
    for rank in range(world_size):
        mask = owner == rank
        out_values.append(local[mask])
        out_lengths.append(torch.bincount(seg[mask], minlength=nseg))
        count = int(mask.sum())
        unbucketize_permute[mask] = torch.arange(offset, offset + count, device=dev)
        offset += count
        if weights is not None:
            out_weights.append(weights[mask])
    new_lengths = torch.cat(out_lengths)
    return DispatchResult(
        values=torch.cat(out_values).to(values.dtype),
        lengths=new_lengths.to(lengths.dtype),
        splits=new_lengths.view(world_size, nseg).sum(1),
        key_counts=new_lengths.view(world_size, num_keys, batch).sum(2),
        unbucketize_permute=unbucketize_permute,
        weights=None if weights is None else torch.cat(out_weights),
    )


def ranged_combine(
    rows: torch.Tensor, unbucketize_permute: torch.Tensor, splits: list[int]
) -> torch.Tensor:
    """Per source rank: a mask of the batch positions its rows go to, then a gather."""
    out = torch.empty_like(rows)
    perm = unbucketize_permute.to(torch.int64)
    start = 0
    for count in splits:
        mask = (perm >= start) & (perm < start + count)
        out[mask] = rows[perm[mask]]
        start += count
    return out


def ranged_combine_backward(
    grad: torch.Tensor, unbucketize_permute: torch.Tensor, splits: list[int]
) -> torch.Tensor:
    """Per destination rank: a mask of the batch positions it owns, then a scatter."""
    out = torch.empty_like(grad)
    perm = unbucketize_permute.to(torch.int64)
    start = 0
    for count in splits:
        mask = (perm >= start) & (perm < start + count)
        out[perm[mask]] = grad[mask]
        start += count
    return out


def indexed_permute(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """A slice per output row and one `torch.cat`."""
    check_permutation_args(permute, lengths, values)
    row_offsets = [0, *torch.cumsum(lengths.sum(1), 0).tolist()]
    rows = permute.tolist()
    out_values = torch.cat(
        [values[:0]] + [values[row_offsets[r] : row_offsets[r + 1]] for r in rows]
    )
    out_weights = None
    if weights is not None:
        pieces = [weights[row_offsets[r] : row_offsets[r + 1]] for r in rows]
        out_weights = torch.cat([weights[:0], *pieces])
    return lengths[permute.to(torch.int64)], out_values, out_weights


def keyed_transpose(
    lengths: torch.Tensor, values: torch.Tensor, weights: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Fixed-batch form only: split per (rank, key) block, re-concatenate key-major."""
    num_a, num_c, _ = lengths.shape
    block_sizes = lengths.sum(2).reshape(-1).tolist()
    blocks = list(torch.split(values, block_sizes))
    wblocks = None if weights is None else list(torch.split(weights, block_sizes))
    order = [a * num_c + c for c in range(num_c) for a in range(num_a)]
    out_values = torch.cat([values[:0], *(blocks[i] for i in order)])
    out_weights = (
        None if wblocks is None else torch.cat([weights[:0], *(wblocks[i] for i in order)])
    )
    return lengths.transpose(0, 1).contiguous(), out_values, out_weights
