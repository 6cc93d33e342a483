"""One asynchronous interface for FreeScale's collectives.

Owns: :class:`Awaitable` (a handle whose ``wait()`` returns the result, as in
TorchRec), :class:`Communicator` (all-gather, variable-split all-to-all, all-reduce
over a ``torch.distributed`` process group: gloo on CPU, NCCL on GPU),
:func:`process_groups` / :func:`release_groups` (the groups a component made, destroyed
once every rank is done with them), :func:`side_communicator` (a second group over the
same ranks, for traffic that must not queue behind the main group's), per-backend
byte / call counters and :data:`wait_clock` (host time each thread spent blocked in
``wait()``, by backend and collective: where a thread waits for a peer or a worker
rather than handing the wait to the device). SM-free backends (copy-engine,
host-staged) implement the same :class:`Communicator` methods and live in sibling
modules; callers never branch on the backend.

It may not touch model state: it moves tensors and nothing else. Every collective
carries a name, used in errors ("all_to_all 'ids' on rank 1 of 2 failed: ...").
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "Awaitable",
    "Done",
    "CommStats",
    "Communicator",
    "CollectiveError",
    "WaitClock",
    "wait_clock",
    "device_wait",
    "process_groups",
    "release_groups",
    "side_communicator",
]

T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names it and the ranks."""


#: Optional observers, set by freescale.pipeline.faults (None: no cost). ``on_issue(aw)``
#: sees every issued collective's handle; ``on_error(aw, exc)`` builds the error raised.
on_issue: Callable[[Awaitable], None] | None = None
on_error: Callable[[Awaitable, BaseException], CollectiveError] | None = None
#: Optional deadline of ``Awaitable.wait`` on ``torch.distributed`` works (gloo: a
#: group's own timeout does not bound every wait); set by faults.py on CPU only.
wait_timeout: datetime.timedelta | None = None


class WaitClock:
    """Host seconds spent inside :meth:`Awaitable.wait` (its first call: the works'
    waits and the finish), and calls, per ``"thread|backend:name"``. On NCCL a wait
    only makes the stream wait (microseconds on the host); on gloo, the copy engine and
    host-staged it blocks the calling thread until the peers (or the backend's worker)
    got there, which is host time the GPU queue may run dry in. Process-wide; the
    trainer resets it at its first timed step and reports it per step."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._calls: dict[str, int] = defaultdict(int)

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self._seconds[key] += seconds
            self._calls[key] += 1

    def reset(self) -> None:
        with self._lock:
            self._seconds.clear()
            self._calls.clear()

    def snapshot(self) -> dict[str, tuple[float, int]]:
        """``{key: (seconds, calls)}`` since the last reset."""
        with self._lock:
            return {k: (self._seconds[k], self._calls[k]) for k in sorted(self._seconds)}

    def per_step_ms(self, steps: int, thread: str | None = None) -> dict[str, dict[str, float]]:
        """``{key: {"ms_per_step", "calls_per_step"}}`` over ``steps`` steps; with
        ``thread``, that thread's keys only, the thread prefix dropped."""
        out: dict[str, dict[str, float]] = {}
        n = max(int(steps), 1)
        for key, (sec, calls) in self.snapshot().items():
            who, _, what = key.partition("|")
            if thread is not None and who != thread:
                continue
            out[what if thread is not None else key] = {
                "ms_per_step": 1e3 * sec / n,
                "calls_per_step": calls / n,
            }
        return out


#: The process's wait clock (see :class:`WaitClock`).
wait_clock = WaitClock()


