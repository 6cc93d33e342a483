"""The planner of the sequence load balancer: global metadata in, logged plan out.

Owns: :class:`BalanceConfig`, :class:`GlobalMetadata` (the all-gathered per-sample
lengths, candidate counts, sample ids and home ranks of one step, in canonical
ascending-sample-id order), :class:`Plan` (the assignment to apply plus its predicted
metrics), :class:`PlanLog` (JSON lines; exact replay by step) and :class:`Planner`,
which runs a partitioner on a cost vector, measures and logs it, and learns from
measured times (cost-model refits, AutoTune).

Every rank builds the same :class:`GlobalMetadata` and runs the same planner state,
so every rank computes the same plan without talking. Plans depend on measured times
(AutoTune, cost-model fits), so every plan is logged and can be replayed exactly on
resume. Shadow mode plans and reports the predicted gain but applies the home
placement (no sample moves). This module sees metadata only: it never touches
tensors or communicators (see ``coordinator.py`` for the data movement).
"""

from __future__ import annotations

import base64
import json
import os
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from freescale.balance.cost_model import AutoTune, AutoTuneConfig, CostModel
from freescale.balance.partitioners import (
    Assignment,
    canonical_order,
    get_partitioner,
    lower_bound,
    straggler_share,
)

__all__ = ["BalanceConfig", "GlobalMetadata", "Plan", "PlanLog", "Planner"]


# ------------------------------------------------------------------------- config
@dataclass
class BalanceConfig:
    """How the sequence load balancer plans (one per run; identical on every rank)."""

    partitioner: str = "fbs"  # identity | fbs | vbs | kk (or a registered name)
    alpha: float = 1.5  # default per-sample cost L^alpha
    use_cost_model: bool = False  # use the fitted a*L + b*L^2 (+c) instead of L^alpha
    cost_model_path: str | None = None  # JSON {a, b, c} to start from (counts as fitted)
    refit_every: int = 0  # refit the cost model every k observed steps (0: never)
    fit_window: int = 4096  # most recent per-rank measurements kept for fitting
    shadow: bool = False  # plan + report, but apply the home placement
    autotune: bool = False  # AutoTune alpha from measured times (L^alpha costs only)
    autotune_config: AutoTuneConfig = field(default_factory=AutoTuneConfig)
    candidate_tokens: int = 0  # tokens a candidate adds to L (1 if the model appends them)
    log_path: str | None = None  # JSON lines; "{rank}" in it: one file per rank, else rank 0
    # "full": assignments + per-rank arrays (self-contained replay, ~2.7 bytes a sample);
    # "compact": scalars, cost state and checksums (replay recomputes and verifies)
    log_detail: str = "full"
    replay_path: str | None = None  # a plan log: logged steps are replayed, not re-planned
    # all-gather a checksum of every plan and raise, naming the step, when the ranks'
    # plans differ (one tiny collective per step; BalanceHook(verify_plans=True) too)
    verify_plans: bool = False

    def __post_init__(self) -> None:
        fn = get_partitioner(self.partitioner)  # fail early on a typo
        if getattr(fn, "plans_on_lengths", False) and (
            self.use_cost_model or self.cost_model_path or self.autotune
        ):
            raise ValueError(
                f"partitioner '{self.partitioner}' plans on the sample lengths and ignores "
                "per-sample costs: a cost model (use_cost_model / cost_model_path; "
                "--balance-cost-model, --balance-refit-every) or AutoTune "
                "(--balance-autotune) would have no effect; drop it or choose a "
                "cost-driven partitioner (fbs, kk, sticky)"
            )
        if self.alpha < 0:
            raise ValueError("alpha must be >= 0")
        if self.candidate_tokens < 0:
            raise ValueError("candidate_tokens must be >= 0")
        if self.log_detail not in ("full", "compact"):
            raise ValueError(f"log_detail must be 'full' or 'compact', got '{self.log_detail}'")


