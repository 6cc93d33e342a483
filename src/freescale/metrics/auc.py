"""ROC AUC of binary predictions: exact, streaming, and merged across ranks.

Owns the AUC computation and its evaluation buffer. Two implementations of the same
number:

* ``reference_auc``: our own, sort-based. Samples are sorted by score; tied scores form
  one threshold, so a tied (positive, negative) pair counts one half -- the trapezoid
  through the ROC points at every distinct score, exactly what torchmetrics' exact
  (``thresholds=None``) ``BinaryAUROC`` computes. With no positives or no negatives it
  returns 0.0, as torchmetrics does. Sample weights are supported.
* torchmetrics' ``binary_auroc`` (the functional form of ``BinaryAUROC``), used when
  torchmetrics is installed and no weights were given.

:class:`AUCAccumulator` keeps scores and labels (a bounded buffer: evaluation sets are
small) and gathers every rank's buffer through a
:class:`~freescale.comm.base.Communicator` for ``compute``. AUC is invariant to the
order of samples, so streaming, sharded and one-shot computations agree. This module
does not touch model state or process groups directly.
"""

from __future__ import annotations

import importlib.util

import torch

from freescale.comm.base import Communicator
from freescale.metrics._dist import all_gather_varlen

__all__ = ["HAVE_TORCHMETRICS", "reference_auc", "auc", "AUCAccumulator"]

HAVE_TORCHMETRICS = importlib.util.find_spec("torchmetrics") is not None


def reference_auc(
    scores: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> float:
    """Exact ROC AUC (ties count one half), float64. Scores may be logits or
    probabilities (AUC only depends on their order); labels are 0/1."""
    s = scores.detach().reshape(-1).double()
    y = labels.detach().reshape(-1).double()
    if s.shape != y.shape:
        raise ValueError(f"scores have {s.numel()} entries, labels {y.numel()}")
    w = torch.ones_like(s) if weights is None else weights.detach().reshape(-1).double()
    if s.numel() == 0:
        return 0.0
    order = torch.argsort(s, descending=True)
    s, y, w = s[order], y[order], w[order]
    # last index of every group of tied scores: one ROC point per distinct score
    last = torch.nonzero(s[1:] != s[:-1]).reshape(-1)
    last = torch.cat([last, last.new_tensor([s.numel() - 1])])
    tps = torch.cumsum(y * w, 0)[last]
    fps = torch.cumsum((1.0 - y) * w, 0)[last]
    zero = tps.new_zeros(1)
    tps, fps = torch.cat([zero, tps]), torch.cat([zero, fps])
    if tps[-1] <= 0 or fps[-1] <= 0:
        return 0.0  # one class only: torchmetrics returns 0 (with a warning)
    tpr, fpr = tps / tps[-1], fps / fps[-1]
    return float(torch.trapezoid(tpr, fpr).item())


def _torchmetrics_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    import warnings

    from torchmetrics.functional.classification import binary_auroc

    s = scores.detach().reshape(-1).double()
    if s.numel() and (s.min() < 0 or s.max() > 1):
        # torchmetrics would apply a sigmoid, which saturates for large logits and turns
        # distinct scores into ties; map scores to their dense rank in [0, 1] instead
        # (same order, same ties, so the same AUC)
        _, rank = torch.unique(s, sorted=True, return_inverse=True)
        s = rank.double() / max(1, int(rank.max().item()))
    y = labels.detach().reshape(-1).long()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # one-class warning: returns 0
        return float(binary_auroc(s, y, thresholds=None, validate_args=False).item())


def auc(
    scores: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    backend: str = "auto",
) -> float:
    """ROC AUC. ``backend``: ``"torchmetrics"``, ``"reference"`` or ``"auto"``
    (torchmetrics if installed and unweighted, else the reference)."""
    if backend not in ("auto", "torchmetrics", "reference"):
        raise ValueError(f"unknown AUC backend {backend!r}")
    if backend == "torchmetrics" and weights is not None:
        raise ValueError("torchmetrics' BinaryAUROC takes no sample weights")
    use_tm = backend == "torchmetrics" or (
        backend == "auto" and HAVE_TORCHMETRICS and weights is None
    )
    if use_tm:
        return _torchmetrics_auc(scores, labels)
    return reference_auc(scores, labels, weights)


class AUCAccumulator:
    """Buffers (score, label[, weight]) for an exact AUC over an evaluation set.

    ``max_samples`` bounds the buffer on each rank; exceeding it raises (AUC over a
    subsample would silently change the metric). ``compute(comm)`` gathers every
    rank's buffer (collective) and computes one AUC over the union.
    """

    def __init__(self, max_samples: int = 1 << 22, backend: str = "auto") -> None:
        self.max_samples = int(max_samples)
        self.backend = backend
        self._scores: list[torch.Tensor] = []
        self._labels: list[torch.Tensor] = []
        self._weights: list[torch.Tensor] = []
        self._weighted: bool | None = None
        self.num_samples = 0

    def reset(self) -> None:
        self._scores, self._labels, self._weights = [], [], []
        self._weighted = None
        self.num_samples = 0

    def update(
        self,
        scores: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Add a batch of scores (logits or probabilities) and 0/1 labels. Stays on
        the inputs' device; no host synchronisation."""
        s = scores.detach().reshape(-1).double()
        y = labels.detach().reshape(-1).double()
        if s.shape != y.shape:
            raise ValueError(f"scores have {s.numel()} entries, labels {y.numel()}")
        weighted = weights is not None
        if self._weighted is not None and weighted != self._weighted:
            raise ValueError("either every update passes weights or none does")
        if self.num_samples + s.numel() > self.max_samples:
            raise ValueError(
                f"AUC buffer holds at most {self.max_samples} samples per rank "
                f"({self.num_samples} + {s.numel()} requested); raise max_samples"
            )
        self._weighted = weighted
        self._scores.append(s)
        self._labels.append(y)
        if weights is not None:
            w = weights.detach().reshape(-1).double()
            if w.shape != s.shape:
                raise ValueError(f"weights have {w.numel()} entries, scores {s.numel()}")
            self._weights.append(w)
        self.num_samples += s.numel()

    def _local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        if not self._scores:
            e = torch.zeros(0, dtype=torch.float64)
            return e, e.clone(), (e.clone() if self._weighted else None)
        s = torch.cat(self._scores)
        y = torch.cat(self._labels)
        w = torch.cat(self._weights) if self._weighted else None
        return s, y, w

    def compute(self, comm: Communicator | None = None, name: str = "metrics.auc") -> float:
        """AUC over this rank's buffer, or over every rank's when ``comm`` is given
        (collective: all ranks call it; every rank gets the same value)."""
        s, y, w = self._local()
        if comm is not None and comm.world_size > 1:
            # agree on whether weights are present (a rank may have seen no data)
            flag = torch.tensor([1.0 if self._weighted else 0.0], dtype=torch.float64)
            flags = all_gather_varlen(comm, flag, f"{name}.weighted")
            weighted = any(float(f.item()) > 0 for f in flags)
            if weighted and w is None:
                if s.numel():
                    raise ValueError("some ranks passed weights to the AUC, this one did not")
                w = s.new_zeros(0)
            s = torch.cat(all_gather_varlen(comm, s, f"{name}.scores"))
            y = torch.cat(all_gather_varlen(comm, y, f"{name}.labels"))
            if weighted:
                assert w is not None
                w = torch.cat(all_gather_varlen(comm, w, f"{name}.weights"))
        return auc(s, y, w, backend=self.backend)
