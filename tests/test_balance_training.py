"""Tier 2 of the numerical contract with the load balancer in the training loop
(DESIGN.md section 1): training with :class:`BalanceHook` (FBS, VBS, KK and KK on a
cost model refitted from measured times) at 2 and 4 gloo ranks gives parameters (full
embedding tables + dense weights) equal to unbalanced training

* in float32: within the vanilla-vs-vanilla noise floor, measured here by legal
  in-rank reorderings (samples permuted inside each rank) of the same run;
* in float64: within 1e-12 (max over tensors of max |diff| / max |param|).

Samples must really move (so an identity plan cannot pass), shadow mode must be
bitwise vanilla, and a balancer that duplicates or drops one sample must fail the
comparison (mutation check). The per-step ``rec["balance"]`` record reaches the
JSON-lines log.

Every parameter is compared. (The reference model has no attention *key* bias: softmax
ignores it, its true gradient is exactly zero, and Adam would turn the rounding noise
in that gradient into lr-sized updates in every run, vanilla included.)
"""

from __future__ import annotations

import json

import pytest
import torch

from freescale.balance.cost_model import CostModel
from freescale.balance.hook import BalanceHook
from freescale.balance.planner import BalanceConfig
from freescale.config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig
from freescale.pipeline.data_stage import METRICS_LAG
from freescale.pipeline.trainer import Trainer, TrainerHook

F64_TOL = 1e-12  # DESIGN.md section 1, tier 2
# float32: balanced runs move samples *between* ranks (DDP partial sums, owner-side
# gradient order and per-rank GEMM shapes all change), a reordering only inside ranks;
# both are reassociation noise of the same size, allowed up to this factor of the
# largest of several reorderings. The mutation must exceed the bound by MUTATION_MARGIN.
F32_FACTOR = 10.0
# Known deviation, traced: VBS lands at 17-24x the in-rank floor in float32, identically
# at 2 and 4 ranks, on ONE pos-embedding row (position 46: only the first token of the
# longest samples uses it). Its gradient is a near-cancelling sum (Adam |m| ~1e-5 from
# terms ~1e-3), so ulp-level differences in per-token values are amplified ~100x. VBS
# puts all long samples on one rank, changing that rank's GEMM row counts and the
# padded-attention groups; an in-rank reordering keeps every rank's shapes, so the floor
# it measures cannot see this noise source. float64: 1.2e-14 absolute on that row
# (1.2e-13 relative), inside tier 2's 1e-12; that bound is not relaxed for anyone.
F32_FACTOR_VBS = 50.0
MUTATION_MARGIN = 20.0
# name -> (config, starting cost model). kk_cost plans with a*L + b*L^2 from step 1 and
# refits the model from the measured dense times after every step (plan s learns from
# the steps <= s - METRICS_LAG, the same on every rank whatever the threads' timing)
START_COST_MODEL = CostModel(a=1.0, b=0.1, c=0.0, fitted=True)
PARTITIONERS = {
    "fbs": (BalanceConfig(partitioner="fbs"), None),
    "vbs": (BalanceConfig(partitioner="vbs"), None),
    "kk": (BalanceConfig(partitioner="kk"), None),
    # the diagnostic: legal cross-rank moves that ignore costs (the cross-rank floor)
    "shuffle": (BalanceConfig(partitioner="shuffle"), None),
    "kk_cost": (
        BalanceConfig(partitioner="kk", use_cost_model=True, refit_every=1),
        START_COST_MODEL,
    ),
    # swaps from the home placement; and the same planning with the refitted cost model
    # (bench e2e's freescale_sticky_cost)
    "sticky": (BalanceConfig(partitioner="sticky"), None),
    # swaps balancing total length and total squared length (no cost model needed)
    "sticky2": (BalanceConfig(partitioner="sticky2"), None),
    "sticky_cost": (
        BalanceConfig(partitioner="sticky", use_cost_model=True, refit_every=1),
        START_COST_MODEL,
    ),
}
STEPS = 6  # > METRICS_LAG: the refitted cost model plans the last steps
REORDER_SEEDS = (1, 2, 3)


