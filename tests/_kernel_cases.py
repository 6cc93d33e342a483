"""Random jagged inputs and a pure-Python oracle for tests/test_kernels.py.

Owns: input generation (empty segments, ids at block borders and beyond the table,
rows not divisible by W, int32/int64) and `oracle_dispatch`, a loop-by-loop transcription
of fbgemm's CPU block-bucketize algorithm (count, prefix sum, scatter) that shares no
code with the kernels it checks.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Optional

import torch

SEED_ENV_VAR = "FREESCALE_TEST_SEED"


def fresh_seed() -> int:
    """A new seed per test run (or $FREESCALE_TEST_SEED to replay a failure)."""
    return int(os.environ.get(SEED_ENV_VAR, secrets.randbits(31)))


@dataclass
class DispatchCase:
    values: torch.Tensor
    lengths: torch.Tensor
    block_sizes: torch.Tensor
    world_size: int
    weights: Optional[torch.Tensor]

    def describe(self) -> str:
        return (
            f"W={self.world_size} K={self.block_sizes.numel()} lengths={self.lengths.tolist()} "
            f"block_sizes={self.block_sizes.tolist()} dtypes={self.values.dtype}/"
            f"{self.lengths.dtype}"
        )


def _randint(gen: torch.Generator, low: int, high: int) -> int:
    return int(torch.randint(low, high, (), generator=gen))


def random_lengths(
    gen: torch.Generator, num_segments: int, max_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """Jagged lengths with ~30% empty segments and occasional full-length ones."""
    lengths = torch.randint(0, max_len + 1, (num_segments,), generator=gen)
    lengths[torch.rand(num_segments, generator=gen) < 0.3] = 0
    lengths[torch.rand(num_segments, generator=gen) < 0.1] = max_len
    return lengths.to(dtype)


def random_ids(
    gen: torch.Generator, n: int, block: int, world_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Ids mixing uniform rows, block borders and ids beyond blk*W (fbgemm's fallback)."""
    table = block * world_size
    uniform = torch.randint(0, table, (n,), generator=gen)
    borders = torch.tensor(
        [0, block - 1, block, table - block, table - 1, table, table + 1, 2 * table + 3],
        dtype=torch.int64,
    ).clamp(min=0)
    pick = borders[torch.randint(0, borders.numel(), (n,), generator=gen)]
    owner_border = torch.randint(0, world_size, (n,), generator=gen) * block
    beyond = table + torch.randint(0, 5 * table + 7, (n,), generator=gen)
    choice = torch.randint(0, 10, (n,), generator=gen)
    ids = torch.where(choice < 5, uniform, pick)
    ids = torch.where(choice == 8, owner_border, ids)
    ids = torch.where(choice == 9, beyond, ids)
    return ids.to(dtype)


def random_dispatch_case(
    gen: torch.Generator,
    world_size: int,
    *,
    max_keys: int = 3,
    max_batch: int = 5,
    max_len: int = 12,
    values_dtype: torch.dtype = torch.int64,
    lengths_dtype: torch.dtype = torch.int64,
    with_weights: bool = False,
) -> DispatchCase:
    """A key-major jagged batch whose per-key tables have rows not divisible by W."""
    num_keys = _randint(gen, 1, max_keys + 1)
    batch = _randint(gen, 0, max_batch + 1)
    lengths = random_lengths(gen, num_keys * batch, max_len, lengths_dtype)
    rows = [_randint(gen, 1, 8 * world_size + 5) for _ in range(num_keys)]
    blocks = [-(-r // world_size) for r in rows]  # ceil: the last owner gets fewer rows
    parts = []
    for k in range(num_keys):
        n_k = int(lengths[k * batch : (k + 1) * batch].sum())
        parts.append(random_ids(gen, n_k, blocks[k], world_size, values_dtype))
    values = torch.cat(parts) if parts else torch.zeros(0, dtype=values_dtype)
    weights = torch.rand(values.numel(), generator=gen) if with_weights else None
    return DispatchCase(
        values=values,
        lengths=lengths,
        block_sizes=torch.tensor(blocks, dtype=values_dtype),
        world_size=world_size,
        weights=weights,
    )


def oracle_dispatch(
    values: torch.Tensor,
    lengths: torch.Tensor,
    block_sizes: torch.Tensor,
    world_size: int,
    mode: str,
) -> tuple[list[int], list[int], list[int]]:
    """fbgemm's CPU algorithm, element by element: (new values, new lengths, permute)."""
    ids, lens, blocks = values.tolist(), lengths.tolist(), block_sizes.tolist()
    num_keys = len(blocks)
    batch = len(lens) // num_keys if num_keys else 0
    nseg = len(lens)

    def owner_local(i: int, seg: int) -> tuple[int, int]:
        if mode == "modulo":
            return i % world_size, i // world_size
        blk = blocks[seg // batch]
        if i < blk * world_size:
            return i // blk, i % blk
        return i % world_size, i // world_size

    starts = [0]
    for length in lens:
        starts.append(starts[-1] + length)
    new_lengths = [0] * (world_size * nseg)
    for seg in range(nseg):
        for pos in range(starts[seg], starts[seg + 1]):
            new_lengths[owner_local(ids[pos], seg)[0] * nseg + seg] += 1
    cursor = [0]
    for length in new_lengths[:-1]:
        cursor.append(cursor[-1] + length)
    out = [0] * len(ids)
    permute = [0] * len(ids)
    for seg in range(nseg):
        for pos in range(starts[seg], starts[seg + 1]):
            owner, local = owner_local(ids[pos], seg)
            slot = cursor[owner * nseg + seg]
            out[slot] = local
            permute[pos] = slot
            cursor[owner * nseg + seg] += 1
    return out, new_lengths, permute


def assert_dispatch_equal(expected, actual, context: str) -> None:
    """Bitwise equality (values and dtypes) of two DispatchResults."""
    for name in ("values", "lengths", "splits", "key_counts", "unbucketize_permute", "weights"):
        e, a = getattr(expected, name), getattr(actual, name)
        if e is None or a is None:
            assert e is None and a is None, f"{name}: one side is None ({context})"
            continue
        assert e.dtype == a.dtype, f"{name}: dtype {a.dtype} != {e.dtype} ({context})"
        assert e.shape == a.shape, f"{name}: shape {a.shape} != {e.shape} ({context})"
        assert torch.equal(e, a), f"{name} differs ({context})\nexpected {e}\nactual   {a}"


def random_permute_case(
    gen: torch.Generator,
    *,
    lengths_dtype: torch.dtype = torch.int64,
    values_dtype: torch.dtype = torch.int64,
    max_rows: int = 6,
    max_batch: int = 5,
    max_len: int = 8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(permute with repeats/drops, lengths (T, B), values, weights)."""
    rows = _randint(gen, 1, max_rows + 1)
    batch = _randint(gen, 0, max_batch + 1)
    lengths = random_lengths(gen, rows * batch, max_len, lengths_dtype).view(rows, batch)
    n = int(lengths.sum())
    values = torch.randint(0, 1 << 30, (n,), generator=gen).to(values_dtype)
    weights = torch.rand(n, generator=gen)
    permute = torch.randint(0, rows, (_randint(gen, 0, 2 * rows + 1),), generator=gen)
    return permute.to(torch.int32), lengths, values, weights
