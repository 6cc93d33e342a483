"""Tests of the data layer: synthetic source, MovieLens reader, validation, loader."""

from __future__ import annotations

import csv
import dataclasses
import math
import time

import numpy as np
import pytest
import torch

from freescale.config import DataConfig
from freescale.data import (
    BadInputError,
    JaggedBatch,
    SyntheticSource,
    normalized_entropy,
    oracle_ne,
    synthetic,
    truncate_uih,
    validate_batch,
)
from freescale.data.batch import lengths_to_offsets
from freescale.data.loader import LoaderError, PrefetchingLoader
from freescale.data.movielens import MovieLensSource, detect_format, load_interactions
from freescale.data.synthetic import _uniform, zipf_ranks_reference

torch.set_num_threads(1)

_FIELDS = ("sample_ids", "candidates", "num_candidates", "labels", "true_probs")


def assert_bitwise_equal(a: JaggedBatch, b: JaggedBatch) -> None:
    assert a.keys == b.keys
    for f in _FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f
    for k in a.keys:
        assert torch.equal(a.uih[k], b.uih[k]), k
        assert torch.equal(a.uih_lengths[k], b.uih_lengths[k]), k
    assert (a.timestamps is None) == (b.timestamps is None)
    if a.timestamps is not None:
        for k in a.keys:
            assert torch.equal(a.timestamps[k], b.timestamps[k])


# ============================================================== synthetic source
@pytest.fixture(scope="module")
def src() -> SyntheticSource:
    return SyntheticSource(DataConfig(global_batch_size=64))


@pytest.mark.parametrize(
    "kw, ts",
    [({}, False), (dict(overlap=0.4, length_dist="powerlaw"), True)],
)
def test_world_size_invariance(kw: dict, ts: bool) -> None:
    s = SyntheticSource(DataConfig(global_batch_size=16, **kw), with_timestamps=ts)
    for step in (0, 1, 7):
        g = s.global_batch(step)
        assert g.sample_ids.tolist() == list(range(16))
        for W in (1, 2, 4):
            local = [s.local_batch(step, r, W) for r in range(W)]
            for r, b in enumerate(local):
                assert b.sample_ids.tolist() == list(range(r * 16 // W, (r + 1) * 16 // W))
            assert_bitwise_equal(JaggedBatch.concat(local), g)


def test_samples_any_order_and_subset(src: SyntheticSource) -> None:
    g = src.global_batch(3)
    order = [17, 2, 63, 2, 40]
    assert_bitwise_equal(src.samples(3, torch.tensor(order)), g.select(order))
    # ids beyond the global batch are legal and independent of their neighbours
    a = src.samples(3, np.array([100, 5]))
    b = src.samples(3, np.array([5]))
    assert torch.equal(a.select([1]).uih["uih_item"], b.uih["uih_item"])


def test_determinism_and_streams(src: SyntheticSource) -> None:
    again = SyntheticSource(DataConfig(global_batch_size=64))
    assert_bitwise_equal(src.global_batch(5), again.global_batch(5))
    other_seed = SyntheticSource(DataConfig(global_batch_size=64, seed=99))
    assert not torch.equal(src.global_batch(5).candidates, other_seed.global_batch(5).candidates)
    assert not torch.equal(src.global_batch(5).candidates, src.global_batch(6).candidates)
    ev = src.global_batch(5, split="eval")
    assert not torch.equal(src.global_batch(5).candidates, ev.candidates)
    with pytest.raises(ValueError, match="unknown split"):
        src.global_batch(0, split="test")


def test_local_batch_requires_divisible_world_size(src: SyntheticSource) -> None:
    with pytest.raises(ValueError, match="not divisible by world size 3"):
        src.local_batch(0, 0, 3)
    with pytest.raises(ValueError, match="bad rank"):
        src.local_batch(0, 4, 4)


def test_batch_layout_and_ranges(src: SyntheticSource) -> None:
    b = src.global_batch(2)
    cfg = src.cfg
    assert src.uih_keys == ["uih_item", "uih_action"]
    assert torch.equal(b.uih_lengths["uih_item"], b.uih_lengths["uih_action"])
    assert b.uih["uih_item"].dtype == torch.int64 and b.labels.dtype == torch.float32
    assert b.true_probs is not None and b.true_probs.dtype == torch.float64
    assert int(b.uih["uih_item"].min()) >= 0 and int(b.uih["uih_item"].max()) < cfg.num_items
    assert int(b.uih["uih_action"].max()) < cfg.num_actions
    assert b.num_candidates.tolist() == [cfg.num_candidates] * cfg.global_batch_size
    # actions are skewed: action 0 is the most common
    counts = torch.bincount(b.uih["uih_action"], minlength=cfg.num_actions)
    assert int(counts.argmax()) == 0 and int(counts[-1]) > 0
    assert validate_batch(b, src.feature_rows(), max_uih=cfg.max_uih, rank=0) is b


def test_timestamps_increase_per_sample() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=16, overlap=0.3), with_timestamps=True)
    b = s.global_batch(4)
    ts, offs = b.timestamps["uih_item"], b.uih_offsets("uih_item")
    assert ts.dtype == torch.int64 and ts.numel() == b.uih["uih_item"].numel()
    for i in range(b.batch_size):
        seg = ts[offs[i] : offs[i + 1]]
        assert bool((seg[1:] > seg[:-1]).all())


