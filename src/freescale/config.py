"""Typed configuration for every FreeScale component.

Owns the dataclasses a run is described by (data, tables, model, sparse optimizer,
training loop) and the config hash every rank checks at start-up. No component reads
untyped dictionaries; the CLI builds these from flags and the embedded defaults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

__all__ = [
    "TableConfig",
    "SparseOptimConfig",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "config_hash",
    "config_to_dict",
]

CANDIDATE_FEATURE = "candidates"


@dataclass
class TableConfig:
    """One embedding table; ``feature_names`` share it (TorchRec's EmbeddingConfig)."""

    name: str
    num_embeddings: int
    embedding_dim: int
    feature_names: list[str]
    init_std: float = 0.05

    def __post_init__(self) -> None:
        if self.num_embeddings <= 0:
            raise ValueError(f"table '{self.name}': num_embeddings must be > 0")
        if self.embedding_dim <= 0:
            raise ValueError(f"table '{self.name}': embedding_dim must be > 0")
        if not self.feature_names:
            raise ValueError(f"table '{self.name}': needs at least one feature")


@dataclass
class SparseOptimConfig:
    """Fused sparse optimizer applied by the owner of each row (fbgemm semantics).

    * ``sgd``: ``w -= lr * g`` (fbgemm EXACT_SGD)
    * ``rowwise_adagrad``: ``s += mean(g^2)``, ``w -= lr * g / (sqrt(s) + eps)``
      (fbgemm EXACT_ROWWISE_ADAGRAD)
    * ``adam``: per-element Adam with bias correction by the global step.
    ``g`` is the sum of every gradient of the row in this step.
    """

    kind: Literal["sgd", "rowwise_adagrad", "adam"] = "rowwise_adagrad"
    lr: float = 0.05
    eps: float = 1e-8
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("sgd", "rowwise_adagrad", "adam"):
            raise ValueError(f"unknown sparse optimizer '{self.kind}' (sgd, rowwise_adagrad, adam)")
        if self.lr <= 0:
            raise ValueError("sparse optimizer lr must be > 0")


@dataclass
class DataConfig:
    """Where batches come from. Synthetic data is a pure function of
    (seed, step, global sample index): never of rank or world size."""

    source: Literal["synthetic", "movielens"] = "synthetic"
    path: str | None = None  # MovieLens-format file or folder
    seed: int = 1234
    global_batch_size: int = 64
    num_items: int = 20_000
    num_actions: int = 4
    # UIH length distribution (clipped to [min_uih, max_uih])
    length_dist: Literal["lognormal", "powerlaw"] = "lognormal"
    median_uih: int = 48
    sigma: float = 1.0  # log-normal shape
    powerlaw_alpha: float = 1.2  # Pareto tail index
    min_uih: int = 1
    max_uih: int = 512
    zipf_s: float = 1.05  # item popularity exponent
    num_candidates: int = 8
    latent_dim: int = 8  # hidden ground-truth model
    label_temperature: float = 3.0
    # collision injection: share of step t+1's UIH ids copied from step t (0 = off)
    overlap: float = 0.0
    eval_samples: int = 1024

    def __post_init__(self) -> None:
        if self.global_batch_size <= 0:
            raise ValueError("global_batch_size must be > 0")
        if not 1 <= self.min_uih <= self.max_uih:
            raise ValueError(f"need 1 <= min_uih <= max_uih, got {self.min_uih}, {self.max_uih}")
        if self.num_candidates <= 0:
            raise ValueError("num_candidates must be > 0")
        if self.num_items <= 0 or self.num_actions <= 0:
            raise ValueError(
                f"num_items and num_actions must be > 0, got {self.num_items}, {self.num_actions}"
            )
        if self.median_uih < 1:
            raise ValueError(f"median_uih must be >= 1, got {self.median_uih}")
        if self.eval_samples < 0:
            raise ValueError(f"eval_samples must be >= 0, got {self.eval_samples}")


@dataclass
class ModelConfig:
    """Reference HSTU/SASRec-style sequence model."""

    embedding_dim: int = 32
    num_layers: int = 2
    num_heads: int = 2
    ffn_mult: int = 2
    max_positions: int = 32_768
    attention: Literal["auto", "reference", "sdpa", "flex"] = "auto"
    # compute dtype of the attention kernel; "auto": bfloat16 for flex on CUDA (tensor
    # cores; fp32 flex backward is ~10x slower), else the model dtype
    attention_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    dtype: Literal["float32", "float64"] = "float32"

    def __post_init__(self) -> None:
        if self.embedding_dim <= 0:
            raise ValueError(f"embedding_dim must be > 0, got {self.embedding_dim}")
        if self.num_layers < 0 or self.num_heads < 1 or self.ffn_mult < 1:
            raise ValueError(
                f"need num_layers >= 0, num_heads >= 1 and ffn_mult >= 1, got "
                f"{self.num_layers}, {self.num_heads}, {self.ffn_mult}"
            )
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"embedding_dim {self.embedding_dim} is not divisible by num_heads {self.num_heads}"
            )


