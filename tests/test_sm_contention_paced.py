"""``benchmarks/sm_contention.py``'s paced copy engine (``copy_engine_paced``: the copy
engine slowed on the host to NCCL's byte rate, so the slowdown is measured at ~equal
bytes instead of extrapolated): the pacing arithmetic, the cell's pacing loop with the
device calls faked, the rows' bytes ratio and eligibility, the headline and target keys,
and the CPU smoke's JSON. CPU only, no timing assertions."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import sm_contention as smc  # noqa: E402

MB = smc.MB
WL = int(220e6)


# ------------------------------------------------------------------- arithmetic
def test_pacing_period_and_gap():
    # 110 MB per transfer at 72 GB/s: one transfer every 1.5278 ms
    assert smc.pacing_period_ms(110e6, 72.0) == pytest.approx(110 / 72)
    assert smc.pacing_gap_ms(110e6, 72.0, 0.6) == pytest.approx(110 / 72 - 0.6)
    # a transfer slower than the period: no gap (saturated)
    assert smc.pacing_gap_ms(110e6, 72.0, 2.0) == 0.0
    # no target rate (NCCL moved nothing): never issue
    assert math.isinf(smc.pacing_period_ms(1e6, 0.0))
    # the transfer count covers the window at the period, not at the transfer time
    assert smc.transfers_needed(25.0, 110 / 72) == 2 + math.ceil(1.5 * 25 * 72 / 110) + 1


def test_pace_step_sleeps_to_deadlines_without_bursts():
    assert smc.pace_step(10.0, 9.25, 2.0) == (0.75, 12.0)
    # slightly late: issue now, keep the schedule
    assert smc.pace_step(10.0, 10.5, 2.0) == (0.0, 12.0)
    # late by 3.5 periods: issue now, the next one may follow at once, then on schedule
    pause, nxt = smc.pace_step(10.0, 17.0, 2.0)
    assert (pause, nxt) == (0.0, 17.0)
    assert smc.pace_step(nxt, 17.25, 2.0) == (0.0, 19.0)
    # a schedule followed exactly issues at t0 + i x period
    deadline, issued, now = 0.0, [], 0.0
    for _ in range(5):
        pause, nd = smc.pace_step(deadline, now, 1.5)
        now += pause
        issued.append(now)
        deadline, now = nd, now + 0.4  # the transfer's issue time
    assert issued == pytest.approx([0.0, 1.5, 3.0, 4.5, 6.0])


def test_eligibility_rule():
    e = smc.eligible_for_best
    assert e("nccl", None) and e("nccl", 1.0)
    assert not e("copy_engine_paced", 0.49)
    assert e("copy_engine_paced", 0.5) and e("copy_engine_paced", 1.0)
    assert e("copy_engine_paced", 2.0) and not e("copy_engine_paced", 2.01)
    assert not e("copy_engine_paced", None)
    # saturated backends keep the >= 25% rule (a 4x extrapolation at most), no ceiling
    assert e("copy_engine", 2.3) and e("copy_engine", 0.25) and not e("copy_engine", 0.2)
    assert not e("copy_engine_paced", 0.3) and e("copy_engine", 0.3)


def test_parse_args_paced_flags():
    a = smc.parse_args(["--out", "x"])
    assert a.paced_backends == ["copy_engine"] and a.paced_dropped == []
    assert smc.parse_args(["--out", "x", "--no-paced"]).paced_backends == []
    a = smc.parse_args(["--out", "x", "--paced-backends", "copy_engine", "copy_engine_contiguous"])
    assert a.paced_backends == ["copy_engine", "copy_engine_contiguous"]
    a = smc.parse_args(["--out", "x", "--backends", "copy_engine", "host_staged"])
    assert a.paced_backends == [] and a.paced_dropped == ["copy_engine"]


# ------------------------------------------------------------- rows / headline
def _row(kernel, size, backend, slowdown, moved, alone=25.0):
    r = smc.make_row(kernel, size, backend, [alone], [alone * (1 + slowdown)], [moved], [1.0])
    if backend in smc.PACED_BACKENDS:
        r["paced_from"] = smc.paced_base(backend)
    return r


def _cells(paced_slow=0.015, paced_moved=1.8e9, attn_paced_moved=None):
    rows = []
    for k in ("gemm", "attention"):
        for size in (WL, 256 * MB):
            rows.append(_row(k, size, "nccl", 0.12, 2.0e9))
            rows.append(_row(k, size, "copy_engine", 0.05, 4.6e9))
            moved = attn_paced_moved if (k == "attention" and attn_paced_moved) else paced_moved
            rows.append(_row(k, size, "copy_engine_paced", paced_slow, moved))
    smc.normalise_cells(rows)
    return rows


def test_paced_rows_get_bytes_ratio_and_equal_bytes_slowdown():
    rows = _cells()
    p = next(r for r in rows if r["backend"] == "copy_engine_paced" and r["kernel"] == "gemm")
    assert p["bytes_ratio_to_nccl"] == pytest.approx(0.9)
    assert p["equal_bytes_factor"] == pytest.approx(2.0 / 1.8)
    assert p["slowdown_equal_bytes"] == pytest.approx(0.015 * 2.0 / 1.8)
    assert p["eligible_for_best"] is True
    ce = next(r for r in rows if r["backend"] == "copy_engine" and r["kernel"] == "gemm")
    assert ce["bytes_ratio_to_nccl"] == pytest.approx(2.3)
    assert ce["slowdown_equal_bytes"] == pytest.approx(0.05 / 2.3)
    nccl = next(r for r in rows if r["backend"] == "nccl")
    assert nccl["bytes_ratio_to_nccl"] == 1.0
    # a paced row that missed NCCL's rate by more than 2x is reported, not eligible
    bad = [r for r in _cells(paced_moved=4.4e9) if r["backend"] == "copy_engine_paced"]
    assert all(r["bytes_ratio_to_nccl"] == pytest.approx(2.2) for r in bad)
    assert not any(r["eligible_for_best"] for r in bad)


def test_headline_paced_keys_and_targets():
    rows = _cells()
    h = smc.headline(rows, [], WL)
    # unscaled, measured: GEMM at 256 MB and every kernel at the workload size
    assert h["slowdown_copy_engine_paced"] == pytest.approx(0.015)
    assert h["bytes_ratio_copy_engine_paced"] == pytest.approx(0.9)
    assert h["slowdown_copy_engine_paced_at_workload"] == {
        "attention": pytest.approx(0.015),
        "gemm": pytest.approx(0.015),
    }
    assert h["bytes_ratio_copy_engine_paced_at_workload"]["gemm"] == pytest.approx(0.9)
    assert h["best_paced_at_workload"]["gemm"]["backend"] == "copy_engine_paced"
    assert h["targets"][smc.PACED_TARGET] is True
    # existing keys unchanged (extrapolated copy engine still reported as before)
    assert h["slowdown_copy_engine"] == pytest.approx(0.05 / 2.3)
    assert h["slowdown_copy_engine_saturated"] == pytest.approx(0.05)
    assert "best_smfree_under_2pct_at_workload_size" in h["targets"]
    # the paced row is eligible, so it may be the best SM-free backend
    assert h["best_smfree_at_workload"]["gemm"]["backend"] == "copy_engine_paced"

    assert smc.headline(_cells(paced_slow=0.025), [], WL)["targets"][smc.PACED_TARGET] is False
    # attention's paced row moved 3x NCCL's bytes: not ~equal bytes -> not decided
    h = smc.headline(_cells(attn_paced_moved=6e9), [], WL)
    assert h["best_paced_at_workload"]["attention"] is None
    assert h["targets"][smc.PACED_TARGET] is None
    # ... but a measured miss on another kernel decides it
    h = smc.headline(_cells(paced_slow=0.03, attn_paced_moved=6e9), [], WL)
    assert h["targets"][smc.PACED_TARGET] is False
    # no paced rows at all: keys present, values None
    plain = [r for r in _cells() if r["backend"] != "copy_engine_paced"]
    h = smc.headline(plain, [], WL)
    assert h["slowdown_copy_engine_paced"] is None
    assert h["targets"][smc.PACED_TARGET] is None


def test_validate_result_requires_paced_keys():
    rows = _cells()
    result = {
        "figure": "sm_contention",
        "device": "none",
        "git_sha": None,
        "date": "d",
        "command": "c",
        "method": smc.METHOD,
        "rows": rows,
        "headline": smc.headline(rows, [], WL),
    }
    smc.validate_result(result)
    assert "pacing" in smc.METHOD and smc.PACED_TARGET in smc.METHOD["paced_target"]
    del result["headline"]["slowdown_copy_engine_paced_at_workload"]
    with pytest.raises(AssertionError, match="slowdown_copy_engine_paced_at_workload"):
        smc.validate_result(result)


# --------------------------------------------------- the cell with fake devices
class _FakeBench:
    """Bench.cell with the device calls replaced: NCCL moves 1e8 bytes every 2 ms
    (50 GB/s), the copy engine 1e8 bytes every 0.5 ms; paced transfers start every
    ``period_ms`` and last 0.5 ms. Windows are [2, 27] ms."""

    def __init__(self, backends, paced):
        self.a = SimpleNamespace(reps=3, backends=backends, paced_backends=paced)
        self.rank = 1  # no printing
        self.agreed: list[float] = []
        self.measured: list[tuple] = []

    window = lambda self, fn, reps: 25.0  # noqa: E731
    transfer_fn = lambda self, b, size: (b, 1e8)  # noqa: E731

    def agree_max(self, x):
        self.agreed.append(x)
        return float(x)

    def measure(self, call, n, kernel=None, reps=0, period_ms=0.0):
        self.measured.append((call, n, period_ms))
        if period_ms > 0:
            iv = [(i * period_ms, i * period_ms + 0.5) for i in range(n)]
        else:
            step = 2.0 if call == "nccl" else 0.5
            iv = [(i * step, (i + 1) * step) for i in range(n)]
        return {"intervals": iv, "window": (2.0, 27.0 + (0.4 if period_ms else 0.0))}


def test_cell_paces_copy_engine_to_nccl_rate():
    fb = _FakeBench(["copy_engine", "nccl"], ["copy_engine"])
    xfer = {("copy_engine", WL): 0.5, ("nccl", WL): 2.0}
    rows = smc.Bench.cell(fb, "gemm", None, 18, WL, xfer)
    assert [r["backend"] for r in rows] == ["nccl", "copy_engine", "copy_engine_paced"]
    # every rep: NCCL before the paced copy engine, which gets NCCL's period and count
    calls = [c for c, _, _ in fb.measured]
    assert calls == ["nccl", "copy_engine", "copy_engine"] * 3
    period = 1e8 / (50.0 * 1e6)  # 2 ms
    n = smc.transfers_needed(25.0, period)
    assert [(n_, p) for c, n_, p in fb.measured[2::3]] == [(n, pytest.approx(period))] * 3
    assert [(n_, p) for c, n_, p in fb.measured[:2]] == [
        (smc.transfers_needed(25.0, 2.0), 0.0),
        (smc.transfers_needed(25.0, 0.5), 0.0),
    ]
    # agreed on every rank: the window guess, then per rep the target rate and the count
    assert fb.agreed == [25.0] + [pytest.approx(50.0), n] * 3
    smc.normalise_cells(rows)
    p = rows[2]
    assert p["paced_from"] == "copy_engine"
    assert p["pacing_target_gbps"] == pytest.approx(50.0)
    assert p["pacing_period_ms"] == pytest.approx(2.0)
    assert p["pacing_gap_ms"] == pytest.approx(1.5)
    assert p["transfers_per_window"] == n
    # 13 paced transfers start inside [2, 27.4] (2, 4, ..., 26) vs NCCL's 12.5
    assert p["bytes_ratio_to_nccl"] == pytest.approx(13 / 12.5)
    assert p["slowdown"] == pytest.approx(0.4 / 25)
    assert p["eligible_for_best"] is True
    assert rows[1]["bytes_ratio_to_nccl"] == pytest.approx(4.0)


def test_cell_without_pacing_is_unchanged():
    fb = _FakeBench(["nccl", "copy_engine"], [])
    xfer = {("copy_engine", WL): 0.5, ("nccl", WL): 2.0}
    rows = smc.Bench.cell(fb, "gemm", None, 18, WL, xfer)
    assert [r["backend"] for r in rows] == ["nccl", "copy_engine"]
    assert fb.agreed == [25.0] and all(p == 0.0 for _, _, p in fb.measured)


# ------------------------------------------------------------------- the smoke
@pytest.mark.timeout(120)
def test_smoke_writes_paced_rows_and_keys(tmp_path):
    script = os.path.join(HERE, "..", "benchmarks", "sm_contention.py")
    cmd = [sys.executable, script, "--smoke", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=110)
    d = json.loads((tmp_path / "sm_contention.json").read_text())
    paced = [r for r in d["rows"] if r["backend"] == "copy_engine_paced"]
    assert len(paced) == len({(r["kernel"], r["size_bytes"]) for r in d["rows"]})
    assert all(0.5 <= r["bytes_ratio_to_nccl"] <= 2.0 for r in paced)
    assert all(r["slowdown_equal_bytes"] is not None for r in paced)
    h = d["headline"]
    assert h["slowdown_copy_engine_paced"] == pytest.approx(0.015)
    assert set(h["slowdown_copy_engine_paced_at_workload"]) == {"gemm", "attention"}
    assert h["bytes_ratio_copy_engine_paced"] == pytest.approx(0.97 * 1.015 / 1.11)
    assert h["targets"][smc.PACED_TARGET] is True
    assert "pacing" in d["method"] and d["config"]["paced_backends"] == ["copy_engine"]

    off = tmp_path / "off"
    subprocess.run(cmd[:-1] + [str(off), "--no-paced"], check=True, capture_output=True)
    d = json.loads((off / "sm_contention.json").read_text())
    assert not any(r["backend"].endswith("_paced") for r in d["rows"])
    assert d["headline"]["targets"][smc.PACED_TARGET] is None


# ------------------------------------------------------ paired alone windows
class _DriftBench(_FakeBench):
    """Like _FakeBench, but every alone window is 0.1 ms longer than the one before
    (a GPU slowing down over the cell), so a shared alone median and per-rep pairs
    disagree."""

    def __init__(self, backends, paced):
        super().__init__(backends, paced)
        self.a.paired_alone = True
        self.windows: list[float] = []

    def window(self, fn, reps):
        w = 20.0 + 0.1 * len(self.windows)
        self.windows.append(w)
        return w


def test_make_row_paired_alone():
    row = smc.make_row("gemm", WL, "nccl", [10.0], [11.0, 12.6], [1.0, 1.0], [1.0, 1.0],
                       paired_alone_ms=[10.0, 12.0])  # fmt: skip
    assert row["paired_alone"] is True
    assert row["slowdown"] == pytest.approx((0.1 + 0.05) / 2)
    assert row["kernel_alone_ms"] == pytest.approx(11.0)
    unpaired = smc.make_row("gemm", WL, "nccl", [10.0], [11.0, 12.6], [1.0, 1.0], [1.0, 1.0])
    assert unpaired["paired_alone"] is False
    assert unpaired["slowdown"] == pytest.approx((0.1 + 0.26) / 2)
    with pytest.raises(ValueError, match="one alone window per overlapped"):
        smc.make_row("gemm", WL, "nccl", [10.0], [11.0], [1.0], [1.0], paired_alone_ms=[1, 2])


def test_cell_paired_alone_times_one_alone_window_before_each_overlapped_one():
    fb = _DriftBench(["nccl", "copy_engine"], [])
    xfer = {("copy_engine", WL): 0.5, ("nccl", WL): 2.0}
    rows = smc.Bench.cell(fb, "gemm", None, 18, WL, xfer)
    assert [r["backend"] for r in rows] == ["nccl", "copy_engine", "null"]
    assert all(r["paired_alone"] for r in rows)
    # windows: the guess, then per rep: shared alone, null's pair (2), nccl's, copy engine's
    w = fb.windows
    assert len(w) == 1 + 3 * 5
    nccl_before = [w[1 + 5 * i + 3] for i in range(3)]
    assert rows[0]["kernel_alone_ms"] == pytest.approx(sorted(nccl_before)[1])
    assert rows[0]["slowdown"] == pytest.approx(sorted(25.0 / x - 1 for x in nccl_before)[1])
    null = rows[2]
    assert null["transfers_per_window"] == 0 and null["bytes_moved_during_kernel"] == 0
    # alone then alone again: 0.1 ms of drift over ~20 ms
    pairs = [(w[1 + 5 * i + 1], w[1 + 5 * i + 2]) for i in range(3)]
    assert null["slowdown"] == pytest.approx(sorted(o / a - 1 for a, o in pairs)[1])
    smc.normalise_cells(rows)
    assert null["eligible_for_best"] is False and null["slowdown_equal_bytes"] is None
    h = smc.headline(rows, [], WL)
    assert h["null_slowdown_at_workload"]["gemm"]["slowdown"] == pytest.approx(null["slowdown"])


@pytest.mark.timeout(120)
def test_smoke_paired_alone_writes_null_rows(tmp_path):
    script = os.path.join(HERE, "..", "benchmarks", "sm_contention.py")
    cmd = [sys.executable, script, "--smoke", "--out", str(tmp_path), "--paired-alone"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=110)
    d = json.loads((tmp_path / "sm_contention.json").read_text())
    nulls = [r for r in d["rows"] if r["backend"] == "null"]
    assert len(nulls) == len({(r["kernel"], r["size_bytes"]) for r in d["rows"]})
    assert all(r["paired_alone"] for r in d["rows"])
    assert set(d["headline"]["null_slowdown_at_workload"]) == {"gemm", "attention"}
    assert "paired_alone" in d["method"]


def test_headline_paced_minus_null():
    def row(b, slow, moved):
        over = [10.0 * (1 + slow)] * 3
        return smc.make_row("attention", WL, b, [10.0] * 3, over, [moved] * 3, [1.0] * 3,
                            paired_alone_ms=[10.0] * 3)  # fmt: skip

    rows = [row("nccl", 0.05, 1e9), row("copy_engine_paced", 0.03, 0.9e9), row("null", 0.01, 0)]
    smc.normalise_cells(rows)
    h = smc.headline(rows, [], WL)
    assert h["slowdown_copy_engine_paced_minus_null_at_workload"] == {
        "attention": pytest.approx(0.02)
    }
    assert h["null_slowdown_at_workload"]["attention"]["slowdown"] == pytest.approx(0.01)


# ------------------------------------------------------------ the workload size
def _e2e_report(summary_extra: dict, waits: dict) -> dict:
    summary = {
        "steps": 100,
        "world_size": 2,
        "overlap_backend": "copy_engine",
        "comm_bytes_by_backend": {"nccl": 9e9, "copy_engine": 100 * 2 * 28e6},
        "host_cpu": {"host_wait_all_threads": waits},
        **summary_extra,
    }
    return {"git_sha": "abc", "rows": [{"variant": "vanilla"}, {"variant": "freescale",
                                                              "summary": summary}]}  # fmt: skip


def test_workload_from_e2e_sizes_one_sm_free_collective(tmp_path):
    waits = {
        "MainThread|copy_engine:exclusive_embeddings": {"calls_per_step": 1.0},
        "MainThread|copy_engine:exclusive_grads": {"calls_per_step": 1.0},
        "MainThread|nccl:ids": {"calls_per_step": 1.0},  # another backend: not counted
    }
    wl = smc.workload_from_e2e(_e2e_report({}, waits))
    # 56 MB sent per step in 2 collectives; W = 2 keeps half: 56 MB of input per rank
    assert wl["collectives_per_step"] == 2.0
    assert wl["bytes_sent_per_collective"] == pytest.approx(28e6)
    assert wl["input_bytes_per_rank"] == pytest.approx(56e6)
    assert "host_wait" in wl["collectives_per_step_from"]
    # the trainer's per-collective counts win when the report has them: only the
    # backend's all-to-alls (an all-gather on it is not an all-to-all's size)
    by_op = {
        "copy_engine:all_to_all": {"bytes": 100 * 4 * 14e6, "calls": 400},
        "copy_engine:all_gather": {"bytes": 100 * 1e6, "calls": 100},
    }
    wl = smc.workload_from_e2e(_e2e_report({"comm_by_op": by_op}, waits))
    assert wl["collectives_per_step"] == 4.0
    assert wl["bytes_sent_per_collective"] == pytest.approx(14e6)
    assert wl["input_bytes_per_rank"] == pytest.approx(28e6)
    # the flag reads the file and puts the size among the cells
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(_e2e_report({}, waits)))
    a = smc.parse_args(["--out", str(tmp_path), "--workload-from", str(path)])
    assert a.workload_bytes == pytest.approx(56e6)
    assert a.workload["source"] == str(path)
    assert int(56e6) in smc.size_list(a)


def test_workload_from_e2e_errors_name_what_is_missing():
    with pytest.raises(ValueError, match="no 'freescale' row"):
        smc.workload_from_e2e({"rows": [{"variant": "vanilla"}]})
    report = _e2e_report({"comm_bytes_by_backend": {"nccl": 1}}, {})
    with pytest.raises(ValueError, match="sent nothing"):
        smc.workload_from_e2e(report)
    with pytest.raises(ValueError, match="no copy_engine collectives"):
        smc.workload_from_e2e(_e2e_report({}, {}))
    with pytest.raises(ValueError, match="no summary"):
        smc.workload_from_e2e({"rows": [{"variant": "freescale", "summary": None}]})
