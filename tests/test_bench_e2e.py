"""``freescale bench e2e`` on CPU (gloo, 2 ranks), small config: the report is written
with its schema, and only numerics are asserted (never timings):

* prioritized's and sdd's eval NE (every eval point) equal vanilla's bitwise (tier 1);
* balance, freescale and the reordered vanilla (the noise floor) are within 1e-12
  relative of vanilla in float64 (tier 2);
* the trainers run with ``timing="events"`` and profile their last steps (the GPU
  accounting says it is unavailable on CPU, and the headline lists it as not measured);
* every technique really ran: prioritized steps, collision and deferred rows, samples
  moved by the balancer are all > 0.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from freescale.config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig
from freescale.pipeline.bench_e2e import (
    DIAGNOSTIC_VARIANTS,
    VARIANTS,
    _variant_cfg,
    apply_bench_defaults,
    headline,
    merge_results,
    run_e2e,
    write_report,
)

F64_TOL = 1e-12  # DESIGN.md section 1, tier 2 (float64)
STEPS = 8


def e2e_config() -> TrainConfig:
    """tests/test_trainer.py's tiny config with skewed lengths (the balancer moves
    samples) and collision injection (prioritized has collision rows)."""
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
            overlap=0.3,
        ),
        model=ModelConfig(
            embedding_dim=8, num_layers=1, num_heads=2, max_positions=64, dtype="float64"
        ),
        sparse_optim=SparseOptimConfig(kind="rowwise_adagrad", lr=0.05),
        steps=STEPS,
        eval_every=4,
        log_every=10_000,
        progress=False,
        device="cpu",
        dense_lr=1e-2,
        timing="events",
        profile_steps=2,
        gil_probe_ms=2.0,
    )


def _e2e(rank, world, cfg, variants):
    return run_e2e(rank, world, cfg, variants)


def test_e2e_report_numerics(pool2, tmp_path):
    res = pool2.run(_e2e, e2e_config(), list(VARIANTS))
    report = write_report(res[0], str(tmp_path), command="pytest tests/test_bench_e2e.py")

    # --- schema (files and keys; no values of timings)
    for name in ("e2e.json", "e2e.md"):
        assert os.path.getsize(tmp_path / name) > 0
    on_disk = json.loads((tmp_path / "e2e.json").read_text())
    assert on_disk["figure"] == "e2e"
    for key in ("device", "git_sha", "date", "command", "environment", "rows", "headline"):
        assert key in on_disk, key
    assert [r["variant"] for r in on_disk["rows"]] == list(VARIANTS)
    assert {"qps_ratio", "ne_rel_diff"} <= set(on_disk["headline"])
    assert (tmp_path / "e2e.png").exists() == (on_disk["plot"] == "e2e.png")
    if on_disk["plot"] is None:
        assert on_disk["notes"], "a skipped plot is explained"
    md = (tmp_path / "e2e.md").read_text()
    assert all(f"| {v} |" in md for v in VARIANTS)
    for r in on_disk["rows"]:
        for key in ("qps", "eval_ne", "stage_ms", "breakdown_ms", "ne_curve", "activity"):
            assert key in r, key
        # host CPU per thread group over the timed steps (Linux /proc; no timing asserted)
        hc = r["summary"]["host_cpu"]
        if os.path.isdir("/proc/self/task"):
            assert hc["steps"] > 0 and "training" in hc["by_group_ms_per_step"], hc
            assert hc["gil_wait"]["wakes"] >= 0, hc  # the probe ran (no timing asserted)
            # the training thread's blocking waits (gloo here), by backend and name
            cw = hc["host_wait_training"]
            assert any(k.startswith("gloo:") and v["calls_per_step"] > 0 for k, v in cw.items())
            assert hc["host_wait_training_ms"] >= 0 and hc["host_wait_all_threads"], hc
    assert "host cpu/wall" in md and "GIL wait p99 ms" in md
    # compiles inside the profiled window are counted for every variant (CompileWatch);
    # none on CPU: nothing compiles after the first steps
    assert "compiles in profiled window" in md
    assert set(on_disk["headline"]["compiles_in_profiled_window"]) == set(VARIANTS)
    assert on_disk["headline"]["profiled_window_compile_free"] is True
    if os.path.isdir("/proc/self/task"):  # the per-collective waits, listed per row
        assert "Training thread blocked in collectives' wait() and host waits" in md
        assert all(f"- {v}" in md for v in VARIANTS)
    # the main table: every row has as many cells as the header (the unprofiled columns
    # once had a header and no cells)
    table = [ln for ln in md.splitlines() if ln.startswith("| variant | qps")]
    assert len(table) == 1
    width = table[0].count("|")
    rows_md = [ln for ln in md.splitlines() if any(ln.startswith(f"| {v} | ") for v in VARIANTS)]
    rows_md = [ln for ln in rows_md if ln.count("|") > 8]  # not the per-pass table
    assert len(rows_md) == len(VARIANTS) and all(ln.count("|") == width for ln in rows_md)

    # --- numerics
    rows = {r["variant"]: r for r in report["rows"]}
    van = rows["vanilla"]
    steps = [p["step"] for p in van["ne_curve"]]
    assert steps == [4, 8]
    for name in VARIANTS:
        assert [p["step"] for p in rows[name]["ne_curve"]] == steps
    # every rank reports the same numerics
    for r in res[1]["rows"]:
        assert r["ne_curve"] == rows[r["variant"]]["ne_curve"]
    # tier 1: prioritized and sdd are bitwise vanilla (whole curve)
    for name in ("prioritized", "sdd"):
        assert rows[name]["ne_curve"] == van["ne_curve"], name
        assert rows[name]["eval_ne"] == van["eval_ne"], name
        assert report["headline"][f"ne_rel_diff_{name}"] == 0.0
    # the SM-free ablation changes the transport only: bitwise the same curve
    assert rows["freescale"]["ne_curve"] == rows["freescale_nccl_overlap"]["ne_curve"]
    assert rows["freescale"]["summary"]["overlap_backend"] == "host_staged"
    assert rows["freescale"]["summary"]["comm_bytes_by_backend"]["host_staged"] > 0
    # per backend:collective, the same bytes (what sm_contention --workload-from reads)
    by_op = rows["freescale"]["summary"]["comm_by_op"]
    assert by_op["host_staged:all_to_all"]["calls"] > 0
    assert (
        sum(v["bytes"] for k, v in by_op.items() if k.startswith("host_staged:"))
        == (rows["freescale"]["summary"]["comm_bytes_by_backend"]["host_staged"])
    )
    assert rows["freescale_nccl_overlap"]["summary"]["overlap_backend"] != "host_staged"
    # tier 2: balancing and the legal reordering change summation orders (float64)
    reordered = ("vanilla_reordered", "vanilla_reordered_b")
    for name in (
        "balance",
        "freescale",
        "freescale_nccl_overlap",
        "vanilla_shuffled",
        *reordered,
    ):
        for p, q in zip(rows[name]["ne_curve"], van["ne_curve"]):
            assert abs(p["eval_ne"] - q["eval_ne"]) <= F64_TOL * abs(q["eval_ne"]), name
    assert report["headline"]["ne_rel_diff"] <= F64_TOL
    assert 0.0 < report["headline"]["ne_noise_floor"] <= F64_TOL  # the reordering is real
    samples = report["headline"]["ne_noise_floor_samples"]
    # the reorderings are real: at least one moves the final NE, and the two differ from
    # each other (below). In float64 at this size the distances are a few ulps, so one
    # reordering can land on vanilla's bits at every eval: on session 15's CI machine
    # vanilla_reordered_b did (its vector kernels round differently from session 14's)
    assert set(samples) == set(reordered) and max(samples.values()) > 0.0
    assert any(rows[name]["ne_curve"] != van["ne_curve"] for name in reordered)
    assert report["headline"]["ne_noise_floor"] == max(samples.values())
    assert rows["vanilla_reordered"]["ne_curve"] != rows["vanilla_reordered_b"]["ne_curve"]
    # the cross-rank floor: vanilla with samples moved across ranks (costs ignored)
    # (float64 here: the moved samples can leave the final NE bit-equal, as balance_fbs)
    assert 0.0 <= report["headline"]["ne_cross_rank_floor"] <= F64_TOL
    assert "ne_rel_diff_vanilla_shuffled" not in report["headline"]
    # CPU: no GPU activity to account; said so, never invented
    assert van["gpu_accounting"]["profiled_steps"] == 2
    assert not van["gpu_accounting"]["available"]
    assert {"bubble_reduction", "scaling_efficiency"} <= set(report["not_measured"])
    assert van["summary"]["timing"] == "events"
    # the projection to 64 / 256 ranks is there, labelled, and says it is illustrative
    proj = on_disk["projection"]
    assert proj["kind"] == "projection" and "network" in proj and proj["assumptions"]
    assert {r["world_size"] for r in proj["rows"]} == {2, 64, 256}
    assert all(r["kind"] == "projection" for r in proj["rows"])
    assert "illustrative" in proj["note"]

    # --- every technique really ran
    for name in ("prioritized", "freescale"):
        a = rows[name]["activity"]
        assert a["prioritized_steps"] > 0, a
        assert a["collision_rows"] > 0 and a["deferred_rows"] > 0, a
    for name in ("balance", "freescale", "vanilla_shuffled"):
        assert rows[name]["activity"]["samples_moved"] > 0, rows[name]["activity"]
    # freescale's balancer (sticky; its cost model refits every 20 steps, past this run)
    assert rows["freescale"]["balance"] == rows["balance"]["balance"] == "sticky"
    assert van["activity"]["prioritized_steps"] == 0
    assert van["activity"]["samples_moved"] == 0

    # --- scaling efficiency against a "one-GPU" report (here: the same rows, world 1)
    base = {"world_size": 1, "rows": [{**r, "qps": r["qps"] / 2} for r in report["rows"]]}
    head, missing = headline(report["rows"], base)
    assert abs(head["scaling_efficiency"] - 1.0) < 1e-12 and "scaling_efficiency" not in missing

    # --- a sweep split over launches: rows merge, a rerun variant replaces its row
    merged = merge_results(on_disk, {**res[0], "rows": res[0]["rows"][:1]})
    assert [r["variant"] for r in merged["rows"]] == [*VARIANTS[1:], VARIANTS[0]]
    other = {**res[0], "config": {**res[0]["config"], "seed": 99}}
    with pytest.raises(ValueError, match="different config"):
        merge_results(on_disk, other)


def test_report_records_the_switches_the_command_line_does_not_show(monkeypatch):
    """A run's FREESCALE_* / NCCL_* / Triton settings change what it measures (e.g.
    FREESCALE_BLOCK_MASK=reference): the report lists them, JSON and Markdown."""
    from freescale.pipeline.bench_e2e import _markdown, run_environment

    monkeypatch.setenv("FREESCALE_BLOCK_MASK", "reference")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("FREESCALE_GIT_SHA", "abc")  # reported as git_sha, not here
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "1")
    env = run_environment()
    assert env["FREESCALE_BLOCK_MASK"] == "reference" and env["NCCL_NVLS_ENABLE"] == "0"
    assert "FREESCALE_GIT_SHA" not in env and "HOME_OF_SOMETHING_ELSE" not in env
    assert list(env) == sorted(env)
    report = {"device": "cpu", "world_size": 1, "date": "d", "git_sha": "abc"}
    report |= {"environment": env, "rows": [], "headline": {}}
    assert "`FREESCALE_BLOCK_MASK=reference`" in _markdown(report)


def test_diagnostic_variants_force_one_setting_only():
    """The sparse-update diagnostics differ from their variant only in
    ``sparse_update``, the completion diagnostic only in ``copy_engine_completion``, the
    fast-switch ones only in the switch interval, the pinned ones only in
    ``pin_threads``; none runs unless named."""
    base = TrainConfig()
    assert not set(DIAGNOSTIC_VARIANTS) & set(VARIANTS)
    pairs = {
        "vanilla_sync_update": ("vanilla", "vanilla", "sync"),
        "vanilla_padded_update": ("vanilla", "vanilla", "padded"),
        "freescale_padded_update": ("freescale", "prioritized", "padded"),
    }
    others = {"freescale_host_completion", "freescale_late_prepare"}
    switch = {"vanilla_fast_switch": "vanilla", "freescale_fast_switch": "freescale"}
    pinned = {"vanilla_pinned": "vanilla", "freescale_pinned": "freescale"}
    others |= {"freescale_gloo_handshake", "freescale_deferred_metrics"}
    others |= {"freescale_shadow_balance", "freescale_no_balance"}  # the balancer only
    others |= {"freescale_local_prepare"}  # prepare_blocks forced off after construction
    others |= {"freescale_sticky", "balance_sticky"}  # another partitioner only
    others |= {"freescale_sticky_cost"}  # sticky's balancer plans with a fitted cost model
    others |= {"freescale_sticky2", "balance_sticky2"}  # another partitioner only
    others |= {"freescale_fbs", "balance_fbs"}  # another partitioner only (the old default)
    others |= {"freescale_verify_plans"}  # the balancer checks plans across ranks only
    others |= {"vanilla_reordered_c", "vanilla_reordered_d"}  # a hook's order only
    others |= {"freescale_again"}  # freescale itself, run again
    assert set(pairs) | others | set(switch) | set(pinned) == set(DIAGNOSTIC_VARIANTS)
    got = _variant_cfg(base, "freescale_gloo_handshake", "prioritized")
    ref0 = _variant_cfg(base, "freescale", "prioritized")
    again = _variant_cfg(base, "freescale_again", "prioritized")
    assert again == dataclasses.replace(ref0, log_path=again.log_path)
    from freescale.pipeline.bench_e2e import balance_config as _bc

    assert _bc("freescale_again") == _bc("freescale")
    assert got.copy_engine_handshake == "gloo" and ref0.copy_engine_handshake == "auto"
    assert got == dataclasses.replace(ref0, copy_engine_handshake="gloo", log_path=got.log_path)
    from freescale.balance.hook import FREESCALE_PARTITIONER, FREESCALE_REFIT_EVERY
    from freescale.pipeline.bench_e2e import _SPEC

    for diag, twin, part in (
        ("freescale_sticky", "freescale", "sticky"),
        ("balance_sticky", "balance", "sticky"),
        ("freescale_sticky2", "freescale", "sticky2"),
        ("balance_sticky2", "balance", "sticky2"),
        ("freescale_fbs", "freescale", "fbs"),
        ("balance_fbs", "balance", "fbs"),
    ):
        assert _SPEC[diag] == (_SPEC[twin][0], part) and _SPEC[twin][1] == FREESCALE_PARTITIONER
        got, ref = (
            _variant_cfg(base, diag, _SPEC[diag][0]),
            _variant_cfg(base, twin, _SPEC[twin][0]),
        )
        assert got == dataclasses.replace(ref, log_path=got.log_path)
    # sticky_cost differs from freescale_sticky in the balancer's cost model only, and is
    # freescale's balancer; the variants on it (named for another switch) refit, the ones
    # named for a partitioner do not
    from freescale.pipeline.bench_e2e import REFIT_EVERY, balance_config

    assert balance_config("freescale_sticky_cost") == balance_config("freescale")
    assert balance_config("balance") == balance_config("freescale")
    assert balance_config("freescale").refit_every == FREESCALE_REFIT_EVERY
    assert balance_config("freescale_verify_plans") == dataclasses.replace(
        balance_config("freescale"), verify_plans=True
    )
    assert not any(balance_config(n).verify_plans for n in ("freescale", "balance"))
    got = _variant_cfg(base, "freescale_sticky_cost", "prioritized")
    assert got == dataclasses.replace(ref0, log_path=got.log_path)
    assert _SPEC["freescale_sticky_cost"] == _SPEC["freescale_sticky"]
    bc = balance_config("freescale_sticky_cost")
    assert (
        bc
        == dataclasses.replace(
            balance_config("freescale_sticky"),
            use_cost_model=True,
            refit_every=REFIT_EVERY["freescale_sticky_cost"],
        )
        and bc.refit_every > 0
    )
    refitting = {n for n in (*VARIANTS, *DIAGNOSTIC_VARIANTS) if n.startswith("freescale")}
    refitting -= {"freescale_fbs", "freescale_sticky", "freescale_sticky2"}
    refitting = (refitting - {"freescale_no_balance"}) | {"balance"}
    assert set(REFIT_EVERY) == refitting
    for name in (*VARIANTS, *DIAGNOSTIC_VARIANTS):
        cfg = balance_config(name)
        assert (cfg is None) == (_SPEC[name][1] is None), name
        if cfg is not None:
            assert cfg.use_cost_model == (name in refitting), name
            assert cfg.refit_every == (FREESCALE_REFIT_EVERY if name in refitting else 0)
    got = _variant_cfg(base, "freescale_deferred_metrics", "prioritized")
    assert got.defer_metrics and not ref0.defer_metrics
    assert got == dataclasses.replace(ref0, defer_metrics=True, log_path=got.log_path)
    for diag, twin in pinned.items():
        mode = "vanilla" if twin == "vanilla" else "prioritized"
        got, ref = _variant_cfg(base, diag, mode), _variant_cfg(base, twin, mode)
        assert got.pin_threads and not ref.pin_threads
        assert got == dataclasses.replace(ref, pin_threads=True, log_path=got.log_path)
    for diag, twin in switch.items():
        mode = "vanilla" if twin == "vanilla" else "prioritized"
        got, ref = _variant_cfg(base, diag, mode), _variant_cfg(base, twin, mode)
        assert got.gil_switch_interval_ms == 0.5 and ref.gil_switch_interval_ms is None
        assert got == dataclasses.replace(ref, gil_switch_interval_ms=0.5, log_path=got.log_path)
    for diag, (twin, mode, update) in pairs.items():
        got, ref = _variant_cfg(base, diag, mode), _variant_cfg(base, twin, mode)
        assert got.sparse_update == update and ref.sparse_update == base.sparse_update
        assert got == dataclasses.replace(ref, sparse_update=update, log_path=got.log_path)
    got = _variant_cfg(base, "freescale_host_completion", "prioritized")
    ref = _variant_cfg(base, "freescale", "prioritized")
    assert got.copy_engine_completion == "host" and ref.copy_engine_completion == "auto"
    assert got == dataclasses.replace(ref, copy_engine_completion="host", log_path=got.log_path)
    got = _variant_cfg(base, "freescale_late_prepare", "prioritized")
    assert got.early_prepare is False and ref.early_prepare is True
    assert got == dataclasses.replace(ref, early_prepare=False, log_path=got.log_path)


def test_unprofiled_estimates_in_the_headline():
    """The profiler-free estimates come from the same rows: unprofiled step = host wall
    per timed step, non-compute = step - GPU compute, inflation = GPU window - step;
    rows without host CPU or GPU accounting give none (never invented)."""

    def row(name, wall, window, compute):
        return {
            "variant": name,
            "qps": 1000.0,
            "eval_ne": 0.5,
            "step_ms": wall,
            "straggler_share_median": 0.0,
            "summary": {"world_size": 2, "host_cpu": {"wall_ms_per_step": wall}},
            "gpu_accounting": {
                "available": True,
                "window_ms": window,
                "compute_ms": compute,
                "bubble_ms": window - compute,
                "exposed_comm_ms": 1.0,
            },
        }

    rows = [row("vanilla", 40.0, 39.0, 32.0), row("freescale", 38.0, 44.0, 34.0)]
    head, _ = headline(rows)
    assert head["noncompute_unprofiled_ms"] == {"vanilla": 8.0, "freescale": 4.0}
    assert head["profiler_inflation_ms"] == {"vanilla": -1.0, "freescale": 6.0}
    assert head["noncompute_reduction_unprofiled"] == pytest.approx(0.5)
    assert head["bubble_reduction"] == pytest.approx(1 - 10.0 / 7.0)  # the measured one stays
    rows[1]["summary"]["host_cpu"] = None
    head, _ = headline(rows)
    assert "freescale" not in head["noncompute_unprofiled_ms"]
    assert "noncompute_reduction_unprofiled" not in head


def test_noise_floor_takes_every_reordering_and_the_repeat_distance():
    """The NE floor is the largest distance of every in-rank reordering present (four
    since session 18), each reported as a sample; freescale_again gives the distance
    between two runs of freescale's config; the reorderings' salts are distinct."""
    from freescale.pipeline.bench_e2e import REORDER_SALT

    assert len(set(REORDER_SALT.values())) == len(REORDER_SALT)

    def row(name, ne):
        return {"variant": name, "qps": 1.0, "eval_ne": ne, "step_ms": 1.0,
                "straggler_share_median": 0.0, "summary": {"world_size": 2}}  # fmt: skip

    nes = {"vanilla_reordered": 1.000001, "vanilla_reordered_b": 1.000002,
           "vanilla_reordered_c": 1.000008, "vanilla_reordered_d": 0.999997}  # fmt: skip
    rows = [row("vanilla", 1.0), row("freescale", 1.00005), row("freescale_again", 1.00001)]
    rows += [row(name, ne) for name, ne in nes.items()]
    head, _ = headline(rows)
    assert set(head["ne_noise_floor_samples"]) == set(nes)
    assert head["ne_noise_floor"] == pytest.approx(8e-6)  # reordering c's, the largest
    assert head["ne_within_noise_floor"] is False  # 5e-5 > 8e-6
    assert head["ne_rel_diff_freescale_runs"] == pytest.approx(4e-5 / 1.00005)
    assert "ne_rel_diff_vanilla_reordered_c" not in head  # moved into the samples
    head, _ = headline(rows[:2])
    assert "ne_rel_diff_freescale_runs" not in head and "ne_noise_floor" not in head


def _e2e_repeats(rank, world, cfg, variants, repeats):
    return run_e2e(rank, world, cfg, variants, repeats=repeats)


def test_repeated_passes_replay_the_numerics(pool2, tmp_path):
    """``repeats=2``: the variant list twice, the second pass reversed (A B, B A: no
    variant always runs after the others); the second pass is in
    ``repeat_rows`` with ``pass`` 1 and replays the first bit for bit (eval NE curve,
    activity counters); the headline has QPS per pass, the ratio per pass and its
    median, and each variant's spread (their values are timings: not asserted)."""
    cfg = dataclasses.replace(e2e_config(), profile_steps=0)
    res = pool2.run(_e2e_repeats, cfg, ["vanilla", "freescale"], 2)
    report = write_report(res[0], str(tmp_path), command="pytest repeats")
    first = {r["variant"]: r for r in report["rows"]}
    again = {r["variant"]: r for r in report["repeat_rows"]}
    assert set(first) == set(again) == {"vanilla", "freescale"}
    assert [r["variant"] for r in report["rows"]] == ["vanilla", "freescale"]
    assert [r["variant"] for r in report["repeat_rows"]] == ["freescale", "vanilla"]
    assert [r["position"] for r in report["repeat_rows"]] == [0, 1]
    for name in first:
        assert first[name]["pass"] == 0 and again[name]["pass"] == 1
        assert again[name]["ne_curve"] == first[name]["ne_curve"], name
        assert again[name]["activity"] == first[name]["activity"], name
    h = report["headline"]
    assert h["passes"] == 2 and set(h["qps_by_pass"]) == {"vanilla", "freescale"}
    assert all(len(v) == 2 for v in h["qps_by_pass"].values())
    assert len(h["qps_ratio_by_pass"]) == 2 and "qps_ratio_median" in h
    assert set(h["qps_spread_by_variant"]) == {"vanilla", "freescale"}
    assert "QPS per pass" in (tmp_path / "e2e.md").read_text()
    # a merge keeps the earlier report's repeats of variants this run did not redo
    merged = merge_results(report, {**res[0], "rows": res[0]["rows"][:1], "repeat_rows": []})
    assert [r["variant"] for r in merged["repeat_rows"]] == ["freescale"]
    with pytest.raises(ValueError, match="repeats"):
        run_e2e(0, 1, cfg, ["vanilla"], repeats=0)


