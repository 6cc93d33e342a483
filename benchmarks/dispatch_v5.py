"""Figure "dispatch_v5": the Gluon shared-memory dispatch (v5) against v4 on one GPU.

Issue 3's last open target is `dispatch_fraction_of_hbm_floor` >= 0.5 at 2^26 ids and
W=1024 (v4: 0.14). v4's docstring and BENCHMARKS.md trace the gap to state that belongs
in shared memory. `kernels/triton_dispatch_v5.py` keeps it there (Gluon buffers, PTX
accesses). This script:

1. checks v5 bit for bit against `reference.ranged_dispatch` on fresh random inputs
   (W = 1 .. 4096, int32 and int64, block and modulo, empty segments, ids at range
   borders, segments crossing tiles, several tiles and warp counts, both scatters); any
   mismatch ends the run with exit 1 before timing;
2. times v4 (defaults) and v5 (its defaults for this card, `default_config_v5`; on a
   card with its own table also the H200 table's choice, row "v5_h200_table"; and a few
   tile x warps configs) on `kernels.py`'s large workload (2^26 ids, 4 keys, 8192 samples) and v4 /
   v5 defaults on its per-rank one (128 samples, ~1M ids) at W = 8 .. 1024 (CUDA events,
   `triton.testing.do_bench` median), each call first checked equal to v4's output;
3. splits one call of each into kernels (torch.profiler), at W = 8, 32, 128 and 1024.

``--workloads hot`` (session 50) times the large workload's ids mapped to a power law
(`hot_ids`: id' = rows x (id / rows)^8, so the first shard's rows hold W^(-1/8) of the
ids, 42% at W = 1024): tiles where one dest takes thousands of ids, the atomic scatter's
worst case without its LONG path. Its rows never enter the headline.

The floor is `kernels.py`'s: bytes that must be read and written / measured copy
bandwidth. Usage (one H200, ~2-3 min):

    PYTHONPATH=src python benchmarks/dispatch_v5.py --out DIR --git-sha SHA

Writes DIR/dispatch_v5.json (figure, device, git sha, date, command, rows, headline:
per W the default's fraction of the floor and the best config timed; at W = 1024
`v5_fraction_of_hbm_floor_w1024`, `v4_fraction_of_hbm_floor_w1024`, the best v5 config),
also after every W with a field "partial" (where the rows stop), so that a run cut short
still leaves its rows in the file; the finished file has no "partial".
``--rehead FILE`` recomputes the headline of an existing file from its rows.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from freescale.kernels import reference
from freescale.kernels.triton_dispatch_v4 import ranged_dispatch_v4

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import figure_header, kernel_device_ms, write_figure  # noqa: E402
from kernels import (  # noqa: E402
    ROWS_PER_TABLE,
    block_sizes_for,
    copy_bandwidth,
    make_workload,
    time_fast,
)

FIELDS = ("values", "lengths", "splits", "key_counts", "unbucketize_permute")
WORLDS = [8, 32, 128, 512, 1024]
PROFILE_WORLDS = (8, 32, 128, 1024)  # one call split into kernels (torch.profiler)
CONFIGS = {  # name -> V5Config fields (c: count warps, s: scatter warps, u: unroll)
    "v5_t2048_w4_u4": {"tile": 2048, "count_warps": 4, "scatter_warps": 4, "unroll": 4},
    "v5_t4096_w8_u4": {"tile": 4096, "count_warps": 8, "scatter_warps": 8, "unroll": 4},
    "v5_t8192_c8_s16_u8": {"tile": 8192, "count_warps": 8, "scatter_warps": 16, "unroll": 8},
    # scatter="ranks": the in-order loop only ranks, placement after it (session 27)
    "ranks_t2048_w4_u4": {"tile": 2048, "count_warps": 4, "scatter_warps": 4, "unroll": 4,
                          "scatter": "ranks"},
    "ranks_t4096_w8_u4": {"tile": 4096, "count_warps": 8, "scatter_warps": 8, "unroll": 4,
                          "scatter": "ranks"},
    "ranks_t4096_c8_s16_u4": {"tile": 4096, "count_warps": 8, "scatter_warps": 16, "unroll": 4,
                              "scatter": "ranks"},
    "ranks_t8192_c8_s16_u8": {"tile": 8192, "count_warps": 8, "scatter_warps": 16, "unroll": 8,
                              "scatter": "ranks"},
    # more resident warps per SM (session 27: 16-warp programs were 1.3x faster at W=512)
    "v5_t2048_c4_s8_u4": {"tile": 2048, "count_warps": 4, "scatter_warps": 8, "unroll": 4},
    "ranks_t2048_c4_s8_u4": {"tile": 2048, "count_warps": 4, "scatter_warps": 8, "unroll": 4,
                             "scatter": "ranks"},
    "v5_t4096_c8_s16_u4": {"tile": 4096, "count_warps": 8, "scatter_warps": 16, "unroll": 4},
    "ranks_t4096_c8_s16_u2": {"tile": 4096, "count_warps": 8, "scatter_warps": 16, "unroll": 2,
                              "scatter": "ranks"},
    "ranks_t2048_c8_s16_u4": {"tile": 2048, "count_warps": 8, "scatter_warps": 16, "unroll": 4,
                              "scatter": "ranks"},
    "ranks_t2048_c4_s8_u2": {"tile": 2048, "count_warps": 4, "scatter_warps": 8, "unroll": 2,
                             "scatter": "ranks"},
    "ranks_t4096_c8_s16_u1": {"tile": 4096, "count_warps": 8, "scatter_warps": 16, "unroll": 1,
                              "scatter": "ranks"},
    # session 30: smaller tiles at W = 64..256 (more programs, shorter ordered loops)
    "ranks_t1024_c4_s8_u4": {"tile": 1024, "count_warps": 4, "scatter_warps": 8, "unroll": 4,
                             "scatter": "ranks"},
    "ranks_t1024_c4_s4_u4": {"tile": 1024, "count_warps": 4, "scatter_warps": 4, "unroll": 4,
                             "scatter": "ranks"},
    "v5_t1024_c4_s4_u4": {"tile": 1024, "count_warps": 4, "scatter_warps": 4, "unroll": 4},
    "ranks_t2048_c4_s8_u8": {"tile": 2048, "count_warps": 4, "scatter_warps": 8, "unroll": 8,
                             "scatter": "ranks"},
    "ranks_t2048_c8_s8_u4": {"tile": 2048, "count_warps": 8, "scatter_warps": 8, "unroll": 4,
                             "scatter": "ranks"},
    # session 30: counts stored in the scan's order (no transpose), finish blocks
    "v5_t2048_w4_u4_cols": {"tile": 2048, "count_warps": 4, "scatter_warps": 4, "unroll": 4,
                            "counts": "columns"},
    "ranks_t2048_c4_s8_u4_cols": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                  "unroll": 4, "scatter": "ranks", "counts": "columns"},
    "ranks_t4096_c8_s16_u2_cols": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                   "unroll": 2, "scatter": "ranks", "counts": "columns"},
    "ranks_t2048_c4_s8_u4_f64": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "finish_block": 64},
    "ranks_t2048_c4_s8_u4_f16": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "finish_block": 16},
    "ranks_t4096_c8_s16_u2_f64": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "finish_block": 64},
    "ranks_t4096_c16_s16_u2": {"tile": 4096, "count_warps": 16, "scatter_warps": 16,
                               "unroll": 2, "scatter": "ranks"},
    "ranks_t4096_c4_s16_u2": {"tile": 4096, "count_warps": 4, "scatter_warps": 16, "unroll": 2,
                              "scatter": "ranks"},
    # session 32: int32 output positions per staged slot (`V5Config.slots`), on the
    # default configurations
    "v5_t2048_w4_u4_pos": {"tile": 2048, "count_warps": 4, "scatter_warps": 4, "unroll": 4,
                           "slots": "pos"},
    "v5_t2048_w4_u4_cols_pos": {"tile": 2048, "count_warps": 4, "scatter_warps": 4,
                                "unroll": 4, "counts": "columns", "slots": "pos"},
    "ranks_t2048_c4_s8_u4_pos": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "slots": "pos"},
    "ranks_t2048_c4_s8_u4_cols_pos": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                      "unroll": 4, "scatter": "ranks", "counts": "columns",
                                      "slots": "pos"},
    "v5_t2048_c4_s8_u4_pos": {"tile": 2048, "count_warps": 4, "scatter_warps": 8, "unroll": 4,
                              "slots": "pos"},
    "v5_t4096_w8_u4_pos": {"tile": 4096, "count_warps": 8, "scatter_warps": 8, "unroll": 4,
                           "slots": "pos"},
    "ranks_t4096_c8_s16_u2_pos": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "slots": "pos"},
    # session 34: each id's dest stored in shared memory by a pass in any order, so the
    # ordered ranking loop waits on no global load (`V5Config.dests`)
    "ranks_t4096_c8_s16_u2_dst": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "dests": "stored"},
    "ranks_t4096_c8_s16_u2_dst_pos": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "slots": "pos",
                                      "dests": "stored"},
    "ranks_t4096_c8_s16_u4_dst": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 4, "scatter": "ranks", "dests": "stored"},
    "ranks_t2048_c4_s8_u4_dst": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "dests": "stored"},
    "ranks_t4096_c8_s16_u8_dst": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 8, "scatter": "ranks", "dests": "stored"},
    # session 34: int32 staging, three scatter programs per SM at W = 1024
    "ranks_t4096_c8_s16_u2_v32": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "staging": "int32"},
    "ranks_t4096_c8_s16_u2_v32_pos": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "staging": "int32",
                                      "slots": "pos"},
    "ranks_t2048_c4_s8_u4_v32": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "staging": "int32"},
    # session 35: int32 staging makes 8192-id tiles fit twice per SM at W = 1024 (half the
    # per-tile W-sized work and tables per id of 4096-id tiles)
    "ranks_t8192_c8_s16_u2_v32": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "staging": "int32"},
    "ranks_t8192_c8_s16_u4_v32": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                  "unroll": 4, "scatter": "ranks", "staging": "int32"},
    "ranks_t8192_c16_s16_u2_v32": {"tile": 8192, "count_warps": 16, "scatter_warps": 16,
                                   "unroll": 2, "scatter": "ranks", "staging": "int32"},
    "ranks_t8192_c4_s16_u2_v32": {"tile": 8192, "count_warps": 4, "scatter_warps": 16,
                                  "unroll": 2, "scatter": "ranks", "staging": "int32"},
    "ranks_t8192_c8_s8_u4_v32": {"tile": 8192, "count_warps": 8, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "staging": "int32"},
    # session 35: the ordered loop keeps 4 chunks' id loads in flight (`V5Config.ahead`)
    "ranks_t8192_c8_s16_u2_v32_a4": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                     "unroll": 2, "scatter": "ranks", "staging": "int32",
                                     "ahead": 4},
    "ranks_t16384_c8_s16_u2_v32_a4": {"tile": 16384, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "staging": "int32",
                                      "ahead": 4},
    # session 35: placement (r2) loads its next pass's ids ahead (`V5Config.prefetch`)
    "ranks_t8192_c8_s16_u2_v32_pf": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                     "unroll": 2, "scatter": "ranks", "staging": "int32",
                                     "prefetch": True},
    "ranks_t8192_c8_s16_u2_v32_a4_pf": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                        "unroll": 2, "scatter": "ranks", "staging": "int32",
                                        "ahead": 4, "prefetch": True},
    "ranks_t4096_c8_s16_u2_pf": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                 "unroll": 2, "scatter": "ranks", "prefetch": True},
    "ranks_t4096_c8_s16_u2_a4": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                 "unroll": 2, "scatter": "ranks", "ahead": 4},
    "ranks_t16384_c8_s16_u2_v32": {"tile": 16384, "count_warps": 8, "scatter_warps": 16,
                                   "unroll": 2, "scatter": "ranks", "staging": "int32"},
    "ranks_t4096_c8_s8_u4_v32": {"tile": 4096, "count_warps": 8, "scatter_warps": 8,
                                 "unroll": 4, "scatter": "ranks", "staging": "int32"},
    # session 36: int16 counter snapshots (`V5Config.snaps`), half the count -> finish bytes
    "ranks_t8192_c8_s16_u2_v32_sn16": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                       "unroll": 2, "scatter": "ranks", "staging": "int32",
                                       "snaps": "int16"},
    "ranks_t16384_c8_s16_u2_v32_sn16": {"tile": 16384, "count_warps": 8, "scatter_warps": 16,
                                        "unroll": 2, "scatter": "ranks", "staging": "int32",
                                        "snaps": "int16"},
    "ranks_t4096_c8_s16_u2_sn16": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                   "unroll": 2, "scatter": "ranks", "snaps": "int16"},
    "ranks_t2048_c4_s8_u4_sn16": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                  "unroll": 4, "scatter": "ranks", "snaps": "int16"},
    "ranks_t8192_c8_s16_u2_v32_pf_sn16": {"tile": 8192, "count_warps": 8, "scatter_warps": 16,
                                          "unroll": 2, "scatter": "ranks", "staging": "int32",
                                          "prefetch": True, "snaps": "int16"},
    "ranks_t16384_c8_s16_u2_v32_pf_sn16": {"tile": 16384, "count_warps": 8,
                                           "scatter_warps": 16, "unroll": 2, "scatter": "ranks",
                                           "staging": "int32", "prefetch": True,
                                           "snaps": "int16"},
    "ranks_t4096_c8_s16_u2_pf_sn16": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "prefetch": True,
                                      "snaps": "int16"},
    "v5_t2048_w4_u4_sn16": {"tile": 2048, "count_warps": 4, "scatter_warps": 4, "unroll": 4,
                            "snaps": "int16"},
    # session 37: 32-bit owner and row arithmetic (`V5Config.narrow`) on each table's configs
    "ranks_t2048_c4_s8_u4_nr": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                "unroll": 4, "scatter": "ranks", "narrow": True},
    "ranks_t4096_c8_s16_u2_nr": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                 "unroll": 2, "scatter": "ranks", "narrow": True},
    "ranks_t4096_c8_s16_u2_sn16_nr": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "snaps": "int16",
                                      "narrow": True},
    "ranks_t8192_c8_s16_u2_v32_pf_sn16_nr": {"tile": 8192, "count_warps": 8,
                                             "scatter_warps": 16, "unroll": 2,
                                             "scatter": "ranks", "staging": "int32",
                                             "prefetch": True, "snaps": "int16",
                                             "narrow": True},
    "ranks_t16384_c8_s16_u2_v32_pf_sn16_nr": {"tile": 16384, "count_warps": 8,
                                              "scatter_warps": 16, "unroll": 2,
                                              "scatter": "ranks", "staging": "int32",
                                              "prefetch": True, "snaps": "int16",
                                              "narrow": True},
    # session 37: each warp's ids prefetched into L2 in one bulk request (`l2_prefetch`)
    "ranks_t2048_c4_s8_u4_l2": {"tile": 2048, "count_warps": 4, "scatter_warps": 8,
                                "unroll": 4, "scatter": "ranks", "l2_prefetch": True},
    "ranks_t4096_c8_s16_u2_l2": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                 "unroll": 2, "scatter": "ranks", "l2_prefetch": True},
    "ranks_t4096_c8_s16_u2_sn16_l2": {"tile": 4096, "count_warps": 8, "scatter_warps": 16,
                                      "unroll": 2, "scatter": "ranks", "snaps": "int16",
                                      "l2_prefetch": True},
    "ranks_t8192_c8_s16_u2_v32_pf_sn16_l2": {"tile": 8192, "count_warps": 8,
                                             "scatter_warps": 16, "unroll": 2,
                                             "scatter": "ranks", "staging": "int32",
                                             "prefetch": True, "snaps": "int16",
                                             "l2_prefetch": True},
    "ranks_t16384_c8_s16_u2_v32_pf_sn16_l2": {"tile": 16384, "count_warps": 8,
                                              "scatter_warps": 16, "unroll": 2,
                                              "scatter": "ranks", "staging": "int32",
                                              "prefetch": True, "snaps": "int16",
                                              "l2_prefetch": True},
}  # fmt: skip
# the H100 table's configs (4096-id tiles below W = 512, 8192 from 512, 16384 at 2048)
H100_BASES = ("ranks_t4096_c8_s16_u2_sn16", "ranks_t8192_c8_s16_u2_v32_pf_sn16",
              "ranks_t16384_c8_s16_u2_v32_pf_sn16")  # fmt: skip
# session 39: each warp asks for its sub-range of the tile n tiles ahead in L2 (`l2_ahead`),
# about a wave before that tile's program reads it; n around the resident programs (an
# H100 holds 2 x 132 of the 8192-id config)
for _base in H100_BASES:
    for _n in (66, 132, 264, 528):
        CONFIGS[f"{_base}_la{_n}"] = {**CONFIGS[_base], "l2_ahead": _n}
# session 40, timing diagnostics (`V5Config(diag_skip=...)`; rows marked "diagnostic", not
# compared with v4, never a headline's best): the same scatter without its write-out
# (_nowo), without its perm stores (_noperm), without both (_nostore)
for _base in H100_BASES:
    for _suffix, _skip in (("_nowo", 1), ("_noperm", 2), ("_nostore", 3)):
        CONFIGS[f"{_base}{_suffix}"] = {**CONFIGS[_base], "diag_skip": _skip}

# session 47: the scatter takes the tiles last first (`V5Config(reverse=True)`), so that its
# first id reads may hit the L2 lines the count kernel read last; on each table's configs
for _base in ("v5_t2048_w4_u4", "ranks_t2048_c4_s8_u4", "ranks_t2048_c4_s8_u4_sn16",
              *H100_BASES):  # fmt: skip
    CONFIGS[f"{_base}_rev"] = {**CONFIGS[_base], "reverse": True}

# session 49: the atomic scatter (`V5Config(scatter="atomic")`: unordered ranks by shared
# atomics, then each id's stable rank within its dest's run; no loop in input order), on
# the tiles and warps of each table's ranks configs
for _base, _tile in (("ranks_t2048_c4_s8_u4_sn16", 2048), ("ranks_t4096_c8_s16_u2_sn16", 4096),
                     ("ranks_t8192_c8_s16_u2_v32_pf_sn16", 8192),
                     ("ranks_t8192_c8_s16_u2_v32_pf_sn16", 4096),
                     ("ranks_t16384_c8_s16_u2_v32_pf_sn16", 16384)):  # fmt: skip
    _name = f"atomic_t{_tile}" + _base[len(f"ranks_t{CONFIGS[_base]['tile']}") :]
    CONFIGS[_name] = {**CONFIGS[_base], "scatter": "atomic", "tile": _tile}
# session 50: the atomic scatter's LONG path (`V5Config(run_limit=...)`) on every tile (rl0)
# and on none (rlmax: the runs' count alone, ~run length shared loads per id)
for _limit, _suffix in ((0, "_rl0"), (16384, "_rlmax")):
    _base = "atomic_t8192_c8_s16_u2_v32_pf_sn16"
    CONFIGS[_base + _suffix] = {**CONFIGS[_base], "run_limit": _limit}


def hot_ids(values: torch.Tensor, rows: int) -> torch.Tensor:
    """Uniform ids in [0, rows) mapped to a power law, id' = floor(rows x (id / rows)^8)
    (same dtype): P(id' < rows / W) = W^(-1/8), the first shard's share under row-wise
    block sharding (0.42 at W = 1024, 0.55 at W = 128)."""
    x = values.double() / rows
    return (x**8 * rows).floor_().clamp_(0, rows - 1).to(values.dtype)


def _diff(a, b) -> list[str]:
    return [f for f in FIELDS if not torch.equal(getattr(a, f), getattr(b, f))]


def check(v5, g: torch.Generator, only: Optional[list[str]] = None) -> int:
    """Bitwise v5 == reference on random inputs; prints and counts mismatches. ``only``:
    check just these CONFIGS (names), not the built-in list and the forced route."""
    bad = cases = 0
    for w in (1, 2, 7, 8, 33, 64, 1000, 1024, 4096):
        for dt in (torch.int32, torch.int64):
            for k, b, maxlen in ((3, 257, 40), (2, 64, 3000)):
                lengths = torch.randint(0, maxlen, (k * b,), device="cuda", generator=g)
                lengths[torch.randint(0, k * b, (k * b // 5,), device="cuda", generator=g)] = 0
                lengths = lengths.to(dt)
                n = int(lengths.sum())
                rows = torch.tensor([1000, 4099, 37][:k], device="cuda")
                blocks = (rows + w - 1) // w
                key = torch.repeat_interleave(torch.arange(k, device="cuda"), b)
                seg_rows = torch.repeat_interleave(rows[key], lengths.long())
                vals = (torch.rand(n, device="cuda", generator=g) * seg_rows).long()
                # ids at block borders and past the last block (the modulo fallback)
                border = torch.rand(n, device="cuda", generator=g) < 0.1
                edge = (vals // blocks[key.repeat_interleave(lengths.long())].clamp(min=1)) * (
                    blocks[key.repeat_interleave(lengths.long())]
                )
                vals = torch.where(border, edge, vals).to(dt)
                for mode in ("block", "modulo"):
                    args = (vals, lengths, blocks.to(dt), w)
                    ref = reference.ranged_dispatch(*args, mode=mode)
                    builtin = (
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1),
                        v5.V5Config(tile=256, count_warps=4, scatter_warps=2, unroll=2),
                        v5.V5Config(tile=1024, count_warps=8, scatter_warps=8, unroll=8),
                        v5.V5Config(),
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    scatter="ranks"),
                        v5.V5Config(tile=256, count_warps=2, scatter_warps=8, unroll=2,
                                    scatter="ranks"),
                        v5.V5Config(tile=1024, count_warps=8, scatter_warps=4, unroll=8,
                                    scatter="ranks"),
                        v5.V5Config(scatter="ranks"),
                        v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2,
                                    scatter="ranks"),
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    counts="columns"),
                        v5.V5Config(tile=1024, count_warps=8, scatter_warps=4, unroll=8,
                                    scatter="ranks", counts="columns"),
                        v5.V5Config(scatter="ranks", counts="columns"),
                        v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2,
                                    scatter="ranks", counts="columns"),
                        # session 32: int32 output positions per staged slot
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    slots="pos"),
                        v5.V5Config(tile=2048, count_warps=4, scatter_warps=4, slots="pos"),
                        v5.V5Config(tile=256, count_warps=2, scatter_warps=8, unroll=2,
                                    scatter="ranks", slots="pos"),
                        v5.V5Config(tile=2048, count_warps=4, scatter_warps=8,
                                    scatter="ranks", slots="pos"),
                        v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2,
                                    scatter="ranks", counts="columns", slots="pos"),
                        # session 34: each id's dest stored in shared memory first
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    scatter="ranks", dests="stored"),
                        v5.V5Config(tile=2048, count_warps=4, scatter_warps=8,
                                    scatter="ranks", dests="stored"),
                        v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2,
                                    scatter="ranks", slots="pos", dests="stored"),
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    scatter="ranks", staging="int32"),
                        v5.V5Config(tile=4096, count_warps=8, scatter_warps=16, unroll=2,
                                    scatter="ranks", staging="int32"),
                        # session 47: the scatter takes the tiles last first
                        v5.V5Config(tile=256, count_warps=1, scatter_warps=1, unroll=1,
                                    reverse=True),
                        v5.V5Config(tile=512, count_warps=2, scatter_warps=4, unroll=2,
                                    scatter="ranks", staging="int32", reverse=True),
                    )  # fmt: skip
                    named = [v5.V5Config(**CONFIGS[c]) for c in only or ()]
                    for cfg in named or builtin:
                        if not v5.v5_supported(w, None, cfg):
                            continue
                        cases += 1
                        got = v5.ranged_dispatch_v5(*args, mode=mode, config=cfg)
                        wrong = _diff(ref, got)
                        if wrong:
                            bad += 1
                            print(f"MISMATCH v5 w={w} {dt} k={k} b={b} {mode} {cfg}: {wrong}")
    if only:
        print(f"v5 check of {only}: {cases} cases, {bad} mismatches", flush=True)
        return bad
    # the forced route: FREESCALE_TRITON_DISPATCH=v5 through kernels.ranged_dispatch (small
    # calls, which "auto" gives v4)
    import os

    from freescale.kernels import ranged_dispatch

    os.environ["FREESCALE_TRITON_DISPATCH"] = "v5"
    try:
        for w in (8, 1024, 5000):
            lengths = torch.randint(0, 200, (4 * 32,), device="cuda", generator=g)
            vals = torch.randint(0, 1 << 20, (int(lengths.sum()),), device="cuda", generator=g)
            blocks = torch.full((4,), -(-(1 << 20) // w), device="cuda")
            ref = reference.ranged_dispatch(vals, lengths, blocks, w)
            cases += 1
            if _diff(ref, ranged_dispatch(vals, lengths, blocks, w, backend="triton")):
                bad += 1
                print(f"MISMATCH FREESCALE_TRITON_DISPATCH=v5 w={w}")
    finally:
        del os.environ["FREESCALE_TRITON_DISPATCH"]
    print(f"v5 check: {cases} cases, {bad} mismatches", flush=True)
    return bad


def profile_one(fn, calls: int = 5) -> dict[str, float]:
    """Device ms per call per kernel name."""
    return kernel_device_ms(fn, calls)


def headline(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline of a run from its rows: per W of the large workload, v5's default
    fraction of the HBM floor and the best v5 configuration timed; at W = 1024 (when
    timed) the fields earlier runs had (`v4_fraction_of_hbm_floor_w1024`, ...)."""
    large = [r for r in rows if r["workload"] == "large"]
    out: dict[str, Any] = {"by_world": {}}
    for w in sorted({r["world"] for r in large}):
        at = [r for r in large if r["world"] == w]
        v5_rows = [r for r in at if r["impl"] != "v4" and "diagnostic" not in r]
        if not v5_rows:
            continue
        best = max(v5_rows, key=lambda r: r["fraction_of_hbm_floor"])
        out["by_world"][str(w)] = {
            "v5_default_fraction_of_hbm_floor": next(
                (r["fraction_of_hbm_floor"] for r in at if r["impl"] == "v5_default"), None
            ),
            "best_config": best["impl"],
            "best_fraction_of_hbm_floor": best["fraction_of_hbm_floor"],
        }
        if w == 1024:
            out["v4_fraction_of_hbm_floor_w1024"] = next(
                (r["fraction_of_hbm_floor"] for r in at if r["impl"] == "v4"), None
            )
            out["v5_fraction_of_hbm_floor_w1024"] = best["fraction_of_hbm_floor"]
            out["v5_best_config_w1024"] = best["impl"]
            out["v5_default_fraction_of_hbm_floor_w1024"] = out["by_world"]["1024"][
                "v5_default_fraction_of_hbm_floor"
            ]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--git-sha", default=None)
    p.add_argument("--worlds", type=int, nargs="*", default=WORLDS)
    p.add_argument("--check-only", action="store_true")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="skip step 1 (a timing sweep of code already checked; every timed call is "
        "still compared with v4's output)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        default=["large", "per_rank"],
        choices=["large", "per_rank", "hot"],
        help="hot: the large workload's ids on a power law (never in the headline)",
    )
    p.add_argument(
        "--configs",
        nargs="*",
        default=sorted(CONFIGS),
        choices=sorted(CONFIGS),
        help="extra V5Config settings timed on the large workload",
    )
    p.add_argument(
        "--check-configs",
        nargs="+",
        default=None,
        choices=sorted(CONFIGS),
        help="step 1 checks only these configs (not the built-in list)",
    )
    p.add_argument(
        "--ncu-config",
        choices=sorted(CONFIGS),
        default=None,
        help="no check, no timing: two calls of this config per W (after v4's, compared "
        "with it), for Nsight Compute: ncu -k regex:_v5_ ... dispatch_v5.py --ncu-config C",
    )
    p.add_argument(
        "--rehead",
        default=None,
        help="recompute the headline of an existing dispatch_v5 JSON from its rows (no run)",
    )
    args = p.parse_args(argv)
    if args.rehead:
        import json

        with open(args.rehead) as f:
            report = json.load(f)
        report["headline"] = headline(report["rows"])
        report.setdefault("notes", []).append(
            "headline recomputed from the rows by `dispatch_v5.py --rehead` (session 30)"
        )
        with open(args.rehead, "w") as f:
            json.dump(report, f, indent=1)
        print(json.dumps(report["headline"], indent=1))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("dispatch_v5.py needs a CUDA GPU (v5 is Gluon: no interpreter)")
    from freescale.kernels import triton_dispatch_v5 as v5

    dev = torch.device("cuda")
    # the card whose table "v5_default" runs (FREESCALE_V5_TABLE may name the other one)
    card = v5.table_name(v5.device_name(torch.device("cuda", torch.cuda.current_device())))
    if args.ncu_config:
        wl = make_workload("large", 8192, 1 << 26, dev, seed=0, smoke=False)
        cfg = v5.V5Config(**CONFIGS[args.ncu_config])
        for w in args.worlds:
            a = (wl["values"], wl["lengths"], block_sizes_for(w, dev), w)
            want = ranged_dispatch_v4(*a)
            for call in range(2):
                wrong = _diff(want, v5.ranged_dispatch_v5(*a, config=cfg))
                torch.cuda.synchronize()
                print(f"W={w} {args.ncu_config} call {call}: {wrong or 'equal to v4'}", flush=True)
                if wrong:
                    return 1
        return 0
    g = torch.Generator(device="cuda").manual_seed(5)
    bad = 0 if args.no_check else check(v5, g, args.check_configs)
    report: dict[str, Any] = figure_header("dispatch_v5", args.git_sha)
    report["command"] = "python benchmarks/dispatch_v5.py " + shlex.join(argv or sys.argv[1:])
    report["check"] = {"mismatches": "skipped (--no-check)" if args.no_check else bad}
    if bad or args.check_only:
        # a file that ends at the check still says what it checked and found
        checked = args.check_configs or "built-in list and the forced route"
        report["rows"] = [{"check": "v5 vs reference.ranged_dispatch, random inputs",
                           "configs": checked, "mismatches": bad}]  # fmt: skip
        report["headline"] = {"check_mismatches": bad, "timed": False}
        write_figure(args.out, report)
        return 1 if bad else 0

    bw = copy_bandwidth(dev, 1 << 30)
    report["copy_bandwidth_gbs"] = bw / 1e9
    rows: list[dict[str, Any]] = []
    workloads = {}
    for name, batch, total in (
        ("large", 8192, 1 << 26),
        ("per_rank", 128, None),
        ("hot", 8192, 1 << 26),
    ):
        if name not in args.workloads:
            continue
        workloads[name] = wl = make_workload(name, batch, total, dev, seed=0, smoke=False)
        if name == "hot":
            wl["values"] = hot_ids(wl["values"], ROWS_PER_TABLE)
        values, lengths, n = wl["values"], wl["lengths"], wl["n"]
        idx_bytes, len_bytes = values.element_size(), lengths.element_size()
        for w in args.worlds:
            a = (values, lengths, block_sizes_for(w, dev), w)
            want = ranged_dispatch_v4(*a)
            fns = {
                "v4": lambda a=a: ranged_dispatch_v4(*a),
                # what FREESCALE_TRITON_DISPATCH=v5 runs: default_config_v5
                "v5_default": lambda a=a: v5.ranged_dispatch_v5(*a),
            }
            h200 = v5.default_config_v5(w, "NVIDIA H200")
            if v5.default_config_v5(w, card) != h200:  # this card has its own table
                fns["v5_h200_table"] = lambda a=a, c=h200: v5.ranged_dispatch_v5(*a, config=c)
            for cname in args.configs if name != "per_rank" else ():
                cfg = v5.V5Config(**CONFIGS[cname])
                if v5.v5_supported(w, None, cfg):
                    fns[cname] = lambda a=a, cfg=cfg: v5.ranged_dispatch_v5(*a, config=cfg)
            floor_bytes = 2 * n * idx_bytes + n * 8 + lengths.numel() * len_bytes * (1 + w)
            floor_ms = floor_bytes / bw * 1e3
            for impl, fn in fns.items():
                # a diag_skip config leaves part of the output unwritten: not compared
                diag = CONFIGS.get(impl, {}).get("diag_skip", 0)
                wrong = [] if diag else _diff(want, fn())
                if wrong:
                    print(f"MISMATCH {impl} vs v4 at {name} W={w}: {wrong}", flush=True)
                    report["check"]["large_mismatch"] = f"{impl} {name} W={w} {wrong}"
                    write_figure(args.out, report)
                    return 1
                ms, _ = time_fast(fn, dev, reps=0)
                row = {"workload": name, "n": n, "world": w, "impl": impl, "ms": ms,
                       "floor_ms": floor_ms, "fraction_of_hbm_floor": floor_ms / ms}  # fmt: skip
                if diag:
                    row["diagnostic"] = f"diag_skip={diag}: output incomplete, not compared"
                if w in PROFILE_WORLDS:
                    row["kernels_ms"] = profile_one(fn)
                    row["device_ms"] = sum(row["kernels_ms"].values())
                rows.append(row)
                print(f"{name:8s} W={w:5d} {impl:20s} {ms:7.3f} ms  floor {floor_ms:.3f}  "
                      f"fraction {floor_ms / ms:.3f}", flush=True)  # fmt: skip
            # the rows so far, after every W: a call cut short (device time, a timeout)
            # still brings back a JSON file; "partial" says where it stopped
            report["rows"] = rows
            report["partial"] = f"rows through {name} W={w}; the run had not ended"
            report["headline"] = headline(rows)
            write_figure(args.out, report)
    report.pop("partial", None)
    report["rows"] = rows
    report["workloads"] = {
        k: {"n": wl["n"], "keys": 4, "batch": wl["batch"], "values": str(wl["values"].dtype)}
        for k, wl in workloads.items()
    }
    report["headline"] = headline(rows)
    path = write_figure(args.out, report)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
