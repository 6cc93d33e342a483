"""Compiles inside a measured window.

Owns :class:`CompileWatch`. It counts, between :meth:`~CompileWatch.start` and
:meth:`~CompileWatch.stop`, the Triton JIT compiles of every host thread (Triton's
``knobs.runtime`` compile hooks, chained to any hook already set) and the graphs
``torch.compile`` (Dynamo) compiled.

A kernel variant first used inside the profiled window stalls the host for its whole
compile, seconds for some kernels. The GPU accounting counts that stall as bubble. In
session 25 the last step of a prioritized run was the first to use a variant of the
fused Adagrad kernel, and the 1-GPU report's freescale bubble read 236 ms per step
instead of 1.3. The trainer records these counts next to the window's GPU accounting,
so each report says whether its window was free of compiles.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["CompileWatch", "COMPILE_KEYS"]

# per rank, totals over the window (not per step): Triton JIT compiles, their seconds,
# torch.compile graphs
COMPILE_KEYS = ("jit_compiles_in_window", "jit_compile_s_in_window", "dynamo_graphs_in_window")


def _dynamo_graphs() -> int | None:
    """Graphs Dynamo compiled in this process so far (None where it cannot say)."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled yet: import nothing
        return 0
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - private counters: report unknown, never fail
        return None


class CompileWatch:
    """Counts compiles between :meth:`start` and :meth:`stop` (once each; not
    reentrant). ``triton``: watch Triton's JIT too (on GPU runs; a CPU run's kernels
    run in the interpreter, which compiles nothing). ``on_compile``: also called after
    each Triton compile, in the compiling thread, with the compile's seconds and Triton's
    hook arguments (``key``, ``repr``, ``fn``, ...), e.g. to log it
    (``benchmarks/host_time/sitecustomize.py``)."""

    def __init__(self, triton: bool = True, on_compile: Callable[..., None] | None = None) -> None:
        self._triton = triton
        self._on_compile = on_compile
        self._lock = threading.Lock()
        self._started: dict[tuple[int, str], float] = {}
        self._count = 0
        self._seconds = 0.0
        self._kernels: dict[str, int] = {}
        self._prev: tuple[Any, Any] | None = None
        self._graphs0: int | None = None
        self._knobs: Any = None

    def start(self) -> None:
        self._graphs0 = _dynamo_graphs()
        if not self._triton:
            return
        try:
            import triton
        except ImportError:  # no Triton: nothing of it can compile
            return
        knobs = triton.knobs.runtime
        prev_before, prev_after = knobs.jit_cache_hook, knobs.jit_post_compile_hook

        def before(**kw: Any) -> Any:
            skip = prev_before(**kw) if prev_before is not None else None
            if not skip:  # a previous hook may skip the compile (then no "after")
                with self._lock:
                    self._started[(threading.get_ident(), str(kw["key"]))] = time.perf_counter()
            return skip

        def after(**kw: Any) -> Any:
            now = time.perf_counter()
            with self._lock:
                t0 = self._started.pop((threading.get_ident(), str(kw["key"])), now)
                self._count += 1
                self._seconds += now - t0
                name = getattr(kw.get("fn"), "name", "?")
                self._kernels[name] = self._kernels.get(name, 0) + 1
            if self._on_compile is not None:
                self._on_compile(now - t0, **kw)
            return prev_after(**kw) if prev_after is not None else None

        self._knobs, self._prev = knobs, (prev_before, prev_after)
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = before, after

    def stop(self) -> dict[str, Any]:
        """Restore the hooks; the counts (``COMPILE_KEYS``, ``jit_kernels``: compiles
        per kernel name)."""
        if self._knobs is not None and self._prev is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._prev
            self._knobs = self._prev = None
        g1 = _dynamo_graphs()
        graphs = None if g1 is None or self._graphs0 is None else g1 - self._graphs0
        with self._lock:
            return {
                "jit_compiles_in_window": self._count,
                "jit_compile_s_in_window": self._seconds,
                "dynamo_graphs_in_window": graphs,
                "jit_kernels": dict(sorted(self._kernels.items())),
            }
