"""How long the data stage's work holds the interpreter lock (host diagnostic).

The data-stage thread (pipeline/data_stage.py) makes the batches of steps t+1 / t+2 while
the training thread drives step t; both are Python threads of one process, so whenever
the data stage runs Python code (or a C call that keeps the lock) the training thread's
next launches wait. This measures that wait directly: each of 2 gloo ranks runs the
data-stage work on a background thread — the synthetic loader alone, the loader plus
FBS balancing (metadata all-gathers, plan, sample all-to-all; FBS was freescale's
balancer when this was measured, sticky on the refitted cost model since session 17,
which moves far fewer samples), and that plus the
host-side id counts per owner (`kernels.reference.owner_counts`, what `host_counts`
runs; "counts_old": the owner_and_local path it replaced, for the A/B) — for the GPU default
workload (128 samples per rank, max UIH 16K, median 1K, 1M items, Zipf s=0.6), while a
:class:`~freescale.metrics.host_cpu.GilProbe` on the main thread records how late it
wakes every 1 ms. A lateness near the switch interval (5 ms by default) means the work
holds the lock for long stretches; near the OS timer's slack (~0.1 ms), it releases it.
Caveat: lateness also counts waiting for a free core. With two ranks, each with a busy
data thread and gloo's threads, a 2-core machine has more runnable threads than cores,
and the probe then measures the scheduler as much as the lock (a shorter switch
interval not helping is the sign); on the GPU host (16 cores per GPU) it is the lock.

    python benchmarks/gil_data_stage.py --out benchmarks/results

``--profile`` runs loader+fbs+counts alone under cProfile (rank 0) and prints where the
data stage's CPU goes (no figure). Otherwise it writes ``gil_data_stage.json`` (figure,
device, git sha, date, command, rows, headline): per (work, switch interval) the probe's
wake count, mean, p50 / p90 / p99 / max lateness and the share of wakes over 1 ms, plus
the work's thread CPU and wall per batch. Host timings of this machine only; no
assertion anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
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
    rank: int,
    world: int,
    port: int,
    q: Any,
    work: str,
    switch_ms: float | None,
    batches: int,
    profile: bool = False,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    if switch_ms is not None:
        sys.setswitchinterval(switch_ms / 1e3)
    from freescale.balance.coordinator import BalanceCoordinator, CoordinatorConfig
    from freescale.balance.planner import BalanceConfig, Planner
    from freescale.comm.base import Communicator
    from freescale.config import DataConfig
    from freescale.data.synthetic import SyntheticSource
    from freescale.metrics.host_cpu import GilProbe

    d = DataConfig(global_batch_size=128 * world, seed=0, zipf_s=0.6)
    d.num_items, d.max_uih, d.median_uih = 1_000_000, 16_384, 1024
    src = SyntheticSource(d)
    comm = Communicator(dist.new_group(backend="gloo"), name="balance")
    planner = Planner(BalanceConfig(partitioner="fbs"), world, rank)
    coord = BalanceCoordinator(comm, planner, CoordinatorConfig(max_local_samples=128))
    from freescale.kernels.reference import owner_and_local, owner_counts

    # row-wise blocks as the GPU default's tables have them (items 1M rows, actions few)
    blocks = {"uih_item": -(-d.num_items // world), "uih_action": -(-d.num_actions // world)}

    def counts(b: Any, old: bool) -> None:
        feats = [(b.uih[k], blocks[k]) for k in b.uih] + [(b.candidates, blocks["uih_item"])]
        for v, blk in feats:
            if old:
                keys = torch.zeros(1, dtype=torch.int64).expand(v.numel())
                owner, _ = owner_and_local(v, keys, torch.tensor([blk]), world, "block")
                torch.bincount(owner, minlength=world)
            else:
                owner_counts(v, blk, world)

    def one(s: int) -> None:
        b = src.local_batch(s, rank, world)
        if work != "loader":
            b, _ = coord.balance(b)
        if work.endswith("counts"):
            counts(b, old=False)
        elif work.endswith("counts_old"):
            counts(b, old=True)

    for s in range(3):  # warm-up outside the window
        one(s)
    dist.barrier()
    cpu: list[float] = []

    prof_text: list[str] = []

    def run() -> None:
        prof = None
        if profile and rank == 0:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        c0 = time.thread_time()
        for s in range(3, 3 + batches):
            one(s)
        cpu.append(time.thread_time() - c0)
        if prof is not None:
            import io
            import pstats

            prof.disable()
            buf = io.StringIO()
            st = pstats.Stats(prof, stream=buf)
            st.sort_stats("tottime").print_stats(25)
            st.sort_stats("cumulative").print_stats(25)
            prof_text.append(buf.getvalue())

    probe = GilProbe(1.0)
    probe.start()
    t0 = time.perf_counter()
    th = threading.Thread(target=run, name="freescale-data-stage-probe")
    th.start()
    th.join()
    wall = time.perf_counter() - t0
    stats = probe.stop() or {}
    if rank == 0:
        q.put(
            {
                "work": work,
                "switch_interval_ms": switch_ms if switch_ms is not None else 5.0,
                "batches": batches,
                "work_cpu_ms_per_batch": cpu[0] / batches * 1e3,
                "work_wall_ms_per_batch": wall / batches * 1e3,
                **{f"gil_{k}": v for k, v in stats.items()},
                **({"profile": prof_text[0]} if prof_text else {}),
            }
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for gil_data_stage.json")
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--git-sha", default=os.environ.get("FREESCALE_GIT_SHA"))
    ap.add_argument(
        "--profile",
        action="store_true",
        help="only loader+fbs+counts, under cProfile on rank 0's work thread: prints the "
        "top functions by own and cumulative time (CPU-time attribution of the data stage; "
        "writes no figure)",
    )
    args = ap.parse_args(argv)
    rows = []
    works = [("loader", None), ("loader", 0.5), ("loader+fbs", None), ("loader+fbs", 0.5)]
    works += [("loader+fbs+counts", None), ("loader+fbs+counts_old", None)]
    if args.profile:
        works = [("loader+fbs+counts", None)]
    for work, sw in works:
        row = spawn_ranks(_rank, 2, work, sw, args.batches, args.profile, timeout=600)
        if "profile" in row:
            print(row.pop("profile"), flush=True)
        rows.append(row)
        print(
            json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
            flush=True,
        )
    if args.profile:
        return 0
    cpu = {(r["work"], r["switch_interval_ms"]): r["work_cpu_ms_per_batch"] for r in rows}
    head: dict[str, Any] = {
        "fbs_cpu_ms_per_batch": cpu[("loader+fbs", 5.0)] - cpu[("loader", 5.0)],
        "counts_cpu_ms_per_batch": cpu[("loader+fbs+counts", 5.0)] - cpu[("loader+fbs", 5.0)],
        "counts_old_cpu_ms_per_batch": cpu[("loader+fbs+counts_old", 5.0)]
        - cpu[("loader+fbs", 5.0)],
    }
    head |= {
        f"{r['work']}_switch{r['switch_interval_ms']:g}ms_gil_p99_ms": r.get("gil_p99_ms")
        for r in rows
    }
    report = {
        **host_figure_header("gil_data_stage", git_sha(args.git_sha)),
        "caveat": (
            "lateness = waiting for the interpreter lock + waiting for a free core; with "
            f"{os.cpu_count()} cores and 2 ranks of busy threads the second may dominate"
        ),
        "rows": rows,
        "headline": head,
    }
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
