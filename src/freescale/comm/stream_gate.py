"""Device-side gates: a CUDA stream waits until a 32-bit flag in device memory reaches a
value that another stream writes — so a thread can order its stream after work that a
different thread has not issued yet, without blocking on the host.

Owns :class:`StreamGate`, :func:`gate_available` and :class:`HostGate`. Used by the copy engine's
``wait="stream"`` mode (``comm/copy_engine.py``): the caller's ``wait()`` enqueues
"wait until flag >= k" on its current stream and returns at once; the backend's worker
thread, once it has issued collective k's copies, enqueues "flag = k" on its copy stream
behind them. The plain reference with the same semantics is the host wait
(``wait="host"``): ``wait()`` blocks until the worker has issued the copies and then
makes the stream wait on their CUDA event.

torch exposes no stream wait-value operation, so the two CUDA driver calls
(``cuStreamWaitValue32`` / ``cuStreamWriteValue32``, "stream memory operations") are
loaded from ``libcuda`` with ``ctypes``. Values compare as in the driver's ``GEQ`` mode,
``(int32)(*flag - value) >= 0``, so a counter that wraps around stays ordered. A write
is ordered after all earlier work of its stream and carries a memory barrier (the
driver's default), so work that waited for the flag sees the copies' bytes.

CPU-only builds and drivers without these entry points report unavailable (with the
reason); :func:`gate_available` also runs a self-test on the device. On CPU tensors
(no streams) the copy engine uses :class:`HostGate`, the same flag protocol on the host
— ``wait`` blocks the calling thread until the value is reached, with a timeout — which
is what the CPU tests exercise (value numbering, ordering, the error path).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import torch

__all__ = ["StreamGate", "HostGate", "gate_available", "reached", "resolve_wait", "WAIT_ENV"]

#: what ``wait="auto"`` of the SM-free backends follows (host | stream), else host
WAIT_ENV = "FREESCALE_SMFREE_WAIT"


def resolve_wait(mode: str) -> str:
    """``host`` or ``stream`` for a backend config's ``wait`` (``auto`` resolved through
    :data:`WAIT_ENV`; ``stream`` is opt-in until measured on GPUs)."""
    if mode not in ("auto", "host", "stream"):
        raise ValueError(f"wait must be auto, host or stream, got {mode!r}")
    if mode != "auto":
        return mode
    env = os.environ.get(WAIT_ENV, "").strip().lower()
    if env in ("", "auto", "host"):
        return "host"
    if env == "stream":
        return "stream"
    raise ValueError(f"{WAIT_ENV}={env!r}: use host, stream or auto")


_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT (with a memory barrier)
_MASK = 0xFFFFFFFF


def reached(flag: int, value: int) -> bool:
    """The driver's ``GEQ`` test on 32-bit values: ``(int32)(flag - value) >= 0``."""
    return ((flag - value) & _MASK) < (1 << 31)


_lock = threading.Lock()
_driver: tuple[Any, Any] | None = None
_driver_error: str | None = None


def _load_driver() -> tuple[Any, Any]:
    """``(wait, write)`` driver functions, loaded once; raises RuntimeError with the
    reason when they are missing."""
    global _driver, _driver_error
    with _lock:
        if _driver is not None:
            return _driver
        if _driver_error is not None:
            raise RuntimeError(_driver_error)
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            _driver_error = f"libcuda.so.1 not loadable: {e}"
            raise RuntimeError(_driver_error) from e
        funcs = []
        for base in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
            fn = None
            for name in (base + "_v2", base):
                fn = getattr(lib, name, None)
                if fn is not None:
                    break
            if fn is None:
                _driver_error = f"the CUDA driver has no {base}"
                raise RuntimeError(_driver_error)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            funcs.append(fn)
        _driver = (funcs[0], funcs[1])
        return _driver


class StreamGate:
    """One 32-bit flag in device memory (starts at 0). :meth:`wait` makes a stream wait
    until the flag reaches a value, :meth:`write` makes a stream set it once its earlier
    work is done, :meth:`release` sets it now (on a private stream with no earlier work:
    the error path, so that no stream waits forever for a collective that failed)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise RuntimeError(f"a stream gate needs a CUDA device, got {device}")
        self._wait_fn, self._write_fn = _load_driver()
        self.device = device
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.addr = self.flag.data_ptr()
        self._release_stream = torch.cuda.Stream(device=device)
        self.waits = 0  # stream waits enqueued (a counter for tests and reports)
        self.writes = 0

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"stream gate: {what} failed with CUresult {rc}")

    def wait(self, stream: torch.cuda.Stream, value: int) -> None:
        """Work enqueued on ``stream`` after this call runs once the flag >= ``value``."""
        rc = self._wait_fn(ctypes.c_void_p(stream.cuda_stream), self.addr, value & _MASK, _WAIT_GEQ)
        self._check(rc, "cuStreamWaitValue32")
        self.waits += 1

    def write(self, stream: torch.cuda.Stream, value: int) -> None:
        """Set the flag to ``value`` once the work enqueued on ``stream`` so far is done."""
        rc = self._write_fn(
            ctypes.c_void_p(stream.cuda_stream), self.addr, value & _MASK, _WRITE_DEFAULT
        )
        self._check(rc, "cuStreamWriteValue32")
        self.writes += 1

    def release(self, value: int) -> None:
        """Set the flag to ``value`` without waiting for any earlier work."""
        self.write(self._release_stream, value)


def gate_available(device: torch.device | str) -> tuple[bool, str]:
    """Whether stream gates work on ``device``: CUDA, the driver's entry points, and a
    self-test (one stream writes 1 behind a delay, another waits for it, the host reads
    the flag after the waiting stream). ``(ok, reason)``."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"stream gates need a CUDA device (got {device})"
    try:
        gate = StreamGate(device)
        a = torch.cuda.Stream(device=device)
        b = torch.cuda.Stream(device=device)
        with torch.cuda.device(device):
            with torch.cuda.stream(a):
                torch.cuda._sleep(1_000_000)  # ~0.5 ms: the waiter must really wait
            gate.write(a, 1)
            gate.wait(b, 1)
            seen = torch.empty(1, dtype=torch.int32, device=device)
            with torch.cuda.stream(b):
                seen.copy_(gate.flag)
            b.synchronize()
            a.synchronize()
        if int(seen.item()) != 1:
            return False, f"self-test read {int(seen.item())} behind the gate, expected 1"
    except Exception as e:  # noqa: BLE001 - reported as the reason
        return False, f"{type(e).__name__}: {e}"
    return True, "cuStreamWaitValue32 / cuStreamWriteValue32 through libcuda"


class HostGate:
    """:class:`StreamGate`'s protocol on the host, for CPU tensors (no streams): ``wait``
    blocks the calling thread until the flag reaches the value (``TimeoutError`` after
    ``timeout_s``), ``write`` / ``release`` set it (the CPU copies before a write are
    synchronous, so "behind the earlier work" holds)."""

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.value = 0
        self._cv = threading.Condition()
        self.waits = 0
        self.writes = 0

    def wait(self, stream: Any, value: int) -> None:
        value &= _MASK
        with self._cv:
            if not self._cv.wait_for(lambda: reached(self.value, value), self.timeout_s):
                raise TimeoutError(
                    f"host gate: flag {self.value} did not reach {value} within {self.timeout_s} s"
                )
            self.waits += 1

    def write(self, stream: Any, value: int) -> None:
        with self._cv:
            self.value = value & _MASK
            self.writes += 1
            self._cv.notify_all()

    def release(self, value: int) -> None:
        self.write(None, value)
