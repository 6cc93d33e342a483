"""Id-dist split sizes counted on the host one step ahead (``TrainConfig.host_counts``;
DESIGN.md section 3: no device read-back of split sizes on the critical path). On 2
gloo ranks every schedule trains bit for bit as with device counts, the host counts
were really used (counter), host counts equal the device dispatch's counts on fresh
random ids, and a wrong count is not silently absorbed (mutation)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from freescale.config import SparseOptimConfig, TableConfig
from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.kernels import ranged_dispatch
from freescale.pipeline.trainer import Trainer
from freescale.testing import RankFailure
from test_bench_e2e import e2e_config
from test_overlap_backend import _equal


def _run(rank, world, cfg, corrupt=False):
    tr = Trainer(cfg)
    if corrupt:  # mutation: rank 0 registers counts off by one id
        orig = tr.sparse.register_counts

        def bad(features, counts):
            sent, recv = counts
            if tr.rank == 0 and int(sent[1, 0]) > 0:
                sent = sent.clone()
                sent[0, 0] += 1
                sent[1, 0] -= 1
            orig(features, (sent, recv))

        tr.sparse.register_counts = bad
    summary = tr.train()
    from test_trainer import _state

    return _state(tr), summary, tr.sparse.stats.host_counts_used


@pytest.mark.parametrize("mode", ["vanilla", "sdd", "prioritized"])
def test_host_counts_change_nothing(pool2, mode):
    base = dataclasses.replace(e2e_config(), eval_every=4, mode=mode, profile_steps=0)
    dev = pool2.run(_run, dataclasses.replace(base, host_counts=False))
    host = pool2.run(_run, dataclasses.replace(base, host_counts=True))
    assert _equal(host, dev)
    assert host[0][1]["eval_ne"] == dev[0][1]["eval_ne"]
    assert dev[0][2] == 0
    assert host[0][2] >= base.steps  # every training id dist took host counts


def test_wrong_host_counts_are_caught(pool2):
    base = dataclasses.replace(e2e_config(), eval_every=0, profile_steps=0, host_counts=True)
    with pytest.raises(RankFailure):  # mismatched splits fail in the id exchange
        pool2.run(_run, base, True)


def test_host_counts_equal_device_dispatch_counts():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    tables = [
        TableConfig("t0", 1001, 4, ["a", "b"]),
        TableConfig("t1", 7, 4, ["c"]),
    ]
    for w in (1, 3, 8):
        m = ShardedEmbeddingCollection(tables, _PlanOnly(w), SparseOptimConfig(kind="sgd"))
        feats = {}
        for f, rows in (("a", 1001), ("b", 1001), ("c", 7)):
            n = int(torch.randint(0, 50, (1,), generator=g))
            v = torch.randint(0, rows, (n,), generator=g)
            if n:
                v[0] = rows - 1  # a row at the border
            feats[f] = (v, torch.tensor([n]))
        host = m.host_counts(feats)
        cat = torch.cat([feats[f][0] for f in m.plan.features])
        seg = torch.tensor([feats[f][0].numel() for f in m.plan.features])
        res = ranged_dispatch(cat, seg, m._block_sizes, w)
        assert torch.equal(host, res.key_counts.to(torch.int64)), w


class _PlanOnly:
    """World size and rank for building a W-rank plan in one process; host_counts and
    the dispatch compared here call no collective."""

    def __init__(self, w: int) -> None:
        self.world_size, self.rank, self.name = w, 0, "fake"
        self.device = torch.device("cpu")
        self.group = None


def test_owner_counts_matches_the_owner_rule():
    """``owner_counts`` (the host counts' fast path) counts exactly the owners of
    ``owner_and_local`` (fbgemm's block rule) on fresh random ids: ids past the W blocks
    (modulo fallback), all ids inside the blocks (the fast path), one id just past them,
    block borders, W = 1, int32 ids, no ids."""
    from freescale.kernels.reference import owner_and_local, owner_counts

    g = torch.Generator().manual_seed(5)
    for w, blk in ((1, 7), (2, 500), (3, 4), (8, 1), (16, 1000)):
        ids = torch.randint(0, blk * w + 50, (2000,), generator=g)
        ids[:w] = torch.arange(w) * blk  # block borders
        inside = ids.remainder(blk * w)  # all in the blocks: the fast path
        inside[-1] = blk * w - 1  # the last id of the last block
        edge = inside.clone()
        edge[-1] = blk * w  # one id just past the blocks: the fallback path
        for t in (ids, ids.to(torch.int32), ids[:0], inside, inside.to(torch.int32), edge):
            keys = torch.zeros(t.numel(), dtype=torch.int64)
            owner, _ = owner_and_local(t, keys, torch.tensor([blk]), w, "block")
            want = torch.bincount(owner, minlength=w)
            assert torch.equal(owner_counts(t, blk, w), want), (w, blk, t.dtype)
