"""Fused sparse optimizers applied by the owner of each embedding row.

Owns the optimizer state of one rank's shard (a single ``[rows, D]`` weight tensor
that holds all of the rank's local table rows) and the per-row update arithmetic:

* ``sgd``:              ``w -= lr * g``                                  (fbgemm EXACT_SGD)
* ``rowwise_adagrad``:  ``s += mean(g^2)``; ``w -= lr / (sqrt(s) + eps) * g``
                        (fbgemm EXACT_ROWWISE_ADAGRAD)
* ``adam``:             ``m = b1 m + (1-b1) g``; ``v = b2 v + (1-b2) g^2``;
                        ``w -= lr * (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)``

``g`` is the summed gradient of the row in one step (embedding/reduce.py), ``t`` the
1-based index of the step that produced it. Tier 1 condition (ii): a row's arithmetic
never depends on how many rows one call holds, so the row mean of ``g^2`` is a fixed
pairwise tree of element-wise adds rather than a library reduction (whose blocking can
change with the number of rows). Weight decay, when set, is decoupled (``w -= lr*wd*w``).

Row-wise Adagrad also has a Triton version of the same arithmetic, rounding for rounding
(`kernels.sparse_optim`, the default on CUDA; ``FREESCALE_SPARSE_OPTIM=reference`` keeps
these PyTorch ops); for it, the
reference's two device-dependent steps are pinned down: the division by D is a
multiplication by its rounded reciprocal (CUDA's arithmetic for a number divisor) and
the square root is correctly rounded on CPU too (`sqrt_rn`).
"""

from __future__ import annotations

import functools
import os

import torch

from ..config import SparseOptimConfig

__all__ = ["FusedSparseOptimizer", "row_mean_fixed_order", "sqrt_rn", "SPARSE_OPTIM_ENV_VAR"]

# auto (Triton on CUDA, the default) | reference (the PyTorch ops below) | triton
# (forced, any device: the interpreter tests). `auto` became the default at b87503d+
# after the 1-GPU e2e on an H200 gave the reference's eval NE bits in vanilla and
# freescale (benchmarks/results/e2e_1gpu_optim_{auto,ref}_b87503d.*).
SPARSE_OPTIM_ENV_VAR = "FREESCALE_SPARSE_OPTIM"
SPARSE_OPTIM_DEFAULT = "auto"


