"""How fast this host's CPU runs single-threaded work, so reports from different hosts
compare.

Owns :func:`host_calibration`: the CPU model and current clock from ``/proc/cpuinfo``
(Linux; ``None`` elsewhere) and two fixed workloads timed on the calling thread, the
median of a few repetitions each: a pure-Python loop (the interpreter's speed: what
bounds the launch threads of a host-bound step) and a single-threaded torch CPU op
sequence like the data stage's (``index_select`` + ``cumsum`` + ``cat`` over about a
million int64 elements, under ``torch.set_num_threads(1)``, restored afterwards).

Why: two hosts of the same machine kind (same CPU model, same core counts) can run the
same code 25-35% slower or faster per step on a given day (clock, neighbours, firmware),
and a host-bound mode's QPS moves with them; the topology (core counts) says nothing
about that. The timings are in milliseconds, lower is faster; they mean something only
next to the same numbers from another report (same workload sizes, recorded with them).
Cost: well under half a second. Never raises: what could not be measured is ``None``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["host_calibration", "format_host_calibration"]

_CPUINFO = "/proc/cpuinfo"
PY_LOOP_ITERS = 200_000  # pure-Python loop: iterations per repetition
TORCH_ELEMENTS = 1 << 20  # torch op sequence: int64 elements
REPEATS = 5  # timed repetitions per workload (the median is reported)


def _cpuinfo(path: str = _CPUINFO) -> tuple[str | None, float | None]:
    """(first 'model name', mean of 'cpu MHz' over the CPUs listed); None where absent."""
    model: str | None = None
    mhz: list[float] = []
    try:
        with open(path) as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if not sep:
                    continue
                key, value = key.strip(), value.strip()
                if key == "model name" and model is None and value:
                    model = value
                elif key == "cpu MHz":
                    try:
                        mhz.append(float(value))
                    except ValueError:
                        pass
    except OSError:
        return None, None
    return model, (statistics.fmean(mhz) if mhz else None)


def _python_loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def _time_python_loop(n: int = PY_LOOP_ITERS, repeats: int = REPEATS) -> float:
    """Median wall ms of a pure-Python summing loop of ``n`` iterations."""
    _python_loop(n // 10)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _python_loop(n)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_torch_ops(n: int = TORCH_ELEMENTS, repeats: int = REPEATS) -> float:
    """Median wall ms of ``index_select`` + ``cumsum`` + ``cat`` over ``n`` int64
    elements on one intra-op thread (the previous thread count is restored)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        values = torch.arange(n, dtype=torch.int64)
        index = torch.randint(0, n, (n,), generator=gen, dtype=torch.int64)
        lengths = torch.randint(0, 8, (n,), generator=gen, dtype=torch.int64)

        def once() -> int:
            picked = torch.index_select(values, 0, index)
            offsets = torch.cumsum(lengths, 0)
            out = torch.cat([picked, offsets])
            return int(out.numel())

        once()  # warm-up (allocator, first-call dispatch)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def host_calibration() -> dict[str, Any]:
    """CPU model, mean current MHz and two timed fixed workloads on the calling thread
    (ms, median of :data:`REPEATS`; lower is faster). Keys: ``cpu_model``,
    ``cpu_mhz_mean``, ``python_loop_ms``, ``torch_ops_ms``, and the workload sizes
    ``python_loop_iters``, ``torch_ops_elements``, ``repeats``. Never raises; a value
    that could not be measured is ``None`` (and the reason is under ``errors``)."""
    out: dict[str, Any] = {
        "cpu_model": None,
        "cpu_mhz_mean": None,
        "python_loop_ms": None,
        "torch_ops_ms": None,
        "python_loop_iters": PY_LOOP_ITERS,
        "torch_ops_elements": TORCH_ELEMENTS,
        "repeats": REPEATS,
    }
    errors: dict[str, str] = {}
    try:
        out["cpu_model"], out["cpu_mhz_mean"] = _cpuinfo()
    except Exception as e:  # noqa: BLE001 - a calibration must never fail the caller
        errors["cpuinfo"] = repr(e)
    for key, fn in (("python_loop_ms", _time_python_loop), ("torch_ops_ms", _time_torch_ops)):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001
            errors[key] = repr(e)
    if errors:
        out["errors"] = errors
    return out


def format_host_calibration(cal: dict[str, Any] | None) -> str | None:
    """The report's one line for a :func:`host_calibration` dict; None without one."""
    if not cal:
        return None

    def ms(key: str) -> str:
        v = cal.get(key)
        return "n/a" if v is None else f"{v:.2f} ms"

    mhz = cal.get("cpu_mhz_mean")
    return (
        f"Host speed (rank 0): {cal.get('cpu_model') or 'CPU model unknown'}, "
        f"{'n/a' if mhz is None else f'{mhz:.0f}'} MHz, python loop {ms('python_loop_ms')}, "
        f"torch ops {ms('torch_ops_ms')} (lower is faster; compare across reports)."
    )