@pytest.mark.parametrize("dist", ["lognormal", "powerlaw"])
def test_length_distribution(dist: str) -> None:
    cfg = DataConfig(
        global_batch_size=256,
        length_dist=dist,
        median_uih=64,
        sigma=1.5,
        powerlaw_alpha=1.2,
        min_uih=4,
        max_uih=32_768,
        num_items=1000,
    )
    s = SyntheticSource(cfg)
    L = np.concatenate([s.lengths(t, np.arange(256)) for t in range(8)])  # 2048 samples
    assert L.min() >= 4 and L.max() <= 32_768
    med = float(np.median(L))
    assert 0.8 * 64 <= med <= 1.25 * 64  # the configured median
    assert L.max() > 40 * med  # heavy tail
    assert np.mean(L > 10 * med) > 0.005
    # clipping at a small max_uih: many samples sit exactly at the cap
    s2 = SyntheticSource(DataConfig(median_uih=64, sigma=1.5, max_uih=128))
    L2 = s2.lengths(0, np.arange(1000))
    assert L2.max() == 128 and np.mean(L2 == 128) > 0.1
    # lengths() agrees with the generated batch
    b = s.global_batch(3)
    assert b.uih_lengths["uih_item"].tolist() == s.lengths(3, np.arange(256)).tolist()


def test_zipf_skew_and_permutation() -> None:
    s = SyntheticSource(DataConfig(num_items=10_000, zipf_s=1.05, global_batch_size=64))
    items = torch.cat([s.global_batch(t).uih["uih_item"] for t in range(4)]).numpy()
    ranks = s.item_to_rank[items]
    top1pct = np.mean(ranks < 100)
    expected = s.zipf_pmf[:100].sum()
    assert top1pct > 0.4 and abs(top1pct - expected) < 0.05
    counts = np.bincount(ranks, minlength=10_000)
    assert counts[0] > counts[1000] * 50  # rank 0 far more frequent than rank 1000
    # popular items are spread over row-wise shards (4 shards of 2500 rows)
    shard_of_top = s.rank_to_item[:100] // 2500
    assert len(set(shard_of_top.tolist())) == 4


@pytest.mark.parametrize("guide_bits", [22, 10])
def test_zipf_guide_table_matches_reference(guide_bits: int, monkeypatch) -> None:
    """The guide table + bounded search equals plain searchsorted; with a 10-bit guide
    most draws fall in buckets holding many ranks (the 20M-item case at 22 bits)."""
    monkeypatch.setattr(synthetic, "_GUIDE_MAX_BITS", guide_bits)
    for n, zs in [(1000, 1.05), (50_000, 1.3), (7, 0.0), (50_000, 0.6)]:
        s = SyntheticSource(DataConfig(num_items=n, zipf_s=zs))
        rng = np.random.default_rng(n)
        y = rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64, endpoint=True)
        y[:3] = [0, 2**64 - 1, 2**63]
        fast = s.zipf_ranks(y)
        ref = zipf_ranks_reference(s.zipf_cdf, _uniform(y))
        assert np.array_equal(fast, ref)
        assert fast.min() >= 0 and fast.max() < n


