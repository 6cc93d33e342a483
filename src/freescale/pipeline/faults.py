"""Collective timeouts, lost ranks and a test-only fault injector.

Owns :class:`FaultMonitor` (installed on a :class:`~freescale.pipeline.trainer.Trainer`
by :func:`install`), the errors it raises (:class:`CollectiveTimeout`,
:class:`RankLost`, both :class:`~freescale.comm.base.CollectiveError`), the
``--resume`` rule for elastic restarts (:func:`resume_point`) and the fault injector
(:class:`FaultInjector`, read from ``FREESCALE_FAULT_*`` environment variables; tests
only). See docs/faults.md.

How it works, per rank:

* **Configured timeout.** ``dist.new_group()`` ignores ``init_process_group``'s
  timeout (gloo's groups default to 30 minutes), so :func:`install` sets the trainer's
  embedding and metadata groups to the configured timeout (on NCCL to timeout + grace,
  so that the monitor, not NCCL's watchdog, reports first).
* **Progress heartbeat.** ``comm.base.on_issue`` tags every issued collective with a
  per-rank sequence number, the step and the stage (a Python attribute write, no I/O).
  A daemon thread publishes ``{seq, step, stage, collective, time}`` to the
  ``torch.distributed`` store (``freescale/hb/<rank>``) when it changes — at most once
  per ``min_gap`` seconds (20 ms: a step issues 10-20 collectives, and every publish
  takes the interpreter lock and a store round trip away from the threads that launch
  GPU work; the record a peer reads is at most ``min_gap`` older than the last change)
  — and every ``interval`` seconds. Nothing is written on the training thread.
* **Diagnosis.** When a collective fails (``comm.base.on_error``) or the watchdog sees
  the last issued collective incomplete after the timeout, the monitor reads every
  rank's heartbeat: ranks whose sequence number is behind this collective's did not
  arrive; ranks whose heartbeat stopped are dead. The error raised on the caller's
  thread names the collective, the step, the missing ranks and where they were last
  seen, e.g. ``all_to_all 'grads' on rank 0 of 2 (gloo) timed out after 10 s at step 3
  (backward): rank 1 did not arrive (last seen: all_reduce 'input_ok' of step 3 (data),
  12.0 s ago, heartbeat alive)``.
* **Watchdog backstop.** If the training thread is still blocked ``grace`` seconds
  after the deadline (NCCL: the CPU waits in a CUDA sync and cannot raise), the
  watchdog prints the diagnosis to stderr and ends the process with exit code
  :data:`EXIT_COLLECTIVE_TIMEOUT`.
* **Terminated by the launcher.** torch's elastic agent SIGTERMs the surviving ranks
  as soon as it sees one rank die (its monitor tick, 0.5 s in ``freescale train``),
  often before a survivor reaches a collective with the dead rank, and then the
  survivor printed nothing. :func:`install` (where SIGTERM still has its default action
  and no wakeup fd is set) gives SIGTERM a do-nothing Python handler plus a wakeup fd
  read by a reporter thread, so the report does not wait for the training thread (on
  NCCL it may sit in a CUDA sync): the thread prints the diagnosis (``RankLost:
  terminated by SIGTERM at step 3 (backward): rank 1 was lost (...)`` when a peer is
  dead) and ends the process with exit code :data:`EXIT_TERMINATED` (128 + SIGTERM).
  A SIGTERM handler installed later (e.g. checkpoint on preemption) takes over: the
  thread then does nothing. Forked children get the default action back
  (:func:`_sigterm_after_fork_in_child`).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..comm import base as comm_base
from ..comm.base import Awaitable, CollectiveError
from .trainer import Trainer, TrainerHook

__all__ = [
    "EXIT_COLLECTIVE_TIMEOUT",
    "EXIT_TERMINATED",
    "CollectiveTimeout",
    "RankLost",
    "FaultMonitor",
    "FaultInjector",
    "install",
    "resume_point",
    "explain",
    "init_after_elastic_restart",
]

#: exit code of a process ended by the watchdog backstop
EXIT_COLLECTIVE_TIMEOUT = 75
#: exit code of a process ended by SIGTERM after its report (the shell's 128 + 15)
EXIT_TERMINATED = 128 + int(signal.SIGTERM)
_KEY = "hb/"
_HOST = socket.gethostname()
_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "nccl communicator was aborted",
)
_TIMEOUT_MARKERS = ("timed out", "timeout")


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the configured timeout; the message names
    it, the step and the ranks that did not arrive."""


