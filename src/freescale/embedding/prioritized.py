"""Prioritized embedding updates (DESIGN.md section 2.2): only collision rows block.

Owns :class:`PrioritizedEmbeddingCollection`, a drop-in subclass of the vanilla
:class:`~freescale.embedding.collection.ShardedEmbeddingCollection` (same weights, same
fused optimizer, same sharding plan, same outputs) whose schedule keeps only the rows
touched by two consecutive steps on the critical path; its counters
(:class:`PrioritizedStats`), its extra-memory report, and
:func:`make_embedding_collection`, the factory the trainer builds its embedding module
with. It may not touch the dense model or the trainer; it reads nothing but the ids
given to it (``features`` of step t and ``next_features`` of step t+1).

Vocabulary. Rows are keyed by (table, row), i.e. by the row of the owner's shard tensor
(``recv_keys``). For consecutive training steps t and t+1, a *collision* row is touched
by both; every other row of t+1 is *exclusive* to t+1, every other row of t is
exclusive to t. Collision detection runs at the owner, in shard-major form, with a
bitmap over the shard's rows. All occurrences of a row fall in the same subset.

Schedule of training step t (``forward(features_t, next_features=features_{t+1})``):

(a) wait for and apply the deferred exclusive-gradient update of step t-1, with the
    step index and learning rate captured at t-1's forward — at the start of t's
    backward, before (b)'s second half (a prioritized t reads no row in its forward, so
    the wait, which blocks the host on the copy-engine backend, comes as late as
    possible); a synchronous t applies it at the start of its forward instead;
(b) lookahead (skipped on the last step, ``next_features is None``), in two halves.
    In t's forward: id dist of t+1; at the owner, mark t+1's ids whose row t touches
    (collision) and t's ids whose row t+1 touches ("reappear"), and count them per
    source; then one all-to-all sends both masks back to the requesters with the owner's
    counts appended (a trailer built on the device) — device work only, on the side
    stream, no host read. At the start of t's backward (before t's gradients are
    exchanged): one host read of the received trailers and the owner's counts (a pinned
    copy made in the forward, behind an event): every rank then knows the global
    collision rate and takes the same guardrail decision before any exclusive lookup of
    t+1. If t+1 is prioritized: look up t+1's exclusive rows and start sending them
    (side communicator, asynchronous). The mask exchange reads and writes no row, so it
    runs as early as its inputs exist; its read waits for side-stream work finished
    during the dense forward, not for the peer or the GPU's progress through the
    backward (up to `638f4a4` the counts were read first and the exchange issued in the
    backward, where the host waited for both). The owner split's groupings are queued
    before (a) (after it, they would queue behind (a)'s update kernels on the side
    stream); the gradient split and the exclusive lookup run after (a);
(c) wait only for t's collision embeddings (sent by the backward of t-1) and t's
    exclusive embeddings (sent by (b) of t-1); merge them into batch-major order.
    Without a prioritized lookahead for t (first step, after :meth:`flush`, after a
    guardrail fallback) t's rows are looked up and exchanged synchronously instead.

Backward of t: if t+1 is prioritized, split t's gradients with the reappear mask; the
collision gradients go to the owners (blocking), which apply them, look up t+1's
collision rows (now updated) and start sending them (what (c) of t+1 waits for); the
exclusive gradients are sent asynchronously and applied at (a) of t+1. Otherwise (last
step, fallback, or a context made stale by :meth:`flush`) every gradient of t is
exchanged and applied synchronously, exactly as the vanilla collection does.

Why every read sees every earlier write (the tier-1 argument). Vanilla applies step
s's update to row r between the reads of steps s and s+1. Here:

* t's collision rows (in t and t+1) are updated in t's backward, before they are
  looked up for t+1 (in that same backward, after the update);
* t's exclusive rows (in t, not in t+1) are updated at (a) of t+1 (the start of t+1's
  backward). Nobody reads them in between: step t+1 does not touch them (its forward
  reads no row: its rows came from (b) of t and t's backward), and the only other read
  issued before (a) of t+1 is (b) of t, whose exclusive lookup covers rows of t+1 only.
  Their next reader is some step s >= t+2, whose rows are looked up at (b) of
  s-1 >= t+1 *after* (a) of s-1 (the order (a) -> (b) is what the
  ``early_exclusive_lookup`` mutation breaks: it runs all of (b) in the forward before
  (a)), or in the backward of s-1, later still.
  Example: a row in t-1 and t+1 but not in t is exclusive for t+1; its t-1 update was
  deferred to (a) of t, which runs before (b) of t looks it up for t+1.
* t+1's exclusive rows are read at (b) of t. Their last update before t+1 is from some
  step <= t-1 (t does not touch them), applied in that step's backward or at (a) of
  the next step <= t: all before (b) of t. Step t's own updates (collision rows in its
  backward, exclusive rows at (a) of t+1) touch no row of this set.
* a synchronous step reads after everything earlier is applied: (a) of t runs before
  its lookup, and a step without prioritized lookahead follows a synchronous backward
  or a :meth:`flush`.

So every row sees the same sequence of updates, each one with the step's gradient sum
(all of a row's gradients fall in one subset; each subset keeps the received
(source rank, position) order, and embedding/reduce.py sums a row from its own
gradients only), the step index and lr of the step that produced it (captured at that
step's forward), and per-row optimizer arithmetic that does not depend on how many rows
one call holds (embedding/optim.py). Hence parameters are bit-for-bit those of the
vanilla collection. Updates of different rows commute (row-wise state only).

Collectives. Blocking traffic (ids, masks, collision gradients and rows) uses ``comm``;
exclusive embeddings and gradients use ``side_comm`` (its own process group by
default), so on NCCL the overlapped traffic never queues in front of blocking traffic.
Every rank issues the collectives of each group in the same order: the schedule
depends only on the agreed guardrail decision and on calls every rank makes
(``forward``, ``backward``, :meth:`flush`), so :meth:`flush` is collective too.

CUDA. With ``side_streams`` (default on CUDA) (a) and (b) run on a side stream that
first waits for the compute stream; the compute stream waits on events recorded after
(a) and after (b) before it reads what they produced, and on the collectives
themselves (``Awaitable.wait()`` makes the current stream wait). Tensors crossing
streams are ``record_stream``-ed. ``debug_delay_s`` injects random ``torch.cuda._sleep``
on the side stream (random host sleeps on CPU) so that a missing dependency would show.
(b) needs split sizes on the host (as any variable all-to-all does); its second half
reads them at the start of t's backward, when the first half's side-stream work is done.

Not offered on this path: global gradient-norm clipping across embedding rows (it needs
every gradient before any update). The embedding Function must sit outside any
activation-checkpointed region (recomputation must never re-run it).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..comm.base import Awaitable, Communicator, device_wait, side_communicator
from ..config import SparseOptimConfig, TableConfig
from ..kernels import ranged_combine_backward
from ..kernels.ops import gather_blocks
from .collection import ShardedEmbeddingCollection, _IdDist, check_lookahead
from .reduce import (
    PendingRowGroups,
    group_rows_start,
    mask_partition,
    partition_ranks,
)
from .sdd import SddEmbeddingCollection

__all__ = [
    "PrioritizedEmbeddingCollection",
    "PrioritizedStats",
    "make_embedding_collection",
    "MUTATIONS",
]

Features = Mapping[str, tuple[torch.Tensor, torch.Tensor]]

#: test-only deliberate bugs, each of which the tier-1 exactness tests must catch
MUTATIONS = (
    "deferred_lr",  # deferred update with lr * (1 + 2**-20)
    "deferred_step",  # deferred update with step index - 1
    "drop_grad",  # rank 0 drops one received exclusive gradient, once
    "skip_flush",  # flush() does nothing
    "early_exclusive_lookup",  # (b) runs before (a)
)

_TRAILER = 6  # int64 per destination appended to the mask exchange (see _mask_exchange)
_TRAILER_BYTES = 8 * _TRAILER


# --------------------------------------------------------------------------- state
@dataclass
class PrioritizedStats:
    """Counters of the prioritized schedule.

    ``prioritized_steps``: steps whose embeddings came from a prioritized lookahead *and*
    whose backward deferred its exclusive gradients (every step but the first and the
    last of an undisturbed run); ``sync_steps``: every other training step; ``fallbacks``:
    guardrail decisions that made step t+1 synchronous; ``flushes``: flush() calls that
    had something to apply or drop. ``collision_*`` / ``exclusive_*`` / ``next_*``:
    global (identical on every rank) sums over lookaheads of the distinct rows (``_rows``)
    and occurrences (``_ids``) of t+1 at the owners. ``deferred_rows`` / ``deferred_ids``:
    rows updated and gradients applied by deferred updates on *this* owner.
    ``prepared_steps``: backwards whose gradient-free part ran early, in
    :meth:`PrioritizedEmbeddingCollection.prepare_backward` (rank-local: it runs where the
    mask exchange had already reached the host).
    ``history``: per lookahead ``(step t+1, distinct share, occurrence share,
    prioritized)``.
    """

    prioritized_steps: int = 0
    sync_steps: int = 0
    fallbacks: int = 0
    flushes: int = 0
    lookaheads: int = 0
    collision_rows: int = 0
    collision_ids: int = 0
    exclusive_rows: int = 0
    exclusive_ids: int = 0
    next_rows: int = 0
    next_ids: int = 0
    deferred_rows: int = 0
    deferred_ids: int = 0
    prepared_steps: int = 0
    history: list[tuple[int, float, float, bool]] = field(default_factory=list)

    def collision_rate(self) -> dict[str, float]:
        """Cumulative collision rate: share of distinct rows and share of occurrences."""
        return {
            "distinct": self.collision_rows / self.next_rows if self.next_rows else 0.0,
            "occurrence": self.collision_ids / self.next_ids if self.next_ids else 0.0,
        }

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "history"}
        out["collision_rate"] = self.collision_rate()
        return out


@dataclass
class _Ahead:
    """Step t+1's embeddings as prepared by step t (forward (b) and backward)."""

    dist: _IdDist  # t+1's id dist (its step / lr are replaced at t+1's forward)
    values: list[torch.Tensor]  # t+1's ids as given, to check the call of t+1
    lengths: list[torch.Tensor]
    prioritized: bool
    ready: Any = None  # CUDA event recorded after (b) on the side stream
    # requester side: merged = cat([collision rows, exclusive rows])[merge_perm]
    merge_perm: torch.Tensor | None = None
    coll_recv_splits: list[int] = field(default_factory=list)
    excl_recv_splits: list[int] = field(default_factory=list)
    # owner side
    coll_keys: torch.Tensor | None = None
    coll_send_splits: list[int] = field(default_factory=list)
    excl_send_rows: torch.Tensor | None = None
    excl_aw: Awaitable | None = None
    coll_send_rows: torch.Tensor | None = None
    coll_aw: Awaitable | None = None


