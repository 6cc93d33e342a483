"""Trainer: world-size invariance (tier 2), placement invariance with an empty rank,
bad input rejected on every rank without a hang or a partial update, config checks."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from freescale.comm.base import CollectiveError
from freescale.config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig
from freescale.data.batch import JaggedBatch
from freescale.data.validate import BadInputError
from freescale.pipeline.distributed import ConfigMismatchError
from freescale.pipeline.trainer import InputRejected, Trainer, TrainerHook

# tier-2 tolerance in float64 (DESIGN.md section 1: within 1e-12 in float64; parameters
# after a few steps of Adam are compared relative to their scale)
F64_TOL = 1e-12  # DESIGN.md section 1, tier 2 (float64)


def tiny_config(kind: str = "rowwise_adagrad", dtype: str = "float64", steps: int = 4):
    return TrainConfig(
        data=DataConfig(
            seed=7,
            global_batch_size=8,
            num_items=300,
            num_actions=3,
            median_uih=6,
            max_uih=24,
            num_candidates=3,
            eval_samples=8,
        ),
        model=ModelConfig(
            embedding_dim=8, num_layers=1, num_heads=2, max_positions=64, dtype=dtype
        ),
        sparse_optim=SparseOptimConfig(kind=kind, lr=0.05),
        steps=steps,
        eval_every=0,
        progress=False,
        device="cpu",
        dense_lr=1e-2,
    )


def _state(tr: Trainer) -> dict:
    return {
        "tables": {n: (lo, t.clone()) for n, (lo, t) in tr.sparse.shard_tables().items()},
        "dense": {k: v.detach().clone() for k, v in tr.dense.state_dict().items()},
    }


def _full_tables(results: list[dict]) -> dict[str, torch.Tensor]:
    names = results[0]["tables"].keys()
    return {n: torch.cat([r["tables"][n][1] for r in results]) for n in names}


class _DropSample(TrainerHook):
    """Mutation: rank 1 silently skips its last sample at step 2."""

    def on_batch(self, trainer, step, batch):
        if trainer.rank == 1 and step == 2 and batch.batch_size > 0:
            out = batch.select(torch.arange(batch.batch_size - 1))
            out.extras = batch.extras
            return out
        return batch


class _AllOnRankZero(TrainerHook):
    """A legal placement: rank 0 trains the whole global batch, the others nothing."""

    def on_batch(self, trainer, step, batch):
        gb = trainer.source.global_batch(step)
        out = gb if trainer.rank == 0 else JaggedBatch.empty(trainer.uih_keys, step)
        out.extras = batch.extras
        return out


def train_and_state(rank, world, cfg, hook=None):
    tr = Trainer(cfg, hooks=[hook] if hook else [])
    tr.train()
    return _state(tr)


def _compare(a: list[dict], b: list[dict], tol: float) -> float:
    """Max relative difference of tables and dense params between two runs."""
    worst = 0.0
    ta, tb = _full_tables(a), _full_tables(b)
    for n in ta:
        worst = max(worst, float((ta[n] - tb[n]).abs().max() / tb[n].abs().max()))
    for k, v in a[0]["dense"].items():
        w = b[0]["dense"][k]
        worst = max(worst, float((v - w).abs().max() / w.abs().max().clamp(min=1e-30)))
    return worst


def test_world_size_invariance_1_2_4(pool1, pool2, pool4):
    cfg = tiny_config()
    r1 = pool1.run(train_and_state, cfg)
    r2 = pool2.run(train_and_state, cfg)
    r4 = pool4.run(train_and_state, cfg)
    d12, d14 = _compare(r2, r1, F64_TOL), _compare(r4, r1, F64_TOL)
    print(f"max rel diff 2 vs 1 ranks {d12:.3g}, 4 vs 1 ranks {d14:.3g}")
    assert d12 < F64_TOL and d14 < F64_TOL
    # every rank holds the same dense parameters
    for r in r4[1:]:
        for k, v in r["dense"].items():
            assert torch.equal(v, r4[0]["dense"][k])
    # the check can fail: one rank skipping one sample is caught
    bad = pool2.run(train_and_state, cfg, _DropSample())
    d_bad = _compare(bad, r1, F64_TOL)
    print(f"max rel diff with a skipped sample {d_bad:.3g}")
    assert d_bad > 1e3 * F64_TOL


def test_empty_rank_and_placement_invariance(pool1, pool2):
    cfg = tiny_config(kind="adam")
    r1 = pool1.run(train_and_state, cfg)
    r2 = pool2.run(train_and_state, cfg, _AllOnRankZero())
    d = _compare(r2, r1, F64_TOL)
    print(f"all samples on rank 0 of 2 vs 1 rank: {d:.3g}")
    assert d < F64_TOL


class _CorruptSource:
    """Wraps a source; rank 1's batch of step 3 gets an out-of-range id."""

    def __init__(self, inner, rank):
        self.inner, self.rank = inner, rank
        self.uih_keys = inner.uih_keys
        self.num_items, self.num_actions = inner.num_items, inner.num_actions

    def global_batch(self, step, split="train"):
        return self.inner.global_batch(step, split)

    def local_batch(self, step, rank, world, split="train"):
        b = self.inner.local_batch(step, rank, world, split)
        if split == "train" and step == 3 and rank == 1:
            b.uih["uih_item"] = b.uih["uih_item"].clone()
            b.uih["uih_item"][-1] = self.num_items + 5
        return b


