"""Common header of a figure file: ``benchmarks/results/<figure>.json`` says what produced
it (figure, device, git sha, date, exact command, torch version)."""

from __future__ import annotations

import datetime as dt
import sys
from typing import Any, Optional

import torch


def figure_header(figure: str, git_sha: Optional[str]) -> dict[str, Any]:
    """The keys every figure file starts with; rows and headline are the caller's."""
    return {
        "figure": figure,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "git_sha": git_sha,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "torch": torch.__version__,
    }
