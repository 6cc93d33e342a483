"""Prioritized embedding updates: tier 1 (bit-for-bit equal to vanilla), mutations, guardrail.

Every multi-rank case trains the real :class:`~freescale.pipeline.trainer.Trainer` on real
gloo ranks (shared pools, tests/conftest.py) twice, once with the vanilla collection and
once with :class:`PrioritizedEmbeddingCollection` swapped in before training, and compares
sparse rows, optimizer state and dense parameters with ``torch.equal``. Data: synthetic,
Zipf items over a small table plus collision injection (``overlap=0.4``) and a 3-row action
table, so about 80% of the id occurrences of a step (45% of its distinct rows) hit rows of
the previous step. Step counts: 200 steps per optimizer (SGD, row-wise Adagrad, Adam) at
2 and at 4 ranks; the mutation and flush cases run 60 steps, the guardrail cases 60 and
200, at 2 ranks. About two minutes on 2 shared cores.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics

import pytest
import torch

from freescale.comm.base import Communicator
from freescale.config import (
    DataConfig,
    ModelConfig,
    SparseOptimConfig,
    TableConfig,
    TrainConfig,
)
from freescale.data.batch import JaggedBatch
from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.prioritized import (
    MUTATIONS,
    PrioritizedEmbeddingCollection,
    make_embedding_collection,
    side_orders_on_device,
)
from freescale.pipeline.trainer import Trainer, TrainerHook

STEPS_2 = 200  # steps per optimizer at 2 ranks
STEPS_4 = 200  # steps per optimizer at 4 ranks
STEPS_SHORT = 60  # mutation and flush cases


def config(kind: str, steps: int, eval_every: int = 0) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            seed=11,
            global_batch_size=8,
            num_items=300,
            num_actions=3,
            median_uih=6,
            max_uih=16,
            num_candidates=2,
            eval_samples=8,
            overlap=0.4,
            zipf_s=1.1,
        ),
        model=ModelConfig(
            embedding_dim=8, num_layers=1, num_heads=2, max_positions=64, dtype="float32"
        ),
        sparse_optim=SparseOptimConfig(kind=kind, lr=0.05),
        steps=steps,
        eval_every=eval_every,
        progress=False,
        device="cpu",
        dense_lr=1e-2,
        log_every=10_000,
    )


class _Snapshot(TrainerHook):
    """A mid-run checkpoint: at the given steps, flush and copy the shard state."""

    def __init__(self, steps: tuple[int, ...]):
        self.steps = steps
        self.taken: dict[int, dict] = {}

    def on_metrics(self, trainer, step, record):
        if step in self.steps:
            trainer.flush()
            self.taken[step] = _sparse_state(trainer)


class _AllOnRankZero(TrainerHook):
    """A legal placement: rank 0 trains the whole global batch, the others nothing."""

    def on_batch(self, trainer, step, batch):
        gb = trainer.source.global_batch(step)
        out = gb if trainer.rank == 0 else JaggedBatch.empty(trainer.uih_keys, step)
        out.extras = batch.extras
        return out


def _sparse_state(tr: Trainer) -> dict:
    return {
        "tables": {n: v.clone() for n, (_, v) in tr.sparse.shard_tables().items()},
        "optim": {
            n: {k: v.clone() for k, (_, v) in d.items()}
            for n, d in tr.sparse.shard_optimizer_state().items()
        },
    }


def train_run(rank, world, cfg, mode, opts, snapshot_steps=(), all_on_rank_zero=False):
    """One training run; returns the final state, counters and mid-run observations."""
    snap = _Snapshot(tuple(snapshot_steps))
    hooks = [snap] + ([_AllOnRankZero()] if all_on_rank_zero else [])
    tr = Trainer(cfg, hooks=hooks)
    if mode != "vanilla":
        tr.sparse = make_embedding_collection(
            mode,
            tr.tables,
            tr.emb_comm,
            cfg.sparse_optim,
            device=tr.device,
            dtype=tr.dtype,
            seed=cfg.seed,
            timing=True,
            **dict(opts),
        )
        tr.sparse.sparse_update = cfg.sparse_update  # as the Trainer sets it on its own
    summary = tr.train()
    out = {
        **_sparse_state(tr),
        "dense": {k: v.detach().clone() for k, v in tr.dense.state_dict().items()},
        "eval": [
            {k: v for k, v in e.items() if k in ("step", "eval_ne", "eval_auc")}
            for e in tr.eval_history
        ],
        "snapshots": snap.taken,
        "steps": tr.step,
        "rows_updated": tr.sparse.stats.rows_updated,
        "rows_grouped_ahead": tr.sparse.stats.rows_grouped_ahead,
        "ne": summary.get("eval_ne"),
    }
    if isinstance(tr.sparse, PrioritizedEmbeddingCollection):
        ps = tr.sparse.pstats
        out["pstats"] = ps.as_dict()
        out["history"] = list(ps.history)
        out["peak_memory"] = tr.sparse.peak_extra_memory_bytes()
        out["memory_after"] = tr.sparse.extra_memory_bytes()
        out["mutation_fired"] = tr.sparse._mutation_fired
    tr.close()
    return out


def _pool(world, pool2, pool4):
    return {2: pool2, 4: pool4}[world]


_CACHE: dict = {}


def run(pool, cfg, mode="vanilla", snapshot_steps=(), all_on_rank_zero=False, **opts):
    """Cached pool run (vanilla references are shared between tests)."""
    key = (
        pool.world_size,
        repr(cfg),
        mode,
        tuple(sorted(opts.items())),
        tuple(snapshot_steps),
        all_on_rank_zero,
    )
    if key not in _CACHE:
        _CACHE[key] = pool.run(
            train_run, cfg, mode, tuple(sorted(opts.items())), snapshot_steps, all_on_rank_zero
        )
    return _CACHE[key]


def differences(a: list[dict], b: list[dict]) -> list[str]:
    """Names of every tensor that is not bit-for-bit equal between two runs."""
    bad = []

    def cmp(x, y, where):
        if isinstance(x, dict):
            for k in x:
                cmp(x[k], y[k], f"{where}.{k}")
        elif isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                bad.append(where)
        elif isinstance(x, list):
            for i, (u, v) in enumerate(zip(x, y)):
                cmp(u, v, f"{where}[{i}]")
        elif x != y and not (x != x and y != y):  # NaN == NaN here
            bad.append(where)

    for r, (x, y) in enumerate(zip(a, b)):
        for part in ("tables", "optim", "dense", "eval", "snapshots"):
            cmp(x[part], y[part], f"rank{r}.{part}")
    return bad


def assert_really_active(res: list[dict], steps: int, prepared: bool = True) -> None:
    for r in res:
        ps = r["pstats"]
        # the Trainer calls prepare_backward before every loss.backward(); on CPU the mask
        # exchange is always on the host by then, so every backward is prepared early
        assert ps["prepared_steps"] == (steps if prepared else 0), ps
        assert ps["prioritized_steps"] == steps - 2, ps  # all but the first and the last
        assert ps["sync_steps"] == 2, ps
        assert ps["fallbacks"] == 0, ps
        assert ps["collision_rows"] > 0 and ps["exclusive_rows"] > 0, ps
        assert r["history"] == res[0]["history"], "every rank takes the same decisions"
    assert sum(r["pstats"]["deferred_rows"] for r in res) > 0


# ------------------------------------------------------------------ tier 1
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("world", [2, 4])
def test_bitwise_equal_to_vanilla(world, kind, pool2, pool4):
    pool = _pool(world, pool2, pool4)
    steps = STEPS_2 if world == 2 else STEPS_4
    cfg = config(kind, steps)
    van = run(pool, cfg)
    pri = run(pool, cfg, "prioritized", max_collision_rate=1.0)
    rate = pri[0]["pstats"]["collision_rate"]
    print(
        f"{kind} at {world} ranks, {steps} steps: collision rate {rate['distinct']:.3f} of "
        f"distinct rows, {rate['occurrence']:.3f} of occurrences; "
        f"peak extra memory {pri[0]['peak_memory']}"
    )
    assert differences(pri, van) == []
    assert all(r["steps"] == steps for r in pri)
    assert_really_active(pri, steps)
    # nothing is left over after training; the rows updated are the vanilla ones
    for r in pri:
        after = r["memory_after"]
        assert after["total"] == after["collision_bitmap"], after
    assert sum(r["rows_updated"] for r in pri) == sum(r["rows_updated"] for r in van)
    peak = pri[0]["peak_memory"]
    for key in ("ids_ahead", "exclusive_embeddings", "deferred_gradients", "masks"):
        assert peak[key] > 0, peak


def test_empty_rank_is_legal(pool2):
    """All samples on rank 0 (a legal placement, as balancing may produce): rank 1 sends no
    id, yet owns rows and receives ids, masks and gradients."""
    cfg = config("rowwise_adagrad", 40)
    van = run(pool2, cfg, all_on_rank_zero=True)
    pri = run(pool2, cfg, "prioritized", all_on_rank_zero=True, max_collision_rate=1.0)
    assert differences(pri, van) == []
    assert_really_active(pri, 40)


def test_random_side_delays_change_nothing(pool2):
    """``debug_delay_s``: random sleeps before the deferred update and the exclusive
    lookup (host sleeps on CPU; ``torch.cuda._sleep`` on the side stream on GPU)."""
    cfg = config("adam", 40)
    van = run(pool2, cfg)
    pri = run(pool2, cfg, "prioritized", max_collision_rate=1.0, debug_delay_s=0.004)
    assert differences(pri, van) == []
    assert_really_active(pri, 40)


def test_late_prepare_is_exact_too(pool2):
    """``early_prepare=False``: ``prepare_backward`` does nothing and the embedding
    backward does the gradient-free part itself (mask read, deferred update, t+1's
    exclusive rows), when the dense backward reaches it. Same bits as vanilla (and as the
    early-prepared default, which the other tier-1 tests check)."""
    cfg = config("adam", 40)
    van = run(pool2, cfg)
    late = run(pool2, cfg, "prioritized", max_collision_rate=1.0, early_prepare=False)
    assert differences(late, van) == []
    assert_really_active(late, 40, prepared=False)


def test_sparse_update_ahead_is_exact_and_used(pool2):
    """``sparse_update="ahead"`` (the CUDA default): the row grouping of the ids starts in
    the forward (vanilla, sdd) or right after the mask exchange (prioritized: collision
    and deferred rows), its counts are read in the update. Same bits as the synchronous
    update of the default vanilla run, and the grouping started ahead was really used:
    for every row vanilla and sdd update, for the prioritized steps' updates."""
    cfg = dataclasses.replace(config("adam", 40), sparse_update="sync")
    ahead = dataclasses.replace(cfg, sparse_update="ahead")
    van = run(pool2, cfg)
    assert all(r["rows_grouped_ahead"] == 0 for r in van)
    van_a = run(pool2, ahead)
    sdd_a = run(pool2, ahead, "sdd")
    pri_a = run(pool2, ahead, "prioritized", max_collision_rate=1.0)
    # guardrail at 0: every lookahead falls back, every step updates synchronously
    pri_fb = run(pool2, ahead, "prioritized", max_collision_rate=0.0)
    assert all(r["pstats"]["fallbacks"] > 0 for r in pri_fb)
    for res in (van_a, sdd_a, pri_a, pri_fb):
        assert differences(res, van) == []
    assert_really_active(pri_a, 40)
    for r in pri_a:  # deferred and collision updates, and the synchronous steps' updates
        assert r["pstats"]["sync_steps"] > 0
        assert 0 < r["pstats"]["deferred_rows"] < r["rows_grouped_ahead"]
    # every row of every run, the synchronous steps of prioritized included (the last
    # one's grouping used to be missing: on CUDA it then took the padded path, whose
    # first use compiled kernels inside the profiled last steps)
    for r in van_a + sdd_a + pri_a + pri_fb:
        assert r["rows_grouped_ahead"] == r["rows_updated"] > 0


