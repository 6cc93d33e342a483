"""Sample-to-rank partitioners of the sequence load balancer (the *balancer* role).

Owns: :class:`Assignment` (sample -> rank map plus, per rank, its samples in ascending
global order), the partition functions ``identity``, ``fbs``, ``vbs`` and ``kk`` (and ``shuffle``, a
diagnostic that ignores costs), the
:class:`Partitioner` protocol with its name registry, :func:`lower_bound` and
:func:`straggler_share`.

Every partitioner is a *pure, deterministic* function of the global per-sample cost
vector (``L ** alpha`` or a fitted cost model's per-sample cost) and the world size:
all ranks call it on the same gathered list and get the same answer, with no
communication. Ties are broken by global sample index only (never by an unstable
sort or by the platform's SIMD sort), so plans are canonical. This module sees
metadata only: it never touches tensors, ranks or communicators.

Optional ``sort_key``: an integer array whose order equals the order of ``costs``
(e.g. the per-sample lengths when costs are a non-decreasing function of length).
FBS and VBS sort by it when given ("sort by length"; it is also the fastest exact
path); costs then only provide the weights.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

__all__ = [
    "Assignment",
    "Partitioner",
    "PARTITIONERS",
    "register_partitioner",
    "get_partitioner",
    "identity",
    "fbs",
    "vbs",
    "kk",
    "shuffle",
    "lower_bound",
    "straggler_share",
    "canonical_order",
]


# --------------------------------------------------------------------------- types
@dataclass(frozen=True, eq=False)
class Assignment:
    """A sample-to-rank map over ``N`` samples and ``W`` ranks.

    * ``rank_of[i]``: the rank sample ``i`` goes to (int64, ``N``);
    * ``order``: all samples grouped by rank, ascending global index inside a rank
      (int64, ``N``); rank ``r`` holds ``order[offsets[r]:offsets[r + 1]]``;
    * ``offsets``: ``W + 1`` int64 boundaries into ``order``.
    """

    rank_of: np.ndarray
    order: np.ndarray
    offsets: np.ndarray
    _per_rank: list[np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def num_samples(self) -> int:
        return int(self.rank_of.size)

    @property
    def counts(self) -> np.ndarray:
        """Samples per rank (int64, ``W``)."""
        return np.diff(self.offsets)

    def samples_of(self, rank: int) -> np.ndarray:
        """Global indices held by ``rank``, ascending."""
        return self.order[self.offsets[rank] : self.offsets[rank + 1]]

    @property
    def per_rank(self) -> list[np.ndarray]:
        """Per-rank ordered sample lists (views into ``order``; built on first use)."""
        if self._per_rank is None:
            lists = [self.samples_of(r) for r in range(self.world_size)]
            object.__setattr__(self, "_per_rank", lists)
        return self._per_rank  # type: ignore[return-value]

    def rank_sums(self, values: np.ndarray) -> np.ndarray:
        """Per-rank sum of a per-sample quantity (float64, ``W``)."""
        return np.bincount(
            self.rank_of, weights=np.asarray(values, dtype=np.float64), minlength=self.world_size
        )

    def equals(self, other: Assignment) -> bool:
        return self.world_size == other.world_size and np.array_equal(self.rank_of, other.rank_of)

    @staticmethod
    def from_ranks(rank_of: np.ndarray, world_size: int) -> Assignment:
        """Build the canonical per-rank lists from a rank-per-sample array."""
        rank_of = np.ascontiguousarray(rank_of, dtype=np.int64)
        n = rank_of.size
        if n and (rank_of.min() < 0 or rank_of.max() >= world_size):
            raise ValueError(f"rank_of must lie in [0, {world_size}), got a value out of range")
        counts = np.bincount(rank_of, minlength=world_size)
        offsets = np.zeros(world_size + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        bits = max(int(n).bit_length(), 1)
        if int(world_size).bit_length() + bits <= 62:
            # unique keys: any (fast, SIMD) sort gives the one canonical order
            order = _pack_sort(rank_of.copy(), _arange(n), bits)
            order &= (1 << bits) - 1
        else:  # pragma: no cover - astronomically large N * W
            order = np.argsort(rank_of, kind="stable").astype(np.int64)
        return Assignment(rank_of=rank_of, order=order, offsets=offsets)

    @staticmethod
    def contiguous(counts: np.ndarray | list[int]) -> Assignment:
        """Rank ``r`` takes the next ``counts[r]`` samples (vanilla placement)."""
        counts = np.asarray(counts, dtype=np.int64)
        w = counts.size
        offsets = np.zeros(w + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        rank_of = np.repeat(np.arange(w, dtype=np.int64), counts)
        order = np.arange(int(offsets[-1]), dtype=np.int64)
        return Assignment(rank_of=rank_of, order=order, offsets=offsets)


class Partitioner(Protocol):
    """``(costs, world_size, *, sort_key=None) -> Assignment``; pure and deterministic."""

    def __call__(
        self, costs: np.ndarray, world_size: int, *, sort_key: np.ndarray | None = None
    ) -> Assignment: ...


# ----------------------------------------------------------------- canonical sorts
_ARANGE: dict[int, np.ndarray] = {}


def _arange(n: int) -> np.ndarray:
    """A cached read-only ``arange(n)`` (int64): fresh large arrays cost page faults."""
    a = _ARANGE.get(n)
    if a is None:
        a = np.arange(n, dtype=np.int64)
        a.setflags(write=False)
        if len(_ARANGE) > 16:
            _ARANGE.clear()
        _ARANGE[n] = a
    return a


def _pack_sort(high: np.ndarray, low: np.ndarray, bits: int) -> np.ndarray:
    """Sort unique packed keys ``high << bits | low`` and return them (sorted, packed).
    ``high`` is consumed (modified in place) when it is already an int64 temporary."""
    high <<= bits
    high |= low
    high.sort()
    return high


def _check(costs: np.ndarray, world_size: int) -> np.ndarray:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    c = np.asarray(costs)
    if c.ndim != 1:
        raise ValueError(f"costs must be one-dimensional, got shape {c.shape}")
    if c.dtype.kind == "f":
        if c.size and not (np.isfinite(c).all() and c.min() >= 0):
            raise ValueError("costs must be finite and non-negative")
    elif c.dtype.kind in "iu":
        if c.size and c.min() < 0:
            raise ValueError("costs must be non-negative")
    else:
        raise TypeError(f"costs must be a numeric array, got dtype {c.dtype}")
    return c


def canonical_order(key: np.ndarray, descending: bool = False) -> np.ndarray:
    """Indices sorting ``key`` (ascending or descending); ties by ascending index.

    Integer keys: one sort of unique packed ``(key, index)`` int64 values (exact, and
    any sort algorithm returns the same answer). Float keys: a SIMD argsort, then
    ties repaired by the same packing over the dense rank of each value.
    """
    key = np.asarray(key)
    n = key.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    bits = max(int(n).bit_length(), 1)
    if key.dtype.kind in "iub":
        lo, hi = int(key.min()), int(key.max())
        if (hi - lo).bit_length() + bits <= 62:
            if descending:
                k = np.subtract(hi, key, dtype=np.int64)
            else:
                k = np.subtract(key, lo, dtype=np.int64)
            k = _pack_sort(k, _arange(n), bits)
            k &= (1 << bits) - 1
            return k
        key = key.astype(np.float64)  # huge range: fall through to the float path
    f = -key.astype(np.float64) if descending else key.astype(np.float64)
    perm = np.argsort(f).astype(np.int64)  # unstable, fast; ties repaired below
    sv = f[perm]
    new_run = sv[1:] != sv[:-1]
    if new_run.all():
        return perm
    dense = np.zeros(n, dtype=np.int64)
    np.cumsum(new_run, out=dense[1:])
    dense = _pack_sort(dense, perm, bits)
    dense &= (1 << bits) - 1
    return dense


def lower_bound(costs: np.ndarray, world_size: int) -> float:
    """No partition beats ``max(max(costs), sum(costs) / W)`` (per-rank constants aside)."""
    c = np.asarray(costs, dtype=np.float64)
    if c.size == 0:
        return 0.0
    return float(max(c.max(), c.sum() / world_size))


def straggler_share(rank_costs: np.ndarray) -> float:
    """``(max - mean) / max`` over ranks; 0 for an all-zero vector."""
    r = np.asarray(rank_costs, dtype=np.float64)
    m = float(r.max()) if r.size else 0.0
    return 0.0 if m <= 0 else float((m - r.mean()) / m)


# -------------------------------------------------------------------- partitioners
def identity(
    costs: np.ndarray,
    world_size: int,
    *,
    sort_key: np.ndarray | None = None,
    counts: np.ndarray | list[int] | None = None,
) -> Assignment:
    """Vanilla placement: contiguous runs of ``N / W`` samples (``counts`` if given;
    without it the first ``N mod W`` ranks take one extra sample). O(N)."""
    c = _check(costs, world_size)
    n = c.size
    if counts is None:
        base, extra = divmod(n, world_size)
        counts = np.full(world_size, base, dtype=np.int64)
        counts[:extra] += 1
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size != world_size or int(counts.sum()) != n or (counts < 0).any():
        raise ValueError(f"identity: counts {counts.tolist()} do not split {n} samples")
    return Assignment.contiguous(counts)


def fbs(costs: np.ndarray, world_size: int, *, sort_key: np.ndarray | None = None) -> Assignment:
    """Fixed batch size: sort by cost descending (index breaks ties) and deal zig-zag:
    rank ``i`` takes sorted positions ``i, 2W-1-i, 2W+i, 4W-1-i, ...``. Counts are equal
    (differ by at most one when ``W`` does not divide ``N``). O(N log N)."""
    c = _check(costs, world_size)
    n = c.size
    desc = canonical_order(c if sort_key is None else sort_key, descending=True)
    if n % world_size == 0:
        # rows of the [G, W] deal table; odd rows reversed = zig-zag; columns = ranks
        g = n // world_size
        table = desc.reshape(g, world_size)
        table[1::2] = table[1::2, ::-1].copy()
        order = np.ascontiguousarray(table.T)
        order.sort(axis=1)  # ascending global index inside each rank
        rank_of = np.empty(n, dtype=np.int64)
        rank_of[order] = _arange(world_size)[:, None]
        offsets = _arange(world_size + 1) * g
        return Assignment(rank_of=rank_of, order=order.reshape(-1), offsets=offsets)
    rnd, j = np.divmod(_arange(n), world_size)
    snake = np.where(rnd & 1, world_size - 1 - j, j)
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[desc] = snake
    return Assignment.from_ranks(rank_of, world_size)


def vbs(costs: np.ndarray, world_size: int, *, sort_key: np.ndarray | None = None) -> Assignment:
    """Variable batch size: sort ascending (by ``sort_key`` if given, else cost; index
    breaks ties), then cut the sorted list into ``W`` contiguous runs of near-equal
    total weight: boundary ``k`` is the prefix position nearest to ``k * total / W``
    (the lower one on a tie). Each run's weight is within one sample weight of
    ``total / W``; counts vary; a rank may receive no sample. O(N log N)."""
    c = _check(costs, world_size)
    n = c.size
    asc = canonical_order(c if sort_key is None else sort_key, descending=False)
    prefix = np.empty(n + 1, dtype=np.float64)
    prefix[0] = 0.0
    np.take(c.astype(np.float64, copy=False), asc, out=prefix[1:])
    # torch's CPU scan is the same sequential left-to-right float64 sum as np.cumsum
    # (bitwise equal), about 5x faster
    torch.from_numpy(prefix[1:]).cumsum_(0)
    total = prefix[-1]
    targets = total * (np.arange(1, world_size, dtype=np.float64) / world_size)
    hi = np.searchsorted(prefix, targets, side="left")  # prefix[hi] >= target
    hi = np.clip(hi, 1, n) if n else hi
    lo = hi - 1
    if n:
        take_lo = (targets - prefix[lo]) <= (prefix[hi] - targets)
        cuts = np.where(take_lo, lo, hi)
    else:
        cuts = np.zeros(world_size - 1, dtype=np.int64)
    bounds = np.concatenate(([0], cuts, [n])).astype(np.int64)
    counts = np.diff(bounds)
    bits = max(int(n).bit_length(), 1)
    # ranks own contiguous runs of the sorted list; sort (rank, index) keys for the
    # ascending-index order inside each rank
    key = _pack_sort(np.repeat(_arange(world_size), counts), asc, bits)
    rank_of = np.empty(n, dtype=np.int64)
    order = np.bitwise_and(key, (1 << bits) - 1, out=asc)  # asc is no longer needed
    key >>= bits
    rank_of[order] = key
    return Assignment(rank_of=rank_of, order=order, offsets=bounds)


def kk(costs: np.ndarray, world_size: int, *, sort_key: np.ndarray | None = None) -> Assignment:
    """Equal-count Karmarkar-Karp (balanced largest differencing method).

    Samples sorted by cost descending are cut into ``G = ceil(N / W)`` chunks of ``W``
    consecutive samples; each chunk is a partial solution of ``W`` one-sample subsets.
    A heap repeatedly pops the two partial solutions with the largest spread
    (max - min subset sum) and merges them by pairing the heaviest subset of one with
    the lightest of the other, so every subset keeps exactly one sample per chunk: all
    ranks get ``N / W`` samples (``N mod W`` zero-cost phantoms pad the last chunk when
    ``W`` does not divide ``N``; counts then differ by at most one).

    Complexity: O(N log N) for the sort, ``G - 1`` merges of O(W log W) each
    (O(N log W) total) plus O(G log G) heap work; memory O(N). Merges only record
    parent links; subset membership is resolved once at the end, top down, in O(N).
    Subsets are numbered by their smallest global sample index (canonical).
    """
    c = _check(costs, world_size)
    n = c.size
    if world_size == 1 or n == 0:
        return identity(c, world_size)
    cf = c.astype(np.float64, copy=False)
    desc = canonical_order(cf if sort_key is None else sort_key, descending=True)
    w = world_size
    g = -(-n // w)
    pad = g * w - n
    items = np.concatenate((desc, np.arange(n, n + pad, dtype=np.int64)))
    vals = np.concatenate((cf[desc], np.zeros(pad))).reshape(g, w)
    # Node ids: 0 .. g*W-1 are the leaves (positions in `items`); merge m creates the W
    # nodes base_m .. base_m+W-1, base_m = (g + m) * W. A partial solution is
    # (subset sums sorted descending, node id of each subset).
    sols: dict[int, tuple[np.ndarray, np.ndarray]] = {
        k: (vals[k], np.arange(k * w, (k + 1) * w, dtype=np.int64)) for k in range(g)
    }
    spreads = (vals[:, 0] - vals[:, -1]).tolist()
    heap = [(-spreads[k], k) for k in range(g)]
    heapq.heapify(heap)
    merges: list[tuple[np.ndarray, np.ndarray]] = []
    next_sol = g
    while len(heap) > 1:
        a = heapq.heappop(heap)[1]
        b = heapq.heappop(heap)[1]
        sa, na = sols.pop(a)
        sb, nb = sols.pop(b)
        new_sums = sa + sb[::-1]  # heaviest of a with lightest of b
        merges.append((na, nb[::-1]))
        perm = np.argsort(new_sums, kind="stable")[::-1]
        sorted_sums = new_sums[perm]
        sols[next_sol] = (sorted_sums, perm + next_sol * w)
        heapq.heappush(heap, (-(float(sorted_sums[0]) - float(sorted_sums[-1])), next_sol))
        next_sol += 1
    (final_nodes,) = (nd for _, nd in sols.values())
    slot = np.empty(next_sol * w, dtype=np.int64)
    slot[final_nodes] = _arange(w)
    for m in range(len(merges) - 1, -1, -1):  # top down: a parent outlives its children
        a_nodes, b_nodes = merges[m]
        s = slot[(g + m) * w : (g + m + 1) * w]
        slot[a_nodes] = s
        slot[b_nodes] = s
    slot_of = np.empty(n + pad, dtype=np.int64)
    slot_of[items] = slot[: g * w]
    by_slot = Assignment.from_ranks(slot_of[:n], w)
    # canonical numbering: subsets ordered by their smallest sample index (empty last)
    slot_counts = by_slot.counts
    starts = np.where(slot_counts > 0, by_slot.order[np.minimum(by_slot.offsets[:-1], n - 1)], n)
    rank_to_slot = canonical_order(starts)
    slot_to_rank = np.empty(w, dtype=np.int64)
    slot_to_rank[rank_to_slot] = _arange(w)
    counts = slot_counts[rank_to_slot]
    offsets = np.zeros(w + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    src = np.repeat(by_slot.offsets[:-1][rank_to_slot] - offsets[:-1], counts)
    src += _arange(n)
    return Assignment(
        rank_of=slot_to_rank[by_slot.rank_of], order=by_slot.order[src], offsets=offsets
    )


def shuffle(
    costs: np.ndarray, world_size: int, *, sort_key: np.ndarray | None = None
) -> Assignment:
    """A diagnostic, not a balancer: equal counts (as ``identity``), samples dealt to
    ranks in a pseudo-random order that ignores costs, seeded by a hash of the global
    list's canonical order (``sort_key`` if given, else ``costs``), so every rank
    computes the same plan.
    Training with it is vanilla with samples legally moved across ranks: its distance
    to unbalanced training is the cross-rank noise floor of the tier-2 contract (what
    balancing's sample moves alone cost in float32), next to the in-rank floor of
    DESIGN.md section 1. O(N)."""
    c = _check(costs, world_size)
    n = c.size
    # seeded by the canonical order of the list: costs and an order-equal sort_key
    # give the same plan, as for the other partitioners
    order = np.ascontiguousarray(canonical_order(c if sort_key is None else sort_key))
    seed = int.from_bytes(hashlib.sha256(order.astype(np.int64).tobytes()).digest()[:8], "little")
    perm = np.random.default_rng(seed).permutation(n)
    base, extra = divmod(n, world_size)
    counts = np.full(world_size, base, dtype=np.int64)
    counts[:extra] += 1
    rank_of = np.empty(n, dtype=np.int64)
    rank_of[perm] = np.repeat(np.arange(world_size, dtype=np.int64), counts)
    return Assignment.from_ranks(rank_of, world_size)


# ------------------------------------------------------------------------ registry
PARTITIONERS: dict[str, Callable[..., Assignment]] = {
    "identity": identity,
    "fbs": fbs,
    "vbs": vbs,
    "kk": kk,
    "shuffle": shuffle,
}


def register_partitioner(name: str, fn: Callable[..., Assignment]) -> None:
    """Add a partitioner (it must follow the :class:`Partitioner` protocol)."""
    if name in PARTITIONERS:
        raise ValueError(f"partitioner '{name}' is already registered")
    PARTITIONERS[name] = fn


def get_partitioner(name: str) -> Callable[..., Assignment]:
    try:
        return PARTITIONERS[name]
    except KeyError:
        raise ValueError(
            f"unknown partitioner '{name}' (known: {', '.join(sorted(PARTITIONERS))})"
        ) from None
