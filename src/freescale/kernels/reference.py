"""Readable PyTorch reference of every jagged index op: this module *is* the semantics.

Owns: the definition of ranged dispatch / combine, indexed permute and keyed transpose,
written for clarity (whole-tensor ops, no Python loop over ranks, no device sync except
where an output size is unknown). Every other backend (`vectorized.py`, `triton_impl.py`,
`naive.py`) must return bitwise-identical tensors; tests compare them on fresh random input.
It never imports triton or fbgemm.

Vocabulary: N ids, W destinations (ranks / owners), K keys (features), B samples per key.
Jagged data is `values` plus `lengths`; offsets are always derived locally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch

from freescale.kernels.common import (
    DispatchResult,
    check_dispatch_inputs,
    check_permutation_args,
)

GatherBlocks = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    """(n,) -> (n+1,) int64 offsets: ``[0, x0, x0+x1, ...]``."""
    out = torch.zeros(x.numel() + 1, dtype=torch.int64, device=x.device)
    torch.cumsum(x.reshape(-1), 0, out=out[1:])
    return out


# ---------------------------------------------------------------------------------------
# ranged dispatch / combine
# ---------------------------------------------------------------------------------------


def owner_and_local(
    ids: torch.Tensor,
    keys: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    mode: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank and local row (both int64) of every id; ``keys[i]`` is id i's key.

    Block mode (fbgemm's `block_bucketize_sparse_features`): with blk = block_sizes[key],
    ids below blk*W go to owner id // blk as local row id - owner*blk; ids at or above
    blk*W (rows not covered by the W blocks) fall back to owner id % W, local id // W.
    Modulo mode: owner id % W, local id // W. Ids must be >= 0.
    """
    ids = ids.to(torch.int64)
    if mode == "modulo":
        return ids % world_size, ids // world_size
    blk = block_sizes.to(torch.int64)[keys]
    in_range = ids < blk * world_size
    owner = torch.where(in_range, ids // blk, ids % world_size)
    local = torch.where(in_range, ids - owner * blk, ids // world_size)
    return owner, local


def owner_counts(ids: torch.Tensor, block_size: int, world_size: int) -> torch.Tensor:
    """(W,) int64: how many of ``ids`` (one key, block mode) each rank owns — the owner
    rule of :func:`owner_and_local` with a scalar block size, without the local rows or
    a per-id block-size gather (the host-side id counts run this per feature and step)."""
    ids = ids.to(torch.int64)
    if ids.numel() == 0 or int(ids.max()) < block_size * world_size:
        # every id in the row-wise blocks (tables sized to the plan): owner = id // block,
        # no fallback term (one reduction instead of a remainder and a select per id:
        # 3.0 vs 16.9 ms for 700K ids on the dev box)
        return torch.bincount(
            torch.div(ids, block_size, rounding_mode="floor"), minlength=world_size
        )
    owner = torch.where(
        ids < block_size * world_size,
        torch.div(ids, block_size, rounding_mode="floor"),
        ids.remainder(world_size),
    )
    return torch.bincount(owner, minlength=world_size)


def segment_ids(lengths: torch.Tensor, num_values: int) -> torch.Tensor:
    """(N,) int64: index of the segment (entry of `lengths`) each value belongs to."""
    segments = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(segments, lengths.to(torch.int64), output_size=num_values)


# torch.bincount on CUDA wraps a value above INT_MAX to a negative bin (pytorch/pytorch
# issue 189666): an illegal memory access on the H200 at W = 4096 x 589,824 segments
# (torch 2.11; benchmarks/results/verify_kernels_auto_*.log). Above this many bins the
# counts come from an integer index_put_ (exact, so the same bits; checked there)
BINCOUNT_MAX_BINS = (1 << 31) - 1


def _count_buckets(bucket: torch.Tensor, bins: int) -> torch.Tensor:
    """int64 (bins,): how many entries of `bucket` hold each value in [0, bins)."""
    if bins <= BINCOUNT_MAX_BINS:
        return torch.bincount(bucket, minlength=bins)
    counts = torch.zeros(bins, dtype=torch.int64, device=bucket.device)
    return counts.index_put_((bucket,), torch.ones_like(bucket), accumulate=True)


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
) -> DispatchResult:
    """Bucket key-major jagged ids by owner rank; see `DispatchResult` for the outputs.

    `lengths` is (K*B,) in [key][sample] order, `block_sizes` (K,) (its values are ignored
    in modulo mode, its length still gives K). The output is ordered [dest][key][sample]
    with each segment's in-sample order kept: a stable sort of the ids by
    (owner, segment), which is what the other backends compute faster.
    """
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    seg = segment_ids(lengths, n)
    key = seg // batch if batch > 0 else seg
    owner, local = owner_and_local(values, key, block_sizes, world_size, mode)

    # Output segment ("bucket") of every id: [dest][key][sample] flattened.
    bucket = owner * nseg + seg
    order = torch.sort(bucket, stable=True).indices  # output position -> input position
    new_lengths = _count_buckets(bucket, world_size * nseg)
    unbucketize_permute = torch.empty(n, dtype=torch.int64, device=dev)
    unbucketize_permute[order] = torch.arange(n, device=dev)
    return DispatchResult(
        values=local[order].to(values.dtype),
        lengths=new_lengths.to(lengths.dtype),
        splits=new_lengths.view(world_size, nseg).sum(1),
        key_counts=new_lengths.view(world_size, num_keys, batch).sum(2),
        unbucketize_permute=unbucketize_permute,
        weights=None if weights is None else weights[order],
    )


def ranged_combine(rows: torch.Tensor, unbucketize_permute: torch.Tensor) -> torch.Tensor:
    """Shard-major rows -> batch-major: ``out[i] = rows[unbucketize_permute[i]]``."""
    return rows.index_select(0, unbucketize_permute.to(torch.int64))


def ranged_combine_backward(grad: torch.Tensor, unbucketize_permute: torch.Tensor) -> torch.Tensor:
    """Transpose of `ranged_combine`: ``out[unbucketize_permute[i]] = grad[i]``.

    `unbucketize_permute` is a permutation, so every output row is written exactly once
    (no accumulation, deterministic).
    """
    out = torch.empty_like(grad)
    out.index_copy_(0, unbucketize_permute.to(torch.int64), grad)
    return out


# ---------------------------------------------------------------------------------------
# block gathers: indexed permute and keyed transpose
# ---------------------------------------------------------------------------------------


def gather_blocks(
    x: torch.Tensor,
    starts: torch.Tensor,
    sizes: torch.Tensor,
    out_size: int,
    out_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Concatenate the contiguous blocks ``x[starts[j] : starts[j] + sizes[j]]`` over j.

    `out_size` must equal ``sizes.sum()`` (passed so that no device sync is needed);
    `out_offsets`, if given, must be ``exclusive_cumsum(sizes)`` (a caller that has the
    sizes on the host saves the scan).
    """
    if out_offsets is None:
        out_offsets = exclusive_cumsum(sizes)
    shift = torch.repeat_interleave(
        starts.to(torch.int64) - out_offsets[:-1], sizes.to(torch.int64), output_size=out_size
    )
    return x[torch.arange(out_size, device=x.device) + shift]


def _value_block_bounds(
    lengths: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of consecutive lengths entries (block j holds `block_rows[j]` entries).

    Returns (starts of each block in `lengths`, starts in values, sizes in values).
    """
    row_offsets = exclusive_cumsum(block_rows)
    value_offsets = exclusive_cumsum(lengths)[row_offsets]
    return row_offsets[:-1], value_offsets[:-1], value_offsets[1:] - value_offsets[:-1]


def _permute_value_blocks(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor],
    block_rows: torch.Tensor,
    out_size: Optional[int],
    gather: GatherBlocks,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Gather value blocks (block j = the values of `block_rows[j]` consecutive segments)."""
    _, starts, sizes = _value_block_bounds(lengths.reshape(-1), block_rows)
    starts, sizes = starts[permute], sizes[permute]
    if out_size is None:
        out_size = int(sizes.sum())  # device sync: pass the size to avoid it
    out_values = gather(values, starts, sizes, out_size)
    out_weights = None if weights is None else gather(weights, starts, sizes, out_size)
    return out_values, out_weights


def indexed_permute_with(
    gather: GatherBlocks,
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    permuted_lengths_sum: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`indexed_permute` with a pluggable block gather (shared by all backends)."""
    check_permutation_args(permute, lengths, values)
    permute = permute.to(torch.int64)
    num_rows, batch = lengths.shape
    block_rows = torch.full((num_rows,), batch, dtype=torch.int64, device=lengths.device)
    out_values, out_weights = _permute_value_blocks(
        permute, lengths, values, weights, block_rows, permuted_lengths_sum, gather
    )
    return lengths.index_select(0, permute), out_values, out_weights


def indexed_permute(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    permuted_lengths_sum: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """fbgemm's `permute_2D_sparse_data`: output row t is input row ``permute[t]``.

    `lengths` is (T, B), row-major; row t's values are contiguous. `permute` (T',) may
    repeat or drop rows. Returns (lengths (T', B), values, weights). Without
    `permuted_lengths_sum` the output size costs one device sync.
    """
    return indexed_permute_with(
        gather_blocks, permute, lengths, values, weights, permuted_lengths_sum
    )


def transpose_plan(
    batch_sizes: torch.Tensor, num_keys: int, inverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of the keyed transpose: (entries of each input block, output->input block).

    Forward: input blocks are [rank a][key k] (block size batch_sizes[a]), output [k][a].
    Inverse: input blocks are [k][a], output [a][k].
    """
    num_ranks = batch_sizes.numel()
    idx = torch.arange(num_ranks * num_keys, device=batch_sizes.device)
    batch_sizes = batch_sizes.to(torch.int64)
    if not inverse:
        rows = batch_sizes.repeat_interleave(num_keys)
        permute = idx.view(num_ranks, num_keys).t().reshape(-1)
    else:
        rows = batch_sizes.repeat(num_keys)
        permute = idx.view(num_keys, num_ranks).t().reshape(-1)
    return rows, permute


def keyed_transpose_with(
    gather: GatherBlocks,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    batch_sizes: Optional[torch.Tensor] = None,
    num_keys: Optional[int] = None,
    inverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`keyed_transpose` with a pluggable block gather (shared by all backends)."""
    if values.dim() != 1:
        raise ValueError("values must be 1-D")
    if batch_sizes is None:
        if lengths.dim() != 3:
            raise ValueError("lengths must be 3-D (A, C, B) unless batch_sizes is given")
        num_a, num_c, batch = lengths.shape
        out_lengths = lengths.transpose(0, 1).contiguous()
        rows = torch.full((num_a * num_c,), batch, dtype=torch.int64, device=lengths.device)
        permute = torch.arange(num_a * num_c, device=lengths.device)
        permute = permute.view(num_a, num_c).t().reshape(-1)
    else:
        if lengths.dim() != 1 or num_keys is None:
            raise ValueError("with batch_sizes, lengths must be 1-D and num_keys given")
        rows, permute = transpose_plan(batch_sizes, num_keys, inverse)
        starts, _, _ = _value_block_bounds(lengths, rows)
        out_lengths = gather(lengths, starts[permute], rows[permute], lengths.numel())
    out_values, out_weights = _permute_value_blocks(
        permute, lengths, values, weights, rows, values.numel(), gather
    )
    return out_lengths, out_values, out_weights


def keyed_transpose(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    batch_sizes: Optional[torch.Tensor] = None,
    num_keys: Optional[int] = None,
    inverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Swap the two outer levels of jagged data: [rank][key][sample] <-> [key][rank][sample].

    Fixed batch: `lengths` is (A, C, B) and values follow it row-major; returns lengths
    (C, A, B) and the values in that order. Swapping twice is the identity, so the same
    call undoes it (`inverse` is ignored).
    Variable batch per rank (load-balanced ranks): `lengths` is 1-D laid out
    [rank a][key k][sample b < batch_sizes[a]] with `num_keys` keys; returns
    [k][a][b] (1-D). With ``inverse=True`` the input is [k][a][b] and the output [a][k][b].
    No device sync in either form.
    """
    return keyed_transpose_with(
        gather_blocks,
        lengths,
        values,
        weights,
        batch_sizes=batch_sizes,
        num_keys=num_keys,
        inverse=inverse,
    )
