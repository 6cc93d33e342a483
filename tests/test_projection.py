"""Projection of step time to more ranks (pipeline/projection.py): pure arithmetic, CPU."""

from __future__ import annotations

import json
import math

import pytest

from freescale.balance.cost_model import CostModel
from freescale.pipeline.projection import (
    FREESCALE_BLOCKING_COLLECTIVES,
    VANILLA_BLOCKING_COLLECTIVES,
    MeasuredCosts,
    NetworkModel,
    bytes_per_rank_from_sent,
    format_table,
    project,
    projection_report,
    straggler_share_at,
    straggler_shares_from_simulator,
)

NET = NetworkModel(
    gpus_per_node=8,
    intra_bw_gbps=400.0,
    inter_bw_gbps=25.0,
    intra_latency_us=10.0,
    inter_latency_us=25.0,
)


def _costs(**kw) -> MeasuredCosts:
    base = dict(
        dense_ms=45.0,
        emb_compute_ms=12.0,
        emb_bytes_per_rank=3e8,
        collision_rate=0.1,
        dense_param_bytes=4e6,
        host_overhead_ms=1.0,
        straggler_vanilla={2: 0.03, 64: 0.22, 256: 0.26},
        straggler_freescale={2: 0.01, 64: 0.015, 256: 0.015},
    )
    base.update(kw)
    return MeasuredCosts(**base)


# ------------------------------------------------------------- network model
def test_alltoall_single_node_hand_computed():
    # W=2 in one node: half of 1 GB goes to the peer over NVLink, nothing crosses nodes
    assert NET.alltoall_split(1e9, 2) == (0.5e9, 0.0)
    # 0.5e9 B / 400e9 B/s = 1.25 ms, + 10 us
    assert NET.alltoall_ms(1e9, 2) == pytest.approx(1.25 + 0.010, rel=1e-12)
    # W=8 still one node: 7/8 of the bytes over NVLink
    assert NET.alltoall_ms(1e9, 8) == pytest.approx(7 / 8 * 1e9 / 400e9 * 1e3 + 0.010)


def test_alltoall_multi_node_hand_computed():
    # W=64, 8 per node: 7/64 stay in the node, 56/64 cross it
    intra, inter = NET.alltoall_split(1e9, 64)
    assert intra == pytest.approx(7 / 64 * 1e9)
    assert inter == pytest.approx(56 / 64 * 1e9)
    # max(0.109375e9 / 400e9, 0.875e9 / 25e9) s = 35 ms, + 25 us inter-node latency
    assert NET.alltoall_ms(1e9, 64) == pytest.approx(35.0 + 0.025, rel=1e-12)
    assert NET.alltoall_ms(1e9, 64, collectives=4) == pytest.approx(35.0 + 4 * 0.025)
    assert NET.nodes(64) == 8 and NET.nodes(2) == 1 and NET.nodes(9) == 2
    assert NET.alltoall_ms(1e9, 1) == 0.0


def test_allreduce_hand_computed():
    # ring: 2 (W-1)/W * bytes / bw + latency * max(1, log2 W)
    assert NET.allreduce_ms(1e8, 2) == pytest.approx(2 * 1 / 2 * 1e8 / 400e9 * 1e3 + 0.010)
    assert NET.allreduce_ms(1e8, 64) == pytest.approx(2 * 63 / 64 * 1e8 / 25e9 * 1e3 + 6 * 0.025)
    assert NET.allreduce_ms(1e8, 1) == 0.0


def test_network_model_validation_and_round_trip():
    with pytest.raises(ValueError):
        NetworkModel(inter_bw_gbps=0)
    with pytest.raises(ValueError):
        NET.alltoall_ms(1.0, 0)
    with pytest.raises(ValueError):
        NetworkModel.from_dict({"gpus_per_node": 8, "bogus": 1})
    assert NetworkModel.from_dict(json.loads(json.dumps(NET.to_dict()))) == NET


def test_bytes_per_rank_from_sent():
    assert bytes_per_rank_from_sent(148.6e6, 2) == pytest.approx(297.2e6)
    assert bytes_per_rank_from_sent(7.0, 8) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        bytes_per_rank_from_sent(1.0, 1)


# ---------------------------------------------------------------- projection
def _by(rows, schedule):
    return {r["world_size"]: r for r in rows if r["schedule"] == schedule}