@dataclass
class TrainConfig:
    """One training run."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sparse_optim: SparseOptimConfig = field(default_factory=SparseOptimConfig)
    tables: list[TableConfig] | None = None  # None: derived from data + model
    steps: int = 300
    dense_lr: float = 3e-3
    seed: int = 0  # dense init
    eval_every: int = 100
    eval_batches: int = 0  # 0: data.eval_samples / global_batch_size
    log_every: int = 10
    log_path: str | None = None  # JSON lines
    device: Literal["auto", "cpu", "cuda"] = "auto"
    progress: bool = True
    # embedding schedule: "vanilla" (synchronous, TorchRec-equivalent), "sdd" (DESIGN.md 3:
    # the next step's id dist ahead, on a side stream; bitwise equal) or "prioritized"
    # (DESIGN.md 2.2: only collision rows on the critical path; bitwise equal)
    mode: Literal["vanilla", "sdd", "prioritized"] = "vanilla"
    max_collision_rate: float = 0.9  # prioritized guardrail (occurrence share)
    # prioritized: run the gradient-free part of the embedding backward (mask read, the
    # deferred update, the next step's exclusive rows) between the forward and
    # loss.backward() instead of when the dense backward reaches the embeddings
    # (PrioritizedEmbeddingCollection.prepare_backward). Bit-identical either way
    early_prepare: bool = True
    # backend of the overlapped embedding traffic (sdd's ids ahead; prioritized's
    # exclusive embeddings and gradients): "default" = a side group of the main backend
    # (NCCL on GPU); "auto" = SM-free, chosen by topology (comm.select_backend: copy
    # engine inside one node on CUDA, host-staged otherwise); or one by name
    overlap_backend: Literal["default", "auto", "host_staged", "copy_engine"] = "default"
    # how the copy engine completes its collectives (comm.CopyEngineConfig.completion):
    # "host" = its worker waits on the host for the GPU, "device" = through CUDA
    # inter-process events, no host wait; "auto" = $FREESCALE_COPY_ENGINE_COMPLETION,
    # else device. Bit-identical either way
    copy_engine_completion: Literal["auto", "host", "device"] = "auto"
    # how the copy engine's per-collective handshakes travel: "shm" (one shared-memory
    # file for the host's ranks, comm/shm_exchange.py), "gloo" (two gloo collectives per
    # call); "auto" = $FREESCALE_COPY_ENGINE_HANDSHAKE, else shm where available. Same bits
    copy_engine_handshake: Literal["auto", "shm", "gloo"] = "auto"
    # per-stage timing: "sync" synchronises the device at every stage boundary (exact
    # stage times, but no overlap across stages); "events" records CUDA events instead
    # and reads them one step later (no host sync on the compute stream for timing; the
    # mode for throughput measurements). Identical numerics either way.
    timing: Literal["sync", "events"] = "sync"
    # with timing="events": finish each step's record (the all-gather of stage times for
    # the straggler share, hooks' on_metrics, log) one step later still, so the per-step
    # gloo all-gather is in flight for a step instead of a host barrier between the ranks
    # every step (Trainer._finish_step). Same order of records and hooks, identical
    # numerics. Off: measured slower on 2 H200 at 878d359 (QPS 4,088 / 4,309 vs 5,029 /
    # 4,799, BENCHMARKS.md e2e session 13): the data stage's gate (lag 4 behind the
    # finished records) then starts each batch a step later and the training thread
    # waits ~13 ms per step for it (bench variant freescale_deferred_metrics)
    defer_metrics: bool = False
    # the owner's sparse update: "ahead" groups the ids by row when they arrive in the
    # forward and reads the row count in the backward from a pinned copy made then
    # (embedding/reduce.group_rows_start), "padded" groups gradients into one slot per id
    # with no device read-back (group_rows_padded), "sync" reads the unique-row count back
    # in the backward (group_rows); "auto": ahead on CUDA, sync on CPU, unless
    # $FREESCALE_SPARSE_UPDATE says otherwise. Bit-identical parameters either way.
    sparse_update: Literal["auto", "sync", "padded", "ahead"] = "auto"
    # id-dist split sizes counted on the host one step ahead (no device read-back in the
    # id dist; DESIGN.md 3); None: on with CUDA, off on CPU (where it only adds work)
    host_counts: bool | None = None
    # the data stage (input agreement, balancing, id counts, pinning) of steps t+1 / t+2 on
    # a background thread while step t trains (pipeline/data_stage.py); None: on with
    # CUDA. Identical numerics either way.
    data_thread: bool | None = None
    # torch intra-op threads per rank; None: OMP_NUM_THREADS if set, else cores / local
    # ranks / 2 (at most 8). The loader thread and the training thread each drive their
    # own OpenMP team: torch's default (every core, per process) oversubscribes the host
    # as soon as several ranks share it, and slows host-side batch work several-fold.
    cpu_threads: int | None = None
    # host: Python's thread switch interval (sys.setswitchinterval) while training, in ms;
    # None leaves the interpreter's (5 ms by default). A thread that wants the interpreter
    # lock while another runs Python code waits up to this long: the training thread's
    # kernel launches wait behind the data-stage and communicator threads. Restored after
    gil_switch_interval_ms: float | None = None
    # host: measure that wait over the timed steps (metrics.host_cpu.GilProbe, one wake
    # per this many ms; 0 = off); reported in the summary's host_cpu["gil_wait"]
    gil_probe_ms: float = 0.0
    # debugging hangs: if no step finishes within this many seconds, write every thread's
    # Python stack to stderr (pipeline.trainer.StallDump, faulthandler; once per stall,
    # the run goes on); 0 = off
    stall_dump_s: float = 0.0
    # host: pin this rank's threads by role (pipeline/placement.py): training and autograd
    # threads a physical core each, data stage and loader a CPU each, the rest the other
    # cores of the rank's share; applied at the first step and after the warm-up, undone
    # at the end. Linux only (elsewhere reported as unavailable); no numerical effect
    pin_threads: bool = False
    # profile the last `profile_steps` steps (excluded from QPS) with torch.profiler and
    # report GPU compute / communication / bubble time per step (pipeline/accounting.py)
    profile_steps: int = 0
    trace_dir: str | None = None  # also keep each rank's Chrome trace (Perfetto) here
    # what the profiler records: "cpu_cuda" (host ops, the stage ranges and GPU kernels:
    # the trace option's view) or "cuda" (GPU kernels and copies only — all the GPU
    # accounting reads — with less host cost per op: the profiled steps of a
    # launch-heavy schedule stretch less); "auto": cpu_cuda
    profile_activities: Literal["auto", "cpu_cuda", "cuda"] = "auto"

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.timing not in ("sync", "events"):
            raise ValueError(f"timing must be 'sync' or 'events', got {self.timing!r}")
        if self.sparse_update not in ("auto", "sync", "padded", "ahead"):
            raise ValueError(
                f"sparse_update must be auto | sync | padded | ahead, got {self.sparse_update!r}"
            )
        if self.overlap_backend not in ("default", "auto", "host_staged", "copy_engine"):
            raise ValueError(
                "overlap_backend must be default | auto | host_staged | copy_engine, "
                f"got {self.overlap_backend!r}"
            )
        if self.copy_engine_completion not in ("auto", "host", "device"):
            raise ValueError(
                "copy_engine_completion must be auto | host | device, "
                f"got {self.copy_engine_completion!r}"
            )
        if self.copy_engine_handshake not in ("auto", "shm", "gloo"):
            raise ValueError(
                "copy_engine_handshake must be auto | shm | gloo, "
                f"got {self.copy_engine_handshake!r}"
            )
        if self.profile_steps < 0:
            raise ValueError("profile_steps must be >= 0")
        if self.profile_activities not in ("auto", "cpu_cuda", "cuda"):
            raise ValueError(
                "profile_activities must be auto | cpu_cuda | cuda, "
                f"got {self.profile_activities!r}"
            )
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.gil_switch_interval_ms is not None and not self.gil_switch_interval_ms > 0:
            raise ValueError(
                f"gil_switch_interval_ms must be > 0 (or None), got {self.gil_switch_interval_ms}"
            )
        if not self.stall_dump_s >= 0:
            raise ValueError(f"stall_dump_s must be >= 0 (0 = off), got {self.stall_dump_s}")
        if not self.gil_probe_ms >= 0:
            raise ValueError(f"gil_probe_ms must be >= 0 (0 = off), got {self.gil_probe_ms}")


def config_to_dict(cfg: object) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str))


def config_hash(cfg: object) -> str:
    """Stable hash of a config; every rank compares it at start-up."""
    blob = json.dumps(config_to_dict(cfg), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def default_tables(data: DataConfig, model: ModelConfig, uih_keys: list[str]) -> list[TableConfig]:
    """Tables of the built-in data sources: items (UIH items and candidates share it)
    and actions."""
    d = model.embedding_dim
    tables = [TableConfig("item", data.num_items, d, [k for k in uih_keys if k != "uih_action"])]
    tables[0].feature_names.append(CANDIDATE_FEATURE)
    if "uih_action" in uih_keys:
        tables.append(TableConfig("action", data.num_actions, d, ["uih_action"]))
    return tables
