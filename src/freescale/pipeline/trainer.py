"""The staged training loop (vanilla schedule) with explicit hook points.

Owns one rank's training run: building the sharded embeddings, the DDP-replicated
dense model and its optimizer from a :class:`~freescale.config.TrainConfig`; the five
stages of a step (data, forward, backward, optimizer, metrics) with a hook before /
after each; per-stage timing; the progress bar, the JSON-lines log, periodic
evaluation and the final summary. Later techniques (balancing, prioritized updates,
SM-free communication) plug into the hooks or replace the embedding module; this loop
never traces the user's model.

Numerics (DESIGN.md section 1): the loss is the sum of per-candidate BCE terms divided
by the *global* candidate count of the step. Dense gradients are *summed* over ranks
(a SUM communication hook on DDP instead of its average), and sparse gradients are
summed at the owners, so both are exactly the gradient of the global loss: neither the
world size nor the placement of samples changes what is optimised. (Scaling the local
loss by W under DDP's average would fix the dense side but make every sparse gradient
W times too large.)

Bad input is rejected at the data stage on the rank that loaded it; before any id
reaches an owner, every rank learns of it through one small all-reduce and raises, so
no collective hangs and no update is half applied.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import threading
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import record_function

from ..comm import base as comm_base
from ..comm.base import Communicator, process_groups, release_groups
from ..config import CANDIDATE_FEATURE, TrainConfig, config_to_dict, default_tables
from ..data.batch import JaggedBatch
from ..data.loader import PrefetchingLoader
from ..data.validate import BadInputError, validate_batch
from ..embedding.prioritized import make_embedding_collection
from ..metrics.auc import AUCAccumulator
from ..metrics.host_cpu import GilProbe, ThreadCpuMeter
from ..metrics.ne import NEAccumulator
from ..models.sequence import SequenceRecModel, sum_bce_loss
from .compile_watch import CompileWatch
from .data_stage import DataStageThread, PreparedBatch
from .distributed import RankContext, check_config_hash, init_distributed
from .placement import (
    Placement,
    apply_placement,
    cpu_topology,
    gpu_local_cpus,
    plan_placement,
    restore_affinities,
    thread_affinities,
    topology_summary,
)
from .progress import make_progress

if TYPE_CHECKING:
    from ..comm.copy_engine import SMFreeConfig

__all__ = ["Trainer", "TrainerHook", "make_source", "StageTimes", "InputRejected"]

STAGES = ("data", "forward", "backward", "optimizer", "metrics")


class InputRejected(BadInputError):
    """Some rank rejected its input for this step; raised on every rank."""


def set_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for this rank and return the count in force.

    ``requested`` wins; else ``OMP_NUM_THREADS`` (left as torch read it); else the cores
    this process may use / local ranks (``LOCAL_WORLD_SIZE``) / 2, at most 8 — the loader
    thread and the training thread each drive an OpenMP team, and torch's default (all
    cores in every process) oversubscribes a host shared by several ranks."""
    if requested is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        requested = max(1, min(8, cores // local // 2))
    if requested != torch.get_num_threads():
        torch.set_num_threads(requested)
    return requested


class TrainerHook:
    """Base class of stage hooks; override what you need. ``on_batch`` may replace the
    local batch (e.g. the load balancer); the others observe.

    ``ahead_safe``: ``on_batch`` may run on the data-stage thread, steps ahead of the
    training thread (it touches only the host batch and its own process group; the
    balancer). ``passes_batch``: ``on_batch`` returns the batch unchanged (so the id
    counts can be taken before it runs)."""

    ahead_safe: bool = False
    passes_batch: bool = False

    def on_train_start(self, trainer: Trainer) -> None: ...
    def on_batch(self, trainer: Trainer, step: int, batch: JaggedBatch) -> JaggedBatch:
        return batch

    def after_forward(self, trainer: Trainer, step: int, loss: torch.Tensor) -> None: ...
    def after_backward(self, trainer: Trainer, step: int) -> None: ...
    def after_optimizer(self, trainer: Trainer, step: int) -> None: ...
    def on_metrics(self, trainer: Trainer, step: int, record: dict[str, Any]) -> None: ...
    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None: ...


def known_hang_risk(
    mode: str, device_type: str, overlap_backend: str | None, hook_names: Iterable[str]
) -> str | None:
    """The warning for a configuration that hung on GPUs and is not yet fixed, or None.
    prioritized with the copy engine carrying the overlapped traffic and no balancer hung
    2 H200 twice in session 14 (dense all-reduce stuck on both ranks; cause open:
    BENCHMARKS.md e2e). With the balancer (``--mode freescale``) or a NCCL side group no
    hang has been seen."""
    if mode != "prioritized" or device_type != "cuda" or overlap_backend != "copy_engine":
        return None
    if "BalanceHook" in set(hook_names):
        return None
    return (
        "prioritized embeddings with the copy engine and no load balancer hung on 2 H200 "
        "(session 14, cause not yet established; see README 'Known open bug'). Prefer "
        "--mode freescale (with the balancer) or --overlap-backend default (a NCCL side "
        "group); --stall-dump-s prints every thread's stack if a step stalls"
    )


class StallDump(TrainerHook):
    """``TrainConfig.stall_dump_s``: if no step finishes its optimizer within ``seconds``
    (counted from the start of training, then from each step's optimizer), write to
    ``file`` (stderr by default), once per stall — the process keeps running:

    1. every thread's Python stack (:mod:`faulthandler`: works even if a thread holds
       the interpreter lock);
    2. from a Python watchdog thread, the state of every open copy-engine communicator
       (:func:`freescale.comm.copy_engine.stall_reports`: its last jobs' phases and
       whether each of their CUDA events — this rank's and the peers' — has completed).

    For hangs: where the training, autograd, data-stage and communicator worker threads
    of each rank are blocked, and which device-side wait is pending, long before a
    collective's timeout ends the run. Costs one timer re-arm per step."""

    def __init__(self, seconds: float, file: Any = None) -> None:
        if not seconds > 0:
            raise ValueError(f"stall dump needs seconds > 0, got {seconds}")
        self.seconds = float(seconds)
        self.file = file if file is not None else sys.stderr
        self.armed = False
        self.reports = 0  # state reports written (tests)
        self._deadline = 0.0
        self._reported = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _arm(self) -> None:
        faulthandler.dump_traceback_later(self.seconds, repeat=False, file=self.file)
        self._deadline = time.monotonic() + self.seconds
        self._reported = False
        self.armed = True

    def cancel(self) -> None:
        if self.armed:
            faulthandler.cancel_dump_traceback_later()
            self.armed = False

    def close(self) -> None:
        self.cancel()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        self._thread = None

    def _watch(self) -> None:
        poll = min(1.0, self.seconds / 4)
        while not self._stop.wait(poll):
            if not self.armed or self._reported or time.monotonic() < self._deadline:
                continue
            self._reported = True
            try:
                from ..comm.copy_engine import stall_reports

                reps = stall_reports()
            except Exception as e:  # noqa: BLE001 - a report, never a failure
                reps = [f"(copy-engine state unavailable: {e!r})"]
            body = "\n".join(reps) if reps else "(no copy-engine communicator open)"
            print(
                f"[freescale stall] no step finished in {self.seconds:g} s; "
                f"communicator state:\n{body}",
                file=self.file,
                flush=True,
            )
            self.reports += 1

    def on_train_start(self, trainer: Trainer) -> None:
        self._arm()
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="freescale-stall", daemon=True)
            self._thread.start()

    def after_optimizer(self, trainer: Trainer, step: int) -> None:
        self._arm()

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.cancel()


def make_source(cfg: TrainConfig):
    """The data source named by ``cfg.data.source``."""
    if cfg.data.source == "synthetic":
        from ..data.synthetic import SyntheticSource

        return SyntheticSource(cfg.data)
    if cfg.data.source == "movielens":
        from ..data.movielens import MovieLensSource

        if not cfg.data.path:
            raise ValueError("data.source='movielens' needs data.path (a MovieLens-format file)")
        return MovieLensSource(cfg.data)
    raise ValueError(f"unknown data source '{cfg.data.source}'")


@dataclass
class StageTimes:
    """Seconds per stage of one step on this rank (synchronised on CUDA)."""

    values: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, seconds: float) -> None:
        self.values[key] = self.values.get(key, 0.0) + seconds


