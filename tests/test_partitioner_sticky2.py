"""Tests of the ``sticky2`` partitioner: swaps from the home placement that balance
every rank's total length and total squared length at once (partitioners.py)."""

from __future__ import annotations

import numpy as np
import pytest

from freescale.balance.partitioners import (
    PARTITIONERS,
    Assignment,
    fbs,
    identity,
    sticky,
    sticky2,
    straggler_share,
)
from freescale.balance.planner import BalanceConfig, GlobalMetadata, Planner
from test_partitioner_sticky import check_assignment, lognormal_lengths


def reference_sticky2(lengths, w, tol=2e-3, max_swaps=None, home=None):
    """The search spelled out one pair at a time in Python (slow)."""
    ln = np.asarray(lengths, dtype=np.float64)
    n = ln.size
    home = identity(ln, w) if home is None else home
    rank_of = home.rank_of.copy()
    sq = ln * ln
    tot, tot_sq = float(ln.sum()), float(sq.sum())
    if w == 1 or n == 0 or tot <= 0 or tot_sq <= 0:
        return rank_of
    x, y = ln / (tot / w), sq / (tot_sq / w)
    loads = [
        np.bincount(rank_of, weights=x, minlength=w),
        np.bincount(rank_of, weights=y, minlength=w),
    ]
    limit = n if max_swaps is None else max_swaps
    swaps = 0
    while swaps < limit:
        shares = [(float(v.max()) - 1.0) / float(v.max()) for v in loads]
        if max(shares) <= tol:
            break
        made = False
        for k in (0, 1) if shares[0] >= shares[1] else (1, 0):
            v = loads[k]
            h, lo = int(np.argmax(v)), int(np.argmin(v))
            gx = float(loads[0][h] - loads[0][lo])
            gy = float(loads[1][h] - loads[1][lo])
            best = None
            for a in np.flatnonzero(rank_of == h):
                for b in np.flatnonzero(rank_of == lo):
                    dx, dy = float(x[a] - x[b]), float(y[a] - y[b])
                    key = ((dx - gx / 2) ** 2 + (dy - gy / 2) ** 2, int(a), int(b), dx, dy)
                    best = key if best is None or key < best else best
            if h == lo or best is None:
                continue
            _, a, b, dx, dy = best
            if 2.0 * (dx * dx + dy * dy) - 2.0 * (dx * gx + dy * gy) < 0.0:
                loads[0][h] -= dx
                loads[0][lo] += dx
                loads[1][h] -= dy
                loads[1][lo] += dy
                rank_of[a], rank_of[b] = lo, h
                swaps += 1
                made = True
                break
        if not made:
            break
    return rank_of


def moment_shares(a: Assignment, lengths: np.ndarray) -> tuple[float, float]:
    ln = np.asarray(lengths, dtype=np.float64)
    return straggler_share(a.rank_sums(ln)), straggler_share(a.rank_sums(ln * ln))


