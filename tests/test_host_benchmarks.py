"""The host diagnostics under benchmarks/ run and write well-formed figure files on CPU
(structure only: these scripts report this machine's timings, never asserted)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

FIGURE_KEYS = ("figure", "device", "git_sha", "date", "command", "rows", "headline")


def _figure(path) -> dict:
    d = json.loads(path.read_text())
    assert all(k in d for k in FIGURE_KEYS), sorted(d)
    return d


@pytest.mark.timeout(300)
def test_copy_engine_call_runs_both_handshakes(tmp_path):
    import copy_engine_call
    from freescale.comm.shm_exchange import available

    assert copy_engine_call.main(["--calls", "5", "--out", str(tmp_path)]) == 0
    d = _figure(tmp_path / "copy_engine_call.json")
    want = ["gloo", "shm"] if available()[0] else ["gloo", "gloo"]
    assert [r["handshake"] for r in d["rows"]] == want
    assert all(r["calls"] == 5 and r["ms_per_call"] > 0 for r in d["rows"])


@pytest.mark.timeout(300)
def test_gloo_host_writes_its_figure(tmp_path):
    import gloo_host

    assert gloo_host.main(["--reps", "1", "--out", str(tmp_path)]) == 0
    d = _figure(tmp_path / "gloo_host.json")
    ops = {r["op"] for r in d["rows"]}
    assert {"all_to_all", "all_gather", "all_reduce_flag_1", "barrier"} <= ops
    assert {"small_all_gather_ms", "all_to_all_gb_per_s_4mb"} <= set(d["headline"])


@pytest.mark.timeout(300)
def test_sm_contention_smoke_writes_its_figure(tmp_path):
    """`sm_contention.py --smoke` (2 CPU ranks, synthetic cells: the figure's pipeline,
    not a measurement) writes the figure with its headline, and every row carries the
    wall clock it finished at (for lining rows up with clock samples, e2e_gpu.sh smc2)."""
    import subprocess

    here = os.path.dirname(__file__)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        os.path.join(here, "..", "benchmarks", "sm_contention.py"),
        "--smoke",
        "--out",
        str(tmp_path),
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=240)
    d = _figure(tmp_path / "sm_contention.json")
    assert d["rows"] and all(r["finished_unix"] > 0 for r in d["rows"])
    assert "smfree_vs_nccl_slowdown_ratio" in d["headline"]


@pytest.mark.timeout(300)
def test_balance_host_ab_writes_its_figure(tmp_path):
    import balance_host

    src = os.path.join(os.path.dirname(__file__), "..", "src")
    argv = ["--batches", "2", "--passes", "2", "--out", str(tmp_path)]
    argv += ["--code", f"a={src}:fbs", "--code", f"b={src}:fbs,sticky"]
    assert balance_host.main(argv) == 0
    d = _figure(tmp_path / "balance_host.json")
    got = {(r["code"], r["partitioner"], r["pass"]) for r in d["rows"]}
    assert got == {
        (c, p, n) for n in (0, 1) for c, p in [("a", "fbs"), ("b", "fbs"), ("b", "sticky")]
    }
    h = d["headline"]
    assert "b:fbs:cpu_ratio_vs_a" in h and "b:sticky:cpu_ratio_vs_a" not in h
    # the same code and data on both sides: the same plans (timings are not asserted)
    assert h["a:fbs:samples_moved_per_batch"] == h["b:fbs:samples_moved_per_batch"] > 0
    assert 0 < h["b:sticky:samples_moved_per_batch"] < h["b:fbs:samples_moved_per_batch"]


@pytest.mark.timeout(120)
def test_sticky_robustness_writes_its_figure(tmp_path):
    """The simulator figure behind the partitioner choice (fbs the default until session 17,
    sticky on the fitted cost model since): every planner at every world
    size, sticky moving few samples where fbs moves about (W - 1) / W, and the headline
    comparing each sticky planner with fbs (simulated costs, no timings)."""
    import sticky_robustness as sr

    assert sr.main(["--world-sizes", "2,8", "--steps", "3", "--out", str(tmp_path)]) == 0
    d = _figure(tmp_path / "sticky_robustness.json")
    names = sr.planners(sr.MISFITS)
    assert [(r["world_size"], r["planner"]) for r in d["rows"]] == [
        (w, n) for w in (2, 8) for n in names
    ]
    by = {(r["world_size"], r["planner"]): r for r in d["rows"]}
    for w in (2, 8):
        assert by[(w, "fbs")]["moved_share_median"] >= 0.4
        for n in names:
            if n.startswith("sticky"):
                assert by[(w, n)]["moved_share_median"] < 0.1, (w, n)
        assert set(d["headline"][f"straggler_over_fbs_{w}ranks"]) == {
            n for n in names if n.startswith("sticky")
        }


def test_ncu_sass_summary_counts_per_id_and_shares(tmp_path):
    """`ncu_sass_summary.py` on a small export of the shape ``ncu --page source --csv``
    writes: a kernel-name row, the header, one row per SASS line."""
    import ncu_sass_summary

    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
    header += ["stall_long_sb", "stall_short_sb"]
    rows = [
        ["0x0", "  LDG.E.64 R2, desc[UR4][R2.64]", "10", "64", "0", "0"],
        ["0x10", "@P0 IMAD.MOV.U32 R4, RZ, RZ, R2", "30", "128", "30", "0"],
        ["0x20", "  LDS.U16 R5, [R4]", "60", "64", "0", "60"],
    ]
    path = tmp_path / "sass.csv"
    text = '"Kernel Name","k",\n' + "\n".join(
        ",".join(f'"{c}"' for c in r) for r in [header, *rows]
    )
    path.write_text(text + "\n")
    s = ncu_sass_summary.summarise(str(path), ids=32 * 64, top=2)
    assert s["warp_instructions_per_32_ids"] == pytest.approx(256 / 64)
    assert s["by_opcode"]["IMAD"]["instr_share"] == pytest.approx(0.5)
    assert s["by_opcode"]["LDS"]["sample_share"] == pytest.approx(0.6)
    assert [h["line"] for h in s["hottest_lines"]] == [2, 1]
    assert s["hottest_lines"][0]["reason"] == "stall_short_sb"
    assert s["hottest_lines"][1]["reason"] == "stall_long_sb"
    assert ncu_sass_summary.main([str(path), "--ids", str(32 * 64)]) == 0