# --------------------------------------------------- flush, eval, checkpoints
FLUSH_EVAL_EVERY = 20  # evaluations after steps 20 and 40 (each calls flush)
FLUSH_SNAPSHOTS = (30, 45)  # hook-driven flush + checkpoint-like copy of the shard state


def test_flush_for_eval_and_checkpoints_mid_run(pool2):
    cfg = config("adam", STEPS_SHORT, eval_every=FLUSH_EVAL_EVERY)
    van = run(pool2, cfg, snapshot_steps=FLUSH_SNAPSHOTS)
    pri = run(pool2, cfg, "prioritized", snapshot_steps=FLUSH_SNAPSHOTS, max_collision_rate=1.0)
    assert differences(pri, van) == []
    assert len(pri[0]["eval"]) == 3 and len(pri[0]["snapshots"]) == 2
    # the step after each flush runs synchronously (its lookahead was dropped)
    flushed_after = {20, 40, *FLUSH_SNAPSHOTS}
    sync = {1, STEPS_SHORT} | {s + 1 for s in flushed_after}
    for r in pri:
        ps = r["pstats"]
        assert ps["sync_steps"] == len(sync) and ps["prioritized_steps"] == STEPS_SHORT - len(sync)
        assert ps["flushes"] == len(flushed_after), ps


