"""Triton fast paths of `embedding.reduce`: the per-row gradient sum (`segment_sum`) and
`mask_positions` (nonzero with a host-known count).

Owns their kernels and the per-row sum's level loop. The per-row sum's semantics are
`reduce.segment_sum_reference`'s, bit for bit: each row's gradients (in stable sorted
order) summed by the pairwise tree over their index inside the row's segment — at
stride s, element i (i % 2s == 0) adds element i + s when it exists. Two facts make a
chunked version exact:

* the tree's first log2(C) levels stay inside aligned chunks of C elements, and the
  later levels combine the chunk sums by the same pairwise rule over chunk indices; so
  the sum of a segment of c elements is the same tree applied to its ceil(c / C) chunk
  sums — one kernel launch per level, ceil(log_C(longest segment)) levels. A segment
  of at most C elements at a level is finished there (its chunk sum goes straight to
  the result row), so a later level runs only over the unfinished segments: at most
  1 / (C + 1) of the previous level's elements (host-known grid bounds, no read-back);
* a missing right partner ("pass through") equals adding -0.0, the exact additive
  identity of IEEE round-to-nearest (x + -0.0 == x bitwise, for x = -0.0 too), so a
  chunk is loaded with -0.0 in its empty lanes and reduced as a full power-of-two tree.

Adds are in the values' dtype (float32 or float64; other dtypes use the reference).
Deterministic: no float atomics; each output element has one writer. On CPU tensors this
module needs ``TRITON_INTERPRET=1`` set before triton is first imported (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale.kernels.common import cdiv, next_power_of_2

__all__ = [
    "segment_tree_sum",
    "mask_positions_triton",
    "mask_partition_triton",
    "run_stats_triton",
    "SUPPORTED_DTYPES",
]

SUPPORTED_DTYPES = (torch.float32, torch.float64)


@triton.jit(do_not_specialize=["num_segments", "dim"])
def _chunk_tree_kernel(
    src_ptr,
    gather_ptr,
    starts_ptr,
    counts_ptr,
    chunk_first_ptr,
    chunk_seg_ptr,
    out_ptr,
    res_ptr,
    num_segments,
    dim,
    GATHER: tl.constexpr,
    IS64: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG_CHUNK: tl.constexpr,
    BD: tl.constexpr,
):
    """Program (j, d-block): the tree sum of chunk j of segment s = chunk_seg[j]; s owns
    chunks [chunk_first[s], chunk_first[s + 1]) and its chunk m covers the segment's
    elements [m * CHUNK, (m + 1) * CHUNK). A segment of at most CHUNK elements is done:
    its one chunk sum is stored to result row s; otherwise to out row j (the next
    level's input)."""
    j = tl.program_id(0)
    live = j < tl.load(chunk_first_ptr + num_segments)  # grid is an upper bound
    seg = tl.load(chunk_seg_ptr + j, mask=live, other=0)  # dead slots: never written
    m = j - tl.load(chunk_first_ptr + seg)
    start = tl.load(starts_ptr + seg)
    count = tl.load(counts_ptr + seg)
    lane = tl.arange(0, CHUNK)
    local = m * CHUNK + lane
    valid = (local < count) & live
    rows = start + local
    if GATHER:
        rows = tl.load(gather_ptr + rows, mask=valid, other=0)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    cmask = cols < dim
    m2 = valid[:, None] & cmask[None, :]
    x = tl.load(src_ptr + rows.to(tl.int64)[:, None] * dim + cols[None, :], mask=m2, other=0.0)
    # empty lanes hold -0.0, built from its bit pattern (a -0.0 literal or a negated
    # zero can come out as +0.0: constant folding / negation lowered as 0 - x)
    if IS64:
        nz = tl.full([CHUNK, BD], -9223372036854775808, tl.int64).to(tl.float64, bitcast=True)
    else:
        nz = tl.full([CHUNK, BD], -2147483648, tl.int32).to(tl.float32, bitcast=True)
    x = tl.where(m2, x, nz)
    # pairwise tree over the chunk: rows (2i, 2i+1), then (4i, 4i+2), ...
    xt = tl.trans(x)  # [BD, CHUNK]
    for lvl in tl.static_range(LOG_CHUNK):
        pairs = tl.reshape(xt, [BD, CHUNK >> (lvl + 1), 2])
        a, b = tl.split(pairs)
        xt = a + b
    total = tl.reshape(xt, [BD])
    done = count <= CHUNK
    row = tl.where(done, seg, j).to(tl.int64)
    dst = tl.where(done, res_ptr, out_ptr)
    tl.store(dst + row * dim + cols, total, mask=cmask & live)


@triton.jit(do_not_specialize=["num_segments"])
def _level_counts_kernel(
    counts_ptr,
    prev_first_ptr,
    counts_out_ptr,
    chunk_first_ptr,
    num_segments,
    FIRST: tl.constexpr,
    CHUNK: tl.constexpr,
    BS: tl.constexpr,
):
    """One level's per-segment counts and chunk counts. FIRST: a segment's count is
    ``counts[s]``; later levels: its previous level's chunk count ``prev_first[s + 1] -
    prev_first[s]`` when above 1 (still unfinished), else 0, written to ``counts_out``.
    Writes ``chunk_first[0] = 0`` and ``chunk_first[1 + s] = ceil(count / CHUNK)``; an
    in-place cumsum then makes it the exclusive prefix (each segment's first chunk)."""
    seg = tl.program_id(0) * BS + tl.arange(0, BS)
    m = seg < num_segments
    if FIRST:
        c = tl.load(counts_ptr + seg, mask=m, other=0).to(tl.int64)
    else:
        hi = tl.load(prev_first_ptr + seg + 1, mask=m, other=0)
        c = hi - tl.load(prev_first_ptr + seg, mask=m, other=0)
        c = tl.where(c > 1, c, 0)
        tl.store(counts_out_ptr + seg, c, mask=m)
    tl.store(chunk_first_ptr + 1 + seg, (c + (CHUNK - 1)) // CHUNK, mask=m)
    tl.store(chunk_first_ptr + seg, tl.zeros_like(seg).to(tl.int64), mask=seg == 0)


@triton.jit(do_not_specialize=["num_segments", "grid"])
def _chunk_owner_kernel(chunk_first_ptr, chunk_seg_ptr, num_segments, grid, BS: tl.constexpr):
    """``chunk_seg[j] = s`` for every chunk j of segment s (j in [chunk_first[s],
    chunk_first[s + 1]), j < grid): one writer per chunk; a program loops as many times
    as its longest segment has chunks (1 for most)."""
    seg = tl.program_id(0) * BS + tl.arange(0, BS)
    m = seg < num_segments
    first = tl.load(chunk_first_ptr + seg, mask=m, other=0)
    n = tl.load(chunk_first_ptr + seg + 1, mask=m, other=0) - first
    kmax = tl.max(n, axis=0)
    k = 0
    while k < kmax:  # (a while loop: the interpreter cannot take a tensor range bound)
        j = first + k
        tl.store(chunk_seg_ptr + j, seg.to(tl.int64), mask=m & (k < n) & (j < grid))
        k += 1


_SEG_BLOCK = 1024  # segments per program of the two table kernels


def segment_tree_sum(
    values: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    max_count: int,
    *,
    chunk: int = 32,
) -> torch.Tensor:
    """Per-segment tree sums: row s of the result sums ``values[order[starts[s] + i]]``
    for i < counts[s] by the fixed pairwise tree (module docstring). ``values`` is
    [N, D] (or [N]); ``max_count`` is ``counts.max()`` or an upper bound of it (known on
    the host: no read-back). Rows of empty segments (count 0) are left unwritten
    (uninitialised memory). ``chunk`` (a power of two >= 2) only changes speed, never
    the result. Five launches per level: the counts kernel, an in-place cumsum (two
    kernels), the chunk-owner kernel, the tree kernel."""
    if chunk < 2 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 2, got {chunk}")
    if values.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"segment_tree_sum supports {SUPPORTED_DTYPES}, got {values.dtype}")
    flat = values.reshape(values.shape[0], -1).contiguous()
    n, dim = flat.shape
    u = counts.numel()
    if u == 0:
        return values.new_zeros((0, *values.shape[1:]))
    dev = flat.device
    bd = min(128, next_power_of_2(max(dim, 1)))
    log_chunk = chunk.bit_length() - 1
    src, gather = flat, order.to(torch.int64).contiguous()
    starts, counts = starts.to(torch.int64).contiguous(), counts.to(torch.int64).contiguous()
    longest = max(int(max_count), 1)
    res = torch.empty(u, dim, dtype=flat.dtype, device=dev)
    seg_grid = (cdiv(u, _SEG_BLOCK),)
    # host-known bounds of this level: elements in unfinished segments (m), unfinished
    # segments (k); a segment of c elements has ceil(c / chunk) <= c // chunk + 1 chunks
    m, k = n, min(u, n)
    first, prev_first = True, None
    while True:
        chunk_first = torch.empty(u + 1, dtype=torch.int64, device=dev)
        level_counts = counts if first else torch.empty(u, dtype=torch.int64, device=dev)
        _level_counts_kernel[seg_grid](
            counts, chunk_first if first else prev_first, level_counts, chunk_first, u,
            FIRST=first, CHUNK=chunk, BS=_SEG_BLOCK,
        )  # fmt: skip
        chunk_first.cumsum_(0)
        grid = max(min(m, m // chunk + k), 1)  # chunks this level (no read-back)
        chunk_seg = torch.empty(grid, dtype=torch.int64, device=dev)
        _chunk_owner_kernel[seg_grid](chunk_first, chunk_seg, u, grid, BS=_SEG_BLOCK)
        out = torch.empty(grid, dim, dtype=flat.dtype, device=dev)
        _chunk_tree_kernel[(grid, cdiv(dim, bd))](
            src, gather, starts, level_counts, chunk_first, chunk_seg, out, res, u, dim,
            GATHER=first, IS64=flat.dtype == torch.float64, CHUNK=chunk, LOG_CHUNK=log_chunk, BD=bd,
        )  # fmt: skip
        # segments of more than one chunk go on with their chunk sums; the others are done
        longest = -(-longest // chunk)
        k = min(k, m // (chunk + 1))
        m = min(grid, m // chunk + k)
        if longest <= 1 or k == 0:
            return res.reshape(u, *values.shape[1:])
        src, first, prev_first = out, False, chunk_first
        starts = chunk_first[:-1]
        counts = level_counts  # unused by the next level's counts kernel (FIRST=False)


# ---------------------------------------------------------------------------------------
# mask positions (nonzero with a host-known count)
# ---------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n", "count"])
def _compact_kernel(mask_ptr, incl_ptr, out_ptr, n, count, BLOCK: tl.constexpr):
    """out[incl[i] - 1] = i for every set mask[i] (incl: inclusive prefix count); a
    wrong host count never writes past ``out`` (the caller's count is trusted, as in
    the reference, but memory stays safe)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    keep = (tl.load(mask_ptr + offs, mask=inside, other=0) != 0) & inside
    pos = tl.load(incl_ptr + offs, mask=keep, other=1) - 1
    tl.store(out_ptr + pos, offs.to(tl.int64), mask=keep & (pos < count))


def mask_positions_triton(mask: torch.Tensor, count: int) -> torch.Tensor:
    """``torch.nonzero(mask).squeeze(1)`` for a 1-D bool ``mask`` with ``count`` set
    entries known on the host: one scan and one scatter launch (the reference,
    `embedding.reduce.mask_positions`, takes six)."""
    n = mask.numel()
    if count == n:
        return torch.arange(n, device=mask.device)
    out = torch.empty(count, dtype=torch.int64, device=mask.device)
    if count == 0:
        return out
    incl = torch.cumsum(mask, 0, dtype=torch.int64)
    block = 1024
    flags = mask.contiguous().view(torch.uint8)
    _compact_kernel[(cdiv(n, block),)](flags, incl, out, n, count, BLOCK=block)
    return out


@triton.jit(do_not_specialize=["n", "count"])
def _partition_kernel(mask_ptr, incl_ptr, out_ptr, n, count, BLOCK: tl.constexpr):
    """out[incl[i] - 1] = i for a set mask[i], out[count + i - incl[i]] = i otherwise
    (incl: inclusive prefix count of set entries). A wrong host count never writes past
    ``out`` (positions are clamped into the buffer; the result is then wrong, as the
    reference's would be, but memory stays safe)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    keep = tl.load(mask_ptr + offs, mask=inside, other=0) != 0
    incl = tl.load(incl_ptr + offs, mask=inside, other=0)
    pos = tl.where(keep, incl - 1, count + offs.to(tl.int64) - incl)
    ok = inside & (pos >= 0) & (pos < n)
    tl.store(out_ptr + pos, offs.to(tl.int64), mask=ok)


def mask_partition_triton(mask: torch.Tensor, count: int) -> torch.Tensor:
    """`embedding.reduce.mask_partition` for a 1-D bool ``mask``: positions of the set
    entries, then of the others, each in order: one scan and one launch, where two
    `mask_positions_triton` calls take two of each plus an inverted copy of the mask."""
    n = mask.numel()
    if count in (0, n):
        return torch.arange(n, device=mask.device)
    out = torch.empty(n, dtype=torch.int64, device=mask.device)
    incl = torch.cumsum(mask, 0, dtype=torch.int64)
    block = 1024
    flags = mask.contiguous().view(torch.uint8)
    _partition_kernel[(cdiv(n, block),)](flags, incl, out, n, count, BLOCK=block)
    return out


# ---------------------------------------------------------------------------------------
# runs of a sorted key array (group_rows_start's two counts)
# ---------------------------------------------------------------------------------------

_RUN_BLOCK = 1024  # keys per program of the run-stats kernel
_RUN_CHUNK = 1024  # blocks per iteration of the one-program total


@triton.jit
def _max_fn(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_fn(a, b):
    return tl.minimum(a, b)


@triton.jit(do_not_specialize=["n"])
def _run_block_kernel(keys_ptr, is_start_ptr, part_ptr, n, BLOCK: tl.constexpr):
    """Block b: ``is_start`` of its keys and four int64 partials at ``part[4b:4b+4]``:
    the number of run starts, the first and the last start's position (n / -1 when the
    block has none) and the longest stretch from a start in the block to a position in
    the block (a run's full length when its next start is in the same block)."""
    b = tl.program_id(0).to(tl.int64)
    i = b * BLOCK + tl.arange(0, BLOCK)
    inside = i < n
    k = tl.load(keys_ptr + i, mask=inside, other=0)
    prev = tl.load(keys_ptr + i - 1, mask=inside & (i > 0), other=0)
    start = inside & ((i == 0) | (k != prev))
    tl.store(is_start_ptr + i, start.to(tl.int8), mask=inside)
    pos = tl.where(start, i, -1)
    run_start = tl.associative_scan(pos, 0, _max_fn)
    stretch = tl.where(inside & (run_start >= 0), i - run_start + 1, 0)
    base = part_ptr + 4 * b
    tl.store(base, tl.sum(start.to(tl.int64), axis=0))
    tl.store(base + 1, tl.min(tl.where(start, i, n), axis=0))
    tl.store(base + 2, tl.max(pos, axis=0))
    tl.store(base + 3, tl.max(stretch, axis=0))


@triton.jit(do_not_specialize=["n", "nblocks"])
def _run_total_kernel(part_ptr, stats_ptr, n, nblocks, BB: tl.constexpr):
    """One program: ``stats = [number of runs, longest run]`` from the block partials.
    The run of a block's last start ends at the first start of the next block that has
    one (n past the end): blocks are visited last to first, BB at a time, with a
    prefix minimum over the chunk and the minimum of the chunks already seen (carry)."""
    total = tl.zeros([BB], dtype=tl.int64)
    longest = tl.zeros([BB], dtype=tl.int64)
    carry = n.to(tl.int64)  # first start after the current chunk
    r = tl.arange(0, BB)
    c = 0
    while c * BB < nblocks:  # (a while loop: the interpreter takes no tensor range)
        blk = nblocks - 1 - (c * BB + r).to(tl.int64)  # r = 0: the chunk's last block
        ok = blk >= 0
        base = part_ptr + 4 * blk
        cnt = tl.load(base, mask=ok, other=0)
        first = tl.load(base + 1, mask=ok, other=n)
        last = tl.load(base + 2, mask=ok, other=-1)
        inner = tl.load(base + 3, mask=ok, other=0)
        # the first start of block blk + 1 (r - 1 in this chunk; r = 0 takes the carry)
        following = tl.load(base + 5, mask=ok & (r > 0), other=n)
        nxt = tl.minimum(tl.associative_scan(following, 0, _min_fn), carry)
        cross = tl.where(last >= 0, nxt - last, 0)
        total += cnt
        longest = tl.maximum(longest, tl.maximum(inner, cross))
        carry = tl.minimum(carry, tl.min(first, axis=0))
        c += 1
    tl.store(stats_ptr, tl.sum(total, axis=0))
    tl.store(stats_ptr + 1, tl.max(longest, axis=0))


def run_stats_triton(
    sorted_keys: torch.Tensor, *, block: int = _RUN_BLOCK, chunk: int = _RUN_CHUNK
) -> tuple[torch.Tensor, torch.Tensor]:
    """For a sorted 1-D int64 ``sorted_keys`` (n >= 1): ``is_start`` (bool, True where
    a run of equal keys begins) and ``stats`` = int64 ``[number of runs, longest run]``
    on the device, in two launches (`embedding.reduce.run_stats_reference`: ~10).
    ``block`` (keys per program) and ``chunk`` (blocks per step of the total), powers of
    two, change only the speed (the tests shrink them to cover many blocks/chunks)."""
    for name, v in (("block", block), ("chunk", chunk)):
        if v < 2 or v & (v - 1):
            raise ValueError(f"run_stats_triton: {name} must be a power of two >= 2, got {v}")
    n = sorted_keys.numel()
    if n == 0:
        raise ValueError("run_stats_triton needs at least one key")
    keys = sorted_keys.contiguous()
    nblocks = cdiv(n, block)
    is_start = torch.empty(n, dtype=torch.bool, device=keys.device)
    part = torch.empty(4 * nblocks, dtype=torch.int64, device=keys.device)
    stats = torch.empty(2, dtype=torch.int64, device=keys.device)
    _run_block_kernel[(nblocks,)](keys, is_start.view(torch.int8), part, n, BLOCK=block)
    bb = min(chunk, next_power_of_2(nblocks))
    _run_total_kernel[(1,)](part, stats, n, nblocks, BB=bb)
    return is_start, stats
