"""The ``freescale`` command line: simulate passes its flags through, train runs a
single-process job end to end and writes its summary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from freescale.cli import main

NO_CUDA = not torch.cuda.is_available()


def test_simulate_flags_reach_the_simulator(tmp_path):
    out = tmp_path / "sim.json"
    rc = main(
        [
            "simulate",
            "--ranks",
            "2,8",
            "--steps",
            "2",
            "--max-uih",
            "256",
            "--median",
            "32",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert {r["ranks"] for r in rows} == {2, 8}


def test_train_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "--balance" in capsys.readouterr().out


def test_single_process_train_writes_summary(tmp_path):
    summary = tmp_path / "not" / "yet" / "s.json"  # folders made (it used to end the run)
    log = tmp_path / "log.jsonl"
    rc = main(
        [
            "train",
            "--nproc",
            "1",
            "--device",
            "cpu",
            "--steps",
            "3",
            "--max-uih",
            "32",
            "--median-uih",
            "8",
            "--global-batch-size",
            "8",
            "--eval-samples",
            "8",
            "--no-progress",
            "--summary",
            str(summary),
            "--log",
            str(log),
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
        ]
    )
    assert rc == 0
    # --checkpoint-dir alone: one checkpoint, at the end (none was written before)
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_3"]
    s = json.loads(summary.read_text())["summary"]
    assert s["steps"] == 3 and s["world_size"] == 1
    assert 0 < s["oracle_ne"] < 1 and s["eval_ne"] > 0
    kinds = [json.loads(line)["kind"] for line in log.read_text().splitlines()]
    assert "train" in kinds and "eval" in kinds and kinds[-1] == "summary"


def test_mode_freescale_turns_every_technique_on_and_flags_override():
    import argparse

    from freescale.balance.hook import balance_config_from_args
    from freescale.cli import _add_train_flags, build_train_config, resolve_mode

    def parse(*argv):
        p = argparse.ArgumentParser()
        _add_train_flags(p)
        args = p.parse_args(list(argv))
        resolve_mode(args)
        return build_train_config(args, gpu=False), balance_config_from_args(args)

    cfg, bal = parse("--mode", "freescale")
    assert cfg.mode == "prioritized" and cfg.overlap_backend == "auto"
    # freescale's balancer: sticky on the cost model refitted every 20 steps
    assert bal is not None and bal.partitioner == "sticky"
    assert bal.use_cost_model and bal.refit_every == 20 and bal.cost_model_path is None
    # a named partitioner keeps its own defaults (no refit), as does a refit flag given
    _, bal = parse("--mode", "freescale", "--balance", "fbs")
    assert bal.partitioner == "fbs" and not bal.use_cost_model and bal.refit_every == 0
    _, bal = parse("--mode", "freescale", "--balance-refit-every", "0")
    assert bal.partitioner == "sticky" and not bal.use_cost_model
    _, bal = parse("--mode", "freescale", "--balance-refit-every", "7")
    assert bal.partitioner == "sticky" and bal.refit_every == 7
    _, bal = parse("--mode", "freescale", "--balance", "sticky2")  # plans on lengths
    assert bal.partitioner == "sticky2" and not bal.use_cost_model
    _, bal = parse("--balance", "sticky")  # without --mode freescale: no refit
    assert not bal.use_cost_model and bal.refit_every == 0
    # plans that depend on measured times are logged next to the run log (compact)
    assert bal.log_path is None
    _, bal = parse("--mode", "freescale", "--log", "out/run.jsonl")
    assert bal.log_path == "out/run.plans.jsonl" and bal.log_detail == "compact"
    _, bal = parse("--mode", "freescale", "--log", "r.jsonl", "--balance-log", "p.jsonl")
    assert bal.log_path == "p.jsonl" and bal.log_detail == "full"
    _, bal = parse("--mode", "freescale", "--log", "r.jsonl", "--balance", "fbs")
    assert bal.log_path is None  # deterministic plans: nothing to record
    assert not bal.verify_plans
    _, bal = parse("--mode", "freescale", "--balance-verify-plans")
    assert bal.verify_plans and bal.partitioner == "sticky"
    cfg, bal = parse("--mode", "freescale", "--balance", "off", "--overlap-backend", "default")
    assert cfg.mode == "prioritized" and cfg.overlap_backend == "default" and bal is None
    cfg, bal = parse()  # defaults: vanilla, nothing on
    assert cfg.mode == "vanilla" and cfg.overlap_backend == "default" and bal is None
    assert cfg.model.attention_dtype == "auto" and cfg.sparse_update == "auto"
    cfg, _ = parse("--attention-dtype", "float32", "--sparse-update", "ahead")
    assert cfg.model.attention_dtype == "float32" and cfg.sparse_update == "ahead"
    assert cfg.copy_engine_completion == "auto"
    cfg, _ = parse("--mode", "freescale", "--copy-engine-completion", "device")
    assert cfg.copy_engine_completion == "device"


@pytest.mark.parametrize(
    "flags,names",
    [
        (["--balance", "sticky2", "--balance-refit-every", "5"], "'sticky2'"),
        (["--balance", "fbs", "--balance-alpha", "-1"], "alpha"),
        (["--global-batch-size", "6", "--nproc", "4"], "--global-batch-size 6"),
        (["--source", "movielens"], "--data-path"),
        (["--num-items", "0"], "num_items"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--resume", "/no/such/ckpt"], "--resume '/no/such/ckpt' does not exist"),
        *([(["--device", "cuda"], "CUDA is not available")] if NO_CUDA else []),
        (["--embedding-dim", "0"], "embedding_dim"),
        (["--num-heads", "3", "--embedding-dim", "32"], "num_heads 3"),
        (["--source", "movielens", "--data-path", "/no/such/ml.inter"], "/no/such/ml.inter"),
    ],
)
def test_bad_flag_combination_is_one_line_not_a_traceback(capsys, flags, names):
    """An invalid configuration ends ``freescale train`` with exit code 2 and one error
    line naming it, before any rank is launched."""
    device = [] if "--device" in flags else ["--device", "cpu"]
    assert main(["train", "--nproc", "1", *device, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("freescale train: error: ") and names in err, err
    assert "Traceback" not in err


def test_resume_of_the_runs_own_checkpoint_dir_may_not_exist_yet(tmp_path):
    """``--checkpoint-dir D --resume D``: the first attempt of an elastic job starts fresh
    (docs/faults.md), so the launch check lets a missing D through."""
    from freescale.cli import check_resume

    d = str(tmp_path / "ckpt")
    check_resume(d, d)
    check_resume(d + "/", d)
    with pytest.raises(ValueError, match="does not exist"):
        check_resume(d, str(tmp_path / "other"))


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_nproc_must_be_a_positive_whole_number(capsys, value):
    """``--nproc 0`` is a usage error, not an assertion deep in torch's launcher."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--nproc", value, "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--nproc" in err and "Traceback" not in err, err


def test_failed_rank_ends_in_one_line_naming_it(tmp_path):
    """A rank that raises ends ``freescale train`` with exit code 1: torch's report
    (ChildFailedError, root cause) and a last line naming the rank and its error. The
    file passes the launch check (it exists) and fails in the ranks (no rating)."""
    bad = tmp_path / "bad.inter"
    bad.write_text("user_id:token\titem_id:token\ttimestamp:float\n1\t2\t3\n")
    p = subprocess.run(
        [sys.executable, "-m", "freescale.cli", "train", "--nproc", "2", "--device", "cpu",
         "--source", "movielens", "--data-path", str(bad), "--steps", "2"],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert p.returncode == 1, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("freescale: rank "), last
    assert "failed (exit code 1): ValueError: " in last and "lacks fields ['rating']" in last
    assert "ChildFailedError" in p.stderr
