"""Tests of the sequence load balancer: partitioners, cost model, AutoTune, planner,
plan log, coordinator (single process and gloo at 2 / 4 ranks) and simulator."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.balance.coordinator import BalanceCoordinator, CoordinatorConfig
from freescale.balance.cost_model import AutoTune, AutoTuneConfig, CostModel
from freescale.balance.partitioners import (
    PARTITIONERS,
    Assignment,
    canonical_order,
    fbs,
    get_partitioner,
    identity,
    kk,
    lower_bound,
    register_partitioner,
    straggler_share,
    vbs,
)
from freescale.balance.planner import BalanceConfig, GlobalMetadata, PlanLog, Planner
from freescale.balance.simulator import SimConfig, simulate, simulate_main
from freescale.comm.base import Communicator
from freescale.data.batch import JaggedBatch

torch.set_num_threads(1)

NAMES = ["identity", "fbs", "vbs", "kk", "shuffle"]


def heavy_lengths(rng: np.random.Generator, n: int, sigma: float = 1.5, cap: int = 20_000):
    return np.clip(np.rint(rng.lognormal(np.log(48), sigma, n)), 1, cap).astype(np.int64)


def check_assignment(a: Assignment, n: int, w: int) -> None:
    assert a.rank_of.shape == (n,) and a.rank_of.dtype == np.int64
    assert a.world_size == w and a.offsets[0] == 0 and a.offsets[-1] == n
    assert np.array_equal(np.sort(a.order), np.arange(n))  # every sample exactly once
    for r in range(w):
        s = a.samples_of(r)
        assert np.all(np.diff(s) > 0)  # ascending global order inside a rank
        assert np.all(a.rank_of[s] == r)
    assert len(a.per_rank) == w


# ------------------------------------------------------------------ partitioners
@pytest.mark.parametrize("name", NAMES)
def test_partitioner_invariants_and_determinism(name):
    rng = np.random.default_rng(0)
    fn = get_partitioner(name)
    for trial in range(40):
        w = int(rng.integers(1, 33))
        n = w * int(rng.integers(1, 17)) + (int(rng.integers(0, w)) if trial % 3 == 0 else 0)
        ln = heavy_lengths(rng, n)
        ln[rng.integers(0, n, size=n // 4)] = 7  # many exact ties
        c = ln.astype(np.float64) ** 1.7
        a = fn(c, w)
        check_assignment(a, n, w)
        assert a.equals(fn(c.copy(), w))  # deterministic
        assert a.equals(fn(c, w, sort_key=ln))  # integer sort key: same canonical plan
        assert a.rank_sums(c).max() >= lower_bound(c, w) * (1 - 1e-12)
        if name != "vbs":
            assert a.counts.max() - a.counts.min() <= 1


def test_shuffle_moves_samples_and_ignores_costs():
    """The diagnostic partitioner: equal counts, samples really cross ranks, the plan
    depends on the list (not on the cost scale), and it does not balance."""
    rng = np.random.default_rng(int(rng_seed()))
    ln = heavy_lengths(rng, 512)
    a = get_partitioner("shuffle")(ln.astype(np.float64), 8)
    home = identity(ln.astype(np.float64), 8)
    assert (a.rank_of != home.rank_of).sum() > 256  # most samples move (7/8 expected)
    assert a.equals(get_partitioner("shuffle")(ln.astype(np.float64) * 3.0 + 1.0, 8))
    assert not a.equals(get_partitioner("shuffle")(np.roll(ln, 1).astype(np.float64), 8))
    assert set(a.counts.tolist()) == {64}


def rng_seed() -> int:
    s = int(np.random.SeedSequence().entropy % (1 << 31))
    print(f"seed {s}")
    return s


def test_canonical_order_breaks_ties_by_index():
    key = np.array([3.0, 1.0, 3.0, 2.0, 1.0, 3.0])
    assert canonical_order(key).tolist() == [1, 4, 3, 0, 2, 5]
    assert canonical_order(key, descending=True).tolist() == [0, 2, 5, 3, 1, 4]
    ik = key.astype(np.int64)
    assert canonical_order(ik).tolist() == [1, 4, 3, 0, 2, 5]
    assert canonical_order(ik, descending=True).tolist() == [0, 2, 5, 3, 1, 4]
    big = np.random.default_rng(1).random(5000).round(2)  # many ties
    assert np.array_equal(canonical_order(big), np.argsort(big, kind="stable"))


def test_fbs_zigzag_hand_example():
    # descending order: samples 4(9) 1(8) 6(7) 0(6) 3(5) 7(4) 2(3) 5(2) 8(1)
    costs = np.array([6, 8, 3, 5, 9, 2, 7, 4, 1], dtype=np.float64)
    a = fbs(costs, 3)
    # rank i takes sorted positions i, 2W-1-i, 2W+i: r0 {0,5,6}, r1 {1,4,7}, r2 {2,3,8}
    assert a.samples_of(0).tolist() == sorted([4, 7, 2])
    assert a.samples_of(1).tolist() == sorted([1, 3, 5])
    assert a.samples_of(2).tolist() == sorted([6, 0, 8])
    assert a.counts.tolist() == [3, 3, 3]
    # ties broken by index: all equal costs deal 0,1,2 then 5,4,3 ... (reversed rows)
    b = fbs(np.ones(6), 3)
    assert b.rank_of.tolist() == [0, 1, 2, 2, 1, 0]


def test_identity_is_contiguous():
    a = identity(np.ones(10), 3)
    assert a.counts.tolist() == [4, 3, 3]
    assert a.rank_of.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    b = identity(np.ones(5), 3, counts=[0, 5, 0])
    assert b.rank_of.tolist() == [1] * 5


def test_vbs_contiguous_runs_and_empty_ranks():
    rng = np.random.default_rng(2)
    for _ in range(20):
        w = int(rng.integers(2, 40))
        ln = heavy_lengths(rng, w * 8)
        c = ln.astype(np.float64) ** 1.5
        a = vbs(c, w, sort_key=ln)
        ranks_sorted = a.rank_of[canonical_order(ln)]
        assert np.all(np.diff(ranks_sorted) >= 0)  # contiguous runs in length order
        sums = a.rank_sums(c)
        assert np.all(np.abs(sums - c.sum() / w) <= c.max() + 1e-9 * c.sum())
    # a dominant sample leaves ranks empty: legal
    c = np.array([1.0, 1.0, 1.0, 100.0])
    a = vbs(c, 4)
    check_assignment(a, 4, 4)
    assert (a.counts == 0).sum() == 2
    assert a.rank_of[3] != a.rank_of[0]
    e = vbs(np.zeros(0), 3)
    assert e.counts.tolist() == [0, 0, 0]


def test_kk_equal_counts_and_beats_fbs_on_heavy_tails():
    rng = np.random.default_rng(3)
    wins, trials = 0, 40
    for _ in range(trials):
        w = int(rng.integers(2, 64))
        ln = heavy_lengths(rng, w * int(rng.integers(2, 32)), sigma=1.2, cap=4096)
        c = ln.astype(np.float64) ** 1.5
        a = kk(c, w)
        assert np.all(a.counts == ln.size // w)
        m_kk, m_fbs = a.rank_sums(c).max(), fbs(c, w).rank_sums(c).max()
        assert m_kk >= lower_bound(c, w) * (1 - 1e-12)
        wins += m_kk <= m_fbs * (1 + 1e-12)
    assert wins >= 0.9 * trials, f"KK beat FBS on only {wins}/{trials} heavy-tailed inputs"
    # phantoms: W does not divide N -> counts differ by one; N < W -> empty ranks
    assert sorted(kk(np.arange(7.0), 3).counts.tolist()) == [2, 2, 3]
    assert sorted(kk(np.array([5.0, 1.0]), 4).counts.tolist()) == [0, 0, 1, 1]


def test_lower_bound_and_straggler_share():
    assert lower_bound(np.array([1.0, 1.0, 10.0]), 2) == 10.0
    assert lower_bound(np.array([3.0, 3.0, 3.0, 3.0]), 2) == 6.0
    assert lower_bound(np.zeros(0), 4) == 0.0
    assert straggler_share(np.array([1.0, 1.0, 2.0])) == pytest.approx((2 - 4 / 3) / 2)
    assert straggler_share(np.zeros(3)) == 0.0


def test_registry():
    assert set(NAMES) <= set(PARTITIONERS)
    with pytest.raises(ValueError, match="unknown partitioner"):
        get_partitioner("nope")

    def reverse_identity(costs, world_size, *, sort_key=None):
        return Assignment.from_ranks(
            (world_size - 1) - identity(costs, world_size).rank_of, world_size
        )

    register_partitioner("test_reverse", reverse_identity)
    try:
        a = get_partitioner("test_reverse")(np.ones(4), 2)
        assert a.rank_of.tolist() == [1, 1, 0, 0]
        with pytest.raises(ValueError, match="already registered"):
            register_partitioner("test_reverse", reverse_identity)
    finally:
        PARTITIONERS.pop("test_reverse")


def test_partitioner_timing_512x128(capsys):
    """Prints planner times at 512 ranks x 128 samples (never asserted)."""
    rng = np.random.default_rng(4)
    w, b = 512, 128
    ln = heavy_lengths(rng, w * b, sigma=1.0, cap=4096)
    c = ln.astype(np.float64) ** 1.5
    lines = []
    for name in NAMES:
        fn = get_partitioner(name)
        reps = 5 if name == "kk" else 30
        for label, kw in (("L^a+sort_key", {"sort_key": ln}), ("float only", {})):
            fn(c, w, **kw)
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn(c, w, **kw)
                ts.append((time.perf_counter() - t0) * 1e3)
            lines.append(
                f"{name:>8} {label:<13} median {np.median(ts):7.3f} ms  min {min(ts):7.3f} ms"
            )
    with capsys.disabled():
        print("\npartitioner times at 512 ranks x 128 samples (65,536 samples):")
        print("\n".join(lines))


# ------------------------------------------------------------ cost model, AutoTune
def _rank_measurements(rng, a, b, c, n=200, noise=0.02):
    out = []
    for _ in range(n):
        ln = heavy_lengths(rng, int(rng.integers(4, 64)), sigma=1.0, cap=4096).astype(float)
        tok, sq = ln.sum(), (ln * ln).sum()
        ms = (a * tok + b * sq + c) * (1 + noise * rng.normal())
        out.append((tok, sq, ms))
    return out


def test_cost_model_fit_recovers_coefficients():
    rng = np.random.default_rng(5)
    a, b, c = 2e-4, 3e-7, 0.8
    data = _rank_measurements(rng, a, b, c)
    cm = CostModel()
    err = cm.fit(data)
    assert cm.fitted and err < 0.05
    assert cm.a == pytest.approx(a, rel=0.1)
    assert cm.b == pytest.approx(b, rel=0.1)
    assert cm.c == pytest.approx(c, rel=0.25)
    cm2 = CostModel()
    cm2.fit(data)
    assert (cm2.a, cm2.b, cm2.c) == (cm.a, cm.b, cm.c)  # deterministic
    # true b = 0 with noise: the fit stays non-negative
    cm3 = CostModel()
    cm3.fit(_rank_measurements(rng, 1e-3, 0.0, 0.0, noise=0.1))
    assert min(cm3.a, cm3.b, cm3.c) >= 0.0
    # per-sample costs and the per-rank constant
    assert cm.sample_costs(np.array([10]))[0] == pytest.approx(cm.a * 10 + cm.b * 100)
    assert cm.per_rank_constant == cm.c
    assert CostModel(alpha=2.0).sample_costs(np.array([3]))[0] == 9.0
    with pytest.raises(ValueError):
        CostModel().fit([(1.0, 1.0, 1.0)])


def test_cost_model_json_round_trip(tmp_path):
    p = tmp_path / "fit.json"
    p.write_text(json.dumps({"a": 1e-4, "b": 2e-8, "c": 0.3}))
    cm = CostModel.load(str(p))
    assert cm.fitted and (cm.a, cm.b, cm.c) == (1e-4, 2e-8, 0.3)
    q = tmp_path / "full.json"
    cm.save(str(q))
    assert CostModel.load(str(q)) == cm


def _vbs_rank_times(alpha, ln, w, true_power=2.0):
    c = ln.astype(np.float64) ** alpha
    a = vbs(c, w, sort_key=ln)
    lf = ln.astype(np.float64)
    times = a.rank_sums(lf**true_power)
    counts = a.counts
    mean_len = np.where(counts > 0, a.rank_sums(lf) / np.maximum(counts, 1), 0.0)
    return times, mean_len


def test_autotune_moves_alpha_in_the_right_direction():
    rng = np.random.default_rng(6)
    ln = heavy_lengths(rng, 16 * 64, sigma=1.0, cap=2048)
    up = AutoTune(AutoTuneConfig(alpha=1.0))
    up.update(*_vbs_rank_times(1.0, ln, 16))  # true cost L^2: long ranks straggle
    assert up.alpha > 1.0
    down = AutoTune(AutoTuneConfig(alpha=3.0))
    down.update(*_vbs_rank_times(3.0, ln, 16))
    assert down.alpha < 3.0
    # a few dozen steps bring alpha near 2 and cut the straggler share
    tune = AutoTune(AutoTuneConfig(alpha=1.0, step=0.2))
    first = None
    for step in range(40):
        ln = heavy_lengths(np.random.default_rng(100 + step), 16 * 64, sigma=1.0, cap=2048)
        t, m = _vbs_rank_times(tune.alpha, ln, 16)
        first = straggler_share(t) if first is None else first
        tune.update(t, m)
    last = straggler_share(_vbs_rank_times(tune.alpha, ln, 16)[0])
    assert 1.6 < tune.alpha < 2.4 and last < first
    # checkpoint round trip continues identically
    clone = AutoTune()
    clone.load_state_dict(json.loads(json.dumps(tune.state_dict())))
    t, m = _vbs_rank_times(tune.alpha, ln, 16)
    assert clone.update(t, m) == tune.update(t, m)


# ------------------------------------------------------------------------ planner
def _meta(step, w=8, b=16, seed=0):
    rng = np.random.default_rng([seed, step])
    ln = heavy_lengths(rng, w * b, sigma=1.3, cap=4096)
    return GlobalMetadata.from_lengths(step, ln, w, rng.integers(1, 9, size=w * b))


def test_plan_log_replay_equals_original(tmp_path):
    log = tmp_path / "plans.jsonl"
    cfg = BalanceConfig(partitioner="vbs", autotune=True, log_path=str(log), alpha=1.2)
    planner = Planner(cfg, world_size=8)
    originals = []
    for step in range(5):
        plan = planner.plan(_meta(step))
        times = plan.rank_tokens**2 / 1e4  # some measured times
        planner.observe(plan, times)  # alpha changes between steps
        originals.append(plan)
    assert len({p.alpha for p in originals}) > 1
    logged = PlanLog.read(str(log))
    assert sorted(logged) == list(range(5))
    replayer = Planner(BalanceConfig(partitioner="vbs", replay_path=str(log)), world_size=8)
    for plan in originals:
        again = replayer.plan(_meta(plan.step))
        assert again.replayed and again.same_as(plan)
        assert again.summary() == plan.summary()
        assert PlanLog.replay(str(log), plan.step).same_as(plan)
    with pytest.raises(ValueError, match="different metadata"):
        replayer.plan(_meta(2, seed=99))


def test_compact_plan_log_replays_by_recomputation(tmp_path):
    log = tmp_path / "compact.jsonl"
    cfg = BalanceConfig(partitioner="kk", autotune=True, log_path=str(log), log_detail="compact")
    planner = Planner(cfg, world_size=8)
    originals = []
    for step in range(4):
        plan = planner.plan(_meta(step))
        planner.observe(plan, plan.rank_tokens**2 / 1e4)
        originals.append(plan)
    rec = PlanLog.read(str(log))[3]
    assert "rank_of" not in rec and "rank_costs" not in rec
    with pytest.raises(ValueError, match="compact"):
        PlanLog.replay(str(log), 3)
    replayer = Planner(BalanceConfig(partitioner="fbs", replay_path=str(log)), world_size=8)
    for plan in originals:  # logged partitioner and alpha win over the new config
        again = replayer.plan(_meta(plan.step))
        assert again.replayed and again.same_as(plan) and again.alpha == plan.alpha
    # a record whose checksum no longer matches fails loudly
    lines = log.read_text().splitlines()
    bad = json.loads(lines[0])
    bad["rank_of_crc"] ^= 1
    log.write_text(json.dumps(bad) + "\n")
    with pytest.raises(RuntimeError, match="different assignment"):
        Planner(BalanceConfig(replay_path=str(log)), world_size=8).plan(_meta(0))


def test_shadow_mode_applies_identity():
    meta = _meta(0)
    shadow = Planner(BalanceConfig(partitioner="kk", shadow=True), world_size=8).plan(meta)
    live = Planner(BalanceConfig(partitioner="kk"), world_size=8).plan(meta)
    assert shadow.assignment.equals(meta.home_assignment())
    assert shadow.samples_moved == 0 and shadow.bytes_moved == 0
    assert shadow.proposed.equals(live.assignment)
    assert shadow.proposed_samples_moved == live.samples_moved > 0
    assert shadow.straggler_after == live.straggler_after < shadow.straggler_before
    assert shadow.predicted_gain > 1.0
    assert live.predicted_max >= live.lower_bound * (1 - 1e-12)


def test_planner_cost_model_refit_and_state():
    cfg = BalanceConfig(partitioner="kk", use_cost_model=True, refit_every=2)
    planner = Planner(cfg, world_size=8)
    plan = planner.plan(_meta(0))
    assert plan.cost_model["kind"] == "power"
    for step in range(1, 5):
        plan = planner.plan(_meta(step))
        planner.observe(plan, 1e-4 * plan.rank_tokens + 1e-7 * plan.rank_sum_sq + 0.5)
    assert planner.cost_model.fitted and planner.cost_model.fit_error < 1e-6
    plan = planner.plan(_meta(9))
    assert plan.cost_model["kind"] == "fit"
    assert plan.cost_model["a"] == pytest.approx(1e-4, rel=1e-3)
    other = Planner(cfg, world_size=8)
    other.load_state_dict(json.loads(json.dumps(planner.state_dict())))
    assert other.plan(_meta(9)).same_as(plan)


def test_planner_skips_rank_times_that_are_not_costs():
    """A negative or non-finite rank time (a timing mis-attribution) is skipped and
    counted, not fed to the fit, which would raise and end training; the fit of the
    valid times is the one it would be without them."""
    cfg = BalanceConfig(partitioner="kk", use_cost_model=True, refit_every=2)
    planner, clean = Planner(cfg, world_size=8), Planner(cfg, world_size=8)
    for step in range(1, 5):
        plan = planner.plan(_meta(step))
        times = 1e-4 * plan.rank_tokens + 1e-7 * plan.rank_sum_sq + 0.5
        bad = times.copy()
        bad[step % 8], bad[(step + 3) % 8] = -2.0, float("nan")
        planner.observe(plan, bad)
        keep = np.ones(8, dtype=bool)
        keep[[step % 8, (step + 3) % 8]] = False
        clean._measurements.extend(
            (float(a), float(b), float(c))
            for a, b, c, k in zip(plan.rank_tokens, plan.rank_sum_sq, times, keep)
            if k
        )
    assert planner.rejected_measurements == 8
    assert planner.cost_model.fitted
    clean.cost_model.fit(list(clean._measurements))
    assert planner.cost_model.to_dict() == clean.cost_model.to_dict()


def test_planner_degenerate_fit_keeps_power_costs():
    """Times that do not grow with length fit ``a == b == 0``: every sample would cost 0
    and nothing could be balanced, so plans keep ``L^alpha`` (and move samples) until a
    refit sees lengths matter; a saved planner state restores that choice. Mutation:
    using the degenerate fit (``_uses_fit`` without the check) makes the plan's kind
    "fit" with ~zero costs, and nothing moves."""
    cfg = BalanceConfig(partitioner="sticky", use_cost_model=True, refit_every=2)
    planner = Planner(cfg, world_size=8)
    for step in range(4):
        plan = planner.plan(_meta(step))
        planner.observe(plan, np.full(8, 3.0))  # flat: length does not matter
    cm = planner.cost_model
    # a == b == 0 up to rounding (b can come out ~1e-22)
    assert cm.fitted and cm.a < 1e-15 and cm.b < 1e-15 and cm.c == pytest.approx(3.0)
    plan = planner.plan(_meta(9))
    assert plan.cost_model["kind"] == "power" and plan.samples_moved > 0
    other = Planner(cfg, world_size=8)
    other.load_state_dict(json.loads(json.dumps(planner.state_dict())))
    assert other.plan(_meta(9)).same_as(plan)
    # the decision is the last refit's, saved with the state and not recomputed from the
    # measurements held at save time (near the threshold those can decide otherwise)
    for step in range(10, 14):  # now the times grow with the tokens
        plan = planner.plan(_meta(step))
        planner.observe(plan, 1e-3 * plan.rank_tokens + 0.5)
    assert planner.plan(_meta(20)).cost_model["kind"] == "fit"
    state = json.loads(json.dumps(planner.state_dict()))
    assert state["fit_usable"] is True
    state["fit_usable"] = False  # as if the last refit had been degenerate
    other = Planner(cfg, world_size=8)
    other.load_state_dict(state)
    assert other.plan(_meta(20)).cost_model["kind"] == "power"
    plan = planner.plan(_meta(20))
    assert plan.cost_model["kind"] == "fit" and plan.cost_model["a"] > 0


def test_hook_plans_with_the_state_of_step_minus_lag_and_checkpoints_it():
    """``BalanceHook.on_metrics`` learns from a step's times at once (the training
    thread) and keeps the resulting cost state by step; step ``s`` is planned with the
    state as of ``s - METRICS_LAG`` (the same on every rank whatever the threads'
    timing). The kept states go into the hook's checkpoint, so a restored hook plans the
    next steps with the same states. Mutations: planning with the current state (the
    pre-session-17 behaviour) fails the first check; not saving the states fails the
    restored comparison."""
    from freescale.balance.hook import BalanceHook
    from freescale.pipeline.data_stage import METRICS_LAG

    cfg = BalanceConfig(partitioner="sticky", use_cost_model=True, refit_every=1)

    def hook():
        h = BalanceHook(cfg)
        h.planner = Planner(cfg, world_size=8)
        h._states[None] = dict(h.planner.cost_model_state())  # what on_train_start does
        return h

    a = hook()
    start = a._state_for(1)
    by_step = {}
    for step in range(1, 9):
        plan = a.planner.plan(_meta(step), a._state_for(step))
        a._pending[step] = (plan, None, 0.0, {})
        times = [float(x) * (1.0 + 0.1 * step) for x in 1e-3 * plan.rank_tokens + 0.5]
        a.on_metrics(None, step, {"dense_ms_per_rank": times})  # type: ignore[arg-type]
        by_step[step] = dict(a.planner.cost_model_state())
    assert a.observations_applied == 8 and start["kind"] == "power"
    assert by_step[8]["kind"] == "fit" and by_step[8] != by_step[5]  # it kept learning
    for s in range(2, 13):
        want = by_step[s - METRICS_LAG] if s - METRICS_LAG >= 1 else start
        assert a._state_for(s) == want, s
    b = hook()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for s in range(9, 13):
        assert b._state_for(s) == a._state_for(s), s
        assert b.planner.plan(_meta(s), b._state_for(s)).same_as(
            a.planner.plan(_meta(s), a._state_for(s))
        )
    assert b.planner.cost_model.to_dict() == a.planner.cost_model.to_dict()
    # a schedule that had not finished step s - METRICS_LAG's metrics is an error, not a
    # plan with an older state on this rank only
    with pytest.raises(RuntimeError, match="planning step 13 needs the metrics of step 9"):
        a._state_for(13)


# --------------------------------------------------------------------- coordinator
def make_batch(
    seed: int,
    n: int,
    ids: torch.Tensor,
    step: int,
    keys=("uih_item", "uih_action"),
    with_extras: bool = True,
    huge: bool = False,
) -> JaggedBatch:
    g = torch.Generator().manual_seed(seed)
    lens = {k: torch.randint(0, 24, (n,), generator=g) for k in keys}
    if n:
        spikes = torch.rand(n, generator=g) < 0.15
        for k in keys:
            lens[k] = torch.where(spikes, lens[k] * 12 + 50, lens[k])
        if huge:
            lens[keys[0]][0] = 5000
    uih = {k: torch.randint(0, 10**9, (int(lens[k].sum()),), generator=g) for k in keys}
    ncand = torch.randint(1, 5, (n,), generator=g)
    nc = int(ncand.sum())
    return JaggedBatch(
        sample_ids=ids.to(torch.int64),
        uih=uih,
        uih_lengths=lens,
        candidates=torch.randint(0, 10**9, (nc,), generator=g),
        num_candidates=ncand,
        labels=(torch.rand(nc, generator=g) < 0.3).to(torch.float32),
        timestamps={k: torch.randint(0, 2**40, (int(lens[k].sum()),), generator=g) for k in keys}
        if with_extras
        else None,
        true_probs=torch.rand(nc, generator=g, dtype=torch.float64) if with_extras else None,
        step=step,
    )


def make_world(world: int, counts: list[int], step: int, seed: int, **kw) -> list[JaggedBatch]:
    """Every rank's local batch; global sample ids are a permutation (not rank-major)."""
    n = sum(counts)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17))
    out, start = [], 0
    for r in range(world):
        ids = perm[start : start + counts[r]]
        if counts[r] == 0:  # an empty rank's batch lacks the optional fields: legal
            out.append(JaggedBatch.empty(kw.get("keys", ("uih_item", "uih_action")), step=step))
        else:
            out.append(make_batch(seed * 100 + r, counts[r], ids, step, **kw))
        start += counts[r]
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    return t


