"""Tests for freescale.comm: the base Communicator and the HostStagedCommunicator against
the reference collective computed directly from every rank's known input, at 2 and 4
gloo ranks (random variable splits, empty splits, chunked multi-MB messages,
all-gather, exchange_counts), FIFO ordering under many outstanding submissions, and
errors raised inside the worker surfacing at wait() with the collective's name and the
ranks. One spawned job per world size runs every multi-rank check."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.comm import (
    CollectiveError,
    Communicator,
    HostStagedCommunicator,
    HostStagedConfig,
    PinnedBufferPool,
)
from freescale.comm.base import Done, device_wait, wait_clock

try:
    from _comm_cases import check_bad_splits
except ImportError:  # tests/ imported as a package
    from tests._comm_cases import check_bad_splits

torch.set_num_threads(1)


# ------------------------------------------------------------- reference helpers
def _splits(seed: int, world: int, hi: int) -> list[list[int]]:
    """S[src][dst]: rows rank src sends to rank dst (known to every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi + 1, (world, world), generator=g).tolist()


def _input(seed: int, src: int, rows: int, feat: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed * 1009 + src)
    if dtype.is_floating_point:
        return torch.randn((rows, *feat), generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, (rows, *feat), generator=g, dtype=dtype)


def _expected_a2a(seed, S, dst, feat, dtype) -> torch.Tensor:
    world = len(S)
    parts = []
    for s in range(world):
        x = _input(seed, s, sum(S[s]), feat, dtype)
        a = sum(S[s][:dst])
        parts.append(x[a : a + S[s][dst]])
    return torch.cat(parts)


def _check_a2a(comm, rank, seed, S, feat=(3,), dtype=torch.float32, name="a2a"):
    world = len(S)
    x = _input(seed, rank, sum(S[rank]), feat, dtype)
    out_splits = [S[s][rank] for s in range(world)]
    got = comm.all_to_all_v(x, S[rank], out_splits, name=name).wait()
    want = _expected_a2a(seed, S, rank, feat, dtype)
    assert got.dtype == dtype and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want), f"{type(comm).__name__} {name} differs on rank {rank}"


def _check_all_gather(comm, rank, world, seed, shape, dtype=torch.float32, name="ag"):
    got = comm.all_gather(_input(seed, rank, shape[0], shape[1:], dtype), name=name).wait()
    assert len(got) == world
    for r in range(world):
        assert torch.equal(got[r], _input(seed, r, shape[0], shape[1:], dtype)), (name, r)


# --------------------------------------------------------------- the rank job
def _collective_suite(comm, rank: int, world: int, big_rows: int) -> None:
    label = type(comm).__name__
    # random variable splits, two dtypes and row shapes
    _check_a2a(comm, rank, 1, _splits(11, world, 20))
    _check_a2a(comm, rank, 2, _splits(12, world, 9), feat=(), dtype=torch.int64)
    _check_a2a(comm, rank, 3, _splits(13, world, 4), feat=(2, 5), dtype=torch.bfloat16)
    # empty splits: rank 0 sends nothing, the last rank receives nothing
    S = _splits(14, world, 7)
    S[0] = [0] * world
    for s in range(world):
        S[s][world - 1] = 0
    _check_a2a(comm, rank, 4, S, name="empty")
    _check_a2a(comm, rank, 5, [[0] * world for _ in range(world)], name="all_empty")
    # large: a few MB per rank, many chunks for the host-staged backend
    per = big_rows // world
    S = [[per + 37 * ((s + d) % 3) for d in range(world)] for s in range(world)]
    _check_a2a(comm, rank, 6, S, feat=(8,), name="large")
    # all-gather: small, large, empty
    _check_all_gather(comm, rank, world, 7, (5, 7))
    _check_all_gather(comm, rank, world, 8, (big_rows * 2,), name="ag_large")
    _check_all_gather(comm, rank, world, 9, (0, 3), name="ag_empty")
    # exchange_counts: row d of counts goes to rank d
    counts = torch.arange(world * 2, dtype=torch.int64).reshape(world, 2) + 100 * rank
    got = comm.exchange_counts(counts)
    want = torch.stack([torch.tensor([2 * rank, 2 * rank + 1]) + 100 * s for s in range(world)])
    assert torch.equal(got, want), label
    comm.barrier()


def _fifo_suite(comm, rank: int, world: int) -> None:
    """Many outstanding submissions of different sizes and kinds, waited in reverse."""
    handles = []
    for i in range(40):
        S = _splits(100 + i, world, 3 + 40 * (i % 5))
        x = _input(200 + i, rank, sum(S[rank]), (4,), torch.float32)
        h = comm.all_to_all_v(x, S[rank], [S[s][rank] for s in range(world)], name=f"q{i}")
        handles.append(("a2a", i, S, h))
        if i % 7 == 0:
            y = _input(300 + i, rank, 33, (), torch.float32)
            handles.append(("ag", i, None, comm.all_gather(y, name=f"g{i}")))
    for kind, i, S, h in reversed(handles):
        got = h.wait()
        if kind == "a2a":
            assert torch.equal(got, _expected_a2a(200 + i, S, rank, (4,), torch.float32)), i
        else:
            for r in range(world):
                assert torch.equal(got[r], _input(300 + i, r, 33, (), torch.float32)), i