class Trainer:
    """One rank of a FreeScale training run. ``train()`` returns the summary on every
    rank (identical except for rank-local timings)."""

    def __init__(
        self,
        cfg: TrainConfig,
        hooks: Sequence[TrainerHook] = (),
        ctx: RankContext | None = None,
        source: Any = None,
    ) -> None:
        self.cfg = cfg
        self.cpu_threads = set_cpu_threads(cfg.cpu_threads)
        self.ctx = ctx or init_distributed(cfg.device)
        self.device = self.ctx.device
        self.rank, self.world_size = self.ctx.rank, self.ctx.world_size
        self.hooks = list(hooks)
        if cfg.stall_dump_s > 0:
            self.hooks.append(StallDump(cfg.stall_dump_s))
        self.config_hash = check_config_hash(cfg, self.ctx)
        self.dtype = torch.float64 if cfg.model.dtype == "float64" else torch.float32
        self.source = source if source is not None else make_source(cfg)
        self.uih_keys = list(self.source.uih_keys)
        self.tables = cfg.tables or default_tables(cfg.data, cfg.model, self.uih_keys)
        _fit_table_sizes(self.tables, self.source)
        self.feature_rows = {f: t.num_embeddings for t in self.tables for f in t.feature_names}
        # separate groups: embedding exchange, metadata; DDP keeps the default group.
        # Every group made from here to the end of __init__ (these three, a prioritized or
        # sdd collection's side group, an SM-free communicator's) is this trainer's:
        # close() releases them
        groups_before = process_groups() if self.world_size > 1 else None
        if self.world_size > 1:
            self.emb_comm = Communicator(dist.new_group(), name="embedding")
            # small host metadata (input agreement, stage times, losses, eval merges):
            # gloo on CPU tensors even under NCCL, so reading it back never waits for
            # the compute stream
            meta_backend = "gloo" if self.ctx.backend == "nccl" else None
            self.meta_comm = Communicator(dist.new_group(backend=meta_backend), name="meta")
            # the data-stage thread's own metadata group (input agreement, id counts ahead)
            self.data_comm = Communicator(dist.new_group(backend=meta_backend), name="data")
        else:
            self.emb_comm = Communicator(None, name="embedding")
            self.meta_comm = Communicator(None, name="meta")
            self.data_comm = Communicator(None, name="data")
        self._stage: DataStageThread | None = None
        self.data_stage_steps = 0  # steps prepared on the data-stage thread
        self.data_stage_counts = 0  # of which the id counts were taken there too
        # the data-stage thread's ms per step: busy / gate / blocked (DataStageThread.timing)
        self.data_stage_timing: dict[str, Any] | None = None
        # seconds per phase of the data stage's work (load = take the prefetched batch
        # and agree on it, hook:<class> = each ahead hook, e.g. the balancer, id_counts,
        # pin = pinning a batch a hook rebuilt), summed over the steps prepared on the
        # data-stage thread: where its busy time goes (summary data_thread.phases_ms)
        self.data_stage_phase_s: dict[str, float] = {}
        opts: dict[str, Any] = (
            {"max_collision_rate": cfg.max_collision_rate, "early_prepare": cfg.early_prepare}
            if cfg.mode == "prioritized"
            else {}
        )
        self.overlap_comm = self._overlap_communicator()
        if self.overlap_comm is not None:
            opts["side_comm"] = self.overlap_comm
        risk = known_hang_risk(
            cfg.mode,
            self.device.type,
            getattr(self.overlap_comm, "backend_name", None),
            (type(h).__name__ for h in self.hooks),
        )
        if risk is not None and self.rank == 0:
            warnings.warn(risk, RuntimeWarning, stacklevel=2)
        self.sparse = make_embedding_collection(
            cfg.mode,
            self.tables,
            self.emb_comm,
            cfg.sparse_optim,
            device=self.device,
            dtype=self.dtype,
            seed=cfg.seed,
            timing=cfg.timing == "sync",
            **opts,
        )
        self.sparse.sparse_update = cfg.sparse_update
        torch.manual_seed(cfg.seed)
        self.dense = SequenceRecModel(cfg.model, self.uih_keys, self.sparse.plan.dim).to(
            self.device, self.dtype
        )
        if self.world_size > 1:
            self.dense_ddp: nn.Module = DDP(
                self.dense,
                device_ids=[self.device.index] if self.device.type == "cuda" else None,
            )
            self.dense_ddp.register_comm_hook(None, allreduce_sum_hook)
        else:
            self.dense_ddp = self.dense
        self.optimizer = torch.optim.Adam(self.dense.parameters(), lr=cfg.dense_lr)
        self.step = 0  # steps completed
        self.history: list[dict[str, Any]] = []
        self.eval_history: list[dict[str, Any]] = []
        self._log_file = None
        self._marks: _Marks | None = None  # the current step's marks (events timing)
        # the groups close() destroys; none when torch hides its group registry
        self._owned_groups = (
            list((process_groups() or set()) - groups_before) if groups_before is not None else []
        )
        self._train_failed = False  # a train() call raised: close() leaves the groups
        if cfg.log_path and self.rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.log_path)), exist_ok=True)
            self._log_file = open(cfg.log_path, "a")  # noqa: SIM115

    # ------------------------------------------------------------- helpers
    def _overlap_communicator(self) -> Communicator | None:
        """The communicator of the overlapped embedding traffic (``cfg.overlap_backend``);
        None: the module makes its own side group of the main backend. Also resolves
        :attr:`overlap_backend_name` (``auto`` -> by topology), which the balancer uses
        for its exchanges."""
        choice = self.cfg.overlap_backend
        self.overlap_backend_name: str | None = None
        if choice == "default" or self.world_size == 1:
            return None
        from ..comm import create_communicator, detect_topology, select_backend

        backend = choice
        if choice == "auto":
            backend = select_backend(
                detect_topology(), "exclusive_embeddings", cuda=self.device.type == "cuda"
            )
        self.overlap_backend_name = backend
        if self.cfg.mode == "vanilla":
            return None
        return create_communicator(backend, name=f"overlap-{backend}", config=self.smfree_config())

    def smfree_config(self) -> SMFreeConfig:
        """The SM-free backends' config from :attr:`cfg` (the copy engine's completion and
        handshake);
        used for the overlapped traffic and by hooks that make SM-free communicators."""
        from ..comm import CopyEngineConfig, SMFreeConfig

        cfg = self.cfg
        return SMFreeConfig(
            copy_engine=CopyEngineConfig(
                completion=cfg.copy_engine_completion, handshake=cfg.copy_engine_handshake
            )
        )

    def comm_bytes_by_backend(self) -> dict[str, int]:
        """Bytes this rank sent per backend (embedding, metadata, overlapped traffic,
        hooks' communicators such as the balancer's)."""
        out: dict[str, int] = defaultdict(int)
        for key, stat in self.comm_by_op().items():
            out[key.split(":", 1)[0]] += stat["bytes"]
        return dict(out)

    def comm_by_op(self) -> dict[str, dict[str, int]]:
        """Bytes sent and calls made by this rank per ``backend:collective`` (e.g.
        ``copy_engine:all_to_all``), over the same communicators."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "calls": 0})
        comms = [self.emb_comm, self.meta_comm, self.data_comm]
        comms.append(getattr(self.sparse, "side_comm", None))
        comms += [getattr(h, "comm", None) for h in self.hooks]  # e.g. the balancer's
        seen: set[int] = set()
        for c in comms:
            if c is None or id(c) in seen:
                continue
            seen.add(id(c))
            for key, n in c.stats.bytes.items():
                op = ":".join(key.split(":", 2)[:2])  # backend:collective, name dropped
                out[op]["bytes"] += int(n)
                out[op]["calls"] += int(c.stats.calls.get(key, 0))
        return {k: dict(v) for k, v in out.items()}

    @property
    def events_timing(self) -> bool:
        """Stage times from CUDA events read a step later (``cfg.timing == "events"``)."""
        return self.cfg.timing == "events"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _now(self) -> float:
        if not self.events_timing:
            self._sync()
        return time.perf_counter()

    def log(self, record: dict[str, Any]) -> None:
        if self._log_file is not None:
            self._log_file.write(json.dumps(record, default=float) + "\n")
            self._log_file.flush()

    def local_batch(self, step: int, split: str = "train") -> JaggedBatch:
        return self.source.local_batch(step, self.rank, self.world_size, split=split)

    def load_batch(self, step: int, split: str = "train") -> JaggedBatch:
        """Load and validate this rank's batch of ``step``; agree with every rank that
        all inputs are valid (raises on every rank otherwise) and learn the global
        candidate count. Returns the batch on the training device."""
        err: Exception | None = None
        batch: JaggedBatch | None = None
        try:
            batch = self.validate(self.local_batch(step, split))
        except BadInputError as e:
            err = e
        batch = self.agree_on_input(batch, err, step)
        return batch.to(self.device)

    def validate(self, batch: JaggedBatch) -> JaggedBatch:
        return validate_batch(
            batch, self.feature_rows, max_uih=self.cfg.data.max_uih, rank=self.rank
        )

    def _loader(self, first: int, steps: int) -> PrefetchingLoader:
        """Background thread loading + validating batches ``first .. first+steps-1``."""
        return PrefetchingLoader(
            self.source,
            self.rank,
            self.world_size,
            range(first, first + steps),
            validate_fn=self.validate,
            depth=3,
            pin_memory=self.device.type == "cuda",
        )

    def next_batch(
        self,
        loader: PrefetchingLoader,
        step: int,
        to_device: bool = True,
        comm: Communicator | None = None,
    ) -> JaggedBatch:
        """Data stage: take the prefetched batch, agree with all ranks, move to device
        (``to_device=False``: keep it on the host, where the hooks run: balancing never
        touches the device, so it never waits for the compute stream)."""
        err: Exception | None = None
        batch: JaggedBatch | None = None
        try:
            batch = next(loader)
        except BadInputError as e:
            err = e
        batch = self.agree_on_input(batch, err, step, comm)
        return batch.to(self.device, non_blocking=True) if to_device else batch

    def agree_on_input(
        self,
        batch: JaggedBatch | None,
        err: Exception | None,
        step: int,
        comm: Communicator | None = None,
    ) -> JaggedBatch:
        """One all-reduce: [candidates, bad flag per rank]. Every rank raises if any
        rank's input was rejected; otherwise sets ``batch.extras['global_candidates']``."""
        w = self.world_size
        vec = torch.zeros(1 + w, dtype=torch.float64)
        if err is None and batch is not None:
            vec[0] = float(batch.num_candidates.sum())
        else:
            vec[1 + self.rank] = 1.0
        if w > 1:
            comm = comm or self.meta_comm
            vec = comm.all_reduce(vec.to(comm.device), name="input_ok").wait().cpu()
        bad = [r for r in range(w) if vec[1 + r] > 0]
        if err is not None:
            raise err
        if bad:
            raise InputRejected(
                f"rank {self.rank}: step {step} stopped before any id exchange because rank(s) "
                f"{bad} rejected their input (see the error on those ranks); no update applied"
            )
        assert batch is not None
        batch.extras["global_candidates"] = float(vec[0])
        return batch

    def features_of(self, batch: JaggedBatch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        feats = {k: (batch.uih[k], batch.uih_lengths[k]) for k in self.uih_keys}
        feats[CANDIDATE_FEATURE] = (batch.candidates, batch.num_candidates)
        return {f: feats[f] for f in self.sparse.features}

    def forward(self, batch: JaggedBatch, next_batch: JaggedBatch | None = None) -> torch.Tensor:
        """Logits for every candidate of the local batch. Embedding modules that look
        ahead (prioritized updates) also receive the next step's features."""
        if getattr(self.sparse, "uses_next_features", False):
            nxt = self.features_of(next_batch) if next_batch is not None else None
            emb = self.sparse(self.features_of(batch), next_features=nxt)
        else:
            emb = self.sparse(self.features_of(batch))
        marks = self._marks
        if marks is not None:  # events timing: dense time = these marks' intervals
            marks("emb_fwd")
            emb = {k: _BackwardMark.apply(v, marks, f"dense_bwd.{k}") for k, v in emb.items()}
        lengths = batch.uih_lengths[self.uih_keys[0]]
        logits = self.dense_ddp(
            {k: emb[k] for k in self.uih_keys},
            lengths,
            emb[CANDIDATE_FEATURE],
            batch.num_candidates,
        )
        if marks is not None:
            marks("dense_fwd")
        return logits

    def dense_lr(self, step: int) -> float:
        return self.cfg.dense_lr

    def sparse_lr(self, step: int) -> float:
        return self.cfg.sparse_optim.lr

    # --------------------------------------------------------------- step
    def _begin(self, loader: PrefetchingLoader, step: int) -> tuple[int, JaggedBatch, Any]:
        """Data stage, first half (two steps ahead): load, agree, and let the first hook
        that supports it start asynchronous work on the batch (the balancer's stages
        I and II: metadata all-gathers in flight while the current step computes)."""
        batch = self.next_batch(loader, step, to_device=False)  # hooks work on the host
        for h in self.hooks:
            begin = getattr(h, "begin_batch", None)
            if begin is not None:
                return step, batch, (h, begin(self, step, batch))
        return step, batch, None

    def _end(self, begun: tuple[int, JaggedBatch, Any]) -> JaggedBatch:
        """Data stage, second half (one step ahead): finish the asynchronous hook, then
        the remaining hooks' ``on_batch``."""
        step, batch, pending = begun
        owner = None
        if pending is not None:
            owner, handle = pending
            batch = owner.end_batch(self, step, handle)
        for h in self.hooks:
            if h is not owner:
                batch = h.on_batch(self, step, batch)
        return self._ship(batch, self._id_counts(batch))

    def _ship(self, batch: JaggedBatch, counts: Any) -> JaggedBatch:
        """End of the data stage: local candidate count, device copy, id counts."""
        if batch.device.type == "cpu":
            batch.extras["local_candidates"] = float(batch.num_candidates.sum())
        batch = self._to_device(batch)
        if counts is not None:
            self.sparse.register_counts(self.features_of(batch), counts)
        return batch

    @property
    def host_counts(self) -> bool:
        hc = self.cfg.host_counts
        return self.device.type == "cuda" if hc is None else bool(hc)

    def _id_counts(
        self, batch: JaggedBatch, comm: Communicator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Id-dist split sizes of the (host) batch, exchanged over the host metadata
        group: computed one step ahead, so the id dist reads nothing back from the
        device (``cfg.host_counts``)."""
        register = getattr(self.sparse, "register_counts", None)
        if not self.host_counts or register is None or batch.device.type != "cpu":
            return None
        sent = self.sparse.host_counts(self.features_of(batch))
        if self.world_size == 1:
            return sent, sent.clone()
        comm = comm or self.meta_comm
        recv = comm.exchange_counts(sent.to(comm.device), name="id_counts")
        return sent, recv.cpu()

    # ------------------------------------------------- data stage on its own thread
    @property
    def data_thread(self) -> bool:
        dt = self.cfg.data_thread
        return self.device.type == "cuda" if dt is None else bool(dt)

    def _placement_plan(self) -> Placement | None:
        """This rank's thread placement when ``cfg.pin_threads`` (None otherwise, or
        when it cannot apply here: the report says why)."""
        if not self.cfg.pin_threads:
            return None
        plan = self._plan_placement()
        if not hasattr(os, "sched_setaffinity"):
            plan.available = False
            plan.notes.append("os.sched_setaffinity is not available on this platform")
        return plan if plan.available else None

    def _plan_placement(self) -> Placement:
        """The plan for this rank: local ranks from ``LOCAL_WORLD_SIZE``; on CUDA with the
        CPUs near each local rank's GPU (NUMA), when sysfs tells."""
        local_world = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        near = None
        if self.device.type == "cuda":
            count = torch.cuda.device_count()
            near = [gpu_local_cpus(r % count) for r in range(local_world)]
        return plan_placement(
            cpu_topology(), self.ctx.local_rank % local_world, local_world, near=near
        )

    def _placement_report(self, pin: Placement | None, counts: dict[str, int]) -> dict[str, Any]:
        """Host topology, and the placement in force (or why none) for the summary."""
        out: dict[str, Any] = {"topology": topology_summary(), "pinned": pin is not None}
        if pin is not None:
            out |= {"cpus": {k: list(v) for k, v in pin.cpus.items()}, "threads": counts}
            out["notes"] = list(pin.notes)
        elif self.cfg.pin_threads:
            out["notes"] = self._plan_placement().notes or ["pinning unavailable here"]
        else:
            out["notes"] = []
        return out

    def _ahead_hooks(self) -> int:
        """How many leading hooks run on the data-stage thread (``ahead_safe``)."""
        n = 0
        for h in self.hooks:
            if not getattr(h, "ahead_safe", False):
                break
            n += 1
        return n

    def _prepare_ahead(self, step: int, loader: PrefetchingLoader, n_ahead: int) -> PreparedBatch:
        """The data stage of ``step`` on the data-stage thread (pipeline/data_stage.py):
        agree, the ``ahead_safe`` hooks, the id counts when every later hook passes the
        batch through, pinning."""
        clock = time.perf_counter
        phases = self.data_stage_phase_s
        t0 = clock()
        batch = self.next_batch(loader, step, to_device=False, comm=self.data_comm)
        t1 = clock()
        phases["load"] = phases.get("load", 0.0) + (t1 - t0)
        for h in self.hooks[:n_ahead]:
            batch = h.on_batch(self, step, batch)
            t2 = clock()
            key = f"hook:{type(h).__name__}"
            phases[key] = phases.get(key, 0.0) + (t2 - t1)
            t1 = t2
        counts = None
        if all(_passes_batch(h) for h in self.hooks[n_ahead:]):
            counts = self._id_counts(batch, comm=self.data_comm)
            self.data_stage_counts += counts is not None
            t2 = clock()
            if counts is not None:  # else: none taken here (cfg.host_counts off)
                phases["id_counts"] = phases.get("id_counts", 0.0) + (t2 - t1)
            t1 = t2
        if self.device.type == "cuda" and batch.device.type == "cpu" and not _is_pinned(batch):
            batch = batch.pin_memory()  # so the training thread's copy is asynchronous
            phases["pin"] = phases.get("pin", 0.0) + (clock() - t1)
        self.data_stage_steps += 1
        return PreparedBatch(step, batch, counts)

    def _finish_prepared(self, p: PreparedBatch, n_ahead: int) -> JaggedBatch:
        """The rest of the data stage on the training thread: the remaining hooks, the
        id counts (if the thread could not), the device copy."""
        batch = p.batch
        for h in self.hooks[n_ahead:]:
            batch = h.on_batch(self, p.step, batch)
        return self._ship(batch, p.counts if p.counts is not None else self._id_counts(batch))

    def _to_device(self, batch: JaggedBatch) -> JaggedBatch:
        """Host batch -> training device, asynchronously: a batch rebuilt on the host by
        a hook (the balancer) is pinned first, so the copy never waits for the compute
        stream (a pageable copy would)."""
        if self.device.type != "cuda" or batch.device.type == "cuda":
            return batch.to(self.device)
        if not _is_pinned(batch):
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def flush(self) -> None:
        """Apply every deferred embedding update (a no-op for the vanilla schedule) and
        settle the sparse collection's device-side counters. Called before evaluation,
        checkpoints, errors and the end of training."""
        flush = getattr(self.sparse, "flush", None)
        if flush is not None:
            flush()
        tally = getattr(self.sparse, "tally", None)
        if tally is not None:
            tally.settle()  # device-side row counts into the stats (waits for them)

    def train_step(
        self, batch: JaggedBatch, next_batch: JaggedBatch | None = None
    ) -> dict[str, Any]:
        """Forward, backward, optimizer for one (validated) local batch. ``next_batch``
        is the following step's batch where known (None on the last step)."""
        t = self.step + 1
        times = StageTimes()
        self.sparse.stats.times.clear()
        for g in self.optimizer.param_groups:
            g["lr"] = self.dense_lr(t)
        self.sparse.set_step(t, self.sparse_lr(t))
        self.dense_ddp.train()
        self.sparse.train()

        marks = self._marks = _Marks(self.device) if self.events_timing else None
        try:
            if marks is not None:
                marks("fwd_start")
            t0 = self._now()
            with record_function("freescale/forward"):
                logits = self.forward(batch, next_batch)
                gc = batch.extras["global_candidates"]
                loss_sum = sum_bce_loss(logits, batch.labels)
                loss = loss_sum / max(gc, 1.0)
                loss_host = _host_copy(loss_sum.detach()) if marks is not None else None
            times.add("forward", self._now() - t0)
            for h in self.hooks:
                h.after_forward(self, t, loss)

            if marks is not None:
                marks("bwd_start")
            t0 = self._now()
            with record_function("freescale/backward"):
                prepare = getattr(self.sparse, "prepare_backward", None)
                if prepare is not None:  # the sparse backward's gradient-free part, early
                    with record_function("freescale/prepare_backward"):
                        prepare()
                loss.backward()
            times.add("backward", self._now() - t0)
            for h in self.hooks:
                h.after_backward(self, t)

            if marks is not None:
                marks("opt_start")
            t0 = self._now()
            with record_function("freescale/optimizer"):
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            times.add("optimizer", self._now() - t0)
            if marks is not None:
                marks("opt_end")
        finally:
            self._marks = None
        if marks is None:  # before the hooks: sparse work they do (a checkpoint's flush)
            st = self.sparse.stats.times  # is not this step's forward or backward
            times.values.update({f"emb.{k}": v for k, v in st.items()})
            fkeys = getattr(self.sparse, "forward_time_keys", ("id_dist", "lookup", "emb_a2a"))
            bkeys = getattr(self.sparse, "backward_time_keys", ("grad_a2a", "sparse_update"))
            fwd_sparse = sum(st.get(k, 0.0) for k in fkeys)
            bwd_sparse = sum(st.get(k, 0.0) for k in bkeys)
            times.add(
                "dense",
                times.values["forward"] - fwd_sparse + times.values["backward"] - bwd_sparse,
            )
        for h in self.hooks:
            h.after_optimizer(self, t)
        self.step = t
        return {
            "step": t,
            # with event timing: a pinned copy, complete once the step's marks are (read
            # in _finish_step after them); float() of the device tensor there would wait
            # for everything queued since, i.e. the whole next step
            "loss_sum": loss_host if loss_host is not None else float(loss_sum.detach()),
            "_marks": marks,
            "global_candidates": gc,
            "samples": batch.batch_size,
            # counted on the host before the copy (a device sum read here would make the
            # host wait for this whole step before it could prepare the next)
            "candidates": batch.extras.get("local_candidates")
            if "local_candidates" in batch.extras
            else float(batch.num_candidates.sum()),
            "tokens": batch.total_tokens(),
            "times": times.values,
        }

    # --------------------------------------------------------------- eval
    @torch.no_grad()
    def evaluate(self, num_batches: int | None = None) -> dict[str, float]:
        """NE, AUC, log loss and the oracle NE (true probabilities) on held-out samples."""
        self.flush()
        self.dense_ddp.eval()
        self.sparse.eval()
        n = (
            num_batches
            or self.cfg.eval_batches
            or max(1, self.cfg.data.eval_samples // self.cfg.data.global_batch_size)
        )
        ne, ne_oracle, auc = NEAccumulator(), NEAccumulator(), AUCAccumulator()
        for i in range(n):
            batch = self.load_batch(i, split="eval")
            logits = self.dense(*self._dense_inputs(batch))
            ne.update(labels=batch.labels, logits=logits)
            auc.update(logits, batch.labels)
            if batch.true_probs is not None:
                ne_oracle.update(labels=batch.labels, probs=batch.true_probs)
        res = ne.merge(self.meta_comm, "eval.ne").compute()
        oracle = ne_oracle.merge(self.meta_comm, "eval.oracle").compute()
        out = {
            "eval_ne": res.ne,
            "eval_logloss": res.logloss,
            "eval_calibration": res.calibration,
            "eval_auc": auc.compute(self.meta_comm, "eval.auc"),
            "oracle_ne": oracle.ne,
            "eval_candidates": res.num_samples,
        }
        self.dense_ddp.train()
        self.sparse.train()
        return out

    def _dense_inputs(self, batch: JaggedBatch):
        emb = self.sparse(self.features_of(batch))
        lengths = batch.uih_lengths[self.uih_keys[0]]
        return (
            {k: emb[k] for k in self.uih_keys},
            lengths,
            emb[CANDIDATE_FEATURE],
            batch.num_candidates,
        )

    # -------------------------------------------------------------- loop
    def _gather_times(self, times: dict[str, float]) -> Callable[[], list[dict[str, float]]]:
        """Issue the all-gather of this rank's stage times; the returned callable waits
        for it and returns every rank's times (in rank order)."""
        keys = sorted(times)
        vec = torch.tensor([times[k] for k in keys], dtype=torch.float64)
        if self.world_size == 1:
            return lambda: [dict(zip(keys, vec.tolist()))]
        work = self.meta_comm.all_gather(vec.to(self.meta_comm.device), name="stage_times")
        return lambda: [dict(zip(keys, o.cpu().tolist())) for o in work.wait()]

    def train(self, steps: int | None = None) -> dict[str, Any]:
        """Run ``steps`` more steps (default ``cfg.steps``), evaluate, return the summary.

        With ``cfg.timing == "events"`` a step's record (times, straggler share, hooks'
        ``on_metrics``, log) is finished while the next step is already queued on the
        device; evaluation points and the last step are finished at once."""
        cfg = self.cfg
        steps = cfg.steps if steps is None else steps
        for h in self.hooks:
            h.on_train_start(self)
        show = cfg.progress and self.rank == 0
        # tqdm on a terminal, plain lines in a pipe or a log file (`make_progress`)
        bar = make_progress(steps, "train") if show else None
        warmup = min(5, steps // 10)
        first, last = self.step + 1, self.step + steps
        # profiled window: the last profile_steps steps, after warm-up, excluded from QPS
        prof_steps = min(cfg.profile_steps, max(0, steps - warmup - 1))
        prof_first = last - prof_steps + 1 if prof_steps > 0 else None
        acc = _LoopAccumulator(first + warmup, (prof_first or last + 1) - 1)
        cpu_meter = ThreadCpuMeter()  # host CPU per thread over the timed steps
        gil_probe = GilProbe(cfg.gil_probe_ms) if cfg.gil_probe_ms > 0 else None
        host_cpu: dict[str, Any] | None = None

        me = threading.current_thread().name

        def close_cpu_window() -> dict[str, Any] | None:
            out = cpu_meter.stop(acc.timed_steps)
            gil = gil_probe.stop() if gil_probe is not None else None
            if out is not None and gil is not None:
                out["gil_wait"] = gil
            if out is not None:  # host time blocked in wait() / device waits, per step
                waits = comm_base.wait_clock.per_step_ms(acc.timed_steps, thread=me)
                out["host_wait_training"] = waits
                out["host_wait_training_ms"] = sum(w["ms_per_step"] for w in waits.values())
                out["host_wait_all_threads"] = comm_base.wait_clock.per_step_ms(acc.timed_steps)
            return out

        switch_before = sys.getswitchinterval()  # restored in the finally below
        pin = self._placement_plan()
        pin_counts: dict[str, int] = {}
        affinity_before = thread_affinities() if pin is not None else {}  # restored below
        t_start: float | None = None
        t_stop: float | None = None
        profiler = None
        watch: CompileWatch | None = None  # compiles inside the profiled window
        loader = self._loader(first, steps)
        n_ahead = self._ahead_hooks()
        stage = None
        self.data_stage_timing = None  # this call's (a previous call's would be stale)
        # records whose stage-times all-gather is in flight (cfg.defer_metrics) and how
        # many were finished a step after they were issued (this call)
        self._metrics_queue: deque[tuple[dict[str, Any], Any, float]] = deque()
        self.metrics_deferred = 0
        if self.data_thread and steps > 0:
            stage = self._stage = DataStageThread(
                lambda s: self._prepare_ahead(s, loader, n_ahead),
                list(range(first, last + 1)),
                num_threads=self.cpu_threads,
                name=f"freescale-data-stage-rank{self.rank}",
            )
        ahead: JaggedBatch | None = None
        begun: deque[tuple[int, JaggedBatch, Any]] = deque()
        pending: dict[str, Any] | None = None
        try:
            if cfg.gil_switch_interval_ms is not None:
                sys.setswitchinterval(cfg.gil_switch_interval_ms / 1e3)
            for t in range(first, last + 1):
                if pin is not None and t in (first, first + 1):
                    # threads created since (autograd's at the first backward, the
                    # OpenMP teams at their first parallel op) inherit their creator's
                    # affinity: place them by role again
                    pin_counts = apply_placement(pin)
                if t == first + warmup:
                    self._sync()
                    if gil_probe is not None:
                        gil_probe.start()
                    if pin is not None:  # the probe too: off the training thread's core
                        pin_counts = apply_placement(pin)
                    t_start = time.perf_counter()
                    cpu_meter.start()
                    comm_base.wait_clock.reset()
                    if self.device.type == "cuda" and os.environ.get("FREESCALE_SYNC_DEBUG"):
                        # diagnosis: warn at every call site that synchronises the device
                        # (once per site; a host-bound step shows its syncs here)
                        torch.cuda.set_sync_debug_mode("warn")
                if prof_first is not None and t == prof_first:
                    if pending is not None:
                        self._finish_step(pending, acc, bar, last)
                        pending = None
                    self._sync()
                    t_stop = time.perf_counter()
                    host_cpu = close_cpu_window()
                    profiler = _start_profiler(self.device, cfg.profile_activities)
                    watch = CompileWatch(triton=self.device.type == "cuda")
                    watch.start()
                    if pin is not None:  # the profiler's threads: off the training core
                        apply_placement(pin)
                marks = _Marks(self.device) if self.events_timing else None
                if marks is not None:
                    marks("step_start")
                t0 = self._now()
                # lookahead: batch t+1 is loaded, agreed on and balanced before step t
                # trains (prioritized updates read its ids during step t); batch t+2 is
                # loaded and its balancing metadata is in flight while step t computes
                with record_function("freescale/data"):
                    if stage is not None:  # prepared on the data-stage thread
                        if ahead is None:
                            ahead = self._finish_prepared(stage.get(t), n_ahead)
                        batch = ahead
                        nxt = stage.get(t + 1) if t < last else None
                        ahead = self._finish_prepared(nxt, n_ahead) if nxt else None
                    elif ahead is None:  # first step of this call
                        begun.append(self._begin(loader, t))
                        if t < last:
                            begun.append(self._begin(loader, t + 1))
                        ahead = self._end(begun.popleft())
                    if stage is None:
                        batch = ahead
                        ahead = self._end(begun.popleft()) if t < last else None
                        if t + 2 <= last:
                            begun.append(self._begin(loader, t + 2))
                t_data = self._now() - t0
                rec = self.train_step(batch, ahead)
                rec["times"]["data"] = t_data
                if marks is not None:
                    rec["_step_marks"] = marks
                if not self.events_timing:
                    self._finish_step(rec, acc, bar, last)
                    continue
                if pending is not None:  # step t is queued: finish step t-1
                    self._finish_step(pending, acc, bar, last, flush=False)
                pending = rec
                eval_now = cfg.eval_every and t % cfg.eval_every == 0 and t != last
                if eval_now or t == last or t + 1 == prof_first:
                    self._finish_step(pending, acc, bar, last)
                    pending = None
        except BaseException:
            self._train_failed = True
            if profiler is not None:
                profiler.stop()
            if watch is not None:
                watch.stop()
            self.flush()  # deferred updates are applied before the error propagates
            raise
        finally:
            if t_stop is None:  # before the data-stage thread exits (its CPU time with it)
                host_cpu = close_cpu_window()
            sys.setswitchinterval(switch_before)
            if pin is not None:
                restore_affinities(affinity_before)
            if stage is not None:
                stage.close()
                self.data_stage_timing = stage.timing()
                self._stage = None
            loader.close()
        if self.device.type == "cuda" and os.environ.get("FREESCALE_SYNC_DEBUG"):
            torch.cuda.set_sync_debug_mode("default")
        self.flush()
        self._sync()
        if t_stop is None:
            t_stop = time.perf_counter()
        wall = t_stop - t_start if t_start is not None else 0.0
        accounting = None
        if profiler is not None:
            profiler.stop()
            compiles = watch.stop() if watch is not None else {}
            accounting = self._accounting(profiler, prof_steps, compiles)
        if bar is not None:
            bar.close()
        ev = self.evaluate() if steps > 0 else {}
        if ev:
            ev["step"] = self.step
            self.eval_history.append(ev)
            self.log({"kind": "eval", **ev})
        mean_times = {k: v / max(acc.timed_steps, 1) for k, v in acc.stage_sum.items()}
        summary: dict[str, Any] = {
            "steps": self.step,
            "world_size": self.world_size,
            "device": str(self.device),
            "backend": self.ctx.backend,
            "config_hash": self.config_hash,
            "timing": cfg.timing,
            "qps": acc.samples / wall if wall > 0 else float("nan"),
            "timed_steps": acc.timed_steps,
            "stage_ms": {k: 1e3 * v for k, v in sorted(mean_times.items())},
            "straggler_share_median": _median(acc.straggler),
            # step records finished one step late (cfg.defer_metrics; 0 when off)
            "metrics_deferred": self.metrics_deferred,
            "emb_bytes_sent_per_step": self.sparse.stats.emb_bytes_sent
            / max(self.sparse.stats.steps, 1),
            "cpu_threads": self.cpu_threads,
            "placement": self._placement_report(pin, pin_counts),
            # host CPU ms per step by thread group over the timed steps (metrics.host_cpu)
            "host_cpu": host_cpu,
            "data_thread": {
                "on": self.data_thread,
                "steps": self.data_stage_steps,
                "counts_on_thread": self.data_stage_counts,
                # over every step it prepared (warm-up included)
                "timing": self.data_stage_timing,
                # ms per prepared step in each phase of its work (busy, split)
                "phases_ms": {
                    k: 1e3 * v / max(self.data_stage_steps, 1)
                    for k, v in sorted(self.data_stage_phase_s.items())
                },
            },
            "dense_param_bytes": sum(p.numel() * p.element_size() for p in self.dense.parameters()),
            "overlap_backend": getattr(
                getattr(self.sparse, "side_comm", None), "backend_name", None
            ),
            "comm_bytes_by_backend": self.comm_bytes_by_backend(),
            "comm_by_op": self.comm_by_op(),
            # the SM-free protocol in force, when an SM-free backend carries the
            # overlapped traffic (copy engine: completion, handshake)
            "smfree": _smfree_protocol(getattr(self.sparse, "side_comm", None)),
            **ev,
        }
        if accounting is not None:
            summary["gpu_accounting"] = accounting
        if ev and not math.isnan(ev.get("oracle_ne", float("nan"))):
            gap = 1.0 - ev["oracle_ne"]
            summary["ne_gap_closed"] = (1.0 - ev["eval_ne"]) / gap if gap > 0 else float("nan")
        self.log({"kind": "summary", **summary})
        for h in self.hooks:
            h.on_train_end(self, summary)
        return summary

    def _finish_step(
        self,
        rec: dict[str, Any],
        acc: _LoopAccumulator,
        bar: Any,
        last: int,
        flush: bool = True,
    ) -> None:
        """Per-step bookkeeping after the step's work is queued: resolve event times,
        issue the all-gather of stage times, then finish the record (straggler share,
        hooks' ``on_metrics``, log, eval: :meth:`_complete_step`). With
        ``cfg.defer_metrics`` and ``flush=False`` the record is finished at the next
        call instead, so the all-gather is in flight for a step (records and hooks keep
        their order); ``flush=True`` finishes every record issued so far."""
        t0 = time.perf_counter()
        step_marks: _Marks | None = rec.pop("_step_marks", None)
        marks: _Marks | None = rec.pop("_marks", None)
        if marks is not None:
            with comm_base.device_wait("step_marks"):  # the step before, one step late
                marks.synchronize()
            rec["times"].update(marks.stage_times(step_marks))
        if isinstance(rec["loss_sum"], torch.Tensor):  # host memory: its copy is done
            rec["loss_sum"] = float(rec["loss_sum"])
        gathered = self._gather_times(rec["times"])
        self._metrics_queue.append((rec, gathered, time.perf_counter() - t0))
        keep = 1 if (self.cfg.defer_metrics and not flush) else 0
        while len(self._metrics_queue) > keep:
            if len(self._metrics_queue) > 1:
                self.metrics_deferred += 1  # finished one step after it was issued
            self._complete_step(*self._metrics_queue.popleft(), acc, bar, last)

    def _complete_step(
        self,
        rec: dict[str, Any],
        gathered: Callable[[], list[dict[str, float]]],
        issue_s: float,
        acc: _LoopAccumulator,
        bar: Any,
        last: int,
    ) -> None:
        """Finish one step's record: every rank's stage times (the all-gather issued by
        :meth:`_finish_step`), straggler share, timed-window sums, hooks' ``on_metrics``,
        the data stage's gate, log and eval."""
        cfg = self.cfg
        t = rec["step"]
        t0 = time.perf_counter()
        acc.loss += rec["loss_sum"]
        acc.cands += rec["candidates"]
        all_times = gathered()
        dense = [a.get("dense", 0.0) for a in all_times]
        share = (max(dense) - sum(dense) / len(dense)) / max(max(dense), 1e-12)
        rec["straggler_share"] = share
        rec["dense_ms_per_rank"] = [1e3 * d for d in dense]
        rec["times"]["metrics"] = issue_s + time.perf_counter() - t0
        if acc.first_timed <= t <= acc.last_timed:
            acc.timed_steps += 1
            acc.samples += cfg.data.global_batch_size
            acc.straggler.append(share)
            for k, v in rec["times"].items():
                acc.stage_sum[k] += v
        for h in self.hooks:
            h.on_metrics(self, t, rec)
        if self._stage is not None:  # the data-stage thread may plan step t + 4 now
            self._stage.metrics_done(t)
        if t % cfg.log_every == 0 or t == last:
            tot = torch.tensor([acc.loss, acc.cands], dtype=torch.float64)
            if self.world_size > 1:
                tot = (
                    self.meta_comm.all_reduce(tot.to(self.meta_comm.device), name="loss")
                    .wait()
                    .cpu()
                )
            rec["train_logloss"] = float(tot[0] / max(float(tot[1]), 1.0))
            acc.loss, acc.cands = 0.0, 0.0
            self.log({"kind": "train", **rec})
            if bar is not None:
                bar.set_postfix(logloss=f"{rec['train_logloss']:.4f}")
        if cfg.eval_every and t % cfg.eval_every == 0 and t != last:
            ev = self.evaluate()
            ev["step"] = t
            self.eval_history.append(ev)
            self.log({"kind": "eval", **ev})
            if cfg.progress and self.rank == 0:
                _print(
                    bar,
                    f"step {t}: eval NE {ev['eval_ne']:.4f} "
                    f"(oracle {ev['oracle_ne']:.4f}), AUC {ev['eval_auc']:.4f}",
                )
        if bar is not None:
            bar.update(1)

    def _accounting(
        self, profiler: Any, steps: int, compiles: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """GPU accounting of the profiled window on every rank (all-gathered), the
        compiles inside it (``compiles``: this rank's `CompileWatch` counts; reported as
        the largest over ranks, since the ranks step in lockstep), and the Chrome traces
        kept under ``cfg.trace_dir`` when set."""
        import tempfile

        from .accounting import ACCOUNTING_KEYS, gpu_accounting, merge_ranks
        from .compile_watch import COMPILE_KEYS

        keep = self.cfg.trace_dir
        if keep:
            os.makedirs(keep, exist_ok=True)
            path = os.path.join(keep, f"trace_rank{self.rank}.json")
        else:
            fd, path = tempfile.mkstemp(suffix=".json", prefix="freescale-trace-")
            os.close(fd)
        try:
            profiler.export_chrome_trace(path)
            mine = gpu_accounting(path, steps)
        except Exception as e:  # noqa: BLE001 - accounting must not end a training run
            mine = {"available": False, "reason": f"trace export/parse failed: {e}"}
        finally:
            if not keep and os.path.exists(path):
                os.remove(path)
        compiles = compiles or {}
        nan = float("nan")
        vec = torch.tensor(
            [1.0 if mine.get("available") else 0.0]
            + [float(mine.get(k, 0.0)) for k in ACCOUNTING_KEYS]
            + [nan if compiles.get(k) is None else float(compiles[k]) for k in COMPILE_KEYS],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            parts = self.meta_comm.all_gather(vec.to(self.meta_comm.device), name="acct").wait()
            rows = [p.cpu().tolist() for p in parts]
        else:
            rows = [vec.tolist()]
        na = len(ACCOUNTING_KEYS)
        per_rank = [
            {"available": bool(r[0]), **dict(zip(ACCOUNTING_KEYS, r[1 : 1 + na]))}
            if r[0]
            else {"available": False, "reason": mine.get("reason", "no GPU activity")}
            for r in rows
        ]
        out = merge_ranks(per_rank)
        out["per_rank"] = per_rank
        for i, k in enumerate(COMPILE_KEYS):
            vals = [r[1 + na + i] for r in rows if not math.isnan(r[1 + na + i])]
            out[k] = max(vals) if vals else None
        out["jit_kernels_in_window_this_rank"] = compiles.get("jit_kernels", {})
        # which collective kinds the compute stream waited for, on this rank
        out["exposed_by_kind_ms_this_rank"] = mine.get("exposed_by_kind_ms")
        out["profiled_steps"] = steps
        acts = self.cfg.profile_activities
        cuda_only = acts == "cuda" and self.device.type == "cuda"
        out["profile_activities"] = "cuda" if cuda_only else "cpu_cuda"
        # whether CUPTI is released after this window (later runs in the process pay
        # its per-launch cost otherwise; ensure_cupti_teardown)
        out["cupti_teardown"] = os.environ.get(CUPTI_TEARDOWN_ENV)
        if keep:
            out["trace_dir"] = keep
        return out

    def close(self) -> None:
        """Disarm the stall dump, close the SM-free communicator this trainer made for
        the overlapped traffic (its worker thread, receive buffers and handshake file:
        nothing of it outlives the trainer, e.g. into the next bench variant), close the
        log, and release the process groups the trainer made (`release_groups`: a
        barrier on its metadata group, then each group destroyed), so that a process
        that builds trainers one after another (a benchmark's variants) does not keep
        every one's gloo threads and NCCL communicators. Collective when world > 1:
        every rank calls it, as every rank calls ``train()``. After a ``train()`` that
        raised, the groups are left as they are (a peer may still sit in a collective on
        them; the process's own teardown destroys them). Idempotent; the trainer cannot
        train after it."""
        for h in self.hooks:
            if isinstance(h, StallDump):
                h.close()
        comm = getattr(self, "overlap_comm", None)
        if comm is not None and callable(getattr(comm, "close", None)):
            comm.close()
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        groups, self._owned_groups = self._owned_groups, []
        if groups and not self._train_failed:
            comms = [self.emb_comm, self.meta_comm, self.data_comm, comm]
            comms.append(getattr(getattr(self, "sparse", None), "side_comm", None))
            ours = [c for c in comms if isinstance(c, Communicator) and c.group in groups]
            release_groups(groups, barrier=self.meta_comm.group)
            for c in ours:  # a destroyed gloo group lives (its thread too) while referenced
                c.release()


def allreduce_sum_hook(process_group, bucket):  # noqa: ANN001 - DDP inspects annotations
    """DDP communication hook: sum gradients over ranks (no division by W)."""
    group = process_group if process_group is not None else dist.group.WORLD
    fut = dist.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _passes_batch(h: Any) -> bool:
    """The hook's ``on_batch`` returns the batch unchanged (declared, or not overridden)."""
    if getattr(h, "passes_batch", False):
        return True
    on_batch = getattr(type(h), "on_batch", None)
    return on_batch is None or on_batch is TrainerHook.on_batch


def _is_pinned(batch: JaggedBatch) -> bool:
    return bool(batch.uih_lengths) and next(iter(batch.uih_lengths.values())).is_pinned()


def _median(xs: Iterable[float]) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    m = len(s) // 2
    return s[m] if len(s) % 2 else 0.5 * (s[m - 1] + s[m])


def _print(bar: Any, msg: str) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)


def _fit_table_sizes(tables: list, source: Any) -> None:
    """Sources with data-defined vocabularies (MovieLens) size the default tables."""
    sizes = {
        "item": getattr(source, "num_items", None),
        "action": getattr(source, "num_actions", None),
    }
    for t in tables:
        n = sizes.get(t.name)
        if n is not None and n != t.num_embeddings:
            t.num_embeddings = int(n)


def summary_to_json(summary: dict[str, Any], cfg: TrainConfig) -> str:
    return json.dumps({"summary": summary, "config": config_to_dict(cfg)}, indent=2, default=float)


def _smfree_protocol(comm: Any) -> dict[str, Any] | None:
    """Backend and (copy engine) completion and handshake of an SM-free communicator,
    with the notes of any fallback; None for other communicators."""
    backend = getattr(comm, "backend_name", None)
    if backend not in ("copy_engine", "host_staged"):
        return None
    out = {"backend": backend}
    out.update({k: getattr(comm, k, None) for k in ("completion", "handshake", "stream_priority")})
    notes = [getattr(comm, k, "") for k in ("completion_note", "handshake_note")]
    out["notes"] = [n for n in notes if n]
    return out


@dataclass
class _LoopAccumulator:
    """Running sums of one ``train()`` call (timed steps: ``first_timed..last_timed``)."""

    first_timed: int
    last_timed: int
    timed_steps: int = 0
    samples: int = 0
    loss: float = 0.0
    cands: float = 0.0
    straggler: list[float] = field(default_factory=list)
    stage_sum: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` copied to (pinned) host memory without a wait on CUDA: the copy is queued on
    the current stream, so it is complete once a later event on that stream is; ``t``
    itself elsewhere."""
    if not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class _Marks:
    """Named timestamps of one step on the compute stream: CUDA events on a GPU, host
    clocks on CPU (where work is synchronous). Read only after :meth:`synchronize`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.t: dict[str, Any] = {}

    def __call__(self, name: str) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.t[name] = e
        else:
            self.t[name] = time.perf_counter()

    def synchronize(self) -> None:
        if self.cuda:
            for e in self.t.values():
                e.synchronize()

    def seconds(self, a: str, b: str) -> float:
        if self.cuda:
            return self.t[a].elapsed_time(self.t[b]) / 1e3
        return self.t[b] - self.t[a]

    def stage_times(self, step: _Marks | None) -> dict[str, float]:
        """forward / backward / optimizer / dense (and data, from the step's own marks)."""
        out = {
            "forward": self.seconds("fwd_start", "bwd_start"),
            "backward": self.seconds("bwd_start", "opt_start"),
            "optimizer": self.seconds("opt_start", "opt_end"),
        }
        bwd_marks = [k for k in self.t if k.startswith("dense_bwd.")]
        if "emb_fwd" in self.t and "dense_fwd" in self.t:
            dense = self.seconds("emb_fwd", "dense_fwd")
            if bwd_marks:
                dense += max(self.seconds("bwd_start", k) for k in bwd_marks)
            out["dense"] = dense
        if step is not None and "step_start" in step.t:
            step.synchronize()
            if self.cuda:
                out["data"] = step.t["step_start"].elapsed_time(self.t["fwd_start"]) / 1e3
            else:
                out["data"] = self.t["fwd_start"] - step.t["step_start"]
        return out


class _BackwardMark(torch.autograd.Function):
    """Identity; its backward records a mark (the dense backward reached this input)."""

    @staticmethod
    def forward(ctx, x, marks, name):  # noqa: ANN001, D102
        ctx.marks, ctx.name = marks, name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, D102
        ctx.marks(ctx.name)
        return grad, None, None


#: kineto's switch: release CUPTI when a profiler stops ("1") or keep it attached
CUPTI_TEARDOWN_ENV = "TEARDOWN_CUPTI"


def ensure_cupti_teardown(device: torch.device) -> str | None:
    """Before the first CUDA profiler of the process: ask kineto to detach CUPTI when the
    profiler stops. Without ``TEARDOWN_CUPTI=1`` kineto leaves CUPTI attached for the
    rest of the process (pytorch/pytorch#144455), and every later kernel launch pays its
    callbacks: on 2 H200 at ``6bd6de1`` a ``freescale`` run that followed a profiled
    ``vanilla`` run in the same process ran 16% slower in its unprofiled steps than
    with no profiler at all (``benchmarks/results/e2e_prof20_6bd6de1.json`` against
    ``e2e_prof0_6bd6de1.json``, one device call; vanilla, profiled after its timed
    steps, was not slowed) — CUPTI left attached fits, the effect of this switch is
    still to be measured. A value already set (by the user, or by inductor, which sets ``0``
    when CUDA graphs are on) is kept. Returns
    the value in force (None on CPU devices, where there is no CUPTI)."""
    if device.type != "cuda":
        return None
    return os.environ.setdefault(CUPTI_TEARDOWN_ENV, "1")


def _start_profiler(device: torch.device, activities: str = "auto") -> Any:
    """torch.profiler over the profiled steps: host ops and GPU activity, or (``"cuda"``
    on a CUDA device) GPU activity only (TrainConfig.profile_activities). CUPTI is
    released when it stops (:func:`ensure_cupti_teardown`)."""
    from torch.profiler import ProfilerActivity, profile

    ensure_cupti_teardown(device)

    if device.type == "cuda" and activities == "cuda":
        acts = [ProfilerActivity.CUDA]
    else:
        acts = [ProfilerActivity.CPU]
        if device.type == "cuda":
            acts.append(ProfilerActivity.CUDA)
    # FREESCALE_PROFILE_STACK=1 records Python frames (benchmarks/trace_host.py reads them)
    stack = os.environ.get("FREESCALE_PROFILE_STACK", "") not in ("", "0")
    prof = profile(activities=acts, record_shapes=False, with_stack=stack)
    prof.start()
    return prof
