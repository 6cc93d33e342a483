"""Collective backends behind one asynchronous interface (see :mod:`freescale.comm.base`)."""

from freescale.comm.base import Awaitable, CollectiveError, CommStats, Communicator, Done
from freescale.comm.host_staged import HostStagedCommunicator, HostStagedConfig, PinnedBufferPool

__all__ = [
    "Awaitable",
    "CollectiveError",
    "CommStats",
    "Communicator",
    "Done",
    "HostStagedCommunicator",
    "HostStagedConfig",
    "PinnedBufferPool",
]
