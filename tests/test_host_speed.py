"""metrics/host_speed.py: the host calibration's keys and types (timings only > 0), its
never-raise contract, and the e2e report's "Host speed" line with and without the key
(reports written before it, or merged from them, still render)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from freescale.metrics import host_speed
from freescale.metrics.host_speed import format_host_calibration, host_calibration
from freescale.pipeline.bench_e2e import _markdown, write_report

KEYS = {
    "cpu_model",
    "cpu_mhz_mean",
    "python_loop_ms",
    "torch_ops_ms",
    "python_loop_iters",
    "torch_ops_elements",
    "repeats",
}
STORED = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "e2e.json"


def test_calibration_keys_types_and_threads_restored():
    before = torch.get_num_threads()
    cal = host_calibration()
    assert torch.get_num_threads() == before
    assert KEYS <= set(cal) and "errors" not in cal, cal
    for key in ("python_loop_ms", "torch_ops_ms"):
        assert isinstance(cal[key], float) and math.isfinite(cal[key]) and cal[key] > 0, cal
    assert cal["cpu_model"] is None or (isinstance(cal["cpu_model"], str) and cal["cpu_model"])
    assert cal["cpu_mhz_mean"] is None or cal["cpu_mhz_mean"] > 0
    if os.path.exists("/proc/cpuinfo"):
        assert cal["cpu_model"] is not None or cal["cpu_mhz_mean"] is not None
    json.dumps(cal)  # goes into e2e.json as is


def test_cpuinfo_parsing(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(
        "processor\t: 0\nmodel name\t: Test CPU @ 2.00GHz\ncpu MHz\t\t: 2000.000\n\n"
        "processor\t: 1\nmodel name\t: Test CPU @ 2.00GHz\ncpu MHz\t\t: 3000.000\n"
    )
    assert host_speed._cpuinfo(str(f)) == ("Test CPU @ 2.00GHz", 2500.0)
    f.write_text("processor\t: 0\nHardware\t: some board\n")  # e.g. an ARM board
    assert host_speed._cpuinfo(str(f)) == (None, None)
    assert host_speed._cpuinfo(str(tmp_path / "missing")) == (None, None)


def test_calibration_never_raises(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("no torch here")

    monkeypatch.setattr(host_speed, "_cpuinfo", boom)
    monkeypatch.setattr(host_speed, "_time_torch_ops", boom)
    cal = host_calibration()
    assert cal["cpu_model"] is None and cal["cpu_mhz_mean"] is None
    assert cal["torch_ops_ms"] is None and cal["python_loop_ms"] > 0
    assert set(cal["errors"]) == {"cpuinfo", "torch_ops_ms"}
    line = format_host_calibration(cal)
    assert "CPU model unknown, n/a MHz" in line and "torch ops n/a" in line


def test_format_line():
    cal = {
        "cpu_model": "Intel(R) Xeon(R) Platinum 8480C",
        "cpu_mhz_mean": 2000.4,
        "python_loop_ms": 4.25,
        "torch_ops_ms": 18.5,
    }
    assert format_host_calibration(cal) == (
        "Host speed (rank 0): Intel(R) Xeon(R) Platinum 8480C, 2000 MHz, python loop "
        "4.25 ms, torch ops 18.50 ms (lower is faster; compare across reports)."
    )
    assert format_host_calibration(None) is None and format_host_calibration({}) is None


@pytest.mark.skipif(not STORED.exists(), reason="no stored e2e report")
def test_report_renders_with_and_without_the_key(tmp_path):
    old = json.loads(STORED.read_text())
    old.pop("host_calibration", None)  # a report from before the calibration
    md = _markdown(old)
    assert "Host speed (rank 0)" not in md and "Host (rank 0)" in md
    # the same rows written again (as --merge does), without and with a calibration
    result = {k: old.get(k) for k in ("rows", "repeat_rows", "config", "device", "world_size")}
    report = write_report(result, str(tmp_path / "without"), command="pytest")
    assert report["host_calibration"] is None
    assert "Host speed" not in (tmp_path / "without" / "e2e.md").read_text()
    cal = host_calibration()
    report = write_report(
        {**result, "host_calibration": cal}, str(tmp_path / "with"), command="pytest"
    )
    on_disk = json.loads((tmp_path / "with" / "e2e.json").read_text())
    assert on_disk["host_calibration"] == report["host_calibration"]
    assert on_disk["host_calibration"]["python_loop_ms"] > 0
    md = (tmp_path / "with" / "e2e.md").read_text().splitlines()
    speed = [i for i, ln in enumerate(md) if ln.startswith("Host speed (rank 0): ")]
    host = [i for i, ln in enumerate(md) if ln.startswith("Host (rank 0): ")]
    assert len(speed) == 1 and len(host) == 1 and speed[0] == host[0] + 2, md
    assert md[speed[0]] == format_host_calibration(cal)