# ----------------------------------------------------------------------- metadata
@dataclass
class GlobalMetadata:
    """One step's gathered metadata, in canonical order (ascending sample id; ties by
    gathered position). ``home_rank[g]`` / ``home_pos[g]``: where sample ``g`` is now."""

    step: int
    world_size: int
    counts: np.ndarray  # samples per rank before balancing
    lengths: np.ndarray  # composite UIH length (sum over keys), int64
    num_candidates: np.ndarray  # int64
    sample_ids: np.ndarray  # int64, ascending
    home_rank: np.ndarray  # int64
    home_pos: np.ndarray  # int64 position inside the home rank's local batch
    bytes_per_sample: np.ndarray | None = None  # wire bytes of each sample, if known

    @property
    def num_samples(self) -> int:
        return int(self.lengths.size)

    @staticmethod
    def from_rank_lists(
        step: int,
        lengths: Sequence[np.ndarray],
        num_candidates: Sequence[np.ndarray],
        sample_ids: Sequence[np.ndarray] | None = None,
        bytes_per_sample: Sequence[np.ndarray] | None = None,
    ) -> GlobalMetadata:
        """From per-rank arrays (index = rank) as gathered; sorts into canonical order."""
        w = len(lengths)
        counts = np.array([len(x) for x in lengths], dtype=np.int64)
        cat = lambda xs: (  # noqa: E731
            np.concatenate([np.asarray(x, dtype=np.int64) for x in xs])
            if w
            else np.zeros(0, np.int64)
        )
        ln, nc = cat(lengths), cat(num_candidates)
        n = ln.size
        ids = cat(sample_ids) if sample_ids is not None else np.arange(n, dtype=np.int64)
        home = np.repeat(np.arange(w, dtype=np.int64), counts)
        pos = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        if n < 2 or bool((ids[1:] >= ids[:-1]).all()):
            order = np.arange(n, dtype=np.int64)  # vanilla: rank-major is id order
        else:
            order = canonical_order(ids)
        bps = None
        if bytes_per_sample is not None:
            bps = np.concatenate([np.asarray(x, np.int64) for x in bytes_per_sample])[order]
        return GlobalMetadata(
            step=int(step),
            world_size=w,
            counts=counts,
            lengths=ln[order],
            num_candidates=nc[order],
            sample_ids=ids[order],
            home_rank=home[order],
            home_pos=pos[order],
            bytes_per_sample=bps,
        )

    @staticmethod
    def from_lengths(
        step: int,
        lengths: np.ndarray,
        world_size: int,
        num_candidates: np.ndarray | None = None,
    ) -> GlobalMetadata:
        """Vanilla placement of a global batch: rank r holds the r-th contiguous run."""
        ln = np.asarray(lengths, dtype=np.int64)
        n = ln.size
        base, extra = divmod(n, world_size)
        counts = np.full(world_size, base, dtype=np.int64)
        counts[:extra] += 1
        nc = np.zeros(n, np.int64) if num_candidates is None else np.asarray(num_candidates)
        parts = np.split(np.arange(n), np.cumsum(counts)[:-1])
        return GlobalMetadata.from_rank_lists(
            step, [ln[p] for p in parts], [nc[p] for p in parts], [p for p in parts]
        )

    def effective_lengths(self, candidate_tokens: int = 0) -> np.ndarray:
        """Sequence length the dense model sees: composite UIH (+ candidates)."""
        if candidate_tokens:
            return self.lengths + candidate_tokens * self.num_candidates
        return self.lengths

    def estimated_bytes(self) -> np.ndarray:
        """Wire bytes per sample (coordinator's int64 packing) unless given."""
        if self.bytes_per_sample is not None:
            return self.bytes_per_sample
        return 8 * (self.lengths + 2) + 16 * self.num_candidates

    def home_assignment(self) -> Assignment:
        h = self.home_rank
        if h.size < 2 or bool((h[1:] >= h[:-1]).all()):  # vanilla: contiguous runs
            return Assignment.contiguous(self.counts)
        return Assignment.from_ranks(h, self.world_size)

    def digest(self) -> str:
        """Checksum of what a plan is a function of (to check a replayed plan applies):
        sample count and crc32 of step, counts, lengths, candidate counts, sample ids."""
        crc = 0
        for a in (
            np.int64([self.step, self.world_size]),
            self.counts,
            self.lengths,
            self.num_candidates,
            self.sample_ids,
        ):
            crc = zlib.crc32(np.ascontiguousarray(a, dtype="<i8").data, crc)
        return f"{self.num_samples:x}-{crc:08x}"


# --------------------------------------------------------------------------- plan
def _pack_ranks(rank_of: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(rank_of.astype("<i4").tobytes(), 6)).decode()


def _unpack_ranks(s: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(s)), dtype="<i4").astype(np.int64)


