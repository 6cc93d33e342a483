"""Data movement of the sequence load balancer (the *coordinator* role).

Owns the three-stage protocol's communication over a :class:`Communicator`:

* stages I + II (``BalanceCoordinator.start``, asynchronous): all-gather every rank's
  header (step, local sample count, field layout) and its per-sample metadata
  (composite UIH length, candidate count, sample id). The composite length (sum of
  a sample's UIH lengths over keys) is computed locally before the gather, so a batch
  with several sequence keys costs no extra collective. Local counts vary, so the
  header is gathered first and the metadata padded to the largest count; with
  ``CoordinatorConfig.max_local_samples`` set, both travel in one all-gather.
* stage III (``PendingBalance.finish``): every rank runs the same :class:`Planner` on
  the gathered list, then one variable-split all-to-all moves the jagged samples so
  that each rank holds exactly its planned samples in ascending global sample id.

Wire format of stage III: one int64 buffer. Per destination, field blocks
``[sample ids | lengths of key 1..K | ids of key 1..K | timestamps of key 1..K |
candidates | labels | true_probs]``; float fields travel bit-cast (float64 viewed as
int64; float32 as int32 widened), so the exchange is bitwise exact. The receiver
knows every block size from the gathered metadata (lengths per key are read from
the buffer before the id blocks are split), so no separate count exchange is needed.

It may not decide placement (the planner does) nor touch model state; it moves
samples of one step only (samples never cross steps). Every rank must call
``start`` / ``advance`` / ``finish`` in the same order (collectives are matched by
order).
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from freescale.balance.planner import GlobalMetadata, Plan, Planner
from freescale.comm.base import Awaitable, Communicator, Done
from freescale.data.batch import JaggedBatch, lengths_to_offsets

__all__ = ["CoordinatorConfig", "MoveStats", "BalanceCoordinator", "PendingBalance"]

_CODES = {torch.int64: 1, torch.int32: 2, torch.float32: 3, torch.float64: 4}
_DTYPES = {v: k for k, v in _CODES.items()}
# header: step, count, num keys, dtype codes of uih, timestamps, candidates, labels, probs
_H_STEP, _H_COUNT, _H_KEYS, _H_UIH, _H_TS, _H_CAND, _H_LAB, _H_PROB = range(8)
_HEADER = 8


@dataclass
class CoordinatorConfig:
    """Data-movement options (identical on every rank)."""

    max_local_samples: int | None = None  # set: stages I+II in one all-gather
    verify_plans: bool = False  # all-gather a plan checksum per step; fail on divergence
    name: str = "balance"  # prefix of collective names


@dataclass
class MoveStats:
    """What one balancing step cost this rank (self-to-self traffic excluded)."""

    step: int
    samples_sent: int
    samples_received: int
    bytes_sent: int
    bytes_received: int
    metadata_bytes: int  # bytes this rank contributed to all-gathers
    collectives: int
    exchange_skipped: bool  # nothing moved anywhere: no all-to-all was issued
    finish_ms: float


def _encode(t: torch.Tensor) -> torch.Tensor:
    """Bit-exact int64 carrier of an int64 / int32 / float32 / float64 tensor."""
    if t.dtype == torch.int64:
        return t
    if t.dtype == torch.float64:
        return t.view(torch.int64)
    if t.dtype == torch.float32:
        return t.view(torch.int32).to(torch.int64)
    if t.dtype == torch.int32:
        return t.to(torch.int64)
    raise TypeError(f"balance: cannot move a {t.dtype} field (int32/64, float32/64 only)")


def _decode(t: torch.Tensor, code: int) -> torch.Tensor:
    dtype = _DTYPES[code]
    if dtype == torch.int64:
        return t
    if dtype == torch.float64:
        return t.view(torch.float64)
    if dtype == torch.float32:
        return t.to(torch.int32).view(torch.float32)
    return t.to(torch.int32)


# up to this many blocks the transpose concatenates views of the blocks (one memcpy per
# block: 0.3-0.5 ms for 1M ids in 8-256 blocks on the dev box, against 2.6-3.7 ms for the
# gather below, which builds a per-element index); above it torch.cat's per-tensor cost
# wins out (5.9 ms at 1,024 blocks) and the gather is used
_TRANSPOSE_CAT_MAX_BLOCKS = 256


def _transpose_blocks(buf: torch.Tensor, sizes: np.ndarray) -> torch.Tensor:
    """``buf`` holds blocks ``(x, y)`` in x-major order with ``sizes[x, y]`` elements;
    return the same blocks in y-major order (the "keyed transpose")."""
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    total = int(sizes.sum())
    if total == 0:
        return buf[:0]
    if sizes.size <= _TRANSPOSE_CAT_MAX_BLOCKS:
        return _transpose_blocks_cat(buf, sizes, total)
    return _transpose_blocks_gather(buf, sizes, total)


def _transpose_blocks_cat(buf: torch.Tensor, sizes: np.ndarray, total: int) -> torch.Tensor:
    """Few blocks: views of the blocks, concatenated in y-major order."""
    nx, ny = sizes.shape
    parts = torch.split(buf[:total], sizes.reshape(-1).tolist())
    return torch.cat([parts[x * ny + y] for y in range(ny) for x in range(nx)])


def _transpose_blocks_gather(buf: torch.Tensor, sizes: np.ndarray, total: int) -> torch.Tensor:
    """Many blocks: one gather by a per-element source index."""
    flat = sizes.reshape(-1)
    in_start = (np.cumsum(flat) - flat).reshape(sizes.shape)
    sizes_t = sizes.T.reshape(-1)
    out_start = np.cumsum(sizes_t) - sizes_t
    shift = torch.from_numpy(in_start.T.reshape(-1) - out_start).to(buf.device)
    idx = torch.repeat_interleave(
        shift, torch.from_numpy(sizes_t).to(buf.device), output_size=total
    )
    idx += torch.arange(total, device=buf.device)
    return buf.index_select(0, idx)  # not buf[idx]: same values, less CPU


def _segment_sums(lengths: torch.Tensor, bounds: np.ndarray) -> np.ndarray:
    """Sums of ``lengths`` over sample ranges ``bounds[i]:bounds[i+1]`` (int64 numpy)."""
    off = lengths_to_offsets(lengths).cpu().numpy()
    return off[bounds[1:]] - off[bounds[:-1]]


def _header(batch: JaggedBatch) -> list[int]:
    code = lambda t: 0 if t is None else _CODES.get(t.dtype, -1)  # noqa: E731
    keys = batch.keys
    ts = None if batch.timestamps is None or not keys else batch.timestamps[keys[0]]
    return [
        int(batch.step),
        batch.batch_size,
        len(keys),
        code(batch.uih[keys[0]]) if keys else 1,
        code(ts),
        code(batch.candidates),
        code(batch.labels),
        code(batch.true_probs),
    ]


class PendingBalance:
    """Stages I+II in flight for one batch; ``finish`` runs stage III."""

    def __init__(self, coord: BalanceCoordinator, batch: JaggedBatch) -> None:
        self._c = coord
        self.batch = batch
        self.step = int(batch.step)
        self.stats: MoveStats | None = None
        self._meta_bytes = 0
        self._collectives = 0
        self._done: tuple[JaggedBatch, Plan] | None = None
        comm, cfg = coord.comm, coord.config
        dev = batch.device
        head = torch.tensor(_header(batch), dtype=torch.int64, device=dev)
        self._local = torch.stack(
            [batch.composite_lengths(), batch.num_candidates.to(torch.int64), batch.sample_ids]
        )  # [3, B]
        cap = cfg.max_local_samples
        self._headers: Awaitable[list[torch.Tensor]] | None = None
        self._rows: Awaitable[list[torch.Tensor]] | None = None
        self._width = 0
        if cap is not None:
            # an oversized batch still joins the gather (truncated); every rank then
            # raises in finish() instead of the others hanging in a collective
            rows = torch.zeros(3, cap, dtype=torch.int64, device=dev)
            fit = min(batch.batch_size, cap)
            rows[:, :fit] = self._local[:, :fit]
            buf = torch.cat([head, rows.reshape(-1)])
            self._width = cap
            self._fused = comm.all_gather(buf, name=f"{cfg.name}:meta")
            self._count(buf)
        else:
            self._fused = None
            self._headers = comm.all_gather(head, name=f"{cfg.name}:header")
            self._count(head)

    def _count(self, t: torch.Tensor) -> None:
        self._meta_bytes += t.numel() * t.element_size()
        self._collectives += 1

    # ------------------------------------------------------------------ stages
    def advance(self) -> None:
        """Issue the padded metadata gather now (waits for the tiny header gather
        only). A no-op when fused or already issued. Optional: ``finish`` does it
        otherwise. Collectives are matched by order, so whether to call it must not
        depend on rank-local state (such as ``is_completed()``)."""
        if self._fused is None and self._rows is None:
            self._issue_rows()

    def _issue_rows(self) -> None:
        heads = torch.stack(self._headers.wait()).cpu()  # type: ignore[union-attr]
        self._width = int(heads[:, _H_COUNT].max()) if heads.numel() else 0
        rows = torch.zeros(3, self._width, dtype=torch.int64, device=self.batch.device)
        rows[:, : self.batch.batch_size] = self._local
        if self._width == 0:  # every rank is empty: nothing to gather
            self._rows = Done([rows.reshape(-1)] * self._c.comm.world_size)
            return
        self._rows = self._c.comm.all_gather(rows.reshape(-1), name=f"{self._c.config.name}:meta")
        self._count(rows)

    def _gathered(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """(headers [W, 8], per-rank [3, count] metadata)."""
        if self._fused is not None:
            parts = [p.cpu().numpy() for p in self._fused.wait()]
            heads = np.stack([p[:_HEADER] for p in parts])
            rows = [p[_HEADER:].reshape(3, self._width) for p in parts]
        else:
            if self._rows is None:
                self._issue_rows()
            heads = np.stack([h.cpu().numpy() for h in self._headers.wait()])  # type: ignore[union-attr]
            rows = [p.cpu().numpy().reshape(3, self._width) for p in self._rows.wait()]  # type: ignore[union-attr]
        over = np.flatnonzero(heads[:, _H_COUNT] > self._width)
        if over.size:
            raise ValueError(
                f"balance step {self.step}: ranks {over.tolist()} have local batches of "
                f"{heads[over, _H_COUNT].tolist()} samples > max_local_samples={self._width}"
            )
        return heads, [r[:, : int(h[_H_COUNT])] for r, h in zip(rows, heads)]

    def _layout(self, heads: np.ndarray) -> np.ndarray | None:
        """The agreed header (layout of every non-empty rank); None if all are empty."""
        rank = self._c.comm.rank
        steps = set(heads[:, _H_STEP].tolist())
        if len(steps) != 1:
            raise ValueError(
                f"balance on rank {rank}: ranks passed batches of different steps "
                f"{sorted(steps)} (samples never cross steps)"
            )
        if len(set(heads[:, _H_KEYS].tolist())) != 1:
            raise ValueError(
                f"balance step {self.step} on rank {rank}: ranks' batches have different "
                f"numbers of UIH keys {heads[:, _H_KEYS].tolist()}"
            )
        full = np.flatnonzero(heads[:, _H_COUNT] > 0)
        if full.size == 0:
            return None
        ref = heads[full[0]]
        for r in full:
            if not np.array_equal(heads[r, _H_KEYS:], ref[_H_KEYS:]):
                raise ValueError(
                    f"balance step {self.step} on rank {rank}: rank {int(r)}'s batch layout "
                    f"{heads[r, _H_KEYS:].tolist()} differs from rank {int(full[0])}'s "
                    f"{ref[_H_KEYS:].tolist()} (keys, dtypes, timestamps / true_probs "
                    "presence must agree)"
                )
        if (ref[_H_UIH:] < 0).any():
            raise TypeError(f"balance: unsupported field dtype in layout {ref.tolist()}")
        return ref

    def finish(self, state: dict | None = None) -> tuple[JaggedBatch, Plan]:
        """Wait for the metadata, plan, move samples. Returns (local batch, plan).
        ``state``: the cost state to plan with (:meth:`Planner.plan`; default the
        planner's current one)."""
        if self._done is not None:
            return self._done
        t0 = time.perf_counter()
        planner, cfg = self._c.planner, self._c.config
        heads, rows = self._gathered()
        layout = self._layout(heads)
        k = int(layout[_H_KEYS]) if layout is not None else 0
        has_ts = layout is not None and layout[_H_TS] > 0
        has_p = layout is not None and layout[_H_PROB] > 0
        lens = [r[0] for r in rows]
        ncand = [r[1] for r in rows]
        per_sample = [
            8 * (1 + k) + 8 * (1 + has_ts) * ln + 8 * (2 + has_p) * c for ln, c in zip(lens, ncand)
        ]
        meta = GlobalMetadata.from_rank_lists(
            self.step, lens, ncand, [r[2] for r in rows], per_sample
        )
        plan = planner.plan(meta, state)
        if cfg.verify_plans:
            self._verify(plan)
        if plan.samples_moved == 0 or layout is None:
            out = self._keep_local(plan)
            sent = recv = nbytes_s = nbytes_r = 0
            skipped = True
        else:
            out, sent, recv, nbytes_s, nbytes_r = self._exchange(meta, plan, layout)
            self._collectives += 1
            skipped = False
        self.stats = MoveStats(
            step=self.step,
            samples_sent=sent,
            samples_received=recv,
            bytes_sent=nbytes_s,
            bytes_received=nbytes_r,
            metadata_bytes=self._meta_bytes,
            collectives=self._collectives,
            exchange_skipped=skipped,
            finish_ms=(time.perf_counter() - t0) * 1e3,
        )
        self._c.last_stats = self.stats
        self._done = (out, plan)
        self.batch = None  # type: ignore[assignment]  # drop the reference
        return self._done

    # ---------------------------------------------------------------- helpers
    def _verify(self, plan: Plan) -> None:
        comm = self._c.comm
        crc = zlib.crc32(np.ascontiguousarray(plan.assignment.rank_of, dtype="<i8").data)
        t = torch.tensor([crc], dtype=torch.int64, device=self.batch.device)
        parts = comm.all_gather(t, name=f"{self._c.config.name}:verify").wait()
        got = [int(x) for x in torch.cat(parts).tolist()]
        self._count(t)
        if len(set(got)) != 1:
            raise RuntimeError(
                f"balance step {self.step}: ranks computed different plans (checksums {got}); "
                "planner inputs, state or numeric libraries differ between ranks"
            )

    def _keep_local(self, plan: Plan) -> JaggedBatch:
        batch = self.batch
        if plan.shadow or batch.batch_size < 2:
            return batch
        ids = batch.sample_ids
        if bool((ids[1:] >= ids[:-1]).all()):
            return batch
        return batch.select(torch.argsort(ids.cpu(), stable=True).to(batch.device))

    def _exchange(
        self, meta: GlobalMetadata, plan: Plan, layout: np.ndarray
    ) -> tuple[JaggedBatch, int, int, int, int]:
        """Move the planned samples. Samples that stay on this rank never enter the
        all-to-all: only the movers are selected, packed and sent; the kept samples are
        taken from the local batch and merged with the received ones in canonical order.
        The result is bit for bit what a round trip through the all-to-all gives (the
        int64 carrier is exact; lengths, candidate counts and ids come back as int64)."""
        comm, batch = self._c.comm, self.batch
        me, w = comm.rank, comm.world_size
        a = plan.assignment
        keys = batch.keys
        has_ts = layout[_H_TS] > 0
        has_p = layout[_H_PROB] > 0
        dev = batch.device
        if len(keys) != int(layout[_H_KEYS]):
            raise ValueError(
                f"balance step {self.step} on rank {me}: local batch has keys {keys}, the "
                f"other ranks' batches have {int(layout[_H_KEYS])} keys"
            )
        # ---- send side: my samples that leave, destination-major, ascending per dest
        mine = np.flatnonzero(meta.home_rank == me)
        dest = a.rank_of[mine]
        away = dest != me
        leave, dest = mine[away], dest[away]
        o = np.argsort(dest, kind="stable")
        send_counts = np.bincount(dest, minlength=w).astype(np.int64)
        sb = np.zeros(w + 1, dtype=np.int64)
        np.cumsum(send_counts, out=sb[1:])
        if leave.size == 0:  # nothing to send; the local batch may lack optional fields
            sel = JaggedBatch.empty(keys, step=batch.step, device=dev)
            sel.timestamps = {key: sel.uih[key] for key in keys}
            sel.true_probs = torch.zeros(0, dtype=torch.float64, device=dev)
        else:
            sel = batch.select(torch.from_numpy(meta.home_pos[leave[o]]).to(dev))
        fields: list[torch.Tensor] = [sel.sample_ids]
        sizes: list[np.ndarray] = [send_counts]
        for key in keys:
            fields.append(sel.uih_lengths[key].to(torch.int64))
            sizes.append(send_counts)
        key_sizes = [_segment_sums(sel.uih_lengths[key], sb) for key in keys]
        for key, ks in zip(keys, key_sizes):
            fields.append(_encode(sel.uih[key]))
            sizes.append(ks)
        if has_ts:
            for key, ks in zip(keys, key_sizes):
                fields.append(_encode(sel.timestamps[key]))  # type: ignore[index]
                sizes.append(ks)
        csz = _segment_sums(sel.num_candidates, sb)
        fields += [_encode(sel.candidates), _encode(sel.labels)]
        sizes += [csz, csz]
        if has_p:
            fields.append(_encode(sel.true_probs))  # type: ignore[arg-type]
            sizes.append(csz)
        s_mat = np.stack(sizes)  # [F, W]
        send_buf = _transpose_blocks(torch.cat([f.reshape(-1) for f in fields]), s_mat)
        in_splits = s_mat.sum(0)
        # ---- receive side: sizes known from the gathered metadata
        recv_g = a.samples_of(me)
        src = meta.home_rank[recv_g]
        home = src == me
        kept_g, arrive, src = recv_g[home], recv_g[~home], src[~home]
        o2 = np.argsort(src, kind="stable")
        recv_sorted = arrive[o2]
        recv_counts = np.bincount(src, minlength=w).astype(np.int64)
        comp = np.bincount(src, weights=meta.lengths[arrive], minlength=w).astype(np.int64)
        cand = np.bincount(src, weights=meta.num_candidates[arrive], minlength=w).astype(np.int64)
        r_cols = [recv_counts] * (1 + len(keys)) + [comp] * (1 + has_ts) + [cand] * (2 + has_p)
        r_mat = np.stack(r_cols, axis=1)  # [W sources, F']
        out_splits = r_mat.sum(1)
        # every rank joins the all-to-all (a collective), even with nothing to move
        recv_buf = comm.all_to_all_v(
            send_buf, in_splits.tolist(), out_splits.tolist(), name=f"{self._c.config.name}:samples"
        ).wait()
        pieces: list[tuple[np.ndarray, JaggedBatch]] = []
        if recv_sorted.size or not kept_g.size:  # (an empty result: typed like received)
            received, q = self._unpack(recv_buf, r_mat, recv_counts, meta, recv_sorted, layout)
            # source-major: the sources below me come before my kept samples
            lo, hi = _split_batch(
                received, int(recv_counts[:me].sum()), q[:me].sum(0), cand[:me].sum()
            )
            n_lo = lo.batch_size
            pieces += [(recv_sorted[:n_lo], lo), (recv_sorted[n_lo:], hi)]
        if kept_g.size:
            at = 1 if recv_sorted.size else 0
            pieces[at:at] = [(g, _as_received(b)) for g, b in _kept(batch, kept_g, meta)]
        pieces = [(g, b) for g, b in pieces if g.size] or pieces[:1]
        order = np.concatenate([g for g, _ in pieces])
        out = pieces[0][1] if len(pieces) == 1 else JaggedBatch.concat([b for _, b in pieces])
        if order.size > 1 and not bool((order[1:] > order[:-1]).all()):
            out = out.select(torch.from_numpy(np.argsort(order, kind="stable")).to(dev))
        out.extras = dict(batch.extras)
        row = 8
        return (
            out,
            int(send_counts.sum()),
            int(recv_counts.sum()),
            int(in_splits.sum()) * row,
            int(out_splits.sum()) * row,
        )

    def _unpack(
        self,
        recv_buf: torch.Tensor,
        r_mat: np.ndarray,
        recv_counts: np.ndarray,
        meta: GlobalMetadata,
        recv_sorted: np.ndarray,
        layout: np.ndarray,
    ) -> tuple[JaggedBatch, np.ndarray]:
        """The received samples (source-major, ascending within a source) as a batch,
        and their UIH tokens per (source, key)."""
        me, w = self._c.comm.rank, self._c.comm.world_size
        keys, dev = self.batch.keys, self.batch.device
        has_ts, has_p = layout[_H_TS] > 0, layout[_H_PROB] > 0
        by_field = torch.split(_transpose_blocks(recv_buf, r_mat), r_mat.sum(0).tolist())
        ids = by_field[0]
        expect = torch.from_numpy(meta.sample_ids[recv_sorted]).to(dev)
        if not torch.equal(ids, expect):
            raise RuntimeError(
                f"balance step {self.step} on rank {me}: received sample ids differ from the plan"
            )
        lengths = {key: by_field[1 + i] for i, key in enumerate(keys)}
        rb = np.zeros(w + 1, dtype=np.int64)
        np.cumsum(recv_counts, out=rb[1:])
        q = np.stack([_segment_sums(lengths[key], rb) for key in keys], axis=1)  # [W, K]
        nxt = 1 + len(keys)

        def per_key(flat: torch.Tensor, code: int) -> dict[str, torch.Tensor]:
            parts = torch.split(_transpose_blocks(flat, q), q.sum(0).tolist())
            return {key: _decode(p, code) for key, p in zip(keys, parts)}

        uih = per_key(by_field[nxt], int(layout[_H_UIH]))
        nxt += 1
        ts = None
        if has_ts:
            ts = per_key(by_field[nxt], int(layout[_H_TS]))
            nxt += 1
        cands = _decode(by_field[nxt], int(layout[_H_CAND]))
        labels = _decode(by_field[nxt + 1], int(layout[_H_LAB]))
        probs = _decode(by_field[nxt + 2], int(layout[_H_PROB])) if has_p else None
        received = JaggedBatch(
            sample_ids=ids,
            uih=uih,
            uih_lengths=lengths,
            candidates=cands,
            num_candidates=torch.from_numpy(meta.num_candidates[recv_sorted]).to(dev),
            labels=labels,
            timestamps=ts,
            true_probs=probs,
            step=self.batch.step,
        )
        return received, q


def _as_received(b: JaggedBatch) -> JaggedBatch:
    """Kept samples with the dtypes the all-to-all gives the received ones (ids, UIH
    lengths and candidate counts travel as int64); a no-op where they are int64."""
    i64 = torch.int64
    if (
        b.sample_ids.dtype == i64
        and b.num_candidates.dtype == i64
        and all(v.dtype == i64 for v in b.uih_lengths.values())
    ):
        return b
    return dataclasses.replace(
        b,
        sample_ids=b.sample_ids.to(i64),
        uih_lengths={k: v.to(i64) for k, v in b.uih_lengths.items()},
        num_candidates=b.num_candidates.to(i64),
    )


# kept samples in at most this many runs of consecutive local positions are taken as
# views of the local batch (one copy, in the final concat); more runs: one select
_KEPT_MAX_RUNS = 32


def _kept(
    batch: JaggedBatch, kept_g: np.ndarray, meta: GlobalMetadata
) -> list[tuple[np.ndarray, JaggedBatch]]:
    """The samples ``kept_g`` (canonical indices, ascending) of the local batch, as
    ``(canonical indices, batch)`` pieces: the whole batch when all stay; views of runs of
    consecutive positions when they are few and the batch is on the host (a partitioner
    that moves few samples, e.g. sticky, leaves a handful); else one select."""
    pos = meta.home_pos[kept_g]
    n = pos.size
    if n == batch.batch_size and bool((pos == np.arange(n)).all()):
        return [(kept_g, batch)]
    cuts = np.flatnonzero(np.diff(pos) != 1) + 1
    if batch.device.type == "cpu" and cuts.size < _KEPT_MAX_RUNS and bool((np.diff(pos) > 0).all()):
        starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [n]))
        tok = {
            k: np.concatenate(([0], np.cumsum(v.numpy(), dtype=np.int64)))
            for k, v in batch.uih_lengths.items()
        }
        cnd = np.concatenate(([0], np.cumsum(batch.num_candidates.numpy(), dtype=np.int64)))
        out = []
        for a, z in zip(starts, ends):
            lo, hi = int(pos[a]), int(pos[z - 1]) + 1
            spans = {k: (int(t[lo]), int(t[hi])) for k, t in tok.items()}
            out.append((kept_g[a:z], _view(batch, lo, hi, spans, (int(cnd[lo]), int(cnd[hi])))))
        return out
    return [(kept_g, batch.select(torch.from_numpy(pos).to(batch.device)))]