# ----------------------------------------------------------------- mutations
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_mutation_is_caught(mutation, pool2):
    """Each deliberate bug breaks bit-for-bit equality (with Adam, mid-run evaluation and
    checkpoint-like flushes, so every mutation has something to break)."""
    cfg = config("adam", STEPS_SHORT, eval_every=FLUSH_EVAL_EVERY)
    van = run(pool2, cfg, snapshot_steps=FLUSH_SNAPSHOTS)
    bad = run(
        pool2,
        cfg,
        "prioritized",
        snapshot_steps=FLUSH_SNAPSHOTS,
        max_collision_rate=1.0,
        _mutation=mutation,
    )
    diff = differences(bad, van)
    print(f"{mutation}: {len(diff)} tensors differ, e.g. {diff[:3]}")
    assert diff, f"mutation '{mutation}' was not caught"
    if mutation == "drop_grad":
        assert bad[0]["mutation_fired"]


# ----------------------------------------------------------------- guardrail
def test_guardrail_all_fallback_is_still_exact(pool2):
    cfg = config("rowwise_adagrad", STEPS_SHORT)
    van = run(pool2, cfg)
    pri = run(pool2, cfg, "prioritized", max_collision_rate=0.0)
    assert differences(pri, van) == []
    for r in pri:
        ps = r["pstats"]
        # every step collides on the 3-row action table: every lookahead falls back
        assert ps["fallbacks"] == ps["lookaheads"] == STEPS_SHORT - 1, ps
        assert ps["prioritized_steps"] == 0 and ps["sync_steps"] == STEPS_SHORT, ps
        assert ps["deferred_rows"] == 0, ps


