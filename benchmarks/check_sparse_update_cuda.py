"""The sparse update on CUDA: padded (no read-back, the CUDA default) vs synchronous.

Applies the same random gradient steps to two single-rank collections on the GPU, one
with ``FREESCALE_SPARSE_UPDATE=sync`` (``group_rows`` reads the row count back), one with
``padded`` (``group_rows_padded``), for SGD, row-wise Adagrad and Adam at the
end-to-end workload's size (one rank's ~435K ids per step, dim 128, Zipf rows plus a
4-row table's long segments); checks weights and optimizer state bitwise and times one
update each way behind a queued GPU load (a 30 ms matmul chain): the synchronous one
makes the host wait for the load, the padded one does not. Writes
``OUT/sparse_update.json``; exits 1 on a mismatch::

    PYTHONPATH=src python benchmarks/check_sparse_update_cuda.py --out DIR --git-sha SHA
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import figure_header  # noqa: E402


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
    from freescale.embedding.collection import SPARSE_UPDATE_ENV_VAR

    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    ok, rows = True, []
    dev = torch.device(a.device)
    load_a = torch.randn(
        4096 if dev.type == "cuda" else 64, 4096 if dev.type == "cuda" else 64, device=dev
    )
    for kind in ("sgd", "rowwise_adagrad", "adam"):
        colls = {m: _collection(kind, a.rows, a.dim, a.device) for m in ("sync", "padded")}
        walls: dict[str, list[float]] = {m: [] for m in colls}
        for step in range(1, a.steps + 1):
            keys = _keys(a.ids, a.rows, gen).to(dev)
            grads = torch.randn(a.ids, a.dim, generator=gen).to(dev)
            for mode, c in colls.items():
                os.environ[SPARSE_UPDATE_ENV_VAR] = mode
                _sync(dev)
                x = load_a
                for _ in range(60):  # queued GPU load (~30 ms on an H200)
                    x = torch.tanh(x @ load_a) * 0.01
                t0 = time.perf_counter()
                c.apply_gradients(keys, grads, step, None)
                walls[mode].append(1e3 * (time.perf_counter() - t0))
                _sync(dev)
        s, pd = colls["sync"], colls["padded"]
        pd.tally.settle()
        equal = torch.equal(s.weight, pd.weight) and all(
            torch.equal(s.optimizer.state[k], pd.optimizer.state[k]) for k in s.optimizer.state
        )
        counts = s.stats.rows_updated == pd.stats.rows_updated
        ok &= equal and counts
        rows.append(
            {
                "kind": kind,
                "bitwise_equal": equal,
                "rows_updated_equal": counts,
                "rows_updated": s.stats.rows_updated,
                "host_ms_sync_median": statistics.median(walls["sync"][1:]),
                "host_ms_padded_median": statistics.median(walls["padded"][1:]),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    doc = figure_header("sparse_update", a.git_sha)
    doc.update(
        rows=rows,
        workload={"ids": a.ids, "rows": a.rows, "dim": a.dim, "steps": a.steps},
        headline={
            "bitwise_equal_all": all(r["bitwise_equal"] for r in rows),
            "host_ms_sync": statistics.median(r["host_ms_sync_median"] for r in rows),
            "host_ms_padded": statistics.median(r["host_ms_padded_median"] for r in rows),
        },
        definition="host_ms: wall time of one apply_gradients call issued behind ~30 ms of "
        "queued GPU work (sync waits for it, padded only enqueues); first step dropped",
    )
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "sparse_update.json", "w") as f:
        json.dump(doc, f, indent=1)
    print("sparse update CUDA check:", "OK" if ok else "MISMATCH", json.dumps(doc["headline"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
