"""Interoperability with TorchRec, and the TorchRec baseline of DESIGN.md section 1, tier 3.

Owns:

* ``KeyedJaggedTensor`` conversions: :func:`features_to_kjt`, :func:`batch_to_kjt`,
  :func:`kjt_to_features`, :func:`batch_from_kjt` (ids only; labels and the other
  per-candidate fields travel separately);
* table configs: :func:`tables_from_torchrec` / :func:`tables_to_torchrec`
  (TorchRec ``EmbeddingConfig`` <-> :class:`freescale.config.TableConfig`);
* the baseline: :func:`build_torchrec_sparse` builds TorchRec's row-wise sharded
  ``EmbeddingCollection`` under ``DistributedModelParallel`` with a fused fbgemm
  optimizer (``EXACT_SGD`` / ``EXACT_ROWWISE_ADAGRAD``, same lr / eps as FreeScale),
  :func:`init_torchrec_tables` writes FreeScale's initial rows into its shards in place,
  and :func:`torchrec_full_tables` / :func:`torchrec_optimizer_state` /
  :func:`gather_row_shards` read full tables and row-wise Adagrad state back for
  comparison; :func:`torchrec_row_ranges` / :func:`check_row_ranges` compare its shard
  placement with FreeScale's ``RowWisePlan`` (both: ``block = ceil(rows / W)``);
* drop-in model sharding: :func:`shard_model` finds every TorchRec
  ``EmbeddingCollection`` of an unchanged TorchRec model and swaps in a
  :class:`FreeScaleEmbeddingCollection` (TorchRec's call interface, KJT in,
  ``{feature: JaggedTensor}`` out) over a FreeScale sharded collection initialised from
  the module's own weights; :func:`freescale_modules` lists the swapped modules (for
  ``set_step`` / ``set_next`` / ``flush`` in the training loop).

TorchRec and fbgemm are optional: this module imports without them and every function
that needs them imports them lazily and raises :class:`ImportError` naming what to
install. Nothing here runs on the GPU path (DESIGN.md section 5: no TorchRec there).

Numerics of the baseline (tier 3, measured in tests/test_torchrec_parity.py):

* Loss scaling. TorchRec divides embedding gradients by W in its all-to-all backward
  (``torchrec.distributed.comm_ops`` gradient division, on by default), matching DDP's
  average; so under TorchRec the local loss is ``sum / global_count * W``. FreeScale
  sums sparse gradients at the owners, so its loss is ``sum / global_count`` with a SUM
  hook on DDP (``Trainer``). Both give the gradient of the global loss.
* Lookups are copies: forward outputs are bitwise equal while the tables are.
* The fbgemm CPU backward of an unpooled (``nobag``) table sums a row's gradients
  sequentially from zero in (feature, source rank, sample, position) order; FreeScale by
  a pairwise tree in (source rank, feature, position) order. They agree bitwise for rows
  with at most two gradients in a step.
* fbgemm's ``EXACT_SGD`` rounds ``w - lr * g`` once (FMA); FreeScale's optimizer twice.
  With sum order and single rounding emulated, FreeScale reproduces TorchRec's SGD
  bit for bit.
* fbgemm's row-wise Adagrad takes ``mean(g^2)`` as a sequential float sum over the
  dimension, FreeScale by a fixed pairwise tree; its multiplier ``lr / (sqrt(s) + eps)``
  also differs from float32 arithmetic in the last bit on some rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm.base import Communicator
from ..config import CANDIDATE_FEATURE, SparseOptimConfig, TableConfig
from ..data.batch import JaggedBatch
from ..embedding.collection import ddp_ignore_shards

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = [
    "require_torchrec",
    "features_to_kjt",
    "batch_to_kjt",
    "kjt_to_features",
    "batch_from_kjt",
    "tables_from_torchrec",
    "tables_to_torchrec",
    "fused_params_for",
    "build_torchrec_sparse",
    "torchrec_lookup",
    "torchrec_local_shards",
    "torchrec_optimizer_shards",
    "torchrec_row_ranges",
    "check_row_ranges",
    "init_torchrec_tables",
    "gather_row_shards",
    "torchrec_full_tables",
    "torchrec_optimizer_state",
    "FreeScaleEmbeddingCollection",
    "shard_model",
    "freescale_modules",
]

_INSTALL_HINT = (
    "TorchRec interop needs torchrec and fbgemm-gpu. On CPU: pip install "
    "fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec==1.8.0 && pip install "
    "tensordict torchmetrics tqdm pyre-extensions (see DESIGN.md section 5)"
)


def require_torchrec() -> Any:
    """Import and return the ``torchrec`` module, or raise :class:`ImportError` saying
    what to install."""
    try:
        import fbgemm_gpu  # noqa: F401
        import torchrec
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"{_INSTALL_HINT} (import failed: {e})") from e
    return torchrec


# --------------------------------------------------------------------------- KJT


def features_to_kjt(
    features: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    keys: Sequence[str] | None = None,
    lengths_dtype: torch.dtype = torch.int32,
) -> KeyedJaggedTensor:
    """``{key: (values, lengths)}`` (the input of ``ShardedEmbeddingCollection``) -> a
    ``KeyedJaggedTensor`` with ``keys`` (default: the mapping's order). Every key must
    have the same number of samples; values become int64, lengths ``lengths_dtype``
    (TorchRec's convention is int32)."""
    require_torchrec()
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    keys = list(features) if keys is None else list(keys)
    missing = [k for k in keys if k not in features]
    if missing:
        raise KeyError(f"features_to_kjt: no feature(s) {missing} (have {list(features)})")
    if not keys:
        raise ValueError("features_to_kjt: need at least one key")
    strides = {k: int(features[k][1].numel()) for k in keys}
    if len(set(strides.values())) != 1:
        raise ValueError(f"features_to_kjt: keys have different sample counts {strides}")
    for k in keys:
        v, ln = features[k]
        if int(ln.sum()) != int(v.numel()):
            raise ValueError(
                f"features_to_kjt: feature '{k}' has {v.numel()} values but lengths sum "
                f"to {int(ln.sum())}"
            )
    values = torch.cat([features[k][0].reshape(-1).to(torch.int64) for k in keys])
    lengths = torch.cat([features[k][1].reshape(-1).to(lengths_dtype) for k in keys])
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths)


def batch_to_kjt(
    batch: JaggedBatch, keys: Sequence[str] | None = None, lengths_dtype: torch.dtype = torch.int32
) -> KeyedJaggedTensor:
    """Ids of ``batch`` as a ``KeyedJaggedTensor``: each UIH key, then ``"candidates"``
    (``keys`` picks a subset / order). Lengths are per sample, values int64."""
    feats: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        k: (batch.uih[k], batch.uih_lengths[k]) for k in batch.keys
    }
    feats[CANDIDATE_FEATURE] = (batch.candidates, batch.num_candidates)
    return features_to_kjt(feats, keys if keys is not None else list(feats), lengths_dtype)