class RankLost(CollectiveError):
    """A collective failed because a peer's connection was lost (the rank crashed or
    was killed); the message names the collective and the rank(s) lost."""


@dataclass
class _Progress:
    seq: int = 0
    step: int = 0
    stage: str = "start"
    what: str = ""  # "all_to_all 'grads'"


class FaultMonitor(TrainerHook):
    """Per-rank heartbeat, collective diagnosis and watchdog (see module docstring).

    Use :func:`install`; one monitor is active per process."""

    def __init__(
        self,
        timeout_s: float,
        rank: int,
        world_size: int,
        backend: str,
        store: Any = None,
        interval: float = 0.25,
        grace: float | None = None,
        min_gap: float = 0.02,
        hard_exit: bool = True,
        deadline_s: float | None = None,
        report_sigterm: bool = False,
    ) -> None:
        self.timeout_s = float(timeout_s)
        self.deadline_s = float(deadline_s) if deadline_s is not None else self.timeout_s
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.interval = interval
        if not 0 <= min_gap <= interval:
            raise ValueError(f"min_gap must be in [0, interval={interval}], got {min_gap}")
        self.min_gap = min_gap
        self.publishes = 0  # heartbeat records written (tests; the rate limit)
        self.grace = grace if grace is not None else min(10.0, max(2.0, 0.5 * timeout_s))
        self.hard_exit = hard_exit
        self.report_sigterm = report_sigterm
        self.progress = _Progress()
        self.diagnosis: str | None = None  # set by the watchdog when it fired
        self._raised = False
        self._store = store  # the heartbeat thread's client
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        # the last issued collective: (works, description, tag). Strong references to
        # the Work objects, not to the Awaitable: on NCCL ``wait()`` returns as soon as
        # the streams are ordered and the caller drops the Awaitable, but the work may
        # still hang on the device (a weak reference died there and hid the hang).
        self._last: tuple[list[Any], str, Any] | None = None
        self._last_issued_at = 0.0
        self._threads: list[threading.Thread] = []
        self._t0 = time.time()
        self._sigterm_pipe: tuple[int, int] | None = None  # (read, write): the wakeup fd

    # ------------------------------------------------------------ lifecycle
    def start(self) -> FaultMonitor:
        if self._store is not None and self.world_size > 1:
            self._publish()
            t = threading.Thread(target=self._heartbeat, name="freescale-heartbeat", daemon=True)
            t.start()
            self._threads.append(t)
        if self.world_size > 1:
            t = threading.Thread(target=self._watchdog, name="freescale-watchdog", daemon=True)
            t.start()
            self._threads.append(t)
        comm_base.on_issue = self._on_issue
        comm_base.on_error = self._on_error
        if self.backend == "gloo":
            comm_base.wait_timeout = datetime.timedelta(seconds=self.timeout_s)
        if self.report_sigterm:
            self._install_sigterm()
        return self

    def close(self) -> None:
        if comm_base.on_issue == self._on_issue:
            comm_base.on_issue = None
        if comm_base.on_error == self._on_error:
            comm_base.on_error = None
            comm_base.wait_timeout = None
        self._stop.set()
        self._changed.set()
        self._restore_sigterm()
        for t in self._threads:
            t.join(timeout=2.0)
        self._threads = []

    # ----------------------------------------------------------- progress
    def _set(self, step: int, stage: str) -> None:
        p = self.progress
        if p.step != step or p.stage != stage:
            p.step, p.stage = step, stage
            self._changed.set()

    def on_train_start(self, trainer: Trainer) -> None:
        self._set(trainer.step + 1, "start")

    passes_batch = True

    def on_batch(self, trainer: Trainer, step: int, batch: Any) -> Any:
        self._set(trainer.step + 1, "data+forward")
        return batch

    def after_forward(self, trainer: Trainer, step: int, loss: Any) -> None:
        self._set(step, "backward")

    def after_backward(self, trainer: Trainer, step: int) -> None:
        self._set(step, "optimizer")

    def after_optimizer(self, trainer: Trainer, step: int) -> None:
        self._set(step, "metrics")

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._set(trainer.step, "end")

    def _on_issue(self, aw: Awaitable[Any]) -> None:
        p = self.progress
        p.seq += 1
        what = _short(aw)
        p.what = what
        aw._fs_tag = (p.seq, p.step, p.stage, what)  # type: ignore[attr-defined]
        self._last = (list(aw._works), aw._describe or _short(aw), aw._fs_tag)  # type: ignore[attr-defined]
        self._last_issued_at = time.monotonic()
        self._changed.set()

    # ------------------------------------------------------------- store
    def _record(self) -> dict[str, Any]:
        p = self.progress
        return {
            "seq": p.seq,
            "step": p.step,
            "stage": p.stage,
            "what": p.what,
            "t": time.time(),
            "pid": os.getpid(),
            "host": _HOST,
        }

    def _publish(self) -> None:
        rec = json.dumps(self._record())
        with self._lock:
            self._store.set(f"{_KEY}{self.rank}", rec)
        self.publishes += 1

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(self.interval)
            self._changed.clear()
            try:
                self._publish()
            except Exception:  # noqa: BLE001 - the store may be gone at shutdown
                if self._stop.is_set():
                    return
                time.sleep(self.interval)
            # rate limit: changes during the gap set the event and are published right
            # after it (the latest state; intermediate ones are not needed by a peer)
            if self.min_gap > 0:
                self._stop.wait(self.min_gap)

    def _stale_after(self) -> float:
        return max(4 * self.interval, 1.0)

    def _dead(self, peers: dict[int, dict[str, Any] | None], now: float) -> dict[int, str]:
        """Which of ``peers`` are dead, and why: the process is gone (same host) or the
        heartbeat stopped (older than :meth:`_stale_after`)."""
        dead: dict[int, str] = {}
        for r, rec in peers.items():
            if rec is None:
                continue
            if rec.get("host") == _HOST and not _pid_alive(int(rec["pid"])):
                dead[r] = f"process {rec['pid']} has exited"
            elif now - rec["t"] > self._stale_after():
                dead[r] = f"heartbeat stopped {now - rec['t']:.1f} s ago"
        return dead

    def read_peers(self, lock_timeout: float = -1) -> dict[int, dict[str, Any] | None]:
        """Every other rank's last heartbeat (None: never published / unreadable, or the
        store client stayed busy for ``lock_timeout`` seconds; -1: wait)."""
        out: dict[int, dict[str, Any] | None] = {}
        if self._store is None:
            return out
        for r in range(self.world_size):
            if r == self.rank:
                continue
            key = f"{_KEY}{r}"
            out[r] = None
            if not self._lock.acquire(timeout=lock_timeout):
                continue
            try:
                ok = self._store.check([key])
                out[r] = json.loads(self._store.get(key)) if ok else None
            except Exception:  # noqa: BLE001
                pass
            finally:
                self._lock.release()
        return out

    # --------------------------------------------------------- diagnosis
    def diagnose(self, tag: tuple[int, int, str, str] | None, lost: bool = False) -> str:
        """Which ranks did not arrive at the collective tagged ``tag`` (this rank's
        ``(seq, step, stage, what)``) and where they were last seen. ``lost``: a peer
        connection broke; dead ranks count as missing (found by pid on this host, else
        by a heartbeat that stops advancing within about a second)."""
        if self._store is None:
            return "no heartbeat store: cannot tell which ranks did not arrive"
        p = self.progress
        seq, step, stage = tag[:3] if tag else (p.seq, p.step, p.stage)
        mine = (step, _STAGES.get(stage, 0), seq)
        peers = self.read_peers()
        stale_after = self._stale_after()
        now = time.time()
        dead = self._dead(peers, now)
        behind = [r for r, rec in peers.items() if rec is None or _position(rec) < mine]
        if lost and not dead:
            # a killed process resets its connections while it exits, before it is a
            # zombie: give same-host peers a moment to show as exited
            local = [r for r, rec in peers.items() if rec is not None and rec.get("host") == _HOST]
            deadline = time.time() + stale_after
            while local and not dead and time.time() < deadline:
                time.sleep(0.05)
                for r in local:
                    if not _pid_alive(int(peers[r]["pid"])):
                        dead[r] = f"process {peers[r]['pid']} has exited"
        if lost and not dead and not behind:  # remote ranks: watch the heartbeats
            time.sleep(stale_after)
            later = self.read_peers()
            for r, rec in later.items():
                old = peers.get(r)
                if rec is not None and old is not None and rec["t"] == old["t"]:
                    dead[r] = f"heartbeat stopped {time.time() - rec['t']:.1f} s ago"
        missing = sorted(set(behind) | (set(dead) if lost else set()))
        if not missing:
            return "every rank had reached this collective (a peer failed inside it)"
        parts = []
        for r in missing:
            rec = peers.get(r)
            if rec is None:
                parts.append(f"rank {r} did not arrive (no heartbeat published)")
                continue
            state = f"dead: {dead[r]}" if r in dead else "alive"
            verb = "was lost" if (lost and r in dead and r not in behind) else "did not arrive"
            parts.append(_peer_line(r, verb, rec, now, state))
        return "; ".join(parts)

    def _on_error(self, aw: Awaitable[Any], exc: BaseException) -> CollectiveError:
        return self.make_error(aw._describe, getattr(aw, "_fs_tag", None), exc)

    def make_error(
        self, describe: str, tag: tuple[int, int, str, str] | None, exc: BaseException
    ) -> CollectiveError:
        """The error to raise for ``exc`` from the collective ``describe``/``tag``. Also
        printed to stderr at once: a launcher that saw a rank die may terminate this
        process before the exception reaches the top."""
        err = self._make_error(describe, tag, exc)
        self._raised = True  # the caller's thread has its error: no hard exit
        _say(f"[freescale rank {self.rank}] {type(err).__name__}: {err}")
        return err

    def _make_error(
        self, describe: str, tag: tuple[int, int, str, str] | None, exc: BaseException
    ) -> CollectiveError:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        low = str(exc).lower()
        at = f" at step {tag[1]} ({tag[2]})" if tag else f" at step {self.progress.step}"
        if self.diagnosis is not None:
            return CollectiveTimeout(f"{describe} timed out{at}: {self.diagnosis} [{msg}]")
        try:
            if any(m in low for m in _LOST_MARKERS):
                d = self.diagnose(tag, lost=True)
                return RankLost(
                    f"{describe} failed{at}: connection to a peer lost, the rank crashed or "
                    f"was killed: {d} [{self.backend}: {msg}]"
                )
            if any(m in low for m in _TIMEOUT_MARKERS):
                d = self.diagnose(tag)
                return CollectiveTimeout(
                    f"{describe} timed out after {self.timeout_s:g} s{at}: {d} "
                    f"[{self.backend}: {msg}]"
                )
        except Exception as e:  # noqa: BLE001 - never hide the original error
            msg += f" (diagnosis failed: {e})"
        return CollectiveError(f"{describe} failed{at}: {msg}")

    # ---------------------------------------------------------- watchdog
    def _watchdog(self) -> None:
        poll = min(1.0, max(0.05, self.deadline_s / 20))
        while not self._stop.wait(poll):
            last = self._last
            if last is None:
                continue
            works, describe, tag = last
            waited = time.monotonic() - self._last_issued_at
            if waited < self.deadline_s:
                continue
            try:
                completed = all(w.is_completed() for w in works)
            except Exception:  # noqa: BLE001 - a failed work: the caller raises
                completed = True
            if completed:
                continue
            try:
                self.diagnosis = self.diagnose(tag)
            except Exception as e:  # noqa: BLE001
                self.diagnosis = f"diagnosis failed: {e}"
            at = f" at step {tag[1]} ({tag[2]})" if tag else ""
            _say(
                f"[freescale rank {self.rank}] collective timeout: {describe} not "
                f"complete after {self.deadline_s:g} s{at}: {self.diagnosis}"
            )
            if self._stop.wait(self.grace) or not self.hard_exit or self._raised:
                return
            try:
                if all(w.is_completed() for w in works):
                    return
            except Exception:  # noqa: BLE001
                return
            _say(
                f"[freescale rank {self.rank}] still blocked {self.grace:g} s after the "
                f"deadline; exiting with code {EXIT_COLLECTIVE_TIMEOUT}"
            )
            os._exit(EXIT_COLLECTIVE_TIMEOUT)

    # ----------------------------------------------------------- SIGTERM
    def _install_sigterm(self) -> None:
        """The report on SIGTERM (module docstring, "Terminated by the launcher"): only
        from the main thread, only where SIGTERM has its default action and no other
        wakeup fd is set (asyncio's, say); otherwise nothing changes."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        r, w = os.pipe()
        os.set_blocking(w, False)  # the C-level handler must never block
        old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        if old != -1:
            signal.set_wakeup_fd(old)
            os.close(r)
            os.close(w)
            return
        signal.signal(signal.SIGTERM, _sigterm_noop)
        self._sigterm_pipe = (r, w)
        t = threading.Thread(
            target=self._sigterm_reporter, args=(r,), name="freescale-sigterm", daemon=True
        )
        t.start()
        self._threads.append(t)

    def _restore_sigterm(self) -> None:
        """Undo :meth:`_install_sigterm`. Only the main thread can: from another thread
        the handler and the reporter stay (SIGTERM still reports and ends the process)."""
        if self._sigterm_pipe is None:
            return
        if threading.current_thread() is not threading.main_thread():
            self._threads = [t for t in self._threads if t.name != "freescale-sigterm"]
            return
        w = self._sigterm_pipe[1]
        self._sigterm_pipe = None
        if signal.getsignal(signal.SIGTERM) is _sigterm_noop:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        current = signal.set_wakeup_fd(-1)
        if current != w:  # somebody else's since: theirs stays
            signal.set_wakeup_fd(current)
        os.close(w)  # the reporter reads what is left, then end of file, and returns

    def _sigterm_reporter(self, fd: int) -> None:
        try:
            while data := os.read(fd, 64):  # b"": _restore_sigterm closed the pipe
                if int(signal.SIGTERM) not in data:
                    continue  # another signal with a Python handler (SIGINT)
                handler = signal.getsignal(signal.SIGTERM)
                if handler is _sigterm_noop:
                    if not self._raised:  # a collective error already said it all
                        _say(f"[freescale rank {self.rank}] {self.sigterm_report()}")
                    try:
                        sys.stdout.flush()
                    except Exception:  # noqa: BLE001
                        pass
                    os._exit(EXIT_TERMINATED)
                if handler is signal.SIG_DFL:  # came while close() restored the default:
                    os.kill(os.getpid(), signal.SIGTERM)  # the do-nothing handler took it
                # else: a handler installed since (the user's) has it
        finally:
            os.close(fd)

    def sigterm_report(self) -> str:
        """What this rank says when it is terminated: where it was, and which peers are
        dead (torch's launcher terminates the survivors after one rank died), read
        without waiting more than a second for the store client."""
        p = self.progress
        last = f", last collective {p.what}" if p.what else ""
        head = f"terminated by SIGTERM at step {p.step} ({p.stage}{last})"
        if self._store is None or self.world_size < 2:
            return head
        peers = self.read_peers(lock_timeout=1.0)
        now = time.time()
        dead = self._dead(peers, now)
        if not dead:
            n = sum(rec is not None for rec in peers.values())
            return f"{head}: no peer found dead ({n} of {len(peers)} heartbeats read)"
        parts = []
        for r in sorted(dead):
            rec = peers[r]
            assert rec is not None  # _dead only names ranks with a record
            parts.append(_peer_line(r, "was lost", rec, now, f"dead: {dead[r]}"))
        return f"{RankLost.__name__}: {head}: " + "; ".join(parts)

    def explain(self, exc: BaseException) -> CollectiveError | None:
        """A clearer error for a backend failure raised outside ``Communicator`` (DDP's
        gradient all-reduce, a barrier); None when ``exc`` is not one (or is already a
        :class:`CollectiveError`)."""
        if isinstance(exc, CollectiveError):
            return None
        low = str(exc).lower()
        backend_err = isinstance(exc, getattr(dist, "DistBackendError", ())) or any(
            m in low for m in (*_LOST_MARKERS, *_TIMEOUT_MARKERS, "gloo", "nccl")
        )
        if not backend_err:
            return None
        p = self.progress
        describe = (
            f"collective during step {p.step} ({p.stage}, e.g. DDP's gradient all-reduce) "
            f"on rank {self.rank} of {self.world_size} ({self.backend})"
        )
        return self.make_error(describe, (p.seq, p.step, p.stage, ""), exc)


_STAGES = {"start": 0, "data+forward": 1, "backward": 2, "optimizer": 3, "metrics": 4, "end": 5}


def _position(rec: dict[str, Any]) -> tuple[int, int, int]:
    """How far a rank got: (step, stage, collectives issued), compared lexicographically."""
    return (int(rec["step"]), _STAGES.get(rec["stage"], 0), int(rec["seq"]))


def _peer_line(r: int, verb: str, rec: dict[str, Any], now: float, state: str) -> str:
    """One peer in a diagnosis: ``rank 1 was lost (last seen: all_to_all 'ids' of step 3
    (data+forward), 0.3 s ago; dead: process 4440 has exited)``."""
    where = f"{rec['what'] or 'no collective yet'} of step {rec['step']} ({rec['stage']})"
    return f"rank {r} {verb} (last seen: {where}, {now - rec['t']:.1f} s ago; {state})"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` (on this host) still runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _sigterm_noop(signum: int, frame: Any) -> None:
    """SIGTERM's Python handler while a monitor reports it: the report and the exit come
    from the monitor's reporter thread (woken through the wakeup fd), not from here."""


_fork_blocked = False  # SIGTERM blocked in the forking thread around an os.fork()


def _sigterm_before_fork() -> None:
    """Block SIGTERM in the forking thread while a monitor reports it: a SIGTERM that
    reaches the child before :func:`_sigterm_after_fork_in_child` ran would go to the
    do-nothing handler and write to the *parent's* wakeup pipe (the child inherits the
    fd), and the parent's reporter would end the parent. Blocked, it waits in the child
    until the default action is back."""
    global _fork_blocked
    if signal.getsignal(signal.SIGTERM) is _sigterm_noop:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        _fork_blocked = True


def _sigterm_after_fork_in_parent() -> None:
    global _fork_blocked
    if _fork_blocked:
        _fork_blocked = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _sigterm_after_fork_in_child() -> None:
    """A forked child (a DataLoader worker) inherits the do-nothing handler but not the
    reporter thread: give it SIGTERM's default action and no wakeup fd, then unblock."""
    global _fork_blocked
    if signal.getsignal(signal.SIGTERM) is _sigterm_noop:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
    if _fork_blocked:
        _fork_blocked = False
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


os.register_at_fork(
    before=_sigterm_before_fork,
    after_in_parent=_sigterm_after_fork_in_parent,
    after_in_child=_sigterm_after_fork_in_child,
)


def _short(aw: Awaitable[Any]) -> str:
    d = aw._describe or ""
    return d.split(" on rank ")[0] if " on rank " in d else (aw._name or "collective")


def _say(msg: str) -> None:
    try:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass


def _store() -> Any:
    """The default group's store under a ``freescale/<attempt>/`` prefix; None when there
    is none. (Not ``Store.clone()``: under torchrun a cloned client breaks the next
    elastic attempt's rendezvous. TCPStore clients serialise their operations.)"""
    try:
        st = dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"freescale/{attempt}", st)


