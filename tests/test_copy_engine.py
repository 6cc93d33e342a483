"""Tests for freescale.comm.copy_engine.

CPU (always): the pure parts — receive offsets, the byte-level copy plans (checked by
simulating every rank's copies into every receive buffer), buffer growth, backend
selection, config validation, the symmetric-memory API shape of this torch, the
multicast guard — and the whole protocol at 2 and 4 gloo ranks with ``host_shm`` peer
memory (CPU tensors in /dev/shm files stand in for peer-mapped GPU buffers): random
variable splits, empty splits, multi-MB messages through growing buffers, zero-copy
segments and their lifetime, all-gather, FIFO order, errors naming the collective and
the ranks, timeouts.

CUDA (skipped here, "needs 2 CUDA devices"): two spawned ranks with NCCL + gloo compare
nccl, copy_engine (symmetric and ipc peer memory; contiguous and segments) and
host_staged against the reference collective on random variable splits, empty splits
and 64 MB messages, with the input produced on the current stream right before the call.
"""

from __future__ import annotations

import inspect
import os
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.comm import (
    CollectiveError,
    Communicator,
    CopyEngineCommunicator,
    CopyEngineConfig,
    HostStagedCommunicator,
    HostStagedConfig,
    SMFreeConfig,
    select_backend,
)
from freescale.comm.copy_engine import (
    COMPLETION_ENV,
    STREAM_PRIORITY_ENV,
    TRAFFIC_CLASSES,
    _split_range,
    ensure_no_multicast,
    grow_capacity,
    plan_all_gather,
    plan_all_to_all,
    receive_offsets,
    symm_available,
)
from freescale.comm.shm_exchange import available as shm_available

try:
    from _comm_cases import check_bad_splits
except ImportError:  # tests/ imported as a package
    from tests._comm_cases import check_bad_splits


