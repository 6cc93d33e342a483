"""CompileWatch on a GPU: real Triton JIT compiles are counted, cached launches are not.

The CPU tests call Triton's compile hooks the way ``JITFunction._do_compile`` does; this
check makes Triton really compile. Inside one window it launches a kernel never compiled
in this process (a fresh constexpr), then the same launch again (the in-memory cache),
and from a second thread a third variant. Expects 2 compiles with positive seconds, the
kernel's name, and the hooks set before the window back afterwards. Exits 1 otherwise::

    PYTHONPATH=src python benchmarks/check_compile_watch_cuda.py
"""

from __future__ import annotations

import random
import sys
import threading

import torch
import triton
import triton.language as tl

from freescale.pipeline.compile_watch import CompileWatch


@triton.jit
def _add_const(x_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=m) + C, mask=m)


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: needs CUDA")
        return 0
    x = torch.zeros(1000, device="cuda")
    c = random.randint(1000, 10**6)  # a constexpr no earlier run compiled (disk cache)
    knobs = triton.knobs.runtime
    before = (knobs.jit_cache_hook, knobs.jit_post_compile_hook)
    w = CompileWatch(triton=True)
    w.start()
    _add_const[(4,)](x, x.numel(), C=c, BLOCK=256)
    _add_const[(4,)](x, x.numel(), C=c, BLOCK=256)  # cached: no compile
    t = threading.Thread(target=lambda: _add_const[(4,)](x, x.numel(), C=c + 1, BLOCK=256))
    t.start()
    t.join()
    out = w.stop()
    torch.cuda.synchronize()
    ok = (
        out["jit_compiles_in_window"] == 2
        and out["jit_compile_s_in_window"] > 0
        and out["jit_kernels"] == {"_add_const": 2}
        and (knobs.jit_cache_hook, knobs.jit_post_compile_hook) == before
        and float(x[0]) == 2 * c + c + 1
    )
    print(out)
    print("compile watch check:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
