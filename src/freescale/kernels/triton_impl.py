"""Triton kernels for the jagged index ops (the GPU fast path).

Owns: the Triton kernels and the few PyTorch glue ops between them (cumsum scans, small
index tables). Results are bitwise identical to `reference.py` and to themselves run to
run: no float atomics, no atomics at all, every output element is written by exactly one
program. Offsets into id / row arrays are int64. On CPU tensors this module needs
``TRITON_INTERPRET=1`` set before triton is first imported.

Ranged dispatch (`ranged_dispatch`) is sort-free: the output is the input stably sorted by
dest, so an id's position is the start of its (dest, chunk) block (an exclusive scan of
per-(dest, chunk) counts laid out [dest][chunk]) plus its rank among same-dest ids of its
chunk, found block by block with a BLOCK x BLOCK comparison and a per-(dest, chunk)
cursor. Chunks never cross segments, so output lengths are differences of that scan.
`ranged_dispatch_v1` (per-tile `tl.sort`) is kept for benchmark comparison. See README.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from freescale.kernels import reference
from freescale.kernels.common import (
    DispatchResult,
    cdiv,
    check_dispatch_inputs,
    check_permutation_args,
    next_power_of_2,
)
from freescale.kernels.reference import exclusive_cumsum

# ---------------------------------------------------------------------------------------
# ranged dispatch
# ---------------------------------------------------------------------------------------


@triton.jit
def _owner(ids, blk, world_size, MODULO: tl.constexpr):
    if MODULO:
        owner = ids % world_size
    else:
        owner = tl.where(ids < blk * world_size, ids // blk, ids % world_size)
    return owner


@triton.jit
def _run_count(dest_a, count_a, dest_b, count_b):
    # Segmented count over a sorted sequence: (last dest, length of its trailing run).
    return dest_b, tl.where(dest_a == dest_b, count_a + count_b, count_b)


@triton.jit(do_not_specialize=["num_segments"])
def _segment_table_kernel(
    lengths_ptr,
    seg_offsets_ptr,
    tile_first_ptr,
    num_segments,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: seg_offsets = exclusive cumsum of lengths and tile_first = exclusive
    cumsum of ceil(length / TILE), both (num_segments + 1,) int64 — what five to seven
    small torch launches computed before (dispatch is launch-bound on one rank's batch)."""
    offs = tl.arange(0, BLOCK)
    n = tl.load(lengths_ptr + offs, mask=offs < num_segments, other=0).to(tl.int64)
    tiles = (n + (TILE - 1)) // TILE
    out = offs <= num_segments
    tl.store(seg_offsets_ptr + offs, tl.cumsum(n, 0) - n, mask=out)
    tl.store(tile_first_ptr + offs, tl.cumsum(tiles, 0) - tiles, mask=out)


# one program scans at most this many segments (a training batch has K * B ~ 10^2-10^3;
# a larger block would spill registers); larger batches use torch's scans
_SEGMENT_TABLE_MAX = 1 << 13


