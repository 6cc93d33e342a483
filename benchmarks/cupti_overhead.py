"""Figure "cupti_overhead": the host cost torch.profiler adds to every CUDA launch.

Why: in the e2e report (issue 7) the profiled window of freescale's 2-GPU step is ~10 ms
longer than its unprofiled step, while vanilla's is not, and on one GPU neither is.
freescale's host threads (training, autograd, data stage, copy-engine / NCCL side work)
all call the CUDA runtime, and with ``ProfilerActivity.CUDA`` Kineto traces every
runtime and driver call through CUPTI. This measures, on one GPU, what that tracing
costs per launch on the launching thread: alone, and while side threads keep calling
the runtime as freescale's helper threads do.

Method: the main thread launches ``--launches`` small kernels (an in-place add on a
4 KB tensor) back to back and its host wall time per launch is taken (the GPU never
falls behind: each kernel is ~2 us). Side threads (0 or ``--side-threads``) loop on
their own streams over a 4 KB device-to-device copy, an event record and an event
query, with ``--side-gap-us`` of sleep between iterations. Each configuration is timed
``--reps`` times, profiler off and on (``activities=[CUDA]``, no shapes, no stacks:
what the e2e trainer records) alternating; the median is kept. CUPTI is released when
each profile stops (``TEARDOWN_CUPTI=1``, as the trainer sets it), and an unprofiled
baseline timed before the first profile checks that. Host timing only, nothing
asserted.

    PYTHONPATH=src python benchmarks/cupti_overhead.py --out DIR [--git-sha SHA]

Writes DIR/cupti_overhead.json (figure, device, git_sha, date, command, rows, headline).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from _figure import git_sha


class SideThreads:
    """Threads that keep calling the CUDA runtime on their own streams until stopped."""

    def __init__(self, n: int, gap_us: float, device: torch.device) -> None:
        self.stop = threading.Event()
        self.calls = [0] * n
        self.threads = [
            threading.Thread(target=self._run, args=(i, gap_us, device), daemon=True)
            for i in range(n)
        ]

    def _run(self, i: int, gap_us: float, device: torch.device) -> None:
        stream = torch.cuda.Stream(device)
        src = torch.ones(1024, device=device)
        dst = torch.empty_like(src)
        ev = torch.cuda.Event()
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                dst.copy_(src, non_blocking=True)
                ev.record(stream)
                ev.query()
                self.calls[i] += 1
                if gap_us > 0:
                    time.sleep(gap_us * 1e-6)

    def __enter__(self) -> SideThreads:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def launch_loop(x: torch.Tensor, n: int) -> float:
    """Host microseconds per launch of n back-to-back small kernels (GPU drained after)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1.0)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def measure(x: torch.Tensor, launches: int, profiled: bool) -> float:
    if not profiled:
        return launch_loop(x, launches)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA], record_shapes=False, with_stack=False):
        us = launch_loop(x, launches)
    return us


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--launches", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--side-threads", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--side-gap-us", type=float, default=20.0)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cupti_overhead needs CUDA")
    # release CUPTI when a profile stops, as the trainer does (ensure_cupti_teardown):
    # otherwise its callbacks stay attached and every later "unprofiled" launch pays them
    teardown = os.environ.setdefault("TEARDOWN_CUPTI", "1")
    dev = torch.device("cuda", 0)
    x = torch.zeros(1024, device=dev)
    measure(x, 2000, False)  # warm-up: kernels loaded, allocator primed
    # a baseline before CUPTI was ever attached, against which teardown is checked
    pristine = statistics.median(launch_loop(x, a.launches) for _ in range(a.reps))
    measure(x, 2000, True)  # CUPTI initialised once
    rows = []
    for n_side in a.side_threads:
        samples: dict[bool, list[float]] = {False: [], True: []}
        side_calls = 0
        for _ in range(a.reps):
            for profiled in (False, True):
                with SideThreads(n_side, a.side_gap_us, dev) as side:
                    time.sleep(0.05)  # side threads running before the timed loop
                    samples[profiled].append(measure(x, a.launches, profiled))
                side_calls += sum(side.calls)
        off, on = (statistics.median(samples[p]) for p in (False, True))
        row = {
            "side_threads": n_side,
            "side_gap_us": a.side_gap_us,
            "launches": a.launches,
            "reps": a.reps,
            "us_per_launch_unprofiled": off,
            "us_per_launch_profiled": on,
            "added_us_per_launch": on - off,
            "profiled_over_unprofiled": on / off,
            "samples_us": {"unprofiled": samples[False], "profiled": samples[True]},
            "side_calls_total": side_calls,
        }
        rows.append(row)
        print(
            f"side threads {n_side}: {off:.2f} -> {on:.2f} us per launch "
            f"(+{on - off:.2f}, x{on / off:.2f})",
            flush=True,
        )
    alone = next((r for r in rows if r["side_threads"] == 0), None)
    headline = {
        "added_us_per_launch_alone": alone["added_us_per_launch"] if alone else None,
        # unprofiled launches before any profile vs after profiles (alone): ~1 if CUPTI
        # was released
        "us_per_launch_before_any_profile": pristine,
        "after_profiles_over_before": alone["us_per_launch_unprofiled"] / pristine
        if alone
        else None,
        "added_us_per_launch_by_side_threads": {
            str(r["side_threads"]): r["added_us_per_launch"] for r in rows
        },
        "profiled_over_unprofiled_by_side_threads": {
            str(r["side_threads"]): r["profiled_over_unprofiled"] for r in rows
        },
    }
    out = {
        "figure": "cupti_overhead",
        "device": torch.cuda.get_device_name(dev),
        "git_sha": git_sha(a.git_sha),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(s) for s in sys.argv),
        "torch": torch.__version__,
        "teardown_cupti": teardown,
        "method": __doc__.split("Method: ", 1)[1].split("\n\n", 1)[0].replace("\n", " "),
        "rows": rows,
        "headline": headline,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "cupti_overhead.json"
    path.write_text(json.dumps(out, indent=2))
    print(json.dumps(headline, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
