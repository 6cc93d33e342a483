"""Session-wide pools of real gloo ranks (2 and 4 processes), shared by all tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)

from freescale.testing import DistPool  # noqa: E402

_POOLS: dict[int, DistPool] = {}


def get_pool(world_size: int) -> DistPool:
    if world_size not in _POOLS:
        _POOLS[world_size] = DistPool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def pool2() -> DistPool:
    return get_pool(2)


@pytest.fixture(scope="session")
def pool4() -> DistPool:
    return get_pool(4)


@pytest.fixture(scope="session")
def pool1() -> DistPool:
    return get_pool(1)


def pytest_sessionfinish(session, exitstatus):  # noqa: ARG001
    for p in _POOLS.values():
        p.close()
