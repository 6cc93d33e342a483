"""Figure "sm_contention": how much a transfer on a second stream slows a dense kernel.

Launch (2 GPUs of one node, about 2-3 minutes)::

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/sm_contention.py \\
        --out DIR --git-sha SHA

The method of the canonical figure (session 15; about 4 minutes, bias measured at
0.05%) adds ``--reps 15 --no-probe --paired-alone --cooldown-ms 100``.

CPU smoke check (argument parsing, the accounting, JSON and plot writing on synthetic
timings; no torch.distributed, no CUDA)::

    python benchmarks/sm_contention.py --out DIR --smoke

Kernels: a bf16 8192^3 GEMM (``torch.mm``) and the model's attention (compiled flex
attention with the document-causal block mask of ``freescale.models.sequence``, on a
jagged batch of ~200K tokens, bf16, H=4, dh=32, forward + backward). Transfers: an
all-to-all of SIZE bytes per rank (fp32 rows of 128, equal splits) through
* ``nccl``: the plain Communicator on a dedicated NCCL group (kernels on SMs);
* ``copy_engine``: CopyEngineCommunicator.all_to_all_v_segments (zero-copy: only
  copy-engine peer copies run);
* ``copy_engine_contiguous``: CopyEngineCommunicator.all_to_all_v (adds the two local
  copies into a fresh output, which CUDA runs on SMs);
* ``host_staged``: HostStagedCommunicator (device->pinned host->gloo->device);
* ``copy_engine_paced`` (pseudo-backend, on by default, ``--paced-backends``): the
  ``copy_engine`` call, paced down to NCCL's byte rate (method, step 4).

Method (also written into the JSON under "method"):
1. Bandwidth alone: back-to-back transfers, no kernel; per-transfer GPU time.
2. Kernel alone: a window of R back-to-back kernels (R so the window is ~--window-ms),
   CUDA events; alone and overlapped windows are interleaved, rep by rep.
3. Overlapped: a thread on this rank issues N back-to-back transfers (N identical on all
   ranks, sized to cover the window), each bracketed by CUDA events on its own stream;
   the window starts once two transfers are issued. Bytes moved during the kernel =
   sum over transfers of (bytes sent to peers) x (fraction of the transfer's GPU
   interval inside the window); coverage = fraction of the window with a transfer in
   flight.
4. Equal bytes: slowdown = window / alone - 1 is measured with each backend saturated;
   backends move different bytes in the same window, so each slowdown is scaled to the
   bytes NCCL moved in that window: slowdown_equal_bytes = slowdown x B_nccl / B_backend
   (interference taken as proportional to bytes moved during the kernel). The "best
   SM-free" backend is chosen among those that moved at least 25% of NCCL's bytes (at
   most a 4x extrapolation); the others are reported but not eligible.
   Pacing measures the equal-bytes slowdown instead of extrapolating it: the copy
   engine saturated moves ~2.3x NCCL's bytes in the window, and interference need not
   be linear in bytes. ``copy_engine_paced`` issues the same copy-engine call, but the
   transfer thread sleeps on the host between transfers (no GPU sleep kernel: it would
   occupy SMs) so that its byte rate matches NCCL's in the same cell and rep: NCCL runs
   first in every rep; target rate = bytes NCCL moved during that rep's window /
   window ms (max over ranks); period = bytes sent per transfer / target rate (capped at
   the window); transfer i is issued at t0 + i x period on the host clock, i.e. after a
   gap = period - the transfer's issue time (nominal gap = max(period - copy-engine
   transfer time alone, 0), recorded); the deadlines absorb sleep overshoot, and a late
   transfer lets at most one more follow back-to-back. The number of transfers covers
   the window at that period; period and count are identical on all ranks. Its rows
   carry bytes_ratio_to_nccl (~1: its slowdown_equal_bytes is a near-unit rescale of
   the measured slowdown); it is eligible as "best SM-free" only with a bytes ratio
   within [0.5, 2]. The headline reports it unscaled (slowdown_copy_engine_paced*)
   and a target "under 2% at the workload size" from the measured paced slowdown.
   Cost: one more overlapped window per rep and cell (about +10-20% run time); off
   with --no-paced.
   --paired-alone: every overlapped window is preceded by its own alone window and each
   rep's slowdown is taken against it (drift within a rep — clocks, temperature after
   NCCL's windows — cancels); a "null" row times an alone window as if it were
   overlapped (alone, then alone again): the method's own bias, reported as
   null_slowdown_at_workload. Session 15 saw saturated slowdowns of -3% (host-staged,
   GEMM) without it: a bias of that size, not a speed-up. With it, the null row showed
   +6% for the GEMM (an alone window right after another one: the bf16 GEMM holds the
   H200 at its power limit) and ~0 for attention; --cooldown-ms idles the GPU before
   every timed window so each starts from the same power state.
5. A probe (separate torchrun job, --no-probe to skip) tries NCCL 2.28's zero-CTA
   copy-engine collectives: ProcessGroupNCCL CTA policy ZERO + symmetric memory on
   the NCCL backend, equal-count all_to_all_single and all_gather_into_tensor; checks
   correctness, whether any NCCL kernel ran (profiler), and the GEMM slowdown.

Writes DIR/sm_contention.json (figure, device, git_sha, date, command, method, rows,
bandwidth_alone, headline, nccl_ce_probe) and DIR/sm_contention.png (if matplotlib).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1 are set here and checked).
"""

from __future__ import annotations

import os

_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _k, _v in _SAFE_ENV.items():  # before torch / NCCL read them
    if os.environ.setdefault(_k, _v) != _v:
        raise SystemExit(f"refusing to run: {_k}={os.environ[_k]} would allow NVLink multicast")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

try:
    import freescale  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from _figure import git_sha  # noqa: E402

