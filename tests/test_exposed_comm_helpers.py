"""Pure helpers of benchmarks/exposed_comm.py (the GPU figure of issue 5)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import exposed_comm  # noqa: E402


def test_issue_skew_is_the_mean_spread_of_issue_times():
    issued = [
        {"grads": [1.000, 2.000], "ids": [0.5], "only_here": [3.0]},
        {"grads": [1.004, 1.998], "ids": [0.5]},
        {"grads": [1.001, 2.010], "ids": [0.501], "only_here": []},
    ]
    got = exposed_comm.issue_skew_ms(issued)
    # grads: spreads 4 ms and 12 ms -> 8 ms; ids: 1 ms; a name whose call counts differ
    # between ranks is left out
    assert got["grads"] == pytest.approx(8.0)
    assert got["ids"] == pytest.approx(1.0)
    assert "only_here" not in got
    assert exposed_comm.issue_skew_ms([]) == {}
    assert exposed_comm.issue_skew_ms([{"x": []}, {"x": []}]) == {}