# ------------------------------------------------------------- reference helpers
def _splits(seed: int, world: int, hi: int) -> list[list[int]]:
    """S[src][dst]: rows rank src sends to rank dst (known to every rank)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi + 1, (world, world), generator=g).tolist()


def _input(seed: int, src: int, rows: int, feat: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed * 1009 + src)
    if dtype.is_floating_point:
        return torch.randn((rows, *feat), generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, (rows, *feat), generator=g, dtype=torch.int64).to(dtype)


def _expected_a2a(seed, S, dst, feat, dtype) -> torch.Tensor:
    parts = []
    for s in range(len(S)):
        x = _input(seed, s, sum(S[s]), feat, dtype)
        a = sum(S[s][:dst])
        parts.append(x[a : a + S[s][dst]])
    return torch.cat(parts)


# ================================================================ pure parts
def test_receive_offsets() -> None:
    S = [[1, 2, 0], [3, 0, 4], [5, 6, 7]]
    assert receive_offsets(S, 0) == [0, 1, 4, 9]
    assert receive_offsets(S, 1) == [0, 2, 2, 8]
    assert receive_offsets(S, 2) == [0, 0, 4, 11]
    with pytest.raises(ValueError):
        receive_offsets([[-1]], 0)


def _simulate(plans, world, inputs, with_self=True):
    """Apply every rank's pushes to every rank's receive buffer, then each rank's
    copy-out + own copy: the outputs every rank would see."""
    need = plans[0].need_bytes
    assert all(p.need_bytes == need for p in plans), "every rank must size buffers alike"
    bufs = [torch.full((need,), 255, dtype=torch.uint8) for _ in range(world)]
    for src, plan in enumerate(plans):
        for peer, s_off, d_off, n in plan.pushes:
            assert peer != src and n > 0
            assert d_off + n <= need and s_off + n <= inputs[src].numel()
            bufs[peer][d_off : d_off + n] = inputs[src][s_off : s_off + n]
    outs = []
    for r, plan in enumerate(plans):
        out = torch.full((plan.recv_bytes,), 254, dtype=torch.uint8)
        for a, m in plan.copy_out_ranges(r):
            out[a : a + m] = bufs[r][a : a + m]
        o, s, n = plan.self_copy
        if with_self:
            out[o : o + n] = inputs[r][s : s + n]
        # the segments describe the same layout
        for src, (off, n) in enumerate(plan.segments):
            if src != r and n:
                assert torch.equal(out[off : off + n], bufs[r][off : off + n])
        outs.append(out)
    return outs


@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plan_all_to_all_matches_reference(world: int, seed: int) -> None:
    S = _splits(seed, world, 6)
    if seed == 1:  # empty rows and columns
        S[0] = [0] * world
        for s in range(world):
            S[s][world - 1] = 0
    if seed == 2 and world > 1:
        S = [[0] * world for _ in range(world)]
    row_bytes = 12
    inputs = [
        torch.randint(
            0,
            250,
            (sum(S[r]) * row_bytes,),
            dtype=torch.uint8,
            generator=torch.Generator().manual_seed(r),
        )
        for r in range(world)
    ]
    plans = [plan_all_to_all(S, r, row_bytes) for r in range(world)]
    outs = _simulate(plans, world, inputs)
    for d in range(world):
        want = []
        for s in range(world):
            a = sum(S[s][:d]) * row_bytes
            want.append(inputs[s][a : a + S[s][d] * row_bytes])
        assert torch.equal(outs[d], torch.cat(want)), d
        assert plans[d].recv_bytes == sum(S[s][d] for s in range(world)) * row_bytes
    assert (
        plans[0].need_bytes
        == max(sum(S[s][d] for s in range(world)) for d in range(world)) * row_bytes
    )


def test_plan_all_gather_matches_reference() -> None:
    world, n = 4, 40
    inputs = [torch.full((n,), r + 1, dtype=torch.uint8) for r in range(world)]
    plans = [plan_all_gather(world, r, n) for r in range(world)]
    for out in _simulate(plans, world, inputs):
        assert torch.equal(out, torch.cat(inputs))
    assert plan_all_gather(3, 1, 0).pushes == ()
    with pytest.raises(ValueError):
        plan_all_gather(2, 2, 4)


def test_plan_rejects_bad_matrix() -> None:
    with pytest.raises(ValueError):
        plan_all_to_all([[1, 2], [3]], 0, 4)


def test_grow_capacity() -> None:
    MiB = 1 << 20
    assert grow_capacity(0, 0) == 0
    assert grow_capacity(8 * MiB, 5 * MiB) == 8 * MiB  # fits: unchanged, reused
    assert grow_capacity(0, 1, minimum=8 * MiB) == 8 * MiB
    assert grow_capacity(8 * MiB, 9 * MiB, factor=2.0) == 16 * MiB  # geometric
    assert grow_capacity(8 * MiB, 40 * MiB + 1, factor=2.0) == 42 * MiB  # need, aligned
    assert grow_capacity(0, 100, align=64) == 128
    assert grow_capacity(8 * MiB, 9 * MiB, factor=2.0, maximum=12 * MiB) == 12 * MiB
    with pytest.raises(ValueError, match="max_buffer_bytes"):
        grow_capacity(0, 13 * MiB, maximum=12 * MiB)
    # deterministic: every rank computes the same sequence of sizes
    caps, cap = [], 0
    for need in [1, 3 * MiB, 9 * MiB, 9 * MiB, 30 * MiB, 2 * MiB]:
        cap = grow_capacity(cap, need, factor=1.5, minimum=4 * MiB)
        caps.append(cap)
    assert caps == [4 * MiB, 4 * MiB, 10 * MiB, 10 * MiB, 30 * MiB, 30 * MiB]


def test_split_range() -> None:
    for n in [0, 1, 65536, 65537, 10 << 20, (10 << 20) + 3]:
        for parts in [1, 2, 3, 4]:
            pieces = _split_range(n, parts)
            assert len(pieces) <= max(parts, 1)
            covered = 0
            for a, m in pieces:
                assert a == covered and m > 0
                covered += m
            assert covered == n


def test_select_backend_table() -> None:
    # automatic: overlapped intra-node -> copy engine (CUDA), inter-node -> host staged
    assert select_backend("intra_node", "exclusive_embeddings", cuda=True) == "copy_engine"
    assert select_backend("intra_node", "ids", cuda=False) == "host_staged"
    assert select_backend("inter_node", "exclusive_gradients", cuda=True) == "host_staged"
    assert select_backend("intra_node", "overlapped", cuda=True) == "copy_engine"
    # blocking traffic and reductions -> NCCL
    assert select_backend("intra_node", "collision", cuda=True) == "nccl"
    assert select_backend("intra_node", "blocking", cuda=True) == "nccl"
    assert select_backend("intra_node", "dense", collective="all_reduce", cuda=True) == "nccl"
    assert select_backend("intra_node", "balancing", collective="all_reduce", cuda=True) == "nccl"
    for traffic in TRAFFIC_CLASSES:
        assert select_backend("inter_node", traffic, cuda=True) in ("nccl", "host_staged")
    # overrides win, but are checked
    cfg = SMFreeConfig(ids="nccl", collision="host_staged", balancing="copy_engine")
    assert select_backend("intra_node", "ids", cfg, cuda=True) == "nccl"
    assert select_backend("intra_node", "collision", cfg, cuda=True) == "host_staged"
    assert select_backend("intra_node", "balancing", cfg, cuda=False) == "copy_engine"
    with pytest.raises(ValueError, match="one NVLink node"):
        select_backend("inter_node", "balancing", cfg, cuda=True)
    with pytest.raises(ValueError, match="reduction"):
        select_backend(
            "intra_node", "ids", SMFreeConfig(ids="host_staged"), collective="all_reduce", cuda=True
        )
    with pytest.raises(ValueError, match="kind"):
        select_backend("node", "ids")
    with pytest.raises(ValueError, match="unknown traffic"):
        select_backend("intra_node", "embeddings")


def test_smfree_config_validation() -> None:
    cfg = SMFreeConfig()
    assert all(cfg.backend_for(t) == "auto" for t in TRAFFIC_CLASSES)
    with pytest.raises(ValueError, match="choose one of"):
        SMFreeConfig(ids="gloo")
    with pytest.raises(ValueError, match="reduction"):
        SMFreeConfig(dense="copy_engine")
    with pytest.raises(ValueError, match="unknown traffic"):
        cfg.backend_for("dense_grads")
    d = SMFreeConfig.from_dict(
        {"ids": "host_staged", "copy_engine": {"num_recv_buffers": 3}, "host_staged": {}}
    )
    assert d.ids == "host_staged" and d.copy_engine.num_recv_buffers == 3
    with pytest.raises(ValueError, match="unknown SMFreeConfig keys"):
        SMFreeConfig.from_dict({"idz": "auto"})


def test_copy_engine_config_validation() -> None:
    CopyEngineConfig()
    for bad in [
        dict(peer_memory="nvshmem"),
        dict(num_recv_buffers=0),
        dict(growth_factor=0.5),
        dict(initial_buffer_bytes=-1),
        dict(max_buffer_bytes=0),
        dict(initial_buffer_bytes=1 << 30, max_buffer_bytes=1 << 20),
        dict(copy_streams=0),
        dict(timeout_s=0),
        dict(completion="gpu"),
        dict(handshake="tcp"),
    ]:
        with pytest.raises(ValueError):
            CopyEngineConfig(**bad)


def test_copy_engine_handshake_resolution(monkeypatch) -> None:
    """``auto`` follows FREESCALE_COPY_ENGINE_HANDSHAKE (shm | gloo), else stays auto
    (shm where available); explicit values win; a bad variable is an error."""
    from freescale.comm.copy_engine import HANDSHAKE_ENV

    monkeypatch.delenv(HANDSHAKE_ENV, raising=False)
    assert CopyEngineConfig().resolved_handshake() == "auto"
    monkeypatch.setenv(HANDSHAKE_ENV, "gloo")
    assert CopyEngineConfig().resolved_handshake() == "gloo"
    assert CopyEngineConfig(handshake="shm").resolved_handshake() == "shm"
    monkeypatch.setenv(HANDSHAKE_ENV, "tcp")
    with pytest.raises(ValueError, match=HANDSHAKE_ENV):
        CopyEngineConfig().resolved_handshake()


def test_copy_engine_completion_resolution(monkeypatch) -> None:
    """``auto`` follows FREESCALE_COPY_ENGINE_COMPLETION, else device; explicit values win."""
    monkeypatch.delenv(COMPLETION_ENV, raising=False)
    assert CopyEngineConfig().resolved_completion() == "device"
    monkeypatch.setenv(COMPLETION_ENV, "host")
    assert CopyEngineConfig().resolved_completion() == "host"
    assert CopyEngineConfig(completion="device").resolved_completion() == "device"
    monkeypatch.setenv(COMPLETION_ENV, "sometimes")
    with pytest.raises(ValueError, match=COMPLETION_ENV):
        CopyEngineConfig().resolved_completion()


def test_copy_stream_priority_resolution(monkeypatch) -> None:
    """Copy streams default to the high-priority pool (-1); the environment overrides
    (0 = the shared low-priority pool, for A/B runs); junk is rejected by name."""
    monkeypatch.delenv(STREAM_PRIORITY_ENV, raising=False)
    assert CopyEngineConfig().resolved_stream_priority() == -1
    assert CopyEngineConfig(stream_priority=0).resolved_stream_priority() == 0
    monkeypatch.setenv(STREAM_PRIORITY_ENV, "0")
    assert CopyEngineConfig().resolved_stream_priority() == 0
    monkeypatch.setenv(STREAM_PRIORITY_ENV, "high")
    with pytest.raises(ValueError, match=STREAM_PRIORITY_ENV):
        CopyEngineConfig().resolved_stream_priority()


def test_copy_streams_are_requested_from_the_high_priority_pool(monkeypatch) -> None:
    """Both SM-free backends ask torch for their CUDA copy streams with the resolved
    priority (-1 by default: the high-priority pool), never the default 0. Stream
    creation is recorded instead of run (no GPU here)."""
    from freescale.comm import copy_engine as ce
    from freescale.comm import host_staged as hs

    made: list[dict] = []

    class _Rec:
        def __init__(self, device=None, priority=0, **kw) -> None:  # noqa: ANN001
            made.append({"device": device, "priority": priority})

    monkeypatch.setattr(torch.cuda, "Stream", _Rec)
    monkeypatch.delenv(STREAM_PRIORITY_ENV, raising=False)
    dev = torch.device("cuda", 0)
    ce._CudaCopier(dev, 2, CopyEngineConfig().resolved_stream_priority())
    hs._CudaCopier(dev)
    assert [m["priority"] for m in made] == [-1, -1, -1, -1]
    made.clear()
    monkeypatch.setenv(STREAM_PRIORITY_ENV, "0")  # the A/B switch back to the shared pool
    ce._CudaCopier(dev, 1, CopyEngineConfig().resolved_stream_priority())
    hs._CudaCopier(dev)
    assert [m["priority"] for m in made] == [0, 0, 0]


def test_future_callbacks_draw_streams_from_the_global_pool() -> None:
    """The premise of ``CopyEngineConfig.stream_priority``: a Future callback (DDP comm
    hooks' ``then``) runs on a stream drawn from torch's global (low-priority) stream
    pool, which it makes wait on the future's events. Read from the installed torch's
    headers; if this stops holding, revisit the copy streams' priority."""
    import os

    header = os.path.join(os.path.dirname(torch.__file__), "include/ATen/core/ivalue_inl.h")
    if not os.path.exists(header):
        pytest.skip("this torch install ships no C++ headers to read the premise from")
    src = open(header).read()
    at = src.find("getStreamFromGlobalPool(device)")
    assert at > 0
    window = src[at - 1500 : at + 600]
    assert "callback(*this)" in window and "synchronizeWithCurrentStreams" in window


def test_symmetric_memory_api_shape() -> None:
    """The private calls the compatibility layer makes exist with the expected shape in
    this torch (2.13 here; 2.11 is checked on the GPU machine by gpu_check_comm.py)."""
    import torch.distributed._symmetric_memory as sm

    assert callable(sm.empty) and callable(sm.rendezvous)
    params = list(inspect.signature(sm.rendezvous).parameters)
    assert params[:2] == ["tensor", "group"], params
    doc = sm._SymmetricMemory.get_buffer.__doc__ or ""
    assert "storage_offset" in doc and "rank" in doc, doc
    ok, why = symm_available()
    assert ok == torch.cuda.is_available(), why


def test_multicast_guard(monkeypatch) -> None:
    for k in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.delenv(k, raising=False)
    env = ensure_no_multicast()
    assert env == {
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NCCL_NVLS_ENABLE": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
    }
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(RuntimeError, match="multicast"):
        ensure_no_multicast()


def test_world_of_one() -> None:
    assert not dist.is_initialized()
    comm = CopyEngineCommunicator(device="cpu")
    x = torch.randn(4, 3)
    assert comm.world_size == 1
    assert comm.all_gather(x).wait()[0] is x
    assert comm.all_gather(x, views=True).wait()[0] is x
    assert comm.all_to_all_v(x, [4], [4]).wait() is x
    h = comm.all_to_all_v_segments(x, [4], [4])
    assert h.wait()[0] is x
    h.release()
    assert torch.equal(comm.exchange_counts(torch.tensor([[3]])), torch.tensor([[3]]))
    comm.barrier()
    with pytest.raises(ValueError, match="splits"):
        comm.all_to_all_v(x, [3], [4])
    with pytest.raises(NotImplementedError, match="reductions"):
        comm.all_reduce(x)
    from freescale.comm.copy_engine import stall_reports

    assert any(r == comm.stall_report() for r in stall_reports())  # open: reported
    comm.close()
    assert not any(r.startswith(comm.stall_report().splitlines()[0]) for r in stall_reports())
    with pytest.raises(ValueError, match="needs CUDA"):
        CopyEngineCommunicator(device="cpu", config=CopyEngineConfig(peer_memory="symmetric"))


# ============================================== multi-rank protocol on CPU ranks
def _check_a2a(comm, rank, seed, S, feat=(3,), dtype=torch.float32, name="a2a"):
    world = len(S)
    x = _input(seed, rank, sum(S[rank]), feat, dtype)
    got = comm.all_to_all_v(x, S[rank], [S[s][rank] for s in range(world)], name=name).wait()
    want = _expected_a2a(seed, S, rank, feat, dtype)
    assert got.dtype == dtype and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got, want), f"{name} differs on rank {rank}"