def test_vanilla_exposed_comm_monotone_in_ranks():
    ws = (2, 4, 8, 9, 16, 32, 64, 128, 256, 512, 1024)
    costs = _costs(straggler_vanilla={2: 0.0, 1024: 0.3}, straggler_freescale={2: 0.0, 1024: 0.0})
    van = _by(project(costs, NET, ws), "vanilla")
    comm = [van[w]["breakdown_ms"]["exposed_emb_comm"] for w in ws]
    assert all(b >= a for a, b in zip(comm, comm[1:])), comm
    # crossing the node boundary is a big step up (NIC 16x slower than NVLink here)
    assert (
        van[16]["breakdown_ms"]["exposed_emb_comm"] > 5 * van[8]["breakdown_ms"]["exposed_emb_comm"]
    )


def test_freescale_exposed_comm_scales_with_collision_rate():
    ws = (2, 64, 256)
    floor = {w: FREESCALE_BLOCKING_COLLECTIVES * NET.latency_ms(w) for w in ws}
    fs0 = _by(project(_costs(collision_rate=0.0), NET, ws), "freescale")
    for w in ws:
        # nothing blocks but the latency of the three blocking collectives
        assert fs0[w]["breakdown_ms"]["exposed_emb_comm"] == pytest.approx(floor[w])
    excess = {}
    for c in (0.1, 0.2, 0.4, 1.0):
        fs = _by(project(_costs(collision_rate=c), NET, ws), "freescale")
        for w in ws:
            excess[(c, w)] = fs[w]["breakdown_ms"]["exposed_emb_comm"] - floor[w]
    for w in ws:
        # linear in the collision rate, through the latency floor
        for c in (0.2, 0.4, 1.0):
            assert excess[(c, w)] == pytest.approx(c / 0.1 * excess[(0.1, w)], rel=1e-9)
    # collision_rate = 1: the same bytes as vanilla, one collective fewer
    van = _by(project(_costs(collision_rate=1.0), NET, ws), "vanilla")
    for w in ws:
        diff = (VANILLA_BLOCKING_COLLECTIVES - FREESCALE_BLOCKING_COLLECTIVES) * NET.latency_ms(w)
        assert van[w]["breakdown_ms"]["exposed_emb_comm"] - diff == pytest.approx(
            floor[w] + excess[(1.0, w)]
        )


def test_project_rows_and_breakdown():
    costs = _costs()
    rows = project(costs, NET)
    assert [(r["world_size"], r["schedule"]) for r in rows] == [
        (w, s) for w in (2, 64, 256) for s in ("vanilla", "freescale")
    ]
    for r in rows:
        assert r["kind"] == "projection"
        assert r["network"] == NET.to_dict()
        assert r["step_ms"] == pytest.approx(sum(r["breakdown_ms"].values()))
        assert r["qps_per_gpu"] == pytest.approx(1e3 * costs.local_batch_size / r["step_ms"])
        assert 0 < r["qps_per_gpu_rel"] <= 1
        s = r["straggler_share"]
        assert r["breakdown_ms"]["straggler_wait"] == pytest.approx(costs.dense_ms * s / (1 - s))
    van, fs = _by(rows, "vanilla"), _by(rows, "freescale")
    for w in (2, 64, 256):
        assert fs[w]["freescale_over_vanilla"] == pytest.approx(
            fs[w]["qps_per_gpu"] / van[w]["qps_per_gpu"]
        )
        assert (
            van[w]["breakdown_ms"]["overlap_slowdown"] <= fs[w]["breakdown_ms"]["overlap_slowdown"]
        )
    assert van[64]["straggler_share"] == 0.22
    # the last DDP bucket (here all 4 MB) is exposed: W=64 ring over the NICs
    assert van[64]["breakdown_ms"]["exposed_allreduce"] == pytest.approx(NET.allreduce_ms(4e6, 64))
    assert fs[256]["freescale_over_vanilla"] > 1.0
    assert "PROJECTION" in format_table(rows)


def test_allreduce_beyond_last_bucket_hidden_by_backward():
    # 100 MB of dense gradients, 25 MiB buckets: only the last bucket is exposed while
    # the rest fits in backward (30 ms); a 1 ms backward exposes the remainder too
    big = _costs(dense_param_bytes=1e8)
    r = _by(project(big, NET, (64,)), "vanilla")[64]
    last = NET.allreduce_ms(25 * 2**20, 64)
    rest = NET.allreduce_ms(1e8, 64) - last
    assert rest < big.backward_share * big.dense_ms
    assert r["breakdown_ms"]["exposed_allreduce"] == pytest.approx(last)
    tiny = _costs(dense_param_bytes=1e8, dense_ms=1.5)
    r = _by(project(tiny, NET, (64,)), "vanilla")[64]
    assert r["breakdown_ms"]["exposed_allreduce"] == pytest.approx(last + rest - 1.0)