def bad_input_run(rank, world, cfg):
    from freescale.pipeline.trainer import make_source

    tr = Trainer(cfg, source=_CorruptSource(make_source(cfg), rank))
    tr.train(steps=2)
    before = _state(tr)
    err = None
    try:
        tr.train(steps=2)
    except BadInputError as e:
        err = (type(e).__name__, str(e))
    after = _state(tr)
    same = all(torch.equal(before["tables"][n][1], after["tables"][n][1]) for n in before["tables"])
    same_dense = all(torch.equal(before["dense"][k], after["dense"][k]) for k in before["dense"])
    return {"err": err, "unchanged": same and same_dense, "step": tr.step}


def test_bad_input_rejected_on_every_rank_without_update(pool2):
    res = pool2.run(bad_input_run, tiny_config(steps=4))
    for r in res:
        assert r["err"] is not None, "every rank must raise"
        assert r["unchanged"], "no update may be applied for the rejected step"
        assert r["step"] == 2
    kind1, msg1 = res[1]["err"]
    assert kind1 == "BadInputError"
    assert "rank 1" in msg1 and "uih_item" in msg1 and "sample" in msg1
    kind0, msg0 = res[0]["err"]
    assert kind0 == InputRejected.__name__ and "rank(s) [1]" in msg0


def mismatched_config(rank, world, cfg):
    cfg = dataclasses.replace(cfg, seed=cfg.seed + rank)
    try:
        Trainer(cfg)
    except ConfigMismatchError as e:
        return str(e)
    return None


def test_config_mismatch_detected(pool2):
    res = pool2.run(mismatched_config, tiny_config())
    for r, msg in enumerate(res):
        assert msg is not None and f"rank {r}" in msg and "different configurations" in msg


def single_run_summary(rank, world, cfg):
    tr = Trainer(cfg)
    s = tr.train()
    return s


def test_summary_reports_ne_and_oracle(pool2):
    cfg = tiny_config(steps=3)
    cfg.eval_every = 2
    s = pool2.run(single_run_summary, cfg)
    for key in ("qps", "eval_ne", "oracle_ne", "eval_auc", "stage_ms", "straggler_share_median"):
        assert key in s[0]
    assert 0 < s[0]["oracle_ne"] < 1
    assert s[0]["eval_ne"] == pytest.approx(s[1]["eval_ne"])


def switch_and_gil(rank, world, cfg):
    import sys

    before = sys.getswitchinterval()
    seen = []

    class Watch(TrainerHook):
        def after_optimizer(self, trainer, step):  # noqa: ANN001
            seen.append(sys.getswitchinterval())

    tr = Trainer(cfg, hooks=[Watch()])
    s = tr.train()
    return s, before, seen, sys.getswitchinterval(), _state(tr)