def assert_batches_identical(got: JaggedBatch, want: JaggedBatch) -> None:
    def same(a, b, what):
        assert a.dtype == b.dtype, what
        assert torch.equal(_bits(a), _bits(b)), what

    same(got.sample_ids, want.sample_ids, "sample_ids")
    assert got.keys == want.keys
    for k in want.keys:
        same(got.uih[k], want.uih[k], f"uih[{k}]")
        same(got.uih_lengths[k].to(torch.int64), want.uih_lengths[k].to(torch.int64), "lengths")
    same(got.candidates, want.candidates, "candidates")
    same(got.num_candidates.to(torch.int64), want.num_candidates.to(torch.int64), "ncand")
    same(got.labels, want.labels, "labels")
    assert (got.timestamps is None) == (want.timestamps is None)
    if want.timestamps is not None:
        for k in want.keys:
            same(got.timestamps[k], want.timestamps[k], f"timestamps[{k}]")
    assert (got.true_probs is None) == (want.true_probs is None)
    if want.true_probs is not None:
        same(got.true_probs, want.true_probs, "true_probs")
    assert got.step == want.step


def expected_local(batches: list[JaggedBatch], plan, rank: int) -> JaggedBatch:
    glob = JaggedBatch.concat([b for b in batches if b.batch_size > 0])
    canon = np.argsort(glob.sample_ids.numpy(), kind="stable")
    return glob.select(torch.from_numpy(canon[plan.assignment.samples_of(rank)]))


