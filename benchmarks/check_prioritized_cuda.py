"""Tier-1 check on GPUs: prioritized embedding updates (NCCL, side streams) against the
vanilla schedule, bit for bit, for SGD, row-wise Adagrad and Adam; once more with
random delays injected on the side streams so races would show. Vanilla against
vanilla first (tier 1 condition (iv): the baseline itself must be deterministic).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/check_prioritized_cuda.py

Each rank compares its own shard rows, optimizer state and the dense parameters of
the two runs (same rank, same rows); the verdict is all-reduced. Exit 1 on mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from freescale.config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig
from freescale.pipeline.distributed import init_distributed
from freescale.pipeline.trainer import Trainer


def _cfg(kind: str, mode: str, steps: int, device: str) -> TrainConfig:
    return TrainConfig(
        data=DataConfig(
            seed=11,
            global_batch_size=64,
            num_items=5000,
            median_uih=256,
            max_uih=2048,
            overlap=0.3,
            eval_samples=64,
        ),
        model=ModelConfig(embedding_dim=64, num_layers=1, num_heads=2),
        sparse_optim=SparseOptimConfig(kind=kind, lr=0.05 if kind != "adam" else 0.01),
        steps=steps,
        eval_every=0,
        progress=False,
        device=device,
        mode=mode,
        max_collision_rate=1.0,
    )


def _state(tr: Trainer) -> dict[str, torch.Tensor]:
    out = {"weight": tr.sparse.weight.detach().clone()}
    for k, v in tr.sparse.optimizer.state.items():
        out["opt." + k] = v.detach().clone()
    for k, v in tr.dense.state_dict().items():
        out["dense." + k] = v.detach().clone()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--delay-s", type=float, default=2e-3)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: the same check on gloo (smoke)")
    p.add_argument(
        "--nondeterministic", action="store_true", help="do not ask torch for deterministic kernels"
    )
    a = p.parse_args()
    if not a.nondeterministic:  # tier 1 (iv): deterministic kernels on GPU
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    ctx = init_distributed(a.device)
    rows, bad = [], 0
    for kind in ("sgd", "rowwise_adagrad", "adam"):
        ref = Trainer(_cfg(kind, "vanilla", a.steps, a.device), ctx=ctx)
        ref.train()
        want = _state(ref)
        runs = [("vanilla", 0.0), ("prioritized", 0.0), ("prioritized", a.delay_s)]
        for mode, delay in runs if kind == "sgd" else runs[1:]:
            tr = Trainer(_cfg(kind, mode, a.steps, a.device), ctx=ctx)
            if mode == "prioritized":
                tr.sparse.debug_delay_s = delay
            tr.train()
            got = _state(tr)
            diff = [k for k in want if not torch.equal(want[k], got[k])]
            flag = torch.tensor([1.0 if diff else 0.0], device=ctx.device)
            dist.all_reduce(flag)
            ps = dict(vars(tr.sparse.pstats)) if hasattr(tr.sparse, "pstats") else {}
            ps = {k: v for k, v in ps.items() if isinstance(v, (int, float))}
            row = {
                "optimizer": kind,
                "mode": mode,
                "delay_s": delay,
                "bitwise_equal": flag.item() == 0,
                "rank0_mismatched": diff,
                "counters": ps,
                "side_streams": bool(getattr(tr.sparse, "side_streams", False)),
                "prepare_blocks": bool(getattr(tr.sparse, "prepare_blocks", False)),
            }
            rows.append(row)
            bad += int(flag.item() > 0)
            if ctx.rank == 0:
                print(json.dumps(row), flush=True)
    if ctx.rank == 0:
        print("prioritized CUDA check:", "OK" if not bad else f"{bad} MISMATCHES", flush=True)
        if a.out:
            with open(os.path.join(a.out, "prioritized_cuda_check.json"), "w") as f:
                json.dump({"rows": rows, "ok": not bad}, f, indent=1)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