def test_labels_calibrated_and_oracle_ne(src: SyntheticSource) -> None:
    batches = [src.global_batch(t) for t in range(60)]
    labels = torch.cat([b.labels for b in batches]).double()
    probs = torch.cat([b.true_probs for b in batches])
    n = labels.numel()
    se = math.sqrt(float((probs * (1 - probs)).sum())) / n
    assert abs(float(labels.mean() - probs.mean())) < 4 * se
    # binned calibration: high-probability candidates are clicked more
    hi, lo = probs > 0.6, probs < 0.2
    assert float(labels[hi].mean()) > 0.5 and float(labels[lo].mean()) < 0.25
    ne = oracle_ne(batches)
    assert 0.5 < ne < 0.85
    # a constant prediction at the mean label has NE 1 by definition
    const = torch.full_like(labels, float(labels.mean()))
    assert normalized_entropy(const, labels) == pytest.approx(1.0, abs=1e-9)
    assert 0.5 < oracle_ne(src.eval_batches(256)) < 0.85


def test_normalized_entropy_matches_torchrec() -> None:
    ne_mod = pytest.importorskip("torchrec.metrics.ne")
    g = torch.Generator().manual_seed(0)
    p = torch.rand(500, generator=g, dtype=torch.float64)
    y = (torch.rand(500, generator=g, dtype=torch.float64) < p).double()
    w = torch.ones_like(p)
    ce = ne_mod.compute_cross_entropy(y, p, w, 1e-12).sum()
    ref = ne_mod.compute_ne(ce, w.sum(), (y * w).sum(), ((1 - y) * w).sum(), 1e-12)
    assert normalized_entropy(p, y) == pytest.approx(float(ref), rel=1e-9)


def _shared_share(prev: JaggedBatch, cur: JaggedBatch) -> list[float]:
    po, co = prev.uih_offsets("uih_item"), cur.uih_offsets("uih_item")
    out = []
    for i in range(cur.batch_size):
        p = set(prev.uih["uih_item"][po[i] : po[i + 1]].tolist())
        c = cur.uih["uih_item"][co[i] : co[i + 1]].tolist()
        out.append(sum(x in p for x in c) / len(c))
    return out


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.6])
def test_overlap_injection(overlap: float) -> None:
    # uniform popularity over many items: natural collisions are ~0
    cfg = DataConfig(
        num_items=300_000, zipf_s=0.0, overlap=overlap, global_batch_size=32, median_uih=200
    )
    s = SyntheticSource(cfg)
    b0, b1, b2 = (s.global_batch(t) for t in range(3))
    for prev, cur in ((b0, b1), (b1, b2)):
        share = _shared_share(prev, cur)
        L = cur.uih_lengths["uih_item"].tolist()
        for sh, n in zip(share, L):
            assert sh >= math.floor(overlap * n) / n  # every copied id is shared
            assert sh <= math.floor(overlap * n) / n + 0.02
        total = sum(sh * n for sh, n in zip(share, L)) / sum(L)
        assert abs(total - overlap) < 0.01
    # step 0 has no predecessor: nothing is copied into it (still pure in (seed, step, g))
    no_overlap = SyntheticSource(dataclasses.replace(cfg, overlap=0.0))
    assert_bitwise_equal(b0, no_overlap.global_batch(0))
    assert not torch.equal(b1.uih["uih_item"], no_overlap.global_batch(1).uih["uih_item"]) or (
        overlap == 0.0
    )


def test_overlap_validation() -> None:
    with pytest.raises(ValueError, match="overlap"):
        SyntheticSource(DataConfig(overlap=1.0))


def test_generation_speed() -> None:
    # targets: 128 x mean ~2K (max 32K) << 50 ms; 64 x ~50 in a few ms (on one core).
    # The bounds here are loose (shared CI machines); they catch a 5x regression.
    big = SyntheticSource(
        DataConfig(global_batch_size=128, median_uih=1240, sigma=1.0, max_uih=32_768)
    )
    big.global_batch(0)
    t0 = time.perf_counter()
    b = big.global_batch(1)
    dt_big = time.perf_counter() - t0
    assert 1000 < b.total_tokens() / 2 / 128 < 4000
    small = SyntheticSource(DataConfig(global_batch_size=64))
    small.global_batch(0)
    t0 = time.perf_counter()
    small.global_batch(1)
    dt_small = time.perf_counter() - t0
    assert dt_big < 0.25 and dt_small < 0.05, (dt_big, dt_small)


