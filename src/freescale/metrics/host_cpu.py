"""Host CPU time per thread group over a window of training steps.

Owns the question "is the host, not the device, what bounds the step?". A GPU step is
host-bound when the Python threads that launch work (the training thread, the autograd
engine's device threads, the data-stage thread, the communicators' workers) need, in
CPU time, about as long as the step takes: they share one interpreter lock, so their
CPU times add up. :class:`ThreadCpuMeter` reads every thread's user + system time from
``/proc/self/task`` (Linux; elsewhere it reports nothing) at the start and the end of
a window, groups the threads by role and returns CPU milliseconds per step next to the
wall milliseconds per step. It never touches the device; reading ``/proc`` costs about
a millisecond, done twice per window, not per step.

Resolution: the kernel counts thread CPU time in clock ticks (usually 10 ms), so a
window should span a few hundred milliseconds at least; the process total comes from
``os.times()`` and the calling thread's own time from ``time.thread_time()``, both finer.
A thread that exits inside the window counts if it called :func:`note_thread_exit` (the
data stage and the loader do); other exited threads are lost with their ``/proc`` entry.

CPU time says how busy the threads are, not whether they wait for each other. The
:class:`GilProbe` measures that wait: a thread that sleeps a fixed period and, on each
wake, records how late it got to run again (it needs the interpreter lock to resume).
On an idle interpreter the lateness is the OS timer's (tens of microseconds); when other
threads hold the lock in Python code, a thread that wants it waits up to the switch
interval (``sys.getswitchinterval()``, 5 ms by default) — the same wait the training
thread sees before it can launch the next kernels. Its own cost: one wake per period.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["ThreadCpuMeter", "CpuSnapshot", "GilProbe", "thread_group", "note_thread_exit"]

_TASKS = "/proc/self/task"
# CPU seconds of worker threads at their exit (tid -> (Python name, seconds)): a thread
# that ends inside a window takes its /proc entry with it
_EXITED: dict[int, tuple[str, float]] = {}
_EXITED_LOCK = threading.Lock()
_TOP_OTHER = 6  # busiest "other" threads listed per window


def note_thread_exit() -> None:
    """Call at the end of a worker thread's run (the data stage, the loader): its CPU
    time is kept for a meter whose window outlives the thread."""
    with _EXITED_LOCK:
        _EXITED[threading.get_native_id()] = (threading.current_thread().name, time.thread_time())


def thread_group(kernel_name: str, python_name: str, is_caller: bool) -> str:
    """Role of a thread: ``training`` (the thread that runs the loop), ``autograd``
    (torch's device threads), ``data`` (the data-stage thread and the loader),
    ``comm_workers`` (the SM-free communicators' workers), ``watchdog`` (heartbeat and
    collective watchdog), ``gloo`` (gloo's I/O loops) or ``other``."""
    if is_caller:
        return "training"
    if kernel_name.startswith("pt_autograd"):
        return "autograd"
    if python_name.startswith(("freescale-data-stage", "freescale-loader")):
        return "data"
    if python_name.startswith(("freescale-copy-engine", "freescale-host-staged")):
        return "comm_workers"
    if python_name.startswith(("freescale-heartbeat", "freescale-watchdog")):
        return "watchdog"
    if python_name.startswith("freescale-gil-probe"):
        return "probe"
    if kernel_name.startswith(("gloo", "pt_gloo")):
        return "gloo"
    return "other"


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds at one instant: per thread id ``(kernel name, seconds)``, the
    process total, the caller's own thread time and the wall clock."""

    threads: dict[int, tuple[str, float]]
    process_s: float
    caller_s: float
    wall_s: float


def _read_threads(tick: float) -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/stat") as fh:
                st = fh.read()
        except OSError:  # the thread exited meanwhile
            continue
        name = st[st.index("(") + 1 : st.rindex(")")]
        fields = st[st.rindex(")") + 2 :].split()
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) * tick)
    return out