@dataclass
class _PendingAhead:
    """(b), first half, issued in t's forward: t+1's id dist, the collision masks at the
    owner and their exchange. The second half (read the exchange's trailers, decide,
    split, send t+1's exclusive rows) runs in t's backward (:meth:`
    PrioritizedEmbeddingCollection._look_ahead_finish`), so its one host read waits for
    side-stream work long finished instead of stalling the training thread before the
    dense forward."""

    dist_t: _IdDist
    dn: _IdDist
    values: list[torch.Tensor]
    lengths: list[torch.Tensor]
    coll_n: torch.Tensor  # owner: ids of t+1 whose row t touches
    reap_t: torch.Tensor  # owner: ids of t whose row t+1 touches
    counts: torch.Tensor  # [reappear per source | collision per source | coll rows, rows]
    # the mask exchange, issued in t's forward right after the first half (device work
    # only: its trailer is built on the device): the masks received (coll_y, reap_y),
    # and [received trailers | counts] for the host — on CUDA a pinned copy behind
    # ``host_ready``, so the read in t's backward waits for that event only
    masks_y: tuple[torch.Tensor, torch.Tensor] | None = None
    host: torch.Tensor | None = None
    host_ready: Any = None
    # the mask exchange's result once read (in t's backward, ahead of (a))
    exchanged: tuple[torch.Tensor, torch.Tensor, bool, tuple[torch.Tensor, list[int]]] | None = None
    # owner side, made right after the exchange: t's ids split by t+1's rows (collision,
    # exclusive) and, with the "ahead" update, their row groupings already started
    owner_split: tuple[torch.Tensor, torch.Tensor, Any, Any] | None = None


@dataclass
class _GradSplit:
    """How step t's gradients split by t+1's rows (computed at (b) of t)."""

    # requester side: positions in t's shard-major send buffer
    coll_pos: torch.Tensor
    excl_pos: torch.Tensor
    coll_send_splits: list[int]
    excl_send_splits: list[int]
    # owner side: shard rows of the received gradients, in received order
    coll_keys: torch.Tensor
    excl_keys: torch.Tensor
    coll_recv_splits: list[int]
    excl_recv_splits: list[int]
    # coll_keys' / excl_keys' row groupings, started after the mask exchange ("ahead")
    coll_groups: PendingRowGroups | None = None
    excl_groups: PendingRowGroups | None = None


