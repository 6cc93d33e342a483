"""Ranged dispatch "v5": v4's tables, scan and finish pass with
its rank and scatter kernels replaced by Gluon kernels that keep their per-tile state
in shared memory.

Owns: `ranged_dispatch_v5`, `V5Config`, `default_config_v5` (per W and card; `table_name`:
the ``FREESCALE_V5_TABLE`` override),
`device_name`, `check_config`,
`v5_supported`, `check_layout`, `compile_v5`, the Gluon kernels (one count, two
scatters) and a plain Triton transpose
(`transpose_2d`). Same semantics and bits as `reference.ranged_dispatch` for inputs
without weights and world sizes up to `V5_MAX_WORLD` (checked bitwise on an H200 by
`benchmarks/dispatch_v5.py`, which exits 1 on a mismatch). `kernels.ranged_dispatch`
runs it by default from `ops.V5_MIN_IDS` (2^25) ids per unweighted call on sm_90
(session 29: below, v4's lighter host work wins; `ops.py` has the crossover);
``FREESCALE_TRITON_DISPATCH=v5`` forces it where it can run (v4 otherwise). It answers a
question measured on one H200: how close to the HBM floor a dispatch gets when its
kernels may index shared memory (issue 3).
Measured (`benchmarks/results/dispatch_v5.json`, BENCHMARKS.md "kernels", session 27):
at 2^26 ids 0.272 of the floor at W = 1024 (v4 0.141) and 0.520 at W = 8 (v4 0.400);
on one rank's ~1M ids its host time per call is higher than v4's.

Why: v4 (`triton_dispatch_v4.py`) is bound at W = 1024 by two costs that belong in
shared memory (its module docstring and BENCHMARKS.md "kernels" have the counters):
per-tile counters written back to L2 after every 32 ids, and a scatter storing every
8-byte id to its own sector. Triton's language cannot index shared memory per lane.
Gluon (``triton.experimental.gluon``, shipped with Triton) can reserve a shared buffer;
the per-lane loads, stores and atomics on it are PTX through
``inline_asm_elementwise``, addressed from Triton's ``global_smem`` symbol: the
buffers form one range from offset 0, which `check_layout` verifies on each compiled
kernel (its shared size and the buffers' bases in the LLVM IR).

Kernels (one program = one v4 tile: <= `tile` ids of one key; `NW` warps):

* `_v5_count_kernel`: per-dest counters in shared memory, one ``atom.shared.add`` per
  id; before the piece of every segment the tile owns, the counters are copied to
  snaps[s, :] (v4's "rows" snapshot, so v4's finish pass makes lengths, et rows, splits
  and key counts unchanged); counts[t, :] as a row at the end (`transpose_2d` turns
  the rows into v4's [dest][tile] order for the scan). Reads each id once; writes
  no per-id state (v4's rank kernel writes a 4-byte rank per id and reads it back).
* `_v5_scatter_kernel`: warp w owns the w-th contiguous sub-range of the tile.
  (a) each warp counts its sub-range's dests into its own shared row (uint16) and keeps
  each id's dest (uint16); (b) per dest, the tile-local start (exclusive scan over dests) plus the
  counts of earlier warps; (c) each warp walks its sub-range in order, 32 ids at a
  time: ``match.any`` gives same-dest lanes, the stable slot is the warp's running
  count + earlier peers, the dest's last lane advances the count; the local row goes
  to a shared staging array at its slot and the output position to perm (input order,
  coalesced); (d) the staging array is written out in slot order, so consecutive lanes
  store consecutive addresses within each dest's run (tile / W ids long).
* `_v5_scatter_ranks_kernel` (``V5Config(scatter="ranks")``; the default from W = 32
  on an H200, at every W on an H100; on both from W = 512 with int32 staging and 8192- or
  16384-id tiles: `default_config_v5`):
  (r1) each warp walks its sub-range in order and only ranks: match.any, its running
  counter, a uint16 rank per id stored in input order; (b) as above; (r2) every id in
  any order, U per thread: dest again from the id, slot = the warp's start + rank,
  staging, slot dest, perm; (d) as above. No count pass before the ordered loop, and
  the ordered loop holds none of placement's random shared accesses. With
  ``V5Config(dests="stored")`` (opt-in, session 34) a pass (p0) over the tile in any
  order first stores each id's dest in shared memory; r1 then reads dests there instead
  of waiting on each id's global load (Nsight Compute, W = 1024 on an H100: 15% of the
  kernel's stall samples sat on that wait), and r2 reads the dest instead of mapping the
  id again. ``V5Config(staging="int32")`` (an H100's default from W = 512, session 35) stages
  values as int32 (a value that does not fit goes straight to its output position, its
  slot marked -1): 4 bytes of shared memory less per id, so that 8192-id tiles fit twice
  per SM at W = 1024 (half the per-tile work and tables per id: 0.402 of the floor on an
  H100 against 0.341 with 4096-id tiles, `kernels_h100_15a9a81.json`). Session 36 added
  ``V5Config(snaps="int16")`` (the count kernel's counter snapshots at half the bytes) and
  ``prefetch=True`` to the H100's table: 0.417 at W = 1024 (`kernels_h100_3d4b487.json`;
  0.418 at `7024f25`, `kernels_h100_7024f25.json`). Session 37 tried two opt-in options
  that did not move the W = 1024 default (`V5Config` has the numbers): ``narrow``
  (32-bit owner and row arithmetic, ~15-25% fewer instructions in the loops) and
  ``l2_prefetch`` (each warp's ids requested into L2 in one bulk prefetch). The kernel is
  bound neither by its instruction count nor by the latency of its id loads alone. The
  PTX accesses add their offsets to one ``global_smem`` base per kernel (`_sh_addr`;
  before, ptxas re-derived it from the CTA id in every loop iteration).
  The ranks kernel's body is `_ranks_tile`, called once per program with the tile's
  arithmetic path.

* `_v5_scatter_atomic_kernel` (``V5Config(scatter="atomic")``, session 49, opt-in):
  no ordered loop and one row of tile counters instead of one per warp. (a1) every id
  in any order takes an unordered rank among the tile's ids of its dest from a shared
  atomic; (b) the row becomes the dests' tile-local starts; (a2) every id in any order
  is staged at start + unordered rank with its input index; (a3) in slot order, each
  id's stable rank is the number of input indices below its own in its dest's run
  (`_run_rank`, a PTX loop over ~tile / W entries), its value goes to the output there;
  (a4) perm in input order. Same bits as the others (the rank within the run is the
  stable one whatever order the atomics took: `test_kernels_v5.py` checks the argument
  on CPU, the GPU tests the kernel's bits). A run's count costs its length per id, so a
  tile where one dest holds thousands of ids (W = 1, hot ids in one shard's rows) would
  cost ~tile^2 shared loads: such a LONG tile (a dest with more than
  ``V5Config.run_limit`` ids, seen in a1) ranks in input order instead (session 50,
  `_atomic_long_ranks`: up to ``scatter_warps`` warps with their own counter rows in
  the bytes a2 fills later, as the ranks scatter does), a branch uniform per tile.

Step (b) is `_slot_starts` in all three: 4 packed uint16 counters per u64 shared access.

The output is the stable sort by dest of each tile (v4's definition), so positions
equal v4's bit for bit. No atomics on global memory, one writer per output element.
CPU: the kernels need a GPU (Gluon has no interpreter); tests compile them for sm_90
(`compile_v5`) and check the shared-memory layout assumption, and the GPU check
compares the bits.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from freescale.kernels import reference
from freescale.kernels.common import DispatchResult, check_dispatch_inputs, next_power_of_2
from freescale.kernels.triton_dispatch_v4 import (  # plain Triton helpers Gluon calls
    _carve,
    _owner_inv,
    _popc,
    launch_finish_rows,
    launch_tables,
    narrow_ok,
    owner_local_narrow,
    udiv,
)

V5_MAX_WORLD = 4096  # per-warp counter rows: NW * W * 4 bytes of shared memory
SMEM_LIMIT = 227 * 1024  # bytes of shared memory one H100/H200 program may use


# ---------------------------------------------------------------------------------------
# shared memory through PTX (byte offsets relative to the reserved buffer)
# ---------------------------------------------------------------------------------------


@gluon.jit
def _sh_addr(off):
    """The shared-window address of byte offset `off` of the reserved buffer: the
    ``global_smem`` base by a pure asm whose only operand is a constant (off * 0), so that
    the compiler computes it once per kernel instead of in every access (ptxas derives it
    from the CTA id: an S2UR, ~6-9% of the W = 1024 scatter's stall samples on an H100
    when each access did it, `ncu_v5_sass_w1024_h100_7024f25.csv`), plus `off`."""
    base = gl.inline_asm_elementwise(
        "mov.u32 $0, global_smem;", "=r,r", [off * 0], dtype=gl.int32, is_pure=True, pack=1
    )
    return base + off


@gluon.jit
def _sh_ld32(off):
    """ld.shared.u32 at byte offset `off` (int32 tensor) of the reserved buffer."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, $1; ld.shared.u32 $0, [a]; }",
        "=r,r",
        [_sh_addr(off)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_ld64(off):
    """ld.shared.u64 at byte offset `off` (8-byte aligned)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, $1; ld.shared.u64 $0, [a]; }",
        "=l,r",
        [_sh_addr(off)],
        dtype=gl.int64,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_st32(off, value, pred):
    """st.shared.u32 where `pred` (int32 != 0); returns a dummy 0 (asm needs a result)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p; setp.ne.s32 p, $3, 0; "
        "mov.u32 a, $1; @p st.shared.u32 [a], $2; mov.u32 $0, 0; }",
        "=r,r,r,r",
        [_sh_addr(off), value, pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_st64(off, value, pred):
    """st.shared.u64 where `pred`; dummy result."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p; setp.ne.s32 p, $3, 0; "
        "mov.u32 a, $1; @p st.shared.u64 [a], $2; mov.u32 $0, 0; }",
        "=r,r,l,r",
        [_sh_addr(off), value, pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_ld16(off):
    """ld.shared.u16 at byte offset `off` (2-byte aligned), zero-extended to int32."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; mov.u32 a, $1; ld.shared.u16 $0, [a]; }",
        "=r,r",
        [_sh_addr(off)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_st16(off, value, pred):
    """st.shared.u16 of the low half of `value` where `pred`; dummy result."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a; .reg .pred p; setp.ne.s32 p, $3, 0; "
        "mov.u32 a, $1; @p st.shared.u16 [a], $2; mov.u32 $0, 0; }",
        "=r,r,r,r",
        [_sh_addr(off), value, pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_add16(off, pred):
    """+1 on the uint16 at byte offset `off` where `pred`: atom.shared.add.u32 of 1 or
    1 << 16 on the aligned word holding it (the halves never carry: counts <= 16384)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, v, o; .reg .pred p; setp.ne.s32 p, $2, 0; and.b32 v, $1, 2; "
        "shl.b32 v, v, 3; mov.u32 o, 1; shl.b32 v, o, v; mov.u32 a, $1; "
        "and.b32 a, a, -4; @p atom.shared.add.u32 o, [a], v; mov.u32 $0, 0; }",
        "=r,r,r",
        [_sh_addr(off), pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_add32(off, pred):
    """atom.shared.add.u32 of 1 where `pred`; dummy result."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, o; .reg .pred p; setp.ne.s32 p, $2, 0; "
        "mov.u32 a, $1; @p atom.shared.add.u32 o, [a], 1; mov.u32 $0, 0; }",
        "=r,r,r",
        [_sh_addr(off), pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _sh_fetch_add16(off, pred):
    """+1 on the uint16 at byte offset `off` where `pred`, as `_sh_add16` (an
    atom.shared.add.u32 of 1 or 1 << 16 on the aligned word holding it), returning the
    uint16's value before the add (0 where not `pred`): the atomic scatter's unordered
    rank of an id among the tile's ids of its dest."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, v, o, s; .reg .pred p; setp.ne.s32 p, $2, 0; and.b32 s, $1, 2; "
        "shl.b32 s, s, 3; mov.u32 v, 1; shl.b32 v, v, s; and.b32 a, $1, -4; mov.u32 o, 0; "
        "@p atom.shared.add.u32 o, [a], v; shr.u32 o, o, s; and.b32 $0, o, 65535; }",
        "=r,r,r",
        [_sh_addr(off), pred],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _run_rank(lo, hi, key):
    """Per lane, how many of the uint16 at byte offsets [lo, hi) of the reserved buffer
    are below `key` (a loop in PTX, as long as the lane's own range: lanes of one warp
    with shorter ranges wait for the longest). The atomic scatter's stable rank of an id
    within its dest's run of the tile: the run holds the input indices of the dest's ids
    in the order the atomics gave them."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 a, e, v, r; .reg .pred p, q; mov.u32 a, $1; mov.u32 e, $2; "
        "mov.u32 r, 0; setp.ge.u32 p, a, e; @p bra RUN_DONE; RUN_LOOP: "
        "ld.shared.u16 v, [a]; setp.lt.u32 q, v, $3; selp.u32 v, 1, 0, q; add.u32 r, r, v; "
        "add.u32 a, a, 2; setp.lt.u32 p, a, e; @p bra RUN_LOOP; RUN_DONE: mov.u32 $0, r; }",
        "=r,r,r,r",
        [_sh_addr(lo), _sh_addr(hi), key],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _warp_sync(x):
    """bar.warp.sync: orders the shared accesses of a warp's lanes (x: any int32 tensor
    of the layout; the dummy result keeps the asm in program order)."""
    return gl.inline_asm_elementwise(
        "bar.warp.sync -1; mov.u32 $0, 0;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _match_any(x):
    """match.any.sync: per lane, the lanes of its warp holding the same int32 (v4's
    `_match_any` is declared pure; here it stays in program order among the shared
    accesses of the ranking loop, as measured)."""
    return gl.inline_asm_elementwise(
        "match.any.sync.b32 $0, $1, -1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1
    )


@gluon.jit
def _warp_inclusive_scan(x):
    """Inclusive prefix sum of int32 x over the lanes of each warp (PTX shfl.sync.up;
    element i of a warp's 32 must live in lane i)."""
    return gl.inline_asm_elementwise(
        "{ .reg .u32 v, u; .reg .pred p; mov.u32 v, $1; "
        "shfl.sync.up.b32 u|p, v, 1, 0, -1; @p add.u32 v, v, u; "
        "shfl.sync.up.b32 u|p, v, 2, 0, -1; @p add.u32 v, v, u; "
        "shfl.sync.up.b32 u|p, v, 4, 0, -1; @p add.u32 v, v, u; "
        "shfl.sync.up.b32 u|p, v, 8, 0, -1; @p add.u32 v, v, u; "
        "shfl.sync.up.b32 u|p, v, 16, 0, -1; @p add.u32 v, v, u; mov.u32 $0, v; }",
        "=r,r",
        [x],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _l2_prefetch(lo_ptrs, hi_ptrs, pred):
    """``cp.async.bulk.prefetch.L2.global`` (sm_90) of the bytes from lo_ptrs to hi_ptrs
    (per lane, widened to 16-byte borders; nothing where `pred` is 0 or the range is
    empty): the memory system fetches a whole range into L2 at once, with no registers or
    shared memory waiting for it. Dummy result."""
    lo = lo_ptrs.to(gl.int64, bitcast=True) & -16
    hi = (hi_ptrs.to(gl.int64, bitcast=True) + 15) & -16
    on = (pred != 0) & (hi > lo)
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r",
        [lo, (hi - lo).to(gl.int32), on.to(gl.int32)],
        dtype=gl.int32,
        is_pure=False,
        pack=1,
    )


@gluon.jit
def _keep_live(buf, ptr, t, layout: gl.constexpr, CH: gl.constexpr):
    """A use of a reserved buffer at the kernel's end (a store that never runs: t >= 0),
    so that Triton's allocator keeps its bytes for the whole kernel and places no other
    scratch buffer over them while the PTX accesses use them."""
    keep = buf.slice(0, CH).load(layout)
    never = (gl.zeros([CH], gl.int32, layout) + t) < 0
    gl.store(ptr + gl.arange(0, CH, layout=layout), keep.to(ptr.dtype.element_ty), mask=never)


@gluon.jit
def _reserve(WORDS: gl.constexpr):
    """A shared buffer of WORDS int32 (a power of two: Gluon's shapes must be)."""
    return gl.allocate_shared_memory(gl.int32, [WORDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))


# ---------------------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------------------


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, rows, cols, BR: tl.constexpr, BC: tl.constexpr):
    """dst[c, r] = src[r, c] for a [rows, cols] matrix, one [BR, BC] block per program
    (plain Triton: reads along cols, writes along rows, the reorder in between through
    shared memory). Runs in the interpreter; `transpose_2d` is its reference."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    m = (r[:, None] < rows) & (c[None, :] < cols)
    x = tl.load(src_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=m, other=0)
    tl.store(dst_ptr + c[:, None].to(tl.int64) * rows + r[None, :], tl.trans(x), mask=tl.trans(m))


def transpose_2d(x: torch.Tensor, *, block: int = 64) -> torch.Tensor:
    """A contiguous transpose of a 2-D tensor with `_transpose_kernel` (the count rows of
    `_v5_count_kernel` to v4's [dest][tile] scan order; torch's copy of ``x.t()`` took
    0.116 ms for 4K x 1K int32 on an H200)."""
    rows, cols = x.shape
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    if x.numel():
        grid = (triton.cdiv(rows, block), triton.cdiv(cols, block))
        _transpose_kernel[grid](x.contiguous(), out, rows, cols, BR=block, BC=block, num_warps=4)
    return out


@gluon.jit
def _count_loop(values_ptr, lo, hi, blk, inv, e, WORLD: gl.constexpr,
                MODULO: gl.constexpr, CH: gl.constexpr, NARROW: gl.constexpr):  # fmt: skip
    # CH: the length of e (ids per iteration)
    """Shared counters[dest] += 1 for ids values[lo:hi] (order does not matter)."""
    p = lo
    while p < hi:
        offs = p + e
        m = offs < hi
        ids = gl.load(values_ptr + offs, mask=m, other=0).to(gl.int64)
        d = _dest_local(ids, blk, inv, WORLD, MODULO, NARROW)[0]
        _sh_add32(gl.where(m, d, 0) * 4, m.to(gl.int32))
        p += CH


@gluon.jit
def _count_piece(values_ptr, lo, hi, blk, inv, e, WORLD: gl.constexpr,
                 MODULO: gl.constexpr, CH: gl.constexpr, NARROW: gl.constexpr):  # fmt: skip
    """`_count_loop` over values[lo:hi]; NARROW (``V5Config(narrow=True)``, block mode):
    in 32-bit arithmetic where the key passes `narrow_ok` (one uniform branch per piece)."""
    if NARROW:
        if narrow_ok(blk, WORLD):
            _count_loop(values_ptr, lo, hi, blk, inv, e, WORLD, MODULO, CH, True)
        else:
            _count_loop(values_ptr, lo, hi, blk, inv, e, WORLD, MODULO, CH, False)
    else:
        _count_loop(values_ptr, lo, hi, blk, inv, e, WORLD, MODULO, CH, False)


@gluon.jit
def _local_of(ids, d, blk, WORLD: gl.constexpr, MODULO: gl.constexpr):
    """The local row of ids whose owner d is known (`reference.owner_and_local`)."""
    if MODULO:
        local = udiv(ids, WORLD)
    else:
        local = gl.where(ids < blk * WORLD, ids - d.to(gl.int64) * blk, udiv(ids, WORLD))
    return local


@gluon.jit
def _dest_local(ids, blk, inv, WORLD: gl.constexpr, MODULO: gl.constexpr,
                NARROW: gl.constexpr):  # fmt: skip
    """(dest int32, local row int64) of int64 ids >= 0: NARROW (block mode, `narrow_ok`
    checked by the caller) in 32-bit arithmetic (`owner_local_narrow`), else the 64-bit
    `_owner_inv` and `_local_of`. Callers that use only the dest leave the rest to dead
    code elimination."""
    if NARROW:
        d, local = owner_local_narrow(ids, blk, inv, WORLD)
    else:
        d = _owner_inv(ids, blk, inv, WORLD, MODULO)
        local = _local_of(ids, d, blk, WORLD, MODULO)
    return d, local


@gluon.jit
def _tile_header(tile_key_ptr, tile_start_ptr, tile_end_ptr, block_sizes_ptr,
                 REV: gl.constexpr):  # fmt: skip
    """Tile t of this program: (t as int64, its first id, its id count, its key's block
    size, 1 / block size as float32 for `_owner_inv`). t = the program id, or with REV
    (``V5Config(reverse=True)``) the grid's last tile first."""
    t = gl.program_id(0).to(gl.int64)
    if REV:
        t = gl.num_programs(0).to(gl.int64) - 1 - t
    key = gl.load(tile_key_ptr + t)
    start = gl.load(tile_start_ptr + t)
    end = gl.load(tile_end_ptr + t)
    blk = gl.load(block_sizes_ptr + key).to(gl.int64)
    return t, start, (end - start).to(gl.int32), blk, 1.0 / blk.to(gl.float32)


@gluon.jit
def _l2_prefetch_ahead(values_ptr, tile_start_ptr, tile_end_ptr, t2, TILE: gl.constexpr,
                       NW: gl.constexpr, layout: gl.constexpr):  # fmt: skip
    """Lane 0 of each of the NW warps asks for its sub-range (TILE // NW ids) of tile t2
    in L2 with one bulk prefetch, so that the program running t2 about a wave later
    finds its ids there (the last tile stands in for t2 past the grid). Moves no data
    into registers or shared memory; a hint only."""
    SUB: gl.constexpr = TILE // NW
    e = gl.arange(0, NW * 32, layout=layout)
    w = (e // 32).to(gl.int64)
    tq = gl.minimum(t2, gl.num_programs(0).to(gl.int64) - 1)
    s2 = gl.load(tile_start_ptr + tq).to(gl.int64)
    n2 = gl.load(tile_end_ptr + tq).to(gl.int64) - s2
    lo = values_ptr + s2 + gl.minimum(w * SUB, n2)
    hi = values_ptr + s2 + gl.minimum(w * SUB + SUB, n2)
    _l2_prefetch(lo, hi, (e % 32 == 0).to(gl.int32))


@gluon.jit
def _lane_masks(lane):
    """Per lane, the bits of the lanes before it and of the lanes after it."""
    one = gl.full(lane.shape, 1, gl.int32, lane.type.layout)
    below = (one << lane) - 1
    return below, ~(below | (one << lane))


@gluon.jit
def _warp_rank(d, m, w, below, above, WC: gl.constexpr, WROW: gl.constexpr):
    """One step of a warp's ordered loop over 32 ids (d: each lane's dest, -1 where not
    m): the lane's rank among the warp's ids of its dest so far (the warp's counter
    WC[w][d] plus its earlier same-dest lanes, by match.any), and the counter advanced by
    the dest's last lane. Returns (rank, sync): sync is a dummy 0 that, added to the next
    shared address, keeps the next access after the warp's counter update."""
    peers = _match_any(d)
    earlier = _popc(peers & below)
    last = (peers & above) == 0
    a = WC + (w * WROW + gl.where(m, d, 0)) * 2
    rank = _sh_ld16(a) + earlier
    sync = _warp_sync(rank)
    _sh_st16(a + sync, rank + 1, (m & last).to(gl.int32))
    sync = _warp_sync(rank)
    return rank, sync


@gluon.jit
def _zero_words(OFF: gl.constexpr, WORDS: gl.constexpr, e, CH: gl.constexpr):
    """Zero WORDS int32 of shared memory from byte offset OFF, then a barrier."""
    for b in range(0, WORDS, CH):
        _sh_st32(OFF + (b + e) * 4, e * 0, ((b + e) < WORDS).to(gl.int32))
    gl.thread_barrier()


@gluon.jit
def _write_staged(out_values_ptr, n_t, e2, VAL: gl.constexpr, DSLOT: gl.constexpr,
                  SHIFT: gl.constexpr, STEP: gl.constexpr, POS: gl.constexpr,
                  V32: gl.constexpr):  # fmt: skip
    """Step (d) of both scatters: the staged values in slot order, STEP (= len(e2))
    consecutive slots per pass, to out[SHIFT[dest of the slot] + slot] (DSLOT holds
    uint16 dests) or, with POS, to out[DSLOT[slot]] (int32 output positions: one
    sequential shared load per slot instead of a sequential and a random one). V32: the
    staged values are int32; -1 marks a slot whose value placement stored itself."""
    for j0 in range(0, n_t, STEP):
        j = j0 + e2
        m = j < n_t
        jc = gl.where(m, j, 0)
        if V32:
            v = _sh_ld32(VAL + jc * 4).to(gl.int64)
            m = m & (v != -1)
        else:
            v = _sh_ld64(VAL + jc * 8)
        if POS:
            at = _sh_ld32(DSLOT + jc * 4).to(gl.int64)
        else:
            d = _sh_ld16(DSLOT + jc * 2)
            at = _sh_ld64(SHIFT + d * 8) + jc.to(gl.int64)
        gl.store(out_values_ptr + at, v.to(out_values_ptr.dtype.element_ty), mask=m)


@gluon.jit
def _slot_starts(et_ptr, t, e, w, lane, WC: gl.constexpr, SHIFT: gl.constexpr,
                 WTOT: gl.constexpr, WORLD: gl.constexpr, WROW: gl.constexpr,
                 NW: gl.constexpr, CH: gl.constexpr, ET_EARLY: gl.constexpr,
                 ROWS: gl.constexpr, ROLLED: gl.constexpr):  # fmt: skip
    """Step (b) of the scatter kernels. In: WC[w][d] = warp w's count of dest d (uint16,
    ROWS rows of WROW >= WORLD entries, WROW a multiple of 4; ROWS = NW, or 1 for the
    atomic scatter's one row of tile counts). Out: WC[w][d] = the tile slot
    where row w's first id of dest d goes (the tile-local start of d, an exclusive scan
    over dests, plus the counts of warps before w), SHIFT[d] = et[t, d] minus that local
    start (int64). Each lane owns 4 consecutive dests and moves them as one u64 of 4
    packed uint16 (additions never carry between the fields: every start + count <=
    TILE <= 16384), a quarter of the shared accesses of one dest per lane. The scan is
    PTX shuffles within a warp plus the warps' totals through WTOT [NW] int32: no
    Triton op here may need shared scratch (see `check_layout`). ROLLED: the rows in a
    loop rather than unrolled (the atomic scatter's rare LONG path, where 16 unrolled
    rows raised the whole kernel's registers from 32 to 55). Ends with a barrier."""
    QUADS: gl.constexpr = WROW // 4
    zero = e * 0
    carry = zero
    for b in range(0, QUADS, CH):
        q = b + e
        qm = q < QUADS
        qc = gl.where(qm, q, 0)
        tot = zero.to(gl.int64)
        if ROLLED:  # a loop over the rows: registers for one row's quad at a time
            for ww in range(ROWS):
                tot += _sh_ld64(WC + (ww * WROW + qc * 4) * 2)
        else:
            for ww in gl.static_range(ROWS):
                tot += _sh_ld64(WC + (ww * WROW + qc * 4) * 2)
        tot = gl.where(qm, tot, 0)
        c0 = (tot & 0xFFFF).to(gl.int32)
        c1 = ((tot >> 16) & 0xFFFF).to(gl.int32)
        c2 = ((tot >> 32) & 0xFFFF).to(gl.int32)
        c3 = ((tot >> 48) & 0xFFFF).to(gl.int32)
        quad = c0 + c1 + c2 + c3
        incl = _warp_inclusive_scan(quad)
        _sh_st32(WTOT + w * 4, incl, (lane == 31).to(gl.int32))
        gl.thread_barrier()
        before = zero
        chunk = zero
        for ww in gl.static_range(NW):
            wt = _sh_ld32(WTOT + ww * 4 + zero)
            before += gl.where(w > ww, wt, 0)
            chunk += wt
        s0 = carry + before + incl - quad
        carry += chunk
        s1 = s0 + c0
        s2 = s1 + c1
        s3 = s2 + c2
        run = (s0.to(gl.int64) | (s1.to(gl.int64) << 16) | (s2.to(gl.int64) << 32)
               | (s3.to(gl.int64) << 48))  # fmt: skip
        qmi = qm.to(gl.int32)
        if ROLLED:
            for ww in range(ROWS):
                a = WC + (ww * WROW + qc * 4) * 2
                cw = _sh_ld64(a)
                _sh_st64(a, run, qmi)
                run += cw
        else:
            for ww in gl.static_range(ROWS):
                a = WC + (ww * WROW + qc * 4) * 2
                cw = _sh_ld64(a)
                _sh_st64(a, run, qmi)
                run += cw
        for i in gl.static_range(4):
            d = qc * 4 + i
            dm = qm & (d < WORLD)
            dc = gl.where(dm, d, 0)
            if ET_EARLY:
                base = _sh_ld64(SHIFT + dc * 8)
            else:
                base = gl.load(et_ptr + t * WORLD + dc, mask=dm, other=0).to(gl.int64)
            if i == 0:
                local_start = s0
            elif i == 1:
                local_start = s1
            elif i == 2:
                local_start = s2
            else:
                local_start = s3
            _sh_st64(SHIFT + dc * 8, base - local_start.to(gl.int64), dm.to(gl.int32))
        gl.thread_barrier()  # WTOT is rewritten by the next block; WC / SHIFT are read next


@gluon.jit
def _v5_count_kernel(
    values_ptr,
    block_sizes_ptr,
    seg_offsets_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    tile_seg_lo_ptr,
    tile_seg_hi_ptr,
    counts_ptr,
    snaps_ptr,
    seg_tile_ptr,
    num_tiles,
    WORLD: gl.constexpr,
    MODULO: gl.constexpr,
    NW: gl.constexpr,
    WP: gl.constexpr,
    U: gl.constexpr,
    COLUMNS: gl.constexpr,
    NARROW: gl.constexpr,
):
    """Tile t: the ids of each dest d in the tile, as counts[t, d] (a contiguous row,
    transposed to v4's [dest][tile] order on the host) or, COLUMNS, straight into that
    order at counts[d, t] (W stores num_tiles words apart; adjacent tiles fill each
    sector while it sits in L2), and before the piece of each
    segment s it owns, snaps[s, :] = the counters then and seg_tile[s] = t (what v4's
    `_v4_rank_rows_kernel` writes, without the per-id ranks). Counters: W int32 at the
    reserved buffer's start."""
    CH: gl.constexpr = NW * 32
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    buf = _reserve(WP)
    t = gl.program_id(0)
    key = gl.load(tile_key_ptr + t)
    start = gl.load(tile_start_ptr + t)
    end = gl.load(tile_end_ptr + t)
    seg_lo = gl.load(tile_seg_lo_ptr + t)
    seg_hi = gl.load(tile_seg_hi_ptr + t)
    blk = gl.load(block_sizes_ptr + key).to(gl.int64)
    inv = 1.0 / blk.to(gl.float32)  # for _owner_inv
    e = gl.arange(0, CH, layout=layout)
    for b in range(0, WORLD, CH):
        dd = b + e
        _sh_st32(dd * 4, gl.zeros([CH], gl.int32, layout), (dd < WORLD).to(gl.int32))
    gl.thread_barrier()
    head_end = gl.where(seg_lo < seg_hi, gl.load(seg_offsets_ptr + seg_lo), end)
    eu = gl.arange(0, CH * U, layout=layout)  # U ids per thread and iteration
    _count_piece(values_ptr, start, head_end, blk, inv, eu, WORLD, MODULO, CH * U, NARROW)
    s = seg_lo
    seg_start = head_end
    while s < seg_hi:
        gl.thread_barrier()  # the previous piece's atomics are done
        for b in range(0, WORLD, CH):
            dd = b + e
            dm = dd < WORLD
            seen = _sh_ld32(gl.where(dm, dd, 0) * 4)
            gl.store(snaps_ptr + s * WORLD + dd, seen.to(snaps_ptr.dtype.element_ty), mask=dm)
        gl.store(seg_tile_ptr + s, t)
        gl.thread_barrier()  # every snapshot read precedes the next piece's atomics
        seg_end = gl.load(seg_offsets_ptr + s + 1)
        _count_piece(values_ptr, seg_start, gl.minimum(seg_end, end), blk, inv, eu, WORLD,
                     MODULO, CH * U, NARROW)  # fmt: skip
        seg_start = seg_end
        s += 1
    gl.thread_barrier()
    for b in range(0, WORLD, CH):
        dd = b + e
        dm = dd < WORLD
        total = _sh_ld32(gl.where(dm, dd, 0) * 4)
        if COLUMNS:
            gl.store(counts_ptr + dd.to(gl.int64) * num_tiles + t, total, mask=dm)
        else:
            gl.store(counts_ptr + t.to(gl.int64) * WORLD + dd, total, mask=dm)
    _keep_live(buf, counts_ptr, t, layout, CH)


@gluon.jit
def _v5_scatter_kernel(
    values_ptr,
    block_sizes_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    et_ptr,
    out_values_ptr,
    perm_ptr,
    WORLD: gl.constexpr,
    MODULO: gl.constexpr,
    TILE: gl.constexpr,
    NW: gl.constexpr,
    U: gl.constexpr,
    POS: gl.constexpr,
    B0: gl.constexpr,
    B1: gl.constexpr,
    B2: gl.constexpr,
    B3: gl.constexpr,
    REV: gl.constexpr,
):
    """Tile t (see the module docstring, steps a-d). Shared layout (bytes from the
    reserved buffer): VAL [TILE] int64 staging; SHIFT [W] int64 (et[t, d] minus the
    tile-local start of d); WC [NW][WROW] uint16 per-warp counters / running slots
    (WROW: W rounded up to 4); DIN [TILE] uint16 (dest of each input id); DSLOT [TILE]
    uint16 (dest of each slot; with POS: int32 output position); WTOT [NW] int32 (the
    warps' totals in the scan of step
    b). The bytes are reserved as up to four buffers of B0 > B1 > B2 > B3 words (powers
    of two, 0: none; the binary digits of the size), which Triton's allocator lays out
    largest first, i.e. as one contiguous range from offset 0 (`check_layout` checks it
    on each compiled variant)."""
    CH: gl.constexpr = NW * 32
    VAL: gl.constexpr = 0
    SHIFT: gl.constexpr = VAL + TILE * 8
    WROW: gl.constexpr = (WORLD + 3) // 4 * 4  # WC row stride: whole u64 quads
    WC: gl.constexpr = SHIFT + WORLD * 8
    WC_WORDS: gl.constexpr = NW * WROW // 2
    DIN: gl.constexpr = WC + WC_WORDS * 4
    DSLOT: gl.constexpr = DIN + TILE * 2
    WTOT: gl.constexpr = DSLOT + TILE * (4 if POS else 2)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    buf0 = _reserve(B0)
    if B1 > 0:
        buf1 = _reserve(B1)
    if B2 > 0:
        buf2 = _reserve(B2)
    if B3 > 0:
        buf3 = _reserve(B3)
    t, start, n_t, blk, inv = _tile_header(tile_key_ptr, tile_start_ptr, tile_end_ptr,
                                           block_sizes_ptr, REV)  # fmt: skip
    sub = (n_t + CH * U - 1) // (CH * U) * (32 * U)  # ids per warp, a multiple of 32 U
    e = gl.arange(0, CH, layout=layout)
    w = e // 32
    lane = e % 32
    below, above = _lane_masks(lane)

    e2 = gl.arange(0, CH * U, layout=layout)
    # the tile's et row (output start of each dest), loaded now so that its latency
    # overlaps step (a) when one [CH * U] range holds it; step (b) loads it otherwise
    ET_EARLY: gl.constexpr = WORLD <= CH * U
    if ET_EARLY:
        et_row = gl.load(et_ptr + t * WORLD + e2, mask=e2 < WORLD, other=0).to(gl.int64)
    _zero_words(WC, WC_WORDS, e, CH)
    # (a) per-warp counts; each id's dest kept in DIN. U chunks of 32 per warp and
    # iteration (element e2 of the [CH * U] range: warp (e2 % CH) // 32, lane e2 % 32,
    # chunk e2 // CH), so each thread has U loads in flight.
    loc2 = ((e2 % CH) // 32) * sub + (e2 // CH) * 32 + e2 % 32
    wrow2 = ((e2 % CH) // 32) * WROW
    for c in range(0, sub, 32 * U):
        loc = loc2 + c
        m = loc < n_t
        ids = gl.load(values_ptr + start + loc, mask=m, other=0).to(gl.int64)
        d = gl.where(m, _owner_inv(ids, blk, inv, WORLD, MODULO), 0)
        mi = m.to(gl.int32)
        _sh_add16(WC + (wrow2 + d) * 2, mi)
        _sh_st16(DIN + gl.where(m, loc, 0) * 2, d, mi)
    if ET_EARLY:
        _sh_st64(SHIFT + gl.where(e2 < WORLD, e2, 0) * 8, et_row, (e2 < WORLD).to(gl.int32))
    gl.thread_barrier()
    # (b) per dest: tile-local start, each warp's slot start in WC, SHIFT
    _slot_starts(et_ptr, t, e, w, lane, WC, SHIFT, WTOT, WORLD, WROW, NW, CH, ET_EARLY, NW, False)
    # (c) stable slots, staging, perm; the ids are loaded two chunks ahead
    wloc = w * sub + lane
    ids_1 = gl.load(values_ptr + start + wloc, mask=wloc < n_t, other=0).to(gl.int64)
    ids_2 = gl.load(
        values_ptr + start + wloc + 32, mask=wloc + 32 < gl.minimum(n_t, w * sub + sub), other=0
    ).to(gl.int64)
    for c in range(0, sub, 32):
        loc = wloc + c
        m = loc < n_t
        ids = ids_1
        ids_1 = ids_2
        ahead = loc + 64
        ids_2 = gl.load(
            values_ptr + start + ahead, mask=ahead < gl.minimum(n_t, w * sub + sub), other=0
        ).to(gl.int64)
        mi = m.to(gl.int32)
        locc = gl.where(m, loc, 0)
        d = gl.where(m, _sh_ld16(DIN + locc * 2), -1)
        dc = gl.where(m, d, 0)
        slot, sync = _warp_rank(d, m, w, below, above, WC, WROW)
        slotc = gl.where(m, slot, 0) + sync
        local = _local_of(ids, dc, blk, WORLD, MODULO)
        _sh_st64(VAL + slotc * 8, local, mi)
        shift = _sh_ld64(SHIFT + dc * 8)
        if POS:
            _sh_st32(DSLOT + slotc * 4, (shift + slotc.to(gl.int64)).to(gl.int32), mi)
        else:
            _sh_st16(DSLOT + slotc * 2, dc, mi)
        gl.store(perm_ptr + start + loc, shift + slot.to(gl.int64), mask=m)
    gl.thread_barrier()
    # (d) write the staged tile out in slot order, CH consecutive slots per store
    _write_staged(out_values_ptr, n_t, e2, VAL, DSLOT, SHIFT, CH * U, POS, False)
    _keep_live(buf0, out_values_ptr, t, layout, CH)
    if B1 > 0:
        _keep_live(buf1, out_values_ptr, t, layout, CH)
    if B2 > 0:
        _keep_live(buf2, out_values_ptr, t, layout, CH)
    if B3 > 0:
        _keep_live(buf3, out_values_ptr, t, layout, CH)


@gluon.jit
def _r1_first(values_ptr, start, wloc, wend, AHEAD: gl.constexpr):
    """The ordered loop's first AHEAD (2 or 4) chunks of 32 ids of each warp's sub-range
    (lane ids wloc, sub-range end wend; 0 past it); with AHEAD = 2 the last two repeat
    the second."""
    ids_1 = gl.load(values_ptr + start + wloc, mask=wloc < wend, other=0).to(gl.int64)
    ids_2 = gl.load(values_ptr + start + wloc + 32, mask=wloc + 32 < wend, other=0)
    ids_2 = ids_2.to(gl.int64)
    ids_3 = ids_2
    ids_4 = ids_2
    if AHEAD == 4:
        ids_3 = gl.load(values_ptr + start + wloc + 64, mask=wloc + 64 < wend, other=0)
        ids_4 = gl.load(values_ptr + start + wloc + 96, mask=wloc + 96 < wend, other=0)
        ids_3 = ids_3.to(gl.int64)
        ids_4 = ids_4.to(gl.int64)
    return ids_1, ids_2, ids_3, ids_4


@gluon.jit
def _ranks_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk, inv,
                WORLD: gl.constexpr, MODULO: gl.constexpr, TILE: gl.constexpr,
                NW: gl.constexpr, U: gl.constexpr, POS: gl.constexpr, DST: gl.constexpr,
                V32: gl.constexpr, AHEAD: gl.constexpr, PREFETCH: gl.constexpr,
                NARROW: gl.constexpr, L2PF: gl.constexpr, SKIP: gl.constexpr):  # fmt: skip
    """The work of `_v5_scatter_ranks_kernel` for tile t (ids values[start : start + n_t],
    key block size blk, inv = 1 / blk): the only loop in input order per warp does just
    what stability needs; the random shared
    accesses of placement run after it, U ids per thread at a time, in any order.
    Shared layout (bytes): VAL [TILE] int64 staging (int32 with V32,
    ``staging="int32"``); SHIFT [W] int64; WC [NW][WROW]
    uint16 per-warp counters, then slot starts (WROW: W rounded up to 4); DSLOT [TILE]
    uint16 (dest of each slot; with POS: int32 output position); RNK [TILE] uint16
    (rank of each input id among its
    warp's ids of the same dest); with DST (``dests="stored"``) DEST [TILE] uint16 (each
    input id's dest, step p0); WTOT [NW] int32. Reserved as `_v5_scatter_kernel` does.

    DST: (p0) every id of the tile in any order, U per thread, all loads in flight: its
    dest to DEST; then r1 reads the dests from shared memory instead of loading and
    mapping ids (its ordered loop waited on each id's global load: Nsight Compute put
    15% of the kernel's stall samples on that wait at W = 1024 on an H100, session 34),
    and r2 reads the dest instead of mapping the id again.
    NARROW: dests and local rows by `owner_local_narrow` (the caller checked `narrow_ok`).
    SKIP (``V5Config(diag_skip=...)``, timing only): odd, no write-out (d); 2 or 3, no perm
    stores in r2. 0 compiles the full kernel."""
    CH: gl.constexpr = NW * 32
    SUB: gl.constexpr = TILE // NW  # ids of warp w: [w * SUB, (w + 1) * SUB)
    VAL: gl.constexpr = 0
    SHIFT: gl.constexpr = VAL + TILE * (4 if V32 else 8)
    WROW: gl.constexpr = (WORLD + 3) // 4 * 4  # WC row stride: whole u64 quads
    WC: gl.constexpr = SHIFT + WORLD * 8
    WC_WORDS: gl.constexpr = NW * WROW // 2
    DSLOT: gl.constexpr = WC + WC_WORDS * 4
    RNK: gl.constexpr = DSLOT + TILE * (4 if POS else 2)
    DEST: gl.constexpr = RNK + TILE * 2
    WTOT: gl.constexpr = DEST + (TILE * 2 if DST else 0)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    e = gl.arange(0, CH, layout=layout)
    w = e // 32
    lane = e % 32
    below, above = _lane_masks(lane)
    e2 = gl.arange(0, CH * U, layout=layout)
    ET_EARLY: gl.constexpr = WORLD <= CH * U
    if ET_EARLY:
        et_row = gl.load(et_ptr + t * WORLD + e2, mask=e2 < WORLD, other=0).to(gl.int64)
    if DST:
        # (p0) every id in any order: its dest to DEST (the barrier is _zero_words')
        for j0 in range(0, n_t, CH * U):
            loc = j0 + e2
            m = loc < n_t
            ids = gl.load(values_ptr + start + loc, mask=m, other=0).to(gl.int64)
            d, _ = _dest_local(ids, blk, inv, WORLD, MODULO, NARROW)
            _sh_st16(DEST + gl.where(m, loc, 0) * 2, d, m.to(gl.int32))
    if L2PF:
        # lane 0 of each warp: its sub-range's ids into L2 in one request
        first = values_ptr + start + gl.minimum(w * SUB, n_t)
        _l2_prefetch(first, values_ptr + start + gl.minimum(w * SUB + SUB, n_t), lane == 0)
    wloc = w * SUB + lane  # warp w's lanes in r1
    wend = gl.minimum(n_t, w * SUB + SUB)
    _zero_words(WC, WC_WORDS, e, CH)
    # (r1) per warp, in input order: rank within the warp among ids of the same dest
    # (match.any peers + the warp's running count) to RNK
    if DST:
        for c in range(0, SUB, 32):
            loc = wloc + c
            m = loc < wend
            mi = m.to(gl.int32)
            d = gl.where(m, _sh_ld16(DEST + gl.where(m, loc, 0) * 2), -1)
            rank, sync = _warp_rank(d, m, w, below, above, WC, WROW)
            _sh_st16(RNK + gl.where(m, loc, 0) * 2 + sync, rank, mi)
    else:
        # the next AHEAD chunks' ids are in flight (the loads of chunk c + AHEAD are
        # issued before chunk c is ranked); AHEAD = 2 or 4
        ids_1, ids_2, ids_3, ids_4 = _r1_first(values_ptr, start, wloc, wend, AHEAD)
        for c in range(0, SUB, 32):
            loc = wloc + c
            m = loc < wend
            ids = ids_1
            ahead = loc + 32 * AHEAD
            nxt = gl.load(values_ptr + start + ahead, mask=ahead < wend, other=0).to(gl.int64)
            if AHEAD == 4:
                ids_1 = ids_2
                ids_2 = ids_3
                ids_3 = ids_4
                ids_4 = nxt
            else:
                ids_1 = ids_2
                ids_2 = nxt
            mi = m.to(gl.int32)
            d = gl.where(m, _dest_local(ids, blk, inv, WORLD, MODULO, NARROW)[0], -1)
            rank, sync = _warp_rank(d, m, w, below, above, WC, WROW)
            _sh_st16(RNK + gl.where(m, loc, 0) * 2 + sync, rank, mi)
    # PREFETCH: r2's first ids are loaded here, in flight during (b)
    nxt = gl.load(values_ptr + start + e2, mask=(e2 < n_t) & PREFETCH, other=0).to(gl.int64)
    if ET_EARLY:
        _sh_st64(SHIFT + gl.where(e2 < WORLD, e2, 0) * 8, et_row, (e2 < WORLD).to(gl.int32))
    gl.thread_barrier()
    # (b) per dest: tile-local start, each warp's slot start in WC, SHIFT
    _slot_starts(et_ptr, t, e, w, lane, WC, SHIFT, WTOT, WORLD, WROW, NW, CH, ET_EARLY, NW, False)
    # (r2) every id in any order: the dest again (from the id), slot = the warp's start
    # for the dest + the rank; value staged at the slot, output position to perm. With
    # PREFETCH the next pass's ids are loaded before this pass's work (double buffer)
    for j0 in range(0, n_t, CH * U):
        loc = j0 + e2
        m = loc < n_t
        locc = gl.where(m, loc, 0)
        if PREFETCH:
            ids = nxt
            nl = loc + CH * U
            nxt = gl.load(values_ptr + start + nl, mask=nl < n_t, other=0).to(gl.int64)
        else:
            ids = gl.load(values_ptr + start + loc, mask=m, other=0).to(gl.int64)
        d, local = _dest_local(ids, blk, inv, WORLD, MODULO, NARROW)
        if DST:
            d = _sh_ld16(DEST + locc * 2)
            if not NARROW:
                local = _local_of(ids, d, blk, WORLD, MODULO)
        # the id's warp (locc >= 0: an unsigned shift, no sign fix-up)
        owner_warp = (locc.to(gl.uint32) // SUB).to(gl.int32)
        slot = _sh_ld16(WC + (owner_warp * WROW + d) * 2) + _sh_ld16(RNK + locc * 2)
        mi = m.to(gl.int32)
        shift = _sh_ld64(SHIFT + d * 8)
        if V32:
            # int32 staging; a value outside [0, 2^31 - 1) goes straight to its output
            # position (exact for any id) and its slot holds -1, which the write-out skips
            fits = local.to(gl.uint64) < 0x7FFFFFFF  # 0 <= local < 2^31 - 1
            _sh_st32(VAL + slot * 4, gl.where(fits, local, -1).to(gl.int32), mi)
            gl.store(out_values_ptr + shift + slot.to(gl.int64),
                     local.to(out_values_ptr.dtype.element_ty), mask=m & ~fits)  # fmt: skip
        else:
            _sh_st64(VAL + slot * 8, local, mi)
        if POS:
            _sh_st32(DSLOT + slot * 4, (shift + slot.to(gl.int64)).to(gl.int32), mi)
        else:
            _sh_st16(DSLOT + slot * 2, d, mi)
        if SKIP // 2 % 2 == 0:
            gl.store(perm_ptr + start + loc, shift + slot.to(gl.int64), mask=m)
    gl.thread_barrier()
    # (d) write the staged tile out in slot order, CH consecutive slots per store
    if SKIP % 2 == 0:
        _write_staged(out_values_ptr, n_t, e2, VAL, DSLOT, SHIFT, CH * U, POS, V32)


@gluon.jit
def _v5_scatter_ranks_kernel(
    values_ptr,
    block_sizes_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    et_ptr,
    out_values_ptr,
    perm_ptr,
    WORLD: gl.constexpr,
    MODULO: gl.constexpr,
    TILE: gl.constexpr,
    NW: gl.constexpr,
    U: gl.constexpr,
    POS: gl.constexpr,
    DST: gl.constexpr,
    V32: gl.constexpr,
    AHEAD: gl.constexpr,
    PREFETCH: gl.constexpr,
    B0: gl.constexpr,
    B1: gl.constexpr,
    B2: gl.constexpr,
    B3: gl.constexpr,
    NARROW: gl.constexpr,
    L2PF: gl.constexpr,
    L2AH: gl.constexpr,
    SKIP: gl.constexpr,
    REV: gl.constexpr,
):
    """Tile t, ``scatter="ranks"`` (the module docstring's steps r1, b, r2, d; the work is
    `_ranks_tile`'s). NARROW (``V5Config(narrow=True)``, block mode): a tile whose key
    passes `narrow_ok` (block size x (W + 1) < 2^31) maps ids to dests and local rows in
    32-bit arithmetic (`owner_local_narrow`); one uniform branch per tile picks the body,
    both compiled, so another tile of the same call takes the 64-bit path.
    L2AH > 0 (``V5Config(l2_ahead=...)``): first, lane 0 of each warp asks for its
    sub-range of tile t + L2AH in L2 (`_l2_prefetch_ahead`)."""
    CH: gl.constexpr = NW * 32
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    buf0 = _reserve(B0)
    if B1 > 0:
        buf1 = _reserve(B1)
    if B2 > 0:
        buf2 = _reserve(B2)
    if B3 > 0:
        buf3 = _reserve(B3)
    t, start, n_t, blk, inv = _tile_header(tile_key_ptr, tile_start_ptr, tile_end_ptr,
                                           block_sizes_ptr, REV)  # fmt: skip
    if L2AH > 0:
        _l2_prefetch_ahead(values_ptr, tile_start_ptr, tile_end_ptr, t + L2AH, TILE, NW,
                           layout)  # fmt: skip
    if NARROW:
        if narrow_ok(blk, WORLD):
            _ranks_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk,
                        inv, WORLD, MODULO, TILE, NW, U, POS, DST, V32, AHEAD, PREFETCH,
                        True, L2PF, SKIP)  # fmt: skip
        else:
            _ranks_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk,
                        inv, WORLD, MODULO, TILE, NW, U, POS, DST, V32, AHEAD, PREFETCH,
                        False, L2PF, SKIP)  # fmt: skip
    else:
        _ranks_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk, inv,
                    WORLD, MODULO, TILE, NW, U, POS, DST, V32, AHEAD, PREFETCH, False,
                    L2PF, SKIP)  # fmt: skip
    _keep_live(buf0, out_values_ptr, t, layout, CH)
    if B1 > 0:
        _keep_live(buf1, out_values_ptr, t, layout, CH)
    if B2 > 0:
        _keep_live(buf2, out_values_ptr, t, layout, CH)
    if B3 > 0:
        _keep_live(buf3, out_values_ptr, t, layout, CH)


@gluon.jit
def _atomic_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk, inv,
                 WORLD: gl.constexpr, MODULO: gl.constexpr, TILE: gl.constexpr,
                 NW: gl.constexpr, U: gl.constexpr, V32: gl.constexpr,
                 PREFETCH: gl.constexpr, RUNMAX: gl.constexpr,
                 KR: gl.constexpr):  # fmt: skip
    """The work of `_v5_scatter_atomic_kernel` for tile t (`_ranks_tile`'s arguments):
    no loop in input order unless a run is long.

    (a1) every id in any order: its dest, its unordered rank u among the tile's ids of
    that dest (`_sh_fetch_add16` on one row of tile counters), u and the dest stored by
    input index; a thread that took some u >= RUNMAX raises the tile's LONG flag; (b)
    `_slot_starts` with one row: the counters become the dests' tile-local starts,
    SHIFT[d] = et[t, d] - start[d]; (a2) every id in any order: its value staged at slot
    start[d] + u, its input index and dest by slot; (a3) the slots in order: the stable
    rank r of the slot's id in its dest's run = how many input indices of the run are
    below its own (`_run_rank`; the run is [start[d], start[d + 1]), ~tile / W ids, which
    is why this scatter is for large W), the value written out to et[t, d] + r (a warp's
    stores cover the same runs as in slot order), the final slot start[d] + r by input
    index; (a4) every id in input order: perm = SHIFT[d] + its final slot (coalesced
    stores).

    A LONG tile (some dest holds more than RUNMAX of its ids) would cost a3 ~run length
    shared loads per id: ~tile^2 when one dest takes the whole tile (W = 1, or hot ids
    in one shard's range). It ranks in input order instead, between (b) and (a2): (o)
    KR ranking warps, warp w < KR taking ids [w * TILE / KR, (w + 1) * TILE / KR), each
    count its ids' dests in its own row of uint16 counters (in the VAL, LI and DSLOT
    bytes, unused until a2), `_slot_starts` turns the rows into each warp's slot start
    per dest, and each ranking warp walks its ids in order (`_warp_rank`: match.any and
    its row), the final slot to UR; with KR = 1 (the rows do not fit) warp 0 walks the
    whole tile on the WC row of starts itself. Then a2 stages at the final slot and a3
    writes slot p to et[t, d] + p - start[d] without the run count. The flag is one
    shared word read by every thread after a barrier: the branch is uniform per tile.

    Shared layout (bytes): VAL [TILE] int64 staging (int32 with V32: a value outside
    [0, 2^31 - 1) is staged as -1 and a3 maps its id again); LI [TILE] uint16 by slot
    (input index); DSLOT [TILE] uint16 by slot (dest); SHIFT [W] int64; WC [WROW] uint16
    tile counters, then starts (WROW >= W + 1, a multiple of 4: entry W holds the tile's
    id count after the scan, the end of the last run); UR [TILE] uint16 by input index
    (u, then the final slot); DEST [TILE] uint16 by input index (dest); WTOT [NW] int32;
    LONG int32."""
    CH: gl.constexpr = NW * 32
    VAL: gl.constexpr = 0
    LI: gl.constexpr = VAL + TILE * (4 if V32 else 8)
    DSLOT: gl.constexpr = LI + TILE * 2
    SHIFT: gl.constexpr = DSLOT + TILE * 2
    WROW: gl.constexpr = (WORLD + 4) // 4 * 4  # one row, entry W included
    WC: gl.constexpr = SHIFT + WORLD * 8
    WC_WORDS: gl.constexpr = WROW // 2
    UR: gl.constexpr = WC + WC_WORDS * 4
    DEST: gl.constexpr = UR + TILE * 2
    WTOT: gl.constexpr = DEST + TILE * 2
    LONG: gl.constexpr = WTOT + NW * 4
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    e = gl.arange(0, CH, layout=layout)
    w = e // 32
    lane = e % 32
    e2 = gl.arange(0, CH * U, layout=layout)
    ET_EARLY: gl.constexpr = WORLD <= CH * U
    if ET_EARLY:
        et_row = gl.load(et_ptr + t * WORLD + e2, mask=e2 < WORLD, other=0).to(gl.int64)
    _sh_st32(LONG + e * 0, e * 0, (e == 0).to(gl.int32))
    _zero_words(WC, WC_WORDS, e, CH)
    # (a1) any order: unordered rank by a shared atomic; u and dest by input index
    umax = e2 * 0
    for j0 in range(0, n_t, CH * U):
        loc = j0 + e2
        m = loc < n_t
        locc = gl.where(m, loc, 0)
        mi = m.to(gl.int32)
        ids = gl.load(values_ptr + start + loc, mask=m, other=0).to(gl.int64)
        d, _ = _dest_local(ids, blk, inv, WORLD, MODULO, False)
        d = gl.where(m, d, 0)
        u = _sh_fetch_add16(WC + d * 2, mi)
        umax = gl.maximum(umax, u)
        _sh_st16(UR + locc * 2, u, mi)
        _sh_st16(DEST + locc * 2, d, mi)
    _sh_st32(LONG + e2 * 0, e2 * 0 + 1, (umax >= RUNMAX).to(gl.int32))
    # PREFETCH: a2's first ids are loaded here, in flight during (b)
    nxt = gl.load(values_ptr + start + e2, mask=(e2 < n_t) & PREFETCH, other=0).to(gl.int64)
    if ET_EARLY:
        _sh_st64(SHIFT + gl.where(e2 < WORLD, e2, 0) * 8, et_row, (e2 < WORLD).to(gl.int32))
    gl.thread_barrier()
    # (b) one row: tile-local start of each dest (entry W: n_t), SHIFT
    _slot_starts(et_ptr, t, e, w, lane, WC, SHIFT, WTOT, WORLD, WROW, NW, CH, ET_EARLY, 1, False)
    long_tile = _sh_ld32(LONG) != 0  # after _slot_starts' closing barrier
    if long_tile:
        _atomic_long_ranks(et_ptr, t, n_t, e, w, lane, WC, SHIFT, WTOT, UR, DEST, WORLD,
                           TILE, NW, KR)  # fmt: skip
    # (a2) any order: value, input index and dest at slot start[d] + u (LONG: UR's slot)
    for j0 in range(0, n_t, CH * U):
        loc = j0 + e2
        m = loc < n_t
        locc = gl.where(m, loc, 0)
        mi = m.to(gl.int32)
        if PREFETCH:
            ids = nxt
            nl = loc + CH * U
            nxt = gl.load(values_ptr + start + nl, mask=nl < n_t, other=0).to(gl.int64)
        else:
            ids = gl.load(values_ptr + start + loc, mask=m, other=0).to(gl.int64)
        d, local = _dest_local(ids, blk, inv, WORLD, MODULO, False)
        d = gl.where(m, d, 0)
        if long_tile:
            slot = _sh_ld16(UR + locc * 2)
        else:
            slot = _sh_ld16(WC + d * 2) + _sh_ld16(UR + locc * 2)
        if V32:
            fits = local.to(gl.uint64) < 0x7FFFFFFF  # 0 <= local < 2^31 - 1
            _sh_st32(VAL + slot * 4, gl.where(fits, local, -1).to(gl.int32), mi)
        else:
            _sh_st64(VAL + slot * 8, local, mi)
        _sh_st16(LI + slot * 2, loc, mi)
        _sh_st16(DSLOT + slot * 2, d, mi)
    gl.thread_barrier()
    # (a3) slot order: stable rank within the run (LONG: the slot is final already),
    # write-out, final slot by input index
    for j0 in range(0, n_t, CH * U):
        p = j0 + e2
        m = p < n_t
        pc = gl.where(m, p, 0)
        mi = m.to(gl.int32)
        li = _sh_ld16(LI + pc * 2)
        d = _sh_ld16(DSLOT + pc * 2)
        if long_tile:
            f = pc
        else:
            s = _sh_ld16(WC + d * 2)
            f = s + _run_rank(LI + s * 2, LI + _sh_ld16(WC + d * 2 + 2) * 2, li)
        if V32:
            v = _sh_ld32(VAL + pc * 4).to(gl.int64)
            big = m & (v == -1)
            ids = gl.load(values_ptr + start + li, mask=big, other=0).to(gl.int64)
            v = gl.where(big, _local_of(ids, d, blk, WORLD, MODULO), v)
        else:
            v = _sh_ld64(VAL + pc * 8)
        at = _sh_ld64(SHIFT + d * 8) + f.to(gl.int64)
        gl.store(out_values_ptr + at, v.to(out_values_ptr.dtype.element_ty), mask=m)
        _sh_st16(UR + li * 2, f, mi)
    gl.thread_barrier()
    # (a4) input order: perm = SHIFT[d] + final slot
    for j0 in range(0, n_t, CH * U):
        loc = j0 + e2
        m = loc < n_t
        locc = gl.where(m, loc, 0)
        d = _sh_ld16(DEST + locc * 2)
        at = _sh_ld64(SHIFT + d * 8) + _sh_ld16(UR + locc * 2).to(gl.int64)
        gl.store(perm_ptr + start + loc, at, mask=m)


@gluon.jit
def _atomic_long_ranks(et_ptr, t, n_t, e, w, lane, WC: gl.constexpr, SHIFT: gl.constexpr,
                       WTOT: gl.constexpr, UR: gl.constexpr, DEST: gl.constexpr,
                       WORLD: gl.constexpr, TILE: gl.constexpr, NW: gl.constexpr,
                       KR: gl.constexpr):  # fmt: skip
    """Step (o) of `_atomic_tile` on a LONG tile: each id's final tile slot (its dest's
    start + its stable rank among the tile's ids of that dest) to UR[input index], by
    KR warps each walking its own TILE / KR ids in input order. Uses bytes [0, KR * RW *
    2) for the ranking warps' counter rows when KR > 1 (RW: W rounded up to 4; in VAL,
    LI and DSLOT, whose first writes come after); with KR = 1 warp 0 walks the tile on
    WC's starts (a2 and a3 read no start on a LONG tile). Ends with a barrier."""
    CH: gl.constexpr = NW * 32
    SUB: gl.constexpr = TILE // KR  # ids of ranking warp w: [w * SUB, (w + 1) * SUB)
    below, above = _lane_masks(lane)
    wk = gl.where(w < KR, w, 0)
    wloc = wk * SUB + lane
    wend = gl.minimum(n_t, wk * SUB + SUB)
    on = (w < KR) & (lane < SUB)
    if KR > 1:
        RW: gl.constexpr = (WORLD + 3) // 4 * 4  # row stride: whole u64 quads
        ROWS: gl.constexpr = 0
        _zero_words(ROWS, KR * RW // 2, e, CH)
        for c in range(0, SUB, 32):  # each ranking warp counts its ids' dests
            loc = wloc + c
            m = on & (loc < wend)
            d = _sh_ld16(DEST + gl.where(m, loc, 0) * 2)
            _sh_add16(ROWS + (wk * RW + gl.where(m, d, 0)) * 2, m.to(gl.int32))
        gl.thread_barrier()
        # per ranking warp and dest: the slot of its first id (SHIFT rewritten, same values)
        _slot_starts(et_ptr, t, e, w, lane, ROWS, SHIFT, WTOT, WORLD, RW, NW, CH, False, KR, True)
    else:
        RW: gl.constexpr = (WORLD + 4) // 4 * 4
        ROWS: gl.constexpr = WC
    for c in range(0, SUB, 32):
        loc = wloc + c
        m = on & (loc < wend)
        mi = m.to(gl.int32)
        d = gl.where(m, _sh_ld16(DEST + gl.where(m, loc, 0) * 2), -1)
        rank, sync = _warp_rank(d, m, wk, below, above, ROWS, RW)
        _sh_st16(UR + gl.where(m, loc, 0) * 2 + sync, rank, mi)
    gl.thread_barrier()


@gluon.jit
def _v5_scatter_atomic_kernel(
    values_ptr,
    block_sizes_ptr,
    tile_key_ptr,
    tile_start_ptr,
    tile_end_ptr,
    et_ptr,
    out_values_ptr,
    perm_ptr,
    WORLD: gl.constexpr,
    MODULO: gl.constexpr,
    TILE: gl.constexpr,
    NW: gl.constexpr,
    U: gl.constexpr,
    V32: gl.constexpr,
    PREFETCH: gl.constexpr,
    RUNMAX: gl.constexpr,
    KR: gl.constexpr,
    B0: gl.constexpr,
    B1: gl.constexpr,
    B2: gl.constexpr,
    B3: gl.constexpr,
    REV: gl.constexpr,
):
    """Tile t, ``scatter="atomic"`` (`_atomic_tile`'s steps a1, b, [o,] a2, a3, a4)."""
    CH: gl.constexpr = NW * 32
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    buf0 = _reserve(B0)
    if B1 > 0:
        buf1 = _reserve(B1)
    if B2 > 0:
        buf2 = _reserve(B2)
    if B3 > 0:
        buf3 = _reserve(B3)
    t, start, n_t, blk, inv = _tile_header(tile_key_ptr, tile_start_ptr, tile_end_ptr,
                                           block_sizes_ptr, REV)  # fmt: skip
    _atomic_tile(values_ptr, et_ptr, out_values_ptr, perm_ptr, t, start, n_t, blk, inv,
                 WORLD, MODULO, TILE, NW, U, V32, PREFETCH, RUNMAX, KR)  # fmt: skip
    _keep_live(buf0, out_values_ptr, t, layout, CH)
    if B1 > 0:
        _keep_live(buf1, out_values_ptr, t, layout, CH)
    if B2 > 0:
        _keep_live(buf2, out_values_ptr, t, layout, CH)
    if B3 > 0:
        _keep_live(buf3, out_values_ptr, t, layout, CH)


# ---------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class V5Config:
    """Tuning knobs of `ranged_dispatch_v5` (every choice gives the same bits).

    tile: ids per program of both kernels (power of two, 256..16384); the scatter stages
        a whole tile in shared memory (12 bytes per id plus 8 W + 2 W * scatter_warps).
    count_warps / scatter_warps: warps per program of each kernel.
    finish_block: v4's finish pass block (see `V4Config.finish_block`).
    unroll: ids per thread and iteration of the loops that need no order (counting,
        write-out): loads in flight per thread (1, 2, 4 or 8).
    scatter: "staged" (`_v5_scatter_kernel`: per-warp counts first, then one loop in
        input order that ranks and places) or "ranks" (`_v5_scatter_ranks_kernel`: the
        loop in input order only ranks; placement runs after it in any order; needs
        tile >= 32 * scatter_warps) or "atomic" (`_v5_scatter_atomic_kernel`, session
        49, opt-in: no loop in input order; each id's rank among the tile's ids of its
        dest comes unordered from a shared atomic, and the stable rank is then counted
        within the dest's run of ~tile / W ids, so it is meant for large W; takes the
        tile, warps, unroll, staging, prefetch, counts, snaps, reverse and run_limit
        knobs only).
    counts: how the count kernel hands the per-(tile, dest) counts to the scan: "rows"
        ([tile][dest] rows, then `transpose_2d`) or "columns" (stored in the scan's
        [dest][tile] order by the count kernel itself: one launch and one copy less).
        Measured at 2^26 ids (`dispatch_v5_bcf9972.json`, H200): at W = 8 and 32 the
        count kernel took the same time either way, so "columns" saved the transpose
        (3.6-4.4 us); at W = 128 its strided stores cost 13 us more than the transpose's
        9; at W = 1024, 194-547 us more than its 34. The default stays "rows"
        everywhere (what `kernels.json` measured).
    slots: what the scatter keeps per staged slot for its write-out: "dest" (uint16; the
        write-out looks up the dest's output shift, a random shared load per id) or
        "pos" (the int32 output position itself, 2 bytes more per id; calls of 2^31 ids
        or more use "dest").
    dests: with ``scatter="ranks"``, "recompute" (the ordered loop and the placement
        each load an id and map it to its dest) or "stored" (a pass over the tile in any
        order, all loads in flight, stores each id's dest in shared memory, 2 bytes more
        per id; the ordered loop then reads dests from shared memory and waits on no
        global load). The staged scatter keeps its dests in shared memory already.
        Measured on one H100 at 2^26 ids (`dispatch_v5_dst_h100_123d8b2.json`): W = 1024
        0.354 of the floor with unroll 4 against 0.340 for the default; 3-8% slower at
        W = 64 and 256 with 4096-id tiles, 4-7% faster with 2048-id tiles. Opt-in.
    staging: with ``scatter="ranks"``, the width of a staged value: "int64" or "int32"
        (4 bytes less per id). A value outside [0, 2^31 - 1) is stored straight to its
        output position instead and its slot marked -1, so every id stays exact (GPU
        test with ids past 2^31 rows per shard: passed on an H100 at 47cd70b). At
        W = 1024 with 4096-id tiles it lifts occupancy from 50% to 73% (three programs
        per SM) but not the time (1.867 against 1.836 ms on an H100,
        `dispatch_v5_probe_h100_47cd70b.json`); what it buys is larger tiles at the same
        occupancy: 8192 ids at W = 1024 (1.559 ms), 16384 at W = 2048 (`default_config_v5`).
    ahead: with ``scatter="ranks"`` and ``dests="recompute"``, how many chunks of 32
        ids the ordered loop (r1) keeps loading ahead of the chunk it ranks: 2 or 4
        (session 35's profile: 14% of the W = 1024 scatter's stall samples waited on
        those loads). Opt-in: on one H100 (`dispatch_v5_snaps_h100_561a5b7.json`) it did
        not help with 8192-id tiles (W = 1024: 1.550 against 1.541 ms; W = 256: 1.212
        against 1.179); with 4096-id tiles 2-5% faster at W = 1024 and 2048, where the
        H100 runs 8192- or 16384-id tiles.
    prefetch: with ``scatter="ranks"``, placement (r2) loads the ids of its next pass
        before working on the current one, and its first pass's ids before step (b)
        (the same profile: 15% of the stall samples on r2's id loads; four ids per
        thread instead of two did not help). On one H100 (`dispatch_v5_pfsn_h100_ad89623.json`,
        with int16 snapshots) 2.8-6.3% faster from W = 512 with 8192- and 16384-id tiles,
        the H100's default there; +1.7% slower at W = 256 with 4096-id tiles.
    snaps: the width of the count kernel's per-segment counter snapshots (nseg x W words
        written, then read by the finish pass): "int32" (v4's) or "int16" (half the
        bytes; a counter never exceeds the tile, at most 16384 ids). At 2^26 ids, W = 1024
        and 32K segments they are 128 MB each way at int32, ~0.085 ms of an H100's
        1.54 ms call. On one H100 (`dispatch_v5_snaps_h100_561a5b7.json`): 1.511 against
        1.541 ms at W = 1024, 2.364 against 2.418 at W = 2048 (8192-id tiles), 0.966
        against 0.968 at W = 64; never slower. The H100 table uses it at every W; the H200
        table not yet (not timed there).
    narrow: with ``scatter="ranks"``, block mode: a tile whose key passes `narrow_ok`
        (block size x (W + 1) < 2^31, every table below ~2M rows per shard at W = 1024)
        maps ids to dests and local rows in 32-bit arithmetic (`owner_local_narrow`),
        chosen per tile and per count piece by one uniform branch. Static SASS (sm_90, the
        H100 default at W = 1024): ordered loop 69 -> 58 instructions per 32 ids,
        placement 148 -> 129 per 64, count loop 78 -> 61. Time on one H100 at 2^26 ids
        (`dispatch_v5_narrow_h100_4e08fad.json`): W = 1024 1.503 against 1.498 ms with
        8192-id tiles (the default), 1.540 against 1.577 with 16384-id tiles; W = 2048
        1.865 against 1.907 (16384, the default there). The scatter is not bound by its
        instruction count; opt-in.
    l2_prefetch: with ``scatter="ranks"``, lane 0 of each warp first asks for its
        sub-range's ids in L2 with one ``cp.async.bulk.prefetch`` (aimed at the ordered
        loop's waits on global id loads). On one H100 (`dispatch_v5_l2_h100_b7659d4.json`):
        W = 1024 1.599 against 1.511 ms with 8192-id tiles (slower), W = 2048 2.051
        against 2.322 with 8192-id tiles and 1.885 against 1.918 with 16384; opt-in.
    l2_ahead: with ``scatter="ranks"``, n > 0: lane 0 of each warp of the program of tile
        t first asks for its sub-range of tile t + n in L2 (one bulk prefetch), about a
        wave ahead of that tile's program (an H100 holds 2 x 132 programs of the 8192-id
        config), instead of `l2_prefetch`'s own sub-range just before it is read. 0 (the
        default): off. On one H100 (`dispatch_v5_l2ahead_h100_a19edf1.json`, n = 66 ..
        528): slower on the table's configs at every W (W = 1024, 8192-id tiles: 1.63-1.66
        against 1.50 ms); faster only on configs the table does not use there (W = 2048,
        8192-id tiles, n = 66: 2.10 against 2.32 ms; the default's 16384-id tiles: 1.92);
        opt-in.
    diag_skip: **timing diagnostics only; the call's output is incomplete.** With
        ``scatter="ranks"``: 1 skips the write-out of the staged values (step d), 2 the
        perm stores of step r2, 3 both, so that `benchmarks/dispatch_v5.py` can time what
        the rest of the scatter costs (how much a write-out overlapped with the next
        tile's ranking could save). 0 (the default) compiles the full kernel. Never set
        by `default_config_v5`. On one H100 (`dispatch_v5_diagskip_h100_b96ca4f.json`), W =
        1024, the default's scatter: 0.999 ms, 0.726 without the write-out, 0.687 without
        any global store (the whole call 0.418 -> 0.508 / 0.529 of the HBM floor).
    reverse: the scatter takes the tiles last first (program i runs tile num_tiles - 1 - i;
        either scatter). The count kernel reads the ids first to last just before, so the
        ids it read last may still sit in L2 (50 MB on an H100 or H200, against 512 MB of
        int64 ids at 2^26) when the scatter reads them first: up to ~50 MB of the
        scatter's id reads from L2 rather than HBM. Same bits: each tile writes only its
        own precomputed output positions. Session 47 (`default_config_v5` has the
        numbers): 0.950x the time at W = 32 and 0.942x at 16 on an H200, no gain at 64
        or 1024 nor for the H100's 4096-id config; on in both tables where it gained.
    run_limit: with ``scatter="atomic"``, a tile in which some dest holds more than
        run_limit of its ids ranks them in input order (`_atomic_tile`'s step o: warps
        walking their ids with match.any, as the ranks scatter does) instead of counting
        within the dests' runs, whose cost per id is the run's length: a tile whose ids
        all go to one dest (W = 1, or hot ids in one shard's row range) would cost ~tile^2
        shared loads. 64 (the default) is a guess from the instruction counts (a warp
        step of the run count per 32 slots against ~100 cycles of latency per ordered
        step), not timed yet; 0 takes the ordered path on every tile, 16384 on none (the
        runs' count alone, however long). Same bits either way.
    """

    tile: int = 4096
    count_warps: int = 8
    scatter_warps: int = 8
    finish_block: int = 32
    unroll: int = 4
    scatter: str = "staged"
    counts: str = "rows"
    slots: str = "dest"
    dests: str = "recompute"
    staging: str = "int64"
    ahead: int = 2
    prefetch: bool = False
    snaps: str = "int32"
    narrow: bool = False
    l2_prefetch: bool = False
    l2_ahead: int = 0
    diag_skip: int = 0
    reverse: bool = False
    run_limit: int = 64


def default_config_v5(world_size: int, device_name: Optional[str] = None) -> V5Config:
    """The best of the configurations timed at 2^26 ids on the card `device_name`
    (``torch.cuda.get_device_name()``; `ranged_dispatch_v5` passes its tensors' card).

    H200 and any other name (sessions 27-30, `benchmarks/results/dispatch_v5_sweep_*.json`;
    44; 47): below W = 32 the staged scatter with 2048-id tiles and 4 warps, tiles last
    first (``reverse``); to W = 255 the ranks scatter with 2048-id tiles and 8 warps (4
    counting), int16 snapshots, tiles last first; to W = 511 the ranks scatter with
    4096-id tiles and 16 warps (8 counting), 2 ids per thread and pass, int16 snapshots.
    Session 47 (`dispatch_v5_rev_h200_88bebc9.json`, one H200, two runs each unless said):
    the 2048-id ranks config reversed with int16 snapshots took 0.729 / 0.730 ms at W = 32
    against 0.768 / 0.769 for the table before, 0.850 / 0.852 against 0.860 / 0.861 at
    W = 128, 0.774 / 0.776 against 0.771 / 0.774 at W = 64 (a tie); the staged scatter
    reversed 0.695 against 0.738 at W = 16 (one run); the 4096-id config with int16
    snapshots 0.966 / 0.966 against 1.014 / 1.016 at W = 256. From W = 512 the H100's
    choices below (int32 staging, 8192-id tiles, 16384 from W = 1025 to 2048, placement
    prefetch, int16 snapshots): tuned on H100s (sessions 35-36) and adopted on the H200
    in session 44, where they took 1.251 against 1.584 ms at W = 1024, 1.673 against
    2.496 at W = 2048 and 1.090 against 1.078 at W = 512
    (`dispatch_v5_candidate_h200_d4ce341.json`, one run; there as
    ``FREESCALE_V5_TABLE=H200_H100BIG``, the name this table had before).

    H100 ("H100" in the name): below W = 32 the ranks scatter with 2048-id tiles, 8 warps
    (4 counting), 4 ids per thread and int16 snapshots (session 42, at 75402d3,
    `dispatch_v5_smallw_h100_75402d3.json`: 0.832 / 0.850 ms at W = 8 / 16 against 0.884 /
    0.895 for the 4096-id config; tied at W = 32 and 64, 0.941 / 0.950 against 0.947 /
    0.952; behind from W = 128, 1.293 against 1.034); at W = 32 to 64 the H200's config
    since session 47 (2048-id ranks, int16 snapshots, tiles last first; at bf4a007,
    `dispatch_v5_rev_h100_bf4a007.json`, two runs: 0.916 / 0.918 ms against 0.944 / 0.945
    for the 4096-id config at W = 32, 0.925 / 0.926 against 0.945 / 0.946 at W = 64; the
    4096-id config reversed took 1.000-1.010x its unreversed time at W = 32 to 256, the
    8192-id one 1.001x at W = 1024); the 4096-id config from W = 65 to 511; from W = 512
    the same warps with int32 staging and larger tiles: 8192 ids, but
    16384 from W = 1025 to 2048 (session 35; the H200's too since session 44), and
    placement prefetch; int16 snapshots at every W (session 36, measured at ad89623,
    `dispatch_v5_pfsn_h100_ad89623.json`: W = 1024 1.484 against 1.541 ms, W = 2048 1.910
    against 2.038, W = 256 1.094 against 1.100; `kernels_h100_3d4b487.json`). On
    one H100 at 422e9b0 (`dispatch_v5_h100_422e9b0.json`) the 4096-id config took 0.915 / 0.949 /
    0.979 / 1.036 / 1.140 ms at W = 8 / 32 / 64 / 128 / 256 against 0.948 / 1.042 /
    1.175 / 1.297 / 1.592 for the H200 table's choices (on the H200 the smaller tiles
    won from W = 32 to 256: 0.781 against 0.825 ms at W = 32, 0.913 against 0.926 at
    W = 128). At 47cd70b (`dispatch_v5_probe_h100_47cd70b.json`) the 8192-id tiles took
    1.559 against 1.836 ms at W = 1024 (half the tables and half the per-tile work of
    the scatter per id) and lost at W = 256 (1.189 against 1.115) and W = 64. At 15a9a81
    (`dispatch_v5_tiles_h100_15a9a81.json`): W = 512 1.289 against 1.409 ms; W = 2048
    2.050 ms with 16384-id tiles against 2.424 (8192) and 2.898 (4096); at W = 1024 the
    16384-id tiles lost (1.704 against 1.554). At d1eca03
    (`dispatch_v5_bigw_h100_d1eca03.json`): W = 1536 1.927 ms (16384) against 2.247
    (8192) and 2.194 (4096); W = 3072 and 4096, where 16384-id tiles do not fit, 3.051
    and 3.392 ms (8192) against 3.680 and 4.099 (4096).
    """
    big = V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2, scatter="ranks")
    # session 47: the H200's from W = 32 to 255, the H100's from 32 to 64
    small_rev = V5Config(tile=2048, count_warps=4, scatter_warps=8, scatter="ranks",
                         snaps="int16", reverse=True)  # fmt: skip
    if world_size >= 512:  # both cards (the H200 since session 44)
        tile = 16384 if 1024 < world_size <= 2048 else 8192
        return dataclasses.replace(big, tile=tile, staging="int32", prefetch=True, snaps="int16")
    if device_name is not None and "H100" in device_name:
        if world_size < 32:  # session 42 (dispatch_v5_smallw_h100_75402d3.json)
            return V5Config(tile=2048, count_warps=4, scatter_warps=8, scatter="ranks",
                            snaps="int16")  # fmt: skip
        if world_size <= 64:  # dispatch_v5_rev_h100_bf4a007.json
            return small_rev
        return dataclasses.replace(big, snaps="int16")
    if world_size < 32:  # session 47: tiles last first (dispatch_v5_rev_h200_88bebc9.json)
        return V5Config(tile=2048, count_warps=4, scatter_warps=4, reverse=True)
    if world_size < 256:
        return small_rev
    return dataclasses.replace(big, snaps="int16")  # session 47: from W = 256


@functools.cache
def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` of a CUDA device (cached: one driver query per
    card and process)."""
    return torch.cuda.get_device_name(device)


TABLE_ENV = "FREESCALE_V5_TABLE"
TABLE_CARDS = {
    "H100": "NVIDIA H100 (FREESCALE_V5_TABLE)",
    "H200": "NVIDIA H200 (FREESCALE_V5_TABLE)",
}


def table_name(card: Optional[str]) -> Optional[str]:
    """The card name `default_config_v5` picks its table by: `card` (the tensors' card),
    unless ``FREESCALE_V5_TABLE`` is "H100" or "H200" (the tables differ below W = 256,
    since session 47).
    That override is a benchmark knob: one GPU call can time the other card's table next
    to the A/B that decides whether to adopt it (`benchmarks/kernels.py` records it).
    Same bits either way."""
    forced = os.environ.get(TABLE_ENV, "")
    if not forced:
        return card
    if forced not in TABLE_CARDS:
        raise ValueError(
            f"{TABLE_ENV} must be one of {tuple(TABLE_CARDS)} or unset, got {forced!r}"
        )
    return TABLE_CARDS[forced]


SCATTERS = ("staged", "ranks", "atomic")
COUNTS = ("rows", "columns")
SLOTS = ("dest", "pos")
DESTS = ("recompute", "stored")
STAGINGS = ("int64", "int32")
SNAPS = {"int32": torch.int32, "int16": torch.int16}


def scatter_smem_bytes(cfg: V5Config, world_size: int, pos: Optional[bool] = None) -> int:
    """Shared memory the scatter program reserves (the count program's is W * 4): per id
    12 bytes (staged: value, input dest, slot dest; ranks: value, rank, slot dest), 14
    where the slots hold int32 positions (`pos`; default: ``cfg.slots == "pos"``); the
    atomic scatter 16 (value, rank, input index, slot dest, input dest), less 4 with
    int32 staging, one row of W + 1 counters and its LONG flag (`_atomic_tile`)."""
    if cfg.scatter == "atomic":  # VAL, LI, DSLOT, UR, DEST; a row of W + 1; LONG
        per_id = 16 - (4 if _v32(cfg) else 0)
        row = (world_size + 4) // 4 * 4
        return cfg.tile * per_id + world_size * 8 + row * 2 + cfg.scatter_warps * 4 + 4
    pos = cfg.slots == "pos" if pos is None else pos
    wc_words = cfg.scatter_warps * ((world_size + 3) // 4 * 4) // 2
    per_id = (14 if pos else 12) + (2 if _stored_dests(cfg) else 0) - (4 if _v32(cfg) else 0)
    return cfg.tile * per_id + world_size * 8 + wc_words * 4 + cfg.scatter_warps * 4


def atomic_rank_warps(cfg: V5Config, world_size: int) -> int:
    """How many warps rank a LONG tile of the atomic scatter in input order (see
    `_atomic_tile`): the most, up to ``scatter_warps`` and halving, whose uint16 counter
    rows of W (rounded up to 4) fit in the tile's VAL, LI and DSLOT bytes; 1 where not
    even two fit (warp 0 then ranks the whole tile on the tile's row of starts)."""
    free = cfg.tile * ((4 if _v32(cfg) else 8) + 4)
    row = (world_size + 3) // 4 * 4 * 2
    k = cfg.scatter_warps
    while k > 1 and k * row > free:
        k //= 2
    return k


def _stored_dests(cfg: V5Config) -> bool:
    return cfg.scatter == "ranks" and cfg.dests == "stored"


def _narrow(cfg: V5Config, modulo: bool) -> bool:
    """Whether the kernels take the 32-bit path on tiles that allow it (block mode only:
    modulo mode's owner and row are a mask and a shift at a power-of-two W already)."""
    return cfg.narrow and not modulo


def _v32(cfg: V5Config) -> bool:
    return cfg.scatter in ("ranks", "atomic") and cfg.staging == "int32"


def _scatter_kernel(cfg: V5Config):
    return {"ranks": _v5_scatter_ranks_kernel, "atomic": _v5_scatter_atomic_kernel}.get(
        cfg.scatter, _v5_scatter_kernel
    )


def _scatter_meta(cfg: V5Config, world_size: int, modulo: bool, pos: bool, bufs) -> dict:
    """The scatter kernel's constexprs (the ranks kernel also takes DST; the atomic one
    takes V32 and PREFETCH, no POS)."""
    meta = {"WORLD": world_size, "MODULO": modulo, "TILE": cfg.tile, "NW": cfg.scatter_warps,
            "U": cfg.unroll, "B0": bufs[0], "B1": bufs[1], "B2": bufs[2],
            "B3": bufs[3], "REV": cfg.reverse}  # fmt: skip
    if cfg.scatter == "atomic":
        return {**meta, "V32": _v32(cfg), "PREFETCH": cfg.prefetch, "RUNMAX": cfg.run_limit,
                "KR": atomic_rank_warps(cfg, world_size)}  # fmt: skip
    meta["POS"] = pos
    if cfg.scatter == "ranks":
        meta["DST"] = _stored_dests(cfg)
        meta["V32"] = _v32(cfg)
        meta["AHEAD"] = cfg.ahead
        meta["PREFETCH"] = cfg.prefetch
        meta["NARROW"] = _narrow(cfg, modulo)
        meta["L2PF"] = cfg.l2_prefetch
        meta["L2AH"] = cfg.l2_ahead
        meta["SKIP"] = cfg.diag_skip
    return meta


def check_config(cfg: V5Config) -> None:
    """Raise ValueError for knobs the kernels do not take."""
    t = cfg.tile
    if t & (t - 1) or not 256 <= t <= 16384:
        raise ValueError(f"tile must be a power of two in [256, 16384], got {t}")
    for name, nw in (("count_warps", cfg.count_warps), ("scatter_warps", cfg.scatter_warps)):
        if nw not in (1, 2, 4, 8, 16):
            raise ValueError(f"{name} must be 1, 2, 4, 8 or 16, got {nw}")
    if cfg.unroll not in (1, 2, 4, 8):
        raise ValueError(f"unroll must be 1, 2, 4 or 8, got {cfg.unroll}")
    if cfg.scatter not in SCATTERS:
        raise ValueError(f"scatter must be one of {SCATTERS}, got {cfg.scatter!r}")
    if cfg.scatter == "atomic":
        given = [f"{k}={getattr(cfg, k)!r}" for k, off in _ATOMIC_OFF.items()
                 if getattr(cfg, k) != off]  # fmt: skip
        if given:
            raise ValueError(
                f'scatter="atomic" takes tile, warps, unroll, staging, prefetch, counts, '
                f"snaps, reverse and run_limit only, got {', '.join(given)}"
            )
    rl = cfg.run_limit
    if not isinstance(rl, int) or isinstance(rl, bool) or not 0 <= rl <= 16384:
        raise ValueError(f"run_limit must be an int in [0, 16384], got {rl!r}")
    if rl != 64 and cfg.scatter != "atomic":
        raise ValueError(f'run_limit is an option of scatter="atomic", got {cfg.scatter!r}')
    if cfg.counts not in COUNTS:
        raise ValueError(f"counts must be one of {COUNTS}, got {cfg.counts!r}")
    if cfg.slots not in SLOTS:
        raise ValueError(f"slots must be one of {SLOTS}, got {cfg.slots!r}")
    if cfg.dests not in DESTS:
        raise ValueError(f"dests must be one of {DESTS}, got {cfg.dests!r}")
    if not isinstance(cfg.prefetch, bool):
        raise ValueError(f"prefetch must be True or False, got {cfg.prefetch!r}")
    if not isinstance(cfg.narrow, bool):
        raise ValueError(f"narrow must be True or False, got {cfg.narrow!r}")
    if not isinstance(cfg.l2_prefetch, bool):
        raise ValueError(f"l2_prefetch must be True or False, got {cfg.l2_prefetch!r}")
    if cfg.l2_prefetch and cfg.scatter != "ranks":
        raise ValueError(f'l2_prefetch=True is an option of scatter="ranks", got {cfg.scatter!r}')
    if not isinstance(cfg.l2_ahead, int) or isinstance(cfg.l2_ahead, bool) or cfg.l2_ahead < 0:
        raise ValueError(f"l2_ahead must be an int >= 0 (tiles ahead), got {cfg.l2_ahead!r}")
    if cfg.l2_ahead and cfg.scatter != "ranks":
        raise ValueError(f'l2_ahead > 0 is an option of scatter="ranks", got {cfg.scatter!r}')
    if not isinstance(cfg.reverse, bool):
        raise ValueError(f"reverse must be True or False, got {cfg.reverse!r}")
    if cfg.reverse and cfg.l2_ahead:
        raise ValueError("reverse=True and l2_ahead > 0 do not combine (l2_ahead looks forward)")
    if cfg.diag_skip not in (0, 1, 2, 3) or isinstance(cfg.diag_skip, bool):
        raise ValueError(f"diag_skip must be 0, 1, 2 or 3, got {cfg.diag_skip!r}")
    if cfg.diag_skip and cfg.scatter != "ranks":
        raise ValueError(f'diag_skip > 0 is an option of scatter="ranks", got {cfg.scatter!r}')
    if cfg.narrow and cfg.scatter != "ranks":
        raise ValueError(f'narrow=True is an option of scatter="ranks", got {cfg.scatter!r}')
    if cfg.ahead not in (2, 4):
        raise ValueError(f"ahead must be 2 or 4, got {cfg.ahead}")
    if cfg.snaps not in SNAPS:
        raise ValueError(f"snaps must be one of {tuple(SNAPS)}, got {cfg.snaps!r}")
    if cfg.staging not in STAGINGS:
        raise ValueError(f"staging must be one of {STAGINGS}, got {cfg.staging!r}")
    if cfg.staging == "int32" and cfg.scatter not in ("ranks", "atomic"):
        raise ValueError(
            f'staging="int32" is an option of scatter="ranks" or "atomic", got {cfg.scatter!r}'
        )
    if cfg.dests == "stored" and cfg.scatter != "ranks":
        raise ValueError(
            'dests="stored" is an option of scatter="ranks" (the staged scatter keeps its '
            f"dests in shared memory already), got scatter={cfg.scatter!r}"
        )
    if cfg.scatter == "ranks" and t < 32 * cfg.scatter_warps:
        raise ValueError(
            f'scatter="ranks" needs tile >= 32 * scatter_warps (a warp ranks whole chunks '
            f"of 32), got tile {t}, scatter_warps {cfg.scatter_warps}"
        )


_ATOMIC_OFF = {"slots": "dest", "dests": "recompute", "ahead": 2, "narrow": False,
               "l2_prefetch": False, "l2_ahead": 0, "diag_skip": 0}  # fmt: skip


def v5_supported(world_size: int, weights: Optional[torch.Tensor], cfg: V5Config) -> bool:
    """Inputs v5 handles: no weights, W <= V5_MAX_WORLD, a tile whose staging fits."""
    return (
        weights is None
        and 1 <= world_size <= V5_MAX_WORLD
        and scatter_smem_bytes(cfg, world_size) <= SMEM_LIMIT
    )


_CHECKED: set = set()
_SMEM_BASE = re.compile(r"@global_smem, i32 (\d+)\)")


def buffer_words(total_bytes: int, unit_words: int) -> tuple[int, int, int, int]:
    """The reserved buffers (int32 words, descending powers of two, zero-padded to four)
    covering `total_bytes` rounded up to a multiple of `unit_words` words (each buffer at
    least one unit: the keep-alive load reads a unit)."""
    words = -(-total_bytes // (4 * unit_words)) * unit_words
    parts = [1 << b for b in range(words.bit_length() - 1, -1, -1) if words >> b & 1]
    if len(parts) > 4:  # round up so that at most four parts remain
        top = parts[0]
        words = -(-words // (top >> 3)) * (top >> 3)
        parts = [1 << b for b in range(words.bit_length() - 1, -1, -1) if words >> b & 1]
    return tuple(parts + [0] * (4 - len(parts)))  # type: ignore[return-value]


def check_layout(compiled, buffers_bytes: list[int]) -> None:
    """The PTX accesses address the reserved buffers as one range from ``global_smem``.
    That holds when the kernel's shared memory is exactly the buffers (no Triton op of
    the kernel asked for scratch) and the allocator put them largest first, back to back
    (each later buffer's base appears in the LLVM IR); raise otherwise."""
    shared = compiled.metadata.shared
    name = compiled.metadata.name
    if shared != sum(buffers_bytes):
        raise RuntimeError(
            f"{name}: shared memory {shared} bytes, reserved buffers {buffers_bytes}: some "
            "op needs scratch, the buffers may not start at offset 0"
        )
    expected = {sum(buffers_bytes[:i]) for i in range(1, len(buffers_bytes))}
    found = {int(x) for x in _SMEM_BASE.findall(compiled.asm["llir"])} - {0}
    if found != expected:
        raise RuntimeError(
            f"{name}: reserved buffers {buffers_bytes} placed at {sorted(found)}, expected "
            f"{sorted(expected)} (largest first, back to back)"
        )


def _launch(kernel, grid: tuple, args: tuple, meta: dict, buffers_bytes: list[int]) -> None:
    """Launch a v5 kernel; the first launch of each compiled variant checks its shared
    memory layout (`check_layout`)."""
    compiled = kernel[grid](*args, **meta)
    key = (id(kernel), tuple(sorted(meta.items())))
    if key not in _CHECKED:
        check_layout(compiled, buffers_bytes)
        _CHECKED.add(key)


def compile_v5(
    world_size: int,
    cfg: V5Config,
    *,
    modulo: bool = False,
    values_dtype: torch.dtype = torch.int64,
    arch: int = 90,
) -> dict:
    """Compile both v5 kernels ahead of time for an NVIDIA target (no GPU needed: Triton
    runs ptxas) and check their shared-memory layouts (`check_layout`); returns
    {"count": compiled, "scatter": compiled}. Used by the CPU tests, which cannot run
    Gluon kernels."""
    from triton.backends.compiler import GPUTarget

    vt = {torch.int32: "*i32", torch.int64: "*i64"}[values_dtype]
    wp = max(2, next_power_of_2(world_size))
    target = GPUTarget("cuda", arch, 32)

    def build(fn, sig: dict, const: dict, warps: int):
        src = gluon._runtime.GluonASTSource(
            fn, signature={**sig, **dict.fromkeys(const, "constexpr")}, constexprs=const
        )
        return triton.compile(src, target=target, options={"num_warps": warps})

    i64 = "*i64"
    table = {"tile_key_ptr": "*i32", "tile_start_ptr": i64, "tile_end_ptr": i64}
    cw, sw = cfg.count_warps, cfg.scatter_warps
    count_words = max(wp, cw * 32)
    count = build(
        _v5_count_kernel,
        {"values_ptr": vt, "block_sizes_ptr": vt, "seg_offsets_ptr": i64, **table,
         "tile_seg_lo_ptr": i64, "tile_seg_hi_ptr": i64, "counts_ptr": "*i32",
         "snaps_ptr": "*i16" if cfg.snaps == "int16" else "*i32", "seg_tile_ptr": "*i32",
         "num_tiles": "i32"},
        {"WORLD": world_size, "MODULO": modulo, "NW": cw, "WP": count_words, "U": cfg.unroll,
         "COLUMNS": cfg.counts == "columns", "NARROW": _narrow(cfg, modulo)},
        cw,
    )  # fmt: skip
    check_layout(count, [count_words * 4])
    bufs = buffer_words(scatter_smem_bytes(cfg, world_size), sw * 32)
    check_config(cfg)
    scatter = build(
        _scatter_kernel(cfg),
        {"values_ptr": vt, "block_sizes_ptr": vt, **table, "et_ptr": "*i32",
         "out_values_ptr": vt, "perm_ptr": i64},
        _scatter_meta(cfg, world_size, modulo, cfg.slots == "pos", bufs),
        sw,
    )  # fmt: skip
    check_layout(scatter, [4 * b for b in bufs if b])
    return {"count": count, "scatter": scatter}


def ranged_dispatch_v5(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: str = "block",
    weights: Optional[torch.Tensor] = None,
    config: Optional[V5Config] = None,
) -> DispatchResult:
    """Gluon `ranged_dispatch`, v5 (see the module docstring; CUDA only); same semantics
    and results as `reference.ranged_dispatch` for the inputs `v5_supported` accepts."""
    num_keys, batch = check_dispatch_inputs(values, lengths, block_sizes, world_size, mode, weights)
    card = device_name(values.device) if values.device.type == "cuda" else None
    cfg = config or default_config_v5(world_size, table_name(card))
    check_config(cfg)
    t = cfg.tile
    if not v5_supported(world_size, weights, cfg):
        raise ValueError(
            f"ranged_dispatch_v5 supports no weights, world_size <= {V5_MAX_WORLD} and "
            f"{scatter_smem_bytes(cfg, world_size)} <= {SMEM_LIMIT} bytes of staging "
            f"(world_size {world_size}, tile {cfg.tile}, weights {weights is not None})"
        )
    n, nseg, dev = values.numel(), num_keys * batch, values.device
    if dev.type != "cuda":
        raise ValueError(f"ranged_dispatch_v5 runs on CUDA tensors only, got {dev}")
    if n == 0:
        return reference.ranged_dispatch(values, lengths, block_sizes, world_size, mode=mode)
    values, lengths = values.contiguous(), lengths.contiguous()
    block_sizes = block_sizes.contiguous()
    modulo = mode == "modulo"
    wp = max(2, next_power_of_2(world_size))

    num_tiles = n // t + num_keys
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    tw = num_tiles * world_size
    seg_offsets, key_tile_first, tile_start, tile_end, tile_seg_lo, tile_seg_hi = _carve(
        torch.int64, dev, nseg + 1, num_keys + 1, *(num_tiles,) * 4
    )
    et_here = (tw,) if index_dtype == torch.int32 else ()
    snap_words = nseg * world_size
    if cfg.snaps == "int16":  # two snapshot counters per int32 word of the carve
        snap_words = (snap_words + 1) // 2
    tile_key, counts, snaps, seg_tile, *et = _carve(
        torch.int32, dev, num_tiles, tw, snap_words, nseg, *et_here
    )
    counts = counts[:tw]
    if cfg.snaps == "int16":
        snaps = snaps.view(torch.int16)

    # 1-2. v4's segment offsets and tile table
    table = (tile_key, tile_start, tile_end, tile_seg_lo, tile_seg_hi)
    launch_tables(lengths, seg_offsets, key_tile_first, table, num_keys, batch, num_tiles, t)

    # 3. per-(dest, tile) counts and per-segment counter snapshots (shared counters)
    cw = cfg.count_warps
    _launch(
        _v5_count_kernel,
        (num_tiles,),
        (values, block_sizes, seg_offsets, tile_key, tile_start, tile_end, tile_seg_lo,
         tile_seg_hi, counts, snaps, seg_tile, num_tiles),
        {"WORLD": world_size, "MODULO": modulo, "NW": cw, "WP": max(wp, cw * 32),
         "U": cfg.unroll, "COLUMNS": cfg.counts == "columns", "NARROW": _narrow(cfg, modulo),
         "num_warps": cw},
        [max(wp, cw * 32) * 4],
    )  # fmt: skip

    # 4-5. v4's scan over [dest][tile] (counts="columns": as the count kernel stored them;
    # "rows": its [tile][dest] rows transposed) and finish pass: et rows, lengths, splits,
    # key counts
    if cfg.counts == "columns":
        scan = torch.cumsum(counts, 0, dtype=index_dtype)
    else:
        scan = torch.cumsum(transpose_2d(counts.view(num_tiles, world_size)).view(-1), 0,
                            dtype=index_dtype)  # fmt: skip
    et = et[0] if et else torch.empty(tw, dtype=index_dtype, device=dev)
    new_lengths = torch.empty(world_size * nseg, dtype=lengths.dtype, device=dev)
    splits = torch.empty(world_size, dtype=torch.int64, device=dev)
    key_counts = torch.empty((world_size, num_keys), dtype=torch.int64, device=dev)
    launch_finish_rows(scan, snaps, seg_tile, key_tile_first, et, new_lengths, splits,
                       key_counts, num_tiles, nseg, num_keys, world_size,
                       cfg.finish_block)  # fmt: skip

    # 6. scatter through shared staging
    out_values = torch.empty_like(values)
    perm = torch.empty(n, dtype=torch.int64, device=dev)
    sw = cfg.scatter_warps
    pos = cfg.slots == "pos" and index_dtype == torch.int32  # positions fit int32
    bufs = buffer_words(scatter_smem_bytes(cfg, world_size, pos), sw * 32)
    _launch(
        _scatter_kernel(cfg),
        (num_tiles,),
        (values, block_sizes, tile_key, tile_start, tile_end, et, out_values, perm),
        {**_scatter_meta(cfg, world_size, modulo, pos, bufs), "num_warps": sw},
        [4 * b for b in bufs if b],
    )  # fmt: skip
    return DispatchResult(
        values=out_values,
        lengths=new_lengths,
        splits=splits,
        key_counts=key_counts,
        unbucketize_permute=perm,
        weights=None,
    )
