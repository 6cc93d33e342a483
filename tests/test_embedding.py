"""Row-wise sharded embeddings: fixed-order reduction, fused optimizers, exchange.

Multi-rank cases run on real gloo ranks from the shared pools (tests/conftest.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from freescale.comm.base import Communicator
from freescale.config import SparseOptimConfig, TableConfig
from freescale.embedding.collection import (
    RowWisePlan,
    ShardedEmbeddingCollection,
    ddp_ignore_shards,
    init_table_rows,
)
from freescale.embedding.optim import FusedSparseOptimizer, row_mean_fixed_order
from freescale.embedding.reduce import group_rows, group_rows_reference, segment_sum


def _seed() -> int:
    s = random.randrange(1 << 30)
    print(f"seed {s}")
    return s


# ----------------------------------------------------------------- reduction
def test_segment_sum_matches_float64_and_is_row_local():
    g = torch.Generator().manual_seed(_seed())
    keys = torch.randint(0, 50, (3000,), generator=g)
    vals = torch.randn(3000, 16, generator=g)
    groups = group_rows(keys)
    out = segment_sum(vals, groups)
    ref = torch.zeros(50, 16, dtype=torch.float64).index_add_(0, keys, vals.double())
    torch.testing.assert_close(out.double(), ref[groups.rows], rtol=1e-5, atol=1e-5)
    # a row's sum depends only on its own gradients (same order): sum a subset of rows
    keep = torch.isin(keys, groups.rows[::3])
    sub = group_rows(keys[keep])
    out_sub = segment_sum(vals[keep], sub)
    assert torch.equal(out_sub, out[::3])


def test_group_rows_equals_its_reference_on_fresh_random_keys():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    cases = [torch.zeros(0, dtype=torch.int64), torch.tensor([5]), torch.full((9,), 3)]
    cases.append(torch.arange(50).flip(0))  # all distinct
    for n, hi in ((1000, 7), (1000, 5000), (4097, 64), (300, 1 << 40)):
        cases.append(torch.randint(0, hi, (n,), generator=g))
    for keys in cases:
        got, ref = group_rows(keys), group_rows_reference(keys)
        for f in ("order", "rows", "starts", "counts"):
            a, b = getattr(got, f), getattr(ref, f)
            assert a.dtype == b.dtype and torch.equal(a, b), (f, keys[:10])
        assert got.max_count == ref.max_count, keys[:10]


def test_segment_sum_empty_and_single():
    e = group_rows(torch.zeros(0, dtype=torch.int64))
    assert segment_sum(torch.zeros(0, 4), e).shape == (0, 4)
    one = group_rows(torch.tensor([7]))
    v = torch.randn(1, 4)
    assert torch.equal(segment_sum(v, one), v)


def test_segment_sum_order_is_fixed_tree():
    # three values where the summation order changes the float32 result
    keys = torch.tensor([1, 1, 1])
    vals = torch.tensor([[1e8], [1.0], [-1e8]], dtype=torch.float32)
    out = segment_sum(vals, group_rows(keys))
    # tree: (v0 + v1) + v2 = (1e8 + 1) - 1e8 = 0 in float32
    assert out.item() == ((vals[0] + vals[1]) + vals[2]).item()


# ----------------------------------------------------------------- optimizers
@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_optimizer_rows_independent_of_call_size(kind):
    g = torch.Generator().manual_seed(_seed())
    w0 = torch.randn(100, 24, generator=g)
    rows = torch.randperm(100, generator=g)[:60]
    grad = torch.randn(60, 24, generator=g)
    cfg = SparseOptimConfig(kind=kind, lr=0.1)
    a = FusedSparseOptimizer(cfg, w0.clone())
    b = FusedSparseOptimizer(cfg, w0.clone())
    for step in (1, 2):
        a.step(rows, grad, step=step)
        b.step(rows[:17], grad[:17], step=step)
        b.step(rows[17:], grad[17:], step=step)
    assert torch.equal(a.weight, b.weight)
    for k in a.state:
        assert torch.equal(a.state[k], b.state[k])


def test_rowwise_adagrad_formula():
    w = torch.tensor([[1.0, 2.0, 3.0]])
    g = torch.tensor([[0.5, -1.0, 2.0]])
    opt = FusedSparseOptimizer(SparseOptimConfig("rowwise_adagrad", lr=0.1, eps=1e-8), w.clone())
    opt.step(torch.tensor([0]), g, step=1)
    s = (g * g).mean()
    expect = w - 0.1 / (s.sqrt() + 1e-8) * g
    torch.testing.assert_close(opt.weight, expect)
    torch.testing.assert_close(opt.state["sum_sq"], s.reshape(1))


def test_row_mean_fixed_order_non_power_of_two():
    x = torch.randn(5, 13, dtype=torch.float64)
    torch.testing.assert_close(row_mean_fixed_order(x), x.mean(1))


# ----------------------------------------------------------------- sharding
def test_row_wise_plan_ranges_match_torchrec_rule():
    t = TableConfig("t", 10, 4, ["f"])
    ranges = [RowWisePlan([t], 4, r).row_range(0) for r in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 9), (9, 10)]
    ranges = [RowWisePlan([t], 8, r).row_range(0) for r in range(8)]
    # block = ceil(10/8) = 2: ranks 5..7 own nothing
    assert ranges[4] == (8, 10) and ranges[5] == (10, 10) and ranges[7] == (10, 10)


def test_plan_rejects_mixed_dims_and_shared_features():
    with pytest.raises(ValueError, match="embedding dim"):
        RowWisePlan([TableConfig("a", 5, 4, ["x"]), TableConfig("b", 5, 8, ["y"])], 1, 0)
    with pytest.raises(ValueError, match="two tables"):
        RowWisePlan([TableConfig("a", 5, 4, ["x"]), TableConfig("b", 5, 4, ["x"])], 1, 0)


def test_init_is_independent_of_sharding():
    t = TableConfig("t", 10_000, 8, ["f"])
    full = init_table_rows(t, 0, 0, 10_000, seed=3, dtype=torch.float32)
    part = init_table_rows(t, 0, 4000, 8500, seed=3, dtype=torch.float32)
    assert torch.equal(full[4000:8500], part)


TABLES = [
    TableConfig("item", 997, 8, ["uih", "cand"]),
    TableConfig("small", 5, 8, ["act"]),
]


def _features(step: int, rank: int, seed: int, empty: bool = False):
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    b = 0 if empty else 6
    lengths = torch.randint(0, 9, (b,), generator=g)
    n = int(lengths.sum())
    # Zipf-ish: many repeats, plus the range borders
    uih = torch.randint(0, 997, (n,), generator=g) % torch.randint(1, 997, (1,), generator=g)
    if n >= 2:
        uih[0], uih[-1] = 0, 996
    act = torch.randint(0, 5, (n,), generator=g)
    cl = torch.full((b,), 3, dtype=torch.int64)
    cand = torch.randint(0, 997, (3 * b,), generator=g)
    return {"uih": (uih, lengths), "cand": (cand, cl), "act": (act, lengths)}


def _full_table(emb: ShardedEmbeddingCollection, name: str) -> torch.Tensor:
    lo, rows = emb.shard_tables()[name]
    return rows.clone(), lo


def _run_exchange(rank, world, kind, seed, steps, empty_rank):
    comm = Communicator(torch.distributed.group.WORLD if world > 1 else None)
    emb = ShardedEmbeddingCollection(TABLES, comm, SparseOptimConfig(kind, lr=0.05), seed=seed)
    full0 = {
        t.name: init_table_rows(t, i, 0, t.num_embeddings, seed, torch.float32)
        for i, t in enumerate(TABLES)
    }
    outs = []
    for step in range(1, steps + 1):
        feats = _features(step, rank, seed, empty=(rank == empty_rank))
        emb.set_step(step)
        out = emb(feats)
        if step == 1:  # forward equals a plain lookup of the initial tables
            for f, tname in (("uih", "item"), ("cand", "item"), ("act", "small")):
                assert torch.equal(out[f], full0[tname][feats[f][0]]), f
        g = torch.Generator().manual_seed(seed + step * 7 + rank)
        loss = sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values())
        loss.backward()
        outs.append({f: o.detach().clone() for f, o in out.items()})
    return {
        "tables": {n: _full_table(emb, n) for n in ("item", "small")},
        "state": {
            n: {k: v.clone() for k, (lo, v) in d.items()}
            for n, d in emb.shard_optimizer_state().items()
        },
        "ids_sent": emb.stats.ids_sent,
        "rows_updated": emb.stats.rows_updated,
    }


def _reference(kind, seed, steps, world, empty_rank):
    """Single-process reference: all ranks' features on one table, float64 sums."""
    tables = {
        t.name: init_table_rows(t, i, 0, t.num_embeddings, seed, torch.float32)
        for i, t in enumerate(TABLES)
    }
    opt = {n: FusedSparseOptimizer(SparseOptimConfig(kind, lr=0.05), tables[n]) for n in tables}
    for step in range(1, steps + 1):
        grads = {n: torch.zeros(tables[n].shape, dtype=torch.float64) for n in tables}
        touched = {n: torch.zeros(tables[n].shape[0], dtype=torch.bool) for n in tables}
        for rank in range(world):
            feats = _features(step, rank, seed, empty=(rank == empty_rank))
            g = torch.Generator().manual_seed(seed + step * 7 + rank)
            for f, tname in (("uih", "item"), ("cand", "item"), ("act", "small")):
                ids = feats[f][0]
                r = torch.randn((ids.numel(), 8), generator=g)
                grads[tname].index_add_(0, ids, r.double())
                touched[tname][ids] = True
        for n in tables:
            rows = touched[n].nonzero().squeeze(1)
            opt[n].step(rows, grads[n][rows].float(), step=step)
    return tables, opt


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_exchange_trains_like_one_table(kind, world, pool2, pool4):
    pool = pool2 if world == 2 else pool4
    seed = _seed()
    steps = 3
    empty_rank = world - 1  # an empty local batch is legal
    res = pool.run(_run_exchange, kind, seed, steps, empty_rank)
    ref_tables, ref_opt = _reference(kind, seed, steps, world, empty_rank)
    for name in ("item", "small"):
        full = torch.cat([r["tables"][name][0] for r in res])
        torch.testing.assert_close(full, ref_tables[name], rtol=2e-5, atol=2e-6)
        for k, v in ref_opt[name].state.items():
            got = torch.cat([r["state"][name][k] for r in res])
            torch.testing.assert_close(got, v, rtol=2e-5, atol=2e-6)
    assert sum(r["ids_sent"] for r in res) > 0
    assert all(r["rows_updated"] >= 0 for r in res)