COUNTS = {2: [6, 9], 4: [3, 7, 0, 5]}
CASES = [  # (partitioner, shadow, fused gather, extras, huge sample)
    ("fbs", False, False, True, False),
    ("kk", False, True, False, False),
    ("vbs", False, False, True, True),  # empty ranks
    ("kk", True, False, True, False),  # shadow: nothing moves
    ("sticky", False, False, True, False),  # swaps from the real (interleaved) home
]


def _run_cases(comm: Communicator) -> None:
    rank, world = comm.rank, comm.world_size
    counts = COUNTS[world]
    for ci, (name, shadow, fused, extras, huge) in enumerate(CASES):
        planner = Planner(BalanceConfig(partitioner=name, shadow=shadow), world, rank)
        cfg = CoordinatorConfig(max_local_samples=max(counts) if fused else None, verify_plans=True)
        coord = BalanceCoordinator(comm, planner, cfg)
        steps = [10 * ci, 10 * ci + 1]
        worlds = [
            make_world(world, counts, s, seed=1000 * ci + s, with_extras=extras, huge=huge)
            for s in steps
        ]
        # pipelined: stages I+II of both steps in flight before either finishes
        pend = [coord.start(w[rank]) for w in worlds]
        for p in pend:
            p.advance()
        for w, p in zip(worlds, pend):
            out, plan = p.finish()
            st = p.stats
            if shadow or (name == "sticky" and 0 in counts):
                # sticky: the empty rank is the lightest and no swap with it is valid,
                # so the greedy stops at once (documented in partitioners.sticky)
                assert plan.samples_moved == 0 and st.exchange_skipped
                if shadow:
                    assert out is w[rank]
                elif w[rank].batch_size:  # nothing moved: the local batch, canonical order
                    assert_batches_identical(out, expected_local(w, plan, rank))
                else:  # an empty rank keeps its empty batch (optional fields absent)
                    assert out.batch_size == 0
                continue
            assert plan.samples_moved > 0 and not st.exchange_skipped
            assert_batches_identical(out, expected_local(w, plan, rank))
            assert out.batch_size == plan.assignment.counts[rank]
            tot = torch.tensor([st.samples_sent, st.samples_received], dtype=torch.int64)
            dist.all_reduce(tot, group=comm.group)
            assert tot.tolist() == [plan.samples_moved, plan.samples_moved]
            if huge and world > 2:  # one dominant sample: VBS leaves ranks empty
                assert (plan.assignment.counts == 0).any()
    # samples that stay home skip the all-to-all (coordinator._exchange): rank-major ids,
    # equal counts, one swap between the last two ranks; the other ranks keep their whole
    # batch (returned as is), the last two merge kept and received samples on both sides
    _run_swap_edge(comm)
    # single-key batches, no timestamps, balance() convenience
    coord = BalanceCoordinator(comm, Planner(BalanceConfig(partitioner="kk"), world, rank))
    w = make_world(world, counts, 77, seed=5, keys=("uih",), with_extras=False)
    out, plan = coord.balance(w[rank])
    assert_batches_identical(out, expected_local(w, plan, rank))


