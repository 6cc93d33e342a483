"""Throughput meter: samples, candidates and tokens per second, lifetime and windowed.

Owns wall-clock rate bookkeeping on the host. It reads ``time.perf_counter`` only and
never synchronises a device: call :meth:`ThroughputMeter.step` at a point where the
step's work is known to be finished (e.g. after the loss was read back, or after the
trainer's step-end event), otherwise rates measure issue speed, not execution speed.
Counts are per rank; :meth:`ThroughputMeter.global_rates` sums them over ranks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from freescale.comm.base import Communicator
from freescale.metrics._dist import all_reduce_sum

__all__ = ["Rates", "ThroughputMeter"]


@dataclass(frozen=True)
class Rates:
    """Per-second rates over some interval (0 where the interval is empty)."""

    samples_per_s: float
    candidates_per_s: float
    tokens_per_s: float
    steps_per_s: float
    seconds: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _rates(a: tuple[float, ...], b: tuple[float, ...]) -> Rates:
    dt = b[0] - a[0]
    if dt <= 0:
        return Rates(0.0, 0.0, 0.0, 0.0, 0.0)
    d = [(y - x) / dt for x, y in zip(a[1:], b[1:])]
    return Rates(d[0], d[1], d[2], d[3], dt)


class ThroughputMeter:
    """Counts per step; rates over the last ``window`` steps and since ``start()``.

    The clock starts at construction (or at the last ``start()``, e.g. after warm-up
    steps). ``clock`` is injectable for tests.
    """

    def __init__(self, window: int = 20, clock: Callable[[], float] = time.perf_counter) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = int(window)
        self._clock = clock
        self.start()

    def start(self) -> None:
        """(Re)start the clock and clear all counts."""
        # points: (time, cumulative samples, candidates, tokens, steps)
        self._origin: tuple[float, ...] = (self._clock(), 0.0, 0.0, 0.0, 0.0)
        self._last = self._origin
        self._points: deque[tuple[float, ...]] = deque([self._origin], maxlen=self.window + 1)

    def step(
        self,
        samples: int,
        candidates: int = 0,
        tokens: int = 0,
        now: float | None = None,
    ) -> None:
        """Record one finished step with its counts (host integers)."""
        t = self._clock() if now is None else float(now)
        _, s, c, k, n = self._last
        self._last = (t, s + samples, c + candidates, k + tokens, n + 1)
        self._points.append(self._last)

    @property
    def totals(self) -> dict[str, float]:
        _, s, c, k, n = self._last
        return {"samples": s, "candidates": c, "tokens": k, "steps": n}

    def window_rates(self) -> Rates:
        """Rates over the last ``window`` steps."""
        return _rates(self._points[0], self._last)

    def lifetime_rates(self) -> Rates:
        """Rates since the last ``start()``."""
        return _rates(self._origin, self._last)

    def global_rates(self, comm: Communicator, name: str = "metrics.qps") -> Rates:
        """Lifetime rates of all ranks together: counts summed, time the slowest
        rank's (collective: every rank calls it)."""
        t0, s, c, k, n = self._last
        dt = t0 - self._origin[0]
        counts = torch.tensor([s, c, k], dtype=torch.float64)
        total = all_reduce_sum(comm, counts, f"{name}.counts")
        # the slowest rank's elapsed time: max via gathering one number per rank
        times = comm.all_gather(torch.tensor([dt], dtype=torch.float64), f"{name}.time").wait()
        span = max(float(x.item()) for x in times)
        if span <= 0:
            return Rates(0.0, 0.0, 0.0, 0.0, 0.0)
        return Rates(
            float(total[0]) / span, float(total[1]) / span, float(total[2]) / span, n / span, span
        )