# ============================================================== validation
ROWS = {"uih_item": 20_000, "uih_action": 4, "candidates": 20_000}


@pytest.fixture()
def good() -> JaggedBatch:
    # rank 1 of 2: local sample i has global id 32 + i
    return SyntheticSource(DataConfig(global_batch_size=64)).local_batch(0, 1, 2)


def _pos(batch: JaggedBatch, key: str, sample: int, j: int = 0) -> int:
    return int(batch.uih_offsets(key)[sample]) + j


def _bad(batch: JaggedBatch, *parts: str, **kw: object) -> str:
    kw = {"max_uih": 512, "rank": 3, **kw}
    with pytest.raises(BadInputError) as ei:
        validate_batch(batch, ROWS, **kw)
    msg = str(ei.value)
    assert msg.startswith("rank 3")
    for p in parts:
        assert p in msg, (p, msg)
    return msg


def test_valid_batch_passes_unchanged(good: JaggedBatch) -> None:
    assert validate_batch(good, ROWS, max_uih=512, rank=1) is good


def test_empty_batch_is_valid() -> None:
    e = JaggedBatch.empty(["uih_item", "uih_action"])
    assert validate_batch(e, ROWS, max_uih=8, rank=0, truncate=True).batch_size == 0


def test_reject_id_too_large(good: JaggedBatch) -> None:
    good.uih["uih_item"][_pos(good, "uih_item", 17, 1)] = 20_001
    msg = _bad(good, "feature 'uih_item'", "sample 17 (global id 49)", "id 20001")
    assert "out of range [0, 20000)" in msg


def test_reject_negative_id(good: JaggedBatch) -> None:
    good.uih["uih_action"][_pos(good, "uih_action", 5)] = -2
    _bad(good, "feature 'uih_action'", "sample 5 (global id 37)", "id -2 out of range [0, 4)")


def test_reject_candidate_out_of_range(good: JaggedBatch) -> None:
    good.candidates[8 * 9 + 3] = 20_000
    _bad(good, "feature 'candidates'", "sample 9 (global id 41)", "id 20000")


def test_reject_negative_length(good: JaggedBatch) -> None:
    L = good.uih_lengths["uih_item"]
    L[4], L[6] = -1, L[6] + L[4] + 1  # keep the sum
    _bad(good, "feature 'uih_item'", "sample 4 (global id 36)", "negative length -1")


def test_reject_lengths_not_summing(good: JaggedBatch) -> None:
    good.uih_lengths["uih_action"] = good.uih_lengths["uih_action"].clone()
    good.uih_lengths["uih_action"][0] += 1
    _bad(good, "feature 'uih_action'", "lengths sum to", "values")


def test_reject_mismatched_keys(good: JaggedBatch) -> None:
    b = JaggedBatch.concat([good])
    b.uih_lengths["uih_other"] = b.uih_lengths.pop("uih_action")
    _bad(b, "keys", "uih_other")
    c = JaggedBatch.concat([good])
    c.uih["uih_extra"] = c.uih["uih_item"]
    c.uih_lengths["uih_extra"] = c.uih_lengths["uih_item"]
    _bad(c, "unknown: ['uih_extra']")


def test_reject_unaligned_keys(good: JaggedBatch) -> None:
    # move one id of sample 2 to sample 3 in 'uih_action' only: sums still match
    L = good.uih_lengths["uih_action"].clone()
    L[2] -= 1
    L[3] += 1
    good.uih_lengths["uih_action"] = L
    _bad(good, "feature 'uih_action'", "sample 2 (global id 34)", "not aligned with 'uih_item'")
    # tolerated when alignment is not required
    validate_batch(good, ROWS, max_uih=512, rank=3, require_aligned=False)


def test_reject_label_not_binary(good: JaggedBatch) -> None:
    good.labels[8 * 12 + 2] = 0.5
    _bad(good, "feature 'labels'", "sample 12 (global id 44)", "label 0.5")


