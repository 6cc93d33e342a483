"""sdd (DESIGN.md section 3): the next step's id dist ahead, bit-for-bit equal to vanilla.

Multi-rank cases run on real gloo ranks from the shared pools (tests/conftest.py). Most
drive the embedding modules directly: every rank feeds the same per-rank synthetic ids
(Zipf-like items over a 300-row table, a 3-row action table, candidates) to a vanilla
collection and to an :class:`SddEmbeddingCollection`, with a learning-rate schedule and
a random-weighted loss, and the final shard rows and optimizer state are compared with
``torch.equal``. One case trains the real Trainer with ``TrainConfig(mode="sdd")``
(mid-run evaluations and checkpoint-like flushes) against the vanilla Trainer. The
activity counters show the lookahead ran on every step but the first (and after each
flush); deliberate bugs (:data:`~freescale.embedding.sdd.MUTATIONS`) break equality.
About 30 s on 2 shared cores (the pools start once per session).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freescale.comm.base import Communicator
from freescale.config import SparseOptimConfig, TableConfig
from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.prioritized import make_embedding_collection
from freescale.embedding.sdd import MUTATIONS, SddEmbeddingCollection
from freescale.pipeline.trainer import Trainer
from test_prioritized import _Snapshot, _sparse_state, config, differences, run

STEPS = 60  # steps per direct-drive run
IDS_KEY = "gloo:all_to_all:ids"
TABLES = [TableConfig("item", 300, 8, ["uih", "cand"]), TableConfig("act", 3, 8, ["act"])]


def features(rank: int, step: int) -> dict:
    """Per-rank ids of one step: item ids concentrated on low rows (many repeats within
    and across steps and ranks), a 3-row action table, two candidates per sample."""
    g = torch.Generator().manual_seed(1_000_003 * rank + step)
    lengths = torch.randint(0, 12, (4,), generator=g)
    n = int(lengths.sum())
    u = torch.rand(n, generator=g)
    return {
        "uih": ((u * u * 300).long().clamp_max(299), lengths),
        "act": (torch.randint(0, 3, (n,), generator=g), lengths),
        "cand": (torch.randint(0, 300, (8,), generator=g), torch.full((4,), 2)),
    }


def lr_at(step: int) -> float:
    return 0.05 / (1.0 + 0.05 * step)  # a schedule: a stale lr would show


def drive(
    rank: int,
    world: int,
    kind: str,
    mode: str,
    steps: int = STEPS,
    opts: tuple = (),
    wrong_ahead_at: int | None = None,
    eval_every: int = 0,
    timing: bool = False,
) -> dict:
    """Train ``mode``'s collection for ``steps`` steps on this rank's ids; return its
    state and counters. ``wrong_ahead_at``: at that step, ``next_features`` are the ids
    of another batch. ``eval_every``: a no-grad eval forward after every such step."""
    comm = Communicator(None, name="embedding")  # the pool's default gloo group
    optim = SparseOptimConfig(kind, lr=0.05)
    if mode == "sdd":  # directly: the factory passes no test-only option
        emb = SddEmbeddingCollection(TABLES, comm, optim, seed=3, timing=timing, **dict(opts))
    else:
        emb = make_embedding_collection(mode, TABLES, comm, optim, seed=3, timing=timing)
    init = emb.weight.clone()
    sdd = isinstance(emb, SddEmbeddingCollection)
    for t in range(1, steps + 1):
        emb.set_step(t, lr_at(t))
        feats = features(rank, t)
        if sdd:
            nxt = None if t == steps else features(rank, t + 1)
            if t == wrong_ahead_at:
                nxt = features(rank, t + 1000)
            out = emb(feats, next_features=nxt)
        else:
            out = emb(feats)
        g = torch.Generator().manual_seed(100_003 * rank + t)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values()).backward()
        if eval_every and t % eval_every == 0:
            emb.eval()
            with torch.no_grad():
                emb(features(rank, 10_000 + t))
            emb.train()
    return {
        "weight": emb.weight.clone(),
        "optim": {k: v.clone() for k, v in emb.optimizer.state.items()},
        "changed": not torch.equal(init, emb.weight),
        "sdd": emb.sdd_stats.as_dict() if sdd else None,
        "times": dict(emb.stats.times),
        "rows_updated": emb.stats.rows_updated,
        "id_a2a": {  # all-to-alls of ids issued on each communicator
            "main": comm.stats.calls.get(IDS_KEY, 0),
            "side": emb.side_comm.stats.calls.get(IDS_KEY, 0) if sdd else 0,
        },
    }


_CACHE: dict = {}


def drive_all(pool, kind, mode="vanilla", **kw) -> list[dict]:
    key = (pool.world_size, kind, mode, tuple(sorted(kw.items())))
    if key not in _CACHE:
        _CACHE[key] = pool.run(drive, kind, mode, **kw)
    return _CACHE[key]


def state_differences(a: list[dict], b: list[dict]) -> list[str]:
    bad = []
    for r, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x["weight"], y["weight"]):
            bad.append(f"rank{r}.weight")
        for k in x["optim"]:
            if not torch.equal(x["optim"][k], y["optim"][k]):
                bad.append(f"rank{r}.optim.{k}")
    return bad


# --------------------------------------------------------- bitwise, active
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("world", [2, 4])
def test_bitwise_equal_to_vanilla(world, kind, pool2, pool4):
    pool = {2: pool2, 4: pool4}[world]
    van = drive_all(pool, kind)
    sdd = drive_all(pool, kind, "sdd")
    assert state_differences(sdd, van) == []
    assert all(r["changed"] for r in van), "the run must update the tables"
    for r in sdd:
        # the lookahead supplied every step's id dist but the first's
        assert r["sdd"] == {
            "ahead_steps": STEPS - 1,
            "sync_steps": 1,
            "lookaheads": STEPS - 1,
            "dropped": 0,
        }
    assert [r["rows_updated"] for r in sdd] == [r["rows_updated"] for r in van]
    # the ids of steps 2.. went over the side group, only step 1's over the main one
    assert all(r["id_a2a"] == {"main": STEPS, "side": 0} for r in van)
    assert all(r["id_a2a"] == {"main": 1, "side": STEPS - 1} for r in sdd)


def test_eval_drops_the_lookahead_and_stays_exact(pool2):
    """A no-grad eval forward every 20 steps drops the lookahead (on every rank); the
    step after it runs its own id dist."""
    van = drive_all(pool2, "adam", eval_every=20)
    sdd = drive_all(pool2, "adam", "sdd", eval_every=20)
    assert state_differences(sdd, van) == []
    for r in sdd:
        # evaluations after 20 and 40 drop a lookahead; after 60 there is none
        assert r["sdd"] == {
            "ahead_steps": STEPS - 3,
            "sync_steps": 3,
            "lookaheads": STEPS - 1,
            "dropped": 2,
        }


def test_timing_keys(pool2):
    """``timing=True``: the lookahead's id dist is timed as ``id_dist_ahead``; the
    trainer's forward keys cover it."""
    res = drive_all(pool2, "sgd", "sdd", steps=5, timing=True)
    for r in res:
        assert r["times"]["id_dist_ahead"] > 0 and r["times"]["id_dist"] > 0
        assert set(r["times"]) <= set(
            SddEmbeddingCollection.forward_time_keys + SddEmbeddingCollection.backward_time_keys
        )


