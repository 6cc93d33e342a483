"""GPU accounting from a Chrome trace (hand-made traces with known answers), and the
trainer's ``timing="events"`` / profiling path: identical numerics to ``"sync"``."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from freescale.pipeline.accounting import gpu_accounting, interval_union, merge_ranks
from freescale.pipeline.trainer import Trainer, TrainerHook, _host_copy
from test_trainer import _compare, _state, tiny_config


def _k(name: str, ts: float, dur: float, cat: str = "kernel", stream: int = 7) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_interval_union():
    assert interval_union([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]


def test_accounting_known_answer(tmp_path):
    # 2 steps over [0, 100] us: compute [0,30] + [40,60] (two overlapping kernels on two
    # streams), NCCL [25,50] (5 us hidden under compute, 10 us exposed: [30,40]), NCCL
    # [70,80] exposed, an HtoD copy [80,90] (neither), the last compute kernel [90,100]
    events = [
        _k("gemm", 0, 30),
        _k("gemm", 40, 15),
        _k("softmax", 45, 15, stream=9),
        _k("ncclDevKernel_AllToAll", 25, 25, stream=20),
        _k("ncclDevKernel_AllReduce", 70, 10, stream=20),
        _k("Memcpy HtoD (Pinned -> Device)", 80, 10, cat="gpu_memcpy"),
        _k("add", 90, 10),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -50, "dur": 500},
        # 5 runtime / driver calls on host threads (launch load, not GPU time)
        *[_k("cudaLaunchKernel", 10 * i, 1, cat="cuda_runtime") for i in range(4)],
        _k("cuLaunchKernel", 3, 1, cat="cuda_driver"),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    a = gpu_accounting(str(path), steps=2)
    assert a["available"]
    assert a["window_ms"] == pytest.approx(100e-3 / 2)
    assert a["compute_ms"] == pytest.approx(60e-3 / 2)  # [0,30] [40,60] [90,100]
    assert a["comm_ms"] == pytest.approx(35e-3 / 2)  # [25,50] [70,80]
    assert a["bubble_ms"] == pytest.approx(40e-3 / 2)
    assert a["exposed_comm_ms"] == pytest.approx(20e-3 / 2)  # [30,40] [70,80]
    assert a["other_idle_ms"] == pytest.approx(20e-3 / 2)  # [60,70] [80,90]
    assert a["gpu_ops_per_step"] == pytest.approx(7 / 2)  # 6 kernels and a copy
    assert a["runtime_calls_per_step"] == pytest.approx(5 / 2)
    # per kind: the all-to-all's exposed part [30,40], the all-reduce's [70,80]
    assert a["exposed_by_kind_ms"] == pytest.approx(
        {"all_to_all": 10e-3 / 2, "all_reduce": 10e-3 / 2}
    )
    m = merge_ranks([a, {**a, "bubble_ms": 3 * a["bubble_ms"]}])
    assert m["bubble_ms"] == pytest.approx(2 * a["bubble_ms"])
    assert m["bubble_ms_max"] == pytest.approx(3 * a["bubble_ms"])


def test_comm_kind():
    from freescale.pipeline.accounting import comm_kind

    assert comm_kind({"name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL"}) == "all_reduce"
    assert comm_kind({"name": "ncclDevKernel_SendRecv"}) == "all_to_all"
    assert comm_kind({"name": "ncclKernel_AllGather_RING_LL_Sum_int8_t"}) == "all_gather"
    assert comm_kind({"name": "ncclDevKernel_Reduce_Scatter"}) == "reduce_scatter"
    assert comm_kind({"name": "Memcpy PtoP (Device -> Device)", "cat": "gpu_memcpy"}) == (
        "peer_copy"
    )
    assert comm_kind({"name": "ncclDevKernel_Something"}) == "nccl_other"


def test_accounting_without_gpu_activity():
    a = gpu_accounting({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5}]}, 3)
    assert not a["available"] and "no GPU activity" in a["reason"]
    assert not merge_ranks([a])["available"]


class _Losses(TrainerHook):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_metrics(self, trainer, step, record):  # noqa: ANN001, ANN201
        self.losses.append(record["loss_sum"])


def _run(rank, world, cfg):
    hook = _Losses()
    tr = Trainer(cfg, hooks=[hook])
    summary = tr.train()
    summary["_losses"] = hook.losses
    return _state(tr), summary


def test_events_timing_and_profiling_change_nothing(pool2, tmp_path):
    """timing="events" defers each step's bookkeeping by one step and profiling wraps
    the last steps: both must leave training bit for bit as with timing="sync"."""
    base = tiny_config(steps=8, dtype="float32")
    base.eval_every = 4
    ev = dataclasses.replace(base, timing="events", profile_steps=3, trace_dir=str(tmp_path))
    a = pool2.run(_run, base)
    b = pool2.run(_run, ev)
    assert _compare([r[0] for r in a], [r[0] for r in b], 0.0) == 0.0
    sa, sb = a[0][1], b[0][1]
    assert sb["timing"] == "events" and sb["eval_ne"] == sa["eval_ne"]
    # each step's loss reaches the bookkeeping as a host float, the same in both modes
    assert len(sb["_losses"]) == 8 and all(isinstance(x, float) for x in sb["_losses"])
    assert sb["_losses"] == sa["_losses"]
    # every step's record was finished: stage times of the timed steps are present
    assert sb["timed_steps"] == 8 - 0 - 3 and {"dense", "forward", "data"} <= set(sb["stage_ms"])
    acc = sb["gpu_accounting"]  # CPU run: no GPU activity, said so; traces kept
    assert acc["profiled_steps"] == 3 and not acc["available"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace_rank0.json", "trace_rank1.json"]
    assert torch.isfinite(torch.tensor(sb["straggler_share_median"]))


class _Records(TrainerHook):
    """The order in which step records reach the hooks, with their loss and share."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    def on_metrics(self, trainer, step, record):  # noqa: ANN001, ANN201
        self.seen.append((step, record["loss_sum"], record["straggler_share"]))


