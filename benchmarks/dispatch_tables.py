"""Figure "dispatch_tables": device time of the dispatch's table launches per setting.

Steps 1-2 of v4 and v5 (`triton_dispatch_v4.launch_tables`): the segment offsets (one
program scanning the lengths `SEG_BLOCK_MAX` at a time) and the tile table (per tile, its
key, id range and owned segments, by k-ary searches with `SEARCH_FAN` probes a round;
`TABLE_BLOCK` tiles per program, or `FUSED_TABLE_BLOCK` a pass of the one-program launch
used up to `FUSED_TABLES_MAX_TILES` tiles).
On an H200 at 2^26 ids they took 36 + 29 us per call (`dispatch_v5.json`, `431f902`),
~9% of v5's whole call at W = 8 and more than the gap to half the HBM floor at W = 32.
For each workload of `kernels.py` (2^26 ids; one rank's ~1M ids) and tile size, every
setting below is run, its seven outputs compared bit for bit with a plain torch
reference (cumsum, searchsorted), and its kernels timed with torch.profiler (device time
per call, summed over the table kernels).

Usage (one H200, about a minute; a CPU check of the many-program path, no timing, with
TRITON_INTERPRET=1 ... --smoke, run by tests/test_kernels_v4.py):

    PYTHONPATH=src python benchmarks/dispatch_tables.py --out DIR --git-sha SHA

Writes DIR/dispatch_tables.json (figure, device, git sha, date, command, rows: workload,
tile, setting, per-kernel and total device us; headline: the default's total and the
ratio binary-like (fan 2, 1024-tile blocks) / default, per workload and tile). Exits 1 on a
mismatch.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _figure import (  # noqa: E402
    figure_header,
    git_sha,
    kernel_device_ms,
    write_figure,
)
from freescale.kernels import triton_dispatch_v4 as v4  # noqa: E402
from freescale.kernels.common import cdiv  # noqa: E402
from kernels import make_workload  # noqa: E402

# module constants set per setting; the first setting is the module's default
KNOBS = ("SEG_BLOCK_MAX", "SEARCH_FAN", "TABLE_BLOCK", "FUSED_TABLE_BLOCK", "FUSED_TABLE_WARPS",
         "SEG_SCAN_BLOCK")  # fmt: skip
DEFAULT = tuple(getattr(v4, k) for k in KNOBS)
SETTINGS = [
    DEFAULT,
    # close to `431f902`: binary search, 1024-tile blocks, one program for the offsets
    (2048, 2, 1024, 1024, 4, 1 << 40),
    (2048, 16, 256, 512, 16, 1 << 40),  # 7f780b3: one program for the offsets
    (2048, 16, 256, 512, 16, 1024),
    (2048, 16, 256, 512, 16, 4096),
    (2048, 16, 64, 256, 8, 2048),
]
FIELDS = ("seg_offsets", "key_tile_first", "tile_key", "tile_start", "tile_end",
          "tile_seg_lo", "tile_seg_hi")  # fmt: skip


def reference_tables(lengths: torch.Tensor, num_keys: int, batch: int, num_tiles: int,
                     tile: int) -> dict:  # fmt: skip
    """The tables from torch ops (cumsum, searchsorted): what `launch_tables` writes."""
    dev = lengths.device
    seg_offsets = torch.zeros(num_keys * batch + 1, dtype=torch.int64, device=dev)
    seg_offsets[1:] = torch.cumsum(lengths.long(), 0)
    key_start = seg_offsets[::batch][:num_keys]
    key_end = seg_offsets[batch::batch]
    per_key = torch.clamp(-(-(key_end - key_start) // tile), min=1)
    key_tile_first = torch.zeros(num_keys + 1, dtype=torch.int64, device=dev)
    key_tile_first[1:] = torch.cumsum(per_key, 0)
    out = {f: torch.zeros(num_tiles, dtype=torch.int64, device=dev) for f in FIELDS[2:]}
    out["tile_key"] = out["tile_key"].int()
    for k in range(num_keys):
        seg0 = k * batch
        first, count = int(key_tile_first[k]), int(per_key[k])
        t = torch.arange(first, first + count, device=dev)
        start = key_start[k] + (t - first) * tile
        end = torch.minimum(start + tile, key_end[k])
        offs = seg_offsets[seg0 : seg0 + batch].contiguous()
        seg_hi = seg0 + torch.searchsorted(offs, end)
        seg_hi[-1] = seg0 + batch
        out["tile_key"][t] = k
        out["tile_start"][t], out["tile_end"][t] = start, end
        out["tile_seg_lo"][t] = seg0 + torch.searchsorted(offs, start)
        out["tile_seg_hi"][t] = seg_hi
    return {"seg_offsets": seg_offsets, "key_tile_first": key_tile_first, **out}


def run_tables(lengths: torch.Tensor, num_keys: int, batch: int, num_tiles: int,
               tile: int) -> dict:  # fmt: skip
    """`launch_tables` into fresh buffers; the seven tables by name."""
    dev = lengths.device
    bufs = {
        "seg_offsets": torch.empty(num_keys * batch + 1, dtype=torch.int64, device=dev),
        "key_tile_first": torch.empty(num_keys + 1, dtype=torch.int64, device=dev),
        "tile_key": torch.empty(num_tiles, dtype=torch.int32, device=dev),
        **{f: torch.empty(num_tiles, dtype=torch.int64, device=dev) for f in FIELDS[3:]},
    }
    table = tuple(bufs[f] for f in FIELDS[2:])
    v4.launch_tables(lengths, bufs["seg_offsets"], bufs["key_tile_first"], table, num_keys,
                     batch, num_tiles, tile)  # fmt: skip
    return bufs


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--git-sha", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, no timing (CPU check)")
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        workloads = [("smoke", make_workload("smoke", 8, 4000, dev, seed=0, smoke=True))]
        tiles = [64, 256]
    else:
        workloads = [
            ("large", make_workload("large", 8192, 1 << 26, dev, seed=0, smoke=False)),
            ("per_rank", make_workload("per_rank", 128, None, dev, seed=0, smoke=False)),
        ]
        tiles = [1024, 4096]  # v4's per-rank tile; v5's at 2^26 ids from W = 512
    settings = list(SETTINGS)
    fused_max = v4.FUSED_TABLES_MAX_TILES
    if args.smoke:  # the many-program path, with several offset programs and table blocks
        v4.FUSED_TABLES_MAX_TILES = 0
        settings.append((2048, 16, 16, 16, 4, 8))
    rows, bad = [], 0
    try:
        for name, wl in workloads:
            lengths = wl["lengths"]
            num_keys = lengths.numel() // wl["batch"]
            n = int(lengths.sum())
            for tile in tiles:
                num_tiles = n // tile + num_keys
                want = reference_tables(lengths, num_keys, wl["batch"], num_tiles, tile)
                for setting in settings:
                    for knob, value in zip(KNOBS, setting):
                        setattr(v4, knob, value)
                    got = run_tables(lengths, num_keys, wl["batch"], num_tiles, tile)
                    wrong = [f for f in FIELDS if not torch.equal(got[f], want[f])]
                    bad += bool(wrong)
                    row = {"workload": name, "ids": n, "tile": tile, "tiles": num_tiles,
                           "fused": num_tiles <= v4.FUSED_TABLES_MAX_TILES,
                           "setting": dict(zip(KNOBS, setting)), "equal": not wrong,
                           "table_programs": cdiv(num_tiles, setting[2])}  # fmt: skip
                    if wrong:
                        row["wrong_fields"] = wrong
                    if cuda:
                        call = (lengths, num_keys, wl["batch"], num_tiles, tile)
                        kern = kernel_device_ms(partial(run_tables, *call), args.calls)
                        tables = {k: v * 1e3 for k, v in kern.items() if "_v4_" in k}
                        row["kernels_us"] = tables
                        row["total_us"] = sum(tables.values())
                    rows.append(row)
                    print(
                        f"{name} tile={tile} {setting}: "
                        f"{'EQUAL' if not wrong else 'MISMATCH ' + ','.join(wrong)} "
                        f"{row.get('total_us', float('nan')):.1f} us",
                        flush=True,
                    )
    finally:
        for knob, value in zip(KNOBS, DEFAULT):
            setattr(v4, knob, value)
        v4.FUSED_TABLES_MAX_TILES = fused_max
    headline = {"mismatches": bad}
    if cuda:
        for name, _ in workloads:
            mine = [r for r in rows if r["workload"] == name and "total_us" in r]
            for tile in tiles:
                at = [r for r in mine if r["tile"] == tile]
                default = next(r for r in at if tuple(r["setting"].values()) == DEFAULT)
                binary = next(r for r in at if tuple(r["setting"].values()) == SETTINGS[1])
                headline[f"{name}_tile{tile}_default_us"] = default["total_us"]
                headline[f"{name}_tile{tile}_binary_like_over_default"] = (
                    binary["total_us"] / default["total_us"]
                )
    report = {
        **figure_header("dispatch_tables", git_sha(args.git_sha)),
        "knobs": list(KNOBS),
        "settings": [list(s) for s in SETTINGS],
        "rows": rows,
        "headline": headline,
    }
    print(headline)
    if not args.smoke:
        write_figure(args.out, report)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