def test_reject_nan_label(good: JaggedBatch) -> None:
    good.labels[8 * 30] = float("nan")
    _bad(good, "feature 'labels'", "sample 30 (global id 62)", "label nan")


def test_reject_label_count_mismatch(good: JaggedBatch) -> None:
    good.labels = good.labels[:-1]
    _bad(good, "feature 'labels'", "255 labels for 256 candidates")


def test_reject_num_candidates_mismatch(good: JaggedBatch) -> None:
    good.num_candidates[3] += 1
    _bad(good, "feature 'candidates'", "lengths sum to 257", "256 values")


def test_reject_too_long(good: JaggedBatch) -> None:
    L = good.uih_lengths["uih_item"]
    i = int((L > 100).nonzero()[0, 0])  # the first over-long sample is reported
    n = int(L[i])
    _bad(
        good,
        "feature 'uih_item'",
        f"sample {i} (global id {32 + i})",
        f"length {n}",
        "exceeds max_uih=100",
        max_uih=100,
    )


def test_truncation_keeps_most_recent() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=8), with_timestamps=True)
    b = s.global_batch(1)
    t = validate_batch(b, ROWS, max_uih=10, rank=0, truncate=True)
    offs, toffs = b.uih_offsets("uih_item"), t.uih_offsets("uih_item")
    for i in range(b.batch_size):
        n = int(b.uih_lengths["uih_item"][i])
        assert int(t.uih_lengths["uih_item"][i]) == min(n, 10)
        for k in ("uih_item", "uih_action"):
            assert torch.equal(
                t.uih[k][toffs[i] : toffs[i + 1]], b.uih[k][offs[i + 1] - min(n, 10) : offs[i + 1]]
            )
        assert torch.equal(
            t.timestamps["uih_item"][toffs[i] : toffs[i + 1]],
            b.timestamps["uih_item"][offs[i + 1] - min(n, 10) : offs[i + 1]],
        )
    assert truncate_uih(b, 10_000) is b


def test_reject_wrong_dtypes(good: JaggedBatch) -> None:
    b = JaggedBatch.concat([good])
    b.uih["uih_item"] = b.uih["uih_item"].to(torch.int32)
    _bad(b, "feature 'uih_item'", "dtype torch.int32")
    c = JaggedBatch.concat([good])
    c.labels = c.labels.double()
    _bad(c, "feature 'labels'", "dtype torch.float64")


# ============================================================== MovieLens
def _write_all_formats(tmp, rows):  # rows: (user, item, rating, ts)
    inter = tmp / "ml-100k.inter"
    with open(inter, "w") as f:
        f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
        for u, i, r, t in rows:
            f.write(f"{u}\t{i}\t{r}\t{t}\n")
    dat_dir = tmp / "ml1m"
    dat_dir.mkdir()
    with open(dat_dir / "ratings.dat", "w") as f:
        for u, i, r, t in rows:
            f.write(f"{u}::{i}::{int(r)}::{t}\n")
    users = sorted({u for u, *_ in rows})
    with open(tmp / "sasrec_format.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "index",
                "user_id",
                "sequence_item_ids",
                "sequence_ratings",
                "sequence_timestamps",
                "sex",
            ]
        )
        for n, u in enumerate(reversed(users)):  # users in any order
            hist = sorted((t, i, r) for uu, i, r, t in rows if uu == u)
            w.writerow(
                [
                    n,
                    u,
                    ",".join(str(i) for _, i, _ in hist),
                    ",".join(str(int(r)) for *_, r in hist),
                    ",".join(str(t) for t, *_ in hist),
                    0,
                ]
            )
    return inter, dat_dir / "ratings.dat", tmp / "sasrec_format.csv"


