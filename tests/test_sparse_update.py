"""The sparse updates that do not wait on CUDA — ``ahead`` (``group_rows_start`` when the
ids arrive, finished in the update; the CUDA default) and ``padded``
(``group_rows_padded``) — against the one that reads the row count back
(``group_rows``): same groups, and bit-identical weights and optimizer state after
several steps of random updates; deliberately wrong versions (padding slots not filled,
another step's grouping) are caught.

The Triton per-row sum on padded groups is compared in tests/test_kernels.py (it needs
``TRITON_INTERPRET=1`` before triton is imported).
"""

from __future__ import annotations

import random

import pytest
import torch

from freescale.comm.base import Communicator
from freescale.config import SparseOptimConfig, TableConfig, TrainConfig
from freescale.embedding.collection import (
    SPARSE_UPDATE_ENV_VAR,
    DeviceTally,
    ExchangeStats,
    ShardedEmbeddingCollection,
)
from freescale.embedding.reduce import (
    group_rows,
    group_rows_padded,
    group_rows_reference,
    group_rows_start,
    segment_sum,
)


def _gen() -> torch.Generator:
    s = random.randrange(1 << 30)
    print(f"seed {s}")
    return torch.Generator().manual_seed(s)


def _key_cases(g: torch.Generator) -> list[torch.Tensor]:
    cases = [torch.tensor([5]), torch.full((9,), 3), torch.arange(50).flip(0)]
    for n, hi in ((1000, 7), (1000, 5000), (4097, 64), (300, 1 << 40), (2, 2)):
        cases.append(torch.randint(0, hi, (n,), generator=g))
    return cases


def test_group_rows_padded_equals_group_rows_on_real_slots():
    g = _gen()
    e = group_rows_padded(torch.zeros(0, dtype=torch.int64))
    assert e.groups.rows.numel() == 0 and int(e.num_rows) == 0
    for keys in _key_cases(g):
        ref, pg = group_rows(keys), group_rows_padded(keys)
        n, u = keys.numel(), int(pg.num_rows)
        assert u == ref.rows.numel()
        assert torch.equal(pg.groups.order, ref.order)
        for f in ("rows", "starts", "counts"):
            got = getattr(pg.groups, f)
            assert got.shape == (n,) and torch.equal(got[:u], getattr(ref, f)), f
        # padding: empty segments whose start / row stay in range, fill -> last real row
        assert torch.all(pg.groups.counts[u:] == 0)
        assert torch.all((pg.groups.starts >= 0) & (pg.groups.starts < n))
        assert torch.equal(pg.fill, torch.clamp(torch.arange(n), max=u - 1))
        assert pg.groups.max_count >= ref.max_count


def test_group_rows_started_ahead_equals_group_rows():
    g = _gen()
    e = group_rows_start(torch.zeros(0, dtype=torch.int64)).finish()
    assert e.rows.numel() == 0 and e.max_count == 0
    for keys in _key_cases(g):
        pending = group_rows_start(keys)
        assert pending.n == keys.numel()
        got, ref = pending.finish(), group_rows_reference(keys)
        assert pending.finish() is got  # computed once
        for f in ("order", "rows", "starts", "counts", "max_count"):
            a, b = getattr(got, f), getattr(ref, f)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, f


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_ahead_update_is_bitwise_the_synchronous_one(kind, monkeypatch):
    g = _gen()
    seed = int(torch.randint(1 << 20, (1,), generator=g))
    sync, ahead = _collection(kind, seed), _collection(kind, seed)
    sync.sparse_update, ahead.sparse_update = "sync", "ahead"
    rows = sync.weight.shape[0]
    upd = _updates(g, rows, 6)
    pending = [group_rows_start(k) for k, _ in upd]  # all started before any update
    for step, ((keys, grads), p) in enumerate(zip(upd, pending), start=1):
        n_sync = sync.apply_gradients(keys, grads, step, None)
        assert ahead.apply_gradients(keys, grads, step, None, groups=p) == n_sync
    assert torch.equal(sync.weight, ahead.weight)
    for k in sync.optimizer.state:
        assert torch.equal(sync.optimizer.state[k], ahead.optimizer.state[k]), k
    assert ahead.stats.rows_grouped_ahead == ahead.stats.rows_updated == sync.stats.rows_updated
    assert sync.stats.rows_grouped_ahead == 0


def test_ahead_update_with_another_steps_grouping_is_caught():
    """Mutation: the grouping of other ids of the same count (another step's) is used;
    the comparison above sees it. A count mismatch is refused outright."""
    g = _gen()
    sync, bad = _collection("adam", 5), _collection("adam", 5)
    bad.sparse_update = "ahead"
    keys = torch.randint(0, 300, (64,), generator=g)
    other = torch.randint(0, 300, (64,), generator=g)
    grads = torch.randn(64, 8, generator=g)
    sync.apply_gradients(keys, grads, 1, None)
    bad.apply_gradients(keys, grads, 1, None, groups=group_rows_start(other))
    assert not torch.equal(sync.weight, bad.weight)
    with pytest.raises(ValueError, match="covers 63 ids"):
        bad.apply_gradients(keys, grads, 2, None, groups=group_rows_start(other[:-1]))


