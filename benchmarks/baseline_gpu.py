"""Figure `baseline_gpu`: the vanilla (TorchRec-equivalent) step on 1 and 2 GPUs.

Runs ``freescale train`` on a long-UIH synthetic workload at 1 GPU and at every GPU of
the machine, then a plain NCCL all-to-all microbenchmark at the embedding exchange's
measured per-step message size, and writes ``<out>/baseline_gpu.json`` (figure,
device, git sha, date, exact commands, rows, headline). Run from the repository root:

    PYTHONPATH=src python benchmarks/baseline_gpu.py --out benchmarks/results --git-sha SHA
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

import torch


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--max-uih", type=int, default=16384)
    p.add_argument("--median-uih", type=int, default=1024)
    p.add_argument("--per-rank", type=int, default=128)
    p.add_argument("--gpus", type=int, nargs="+", default=None)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    env["PYTHONPATH"] = "src" + os.pathsep + env.get("PYTHONPATH", "")
    ngpu = torch.cuda.device_count()
    gpus = a.gpus or sorted({1, ngpu})
    sha = (
        a.git_sha
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        or "unknown"
    )
    commands, rows = [], []
    for n in gpus:
        summ = os.path.join(a.out, f"baseline_summary_{n}gpu.json")
        cmd = [
            sys.executable,
            "-m",
            "freescale",
            "train",
            "--nproc",
            str(n),
            "--device",
            "cuda",
            "--steps",
            str(a.steps),
            "--max-uih",
            str(a.max_uih),
            "--median-uih",
            str(a.median_uih),
            "--global-batch-size",
            str(a.per_rank * n),
            "--eval-every",
            "0",
            "--no-progress",
            "--summary",
            summ,
        ]
        run(cmd, env)
        commands.append(" ".join(cmd[1:]))
        s = json.load(open(summ))["summary"]
        st = s["stage_ms"]
        emb_bytes = s["emb_bytes_sent_per_step"]
        row = {
            "gpus": n,
            "qps": s["qps"],
            "qps_per_gpu": s["qps"] / n,
            "stage_ms": st,
            "straggler_share_median": s["straggler_share_median"],
            "eval_ne": s.get("eval_ne"),
            "oracle_ne": s.get("oracle_ne"),
            "emb_bytes_sent_per_step": emb_bytes,
            "emb_a2a_ms": st.get("emb.emb_a2a"),
        }
        if n > 1 and st.get("emb.emb_a2a"):
            row["emb_a2a_gb_per_s"] = emb_bytes / (st["emb.emb_a2a"] * 1e-3) / 1e9
        rows.append(row)
    head: dict[str, float] = {"qps_1gpu": rows[0]["qps"]}
    multi = [r for r in rows if r["gpus"] > 1]
    if multi:
        m = multi[-1]
        # the same message size as the embedding exchange: per-rank send buffer
        per_rank = int(m["emb_bytes_sent_per_step"] * m["gpus"] / (m["gpus"] - 1))
        mb = os.path.join(a.out, "nccl_a2a.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(m["gpus"]),
            "benchmarks/nccl_a2a.py",
            "--bytes",
            str(per_rank),
            "--out",
            mb,
        ]
        run(cmd, env)
        commands.append(" ".join(cmd[1:]))
        micro = json.load(open(mb))["rows"][0]
        m["nccl_microbench"] = micro
        head.update(
            {
                f"qps_{m['gpus']}gpu": m["qps"],
                "scaling_efficiency": m["qps_per_gpu"] / rows[0]["qps_per_gpu"],
                "emb_a2a_gb_per_s": m.get("emb_a2a_gb_per_s", float("nan")),
                "nccl_a2a_gb_per_s": micro["gb_per_s"],
                "emb_a2a_vs_nccl_bw": m.get("emb_a2a_gb_per_s", float("nan")) / micro["gb_per_s"],
                "straggler_share_median": m["straggler_share_median"],
            }
        )
    out = {
        "figure": "baseline_gpu",
        "device": f"{ngpu}x {torch.cuda.get_device_name(0)}",
        "git_sha": sha,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": commands,
        "torch": torch.__version__,
        "workload": {
            "max_uih": a.max_uih,
            "median_uih": a.median_uih,
            "per_rank": a.per_rank,
            "steps": a.steps,
            "length_dist": "lognormal",
        },
        "rows": rows,
        "headline": head,
    }
    path = os.path.join(a.out, "baseline_gpu.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=float)
    print(json.dumps(head, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
