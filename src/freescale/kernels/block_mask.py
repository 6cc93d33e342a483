"""Triton fast path of the model's document-causal flex-attention block mask.

Owns the two kernels that build every index table of
`models.sequence.document_causal_block_mask` from the samples' token lengths, in three
launches (one ``cumsum``, two kernels) instead of the ~90 small PyTorch ops of the
reference (`models.sequence.block_mask_tables_reference`, which *is* the semantics).
One forward builds the mask once, on the host's critical path of a host-bound step:
each op is a CUDA launch, and the profiler adds microseconds to each.

Semantics, with ``ends = cumsum(lengths)`` (int64), ``t = ends[-1]`` tokens padded to
``tp`` (a multiple of ``block``), ``nb = tp // block``:

* ``doc(p)`` = the number of ``ends`` <= p (the sample holding token p; empty samples are
  skipped), for p < t; the mask's ``docm[p]`` is ``doc(p)``, or ``-1 - (p - t)`` for a
  padding token (it attends only to itself);
* ``start(p)`` = ``ends[doc(p) - 1]`` (0 for the first sample) for p < t, ``p`` for
  padding;
* per query block i: ``pstart = start(i * block) // block``, ``fstart = min(ceil(
  start(i * block + block - 1) / block), i)``; the kv tables and the query-side tables
  follow from these two non-decreasing bounds exactly as in the reference (the formulas
  are repeated below term for term).

Integer-only, so "identical semantics" means equal tensors (tests compare every table on
fresh random lengths in the interpreter; ``benchmarks/check_kernels_cuda.py`` on a GPU).
On CPU tensors this module needs ``TRITON_INTERPRET=1`` set before triton is first
imported (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale.kernels.common import cdiv, next_power_of_2

__all__ = ["block_mask_tables_triton", "TOKENS_PER_PROGRAM"]

TOKENS_PER_PROGRAM = 1024  # kernel 1: tokens (and their query blocks) per program
_MAX_COLS = 1024  # kernel 2: table columns per program


@triton.jit
def _count_le(arr_ptr, n, q, LOG: tl.constexpr):
    """The number of entries <= q of the sorted ``arr[0:n]`` (``searchsorted(arr, q,
    right=True)``) for every element of the vector ``q``: binary lifting with steps
    2^(LOG-1) .. 1, where 2^LOG > n."""
    pos = tl.zeros_like(q)
    for k in tl.static_range(LOG):
        cand = pos + (1 << (LOG - 1 - k))
        ok = cand <= n
        v = tl.load(arr_ptr + cand - 1, mask=ok, other=0)
        pos = tl.where(ok & (v <= q), cand, pos)
    return pos


@triton.jit(do_not_specialize=["nsamp", "t", "tp", "nb"])
def _doc_bounds_kernel(
    ends_ptr,
    docm_ptr,
    bounds_ptr,
    nsamp,
    t,
    tp,
    nb,
    LOG_B: tl.constexpr,
    BLOCK: tl.constexpr,
    BT: tl.constexpr,
):
    """Program p: ``docm`` of tokens [p * BT, (p + 1) * BT) and (pstart, fstart) of their
    query blocks (``bounds[0:nb]``, ``bounds[nb:2nb]``, int32)."""
    pid = tl.program_id(0).to(tl.int64)
    tok = pid * BT + tl.arange(0, BT)
    d = _count_le(ends_ptr, nsamp, tok, LOG_B)
    tl.store(docm_ptr + tok, tl.where(tok < t, d, -1 - (tok - t)), mask=tok < tp)

    rows = pid * (BT // BLOCK) + tl.arange(0, BT // BLOCK)
    rmask = rows < nb
    first = rows * BLOCK
    last = first + (BLOCK - 1)
    d_first = _count_le(ends_ptr, nsamp, first, LOG_B)
    d_last = _count_le(ends_ptr, nsamp, last, LOG_B)
    s_first = tl.load(ends_ptr + d_first - 1, mask=rmask & (d_first > 0), other=0)
    s_last = tl.load(ends_ptr + d_last - 1, mask=rmask & (d_last > 0), other=0)
    s_first = tl.where(first < t, s_first, first)
    s_last = tl.where(last < t, s_last, last)
    pstart = s_first // BLOCK
    fstart = tl.minimum((s_last + BLOCK - 1) // BLOCK, rows)
    tl.store(bounds_ptr + rows, pstart.to(tl.int32), mask=rmask)
    tl.store(bounds_ptr + nb + rows, fstart.to(tl.int32), mask=rmask)


@triton.jit(do_not_specialize=["nb"])
def _tables_kernel(
    bounds_ptr,
    kv_num_ptr,
    kv_idx_ptr,
    fkv_num_ptr,
    fkv_idx_ptr,
    q_num_ptr,
    q_idx_ptr,
    fq_num_ptr,
    fq_idx_ptr,
    nb,
    LOG_NB: tl.constexpr,
    BJ: tl.constexpr,
):
    """Program (i, c): columns [c * BJ, (c + 1) * BJ) of row i of the four [nb, nb]
    int32 tables (kv partial, kv full, q partial, q full); program (i, 0) also writes
    row i's four counts."""
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64) * BJ + tl.arange(0, BJ)
    jm = j < nb
    ps = tl.load(bounds_ptr + i).to(tl.int64)
    fs = tl.load(bounds_ptr + nb + i).to(tl.int64)
    # kv side of query block i: partial [ps, fs) then i, full [fs, i) (reference order)
    n_part = fs - ps + 1
    part = tl.minimum(tl.where(j == n_part - 1, i, ps + j), nb - 1)
    full = tl.minimum(fs + j, nb - 1)
    # q side of kv block c = i (`_transposed_blocks`, term for term); the searches run
    # on a vector of equal queries (every lane loads the same entries)
    c = i + 0 * j
    bounds32 = bounds_ptr  # pstart, then fstart: int32, compared as int64 below
    a = _count_le(bounds32 + nb, nb, c.to(tl.int32), LOG_NB).to(tl.int64)
    b = _count_le(bounds32, nb, c.to(tl.int32), LOG_NB).to(tl.int64) - 1
    r = tl.maximum(b - a + 1, 0)
    a2 = tl.where(r > 0, a, nb)
    b2 = tl.where(r > 0, b, nb - 1)
    k = j - 1 - r
    second = a2 - 1 - c
    rest = tl.where(k < c, k, tl.where(k - c < second, c + 1 + (k - c), b2 + 1 + (k - c - second)))
    qpart = tl.where(j == 0, c, tl.where(j <= r, a + j - 1, rest))
    rf = a - 1 - c
    k2 = j - rf
    qfull = tl.where(j < rf, c + 1 + j, tl.where(k2 <= c, k2, a + (k2 - c - 1)))

    at = i * nb + j  # int64: no overflow for any nb
    tl.store(kv_idx_ptr + at, part.to(tl.int32), mask=jm)
    tl.store(fkv_idx_ptr + at, full.to(tl.int32), mask=jm)
    tl.store(q_idx_ptr + at, qpart.to(tl.int32), mask=jm)
    tl.store(fq_idx_ptr + at, qfull.to(tl.int32), mask=jm)
    lane0 = j == 0  # program (i, 0), lane 0: row i's counts
    zero = 0 * j
    tl.store(kv_num_ptr + i + zero, (n_part + zero).to(tl.int32), mask=lane0)
    tl.store(fkv_num_ptr + i + zero, (i - fs + zero).to(tl.int32), mask=lane0)
    tl.store(q_num_ptr + i + zero, (1 + r).to(tl.int32), mask=lane0)
    tl.store(fq_num_ptr + i + zero, rf.to(tl.int32), mask=lane0)