def test_gil_switch_interval_is_set_while_training_and_restored(pool2):
    """``gil_switch_interval_ms`` holds during the steps and the interpreter's value
    comes back after; ``gil_probe_ms`` adds the probe's statistics (no timing asserted);
    parameters are the same bits as without either (host scheduling only)."""
    cfg = tiny_config(steps=12)
    ref = pool2.run(train_and_state, cfg)
    cfg2 = dataclasses.replace(cfg, gil_switch_interval_ms=0.5, gil_probe_ms=1.0)
    out = pool2.run(switch_and_gil, cfg2)
    for (s, before, seen, after, state), r in zip(out, ref):
        assert seen and all(v == pytest.approx(0.5e-3) for v in seen)
        assert after == before
        gw = s["host_cpu"]["gil_wait"] if s.get("host_cpu") else None
        if gw is not None:  # Linux /proc (the meter's window)
            assert gw["wakes"] > 0 and gw["period_ms"] == 1.0
            assert gw["p50_ms"] <= gw["p90_ms"] <= gw["p99_ms"] <= gw["max_ms"]
        for n, (lo, t) in r["tables"].items():
            assert state["tables"][n][0] == lo and torch.equal(state["tables"][n][1], t), n
        for k, v in r["dense"].items():
            assert torch.equal(v, state["dense"][k]), k
    with pytest.raises(ValueError, match="gil_switch_interval_ms"):
        dataclasses.replace(cfg, gil_switch_interval_ms=0.0)
    with pytest.raises(ValueError, match="gil_probe_ms"):
        dataclasses.replace(cfg, gil_probe_ms=-1.0)


def test_profile_activities_option():
    """``profile_activities="cuda"`` records GPU activity only on a CUDA device; on a CPU
    device the profiler keeps host ops (there is no GPU activity to record)."""
    from freescale.pipeline.trainer import _start_profiler

    prof = _start_profiler(torch.device("cpu"), "cuda")
    torch.ones(4).add_(1)
    prof.stop()
    assert any(e.name == "aten::add_" for e in prof.events())
    with pytest.raises(ValueError, match="profile_activities"):
        dataclasses.replace(tiny_config(), profile_activities="gpu")


def test_cupti_teardown_env(monkeypatch):
    """A CUDA profiler asks kineto to release CUPTI when it stops (TEARDOWN_CUPTI=1),
    unless a value is already set; CPU devices leave the environment alone. (Without it,
    CUPTI stays attached and slowed every later run in the process by 16% on H200.)"""
    from freescale.pipeline.trainer import CUPTI_TEARDOWN_ENV, ensure_cupti_teardown

    monkeypatch.delenv(CUPTI_TEARDOWN_ENV, raising=False)
    assert ensure_cupti_teardown(torch.device("cpu")) is None
    assert CUPTI_TEARDOWN_ENV not in os.environ
    assert ensure_cupti_teardown(torch.device("cuda", 0)) == "1"
    assert os.environ[CUPTI_TEARDOWN_ENV] == "1"
    monkeypatch.setenv(CUPTI_TEARDOWN_ENV, "0")  # the user's (or inductor's) choice wins
    assert ensure_cupti_teardown(torch.device("cuda", 0)) == "0"


def pinned_run(rank, world, cfg):
    import os

    os.environ["LOCAL_WORLD_SIZE"] = "1"  # each rank plans as if alone on the host
    before = os.sched_getaffinity(0)
    seen = []

    class Watch(TrainerHook):
        def after_optimizer(self, trainer, step):  # noqa: ANN001
            seen.append(os.sched_getaffinity(0))

    tr = Trainer(cfg, hooks=[Watch()])
    s = tr.train()
    return s, before, seen, os.sched_getaffinity(0), _state(tr)