@dataclass
class _StepCtx:
    """What step t's backward needs; lives from t's forward to t's backward."""

    dist: _IdDist
    generation: int
    from_ahead: bool  # t's embeddings came from a prioritized lookahead
    split: _GradSplit | None  # None: synchronous backward
    ahead: _Ahead | None  # t+1's lookahead (its collision rows are sent by t's backward)
    prev: _Ahead | None = None  # t's own lookahead (made by t-1), consumed by (c)
    stream: Any = None
    done: bool = False
    pending: _PendingAhead | None = None  # t+1's lookahead, finished in t's backward
    # prepare_backward ran the gradient-free part of t's backward (mask read, (a), (b)'s
    # second half) already; the compute stream waits for this side-stream event in the
    # backward, before it touches a row (None: nothing to wait for, or on CPU)
    prepared: bool = False
    prepared_event: Any = None


@dataclass
class _Deferred:
    """Step t's exclusive gradients in flight to their owners, applied at (a) of t+1."""

    aw: Awaitable
    keys: torch.Tensor
    step: int
    lr: float | None
    send: torch.Tensor  # kept alive (and counted) until applied
    groups: PendingRowGroups | None = None  # keys' grouping, started in t's backward


class _PrioritizedExchange(torch.autograd.Function):
    """Forward: (c), the merge of t's embeddings; backward: t's gradient exchange."""

    @staticmethod
    def forward(ctx, anchor, module, step_ctx):  # type: ignore[override]
        ctx.module = module
        ctx.step_ctx = step_ctx
        return module._embeddings_of_step(step_ctx)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.module._backward_of_step(ctx.step_ctx, grad)
        ctx.step_ctx = None
        return None, None, None


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(int(t.numel()) * t.element_size() for t in ts if t is not None)


def _seg_sums(masks: Sequence[torch.Tensor], splits: Sequence[Sequence[int]]) -> torch.Tensor:
    """Number of True entries in each consecutive segment of ``splits[i]`` of
    ``masks[i]``, for every mask in turn, as one int64 tensor: one scan over the
    concatenated masks and one host-to-device copy of the segment bounds for all of them
    (per mask, a scan, two small host tensors and a copy each)."""
    flat = torch.cat(list(masks)) if len(masks) > 1 else masks[0]
    cs = torch.zeros(flat.numel() + 1, dtype=torch.int64, device=flat.device)
    torch.cumsum(flat, 0, dtype=torch.int64, out=cs[1:])
    starts: list[int] = []
    ends: list[int] = []
    base = 0
    for mask, sizes in zip(masks, splits):
        at = base
        for size in sizes:
            starts.append(at)
            at += int(size)
            ends.append(at)
        base += mask.numel()
    # non-blocking: a blocking host-to-device copy would synchronise the stream
    both = torch.tensor([ends, starts], dtype=torch.int64).to(flat.device, non_blocking=True)
    return cs[both[0]] - cs[both[1]]


