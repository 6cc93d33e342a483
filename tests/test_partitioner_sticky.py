"""Tests of the ``sticky`` partitioner: a greedy swap search from the home placement
that keeps most samples on their home rank (partitioners.py)."""

from __future__ import annotations

import argparse
import math

import numpy as np
import pytest

from freescale.balance.partitioners import (
    PARTITIONERS,
    Assignment,
    fbs,
    get_partitioner,
    identity,
    lower_bound,
    sticky,
    straggler_share,
)


def check_assignment(a: Assignment, n: int, w: int) -> None:
    assert a.rank_of.shape == (n,) and a.rank_of.dtype == np.int64
    assert a.order.shape == (n,) and a.order.dtype == np.int64
    assert a.offsets.shape == (w + 1,) and a.world_size == w
    assert a.offsets[0] == 0 and a.offsets[-1] == n and np.all(np.diff(a.offsets) >= 0)
    assert np.array_equal(np.sort(a.order), np.arange(n))  # every sample exactly once
    for r in range(w):
        s = a.samples_of(r)
        assert np.all(np.diff(s) > 0)  # ascending global order inside a rank
        assert np.all(a.rank_of[s] == r)  # offsets consistent with rank_of


def home_counts(n: int, w: int) -> np.ndarray:
    base, extra = divmod(n, w)
    counts = np.full(w, base, dtype=np.int64)
    counts[:extra] += 1
    return counts


def lognormal_lengths(rng: np.random.Generator, n: int, sigma: float = 1.0) -> np.ndarray:
    return np.clip(np.rint(rng.lognormal(np.log(48), sigma, n)), 1, 4096)


def moved(a: Assignment, n: int, w: int) -> int:
    return int((a.rank_of != identity(np.zeros(n), w).rank_of).sum())


def reference_sticky(costs: np.ndarray, w: int, tol: float = 2e-3, max_swaps=None, home=None):
    """The greedy spelled out one swap at a time over all (a, b) pairs (slow)."""
    c = np.asarray(costs, dtype=np.float64) + 0.0
    n = c.size
    rank_of = (identity(c, w) if home is None else home).rank_of.copy()
    loads = np.bincount(rank_of, weights=c, minlength=w)
    mean = math.fsum(loads.tolist()) / w
    swaps = 0
    limit = n if max_swaps is None else max_swaps
    while w > 1 and n and swaps < limit:
        h, l = int(np.argmax(loads)), int(np.argmin(loads))
        top = float(loads[h])
        if top <= 0.0 or (top - mean) / top <= tol:
            break
        gap = top - float(loads[l])
        best = None
        for a in np.flatnonzero(rank_of == h):
            target = c[a] - 0.5 * gap
            for b in np.flatnonzero(rank_of == l):
                delta = c[a] - c[b]
                if 0.0 < delta < gap:
                    key = (abs(c[b] - target), int(a), int(b))
                    best = key if best is None or key < best else best
        if best is None:
            break
        _, a, b = best
        delta = c[a] - c[b]
        rank_of[a], rank_of[b] = l, h
        loads[h] = top - delta
        loads[l] = float(loads[l]) + delta
        swaps += 1
    return Assignment.from_ranks(rank_of, w)