def _search_steps(n: int) -> int:
    """Binary-lifting steps for a sorted array of ``n`` entries: the bit length of n,
    rounded up to a multiple of 4 (a constexpr: few compiled variants; extra steps only
    test candidates past the end)."""
    return max(4, -(-n.bit_length() // 4) * 4)


def block_mask_tables_triton(
    lengths: torch.Tensor, tp: int, total: int, block: int
) -> tuple[torch.Tensor, ...]:
    """The tables of `models.sequence.block_mask_tables_reference` (same order, dtypes and
    shapes): ``docm`` [tp] int64, then kv_num [1, 1, nb], kv_idx [1, 1, nb, nb], full
    kv_num, full kv_idx, q_num, q_idx, full q_num, full q_idx (int32). ``total`` is
    ``sum(lengths)`` (<= ``tp``; not checked: that would read it back from the device).
    ``block`` must be a power of two dividing ``tp``, at most `TOKENS_PER_PROGRAM`."""
    if block < 1 or block & (block - 1) or block > TOKENS_PER_PROGRAM or tp <= 0 or tp % block:
        raise ValueError(
            f"block mask tables: block {block} must be a power of two <= "
            f"{TOKENS_PER_PROGRAM} dividing the padded token count {tp} (> 0)"
        )
    if not 0 <= total <= tp:
        raise ValueError(f"block mask tables: token count {total} not in [0, {tp}]")
    dev = lengths.device
    nsamp = lengths.numel()
    nb = tp // block
    ends = torch.cumsum(lengths, 0, dtype=torch.int64)
    docm = torch.empty(tp, dtype=torch.int64, device=dev)
    bounds = torch.empty(2 * nb, dtype=torch.int32, device=dev)  # pstart, fstart
    _doc_bounds_kernel[(cdiv(tp, TOKENS_PER_PROGRAM),)](
        ends, docm, bounds, nsamp, total, tp, nb,
        LOG_B=_search_steps(nsamp), BLOCK=block, BT=TOKENS_PER_PROGRAM,
    )  # fmt: skip
    # separate allocations, as the reference's: views into one buffer would carry
    # storage offsets that change with nb into the compiled flex-attention call
    nums = [torch.empty(1, 1, nb, dtype=torch.int32, device=dev) for _ in range(4)]
    idxs = [torch.empty(1, 1, nb, nb, dtype=torch.int32, device=dev) for _ in range(4)]
    bj = min(_MAX_COLS, next_power_of_2(nb))
    _tables_kernel[(nb, cdiv(nb, bj))](
        bounds, nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3], nb,
        LOG_NB=_search_steps(nb), BJ=bj,
    )  # fmt: skip
    return (docm, nums[0], idxs[0], nums[1], idxs[1], nums[2], idxs[2], nums[3], idxs[3])
