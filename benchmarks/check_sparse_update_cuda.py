"""The sparse update on CUDA: ahead (the CUDA default) and padded vs synchronous.

Applies the same random gradient steps to three single-rank collections on the GPU:
``sync`` (``group_rows`` reads the row count back), ``padded`` (``group_rows_padded``,
one slot per id, no read-back) and ``ahead`` (``group_rows_start`` issued before the
queued load, as the forward does, and finished in the update), for SGD, row-wise Adagrad
and Adam at the end-to-end workload's size (one rank's ~435K ids per step, dim 128, Zipf
rows plus a 4-row table's long segments); checks weights and optimizer state bitwise
against ``sync``, times one update each way behind a queued GPU load (a 30 ms matmul
chain: the synchronous one makes the host wait for the load, the others do not), and
the GPU time of one update each way with nothing queued (CUDA events: what padding costs
the device). Writes ``OUT/sparse_update.json``; exits 1 on a mismatch::

    PYTHONPATH=src python benchmarks/check_sparse_update_cuda.py --out DIR --git-sha SHA
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import figure_header  # noqa: E402

MODES = ("sync", "padded", "ahead")  # sync first: the reference


def _collection(kind: str, rows: int, dim: int, device: str):
    from freescale.comm.base import Communicator
    from freescale.config import SparseOptimConfig, TableConfig
    from freescale.embedding.collection import ShardedEmbeddingCollection

    tables = [TableConfig("item", rows, dim, ["item"]), TableConfig("action", 4, dim, ["act"])]
    cfg = SparseOptimConfig(kind=kind, lr=0.05)
    return ShardedEmbeddingCollection(
        tables, Communicator(None, name="check"), cfg, device=device, seed=1
    )


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _keys(n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    w = torch.arange(1, rows + 1, dtype=torch.float64).pow(-0.6)
    item = torch.multinomial(w, n, replacement=True, generator=gen)
    act = rows + torch.randint(0, 4, (n,), generator=gen)  # the action table's rows
    return torch.where(torch.rand(n, generator=gen) < 0.25, act, item)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--git-sha", default=None)
    p.add_argument("--ids", type=int, default=435_000)
    p.add_argument("--rows", type=int, default=500_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run of the script only")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from freescale.embedding.reduce import group_rows_start

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    ok, rows = True, []
    dev = torch.device(a.device)
    gpu_ev = dev.type == "cuda"
    load_a = torch.randn(
        4096 if dev.type == "cuda" else 64, 4096 if dev.type == "cuda" else 64, device=dev
    )
    for kind in ("sgd", "rowwise_adagrad", "adam"):
        colls = {m: _collection(kind, a.rows, a.dim, a.device) for m in MODES}
        walls: dict[str, list[float]] = {m: [] for m in colls}
        gpu: dict[str, list[float]] = {m: [] for m in colls}
        for step in range(1, 2 * a.steps + 1):
            keys = _keys(a.ids, a.rows, gen).to(dev)
            grads = torch.randn(a.ids, a.dim, generator=gen).to(dev)
            loaded = step <= a.steps  # first half behind a queued load, then alone
            for mode, c in colls.items():
                c.sparse_update = mode
                _sync(dev)
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if gpu_ev else []
                if ev and not loaded:  # the GPU time includes ahead's sort
                    ev[0].record()
                groups = group_rows_start(keys) if mode == "ahead" else None
                if loaded:
                    x = load_a
                    for _ in range(60):  # queued GPU load (~30 ms on an H200)
                        x = torch.tanh(x @ load_a) * 0.01
                t0 = time.perf_counter()
                c.apply_gradients(keys, grads, step, None, groups=groups)
                host_ms = 1e3 * (time.perf_counter() - t0)
                if ev and not loaded:
                    ev[1].record()
                _sync(dev)
                if loaded:
                    walls[mode].append(host_ms)
                elif ev:
                    gpu[mode].append(ev[0].elapsed_time(ev[1]))
        s = colls["sync"]
        row: dict = {"kind": kind, "rows_updated": s.stats.rows_updated}
        for mode in MODES[1:]:
            c = colls[mode]
            c.tally.settle()
            equal = torch.equal(s.weight, c.weight) and all(
                torch.equal(s.optimizer.state[k], c.optimizer.state[k]) for k in s.optimizer.state
            )
            counts = s.stats.rows_updated == c.stats.rows_updated
            ok &= equal and counts
            row[f"bitwise_equal_{mode}"] = equal
            row[f"rows_updated_equal_{mode}"] = counts
        row["bitwise_equal"] = all(row[f"bitwise_equal_{m}"] for m in MODES[1:])
        ok &= colls["ahead"].stats.rows_grouped_ahead == s.stats.rows_updated
        for mode in MODES:
            row[f"host_ms_{mode}_median"] = statistics.median(walls[mode][1:])
            if gpu[mode]:
                row[f"gpu_ms_{mode}_median"] = statistics.median(gpu[mode][1:])
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    doc = figure_header("sparse_update", a.git_sha)
    doc.update(
        rows=rows,
        workload={"ids": a.ids, "rows": a.rows, "dim": a.dim, "steps": a.steps},
        headline={
            "bitwise_equal_all": all(r["bitwise_equal"] for r in rows),
            **{
                f"host_ms_{m}": statistics.median(r[f"host_ms_{m}_median"] for r in rows)
                for m in MODES
            },
            **{
                f"gpu_ms_{m}": statistics.median(r[f"gpu_ms_{m}_median"] for r in rows)
                for m in MODES
                if gpu_ev
            },
        },
        definition="host_ms: wall time of one apply_gradients call issued behind ~30 ms of "
        "queued GPU work (sync waits for it, padded and ahead only enqueue); gpu_ms: CUDA "
        "events around one call with nothing queued; first step of each dropped",
    )
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "sparse_update.json", "w") as f:
        json.dump(doc, f, indent=1)
    print("sparse update CUDA check:", "OK" if ok else "MISMATCH", json.dumps(doc["headline"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