BACKENDS = ["nccl", "copy_engine", "copy_engine_contiguous", "host_staged"]
SMFREE = ["copy_engine", "copy_engine_contiguous", "host_staged"]
# backends that can be paced down to NCCL's byte rate (host_staged moves ~2 GB/s: it
# cannot reach NCCL's rate, so there is nothing to pace); a paced row's backend is
# paced_name(base)
PACEABLE = ["copy_engine", "copy_engine_contiguous"]
PACED_SUFFIX = "_paced"
PACED_BACKENDS = [b + PACED_SUFFIX for b in PACEABLE]
PACED_RATIO_RANGE = (0.5, 2.0)  # bytes / NCCL's bytes for a paced row to be "best"
PACED_TARGET = "best_smfree_under_2pct_at_workload_size_measured_paced"
KERNELS = ["gemm", "attention"]
MB = 1 << 20
ELIGIBLE_MIN_BYTES_FRACTION = 0.25
NOISE_FLOOR = 0.005  # NCCL slowdowns below this are too small to form a ratio


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[16, 64, 256])
    p.add_argument(
        "--workload-bytes",
        type=float,
        default=220e6,
        help="the workload size: all-to-all input bytes per rank at which the 'under 2%%' "
        "targets are read; added to the sizes (default: 220e6, an a-priori estimate of a "
        "step's embedding bytes; --workload-from measures it instead)",
    )
    p.add_argument(
        "--workload-from",
        default=None,
        metavar="E2E_JSON",
        help="take the workload size from an e2e report (freescale bench e2e): the mean "
        "all-to-all input per rank of one collective on the SM-free backend in its "
        "'freescale' row (workload_from_e2e); replaces --workload-bytes",
    )
    p.add_argument("--kernels", nargs="+", default=KERNELS, choices=KERNELS)
    p.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    p.add_argument(
        "--paced-backends",
        nargs="+",
        default=["copy_engine"],
        choices=PACEABLE,
        help="also measure these backends paced to NCCL's byte rate in the same cell "
        "(rows '<backend>_paced'; needs nccl and the backend in --backends, else dropped)",
    )
    p.add_argument("--no-paced", action="store_true", help="no paced rows")
    p.add_argument(
        "--cooldown-ms",
        type=float,
        default=0.0,
        help="idle the GPU this long before every timed window (synchronize, then sleep on "
        "the host), so each window starts from the same power state: a sustained bf16 GEMM "
        "runs the H200 at its power limit and a window right after another one is slower",
    )
    p.add_argument(
        "--paired-alone",
        action="store_true",
        help="time an alone window right before every overlapped window and take each "
        "rep's slowdown against its own alone window (cancels drift within a rep: clocks, "
        "temperature), plus a 'null' row: an alone window timed as if overlapped, the "
        "method's own bias",
    )
    p.add_argument("--reps", type=int, default=5, help="interleaved windows per cell")
    p.add_argument("--window-ms", type=float, default=25.0)
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--attn-tokens", type=int, default=200_000)
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--attn-dim", type=int, default=32)
    p.add_argument("--attn-mean-len", type=int, default=2048)
    p.add_argument("--ce-streams", type=int, default=1, help="copy-engine side streams")
    p.add_argument(
        "--ce-completion",
        choices=["auto", "host", "device"],
        default="auto",
        help="copy-engine completion (CopyEngineConfig.completion; auto follows "
        "FREESCALE_COPY_ENGINE_COMPLETION, else host)",
    )
    p.add_argument(
        "--time-budget-s", type=float, default=140.0, help="measurement cells start only before it"
    )
    p.add_argument("--no-probe", action="store_true", help="skip the NCCL zero-CTA probe")
    p.add_argument("--probe-timeout-s", type=float, default=90.0)
    p.add_argument("--total-budget-s", type=float, default=230.0, help="the probe is cut to fit")
    p.add_argument("--smoke", action="store_true", help="CPU-only check on synthetic data")
    p.add_argument("--probe-nccl-ce", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--probe-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.reps < 1 or a.window_ms <= 0:
        p.error("--reps must be >= 1 and --window-ms > 0")
    a.workload = {"source": "--workload-bytes", "input_bytes_per_rank": a.workload_bytes}
    if a.workload_from:
        try:
            with open(a.workload_from) as f:
                a.workload = workload_from_e2e(json.load(f))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            p.error(f"--workload-from {a.workload_from}: {exc}")
        a.workload["source"] = a.workload_from
        a.workload_bytes = float(a.workload["input_bytes_per_rank"])
    want = [] if a.no_paced else list(dict.fromkeys(a.paced_backends))
    a.paced_backends = [b for b in want if b in a.backends and "nccl" in a.backends]
    a.paced_dropped = [b for b in want if b not in a.paced_backends]
    if a.paced_dropped:
        why = "pacing needs nccl and the backend itself in --backends"
        print(f"sm_contention: not pacing {a.paced_dropped} ({why})", file=sys.stderr)
    return a


def paced_name(backend: str) -> str:
    return backend + PACED_SUFFIX


def paced_base(backend: str) -> str | None:
    """The backend a paced pseudo-backend paces (None for a plain backend)."""
    return backend[: -len(PACED_SUFFIX)] if backend in PACED_BACKENDS else None


def workload_from_e2e(report: dict[str, Any], variant: str = "freescale") -> dict[str, Any]:
    """The size of one SM-free collective in an e2e report's ``variant`` row: bytes its
    overlap backend (``summary.overlap_backend``) sent per step / that backend's
    collectives per step, as all-to-all input per rank (x W / (W - 1): a rank keeps
    its own share), the unit of this benchmark's sizes. Bytes and collectives per step
    come from the backend's all-to-alls in ``summary.comm_by_op`` (reports since
    session 19); older reports give only the backend's total bytes, and collectives
    per step from the waits on them (``summary.host_cpu.host_wait_all_threads``, keys
    ``thread|backend:name``: every overlapped collective is waited on once).
    ValueError if the row is missing or its overlap backend carried nothing."""
    rows = {r.get("variant"): r for r in report.get("rows", [])}
    if variant not in rows:
        raise ValueError(f"no {variant!r} row (rows: {sorted(map(str, rows))})")
    s = rows[variant]["summary"]
    if not isinstance(s, dict):
        raise ValueError(f"{variant!r} has no summary")
    backend, steps, world = s.get("overlap_backend"), int(s["steps"]), int(s["world_size"])
    a2a = (s.get("comm_by_op") or {}).get(f"{backend}:all_to_all") or {}
    sent = a2a.get("bytes") or (s.get("comm_bytes_by_backend") or {}).get(backend, 0)
    if world < 2 or not sent or not backend:
        raise ValueError(f"{variant!r} sent nothing through its overlap backend ({backend})")
    if a2a.get("calls"):
        per_step, how = a2a["calls"] / steps, f"summary.comm_by_op[{backend}:all_to_all]"
    else:
        waits = (s.get("host_cpu") or {}).get("host_wait_all_threads") or {}
        per_step = sum(
            float(v.get("calls_per_step", 0.0))
            for k, v in waits.items()
            if k.split("|", 1)[-1].startswith(f"{backend}:")
        )
        how = "summary.host_cpu.host_wait_all_threads (waits per collective)"
    if per_step <= 0:
        raise ValueError(f"no {backend} collectives per step found in {variant!r}")
    sent_per_call = sent / steps / per_step
    return {
        "variant": variant,
        "backend": backend,
        "world_size": world,
        "bytes_sent_per_step": sent / steps,
        "collectives_per_step": per_step,
        "collectives_per_step_from": how,
        "bytes_sent_per_collective": sent_per_call,
        "input_bytes_per_rank": sent_per_call * world / (world - 1),
        "git_sha": report.get("git_sha"),
    }


def size_list(a: argparse.Namespace) -> list[int]:
    sizes = {int(s * MB) for s in a.sizes_mb}
    if a.workload_bytes > 0:
        sizes.add(int(a.workload_bytes))
    return sorted(sizes)


def size_label(nbytes: int) -> str:
    return f"{nbytes / MB:.0f}MB" if nbytes % MB == 0 else f"{nbytes / 1e6:.0f}MB(workload)"


# ============================================================ pure accounting
def bytes_in_window(
    intervals: list[tuple[float, float]], w0: float, w1: float, nbytes: float
) -> tuple[float, float]:
    """(bytes moved inside [w0, w1], coverage): each transfer interval [s, e] carries
    ``nbytes``, spread uniformly over it; coverage = fraction of the window covered by
    the union of the intervals."""
    if w1 <= w0:
        return 0.0, 0.0
    moved = 0.0
    for s, e in intervals:
        if e <= s:
            continue
        ov = min(e, w1) - max(s, w0)
        if ov > 0:
            moved += nbytes * ov / (e - s)
    covered, cur_s, cur_e = 0.0, None, None
    for s, e in sorted((max(s, w0), min(e, w1)) for s, e in intervals if e > w0 and s < w1):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                covered += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        covered += cur_e - cur_s
    return moved, covered / (w1 - w0)


def transfers_needed(window_ms: float, transfer_ms: float, pre: int = 2, margin: float = 1.5):
    """Back-to-back transfers to issue so that they cover a kernel window."""
    transfer_ms = max(transfer_ms, 1e-3)
    return int(pre + math.ceil(margin * window_ms / transfer_ms) + 1)


def pacing_period_ms(sent_bytes: float, target_gbps: float) -> float:
    """Milliseconds between transfer starts so that ``sent_bytes`` per transfer make
    ``target_gbps`` (1e9 bytes/s); inf for a target <= 0."""
    return sent_bytes / (target_gbps * 1e6) if target_gbps > 0 else math.inf


def pacing_gap_ms(sent_bytes: float, target_gbps: float, transfer_ms: float) -> float:
    """Host idle time after a transfer of ``transfer_ms``: max(period - transfer, 0); 0
    when the transfer alone is slower than the target rate (the pacing is then
    saturated)."""
    return max(pacing_period_ms(sent_bytes, target_gbps) - transfer_ms, 0.0)


def pace_step(deadline: float, now: float, period: float) -> tuple[float, float]:
    """One step of the paced transfer loop (host clock, any unit): (sleep before issuing
    the transfer due at ``deadline``, the next transfer's deadline). A late transfer is
    issued at once and the schedule slips so that at most one more follows back-to-back
    (no burst to catch up)."""
    if deadline > now:
        return deadline - now, deadline + period
    return 0.0, max(deadline, now - period) + period


def eligible_for_best(backend: str, bytes_ratio: float | None) -> bool:
    """Whether a row may be the "best SM-free" one, from its bytes moved during the
    kernel / NCCL's in the same cell: NCCL always; a paced row within
    PACED_RATIO_RANGE (then ~equal bytes, a near-unit rescale); a saturated backend
    with at least ELIGIBLE_MIN_BYTES_FRACTION (at most a 4x extrapolation)."""
    if backend == "nccl":
        return True
    if bytes_ratio is None or bytes_ratio <= 0:
        return False
    if backend in PACED_BACKENDS:
        return PACED_RATIO_RANGE[0] <= bytes_ratio <= PACED_RATIO_RANGE[1]
    return bytes_ratio >= ELIGIBLE_MIN_BYTES_FRACTION


def make_row(
    kernel: str,
    size: int,
    backend: str,
    alone_ms: list[float],
    overlapped_ms: list[float],
    moved: list[float],
    coverage: list[float],
    paired_alone_ms: list[float] | None = None,
    **extra: Any,
) -> dict:
    """One cell's row. With ``paired_alone_ms`` (one alone window timed right before each
    overlapped one) each rep's slowdown is against its own alone window; otherwise
    against the median of ``alone_ms``."""
    if paired_alone_ms:
        if len(paired_alone_ms) != len(overlapped_ms):
            raise ValueError("paired_alone_ms needs one alone window per overlapped window")
        base = statistics.median(paired_alone_ms)
        slow = [o / a - 1.0 for o, a in zip(overlapped_ms, paired_alone_ms)]
    else:
        base = statistics.median(alone_ms)
        slow = [o / base - 1.0 for o in overlapped_ms]
    b = statistics.median(moved) if moved else 0.0
    row = {
        "kernel": kernel,
        "size_bytes": size,
        "size_label": size_label(size),
        "backend": backend,
        "kernel_alone_ms": base,
        "kernel_overlapped_ms": statistics.median(overlapped_ms),
        "slowdown": statistics.median(slow),
        "slowdown_std": statistics.pstdev(slow) if len(slow) > 1 else 0.0,
        "bytes_moved_during_kernel": b,
        "transfer_gbps_during_kernel": b / (statistics.median(overlapped_ms) * 1e6),
        "coverage": statistics.median(coverage) if coverage else 0.0,
        "reps": len(overlapped_ms),
        "paired_alone": bool(paired_alone_ms),
        # wall clock when the cell finished: lines the rows up with clock/power samples
        # taken alongside (e2e_gpu.sh smc2: nvidia-smi every 100 ms)
        "finished_unix": time.time(),
    }
    row.update(extra)
    return row


def normalise_cells(rows: list[dict]) -> None:
    """Add the equal-bytes slowdown, the bytes ratio to NCCL and the "best" eligibility
    to every row (reference: NCCL in the same cell; paced rows alike, their factor then
    near 1)."""
    cells: dict[tuple[str, int], dict[str, dict]] = {}
    for r in rows:
        cells.setdefault((r["kernel"], r["size_bytes"]), {})[r["backend"]] = r
    for by_backend in cells.values():
        ref = by_backend.get("nccl")
        ref_bytes = ref["bytes_moved_during_kernel"] if ref else None
        for r in by_backend.values():
            b = r["bytes_moved_during_kernel"]
            r["bytes_ratio_to_nccl"] = b / ref_bytes if ref_bytes else None
            if ref_bytes and b > 0:
                f = ref_bytes / b
                r["equal_bytes_factor"] = f
                r["slowdown_equal_bytes"] = r["slowdown"] * f
                r["slowdown_equal_bytes_std"] = r["slowdown_std"] * f
                r["eligible_for_best"] = eligible_for_best(r["backend"], b / ref_bytes)
            else:
                r["equal_bytes_factor"] = None
                r["slowdown_equal_bytes"] = None
                r["slowdown_equal_bytes_std"] = None
                r["eligible_for_best"] = False
            r["slowdown_pct_per_gb"] = 100 * r["slowdown"] / (b / 1e9) if b > 0 else None


def _closest(values: list[int], target: int) -> int | None:
    return min(values, key=lambda v: abs(v - target)) if values else None


def headline(rows: list[dict], bandwidth: list[dict], workload_bytes: int) -> dict:
    def cell(kernel: str, size: int) -> dict[str, dict]:
        return {r["backend"]: r for r in rows if r["kernel"] == kernel and r["size_bytes"] == size}

    sizes = sorted({r["size_bytes"] for r in rows})
    kernels = sorted({r["kernel"] for r in rows})
    h: dict[str, Any] = {}
    s256 = _closest(sizes, 256 * MB)
    g = cell("gemm", s256) if s256 is not None else {}
    h["headline_cell"] = {"kernel": "gemm", "size_bytes": s256}
    h["slowdown_nccl"] = g.get("nccl", {}).get("slowdown")
    for b in SMFREE:
        h[f"slowdown_{b}"] = g.get(b, {}).get("slowdown_equal_bytes")
        h[f"slowdown_{b}_saturated"] = g.get(b, {}).get("slowdown")

    def best(c: dict[str, dict]) -> tuple[str | None, float | None]:
        cands = [
            (r["slowdown_equal_bytes"], b)
            for b, r in c.items()
            if (b in SMFREE or b in PACED_BACKENDS)
            and r.get("eligible_for_best")
            and r["slowdown_equal_bytes"] is not None
        ]
        if not cands:
            return None, None
        v, b = min(cands)
        return b, v

    ratios, per_kernel, skipped = [], {}, []
    for k in kernels:
        kr = []
        for s in sizes:
            c = cell(k, s)
            nccl = c.get("nccl", {}).get("slowdown")
            b, v = best(c)
            if nccl is None or v is None or nccl < NOISE_FLOOR:
                skipped.append({"kernel": k, "size_bytes": s, "nccl_slowdown": nccl})
                continue
            kr.append({"size_bytes": s, "ratio": v / nccl, "best": b})
        per_kernel[k] = max((x["ratio"] for x in kr), default=None)
        ratios += [x["ratio"] for x in kr]
        per_kernel[f"{k}_by_size"] = kr
    h["smfree_vs_nccl_slowdown_ratio"] = max(ratios) if ratios else None
    h["smfree_vs_nccl_slowdown_ratio_by_kernel"] = per_kernel
    h["ratio_cells_skipped"] = skipped
    wl = _closest(sizes, workload_bytes)
    h["workload_size_bytes"] = wl
    h["best_smfree_at_workload"] = {
        k: dict(zip(("backend", "slowdown_equal_bytes"), best(cell(k, wl)))) for k in kernels
    }
    bw: dict[str, dict[str, float]] = {}
    for r in bandwidth:
        bw.setdefault(r["backend"], {})[r["size_label"]] = r["gbps"]
    h["bandwidth_alone_gbps"] = bw
    nccl_ok = h["slowdown_nccl"] is not None and h["slowdown_nccl"] >= 0.03
    ratio = h["smfree_vs_nccl_slowdown_ratio"]
    wl_vals = [v["slowdown_equal_bytes"] for v in h["best_smfree_at_workload"].values()]
    # paced: measured at ~equal bytes, reported unscaled
    wc = {k: cell(k, wl) for k in kernels} if wl is not None else {}
    for pb in PACED_BACKENDS:
        if pb != "copy_engine_paced" and not any(r["backend"] == pb for r in rows):
            continue
        h[f"slowdown_{pb}"] = g.get(pb, {}).get("slowdown")
        h[f"bytes_ratio_{pb}"] = g.get(pb, {}).get("bytes_ratio_to_nccl")
        h[f"slowdown_{pb}_at_workload"] = {k: wc[k].get(pb, {}).get("slowdown") for k in wc}
        h[f"bytes_ratio_{pb}_at_workload"] = {
            k: wc[k].get(pb, {}).get("bytes_ratio_to_nccl") for k in wc
        }
    h["best_paced_at_workload"] = {k: best_paced(c) for k, c in wc.items()}
    # --paired-alone: the method's own bias (an alone window timed as if overlapped);
    # a backend's slowdown is only meaningful beyond this, in either direction. The
    # paced slowdown less the null row's (both timed right after an alone window):
    h["slowdown_copy_engine_paced_minus_null_at_workload"] = {
        k: wc[k]["copy_engine_paced"]["slowdown"] - wc[k]["null"]["slowdown"]
        for k in wc
        if "null" in wc[k] and "copy_engine_paced" in wc[k]
    }
    h["null_slowdown_at_workload"] = {
        k: {q: wc[k]["null"].get(q) for q in ("slowdown", "slowdown_std", "reps")}
        for k in wc
        if "null" in wc[k]
    }
    h["targets"] = {
        "nccl_slowdown_reproduced (>= 3% at 256 MB, GEMM)": nccl_ok,
        "best_smfree_at_most_half_of_nccl_at_every_size": ratio is not None and ratio <= 0.5,
        "best_smfree_under_2pct_at_workload_size": bool(wl_vals)
        and all(v is not None and v < 0.02 for v in wl_vals),
        PACED_TARGET: paced_target(h["best_paced_at_workload"]),
    }
    return h


def best_paced(c: dict[str, dict]) -> dict | None:
    """The paced row of a cell with the lowest measured (unscaled) slowdown among those
    eligible (bytes ratio to NCCL within PACED_RATIO_RANGE); None if there is none."""
    cands = [r for b, r in c.items() if b in PACED_BACKENDS and r.get("eligible_for_best")]
    if not cands:
        return None
    r = min(cands, key=lambda r: r["slowdown"])
    keys = ("backend", "slowdown", "slowdown_std", "bytes_ratio_to_nccl", "reps")
    return {k: r.get(k) for k in keys}


def paced_target(best_by_kernel: dict[str, dict | None]) -> bool | None:
    """ "Best SM-free under 2% at the workload size", from the paced rows' measured
    slowdown: False if any kernel's best eligible paced row is >= 2%; None if a kernel
    has no eligible paced row (not measured at ~equal bytes); else True."""
    vals = list(best_by_kernel.values())
    if any(v is not None and v["slowdown"] >= 0.02 for v in vals):
        return False
    if not vals or any(v is None for v in vals):
        return None
    return True


METHOD = {
    "sizes": "bytes per rank in the all-to-all input (fp32 rows of 128, equal splits); "
    "bytes moved = bytes sent to other ranks = size x (W-1)/W",
    "kernel_window": "R back-to-back kernels between two CUDA events on the compute "
    "stream; R chosen so one window lasts about --window-ms; median over reps; alone "
    "and overlapped windows interleaved rep by rep",
    "overlap": "a second thread issues N back-to-back transfers (same N on every rank) "
    "on its own stream, each between two CUDA events; the kernel window starts after two "
    "are issued. bytes_moved_during_kernel prorates each transfer's bytes by the share "
    "of its GPU interval inside the window; coverage = share of the window with a "
    "transfer in flight",
    "equal_bytes": "slowdown is measured with each backend saturated; "
    "slowdown_equal_bytes = slowdown x (bytes NCCL moved in the same window) / (bytes "
    "this backend moved): the slowdown at equal bytes moved during the kernel, taking "
    "interference as proportional to bytes moved; bytes_ratio_to_nccl = bytes this "
    "backend moved / NCCL's in the same cell",
    "pacing": "<backend>_paced rows (copy_engine_paced by default; --paced-backends, "
    "--no-paced) measure the slowdown at ~equal bytes instead of extrapolating it: the "
    "same transfer call as <backend>, but the transfer thread sleeps on the host "
    "between transfers (no GPU sleep kernel: it would occupy SMs) so that its byte rate "
    "matches NCCL's. NCCL runs first in every rep; target rate = bytes NCCL moved during "
    "that rep's window / window ms (max over ranks); period = bytes sent per transfer / "
    "target rate (at most the window); transfer i is issued at t0 + i x period on the "
    "host clock (the gap after a transfer = period - its issue time; nominal gap = "
    "max(period - transfer time alone, 0), in pacing_gap_ms; a late transfer lets at "
    "most one more follow back-to-back); the transfer count covers the window at that "
    "period; period and count identical on all ranks. slowdown is then measured at "
    "bytes_ratio_to_nccl ~ 1 and slowdown_equal_bytes is a near-unit rescale of it",
    "best_smfree": "lowest slowdown_equal_bytes among SM-free backends that moved at "
    f"least {ELIGIBLE_MIN_BYTES_FRACTION:.0%} of NCCL's bytes in the window (<= 4x "
    "extrapolation) and paced rows whose bytes_ratio_to_nccl is within "
    f"[{PACED_RATIO_RANGE[0]}, {PACED_RATIO_RANGE[1]}]",
    "paired_alone": "with --paired-alone (rows say paired_alone: true) each rep's slowdown "
    "is overlapped / the alone window timed right before it - 1; the null row repeats an "
    "alone window as if overlapped: the method's bias (headline null_slowdown_at_workload)",
    "paced_target": f"targets[{PACED_TARGET!r}]: at the workload size, for every kernel "
    "the eligible paced row with the lowest measured (unscaled) slowdown is < 2%; False "
    "if one is >= 2%, None if a kernel has no eligible paced row; next to the "
    "extrapolated best_smfree_under_2pct_at_workload_size",
    "ratio": "smfree_vs_nccl_slowdown_ratio = max over kernels and sizes of best SM-free "
    f"slowdown_equal_bytes / NCCL slowdown (cells with NCCL slowdown < {NOISE_FLOOR:.1%} "
    "are skipped and listed)",
}


# ===================================================================== outputs


def write_outputs(out_dir: str, result: dict) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sm_contention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    kernels = [k for k in KERNELS if any(r["kernel"] == k for r in result["rows"])]
    fig, axes = plt.subplots(1, len(kernels) + 1, figsize=(5 * (len(kernels) + 1), 4))
    axes = list(axes) if hasattr(axes, "__len__") else [axes]
    plotted = BACKENDS + [
        b for b in PACED_BACKENDS if any(r["backend"] == b for r in result["rows"])
    ]
    for ax, k in zip(axes, kernels):
        for i, b in enumerate(plotted):
            rs = sorted(
                (r for r in result["rows"] if r["kernel"] == k and r["backend"] == b),
                key=lambda r: r["size_bytes"],
            )
            rs = [r for r in rs if r.get("slowdown_equal_bytes") is not None]
            if not rs:
                continue
            xs = [r["size_bytes"] / MB for r in rs]
            ys = [100 * r["slowdown_equal_bytes"] for r in rs]
            ok = all(r.get("eligible_for_best") for r in rs)
            ax.plot(xs, ys, color=f"C{i}", ls="-" if ok else "--", lw=1)
            for x, y, r in zip(xs, ys, rs):
                face = f"C{i}" if r.get("eligible_for_best") else "none"
                ax.plot([x], [y], "o", color=f"C{i}", mfc=face)
            ax.plot([], [], "o-", color=f"C{i}", label=b + ("" if ok else " (extrapolated)"))
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("all-to-all size per rank (MB)")
        ax.set_ylabel("kernel slowdown at equal bytes (%)")
        ax.set_title(f"{k}: slowdown at equal bytes")
        ax.legend(fontsize=7)
    ax = axes[-1]
    for b in BACKENDS:
        pts = sorted(
            (r["size_bytes"] / MB, r["gbps"])
            for r in result["bandwidth_alone"]
            if r["backend"] == b
        )
        if pts:
            ax.plot(*zip(*pts), marker="o", label=b)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("all-to-all size per rank (MB)")
    ax.set_ylabel("GB/s sent to peers, alone")
    ax.set_title("bandwidth alone")
    ax.legend(fontsize=7)
    fig.suptitle(f"sm_contention {result.get('device', '')} {result.get('git_sha') or ''}")
    fig.tight_layout()
    png = os.path.join(out_dir, "sm_contention.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return written + [png]


def validate_result(result: dict) -> None:
    """Fail loudly if the JSON misses what the figure promises."""
    for key in ("figure", "device", "git_sha", "date", "command", "method", "rows", "headline"):
        if key not in result:
            raise AssertionError(f"sm_contention.json lacks {key!r}")
    h = result["headline"]
    for key in (
        "slowdown_nccl",
        "slowdown_copy_engine",
        "slowdown_host_staged",
        "smfree_vs_nccl_slowdown_ratio",
        "bandwidth_alone_gbps",
        "slowdown_copy_engine_paced",
        "bytes_ratio_copy_engine_paced",
        "slowdown_copy_engine_paced_at_workload",
        "bytes_ratio_copy_engine_paced_at_workload",
        "best_paced_at_workload",
    ):
        if key not in h:
            raise AssertionError(f"headline lacks {key!r}")
    if PACED_TARGET not in h.get("targets", {}):
        raise AssertionError(f"headline targets lack {PACED_TARGET!r}")
    for r in result["rows"]:
        for key in ("kernel", "size_bytes", "backend", "slowdown", "bytes_moved_during_kernel"):
            if key not in r:
                raise AssertionError(f"row lacks {key!r}: {r}")
        if r["backend"] in PACED_BACKENDS:
            for key in ("paced_from", "bytes_ratio_to_nccl", "slowdown_equal_bytes"):
                if key not in r:
                    raise AssertionError(f"paced row lacks {key!r}: {r}")


def command_line() -> str:
    if "LOCAL_RANK" in os.environ:
        n = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "?"))
        pre = f"python -m torch.distributed.run --nproc-per-node {n} "
    else:
        pre = "python "
    return pre + " ".join(shlex.quote(x) for x in sys.argv)


