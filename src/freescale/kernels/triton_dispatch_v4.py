"""Triton ranged dispatch "v4": large tiles ranked serially, scattered flat.

Owns: `ranged_dispatch_v4`, its kernels and its tuning defaults (`default_config_v4`).
Same semantics and bits as `reference.ranged_dispatch` (tested in the interpreter and,
compiled, on an H200 by `benchmarks/check_kernels_cuda.py`), same call as v3
(`triton_impl.ranged_dispatch_v1(dest_major=True)`) plus keyword tuning knobs.
`ops.ranged_dispatch` runs it on CUDA from `ops.V4_MIN_IDS` = 1 id per call, up to
`ops.V5_MIN_IDS` (2^25) ids, and above where v5 cannot run (weights, W > 4096, not sm_90).

Measured (H200, 2^26 ids, git a2674e6; BENCHMARKS.md "kernels"): 0.91 ms at W=8, 3.09
ms at W=1024 (0.41 / 0.143 of the HBM floor). Nsight Compute puts the W=1024 rank kernel
at 86% of L2 throughput (the counter write-backs below) and the scatter at 83M store
sectors for 2^26 8-byte ids. Both costs come from state and reordering that would
belong in shared memory, which Triton does not let a kernel index.

Why: v3 sorts every 512-id tile (a bitonic `tl.sort`, 73-84% of its time on an H200) and
counts every tile over W bins (`tl.histogram`, whose ballot scheme costs ~W/32 * log2 W
operations per id) into a [W][tiles] matrix that at 2^26 ids and W=1024 is 537 MB, more
than the ids. v4 keeps v3's idea (the output is the input stably sorted by dest, so an id
goes to the exclusive scan of per-(dest, tile) counts in [dest][tile] order plus its rank
among same-dest ids earlier in its tile) and changes how both parts are computed:

* Tiles are large (`tile` ids; 1K-8K on a GPU) and follow keys only (one block size per
  tile), not segments: the count matrix has W * (N / tile + K) entries, 8M int32 (32 MB)
  at 2^26 ids, W=1024, 8K-id tiles, instead of 134M.
* No sort and no histogram. `_v4_rank_kernel` (one warp per tile) walks its tile in order,
  `chunk` (32) ids at a time, keeping per-dest counters in a private row of a global
  scratch matrix (W int32, L1/L2-resident). For a chunk it compares every lane's dest with
  every other lane's ([32, 32] equalities OR-reduced into a 32-bit "peers" mask per lane):
  rank in tile = counter[dest] + popcount(peers below the lane); the last lane of each dest
  writes the counter back. Two barriers per chunk order the counter reads, the write-back
  and the next chunk's reads. It stores (dest << 16 | rank in tile) per id (int32), so
  the work per id does not depend on W (~6 warp instructions per id on sm_90 by static
  count, v3's sort + histogram ~20-25).
* `_v4_scatter_kernel` is flat and fully parallel: position = [tile][dest] exclusive scan
  (`et`, one contiguous W-row per tile, loaded once per program and indexed with
  `tl.gather`, i.e. through shared memory; by default up to W = 1024, on request up to
  4096: `V4Config.et_gather`) + rank; local row from the id.
  A tile's scatter blocks are adjacent in launch order (`V4Config.scatter_order`), so
  the short per-dest runs a tile writes are completed while their sectors sit in L2.
* Same-dest lanes of a chunk come from PTX ``match.any.sync`` on CUDA
  (`V4Config.peers`; the [32, 32] compare below is what the interpreter runs).

Output lengths (`V4Config.lengths_mode`). "rows" (default): before ranking the piece of
each segment s it owns, the rank program stores its counters as a contiguous row
snaps[s, :] (ids of each dest in the tile before s's first id). With
P(d, s) = exclusive scan at (d, tile owning s) + snaps[s, d] (the output position of
(d, s)'s first id; P(d, S) = the scan's end), lengths[d, s] = P(d, s + 1) - P(d, s); the
finish kernel computes it in [dest] x [segment] blocks, reading snapshot rows along dests
and writing lengths along segments, and writes the [tile][dest] copy of the scan in
blocks too. A segment crossing tiles needs no special case. "columns" (the first v4,
kept for comparison): the rank program takes W-wide differences of counter snapshots at
segment ends and stores each owned segment's lengths[:, s] directly (W stores S * 8 bytes
apart); a segment running past its tile leaves partial counts (`tail` in its first tile,
`head` in its last) that `_v4_finish_kernel` completes from the scan.

Launches (six, like v3; five up to `FUSED_TABLES_MAX_TILES` tiles, where the first two
are one single-program launch): segment / key-tile offsets (one program); tile table
(k-ary searches, `SEARCH_FAN`); rank; `torch.cumsum` of the [dest][tile] counts; finish;
scatter. Deterministic: no atomics, one writer per output element, per-tile state
updated in a fixed order. No host-device sync (sizes come from shapes). World size is a
compile-time constant (cheap divisions; one compiled variant per W). On CPU tensors this
module needs ``TRITON_INTERPRET=1`` set before triton is first imported.

Cost that grows with W (arithmetic from the code; "large" workload of
benchmarks/kernels.py: N = 2^26 uniform int64 ids, int64 lengths, K = 4, B = 8192, so
S = 32768 segments of ~2048 ids; default tile 8192, so T = N / tile + K = 8196 programs,
8188 of them ending inside a segment; chunk 32, so 2^21 chunks). Counts are element
accesses, W = 8 -> W = 1024 (x128 unless said):

* Rank, "columns": per owned segment 2 W-wide loads + 1 W-wide store of rows (3 S W:
  0.8M -> 101M) and W int64 stores lengths[d * S + s], 256 KB apart: S W = 0.26M ->
  33.5M stores, each its own 32-byte sector of a 268 MB array (> the 50 MB L2) written
  column by column: >= 1.07 GB of sector traffic at W = 1024 for 268 MB of payload. Per
  tile ~6 W-wide row passes (zero, head, snapshot, counts; 6 T W: 0.4M -> 50M), the
  counts store counts[d * T + t] 32 KB apart (T W = 66K -> 8.4M). Per-program rows
  (counters, snapshot, head) 3 W * 4 B = 96 B -> 12 KB; with up to 32 one-warp programs
  per SM that is 384 KB at W = 1024, more than an SM's 256 KB L1 (counter rows likely
  re-read from L2 each chunk: an estimate).
* Rank, both modes: per chunk the counter gather and write-back hit ~W/8 (1 - (1 - 8/W)^32)
  distinct 32-byte sectors of the row: 1 (W=8), 4 (32), 14 (128), 20 (256), 25 (512),
  28 (1024): 2.1M -> ~60M sector requests each way, on the serial path of every chunk.
* Finish, "columns": et (T W strided scan reads, 32 KB apart, + T W row stores: 66K ->
  8.4M each) and for each crossing segment 2 strided scan reads + W strided lengths
  stores: +8.4M int64 stores 256 KB apart, +16.8M strided reads.
* cumsum: T W int32 each way, 0.26 MB -> 33.6 MB. Scatter: a tile gives each dest a
  run of tile / W output ids, 1024 (8 KB) at W = 8, 8 (64 B) at W = 1024, where a
  1024-id program sees ~1 id per dest: 2^26 scattered 8-byte value stores (partial
  sectors) instead of coalesced runs; the et row gather per id spreads the same way.
* Not W-dependent: the per-id rank work, values / ranks / perm traffic (the HBM floor).

The measured tile sweep at W = 1024 (2048 -> 16384-id tiles: T W 33.6M -> 4.2M, x8 fewer)
kept v4 within 7.0-7.6 ms (chunk 32), so the T W terms do not dominate; S W (the rank
kernel's column-wise lengths stores), the per-chunk sector divergence and the scatter's
short runs do not depend on the tile. A marginal fit, W = 512 -> 1024 (+2.2 ms for +21M
column-strided lengths stores, ~0.1 ns each), would put up to ~4 ms of the 7.5 ms in
those stores if the other terms were flat there (they are not quite: an upper bound).
Caveat: at tile 2048 the finish kernel's crossing stores grow to 33.5M, yet that tile
was the fastest; there consecutive programs fill adjacent columns at nearly the same
time (sectors merge in L2), while a rank program writes its own segments' columns a
quarter of its run apart, so the cost per strided store depends on the L2 merge window.
Only a per-kernel profile settles the split.

"rows" removes these stores: per owned segment one contiguous W-row load and store (S W
int32: 134 MB written and read back sequentially at W = 1024, and that much more
memory), no head / tail / snapshot rows (per-program rows 4 KB at W = 1024), no crossing
fix-up, lengths and et written by blocked transposes with coalesced reads and writes.
Expected effect (an estimate, not measured): ~1.3-2.7 GB of sector-granular DRAM traffic
(42M partial-sector stores, twice if L2 read-fills them) traded for ~0.27 GB of extra
sequential traffic at W = 1024, i.e. somewhere between ~0.3 ms and the ~4 ms bound above
saved; ~nothing at W = 8. Unchanged: the per-chunk counter divergence, the strided counts
store and the scatter's short runs (a dest-radix pre-pass or larger per-dest runs would
be the next step), so "rows" alone is not expected to reach ~0.9 ms at W = 1024.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from freescale.kernels import reference
from freescale.kernels.common import DispatchResult, cdiv, check_dispatch_inputs, next_power_of_2

MAX_WORLD = (1 << 15) - 1  # dest is stored in the high 16 bits of a non-negative int32
MAX_TILE = 1 << 16  # the rank in tile in the low 16 bits
LENGTHS_MODES = ("rows", "columns")  # `V4Config.lengths_mode`
SCATTER_ORDERS = ("tile", "block")  # `V4Config.scatter_order`
PEERS = ("auto", "match", "compare")  # `V4Config.peers`
ET_GATHERS = ("global", "row")  # `V4Config.et_gather`
ET_ROW_MAX_WORLD = 4096  # et_gather="row" holds a [next_power_of_2(W)] row per program
ET_ROW_DEFAULT_MAX_WORLD = 1024  # "row" by default up to here (measured and GPU-checked)
# Tile table (`benchmarks/results/dispatch_tables_{b42741b,7f780b3}.json`, H200, session
# 30): on many programs TABLE_BLOCK tiles each (256: 16 us at 2^26 ids against 90-95 us
# with 1024, whose [1024, SEARCH_FAN] probe rounds are 128 loads a thread with 4 warps);
# in the single-program launch FUSED_TABLE_BLOCK tiles a pass on FUSED_TABLE_WARPS warps
# (one rank's ~1M ids in 1K-id tiles: 12.4 us with 512 against 16.8 with 1024).
TABLE_BLOCK = 256
FUSED_TABLE_BLOCK = 512
FUSED_TABLE_WARPS = 16
# The searches of the tile table are k-ary: each round loads SEARCH_FAN probes per tile
# and keeps one of SEARCH_FAN + 1 sub-ranges, so a key of B segments takes
# `search_rounds(B, SEARCH_FAN)` dependent loads (4 at B = 8192) instead of a binary
# search's ~14 (fan 8 and 32 were slower in the same run).
SEARCH_FAN = 16
# Segment offsets: one program scans the lengths SEG_BLOCK_MAX at a time (32K segments:
# 30.5 us with 2048, 32.6 with 8192, 40 with 16384).
SEG_BLOCK_MAX = 2048
# Beyond one program's pass (calls past FUSED_TABLES_MAX_TILES tiles with more than
# SEG_SCAN_BLOCK segments) the segment offsets run on SEG_SCAN_BLOCK-segment programs:
# one program took 30.5 us for 32K segments on an H200 (dispatch_tables_7f780b3.json).
SEG_SCAN_BLOCK = 2048
SEG_SUMS_BLOCK = 1024  # block sums a scan program adds per pass
# Up to this many offset blocks (8M segments) each scan program adds the earlier blocks'
# sums itself (at most SEG_SUMS_MAX_BLOCKS^2 / 2 loads in all, from L2); beyond, one more
# single-program launch turns the block sums into their prefix first.
SEG_SUMS_MAX_BLOCKS = 4096
SEG_SUMS_SCAN_BLOCK = 2048  # block sums per pass of that launch
_CARVE_ALIGN = 512  # bytes: where `_carve` starts each scratch view
# Up to this many tiles (one rank's ~1M ids: ~980 1K-id tiles; up to ~2M ids with 1K-id
# tiles) the segment offsets and the tile table are one single-program launch
# (`_v4_tables_kernel`, at most two table blocks in turn: ~12 us of one SM each on an
# H200, dispatch_profile_etrow2_c3aedfe.json), saving a launch where the host's per-call
# work is what a call costs (benchmarks/results/dispatch_host.json); beyond it the table
# runs on many programs. Same results either way (tests force both).
FUSED_TABLES_MAX_TILES = 2048


# ---------------------------------------------------------------------------------------
# device helpers
# ---------------------------------------------------------------------------------------


@triton.jit
def _owner(ids, blk, WORLD: tl.constexpr, MODULO: tl.constexpr):
    """Owner (int32) of int64 ids >= 0, `reference.owner_and_local`'s rule.

    Block mode without a 64-bit division (~40 instructions per id in the SASS of v5's
    kernels, and a called subroutine where an operand exceeds 32 bits): where
    ids < blk * WORLD the quotient ids // blk is below WORLD < 2^15, and the float32
    estimate ids * (1 / blk) is within a relative 2^-20 of ids / blk, i.e. within 2^-5
    of it: its floor is the quotient or one off either way, which one exact int64
    remainder fixes. Elsewhere the estimate is clamped (no overflow in the conversion)
    and unused. Past blk * WORLD the owner is ids % WORLD in unsigned arithmetic (`umod`:
    ids are >= 0). `owner_exact` is the plain rule."""
    return _owner_inv(ids, blk, 1.0 / blk.to(tl.float32), WORLD, MODULO)


@triton.jit
def _owner_inv(ids, blk, inv, WORLD: tl.constexpr, MODULO: tl.constexpr):
    """`_owner` given inv = 1.0 / blk.to(float32) (computed once per tile by callers that
    loop)."""
    if MODULO:
        owner = umod(ids, WORLD)
    else:
        est = tl.minimum(ids.to(tl.float32) * inv, WORLD * 1.0)
        q = est.to(tl.int32).to(tl.int64)
        r = ids - q * blk
        q = tl.where(r < 0, q - 1, tl.where(r >= blk, q + 1, q))
        owner = tl.where(ids < blk * WORLD, q, umod(ids, WORLD))
    return owner.to(tl.int32)


@triton.jit
def narrow_ok(blk, WORLD: tl.constexpr):
    """Whether `owner_local_narrow` is exact for a key of block size blk (a scalar: callers
    branch on it once per tile or piece)."""
    return blk.to(tl.int64) * (WORLD + 1) < 2147483648  # 2^31


@triton.jit
def owner_local_narrow(ids, blk, inv, WORLD: tl.constexpr):
    """Block mode's (owner int32, local row int64) of int64 ids >= 0 with 32-bit arithmetic,
    valid where `narrow_ok(blk)`: an id below blk * WORLD (< 2^31) is its own low word, so
    the float estimate, its one-off correction and the remainder (the local row, which
    `_owner_inv`'s callers compute again in 64 bits) are int32 operations, and the I2F of
    an int64 becomes one of an int32. Past blk * WORLD: ids % WORLD and ids // WORLD
    (`umod` / `udiv`), as `_owner_inv`. Same results as `reference.owner_and_local`
    (interpreter test `test_owner_local_narrow_is_exact`, with a mutation it catches)."""
    blk32 = blk.to(tl.int32)
    lo = ids.to(tl.int32)  # the low word; exact below blk * WORLD
    q = tl.minimum(lo.to(tl.float32) * inv, WORLD * 1.0).to(tl.int32)
    r = lo - q * blk32  # |r| <= blk * (WORLD + 1) < 2^31 where the id is in range
    neg = r < 0
    big = r >= blk32
    q = tl.where(neg, q - 1, tl.where(big, q + 1, q))
    r = tl.where(neg, r + blk32, tl.where(big, r - blk32, r))
    inside = ids < blk * WORLD
    owner = tl.where(inside, q, umod(ids, WORLD).to(tl.int32))
    local = tl.where(inside, r.to(tl.int64), udiv(ids, WORLD))
    return owner, local


@triton.jit
def umod(ids, WORLD: tl.constexpr):
    """ids % WORLD for int64 ids >= 0 (the dispatch's contract), as unsigned arithmetic:
    the signed rule's sign fix-up (3 instructions per id at a power-of-two W) falls away."""
    return (ids.to(tl.uint64) % WORLD).to(tl.int64)


@triton.jit
def udiv(ids, WORLD: tl.constexpr):
    """ids // WORLD for int64 ids >= 0, unsigned (see `umod`)."""
    return (ids.to(tl.uint64) // WORLD).to(tl.int64)


@triton.jit
def owner_exact(ids, blk, WORLD: tl.constexpr, MODULO: tl.constexpr):
    """`_owner` with the 64-bit division (the reference its tests compare against)."""
    if MODULO:
        owner = ids % WORLD
    else:
        owner = tl.where(ids < blk * WORLD, ids // blk, ids % WORLD)
    return owner.to(tl.int32)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _popcount32(x):
    """Set bits of int32 x (SWAR; the masks clear what arithmetic shifts bring in and the
    wrapping multiply sums the four byte counts into the top byte)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _match_any(dest):
    """PTX ``match.any.sync``: per lane, the lanes of its warp holding the same int32 (one
    instruction). Valid only where element i of a 32-element tensor lives in lane i of the
    one warp (`V4Config.peers`; `benchmarks/check_kernels_cuda.py` checks the bits)."""
    return tl.inline_asm_elementwise(
        "match.any.sync.b32 $0, $1, -1;", "=r,r", [dest], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _popc(x):
    """PTX ``popc.b32`` (set bits of an int32; elementwise, any layout)."""
    return tl.inline_asm_elementwise(
        "popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _chunk_rank(dest, CHUNK: tl.constexpr, MATCH: tl.constexpr):
    """Per lane of a chunk (CHUNK <= 32 lanes): (earlier lanes with the same dest, whether
    no later lane has it). ``peers`` holds, as bits, the lanes sharing the lane's dest:
    with MATCH (CUDA, CHUNK == 32) the warp's ``match.any`` and ``popc`` instructions,
    otherwise [chunk, chunk] equalities OR-reduced over axis 0 (in-thread with one warp;
    ~100 instructions per chunk on sm_90, what the interpreter runs)."""
    bit = tl.full([CHUNK], 1, tl.int32) << tl.arange(0, CHUNK)
    below = bit - 1  # lanes before this one
    above = ~(below | bit)  # lanes after this one
    if MATCH:
        tl.static_assert(CHUNK == 32, "match.any needs one id per lane of the warp")
        peers = _match_any(dest)
        earlier = _popc(peers & below)
    else:
        same = dest[:, None] == dest[None, :]
        peers = tl.reduce(tl.where(same, bit[:, None], 0), 0, _bit_or)
        earlier = _popcount32(peers & below)
    return earlier, (peers & above) == 0


@triton.jit
def _exclusive_at(scan_ptr, off, mask):
    """The exclusive scan at flat index ``off`` of an inclusive scan (one entry earlier)."""
    return tl.load(scan_ptr + off - 1, mask=mask & (off > 0), other=0)


@triton.jit
def _rank_piece(
    values_ptr,
    ranks_ptr,
    row_ptr,
    lo,
    hi,
    blk,
    WORLD: tl.constexpr,
    MODULO: tl.constexpr,
    CHUNK: tl.constexpr,
    MATCH: tl.constexpr,
):
    """Rank ids ``values[lo:hi]`` (one key) in order, CHUNK at a time, against the counters
    ``row_ptr[0:W]`` (ids of each dest seen so far in this tile); write
    ``ranks[i] = dest << 16 | rank`` and advance the counters. One warp: a lane per id."""
    lane = tl.arange(0, CHUNK)
    # ids travel as int64 also for int32 input: converting the 4-byte ids is as cheap to
    # the compiler as converting dest, and it would then recompute the owner (divisions)
    # for every lane's view of the [chunk, chunk] comparison (~5x the instructions)
    # Loads run two chunks ahead: one warp's chunk is ~180 instructions, less than a DRAM
    # round trip, and 32 one-warp programs per SM need several loads in flight each.
    nxt = tl.load(values_ptr + lo + lane, mask=lo + lane < hi, other=0).to(tl.int64)
    nxt2 = tl.load(values_ptr + lo + CHUNK + lane, mask=lo + CHUNK + lane < hi, other=0)
    nxt2 = nxt2.to(tl.int64)
    p = lo
    while p < hi:  # `while`: the interpreter cannot range() over arguments
        offs = p + lane
        mask = offs < hi
        ids = nxt
        nxt = nxt2
        ahead = offs + 2 * CHUNK
        nxt2 = tl.load(values_ptr + ahead, mask=ahead < hi, other=0).to(tl.int64)
        dest = tl.where(mask, _owner(ids, blk, WORLD, MODULO), -1)  # padding matches none
        earlier, last = _chunk_rank(dest, CHUNK, MATCH)
        rank = tl.load(row_ptr + dest, mask=mask, other=0) + earlier
        tl.store(ranks_ptr + offs, dest * 65536 + rank, mask=mask)
        tl.debug_barrier()  # every lane has read its counter before any is written back
        # one writer per counter (the dest's last lane): a store from several lanes to one
        # address leaves an unspecified one on a GPU (the interpreter keeps the last)
        tl.store(row_ptr + dest, rank + 1, mask=mask & last)
        tl.debug_barrier()  # written counters are visible to the next chunk's reads
        p += CHUNK


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _segment_offsets(
    lengths_ptr, seg_offsets_ptr, key_tile_first_ptr, num_segments, num_keys, batch,
    TILE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program. seg_offsets (S + 1,) = [0, cumsum(lengths)], then `_key_tile_offsets`."""
    lane = tl.arange(0, BLOCK)
    carry = tl.full([], 0, tl.int64)
    tl.store(seg_offsets_ptr, carry)
    first = 0
    while first < num_segments:
        offs = first + lane
        mask = offs < num_segments
        n = tl.load(lengths_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.store(seg_offsets_ptr + 1 + offs, tl.cumsum(n, 0) + carry, mask=mask)
        carry += tl.sum(n, 0)
        first += BLOCK
    tl.debug_barrier()  # the offsets written above are read back below by other threads
    _key_tile_offsets(seg_offsets_ptr, key_tile_first_ptr, num_keys, batch, TILE, BLOCK)


@triton.jit
def _key_tile_offsets(seg_offsets_ptr, key_tile_first_ptr, num_keys, batch, TILE: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """One program. key_tile_first (K + 1,) = [0, cumsum(max(1, ceil(ids of key k /
    TILE)))] from the segment offsets: key k owns tiles [key_tile_first[k],
    key_tile_first[k + 1]) (an empty key one empty tile, which owns its segments and
    writes their zero lengths)."""
    lane = tl.arange(0, BLOCK)
    tiles_carry = tl.full([], 0, tl.int64)
    tl.store(key_tile_first_ptr, tiles_carry)
    first = 0
    while first < num_keys:
        k = first + lane
        mask = k < num_keys
        lo = tl.load(seg_offsets_ptr + k.to(tl.int64) * batch, mask=mask, other=0)
        hi = tl.load(seg_offsets_ptr + (k + 1).to(tl.int64) * batch, mask=mask, other=0)
        tiles = tl.where(mask, tl.maximum((hi - lo + (TILE - 1)) // TILE, 1), 0)
        tl.store(key_tile_first_ptr + 1 + k, tl.cumsum(tiles, 0) + tiles_carry, mask=mask)
        tiles_carry += tl.sum(tiles, 0)
        first += BLOCK


def search_rounds(n: int, fan: int) -> int:
    """Rounds `_first_at_least` needs for a range of n entries with `fan` probes per
    round: each round leaves at most ceil(n / fan) - 1 candidates."""
    if fan < 2:
        raise ValueError(f"fan must be >= 2, got {fan}")
    rounds = 0
    while n > 0:
        n = -(-n // fan) - 1
        rounds += 1
    return rounds


@triton.jit
def _first_at_least(ptr, lo, hi, target, active, STRICT: tl.constexpr, ROUNDS: tl.constexpr,
                    FAN: tl.constexpr):  # fmt: skip
    """Per element of the [BLOCK] vectors: the first s in [lo, hi) with ptr[s] >= target
    (> target if STRICT), hi if none; ptr[lo:hi] must be non-decreasing; FAN a power of
    two. A k-ary search: each round loads FAN probes (lo + (i + 1) * step - 1, step =
    ceil((hi - lo) / FAN)) as one [BLOCK, FAN] load; the c probes below the target are a
    prefix, so the answer lies in [lo + c * step, min(lo + (c + 1) * step - 1, hi)]: at
    most step - 1 candidates remain. ROUNDS = `search_rounds(hi - lo, FAN)` rounds end
    with lo == hi (the answer). Inactive elements load nothing."""
    probe = (tl.arange(0, FAN) + 1)[None, :]
    for _ in tl.static_range(ROUNDS):
        n = hi - lo
        step = (n + (FAN - 1)) // FAN
        q = lo[:, None] + probe * step[:, None] - 1
        valid = (q < hi[:, None]) & (active & (n > 0))[:, None]
        v = tl.load(ptr + q, mask=valid, other=0)
        if STRICT:
            hit = v > target[:, None]
        else:
            hit = v >= target[:, None]
        c = tl.sum((valid & ~hit).to(step.dtype), axis=1)
        new_lo = lo + c * step
        new_hi = tl.minimum(new_lo + step - 1, hi)
        lo = new_lo
        hi = tl.where(n > 0, new_hi, hi)
    return lo


@triton.jit
def _tile_table_block(
    t, seg_offsets_ptr, key_tile_first_ptr, tile_key_ptr, tile_start_ptr, tile_end_ptr,
    tile_seg_lo_ptr, tile_seg_hi_ptr, num_tiles, num_keys, batch, TILE: tl.constexpr,
    KEY_ROUNDS: tl.constexpr, SEG_ROUNDS: tl.constexpr, FAN: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """The tile table entries of the tiles ``t`` (a [BLOCK] int64 vector): tile t -> key,
    ids [start, end) (TILE ids of one key, the key's last tile shorter) and the segments
    it owns, [seg_lo, seg_hi): those starting in [start, end), plus, in the key's last
    tile, the empty segments at the key's end. Spare tiles past the last one are empty
    (start = end = 0, no segments). Searches: `_first_at_least` (KEY_ROUNDS over the
    K + 1 key offsets, SEG_ROUNDS over the key's B segments)."""
    in_grid = t < num_tiles
    # key = last k in [0, K] with key_tile_first[k] <= t
    zero32 = tl.zeros([BLOCK], dtype=tl.int32)
    k_hi = _first_at_least(key_tile_first_ptr, zero32, zero32 + num_keys + 1, t, in_grid,
                           True, KEY_ROUNDS, FAN)  # fmt: skip
    used = in_grid & (t < tl.load(key_tile_first_ptr + num_keys))
    key = tl.minimum(k_hi - 1, num_keys - 1)
    first_tile = tl.load(key_tile_first_ptr + key, mask=used, other=0)
    last = t == tl.load(key_tile_first_ptr + key + 1, mask=used, other=0) - 1
    seg0 = key.to(tl.int64) * batch
    key_start = tl.load(seg_offsets_ptr + seg0, mask=used, other=0)
    key_end = tl.load(seg_offsets_ptr + seg0 + batch, mask=used, other=0)
    start = key_start + (t - first_tile) * TILE
    end = tl.minimum(start + TILE, key_end)
    # seg_lo = first s of the key with seg_offsets[s] >= start; likewise for end
    seg_lo = _first_at_least(seg_offsets_ptr, seg0, seg0 + batch, start, used, False,
                             SEG_ROUNDS, FAN)  # fmt: skip
    seg_end = _first_at_least(seg_offsets_ptr, seg0, seg0 + batch, end, used & ~last, False,
                              SEG_ROUNDS, FAN)  # fmt: skip
    seg_hi = tl.where(last, seg0 + batch, seg_end)
    zero = tl.zeros([BLOCK], dtype=tl.int64)
    tl.store(tile_key_ptr + t, tl.where(used, key, 0), mask=in_grid)
    tl.store(tile_start_ptr + t, tl.where(used, start, zero), mask=in_grid)
    tl.store(tile_end_ptr + t, tl.where(used, end, zero), mask=in_grid)
    tl.store(tile_seg_lo_ptr + t, tl.where(used, seg_lo, zero), mask=in_grid)
    tl.store(tile_seg_hi_ptr + t, tl.where(used, seg_hi, zero), mask=in_grid)


@triton.jit(do_not_specialize=["num_segments", "num_keys", "batch"])
def _v4_segment_kernel(
    lengths_ptr,
    seg_offsets_ptr,
    key_tile_first_ptr,
    num_segments,
    num_keys,
    batch,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: `_segment_offsets`."""
    _segment_offsets(lengths_ptr, seg_offsets_ptr, key_tile_first_ptr, num_segments, num_keys,
                     batch, TILE, BLOCK)  # fmt: skip


@triton.jit(do_not_specialize=["num_segments"])
def _v4_seg_sums_kernel(lengths_ptr, block_sums_ptr, num_segments, BLOCK: tl.constexpr):
    """Program b: block_sums[b] = the sum of lengths[b * BLOCK : (b + 1) * BLOCK] (int64),
    the first pass of the many-program segment offsets."""
    b = tl.program_id(0)
    offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    n = tl.load(lengths_ptr + offs, mask=offs < num_segments, other=0).to(tl.int64)
    tl.store(block_sums_ptr + b, tl.sum(n, 0))


@triton.jit(do_not_specialize=["num_blocks"])
def _v4_sums_scan_kernel(block_sums_ptr, num_blocks, BLOCK: tl.constexpr):
    """One program: block_sums becomes its exclusive prefix sum, in place, BLOCK at a time
    (for calls with more than `SEG_SUMS_MAX_BLOCKS` offset blocks, where every scan
    program adding all earlier block sums itself would be quadratic)."""
    j = tl.arange(0, BLOCK)
    carry = tl.full([], 0, tl.int64)
    first = 0
    while first < num_blocks:
        m = first + j < num_blocks
        x = tl.load(block_sums_ptr + first + j, mask=m, other=0)
        tl.store(block_sums_ptr + first + j, tl.cumsum(x, 0) - x + carry, mask=m)
        carry += tl.sum(x, 0)
        first += BLOCK


@triton.jit(do_not_specialize=["num_segments"])
def _v4_seg_scan_kernel(lengths_ptr, block_sums_ptr, seg_offsets_ptr, num_segments,
                        BLOCK: tl.constexpr, SUMS_BLOCK: tl.constexpr,
                        PREFIXED: tl.constexpr):  # fmt: skip
    """Program b: seg_offsets[1 + i] for i in block b = the sum of the block sums before
    b (PREFIXED: block_sums[b], already an exclusive prefix sum; else added here,
    SUMS_BLOCK at a time) + the inclusive cumsum within the block; program 0 also writes
    seg_offsets[0] = 0. Same values as `_segment_offsets`'s single pass."""
    b = tl.program_id(0)
    if PREFIXED:
        carry = tl.load(block_sums_ptr + b)
    else:
        carry = tl.full([], 0, tl.int64)
        j = tl.arange(0, SUMS_BLOCK)
        first = 0
        while first < b:
            carry += tl.sum(tl.load(block_sums_ptr + first + j, mask=first + j < b, other=0), 0)
            first += SUMS_BLOCK
    offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_segments
    n = tl.load(lengths_ptr + offs, mask=mask, other=0).to(tl.int64)
    tl.store(seg_offsets_ptr + 1 + offs, tl.cumsum(n, 0) + carry, mask=mask)
    if b == 0:
        tl.store(seg_offsets_ptr, carry)  # 0: no blocks before block 0


@triton.jit(do_not_specialize=["num_keys", "batch"])
def _v4_key_tiles_kernel(seg_offsets_ptr, key_tile_first_ptr, num_keys, batch,
                         TILE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """One program: `_key_tile_offsets` (after the many-program segment offsets)."""
    _key_tile_offsets(seg_offsets_ptr, key_tile_first_ptr, num_keys, batch, TILE, BLOCK)


@triton.jit(do_not_specialize=["num_tiles", "num_keys", "batch"])
def _v4_tile_table_kernel(
    seg_offsets_ptr,
    key_tile_first_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    num_tiles,
    num_keys,
    batch,
    TILE: tl.constexpr,
    KEY_ROUNDS: tl.constexpr,
    SEG_ROUNDS: tl.constexpr,
    FAN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program p: `_tile_table_block` of tiles [p * BLOCK, (p + 1) * BLOCK)."""
    t = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    _tile_table_block(t, seg_offsets_ptr, key_tile_first_ptr, tile_key_ptr, tile_start_ptr,
                      tile_end_ptr, tile_seg_lo_ptr, tile_seg_hi_ptr, num_tiles, num_keys, batch,
                      TILE, KEY_ROUNDS, SEG_ROUNDS, FAN, BLOCK)  # fmt: skip


@triton.jit(do_not_specialize=["num_segments", "num_tiles", "num_keys", "batch"])
def _v4_tables_kernel(
    lengths_ptr,
    seg_offsets_ptr,
    key_tile_first_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    num_segments,
    num_tiles,
    num_keys,
    batch,
    TILE: tl.constexpr,
    KEY_ROUNDS: tl.constexpr,
    SEG_ROUNDS: tl.constexpr,
    FAN: tl.constexpr,
    SEG_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program, one launch instead of two for a small call (one rank's batch): the
    segment and key-tile offsets (`_segment_offsets`), then the tile table of every tile,
    BLOCK tiles at a time (`_tile_table_block`), from the offsets just written."""
    _segment_offsets(lengths_ptr, seg_offsets_ptr, key_tile_first_ptr, num_segments, num_keys,
                     batch, TILE, SEG_BLOCK)  # fmt: skip
    tl.debug_barrier()  # the offsets written above are read by every thread below
    first = 0
    while first < num_tiles:
        t = (first + tl.arange(0, BLOCK)).to(tl.int64)
        _tile_table_block(
            t, seg_offsets_ptr, key_tile_first_ptr, tile_key_ptr, tile_start_ptr, tile_end_ptr,
            tile_seg_lo_ptr, tile_seg_hi_ptr, num_tiles, num_keys, batch, TILE, KEY_ROUNDS,
            SEG_ROUNDS, FAN, BLOCK,
        )  # fmt: skip
        first += BLOCK


@triton.jit(do_not_specialize=["num_tiles", "num_segments"])
def _v4_rank_kernel(
    values_ptr,
    block_sizes_ptr,
    seg_offsets_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    rows_ptr,
    ranks_ptr,
    counts_ptr,
    head_ptr,
    tail_ptr,
    lengths_ptr,
    num_tiles,
    num_segments,
    WORLD: tl.constexpr,
    MODULO: tl.constexpr,
    CHUNK: tl.constexpr,
    WB: tl.constexpr,
    MATCH: tl.constexpr,
):
    """Tile t (one warp), piece by piece (a piece = the tile's ids of one segment):
    ranks of its ids (`_rank_piece`, counters in rows[t]); counts[d * T + t] = ids of
    dest d in the tile; head[t, d] = the first piece's counts when it continues a segment
    owned by an earlier tile; lengths[d * S + s] for each owned segment s that ends in the
    tile; tail[t, d] = the last owned segment's counts when it runs past the tile. Until
    then tail[t] holds the counters at the current piece's start (a snapshot in memory,
    not registers: a [W] vector would cost W / 32 registers per lane). W-wide work runs
    in blocks of WB."""
    t = tl.program_id(0)
    key = tl.load(tile_key_ptr + t)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    seg_lo = tl.load(tile_seg_lo_ptr + t)
    seg_hi = tl.load(tile_seg_hi_ptr + t)
    blk = tl.load(block_sizes_ptr + key).to(tl.int64)
    row = t.to(tl.int64) * WORLD
    counters = rows_ptr + row
    snap = tail_ptr + row
    wl = tl.arange(0, WB)
    for b in tl.range(0, WORLD, WB):
        tl.store(counters + b + wl, tl.zeros([WB], dtype=tl.int32), mask=b + wl < WORLD)
    tl.debug_barrier()

    head_end = tl.where(seg_lo < seg_hi, tl.load(seg_offsets_ptr + seg_lo), end)
    _rank_piece(values_ptr, ranks_ptr, counters, start, head_end, blk, WORLD, MODULO, CHUNK, MATCH)
    for b in tl.range(0, WORLD, WB):
        m = b + wl < WORLD
        seen = tl.load(counters + b + wl, mask=m, other=0)
        tl.store(head_ptr + row + b + wl, seen, mask=m & (head_end > start))
        tl.store(snap + b + wl, seen, mask=m)
    tl.debug_barrier()  # snapshot rows are re-read below (an empty piece runs no chunk)
    s = seg_lo
    seg_start = head_end
    while s < seg_hi:
        seg_end = tl.load(seg_offsets_ptr + s + 1)
        _rank_piece(values_ptr, ranks_ptr, counters, seg_start, tl.minimum(seg_end, end), blk,
                    WORLD, MODULO, CHUNK, MATCH)  # fmt: skip
        crossing = seg_end > end  # only the last owned segment can run past the tile
        for b in tl.range(0, WORLD, WB):
            m = b + wl < WORLD
            now = tl.load(counters + b + wl, mask=m, other=0)
            piece = now - tl.load(snap + b + wl, mask=m, other=0)
            tl.store(lengths_ptr + (b + wl).to(tl.int64) * num_segments + s,
                     piece.to(lengths_ptr.dtype.element_ty), mask=m & ~crossing)  # fmt: skip
            tl.store(snap + b + wl, tl.where(crossing, piece, now), mask=m)
        tl.debug_barrier()
        seg_start = seg_end
        s += 1
    for b in tl.range(0, WORLD, WB):
        m = b + wl < WORLD
        total = tl.load(counters + b + wl, mask=m, other=0)
        tl.store(counts_ptr + (b + wl).to(tl.int64) * num_tiles + t, total, mask=m)


@triton.jit(do_not_specialize=["num_tiles"])
def _v4_rank_rows_kernel(
    values_ptr,
    block_sizes_ptr,
    seg_offsets_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    rows_ptr,
    ranks_ptr,
    counts_ptr,
    snaps_ptr,
    seg_tile_ptr,
    num_tiles,
    WORLD: tl.constexpr,
    MODULO: tl.constexpr,
    CHUNK: tl.constexpr,
    WB: tl.constexpr,
    MATCH: tl.constexpr,
):
    """lengths="rows": tile t (one warp) ranks its ids piece by piece like
    `_v4_rank_kernel` (counters in rows[t], counts[d * T + t] at the end), and before the
    piece of each segment s it owns stores the counters as one contiguous row,
    snaps[s, :] (ids of each dest in the tile before the segment's first id), and
    seg_tile[s] = t. No differences, head/tail rows or [dest][segment] stores here:
    `_v4_finish_rows_kernel` turns the rows into lengths."""
    t = tl.program_id(0)
    key = tl.load(tile_key_ptr + t)
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    seg_lo = tl.load(tile_seg_lo_ptr + t)
    seg_hi = tl.load(tile_seg_hi_ptr + t)
    blk = tl.load(block_sizes_ptr + key).to(tl.int64)
    counters = rows_ptr + t.to(tl.int64) * WORLD
    wl = tl.arange(0, WB)
    for b in tl.range(0, WORLD, WB):
        tl.store(counters + b + wl, tl.zeros([WB], dtype=tl.int32), mask=b + wl < WORLD)
    tl.debug_barrier()

    head_end = tl.where(seg_lo < seg_hi, tl.load(seg_offsets_ptr + seg_lo), end)
    _rank_piece(values_ptr, ranks_ptr, counters, start, head_end, blk, WORLD, MODULO, CHUNK, MATCH)
    s = seg_lo
    seg_start = head_end
    while s < seg_hi:
        # the snapshot reads precede the next piece's write-backs: a chunk writes its
        # counters only after a barrier that every lane reaches after these loads
        for b in tl.range(0, WORLD, WB):
            m = b + wl < WORLD
            seen = tl.load(counters + b + wl, mask=m, other=0)
            tl.store(snaps_ptr + s * WORLD + b + wl, seen, mask=m)
        tl.store(seg_tile_ptr + s, t)
        seg_end = tl.load(seg_offsets_ptr + s + 1)
        _rank_piece(values_ptr, ranks_ptr, counters, seg_start, tl.minimum(seg_end, end), blk,
                    WORLD, MODULO, CHUNK, MATCH)  # fmt: skip
        seg_start = seg_end
        s += 1
    for b in tl.range(0, WORLD, WB):
        m = b + wl < WORLD
        total = tl.load(counters + b + wl, mask=m, other=0)
        tl.store(counts_ptr + (b + wl).to(tl.int64) * num_tiles + t, total, mask=m)


@triton.jit(do_not_specialize=["num_tiles", "num_segments", "num_keys", "batch"])
def _v4_finish_kernel(
    scan_ptr,
    seg_offsets_ptr,
    key_tile_first_ptr,
    tile_key_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    head_ptr,
    tail_ptr,
    et_ptr,
    lengths_ptr,
    splits_ptr,
    key_counts_ptr,
    num_tiles,
    num_segments,
    num_keys,
    batch,
    WORLD: tl.constexpr,
    TILE: tl.constexpr,
    WB: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Programs [0, T): et[t, d] = exclusive scan at (d, t) (a contiguous row per tile for
    the scatter); if tile t1's last owned segment s runs past it (to tile t2),
    lengths[:, s] = tail[t1] + (ids in the full tiles t1+1..t2-1: a scan difference) +
    head[t2]. Programs [T, T + W / BLOCK_D): splits and key_counts of BLOCK_D dests,
    differences of the [dest][tile] scan at key-tile boundaries (tiles follow keys)."""
    pid = tl.program_id(0)
    if pid < num_tiles:
        t1 = pid.to(tl.int64)
        row = t1 * WORLD
        wl = tl.arange(0, WB)
        for b in tl.range(0, WORLD, WB):
            m = b + wl < WORLD
            e = _exclusive_at(scan_ptr, (b + wl).to(tl.int64) * num_tiles + t1, m)
            tl.store(et_ptr + row + b + wl, e, mask=m)
        seg_lo = tl.load(tile_seg_lo_ptr + t1)
        seg_hi = tl.load(tile_seg_hi_ptr + t1)
        s = tl.maximum(seg_hi - 1, 0)
        seg_end = tl.load(seg_offsets_ptr + s + 1)
        if (seg_lo < seg_hi) & (seg_end > tl.load(tile_end_ptr + t1)):
            key = tl.load(tile_key_ptr + t1)
            key_start = tl.load(seg_offsets_ptr + key.to(tl.int64) * batch)
            t2 = tl.load(key_tile_first_ptr + key) + (seg_end - 1 - key_start) // TILE
            for b in tl.range(0, WORLD, WB):
                m = b + wl < WORLD
                col = (b + wl).to(tl.int64) * num_tiles
                between = _exclusive_at(scan_ptr, col + t2, m) - _exclusive_at(
                    scan_ptr, col + t1 + 1, m
                )
                tail = tl.load(tail_ptr + row + b + wl, mask=m, other=0)
                head = tl.load(head_ptr + t2 * WORLD + b + wl, mask=m, other=0)
                total = tail + head + between
                tl.store(lengths_ptr + (b + wl).to(tl.int64) * num_segments + s,
                         total.to(lengths_ptr.dtype.element_ty), mask=m)  # fmt: skip
    else:
        _splits_block(scan_ptr, key_tile_first_ptr, splits_ptr, key_counts_ptr,
                      pid - num_tiles, num_tiles, num_keys, WORLD, BLOCK_D)  # fmt: skip


@triton.jit
def _splits_block(
    scan_ptr,
    key_tile_first_ptr,
    splits_ptr,
    key_counts_ptr,
    block_id,
    num_tiles,
    num_keys,
    WORLD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """splits and key_counts of dests [block_id * BLOCK_D, +BLOCK_D): differences of the
    [dest][tile] scan at key-tile boundaries (tiles follow keys)."""
    dest = block_id * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = dest < WORLD
    dcol = dest.to(tl.int64) * num_tiles
    first = _exclusive_at(scan_ptr, dcol, dmask)  # key_tile_first[0] == 0
    prev = first
    k = 0
    while k < num_keys:
        cur = _exclusive_at(scan_ptr, dcol + tl.load(key_tile_first_ptr + k + 1), dmask)
        tl.store(key_counts_ptr + dest.to(tl.int64) * num_keys + k,
                 (cur - prev).to(tl.int64), mask=dmask)  # fmt: skip
        prev = cur
        k += 1
    tl.store(splits_ptr + dest, (prev - first).to(tl.int64), mask=dmask)


@triton.jit
def _boundary_positions(scan_ptr, snaps_ptr, seg_tile_ptr, s, d, num_tiles, num_segments,
                        WORLD: tl.constexpr):  # fmt: skip
    """[BD, BS] int64: P(d, s) = ids before segment s's first id that go to a dest < d or
    to d (the output position of (d, s)'s first id) = exclusive scan at (d, tile owning
    s) + snaps[s, d]. s == S is the end (the virtual tile T, no snapshot); s > S and
    d >= W are padding."""
    seg_in = s < num_segments
    tile = tl.load(seg_tile_ptr + s, mask=seg_in, other=num_tiles).to(tl.int64)
    m = (d[:, None] < WORLD) & (s <= num_segments)[None, :]
    excl = _exclusive_at(scan_ptr, d[:, None].to(tl.int64) * num_tiles + tile[None, :], m)
    snap = tl.load(snaps_ptr + s[None, :].to(tl.int64) * WORLD + d[:, None],
                   mask=m & seg_in[None, :], other=0)  # fmt: skip
    return excl.to(tl.int64) + snap


@triton.jit
def _et_block(scan_ptr, et_ptr, block_id, num_tiles, WORLD: tl.constexpr, BT: tl.constexpr,
              BD: tl.constexpr):  # fmt: skip
    """et[t, d] = exclusive scan at (d, t) for BD dests x BT tiles: read along tiles,
    written along dests (a blocked transpose; dest blocks vary fastest)."""
    d_blocks = (WORLD + BD - 1) // BD
    t = (block_id // d_blocks) * BT + tl.arange(0, BT)
    d = (block_id % d_blocks) * BD + tl.arange(0, BD)
    m = (d[:, None] < WORLD) & (t[None, :] < num_tiles)
    e = _exclusive_at(scan_ptr, d[:, None].to(tl.int64) * num_tiles + t[None, :], m)
    tl.store(et_ptr + t[None, :].to(tl.int64) * WORLD + d[:, None], e, mask=m)


@triton.jit
def _lengths_block(scan_ptr, snaps_ptr, seg_tile_ptr, lengths_ptr, block_id, num_tiles,
                   num_segments, seg_blocks, WORLD: tl.constexpr, BS: tl.constexpr,
                   BD: tl.constexpr):  # fmt: skip
    """lengths[d, s] = P(d, s + 1) - P(d, s) for BD dests x BS segments: snapshot rows
    read along dests, lengths written along segments (segment blocks vary fastest)."""
    s = (block_id % seg_blocks) * BS + tl.arange(0, BS)
    d = (block_id // seg_blocks) * BD + tl.arange(0, BD)
    lo = _boundary_positions(scan_ptr, snaps_ptr, seg_tile_ptr, s, d, num_tiles,
                             num_segments, WORLD)  # fmt: skip
    hi = _boundary_positions(scan_ptr, snaps_ptr, seg_tile_ptr, s + 1, d, num_tiles,
                             num_segments, WORLD)  # fmt: skip
    m = (d[:, None] < WORLD) & (s[None, :] < num_segments)
    tl.store(lengths_ptr + d[:, None].to(tl.int64) * num_segments + s[None, :],
             (hi - lo).to(lengths_ptr.dtype.element_ty), mask=m)  # fmt: skip


@triton.jit(do_not_specialize=["num_tiles", "num_segments", "num_keys", "et_blocks",
                               "len_blocks", "seg_blocks"])  # fmt: skip
def _v4_finish_rows_kernel(
    scan_ptr,
    snaps_ptr,
    seg_tile_ptr,
    key_tile_first_ptr,
    et_ptr,
    lengths_ptr,
    splits_ptr,
    key_counts_ptr,
    num_tiles,
    num_segments,
    num_keys,
    et_blocks,
    len_blocks,
    seg_blocks,
    WORLD: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
    BD: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """lengths="rows", three program ranges, every one a [dest] x [tile or segment] block
    whose reads and writes both run along a contiguous axis:

    * [0, et_blocks): et[t, d] = exclusive scan at (d, t) for BD dests x BT tiles (read
      along tiles, written along dests);
    * then len_blocks: lengths[d, s] = P(d, s + 1) - P(d, s) (`_boundary_positions`)
      for BD dests x BS segments (snapshot rows read along dests, lengths written along
      segments); a segment spanning tiles needs no special case (the scan counts the
      tiles in between);
    * then W / BLOCK_D programs: splits and key_counts (`_splits_block`)."""
    pid = tl.program_id(0)
    if pid < et_blocks:
        _et_block(scan_ptr, et_ptr, pid, num_tiles, WORLD, BT, BD)
    else:
        if pid < et_blocks + len_blocks:
            _lengths_block(scan_ptr, snaps_ptr, seg_tile_ptr, lengths_ptr, pid - et_blocks,
                           num_tiles, num_segments, seg_blocks, WORLD, BS, BD)  # fmt: skip
        else:
            d_block = pid - et_blocks - len_blocks
            _splits_block(scan_ptr, key_tile_first_ptr, splits_ptr, key_counts_ptr, d_block,
                          num_tiles, num_keys, WORLD, BLOCK_D)  # fmt: skip


@triton.jit
def _v4_scatter_kernel(
    values_ptr,
    weights_ptr,
    block_sizes_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    ranks_ptr,
    et_ptr,
    out_values_ptr,
    out_weights_ptr,
    perm_ptr,
    WORLD: tl.constexpr,
    MODULO: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCKS_PER_TILE: tl.constexpr,
    TILE_MAJOR: tl.constexpr,
    ET_ROW: tl.constexpr,
):
    """Block b of tile t: position = et[t, dest] + rank in tile; local row. TILE_MAJOR:
    program p is block p % BLOCKS_PER_TILE of tile p // BLOCKS_PER_TILE, so a tile's
    blocks run together and fill its short per-dest runs while their sectors sit in L2;
    otherwise (the first v4) p is tile p % T, block p // T: every block of a wave writes
    ~1 id per dest run and the run's sectors are completed a whole grid pass later.
    ET_ROW (a power of two >= W, or 0): load the tile's et row once, coalesced, and pick
    each id's entry with `tl.gather` (through shared memory) instead of one global load
    per id (a gather touching up to 32 sectors per warp at large W)."""
    pid = tl.program_id(0)
    if TILE_MAJOR:
        t = (pid // BLOCKS_PER_TILE).to(tl.int64)
        b = pid % BLOCKS_PER_TILE
    else:
        num_tiles = tl.num_programs(0) // BLOCKS_PER_TILE
        t = (pid % num_tiles).to(tl.int64)
        b = pid // num_tiles
    start = tl.load(tile_start_ptr + t)
    end = tl.load(tile_end_ptr + t)
    offs = start + b * BLOCK + tl.arange(0, BLOCK)
    mask = offs < end
    blk = tl.load(block_sizes_ptr + tl.load(tile_key_ptr + t)).to(tl.int64)
    ids = tl.load(values_ptr + offs, mask=mask, other=0).to(tl.int64)
    packed = tl.load(ranks_ptr + offs, mask=mask, other=0)
    dest = packed >> 16
    if ET_ROW > 0:
        cols = tl.arange(0, ET_ROW)
        row = tl.load(et_ptr + t * WORLD + cols, mask=cols < WORLD, other=0)
        base = tl.gather(row, tl.where(mask, dest, 0), 0)
    else:
        base = tl.load(et_ptr + t * WORLD + dest, mask=mask, other=0)
    pos = base.to(tl.int64) + (packed & 0xFFFF)
    if MODULO:
        local = udiv(ids, WORLD)
    else:
        local = tl.where(ids < blk * WORLD, ids - dest.to(tl.int64) * blk, udiv(ids, WORLD))
    tl.store(out_values_ptr + pos, local.to(out_values_ptr.dtype.element_ty), mask=mask)
    tl.store(perm_ptr + offs, pos, mask=mask)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + offs, mask=mask)
        tl.store(out_weights_ptr + pos, w, mask=mask)


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class V4Config:
    """Tuning knobs of `ranged_dispatch_v4` (every choice gives the same bits).

    tile: ids per rank program (power of two, 16..65536); the count matrix, its scan and
        the per-tile rows have W * (N / tile + K) entries; a program walks its tile alone.
    chunk: ids ranked together (16 or 32): a lane each of the rank program's one warp.
    scatter_block: ids per scatter program (power of two >= 16).
    scatter_warps: warps per scatter program.
    scatter_order: "tile" (default): a tile's scatter blocks are adjacent in launch order;
        "block" (the first v4): the grid walks every tile's first block, then every
        tile's second, ... (see `_v4_scatter_kernel`).
    peers: how a chunk's lanes find same-dest lanes: "match" (PTX ``match.any.sync`` +
        ``popc``; CUDA and chunk 32 only), "compare" ([chunk, chunk] equalities; what the
        interpreter runs), "auto" (default): "match" where it can run.
    et_gather: how a scatter program finds each id's tile offset: "row" (the tile's
        W-row loaded once and indexed with `tl.gather`; W <= ET_ROW_MAX_WORLD; the default
        up to ET_ROW_DEFAULT_MAX_WORLD) or "global" (one load of et[t, dest] per id).
    lengths_mode: how the per-(dest, segment) lengths are made. "rows" (default): the rank
        program stores a contiguous [W] counter snapshot per segment it owns and a blocked
        pass writes lengths[d, s] = P(d, s + 1) - P(d, s) row by row. "columns" (the first
        v4): the rank program writes each segment's W counts straight into the [W][S]
        output (W stores S * 8 bytes apart per segment) and the finish kernel fixes up
        segments that cross tiles. See "Cost that grows with W" in the module docstring.
    finish_block: "rows" only: dests x (tiles or segments) per block of the finish pass
        (power of two, 16..256; 32: a [32, 32] block of int64 positions, twice, is ~8
        values per thread of 4 warps each).
    """

    tile: int
    chunk: int = 32
    scatter_block: int = 1024
    scatter_warps: int = 4
    lengths_mode: str = "rows"
    finish_block: int = 32
    scatter_order: str = "tile"
    peers: str = "auto"
    et_gather: str = "global"


def default_config_v4(world_size: int, device: torch.device, n: int) -> V4Config:
    """Defaults before any GPU measurement (`benchmarks/kernels.py` sweeps the tile).

    A rank program is one warp walking its tile serially, so the grid wants several
    thousand tiles at 2^26 ids (8K-id tiles: 8K programs, a 32 MB count matrix at W=1024)
    and ~1K at one rank's ~1M ids (1K-id tiles). On CPU (interpreter) everything is tiny
    so that tests cover many tiles and chunks.

    Scatter (one H200, 2^26 ids, device time, `dispatch_profile_etrow2_c3aedfe.json`):
    the tile's offset row through `tl.gather` (et_gather="row") took 0.87-0.94x the
    per-id loads at W = 8, 32, 128 and 1024, 1.02x at 256 and 512; with 2048-id, 8-warp
    scatter programs it took 0.91-0.94x at W = 128-512 (8K-id tiles). Both are the
    defaults where they won: "row" up to ET_ROW_DEFAULT_MAX_WORLD (the measured range;
    the knob allows up to ET_ROW_MAX_WORLD), 2048-id programs only where a tile holds
    them. The interpreter follows the same et_gather rule.
    """
    tile = 1 << max(10, min(13, (max(n, 1) // 8192).bit_length() - 1))
    if device.type == "cpu":
        tile = 64
    return _default_config(world_size, device.type, tile)


@functools.lru_cache(maxsize=4096)
def _default_config(world_size: int, device_type: str, tile: int) -> V4Config:
    """`default_config_v4` for a tile (n matters only through it); cached: made once per
    world size and tile, not per call."""
    et_gather = "row" if world_size <= ET_ROW_DEFAULT_MAX_WORLD else "global"
    if device_type == "cpu":
        return V4Config(tile=64, chunk=16, scatter_block=32, finish_block=16, et_gather=et_gather)
    block = 2048 if 128 <= world_size <= 512 and tile >= 2048 else 1024
    return V4Config(
        tile=tile,
        et_gather=et_gather,
        scatter_block=block,
        scatter_warps=default_scatter_warps(block),
    )


def default_scatter_warps(scatter_block: int) -> int:
    """Warps of a scatter program of this many ids when not given: 8 from 2048 ids (the
    measured wide programs), else 4."""
    return 8 if scatter_block >= 2048 else 4


def _check(cfg: V4Config, world_size: int) -> None:
    for name, x, hi in (
        ("tile", cfg.tile, MAX_TILE),
        ("chunk", cfg.chunk, 32),
        ("scatter_block", cfg.scatter_block, 1 << 16),
        ("finish_block", cfg.finish_block, 256),
    ):
        if x & (x - 1) or not 16 <= x <= hi:
            raise ValueError(f"{name} must be a power of two in [16, {hi}], got {x}")
    if world_size > MAX_WORLD:
        raise ValueError(f"ranged_dispatch_v4 supports world_size <= {MAX_WORLD}")
    for name, value, allowed in (
        ("lengths_mode", cfg.lengths_mode, LENGTHS_MODES),
        ("scatter_order", cfg.scatter_order, SCATTER_ORDERS),
        ("peers", cfg.peers, PEERS),
        ("et_gather", cfg.et_gather, ET_GATHERS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if cfg.et_gather == "row" and world_size > ET_ROW_MAX_WORLD:
        raise ValueError(f"et_gather='row' supports world_size <= {ET_ROW_MAX_WORLD}")


def _carve(dtype: torch.dtype, device: torch.device, *sizes: int) -> list[torch.Tensor]:
    """Views of one new allocation, at least ``sizes`` elements each, every view starting
    on a 512-byte boundary as a separate allocation from PyTorch's caching allocator
    would (16-byte alignment, what Triton specializes on, left v4 ~3% slower at 2^26
    ids: rows then straddle 128-byte lines): scratch buffers in one allocator call
    instead of one each."""
    per = _CARVE_ALIGN // dtype.itemsize
    padded = [-(-size // per) * per for size in sizes]
    return list(torch.empty(sum(padded), dtype=dtype, device=device).split_with_sizes(padded))


def _use_match(cfg: V4Config, device: torch.device) -> bool:
    """Whether the rank kernel finds same-dest lanes with ``match.any`` (`V4Config.peers`):
    compiled for an NVIDIA GPU (not ROCm, not Triton's interpreter, which runs no inline
    assembly, also on CUDA tensors) with 32-id chunks."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    nvidia = device.type == "cuda" and torch.version.hip is None
    runnable = nvidia and not interpreted and cfg.chunk == 32
    if cfg.peers == "match" and not runnable:
        raise ValueError(
            "peers='match' needs a compiled kernel on an NVIDIA GPU and chunk 32 (device "
            f"{device}, chunk {cfg.chunk}, TRITON_INTERPRET={'1' if interpreted else '0'})"
        )
    return runnable and cfg.peers != "compare"


def launch_tables(
    lengths: torch.Tensor,
    seg_offsets: torch.Tensor,
    key_tile_first: torch.Tensor,
    table: tuple,
    num_keys: int,
    batch: int,
    num_tiles: int,
    tile: int,
) -> None:
    """Steps 1-2 (also v5's): segment offsets and the first tile of every key, then the
    tile table ``(tile_key, tile_start, tile_end, tile_seg_lo, tile_seg_hi)`` by k-ary
    searches (`_first_at_least`). Up to `FUSED_TABLES_MAX_TILES` tiles: one
    single-program launch. Beyond: the offsets by one program up to `SEG_SCAN_BLOCK`
    segments, else by `SEG_SCAN_BLOCK`-segment programs (block sums, scan, key tiles:
    three launches; four past `SEG_SUMS_MAX_BLOCKS` blocks), then the table on many
    programs."""
    nseg = num_keys * batch
    block = min(SEG_BLOCK_MAX, max(128, next_power_of_2(max(nseg, num_keys))))
    seg_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    seg_rounds = search_rounds(batch, SEARCH_FAN)
    key_rounds = search_rounds(num_keys + 1, SEARCH_FAN)
    if num_tiles <= FUSED_TABLES_MAX_TILES:
        _v4_tables_kernel[(1,)](
            lengths, seg_offsets, key_tile_first, *table, nseg, num_tiles, num_keys, batch,
            TILE=tile, KEY_ROUNDS=key_rounds, SEG_ROUNDS=seg_rounds, FAN=SEARCH_FAN,
            SEG_BLOCK=block, BLOCK=FUSED_TABLE_BLOCK,
            num_warps=max(seg_warps, FUSED_TABLE_WARPS),
        )  # fmt: skip
        return
    if nseg <= SEG_SCAN_BLOCK:
        _v4_segment_kernel[(1,)](
            lengths, seg_offsets, key_tile_first, nseg, num_keys, batch, TILE=tile,
            BLOCK=block, num_warps=seg_warps,
        )  # fmt: skip
    else:
        sb = SEG_SCAN_BLOCK
        nb = cdiv(nseg, sb)
        block_sums = torch.empty(nb, dtype=torch.int64, device=lengths.device)
        warps = 8 if sb >= 2048 else 4
        _v4_seg_sums_kernel[(nb,)](lengths, block_sums, nseg, BLOCK=sb, num_warps=warps)
        prefixed = nb > SEG_SUMS_MAX_BLOCKS
        if prefixed:
            _v4_sums_scan_kernel[(1,)](block_sums, nb, BLOCK=SEG_SUMS_SCAN_BLOCK, num_warps=8)
        _v4_seg_scan_kernel[(nb,)](
            lengths, block_sums, seg_offsets, nseg, BLOCK=sb, SUMS_BLOCK=SEG_SUMS_BLOCK,
            PREFIXED=prefixed, num_warps=warps,
        )  # fmt: skip
        kb = min(SEG_BLOCK_MAX, max(128, next_power_of_2(num_keys)))
        _v4_key_tiles_kernel[(1,)](
            seg_offsets, key_tile_first, num_keys, batch, TILE=tile, BLOCK=kb, num_warps=4
        )  # fmt: skip
    _v4_tile_table_kernel[(cdiv(num_tiles, TABLE_BLOCK),)](
        seg_offsets, key_tile_first, *table, num_tiles, num_keys, batch, TILE=tile,
        KEY_ROUNDS=key_rounds, SEG_ROUNDS=seg_rounds, FAN=SEARCH_FAN, BLOCK=TABLE_BLOCK,
        num_warps=4,
    )  # fmt: skip


def launch_finish_rows(
    scan: torch.Tensor,
    snaps: torch.Tensor,
    seg_tile: torch.Tensor,
    key_tile_first: torch.Tensor,
    et: torch.Tensor,
    new_lengths: torch.Tensor,
    splits: torch.Tensor,
    key_counts: torch.Tensor,
    num_tiles: int,
    nseg: int,
    num_keys: int,
    world_size: int,
    finish_block: int,
) -> None:
    """Step 5 of the "rows" lengths mode (also v5's): `_v4_finish_rows_kernel` over its
    three program ranges (et rows, lengths, splits and key counts)."""
    block_d = 256
    fb = finish_block
    bd = min(max(2, next_power_of_2(world_size)), fb)
    d_blocks = cdiv(world_size, bd)
    et_blocks = cdiv(num_tiles, fb) * d_blocks
    seg_blocks = cdiv(nseg, fb)
    len_blocks = seg_blocks * d_blocks
    grid = (et_blocks + len_blocks + cdiv(world_size, block_d),)
    _v4_finish_rows_kernel[grid](
        scan, snaps, seg_tile, key_tile_first, et, new_lengths, splits, key_counts,
        num_tiles, nseg, num_keys, et_blocks, len_blocks, seg_blocks, WORLD=world_size,
        BT=fb, BS=fb, BD=bd, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip


def ranged_dispatch_v4(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
    tile: Optional[int] = None,
    chunk: Optional[int] = None,
    scatter_block: Optional[int] = None,
    scatter_warps: Optional[int] = None,
    lengths_mode: Optional[str] = None,
    finish_block: Optional[int] = None,
    scatter_order: Optional[str] = None,
    peers: Optional[str] = None,
    et_gather: Optional[str] = None,
) -> DispatchResult:
    """Triton `ranged_dispatch`, v4 (see the module docstring); same semantics and results
    as `reference.ranged_dispatch`. Keyword knobs override `default_config_v4`
    (``lengths_mode="columns"`` selects the first v4's lengths path, see `V4Config`)."""
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    if n == 0:
        return reference.ranged_dispatch(
            values, lengths, block_sizes, world_size, mode=mode, weights=weights
        )
    base = default_config_v4(world_size, dev, n)
    knobs = (tile, chunk, scatter_block, scatter_warps, lengths_mode, finish_block,
             scatter_order, peers, et_gather)  # fmt: skip
    cfg = (
        base
        if all(k is None for k in knobs)
        else V4Config(
            tile=tile or base.tile,
            chunk=chunk or base.chunk,
            scatter_block=scatter_block or base.scatter_block,
            # warps follow an explicitly given block size unless given too
            scatter_warps=scatter_warps
            or (default_scatter_warps(scatter_block) if scatter_block else base.scatter_warps),
            lengths_mode=lengths_mode or base.lengths_mode,
            finish_block=finish_block or base.finish_block,
            scatter_order=scatter_order or base.scatter_order,
            peers=peers or base.peers,
            et_gather=et_gather or base.et_gather,
        )
    )
    if cfg is base:
        if world_size > MAX_WORLD:  # the one check defaults can fail
            raise ValueError(f"ranged_dispatch_v4 supports world_size <= {MAX_WORLD}")
    else:
        _check(cfg, world_size)
    match = _use_match(cfg, dev)
    values, lengths = values.contiguous(), lengths.contiguous()
    block_sizes = block_sizes.contiguous()
    weights = None if weights is None else weights.contiguous()
    modulo = mode == "modulo"
    wp = max(2, next_power_of_2(world_size))

    # Scratch: one int64 and one int32 allocation carved into 512-byte aligned views (one
    # rank's batch is bound by the host's per-call work; an allocation costs 7-9 us of it
    # on the H200's host, benchmarks/results/dispatch_host.json). Key k has
    # max(1, ceil(n_k / tile)) <= n_k // tile + 1 tiles, so n // tile + K bounds the
    # tiles used without a sync; spare tiles stay empty.
    num_tiles = n // cfg.tile + num_keys
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    tw = num_tiles * world_size
    seg_offsets, key_tile_first, tile_start, tile_end, tile_seg_lo, tile_seg_hi = _carve(
        torch.int64, dev, nseg + 1, num_keys + 1, *(num_tiles,) * 4
    )
    rows_mode = cfg.lengths_mode == "rows"
    per_seg = (nseg * world_size, nseg) if rows_mode else (tw, tw)  # snaps, seg_tile | head, tail
    et_here = (tw,) if index_dtype == torch.int32 else ()
    tile_key, rows, ranks, counts, seg_a, seg_b, *et = _carve(
        torch.int32, dev, num_tiles, tw, n, tw, *per_seg, *et_here
    )
    counts = counts[:tw]  # scanned whole: no padding

    # 1-2. segment offsets and the first tile of every key (one program), then the tile
    # table (binary searches); one launch when one program covers every tile
    table = (tile_key, tile_start, tile_end, tile_seg_lo, tile_seg_hi)
    launch_tables(lengths, seg_offsets, key_tile_first, table, num_keys, batch, num_tiles, cfg.tile)
    tiles = (tile_key, tile_start, tile_end)

    # 3. ranks in tile, per-(dest, tile) counts in [dest][tile] order, and per segment
    # either a [W] counter snapshot row ("rows") or its lengths ("columns")
    new_lengths = torch.empty(world_size * nseg, dtype=lengths.dtype, device=dev)
    rank_common = (values, block_sizes, seg_offsets, *tiles, tile_seg_lo, tile_seg_hi, rows,
                   ranks, counts)  # fmt: skip
    rank_meta = {"WORLD": world_size, "MODULO": modulo, "CHUNK": cfg.chunk,
                 "WB": min(wp, 256), "MATCH": match, "num_warps": 1}  # fmt: skip
    if rows_mode:
        snaps, seg_tile = seg_a, seg_b
        _v4_rank_rows_kernel[(num_tiles,)](*rank_common, snaps, seg_tile, num_tiles,
                                           **rank_meta)  # fmt: skip
    else:
        head, tail = seg_a, seg_b
        _v4_rank_kernel[(num_tiles,)](*rank_common, head, tail, new_lengths, num_tiles, nseg,
                                      **rank_meta)  # fmt: skip

    # 4. inclusive scan in [dest][tile] order; the exclusive value at (d, t), the output
    # position of tile t's first id of dest d, sits one entry earlier
    scan = torch.cumsum(counts, 0, dtype=index_dtype)

    # 5. the scan as [tile][dest] rows, lengths ("rows") or segments crossing tiles
    # ("columns"), splits, key counts
    et = et[0] if et else torch.empty(tw, dtype=index_dtype, device=dev)
    splits = torch.empty(world_size, dtype=torch.int64, device=dev)
    key_counts = torch.empty((world_size, num_keys), dtype=torch.int64, device=dev)
    block_d = 256
    if rows_mode:
        launch_finish_rows(scan, snaps, seg_tile, key_tile_first, et, new_lengths, splits,
                           key_counts, num_tiles, nseg, num_keys, world_size,
                           cfg.finish_block)  # fmt: skip
    else:
        _v4_finish_kernel[(num_tiles + cdiv(world_size, block_d),)](
            scan, seg_offsets, key_tile_first, tile_key, tile_end, tile_seg_lo, tile_seg_hi,
            head, tail, et, new_lengths, splits, key_counts, num_tiles, nseg, num_keys, batch,
            WORLD=world_size, TILE=cfg.tile, WB=min(wp, 1024), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip

    # 6. scatter
    out_values = torch.empty_like(values)
    out_weights = None if weights is None else torch.empty_like(weights)
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    blocks_per_tile = cdiv(cfg.tile, cfg.scatter_block)
    _v4_scatter_kernel[(num_tiles * blocks_per_tile,)](
        values, values if weights is None else weights, block_sizes, *tiles, ranks, et,
        out_values, out_values if out_weights is None else out_weights, perm,
        WORLD=world_size, MODULO=modulo, HAS_WEIGHTS=weights is not None,
        BLOCK=cfg.scatter_block, BLOCKS_PER_TILE=blocks_per_tile,
        TILE_MAJOR=cfg.scatter_order == "tile", ET_ROW=wp if cfg.et_gather == "row" else 0,
        num_warps=cfg.scatter_warps,
    )  # fmt: skip
    return DispatchResult(
        values=out_values,
        lengths=new_lengths,
        splits=splits,
        key_counts=key_counts,
        unbucketize_permute=perm,
        weights=out_weights,
    )
