"""Synthetic skewed-UIH data with a known ground truth.

Owns :class:`SyntheticSource`: it generates jagged batches (two aligned UIH features,
``uih_item`` and ``uih_action``, optional timestamps, candidates, labels and the true
click probabilities) and the helpers built on them (:func:`normalized_entropy`,
:func:`oracle_ne`). It may not touch ranks, devices, tables or the model: ``rank`` and
``world_size`` only choose *which* samples to generate, never *what* they contain.

Determinism (the contract of DESIGN.md section 1): every value of sample ``g`` of step
``t`` is a pure function of ``(cfg.seed, split, t, g)`` and of the other ``DataConfig``
fields, never of rank, world size, or of which other samples are generated in the same
call. Randomness is counter based: a SplitMix64 finaliser (a bijective 64-bit mixer)
keyed by ``(seed, split, stream, step, sample id)`` gives one 64-bit state per sample
and stream, and draw ``k`` of that stream is ``mix(state + (k+1) * golden)`` (the
SplitMix64 generator). All draws are vectorised over the tokens of the whole batch;
there is no Python loop over samples. So ``JaggedBatch.concat`` of the local batches
of all ranks is bitwise equal to the global batch, for any world size.

The generative model (the constants below are module level and documented):

* UIH length: log-normal (median ``median_uih``, shape ``sigma``) or Pareto (tail index
  ``powerlaw_alpha``, scaled so its median is ``median_uih``), rounded and clipped to
  ``[min_uih, max_uih]``.
* Items: Zipf popularity (exponent ``zipf_s``) over popularity ranks; ranks map to item
  ids through a fixed seeded permutation, so popular items spread over row-wise
  shards. Sampling is inverse CDF: :func:`zipf_ranks_reference` is the plain
  ``searchsorted`` reference; :meth:`SyntheticSource.zipf_ranks` adds a guide table
  (bucket of the uniform -> range of candidate ranks) and searches only the few
  uniforms whose bucket straddles a CDF step; both give identical ranks.
* Actions: ``P(a) ∝ ACTION_DECAY**a`` (views common, strong actions rare), drawn from
  the low 11 bits of the same 64-bit draw as the item.
* Candidates: ``num_candidates`` per sample, each popular (Zipf) or uniformly random
  with probability 1/2.
* Labels: hidden model with item latents ``v_i ~ N(0, I_latent_dim)`` and biases
  ``b_i`` that grow with popularity. The user vector ``u`` is the mean of ``v`` over
  the most recent ``USER_WINDOW`` UIH items weighted by recency
  (``2 ** (-age / RECENCY_HALF_LIFE)``) and action (``1 + a``), rescaled to RMS ``USER_RMS``
  per dimension; ``p = sigmoid(label_temperature * <u, v_c> / sqrt(latent_dim) + b_c)``
  and ``label ~ Bernoulli(p)``. ``true_probs`` holds ``p`` (float64).
* Collision injection (``overlap`` in ``[0, 1)``): at step ``t >= 1`` exactly
  ``floor(overlap * L)`` positions of sample ``g`` (evenly spread over the sequence)
  hold an (item, action) pair copied from a freshly drawn position of sample ``g`` at
  step ``t - 1``; the copy source is recomputed from the counters of step ``t - 1``, so
  the result is still a pure function of ``(seed, split, t, g)``. The copied share of
  sample ``g``'s ids is therefore ``floor(overlap * L) / L``; natural Zipf collisions
  come on top.

Caveat: lengths and labels use ``exp``/``log``/``cos`` of numpy; item ids use integer
operations and comparisons only. Machines whose libm differ in the last ulp could in
rare cases round a length differently; ranks of one job should share a software stack.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from freescale.config import CANDIDATE_FEATURE, DataConfig
from freescale.data.batch import JaggedBatch

__all__ = [
    "GlobalBatchSource",
    "SyntheticSource",
    "SPLITS",
    "local_range",
    "normalized_entropy",
    "oracle_ne",
    "zipf_ranks_reference",
]

#: split name -> split id in the counters (different streams per split)
SPLITS: dict[str, int] = {"train": 0, "eval": 1}

# ---- generative-model constants (part of the data definition: changing one changes data)
RECENCY_HALF_LIFE = 16.0  # positions; weight of an item ``age`` positions back
USER_WINDOW = 256  # only the most recent items shape the user vector
ACTION_DECAY = 0.5  # P(action a) ∝ ACTION_DECAY ** a
BIAS_LOW = -2.5  # item bias of the least popular rank ...
BIAS_HIGH = 0.0  # ... and of the most popular one (linear in log rank)
BIAS_NOISE = 0.5  # std of the per-item bias noise
USER_RMS = 0.4  # RMS per dimension of the user vector u
POPULAR_CANDIDATE_SHARE = 0.5
TIME_START = 1_600_000_000  # seconds; start of step 0
TIME_PER_STEP = 86_400  # one simulated day per step
MEAN_GAP_S = 300.0  # mean gap between consecutive interactions of a sample
_GUIDE_MAX_BITS = 22  # guide table has at most 2**22 buckets (16 MiB of int32)

# ---- counter-based hashing (SplitMix64)
_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_M1 = _U64(0xBF58476D1CE4E5B9)
_M2 = _U64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = _U64(30), _U64(27), _U64(31), _U64(11)
_LOW11 = _U64(0x7FF)
_INV53 = 2.0**-53
_MASK64 = (1 << 64) - 1
_STREAMS = {"length": 1, "item": 2, "copy": 3, "time": 4, "cand": 5, "label": 6}


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (bijective; wraps modulo 2**64)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
        return z ^ (z >> _S31)


def _key(*parts: int) -> np.ndarray:
    """One uint64 key (0-d array) from a tuple of integers."""
    h = np.array(0x243F6A8885A308D3, dtype=np.uint64)
    for p in parts:
        with np.errstate(over="ignore"):
            h = _mix(h + np.array((int(p) + 1) & _MASK64, dtype=np.uint64) * _GOLDEN)
    return h


def _draws(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Draw number ``counters[i]`` of the stream with state ``keys[i]`` (uint64)."""
    with np.errstate(over="ignore"):
        return _mix(keys + (counters.astype(np.uint64) + _U64(1)) * _GOLDEN)