@pytest.fixture()
def ml_files(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for u in range(1, 13):  # raw user ids 1..12, sparse raw item ids
        n = int(rng.integers(1, 25))
        ts = rng.choice(np.arange(1000, 5000), size=n, replace=False)
        for t in ts:
            rows.append(
                (u * 3, int(rng.integers(0, 40)) * 7 + 100, float(rng.integers(1, 6)), int(t))
            )
    order = rng.permutation(len(rows))  # file order is not time order
    rows = [rows[i] for i in order]
    return rows, _write_all_formats(tmp_path, rows)


def test_movielens_formats_agree(ml_files, tmp_path) -> None:
    rows, (inter, dat, sas) = ml_files
    assert detect_format(str(inter))[0] == "inter"
    assert detect_format(str(dat))[0] == "dat"
    assert detect_format(str(sas))[0] == "sasrec"
    assert detect_format(str(dat.parent)) == ("dat", str(dat))
    cfg = DataConfig(global_batch_size=8, num_candidates=3, max_uih=6)
    srcs = [MovieLensSource(cfg, str(p)) for p in (inter, dat, sas)]
    n_items = len({i for _, i, _, _ in rows})
    for s in srcs:
        assert s.num_items == n_items and s.num_actions == 5
        assert s.num_interactions == len(rows)
        assert s.item_raw_ids.tolist() == sorted({i for _, i, _, _ in rows})
        assert s.dense_item(s.item_raw_ids[3]) == 3
        assert s.data_config().num_items == n_items
    for t in range(3):
        for split in ("train", "eval"):
            a = srcs[0].global_batch(t, split)
            assert_bitwise_equal(a, srcs[1].global_batch(t, split))
            assert_bitwise_equal(a, srcs[2].global_batch(t, split))
    with pytest.raises(ValueError, match="cannot tell the format"):
        load_interactions(str(tmp_path / "x.txt"))
    assert load_interactions(str(dat), fmt="dat").user.size == len(rows)


def test_movielens_samples(ml_files) -> None:
    rows, (inter, _, _) = ml_files
    cfg = DataConfig(global_batch_size=16, num_candidates=3, max_uih=6, seed=7)
    s = MovieLensSource(cfg, str(inter), with_timestamps=True)
    assert set(s.split_users["train"]).isdisjoint(s.split_users["eval"])
    assert len(s.split_users["eval"]) >= 1
    by_user: dict[int, list] = {}
    for u, i, r, t in rows:
        by_user.setdefault(u, []).append((t, i, r))
    saw_short_candidates = False
    for t in range(6):
        b = s.global_batch(t)
        validate_batch(b, s.feature_rows(), max_uih=6, rank=0)
        users, cuts = s.pick(t, np.arange(16))
        uo, co = b.uih_offsets("uih_item"), b.candidate_offsets()
        for k in range(16):
            u, c = int(users[k]), int(cuts[k])
            assert u in set(s.split_users["train"].tolist())
            hist = sorted(by_user[int(s.user_raw_ids[u])])  # time order
            assert 1 <= c < len(hist)
            items = [s.dense_item(i) for _, i, _ in hist]
            ratings = [r for *_, r in hist]
            uih = b.uih["uih_item"][uo[k] : uo[k + 1]].tolist()
            assert uih == items[max(0, c - 6) : c]  # most recent max_uih before the cut
            assert b.uih["uih_action"][uo[k] : uo[k + 1]].tolist() == [
                int(r) - 1 for r in ratings[max(0, c - 6) : c]
            ]
            assert b.timestamps["uih_item"][uo[k] : uo[k + 1]].tolist() == [
                h[0] for h in hist[max(0, c - 6) : c]
            ]
            assert b.candidates[co[k] : co[k + 1]].tolist() == items[c : c + 3]
            assert b.labels[co[k] : co[k + 1]].tolist() == [
                float(r >= 4) for r in ratings[c : c + 3]
            ]
            saw_short_candidates |= int(b.num_candidates[k]) < 3
    assert saw_short_candidates  # candidates are fewer at the end of a history
    # world-size invariance and eval split
    for W in (2, 4):
        assert_bitwise_equal(
            JaggedBatch.concat([s.local_batch(2, r, W) for r in range(W)]), s.global_batch(2)
        )
    ev = next(s.eval_batches(16))
    eu, _ = s.pick(0, np.arange(16), "eval")
    assert set(eu.tolist()) <= set(s.split_users["eval"].tolist())
    assert ev.batch_size == 16


# ============================================================== loader
class _FailingSource:
    def __init__(self, inner: SyntheticSource, fail_at: int, exc: BaseException) -> None:
        self.inner, self.fail_at, self.exc = inner, fail_at, exc

    def local_batch(self, step, rank, world_size, split="train"):
        if step == self.fail_at:
            raise self.exc
        return self.inner.local_batch(step, rank, world_size, split)


def test_loader_yields_in_order_with_load_times() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=16))
    fn = lambda b: validate_batch(b, s.feature_rows(), max_uih=512, rank=1)  # noqa: E731
    with PrefetchingLoader(s, 1, 2, steps=range(3, 9), validate_fn=fn, depth=2) as ld:
        got = list(ld)
    assert [b.step for b in got] == list(range(3, 9))
    for b in got:
        assert_bitwise_equal(b, s.local_batch(b.step, 1, 2))
        assert b.extras["load_time_s"] >= 0
    assert sorted(ld.load_times) == list(range(3, 9))
    assert not ld._thread.is_alive()