def test_guardrail_switches_both_ways_and_stays_exact(pool2):
    """Threshold at the median per-step occurrence share: the schedule switches between
    prioritized and synchronous many times, in both directions, and stays exact."""
    steps = STEPS_2
    cfg = config("rowwise_adagrad", steps)
    free = run(pool2, cfg, "prioritized", max_collision_rate=1.0)
    threshold = statistics.median(h[2] for h in free[0]["history"])
    van = run(pool2, cfg)
    pri = run(pool2, cfg, "prioritized", max_collision_rate=threshold)
    assert differences(pri, van) == []
    decisions = [h[3] for h in pri[0]["history"]]
    assert decisions == [h[2] <= threshold for h in free[0]["history"]]
    to_sync = sum(1 for a, b in zip(decisions, decisions[1:]) if a and not b)
    to_prio = sum(1 for a, b in zip(decisions, decisions[1:]) if not a and b)
    ps = pri[0]["pstats"]
    print(
        f"threshold {threshold:.4f}: {ps['fallbacks']} fallbacks, {to_sync} switches to sync, "
        f"{to_prio} back to prioritized, {ps['prioritized_steps']} prioritized steps"
    )
    assert to_sync > 0 and to_prio > 0
    assert ps["fallbacks"] == decisions.count(False) > 0
    # step t+1 is fully prioritized iff the decisions at t-1->t and t->t+1 both were
    both = sum(1 for a, b in zip(decisions, decisions[1:]) if a and b)
    assert ps["prioritized_steps"] == both
    assert ps["prioritized_steps"] + ps["sync_steps"] == steps
    for r in pri:
        assert r["history"] == pri[0]["history"]


# ------------------------------------------------------------ single process
TABLES = [TableConfig("item", 50, 4, ["uih", "cand"]), TableConfig("act", 3, 4, ["act"])]


