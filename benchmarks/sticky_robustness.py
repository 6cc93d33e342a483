"""Figure `sticky_robustness`: how the sticky partitioner's balance depends on its costs.

Session 16 measured `sticky` against `fbs` on 2 H200 (`e2e_sticky_d1cf677.json`: equal
QPS on an uncontended host, higher on a contended one, a lower straggler share, ~45x fewer
samples moved). At 2 ranks every partitioner balances well. This script asks what
happens at 8 to 256 ranks, where the GPU was not available, with the per-rank dense
cost model fitted on the GPU (``cost_model_2gpu.json``: ``a*sum(L) + b*sum(L^2) + c``)
taken as the truth. Per step: ``W x batch`` log-normal lengths (the GPU workload's:
median 1,024, sigma 1, clipped at max UIH 16K), every sample at its home rank
(rank-major), then one plan per planner, each scored by the true model:

* ``fbs``, ``kk``: planned with ``L^alpha`` weights (alpha 1.5), as ``--balance fbs`` /
  ``kk`` do (``fbs`` is the same plan for any monotone cost; it was ``--mode
  freescale``'s partitioner until session 17);
* ``sticky``: planned with ``L^alpha``;
* ``sticky_cost``: planned with the true model (the ideal of
  ``BalanceConfig(use_cost_model=True)``; ``--mode freescale``'s balancer since session
  17 refits it every 20 steps);
* ``sticky_cost_a<fa>_b<fb>``: planned with a misfit model, ``a`` and ``b`` scaled by
  ``fa`` and ``fb`` (the trainer's online fit is never exact);
* ``sticky2``: swaps balancing every rank's total length and total squared length (no
  cost model; it balances every ``a*L + b*L^2 + c``).

Every plan is also scored by other models of that form (``L`` alone, ``L^2`` alone, the
fit with ``a`` and ``b`` off by 2x): each row's ``straggler_by_model`` (medians), for a
planner that is to be right whatever the true cost is.

Rows: median straggler share ``(max - mean) / max`` of the scored per-rank cost, the
median share of samples moved off their home rank, and the median time of the
partition call on this host (``plan_ms_median``). CPU only, deterministic (seeded);
~10 s at the defaults::

    PYTHONPATH=src python benchmarks/sticky_robustness.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _figure import host_figure_header, write_figure  # noqa: E402
from freescale.balance.cost_model import CostModel  # noqa: E402
from freescale.balance.partitioners import fbs, identity, kk, sticky, sticky2  # noqa: E402
from freescale.balance.simulator import SimConfig, _score, sample_lengths  # noqa: E402

MISFITS = ((0.7, 1.3), (1.3, 0.7), (0.5, 2.0), (2.0, 0.5))


def planners(misfits: tuple[tuple[float, float], ...]) -> list[str]:
    names = ["fbs", "kk", "sticky", "sticky_cost", "sticky2"]
    return names + [f"sticky_cost_a{fa:g}_b{fb:g}" for fa, fb in misfits]


def scoring_models(true_model: CostModel) -> dict[str, CostModel]:
    """Other costs of the form ``a*L + b*L^2 + c`` every plan is scored by."""
    t = true_model
    return {
        "L": CostModel(a=1.0, b=0.0, c=0.0, fitted=True),
        "L2": CostModel(a=0.0, b=1.0, c=0.0, fitted=True),
        "fit_a0.5_b2": CostModel(a=t.a * 0.5, b=t.b * 2.0, c=t.c, fitted=True),
        "fit_a2_b0.5": CostModel(a=t.a * 2.0, b=t.b * 0.5, c=t.c, fitted=True),
    }


def run(
    true_model: CostModel,
    world_sizes: list[int],
    *,
    batch: int = 128,
    max_uih: int = 16384,
    median_uih: int = 1024,
    steps: int = 20,
    alpha: float = 1.5,
    seed: int = 0,
    misfits: tuple[tuple[float, float], ...] = MISFITS,
) -> list[dict[str, Any]]:
    """One row per (world size, planner): median straggler share and moved share."""
    cfg = SimConfig(ranks=[2], batch_sizes=[batch], max_uih=[max_uih], median_uih=median_uih)
    scoring = scoring_models(true_model)
    rows = []
    for w in world_sizes:
        rng = np.random.default_rng([seed, w])
        got: dict[str, list[tuple[float, float]]] = {n: [] for n in planners(misfits)}
        by_model: dict[str, dict[str, list[float]]] = {n: {} for n in planners(misfits)}
        plan_ms: dict[str, list[float]] = {n: [] for n in planners(misfits)}
        for _ in range(steps):
            ln = sample_lengths(rng, w * batch, cfg, max_uih)
            home = identity(ln.astype(np.float64), w)
            by_alpha = CostModel(alpha=alpha).sample_costs(ln)
            # name -> (partition function, costs, keyword arguments)
            calls: dict[str, tuple[Any, np.ndarray, dict[str, Any]]] = {
                "fbs": (fbs, by_alpha, {}),
                "kk": (kk, by_alpha, {}),
                "sticky": (sticky, by_alpha, {"home": home}),
                "sticky_cost": (sticky, true_model.sample_costs(ln), {"home": home}),
                "sticky2": (sticky2, by_alpha, {"sort_key": ln, "home": home}),
            }
            for fa, fb in misfits:
                m = CostModel(a=true_model.a * fa, b=true_model.b * fb, c=true_model.c, fitted=True)
                calls[f"sticky_cost_a{fa:g}_b{fb:g}"] = (sticky, m.sample_costs(ln), {"home": home})
            plans = {}
            for name, (fn, costs, kw) in calls.items():
                t0 = time.perf_counter()
                plans[name] = fn(costs, w, **kw)
                plan_ms[name].append((time.perf_counter() - t0) * 1e3)
            for name, plan in plans.items():
                metrics, _, _ = _score(plan, ln, true_model, w, home.rank_of)
                got[name].append((metrics["straggler"], metrics["moved_share"]))
                for model_name, model in scoring.items():
                    m, _, _ = _score(plan, ln, model, w, home.rank_of)
                    by_model[name].setdefault(model_name, []).append(m["straggler"])
        for name, vals in got.items():
            rows.append(
                {
                    "world_size": w,
                    "planner": name,
                    "straggler_median": float(np.median([v[0] for v in vals])),
                    "moved_share_median": float(np.median([v[1] for v in vals])),
                    # this host's time for the partition call alone (not asserted anywhere)
                    "plan_ms_median": float(np.median(plan_ms[name])),
                    "straggler_by_model": {
                        m: float(np.median(v)) for m, v in by_model[name].items()
                    },
                    "steps": steps,
                }
            )
    return rows


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per world size: each sticky planner's straggler share over fbs's."""
    out: dict[str, Any] = {}
    by = {(r["world_size"], r["planner"]): r for r in rows}
    for w in sorted({r["world_size"] for r in rows}):
        ref = by[(w, "fbs")]["straggler_median"]
        out[f"straggler_over_fbs_{w}ranks"] = {
            p: (by[(w, p)]["straggler_median"] / ref if ref > 0 else None)
            for (ww, p) in by
            if ww == w and p.startswith("sticky")
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="directory for sticky_robustness.json")
    ap.add_argument(
        "--cost-model",
        default=os.path.join(os.path.dirname(__file__), "results", "cost_model_2gpu.json"),
        help="the true per-rank cost model (JSON {a, b, c})",
    )
    ap.add_argument("--world-sizes", default="2,8,64,256")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=128, help="samples per rank")
    ap.add_argument("--git-sha", default=None)
    args = ap.parse_args(argv)
    with open(args.cost_model) as f:
        true_model = CostModel.from_dict(json.load(f))
    worlds = [int(x) for x in args.world_sizes.split(",")]
    rows = run(true_model, worlds, batch=args.batch, steps=args.steps)
    report = host_figure_header("sticky_robustness", args.git_sha)
    report.update(
        cost_model=true_model.to_dict(),
        cost_model_path=os.path.relpath(args.cost_model),
        rows=rows,
        headline=headline(rows),
    )
    for r in rows:
        others = " ".join(f"{m} {v:.4f}" for m, v in r["straggler_by_model"].items())
        print(
            f"W={r['world_size']:4d} {r['planner']:26s} straggler {r['straggler_median']:.4f}"
            f"  moved {r['moved_share_median']:.3f}  plan {r['plan_ms_median']:.1f} ms  | {others}"
        )
    write_figure(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