def _error_suite(rank: int, world: int) -> None:
    # (1) an error raised inside the worker, on every rank (nobody is left hanging)
    comm = HostStagedCommunicator.create(name="faulty", config=HostStagedConfig(timeout_s=20))

    def fault(op: str, name: str, k: int) -> None:
        if name == "boom":
            raise RuntimeError("injected transfer failure")

    comm._fault = fault
    S = _splits(21, world, 5)
    _check_a2a(comm, rank, 21, S, name="fine")  # works before the fault
    x = _input(22, rank, sum(S[rank]), (3,), torch.float32)
    h = comm.all_to_all_v(x, S[rank], [S[s][rank] for s in range(world)], name="boom")
    with pytest.raises(CollectiveError) as ei:
        h.wait()
    msg = str(ei.value)
    assert "all_to_all 'boom'" in msg and f"rank {rank} of {world}" in msg, msg
    assert f"group ranks {list(range(world))}" in msg and "injected transfer failure" in msg, msg
    # the worker kept the error: later submissions fail fast, with that error
    with pytest.raises(CollectiveError, match="failed earlier: injected transfer failure"):
        comm.all_gather(x, name="after")
    assert comm._worker is not None and comm._worker._thread.is_alive()
    comm.close()
    with pytest.raises(CollectiveError, match="closed"):
        comm.all_gather(x, name="closed")

    # (2) a timed-out transfer: rank 0 expects rows that rank 1 never sends
    comm_t = HostStagedCommunicator.create(name="lonely", config=HostStagedConfig(timeout_s=1.0))
    if rank == 0:
        out_splits = [0] * world
        out_splits[1] = 4
        h = comm_t.all_to_all_v(torch.zeros(0, 2), [0] * world, out_splits, name="lonely")
        with pytest.raises(CollectiveError) as ei:
            h.wait()
        msg = str(ei.value)
        assert "all_to_all 'lonely' on rank 0" in msg and "group ranks" in msg, msg
        assert "round 0: receive from group rank 1 timed out after 1.0 s" in msg, msg
        with pytest.raises(CollectiveError, match="failed earlier"):
            comm_t.barrier()
    comm_t.close()


