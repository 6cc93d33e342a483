"""Checks shared by the communicator tests (every backend, any world size)."""

from __future__ import annotations

import pytest
import torch


def check_bad_splits(comm, rank: int, world: int) -> None:
    """Splits that are wrong on this rank alone are a ``ValueError`` naming the
    collective and the rank, raised before anything is sent (so no peer is left
    waiting): a wrong count of entries, a negative entry, input splits that do not sum
    to the tensor's rows, and a rank that expects from itself other than it sends."""
    x = torch.zeros((2 * world, 3))
    ok = [2] * world
    wrong_self = list(ok)
    wrong_self[rank] = 3
    negative = [2] * world
    negative[(rank + 1) % world] = -2
    negative[rank] = 6
    cases = [
        ([2] * (world + 1), ok, f"splits must have {world} entries"),
        (negative, ok, "negative split"),
        ([1] * world, ok, f"input splits sum to {world}"),
        (ok, wrong_self, "sends itself 2 rows but expects 3"),
    ]
    for i_s, o_s, what in cases:
        with pytest.raises(ValueError, match=what) as ei:
            comm.all_to_all_v(x, i_s, o_s, name="bad_splits")
        msg = str(ei.value)
        assert "all_to_all 'bad_splits'" in msg and f"rank {rank} of {world}" in msg, msg
    comm.barrier()  # every rank got here: nothing was sent, nobody waits
