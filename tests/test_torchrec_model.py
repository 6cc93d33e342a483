"""A model written for TorchRec trains under FreeScale unchanged (issue 7).

``UserModel`` is plain TorchRec + torch: an ``EmbeddingCollection`` with two tables
(``item``: 97 rows read by features ``hist`` and ``cand``; ``actions``: 5 rows read by
``act``), mean pooling of the jagged sequences, a small MLP and a summed BCE loss. It
knows nothing about FreeScale.

Reference: the unchanged model, one process, the whole global batch per step, plain
``torch.optim.SGD`` on *all* parameters (the tables are ordinary dense parameters of
TorchRec's unsharded module), in float64 (``model.double()``).

FreeScale: on 2 and 4 gloo ranks every rank builds the same model, calls
``shard_model`` (SGD with the same lr), wraps the model in DDP with a SUM hook, and
trains on its contiguous slice of each global batch (uneven at W=4) with the local loss
``sum / global sample count``.

Tolerance (DESIGN.md section 1, tier 2): 1e-12 relative in float64, as max |a - b| /
max |b| per tensor. One detail keeps this float64 only in part, on both sides alike:
TorchRec's ``EmbeddingCollection.forward`` casts its lookups with ``.float()``, so the
embeddings the dense part sees are float32 roundings of the float64 rows and the
gradients reaching the rows are float32 values (the cast's backward). FreeScale's module
does the same cast (``output_dtype=torch.float32``, TorchRec's interface). What remains
is summation order (per-row gradient sums, dense gradient sums over ranks), at the level
of float64 rounding. Measured (printed by the test), at W = 2 and W = 4 alike: tables and
per-step losses bitwise equal (a row's gradients are float32 values, whose float64 sums
are exact here in any order; both SGD updates round once), dense parameters within
1.4e-16 relative (dense gradients summed over ranks instead of in one GEMM).

Mutations the same comparison catches: shards initialised by FreeScale instead of from
the module's weights (``init="freescale"``), and the sparse lr off by a factor
``1 + 1e-9``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("fbgemm_gpu", reason="TorchRec interop needs fbgemm-gpu-cpu")
torchrec = pytest.importorskip("torchrec", reason="TorchRec interop needs torchrec")

from torchrec.modules.embedding_modules import EmbeddingCollection  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

STEPS = 10
GLOBAL_BATCH = 18  # uneven slices at W = 4
LR = 0.3
SEED = 7  # model init
DATA_SEED = 123
NUM_ITEMS, NUM_ACTIONS, DIM = 97, 5, 8
TOL = 1e-12


# ------------------------------------------------------------- the user's model


class UserModel(nn.Module):
    """Written for TorchRec: a KJT with ``hist``, ``act`` (one action per history
    event) and ``cand`` (one candidate), and a label per sample."""

    def __init__(self, need_indices: bool = False, act_dtype: Any = None) -> None:
        super().__init__()
        act_kw = {} if act_dtype is None else {"data_type": act_dtype}
        self.ec = EmbeddingCollection(
            tables=[
                torchrec.EmbeddingConfig(
                    name="item",
                    num_embeddings=NUM_ITEMS,
                    embedding_dim=DIM,
                    feature_names=["hist", "cand"],
                ),
                torchrec.EmbeddingConfig(
                    name="actions",
                    num_embeddings=NUM_ACTIONS,
                    embedding_dim=DIM,
                    feature_names=["act"],
                    **act_kw,
                ),
            ],
            need_indices=need_indices,
        )
        self.mlp = nn.Sequential(nn.Linear(3 * DIM, 16), nn.Tanh(), nn.Linear(16, 1))

    @staticmethod
    def _mean(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = lengths.to(torch.int64)
        seg = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        out = torch.zeros(lengths.numel(), values.shape[1], dtype=values.dtype)
        out = out.index_add(0, seg, values)
        return out / lengths.clamp_min(1).to(values.dtype).unsqueeze(1)

    def forward(self, kjt: KeyedJaggedTensor, labels: torch.Tensor) -> torch.Tensor:
        emb = self.ec(kjt)
        dtype = self.mlp[0].weight.dtype  # TorchRec's lookups are float32
        x = torch.cat(
            [
                self._mean(emb["hist"].values().to(dtype), emb["hist"].lengths()),
                self._mean(emb["act"].values().to(dtype), emb["act"].lengths()),
                emb["cand"].values().to(dtype),
            ],
            dim=1,
        )
        logits = self.mlp(x).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum")


# ------------------------------------------------------------------------ data


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s global batch: a function of (DATA_SEED, step) only."""
    g = torch.Generator().manual_seed(DATA_SEED * 1000 + step)
    lengths = torch.randint(0, 7, (GLOBAL_BATCH,), generator=g)
    n = int(lengths.sum())
    # skewed ids: rows collide inside a step and between steps
    hist = (torch.rand(n, generator=g) ** 2 * NUM_ITEMS).long()
    act = torch.randint(0, NUM_ACTIONS, (n,), generator=g)
    cand = (torch.rand(GLOBAL_BATCH, generator=g) ** 2 * NUM_ITEMS).long()
    labels = (torch.rand(GLOBAL_BATCH, generator=g) < 0.4).double()
    return {"lengths": lengths, "hist": hist, "act": act, "cand": cand, "labels": labels}


