"""Figure "dispatch_host": is one rank's Triton dispatch bound by the host or the GPU?

``kernels.json`` times one rank's batch (~1M ids) with ``triton.testing.do_bench``; those
times moved 4x between two runs of the same kernels on different device hosts (0.16 ms
at 87e7306, 0.69 ms at a2674e6 for v3 at W=512) while the profiler put v3's kernels at
0.13-0.17 ms and v4's at 0.04-0.08 ms (dispatch_profile.json). This script separates the
two costs for every Triton dispatch version, at W in 8..1024:

- ``host_us``: host time to enqueue one call (a loop of calls without a sync);
- ``gpu_us``: device time per call, measured with the GPU held by ``torch.cuda._sleep``
  while the host enqueues the whole loop, so launches never starve the GPU;
- ``bench_us``: ``do_bench``'s median, as kernels.json measures it;
- ``launches``: kernel launches per call (torch.profiler, one call).

Plus the host cost of the parts a call is made of: an empty Triton kernel launch with
10 arguments, ``torch.empty`` on the device, a small ``torch.cumsum``; on CUDA also the
same kernel through its compiled launcher directly (`_direct_parts`: what a launch cache
of our own could save).

Usage (one H200, ~1 min): ``PYTHONPATH=src python benchmarks/dispatch_host.py --out DIR``
CPU check that it runs: ``TRITON_INTERPRET=1 ... --smoke`` (tiny; times meaningless).
Every version's output is compared bitwise with the reference before it is timed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Optional

import torch
import triton
import triton.language as tl

from freescale.kernels import ops, reference

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import (  # noqa: E402
    figure_header,
    git_sha,
    write_figure,
)
from kernels import block_sizes_for, device_us, enqueue_us, make_workload  # noqa: E402

WORLDS = [8, 32, 128, 512, 1024]
FIELDS = ("values", "lengths", "splits", "key_counts", "unbucketize_permute")


def _bench_us(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e3


def _launches(fn: Callable[[], object]) -> int:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@triton.jit
def _empty_kernel(a, b, c, d, e, f, g, h, n, m, BLOCK: tl.constexpr):
    pass


def _versions():
    from freescale.kernels import triton_dispatch_v4, triton_impl

    return {
        "v3": partial(triton_impl.ranged_dispatch_v1, dest_major=True),
        "v4": triton_dispatch_v4.ranged_dispatch_v4,
        "auto": ops.ranged_dispatch,
    }


def _direct_parts(compiled, bufs, calls: int, device: torch.device) -> dict:
    """What a launch costs without `JITFunction.run`'s argument binding, specialization
    key and cache lookup: the same empty kernel through its compiled launcher
    (``CompiledKernel.run``, Triton 3.6's calling convention: grid, stream, function,
    packed metadata, launch metadata, the two launch hooks, then every argument), and
    the current-stream query each launch makes. Measured to decide whether a launch
    cache of our own would pay; on another Triton the error is recorded instead."""
    from triton.runtime import driver

    def stream():
        return driver.active.get_current_stream(driver.active.get_current_device())

    def direct():
        compiled.run(4, 1, 1, stream(), compiled.function, compiled.packed_metadata,
                     None, None, None, *bufs, 100, 200, 128)  # fmt: skip

    try:
        direct()
        torch.cuda.synchronize(device)
        return {
            "triton_direct_run_10_args_us": enqueue_us(direct, calls, device),
            "triton_current_stream_us": enqueue_us(stream, calls, device),
        }
    except Exception as err:  # noqa: BLE001 - recorded: the convention is Triton 3.6's
        return {"triton_direct_run_error": f"{type(err).__name__}: {err}"[:300]}


def _parts(device: torch.device, calls: int) -> dict[str, float]:
    """Host microseconds of the pieces a dispatch call is made of."""
    bufs = [torch.empty(16, dtype=torch.int64, device=device) for _ in range(8)]
    small = torch.ones(4096, dtype=torch.int32, device=device)

    def launch():
        _empty_kernel[(4,)](*bufs, 100, 200, BLOCK=128)

    compiled = _empty_kernel[(4,)](*bufs, 100, 200, BLOCK=128)
    parts = {}
    if device.type == "cuda":
        parts.update(_direct_parts(compiled, bufs, calls, device))
    return {
        **parts,
        "triton_launch_10_args_us": enqueue_us(launch, calls, device),
        "torch_empty_us": enqueue_us(
            lambda: torch.empty(1024, dtype=torch.int32, device=device), calls, device
        ),
        "torch_cumsum_4096_us": enqueue_us(
            lambda: torch.cumsum(small, 0, dtype=torch.int32), calls, device
        ),
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (interpreter)")
    parser.add_argument("--calls", type=int, default=50, help="calls per timing loop")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    worlds = [8, 1024] if args.smoke else WORLDS
    calls = 2 if args.smoke else args.calls
    wl = make_workload("per_rank", 8 if args.smoke else 128, None, device, 0, args.smoke)
    versions = _versions()
    rows = []
    for world in worlds:
        blocks = block_sizes_for(world, device)
        ref = reference.ranged_dispatch(wl["values"], wl["lengths"], blocks, world)
        for name, impl in versions.items():
            fn = partial(impl, wl["values"], wl["lengths"], blocks, world)
            got = fn()
            for field in FIELDS:
                if not torch.equal(getattr(ref, field).cpu(), getattr(got, field).cpu()):
                    raise SystemExit(f"MISMATCH {name} W={world}: {field} differs")
            row = {"world_size": world, "version": name, "n_ids": wl["n"]}
            row["host_us"] = enqueue_us(fn, calls, device)
            if cuda:
                row["gpu_us"], row["sleep_covered"] = device_us(fn, calls, row["host_us"])
                row["bench_us"] = _bench_us(fn)
                row["launches"] = _launches(fn)
                row["host_over_gpu"] = row["host_us"] / row["gpu_us"]
            if name == "auto":
                row["auto_version"] = ops.triton_dispatch_version(wl["n"], world)
            print(row, flush=True)
            rows.append(row)
    parts = _parts(device, 200 if cuda else 2)
    print(parts)
    report = figure_header("dispatch_host", git_sha(args.git_sha))
    report["command"] = " ".join(["python", *(sys.argv if argv is None else ["", *argv])])
    report["smoke"] = args.smoke
    report["config"] = {"workload": "per_rank", "calls_per_loop": calls, "worlds": worlds}
    report["rows"] = rows
    report["parts_host_us"] = parts

    def pick(version: str, world: int, key: str) -> Optional[float]:
        for r in rows:
            if r["version"] == version and r["world_size"] == world:
                return r.get(key)
        return None

    report["headline"] = {
        f"{v}_{k}_w{w}": pick(v, w, k)
        for v in ("v3", "v4")
        for w in (worlds[0], worlds[-1])
        for k in ("host_us", "gpu_us")
    }
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