def swap_edge(costs: np.ndarray, world_size: int, *, sort_key=None) -> Assignment:
    """Test partitioner: the home placement (equal contiguous runs) with the last sample
    of rank W-2 and the first of rank W-1 swapped."""
    a = identity(costs, world_size)
    rank_of = a.rank_of.copy()
    if world_size > 1:
        x, y = int(a.offsets[world_size - 1]) - 1, int(a.offsets[world_size - 1])
        rank_of[x], rank_of[y] = rank_of[y], rank_of[x]
    return Assignment.from_ranks(rank_of, world_size)


def _run_swap_edge(comm: Communicator) -> None:
    if "test_swap_edge" not in PARTITIONERS:
        register_partitioner("test_swap_edge", swap_edge)
    rank, world = comm.rank, comm.world_size
    planner = Planner(BalanceConfig(partitioner="test_swap_edge"), world, rank)
    coord = BalanceCoordinator(comm, planner, CoordinatorConfig(verify_plans=True))
    n = 5
    w = [make_batch(900 + r, n, torch.arange(r * n, (r + 1) * n), 3) for r in range(world)]
    out, plan = coord.balance(w[rank])
    assert plan.samples_moved == 2
    assert_batches_identical(out, expected_local(w, plan, rank))
    st = coord.last_stats
    moved = rank >= world - 2
    assert (st.samples_sent, st.samples_received) == ((1, 1) if moved else (0, 0))
    if not moved:
        assert out is w[rank]  # nothing left or arrived: the local batch, no copy