def skewed_config(dtype: str, steps: int = STEPS, log_path: str | None = None) -> TrainConfig:
    """tests/test_trainer.py's tiny config with more, more unevenly long histories
    (log-normal sigma 1.5), so every partitioner moves samples."""
    return TrainConfig(
        data=DataConfig(
            seed=7,
            global_batch_size=16,
            num_items=300,
            num_actions=3,
            median_uih=4,
            sigma=1.5,
            max_uih=48,
            num_candidates=3,
            eval_samples=16,
        ),
        model=ModelConfig(
            embedding_dim=8, num_layers=1, num_heads=2, max_positions=64, dtype=dtype
        ),
        sparse_optim=SparseOptimConfig(kind="rowwise_adagrad", lr=0.05),
        steps=steps,
        eval_every=0,
        log_every=1,
        log_path=log_path,
        progress=False,
        device="cpu",
        dense_lr=1e-2,
    )


# ---------------------------------------------------------------------- hooks
class Reorder(TrainerHook):
    """A legal placement change: a seeded permutation of the samples inside a rank."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def on_batch(self, trainer, step, batch):
        g = torch.Generator().manual_seed(self.seed * 7919 + step * 31 + trainer.rank)
        perm = torch.randperm(batch.batch_size, generator=g)
        if batch.batch_size > 1 and torch.equal(perm, torch.arange(batch.batch_size)):
            perm = perm.flip(0)
        out = batch.select(perm)
        out.extras = dict(batch.extras)
        return out


class WrongBalancer(BalanceHook):
    """Mutation: a balancer whose exchange loses (``drop``) or duplicates one sample
    on the last rank at step 2."""

    def __init__(self, config: BalanceConfig, mode: str) -> None:
        super().__init__(config)
        self.mode = mode

    def end_batch(self, trainer, step, handle):  # stage III: where samples move
        out = super().end_batch(trainer, step, handle)
        if step == 2 and trainer.rank == trainer.world_size - 1 and out.batch_size > 1:
            n = out.batch_size
            idx = list(range(n - 1)) if self.mode == "drop" else [0, *range(n)]
            extras = out.extras
            out = out.select(torch.tensor(idx))
            out.extras = extras
        return out


class Recorder(TrainerHook):
    """Keeps each step's ``rec['balance']`` and the local batch's sample ids."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.ids: list[list[int]] = []

    def on_batch(self, trainer, step, batch):
        self.ids.append(batch.sample_ids.tolist())
        assert "global_candidates" in batch.extras
        return batch

    def on_metrics(self, trainer, step, record):
        self.records.append(
            {
                "balance": record.get("balance"),
                "straggler_share": record["straggler_share"],
                "samples": record["samples"],
            }
        )


# ------------------------------------------------------------------- workers
def _state(tr: Trainer) -> dict:
    return {
        "tables": {n: (lo, t.clone()) for n, (lo, t) in tr.sparse.shard_tables().items()},
        "dense": {k: v.detach().clone() for k, v in tr.dense.state_dict().items()},
    }


def _hooks(spec: tuple) -> list[TrainerHook]:
    kind = spec[0]
    if kind == "vanilla":
        return []
    if kind == "reorder":
        return [Reorder(spec[1])]
    if kind == "balance":
        cm = None if spec[2] is None else CostModel(**spec[2].to_dict())
        return [BalanceHook(spec[1], cost_model=cm), Recorder()]
    if kind == "wrong":
        return [WrongBalancer(spec[1], spec[2]), Recorder()]
    raise ValueError(kind)


def train_variants(rank, world, dtype: str, variants: dict[str, tuple], log_path=None):
    """Train the skewed config once per variant on this rank; return per variant the
    final parameters, the balance counters and the recorded step metrics."""
    out = {}
    for name, spec in variants.items():
        hooks = _hooks(spec)
        cfg = skewed_config(dtype, log_path=log_path if name == "log" else None)
        tr = Trainer(cfg, hooks=hooks)
        summary = tr.train()
        tr.close()
        res = {"state": _state(tr)}
        if hooks and isinstance(hooks[0], BalanceHook):
            res["counters"] = hooks[0].summary()
            res["summary_balance"] = summary.get("balance")
            res["records"] = hooks[1].records
            res["ids"] = hooks[1].ids
            res["plan_cost_models"] = [r["balance"]["cost_model"] for r in hooks[1].records]
        out[name] = res
    return out


# ---------------------------------------------------------------- comparison
def _full_tables(results: list[dict], name: str) -> dict[str, torch.Tensor]:
    tabs = results[0][name]["state"]["tables"]
    return {n: torch.cat([r[name]["state"]["tables"][n][1] for r in results]) for n in tabs}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))


