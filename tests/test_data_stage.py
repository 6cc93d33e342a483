"""The data stage on its own thread (pipeline/data_stage.py, ``TrainConfig.data_thread``).

Unit: batches come in step order, a step is prepared only after the metrics of
``step - lag`` (the gate that keeps adaptive balancing plans equal on every rank), an
error reaches the consumer at its step after the steps before it, close() never hangs.
Training on 2 and 4 gloo ranks: the thread changes nothing (bit for bit against the
inline data stage, with balancing moving samples, prioritized updates and host counts),
it really ran (counters), a mis-ordered thread is caught by the same comparison
(mutation), and rejected input still stops every rank before any update."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from freescale.balance.cost_model import CostModel
from freescale.balance.hook import BalanceHook
from freescale.balance.planner import BalanceConfig
from freescale.pipeline.data_stage import METRICS_LAG, DataStageThread, PreparedBatch
from freescale.pipeline.trainer import InputRejected, Trainer
from test_bench_e2e import e2e_config
from test_overlap_backend import _equal
from test_trainer import _state, bad_input_run, tiny_config


def _stage(prepare, steps, lag=2, depth=2):
    return DataStageThread(prepare, steps, lag=lag, depth=depth, num_threads=1)


def test_order_and_gate():
    done_at_prepare: dict[int, int] = {}
    stage_ref: list[DataStageThread] = []
    ready = threading.Event()

    def prepare(s):
        ready.wait()
        done_at_prepare[s] = stage_ref[0]._metrics_done
        return PreparedBatch(s, None, None)  # type: ignore[arg-type]

    steps = list(range(5, 25))
    stage = _stage(prepare, steps, lag=3, depth=3)
    stage_ref.append(stage)
    ready.set()
    try:
        for s in steps:
            assert stage.get(s).step == s
            time.sleep(0.002)  # let the producer run ahead as far as the gate allows
            stage.metrics_done(s)
        # every step handed out: the thread (and its OpenMP team, whose CPU time the
        # trainer's host-CPU window counts) stays alive until close()
        time.sleep(0.05)
        assert stage._thread.is_alive()
    finally:
        stage.close()
    assert not stage._thread.is_alive()
    assert sorted(done_at_prepare) == steps
    for s, done in done_at_prepare.items():
        assert done >= s - 3, (s, done)
    # the thread did run ahead (not lock-step with the consumer)
    assert any(done < s - 1 for s, done in done_at_prepare.items())
    # its wall-time accounting covers every prepared step (values not asserted: timings)
    t = stage.timing()
    assert t["prepared"] == len(steps)
    assert all(t[k] >= 0.0 for k in ("busy_ms", "gate_ms", "blocked_ms"))


def test_error_reaches_consumer_at_its_step():
    def prepare(s):
        if s == 3:
            raise ValueError("rank 1: bad sample 7 in feature 'uih_item'")
        return PreparedBatch(s, None, None)  # type: ignore[arg-type]

    stage = _stage(prepare, list(range(6)), lag=100)
    try:
        for s in range(3):
            assert stage.get(s).step == s
        with pytest.raises(ValueError, match="bad sample 7"):
            stage.get(3)
        with pytest.raises(ValueError):  # stays raised
            stage.get(3)
    finally:
        stage.close()


def test_out_of_order_request_and_close_never_hang():
    stage = _stage(lambda s: PreparedBatch(s, None, None), list(range(100)), lag=0)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="asked for step 5"):
        stage.get(5)
    t0 = time.perf_counter()
    stage.close()  # producer blocked on the gate (lag 0, nothing done)
    assert time.perf_counter() - t0 < 5.0
    assert not any(t.name == "freescale-data-stage" for t in threading.enumerate())


# ------------------------------------------------------------------ training
def _run(rank, world, cfg, balance=False, swap=False):
    hooks = [BalanceHook(BalanceConfig(partitioner="fbs"))] if balance else []
    tr = Trainer(cfg, hooks=hooks)
    if swap:  # mutation: the thread hands step 3 the batch of step 4 and vice versa
        orig = tr._prepare_ahead
        held: dict[int, PreparedBatch] = {}

        def bad(step, loader, n):
            if step == 4:
                return PreparedBatch(4, held[3].batch, None)
            p = orig(step, loader, n)
            if step == 3:
                held[3] = p
                return PreparedBatch(3, orig(4, loader, n).batch, None)
            return p

        tr._prepare_ahead = bad
    summary = tr.train()
    moved = hooks[0].samples_moved_total if hooks else 0
    return _state(tr), summary, moved


def _pair(pool, balance, **kw):
    base = dataclasses.replace(e2e_config(), eval_every=4, profile_steps=0, **kw)
    inline = pool.run(_run, dataclasses.replace(base, data_thread=False), balance)
    thread = pool.run(_run, dataclasses.replace(base, data_thread=True), balance)
    return base, inline, thread


@pytest.mark.parametrize(
    "mode,balance,host_counts",
    [("vanilla", False, True), ("prioritized", True, True), ("sdd", True, False)],
)
def test_data_thread_changes_nothing_2_ranks(pool2, mode, balance, host_counts):
    base, inline, thread = _pair(pool2, balance, mode=mode, host_counts=host_counts)
    assert _equal(thread, inline)
    assert thread[0][1]["eval_ne"] == inline[0][1]["eval_ne"]
    for _, summary, moved in thread:
        dt = summary["data_thread"]
        assert dt["on"] and dt["steps"] == base.steps
        assert dt["counts_on_thread"] == (base.steps if host_counts else 0)
        if balance:
            assert moved > 0  # the balancer ran on the thread and moved samples
        # where the thread's busy time went: one entry per phase it ran
        phases = dt["phases_ms"]
        want = {"load"} | ({"hook:BalanceHook"} if balance else set())
        want |= {"id_counts"} if host_counts else set()
        assert set(phases) == want, phases  # no "pin": CPU batches are never pinned
        assert all(v > 0 for v in phases.values())
        assert sum(phases.values()) <= dt["timing"]["busy_ms"] * 1.05 + 0.05
    assert inline[0][1]["data_thread"]["steps"] == 0
    assert inline[0][1]["data_thread"]["phases_ms"] == {}


def test_data_thread_changes_nothing_4_ranks(pool4):
    base, inline, thread = _pair(pool4, True, mode="prioritized", host_counts=True)
    assert _equal(thread, inline)
    assert all(s["data_thread"]["steps"] == base.steps for _, s, _ in thread)
    assert sum(m for _, _, m in thread) > 0


def test_swapped_batches_on_the_thread_are_caught(pool2):
    base = dataclasses.replace(
        e2e_config(), eval_every=0, profile_steps=0, mode="prioritized", data_thread=True
    )
    good = pool2.run(_run, base)
    bad = pool2.run(_run, base, False, True)
    assert not _equal(bad, good)


def test_rejected_input_with_data_thread(pool2):
    res = pool2.run(bad_input_run, dataclasses.replace(tiny_config(steps=4), data_thread=True))
    for r in res:
        assert r["err"] is not None and r["unchanged"] and r["step"] == 2
    assert res[1]["err"][0] == "BadInputError" and "rank 1" in res[1]["err"][1]
    assert res[0]["err"][0] == InputRejected.__name__ and "rank(s) [1]" in res[0]["err"][1]


# ------------------------------------------- learning balancer, cross-rank plans
class _LatePlanner(BalanceHook):
    """Rank 0 plans every step 60 ms after its metadata arrived, so by then its training
    thread has finished more steps' metrics than rank 1's had when rank 1 planned the
    same step. ``eager``: the mutation, planning with the current cost state (what the
    training thread has learned so far), as the hook did before session 17."""

    def __init__(self, *args, eager: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.eager = eager
        self.plan_states: list[dict] = []

    def end_batch(self, trainer, step, handle):
        if self.comm.rank == 0:
            time.sleep(0.06)
            if self.eager:  # under load 60 ms may not be a step: wait for one (<= 1 s)
                seen, t0 = self._last_metrics, time.monotonic()
                while self._last_metrics == seen and time.monotonic() - t0 < 1.0:
                    time.sleep(0.005)
        out = super().end_batch(trainer, step, handle)
        self.plan_states.append(dict(self.last_plan.cost_model))
        return out

    def _state_for(self, step):
        if self.eager:
            return dict(self.planner.cost_model_state())
        return super()._state_for(step)


START = {"a": 1.0, "b": 0.1, "c": 0.0}


def _learning_run(rank, world, eager):
    cfg = dataclasses.replace(
        e2e_config(), steps=14, eval_every=0, profile_steps=0, data_thread=True
    )
    hook = _LatePlanner(
        BalanceConfig(partitioner="sticky", use_cost_model=True, refit_every=1),
        cost_model=CostModel(fitted=True, **START),
        verify_plans=True,  # every plan's checksum all-gathered: divergence raises
        eager=eager,
    )
    tr = Trainer(cfg, hooks=[hook])
    try:
        tr.train()
        err = None
    except Exception as e:  # the plan check raises on every rank alike
        err = f"{type(e).__name__}: {e}"
    finally:
        tr.close()
    assert hook.planner is not None
    return {
        "err": err,
        "applied": hook.observations_applied,
        "states": hook.plan_states,
        "moved": hook.samples_moved_total,
    }


def test_learning_balancer_plans_alike_on_every_rank(pool2):
    """With the data-stage thread, sticky on a cost model refitted after every step
    plans every step identically on both ranks (``verify_plans``) although rank 0 plans
    late (its training thread is further ahead then): plan ``s`` uses the cost state as
    of step ``s - METRICS_LAG``. The learning was real: the first plans used the
    starting model, later ones a refitted model or (a degenerate CPU fit) ``L^alpha``,
    and samples moved. Mutation: planning with the current state makes the ranks'
    plans diverge, and the checksum all-gather names it."""
    res = pool2.run(_learning_run, False)
    for r in res:
        assert r["err"] is None, r
        assert r["applied"] == 14 and r["moved"] > 0, r
        states = r["states"]
        assert len(states) == 14
        for st in states[:METRICS_LAG]:  # nothing learned yet: the starting model
            assert st["kind"] == "fit" and {k: st[k] for k in START} == START, st
        changed = [
            st
            for st in states[METRICS_LAG:]
            if st["kind"] == "power" or any(st[k] != v for k, v in START.items())
        ]
        assert changed, states  # plans after the lag used what was learned
    assert res[0]["states"] == res[1]["states"]
    for _ in range(3):  # the mutation shows only where the threads' timing differs
        bad = pool2.run(_learning_run, True)
        if all(r["err"] is not None for r in bad):
            break
    assert all(r["err"] is not None and "different plans" in r["err"] for r in bad), bad
