"""Load-time validation of jagged batches.

Owns :class:`BadInputError` and :func:`validate_batch`: the check every batch passes
before any of its ids reach an embedding owner (DESIGN.md section 3: malformed input
is rejected at load time). It may not touch ranks' state, tables or the trainer: it
reads a batch and returns it (or a truncated copy); flushing deferred updates before
re-raising is the trainer's job.

Every error message names the rank, the feature, the offending sample (index in the
batch and global sample id) and the offending value, e.g.::

    rank 1: feature 'uih_item', sample 17 (global id 145): id 20001 out of range [0, 20000)

Checks are vectorised (a handful of tensor reductions per feature); only the error
path looks at individual elements. An empty batch (zero samples) is valid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from freescale.config import CANDIDATE_FEATURE
from freescale.data.batch import JaggedBatch, lengths_to_offsets

__all__ = ["BadInputError", "validate_batch", "truncate_uih"]

_ID_DTYPE = torch.int64
_LABEL_DTYPE = torch.float32


class BadInputError(ValueError):
    """A batch violates the input contract; the message says where and why."""


def _where(rank: int, feature: str, batch: JaggedBatch, sample: int) -> str:
    gid: object = "?"
    if 0 <= sample < batch.sample_ids.numel():
        gid = int(batch.sample_ids[sample])
    return f"rank {rank}: feature '{feature}', sample {sample} (global id {gid})"


def _sample_of(offsets: torch.Tensor, index: int) -> int:
    """Sample holding flat position ``index`` (offsets has B+1 entries)."""
    return int(torch.searchsorted(offsets, torch.tensor([index]), right=True)[0]) - 1


def _check_dtype(rank: int, feature: str, what: str, t: object, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise BadInputError(f"rank {rank}: feature '{feature}': {what} is not a tensor")
    if t.dtype != dtype:
        raise BadInputError(
            f"rank {rank}: feature '{feature}': {what} has dtype {t.dtype}, expected {dtype}"
        )
    if t.dim() != 1:
        raise BadInputError(
            f"rank {rank}: feature '{feature}': {what} must be 1-D, got shape {tuple(t.shape)}"
        )


def _check_lengths(
    rank: int, feature: str, batch: JaggedBatch, lengths: torch.Tensor, values_numel: int
) -> torch.Tensor:
    """Count, sign and sum of one feature's lengths; returns its offsets."""
    B = batch.batch_size
    if lengths.numel() != B:
        raise BadInputError(
            f"rank {rank}: feature '{feature}': {lengths.numel()} lengths for {B} samples"
        )
    neg = lengths < 0
    if bool(neg.any()):
        s = int(neg.nonzero()[0, 0])
        raise BadInputError(f"{_where(rank, feature, batch, s)}: negative length {int(lengths[s])}")
    total = int(lengths.sum())
    if total != values_numel:
        raise BadInputError(
            f"rank {rank}: feature '{feature}': lengths sum to {total} but there are "
            f"{values_numel} values"
        )
    return lengths_to_offsets(lengths)


def _check_ids(
    rank: int,
    feature: str,
    batch: JaggedBatch,
    values: torch.Tensor,
    offsets: torch.Tensor,
    rows: int,
) -> None:
    if values.numel() == 0:
        return
    bad = (values < 0) | (values >= rows)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        s = _sample_of(offsets.cpu(), i)
        pos = i - int(offsets[s])
        raise BadInputError(
            f"{_where(rank, feature, batch, s)}: id {int(values[i])} out of range [0, {rows}) "
            f"at position {pos}"
        )


def truncate_uih(batch: JaggedBatch, max_uih: int) -> JaggedBatch:
    """Keep only the most recent ``max_uih`` ids of every UIH sequence (the *last*
    ones: sequences are in time order, oldest first). Timestamps follow their ids.
    Returns ``batch`` itself when nothing is longer than ``max_uih``."""
    if not any(bool((v > max_uih).any()) for v in batch.uih_lengths.values()):
        return batch
    uih, lens = {}, {}
    ts = None if batch.timestamps is None else {}
    for k, vals in batch.uih.items():
        L = batch.uih_lengths[k].to(torch.int64)
        new = L.clamp(max=max_uih)
        offs = lengths_to_offsets(L)
        seg = torch.repeat_interleave(torch.arange(L.numel(), device=L.device), L)
        pos = torch.arange(vals.numel(), device=L.device) - offs[:-1][seg]
        keep = pos >= (L - new)[seg]
        uih[k] = vals[keep]
        lens[k] = new.to(batch.uih_lengths[k].dtype)
        if ts is not None and k in batch.timestamps:
            ts[k] = batch.timestamps[k][keep]
    return replace(batch, uih=uih, uih_lengths=lens, timestamps=ts)


