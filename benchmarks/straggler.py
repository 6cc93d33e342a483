"""Figure `straggler` (issue 4): measured straggler share vs max UIH, per partitioner.

One process-group launch runs every configuration: per max UIH (1K .. 32K) one
:class:`Trainer` is built and trained ``--steps`` steps once per partitioner
(vanilla = the identity plan, FBS = the headline, VBS, KK, and KK on the cost model
fitted to that max UIH's vanilla run), each time on the same batches (the step counter
is reset), so the partitioners are compared step by step on identical data. Per step
the trainer all-gathers every rank's dense (forward + backward, embedding exchange
excluded) time: ``rec["dense_ms_per_rank"]``, and the straggler share
``(max - mean) / max`` over ranks.

Reported per (max UIH, partitioner): median straggler share with a 95% bootstrap
interval over steps, the reduction vs vanilla (ratio of medians, paired bootstrap
interval), median dense times, tokens per rank, samples / bytes moved, planning and
balancing time, the planner's predicted straggler share and the one the fitted cost
model predicts for the plan that ran (the simulator's validation input). The cost
model ``a*tokens + b*sum(L^2) + c`` is fitted on the vanilla runs' per-rank
(tokens, sum L^2, dense ms) with its relative RMSE; ``cost_model_2gpu.json`` holds the
fit of all vanilla runs pooled, in model sequence length ``L`` (the planner's
composite length sums the two aligned UIH keys, ``2L``), for the simulator.

Writes ``<out>/straggler.json`` (rewritten after every run, so a run cut short still
leaves the finished rows), ``<out>/straggler.png`` and ``<out>/cost_model_2gpu.json``.

GPU (2 H200, one launch; ``--budget-s`` trims the steps of the non-headline max UIH
values if the projected time exceeds it; the headline 16K runs first with full steps):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=src \\
    python -m torch.distributed.run --nproc-per-node 2 benchmarks/straggler.py \\
        --out benchmarks/results

CPU smoke test (gloo, tiny sizes, a few steps, two max UIH values):

    PYTHONPATH=src python -m torch.distributed.run --nproc-per-node 2 \\
        benchmarks/straggler.py --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from _figure import device_name, git_sha
from freescale.balance.cost_model import CostModel
from freescale.balance.hook import BalanceHook
from freescale.balance.planner import BalanceConfig
from freescale.comm.base import Communicator
from freescale.config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig
from freescale.pipeline.distributed import init_distributed
from freescale.pipeline.trainer import Trainer, TrainerHook

HEADLINE_UIH = 16384
PARTITIONERS = ("identity", "fbs", "vbs", "kk", "kk_cost")
LABELS = {
    "identity": "vanilla",
    "fbs": "FBS",
    "vbs": "VBS",
    "kk": "KK",
    "kk_cost": "KK (cost model)",
}


# --------------------------------------------------------------------- statistics
def bootstrap_median(x: np.ndarray, n: int = 2000, seed: int = 0) -> dict[str, float]:
    """Median with a 95% percentile-bootstrap interval over steps."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return {"median": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n, x.size))
    meds = np.median(x[idx], axis=1)
    return {
        "median": float(np.median(x)),
        "lo": float(np.percentile(meds, 2.5)),
        "hi": float(np.percentile(meds, 97.5)),
        "n": int(x.size),
    }


def paired_ratio(base: dict[int, float], x: dict[int, float], n: int = 2000, seed: int = 1):
    """median(base) / median(x) over the steps both measured (by step number), with a
    paired bootstrap interval (the same steps resampled for both: the runs trained on
    the same batches)."""
    common = sorted(set(base) & set(x))
    m = len(common)
    if m == 0:
        return {"ratio": float("nan"), "lo": float("nan"), "hi": float("nan"), "n": 0}
    base = np.array([base[s] for s in common])
    x = np.array([x[s] for s in common])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, m, size=(n, m))
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.median(base[idx], axis=1) / np.median(x[idx], axis=1)
        point = float(np.median(base) / np.median(x)) if np.median(x) > 0 else float("inf")
    r = r[np.isfinite(r)]
    return {
        "ratio": point,
        "lo": float(np.percentile(r, 2.5)) if r.size else float("nan"),
        "hi": float(np.percentile(r, 97.5)) if r.size else float("nan"),
        "n": m,
    }


def share(rank_ms: np.ndarray) -> np.ndarray:
    """Straggler share per row of a [steps, W] array."""
    mx = rank_ms.max(axis=1)
    return np.where(mx > 0, (mx - rank_ms.mean(axis=1)) / np.maximum(mx, 1e-12), 0.0)


