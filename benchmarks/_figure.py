"""Common header of a figure file: ``benchmarks/results/<figure>.json`` says what produced
it (figure, device, git sha, date, exact command, torch version)."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch

from freescale.pipeline.bench_e2e import run_environment


def git_sha(given: Optional[str] = None) -> Optional[str]:
    """The commit a figure measures: ``given`` (a script's ``--git-sha``), else
    ``FREESCALE_GIT_SHA`` (a copied tree's .git may be stale), else this checkout's HEAD,
    else None."""
    if given:
        return given
    if os.environ.get("FREESCALE_GIT_SHA"):
        return os.environ["FREESCALE_GIT_SHA"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_name() -> str:
    """This host's CPU model (``/proc/cpuinfo``), else what ``platform`` knows."""
    name = platform.processor() or platform.machine() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name


def device_name(dev: torch.device, world: int) -> str:
    """The device of a multi-rank figure: ``"2x NVIDIA H200"`` or ``"2 gloo ranks on
    2-core <cpu>"``."""
    if dev.type == "cuda":
        return f"{world}x {torch.cuda.get_device_name(dev)}"
    return f"{world} gloo ranks on {os.cpu_count()}-core {cpu_name()}"


def figure_header(figure: str, git_sha: Optional[str]) -> dict[str, Any]:
    """The keys every figure file starts with; rows and headline are the caller's."""
    return {
        "figure": figure,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "git_sha": git_sha,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "environment": run_environment(),
        "torch": torch.__version__,
    }


def host_figure_header(figure: str, git_sha: Optional[str]) -> dict[str, Any]:
    """:func:`figure_header` for a host-only figure: the device is this machine's CPU."""
    head = figure_header(figure, git_sha)
    head["device"] = f"CPU ({cpu_name()}, {os.cpu_count()} cores)"
    return head


def write_figure(out_dir: Optional[str], report: dict[str, Any]) -> Optional[str]:
    """Write ``<out_dir>/<figure>.json`` (when ``out_dir`` is given), say so, return the path."""
    if not out_dir:
        return None
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{report['figure']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {path}")
    return path


def spawn_ranks(target: Callable[..., None], world: int, *args: Any, timeout: float = 900) -> Any:
    """Run ``target(rank, world, port, queue, *args)`` on ``world`` spawned processes
    (gloo rendezvous on a free local ``port``); return the first object a rank puts on
    ``queue`` (rank 0's result, by convention) after every process ended cleanly."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    result = q.get(timeout=timeout)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"rank process exited with {p.exitcode} ({target.__name__}{args})")
    return result


def kernel_device_ms(fn: Callable[[], Any], calls: int = 5) -> dict[str, float]:
    """Device ms per call of ``fn`` per CUDA kernel name (torch.profiler; one warm-up call
    first), largest first."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            out[ev.name[:60]] += ev.device_time_total / 1e3 / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