def validate_batch(
    batch: JaggedBatch,
    feature_rows: Mapping[str, int],
    *,
    max_uih: int | None,
    rank: int,
    truncate: bool = False,
    require_aligned: bool = True,
) -> JaggedBatch:
    """Check ``batch`` against the input contract; return it (or a truncated copy).

    ``feature_rows`` maps every UIH key and ``"candidates"`` to the row count of its
    table; ids must lie in ``[0, rows)``. Raises :class:`BadInputError` on: wrong dtypes
    (ids, lengths and sample ids int64; labels float32; timestamps int64; true_probs
    float64), keys that differ between ids / lengths / timestamps / ``feature_rows``,
    negative lengths, lengths not summing to the values' length, UIH keys with
    different lengths for one sample (when ``require_aligned``), ids out of range,
    a label / candidate count mismatch, labels that are NaN or not in {0, 1}, and
    samples longer than ``max_uih``. With ``truncate=True`` an over-long sample is not
    an error: it keeps its most recent ``max_uih`` ids (see :func:`truncate_uih`).
    ``max_uih=None`` disables the length limit.
    """
    if not isinstance(batch, JaggedBatch):
        raise BadInputError(f"rank {rank}: expected a JaggedBatch, got {type(batch).__name__}")
    _check_dtype(rank, "sample_ids", "sample_ids", batch.sample_ids, _ID_DTYPE)
    B = batch.batch_size

    # ---- keys
    keys = list(batch.uih.keys())
    if set(batch.uih_lengths.keys()) != set(keys):
        raise BadInputError(
            f"rank {rank}: UIH keys {sorted(keys)} and length keys "
            f"{sorted(batch.uih_lengths.keys())} differ"
        )
    if batch.timestamps is not None and set(batch.timestamps.keys()) != set(keys):
        raise BadInputError(
            f"rank {rank}: timestamp keys {sorted(batch.timestamps.keys())} differ from UIH "
            f"keys {sorted(keys)}"
        )
    expected = set(feature_rows) - {CANDIDATE_FEATURE}
    if set(keys) != expected:
        extra, missing = sorted(set(keys) - expected), sorted(expected - set(keys))
        raise BadInputError(
            f"rank {rank}: UIH keys {sorted(keys)} do not match the tables' features "
            f"(unknown: {extra}, missing: {missing})"
        )
    if CANDIDATE_FEATURE not in feature_rows:
        raise BadInputError(f"rank {rank}: feature_rows has no '{CANDIDATE_FEATURE}' entry")

    # ---- UIH: dtypes, lengths, alignment, ids
    offsets: dict[str, torch.Tensor] = {}
    for k in keys:
        _check_dtype(rank, k, "ids", batch.uih[k], _ID_DTYPE)
        _check_dtype(rank, k, "lengths", batch.uih_lengths[k], _ID_DTYPE)
        offsets[k] = _check_lengths(rank, k, batch, batch.uih_lengths[k], batch.uih[k].numel())
        if batch.timestamps is not None:
            ts = batch.timestamps[k]
            _check_dtype(rank, k, "timestamps", ts, _ID_DTYPE)
            if ts.numel() != batch.uih[k].numel():
                raise BadInputError(
                    f"rank {rank}: feature '{k}': {ts.numel()} timestamps for "
                    f"{batch.uih[k].numel()} ids"
                )
    if require_aligned and len(keys) > 1:
        ref = batch.uih_lengths[keys[0]]
        for k in keys[1:]:
            diff = batch.uih_lengths[k] != ref
            if bool(diff.any()):
                s = int(diff.nonzero()[0, 0])
                raise BadInputError(
                    f"{_where(rank, k, batch, s)}: length {int(batch.uih_lengths[k][s])} is "
                    f"not aligned with '{keys[0]}' (length {int(ref[s])})"
                )
    for k in keys:
        _check_ids(rank, k, batch, batch.uih[k], offsets[k], int(feature_rows[k]))

    # ---- candidates and labels
    cf = CANDIDATE_FEATURE
    _check_dtype(rank, cf, "ids", batch.candidates, _ID_DTYPE)
    _check_dtype(rank, cf, "num_candidates", batch.num_candidates, _ID_DTYPE)
    coffs = _check_lengths(rank, cf, batch, batch.num_candidates, batch.candidates.numel())
    _check_ids(rank, cf, batch, batch.candidates, coffs, int(feature_rows[cf]))
    _check_dtype(rank, "labels", "labels", batch.labels, _LABEL_DTYPE)
    nc = batch.candidates.numel()
    if batch.labels.numel() != nc:
        raise BadInputError(
            f"rank {rank}: feature 'labels': {batch.labels.numel()} labels for {nc} candidates "
            f"(num_candidates sums to {nc})"
        )
    bad = ~((batch.labels == 0) | (batch.labels == 1))  # NaN compares unequal: caught
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        s = _sample_of(coffs.cpu(), i)
        raise BadInputError(
            f"{_where(rank, 'labels', batch, s)}: label {float(batch.labels[i])} at candidate "
            f"{i - int(coffs[s])} is not 0 or 1"
        )
    if batch.true_probs is not None:
        _check_dtype(rank, "true_probs", "true_probs", batch.true_probs, torch.float64)
        if batch.true_probs.numel() != nc:
            raise BadInputError(
                f"rank {rank}: feature 'true_probs': {batch.true_probs.numel()} values for "
                f"{nc} candidates"
            )

    # ---- length limit
    if max_uih is not None and B:
        for k in keys:
            over = batch.uih_lengths[k] > max_uih
            if bool(over.any()) and not truncate:
                s = int(over.nonzero()[0, 0])
                raise BadInputError(
                    f"{_where(rank, k, batch, s)}: length {int(batch.uih_lengths[k][s])} "
                    f"exceeds max_uih={max_uih} (pass truncate=True to keep the most recent "
                    f"{max_uih})"
                )
        if truncate:
            batch = truncate_uih(batch, max_uih)
    return batch