def _set_timeout(group: Any, seconds: float) -> None:
    if group is None:
        return
    try:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds), group)
    except Exception as e:  # noqa: BLE001 - private API: degrade to the group default
        _say(f"[freescale] could not set a collective timeout on a group: {e}")


def install(trainer: Trainer, timeout_s: float, **kwargs: Any) -> FaultMonitor:
    """Apply ``timeout_s`` to the trainer's process groups, start the heartbeat and the
    watchdog and add the monitor to ``trainer.hooks``; called from the main thread, it
    also reports a SIGTERM (``report_sigterm``, module docstring). Call
    :meth:`FaultMonitor.close` when done."""
    if trainer.ctx.backend == "nccl":
        # NCCL's watchdog aborts the process at timeout_s with its own message; report
        # (and exit) a little earlier, while the group can still be diagnosed
        kwargs.setdefault("deadline_s", 0.8 * timeout_s)
        kwargs.setdefault("grace", 0.1 * timeout_s)
    kwargs.setdefault("report_sigterm", True)
    mon = FaultMonitor(
        timeout_s,
        trainer.rank,
        trainer.world_size,
        trainer.ctx.backend,
        store=_store() if trainer.world_size > 1 else None,
        **kwargs,
    )
    if trainer.world_size > 1:  # new_group() ignores init_process_group's timeout
        for comm in (trainer.emb_comm, trainer.meta_comm, trainer.data_comm):
            _set_timeout(comm.group, timeout_s)
    trainer.hooks.append(mon)
    return mon.start()


