"""The data stage on its own thread: host batches agreed on, balanced and counted ahead.

Owns :class:`DataStageThread`. Without it the training thread runs the data stage of
step ``t+1`` (input agreement, the balancer's plan and sample exchange, the id dist's
split counts) between enqueuing steps ``t`` and ``t+1``: host work that the GPU waits
for whenever it is longer than the enqueued work (measured on 2 H200: 49 ms of host
data stage per FreeScale step against 39 ms of GPU compute). Here a background thread
does that work for steps ``t+2`` / ``t+3`` while the training thread drives step ``t``;
aten operators release the GIL, so the two run in parallel.

What runs on the thread, in step order, for every rank:

1. take the loaded batch, agree with every rank that all inputs are valid
   (:meth:`Trainer.agree_on_input`, on the trainer's ``data_comm``);
2. the leading hooks marked ``ahead_safe`` (the balancer), each on its own group;
3. the id dist's split sizes (``host_counts``), exchanged on ``data_comm``, when every
   remaining hook passes the batch through unchanged;
4. pinning, so the training thread's host-to-device copy is asynchronous.

The remaining hooks (checkpoints, fault monitor/injector) and the device copy stay on
the training thread, in the same order as without the thread.

Determinism: every collective of the thread is on groups only the thread uses, issued
in step order on every rank. A hook that learns from measured step times (the
balancer's cost model and AutoTune, ``on_metrics``) must plan step ``s`` from the same
observations on every rank. The gate guarantees a lower bound: step ``s`` is prepared
only after the metrics of step ``s - lag`` are finished (``lag`` = :data:`METRICS_LAG`,
4; the inline schedule plans ``s`` after ``s - 3`` in events timing). It is not an
upper bound: when one rank's data stage runs late, its training thread may have
finished the metrics of ``s - 3`` or ``s - 2`` too by then. So the hook plans ``s`` with
the cost state it had learned as of step ``s - METRICS_LAG``, whatever else has arrived
(``BalanceHook`` keeps its state per learned step; before session 17 it planned with
the current one, and a refit or AutoTune step could land between two ranks' plans of
one step).

Errors: an exception on the thread (rejected input on any rank, a collective error) is
handed to the training thread and raised there when it asks for that step, after the
steps before it; the thread stops. Because input agreement is a collective, every rank
raises for the same step and none applies an update for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from freescale.data.batch import JaggedBatch
from freescale.data.loader import put_until_stopped
from freescale.metrics.host_cpu import note_thread_exit

__all__ = ["METRICS_LAG", "DataStageThread", "PreparedBatch"]

# the data stage prepares step s only after the metrics of step s - METRICS_LAG are
# finished; hooks that learn from metrics plan s with what they knew as of s - METRICS_LAG
METRICS_LAG = 4

_DONE = object()


class PreparedBatch:
    """A host batch ready for the training thread: the step, the batch, the id-dist
    counts (``(sent, received)`` or None when the training thread must count)."""

    __slots__ = ("step", "batch", "counts")

    def __init__(self, step: int, batch: JaggedBatch, counts: Any) -> None:
        self.step, self.batch, self.counts = step, batch, counts


class DataStageThread:
    """Runs ``prepare(step)`` for ``steps`` in order on a background thread, at most
    ``depth`` steps ahead of the consumer, and gates step ``s`` on
    ``metrics_done() >= s - lag``.

    ``prepare`` returns a :class:`PreparedBatch`. ``get(step)`` returns it for the next
    step in order (raising the thread's exception for that step, if any)."""

    def __init__(
        self,
        prepare: Callable[[int], PreparedBatch],
        steps: list[int],
        *,
        depth: int = 2,
        lag: int = METRICS_LAG,
        num_threads: int | None = None,
        name: str = "freescale-data-stage",
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._prepare = prepare
        self._steps = list(steps)
        self._lag = lag
        self._num_threads = num_threads
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._metrics_done = self._steps[0] - 1 if self._steps else 0
        self._next = 0  # index into steps of the next get()
        self._error: BaseException | None = None
        # where the thread's wall time goes (seconds, summed over prepared steps): in
        # ``prepare`` (busy), waiting for the metrics gate, blocked on a full queue (ahead
        # of the consumer). busy ~ the step time with ~0 blocked: the data stage bounds
        # the step (the training thread then waits in its "data" stage)
        self.busy_s = 0.0
        self.gate_s = 0.0
        self.blocked_s = 0.0
        self.prepared = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ gate
    def metrics_done(self, step: int) -> None:
        """The training thread finished step ``step``'s record (hooks' on_metrics)."""
        with self._cond:
            if step > self._metrics_done:
                self._metrics_done = step
                self._cond.notify_all()

    def _wait_gate(self, step: int) -> bool:
        with self._cond:
            while self._metrics_done < step - self._lag:
                if self._stop.is_set():
                    return False
                self._cond.wait(timeout=0.05)
        return not self._stop.is_set()

    # -------------------------------------------------------------- producer
    def _put(self, item: object) -> bool:
        return put_until_stopped(self._queue, item, self._stop)

    def _run(self) -> None:
        try:
            self._produce()
        finally:
            note_thread_exit()  # its CPU time, for the trainer's host-CPU window

    def _produce(self) -> None:
        if self._num_threads is not None:  # explicit: the trainer's count, on this thread too
            torch.set_num_threads(self._num_threads)
        clock = time.perf_counter
        for step in self._steps:
            t0 = clock()
            if not self._wait_gate(step):
                return
            t1 = clock()
            try:
                item: Any = self._prepare(step)
            except BaseException as e:  # handed to the consumer, never swallowed
                self._put((step, e))
                return
            t2 = clock()
            if not self._put(item):
                return
            self.gate_s += t1 - t0
            self.busy_s += t2 - t1
            self.blocked_s += clock() - t2
            self.prepared += 1
        if self._put(_DONE):
            # stay alive until close(): an exited thread takes its OpenMP team with it,
            # and the team's CPU time (its workers spin between parallel regions) with
            # it out of the trainer's host-CPU window (metrics.host_cpu)
            self._stop.wait()

    def timing(self) -> dict[str, float | int]:
        """Mean ms per prepared step in ``prepare`` (busy), waiting for the metrics gate
        and blocked on the full queue, and the number of steps prepared (read after
        :meth:`close`, or as a running estimate)."""
        n = max(self.prepared, 1)
        return {
            "prepared": self.prepared,
            "busy_ms": 1e3 * self.busy_s / n,
            "gate_ms": 1e3 * self.gate_s / n,
            "blocked_ms": 1e3 * self.blocked_s / n,
        }

    # -------------------------------------------------------------- consumer
    def get(self, step: int) -> PreparedBatch:
        if self._error is not None:
            raise self._error
        if self._next >= len(self._steps) or self._steps[self._next] != step:
            want = self._steps[self._next] if self._next < len(self._steps) else None
            raise RuntimeError(f"data stage: asked for step {step}, next prepared is {want}")
        while True:
            try:
                item = self._queue.get(timeout=0.1)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError(
                        f"data stage thread ended without preparing step {step}"
                    ) from None
        if item is _DONE:
            raise RuntimeError(f"data stage: no batch for step {step}")
        if isinstance(item, tuple):
            bad_step, exc = item
            self._error = exc
            raise exc
        assert isinstance(item, PreparedBatch) and item.step == step, (item, step)
        self._next += 1
        return item

    def close(self) -> None:
        """Stop the thread (it finishes a collective in flight first) and join it."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5.0)

    def __enter__(self) -> DataStageThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