def _check_segments(comm, rank, seed, S, feat=(3,), dtype=torch.float32, name="seg"):
    world = len(S)
    x = _input(seed, rank, sum(S[rank]), feat, dtype)
    h = comm.all_to_all_v_segments(x, S[rank], [S[s][rank] for s in range(world)], name=name)
    segs = h.wait()
    assert len(segs) == world
    for s in range(world):
        assert segs[s].shape == (S[s][rank], *feat) and segs[s].dtype == dtype
    # the own segment is a view of the input: nothing was copied for it
    if S[rank][rank]:
        assert segs[rank].data_ptr() == x[sum(S[rank][:rank])].data_ptr()
    got = torch.cat(segs)
    h.release()
    assert torch.equal(got, _expected_a2a(seed, S, rank, feat, dtype)), f"{name} rank {rank}"


def ce_suite(
    rank: int, world: int, big_rows: int, completion: str = "host", handshake: str = "auto"
) -> dict:
    torch.set_num_threads(1)
    base = Communicator()
    cfg = CopyEngineConfig(
        initial_buffer_bytes=4096,
        growth_factor=1.5,
        timeout_s=60,
        completion=completion,
        handshake=handshake,
    )
    comm = CopyEngineCommunicator.create(name="ce", config=cfg, device="cpu")
    assert comm.completion == completion
    try:
        # random variable splits, dtypes and row shapes
        _check_a2a(comm, rank, 1, _splits(11, world, 20))
        _check_a2a(comm, rank, 2, _splits(12, world, 9), feat=(), dtype=torch.int64)
        _check_a2a(comm, rank, 3, _splits(13, world, 4), feat=(2, 5), dtype=torch.bfloat16)
        _check_a2a(comm, rank, 4, _splits(14, world, 7), feat=(1,), dtype=torch.int8)
        check_bad_splits(comm, rank, world)
        # empty splits: rank 0 sends nothing, the last rank receives nothing
        S = _splits(15, world, 7)
        S[0] = [0] * world
        for s in range(world):
            S[s][world - 1] = 0
        _check_a2a(comm, rank, 5, S, name="empty")
        _check_segments(comm, rank, 5, S, name="empty_seg")
        _check_a2a(comm, rank, 6, [[0] * world for _ in range(world)], name="all_empty")
        # large: several MB per rank, the receive buffers grow on the way
        per = big_rows // world
        S = [[per + 37 * ((s + d) % 3) for d in range(world)] for s in range(world)]
        _check_a2a(comm, rank, 7, S, feat=(8,), name="large")
        _check_segments(comm, rank, 8, S, feat=(8,), name="large_seg")
        grew = comm.buffer_bytes
        assert grew >= max(sum(S[s][d] for s in range(world)) for d in range(world)) * 32
        # all-gather: contiguous, zero-copy views, empty
        for views in (False, True):
            x = _input(9, rank, 5, (7,), torch.float32)
            h = comm.all_gather(x, name=f"ag{views}", views=views)
            got = h.wait()
            for r in range(world):
                assert torch.equal(got[r], _input(9, r, 5, (7,), torch.float32)), (views, r)
            if views:
                assert got[rank] is x
                h.release()
        got = comm.all_gather(torch.zeros(0, 3), name="ag_empty").wait()
        assert all(g.shape == (0, 3) for g in got)
        # exchange_counts: row d of counts goes to rank d
        counts = torch.arange(world * 2, dtype=torch.int32).reshape(world, 2) + 100 * rank
        got = comm.exchange_counts(counts)
        want = torch.stack(
            [
                torch.tensor([2 * rank, 2 * rank + 1], dtype=torch.int32) + 100 * s
                for s in range(world)
            ]
        )
        assert torch.equal(got, want) and got.dtype == torch.int32
        comm.barrier()

        # FIFO: many outstanding submissions, waited in reverse
        handles = []
        for i in range(24):
            S = _splits(100 + i, world, 3 + 30 * (i % 4))
            x = _input(200 + i, rank, sum(S[rank]), (4,), torch.float32)
            out_s = [S[s][rank] for s in range(world)]
            handles.append(("a2a", i, S, comm.all_to_all_v(x, S[rank], out_s, name=f"q{i}")))
            if i % 5 == 0:
                y = _input(300 + i, rank, 33, (), torch.float32)
                handles.append(("ag", i, None, comm.all_gather(y, name=f"g{i}")))
        for kind, i, S, h in reversed(handles):
            got = h.wait()
            if kind == "a2a":
                assert torch.equal(got, _expected_a2a(200 + i, S, rank, (4,), torch.float32)), i
            else:
                for r in range(world):
                    assert torch.equal(got[r], _input(300 + i, r, 33, (), torch.float32)), i

        # segments of call k survive the next call (other buffer) untouched
        S = _splits(300, world, 50)
        x = _input(300, rank, sum(S[rank]), (4,), torch.float32)
        h = comm.all_to_all_v_segments(x, S[rank], [S[s][rank] for s in range(world)])
        segs = h.wait()
        _check_a2a(comm, rank, 301, _splits(301, world, 50), feat=(4,))
        assert torch.equal(torch.cat(segs), _expected_a2a(300, S, rank, (4,), torch.float32))
        h.release()

        # bytes counted like the base Communicator: off-rank bytes sent
        S = _splits(400, world, 10)
        x = _input(400, rank, sum(S[rank]), (3,), torch.float32)
        out_s = [S[s][rank] for s in range(world)]
        base.all_to_all_v(x, S[rank], out_s, name="count").wait()
        comm.all_to_all_v(x, S[rank], out_s, name="count").wait()
        assert (
            comm.stats.bytes["copy_engine:all_to_all:count"]
            == base.stats.bytes["gloo:all_to_all:count"]
        )
        with pytest.raises(NotImplementedError, match="reductions stay on NCCL/gloo"):
            comm.all_reduce(torch.ones(3))
        mem = comm.memory_stats()
        assert mem["peer_memory"] == "host_shm"
        assert 0 < mem["peak_buffer_bytes"] <= 2 * cfg.max_buffer_bytes
        # the hang-diagnosis report: the last jobs, each issued, every event complete
        report = comm.stall_report().splitlines()
        assert report[0].startswith(f"copy engine 'ce' rank {rank}/{world}: next seq {comm._seq}")
        assert len(report) == 1 + 6 and all(": issued;" in line for line in report[1:]), report
        assert not any("PENDING" in line for line in report), report
        return {
            "grew_to": grew,
            "mem": mem,
            "seq": comm._seq,
            "device_completions": comm.device_completions,
            "handshake": comm.handshake,
            "shm_exchanges": comm._xchg.exchanges if comm._xchg is not None else 0,
        }
    finally:
        comm.close()


