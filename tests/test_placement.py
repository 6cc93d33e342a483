"""Thread placement (pipeline/placement.py): the sysfs topology reader, the per-rank
plan (disjoint shares, the launch threads alone on their physical cores, every CPU of
a share used, fewer cores degrade as documented) and applying it to live threads."""

from __future__ import annotations

import os
import threading

import pytest

from freescale.pipeline.placement import (
    _parse_cpu_list,
    apply_placement,
    cpu_topology,
    gpu_local_cpus,
    plan_placement,
    topology_summary,
)


def test_parse_cpu_list():
    assert _parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert _parse_cpu_list("5") == [5]


def _fake_sysfs(root, siblings: dict[int, str]) -> None:
    for cpu, text in siblings.items():
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")


def test_cpu_topology_groups_smt_siblings(tmp_path):
    # 4 logical CPUs, 2 cores: (0, 2) and (1, 3); CPU 5 has no topology entry
    _fake_sysfs(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"})
    cores = cpu_topology([0, 1, 2, 3, 5], root=str(tmp_path))
    assert cores == [(0, 2), (1, 3), (5,)]
    assert topology_summary(cores) == {"logical_cpus": 5, "physical_cores": 3, "smt": 2}
    # a sibling outside the allowed CPUs is dropped
    assert cpu_topology([0, 1], root=str(tmp_path)) == [(0,), (1,)]


def _smt_host(cores: int, smt: int = 2) -> list[tuple[int, ...]]:
    return [tuple(c + k * cores for k in range(smt)) for c in range(cores)]


@pytest.mark.parametrize("local_world", [1, 2, 3, 4])
def test_plan_shares_are_disjoint_and_launch_threads_run_alone(local_world):
    host = _smt_host(16)  # 16 cores x 2 SMT, like a 32-CPU GPU host
    core_of = {c: core for core in host for c in core}
    used_by_rank = []
    for r in range(local_world):
        p = plan_placement(host, r, local_world)
        assert p.available and not p.notes
        cpus = {c for v in p.cpus.values() for c in v}
        used_by_rank.append(cpus)
        share = {c for core in {core_of[c] for c in cpus} for c in core}
        solo = {c for k in ("training", "autograd") for c in p.cpus[k]}
        idle = {c for cpu in solo for c in core_of[cpu]} - solo
        assert cpus == share - idle  # all of the share but the launch cores' siblings
        for solo in ("training", "autograd"):
            (cpu,) = p.cpus[solo]
            core = set(core_of[cpu])
            others = {c for k, v in p.cpus.items() if k != solo for c in v}
            assert not core & others, (solo, p.cpus)  # its SMT sibling stays idle
        assert p.cpus["data_stage"] != p.cpus["loader"]
        assert not set(p.cpus["data_stage"]) & set(p.cpus["rest"])
    for a in range(local_world):
        for b in range(a + 1, local_world):
            assert not used_by_rank[a] & used_by_rank[b]


def test_plan_with_few_cores_degrades_and_says_so():
    assert not plan_placement([(0,)], 0, 1).available
    p = plan_placement([(0,), (1,), (2,), (3,)], 1, 2)  # 2 cores for this rank
    assert p.cpus["training"] == (2,) and p.cpus["rest"] == (3,) and p.notes
    p = plan_placement([(0,), (1,), (2,)], 0, 1)
    assert p.cpus["data_stage"] == p.cpus["loader"] == (2,) and p.notes
    p = plan_placement([(0,), (1,), (2,), (3,)], 0, 1)  # 4 cores, no SMT
    assert p.cpus["rest"] == (2, 3) and p.notes
    # 5 cores for 2 ranks: the first takes 3, the second 2
    assert plan_placement([(c,) for c in range(5)], 0, 2).cpus["training"] == (0,)
    assert plan_placement([(c,) for c in range(5)], 1, 2).cpus["training"] == (3,)
    with pytest.raises(ValueError, match="local_rank"):
        plan_placement([(0,), (1,)], 2, 2)


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="applying a placement needs Linux's sched_setaffinity and at least 2 usable CPUs",
)
def test_apply_placement_pins_live_threads_by_role():
    cpus = sorted(os.sched_getaffinity(0))
    plan = plan_placement([(cpus[0],), (cpus[1],)], 0, 1)
    before = os.sched_getaffinity(0)
    ready, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def worker():
        tid.append(threading.get_native_id())
        ready.set()
        stop.wait(10)

    th = threading.Thread(target=worker, name="freescale-data-stage-test")
    th.start()
    ready.wait(10)
    try:
        counts = apply_placement(plan)
        assert counts["training"] == 1 and counts["data_stage"] == 1 and counts["failed"] == 0
        assert os.sched_getaffinity(0) == {cpus[0]}
        assert os.sched_getaffinity(tid[0]) == {cpus[1]}
    finally:
        stop.set()
        th.join()
        os.sched_setaffinity(0, before)
    assert os.sched_getaffinity(0) == before


def test_plan_keeps_each_rank_near_its_gpu_on_a_two_node_host():
    """Two NUMA nodes of 8 cores x 2 SMT, four local ranks, GPUs 0 and 2 on node 0, 1 and
    3 on node 1 (interleaved, so a plain contiguous split would be wrong): each rank's
    CPUs are all on its GPU's node, the two ranks of a node split it, and the plan says
    so; the same ``near`` for every rank (or an unknown one)
    gives the whole-host split."""
    host = _smt_host(16)  # cores c = (c, c + 16)
    node0 = {c for core in host[:8] for c in core}
    node1 = {c for core in host[8:] for c in core}
    near = [node0, node1, node0, node1]
    used = []
    for r in range(4):
        p = plan_placement(host, r, 4, near=near)
        cpus = {c for v in p.cpus.values() for c in v}
        assert cpus <= near[r], (r, sorted(cpus))
        assert any("NUMA" in n for n in p.notes)
        used.append(cpus)
    assert not used[0] & used[2] and not used[1] & used[3]
    plain = plan_placement(host, 2, 4)
    assert plan_placement(host, 2, 4, near=[node0 | node1] * 4).cpus == plain.cpus
    assert plan_placement(host, 2, 4, near=[node0, None, node0, node1]).cpus == plain.cpus
    with pytest.raises(ValueError, match="near"):
        plan_placement(host, 0, 4, near=[node0])


def test_gpu_local_cpus_is_none_without_a_gpu(tmp_path):
    """No CUDA device (or no sysfs entry): unknown, never an error."""
    assert gpu_local_cpus(0, root=str(tmp_path)) is None


def test_gpu_local_cpus_reads_the_devices_pci_entry(tmp_path, monkeypatch):
    """The CPUs near a GPU come from ``<pci root>/<domain:bus:device.0>/local_cpulist``
    of the device's PCI ids (hex, zero-padded as sysfs names them)."""
    import types

    import torch

    props = types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    d = tmp_path / "0000:1b:00.0"
    d.mkdir()
    (d / "local_cpulist").write_text("0-3,8\n")
    assert gpu_local_cpus(0, root=str(tmp_path)) == {0, 1, 2, 3, 8}
    props.pci_bus_id = 0x2A  # no such entry: unknown
    assert gpu_local_cpus(0, root=str(tmp_path)) is None
