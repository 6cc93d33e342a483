"""Host wall time per function and step of a training run, without a profiler.

Put this directory first on ``PYTHONPATH`` and set ``FS_HOSTT=1``: every process of the
run (torchrun / spawn ranks) wraps the functions of :data:`TARGETS` with a
``time.perf_counter`` pair (inclusive time, no device sync, ~1 us per call) and, at
exit, writes ``<FS_HOSTT_OUT>/hostt_<pid>.txt``: ms per step and calls per step of
each function on the main thread and on other threads (the autograd engine's device
thread runs the embedding backward), counted after ``FS_HOSTT_WARM`` steps (default
15). A function that waits for the device or for a peer counts that wait: this shows
where the host blocks, which a profiler with stacks inflates (DESIGN.md 3). Below the
functions, CPU time per step of every thread of the process (``/proc/self/task``,
user + system, over whole ``FS_HOSTT_CPU_EVERY``-step windows after the warm-up):
threads that hold the GIL compete for it, so the Python threads' CPU time per step next
to the step's wall time says whether the host, not the GPU, bounds the step.

    FS_HOSTT=1 FS_HOSTT_OUT=/tmp/ht PYTHONPATH=benchmarks/host_time:src \\
        python -m freescale.cli train --device cuda --nproc 2 --steps 60 --mode freescale

(``e2e_gpu.sh hostt``). A diagnostic: it prints nothing into benchmarks/results by
itself; the phase copies its text files there.

Independently, ``FS_TRITON_COMPILES=<dir>`` logs every Triton JIT compile of every
process to ``<dir>/compiles_<pid>.jsonl`` (one JSON line each: start ``time.time()``,
seconds, kernel, Triton's signature text, thread, innermost ``freescale`` frame of the
call): a first use of a kernel variant inside measured steps stalls the host for the
whole compile (``e2e_gpu.sh compiles``).
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
        (_P, "PrioritizedEmbeddingCollection.prepare_backward"),
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

    _EVERY = int(os.environ.get("FS_HOSTT_CPU_EVERY", "10"))
    _cpu: dict[str, Any] = {"first": None, "last": None}
    _TICK = os.sysconf("SC_CLK_TCK")

    def _thread_cpu() -> dict[int, tuple[str, float]]:
        """tid -> (name, user + system seconds) of every thread of this process."""
        out: dict[int, tuple[str, float]] = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as fh:
                    st = fh.read()
            except OSError:
                continue
            name = st[st.index("(") + 1 : st.rindex(")")]
            f = st[st.rindex(")") + 2 :].split()
            out[int(tid)] = (name, (int(f[11]) + int(f[12])) / _TICK)
        return out

    def _cpu_snapshot() -> None:
        snap = (_state["steps"], time.perf_counter(), _thread_cpu())
        if _cpu["first"] is None:
            _cpu["first"] = snap
        _cpu["last"] = snap

    def _wrap(f: Any, key: str, counts_steps: bool = False) -> Any:
        @functools.wraps(f)
        def w(*a: Any, **k: Any) -> Any:
            if counts_steps:
                _state["steps"] += 1
                if _state["steps"] > _WARM and (_state["steps"] - _WARM - 1) % _EVERY == 0:
                    _cpu_snapshot()
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
        first, last = _cpu["first"], _cpu["last"]
        if first is not None and last is not None and last[0] > first[0]:
            steps = last[0] - first[0]
            wall = (last[1] - first[1]) / steps * 1e3
            names = {t.native_id: t.name for t in threading.enumerate()}
            lines.append(
                f"thread CPU time over steps {first[0]}..{last[0]} ({steps} steps, "
                f"{wall:.3f} ms wall per step): ms per step, tid, kernel name, Python name"
            )
            rows, total = [], 0.0
            for tid, (name, cpu) in last[2].items():
                prev = first[2].get(tid, (name, 0.0))[1]
                ms = (cpu - prev) / steps * 1e3
                total += ms
                rows.append((ms, tid, name, names.get(tid, "")))
            for ms, tid, name, py in sorted(rows, reverse=True):
                if ms >= 0.05:
                    lines.append(f"{ms:9.3f} ms/step  tid {tid:7d}  {name:16s} {py}")
            lines.append(f"{total:9.3f} ms/step  all threads")
        with open(os.path.join(out, f"hostt_{os.getpid()}.txt"), "w") as fh:
            fh.write("\n".join(lines) + "\n")

    import freescale.embedding.prioritized  # noqa: F401
    import freescale.embedding.sdd  # noqa: F401
    import freescale.pipeline.trainer  # noqa: F401

    _install()
    atexit.register(_dump)


if os.environ.get("FS_TRITON_COMPILES"):
    import json as _json
    import threading as _threading
    import time as _time
    import traceback as _traceback

    from freescale.pipeline.compile_watch import CompileWatch

    _CDIR = os.environ["FS_TRITON_COMPILES"]
    os.makedirs(_CDIR, exist_ok=True)

    def _caller() -> str:
        for fr in reversed(_traceback.extract_stack()[:-3]):
            if "/freescale/" in fr.filename and "compile_watch" not in fr.filename:
                return f"{fr.filename.split('/freescale/')[-1]}:{fr.lineno} {fr.name}"
        return ""

    def _log(seconds: float, *, repr, fn, **_: object) -> None:  # noqa: A002
        row = {
            "pid": os.getpid(),
            "t_start": _time.time() - seconds,
            "seconds": round(seconds, 4),
            "kernel": f"{fn.module}.{fn.name}",
            "thread": _threading.current_thread().name,
            "caller": _caller(),
            "repr": repr[:500],
        }
        with open(os.path.join(_CDIR, f"compiles_{os.getpid()}.jsonl"), "a") as fh:
            fh.write(_json.dumps(row) + "\n")

    # the trainer's own CompileWatch (profiled window) chains onto these hooks
    CompileWatch(triton=True, on_compile=_log).start()  # for the whole process