def kjt_of(step: int, samples: torch.Tensor) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """The KJT (keys in an order unlike the tables') and labels of ``samples``."""
    b = global_batch(step)
    offsets = torch.cumsum(b["lengths"], 0) - b["lengths"]
    pos = [torch.arange(int(offsets[i]), int(offsets[i] + b["lengths"][i])) for i in samples]
    pos_t = torch.cat(pos) if pos else torch.empty(0, dtype=torch.int64)
    lengths = b["lengths"][samples].to(torch.int32)
    kjt = KeyedJaggedTensor(
        keys=["act", "hist", "cand"],
        values=torch.cat([b["act"][pos_t], b["hist"][pos_t], b["cand"][samples]]),
        lengths=torch.cat([lengths, lengths, torch.ones(len(samples), dtype=torch.int32)]),
    )
    return kjt, b["labels"][samples]


def local_samples(rank: int, world: int) -> torch.Tensor:
    return torch.tensor_split(torch.arange(GLOBAL_BATCH), world)[rank]


# ------------------------------------------------------------------- reference

_REF: dict[str, Any] = {}


def reference() -> dict[str, Any]:
    if not _REF:
        torch.manual_seed(SEED)
        model = UserModel().double()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        losses = []
        for t in range(1, STEPS + 1):
            kjt, labels = kjt_of(t, torch.arange(GLOBAL_BATCH))
            loss = model(kjt, labels) / GLOBAL_BATCH
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        sd = model.state_dict()
        _REF.update(
            losses=losses,
            tables={n: sd[f"ec.embeddings.{n}.weight"].clone() for n in ("item", "actions")},
            dense={k: v.clone() for k, v in sd.items() if k.startswith("mlp.")},
        )
    return _REF


# --------------------------------------------------------------------- workers


