"""Process-group set-up for one FreeScale rank.

Owns: choosing the backend and device (NCCL and one GPU per rank where CUDA is
present, gloo on CPU), initialising ``torch.distributed`` from the environment that
torchrun / torch's elastic launcher sets, the collective timeout, and the start-up
config-hash check that refuses to train when ranks disagree on the configuration.
It launches nothing itself: processes come from torchrun or ``torch.distributed``'s
own launcher (see cli.py).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import config_hash

__all__ = ["RankContext", "init_distributed", "check_config_hash", "ConfigMismatchError"]


class ConfigMismatchError(RuntimeError):
    """Ranks were started with different configurations."""


@dataclass
class RankContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    owns_group: bool  # we initialised the default group (and must destroy it)


def init_distributed(
    device: str = "auto", timeout_s: float = 300.0, backend: str | None = None
) -> RankContext:
    """Initialise the default process group from the environment (RANK, WORLD_SIZE,
    MASTER_ADDR, ...) unless it already is; single process when no environment is set."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was requested but CUDA is not available")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    owns = False
    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        be = backend or ("nccl" if use_cuda else "gloo")
        kwargs = {}
        if use_cuda:
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(backend=be, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        owns = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        be = str(dist.get_backend())
        if be == "nccl":
            use_cuda = True
    else:
        rank, world, be = 0, 1, "single"
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    return RankContext(rank, world, local_rank, dev, be, owns)


def check_config_hash(cfg: object, ctx: RankContext) -> str:
    """All ranks must hold the same config; raise naming the ranks that differ."""
    h = config_hash(cfg)
    if ctx.world_size == 1:
        return h
    mine = torch.tensor([int(h, 16) & ((1 << 62) - 1)], dtype=torch.int64, device=ctx.device)
    allh = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(allh, mine)
    vals = [int(t.item()) for t in allh]
    if len(set(vals)) != 1:
        groups: dict[int, list[int]] = {}
        for r, v in enumerate(vals):
            groups.setdefault(v, []).append(r)
        desc = "; ".join(f"ranks {rs} hash {v:x}" for v, rs in groups.items())
        raise ConfigMismatchError(
            f"rank {ctx.rank}: ranks were started with different configurations ({desc}); "
            "every rank must use identical flags and config files"
        )
    return h
