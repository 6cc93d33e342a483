"""Projection of per-step time to larger rank counts, from measured per-stage costs.

Owns: :class:`NetworkModel` (an explicit bandwidth / latency model of all-to-all and
all-reduce on a cluster of ``gpus_per_node``-GPU nodes), :class:`MeasuredCosts`
(per-step, per-rank quantities measured by one small run, typically 2 GPUs),
:func:`project` (step time at each world size for the ``vanilla`` and ``freescale``
schedules, broken down into stages), :func:`projection_report` (rows plus the inputs
and the assumptions, for a JSON file), :func:`straggler_shares_from_simulator` (the
straggler shares the projection needs, from :mod:`freescale.balance.simulator`),
:func:`straggler_share_at` and :func:`format_table`.

It may not touch tensors, devices or ``torch.distributed``: everything here is
arithmetic on numbers, deterministic and cheap. **The output is a projection, not a
measurement**: every row carries ``"kind": "projection"`` and the network model it
assumed. docs/projection.md explains how to read it.

Schedules (DESIGN.md sections 1-3):

* ``vanilla`` (TorchRec-equivalent): every embedding exchange is a blocking
  all-to-all on the critical path (counts, ids, embeddings, gradients: four
  collectives), no balancing (straggler share of the identity placement);
* ``freescale``: balancing (the straggler share the caller gives: the e2e report passes
  the simulator's for freescale's balancer, sticky on the cost model; FBS in
  :func:`straggler_shares_from_simulator`'s default), prioritized embedding updates
  (only collision-row traffic blocks: collision gradients out, updated collision rows
  back, plus the small mask exchange: three collectives), and everything else (ids of
  t+2, balancing moves, exclusive embeddings and gradients) overlapped with compute on
  SM-free paths, which slow the dense kernels they overlap by ``smfree_slowdown``.

Per-step time of one schedule at ``W`` ranks (all in ms; every term is reported)::

    step = dense                                   measured, per rank, constant in W
         + straggler_wait = dense * s / (1 - s)    s = straggler share at W
         + emb_compute                             measured, constant in W
         + exposed_emb_comm                        NetworkModel.alltoall_ms(blocking bytes)
         + exposed_allreduce                       last DDP bucket + what backward can't hide
         + overlap_slowdown                        dense kernels slowed by overlapped traffic
         + link_overflow                           overlapped traffic that doesn't fit
         + host_overhead                           measured, constant in W

See :func:`project` for the assumptions behind every term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Union

from freescale.balance.cost_model import DEFAULT_COST_MODEL, CostModel

__all__ = [
    "NetworkModel",
    "MeasuredCosts",
    "StragglerShares",
    "ASSUMPTIONS",
    "SCHEDULES",
    "VANILLA_BLOCKING_COLLECTIVES",
    "FREESCALE_BLOCKING_COLLECTIVES",
    "bytes_per_rank_from_sent",
    "straggler_share_at",
    "straggler_shares_from_simulator",
    "project",
    "projection_report",
    "format_table",
]

SCHEDULES = ("vanilla", "freescale")
# counts all-to-all, id all-to-all, embedding all-to-all, gradient all-to-all
VANILLA_BLOCKING_COLLECTIVES = 4
# mask exchange, collision gradients to the owners, updated collision rows back
FREESCALE_BLOCKING_COLLECTIVES = 3

_GB = 1e9  # bandwidths are in GB/s = 1e9 bytes per second
_MIB = 1 << 20

#: ``{W: share}`` or a function ``W -> share``; share = (max - mean) / max of dense time.
StragglerShares = Union[Mapping[int, float], Callable[[int], float]]


# ---------------------------------------------------------------- network model
@dataclass
class NetworkModel:
    """Bandwidth / latency model of a cluster of ``gpus_per_node``-GPU nodes.

    Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s); latencies are
    per collective, in microseconds. Defaults: H100/H200-class nodes of 8 GPUs.

    * ``intra_bw_gbps = 400``: NVLink-class (NVLink 4 is 450 GB/s per direction per
      GPU; NCCL reaches 80-90% of it). Our own 2x H200 measurements reached 113 GB/s
      (all-to-all of 297 MB, ``baseline_gpu.json``) and 280 GB/s (256 MB,
      ``sm_contention.json``): set the achieved figure for a calibrated projection.
    * ``inter_bw_gbps = 25``: one 200 Gb/s NIC per GPU (the paper's nodes: 8 x 200 Gb/s
      per 8-GPU node), i.e. 25 GB/s per GPU, assuming rail-optimised networking where
      every GPU drives its own NIC at line rate.
    * ``intra_latency_us = 10`` / ``inter_latency_us = 25``: fixed cost of one
      collective inside one node / across nodes (launch, handshake, first byte).
    * ``smfree_bw_factor = 1``: achieved bandwidth of the SM-free paths (copy engines
      inside a node, CPU-initiated RDMA across nodes, as in the paper) relative to
      NCCL's on the same links. Below 1 makes overlapped traffic take longer; our
      copy-engine peer copies reached 70-90 GB/s at 256 MB vs NCCL's 280 GB/s (0.3),
      and PyTorch's TCP-only gloo is far slower still (~2 GB/s): not the paper's path.
    """

    gpus_per_node: int = 8
    intra_bw_gbps: float = 400.0
    inter_bw_gbps: float = 25.0
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0
    smfree_bw_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1:
            raise ValueError("gpus_per_node must be >= 1")
        if min(self.intra_bw_gbps, self.inter_bw_gbps, self.smfree_bw_factor) <= 0:
            raise ValueError("bandwidths and smfree_bw_factor must be > 0")
        if min(self.intra_latency_us, self.inter_latency_us) < 0:
            raise ValueError("latencies must be >= 0")

    # ------------------------------------------------------------ primitives
    def ranks_per_node(self, world_size: int) -> int:
        """``g = min(gpus_per_node, W)``: ranks sharing a node (ranks fill nodes)."""
        return min(self.gpus_per_node, _check_world(world_size))

    def nodes(self, world_size: int) -> int:
        return math.ceil(_check_world(world_size) / self.gpus_per_node)

    def latency_ms(self, world_size: int) -> float:
        """Per-collective latency: intra-node if ``W <= gpus_per_node``, else inter-node."""
        w = _check_world(world_size)
        us = self.intra_latency_us if w <= self.gpus_per_node else self.inter_latency_us
        return us / 1e3

    def alltoall_split(self, bytes_per_rank: float, world_size: int) -> tuple[float, float]:
        """``(intra_bytes, inter_bytes)`` one rank sends in an even all-to-all.

        ``bytes_per_rank`` is the rank's whole input buffer, split evenly over the W
        destinations (its own 1/W share included, a local copy that costs nothing):
        ``intra = bytes * (g - 1) / W`` go to the other ranks of its node and
        ``inter = bytes * (W - g) / W`` cross nodes, ``g = min(gpus_per_node, W)``.
        """
        w = _check_world(world_size)
        g = self.ranks_per_node(w)
        b = float(bytes_per_rank)
        if b < 0:
            raise ValueError("bytes must be >= 0")
        return b * (g - 1) / w, b * (w - g) / w

    def alltoall_bandwidth_ms(
        self, bytes_per_rank: float, world_size: int, *, smfree: bool = False
    ) -> float:
        """Bandwidth term of :meth:`alltoall_ms` (no latency).

        ``max(intra_bytes / intra_bw, inter_bytes / inter_bw)``: NVLink and the NICs
        are separate links that run in parallel, so the slower of the two sets the
        time. ``smfree=True``: the SM-free paths, both bandwidths times
        ``smfree_bw_factor``.
        """
        intra, inter = self.alltoall_split(bytes_per_rank, world_size)
        ms = 1e3 * max(intra / (self.intra_bw_gbps * _GB), inter / (self.inter_bw_gbps * _GB))
        return ms / self.smfree_bw_factor if smfree else ms

    def alltoall_ms(self, bytes_per_rank: float, world_size: int, *, collectives: int = 1) -> float:
        """Time of all-to-all exchanges moving ``bytes_per_rank`` per rank in total::

            t = collectives * latency(W)
              + max(bytes * (g-1)/W / intra_bw, bytes * (W-g)/W / inter_bw)

        with ``g = min(gpus_per_node, W)`` and ``latency(W)`` the intra-node latency
        if all ranks share one node, else the inter-node one. ``collectives``: how many
        separate collectives carry the bytes (each pays the latency once). ``W = 1``
        moves nothing and costs nothing. Assumes even splits (row-wise sharding of
        hashed rows), no congestion beyond the per-GPU links, and no per-peer cost.
        """
        w = _check_world(world_size)
        if w == 1:
            return 0.0
        if collectives < 0:
            raise ValueError("collectives must be >= 0")
        return collectives * self.latency_ms(w) + self.alltoall_bandwidth_ms(bytes_per_rank, w)

    def allreduce_bandwidth_ms(self, nbytes: float, world_size: int) -> float:
        """Bandwidth term of :meth:`allreduce_ms`: ``2 (W-1)/W * bytes / bw``."""
        w = _check_world(world_size)
        if w == 1:
            return 0.0
        if nbytes < 0:
            raise ValueError("bytes must be >= 0")
        bw = self.intra_bw_gbps if w <= self.gpus_per_node else self.inter_bw_gbps
        return 1e3 * 2.0 * (w - 1) / w * float(nbytes) / (bw * _GB)

    def allreduce_ms(self, nbytes: float, world_size: int) -> float:
        """Ring all-reduce of ``nbytes`` (the buffer every rank holds)::

            t = latency(W) * max(1, log2 W) + 2 (W-1)/W * bytes / bw

        ``bw`` is the bottleneck link: intra-node if ``W <= gpus_per_node``, else the
        inter-node bandwidth per GPU (each ring crosses the NICs). The latency term is
        that of a tree (NCCL picks trees when small messages are latency bound).
        ``W = 1`` costs nothing.
        """
        w = _check_world(world_size)
        if w == 1:
            return 0.0
        return self.latency_ms(w) * max(1.0, math.log2(w)) + self.allreduce_bandwidth_ms(nbytes, w)

    # ------------------------------------------------------------- serialise
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> NetworkModel:
        names = {f.name for f in fields(NetworkModel)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown NetworkModel keys: {sorted(unknown)}")
        return NetworkModel(**dict(d))


def _check_world(world_size: int) -> int:
    w = int(world_size)
    if w < 1 or w != world_size:
        raise ValueError(f"world size must be a positive integer, got {world_size!r}")
    return w


def bytes_per_rank_from_sent(bytes_sent_to_peers: float, world_size: int) -> float:
    """All-to-all input bytes per rank from the bytes it *sent to other ranks* at ``W``.

    Trainers and NCCL benchmarks usually report bytes sent to peers, i.e.
    ``buffer * (W-1)/W`` under even splits; :class:`MeasuredCosts` wants the buffer
    (which, at a fixed local batch, does not depend on W).
    """
    w = _check_world(world_size)
    if w == 1:
        raise ValueError("one rank sends nothing to peers: measure at W >= 2")
    return float(bytes_sent_to_peers) * w / (w - 1)


# ------------------------------------------------------------- straggler shares
def straggler_share_at(shares: StragglerShares, world_size: int) -> float:
    """Straggler share at ``world_size`` from a callable or a ``{W: share}`` dict.

    A dict is looked up exactly, else interpolated linearly in ``log2 W`` between the
    two nearest world sizes it holds. It is never extrapolated: a world size outside
    its range raises ``ValueError`` (simulate that world size instead). ``W = 1`` has
    no straggler (0). The result must lie in ``[0, 1)``.
    """
    w = _check_world(world_size)
    if callable(shares):
        s = float(shares(w))
    else:
        table = {int(k): float(v) for k, v in shares.items()}
        if w in table:
            s = table[w]
        elif w == 1:
            s = 0.0
        else:
            ws = sorted(table)
            if not ws or w < ws[0] or w > ws[-1]:
                raise ValueError(
                    f"no straggler share for W={w} (known: {ws}); simulate it, "
                    "shares are not extrapolated"
                )
            hi = next(k for k in ws if k > w)
            lo = max(k for k in ws if k < w)
            f = (math.log2(w) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
            s = table[lo] + f * (table[hi] - table[lo])
    if not 0.0 <= s < 1.0 or not math.isfinite(s):
        raise ValueError(f"straggler share must lie in [0, 1), got {s} at W={w}")
    return s


def straggler_shares_from_simulator(
    world_sizes: Sequence[int] = (2, 64, 256),
    *,
    cost_model: CostModel | Mapping[str, Any] | None = None,
    batch_size: int = 128,
    max_uih: int = 16384,
    length_dist: str = "lognormal",
    median_uih: int = 1024,
    sigma: float = 1.0,
    powerlaw_alpha: float = 1.2,
    min_uih: int = 1,
    lengths_pool: Sequence[int] | None = None,
    steps: int = 200,
    balanced_partitioner: str = "fbs",
    alpha: float = 1.5,
    seed: int = 0,
) -> dict[str, dict[int, float]]:
    """Straggler shares ``{"vanilla": {W: s}, "freescale": {W: s}}`` from the simulator.

    Runs :func:`freescale.balance.simulator.simulate` once over ``world_sizes`` with
    the ``identity`` placement (vanilla: samples stay where the loader put them) and
    ``balanced_partitioner`` (FBS by default, planned with ``L^alpha`` weights as
    ``--balance fbs`` does; ``fbs_cost``, ``sticky_cost`` etc. plan with the cost model:
    the e2e report passes ``sticky_cost``, ``--mode freescale``'s balancer). Each share is the
    median over ``steps`` simulated steps of ``(max - mean) / max`` of the per-rank
    cost under ``cost_model`` (a fitted :class:`CostModel`, its dict, or ``None`` for
    the simulator's illustrative default; pass the fit of your own GPU run, e.g.
    ``benchmarks/results/cost_model_2gpu.json``). Lengths: ``lognormal`` /
    ``powerlaw`` with the given knobs, or ``lengths_pool`` (history lengths to draw
    from, e.g. MovieLens users) when given. ``batch_size`` is the local batch per rank.

    Cost: ``steps x len(world_sizes)`` draws of ``W x batch_size`` lengths and two
    plans each; a few seconds at 200 steps up to 256 ranks of 128 samples. The
    simulator scores plans noise-free, so measured shares (timing jitter) sit above
    these at small W.
    """
    from freescale.balance.simulator import SimConfig, simulate

    if cost_model is None:
        cm = CostModel(**asdict(DEFAULT_COST_MODEL))
    elif isinstance(cost_model, CostModel):
        cm = cost_model
    else:
        cm = CostModel.from_dict(dict(cost_model))
    ranks = sorted({_check_world(w) for w in world_sizes})
    names = ["identity", balanced_partitioner]
    cfg = SimConfig(
        ranks=ranks,
        batch_sizes=[batch_size],
        max_uih=[max_uih],
        steps=steps,
        length_dist="file" if lengths_pool is not None else length_dist,
        median_uih=median_uih,
        sigma=sigma,
        powerlaw_alpha=powerlaw_alpha,
        min_uih=min_uih,
        # the pool is passed in memory; SimConfig only checks that a source is named
        lengths_file="<in-memory pool>" if lengths_pool is not None else None,
        partitioners=names,
        alpha=alpha,
        cost_model=cm,
        seed=seed,
    )
    rows = simulate(cfg, lengths_pool=lengths_pool)
    out: dict[str, dict[int, float]] = {"vanilla": {}, "freescale": {}}
    for r in rows:
        key = "vanilla" if r["partitioner"] == "identity" else "freescale"
        out[key][int(r["ranks"])] = float(r["straggler"]["median"])
    return out


# -------------------------------------------------------------- measured costs
@dataclass
class MeasuredCosts:
    """Per-step, per-rank quantities measured by one run at ``measured_world_size``.

    Times are medians over timed steps, in ms; sizes in bytes. The local batch per
    rank is fixed (weak scaling): every quantity below is per rank and, except the
    straggler shares, taken as independent of the world size.

    * ``dense_ms``: forward + backward of the dense model on a rank of *average* load
      (the mean over ranks; if you only have the slowest rank's time ``t_max`` at
      share ``s``, use ``t_max * (1 - s)``), without embedding work or waits;
    * ``emb_compute_ms``: embedding compute on the critical path: lookups, sparse
      optimizer updates, index kernels (bucketing, permutes), not the exchanges;
    * ``emb_bytes_per_rank``: all-to-all input bytes of one rank per step, summed over
      the blocking exchanges of vanilla (ids, embeddings, gradients), its own 1/W share
      included (see :func:`bytes_per_rank_from_sent`);
    * ``collision_rate``: occurrence share of collision rows (ids of step t whose row
      step t+1 also touches); the blocking fraction of the embedding bytes under
      freescale;
    * ``dense_param_bytes``: bytes of the dense gradients DDP all-reduces per step;
    * ``host_overhead_ms``: per-step CPU / launch gaps not overlapped with GPU work;
    * ``straggler_vanilla`` / ``straggler_freescale``: straggler share
      ``(max - mean) / max`` of dense time, identity placement / the balancer, as a
      ``{W: share}`` dict (e.g. :func:`straggler_shares_from_simulator`) or a
      callable ``W -> share``;
    * ``smfree_slowdown``: relative slowdown of a dense kernel while SM-free traffic
      runs beside it the whole time (``sm_contention.json``: copy engine 0.044 at
      256 MB, GEMM); ``nccl_slowdown``: the same under NCCL (0.146), used for DDP's
      all-reduce, which overlaps backward on NCCL in both schedules;
    * ``backward_share``: backward's share of ``dense_ms`` (the window DDP can hide
      its all-reduce in; 2/3 is the usual 2:1 backward:forward FLOP ratio);
    * ``ddp_bucket_bytes``: DDP's bucket cap (25 MiB by default in PyTorch);
    * ``balance_bytes_per_rank``: bytes one rank moves per step to rebalance samples
      (ids only, 8 bytes an id; overlapped under freescale, absent in vanilla);
    * ``local_batch_size``: samples per rank per step (for QPS);
    * ``measured_exposed_comm_ms``: optional ``{"vanilla": ms, "freescale": ms}``
      measured at ``measured_world_size``, echoed next to the model's figure there;
    * ``source``: where the numbers come from (file, commit), copied into reports.
    """

    dense_ms: float
    emb_compute_ms: float
    emb_bytes_per_rank: float
    collision_rate: float
    dense_param_bytes: float
    host_overhead_ms: float
    straggler_vanilla: StragglerShares
    straggler_freescale: StragglerShares
    smfree_slowdown: float = 0.044
    nccl_slowdown: float = 0.146
    backward_share: float = 2.0 / 3.0
    ddp_bucket_bytes: float = 25 * _MIB
    balance_bytes_per_rank: float = 0.0
    local_batch_size: int = 128
    measured_world_size: int = 2
    measured_exposed_comm_ms: dict[str, float] | None = None
    source: str = ""
    # freescale's own host overhead when measured (its planner and prioritized host
    # work add to it); None: the same as vanilla's
    host_overhead_freescale_ms: float | None = None

    def host_ms(self, schedule: str) -> float:
        """Host overhead of ``schedule`` (freescale's own if measured)."""
        if schedule == "freescale" and self.host_overhead_freescale_ms is not None:
            return self.host_overhead_freescale_ms
        return self.host_overhead_ms

    def __post_init__(self) -> None:
        for name in (
            "dense_ms",
            "emb_compute_ms",
            "emb_bytes_per_rank",
            "dense_param_bytes",
            "host_overhead_ms",
            "smfree_slowdown",
            "nccl_slowdown",
            "balance_bytes_per_rank",
        ):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
        if not 0.0 <= self.collision_rate <= 1.0:
            raise ValueError(f"collision_rate must lie in [0, 1], got {self.collision_rate}")
        if not 0.0 < self.backward_share <= 1.0:
            raise ValueError("backward_share must lie in (0, 1]")
        if self.ddp_bucket_bytes <= 0 or self.local_batch_size < 1:
            raise ValueError("ddp_bucket_bytes and local_batch_size must be positive")
        _check_world(self.measured_world_size)

    def straggler_share(self, schedule: str, world_size: int) -> float:
        """Straggler share of ``schedule`` ("vanilla" / "freescale") at ``world_size``."""
        if schedule == "vanilla":
            return straggler_share_at(self.straggler_vanilla, world_size)
        if schedule == "freescale":
            return straggler_share_at(self.straggler_freescale, world_size)
        raise ValueError(f"unknown schedule {schedule!r} (known: {SCHEDULES})")

    def to_dict(self, world_sizes: Sequence[int] | None = None) -> dict[str, Any]:
        """JSON-ready dict; straggler dicts get string keys (JSON object keys).

        A callable straggler share cannot be stored: pass ``world_sizes`` to tabulate
        it there (it then comes back as a dict), else this raises ``ValueError``.
        """
        d: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("straggler_vanilla", "straggler_freescale"):
                if callable(v):
                    if world_sizes is None:
                        raise ValueError(f"{f.name} is a callable: pass world_sizes to tabulate it")
                    v = {w: float(v(w)) for w in world_sizes}
                v = {str(int(k)): float(s) for k, s in sorted(v.items(), key=lambda kv: int(kv[0]))}
            elif isinstance(v, dict):
                v = dict(v)
            d[f.name] = v
        return d

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> MeasuredCosts:
        """Inverse of :meth:`to_dict` (string or int world-size keys both accepted)."""
        names = {f.name for f in fields(MeasuredCosts)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown MeasuredCosts keys: {sorted(unknown)}")
        kw = dict(d)
        for k in ("straggler_vanilla", "straggler_freescale"):
            if k in kw and not callable(kw[k]):
                kw[k] = {int(w): float(s) for w, s in kw[k].items()}
        if kw.get("measured_exposed_comm_ms") is not None:
            kw["measured_exposed_comm_ms"] = {
                str(s): float(v) for s, v in kw["measured_exposed_comm_ms"].items()
            }
        return MeasuredCosts(**kw)


# ------------------------------------------------------------------ projection
ASSUMPTIONS: tuple[str, ...] = (
    "Projection, not measurement: measured per-rank stage costs at a small world size "
    "plus an explicit network model (NetworkModel) and simulated straggler shares.",
    "Weak scaling: the local batch per rank is fixed, so dense time, embedding compute, "
    "embedding bytes per rank and host overhead do not change with W.",
    "Row-wise sharding of hashed rows: every all-to-all has even splits; no hot-row "
    "owner imbalance, no congestion beyond the per-GPU links, no per-peer overhead.",
    "Straggler wait = dense * s / (1 - s), s = (max - mean) / max of dense time over "
    "ranks (DESIGN.md 2.1): the slowest rank takes dense / (1 - s) and the others wait.",
    "Embedding compute (lookups, updates, index kernels) stays on the critical path in "
    "both schedules (side-stream work competes for the same SMs).",
    "vanilla: all embedding bytes on blocking all-to-alls (4 collectives: counts, ids, "
    "embeddings, gradients), nothing overlapped but DDP's all-reduce.",
    "freescale: collision_rate x the embedding bytes block (3 collectives: mask "
    "exchange, collision gradients, collision rows; ids counted in the blocking bytes, "
    "conservatively); the rest, plus balancing moves, is overlapped on SM-free paths.",
    "Overlapped traffic is hidden if its link time fits in the compute window "
    "(dense + embedding compute, minus DDP's all-reduce sharing the links); any excess "
    "is exposed as link_overflow.",
    "Overlap slowdown = slowdown x coverage x kernel time, coverage = share of the "
    "kernel time with a transfer in flight (SM-free traffic over dense, NCCL all-reduce "
    "over backward); interference proportional to time overlapped.",
    "DDP overlaps its all-reduce with backward except the last bucket "
    "(min(ddp_bucket_bytes, dense_param_bytes)), which is exposed in full; all-reduce "
    "time beyond the backward window is exposed too.",
    "Host overhead is constant in W; freescale's is its own measured value when given "
    "(host_overhead_freescale_ms), else the same as vanilla's.",
)


def _schedule_row(
    schedule: str, costs: MeasuredCosts, net: NetworkModel, w: int, *, collectives: int
) -> dict[str, Any]:
    c = costs
    share = c.straggler_share(schedule, w)
    straggler_wait = c.dense_ms * share / (1.0 - share)
    backward_ms = c.backward_share * c.dense_ms

    # DDP all-reduce: the last bucket is exposed; the rest overlaps backward
    last_bucket = min(c.ddp_bucket_bytes, c.dense_param_bytes)
    ar_total = net.allreduce_ms(c.dense_param_bytes, w)
    ar_last = net.allreduce_ms(last_bucket, w) if last_bucket > 0 else 0.0
    ar_rest = max(0.0, ar_total - ar_last)
    ar_hidden = min(ar_rest, backward_ms)
    exposed_allreduce = ar_last + (ar_rest - ar_hidden)
    ar_coverage = ar_hidden / backward_ms if backward_ms > 0 else 0.0
    overlap_nccl = c.nccl_slowdown * ar_coverage * backward_ms if w > 1 else 0.0

    if schedule == "vanilla":
        blocking_bytes = c.emb_bytes_per_rank
        overlapped_bytes = 0.0
    else:
        blocking_bytes = c.collision_rate * c.emb_bytes_per_rank
        overlapped_bytes = (1.0 - c.collision_rate) * c.emb_bytes_per_rank
        overlapped_bytes += c.balance_bytes_per_rank
    exposed_emb = net.alltoall_ms(blocking_bytes, w, collectives=collectives)

    # overlapped (SM-free) traffic: its link time must fit in the compute window,
    # which it shares with the part of DDP's all-reduce hidden under backward
    smfree_ms = net.alltoall_bandwidth_ms(overlapped_bytes, w, smfree=True) if w > 1 else 0.0
    window = c.dense_ms + c.emb_compute_ms
    link_overflow = max(0.0, smfree_ms + ar_hidden - window) if smfree_ms > 0 else 0.0
    smfree_coverage = min(1.0, smfree_ms / c.dense_ms) if c.dense_ms > 0 else 0.0
    overlap_smfree = c.smfree_slowdown * smfree_coverage * c.dense_ms

    breakdown = {
        "dense": c.dense_ms,
        "straggler_wait": straggler_wait,
        "emb_compute": c.emb_compute_ms,
        "exposed_emb_comm": exposed_emb,
        "exposed_allreduce": exposed_allreduce,
        "overlap_slowdown": overlap_nccl + overlap_smfree,
        "link_overflow": link_overflow,
        "host_overhead": c.host_ms(schedule),
    }
    step_ms = sum(breakdown.values())
    ideal_ms = c.dense_ms + c.emb_compute_ms + c.host_ms(schedule)
    qps_per_gpu = 1e3 * c.local_batch_size / step_ms
    intra, inter = net.alltoall_split(blocking_bytes, w)
    return {
        "kind": "projection",
        "schedule": schedule,
        "world_size": w,
        "nodes": net.nodes(w),
        "step_ms": step_ms,
        "breakdown_ms": breakdown,
        "straggler_share": share,
        "qps_per_gpu": qps_per_gpu,
        "qps_total": qps_per_gpu * w,
        # one rank with free, instant network and perfect balance = 1
        "qps_per_gpu_rel": ideal_ms / step_ms,
        "detail": {
            "blocking_collectives": collectives,
            "blocking_bytes_per_rank": blocking_bytes,
            "blocking_intra_bytes": intra,
            "blocking_inter_bytes": inter,
            "overlapped_bytes_per_rank": overlapped_bytes,
            "overlapped_link_ms": smfree_ms,
            "overlap_window_ms": window,
            "smfree_coverage": smfree_coverage,
            "overlap_slowdown_smfree_ms": overlap_smfree,
            "overlap_slowdown_allreduce_ms": overlap_nccl,
            "allreduce_total_ms": ar_total,
            "allreduce_last_bucket_ms": ar_last,
            "allreduce_hidden_ms": ar_hidden,
            "backward_ms": backward_ms,
            "ideal_step_ms": ideal_ms,
        },
        "network": net.to_dict(),
        "measured_world_size": c.measured_world_size,
    }


def project(
    costs: MeasuredCosts,
    net: NetworkModel | None = None,
    world_sizes: Sequence[int] = (2, 64, 256),
    *,
    vanilla_collectives: int = VANILLA_BLOCKING_COLLECTIVES,
    freescale_collectives: int = FREESCALE_BLOCKING_COLLECTIVES,
) -> list[dict[str, Any]]:
    """Projected per-step time of ``vanilla`` and ``freescale`` at each world size.

    One row per (world size, schedule), in that order. Terms (ms per step)::

        dense             costs.dense_ms (mean over ranks; weak scaling: constant in W)
        straggler_wait    dense * s / (1 - s); s from costs.straggler_{vanilla,freescale}
                          at W (identity placement / the balancer): the slowest rank's dense time
                          is dense / (1 - s) when s = (max - mean) / max
        emb_compute       costs.emb_compute_ms, on the critical path in both schedules
        exposed_emb_comm  net.alltoall_ms(blocking bytes, W, collectives=k):
                          vanilla: all emb_bytes_per_rank, k = 4 (counts, ids,
                          embeddings, gradients); freescale: collision_rate x
                          emb_bytes_per_rank, k = 3 (mask exchange, collision gradients,
                          collision rows), so collision_rate = 0 leaves 3 latencies
        exposed_allreduce DDP overlaps its all-reduce with backward (backward_share x
                          dense) except the last bucket, min(ddp_bucket_bytes,
                          dense_param_bytes), which is exposed in full; all-reduce time
                          that does not fit in backward is exposed as well
        overlap_slowdown  nccl_slowdown x backward x (hidden all-reduce time / backward)
                          [both schedules] + smfree_slowdown x dense x min(1, SM-free
                          link time / dense) [freescale: overlapped emb + balance bytes]
        link_overflow     freescale: SM-free link time + hidden all-reduce time beyond
                          the window dense + emb_compute (traffic that cannot hide)
        host_overhead     costs.host_overhead_ms (freescale: host_overhead_freescale_ms
                          when measured)

    ``step_ms`` is their sum. Also per row: ``qps_per_gpu`` (local batch / step),
    ``qps_total``, ``qps_per_gpu_rel`` (ideal step / step, ideal = dense + emb_compute
    + host overhead: one rank with a free network and perfect balance),
    ``freescale_over_vanilla`` (QPS ratio at that W, on both rows), ``detail``
    (intermediate terms), ``"kind": "projection"``, the ``network`` dict and, at
    ``costs.measured_world_size``, ``measured_exposed_comm_ms`` when the costs carry it
    (compare with ``breakdown_ms["exposed_emb_comm"]`` to judge the network model).

    Everything in :data:`ASSUMPTIONS` applies; in short: even all-to-all splits,
    per-GPU links as the only bottleneck, stage costs independent of W, additive
    terms (no overlap between the waits), straggler shares from the simulator (which
    scores plans noise-free, so it misses timing jitter that grows with W).
    """
    net = net if net is not None else NetworkModel()
    rows: list[dict[str, Any]] = []
    for w in world_sizes:
        w = _check_world(w)
        pair = [
            _schedule_row("vanilla", costs, net, w, collectives=vanilla_collectives),
            _schedule_row("freescale", costs, net, w, collectives=freescale_collectives),
        ]
        ratio = pair[1]["qps_per_gpu"] / pair[0]["qps_per_gpu"]
        for r in pair:
            r["freescale_over_vanilla"] = ratio
            if w == costs.measured_world_size and costs.measured_exposed_comm_ms:
                m = costs.measured_exposed_comm_ms.get(r["schedule"])
                if m is not None:
                    r["measured_exposed_comm_ms"] = float(m)
        rows.extend(pair)
    return rows


def projection_report(
    costs: MeasuredCosts,
    net: NetworkModel | None = None,
    world_sizes: Sequence[int] = (2, 64, 256),
) -> dict[str, Any]:
    """``{"kind", "network", "costs", "assumptions", "rows"}``: JSON-ready projection."""
    net = net if net is not None else NetworkModel()
    return {
        "kind": "projection",
        "network": net.to_dict(),
        "costs": costs.to_dict(world_sizes=world_sizes),
        "assumptions": list(ASSUMPTIONS),
        "rows": project(costs, net, world_sizes),
    }


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """Fixed-width text table of :func:`project` rows (ms per step)."""
    cols = (
        ("dense", "dense"),
        ("strag", "straggler_wait"),
        ("emb", "emb_compute"),
        ("a2a", "exposed_emb_comm"),
        ("allred", "exposed_allreduce"),
        ("ovl", "overlap_slowdown"),
        ("overfl", "link_overflow"),
        ("host", "host_overhead"),
    )
    head = f"{'W':>5} {'schedule':<10} {'step':>8} " + " ".join(f"{n:>7}" for n, _ in cols)
    head += f" {'qps/gpu':>8} {'rel':>5} {'fs/van':>6}"
    out = ["PROJECTION (not measured)", head, "-" * len(head)]
    for r in rows:
        b = r["breakdown_ms"]
        out.append(
            f"{r['world_size']:>5} {r['schedule']:<10} {r['step_ms']:>8.2f} "
            + " ".join(f"{b[k]:>7.2f}" for _, k in cols)
            + f" {r['qps_per_gpu']:>8.1f} {r['qps_per_gpu_rel']:>5.2f}"
            + f" {r['freescale_over_vanilla']:>6.2f}"
        )
    return "\n".join(out)