def train_freescale(
    rank: int,
    world: int,
    init: str = "module",
    lr_scale: float = 1.0,
    mode: str = "vanilla",
    prepare: bool = False,
) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig
    from freescale.integrations.torchrec import (
        FreeScaleEmbeddingCollection,
        gather_row_shards,
        shard_model,
    )
    from freescale.pipeline.trainer import allreduce_sum_hook

    torch.manual_seed(SEED)
    model = UserModel().double()
    initial = {n: e.weight.detach().clone() for n, e in model.ec.embeddings.items()}
    comm = Communicator(dist.new_group(), name="embedding")
    swapped = shard_model(
        model, comm, SparseOptimConfig(kind="sgd", lr=LR * lr_scale), mode=mode, init=init
    )
    fs = model.ec
    assert isinstance(fs, FreeScaleEmbeddingCollection)
    shard_rows = {n: int(v.shape[0]) for n, (_, v) in fs.sparse.shard_tables().items()}
    # bitwise copies of this rank's rows of the module's weights
    copied = all(
        torch.equal(v, initial[n][lo : lo + v.shape[0]])
        for n, (lo, v) in fs.sparse.shard_tables().items()
    )
    ddp = DDP(model)
    ddp.register_comm_hook(None, allreduce_sum_hook)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    mine = local_samples(rank, world)
    losses = []
    for t in range(1, STEPS + 1):
        kjt, labels = kjt_of(t, mine)
        if t < STEPS:
            fs.set_next(kjt_of(t + 1, mine)[0])  # look-ahead modes; vanilla ignores it
        loss_sum = ddp(kjt, labels)
        if prepare:  # optional: the sparse backward's gradient-free part, early
            fs.prepare_backward()
        (loss_sum / GLOBAL_BATCH).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tot = loss_sum.detach().reshape(1).clone()
        dist.all_reduce(tot)
        losses.append(float(tot) / GLOBAL_BATCH)
    fs.flush()
    rows = {"item": NUM_ITEMS, "actions": NUM_ACTIONS}
    tables = gather_row_shards({n: [v] for n, v in fs.sparse.shard_tables().items()}, rows)
    out = {
        "swapped": swapped,
        "type": type(model.ec).__name__,
        "params": sorted(n for n, _ in model.named_parameters()),
        "shard_rows": shard_rows,
        "copied": copied,
        "lookahead": {
            k: v
            for st in (getattr(fs.sparse, "sdd_stats", None), getattr(fs.sparse, "pstats", None))
            if st is not None
            for k, v in st.__dict__.items()
            if k in ("lookaheads", "ahead_steps", "prioritized_steps", "prepared_steps")
        },
    }
    if rank == 0:
        out.update(
            losses=losses,
            tables=tables,
            dense={k: v.clone() for k, v in model.state_dict().items() if k.startswith("mlp.")},
        )
    return out


# --------------------------------------------------------------------- compare


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def deviations(res: dict[str, Any]) -> dict[str, float]:
    ref = reference()
    out = {"loss": _rel(torch.tensor(res["losses"]), torch.tensor(ref["losses"]))}
    for n, t in ref["tables"].items():
        out[f"table.{n}"] = _rel(res["tables"][n], t)
    for k, v in ref["dense"].items():
        out[f"dense.{k}"] = _rel(res["dense"][k], v)
    return out


_RUNS: dict[tuple, list[dict[str, Any]]] = {}