def compare(results: list[dict], a: str, b: str) -> tuple[float, str]:
    """(max relative difference over tables + dense params, name of the worst tensor)."""
    worst, where = 0.0, ""
    ta, tb = _full_tables(results, a), _full_tables(results, b)
    for n in ta:
        d = _rel(ta[n], tb[n])
        if d > worst:
            worst, where = d, f"table {n}"
    ma, mb = results[0][a]["state"]["dense"], results[0][b]["state"]["dense"]
    for k in ma:
        d = _rel(ma[k], mb[k])
        if d > worst:
            worst, where = d, k
    return worst, where


def _variants(dtype: str, world: int) -> dict[str, tuple]:
    v: dict[str, tuple] = {"vanilla": ("vanilla",)}
    if dtype == "float32":
        v.update({f"reorder{s}": ("reorder", s) for s in REORDER_SEEDS})
    v.update({name: ("balance", cfg, cm) for name, (cfg, cm) in PARTITIONERS.items()})
    mode = "duplicate" if world == 2 else "drop"
    v[f"wrong_{mode}"] = ("wrong", BalanceConfig(partitioner="fbs"), mode)
    if dtype == "float32" and world == 2:
        v["shadow"] = ("balance", BalanceConfig(partitioner="fbs", shadow=True), None)
        v["log"] = ("balance", BalanceConfig(partitioner="vbs"), None)
    return v


def _check_moved(res: list[dict], name: str) -> int:
    c = res[0][name]["counters"]
    for r in res[1:]:  # every rank counts the same (global) plans
        assert r[name]["counters"] == c
    assert c["samples_moved_total"] > 0 and c["steps_balanced"] > 0, f"{name}: nothing moved"
    assert res[0][name]["summary_balance"] == c
    # the ranks together trained each step's global batch exactly once
    steps = len(res[0][name]["ids"])
    for s in range(steps):
        ids = sorted(i for r in res for i in r[name]["ids"][s])
        assert ids == list(range(16)), f"{name} step {s + 1}: sample ids {ids}"
    return int(c["samples_moved_total"])


@pytest.mark.parametrize("world", [2, 4])
def test_balanced_training_matches_vanilla(world, pool2, pool4, tmp_path):
    pool = {2: pool2, 4: pool4}[world]
    log = str(tmp_path / "train.jsonl")
    r64 = pool.run(train_variants, "float64", _variants("float64", world))
    r32 = pool.run(train_variants, "float32", _variants("float32", world), log)

    # ---- float32 noise floor: legal in-rank reorderings vs vanilla
    floors = [compare(r32, f"reorder{s}", "vanilla") for s in REORDER_SEEDS]
    floor = max(f[0] for f in floors)
    assert floor > 0, "reordering changed nothing: the floor would not be measured"
    tol32 = F32_FACTOR * floor
    print(
        f"\n[{world} ranks] float32 noise floor (in-rank reorderings, max rel diff): "
        + ", ".join(f"{f[0]:.3g}" for f in floors)
        + f"; tolerance {tol32:.3g}"
    )
    for name in PARTITIONERS:
        moved = _check_moved(r32, name)
        moved64 = _check_moved(r64, name)
        d32, where = compare(r32, name, "vanilla")
        d64, where64 = compare(r64, name, "vanilla")
        print(
            f"[{world} ranks] {name:8s} moved {moved:3d}/{moved64:3d} samples; float32 "
            f"{d32:.3g} ({d32 / floor:.2f}x floor, {where}); "
            f"float64 {d64:.3g} ({where64})"
        )
        bound = F32_FACTOR_VBS * floor if name == "vbs" else tol32
        assert d32 <= bound, f"{name}: float32 {d32:.3g} > {bound:.3g} ({where})"
        assert d64 <= F64_TOL, f"{name}: float64 {d64:.3g} > {F64_TOL} ({where64})"

    # kk_cost and sticky_cost planned with the starting cost model until they had learned
    # from a step (plan s learns from steps <= s - METRICS_LAG), then with the model
    # refitted from measured times (or L^alpha when a noisy CPU fit came out degenerate:
    # Planner._length_matters)
    start = (START_COST_MODEL.a, START_COST_MODEL.b, START_COST_MODEL.c)
    assert start == (1.0, 0.1, 0.0)  # not mutated by the planners that started from it
    for r in r32 + r64:
        for name in ("kk_cost", "sticky_cost"):
            cms = r[name]["plan_cost_models"]
            assert len(cms) == STEPS > METRICS_LAG, name
            for c in cms[:METRICS_LAG]:
                assert c["kind"] == "fit" and (c["a"], c["b"], c["c"]) == start, (name, c)
            last = cms[-1]
            assert last["kind"] == "power" or (last["a"], last["b"], last["c"]) != start
            assert r[name]["counters"]["cost_model"]["fit_error"] is not None, name

    # ---- mutation: a balancer that loses or duplicates one sample is caught
    wrong = next(n for n in r32[0] if n.startswith("wrong_"))
    b32 = compare(r32, wrong, "vanilla")[0]
    b64 = compare(r64, wrong, "vanilla")[0]
    print(f"[{world} ranks] {wrong}: float32 {b32:.3g}, float64 {b64:.3g}")
    assert b32 > MUTATION_MARGIN * tol32
    assert b64 > 1e6 * F64_TOL

    if world == 2:
        _check_shadow_and_log(r32, log)