# ----------------------------------------------------------------- mutations
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutation_is_caught(mutation, pool2):
    """``unchecked_lookahead``: the lookahead of step 10 dist'ed another batch's ids and
    the check is off; ``stale_step_lr``: step t+1 updates with step t's lr (schedule)."""
    kw = {"wrong_ahead_at": 10} if mutation == "unchecked_lookahead" else {}
    van = drive_all(pool2, "rowwise_adagrad")
    bad = drive_all(pool2, "rowwise_adagrad", "sdd", opts=(("_mutation", mutation),), **kw)
    diff = state_differences(bad, van)
    print(f"{mutation}: {diff}")
    assert diff, f"mutation '{mutation}' was not caught"


def drive_expecting_error(rank: int, world: int, *args, **kw) -> str:
    try:
        drive(rank, world, *args, **kw)
    except ValueError as e:
        return str(e)
    return "no error"


def test_wrong_lookahead_is_rejected(pool2):
    """The same wrong lookahead as the ``unchecked_lookahead`` mutation, check on: every
    rank raises at step 11, before issuing any collective of that step (so the pool's
    ranks are left in a clean state and the error is returned, not raised)."""
    msgs = pool2.run(drive_expecting_error, "rowwise_adagrad", "sdd", wrong_ahead_at=10)
    for m in msgs:
        assert "feature 'uih' of this step differs from the next_features" in m, m


