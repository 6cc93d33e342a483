"""Prefetching loader: local batches of the next steps, built and validated ahead.

Owns :class:`PrefetchingLoader`, a background thread that loads the local batches of
steps ``t+1 .. t+depth`` while step ``t`` trains (DESIGN.md section 3: "load batch
t+3, validate it"), and the per-step load times. It may not touch devices beyond
optional pinning, the model, or communication: whatever must happen at load time
(validation, counting ids per owner) is passed in as ``validate_fn``.

Error contract: an exception raised while loading step ``t`` (by the source or by
``validate_fn``) is never swallowed. Batches of the steps before ``t`` are still
yielded; asking for step ``t`` re-raises it on the consumer's thread, prefixed with
``"step t: "``, as the same exception type when that type can be rebuilt from a
message (``BadInputError`` stays a ``BadInputError``) and as :class:`LoaderError`
otherwise; the original is chained as ``__cause__`` and the step is in ``.step``.
The loader stops producing after an error.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from freescale.data.batch import JaggedBatch
from freescale.metrics.host_cpu import note_thread_exit

__all__ = ["PrefetchingLoader", "LoaderError", "BatchSource", "put_until_stopped"]


class LoaderError(RuntimeError):
    """Loading a step failed with an exception that could not be re-raised as its own
    type; ``__cause__`` holds the original."""

    step: int = -1


class BatchSource(Protocol):
    """What the loader needs from a data source (SyntheticSource, MovieLensSource)."""

    def local_batch(
        self, step: int, rank: int, world_size: int, split: str = "train"
    ) -> JaggedBatch: ...


_DONE = object()


def _with_step(step: int, exc: BaseException) -> BaseException:
    msg = f"step {step}: {exc}"
    try:
        new = type(exc)(msg)
        if str(new) != msg:
            raise TypeError("exception type rewrites its message")
    except Exception:
        new = LoaderError(f"step {step}: {type(exc).__name__}: {exc}")
    try:
        new.step = step  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return new


def put_until_stopped(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put ``item`` on the bounded queue ``q``, waiting for room; False if ``stop`` is
    set first (a producer thread's put that never blocks its shutdown)."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


class PrefetchingLoader:
    """Iterate the local batches of ``steps`` for one rank, loaded ``depth`` ahead.

    ``steps`` is a step count (steps ``0 .. steps-1``) or any iterable of step
    indices (e.g. ``range(resume_step, total)``). ``validate_fn`` (batch -> batch) runs
    on the loader thread for every batch, e.g. ``functools.partial(validate_batch,
    feature_rows=..., max_uih=..., rank=rank)``. ``pin_memory=True`` pins each batch
    (a no-op without CUDA). The load time of each step (source + validation + pinning,
    seconds) is in ``load_times[step]`` and ``batch.extras["load_time_s"]``.

    Use as a context manager, or call :meth:`close` (joins the thread).
    """

    def __init__(
        self,
        source: BatchSource,
        rank: int,
        world_size: int,
        steps: int | Iterable[int],
        validate_fn: Callable[[JaggedBatch], JaggedBatch] | None = None,
        depth: int = 3,
        pin_memory: bool = False,
        split: str = "train",
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.source = source
        self.rank = rank
        self.world_size = world_size
        self.steps = list(range(steps)) if isinstance(steps, int) else [int(s) for s in steps]
        self.validate_fn = validate_fn
        self.depth = depth
        self.pin_memory = pin_memory
        self.split = split
        self.load_times: dict[int, float] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._consumed = 0
        self._finished = False
        self._thread = threading.Thread(
            target=self._run, name=f"freescale-loader-rank{rank}", daemon=True
        )
        self._thread.start()

    # ---------------------------------------------------------------- producer
    def _put(self, item: object) -> bool:
        return put_until_stopped(self._queue, item, self._stop)

    def _run(self) -> None:
        try:
            self._produce()
        finally:
            note_thread_exit()  # its CPU time, for the trainer's host-CPU window

    def _produce(self) -> None:
        for step in self.steps:
            if self._stop.is_set():
                return
            try:
                t0 = time.perf_counter()
                batch = self.source.local_batch(step, self.rank, self.world_size, self.split)
                if self.validate_fn is not None:
                    batch = self.validate_fn(batch)
                if self.pin_memory:
                    batch = batch.pin_memory()
                dt = time.perf_counter() - t0
                batch.extras["load_time_s"] = dt
                self.load_times[step] = dt
            except BaseException as e:  # handed to the consumer, never swallowed
                self._put((step, None, e))
                return
            if not self._put((step, batch, None)):
                return
        self._put(_DONE)

    # ---------------------------------------------------------------- consumer
    def __iter__(self) -> Iterator[JaggedBatch]:
        return self

    def __next__(self) -> JaggedBatch:
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        step, batch, exc = item
        self._consumed += 1
        if exc is not None:
            self._finished = True
            raise _with_step(step, exc) from exc
        return batch

    def __len__(self) -> int:
        return len(self.steps)

    def close(self) -> None:
        """Stop the thread (dropping batches loaded ahead) and join it."""
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()
        self._finished = True

    def __enter__(self) -> PrefetchingLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self._stop.set()
        except Exception:
            pass