def ce_error_suite(rank: int, world: int) -> str:
    torch.set_num_threads(1)
    cfg = CopyEngineConfig(initial_buffer_bytes=4096, timeout_s=30)
    comm = CopyEngineCommunicator.create(name="ce_err", config=cfg, device="cpu")
    # (1) inconsistent splits fail on every rank, with the same message
    S = _splits(21, world, 5)
    _check_a2a(comm, rank, 21, S, name="fine")
    x = _input(22, rank, sum(S[rank]), (3,), torch.float32)
    out_s = [S[s][rank] for s in range(world)]
    if rank == 1:
        out_s[0] += 1  # rank 1 expects one row too many from rank 0
    h = comm.all_to_all_v(x, S[rank], out_s, name="bad")
    with pytest.raises(CollectiveError) as ei:
        h.wait()
    msg = str(ei.value)
    assert "all_to_all 'bad'" in msg and f"rank {rank} of {world}" in msg, msg
    assert f"group ranks {list(range(world))}" in msg, msg
    assert f"rank 0 sends {S[0][1]} rows to rank 1, which expects {S[0][1] + 1}" in msg, msg
    # the worker kept the error: later submissions are refused with it
    with pytest.raises(CollectiveError, match="failed earlier"):
        comm.all_gather(x, name="after")
    comm.close()
    with pytest.raises(CollectiveError, match="closed"):
        comm.all_gather(x, name="closed")

    # (2) a timed-out collective: rank 0 issues one that no other rank issues
    comm_t = CopyEngineCommunicator.create(
        name="lonely", config=CopyEngineConfig(timeout_s=1.0), device="cpu"
    )
    if rank == 0:
        h = comm_t.all_gather(torch.ones(3), name="lonely")
        with pytest.raises(CollectiveError) as ei:
            h.wait()
        msg = str(ei.value)
        assert "all_gather 'lonely' on rank 0" in msg and "timed out after 1.0 s" in msg, msg
    comm_t.close()

    # (3) ranks disagreeing on the collective (order bug) fail alike
    comm_o = CopyEngineCommunicator.create(name="order", config=cfg, device="cpu")
    t = torch.ones(4)
    h = comm_o.all_gather(t, name="a" if rank == 0 else "b")
    with pytest.raises(CollectiveError, match="ranks disagree on the collective name"):
        h.wait()
    comm_o.close()
    return "ok"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "world,completion,handshake",
    [
        (2, "host", "shm"),
        (4, "host", "shm"),
        (2, "device", "shm"),
        (4, "device", "shm"),
        (2, "device", "gloo"),
        (4, "host", "gloo"),
    ],
)
def test_copy_engine_protocol_on_cpu_ranks(
    world: int, completion: str, handshake: str, request
) -> None:
    """The whole protocol (random splits and dtypes, empty and large messages, views,
    FIFO depth, byte counts) against the reference, with each handshake: the
    shared-memory exchange (comm/shm_exchange.py; counted: it really carried the
    handshakes) and the two gloo collectives."""
    if handshake == "shm" and not shm_available()[0]:
        pytest.skip(f"shared-memory handshake unavailable here: {shm_available()[1]}")
    pool = request.getfixturevalue(f"pool{world}")
    big_rows = 60_000 if world == 2 else 40_000  # 8 floats per row: MBs per rank
    res = pool.run(ce_suite, big_rows, completion, handshake)
    assert all(r["handshake"] == handshake for r in res)
    # two handshakes per data collective (header, completion flag) went through shm
    assert all((r["shm_exchanges"] > 2 * 30) == (handshake == "shm") for r in res)
    assert len({r["seq"] for r in res}) == 1  # every rank issued the same sequence
    assert all(r["grew_to"] > 4096 for r in res)
    # the device-completion protocol really ran (every data collective), or not at all
    n = res[0]["device_completions"]
    assert all(r["device_completions"] == n for r in res)
    assert (n > 30) if completion == "device" else (n == 0)


