"""CompileWatch (pipeline/compile_watch.py): compiles inside a measured window."""

from __future__ import annotations

import torch

from freescale.pipeline.compile_watch import COMPILE_KEYS, CompileWatch
from freescale.pipeline.trainer import Trainer, TrainerHook


def test_dynamo_graphs_compiled_inside_the_window_are_counted():
    def f(x):
        return torch.sin(x) * 2 + 1

    g = torch.compile(f, backend="eager")  # Dynamo only: no C++ compiler needed
    w = CompileWatch(triton=False)
    w.start()
    g(torch.randn(8))
    first = w.stop()
    assert set(COMPILE_KEYS) <= set(first)
    assert first["dynamo_graphs_in_window"] >= 1
    assert first["jit_compiles_in_window"] == 0
    w2 = CompileWatch(triton=False)  # the same shapes again: cached, nothing compiled
    w2.start()
    g(torch.randn(8))
    assert w2.stop()["dynamo_graphs_in_window"] == 0


def test_triton_hooks_count_chain_and_are_restored():
    """Triton calls ``jit_cache_hook`` before a compile and ``jit_post_compile_hook``
    after it (``JITFunction._do_compile``); a CPU run compiles nothing (the
    interpreter), so the hooks are called here as Triton calls them."""
    import triton

    knobs = triton.knobs.runtime
    seen = []

    def user_before(**kw):
        seen.append(("before", kw["key"]))

    def user_after(**kw):
        seen.append(("after", kw["key"]))

    old = knobs.jit_cache_hook, knobs.jit_post_compile_hook
    knobs.jit_cache_hook, knobs.jit_post_compile_hook = user_before, user_after
    try:
        w = CompileWatch(triton=True)
        w.start()
        fn = type("Info", (), {"name": "_my_kernel"})()
        for key in ("k1", "k2"):
            assert not knobs.jit_cache_hook(key=key, fn=fn, repr="", compile={})
            knobs.jit_post_compile_hook(key=key, fn=fn, repr="", compile={})
        out = w.stop()
        assert out["jit_compiles_in_window"] == 2
        assert out["jit_compile_s_in_window"] >= 0.0
        assert out["jit_kernels"] == {"_my_kernel": 2}
        # the hooks set before start are called too, and are back after stop
        assert seen == [("before", "k1"), ("after", "k1"), ("before", "k2"), ("after", "k2")]
        assert (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == (user_before, user_after)
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = old


def test_a_hook_that_skips_the_compile_is_respected():
    import triton

    knobs = triton.knobs.runtime
    old = knobs.jit_cache_hook, knobs.jit_post_compile_hook
    knobs.jit_cache_hook = lambda **kw: True  # e.g. a tool that only lists the variants
    try:
        w = CompileWatch(triton=True)
        w.start()
        assert knobs.jit_cache_hook(key="k", fn=None, repr="", compile={}) is True
        assert w.stop()["jit_compiles_in_window"] == 0
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = old


class _CompileLate(TrainerHook):
    """Compiles a new torch.compile graph on rank 1 at the last step (inside the profiled
    window), as a kernel's first use there would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_backward(self, trainer, step):  # noqa: ANN001, ANN201
        if step == self.step and trainer.rank == 1:
            torch.compile(lambda x: torch.cos(x) + 3, backend="eager")(torch.randn(5))


def _train(rank, world, cfg, late):
    tr = Trainer(cfg, hooks=[_CompileLate(cfg.steps)] if late else [])
    return tr.train()


def test_the_trainer_reports_compiles_inside_the_profiled_window(pool2, capsys):
    import dataclasses

    from tests.test_trainer import tiny_config

    cfg = dataclasses.replace(tiny_config(steps=6, dtype="float32"), profile_steps=2)
    from freescale.cli import _print_summary

    clean = pool2.run(_train, cfg, False)
    late = pool2.run(_train, cfg, True)
    for s in clean:
        acc = s["gpu_accounting"]
        assert acc["profiled_steps"] == 2
        assert acc["jit_compiles_in_window"] == 0 and acc["dynamo_graphs_in_window"] == 0
    for s in late:  # the largest over ranks: rank 0 sees rank 1's compile too
        assert s["gpu_accounting"]["dynamo_graphs_in_window"] >= 1
    # `freescale train` prints a warning line for the late run only
    _print_summary(clean[0])
    assert "compiles inside the profiled steps" not in capsys.readouterr().out
    _print_summary(late[0])
    assert "warning: compiles inside the profiled steps" in capsys.readouterr().out


def test_the_compile_log_diagnostic_writes_one_line_per_compile(tmp_path):
    """benchmarks/host_time/sitecustomize.py with FS_TRITON_COMPILES (CompileWatch's
    ``on_compile``), in a fresh process; the hooks are called as Triton calls them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = (
        "import triton\n"
        "k = triton.knobs.runtime\n"
        "fn = type('Info', (), {'module': 'm', 'name': '_k'})()\n"
        "assert not k.jit_cache_hook(key='a', fn=fn, repr='r', compile={})\n"
        "k.jit_post_compile_hook(key='a', fn=fn, repr='r', compile={})\n"
    )
    env = dict(os.environ, FS_TRITON_COMPILES=str(tmp_path))
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "benchmarks" / "host_time"), str(root / "src"), env.get("PYTHONPATH", "")]
    )
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    (log,) = tmp_path.glob("compiles_*.jsonl")
    (row,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert row["kernel"] == "m._k" and row["seconds"] >= 0 and row["thread"] == "MainThread"