# ====================================================================== smoke
def smoke(a: argparse.Namespace) -> int:
    """The accounting, headline, JSON and plot on synthetic timings (no device)."""
    # bytes_in_window on a known case: 4 transfers of 10 units, window [5, 25]
    iv = [(0.0, 10.0), (10.0, 20.0), (20.0, 30.0), (35.0, 40.0)]
    moved, cov = bytes_in_window(iv, 5.0, 25.0, 100.0)
    assert abs(moved - 200.0) < 1e-9 and abs(cov - 1.0) < 1e-9, (moved, cov)
    moved, cov = bytes_in_window(iv, 28.0, 38.0, 100.0)
    assert abs(moved - (20.0 + 60.0)) < 1e-9 and abs(cov - 0.5) < 1e-9, (moved, cov)
    assert transfers_needed(25.0, 0.5) == 2 + 75 + 1
    # pacing: 110 MB per transfer at NCCL's 72 GB/s -> one every 1.528 ms; a 0.6 ms
    # transfer leaves a 0.928 ms gap; 2 + ceil(1.5 x 25 / 1.528) + 1 transfers
    period = pacing_period_ms(110e6, 72.0)
    assert abs(period - 110 / 72) < 1e-9, period
    assert abs(pacing_gap_ms(110e6, 72.0, 0.6) - (110 / 72 - 0.6)) < 1e-9
    assert pacing_gap_ms(110e6, 72.0, 2.0) == 0.0
    assert transfers_needed(25.0, period) == 2 + 25 + 1
    assert pace_step(10.0, 9.0, 2.0) == (1.0, 12.0)  # early: sleep to the deadline
    assert pace_step(10.0, 17.0, 2.0) == (0.0, 17.0)  # late by 3.5 periods: 1 catch-up
    sizes = size_list(a)
    fake_rate = {"nccl": 260e9, "copy_engine": 180e9, "copy_engine_contiguous": 170e9}
    fake_rate["host_staged"] = 1.7e9
    fake_slow = {"nccl": 0.11, "copy_engine": 0.04, "copy_engine_contiguous": 0.07}
    fake_slow["host_staged"] = 0.004
    for b in PACEABLE:  # paced: 97% of NCCL's rate, a smaller slowdown than saturated
        fake_rate[paced_name(b)] = 0.97 * fake_rate["nccl"]
        fake_slow[paced_name(b)] = fake_slow[b] * 0.375
    paced = [paced_name(b) for b in a.paced_backends]
    rows, bandwidth = [], []
    for size in sizes:
        for b in a.backends:
            bandwidth.append(
                {"backend": b, "size_bytes": size, "size_label": size_label(size),
                 "gbps": fake_rate[b] / 1e9, "transfer_ms": size / 2 / fake_rate[b] * 1e3}
            )  # fmt: skip
        for k in a.kernels:
            alone = [25.0, 25.1, 24.9]
            for b in a.backends + paced:
                over = [x * (1 + fake_slow[b]) for x in alone]
                moved = [fake_rate[b] * x * 1e-3 for x in over]
                extra = {"paced_from": paced_base(b)} if b in paced else {}
                pa = alone if a.paired_alone else None
                rows.append(
                    make_row(
                        k, size, b, alone, over, moved, [1.0] * 3,
                        paired_alone_ms=pa, window_reps=18, **extra,
                    )
                )  # fmt: skip
            if a.paired_alone:
                null = [x * 1.001 for x in alone]
                rows.append(make_row(k, size, "null", alone, null, [], [], paired_alone_ms=alone))
    normalise_cells(rows)
    result = {
        "figure": "sm_contention",
        "smoke": True,
        "device": "none (smoke: synthetic timings)",
        "git_sha": git_sha(a.git_sha),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "method": METHOD,
        "config": vars(a),
        "workload": a.workload,
        "bandwidth_alone": bandwidth,
        "rows": rows,
        "headline": headline(rows, bandwidth, int(a.workload_bytes)),
        "nccl_ce_probe": {"skipped": "smoke"},
    }
    validate_result(result)
    h = result["headline"]
    assert abs(h["slowdown_nccl"] - 0.11) < 1e-9, h
    # copy engine: 4% saturated while moving 180 GB/s x its window, NCCL 260 GB/s x its
    # window -> scaled by the ratio of the bytes moved
    want = 0.04 * (260 * 1.11) / (180 * 1.04)
    assert abs(h["slowdown_copy_engine"] - want) < 1e-6, h
    assert h["slowdown_host_staged"] is not None  # reported, but not eligible as "best"
    if "copy_engine" in a.paced_backends:
        # paced: 1.5% measured, unscaled, at 97% x 1.015 / 1.11 of NCCL's bytes; eligible,
        # so it is the best SM-free backend and meets the measured target
        ratio = 0.97 * 1.015 / 1.11
        assert abs(h["slowdown_copy_engine_paced"] - 0.015) < 1e-9, h
        assert abs(h["bytes_ratio_copy_engine_paced"] - ratio) < 1e-9, h
        for k in a.kernels:
            assert abs(h["slowdown_copy_engine_paced_at_workload"][k] - 0.015) < 1e-9, h
            assert abs(h["bytes_ratio_copy_engine_paced_at_workload"][k] - ratio) < 1e-9, h
        assert h["best_smfree_at_workload"]["gemm"]["backend"] == "copy_engine_paced", h
        assert h["targets"][PACED_TARGET] is True, h
        assert h["targets"]["best_smfree_under_2pct_at_workload_size"] is True, h
    else:
        assert h["slowdown_copy_engine_paced"] is None, h
        assert h["targets"][PACED_TARGET] is None, h
        assert h["best_smfree_at_workload"]["gemm"]["backend"] == "copy_engine", h
    files = write_outputs(a.out, result)
    with open(files[0]) as f:
        validate_result(json.load(f))
    print(json.dumps(h, indent=1, default=str))
    print("smoke OK:", ", ".join(files))
    return 0