def _uniform(y: np.ndarray) -> np.ndarray:
    """Top 53 bits of uint64 draws -> float64 uniforms in [0, 1)."""
    return (y >> _S11).astype(np.float64) * _INV53


def zipf_ranks_reference(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Plain inverse CDF: rank ``r`` such that ``cdf[r-1] <= u < cdf[r]`` (int64)."""
    return np.searchsorted(cdf, u, side="right").astype(np.int64)


def normalized_entropy(
    probs: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor
) -> float:
    """NE = mean binary cross entropy / entropy of the mean label (torchrec.metrics NE,
    with its clamping ``eta = 1e-12``). Returns ``nan`` for an empty input."""
    p = torch.as_tensor(probs).double().flatten().clamp(1e-12, 1 - 1e-12)
    y = torch.as_tensor(labels).double().flatten()
    if y.numel() == 0:
        return float("nan")
    ce = -(y * torch.log(p) + (1 - y) * torch.log1p(-p)).sum()
    mean = (y.sum() / y.numel()).clamp(1e-12, 1 - 1e-12)
    norm = -(y.sum() * torch.log(mean) + (y.numel() - y.sum()) * torch.log1p(-mean))
    return float(ce / norm)


def oracle_ne(batches: Iterable[JaggedBatch]) -> float:
    """NE of the ground-truth probabilities on the labels of ``batches`` (pooled).

    This is the best NE any model can reach in expectation on this data."""
    probs, labels = [], []
    for b in batches:
        if b.true_probs is None:
            raise ValueError(f"{b!r} has no true_probs (only synthetic batches do)")
        probs.append(b.true_probs.detach().cpu().double())
        labels.append(b.labels.detach().cpu().double())
    if not probs:
        raise ValueError("oracle_ne needs at least one batch")
    return normalized_entropy(torch.cat(probs), torch.cat(labels))


class GlobalBatchSource(abc.ABC):
    """What every data source derives from ``samples(step, ids, split)`` and
    ``cfg.global_batch_size``: rank ``r``'s contiguous slice of a global batch whose
    content depends on (seed, step, global sample id) only, and the held-out batches."""

    cfg: DataConfig

    @abc.abstractmethod
    def samples(
        self, step: int, sample_ids: torch.Tensor | np.ndarray, split: str = "train"
    ) -> JaggedBatch:
        """Samples ``sample_ids`` (global ids, in this order) of ``step``."""

    def local_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """Global sample ids ``[start, stop)`` of ``rank`` under contiguous placement."""
        return local_range(self.cfg.global_batch_size, rank, world_size)

    def local_batch(
        self, step: int, rank: int, world_size: int, split: str = "train"
    ) -> JaggedBatch:
        """Rank ``rank``'s contiguous slice of the global batch; only its own samples
        are generated."""
        start, stop = self.local_range(rank, world_size)
        return self.samples(step, np.arange(start, stop, dtype=np.int64), split)

    def num_eval_batches(self, num_samples: int | None = None) -> int:
        n = self.cfg.eval_samples if num_samples is None else num_samples
        return -(-n // self.cfg.global_batch_size)

    def eval_batches(
        self, num_samples: int | None = None, rank: int = 0, world_size: int = 1
    ) -> Iterator[JaggedBatch]:
        """Held-out local batches (split ``"eval"``, steps ``0, 1, ...``) covering at
        least ``num_samples`` (default ``cfg.eval_samples``) samples, rounded up to
        whole global batches. Same samples for any world size."""
        for s in range(self.num_eval_batches(num_samples)):
            yield self.local_batch(s, rank, world_size, split="eval")


class SyntheticSource(GlobalBatchSource):
    """Deterministic synthetic batches; see the module docstring for the model.

    ``with_timestamps`` adds increasing per-sample timestamps (int64 seconds, one
    tensor shared by both UIH keys: they are aligned).
    """

    uih_keys: list[str] = ["uih_item", "uih_action"]

    def __init__(self, cfg: DataConfig, *, with_timestamps: bool = False) -> None:
        if not 0.0 <= cfg.overlap < 1.0:
            raise ValueError(f"overlap must be in [0, 1), got {cfg.overlap}")
        if cfg.num_items <= 0 or cfg.num_actions <= 0:
            raise ValueError("num_items and num_actions must be > 0")
        if cfg.length_dist not in ("lognormal", "powerlaw"):
            raise ValueError(f"unknown length_dist '{cfg.length_dist}' (lognormal, powerlaw)")
        if cfg.latent_dim <= 0:
            raise ValueError("latent_dim must be > 0")
        self.cfg = cfg
        self.with_timestamps = with_timestamps
        self.uih_keys = list(type(self).uih_keys)
        n = cfg.num_items
        seed = int(cfg.seed) & _MASK64
        self._seed = seed

        # popularity: rank -> item id permutation and the Zipf CDF over ranks
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0xA11CE])))
        self.rank_to_item = rng.permutation(n).astype(np.int64)
        self.item_to_rank = np.empty(n, dtype=np.int64)
        self.item_to_rank[self.rank_to_item] = np.arange(n, dtype=np.int64)
        w = np.arange(1, n + 1, dtype=np.float64) ** (-float(cfg.zipf_s))
        cdf = np.cumsum(w)
        cdf /= cdf[-1]
        cdf[-1] = 1.0  # u < 1 always lands on a valid rank
        self.zipf_cdf = cdf
        self.zipf_pmf = w / w.sum()
        bits = min(_GUIDE_MAX_BITS, max(8, int(math.ceil(math.log2(16 * n)))))
        self._guide_shift = _U64(64 - bits)
        grid = np.arange((1 << bits) + 1, dtype=np.float64) / float(1 << bits)
        self._guide = np.searchsorted(cdf, grid, side="right").astype(np.int32)

        # actions: a 2048-entry lookup table over the low 11 bits of an item draw
        pa = ACTION_DECAY ** np.arange(cfg.num_actions, dtype=np.float64)
        acdf = np.cumsum(pa / pa.sum())
        acdf[-1] = 1.0
        self._action_lut = np.searchsorted(acdf, (np.arange(2048) + 0.5) / 2048, side="right")
        self._action_lut = self._action_lut.astype(np.int64)
        self.action_weight = 1.0 + np.arange(cfg.num_actions, dtype=np.float64)

        # hidden ground truth, per item id
        lat = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0x1A7E])))
        self.latents = lat.standard_normal((n, cfg.latent_dim), dtype=np.float32)
        log_rank = np.log1p(self.item_to_rank.astype(np.float64))
        pop = 1.0 - log_rank / math.log(max(n, 2))  # 1 for the top rank, ~0 for the tail
        noise = lat.standard_normal(n)
        self.bias = BIAS_LOW + (BIAS_HIGH - BIAS_LOW) * pop + BIAS_NOISE * noise

        # per (split, stream) base keys
        self._base = {
            (sp, st): _key(seed, sid, sv)
            for sp, sid in SPLITS.items()
            for st, sv in _STREAMS.items()
        }

    # ------------------------------------------------------------------ sizes
    @property
    def num_items(self) -> int:
        return self.cfg.num_items

    @property
    def num_actions(self) -> int:
        return self.cfg.num_actions

    def feature_rows(self) -> dict[str, int]:
        """Feature -> rows of its table (what :func:`validate_batch` checks against)."""
        return {
            "uih_item": self.num_items,
            "uih_action": self.num_actions,
            CANDIDATE_FEATURE: self.num_items,
        }

    # ------------------------------------------------------------------ keys
    def _sample_keys(self, split: str, stream: str, step: int, g: np.ndarray) -> np.ndarray:
        """Per-sample uint64 state of one stream at one step."""
        with np.errstate(over="ignore"):
            h = _mix(self._base[(split, stream)] + _U64((step + 1) & _MASK64) * _GOLDEN)
            return _mix(h + (g.astype(np.uint64) + _U64(1)) * _GOLDEN)

    def lengths(self, step: int, g: np.ndarray, split: str = "train") -> np.ndarray:
        """UIH length of samples ``g`` at ``step`` (int64), without generating ids."""
        cfg = self.cfg
        k = self._sample_keys(split, "length", step, g)
        zero = np.zeros_like(g, dtype=np.uint64)
        u1 = _uniform(_draws(k, zero))
        if cfg.length_dist == "lognormal":
            u2 = _uniform(_draws(k, zero + _U64(1)))
            z = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
            x = cfg.median_uih * np.exp(cfg.sigma * z)
        else:  # Pareto(alpha) scaled so that its median is median_uih
            xm = cfg.median_uih / 2.0 ** (1.0 / cfg.powerlaw_alpha)
            x = xm * (1.0 - u1) ** (-1.0 / cfg.powerlaw_alpha)
        x = np.clip(np.floor(x + 0.5), cfg.min_uih, cfg.max_uih)
        return x.astype(np.int64)

    # ------------------------------------------------------------------ sampling
    def zipf_ranks(self, y: np.ndarray) -> np.ndarray:
        """Popularity ranks of uint64 draws ``y`` (fast path of
        :func:`zipf_ranks_reference` applied to ``_uniform(y)``; identical output)."""
        b = (y >> self._guide_shift).astype(np.int64)
        lo = self._guide[b]
        hi = self._guide[b + 1]
        out = lo.astype(np.int64)
        amb = np.flatnonzero(lo != hi)
        if amb.size:
            # u lies in bucket b = [b, b+1) / 2**bits, so its rank is in [lo, hi]: a
            # binary search bounded to that range (a few steps, where the bucket holds
            # few ranks) instead of one over the whole CDF — ~25 cache-missing steps per
            # draw at 20M items, the loader's bottleneck there
            u = _uniform(y[amb])
            lo_a, hi_a = out[amb], hi[amb].astype(np.int64)
            cdf = self.zipf_cdf
            for _ in range(int(hi_a.max() - lo_a.min()).bit_length() + 1):
                act = np.flatnonzero(lo_a < hi_a)
                if not act.size:
                    break
                la, ha = lo_a[act], hi_a[act]
                mid = (la + ha) >> 1
                right = cdf[mid] <= u[act]  # searchsorted(side="right"): go past ties
                lo_a[act] = np.where(right, mid + 1, la)
                hi_a[act] = np.where(right, ha, mid)
            out[amb] = lo_a
        return out

    def _items_actions(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        items = self.rank_to_item[self.zipf_ranks(y)]
        actions = self._action_lut[(y & _LOW11).astype(np.int64)]
        return items, actions

    def samples(
        self, step: int, sample_ids: torch.Tensor | np.ndarray, split: str = "train"
    ) -> JaggedBatch:
        """Samples ``sample_ids`` (global ids, in this order) of ``step``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}' (one of {sorted(SPLITS)})")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        cfg = self.cfg
        g = np.asarray(torch.as_tensor(sample_ids, dtype=torch.int64).cpu().numpy(), np.int64)
        if g.size and g.min() < 0:
            raise ValueError("sample ids must be >= 0")
        B = g.size
        L = self.lengths(step, g, split)
        offs = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(L, out=offs[1:])
        N = int(offs[-1])
        seg = np.repeat(np.arange(B, dtype=np.int64), L)
        pos = np.arange(N, dtype=np.int64) - offs[:-1][seg]

        # ---- UIH items and actions (fresh draws, or copies from step - 1)
        item_key = self._sample_keys(split, "item", step, g)
        ov = float(cfg.overlap) if step >= 1 else 0.0
        if ov > 0.0:
            posf = pos.astype(np.float64)
            before = np.floor(posf * ov)  # copied positions before this one
            copied = np.floor((posf + 1.0) * ov) > before
            before = before.astype(np.int64)
            counter = pos - before  # fresh index (overwritten below for copies)
            keys = item_key[seg]
            ci = np.flatnonzero(copied)
            if ci.size:
                L_prev = self.lengths(step - 1, g, split)
                ov_prev = ov if step - 1 >= 1 else 0.0
                fresh_prev = L_prev - np.floor(L_prev * ov_prev).astype(np.int64)
                copy_key = self._sample_keys(split, "copy", step, g)
                s = seg[ci]
                uc = _uniform(_draws(copy_key[s], before[ci]))
                counter[ci] = np.minimum(
                    np.floor(uc * fresh_prev[s]).astype(np.int64), fresh_prev[s] - 1
                )
                keys[ci] = self._sample_keys(split, "item", step - 1, g)[s]
            y = _draws(keys, counter)
        else:
            y = _draws(item_key[seg], pos)
        items, actions = self._items_actions(y)

        # ---- candidates and labels
        C = int(cfg.num_candidates)
        cseg = np.repeat(np.arange(B, dtype=np.int64), C)
        cpos = np.tile(np.arange(C, dtype=np.int64), B)
        cy = _draws(self._sample_keys(split, "cand", step, g)[cseg], cpos)
        popular = _uniform(_draws(self._sample_keys(split, "cand", step, g)[cseg], cpos + C))
        popular = popular < POPULAR_CANDIDATE_SHARE
        cands = np.floor(_uniform(cy) * cfg.num_items).astype(np.int64)
        if popular.any():
            pi = np.flatnonzero(popular)
            cands[pi] = self.rank_to_item[self.zipf_ranks(cy[pi])]
        probs = self._true_probs(items, actions, L, offs, cands, cseg)
        ul = _uniform(_draws(self._sample_keys(split, "label", step, g)[cseg], cpos))
        labels = (ul < probs).astype(np.float32)

        t_items = torch.from_numpy(items)
        t_len = torch.from_numpy(L)
        timestamps = None
        if self.with_timestamps:
            ts = self._timestamps(split, step, g, seg, pos, offs)
            timestamps = {k: ts for k in self.uih_keys}
        return JaggedBatch(
            sample_ids=torch.from_numpy(g.copy()),
            uih={"uih_item": t_items, "uih_action": torch.from_numpy(actions)},
            uih_lengths={"uih_item": t_len, "uih_action": t_len.clone()},
            candidates=torch.from_numpy(cands),
            num_candidates=torch.full((B,), C, dtype=torch.int64),
            labels=torch.from_numpy(labels),
            timestamps=timestamps,
            true_probs=torch.from_numpy(probs),
            step=step,
        )

    def _true_probs(
        self,
        items: np.ndarray,
        actions: np.ndarray,
        L: np.ndarray,
        offs: np.ndarray,
        cands: np.ndarray,
        cseg: np.ndarray,
    ) -> np.ndarray:
        """Ground-truth click probability of every candidate (float64)."""
        B = L.size
        d = self.cfg.latent_dim
        if cands.size == 0:
            return np.zeros(0, dtype=np.float64)
        wl = np.minimum(L, USER_WINDOW)
        woffs = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(wl, out=woffs[1:])
        wseg = np.repeat(np.arange(B, dtype=np.int64), wl)
        wpos = np.arange(int(woffs[-1]), dtype=np.int64) - woffs[:-1][wseg]
        age = (wl[wseg] - 1 - wpos).astype(np.float64)
        tok = offs[1:][wseg] - wl[wseg] + wpos
        w = np.exp2(-age / RECENCY_HALF_LIFE) * self.action_weight[actions[tok]]
        m = np.zeros((B, d), dtype=np.float64)
        v = self.latents[items[tok]].astype(np.float64) * w[:, None]
        if v.shape[0]:
            nz = wl > 0
            m[nz] = np.add.reduceat(v, woffs[:-1][nz], axis=0)
        rms = np.sqrt((m * m).sum(axis=1) / d)
        u = m * (USER_RMS / np.where(rms > 0, rms, 1.0))[:, None]
        vc = self.latents[cands].astype(np.float64)
        score = (u[cseg] * vc).sum(axis=1) / math.sqrt(d)
        logit = self.cfg.label_temperature * score + self.bias[cands]
        return 1.0 / (1.0 + np.exp(-logit))

    def _timestamps(
        self,
        split: str,
        step: int,
        g: np.ndarray,
        seg: np.ndarray,
        pos: np.ndarray,
        offs: np.ndarray,
    ) -> torch.Tensor:
        k = self._sample_keys(split, "time", step, g)
        start = TIME_START + step * TIME_PER_STEP
        start = start + np.floor(_uniform(_draws(k, np.zeros_like(g))) * TIME_PER_STEP)
        gaps = 1.0 + np.floor(-MEAN_GAP_S * np.log1p(-_uniform(_draws(k[seg], pos + 1))))
        csum = np.cumsum(gaps.astype(np.int64))
        base = np.concatenate([[0], csum])[offs[:-1]]  # cumsum before each sample
        ts = start.astype(np.int64)[seg] + csum - base[seg]
        return torch.from_numpy(ts)

    # ------------------------------------------------------------------ batches
    def global_batch(self, step: int, split: str = "train") -> JaggedBatch:
        """The whole global batch of ``step``: sample ids ``0 .. GB-1``."""
        return self.samples(step, np.arange(self.cfg.global_batch_size, dtype=np.int64), split)


def local_range(global_batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous placement: rank r holds global ids ``[r*GB/W, (r+1)*GB/W)``."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} for world size {world_size}")
    if global_batch_size % world_size:
        raise ValueError(
            f"global batch size {global_batch_size} is not divisible by world size "
            f"{world_size}; choose a global batch size that is a multiple of it"
        )
    per = global_batch_size // world_size
    return rank * per, (rank + 1) * per