def _view(
    b: JaggedBatch, lo: int, hi: int, tokens: dict[str, tuple[int, int]], cands: tuple[int, int]
) -> JaggedBatch:
    """Samples ``lo .. hi-1`` of ``b`` as views: ``tokens[k]`` is their UIH token range of
    key k, ``cands`` their candidate range (known by the caller: no device read here)."""
    c = slice(*cands)
    return JaggedBatch(
        sample_ids=b.sample_ids[lo:hi],
        uih={k: v[slice(*tokens[k])] for k, v in b.uih.items()},
        uih_lengths={k: v[lo:hi] for k, v in b.uih_lengths.items()},
        candidates=b.candidates[c],
        num_candidates=b.num_candidates[lo:hi],
        labels=b.labels[c],
        timestamps=None
        if b.timestamps is None
        else {k: v[slice(*tokens[k])] for k, v in b.timestamps.items()},
        true_probs=None if b.true_probs is None else b.true_probs[c],
        step=b.step,
        extras=b.extras,
    )


def _split_batch(
    b: JaggedBatch, n: int, tokens: np.ndarray, cands: int
) -> tuple[JaggedBatch, JaggedBatch]:
    """``b``'s first ``n`` samples and the rest, as views (no copy, no device read):
    ``tokens[k]`` UIH tokens of key k and ``cands`` candidates belong to the first part."""
    total = {k: int(v.numel()) for k, v in b.uih.items()}
    first = {k: (0, int(t)) for k, t in zip(b.keys, tokens)}
    rest = {k: (int(t), total[k]) for k, t in zip(b.keys, tokens)}
    nc = int(b.candidates.numel())
    return (
        _view(b, 0, n, first, (0, int(cands))),
        _view(b, n, b.batch_size, rest, (int(cands), nc)),
    )


class BalanceCoordinator:
    """Balances each step's samples across the ranks of ``comm`` with ``planner``.

    ``start(batch)`` issues stages I+II and returns at once; ``finish()`` on the handle
    (typically two steps later) plans and moves. ``balance(batch)`` does both.
    """

    def __init__(
        self,
        comm: Communicator,
        planner: Planner,
        config: CoordinatorConfig | None = None,
    ) -> None:
        if planner.world_size != comm.world_size:
            raise ValueError(
                f"planner built for {planner.world_size} ranks, communicator has {comm.world_size}"
            )
        self.comm = comm
        self.planner = planner
        self.config = config or CoordinatorConfig()
        self.last_stats: MoveStats | None = None

    def start(self, batch: JaggedBatch) -> PendingBalance:
        """Issue the metadata all-gather(s) for ``batch`` (not modified until finish)."""
        return PendingBalance(self, batch)

    def balance(self, batch: JaggedBatch) -> tuple[JaggedBatch, Plan]:
        return self.start(batch).finish()