def test_bench_defaults_gpu_profiles_device_activity_only():
    """On GPUs the benchmark profiles GPU activity only unless told otherwise (the
    accounting reads nothing else; host-op recording stretches host-bound steps)."""
    cfg = TrainConfig()
    apply_bench_defaults(cfg, set(), gpu=True, steps=1000)
    assert (cfg.profile_activities, cfg.timing, cfg.profile_steps) == ("cuda", "events", 20)
    assert cfg.gil_probe_ms == 2.0
    cfg = TrainConfig(profile_activities="cpu_cuda", timing="sync")
    apply_bench_defaults(cfg, {"--profile-activities", "--timing"}, gpu=True, steps=1000)
    assert (cfg.profile_activities, cfg.timing) == ("cpu_cuda", "sync")  # the user's word
    cfg = TrainConfig()
    apply_bench_defaults(cfg, set(), gpu=False, steps=8)
    assert (cfg.profile_activities, cfg.timing, cfg.profile_steps) == ("auto", "sync", 2)


def test_balance_diagnostics_run_and_differ_only_in_balancing(pool2):
    """``freescale_shadow_balance`` plans (metadata exchanged, steps planned) but moves
    no sample, so it trains exactly as prioritized with the SM-free backend does
    (``freescale_no_balance``); ``freescale`` moves samples. Same config as freescale's
    otherwise. ``freescale_local_prepare`` is freescale with prepare_backward's
    rank-local choice forced (reported as ``prepare_blocks`` False): the same bits."""
    base = TrainConfig()
    ref = _variant_cfg(base, "freescale", "prioritized")
    for diag in ("freescale_shadow_balance", "freescale_no_balance", "freescale_local_prepare"):
        got = _variant_cfg(base, diag, "prioritized")
        assert got == dataclasses.replace(ref, log_path=got.log_path), diag
    cfg = dataclasses.replace(e2e_config(), profile_steps=0)
    variants = ["freescale", "freescale_shadow_balance", "freescale_no_balance"]
    variants.append("freescale_local_prepare")
    rows = {r["variant"]: r for r in pool2.run(_e2e, cfg, variants)[0]["rows"]}
    local = rows["freescale_local_prepare"]
    assert local["activity"]["prepare_blocks"] is False
    assert local["ne_curve"] == rows["freescale"]["ne_curve"]
    assert (
        local["activity"]["prioritized_steps"] == rows["freescale"]["activity"]["prioritized_steps"]
    )
    moved = {v: r["activity"]["samples_moved"] for v, r in rows.items()}
    assert moved["freescale"] > 0 and moved["freescale_shadow_balance"] == 0
    assert moved["freescale_no_balance"] == 0
    shadow, plain = rows["freescale_shadow_balance"], rows["freescale_no_balance"]
    assert shadow["ne_curve"] == plain["ne_curve"]  # nothing moved: the same training
    assert shadow["activity"]["prioritized_steps"] > 0