def _worker(rank: int, world: int, init: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        pair = dist.new_group([0, 1])  # every rank takes part in creating it
        _run_cases(Communicator())  # 4 ranks
        if rank < 2:
            _run_cases(Communicator(pair))  # 2 ranks (one process pool for both sizes)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_coordinator_gloo_2_and_4_ranks_move_exactly_the_planned_samples(tmp_path):
    mp.spawn(_worker, args=(4, f"file://{tmp_path}/store"), nprocs=4, join=True)


def test_coordinator_single_process():
    comm = Communicator()
    assert comm.world_size == 1
    coord = BalanceCoordinator(comm, Planner(BalanceConfig(partitioner="fbs"), world_size=1))
    batch = make_world(1, [7], 3, seed=1)[0]
    out, plan = coord.balance(batch)
    assert plan.samples_moved == 0 and coord.last_stats.exchange_skipped
    order = torch.argsort(batch.sample_ids, stable=True)
    assert_batches_identical(out, batch.select(order))
    with pytest.raises(ValueError, match="max_local_samples"):
        BalanceCoordinator(
            comm, Planner(world_size=1), CoordinatorConfig(max_local_samples=3)
        ).balance(batch)


# ----------------------------------------------------------------------- simulator
def test_simulator_rows_and_speed(capsys):
    cfg = SimConfig(ranks=[256], batch_sizes=[128], steps=50, max_uih=[1024])
    t0 = time.perf_counter()
    rows = simulate(cfg)
    elapsed = time.perf_counter() - t0
    by = {r["partitioner"]: r for r in rows}
    assert set(by) == set(cfg.partitioners)
    assert by["identity"]["moved_share"]["median"] == 0.0
    for name in ("fbs", "kk", "kk_cost"):
        assert by[name]["straggler"]["median"] < by["identity"]["straggler"]["median"]
        assert by[name]["max_over_lb"]["median"] >= 1.0 - 1e-12
    assert by["vbs"]["padding_sparsity"]["median"] < by["fbs"]["padding_sparsity"]["median"]
    with capsys.disabled():
        print(f"\nsimulator: 256 ranks x 128 samples x 50 steps, 6 partitioners: {elapsed:.2f} s")


def test_simulator_rank_noise_is_a_floor_no_partitioner_removes():
    """Per-rank time noise (rank_noise_ms) raises every plan's straggler share, more at
    more ranks (the max over W noisy ranks), and is reproducible; 0 changes nothing."""
    base = dict(batch_sizes=[64], steps=20, max_uih=[1024], partitioners=["identity", "fbs"])
    quiet = {(r["ranks"], r["partitioner"]): r for r in simulate(SimConfig(ranks=[8, 128], **base))}
    cfg = SimConfig(ranks=[8, 128], rank_noise_ms=1.0, **base)
    noisy = {(r["ranks"], r["partitioner"]): r for r in simulate(cfg)}
    again = {(r["ranks"], r["partitioner"]): r for r in simulate(cfg)}
    for key in quiet:
        assert noisy[key]["straggler"] == again[key]["straggler"]
    share = {k: v["straggler"]["median"] for k, v in noisy.items()}
    assert share[(8, "fbs")] > quiet[(8, "fbs")]["straggler"]["median"]
    assert share[(128, "fbs")] > share[(8, "fbs")]
    zero = simulate(SimConfig(ranks=[8], rank_noise_ms=0.0, **base))
    assert [r["straggler"] for r in zero] == [
        quiet[(8, p)]["straggler"] for p in ("identity", "fbs")
    ]
    with pytest.raises(ValueError, match="rank_noise_ms"):
        SimConfig(rank_noise_ms=-1.0)


def test_simulate_main_cli(tmp_path, capsys):
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(x) for x in [5, 20, 300, 41, 1200, 7, 64]) + "\n")
    fit = tmp_path / "fit.json"
    fit.write_text(json.dumps({"a": 1e-4, "b": 5e-8, "c": 0.2}))
    out = tmp_path / "sim.json"
    argv = [
        "--ranks", "8,16", "--batch-size", "4,8", "--steps", "5", "--lengths-file",
        str(lengths), "--cost-model", str(fit), "--json", str(out),
    ]  # fmt: skip
    assert simulate_main(argv) == 0
    text = capsys.readouterr().out
    assert "straggler" in text and "kk_cost" in text
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 2 * 2 * 6
    assert data["config"]["cost_model"]["b"] == 5e-8
    assert simulate_main(["--lengths-file", str(tmp_path / "missing.txt")]) == 2