def _blocks(x: torch.Tensor, starts: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """``x[starts[j] : starts[j] + sizes[j]]`` concatenated over j (1-D ``x``; host lists):
    starts, sizes and the output offsets in one non-blocking host-to-device copy (a
    blocking one synchronises the stream), then one gather (`ops.gather_blocks`: a
    single Triton launch on CUDA)."""
    offsets = _offsets(sizes)
    total = offsets[-1] + int(sizes[-1]) if sizes else 0
    rows = torch.tensor([[*starts, 0], [*sizes, 0], [*offsets, total]], dtype=torch.int64).to(
        x.device, non_blocking=True
    )
    n = len(sizes)
    return gather_blocks(x, rows[0, :n], rows[1, :n], total, out_offsets=rows[2])


def _offsets(splits: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in splits:
        out.append(acc)
        acc += int(s)
    return out


def side_orders_on_device(comm: Any) -> bool:
    """Whether ``comm``'s transfers make one rank's GPU streams wait for another rank's
    GPU work: NCCL kernels, and the copy engine with device completion (its copy streams
    wait on the peers' inter-process events). Operations on such a communicator must be
    issued in the same order, relative to the other communicators' operations, on every
    rank — a rank-local choice of where they go (prepare_backward's event query) can
    close a wait cycle across ranks through the dense all-reduces (the suspected cause of
    a hang on 2 H200 at ef8d370: prioritized with the copy engine and no balancer,
    default-group all-reduce stuck on both ranks; the same variant hung again with this
    rule in force, so it is not the whole cause — BENCHMARKS.md e2e, session 14). The
    host-staged backend, gloo and the copy engine with host completion wait on the host
    only."""
    name = getattr(comm, "backend_name", "")
    if name == "nccl":
        return True
    return name == "copy_engine" and getattr(comm, "completion", "") == "device"


# ---------------------------------------------------------------------- the module
class PrioritizedEmbeddingCollection(ShardedEmbeddingCollection):
    """Vanilla-equivalent sharded embeddings with prioritized (collision-first) updates.

    Call as ``module(features_t, next_features=features_{t+1} or None)`` once per
    training step, after :meth:`set_step`; ``features_{t+1}`` must be what the next call
    receives (checked). Eval / no-grad calls first :meth:`flush`, then run the vanilla
    lookup. See the module docstring for the schedule and why it is exact.

    Options: ``max_collision_rate`` (guardrail: step t+1 runs synchronously when the
    share of its id occurrences that hit rows of step t exceeds it), ``side_comm`` (the
    communicator of the overlapped traffic; default a new group over ``comm``'s ranks),
    ``side_streams`` (CUDA side stream; default on for CUDA), ``debug_delay_s`` (random
    delays on the side work), ``early_prepare`` (default on: :meth:`prepare_backward` runs
    the gradient-free part of the backward early; off: it does nothing and the backward
    does it all), ``_mutation`` (test-only, one of :data:`MUTATIONS`).
    """

    uses_next_features = True
    #: disjoint ``stats.times`` keys of the sparse work inside forward / backward
    forward_time_keys = (
        "deferred_update",
        "id_dist",
        "collision_detect",
        "excl_lookup",
        "lookup",
        "emb_a2a",
        "coll_wait",
        "excl_wait",
    )
    backward_time_keys = ("grad_a2a", "sparse_update", "coll_lookup")
    # t+1's id dist is made in t's forward but its gradients are split by t+2's rows:
    # the subsets are grouped after the mask exchange instead (see _owner_split)
    _groups_in_input_dist = False

    def __init__(
        self,
        tables: Sequence[TableConfig],
        comm: Communicator,
        optim: SparseOptimConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        timing: bool = False,
        *,
        max_collision_rate: float = 0.9,
        side_comm: Communicator | None = None,
        side_streams: bool | None = None,
        debug_delay_s: float = 0.0,
        early_prepare: bool = True,
        _mutation: str | None = None,
    ) -> None:
        super().__init__(tables, comm, optim, device=device, dtype=dtype, seed=seed, timing=timing)
        self.early_prepare = bool(early_prepare)
        if _mutation is not None and _mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation '{_mutation}' (one of {MUTATIONS})")
        if not 0.0 <= max_collision_rate <= 1.0:
            raise ValueError(f"max_collision_rate must be in [0, 1], got {max_collision_rate}")
        self.max_collision_rate = float(max_collision_rate)
        self.side_comm = (
            side_comm if side_comm is not None else side_communicator(comm, f"{comm.name}.side")
        )
        # None: prepare_backward blocks iff the side group orders on the device
        # (side_orders_on_device); tests may force it
        self._prepare_blocks: bool | None = None
        if side_streams is None:
            side_streams = self.device.type == "cuda"
        if side_streams and self.device.type != "cuda":
            raise ValueError("side_streams needs a CUDA device")
        self.side_streams = bool(side_streams)
        self._side_stream = torch.cuda.Stream(self.device) if self.side_streams else None
        self.debug_delay_s = float(debug_delay_s)
        self._rng = random.Random(1_000_003 * (seed + 1) + comm.rank)
        self._mutation = _mutation
        self._mutation_fired = False
        self.pstats = PrioritizedStats()
        # collision bitmap over the shard's rows; all False between uses
        self._bitmap = torch.zeros(self.plan.total_local_rows, dtype=torch.bool, device=self.device)
        self._ahead: _Ahead | None = None
        self._pending: _PendingAhead | None = None  # t+1's lookahead until t's backward
        self._deferred: _Deferred | None = None
        self._open: _StepCtx | None = None  # forward done, backward not yet
        self._generation = 0
        self._peak: dict[str, int] = {}

    @property
    def prepare_blocks(self) -> bool:
        """Whether :meth:`prepare_backward` always runs (waiting for the mask copy)
        instead of deciding by a rank-local event query: true when the side group's
        transfers wait for the peers on the device (:func:`side_orders_on_device`)."""
        if self._prepare_blocks is not None:
            return self._prepare_blocks
        return side_orders_on_device(self.side_comm)

    @prepare_blocks.setter
    def prepare_blocks(self, value: bool | None) -> None:
        self._prepare_blocks = value

    # ------------------------------------------------------------------ streams
    def _compute_stream(self):
        return torch.cuda.current_stream(self.device) if self.side_streams else None

    def _on_side(self) -> contextlib.AbstractContextManager:
        if self._side_stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._side_stream)

    def _record(self, stream, *tensors: torch.Tensor | None) -> None:
        """Tell the caching allocator that ``stream`` uses these tensors too."""
        if stream is None:
            return
        for t in tensors:
            if t is not None and t.is_cuda:
                t.record_stream(stream)

    def _event_on_side(self):
        if self._side_stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self._side_stream)
        return ev

    def _delay(self) -> None:
        """``debug_delay_s``: a random delay on the side work (GPU sleep on the side
        stream, host sleep otherwise)."""
        if self.debug_delay_s <= 0:
            return
        s = self._rng.uniform(0.0, self.debug_delay_s)
        if self._side_stream is not None:
            khz = getattr(torch.cuda.get_device_properties(self.device), "clock_rate", 0) or 1.5e6
            torch.cuda._sleep(int(s * khz * 1e3))
        else:
            time.sleep(s)

    # --------------------------------------------------------------------- api
    def forward(  # type: ignore[override]
        self, features: Features, next_features: Features | None = None
    ) -> dict[str, torch.Tensor]:
        # a missing feature (or bad ids) is BadInputError on every rank at the id exchange
        # that takes them (input_dist); features already looked ahead are checked
        # against that look-ahead (check_lookahead)
        if not (torch.is_grad_enabled() and self.training):
            # evaluation: every deferred write first, then the plain lookup
            if self._has_pending():
                self.flush()
            st = self.input_dist(features)
            flat = self._lookup_exchange(st)
            return dict(zip(self.plan.features, torch.split(flat, st.feature_sizes)))
        if self._open is not None and not self._open.done:
            raise RuntimeError(
                "PrioritizedEmbeddingCollection: training forward of a new step before the "
                "backward of the previous one (call flush() to abandon a step)"
            )
        compute = self._compute_stream()
        if self._side_stream is not None:
            self._side_stream.wait_stream(compute)

        ahead, self._ahead = self._ahead, None
        early = self._mutation == "early_exclusive_lookup"
        if ahead is not None:
            self._check_ahead(ahead, features)
            dist_t = replace(ahead.dist, step=self._step, lr=self._lr)
        else:
            dist_t = None
        # (a) runs at the start of t's backward, before (b)'s second half (the first read
        # that needs it): a prioritized t reads no table row in its forward, so waiting
        # for t-1's exclusive gradients here would only stall the host. A synchronous t
        # reads rows now and applies any deferred update first (none is expected: a
        # deferred update implies that t was looked ahead and prioritized).
        if not early and (ahead is None or not ahead.prioritized):
            with self._on_side():
                self._apply_deferred()
        ev_a = self._event_on_side()
        if dist_t is None:  # no lookahead for t: id dist now, on the compute stream
            dist_t = self.input_dist(features)
            if self._side_stream is not None:
                self._record(self._side_stream, dist_t.recv_keys)
                self._side_stream.wait_stream(compute)

        split, nxt, pending = None, None, None
        if next_features is None:  # no lookahead: t updates synchronously
            self._group_sync_step(dist_t)
        if next_features is not None:  # (b): first half now, second half in t's backward
            with self._on_side():
                pending = self._look_ahead_start(dist_t, next_features)
            if early:  # mutation: all of (b), exclusive lookup included, before (a)
                nxt, split = self._look_ahead_finish(pending, compute)
                pending = None
        if early:
            with self._on_side():
                self._apply_deferred()
            ev_a = self._event_on_side()
        if ev_a is not None:
            compute.wait_event(ev_a)

        ctx = _StepCtx(
            dist=dist_t,
            generation=self._generation,
            from_ahead=ahead is not None and ahead.prioritized,
            split=split,
            ahead=nxt,
            prev=ahead,
            stream=compute,
            pending=pending,
        )
        self._ahead, self._pending = nxt, pending
        self._open = ctx
        flat = _PrioritizedExchange.apply(self._anchor, self, ctx)
        self._note_memory()
        return dict(zip(self.plan.features, torch.split(flat, dist_t.feature_sizes)))

    def flush(self) -> None:
        """Apply the deferred update and drop the lookahead, so that the tables hold every
        update of the steps run so far and the next step runs synchronously. Collective:
        every rank must call it at the same point (the trainer does: before evaluation,
        on errors and at the end of training)."""
        if self._mutation == "skip_flush":
            return
        had = self._has_pending()
        with self._on_side():
            self._apply_deferred()
        if self._ahead is not None:
            # in-flight collectives were issued by every rank: complete them, drop results
            for aw in (self._ahead.excl_aw, self._ahead.coll_aw):
                if aw is not None:
                    aw.wait()
            self._ahead = None
        self._pending = None  # its first half issued no collective still in flight
        if self._open is not None and not self._open.done:
            self._open.done = True  # its backward, should it run, is synchronous
        self._open = None
        self._generation += 1
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.tally.settle()  # the deferred rows counted on the device, flush's included
        if had:
            self.pstats.flushes += 1

    def extra_memory_bytes(self) -> dict[str, int]:
        """Bytes held now beyond the vanilla collection: ``ids_ahead`` (t+1's id dist:
        received shard rows and unbucketize permutation), ``exclusive_embeddings`` (t+1's,
        owner send + requester receive buffers), ``collision_embeddings`` (t+1's, in
        flight between t's backward and t+1's forward), ``deferred_gradients`` (t's
        exclusive gradients, send + receive + keys), ``masks`` (positions / keys of the
        collision and exclusive subsets, and the deferred rows' grouping),
        ``collision_bitmap`` (one byte per shard row)
        and ``total``."""
        out = {
            "ids_ahead": 0,
            "exclusive_embeddings": 0,
            "collision_embeddings": 0,
            "deferred_gradients": 0,
            "masks": 0,
            "collision_bitmap": _nbytes(self._bitmap),
        }
        a = self._ahead
        if a is not None:
            out["ids_ahead"] += _nbytes(a.dist.recv_keys, a.dist.unbucketize)
            out["masks"] += _nbytes(a.merge_perm, a.coll_keys)
            out["exclusive_embeddings"] += _nbytes(a.excl_send_rows)
            if a.excl_aw is not None:
                out["exclusive_embeddings"] += sum(a.excl_recv_splits) * self._row_bytes()
            out["collision_embeddings"] += _nbytes(a.coll_send_rows)
            if a.coll_aw is not None:
                out["collision_embeddings"] += sum(a.coll_recv_splits) * self._row_bytes()
        pa = self._pending  # t+1's lookahead between t's forward and t's backward
        if pa is not None:
            out["ids_ahead"] += _nbytes(pa.dn.recv_keys, pa.dn.unbucketize)
            out["masks"] += _nbytes(pa.coll_n, pa.reap_t, pa.counts)
        c = self._open
        if c is not None and not c.done and c.split is not None:
            s = c.split
            out["masks"] += _nbytes(s.coll_pos, s.excl_pos, s.coll_keys, s.excl_keys)
        d = self._deferred
        if d is not None:
            out["deferred_gradients"] += _nbytes(d.keys, d.send)
            out["deferred_gradients"] += int(d.keys.numel()) * self._row_bytes()
            if d.groups is not None:  # the keys' row grouping, started in t's backward
                g = d.groups
                out["masks"] += _nbytes(g.order, g.sorted_keys, g.is_start)
        out["total"] = sum(out.values())
        return out

    def peak_extra_memory_bytes(self) -> dict[str, int]:
        """Per-category maxima of :meth:`extra_memory_bytes` over the run (sampled at the
        end of every forward and backward)."""
        return dict(self._peak)

    # ------------------------------------------------------------ internals
    def _row_bytes(self) -> int:
        return self.plan.dim * self.weight.element_size()

    def _has_pending(self) -> bool:
        return (
            self._deferred is not None
            or self._ahead is not None
            or self._pending is not None
            or (self._open is not None and not self._open.done)
        )

    def _note_memory(self) -> None:
        for k, v in self.extra_memory_bytes().items():
            if v > self._peak.get(k, -1):
                self._peak[k] = v

    def _check_ahead(self, ahead: _Ahead, features: Features) -> None:
        """The ids looked ahead at step t must be the ids of step t+1."""
        check_lookahead(
            "PrioritizedEmbeddingCollection",
            self.plan.features,
            ahead.values,
            ahead.lengths,
            features,
        )

    # (a) -------------------------------------------------------------------
    def _apply_deferred(self) -> None:
        d, self._deferred = self._deferred, None
        if d is None:
            return
        t0 = self._tic()
        self._delay()
        grads = d.aw.wait()  # on CUDA: the current (side) stream waits for it
        self._record(self._side_stream, grads, d.keys)
        keys, step = d.keys, d.step
        lr = self.optim_cfg.lr if d.lr is None else d.lr
        if self._mutation == "deferred_lr":
            lr = lr * (1.0 + 2.0**-20)
        elif self._mutation == "deferred_step":
            step = max(step - 1, 1)
        elif (
            self._mutation == "drop_grad"
            and not self._mutation_fired
            and self.comm.rank == 0
            and keys.numel() > 0
        ):
            keys, grads = keys[:-1], grads[:-1]
            self._mutation_fired = True
        groups = d.groups if keys is d.keys else None  # (drop_grad shortens the keys)
        rows = self._apply_update(keys, grads, step, lr, groups)
        self.tally.add(self.pstats, "deferred_rows", rows)
        self.pstats.deferred_ids += int(keys.numel())
        self._toc("deferred_update", t0)

    # (b) -------------------------------------------------------------------
    def _look_ahead_finish(
        self, p: _PendingAhead, compute: Any
    ) -> tuple[_Ahead, _GradSplit | None]:
        """(b), second half, on the side stream; the results are recorded for use on
        the ``compute`` stream."""
        with self._on_side():
            nxt, split = self._look_ahead_rest(p)
            nxt.ready = self._event_on_side()
        self._record(
            compute,
            nxt.dist.recv_keys,
            nxt.dist.unbucketize,
            nxt.merge_perm,
            nxt.coll_keys,
            *(
                (split.coll_pos, split.excl_pos, split.coll_keys, split.excl_keys)
                if split is not None
                else ()
            ),
        )
        return nxt, split

    def _look_ahead_start(self, dist_t: _IdDist, next_features: Features) -> _PendingAhead:
        """(b), first half: t+1's id dist, the owner's collision masks and counts and
        their exchange (:meth:`_mask_exchange_start`), all on the device (no read-back)."""
        plan = self.plan
        dn = self.input_dist(next_features)
        values = [next_features[f][0] for f in plan.features]
        lengths = [next_features[f][1] for f in plan.features]
        keys_t, keys_n = dist_t.recv_keys, dn.recv_keys
        t0 = self._tic()
        # collision bitmap at the owner, in shard-major form
        # (index_fill_, not ``bm[keys] = True``: assigning a Python scalar copies it to the
        # device from pageable memory, which synchronises the stream)
        bm = self._bitmap
        bm.index_fill_(0, keys_t, True)
        coll_n = bm[keys_n]  # ids of t+1 whose row t touches
        bm.index_fill_(0, keys_t, False)
        bm.index_fill_(0, keys_n, True)
        reap_t = bm[keys_t]  # ids of t whose row t+1 touches
        # distinct rows by popcount (device scalars, read with the other counts at once;
        # torch.unique would sort and synchronise twice): rows of t+1, and those of them
        # that t also touches (cleared by keys_t)
        total_rows = bm.sum()
        bm.index_fill_(0, keys_t, False)
        coll_rows = total_rows - bm.sum()
        bm.index_fill_(0, keys_n, False)
        # per source rank: reappearing ids of t, then collision ids of t+1
        per_src = _seg_sums([reap_t, coll_n], [dist_t.recv_splits, dn.recv_splits])
        counts = torch.cat([per_src, torch.stack([coll_rows, total_rows]).to(torch.int64)])
        p = _PendingAhead(dist_t, dn, values, lengths, coll_n, reap_t, counts)
        self._mask_exchange_start(p)
        self._toc("collision_detect", t0)
        return p

    def _look_ahead_rest(self, p: _PendingAhead) -> tuple[_Ahead, _GradSplit | None]:
        """(b), second half: read the mask exchange's trailers (the one read-back), split
        t's gradients, send t+1's exclusive rows."""
        dist_t, dn, coll_n = p.dist_t, p.dn, p.coll_n
        keys_n = dn.recv_keys
        values, lengths = p.values, p.lengths
        if p.exchanged is None:
            self._exchange_masks(p)
        assert p.exchanged is not None
        owner_split = p.owner_split
        coll_y, reap_y, decision, sums = p.exchanged
        tr, own = sums
        coll_occ, total_occ = int(tr[:, 2].sum()), int(tr[:, 3].sum())
        coll_rows, total_rows = int(tr[:, 4].sum()), int(tr[:, 5].sum())
        ps = self.pstats
        ps.lookaheads += 1
        ps.collision_ids += coll_occ
        ps.collision_rows += coll_rows
        ps.exclusive_ids += total_occ - coll_occ
        ps.exclusive_rows += total_rows - coll_rows
        ps.next_ids += total_occ
        ps.next_rows += total_rows
        ps.history.append(
            (
                self._step + 1,
                coll_rows / total_rows if total_rows else 0.0,
                coll_occ / total_occ if total_occ else 0.0,
                decision,
            )
        )
        ahead = _Ahead(dist=dn, values=values, lengths=lengths, prioritized=decision)
        if not decision:
            ps.fallbacks += 1
            return ahead, None
        w = self.comm.world_size
        # owner side
        reap_per_src, coll_per_src = own[:w], own[w : 2 * w]
        # positions from counts already on the host (no nonzero / boolean-index syncs)
        n_coll_own = sum(coll_per_src)
        assert owner_split is not None  # made with the exchange when it decided so
        # t+1's ids at this owner: collision ids, then exclusive ids, each in received order
        parted = keys_n.index_select(0, mask_partition(coll_n, n_coll_own))
        ahead.coll_keys, excl_keys_n = parted[:n_coll_own], parted[n_coll_own:]
        ahead.coll_send_splits = coll_per_src
        excl_send_splits = [a - b for a, b in zip(dn.recv_splits, coll_per_src)]
        # requester side
        ahead.coll_recv_splits = tr[:, 1].tolist()
        ahead.excl_recv_splits = [a - b for a, b in zip(dn.send_splits, ahead.coll_recv_splits)]
        n_coll = sum(ahead.coll_recv_splits)
        # each received row's slot in [collision rows | exclusive rows], in batch order
        ahead.merge_perm = partition_ranks(coll_y, n_coll).index_select(0, dn.unbucketize)
        g_coll = tr[:, 0].tolist()
        n_reap_req = sum(g_coll)
        reap_pos = mask_partition(reap_y, n_reap_req)
        split = _GradSplit(
            coll_pos=reap_pos[:n_reap_req],
            excl_pos=reap_pos[n_reap_req:],
            coll_send_splits=g_coll,
            excl_send_splits=[a - b for a, b in zip(dist_t.send_splits, g_coll)],
            coll_keys=owner_split[0],
            excl_keys=owner_split[1],
            coll_recv_splits=reap_per_src,
            excl_recv_splits=[a - b for a, b in zip(dist_t.recv_splits, reap_per_src)],
            coll_groups=owner_split[2],
            excl_groups=owner_split[3],
        )
        # t+1's exclusive rows: every earlier update of them is applied (see docstring)
        self._delay()
        t0 = self._tic()
        rows = self.weight.index_select(0, excl_keys_n)
        ahead.excl_send_rows = rows
        ahead.excl_aw = self.side_comm.all_to_all_v(
            rows, excl_send_splits, ahead.excl_recv_splits, name="exclusive_embeddings"
        )
        self.stats.emb_bytes_sent += (
            sum(excl_send_splits) - excl_send_splits[self.comm.rank]
        ) * self._row_bytes()
        self._toc("excl_lookup", t0)
        return ahead, split

    def _exchange_masks(self, p: _PendingAhead) -> None:
        """The read of (b)'s mask exchange (issued in t's forward), stored in
        ``p.exchanged``, and the owner split. In t's backward it runs on the side stream
        *before* (a): the owner split's groupings queued after (a)'s deferred update
        would wait for that update's kernels."""
        t0 = self._tic()
        p.exchanged = self._mask_exchange(p)
        if p.exchanged[2]:  # prioritized: t's gradients will split by t+1's rows
            p.owner_split = self._owner_split(p)
        else:  # fallback: t updates synchronously
            self._group_sync_step(p.dist_t)
        self._toc("collision_detect", t0)

    def _group_sync_step(self, dist_t: _IdDist) -> None:
        """Start the row grouping of a step t known to update synchronously (no lookahead:
        the last step before a flush or the end; a fallback), as the plain collection's id
        dist does for every step (``ahead`` update). Its update then runs the grouped path
        and kernels of every other step. Without it, such a step took the padded path, whose
        first use (on CUDA: the last step of a run) compiled Triton kernels that no earlier
        step had needed, a stall of seconds inside the last steps that the e2e report
        profiles. A step made stale by a flush after its forward still takes the padded
        path."""
        if dist_t.groups is None and self.update_mode(dist_t.recv_keys.is_cuda) == "ahead":
            dist_t.groups = group_rows_start(dist_t.recv_keys)

    def _owner_split(self, p: _PendingAhead) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
        """Owner side of t's gradient split: the shard rows of t's ids that t+1 touches
        (their gradients are applied in t's backward) and the others (deferred to (a) of
        t+1), in received order; with the ``ahead`` update, both row groupings are started
        here — right after the exchange, before (a)'s kernels are queued behind them on
        the side stream — so the updates read their row counts without waiting."""
        assert p.exchanged is not None
        own = p.exchanged[3][1]
        w = self.comm.world_size
        keys_t, reap_t = p.dist_t.recv_keys, p.reap_t
        n_reap_own = sum(own[:w])
        parted = keys_t.index_select(0, mask_partition(reap_t, n_reap_own))
        coll_keys, excl_keys = parted[:n_reap_own], parted[n_reap_own:]
        coll_groups = excl_groups = None
        if self.update_mode(keys_t.is_cuda) == "ahead":
            coll_groups, excl_groups = group_rows_start(coll_keys), group_rows_start(excl_keys)
        return coll_keys, excl_keys, coll_groups, excl_groups

    def _mask_exchange_start(self, p: _PendingAhead) -> None:
        """Owner -> requesters, one all-to-all, issued in t's forward right after (b)'s
        first half, on the same stream, with no host read: per source s, [reappear mask
        of s's ids of t | collision mask of s's ids of t+1 | int64 trailer (reappear
        count of s, collision count of s, collision ids, ids, collision rows, distinct
        rows of t+1 at this owner)], the trailer built on the device from the counts.
        Every rank receives every owner's totals, so all ranks compute the same global
        rate and take the same guardrail decision (:meth:`_mask_exchange`). It reads and
        writes no row, so it may run this early; its one host read waits in t's backward
        for an event recorded here."""
        dist_t, dn, coll_n, reap_t, c = p.dist_t, p.dn, p.coll_n, p.reap_t, p.counts
        w = self.comm.world_size
        keys_t, keys_n = dist_t.recv_keys, dn.recv_keys
        nt, nn_ = int(keys_t.numel()), int(keys_n.numel())
        # totals: collision ids, ids (a host int: a fill, no host-to-device copy),
        # collision rows, distinct rows of t+1
        totals = torch.cat([c[w : 2 * w].sum().reshape(1), c.new_full((1,), nn_), c[2 * w :]])
        trailer = torch.cat(
            [c[:w].reshape(w, 1), c[w : 2 * w].reshape(w, 1), totals.reshape(1, 4).expand(w, 4)],
            dim=1,
        ).contiguous()
        x = torch.cat(
            [
                reap_t.view(torch.uint8),
                coll_n.view(torch.uint8),
                trailer.view(torch.uint8).reshape(-1),
            ]
        )
        st, sn = _offsets(dist_t.recv_splits), _offsets(dn.recv_splits)
        starts, sizes = [], []
        for s in range(w):
            starts += [st[s], nt + sn[s], nt + nn_ + _TRAILER_BYTES * s]
            sizes += [dist_t.recv_splits[s], dn.recv_splits[s], _TRAILER_BYTES]
        payload = _blocks(x, starts, sizes)
        out_splits = [a + b + _TRAILER_BYTES for a, b in zip(dist_t.send_splits, dn.send_splits)]
        in_splits = [a + b + _TRAILER_BYTES for a, b in zip(dist_t.recv_splits, dn.recv_splits)]
        y = self.comm.all_to_all_v(payload, in_splits, out_splits, name="collision_masks").wait()
        oy = _offsets(out_splits)
        # one gather for the three parts: [trailers | reappear masks | collision masks],
        # each in dest order, then slices of it (trailers first: their int64 view needs
        # the allocation's alignment)
        a, b = dist_t.send_splits, dn.send_splits
        parts = _blocks(
            y,
            [oy[d] + a[d] + b[d] for d in range(w)]
            + [oy[d] for d in range(w)]
            + [oy[d] + a[d] for d in range(w)],
            [_TRAILER_BYTES] * w + list(a) + list(b),
        )
        nt_, na = _TRAILER_BYTES * w, int(sum(a))
        tr = parts[:nt_]
        reap_y = parts[nt_ : nt_ + na].view(torch.bool)  # views: bytes that were bools
        coll_y = parts[nt_ + na :].view(torch.bool)
        both = torch.cat([tr.view(torch.int64), c])  # [w * _TRAILER received | 2w + 2 own]
        p.masks_y = (coll_y, reap_y)
        if self._side_stream is not None:
            p.host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
            p.host.copy_(both, non_blocking=True)
            p.host_ready = self._event_on_side()
        else:
            p.host = both

    def _mask_exchange(
        self, p: _PendingAhead
    ) -> tuple[torch.Tensor, torch.Tensor, bool, tuple[torch.Tensor, list[int]]]:
        """The mask exchange's one host read (in t's backward): every owner's trailer
        and this owner's counts; the guardrail decision from the global totals."""
        assert p.masks_y is not None and p.host is not None
        w = self.comm.world_size
        if p.host_ready is not None:
            with device_wait("mask_read"):
                p.host_ready.synchronize()
        both = p.host.tolist()
        tr = torch.tensor(both[: w * _TRAILER], dtype=torch.int64).reshape(w, _TRAILER)
        own = both[w * _TRAILER : w * _TRAILER + 2 * w]
        coll_occ, total_occ = int(tr[:, 2].sum()), int(tr[:, 3].sum())
        decision = total_occ == 0 or coll_occ <= self.max_collision_rate * total_occ
        coll_y, reap_y = p.masks_y
        return coll_y, reap_y, decision, (tr, own)

    # (c) -------------------------------------------------------------------
    def _embeddings_of_step(self, ctx: _StepCtx) -> torch.Tensor:
        prev, ctx.prev = ctx.prev, None
        compute = ctx.stream
        if prev is not None and prev.ready is not None:
            compute.wait_event(prev.ready)
        if not ctx.from_ahead:
            return self._lookup_exchange(ctx.dist)
        assert prev is not None and prev.excl_aw is not None
        if prev.coll_aw is None:  # pragma: no cover - guarded by the forward's check
            raise RuntimeError("collision rows of this step were never sent")
        t0 = self._tic()
        coll = prev.coll_aw.wait()
        self._toc("coll_wait", t0)
        t0 = self._tic()
        excl = prev.excl_aw.wait()
        self._record(compute, excl)
        self._toc("excl_wait", t0)
        merged = torch.cat([coll, excl]).index_select(0, prev.merge_perm)
        return merged

    # backward ---------------------------------------------------------------
    def prepare_backward(self, block: bool = False) -> bool:
        """Explicit hook between step t's forward and ``loss.backward()`` (the trainer
        calls it): run now the part of t's backward that needs no gradient of t — the
        mask exchange's host read, (a) the deferred update of t-1, (b)'s second half
        (the split, t+1's exclusive rows sent) — so that when the dense backward reaches
        the embeddings the autograd thread only splits and sends t's gradients (the
        collision-gradient all-to-all is issued that much sooner). Without ``block`` it
        runs only if the mask exchange has already reached the host (an event query,
        never a wait: on CUDA a host far ahead of the GPU leaves it to the backward);
        otherwise, and if never called, the backward does it. The same operations in the
        same order on every stream and communicator either way (bitwise the same
        results); the compute stream waits for (a) in the backward, not here, so the
        dense backward is not held up. Rank-local (issues no collective out of order:
        the side group's next operation is t+1's exclusive rows in both places) —
        except across NCCL communicators: NCCL requires operations on different
        communicators of one device to be launched in the same order on every rank, and
        t+1's exclusive rows would go out before the dense backward's all-reduces on one
        rank and after them on another; the copy engine with device completion is the
        same (its copy streams wait on the peers' events; suspected in a hang on 2 H200
        at ef8d370). So with a side group that orders on the device
        (:attr:`prepare_blocks`) the choice is not rank-local: it always runs, waiting
        for the mask exchange's host copy (which the forward issued early; the wait is
        short and the GPU still has the dense forward queued). Returns whether it ran
        now."""
        ctx = self._open
        if not self.early_prepare or ctx is None or ctx.done or ctx.prepared:
            return False
        if ctx.generation != self._generation:
            return False
        p = ctx.pending
        block = block or self.prepare_blocks
        if p is not None and not block and p.host_ready is not None:
            if not p.host_ready.query():
                return False
        ctx.prepared_event = self._gradient_free_part(ctx, lookahead=True)
        ctx.prepared = True
        self.pstats.prepared_steps += 1
        return True

    def _gradient_free_part(self, ctx: _StepCtx, lookahead: bool) -> Any:
        """The part of t's backward that needs no gradient of t, in this order: (b)'s
        mask read and owner split (ahead of (a), see :meth:`_exchange_masks`), (a) the
        deferred update of t-1, then (b)'s second half (only with ``lookahead``: a stale
        step has none). Returns the side-stream event after (a) (None on CPU), which the
        compute stream waits for before it touches a row."""
        p = ctx.pending if lookahead else None
        with self._on_side():
            if p is not None:
                self._exchange_masks(p)
            if self._deferred is not None and self._mutation != "early_exclusive_lookup":
                self._apply_deferred()  # (a)
        ev_a = self._event_on_side()
        if p is not None:  # (b), second half
            ctx.ahead, ctx.split = self._look_ahead_finish(p, ctx.stream)
            ctx.pending = None
            self._ahead, self._pending = ctx.ahead, None
        return ev_a

    def _backward_of_step(self, ctx: _StepCtx, grad: torch.Tensor) -> None:
        stale = ctx.generation != self._generation or ctx.done
        ctx.done = True
        if self._open is ctx:
            self._open = None
        stream_cm = (
            torch.cuda.stream(ctx.stream) if ctx.stream is not None else contextlib.nullcontext()
        )
        with stream_cm:
            if not ctx.prepared:  # else prepare_backward did it
                ctx.prepared_event = self._gradient_free_part(ctx, lookahead=not stale)
            if ctx.prepared_event is not None:  # (a) before this stream touches a row
                ctx.stream.wait_event(ctx.prepared_event)
            if stale or ctx.split is None:
                self._grad_exchange_and_update(ctx.dist, grad)
                self.pstats.sync_steps += 1
            else:
                if ctx.ahead is not None and ctx.ahead.ready is not None:
                    ctx.stream.wait_event(ctx.ahead.ready)
                self._split_backward(ctx, grad)
                if ctx.from_ahead:
                    self.pstats.prioritized_steps += 1
                else:
                    self.pstats.sync_steps += 1
        self._note_memory()

    def _split_backward(self, ctx: _StepCtx, grad: torch.Tensor) -> None:
        st, sp, nxt = ctx.dist, ctx.split, ctx.ahead
        assert sp is not None and nxt is not None
        t0 = self._tic()
        grad = grad.contiguous().to(self.dtype)
        send = ranged_combine_backward(grad, st.unbucketize)  # shard-major, t's send order
        g_coll = send.index_select(0, sp.coll_pos)
        g_excl = send.index_select(0, sp.excl_pos)
        recv = self.comm.all_to_all_v(
            g_coll, sp.coll_send_splits, sp.coll_recv_splits, name="collision_grads"
        ).wait()
        rb = self._row_bytes()
        self.stats.grad_bytes_sent += (
            sum(sp.coll_send_splits) - sp.coll_send_splits[self.comm.rank]
        ) * rb
        self._toc("grad_a2a", t0)
        t0 = self._tic()
        self._apply_update(sp.coll_keys, recv, st.step, st.lr, sp.coll_groups)
        self._toc("sparse_update", t0)
        # t+1's collision rows, now updated: what (c) of t+1 waits for
        t0 = self._tic()
        rows = self.weight.index_select(0, nxt.coll_keys)
        nxt.coll_send_rows = rows
        nxt.coll_aw = self.comm.all_to_all_v(
            rows, nxt.coll_send_splits, nxt.coll_recv_splits, name="collision_embeddings"
        )
        self.stats.emb_bytes_sent += (
            sum(nxt.coll_send_splits) - nxt.coll_send_splits[self.comm.rank]
        ) * rb
        self._toc("coll_lookup", t0)
        # t's exclusive gradients: applied at (a) of t+1
        aw = self.side_comm.all_to_all_v(
            g_excl, sp.excl_send_splits, sp.excl_recv_splits, name="exclusive_grads"
        )
        self.stats.grad_bytes_sent += (
            sum(sp.excl_send_splits) - sp.excl_send_splits[self.comm.rank]
        ) * rb
        self._deferred = _Deferred(
            aw=aw, keys=sp.excl_keys, step=st.step, lr=st.lr, send=g_excl, groups=sp.excl_groups
        )
        self.stats.steps += 1