def kjt_to_features(kjt: KeyedJaggedTensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A ``KeyedJaggedTensor`` -> ``{key: (values int64, lengths int64)}`` in key order
    (weights, if any, are dropped: FreeScale's lookups are unweighted)."""
    require_torchrec()
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for k, jt in kjt.to_dict().items():
        out[k] = (jt.values().to(torch.int64), jt.lengths().to(torch.int64))
    return out


def batch_from_kjt(
    kjt: KeyedJaggedTensor,
    labels: torch.Tensor,
    *,
    uih_keys: Sequence[str] | None = None,
    candidate_key: str = CANDIDATE_FEATURE,
    sample_ids: torch.Tensor | None = None,
    step: int = 0,
    timestamps: Mapping[str, torch.Tensor] | None = None,
    true_probs: torch.Tensor | None = None,
) -> JaggedBatch:
    """Rebuild a :class:`JaggedBatch` from the ids in ``kjt`` plus what a KJT does not
    carry (``labels``, one per candidate; optional sample ids, default ``0..B-1``;
    timestamps; true probabilities). ``uih_keys`` defaults to every key but
    ``candidate_key``."""
    feats = kjt_to_features(kjt)
    if candidate_key not in feats:
        raise KeyError(f"batch_from_kjt: the KJT has no '{candidate_key}' key ({list(feats)})")
    keys = [k for k in feats if k != candidate_key] if uih_keys is None else list(uih_keys)
    cands, ncand = feats[candidate_key]
    if labels.numel() != cands.numel():
        raise ValueError(f"batch_from_kjt: {labels.numel()} labels for {cands.numel()} candidates")
    b = int(ncand.numel())
    if sample_ids is None:
        sample_ids = torch.arange(b, dtype=torch.int64)
    return JaggedBatch(
        sample_ids=sample_ids.to(torch.int64),
        uih={k: feats[k][0] for k in keys},
        uih_lengths={k: feats[k][1] for k in keys},
        candidates=cands,
        num_candidates=ncand,
        labels=labels.to(torch.float32),
        timestamps=dict(timestamps) if timestamps is not None else None,
        true_probs=true_probs,
        step=step,
    )


# ------------------------------------------------------------------- tables


def tables_from_torchrec(
    configs: Sequence[EmbeddingConfig], init_std: float | None = None
) -> list[TableConfig]:
    """TorchRec ``EmbeddingConfig`` s -> FreeScale :class:`TableConfig` s (same order).

    FreeScale's collection is unpooled, FP32, one shared embedding dim: pooled configs
    (``EmbeddingBagConfig``, or any ``pooling`` other than NONE), other data types,
    virtual / position-weighted / pruned tables and mismatched dims raise
    :class:`ValueError`. FreeScale initialises rows itself (``N(0, init_std)``, a
    function of (seed, table, row)); ``init_std`` defaults to the standard deviation of
    TorchRec's uniform ``[weight_init_min, weight_init_max]`` range. A custom
    ``init_fn`` is not translated (load rows explicitly to reproduce it).
    """
    torchrec = require_torchrec()
    from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType

    out: list[TableConfig] = []
    for c in configs:
        name = getattr(c, "name", "") or "<unnamed>"
        if isinstance(c, EmbeddingBagConfig):
            raise ValueError(
                f"table '{name}': EmbeddingBagConfig is pooled (pooling={c.pooling.name}); "
                "FreeScale's ShardedEmbeddingCollection is unpooled like TorchRec's "
                "EmbeddingCollection: use torchrec.EmbeddingConfig"
            )
        pooling = getattr(c, "pooling", None)
        if pooling is not None and pooling != PoolingType.NONE:
            raise ValueError(
                f"table '{name}': pooling={pooling.name} is a pooled (EmbeddingBag) option; "
                "FreeScale tables are unpooled (sequence) embeddings"
            )
        if not isinstance(c, torchrec.EmbeddingConfig) and pooling is None:
            raise TypeError(f"table '{name}': expected torchrec.EmbeddingConfig, got {type(c)}")
        if not getattr(c, "name", ""):
            raise ValueError("every TorchRec table needs a name (FreeScale keys rows by table)")
        if c.data_type != DataType.FP32:
            raise ValueError(
                f"table '{name}': data_type={c.data_type.name}; FreeScale tables are FP32 "
                "(float64 via ModelConfig.dtype)"
            )
        unsupported = {
            "use_virtual_table": getattr(c, "use_virtual_table", False),
            "need_pos": getattr(c, "need_pos", False),
            "num_embeddings_post_pruning": getattr(c, "num_embeddings_post_pruning", None),
            "total_num_buckets": getattr(c, "total_num_buckets", None),
            "is_weighted": getattr(c, "is_weighted", False),
        }
        bad = {k: v for k, v in unsupported.items() if v not in (None, False)}
        if bad:
            raise ValueError(f"table '{name}': unsupported TorchRec option(s) {bad}")
        std = init_std
        if std is None:
            lo, hi = c.get_weight_init_min(), c.get_weight_init_max()
            std = (hi - lo) / math.sqrt(12.0)
        out.append(
            TableConfig(
                name=c.name,
                num_embeddings=int(c.num_embeddings),
                embedding_dim=int(c.embedding_dim),
                feature_names=list(c.feature_names),
                init_std=float(std),
            )
        )
    dims = {t.embedding_dim for t in out}
    if len(dims) > 1:
        raise ValueError(
            "mismatched embedding dims: one FreeScale collection needs one dim, got "
            + ", ".join(f"{t.name}={t.embedding_dim}" for t in out)
            + " (build one collection per dim)"
        )
    return out


def tables_to_torchrec(tables: Sequence[TableConfig]) -> list[EmbeddingConfig]:
    """FreeScale tables -> TorchRec ``EmbeddingConfig`` s (same names, rows, dims,
    features; TorchRec's own init is uniform with FreeScale's std, and is overwritten by
    :func:`init_torchrec_tables` when the two must start equal)."""
    torchrec = require_torchrec()
    out = []
    for t in tables:
        a = t.init_std * math.sqrt(3.0)
        out.append(
            torchrec.EmbeddingConfig(
                name=t.name,
                num_embeddings=t.num_embeddings,
                embedding_dim=t.embedding_dim,
                feature_names=list(t.feature_names),
                weight_init_min=-a,
                weight_init_max=a,
            )
        )
    return out


# ------------------------------------------------------------------ baseline


def fused_params_for(optimizer: SparseOptimConfig) -> dict:
    """Sharder ``fused_params`` giving fbgemm's optimizer with FreeScale's semantics:
    ``sgd`` -> ``EXACT_SGD``, ``rowwise_adagrad`` -> ``EXACT_ROWWISE_ADAGRAD`` (same lr
    and eps). Adam is refused: fbgemm has no CPU Adam kernel and the GPU machines have
    no TorchRec (FreeScale's Adam is checked against a single-process reference,
    tests/test_sparse_adam.py). Weight decay is not part of the comparison."""
    require_torchrec()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    if optimizer.weight_decay:
        raise ValueError(
            "TorchRec baseline: weight_decay is not part of the tier-3 comparison "
            f"(got {optimizer.weight_decay}); set SparseOptimConfig.weight_decay=0"
        )
    if optimizer.kind == "sgd":
        return {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": optimizer.lr}
    if optimizer.kind == "rowwise_adagrad":
        return {
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": optimizer.lr,
            "eps": optimizer.eps,
        }
    if optimizer.kind == "adam":
        raise NotImplementedError(
            "TorchRec baseline: fbgemm has no CPU Adam kernel (and the GPU machines have no "
            "TorchRec); use sgd or rowwise_adagrad. FreeScale's Adam is checked against a "
            "single-process reference instead (tests/test_sparse_adam.py)"
        )
    raise ValueError(f"unknown sparse optimizer '{optimizer.kind}'")


def _topology(world_size: int, device: torch.device) -> Any:
    from torchrec.distributed.planner import Topology

    try:  # torchrec >= 1.8 prefers the factory (and warns otherwise)
        from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

        return TopologyFactory.create_topology(
            trainer_config=TrainerConfig(world_size=world_size, local_world_size=world_size),
            kernel_config=KernelConfig(compute_device=device.type),
        )
    except ImportError:  # pragma: no cover - older torchrec
        return Topology(world_size=world_size, compute_device=device.type)


def build_torchrec_sparse(
    tables: Sequence[TableConfig],
    optimizer: SparseOptimConfig,
    pg: dist.ProcessGroup | None = None,
    device: torch.device | str = "cpu",
    check_ranges: bool = True,
) -> DistributedModelParallel:
    """TorchRec's ``EmbeddingCollection`` over ``tables``, row-wise sharded over the ranks
    of ``pg`` (default: the world) by ``DistributedModelParallel`` with a fused
    fbgemm optimizer (:func:`fused_params_for`).

    The plan comes from TorchRec's planner with every table constrained to
    ``sharding_types=["row_wise"]`` and ``compute_kernels=["fused"]``. The collection is
    created on the meta device, so no rank allocates a full table; its initial rows are
    TorchRec's (load FreeScale's with :func:`init_torchrec_tables`). With
    ``check_ranges`` the shard row ranges are checked against FreeScale's
    (:func:`check_row_ranges`). Forward: ``dmp(kjt)`` (or :func:`torchrec_lookup`);
    the update runs inside backward, on gradients TorchRec has divided by W (its
    default gradient division): scale the local loss by W, as for DDP's average.
    """
    require_torchrec()
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
    from torchrec.distributed.planner.storage_reservations import (
        FixedPercentageStorageReservation,
    )
    from torchrec.distributed.types import ShardingEnv, ShardingType
    from torchrec.modules.embedding_modules import EmbeddingCollection

    if not dist.is_initialized():
        raise RuntimeError("build_torchrec_sparse needs an initialised torch.distributed group")
    device = torch.device(device)
    pg = pg if pg is not None else dist.group.WORLD
    world_size = dist.get_world_size(pg)
    tables = list(tables)
    tables_from_torchrec(tables_to_torchrec(tables))  # same validation as the interop path
    ec = EmbeddingCollection(tables=tables_to_torchrec(tables), device=torch.device("meta"))
    sharder = EmbeddingCollectionSharder(fused_params=fused_params_for(optimizer))
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=[ShardingType.ROW_WISE.value],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for t in tables
    }
    planner = EmbeddingShardingPlanner(
        topology=_topology(world_size, device),
        constraints=constraints,
        storage_reservation=FixedPercentageStorageReservation(0.15),
        debug=False,
    )
    plan = planner.collective_plan(ec, [sharder], pg)
    dmp = DistributedModelParallel(
        ec,
        env=ShardingEnv.from_process_group(pg),
        device=device,
        plan=plan,
        sharders=[sharder],
    )
    if check_ranges:
        check_row_ranges(dmp, tables, world_size)
    return dmp


def torchrec_lookup(
    dmp: DistributedModelParallel, features: KeyedJaggedTensor
) -> dict[str, torch.Tensor]:
    """Forward of the baseline: ``{feature: [N_f, D]}`` in the local batch's order (the
    layout of FreeScale's ``ShardedEmbeddingCollection.forward``)."""
    out = dmp(features)
    if hasattr(out, "wait"):
        out = out.wait()
    return {k: jt.values() for k, jt in out.items()}


def _table_of_key(key: str) -> str:
    # "<prefix>embeddings.<table>.weight" -> "<table>"
    parts = key.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        raise ValueError(f"unexpected TorchRec state key '{key}'")
    return parts[-2]


def torchrec_local_shards(
    dmp: DistributedModelParallel,
) -> dict[str, list[tuple[int, torch.Tensor]]]:
    """This rank's shards of each table, ``{name: [(first global row, [rows, D])]}``.

    The tensors are the ``ShardedTensor`` local shards of ``dmp.state_dict()``, which for
    the fused CPU kernel are views into the fbgemm TBE's weights (writes reach the
    model; :func:`init_torchrec_tables` checks it)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, v in dmp.state_dict().items():
        if not isinstance(v, ShardedTensor):
            continue
        name = _table_of_key(key)
        for s in v.local_shards():
            row, col = s.metadata.shard_offsets[0], s.metadata.shard_offsets[1]
            if col != 0 or s.metadata.shard_sizes[1] != v.size(1):
                raise ValueError(f"table '{name}' is not row-wise sharded (column offset {col})")
            out.setdefault(name, []).append((int(row), s.tensor))
    return out


def torchrec_optimizer_shards(
    dmp: DistributedModelParallel,
) -> dict[str, dict[str, list[tuple[int, torch.Tensor]]]]:
    """This rank's fused optimizer state per table: ``{name: {state: [(row, tensor)]}}``
    (row-wise Adagrad: ``momentum1``, one value per row; views of the TBE state)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, dict[str, list[tuple[int, torch.Tensor]]]] = {}
    for _, states in dmp.fused_optimizer.state_dict()["state"].items():
        for skey, v in states.items():
            if not isinstance(v, ShardedTensor):
                continue
            name, _, state = skey.rpartition(".")
            for s in v.local_shards():
                out.setdefault(name, {}).setdefault(state, []).append(
                    (int(s.metadata.shard_offsets[0]), s.tensor)
                )
    return out


def torchrec_row_ranges(
    dmp: DistributedModelParallel, world_size: int | None = None
) -> dict[str, list[tuple[int, int]]]:
    """Global row range ``[start, stop)`` of every rank's shard of each table, by rank
    (empty ranks get ``(rows, rows)``), from the plan's sharded-tensor metadata."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    out: dict[str, list[tuple[int, int]]] = {}
    for key, v in dmp.state_dict().items():
        if not isinstance(v, ShardedTensor):
            continue
        name = _table_of_key(key)
        md = v.metadata()
        ranges: dict[int, tuple[int, int]] = {}
        for sm in md.shards_metadata:
            rank = sm.placement.rank()
            lo = int(sm.shard_offsets[0])
            ranges[rank] = (lo, lo + int(sm.shard_sizes[0]))
        world = world_size if world_size is not None else dist.get_world_size()
        rows = int(v.size(0))
        out[name] = [ranges.get(r, (rows, rows)) for r in range(world)]
    return out


def check_row_ranges(
    dmp: DistributedModelParallel, tables: Sequence[TableConfig], world_size: int
) -> None:
    """Raise :class:`AssertionError` unless TorchRec places every table's rows exactly as
    FreeScale's ``RowWisePlan`` (``block = ceil(rows / W)``, rank r owns
    ``[r*block, min((r+1)*block, rows))``)."""
    ranges = torchrec_row_ranges(dmp, world_size)
    for t in tables:
        block = math.ceil(t.num_embeddings / world_size)
        ours = [
            (min(r * block, t.num_embeddings), min((r + 1) * block, t.num_embeddings))
            for r in range(world_size)
        ]
        theirs = ranges[t.name]
        if len(theirs) != world_size:
            raise AssertionError(
                f"table '{t.name}': TorchRec placed shards on {len(theirs)} ranks, not {world_size}"
            )
        # empty shards: only their size matters
        same = all(a == b or (a[0] == a[1] and b[0] == b[1]) for a, b in zip(ours, theirs))
        if not same:
            raise AssertionError(
                f"table '{t.name}' ({t.num_embeddings} rows, W={world_size}): TorchRec's "
                f"row-wise shards {ranges[t.name]} differ from FreeScale's {ours}"
            )


def _tbe_table_weights(dmp: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """Per-table weights as the fbgemm TBEs hold them (private TorchRec attributes;
    empty if their layout changed)."""
    out: dict[str, torch.Tensor] = {}
    for lookup in getattr(dmp.module, "_lookups", []):
        inner = getattr(lookup, "module", lookup)  # a DDP-wrapped lookup
        for emb in getattr(inner, "_emb_modules", []):
            if hasattr(emb, "named_split_embedding_weights"):
                for key, w in emb.named_split_embedding_weights():
                    out[key.rpartition(".weight")[0]] = w
    return out


@torch.no_grad()
def init_torchrec_tables(
    dmp: DistributedModelParallel,
    tables: Sequence[TableConfig],
    seed: int,
    dtype: torch.dtype = torch.float32,
) -> list[str]:
    """Write FreeScale's initial rows (:func:`freescale.embedding.collection.init_table_rows`
    with the *index of each table in* ``tables``, so pass the same list, in the same
    order, as to ``ShardedEmbeddingCollection``) into the local shards in place, and
    zero the fused optimizer state. Checks against the fbgemm TBEs (reached through
    private TorchRec attributes) that the writes landed in the weights they train and
    raises if not; returns the names of the tables so verified (empty if TorchRec's
    internals moved: then check a lookup instead)."""
    from ..embedding.collection import init_table_rows

    shards = torchrec_local_shards(dmp)
    for ti, t in enumerate(tables):
        for lo, w in shards.get(t.name, []):
            w.copy_(init_table_rows(t, ti, lo, lo + w.shape[0], seed=seed, dtype=dtype))
    for states in torchrec_optimizer_shards(dmp).values():
        for parts in states.values():
            for _, s in parts:
                s.zero_()
    live = _tbe_table_weights(dmp)
    verified = []
    for t in tables:
        parts = shards.get(t.name, [])
        if t.name not in live or len(parts) != 1:
            continue
        tbe, w = live[t.name], parts[0][1]
        if tbe.data_ptr() != w.data_ptr() or not torch.equal(tbe, w):
            raise RuntimeError(
                f"table '{t.name}': TorchRec's state_dict shard is not a view of the TBE "
                "weights; rows were not loaded"
            )
        verified.append(t.name)
    return verified


def gather_row_shards(
    shards: Mapping[str, Sequence[tuple[int, torch.Tensor]]],
    num_rows: Mapping[str, int],
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Full tensors from row shards held by the ranks of ``group``: every rank passes its
    ``{name: [(first row, tensor)]}`` and gets ``{name: [num_rows, ...]}`` (a copy, in
    the shards' dtype). Meant for comparisons of small tables: every rank ends
    with every table. Rows no rank holds raise."""
    local = {
        name: [(int(lo), t.detach().cpu().clone()) for lo, t in parts]
        for name, parts in shards.items()
    }
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    else:
        gathered = [local]
    out: dict[str, torch.Tensor] = {}
    for name, n in num_rows.items():
        parts = [p for g in gathered for p in g.get(name, [])]
        if not parts:
            raise KeyError(f"gather_row_shards: no rank holds table '{name}'")
        ref = parts[0][1]
        full = torch.empty((n, *ref.shape[1:]), dtype=ref.dtype)
        seen = torch.zeros(n, dtype=torch.bool)
        for lo, t in parts:
            full[lo : lo + t.shape[0]] = t
            seen[lo : lo + t.shape[0]] = True
        if not bool(seen.all()):
            missing = int((~seen).sum())
            raise RuntimeError(f"gather_row_shards: {missing} rows of '{name}' held by no rank")
        out[name] = full
    return out


