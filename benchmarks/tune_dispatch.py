"""Tuning sweep of the dispatch kernel training uses (v3: tile sort + dest-major scan).

For each workload of ``benchmarks/kernels.py`` (one rank's batch, ~1M ids; 2^26 ids) and
a few world sizes, times ``triton_impl.ranged_dispatch_v1(dest_major=True)`` per tile
size, warps per program and ``head_load`` (one scan-matrix read per run of equal owners),
after checking each setting bitwise against the reference. The fastest setting per
(workload, W) is what ``triton_impl.default_tile`` should pick. Writes
``OUT/dispatch_tune.json`` and prints one line per setting::

    PYTHONPATH=src python benchmarks/tune_dispatch.py --out DIR --git-sha SHA   # one H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import figure_header  # noqa: E402
from freescale.kernels import reference  # noqa: E402
from kernels import block_sizes_for, check_same, make_workload, time_fast  # noqa: E402

SWEEP = {
    # workload: (samples per key, total ids, world sizes, tiles)
    "large": (8192, 1 << 26, [8, 1024], [512, 1024, 2048, 4096, 8192]),
    "per_rank": (128, None, [32, 512], [128, 256, 512, 1024, 2048]),
}


def headline(best: dict[str, dict]) -> dict[str, object]:
    """Per (workload, W): the fastest setting and its time."""
    return {
        k.replace(" W=", "_w"): {
            "ms": r["ms"],
            "tile": r["tile"],
            "num_warps": r["num_warps"],
            "head_load": r["head_load"],
        }  # fmt: skip
        for k, r in best.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--git-sha", default=None)
    p.add_argument("--budget-s", type=float, default=240.0)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_dispatch needs a CUDA device", file=sys.stderr)
        return 2
    from freescale.kernels import triton_impl as tri

    dev = torch.device("cuda")
    deadline = time.perf_counter() + a.budget_s
    rows: list[dict] = []
    for i, (name, (batch, total, worlds, tiles)) in enumerate(SWEEP.items()):
        wl = make_workload(name, batch, total, dev, i, smoke=False)
        for world in worlds:
            args = (wl["values"], wl["lengths"], block_sizes_for(world, dev), world)
            expect = reference.ranged_dispatch(*args)
            for tile in tiles:
                for warps in (4, 8, 16) if tile >= 2048 else (2, 4, 8):
                    for head in (False, True):
                        if time.perf_counter() > deadline:
                            break
                        fn = partial(
                            tri.ranged_dispatch_v1, *args, tile=tile, dest_major=True,
                            num_warps=warps, head_load=head,
                        )  # fmt: skip
                        row = {"workload": name, "n_ids": wl["n"], "world_size": world,
                               "tile": tile, "num_warps": warps, "head_load": head}  # fmt: skip
                        try:
                            check_same(f"v3 {row}", expect, fn())
                            row["ms"] = time_fast(fn, dev, 0)[0]
                        except Exception as exc:  # noqa: BLE001 - a failed setting is data
                            row["error"] = repr(exc)[:200]
                        rows.append(row)
                        print(json.dumps(row), flush=True)
            del expect
        del wl
        torch.cuda.empty_cache()
    best = {}
    for r in rows:
        key = f"{r['workload']} W={r['world_size']}"
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    a.out.mkdir(parents=True, exist_ok=True)
    res = {
        **figure_header("dispatch_tune", a.git_sha),
        "rows": rows,
        "best": best,
        "headline": headline(best),
    }
    (a.out / "dispatch_tune.json").write_text(json.dumps(res, indent=1) + "\n")
    for k, r in best.items():
        print(f"best {k}: tile {r['tile']} warps {r['num_warps']} head {r['head_load']} "
              f"{r['ms']:.3f} ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