def _features(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (3,), generator=g)
    n = int(lengths.sum())
    return {
        "uih": (torch.randint(0, 50, (n,), generator=g) % 13, lengths),
        "act": (torch.randint(0, 3, (n,), generator=g), lengths),
        "cand": (torch.randint(0, 50, (6,), generator=g), torch.full((3,), 2)),
    }


@functools.cache
def _single(kind: str, prioritized: bool, steps: int):
    comm = Communicator(None)
    cls = PrioritizedEmbeddingCollection if prioritized else ShardedEmbeddingCollection
    opts = {"max_collision_rate": 1.0} if prioritized else {}
    emb = cls(TABLES, comm, SparseOptimConfig(kind, lr=0.1), seed=3, **opts)
    for t in range(1, steps + 1):
        emb.set_step(t, 0.1 / t)  # a learning-rate schedule: deferred updates keep theirs
        feats = _features(t)
        if prioritized:
            out = emb(feats, next_features=_features(t + 1) if t < steps else None)
        else:
            out = emb(feats)
        g = torch.Generator().manual_seed(1000 + t)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values()).backward()
    return emb


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_single_process_with_lr_schedule(kind):
    van, pri = _single(kind, False, 40), _single(kind, True, 40)
    assert torch.equal(van.weight, pri.weight)
    for k, v in van.optimizer.state.items():
        assert torch.equal(v, pri.optimizer.state[k])
    assert pri.pstats.prioritized_steps == 38 and pri.pstats.deferred_rows > 0


def test_lookahead_must_match_the_next_call():
    emb = PrioritizedEmbeddingCollection(
        TABLES, Communicator(None), SparseOptimConfig("sgd", lr=0.1)
    )
    emb.set_step(1)
    out = emb(_features(1), next_features=_features(2))
    sum(o.sum() for o in out.values()).backward()
    emb.set_step(2)
    with pytest.raises(ValueError, match="differs from the next_features"):
        emb(_features(3), next_features=None)


def test_mask_exchange_is_issued_in_the_forward_and_read_in_the_backward():
    """(b)'s mask exchange runs with the first half, in t's forward (its result waits in
    the pending lookahead, not yet read); t's backward reads it once and decides."""
    emb = PrioritizedEmbeddingCollection(
        TABLES, Communicator(None), SparseOptimConfig("sgd", lr=0.1), max_collision_rate=1.0
    )
    emb.set_step(1)
    out = emb(_features(1), next_features=_features(2))
    p = emb._pending
    assert p is not None and p.masks_y is not None and p.host is not None
    assert p.exchanged is None  # issued, not read
    w = emb.comm.world_size
    assert p.host.numel() == w * 6 + 2 * w + 2  # received trailers | own counts
    sum(o.sum() for o in out.values()).backward()
    assert p.exchanged is not None and p.exchanged[2]  # read in the backward: prioritized
    assert emb._ahead is not None and emb._ahead.prioritized
    assert emb.pstats.lookaheads == 1


def test_prepare_backward_lifecycle():
    """``prepare_backward`` reads the mask exchange, applies (a) and sends t+1's exclusive
    rows before the backward; it runs once per step (a second call is a no-op), never
    outside a training step, never when ``early_prepare`` is off, and a flush between it
    and the backward leaves a synchronous backward over a consistent state (same bits as
    the same calls without the prepare)."""

    def run(prepare: bool, flush_between: bool, early: bool = True):
        emb = PrioritizedEmbeddingCollection(
            TABLES,
            Communicator(None),
            SparseOptimConfig("adam", lr=0.1),
            max_collision_rate=1.0,
            early_prepare=early,
        )
        assert emb.prepare_backward() is False  # no open step
        ran = []
        for t in (1, 2, 3):
            emb.set_step(t)
            out = emb(_features(t), next_features=_features(t + 1) if t < 3 else None)
            if prepare:
                ran.append(emb.prepare_backward())
                assert emb.prepare_backward() is False  # once per step
                if early and t < 3:
                    p = emb._open.ahead  # type: ignore[union-attr]
                    assert p is not None and p.excl_aw is not None  # t+1's rows sent
            if flush_between and t == 2:
                emb.flush()
            sum((o * (1 + i)).sum() for i, o in enumerate(out.values())).backward()
        emb.flush()
        return emb.weight.detach().clone(), emb.pstats, ran

    w_ref, ps_ref, _ = run(prepare=False, flush_between=False)
    w, ps, ran = run(prepare=True, flush_between=False)
    assert torch.equal(w, w_ref) and ran == [True, True, True]
    assert ps.prepared_steps == 3 and ps_ref.prepared_steps == 0
    assert ps.prioritized_steps == ps_ref.prioritized_steps > 0
    w_f_ref, _, _ = run(prepare=False, flush_between=True)
    w_f, ps_f, _ = run(prepare=True, flush_between=True)
    assert torch.equal(w_f, w_f_ref) and ps_f.flushes >= 1
    w_off, ps_off, ran_off = run(prepare=True, flush_between=False, early=False)
    assert torch.equal(w_off, w_ref) and ran_off == [False] * 3 and ps_off.prepared_steps == 0