# ================================================================== the device
class Bench:
    """Everything that touches the GPUs (both ranks run the same sequence)."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch.distributed as dist

        from freescale.comm import (
            Communicator,
            CopyEngineCommunicator,
            CopyEngineConfig,
            HostStagedCommunicator,
            HostStagedConfig,
        )

        self.a, self.dist = a, dist
        self.t_start = time.monotonic()
        self.local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(self.local)
        self.dev = torch.device("cuda", self.local)
        dist.init_process_group("nccl", device_id=self.dev)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world < 2:
            raise SystemExit("sm_contention needs >= 2 ranks (torchrun --nproc-per-node 2)")
        self.ctrl = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=900))
        self.comms: dict[str, Any] = {}
        nccl_group = dist.new_group(backend="nccl")
        self.comms["nccl"] = Communicator(nccl_group, "nccl")
        ce = CopyEngineCommunicator.create(
            name="ce",
            config=CopyEngineConfig(
                copy_streams=a.ce_streams, timeout_s=120, completion=a.ce_completion
            ),
        )
        self.comms["copy_engine"] = self.comms["copy_engine_contiguous"] = ce
        self.comms["host_staged"] = HostStagedCommunicator.create(
            name="hs", config=HostStagedConfig(timeout_s=120, max_pinned_bytes=512 << 20)
        )
        self.comm_stream = torch.cuda.Stream(device=self.dev)
        self.skipped: list[dict] = []

    # ------------------------------------------------------------ agreement
    def agree_max(self, x: float) -> float:
        t = torch.tensor([float(x)], dtype=torch.float64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.ctrl)
        return float(t.item())

    def out_of_time(self) -> bool:
        over = time.monotonic() - self.t_start > self.a.time_budget_s
        return self.agree_max(1.0 if over else 0.0) > 0

    # ------------------------------------------------------------- kernels
    def make_kernel(self, kind: str):
        a = self.a
        if kind == "gemm":
            n = a.gemm_n
            x = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            y = torch.randn(n, n, device=self.dev, dtype=torch.bfloat16)
            z = torch.empty(n, n, device=self.dev, dtype=torch.bfloat16)
            return lambda: torch.mm(x, y, out=z), {"shape": [n, n, n], "dtype": "bfloat16"}
        from freescale.models import sequence as seq

        g = torch.Generator().manual_seed(7)
        lens: list[int] = []
        lo, hi = a.attn_mean_len // 4, a.attn_mean_len * 7 // 4
        while sum(lens) < a.attn_tokens:
            lens.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
        lens[-1] -= sum(lens) - a.attn_tokens
        lengths = torch.tensor(lens, device=self.dev)
        t, h, d = a.attn_tokens, a.attn_heads, a.attn_dim
        q, k, v = (torch.randn(t, h, d, device=self.dev, dtype=torch.bfloat16) for _ in range(3))
        seq.jagged_attention(q, k, v, lengths, "flex")  # compiles; validates the path
        fn = seq._FLEX_CACHE["fn"]
        tp = -(-t // seq.FLEX_BLOCK) * seq.FLEX_BLOCK
        if not seq._FLEX_CACHE.get("dynamic", True):
            tp = seq.flex_bucket(t)
        mask = seq.document_causal_block_mask(lengths, tp)

        def pad(x: torch.Tensor) -> torch.Tensor:  # the model's layout (see _attention_flex)
            out = x.new_zeros(tp, h, d)
            out[:t] = x
            return out.requires_grad_(True)

        leaves = [pad(q), pad(k), pad(v)]
        go = torch.randn(1, h, tp, d, device=self.dev, dtype=torch.bfloat16)

        def step() -> None:  # forward + backward, mask prebuilt: no host synchronisation
            qp, kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in leaves)
            o = fn(qp, kp, vp, block_mask=mask)
            torch.autograd.grad(o, leaves, go)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        info = {"tokens": t, "samples": len(lens), "heads": h, "head_dim": d, "dtype": "bfloat16"}
        return step, info

    def cool(self) -> None:
        """--cooldown-ms: let the GPU idle before a timed window (same on every rank)."""
        ms = float(getattr(self.a, "cooldown_ms", 0.0) or 0.0)
        if ms > 0:
            torch.cuda.synchronize()
            time.sleep(ms / 1e3)

    def window(self, fn, reps: int) -> float:
        self.cool()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    # ------------------------------------------------------------ transfers
    def transfer_fn(self, backend: str, size: int):
        rows = max(size // 512 // self.world, 1) * self.world
        x = torch.randn(rows, 128, device=self.dev)
        splits = [rows // self.world] * self.world
        comm = self.comms[backend]
        sent = rows * 512 * (self.world - 1) / self.world
        if backend == "copy_engine":

            def call() -> None:
                h = comm.all_to_all_v_segments(x, splits, splits, name="bench")
                h.wait()
                h.release()

        else:

            def call() -> None:
                comm.all_to_all_v(x, splits, splits, name="bench").wait()

        return call, sent

    def run_transfers(
        self, call, n: int, started: threading.Event, records: list, period_ms: float = 0.0
    ) -> None:
        """``n`` transfers on the comm stream, back-to-back, or with ``period_ms`` > 0
        paced: transfer i issued at t0 + i x period (host clock, host sleep only)."""
        torch.cuda.set_device(self.dev)
        cs = self.comm_stream
        period_s = period_ms / 1e3
        deadline = time.perf_counter()
        try:
            with torch.cuda.stream(cs):
                for i in range(n):
                    if period_s > 0:
                        pause, deadline = pace_step(deadline, time.perf_counter(), period_s)
                        if pause > 0:
                            time.sleep(pause)
                    s = torch.cuda.Event(enable_timing=True)
                    s.record(cs)
                    call()
                    e = torch.cuda.Event(enable_timing=True)
                    e.record(cs)
                    records.append((s, e))
                    if i == 1:
                        started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            records.append(exc)
        finally:
            started.set()

    def measure(self, call, n: int, kernel=None, reps: int = 0, period_ms: float = 0.0) -> dict:
        """Issue ``n`` transfers on a thread (paced at ``period_ms`` if > 0); optionally
        time a kernel window meanwhile. Returns the transfer intervals and window bounds
        in ms after a reference event."""
        if kernel is not None:
            self.cool()
        ref = torch.cuda.Event(enable_timing=True)
        ref.record()
        torch.cuda.synchronize()
        records: list = []
        started = threading.Event()
        th = threading.Thread(
            target=self.run_transfers, args=(call, n, started, records, period_ms)
        )
        th.start()
        w = None
        if kernel is not None:
            if not started.wait(self.a.probe_timeout_s):
                raise RuntimeError("transfers did not start")
            w0, w1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            w0.record()
            for _ in range(reps):
                kernel()
            w1.record()
            w1.synchronize()
            w = (ref.elapsed_time(w0), ref.elapsed_time(w1))
        th.join()
        torch.cuda.synchronize()
        errs = [r for r in records if isinstance(r, BaseException)]
        if errs:
            raise RuntimeError(f"transfer thread failed: {errs[0]!r}") from errs[0]
        iv = [(ref.elapsed_time(s), ref.elapsed_time(e)) for s, e in records]
        return {"intervals": iv, "window": w}

    def bandwidth(self, backend: str, size: int) -> dict:
        call, sent = self.transfer_fn(backend, size)
        warm = self.measure(call, 2)
        t_est = max(e - s for s, e in warm["intervals"])
        n = int(self.agree_max(max(4, min(30, math.ceil(150.0 / max(t_est, 1e-3))))))
        iv = self.measure(call, n)["intervals"]
        per = statistics.median(e - s for s, e in iv)
        span = iv[-1][1] - iv[0][0]
        return {
            "backend": backend,
            "size_bytes": size,
            "size_label": size_label(size),
            "bytes_sent_per_transfer": sent,
            "transfers": n,
            "transfer_ms": per,
            "gbps": sent / (per * 1e6),
            "gbps_back_to_back": sent * n / (span * 1e6),
        }

    # ---------------------------------------------------------------- main
    def run(self) -> dict:
        a = self.a
        sizes = size_list(a)
        bandwidth: list[dict] = []
        xfer_ms: dict[tuple[str, int], float] = {}
        for size in sizes:
            for b in a.backends:
                r = self.bandwidth(b, size)
                bandwidth.append(r)
                xfer_ms[(b, size)] = self.agree_max(r["transfer_ms"])
                if self.rank == 0:
                    print(json.dumps(r), flush=True)
        rows: list[dict] = []
        kernel_info: dict[str, Any] = {}
        for kind in a.kernels:
            if self.out_of_time():
                self.skipped.append({"kernel": kind, "why": "time budget"})
                continue
            fn, info = self.make_kernel(kind)
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            single = statistics.median(self.window(fn, 1) for _ in range(5))
            reps = int(self.agree_max(max(1, round(a.window_ms / single))))
            info.update(single_ms=single, window_reps=reps)
            kernel_info[kind] = info
            for size in sizes:
                if self.out_of_time():
                    self.skipped.append({"kernel": kind, "size_bytes": size, "why": "time budget"})
                    continue
                rows += self.cell(kind, fn, reps, size, xfer_ms)
            del fn
            torch.cuda.empty_cache()
        normalise_cells(rows)
        return {"rows": rows, "bandwidth_alone": bandwidth, "kernels": kernel_info}

    def cell(self, kind: str, fn, reps: int, size: int, xfer_ms) -> list[dict]:
        a = self.a
        # NCCL first in every rep: its bytes in the rep's window set the paced rate
        plain = sorted(a.backends, key=lambda b: b != "nccl")
        paced = {paced_name(b): b for b in a.paced_backends}  # parse_args: nccl present
        order = plain + list(paced)
        alone: list[float] = []
        over: dict[str, list[float]] = {b: [] for b in order}
        moved: dict[str, list[float]] = {b: [] for b in order}
        cover: dict[str, list[float]] = {b: [] for b in order}
        pacing: dict[str, dict[str, list[float]]] = {
            b: {"target_gbps": [], "period_ms": [], "gap_ms": [], "transfers": []} for b in paced
        }
        calls = {b: self.transfer_fn(b, size) for b in a.backends}
        window_guess = self.agree_max(self.window(fn, reps))
        ns = {b: transfers_needed(window_guess, xfer_ms[(b, size)]) for b in a.backends}
        paired = bool(getattr(a, "paired_alone", False))
        before: dict[str, list[float]] = {b: [] for b in order + ["null"]}
        null_over: list[float] = []
        for _ in range(a.reps):
            alone.append(self.window(fn, reps))
            nccl_gbps = 0.0
            if paired:  # the method's bias: an alone window "overlapped" with nothing
                before["null"].append(self.window(fn, reps))
                null_over.append(self.window(fn, reps))
            for b in order:
                if paired:
                    before[b].append(self.window(fn, reps))
                base = paced.get(b, b)
                call, sent = calls[base]
                n, period = ns.get(b, 0), 0.0
                if b in paced:  # same rate, period and count on every rank
                    target = self.agree_max(nccl_gbps)
                    period = min(pacing_period_ms(sent, target), window_guess)
                    n = int(self.agree_max(transfers_needed(window_guess, period)))
                    p = pacing[b]
                    p["target_gbps"].append(target)
                    p["period_ms"].append(period)
                    p["gap_ms"].append(pacing_gap_ms(sent, target, xfer_ms[(base, size)]))
                    p["transfers"].append(n)
                m = self.measure(call, n, fn, reps, period_ms=period)
                w0, w1 = m["window"]
                mv, cv = bytes_in_window(m["intervals"], w0, w1, sent)
                over[b].append(w1 - w0)
                moved[b].append(mv)
                cover[b].append(cv)
                if b == "nccl":
                    nccl_gbps = mv / ((w1 - w0) * 1e6)
        out = []
        for b in order:
            extra: dict[str, Any] = {"transfers_per_window": ns.get(b)}
            if b in paced:
                p = pacing[b]
                extra = {
                    "paced_from": paced[b],
                    "transfers_per_window": max(p["transfers"]),
                    "transfer_ms_alone": xfer_ms[(paced[b], size)],
                    **{f"pacing_{k}": statistics.median(v) for k, v in p.items()},
                    "pacing_target_gbps_by_rep": p["target_gbps"],
                }
            row = make_row(
                kind, size, b, alone, over[b], moved[b], cover[b],
                paired_alone_ms=before[b] if paired else None,
                window_reps=reps, rank=self.rank, **extra,
            )  # fmt: skip
            out.append(row)
            if self.rank == 0:
                print(json.dumps(row), flush=True)
        if paired:
            row = make_row(
                kind, size, "null", alone, null_over, [], [],
                paired_alone_ms=before["null"], window_reps=reps, rank=self.rank,
                transfers_per_window=0,
            )  # fmt: skip
            out.append(row)
            if self.rank == 0:
                print(json.dumps(row), flush=True)
        return out

    def close(self) -> None:
        for c in {id(c): c for c in self.comms.values()}.values():
            close = getattr(c, "close", None)
            if close is not None:
                close()


# ======================================================== NCCL zero-CTA probe
def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TORCHELASTIC_")
        and k
        not in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "GROUP_WORLD_SIZE",
            "ROLE_RANK",
            "ROLE_WORLD_SIZE",
            "ROLE_NAME",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    }
    env.update(_SAFE_ENV)
    return env


def _descendants(pid: int) -> list[int]:
    """PIDs of every descendant of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop_job(proc: subprocess.Popen) -> None:
    """Stop the torchrun job we started and its ranks: SIGTERM to torchrun (it stops its
    workers), then SIGKILL to whatever of its descendants is left, by pid."""
    kids = _descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *kids]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_probe(a: argparse.Namespace, world: int, timeout_s: float) -> dict:
    """Rank 0 only: the probe as its own torchrun job, killed if it overruns."""
    pdir = os.path.join(a.out, "sm_contention_probe")
    os.makedirs(pdir, exist_ok=True)
    out = os.path.join(pdir, "nccl_ce_probe.json")
    if os.path.exists(out):
        os.unlink(out)
    env = _clean_env()
    env.update(
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT,COLL,TUNING,REG",
        NCCL_DEBUG_FILE=os.path.join(pdir, "nccl.%h.%p.log"),
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(world), str(Path(__file__).resolve()),
        "--probe-nccl-ce", "--probe-out", out, "--out", a.out,
    ]  # fmt: skip
    log = os.path.join(pdir, "probe_stdout.log")
    t0 = time.monotonic()
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_job(proc)
            return {"error": f"probe timed out after {timeout_s:.0f} s", "log": log}
    res: dict[str, Any] = {"returncode": rc, "seconds": time.monotonic() - t0, "log": log}
    if os.path.exists(out):
        with open(out) as f:
            res.update(json.load(f))
    else:
        with open(log) as f:
            res["log_tail"] = f.read()[-3000:]
    return res