def _rank_job(rank: int, world: int, store: str, big_rows: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        base = Communicator()
        # dedicated gloo groups, created in the same order on every rank
        direct = HostStagedCommunicator.create(
            name="hs_direct", config=HostStagedConfig(chunk_bytes=64 << 10)
        )
        cap = 2 * world * (16 << 10) * 2  # two rounds of 16 KiB blocks
        staged = HostStagedCommunicator.create(
            name="hs_staged",
            config=HostStagedConfig(
                chunk_bytes=16 << 10, max_pinned_bytes=cap, stage_host_tensors=True
            ),
        )
        assert staged.chunk_bytes == 16 << 10
        wait_clock.reset()
        for comm in (base, direct, staged):
            _collective_suite(comm, rank, world, big_rows)
            check_bad_splits(comm, rank, world)
        # every blocking wait() is on the wait clock, by thread, backend and name: once
        # per handle (a second wait() is free), not for a Done (nothing was waited for)
        seen = wait_clock.snapshot()
        for key in ("gloo:large", "host_staged:large"):
            assert seen[f"MainThread|{key}"][1] >= 1, sorted(seen)
        h = base.all_gather(torch.ones(2), name="twice")
        h.wait()
        h.wait()
        assert wait_clock.snapshot()["MainThread|gloo:twice"][1] == 1
        mine = wait_clock.per_step_ms(2, thread="MainThread")
        assert mine["gloo:twice"]["calls_per_step"] == 0.5 and "MainThread|gloo:twice" not in mine
        for comm in (direct, staged):
            _fifo_suite(comm, rank, world)
        # pinned (here: staging) memory stayed under the cap and was reused
        pool = staged._worker.pool_for(torch.device("cpu"))
        assert 0 < pool.peak_bytes_pinned <= cap, (pool.peak_bytes_pinned, cap)
        # bytes counted like the base Communicator: off-rank bytes sent
        for key in ("all_to_all:large", "all_gather:ag_large"):
            b = base.stats.bytes[f"gloo:{key}"]
            assert b > 0 and direct.stats.bytes[f"host_staged:{key}"] == b, key
            assert staged.stats.bytes[f"host_staged:{key}"] == b, key
        # all_reduce is refused with a clear message
        with pytest.raises(NotImplementedError, match="reductions stay on NCCL/gloo"):
            direct.all_reduce(torch.ones(3))
        if world == 2:
            _error_suite(rank, world)
        direct.close()
        staged.close()
        assert direct._worker is None
        base.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_reference(tmp_path, world: int) -> None:
    # a few MB per rank in the large all-to-all (8 floats per row)
    big_rows = 96_000 if world == 2 else 64_000
    store = os.path.join(tmp_path, "store")
    mp.spawn(_rank_job, args=(world, store, big_rows), nprocs=world, join=True)


# ------------------------------------------------------------- single process
def test_world_of_one_and_config() -> None:
    assert not dist.is_initialized()
    comm = HostStagedCommunicator()
    x = torch.randn(4, 3)
    assert comm.world_size == 1
    assert comm.all_gather(x).wait()[0] is x
    assert comm.all_to_all_v(x, [4], [4]).wait() is x
    assert torch.equal(comm.exchange_counts(torch.tensor([[3]])), torch.tensor([[3]]))
    comm.barrier()
    wait_clock.reset()
    Done(x).wait()  # nothing to wait for: not on the wait clock
    assert wait_clock.snapshot() == {}
    with device_wait("probe"):  # a host wait for the device, on the same clock
        pass
    assert wait_clock.snapshot()["MainThread|device:probe"][1] == 1
    with pytest.raises(ValueError, match="splits"):
        comm.all_to_all_v(x, [3], [4])
    with pytest.raises(NotImplementedError, match="reductions"):
        comm.all_reduce(x)
    comm.close()
    with pytest.raises(ValueError):
        HostStagedConfig(chunk_bytes=1)
    with pytest.raises(ValueError):
        HostStagedConfig(prefetch_rounds=0)


def test_pinned_pool_is_bounded_and_reused() -> None:
    pool = PinnedBufferPool(block_bytes=1024, max_bytes=3 * 1024 + 5, pin=False)
    assert pool.max_blocks == 3 and pool.available() == 3
    a, b, c = pool.acquire(), pool.acquire(), pool.acquire()
    assert pool.available() == 0 and pool.bytes_pinned == 3 * 1024
    with pytest.raises(RuntimeError):
        pool.acquire()
    pool.release([b])
    assert pool.acquire().data_ptr() == b.data_ptr()  # reused, not reallocated
    pool.release([a, b, c])
    assert pool.peak_bytes_pinned == 3 * 1024
    pool.clear()
    assert pool.bytes_pinned == 0
    with pytest.raises(ValueError):
        PinnedBufferPool(block_bytes=100, max_bytes=1000)


def _cuda_rank_job(rank: int, world: int, store: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        comm = HostStagedCommunicator.create(config=HostStagedConfig(chunk_bytes=256 << 10))
        dev = torch.device("cuda", torch.cuda.current_device())
        S = _splits(31, world, 20000)
        x = _input(31, rank, sum(S[rank]), (16,), torch.float32).to(dev)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # wait() orders the current (side) stream
            got = comm.all_to_all_v(x, S[rank], [S[s][rank] for s in range(world)]).wait()
            got = got.cpu()
        assert torch.equal(got, _expected_a2a(31, S, rank, (16,), torch.float32))
        ag = comm.all_gather(x[:1000], name="ag").wait()
        for r in range(world):
            want = _input(31, r, sum(S[r]), (16,), torch.float32)[:1000]
            assert torch.equal(ag[r].cpu(), want)
        assert 0 < comm.peak_bytes_pinned <= comm.config.max_pinned_bytes
        comm.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: device-to-host staging on a copy stream, events, pinned memory",
)
@pytest.mark.timeout(120)
def test_host_staged_cuda_matches_reference(tmp_path) -> None:
    store = os.path.join(tmp_path, "store")
    mp.spawn(_cuda_rank_job, args=(2, store), nprocs=2, join=True)


def test_serve_jobs_fails_what_follows_an_error_and_leaves_no_job_waiting():
    """The worker loop of both threaded communicators (host-staged, copy engine)."""
    import queue

    from freescale.comm.host_staged import _STOP, _Job, serve_jobs

    def boom():
        raise ValueError("bad piece")

    state: dict = {"error": None, "closed": 0}

    def fail(e):
        state["error"] = e

    def closing():
        state["closed"] += 1

    jobs: queue.SimpleQueue = queue.SimpleQueue()
    ran = [_Job(lambda: 7, "a"), _Job(boom, "b"), _Job(lambda: 8, "c")]
    for j in [*ran, _STOP]:
        jobs.put(j)
    serve_jobs(jobs, lambda: state["error"], fail, "test", closing=closing)
    ran[0].wait()
    assert ran[0].result == 7 and state["closed"] == 1
    with pytest.raises(ValueError, match="bad piece"):
        ran[1].wait()
    with pytest.raises(RuntimeError, match="an earlier collective failed: bad piece"):
        ran[2].wait()

    # a setup that raises: the loop records why, and every queued job fails with it
    state["error"] = None
    queued = [_Job(lambda: 1, "d"), _Job(lambda: 2, "e")]
    for j in queued:
        jobs.put(j)
    serve_jobs(jobs, lambda: state["error"], fail, "test", setup=boom, closing=closing)
    assert state["closed"] == 2
    for j in queued:
        assert j.is_completed()
        with pytest.raises(RuntimeError, match="test worker died: ValueError"):
            j.wait()
