"""Where the GPU waits for the host: bubble time attributed to the training thread's
Python frames, from a Chrome trace written with stacks.

Run a profiled training with stacks, then this script on one rank's trace::

    FREESCALE_PROFILE_STACK=1 python -m freescale.cli train --device cuda --nproc 2 \
        --steps 40 --profile-steps 5 --trace-dir DIR --mode freescale
    python benchmarks/trace_host.py DIR/trace_rank0.json --steps 5

Method: the GPU's busy time is the union of kernels, memcpys and memsets on the device
(every stream, communication included); every gap in it is a bubble. Each gap is sampled
every 50 us and each sample is charged to what the training thread (the one that opened
``freescale/forward``) was doing at that instant: its innermost ``freescale`` frame (and
that frame's caller), or "(no python frame)"; then by each host thread's innermost op.
Host load: per thread (autograd's device thread runs the backward), the time in
top-level ops ("busy"), the part of it blocked in CUDA synchronize / memcpy calls, and
the rest ("work": what the host really computes), also per top-level op; the
blocking calls themselves by Python frame; and every CUDA runtime / driver call (the
launch load) by thread and Python frame. All in milliseconds per profiled step. A
diagnostic, not a figure: it writes nothing but stdout.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_BLOCKING = ("Synchronize", "cudaMemcpy")
SAMPLE_US = 50.0


def gaps(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Gaps between the merged busy intervals (first start to last end)."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] > a[1]]


def stacks_at(frames: Sequence[dict], times: Sequence[float]) -> list[list[dict]]:
    """The properly nested events containing each time (outermost first); one sweep."""
    order = sorted(range(len(times)), key=lambda i: times[i])
    evs = sorted(frames, key=lambda e: (e["ts"], -e["dur"]))
    out: list[list[dict]] = [[] for _ in times]
    stack: list[dict] = []
    j = 0
    for i in order:
        t = times[i]
        while j < len(evs) and evs[j]["ts"] <= t:
            e = evs[j]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            stack.append(e)
            j += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] <= t:
            stack.pop()
        out[i] = [e for e in stack if e["ts"] + e["dur"] > t]
    return out


def label(stack: list[dict]) -> str:
    """Innermost freescale frame and its caller; else the innermost frame."""
    ours = [e["name"] for e in stack if "freescale" in e["name"]]
    if ours:
        return " < ".join(reversed(ours[-2:]))
    return stack[-1]["name"] if stack else "(no python frame)"


def launch_sites(events: list[dict], main_tid: tuple, steps: int) -> list[tuple[str, float]]:
    """CUDA runtime and driver calls per step (the launch load the profiler traces, see
    benchmarks/cupti_overhead.py), by host thread and the innermost freescale frame of
    that thread at the call (`label`), most first."""
    calls: dict[int, list[dict]] = defaultdict(list)
    frames: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("pid") != main_tid[0]:
            continue
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            calls[e["tid"]].append(e)
        elif e.get("cat") == "python_function":
            frames[e["tid"]].append(e)
    out: dict[str, float] = defaultdict(float)
    for tid, cs in calls.items():
        tag = "main" if tid == main_tid[1] else f"tid {tid}"
        for st in stacks_at(frames.get(tid, []), [e["ts"] for e in cs]):
            out[f"{tag}: {label(st)}"] += 1.0 / steps
    return sorted(out.items(), key=lambda kv: -kv[1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--steps", type=int, required=True, help="profiled steps in the trace")
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    events = [e for e in json.load(open(a.trace))["traceEvents"] if e.get("ph") == "X"]
    main_tid = next((e["pid"], e["tid"]) for e in events if e.get("name") == "freescale/forward")
    on_main = [e for e in events if (e.get("pid"), e.get("tid")) == main_tid]
    frames = [e for e in on_main if e.get("cat") == "python_function"]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _GPU_CATS]
    holes = gaps(gpu)
    samples = [
        s + SAMPLE_US * (k + 0.5) for s, e in holes for k in range(int((e - s) // SAMPLE_US))
    ]
    per = a.steps * 1000.0
    bubble: dict[str, float] = defaultdict(float)
    for st in stacks_at(frames, samples):
        bubble[label(st)] += SAMPLE_US / per
    # the other host threads of this process (autograd's device thread runs backward)
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function") and e.get("pid") == main_tid[0]:
            threads[(e["tid"], e["cat"])].append(e)
    per_thread: dict[str, float] = defaultdict(float)
    for (tid, cat), evs in threads.items():
        tag = "main" if tid == main_tid[1] else f"tid {tid}"
        for st in stacks_at(evs, samples):
            if cat == "cpu_op":
                per_thread[f"{tag} op: {st[-1]['name'] if st else '(idle)'}"] += SAMPLE_US / per
            elif tag != "main":
                per_thread[f"{tag} py: {label(st)}"] += SAMPLE_US / per
    # blocking CUDA runtime calls (synchronize, memcpy) on every thread of the process:
    # "busy" below counts them; "work" subtracts them (what the host really computes)
    blocking: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if (
            e.get("cat") == "cuda_runtime"
            and e.get("pid") == main_tid[0]
            and any(x in e["name"] for x in _BLOCKING)
        ):
            blocking[e["tid"]].append((e["ts"], e["dur"]))
    busy: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    by_top: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for (tid, cat), evs in threads.items():
        if cat != "cpu_op":
            continue
        tag = "main" if tid == main_tid[1] else f"tid {tid}"
        top = [e for e, st in zip(evs, stacks_at(evs, [e["ts"] for e in evs])) if len(st) <= 1]
        waits = sorted(blocking.get(tid, []))
        starts = [w[0] for w in waits]
        for e in top:  # e.g. "autograd::engine::evaluate_function: MmBackward0"
            lo = bisect.bisect_left(starts, e["ts"])
            hi = bisect.bisect_left(starts, e["ts"] + e["dur"])
            waited = sum(d for _, d in waits[lo:hi])
            busy[tag][0] += e["dur"] / per
            busy[tag][1] += waited / per
            b = by_top[f"{tag}: {e['name'][:90]}"]
            b[0] += e["dur"] / per
            b[1] += waited / per
            b[2] += 1
    total = sum(e - s for s, e in holes) / per
    print(f"GPU gaps: {len(holes)} totalling {total:.2f} ms/step; sampled {len(samples)} points")
    print("the gaps by the training thread's innermost freescale frame:")
    for name, ms in sorted(bubble.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"  {ms:7.2f} ms/step  {name}")
    print("the same gaps by each host thread's innermost op (or its Python frames):")
    shown = {k: v for k, v in per_thread.items() if "(idle)" not in k and "faults.py" not in k}
    for name, ms in sorted(shown.items(), key=lambda kv: -kv[1])[: 2 * a.top]:
        print(f"  {ms:7.2f} ms/step  {name}")
    print("host threads, top-level ops (ms/step): busy, of which blocked in CUDA syncs/copies")
    for tag, (ms, waited) in sorted(busy.items(), key=lambda kv: -kv[1][0]):
        print(f"  {tag}: busy {ms:.2f}, blocked {waited:.2f}, work {ms - waited:.2f}")
    print("host work per thread by top-level op (ms/step busy, blocked, calls/step):")
    for name, (ms, waited, n) in sorted(by_top.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"  {ms:7.2f} {waited:6.2f} {n / a.steps:6.1f}/step  {name}")
    blocked: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for tid in {e["tid"] for e in events if e.get("pid") == main_tid[0]}:
        calls = [
            e
            for e in events
            if e.get("pid") == main_tid[0]
            and e["tid"] == tid
            and e.get("cat") == "cuda_runtime"
            and any(b in e["name"] for b in _BLOCKING)
        ]
        if not calls:
            continue
        tag = "main" if tid == main_tid[1] else f"tid {tid}"
        mine = threads.get((tid, "python_function"), [])
        mids = [e["ts"] + e["dur"] / 2 for e in calls]
        for e, st in zip(calls, stacks_at(mine, mids)):
            b = blocked[f"{tag}: {e['name']} @ {label(st)}"]
            b[0] += e["dur"] / per
            b[1] += 1
    print("host-blocking CUDA runtime calls per thread (ms/step, calls/step):")
    for name, (ms, n) in sorted(blocked.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"  {ms:7.2f} ms/step {n / a.steps:5.1f}/step  {name}")
    print("CUDA runtime / driver calls per step by thread and innermost freescale frame:")
    for name, n in launch_sites(events, main_tid, a.steps)[: a.top]:
        print(f"  {n:7.1f}/step  {name}")
    ranges: dict[str, float] = defaultdict(float)
    for e in on_main:
        if e.get("cat") == "user_annotation" and e["name"].startswith("freescale/"):
            ranges[e["name"]] += e["dur"] / per
    print("host time per range:", {k: round(v, 2) for k, v in sorted(ranges.items())})


if __name__ == "__main__":
    main()
