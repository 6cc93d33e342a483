"""Deterministic per-row gradient sums (DESIGN.md section 1, tier 1 condition (i)).

Owns the one reduction order every FreeScale path uses to sum the gradients of a row
at its owner: ids are stably sorted by row key (received buffers are already in
source-rank-major, then position order, so ties keep (source rank, position) order);
each row's gradients are then summed by a pairwise tree over their index inside the
row's segment. The result for a row depends only on that row's gradients and their
order: not on which other rows are in the call, how many there are, or the device.
No atomics and no ``index_add_`` on floats.

The reference (`segment_sum_reference`) runs the tree as ``ceil(log2(max segment
length))`` rounds of whole-tensor ``torch.where`` (no data-dependent shapes, no host
synchronisation beyond reading the maximum segment length, with the row count, once):
~7 launches and a full pass over the [N, D] gradients per round. On CUDA `segment_sum`
uses the Triton version (`kernels/segment_tree.py`: one launch per 32x of segment
length, each gradient read once), bitwise equal to the reference.

Grouping ids by row needs the number of distinct rows on the host. Three ways, same
groups: `group_rows` reads it back where it is needed (the stream must drain first);
`group_rows_start` queues the work early and copies the count to pinned memory behind
an event, `PendingRowGroups.finish` reads it later (the CUDA default: started when the
ids arrive in the forward, finished in the backward); `group_rows_padded` never reads it
(one slot per id, for groupings that cannot be started early).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = [
    "PaddedRowGroups",
    "PendingRowGroups",
    "RowGroups",
    "group_rows",
    "group_rows_padded",
    "group_rows_start",
    "group_rows_reference",
    "mask_partition",
    "mask_partition_reference",
    "mask_positions",
    "mask_positions_reference",
    "run_stats",
    "run_stats_reference",
    "segment_sum",
    "segment_sum_reference",
]

# auto | reference | triton; "reference" also keeps mask_positions on its reference
SEGMENT_SUM_ENV_VAR = "FREESCALE_SEGMENT_SUM"


@dataclass
class RowGroups:
    """Result of grouping ids by row: ``order`` sorts the ids, ``rows`` are the unique
    keys (ascending), ``starts``/``counts`` their segments in sorted order."""

    order: torch.Tensor
    rows: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor
    max_count: int


def mask_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """``torch.nonzero(mask).squeeze(1)`` when the number of True entries (``count``) is
    already known on the host: no device read-back (``nonzero`` and boolean indexing
    synchronise the stream to learn their output size). Each True entry scatters its
    position to its rank among the True entries. On CUDA (bool masks): the Triton
    version, two launches; elsewhere `mask_positions_reference`."""
    fast = mask.is_cuda and mask.dtype == torch.bool and mask.dim() == 1
    if fast and os.environ.get(SEGMENT_SUM_ENV_VAR, "auto") != "reference":
        from freescale.kernels.segment_tree import mask_positions_triton

        return mask_positions_triton(mask, count)  # same result, 2 launches instead of 6
    return mask_positions_reference(mask, count)


def mask_positions_reference(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The plain version of :func:`mask_positions` (what it runs on CPU)."""
    n = mask.numel()
    if count == n:
        return torch.arange(n, device=mask.device)
    m = mask.to(torch.int64)
    target = torch.where(mask, torch.cumsum(m, 0) - 1, count)
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    out.scatter_(0, target, torch.arange(n, device=mask.device))
    return out[:count]


