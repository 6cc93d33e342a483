"""Progress output: plain lines outside a terminal (a job's log gets no tqdm redraws),
tqdm on a terminal, and what a 2-rank run prints on rank 0."""

from __future__ import annotations

import contextlib
import dataclasses
import io

import pytest
from tests.test_trainer import tiny_config

from freescale.pipeline.progress import LineProgress, make_progress
from freescale.pipeline.trainer import Trainer


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_line_progress_prints_a_bounded_number_of_plain_lines() -> None:
    out = io.StringIO()
    p = LineProgress(100, "train", file=out, lines=20)
    for i in range(100):
        if i == 50:
            p.set_postfix(logloss="0.4611")
            p.write("step 50: eval NE 0.7663")
        p.update(1)
    p.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert len(lines) == 21, lines  # every 5 steps, plus the message
    assert lines[0].startswith("train: step 5/100 (5%), ")
    assert "step 50: eval NE 0.7663" in lines
    assert lines[-1].startswith("train: step 100/100 (100%), ")
    assert lines[-1].endswith("it/s, logloss=0.4611")


@pytest.mark.parametrize("total,lines,expect", [(7, 20, 7), (41, 20, 21), (3, 1, 1), (0, 5, 0)])
def test_line_progress_prints_every_k_steps_and_at_the_last(total, lines, expect) -> None:
    """One line every total // lines steps (at least every step) and one at the last
    step when it is not a multiple: at most lines + 1 lines for any run length."""
    out = io.StringIO()
    p = LineProgress(total, file=out, lines=lines)
    for _ in range(total):
        p.update(1)
    got = out.getvalue().splitlines()
    assert len(got) == expect, got
    if total:
        assert got[-1].startswith(f"train: step {total}/{total} (100%)")


def test_line_progress_rejects_zero_lines() -> None:
    with pytest.raises(ValueError, match="lines must be >= 1"):
        LineProgress(10, lines=0)


def test_make_progress_picks_tqdm_only_on_a_terminal() -> None:
    tqdm = pytest.importorskip("tqdm")
    assert isinstance(make_progress(10, file=io.StringIO()), LineProgress)
    bar = make_progress(10, file=_Terminal())
    assert isinstance(bar, tqdm.tqdm)
    bar.close()


def _run_with_progress(rank, world, cfg):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        Trainer(cfg).train()
    return buf.getvalue()


def test_training_output_in_a_log_is_plain_lines(pool2) -> None:
    """``progress=True`` with stdout redirected to a file-like object (not a terminal):
    rank 0 prints step lines and the eval line, no carriage returns; rank 1 prints
    nothing."""
    cfg = dataclasses.replace(tiny_config(steps=4), progress=True, eval_every=2)
    out0, out1 = pool2.run(_run_with_progress, cfg)
    assert "\r" not in out0
    assert "train: step 4/4 (100%)" in out0
    assert "step 2: eval NE" in out0
    assert out1 == ""
