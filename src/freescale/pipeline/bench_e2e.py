"""``freescale bench e2e``: every training mode side by side on the same data, one report.

Owns :func:`run_e2e` (called on every rank of an initialised process group: one
:class:`~freescale.pipeline.trainer.Trainer` per variant, all on the same config, data
and seed), :func:`write_report` (``e2e.json``, ``e2e.md``, ``e2e.png``) and
:func:`bench_e2e_main`, the command line, which launches local ranks the way
``freescale train`` does (torch's ``elastic_launch`` with the module-level entry point
:func:`bench_rank`).

Variants (:data:`VARIANTS`):

* ``vanilla``: the TorchRec-equivalent schedule, no balancing;
* ``vanilla_reordered``: vanilla with every rank's samples in a different (legal) order;
  its distance to ``vanilla`` is the NE noise floor (``ne_noise_floor``);
  ``vanilla_reordered_b``: a second such order (another seed): with both, the floor is
  the larger of the two distances (one sample of the float32 noise band can fall low);
* ``vanilla_shuffled``: vanilla with samples moved across ranks by the ``shuffle``
  partitioner (equal counts, pseudo-random, costs ignored): its distance to ``vanilla``
  is the cross-rank noise floor (``ne_cross_rank_floor``), what moving samples alone
  costs in float32 (balancing also moves them; DESIGN.md's floor permutes inside ranks);
* ``sdd``: vanilla, but the ids of step t+1 are distributed during step t (bitwise equal);
* ``prioritized``: prioritized embedding updates (DESIGN.md 2.2; bitwise equal to
  vanilla, tier 1);
* ``balance``: vanilla schedule + freescale's sequence load balancing (tier 2): the
  ``sticky`` partitioner on the cost model refitted every 20 steps
  (``balance.hook.FREESCALE_PARTITIONER`` / ``FREESCALE_REFIT_EVERY``; ``fbs`` until
  session 17, now the diagnostic ``balance_fbs``);
* ``freescale_nccl_overlap``: prioritized + freescale's balancing, the overlapped traffic
  on a side group of the main backend (NCCL on GPUs): the SM-free ablation (the same
  bits as ``freescale`` until the balancer's first refit; its plans then follow this
  run's measured times);
* ``freescale``: prioritized + freescale's balancing (tier 2), the overlapped traffic
  SM-free (``overlap_backend="auto"`` unless the config names a backend). Every
  ``freescale_<switch>`` diagnostic below is this with one switch changed, on the same
  balancer unless its name names a partitioner. Where a diagnostic below says "same
  bits" of a freescale variant, that holds until the balancer's first refit (step 20):
  from then on the plans follow each run's measured dense times, so two runs differ
  within tier 2 (the plan log, ``BalanceConfig.log_path``, makes a run replayable).

Diagnostic variants (:data:`DIAGNOSTIC_VARIANTS`, only when named in ``--variants``):
``vanilla_sync_update``, ``vanilla_padded_update``, ``freescale_padded_update``: the
variant with the owner's sparse update forced (``TrainConfig.sparse_update``; bitwise
the same parameters), to compare the update implementations in one run;
``freescale_host_completion``: freescale with the copy engine's host-side completion
(``TrainConfig.copy_engine_completion="host"``: its worker host-waits for the GPU; same
bits), next to ``freescale`` (device completion unless the base config or the
environment says otherwise) in one run; ``freescale_late_prepare``: freescale with
``TrainConfig.early_prepare=False`` (the gradient-free part of the prioritized backward
runs when the dense backward reaches the embeddings, as before ``prepare_backward``;
same bits); ``vanilla_fast_switch``, ``freescale_fast_switch``: the variant with Python's
thread switch interval at 0.5 ms instead of 5 (``TrainConfig.gil_switch_interval_ms``:
how long the training thread may wait for the interpreter lock behind the data-stage
and communicator threads; same bits); ``vanilla_pinned``, ``freescale_pinned``: the
variant with its host threads pinned by role (``TrainConfig.pin_threads``,
:mod:`~freescale.pipeline.placement`: do the launch threads need a core of their own?
same bits); ``freescale_gloo_handshake``: freescale with the copy engine's
per-collective handshakes on gloo instead of the shared-memory exchange
(``TrainConfig.copy_engine_handshake``; same bits); ``freescale_deferred_metrics``:
freescale with each step's record finished a step later still
(``TrainConfig.defer_metrics``: the per-step all-gather of stage times stays in flight
for a step instead of a host barrier between the ranks; same bits);
``freescale_shadow_balance``: freescale whose balancer plans and reports but moves no
sample (``BalanceConfig.shadow``: the metadata all-gathers and planning without the
exchange; the batches of prioritized); ``freescale_no_balance``: freescale without the
balancer (prioritized with the SM-free overlap backend) — with ``prioritized``,
``balance`` and ``freescale`` they separate what balancing costs a host-bound step
(session 13: each technique alone beat vanilla, the combination did not);
``freescale_fbs``, ``balance_fbs``: freescale and balance with the paper's ``fbs``
partitioner on ``L^alpha`` (freescale's balancer until session 17: sorted zig-zag deal,
about half the samples move); ``freescale_sticky``, ``balance_sticky``: freescale and
balance with plain ``sticky`` on ``L^alpha``, no cost model (equal counts by swaps from
the home placement: a few samples move, and the samples that stay skip the exchange;
a legal reordering, tier 2); ``freescale_sticky_cost``: sticky whose planner fits the
per-rank cost model ``a*L + b*L^2 + c`` from the measured dense times every
:data:`REFIT_EVERY` steps and plans with it (``L^alpha`` before the first fit) — the same
balancer as ``freescale`` now, kept under the name it was first measured by: sticky
balances exactly the costs it is given, so at scale it needs the true cost
(``benchmarks/sticky_robustness.py``); ``freescale_sticky2``,
``balance_sticky2``: freescale and balance with the ``sticky2`` partitioner (swaps
from home that balance every rank's total length and total squared length, so every
cost ``a*L + b*L^2 + c`` at once; tier 2); ``freescale_verify_plans``: freescale whose
balancer all-gathers a checksum of every plan and raises when the ranks' plans differ
(``BalanceConfig.verify_plans``; one tiny collective per step on the data stage): the
direct check, on GPUs, that the refitting balancer plans alike on every rank, and its
cost; ``vanilla_reordered_c``, ``vanilla_reordered_d``: two more in-rank orders (more
samples of the noise floor, which is the largest of them); ``freescale_again``: freescale
run a second time in the same invocation (the same config: its plans follow its own
measured times, so its NE distance to vanilla next to freescale's shows how far the
timing-fitted plans alone move NE); ``freescale_local_prepare``:
freescale with ``prepare_backward`` deciding by its
rank-local event query although the copy engine orders on the device (the rule before
``c39168e``; same bits): what that change costs or gains. With the balancer it has
run thousands of steps; prioritized + copy engine without a balancer hung with either
rule (session 14), so it exists only with the balancer. Every variant
runs the GIL probe
(``TrainConfig.gil_probe_ms``, 2 ms unless ``--gil-probe-ms`` says otherwise): the
report's "GIL wait" columns.

Per variant the report holds the trainer's summary (QPS, mean stage times, straggler
share, final eval NE / AUC / oracle NE), the NE curve (eval NE at every eval point),
activity counters (prioritized steps, collision / exclusive / deferred rows, samples
moved by the balancer), a step-time breakdown (data, embedding, dense, optimizer,
metrics; ms per step on rank 0) and, when the last steps were profiled
(``profile_steps``; on by default on GPUs, recording GPU activity only unless
``--profile-activities`` says otherwise: :func:`apply_bench_defaults`), the GPU accounting of
:mod:`~freescale.pipeline.accounting` (compute, bubble, exposed communication per step).
The headline compares ``freescale`` with ``vanilla``: ``qps_ratio``, ``ne_rel_diff``,
``ne_noise_floor``, ``bubble_reduction`` and ``exposed_comm_reduction`` (1 - freescale /
vanilla), and ``scaling_efficiency`` when a one-GPU report is given (``--baseline``:
per-GPU QPS here over per-GPU QPS there, per variant). What was not measured is listed
under ``not_measured``. On GPUs the trainers run with ``timing="events"`` (no host sync
per stage), on CPU with the default. Rank 0's host is recorded too: its topology
(``host_topology``, pipeline/placement.py) and, measured once before the variants, its
single-thread speed (``host_calibration``, metrics/host_speed.py): a host-bound mode's
QPS moves with it, so two reports from hosts of the same kind compare only next to it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..balance.hook import FREESCALE_PARTITIONER, FREESCALE_REFIT_EVERY
from ..config import TrainConfig
from ..metrics.host_speed import format_host_calibration, host_calibration
from .trainer import Trainer, TrainerHook

if TYPE_CHECKING:
    from ..balance.planner import BalanceConfig

__all__ = [
    "DIAGNOSTIC_VARIANTS",
    "InRankReorder",
    "REFIT_EVERY",
    "balance_config",
    "VARIANTS",
    "run_e2e",
    "write_report",
    "bench_rank",
    "bench_e2e_main",
]

VARIANTS = (
    "vanilla",
    "vanilla_reordered",
    "vanilla_reordered_b",
    "vanilla_shuffled",
    "sdd",
    "prioritized",
    "balance",
    "freescale_nccl_overlap",
    "freescale",
)
DIAGNOSTIC_VARIANTS = (
    "vanilla_sync_update",
    "vanilla_padded_update",
    "freescale_padded_update",
    "freescale_host_completion",
    "freescale_late_prepare",
    "vanilla_fast_switch",
    "freescale_fast_switch",
    "vanilla_pinned",
    "freescale_pinned",
    "freescale_gloo_handshake",
    "freescale_deferred_metrics",
    "freescale_shadow_balance",
    "freescale_no_balance",
    "freescale_local_prepare",
    "freescale_fbs",
    "balance_fbs",
    "freescale_sticky",
    "balance_sticky",
    "freescale_sticky_cost",
    "freescale_sticky2",
    "balance_sticky2",
    "freescale_verify_plans",
    "vanilla_reordered_c",
    "vanilla_reordered_d",
    "freescale_again",
)
# in-rank reorderings (InRankReorder salt per variant): their distances to vanilla are the
# NE noise floor's samples (``ne_noise_floor`` = the largest)
REORDER_SALT = {
    "vanilla_reordered": 0,
    "vanilla_reordered_b": 1,
    "vanilla_reordered_c": 2,
    "vanilla_reordered_d": 3,
}
# diagnostic variants whose prepare_backward decides rank-locally (the pre-c39168e rule)
_LOCAL_PREPARE = ("freescale_local_prepare",)
# diagnostic variants whose balancer plans and reports but moves nothing
# (BalanceConfig.shadow): its metadata all-gathers and planning without the exchange
_SHADOW = ("freescale_shadow_balance",)
# diagnostic variant -> Python's thread switch interval it sets, ms
# (TrainConfig.gil_switch_interval_ms; the interpreter's default is 5 ms)
FAST_SWITCH_MS = 0.5
_SWITCH = {"vanilla_fast_switch": FAST_SWITCH_MS, "freescale_fast_switch": FAST_SWITCH_MS}
# diagnostic variant -> the copy engine's completion it forces (TrainConfig.copy_engine_completion)
_COMPLETION = {"freescale_host_completion": "host"}
# diagnostic variant -> the sparse update it forces (TrainConfig.sparse_update)
_UPDATE = {
    "vanilla_sync_update": "sync",
    "vanilla_padded_update": "padded",
    "freescale_padded_update": "padded",
}
# freescale's balancer (``--mode freescale``, balance.hook.FREESCALE_PARTITIONER): the
# variants that do not name a partitioner (freescale, balance, freescale_<other switch>)
_FS = FREESCALE_PARTITIONER
# variant -> (embedding schedule, balancing partitioner or None)
_SPEC: dict[str, tuple[str, str | None]] = {
    "vanilla": ("vanilla", None),
    "vanilla_reordered": ("vanilla", None),
    "vanilla_reordered_b": ("vanilla", None),
    "vanilla_shuffled": ("vanilla", "shuffle"),
    "sdd": ("sdd", None),
    "prioritized": ("prioritized", None),
    "balance": ("vanilla", _FS),
    "balance_fbs": ("vanilla", "fbs"),
    "freescale_fbs": ("prioritized", "fbs"),
    "freescale_nccl_overlap": ("prioritized", _FS),
    "freescale": ("prioritized", _FS),
    "vanilla_sync_update": ("vanilla", None),
    "vanilla_padded_update": ("vanilla", None),
    "freescale_padded_update": ("prioritized", _FS),
    "freescale_host_completion": ("prioritized", _FS),
    "freescale_late_prepare": ("prioritized", _FS),
    "vanilla_fast_switch": ("vanilla", None),
    "freescale_fast_switch": ("prioritized", _FS),
    "vanilla_pinned": ("vanilla", None),
    "freescale_pinned": ("prioritized", _FS),
    "freescale_gloo_handshake": ("prioritized", _FS),
    "freescale_deferred_metrics": ("prioritized", _FS),
    "freescale_shadow_balance": ("prioritized", _FS),
    "freescale_no_balance": ("prioritized", None),
    "freescale_local_prepare": ("prioritized", _FS),
    "freescale_sticky": ("prioritized", "sticky"),
    "balance_sticky": ("vanilla", "sticky"),
    "freescale_sticky_cost": ("prioritized", "sticky"),
    "freescale_sticky2": ("prioritized", "sticky2"),
    "balance_sticky2": ("vanilla", "sticky2"),
    "freescale_verify_plans": ("prioritized", _FS),
    "vanilla_reordered_c": ("vanilla", None),
    "vanilla_reordered_d": ("vanilla", None),
    "freescale_again": ("prioritized", _FS),
}
# variants named for their partitioner: their balancer is that one, on L^alpha costs
_NAMED_PARTITIONER = (
    "balance_fbs",
    "freescale_fbs",
    "freescale_sticky",
    "balance_sticky",
    "freescale_sticky2",
    "balance_sticky2",
)
# variant -> how often its balancer refits its cost model (BalanceConfig use_cost_model +
# refit_every: it plans with a*L + b*L^2 + c fitted from the measured per-rank dense times,
# and with L^alpha until the first fit): freescale's balancer refits every
# FREESCALE_REFIT_EVERY steps, in every variant on it (_FS) not named for a partitioner,
# and in freescale_sticky_cost (sticky on the refitted model: the name it was measured
# under at 570414c, before it became freescale's balancer)
REFIT_EVERY = {
    name: FREESCALE_REFIT_EVERY
    for name, (_, part) in _SPEC.items()
    if (part == _FS and name not in _NAMED_PARTITIONER) or name == "freescale_sticky_cost"
}
# the overlapped traffic's backend per variant (TrainConfig.overlap_backend): freescale
# takes SM-free ("auto" unless the base config names a backend); the ablation
# freescale_nccl_overlap keeps it on a side group of the main backend; others: the base
_OVERLAP = {"freescale_nccl_overlap": "default"}
BREAKDOWN = ("data", "embedding", "dense", "optimizer", "metrics")


class InRankReorder(TrainerHook):
    """A legal reordering: every rank trains its samples in a permuted order (fixed by
    seed, step and rank; ``salt`` picks another order). Changes only summation orders:
    the NE noise floor."""

    ahead_safe = True  # a pure function of the host batch: runs on the data-stage thread

    def __init__(self, salt: int = 0) -> None:
        self.salt = salt

    def on_batch(self, trainer: Trainer, step: int, batch: Any) -> Any:
        n = batch.batch_size
        if n < 2:
            return batch
        seed = 1_000_003 * step + 7919 * trainer.rank + 17 + 104_729 * self.salt
        g = torch.Generator().manual_seed(seed)
        out = batch.select(torch.randperm(n, generator=g).to(batch.device))
        out.extras = batch.extras
        return out


class _StepRecorder(TrainerHook):
    """Keeps a compact per-step record: total step ms and straggler share (this rank)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_metrics(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        t = record["times"]
        total = sum(t.get(k, 0.0) for k in ("data", "forward", "backward", "optimizer", "metrics"))
        self.steps.append(
            {
                "step": step,
                "step_ms": 1e3 * total,
                "straggler_share": float(record.get("straggler_share", float("nan"))),
            }
        )


def _breakdown(stage_ms: dict[str, float]) -> dict[str, float]:
    """Mean ms per step split into data / embedding / dense / optimizer / metrics."""
    fwd_bwd = stage_ms.get("forward", 0.0) + stage_ms.get("backward", 0.0)
    dense = stage_ms.get("dense", 0.0)
    return {
        "data": stage_ms.get("data", 0.0),
        "embedding": max(fwd_bwd - dense, 0.0),
        "dense": dense,
        "optimizer": stage_ms.get("optimizer", 0.0),
        "metrics": stage_ms.get("metrics", 0.0),
    }


def _variant_cfg(base: TrainConfig, variant: str, mode: str) -> TrainConfig:
    log = base.log_path
    if log:
        stem, ext = os.path.splitext(log)
        log = f"{stem}.{variant}{ext or '.jsonl'}"
    overlap = _OVERLAP.get(variant, base.overlap_backend)
    if variant.startswith("freescale") and variant != "freescale_nccl_overlap":
        if overlap == "default":
            overlap = "auto"
    return dataclasses.replace(
        base,
        mode=mode,
        log_path=log,
        overlap_backend=overlap,
        sparse_update=_UPDATE.get(variant, base.sparse_update),  # type: ignore[arg-type]
        copy_engine_completion=_COMPLETION.get(variant, base.copy_engine_completion),  # type: ignore[arg-type]
        early_prepare=base.early_prepare and variant != "freescale_late_prepare",
        gil_switch_interval_ms=_SWITCH.get(variant, base.gil_switch_interval_ms),
        pin_threads=base.pin_threads or variant.endswith("_pinned"),
        copy_engine_handshake="gloo"
        if variant == "freescale_gloo_handshake"
        else base.copy_engine_handshake,
        defer_metrics=base.defer_metrics or variant == "freescale_deferred_metrics",
    )


def balance_config(variant: str) -> BalanceConfig | None:
    """The :class:`~freescale.balance.planner.BalanceConfig` of ``variant``'s balancer, or
    ``None`` when it does not balance."""
    from ..balance.planner import BalanceConfig

    partitioner = _SPEC[variant][1]
    if partitioner is None:
        return None
    refit = REFIT_EVERY.get(variant, 0)
    return BalanceConfig(
        partitioner=partitioner,
        shadow=variant in _SHADOW,
        use_cost_model=refit > 0,
        refit_every=refit,
        verify_plans=variant == "freescale_verify_plans",
    )


def run_variant(
    rank: int, world: int, base_cfg: TrainConfig, variant: str, ctx: Any = None
) -> dict[str, Any]:
    """Train one variant from scratch on ``base_cfg``; its report row (every rank)."""
    if variant not in _SPEC:
        raise ValueError(f"unknown variant '{variant}'; choose from {', '.join(VARIANTS)}")
    mode, partitioner = _SPEC[variant]
    cfg = _variant_cfg(base_cfg, variant, mode)
    rec = _StepRecorder()
    hooks: list[TrainerHook] = []
    balance = None
    if partitioner is not None:
        from ..balance.hook import BalanceHook

        balance = BalanceHook(balance_config(variant))
        hooks.append(balance)
    if variant in REORDER_SALT:
        hooks.append(InRankReorder(salt=REORDER_SALT[variant]))
    hooks.append(rec)
    tr = Trainer(cfg, hooks=hooks, ctx=ctx)
    if tr.world_size != world or tr.rank != rank:
        raise RuntimeError(f"rank {rank}/{world} but the trainer sees {tr.rank}/{tr.world_size}")
    if variant in _LOCAL_PREPARE:
        tr.sparse.prepare_blocks = False  # type: ignore[union-attr]
    try:
        summary = tr.train()
        pstats = getattr(tr.sparse, "pstats", None)
        ps = pstats.as_dict() if pstats is not None else {}
        local = torch.tensor(
            [float(ps.get("deferred_rows", 0)), float(ps.get("deferred_ids", 0))],
            dtype=torch.float64,
        )
        if world > 1:  # deferred counts are per owner: sum them (before close() releases
            # the trainer's groups)
            local = tr.meta_comm.all_reduce(local.to(tr.meta_comm.device), name="e2e").wait()
            local = local.cpu()
    finally:
        tr.close()
    if balance is not None:  # a new hook per variant: its group goes with the variant
        balance.close()
    side = getattr(tr.sparse, "side_comm", None)
    activity = {
        "prioritized_steps": int(ps.get("prioritized_steps", 0)),
        # rank 0's backwards whose gradient-free part ran early (prepare_backward)
        "prepared_steps": int(ps.get("prepared_steps", 0)),
        # prepare_backward always ran (side group orders on the device), not by query
        "prepare_blocks": bool(getattr(tr.sparse, "prepare_blocks", False)),
        "sync_steps": int(ps.get("sync_steps", summary.get("steps", 0))),
        "fallbacks": int(ps.get("fallbacks", 0)),
        "collision_rows": int(ps.get("collision_rows", 0)),
        "collision_ids": int(ps.get("collision_ids", 0)),
        "exclusive_rows": int(ps.get("exclusive_rows", 0)),
        "deferred_rows": int(local[0]),
        "deferred_ids": int(local[1]),
        "collision_rate": ps.get("collision_rate", {"distinct": 0.0, "occurrence": 0.0}),
        "samples_moved": int(balance.samples_moved_total) if balance else 0,
        "bytes_moved": int(balance.bytes_moved_total) if balance else 0,
        "steps_balanced": int(balance.steps_balanced) if balance else 0,
        # the balancer's cost model at the end when it plans with one (REFIT_EVERY): its
        # a, b, c, whether it was fitted, and the fit's relative error
        "balance_cost_model": (
            balance.planner.cost_model.to_dict()
            if balance is not None and balance.planner is not None and balance.config.use_cost_model
            else None
        ),
        # the copy engine's completion protocol, when it carried the overlapped traffic
        "copy_engine_completion": getattr(side, "completion", None),
        "copy_engine_handshake": getattr(side, "handshake", None),
        "copy_engine_device_completions": int(getattr(side, "device_completions", 0)),
    }
    stage_ms = dict(summary.get("stage_ms", {}))
    curve = [
        {k: float(e[k]) for k in ("step", "eval_ne", "eval_auc") if k in e} for e in tr.eval_history
    ]
    return {
        "variant": variant,
        "mode": mode,
        "balance": partitioner,
        "qps": float(summary.get("qps", float("nan"))),
        "eval_ne": float(summary.get("eval_ne", float("nan"))),
        "oracle_ne": float(summary.get("oracle_ne", float("nan"))),
        "eval_auc": float(summary.get("eval_auc", float("nan"))),
        "straggler_share_median": float(summary.get("straggler_share_median", float("nan"))),
        "step_ms": sum(_breakdown(stage_ms).values()),
        "breakdown_ms": _breakdown(stage_ms),
        "stage_ms": stage_ms,
        "ne_curve": curve,
        "activity": activity,
        "gpu_accounting": summary.get("gpu_accounting"),
        "per_step": rec.steps,
        "summary": {
            k: v for k, v in summary.items() if k not in ("stage_ms", "balance", "gpu_accounting")
        },
    }


def run_e2e(
    rank: int,
    world: int,
    base_cfg: TrainConfig,
    variants: list[str] | tuple[str, ...] = VARIANTS,
    ctx: Any = None,
    warmup_steps: int = 0,
    on_row: Any = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Train every variant on the same config (data, seed) in turn; the rows (every
    rank; timings are rank-local, numerics identical on every rank).

    ``repeats`` > 1: the whole variant list that many times in all, every second pass
    in reverse order (A B, B A, A B ...): whatever a variant leaves behind in the
    process (a profiler's CUPTI session, warm caches, allocator state) then falls on
    each variant in turn, not always on the later ones. The first pass gives ``rows``,
    the others ``repeat_rows`` (each row with its ``pass`` and its ``position`` in the
    pass). Same numerics every pass; the spread of the timings between passes is what a
    single run's ratio is worth.

    ``warmup_steps`` > 0: first a discarded vanilla run of that many steps, so that
    one-time costs (compiling the attention kernels for the token-count buckets, CUDA
    and NCCL initialisation) are not charged to the first variant."""
    bad = [v for v in variants if v not in _SPEC]
    if bad:
        known = ", ".join(VARIANTS + DIAGNOSTIC_VARIANTS)
        raise ValueError(f"unknown variant(s) {bad}; choose from {known}")
    if warmup_steps > 0:
        wcfg = dataclasses.replace(
            base_cfg,
            steps=warmup_steps,
            eval_every=0,
            profile_steps=0,
            trace_dir=None,
            log_path=None,
            mode="vanilla",
        )
        tr = Trainer(wcfg, ctx=ctx)
        try:
            tr.train()
        finally:
            tr.close()
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    rows: list[dict[str, Any]] = []
    extra: list[dict[str, Any]] = []
    for p in range(repeats):
        order = list(variants) if p % 2 == 0 else list(reversed(variants))
        for i, v in enumerate(order):
            row = run_variant(rank, world, base_cfg, v, ctx=ctx)
            row["pass"], row["position"] = p, i
            (rows if p == 0 else extra).append(row)
            if on_row is not None:
                on_row(_result(rank, world, base_cfg, rows, extra))
    return _result(rank, world, base_cfg, rows, extra)


def _result(
    rank: int,
    world: int,
    cfg: TrainConfig,
    rows: list[dict[str, Any]],
    repeat_rows: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    device = rows[0]["summary"].get("device", "cpu") if rows else "cpu"
    return {
        "world_size": world,
        "rank": rank,
        "device": _describe_device(device, rows[0]["summary"].get("backend") if rows else None),
        "config": dataclasses.asdict(cfg),
        "rows": list(rows),
        "repeat_rows": list(repeat_rows or []),
    }


def _describe_device(device: str, backend: str | None) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine() or "cpu"
        name = f"CPU ({name}, {os.cpu_count()} cores)"
    return f"{name}; {backend or 'single'}"


ENV_PREFIXES = ("FREESCALE_", "NCCL_", "TORCH_SYMM_MEM_", "TRITON_", "CUDA_VISIBLE_DEVICES")


def run_environment() -> dict[str, str]:
    """The environment variables that change what a run measures (FreeScale's switches,
    e.g. ``FREESCALE_BLOCK_MASK``, and NCCL / Triton / device settings), sorted; the git
    sha override is reported as ``git_sha`` instead. A report's command line alone does
    not show them."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(ENV_PREFIXES) and k != "FREESCALE_GIT_SHA"
    }


def _git_sha() -> str | None:
    """``FREESCALE_GIT_SHA`` when set (a copied tree's .git may be stale), else HEAD."""
    env = os.environ.get("FREESCALE_GIT_SHA")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("nan")


def _acct(row: dict[str, Any], key: str) -> float | None:
    a = row.get("gpu_accounting") or {}
    return float(a[key]) if a.get("available") and key in a else None


def _unprofiled(row: dict[str, Any]) -> dict[str, float] | None:
    """The unprofiled step (host wall ms per timed step, before the profiled window;
    the periodic eval amortized in it, as in QPS) against the profiled GPU accounting:
    ``unprofiled_step_ms``, ``profiler_inflation_ms`` (profiled GPU window per step -
    unprofiled step; negative when the window leaves out the eval share) and
    ``noncompute_unprofiled_ms`` (unprofiled step - GPU compute per step, at least 0:
    the bubble without the profiler's host cost, plus the amortized eval, which is
    about the same for every variant; GPU compute is kernel time, which the profiler
    barely changes). None without both."""
    hc = (row.get("summary") or {}).get("host_cpu") or {}
    step = hc.get("wall_ms_per_step")
    window, compute = _acct(row, "window_ms"), _acct(row, "compute_ms")
    if not step or window is None or compute is None:
        return None
    step = float(step)
    return {
        "unprofiled_step_ms": step,
        "profiler_inflation_ms": window - step,
        "noncompute_unprofiled_ms": max(0.0, step - compute),
    }


def _compiles(row: dict[str, Any]) -> dict[str, Any] | None:
    """Compiles inside the row's profiled window, the largest over ranks (``jit_compiles``,
    ``jit_compile_s``: Triton JIT; ``dynamo_graphs``: torch.compile, None if unknown), or
    None for a report written before they were counted (session 25)."""
    a = row.get("gpu_accounting") or {}
    if a.get("jit_compiles_in_window") is None:
        return None
    return {
        "jit_compiles": int(a["jit_compiles_in_window"]),
        "jit_compile_s": float(a.get("jit_compile_s_in_window") or 0.0),
        "dynamo_graphs": a.get("dynamo_graphs_in_window"),
    }


def headline(
    rows: list[dict[str, Any]],
    baseline: dict[str, Any] | None = None,
    repeat_rows: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """freescale (and every other variant) against vanilla; and what was not measured.

    ``baseline``: a one-GPU report of the same workload (per-rank batch) for the
    scaling efficiency (per-GPU QPS here / per-GPU QPS there, per variant).
    ``repeat_rows``: later passes of the same variants (``run_e2e(repeats=...)``): QPS
    per pass and variant, the freescale / vanilla ratio per pass and its median, and
    each variant's spread ((max - min) / median QPS over passes)."""
    by = {r["variant"]: r for r in rows}
    van = by.get("vanilla")
    out: dict[str, Any] = {}
    missing: list[str] = []
    if van is None:
        return out, ["everything: no vanilla row"]
    for name, r in by.items():
        if name == "vanilla":
            continue
        key = "" if name == "freescale" else f"_{name}"
        out[f"qps_ratio{key}"] = r["qps"] / van["qps"] if van["qps"] else float("nan")
        out[f"ne_rel_diff{key}"] = _rel(r["eval_ne"], van["eval_ne"])
        out[f"step_ms_ratio{key}"] = r["step_ms"] / van["step_ms"] if van["step_ms"] else None
        for what in ("bubble", "exposed_comm"):
            a, b = _acct(r, f"{what}_ms"), _acct(van, f"{what}_ms")
            if a is not None and b:
                out[f"{what}_reduction{key}"] = 1.0 - a / b
    for what in ("bubble", "exposed_comm"):
        v = _acct(van, f"{what}_ms")
        if v is not None:
            out[f"vanilla_{what}_ms"] = v
        if "freescale" in by:
            f = _acct(by["freescale"], f"{what}_ms")
            if f is not None:
                out[f"freescale_{what}_ms"] = f
    # the profiled window runs under torch.profiler, whose per-op host cost slows a
    # launch-heavy schedule more than vanilla: its idle time is partly the profiler's.
    # Derived from the unprofiled timed steps of the same run (see _unprofiled): an
    # estimate, labelled so; the measured bubble stays the headline.
    unprof = {n: _unprofiled(r) for n, r in by.items()}
    infl = {n: u["profiler_inflation_ms"] for n, u in unprof.items() if u}
    if infl:
        out["profiler_inflation_ms"] = infl
        nc = {n: u["noncompute_unprofiled_ms"] for n, u in unprof.items() if u}
        out["noncompute_unprofiled_ms"] = nc
        if nc.get("vanilla", 0.0) > 0:
            for name, v in nc.items():
                if name != "vanilla":
                    key = "" if name == "freescale" else f"_{name}"
                    out[f"noncompute_reduction_unprofiled{key}"] = 1.0 - v / nc["vanilla"]
    # compiles inside the profiled window (pipeline/compile_watch.py): a kernel variant
    # first used there stalls the host for its compile, which reads as bubble
    comp = {n: _compiles(r) for n, r in by.items()}
    comp = {n: c for n, c in comp.items() if c is not None}
    if comp:
        out["compiles_in_profiled_window"] = comp
        out["profiled_window_compile_free"] = all(
            c["jit_compiles"] == 0 and not c["dynamo_graphs"] for c in comp.values()
        )
    if "freescale" in by:
        fs = by["freescale"]
        out["straggler_share_vanilla"] = van["straggler_share_median"]
        out["straggler_share_freescale"] = fs["straggler_share_median"]
        if "bubble_reduction" not in out:
            missing += ["bubble_reduction", "exposed_comm_reduction"]
    samples = {name: out.pop(f"ne_rel_diff_{name}") for name in REORDER_SALT if name in by}
    if samples:
        out["ne_noise_floor"] = max(samples.values())
        out["ne_noise_floor_samples"] = samples
        if "ne_rel_diff" in out:
            out["ne_within_noise_floor"] = bool(out["ne_rel_diff"] <= out["ne_noise_floor"])
    else:
        missing.append("ne_noise_floor")
    if "freescale" in by and "freescale_again" in by:
        # two runs of one config: how far the timing-fitted plans alone move NE
        out["ne_rel_diff_freescale_runs"] = _rel(
            by["freescale_again"]["eval_ne"], by["freescale"]["eval_ne"]
        )
    if "vanilla_shuffled" in by:
        cross = out.pop("ne_rel_diff_vanilla_shuffled", None)
        if int(by["vanilla_shuffled"]["summary"].get("world_size", 1)) < 2:
            missing.append("ne_cross_rank_floor (one rank: nothing to move)")
        elif cross is not None:
            out["ne_cross_rank_floor"] = cross
            if "ne_rel_diff" in out:
                out["ne_within_cross_rank_floor"] = bool(out["ne_rel_diff"] <= cross)
    if baseline is not None:
        bw = int(baseline.get("world_size") or 1)
        base = {r["variant"]: r for r in baseline.get("rows", [])}
        w = int(rows[0]["summary"].get("world_size", 1)) if rows else 1
        eff = {
            name: (r["qps"] / w) / (base[name]["qps"] / bw)
            for name, r in by.items()
            if name in base and base[name].get("qps")
        }
        out["scaling_efficiency_by_variant"] = eff
        if "freescale" in eff:
            out["scaling_efficiency"] = eff["freescale"]
        out["scaling_baseline_world_size"] = bw
    else:
        missing.append("scaling_efficiency")
    if repeat_rows:
        out.update(_pass_stats(rows, repeat_rows))
    return out, missing


def _pass_stats(rows: list[dict[str, Any]], repeat_rows: list[dict[str, Any]]) -> dict[str, Any]:
    """QPS per pass and variant, ratios per pass, medians and spreads (see headline)."""
    by_pass: dict[int, dict[str, float]] = {}
    for r in [*rows, *repeat_rows]:
        by_pass.setdefault(int(r.get("pass", 0)), {})[r["variant"]] = float(r["qps"])
    passes = [by_pass[p] for p in sorted(by_pass)]
    names = sorted({n for p in passes for n in p})
    qps = {n: [p[n] for p in passes if n in p] for n in names}
    out: dict[str, Any] = {"passes": len(passes), "qps_by_pass": qps}
    out["qps_spread_by_variant"] = {
        n: (max(v) - min(v)) / statistics.median(v) for n, v in qps.items() if len(v) > 1
    }
    for n in names:
        if n == "vanilla":
            continue
        ratios = [p[n] / p["vanilla"] for p in passes if n in p and p.get("vanilla")]
        if len(ratios) > 1:
            key = "" if n == "freescale" else f"_{n}"
            out[f"qps_ratio_by_pass{key}"] = ratios
            out[f"qps_ratio_median{key}"] = statistics.median(ratios)
    return out


def _dense_param_bytes(report: dict[str, Any]) -> float:
    """From the rows' summaries, else by building the dense model of the config."""
    for r in report.get("rows", []):
        v = (r.get("summary") or {}).get("dense_param_bytes")
        if v:
            return float(v)
    from ..cli import _cfg_from_dict
    from ..data.synthetic import SyntheticSource
    from ..models.sequence import SequenceRecModel

    cfg = _cfg_from_dict(report["config"])
    model = SequenceRecModel(cfg.model, list(SyntheticSource.uih_keys))
    size = 8 if cfg.model.dtype == "float64" else 4
    return float(sum(p.numel() for p in model.parameters()) * size)


def _other_idle(row: dict[str, Any] | None) -> float | None:
    a = (row or {}).get("gpu_accounting") or {}
    return float(a["other_idle_ms"]) if a.get("available") else None


def projection_from_report(
    report: dict[str, Any], world_sizes: tuple[int, ...] = (64, 256)
) -> dict[str, Any] | None:
    """Project the measured vanilla and freescale steps of ``report`` to
    ``world_sizes`` (pipeline/projection.py; docs/projection.md). Inputs, all from the
    report: the vanilla row's dense time (rank 0, CUDA events), embedding compute (GPU
    compute minus dense, from the profiler accounting), bytes sent per step, host
    overhead (the accounting's *other idle*, each schedule its own), the measured
    exposed communication of both modes; the collision rate of the freescale (or
    prioritized) row; straggler
    shares at every W from the simulator on the run's length distribution. None when
    the report has no vanilla row."""
    from .projection import (
        MeasuredCosts,
        NetworkModel,
        bytes_per_rank_from_sent,
        projection_report,
        straggler_shares_from_simulator,
    )

    by = {r["variant"]: r for r in report.get("rows", [])}
    van = by.get("vanilla")
    if van is None:
        return None
    fs = by.get("freescale") or by.get("prioritized")
    w = int(van["summary"].get("world_size") or report.get("world_size") or 1)
    data = (report.get("config") or {}).get("data", {})
    per_rank = max(1, int(data.get("global_batch_size", 128)) // max(w, 1))
    acct = van.get("gpu_accounting") or {}
    dense = float(van["breakdown_ms"].get("dense", 0.0))
    if acct.get("available"):
        emb_compute = max(0.0, float(acct["compute_ms"]) - dense)
        host = float(acct["other_idle_ms"])
    else:
        emb_compute, host = float(van["breakdown_ms"].get("embedding", 0.0)), 0.0
    sizes = tuple(sorted({max(w, 2), *world_sizes}))
    shares = straggler_shares_from_simulator(
        sizes,
        batch_size=per_rank,
        max_uih=int(data.get("max_uih", 16384)),
        length_dist=str(data.get("length_dist", "lognormal")),
        median_uih=int(data.get("median_uih", 1024)),
        sigma=float(data.get("sigma", 1.0)),
        steps=100,
        # freescale's balancer: sticky on the cost model (the simulator's "_cost" names
        # plan with the model it scores with: the refitted model, converged)
        balanced_partitioner=f"{FREESCALE_PARTITIONER}_cost",
    )
    measured = {}
    for name, row in (("vanilla", van), ("freescale", fs)):
        a = (row or {}).get("gpu_accounting") or {}
        if a.get("available"):
            measured[name] = float(a["exposed_comm_ms"])
    coll = (fs or {}).get("activity", {}).get("collision_rate", {}).get("occurrence", 0.0)
    costs = MeasuredCosts(
        dense_ms=dense,
        emb_compute_ms=emb_compute,
        emb_bytes_per_rank=bytes_per_rank_from_sent(
            float(van["summary"].get("emb_bytes_sent_per_step", 0.0)), max(w, 2)
        ),
        collision_rate=float(coll),
        dense_param_bytes=_dense_param_bytes(report),
        host_overhead_ms=host,
        straggler_vanilla=shares["vanilla"],
        straggler_freescale=shares["freescale"],
        local_batch_size=per_rank,
        measured_world_size=max(w, 2),
        measured_exposed_comm_ms=measured or None,
        host_overhead_freescale_ms=_other_idle(fs),
        source=f"e2e report {report.get('git_sha')} ({report.get('device')})",
    )
    out = projection_report(costs, NetworkModel(), sizes)
    rows = out["rows"]
    head = {}
    for W in world_sizes:
        for r in rows:
            if r["world_size"] == W and r["schedule"] == "freescale":
                head[f"projected_qps_ratio_{W}"] = r["freescale_over_vanilla"]
    out["headline"] = head
    if not acct.get("available"):
        out["note"] = "no GPU accounting in the report (CPU run?): illustrative only"
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _wait_lines(rows: list[dict[str, Any]], top: int = 5) -> list[str]:
    """Where each row's training thread blocked in collectives' ``wait()`` (rank 0, ms
    per timed step, the largest ``top``; comm.base.wait_clock), or nothing if no row
    has it."""
    out: list[str] = []
    for r in rows:
        hc = (r.get("summary") or {}).get("host_cpu") or {}
        waits = hc.get("host_wait_training")
        if waits is None:
            continue
        big = sorted(waits.items(), key=lambda kv: -kv[1]["ms_per_step"])[:top]
        cells = ", ".join(
            f"{k} {v['ms_per_step']:.2f} ({v['calls_per_step']:.1f}x)" for k, v in big
        )
        tag = f" (pass {int(r.get('pass', 0)) + 1})"
        out.append(f"- {r['variant']}{tag}: {hc['host_wait_training_ms']:.2f} ms: {cells or '-'}")
    if not out:
        return []
    head = (
        "Training thread blocked in collectives' wait() and host waits for the device "
        "(device:*) (rank 0, ms per step; calls per step):"
    )
    return ["", head, "", *out]


def _markdown(report: dict[str, Any]) -> str:
    cols = [
        ("variant", "{}"),
        ("qps", "{:.1f}"),
        ("step_ms", "{:.2f}"),
        ("eval_ne", "{:.6f}"),
        ("eval_auc", "{:.4f}"),
        ("straggler_share_median", "{:.3f}"),
    ]
    acts = ("prioritized_steps", "collision_rows", "deferred_rows", "samples_moved")
    gpu = ("compute_ms", "bubble_ms", "exposed_comm_ms")
    load = ("gpu_ops_per_step", "runtime_calls_per_step")  # absent before session 19
    head = (
        [c for c, _ in cols]
        + [f"ms {b}" for b in BREAKDOWN]
        + [f"GPU {g}" for g in gpu]
        + ["GPU ops per step", "CUDA API calls per step"]
        + list(acts)
        + ["host CPU ms training thread", "host CPU ms process", "host cpu/wall"]
        + ["GIL wait mean ms", "GIL wait p90 ms", "GIL wait p99 ms"]
        + ["unprofiled step ms", "non-compute ms (unprofiled est.)", "profiler inflation ms"]
        + ["data stage busy ms", "data stage blocked ms"]
        + ["host wait ms training thread"]
        + ["compiles in profiled window"]
    )
    lines = [
        f"# E2E benchmark ({report['device']}, {report['world_size']} ranks)",
        "",
        f"{report['date']}, git {report.get('git_sha') or 'unknown'}",
        "",
    ]
    env = report.get("environment") or {}
    if env:
        lines += ["Environment: " + ", ".join(f"`{k}={v}`" for k, v in env.items()), ""]
    lines += [
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for r in report["rows"]:
        cells = []
        for c, fmt in cols:
            v = r.get(c)
            cells.append("n/a" if v is None else fmt.format(v))
        cells += [f"{r['breakdown_ms'].get(b, 0.0):.2f}" for b in BREAKDOWN]
        cells += [("n/a" if _acct(r, g) is None else f"{_acct(r, g):.2f}") for g in gpu]
        cells += [("n/a" if _acct(r, g) is None else f"{_acct(r, g):.0f}") for g in load]
        cells += [str(r["activity"].get(a, 0)) for a in acts]
        hc = (r.get("summary") or {}).get("host_cpu")
        cells += (
            [
                f"{hc['by_group_ms_per_step'].get('training', 0.0):.1f}",
                f"{hc['process_cpu_ms_per_step']:.1f}",
                f"{hc['cpu_over_wall']:.2f}",
            ]
            if hc
            else ["n/a"] * 3
        )
        gw = (hc or {}).get("gil_wait")
        cells += [f"{gw[k]:.2f}" for k in ("mean_ms", "p90_ms", "p99_ms")] if gw else ["n/a"] * 3
        u = _unprofiled(r)
        keys = ("unprofiled_step_ms", "noncompute_unprofiled_ms", "profiler_inflation_ms")
        cells += [f"{u[k]:.2f}" for k in keys] if u else ["n/a"] * 3
        dt = ((r.get("summary") or {}).get("data_thread") or {}).get("timing")
        cells += [f"{dt[k]:.2f}" for k in ("busy_ms", "blocked_ms")] if dt else ["n/a"] * 2
        cw = (hc or {}).get("host_wait_training_ms")
        cells.append("n/a" if cw is None else f"{cw:.2f}")
        cc = _compiles(r)
        cells.append(
            "n/a"
            if cc is None
            else f"{cc['jit_compiles']} Triton ({cc['jit_compile_s']:.2f} s), "
            f"{'?' if cc['dynamo_graphs'] is None else cc['dynamo_graphs']} graphs"
        )
        lines.append("| " + " | ".join(cells) + " |")
    h = report["headline"]
    if h.get("qps_by_pass"):
        n = int(h["passes"])
        lines += ["", f"QPS per pass ({n} passes of the variant list, in order):", ""]
        lines += ["| variant | " + " | ".join(f"pass {i + 1}" for i in range(n)) + " | spread |"]
        lines += ["|" + "---|" * (n + 2)]
        for name, q in h["qps_by_pass"].items():
            spread = h["qps_spread_by_variant"].get(name)
            cells = [f"{x:.1f}" for x in q] + ["n/a"] * (n - len(q))
            cells.append("n/a" if spread is None else f"{spread:.3f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += _wait_lines(report["rows"] + report.get("repeat_rows", []))
    lines += ["", "Headline (freescale vs vanilla):", ""]
    for k, v in report["headline"].items():
        lines.append(f"- `{k}`: {v}")
    if report.get("not_measured"):
        lines += ["", "Not measured here: " + ", ".join(report["not_measured"])]
    topo = report.get("host_topology")
    if topo:
        lines += [
            "",
            f"Host (rank 0): {topo['logical_cpus']} logical CPUs, {topo['physical_cores']} "
            f"physical cores, SMT {topo['smt']}.",
        ]
    speed = format_host_calibration(report.get("host_calibration"))
    if speed:  # absent in reports written before it (or merged from them)
        lines += ["", speed]
    lines += [
        "",
        "GPU columns: per step over the profiled last steps, mean over ranks "
        "(freescale.pipeline.accounting); GPU ops and CUDA API calls per step (every host "
        "thread) are the launch load the profiler traces (benchmarks/cupti_overhead.py). "
        "Host CPU columns: rank 0, CPU ms per timed step of the training thread and of "
        "the whole process, and process CPU / wall "
        "(freescale.metrics.host_cpu; Python threads share one interpreter lock). GIL wait: "
        "rank 0, how late a probe thread that sleeps gil_probe_ms (2 by default) wakes "
        "(metrics.host_cpu.GilProbe). Unprofiled columns: wall ms per timed step before the "
        "profiled window, that minus GPU compute (an estimate of the bubble without the "
        "profiler's host cost, plus the amortized eval), and the profiled GPU window minus "
        "it (how much the profiler slowed the step). Data stage: rank 0's data-stage "
        "thread, ms per prepared step in its work (busy) and blocked ahead of the training "
        "thread (pipeline/data_stage.py; busy near the step time with ~0 blocked: the data "
        "stage bounds the step). Host wait: rank 0's training thread, host ms per timed "
        "step inside collectives' wait() and in host waits for the device (device:*: the "
        "mask read, the step marks) (comm.base.wait_clock; NCCL waits are stream waits, "
        "gloo / copy-engine / host-staged ones block the thread until the peers or the "
        "backend's worker got there; per collective in the list below the table). "
        "Compiles in profiled window: the largest count over ranks of Triton JIT compiles "
        "(their seconds) and torch.compile graphs inside the profiled steps "
        "(pipeline/compile_watch.py); a compile there stalls the host and reads as bubble.",
    ]
    proj = report.get("projection")
    if proj:
        from .projection import format_table

        net = proj["network"]
        lines += [
            "",
            "## Projection (not a measurement; docs/projection.md)",
            "",
            f"Network model: {net}",
            "",
            "```",
            format_table(proj["rows"]),
            "```",
        ]
        if proj.get("note"):
            lines += ["", proj["note"]]
    return "\n".join(lines) + "\n"


def _plot(report: dict[str, Any], path: str) -> str | None:
    """Step-time breakdown per mode + NE curves; returns a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not importable: e2e.png not written"
    rows = report["rows"]
    gpu = [r for r in rows if _acct(r, "window_ms") is not None]
    fig, axes = plt.subplots(1, 3 if gpu else 2, figsize=(18 if gpu else 12, 4.5))
    ax1, ax2 = axes[0], axes[1]
    names = [r["variant"] for r in rows]
    bottom = [0.0] * len(rows)
    for b in BREAKDOWN:
        vals = [r["breakdown_ms"].get(b, 0.0) for r in rows]
        ax1.bar(names, vals, bottom=bottom, label=b)
        bottom = [x + y for x, y in zip(bottom, vals)]
    ax1.set_ylabel("ms per step (rank 0, mean)")
    ax1.set_title("step-time breakdown")
    ax1.legend(fontsize="small")
    for r in rows:
        c = r["ne_curve"]
        ax2.plot([p["step"] for p in c], [p["eval_ne"] for p in c], marker="o", label=r["variant"])
    ax2.set_xlabel("step")
    ax2.set_ylabel("eval NE")
    ax2.set_title("NE curves")
    ax2.legend(fontsize="small")
    if gpu:  # where the GPU's time goes (profiler trace; accounting.py)
        ax3 = axes[2]
        bottom = [0.0] * len(gpu)
        for key, label in (
            ("compute_ms", "compute"),
            ("exposed_comm_ms", "exposed communication"),
            ("other_idle_ms", "other idle (host-bound)"),
        ):
            vals = [_acct(r, key) or 0.0 for r in gpu]
            ax3.bar([r["variant"] for r in gpu], vals, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax3.set_ylabel("ms per step (GPU timeline, mean over ranks)")
        ax3.set_title("GPU time: compute vs bubble")
        ax3.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def write_report(
    result: dict[str, Any],
    out_dir: str,
    command: str | None = None,
    baseline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``e2e.json``, ``e2e.md`` and ``e2e.png`` (if matplotlib imports) under
    ``out_dir``; returns the JSON report. ``baseline``: a one-GPU ``e2e.json`` (loaded)
    for the scaling efficiency."""
    os.makedirs(out_dir, exist_ok=True)
    rows = result["rows"]
    repeat_rows = result.get("repeat_rows") or []
    head, missing = headline(rows, baseline, repeat_rows)
    report: dict[str, Any] = {
        "figure": "e2e",
        "device": result.get("device"),
        # rank 0's host: logical CPUs, physical cores, SMT width (pipeline/placement.py)
        "host_topology": next(
            (
                r["summary"]["placement"]["topology"]
                for r in rows
                if (r.get("summary") or {}).get("placement")
            ),
            None,
        ),
        # rank 0's CPU model, clock and two timed fixed workloads, measured once before
        # the variants (metrics/host_speed.py): compares hosts of the same kind
        "host_calibration": result.get("host_calibration"),
        "world_size": result.get("world_size"),
        "git_sha": _git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command or result.get("command") or " ".join(sys.argv),
        "environment": run_environment(),
        "variants": [r["variant"] for r in rows],
        "rows": rows,
        "repeat_rows": repeat_rows,
        "headline": head,
        "not_measured": missing,
        "config": result.get("config"),
        "notes": [],
    }
    try:
        report["projection"] = projection_from_report(_jsonable(report))
    except Exception as e:  # noqa: BLE001 - a projection must not lose the measurements
        report["projection"] = None
        report["notes"].append(f"projection failed: {e}")
    note = _plot(report, os.path.join(out_dir, "e2e.png"))
    report["plot"] = None if note else "e2e.png"
    if note:
        report["notes"].append(note)
    report = _jsonable(report)
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write(_markdown(report))
    return report


def merge_results(earlier: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Rows of an earlier report (same config, device and world size) followed by this
    run's rows; a variant run again replaces its earlier row. For sweeps split over
    several launches (e.g. a per-call time limit)."""
    cfg = json.loads(json.dumps(_jsonable(result["config"]), default=str))
    if earlier.get("config") != cfg:
        diff = sorted(
            k for k in set(cfg) | set(earlier.get("config") or {})
            if cfg.get(k) != (earlier.get("config") or {}).get(k)
        )  # fmt: skip
        raise ValueError(f"--merge: the earlier report has a different config ({diff})")
    if earlier.get("world_size") != result["world_size"]:
        raise ValueError(
            f"--merge: earlier report has {earlier.get('world_size')} ranks, this run "
            f"{result['world_size']}"
        )
    new = {r["variant"] for r in result["rows"]}
    rows = [r for r in earlier.get("rows", []) if r["variant"] not in new] + result["rows"]
    reps = [r for r in earlier.get("repeat_rows") or [] if r["variant"] not in new]
    return {**result, "rows": rows, "repeat_rows": reps + list(result.get("repeat_rows") or [])}


# ----------------------------------------------------------------------------- CLI
def bench_rank(
    cfg_dict: dict[str, Any],
    variants: list[str],
    out_dir: str,
    timeout: float,
    command: str,
    baseline: dict[str, Any] | None = None,
    merge: dict[str, Any] | None = None,
    warmup: int = 0,
    repeats: int = 1,
) -> dict[str, Any] | None:
    """Entry point of one rank (module level so the launcher can pickle it); rank 0
    writes the report and returns its headline."""
    from ..cli import _cfg_from_dict
    from .distributed import init_distributed

    cfg = _cfg_from_dict(cfg_dict)
    ctx = init_distributed(cfg.device, timeout_s=timeout)
    try:
        cmd = command if merge is None else f"{merge.get('command')} ; {command}"
        # once, on rank 0, before any variant: the host's single-thread speed (this
        # launch's host, also when rows are merged from an earlier report)
        calibration = host_calibration() if ctx.rank == 0 else None

        def save(result: dict[str, Any]) -> dict[str, Any]:
            # after every variant, so a run cut short still leaves its finished rows
            if merge is not None:
                result = merge_results(merge, result)
            result = {**result, "host_calibration": calibration}
            return write_report(result, out_dir, command=cmd, baseline=baseline)

        result = run_e2e(
            ctx.rank,
            ctx.world_size,
            cfg,
            variants,
            ctx=ctx,
            warmup_steps=warmup,
            on_row=save if ctx.rank == 0 else None,
            repeats=repeats,
        )
        if ctx.rank == 0:
            report = save(result)
            print(_markdown(report), flush=True)
            return report["headline"]
        return None
    finally:
        if ctx.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def apply_bench_defaults(cfg: TrainConfig, given: set[str], gpu: bool, steps: int) -> None:
    """The benchmark's defaults where its flags (``given``) leave them open.

    On GPUs: ``timing="events"`` (no host sync per stage: what a user's run would do) and
    ``profile_activities="cuda"`` — the accounting reads GPU activity only, and recording
    every host op stretches host-bound steps: profiled minus unprofiled step +3.8 ms with
    host ops against -0.8 / -1.6 ms without (BENCHMARKS.md e2e, session 10), and at
    ``878d359`` the profiled bubble grew with host work at unchanged wall time
    (vanilla_shuffled 14.7 ms against vanilla's 6.3 at 42 ms per step). Everywhere: the
    GIL probe at 2 ms and the last ``steps // 10`` steps (at most 20) profiled on GPUs,
    2 on CPU."""
    if gpu and "--timing" not in given:
        cfg.timing = "events"
    if gpu and "--profile-activities" not in given:
        cfg.profile_activities = "cuda"
    if "--gil-probe-ms" not in given:
        cfg.gil_probe_ms = 2.0  # every variant: the GIL wait columns
    if "--profile-steps" not in given:
        cfg.profile_steps = min(20, max(steps // 10, 1)) if gpu else 2


def bench_e2e_main(argv: list[str] | None = None) -> int:
    """``freescale bench e2e --out DIR [--steps N] [--variants ...] [--nproc N]`` (plus
    every ``freescale train`` data / model flag; ``--mode`` and ``--balance`` are ignored:
    the variants set them)."""
    from ..cli import (
        _add_train_flags,
        build_train_config,
        check_devices,
        check_launch,
        launch_local,
        local_ranks,
        resolve_launch,
        resolve_mode,
    )

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="freescale bench e2e", description=__doc__.split("\n")[0])
    _add_train_flags(p)
    p.add_argument("--out", required=True, help="report folder (e2e.json, e2e.md, e2e.png)")
    p.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS + DIAGNOSTIC_VARIANTS),
        default=list(VARIANTS),
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="a one-GPU e2e.json of the same workload: adds scaling_efficiency",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="discarded vanilla steps before the variants (default: 30 on GPU, 0 on CPU)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run the variant list this many times in all, every second pass reversed "
        "(A B, B A, ...): QPS per pass, "
        "the freescale / vanilla ratio per pass and its median, each variant's spread",
    )
    p.add_argument(
        "--merge",
        default=None,
        help="an earlier e2e.json of the same config: its rows join this report's",
    )
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    baseline = merge = None
    if args.baseline:
        with open(args.baseline) as f:
            baseline = json.load(f)
    if args.merge:
        with open(args.merge) as f:
            merge = json.load(f)
    in_torchrun, gpu = resolve_launch(args)
    args.no_progress = True
    resolve_mode(args)  # --overlap-backend given with --mode freescale applies to every variant
    try:  # a bad value: one usage line naming it, before any rank starts
        cfg = build_train_config(args, gpu)
        apply_bench_defaults(cfg, {a.split("=")[0] for a in argv}, gpu, args.steps)
        check_devices(args.device, gpu, local_ranks(args.nproc, in_torchrun))
        check_launch(cfg, int(os.environ["WORLD_SIZE"]) if in_torchrun else args.nproc)
    except ValueError as e:
        p.error(str(e))
    cfg_dict = json.loads(json.dumps(dataclasses.asdict(cfg)))
    command = "freescale bench e2e " + " ".join(argv)
    warmup = args.warmup_steps if args.warmup_steps is not None else (30 if gpu else 0)
    rank_args = (
        cfg_dict, list(args.variants), args.out, args.timeout, command, baseline, merge, warmup,
        args.repeats,
    )  # fmt: skip
    if not (in_torchrun or args.nproc == 1):
        print(
            f"freescale bench e2e: {len(args.variants)} variants x {args.steps} steps on "
            f"{args.nproc} local ranks ({'NCCL' if gpu else 'gloo on CPU'})",
            flush=True,
        )
    rc = launch_local(bench_rank, rank_args, args.nproc, in_torchrun, name="freescale-bench")
    if rc == 0:
        print(f"report: {os.path.join(args.out, 'e2e.json')}", flush=True)
    return rc
