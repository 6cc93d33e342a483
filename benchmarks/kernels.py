"""Figure "kernels": jagged index kernels, Triton vs naive eager vs vectorized PyTorch.

Usage (one H200): ``PYTHONPATH=src python benchmarks/kernels.py --out DIR [--git-sha SHA]``
CPU smoke check: ``PYTHONPATH=src python benchmarks/kernels.py --out DIR --smoke``
(tiny sizes; reference/vectorized/naive, plus Triton if TRITON_INTERPRET=1 is set).

World size is swept 8..1024 for two workloads:
- "per_rank": ONE rank's local batch (128 samples x 4 keys, skewed UIH lengths with mean
  2048, the 4 keys are parallel sequences of one length) dispatched to W owners;
- "large": 2^26 ids (8192 samples x 4 keys, same length distribution).
Ops: ranged_dispatch (Triton: "triton" is the sort-free kernel v2, "triton_v1" the first
tile-sort kernel, "triton_v3" the tile sort with the dest-major scan, "triton_v4" the
large-tile kernel of `triton_dispatch_v4.py` (checked bitwise against v3 as well as the
reference before it is timed), "triton_v5" the Gluon shared-memory kernels of
`triton_dispatch_v5.py` (compiled CUDA only; checked the same way), "triton_auto" what
`kernels.ranged_dispatch` runs for that many ids (v5 from `ops.V5_MIN_IDS` = 2^25 ids on
sm_90, v4 from `ops.V4_MIN_IDS` = 1 id, v3 for W > 32767; the row's `auto_version`, and
for one rank's batch its host enqueue and device time apart, `*_host_ms` and
`*_device_ms`, next to v3's: that call is bound by the host's work); plus crossover
rows, v3, v4 and v5 over 2^20..2^25 ids at W = 8, 128, 1024, with v4's and v5's host
and device time apart), ranged_combine (+ backward,
D=128 bf16 rows), keyed_transpose of the dispatch output ([W][K][B] -> [K][W][B]) and
indexed_permute (a sample shuffle; its cost does not depend on W, so it is timed once per
workload).

Correct first: before timing, every implementation's output is compared bitwise with the
reference on the same input, and Triton is run twice and compared with itself; any
mismatch aborts the run. Times are medians (triton.testing.do_bench on GPU; naive eager
gets a capped number of repetitions and a global time budget). Writes DIR/kernels.json
and, if matplotlib is importable, DIR/kernels.png.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Optional

import torch

from _figure import git_sha
from freescale.kernels import naive, ops, reference, vectorized
from freescale.kernels.common import triton_available

WORLD_SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]
NUM_KEYS = 4
# experimental dispatch kernels: timed when they compile and agree with the reference and
# v3; a failure is recorded in the row (<name>_error), never fatal to the figure
EXPERIMENTAL = ("triton_v4", "triton_v5", "triton_v4_first", "triton_v4_s18")
# earlier v4 configurations, timed next to the current defaults (same bits)
V4_PINNED = {
    # as measured at e756e56: same-dest lanes by the [32, 32] compare, the scatter grid
    # walking every tile's first block, then every second, ..., a global load per id
    "triton_v4_first": {"peers": "compare", "scatter_order": "block", "et_gather": "global",
                        "scatter_block": 1024, "scatter_warps": 4},
    # session 18's defaults (87e7306): match.any, tile-major scatter, a global load per id
    "triton_v4_s18": {"et_gather": "global", "scatter_block": 1024, "scatter_warps": 4},
}  # fmt: skip
MEAN_UIH = 2048
MAX_UIH = 16384
EMBEDDING_DIM = 128
ROWS_PER_TABLE = 50_000_000


class Mismatch(RuntimeError):
    """An implementation disagreed with the reference: the run is invalid."""


# ----------------------------------------------------------------------------- inputs


def skewed_lengths(
    gen: torch.Generator, batch: int, total: Optional[int], mean: int, cap: int
) -> torch.Tensor:
    """Per-sample UIH lengths: log-normal, mean ~`mean`, in [1, cap]; sum `total` if given."""
    raw = torch.empty(batch).log_normal_(mean=0.0, std=1.0, generator=gen)
    lengths = (raw / raw.mean() * mean).clamp_(1, cap).round_().to(torch.int64)
    if total is not None:  # rescale to hit `total` ids exactly
        lengths = (lengths.double() * total / lengths.sum()).floor_().clamp_(min=1).long()
        lengths[torch.argsort(lengths)[: total - int(lengths.sum())]] += 1
        assert int(lengths.sum()) == total
    return lengths


def make_workload(
    name: str, batch: int, total: Optional[int], device: torch.device, seed: int, smoke: bool
) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mean, cap = (64, 512) if smoke else (MEAN_UIH, MAX_UIH)  # smoke: seconds on a CPU
    per_sample = skewed_lengths(gen, batch, total // NUM_KEYS if total else None, mean, cap)
    lengths = per_sample.repeat(NUM_KEYS)  # [key][sample], parallel sequence features
    n = int(lengths.sum())
    values = torch.randint(0, ROWS_PER_TABLE, (n,), generator=gen)
    return {
        "name": name,
        "batch": batch,
        "lengths": lengths.to(device),
        "values": values.to(device),
        "n": n,
    }


def parse_v4_knobs(spec: str) -> dict:
    """``"KNOB=VALUE,..."`` -> keyword knobs of `ranged_dispatch_v4` (ints where numeric);
    a name that is not a `V4Config` field exits with the list of fields."""
    import dataclasses

    from freescale.kernels.triton_dispatch_v4 import V4Config

    fields = {f.name for f in dataclasses.fields(V4Config)}
    out = {}
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"{spec!r}: unknown knob {key!r}; V4Config has {sorted(fields)}")
        out[key] = int(value) if value.isdigit() else value
    return out


def block_sizes_for(world: int, device: torch.device) -> torch.Tensor:
    block = -(-ROWS_PER_TABLE // world)
    return torch.full((NUM_KEYS,), block, dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------- timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fast(
    fn: Callable[[], object], device: torch.device, reps: int, warmup: bool = True
) -> tuple[float, int]:
    """Median ms: triton.testing.do_bench on GPU, a perf_counter loop on CPU."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median")), -1
    if warmup:
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), reps


