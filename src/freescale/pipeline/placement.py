"""Thread placement: which cores a rank's host threads run on (``TrainConfig.pin_threads``).

Owns one question about a GPU step that the host bounds: do the threads that launch
work get a core of their own? A rank's process has a training thread (launches the
forward and the optimizer), torch's autograd device thread (launches the backward), the
data-stage and loader threads (FreeScale's balancing and id counts of steps ahead), and
many native threads (OpenMP teams, NCCL's proxy, gloo's I/O loops, the copy engine's
workers). Left to the scheduler, two busy threads can share one physical core (two
SMT siblings, or one core by time slicing) while another core idles — and the step
then moves with where the threads happened to land. On 2 H200 at e756e56 FreeScale's
QPS moved between ~4,400 and ~6,100 across runs of the same code, with every thread's
CPU per step higher in the slow runs (benchmarks/results/bisect_freescale_qps_e756e56.log);
this module is the A/B for that hypothesis, off by default.

:func:`cpu_topology` reads the physical cores (SMT sibling groups) of the CPUs this
process may use from ``/sys/devices/system/cpu``; :func:`gpu_local_cpus` the CPUs on
each GPU's NUMA node (its PCI device's ``local_cpulist``). :func:`plan_placement` keeps
a rank on its GPU's node when the nodes differ (a slow run could be threads on the far
socket: every thread then needs more CPU for the same work, as observed), splits the
cores into contiguous per-local-rank shares and gives, within a share, one physical core each
to the training thread and the autograd thread (the core's SMT siblings stay idle: the
two launch threads run alone), one logical CPU each to the data-stage thread and the
loader, and everything left (including those two cores' siblings) to the other threads.
With too few cores it gives less (the plan says what it dropped, never fails).
:func:`apply_placement` sets each thread's affinity (``os.sched_setaffinity`` on its
native thread id) by role; threads created later inherit their creator's, so the
Trainer applies it after the warm-up steps too, when the OpenMP teams exist. Linux
only; elsewhere (or without ``sched_setaffinity``) the plan says ``available: False``.
Placement changes no numerics.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Placement",
    "gpu_local_cpus",
    "cpu_topology",
    "plan_placement",
    "apply_placement",
    "placement_role",
    "restore_affinities",
    "thread_affinities",
    "topology_summary",
]

_SYS_CPU = "/sys/devices/system/cpu"
ROLES = ("training", "autograd", "data_stage", "loader", "rest")


def _parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def _allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_topology(cpus: list[int] | None = None, root: str = _SYS_CPU) -> list[tuple[int, ...]]:
    """Physical cores of ``cpus`` (default: the CPUs this process may use) as tuples of
    logical CPUs (SMT siblings), ordered by their first CPU. A CPU whose sibling list
    cannot be read is its own core."""
    cpus = _allowed_cpus() if cpus is None else sorted(cpus)
    allowed = set(cpus)
    cores: dict[tuple[int, ...], None] = {}
    for c in cpus:
        try:
            with open(f"{root}/cpu{c}/topology/thread_siblings_list") as fh:
                sib = tuple(s for s in _parse_cpu_list(fh.read()) if s in allowed)
        except (OSError, ValueError):
            sib = (c,)
        cores[sib or (c,)] = None
    return sorted(cores, key=lambda t: t[0])


def topology_summary(cores: list[tuple[int, ...]] | None = None) -> dict[str, Any]:
    """Logical CPUs, physical cores and SMT width of this process's CPUs (for reports)."""
    cores = cpu_topology() if cores is None else cores
    n = sum(len(c) for c in cores)
    return {
        "logical_cpus": n,
        "physical_cores": len(cores),
        "smt": max((len(c) for c in cores), default=1),
    }


@dataclass
class Placement:
    """Logical CPUs per thread role for one rank. ``available``: pinning can be applied
    here; ``notes``: what the plan had to drop (too few cores)."""

    cpus: dict[str, tuple[int, ...]] = field(default_factory=dict)
    available: bool = True
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "cpus": {k: list(v) for k, v in self.cpus.items()},
            "notes": list(self.notes),
        }


def gpu_local_cpus(index: int, root: str = "/sys/bus/pci/devices") -> set[int] | None:
    """The CPUs on the NUMA node of CUDA device ``index`` (its PCI device's
    ``local_cpulist`` in sysfs), or None when unknown (no CUDA, no sysfs entry, or
    properties without PCI ids)."""
    try:
        import torch

        props = torch.cuda.get_device_properties(index)
        dom = int(props.pci_domain_id)
        bus = int(props.pci_bus_id)
        dev = int(props.pci_device_id)
        with open(f"{root}/{dom:04x}:{bus:02x}:{dev:02x}.0/local_cpulist") as fh:
            cpus = set(_parse_cpu_list(fh.read()))
    except Exception:  # noqa: BLE001 - any failure: unknown
        return None
    return cpus or None


