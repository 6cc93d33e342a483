"""Plain NCCL all-to-all microbenchmark (the yardstick for the embedding exchange).

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node 2
benchmarks/nccl_a2a.py --bytes 200000000 --out result.json``. Each rank sends
``--bytes`` in total, split equally over the ranks (the part to itself included, as
the embedding exchange does), fp32. Reports the median time of single calls (each
after a barrier) and the mean of 10 back-to-back calls (no barrier skew inside the
timed region; the headline ``gb_per_s``), as bytes leaving the rank / time, timed
with CUDA events.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, nargs="+", required=True)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    w, r = dist.get_world_size(), dist.get_rank()
    rows = []
    for nbytes in a.bytes:
        n = max(nbytes // 4 // w, 1) * w
        x = torch.randn(n, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        times = []
        for _ in range(a.iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dist.barrier()
            s.record()
            dist.all_to_all_single(y, x)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        ms = statistics.median(times)
        # back-to-back: no barrier skew between ranks inside the timed region
        loop = 10
        dist.barrier()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(loop):
            dist.all_to_all_single(y, x)
        e.record()
        e.synchronize()
        ms_loop = s.elapsed_time(e) / loop
        sent = n * 4 * (w - 1) / w  # bytes leaving this rank
        rows.append(
            {
                "bytes_per_rank": n * 4,
                "bytes_sent_to_peers": sent,
                "median_ms": ms,
                "gb_per_s_single": sent / ms / 1e6 if ms > 0 else float("nan"),
                "back_to_back_ms": ms_loop,
                "gb_per_s": sent / ms_loop / 1e6 if ms_loop > 0 else float("nan"),
            }
        )
    if r == 0:
        print(json.dumps(rows, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"world_size": w, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
