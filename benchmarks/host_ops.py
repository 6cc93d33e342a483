"""Figure "host_ops": PyTorch ops the host issues per step in the embedding collection,
vanilla vs prioritized, by the innermost FreeScale frame that issued them.

A CPU proxy for the launch load `cupti_overhead` and `trace_host.py` measure on the GPU
(every op there is at least one CUDA API call): it needs no GPU and counts, so it can
compare two commits on any machine. One process (world size 1, gloo not needed), the
collection alone with a small random batch per step (the layout of
tests/test_prioritized.py's single-process test: 2 tables, 3 features, collisions every
step), SGD, counted with a ``TorchDispatchMode`` over steps 3..10 (after warm-up, before
the last look-ahead), with the CPU's default sparse update (sync) and with "ahead" (the
CUDA default: row groupings started early). On CPU the ops are the reference paths; on
CUDA several of them are single Triton launches, so the counts rank the call sites, they
are not the GPU's.

Usage: ``python benchmarks/host_ops.py --out DIR [--git-sha SHA]``; to compare commits,
run it with ``PYTHONPATH=<a commit's src>`` (it uses only the collection's public
constructor and call). Writes DIR/host_ops.json.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import host_figure_header, write_figure  # noqa: E402

FIRST, LAST = 3, 10  # counted steps (inclusive)


class _OpCounter(TorchDispatchMode):
    """Counts every dispatched op by its innermost ``freescale/`` frame."""

    def __init__(self) -> None:
        super().__init__()
        self.by_frame: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        frame = "(no freescale frame)"
        for f in reversed(traceback.extract_stack()):
            if "/freescale/" in f.filename:
                frame = f"{f.filename.split('/freescale/', 1)[1]}:{f.name}"
                break
        self.by_frame[frame] += 1
        return func(*args, **(kwargs or {}))


def _features(step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (3,), generator=g)
    n = int(lengths.sum())
    return {
        "uih": (torch.randint(0, 50, (n,), generator=g) % 13, lengths),
        "act": (torch.randint(0, 3, (n,), generator=g), lengths),
        "cand": (torch.randint(0, 50, (6,), generator=g), torch.full((3,), 2)),
    }


def count(prioritized: bool, update: str = "auto", steps: int = LAST + 2) -> _OpCounter:
    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig, TableConfig
    from freescale.embedding.collection import ShardedEmbeddingCollection
    from freescale.embedding.prioritized import PrioritizedEmbeddingCollection

    tables = [TableConfig("item", 50, 4, ["uih", "cand"]), TableConfig("act", 3, 4, ["act"])]
    cls = PrioritizedEmbeddingCollection if prioritized else ShardedEmbeddingCollection
    opts: dict[str, Any] = {"max_collision_rate": 1.0} if prioritized else {}
    emb = cls(tables, Communicator(None), SparseOptimConfig("sgd", lr=0.1), seed=3, **opts)
    emb.sparse_update = update  # "ahead": the CUDA default (groupings started early)
    counter = _OpCounter()
    for t in range(1, steps + 1):
        emb.set_step(t, 0.1 / t)
        if t == FIRST:
            counter.__enter__()
        nxt = _features(t + 1) if prioritized and t < steps else None
        out = emb(_features(t), next_features=nxt) if prioritized else emb(_features(t))
        g = torch.Generator().manual_seed(1000 + t)
        sum((o * torch.randn(o.shape, generator=g)).sum() for o in out.values()).backward()
        if t == LAST:
            counter.__exit__(None, None, None)
    return counter


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    steps = LAST - FIRST + 1
    rows = []
    per_step = {}
    variants = (
        ("vanilla", False, "auto"),
        ("prioritized", True, "auto"),
        ("vanilla_ahead", False, "ahead"),
        ("prioritized_ahead", True, "ahead"),
    )
    for name, prioritized, update in variants:
        c = count(prioritized, update)
        total = sum(c.by_frame.values()) / steps
        per_step[name] = total
        print(f"{name}: {total:.1f} ops per step")
        for frame, n in c.by_frame.most_common(args.top):
            rows.append({"variant": name, "frame": frame, "ops_per_step": n / steps})
            print(f"  {n / steps:7.1f}  {frame}")
    report = host_figure_header("host_ops", args.git_sha)
    report["config"] = {"counted_steps": [FIRST, LAST], "world_size": 1, "optimizer": "sgd"}
    report["rows"] = rows
    report["headline"] = {f"{name}_ops_per_step": v for name, v in per_step.items()}
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
