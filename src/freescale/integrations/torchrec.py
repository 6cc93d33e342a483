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
  placement with FreeScale's ``RowWisePlan`` (both: ``block = ceil(rows / W)``).

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

from ..config import CANDIDATE_FEATURE, SparseOptimConfig, TableConfig
from ..data.batch import JaggedBatch

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
