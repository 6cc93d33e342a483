"""Copy-engine, SM-free collectives inside one node, and the automatic backend choice.

Owns :class:`CopyEngineCommunicator` (the :class:`~freescale.comm.base.Communicator`
methods all_gather, all_to_all_v, exchange_counts and barrier, plus the zero-copy
variants ``all_to_all_v_segments`` / ``all_gather(views=True)``; no all_reduce), its
receive buffers in peer-mapped memory, the small compatibility layer over PyTorch's
private symmetric-memory API (:func:`symm_empty`, :func:`symm_rendezvous`,
:func:`symm_get_buffer`), the pure planning helpers (:func:`receive_offsets`,
:func:`plan_all_to_all`, :func:`plan_all_gather`, :func:`grow_capacity`) and the
automatic backend choice (:class:`SMFreeConfig`, :func:`select_backend`,
:func:`create_communicator`). It moves tensors and nothing else: no model state, no
other process group than the dedicated gloo group it is given (DESIGN.md 2.3).

How one all-to-all-v runs (every rank, same order):

1. Caller thread: validates, allocates the output on the current stream, records a
   "ready" event on the current stream and queues a job for this communicator's FIFO
   worker thread (one per communicator, which alone uses its gloo group).
2. Worker: waits (host, with a timeout) until its receive buffer is free again: the
   previous copy-out from it finished, or the caller released the views it handed out.
3. Worker: all-gathers a small int64 header (the handshake channel: a shared-memory
   exchange among the host's ranks by default, else gloo; ``CopyEngineConfig.handshake``,
   :mod:`freescale.comm.shm_exchange`): op, sequence number, dtype,
   row bytes, input and output splits. Every rank then knows the full split matrix
   ``S[src][dst]`` and checks it globally (so a mismatch fails on *every* rank with the
   same message). This exchange doubles as the barrier "every receive buffer is free".
4. Worker: grows the receive buffers if a rank needs more (all ranks decide alike from
   ``S``; geometric growth, reused across calls, capped by ``max_buffer_bytes``).
5. Worker: on a side CUDA stream (after the ready event), copies its segment for peer
   ``p`` straight into ``p``'s receive buffer at the offset ``p`` expects — the
   exclusive prefix over source ranks of what ``p`` receives, which is exactly ``p``'s
   output layout. A contiguous same-dtype ``copy_`` whose destination lives on another
   GPU is a cudaMemcpy over NVLink: it runs on the copy engines, on no SM.
6. Worker: waits (host) for its copies, then an all-reduce of an error flag (same
   channel): after
   it, every rank's data has landed in every receive buffer (and a rank whose copies
   failed makes every rank raise instead of hang).
7. Contiguous output (``all_to_all_v``): the received bytes are copied from the receive
   buffer into the output and the rank's own segment from the input, on the side
   stream. NOTE: CUDA runs a memcpy whose source and destination are on the *same* GPU
   with a kernel (on SMs) unless the CUDA 13.1+ batch-copy flag asks otherwise; these
   two local copies are short (HBM speed) but not SM-free. ``all_to_all_v_segments``
   avoids both: it returns per-source views (own segment = a view of the input, peers'
   segments = views into the receive buffer), valid until the buffer is reused — see
   :meth:`CopyEngineCommunicator.all_to_all_v_segments`.
8. ``wait()`` blocks until the worker finished issuing, then makes the *current* stream
   wait on the job's final event (no host synchronisation with the device).

Completion (``CopyEngineConfig.completion``; ``auto`` = ``device`` unless
FREESCALE_COPY_ENGINE_COMPLETION says otherwise). With ``host`` the worker waits on the
host in steps 2 and 6: for its buffer's release and for its copies into the peers — so
for the GPU to have run the producer of ``src`` and the transfer. A caller's ``wait()``
then blocks until then: a host-device synchronisation on the critical path when the
producer was queued recently (the prioritized forward waits for the exclusive rows sent
in the previous backward). With ``device`` both waits move to the copy streams through
CUDA inter-process events, one ``free`` and one ``sent`` event per rank and receive
buffer, opened by every peer once (:class:`_PeerSignals`): step 2 records ``free`` after
the copy streams wait for the release; step 5 makes the copy streams wait for every
peer's ``free`` before pushing and records ``sent`` after the pushes; step 6 keeps the
all-reduce (errors, and it orders every ``sent`` record before the peers' waits) but no
host wait; step 7 waits for every peer's ``sent`` on the copy streams. The worker then
never waits for the GPU (except when a buffer grows), and ``wait()`` only for the peers'
workers.

Peer memory (``CopyEngineConfig.peer_memory``): ``symmetric`` = PyTorch symmetric memory
(CUDA backend; multicast must stay off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1 is enforced),
``ipc`` = CUDA IPC handles through torch.multiprocessing's reductions (peer buffers then
show up on the peer's device index), ``host_shm`` = CPU tensors in /dev/shm files (the
same protocol on CPU: what the CPU tests exercise). ``auto`` picks ``symmetric`` on CUDA
(falling back to ``ipc`` on every rank if any rank fails) and ``host_shm`` on CPU.

Errors: any failure in the worker (gloo error or timeout, a copy that did not complete
within ``timeout_s``, inconsistent splits) is raised at ``wait()`` as a
:class:`~freescale.comm.base.CollectiveError` naming the collective and the ranks; the
worker keeps it and refuses every later submission (the ranks may be out of step).
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import threading
import time
import uuid
import warnings
import weakref
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from freescale.comm.base import Awaitable, CollectiveError, Communicator, Done
from freescale.comm.host_staged import (
    _STOP,
    HostStagedCommunicator,
    HostStagedConfig,
    _Job,
    serve_jobs,
)
from freescale.comm.shm_exchange import ShmExchange, ShmUnavailable
from freescale.comm.shm_exchange import available as shm_available

__all__ = [
    "CopyEngineConfig",
    "CopyEngineCommunicator",
    "SegmentsAwaitable",
    "CopyPlan",
    "SMFreeConfig",
    "TRAFFIC_CLASSES",
    "receive_offsets",
    "plan_all_to_all",
    "plan_all_gather",
    "grow_capacity",
    "select_backend",
    "detect_topology",
    "create_communicator",
    "symm_available",
    "symm_empty",
    "symm_rendezvous",
    "symm_get_buffer",
    "ensure_no_multicast",
]

_MiB = 1 << 20


# ============================================================ multicast safety
_NO_MULTICAST_ENV = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def ensure_no_multicast() -> dict[str, str]:
    """Set the variables that keep NVLink multicast off (PyTorch symmetric memory, NCCL,
    NVSHMEM) unless already set, and refuse to run if one is set to enable it.

    Multicast objects can put a shared host's GPUs out of service; nothing in FreeScale
    needs them. Must run before the first symmetric-memory allocation or NCCL
    communicator of the process (the libraries read the variables once)."""
    for key, safe in _NO_MULTICAST_ENV.items():
        val = os.environ.setdefault(key, safe)
        if val != safe:
            raise RuntimeError(
                f"{key}={val!r} would allow NVLink multicast; FreeScale requires {key}={safe}"
            )
    return {k: os.environ[k] for k in _NO_MULTICAST_ENV}


# ============================================ symmetric memory compatibility layer
def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return (99, 0)


def _symm_module() -> Any:
    import torch.distributed._symmetric_memory as sm

    return sm


def symm_available() -> tuple[bool, str]:
    """Whether this torch exposes the symmetric-memory calls we use, and why not."""
    try:
        sm = _symm_module()
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        return False, f"torch.distributed._symmetric_memory does not import: {e!r}"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(sm, n)]
    if missing:
        return False, f"torch {torch.__version__} lacks _symmetric_memory.{missing}"
    if not torch.cuda.is_available():
        return False, "symmetric memory needs CUDA"
    return True, ""


def symm_backend(device: torch.device) -> str | None:
    """The symmetric-memory allocation backend in use for ``device`` (None if unknown)."""
    sm = _symm_module()
    get = getattr(sm, "get_backend", None)
    if get is None:
        return None
    try:
        return get(device)
    except Exception:  # noqa: BLE001
        return None


def symm_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty`` in symmetric memory (torch 2.11 and 2.13: ``empty(size, dtype=,
    device=)``). Allocation is local; :func:`symm_rendezvous` makes it peer-visible."""
    ensure_no_multicast()
    sm = _symm_module()
    return sm.empty(tuple(int(s) for s in shape), dtype=dtype, device=device)