def test_e2e_sticky_partitioner_tier2(pool2):
    """The sticky diagnostics (another balancing partitioner): a legal reordering within
    tier 2 of vanilla (float64), balancing really ran (samples moved), and it moved fewer
    samples than fbs on the same data while prioritized stayed active."""
    variants = ["vanilla", "balance_fbs", "balance_sticky", "freescale_sticky"]
    res = pool2.run(_e2e, e2e_config(), variants)
    rows = {r["variant"]: r for r in res[0]["rows"]}
    van = rows["vanilla"]
    for name in ("balance_sticky", "freescale_sticky"):
        for p, q in zip(rows[name]["ne_curve"], van["ne_curve"], strict=True):
            assert abs(p["eval_ne"] - q["eval_ne"]) <= F64_TOL * abs(q["eval_ne"]), name
        assert rows[name]["balance"] == "sticky"
        assert rows[name]["activity"]["balance_cost_model"] is None  # plans on L^alpha
    moved = {n: rows[n]["activity"]["samples_moved"] for n in variants[1:]}
    assert 0 < moved["balance_sticky"] < moved["balance_fbs"], moved
    assert moved["freescale_sticky"] == moved["balance_sticky"], moved  # same data, plans
    a = rows["freescale_sticky"]["activity"]
    assert a["prioritized_steps"] > 0 and a["deferred_rows"] > 0, a