def _crc(a: Assignment) -> int:
    return zlib.crc32(np.ascontiguousarray(a.rank_of, dtype="<i8").data)


@dataclass
class Plan:
    """One step's balancing decision. Indices are canonical (ascending sample id).

    ``assignment`` is what the coordinator applies (the home placement in shadow mode);
    ``proposed`` is what the partitioner produced. Predicted costs use the planner's
    cost function of that step (``L^alpha`` or the fitted model, see ``cost_model``).
    """

    step: int
    partitioner: str
    shadow: bool
    world_size: int
    assignment: Assignment
    proposed: Assignment
    rank_costs: np.ndarray  # predicted per-rank cost of `proposed`
    baseline_costs: np.ndarray  # predicted per-rank cost of the home placement
    lower_bound: float
    straggler_before: float  # predicted, home placement
    straggler_after: float  # predicted, proposed plan
    planning_ms: float
    samples_moved: int  # by `assignment` (0 in shadow mode)
    bytes_moved: int  # estimate, by `assignment`
    proposed_samples_moved: int
    proposed_bytes_moved: int
    rank_tokens: np.ndarray  # per rank sum of effective L under `assignment`
    rank_sum_sq: np.ndarray  # per rank sum of L^2 under `assignment`
    alpha: float
    cost_model: dict
    digest: str  # GlobalMetadata.digest() of the input
    replayed: bool = False

    @property
    def per_rank(self) -> list[np.ndarray]:
        """Per-rank ordered sample lists of the applied assignment."""
        return self.assignment.per_rank

    @property
    def predicted_max(self) -> float:
        return float(self.rank_costs.max()) if self.rank_costs.size else 0.0

    @property
    def predicted_mean(self) -> float:
        return float(self.rank_costs.mean()) if self.rank_costs.size else 0.0

    @property
    def predicted_gain(self) -> float:
        """Predicted max per-rank cost of the home placement over that of the plan."""
        b = float(self.baseline_costs.max()) if self.baseline_costs.size else 0.0
        return b / self.predicted_max if self.predicted_max > 0 else 1.0

    def summary(self) -> dict:
        """Scalar metrics (what a training log records per step)."""
        return {
            "step": self.step,
            "partitioner": self.partitioner,
            "shadow": self.shadow,
            "predicted_max": self.predicted_max,
            "predicted_mean": self.predicted_mean,
            "lower_bound": self.lower_bound,
            "straggler_before": self.straggler_before,
            "straggler_after": self.straggler_after,
            "predicted_gain": self.predicted_gain,
            "planning_ms": self.planning_ms,
            "samples_moved": self.samples_moved,
            "bytes_moved": self.bytes_moved,
            "proposed_samples_moved": self.proposed_samples_moved,
            "proposed_bytes_moved": self.proposed_bytes_moved,
            "alpha": self.alpha,
        }

    def to_json(self, detail: str = "full") -> str:
        """One JSON line. ``detail="compact"`` keeps scalars, the cost state and
        checksums only (:class:`Planner` replays it by recomputing and verifying)."""
        d = self.summary()
        d.update(
            world_size=self.world_size,
            num_samples=self.assignment.num_samples,
            lower_bound=self.lower_bound,
            cost_model=self.cost_model,
            digest=self.digest,
            rank_of_crc=_crc(self.assignment),
            proposed_crc=_crc(self.proposed),
        )
        if detail == "full":
            d.update(
                rank_costs=self.rank_costs.tolist(),
                baseline_costs=self.baseline_costs.tolist(),
                rank_tokens=self.rank_tokens.tolist(),
                rank_sum_sq=self.rank_sum_sq.tolist(),
                rank_of=_pack_ranks(self.assignment.rank_of),
            )
            if not self.proposed.equals(self.assignment):
                d["proposed_rank_of"] = _pack_ranks(self.proposed.rank_of)
        return json.dumps(d, sort_keys=True)

    @staticmethod
    def from_json(line: str | dict) -> Plan:
        """A plan from a *full* log record (compact records need the metadata)."""
        d = json.loads(line) if isinstance(line, str) else line
        if "rank_of" not in d:
            raise ValueError(
                f"plan log record of step {d.get('step')} is compact; replay it through "
                "Planner(BalanceConfig(replay_path=...)) with that step's metadata"
            )
        w = int(d["world_size"])
        applied = Assignment.from_ranks(_unpack_ranks(d["rank_of"]), w)
        proposed = (
            Assignment.from_ranks(_unpack_ranks(d["proposed_rank_of"]), w)
            if "proposed_rank_of" in d
            else applied
        )
        arr = lambda k: np.asarray(d[k], dtype=np.float64)  # noqa: E731
        return Plan(
            step=int(d["step"]),
            partitioner=d["partitioner"],
            shadow=bool(d["shadow"]),
            world_size=w,
            assignment=applied,
            proposed=proposed,
            rank_costs=arr("rank_costs"),
            baseline_costs=arr("baseline_costs"),
            lower_bound=float(d["lower_bound"]),
            straggler_before=float(d["straggler_before"]),
            straggler_after=float(d["straggler_after"]),
            planning_ms=float(d["planning_ms"]),
            samples_moved=int(d["samples_moved"]),
            bytes_moved=int(d["bytes_moved"]),
            proposed_samples_moved=int(d["proposed_samples_moved"]),
            proposed_bytes_moved=int(d["proposed_bytes_moved"]),
            rank_tokens=arr("rank_tokens"),
            rank_sum_sq=arr("rank_sum_sq"),
            alpha=float(d["alpha"]),
            cost_model=d["cost_model"],
            digest=d["digest"],
        )

    def same_as(self, other: Plan) -> bool:
        """Same decision and predictions (planning time and the replay flag aside)."""
        return (
            self.step == other.step
            and self.digest == other.digest
            and self.assignment.equals(other.assignment)
            and self.proposed.equals(other.proposed)
            and np.array_equal(self.rank_costs, other.rank_costs)
            and np.array_equal(self.baseline_costs, other.baseline_costs)
            and self.samples_moved == other.samples_moved
            and self.bytes_moved == other.bytes_moved
        )


