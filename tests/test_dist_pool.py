"""The shared rank pools (``freescale.testing.DistPool``) clean up after each task."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from freescale.testing import _groups


def _make_groups(rank: int, world: int, n: int) -> tuple[int, int]:
    """Make ``n`` groups over all ranks and one over ranks {0, 1}; use each once."""
    groups = [dist.new_group() for _ in range(n)]
    pair = dist.new_group(ranks=[0, 1])
    for g in groups:
        dist.all_reduce(torch.ones(1), group=g)
    if rank < 2:
        dist.all_reduce(torch.ones(1), group=pair)
    return _census(rank, world)


def _census(rank: int, world: int) -> tuple[int, int]:
    """(process groups this rank knows, its threads)."""
    return len(_groups() or ()), len(os.listdir("/proc/self/task"))


def test_groups_a_task_made_are_destroyed(pool4):
    """Each gloo group owns a transport thread that wakes every 10 ms; a pool that kept
    the groups of every task (a trainer makes three) spent the CI machine's cores in the
    kernel. After a task, only the default group is left, and the threads do not grow
    from task to task (the first task may start a lasting thread or two of torch's)."""
    during = pool4.run(_make_groups, 4)
    assert [g for g, _ in during] == [6, 6, 5, 5], during  # ranks 2, 3 are not in `pair`
    first = pool4.run(_census)
    assert [g for g, _ in first] == [1, 1, 1, 1], first  # the default group only
    # each gloo group has its own loop thread: 4 or 5 groups more, >= 4 threads more
    assert all(t >= f + 4 for (_, t), (_, f) in zip(during, first)), (during, first)
    for _ in range(2):  # no growth over tasks
        pool4.run(_make_groups, 4)
        assert pool4.run(_census) == first
