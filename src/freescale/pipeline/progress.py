"""Progress output of a training run on rank 0.

Owns `make_progress`: a tqdm bar where the output is a terminal, and `LineProgress`
elsewhere (a pipe, a file, a cluster job's log), which prints one plain line every
``total / lines`` steps and at the last one instead of tqdm's carriage-return redraws
(up to ten a second: hundreds of ``\\r`` fragments per minute in a log file). Both take
the same four calls from the trainer: ``update(n)``, ``set_postfix(**values)``,
``write(msg)`` and ``close()``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


class LineProgress:
    """Plain progress lines, ``desc: step k/N (p%), r it/s, key=value``: one every
    ``max(1, total // lines)`` steps and one at the last step (``lines`` bounds the count
    for any run length). `write` prints a message on a line of its own at once."""

    def __init__(self, total: int, desc: str = "train", file: TextIO | None = None,
                 lines: int = 20) -> None:  # fmt: skip
        if lines < 1:
            raise ValueError(f"lines must be >= 1, got {lines}")
        self.total = max(0, int(total))
        self.desc = desc
        self.file = file
        self.every = max(1, self.total // lines)
        self.n = 0
        self.postfix: dict[str, Any] = {}
        self._t0 = time.perf_counter()

    def _out(self) -> TextIO:
        return self.file if self.file is not None else sys.stdout

    def set_postfix(self, **values: Any) -> None:
        self.postfix = dict(values)

    def update(self, n: int = 1) -> None:
        before, self.n = self.n, self.n + n
        if self.n // self.every > before // self.every or (self.n >= self.total > before):
            self._line()

    def _line(self) -> None:
        elapsed = time.perf_counter() - self._t0
        rate = self.n / elapsed if elapsed > 0 else float("nan")
        pct = 100.0 * self.n / self.total if self.total else 100.0
        extra = "".join(f", {k}={v}" for k, v in self.postfix.items())
        print(f"{self.desc}: step {self.n}/{self.total} ({pct:.0f}%), {rate:.2f} it/s{extra}",
              file=self._out(), flush=True)  # fmt: skip

    def write(self, msg: str) -> None:
        print(msg, file=self._out(), flush=True)

    def close(self) -> None:
        """Nothing to release (tqdm's bar restores the terminal line here)."""


def make_progress(total: int, desc: str = "train", file: TextIO | None = None) -> Any:
    """The progress reporter for `total` steps on `file` (default stdout): tqdm when the
    file is a terminal and tqdm imports, `LineProgress` otherwise."""
    out = file if file is not None else sys.stdout
    isatty = getattr(out, "isatty", None)
    if callable(isatty) and isatty():
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover - tqdm is a dependency
            pass
        else:
            return tqdm(total=total, desc=desc, file=out, dynamic_ncols=True)
    return LineProgress(total, desc, file=out)