class ThreadCpuMeter:
    """``start()`` at the first step of a window, ``stop(steps)`` after its last; the
    result is ``None`` where ``/proc/self/task`` is missing (not Linux)."""

    def __init__(self) -> None:
        self.available = os.path.isdir(_TASKS)
        try:
            self._tick = 1.0 / os.sysconf("SC_CLK_TCK")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
            self._tick, self.available = 0.01, False
        self._start: CpuSnapshot | None = None
        self._caller = threading.get_native_id()

    def snapshot(self) -> CpuSnapshot | None:
        if not self.available:
            return None
        t = os.times()
        return CpuSnapshot(
            threads=_read_threads(self._tick),
            process_s=t.user + t.system,
            caller_s=time.thread_time(),
            wall_s=time.perf_counter(),
        )

    def start(self) -> None:
        """Begin the window (on the thread that runs the loop: it is ``training``)."""
        self._caller = threading.get_native_id()
        self._start = self.snapshot()

    def stop(self, steps: int) -> dict[str, Any] | None:
        """CPU ms per step by thread group over the window (``steps`` steps), the
        process total, the wall ms per step and ``cpu_over_wall`` (process CPU / wall:
        near or above 1 with the GIL means the Python threads are saturated)."""
        a, b = self._start, self.snapshot()
        self._start = None
        if a is None or b is None or steps <= 0 or b.wall_s <= a.wall_s:
            return None
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
        groups: dict[str, float] = {}
        other: list[tuple[float, int, str, bool]] = []  # (cpu s, tid, kernel name, new)
        with _EXITED_LOCK:
            exited = {t: _EXITED.pop(t) for t in list(_EXITED) if t in a.threads}
        for tid, (pyname, _) in exited.items():
            # a joined thread can still have its /proc entry for a moment after join()
            # returns (the kernel clears the join futex before it unlinks the task), but
            # threading no longer lists it: keep the role it noted on exit
            names.setdefault(tid, pyname)
        for tid, (kname, cpu) in b.threads.items():
            if tid == self._caller:
                continue  # measured finely below
            prev = a.threads.get(tid, (kname, 0.0))[1]
            g = thread_group(kname, names.get(tid, ""), False)
            groups[g] = groups.get(g, 0.0) + (cpu - prev)
            if g == "other" and cpu > prev:
                other.append((cpu - prev, tid, kname, tid not in a.threads))
        for tid, (pyname, cpu) in exited.items():  # ended inside the window
            if tid not in b.threads:
                g = thread_group(a.threads[tid][0], pyname, False)
                groups[g] = groups.get(g, 0.0) + max(0.0, cpu - a.threads[tid][1])
        groups["training"] = b.caller_s - a.caller_s
        per = 1e3 / steps
        wall = (b.wall_s - a.wall_s) * per
        process = (b.process_s - a.process_s) * per
        return {
            "steps": int(steps),
            "wall_ms_per_step": wall,
            "process_cpu_ms_per_step": process,
            "cpu_over_wall": process / wall if wall > 0 else float("nan"),
            "by_group_ms_per_step": {k: v * per for k, v in sorted(groups.items())},
            # the busiest threads of no known role (library threads: OpenMP, CUDA, NCCL,
            # the profiler's): kernel name, ms per step, created inside the window
            "other_threads_top": [
                {"tid": tid, "kernel_name": kn, "ms_per_step": c * per, "new": new}
                for c, tid, kn, new in sorted(other, reverse=True)[:_TOP_OTHER]
            ],
        }


class GilProbe:
    """Lateness of a thread's wake-ups: how long a Python thread waits for the
    interpreter lock (plus the OS timer's slack). ``start()`` launches a daemon thread
    that sleeps ``period_ms`` in a loop; ``stop()`` ends it and returns the wake count,
    the mean, the 50th / 90th / 99th percentiles and the maximum lateness in ms, and the
    share of wakes later than 1 ms. Cost: one wake (a few microseconds of CPU with the
    lock) per period."""

    def __init__(self, period_ms: float = 2.0) -> None:
        if not period_ms > 0:
            raise ValueError(f"period_ms must be positive, got {period_ms}")
        self.period_s = period_ms / 1e3
        self._late: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        late, period, stop = self._late, self.period_s, self._stop
        clock = time.perf_counter
        while not stop.is_set():
            t0 = clock()
            time.sleep(period)
            late.append(clock() - t0 - period)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("GilProbe already started")
        self._late.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="freescale-gil-probe", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any] | None:
        """The statistics since :meth:`start`; None if it was not started or never woke."""
        th, self._thread = self._thread, None
        if th is None:
            return None
        self._stop.set()
        th.join()
        late = sorted(max(0.0, x) * 1e3 for x in self._late)
        if not late:
            return None

        def pct(q: float) -> float:
            return late[min(len(late) - 1, max(0, math.ceil(q * len(late)) - 1))]

        return {
            "period_ms": self.period_s * 1e3,
            "wakes": len(late),
            "mean_ms": sum(late) / len(late),
            "p50_ms": pct(0.50),
            "p90_ms": pct(0.90),
            "p99_ms": pct(0.99),
            "max_ms": late[-1],
            "share_over_1ms": sum(1 for x in late if x > 1.0) / len(late),
        }