class device_wait:  # noqa: N801 - used like a function: ``with device_wait("mask_read"):``
    """Count a host wait for the device (an event's ``synchronize()``) on the wait clock
    as ``"thread|device:<name>"``: the other way a thread blocks, next to collectives'
    ``wait()``. When the GPU has drained its queue up to that point, the wait is where
    the queue runs dry."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        wait_clock.add(
            f"{threading.current_thread().name}|device:{self.name}",
            time.perf_counter() - self.t0,
        )


class Awaitable(Generic[T]):
    """Result of an asynchronous collective. ``wait()`` blocks (or, on CUDA, makes the
    current stream wait) and returns the result; calling it twice is fine."""

    def __init__(
        self,
        works: Sequence[object],
        finish: Callable[[], T],
        name: str = "",
        describe: str = "",
        backend: str = "",
    ) -> None:
        self._works = list(works)
        self._finish = finish
        self._name = name
        self._describe = describe
        self._backend = backend
        self._done = False
        self._result: T | None = None
        if on_issue is not None and self._works:
            on_issue(self)

    def wait(self) -> T:
        if not self._done:
            t0 = time.perf_counter()
            try:
                for w in self._works:
                    if wait_timeout is not None and isinstance(w, dist.Work):
                        w.wait(wait_timeout)
                    else:
                        w.wait()  # type: ignore[attr-defined]
            except Exception as e:  # gloo/NCCL errors: add what and who
                if on_error is not None:
                    raise on_error(self, e) from e
                raise CollectiveError(f"{self._describe} failed: {e}") from e
            self._result = self._finish()
            self._done = True
            if self._works:  # a Done has nothing to wait for
                wait_clock.add(
                    f"{threading.current_thread().name}|{self._backend or '?'}:{self._name}",
                    time.perf_counter() - t0,
                )
        return self._result  # type: ignore[return-value]

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)  # type: ignore[attr-defined]


class Done(Awaitable[T]):
    """An already available result (single rank, or nothing to send)."""

    def __init__(self, value: T) -> None:
        super().__init__([], lambda: value)


@dataclass
class CommStats:
    """Bytes sent and calls made per (backend, collective name)."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds_issuing: float = 0.0

    def add(self, key: str, nbytes: int) -> None:
        self.bytes[key] += int(nbytes)
        self.calls[key] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"bytes": dict(self.bytes), "calls": dict(self.calls)}

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()
        self.seconds_issuing = 0.0


class Communicator:
    """Collectives over one ``torch.distributed`` process group (gloo or NCCL).

    With ``group=None`` and no initialised process group, it acts as a world of one
    rank (every collective returns its input), so single-process code paths need no
    special case.
    """

    backend_name = "torch"
    _group: dist.ProcessGroup | None = None
    _released = False

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default one, or a world of one rank)."""
        if self._released:
            raise CollectiveError(
                f"communicator '{self.name}' was released (its process group destroyed, "
                "e.g. by Trainer.close()): build a new one"
            )
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        self._group = group

    def release(self) -> None:
        """Drop this communicator's process group after `release_groups` destroyed it:
        a destroyed gloo group keeps its transport thread for as long as anything
        references it. Any later use of ``group`` (every multi-rank collective) raises
        :class:`CollectiveError` naming the communicator."""
        self._group = None
        self._released = True

    def __init__(self, group: dist.ProcessGroup | None = None, name: str = "default") -> None:
        self.group = group
        self.name = name
        self.stats = CommStats()
        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
            self.backend_name = str(dist.get_backend(group))
        else:
            self.rank, self.world_size = 0, 1
            self.backend_name = "single"
        # tensors handed to this group's collectives must live here
        if self.backend_name == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    # ---------------------------------------------------------------- helpers
    def _describe(self, op: str, name: str) -> str:
        return f"{op} '{name}' on rank {self.rank} of {self.world_size} ({self.backend_name})"

    def _count(self, op: str, name: str, nbytes: int) -> None:
        self.stats.add(f"{self.backend_name}:{op}:{name}", nbytes)

    def _check_splits(
        self, tensor: torch.Tensor, input_splits: Sequence[int], output_splits: Sequence[int], name
    ) -> tuple[list[int], list[int]]:
        """The splits of an all-to-all-v as ints, or a ``ValueError`` naming the
        collective and this rank: one entry per rank, none negative, the input splits
        summing to the tensor's rows, and what this rank sends itself equal to what it
        expects from itself. (Whether peers agree is only known after the exchange.)"""
        i_s = [int(s) for s in input_splits]
        o_s = [int(s) for s in output_splits]
        describe = self._describe("all_to_all", name)
        if len(i_s) != self.world_size or len(o_s) != self.world_size:
            raise ValueError(
                f"{describe}: splits must have {self.world_size} entries, got {len(i_s)} and "
                f"{len(o_s)}"
            )
        if min(i_s + o_s, default=0) < 0:
            raise ValueError(f"{describe}: negative split")
        if sum(i_s) != tensor.shape[0]:
            raise ValueError(
                f"{describe}: input splits sum to {sum(i_s)} but the tensor has "
                f"{tensor.shape[0]} rows"
            )
        if i_s[self.rank] != o_s[self.rank]:
            raise ValueError(
                f"{describe}: this rank sends itself {i_s[self.rank]} rows but expects "
                f"{o_s[self.rank]}"
            )
        return i_s, o_s

    # ------------------------------------------------------------ collectives
    def all_gather(self, tensor: torch.Tensor, name: str = "") -> Awaitable[list[torch.Tensor]]:
        """Every rank's ``tensor`` (same shape on all ranks), indexed by rank."""
        if self.world_size == 1:
            return Done([tensor])
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._count("all_gather", name, tensor.numel() * tensor.element_size())
        t0 = time.perf_counter()
        try:
            work = dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True)
        except Exception as e:
            raise CollectiveError(f"{self._describe('all_gather', name)} failed: {e}") from e
        self.stats.seconds_issuing += time.perf_counter() - t0
        return Awaitable(
            [work], lambda: out, name, self._describe("all_gather", name), self.backend_name
        )

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
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        row = (
            tensor[0:1].numel() * tensor.element_size()
            if tensor.dim() > 1
            else tensor.element_size()
        )
        self._count("all_to_all", name, (sum(input_splits) - input_splits[self.rank]) * row)
        t0 = time.perf_counter()
        try:
            work = dist.all_to_all_single(
                out,
                tensor.contiguous(),
                output_split_sizes=output_splits,
                input_split_sizes=input_splits,
                group=self.group,
                async_op=True,
            )
        except Exception as e:
            raise CollectiveError(f"{self._describe('all_to_all', name)} failed: {e}") from e
        self.stats.seconds_issuing += time.perf_counter() - t0
        return Awaitable(
            [work], lambda: out, name, self._describe("all_to_all", name), self.backend_name
        )

    def all_reduce(
        self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = ""
    ) -> Awaitable[torch.Tensor]:
        """In-place all-reduce of ``tensor``; the handle returns it."""
        if self.world_size == 1:
            return Done(tensor)
        self._count("all_reduce", name, tensor.numel() * tensor.element_size())
        try:
            work = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        except Exception as e:
            raise CollectiveError(f"{self._describe('all_reduce', name)} failed: {e}") from e
        return Awaitable(
            [work], lambda: tensor, name, self._describe("all_reduce", name), self.backend_name
        )

    def exchange_counts(self, counts: torch.Tensor, name: str = "counts") -> torch.Tensor:
        """Blocking all-to-all of a ``[W, ...]`` integer count matrix: row d goes to rank d;
        the result's row s came from rank s. Used to learn output splits."""
        if self.world_size == 1:
            return counts.clone()
        flat = counts.reshape(self.world_size, -1).to(self.device)
        per = flat.shape[1]
        out = self.all_to_all_v(
            flat.reshape(-1), [per] * self.world_size, [per] * self.world_size, name
        ).wait()
        return out.reshape(counts.shape).to(counts.device)

    def barrier(self, name: str = "barrier") -> None:
        if self.world_size == 1:
            return
        try:
            dist.barrier(group=self.group)
        except Exception as e:
            raise CollectiveError(f"{self._describe('barrier', name)} failed: {e}") from e


