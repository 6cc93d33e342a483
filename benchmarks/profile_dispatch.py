"""Figure "dispatch_profile": where the Triton ranged dispatch spends its time.

``kernels.json`` measured the tile-sort dispatch (v1, the one training uses) at ~2.4 G
ids/s whatever the world size — 1% of the HBM floor at 2^26 ids. This script splits one
call into its GPU kernels (tile table, per-tile histogram, the torch cumsum scans over
the [tiles, W] count matrix, the sort-and-scatter kernel, segment lengths, the final
key-count sum) with torch.profiler, for v1, v2 and v3 (v1 with the dest-major scan),
at 2^26 ids and at one rank's batch, W in {8, 64, 1024}, so the next kernel design
attacks the stage that dominates.

Usage (one H200, ~1 min):
    PYTHONPATH=src python benchmarks/profile_dispatch.py --out DIR [--git-sha SHA]
CPU smoke check (TRITON_INTERPRET=1, tiny sizes; checks that the script runs):
    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/profile_dispatch.py --out DIR --smoke

Writes DIR/dispatch_profile.json (figure, device, git sha, date, command, rows: one per
(workload, W, version, kernel) with total and per-call device ms, headline: the share of
the largest kernel per (workload, W, version)). Every profiled call's output is first
checked bitwise against the reference.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

from freescale.kernels import reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import git_sha  # noqa: E402
from kernels import block_sizes_for, make_workload, parse_v4_knobs  # noqa: E402

WORLDS = [8, 64, 1024]


def _equal(a, b) -> bool:
    return all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("values", "lengths", "splits", "unbucketize_permute")
    )


def _v4_variant(spec: str, module):
    """``v4:KNOB=VALUE,...`` -> `ranged_dispatch_v4` with those knobs (`parse_v4_knobs`)."""
    name, _, knobs = spec.partition(":")
    if name != "v4" or not knobs:
        raise SystemExit(f"unknown version {spec!r}: v1, v2, v3, v4, v4_columns or v4:K=V,...")
    return partial(module.ranged_dispatch_v4, **parse_v4_knobs(knobs))


def profile_one(fn, device: torch.device, calls: int) -> dict[str, tuple[float, int]]:
    """Device time per kernel name over ``calls`` calls: {name: (total ms, count)}."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()  # compile / warm
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(e, "cuda_time_total", 0.0)
        if device.type == "cuda":
            # kernels only: device-side events have no CPU children; take those with
            # device time and no self CPU time (the launches are CPU events)
            if dev_us <= 0 or e.self_cpu_time_total > 0:
                continue
            out[e.key][0] += dev_us / 1e3
        else:
            if not e.key.startswith(("aten::", "_")) or e.self_cpu_time_total <= 0:
                continue
            out[e.key][0] += e.self_cpu_time_total / 1e3
        out[e.key][1] += e.count
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--git-sha", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument(
        "--versions",
        nargs="+",
        default=["v1", "v2", "v3"],
        help="kernels to profile: v1, v2, v3, v4 (triton_dispatch_v4 at its defaults), "
        "v4_columns (lengths_mode='columns'), or v4:KNOB=VALUE[,KNOB=VALUE...] with "
        "`ranged_dispatch_v4` keyword knobs (e.g. v4:peers=compare,scatter_order=block); "
        "an experimental v4 that fails to compile or disagrees is skipped",
    )
    ap.add_argument("--worlds", type=int, nargs="+", default=None, help=f"default {WORLDS}")
    args = ap.parse_args(argv)
    from freescale.kernels import triton_impl

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        loads = [("per_rank", 4, None), ("large", 8, None)]
        worlds, calls = [8, 64], 1
    else:
        loads = [("per_rank", 128, None), ("large", 8192, 1 << 26)]
        worlds, calls = WORLDS, args.calls
    from freescale.kernels import triton_dispatch_v4

    every = {
        "v1": triton_impl.ranged_dispatch_v1,
        "v2": triton_impl.ranged_dispatch,
        "v3": partial(triton_impl.ranged_dispatch_v1, dest_major=True),
        "v4": partial(triton_dispatch_v4.ranged_dispatch_v4, lengths_mode="rows"),
        "v4_columns": partial(triton_dispatch_v4.ranged_dispatch_v4, lengths_mode="columns"),
    }
    versions = {v: every.get(v) or _v4_variant(v, triton_dispatch_v4) for v in args.versions}
    worlds = args.worlds or worlds
    rows, headline = [], {}
    for name, batch, total in loads:
        wl = make_workload(name, batch, total, device, seed=0, smoke=args.smoke)
        for w in worlds:
            bs = block_sizes_for(w, device)
            ref = reference.ranged_dispatch(wl["values"], wl["lengths"], bs, w)
            for ver, impl in versions.items():
                try:
                    got = impl(wl["values"], wl["lengths"], bs, w)
                except Exception as exc:
                    if not ver.startswith("v4"):
                        raise
                    print(f"SKIPPED {name} W={w} {ver}: {exc!r}"[:400], flush=True)
                    headline[f"{name}_w{w}_{ver}_error"] = repr(exc)[:300]
                    continue
                if not _equal(got, ref):
                    print(f"MISMATCH {name} W={w} {ver}", file=sys.stderr)
                    return 1

                def fn(impl=impl, bs=bs, w=w, wl=wl):
                    return impl(wl["values"], wl["lengths"], bs, w)

                per = profile_one(fn, device, calls)
                total_ms = sum(v[0] for v in per.values()) / calls
                for k, (ms, cnt) in sorted(per.items(), key=lambda kv: -kv[1][0]):
                    rows.append(
                        {
                            "workload": name,
                            "n_ids": wl["n"],
                            "world_size": w,
                            "version": ver,
                            "kernel": k,
                            "ms_per_call": ms / calls,
                            "launches_per_call": cnt / calls,
                            "share": (ms / calls) / total_ms if total_ms > 0 else 0.0,
                        }
                    )
                top = max(per.items(), key=lambda kv: kv[1][0]) if per else ("-", (0.0, 0))
                key = f"{name}_w{w}_{ver}"
                headline[f"{key}_total_ms"] = total_ms
                headline[f"{key}_top_kernel"] = top[0]
                headline[f"{key}_top_share"] = (top[1][0] / calls) / total_ms if total_ms else 0.0
                print(
                    f"{name:8s} W={w:5d} {ver}: {total_ms:8.3f} ms device; top "
                    f"{top[0][:60]} {headline[f'{key}_top_share']:.0%}",
                    flush=True,
                )
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "figure": "dispatch_profile",
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (smoke)",
        "git_sha": git_sha(args.git_sha),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "torch": torch.__version__,
        "rows": rows,
        "headline": headline,
        "notes": "device time per kernel from torch.profiler over `calls` calls after one "
        "warm-up call; outputs checked bitwise against the reference first",
    }
    path = args.out / "dispatch_profile.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
