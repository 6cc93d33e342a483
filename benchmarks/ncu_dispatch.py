"""Hardware counters of dispatch v4's kernels: a driver for Nsight Compute (``ncu``).

Runs `ranged_dispatch_v4` on the large workload of `benchmarks/kernels.py` (2^26 ids),
twice per (W, knobs) setting (the first call compiles), after checking it bitwise against
the reference. Run it under ncu to read DRAM bytes, L2 sectors and L1 wavefronts per
kernel, e.g. (one H200; the launch order is printed, so rows can be matched to settings):

    ncu --clock-control none -k regex:_v4_ --csv --metrics dram__bytes_write.sum,... \\
        python benchmarks/ncu_dispatch.py --worlds 8 1024 --knobs "" "peers=compare"

Without ncu it only checks the outputs (also on CPU with TRITON_INTERPRET=1 and --smoke).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from freescale.kernels import reference
from freescale.kernels.triton_dispatch_v4 import ranged_dispatch_v4

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import block_sizes_for, make_workload, parse_v4_knobs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 1024])
    ap.add_argument("--knobs", nargs="+", default=[""], help='settings, e.g. "" "tile=4096"')
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU check)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    batch, total = (8, None) if args.smoke else (8192, 1 << 26)
    wl = make_workload("large", batch, total, device, seed=0, smoke=args.smoke)
    launch = 0
    for w in args.worlds:
        bs = block_sizes_for(w, device)
        ref = reference.ranged_dispatch(wl["values"], wl["lengths"], bs, w)
        for spec in args.knobs:
            knobs = parse_v4_knobs(spec)
            for call in range(2):
                got = ranged_dispatch_v4(wl["values"], wl["lengths"], bs, w, **knobs)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                print(f"launch set {launch}: W={w} knobs={spec or 'defaults'} call={call}")
                launch += 1
            for f in ("values", "lengths", "splits", "key_counts", "unbucketize_permute"):
                if not torch.equal(getattr(ref, f), getattr(got, f)):
                    print(f"MISMATCH W={w} {spec} {f}", file=sys.stderr)
                    return 1
    print(f"ok: {launch} calls, n={wl['n']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
