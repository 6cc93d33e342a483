"""GPU time accounting from a profiler trace: compute, communication, bubbles.

Owns :func:`gpu_accounting` (one rank's Chrome trace, as written by
``torch.profiler.profile.export_chrome_trace``, reduced to a few numbers per step) and
:func:`merge_ranks` (the per-rank dicts of a run reduced to means and maxima).

Definitions, over the profiled window (first GPU activity to last, on this rank's
device, every stream):

* *compute*: the union of the intervals in which some non-communication kernel or
  memset runs (on any stream);
* *communication*: the union of NCCL kernels and peer-to-peer copies (the copy-engine
  backend's transfers);
* *bubble*: window minus compute — the device computes nothing (it may be copying,
  communicating, or waiting for the host);
* *exposed communication*: communication minus compute — the part of the bubble during
  which a collective is in flight (the compute stream waits for it, or for a straggler
  inside it);
* *exposed by kind* (``exposed_by_kind_ms``): the same per collective kind
  (:func:`comm_kind`: all-reduce, all-to-all, all-gather, ..., peer copies), each kind's
  union minus compute — which collective the compute stream waits for;
* *other idle*: bubble minus exposed communication (host-bound gaps: launches, host
  syncs, data). Host-to-device and device-to-host copies count as neither compute nor
  communication;
* *launch load*: GPU operations and CUDA runtime / driver calls (all host threads) per
  step, the work whose tracing makes up the profiler's host cost.

Every quantity is reported in milliseconds per step (window totals divided by the
number of profiled steps). The accounting needs GPU activity; on a CPU run it returns
``{"available": False, "reason": ...}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["gpu_accounting", "merge_ranks", "union_length", "interval_union", "comm_kind"]

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
ACCOUNTING_KEYS = (
    "window_ms",
    "compute_ms",
    "comm_ms",
    "bubble_ms",
    "exposed_comm_ms",
    "other_idle_ms",
    "gpu_ops_per_step",
    "runtime_calls_per_step",
)


def interval_union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of ``(start, end)`` intervals (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length of a disjoint interval list."""
    return sum(e - s for s, e in intervals)


def _minus_length(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of ``a \\ b`` for two disjoint sorted interval lists."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            if cur >= e:
                break
            k += 1
        if cur < e:
            total += e - cur
    return total


def _is_comm(ev: dict[str, Any]) -> bool:
    name = str(ev.get("name", "")).lower()
    return "nccl" in name or (ev.get("cat") == "gpu_memcpy" and "ptop" in name)


# NCCL kernel name fragments -> collective kind (all_to_all_single runs SendRecv kernels)
_KINDS = (
    ("allreduce", "all_reduce"),
    ("alltoall", "all_to_all"),
    ("sendrecv", "all_to_all"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("broadcast", "broadcast"),
)


def comm_kind(ev: dict[str, Any]) -> str:
    """The collective kind of a communication event: ``all_reduce``, ``all_to_all``,
    ``all_gather``, ``reduce_scatter``, ``broadcast``, ``peer_copy`` (the copy-engine
    backend's transfers) or ``nccl_other``."""
    name = str(ev.get("name", "")).lower().replace("_", "")
    if ev.get("cat") == "gpu_memcpy":
        return "peer_copy"
    for frag, kind in _KINDS:
        if frag in name:
            return kind
    return "nccl_other"


def gpu_accounting(trace: str | dict[str, Any], steps: int) -> dict[str, Any]:
    """Compute / communication / bubble milliseconds per step from one rank's Chrome
    trace (a path or the loaded JSON). See the module docstring for the definitions."""
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    gpu = [
        ev
        for ev in events
        if ev.get("ph") == "X" and ev.get("cat") in _GPU_CATS and float(ev.get("dur", 0)) > 0
    ]
    if not gpu:
        return {"available": False, "reason": "no GPU activity in the trace (CPU run?)"}
    compute, comm = [], []
    by_kind: dict[str, list[tuple[float, float]]] = {}
    for ev in gpu:
        s = float(ev["ts"])
        iv = (s, s + float(ev["dur"]))
        if _is_comm(ev):
            comm.append(iv)
            by_kind.setdefault(comm_kind(ev), []).append(iv)
        elif ev.get("cat") != "gpu_memcpy":
            compute.append(iv)
    start = min(float(ev["ts"]) for ev in gpu)
    end = max(float(ev["ts"]) + float(ev["dur"]) for ev in gpu)
    cu, co = interval_union(compute), interval_union(comm)
    window = end - start
    busy = union_length(cu)
    exposed = _minus_length(co, cu)
    n = max(int(steps), 1)
    us_to_ms = 1e-3 / n
    return {
        "available": True,
        "steps": n,
        "window_ms": window * us_to_ms,
        "compute_ms": busy * us_to_ms,
        "comm_ms": union_length(co) * us_to_ms,
        "bubble_ms": (window - busy) * us_to_ms,
        "exposed_comm_ms": exposed * us_to_ms,
        "other_idle_ms": (window - busy - exposed) * us_to_ms,
        "kernels": len(gpu),
        "comm_kernels": len(comm),
        # launch load: GPU operations (kernels, copies, memsets) and CUDA runtime /
        # driver calls (every host thread) per step; the profiler's host cost grows
        # with the calls (benchmarks/cupti_overhead.py)
        "gpu_ops_per_step": len(gpu) / n,
        "runtime_calls_per_step": sum(
            1 for ev in events if ev.get("cat") in ("cuda_runtime", "cuda_driver")
        )
        / n,
        # exposed communication per collective kind (each kind's union minus compute;
        # kinds in flight at the same time each count, so the sum can exceed the total)
        "exposed_by_kind_ms": {
            k: _minus_length(interval_union(v), cu) * us_to_ms for k, v in sorted(by_kind.items())
        },
    }


def merge_ranks(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Mean and max over ranks of every accounting key (only ranks with data)."""
    ok = [r for r in per_rank if r.get("available")]
    if not ok:
        reason = per_rank[0].get("reason", "no data") if per_rank else "no ranks"
        return {"available": False, "reason": reason}
    out: dict[str, Any] = {"available": True, "ranks": len(ok)}
    for k in ACCOUNTING_KEYS:
        vals = [float(r[k]) for r in ok]
        out[k] = sum(vals) / len(vals)
        out[f"{k}_max"] = max(vals)
    w = out["window_ms"]
    out["bubble_share"] = out["bubble_ms"] / w if w > 0 else math.nan
    out["exposed_comm_share"] = out["exposed_comm_ms"] / w if w > 0 else math.nan
    return out
