"""Cost model and AutoTune of the sequence load balancer (the *cost model* role).

Owns: :class:`CostModel` (per-sample and per-rank predicted dense cost, least-squares
fit with non-negative coefficients from measured per-rank dense times, JSON file
round trip) and :class:`AutoTune` (deterministic search over the VBS exponent
``alpha`` from measured per-rank step times; checkpointable state).

The model: a rank holding samples of (effective) sequence lengths ``L_i`` costs

    cost = a * sum(L_i) + b * sum(L_i ** 2) + c        (milliseconds when fitted)

i.e. ``a * L + b * L**2`` per sample plus ``c`` per rank (``tokens`` and ``sum_sq``
below are the two sums). Before a fit the default is ``L ** alpha`` per sample with
no constant. Everything here is a deterministic function of its inputs, so ranks that
feed it the same all-gathered measurements (in the same order) agree bit for bit; the
caller gathers, this module never communicates. It sees numbers only: no tensors,
no ranks, no batches.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = [
    "CostModel",
    "AutoTuneConfig",
    "AutoTune",
    "DEFAULT_COST_MODEL",
    "fit_nonnegative",
]


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares ``min |x @ w - y|`` subject to ``w >= 0`` for a few columns.

    Exact: every subset of columns is solved by ``lstsq`` (columns scaled to unit norm
    for conditioning) and the best feasible solution wins (ties: fewer columns, then
    subset order). Cost O(2^k) small solves; meant for k <= 4.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    k = x.shape[1]
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    best_w = np.zeros(k)
    best_r = float(np.sum(y * y))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = list(cols)
            w_sub, *_ = np.linalg.lstsq(xs[:, sub], y, rcond=None)
            if (w_sub < 0).any():
                continue
            r = float(np.sum((xs[:, sub] @ w_sub - y) ** 2))
            if r < best_r * (1 - 1e-12):
                best_r = r
                best_w = np.zeros(k)
                best_w[sub] = w_sub
    return best_w / norms


@dataclass
class CostModel:
    """``a * tokens + b * sum(L^2) + c`` per rank once fitted; ``sum(L^alpha)`` before.

    ``fitted`` says which of the two is in use. Coefficients are non-negative, so
    per-sample costs never decrease with length (partitioners may sort by length).
    """

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    alpha: float = 1.5
    fitted: bool = False
    fit_error: float | None = None  # relative RMSE of the last fit
    num_fit_samples: int = 0

    # ------------------------------------------------------------------ predict
    def sample_costs(self, lengths: np.ndarray, alpha: float | None = None) -> np.ndarray:
        """Per-sample cost (float64): ``a*L + b*L^2`` if fitted, else ``L^alpha``."""
        lf = np.asarray(lengths, dtype=np.float64)
        if self.fitted:
            return self.a * lf + self.b * (lf * lf)
        al = self.alpha if alpha is None else alpha
        if al == 1.0:
            return lf.copy()
        if al == 2.0:
            return lf * lf
        return np.power(lf, al)

    @property
    def per_rank_constant(self) -> float:
        return self.c if self.fitted else 0.0

    def rank_cost(self, tokens: np.ndarray | float, sum_sq: np.ndarray | float) -> np.ndarray:
        """Fitted per-rank cost from the two sums (the fit's own features)."""
        return (
            self.a * np.asarray(tokens, np.float64)
            + self.b * np.asarray(sum_sq, np.float64)
            + self.c
        )

    def monotone(self, alpha: float | None = None) -> bool:
        """True when per-sample cost never decreases with length (always, by design)."""
        al = self.alpha if alpha is None else alpha
        return (self.a >= 0 and self.b >= 0) if self.fitted else al >= 0

    # ---------------------------------------------------------------------- fit
    def fit(self, samples: Iterable[Sequence[float]], *, intercept: bool = True) -> float:
        """Fit ``(a, b, c) >= 0`` to ``[(tokens, sum_sq, measured_ms), ...]``.

        Returns the relative RMSE ``sqrt(mean((pred - ms)^2)) / mean(ms)`` and switches
        the model to the fitted form. Deterministic: same samples in the same order give
        the same coefficients. Needs at least 3 samples.
        """
        arr = np.asarray(list(samples), dtype=np.float64).reshape(-1, 3)
        if arr.shape[0] < 3:
            raise ValueError(f"cost model fit needs >= 3 measurements, got {arr.shape[0]}")
        if not np.isfinite(arr).all() or (arr < 0).any():
            raise ValueError("cost model measurements must be finite and non-negative")
        tokens, sum_sq, ms = arr[:, 0], arr[:, 1], arr[:, 2]
        cols = [tokens, sum_sq] + ([np.ones_like(ms)] if intercept else [])
        w = fit_nonnegative(np.stack(cols, axis=1), ms)
        self.a, self.b = float(w[0]), float(w[1])
        self.c = float(w[2]) if intercept else 0.0
        self.fitted = True
        pred = self.rank_cost(tokens, sum_sq)
        mean = float(ms.mean())
        err = float(np.sqrt(np.mean((pred - ms) ** 2)) / mean) if mean > 0 else 0.0
        self.fit_error = err
        self.num_fit_samples = int(arr.shape[0])
        return err

    # ---------------------------------------------------------------- serialise
    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> CostModel:
        """From ``to_dict`` output or a bare ``{"a": .., "b": .., "c": ..}`` fit file
        (which counts as fitted)."""
        known = {k: d[k] for k in ("a", "b", "c", "alpha", "fitted", "fit_error") if k in d}
        if "num_fit_samples" in d:
            known["num_fit_samples"] = d["num_fit_samples"]
        if "fitted" not in known:
            known["fitted"] = all(k in d for k in ("a", "b"))
        for k in ("a", "b", "c"):
            if k in known and float(known[k]) < 0:
                raise ValueError(f"cost model coefficient {k} must be >= 0, got {known[k]}")
        return CostModel(**known)

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)

    @staticmethod
    def load(path: str) -> CostModel:
        with open(path) as f:
            return CostModel.from_dict(json.load(f))


