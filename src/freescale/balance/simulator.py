"""Straggler simulator of the sequence load balancer (``freescale simulate``).

Owns: :class:`SimConfig`, length sources (synthetic log-normal / power-law with the
same knobs as :class:`freescale.config.DataConfig`, or a file with one history
length per line, e.g. per-user MovieLens history lengths), :func:`simulate` (sweeps
of rank count, local batch size and max UIH; per step and partitioner the predicted
per-rank cost, straggler share, max over lower bound, padding sparsity, movement and
planning time; medians and 95% intervals over steps), the table printer and
:func:`simulate_main`, the CLI entry.

Costs come from a :class:`CostModel` (defaults, or a JSON ``{a, b, c}`` fit file):
the *truth* every plan is scored with. Partitioners plan with ``L^alpha`` weights;
a ``_cost`` suffix (``kk_cost``, ``vbs_cost``, ...) plans with the cost model's own
per-sample costs instead; an ``_auto`` suffix (``vbs_auto``) plans with ``L^alpha``
and lets :class:`AutoTune` move alpha from step to step, fed with the simulated
per-rank times (the truth, optionally with multiplicative noise ``time_noise``).
``rank_noise_ms`` adds per-step, per-rank Gaussian noise (ms, the same draw for every
partitioner of a step) to the scored rank times: a sensitivity to timing variation that
no partitioner can remove (the max over W noisy ranks grows with W; off by default).
Nothing here touches tensors, ranks or devices.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from freescale.balance.cost_model import (
    DEFAULT_COST_MODEL,
    AutoTune,
    AutoTuneConfig,
    CostModel,
)
from freescale.balance.partitioners import Assignment, get_partitioner

__all__ = [
    "SimConfig",
    "sample_lengths",
    "load_lengths",
    "simulate",
    "format_table",
    "simulate_main",
]


@dataclass
class SimConfig:
    """One simulator run: the product of ``ranks x batch_sizes x max_uih`` is swept."""

    ranks: list[int] = field(default_factory=lambda: [8, 64, 256, 1024])
    batch_sizes: list[int] = field(default_factory=lambda: [128])  # local, per rank
    max_uih: list[int] = field(default_factory=lambda: [512])
    steps: int = 50
    length_dist: str = "lognormal"  # lognormal | powerlaw | file
    median_uih: int = 48
    sigma: float = 1.0
    powerlaw_alpha: float = 1.2
    min_uih: int = 1
    lengths_file: str | None = None
    partitioners: list[str] = field(
        default_factory=lambda: ["identity", "fbs", "vbs", "vbs_auto", "kk", "kk_cost"]
    )
    alpha: float = 1.5
    time_noise: float = 0.0  # relative std of simulated rank times fed to AutoTune
    rank_noise_ms: float = 0.0  # std of additive per-rank time noise in the scored times
    cost_model: CostModel = field(default_factory=lambda: CostModel(**asdict(DEFAULT_COST_MODEL)))
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length_dist not in ("lognormal", "powerlaw", "file"):
            raise ValueError(f"unknown length_dist '{self.length_dist}'")
        if self.length_dist == "file" and not self.lengths_file:
            raise ValueError("length_dist='file' needs lengths_file")
        for p in self.partitioners:
            get_partitioner(_base(p))
        if self.rank_noise_ms < 0:
            raise ValueError(f"rank_noise_ms must be >= 0, got {self.rank_noise_ms}")
        if self.steps < 1 or min(self.ranks) < 1 or min(self.batch_sizes) < 1:
            raise ValueError("steps, ranks and batch sizes must be >= 1")


def _base(name: str) -> str:
    return name.removesuffix("_cost").removesuffix("_auto")


# ------------------------------------------------------------------ length sources
def load_lengths(path: str) -> np.ndarray:
    """Positive integers, one per line (commas / blanks also separate); '#' comments."""
    vals: list[int] = []
    with open(path) as f:
        for line in f:
            line = line.split("#", 1)[0].replace(",", " ")
            vals.extend(int(float(tok)) for tok in line.split())
    arr = np.asarray(vals, dtype=np.int64)
    arr = arr[arr > 0]
    if arr.size == 0:
        raise ValueError(f"{path}: no positive lengths found")
    return arr


def sample_lengths(
    rng: np.random.Generator,
    n: int,
    cfg: SimConfig,
    max_uih: int,
    pool: np.ndarray | None = None,
) -> np.ndarray:
    """``n`` UIH lengths clipped to ``[min_uih, max_uih]`` (int64)."""
    if cfg.length_dist == "file":
        if pool is None:
            raise ValueError("file lengths need a pool")
        raw = rng.choice(pool, size=n, replace=True).astype(np.float64)
    elif cfg.length_dist == "lognormal":
        raw = np.exp(rng.normal(math.log(cfg.median_uih), cfg.sigma, size=n))
    else:  # Pareto with tail index powerlaw_alpha and the given median
        a = cfg.powerlaw_alpha
        xm = cfg.median_uih / 2.0 ** (1.0 / a)
        raw = xm * (1.0 + rng.pareto(a, size=n))
    return np.clip(np.rint(raw), cfg.min_uih, max_uih).astype(np.int64)


# ---------------------------------------------------------------------- scoring
def _score(
    assignment: Assignment,
    lengths: np.ndarray,
    cm: CostModel,
    world: int,
    home: np.ndarray,
    noise: np.ndarray | None = None,
) -> tuple[dict[str, float], np.ndarray, np.ndarray]:
    """Metrics of one plan, plus its per-rank true cost and mean sample length.
    ``noise``: per-rank additive time noise (ms) in the scored costs (clipped at 0)."""
    lf = lengths.astype(np.float64)
    tokens = assignment.rank_sums(lf)
    sum_sq = assignment.rank_sums(lf * lf)
    cost = cm.a * tokens + cm.b * sum_sq + cm.c
    if noise is not None:
        cost = np.maximum(cost + noise, 0.0)
    mx = float(cost.max())
    per_sample = cm.a * lf + cm.b * lf * lf
    lb = max(float(per_sample.max()), float(per_sample.sum()) / world) + cm.c
    counts = assignment.counts
    full = counts > 0
    sorted_len = lengths[assignment.order]
    local_max = np.zeros(world, dtype=np.int64)
    if sorted_len.size:
        starts = assignment.offsets[:-1][full]
        local_max[full] = np.maximum.reduceat(sorted_len, starts)
    padded = float((counts * local_max).sum())
    mean_len = np.where(full, tokens / np.maximum(counts, 1), 0.0)
    metrics = {
        "straggler": (mx - float(cost.mean())) / mx if mx > 0 else 0.0,
        # no partition can go below this share: (LB - mean) / LB
        "straggler_floor": max(0.0, (lb - float(cost.mean())) / lb) if lb > 0 else 0.0,
        "max_over_lb": mx / lb if lb > 0 else 1.0,
        "max_cost": mx,
        "padding_sparsity": 1.0 - float(lf.sum()) / padded if padded > 0 else 0.0,
        "moved_share": float((assignment.rank_of != home).mean()) if home.size else 0.0,
        "empty_ranks": float((~full).sum()),
        "max_count": float(counts.max()),
    }
    return metrics, cost, mean_len


def _summary(values: list[float]) -> dict[str, float]:
    v = np.asarray(values, dtype=np.float64)
    return {
        "median": float(np.median(v)),
        "p2.5": float(np.percentile(v, 2.5)),
        "p97.5": float(np.percentile(v, 97.5)),
    }


def simulate(cfg: SimConfig, lengths_pool: Sequence[int] | None = None) -> list[dict]:
    """One row per (ranks, batch size, max UIH, partitioner); see module docstring."""
    pool = None
    if lengths_pool is not None:
        pool = np.asarray(lengths_pool, dtype=np.int64)
    elif cfg.length_dist == "file":
        pool = load_lengths(cfg.lengths_file)  # type: ignore[arg-type]
    cm = cfg.cost_model
    if not cm.fitted:
        raise ValueError("the simulator scores plans with a fitted cost model {a, b, c}")
    rows: list[dict] = []
    for world in cfg.ranks:
        for bsz in cfg.batch_sizes:
            for max_uih in cfg.max_uih:
                n = world * bsz
                home = np.repeat(np.arange(world, dtype=np.int64), bsz)
                acc: dict[str, dict[str, list[float]]] = {p: {} for p in cfg.partitioners}
                tuners = {
                    p: AutoTune(
                        AutoTuneConfig(
                            alpha=cfg.alpha,
                            alpha_min=min(0.5, cfg.alpha),
                            alpha_max=max(3.0, cfg.alpha),
                        )
                    )
                    for p in cfg.partitioners
                    if p.endswith("_auto")
                }
                noise_rng = np.random.default_rng([cfg.seed, world, bsz, max_uih, 7])
                cap_sparsity: list[float] = []
                for step in range(cfg.steps):
                    rng = np.random.default_rng([cfg.seed, step, max_uih])
                    ln = sample_lengths(rng, n, cfg, max_uih, pool)
                    cap_sparsity.append(1.0 - float(ln.sum()) / (n * max_uih))
                    w_alpha = CostModel(alpha=cfg.alpha).sample_costs(ln)
                    w_cost = cm.sample_costs(ln)
                    step_noise = None
                    if cfg.rank_noise_ms > 0:  # one draw per step, shared by the plans
                        step_noise = cfg.rank_noise_ms * np.random.default_rng(
                            [cfg.seed, step, world, bsz, max_uih, 11]
                        ).normal(size=world)
                    for name in cfg.partitioners:
                        fn = get_partitioner(_base(name))
                        tuner = tuners.get(name)
                        if name.endswith("_cost"):
                            costs = w_cost
                        elif tuner is not None:
                            costs = CostModel(alpha=tuner.alpha).sample_costs(ln)
                        else:
                            costs = w_alpha
                        t0 = time.perf_counter()
                        a = fn(costs, world, sort_key=ln)
                        ms = (time.perf_counter() - t0) * 1e3
                        s, rank_cost, mean_len = _score(a, ln, cm, world, home, step_noise)
                        s["plan_ms"] = ms
                        if tuner is not None:
                            s["alpha"] = tuner.alpha
                            t = rank_cost
                            if cfg.time_noise > 0:
                                t = t * np.exp(cfg.time_noise * noise_rng.normal(size=t.size))
                            tuner.update(t, mean_len)
                        for k, v in s.items():
                            acc[name].setdefault(k, []).append(v)
                base_strag = None
                for name in cfg.partitioners:
                    row = {
                        "ranks": world,
                        "batch_size": bsz,
                        "max_uih": max_uih,
                        "partitioner": name,
                        "steps": cfg.steps,
                        "sparsity_vs_max_uih": _summary(cap_sparsity)["median"],
                    }
                    for k, v in acc[name].items():
                        row[k] = _summary(v)
                    if "alpha" in acc[name]:
                        row["final_alpha"] = acc[name]["alpha"][-1]
                    if name == "identity":
                        base_strag = row["straggler"]["median"]
                    rows.append(row)
                if base_strag is not None:
                    for row in rows[-len(cfg.partitioners) :]:
                        m = row["straggler"]["median"]
                        row["straggler_reduction"] = base_strag / m if m > 0 else float("inf")
    return rows


def format_table(rows: list[dict]) -> str:
    """Fixed-width text table of the medians (95% interval for straggler share)."""
    head = (
        f"{'ranks':>6} {'B':>5} {'maxL':>6} {'partitioner':<11} {'straggler % [95% int]':>24} "
        f"{'x vanilla':>9} {'floor %':>7} {'max/LB':>7} {'pad %':>6} {'moved %':>7} "
        f"{'empty':>5} {'ms':>7}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        s = r["straggler"]
        red = r.get("straggler_reduction")
        red_s = "" if red is None else (">999x" if red > 999 else f"{red:.1f}x")
        out.append(
            f"{r['ranks']:>6} {r['batch_size']:>5} {r['max_uih']:>6} {r['partitioner']:<11} "
            f"{100 * s['median']:>7.2f} [{100 * s['p2.5']:6.2f},{100 * s['p97.5']:6.2f}] "
            f"{red_s:>9} {100 * r['straggler_floor']['median']:>7.2f} "
            f"{r['max_over_lb']['median']:>7.3f} "
            f"{100 * r['padding_sparsity']['median']:>6.1f} "
            f"{100 * r['moved_share']['median']:>7.1f} {r['empty_ranks']['median']:>5.0f} "
            f"{r['plan_ms']['median']:>7.3f}"
        )
    return "\n".join(out)


# --------------------------------------------------------------------------- CLI
def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="freescale simulate",
        description="Simulate per-rank dense cost and straggler share of balancing "
        "partitioners over many steps (no GPU, no torch.distributed).",
    )
    p.add_argument("--ranks", type=_ints, default=[8, 64, 256, 1024], help="e.g. 8,64,256")
    p.add_argument("--batch-size", type=_ints, default=[128], help="local batch size(s)")
    p.add_argument("--max-uih", type=_ints, default=[512], help="max UIH length(s)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dist", choices=["lognormal", "powerlaw"], default="lognormal")
    p.add_argument("--median", type=int, default=48, help="median UIH length")
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal shape")
    p.add_argument("--powerlaw-alpha", type=float, default=1.2, help="Pareto tail index")
    p.add_argument("--min-uih", type=int, default=1)
    p.add_argument("--lengths-file", default=None, help="one history length per line")
    p.add_argument(
        "--partitioners",
        default="identity,fbs,vbs,vbs_auto,kk,kk_cost",
        help="'_cost' suffix: cost-model weights; '_auto': AutoTune alpha over the steps",
    )
    p.add_argument("--time-noise", type=float, default=0.0, help="AutoTune input noise")
    p.add_argument(
        "--rank-noise-ms",
        type=float,
        default=0.0,
        help="std (ms) of per-rank, per-step time noise added to the scored times",
    )
    p.add_argument("--alpha", type=float, default=1.5, help="L^alpha planning weights")
    p.add_argument("--cost-model", default=None, help="JSON fit file {a, b, c}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write config + rows as JSON here")
    p.add_argument("--quiet", action="store_true", help="no table on stdout")
    return p


def simulate_main(argv: list[str] | None = None) -> int:
    """``freescale simulate`` entry; returns a process exit code."""
    args = _build_parser().parse_args(argv)
    try:
        cm = CostModel.load(args.cost_model) if args.cost_model else None
        cfg = SimConfig(
            ranks=args.ranks,
            batch_sizes=args.batch_size,
            max_uih=args.max_uih,
            steps=args.steps,
            length_dist="file" if args.lengths_file else args.dist,
            median_uih=args.median,
            sigma=args.sigma,
            powerlaw_alpha=args.powerlaw_alpha,
            min_uih=args.min_uih,
            lengths_file=args.lengths_file,
            partitioners=[x.strip() for x in args.partitioners.split(",") if x.strip()],
            alpha=args.alpha,
            time_noise=args.time_noise,
            rank_noise_ms=args.rank_noise_ms,
            seed=args.seed,
            **({"cost_model": cm} if cm is not None else {}),
        )
        t0 = time.perf_counter()
        rows = simulate(cfg)
        elapsed = time.perf_counter() - t0
    except (ValueError, OSError) as e:
        print(f"freescale simulate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        cmd = cfg.cost_model
        print(
            f"cost model: {cmd.a:.3g}*tokens + {cmd.b:.3g}*sum(L^2) + {cmd.c:.3g} per rank; "
            f"lengths: {cfg.length_dist}; {cfg.steps} steps; alpha={cfg.alpha}; "
            f"{elapsed:.2f} s"
        )
        print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": asdict(cfg), "elapsed_s": elapsed, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(simulate_main())