def test_loader_reraises_at_its_step() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=8))
    ld = PrefetchingLoader(_FailingSource(s, 3, KeyError("boom")), 0, 1, steps=6, depth=3)
    seen = []
    with pytest.raises(LoaderError, match="step 3: KeyError") as ei:
        for b in ld:
            seen.append(b.step)
    assert seen == [0, 1, 2]
    assert isinstance(ei.value.__cause__, KeyError) and ei.value.step == 3
    ld.close()
    assert not ld._thread.is_alive()


def test_loader_validation_error_keeps_type() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=8))

    def validate(b: JaggedBatch) -> JaggedBatch:
        if b.step == 2:
            b.uih["uih_item"][0] = 10**9
        return validate_batch(b, s.feature_rows(), max_uih=512, rank=0)

    with PrefetchingLoader(s, 0, 1, steps=5, validate_fn=validate) as ld:
        it = iter(ld)
        assert next(it).step == 0 and next(it).step == 1
        with pytest.raises(BadInputError, match=r"step 2: rank 0: feature 'uih_item'") as ei:
            next(it)
        assert ei.value.step == 2
        with pytest.raises(StopIteration):
            next(it)


def test_loader_close_while_producer_blocked() -> None:
    s = SyntheticSource(DataConfig(global_batch_size=8))
    ld = PrefetchingLoader(s, 0, 1, steps=100, depth=1)
    assert next(iter(ld)).step == 0
    time.sleep(0.05)  # the producer is now blocked on the full queue
    ld.close()
    assert not ld._thread.is_alive()


def test_select_matches_a_per_sample_loop() -> None:
    """``JaggedBatch.select`` (one gather index per key, shared by the timestamps) equals
    slicing sample by sample, on fresh random batches with empty histories, repeated and
    dropped samples, and an empty selection."""
    g = torch.Generator().manual_seed(11)
    src = SyntheticSource(
        DataConfig(global_batch_size=24, median_uih=3, max_uih=12, min_uih=1),
        with_timestamps=True,
    )
    for step in range(5):
        b = src.global_batch(step)
        for k in b.uih:  # some empty histories
            b.uih_lengths[k][:: 5 + step] = 0
        off = {k: lengths_to_offsets(b.uih_lengths[k]) for k in b.uih}
        b.uih = {k: b.uih[k][: int(off[k][-1])] for k in b.uih}  # consistent after zeroing
        b.timestamps = {k: v[: int(off[k][-1])] for k, v in b.timestamps.items()}
        n = int(torch.randint(0, 40, (1,), generator=g))
        order = torch.randint(0, b.batch_size, (n,), generator=g)
        got = b.select(order)
        for k in b.uih:
            o = off[k]
            want = [b.uih[k][o[i] : o[i + 1]] for i in order.tolist()]
            assert torch.equal(got.uih[k], torch.cat(want) if want else b.uih[k][:0])
            if k in b.timestamps:
                ts = b.timestamps[k]
                want_ts = [ts[o[i] : o[i + 1]] for i in order.tolist()]
                assert torch.equal(got.timestamps[k], torch.cat(want_ts) if want_ts else ts[:0])
            assert got.uih_lengths[k].tolist() == [int(o[i + 1] - o[i]) for i in order.tolist()]
        assert got.sample_ids.tolist() == [int(b.sample_ids[i]) for i in order.tolist()]