def test_module_conversions_keep_the_shard_or_refuse():
    """``model.to()`` / ``.cpu()`` / ``.float()`` / ``.share_memory()`` of a model holding a
    collection work when they keep its device and dtype (they called the collection's
    update method with nn.Module's arguments before: a TypeError); ``.double()`` would
    replace the shard behind the fused optimizer, so it raises and changes nothing."""
    tables = [TableConfig("t", 10, 4, ["f"])]
    ec = ShardedEmbeddingCollection(tables, Communicator(), SparseOptimConfig())
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), ec)
    weight, before = ec.weight, ec.weight.clone()
    model.to(torch.float32)
    model.to("cpu")
    model.cpu().float().share_memory()
    assert ec.weight is weight and ec.optimizer.weight is weight
    assert torch.equal(ec.weight, before)
    with pytest.raises(RuntimeError, match=r"\(torch.float32 on cpu\) cannot be converted"):
        model.double()
    assert ec.weight is weight and ec.weight.dtype == torch.float32
    # the update path is unchanged: one step of SGD on the row of id 3
    out = ec({"f": (torch.tensor([3]), torch.tensor([1]))})["f"]
    out.sum().backward()
    assert not torch.equal(ec.weight[3], before[3]) and torch.equal(ec.weight[4], before[4])