@pytest.mark.timeout(200)
def test_copy_engine_errors_on_cpu_ranks(pool2) -> None:
    assert pool2.run(ce_error_suite) == ["ok", "ok"]


# ======================================================== CUDA (GPU machine only)
def _cuda_rank_job(rank: int, world: int, store: str, peer_memory: str) -> None:
    ensure_no_multicast()
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=dev
    )
    try:
        nccl = Communicator()
        ce = CopyEngineCommunicator.create(
            name="ce", config=CopyEngineConfig(peer_memory=peer_memory, timeout_s=120)
        )
        hs = HostStagedCommunicator.create(config=HostStagedConfig(chunk_bytes=4 << 20))
        F32 = torch.float32
        cases = [
            ("random", _splits(31, world, 3000), (16,), torch.float32),
            ("random_bf16", _splits(32, world, 5000), (4, 8), torch.bfloat16),
            ("random_i64", _splits(33, world, 20000), (), torch.int64),
            ("empty", [[0, 5], [0, 0]] if world == 2 else _splits(34, world, 0), (8,), F32),
            ("all_empty", [[0] * world for _ in range(world)], (8,), torch.float32),
            # 64 MB per rank: 128 fp32 per row
            ("large_64MB", [[(64 << 20) // 512 // world] * world] * world, (128,), torch.float32),
        ]  # fmt: skip
        for label, S, feat, dtype in cases:
            seed = zlib.crc32(label.encode()) % 1000
            want = _expected_a2a(seed, S, rank, feat, dtype).to(dev)
            out_s = [S[s][rank] for s in range(world)]
            for comm_name, comm in (("nccl", nccl), ("copy_engine", ce), ("host_staged", hs)):
                # produce the input on the current stream right before the call, behind a
                # long kernel: a backend that does not wait for it reads stale data
                x = torch.zeros((sum(S[rank]), *feat), dtype=dtype, device=dev)
                a = torch.randn(4096, 4096, device=dev)
                for _ in range(4):
                    a = a @ a / 64
                x.copy_(_input(seed, rank, sum(S[rank]), feat, dtype).to(dev, non_blocking=True))
                got = comm.all_to_all_v(x, S[rank], out_s, name=label).wait()
                assert torch.equal(got, want), f"{comm_name} {label} rank {rank}"
                if comm is ce:
                    h = ce.all_to_all_v_segments(x, S[rank], out_s, name=label)
                    got = torch.cat(h.wait())
                    h.release()
                    assert torch.equal(got, want), f"copy_engine segments {label} rank {rank}"
        for comm in (nccl, ce, hs):
            x = _input(40, rank, 1000, (16,), torch.float32).to(dev)
            got = comm.all_gather(x, name="ag").wait()
            for r in range(world):
                assert torch.equal(got[r].cpu(), _input(40, r, 1000, (16,), torch.float32))
        assert ce.peer_memory == peer_memory, (ce.peer_memory, ce.peer_memory_note)
        ce.close()
        hs.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer_memory", ["symmetric", "ipc"])
def test_backends_match_reference_on_cuda(tmp_path, peer_memory: str) -> None:
    ensure_no_multicast()  # inherited by the spawned ranks
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = os.path.join(tmp_path, "store")
    mp.spawn(_cuda_rank_job, args=(2, store, peer_memory), nprocs=2, join=True)
