"""Sparse data dist ahead ("sdd", DESIGN.md section 3): step t+1's id dist during step t.

Owns :class:`SddEmbeddingCollection`, a drop-in subclass of the vanilla
:class:`~freescale.embedding.collection.ShardedEmbeddingCollection` (same weights, same
fused optimizer, same sharding plan, same outputs), and its counters
(:class:`SddStats`). It may not touch the dense model or the trainer; it reads nothing
but the ids given to it (``features`` of step t and ``next_features`` of step t+1).

Schedule of training step t (``forward(features_t, next_features=features_{t+1})``):

* t's id dist (bucketise by owner, counts all-to-all, ids all-to-all) is taken from the
  lookahead made at step t-1; without one (first step, after :meth:`flush`, after an
  eval / no-grad forward) it runs now, blocking, as in vanilla;
* then t+1's id dist runs (skipped on the last step, ``next_features is None``): on CUDA
  on a side stream, always on a side communicator (its own process group by default),
  so on NCCL it never queues in front of the blocking traffic of ``comm``;
* t's lookup, embedding all-to-all, gradient all-to-all and fused update are exactly
  vanilla's, blocking, on ``comm``.

Why it is exact. The id dist depends on the ids only, never on the weights, so doing it
one step early changes nothing it produces; the step index and learning rate of the
update are those of step t+1's :meth:`set_step` (the lookahead's are replaced when it is
consumed). Every row therefore sees the same reads, gradient sums and updates, in the
same order, as vanilla: parameters and optimizer state are bit for bit equal. The ids
given at step t+1 are checked against the ``next_features`` of step t (by identity,
else by equality); a mismatch raises ``ValueError`` naming the feature.

Collectives. Every rank issues the same collectives on each communicator in the same
order: whether step t uses a lookahead depends only on calls every rank makes
(training forward with or without ``next_features``, eval forward, :meth:`flush`), so
these calls are collective.

CUDA. The side stream first waits for the compute stream (``wait_compute``, default
on; the trainer copies the next batch to the device on the compute stream), then runs
t+1's id dist and records an event; step t+1's forward makes the compute stream wait on
that event before it reads the result. Tensors crossing streams are
``record_stream``-ed. The id dist needs split sizes on the host, so the host waits for
the side stream there (as vanilla waits for the compute stream). On CPU the same code
runs synchronously.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..comm.base import Communicator, side_communicator
from ..config import SparseOptimConfig, TableConfig
from .collection import ShardedEmbeddingCollection, _IdDist, _VanillaExchange, check_lookahead

__all__ = ["SddEmbeddingCollection", "SddStats", "MUTATIONS"]

Features = Mapping[str, tuple[torch.Tensor, torch.Tensor]]

#: test-only deliberate bugs, each of which the exactness tests must catch
MUTATIONS = (
    "unchecked_lookahead",  # the ids of step t+1 are not checked against the lookahead
    "stale_step_lr",  # step t+1 updates with the step index and lr captured at step t
)


@dataclass
class SddStats:
    """Counters of the sdd schedule. ``ahead_steps``: training steps whose id dist came
    from the lookahead (every step but the first of an undisturbed run); ``sync_steps``:
    training steps that ran their own id dist; ``lookaheads``: id dists issued one step
    ahead; ``dropped``: lookaheads dropped unused (eval / no-grad forward, flush)."""

    ahead_steps: int = 0
    sync_steps: int = 0
    lookaheads: int = 0
    dropped: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Ahead:
    """Step t+1's id dist as made by step t."""

    dist: _IdDist  # its step / lr are replaced at t+1's forward
    values: list[torch.Tensor]  # t+1's ids as given, to check the call of t+1
    lengths: list[torch.Tensor]
    ready: Any = None  # CUDA event recorded on the side stream after the id dist