def _run(pool, **kw: Any) -> list[dict[str, Any]]:
    key = (pool.world_size, tuple(sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = pool.run(train_freescale, **kw)
    return _RUNS[key]


# ----------------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
def test_torchrec_model_trains_like_the_reference(world: int, pool2, pool4) -> None:
    res = _run(pool2 if world == 2 else pool4)
    for r, out in enumerate(res):
        # the swap happened, the tables are really sharded, each rank copied its rows
        assert out["swapped"] == ["ec"], out["swapped"]
        assert out["type"] == "FreeScaleEmbeddingCollection"
        assert out["params"] == ["mlp.0.bias", "mlp.0.weight", "mlp.2.bias", "mlp.2.weight"]
        assert out["shard_rows"]["item"] < NUM_ITEMS, (r, out["shard_rows"])
        assert out["shard_rows"]["actions"] < NUM_ACTIONS, (r, out["shard_rows"])
        assert out["copied"], f"rank {r}: shard rows are not a bitwise copy of the module's"
    assert sum(o["shard_rows"]["item"] for o in res) == NUM_ITEMS
    dev = deviations(res[0])
    print(
        f"\n[W={world}] max relative deviation from the reference: "
        + ", ".join(f"{k} {v:.1e}" for k, v in dev.items())
    )
    # the tables really trained (so the comparison means something)
    ref = reference()
    torch.manual_seed(SEED)
    start = UserModel().double().ec.embeddings
    for n, t in ref["tables"].items():
        assert _rel(start[n].weight.detach(), t) > 1e-3, n
    bad = {k: v for k, v in dev.items() if not v <= TOL}
    assert not bad, f"W={world}: beyond {TOL} relative: {bad}"


@pytest.mark.parametrize(
    "mode, prepare", [("sdd", False), ("prioritized", False), ("prioritized", True)]
)
def test_lookahead_modes_equal_vanilla_bitwise(pool2, mode: str, prepare: bool) -> None:
    """Tier 1 through shard_model: the look-ahead schedules (fed by set_next) change
    nothing; nor does calling ``prepare_backward()`` before ``loss.backward()``."""
    van = _run(pool2)[0]
    pri = _run(pool2, mode=mode, prepare=prepare)[0]
    ahead = pri["lookahead"]
    print(f"\n[{mode}, prepare={prepare}] {ahead}")
    assert ahead["lookaheads"] == STEPS - 1, ahead  # set_next reached the collection
    assert ahead.get("ahead_steps", ahead.get("prioritized_steps", 0)) > 0, ahead
    if mode == "prioritized":  # every step prepared early on CPU, none without the call
        assert ahead["prepared_steps"] == (STEPS if prepare else 0), ahead
    assert pri["type"] == "FreeScaleEmbeddingCollection"
    for n, t in van["tables"].items():
        assert torch.equal(pri["tables"][n], t), n
    for k, v in van["dense"].items():
        assert torch.equal(pri["dense"][k], v), k
    assert pri["losses"] == van["losses"]


@pytest.mark.parametrize(
    ("kw", "what"),
    [({"init": "freescale"}, "table."), ({"lr_scale": 1.0 + 1e-9}, "table.")],
    ids=["shards_not_loaded_from_module", "sparse_lr_off_by_1e-9"],
)
def test_comparison_catches_mutations(pool2, kw: dict, what: str) -> None:
    res = _run(pool2, **kw)
    if "init" in kw:  # the mutation really skipped the copy
        assert not any(o["copied"] for o in res)
    dev = deviations(res[0])
    print(f"\n[{kw}] " + ", ".join(f"{k} {v:.1e}" for k, v in dev.items()))
    assert any(k.startswith(what) and v > TOL for k, v in dev.items()), dev


# ---------------------------------------------------------- single process


def _single(model: nn.Module, **kw: Any) -> list[str]:
    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig
    from freescale.integrations.torchrec import shard_model

    return shard_model(model, Communicator(None), SparseOptimConfig(kind="sgd", lr=LR), **kw)


def test_containers_aliases_and_lookups_single_process() -> None:
    """ECs inside ModuleDict / ModuleList (one registered twice) are all swapped; the
    lookups are TorchRec's bit for bit; DDP is told to ignore the shards."""
    from freescale.integrations.torchrec import FreeScaleEmbeddingCollection, freescale_modules

    torch.manual_seed(0)
    shared = UserModel().ec
    m = nn.Module()
    m.towers = nn.ModuleDict({"a": UserModel().ec})
    m.stack = nn.ModuleList([nn.Linear(2, 2), shared])
    m.alias = shared
    refs = {"towers.a": m.towers["a"], "stack.1": shared}
    kjt, _ = kjt_of(1, torch.arange(GLOBAL_BATCH))
    expect = {n: {k: jt.values().clone() for k, jt in ec(kjt).items()} for n, ec in refs.items()}
    assert _single(m) == ["towers.a", "stack.1", "alias"]
    assert isinstance(m.towers["a"], FreeScaleEmbeddingCollection)
    assert m.stack[1] is m.alias and isinstance(m.alias, FreeScaleEmbeddingCollection)
    assert sorted(freescale_modules(m)) == ["stack.1", "towers.a"]
    assert m._ddp_params_and_buffers_to_ignore == [
        "alias.sparse.weight",
        "stack.1.sparse.weight",
        "towers.a.sparse.weight",
    ]
    for n, ref in expect.items():
        out = m.get_submodule(n)(kjt)
        assert list(out) == ["hist", "cand", "act"]  # TorchRec's order: tables, features
        for k, v in ref.items():
            assert out[k].values().dtype == torch.float32
            assert torch.equal(out[k].values(), v), (n, k)
            assert torch.equal(out[k].lengths(), kjt[k].lengths())
    assert m.towers["a"].embedding_configs()[0].name == "item"
    m.to(torch.float32)  # no change: allowed
    with pytest.raises(RuntimeError, match="cannot be converted"):
        m.double()


def test_shard_model_errors() -> None:
    with pytest.raises(ValueError, match="Sequential holds no torchrec EmbeddingCollection"):
        _single(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="itself an EmbeddingCollection"):
        _single(UserModel().ec)
    with pytest.raises(NotImplementedError, match=r"module 'ec'.*need_indices=True"):
        _single(UserModel(need_indices=True))
    mixed = UserModel(act_dtype=torchrec.DataType.FP16)
    with pytest.raises(NotImplementedError, match=r"module 'ec'.*2 dtype groups.*\['actions'\]"):
        _single(mixed)
    assert isinstance(mixed.ec, EmbeddingCollection)  # nothing swapped
    half = UserModel().half()
    with pytest.raises(NotImplementedError, match=r"module 'ec'.*\['item', 'actions'\].*float16"):
        _single(half)
    shared = UserModel()
    shared.ec = EmbeddingCollection(
        tables=[
            torchrec.EmbeddingConfig(
                name=n, num_embeddings=4, embedding_dim=DIM, feature_names=["x"]
            )
            for n in ("t1", "t2")
        ]
    )
    with pytest.raises(NotImplementedError, match=r"module 'ec'.*\['x'\] feed several tables"):
        _single(shared)
    with pytest.raises(ValueError, match="init must be"):
        _single(UserModel(), init="zeros")


def test_step_index_advances_without_set_step() -> None:
    """An unchanged loop gives every training forward its own step index; set_step
    overrides it (and its lr is kept for the following steps); eval does not count."""
    m = UserModel()
    _single(m)
    fs = m.ec
    kjt, labels = kjt_of(1, torch.arange(4))
    steps = []
    for call in ("train", "train", "set", "train", "eval", "train"):
        if call == "set":
            fs.set_step(10, lr=0.01)
            continue
        if call == "eval":
            with torch.no_grad():
                m(kjt, labels)
            continue
        m(kjt, labels).backward()
        steps.append((fs.sparse._step, fs.sparse._lr))
    assert steps == [(1, None), (2, None), (10, 0.01), (11, 0.01)]


def _bad_kjt_job(rank: int, world: int, case: str) -> str:
    import torch.distributed as dist

    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig
    from freescale.data.validate import BadInputError
    from freescale.integrations.torchrec import shard_model

    torch.manual_seed(SEED)
    model = UserModel().double()
    comm = Communicator(dist.new_group(), name="embedding")
    shard_model(model, comm, SparseOptimConfig(kind="sgd", lr=LR))
    kjt, labels = kjt_of(0, local_samples(rank, world))
    if rank == world - 1:
        d = kjt.to_dict()
        if case == "missing":
            del d["act"]
        else:  # an id past the item table
            hist = d["hist"].values().clone()
            hist[0] = NUM_ITEMS
            d["hist"] = torchrec.JaggedTensor(values=hist, lengths=d["hist"].lengths())
        kjt = KeyedJaggedTensor.from_jt_dict(d)
    try:
        model(kjt, labels)
    except BadInputError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", ["missing", "out_of_range"])
def test_bad_kjt_on_one_rank_raises_on_every_rank(pool2, case: str) -> None:
    """A KJT that lacks a feature, or holds an id past its table, on one rank only: both
    ranks raise BadInputError at the id exchange (the wrapper's own KeyError used to
    leave the other rank waiting in the collective)."""
    res = pool2.run(_bad_kjt_job, case)
    assert res[0].startswith("rank 0: the input of rank(s) [1] is bad"), res
    what = "feature 'act' missing" if case == "missing" else f"id {NUM_ITEMS} out of range"
    assert res[1].startswith("rank 1: ") and what in res[1], res
