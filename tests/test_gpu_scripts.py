"""The one-call GPU scripts under benchmarks/ parse, and `v5_next.sh` (``DRY=1``) plans
the steps its header promises for each card, naming only configurations and tests that
exist: a typo there costs a GPU call (its device time is scarce), not a CI run."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.sh")) + sorted((ROOT / "tools").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_parse(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def _dispatch_v5_configs() -> set[str]:
    """The names in `benchmarks/dispatch_v5.py`'s CONFIGS, read without importing it (its
    import needs Triton's Gluon, which the plan check does not): the module's literal
    assignments (CONFIGS, the base names) and the top-level loops that add variants to
    CONFIGS (e.g. session 39's `_la<n>`), run on their own."""
    tree = ast.parse((ROOT / "benchmarks" / "dispatch_v5.py").read_text())

    def literal(node: ast.AST) -> bool:
        try:
            ast.literal_eval(node)
        except ValueError:
            return False
        return True

    keep = [
        node
        for node in tree.body
        if (isinstance(node, ast.Assign) and literal(node.value))
        or (isinstance(node, ast.For) and "CONFIGS[" in ast.unparse(node))
    ]
    if not any(isinstance(n, ast.Assign) and "CONFIGS" in ast.unparse(n.targets[0])
               for n in keep):  # fmt: skip
        raise AssertionError("no CONFIGS in dispatch_v5.py")
    ns: dict = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), "dispatch_v5.py", "exec"), ns)
    return set(ns["CONFIGS"])


def _plan(tmp_path: Path, card: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DRY": "1", "CARD": card, "OUT": str(tmp_path), "GIT_SHA": "0" * 40}
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "v5_next.sh"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("card", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_v5_next_plans_existing_configs_and_tests(tmp_path: Path, card: str) -> None:
    done = _plan(tmp_path, card)
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("would run")]
    assert "-m pytest" in steps[0]  # the GPU cases come first on every card
    if "H200" in card:  # v5's defaults checked before the A/B
        assert "check_kernels_cuda.py" in steps[1]
    # session 41: the table's configs with and without early_loads, last
    assert "dispatch_v5.py" in steps[-1] and "_early" in steps[-1], steps
    known = _dispatch_v5_configs()
    for step in steps:
        for names in re.findall(r"--(?:configs|ncu-config) ([\w ]+?)(?: --|$)", step):
            missing = [n for n in names.split() if n not in known]
            assert not missing, (card, missing)
    if "H200" in card:  # the H200 table question: its configs against the H100's
        assert any("--configs" in s and "ranks_t8192_c8_s16_u2_v32_pf_sn16" in s for s in steps)
    k = re.search(r"-k (on_gpu[^>]*)$", steps[0])
    assert k is not None  # the -k expression selects at least one GPU case
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "tests/test_kernels_v5.py", "-k", k.group(1)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert re.search(r"\b[1-9]\d* tests? collected|[1-9]\d*/\d+ tests collected",
                     collected.stdout), collected.stdout[-2000:]  # fmt: skip


def test_v5_next_figure_runs_kernels_py_alone(tmp_path: Path) -> None:
    """``v5_next.sh figure``: the second call, once the A/B has picked the table."""
    done = _plan(tmp_path, "NVIDIA H200", "figure")
    assert done.returncode == 0, done.stderr
    steps = [line for line in done.stdout.splitlines() if line.startswith("would run")]
    assert len(steps) == 1 and "benchmarks/kernels.py" in steps[0], steps


def test_v5_next_refuses_without_a_known_card(tmp_path: Path) -> None:
    done = _plan(tmp_path, "")
    assert done.returncode == 1
    assert "no H100 or H200 here" in done.stderr