def test_overlapped_traffic_that_does_not_fit_is_exposed():
    slow = NetworkModel(inter_bw_gbps=1.0)
    r = _by(project(_costs(collision_rate=0.0), slow, (64,)), "freescale")[64]
    d = r["detail"]
    assert d["overlapped_link_ms"] > d["overlap_window_ms"]
    assert r["breakdown_ms"]["link_overflow"] == pytest.approx(
        d["overlapped_link_ms"] + d["allreduce_hidden_ms"] - d["overlap_window_ms"]
    )
    assert d["smfree_coverage"] == 1.0


def test_measured_exposed_comm_echoed_at_measured_world_size():
    costs = _costs(measured_exposed_comm_ms={"vanilla": 6.0, "freescale": 1.0})
    rows = project(costs, NET)
    at2 = [r for r in rows if r["world_size"] == 2]
    assert {r["schedule"]: r["measured_exposed_comm_ms"] for r in at2} == {
        "vanilla": 6.0,
        "freescale": 1.0,
    }
    assert all("measured_exposed_comm_ms" not in r for r in rows if r["world_size"] != 2)


def test_straggler_share_lookup():
    table = {2: 0.1, 8: 0.3}
    assert straggler_share_at(table, 2) == 0.1
    assert straggler_share_at(table, 4) == pytest.approx(0.2)  # halfway in log2 W
    assert straggler_share_at(table, 1) == 0.0
    with pytest.raises(ValueError):
        straggler_share_at(table, 16)  # never extrapolated
    assert straggler_share_at(lambda w: 0.01 * math.log2(w), 64) == pytest.approx(0.06)
    with pytest.raises(ValueError):
        straggler_share_at({2: 1.0}, 2)


def test_measured_costs_round_trip():
    costs = _costs(measured_exposed_comm_ms={"vanilla": 6.0}, source="test")
    d = costs.to_dict()
    assert d["straggler_vanilla"] == {"2": 0.03, "64": 0.22, "256": 0.26}
    assert MeasuredCosts.from_dict(d) == costs
    assert MeasuredCosts.from_dict(json.loads(json.dumps(d))) == costs
    # a callable is tabulated at the given world sizes
    fn = _costs(straggler_vanilla=lambda w: 0.001 * w)
    with pytest.raises(ValueError):
        fn.to_dict()
    back = MeasuredCosts.from_dict(fn.to_dict(world_sizes=(2, 64)))
    assert back.straggler_vanilla == {2: 0.002, 64: 0.064}
    with pytest.raises(ValueError):
        MeasuredCosts.from_dict({**d, "bogus": 1})
    with pytest.raises(ValueError):
        _costs(collision_rate=1.5)
    rep = projection_report(costs, NET)
    assert rep["kind"] == "projection" and rep["assumptions"]
    assert json.loads(json.dumps(rep))["costs"] == d


# -------------------------------------------------------------- simulator helper
def test_straggler_shares_from_simulator_small():
    cm = CostModel(a=8.4e-5, b=1.1e-8, c=1.0, fitted=True)
    shares = straggler_shares_from_simulator(
        (2, 8, 16),
        cost_model=cm,
        batch_size=16,
        max_uih=16384,
        median_uih=256,
        sigma=1.5,
        steps=30,
    )
    assert set(shares) == {"vanilla", "freescale"}
    for key in shares:
        assert set(shares[key]) == {2, 8, 16}
        assert all(0.0 <= s < 1.0 for s in shares[key].values())
    for w in (2, 8, 16):
        assert shares["freescale"][w] <= shares["vanilla"][w]
    assert shares["vanilla"][16] > 0.05  # skewed lengths: a real straggler
    # they plug straight into MeasuredCosts
    rows = project(
        _costs(straggler_vanilla=shares["vanilla"], straggler_freescale=shares["freescale"]),
        NET,
        (2, 16),
    )
    assert len(rows) == 4
    # a pool of lengths instead of a distribution; dict cost models accepted
    pooled = straggler_shares_from_simulator(
        (4,), cost_model=cm.to_dict(), batch_size=8, lengths_pool=[10, 20, 5000], steps=10
    )
    assert pooled["freescale"][4] <= pooled["vanilla"][4]