@pytest.mark.parametrize("w", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_valid_assignment_keeps_home_counts(w, seed):
    rng = np.random.default_rng(seed)
    for n in sorted({max(w - 1, 1), w * 5 + 1, w * 16}):
        ln = lognormal_lengths(rng, n, 1.5)
        a = sticky2(ln, w)
        check_assignment(a, n, w)
        assert np.array_equal(a.counts, identity(ln, w).counts)


def _check_against_reference(seed: int, ties: bool) -> None:
    rng = np.random.default_rng(100 + seed)
    w = int(rng.integers(2, 9 if ties else 6))
    n = int(rng.integers(w, 12 * w))
    if ties:
        ln = rng.integers(1, 5, n).astype(np.float64)
    else:
        ln = lognormal_lengths(rng, n, float(rng.uniform(0.5, 2.0)))
    if seed % 2:  # an explicit home: uneven counts, ranks interleaved
        counts = np.bincount(rng.integers(0, w, n), minlength=w)
        rank_of = rng.permutation(np.repeat(np.arange(w), counts))
        home = Assignment.from_ranks(rank_of, w)
        got = sticky2(ln, w, home=home)
        want = reference_sticky2(ln, w, home=home)
    else:
        got, want = sticky2(ln, w), reference_sticky2(ln, w)
    assert np.array_equal(got.rank_of, want), (seed, ties)
    assert np.array_equal(
        sticky2(ln, w, max_swaps=2).rank_of, reference_sticky2(ln, w, max_swaps=2)
    )


@pytest.mark.parametrize("seed", range(6))
def test_matches_one_pair_at_a_time_reference(seed):
    _check_against_reference(seed, ties=False)


def test_matches_reference_when_lengths_tie():
    """Lengths from 1-4: equal distances everywhere, so the documented tie-breaks (lowest
    rank index on equal loads, lowest global index of a, then of b) decide the plans."""
    for seed in range(60):
        _check_against_reference(seed, ties=True)


@pytest.mark.parametrize("w", [2, 8])
def test_balances_both_moments_and_moves_few(w):
    """Both moments within a few tenths of a percent, so any a*L + b*L^2 + c is; few
    moves; fbs (robust to a wrong cost) and sticky on L^1.5 leave L^2 far less balanced."""
    rng = np.random.default_rng(7)
    n = 128 * w
    ln = np.clip(np.rint(rng.lognormal(np.log(1024), 1.0, n)), 1, 16384)
    a = sticky2(ln**1.5, w, sort_key=ln.astype(np.int64))
    s_l, s_sq = moment_shares(a, ln)
    assert max(s_l, s_sq) <= 5e-3, (s_l, s_sq)
    moved = float((a.rank_of != identity(ln, w).rank_of).mean())
    assert 0.0 < moved < 0.15, moved
    assert moment_shares(fbs(ln**1.5, w), ln)[1] > 2 * s_sq
    assert moment_shares(sticky(ln**1.5, w), ln)[1] > 2 * s_sq


def test_costs_ignored_when_lengths_given_and_deterministic():
    rng = np.random.default_rng(3)
    ln = lognormal_lengths(rng, 80, 1.2).astype(np.int64)
    a = sticky2(ln.astype(np.float64) ** 1.5, 4, sort_key=ln)
    b = sticky2(rng.random(80), 4, sort_key=ln)
    c = sticky2(ln.astype(np.float64), 4)
    assert np.array_equal(a.rank_of, b.rank_of) and np.array_equal(a.rank_of, c.rank_of)


def test_degenerate_inputs_keep_home():
    home_w1 = sticky2(np.arange(5.0), 1)
    assert np.array_equal(home_w1.rank_of, np.zeros(5, np.int64))
    z = sticky2(np.zeros(12), 3)
    assert np.array_equal(z.rank_of, identity(np.zeros(12), 3).rank_of)
    assert sticky2(np.zeros(0), 2).num_samples == 0
    # an empty home rank is the lightest and has nothing to swap: nothing moves
    ln = np.array([50.0, 1.0, 2.0, 90.0, 3.0, 4.0])
    home = Assignment.from_ranks(np.array([0, 0, 0, 1, 1, 1]), 3)
    assert np.array_equal(sticky2(ln, 3, home=home).rank_of, home.rank_of)
    # max_swaps=1: one exchange, two samples off home (the full search makes more)
    rng = np.random.default_rng(5)
    ln = lognormal_lengths(rng, 64, 1.5)
    home4 = identity(ln, 4).rank_of
    assert int((sticky2(ln, 4).rank_of != home4).sum()) > 2
    assert int((sticky2(ln, 4, max_swaps=1).rank_of != home4).sum()) == 2


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="tol"):
        sticky2(np.ones(4), 2, tol=-1.0)
    with pytest.raises(ValueError, match="max_swaps"):
        sticky2(np.ones(4), 2, max_swaps=-1)
    with pytest.raises(ValueError, match="home places 3 samples"):
        sticky2(np.ones(4), 2, home=identity(np.ones(3), 2))
    with pytest.raises(ValueError, match="non-negative"):
        sticky2(np.array([1.0, -2.0]), 2)
    with pytest.raises(ValueError, match="sort_key has 5 samples, costs 2"):
        sticky2(np.ones(2), 2, sort_key=np.arange(5))


def test_registered_and_planner_passes_lengths_and_home():
    assert PARTITIONERS["sticky2"] is sticky2 and sticky2.accepts_home
    rng = np.random.default_rng(11)
    lengths = [lognormal_lengths(rng, k, 1.5).astype(np.int64) for k in (20, 12, 16)]
    ids = [np.arange(r, 48 * 3, 3)[: len(x)] for r, x in enumerate(lengths)]  # interleaved
    meta = GlobalMetadata.from_rank_lists(
        3, lengths, [np.ones(len(x), np.int64) for x in lengths], sample_ids=ids
    )
    plan = Planner(BalanceConfig(partitioner="sticky2"), world_size=3).plan(meta)
    home = meta.home_assignment()
    assert np.array_equal(plan.assignment.counts, home.counts)
    want = sticky2(np.zeros(meta.num_samples), 3, sort_key=meta.lengths, home=home)
    assert np.array_equal(plan.assignment.rank_of, want.rank_of)


def test_cost_model_settings_rejected_with_sticky2():
    """sticky2 ignores per-sample costs: a cost model or AutoTune with it is a clear
    error naming the partitioner, not a silent no-op."""
    for kw in ({"use_cost_model": True}, {"cost_model_path": "cm.json"}, {"autotune": True}):
        with pytest.raises(ValueError, match="'sticky2' plans on the sample lengths"):
            BalanceConfig(partitioner="sticky2", **kw)
    BalanceConfig(partitioner="sticky2")
    BalanceConfig(partitioner="sticky", use_cost_model=True)
