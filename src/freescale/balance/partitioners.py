"""Sample-to-rank partitioners of the sequence load balancer (the *balancer* role).

Owns: :class:`Assignment` (sample -> rank map plus, per rank, its samples in ascending
global order), the partition functions ``identity``, ``fbs``, ``vbs``, ``kk`` and
``sticky`` (a swap search from the home placement that moves few samples),
``sticky2`` (the same balancing total length and total squared length at once; and
``shuffle``, a diagnostic that ignores costs), the
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
import math
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
    "sticky",
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


def _swap_search_args(
    name: str,
    what: str,
    values: np.ndarray,
    world_size: int,
    tol: float,
    max_swaps: int | None,
    home: Assignment | None,
) -> tuple[int, Assignment]:
    """The swap searches' (:func:`sticky`, :func:`sticky2`) argument checks: the swap
    budget (default ``N``) and the home placement (default :func:`identity`)."""
    n = values.size
    max_swaps = n if max_swaps is None else int(max_swaps)
    if max_swaps < 0:
        raise ValueError(f"max_swaps must be >= 0, got {max_swaps}")
    if not tol >= 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if home is None:
        home = identity(values, world_size)
    elif home.world_size != world_size or home.num_samples != n:
        raise ValueError(
            f"{name}: home places {home.num_samples} samples on {home.world_size} ranks, "
            f"{what} have {n} samples for {world_size} ranks"
        )
    return max_swaps, home


def sticky(
    costs: np.ndarray,
    world_size: int,
    *,
    sort_key: np.ndarray | None = None,
    tol: float = 2e-3,
    max_swaps: int | None = None,
    home: Assignment | None = None,
) -> Assignment:
    """Move-minimising balancer: start from the home placement and swap samples.

    ``home``: where the samples live now (the planner passes
    ``GlobalMetadata.home_assignment()``: any counts, any interleaving of the ranks in
    canonical order); default: :func:`identity` with default counts.

    Every sample starts on its *home* rank (:func:`identity` with default counts: the
    rank-major split of the global list, where the sample already lives). A greedy
    local search then repeats: ``h`` = heaviest rank, ``l`` = lightest (loads are
    float64 sums of costs; ties go to the lowest rank index). It stops when
    ``(max - mean) / max <= tol`` (or ``max == 0``), when ``h`` and ``l`` have no valid
    swap, or after ``max_swaps`` swaps (default ``N``: a generous safety bound; with
    128 lognormal-length samples per rank plans take about ``W`` to ``1.5 W`` swaps).
    A swap exchanges sample ``a`` of ``h`` with sample ``b`` of ``l``; it is valid when
    ``0 < delta = c[a] - c[b] < gap = load_h - load_l``, and the chosen valid pair
    minimises ``|c[b] - (c[a] - gap / 2)|`` (= ``|gap / 2 - delta|``: the swap that
    brings ``h`` and ``l`` closest together; computed in this form, whose float64
    value grows with the distance from ``c[a] - gap / 2`` on either side, so the two
    neighbours of that target in ``l``'s sorted costs are the only candidates per
    ``a``); ties go to the lowest global index of ``a``, then of ``b``. Loads are
    updated incrementally (``load_h -= delta``, ``load_l += delta``).
    A valid swap changes the sum of squared loads by ``-2 delta (gap - delta) < 0``:
    the search strictly descends and cannot cycle (in exact arithmetic; ``max_swaps``
    bounds it regardless).

    What it optimises: few sample moves. Each swap moves two samples (at most
    ``2 x swaps`` samples end away from home), a sample moves only when its rank is
    the heaviest or the lightest at some step, and the search stops as soon as the
    straggler share is within ``tol``. Only swaps are made, so every rank keeps its
    home count (equal counts when the home has them, as for :func:`fbs`). Without
    ``home`` the home is the default-count split: called that way on ranks whose local
    batches differ in size or interleave in canonical order, the samples really live
    elsewhere and the moves saved are not these (the planner passes the real home).
    What it does not: it is a local search, not a min-max partitioner, and the fewest
    moves are not guaranteed either. It stops at the first heaviest/lightest pair
    without a valid swap, so its max load can end above :func:`fbs`'s or :func:`kk`'s.
    A home with an empty rank is the extreme case: that rank is the lightest, no swap
    with it is valid, and nothing moves at all.
    Measured on lognormal lengths (432 cases: W 2 to 256, 8 / 32 / 128 samples per
    rank, sigma 0.5 to 2, costs ``L ** 1`` to ``L ** 2``): its max load was a median
    0.16 % above :func:`lower_bound` (``fbs``: 8 %), 26 % at worst (W = 8 with 8
    samples per rank; ``fbs``: 78 % at worst), and above ``fbs``'s in 2 cases, by under
    0.4 %; it moved a median 1.8 % of the samples at 128 per rank (at most 20 %), 7 %
    at 32 and 12.5 % at 8, where ``fbs`` moves about ``(W - 1) / W``. With many samples
    per rank it usually stops at ``tol``; when one sample outweighs the mean rank load
    (the straggler share cannot reach ``tol``) it runs until no valid swap is left,
    and moves more. It balances the given costs only, with none of the slack of
    ``fbs``'s zig-zag (which gives every rank a similar length mix): when the true
    time is not those costs, it is less robust. In the simulator (256 ranks x 128,
    scored with the cost model) sticky on ``L ** 1.5`` costs left a 3.2 % straggler
    share against ``fbs``'s 0.4 %, and 0.13 % when given the cost model's costs
    (``sticky_cost``).

    ``sort_key`` is accepted for the :class:`Partitioner` protocol and ignored (the
    swap choice needs the costs themselves).

    Deterministic: every choice is made on exact comparisons of float64 values and
    global indices (canonical sorts only); results are bit-identical across calls.

    Complexity, with ``K = ceil(N / W)`` samples per rank: O(N log K) to sort each
    rank's costs once; then per swap O(K log K) (``a``'s targets merged into ``l``'s
    sorted costs) plus O(K) to keep both ranks sorted and O(W) to find ``h`` and
    ``l``; memory O(N). The search is done in batches: while no rank swapped in the
    batch becomes the heaviest or lightest again, the greedy pairs the i-th heaviest
    rank with the i-th lightest, so a batch evaluates many such pairs in one
    vectorised pass and keeps the longest prefix of swaps the one-at-a-time loop
    would make (the same result, checked on the same float64 values); single steps
    take over while one rank stays the heaviest.
    """
    c = _check(costs, world_size)
    n = c.size
    w = world_size
    max_swaps, home = _swap_search_args("sticky", "costs", c, w, tol, max_swaps, home)
    if w == 1 or n == 0 or max_swaps == 0:
        return home
    search = _SwapSearch(c, home, float(tol))
    swaps = 0
    batch = _STICKY_FIRST_BATCH
    seq_left = 0
    while swaps < max_swaps:
        m = min(batch, w // 2, max_swaps - swaps)
        if seq_left or m < _STICKY_MIN_BATCH:
            if not search.step():
                break
            swaps += 1
            seq_left = max(seq_left - 1, 0)
            continue
        p, done = search.batch(m)
        swaps += p
        if done:
            break
        # a short prefix: the same rank stays the heaviest (or lightest) for a while,
        # which only single steps follow cheaply
        seq_left = _STICKY_STEPS if p < _STICKY_MIN_BATCH else 0
        batch = 2 * m if p == m else max(p + p // 4, _STICKY_MIN_BATCH)
    if swaps == 0:
        return home
    return search.assignment()


sticky.accepts_home = True  # type: ignore[attr-defined]  # Planner passes home=...
_STICKY_FIRST_BATCH = 32  # pairs evaluated by sticky's first batch
_STICKY_MIN_BATCH = 8  # smaller batches: single steps instead
_STICKY_STEPS = 32  # single steps after a batch that kept fewer than the minimum


def sticky2(
    costs: np.ndarray,
    world_size: int,
    *,
    sort_key: np.ndarray | None = None,
    tol: float = 2e-3,
    max_swaps: int | None = None,
    home: Assignment | None = None,
) -> Assignment:
    """Two-moment sticky: swaps from the home placement until every rank holds about
    the same total length **and** the same total squared length.

    Why: :func:`sticky` balances exactly the costs it is given, and each rank keeps its
    random mix of lengths, so when the dense time is not those costs its balance is
    lost (``benchmarks/sticky_robustness.py``: on ``L ** 1.5`` costs scored by the
    GPU-fitted ``a*L + b*L^2 + c``, twice fbs's straggler share from 64 ranks up).
    A rank whose ``sum(L)`` and ``sum(L^2)`` are both within ``tol`` of the mean has
    every cost ``a*sum(L) + b*sum(L^2) + c`` (``a, b, c >= 0``) within ``tol`` of the mean
    too, whatever ``a`` and ``b`` are: no cost model is needed, and none can be wrong.

    ``L`` is ``sort_key`` when given (the planner passes the composite lengths), else
    ``costs``; ``costs`` are otherwise ignored (the plan balances every cost of that
    form). ``home`` as in :func:`sticky` (default: :func:`identity` with default counts).

    The search: ``x_i = L_i / mean_r(sum L)`` and ``y_i = L_i^2 / mean_r(sum L^2)``;
    rank loads ``X_r = sum x``, ``Y_r = sum y`` (mean 1 each; float64, updated
    incrementally). Each step takes the moment with the larger share
    ``(max - 1) / max`` (``X`` on ties), ``h`` = its heaviest rank and ``l`` its lightest
    (lowest index on ties), and the swap of ``a`` in ``h`` with ``b`` in ``l`` that
    minimises ``(x_a - x_b - gx / 2)^2 + (y_a - y_b - gy / 2)^2`` with ``g = (X_h - X_l,
    Y_h - Y_l)``: the swap that brings the two ranks' load vectors closest together;
    ties go to the lowest global index of ``a``, then of ``b``. It is made when it lowers
    ``J = sum_r (X_r - 1)^2 + (Y_r - 1)^2`` (``dJ = 2 |d|^2 - 2 d.g < 0``, ``d`` the
    swap's ``(dx, dy)``); otherwise the other moment's pair is tried, and when neither
    helps, or both shares are within ``tol``, or after ``max_swaps`` swaps (default
    ``N``), the search stops. ``J`` strictly falls, so it cannot cycle. Every rank keeps
    its home count; an empty home rank is the lightest and has nothing to swap, so the
    search stops there (as :func:`sticky`; with every length positive, as the planner's
    are: a non-empty rank of zero lengths could tie with it as the lightest).

    Measured (``sticky_robustness.json``, 128 log-normal samples per rank): a straggler
    share of 0.01-0.2% at 2-256 ranks under every cost of that form tried (``L`` alone,
    ``L^2`` alone, the GPU fit, fits off by 2x), against fbs's 0.4-5.9%, moving 4-7% of the
    samples (fbs: ``(W - 1) / W``; sticky: ~2%).

    Cost: every step evaluates all ``K x K`` pairs of the two ranks (``K`` samples per
    rank): O(K^2) per swap, and it makes about ``4-5 W`` swaps at 128 per rank. On the
    2-core dev box 0.6 ms at 2 ranks x 128, 3.5 ms at 8, 29 ms at 64 and 120 ms at 256
    (fbs: 0.1-1.4 ms): fine for a node, too slow for the data stage at hundreds of ranks
    as it stands.

    Deterministic: exact comparisons of float64 values computed in one fixed order,
    ties by global index.
    """
    if sort_key is not None and np.size(sort_key) != np.size(costs):
        raise ValueError(
            f"sticky2: sort_key has {np.size(sort_key)} samples, costs {np.size(costs)}"
        )
    ln = _check(sort_key if sort_key is not None else costs, world_size).astype(np.float64)
    n = ln.size
    w = world_size
    max_swaps, home = _swap_search_args("sticky2", "lengths", ln, w, tol, max_swaps, home)
    if w == 1 or n == 0 or max_swaps == 0:
        return home
    rank_of = home.rank_of.copy()
    sq = ln * ln
    tot, tot_sq = float(ln.sum()), float(sq.sum())
    if tot <= 0.0 or tot_sq <= 0.0:
        return home
    x, y = ln / (tot / w), sq / (tot_sq / w)
    big_x = np.bincount(rank_of, weights=x, minlength=w)
    big_y = np.bincount(rank_of, weights=y, minlength=w)
    members = [home.samples_of(r).copy() for r in range(w)]  # ascending global index
    swaps = 0
    while swaps < max_swaps:
        mx, my = float(big_x.max()), float(big_y.max())
        sx, sy = (mx - 1.0) / mx, (my - 1.0) / my
        if max(sx, sy) <= tol:
            break
        for load in (big_x, big_y) if sx >= sy else (big_y, big_x):
            h, lo = int(np.argmax(load)), int(np.argmin(load))
            a_idx, b_idx = members[h], members[lo]
            if h == lo or a_idx.size == 0 or b_idx.size == 0:
                continue
            gx, gy = float(big_x[h] - big_x[lo]), float(big_y[h] - big_y[lo])
            dx = x[a_idx][:, None] - x[b_idx][None, :]
            dy = y[a_idx][:, None] - y[b_idx][None, :]
            k = int(np.argmin((dx - gx / 2) ** 2 + (dy - gy / 2) ** 2))  # row-major: a, b
            i, j = divmod(k, b_idx.size)
            ddx, ddy = float(dx[i, j]), float(dy[i, j])
            if 2.0 * (ddx * ddx + ddy * ddy) - 2.0 * (ddx * gx + ddy * gy) < 0.0:
                a, b = int(a_idx[i]), int(b_idx[j])
                big_x[h] -= ddx
                big_x[lo] += ddx
                big_y[h] -= ddy
                big_y[lo] += ddy
                members[h] = np.sort(np.concatenate([np.delete(a_idx, i), [b]]))
                members[lo] = np.sort(np.concatenate([np.delete(b_idx, j), [a]]))
                rank_of[a], rank_of[b] = lo, h
                swaps += 1
                break
        else:
            break  # neither moment's pair has a swap that helps
    if swaps == 0:
        return home
    return Assignment.from_ranks(rank_of, w)


sticky2.accepts_home = True  # type: ignore[attr-defined]  # Planner passes home=...
# it balances sum(L) and sum(L^2) itself: BalanceConfig rejects a cost model or AutoTune
sticky2.plans_on_lengths = True  # type: ignore[attr-defined]


class _SwapSearch:
    """State of :func:`sticky`'s greedy swap search.

    ``tab`` / ``idx``: ``[W, K + 2]`` per-rank costs and global indices, sorted by
    (cost, index) in columns ``1 .. count``; column 0 is a ``(-inf, N)`` sentinel and
    the columns past the count ``(+inf, N)`` padding. ``loads``: float64 per rank.
    :meth:`step` is one greedy swap; :meth:`batch` takes several at once with the
    same result.
    """

    def __init__(self, c: np.ndarray, home: Assignment, tol: float) -> None:
        cf = c.astype(np.float64) + 0.0  # a float64 copy without -0.0 (see _count_below)
        n, w = cf.size, home.world_size
        counts = home.counts
        k = int(counts.max())
        # (rank r, column j): the j-th sample of r in index order (home.order), or
        # padding (+inf cost, index n) past r's count
        valid = _arange(k)[None, :] < counts[:, None]
        at = np.minimum(home.offsets[:-1, None] + _arange(k)[None, :], max(n - 1, 0))
        gidx = np.where(valid, home.order[at], n)
        body = np.where(valid, cf[np.minimum(gidx, n - 1)], np.inf)
        # per row, sort by (cost, index): a fast unstable sort by cost, then ties put
        # back in column (= index) order by one integer sort of unique (run, column) keys
        perm = np.argsort(body, axis=1)
        flat = (_arange(w) * k)[:, None] + perm
        vals = body.ravel()[flat]
        if k > 1 and not (vals[:, 1:] != vals[:, :-1]).all():
            bits = k.bit_length()
            run = np.zeros((w, k), dtype=np.int64)
            np.cumsum(vals[:, 1:] != vals[:, :-1], axis=1, out=run[:, 1:])
            run <<= bits
            run |= perm
            run.sort(axis=1)
            run &= (1 << bits) - 1
            perm = run
            flat = (_arange(w) * k)[:, None] + perm
            vals = body.ravel()[flat]
        tab = np.empty((w, k + 2))
        tab[:, 0] = -np.inf
        tab[:, 1 : k + 1] = vals
        tab[:, k + 1] = np.inf
        idx = np.empty((w, k + 2), dtype=np.int64)
        idx[:, 0] = n
        idx[:, 1 : k + 1] = np.take_along_axis(gidx, perm, axis=1)  # padding sorts last
        idx[:, k + 1] = n
        self.tab, self.idx, self.n, self.k, self.w = tab, idx, n, k, w
        self.counts, self.cnt = counts, counts.tolist()
        self.loads = np.bincount(home.rank_of, weights=cf, minlength=w)  # sequential sums
        self.mean = math.fsum(self.loads.tolist()) / w
        self.tol = tol
        self.rank_of = home.rank_of.copy()
        self.offsets = home.offsets

    def _done(self, top: float) -> bool:
        return top <= 0.0 or (top - self.mean) / top <= self.tol

    def step(self) -> bool:
        """One greedy swap; False (nothing changed) when the search stops."""
        loads = self.loads
        h = int(loads.argmax())  # first maximum: the lowest rank on ties
        l = int(loads.argmin())
        top, low = float(loads[h]), float(loads[l])
        if self._done(top) or h == l:
            return False
        gap = top - low
        half = 0.5 * gap
        nh = self.cnt[h]
        row_h, idx_h = self.tab[h], self.idx[h]
        row_l, idx_l = self.tab[l], self.idx[l]
        ch = row_h[1 : nh + 1]
        target = ch - half
        hi = np.searchsorted(row_l, target)  # row_l[hi]: smallest cost >= target
        v_hi, v_lo = row_l[hi], row_l[hi - 1]
        lo = np.searchsorted(row_l, v_lo)  # first of the run (lowest index)
        d_hi = ch - v_hi
        d_lo = ch - v_lo
        with np.errstate(invalid="ignore"):
            e_hi = np.where((d_hi > 0.0) & (d_hi < gap), v_hi - target, np.inf)
            e_lo = np.where((d_lo > 0.0) & (d_lo < gap), target - v_lo, np.inf)
        b_hi, b_lo = idx_l[hi], idx_l[lo]
        take_lo = (e_lo < e_hi) | ((e_lo == e_hi) & (b_lo < b_hi))
        err = np.where(take_lo, e_lo, e_hi)
        i = int(err.argmin())
        best = err[i]
        if not best < np.inf:
            return False  # no valid swap between the heaviest and the lightest rank
        ties = np.flatnonzero(err == best)
        if ties.size > 1:
            i = int(ties[np.argmin(idx_h[1 : nh + 1][ties])])
        j = int(lo[i] if take_lo[i] else hi[i])
        ca, a = float(row_h[i + 1]), int(idx_h[i + 1])
        cb, b = float(row_l[j]), int(idx_l[j])
        delta = ca - cb
        # rank h: (ca, a) out of column i + 1, (cb, b) in at its place q <= i + 1
        q = int(np.searchsorted(row_h, cb))
        r = int(np.searchsorted(row_h, cb, side="right"))
        q += int(np.searchsorted(idx_h[q:r], b))
        row_h[q + 1 : i + 2] = row_h[q : i + 1]
        idx_h[q + 1 : i + 2] = idx_h[q : i + 1]
        row_h[q], idx_h[q] = cb, b
        # rank l: (cb, b) out of column j, (ca, a) in (column q - 1 once b is out)
        q = int(np.searchsorted(row_l, ca))
        r = int(np.searchsorted(row_l, ca, side="right"))
        q += int(np.searchsorted(idx_l[q:r], a))
        row_l[j : q - 1] = row_l[j + 1 : q]
        idx_l[j : q - 1] = idx_l[j + 1 : q]
        row_l[q - 1], idx_l[q - 1] = ca, a
        self.rank_of[a], self.rank_of[b] = l, h
        loads[h] = top - delta
        loads[l] = low + delta
        return True

    def batch(self, m: int) -> tuple[int, bool]:
        """Up to ``m`` greedy swaps at once: ``(swaps made, search stopped)``.

        While no rank it already swapped becomes the heaviest or the lightest again,
        the greedy loop pairs the i-th heaviest rank with the i-th lightest. Evaluate
        the swaps of ``m`` such pairs together and keep the longest prefix that
        :meth:`step` would take as well: every check is the step's, on the same
        float64 values, so the result is identical (only faster)."""
        loads, tab, idx, n, k = self.loads, self.tab, self.idx, self.n, self.k
        # (with tied loads a rank can be on both lists; the check on the swapped
        # ranks' new loads below cuts the batch before its second use)
        hs = canonical_order(loads, descending=True)[:m]  # argmax first, lowest rank on ties
        ls = canonical_order(loads)[:m]
        top, low = loads[hs], loads[ls]
        gap = top - low
        half = 0.5 * gap
        ch, ih = tab[hs, 1 : k + 1], idx[hs, 1 : k + 1]
        rl, il = tab[ls], idx[ls]
        steps = _arange(m)
        base = steps[:, None] * (k + 2)
        flat_rl, flat_il = rl.ravel(), il.ravel()
        with np.errstate(invalid="ignore", divide="ignore"):
            target = ch - half[:, None]  # ascending along each row; +inf on padding
            hi = _count_below(rl[:, 1 : k + 1], target)
            hi += base + 1  # rl[hi]: smallest cost >= target (np.searchsorted on the row)
            v_hi = flat_rl[hi]
            hi -= 1
            v_lo = flat_rl[hi]  # largest cost < target (-inf: none)
            g = gap[:, None]
            d_hi = ch - v_hi
            d_lo = ch - v_lo  # > 0: v_lo < target <= c[a]
            e_hi = np.where((d_hi > 0.0) & (d_hi < g), v_hi - target, np.inf)
            e_lo = np.where(d_lo < g, target - v_lo, np.inf)
            err = np.minimum(e_lo, e_hi)
            best = err.min(axis=1)
            ai = np.where(err == best[:, None], ih, n + 1).argmin(axis=1)  # lowest a on ties
            # its b: the nearer side (the lower index on a tie); on the low side, the
            # first of the run of equal costs (the lowest index)
            j_hi = hi[steps, ai] + 1
            starts = np.zeros((m, k + 2), dtype=np.int64)
            np.multiply(rl[:, 1:] != rl[:, :-1], _arange(k + 2)[1:], out=starts[:, 1:])
            np.maximum.accumulate(starts, axis=1, out=starts)
            j_lo = starts.ravel()[j_hi - 1] + base[:, 0]
            el, eh = e_lo[steps, ai], e_hi[steps, ai]
            take_lo = (el < eh) | ((el == eh) & (flat_il[j_lo] < flat_il[j_hi]))
            bj = np.where(take_lo, j_lo, j_hi)  # flat
            ca, a = ch[steps, ai], ih[steps, ai]
            cb, b = flat_rl[bj], flat_il[bj]
            bj -= base[:, 0]
            delta = ca - cb
            new_h = top - delta
            new_l = low + delta
            # the step's checks at step i, in its order: does it pick hs[i] and ls[i]
            # (every rank swapped before in this batch strictly between them)? then:
            # tolerance reached or no valid swap -> stop
            picked = np.ones(m, dtype=bool)
            picked[1:] = (np.maximum.accumulate(np.maximum(new_h, new_l))[:-1] < top[1:]) & (
                np.minimum.accumulate(np.minimum(new_h, new_l))[:-1] > low[1:]
            )
            stop = (top <= 0.0) | ((top - self.mean) / top <= self.tol) | ~(best < np.inf)
        cut = np.flatnonzero(~picked | stop)
        p = int(cut[0]) if cut.size else m
        if p:
            hp, lp = hs[:p], ls[:p]
            loads[hp] = new_h[:p]
            loads[lp] = new_l[:p]
            self.rank_of[a[:p]] = lp
            self.rank_of[b[:p]] = hp
            _replace_sorted(
                tab,
                idx,
                np.concatenate((hp, lp)),
                np.concatenate((ai[:p] + 1, bj[:p])),
                np.concatenate((cb[:p], ca[:p])),
                np.concatenate((b[:p], a[:p])),
            )
        return p, bool(cut.size) and bool(picked[p])

    def assignment(self) -> Assignment:
        """The current placement (each rank's row sorted back to index order)."""
        rows = np.sort(self.idx[:, 1 : self.k + 1], axis=1)  # padding (N) sorts last
        order = rows[_arange(self.k)[None, :] < self.counts[:, None]]
        return Assignment(rank_of=self.rank_of, order=order, offsets=self.offsets)


def _count_below(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per row, how many of ``rows`` (ascending, each >= +0.0, +inf allowed) are
    ``< targets`` (ascending along each row): a row-wise ``searchsorted``, exact.

    Nonnegative float64 values order like their bit patterns as unsigned integers; a
    tag bit (0 for targets, 1 for row values) puts a target before equal row values.
    One integer sort per row of the merged keys; a target's merged position minus its
    own position is the count (targets <= 0 get key 0: none is below them)."""
    m, k = targets.shape
    one = np.uint64(1)
    keys = np.empty((m, rows.shape[1] + k), dtype=np.uint64)
    np.left_shift(rows.view(np.uint64), one, out=keys[:, k:])
    keys[:, k:] |= one
    np.left_shift(targets.view(np.uint64), one, out=keys[:, :k])
    keys[:, :k][~(targets > 0.0)] = 0
    keys.sort(axis=1)
    at = np.flatnonzero((keys & one) == 0).reshape(m, k)  # exactly k targets per row
    at -= (_arange(m) * keys.shape[1])[:, None]
    at -= _arange(k)[None, :]
    return at


def _replace_sorted(
    tab: np.ndarray,
    idx: np.ndarray,
    rows: np.ndarray,
    at: np.ndarray,
    value: np.ndarray,
    index: np.ndarray,
) -> None:
    """In each of ``rows`` (distinct; sorted by (cost, index)), replace the entry at
    column ``at`` by ``(value, index)`` and shift the entries between to keep it sorted."""
    r_tab, r_idx = tab[rows], idx[rows]
    r = _arange(rows.size)
    cols = _arange(tab.shape[1])[None, :]
    v, x, old = value[:, None], index[:, None], at[:, None]
    before = (r_tab < v) | ((r_tab == v) & (r_idx < x))
    before[r, at] = False
    new = before.sum(axis=1)  # its column once the old entry is gone
    # gather map: moving right (new >= old) the entries in (old, new] shift left by one,
    # moving left those in [new, old) shift right (column new is overwritten after)
    src = cols + (cols >= old + (new < at)[:, None]) - (cols > new[:, None])
    src += (r * tab.shape[1])[:, None]
    r_tab = r_tab.ravel()[src]
    r_idx = r_idx.ravel()[src]
    r_tab[r, new] = value
    r_idx[r, new] = index
    tab[rows] = r_tab
    idx[rows] = r_idx


# ------------------------------------------------------------------------ registry
PARTITIONERS: dict[str, Callable[..., Assignment]] = {
    "identity": identity,
    "fbs": fbs,
    "vbs": vbs,
    "kk": kk,
    "shuffle": shuffle,
    "sticky": sticky,
    "sticky2": sticky2,
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