# ------------------------------------------------------------------- validity
CASES = [
    (w, n)
    for w in (1, 2, 3, 4, 8, 64)
    for n in sorted({w * 5, w * 5 + w // 2 + 1, max(w - 1, 1), w * 16, w * 16 + 1})
]


@pytest.mark.parametrize(("w", "n"), CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_valid_assignment_and_home_counts(w, n, seed):
    rng = np.random.default_rng([seed, w, n])
    ln = lognormal_lengths(rng, n, sigma=1.5)
    ln[rng.integers(0, n, size=n // 3)] = 7  # many exact ties
    for c in (ln**1.5, ln.astype(np.int64), rng.random(n)):
        a = sticky(c, w)
        check_assignment(a, n, w)
        assert np.array_equal(a.counts, home_counts(n, w))  # only swaps: home counts
        assert a.rank_sums(c).max() >= lower_bound(c, w) * (1 - 1e-12)
        # never worse than home: every swap lowers the sum of squared loads
        base = identity(c, w).rank_sums(c)
        assert (a.rank_sums(c) ** 2).sum() <= (base**2).sum() * (1 + 1e-12)


@pytest.mark.parametrize("w", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("n", [0, 1, 5, 64, 200])
def test_degenerate_costs_keep_home(w, n):
    """All-zero or all-equal costs: loads are equal, or differ only by the count
    (N mod W ranks hold one sample more) and no swap changes a load (delta = 0 is not
    a valid swap): nobody moves."""
    home = identity(np.zeros(n), w)
    for c in (np.zeros(n), np.ones(n), np.full(n, 3.5), np.zeros(n, dtype=np.int64)):
        a = sticky(c, w, tol=0.0)
        check_assignment(a, n, w)
        assert a.equals(home)


def test_w1_is_identity():
    c = lognormal_lengths(np.random.default_rng(3), 100) ** 1.5
    a = sticky(c, 1)
    assert a.equals(identity(c, 1))
    assert np.array_equal(a.order, np.arange(100)) and a.offsets.tolist() == [0, 100]


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_swaps"):
        sticky(np.ones(4), 2, max_swaps=-1)
    with pytest.raises(ValueError, match="tol"):
        sticky(np.ones(4), 2, tol=-0.1)
    with pytest.raises(ValueError, match="non-negative"):
        sticky(np.array([1.0, -1.0]), 2)
    with pytest.raises(ValueError, match="world_size"):
        sticky(np.ones(4), 0)


# --------------------------------------------------------------- determinism
@pytest.mark.parametrize("w", [2, 8, 64])
def test_deterministic_and_sort_key_ignored(w):
    rng = np.random.default_rng(w)
    ln = lognormal_lengths(rng, w * 40 + 3)
    ln[::5] = 11  # ties
    c = ln**1.5
    a = sticky(c, w)
    for b in (sticky(c, w), sticky(c.copy(), w), sticky(c, w, sort_key=ln.astype(np.int64))):
        assert np.array_equal(a.rank_of, b.rank_of)
        assert np.array_equal(a.order, b.order)
        assert np.array_equal(a.offsets, b.offsets)
    assert moved(a, c.size, w) > 0  # it did something
    # integer costs are the same costs
    assert sticky(ln.astype(np.int64), w).equals(sticky(ln.astype(np.float64), w))


@pytest.mark.parametrize("seed", range(6))
def test_matches_one_swap_at_a_time_reference(seed):
    """The batched search makes exactly the swaps of the plain greedy (ties, tol,
    max_swaps and W >= 16, where several swaps are evaluated at once, included)."""
    rng = np.random.default_rng(100 + seed)
    for trial in range(8):
        w = int(rng.choice([2, 3, 5, 16, 24, 40, 64]))
        n = w * int(rng.integers(2, 7)) + (int(rng.integers(0, w)) if trial % 2 else 0)
        kind = trial % 4
        if kind == 0:
            c = rng.lognormal(3.0, 1.0, n)
        elif kind == 1:
            c = lognormal_lengths(rng, n, sigma=1.5) ** 1.5
        elif kind == 2:
            c = rng.integers(0, 6, n).astype(np.float64)  # heavy ties
        else:
            c = np.rint(rng.lognormal(3.0, 0.5, n))
        tol = (2e-3, 0.0, 0.05)[trial % 3]
        max_swaps = (None, 3, 17)[(trial + seed) % 3]
        got = sticky(c, w, tol=tol, max_swaps=max_swaps)
        ref = reference_sticky(c, w, tol=tol, max_swaps=max_swaps)
        assert got.equals(ref), (w, n, kind, tol, max_swaps)


@pytest.mark.parametrize("w", [16, 24, 64])
def test_matches_reference_with_tied_loads(w):
    """Most ranks hold a permutation of the same costs (equal loads): a rank can be
    among both the heaviest and the lightest candidates of a batch."""
    rng = np.random.default_rng(w)
    k = 6
    base = rng.integers(1, 20, k).astype(np.float64)
    c = np.concatenate([rng.permutation(base) for _ in range(w)])
    for r, d in ((0, 9.0), (3, -base.min()), (w // 2, 4.0), (w - 1, 2.0)):
        c[r * k + 1] = max(c[r * k + 1] + d, 0.0)
    for tol in (0.0, 2e-3):
        got = sticky(c, w, tol=tol)
        assert got.equals(reference_sticky(c, w, tol=tol))
        assert moved(got, c.size, w) > 0


# ------------------------------------------------------------ moves vs fbs
@pytest.mark.parametrize("w", [2, 8, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_moves_few_samples_and_balances_like_fbs(w, seed):
    rng = np.random.default_rng([7, w, seed])
    c = lognormal_lengths(rng, w * 128) ** 1.0
    n = c.size
    s, f, i = sticky(c, w), fbs(c, w), identity(c, w)
    ss_s, ss_f, ss_i = (straggler_share(a.rank_sums(c)) for a in (s, f, i))
    mv_s, mv_f = moved(s, n, w), moved(f, n, w)
    # measured: sticky moves 3 - 5 % of what fbs moves (fbs: about (W - 1) / W of all)
    assert mv_f > 0.4 * n
    assert 0 < mv_s <= 0.1 * mv_f
    # measured: sticky stops at tol (2e-3); fbs's share is 0.002 - 0.12 here
    assert ss_s <= max(2 * ss_f, 0.01)
    assert ss_s <= 2e-3 + 1e-9
    assert ss_s <= 0.1 * ss_i  # identity's share: 0.06 - 0.31 here


# -------------------------------------------------------- tol and max_swaps
def test_max_swaps_honoured_and_each_swap_is_one_exchange():
    rng = np.random.default_rng(11)
    w = 64
    c = lognormal_lengths(rng, w * 16, sigma=0.7)  # measured: stops after 65 swaps
    n = c.size
    assert sticky(c, w, max_swaps=0).equals(identity(c, w))
    prev = sticky(c, w, max_swaps=0)
    prev_sq = float((prev.rank_sums(c) ** 2).sum())
    full = sticky(c, w)
    for s in range(1, 100):
        cur = sticky(c, w, max_swaps=s)
        check_assignment(cur, n, w)
        changed = np.flatnonzero(cur.rank_of != prev.rank_of)
        if changed.size == 0:  # the search had stopped before s swaps
            assert cur.equals(full)
            break
        # one more swap: two samples exchanged ranks, the sum of squares went down
        assert changed.size == 2
        a, b = changed
        assert cur.rank_of[a] == prev.rank_of[b] and cur.rank_of[b] == prev.rank_of[a]
        sq = float((cur.rank_sums(c) ** 2).sum())
        assert sq < prev_sq
        assert moved(cur, n, w) <= 2 * s
        prev, prev_sq = cur, sq
    else:
        pytest.fail("expected the search to stop within 100 swaps")
    assert moved(sticky(c, w, max_swaps=1), n, w) == 2


def test_larger_tol_stops_earlier():
    rng = np.random.default_rng(5)
    w = 32
    c = lognormal_lengths(rng, w * 128) ** 1.0
    n = c.size
    plans = {tol: sticky(c, w, tol=tol) for tol in (0.0, 2e-3, 1e-2, 5e-2, 0.2, 1.0)}
    moves = [moved(plans[t], n, w) for t in sorted(plans)]
    shares = [straggler_share(plans[t].rank_sums(c)) for t in sorted(plans)]
    assert all(x >= y for x, y in zip(moves, moves[1:]))  # fewer or equal moves
    assert moves[0] > moves[2] > 0  # and it does matter
    assert plans[1.0].equals(identity(c, w))  # any straggler share is within tol = 1
    for t, share in zip(sorted(plans)[1:-1], shares[1:-1]):
        assert share <= t + 1e-9  # stopped on the tolerance
    assert shares[0] <= shares[1]


def test_stops_without_valid_swap_when_one_sample_dominates():
    """A sample heavier than the mean rank load: the tolerance is out of reach; the
    search ends when the heaviest and lightest ranks have no improving swap."""
    w = 8
    c = np.ones(w * 4)
    c[5] = 100.0  # rank 1
    a = sticky(c, w)
    check_assignment(a, c.size, w)
    loads = a.rank_sums(c)
    assert loads.max() == 103.0  # its three unit companions cannot be swapped away
    assert a.equals(identity(c, w))


# ------------------------------------------------------------------ registry
def test_registered():
    assert get_partitioner("sticky") is sticky
    assert PARTITIONERS["sticky"] is sticky


def test_cli_lists_sticky():
    from freescale.balance.hook import add_balance_flags

    p = argparse.ArgumentParser()
    add_balance_flags(p)
    assert p.parse_args(["--balance", "sticky"]).balance == "sticky"


# ------------------------------------------------------------ an explicit home
@pytest.mark.parametrize("seed", range(6))
def test_explicit_home_any_counts_matches_reference(seed):
    """With ``home`` (what the planner passes: unequal counts, ranks interleaved in
    canonical order, empty ranks) sticky keeps every rank's home count, makes exactly
    the plain greedy's swaps from that home, and moves few samples."""
    rng = np.random.default_rng(700 + seed)
    for trial in range(6):
        w = int(rng.choice([2, 3, 5, 16, 40]))
        n = w * int(rng.integers(2, 9)) + int(rng.integers(0, w))
        c = lognormal_lengths(rng, n, sigma=1.0 + 0.25 * trial) ** 1.5
        ranks = rng.integers(0, w, n)
        if trial % 3 == 0:
            ranks[ranks == w - 1] = 0  # an empty rank
        home = Assignment.from_ranks(ranks.astype(np.int64), w)
        got = sticky(c, w, home=home)
        check_assignment(got, n, w)
        assert np.array_equal(got.counts, home.counts)
        assert got.equals(reference_sticky(c, w, home=home)), (w, n, trial)
        assert got.rank_sums(c).max() <= home.rank_sums(c).max()
        fbs_moves = int((fbs(c, w).rank_of != ranks).sum())
        assert int((got.rank_of != home.rank_of).sum()) <= max(fbs_moves, 2)


def test_explicit_identity_home_is_the_default():
    rng = np.random.default_rng(5)
    c = lognormal_lengths(rng, 8 * 37, sigma=1.5)
    assert sticky(c, 8, home=identity(c, 8)).equals(sticky(c, 8))
    with pytest.raises(ValueError, match="home places"):
        sticky(c, 8, home=identity(c[:-1], 8))
    with pytest.raises(ValueError, match="home places"):
        sticky(c, 8, home=identity(c, 4))


def test_planner_passes_the_real_home():
    """Sample ids interleaved across ranks (canonical order is by id, not rank-major):
    the planner hands sticky the real home, so few samples move; without it the
    default-count split would be taken as home and most samples would move."""
    from freescale.balance.planner import BalanceConfig, GlobalMetadata, Planner

    rng = np.random.default_rng(11)
    w, per = 4, 64
    lengths = [lognormal_lengths(rng, per, sigma=1.0) for _ in range(w)]
    ids = np.arange(w * per).reshape(per, w).T  # rank r holds ids r, r + w, r + 2w, ...
    meta = GlobalMetadata.from_rank_lists(3, lengths, [np.ones(per)] * w, list(ids))
    plan = Planner(BalanceConfig(partitioner="sticky"), w, 0).plan(meta)
    assert not meta.home_assignment().equals(identity(np.zeros(w * per), w))
    assert 0 < plan.samples_moved <= 0.2 * w * per, plan.samples_moved
    costs = meta.lengths.astype(np.float64) ** 1.5
    blind = sticky(costs, w)  # the default home: not where the samples are
    assert int((blind.rank_of != meta.home_rank).sum()) > 0.5 * w * per