@pytest.mark.parametrize("shape", [(1, 1), (2, 4), (3, 5), (16, 16), (17, 16), (64, 5)])
def test_transpose_blocks_paths_agree_with_a_per_block_loop(shape):
    """The coordinator's keyed transpose (blocks (x, y) in x-major order -> y-major):
    the concatenating path (few blocks) and the gathering path (many blocks) both equal
    a per-block reference on fresh random sizes, empty blocks included, whatever the
    dtype, and ignore anything after the blocks."""
    from freescale.balance import coordinator as co

    seed = int(np.random.SeedSequence().entropy % (1 << 31))
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 6, shape) * (rng.random(shape) < 0.7)
    total = int(sizes.sum())
    for dtype in (torch.int64, torch.int32, torch.float32):
        buf = (
            torch.randn(total + 3).to(dtype)
            if dtype.is_floating_point
            else torch.randint(-(1 << 30), 1 << 30, (total + 3,), dtype=dtype)
        )
        starts = (np.cumsum(sizes.reshape(-1)) - sizes.reshape(-1)).reshape(shape)
        ref = [
            buf[int(starts[x, y]) : int(starts[x, y] + sizes[x, y])]
            for y in range(shape[1])
            for x in range(shape[0])
        ]
        ref = torch.cat(ref) if ref else buf[:0]
        got = co._transpose_blocks(buf, sizes)
        assert torch.equal(got, ref), (seed, shape, dtype)
        if total:
            for fn in (co._transpose_blocks_cat, co._transpose_blocks_gather):
                assert torch.equal(fn(buf, sizes, total), ref), (seed, fn.__name__, dtype)
        assert got.dtype == dtype
