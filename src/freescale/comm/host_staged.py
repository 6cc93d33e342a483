"""Host-staged, SM-free collectives: device -> pinned host -> gloo -> host -> device.

Owns :class:`HostStagedCommunicator` (the :class:`~freescale.comm.base.Communicator`
methods all_gather, all_to_all_v, exchange_counts and barrier; no all_reduce), its
bounded pool of pinned staging buffers (:class:`PinnedBufferPool`) and the one FIFO
worker thread per dedicated gloo process group that issues every transfer (DESIGN.md
2.3). It moves tensors and nothing else: no model state, no other process group.

How one collective runs:

1. Caller thread: validates the arguments, allocates the output on the current device
   and stream, records a "ready" event on the current stream (CUDA) and queues a job.
2. Worker thread (one per group; jobs run strictly in submission order, so every rank
   issues the same sequence of gloo operations): the message is cut into rounds of at
   most ``chunk_bytes`` per peer. For each round, device-to-host copies into pinned
   blocks are issued on a dedicated device-to-host copy stream (after the ready event),
   the round is sent through gloo (point-to-point for all-to-all-v, so each pair of
   ranks agrees on its own chunking; ``allgather`` for all-gather), and host-to-device
   copies of what arrived are issued on a second copy stream (the two directions use
   different copy engines). Staging of round k+1 overlaps the transfer of round k,
   whose host-to-device copies overlap the transfer of round k+1.
3. ``wait()`` (caller thread): blocks until the worker finished the transfers, then
   makes the *current* stream wait on the job's final copy event (no host sync with
   the device) and returns the output.

CPU tensors go straight to gloo without copies (``stage_host_tensors=True`` routes them
through the staging pool anyway, which is how the CPU tests exercise the pipeline).
Pinned memory never exceeds ``max_pinned_bytes``: blocks of one size are allocated on
demand and reused across calls; a block is only reused once the copies that read it
have completed (event). Any failure inside the worker (gloo error, timeout) is raised
at ``wait()`` as a :class:`~freescale.comm.base.CollectiveError` naming the collective
and the ranks; the worker keeps the error and every later submission fails fast with it
(a failed transfer leaves the ranks out of step, so the group cannot be trusted again).
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freescale.comm.base import Awaitable, CollectiveError, Communicator, Done

__all__ = ["HostStagedConfig", "HostStagedCommunicator", "PinnedBufferPool"]

_ALIGN = 64  # bytes; block sizes are multiples of this, so any dtype view is aligned


@dataclass
class HostStagedConfig:
    """Knobs of the host-staged backend.

    * ``chunk_bytes``: most bytes per peer per round (the pipelining granularity).
    * ``max_pinned_bytes``: cap on pinned staging memory; the chunk shrinks if one round
      (2 x world blocks) would not fit.
    * ``prefetch_rounds``: rounds staged ahead of the one being transferred.
    * ``timeout_s``: limit for each gloo operation; a timeout fails the collective.
    * ``stage_host_tensors``: copy CPU tensors through the staging pool too (tests and
      benchmarks); by default CPU tensors are sent as they are.
    """

    chunk_bytes: int = 4 << 20
    max_pinned_bytes: int = 256 << 20
    prefetch_rounds: int = 2
    timeout_s: float = 300.0
    stage_host_tensors: bool = False

    def __post_init__(self) -> None:
        if self.chunk_bytes < _ALIGN:
            raise ValueError(f"chunk_bytes must be >= {_ALIGN}, got {self.chunk_bytes}")
        if self.max_pinned_bytes < 2 * _ALIGN:
            raise ValueError(f"max_pinned_bytes must be >= {2 * _ALIGN}")
        if self.prefetch_rounds < 1:
            raise ValueError("prefetch_rounds must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")


# --------------------------------------------------------------------------- pool
class PinnedBufferPool:
    """At most ``max_bytes // block_bytes`` staging blocks of ``block_bytes`` each,
    allocated on first use (pinned when CUDA is available) and reused.

    Only the worker thread acquires and releases; the counters may be read anywhere.
    """

    def __init__(self, block_bytes: int, max_bytes: int, pin: bool | None = None) -> None:
        if block_bytes <= 0 or block_bytes % _ALIGN:
            raise ValueError(f"block_bytes must be a positive multiple of {_ALIGN}")
        self.block_bytes = int(block_bytes)
        self.max_blocks = int(max_bytes) // self.block_bytes
        if self.max_blocks < 1:
            raise ValueError(f"max_bytes {max_bytes} is below one block of {block_bytes}")
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free: list[torch.Tensor] = []
        self.num_allocated = 0
        self.peak_allocated = 0

    @property
    def bytes_pinned(self) -> int:
        """Bytes currently allocated by the pool (in use or free for reuse)."""
        return self.num_allocated * self.block_bytes

    @property
    def peak_bytes_pinned(self) -> int:
        return self.peak_allocated * self.block_bytes

    def available(self) -> int:
        """Blocks obtainable now without exceeding the cap."""
        return len(self._free) + self.max_blocks - self.num_allocated

    def acquire(self) -> torch.Tensor:
        if self._free:
            return self._free.pop()
        if self.num_allocated >= self.max_blocks:
            raise RuntimeError("pinned buffer pool exhausted (internal error)")
        block = torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=self.pin)
        self.num_allocated += 1
        self.peak_allocated = max(self.peak_allocated, self.num_allocated)
        return block

    def release(self, blocks: Sequence[torch.Tensor]) -> None:
        self._free.extend(blocks)

    def clear(self) -> None:
        """Drop the free blocks (blocks in use are kept by their holders)."""
        self.num_allocated -= len(self._free)
        self._free.clear()


# ------------------------------------------------------------------------- copiers
class _NullEvent:
    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _HostCopier:
    """Synchronous copies on the host; events are trivially complete."""

    streams: tuple[Any, ...] = ()

    def wait_event(self, event: Any) -> None:
        pass

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_d2h(self) -> Any:
        return _NullEvent()

    def record_h2d(self) -> Any:
        return _NullEvent()

    def record_done(self) -> Any:
        return _NullEvent()


class _CudaCopier:
    """Copies of one CUDA device on two dedicated streams, so both copy-engine
    directions run at once: device-to-host (and the rank's own device-to-device
    segment) on one, host-to-device from pinned memory on the other. No kernels."""

    def __init__(self, device: torch.device) -> None:
        from freescale.comm.copy_engine import copy_stream_priority

        self.device = device
        # high-priority pool: not the streams Future callbacks draw and make wait on an
        # all-reduce (CopyEngineConfig.stream_priority)
        prio = copy_stream_priority()
        self.d2h_stream = torch.cuda.Stream(device=device, priority=prio)
        self.h2d_stream = torch.cuda.Stream(device=device, priority=prio)
        self.streams = (self.d2h_stream, self.h2d_stream)

    def wait_event(self, event: Any) -> None:
        for stream in self.streams:
            stream.wait_event(event)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.d2h_stream):
            dst.copy_(src, non_blocking=True)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.h2d_stream):
            dst.copy_(src, non_blocking=True)

    def _record(self, stream: Any) -> Any:
        event = torch.cuda.Event(blocking=True)  # the worker sleeps, not spins, on it
        event.record(stream)
        return event

    def record_d2h(self) -> Any:
        return self._record(self.d2h_stream)

    def record_h2d(self) -> Any:
        return self._record(self.h2d_stream)

    def record_done(self) -> Any:
        """One event after every copy issued so far on both streams."""
        self.h2d_stream.wait_event(self.record_d2h())
        return self.record_h2d()


# ---------------------------------------------------------------------- job plans
_SEND, _RECV = 0, 1


@dataclass(frozen=True)
class _Piece:
    kind: int  # _SEND (read from the input) or _RECV (written to the output)
    peer: int  # group rank
    offset: int  # elements into the flat input (send) or output (recv)
    numel: int


def _cut(offset: int, numel: int, piece: int) -> list[tuple[int, int]]:
    return [(offset + a, min(piece, numel - a)) for a in range(0, numel, piece)]


class _Job:
    """One queued collective. ``wait()`` blocks until it ran and raises its error."""

    def __init__(self, run: Callable[[], Any], describe: str) -> None:
        self.run = run
        self.describe = describe
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.result: Any = None

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise self.error

    def is_completed(self) -> bool:
        return self._done.is_set()


_STOP = object()


def serve_jobs(
    jobs: queue.SimpleQueue[Any],
    error: Callable[[], BaseException | None],
    fail: Callable[[BaseException], None],
    who: str,
    setup: Callable[[], None] | None = None,
    closing: Callable[[], None] | None = None,
) -> None:
    """The FIFO worker loop shared by the threaded communicators: run ``setup`` then each
    queued :class:`_Job` until ``_STOP``. The first job that raises records its error
    (``fail``) and every later job fails with it; a loop that breaks records
    "``who`` worker died". On the way out ``closing`` runs (refuse new jobs), then every
    job still queued fails, so no caller waits forever."""
    try:
        if setup is not None:
            setup()
        while True:
            job = jobs.get()
            if job is _STOP:
                break
            if error() is not None:
                job.finish(error=RuntimeError(f"an earlier collective failed: {error()}"))
                continue
            try:
                result = job.run()
            except BaseException as e:  # kept, re-raised at wait()
                fail(e)
                job.finish(error=e)
            else:
                job.finish(result)
    except BaseException as e:  # the loop itself broke
        if error() is None:
            fail(RuntimeError(f"{who} worker died: {e!r}"))
    finally:
        if closing is not None:
            closing()
        err = error() or RuntimeError("the communicator was closed")
        while True:  # nothing queued is left waiting forever
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                break
            if job is not _STOP:
                job.finish(error=err)


class _GroupWorker:
    """The FIFO worker thread of one gloo group, with its pool and copy streams."""

    def __init__(self, group: dist.ProcessGroup, rank: int, world: int, cfg: HostStagedConfig):
        self.group, self.rank, self.world, self.cfg = group, rank, world, cfg
        per_round = 2 * world  # a2a: <= 2 (W-1) pieces, all-gather: W + 1 pieces
        block = min(cfg.chunk_bytes, cfg.max_pinned_bytes // per_round) // _ALIGN * _ALIGN
        if block < _ALIGN:
            raise ValueError(
                f"max_pinned_bytes={cfg.max_pinned_bytes} cannot hold one round of "
                f"{per_round} blocks at {world} ranks"
            )
        self.pool = PinnedBufferPool(block, cfg.max_pinned_bytes)
        self._host_pool: PinnedBufferPool | None = None  # unpinned, stage_host_tensors
        self.refs = 0
        self.error: BaseException | None = None
        self.seq = 0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._copiers: dict[torch.device, Any] = {}
        self._copiers_lock = threading.Lock()
        # blocks whose host-to-device copies may still run: (event, pool, blocks)
        self._unstaging: deque[tuple[Any, PinnedBufferPool, list[torch.Tensor]]] = deque()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._loop, name=f"freescale-host-staged-{rank}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------- plumbing
    def copier(self, device: torch.device) -> Any:
        if device.type == "cpu":
            return _HostCopier()
        if device.type != "cuda":
            raise ValueError(f"host-staged collectives support cpu and cuda, not {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._copiers_lock:
            if device not in self._copiers:
                self._copiers[device] = _CudaCopier(device)
            return self._copiers[device]

    def pool_for(self, device: torch.device) -> PinnedBufferPool:
        if device.type == "cuda":
            return self.pool
        if self._host_pool is None:  # staged CPU tensors: same geometry, plain memory
            self._host_pool = PinnedBufferPool(
                self.pool.block_bytes, self.cfg.max_pinned_bytes, pin=False
            )
        return self._host_pool

    def submit(self, job: _Job) -> None:
        if self.error is not None:
            raise CollectiveError(
                f"{job.describe} refused: the host-staged worker failed earlier: {self.error}"
            ) from self.error
        if self._stopped:
            raise CollectiveError(f"{job.describe} refused: the communicator is closed")
        self._queue.put(job)

    def stop(self, timeout: float = 30.0) -> None:
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            serve_jobs(
                self._queue, lambda: self.error, self._fail, "host-staged", closing=self._close
            )
        finally:
            self._unstaging.clear()
            self.pool.clear()

    def _fail(self, error: BaseException) -> None:
        self.error = error

    def _close(self) -> None:
        self._stopped = True

    # ---------------------------------------------------------- the pipeline
    def _wait_work(self, work: Any, what: str) -> None:
        if work is None:
            return
        limit = self.cfg.timeout_s
        try:
            ok = work.wait(timeout=timedelta(seconds=limit))
        except Exception as e:
            if "timed out" in str(e).lower():
                raise TimeoutError(f"{what} timed out after {limit} s ({e})") from e
            raise RuntimeError(f"{what}: {e}") from e
        if ok is False:
            raise TimeoutError(f"{what} timed out after {limit} s")

    def _reclaim(self, need: int, pool: PinnedBufferPool) -> None:
        """Return unstaged blocks to their pools: completed ones always, and the
        oldest ones (waiting for their copies) until ``need`` blocks are free."""
        while self._unstaging and (pool.available() < need or self._unstaging[0][0].query()):
            event, owner, blocks = self._unstaging.popleft()
            event.synchronize()
            owner.release(blocks)

    def run_rounds(
        self,
        rounds: list[list[_Piece]],
        transfer: Callable[[list[_Piece], list[torch.Tensor], int], None],
        src: torch.Tensor,
        dst: torch.Tensor,
        staged: bool,
        copier: Any,
        pool: PinnedBufferPool,
    ) -> None:
        """Stage, transfer and unstage ``rounds`` of pieces of the flat ``src``/``dst``;
        ``transfer(pieces, buffers, round)`` moves one round through gloo."""
        inflight: deque[tuple[int, list[torch.Tensor], list[torch.Tensor], Any]] = deque()
        nxt = 0
        for _ in range(len(rounds)):
            while nxt < len(rounds) and len(inflight) < self.cfg.prefetch_rounds:
                need = len(rounds[nxt]) if staged else 0
                self._reclaim(need, pool)
                if pool.available() < need:
                    if not inflight:
                        raise RuntimeError(
                            f"pinned pool of {pool.max_blocks} blocks cannot stage a round "
                            f"of {need} pieces"
                        )
                    break
                bufs: list[torch.Tensor] = []
                blocks: list[torch.Tensor] = []
                for p in rounds[nxt]:
                    if not staged:
                        flat = src if p.kind == _SEND else dst
                        bufs.append(flat[p.offset : p.offset + p.numel])
                        continue
                    block = pool.acquire()
                    blocks.append(block)
                    view = block.view(src.dtype)[: p.numel]
                    if p.kind == _SEND:
                        copier.d2h(view, src[p.offset : p.offset + p.numel])
                    bufs.append(view)
                inflight.append((nxt, bufs, blocks, copier.record_d2h()))
                nxt += 1
            k, bufs, blocks, staged_event = inflight.popleft()
            staged_event.synchronize()  # device-to-host copies of round k are done
            transfer(rounds[k], bufs, k)
            if staged:
                send_blocks, recv_blocks = [], []
                for p, buf, block in zip(rounds[k], bufs, blocks):
                    if p.kind == _RECV:
                        copier.h2d(dst[p.offset : p.offset + p.numel], buf)
                        recv_blocks.append(block)
                    else:
                        send_blocks.append(block)
                pool.release(send_blocks)  # read by gloo and by no pending copy
                self._unstaging.append((copier.record_h2d(), pool, recv_blocks))
        self._reclaim(0, pool)


# ------------------------------------------------------------------ communicator
_REGISTRY: dict[int, _GroupWorker] = {}
_REGISTRY_LOCK = threading.Lock()


class HostStagedCommunicator(Communicator):
    """SM-free all-gather / all-to-all-v through host memory and a dedicated gloo group.

    ``group`` must be a gloo process group used by nothing else (make one with
    :meth:`create`); with ``group=None`` and no initialised process group it is a world
    of one rank. Communicators on the same group share one worker thread and pool.
    Inputs must not be modified before ``wait()`` returns.
    """

    backend_name = "host_staged"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        name: str = "host_staged",
        config: HostStagedConfig | None = None,
    ) -> None:
        super().__init__(group, name)
        self.config = config or HostStagedConfig()
        # takes CUDA and CPU tensors alike; callers that place tensors by ``device``
        # keep them on the GPU, where the copy stream picks them up
        if torch.cuda.is_available():
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._worker: _GroupWorker | None = None
        self._closed = False
        self.ranks: list[int] = [0]
        if not (dist.is_available() and dist.is_initialized()):
            self.backend_name = "host_staged"
            return
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo":
            raise ValueError(
                f"HostStagedCommunicator needs a gloo process group, got {backend!r}; "
                "create one with HostStagedCommunicator.create()"
            )
        self.backend_name = "host_staged"
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        if pg is dist.group.WORLD and dist.get_world_size() > 1:
            warnings.warn(
                "HostStagedCommunicator on the default process group: its worker thread "
                "must be the group's only user, or ranks may issue collectives in "
                "different orders; prefer HostStagedCommunicator.create()",
                stacklevel=2,
            )
        self.ranks = list(dist.get_process_group_ranks(pg))
        if self.world_size == 1:
            return
        with _REGISTRY_LOCK:
            worker = _REGISTRY.get(id(pg))
            if worker is None or worker._stopped:
                worker = _GroupWorker(pg, self.rank, self.world_size, self.config)
                _REGISTRY[id(pg)] = worker
            worker.refs += 1
        self._worker = worker

    @classmethod
    def create(
        cls,
        ranks: Sequence[int] | None = None,
        name: str = "host_staged",
        config: HostStagedConfig | None = None,
    ) -> HostStagedCommunicator:
        """Create a dedicated gloo group (``dist.new_group(backend="gloo")``) and a
        communicator on it. Collective over the default group: every rank calls it, and
        all ranks must create their groups in the same order."""
        cfg = config or HostStagedConfig()
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, name, cfg)
        group = dist.new_group(
            ranks=list(ranks) if ranks is not None else None,
            backend="gloo",
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"rank {dist.get_rank()} is not in the group ranks {ranks}")
        return cls(group, name, cfg)

    # ------------------------------------------------------------- helpers
    def _describe(self, op: str, name: str) -> str:
        return (
            f"{op} '{name}' on rank {self.rank} of {self.world_size} "
            f"(host_staged over gloo, group ranks {self.ranks})"
        )

    def _live_worker(self, op: str, name: str) -> _GroupWorker:
        if self._closed or self._worker is None:
            raise CollectiveError(f"{self._describe(op, name)} refused: the communicator is closed")
        return self._worker

    @property
    def bytes_pinned(self) -> int:
        """Pinned staging memory currently held (never above ``max_pinned_bytes``)."""
        return self._worker.pool.bytes_pinned if self._worker is not None else 0

    @property
    def peak_bytes_pinned(self) -> int:
        return self._worker.pool.peak_bytes_pinned if self._worker is not None else 0

    @property
    def chunk_bytes(self) -> int:
        """The effective chunk (pinned block) size, after fitting the pinned cap."""
        return self._worker.pool.block_bytes if self._worker is not None else 0

    def memory_stats(self) -> dict[str, int]:
        return {
            "bytes_pinned": self.bytes_pinned,
            "peak_bytes_pinned": self.peak_bytes_pinned,
            "max_pinned_bytes": int(self.config.max_pinned_bytes),
            "chunk_bytes": self.chunk_bytes,
        }

    def _launch(
        self,
        op: str,
        name: str,
        src: torch.Tensor,
        dst: torch.Tensor,
        plan: list[list[_Piece]],
        self_copy: tuple[int, int, int] | None,
        transfer_factory: Callable[[int], Callable[[list[_Piece], list[torch.Tensor], int], None]],
        result: Callable[[], Any],
    ) -> Awaitable[Any]:
        """Queue a job moving the flat ``src`` into the flat ``dst`` by ``plan``
        (``self_copy = (dst offset, src offset, numel)`` is copied locally)."""
        worker = self._live_worker(op, name)
        describe = self._describe(op, name)
        device = src.device
        copier = worker.copier(device)
        staged = device.type == "cuda" or self.config.stage_host_tensors
        pool = worker.pool_for(device)
        ready = None
        if device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            for stream in copier.streams:  # the allocator must not reuse them early
                src.record_stream(stream)
                dst.record_stream(stream)
        done_box: list[Any] = [None]

        def run() -> None:
            if ready is not None:
                copier.wait_event(ready)
            if self_copy is not None and self_copy[2] > 0:
                d, s, n = self_copy
                copier.d2h(dst[d : d + n], src[s : s + n])  # own segment, on-device
            seq = worker.seq
            worker.seq += 1
            worker.run_rounds(plan, transfer_factory(seq), src, dst, staged, copier, pool)
            done_box[0] = copier.record_done()

        job = _Job(run, describe)
        worker.submit(job)

        def finish() -> Any:
            event = done_box[0]
            if device.type == "cuda" and event is not None:
                torch.cuda.current_stream(device).wait_event(event)
            return result()

        return Awaitable([job], finish, name, describe, "host_staged")

    def _p2p_transfer(
        self, seq: int, op: str, name: str
    ) -> Callable[[list[_Piece], list[torch.Tensor], int], None]:
        worker = self._worker
        assert worker is not None
        group = worker.group
        fault = self._fault

        def transfer(pieces: list[_Piece], bufs: list[torch.Tensor], k: int) -> None:
            if fault is not None:
                fault(op, name, k)
            tag = (seq * 4096 + k) % (1 << 30)
            works = []
            for p, buf in zip(pieces, bufs):  # receives first, then sends
                if p.kind == _RECV:
                    works.append((p, dist.irecv(buf, group=group, group_src=p.peer, tag=tag)))
            for p, buf in zip(pieces, bufs):
                if p.kind == _SEND:
                    works.append((p, dist.isend(buf, group=group, group_dst=p.peer, tag=tag)))
            for p, w in works:
                verb = "receive from" if p.kind == _RECV else "send to"
                worker._wait_work(w, f"round {k}: {verb} group rank {p.peer}")

        return transfer

    # Testing hook: called as fault(op, name, round) in the worker before each round.
    _fault: Callable[[str, str, int], None] | None = None

    # ---------------------------------------------------------- collectives
    def all_gather(self, tensor: torch.Tensor, name: str = "") -> Awaitable[list[torch.Tensor]]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), by rank."""
        if self.world_size == 1:
            return Done([tensor])
        worker = self._live_worker("all_gather", name)
        src = tensor.contiguous().reshape(-1)
        n = src.numel()
        out = src.new_empty((self.world_size, n))
        dst = out.reshape(-1)
        self._count("all_gather", name, n * src.element_size())
        t0 = time.perf_counter()
        piece = worker.pool.block_bytes // src.element_size()
        plan = [
            [_Piece(_SEND, self.rank, a, m)]
            + [_Piece(_RECV, r, r * n + a, m) for r in range(self.world_size)]
            for a, m in _cut(0, n, piece)
        ]
        group = worker.group
        fault = self._fault
        timeout_wait = worker._wait_work

        def factory(seq: int) -> Callable[[list[_Piece], list[torch.Tensor], int], None]:
            def transfer(pieces: list[_Piece], bufs: list[torch.Tensor], k: int) -> None:
                if fault is not None:
                    fault("all_gather", name, k)
                work = dist.all_gather(list(bufs[1:]), bufs[0], group=group, async_op=True)
                timeout_wait(work, f"round {k}: allgather")

            return transfer

        shape = tensor.shape
        aw = self._launch(
            "all_gather",
            name,
            src,
            dst,
            plan,
            None,
            factory,
            lambda: [out[r].view(shape) for r in range(self.world_size)],
        )
        self.stats.seconds_issuing += time.perf_counter() - t0
        return aw

    def all_to_all_v(
        self,
        tensor: torch.Tensor,
        input_splits: Sequence[int],
        output_splits: Sequence[int],
        name: str = "",
    ) -> Awaitable[torch.Tensor]:
        """Variable-split all-to-all along dim 0. ``input_splits[d]`` rows go to rank d;
        ``output_splits[s]`` rows arrive from rank s, concatenated by source rank."""
        input_splits, output_splits = self._check_splits(tensor, input_splits, output_splits, name)
        if self.world_size == 1:
            return Done(tensor)
        worker = self._live_worker("all_to_all", name)
        src_t = tensor.contiguous()
        row = math.prod(src_t.shape[1:])  # elements per row
        out = src_t.new_empty((sum(output_splits), *src_t.shape[1:]))
        src, dst = src_t.reshape(-1), out.reshape(-1)
        esize = src_t.element_size()
        self._count("all_to_all", name, (sum(input_splits) - input_splits[self.rank]) * row * esize)
        t0 = time.perf_counter()
        piece = worker.pool.block_bytes // esize
        in_off = [0]
        for s in input_splits:
            in_off.append(in_off[-1] + s * row)
        out_off = [0]
        for s in output_splits:
            out_off.append(out_off[-1] + s * row)
        # pieces per peer; each pair of ranks cuts its segment identically
        per_peer: list[list[_Piece]] = []
        for p in range(self.world_size):
            if p == self.rank:
                continue
            sends = _cut(in_off[p], input_splits[p] * row, piece)
            recvs = _cut(out_off[p], output_splits[p] * row, piece)
            per_peer.append([_Piece(_SEND, p, a, m) for a, m in sends])
            per_peer.append([_Piece(_RECV, p, a, m) for a, m in recvs])
        n_rounds = max((len(x) for x in per_peer), default=0)
        plan = [[x[k] for x in per_peer if k < len(x)] for k in range(n_rounds)]
        me = self.rank
        self_copy = (out_off[me], in_off[me], input_splits[me] * row)
        aw = self._launch(
            "all_to_all",
            name,
            src,
            dst,
            plan,
            self_copy,
            lambda seq: self._p2p_transfer(seq, "all_to_all", name),
            lambda: out,
        )
        self.stats.seconds_issuing += time.perf_counter() - t0
        return aw

    def exchange_counts(self, counts: torch.Tensor, name: str = "counts") -> torch.Tensor:
        """Blocking all-to-all of a ``[W, ...]`` integer count matrix (row d goes to rank
        d; the result's row s came from rank s), on the counts' own device: host counts
        go straight to gloo."""
        if self.world_size == 1:
            return counts.clone()
        flat = counts.reshape(self.world_size, -1)
        per = flat.shape[1]
        out = self.all_to_all_v(
            flat.reshape(-1), [per] * self.world_size, [per] * self.world_size, name
        ).wait()
        return out.reshape(counts.shape)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = ""
    ) -> Awaitable[torch.Tensor]:
        raise NotImplementedError(
            f"{self._describe('all_reduce', name)}: the host-staged backend carries no "
            "reductions; reductions stay on NCCL/gloo (use a plain Communicator)"
        )

    def barrier(self, name: str = "barrier") -> None:
        """Blocks until every rank reached the barrier *and* every collective queued
        before it on this group was issued (the barrier runs in the FIFO worker)."""
        if self.world_size == 1:
            return
        worker = self._live_worker("barrier", name)
        group = worker.group

        def run() -> None:
            worker._wait_work(dist.barrier(group=group, async_op=True), "barrier")

        job = _Job(run, self._describe("barrier", name))
        worker.submit(job)
        Awaitable([job], lambda: None, name, job.describe, "host_staged").wait()

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the worker once every communicator on its group closed (queued work
        finishes first). Idempotent."""
        if self._closed:
            return
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is None:
            return
        with _REGISTRY_LOCK:
            worker.refs -= 1
            last = worker.refs <= 0
            if last and _REGISTRY.get(id(worker.group)) is worker:
                del _REGISTRY[id(worker.group)]
        if last:
            worker.stop()

    def __enter__(self) -> HostStagedCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
