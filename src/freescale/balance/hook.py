"""Trainer integration of the sequence load balancer (the *loader* role).

Owns :class:`BalanceHook`, a :class:`~freescale.pipeline.trainer.TrainerHook` that runs
the three-stage protocol (DESIGN.md section 2.1) on every training step and records
what it did, plus the command-line glue (:func:`add_balance_flags`,
:func:`balance_config_from_args`, :func:`balance_hook_from_args`).

Per batch (synchronous for now, see README.md "Trainer integration"):

* ``on_batch(step=t)``: stages I+II (metadata all-gathers) and III (plan, one
  all-to-all of the jagged samples) for batch ``t`` on the hook's own communicator,
  then hands the trainer the rebalanced local batch; ``extras`` (``global_candidates``,
  which does not change: the same multiset of samples is trained on) are kept. The
  trainer fetches one step ahead, so this runs before step ``t-1`` trains.
* ``on_metrics(step=t)``: feeds the all-gathered per-rank dense times of step ``t`` to
  :meth:`Planner.observe` (cost-model refits, AutoTune), on the training thread, and
  keeps the resulting cost state (``Planner.cost_model_state``) keyed by ``t``; it also
  writes ``rec["balance"]``: the plan summary, predicted vs measured straggler share,
  the lower bound, samples and bytes moved, planning and balancing time, and the
  counters as of step ``t``.
* Plans use the state as of step ``s - METRICS_LAG`` (4,
  :mod:`freescale.pipeline.data_stage`): the newest kept state of a step
  ``<= s - METRICS_LAG``. Which later steps' metrics have arrived when step ``s`` is
  planned depends on thread timing and differs between ranks (the data-stage thread
  plans ahead of the training thread); the plans must not, or the sample exchange
  would move wrong data. Learning stays on the training thread, so a checkpoint's
  planner state is the same on every rank; the kept states go into it too.

It may not touch the model, the embeddings or the loss: it only replaces the local
batch with another placement of the same samples. Evaluation batches are not
balanced (the trainer's ``evaluate`` runs no hooks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist

from freescale.balance.coordinator import BalanceCoordinator, CoordinatorConfig, MoveStats
from freescale.balance.cost_model import CostModel
from freescale.balance.partitioners import PARTITIONERS
from freescale.balance.planner import BalanceConfig, Plan, Planner
from freescale.comm.base import Communicator, process_groups, release_groups
from freescale.data.batch import JaggedBatch
from freescale.pipeline.data_stage import METRICS_LAG
from freescale.pipeline.trainer import Trainer, TrainerHook

__all__ = [
    "BalanceHook",
    "add_balance_flags",
    "balance_config_from_args",
    "balance_hook_from_args",
]

# per-rank arrays go into the step record only up to this world size (log size)
_PER_RANK_MAX_WORLD = 16
# cost states kept by the step they were learned at (plans use the one of step - 4; the
# data-stage thread plans at most ~3 steps ahead of the training thread)
_KEEP_STATES = 32


class BalanceHook(TrainerHook):
    """Balances every training batch across ranks; see the module docstring.

    ``config``: the planner's :class:`BalanceConfig` (identical on every rank; checked
    at start-up). ``comm``: an existing communicator to balance over (default: one on
    a new process group created in ``on_train_start``; all ranks create groups in the
    same order, so hooks must be built identically on every rank). ``cost_model``: a
    starting cost model (overrides ``config.cost_model_path``). ``fuse_metadata``:
    stages I+II in one all-gather padded to the loader's local batch size
    ``ceil(global_batch / W)`` (set False when an earlier hook changes local batch
    sizes). ``verify_plans``: all-gather a checksum of every plan (one tiny extra
    collective per step). ``backend``: backend of the created group (default: the
    default group's).

    Counters: ``samples_moved_total`` / ``bytes_moved_total`` (over all ranks, applied
    plans), ``steps_balanced`` (steps on which samples moved), ``steps_planned``.
    """

    def __init__(
        self,
        config: BalanceConfig | None = None,
        *,
        comm: Communicator | None = None,
        cost_model: CostModel | None = None,
        fuse_metadata: bool = True,
        verify_plans: bool = False,
        backend: str | None = None,
    ) -> None:
        self.config = config or BalanceConfig()
        self.comm = comm
        self._initial_cost_model = cost_model
        self.fuse_metadata = fuse_metadata
        self.verify_plans = verify_plans or self.config.verify_plans
        self.backend = backend
        self.planner: Planner | None = None
        self.coordinator: BalanceCoordinator | None = None
        self.samples_moved_total = 0
        self.bytes_moved_total = 0
        self.steps_balanced = 0
        self.steps_planned = 0
        self.last_plan: Plan | None = None
        self.last_stats: MoveStats | None = None
        self.last_record: dict[str, Any] = {}
        # steps balanced but not yet observed: the trainer fetches (and so balances)
        # batch t+1 before step t trains, so up to two are pending
        self._pending: dict[int, tuple[Plan, MoveStats | None, float, dict[str, int]]] = {}
        # cost states by the last step learned from (None: before any), written by
        # on_metrics (training thread), read by end_batch (the planning thread: the data
        # stage's, or the training thread inline); under the lock: two threads
        self._states: dict[int | None, dict[str, Any]] = {}
        self._states_lock = threading.Lock()
        self.observations_applied = 0
        self._last_metrics: int | None = None  # newest step on_metrics has seen (this run)
        self._made_groups: list[Any] = []  # groups on_train_start made (close() releases)

    def _make_comm(self, trainer: Trainer) -> None:
        """The hook's own communicator (``comm`` not given)."""
        smfree = getattr(trainer, "overlap_backend_name", None)
        host = trainer.world_size > 1 and trainer.ctx.backend == "nccl"
        if host and self.backend is None:
            # the trainer balances host batches (before their copy to the GPU): a
            # gloo group on host memory, SM-free by construction, no device syncs
            self.comm = Communicator(dist.new_group(backend="gloo"), name="balance")
        elif trainer.world_size > 1 and smfree is not None and self.backend is None:
            # the trainer's overlapped traffic goes SM-free (TrainConfig.overlap_backend):
            # so do the balancer's metadata all-gathers and sample moves
            from freescale.comm import create_communicator

            self.comm = create_communicator(
                smfree, name=f"balance-{smfree}", config=trainer.smfree_config()
            )
        elif trainer.world_size > 1:
            group = dist.new_group(backend=self.backend)
            self.comm = Communicator(group, name="balance")
        else:
            self.comm = Communicator(None, name="balance")

    def close(self) -> None:
        """Release what ``on_train_start`` made for the hook: the SM-free communicator's
        worker and the process group(s) (`comm.base.release_groups`: a barrier on the
        hook's group, then each destroyed). Collective when world > 1: every rank calls
        it once it is done with the hook (after the last trainer it serves has trained;
        ``freescale bench e2e`` does so per variant). A communicator passed in is the
        caller's and stays. Idempotent; the next ``on_train_start`` makes a new one."""
        groups, self._made_groups = self._made_groups, []
        if not groups:
            return
        comm, self.comm = self.comm, None
        if self.coordinator is not None:  # rebound by the next on_train_start
            self.coordinator.comm = None  # type: ignore[assignment]
        barrier = comm.group if isinstance(comm, Communicator) else None
        if callable(getattr(comm, "close", None)):
            comm.close()
        release_groups(groups, barrier=barrier if barrier in groups else None)
        if isinstance(comm, Communicator):
            comm.release()

    # ------------------------------------------------------------------ set-up
    def on_train_start(self, trainer: Trainer) -> None:
        if self.comm is None:
            before = process_groups()
            self._make_comm(trainer)
            if before is not None:
                self._made_groups = list((process_groups() or set()) - before)
            if self.coordinator is not None:  # a hook used again after close()
                self.coordinator.comm = self.comm
        if self.comm.world_size != trainer.world_size:
            raise ValueError(
                f"balance communicator has {self.comm.world_size} ranks, the trainer "
                f"{trainer.world_size}"
            )
        if self.planner is None:
            self.planner = Planner(
                self.config,
                self.comm.world_size,
                self.comm.rank,
                cost_model=self._initial_cost_model,
            )
            cap = None
            if self.fuse_metadata:
                cap = -(-trainer.cfg.data.global_batch_size // self.comm.world_size)
            self.coordinator = BalanceCoordinator(
                self.comm,
                self.planner,
                CoordinatorConfig(max_local_samples=cap, verify_plans=self.verify_plans),
            )
        self._pending.clear()  # left over from a call that raised
        with self._states_lock:  # kept across train() calls (and restored on resume)
            self._states.setdefault(None, dict(self.planner.cost_model_state()))
        self._check_same_config()

    def _check_same_config(self) -> None:
        """Every rank must plan with the same configuration (else plans diverge and
        the exchange moves wrong data): one tiny all-gather of a hash."""
        comm = self.comm
        assert comm is not None
        if comm.world_size == 1:
            return
        blob = json.dumps(asdict(self.config), sort_keys=True, default=str).encode()
        h = int(hashlib.sha256(blob).hexdigest()[:15], 16)
        mine = torch.tensor([h], dtype=torch.int64, device=comm.device)
        got = [int(x) for x in torch.cat(comm.all_gather(mine, "balance:config").wait()).tolist()]
        if len(set(got)) != 1:
            bad = [r for r, v in enumerate(got) if v != got[0]]
            raise ValueError(
                f"rank {comm.rank}: ranks {bad} were started with a different BalanceConfig "
                "than rank 0; every rank must balance with identical settings"
            )

    # host batch and own group only: may run on the trainer's data-stage thread
    ahead_safe = True

    # -------------------------------------------------------------------- step
    def on_batch(self, trainer: Trainer, step: int, batch: JaggedBatch) -> JaggedBatch:
        """Synchronous balancing (all three stages now)."""
        return self.end_batch(trainer, step, self.begin_batch(trainer, step, batch))

    def begin_batch(self, trainer: Trainer, step: int, batch: JaggedBatch) -> Any:
        """Stages I and II: issue the metadata all-gathers and return at once; the
        trainer calls this two steps ahead, so they run while the current step computes."""
        if self.coordinator is None:
            raise RuntimeError("BalanceHook.begin_batch before on_train_start")
        t0 = time.perf_counter()
        if batch.step != step:  # the plan log and replay are keyed by the batch's step
            batch = replace(batch, step=step)
        return batch, self.coordinator.start(batch), time.perf_counter() - t0

    def end_batch(self, trainer: Trainer, step: int, handle: Any) -> JaggedBatch:
        """Stage III: wait for the metadata, plan, move the samples."""
        batch, pending, begin_s = handle
        t0 = time.perf_counter()
        out, plan = pending.finish(self._state_for(step))
        ms = (time.perf_counter() - t0 + begin_s) * 1e3
        # same samples, same global candidate count: keep the trainer's extras
        if out is not batch:
            out.extras = dict(batch.extras)
        stats = self.coordinator.last_stats
        self.steps_planned += 1
        if plan.samples_moved > 0:
            self.steps_balanced += 1
        self.samples_moved_total += plan.samples_moved
        self.bytes_moved_total += plan.bytes_moved
        self.last_plan, self.last_stats = plan, stats
        counters = {
            "samples_moved_total": self.samples_moved_total,
            "bytes_moved_total": self.bytes_moved_total,
            "steps_balanced": self.steps_balanced,
        }
        self._pending[step] = (plan, stats, ms, counters)
        return out

    def on_metrics(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None:
        item = self._pending.pop(step, None)
        if item is None:
            return
        self._last_metrics = step
        plan, stats, balance_ms, counters = item
        assert self.planner is not None
        times = record.get("dense_ms_per_rank")
        if times is not None:  # identical on every rank (all-gathered)
            self.planner.observe(plan, times)
            self.observations_applied += 1
            state = dict(self.planner.cost_model_state())
            with self._states_lock:
                self._states[step] = state
                # the planning thread runs at most a few steps ahead: keep the newest
                # _KEEP_STATES (here on the training thread: the same set on every rank)
                steps = sorted(k for k in self._states if k is not None)
                for k in steps[: max(len(steps) - _KEEP_STATES, 0)]:
                    del self._states[k]
        rec = self.step_record(plan, stats, balance_ms, times, record.get("straggler_share"))
        rec.update(counters)  # as of this step (the hook may have balanced t+1 already)
        self.last_record = rec
        record["balance"] = rec

    def _state_for(self, step: int) -> dict[str, Any]:
        """The cost state to plan ``step`` with: the newest kept state of a step
        ``<= step - METRICS_LAG``, else the one from before any learning."""
        last = step - METRICS_LAG
        seen = self._last_metrics
        if seen is not None and seen < last:  # a schedule that finishes metrics later
            raise RuntimeError(  # would plan step with fewer steps learned on some ranks
                f"balance: planning step {step} needs the metrics of step {last}; the "
                f"newest finished is {seen} (the trainer must finish step s's metrics "
                f"before planning s + {METRICS_LAG})"
            )
        with self._states_lock:
            keys = [k for k in self._states if k is not None and k <= last]
            key: int | None = max(keys) if keys else None
            if key in self._states:
                return dict(self._states[key])
        assert self.planner is not None  # nothing kept: a hook driven outside the trainer
        return dict(self.planner.cost_model_state())

    def step_record(
        self,
        plan: Plan,
        stats: MoveStats | None,
        balance_ms: float,
        times: list[float] | None,
        measured: float | None,
    ) -> dict[str, Any]:
        """The ``rec["balance"]`` entry of one step (JSON-serialisable scalars)."""
        s = plan.summary()
        s.pop("step", None)
        # predicted share of what actually ran (the home placement in shadow mode)
        applied = plan.baseline_costs if plan.shadow else plan.rank_costs
        mx = float(applied.max()) if applied.size else 0.0
        mean = float(applied.mean()) if applied.size else 0.0
        lb = float(plan.lower_bound)
        s.update(
            predicted_straggler=plan.straggler_before if plan.shadow else plan.straggler_after,
            measured_straggler=measured,
            # no whole-sample partition can get below this predicted share
            lower_bound_straggler=max(0.0, (lb - mean) / lb) if lb > 0 else 0.0,
            max_over_lower_bound=mx / lb if lb > 0 else 1.0,
            balance_ms=balance_ms,
            local_samples=int(plan.assignment.counts[self.comm.rank]) if self.comm else 0,
            cost_model=dict(plan.cost_model),
        )
        cm = self.planner.cost_model if self.planner is not None else None
        if cm is not None and cm.fitted and cm.fit_error is not None:
            s["cost_model_fit_error"] = cm.fit_error  # plan's "cost_model" says if used
        if self.planner is not None and self.planner.rejected_measurements:
            s["rejected_rank_times"] = self.planner.rejected_measurements  # run total
        if stats is not None:
            s.update(
                local_samples_sent=stats.samples_sent,
                local_samples_received=stats.samples_received,
                local_bytes_sent=stats.bytes_sent,
                local_bytes_received=stats.bytes_received,
                metadata_bytes=stats.metadata_bytes,
                collectives=stats.collectives,
                exchange_skipped=stats.exchange_skipped,
                finish_ms=stats.finish_ms,
            )
        if plan.world_size <= _PER_RANK_MAX_WORLD:
            s["predicted_rank_costs"] = [float(x) for x in applied]
            s["rank_tokens"] = [float(x) for x in plan.rank_tokens]
            s["rank_sum_sq"] = [float(x) for x in plan.rank_sum_sq]
            if times is not None:
                s["measured_rank_ms"] = [float(x) for x in times]
        return s

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        summary["balance"] = self.summary()

    # ------------------------------------------------------------- reporting
    def summary(self) -> dict[str, Any]:
        """Run-level counters and the planner's learned state."""
        out: dict[str, Any] = {
            "partitioner": self.config.partitioner,
            "shadow": self.config.shadow,
            "steps_planned": self.steps_planned,
            "steps_balanced": self.steps_balanced,
            "samples_moved_total": self.samples_moved_total,
            "bytes_moved_total": self.bytes_moved_total,
        }
        if self.planner is not None:
            out["alpha"] = self.planner.alpha
            cm = self.planner.cost_model
            if cm.fitted:
                out["cost_model"] = {
                    "a": cm.a,
                    "b": cm.b,
                    "c": cm.c,
                    "fit_error": cm.fit_error,
                    # False: plans use L^alpha (the fit's length terms explain nothing,
                    # Planner._length_matters) or the config asks for no model
                    "used": self.planner.cost_model_state()["kind"] == "fit",
                }
        return out

    # -------------------------------------------------------------- checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Planner state (cost-model fit, AutoTune) and counters; restore on resume
        together with ``BalanceConfig.replay_path`` for an exact replay. Call it on the
        training thread (as :class:`~freescale.pipeline.checkpoint.CheckpointHook`
        does): the planner learns there, so its state is the same on every rank. The
        kept cost states (up to ``_KEEP_STATES``) go with it, so the resumed ranks plan
        their next steps alike. Not as an uninterrupted run would without the replay log:
        a checkpoint is written before its step's metrics are finished, so the resumed
        run never learns from the last one to three steps before it. The counters are
        reporting only; with the data-stage thread they include the steps it had planned
        ahead, which differ by rank and are planned again after the resume."""
        with self._states_lock:
            states = [[k, dict(v)] for k, v in self._states.items()]
        return {
            "planner": None if self.planner is None else self.planner.state_dict(),
            "cost_states": states,
            "counters": {
                "samples_moved_total": self.samples_moved_total,
                "bytes_moved_total": self.bytes_moved_total,
                "steps_balanced": self.steps_balanced,
                "steps_planned": self.steps_planned,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Call after ``on_train_start`` (the planner exists then)."""
        if state.get("planner") is not None:
            if self.planner is None:
                raise RuntimeError("BalanceHook.load_state_dict before on_train_start")
            self.planner.load_state_dict(state["planner"])
        with self._states_lock:
            if "cost_states" in state:
                self._states = {k: dict(v) for k, v in state["cost_states"]}
            if self.planner is not None:  # a checkpoint without states: plan with the
                # restored planner's until the first learned step (the same on every rank)
                self._states.setdefault(None, dict(self.planner.cost_model_state()))
        for k, v in state.get("counters", {}).items():
            setattr(self, k, int(v))


# ------------------------------------------------------------------------- CLI
# ``--mode freescale``'s balancer (cli.resolve_mode, and bench e2e's ``freescale`` variant
# and every ``freescale_*`` variant that does not name its partitioner): sticky (swaps from
# the home placement: few samples move) on the cost model ``a*L + b*L^2 + c`` refitted from
# the measured per-rank dense times every 20 steps (``L^alpha`` until the first fit). Why
# (BENCHMARKS.md, e2e, session 17): on 2 H200 over 1,000 steps fbs's eval NE sat 5.5x
# above the in-rank noise floor in every report while the sticky family's fell within
# it; sticky costs the data stage less (few moves) with QPS within the run-to-run spread
# of fbs's; at 64-256 ranks sticky needs the fitted cost (sticky_robustness.json).
# Plans then depend on measured times: ``--balance-log`` records them for replay
# (``freescale train --mode freescale --log PATH`` does by default).
FREESCALE_PARTITIONER = "sticky"
FREESCALE_REFIT_EVERY = 20


def add_balance_flags(p: argparse.ArgumentParser) -> None:
    """``--balance ...`` flags of ``freescale train``."""
    names = sorted(PARTITIONERS)
    p.add_argument(
        "--balance",
        choices=["off", *names],
        default=None,
        help="sequence load balancing partitioner (default off; with --mode freescale "
        f"{FREESCALE_PARTITIONER} on a cost model refitted every {FREESCALE_REFIT_EVERY} "
        "steps; fbs is the paper's)",
    )
    p.add_argument("--balance-alpha", type=float, default=1.5, help="L^alpha sample costs")
    p.add_argument(
        "--balance-cost-model",
        default=None,
        help="JSON {a, b, c} fit; plans with a*L + b*L^2 instead of L^alpha",
    )
    p.add_argument(
        "--balance-refit-every",
        type=int,
        default=None,
        help="refit the cost model from measured dense times every k steps (0: never; "
        f"default 0, {FREESCALE_REFIT_EVERY} with --mode freescale and no --balance)",
    )
    p.add_argument("--balance-autotune", action="store_true", help="AutoTune alpha (VBS)")
    p.add_argument(
        "--balance-shadow", action="store_true", help="plan and report only; move nothing"
    )
    p.add_argument(
        "--balance-candidate-tokens",
        type=int,
        default=0,
        help="tokens a candidate adds to a sample's length in the cost",
    )
    p.add_argument(
        "--balance-log",
        default=None,
        help="plan log (JSON lines) path; with --mode freescale's default balancer (plans "
        "depend on measured times) and --log PATH: PATH's stem + '.plans.jsonl', compact",
    )
    p.add_argument(
        "--balance-log-detail",
        choices=["full", "compact"],
        default=None,
        help="full: assignments (self-contained replay); compact: cost state and checksums "
        "(replay recomputes and verifies; ~100 bytes a step). Default full",
    )
    p.add_argument("--balance-replay", default=None, help="replay plans from this plan log")
    p.add_argument(
        "--balance-verify-plans",
        action="store_true",
        help="all-gather a checksum of every plan; raise naming the step if ranks differ",
    )


def balance_config_from_args(args: argparse.Namespace) -> BalanceConfig | None:
    """The :class:`BalanceConfig` the flags ask for, or None (``--balance off`` or
    the flags absent). Picklable: pass it to the ranks and build the hook there."""
    name = getattr(args, "balance", "off") or "off"
    if name == "off":
        return None
    cm_path = getattr(args, "balance_cost_model", None)
    refit = int(getattr(args, "balance_refit_every", 0) or 0)
    return BalanceConfig(
        partitioner=name,
        alpha=float(getattr(args, "balance_alpha", 1.5)),
        use_cost_model=bool(cm_path) or refit > 0,
        cost_model_path=cm_path,
        refit_every=refit,
        shadow=bool(getattr(args, "balance_shadow", False)),
        autotune=bool(getattr(args, "balance_autotune", False)),
        candidate_tokens=int(getattr(args, "balance_candidate_tokens", 0) or 0),
        log_path=getattr(args, "balance_log", None),
        log_detail=getattr(args, "balance_log_detail", None) or "full",
        replay_path=getattr(args, "balance_replay", None),
        verify_plans=bool(getattr(args, "balance_verify_plans", False)),
    )


def balance_hook_from_args(args: argparse.Namespace) -> BalanceHook | None:
    """A :class:`BalanceHook` for the flags of :func:`add_balance_flags`, or None."""
    cfg = balance_config_from_args(args)
    return None if cfg is None else BalanceHook(cfg)