def time_capped(
    fn: Callable[[], object], device: torch.device, max_reps: int, budget_s: float
) -> tuple[float, int]:
    """Median ms of at most `max_reps` runs (after one warmup) within `budget_s` seconds."""
    t_start = time.perf_counter()
    _sync(device)
    fn()  # warmup
    _sync(device)
    samples = []
    while len(samples) < max_reps and (time.perf_counter() - t_start) < budget_s:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples), len(samples)


def enqueue_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """Median over 5 loops of the host time per call of ``calls`` calls with no sync."""
    out = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        _sync(device)
    return statistics.median(out)


def device_us(fn: Callable[[], object], calls: int, host_us: float) -> tuple[float, bool]:
    """Device time per call: the GPU sleeps while the host enqueues ``calls`` calls, then
    runs them back to back between two events. Also whether the sleep outlasted the
    enqueueing (if not, the figure is an upper bound)."""
    enqueue_s = calls * host_us * 1e-6
    cycles = int(max(enqueue_s * 3, 0.02) * 2.0e9)  # > 3x the enqueue time at <= 2 GHz
    samples = []
    covered = True
    for _ in range(5):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sleep_done = torch.cuda.Event()
        torch.cuda._sleep(cycles)
        sleep_done.record()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        covered &= not sleep_done.query()  # still sleeping when everything was enqueued
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls * 1e3)
    return statistics.median(samples), covered


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms, _ = time_fast(lambda: dst.copy_(src), device, reps=5)
    return 2 * nbytes / (ms * 1e-3)


# ----------------------------------------------------------------------------- checks


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def check_same(what: str, expected, actual) -> None:
    if hasattr(expected, "unbucketize_permute"):
        fields = ("values", "lengths", "splits", "key_counts", "unbucketize_permute", "weights")
        pairs = [(f, getattr(expected, f), getattr(actual, f)) for f in fields]
    elif isinstance(expected, tuple):
        pairs = [(str(i), e, a) for i, (e, a) in enumerate(zip(expected, actual))]
    else:
        pairs = [("out", expected, actual)]
    for field, e, a in pairs:
        if not _equal(e, a):
            raise Mismatch(f"MISMATCH in {what}: field {field} differs from the reference")


# ----------------------------------------------------------------------------- benchmark