def torchrec_full_tables(
    dmp: DistributedModelParallel,
    tables: Sequence[TableConfig],
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """Every table of the baseline, gathered on every rank (``{name: [rows, D]}``)."""
    return gather_row_shards(
        torchrec_local_shards(dmp), {t.name: t.num_embeddings for t in tables}, group
    )


def torchrec_optimizer_state(
    dmp: DistributedModelParallel,
    tables: Sequence[TableConfig],
    state: str = "momentum1",
    group: dist.ProcessGroup | None = None,
) -> dict[str, torch.Tensor]:
    """One fused optimizer state of every table, gathered on every rank (row-wise
    Adagrad's ``momentum1``: ``{name: [rows]}``, FreeScale's ``sum_sq``)."""
    per = torchrec_optimizer_shards(dmp)
    shards = {name: st[state] for name, st in per.items() if state in st}
    return gather_row_shards(shards, {t.name: t.num_embeddings for t in tables}, group)


# ------------------------------------------------------------ model sharding

#: ``init`` choices of :func:`shard_model`: copy the module's rows, or FreeScale's own
_INITS = ("module", "freescale")
_FREESCALE_DTYPES = (torch.float32, torch.float64)


def _ec_class() -> type:
    require_torchrec()
    from torchrec.modules.embedding_modules import EmbeddingCollection

    return EmbeddingCollection


def _check_ec(ec: Any, where: str, init: str) -> tuple[torch.dtype, torch.device]:
    """Refuse what one FreeScale collection cannot express (module ``where``); return the
    dtype and device of its weights."""
    if ec.need_indices():
        raise NotImplementedError(
            f"module '{where}': EmbeddingCollection(need_indices=True) returns the ids as "
            "JaggedTensor weights; FreeScale's collection does not (build the module with "
            "need_indices=False, the default)"
        )
    configs = list(ec.embedding_configs())
    shared = [
        (c.name, f, e)
        for c, names in zip(configs, ec.embedding_names_by_table())
        for f, e in zip(c.feature_names, names)
        if f != e
    ]
    if shared:
        raise NotImplementedError(
            f"module '{where}': feature(s) {sorted({f for _, f, _ in shared})} feed several "
            f"tables ({[e for _, _, e in shared]}); FreeScale maps each feature to one table"
        )
    # group the tables by (dtype, sharding); every table goes row-wise, so by dtype
    groups: dict[torch.dtype, list[str]] = {}
    devices = set()
    for c in configs:
        w = ec.embeddings[c.name].weight
        groups.setdefault(w.dtype, []).append(c.name)
        devices.add(w.device)
    if len(groups) > 1:
        desc = "; ".join(f"{dt}: {names}" for dt, names in groups.items())
        raise NotImplementedError(
            f"module '{where}': its tables fall into {len(groups)} dtype groups ({desc}), "
            "and one FreeScale collection holds tables of one dtype; split them into one "
            "EmbeddingCollection per dtype"
        )
    ((dtype, names),) = groups.items()
    if dtype not in _FREESCALE_DTYPES:
        raise NotImplementedError(
            f"module '{where}': tables {names} are {dtype}; FreeScale tables are float32 "
            "(or float64)"
        )
    (device,) = devices
    if device.type == "meta" and init == "module":
        raise ValueError(
            f"module '{where}': its weights are on the meta device, so there are no rows "
            "to copy; pass init='freescale' (FreeScale's own N(0, std) rows) instead"
        )
    return dtype, device


class FreeScaleEmbeddingCollection(nn.Module):
    """A FreeScale row-wise sharded embedding collection with the call interface of
    TorchRec's ``EmbeddingCollection``, which :func:`shard_model` swaps in for it.

    ``forward(kjt)`` returns ``{feature: JaggedTensor}``: values are the embedding rows
    of that feature's ids in the KJT's order (``[N_f, D]``), lengths the KJT's lengths
    of it; keys and order are TorchRec's (tables in order, then their features). Like
    TorchRec's module, which casts its lookups with ``.float()``, the values are float32
    (``output_dtype``; ``None`` keeps the tables' dtype, e.g. float64). KJT keys the
    collection does not own are ignored, weights (``is_weighted``) too.

    Training: the rows are not parameters. Their gradient goes to the owner ranks in
    backward and the fused sparse optimizer (``SparseOptimConfig``) updates them there,
    so neither the dense optimizer nor DDP sees them. Each training forward uses the
    step index and learning rate given by :meth:`set_step`; without a call since the
    previous training forward, the step index advances by one and the lr is kept (the
    configured one at first), so an unchanged training loop gives every step its own
    index (row-wise Adagrad / Adam bias correction need it). Look-ahead modes
    (``sdd``, ``prioritized``) also take the next step's KJT through :meth:`set_next`
    before the forward (without it a step runs synchronously, with the same result);
    :meth:`flush` applies whatever is deferred (collective: call it on every rank before
    evaluation, checkpoints and the end of training).

    The inner collection is :attr:`sparse` (its ``shard_tables()`` gives this rank's
    rows). Its shard is a buffer (``<name>.sparse.weight`` in ``state_dict``, rank-local)
    that may not be moved or cast afterwards: ``.to()`` / ``.double()`` / ``.cuda()`` on
    a model holding one raise unless they leave it unchanged (choose ``device`` /
    ``dtype`` when sharding).
    """

    def __init__(
        self,
        sparse: nn.Module,
        configs: Sequence[EmbeddingConfig] | None = None,
        *,
        output_dtype: torch.dtype | None = torch.float32,
    ) -> None:
        super().__init__()
        self.sparse = sparse
        self._configs = (
            list(configs) if configs is not None else tables_to_torchrec(sparse.plan.tables)
        )
        self.output_dtype = output_dtype
        self._step = 0
        self._lr: float | None = None
        self._step_given = False
        self._next: KeyedJaggedTensor | None = None

    @classmethod
    def from_torchrec(
        cls,
        ec: Any,
        comm: Communicator,
        optim: SparseOptimConfig,
        *,
        mode: str = "vanilla",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int = 0,
        output_dtype: torch.dtype | None = torch.float32,
        init: str = "module",
        name: str = "<module>",
        **options: Any,
    ) -> FreeScaleEmbeddingCollection:
        """The FreeScale version of TorchRec ``EmbeddingCollection`` ``ec`` (``name``
        for errors), row-wise sharded over ``comm``'s ranks with collection kind ``mode``
        (:func:`~freescale.embedding.prioritized.make_embedding_collection`;
        ``options`` go to it). ``device`` / ``dtype`` default to those of ``ec``'s
        weights (float32 or float64). With ``init="module"`` every rank copies its own
        row range of ``ec``'s current weights (bitwise when the dtype is kept), so every
        rank must hold the same full weights (same seed, or loaded); ``init="freescale"``
        uses FreeScale's initialisation (``N(0, std)`` with TorchRec's init range's std,
        a function of ``seed``), for a module built on the meta device."""
        from ..embedding.prioritized import make_embedding_collection

        ec_cls = _ec_class()
        if not isinstance(ec, ec_cls):
            raise TypeError(
                f"'{name}' is a {type(ec).__name__}, not a TorchRec EmbeddingCollection"
            )
        if init not in _INITS:
            raise ValueError(f"init must be one of {_INITS}, got '{init}'")
        w_dtype, w_device = _check_ec(ec, name, init)
        dtype = w_dtype if dtype is None else dtype
        if dtype not in _FREESCALE_DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if device is None:
            device = w_device if w_device.type != "meta" else torch.device("cpu")
        configs = list(ec.embedding_configs())
        try:
            tables = tables_from_torchrec(configs)
        except (ValueError, TypeError) as e:
            raise NotImplementedError(f"module '{name}': {e}") from e
        sparse = make_embedding_collection(
            mode, tables, comm, optim, device=device, dtype=dtype, seed=seed, **options
        )
        if init == "module":
            with torch.no_grad():
                for tname, (lo, shard) in sparse.shard_tables().items():
                    full = ec.embeddings[tname].weight
                    shard.copy_(full[lo : lo + shard.shape[0]].to(shard.device, shard.dtype))
        return cls(sparse, configs, output_dtype=output_dtype)

    # ------------------------------------------------------- TorchRec's interface
    def forward(self, features: KeyedJaggedTensor) -> dict[str, Any]:
        """``{feature: JaggedTensor}`` for the local batch ``features`` (a KJT)."""
        from torchrec.sparse.jagged_tensor import JaggedTensor

        jts = features.to_dict()
        own = self.sparse.features
        # a feature the KJT lacks is the collection's BadInputError, raised on every rank
        # at the id exchange (a local KeyError here would leave the other ranks waiting)
        feats = {f: (jts[f].values(), jts[f].lengths().to(torch.int64)) for f in own if f in jts}
        training = torch.is_grad_enabled() and self.training
        if training:
            if not self._step_given:  # an unchanged loop: advance the step index
                self._step += 1
                self.sparse.set_step(self._step, self._lr)
            self._step_given = False
        if getattr(self.sparse, "uses_next_features", False):
            nxt = None
            if training and self._next is not None:
                nxt = {f: v for f, v in kjt_to_features(self._next).items() if f in own}
                self._next = None
            emb = self.sparse(feats, next_features=nxt)
        else:
            emb = self.sparse(feats)
        out: dict[str, Any] = {}
        for f in own:
            v = emb[f] if self.output_dtype is None else emb[f].to(self.output_dtype)
            out[f] = JaggedTensor(values=v, lengths=jts[f].lengths())
        return out

    def embedding_configs(self) -> list[EmbeddingConfig]:
        """The TorchRec table configs of the module this one replaced."""
        return list(self._configs)

    def embedding_dim(self) -> int:
        return int(self.sparse.plan.dim)

    def embedding_names_by_table(self) -> list[list[str]]:
        return [list(t.feature_names) for t in self.sparse.plan.tables]

    def need_indices(self) -> bool:
        return False

    # ------------------------------------------------------ training-loop hooks
    @property
    def features(self) -> list[str]:
        return list(self.sparse.features)

    @property
    def stats(self) -> Any:
        """The inner collection's exchange counters and times."""
        return self.sparse.stats

    def set_step(self, step: int, lr: float | None = None) -> None:
        """1-based index and sparse lr (None: the configured one) of the next training
        forward (see the class docstring for the default)."""
        self._step, self._lr, self._step_given = int(step), lr, True
        self.sparse.set_step(step, lr)

    def set_next(self, features: KeyedJaggedTensor | None) -> None:
        """The next training step's KJT, for the look-ahead modes (ignored by
        ``vanilla``): it must be what the next training forward after this one gets."""
        self._next = features

    def prepare_backward(self) -> bool:
        """Optional, between the training forward and ``loss.backward()``: run the part of
        the sparse backward that needs no gradient now (prioritized:
        :meth:`~freescale.embedding.prioritized.PrioritizedEmbeddingCollection.prepare_backward`;
        bitwise the same results either way). Returns whether it ran (False for vanilla
        and sdd, which have no such part)."""
        prepare = getattr(self.sparse, "prepare_backward", None)
        return bool(prepare()) if prepare is not None else False

    def flush(self) -> None:
        """Apply deferred updates and drop look-aheads (collective; a no-op for vanilla)."""
        self._next = None
        flush = getattr(self.sparse, "flush", None)
        if flush is not None:
            flush()


def _parent_and_key(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent_name, _, key = dotted.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), key


def _replace(model: nn.Module, dotted: str, new: nn.Module) -> None:
    parent, key = _parent_and_key(model, dotted)
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and key.isdigit():
        parent[int(key)] = new
    elif isinstance(parent, nn.ModuleDict):
        parent[key] = new
    else:
        setattr(parent, key, new)


def shard_model(
    model: nn.Module,
    comm: Communicator | None,
    optim: SparseOptimConfig,
    *,
    mode: str = "vanilla",
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    output_dtype: torch.dtype | None = torch.float32,
    init: str = "module",
    **options: Any,
) -> list[str]:
    """Swap every TorchRec ``EmbeddingCollection`` of ``model`` for a
    :class:`FreeScaleEmbeddingCollection` in place; returns the dotted names swapped.

    The walk is ``model.named_modules()`` (a module registered under several names is
    swapped once, under all of them; parents may be ``nn.ModuleDict`` / ``ModuleList``).
    Each collection's tables are grouped by (dtype, sharding): FreeScale shards every
    table row-wise (TorchRec's ``block = ceil(rows / W)``), and one collection holds one
    dtype, so a module whose tables need several groups, non-float32/64 tables, a
    feature read by two tables, ``need_indices=True`` or any table option
    :func:`tables_from_torchrec` refuses raises :class:`NotImplementedError` naming the
    module, before anything is swapped. A model with no ``EmbeddingCollection`` raises
    :class:`ValueError`; ``EmbeddingBagCollection`` s (pooled) are left as they are,
    with a warning.

    Every rank calls this with the same model (same seed, or the same loaded weights):
    with ``init="module"`` each rank keeps a bitwise copy of its own rows of each table
    (see :meth:`FreeScaleEmbeddingCollection.from_torchrec` for ``device``, ``dtype``,
    ``seed``, ``init``, ``mode`` and ``options``). ``comm`` carries the embedding
    exchange; ``None`` makes a new process group over the world (or a single-process
    communicator without ``torch.distributed``). The shard buffers are registered with
    DDP as ignored on ``model`` (``DistributedDataParallel(model)`` then neither
    broadcasts nor reduces them; wrap ``model`` itself, not a parent). Create the dense
    optimizer afterwards: the old embedding parameters are gone from ``model``.

    Example: a model written for TorchRec, trained by FreeScale::

        model = MyTorchRecModel()  # holds torchrec.EmbeddingCollection(s)
        names = shard_model(model, None, SparseOptimConfig(kind="rowwise_adagrad", lr=0.05))
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(None, allreduce_sum_hook)  # sparse rows see sums too
        opt = torch.optim.Adam(model.parameters())  # the dense parameters only
        for step, (kjt, labels) in enumerate(local_batches, start=1):
            loss = ddp(kjt, labels) / global_sample_count  # a sum over local samples
            loss.backward()  # embedding rows are updated here, at their owners
            opt.step()
            opt.zero_grad()
        for m in freescale_modules(model).values():
            m.flush()

    Loss scaling: FreeScale sums embedding gradients at the owners (no division by W),
    so the dense side must sum too: the SUM hook above
    (:func:`freescale.pipeline.trainer.allreduce_sum_hook`) with a local loss of
    ``sum / global count``, as ``Trainer`` does.
    """
    ec_cls = _ec_class()
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    if init not in _INITS:
        raise ValueError(f"init must be one of {_INITS}, got '{init}'")
    if isinstance(model, ec_cls):
        raise ValueError(
            "shard_model: the model is itself an EmbeddingCollection and cannot be replaced "
            "in place; use FreeScaleEmbeddingCollection.from_torchrec(ec, comm, optim)"
        )
    names: dict[int, list[str]] = {}
    found: dict[int, Any] = {}
    bags = []
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, ec_cls):
            names.setdefault(id(m), []).append(name)
            found[id(m)] = m
        elif isinstance(m, EmbeddingBagCollection):
            bags.append(name)
    if not found:
        raise ValueError(
            f"shard_model: {type(model).__name__} holds no torchrec EmbeddingCollection "
            f"(found {len(bags)} EmbeddingBagCollection(s); FreeScale shards unpooled "
            "EmbeddingCollections only)"
        )
    if bags:
        import warnings

        warnings.warn(
            f"shard_model: EmbeddingBagCollection(s) {bags} are pooled and stay unsharded "
            "(trained as dense parameters)",
            stacklevel=2,
        )
    for key, ec in found.items():  # everything checked before anything is built
        _check_ec(ec, names[key][0], init)
    if comm is None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            comm = Communicator(dist.new_group(), name="embedding")
        else:
            comm = Communicator(None, name="embedding")
    swapped: list[str] = []
    for key, ec in found.items():
        new = FreeScaleEmbeddingCollection.from_torchrec(
            ec,
            comm,
            optim,
            mode=mode,
            device=device,
            dtype=dtype,
            seed=seed,
            output_dtype=output_dtype,
            init=init,
            name=names[key][0],
            **options,
        )
        for n in names[key]:
            _replace(model, n, new)
            swapped.append(n)
    ddp_ignore_shards(model)
    return swapped


def freescale_modules(model: nn.Module) -> dict[str, FreeScaleEmbeddingCollection]:
    """The :class:`FreeScaleEmbeddingCollection` s of ``model`` by dotted name (each
    once), for ``set_step`` / ``set_next`` / ``flush`` in a training loop."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FreeScaleEmbeddingCollection)}
