"""Fuzzed bad input: 200+ malformed batches each raise a clear BadInputError naming the
rank, the feature and (for per-sample faults) the sample, without touching the input;
a few go through a real 2-rank Trainer step, which must reject them on every rank with
tables and dense parameters unchanged, and keep working afterwards (also with an empty
rank)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from freescale.config import CANDIDATE_FEATURE
from freescale.data.batch import JaggedBatch
from freescale.data.synthetic import SyntheticSource
from freescale.data.validate import BadInputError, validate_batch
from freescale.pipeline.trainer import Trainer, make_source
from test_trainer import tiny_config

KINDS = (
    "id_too_large",
    "id_negative",
    "negative_length",
    "length_value_mismatch",
    "nan_label",
    "label_not_binary",
    "beyond_max_uih",
    "labels_count",
)


def _copy(b: JaggedBatch) -> JaggedBatch:
    def c(d):
        return None if d is None else {k: v.clone() for k, v in d.items()}

    return dataclasses.replace(
        b,
        sample_ids=b.sample_ids.clone(),
        uih=c(b.uih),
        uih_lengths=c(b.uih_lengths),
        candidates=b.candidates.clone(),
        num_candidates=b.num_candidates.clone(),
        labels=b.labels.clone(),
        timestamps=c(b.timestamps),
        true_probs=None if b.true_probs is None else b.true_probs.clone(),
        extras=dict(b.extras),
    )


def corrupt(
    b: JaggedBatch, kind: str, rng: random.Random, rows: dict[str, int], max_uih: int
) -> tuple[JaggedBatch, str, int | None]:
    """A malformed copy of ``b``: (batch, feature the error must name, sample or None)."""
    b = _copy(b)
    keys = list(b.uih)
    B = b.batch_size

    def pick_id_feature():
        f = rng.choice([*keys, CANDIDATE_FEATURE])
        if f == CANDIDATE_FEATURE:
            return f, b.candidates, b.num_candidates
        return f, b.uih[f], b.uih_lengths[f]

    if kind in ("id_too_large", "id_negative"):
        for _ in range(100):
            f, vals, lens = pick_id_feature()
            if vals.numel():
                break
        i = rng.randrange(vals.numel())
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        s = int(torch.searchsorted(offs, torch.tensor([i]), right=True)[0]) - 1
        vals[i] = (
            rows[f] + rng.randrange(0, 1000) if kind == "id_too_large" else -rng.randint(1, 10**9)
        )
        return b, f, s
    if kind == "negative_length":
        f = rng.choice([*keys, CANDIDATE_FEATURE])
        lens = b.num_candidates if f == CANDIDATE_FEATURE else b.uih_lengths[f]
        s = rng.randrange(B)
        lens[s] = -rng.randint(1, 5)
        return b, f, s
    if kind == "length_value_mismatch":
        f = rng.choice([*keys, CANDIDATE_FEATURE])
        vals = b.candidates if f == CANDIDATE_FEATURE else b.uih[f]
        if rng.random() < 0.5 and vals.numel():
            vals = vals[: -rng.randint(1, min(3, vals.numel()))]
        else:
            vals = torch.cat([vals, torch.zeros(rng.randint(1, 3), dtype=torch.int64)])
        if f == CANDIDATE_FEATURE:
            b.candidates = vals
        else:
            b.uih[f] = vals
            if b.timestamps is not None:
                b.timestamps[f] = torch.zeros(vals.numel(), dtype=torch.int64)
        return b, f, None
    if kind in ("nan_label", "label_not_binary"):
        i = rng.randrange(b.labels.numel())
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), b.num_candidates.cumsum(0)])
        s = int(torch.searchsorted(offs, torch.tensor([i]), right=True)[0]) - 1
        b.labels[i] = float("nan") if kind == "nan_label" else rng.choice([0.5, 2.0, -1.0, 1e9])
        return b, "labels", s
    if kind == "beyond_max_uih":
        s = rng.randrange(B)
        extra_len = max_uih + rng.randint(1, 5)
        for k in keys:
            L = b.uih_lengths[k]
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), L.cumsum(0)])
            lo, hi = int(offs[s]), int(offs[s + 1])
            new = torch.randint(0, rows[k], (extra_len,), dtype=torch.int64)
            b.uih[k] = torch.cat([b.uih[k][:lo], new, b.uih[k][hi:]])
            if b.timestamps is not None:
                t = b.timestamps[k]
                b.timestamps[k] = torch.cat([t[:lo], torch.zeros(extra_len, dtype=t.dtype), t[hi:]])
            L[s] = extra_len
        return b, keys[0], s
    if kind == "labels_count":
        b.labels = b.labels[:-1]
        return b, "labels", None
    raise AssertionError(kind)


def _rows(cfg) -> dict[str, int]:
    src = SyntheticSource(cfg.data)
    rows = {
        k: (cfg.data.num_actions if k == "uih_action" else cfg.data.num_items) for k in src.uih_keys
    }
    rows[CANDIDATE_FEATURE] = cfg.data.num_items
    return rows


def _same(a: JaggedBatch, b: JaggedBatch) -> bool:
    def eq(x: torch.Tensor, y: torch.Tensor) -> bool:
        if x.is_floating_point():
            return x.shape == y.shape and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
        return torch.equal(x, y)

    fields = ("sample_ids", "candidates", "num_candidates", "labels")
    return all(eq(getattr(a, f), getattr(b, f)) for f in fields) and all(
        eq(a.uih[k], b.uih[k]) and eq(a.uih_lengths[k], b.uih_lengths[k]) for k in a.uih
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_fuzz_validate_batch(seed):
    cfg = tiny_config()
    cfg.data.global_batch_size = 16
    src = SyntheticSource(cfg.data, with_timestamps=seed == 1)
    rows, max_uih = _rows(cfg), cfg.data.max_uih
    rng = random.Random(seed)
    n = 0
    for i in range(130):
        kind = KINDS[i % len(KINDS)]
        rank = rng.randrange(8)
        clean = src.local_batch(rng.randrange(1, 50), rank % 2, 2)
        assert validate_batch(clean, rows, max_uih=max_uih, rank=rank) is clean
        bad, feature, sample = corrupt(clean, kind, rng, rows, max_uih)
        snap = _copy(bad)
        ctx = f"seed {seed} case {i} kind {kind} feature {feature} sample {sample}"
        with pytest.raises(BadInputError) as ei:
            validate_batch(bad, rows, max_uih=max_uih, rank=rank)
        msg = str(ei.value)
        assert f"rank {rank}" in msg, f"{ctx}: {msg}"
        assert f"'{feature}'" in msg, f"{ctx}: {msg}"
        if sample is not None:
            assert f"sample {sample} " in msg, f"{ctx}: {msg}"
        assert _same(bad, snap), f"{ctx}: validate_batch modified its input"
        n += 1
    # the documented alternative for over-long samples: truncation keeps the newest ids
    bad, feature, s = corrupt(src.local_batch(3, 0, 2), "beyond_max_uih", rng, rows, max_uih)
    out = validate_batch(bad, rows, max_uih=max_uih, rank=0, truncate=True)
    assert int(out.uih_lengths[feature].max()) <= max_uih
    # an empty batch is valid
    empty = JaggedBatch.empty(list(src.uih_keys), 0)
    validate_batch(empty, rows, max_uih=max_uih, rank=3)
    assert n == 130


# ----------------------------------------------------------- through a Trainer
class _FuzzSource:
    """Wraps a source. ``plan[step] = (rank, kind)`` corrupts that rank's batch of that
    step; ``empty_rank`` gets no samples (its share is dropped, a legal input)."""

    def __init__(self, inner, seed: int, rows, max_uih: int):
        self.inner = inner
        self.uih_keys = inner.uih_keys
        self.num_items, self.num_actions = inner.num_items, inner.num_actions
        self.plan: dict[int, tuple[int, str]] = {}
        self.empty_rank: int | None = None
        self.rng = random.Random(seed)
        self.rows, self.max_uih = rows, max_uih

    def global_batch(self, step, split="train"):
        return self.inner.global_batch(step, split)

    def local_batch(self, step, rank, world, split="train"):
        b = self.inner.local_batch(step, rank, world, split)
        if split != "train":
            return b
        if rank == self.empty_rank:
            b = JaggedBatch.empty(list(self.uih_keys), step)
        if step in self.plan and self.plan[step][0] == rank:
            b, _, _ = corrupt(b, self.plan[step][1], self.rng, self.rows, self.max_uih)
        return b


def _snapshot(tr: Trainer):
    return [tr.sparse.weight.clone(), *(v.clone() for v in tr.sparse.optimizer.state.values())], [
        p.detach().clone() for p in tr.dense.state_dict().values()
    ]


def _unchanged(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a[0] + a[1], b[0] + b[1]))


def fuzz_trainer(rank, world, cfg, seed):
    rows = _rows(cfg)
    src = _FuzzSource(make_source(cfg), seed, rows, cfg.data.max_uih)
    tr = Trainer(cfg, source=src)
    tr.train(1)
    rng = random.Random(seed)
    out = []
    # batch-level kinds that need samples on the corrupted rank
    kinds = [
        "id_too_large",
        "id_negative",
        "negative_length",
        "length_value_mismatch",
        "nan_label",
        "beyond_max_uih",
    ]
    for i, kind in enumerate(kinds):
        bad_rank = rng.randrange(world)
        src.empty_rank = (1 - bad_rank) if i % 2 else None  # the other rank may be empty
        t = tr.step + 1
        src.plan = {t: (bad_rank, kind)}
        before = _snapshot(tr)
        err = None
        try:
            tr.train(1)
        except BadInputError as e:
            err = (type(e).__name__, str(e))
        unchanged = _unchanged(before, _snapshot(tr))
        src.plan = {}
        tr.train(1)  # the job keeps working (with an empty rank on odd cases)
        out.append(
            {
                "kind": kind,
                "bad_rank": bad_rank,
                "err": err,
                "unchanged": unchanged,
                "step_after": tr.step,
                "t": t,
            }
        )
    return out


def test_fuzz_through_trainer_two_ranks(pool2):
    seed = 11
    cfg = tiny_config(kind="adam", steps=1)
    res = pool2.run(fuzz_trainer, cfg, seed)
    for r, cases in enumerate(res):
        for c in cases:
            ctx = f"seed {seed} rank {r} case {c}"
            assert c["err"] is not None, ctx
            assert c["unchanged"], ctx
            assert c["step_after"] == c["t"], ctx
            name, msg = c["err"]
            if r == c["bad_rank"]:
                assert name == "BadInputError" and f"rank {r}" in msg, ctx
            else:
                assert name == "InputRejected" and f"rank(s) [{c['bad_rank']}]" in msg, ctx