def probe_main(a: argparse.Namespace) -> int:
    """One rank of the zero-CTA probe (started by run_probe through torchrun)."""
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    res: dict[str, Any] = {"torch": torch.__version__, "steps": {}}
    try:
        res["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:  # noqa: BLE001
        res["nccl"] = repr(e)
    pg_cls = getattr(dist, "ProcessGroupNCCL", None)
    zero = getattr(pg_cls, "NCCL_CTA_POLICY_ZERO", None) if pg_cls is not None else None
    res["torch_exposes"] = {
        "ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO": zero is not None,
        "Options.config.cta_policy": False,
    }
    opts = None
    if zero is not None:
        try:
            opts = pg_cls.Options()
            opts.config.cta_policy = zero
            res["torch_exposes"]["Options.config.cta_policy"] = True
        except Exception as e:  # noqa: BLE001
            res["steps"]["cta_policy"] = repr(e)
            opts = None
    if opts is None:
        res["available"] = False
        res["reason"] = "this torch cannot set the NCCL CTA policy (no zero-CTA path)"
        _write_probe(a, res, local)
        return 0
    dist.init_process_group("nccl", device_id=dev, pg_options=opts)
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed._symmetric_memory as sm

    try:
        sm.set_backend("NCCL")
        res["steps"]["set_backend_nccl"] = "ok"
    except Exception as e:  # noqa: BLE001
        res["steps"]["set_backend_nccl"] = repr(e)
    dist.all_reduce(torch.ones(1, device=dev))  # creates the communicator
    gname = dist.group.WORLD.group_name
    n = (256 * MB) // 4 // world * world
    g = torch.Generator(device=dev).manual_seed(rank)
    plain_in = torch.randn(n, device=dev, generator=g)
    plain_out = torch.empty_like(plain_in)
    try:
        inp = sm.empty(n, dtype=torch.float32, device=dev)
        out = sm.empty(n, dtype=torch.float32, device=dev)
        inp.copy_(plain_in)
        sm.rendezvous(inp, gname)
        sm.rendezvous(out, gname)
        res["steps"]["symmetric_alloc"] = "ok"
    except Exception as e:  # noqa: BLE001
        res["steps"]["symmetric_alloc"] = repr(e)
        res["available"] = False
        res["reason"] = "symmetric memory on the NCCL backend failed"
        _write_probe(a, res, local)
        dist.destroy_process_group()
        return 0
    # correctness: equal-count all-gather and all-to-all, registered vs plain buffers;
    # NCCL's CE path can fail inside the call (2.28.9 on 2 H200: "ce_coll.cc Cuda failure
    # 'invalid argument'"): record which collective failed and stop (the communicator is
    # unusable after an NCCL error, so nothing after it is attempted)
    ag_in = inp[: n // world]
    ag_plain = torch.empty(n, device=dev)
    dist.all_gather_into_tensor(ag_plain, plain_in[: n // world])
    dist.all_to_all_single(plain_out, plain_in)
    torch.cuda.synchronize()
    for name, call, want in (
        ("all_gather", lambda: dist.all_gather_into_tensor(out, ag_in), ag_plain),
        ("all_to_all_equal_counts", lambda: dist.all_to_all_single(out, inp), plain_out),
    ):
        try:
            call()
            torch.cuda.synchronize()
            res[f"{name}_correct"] = bool(torch.equal(out, want))
        except Exception as e:  # noqa: BLE001
            res["steps"][f"registered_{name}"] = repr(e)
            res["available"] = False
            res["reason"] = (
                f"NCCL's copy-engine path failed in the registered {name} (symmetric "
                f"buffers, CTA policy zero): {e}; see nccl_log_lines"
            )
            _write_probe(a, res, local)
            return 0
    # did any NCCL kernel run for the registered all-to-all? (profiler activity)
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                dist.all_to_all_single(out, inp)
            torch.cuda.synchronize()
        from torch.autograd import DeviceType

        # GPU activity only (CPU-side ranges are also called "nccl:...")
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
        res["gpu_activity_names_sample"] = sorted(set(names))[:20]
        kernels = sorted({x for x in names if "nccl" in x.lower() and "memcpy" not in x.lower()})
        res["nccl_kernels_during_registered_all_to_all"] = kernels[:10]
        res["memcpy_events_during_registered_all_to_all"] = sum(
            1 for x in names if "memcpy" in x.lower()
        )
        res["zero_cta"] = not kernels
    except Exception as e:  # noqa: BLE001
        res["steps"]["profiler"] = repr(e)

    # timing: alone, and a GEMM window overlapped with each all-to-all
    def timed(fn, k: int) -> float:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(k):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / k

    res["a2a_registered_ms"] = statistics.median(
        timed(lambda: dist.all_to_all_single(out, inp), 3) for _ in range(3)
    )
    res["a2a_plain_ms"] = statistics.median(
        timed(lambda: dist.all_to_all_single(plain_out, plain_in), 3) for _ in range(3)
    )
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    z = torch.empty_like(x)

    def gemm() -> None:
        torch.mm(x, x, out=z)

    gemm()
    alone = statistics.median(timed(gemm, 18) for _ in range(3))
    side = torch.cuda.Stream()
    for label, fn in (
        ("registered", lambda: dist.all_to_all_single(out, inp)),
        ("plain", lambda: dist.all_to_all_single(plain_out, plain_in)),
    ):
        vals = []
        for _ in range(3):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(60):  # ~30-45 ms of back-to-back all-to-alls
                    fn()
            vals.append(timed(gemm, 18))
            torch.cuda.synchronize()
        res[f"gemm_slowdown_with_{label}_a2a"] = statistics.median(vals) / alone - 1
    res["gemm_alone_ms"] = alone
    res["available"] = bool(res.get("all_to_all_equal_counts_correct") and res.get("zero_cta"))
    _write_probe(a, res, local)
    dist.destroy_process_group()
    return 0


def _write_probe(a: argparse.Namespace, res: dict, local: int) -> None:
    if local != 0 or not a.probe_out:
        return
    logs = []
    pdir = os.path.dirname(a.probe_out)
    pat = re.compile(r"(CE|Copy Engine|CTA|[Ss]ymmetric|window|Window|WARN)")
    for name in sorted(os.listdir(pdir)) if os.path.isdir(pdir) else []:
        if name.startswith("nccl.") and name.endswith(".log"):
            with open(os.path.join(pdir, name), errors="replace") as f:
                logs += [ln.strip() for ln in f if pat.search(ln)][:40]
    res["nccl_log_lines"] = logs[:80]
    with open(a.probe_out, "w") as f:
        json.dump(res, f, indent=1, default=str)


# ======================================================================= main
def bench_main(a: argparse.Namespace) -> int:
    bench = Bench(a)
    dist = bench.dist
    try:
        measured = bench.run()
    finally:
        bench.close()
    per_rank: list[Any] = [None] * bench.world
    dist.all_gather_object(
        per_rank,
        [
            {k: r[k] for k in ("kernel", "size_bytes", "backend", "slowdown", "coverage")}
            for r in measured["rows"]
        ],
        group=bench.ctrl,
    )
    probe: dict[str, Any] = {"skipped": "--no-probe"}
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dist.barrier(group=bench.ctrl)
    if not a.no_probe:
        left = a.total_budget_s - (time.monotonic() - bench.t_start)
        if bench.rank == 0:
            probe = run_probe(a, bench.world, max(30.0, min(a.probe_timeout_s, left)))
        dist.barrier(group=bench.ctrl)  # the others wait (gloo, no GPU work) meanwhile
    if bench.rank == 0:
        props = torch.cuda.get_device_properties(bench.dev)
        result = {
            "figure": "sm_contention",
            "device": f"{bench.world}x {props.name}",
            "git_sha": git_sha(a.git_sha),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(),
            "versions": {
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            },
            "env": {k: os.environ.get(k) for k in _SAFE_ENV},
            "method": METHOD,
            "config": vars(a),
            "workload": a.workload,
            "kernels": measured["kernels"],
            "bandwidth_alone": measured["bandwidth_alone"],
            "rows": measured["rows"],
            "rows_source": "rank 0's measurements; every rank's slowdowns in slowdown_by_rank",
            "slowdown_by_rank": per_rank,
            "skipped": bench.skipped,
            "copy_engine_peer_memory": bench.comms["copy_engine"].peer_memory,
            "copy_engine_peer_memory_note": bench.comms["copy_engine"].peer_memory_note,
            "copy_engine_completion": bench.comms["copy_engine"].completion,
            "copy_engine_device_completions": bench.comms["copy_engine"].device_completions,
            "seconds": time.monotonic() - bench.t_start,
            "headline": headline(
                measured["rows"], measured["bandwidth_alone"], int(a.workload_bytes)
            ),
            "nccl_ce_probe": probe,
        }
        validate_result(result)
        files = write_outputs(a.out, result)
        print(json.dumps(result["headline"], indent=1, default=str))
        print("wrote", ", ".join(files), flush=True)
    dist.barrier(group=bench.ctrl)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.smoke:
        return smoke(a)
    if a.probe_nccl_ce:
        return probe_main(a)
    if not torch.cuda.is_available():
        raise SystemExit("sm_contention needs CUDA (use --smoke for the CPU check)")
    return bench_main(a)


if __name__ == "__main__":
    sys.exit(main())
