"""Small all-gathers between ranks of one host through shared memory (no gloo round trip).

Owns :class:`ShmExchange`: the handshakes of the copy-engine backend (a header
all-gather and an error-flag all-reduce per collective, ``comm/copy_engine.py`` steps 3
and 6) through one small ``/dev/shm`` file instead of two gloo collectives. On the dev
box the two gloo handshakes were 0.85 of a 1.06 ms copy-engine call
(``benchmarks/results/gloo_host_devbox.json`` has gloo's small-op latency); here an
exchange is a few stores, a poll and a copy.

Semantics: ``exchange(values)`` on every rank of the group, in the same order, returns
the ``(world, n)`` int64 matrix whose row ``r`` is rank ``r``'s ``values`` — exactly
``torch.stack(all_gather(values))`` (tested against gloo's). Every rank must pass the
same length ``n <= max_len``; a mismatch raises on every rank.

Protocol. The file holds, per rank, two slots (alternating by call parity) of
``[seq, n, pid, values...]``. Call ``k`` writes the values, then the length and pid,
then ``seq = k`` (last); a reader waits until every peer's slot of parity ``k % 2``
says ``seq == k`` and copies the rows. A slot is rewritten only at call ``k + 2``,
which a rank can reach only after every peer published call ``k + 1`` — i.e. after
every peer finished reading call ``k``. Store order: x86-64 keeps stores in program
order and loads in program order (TSO), which the protocol relies on; on other
architectures :func:`available` says no and the copy engine keeps gloo.

Errors, never a hang: a wait longer than ``timeout_s`` raises :class:`TimeoutError`
naming the ranks that did not arrive; a peer whose process is gone (its pid, checked
every ~50 ms while waiting) raises at once, naming it.
"""

from __future__ import annotations

import os
import platform
import socket
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["ShmExchange", "ShmUnavailable", "available"]

_HEAD = 3  # seq, n, pid


class ShmUnavailable(RuntimeError):
    """The shared-memory file could not be created or mapped on some rank; raised alike
    on every rank (the caller may fall back to gloo on every rank)."""


def available() -> tuple[bool, str]:
    """Whether this host can run the protocol (x86-64 store order, a writable tmpfs)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False, f"{platform.machine()}: the protocol relies on x86-64 store ordering"
    if not hasattr(os, "kill"):
        return False, "no os.kill to check the peers' liveness"
    return True, ""


def _shm_dir() -> str:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class ShmExchange:
    """Collective constructor over the gloo group ``pg`` (ranks of one host): rank 0
    creates the file, every rank maps it, rank 0 unlinks it once all have."""

    def __init__(
        self,
        pg: dist.ProcessGroup,
        rank: int,
        world: int,
        max_len: int,
        timeout_s: float = 300.0,
        name: str = "exchange",
    ) -> None:
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        self.rank, self.world, self.max_len = rank, world, max_len
        self.timeout_s = float(timeout_s)
        self.name = name
        self._k = 0
        width = _HEAD + max_len
        nbytes = world * 2 * width * 8
        # every rank reaches every collective below whatever fails, and all raise alike
        path, err = None, None
        if rank == 0:
            try:
                path = os.path.join(_shm_dir(), f"freescale-xchg-{uuid.uuid4().hex[:16]}")
                with open(path, "wb") as fh:
                    fh.truncate(nbytes)
            except OSError as e:
                path, err = None, e
        paths: list[Any] = [None] * world
        dist.all_gather_object(paths, (path, socket.gethostname()), group=pg)
        path = paths[0][0]
        hosts = {h for _, h in paths}
        if len(hosts) > 1:  # the file is only shared within one host
            if rank == 0 and path is not None:
                os.unlink(path)
            raise ShmUnavailable(f"{name}: the ranks span hosts {sorted(hosts)}")
        mm = None
        if path is not None:
            try:
                mm = np.memmap(path, dtype=np.int64, mode="r+", shape=(world, 2, width))
            except (OSError, ValueError) as e:
                err = e
        oks: list[Any] = [None] * world
        dist.all_gather_object(oks, err is None and mm is not None, group=pg)  # all mapped
        if rank == 0 and path is not None:
            os.unlink(path)
        if not all(oks):
            bad = [r for r, ok in enumerate(oks) if not ok]
            raise ShmUnavailable(f"{name}: shared-memory file unavailable on ranks {bad}: {err!r}")
        assert mm is not None
        self._mm = mm
        self.exchanges = 0  # calls made (tests; counters)

    def exchange(self, values: list[int] | torch.Tensor, what: str = "") -> torch.Tensor:
        """All-gather of ``values`` (int64, the same length on every rank)."""
        v = np.asarray(values.tolist() if isinstance(values, torch.Tensor) else values, np.int64)
        n = int(v.size)
        if n > self.max_len:
            raise ValueError(f"{self.name}: {n} values > max_len {self.max_len}")
        self._k += 1
        k, p = self._k, self._k % 2
        mine = self._mm[self.rank, p]
        mine[_HEAD : _HEAD + n] = v
        mine[1] = n
        mine[2] = os.getpid()
        mine[0] = k  # last: the slot is published
        self._wait(k, p, what)
        rows = self._mm[:, p]
        lengths = rows[:, 1]
        if not (lengths == n).all():
            raise RuntimeError(
                f"{self.name} {what}: ranks passed different lengths {lengths.tolist()}"
            )
        self.exchanges += 1
        return torch.from_numpy(np.array(rows[:, _HEAD : _HEAD + n]))

    def _wait(self, k: int, p: int, what: str) -> None:
        seq = self._mm[:, p, 0]
        deadline = time.monotonic() + self.timeout_s
        next_check = time.monotonic() + 0.05
        spins, pause = 0, 2e-6
        while True:
            missing = np.flatnonzero(seq != k)
            if missing.size == 0:
                return
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(
                    f"{self.name} {what} timed out after {self.timeout_s} s: ranks "
                    f"{missing.tolist()} of {self.world} did not arrive (call {k})"
                )
            if now > next_check:
                next_check = now + 0.05
                self._check_alive(missing, what)
            spins += 1
            if spins < 50:
                time.sleep(0)
            else:
                time.sleep(pause)
                pause = min(pause * 2, 100e-6)

    def _check_alive(self, missing: np.ndarray, what: str) -> None:
        """A peer's pid (published with its previous calls) that no longer exists."""
        for r in missing.tolist():
            pid = int(max(self._mm[r, 0, 2], self._mm[r, 1, 2]))
            if pid <= 0 or r == self.rank:
                continue
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(
                    f"{self.name} {what}: rank {r} (pid {pid}) is gone; it did not arrive"
                ) from None
            except PermissionError:  # alive, another user
                pass

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            del self._mm
