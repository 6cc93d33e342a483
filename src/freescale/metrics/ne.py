"""Normalized entropy (NE), log loss and calibration, computed as TorchRec does.

Owns the sufficient statistics of binary cross entropy and their reduction:

* ``ce_sum = sum_i w_i * (-y_i log2 p_i - (1 - y_i) log2 (1 - p_i))`` with ``p``
  clamped to ``[eta, 1 - eta]`` in float64 (TorchRec's ``compute_cross_entropy``),
* ``weighted_num_samples = sum w``, ``pos = sum w*y``, ``neg = sum w*(1-y)``,
* ``pred_sum = sum w*p`` (unclamped, for calibration, as TorchRec's calibration).

``NE = ce_sum / (-pos log2 m - neg log2 (1 - m))`` with ``m = pos / max(sum w, eta)``
clamped to ``[eta, 1 - eta]`` -- identical to ``torchrec.metrics.ne.compute_ne`` with
``eta = 1e-12``; i.e. mean BCE divided by the entropy of the mean label.
``logloss`` is reported in nats (equal to ``torch.nn.functional.binary_cross_entropy``'s
weighted mean for probabilities inside ``[eta, 1 - eta]``); TorchRec's ``LOG_LOSS``
is the same quantity in bits, i.e. ``logloss / ln 2``.
``calibration = pred_sum / pos`` (0 when ``pos <= 0``), as TorchRec.

Updates stay on the inputs' device and never synchronise with the host; only
``compute()`` reads values back. Cross-rank merging is one all-reduce of the five
statistics through a :class:`~freescale.comm.base.Communicator`. This module does
not touch model state, the loss used for training, or any process group directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from freescale.comm.base import Communicator
from freescale.metrics._dist import all_reduce_sum

__all__ = [
    "ETA",
    "NEResult",
    "NEAccumulator",
    "cross_entropy_bits",
    "compute_ne",
    "normalized_entropy",
]

ETA = 1e-12  # TorchRec's NEMetricComputation.eta

# state layout (float64)
_CE, _W, _POS, _NEG, _PRED = range(5)
_NUM_STATES = 5


def cross_entropy_bits(
    probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, eta: float = ETA
) -> torch.Tensor:
    """Per-sample weighted binary cross entropy in bits, float64, probabilities clamped
    to ``[eta, 1 - eta]`` (TorchRec's ``compute_cross_entropy``, without mutating the
    input)."""
    p = probs.double().clamp(min=eta, max=1 - eta)
    y = labels.double()
    w = weights.double()
    return -w * y * torch.log2(p) - w * (1.0 - y) * torch.log2(1.0 - p)


def compute_ne(
    ce_sum: torch.Tensor,
    weighted_num_samples: torch.Tensor,
    pos_labels: torch.Tensor,
    neg_labels: torch.Tensor,
    eta: float = ETA,
) -> torch.Tensor:
    """NE from the sufficient statistics (TorchRec's ``compute_ne``)."""
    mean_label = pos_labels.double() / weighted_num_samples.double().clamp(min=eta)
    mean_label = mean_label.clamp(min=eta, max=1 - eta)
    ce_norm = -pos_labels * torch.log2(mean_label) - neg_labels * torch.log2(1.0 - mean_label)
    return ce_sum / ce_norm


@dataclass(frozen=True)
class NEResult:
    """What :meth:`NEAccumulator.compute` returns (plain floats)."""

    ne: float
    logloss: float  # nats; TorchRec's LOG_LOSS (bits) = logloss / ln 2
    calibration: float  # sum(w*p) / sum(w*y); 0 when there are no positives
    num_samples: float  # sum of weights
    pos_labels: float
    neg_labels: float

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def _probs_from(
    logits: torch.Tensor | None, probs: torch.Tensor | None
) -> torch.Tensor:  # float64 probabilities
    if (logits is None) == (probs is None):
        raise ValueError("pass exactly one of logits= or probs=")
    if logits is not None:
        return torch.sigmoid(logits.detach().double())
    assert probs is not None
    return probs.detach().double()


class NEAccumulator:
    """Streaming NE / log loss / calibration.

    ``update`` adds a batch (logits or probabilities, labels in [0, 1], optional
    weights); ``merge(comm)`` sums the statistics of every rank (collective: all ranks
    call it); ``compute()`` returns an :class:`NEResult`. Empty accumulators compute
    NaN for NE and log loss.
    """

    def __init__(self, eta: float = ETA, device: torch.device | str | None = None) -> None:
        self.eta = float(eta)
        self._device = torch.device(device) if device is not None else None
        self._state: torch.Tensor | None = None

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> torch.Tensor:
        """The float64 ``[5]`` statistics: ce_sum (bits), sum w, pos, neg, sum w*p."""
        if self._state is None:
            self._state = torch.zeros(_NUM_STATES, dtype=torch.float64, device=self._device)
        return self._state

    def reset(self) -> None:
        self._state = None

    def update(
        self,
        *,
        labels: torch.Tensor,
        logits: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add one batch. Shapes of labels / predictions / weights must match (any
        shape; flattened). No host synchronisation."""
        p = _probs_from(logits, probs).reshape(-1)
        y = labels.detach().reshape(-1).double()
        if p.shape != y.shape:
            raise ValueError(f"predictions have {p.numel()} entries, labels {y.numel()}")
        w = torch.ones_like(y) if weights is None else weights.detach().reshape(-1).double()
        if w.shape != y.shape:
            raise ValueError(f"weights have {w.numel()} entries, labels {y.numel()}")
        if self._state is None and self._device is None:
            self._device = p.device
        ce = cross_entropy_bits(p, y, w, self.eta)
        batch = torch.stack(
            [ce.sum(), w.sum(), (w * y).sum(), (w * (1.0 - y)).sum(), (w * p).sum()]
        )
        self.state.add_(batch.to(self.state.device))

    def add_(self, other: NEAccumulator) -> NEAccumulator:
        """Local merge (e.g. of two evaluation shards on one rank)."""
        self.state.add_(other.state.to(self.state.device))
        return self

    def merge(self, comm: Communicator, name: str = "metrics.ne") -> NEAccumulator:
        """A new accumulator holding the sum over every rank of ``comm`` (one
        all-reduce). Collective: every rank must call it, in the same order."""
        out = NEAccumulator(eta=self.eta, device=self.state.device)
        out._state = all_reduce_sum(comm, self.state, name)
        return out

    # ---------------------------------------------------------------- compute
    def compute(self) -> NEResult:
        s = self.state.detach().cpu()
        ce, w, pos, neg, pred = (s[i] for i in range(_NUM_STATES))
        ne = compute_ne(ce, w, pos, neg, self.eta)
        labels_sum = (pos + neg).clamp(min=self.eta)  # TorchRec's compute_logloss
        logloss = ce / labels_sum * math.log(2.0)
        calibration = 0.0 if pos.item() <= 0.0 else (pred / pos).item()
        empty = w.item() == 0.0
        return NEResult(
            ne=float("nan") if empty else ne.item(),
            logloss=float("nan") if empty else logloss.item(),
            calibration=calibration,
            num_samples=w.item(),
            pos_labels=pos.item(),
            neg_labels=neg.item(),
        )


def normalized_entropy(
    labels: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    eta: float = ETA,
) -> NEResult:
    """One-shot NE / log loss / calibration of one set of predictions."""
    acc = NEAccumulator(eta=eta)
    acc.update(labels=labels, logits=logits, probs=probs, weights=weights)
    return acc.compute()