def test_segment_sum_on_padded_groups_equals_unpadded():
    g = _gen()
    for keys in _key_cases(g):
        vals = torch.randn(keys.numel(), 6, generator=g) * 1e3
        ref = segment_sum(vals, group_rows(keys), backend="reference")
        pg = group_rows_padded(keys)
        got = segment_sum(vals, pg.groups, backend="reference")
        assert torch.equal(got[: int(pg.num_rows)], ref)


def _collection(kind: str, seed: int) -> ShardedEmbeddingCollection:
    tables = [TableConfig("item", 300, 8, ["a", "b"]), TableConfig("small", 4, 8, ["c"])]
    cfg = SparseOptimConfig(kind=kind, lr=0.05, weight_decay=0.01 if kind == "sgd" else 0.0)
    return ShardedEmbeddingCollection(tables, Communicator(None, name="t"), cfg, seed=seed)


def _updates(g: torch.Generator, rows: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for _ in range(steps):
        n = int(torch.randint(0, 900, (1,), generator=g))
        hot = torch.randint(0, 4, (n,), generator=g)  # long segments (the 4-row table)
        cold = torch.randint(0, rows, (n,), generator=g)
        keys = torch.where(torch.rand(n, generator=g) < 0.3, hot, cold)
        out.append((keys, torch.randn(n, 8, generator=g)))
    return out


@pytest.mark.parametrize("kind", ["sgd", "rowwise_adagrad", "adam"])
def test_padded_update_is_bitwise_the_synchronous_one(kind, monkeypatch):
    g = _gen()
    seed = int(torch.randint(1 << 20, (1,), generator=g))
    sync, padded = _collection(kind, seed), _collection(kind, seed)
    rows = sync.weight.shape[0]
    for step, (keys, grads) in enumerate(_updates(g, rows, 6), start=1):
        monkeypatch.setenv(SPARSE_UPDATE_ENV_VAR, "sync")
        n_sync = sync.apply_gradients(keys, grads, step, None)
        monkeypatch.setenv(SPARSE_UPDATE_ENV_VAR, "padded")
        n_pad = padded.apply_gradients(keys, grads, step, None)
        assert int(n_pad) == n_sync
    assert torch.equal(sync.weight, padded.weight)
    for k in sync.optimizer.state:
        assert torch.equal(sync.optimizer.state[k], padded.optimizer.state[k]), k
    padded.tally.settle()
    assert padded.stats.rows_updated == sync.stats.rows_updated > 0


def test_padded_update_without_fill_is_caught():
    """Mutation: padding slots keep their own (meaningless) sums instead of repeating
    the last real row; they write the last row again with other values, and the
    comparison above sees it."""
    g = _gen()
    sync, bad = _collection("rowwise_adagrad", 3), _collection("rowwise_adagrad", 3)
    keys = torch.tensor([7, 7, 7, 2, 9, 2, 7, 9])  # 3 rows in 8 slots: 5 padding slots
    grads = torch.randn(8, 8, generator=g)
    sync.apply_gradients(keys, grads, 1, None)
    pg = group_rows_padded(keys)
    summed = segment_sum(grads, pg.groups)  # no index_select(fill): the mutation
    bad.optimizer.step(pg.groups.rows, summed, step=1)
    assert not torch.equal(sync.weight, bad.weight)


def test_sparse_update_mode_is_checked(monkeypatch):
    emb = _collection("sgd", 0)
    monkeypatch.setenv(SPARSE_UPDATE_ENV_VAR, "fast")
    with pytest.raises(ValueError, match="FREESCALE_SPARSE_UPDATE"):
        emb.apply_gradients(torch.tensor([1]), torch.ones(1, 8), 1, None)
    emb.sparse_update = "padded"  # the config's choice wins over the environment
    assert isinstance(
        emb.apply_gradients(torch.tensor([1]), torch.ones(1, 8), 1, None), torch.Tensor
    )
    emb.sparse_update = "fast"
    with pytest.raises(ValueError, match="sparse_update"):
        emb.apply_gradients(torch.tensor([1]), torch.ones(1, 8), 1, None)
    with pytest.raises(ValueError, match="sparse_update"):
        TrainConfig(sparse_update="fast")  # type: ignore[arg-type]


def test_device_tally_counts_host_values_at_once():
    st = ExchangeStats()
    t = DeviceTally()
    t.add(st, "rows_updated", 3)
    t.add(st, "rows_updated", torch.tensor([4]))
    assert st.rows_updated == 7
    t.settle()
    assert st.rows_updated == 7


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned copy path needs CUDA")
def test_device_tally_settles_cuda_values():
    st = ExchangeStats()
    t = DeviceTally()
    for i in range(5):
        t.add(st, "rows_updated", torch.tensor([i], device="cuda"))
    t.settle()
    assert st.rows_updated == 10