def row_mean_fixed_order(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of ``[U, D]`` by a fixed pairwise tree (zero-padded to 2^k), then
    times the reciprocal of D rounded to x's dtype."""
    d = x.shape[1]
    width = 1
    while width < d:
        width *= 2
    if width != d:
        x = torch.cat([x, x.new_zeros(x.shape[0], width - d)], dim=1)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    # times the correctly rounded reciprocal of D in x's dtype: what CUDA computes for a
    # Python-number divisor, spelled out so that the CPU (which divides) does the same
    return x[:, 0] * _reciprocal(d, x.dtype)


@functools.lru_cache(maxsize=64)
def _reciprocal(d: int, dtype: torch.dtype) -> float:
    """1 / d rounded once to ``dtype`` (a Python float, exact in that dtype)."""
    return float(torch.ones((), dtype=dtype) / torch.full((), d, dtype=dtype))


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root on every device: CUDA's ``torch.sqrt`` is; the
    CPU build's vectorised float32 ``sqrt`` is not always (measured: ~15% of random
    inputs off by one ulp), so float32 on CPU goes through float64 (exact rounding:
    53 >= 2 * 24 + 2 bits). The fused CUDA update (`kernels.sparse_optim`) uses IEEE
    ``sqrt_rn`` too, so the CPU tests compare the same arithmetic."""
    if x.dtype == torch.float32 and not x.is_cuda:
        return torch.sqrt(x.double()).float()
    return torch.sqrt(x)


class FusedSparseOptimizer:
    """Optimizer state and update for one shard's weight tensor."""

    def __init__(self, cfg: SparseOptimConfig, weight: torch.Tensor) -> None:
        self.cfg = cfg
        self.weight = weight
        rows = weight.shape[0]
        self.state: dict[str, torch.Tensor] = {}
        if cfg.kind == "rowwise_adagrad":
            self.state["sum_sq"] = torch.zeros(rows, dtype=weight.dtype, device=weight.device)
        elif cfg.kind == "adam":
            self.state["exp_avg"] = torch.zeros_like(weight)
            self.state["exp_avg_sq"] = torch.zeros_like(weight)

    def step(
        self,
        rows: torch.Tensor,
        grad: torch.Tensor,
        step: int,
        lr: float | None = None,
        *,
        unique_rows: bool = False,
    ) -> None:
        """Apply the update for local ``rows`` with summed ``grad`` produced by the
        1-based global ``step`` at learning rate ``lr`` (default: the configured one). A
        row listed twice must carry the same gradient both times (the padded update);
        ``unique_rows=True`` promises it is not listed twice (the fused CUDA update then
        runs in place, one launch)."""
        if rows.numel() == 0:
            return
        cfg = self.cfg
        lr = cfg.lr if lr is None else lr
        if self._fused(grad):
            from freescale.kernels.sparse_optim import rowwise_adagrad_triton

            rowwise_adagrad_triton(
                self.weight, self.state["sum_sq"], rows, grad, lr, cfg.eps, unique_rows=unique_rows
            )
            return
        w = self.weight.index_select(0, rows)
        grad = grad.to(w.dtype)
        if cfg.kind == "sgd":
            # one rounding (w + (-lr) * g fused), as fbgemm's EXACT_SGD
            new_w = torch.add(w, grad, alpha=-lr)
        elif cfg.kind == "rowwise_adagrad":
            s = self.state["sum_sq"].index_select(0, rows) + row_mean_fixed_order(grad * grad)
            self.state["sum_sq"].index_copy_(0, rows, s)
            mult = lr / (sqrt_rn(s) + cfg.eps)  # = (sqrt(s) + eps).reciprocal() * lr
            new_w = w - mult.unsqueeze(1) * grad
        else:  # adam
            if step < 1:
                raise ValueError(f"Adam needs a 1-based step index, got {step}")
            m = self.state["exp_avg"].index_select(0, rows)
            v = self.state["exp_avg_sq"].index_select(0, rows)
            m = cfg.beta1 * m + (1.0 - cfg.beta1) * grad
            v = cfg.beta2 * v + (1.0 - cfg.beta2) * (grad * grad)
            self.state["exp_avg"].index_copy_(0, rows, m)
            self.state["exp_avg_sq"].index_copy_(0, rows, v)
            bc1 = 1.0 - cfg.beta1**step
            bc2 = 1.0 - cfg.beta2**step
            new_w = w - lr * (m / bc1) / (torch.sqrt(v / bc2) + cfg.eps)
        if cfg.weight_decay:
            new_w = new_w - lr * cfg.weight_decay * w
        self.weight.index_copy_(0, rows, new_w)

    def _fused(self, grad: torch.Tensor) -> bool:
        """Whether this update runs as the Triton kernel (`kernels.sparse_optim`: one
        launch for unique rows, two otherwise; the same bits): row-wise Adagrad without
        weight decay on a float32 shard, with ``FREESCALE_SPARSE_OPTIM=auto`` (the
        default) on CUDA or ``=triton`` on any device (on CPU under
        ``TRITON_INTERPRET=1``: the tests); ``reference`` keeps PyTorch."""
        mode = os.environ.get(SPARSE_OPTIM_ENV_VAR, SPARSE_OPTIM_DEFAULT)
        if mode not in ("auto", "reference", "triton"):
            raise ValueError(
                f"{SPARSE_OPTIM_ENV_VAR} must be auto, reference or triton, got {mode!r}"
            )
        w = self.weight
        if not (w.dtype == torch.float32 and w.is_contiguous() and grad.dim() == 2):
            return False
        if self.cfg.kind != "rowwise_adagrad" or self.cfg.weight_decay:
            return False
        return mode == "triton" or (mode == "auto" and w.is_cuda)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            if k not in self.state:
                raise KeyError(f"unexpected sparse optimizer state '{k}' for {self.cfg.kind}")
            self.state[k].copy_(v)