class Runner:
    def __init__(self, args, device: torch.device, use_triton: bool):
        self.args = args
        self.device = device
        self.use_triton = use_triton
        self.deadline = time.perf_counter() + args.budget_s
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.bandwidth: Optional[float] = None
        if use_triton:
            from freescale.kernels import triton_dispatch_v4, triton_impl

            self.triton = triton_impl
            self.v4 = triton_dispatch_v4
            self.tile = 32 if device.type == "cpu" else None
        # v5 (Gluon; compiled CUDA only): timed where `ops._v5_runs` says it can run
        self.v5 = None
        if use_triton and device.type == "cuda":
            from freescale.kernels import triton_dispatch_v5

            self.v5 = triton_dispatch_v5

    def time_impls(self, impls: dict[str, Callable[[], object]], naive_fn) -> dict:
        out = {}
        for name, fn in impls.items():
            # Interpreted Triton on CPU is only checked for correctness: one timed rep.
            interpreted = name.startswith("triton") and self.device.type == "cpu"
            reps = 1 if interpreted else self.args.cpu_reps
            out[f"{name}_ms"], _ = time_fast(fn, self.device, reps, warmup=not interpreted)
        if naive_fn is None:
            return out
        left = self.deadline - time.perf_counter()
        if left <= 0:
            out["naive_ms"], out["naive_reps"] = None, 0
            self.notes.append("time budget exhausted: some naive timings skipped (null)")
            return out
        budget = min(self.args.naive_budget_s, left)
        out["naive_ms"], out["naive_reps"] = time_capped(naive_fn, self.device, 5, budget)
        return out

    def record(self, wl, op: str, world: Optional[int], times: dict, floor_bytes: int) -> None:
        row = {
            "workload": wl["name"],
            "op": op,
            "world_size": world,
            "n_ids": wl["n"],
            "num_keys": NUM_KEYS,
            "batch": wl["batch"],
            **times,
            "floor_bytes": floor_bytes,
        }
        t = row.get("triton_ms")
        if t:
            if row.get("naive_ms"):
                row["speedup_vs_naive"] = row["naive_ms"] / t
            if row.get("vectorized_ms"):
                row["speedup_vs_vectorized"] = row["vectorized_ms"] / t
            if row.get("triton_v1_ms"):
                row["speedup_vs_triton_v1"] = row["triton_v1_ms"] / t
            if self.bandwidth:
                row["floor_ms"] = floor_bytes / self.bandwidth * 1e3
                row["fraction_of_hbm_floor"] = row["floor_ms"] / t
        if row.get("triton_v4_ms") and row.get("triton_v3_ms"):
            row["speedup_v4_vs_v3"] = row["triton_v3_ms"] / row["triton_v4_ms"]
        if row.get("triton_v5_ms") and row.get("triton_v4_ms"):
            row["speedup_v5_vs_v4"] = row["triton_v4_ms"] / row["triton_v5_ms"]
        for name in V4_PINNED:
            suffix = name.removeprefix("triton_")
            if row.get(f"{name}_ms") and row.get("triton_v4_ms"):
                row[f"speedup_v4_vs_{suffix}"] = row[f"{name}_ms"] / row["triton_v4_ms"]
        self.rows.append(row)
        shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(shown), flush=True)

    def v5_fn(self, args: tuple) -> dict[str, Callable[[], object]]:
        """{"triton_v5": v5 on `args` (its default config)} where v5 can run, else {}."""
        values, world = args[0], args[3]
        if self.v5 is None or not ops._v5_runs(values, world, None):
            return {}
        return {"triton_v5": partial(self.v5.ranged_dispatch_v5, *args)}

    def host_and_device(self, row: dict, fns: dict, names: tuple[str, ...]) -> None:
        """Split a call's time into the host's enqueue work (``<name>_host_ms``) and the
        device's (``<name>_device_ms``, with the GPU held while the host enqueues; see
        `device_us`): one rank's batch is small enough for the first to dominate."""
        for name in names:
            host = enqueue_us(fns[name], 50, self.device)
            dev, covered = device_us(fns[name], 50, host)
            row[f"{name}_host_ms"], row[f"{name}_device_ms"] = host / 1e3, dev / 1e3
            row[f"{name}_device_covered"] = covered
        print({k: v for k, v in row.items() if k.endswith(("_host_ms", "_device_ms"))})

    def bench_op(
        self,
        wl: dict,
        op: str,
        world: Optional[int],
        fns: dict[str, Callable[[], object]],
        floor_bytes: int,
    ):
        """Check every implementation against the reference, then time them.

        `fns` maps "reference", "vectorized", "naive", (if used) "triton" and optionally
        "triton_v1" / "triton_v3" / "triton_v4" to zero-argument calls on the same input.
        v4 (experimental) is also compared with v3 field by field. Returns the reference
        output.
        """
        where = f"{op} ({wl['name']}, W={world})"
        expect = fns["reference"]()
        check_same(f"vectorized {where}", expect, fns["vectorized"]())
        if wl["n"] <= self.args.check_naive_max_ids:
            check_same(f"naive {where}", expect, fns["naive"]())
        impls = {"vectorized": fns["vectorized"]}
        errors: dict[str, str] = {}
        for name in ("triton", "triton_v1", "triton_v3", "triton_auto", *EXPERIMENTAL):
            if not self.use_triton or name not in fns:
                continue
            try:
                got = fns[name]()
                check_same(f"{name} {where}", expect, got)
                check_same(f"{name} {where} run twice (determinism)", got, fns[name]())
                if name in EXPERIMENTAL and "triton_v3" in fns:
                    check_same(f"{name} vs triton_v3 {where}", fns["triton_v3"](), got)
            except Exception as exc:
                if name not in EXPERIMENTAL:
                    raise
                # an experimental kernel that does not compile or disagrees is recorded
                # (and never timed); the figure of the kernels that train goes on
                errors[name] = repr(exc)[:400]
                print(f"EXPERIMENTAL {name} {where} FAILED: {errors[name]}", flush=True)
                continue
            impls[name] = fns[name]
            del got
        times = self.time_impls(impls, fns["naive"])
        times.update({f"{k}_error": v for k, v in errors.items()})
        self.record(wl, op, world, times, floor_bytes)
        return expect

    def run_workload(self, wl: dict, worlds: list[int]) -> None:
        values, lengths, n, batch = wl["values"], wl["lengths"], wl["n"], wl["batch"]
        idx_bytes, len_bytes = values.element_size(), lengths.element_size()
        tri = self.triton if self.use_triton else None
        for world in worlds:
            args = (values, lengths, block_sizes_for(world, self.device), world)
            fns = {
                "reference": partial(reference.ranged_dispatch, *args),
                "vectorized": partial(vectorized.ranged_dispatch, *args),
                "naive": partial(naive.ranged_dispatch, *args),
            }
            if tri:
                fns["triton"] = partial(tri.ranged_dispatch, *args)
                fns["triton_v1"] = partial(tri.ranged_dispatch_v1, *args, tile=self.tile)
                fns["triton_v3"] = partial(
                    tri.ranged_dispatch_v1, *args, tile=self.tile, dest_major=True
                )
                fns["triton_v4"] = partial(self.v4.ranged_dispatch_v4, *args)
                fns.update(self.v5_fn(args))
                # what `kernels.ranged_dispatch` (training's call) runs on CUDA for this
                # many ids and W: v4 from ops.V4_MIN_IDS (1) ids where W <= 32767, else v3
                fns["triton_auto"] = partial(ops.ranged_dispatch, *args, backend="triton")
                for name, knobs in V4_PINNED.items():
                    fns[name] = partial(self.v4.ranged_dispatch_v4, *args, **knobs)
            floor = 2 * n * idx_bytes + n * 8 + lengths.numel() * len_bytes * (1 + world)
            ref = self.bench_op(wl, "ranged_dispatch", world, fns, floor)
            if tri:  # the kernel triton_auto ran (FREESCALE_TRITON_DISPATCH can force one)
                self.rows[-1]["auto_version"] = ops.triton_dispatch_kernel(values, world)
            if tri and self.device.type == "cuda" and wl["name"] == "per_rank":
                self.host_and_device(self.rows[-1], fns, ("triton_auto", "triton_v3"))

            # Embedding rows come back shard-major; combine puts them batch-major.
            perm, splits = ref.unbucketize_permute, ref.splits.tolist()
            rows = torch.randn(n, self.args.dim, device=self.device, dtype=torch.bfloat16)
            floor = 2 * rows.numel() * rows.element_size() + n * 8
            for op in ("ranged_combine", "ranged_combine_backward"):
                fns = {
                    "reference": partial(getattr(reference, op), rows, perm),
                    "vectorized": partial(getattr(vectorized, op), rows, perm),
                    "naive": partial(getattr(naive, op), rows, perm, splits),
                }
                if tri:
                    fns["triton"] = partial(getattr(tri, op), rows, perm)
                self.bench_op(wl, op, world, fns, floor)
            del rows, fns

            # The dispatch output is [W][K][B] jagged data: recat it to [K][W][B].
            t_args = (ref.lengths.view(world, NUM_KEYS, batch), ref.values)
            fns = {
                "reference": partial(reference.keyed_transpose, *t_args),
                "vectorized": partial(vectorized.keyed_transpose, *t_args),
                "naive": partial(naive.keyed_transpose, *t_args),
            }
            if tri:
                fns["triton"] = partial(tri.keyed_transpose, *t_args)
            floor = 2 * (n * idx_bytes + ref.lengths.numel() * len_bytes)
            self.bench_op(wl, "keyed_transpose", world, fns, floor)
            del ref, fns, t_args
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

        # indexed_permute: shuffle the samples of every key (cost independent of W).
        gen = torch.Generator().manual_seed(self.args.seed + 1)
        sigma = torch.randperm(batch, generator=gen)
        permute = (torch.arange(NUM_KEYS)[:, None] * batch + sigma[None, :]).reshape(-1)
        call = (permute.to(torch.int32).to(self.device), lengths.view(-1, 1), values)
        fns = {
            "reference": partial(reference.indexed_permute, *call, None, n),
            "vectorized": partial(vectorized.indexed_permute, *call, None, n),
            "naive": partial(naive.indexed_permute, *call),
        }
        if tri:
            fns["triton"] = partial(tri.indexed_permute, *call, None, n)
        floor = 2 * (n * idx_bytes + lengths.numel() * len_bytes)
        self.bench_op(wl, "indexed_permute", None, fns, floor)

    def crossover(self, worlds: list[int], sizes: list[int]) -> None:
        """v3, v4 and v5 dispatch time (and what ``ops.ranged_dispatch`` picks) at
        ``sizes`` ids per call: where the size-based choices (`ops.V4_MIN_IDS`,
        `ops.V5_MIN_IDS`) should switch. Each point is checked v4 == v3 (and v5 == v3)
        first."""
        for total in sizes:
            wl = make_workload("crossover", max(8, total // MEAN_UIH // NUM_KEYS), total,
                               self.device, seed=total, smoke=False)  # fmt: skip
            for world in worlds:
                if time.perf_counter() > self.deadline:
                    self.notes.append("time budget exhausted: crossover cut short")
                    return
                args = (wl["values"], wl["lengths"], block_sizes_for(world, self.device), world)
                fns = {
                    "triton_v3": partial(self.triton.ranged_dispatch_v1, *args, dest_major=True),
                    "triton_v4": partial(self.v4.ranged_dispatch_v4, *args),
                    **self.v5_fn(args),
                }
                expect = fns["triton_v3"]()
                for name in [k for k in fns if k != "triton_v3"]:
                    check_same(f"crossover {name} vs v3 n={wl['n']} W={world}",
                               expect, fns[name]())  # fmt: skip
                del expect
                row = {"workload": "crossover", "op": "ranged_dispatch_crossover",
                       "world_size": world, "n_ids": wl["n"],
                       "auto_version": ops.triton_dispatch_kernel(wl["values"], world)}  # fmt: skip
                for name, fn in fns.items():
                    row[f"{name}_ms"], _ = time_fast(fn, self.device, self.args.cpu_reps)
                row["speedup_v4_vs_v3"] = row["triton_v3_ms"] / row["triton_v4_ms"]
                if "triton_v5_ms" in row:
                    row["speedup_v5_vs_v4"] = row["triton_v4_ms"] / row["triton_v5_ms"]
                if self.device.type == "cuda":  # host-bound below ~2^25 ids?
                    self.host_and_device(row, fns, tuple(k for k in fns if k != "triton_v3"))
                self.rows.append(row)
                print(json.dumps(row), flush=True)
            del wl

    def tile_sweep(
        self,
        wl: dict,
        world: int,
        chunks: list[int],
        blocks: list[int],
        v1_tiles: list[int],
        v4_settings: Optional[list[tuple[int, int]]] = None,
    ) -> None:
        """Triton dispatch time per (chunk, block) of the sort-free kernel ("tile" = chunk),
        per tile of the v1 kernel and per (tile, chunk) of v4 ("block" = chunk) (tuning
        data; every setting is checked against the reference first)."""
        args = (wl["values"], wl["lengths"], block_sizes_for(world, self.device), world)
        expect = reference.ranged_dispatch(*args)
        settings = [("triton", c, b) for c in chunks for b in blocks if b <= c]
        settings += [("triton_v1", t, None) for t in v1_tiles]
        settings += [("triton_v4", t, c) for t, c in v4_settings or []]
        for impl, tile, block in settings:
            if time.perf_counter() > self.deadline:
                self.notes.append("time budget exhausted: tile sweep cut short")
                return
            row = {"workload": wl["name"], "op": "ranged_dispatch_tile_sweep", "impl": impl,
                   "world_size": world, "n_ids": wl["n"], "tile": tile, "block": block}  # fmt: skip
            if impl == "triton":
                fn = partial(self.triton.ranged_dispatch, *args, chunk=tile, block=block)
            elif impl == "triton_v4":
                fn = partial(self.v4.ranged_dispatch_v4, *args, tile=tile, chunk=block)
            else:
                fn = partial(self.triton.ranged_dispatch_v1, *args, tile=tile)
            try:
                got = fn()
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is data
                row["error"] = repr(exc)[:300]
            else:
                check_same(f"{impl} dispatch tile={tile} block={block} W={world}", expect, got)
                del got
                row["triton_ms"], _ = time_fast(fn, self.device, self.args.cpu_reps)
            self.rows.append(row)
            print(json.dumps(row), flush=True)


def _headline(rows: list[dict]) -> dict:
    """Headline of what ``kernels.ranged_dispatch`` runs on CUDA ("triton_auto": the
    size-based choice of `ops.triton_dispatch_version`; v3 in files written before it
    existed), plus the other kernels'."""

    def row(workload: str, world: int) -> dict:
        for r in rows:
            if (
                r["workload"] == workload
                and r["op"] == "ranged_dispatch"
                and r["world_size"] == world
            ):
                return r
        return {}

    def ratio(a, b):
        return a / b if a is not None and b else None

    def fig(key: str) -> dict:
        r32, r512, big = row("per_rank", 32), row("per_rank", 512), row("large", 1024)
        floor = big.get("floor_ms")
        return {
            "speedup_vs_eager_w32": ratio(r32.get("naive_ms"), r32.get(key)),
            "speedup_vs_eager_w512": ratio(r512.get("naive_ms"), r512.get(key)),
            "speedup_vs_vectorized_w512": ratio(r512.get("vectorized_ms"), r512.get(key)),
            "dispatch_fraction_of_hbm_floor": ratio(floor, big.get(key)),
        }

    keys = ("triton_v1_ms", "triton_v3_ms", "triton_v4_ms", "triton_v5_ms", "triton_auto_ms")
    keys += tuple(f"{name}_ms" for name in V4_PINNED)
    have = {k for r in rows for k in keys if k in r}
    if "triton_auto_ms" in have:  # since session 18: the size-based choice of ops
        out = fig("triton_auto_ms")
        out.update({f"{k}_v3": v for k, v in fig("triton_v3_ms").items()})
        out.update({f"{k}_v1": v for k, v in fig("triton_v1_ms").items()})
        used = sorted(
            {
                f"{r['workload']}: {r['auto_version']}"
                for r in rows
                if r["op"] == "ranged_dispatch" and r.get("auto_version")
            }
        )
        kernel = (
            f"auto (what kernels.ranged_dispatch runs on CUDA: v5 from {ops.V5_MIN_IDS} "
            f"ids per unweighted call with W <= {ops.V5_MAX_WORLD} on sm_90, else v4 from "
            f"{ops.V4_MIN_IDS} id(s), v3 below and for W > {ops.V4_MAX_WORLD}; here "
            f"{', '.join(used) or 'not recorded'})"
        )
        if os.environ.get("FREESCALE_V5_TABLE"):  # see config.v5_table_override
            kernel += f"; v5 with the {os.environ['FREESCALE_V5_TABLE']} table"
    elif "triton_v3_ms" in have:  # v3 trained on CUDA (ops.ranged_dispatch)
        out = fig("triton_v3_ms")
        out.update({f"{k}_v1": v for k, v in fig("triton_v1_ms").items()})
        kernel = "v3 (tile sort + dest-major scan; what training dispatches on CUDA)"
    else:  # files written before v3 existed: v1 trained then
        out = fig("triton_v1_ms" if "triton_v1_ms" in have else "triton_ms")
        kernel = "v1 (tile sort; what training dispatched on CUDA then)"
    if have:
        out.update({f"{k}_v2": v for k, v in fig("triton_ms").items()})
    if "triton_v4_ms" in have:
        out.update({f"{k}_v4": v for k, v in fig("triton_v4_ms").items()})
    if "triton_v5_ms" in have:
        out.update({f"{k}_v5": v for k, v in fig("triton_v5_ms").items()})
    for name in V4_PINNED:
        if f"{name}_ms" in have:
            suffix = name.removeprefix("triton_")
            out.update({f"{k}_{suffix}": v for k, v in fig(f"{name}_ms").items()})
    out["kernel"] = kernel
    # the floor target is stated at 2^26 ids; W = 1024 above, every W here
    key = "triton_auto_ms" if "triton_auto_ms" in have else None
    if key:
        out["dispatch_fraction_of_hbm_floor_by_world"] = {
            str(r["world_size"]): ratio(r.get("floor_ms"), r.get(key))
            for r in rows
            if r["workload"] == "large" and r["op"] == "ranged_dispatch"
        }
    out["definition"] = (
        "speedups: ranged_dispatch, per_rank workload (one rank's batch, 128 samples x 4 "
        "keys, mean UIH 2048), naive eager or vectorized time / Triton time; fraction: "
        "large workload (2^26 ids) at W=1024, HBM floor time (bytes read+written / "
        "measured device copy bandwidth) / Triton time; unsuffixed: the kernel named in "
        "'kernel'; *_v3: tile sort + dest-major scan; *_v1: tile sort with the [tile][dest] "
        "scan; *_v2: the sort-free kernel; "
        "*_v4: large tiles ranked per warp + flat scatter (triton_dispatch_v4; "
        "lengths from per-segment counter snapshots, lengths_mode='rows'; same-dest lanes by "
        "PTX match.any, a tile's scatter blocks adjacent in launch order"
        + (
            "; since session 19 each scatter program's tile offsets from one row via "
            "tl.gather, et_gather='row', and 2048-id scatter programs at W=128..512"
            if "triton_v4_s18_ms" in have
            else ""
        )
        + "); *_v5: the Gluon shared-memory dispatch (triton_dispatch_v5, default_config_v5)"
        + "; *_v4_first: v4 as timed at e756e56 (peers='compare', scatter_order='block'"
        + (", et_gather='global'); *_v4_s18: session 18's defaults (et_gather='global', "
           "1024-id scatter programs)" if "triton_v4_s18_ms" in have else ")")
    )  # fmt: skip
    return out


def _plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    workloads = sorted(
        {r["workload"] for r in rows if r["op"] == "ranged_dispatch"}, key=lambda w: w != "per_rank"
    )
    fig, axes = plt.subplots(2, len(workloads), figsize=(6 * len(workloads), 8), squeeze=False)
    for col, wl in enumerate(workloads):
        ax = axes[0][col]
        disp = [r for r in rows if r["workload"] == wl and r["op"] == "ranged_dispatch"]
        for impl, style in (
            ("triton_auto", "D-"),  # what kernels.ranged_dispatch runs (auto_version)
            ("triton_v5", "v-"),
            ("triton", "o-"),
            ("triton_v1", "o--"),
            ("triton_v3", "d-"),
            ("triton_v4", "*-"),
            ("triton_v4_first", "x-"),
            ("triton_v4_s18", "+-"),
            ("vectorized", "s--"),
            ("naive", "^:"),
        ):
            pts = [(r["world_size"], r.get(f"{impl}_ms")) for r in disp if r.get(f"{impl}_ms")]
            if pts:
                ax.plot(*zip(*pts), style, label=impl)
        ax.set(xscale="log", yscale="log", xlabel="world size W", ylabel="ms",
               title=f"ranged_dispatch ({wl}, {disp[0]['n_ids'] if disp else 0} ids)")  # fmt: skip
        ax.set_xticks(WORLD_SIZES, [str(w) for w in WORLD_SIZES])
        ax.legend()
        ax = axes[1][col]
        for op in (
            "ranged_dispatch",
            "ranged_combine",
            "ranged_combine_backward",
            "keyed_transpose",
        ):
            # dispatch: the kernel training runs (triton_auto) where the row has it
            key = "triton_auto_ms" if op == "ranged_dispatch" else "triton_ms"
            pts = [
                (r["world_size"], r["naive_ms"] / (r.get(key) or r["triton_ms"]))
                for r in rows
                if r["workload"] == wl and r["op"] == op and r.get("naive_ms")
                and (r.get(key) or r.get("triton_ms"))
            ]  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), "o-", label=op + (" (auto)" if op == "ranged_dispatch" else ""))
        ax.set(xscale="log", yscale="log", xlabel="world size W", ylabel="naive eager / Triton",
               title=f"Triton speedup over naive eager ({wl})")  # fmt: skip
        ax.set_xticks(WORLD_SIZES, [str(w) for w in WORLD_SIZES])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--git-sha", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny CPU-sized run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=EMBEDDING_DIM)
    parser.add_argument("--budget-s", type=float, default=360.0, help="global time budget (s)")
    parser.add_argument("--naive-budget-s", type=float, default=3.0, help="per naive timing")
    parser.add_argument("--cpu-reps", type=int, default=3)
    parser.add_argument("--no-large", action="store_true", help="skip the 2^26-id workload")
    parser.add_argument("--no-sweep", action="store_true", help="skip the dispatch tile sweep")
    parser.add_argument(
        "--rehead",
        type=Path,
        default=None,
        help="recompute the headline (and plot) of an existing kernels.json from its rows",
    )
    parser.add_argument(
        "--replot",
        type=Path,
        default=None,
        help="redraw kernels.png next to an existing kernels.json from its rows (no run)",
    )
    args = parser.parse_args(argv)
    if args.replot is not None:
        res = json.loads(args.replot.read_text())
        png = args.replot.with_suffix(".png")
        if not _plot(res["rows"], png):
            raise SystemExit("matplotlib is not importable: nothing drawn")
        print(f"wrote {png}")
        return 0
    if args.rehead is not None:
        res = json.loads(args.rehead.read_text())
        res["headline"] = _headline(res["rows"])
        res.setdefault("notes", []).append(
            "headline recomputed from the rows by `kernels.py --rehead` (unsuffixed = "
            "the kernel training dispatches, see 'kernel')"
        )
        args.rehead.write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res["headline"], indent=2))
        return 0
    t_start = time.perf_counter()

    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    use_triton = triton_available() and (cuda or interpret)
    if not cuda and not args.smoke:
        print("no CUDA device: running the smoke configuration", file=sys.stderr)
        args.smoke = True
    if args.smoke:
        torch.set_num_threads(1)
        worlds = [8, 32, 1024]
        workloads = [("per_rank", 8, None), ("large", 16, 4096)]
        args.dim = min(args.dim, 16)
        args.check_naive_max_ids = 1 << 62
    else:
        worlds = WORLD_SIZES
        workloads = [("per_rank", 128, None)]
        if not args.no_large:
            workloads.append(("large", 8192, 1 << 26))
        args.check_naive_max_ids = 1 << 21  # naive checks are slow at 2^26 ids

    runner = Runner(args, device, use_triton)
    runner.bandwidth = copy_bandwidth(device, (1 << 30) if cuda else (1 << 24))
    print(f"device copy bandwidth {runner.bandwidth / 1e9:.1f} GB/s; triton={use_triton}")
    status = 0
    try:
        for i, (name, batch, total) in enumerate(workloads):
            wl = make_workload(name, batch, total, device, args.seed + i, args.smoke)
            runner.run_workload(wl, worlds)
            if name == "large" and use_triton and not args.smoke and not args.no_sweep:
                v4 = [(t, c) for t in (2048, 4096, 8192, 16384) for c in (16, 32)]
                runner.tile_sweep(
                    wl, worlds[-1], [1024, 2048, 4096, 8192], [32, 64, 128], [2048], v4
                )
                runner.tile_sweep(wl, worlds[0], [], [], [], v4)  # v4 at the smallest W
            del wl
        if use_triton and not args.smoke and not args.no_sweep:
            runner.crossover([worlds[0], 128, worlds[-1]], [1 << k for k in range(20, 26)])
    except Mismatch as exc:
        print(f"ABORT: {exc}", file=sys.stderr)
        runner.notes.append(f"ABORTED: {exc}")
        status = 1

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "figure": "kernels",
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "git_sha": git_sha(args.git_sha),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv] if argv is None else ["python", *argv]),
        "smoke": args.smoke,
        "triton": use_triton,
        "torch": torch.__version__,
        "copy_bandwidth_gbps": runner.bandwidth / 1e9,
        "config": {
            "world_sizes": worlds,
            "workloads": [
                {"name": name, "samples_per_key": batch, "total_ids": total}
                for name, batch, total in workloads
            ],
            "num_keys": NUM_KEYS,
            "mean_uih": 64 if args.smoke else MEAN_UIH,
            "max_uih": 512 if args.smoke else MAX_UIH,
            "embedding_dim": args.dim,
            "embedding_dtype": "bfloat16",
            "rows_per_table": ROWS_PER_TABLE,
            "naive_budget_s": args.naive_budget_s,
            "budget_s": args.budget_s,
            # set: v5 ran that card's table on this one (triton_dispatch_v5.table_name)
            "v5_table_override": os.environ.get("FREESCALE_V5_TABLE") or None,
        },
        "rows": runner.rows,
        "headline": _headline(runner.rows),
        "notes": sorted(set(runner.notes)),
        "elapsed_s": round(time.perf_counter() - t_start, 1),
        "valid": status == 0,
    }
    (args.out / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    plotted = False
    try:
        plotted = _plot(runner.rows, args.out / "kernels.png") if runner.rows else False
    except Exception as exc:  # noqa: BLE001 - a broken plot must not lose the JSON
        print(f"plot failed: {exc!r}", file=sys.stderr)
    print(f"wrote {args.out / 'kernels.json'}" + (" and kernels.png" if plotted else ""))
    print(json.dumps(result["headline"], indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
