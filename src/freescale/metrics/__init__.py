"""Training and evaluation metrics: NE / log loss / calibration, AUC, throughput.

Owns metric arithmetic and the reduction of metric state across ranks (through a
:class:`~freescale.comm.base.Communicator`). It never touches model state or the loss
used for training.
"""

from freescale.metrics.auc import HAVE_TORCHMETRICS, AUCAccumulator, auc, reference_auc
from freescale.metrics.host_cpu import ThreadCpuMeter
from freescale.metrics.ne import (
    ETA,
    NEAccumulator,
    NEResult,
    compute_ne,
    cross_entropy_bits,
    normalized_entropy,
)
from freescale.metrics.qps import Rates, ThroughputMeter

__all__ = [
    "ETA",
    "NEAccumulator",
    "NEResult",
    "compute_ne",
    "cross_entropy_bits",
    "normalized_entropy",
    "HAVE_TORCHMETRICS",
    "AUCAccumulator",
    "auc",
    "reference_auc",
    "Rates",
    "ThreadCpuMeter",
    "ThroughputMeter",
]