class _NotReadyEvent:
    """Stands in for the CUDA event of the mask exchange's host copy (CPU has none):
    not reached yet by the query, complete once waited for."""

    def __init__(self) -> None:
        self.waited = False

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.waited = True


@pytest.mark.parametrize("nccl_side", [False, True])
def test_prepare_backward_decides_collectively_with_a_nccl_side_group(nccl_side):
    """With a side group whose operations are NCCL kernels, ``prepare_backward`` may not
    skip on a rank-local event query: NCCL needs operations on different communicators
    launched in the same order on every rank, and t+1's exclusive rows would go out
    before the dense backward's all-reduces on one rank and after them on another. So it
    waits for the mask copy and runs; with any other side group (gloo here, the copy
    engine, host-staged) a copy that has not reached the host leaves the work to the
    backward. Same bits either way."""

    def run(force_not_ready: bool):
        emb = PrioritizedEmbeddingCollection(
            TABLES, Communicator(None), SparseOptimConfig("adam", lr=0.1), max_collision_rate=1.0
        )
        assert emb.prepare_blocks is False  # a gloo / single-process side group
        emb.prepare_blocks = nccl_side  # what a NCCL side_comm sets (backend_name "nccl")
        ran, events = [], []
        for t in (1, 2, 3):
            emb.set_step(t)
            out = emb(_features(t), next_features=_features(t + 1) if t < 3 else None)
            p = emb._open.pending  # type: ignore[union-attr]
            if force_not_ready and p is not None:
                p.host_ready = _NotReadyEvent()
                events.append(p.host_ready)
            ran.append(emb.prepare_backward())
            sum((o * (1 + i)).sum() for i, o in enumerate(out.values())).backward()
        emb.flush()
        return emb.weight.detach().clone(), ran, events

    w_ref, ran_ref, _ = run(force_not_ready=False)
    w, ran, events = run(force_not_ready=True)
    assert ran_ref == [True, True, True]
    assert torch.equal(w, w_ref)
    assert len(events) == 2  # steps 1 and 2 look ahead
    if nccl_side:
        assert ran == [True, True, True] and all(e.waited for e in events)
    else:
        assert ran == [False, False, True]  # step 3 has no lookahead to wait for
        assert all(e.waited for e in events)  # the backward read the masks instead


def test_nccl_side_group_sets_prepare_blocks():
    """``prepare_blocks`` follows the side communicator's backend."""
    emb = PrioritizedEmbeddingCollection(TABLES, Communicator(None), SparseOptimConfig("sgd"))
    assert emb.prepare_blocks is False
    side = Communicator(None, name="side")
    side.backend_name = "nccl"  # as Communicator sets it for a NCCL process group
    emb = PrioritizedEmbeddingCollection(
        TABLES, Communicator(None), SparseOptimConfig("sgd"), side_comm=side
    )
    assert emb.prepare_blocks is True


