"""Reference sequence recommendation model (SASRec/HSTU-style), replicated with DDP.

Owns the dense network: token = sum of the UIH keys' embeddings + a learned position
embedding counted from the most recent interaction; ``num_layers`` pre-norm causal
self-attention blocks over each sample's own history (jagged: samples never attend to
each other, nothing is padded to a global maximum); the user state is the output at a
sample's last position; each candidate is scored by an MLP over
``[user, candidate, user * candidate]``. The loss (models/loss.py) is a sum of
per-candidate terms, so moving samples between ranks does not change it.

Attention backends with identical semantics (tests compare them):
* ``reference``: pad to the *local* maximum length and run masked SDPA (CPU default);
* ``flex``: compiled ``flex_attention`` over the concatenated tokens with a
  document-causal block mask, token count bucketed so it does not recompile every step
  (CUDA default).

No randomness (no dropout), no batch statistics: DESIGN.md section 1 tier 2.
It may not touch embeddings or communication; it sees embedded tensors only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig

__all__ = [
    "SequenceRecModel",
    "jagged_attention",
    "flex_bucket",
    "document_causal_block_mask",
    "block_mask_tables",
    "block_mask_tables_reference",
]


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), 0, out=out[1:])
    return out


def _attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, chunk: int = 8
) -> torch.Tensor:
    """q, k, v: [T, H, dh] jagged by ``lengths`` -> [T, H, dh]; causal within samples.

    Samples are processed in groups of ``chunk`` of similar length (sorted by length,
    ties by index), each padded to its own maximum: a sample's result does not depend on
    which group it is in beyond floating-point noise of the padded GEMM shapes."""
    b = lengths.numel()
    t, h, dh = q.shape
    out = q.new_zeros(q.shape)
    if t == 0 or b == 0:
        return out
    lengths = lengths.to(torch.int64)
    offs = _offsets(lengths)
    order = torch.sort(lengths, stable=True).indices
    lens_sorted = lengths[order].tolist()
    for c0 in range(0, b, chunk):
        idx = order[c0 : c0 + chunk]
        lens = lengths[idx]
        lmax = int(lens_sorted[min(c0 + chunk, b) - 1])
        if lmax == 0:
            continue
        n = int(lens.sum())
        seg = torch.repeat_interleave(
            torch.arange(idx.numel(), device=q.device), lens, output_size=n
        )
        starts = torch.repeat_interleave(offs[:-1][idx], lens, output_size=n)
        first = torch.repeat_interleave(_offsets(lens)[:-1], lens, output_size=n)
        pos = torch.arange(n, device=q.device) - first
        src = starts + pos

        nb = idx.numel()

        def pad(x: torch.Tensor, seg=seg, pos=pos, src=src, nb=nb, lmax=lmax):
            o = x.new_zeros(nb, lmax, h, dh)
            o[seg, pos] = x[src]
            return o.transpose(1, 2)  # [b, H, L, dh]

        ar = torch.arange(lmax, device=q.device)
        valid = ar.unsqueeze(0) < lens.unsqueeze(1)  # [b, L]
        mask = (ar.unsqueeze(1) >= ar.unsqueeze(0)).unsqueeze(0) & valid.unsqueeze(1)
        mask = mask | ~valid.unsqueeze(2)  # padded queries attend to anything (discarded)
        o = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=mask.unsqueeze(1))
        out[src] = o.transpose(1, 2)[seg, pos]
    return out


_FLEX_CACHE: dict[str, object] = {}
FLEX_BLOCK = 128


def flex_bucket(n: int, quantum: int = 4 * FLEX_BLOCK) -> int:
    """Padded token count for flex attention: the next of ``{2^k, 1.5 * 2^k}`` multiples
    of ``quantum`` (few distinct shapes, so few compilations; <= 33% padding)."""
    n = max(n, 1)
    b = quantum
    while True:
        if n <= b:
            return b
        if n <= b + b // 2:
            return b + b // 2
        b *= 2


BLOCK_MASK_ENV_VAR = "FREESCALE_BLOCK_MASK"  # "reference": the PyTorch tables on CUDA too


def document_causal_block_mask(
    lengths: torch.Tensor,
    tp: int,
    block: int = FLEX_BLOCK,
    total: int | None = None,
    analytic_q: bool = True,
):
    """A flex-attention ``BlockMask`` for causal attention inside each jagged sample of
    ``lengths`` (tokens concatenated, padded to ``tp``), built directly from the sample
    boundaries in O(tp / block)^2 / 2 integers, never from a dense [tp, tp] mask.

    For query block i the key blocks with any allowed pair are ``[start(doc(first
    token of i)) / block, i]``; those whose whole span lies in the doc of the last token
    of block i and strictly before i are *full* (no mask evaluated), the rest partial.

    ``total``: ``sum(lengths)`` when the caller knows it (the token count); saves a
    device-to-host sync on CUDA. ``analytic_q`` (default): the query-side indices from
    the same bounds (`_transposed_blocks`); False: torch's generic transpose (the
    reference the tests compare with).

    The tables come from :func:`block_mask_tables`: on CUDA three launches
    (`kernels.block_mask`), elsewhere (or with ``FREESCALE_BLOCK_MASK=reference``) the
    PyTorch reference, :func:`block_mask_tables_reference`."""
    from torch.nn.attention.flex_attention import BlockMask

    t = int(lengths.sum()) if total is None else int(total)
    if analytic_q:
        docm, *kv_q = block_mask_tables(lengths, tp, t, block)
        kv, q = kv_q[:4], kv_q[4:]
    else:
        docm, *kv_q = block_mask_tables_reference(lengths, tp, t, block, with_q=False)
        kv = kv_q

    def mask_mod(bi, hi, qi, ki):  # noqa: ARG001
        return (docm[qi] == docm[ki]) & (qi >= ki)

    if not analytic_q:
        return BlockMask.from_kv_blocks(*kv, BLOCK_SIZE=block, mask_mod=mask_mod)
    try:
        return BlockMask(
            seq_lengths=(tp, tp), kv_num_blocks=kv[0], kv_indices=kv[1],
            full_kv_num_blocks=kv[2], full_kv_indices=kv[3], q_num_blocks=q[0],
            q_indices=q[1], full_q_num_blocks=q[2], full_q_indices=q[3],
            BLOCK_SIZE=(block, block), mask_mod=mask_mod,
        )  # fmt: skip
    except TypeError:  # a torch whose BlockMask takes other arguments: let it transpose
        return BlockMask.from_kv_blocks(*kv, BLOCK_SIZE=block, mask_mod=mask_mod)


def block_mask_tables(
    lengths: torch.Tensor, tp: int, total: int, block: int = FLEX_BLOCK
) -> tuple[torch.Tensor, ...]:
    """The document-causal mask's tables (see :func:`block_mask_tables_reference`): the
    Triton version on CUDA (`kernels.block_mask.block_mask_tables_triton`, 3 launches
    instead of ~90 ops), the reference elsewhere or with ``FREESCALE_BLOCK_MASK=
    reference``. Equal tensors either way (integers only); the first Triton call of a
    process is also computed by the reference and compared (:func:`_first_use_check`)."""
    if lengths.is_cuda and tp > 0 and os.environ.get(BLOCK_MASK_ENV_VAR, "auto") != "reference":
        from freescale.kernels.block_mask import TOKENS_PER_PROGRAM, block_mask_tables_triton

        if block & (block - 1) == 0 and block <= TOKENS_PER_PROGRAM and tp % block == 0:
            out = block_mask_tables_triton(lengths, tp, total, block)
            if not _BLOCK_MASK_CHECKED:
                _first_use_check(out, lengths, tp, total, block)
            return out
    return block_mask_tables_reference(lengths, tp, total, block)


_BLOCK_MASK_CHECKED: list[bool] = []  # non-empty once the first Triton call was compared
_TABLE_NAMES = ("docm", "kv_num", "kv_idx", "full_kv_num", "full_kv_idx")
_TABLE_NAMES += ("q_num", "q_idx", "full_q_num", "full_q_idx")


def _first_use_check(
    out: tuple[torch.Tensor, ...], lengths: torch.Tensor, tp: int, total: int, block: int
) -> None:
    """Compare the Triton tables with the reference once per process (one extra mask
    build and one read-back): a kernel that computes wrong tables on this GPU / Triton
    raises here, before any attention reads its mask."""
    ref = block_mask_tables_reference(lengths, tp, total, block)
    for name, x, y in zip(_TABLE_NAMES, out, ref, strict=True):
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            raise RuntimeError(
                f"block mask: the Triton table {name!r} differs from the reference "
                f"({lengths.numel()} samples, {total} tokens padded to {tp}); set "
                f"{BLOCK_MASK_ENV_VAR}=reference to train with the PyTorch tables"
            )
    _BLOCK_MASK_CHECKED.append(True)


def block_mask_tables_reference(
    lengths: torch.Tensor, tp: int, total: int, block: int = FLEX_BLOCK, with_q: bool = True
) -> tuple[torch.Tensor, ...]:
    """The plain PyTorch tables of the document-causal block mask (the semantics the
    Triton version matches): ``docm`` [tp] int64 (the sample of each token, ``-1 - k``
    for the k-th padding token), then kv_num [1, 1, nb], kv_idx [1, 1, nb, nb], full
    kv_num, full kv_idx and, with ``with_q``, the query side in the same four forms
    (`_transposed_blocks`), all int32; ``nb = tp // block``, ``total = sum(lengths)``."""
    dev = lengths.device
    lengths = lengths.to(torch.int64)
    t = int(total)
    nb = tp // block
    doc = torch.full((tp,), -1, dtype=torch.int64, device=dev)
    start_of = torch.arange(tp, dtype=torch.int64, device=dev)  # padding: own "doc"
    if t:
        b = lengths.numel()
        doc[:t] = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=t)
        offs = torch.zeros(b + 1, dtype=torch.int64, device=dev)
        torch.cumsum(lengths, 0, out=offs[1:])
        start_of[:t] = offs[:-1][doc[:t]]
    i = torch.arange(nb, device=dev)
    first_start = start_of[i * block]  # doc start of the block's first token
    last_start = start_of[i * block + block - 1]  # doc start of the block's last token
    pstart = first_start // block
    fstart = torch.minimum((last_start + block - 1) // block, i)  # first full kv block
    # partial blocks: [pstart, fstart) then i; full blocks: [fstart, i)
    ar = torch.arange(nb, device=dev).unsqueeze(0)
    n_part = fstart - pstart + 1
    part_idx = pstart.unsqueeze(1) + ar
    part_idx = torch.where(ar == (n_part - 1).unsqueeze(1), i.unsqueeze(1), part_idx)
    n_full = i - fstart
    full_idx = fstart.unsqueeze(1) + ar
    clamp = nb - 1
    part_idx = part_idx.clamp(max=clamp).to(torch.int32)
    full_idx = full_idx.clamp(max=clamp).to(torch.int32)
    docm = doc.clone()
    docm[t:] = -1 - torch.arange(tp - t, device=dev)  # padding attends only to itself
    kv = (
        n_part.to(torch.int32).view(1, 1, nb),
        part_idx.view(1, 1, nb, nb),
        n_full.to(torch.int32).view(1, 1, nb),
        full_idx.view(1, 1, nb, nb),
    )
    if not with_q:
        return (docm, *kv)
    return (docm, *kv, *_transposed_blocks(pstart, fstart))


def _transposed_blocks(
    pstart: torch.Tensor, fstart: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q side of the document-causal block mask (for each kv block c: the query
    blocks that read it, partial and full), computed from the two monotone bounds
    instead of torch's generic transpose (a dense [nb, nb + 1] matrix built under two
    vmaps, then a stable argsort per row: milliseconds of host time per step).

    Query block i reads kv blocks [pstart[i], fstart[i]) and i partially and
    [fstart[i], i) fully; pstart and fstart are non-decreasing and fstart[i] <= i. So
    kv block c is read partially by c itself and by the contiguous range
    [a, b] = [first i with fstart[i] > c, last i with pstart[i] <= c] (all > c), and
    fully by (c, a). Each row lists its readers ascending, then the other blocks
    ascending — exactly what ``BlockMask.from_kv_blocks`` produces (tests compare)."""
    nb = pstart.numel()
    dev = pstart.device
    c = torch.arange(nb, device=dev)
    a = torch.searchsorted(fstart.contiguous(), c, right=True)  # first i: fstart[i] > c
    b = torch.searchsorted(pstart.contiguous(), c, right=True) - 1  # last i: pstart[i] <= c
    r = (b - a + 1).clamp(min=0)  # partial readers besides c itself
    j = torch.arange(nb, device=dev).unsqueeze(0)  # position in the row
    cc, aa, rr = c.unsqueeze(1), a.unsqueeze(1), r.unsqueeze(1)
    # partial: [c, a .. b], then the rest ascending: [0, c), (c, a'), (b', nb)
    a2 = torch.where(rr > 0, aa, nb)
    b2 = torch.where(rr > 0, b.unsqueeze(1), nb - 1)
    k = j - 1 - rr  # index into the rest
    second = a2 - 1 - cc  # length of (c, a')
    rest = torch.where(
        k < cc, k, torch.where(k - cc < second, cc + 1 + (k - cc), b2 + 1 + (k - cc - second))
    )
    part = torch.where(j == 0, cc, torch.where(j <= rr, aa + j - 1, rest))
    # full: (c, a) ascending, then the rest ascending: [0, c] and [a, nb)
    rf = aa - 1 - cc
    k = j - rf
    full = torch.where(j < rf, cc + 1 + j, torch.where(k <= cc, k, aa + (k - cc - 1)))
    return (
        (1 + r).to(torch.int32).view(1, 1, nb),
        part.to(torch.int32).view(1, 1, nb, nb),
        rf.squeeze(1).to(torch.int32).view(1, 1, nb),
        full.to(torch.int32).view(1, 1, nb, nb),
    )


def _attention_flex(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX_CACHE:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        # dynamic shapes: one compilation serves every token count (measured on H200:
        # same step time as static shapes, no recompilation when the bucket changes)
        dynamic = os.environ.get("FREESCALE_FLEX_DYNAMIC", "1") == "1"
        _FLEX_CACHE["dynamic"] = dynamic
        _FLEX_CACHE["fn"] = torch.compile(flex_attention, dynamic=dynamic)
    fn = _FLEX_CACHE["fn"]
    t, h, dh = q.shape
    if t == 0:
        return q.new_zeros(q.shape)
    tp = -(-t // FLEX_BLOCK) * FLEX_BLOCK if _FLEX_CACHE["dynamic"] else flex_bucket(t)
    # every layer of one forward passes the same `lengths` tensor: build its mask once
    # (t = q.shape[0] is sum(lengths): no device sync)
    last = _FLEX_CACHE.get("mask")
    if last is not None and last[0] is lengths and last[1] == tp:
        block_mask = last[2]
    else:
        block_mask = document_causal_block_mask(lengths, tp, total=t)
        _FLEX_CACHE["mask"] = (lengths, tp, block_mask)

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(tp, h, dh)
        out[:t] = x
        return out.transpose(0, 1).unsqueeze(0)  # [1, H, Tp, dh]

    o = fn(pad(q), pad(k), pad(v), block_mask=block_mask)
    return o[0].transpose(0, 1)[:t]


def jagged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, backend: str
) -> torch.Tensor:
    """Causal self-attention within each jagged sample. ``backend``: reference | flex."""
    if backend == "flex":
        return _attention_flex(q, k, v, lengths)
    if backend in ("reference", "sdpa"):
        return _attention_reference(q, k, v, lengths)
    raise ValueError(f"unknown attention backend '{backend}' (reference, sdpa, flex)")


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, ffn_mult: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"embedding_dim {d} is not divisible by num_heads {heads}")
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        # no key bias: softmax ignores it (its true gradient is exactly zero), and Adam
        # would turn the rounding noise in that gradient into lr-sized updates
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(d))
        self.v_bias = nn.Parameter(torch.zeros(d))
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, ffn_mult * d), nn.GELU(), nn.Linear(ffn_mult * d, d))

    def forward(
        self, x: torch.Tensor, lengths: torch.Tensor, backend: str, attn_dtype: torch.dtype
    ) -> torch.Tensor:
        t, d = x.shape
        bias = torch.cat([self.q_bias, self.q_bias.new_zeros(d), self.v_bias])
        qkv = (self.qkv(self.norm1(x)) + bias).view(t, 3, self.heads, d // self.heads)
        qkv = qkv.to(attn_dtype)
        a = jagged_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], lengths, backend).to(x.dtype)
        x = x + self.proj(a.reshape(t, d))
        return x + self.ffn(self.norm2(x))


class SequenceRecModel(nn.Module):
    """Dense part of the reference model. ``forward`` takes embedded jagged inputs and
    returns one logit per candidate."""

    def __init__(self, cfg: ModelConfig, uih_keys: Sequence[str], dim: int | None = None):
        super().__init__()
        d = dim or cfg.embedding_dim
        self.cfg = cfg
        self.uih_keys = list(uih_keys)
        self.pos = nn.Embedding(cfg.max_positions, d)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(
            [_Block(d, cfg.num_heads, cfg.ffn_mult) for _ in range(cfg.num_layers)]
        )
        self.norm = nn.LayerNorm(d)
        self.score = nn.Sequential(nn.Linear(3 * d, 2 * d), nn.GELU(), nn.Linear(2 * d, 1))

    def attention_backend(self, device: torch.device) -> str:
        b = self.cfg.attention
        if b == "auto":
            return "flex" if device.type == "cuda" else "reference"
        return b

    def forward(
        self,
        uih: Mapping[str, torch.Tensor],
        lengths: torch.Tensor,
        candidates: torch.Tensor,
        num_candidates: torch.Tensor,
    ) -> torch.Tensor:
        x = None
        for k in self.uih_keys:
            x = uih[k] if x is None else x + uih[k]
        assert x is not None
        t = x.shape[0]
        b = lengths.numel()
        lengths = lengths.to(torch.int64)
        offs = _offsets(lengths)
        seg = torch.repeat_interleave(torch.arange(b, device=x.device), lengths, output_size=t)
        # position from the end: the most recent interaction is 0
        rev = offs[1:][seg] - 1 - torch.arange(t, device=x.device)
        x = x + self.pos(rev.clamp(max=self.cfg.max_positions - 1))
        backend = self.attention_backend(x.device)
        ad = self.cfg.attention_dtype
        if ad == "auto":
            attn_dtype = torch.bfloat16 if backend == "flex" and x.is_cuda else x.dtype
        else:
            attn_dtype = torch.bfloat16 if ad == "bfloat16" else torch.float32
        for blk in self.blocks:
            x = blk(x, lengths, backend, attn_dtype)
        x = self.norm(x)
        # user state = last position of each sample (zeros for an empty history)
        last = (offs[1:] - 1).clamp(min=0)
        user = x[last] if t > 0 else x.new_zeros(b, x.shape[1])
        user = torch.where((lengths > 0).unsqueeze(1), user, torch.zeros_like(user))
        cand_seg = torch.repeat_interleave(
            torch.arange(b, device=x.device),
            num_candidates.to(torch.int64),
            output_size=candidates.shape[0],
        )
        u = user[cand_seg]
        feats = torch.cat([u, candidates, u * candidates], dim=1)
        logits = self.score(feats).squeeze(1)
        if t == 0:  # keep every parameter in the graph for DDP (empty local batch)
            logits = logits + 0.0 * sum(p.sum() for p in self.parameters())
        return logits


def sum_bce_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum over candidates of binary cross-entropy with logits (no mean: callers divide
    by the *global* candidate count, DESIGN.md section 1)."""
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="sum")