def mask_partition(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The stable partition of positions by a 1-D bool ``mask`` with ``count`` True
    entries known on the host: ``cat([nonzero(mask), nonzero(~mask)])`` (squeezed), i.e.
    :func:`mask_positions` of ``mask`` and of ``~mask`` in one tensor, the first
    ``count`` entries and the rest. One pass instead of two and no inverted copy of the
    mask; on CUDA the Triton version (one scan and one launch), elsewhere
    `mask_partition_reference`."""
    fast = mask.is_cuda and mask.dtype == torch.bool and mask.dim() == 1
    if fast and os.environ.get(SEGMENT_SUM_ENV_VAR, "auto") != "reference":
        from freescale.kernels.segment_tree import mask_partition_triton

        return mask_partition_triton(mask, count)
    return mask_partition_reference(mask, count)


def mask_partition_reference(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The plain version of :func:`mask_partition` (what it runs on CPU): each entry goes
    to its rank among the True entries, or ``count`` + its rank among the False ones."""
    n = mask.numel()
    idx = torch.arange(n, device=mask.device)
    if count in (0, n):
        return idx
    return torch.empty_like(idx).scatter_(0, partition_ranks(mask, count), idx)


def partition_ranks(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Where :func:`mask_partition` puts each position: its rank among the True entries
    of ``mask``, or ``count`` + its rank among the False ones (the inverse permutation,
    with ``count`` = the number of True entries)."""
    incl = torch.cumsum(mask, 0, dtype=torch.int64)
    idx = torch.arange(mask.numel(), device=mask.device)
    return torch.where(mask, incl - 1, (idx + count) - incl)


def group_rows(keys: torch.Tensor) -> RowGroups:
    """Stable-sort ``keys`` and find each unique key's segment, with one device read-back
    (the number of rows and the longest segment together; ``unique_consecutive`` and
    ``counts.max()`` would read back twice). Equal to :func:`group_rows_reference`."""
    return group_rows_start(keys, ahead=False).finish()


class PendingRowGroups:
    """:func:`group_rows` split in two: :func:`group_rows_start` queues the sort and the
    two counts (unique rows, longest segment) and, on CUDA, copies the counts to pinned
    host memory behind an event; :meth:`finish` reads them and builds the
    :class:`RowGroups`. Started in the forward for the ids whose gradients the backward
    sums, the read in the backward finds the copy long done: no wait for the dense
    backward (what :func:`group_rows` would wait for there) and no padding (what
    :func:`group_rows_padded` pays for). Same tensors as :func:`group_rows`."""

    def __init__(
        self,
        n: int,
        order: torch.Tensor,
        sorted_keys: torch.Tensor,
        is_start: torch.Tensor,
        stats: torch.Tensor,
        ahead: bool,
    ) -> None:
        self.n = n
        self.order, self.sorted_keys, self.is_start, self._stats = (
            order,
            sorted_keys,
            is_start,
            stats,
        )
        self._host: torch.Tensor | None = None
        self._ready: torch.cuda.Event | None = None
        self._stream: torch.cuda.Stream | None = None
        if ahead and stats.is_cuda:
            self._stream = torch.cuda.current_stream(stats.device)
            self._host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            self._host.copy_(stats, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(self._stream)
        self._result: RowGroups | None = None

    def finish(self) -> RowGroups:
        """The :class:`RowGroups` (computed once). On CUDA, waits for the counts' copy if
        it is still in flight, and makes the current stream safe to use the tensors made
        on the starting stream (their memory is not reused before its work is done)."""
        if self._result is not None:
            return self._result
        n = self.n
        if n == 0:
            e = self.order
            self._result = RowGroups(e, e, e, e, 0)
            return self._result
        if self._host is not None and self._ready is not None:
            self._ready.synchronize()
            u, max_count = self._host.tolist()
            cur = torch.cuda.current_stream(self.order.device)
            if cur != self._stream:
                cur.wait_event(self._ready)
                for t in (self.order, self.sorted_keys, self.is_start):
                    t.record_stream(cur)
        else:
            u, max_count = self._stats.tolist()
        starts = mask_positions(self.is_start, u)
        counts = torch.empty_like(starts)
        counts[:-1] = starts[1:] - starts[:-1]
        counts[-1:] = n - starts[-1:]
        rows = self.sorted_keys.index_select(0, starts)
        self._result = RowGroups(self.order, rows, starts, counts, max_count)
        return self._result


def group_rows_start(keys: torch.Tensor, ahead: bool = True) -> PendingRowGroups:
    """Queue :func:`group_rows`'s device work for ``keys`` (see :class:`PendingRowGroups`);
    ``ahead``: copy the two counts to the host asynchronously (CUDA only; otherwise
    :meth:`PendingRowGroups.finish` reads them directly)."""
    keys = keys.to(torch.int64)
    n = keys.numel()
    if n == 0:
        e = keys.new_zeros(0)
        return PendingRowGroups(0, e, e, e.bool(), e, ahead=False)
    sorted_keys, order = torch.sort(keys, stable=True)
    is_start, stats = run_stats(sorted_keys)
    return PendingRowGroups(n, order, sorted_keys, is_start, stats, ahead)


def run_stats(sorted_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``is_start`` (where a run of equal keys begins) and int64 ``[number of runs,
    longest run]`` of a sorted, non-empty 1-D int64 tensor, on its device: two Triton
    launches on CUDA (`kernels.segment_tree.run_stats_triton`, unless
    ``FREESCALE_SEGMENT_SUM=reference``), :func:`run_stats_reference` elsewhere."""
    if sorted_keys.is_cuda and os.environ.get(SEGMENT_SUM_ENV_VAR, "auto") != "reference":
        from freescale.kernels.segment_tree import run_stats_triton

        return run_stats_triton(sorted_keys)
    return run_stats_reference(sorted_keys)


def run_stats_reference(sorted_keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain PyTorch :func:`run_stats` (about ten ops)."""
    n = sorted_keys.numel()
    is_start = torch.ones(n, dtype=torch.bool, device=sorted_keys.device)
    is_start[1:] = sorted_keys[1:] != sorted_keys[:-1]
    idx = torch.arange(n, device=sorted_keys.device)
    run_start = torch.cummax(torch.where(is_start, idx, 0), 0).values
    stats = torch.stack([is_start.sum(), (idx - run_start).max() + 1])
    return is_start, stats


@dataclass
class PaddedRowGroups:
    """:func:`group_rows` without a device read-back: every array has one slot per id
    (``n``), the unique-row count ``u`` stays on the device.

    ``groups``: slots ``< u`` are exactly :func:`group_rows`'s rows / starts / counts;
    slots ``>= u`` are empty segments (count 0; their start and row are in range but
    meaningless), and ``max_count`` is ``n``, an upper bound (the Triton per-row sum takes
    ``ceil(log_32 n)`` levels; a level over finished segments adds -0.0: same bits).
    ``fill``: slot -> ``min(slot, u - 1)``; indexing per-row results with it makes every
    padding slot a copy of the last real row, so a scatter of the padded results writes
    each row only with bit-identical values (deterministic without knowing ``u``).
    ``num_rows``: ``u`` as a one-element int64 device tensor."""

    groups: RowGroups
    fill: torch.Tensor
    num_rows: torch.Tensor


def group_rows_padded(keys: torch.Tensor) -> PaddedRowGroups:
    """Stable-sort ``keys`` and find each unique key's segment, shapes fixed by
    ``keys.numel()`` (see :class:`PaddedRowGroups`): no host synchronisation, the GPU
    path of the sparse update (``group_rows`` reads the row count back, which made the
    backward thread wait for the whole dense backward)."""
    keys = keys.to(torch.int64)
    n = keys.numel()
    dev = keys.device
    if n == 0:
        e = keys.new_zeros(0)
        return PaddedRowGroups(RowGroups(e, e, e, e, 0), e, keys.new_zeros(1))
    sorted_keys, order = torch.sort(keys, stable=True)
    is_start = torch.ones(n, dtype=torch.bool, device=dev)
    is_start[1:] = sorted_keys[1:] != sorted_keys[:-1]
    seg = torch.cumsum(is_start, 0) - 1  # segment of every sorted position
    u = seg[-1:] + 1
    slot = torch.arange(n, device=dev)
    # starts[k] = position of the k-th start; non-starts land in the dropped slot n
    starts = torch.full((n + 1,), n - 1, dtype=torch.int64, device=dev)
    starts.scatter_(0, torch.where(is_start, seg, n), slot)
    starts = starts[:n]
    nxt = torch.cat([starts[1:], starts.new_full((1,), n)])
    nxt = torch.where(slot + 1 < u, nxt, n)
    counts = torch.where(slot < u, nxt - starts, 0)
    rows = sorted_keys.index_select(0, starts)
    fill = torch.minimum(slot, u - 1)
    return PaddedRowGroups(RowGroups(order, rows, starts, counts, n), fill, u)


def group_rows_reference(keys: torch.Tensor) -> RowGroups:
    """The plain version of :func:`group_rows` (``unique_consecutive``; two read-backs)."""
    keys = keys.to(torch.int64)
    if keys.numel() == 0:
        e = keys.new_zeros(0)
        return RowGroups(e, e, e, e, 0)
    sorted_keys, order = torch.sort(keys, stable=True)
    rows, counts = torch.unique_consecutive(sorted_keys, return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    return RowGroups(order, rows, starts, counts, int(counts.max()))


def segment_sum(values: torch.Tensor, groups: RowGroups, backend: str = "auto") -> torch.Tensor:
    """Per-row sums of ``values`` (``[N, D]``, in the *unsorted* id order) -> ``[U, D]``,
    rows in ``groups.rows`` order, by the fixed pairwise tree described above.

    ``backend``: ``auto`` (``$FREESCALE_SEGMENT_SUM`` if set, else Triton for float32 /
    float64 CUDA tensors, the reference otherwise), ``reference`` or ``triton`` (on CPU
    tensors only under ``TRITON_INTERPRET=1``, as the tests run it)."""
    if backend == "auto":
        backend = os.environ.get(SEGMENT_SUM_ENV_VAR, "auto")
    if backend == "auto":  # never imports triton for CPU tensors (interpreter mode)
        from freescale.kernels.common import triton_available

        fast = values.dtype in (torch.float32, torch.float64)
        use = values.is_cuda and fast and triton_available()
        backend = "triton" if use else "reference"
    if backend == "reference":
        return segment_sum_reference(values, groups)
    if backend != "triton":
        raise ValueError(f"segment_sum backend must be auto, reference or triton: {backend!r}")
    from freescale.kernels.segment_tree import segment_tree_sum

    if groups.rows.numel() == 0:
        return values.new_zeros((0, *values.shape[1:]))
    return segment_tree_sum(values, groups.order, groups.starts, groups.counts, groups.max_count)


def segment_sum_reference(values: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """The plain version of :func:`segment_sum`: the tree as whole-tensor rounds."""
    if groups.rows.numel() == 0:
        return values.new_zeros((0, *values.shape[1:]))
    buf = values.index_select(0, groups.order)
    n = buf.shape[0]
    seg = torch.repeat_interleave(
        torch.arange(groups.rows.numel(), device=buf.device), groups.counts, output_size=n
    )
    local = torch.arange(n, device=buf.device) - groups.starts[seg]
    count_of = groups.counts[seg]
    stride = 1
    while stride < groups.max_count:
        take = ((local % (2 * stride)) == 0) & (local + stride < count_of)
        shifted = torch.cat([buf[stride:], buf[:stride]]) if stride < n else buf
        mask = take.view(-1, *([1] * (buf.dim() - 1)))
        buf = torch.where(mask, buf + shifted, buf)
        stride *= 2
    return buf.index_select(0, groups.starts)
