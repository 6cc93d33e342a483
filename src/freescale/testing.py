"""Shared pools of real ``torch.distributed`` ranks for tests and benchmarks.

Owns :class:`DistPool`: W worker processes started once with torch's own
multiprocessing (spawn), each joined to one gloo process group, that run any
picklable function ``fn(rank, world_size, *args)`` on every rank and return the
per-rank results. Importing torch in a new process takes seconds on a 2-core machine;
sharing one pool per world size across a whole test session keeps CI fast.

Groups a task makes (``dist.new_group``: a trainer makes three, a prioritized collection
one more) are destroyed once every rank has finished it. Each gloo group owns a transport
thread that wakes every 10 ms, so groups leaked across a session's few hundred tasks kept
the 2-core CI machine busy in the kernel (session 40 counted 737 threads per worker and
80% system time in idle workers, and the suite's subprocess tests ran several times slower
late in the session than alone).

Failure handling: an exception on any rank is re-raised in the caller with that rank's
traceback; a task that does not finish within ``timeout`` kills the pool (the next
``run`` starts a fresh one), so a hung collective never hangs the suite.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing as mp

__all__ = ["DistPool", "RankFailure"]


class RankFailure(RuntimeError):
    """A task raised on some rank; the message carries that rank's traceback."""


def _worker(rank: int, world: int, init_file: str, tasks, results, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    while True:
        item = tasks.get()
        if item is None:
            break
        tid, fn, args, kwargs = item
        before = _groups()
        try:
            out = fn(rank, world, *args, **kwargs)
            # pickle here: an unpicklable result must fail this task, not the queue thread
            ForkingPickler.dumps(out)
        except BaseException as e:  # noqa: BLE001 - report everything to the parent
            # the pool restarts after a failure: no cleanup (a peer may sit in a collective)
            results.put((tid, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
            continue
        _destroy_new_groups(before)
        results.put((tid, rank, True, out))
    dist.destroy_process_group()


def _groups() -> set[Any] | None:
    from freescale.comm.base import process_groups

    return process_groups()


def _destroy_new_groups(before: set[Any] | None) -> None:
    """Destroy the groups made since ``before``, after every rank is done with them (a
    barrier on the default group, also on a rank that joined no new group: a subgroup
    task)."""
    from freescale.comm.base import release_groups

    if before is None:
        return
    release_groups(list((_groups() or set()) - before))


class DistPool:
    """``world_size`` gloo ranks in worker processes; see module docstring."""

    def __init__(self, world_size: int, timeout: float = 300.0, pg_timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self.pg_timeout = pg_timeout
        self._procs: list[Any] = []
        self._tid = 0

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        fd, init_file = tempfile.mkstemp(prefix="freescale-pool-")
        os.close(fd)
        os.unlink(init_file)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    init_file,
                    self._tasks[r],
                    self._results,
                    self.pg_timeout,
                ),
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; results by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        self._tid += 1
        tid = self._tid
        for q in self._tasks:
            q.put((tid, fn, args, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(out) + len(errors) < self.world_size:
            # once a rank failed, the others may sit in a collective: do not wait long
            wait = self.timeout if not errors else min(self.timeout, 15.0)
            try:
                t, rank, ok, val = self._results.get(timeout=wait)
            except queue.Empty:
                self.close()
                if errors:
                    r = min(errors)
                    raise RankFailure(
                        f"rank {r} of {self.world_size} failed:\n{errors[r]}"
                    ) from None
                raise RankFailure(
                    f"{getattr(fn, '__name__', fn)} did not finish on ranks "
                    f"{sorted(set(range(self.world_size)) - set(out) - set(errors))} within "
                    f"{self.timeout:.0f} s; pool restarted"
                ) from None
            if t != tid:
                continue  # late result of an earlier, failed task
            (out if ok else errors)[rank] = val
        if errors:
            # ranks may have been left inside a collective: start afresh next time
            self.close()
            r = min(errors)
            raise RankFailure(f"rank {r} of {self.world_size} failed:\n{errors[r]}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in getattr(self, "_tasks", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self._procs = []

    def __enter__(self) -> DistPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
