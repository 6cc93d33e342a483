"""The one-call GPU scripts under benchmarks/ parse, and `v5_next.sh` (``DRY=1``) plans
the steps its header promises for each card, naming only configurations and tests that
exist: a typo there costs a GPU call (its device time is scarce), not a CI run."""

from __future__ import annotations

import ast
import os
import re
import subprocess
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
    # both cards (session 49): the atomic scatter checked, then timed next to the table
    # from W = 128, then (session 50) its LONG path on uniform and power-law ids, then
    # the card's figure
    assert len(steps) == 4, steps
    assert "--check-only --check-configs atomic_" in steps[0], steps
    assert f"--out {tmp_path}/ab4 " in steps[1] and "--worlds 128 256 512 1024 2048 " in steps[1]
    assert "atomic_t8192_c8_s16_u2_v32_pf_sn16" in steps[1], steps
    assert f"--out {tmp_path}/hot " in steps[2] and "--workloads large hot " in steps[2], steps
    assert "_rl0" in steps[2] and "_rlmax" in steps[2], steps
    assert f"benchmarks/kernels.py --out {tmp_path}/k " in steps[3], steps
    known = _dispatch_v5_configs()
    for step in steps:
        for names in re.findall(r"--(?:configs|check-configs|ncu-config) ([\w ]+?)(?: --|$)", step):
            missing = [n for n in names.split() if n not in known]
            assert not missing, (card, missing)


def test_v5_next_refuses_without_a_known_card(tmp_path: Path) -> None:
    done = _plan(tmp_path, "")
    assert done.returncode == 1
    assert "no H100 or H200 here" in done.stderr
