"""Per-call host overhead of the copy-engine backend, by handshake (gloo vs shared memory).

A copy-engine collective makes two handshakes (a header all-gather before the copies, a
completion-flag all-reduce after them; comm/copy_engine.py steps 3 and 6). With gloo
they are two gloo collectives; with ``handshake="shm"`` they go through one
shared-memory file (comm/shm_exchange.py). This times back-to-back small all-to-alls
(4,096 x 16 float32 per rank, so the copies are negligible) on 2 ranks of this host, per
handshake: wall ms per call and the share spent in the two handshakes.

    python benchmarks/copy_engine_call.py --out DIR [--device cpu|cuda]

writes ``copy_engine_call.json`` (figure, device, git sha, date, command, rows,
headline: ms per call with each handshake and their ratio). On CPU the backend runs its
``host_shm`` peer memory (the same protocol); on CUDA symmetric memory. Host timings of
this machine only; no assertion anywhere.
"""

from __future__ import annotations

import argparse
import os
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


def _rank(rank: int, world: int, port: int, q: Any, device: str, calls: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from freescale.comm import copy_engine as ce

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    spent = {"header": 0.0, "completion": 0.0}

    def timed(fn: Any, key: str) -> Any:
        def wrapper(self: Any, *a: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(self, *a)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    cls = ce.CopyEngineCommunicator
    cls._gather_header = timed(cls._gather_header, "header")  # type: ignore[method-assign]
    cls._agree = timed(cls._agree, "completion")  # type: ignore[method-assign]
    rows = []
    x = torch.randn(4096, 16, device=dev)
    splits = [4096 // world] * world
    for handshake in ("gloo", "shm"):
        cfg = ce.CopyEngineConfig(handshake=handshake, timeout_s=120)
        comm = ce.CopyEngineCommunicator.create(None, f"bench_{handshake}", cfg, device=dev)
        for _ in range(30):
            comm.all_to_all_v(x, splits, splits).wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()
        spent["header"] = spent["completion"] = 0.0
        t = time.perf_counter()
        for _ in range(calls):
            comm.all_to_all_v(x, splits, splits).wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t
        rows.append(
            {
                "handshake": comm.handshake,
                "calls": calls,
                "ms_per_call": wall / calls * 1e3,
                "header_ms_per_call": spent["header"] / calls * 1e3,
                "completion_ms_per_call": spent["completion"] / calls * 1e3,
            }
        )
        comm.close()
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for copy_engine_call.json")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--git-sha", default=os.environ.get("FREESCALE_GIT_SHA"))
    args = ap.parse_args(argv)
    rows = spawn_ranks(_rank, 2, args.device, args.calls)
    by = {r["handshake"]: r for r in rows}
    head = {
        "ms_per_call_gloo": by["gloo"]["ms_per_call"],
        "ms_per_call_shm": by.get("shm", {}).get("ms_per_call"),
        "gloo_over_shm": by["gloo"]["ms_per_call"] / by["shm"]["ms_per_call"]
        if "shm" in by
        else None,
        "handshake_share_gloo": (
            by["gloo"]["header_ms_per_call"] + by["gloo"]["completion_ms_per_call"]
        )
        / by["gloo"]["ms_per_call"],
    }
    report = {
        **host_figure_header("copy_engine_call", git_sha(args.git_sha)),
        "backend_device": args.device,
        "workload": "2 ranks, all_to_all_v of 4096 x 16 float32 per rank, equal splits",
        "rows": rows,
        "headline": head,
    }
    if args.device == "cuda":
        report["device"] = torch.cuda.get_device_name(0)
    for r in rows:
        print(r)
    print(head)
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
