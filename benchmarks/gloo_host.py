"""How fast gloo moves host tensors between local ranks, and what a wait costs in CPU.

The balancing exchanges (metadata all-gathers, the sample all-to-all) and the
host-staged backend run on gloo groups. On the GPU host the data stage's gloo waits took
22 ms each in a cProfile run and the thread's CPU time exceeded its compute
(`benchmarks/results/gil_data_stage_profile_e756e56.log`), while on the 2-core dev box a
delayed gloo wait costs 0.1 ms of thread CPU. This separates the two questions: per
message size, the wall time of an all-to-all (equal splits, ``all_to_all_single``) and
of an all-gather, and the calling thread's CPU time over the call (``time.thread_time``:
near the wall time means the wait spins; near zero, it sleeps). A second measurement
delays rank 1 by 20 ms before each call, so rank 0's wait is mostly waiting for a peer:
its thread CPU then says whether waiting itself burns a core.

    python benchmarks/gloo_host.py --out DIR [--world 2]

writes ``gloo_host.json`` (figure, device, git sha, date, command, rows, headline:
the latency of a small all-gather and all-reduce — what the copy-engine backend makes
twice per call —, all-to-all GB/s at 4 MB per rank, thread CPU / wall of a delayed
wait). Host timings of
this machine only; no assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _figure import (  # noqa: E402
    git_sha,
    host_figure_header,
    spawn_ranks,
    write_figure,
)

SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]  # bytes sent per rank per call
DELAY_S = 0.02


def _timed(fn: Any, reps: int, rank: int, delay: float) -> tuple[float, float]:
    """Median wall and thread-CPU seconds of ``fn()`` on this rank (after a barrier;
    rank 1 sleeps ``delay`` first)."""
    walls, cpus = [], []
    for _ in range(reps):
        dist.barrier()
        if rank == 1 and delay:
            time.sleep(delay)
        c0, w0 = time.thread_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.thread_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _rank(rank: int, world: int, port: int, q: Any, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    rows = []
    for nbytes in SIZES:
        n = nbytes // 8
        src = torch.ones(n, dtype=torch.int64)
        dst = torch.empty(n, dtype=torch.int64)
        gather_in = torch.ones(max(n // world, 1), dtype=torch.int64)
        gather_out = [torch.empty_like(gather_in) for _ in range(world)]
        ops = {
            "all_to_all": lambda d=dst, s=src: dist.all_to_all_single(d, s),
            "all_to_all_async_wait": lambda d=dst, s=src: dist.all_to_all_single(
                d, s, async_op=True
            ).wait(),
            "all_gather": lambda o=gather_out, i=gather_in: dist.all_gather(o, i),
        }
        for name, fn in ops.items():
            for delay in (0.0, DELAY_S):
                fn()  # warm-up (connections, buffers)
                wall, cpu = _timed(fn, reps, rank, delay)
                rows.append(
                    {
                        "op": name,
                        "bytes_per_rank": nbytes,
                        "peer_delay_ms": delay * 1e3,
                        "wall_ms": wall * 1e3,
                        "thread_cpu_ms": cpu * 1e3,
                        "gb_per_s": (nbytes * (world - 1) / world) / wall / 1e9
                        if delay == 0 and wall > 0
                        else None,
                    }
                )
    # the small collectives a copy-engine call makes (a header all-gather and an error
    # flag all-reduce, comm/copy_engine.py steps 3 and 6): their latency is a floor of
    # that backend's per-call overhead
    small = torch.zeros(16, dtype=torch.int64)
    small_out = [torch.empty_like(small) for _ in range(world)]
    flag = torch.zeros(1, dtype=torch.int64)
    for name, fn in {
        "all_gather_header_16": lambda: dist.all_gather(small_out, small),
        "all_reduce_flag_1": lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX),
        "barrier": lambda: dist.barrier(),
    }.items():
        fn()
        walls, cpus = [], []
        for _ in range(reps * 10):
            c0, w0 = time.thread_time(), time.perf_counter()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.thread_time() - c0)
        rows.append(
            {
                "op": name,
                "bytes_per_rank": int(small.numel() * 8) if "header" in name else 8,
                "peer_delay_ms": 0.0,
                "wall_ms": statistics.median(walls) * 1e3,
                "wall_p90_ms": sorted(walls)[int(0.9 * len(walls))] * 1e3,
                "thread_cpu_ms": statistics.median(cpus) * 1e3,
                "gb_per_s": None,
            }
        )
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for gloo_host.json")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--git-sha", default=os.environ.get("FREESCALE_GIT_SHA"))
    args = ap.parse_args(argv)
    rows = spawn_ranks(_rank, args.world, args.reps)
    for r in rows:
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}))

    def pick(op: str, nbytes: int, delay: float) -> dict[str, Any]:
        return next(
            r
            for r in rows
            if r["op"] == op and r["bytes_per_rank"] == nbytes and r["peer_delay_ms"] == delay
        )

    a2a = pick("all_to_all", 4 << 20, 0.0)
    waited = pick("all_to_all_async_wait", 4 << 20, DELAY_S * 1e3)
    head = {
        "small_all_gather_ms": pick("all_gather_header_16", 128, 0.0)["wall_ms"],
        "small_all_reduce_ms": pick("all_reduce_flag_1", 8, 0.0)["wall_ms"],
        "all_to_all_gb_per_s_4mb": a2a["gb_per_s"],
        "all_to_all_wall_ms_4mb": a2a["wall_ms"],
        "delayed_wait_wall_ms_4mb": waited["wall_ms"],
        "delayed_wait_thread_cpu_ms_4mb": waited["thread_cpu_ms"],
        "delayed_wait_cpu_over_wall": waited["thread_cpu_ms"] / waited["wall_ms"]
        if waited["wall_ms"]
        else None,
    }
    report = {
        **host_figure_header("gloo_host", git_sha(args.git_sha)),
        "python": platform.python_version(),
        "world_size": args.world,
        "method": (
            "per op and size: median over reps of rank 0's wall and thread CPU time of the "
            "call, after a barrier; with peer_delay_ms > 0 rank 1 sleeps that long before "
            "calling (rank 0's time is then mostly waiting); gb_per_s = bytes sent to "
            "peers / wall (no delay); small ops (header all-gather, flag all-reduce, "
            "barrier): back to back, 10x reps, median and p90 wall"
        ),
        "rows": rows,
        "headline": head,
    }
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in head.items()}))
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
