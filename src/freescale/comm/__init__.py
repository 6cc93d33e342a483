"""Collective backends behind one asynchronous interface (see :mod:`freescale.comm.base`)."""

from freescale.comm.base import Awaitable, CollectiveError, CommStats, Communicator, Done
from freescale.comm.copy_engine import (
    TRAFFIC_CLASSES,
    CopyEngineCommunicator,
    CopyEngineConfig,
    SegmentsAwaitable,
    SMFreeConfig,
    create_communicator,
    detect_topology,
    select_backend,
)
from freescale.comm.host_staged import HostStagedCommunicator, HostStagedConfig, PinnedBufferPool

__all__ = [
    "Awaitable",
    "CollectiveError",
    "CommStats",
    "Communicator",
    "CopyEngineCommunicator",
    "CopyEngineConfig",
    "Done",
    "HostStagedCommunicator",
    "HostStagedConfig",
    "PinnedBufferPool",
    "SMFreeConfig",
    "SegmentsAwaitable",
    "TRAFFIC_CLASSES",
    "create_communicator",
    "detect_topology",
    "select_backend",
]