def _ddp_job(rank: int, world: int, ignore: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(rank)  # the dense layer differs per rank until DDP syncs it
    ec = ShardedEmbeddingCollection(
        [TableConfig("t", 10, 4, ["f"])], Communicator(), SparseOptimConfig()
    )
    model = torch.nn.ModuleDict({"ec": ec, "alias": ec, "lin": torch.nn.Linear(4, 1)})
    rows = ec.weight.clone()
    listed = ddp_ignore_shards(model) if ignore else []
    DistributedDataParallel(model)
    return {
        "rows_kept": bool(torch.equal(rows, ec.weight)),
        "listed": listed,
        "lin": model["lin"].weight.detach().clone(),
    }


@pytest.mark.parametrize("ignore", [True, False])
def test_ddp_keeps_each_ranks_rows_only_with_ddp_ignore_shards(pool2, ignore):
    """DDP broadcasts rank 0's buffers when it is built: without ``ddp_ignore_shards``
    rank 1's rows become rank 0's (the failure the helper exists for, shown here), with
    it every rank keeps its own rows while the dense layer is still synced."""
    res = pool2.run(_ddp_job, ignore)
    assert torch.equal(res[0]["lin"], res[1]["lin"])  # DDP did sync the dense layer
    if ignore:
        assert all(r["rows_kept"] for r in res)
        assert res[0]["listed"] == ["alias.weight", "ec.weight"]
    else:
        assert res[0]["rows_kept"] and not res[1]["rows_kept"]


def _bad_input_job(rank: int, world: int, case: str | None, bad_rank: int) -> dict:
    from freescale.data.validate import BadInputError

    tables = [TableConfig("item", 13, 4, ["uih", "cand"]), TableConfig("small", 5, 4, ["act"])]
    ec = ShardedEmbeddingCollection(tables, Communicator(), SparseOptimConfig(kind="adam"))

    def feats(step: int) -> dict:
        g = torch.Generator().manual_seed(100 * step + rank)
        out = {}
        for f, rows in (("uih", 13), ("cand", 13), ("act", 5)):
            lengths = torch.randint(0, 4, (3,), generator=g)
            out[f] = (torch.randint(0, rows, (int(lengths.sum()),), generator=g), lengths)
        return out

    message = None
    if case is not None:
        bad = feats(0)
        if rank == bad_rank:
            ids, lengths = bad["uih"]
            lengths = torch.tensor([1, 2, 1])
            if case == "too_large":
                bad["uih"] = (torch.tensor([1, 2, 13, 0]), lengths)
            elif case == "negative":
                bad["uih"] = (torch.tensor([1, -3, 2, 0]), lengths)
            elif case == "float":
                bad["uih"] = (torch.tensor([1.0, 2.0, 3.0, 0.0]), lengths)
            elif case == "missing":
                del bad["act"]
        ec.set_step(1, None)
        try:
            ec(bad)
        except BadInputError as e:
            message = str(e)
    ec.set_step(1, None)  # a good step afterwards trains as if the bad one never came
    out = ec(feats(1))
    sum((v * (i + 1)).sum() for i, v in enumerate(out.values())).backward()
    return {"message": message, "weight": ec.weight.clone()}


@pytest.mark.parametrize(
    "case,world,what",
    [
        ("too_large", 2, "feature 'uih', sample 1: id 13 out of range [0, 13)"),
        ("negative", 4, "feature 'uih', sample 1: id -3 out of range [0, 13)"),
        ("float", 2, "feature 'uih': ids have dtype torch.float32"),
        ("missing", 4, "feature 'act' missing"),
    ],
)
def test_bad_ids_on_one_rank_raise_on_every_rank_before_any_exchange(
    pool2, pool4, case, world, what
):
    """Bad input on one rank (ids out of range, negative or not integers; a feature
    missing) is found before the id exchange and agreed on with the counts: every rank
    raises BadInputError at once (no rank waits in a collective; it used to be an
    IndexError on one rank and a timeout on the others), the bad rank names the feature,
    sample and id, and nothing is applied: a good step afterwards ends with the tables
    of a run without the bad step."""
    pool = pool2 if world == 2 else pool4
    bad_rank = world - 1
    res = pool.run(_bad_input_job, case, bad_rank)
    ref = pool.run(_bad_input_job, None, bad_rank)
    for r, (got, want) in enumerate(zip(res, ref)):
        msg = got["message"]
        assert msg is not None and msg.startswith(f"rank {r}: "), msg
        if r == bad_rank:
            assert what in msg and "nothing was exchanged" in msg, msg
        else:
            assert f"the input of rank(s) [{bad_rank}] is bad" in msg, msg
        assert torch.equal(got["weight"], want["weight"]), r


def _bad_next_job(rank: int, world: int, mode: str, case: str) -> list[str]:
    from freescale.data.validate import BadInputError
    from freescale.embedding.prioritized import make_embedding_collection

    tables = [TableConfig("t", 10, 4, ["f"]), TableConfig("u", 5, 4, ["g"])]
    ec = make_embedding_collection(mode, tables, Communicator(), SparseOptimConfig())
    good = {
        "f": (torch.tensor([1, 2, 3]), torch.tensor([3])),
        "g": (torch.tensor([0]), torch.tensor([1])),
    }
    bad = dict(good)
    if rank == world - 1:
        if case == "out_of_range":
            bad["f"] = (torch.tensor([1, 12]), torch.tensor([2]))
        else:
            del bad["g"]
    out = []
    ec.set_step(1, None)
    try:
        if case == "missing_now":  # the first step: no look-ahead yet
            ec(bad, next_features=good)
        else:
            ec(good, next_features=bad)
        out.append("no error")
    except BadInputError as e:
        out.append(str(e))
    ec.flush()  # abandon the step, on every rank
    for step, nxt in ((2, good), (3, None)):
        ec.set_step(step, None)
        ec(good, next_features=nxt)["f"].sum().backward()
    ec.flush()
    out.append("trained on")
    return out


@pytest.mark.parametrize("case", ["out_of_range", "missing_next", "missing_now"])
@pytest.mark.parametrize("mode", ["sdd", "prioritized"])
def test_bad_next_features_raise_on_every_rank_and_flush_recovers(pool2, mode, case):
    """The look-ahead schedules exchange step t+1's ids during step t: an id out of range
    or a feature missing there on one rank (or missing from the first step, which has no
    look-ahead) makes every rank raise in the same forward (the count exchange of the id
    dist carries the flag; it used to be a local KeyError), and after ``flush()``
    training goes on."""
    res = pool2.run(_bad_next_job, mode, case)
    assert res[0][0].startswith("rank 0: the input of rank(s) [1] is bad"), res
    what = "id 12 out of range" if case == "out_of_range" else "feature 'g' missing"
    assert res[1][0].startswith("rank 1: feature ") and what in res[1][0], res
    assert all(r[1] == "trained on" for r in res), res
