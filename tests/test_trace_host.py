"""benchmarks/trace_host.py on a small synthetic Chrome trace: gaps, nesting, blocking."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trace_host  # noqa: E402


def _x(name, cat, ts, dur, tid=1, pid=7):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "pid": pid}


def test_gaps_and_stacks():
    assert trace_host.gaps([(0, 10), (5, 12), (20, 30), (29, 31)]) == [(12, 20)]
    outer = _x("a", "python_function", 0, 100)
    inner = _x("b", "python_function", 10, 20)
    got = trace_host.stacks_at([inner, outer], [5, 15, 50, 150])
    assert [[e["name"] for e in st] for st in got] == [["a"], ["a", "b"], ["a"], []]


def test_report_charges_gaps_and_blocking(tmp_path, capsys):
    ev = [
        _x("freescale/forward", "user_annotation", 0, 50),
        _x("src/freescale/x.py(1): step", "python_function", 0, 2000),
        _x("src/freescale/y.py(9): slow_host", "python_function", 1000, 1000),
        _x("aten::foo", "cpu_op", 1000, 900),
        _x("cudaStreamSynchronize", "cuda_runtime", 1100, 300),
        _x("kernel", "kernel", 0, 1000, tid=3, pid=0),
        _x("kernel", "kernel", 2000, 100, tid=3, pid=0),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    trace_host.main([str(path), "--steps", "1"])
    out = capsys.readouterr().out
    assert "GPU gaps: 1 totalling 1.00 ms/step" in out
    assert "1.00 ms/step  src/freescale/y.py(9): slow_host < src/freescale/x.py(1): step" in out
    assert "main: busy 0.90, blocked 0.30, work 0.60" in out
    assert "cudaStreamSynchronize @ src/freescale/y.py(9): slow_host" in out