def plan_placement(
    cores: list[tuple[int, ...]],
    local_rank: int = 0,
    local_world: int = 1,
    near: list[set[int] | None] | None = None,
) -> Placement:
    """The CPUs of each role for ``local_rank`` of ``local_world`` ranks on this host.

    ``near``: per local rank, the CPUs near its GPU (:func:`gpu_local_cpus`). When they
    differ between ranks (a multi-socket host), a rank places its threads on the cores
    near its GPU only, shared with the ranks whose GPUs sit on the same node; otherwise
    (unknown, or the same for all) on the whole host. Rank ``i`` of the ``n`` ranks
    sharing a set of cores takes its ``i``-th contiguous share (the first ranks take one
    more when they do not divide). Within its share of ``k`` cores:
    ``k >= 4``: training and autograd a whole core each (first logical CPU), data stage
    and loader the first logical CPU of a core each, the rest everything else;
    ``k == 3``: data stage and loader share a core; ``k == 2``: training alone on one
    core, everything else on the other; ``k <= 1``: nothing pinned."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local_rank {local_rank} not in [0, {local_world})")
    if near is not None and len(near) != local_world:
        raise ValueError(f"near has {len(near)} entries for {local_world} local ranks")
    numa_note: list[str] = []
    group, index = local_world, local_rank
    if near is not None and None not in near and len({frozenset(c) for c in near}) > 1:
        mine = near[local_rank]
        assert mine is not None
        local_cores = [c for c in cores if set(c) & mine]
        if local_cores:
            cores = local_cores
            peers = [r for r in range(local_world) if near[r] == mine]
            group, index = len(peers), peers.index(local_rank)
            numa_note = [f"NUMA: the {len(cores)} cores near this rank's GPU, {group} ranks"]
    n = len(cores)
    base, extra = divmod(n, group)
    start = index * base + min(index, extra)
    share = cores[start : start + base + (1 if index < extra else 0)]
    k = len(share)
    if k <= 1:
        return Placement(
            available=False,
            notes=[f"{n} physical cores for {group} local ranks: {k} for this rank", *numa_note],
        )
    flat = lambda cs: tuple(c for core in cs for c in core)  # noqa: E731
    p = Placement(notes=list(numa_note))
    if k == 2:
        p.cpus = {
            "training": share[0][:1],
            "autograd": share[1],
            "data_stage": share[1],
            "loader": share[1],
            "rest": share[1],
        }
        p.notes.append("2 cores: autograd, data stage, loader and the rest share one")
        return p
    p.cpus["training"] = share[0][:1]
    p.cpus["autograd"] = share[1][:1]
    if k == 3:
        p.cpus["data_stage"] = p.cpus["loader"] = share[2][:1]
        p.cpus["rest"] = share[2]
        p.notes.append("3 cores: data stage and loader share one with the rest")
        return p
    p.cpus["data_stage"] = share[2][:1]
    p.cpus["loader"] = share[3][:1]
    rest = share[2][1:] + share[3][1:] + flat(share[4:])
    if not rest:  # k == 4 without SMT: the two data threads' cores
        rest = share[2] + share[3]
        p.notes.append("4 cores, no SMT: the rest shares the data threads' cores")
    p.cpus["rest"] = tuple(sorted(rest))
    return p


def placement_role(kernel_name: str, python_name: str, is_caller: bool) -> str:
    """A thread's role for placement (see ``metrics.host_cpu.thread_group``)."""
    if is_caller:
        return "training"
    if kernel_name.startswith("pt_autograd"):
        return "autograd"
    if python_name.startswith("freescale-data-stage"):
        return "data_stage"
    if python_name.startswith("freescale-loader"):
        return "loader"
    return "rest"


def _task_ids() -> list[int]:
    """Native ids of this process's threads (Linux ``/proc``; empty elsewhere)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def thread_affinities() -> dict[int, set[int]]:
    """Every thread's CPU affinity now (native id -> CPUs); empty where unsupported."""
    out: dict[int, set[int]] = {}
    if not hasattr(os, "sched_getaffinity"):
        return out
    for tid in _task_ids():
        try:
            out[tid] = os.sched_getaffinity(tid)
        except OSError:  # exited meanwhile
            pass
    return out


def restore_affinities(before: dict[int, set[int]]) -> None:
    """Undo a placement: threads that existed at ``before`` (:func:`thread_affinities`)
    get their affinity back, threads created since get the caller's from then."""
    if not hasattr(os, "sched_setaffinity"):
        return
    default = before.get(threading.get_native_id())
    for tid in _task_ids():
        cpus = before.get(tid, default)
        if cpus:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError:
                pass


def apply_placement(placement: Placement, caller_tid: int | None = None) -> dict[str, int]:
    """Set every thread's affinity by role; returns threads pinned per role (and
    ``failed``: threads that refused, e.g. exited meanwhile). ``caller_tid``: the
    training thread (default: the calling thread)."""
    counts = {r: 0 for r in ROLES}
    counts["failed"] = 0
    if not placement.available or not hasattr(os, "sched_setaffinity"):
        return counts
    caller = threading.get_native_id() if caller_tid is None else caller_tid
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    for tid in _task_ids():
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                kname = fh.read().strip()
        except OSError:
            continue
        role = placement_role(kname, names.get(tid, ""), tid == caller)
        cpus = placement.cpus.get(role)
        if not cpus:
            continue
        try:
            os.sched_setaffinity(tid, cpus)
            counts[role] += 1
        except OSError:
            counts["failed"] += 1
    return counts