# Illustrative defaults (milliseconds) for the simulator: a transformer-like layer stack
# whose quadratic attention term equals the linear term at L = a / b = 1536 tokens
# (~6 d for d = 256). Not measured on any machine: fit your own (``CostModel.fit``).
DEFAULT_COST_MODEL = CostModel(a=1.0e-4, b=1.0e-4 / 1536, c=0.5, fitted=True)


# ---------------------------------------------------------------------- AutoTune
@dataclass
class AutoTuneConfig:
    """Bounded multiplicative search over ``alpha`` (see :class:`AutoTune`)."""

    alpha: float = 1.5  # starting exponent
    alpha_min: float = 0.5
    alpha_max: float = 3.0
    step: float = 0.1  # log-step: alpha *= exp(+-step)
    shrink: float = 0.5  # step *= shrink whenever the direction flips
    min_step: float = 0.005
    window: int = 1  # measured steps averaged per decision
    tolerance: float = 0.01  # straggler share below which alpha is left alone

    def __post_init__(self) -> None:
        if not 0 < self.alpha_min <= self.alpha <= self.alpha_max:
            raise ValueError("need 0 < alpha_min <= alpha <= alpha_max")
        if not (self.step > 0 and 0 < self.shrink < 1 and self.window >= 1):
            raise ValueError("need step > 0, 0 < shrink < 1, window >= 1")


@dataclass
class _AutoTuneState:
    alpha: float
    step: float
    direction: int = 0
    acc_signal: float = 0.0
    acc_straggler: float = 0.0
    acc_count: int = 0
    updates: int = 0
    history: list[float] = field(default_factory=list)


class AutoTune:
    """Tunes the VBS weight exponent ``alpha`` (``w = L^alpha``) from measured times.

    Input per step: every rank's measured dense time (all-gathered, identical on all
    ranks) and every rank's mean sample length under the plan that ran. Signal: the
    covariance across non-empty ranks between ``log(mean length)`` and ``time / max``.
    Positive means ranks of long samples are the stragglers, so ``L^alpha``
    under-weights long samples: raise alpha. Negative: lower it. Every ``window``
    steps, if the mean straggler share exceeds ``tolerance``, alpha moves one
    multiplicative step in that direction (clipped to ``[alpha_min, alpha_max]``);
    a flip of direction shrinks the step (a bracketing search), down to ``min_step``.
    Pure arithmetic on the inputs: deterministic; ``state_dict`` for checkpoints.
    """

    def __init__(self, config: AutoTuneConfig | None = None) -> None:
        self.config = config or AutoTuneConfig()
        self._s = _AutoTuneState(alpha=self.config.alpha, step=self.config.step)

    @property
    def alpha(self) -> float:
        return self._s.alpha

    @property
    def step_size(self) -> float:
        return self._s.step

    def update(self, rank_times: Sequence[float], rank_mean_lengths: Sequence[float]) -> float:
        """Feed one step's measurements; returns the (possibly new) alpha."""
        t = np.asarray(rank_times, dtype=np.float64)
        ln = np.asarray(rank_mean_lengths, dtype=np.float64)
        if t.shape != ln.shape:
            raise ValueError("rank_times and rank_mean_lengths need one entry per rank")
        ok = np.isfinite(t) & np.isfinite(ln) & (ln > 0)
        tmax = float(t[ok].max()) if ok.any() else 0.0
        s = self._s
        if ok.sum() >= 2 and tmax > 0:
            x = np.log(ln[ok])
            y = t[ok] / tmax
            signal = float(np.mean((x - x.mean()) * (y - y.mean())))
            strag = float((tmax - t[ok].mean()) / tmax)
            s.acc_signal += signal
            s.acc_straggler += strag
            s.acc_count += 1
        if s.acc_count < self.config.window:
            return s.alpha
        signal, strag = s.acc_signal / s.acc_count, s.acc_straggler / s.acc_count
        s.acc_signal = s.acc_straggler = 0.0
        s.acc_count = 0
        s.updates += 1
        if strag <= self.config.tolerance or signal == 0.0:
            return s.alpha
        direction = 1 if signal > 0 else -1
        if s.direction and direction != s.direction:
            s.step = max(s.step * self.config.shrink, self.config.min_step)
        s.direction = direction
        cfg = self.config
        s.alpha = float(
            min(max(s.alpha * math.exp(direction * s.step), cfg.alpha_min), cfg.alpha_max)
        )
        s.history.append(s.alpha)
        if len(s.history) > 256:
            del s.history[:-256]
        return s.alpha

    def state_dict(self) -> dict:
        return {"config": asdict(self.config), "state": asdict(self._s)}

    def load_state_dict(self, state: dict) -> None:
        self.config = AutoTuneConfig(**state["config"])
        self._s = _AutoTuneState(**state["state"])