def process_groups() -> set[dist.ProcessGroup] | None:
    """The process groups this process knows (torch's group registry), or ``None`` where
    torch does not expose it. Taken before and after a component's set-up, the difference
    is the groups that component made (``dist.new_group`` has no owner of its own)."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    pg_map = getattr(world, "pg_map", None)
    return set(pg_map) if isinstance(pg_map, dict) else None


def release_groups(
    groups: Sequence[dist.ProcessGroup], barrier: dist.ProcessGroup | None = None
) -> int:
    """Destroy ``groups`` after a barrier on ``barrier`` (the default group when None), so
    that no rank closes a connection a peer still reads. Collective: every rank of the
    barrier group calls it with its own groups (a rank that made none still joins the
    barrier). Each gloo group owns a transport thread that wakes every 10 ms and each
    NCCL group its communicators' buffers: a process that makes components repeatedly
    (a benchmark's variants, a sweep in one process) keeps them all unless they are
    released. A destroyed gloo group still runs (and keeps its thread) while referenced:
    the caller also drops its references (:meth:`Communicator.release`). Returns how many
    groups were destroyed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    dist.barrier(group=barrier)  # no rank destroys a group a peer still uses
    known = process_groups()
    n = 0
    for g in groups:
        if known is None or g in known:
            dist.destroy_process_group(g)
            n += 1
    return n


def side_communicator(comm: Communicator, name: str) -> Communicator:
    """A :class:`Communicator` over the ranks of ``comm`` on a new process group of the
    same backend (a side stream's traffic must not queue behind ``comm``'s). A world of
    one needs no group: outside a larger job a single-rank communicator, inside one
    ``comm`` itself (every collective of a one-rank group is local). Collective: every
    rank of the job calls it in the same order (``dist.new_group``)."""
    if comm.world_size == 1:
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return Communicator(None, name=name)
        return comm
    ranks = None if comm.group is None else dist.get_process_group_ranks(comm.group)
    group = dist.new_group(ranks=ranks, backend=dist.get_backend(comm.group))
    return Communicator(group, name=name)