def explain(exc: BaseException) -> CollectiveError | None:
    """:meth:`FaultMonitor.explain` of the active monitor (None without one)."""
    fn = comm_base.on_error
    mon = getattr(fn, "__self__", None)
    return mon.explain(exc) if isinstance(mon, FaultMonitor) else None


# ------------------------------------------------------------- resume rule
def resume_point(resume: str | None, checkpoint_dir: str | None) -> str | None:
    """What ``--resume`` loads: ``resume`` itself, except that when it is the
    ``--checkpoint-dir`` of this run and holds no complete checkpoint yet (the first
    attempt of an elastic job, or a failure before the first save) training starts from
    scratch. Lets one torchrun command line serve every restart."""
    if not resume:
        return None
    if checkpoint_dir and os.path.abspath(resume) == os.path.abspath(checkpoint_dir):
        from .checkpoint import CheckpointError, resolve_checkpoint

        try:
            resolve_checkpoint(resume)
        except CheckpointError:
            return None
    return resume


def init_after_elastic_restart(device: str, timeout_s: float) -> bool:
    """Work around stale rendezvous keys after a torchrun restart (torch 2.13, gloo: the
    restarted workers read the previous attempt's addresses from the agent's store and
    fail in ``connectFullMesh``). In a restarted attempt (``TORCHELASTIC_RESTART_COUNT``
    > 0, agent store in use) initialise the default group on an attempt-prefixed view
    of the agent's store; return True when it did (the caller then owns the group).
    Backend and device follow :func:`~freescale.pipeline.distributed.init_distributed`."""
    env = os.environ
    if dist.is_initialized() or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return False
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or "MASTER_ADDR" not in env:
        return False
    import torch

    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    kwargs: dict[str, Any] = {}
    if use_cuda:
        torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    timeout = datetime.timedelta(seconds=timeout_s)
    agent = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        store=dist.PrefixStore(f"/freescale/attempt_{attempt}", agent),
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timeout,
        **kwargs,
    )
    return True


