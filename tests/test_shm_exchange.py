"""ShmExchange (comm/shm_exchange.py): equal to gloo's all-gather on fresh random values
at 2 and 4 ranks over many back-to-back calls (the two parity slots reused), a length
mismatch raises on every rank, a rank that does not come names itself in the timeout,
and a peer process that is gone is reported at once, not after the timeout."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist

from freescale.comm.shm_exchange import ShmExchange, available

pytestmark = pytest.mark.skipif(not available()[0], reason=f"shm exchange: {available()[1]}")


def _equal_to_gloo(rank, world, seed):
    g = dist.new_group(backend="gloo")
    ex = ShmExchange(g, rank, world, max_len=40, timeout_s=30.0)
    rng = random.Random(seed * 100 + rank)
    bad = []
    for call in range(300):
        n = 1 + (call * 7) % 40  # every rank the same n per call
        vals = [rng.randrange(-(1 << 62), 1 << 62) for _ in range(n)]
        if call % 50 == 0:
            time.sleep(0.002 * rank)  # ranks arrive at different times
        got = ex.exchange(vals, f"call {call}")
        out = [torch.empty(n, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(out, torch.tensor(vals, dtype=torch.int64), group=g)
        if not torch.equal(got, torch.stack(out)):
            bad.append(call)
    n_ex = ex.exchanges
    ex.close()
    return bad, n_ex


@pytest.mark.parametrize("pool", ["pool2", "pool4"])
def test_exchange_equals_gloo_all_gather(pool, request):
    p = request.getfixturevalue(pool)
    seed = random.randrange(1 << 20)
    out = p.run(_equal_to_gloo, seed)
    for bad, n_ex in out:
        assert bad == [] and n_ex == 300, (seed, bad[:5])


def _mismatch(rank, world):
    g = dist.new_group(backend="gloo")
    ex = ShmExchange(g, rank, world, max_len=8, timeout_s=30.0)
    try:
        ex.exchange([1] * (2 + rank), "mismatch")
    except RuntimeError as e:
        return str(e)
    finally:
        dist.barrier(group=g)
        ex.close()
    return None


def test_length_mismatch_raises_on_every_rank(pool2):
    for msg in pool2.run(_mismatch):
        assert msg is not None and "different lengths" in msg and "mismatch" in msg


def _absent(rank, world):
    g = dist.new_group(backend="gloo")
    ex = ShmExchange(g, rank, world, max_len=4, timeout_s=1.0, name="hdr")
    msg = None
    if rank == 0:
        try:
            ex.exchange([1], "step 3")
        except TimeoutError as e:
            msg = str(e)
    dist.barrier(group=g)
    ex.close()
    return msg


def test_a_rank_that_does_not_come_is_named(pool2):
    msg = pool2.run(_absent)[0]
    assert msg is not None and "ranks [1] of 2 did not arrive" in msg and "hdr step 3" in msg
    assert "timed out after 1.0 s" in msg


def _gone(rank, world, tmp):
    """Rank 1 publishes one call, then a child process stands in for it: its pid is
    written into rank 1's slot and the child exits — rank 0's next call must report
    rank 1 as gone well before the 60 s timeout."""
    import subprocess
    import sys

    g = dist.new_group(backend="gloo")
    ex = ShmExchange(g, rank, world, max_len=4, timeout_s=60.0)
    ex.exchange([rank], "first")
    dist.barrier(group=g)
    if rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        ex._mm[1, 0, 2] = ex._mm[1, 1, 2] = child.pid  # a pid that no longer exists
    dist.barrier(group=g)
    out = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            ex.exchange([0], "second")
        except RuntimeError as e:
            out = (str(e), time.monotonic() - t0)
    dist.barrier(group=g)
    ex.close()
    return out


def test_a_gone_peer_is_reported_before_the_timeout(pool2, tmp_path):
    msg, _elapsed = pool2.run(_gone, str(tmp_path))[0]
    assert "rank 1" in msg and "is gone" in msg and "second" in msg


def test_constructor_checks():
    with pytest.raises(ValueError, match="max_len"):
        ShmExchange(None, 0, 1, max_len=0)  # type: ignore[arg-type]


def _two_hosts(rank, world):
    """Ranks that report different hosts: ``auto`` falls back to gloo on every rank (and
    still moves data correctly); ``shm`` asked for explicitly fails on every rank."""
    from unittest import mock

    from freescale.comm.copy_engine import CopyEngineCommunicator, CopyEngineConfig
    from freescale.comm.shm_exchange import ShmUnavailable

    with mock.patch("freescale.comm.shm_exchange.socket.gethostname", lambda: f"host{rank}"):
        comm = CopyEngineCommunicator.create(
            name="twohosts", config=CopyEngineConfig(timeout_s=30), device="cpu"
        )
        got = comm.all_gather(torch.full((3,), float(rank)), name="ag").wait()
        out = (comm.handshake, comm.handshake_note, [float(g[0]) for g in got])
        comm.close()
        try:
            CopyEngineCommunicator.create(
                name="twohosts_shm", config=CopyEngineConfig(handshake="shm"), device="cpu"
            )
            raised = None
        except ShmUnavailable as e:
            raised = str(e)
    return out, raised


def test_ranks_on_different_hosts_keep_gloo(pool2):
    for rank, ((handshake, note, got), raised) in enumerate(pool2.run(_two_hosts)):
        assert handshake == "gloo" and "span hosts" in note, (rank, note)
        assert got == [0.0, 1.0]
        assert raised is not None and "span hosts" in raised