@pytest.mark.skipif(
    not hasattr(__import__("os"), "sched_setaffinity")
    or len(__import__("os").sched_getaffinity(0)) < 2,
    reason="thread pinning needs Linux's sched_setaffinity and at least 2 usable CPUs",
)
def test_pin_threads_places_the_training_thread_and_restores(pool2):
    """``pin_threads``: after the warm-up the training thread runs on the CPU the plan
    gave it, the summary reports the placement (threads pinned per role), the caller's
    affinity comes back after training, and parameters are the same bits as without."""
    cfg = tiny_config(steps=8)
    ref = pool2.run(train_and_state, cfg)
    out = pool2.run(pinned_run, dataclasses.replace(cfg, pin_threads=True))
    for (s, before, seen, after, state), r in zip(out, ref):
        pl = s["placement"]
        assert pl["pinned"] and pl["threads"]["training"] == 1, pl
        assert pl["topology"]["logical_cpus"] >= 2
        train_cpus = set(pl["cpus"]["training"])
        assert len(train_cpus) == 1 and seen and seen[-1] == train_cpus
        assert after == before
        for n, (lo, t) in r["tables"].items():
            assert state["tables"][n][0] == lo and torch.equal(state["tables"][n][1], t), n
        for k, v in r["dense"].items():
            assert torch.equal(v, state["dense"][k]), k


class _StallOnce(TrainerHook):
    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def after_forward(self, trainer, step, loss):  # noqa: ANN001
        if step == self.step:
            _stalled_here(self.seconds)


def _stalled_here(seconds: float) -> None:
    import time

    time.sleep(seconds)


def test_stall_dump_prints_every_threads_stack_and_training_goes_on(capfd):
    """``stall_dump_s``: a step that does not finish within the limit gets every
    thread's Python stack printed (faulthandler, once per stall), naming where it is
    blocked; training then finishes normally and the dump is disarmed (no late dump)."""
    import time

    cfg = dataclasses.replace(tiny_config(steps=4), stall_dump_s=1.0)
    tr = Trainer(cfg, hooks=[_StallOnce(step=3, seconds=3.5)])
    stall = [h for h in tr.hooks if type(h).__name__ == "StallDump"]
    assert len(stall) == 1
    tr.train()
    tr.close()
    assert stall[0].armed is False
    # the watchdog's state report: once per stall (the 3.5 s one, and any slow start-up
    # or evaluation longer than 1 s on this machine)
    assert stall[0].reports >= 1
    err = capfd.readouterr().err
    n = err.count("[freescale stall] no step finished in 1 s")
    assert n == stall[0].reports, err[-2000:]
    assert "(no copy-engine communicator open)" in err  # one rank, no SM-free side group
    dumps = err.split("Timeout (0:00:01)!")[1:]
    assert len(dumps) >= 1, err[-2000:]
    # once per stall: the 3.5 s stall gives one dump, not three
    assert sum("_stalled_here" in d for d in dumps) == 1, err[-3000:]
    time.sleep(1.5)  # disarmed: nothing more is written
    assert "Timeout (" not in capfd.readouterr().err
    with pytest.raises(ValueError, match="stall_dump_s"):
        TrainConfig(stall_dump_s=-1.0)


def test_no_stall_dump_without_a_stall(capfd):
    cfg = dataclasses.replace(tiny_config(steps=3), stall_dump_s=30.0)
    tr = Trainer(cfg)
    tr.train()
    tr.close()
    assert "Timeout (" not in capfd.readouterr().err


def test_known_hang_risk_names_the_configuration_that_hung():
    """prioritized + copy engine + no balancer on CUDA hung 2 H200 in session 14 (cause
    open): the trainer warns for exactly that configuration."""
    from freescale.pipeline.trainer import known_hang_risk

    msg = known_hang_risk("prioritized", "cuda", "copy_engine", ["StallDump"])
    assert msg is not None and "copy engine" in msg and "--mode freescale" in msg
    assert known_hang_risk("prioritized", "cuda", "copy_engine", ["BalanceHook"]) is None
    assert known_hang_risk("prioritized", "cuda", "host_staged", []) is None
    assert known_hang_risk("prioritized", "cuda", None, []) is None  # NCCL side group
    assert known_hang_risk("prioritized", "cpu", "copy_engine", []) is None
    assert known_hang_risk("sdd", "cuda", "copy_engine", []) is None