class SddEmbeddingCollection(ShardedEmbeddingCollection):
    """Vanilla exchange with the id dist of step t+1 run during step t.

    Call as ``module(features_t, next_features=features_{t+1} or None)`` once per
    training step, after :meth:`set_step`; ``features_{t+1}`` must be what the next call
    receives (checked). Eval / no-grad calls drop the lookahead and run the vanilla
    lookup. See the module docstring for the schedule and why it is exact.

    Options: ``side_comm`` (the communicator of the lookahead's id dist; default a new
    group over ``comm``'s ranks), ``wait_compute`` (CUDA: the side stream waits for the
    compute stream before reading ``next_features``; pass False only when they are
    complete already), ``_mutation`` (test-only, one of :data:`MUTATIONS`).
    """

    uses_next_features = True
    #: disjoint ``stats.times`` keys of the sparse work inside forward / backward
    forward_time_keys = ("id_dist", "id_dist_ahead", "lookup", "emb_a2a")
    backward_time_keys = ("grad_a2a", "sparse_update")

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
        side_comm: Communicator | None = None,
        wait_compute: bool = True,
        _mutation: str | None = None,
    ) -> None:
        super().__init__(tables, comm, optim, device=device, dtype=dtype, seed=seed, timing=timing)
        if _mutation is not None and _mutation not in MUTATIONS:
            raise ValueError(f"unknown mutation '{_mutation}' (one of {MUTATIONS})")
        if side_comm is None:
            side_comm = side_communicator(comm, "embedding-side")
        elif (side_comm.world_size, side_comm.rank) != (comm.world_size, comm.rank):
            raise ValueError(
                f"side_comm is rank {side_comm.rank} of {side_comm.world_size}, but comm is "
                f"rank {comm.rank} of {comm.world_size}: both must span the same ranks"
            )
        self.side_comm = side_comm
        self.wait_compute = bool(wait_compute)
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._mutation = _mutation
        self.sdd_stats = SddStats()
        self._ahead: _Ahead | None = None
        self._running_ahead = False

    # --------------------------------------------------------------------- api
    def forward(  # type: ignore[override]
        self, features: Features, next_features: Features | None = None
    ) -> dict[str, torch.Tensor]:
        # a missing feature (or bad ids) is BadInputError on every rank at the id exchange
        # that takes them (input_dist); features already looked ahead are checked
        # against that look-ahead (check_lookahead)
        if not (torch.is_grad_enabled() and self.training):
            self.flush()  # evaluation: the lookahead is dropped, the lookup is vanilla's
            return super().forward(features)
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            st = self.input_dist(features)
            self.sdd_stats.sync_steps += 1
        else:
            if self._mutation != "unchecked_lookahead":
                self._check_ahead(ahead, features)
            if ahead.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(ahead.ready)
            st = ahead.dist
            if self._mutation != "stale_step_lr":
                st = replace(st, step=self._step, lr=self._lr)
            self.sdd_stats.ahead_steps += 1
        if next_features is not None:
            self._ahead = self._look_ahead(next_features)
        flat = _VanillaExchange.apply(self._anchor, self, st)
        return dict(zip(self.plan.features, torch.split(flat, st.feature_sizes)))

    def flush(self) -> None:
        """Drop the lookahead, so that the next step runs its own id dist (its ids may not
        be the ones looked ahead: a restored checkpoint, a retried step). Nothing is
        deferred, so the tables always hold every update. Collective: every rank must
        call it at the same point (the trainer does: before evaluation, on errors and at
        the end of training)."""
        if self._ahead is not None:
            if self._ahead.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(self._ahead.ready)
            self._ahead = None
            self.sdd_stats.dropped += 1

    # ------------------------------------------------------------ internals
    def _toc(self, key: str, t0: float) -> None:
        if self._running_ahead and key == "id_dist":
            key = "id_dist_ahead"
        super()._toc(key, t0)

    def _look_ahead(self, next_features: Features) -> _Ahead:
        """Step t+1's id dist on the side communicator (and, on CUDA, the side stream)."""
        # a feature missing here is input_dist's BadInputError, raised on every rank
        values = [next_features[f][0] for f in self.plan.features if f in next_features]
        lengths = [next_features[f][1] for f in self.plan.features if f in next_features]
        main, self.comm = self.comm, self.side_comm
        self._running_ahead = True
        try:
            if self._side is None:
                ahead = _Ahead(self.input_dist(next_features), values, lengths)
            else:
                compute = torch.cuda.current_stream(self.device)
                if self.wait_compute:
                    self._side.wait_stream(compute)
                with torch.cuda.stream(self._side):
                    for v in values:
                        if v.is_cuda:
                            v.record_stream(self._side)
                    nd = self.input_dist(next_features)
                    ready = torch.cuda.Event()
                    ready.record(self._side)
                for t in (nd.recv_keys, nd.unbucketize):
                    t.record_stream(compute)
                ahead = _Ahead(nd, values, lengths, ready)
        finally:
            self.comm = main
            self._running_ahead = False
        self.sdd_stats.lookaheads += 1
        return ahead

    def _check_ahead(self, ahead: _Ahead, features: Features) -> None:
        """The ids looked ahead at step t must be the ids of step t+1."""
        check_lookahead(
            "SddEmbeddingCollection", self.plan.features, ahead.values, ahead.lengths, features
        )
