"""Figure ``e2e_projection``: the measured 2-GPU e2e report projected to 64 and 256 ranks.

Reads an ``e2e.json`` written by ``freescale bench e2e`` on GPUs (with GPU accounting)
and writes ``<out>/e2e_projection.json`` with the inputs taken from it, the network
model, the assumptions and one row per (world size, schedule); see
``freescale.pipeline.bench_e2e.projection_from_report`` and docs/projection.md. A
projection, not a measurement: CPU only, seconds.

    PYTHONPATH=src python benchmarks/e2e_projection.py \\
        --report benchmarks/results/e2e.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from freescale.pipeline.bench_e2e import _jsonable, projection_from_report
from freescale.pipeline.projection import format_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--report", type=Path, required=True, help="an e2e.json from GPUs")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[64, 256])
    args = ap.parse_args(argv)
    report = json.loads(args.report.read_text())
    proj = projection_from_report(report, tuple(args.world_sizes))
    if proj is None:
        print("the report has no vanilla row", file=sys.stderr)
        return 1
    out = {
        "figure": "e2e_projection",
        "device": f"projection from: {report.get('device')}",
        "git_sha": report.get("git_sha"),
        "date": dt.date.today().isoformat(),
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "measured_report": str(args.report),
        **proj,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "e2e_projection.json"
    path.write_text(json.dumps(_jsonable(out), indent=2) + "\n")
    print(format_table(proj["rows"]))
    print(json.dumps(proj["headline"], indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