# ---------------------------------------------------------------------- collection
class Collector(TrainerHook):
    """Keeps what each step measured (after the balance hook wrote rec['balance'])."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_metrics(self, trainer, step, record):
        b = record.get("balance") or {}
        self.steps.append(
            {
                "step": step,
                "straggler": float(record["straggler_share"]),
                "dense_ms": [float(x) for x in record["dense_ms_per_rank"]],
                "data_ms": 1e3 * float(record["times"].get("data", 0.0)),
                "rank_tokens": b.get("rank_tokens"),
                "rank_sum_sq": b.get("rank_sum_sq"),
                "predicted": b.get("predicted_straggler"),
                "lower_bound": b.get("lower_bound_straggler"),
                "samples_moved": b.get("samples_moved", 0),
                "bytes_moved": b.get("bytes_moved", 0),
                "planning_ms": b.get("planning_ms", 0.0),
                "balance_ms": b.get("balance_ms", 0.0),
                "t": time.perf_counter(),
            }
        )

    def seconds_per_step(self) -> float:
        """Median wall time between steps (compilation and evaluation excluded)."""
        ts = np.array([s["t"] for s in self.steps])
        return float(np.median(np.diff(ts))) if ts.size > 2 else float("nan")


def balance_config(name: str) -> BalanceConfig:
    if name == "kk_cost":
        return BalanceConfig(partitioner="kk", use_cost_model=True, refit_every=0)
    return BalanceConfig(partitioner=name)


def train_config(a: argparse.Namespace, max_uih: int, world: int) -> TrainConfig:
    gb = a.per_rank * world
    return TrainConfig(
        data=DataConfig(
            seed=a.data_seed,
            global_batch_size=gb,
            num_items=a.num_items,
            max_uih=max_uih,
            median_uih=max(1, max_uih // a.median_div),
            sigma=a.sigma,
            length_dist="lognormal",
            eval_samples=gb,
        ),
        model=ModelConfig(
            embedding_dim=a.embedding_dim,
            num_heads=a.heads,
            num_layers=a.layers,
            max_positions=max(32_768, max_uih),
        ),
        sparse_optim=SparseOptimConfig(kind="rowwise_adagrad"),
        steps=a.steps,
        eval_every=0,
        log_every=10**9,
        progress=False,
        device=a.device,
        timing=a.timing,
    )


def fit_samples(steps: list[dict], warmup: int) -> list[tuple[float, float, float]]:
    """Per-rank (tokens, sum L^2, dense ms) of the measured steps (planner units)."""
    out = []
    for s in steps[warmup:]:
        if s["rank_tokens"] is None:
            continue
        for tok, sq, ms in zip(s["rank_tokens"], s["rank_sum_sq"], s["dense_ms"]):
            if tok > 0:
                out.append((tok, sq, ms))
    return out


def summarize(
    name: str,
    max_uih: int,
    steps: list[dict],
    warmup: int,
    wall_s: float,
    fit: CostModel | None,
    base: dict[int, float] | None,
) -> tuple[dict[str, Any], dict[int, float]]:
    """One row of the figure; also returns the measured share by step number."""
    m = steps[warmup:]
    strag = np.array([s["straggler"] for s in m])
    dense = np.array([s["dense_ms"] for s in m]) if m else np.zeros((0, 1))
    row: dict[str, Any] = {
        "max_uih": max_uih,
        "partitioner": name,
        "label": LABELS.get(name, name),
        "steps": len(steps),
        "steps_measured": len(m),
        "straggler_share": bootstrap_median(strag),
        "straggler_share_mean": float(strag.mean()) if strag.size else float("nan"),
        "dense_ms_max": bootstrap_median(dense.max(axis=1)) if m else None,
        "dense_ms_mean": float(np.median(dense.mean(axis=1))) if m else float("nan"),
        "wall_ms_per_step": 1e3 * wall_s / max(len(steps), 1),
        "data_ms_median": float(np.median([s["data_ms"] for s in m])) if m else float("nan"),
        "samples_moved_median": float(np.median([s["samples_moved"] for s in m])) if m else 0,
        "bytes_moved_median": float(np.median([s["bytes_moved"] for s in m])) if m else 0,
        "planning_ms_median": float(np.median([s["planning_ms"] for s in m])) if m else 0,
        "balance_ms_median": float(np.median([s["balance_ms"] for s in m])) if m else 0,
    }
    tok = [s["rank_tokens"] for s in m if s["rank_tokens"] is not None]
    if tok:
        row["tokens_per_rank_median"] = float(np.median(np.asarray(tok)))
    pred = [s["predicted"] for s in m if s["predicted"] is not None]
    if pred:
        row["planner_predicted_share_median"] = float(np.median(pred))
        row["planner_lower_bound_share_median"] = float(
            np.median([s["lower_bound"] for s in m if s["lower_bound"] is not None])
        )
    if fit is not None and tok:
        # what the vanilla-fitted cost model predicts for the plans that ran
        t = np.asarray([s["rank_tokens"] for s in m])
        q = np.asarray([s["rank_sum_sq"] for s in m])
        pred_ms = fit.rank_cost(t, q)
        ps = share(pred_ms)
        row["fit_predicted_share"] = bootstrap_median(ps)
        row["fit_residual_share_median"] = float(np.median(ps - strag))
        row["fit_rel_rmse_ms"] = float(
            np.sqrt(np.mean((pred_ms - dense) ** 2)) / max(float(dense.mean()), 1e-12)
        )
    by_step = {int(s["step"]): float(s["straggler"]) for s in m}
    if base is not None:
        row["reduction_vs_vanilla"] = paired_ratio(base, by_step)
    return row, by_step


# ---------------------------------------------------------------------- plotting
def plot(rows: list[dict], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [p for p in PARTITIONERS if any(r["partitioner"] == p for r in rows)]
    for i, name in enumerate(names):
        rs = sorted((r for r in rows if r["partitioner"] == name), key=lambda r: r["max_uih"])
        dodge = 1.0 + 0.04 * (i - (len(names) - 1) / 2)  # keep the error bars apart
        x = [r["max_uih"] * dodge for r in rs]
        med = np.array([100 * r["straggler_share"]["median"] for r in rs])
        lo = np.array([100 * r["straggler_share"]["lo"] for r in rs])
        hi = np.array([100 * r["straggler_share"]["hi"] for r in rs])
        axes[0].errorbar(
            x, med, yerr=[med - lo, hi - med], marker="o", capsize=3, label=LABELS[name]
        )
        dm = [r["dense_ms_max"]["median"] if r["dense_ms_max"] else np.nan for r in rs]
        axes[1].plot(x, dm, marker="o", label=LABELS[name])
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max UIH length")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("straggler share, % (median, 95% CI)")
    axes[1].set_ylabel("slowest rank's dense ms (median)")
    axes[0].legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--smoke", action="store_true", help="CPU/gloo, tiny sizes, few steps")
    p.add_argument("--max-uih", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--partitioners", default=",".join(PARTITIONERS))
    p.add_argument("--steps", type=int, default=200, help="steps per configuration")
    p.add_argument("--warmup", type=int, default=10, help="first steps not measured")
    p.add_argument("--min-steps", type=int, default=60, help="floor when trimming steps")
    p.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="time budget: steps of non-headline max UIH values are trimmed to fit it",
    )
    p.add_argument(
        "--hard-stop-s",
        type=float,
        default=480.0,
        help="skip a run that would end after this many seconds (outputs still written)",
    )
    p.add_argument("--per-rank", type=int, default=128)
    p.add_argument("--median-div", type=int, default=16, help="median UIH = max / this")
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--embedding-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-items", type=int, default=1_000_000)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--git-sha", default=None)
    p.add_argument(
        "--timing",
        choices=["auto", "sync", "events"],
        default="auto",
        help="per-rank dense time: 'events' = CUDA events read a step later (no host "
        "sync; the GPU default), 'sync' = host timers around a stream sync (CPU)",
    )
    p.add_argument(
        "--merge",
        default=None,
        help="an earlier straggler.json of the same workload: its rows for max UIH values "
        "not run now are kept (a sweep split over several device calls)",
    )
    a = p.parse_args(argv)
    if a.smoke:
        a.device = "cpu"
        if a.max_uih == p.get_default("max_uih"):
            a.max_uih = "64,128"
        if a.steps == p.get_default("steps"):
            a.steps = 8
        a.warmup = min(a.warmup, 2)
        a.min_steps = min(a.min_steps, 4)
        a.per_rank, a.embedding_dim, a.heads, a.layers = 8, 16, 2, 1
        a.num_items = 2000
    a.max_uih_list = [int(x) for x in a.max_uih.split(",") if x.strip()]
    a.partitioner_list = [x.strip() for x in a.partitioners.split(",") if x.strip()]
    if a.partitioner_list[0] != "identity":
        raise SystemExit("--partitioners must start with identity (vanilla: the baseline)")
    return a


def run_order(max_uih: list[int]) -> list[int]:
    """The headline max UIH first (it keeps full steps), then ascending."""
    rest = sorted(x for x in max_uih if x != HEADLINE_UIH)
    return ([HEADLINE_UIH] if HEADLINE_UIH in max_uih else []) + rest


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ctx = init_distributed(a.device)
    if a.timing == "auto":
        a.timing = "events" if ctx.device.type == "cuda" else "sync"
    rank, world = ctx.rank, ctx.world_size
    if world > 1:
        # the trainer balances host batches before their copy to the GPU, so the
        # balancer's group is gloo on every backend (as BalanceHook's own default)
        bal_comm = Communicator(dist.new_group(backend="gloo"), name="balance")
    else:
        bal_comm = Communicator(None, name="balance")
    os.makedirs(a.out, exist_ok=True)
    t_start = time.perf_counter()
    command = f"python -m torch.distributed.run --nproc-per-node {world} " + " ".join(
        [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    )
    meta = {
        "figure": "straggler",
        "device": device_name(ctx.device, world),
        "git_sha": git_sha(a.git_sha),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "torch": torch.__version__,
        "smoke": a.smoke,
        "workload": {
            "ranks": world,
            "per_rank_batch": a.per_rank,
            "length_dist": "lognormal",
            "median_uih": f"max_uih / {a.median_div}",
            "sigma": a.sigma,
            "embedding_dim": a.embedding_dim,
            "num_heads": a.heads,
            "num_layers": a.layers,
            "num_items": a.num_items,
            "steps": a.steps,
            "warmup_steps_dropped": a.warmup,
            "dense_time": "trainer rec['dense_ms_per_rank']: forward + backward minus the "
            "embedding exchange / lookup / update, "
            + (
                "from CUDA events on the compute stream (TrainConfig.timing='events')"
                if a.timing == "events"
                else "host timers around a compute-stream sync (TrainConfig.timing='sync')"
            ),
            "timing": a.timing,
            "straggler_share": "(max - mean) / max over ranks of dense time, per step",
        },
    }
    rows: list[dict] = []
    fits: dict[int, dict] = {}
    pooled: list[tuple[float, float, float]] = []
    per_step_cost: dict[int, float] = {}  # measured wall seconds per step, by max UIH
    skipped: list[dict] = []
    order = run_order(a.max_uih_list)
    n_keys = None
    kept_rows, kept_fits = load_merge(a.merge, meta, set(order))

    def est_step_s(mu: int) -> float:
        if mu in per_step_cost:
            return per_step_cost[mu]
        if not per_step_cost:
            return 0.0
        ref = max(per_step_cost)  # scale from the largest measured, superlinearly
        return per_step_cost[ref] * (mu / ref) ** 1.3

    def steps_for(mu: int, remaining: list[tuple[int, str]]) -> int:
        if mu == HEADLINE_UIH or not per_step_cost:
            return a.steps
        left = a.budget_s - (time.perf_counter() - t_start)
        need = sum(est_step_s(u) * a.steps for u, _ in remaining if u != HEADLINE_UIH)
        if need <= left or need <= 0:
            return a.steps
        return max(a.min_steps, int(a.steps * max(left, 0.0) / need))

    queue = [(mu, p) for mu in order for p in a.partitioner_list]

    def write() -> None:
        if rank != 0:
            return
        all_rows = sorted(kept_rows + rows, key=lambda r: r["max_uih"])
        all_fits = {**kept_fits, **fits}
        out = dict(meta, rows=all_rows, cost_model_fits=all_fits)
        out["headline"] = headline(all_rows, all_fits)
        out["skipped"] = skipped
        out["elapsed_s"] = time.perf_counter() - t_start
        with open(os.path.join(a.out, "straggler.json"), "w") as f:
            json.dump(out, f, indent=1, default=float)

    for mu in order:
        cfg = train_config(a, mu, world)
        tr = Trainer(cfg, ctx=ctx)
        n_keys = len(tr.uih_keys)
        fit: CostModel | None = None
        base: dict[int, float] | None = None
        for name in a.partitioner_list:
            remaining = queue[queue.index((mu, name)) :]
            steps = steps_for(mu, remaining)
            # every rank must agree on the step count (timings differ per rank)
            st = torch.tensor([steps], dtype=torch.int64, device=bal_comm.device)
            if world > 1:
                st = bal_comm.all_reduce(st, op=dist.ReduceOp.MIN, name="steps").wait()
            steps = int(st.item())
            if name == "kk_cost" and fit is None:
                continue
            # projected end of this run: skip it rather than be killed mid-way (every
            # rank decides alike: the max of the projections)
            proj = time.perf_counter() - t_start + est_step_s(mu) * steps
            pj = torch.tensor([proj], dtype=torch.float64, device=bal_comm.device)
            if world > 1:
                pj = bal_comm.all_reduce(pj, op=dist.ReduceOp.MAX, name="proj").wait()
            if float(pj.item()) > a.hard_stop_s:
                skipped.append({"max_uih": mu, "partitioner": name, "projected_s": proj})
                if rank == 0:
                    print(f"skipping max UIH {mu} {name}: projected end {proj:.0f} s", flush=True)
                continue
            hook = BalanceHook(
                balance_config(name),
                comm=bal_comm,
                cost_model=None if fit is None else CostModel(**fit.to_dict()),
            )
            col = Collector()
            tr.hooks = [hook, col]
            tr.step = 0  # the same batches for every partitioner
            t0 = time.perf_counter()
            tr.train(steps)
            wall = time.perf_counter() - t0
            warm = min(a.warmup, max(steps - 2, 0))
            if name == "identity":
                sps = col.seconds_per_step()
                per_step_cost[mu] = sps if math.isfinite(sps) else wall / max(steps, 1)
                samples = fit_samples(col.steps, warm)
                fit = CostModel()
                err = fit.fit(samples)
                half = len(samples) // 2
                hold = CostModel()
                hold.fit(samples[:half] if half >= 3 else samples)
                ho = np.asarray(samples[half:] or samples)
                ho_err = float(
                    np.sqrt(np.mean((hold.rank_cost(ho[:, 0], ho[:, 1]) - ho[:, 2]) ** 2))
                    / max(float(ho[:, 2].mean()), 1e-12)
                )
                fits[mu] = {
                    "a": fit.a,
                    "b": fit.b,
                    "c": fit.c,
                    "fit_error": err,
                    "holdout_error": ho_err,
                    "num_samples": len(samples),
                    "units": "ms per rank; tokens / sum L^2 in planner (composite) lengths",
                    "samples": [list(map(float, x)) for x in samples],  # for --merge
                }
                pooled.extend(samples)
            row, strag = summarize(name, mu, col.steps, warm, wall, fit, base)
            row["summary"] = hook.summary()
            if name == "identity":
                base = strag
            rows.append(row)
            if rank == 0:
                s = row["straggler_share"]
                red = row.get("reduction_vs_vanilla", {}).get("ratio", 1.0)
                print(
                    f"max UIH {mu:6d} {LABELS.get(name, name):16s} steps {steps:4d} "
                    f"straggler {100 * s['median']:6.2f}% [{100 * s['lo']:.2f}, "
                    f"{100 * s['hi']:.2f}]  x{red:.2f} vs vanilla  slowest dense "
                    f"{row['dense_ms_max']['median']:.2f} ms  wall {wall:.1f} s  "
                    f"(elapsed {time.perf_counter() - t_start:.0f} s)",
                    flush=True,
                )
            write()
        # its two process groups stay alive (destroying NCCL subgroups mid-job is not
        # worth a hang risk; 2 per max UIH is a handful)
        tr.close()
        del tr
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # pooled fit for the simulator, converted to model sequence length L (composite =
    # n_keys * L for aligned keys): a*k*L + b*k^2*L^2 + c
    for f in kept_fits.values():
        pooled.extend(tuple(x) for x in f.get("samples", []))
    if pooled and rank == 0:
        cm = CostModel()
        err = cm.fit(pooled)
        k = n_keys or 1
        sim = CostModel(a=cm.a * k, b=cm.b * k * k, c=cm.c, fitted=True, fit_error=err)
        sim.num_fit_samples = len(pooled)
        d = sim.to_dict()
        d.update(
            device=meta["device"],
            git_sha=meta["git_sha"],
            date=meta["date"],
            units="ms per rank = a*sum(L) + b*sum(L^2) + c; L = model sequence length "
            f"(one token per interaction; the planner's composite length is {k}L)",
            source="benchmarks/straggler.py: vanilla runs of every max UIH, pooled",
            max_uih=sorted(set(order) | set(kept_fits)),
            figure="cost_model_2gpu",
            command=meta["command"],
            rows=[
                {"max_uih": int(mu), **{k: v for k, v in f.items() if k != "samples"}}
                for mu, f in sorted(
                    (kv for kv in {**kept_fits, **fits}.items() if str(kv[0]).isdigit()),
                    key=lambda kv: int(kv[0]),
                )
            ],
            headline={
                "a": sim.a,
                "b": sim.b,
                "c": sim.c,
                "fit_error": err,
                "num_fit_samples": len(pooled),
            },
        )
        with open(os.path.join(a.out, "cost_model_2gpu.json"), "w") as f:
            json.dump(d, f, indent=1)
        fits["pooled"] = {"a": cm.a, "b": cm.b, "c": cm.c, "fit_error": err}
    write()
    if rank == 0:
        title = f"{meta['device']}, {a.per_rank} samples/rank, git {meta['git_sha'][:10]}"
        if plot(rows, os.path.join(a.out, "straggler.png"), title):
            print(f"wrote {a.out}/straggler.png", flush=True)
        print(json.dumps(headline(rows, fits), indent=1), flush=True)
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    return 0


def load_merge(path: str | None, meta: dict, running: set[int]) -> tuple[list[dict], dict]:
    """Rows and per-max-UIH fits of an earlier run to keep (``--merge``): same device
    and workload (step count aside), max UIH values this run does not measure."""
    if not path:
        return [], {}
    with open(path) as f:
        prev = json.load(f)
    mine = {k: v for k, v in meta["workload"].items() if k != "steps"}
    theirs = {k: v for k, v in prev.get("workload", {}).items() if k != "steps"}
    if mine != theirs or prev.get("device") != meta["device"]:
        raise SystemExit(f"--merge {path}: different device or workload; not merged")
    rows = [r for r in prev.get("rows", []) if r["max_uih"] not in running]
    fits = {}
    for k, v in prev.get("cost_model_fits", {}).items():
        if k != "pooled" and int(k) not in running:
            if "samples" not in v:
                raise SystemExit(f"--merge {path}: fit of max UIH {k} has no samples")
            fits[int(k)] = v
    meta["merged_from"] = {
        "git_sha": prev.get("git_sha"),
        "date": prev.get("date"),
        "command": prev.get("command"),
        "max_uih": sorted({r["max_uih"] for r in rows}),
    }
    return rows, fits


def headline(rows: list[dict], fits: dict) -> dict[str, Any]:
    """16K headline (or the largest max UIH <= 16K measured, named in the keys)."""
    mus = sorted({r["max_uih"] for r in rows})
    if not mus:
        return {}
    mu = HEADLINE_UIH if HEADLINE_UIH in mus else max(mus)
    tag = "16k" if mu == HEADLINE_UIH else f"{mu}"

    def get(p: str) -> dict | None:
        return next((r for r in rows if r["max_uih"] == mu and r["partitioner"] == p), None)

    van, fbs = get("identity"), get("fbs")
    out: dict[str, Any] = {"max_uih": mu}
    if van is not None:
        out[f"vanilla_straggler_share_{tag}"] = van["straggler_share"]["median"]
        out[f"vanilla_straggler_share_{tag}_ci95"] = [
            van["straggler_share"]["lo"],
            van["straggler_share"]["hi"],
        ]
    if fbs is not None:
        out[f"fbs_straggler_share_{tag}"] = fbs["straggler_share"]["median"]
        out[f"fbs_straggler_share_{tag}_ci95"] = [
            fbs["straggler_share"]["lo"],
            fbs["straggler_share"]["hi"],
        ]
        red = fbs.get("reduction_vs_vanilla", {})
        out[f"reduction_{tag}"] = red.get("ratio")
        out[f"reduction_{tag}_ci95"] = [red.get("lo"), red.get("hi")]
    for p in ("vbs", "kk", "kk_cost"):
        r = get(p)
        if r is not None:
            out[f"{p}_straggler_share_{tag}"] = r["straggler_share"]["median"]
    fit = fits.get("pooled") or fits.get(mu)
    if fit is not None:
        out["cost_model_fit_error"] = fit["fit_error"]
        out[f"cost_model_fit_error_{tag}"] = fits.get(mu, {}).get("fit_error")
    if not math.isfinite(out.get(f"reduction_{tag}") or float("nan")):
        out["note"] = "FBS median straggler share is 0: reduction unbounded"
    return out


if __name__ == "__main__":
    sys.exit(main())
