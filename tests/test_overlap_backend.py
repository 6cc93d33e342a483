"""The overlapped embedding traffic routed through the SM-free backends (issue 6):
``TrainConfig.overlap_backend`` = host_staged / copy_engine / auto, in training, on 2
gloo ranks (host-staged over a dedicated gloo group; the copy engine over /dev/shm
peer buffers, its CPU mode). Each run must equal vanilla bit for bit (tier 1), the
SM-free backend must really have carried bytes (counters), and a broken backend must
be caught by the same comparison (mutation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freescale.balance.hook import BalanceHook
from freescale.balance.planner import BalanceConfig
from freescale.comm.base import Awaitable
from freescale.pipeline.trainer import Trainer
from test_bench_e2e import e2e_config
from test_trainer import _full_tables, _state


def _run(rank, world, cfg, corrupt=False, balance=False):
    hooks = [BalanceHook(BalanceConfig(partitioner="fbs"))] if balance else []
    tr = Trainer(cfg, hooks=hooks)
    if corrupt:  # mutation: the SM-free backend delivers a wrong exclusive payload
        side = tr.sparse.side_comm
        orig = side.all_to_all_v

        def bad(tensor, *a, **kw):
            aw = orig(tensor, *a, **kw)
            out = aw.wait()
            if out.is_floating_point() and out.numel():
                out = out.clone()
                out.view(-1)[0] += 1e-3
            return Awaitable([], lambda: out, "bad", "corrupted all_to_all")

        side.all_to_all_v = bad
    summary = tr.train()
    tr.close()  # closes the SM-free communicator it made (nothing outlives the trainer)
    side = getattr(tr.sparse, "side_comm", None)
    summary["device_completions"] = getattr(side, "device_completions", 0)
    summary["handshake"] = getattr(side, "handshake", None)
    summary["side_closed"] = getattr(side, "_closed", None)
    return _state(tr), summary


def _equal(a, b) -> bool:
    ta, tb = _full_tables([r[0] for r in a]), _full_tables([r[0] for r in b])
    same = all(torch.equal(ta[n], tb[n]) for n in ta)
    da, db = a[0][0]["dense"], b[0][0]["dense"]
    return same and all(torch.equal(da[k], db[k]) for k in da)


@pytest.mark.parametrize(
    "mode,backend,completion,handshake",
    [
        ("prioritized", "host_staged", None, "auto"),
        ("prioritized", "copy_engine", "host", "gloo"),
        ("prioritized", "copy_engine", "device", "shm"),
        ("sdd", "auto", None, "auto"),
    ],
)
def test_overlapped_traffic_on_smfree_backends_is_exact(
    pool2, mode, backend, completion, handshake
):
    from freescale.comm.shm_exchange import available

    if handshake == "shm" and not available()[0]:
        pytest.skip(f"shared-memory handshake unavailable here: {available()[1]}")
    base = dataclasses.replace(e2e_config(), eval_every=0, timing="sync", profile_steps=0)
    van = pool2.run(_run, base)
    cfg = dataclasses.replace(
        base,
        mode=mode,
        overlap_backend=backend,
        copy_engine_completion=completion or "auto",
        copy_engine_handshake=handshake,
    )
    res = pool2.run(_run, cfg)
    assert _equal(res, van), f"{mode} over {backend} differs from vanilla"
    s = res[0][1]
    want = "host_staged" if backend == "auto" else backend  # auto on CPU: host-staged
    assert s["overlap_backend"] == want
    assert s["comm_bytes_by_backend"].get(want, 0) > 0, s["comm_bytes_by_backend"]
    # the completion protocol asked for really ran (on CPU ranks: the same gloo
    # exchanges, no events; the CUDA events are checked by benchmarks/gpu_check_comm.py)
    assert (s["device_completions"] > 0) == (completion == "device"), s["device_completions"]
    if backend == "copy_engine":  # the handshake asked for carried the collectives
        assert s["handshake"] == handshake, s["handshake"]
    assert s["smfree"]["backend"] == want, s["smfree"]  # the summary names the protocol
    assert s["side_closed"] is True  # Trainer.close() closed the overlap communicator


def test_a_broken_smfree_backend_is_caught(pool2):
    base = dataclasses.replace(e2e_config(), eval_every=0, timing="sync", profile_steps=0)
    van = pool2.run(_run, base)
    cfg = dataclasses.replace(base, mode="prioritized", overlap_backend="host_staged")
    res = pool2.run(_run, cfg, True)
    assert not _equal(res, van)


def test_balancer_exchanges_on_the_smfree_backend(pool2):
    """With an SM-free overlap backend the balancer's metadata and sample moves use it
    too: the same plans and moves, so bitwise equal to balancing over the default."""
    base = dataclasses.replace(e2e_config(), eval_every=0, timing="sync", profile_steps=0)
    ref = pool2.run(_run, base, False, True)
    cfg = dataclasses.replace(base, overlap_backend="host_staged")  # vanilla schedule
    res = pool2.run(_run, cfg, False, True)
    assert _equal(res, ref)
    s = res[0][1]
    assert s["overlap_backend"] is None  # vanilla: no embedding side traffic
    assert s["comm_bytes_by_backend"].get("host_staged", 0) > 0, s["comm_bytes_by_backend"]
    assert "host_staged" not in ref[0][1]["comm_bytes_by_backend"]
