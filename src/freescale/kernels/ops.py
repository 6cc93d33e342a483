"""Dispatcher for the jagged index ops: picks a backend per call and nothing else.

Owns: the public signatures of `ranged_dispatch`, `ranged_combine`,
`ranged_combine_backward`, `indexed_permute`, `keyed_transpose` and `gather_blocks`,
backend resolution (argument > ``$FREESCALE_KERNEL_BACKEND`` > device default: Triton on
CUDA, reference on CPU) and the autograd wiring of `ranged_combine`. Semantics live in
`reference.py`; triton is imported lazily, only when the Triton backend is chosen.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

from freescale.kernels import reference, vectorized
from freescale.kernels.common import Backend, DispatchMode, DispatchResult, resolve_backend

DISPATCH_ENV_VAR = "FREESCALE_TRITON_DISPATCH"
DISPATCH_VERSIONS = ("auto", "v1", "v2", "v3", "v4", "v5")
# "auto" (the default) dispatches with v4 from this many ids per call, v3 below: from the
# first id. Session 18 switched at 2^21 ids (v4 1.30x / 1.83x faster than v3 at 2^21,
# W = 8 / 1024, kernels.json at 87e7306), keeping v3 for one rank's ~1M ids, where
# do_bench timed both near 1:1; those times were the host's enqueue work. Device time
# alone (benchmarks/results/dispatch_host*.json, GPU held while the host enqueues): v4
# took 0.33-0.51x v3's time at ~1M ids for W = 8..1024, with as many or fewer launches.
V4_MIN_IDS = 1
V4_MAX_WORLD = (1 << 15) - 1  # triton_dispatch_v4.MAX_WORLD (not imported: triton is lazy)
# ... and with v5 (the Gluon shared-memory dispatch) from this many ids per unweighted
# call where v5 can run (compiled sm_90 CUDA, W <= V5_MAX_WORLD; v4 runs the other calls,
# the same bits). Measured on one H200 in three kernels.py runs (session 29: crossover
# rows of kernels_1dafde3.json, kernels_xover_c51a93f.json, kernels.json at 4e9af8e;
# v4 time / v5 time, do_bench): at 2^25 ids 1.26 / 0.89 / 1.27 at W = 8, 2.0-2.15 at
# W = 128 and 1024; at 2^26 ids 1.30x (W = 8) to 1.93x (W = 1024); at 2^24 0.84-1.20 at
# W = 8; at 2^22 0.30-0.94 except one 1.50 at W = 1024. v5's device time is the lower
# from 2^22 ids; its host work per call is 0.04-0.1 ms more, which do_bench sees below.
V5_MIN_IDS = 1 << 25
V5_MAX_WORLD = 4096  # triton_dispatch_v5.V5_MAX_WORLD


def triton_dispatch_version(num_ids: int, world_size: int = 1, *, weighted: bool = False) -> str:
    """The Triton dispatch kernel `ranged_dispatch` runs for a call with ``num_ids`` ids
    to ``world_size`` owners: ``$FREESCALE_TRITON_DISPATCH`` (v1, v2, v3, v4, v5) if set
    to one, else ("auto", also when unset or empty) v5 from `V5_MIN_IDS` ids on an
    unweighted call with ``world_size <= V5_MAX_WORLD``, v4 from `V4_MIN_IDS` ids and v3
    below or where v4 cannot run (world sizes above its `MAX_WORLD`, 32767). v5 (the
    Gluon shared-memory dispatch) runs where `triton_dispatch_v5.v5_supported` holds on a
    compiled call on an sm_90 CUDA device (`V5_CAPABILITY`); `ranged_dispatch` runs v4
    for the other calls (the interpreter, CPU tensors, ROCm, other GPUs): the same bits."""
    version = os.environ.get(DISPATCH_ENV_VAR, "auto") or "auto"
    if version not in DISPATCH_VERSIONS:
        raise ValueError(f"${DISPATCH_ENV_VAR}={version!r} is not one of {DISPATCH_VERSIONS}")
    if version == "auto":
        if num_ids >= V5_MIN_IDS and world_size <= V5_MAX_WORLD and not weighted:
            return "v5"
        return "v4" if num_ids >= V4_MIN_IDS and world_size <= V4_MAX_WORLD else "v3"
    return version


V5_CAPABILITY = (9, 0)  # v5's shared-memory budget (SMEM_LIMIT) and checks: H100/H200


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _cuda_name(device: torch.device) -> str:
    from freescale.kernels.triton_dispatch_v5 import device_name, table_name

    return table_name(device_name(device))  # picks v5's default table (H100 or H200)


def _v5_runs(values: torch.Tensor, world_size: int, weights: Optional[torch.Tensor]) -> bool:
    """Whether dispatch v5 can run this call: compiled (not interpreted) on an sm_90 CUDA
    device (the one it was checked and tuned on; its staging sizes assume 227 KiB of
    shared memory per program), inputs it supports (`triton_dispatch_v5.v5_supported`
    with its default config)."""
    interpreted = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if values.device.type != "cuda" or interpreted or torch.version.hip is not None:
        return False
    if _cuda_capability(values.device) != V5_CAPABILITY:
        return False
    from freescale.kernels.triton_dispatch_v5 import default_config_v5, v5_supported

    cfg = default_config_v5(world_size, _cuda_name(values.device))
    return v5_supported(world_size, weights, cfg)


def triton_dispatch_kernel(
    values: torch.Tensor, world_size: int, weights: Optional[torch.Tensor] = None
) -> str:
    """The dispatch kernel the Triton backend of `ranged_dispatch` runs for this call:
    `triton_dispatch_version`'s, except v4 where v5 was asked for and cannot run
    (`_v5_runs`: weights, W > 4096, not sm_90, CPU tensors, the interpreter; same bits)."""
    weighted = weights is not None
    version = triton_dispatch_version(values.numel(), world_size, weighted=weighted)
    if version == "v5" and not _v5_runs(values, world_size, weights):
        return "v4"
    return version


def _backend_module(backend: Backend, device: torch.device) -> ModuleType:
    name = resolve_backend(backend, device)
    if name == "triton":
        from freescale.kernels import triton_impl

        return triton_impl
    return vectorized if name == "vectorized" else reference


def ranged_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    *,
    mode: DispatchMode = "block",
    weights: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
) -> DispatchResult:
    """Bucket key-major jagged ids into `world_size` owner ranges (shard-major output).

    Semantics of fbgemm's ``block_bucketize_sparse_features(lengths, values,
    bucketize_pos=False, sequence=True, block_sizes, world_size, weights)``:
    `lengths` (K*B,) is [key][sample]; `block_sizes` (K,) rows per rank for each key.
    Block mode: id i of key k with blk = block_sizes[k] goes to owner i // blk as local
    row i - owner*blk if i < blk*W, else to owner i % W as local row i // W.
    Modulo mode: owner i % W, local i // W (block_sizes only gives K).
    Ids must be non-negative (not checked). See `DispatchResult` for the outputs.
    """
    impl = _backend_module(backend, values.device)
    version = triton_dispatch_kernel(values, world_size, weights)
    if impl.__name__.endswith("triton_impl") and version == "v5":
        from freescale.kernels.triton_dispatch_v5 import ranged_dispatch_v5

        return ranged_dispatch_v5(values, lengths, block_sizes, world_size, mode=mode)
    if impl.__name__.endswith("triton_impl") and version == "v4":
        # triton_dispatch_v4: no tile sort; bitwise equal to v3 and the reference on the
        # H200 at W = 1..1024 (benchmarks/check_kernels_cuda.py, benchmarks/kernels.py)
        from freescale.kernels.triton_dispatch_v4 import ranged_dispatch_v4

        return ranged_dispatch_v4(
            values, lengths, block_sizes, world_size, mode=mode, weights=weights
        )
    if impl.__name__.endswith("triton_impl") and version in ("v1", "v3"):
        # v3: v1's tile sort with the dest-major count scan (checked bitwise and timed on
        # an H200, 1.3-4.6x faster than v1); what "auto" runs where v4 cannot (W > 32767)
        return impl.ranged_dispatch_v1(
            values, lengths, block_sizes, world_size, mode=mode, weights=weights,
            dest_major=version == "v3",
        )  # fmt: skip
    return impl.ranged_dispatch(
        values, lengths, block_sizes, world_size, mode=mode, weights=weights
    )


class _RangedCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, unbucketize_permute, impl):  # noqa: D102
        ctx.save_for_backward(unbucketize_permute)
        ctx.impl = impl
        return impl.ranged_combine(rows, unbucketize_permute)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        (unbucketize_permute,) = ctx.saved_tensors
        return ctx.impl.ranged_combine_backward(grad.contiguous(), unbucketize_permute), None, None


def ranged_combine(
    rows: torch.Tensor, unbucketize_permute: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Rows received in shard-major order -> batch-major: ``out[i] = rows[perm[i]]``.

    `rows` is (N, ...) (e.g. (N, D) embeddings), `unbucketize_permute` the (N,) permutation
    from `ranged_dispatch`. Differentiable: the gradient is `ranged_combine_backward`.
    """
    impl = _backend_module(backend, rows.device)
    if rows.requires_grad and torch.is_grad_enabled():
        return _RangedCombine.apply(rows, unbucketize_permute, impl)
    return impl.ranged_combine(rows, unbucketize_permute)