@triton.jit(do_not_specialize=["num_segments", "num_tiles"])
def _tile_table_kernel(
    seg_offsets_ptr,
    tile_first_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    num_segments,
    num_tiles,
    TILE: tl.constexpr,
    SEARCH_ITERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Tile j -> (segment, first id, end id); spare tiles past the last one are empty.

    ``SEARCH_ITERS`` is fixed by the callers (32: up to 2^31 segments; extra rounds are
    masked no-ops) so a batch size that changes per step (VBS) compiles no new variant."""
    tile = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_grid = tile < num_tiles
    # seg = last s in [0, num_segments] with tile_first[s] <= tile (binary search).
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = lo + num_segments + 1
    for _ in tl.static_range(SEARCH_ITERS):
        active = lo < hi
        mid = (lo + hi) // 2
        go_right = tl.load(tile_first_ptr + mid, mask=active & in_grid, other=0) <= tile
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    used = tile < tl.load(tile_first_ptr + num_segments)
    seg = tl.minimum(lo - 1, num_segments - 1)
    first = tl.load(tile_first_ptr + seg, mask=in_grid, other=0)
    start = tl.load(seg_offsets_ptr + seg, mask=in_grid, other=0) + (tile - first) * TILE
    end = tl.minimum(start + TILE, tl.load(seg_offsets_ptr + seg + 1, mask=in_grid, other=0))
    tl.store(tile_seg_ptr + tile, seg, mask=in_grid)
    tl.store(tile_start_ptr + tile, start, mask=in_grid)
    tl.store(tile_end_ptr + tile, tl.where(used, end, start), mask=in_grid)


@triton.jit
def _tile_ids(
    values_ptr,
    block_sizes_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    batch,
    TILE: tl.constexpr,
):
    """This program's tile: first id, lane mask, block size and the ids."""
    pid = tl.program_id(0)
    seg = tl.load(tile_seg_ptr + pid)
    start = tl.load(tile_start_ptr + pid)
    end = tl.load(tile_end_ptr + pid)
    lane = tl.arange(0, TILE)
    offs = start + lane
    mask = offs < end
    blk = tl.load(block_sizes_ptr + seg // batch).to(tl.int64)
    ids = tl.load(values_ptr + offs, mask=mask, other=0).to(tl.int64)
    return pid, start, lane, mask, blk, ids


@triton.jit
def _count_offset(tile, dest, world_size, num_tiles, DEST_MAJOR: tl.constexpr):
    """Offset of (tile, dest) in the count / scan matrix: [dest][tile] or [tile][dest]."""
    if DEST_MAJOR:
        off = dest.to(tl.int64) * num_tiles + tile
    else:
        off = tile.to(tl.int64) * world_size + dest
    return off


@triton.jit(do_not_specialize=["batch", "world_size", "num_tiles"])
def _dispatch_count_kernel(
    values_ptr,
    block_sizes_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    counts_ptr,
    batch,
    world_size,
    num_tiles,
    MODULO: tl.constexpr,
    TILE: tl.constexpr,
    WP: tl.constexpr,
    DEST_MAJOR: tl.constexpr,
):
    pid, start, lane, mask, blk, ids = _tile_ids(
        values_ptr, block_sizes_ptr, tile_seg_ptr, tile_start_ptr, tile_end_ptr, batch, TILE
    )
    dest = _owner(ids, blk, world_size, MODULO).to(tl.int32)
    hist = tl.histogram(dest, WP, mask=mask)
    bins = tl.arange(0, WP)
    off = _count_offset(pid, bins, world_size, num_tiles, DEST_MAJOR)
    tl.store(counts_ptr + off, hist, mask=bins < world_size)


@triton.jit(do_not_specialize=["batch", "world_size", "num_tiles"])
def _dispatch_scatter_kernel(
    values_ptr,
    weights_ptr,
    block_sizes_ptr,
    tile_seg_ptr,
    tile_start_ptr,
    tile_end_ptr,
    earlier_ptr,
    dest_start_ptr,
    out_values_ptr,
    out_weights_ptr,
    perm_ptr,
    batch,
    world_size,
    num_tiles,
    MODULO: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    TILE: tl.constexpr,
    DEST_MAJOR: tl.constexpr,
    HEAD_LOAD: tl.constexpr = False,
    INCL: tl.constexpr = False,
):
    pid, start, lane, mask, blk, ids = _tile_ids(
        values_ptr, block_sizes_ptr, tile_seg_ptr, tile_start_ptr, tile_end_ptr, batch, TILE
    )
    dest = _owner(ids, blk, world_size, MODULO).to(tl.int32)
    dest = tl.where(mask, dest, world_size)  # padding lanes sort last
    # Sorting (dest, lane) keys is a stable sort by dest; keys are unique.
    keys = tl.sort(dest * TILE + lane)
    sdest = keys // TILE
    slane = keys % TILE
    _, run = tl.associative_scan((sdest, tl.full([TILE], 1, tl.int32)), 0, _run_count)
    valid = sdest < world_size
    off = _count_offset(pid, sdest, world_size, num_tiles, DEST_MAJOR)
    if INCL:  # the matrix holds the inclusive scan: the exclusive value sits one earlier
        off = off - 1
        valid_at = valid & (off >= 0)
    else:
        valid_at = valid
    if HEAD_LOAD:
        # one load per run of equal dests (its first lane), spread over the run by the
        # same segmented sum: fewer scattered reads of the scan matrix when runs are long
        head = tl.load(earlier_ptr + off, mask=valid_at & (run == 1), other=0)
        _, base = tl.associative_scan((sdest, head), 0, _run_count)
    else:
        base = tl.load(earlier_ptr + off, mask=valid_at, other=0)
    if not DEST_MAJOR:  # dest-major: the scan over [dest][tile] already holds dest's start
        base += tl.load(dest_start_ptr + sdest, mask=valid, other=0)
    pos = base.to(tl.int64) + (run - 1)
    src = start + slane
    ids_sorted = tl.load(values_ptr + src, mask=valid, other=0).to(tl.int64)
    if MODULO:
        local = ids_sorted // world_size
    else:
        in_range = ids_sorted < blk * world_size
        local = tl.where(in_range, ids_sorted - sdest.to(tl.int64) * blk, ids_sorted // world_size)
    tl.store(out_values_ptr + pos, local.to(out_values_ptr.dtype.element_ty), mask=valid)
    tl.store(perm_ptr + src, pos, mask=valid)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + src, mask=valid)
        tl.store(out_weights_ptr + pos, w, mask=valid)


@triton.jit
def _scan_at(scan_ptr, off, mask, INCL: tl.constexpr):
    """The exclusive scan at ``off``: stored there, or one earlier in an inclusive scan."""
    if INCL:
        val = tl.load(scan_ptr + off - 1, mask=mask & (off > 0), other=0)
    else:
        val = tl.load(scan_ptr + off, mask=mask, other=0)
    return val


@triton.jit(do_not_specialize=["num_segments", "world_size", "num_tiles", "batch", "num_keys"])
def _segment_lengths_kernel(
    earlier_ptr,
    tile_first_ptr,
    out_ptr,
    totals_ptr,
    key_counts_ptr,
    num_segments,
    world_size,
    num_tiles,
    batch,
    num_keys,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DEST_MAJOR: tl.constexpr,
    INCL: tl.constexpr = False,
    TOTALS: tl.constexpr = False,
    KP: tl.constexpr = 1,
):
    """out[d * S + s] = earlier[tile_first[s + 1], d] - earlier[tile_first[s], d] (the
    scan's layout: [tile][dest], or [dest][tile] with ``DEST_MAJOR``; ``INCL``: the
    matrix holds the inclusive scan). With ``TOTALS`` (dest-major only) the programs of
    the first segment block also write totals[d] (ids per owner) and
    key_counts[d * K + k] (ids per owner and key: a key's segments own consecutive
    tiles), which torch would compute in two more launches."""
    seg = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dest = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dest < world_size
    seg_mask = seg < num_segments
    mask = seg_mask[:, None] & dmask[None, :]
    first = tl.load(tile_first_ptr + seg, mask=seg_mask, other=0)
    after = tl.load(tile_first_ptr + seg + 1, mask=seg_mask, other=0)
    off_lo = _count_offset(first[:, None], dest[None, :], world_size, num_tiles, DEST_MAJOR)
    off_hi = _count_offset(after[:, None], dest[None, :], world_size, num_tiles, DEST_MAJOR)
    lo = _scan_at(earlier_ptr, off_lo, mask, INCL)
    hi = _scan_at(earlier_ptr, off_hi, mask, INCL)
    out_offs = dest[None, :].to(tl.int64) * num_segments + seg[:, None]
    tl.store(out_ptr + out_offs, (hi - lo).to(out_ptr.dtype.element_ty), mask=mask)
    if TOTALS:
        if tl.program_id(0) == 0:
            row = dest.to(tl.int64) * num_tiles  # [dest][tile] layout
            total = _scan_at(earlier_ptr, row + num_tiles, dmask, INCL) - _scan_at(
                earlier_ptr, row, dmask, INCL
            )
            tl.store(totals_ptr + dest, total.to(tl.int64), mask=dmask)
            k = tl.arange(0, KP)
            kmask = (k < num_keys)[:, None] & dmask[None, :]
            k_lo = tl.load(tile_first_ptr + k * batch, mask=k < num_keys, other=0)
            k_hi = tl.load(tile_first_ptr + (k + 1) * batch, mask=k < num_keys, other=0)
            a = _scan_at(earlier_ptr, row[None, :] + k_lo[:, None], kmask, INCL)
            b = _scan_at(earlier_ptr, row[None, :] + k_hi[:, None], kmask, INCL)
            kc_offs = dest[None, :].to(tl.int64) * num_keys + k[:, None]
            tl.store(key_counts_ptr + kc_offs, (b - a).to(tl.int64), mask=kmask)


def default_tile(world_size: int, device: torch.device, n: int = 0) -> int:
    """Ids per tile of the tile-sort kernels (v1/v3), from benchmarks/tune_dispatch.py on
    an H200 (results/dispatch_tune.json): the per-tile sort dominates and its cost per id
    grows with the tile, so at 2^26 ids 512-id tiles are 2x (W=1024) to 1.9x (W=8)
    faster than 1024/2048 even though the counts matrix (W x tiles) grows; at ~1M ids
    (one rank's batch) every tile from 128 to 1024 lands within noise of 0.22-0.25 ms
    (launch-bound) and 1024 keeps the matrix small. ``world_size`` is kept for callers.

    On CPU (interpreter mode) tiles are tiny: interpreting a 1024-wide sort takes seconds.
    """
    del world_size
    if device.type == "cpu":
        return 32
    return 512 if n > (1 << 22) else 1024


def ranged_dispatch_v1(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
    tile: Optional[int] = None,
    dest_major: bool = False,
    num_warps: Optional[int] = None,
    head_load: bool = False,
) -> DispatchResult:
    """First Triton dispatch (tile sort + scan), kept for comparison with `ranged_dispatch`.

    Same semantics as `reference.ranged_dispatch`. `tile` (a power of two) overrides the
    ids per tile; tests use small tiles to cover segments spanning several tiles.

    ``dest_major`` ("v3"): per-tile counts laid out [dest][tile], so the output position
    base of every (dest, tile) is one exclusive 1-D scan of the flattened matrix (a fast
    innermost-dimension cumsum). The default [tile][dest] layout scans along dim 0, which
    torch runs as one sequential loop per column (W threads walking every tile): the
    likely reason v1 runs at ~2.4 G ids/s whatever W (kernels.json) — to be confirmed by
    ``benchmarks/profile_dispatch.py`` on a GPU before v3 becomes the default.

    ``num_warps`` overrides the warps per tile program; ``head_load`` reads the scan
    matrix once per run of equal owners in a tile instead of once per id (tuning knobs,
    same results; ``benchmarks/tune_dispatch.py`` times them).
    """
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    if n == 0:
        return reference.ranged_dispatch(
            values, lengths, block_sizes, world_size, mode=mode, weights=weights
        )
    tile = tile or default_tile(world_size, dev, n)
    if tile & (tile - 1) or tile < 16:
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if (world_size + 1) * tile >= 2**31:
        raise ValueError(f"world_size {world_size} too large for tile {tile}")
    values, block_sizes = values.contiguous(), block_sizes.contiguous()
    weights = None if weights is None else weights.contiguous()

    # Tiles: chunks of <= tile ids inside one segment; segment s owns the tiles
    # [tile_first[s], tile_first[s+1]); a few spare tiles at the end stay empty.
    if nseg + 1 <= _SEGMENT_TABLE_MAX:
        seg_offsets = torch.empty(nseg + 1, dtype=torch.int64, device=dev)
        tile_first = torch.empty(nseg + 1, dtype=torch.int64, device=dev)
        block = max(16, next_power_of_2(nseg + 1))
        _segment_table_kernel[(1,)](
            lengths, seg_offsets, tile_first, nseg, TILE=tile, BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    else:
        seg_offsets = exclusive_cumsum(lengths)
        per_segment = torch.div(lengths.to(torch.int64) + (tile - 1), tile, rounding_mode="floor")
        tile_first = exclusive_cumsum(per_segment)
    grid = (n + nseg * (tile - 1)) // tile + 1  # >= tiles used + 1: the last one is empty
    tile_seg = torch.empty(grid, dtype=torch.int32, device=dev)
    tile_start = torch.empty(grid, dtype=torch.int64, device=dev)
    tile_end = torch.empty(grid, dtype=torch.int64, device=dev)
    _tile_table_kernel[(cdiv(grid, 1024),)](
        seg_offsets, tile_first, tile_seg, tile_start, tile_end, nseg, grid,
        TILE=tile, SEARCH_ITERS=32, BLOCK=1024, num_warps=4,
    )  # fmt: skip
    tiles = (tile_seg, tile_start, tile_end)
    warps = num_warps or (4 if tile <= 1024 else 8)
    common = dict(MODULO=mode == "modulo", TILE=tile, num_warps=warps)

    common["DEST_MAJOR"] = dest_major
    shape = (world_size, grid) if dest_major else (grid, world_size)
    counts = torch.empty(shape, dtype=torch.int32, device=dev)
    _dispatch_count_kernel[(grid,)](
        values, block_sizes, *tiles, counts, batch, world_size, grid,
        WP=max(32, next_power_of_2(world_size)), **common,
    )  # fmt: skip

    index_dtype = torch.int32 if n < 2**31 else torch.int64
    if dest_major:
        # earlier[d, t] = output position of tile t's first id for owner d: ids of owners
        # before d, plus ids of owner d in tiles before t — the exclusive 1-D scan of the
        # flattened matrix, read by the kernels as the inclusive scan one entry earlier
        # (no subtraction launch); totals come from the scan too (segment-lengths kernel)
        earlier = torch.cumsum(counts.view(-1), 0, dtype=index_dtype)
        totals = torch.empty(world_size, dtype=torch.int64, device=dev)
        dest_start = earlier  # unused by the kernels in this layout
    else:
        # Scan: earlier[t, d] = ids of owner d in tiles before t (the last row: totals).
        earlier = torch.cumsum(counts, 0, dtype=index_dtype)
        earlier -= counts
        totals = earlier[-1]
        dest_start = torch.cumsum(totals, 0, dtype=index_dtype) - totals

    out_values = torch.empty_like(values)
    out_weights = None if weights is None else torch.empty_like(weights)
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    _dispatch_scatter_kernel[(grid,)](
        values, values if weights is None else weights, block_sizes, *tiles, earlier,
        dest_start, out_values, out_values if out_weights is None else out_weights, perm,
        batch, world_size, grid, HAS_WEIGHTS=weights is not None, HEAD_LOAD=head_load,
        INCL=dest_major, **common,
    )  # fmt: skip

    # Ids of segment s for owner d: the scan at s's first tile minus the one at s+1's.
    new_lengths = torch.empty(world_size * nseg, dtype=lengths.dtype, device=dev)
    key_counts = torch.empty(world_size, num_keys, dtype=torch.int64, device=dev)
    _segment_lengths_kernel[(cdiv(nseg, 32), cdiv(world_size, 64))](
        earlier, tile_first, new_lengths, totals, key_counts, nseg, world_size, grid, batch,
        num_keys, BLOCK_S=32, BLOCK_D=64, DEST_MAJOR=dest_major, INCL=dest_major,
        TOTALS=dest_major, KP=max(2, next_power_of_2(num_keys)),
    )  # fmt: skip
    if not dest_major:
        key_counts = new_lengths.view(world_size, num_keys, batch).sum(2, dtype=torch.int64)
    return DispatchResult(
        values=out_values,
        lengths=new_lengths,
        splits=totals.to(torch.int64),
        key_counts=key_counts,
        unbucketize_permute=perm,
        weights=out_weights,
    )


# ---------------------------------------------------------------------------------------
# ranged dispatch v2: sort-free counting by (dest, chunk) offsets and in-block ranks
# ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_segments"])
def _segment_scan_kernel(
    lengths_ptr,
    seg_offsets_ptr,
    chunk_first_ptr,
    num_segments,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: seg_offsets = [0, cumsum(lengths)], chunk_first = [0, cumsum(ceil(l/C))]."""
    lane = tl.arange(0, BLOCK)
    carry_ids = tl.full([], 0, tl.int64)
    carry_chunks = tl.full([], 0, tl.int64)
    tl.store(seg_offsets_ptr, carry_ids)
    tl.store(chunk_first_ptr, carry_chunks)
    first = 0
    while first < num_segments:  # `while`: the interpreter cannot range() over arguments
        offs = first + lane
        mask = offs < num_segments
        ids = tl.load(lengths_ptr + offs, mask=mask, other=0).to(tl.int64)
        chunks = (ids + (CHUNK - 1)) // CHUNK
        tl.store(seg_offsets_ptr + 1 + offs, tl.cumsum(ids, 0) + carry_ids, mask=mask)
        tl.store(chunk_first_ptr + 1 + offs, tl.cumsum(chunks, 0) + carry_chunks, mask=mask)
        carry_ids += tl.sum(ids, 0)
        carry_chunks += tl.sum(chunks, 0)
        first += BLOCK


@triton.jit(do_not_specialize=["batch", "world_size", "num_chunks"])
def _chunk_count_kernel(
    values_ptr,
    block_sizes_ptr,
    chunk_seg_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    offsets_ptr,
    batch,
    world_size,
    num_chunks,
    MODULO: tl.constexpr,
    HBLOCK: tl.constexpr,
    WP: tl.constexpr,
):
    """counts of chunk c for dest d -> offsets[1 + d * num_chunks + c]; offsets[0] = 0."""
    pid = tl.program_id(0)
    seg = tl.load(chunk_seg_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    end = tl.load(chunk_end_ptr + pid)
    blk = tl.load(block_sizes_ptr + seg // batch).to(tl.int64)
    lane = tl.arange(0, HBLOCK)
    hist = tl.zeros([WP], dtype=tl.int32)
    block_start = start
    while block_start < end:
        offs = block_start + lane
        mask = offs < end
        ids = tl.load(values_ptr + offs, mask=mask, other=0).to(tl.int64)
        dest = _owner(ids, blk, world_size, MODULO).to(tl.int32)
        hist += tl.histogram(dest, WP, mask=mask)
        block_start += HBLOCK
    bins = tl.arange(0, WP)
    out = offsets_ptr + 1 + bins.to(tl.int64) * num_chunks + pid
    tl.store(out, hist.to(offsets_ptr.dtype.element_ty), mask=bins < world_size)
    tl.store(offsets_ptr + bins, tl.zeros([WP], dtype=offsets_ptr.dtype.element_ty),
             mask=(bins == 0) & (pid == 0))  # fmt: skip


@triton.jit(do_not_specialize=["num_segments", "world_size", "num_chunks"])
def _chunk_lengths_kernel(
    offsets_ptr,
    chunk_first_ptr,
    out_ptr,
    num_segments,
    world_size,
    num_chunks,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[d*S + s] = offsets[d*C + chunk_first[s+1]] - offsets[d*C + chunk_first[s]]."""
    seg = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    dest = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    seg_mask = seg < num_segments
    mask = seg_mask[:, None] & (dest < world_size)[None, :]
    row = dest[None, :].to(tl.int64) * num_chunks
    first = tl.load(chunk_first_ptr + seg, mask=seg_mask, other=0)
    after = tl.load(chunk_first_ptr + seg + 1, mask=seg_mask, other=0)
    lo = tl.load(offsets_ptr + row + first[:, None], mask=mask, other=0)
    hi = tl.load(offsets_ptr + row + after[:, None], mask=mask, other=0)
    out_offs = dest[None, :].to(tl.int64) * num_segments + seg[:, None]
    tl.store(out_ptr + out_offs, (hi - lo).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["world_size", "num_chunks", "num_keys", "batch"])
def _dispatch_totals_kernel(
    offsets_ptr,
    chunk_first_ptr,
    splits_ptr,
    key_counts_ptr,
    world_size,
    num_chunks,
    num_keys,
    batch,
    BLOCK_D: tl.constexpr,
):
    """splits[d] and key_counts[d, k] as differences of offsets at key boundaries."""
    dest = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = dest < world_size
    row = offsets_ptr + dest.to(tl.int64) * num_chunks
    first = tl.load(row, mask=mask, other=0).to(tl.int64)  # chunk_first[0] == 0
    prev = first
    k = 0
    while k < num_keys:
        f = tl.load(chunk_first_ptr + (k + 1) * batch)
        cur = tl.load(row + f, mask=mask, other=0).to(tl.int64)
        tl.store(key_counts_ptr + dest.to(tl.int64) * num_keys + k, cur - prev, mask=mask)
        prev = cur
        k += 1
    tl.store(splits_ptr + dest, prev - first, mask=mask)


@triton.jit(do_not_specialize=["batch", "world_size", "num_chunks"])
def _chunk_scatter_kernel(
    values_ptr,
    weights_ptr,
    block_sizes_ptr,
    chunk_seg_ptr,
    chunk_start_ptr,
    chunk_end_ptr,
    cursor_ptr,
    out_values_ptr,
    out_weights_ptr,
    perm_ptr,
    batch,
    world_size,
    num_chunks,
    MODULO: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Walk this chunk in blocks of BLOCK ids, in order; no sort.

    An id's output position is cursor[dest, chunk] (ids of its dest in earlier chunks, all
    dests before, and earlier blocks of this chunk) + the number of earlier ids of the same
    dest in its block (a BLOCK x BLOCK comparison). After each block the last id of each
    dest advances that dest's cursor. Only this program touches column `chunk` of the
    cursors, and barriers order a block's cursor reads, its update, and the next block's
    reads, so the result does not depend on scheduling.
    """
    pid = tl.program_id(0)
    seg = tl.load(chunk_seg_ptr + pid)
    start = tl.load(chunk_start_ptr + pid)
    end = tl.load(chunk_end_ptr + pid)
    blk = tl.load(block_sizes_ptr + seg // batch).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    earlier = lane[None, :] < lane[:, None]  # [i, j]: lane j comes before lane i
    block_start = start
    while block_start < end:
        offs = block_start + lane
        mask = offs < end
        ids = tl.load(values_ptr + offs, mask=mask, other=0).to(tl.int64)
        dest = _owner(ids, blk, world_size, MODULO).to(tl.int32)
        dest = tl.where(mask, dest, world_size)  # padding lanes match no real dest
        same = dest[:, None] == dest[None, :]
        rank = tl.sum((same & earlier).to(tl.int32), axis=1)
        count = tl.sum(same.to(tl.int32), axis=1)
        cursor = cursor_ptr + dest.to(tl.int64) * num_chunks + pid
        base = tl.load(cursor, mask=mask, other=0, volatile=True)
        pos = base.to(tl.int64) + rank
        if MODULO:
            local = ids // world_size
        else:
            in_range = ids < blk * world_size
            local = tl.where(in_range, ids - dest.to(tl.int64) * blk, ids // world_size)
        tl.store(out_values_ptr + pos, local.to(out_values_ptr.dtype.element_ty), mask=mask)
        tl.store(perm_ptr + offs, pos, mask=mask)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + offs, mask=mask)
            tl.store(out_weights_ptr + pos, w, mask=mask)
        tl.debug_barrier()  # every lane has read its cursor before any is advanced
        tl.store(cursor, base + count, mask=mask & (rank == count - 1))
        tl.debug_barrier()  # advanced cursors are visible to the next block's reads
        block_start += BLOCK


def default_chunk(world_size: int, device: torch.device) -> tuple[int, int]:
    """(ids per chunk, ids per in-chunk block) for `ranged_dispatch`.

    The (dest, chunk) offset matrix has W * (N / chunk + segments) entries: small W affords
    short chunks (more programs, shorter serial block loops); large W wants long ones. On
    CPU (interpreter) both are tiny so that tests cover chunks and blocks cheaply.
    """
    if device.type == "cpu":
        return 32, 16
    return (1024 if world_size <= 64 else 4096), 64


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
    chunk: Optional[int] = None,
    block: Optional[int] = None,
) -> DispatchResult:
    """Triton `ranged_dispatch` (same semantics as `reference.ranged_dispatch`), sort-free.

    `chunk` (ids per program, a power of two, never crossing a segment) and `block` (ids
    ranked together inside a chunk, a power of two dividing `chunk`) override the defaults
    of `default_chunk`.
    """
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    if n == 0:
        return reference.ranged_dispatch(
            values, lengths, block_sizes, world_size, mode=mode, weights=weights
        )
    dchunk, dblock = default_chunk(world_size, dev)
    chunk, block = chunk or dchunk, block or min(dblock, chunk or dchunk)
    for name, x in (("chunk", chunk), ("block", block)):
        if x & (x - 1) or x < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {x}")
    if block > chunk:
        raise ValueError(f"block {block} must not exceed chunk {chunk}")
    values, block_sizes = values.contiguous(), block_sizes.contiguous()
    lengths = lengths.contiguous()
    weights = None if weights is None else weights.contiguous()

    # Segment scan and chunk table: segment s owns chunks [chunk_first[s], chunk_first[s+1]).
    # num_chunks bounds the chunks used (no device sync); spare ones are empty.
    num_chunks = max(1, min((n + nseg * (chunk - 1)) // chunk, n))
    seg_offsets = torch.empty(nseg + 1, dtype=torch.int64, device=dev)
    chunk_first = torch.empty(nseg + 1, dtype=torch.int64, device=dev)
    scan_block = min(4096, max(128, next_power_of_2(nseg)))
    _segment_scan_kernel[(1,)](
        lengths, seg_offsets, chunk_first, nseg, CHUNK=chunk, BLOCK=scan_block,
        num_warps=8 if scan_block >= 2048 else 4,
    )  # fmt: skip
    chunk_seg = torch.empty(num_chunks, dtype=torch.int32, device=dev)
    chunk_start = torch.empty(num_chunks, dtype=torch.int64, device=dev)
    chunk_end = torch.empty(num_chunks, dtype=torch.int64, device=dev)
    _tile_table_kernel[(cdiv(num_chunks, 1024),)](
        seg_offsets, chunk_first, chunk_seg, chunk_start, chunk_end, nseg, num_chunks,
        TILE=chunk, SEARCH_ITERS=32, BLOCK=1024, num_warps=4,
    )  # fmt: skip
    chunks = (chunk_seg, chunk_start, chunk_end)
    modulo = mode == "modulo"

    # offsets[d * C + c] = output position of the first id of dest d in chunk c: an
    # exclusive scan, in [dest][chunk] order, of the per-(dest, chunk) counts.
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    offsets = torch.empty(world_size * num_chunks + 1, dtype=index_dtype, device=dev)
    hblock = min(chunk, 2048)
    _chunk_count_kernel[(num_chunks,)](
        values, block_sizes, *chunks, offsets, batch, world_size, num_chunks,
        MODULO=modulo, HBLOCK=hblock, WP=max(32, next_power_of_2(world_size)),
        num_warps=8 if hblock >= 2048 else 4,
    )  # fmt: skip
    offsets.cumsum_(0)

    new_lengths = torch.empty(world_size * nseg, dtype=lengths.dtype, device=dev)
    _chunk_lengths_kernel[(cdiv(nseg, 64), cdiv(world_size, 32))](
        offsets, chunk_first, new_lengths, nseg, world_size, num_chunks, BLOCK_S=64, BLOCK_D=32,
    )  # fmt: skip
    splits = torch.empty(world_size, dtype=torch.int64, device=dev)
    key_counts = torch.empty((world_size, num_keys), dtype=torch.int64, device=dev)
    _dispatch_totals_kernel[(cdiv(world_size, 256),)](
        offsets, chunk_first, splits, key_counts, world_size, num_chunks, num_keys, batch,
        BLOCK_D=256,
    )  # fmt: skip

    # The scatter advances `offsets` in place as per-(dest, chunk) cursors (last use).
    out_values = torch.empty_like(values)
    out_weights = None if weights is None else torch.empty_like(weights)
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    _chunk_scatter_kernel[(num_chunks,)](
        values, values if weights is None else weights, block_sizes, *chunks, offsets,
        out_values, out_values if out_weights is None else out_weights, perm,
        batch, world_size, num_chunks, MODULO=modulo, HAS_WEIGHTS=weights is not None,
        BLOCK=block, num_warps=4 if block >= 64 else 2,
    )  # fmt: skip
    return DispatchResult(
        values=out_values,
        lengths=new_lengths,
        splits=splits,
        key_counts=key_counts,
        unbucketize_permute=perm,
        weights=out_weights,
    )


# ---------------------------------------------------------------------------------------
# ranged combine (row gather / scatter)
# ---------------------------------------------------------------------------------------


# counts that change from call to call are not specialized (do_not_specialize): Triton
# compiles a variant for an int equal to 1 and one for a multiple of 16, and a variant's
# first use can come at any step, stalling the host for the compile
# (tests/test_kernels.py::test_kernels_do_not_specialize_per_call_counts)
@triton.jit(do_not_specialize=["n_rows"])
def _row_copy_kernel(
    src_ptr,
    dst_ptr,
    index_ptr,
    n_rows,
    row_width,
    SCATTER: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_mask = rows < n_rows
    index = tl.load(index_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    if SCATTER:
        src_rows, dst_rows = rows, index
    else:
        src_rows, dst_rows = index, rows
    mask = row_mask[:, None] & (cols < row_width)[None, :]
    x = tl.load(src_ptr + src_rows[:, None] * row_width + cols[None, :], mask=mask)
    tl.store(dst_ptr + dst_rows[:, None] * row_width + cols[None, :], x, mask=mask)


def _row_copy(x: torch.Tensor, index: torch.Tensor, scatter: bool) -> torch.Tensor:
    n = x.shape[0]
    if index.numel() != n:
        raise ValueError(f"unbucketize_permute has {index.numel()} entries, rows have {n}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    src = x.contiguous()
    width = src.numel() // n
    block_d = min(next_power_of_2(width), 256)
    block_r = max(1, 4096 // block_d)
    grid = (cdiv(n, block_r), cdiv(width, block_d))
    _row_copy_kernel[grid](
        src, out, index.contiguous(), n, width,
        SCATTER=scatter, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


def ranged_combine(rows: torch.Tensor, unbucketize_permute: torch.Tensor) -> torch.Tensor:
    """Triton ``out[i] = rows[perm[i]]`` (rows (N, ...), any dtype)."""
    return _row_copy(rows, unbucketize_permute, scatter=False)


def ranged_combine_backward(grad: torch.Tensor, unbucketize_permute: torch.Tensor) -> torch.Tensor:
    """Triton ``out[perm[i]] = grad[i]`` (perm is a permutation: one writer per row)."""
    return _row_copy(grad, unbucketize_permute, scatter=True)


# ---------------------------------------------------------------------------------------
# block gather: indexed permute and keyed transpose
# ---------------------------------------------------------------------------------------


# n_out stays specialized: its divisibility by 16 lets the compiler vectorize the masked
# copy (unspecialized, indexed_permute and keyed_transpose took 2-7% longer at 2^26 ids
# on an H200, kernels_040c3e7.json); its ==1 variant needs a one-id call
@triton.jit(do_not_specialize=["n_blocks"])
def _gather_blocks_kernel(
    src_ptr,
    dst_ptr,
    starts_ptr,
    out_offsets_ptr,
    n_blocks,
    n_out,
    N_ITERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = pos < n_out
    # Upper bound: first j in [0, n_blocks] with out_offsets[j] > pos; the block is j - 1.
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + (n_blocks + 1)
    for _ in tl.static_range(N_ITERS):
        active = lo < hi
        mid = (lo + hi) // 2
        right = tl.load(out_offsets_ptr + mid, mask=active & mask, other=0) <= pos
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    block = lo - 1
    out_start = tl.load(out_offsets_ptr + block, mask=mask, other=0)
    src = tl.load(starts_ptr + block, mask=mask, other=0) + (pos - out_start)
    tl.store(dst_ptr + pos, tl.load(src_ptr + src, mask=mask), mask=mask)


def gather_blocks(
    x: torch.Tensor,
    starts: torch.Tensor,
    sizes: torch.Tensor,
    out_size: int,
    out_offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Triton `reference.gather_blocks`: concatenate ``x[starts[j] : starts[j] + sizes[j]]``
    (1-D ``x``); ``out_offsets`` as there (given: one launch in all)."""
    if out_size == 0:
        return torch.empty(0, dtype=x.dtype, device=x.device)
    if out_offsets is None:
        out_offsets = exclusive_cumsum(sizes)
    return _gather_planned(
        x, starts.to(torch.int64).contiguous(), out_offsets.to(torch.int64).contiguous(), out_size
    )


# entries per plan-loop iteration (a test lowers it to run several iterations), and the
# most blocks (in + out) one plan program scans; larger plans take the torch scans
_PLAN_BLOCK = 1024
_PLAN_MAX_BLOCKS = 1 << 15


@triton.jit(do_not_specialize=["rows_per_block"])
def _block_sums_kernel(lengths_ptr, sums_ptr, rows_per_block, BLOCK: tl.constexpr):
    """sums[q] = the values in block q (rows [q * rows_per_block, (q + 1) * rows_per_block)
    of `lengths`): one program per block."""
    q = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    r = 0
    while r < rows_per_block:  # `while`: the interpreter cannot range() over arguments
        idx = r + offs
        m = idx < rows_per_block
        acc += tl.load(lengths_ptr + q * rows_per_block + idx, mask=m, other=0).to(tl.int64)
        r += BLOCK
    tl.store(sums_ptr + q, tl.sum(acc, 0))


@triton.jit(do_not_specialize=["n_blocks", "n_out", "num_a"])
def _block_plan_kernel(
    sums_ptr,
    permute_ptr,
    block_offsets_ptr,
    starts_ptr,
    out_offsets_ptr,
    n_blocks,
    n_out,
    num_a,
    TRANSPOSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program plans a block gather from the blocks' value counts (`sums`; what
    `reference._permute_value_blocks` computes with ~10 small torch ops): output block j
    is input block q(j); writes starts[j] (q(j)'s first value) and out_offsets (n_out + 1
    entries: the exclusive scan of the output blocks' value counts). q(j) = permute[j]
    (indexed_permute), or with TRANSPOSE q(j) = (j % num_a) * (n_blocks // num_a) +
    j // num_a ([a][c] -> [c][a])."""
    offs = tl.arange(0, BLOCK)
    # block_offsets = exclusive scan of sums (n_blocks + 1 entries)
    carry = tl.zeros([], dtype=tl.int64)
    tl.store(block_offsets_ptr, carry)
    base = 0
    while base < n_blocks:
        idx = base + offs
        x = tl.load(sums_ptr + idx, mask=idx < n_blocks, other=0)
        tl.store(block_offsets_ptr + idx + 1, tl.cumsum(x, 0) + carry, mask=idx < n_blocks)
        carry += tl.sum(x, 0)
        base += BLOCK
    tl.debug_barrier()  # the scan above is read back at random below
    carry = tl.zeros([], dtype=tl.int64)
    tl.store(out_offsets_ptr, carry)
    base = 0
    while base < n_out:
        j = base + offs
        m = j < n_out
        if TRANSPOSE:
            jj = j.to(tl.int64)
            q = (jj % num_a) * (n_blocks // num_a) + jj // num_a
        else:
            q = tl.load(permute_ptr + j, mask=m, other=0).to(tl.int64)
        start = tl.load(block_offsets_ptr + q, mask=m, other=0)
        size = tl.load(sums_ptr + q, mask=m, other=0)
        tl.store(starts_ptr + j, start, mask=m)
        tl.store(out_offsets_ptr + j + 1, tl.cumsum(size, 0) + carry, mask=m)
        carry += tl.sum(size, 0)
        base += BLOCK


def _block_plan(
    lengths: torch.Tensor,
    n_blocks: int,
    n_out: int,
    *,
    permute: Optional[torch.Tensor] = None,
    num_a: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts (n_out,), out_offsets (n_out + 1,)) int64 of a gather of the values of
    `n_blocks` blocks of equally many rows of flat `lengths` (rows may be 0), in the order
    `permute` or (without it) [a][c] -> [c][a] with `num_a` a's: two launches
    (`_block_sums_kernel`, one program per block, and `_block_plan_kernel`, one program)."""
    rows_per_block = lengths.numel() // n_blocks if n_blocks else 0
    sizes = (n_blocks, n_blocks + 1, n_out, n_out + 1)
    sums, block_offsets, starts, out_offsets = torch.empty(
        sum(sizes), dtype=torch.int64, device=lengths.device
    ).split(sizes)
    if n_blocks and rows_per_block:
        block = min(_PLAN_BLOCK, next_power_of_2(rows_per_block))
        _block_sums_kernel[(n_blocks,)](lengths, sums, rows_per_block, BLOCK=block, num_warps=4)
    else:
        sums.zero_()
    _block_plan_kernel[(1,)](
        sums, sums if permute is None else permute, block_offsets, starts, out_offsets,
        n_blocks, n_out, max(num_a, 1), TRANSPOSE=permute is None, BLOCK=_PLAN_BLOCK,
        num_warps=4,
    )  # fmt: skip
    return starts, out_offsets


def _gather_planned(
    x: torch.Tensor, starts: torch.Tensor, out_offsets: torch.Tensor, out_size: int
) -> torch.Tensor:
    """`gather_blocks` from int64 contiguous block starts and output offsets."""
    out = torch.empty(out_size, dtype=x.dtype, device=x.device)
    if out_size == 0:
        return out
    n_blocks, block = starts.numel(), 1024
    _gather_blocks_kernel[(cdiv(out_size, block),)](
        x.contiguous(), out, starts, out_offsets, n_blocks, out_size,
        N_ITERS=(n_blocks + 1).bit_length() + 1, BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out


def indexed_permute(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    permuted_lengths_sum: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Triton `indexed_permute` (fbgemm's permute_2D_sparse_data semantics): the block
    plan in two launches (`_block_plan`), then one gather per tensor; past
    `_PLAN_MAX_BLOCKS` rows + output rows, the shared plan of torch scans."""
    check_permutation_args(permute, lengths, values)
    num_rows = lengths.shape[0]
    if num_rows + permute.numel() > _PLAN_MAX_BLOCKS:
        return reference.indexed_permute_with(
            gather_blocks, permute, lengths, values, weights, permuted_lengths_sum
        )
    starts, out_offsets = _block_plan(
        lengths.reshape(-1), num_rows, permute.numel(), permute=permute.contiguous()
    )
    if permuted_lengths_sum is None:
        permuted_lengths_sum = int(out_offsets[-1])  # device sync: pass the size to avoid it
    out_values = _gather_planned(values, starts, out_offsets, permuted_lengths_sum)
    out_weights = None
    if weights is not None:
        out_weights = _gather_planned(weights, starts, out_offsets, permuted_lengths_sum)
    return lengths.index_select(0, permute), out_values, out_weights


def keyed_transpose(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    batch_sizes: Optional[torch.Tensor] = None,
    num_keys: Optional[int] = None,
    inverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Triton `keyed_transpose` ([rank][key][sample] <-> [key][rank][sample]). A fixed
    batch of at most `_PLAN_MAX_BLOCKS` / 2 (rank, key) blocks plans them in two launches
    (`_block_plan`, no permutation tensor); others take the shared plan of
    `reference.keyed_transpose_with` (torch scans)."""
    shaped = batch_sizes is None and values.dim() == 1 and lengths.dim() == 3
    if not shaped or 2 * lengths.shape[0] * lengths.shape[1] > _PLAN_MAX_BLOCKS:
        return reference.keyed_transpose_with(
            gather_blocks, lengths, values, weights,
            batch_sizes=batch_sizes, num_keys=num_keys, inverse=inverse,
        )  # fmt: skip
    num_a, num_c, _ = lengths.shape
    starts, out_offsets = _block_plan(
        lengths.reshape(-1), num_a * num_c, num_a * num_c, num_a=num_a
    )
    n = values.numel()
    out_values = _gather_planned(values, starts, out_offsets, n)
    out_weights = None if weights is None else _gather_planned(weights, starts, out_offsets, n)
    return lengths.transpose(0, 1).contiguous(), out_values, out_weights