@pytest.mark.parametrize(
    ("backend", "completion", "blocks"),
    [
        ("copy_engine", "device", True),  # copy streams wait on the peers' events
        ("copy_engine", "host", False),  # the worker waits on the host
        ("host_staged", None, False),
        ("gloo", None, False),
    ],
)
def test_device_ordered_side_group_sets_prepare_blocks(backend, completion, blocks):
    """The copy engine with device completion orders on the device like NCCL (a
    rank-local prepare_backward was suspected in a hang on 2 H200 at ef8d370). The
    property reads the side group now, so a copy engine that falls back to host
    completion at its first transfer stops blocking."""
    side = Communicator(None, name="side")
    side.backend_name = backend
    if completion is not None:
        side.completion = completion  # type: ignore[attr-defined]
    assert side_orders_on_device(side) is blocks
    emb = PrioritizedEmbeddingCollection(
        TABLES, Communicator(None), SparseOptimConfig("sgd"), side_comm=side
    )
    assert emb.prepare_blocks is blocks
    if completion == "device":
        side.completion = "host"  # type: ignore[attr-defined]
        assert emb.prepare_blocks is False
    emb.prepare_blocks = True  # a forced value wins
    assert emb.prepare_blocks is True


def test_eval_forward_flushes_and_backward_is_required():
    emb = PrioritizedEmbeddingCollection(
        TABLES, Communicator(None), SparseOptimConfig("adam", lr=0.1)
    )
    emb.set_step(1)
    out = emb(_features(1), next_features=_features(2))
    with pytest.raises(RuntimeError, match="before the backward"):
        emb(_features(2), next_features=_features(3))
    sum(o.sum() for o in out.values()).backward()
    assert emb.extra_memory_bytes()["deferred_gradients"] > 0
    with torch.no_grad():
        emb(_features(5))  # evaluation: applies the deferred update first
    mem = emb.extra_memory_bytes()
    assert mem["total"] == mem["collision_bitmap"]
    assert emb.pstats.flushes == 1


def test_factory():
    comm = Communicator(None)
    opt = SparseOptimConfig("sgd", lr=0.1)
    assert type(make_embedding_collection("vanilla", TABLES, comm, opt)) is (
        ShardedEmbeddingCollection
    )
    p = make_embedding_collection("prioritized", TABLES, comm, opt, max_collision_rate=0.5)
    assert isinstance(p, PrioritizedEmbeddingCollection) and p.max_collision_rate == 0.5
    with pytest.raises(ValueError, match="unknown"):
        make_embedding_collection("nope", TABLES, comm, opt)
    with pytest.raises(ValueError, match="mutation"):
        PrioritizedEmbeddingCollection(TABLES, comm, opt, _mutation="nope")


def test_seg_sums_counts_each_segment_of_each_mask():
    """`_seg_sums` (one scan for several masks) gives, per mask and segment, the number
    of True entries, on fresh random masks and splits with empty segments."""
    from freescale.embedding.prioritized import _seg_sums

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    for _ in range(50):
        masks, splits, expected = [], [], []
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            sizes = torch.randint(0, 9, (int(torch.randint(1, 6, (1,), generator=g)),),
                                  generator=g).tolist()  # fmt: skip
            mask = torch.rand(sum(sizes), generator=g) < 0.4
            masks.append(mask)
            splits.append(sizes)
            at = 0
            for size in sizes:
                expected.append(int(mask[at : at + size].sum()))
                at += size
        assert _seg_sums(masks, splits).tolist() == expected


def test_mask_partition_is_both_mask_positions():
    from freescale.embedding.reduce import mask_partition, mask_positions

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    for n in (0, 1, 7, 1000):
        for p in (0.0, 0.03, 0.5, 1.0):
            mask = torch.rand(n, generator=g) < p
            c = int(mask.sum())
            both = torch.cat([mask_positions(mask, c), mask_positions(~mask, n - c)])
            assert torch.equal(mask_partition(mask, c), both), (n, p)


def test_mask_positions_equal_nonzero_on_fresh_random_masks():
    from freescale.embedding.reduce import mask_positions

    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    for n in (0, 1, 7, 1000, 4097):
        for p in (0.0, 0.03, 0.5, 1.0):
            mask = torch.rand(n, generator=g) < p
            ref = torch.nonzero(mask).squeeze(1)
            got = mask_positions(mask, int(mask.sum()))
            assert torch.equal(got, ref), (n, p)
    mask = torch.rand(100, generator=g) < 0.5  # a wrong count is not silently right
    assert not torch.equal(
        mask_positions(mask, int(mask.sum()) - 1), torch.nonzero(mask).squeeze(1)
    )
