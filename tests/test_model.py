"""Reference model: jagged attention backends against a per-sample brute force, the
document-causal block mask against torch's dense construction, empty batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from freescale.config import ModelConfig
from freescale.models.sequence import (
    SequenceRecModel,
    _attention_reference,
    document_causal_block_mask,
    flex_bucket,
    jagged_attention,
)


def _brute(q, k, v, lengths):
    out = torch.empty_like(q)
    off = 0
    for n in lengths.tolist():
        if n:
            qq, kk, vv = (x[off : off + n].transpose(0, 1) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True)
            out[off : off + n] = o.transpose(0, 1)
        off += n
    return out


def _lengths(g: torch.Generator, b: int, hi: int) -> torch.Tensor:
    lengths = torch.randint(0, hi, (b,), generator=g)
    lengths[0] = 1
    return lengths


def test_reference_attention_matches_per_sample_sdpa():
    seed = random.randrange(1 << 30)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    lengths = _lengths(g, 19, 150)  # includes empty samples
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = _brute(q, k, v, lengths)
    for chunk in (1, 4, 64):
        out = _attention_reference(q, k, v, lengths, chunk=chunk)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


def test_block_mask_covers_exactly_the_dense_document_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    lengths = torch.cat([_lengths(g, 23, 400), torch.tensor([128, 256, 1])])
    t = int(lengths.sum())
    tp = flex_bucket(t)
    assert tp >= t and tp % 128 == 0
    bm = document_causal_block_mask(lengths, tp)
    doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    docp = torch.cat([doc, -1 - torch.arange(tp - t)])

    def mm(b, h, qi, ki):
        return (docp[qi] == docp[ki]) & (qi >= ki)

    ref = create_block_mask(mm, None, None, tp, tp, device="cpu")
    assert torch.equal(bm.to_dense(), ref.to_dense())
    # full blocks really are fully allowed: check each against the dense mask
    dense = (docp.unsqueeze(1) == docp.unsqueeze(0)) & (
        torch.arange(tp).unsqueeze(1) >= torch.arange(tp).unsqueeze(0)
    )
    nb = tp // 128
    for i in range(nb):
        n = int(bm.full_kv_num_blocks[0, 0, i])
        for j in bm.full_kv_indices[0, 0, i, :n].tolist():
            assert bool(dense[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].all())


def test_block_mask_query_side_equals_torch_transpose():
    """The analytic query-side indices (`_transposed_blocks`) equal torch's generic
    transpose in ``BlockMask.from_kv_blocks``: every tensor of the mask, bit for bit,
    on fresh random jagged lengths (empty samples, block-sized ones, padding blocks)."""
    seed = random.randrange(1 << 30)
    print("seed", seed)
    g = torch.Generator().manual_seed(seed)
    for trial in range(12):
        lengths = _lengths(g, int(torch.randint(1, 30, (1,), generator=g)), 700)
        if trial % 3 == 0:
            lengths = torch.cat([lengths, torch.tensor([128, 256, 1, 0, 127, 129])])
        t = int(lengths.sum())
        tp = flex_bucket(t) if trial % 2 else -(-max(t, 1) // 128) * 128 + 128 * (trial % 3)
        fast = document_causal_block_mask(lengths, tp)
        ref = document_causal_block_mask(lengths, tp, analytic_q=False)
        for x, y in zip(fast.as_tuple(), ref.as_tuple()):
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), trial
            elif not callable(x):
                assert x == y, trial
        assert fast.q_indices is not None and fast.full_q_indices is not None


def test_flex_attention_matches_reference():
    """Compiled flex attention (inductor on CPU) with our block mask."""
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    lengths = torch.cat([_lengths(g, 9, 300), torch.tensor([129])])
    t = int(lengths.sum())
    q, k, v = (torch.randn(t, 2, 16, generator=g) for _ in range(3))
    out = jagged_attention(q, k, v, lengths, "flex")
    ref = _attention_reference(q, k, v, lengths)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    # the block mask is built once per forward (every layer passes the same `lengths`)
    from freescale.models.sequence import _FLEX_CACHE

    mask = _FLEX_CACHE["mask"][2]
    jagged_attention(q, k, v, lengths, "flex")
    assert _FLEX_CACHE["mask"][2] is mask
    # ... and never reused for other lengths, even with the same token count
    other = lengths.flip(0).clone()
    out2 = jagged_attention(q, k, v, other, "flex")
    assert _FLEX_CACHE["mask"][2] is not mask
    torch.testing.assert_close(out2, _attention_reference(q, k, v, other), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("b", [0, 3])
def test_model_handles_empty_and_small_batches(b):
    cfg = ModelConfig(embedding_dim=8, num_layers=1, num_heads=2, max_positions=32)
    m = SequenceRecModel(cfg, ["a", "b"])
    lengths = torch.tensor([3, 0, 5][:b], dtype=torch.int64)
    t = int(lengths.sum())
    nc = torch.full((b,), 2, dtype=torch.int64)
    x = {k: torch.randn(t, 8, requires_grad=True) for k in ("a", "b")}
    cand = torch.randn(2 * b, 8, requires_grad=True)
    logits = m(x, lengths, cand, nc)
    assert logits.shape == (2 * b,)
    logits.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
