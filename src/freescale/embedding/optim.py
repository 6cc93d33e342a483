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
"""

from __future__ import annotations

import torch

from ..config import SparseOptimConfig

__all__ = ["FusedSparseOptimizer", "row_mean_fixed_order"]


def row_mean_fixed_order(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 1 of ``[U, D]`` by a fixed pairwise tree (zero-padded to 2^k)."""
    d = x.shape[1]
    width = 1
    while width < d:
        width *= 2
    if width != d:
        x = torch.cat([x, x.new_zeros(x.shape[0], width - d)], dim=1)
    while x.shape[1] > 1:
        half = x.shape[1] // 2
        x = x[:, :half] + x[:, half:]
    return x[:, 0] / d


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
        self, rows: torch.Tensor, grad: torch.Tensor, step: int, lr: float | None = None
    ) -> None:
        """Apply the update for unique local ``rows`` with summed ``grad`` produced by the
        1-based global ``step`` at learning rate ``lr`` (default: the configured one)."""
        if rows.numel() == 0:
            return
        cfg = self.cfg
        lr = cfg.lr if lr is None else lr
        w = self.weight.index_select(0, rows)
        grad = grad.to(w.dtype)
        if cfg.kind == "sgd":
            # one rounding (w + (-lr) * g fused), as fbgemm's EXACT_SGD
            new_w = torch.add(w, grad, alpha=-lr)
        elif cfg.kind == "rowwise_adagrad":
            s = self.state["sum_sq"].index_select(0, rows) + row_mean_fixed_order(grad * grad)
            self.state["sum_sq"].index_copy_(0, rows, s)
            mult = lr / (torch.sqrt(s) + cfg.eps)
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for k, v in state.items():
            if k not in self.state:
                raise KeyError(f"unexpected sparse optimizer state '{k}' for {self.cfg.kind}")
            self.state[k].copy_(v)