class PlanLog:
    """Append-only JSON-lines plan log, one record per step.

    ``read`` returns the raw records by step; ``replay`` the exact :class:`Plan` of a
    step from a full record. A planner built with ``replay_path`` replays logged steps
    (full or compact) instead of planning them.
    """

    def __init__(self, path: str, detail: str = "full") -> None:
        self.path = path
        self.detail = detail
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)

    def append(self, plan: Plan) -> None:
        with open(self.path, "a") as f:
            f.write(plan.to_json(self.detail) + "\n")

    @staticmethod
    def read(path: str) -> dict[int, dict]:
        """Records by step (a step logged twice: the last entry wins)."""
        records: dict[int, dict] = {}
        with open(path) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    records[int(rec["step"])] = rec
        return records

    @staticmethod
    def replay(path: str, step: int) -> Plan | None:
        """The logged plan of ``step`` (full records), or None if not logged."""
        rec = PlanLog.read(path).get(step)
        return None if rec is None else Plan.from_json(rec)


# ------------------------------------------------------------------------ planner
def _state_model(state: dict) -> CostModel:
    if state["kind"] == "fit":
        return CostModel(a=state["a"], b=state["b"], c=state["c"], fitted=True)
    return CostModel(alpha=float(state["alpha"]))


class Planner:
    """Runs the configured partitioner on global metadata; learns from measured times.

    Identical on every rank (same config, same observations in the same order), so
    every rank computes the same plan. ``rank`` only decides who writes the log.
    """

    def __init__(
        self,
        config: BalanceConfig | None = None,
        world_size: int = 1,
        rank: int = 0,
        cost_model: CostModel | None = None,
    ) -> None:
        self.config = config or BalanceConfig()
        self.world_size = int(world_size)
        self.rank = int(rank)
        cfg = self.config
        if cost_model is not None:  # a copy: refits must not change the caller's model
            self.cost_model = CostModel.from_dict(cost_model.to_dict())
        elif cfg.cost_model_path:
            self.cost_model = CostModel.load(cfg.cost_model_path)
        else:
            self.cost_model = CostModel(alpha=cfg.alpha)
        self.autotune = (
            AutoTune(replace(cfg.autotune_config, alpha=cfg.alpha)) if cfg.autotune else None
        )
        self._measurements: deque[tuple[float, float, float]] = deque(maxlen=cfg.fit_window)
        self._observed = 0
        # rank times that were not finite and >= 0 (a timing mis-attribution), skipped
        self.rejected_measurements = 0
        self._fit_usable = self._length_matters()
        self._replay = PlanLog.read(cfg.replay_path) if cfg.replay_path else {}
        self._log: PlanLog | None = None
        if cfg.log_path and ("{rank}" in cfg.log_path or self.rank == 0):
            self._log = PlanLog(cfg.log_path.format(rank=self.rank), cfg.log_detail)

    # ---------------------------------------------------------------- costing
    @property
    def alpha(self) -> float:
        return self.autotune.alpha if self.autotune is not None else self.config.alpha

    def _uses_fit(self) -> bool:
        """Plan with the fitted model: asked for, fitted, and not degenerate
        (:meth:`_length_matters`)."""
        cm = self.cost_model
        return self.config.use_cost_model and cm.fitted and self._fit_usable

    def _length_matters(self) -> bool:
        """Whether the fit's length terms explain any of the measured time: at the mean
        measured ``(tokens, sum L^2)``, ``a*tokens + b*sum L^2`` above ``1e-6`` of the
        predicted total (a model loaded from a file without measurements: ``a`` or ``b``
        positive). A fit with ``a == b == 0`` up to rounding (the measured times did not
        grow with length: noise, or a step bound by something else) gives every sample
        a cost of ~0, with which no partitioner balances anything, so plans keep
        ``L^alpha`` until a later refit sees lengths matter (``cost_model_state`` says
        which one a plan used)."""
        cm = self.cost_model
        if not self._measurements:
            return cm.a > 0.0 or cm.b > 0.0
        m = np.asarray(self._measurements, dtype=np.float64)
        part = cm.a * float(m[:, 0].mean()) + cm.b * float(m[:, 1].mean())
        return part > 1e-6 * (part + cm.c)

    def cost_model_state(self) -> dict:
        """The cost function plans are made with now (logged with every plan)."""
        if self._uses_fit():
            cm = self.cost_model
            return {"kind": "fit", "a": cm.a, "b": cm.b, "c": cm.c, "alpha": self.alpha}
        return {"kind": "power", "alpha": self.alpha}

    def sample_costs(self, lengths: np.ndarray, state: dict | None = None) -> np.ndarray:
        """Per-sample planning cost of effective lengths (current or given state)."""
        return _state_model(state or self.cost_model_state()).sample_costs(lengths)

    # --------------------------------------------------------------- planning
    def plan(self, meta: GlobalMetadata, state: dict | None = None) -> Plan:
        """The plan of ``meta.step`` (replayed from the log when it holds that step).
        ``state``: the cost state to plan with (a :meth:`cost_model_state` taken
        earlier; :class:`~freescale.balance.hook.BalanceHook` passes the one as of step
        ``meta.step - METRICS_LAG``, the same on every rank); default the current one."""
        if meta.world_size != self.world_size:
            raise ValueError(
                f"metadata has {meta.world_size} ranks, planner expects {self.world_size}"
            )
        digest = meta.digest()
        rec = self._replay.get(meta.step)
        if rec is not None:
            plan = self._replay_record(rec, meta, digest)
        else:
            cfg = self.config
            if state is None:
                state = self.cost_model_state()
            plan = self._compute(meta, digest, cfg.partitioner, cfg.shadow, state)
        if self._log is not None and not (
            plan.replayed and self._log.path == self.config.replay_path
        ):
            self._log.append(plan)
        return plan

    def _replay_record(self, rec: dict, meta: GlobalMetadata, digest: str) -> Plan:
        where = f"plan log {self.config.replay_path} step {meta.step}"
        if rec["digest"] != digest:
            raise ValueError(
                f"{where}: logged for different metadata (digest {rec['digest']} != "
                f"{digest}); the data order changed since the run that wrote it"
            )
        plan = self._compute(
            meta, digest, rec["partitioner"], bool(rec["shadow"]), rec["cost_model"]
        )
        ok = (
            _crc(plan.assignment) == rec["rank_of_crc"]
            and _crc(plan.proposed) == rec["proposed_crc"]
        )
        if "rank_of" in rec:
            logged = Plan.from_json(rec)
            if not (ok and plan.same_as(logged)):
                plan = logged  # the code changed since: the logged decision wins
        elif not ok:
            raise RuntimeError(
                f"{where}: recomputing the compact record gives a different assignment "
                "(partitioner code or numeric libraries changed); log with "
                "log_detail='full' to replay across such changes"
            )
        plan.planning_ms = float(rec["planning_ms"])
        plan.replayed = True
        return plan

    def _compute(
        self, meta: GlobalMetadata, digest: str, partitioner: str, shadow: bool, state: dict
    ) -> Plan:
        t0 = time.perf_counter()
        length = meta.effective_lengths(self.config.candidate_tokens)
        costs = self.sample_costs(length, state)
        home = meta.home_assignment()
        fn = get_partitioner(partitioner)
        # a partitioner that starts from where the samples are (sticky) gets the home
        kw = {"home": home} if getattr(fn, "accepts_home", False) else {}
        proposed = fn(costs, self.world_size, sort_key=length, **kw)
        const = float(state.get("c", 0.0))
        rank_costs = proposed.rank_sums(costs) + const
        base_costs = home.rank_sums(costs) + const
        moved = proposed.rank_of != meta.home_rank
        nbytes = meta.estimated_bytes()
        p_moved, p_bytes = int(moved.sum()), int(nbytes[moved].sum())
        applied = home if shadow else proposed
        lf = length.astype(np.float64)
        plan = Plan(
            step=meta.step,
            partitioner=partitioner,
            shadow=shadow,
            world_size=self.world_size,
            assignment=applied,
            proposed=proposed,
            rank_costs=rank_costs,
            baseline_costs=base_costs,
            lower_bound=lower_bound(costs, self.world_size) + const,
            straggler_before=straggler_share(base_costs),
            straggler_after=straggler_share(rank_costs),
            planning_ms=0.0,
            samples_moved=0 if shadow else p_moved,
            bytes_moved=0 if shadow else p_bytes,
            proposed_samples_moved=p_moved,
            proposed_bytes_moved=p_bytes,
            rank_tokens=applied.rank_sums(lf),
            rank_sum_sq=applied.rank_sums(lf * lf),
            alpha=float(state["alpha"]),
            cost_model=dict(state),
            digest=digest,
        )
        plan.planning_ms = (time.perf_counter() - t0) * 1e3
        return plan

    # -------------------------------------------------------------- learning
    def observe(self, plan: Plan, rank_times_ms: Sequence[float]) -> None:
        """Feed the measured dense time of every rank for the step ``plan`` ran
        (all-gathered by the caller; identical on every rank)."""
        t = np.asarray(rank_times_ms, dtype=np.float64)
        if t.size != self.world_size:
            raise ValueError(f"need {self.world_size} rank times, got {t.size}")
        tokens, sum_sq = plan.rank_tokens, plan.rank_sum_sq
        counts = plan.assignment.counts
        for r in range(self.world_size):
            if counts[r] == 0:
                continue
            if not (np.isfinite(t[r]) and t[r] >= 0):  # a timing artifact, not a cost: the
                self.rejected_measurements += 1  # same skip on every rank (same times)
                continue
            self._measurements.append((float(tokens[r]), float(sum_sq[r]), float(t[r])))
        self._observed += 1
        cfg = self.config
        if cfg.use_cost_model and cfg.refit_every and self._observed % cfg.refit_every == 0:
            if len(self._measurements) >= 3:
                self.cost_model.fit(list(self._measurements))
                self._fit_usable = self._length_matters()
        if self.autotune is not None and not self._uses_fit():
            mean_len = np.where(counts > 0, tokens / np.maximum(counts, 1), 0.0)
            self.autotune.update(t, mean_len)

    def state_dict(self) -> dict:
        return {
            "cost_model": self.cost_model.to_dict(),
            "autotune": None if self.autotune is None else self.autotune.state_dict(),
            "measurements": [list(m) for m in self._measurements],
            "observed": self._observed,
            # decided at the last refit from the measurements held then (later ones
            # would decide differently near the threshold): saved, not recomputed
            "fit_usable": self._fit_usable,
        }

    def load_state_dict(self, state: dict) -> None:
        self.cost_model = CostModel.from_dict(state["cost_model"])
        if state.get("autotune") is not None:
            if self.autotune is None:
                self.autotune = AutoTune()
            self.autotune.load_state_dict(state["autotune"])
        self._measurements.clear()
        self._measurements.extend(tuple(m) for m in state["measurements"])
        self._observed = int(state["observed"])
        usable = state.get("fit_usable")  # absent in states saved before session 17
        self._fit_usable = self._length_matters() if usable is None else bool(usable)

    def config_dict(self) -> dict:
        return asdict(self.config)