def symm_rendezvous(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> Any:
    """Collective over ``group``: exchange the handles of ``tensor`` (allocated by
    :func:`symm_empty`, same shape on every rank). Returns the symmetric-memory handle.

    torch < 2.11 needs ``enable_symm_mem_for_group`` first; 2.11 deprecated it (the
    group's own store is used) and calling it there adds a store prefix, so it is only
    called on older versions. The group is passed by name (both versions accept it)."""
    ensure_no_multicast()
    sm = _symm_module()
    pg = group if group is not None else dist.group.WORLD
    name = pg.group_name  # type: ignore[union-attr]
    if _torch_version() < (2, 11) and hasattr(sm, "enable_symm_mem_for_group"):
        enabled = getattr(sm, "is_symm_mem_enabled_for_group", lambda n: False)(name)
        if not enabled:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                sm.enable_symm_mem_for_group(name)
    handle = sm.rendezvous(tensor, name)
    if handle is None:
        raise RuntimeError("symmetric-memory rendezvous returned no handle")
    return handle


def symm_get_buffer(
    handle: Any, rank: int, shape: Sequence[int], dtype: torch.dtype, offset: int = 0
) -> torch.Tensor:
    """Rank ``rank``'s buffer as a tensor of ``shape``/``dtype`` starting ``offset``
    elements (of ``dtype``) in; addressable from this GPU (same signature in 2.11 and
    2.13: ``get_buffer(rank, sizes, dtype, storage_offset)``)."""
    return handle.get_buffer(int(rank), tuple(int(s) for s in shape), dtype, int(offset))


# ================================================================ pure planning
def receive_offsets(splits: Sequence[Sequence[int]], dst: int) -> list[int]:
    """Row offsets of each source rank's segment in ``dst``'s receive buffer (and
    output): the exclusive prefix over sources of ``splits[s][dst]``; ``W + 1`` entries,
    the last one is the number of rows ``dst`` receives."""
    out = [0]
    for row in splits:
        n = int(row[dst])
        if n < 0:
            raise ValueError(f"negative split {n}")
        out.append(out[-1] + n)
    return out


@dataclass(frozen=True)
class CopyPlan:
    """Byte-level plan of one collective for one rank.

    * ``pushes``: ``(peer, src_offset, dst_offset, nbytes)``: copy input bytes
      ``[src_offset, +nbytes)`` into ``peer``'s receive buffer at ``dst_offset``;
    * ``self_copy``: ``(out_offset, src_offset, nbytes)`` for the rank's own segment;
    * ``segments``: ``(offset, nbytes)`` of every source's data in this rank's receive
      buffer / output (the own entry is where the own segment goes in the output);
    * ``recv_bytes``: this rank's output size; ``need_bytes``: the largest output over
      all ranks (every rank's receive buffer must hold it: the buffers are symmetric).
    """

    pushes: tuple[tuple[int, int, int, int], ...]
    self_copy: tuple[int, int, int]
    segments: tuple[tuple[int, int], ...]
    recv_bytes: int
    need_bytes: int

    def copy_out_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Receive-buffer byte ranges to copy into the output (everything but the own
        segment), merged into at most two contiguous ranges."""
        own_off, own_n = self.segments[rank]
        out = []
        if own_off > 0:
            out.append((0, own_off))
        if self.recv_bytes > own_off + own_n:
            out.append((own_off + own_n, self.recv_bytes - own_off - own_n))
        return out


def plan_all_to_all(splits: Sequence[Sequence[int]], rank: int, row_bytes: int) -> CopyPlan:
    """Plan for rank ``rank`` of an all-to-all-v with ``splits[src][dst]`` rows of
    ``row_bytes`` bytes each (the full matrix, known to every rank after the header
    exchange)."""
    world = len(splits)
    if any(len(r) != world for r in splits):
        raise ValueError("splits must be a square W x W matrix")
    if row_bytes < 0:
        raise ValueError("row_bytes must be >= 0")
    in_off = [0]
    for n in splits[rank]:
        in_off.append(in_off[-1] + int(n))
    pushes = []
    for p in range(world):
        n = int(splits[rank][p])
        if p == rank or n == 0:
            continue
        dst_rows = receive_offsets(splits, p)[rank]
        pushes.append((p, in_off[p] * row_bytes, dst_rows * row_bytes, n * row_bytes))
    mine = receive_offsets(splits, rank)
    segments = tuple(
        (mine[s] * row_bytes, (mine[s + 1] - mine[s]) * row_bytes) for s in range(world)
    )
    need = max(receive_offsets(splits, d)[-1] for d in range(world)) * row_bytes
    own = int(splits[rank][rank]) * row_bytes
    return CopyPlan(
        pushes=tuple(pushes),
        self_copy=(mine[rank] * row_bytes, in_off[rank] * row_bytes, own),
        segments=segments,
        recv_bytes=mine[-1] * row_bytes,
        need_bytes=need,
    )


def plan_all_gather(world: int, rank: int, nbytes: int) -> CopyPlan:
    """Plan for rank ``rank`` of an all-gather of ``nbytes`` bytes per rank: slot ``r``
    of every receive buffer holds rank ``r``'s tensor."""
    if world < 1 or not 0 <= rank < world or nbytes < 0:
        raise ValueError(f"bad all-gather plan arguments world={world} rank={rank} n={nbytes}")
    pushes = tuple((p, 0, rank * nbytes, nbytes) for p in range(world) if p != rank and nbytes)
    return CopyPlan(
        pushes=pushes,
        self_copy=(rank * nbytes, 0, nbytes),
        segments=tuple((r * nbytes, nbytes) for r in range(world)),
        recv_bytes=world * nbytes,
        need_bytes=world * nbytes,
    )


def grow_capacity(
    current: int,
    need: int,
    *,
    factor: float = 2.0,
    minimum: int = 0,
    align: int = 2 * _MiB,
    maximum: int | None = None,
) -> int:
    """Receive-buffer size after a request of ``need`` bytes: unchanged if it fits,
    else ``max(need, factor * current, minimum)`` rounded up to ``align`` and capped at
    ``maximum`` (a request above ``maximum`` raises). Deterministic, so every rank
    computes the same size from the same ``need``."""
    if need < 0 or current < 0:
        raise ValueError("sizes must be >= 0")
    if need <= current:
        return current
    new = max(need, int(math.ceil(current * factor)), minimum)
    new = -(-new // align) * align
    if maximum is not None and new > maximum:
        if need > maximum:
            raise ValueError(
                f"a receive buffer of {need} bytes is needed but max_buffer_bytes is {maximum}"
            )
        new = max(need, (maximum // align) * align)
    return new


def _split_range(nbytes: int, parts: int, align: int = 64 * 1024) -> list[tuple[int, int]]:
    """Split ``[0, nbytes)`` into at most ``parts`` contiguous (offset, size) pieces."""
    if parts <= 1 or nbytes <= align:
        return [(0, nbytes)] if nbytes else []
    per = -(-nbytes // parts)
    step = -(-per // align) * align
    return [(a, min(step, nbytes - a)) for a in range(0, nbytes, step)]


# ==================================================================== config
_PEER_MEMORY = ("auto", "symmetric", "ipc", "host_shm")
_COMPLETION = ("auto", "host", "device")
COMPLETION_ENV = "FREESCALE_COPY_ENGINE_COMPLETION"
HANDSHAKE_ENV = "FREESCALE_COPY_ENGINE_HANDSHAKE"
STREAM_PRIORITY_ENV = "FREESCALE_COPY_STREAM_PRIORITY"


@dataclass
class CopyEngineConfig:
    """Knobs of the copy-engine backend.

    * ``peer_memory``: ``auto`` | ``symmetric`` | ``ipc`` | ``host_shm`` (module doc).
    * ``num_recv_buffers``: receive buffers used round-robin (a buffer is reused only
      once its previous contents were copied out or released; 2 lets call k+1 land
      while call k's views are still read).
    * ``initial_buffer_bytes`` / ``growth_factor`` / ``max_buffer_bytes``: geometric
      growth of each receive buffer (all ranks grow together; memory per rank is at most
      ``num_recv_buffers * max_buffer_bytes``).
    * ``copy_streams``: side streams the peer copies are spread over (each copy is cut
      into that many pieces; more streams may engage more copy engines).
    * ``timeout_s``: limit for each gloo operation and each host wait on a copy.
    * ``completion``: how a collective's copies are ordered with the peers' (module doc,
      "Completion"): ``host`` = the worker waits on the host for its copies into the
      peers before the completion all-reduce (and for a receive buffer to be free before
      the header exchange); ``device`` = those waits are device-side, through CUDA
      inter-process events, so neither the worker nor ``wait()`` ever waits for the GPU;
      ``auto`` = the ``FREESCALE_COPY_ENGINE_COMPLETION`` variable if set, else ``device``
      (bitwise equal to host completion and faster on 2 H200: BENCHMARKS.md, "SM-free
      completion"). On CPU both run the same protocol (the copies are synchronous there).
    * ``handshake``: how the per-collective header all-gather and error-flag all-reduce
      (steps 3 and 6) travel: ``gloo`` = two gloo collectives on the dedicated group;
      ``shm`` = :class:`~freescale.comm.shm_exchange.ShmExchange` (one shared-memory file
      for the ranks of the host: 0.85 of a 1.06 ms call was the two gloo handshakes on
      the dev box); ``auto`` = ``shm`` where the protocol is available (x86-64), else
      ``gloo``, and ``gloo`` if setting it up fails on any rank (said in
      :attr:`CopyEngineCommunicator.handshake_note`).
    * ``stream_priority``: CUDA priority of the copy streams (:func:`copy_stream_priority`:
      ``FREESCALE_COPY_STREAM_PRIORITY`` overrides). Negative (the default, -1) takes them
      from torch's high-priority stream pool. NCCL process groups and PyTorch's own Future
      callbacks draw *low*-priority pool streams round robin (32 per device), and a
      callback (DDP comm hooks' ``then``) makes its drawn stream wait on the all-reduce; a copy
      stream that holds device-side waits on the peers must not be that stream, or this
      rank's all-reduce ends up in a cross-rank wait chain (suspected in the session-14
      hang, BENCHMARKS.md e2e). The copies run on copy engines, so priority changes no
      SM scheduling. 0 = the shared low-priority pool (the behaviour before).
    """

    peer_memory: str = "auto"
    num_recv_buffers: int = 2
    initial_buffer_bytes: int = 8 * _MiB
    growth_factor: float = 1.5
    max_buffer_bytes: int = 8 << 30
    copy_streams: int = 1
    timeout_s: float = 300.0
    completion: str = "auto"
    handshake: str = "auto"
    stream_priority: int = -1

    def __post_init__(self) -> None:
        if self.handshake not in ("auto", "shm", "gloo"):
            raise ValueError(f"handshake must be auto, shm or gloo, got {self.handshake!r}")
        if self.completion not in _COMPLETION:
            raise ValueError(f"completion must be one of {_COMPLETION}, got {self.completion!r}")
        if self.peer_memory not in _PEER_MEMORY:
            raise ValueError(f"peer_memory must be one of {_PEER_MEMORY}, got {self.peer_memory!r}")
        if self.num_recv_buffers < 1:
            raise ValueError("num_recv_buffers must be >= 1")
        if self.initial_buffer_bytes < 0:
            raise ValueError("initial_buffer_bytes must be >= 0")
        if self.growth_factor < 1.0:
            raise ValueError("growth_factor must be >= 1")
        if self.max_buffer_bytes < max(self.initial_buffer_bytes, 1):
            raise ValueError("max_buffer_bytes must be >= initial_buffer_bytes and > 0")
        if self.copy_streams < 1:
            raise ValueError("copy_streams must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")

    def resolved_handshake(self) -> str:
        """``shm``, ``gloo`` or ``auto`` (= shm where available, else gloo): the config,
        unless it says ``auto`` and ``FREESCALE_COPY_ENGINE_HANDSHAKE`` is set."""
        if self.handshake != "auto":
            return self.handshake
        env = os.environ.get(HANDSHAKE_ENV, "").strip().lower()
        if env in ("", "auto"):
            return "auto"
        if env in ("shm", "gloo"):
            return env
        raise ValueError(f"{HANDSHAKE_ENV}={env!r}: use shm, gloo or auto")

    def resolved_stream_priority(self) -> int:
        """The copy streams' priority: ``stream_priority`` unless
        ``FREESCALE_COPY_STREAM_PRIORITY`` is set."""
        return copy_stream_priority(self.stream_priority)

    def resolved_completion(self) -> str:
        """``host`` or ``device`` (``auto`` resolved through the environment)."""
        if self.completion != "auto":
            return self.completion
        env = os.environ.get(COMPLETION_ENV, "").strip().lower()
        if env == "host":
            return "host"
        if env in ("", "auto", "device"):
            return "device"
        raise ValueError(f"{COMPLETION_ENV}={env!r}: use host, device or auto")


def copy_stream_priority(default: int = -1) -> int:
    """CUDA priority for streams that carry SM-free copies: ``FREESCALE_COPY_STREAM_PRIORITY``
    if set (an integer), else ``default`` (see :class:`CopyEngineConfig`)."""
    env = os.environ.get(STREAM_PRIORITY_ENV, "").strip()
    if not env:
        return int(default)
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"{STREAM_PRIORITY_ENV}={env!r}: use an integer (-1 or 0)") from None


# ============================================================ peer memory kinds
class _PeerMemory:
    """One receive buffer per rank, mapped into every rank (collective to connect)."""

    kind = "?"

    def __init__(self, device: torch.device, group: dist.ProcessGroup, rank: int, world: int):
        self.device, self.group, self.rank, self.world = device, group, rank, world

    def alloc(self, nbytes: int) -> Any:  # local, may fail on one rank only
        raise NotImplementedError

    def connect(self, local: Any, nbytes: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Collective: (local uint8 buffer, uint8 views of every rank's buffer)."""
        raise NotImplementedError

    def discard(self, local: Any) -> None:
        """Drop a buffer allocated by :meth:`alloc` that will not be connected."""


class _SymmetricPeers(_PeerMemory):
    kind = "symmetric"

    def alloc(self, nbytes: int) -> torch.Tensor:
        return symm_empty((nbytes,), torch.uint8, self.device)

    def connect(self, local: torch.Tensor, nbytes: int):
        handle = symm_rendezvous(local, self.group)
        peers = [
            local if r == self.rank else symm_get_buffer(handle, r, (nbytes,), torch.uint8, 0)
            for r in range(self.world)
        ]
        self.handle = handle  # keep the mapping alive as long as the views
        return local, peers


class _IpcPeers(_PeerMemory):
    kind = "ipc"

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def connect(self, local: torch.Tensor, nbytes: int):
        from torch.multiprocessing.reductions import reduce_tensor

        fn, args = reduce_tensor(local)
        objs: list[Any] = [None] * self.world
        dist.all_gather_object(objs, (fn, args), group=self.group)
        peers = []
        for r in range(self.world):
            if r == self.rank:
                peers.append(local)
                continue
            rebuild, rargs = objs[r]
            t = rebuild(*rargs)
            if t.numel() != nbytes:
                raise RuntimeError(f"IPC buffer of rank {r} has {t.numel()} bytes, not {nbytes}")
            peers.append(t)
        return local, peers


class _HostShmPeers(_PeerMemory):
    """CPU emulation: every buffer is a file in /dev/shm mapped by every rank."""

    kind = "host_shm"

    def __init__(self, *args: Any, token: str = "") -> None:
        super().__init__(*args)
        self.token = token or uuid.uuid4().hex[:12]
        self.gen = 0
        shm = "/dev/shm"
        self.root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()

    def alloc(self, nbytes: int) -> tuple[str, torch.Tensor]:
        self.gen += 1
        path = os.path.join(
            self.root, f"freescale-ce-{os.getpid()}-{self.token}-{self.rank}-{self.gen}"
        )
        t = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)[:nbytes]
        return path, t

    def connect(self, local: tuple[str, torch.Tensor], nbytes: int):
        path, t = local
        try:
            paths: list[Any] = [None] * self.world
            dist.all_gather_object(paths, path, group=self.group)
            peers = [
                t
                if r == self.rank
                else torch.from_file(paths[r], shared=True, size=max(nbytes, 1), dtype=torch.uint8)[
                    :nbytes
                ]
                for r in range(self.world)
            ]
            dist.barrier(group=self.group)  # everybody mapped every file: unlink them
        finally:
            self.discard(local)
        return t, peers

    def discard(self, local: Any) -> None:
        try:
            os.unlink(local[0])
        except (OSError, TypeError, IndexError):
            pass


# ================================================================= copiers
_TRACE_JOBS = 6  # jobs per communicator kept for stall_report()
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()  # open copy-engine communicators


def _event_state(ev: Any) -> str:
    """'done' / 'PENDING' for an event (a list: one per peer), without waiting."""
    if ev is None:
        return "-"
    if isinstance(ev, (list, tuple)):
        return "[" + ", ".join(_event_state(e) for e in ev) + "]"
    try:
        return "done" if ev.query() else "PENDING"
    except Exception as e:  # noqa: BLE001 - a report, never a failure
        return f"error ({type(e).__name__})"


def stall_reports() -> list[str]:
    """One report per open copy-engine communicator of this process
    (:meth:`CopyEngineCommunicator.stall_report`); for hang diagnosis
    (``TrainConfig.stall_dump_s``)."""
    return [c.stall_report() for c in list(_LIVE)]


class _NullEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _HostCopier:
    """Synchronous copies (CPU tensors); events are complete when recorded."""

    n = 1

    def wait_event(self, event: Any) -> None:
        pass

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int = 0) -> None:
        dst.copy_(src)

    def record(self, stream: int = 0) -> Any:
        return _NullEvent()

    def record_event(self, event: Any, stream: int = 0) -> None:
        pass

    def record_stream(self, t: torch.Tensor) -> None:
        pass

    def join(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _CudaCopier:
    """Copies on dedicated side streams of one device. A ``copy_`` between contiguous
    same-dtype tensors is one cudaMemcpyAsync; when the destination is on a peer GPU it
    runs on a copy engine (no kernel, no SM)."""

    def __init__(self, device: torch.device, n_streams: int, priority: int = -1) -> None:
        self.device = device
        # not from the low-priority pool that Future callbacks draw from (see
        # CopyEngineConfig.stream_priority)
        self.streams = [
            torch.cuda.Stream(device=device, priority=priority) for _ in range(n_streams)
        ]
        self.n = n_streams

    def wait_event(self, event: Any) -> None:
        for s in self.streams:
            s.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: int = 0) -> None:
        with torch.cuda.stream(self.streams[stream % self.n]):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: int = 0) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.streams[stream % self.n])
        return ev

    def record_event(self, event: Any, stream: int = 0) -> None:
        event.record(self.streams[stream % self.n])

    def record_stream(self, t: torch.Tensor) -> None:
        if t.is_cuda:
            for s in self.streams:
                t.record_stream(s)

    def join(self) -> None:
        """Make stream 0 wait for everything issued on the other streams."""
        for s in self.streams[1:]:
            self.streams[0].wait_stream(s)

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()


class _PeerSignals:
    """Device-side completion (``completion='device'``): for every receive buffer
    (slot), two CUDA inter-process events per rank, opened by every peer: ``free`` —
    recorded once this rank's buffer may be overwritten (the previous copy-out from it
    and the release of views handed out from it) — and ``sent`` — recorded after this
    rank's copies into the peers' buffers. Peers wait on them on their copy streams, never
    on the host. A wait applies to the record made by the last host call before it; the
    gloo header exchange (after ``free`` is recorded) and the completion all-reduce
    (after ``sent``) order each record before the peers' waits on it, and a slot's next
    records come only after every peer passed this round's completion all-reduce."""

    def __init__(self, device: torch.device, n_slots: int, rank: int, world: int) -> None:
        self.device, self.rank, self.world = device, rank, world
        self.free = [torch.cuda.Event(interprocess=True) for _ in range(n_slots)]
        self.sent = [torch.cuda.Event(interprocess=True) for _ in range(n_slots)]
        self.peer_free: list[list[Any]] = []
        self.peer_sent: list[list[Any]] = []

    def handles(self) -> tuple[list[bytes], list[bytes]]:
        with torch.cuda.device(self.device):
            return [e.ipc_handle() for e in self.free], [e.ipc_handle() for e in self.sent]

    def open(self, table: Sequence[Any]) -> None:
        """Open every peer's events from the all-gathered handles."""
        ev = torch.cuda.Event.from_ipc_handle
        for p in range(self.world):
            if p == self.rank:
                self.peer_free.append([])
                self.peer_sent.append([])
            else:
                self.peer_free.append([ev(self.device, h) for h in table[p][0]])
                self.peer_sent.append([ev(self.device, h) for h in table[p][1]])

    def peers(self, kind: str, idx: int) -> list[Any]:
        table = self.peer_free if kind == "free" else self.peer_sent
        return [table[p][idx] for p in range(self.world) if p != self.rank]


class _HostSignals:
    """``completion='device'`` on CPU ranks: copies are synchronous, so every record is
    complete when made and the gloo exchanges alone order the peers (no events)."""

    def __init__(self, n_slots: int) -> None:
        self.free = [_NullEvent() for _ in range(n_slots)]
        self.sent = [_NullEvent() for _ in range(n_slots)]

    def peers(self, kind: str, idx: int) -> list[Any]:
        return []


# ================================================================== the worker


class _ReleaseToken:
    """Marks when the views handed out from one receive buffer are no longer read."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.event: Any = None
        self._lock = threading.Lock()

    def release(self) -> Any:
        with self._lock:
            if self.event is None:
                if self.device.type == "cuda":
                    ev = torch.cuda.Event()
                    ev.record(torch.cuda.current_stream(self.device))
                    self.event = ev
                else:
                    self.event = _NullEvent()
            return self.event


class SegmentsAwaitable(Awaitable[Any]):
    """Handle of a zero-copy collective: ``wait()`` returns views into the receive
    buffer; :meth:`release` declares them consumed (see
    :meth:`CopyEngineCommunicator.all_to_all_v_segments`)."""

    def __init__(self, *args: Any, token: _ReleaseToken | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._token = token

    def release(self) -> None:
        """Every read of the returned views has been enqueued on the current stream: the
        buffer may be overwritten once the current stream passes this point."""
        if self._token is not None:
            self._token.release()


@dataclass
class _Slot:
    """One receive buffer (worker-owned, except ``views`` which callers set)."""

    capacity: int = 0
    local: torch.Tensor | None = None
    peers: list[torch.Tensor] | None = None
    keep: Any = None  # the provider's handle, alive as long as the mapping
    free_events: list[Any] = field(default_factory=list)
    views: _ReleaseToken | None = None  # set by the caller thread under the lock


_OP_A2A, _OP_AG = 1, 2
_HDR = 5  # op, seq, dtype code, row bytes, name hash


def _code(s: str) -> int:
    return zlib.crc32(s.encode()) & 0x7FFFFFFF


class CopyEngineCommunicator(Communicator):
    """SM-free all-gather / all-to-all-v inside one node through peer-mapped receive
    buffers and copy-engine copies, with handshakes over a dedicated gloo group.

    ``group`` must be a gloo process group used by nothing else (make one with
    :meth:`create`); with ``group=None`` and no initialised process group it is a world
    of one rank. Tensors must live on :attr:`device` (the current CUDA device when CUDA
    is available, else CPU with ``host_shm`` peer memory). Inputs must not be modified
    before ``wait()`` returns.
    """

    backend_name = "copy_engine"

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        name: str = "copy_engine",
        config: CopyEngineConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(group, name)
        self.config = config or CopyEngineConfig()
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.backend_name = "copy_engine"
        self.ranks: list[int] = [0]
        self.peer_memory = "none"
        self.peer_memory_note = ""
        self._closed = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._issue_lock = threading.Lock()
        self._seq = 0
        self._slots = [_Slot() for _ in range(self.config.num_recv_buffers)]
        self.completion = self.config.resolved_completion()
        self.stream_priority = self.config.resolved_stream_priority()
        # the last jobs' phases and events, for stall_report() (a hang's evidence)
        self._trace: deque[dict[str, Any]] = deque(maxlen=_TRACE_JOBS)
        _LIVE.add(self)
        self.completion_note = ""
        self._signals: _PeerSignals | _HostSignals | None = None
        self.device_completions = 0  # collectives completed with device-side waits
        self.handshake = "gloo"  # in force once the worker ran its first handshake
        self.handshake_note = ""
        self._xchg: ShmExchange | None = None
        # a deliberate bug for the GPU check to catch (benchmarks/gpu_check_comm.py):
        # "skip_sent_wait" copies out of the receive buffer without waiting for the peers
        self._mutation: str | None = None
        self.peak_buffer_bytes = 0
        self._thread: threading.Thread | None = None
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"copy-engine collectives support cpu and cuda, not {self.device}")
        pm = self.config.peer_memory
        if pm in ("symmetric", "ipc") and self.device.type != "cuda":
            raise ValueError(f"peer_memory={pm!r} needs CUDA tensors, device is {self.device}")
        if pm == "host_shm" and self.device.type != "cpu":
            raise ValueError("peer_memory='host_shm' carries CPU tensors only")
        if not (dist.is_available() and dist.is_initialized()):
            return
        backend = str(dist.get_backend(group)).lower()
        if backend != "gloo":
            raise ValueError(
                f"CopyEngineCommunicator needs a gloo process group for its handshakes, got "
                f"{backend!r}; create one with CopyEngineCommunicator.create()"
            )
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        self._pg = pg
        if pg is dist.group.WORLD and dist.get_world_size() > 1:
            warnings.warn(
                "CopyEngineCommunicator on the default process group: its worker thread "
                "must be the group's only user; prefer CopyEngineCommunicator.create()",
                stacklevel=2,
            )
        self.ranks = list(dist.get_process_group_ranks(pg))
        if pm in ("auto", "symmetric") and self.device.type == "cuda":
            ensure_no_multicast()
        if self.world_size == 1:
            return
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._token = uuid.uuid4().hex[:12]
        self._xchg = self._setup_handshake()  # collective, before the worker uses the group
        self._thread = threading.Thread(
            target=self._loop, name=f"freescale-copy-engine-{self.rank}", daemon=True
        )
        self._thread.start()

    @classmethod
    def create(
        cls,
        ranks: Sequence[int] | None = None,
        name: str = "copy_engine",
        config: CopyEngineConfig | None = None,
        device: torch.device | str | None = None,
    ) -> CopyEngineCommunicator:
        """Create a dedicated gloo group and a communicator on it. Collective over the
        default group (every rank calls it, groups created in the same order)."""
        cfg = config or CopyEngineConfig()
        if not (dist.is_available() and dist.is_initialized()):
            return cls(None, name, cfg, device)
        group = dist.new_group(
            ranks=list(ranks) if ranks is not None else None,
            backend="gloo",
            timeout=timedelta(seconds=cfg.timeout_s),
        )
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"rank {dist.get_rank()} is not in the group ranks {ranks}")
        return cls(group, name, cfg, device)

    # ------------------------------------------------------------- helpers
    def _describe(self, op: str, name: str) -> str:
        return (
            f"{op} '{name}' on rank {self.rank} of {self.world_size} "
            f"(copy_engine over {self.peer_memory} peer memory, group ranks {self.ranks})"
        )

    @property
    def buffer_bytes(self) -> int:
        """Receive-buffer memory currently held by this rank."""
        return sum(s.capacity for s in self._slots)

    def memory_stats(self) -> dict[str, Any]:
        return {
            "buffer_bytes": self.buffer_bytes,
            "peak_buffer_bytes": self.peak_buffer_bytes,
            "num_recv_buffers": self.config.num_recv_buffers,
            "max_buffer_bytes": self.config.max_buffer_bytes,
            "peer_memory": self.peer_memory,
        }

    def _check_open(self, op: str, name: str) -> None:
        if self._closed or self._thread is None:
            raise CollectiveError(f"{self._describe(op, name)} refused: the communicator is closed")
        if self._error is not None:
            raise CollectiveError(
                f"{self._describe(op, name)} refused: the copy-engine worker failed earlier: "
                f"{self._error}"
            ) from self._error

    def _check_device(self, t: torch.Tensor, op: str, name: str) -> None:
        if t.device.type != self.device.type or (t.is_cuda and t.device.index != self.device.index):
            raise ValueError(
                f"{self._describe(op, name)}: tensor on {t.device}, communicator on {self.device}"
            )

    def _submit(self, job: _Job) -> None:
        self._queue.put(job)

    # ----------------------------------------------------------- worker side
    def _loop(self) -> None:
        def setup() -> None:
            self._copier: Any
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
                self._copier = _CudaCopier(
                    self.device, self.config.copy_streams, self.stream_priority
                )
            else:
                self._copier = _HostCopier()

        serve_jobs(self._queue, lambda: self._error, self._fail, "copy-engine", setup)

    def _fail(self, error: BaseException) -> None:
        self._error = error

    def _wait_work(self, work: Any, what: str) -> None:
        limit = self.config.timeout_s
        try:
            ok = work.wait(timeout=timedelta(seconds=limit))
        except Exception as e:
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise TimeoutError(f"{what} timed out after {limit} s ({e})") from e
            raise RuntimeError(f"{what}: {e}") from e
        if ok is False:
            raise TimeoutError(f"{what} timed out after {limit} s")

    def _wait_events(self, events: Sequence[Any], what: str) -> None:
        """Host wait (polling, so it can time out) for device events."""
        limit = self.config.timeout_s
        deadline = time.monotonic() + limit
        for ev in events:
            pause = 20e-6
            while not ev.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} did not complete within {limit} s")
                time.sleep(pause)
                pause = min(pause * 2, 200e-6)

    def _setup_handshake(self) -> ShmExchange | None:
        """Construction (collective on the group, every rank): the shared-memory
        exchange per ``config.handshake``, or None for gloo."""
        mode = self.config.resolved_handshake()
        if mode == "gloo":
            return None
        ok, why = shm_available()
        if not ok:  # the same on every rank of one host: no collective was started
            if mode == "shm":
                raise RuntimeError(f"copy engine {self.name}: handshake='shm' unavailable: {why}")
            self.handshake_note = f"shared-memory handshake unavailable, gloo used: {why}"
            return None
        try:
            xchg = ShmExchange(
                self._pg,
                self.rank,
                self.world_size,
                max_len=_HDR + 2 * self.world_size,
                timeout_s=self.config.timeout_s,
                name=f"copy engine '{self.name}' handshake",
            )
        except ShmUnavailable as e:  # raised alike on every rank (a collective error,
            # e.g. a peer that never comes, propagates: the collective fails)
            if mode == "shm":
                raise
            self.handshake_note = f"shared-memory handshake failed, gloo used: {e}"
            warnings.warn(f"copy engine {self.name}: {self.handshake_note}", stacklevel=2)
            return None
        self.handshake = "shm"
        return xchg

    def _gather_header(self, hdr: list[int], what: str) -> torch.Tensor:
        if self._xchg is not None:
            return self._xchg.exchange(hdr, what)
        t = torch.tensor(hdr, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait_work(dist.all_gather(out, t, group=self._pg, async_op=True), what)
        return torch.stack(out)

    def _agree(self, ok: bool, what: str) -> bool:
        """All-reduce of an error flag: True iff every rank is ok."""
        if self._xchg is not None:
            return int(self._xchg.exchange([0 if ok else 1], what).max()) == 0
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        self._wait_work(
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._pg, async_op=True), what
        )
        return int(flag.item()) == 0

    def _setup_signals(self) -> _PeerSignals | _HostSignals | None:
        """Worker, first collective with ``completion='device'`` (every rank at the same
        job): create and exchange the inter-process events. If any rank cannot, every
        rank falls back to host completion (the reason in :attr:`completion_note`)."""
        if self._signals is not None or self.completion != "device":
            return self._signals
        n = len(self._slots)
        if self.device.type != "cuda":
            self._signals = _HostSignals(n)
            return self._signals
        sig, handles, err = None, None, None
        try:
            sig = _PeerSignals(self.device, n, self.rank, self.world_size)
            handles = sig.handles()
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = e
        table: list[Any] = [None] * self.world_size
        dist.all_gather_object(table, handles, group=self._pg)
        if err is None and all(t is not None for t in table):
            try:
                assert sig is not None
                sig.open(table)
            except Exception as e:  # noqa: BLE001
                err = e
        else:
            err = err or RuntimeError("another rank could not create inter-process events")
        if not self._agree(err is None, "opening the peers' inter-process events"):
            self.completion = "host"
            self.completion_note = f"device completion unavailable, host used: {err!r}"
            warnings.warn(f"copy engine {self.name}: {self.completion_note}", stacklevel=2)
            return None
        self._signals = sig
        return sig

    def _provider(self, kind: str) -> _PeerMemory:
        args = (self.device, self._pg, self.rank, self.world_size)
        if kind == "symmetric":
            return _SymmetricPeers(*args)
        if kind == "ipc":
            return _IpcPeers(*args)
        return _HostShmPeers(*args, token=self._token)

    def _connect(self, kind: str, nbytes: int) -> tuple[_PeerMemory, torch.Tensor, list]:
        """Collective: allocate ``nbytes`` on every rank (agreeing that all succeeded),
        then map every rank's buffer. Raises on every rank if any rank failed."""
        prov = self._provider(kind)
        local, err = None, None
        try:
            local = prov.alloc(nbytes)
        except Exception as e:  # noqa: BLE001 - agreed on below, re-raised on every rank
            err = e
        if not self._agree(err is None, f"allocating a {kind} receive buffer"):
            if local is not None:
                prov.discard(local)
            raise RuntimeError(
                f"allocating a {nbytes}-byte {kind} receive buffer failed on "
                f"{'this rank: ' + repr(err) if err is not None else 'another rank'}"
            )
        try:
            buf, peers = prov.connect(local, nbytes)
        except Exception as e:  # noqa: BLE001
            err = e
        if not self._agree(err is None, f"connecting {kind} receive buffers"):
            raise RuntimeError(
                f"connecting {kind} receive buffers failed on "
                f"{'this rank: ' + repr(err) if err is not None else 'another rank'}"
            )
        return prov, buf, peers

    def _ensure_capacity(self, slot: _Slot, need: int) -> None:
        cfg = self.config
        new = grow_capacity(
            slot.capacity,
            need,
            factor=cfg.growth_factor,
            minimum=cfg.initial_buffer_bytes,
            maximum=cfg.max_buffer_bytes,
            align=2 * _MiB if self.device.type == "cuda" else 4096,
        )
        if new == slot.capacity:
            return
        # every copy that touched the old buffer completed before its completion
        # all-reduce; views still read by the caller keep the old memory alive
        self._copier.synchronize()
        slot.local, slot.peers, slot.keep, slot.capacity = None, None, None, 0
        kinds = [self.peer_memory] if self.peer_memory != "none" else self._candidates()
        errors = []
        for kind in kinds:
            try:
                prov, buf, peers = self._connect(kind, new)
            except Exception as e:  # noqa: BLE001 - same outcome on every rank
                errors.append(f"{kind}: {e}")
                continue
            if self.peer_memory == "none":
                self.peer_memory = kind
                self.peer_memory_note = "; ".join(errors)
            slot.local, slot.peers, slot.keep, slot.capacity = buf, peers, prov, new
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
            return
        raise RuntimeError("no peer memory could be set up: " + " | ".join(errors))

    def _candidates(self) -> list[str]:
        pm = self.config.peer_memory
        if pm != "auto":
            return [pm]
        if self.device.type == "cpu":
            return ["host_shm"]
        ok, why = symm_available()
        return ["symmetric", "ipc"] if ok else ["ipc"]

    # ------------------------------------------------------- the data path
    def _claim_slot(self, seq: int, views: bool) -> tuple[int, list[Any], _ReleaseToken | None]:
        """Caller thread: the slot of call ``seq`` and the events that must complete
        before it is overwritten (the release of views handed out from it earlier)."""
        idx = seq % len(self._slots)
        slot = self._slots[idx]
        pre: list[Any] = []
        if slot.views is not None:
            pre.append(slot.views.release())  # recorded now if the caller never released
            slot.views = None
        token = _ReleaseToken(self.device) if views else None
        slot.views = token
        return idx, pre, token

    def _collective(
        self,
        op: int,
        op_name: str,
        name: str,
        src: torch.Tensor,
        hdr_row: int,
        splits: tuple[list[int], list[int]] | None,
        out: torch.Tensor | None,
        views: bool,
        make_result: Callable[[CopyPlan, _Slot], Any],
    ) -> Awaitable[Any]:
        """Queue one all-gather / all-to-all-v moving the flat byte view ``src``.
        ``out`` (flat bytes) receives the contiguous result unless ``views``."""
        describe = self._describe(op_name, name)
        self._check_open(op_name, name)
        # sequence order = queue order, even with several issuing threads; released
        # once the job is queued
        self._issue_lock.acquire()
        try:
            with self._lock:
                seq = self._seq
                self._seq += 1
                idx, pre, token = self._claim_slot(seq, views)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            rec: dict[str, Any] = {"seq": seq, "name": name, "phase": "queued", "ev": {}}
            rec["ev"]["ready"] = ready
            self._trace.append(rec)
        except BaseException:
            self._issue_lock.release()
            raise
        hdr = [op, seq, _code(str(src.dtype)), hdr_row, _code(name)]
        if splits is not None:
            hdr += splits[0] + splits[1]
        else:
            hdr += [0] * (2 * self.world_size)
        me, world = self.rank, self.world_size
        box: dict[str, Any] = {}

        def run() -> Any:
            copier = self._copier
            slot = self._slots[idx]
            copier.record_stream(src)
            if out is not None:
                copier.record_stream(out)
            sig = self._setup_signals()
            rec["phase"] = "buffer free"
            if sig is None:
                self._wait_events(pre + slot.free_events, f"{describe}: receive buffer release")
            else:  # the peers' copies into this buffer wait for ``free`` on the device
                for ev in pre + slot.free_events:
                    copier.wait_event(ev)
                copier.record_event(sig.free[idx])
                rec["ev"]["free"] = sig.free[idx]
            rec["phase"] = "header exchange"
            table = self._gather_header(hdr, f"{describe}: header exchange")
            _check_headers(table, world, describe)
            if op == _OP_A2A:
                s_in = table[:, _HDR : _HDR + world].tolist()
                plan = plan_all_to_all(s_in, me, hdr_row)
            else:
                plan = plan_all_gather(world, me, hdr_row)
            rec["phase"] = "capacity"
            self._ensure_capacity(slot, plan.need_bytes)
            rec["phase"] = "pushes"
            failure: BaseException | None = None
            try:
                if ready is not None:
                    copier.wait_event(ready)
                if sig is not None:  # every peer's buffer is free (its record, see above)
                    peer_free = rec["ev"]["peer free"] = sig.peers("free", idx)
                    for ev in peer_free:
                        copier.wait_event(ev)
                peers = slot.peers
                k = 0
                for p, s_off, d_off, n in plan.pushes:
                    assert peers is not None
                    dst = peers[p]
                    for a, m in _split_range(n, copier.n):
                        copier.copy(
                            dst[d_off + a : d_off + a + m], src[s_off + a : s_off + a + m], k
                        )
                        k += 1
                o_off, s_off, n = plan.self_copy
                if out is not None and n:
                    copier.copy(out[o_off : o_off + n], src[s_off : s_off + n], 0)
                if sig is None:
                    sent = [copier.record(i) for i in range(copier.n)]
                    self._wait_events(sent, f"{describe}: copies into peer buffers")
                else:
                    copier.join()
                    copier.record_event(sig.sent[idx])
                    rec["ev"]["sent"] = sig.sent[idx]
            except BaseException as e:  # noqa: BLE001 - agreed on, then re-raised
                failure = e
            rec["phase"] = "completion exchange"
            everyone = self._agree(failure is None, f"{describe}: completion")
            if failure is not None:
                raise failure
            if not everyone:
                raise RuntimeError("a peer rank failed to deliver its segment")
            if sig is not None:  # every peer's copies into this buffer, on the device
                if self._mutation != "skip_sent_wait":
                    peer_sent = rec["ev"]["peer sent"] = sig.peers("sent", idx)
                    for ev in peer_sent:
                        copier.wait_event(ev)
                self.device_completions += 1
            if out is not None:
                assert slot.local is not None or plan.recv_bytes == plan.self_copy[2]
                for a, m in plan.copy_out_ranges(me):
                    assert slot.local is not None
                    copier.copy(out[a : a + m], slot.local[a : a + m], 0)
            copier.join()
            done = copier.record(0)
            slot.free_events = [done] if not views else []
            box["done"] = done
            rec["ev"]["done"] = done
            rec["phase"] = "issued"
            return make_result(plan, slot)

        job = _Job(run, describe)
        try:
            self._submit(job)
        finally:
            self._issue_lock.release()

        def finish() -> Any:
            ev = box.get("done")
            if self.device.type == "cuda" and ev is not None:
                torch.cuda.current_stream(self.device).wait_event(ev)
            return job.result

        if views:
            return SegmentsAwaitable([job], finish, name, describe, "copy_engine", token=token)
        return Awaitable([job], finish, name, describe, "copy_engine")

    # ---------------------------------------------------------- collectives
    def all_gather(
        self, tensor: torch.Tensor, name: str = "", views: bool = False
    ) -> Awaitable[list[torch.Tensor]]:
        """Every rank's ``tensor`` (same shape and dtype on all ranks), by rank.

        ``views=True``: no local copy at all — the own entry is ``tensor`` itself and the
        others are views into the receive buffer, valid until the buffer is reused (see
        :meth:`all_to_all_v_segments`); the handle has ``release()``."""
        if self.world_size == 1:
            if views:
                return SegmentsAwaitable([], lambda: [tensor], name, "")
            return Done([tensor])
        self._check_device(tensor, "all_gather", name)
        src_t = tensor.contiguous()
        src = src_t.reshape(-1).view(torch.uint8)
        nbytes = src.numel()
        shape, dtype = tensor.shape, tensor.dtype
        world = self.world_size
        out_t = (
            None if views else torch.empty((world, nbytes), dtype=torch.uint8, device=src.device)
        )
        out = out_t.view(-1) if out_t is not None else None
        self._count("all_gather", name, nbytes)
        t0 = time.perf_counter()

        def result(plan: CopyPlan, slot: _Slot) -> list[torch.Tensor]:
            if nbytes == 0:
                return [
                    tensor if (views and r == self.rank) else tensor.new_empty(shape)
                    for r in range(world)
                ]
            if out_t is not None:
                return [out_t[r].view(dtype).view(shape) for r in range(world)]
            res = []
            for r, (off, n) in enumerate(plan.segments):
                if r == self.rank:
                    res.append(tensor)
                elif n == 0:
                    res.append(tensor.new_empty(shape))
                else:
                    assert slot.local is not None
                    res.append(slot.local[off : off + n].view(dtype).view(shape))
            return res

        aw = self._collective(_OP_AG, "all_gather", name, src, nbytes, None, out, views, result)
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
        ``output_splits[s]`` rows arrive from rank s, concatenated by source rank. The
        output is a fresh tensor (two local copies, see the module doc)."""
        i_s, o_s = self._check_splits(tensor, input_splits, output_splits, name)
        if self.world_size == 1:
            return Done(tensor)
        self._check_device(tensor, "all_to_all", name)
        src_t = tensor.contiguous()
        row_bytes = math.prod(src_t.shape[1:]) * src_t.element_size()
        out_t = src_t.new_empty((sum(o_s), *src_t.shape[1:]))
        out = out_t.reshape(-1).view(torch.uint8)
        src = src_t.reshape(-1).view(torch.uint8)
        self._count("all_to_all", name, (sum(i_s) - i_s[self.rank]) * row_bytes)
        t0 = time.perf_counter()
        aw = self._collective(
            _OP_A2A, "all_to_all", name, src, row_bytes, (i_s, o_s), out, False, lambda p, s: out_t
        )
        self.stats.seconds_issuing += time.perf_counter() - t0
        return aw

    def all_to_all_v_segments(
        self,
        tensor: torch.Tensor,
        input_splits: Sequence[int],
        output_splits: Sequence[int],
        name: str = "",
    ) -> SegmentsAwaitable:
        """Zero-copy all-to-all-v: ``wait()`` returns one tensor per source rank (rows
        from that rank): the own segment is a view of ``tensor``, every other one a view
        into this communicator's receive buffer. Only copy-engine copies run: no SM.

        The views stay valid until their receive buffer is reused, which happens
        ``num_recv_buffers`` data collectives later on this communicator, and never
        before the caller's current stream passed the point where either
        ``handle.release()`` was called or (if it was not) where that later collective
        was issued. So: enqueue every read of the views (on the current stream, or
        order other streams after it), then ``release()``; do not hold them longer."""
        i_s, o_s = self._check_splits(tensor, input_splits, output_splits, name)
        feat = tensor.shape[1:]
        if self.world_size == 1:
            return SegmentsAwaitable([], lambda: [tensor], name, "")  # type: ignore[arg-type]
        self._check_device(tensor, "all_to_all", name)
        src_t = tensor.contiguous()
        row_bytes = math.prod(feat) * src_t.element_size()
        src = src_t.reshape(-1).view(torch.uint8)
        self._count("all_to_all", name, (sum(i_s) - i_s[self.rank]) * row_bytes)
        in_off = [0]
        for n in i_s:
            in_off.append(in_off[-1] + n)
        me, dtype = self.rank, tensor.dtype
        t0 = time.perf_counter()

        def result(plan: CopyPlan, slot: _Slot) -> list[torch.Tensor]:
            res = []
            for s, (off, n) in enumerate(plan.segments):
                if s == me:
                    res.append(src_t[in_off[me] : in_off[me + 1]])
                elif n == 0:
                    res.append(src_t.new_empty((0, *feat)))
                else:
                    assert slot.local is not None
                    res.append(slot.local[off : off + n].view(dtype).view(-1, *feat))
            return res

        aw = self._collective(
            _OP_A2A, "all_to_all", name, src, row_bytes, (i_s, o_s), None, True, result
        )
        self.stats.seconds_issuing += time.perf_counter() - t0
        assert isinstance(aw, SegmentsAwaitable)
        return aw

    def stall_report(self) -> str:
        """This communicator's last jobs, oldest first: sequence number, name, the
        worker's phase (queued -> buffer free -> header exchange -> capacity -> pushes ->
        completion exchange -> issued) and each event's state, queried without waiting:
        ready (the caller's producer), free / sent (this rank's records), peer free /
        peer sent (the peers' records this rank's copy streams wait on), done (the last
        copy). For hang diagnosis: a job 'issued' on both ranks with a PENDING peer
        event points at the device; one stuck in an exchange at the host."""
        lines = [
            f"copy engine '{self.name}' rank {self.rank}/{self.world_size}: "
            f"next seq {self._seq}, completion {self.completion}, "
            f"stream priority {self.stream_priority}, closed {self._closed}"
        ]
        for rec in list(self._trace):
            evs = ", ".join(f"{k} {_event_state(v)}" for k, v in rec["ev"].items())
            lines.append(f"  seq {rec['seq']} '{rec['name']}': {rec['phase']}; {evs}")
        return "\n".join(lines)

    def exchange_counts(self, counts: torch.Tensor, name: str = "counts") -> torch.Tensor:
        """Blocking exchange of a ``[W, ...]`` integer count matrix (row d goes to rank d;
        the result's row s came from rank s), through gloo on the host; returned on the
        counts' own device."""
        if self.world_size == 1:
            return counts.clone()
        self._check_open("exchange_counts", name)
        flat = counts.reshape(self.world_size, -1).to("cpu", torch.int64)
        describe = self._describe("exchange_counts", name)

        def run() -> torch.Tensor:
            out = [torch.empty_like(flat) for _ in range(self.world_size)]
            self._wait_work(dist.all_gather(out, flat, group=self._pg, async_op=True), describe)
            return torch.stack([o[self.rank] for o in out])

        job = _Job(run, describe)
        self._submit(job)
        res = Awaitable([job], lambda: job.result, name, describe, "copy_engine").wait()
        return res.reshape(counts.shape).to(counts.device, counts.dtype)

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = ""
    ) -> Awaitable[torch.Tensor]:
        raise NotImplementedError(
            f"{self._describe('all_reduce', name)}: the copy-engine backend carries no "
            "reductions; reductions stay on NCCL/gloo (use a plain Communicator)"
        )

    def barrier(self, name: str = "barrier") -> None:
        """Blocks until every rank reached it and every collective queued before it on
        this communicator was issued (it runs in the FIFO worker)."""
        if self.world_size == 1:
            return
        self._check_open("barrier", name)
        describe = self._describe("barrier", name)

        def run() -> None:
            self._wait_work(dist.barrier(group=self._pg, async_op=True), describe)

        job = _Job(run, describe)
        self._submit(job)
        Awaitable([job], lambda: None, name, describe, "copy_engine").wait()

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Finish queued work, stop the worker, free the receive buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        _LIVE.discard(self)
        if self._thread is not None:
            self._queue.put(_STOP)
            if threading.current_thread() is not self._thread:
                self._thread.join(self.config.timeout_s)
            copier = getattr(self, "_copier", None)
            if copier is not None:
                try:
                    copier.synchronize()
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
        for s in self._slots:
            s.local, s.peers, s.keep, s.capacity, s.free_events = None, None, None, 0, []
        if self._xchg is not None:
            self._xchg.close()
            self._xchg = None

    def __enter__(self) -> CopyEngineCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_headers(table: torch.Tensor, world: int, describe: str) -> None:
    """Every rank checks every rank's header, so a mismatch fails everywhere alike."""
    rows = table.tolist()
    ref = rows[0]
    names = {0: "op", 1: "sequence number", 2: "dtype", 3: "row bytes", 4: "collective name"}
    for r, row in enumerate(rows):
        for i, what in names.items():
            if row[i] != ref[i]:
                raise ValueError(
                    f"{describe}: ranks disagree on the {what}: rank 0 has {ref[i]}, rank {r} "
                    f"has {row[i]} (collectives issued in different orders or shapes?)"
                )
    if ref[0] != _OP_A2A:
        return
    s_in = [row[_HDR : _HDR + world] for row in rows]
    s_out = [row[_HDR + world : _HDR + 2 * world] for row in rows]
    for src in range(world):
        for dst in range(world):
            if s_in[src][dst] != s_out[dst][src]:
                raise ValueError(
                    f"{describe}: rank {src} sends {s_in[src][dst]} rows to rank {dst}, which "
                    f"expects {s_out[dst][src]}"
                )


# ================================================================= choice
BACKENDS = ("auto", "nccl", "copy_engine", "host_staged")
#: FreeScale's traffic classes (DESIGN.md 2.3 / 3) and whether they overlap compute.
TRAFFIC_CLASSES = {
    "balancing": "overlapped",
    "ids": "overlapped",
    "exclusive_embeddings": "overlapped",
    "exclusive_gradients": "overlapped",
    "collision": "blocking",
    "dense": "blocking",
}
_REDUCTIONS = ("all_reduce", "reduce_scatter", "reduce")


@dataclass
class SMFreeConfig:
    """Backend per traffic class: ``auto`` (see :func:`select_backend`), ``nccl`` (the
    plain :class:`Communicator` on the default group: NCCL on GPU, gloo on CPU),
    ``copy_engine`` or ``host_staged``; plus each SM-free backend's own knobs."""

    balancing: str = "auto"
    ids: str = "auto"
    exclusive_embeddings: str = "auto"
    exclusive_gradients: str = "auto"
    collision: str = "auto"
    dense: str = "auto"
    copy_engine: CopyEngineConfig = field(default_factory=CopyEngineConfig)
    host_staged: HostStagedConfig = field(default_factory=HostStagedConfig)

    def __post_init__(self) -> None:
        for traffic in TRAFFIC_CLASSES:
            val = getattr(self, traffic)
            if val not in BACKENDS:
                raise ValueError(f"SMFreeConfig.{traffic}={val!r}: choose one of {BACKENDS}")
        if self.dense not in ("auto", "nccl"):
            raise ValueError(
                f"SMFreeConfig.dense={self.dense!r}: the dense all-reduce is a reduction and "
                "stays on NCCL (auto | nccl)"
            )

    def backend_for(self, traffic: str) -> str:
        if traffic not in TRAFFIC_CLASSES:
            raise ValueError(f"unknown traffic class {traffic!r} ({sorted(TRAFFIC_CLASSES)})")
        return getattr(self, traffic)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SMFreeConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown SMFreeConfig keys {sorted(unknown)}")
        kw = dict(d)
        if isinstance(kw.get("copy_engine"), dict):
            kw["copy_engine"] = CopyEngineConfig(**kw["copy_engine"])
        if isinstance(kw.get("host_staged"), dict):
            kw["host_staged"] = HostStagedConfig(**kw["host_staged"])
        return cls(**kw)


def select_backend(
    kind: str,
    traffic: str,
    config: SMFreeConfig | None = None,
    *,
    collective: str = "all_to_all",
    cuda: bool | None = None,
) -> str:
    """The backend for ``traffic`` on a group whose ranks are ``kind`` =
    ``"intra_node"`` (one NVLink node) or ``"inter_node"``.

    ``traffic`` is a class of :data:`TRAFFIC_CLASSES` or plainly ``"overlapped"`` /
    ``"blocking"``. Automatic choice: reductions and blocking traffic -> ``nccl``;
    overlapped traffic -> ``copy_engine`` inside a node on CUDA, ``host_staged``
    otherwise. A non-auto entry of ``config`` for the class wins, but is checked: no
    SM-free backend for reductions, no copy engine across nodes."""
    if kind not in ("intra_node", "inter_node"):
        raise ValueError(f"kind must be 'intra_node' or 'inter_node', got {kind!r}")
    if traffic in TRAFFIC_CLASSES:
        mode = TRAFFIC_CLASSES[traffic]
        chosen = (config or SMFreeConfig()).backend_for(traffic)
    elif traffic in ("overlapped", "blocking"):
        mode, chosen = traffic, "auto"
    else:
        raise ValueError(
            f"unknown traffic {traffic!r}: one of {sorted(TRAFFIC_CLASSES)}, overlapped, blocking"
        )
    if cuda is None:
        cuda = torch.cuda.is_available()
    if collective in _REDUCTIONS:
        if chosen not in ("auto", "nccl"):
            raise ValueError(
                f"{traffic}: {collective} is a reduction; {chosen} carries none (use nccl)"
            )
        return "nccl"
    if chosen == "copy_engine" and kind == "inter_node":
        raise ValueError(
            f"{traffic}: the copy-engine backend needs every rank in one NVLink node; this "
            "group spans nodes (use host_staged or nccl)"
        )
    if chosen != "auto":
        return chosen
    if mode == "blocking":
        return "nccl"
    if kind == "intra_node" and cuda:
        return "copy_engine"
    return "host_staged"


def detect_topology(group: dist.ProcessGroup | None = None) -> str:
    """``"intra_node"`` if every rank of ``group`` runs on this host, else
    ``"inter_node"``. Collective over ``group`` (an all-gather of host names)."""
    if not (dist.is_available() and dist.is_initialized()):
        return "intra_node"
    import socket

    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return "intra_node" if len(set(names)) == 1 else "inter_node"


def create_communicator(
    backend: str,
    name: str = "",
    ranks: Sequence[int] | None = None,
    config: SMFreeConfig | None = None,
) -> Communicator:
    """A communicator of ``backend`` (as returned by :func:`select_backend`). SM-free
    backends get a dedicated gloo group: collective over the default group, so every
    rank must call it in the same order."""
    cfg = config or SMFreeConfig()
    if backend == "nccl":
        group = None
        if ranks is not None and dist.is_initialized():
            group = dist.new_group(ranks=list(ranks))
        return Communicator(group, name or "nccl")
    if backend == "copy_engine":
        return CopyEngineCommunicator.create(ranks, name or "copy_engine", cfg.copy_engine)
    if backend == "host_staged":
        return HostStagedCommunicator.create(ranks, name or "host_staged", cfg.host_staged)
    raise ValueError(f"unknown backend {backend!r} (nccl, copy_engine, host_staged)")
