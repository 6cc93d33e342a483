"""Killed / hung rank on 2 GPUs with NCCL (issue 8): does the job end, in time, clearly?

A self-checking driver. For each scenario it launches ``torchrun --nproc-per-node 2 -m
freescale.cli train --device cuda ... --timeout T`` with the test-only fault injector
(``FREESCALE_FAULT_KILL_RANK_AT_STEP=1:K`` or ``FREESCALE_FAULT_HANG_RANK_AT_STEP=1:K``,
see docs/faults.md), measures the seconds from the injected fault to the job's exit and
checks:

* the job exits non-zero within ``T + --slack`` seconds of the fault;
* the output says what failed: FreeScale's own message (``[freescale rank 0]
  RankLost / CollectiveTimeout / collective timeout: ... rank 1 ...``) or, where the
  training thread was stuck in a CUDA sync and NCCL's watchdog ended the process first,
  NCCL's ``Watchdog caught collective operation timeout`` naming the operation; the
  verdict records which of the two it was;
* the launcher reports the failed job (``ChildFailedError``, root cause rank).

What it relies on (torch 2.x defaults, set explicitly here unless already set):
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (a timed-out NCCL collective ends the process
instead of hanging) and the process-group timeout ``--timeout`` (FreeScale sets it on
its own groups, which ``new_group()`` would otherwise leave at 10 minutes). On NCCL the
FreeScale watchdog reports at 0.8 T and exits at 0.9 T (exit code 75) if the training
thread has not raised by then; NCCL's own watchdog fires at T. ``NCCL_NVLS_ENABLE=0``
and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` as for the other GPU benchmarks.

Run (2 H200, about 1.5 minutes for both scenarios; prints one JSON verdict, exit code
0 when every check passed)::

    PYTHONPATH=src python benchmarks/kill_rank_gpu.py --out benchmarks/results

Also runs on CPU for a dry check (``--device cpu``: gloo, where both messages come from
FreeScale).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

SMALL = (
    "--steps 40 --num-items 100000 --max-uih 512 --median-uih 64 --embedding-dim 64 "
    "--num-layers 1 --num-heads 2 --eval-samples 256 --no-progress"
).split()
OURS = re.compile(r"\[freescale rank \d+\] (RankLost|CollectiveTimeout|collective timeout)")
NCCL_WD = re.compile(r"Watchdog caught collective operation timeout|NCCL.*(timeout|abort)", re.I)
# torchrun's failure report naming the failed rank first (a dead worker makes the agent
# tear the survivors down at its next monitor tick, before any collective can time out)
LAUNCHER = re.compile(
    r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)[^\n]*",
    re.S,
)


def run_scenario(
    kind: str, device: str, timeout: float, step: int, slack: float, log_dir: str | None = None
) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    spec = f"1:{step}" if kind == "kill" else f"1:{step}:{int(3 * timeout + 60)}"
    env[f"FREESCALE_FAULT_{kind.upper()}_RANK_AT_STEP"] = spec
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--monitor-interval",
        "0.5",
        "-m",
        "freescale.cli",
        "train",
        "--device",
        device,
        *SMALL,
        "--timeout",
        str(timeout),
    ]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    lines: list[str] = []
    t_fault = None
    for line in p.stdout:
        sys.stdout.write(line)
        lines.append(line)
        if t_fault is None and "[freescale fault injector" in line:
            t_fault = time.monotonic()
    rc = p.wait()
    t_end = time.monotonic()
    out = "".join(lines)
    ours = [ln.strip() for ln in lines if OURS.search(ln)]
    nccl = [ln.strip() for ln in lines if NCCL_WD.search(ln)]
    root = LAUNCHER.search(out)
    launcher = " ".join(root.group(0).split()) if root else None
    # for a killed rank, torchrun's report must name that rank (1) as the root cause
    launcher_names_rank = bool(root) and root.group(1) == "1" and kind == "kill"
    after = (t_end - t_fault) if t_fault is not None else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        with open(os.path.join(log_dir, f"kill_rank_{device}_{kind}.log"), "w") as f:
            f.write(out)
    checks = {
        "fault_injected": t_fault is not None,
        "exit_nonzero": rc != 0,
        "within_timeout": after is not None and after <= timeout + slack,
        "clear_message": bool(ours) or bool(nccl) or launcher_names_rank,
        "launcher_reports_failure": "ChildFailedError" in out,
    }
    return {
        "scenario": kind,
        "device": device,
        "timeout_s": timeout,
        "fault_step": step,
        "exit_code": rc,
        "seconds_fault_to_exit": after,
        "seconds_total": t_end - t0,
        "message_source": "freescale"
        if ours
        else ("nccl" if nccl else ("launcher" if launcher_names_rank else None)),
        "freescale_message": ours[0][:600] if ours else None,
        "nccl_message": nccl[0][:600] if nccl else None,
        "launcher_root_cause": launcher[:600] if launcher else None,
        "checks": {k: bool(v) for k, v in checks.items()},
        "passed": all(checks.values()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--timeout", type=float, default=20.0, help="collective timeout, s")
    ap.add_argument("--slack", type=float, default=15.0, help="allowed teardown, s")
    ap.add_argument("--step", type=int, default=5, help="step at which rank 1 fails")
    ap.add_argument("--scenarios", default="kill,hang")
    ap.add_argument("--out", default=None, help="write kill_rank_<device>.json here")
    args = ap.parse_args()
    results = [
        run_scenario(k, args.device, args.timeout, args.step, args.slack, args.out)
        for k in args.scenarios.split(",")
    ]
    verdict: dict[str, Any] = {"passed": all(r["passed"] for r in results), "results": results}
    verdict.update(
        figure=f"kill_rank_{args.device}",
        git_sha=os.environ.get("FREESCALE_GIT_SHA"),
        device=args.device,
        date=time.strftime("%Y-%m-%d"),
        command="python " + " ".join(sys.argv),
        rows=results,
        headline={
            "passed": verdict["passed"],
            **{f"{r['scenario']}_seconds_to_exit": r["seconds_fault_to_exit"] for r in results},
            **{f"{r['scenario']}_message_source": r["message_source"] for r in results},
        },
    )
    text = json.dumps(verdict, indent=2)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"kill_rank_{args.device}.json"), "w") as f:
            f.write(text + "\n")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