def test_dense_time_excludes_sparse_work_done_by_hooks_after_the_optimizer():
    """A hook's sparse work after the optimizer (a checkpoint's flush applies deferred
    updates there) is not the step's: it used to be subtracted from the step's dense
    time, which went negative and made the balancer's cost-model fit raise (seen as a
    flaky tests/test_checkpoint.py failure). The dense time now closes before the
    hooks run."""

    class SparseWorkAfterOptimizer(TrainerHook):
        dense_ms: list[float] = []

        def after_optimizer(self, trainer, step):
            trainer.sparse.stats.add_time("lookup", 10.0)  # 10 s, as a slow flush would

        def on_metrics(self, trainer, step, record):
            self.dense_ms.extend(record["dense_ms_per_rank"])

    hook = SparseWorkAfterOptimizer()
    hook.dense_ms = []
    tr = Trainer(dataclasses.replace(tiny_config(steps=3), mode="prioritized"), hooks=[hook])
    tr.train(3)
    tr.close()
    assert len(hook.dense_ms) == 3 and all(0 < d < 10_000 for d in hook.dense_ms), hook.dense_ms


class _FailAtStep(TrainerHook):
    """Raises after the optimizer of step ``step`` on every rank (a failed run)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_optimizer(self, trainer, step):
        if step == self.step:
            raise RuntimeError(f"deliberate failure at step {step}")


def _groups_across_trainers(rank, world, mode):
    """Group counts: at the start, after building a trainer, after train + close (and a
    second close), then around a trainer whose train() raised on every rank."""
    from freescale.comm.base import process_groups

    def n() -> int:
        return len(process_groups() or ())

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    counts = [n()]
    tr = Trainer(dataclasses.replace(tiny_config(steps=2), mode=mode))
    counts.append(n())
    tr.train()
    busy = threads()
    tr.close()
    counts.append(n())
    # tr is still referenced: its groups' gloo threads end only if it dropped them
    freed = busy - threads()
    with pytest.raises(CollectiveError, match="communicator 'meta' was released"):
        tr.meta_comm.barrier()
    tr.close()  # idempotent: nothing left, no second barrier
    counts.append(n())
    failing = Trainer(dataclasses.replace(tiny_config(steps=3), mode=mode), hooks=[_FailAtStep(1)])
    with pytest.raises(RuntimeError, match="deliberate failure"):
        failing.train()
    failing.close()  # no barrier, no destroy: a peer may sit in a collective on them
    counts.append(n())
    return counts, freed


@pytest.mark.parametrize("mode", ["vanilla", "prioritized"])
def test_close_releases_the_groups_a_trainer_made(pool2, mode):
    """A trainer makes its own process groups (embedding, metadata, data stage; a
    prioritized collection one more for its side traffic). ``close()`` destroys them,
    so a process that builds trainers one after another (``freescale bench e2e``'s
    variants) does not keep every one's gloo threads and NCCL communicators; after a
    train() that raised it leaves them (the pool's cleanup destroys them here)."""
    made = 4 if mode == "prioritized" else 3
    for counts, freed in pool2.run(_groups_across_trainers, mode):
        base = counts[0]
        assert counts == [base, base + made, base, base, base + made], counts
        assert freed >= made, freed  # each gloo group's transport thread ended


def _balance_hook_groups(rank, world):
    """Group counts around a BalanceHook serving two trainers in turn, closed between."""
    from freescale.balance.hook import BalanceHook
    from freescale.comm.base import process_groups

    def n() -> int:
        return len(process_groups() or ())

    hook = BalanceHook()
    counts = [n()]
    moved = []
    for _ in range(2):
        tr = Trainer(tiny_config(steps=3), hooks=[hook])
        tr.train()
        tr.close()
        counts.append(n())  # the trainer's groups gone, the hook's kept
        moved.append(hook.samples_moved_total)
        hook.close()
        counts.append(n())
    hook.close()  # idempotent
    counts.append(n())
    return counts, moved


def test_balance_hook_close_releases_its_group_and_the_hook_can_serve_again(pool2):
    """``BalanceHook.close()`` destroys the group its ``on_train_start`` made; used again,
    the hook makes a new one and keeps balancing (its counters go on)."""
    for counts, moved in pool2.run(_balance_hook_groups):
        base = counts[0]
        assert counts == [base, base + 1, base, base + 1, base, base], counts
        assert 0 < moved[0] < moved[1], moved
