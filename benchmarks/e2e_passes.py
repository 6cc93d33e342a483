"""Print an e2e report's passes (``freescale bench e2e --repeats N``): per row the QPS,
measured straggler share, samples moved, the balancer's data-stage ms, host CPU by
thread group and eval NE; then every variant's QPS over vanilla's per pass and the
median, its final eval NE's relative distance to vanilla's, and the cost model of any
balancer that fits one. A reader for ``e2e_gpu.sh`` phases (rep3, sticky); it writes nothing.

    python benchmarks/e2e_passes.py OUT/e2e_rep3/e2e.json
"""

from __future__ import annotations

import json
import statistics
import sys


def main(argv: list[str]) -> int:
    d = json.load(open(argv[0]))
    print("host_calibration", d.get("host_calibration"))
    by: dict[object, dict[str, float]] = {}
    ne: dict[str, float] = {}
    for r in d["rows"] + d.get("repeat_rows", []):
        s = r["summary"]
        g = (s.get("host_cpu") or {}).get("by_group_ms_per_step") or {}
        phases = (s.get("data_thread") or {}).get("phases_ms") or {}
        by.setdefault(r.get("pass"), {})[r["variant"]] = r["qps"]
        ne[r["variant"]] = r.get("eval_ne", float("nan"))
        print(
            r["variant"], r.get("pass"), round(r["qps"]),
            "straggler", round(r.get("straggler_share_median", float("nan")), 4),
            "moved", r["activity"].get("samples_moved"),
            "balancer_ms", round(phases.get("hook:BalanceHook", 0.0), 2),
            "train", round(g.get("training", 0.0), 1), "data", round(g.get("data", 0.0), 1),
            "other", round(g.get("other", 0.0), 1), "ne", r.get("eval_ne"),
        )  # fmt: skip
    variants = sorted({v for p in by.values() for v in p} - {"vanilla"})
    for v in variants:
        rs = [p[v] / p["vanilla"] for p in by.values() if v in p and p.get("vanilla")]
        med = round(statistics.median(rs), 3) if rs else None
        print(v, "/ vanilla per pass", [round(x, 3) for x in rs], "median", med)
    if "vanilla" in ne:  # same data and seed in every pass: one final NE per variant
        for v in variants:
            rel = abs(ne[v] - ne["vanilla"]) / abs(ne["vanilla"])
            print(v, "eval NE rel. distance to vanilla", f"{rel:.3g}")
    for r in d["rows"]:
        cm = r["activity"].get("balance_cost_model")
        if cm:
            print(r["variant"], "balancer cost model", cm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
