"""Summarise a Nsight Compute SASS export of one kernel: instructions per 32 ids, the
share of instructions and stall samples by opcode, and the SASS lines holding the most
stall samples with their main stall reason.

The export is what session 34 ran on the GPU machine for the v5 ranks scatter at
W = 1024 (2^26 ids)::

    ncu --clock-control none -k regex:_v5_scatter_ranks -s 1 -c 1 --import-source yes \\
        --section SourceCounters --section WarpStateStats -f -o rep \\
        python benchmarks/dispatch_v5.py --ncu-config ranks_t4096_c8_s16_u2 --worlds 1024
    ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv

Then, anywhere (no GPU)::

    python benchmarks/ncu_sass_summary.py sass.csv --ids 67108864
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from typing import Optional

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _num(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summarise(path: str, ids: int, top: int = 12) -> dict:
    """The summary of one SASS export (see the module docstring) as a dict."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if SAMPLES in r and EXECUTED in r)
    header, lines = rows[header_at], rows[header_at + 1 :]
    col = {h: i for i, h in enumerate(header)}
    stalls = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    groups = ids / 32
    total_samples = sum(_num(r[col[SAMPLES]]) for r in lines) or 1.0
    total_instr = sum(_num(r[col[EXECUTED]]) for r in lines) or 1.0
    by_op_instr: Counter = Counter()
    by_op_samples: Counter = Counter()
    hot = []
    for n, r in enumerate(lines):
        words = r[col["Source"]].split()
        if words and words[0].startswith("@"):
            words = words[1:]
        op = words[0].split(".")[0] if words else "?"
        by_op_instr[op] += _num(r[col[EXECUTED]])
        by_op_samples[op] += _num(r[col[SAMPLES]])
        reason = max(stalls, key=lambda i: _num(r[i]), default=None)
        hot.append(
            {
                "line": n,
                "sass": " ".join(r[col["Source"]].split())[:80],
                "per_32_ids": _num(r[col[EXECUTED]]) / groups,
                "sample_share": _num(r[col[SAMPLES]]) / total_samples,
                "reason": header[reason] if reason is not None else "",
            }
        )
    hot.sort(key=lambda h: -h["sample_share"])
    return {
        "warp_instructions_per_32_ids": total_instr / groups,
        "stall_samples": total_samples,
        "by_opcode": {
            op: {"instr_share": v / total_instr, "sample_share": by_op_samples[op] / total_samples}
            for op, v in by_op_instr.most_common(15)
        },
        "hottest_lines": hot[:top],
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sass_csv")
    p.add_argument("--ids", type=int, default=1 << 26, help="ids of the profiled call")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args(argv)
    s = summarise(args.sass_csv, args.ids, args.top)
    print(f"warp instructions per 32 ids: {s['warp_instructions_per_32_ids']:.1f}")
    print(f"stall samples: {s['stall_samples']:.0f}")
    for op, v in s["by_opcode"].items():
        print(f"  {op:10s} instr {v['instr_share']:6.1%}  stall samples {v['sample_share']:6.1%}")
    print("hottest SASS lines (share of stall samples, main reason):")
    for h in s["hottest_lines"]:
        print(
            f"  {h['line']:4d} {h['sample_share']:6.1%} {h['reason']:16s} "
            f"{h['per_32_ids']:5.2f}/32 ids  {h['sass']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
