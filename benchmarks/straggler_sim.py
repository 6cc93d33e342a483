"""Figure `straggler_sim` (issue 4): the straggler simulator at cluster scale.

Runs :func:`freescale.balance.simulator.simulate` (per-rank dense cost of every plan
scored with a cost model ``a*sum(L) + b*sum(L^2) + c``) on the GPU benchmark's length
distribution (log-normal, median = max UIH / 16, sigma 1, clipped at max UIH) and
writes ``<out>/straggler_sim.json`` and ``<out>/straggler_sim.png``:

* main rows: 64 and 256 ranks, max UIH 21K (21,504), 128 samples per rank, every
  partitioner; headline ``reduction_21k_64ranks`` / ``reduction_21k_256ranks`` (FBS
  vs vanilla, ratio of median straggler shares) and the lower bound (the straggler
  share no whole-sample partition can beat, and FBS's max over that bound);
* Fig. 2: padding sparsity (share of a ``[B, max UIH]`` tensor that is padding) and
  straggler share vs max UIH, for a *fixed* history distribution (that of the 16K GPU
  workload: median 1,024) truncated at the swept max UIH, as in the paper;
* Fig. 8: straggler share vs max UIH (scaled distribution), vs local batch size and
  vs rank count (8 .. 1024);
* planner time at 512 ranks x 128 samples (FBS, VBS, KK partition functions and the
  whole ``Planner.plan`` call), median of repeated calls on this CPU;
* validation (``--measured straggler.json``): the simulator at 2 ranks against the
  GPU measurements, per max UIH and partitioner: predicted vs measured median
  straggler share and the residual (also the cost model applied to the plans that
  actually ran, which separates cost-model error from sampling).

The cost model comes from ``--cost-model`` (default: ``cost_model_2gpu.json`` next
to ``--measured``, or in ``--out``); without one the simulator's illustrative
defaults are used and the JSON says so. CPU only:

    PYTHONPATH=src python benchmarks/straggler_sim.py --out benchmarks/results \\
        [--measured benchmarks/results/straggler.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from _figure import cpu_name, git_sha
from freescale.balance.cost_model import DEFAULT_COST_MODEL, CostModel
from freescale.balance.partitioners import get_partitioner
from freescale.balance.planner import BalanceConfig, GlobalMetadata, Planner
from freescale.balance.simulator import SimConfig, sample_lengths, simulate

MAX_UIH_21K = 21 * 1024
PARTS = ["identity", "fbs", "vbs", "vbs_auto", "vbs_cost", "kk", "kk_cost"]
LABELS = {
    "identity": "vanilla",
    "fbs": "FBS",
    "vbs": "VBS",
    "vbs_auto": "VBS + AutoTune",
    "vbs_cost": "VBS (cost model)",
    "kk": "KK",
    "kk_cost": "KK (cost model)",
}


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--measured", default=None, help="straggler.json of the GPU runs")
    p.add_argument("--cost-model", default=None, help="JSON {a, b, c} (ms, L = tokens)")
    p.add_argument("--steps", type=int, default=50, help="simulated steps per point")
    p.add_argument("--ranks", type=_ints, default=[64, 256])
    p.add_argument("--max-uih", type=int, default=MAX_UIH_21K)
    p.add_argument("--batch-size", type=int, default=128, help="samples per rank")
    p.add_argument("--median-div", type=int, default=16)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument(
        "--sweep-max-uih", type=_ints, default=[1024, 2048, 4096, 8192, 16384, 21504, 32768]
    )
    p.add_argument("--fig2-median", type=int, default=1024, help="fixed median for Fig. 2")
    p.add_argument("--fig2-ranks", type=int, default=64)
    p.add_argument("--sweep-batch", type=_ints, default=[16, 32, 64, 128, 256, 512])
    p.add_argument("--sweep-ranks", type=_ints, default=[8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--sweep-at-ranks", type=int, default=256, help="ranks of the batch sweep")
    p.add_argument("--timing-ranks", type=int, default=512)
    p.add_argument("--timing-repeats", type=int, default=60)
    p.add_argument("--partitioners", default=",".join(PARTS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--git-sha", default=None)
    p.add_argument(
        "--rank-noise-ms",
        type=float,
        nargs="*",
        default=None,
        help="noise sensitivity: per-rank time noise std values (ms) for extra runs at "
        "--ranks (identity and FBS); default: the estimate from --measured, and 1 ms",
    )
    p.add_argument("--quick", action="store_true", help="few steps, small sweeps (a check)")
    a = p.parse_args(argv)
    a.parts = [x.strip() for x in a.partitioners.split(",") if x.strip()]
    if a.quick:
        a.steps = 5
        a.sweep_ranks = [8, 64]
        a.sweep_batch = [32, 128]
        a.sweep_max_uih = [4096, 21504]
        a.timing_repeats = 5
    return a


def load_cost_model(a: argparse.Namespace) -> tuple[CostModel, dict[str, Any]]:
    path = a.cost_model
    if path is None:
        cands = []
        if a.measured:
            cands.append(os.path.join(os.path.dirname(a.measured), "cost_model_2gpu.json"))
        cands.append(os.path.join(a.out, "cost_model_2gpu.json"))
        path = next((c for c in cands if os.path.exists(c)), None)
    if path is None:
        cm = CostModel(**asdict(DEFAULT_COST_MODEL))
        info = {
            "source": "defaults: the simulator's illustrative a=1e-4 ms/token, b=a/1536, "
            "c=0.5 ms (NOT measured; re-run with the GPU fit cost_model_2gpu.json)",
            "measured": False,
        }
    else:
        cm = CostModel.load(path)
        with open(path) as f:
            raw = json.load(f)
        info = {
            "source": path,
            "measured": True,
            **{k: raw[k] for k in ("device", "git_sha", "date", "units") if k in raw},
        }
    info.update(a=cm.a, b=cm.b, c=cm.c, fit_error=cm.fit_error)
    return cm, info


def sim(
    a: argparse.Namespace,
    cm: CostModel,
    ranks: list[int],
    batch: list[int],
    max_uih: int,
    median: int,
    parts: list[str] | None = None,
    steps: int | None = None,
    noise_ms: float = 0.0,
) -> list[dict]:
    cfg = SimConfig(
        ranks=ranks,
        batch_sizes=batch,
        max_uih=[max_uih],
        steps=steps or a.steps,
        length_dist="lognormal",
        median_uih=max(1, median),
        sigma=a.sigma,
        partitioners=parts or a.parts,
        cost_model=cm,
        seed=a.seed,
        rank_noise_ms=noise_ms,
    )
    rows = simulate(cfg)
    for r in rows:
        r["median_uih"] = max(1, median)
    return rows


def planner_timing(a: argparse.Namespace, cm: CostModel) -> dict[str, Any]:
    """Median ms of the partition functions and of ``Planner.plan`` at
    ``timing_ranks`` x ``batch_size`` samples (max UIH 21K distribution)."""
    w, b = a.timing_ranks, a.batch_size
    cfg = SimConfig(
        ranks=[w], median_uih=a.max_uih // a.median_div, sigma=a.sigma, partitioners=["fbs"]
    )
    rng = np.random.default_rng([a.seed, 512])
    ln = sample_lengths(rng, w * b, cfg, a.max_uih)
    costs = CostModel(alpha=1.5).sample_costs(ln)
    out: dict[str, Any] = {"ranks": w, "samples": int(ln.size), "repeats": a.timing_repeats}
    for name in ("identity", "fbs", "vbs", "kk"):
        fn = get_partitioner(name)
        for _ in range(3):
            fn(costs, w, sort_key=ln)
        ts = []
        for _ in range(a.timing_repeats):
            t0 = time.perf_counter()
            fn(costs, w, sort_key=ln)
            ts.append((time.perf_counter() - t0) * 1e3)
        out[f"{name}_partition_ms"] = _pct(ts)
    meta = GlobalMetadata.from_lengths(0, ln, w)
    for name in ("fbs", "vbs", "kk"):
        planner = Planner(BalanceConfig(partitioner=name), w, 0)
        for _ in range(3):
            planner.plan(meta)
        ts = []
        for _ in range(a.timing_repeats):
            t0 = time.perf_counter()
            planner.plan(meta)
            ts.append((time.perf_counter() - t0) * 1e3)
        out[f"{name}_planner_plan_ms"] = _pct(ts)
    return out


def _pct(ts: list[float]) -> dict[str, float]:
    v = np.asarray(ts)
    return {
        "median": float(np.median(v)),
        "p10": float(np.percentile(v, 10)),
        "p90": float(np.percentile(v, 90)),
    }


def validate(a: argparse.Namespace, cm: CostModel, measured_path: str) -> list[dict]:
    """Simulator at the GPU runs' setting vs their measured straggler shares."""
    with open(measured_path) as f:
        meas = json.load(f)
    wl = meas.get("workload", {})
    world = int(wl.get("ranks", 2))
    per_rank = int(wl.get("per_rank_batch", 128))
    sigma = float(wl.get("sigma", a.sigma))
    out = []
    by_uih: dict[int, list[dict]] = {}
    for r in meas["rows"]:
        by_uih.setdefault(int(r["max_uih"]), []).append(r)
    for mu, rs in sorted(by_uih.items()):
        parts = [r["partitioner"] for r in rs]
        steps = max(int(r.get("steps_measured", a.steps)) for r in rs)
        old_sigma, a.sigma = a.sigma, sigma
        sims = sim(a, cm, [world], [per_rank], mu, mu // a.median_div, parts, max(steps, 20))
        a.sigma = old_sigma
        for r in rs:
            s = next(x for x in sims if x["partitioner"] == r["partitioner"])
            m = r["straggler_share"]
            pred = s["straggler"]["median"]
            row = {
                "ranks": world,
                "batch_size": per_rank,
                "max_uih": mu,
                "partitioner": r["partitioner"],
                "measured_share": m["median"],
                "measured_ci95": [m["lo"], m["hi"]],
                "simulated_share": pred,
                "simulated_p2.5_p97.5": [s["straggler"]["p2.5"], s["straggler"]["p97.5"]],
                "residual": pred - m["median"],
                "measured_steps": r.get("steps_measured"),
            }
            fp = r.get("fit_predicted_share")
            if fp is not None:
                # the GPU run's own cost-model fit applied to the plans that ran
                row["fit_on_actual_plans_share"] = fp["median"]
                row["fit_on_actual_plans_residual"] = fp["median"] - m["median"]
            out.append(row)
    return out


def noise_estimate_ms(measured_path: str) -> dict[str, Any]:
    """Per-rank timing noise (std, ms) implied by the GPU runs: for the best-balanced
    plan (KK on the cost model, the simulator's predicted share ~0), a 2-rank share s
    of dense max time T is E|e1 - e2| / (2 T) = sigma / (sqrt(pi) T) for Gaussian
    noise e, so sigma ~ s * T * sqrt(pi). Median over max UIH values."""
    with open(measured_path) as f:
        meas = json.load(f)
    per_uih = {}
    for r in meas["rows"]:
        if r["partitioner"] != "kk_cost" or int(meas["workload"].get("ranks", 2)) != 2:
            continue
        t = r.get("dense_ms_max", {}).get("median")
        if t:
            per_uih[int(r["max_uih"])] = r["straggler_share"]["median"] * t * math.sqrt(math.pi)
    vals = sorted(per_uih.values())
    return {
        "sigma_ms": float(np.median(vals)) if vals else None,
        "per_max_uih": per_uih,
        "method": "KK (cost model) rows at 2 ranks: sigma = share * dense max ms * sqrt(pi); "
        "includes the timer's own noise (" + str(meas["workload"].get("dense_time", "")) + ")",
    }


def plot(
    rows: list[dict], info: dict, validation: list[dict] | None, path: str, title: str
) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(2, 3, figsize=(15, 8))
    f2 = [r for r in rows if r["sweep"] == "fig2_max_uih"]
    van = sorted((r for r in f2 if r["partitioner"] == "identity"), key=lambda r: r["max_uih"])
    x = [r["max_uih"] for r in van]
    ax[0, 0].plot(
        x, [100 * r["sparsity_vs_max_uih"] for r in van], marker="o", label="pad to max UIH"
    )
    ax[0, 0].plot(
        x,
        [100 * r["padding_sparsity"]["median"] for r in van],
        marker="s",
        label="pad to local max (vanilla)",
    )
    ax[0, 0].set_ylabel("padding sparsity, %")
    ax[0, 0].set_title(f"Fig. 2: fixed history distribution (median {van[0]['median_uih']})")
    ax[0, 0].legend()
    panels = [
        (ax[0, 1], "fig2_max_uih", "max_uih", "max UIH length", "Fig. 2: straggler vs max UIH"),
        (ax[1, 0], "fig8_max_uih", "max_uih", "max UIH length", "Fig. 8: vs max UIH"),
        (ax[1, 1], "fig8_batch", "batch_size", "samples per rank", "Fig. 8: vs batch size"),
        (ax[1, 2], "fig8_ranks", "ranks", "ranks", "Fig. 8: vs rank count"),
    ]
    for axis, sweep, key, xlabel, ttl in panels:
        rs = [r for r in rows if r["sweep"] == sweep]
        for name in PARTS:
            pts = sorted((r for r in rs if r["partitioner"] == name), key=lambda r: r[key])
            if not pts:
                continue
            axis.plot(
                [r[key] for r in pts],
                [100 * r["straggler"]["median"] for r in pts],
                marker="o",
                label=LABELS[name],
            )
        floor = sorted((r for r in rs if r["partitioner"] == "fbs"), key=lambda r: r[key])
        if floor:
            axis.plot(
                [r[key] for r in floor],
                [100 * r["straggler_floor"]["median"] for r in floor],
                "k--",
                lw=1,
                label="lower bound",
            )
        axis.set_xlabel(xlabel)
        axis.set_ylabel("straggler share, % (median)")
        axis.set_yscale("symlog", linthresh=0.1)
        axis.set_title(ttl, fontsize=9)
    for axis in [ax[0, 0], ax[0, 1], ax[1, 0], ax[1, 1], ax[1, 2]]:
        axis.set_xscale("log", base=2)
        axis.grid(True, alpha=0.3)
    ax[0, 0].set_xlabel("max UIH length")
    ax[1, 2].legend(fontsize=7)
    v = ax[0, 2]
    if validation:
        for name in PARTS:
            pts = [r for r in validation if r["partitioner"] == name]
            if pts:
                v.scatter(
                    [100 * r["measured_share"] for r in pts],
                    [100 * r["simulated_share"] for r in pts],
                    label=LABELS[name],
                    s=14,
                )
        hi = max(100 * max(r["measured_share"], r["simulated_share"]) for r in validation)
        v.plot([0, hi], [0, hi], "k:", lw=1)
        v.set_xlabel("measured on GPU, % (2 ranks)")
        v.set_ylabel("simulated, %")
        v.legend(fontsize=7)
        v.grid(True, alpha=0.3)
    else:
        v.text(0.5, 0.5, "no GPU measurements given\n(--measured straggler.json)", ha="center")
        v.set_axis_off()
    v.set_title("validation: simulator vs GPU (median straggler share)", fontsize=9)
    cm_src = "measured fit" if info.get("measured") else "DEFAULT cost model (not measured)"
    fig.suptitle(f"{title}; {cm_src}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.perf_counter()
    cm, info = load_cost_model(a)
    rows: list[dict] = []

    def tag(rs: list[dict], sweep: str) -> list[dict]:
        for r in rs:
            r["sweep"] = sweep
        rows.extend(rs)
        return rs

    med = a.max_uih // a.median_div
    main_rows = tag(sim(a, cm, a.ranks, [a.batch_size], a.max_uih, med), "main")
    for mu in a.sweep_max_uih:  # Fig. 2: a fixed distribution truncated at max UIH
        tag(sim(a, cm, [a.fig2_ranks], [a.batch_size], mu, a.fig2_median), "fig2_max_uih")
    for mu in a.sweep_max_uih:  # Fig. 8 (a): the GPU workload's scaled distribution
        tag(sim(a, cm, [a.sweep_at_ranks], [a.batch_size], mu, mu // a.median_div), "fig8_max_uih")
    tag(sim(a, cm, [a.sweep_at_ranks], a.sweep_batch, a.max_uih, med), "fig8_batch")
    tag(sim(a, cm, a.sweep_ranks, [a.batch_size], a.max_uih, med), "fig8_ranks")
    timing = planner_timing(a, cm)
    validation = validate(a, cm, a.measured) if a.measured else None

    def pick(ranks: int, name: str) -> dict | None:
        return next(
            (r for r in main_rows if r["ranks"] == ranks and r["partitioner"] == name), None
        )

    head: dict[str, Any] = {"max_uih": a.max_uih, "batch_size": a.batch_size}
    for w in a.ranks:
        van, fbs = pick(w, "identity"), pick(w, "fbs")
        if van is None or fbs is None:
            continue
        head[f"reduction_21k_{w}ranks"] = fbs.get("straggler_reduction")
        head[f"vanilla_straggler_share_21k_{w}ranks"] = van["straggler"]["median"]
        head[f"fbs_straggler_share_21k_{w}ranks"] = fbs["straggler"]["median"]
        head[f"lower_bound_straggler_share_21k_{w}ranks"] = fbs["straggler_floor"]["median"]
        head[f"fbs_max_over_lower_bound_21k_{w}ranks"] = fbs["max_over_lb"]["median"]
        best = min(
            (r for r in main_rows if r["ranks"] == w and r["partitioner"] != "identity"),
            key=lambda r: r["straggler"]["median"],
        )
        head[f"best_partitioner_21k_{w}ranks"] = best["partitioner"]
        head[f"best_reduction_21k_{w}ranks"] = best.get("straggler_reduction")
    t = timing.get("fbs_partition_ms", {})
    head[f"planner_ms_{a.timing_ranks}ranks"] = t.get("median")
    head[f"planner_plan_call_ms_{a.timing_ranks}ranks"] = timing["fbs_planner_plan_ms"]["median"]
    head[f"vbs_planner_ms_{a.timing_ranks}ranks"] = timing["vbs_partition_ms"]["median"]
    head[f"kk_planner_ms_{a.timing_ranks}ranks"] = timing["kk_partition_ms"]["median"]
    head["cost_model_measured"] = info["measured"]
    if validation:
        res = np.array([v["residual"] for v in validation])
        head["validation_mean_abs_residual"] = float(np.mean(np.abs(res)))
        head["validation_max_abs_residual"] = float(np.max(np.abs(res)))
    # sensitivity: timing noise no partitioner removes (the max over W noisy ranks)
    noise_info = noise_estimate_ms(a.measured) if a.measured else None
    sigmas = a.rank_noise_ms
    if sigmas is None:
        sigmas = [1.0]
        if noise_info and noise_info["sigma_ms"]:
            sigmas = [round(noise_info["sigma_ms"], 3), 1.0]
    noise_rows: list[dict] = []
    for sg in sigmas:
        rs = sim(a, cm, a.ranks, [a.batch_size], a.max_uih, med, ["identity", "fbs"], None, sg)
        for r in rs:
            r["sweep"] = "noise_sensitivity"
            r["rank_noise_ms"] = sg
        noise_rows += rs
        for w in a.ranks:
            f = next(r for r in rs if r["ranks"] == w and r["partitioner"] == "fbs")
            head[f"reduction_21k_{w}ranks_noise_{sg:g}ms"] = f.get("straggler_reduction")
    if noise_info is not None:
        head["rank_noise_ms_estimate"] = noise_info["sigma_ms"]
    command = "python " + " ".join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    out = {
        "figure": "straggler_sim",
        "device": f"{cpu_name()} ({os.cpu_count()} cores)",
        "git_sha": git_sha(a.git_sha),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "cost_model": info,
        "workload": {
            "length_dist": "lognormal",
            "median_uih": f"max_uih / {a.median_div} (Fig. 2: fixed {a.fig2_median})",
            "sigma": a.sigma,
            "batch_size_per_rank": a.batch_size,
            "steps_per_point": a.steps,
            "plans": "partitioners plan with L^1.5 weights; '_cost' with the cost model's "
            "own per-sample costs; '_auto' runs AutoTune on alpha; every plan is scored "
            "with the cost model (noise-free: measured GPU times add jitter on top)",
            "planner_ms": "partition function (FBS) alone, sort_key = lengths, median of "
            "repeats on this shared CPU; planner_plan_call_ms is the whole Planner.plan",
        },
        "headline": head,
        "planner_timing": timing,
        "validation": validation,
        "noise_sensitivity": {
            "note": "identity and FBS at --ranks with per-rank Gaussian time noise (ms) "
            "added to every scored rank time (one draw per step, shared by both plans); "
            "not in the headline reductions above, which are noise-free",
            "estimate": noise_info,
            "rows": noise_rows,
        },
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
    }
    path = os.path.join(a.out, "straggler_sim.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=float)
    title = f"simulator, {a.batch_size} samples/rank, git {out['git_sha'][:10]}"
    plot(rows, info, validation, os.path.join(a.out, "straggler_sim.png"), title)
    print(json.dumps(head, indent=1, default=float))
    print(f"wrote {path} ({out['elapsed_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
