"""Dense model forward/backward timing on one GPU for a long-UIH batch (diagnostics).

PYTHONPATH=src TORCH_LOGS=recompiles python benchmarks/profile_dense.py
"""

from __future__ import annotations

import argparse
import time

import torch

from freescale.config import DataConfig, ModelConfig
from freescale.data.synthetic import SyntheticSource
from freescale.models.sequence import SequenceRecModel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--attention", default="flex")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    dev = torch.device("cuda")
    src = SyntheticSource(
        DataConfig(global_batch_size=128, max_uih=16384, median_uih=1024, num_items=1000)
    )
    m = SequenceRecModel(
        ModelConfig(embedding_dim=128, num_heads=4, attention=a.attention), src.uih_keys
    ).to(dev)
    for it in range(a.iters):
        b = src.global_batch(it).to(dev)
        lengths = b.uih_lengths["uih_item"]
        t = int(lengths.sum())
        x = {k: torch.randn(t, 128, device=dev, requires_grad=True) for k in src.uih_keys}
        c = torch.randn(b.candidates.numel(), 128, device=dev, requires_grad=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = m(x, lengths, c, b.num_candidates)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        out.sum().backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(
            f"iter {it}: tokens {t} fwd {1e3 * (t1 - t0):.1f} ms bwd {1e3 * (t2 - t1):.1f} ms",
            flush=True,
        )
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = m(x, lengths, c, b.num_candidates)
            out.sum().backward()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
