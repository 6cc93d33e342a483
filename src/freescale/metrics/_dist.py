"""Small helpers the metrics use to combine per-rank state through a Communicator.

Owns: choosing the device a backend can carry (gloo: host, NCCL: CUDA) and gathering
1-D tensors of different lengths from every rank. It moves metric state only; it never
touches model state and issues no collective the caller did not ask for.
"""

from __future__ import annotations

import torch

from freescale.comm.base import Communicator

__all__ = ["comm_device", "all_reduce_sum", "all_gather_varlen"]


def comm_device(comm: Communicator, like: torch.Tensor) -> torch.device:
    """The device ``comm`` carries tensors on: its ``device`` attribute where it has
    one, else the host for gloo / host-staged, the current CUDA device for NCCL, else
    ``like``'s device."""
    device = getattr(comm, "device", None)
    if isinstance(device, torch.device):
        return device
    backend = str(getattr(comm, "backend_name", "")).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or "host" in backend:
        return torch.device("cpu")
    return like.device


def all_reduce_sum(comm: Communicator, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Sum of ``tensor`` over every rank of ``comm``, on ``tensor``'s device (an
    all-reduce; an all-gather and a local sum on backends without reductions). The
    input is not modified."""
    dev = comm_device(comm, tensor)
    buf = tensor.detach().to(dev, copy=True)
    try:
        out = comm.all_reduce(buf, name=name).wait()
    except NotImplementedError:  # backends without reductions (host-staged): gather, sum
        parts = comm.all_gather(buf, name=name).wait()
        out = torch.stack(list(parts)).sum(0)
    return out.to(tensor.device)


def all_gather_varlen(comm: Communicator, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
    """Every rank's 1-D ``tensor`` (lengths may differ; dtype must match), by rank, on
    ``tensor``'s device. Two collectives: the lengths, then the values padded to the
    longest."""
    if comm.world_size == 1:
        return [tensor]
    dev = comm_device(comm, tensor)
    local = tensor.detach().reshape(-1).to(dev)
    n = torch.tensor([local.numel()], dtype=torch.int64, device=dev)
    lengths = [int(x.item()) for x in comm.all_gather(n, name=f"{name}.lengths").wait()]
    longest = max(lengths)
    padded = local.new_zeros(longest)
    padded[: local.numel()] = local
    parts = comm.all_gather(padded, name=name).wait()
    return [p[:k].to(tensor.device) for p, k in zip(parts, lengths)]