def _check_shadow_and_log(r32: list[dict], log: str) -> None:
    # shadow mode: plans, reports the gain, moves nothing: bitwise vanilla
    d, _ = compare(r32, "shadow", "vanilla")
    assert d == 0.0
    c = r32[0]["shadow"]["counters"]
    assert c["samples_moved_total"] == 0 and c["steps_balanced"] == 0 and c["shadow"]
    recs = [x["balance"] for x in r32[0]["shadow"]["records"]]
    assert all(x["samples_moved"] == 0 and x["exchange_skipped"] for x in recs)
    assert sum(x["proposed_samples_moved"] for x in recs) > 0
    assert all(x["predicted_straggler"] == x["straggler_before"] for x in recs)

    # per-step record: predicted vs measured, movement, counters; in the JSON log
    steps = r32[0]["log"]["records"]
    total = 0
    for i, x in enumerate(steps):
        b = x["balance"]
        total += b["samples_moved"]
        assert b["measured_straggler"] == x["straggler_share"]
        assert b["predicted_straggler"] == b["straggler_after"]
        assert 0.0 <= b["lower_bound_straggler"] <= b["predicted_straggler"] + 1e-12
        assert b["max_over_lower_bound"] >= 1.0 - 1e-12
        assert b["samples_moved_total"] == total and b["steps_balanced"] <= i + 1
        assert b["planning_ms"] >= 0 and b["balance_ms"] >= b["planning_ms"]
        assert len(b["measured_rank_ms"]) == 2 and len(b["predicted_rank_costs"]) == 2
        assert sum(r["log"]["records"][i]["samples"] for r in r32) == 16
    with open(log) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    train = [rec for rec in lines if rec["kind"] == "train"]
    assert len(train) == len(steps)
    for rec, x in zip(train, steps):
        assert rec["balance"]["samples_moved"] == x["balance"]["samples_moved"]
        assert rec["balance"]["partitioner"] == "vbs"
    summ = [rec for rec in lines if rec["kind"] == "summary"]
    assert summ


def test_single_rank_balancing_is_vanilla():
    """A world of one: the hook runs (no process group needed) and moves nothing."""
    cfg = skewed_config("float32", steps=2)
    a = Trainer(cfg)
    a.train()
    hook = BalanceHook(BalanceConfig(partitioner="kk"))
    b = Trainer(cfg, hooks=[hook])
    summary = b.train()
    sa, sb = _state(a), _state(b)
    for n in sa["tables"]:
        assert torch.equal(sa["tables"][n][1], sb["tables"][n][1])
    for k in sa["dense"]:
        assert torch.equal(sa["dense"][k], sb["dense"][k])
    assert summary["balance"]["steps_planned"] == 2
    assert summary["balance"]["samples_moved_total"] == 0
    assert hook.last_record["measured_straggler"] == 0.0


def test_balance_flags_build_the_hook():
    import argparse

    from freescale.balance.hook import (
        add_balance_flags,
        balance_config_from_args,
        balance_hook_from_args,
    )

    p = argparse.ArgumentParser()
    add_balance_flags(p)
    assert balance_hook_from_args(p.parse_args([])) is None
    assert balance_hook_from_args(argparse.Namespace()) is None  # flags not added
    args = p.parse_args(
        ["--balance", "kk", "--balance-refit-every", "5", "--balance-shadow", "--balance-log", "x"]
    )
    cfg = balance_config_from_args(args)
    assert cfg is not None
    assert (cfg.partitioner, cfg.use_cost_model, cfg.refit_every, cfg.shadow, cfg.log_path) == (
        "kk",
        True,
        5,
        True,
        "x",
    )
    hook = balance_hook_from_args(args)
    assert isinstance(hook, BalanceHook) and hook.config == cfg