def _run_records(rank, world, cfg, never_flush=False):
    cls = Trainer
    if never_flush:  # the mutant: a deferred record is never finished at a flush point

        class _NeverFlush(Trainer):
            def _finish_step(self, rec, acc, bar, last, flush=True):  # noqa: ANN001
                super()._finish_step(rec, acc, bar, last, flush=False)

        cls = _NeverFlush
    hook = _Records()
    tr = cls(cfg, hooks=[hook])
    summary = tr.train()
    summary["_seen"] = [(s, x) for s, x, _ in hook.seen]
    summary["_shares_finite"] = all(math.isfinite(r) for _, _, r in hook.seen)
    return _state(tr), summary


def test_deferred_metrics_change_nothing(pool2):
    """defer_metrics finishes each step's record a step later (the stage-times all-gather
    in flight meanwhile): parameters bit for bit, every record once and in step order
    with the same loss, the same timed steps and eval; the deferral really happened
    (metrics_deferred > 0). A mutant that never finishes the deferred record at a flush
    point (eval, last step) is caught by the same record check."""
    base = tiny_config(steps=10, dtype="float32")
    base.eval_every = 5
    base.timing = "events"
    base.data_thread = True  # its gate waits on the hooks' records: finished later now
    deferred = dataclasses.replace(base, defer_metrics=True)
    a = pool2.run(_run_records, base)
    b = pool2.run(_run_records, deferred)
    assert _compare([r[0] for r in a], [r[0] for r in b], 0.0) == 0.0
    sa, sb = a[0][1], b[0][1]
    assert [s for s, _ in sa["_seen"]] == list(range(1, 11))
    assert sb["_seen"] == sa["_seen"] and sb["_shares_finite"]
    assert sa["metrics_deferred"] == 0 and sb["metrics_deferred"] > 0
    assert sb["timed_steps"] == sa["timed_steps"] and sb["eval_ne"] == sa["eval_ne"]
    mutant = pool2.run(_run_records, deferred, True)[0][1]
    assert mutant["_seen"] != sa["_seen"]  # the check sees the lost record


def test_host_copy_leaves_host_tensors_alone():
    t = torch.tensor(2.5)
    assert _host_copy(t) is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy path needs CUDA")
def test_host_copy_of_a_device_tensor_is_pinned_and_complete_after_a_later_event():
    x = torch.randn(3, device="cuda")
    h = _host_copy(x)
    ev = torch.cuda.Event()
    ev.record()
    ev.synchronize()
    assert h.device.type == "cpu" and h.is_pinned() and torch.equal(h, x.cpu())
