"""KeyedJaggedTensor interop of integrations/torchrec.py (single process): batch ->
KJT -> batch round trip, feature-dict conversions, table config conversions, and that
the module imports (and fails clearly) without TorchRec."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from freescale.config import DataConfig
from freescale.data.batch import JaggedBatch
from freescale.data.synthetic import SyntheticSource

needs_torchrec = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("torchrec", "fbgemm_gpu")),
    reason="needs torchrec and fbgemm-gpu (pip install fbgemm-gpu-cpu; torchrec --no-deps)",
)


def _batch(with_empty: bool = True) -> JaggedBatch:
    cfg = DataConfig(seed=3, global_batch_size=6, num_items=500, median_uih=5, max_uih=12)
    b = SyntheticSource(cfg, with_timestamps=True).global_batch(4)
    if with_empty:  # a sample with an empty history (legal in a JaggedBatch)
        for k in b.keys:
            off = b.uih_offsets(k)
            keep = torch.ones(b.uih[k].numel(), dtype=torch.bool)
            keep[off[1] : off[2]] = False
            b.uih[k] = b.uih[k][keep]
            b.timestamps[k] = b.timestamps[k][keep]
            b.uih_lengths[k] = b.uih_lengths[k].clone()
            b.uih_lengths[k][1] = 0
    return b


def _assert_batches_equal(a: JaggedBatch, b: JaggedBatch) -> None:
    assert a.keys == b.keys
    for k in a.keys:
        assert torch.equal(a.uih[k], b.uih[k]) and a.uih[k].dtype == torch.int64
        assert torch.equal(a.uih_lengths[k], b.uih_lengths[k])
    assert torch.equal(a.candidates, b.candidates)
    assert torch.equal(a.num_candidates, b.num_candidates)
    assert torch.equal(a.labels, b.labels)
    assert torch.equal(a.sample_ids, b.sample_ids)


@needs_torchrec
def test_batch_kjt_round_trip() -> None:
    from freescale.integrations.torchrec import batch_from_kjt, batch_to_kjt

    b = _batch()
    kjt = batch_to_kjt(b)
    assert kjt.keys() == ["uih_item", "uih_action", "candidates"]
    assert kjt.stride() == b.batch_size
    assert kjt.values().dtype == torch.int64
    jt = kjt.to_dict()
    for k in b.keys:
        assert torch.equal(jt[k].values(), b.uih[k])
        assert torch.equal(jt[k].lengths().long(), b.uih_lengths[k])
    assert torch.equal(jt["candidates"].values(), b.candidates)
    back = batch_from_kjt(
        kjt,
        b.labels,
        sample_ids=b.sample_ids,
        step=b.step,
        timestamps=b.timestamps,
        true_probs=b.true_probs,
    )
    _assert_batches_equal(back, b)
    assert back.step == b.step
    assert all(torch.equal(back.timestamps[k], b.timestamps[k]) for k in b.keys)
    assert torch.equal(back.true_probs, b.true_probs)


@needs_torchrec
def test_kjt_subset_order_and_features() -> None:
    from freescale.integrations.torchrec import (
        batch_from_kjt,
        batch_to_kjt,
        features_to_kjt,
        kjt_to_features,
    )

    b = _batch()
    kjt = batch_to_kjt(b, keys=["candidates", "uih_item"], lengths_dtype=torch.int64)
    assert kjt.keys() == ["candidates", "uih_item"]
    feats = kjt_to_features(kjt)
    assert list(feats) == ["candidates", "uih_item"]
    assert torch.equal(feats["uih_item"][0], b.uih["uih_item"])
    assert feats["uih_item"][1].dtype == torch.int64
    # features dict -> KJT -> features dict is the identity
    again = kjt_to_features(features_to_kjt(feats))
    assert all(torch.equal(again[k][i], feats[k][i]) for k in feats for i in (0, 1))
    # default sample ids, UIH keys = everything but the candidates
    back = batch_from_kjt(kjt, b.labels)
    assert back.keys == ["uih_item"]
    assert torch.equal(back.sample_ids, torch.arange(b.batch_size))


@needs_torchrec
def test_kjt_errors() -> None:
    from freescale.integrations.torchrec import batch_from_kjt, batch_to_kjt, features_to_kjt

    b = _batch()
    with pytest.raises(KeyError, match="no feature"):
        batch_to_kjt(b, keys=["uih_item", "nope"])
    with pytest.raises(ValueError, match="different sample counts"):
        features_to_kjt(
            {
                "a": (torch.tensor([1, 2]), torch.tensor([2])),
                "b": (torch.tensor([1]), torch.tensor([1, 0])),
            }
        )
    with pytest.raises(ValueError, match="lengths sum"):
        features_to_kjt({"a": (torch.tensor([1, 2]), torch.tensor([1]))})
    kjt = batch_to_kjt(b)
    with pytest.raises(ValueError, match="labels for"):
        batch_from_kjt(kjt, b.labels[:-1])
    with pytest.raises(KeyError, match="no 'candidates'"):
        batch_from_kjt(batch_to_kjt(b, keys=["uih_item"]), b.labels)


def test_module_imports_without_torchrec() -> None:
    code = (
        "import sys\n"
        "sys.modules['torchrec'] = None\n"
        "sys.modules['fbgemm_gpu'] = None\n"
        "import freescale.integrations.torchrec as m\n"
        "from freescale.data.batch import JaggedBatch\n"
        "try:\n"
        "    m.batch_to_kjt(JaggedBatch.empty(['uih_item']))\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e) and 'torchrec' in str(e), e\n"
        "    print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