# ---------------------------------------------------------- fault injector
class FaultInjector(TrainerHook):
    """TEST ONLY. Kills or freezes one rank at one step, from environment variables:

    ``FREESCALE_FAULT_KILL_RANK_AT_STEP=R:K``  rank R sends itself SIGKILL after the
    forward of step K (mid-step: the embedding exchange is done, the gradient exchange
    is not).
    ``FREESCALE_FAULT_HANG_RANK_AT_STEP=R:K[:S]``  rank R sleeps S seconds (default
    3600) at the same point, so the others time out waiting for it.

    Both may be set (:meth:`all_from_env`): e.g. rank 1 killed while rank 0 sleeps, so
    that the launcher terminates rank 0 before it reaches a collective.

    Fires only in the first attempt of an elastic job (``TORCHELASTIC_RESTART_COUNT``
    unset or 0), so a restarted job runs clean."""

    def __init__(self, action: str, rank: int, step: int, seconds: float = 3600.0) -> None:
        self.action, self.rank, self.step, self.seconds = action, rank, step, seconds

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> FaultInjector | None:
        """The first of :meth:`all_from_env` (kill before hang), or None."""
        found = FaultInjector.all_from_env(env)
        return found[0] if found else None

    @staticmethod
    def all_from_env(env: dict[str, str] | None = None) -> list[FaultInjector]:
        """Every injector the environment asks for (none after an elastic restart)."""
        env = dict(os.environ) if env is None else env
        if env.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
            return []
        found = []
        for action in ("kill", "hang"):
            spec = env.get(f"FREESCALE_FAULT_{action.upper()}_RANK_AT_STEP")
            if spec:
                parts = spec.split(":")
                if len(parts) not in (2, 3) or (action == "kill" and len(parts) != 2):
                    raise ValueError(
                        f"FREESCALE_FAULT_{action.upper()}_RANK_AT_STEP={spec!r}: "
                        "expected RANK:STEP" + ("[:SECONDS]" if action == "hang" else "")
                    )
                secs = float(parts[2]) if len(parts) == 3 else 3600.0
                found.append(FaultInjector(action, int(parts[0]), int(parts[1]), secs))
        return found

    def after_forward(self, trainer: Trainer, step: int, loss: Any) -> None:
        if trainer.rank != self.rank or step != self.step:
            return
        _say(
            f"[freescale fault injector, test only] {self.action} rank {self.rank} "
            f"at step {step} (after forward)"
        )
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            time.sleep(self.seconds)
