"""The jagged batch type every stage of FreeScale passes around.

Owns: :class:`JaggedBatch` (per sample one or more UIH id sequences, candidate ids,
binary labels, optional timestamps, global sample ids), slicing / concatenation /
sample permutation on the host, and size accounting. It does not know about ranks,
tables or devices beyond ``.to(device)``.

Layout (generative-recommenders / fbgemm convention, never padded):

* ``uih[key]`` is a flat int64 tensor of ids; ``uih_lengths[key]`` holds one length
  per sample (``B`` entries). All keys of one sample may have different lengths; the
  reference model requires keys to be *aligned* (equal lengths per sample) and checks.
* ``candidates`` is a flat int64 tensor, ``num_candidates`` one count per sample.
* ``labels`` is float32, one per candidate, in {0, 1}.
* ``timestamps[key]`` (optional) aligns with ``uih[key]``.
* ``sample_ids`` (int64, ``B``) are *global* sample indices within the step: the
  batch of step t is a function of (seed, t, sample id) only, so any placement of
  samples on ranks trains on the same data.
* ``true_probs`` (optional, float64, one per candidate) are the generator's ground
  truth click probabilities, used only to report the oracle NE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

__all__ = ["JaggedBatch", "lengths_to_offsets"]


def lengths_to_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[l0, l1, ...] -> [0, l0, l0+l1, ...]`` (int64, B+1 entries)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.to(torch.int64), dim=0, out=out[1:])
    return out


def _segment_index(
    lengths: torch.Tensor, order: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Positions in the values of jagged segments ``order[0], order[1], ...`` (one index
    for every jagged field with these lengths) and the new lengths (int64); None for an
    empty result. ``index_select``, not advanced indexing: the same values, less CPU."""
    lengths = lengths.to(torch.int64)
    offsets = lengths_to_offsets(lengths)
    new_lengths = lengths.index_select(0, order)
    total = int(new_lengths.sum())
    if total == 0:
        return None, new_lengths
    new_offsets = lengths_to_offsets(new_lengths)
    shift = offsets[:-1].index_select(0, order) - new_offsets[:-1]
    seg = torch.repeat_interleave(
        torch.arange(order.numel(), device=lengths.device), new_lengths, output_size=total
    )
    idx = shift.index_select(0, seg)
    idx += torch.arange(total, device=lengths.device)
    return idx, new_lengths


