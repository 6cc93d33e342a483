"""Row-wise sharded embedding collection with the vanilla (synchronous) schedule.

Owns: the row-wise sharding plan (TorchRec's: block = ceil(rows / W), rank r owns rows
``[r*block, min((r+1)*block, rows))``), the shard's weights and fused optimizer state,
and the vanilla exchange of DESIGN.md section 1:

  forward   id dist (counts all-to-all, ids all-to-all) -> lookup at the owner in
            shard-major order -> embedding all-to-all -> batch-major, per feature
  backward  gradient all-to-all to the owners -> per-row sum in the fixed order of
            embedding/reduce.py -> fused sparse optimizer (embedding/optim.py)

Output is unpooled (sequence) embeddings like TorchRec's ``EmbeddingCollection``:
feature ``f`` with ``N_f`` ids gives an ``[N_f, D]`` tensor. Several features may share a
table; rows are keyed by (table, row), never by feature. All tables of one collection
have the same embedding dim (one exchange per step, as TorchRec groups them).

The embedding weights are not ``nn.Parameter``s: their update is fused into backward,
so no dense optimizer or DDP may see them. The step index and learning rate of an
update are captured when the forward runs (tier 1 condition (iii)).

It may not touch the dense model, and never reads data other than the ids given to it.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator
from ..config import SparseOptimConfig, TableConfig
from ..data.validate import BadInputError
from ..kernels import ranged_combine, ranged_combine_backward, ranged_dispatch
from ..kernels.reference import owner_counts
from .optim import FusedSparseOptimizer
from .reduce import (
    PendingRowGroups,
    group_rows,
    group_rows_padded,
    group_rows_start,
    segment_sum,
)

# how the owner groups a step's gradients by row before the fused update:
# "auto" (ahead on CUDA; sync on CPU, where a read-back is free),
# "sync" (group_rows in the backward: reads the unique-row count back, which waits for
# the dense backward queued before it), "padded" (group_rows_padded: no read-back, one
# slot per id, so the sum and the update run over every id instead of every row) or
# "ahead" (group_rows_start when the ids arrive in the forward, its two counts copied to
# the host behind an event and read in the backward, long after; the prioritized
# schedule starts it for its subsets after the mask exchange and for its synchronous
# steps when they are known to be; where no grouping was started ahead — a step made
# stale by a flush after its forward — padded on CUDA).
# All give bit-identical parameters and optimizer state.
SPARSE_UPDATE_ENV_VAR = "FREESCALE_SPARSE_UPDATE"
SPARSE_UPDATE_MODES = ("auto", "sync", "padded", "ahead")


class DeviceTally:
    """Host ``int`` counters fed with device scalars without a read-back: each value is
    copied to pinned host memory behind an event on the current stream; :meth:`poll`
    adds the copies that finished (never waits), :meth:`settle` waits for all. The
    counters lag the device by the copies still in flight."""

    def __init__(self) -> None:
        self._q: deque[tuple[object, str, torch.Tensor, torch.cuda.Event]] = deque()

    def add(self, target: object, attr: str, value: torch.Tensor | int) -> None:
        if isinstance(value, int) or not value.is_cuda:
            setattr(target, attr, getattr(target, attr) + int(value))
            return
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        host.copy_(value, non_blocking=True)  # on value's device's current stream
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(value.device))
        self._q.append((target, attr, host, ev))
        self.poll()

    def poll(self, wait: bool = False) -> None:
        while self._q:
            target, attr, host, ev = self._q[0]
            if wait:
                ev.synchronize()
            elif not ev.query():
                return
            setattr(target, attr, getattr(target, attr) + int(host.sum()))
            self._q.popleft()

    def settle(self) -> None:
        self.poll(wait=True)


__all__ = [
    "SPARSE_UPDATE_ENV_VAR",
    "SPARSE_UPDATE_MODES",
    "DeviceTally",
    "ExchangeStats",
    "RowWisePlan",
    "ShardedEmbeddingCollection",
    "init_table_rows",
]

_INIT_CHUNK = 4096


def init_table_rows(
    table: TableConfig, table_index: int, start: int, stop: int, seed: int, dtype: torch.dtype
) -> torch.Tensor:
    """Initial values of rows ``start..stop-1``: a function of (seed, table, row) only, so
    any sharding or world size starts from the same table."""
    d = table.embedding_dim
    out = torch.empty(max(stop - start, 0), d, dtype=dtype)
    if stop <= start:
        return out
    first, last = start // _INIT_CHUNK, (stop - 1) // _INIT_CHUNK
    for c in range(first, last + 1):
        g = torch.Generator().manual_seed((seed * 1_000_003 + table_index * 7919 + c) % 2**63)
        chunk = torch.randn(_INIT_CHUNK, d, generator=g, dtype=torch.float64) * table.init_std
        lo, hi = max(start, c * _INIT_CHUNK), min(stop, (c + 1) * _INIT_CHUNK)
        out[lo - start : hi - start] = chunk[lo - c * _INIT_CHUNK : hi - c * _INIT_CHUNK].to(dtype)
    return out


@dataclass
class RowWisePlan:
    """Which rows of which table live on which rank, and where in the shard tensor."""

    tables: list[TableConfig]
    world_size: int
    rank: int
    features: list[str] = field(init=False)
    feature_table: list[int] = field(init=False)
    block: list[int] = field(init=False)
    local_rows: list[int] = field(init=False)
    local_offset: list[int] = field(init=False)

    def __post_init__(self) -> None:
        dims = {t.embedding_dim for t in self.tables}
        if len(dims) != 1:
            raise ValueError(
                "all tables of one ShardedEmbeddingCollection must share an embedding dim, got "
                + ", ".join(f"{t.name}={t.embedding_dim}" for t in self.tables)
            )
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate table names: {names}")
        self.features, self.feature_table = [], []
        for ti, t in enumerate(self.tables):
            for f in t.feature_names:
                if f in self.features:
                    raise ValueError(f"feature '{f}' is mapped to two tables")
                self.features.append(f)
                self.feature_table.append(ti)
        self.block, self.local_rows, self.local_offset = [], [], []
        off = 0
        for t in self.tables:
            b = math.ceil(t.num_embeddings / self.world_size)
            n = max(0, min(b, t.num_embeddings - self.rank * b))
            self.block.append(b)
            self.local_rows.append(n)
            self.local_offset.append(off)
            off += n
        self.total_local_rows = off

    @property
    def dim(self) -> int:
        return self.tables[0].embedding_dim

    def row_range(self, table_index: int, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        t = self.tables[table_index]
        b = self.block[table_index]
        return min(r * b, t.num_embeddings), min((r + 1) * b, t.num_embeddings)


@dataclass
class ExchangeStats:
    """Counters and wall times of the exchange (seconds; synchronised when timing)."""

    steps: int = 0
    ids_sent: int = 0
    ids_received: int = 0
    emb_bytes_sent: int = 0
    grad_bytes_sent: int = 0
    rows_updated: int = 0  # padded path (CUDA): added via the tally, may lag until settled
    host_counts_used: int = 0  # id dists that took their counts from the host
    rows_grouped_ahead: int = 0  # rows updated with a grouping started ahead ("ahead")
    times: dict[str, float] = field(default_factory=dict)

    def add_time(self, key: str, seconds: float) -> None:
        self.times[key] = self.times.get(key, 0.0) + seconds


@dataclass
class _IdDist:
    """Result of the id dist of one forward, kept for the backward."""

    lengths: dict[str, torch.Tensor]
    feature_sizes: list[int]
    unbucketize: torch.Tensor  # position in the send buffer of each batch-major id
    send_splits: list[int]
    recv_splits: list[int]
    recv_keys: torch.Tensor  # shard-tensor row of every received id
    step: int
    lr: float | None
    # recv_keys' row grouping, started with the id dist ("ahead" sparse update)
    groups: PendingRowGroups | None = None


class _VanillaExchange(torch.autograd.Function):
    """Lookup + embedding all-to-all forward; gradient all-to-all + fused update backward."""

    @staticmethod
    def forward(ctx, anchor, module, dist_state):  # type: ignore[override]
        ctx.module = module
        ctx.dist_state = dist_state
        return module._lookup_exchange(dist_state)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.module._grad_exchange_and_update(ctx.dist_state, grad)
        ctx.dist_state = None
        return None, None, None


class ShardedEmbeddingCollection(nn.Module):
    """Row-wise sharded, unpooled embedding collection with a fused sparse optimizer.

    ``forward({feature: (values, lengths)})`` returns ``{feature: [N_f, D]}`` for the
    local batch. Every configured feature must be given (possibly empty). Call
    :meth:`set_step` before each training forward so updates use that step's index and
    learning rate. Each rank's rows are the buffer ``weight``: before wrapping a model
    that holds the collection in ``DistributedDataParallel``, call
    :func:`ddp_ignore_shards` on it, or DDP replaces every rank's rows with rank 0's.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        comm: Communicator,
        optim: SparseOptimConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        timing: bool = False,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.plan = RowWisePlan(list(tables), comm.world_size, comm.rank)
        self.device = torch.device(device)
        self.dtype = dtype
        self.optim_cfg = optim
        self.timing = timing
        shards = [
            init_table_rows(t, ti, *self.plan.row_range(ti), seed=seed, dtype=dtype)
            for ti, t in enumerate(self.plan.tables)
        ]
        weight = torch.cat(shards) if shards else torch.empty(0, self.plan.dim, dtype=dtype)
        self.register_buffer("weight", weight.to(self.device), persistent=True)
        self.optimizer = FusedSparseOptimizer(optim, self.weight)
        self._anchor = torch.zeros((), requires_grad=True)
        self._feature_table = torch.tensor(self.plan.feature_table, dtype=torch.int64)
        self._block_sizes = torch.tensor(
            [self.plan.block[t] for t in self.plan.feature_table], dtype=torch.int64
        )
        self._table_offsets = torch.tensor(self.plan.local_offset, dtype=torch.int64)
        # device copies made once: a blocking host-to-device copy synchronises the stream
        self._block_sizes_dev = self._block_sizes.to(self.device)
        # shard-tensor row offset of each feature's table, indexed by feature
        self._feature_offset_dev = self._table_offsets[self._feature_table].to(self.device)
        self.stats = ExchangeStats()
        # auto | sync | padded | ahead (TrainConfig.sparse_update); "auto" defers to
        # $FREESCALE_SPARSE_UPDATE, then to the device (ahead on CUDA)
        self.sparse_update = "auto"
        self.tally = DeviceTally()  # device-side counts on their way into the stats
        # host count matrices registered ahead (register_counts), keyed by the identity
        # of the first feature's ids tensor (a strong reference is kept, so ids of freed
        # tensors cannot alias); a few batches at most
        self._known_counts: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._step = 1
        self._lr: float | None = None

    # ------------------------------------------------------------------ api
    @property
    def features(self) -> list[str]:
        return list(self.plan.features)

    def set_step(self, step: int, lr: float | None = None) -> None:
        """1-based index of the training step about to run, and its sparse lr."""
        self._step = int(step)
        self._lr = lr

    def forward(
        self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        state = self.input_dist(features)  # bad input: every rank raises there
        anchor = self._anchor
        if torch.is_grad_enabled() and self.training:
            flat = _VanillaExchange.apply(anchor, self, state)
        else:
            flat = self._lookup_exchange(state)
        return dict(zip(self.plan.features, torch.split(flat, state.feature_sizes)))

    # ------------------------------------------------------------- id dist
    def _sync(self) -> None:
        if self.timing and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _tic(self) -> float:
        self._sync()
        return time.perf_counter()

    def _toc(self, key: str, t0: float) -> None:
        self._sync()
        self.stats.add_time(key, time.perf_counter() - t0)

    def host_counts(
        self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """``[W, K]`` int64 on the host: ids of each feature (plan order) per owner rank,
        from *host* ids — exactly what :meth:`input_dist`'s dispatch counts on the device
        (same owner rule, kernels.reference.owner_and_local). Computed at load time it
        lets the id dist skip reading counts back from the device (DESIGN.md 3)."""
        w = self.comm.world_size
        out = torch.zeros(w, len(self.plan.features), dtype=torch.int64)
        for k, f in enumerate(self.plan.features):
            v = features[f][0]
            if v.device.type != "cpu":
                raise ValueError(f"host_counts: feature '{f}' is on {v.device}, not the host")
            if v.numel():
                out[:, k] = owner_counts(v, int(self._block_sizes[k]), w)
        return out

    def register_counts(
        self,
        features: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        counts: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Host ``(sent, received)`` count matrices of ``features`` (this rank's
        :meth:`host_counts` and their all-to-all), used by the id dist of exactly these
        tensors whenever it runs (now or as a lookahead), instead of device read-backs."""
        if not self.plan.features:
            return
        key = features[self.plan.features[0]][0]
        self._known_counts[id(key)] = (key, counts)
        while len(self._known_counts) > 4:
            self._known_counts.pop(next(iter(self._known_counts)))

    def _registered_counts(
        self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._known_counts or not self.plan.features:
            return None
        key = features[self.plan.features[0]][0]
        hit = self._known_counts.get(id(key))
        return hit[1] if hit is not None and hit[0] is key else None

    def _input_problem(
        self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> str | None:
        """What is wrong with ``features`` before looking at any id value: a missing
        feature, or ids that are not integers."""
        for f in self.plan.features:
            if f not in features:
                return f"feature '{f}' missing (features given: {sorted(features)})"
            ids = features[f][0]
            if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
                return f"feature '{f}': ids have dtype {ids.dtype}, expected an integer dtype"
        return None

    def _id_extremes(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[K, 2]`` (min, max) id of each feature on the device (0, 0 when empty)."""
        rows = [torch.stack(torch.aminmax(v)) if v.numel() else None for v in values]
        zero = torch.zeros(2, dtype=torch.int64, device=self.device)
        return torch.stack([zero if r is None else r for r in rows]) if rows else zero[:0]

    def _range_problem(
        self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]], extremes: torch.Tensor
    ) -> str | None:
        """The first id outside its table's rows, with its feature, sample and position
        (the error path reads the ids back; the check itself is the extremes)."""
        for i, f in enumerate(self.plan.features):
            rows = self.plan.tables[self.plan.feature_table[i]].num_embeddings
            lo, hi = int(extremes[i, 0]), int(extremes[i, 1])
            if lo >= 0 and hi < rows:
                continue
            ids, lengths = features[f][0].cpu(), features[f][1].cpu().to(torch.int64)
            pos = int(((ids < 0) | (ids >= rows)).nonzero()[0, 0])
            sample = int(torch.searchsorted(lengths.cumsum(0), pos, right=True))
            return (
                f"feature '{f}', sample {sample}: id {int(ids[pos])} out of range [0, {rows}) "
                f"(table '{self.plan.tables[self.plan.feature_table[i]].name}', flat position "
                f"{pos})"
            )
        return None

    def _bad_input_message(self, problem: str | None, bad: Sequence[int]) -> str:
        ranks = [r for r, b in enumerate(bad) if b]
        me = self.comm.rank
        if problem is not None:
            return f"rank {me}: {problem}; nothing was exchanged (bad input on ranks {ranks})"
        return (
            f"rank {me}: the input of rank(s) {ranks} is bad (see their error); nothing was "
            "exchanged"
        )

    def input_dist(
        self,
        features: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> _IdDist:
        """Bucket ids by owner rank, exchange counts then ids (blocking).

        ``counts``: ``(sent, received)`` ``[W, K]`` host count matrices of these
        features (:meth:`host_counts` of this rank, and the all-to-all of everyone's),
        known ahead: then no count is read back from the device and no count collective
        runs here (default: those given to :meth:`register_counts` for these tensors).
        They must be right: a wrong count corrupts the exchange (the tests compare
        against the device path bit for bit)."""
        t0 = self._tic()
        plan, w = self.plan, self.comm.world_size
        if counts is None:
            counts = self._registered_counts(features)
        checked = counts is None  # counts known ahead come from a validated host batch
        problem = self._input_problem(features) if checked else None
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        values = [
            empty if problem is not None else features[f][0].to(self.device, torch.int64)
            for f in plan.features
        ]
        lengths = {f: features[f][1] if f in features else empty for f in plan.features}
        sizes = [int(v.numel()) for v in values]
        cat = torch.cat(values) if values else empty
        # one segment per feature: lengths [K] in key-major order, batch of one
        seg_lengths = torch.tensor(sizes, dtype=torch.int64).to(self.device, non_blocking=True)
        if checked:  # each feature's id range, read with the counts (no extra sync); a
            extremes = self._id_extremes(values)  # negative id would misroute the dispatch
            cat = cat.clamp_min(0)
        res = ranged_dispatch(cat, seg_lengths, self._block_sizes_dev, w)
        if counts is None:
            # every rank's counts plus one column: whether its input was bad, so that all
            # ranks raise here together, before any id moves (no rank left in a collective)
            key_counts = res.key_counts.to(torch.int64)  # [W, K]
            host = torch.cat([key_counts.reshape(-1), extremes.reshape(-1)]).cpu()
            k = len(plan.features)
            key_counts, extremes = host[: w * k].reshape(w, k), host[w * k :].reshape(-1, 2)
            if problem is None:
                problem = self._range_problem(features, extremes)
            flag = torch.full((w, 1), int(problem is not None), dtype=torch.int64)
            exchanged = self.comm.exchange_counts(
                torch.cat([key_counts, flag], dim=1), name="id_counts"
            )
            recv_counts, bad = exchanged[:, :k], exchanged[:, k].tolist()
            if any(bad):
                raise BadInputError(self._bad_input_message(problem, bad))
            send_splits = key_counts.sum(1).tolist()
        else:
            key_counts, recv_counts = counts
            send_splits = key_counts.sum(1).tolist()
            self.stats.host_counts_used += 1
        recv_splits = recv_counts.sum(1).tolist()
        recv = self.comm.all_to_all_v(res.values, send_splits, recv_splits, name="ids").wait()
        # shard-tensor row of each received id: local row + offset of its table
        k = len(plan.features)
        feat_of = torch.repeat_interleave(
            torch.arange(k, device=self.device).repeat(w),
            recv_counts.reshape(-1).to(self.device, non_blocking=True),
            output_size=sum(recv_splits),
        )
        recv_keys = recv + self._feature_offset_dev[feat_of]
        self.stats.ids_sent += int(cat.numel()) - int(send_splits[self.comm.rank])
        self.stats.ids_received += int(recv.numel())
        groups = None
        if (
            self._groups_in_input_dist
            and torch.is_grad_enabled()
            and self.training
            and self.update_mode(recv_keys.is_cuda) == "ahead"
        ):
            groups = group_rows_start(recv_keys)
        self._toc("id_dist", t0)
        return _IdDist(
            lengths=lengths,
            feature_sizes=sizes,
            unbucketize=res.unbucketize_permute,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_keys=recv_keys,
            step=self._step,
            lr=self._lr,
            groups=groups,
        )

    # -------------------------------------------------------- lookup + a2a
    def _lookup_exchange(self, st: _IdDist) -> torch.Tensor:
        t0 = self._tic()
        rows = self.weight.index_select(0, st.recv_keys)
        self._toc("lookup", t0)
        t0 = self._tic()
        back = self.comm.all_to_all_v(rows, st.recv_splits, st.send_splits, name="embeddings")
        out = back.wait()
        self._toc("emb_a2a", t0)
        self.stats.emb_bytes_sent += (sum(st.recv_splits) - st.recv_splits[self.comm.rank]) * (
            self.plan.dim * rows.element_size()
        )
        return ranged_combine(out, st.unbucketize)

    def _grad_exchange_and_update(self, st: _IdDist, grad: torch.Tensor) -> None:
        t0 = self._tic()
        grad = grad.contiguous().to(self.dtype)
        send = ranged_combine_backward(grad, st.unbucketize)
        recv = self.comm.all_to_all_v(send, st.send_splits, st.recv_splits, name="grads").wait()
        self._toc("grad_a2a", t0)
        self.stats.grad_bytes_sent += (sum(st.send_splits) - st.send_splits[self.comm.rank]) * (
            self.plan.dim * grad.element_size()
        )
        t0 = self._tic()
        self._apply_update(st.recv_keys, recv, st.step, st.lr, st.groups)
        st.groups = None
        self._toc("sparse_update", t0)
        self.stats.steps += 1

    # input_dist starts the row grouping of the ids it delivers ("ahead" update); the
    # prioritized collection groups subsets of them instead and turns this off
    _groups_in_input_dist = True

    def update_mode(self, cuda: bool) -> str:
        """The sparse update this collection runs for keys on CUDA (``cuda``) or not:
        ``sync``, ``padded`` or ``ahead`` (see ``SPARSE_UPDATE_ENV_VAR``'s comment)."""
        mode = self.sparse_update
        if mode == "auto":
            mode = os.environ.get(SPARSE_UPDATE_ENV_VAR, "auto")
            if mode not in SPARSE_UPDATE_MODES:
                raise ValueError(
                    f"{SPARSE_UPDATE_ENV_VAR} must be one of {', '.join(SPARSE_UPDATE_MODES)}: "
                    f"{mode!r}"
                )
        elif mode not in SPARSE_UPDATE_MODES:
            raise ValueError(
                f"sparse_update must be one of {', '.join(SPARSE_UPDATE_MODES)}: {mode!r}"
            )
        if mode == "auto":
            return "ahead" if cuda else "sync"
        return mode

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedEmbeddingCollection:
        """``nn.Module``'s hook behind ``.to()`` / ``.cuda()`` / ``.cpu()`` / ``.float()`` /
        ``.double()`` / ``.share_memory()``: the shard, its optimizer state and the
        communicator were built for one device and dtype, so a conversion that keeps both
        runs (``model.to(device)`` of a model holding this collection, on its device) and
        one that would change either raises before touching anything here."""
        w = self.weight
        probe = fn(torch.empty(0, dtype=w.dtype, device=w.device))
        if probe.dtype != w.dtype or probe.device != w.device:
            raise RuntimeError(
                f"{type(self).__name__}: its shard ({w.dtype} on {w.device}) cannot be "
                f"converted to {probe.dtype} on {probe.device} (the fused optimizer and the "
                "communicator hold it): build it with device= / dtype= (a TorchRec model: "
                "move / cast it before shard_model, or pass shard_model(..., device=, dtype=))"
            )
        return super()._apply(fn, recurse)

    def _apply_update(
        self,
        keys: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        lr: float | None,
        groups: PendingRowGroups | None,
    ) -> torch.Tensor | int:
        """:meth:`apply_gradients`, passing ``groups`` only when a grouping was started
        (subclasses that override the signature without ``groups`` keep working)."""
        if groups is None:
            return self.apply_gradients(keys, grads, step, lr)
        return self.apply_gradients(keys, grads, step, lr, groups=groups)

    def apply_gradients(
        self,
        keys: torch.Tensor,
        grads: torch.Tensor,
        step: int,
        lr: float | None,
        groups: PendingRowGroups | None = None,
    ) -> torch.Tensor | int:
        """Owner side: sum ``grads`` per shard row ``keys`` in the fixed order and apply the
        fused optimizer with step index ``step``. Returns the number of rows updated: an
        ``int``, or a one-element device tensor on the padded path (feed it to
        ``self.tally``; ``stats.rows_updated`` gets it that way).

        ``groups``: the grouping of exactly these ``keys`` started ahead
        (:func:`~freescale.embedding.reduce.group_rows_start`), used on the ``ahead``
        path. The padded path (``ahead`` without ``groups`` on CUDA) never reads back: it
        sums and updates one slot per id, padding slots repeating the last real row
        (:class:`~freescale.embedding.reduce.PaddedRowGroups`), so each row is written
        only with its one bit-exact new value."""
        mode = self.update_mode(keys.is_cuda)
        if mode == "ahead" and groups is not None:
            if groups.n != keys.numel():
                raise ValueError(
                    f"apply_gradients: the grouping started ahead covers {groups.n} ids, "
                    f"the update has {keys.numel()}"
                )
            g = groups.finish()
            if g.rows.numel() == 0:
                return 0
            summed = segment_sum(grads, g)
            self.optimizer.step(g.rows, summed, step=step, lr=lr, unique_rows=True)
            self.stats.rows_updated += int(g.rows.numel())
            self.stats.rows_grouped_ahead += int(g.rows.numel())
            return int(g.rows.numel())
        if mode == "padded" or (mode == "ahead" and keys.is_cuda):
            if keys.numel() == 0:
                return 0
            pg = group_rows_padded(keys)
            summed = segment_sum(grads, pg.groups).index_select(0, pg.fill)
            rows = pg.groups.rows.index_select(0, pg.fill)
            self.optimizer.step(rows, summed, step=step, lr=lr)
            self.tally.add(self.stats, "rows_updated", pg.num_rows)
            return pg.num_rows
        groups = group_rows(keys)
        summed = segment_sum(grads, groups)
        self.optimizer.step(groups.rows, summed, step=step, lr=lr, unique_rows=True)
        self.stats.rows_updated += int(groups.rows.numel())
        return int(groups.rows.numel())

    # ------------------------------------------------------------- state
    def shard_tables(self) -> dict[str, tuple[int, torch.Tensor]]:
        """This rank's rows of each table: ``{name: (first global row, [rows, D])}``."""
        out = {}
        for ti, t in enumerate(self.plan.tables):
            lo, _ = self.plan.row_range(ti)
            off, n = self.plan.local_offset[ti], self.plan.local_rows[ti]
            out[t.name] = (lo, self.weight[off : off + n])
        return out

    def shard_optimizer_state(self) -> dict[str, dict[str, tuple[int, torch.Tensor]]]:
        """Optimizer state rows per table, in the layout of :meth:`shard_tables`."""
        out: dict[str, dict[str, tuple[int, torch.Tensor]]] = {}
        for ti, t in enumerate(self.plan.tables):
            lo, _ = self.plan.row_range(ti)
            off, n = self.plan.local_offset[ti], self.plan.local_rows[ti]
            out[t.name] = {k: (lo, v[off : off + n]) for k, v in self.optimizer.state.items()}
        return out


def check_lookahead(
    owner: str,
    feature_names: Sequence[str],
    ahead_values: Sequence[torch.Tensor],
    ahead_lengths: Sequence[torch.Tensor],
    features: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """The ids looked ahead at step t (``ahead_*``, in ``feature_names`` order) must be
    the ids of step t+1 (``features``); a clear ``ValueError`` naming the feature
    otherwise. Cheap when the caller passes the same tensors (identity first)."""
    for f, v0, l0 in zip(feature_names, ahead_values, ahead_lengths):
        if f not in features:
            raise ValueError(
                f"{owner}: feature '{f}' is missing from this step, but was given in the "
                "next_features of the previous step"
            )
        v, ln = features[f]
        same_v = v is v0 or (v.shape == v0.shape and torch.equal(v.to(v0.device), v0))
        same_l = ln is l0 or (ln.shape == l0.shape and torch.equal(ln.to(l0.device), l0))
        if not (same_v and same_l):
            raise ValueError(
                f"{owner}: feature '{f}' of this step differs from the next_features given "
                "at the previous step"
            )


def ddp_ignore_shards(model: nn.Module) -> list[str]:
    """Register the row shard of every :class:`ShardedEmbeddingCollection` under ``model``
    (by every name it has there) as ignored by DDP on ``model``, and return the whole
    ignore list. Call it before ``DistributedDataParallel(model)``: DDP broadcasts rank
    0's buffers to every rank when it is built (and, with ``broadcast_buffers``, before
    each forward), which would overwrite each rank's own rows with rank 0's. Names
    already ignored on ``model`` stay. ``shard_model`` calls it for TorchRec models; the
    trainer wraps only the dense model in DDP."""
    from torch.nn.parallel import DistributedDataParallel

    names = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    for prefix, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, ShardedEmbeddingCollection):
            owned = [*m.named_buffers(remove_duplicate=False), *m.named_parameters()]
            names.update(f"{prefix}.{n}" if prefix else n for n, _ in owned)
    ignore = sorted(names)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    return ignore