# ------------------------------------------------------------ real trainer
def train_sdd(rank, world, cfg, snapshot_steps):
    snap = _Snapshot(tuple(snapshot_steps))
    tr = Trainer(cfg, hooks=[snap])
    assert isinstance(tr.sparse, SddEmbeddingCollection)
    tr.train()
    out = {
        **_sparse_state(tr),
        "dense": {k: v.detach().clone() for k, v in tr.dense.state_dict().items()},
        "eval": [
            {k: v for k, v in e.items() if k in ("step", "eval_ne", "eval_auc")}
            for e in tr.eval_history
        ],
        "snapshots": snap.taken,
        "sdd": tr.sparse.sdd_stats.as_dict(),
    }
    tr.close()
    return out


def test_trainer_mode_sdd_is_bitwise_vanilla(pool2):
    """``TrainConfig(mode="sdd")`` end to end (the same run as test_prioritized's flush
    case): sparse rows, optimizer state, dense weights, eval metrics and mid-run
    snapshots equal the vanilla Trainer's; every flush costs one step its lookahead."""
    snaps = (30, 45)
    cfg = config("adam", 60, eval_every=20)
    van = run(pool2, cfg, snapshot_steps=snaps)
    sdd = pool2.run(train_sdd, dataclasses.replace(cfg, mode="sdd"), snaps)
    assert differences(sdd, van) == []
    assert len(sdd[0]["eval"]) == 3 and len(sdd[0]["snapshots"]) == 2
    # flushed (evaluation / snapshot) after 20, 30, 40, 45: those lookaheads are dropped
    for r in sdd:
        s = r["sdd"]
        assert s["dropped"] == 4, s
        assert s["sync_steps"] == 5 and s["ahead_steps"] == 55, s


# ------------------------------------------------------------ single process
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_single_process(kind):
    van = drive(0, 1, kind, "vanilla", steps=30)
    sdd = drive(0, 1, kind, "sdd", steps=30, eval_every=10)
    ref = drive(0, 1, kind, "vanilla", steps=30, eval_every=10)
    assert state_differences([sdd], [van]) == [] and state_differences([ref], [van]) == []
    assert van["changed"]
    assert sdd["sdd"] == {"ahead_steps": 27, "sync_steps": 3, "lookaheads": 29, "dropped": 2}


def _one_step(emb, t, nxt):
    emb.set_step(t, lr_at(t))
    out = emb(features(0, t), next_features=nxt)
    sum(o.sum() for o in out.values()).backward()


def test_lookahead_must_match_the_next_call():
    emb = SddEmbeddingCollection(TABLES, Communicator(None), SparseOptimConfig("sgd", lr=0.1))
    _one_step(emb, 1, features(0, 2))
    emb.set_step(2)
    with pytest.raises(ValueError, match="feature 'uih' of this step differs"):
        emb(features(0, 3), next_features=None)
    # equal values in new tensors pass (by equality, not identity); flush drops it
    _one_step(emb, 1, features(0, 2))
    _one_step(emb, 2, None)
    assert emb.sdd_stats.ahead_steps == 1
    _one_step(emb, 3, features(0, 4))
    emb.flush()
    _one_step(emb, 4, None)  # nothing ahead any more: runs its own id dist
    assert emb.sdd_stats.dropped == 1 and emb.sdd_stats.ahead_steps == 1


def test_factory_and_options():
    comm, opt = Communicator(None), SparseOptimConfig("sgd", lr=0.1)
    side = Communicator(None, name="mine")
    m = make_embedding_collection("sdd", TABLES, comm, opt, side_comm=side)
    assert isinstance(m, SddEmbeddingCollection) and m.side_comm is side
    assert m.uses_next_features
    own = make_embedding_collection("sdd", TABLES, comm, opt)
    assert own.side_comm.name == "embedding-side" and own.side_comm.world_size == 1
    assert type(make_embedding_collection("vanilla", TABLES, comm, opt)) is (
        ShardedEmbeddingCollection
    )
    with pytest.raises(ValueError, match="only side_comm"):
        make_embedding_collection("sdd", TABLES, comm, opt, max_collision_rate=0.5)
    with pytest.raises(ValueError, match="vanilla, sdd, prioritized"):
        make_embedding_collection("nope", TABLES, comm, opt)
    with pytest.raises(ValueError, match="mutation"):
        SddEmbeddingCollection(TABLES, comm, opt, _mutation="nope")
    wide = Communicator(None)
    wide.world_size = 2
    with pytest.raises(ValueError, match="same ranks"):
        SddEmbeddingCollection(TABLES, comm, opt, side_comm=wide)