def _take(values: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
    return values[:0] if idx is None else values.index_select(0, idx)


def _gather_segments(
    values: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather jagged segments ``order[i]`` of (values, lengths) in the given order."""
    idx, new_lengths = _segment_index(lengths, order)
    return _take(values, idx), new_lengths


@dataclass
class JaggedBatch:
    """A local (or global) batch of samples in jagged form. See module docstring."""

    sample_ids: torch.Tensor
    uih: dict[str, torch.Tensor]
    uih_lengths: dict[str, torch.Tensor]
    candidates: torch.Tensor
    num_candidates: torch.Tensor
    labels: torch.Tensor
    timestamps: dict[str, torch.Tensor] | None = None
    true_probs: torch.Tensor | None = None
    step: int = 0
    extras: dict[str, object] = field(default_factory=dict)

    # ------------------------------------------------------------------ basics
    @property
    def batch_size(self) -> int:
        return int(self.sample_ids.numel())

    @property
    def keys(self) -> list[str]:
        return list(self.uih.keys())

    @property
    def device(self) -> torch.device:
        return self.sample_ids.device

    def uih_offsets(self, key: str) -> torch.Tensor:
        return lengths_to_offsets(self.uih_lengths[key])

    def candidate_offsets(self) -> torch.Tensor:
        return lengths_to_offsets(self.num_candidates)

    def total_tokens(self) -> int:
        return sum(int(v.numel()) for v in self.uih.values())

    def num_bytes(self) -> int:
        """Bytes of payload (what moving these samples between ranks costs)."""
        n = 0
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                n += v.numel() * v.element_size()
            elif isinstance(v, dict):
                n += sum(t.numel() * t.element_size() for t in v.values() if torch.is_tensor(t))
        return n

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedBatch:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return replace(
            self,
            sample_ids=mv(self.sample_ids),
            uih={k: mv(v) for k, v in self.uih.items()},
            uih_lengths={k: mv(v) for k, v in self.uih_lengths.items()},
            candidates=mv(self.candidates),
            num_candidates=mv(self.num_candidates),
            labels=mv(self.labels),
            timestamps=None
            if self.timestamps is None
            else {k: mv(v) for k, v in self.timestamps.items()},
            true_probs=mv(self.true_probs),
        )

    def pin_memory(self) -> JaggedBatch:
        if self.device.type != "cpu" or not torch.cuda.is_available():
            return self

        def pin(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.pin_memory()

        return replace(
            self,
            sample_ids=pin(self.sample_ids),
            uih={k: pin(v) for k, v in self.uih.items()},
            uih_lengths={k: pin(v) for k, v in self.uih_lengths.items()},
            candidates=pin(self.candidates),
            num_candidates=pin(self.num_candidates),
            labels=pin(self.labels),
            timestamps=None
            if self.timestamps is None
            else {k: pin(v) for k, v in self.timestamps.items()},
            true_probs=pin(self.true_probs),
        )

    # --------------------------------------------------------- sample moves
    def select(self, order: torch.Tensor | Sequence[int]) -> JaggedBatch:
        """Samples ``order[0], order[1], ...`` of this batch, in that order (a copy).

        ``order`` may repeat or drop samples; it is the host-side reference for the
        indexed-permute kernel.
        """
        order = torch.as_tensor(order, dtype=torch.int64, device=self.device)
        uih, uih_len, where = {}, {}, {}
        for k in self.uih:  # one index per key: the timestamps share it
            where[k], uih_len[k] = _segment_index(self.uih_lengths[k], order)
            uih[k] = _take(self.uih[k], where[k])
        ts = None
        if self.timestamps is not None:
            ts = {
                k: _take(v, where[k])
                if k in where
                else _gather_segments(v, self.uih_lengths[k], order)[0]
                for k, v in self.timestamps.items()
            }
        c_idx, ncand = _segment_index(self.num_candidates, order)
        cands, labels = _take(self.candidates, c_idx), _take(self.labels, c_idx)
        probs = None
        if self.true_probs is not None:
            probs = _take(self.true_probs, c_idx)
        return JaggedBatch(
            sample_ids=self.sample_ids.index_select(0, order),
            uih=uih,
            uih_lengths=uih_len,
            candidates=cands,
            num_candidates=ncand,
            labels=labels,
            timestamps=ts,
            true_probs=probs,
            step=self.step,
            extras=dict(self.extras),
        )

    def slice(self, start: int, stop: int) -> JaggedBatch:
        """Samples ``start .. stop-1`` (contiguous placement of a global batch)."""
        return self.select(torch.arange(start, stop, dtype=torch.int64))

    @staticmethod
    def concat(batches: Sequence[JaggedBatch]) -> JaggedBatch:
        """Concatenate batches sample-wise (they must have the same keys)."""
        if not batches:
            raise ValueError("JaggedBatch.concat needs at least one batch")
        first = batches[0]
        keys = first.keys
        for b in batches[1:]:
            if b.keys != keys:
                raise ValueError(f"cannot concat batches with keys {keys} and {b.keys}")

        def cat(ts: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(ts) if ts else torch.empty(0)

        has_ts = all(b.timestamps is not None for b in batches)
        has_p = all(b.true_probs is not None for b in batches)
        return JaggedBatch(
            sample_ids=cat([b.sample_ids for b in batches]),
            uih={k: cat([b.uih[k] for b in batches]) for k in keys},
            uih_lengths={k: cat([b.uih_lengths[k] for b in batches]) for k in keys},
            candidates=cat([b.candidates for b in batches]),
            num_candidates=cat([b.num_candidates for b in batches]),
            labels=cat([b.labels for b in batches]),
            timestamps={k: cat([b.timestamps[k] for b in batches]) for k in keys}
            if has_ts
            else None,
            true_probs=cat([b.true_probs for b in batches]) if has_p else None,
            step=first.step,
            extras=dict(first.extras),
        )

    @staticmethod
    def empty(
        keys: Sequence[str], step: int = 0, device: torch.device | str = "cpu"
    ) -> JaggedBatch:
        """A batch with zero samples (legal: balancing can leave a rank empty)."""
        z64 = torch.zeros(0, dtype=torch.int64, device=device)
        return JaggedBatch(
            sample_ids=z64.clone(),
            uih={k: z64.clone() for k in keys},
            uih_lengths={k: z64.clone() for k in keys},
            candidates=z64.clone(),
            num_candidates=z64.clone(),
            labels=torch.zeros(0, dtype=torch.float32, device=device),
            step=step,
        )

    def composite_lengths(self) -> torch.Tensor:
        """Per-sample sum of UIH lengths over keys (stage II of balancing)."""
        out = torch.zeros(self.batch_size, dtype=torch.int64, device=self.device)
        for v in self.uih_lengths.values():
            out += v.to(torch.int64)
        return out

    def __repr__(self) -> str:  # short: tensors can be huge
        return (
            f"JaggedBatch(step={self.step}, B={self.batch_size}, keys={self.keys}, "
            f"tokens={self.total_tokens()}, candidates={int(self.candidates.numel())})"
        )
