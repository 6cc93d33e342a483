"""Tests for freescale.metrics: NE / log loss / calibration against TorchRec and a float64
hand computation, AUC against torchmetrics and hand examples with ties, streaming vs
one-shot, and a 2-rank gloo merge equal to one process on the concatenated data."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from freescale.comm import Communicator, HostStagedCommunicator
from freescale.metrics import (
    HAVE_TORCHMETRICS,
    AUCAccumulator,
    NEAccumulator,
    ThroughputMeter,
    auc,
    normalized_entropy,
    reference_auc,
)

torch.set_num_threads(1)


def _data(seed: int, n: int, pos_rate: float = 0.3, weighted: bool = True):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, generator=g) * 2.0
    labels = (torch.rand(n, generator=g) < pos_rate).float()
    weights = torch.rand(n, generator=g) + 0.1 if weighted else None
    return logits, labels, weights


def _hand_ne(probs, labels, weights):
    """NE / log loss / calibration with Python floats (float64), natural log."""
    p = [min(max(float(x), 1e-12), 1 - 1e-12) for x in probs]
    y = [float(x) for x in labels]
    w = [1.0] * len(p) if weights is None else [float(x) for x in weights]
    ce = sum(-wi * (yi * math.log(pi) + (1 - yi) * math.log(1 - pi)) for pi, yi, wi in zip(p, y, w))
    wsum = sum(w)
    pos = sum(wi * yi for yi, wi in zip(y, w))
    m = pos / wsum
    ent = -(m * math.log(m) + (1 - m) * math.log(1 - m))
    calib = sum(wi * float(pi) for pi, wi in zip(probs, w)) / pos
    return (ce / wsum) / ent, ce / wsum, calib


# --------------------------------------------------------------------------- NE
@pytest.mark.parametrize("seed", [0, 1])
def test_ne_matches_torchrec(seed: int) -> None:
    ne_mod = pytest.importorskip("torchrec.metrics.ne")
    logits, labels, weights = _data(100 + seed, 4000)
    probs32 = torch.sigmoid(logits)
    ours = normalized_entropy(labels, probs=probs32, weights=weights)
    # TorchRec sums float32 inputs in float32, we always sum in float64: give it
    # float64 inputs for the exact comparison, float32 ones at float32 accuracy
    st32 = ne_mod.get_ne_states(labels, probs32.clone(), weights, 1e-12)
    ne32 = ne_mod.compute_ne(
        st32["cross_entropy_sum"],
        st32["weighted_num_samples"],
        st32["pos_labels"],
        st32["neg_labels"],
        1e-12,
    )
    assert ours.ne == pytest.approx(float(ne32), rel=1e-6)
    probs, labels, weights = probs32.double(), labels.double(), weights.double()

    # TorchRec's functional pieces
    st = ne_mod.get_ne_states(labels, probs.clone(), weights, 1e-12)
    ne_ref = ne_mod.compute_ne(
        st["cross_entropy_sum"],
        st["weighted_num_samples"],
        st["pos_labels"],
        st["neg_labels"],
        1e-12,
    )
    ll_ref = ne_mod.compute_logloss(
        st["cross_entropy_sum"], st["pos_labels"].clone(), st["neg_labels"], 1e-12
    )
    assert ours.ne == pytest.approx(float(ne_ref), rel=1e-12)
    assert ours.logloss / math.log(2.0) == pytest.approx(float(ll_ref), rel=1e-12)

    # TorchRec's NEMetricComputation (the state machine NEMetric drives), two batches
    from torchrec.metrics.metrics_config import RecComputeMode, RecTaskInfo

    task = RecTaskInfo(name="t", label_name="l", prediction_name="p", weight_name="w")
    metric = ne_mod.NEMetric(
        world_size=1,
        my_rank=0,
        batch_size=2000,
        tasks=[task],
        compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
        window_size=100_000,
        include_logloss=True,
    )
    for sl in (slice(0, 2000), slice(2000, 4000)):
        metric.update(
            predictions={"t": probs[sl].clone()},
            labels={"t": labels[sl]},
            weights={"t": weights[sl]},
        )
    # NEMetric.compute() trips over torchmetrics>=1.9 (frozen report dataclass); read
    # the computation's reports directly
    reports = {
        (r.name.value, r.metric_prefix.value): float(r.value)
        for r in metric._metrics_computations[0]._compute()
    }
    assert ours.ne == pytest.approx(reports[("ne", "lifetime_")], rel=1e-12)
    assert ours.logloss / math.log(2.0) == pytest.approx(
        reports[("logloss", "lifetime_")], rel=1e-12
    )

    calib_mod = pytest.importorskip("torchrec.metrics.calibration")
    cs = calib_mod.get_calibration_states(labels.double(), probs.double(), weights.double())
    ref_cal = calib_mod.compute_calibration(cs["calibration_num"], cs["calibration_denom"])
    assert ours.calibration == pytest.approx(float(ref_cal), rel=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_ne_matches_float64_hand(weighted: bool) -> None:
    logits, labels, weights = _data(7, 500, weighted=weighted)
    probs = torch.sigmoid(logits.double())
    res = normalized_entropy(labels, logits=logits, weights=weights)
    ne, ll, cal = _hand_ne(probs.tolist(), labels.tolist(), None if weights is None else weights)
    assert res.ne == pytest.approx(ne, rel=1e-10)
    assert res.logloss == pytest.approx(ll, rel=1e-10)
    assert res.calibration == pytest.approx(cal, rel=1e-10)
    w64 = None if weights is None else weights.double()
    bce = F.binary_cross_entropy(probs, labels.double(), weight=w64, reduction="sum")
    wsum = float(w64.sum()) if w64 is not None else len(labels)
    assert res.logloss == pytest.approx(float(bce) / wsum, rel=1e-10)
    # logits and probabilities give the same result
    res_p = normalized_entropy(labels, probs=probs, weights=weights)
    assert res_p.ne == pytest.approx(res.ne, rel=1e-14)


def test_ne_edge_cases() -> None:
    # perfect predictor of a constant label: eta-clamped, finite
    labels = torch.ones(10)
    r = normalized_entropy(labels, probs=torch.ones(10))
    assert math.isfinite(r.ne)
    # empty: NaN, no crash
    e = NEAccumulator().compute()
    assert math.isnan(e.ne) and e.num_samples == 0.0 and e.calibration == 0.0
    with pytest.raises(ValueError):
        NEAccumulator().update(labels=labels, logits=torch.zeros(10), probs=torch.zeros(10))
    with pytest.raises(ValueError):
        NEAccumulator().update(labels=labels, logits=torch.zeros(9))
    # predicting the base rate gives NE == 1
    y = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert normalized_entropy(y, probs=torch.full((4,), 0.25)).ne == pytest.approx(1.0, rel=1e-12)


def test_ne_streaming_equals_one_shot() -> None:
    logits, labels, weights = _data(3, 3001)
    one = normalized_entropy(labels, logits=logits, weights=weights)
    acc = NEAccumulator()
    bounds = [0, 1, 17, 500, 501, 2000, 3001]
    for a, b in itertools.pairwise(bounds):
        acc.update(labels=labels[a:b], logits=logits[a:b], weights=weights[a:b])
    got = acc.compute()
    assert got.ne == pytest.approx(one.ne, rel=1e-12)
    assert got.logloss == pytest.approx(one.logloss, rel=1e-12)
    assert got.calibration == pytest.approx(one.calibration, rel=1e-12)
    # local merge and the world-of-one merge
    a, b = NEAccumulator(), NEAccumulator()
    a.update(labels=labels[:1000], logits=logits[:1000], weights=weights[:1000])
    b.update(labels=labels[1000:], logits=logits[1000:], weights=weights[1000:])
    merged = a.add_(b).merge(Communicator()).compute()
    assert merged.ne == pytest.approx(one.ne, rel=1e-12)


# -------------------------------------------------------------------------- AUC
def _pairwise_auc(scores, labels) -> float:
    pos = [s for s, y in zip(scores, labels) if y == 1]
    neg = [s for s, y in zip(scores, labels) if y == 0]
    tot = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    return tot / (len(pos) * len(neg))


AUC_CASES = [
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),
    ([0.5, 0.5], [1, 0], 0.5),
    ([0.2, 0.2, 0.6, 0.6, 0.9], [0, 1, 0, 1, 1], 4.0 / 6.0),
    ([1.0, 1.0, 1.0, 0.0], [1, 0, 1, 0], 0.75),
    ([0.3, 0.7], [1, 0], 0.0),
]


@pytest.mark.parametrize("backend", ["reference", "torchmetrics"])
@pytest.mark.parametrize("case", AUC_CASES)
def test_auc_hand_examples_with_ties(case, backend: str) -> None:
    if backend == "torchmetrics" and not HAVE_TORCHMETRICS:
        pytest.skip("torchmetrics not installed")
    scores, labels, expected = case
    assert _pairwise_auc(scores, labels) == pytest.approx(expected, abs=1e-15)
    got = auc(torch.tensor(scores), torch.tensor(labels), backend=backend)
    # torchmetrics accumulates in float32
    assert got == pytest.approx(expected, abs=1e-12 if backend == "reference" else 1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_torchmetrics_and_pairwise(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = 400
    scores = torch.randint(0, 25, (n,), generator=g).float() / 25  # many ties
    labels = (torch.rand(n, generator=g) < 0.4).long()
    expected = _pairwise_auc(scores.tolist(), labels.tolist())
    assert reference_auc(scores, labels) == pytest.approx(expected, abs=1e-12)
    if HAVE_TORCHMETRICS:
        from torchmetrics.classification import BinaryAUROC

        m = BinaryAUROC()
        m.update(scores, labels)
        assert float(m.compute()) == pytest.approx(expected, abs=1e-6)
        assert auc(scores, labels, backend="torchmetrics") == pytest.approx(expected, abs=1e-6)


def test_auc_weights_large_logits_and_one_class() -> None:
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(0, 10, (60,), generator=g).float()
    labels = (torch.rand(60, generator=g) < 0.5).float()
    reps = torch.randint(1, 4, (60,), generator=g)
    # integer weights == repeated samples
    rep_s = scores.repeat_interleave(reps)
    rep_y = labels.repeat_interleave(reps)
    assert auc(scores, labels, reps.double()) == pytest.approx(
        _pairwise_auc(rep_s.tolist(), rep_y.tolist()), abs=1e-12
    )
    # large logits must not collapse into ties (float32 sigmoid would)
    s = torch.tensor([40.0, 41.0, 42.0])
    y = torch.tensor([0, 1, 1])
    for backend in ("reference", "auto"):
        assert auc(s, y, backend=backend) == 1.0
    # a single class: 0.0, as torchmetrics
    assert reference_auc(torch.rand(5), torch.ones(5)) == 0.0
    assert reference_auc(torch.rand(5), torch.zeros(5)) == 0.0
    assert reference_auc(torch.zeros(0), torch.zeros(0)) == 0.0
    if HAVE_TORCHMETRICS:
        assert auc(torch.rand(5), torch.ones(5), backend="torchmetrics") == 0.0
    with pytest.raises(ValueError):
        auc(s, y, torch.ones(3), backend="torchmetrics")


def test_auc_streaming_equals_one_shot_and_bound() -> None:
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(1000, generator=g).round(decimals=1)
    labels = (torch.rand(1000, generator=g) < 0.3).float()
    acc = AUCAccumulator(max_samples=1000)
    for a, b in itertools.pairwise([0, 3, 400, 401, 1000]):
        acc.update(scores[a:b], labels[a:b])
    assert acc.compute() == pytest.approx(auc(scores, labels), abs=1e-12)
    assert acc.compute(Communicator()) == pytest.approx(auc(scores, labels), abs=1e-12)
    with pytest.raises(ValueError, match="max_samples"):
        acc.update(scores[:1], labels[:1])
    a2 = AUCAccumulator()
    a2.update(scores[:2], labels[:2])
    with pytest.raises(ValueError, match="weights"):
        a2.update(scores[:2], labels[:2], torch.ones(2))


# -------------------------------------------------------------------------- QPS
def test_throughput_meter_window_and_lifetime() -> None:
    now = [0.0]
    m = ThroughputMeter(window=2, clock=lambda: now[0])
    for t, s in [(1.0, 10), (2.0, 20), (4.0, 30)]:
        now[0] = t
        m.step(samples=s, candidates=2 * s, tokens=100 * s)
    life = m.lifetime_rates()
    assert life.samples_per_s == pytest.approx(60 / 4.0)
    assert life.tokens_per_s == pytest.approx(6000 / 4.0)
    assert life.steps_per_s == pytest.approx(3 / 4.0)
    win = m.window_rates()  # last 2 steps: from t=1 to t=4, 50 samples
    assert win.samples_per_s == pytest.approx(50 / 3.0)
    assert win.candidates_per_s == pytest.approx(100 / 3.0)
    assert m.totals["samples"] == 60
    m.start()
    assert m.lifetime_rates().samples_per_s == 0.0
    g = m.global_rates(Communicator())
    assert g.samples_per_s == 0.0


# ------------------------------------------------------------------ 2 ranks, gloo
def _check_merge(comm: Communicator, rank: int, world: int, sizes: list[int]) -> None:
    parts = [_data(1000 + r, sizes[r]) for r in range(world)]
    logits, labels, weights = parts[rank]

    ne = NEAccumulator()
    if sizes[rank]:
        ne.update(labels=labels, logits=logits, weights=weights)
    merged = ne.merge(comm).compute()
    cat = [torch.cat([p[i] for p in parts]) for i in range(3)]
    one = normalized_entropy(cat[1], logits=cat[0], weights=cat[2])
    assert merged.ne == pytest.approx(one.ne, rel=1e-12), (merged, one)
    assert merged.logloss == pytest.approx(one.logloss, rel=1e-12)
    assert merged.calibration == pytest.approx(one.calibration, rel=1e-12)
    assert merged.num_samples == pytest.approx(one.num_samples, rel=1e-12)

    # AUC with tied scores across ranks
    a = AUCAccumulator()
    if sizes[rank]:
        a.update(logits.round(decimals=1), labels)
    got = a.compute(comm)
    want = auc(cat[0].round(decimals=1), cat[1])
    assert got == pytest.approx(want, abs=1e-12), (got, want)
    aw = AUCAccumulator(backend="reference")
    if sizes[rank]:
        aw.update(logits.round(decimals=1), labels, weights)
    want_w = reference_auc(cat[0].round(decimals=1), cat[1], cat[2])
    assert aw.compute(comm) == pytest.approx(want_w, abs=1e-12)


def _dist_worker(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        comm = Communicator()
        for sizes in ([700, 0], [311, 45]):  # first: rank 1 sees nothing
            _check_merge(comm, rank, world, sizes)
        # a backend without reductions: the NE merge gathers and sums instead
        hs = HostStagedCommunicator.create()
        _check_merge(hs, rank, world, [311, 45])
        hs.close()

        m = ThroughputMeter(clock=lambda: 0.0)
        m.step(samples=10 * (rank + 1), now=2.0 * (rank + 1))
        g = m.global_rates(comm)
        total = sum(10 * (r + 1) for r in range(world))
        assert g.samples_per_s == pytest.approx(total / (2.0 * world))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_merge_across_two_ranks_equals_single_process(tmp_path) -> None:
    store = os.path.join(tmp_path, "store")
    mp.spawn(_dist_worker, args=(2, store), nprocs=2, join=True)
