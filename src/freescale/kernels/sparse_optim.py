"""Triton fast path of the owner's row-wise Adagrad update (`embedding.optim`).

Owns one kernel: for each unique local row r with summed gradient g (one step),

    s      = sum_sq[r] + tree_mean(g * g)
    mult   = reciprocal(sqrt(s) + eps) * lr
    w[r]   = w[r] - mult * g

in one launch for unique rows, two otherwise (all reads and the arithmetic, then the
writes), where the optimizer's
PyTorch path (`embedding.optim.FusedSparseOptimizer` with ``FREESCALE_SPARSE_OPTIM=
reference``) runs ~20 ops (gathers, the 7-level column tree, the arithmetic, two
scatters).
Bit-for-bit the same arithmetic, rounding step by rounding step:

* ``tree_mean`` is `embedding.optim.row_mean_fixed_order`: zero-pad the columns to a
  power of two, repeatedly add the right half to the left half, then multiply by 1 / D
  rounded to float32 (PyTorch's CUDA division by a number);
* ``lr / t`` in PyTorch is ``t.reciprocal() * lr`` (``Tensor.__rtruediv__``): two
  roundings, kept here; Python floats (lr, eps) are rounded to the weight's dtype first,
  as PyTorch does with a scalar operand;
* every division and square root is IEEE round-to-nearest (``tl.div_rn``,
  ``tl.sqrt_rn``; Triton's defaults are approximate on NVIDIA GPUs), and the launch
  disables floating-point contraction (``enable_fp_fusion=False``), so no multiply and
  add is fused into one FMA that PyTorch's separate kernels round twice.

As in PyTorch's ``index_select`` ... ``index_copy_`` sequence, every read comes before
any write: a row may be listed more than once when every listing carries the same
gradient (the padded update repeats its last row), and then each write stores the same
bits. (One launch that read and wrote would let a later program read a row another
one had already updated.) Within one program too, every load precedes every store: the
in-place launch has a barrier between them, since the row values are replicated across
warps and a lagging warp would otherwise read a state another warp had just stored.
On CPU tensors this module needs ``TRITON_INTERPRET=1`` set before triton is first
imported (tests); `benchmarks/check_sparse_update_cuda.py` compares it with the
reference bit for bit on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freescale.kernels.common import cdiv, next_power_of_2

__all__ = ["rowwise_adagrad_triton"]


@triton.jit
def _entries(rows_ptr, n_rows, dim, BR: tl.constexpr, WIDTH: tl.constexpr):
    """This program's entries i (and mask), their shard rows r, the columns c of a padded
    row and the [entry, column] mask."""
    i = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    im = i < n_rows
    r = tl.load(rows_ptr + i, mask=im, other=0).to(tl.int64)
    c = tl.arange(0, WIDTH)
    return i, im, r, c, im[:, None] & (c < dim)[None, :]


@triton.jit(do_not_specialize=["n_rows", "dim"])
def _rowwise_adagrad_kernel(
    w_ptr,
    s_ptr,
    rows_ptr,
    g_ptr,
    new_w_ptr,
    new_s_ptr,
    n_rows,
    dim,
    lr,
    eps,
    BR: tl.constexpr,
    WIDTH: tl.constexpr,
    LOG_WIDTH: tl.constexpr,
    IN_PLACE: tl.constexpr,
    BARRIER: tl.constexpr,
):
    """Entries [pid * BR, (pid + 1) * BR) of the update; WIDTH = D padded to a power of
    2; ``lr`` and ``eps`` arrive as float32 scalars. IN_PLACE (rows known unique): the
    new row and state are stored to the shard; otherwise to ``new_w`` [n, D] / ``new_s``
    [n] in entry order, for `_write_rows_kernel` (reads never see a write)."""
    i, im, r, c, m2 = _entries(rows_ptr, n_rows, dim, BR, WIDTH)
    g = tl.load(g_ptr + i[:, None] * dim + c[None, :], mask=m2, other=0.0)
    w = tl.load(w_ptr + r[:, None] * dim + c[None, :], mask=m2, other=0.0)
    # the column tree: x[:, :half] + x[:, half:] until one column (padding adds +0.0)
    x = g * g
    for lvl in tl.static_range(LOG_WIDTH):
        pair = tl.reshape(x, [BR, 2, WIDTH >> (lvl + 1)])  # [row, (left, right), j]
        pair = tl.permute(pair, (0, 2, 1))
        left, right = tl.split(pair)
        x = left + right
    total = tl.reshape(x, [BR])
    dt = g.dtype
    mean = total * tl.div_rn(tl.full([BR], 1.0, dt), tl.full([BR], dim, dt))
    s = tl.load(s_ptr + r, mask=im, other=0.0) + mean
    if IN_PLACE and BARRIER:
        # all of this program's loads (w above, s here) before any of its stores: a
        # row's state is loaded by every warp (the 1-D row values are replicated across
        # warps) but stored by one, and a warp still in the column tree could otherwise
        # read the state another warp had already updated (found on the H200: the 1-GPU
        # e2e NE moved from run to run, even with CUDA_LAUNCH_BLOCKING=1)
        tl.debug_barrier()
    if IN_PLACE:
        tl.store(s_ptr + r, s, mask=im)
    else:
        tl.store(new_s_ptr + i, s, mask=im)
    den = tl.sqrt_rn(s) + tl.full([BR], eps, dt)
    mult = tl.div_rn(tl.full([BR], 1.0, dt), den) * tl.full([BR], lr, dt)
    upd = mult[:, None] * g
    if IN_PLACE:
        tl.store(w_ptr + r[:, None] * dim + c[None, :], w - upd, mask=m2)
    else:
        tl.store(new_w_ptr + i[:, None] * dim + c[None, :], w - upd, mask=m2)


@triton.jit(do_not_specialize=["n_rows", "dim"])
def _write_rows_kernel(
    w_ptr, s_ptr, rows_ptr, new_w_ptr, new_s_ptr, n_rows, dim, BR: tl.constexpr,
    WIDTH: tl.constexpr,
):  # fmt: skip
    """``w[rows[i]] = new_w[i]``, ``s[rows[i]] = new_s[i]``: the writes, after every read
    of the first kernel (a row listed twice gets the same values twice)."""
    i, im, r, c, m2 = _entries(rows_ptr, n_rows, dim, BR, WIDTH)
    x = tl.load(new_w_ptr + i[:, None] * dim + c[None, :], mask=m2, other=0.0)
    tl.store(w_ptr + r[:, None] * dim + c[None, :], x, mask=m2)
    tl.store(s_ptr + r, tl.load(new_s_ptr + i, mask=im, other=0.0), mask=im)


def rowwise_adagrad_triton(
    weight: torch.Tensor,
    sum_sq: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    eps: float,
    *,
    unique_rows: bool = False,
    barrier: bool = True,
) -> None:
    """In place: the row-wise Adagrad update of `embedding.optim` (without weight
    decay) for ``rows`` with summed ``grad`` [len(rows), D] (a repeated row must repeat
    its gradient, as in the padded update; ``unique_rows=True`` promises no repeats and
    updates in place in one launch); ``weight`` [R, D]
    and ``sum_sq`` [R] contiguous float32 (Triton passes Python floats as float32, which
    is what PyTorch rounds them to for a float32 tensor; float64 stays on the
    reference). ``barrier=False`` drops the in-place launch's barrier between the
    loads and the stores: only for the GPU check's mutant (a race, see the kernel)."""
    if weight.dtype != torch.float32 or sum_sq.dtype != torch.float32:
        raise TypeError(
            f"rowwise_adagrad_triton: weight and state must be float32, got "
            f"{weight.dtype} / {sum_sq.dtype}"
        )
    if not (weight.is_contiguous() and sum_sq.is_contiguous()) or weight.dim() != 2:
        raise ValueError("rowwise_adagrad_triton: weight [R, D] and sum_sq [R] must be contiguous")
    n, dim = rows.numel(), weight.shape[1]
    if grad.shape != (n, dim):
        raise ValueError(f"rowwise_adagrad_triton: grad {tuple(grad.shape)} != ({n}, {dim})")
    if n == 0:
        return
    g = grad.to(torch.float32).contiguous()
    width = next_power_of_2(max(dim, 1))
    br = max(1, min(64, 4096 // width))  # ~4K elements per program
    rows = rows.contiguous()
    if unique_rows:
        new_w, new_s = weight, sum_sq  # not written (IN_PLACE)
    else:
        new_w = torch.empty_like(g)
        new_s = torch.empty(n, dtype=torch.float32, device=g.device)
    grid = (cdiv(n, br),)
    _rowwise_adagrad_kernel[grid](
        weight, sum_sq, rows, g, new_w, new_s, n, dim, float(lr), float(eps),
        BR=br, WIDTH=width, LOG_WIDTH=width.bit_length() - 1, IN_PLACE=unique_rows,
        BARRIER=barrier, enable_fp_fusion=False,
    )  # fmt: skip
    if not unique_rows:
        _write_rows_kernel[grid](weight, sum_sq, rows, new_w, new_s, n, dim, BR=br, WIDTH=width)
