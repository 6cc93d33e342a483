"""Figure "balance_host": the host cost of one balancing step, per partitioner.

The balancer runs on the data-stage thread, on the host, beside a training thread that
is the bottleneck on the GPU host (BENCHMARKS.md ``e2e``): every ms of CPU it needs,
and every parallel region it starts, competes with the step. This measures that cost on
2 gloo ranks with the GPU default workload (128 samples per rank, max UIH 16K, median
1K, 1M items, Zipf s=0.6): for each partitioner, the thread CPU time and wall time per
batch of ``BalanceCoordinator.balance`` (metadata all-gathers, plan, sample
all-to-all; the synthetic loader is outside the timed region), the samples moved per
batch and the predicted straggler share before and after the plan. One intra-op
thread, so the CPU time is the work, not a thread team's.

    python benchmarks/balance_host.py --out benchmarks/results [--partitioners fbs sticky]

Run it against another tree's code with ``PYTHONPATH=<tree>/src`` (the A/B of a change
in the coordinator: the script itself only uses the public API). Writes
``balance_host.json`` (figure, device, git sha, date, command, rows, headline). Host
timings of this machine only; no assertion on them anywhere.
"""

from __future__ import annotations

import argparse
import os
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


def _rank(
    rank: int, world: int, port: int, q: Any, partitioners: list[str], batches: int, src: str
) -> None:
    if src:  # the code under test (a fresh spawned process: nothing imported yet)
        sys.path.insert(0, src)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import freescale
    from freescale.balance.coordinator import BalanceCoordinator, CoordinatorConfig
    from freescale.balance.planner import BalanceConfig, Planner
    from freescale.comm.base import Communicator
    from freescale.config import DataConfig
    from freescale.data.synthetic import SyntheticSource

    d = DataConfig(global_batch_size=128 * world, seed=0, zipf_s=0.6)
    d.num_items, d.max_uih, d.median_uih = 1_000_000, 16_384, 1024
    src = SyntheticSource(d)
    comm = Communicator(dist.new_group(backend="gloo"), name="balance")
    rows = []
    for name in partitioners:
        planner = Planner(BalanceConfig(partitioner=name), world, rank)
        coord = BalanceCoordinator(comm, planner, CoordinatorConfig(max_local_samples=128))
        local = [src.local_batch(s, rank, world) for s in range(batches + 3)]
        for s in range(3):  # warm-up
            coord.balance(local[s])
        dist.barrier()
        cpu, wall, moved, before, after, sent, plan_ms = [], [], [], [], [], [], []
        for s in range(3, batches + 3):
            c0, w0 = time.thread_time(), time.perf_counter()
            _, plan = coord.balance(local[s])
            cpu.append(time.thread_time() - c0)
            wall.append(time.perf_counter() - w0)
            moved.append(plan.samples_moved)
            before.append(plan.straggler_before)
            after.append(plan.straggler_after)
            sent.append(coord.last_stats.samples_sent)
            plan_ms.append(plan.planning_ms)
        rows.append(
            {
                "partitioner": name,
                "rank": rank,
                "batches": batches,
                "cpu_ms_per_batch": 1e3 * statistics.mean(cpu),
                "cpu_ms_median": 1e3 * statistics.median(cpu),
                "wall_ms_per_batch": 1e3 * statistics.mean(wall),
                "planning_ms_per_batch": statistics.mean(plan_ms),
                "samples_per_batch": 128 * world,
                "samples_moved_per_batch": statistics.mean(moved),
                "samples_sent_by_rank_per_batch": statistics.mean(sent),
                "straggler_share_home": statistics.mean(before),
                "straggler_share_planned": statistics.mean(after),
            }
        )
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        q.put({"rows": [r for rs in gathered for r in rs], "code": freescale.__file__})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for balance_host.json")
    ap.add_argument("--partitioners", nargs="+", default=["fbs", "sticky"])
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2, help="A B / B A ... over --code")
    ap.add_argument(
        "--code",
        action="append",
        default=None,
        metavar="NAME=SRC[:PARTITIONER,...]",
        help="code under test: a name, its src folder, optionally its partitioners "
        "(default: this tree's src with --partitioners); repeat for an A/B in one run",
    )
    ap.add_argument("--git-sha", default=os.environ.get("FREESCALE_GIT_SHA"))
    a = ap.parse_args(argv)
    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    codes = []
    for spec in a.code or [f"this tree={here}"]:
        name, _, rest = spec.partition("=")
        path, _, parts = rest.partition(":")
        codes.append((name, path, parts.split(",") if parts else a.partitioners))
    rows = []
    for p in range(a.passes):
        for name, path, parts in codes if p % 2 == 0 else codes[::-1]:
            res = spawn_ranks(_rank, a.world, parts, a.batches, path)
            for r in res["rows"]:
                rows.append({**r, "code": name, "code_path": res["code"], "pass": p})
    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["code"], r["partitioner"]), []).append(r)
    headline: dict[str, Any] = {}
    for (code, part), rs in by.items():
        key = f"{code}:{part}"
        headline[f"{key}:cpu_ms_per_batch"] = statistics.median(r["cpu_ms_per_batch"] for r in rs)
        headline[f"{key}:wall_ms_per_batch"] = statistics.median(r["wall_ms_per_batch"] for r in rs)
        headline[f"{key}:samples_moved_per_batch"] = rs[0]["samples_moved_per_batch"]
        headline[f"{key}:straggler_share_planned"] = rs[0]["straggler_share_planned"]
    first = codes[0][0]
    for code, part in by:  # A/B in one run: each code's CPU over the first code's
        base = headline.get(f"{first}:{part}:cpu_ms_per_batch")
        if code != first and base:
            cpu = headline[f"{code}:{part}:cpu_ms_per_batch"]
            headline[f"{code}:{part}:cpu_ratio_vs_{first}"] = cpu / base
    report = {
        **host_figure_header("balance_host", git_sha(a.git_sha)),
        "workload": "2 gloo ranks x 128 samples, max UIH 16K, median 1K, 1M items, Zipf 0.6",
        "rows": rows,
        "headline": headline,
    }
    for r in rows:
        print(
            f"{r['code'][-24:]:>24} pass {r['pass']} {r['partitioner']:>8} rank {r['rank']}: "
            f"cpu {r['cpu_ms_per_batch']:6.2f} ms/batch, wall {r['wall_ms_per_batch']:6.2f}, "
            f"plan {r['planning_ms_per_batch']:5.2f}, "
            f"moved {r['samples_moved_per_batch']:6.1f} of {r['samples_per_batch']}, "
            f"straggler {r['straggler_share_home']:.3f} -> {r['straggler_share_planned']:.3f}"
        )
    write_figure(a.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
