"""Host wall time per function and step of a training run, without a profiler.

Put this directory first on ``PYTHONPATH`` and set ``FS_HOSTT=1``: every process of the
run (torchrun / spawn ranks) wraps the functions of :data:`TARGETS` with a
``time.perf_counter`` pair (inclusive time, no device sync, ~1 us per call) and, at
exit, writes ``<FS_HOSTT_OUT>/hostt_<pid>.txt``: ms per step and calls per step of
each function on the main thread and on other threads (the autograd engine's device
thread runs the embedding backward), counted after ``FS_HOSTT_WARM`` steps (default
15). A function that waits for the device or for a peer counts that wait: this shows
where the host blocks, which a profiler with stacks inflates (DESIGN.md 3).

    FS_HOSTT=1 FS_HOSTT_OUT=/tmp/ht PYTHONPATH=benchmarks/host_time:src \\
        python -m freescale.cli train --device cuda --nproc 2 --steps 60 --mode freescale

(``e2e_gpu.sh hostt``). A diagnostic: it prints nothing into benchmarks/results by
itself; the phase copies its text files there.
"""

from __future__ import annotations

import os

if os.environ.get("FS_HOSTT"):
    import atexit
    import collections
    import functools
    import importlib
    import sys
    import threading
    import time
    from typing import Any

    _E, _P = "freescale.embedding.collection", "freescale.embedding.prioritized"
    TARGETS = [
        ("freescale.pipeline.trainer", "Trainer.train_step"),
        ("freescale.pipeline.trainer", "Trainer.forward"),
        ("torch", "Tensor.backward"),
        (_E, "ShardedEmbeddingCollection.forward"),
        (_E, "ShardedEmbeddingCollection.input_dist"),
        (_E, "ShardedEmbeddingCollection._lookup_exchange"),
        (_E, "ShardedEmbeddingCollection._grad_exchange_and_update"),
        (_E, "ShardedEmbeddingCollection._apply"),
        (_P, "PrioritizedEmbeddingCollection.forward"),
        (_P, "PrioritizedEmbeddingCollection._backward_of_step"),
        (_P, "PrioritizedEmbeddingCollection._exchange_masks"),
        (_P, "PrioritizedEmbeddingCollection._mask_exchange"),
        (_P, "PrioritizedEmbeddingCollection._owner_split"),
        (_P, "PrioritizedEmbeddingCollection._apply_deferred"),
        (_P, "PrioritizedEmbeddingCollection._look_ahead_start"),
        (_P, "PrioritizedEmbeddingCollection._look_ahead_rest"),
        (_P, "PrioritizedEmbeddingCollection._split_backward"),
        (_P, "PrioritizedEmbeddingCollection._embeddings_of_step"),
        ("freescale.embedding.reduce", "group_rows_start"),
        ("freescale.embedding.reduce", "PendingRowGroups.finish"),
        ("freescale.embedding.reduce", "segment_sum"),
        ("freescale.embedding.reduce", "mask_positions"),
        ("freescale.embedding.optim", "FusedSparseOptimizer.step"),
        ("freescale.kernels.ops", "ranged_dispatch"),
        ("freescale.kernels.ops", "ranged_combine_backward"),
        ("freescale.comm.base", "Communicator.all_to_all_v"),
        ("freescale.comm.base", "Awaitable.wait"),
    ]
    _tot: dict[tuple[str, str], float] = collections.defaultdict(float)
    _cnt: dict[tuple[str, str], int] = collections.defaultdict(int)
    _state = {"steps": 0}
    _WARM = int(os.environ.get("FS_HOSTT_WARM", "15"))

    def _wrap(f: Any, key: str, counts_steps: bool = False) -> Any:
        @functools.wraps(f)
        def w(*a: Any, **k: Any) -> Any:
            if counts_steps:
                _state["steps"] += 1
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                if _state["steps"] > _WARM:
                    main = threading.current_thread() is threading.main_thread()
                    tn = "main" if main else "other"
                    _tot[(tn, key)] += time.perf_counter() - t0
                    _cnt[(tn, key)] += 1

        return w

    def _install() -> None:
        for modname, qual in TARGETS:
            mod = importlib.import_module(modname)
            parts = qual.split(".")
            if len(parts) == 2:
                cls = getattr(mod, parts[0])
                f = cls.__dict__[parts[1]]
                setattr(cls, parts[1], _wrap(f, qual, qual == "Trainer.train_step"))
                continue
            f = getattr(mod, qual)
            wf = _wrap(f, qual)
            for m in list(sys.modules.values()):  # also the names imported elsewhere
                name = getattr(m, "__name__", "") or ""
                if name.startswith("freescale") and getattr(m, qual, None) is f:
                    setattr(m, qual, wf)

    def _dump() -> None:
        out = os.environ.get("FS_HOSTT_OUT")
        if not out or _state["steps"] <= _WARM:
            return
        n = _state["steps"] - _WARM
        lines = [f"pid {os.getpid()} rank {os.environ.get('RANK', '?')} steps counted {n}"]
        for (tn, key), v in sorted(_tot.items(), key=lambda kv: -kv[1]):
            per = _cnt[(tn, key)] / n
            lines.append(f"{v / n * 1e3:9.3f} ms/step {per:6.2f} calls/step  {tn:5s} {key}")
        with open(os.path.join(out, f"hostt_{os.getpid()}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    import freescale.embedding.prioritized  # noqa: F401
    import freescale.embedding.sdd  # noqa: F401
    import freescale.pipeline.trainer  # noqa: F401

    _install()
    atexit.register(_dump)