def ranged_combine_backward(
    grad: torch.Tensor, unbucketize_permute: torch.Tensor, *, backend: Backend = "auto"
) -> torch.Tensor:
    """Batch-major gradients -> shard-major: ``out[perm[i]] = grad[i]`` (no accumulation)."""
    impl = _backend_module(backend, grad.device)
    return impl.ranged_combine_backward(grad, unbucketize_permute)


def gather_blocks(
    x: torch.Tensor,
    starts: torch.Tensor,
    sizes: torch.Tensor,
    out_size: int,
    *,
    out_offsets: Optional[torch.Tensor] = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Concatenate the blocks ``x[starts[j] : starts[j] + sizes[j]]`` of a 1-D ``x``
    (`reference.gather_blocks`). ``out_size`` = ``sizes.sum()`` and ``out_offsets`` =
    its exclusive scan (optional) come from the caller, so nothing syncs; with both,
    the Triton backend is one launch."""
    if x.dim() != 1:
        raise ValueError(f"gather_blocks takes a 1-D tensor, got shape {tuple(x.shape)}")
    impl = _triton_or_reference(backend, x.device)
    return impl.gather_blocks(x, starts, sizes, out_size, out_offsets)


def _triton_or_reference(backend: Backend, device: torch.device) -> ModuleType:
    """The module with the Triton kernels when ``backend`` resolves to Triton, else the
    reference (for ops the vectorised backend does not implement itself)."""
    impl = _backend_module(backend, device)
    return reference if impl is vectorized else impl


def indexed_permute(
    permute: torch.Tensor,
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    permuted_lengths_sum: Optional[int] = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """fbgemm's ``permute_2D_sparse_data``: row t of the output is row ``permute[t]``.

    `lengths` (T, B) row-major, `values`/`weights` (N,) in that order; `permute` (T',)
    may repeat or drop rows. Returns (lengths (T', B), values, weights or None).
    Pass `permuted_lengths_sum` (the output value count) to avoid a device sync.
    To shuffle samples, view lengths as (T*B, 1) and permute the T*B segments.
    """
    impl = _backend_module(backend, values.device)
    return impl.indexed_permute(permute, lengths, values, weights, permuted_lengths_sum)


def keyed_transpose(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: Optional[torch.Tensor] = None,
    *,
    batch_sizes: Optional[torch.Tensor] = None,
    num_keys: Optional[int] = None,
    inverse: bool = False,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """[rank][key][sample] <-> [key][rank][sample] for jagged data (TorchRec's "recat").

    Fixed batch: `lengths` (W, K, B) -> returns lengths (K, W, B) with values/weights
    reordered; calling it again on the result undoes it. Variable batch per rank:
    `lengths` 1-D as [rank w][key k][sample b < batch_sizes[w]], `num_keys` = K;
    returns [k][w][b]; ``inverse=True`` maps [k][w][b] back to [w][k][b]. No device sync.
    """
    impl = _backend_module(backend, values.device)
    return impl.keyed_transpose(
        lengths, values, weights, batch_sizes=batch_sizes, num_keys=num_keys, inverse=inverse
    )
