"""The per-row gradient sum on CUDA: Triton tree (kernels/segment_tree.py) vs reference.

Also checks the module's `mask_positions_triton` and `mask_partition_triton` against
``torch.nonzero``, and `run_stats_triton` against `embedding.reduce.run_stats_reference`.

Checks `segment_tree_sum` bitwise against `embedding.reduce.segment_sum_reference` on
fresh random inputs (signed zeros, long hot-row segments, float32 and float64), then
times both at the end-to-end workload's size (one rank's ~435K ids per step, dim 128,
Zipf-distributed rows) and a smaller one. Writes ``OUT/segment_sum.json``; exits 1 on a
mismatch::

    PYTHONPATH=src python benchmarks/check_segment_sum_cuda.py --out DIR --git-sha SHA
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import figure_header  # noqa: E402


def zipf_keys(n: int, rows: int, s: float, gen: torch.Generator) -> torch.Tensor:
    w = torch.arange(1, rows + 1, dtype=torch.float64).pow(-s)
    return torch.multinomial(w, n, replacement=True, generator=gen)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--git-sha", default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    from freescale.embedding.reduce import group_rows, segment_sum_reference
    from freescale.kernels.segment_tree import segment_tree_sum

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    ok, rows = True, []
    for n, d, nrows, dtype in [
        (1, 4, 1, torch.float32),
        (5000, 3, 1, torch.float32),  # one segment of 5000: 3 chunk levels
        (20000, 130, 500, torch.float64),
        (435_000, 128, 1_000_000, torch.float32),  # the e2e step's size
        (100_000, 128, 1_000_000, torch.float32),
    ]:
        keys = zipf_keys(n, nrows, 0.6, gen).to(dev)
        vals = (torch.randn(n, d, generator=gen, dtype=dtype) * 100).to(dev)
        vals[torch.rand(n, d, device=dev) < 0.1] = -0.0
        groups = group_rows(keys)
        ref = segment_sum_reference(vals, groups)
        got = segment_tree_sum(vals, groups.order, groups.starts, groups.counts, groups.max_count)
        it = torch.int64 if dtype == torch.float64 else torch.int32
        same = bool(torch.equal(ref.view(it), got.view(it)))
        ok &= same
        row = {"n_ids": n, "dim": d, "rows": int(groups.rows.numel()),
               "max_count": groups.max_count, "dtype": str(dtype),
               "bitwise_equal": same}  # fmt: skip
        if n >= 100_000:
            g, v = groups, vals
            row["reference_ms"] = do_bench(lambda: segment_sum_reference(v, g), rep=200)  # noqa: B023
            row["triton_ms"] = do_bench(
                lambda: segment_tree_sum(v, g.order, g.starts, g.counts, g.max_count),  # noqa: B023
                rep=200,
            )
            row["speedup"] = row["reference_ms"] / row["triton_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    # mask positions (the same module's second kernel) against torch.nonzero
    from freescale.kernels.segment_tree import mask_partition_triton, mask_positions_triton

    for n, p in ((1, 0.5), (1000, 0.01), (435_000, 0.5), (435_000, 0.999)):
        m = torch.rand(n, generator=gen).to(dev) < p
        same = bool(torch.equal(mask_positions_triton(m, int(m.sum())), torch.nonzero(m)[:, 0]))
        ok &= same
        rows.append({"op": "mask_positions", "n": n, "p": p, "equal_to_nonzero": same})
        print(json.dumps(rows[-1]), flush=True)
        # the stable partition: [nonzero(m) | nonzero(~m)] in one launch
        both = torch.cat([torch.nonzero(m)[:, 0], torch.nonzero(~m)[:, 0]])
        same = bool(torch.equal(mask_partition_triton(m, int(m.sum())), both))
        ok &= same
        rows.append({"op": "mask_partition", "n": n, "p": p, "equal_to_nonzero": same})
        print(json.dumps(rows[-1]), flush=True)
    # run stats of sorted keys (group_rows_start's CUDA path) against the reference
    from freescale.embedding.reduce import run_stats_reference
    from freescale.kernels.segment_tree import run_stats_triton

    for n, nrows in ((1, 1), (1024, 1), (1025, 3), (435_000, 1_000_000), (5_000_000, 1000)):
        sk = torch.sort(zipf_keys(n, nrows, 0.6, gen).to(dev)).values
        ref_start, ref_stats = run_stats_reference(sk)
        for kw in ({}, {"block": 256, "chunk": 8}):
            got_start, got_stats = run_stats_triton(sk, **kw)
            same = bool(torch.equal(got_start, ref_start) and torch.equal(got_stats, ref_stats))
            ok &= same
            rows.append({"op": "run_stats", "n": n, "rows": nrows, **kw, "equal": same,
                         "stats": ref_stats.tolist()})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    big = next(r for r in rows if r.get("n_ids") == 435_000)
    res = {
        **figure_header("segment_sum", a.git_sha),
        "rows": rows,
        "headline": {"bitwise_equal": ok, "speedup_e2e_size": big.get("speedup")},
        "note": "device time by triton.testing.do_bench (median of repeated calls)",
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "segment_sum.json").write_text(json.dumps(res, indent=1) + "\n")
    print("segment_sum CUDA check:", "OK" if ok else "MISMATCH", json.dumps(res["headline"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