# ---------------------------------------------------------------------- factory
def make_embedding_collection(
    kind: str,
    tables: Sequence[TableConfig],
    comm: Communicator,
    optim: SparseOptimConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    timing: bool = False,
    **options: Any,
) -> ShardedEmbeddingCollection:
    """The embedding collection of a training mode: ``"vanilla"`` (synchronous, TorchRec's
    schedule), ``"sdd"`` (vanilla with the next step's id dist ahead, embedding/sdd.py;
    option ``side_comm``) or ``"prioritized"`` (this module; ``options`` go to its
    constructor)."""
    if kind == "vanilla":
        if options:
            raise ValueError(f"the vanilla collection takes no options, got {sorted(options)}")
        return ShardedEmbeddingCollection(
            tables, comm, optim, device=device, dtype=dtype, seed=seed, timing=timing
        )
    if kind == "sdd":
        extra = sorted(set(options) - {"side_comm"})
        if extra:
            raise ValueError(f"the sdd collection takes only side_comm, got {extra}")
        return SddEmbeddingCollection(
            tables, comm, optim, device=device, dtype=dtype, seed=seed, timing=timing, **options
        )
    if kind == "prioritized":
        return PrioritizedEmbeddingCollection(
            tables, comm, optim, device=device, dtype=dtype, seed=seed, timing=timing, **options
        )
    raise ValueError(f"unknown embedding collection kind '{kind}' (vanilla, sdd, prioritized)")
