"""Host CPU time per thread group (freescale.metrics.host_cpu)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from freescale.metrics.host_cpu import GilProbe, ThreadCpuMeter, thread_group

pytestmark = pytest.mark.skipif(
    not os.path.isdir("/proc/self/task"), reason="per-thread CPU time needs Linux /proc"
)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


def _spinner(name: str, seconds: float):
    """A thread that spins ``seconds`` of CPU once ``go`` is set, sets ``done`` and stays
    alive until ``release`` (an exited thread's time leaves /proc with it)."""
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        go.wait()
        _spin(seconds)
        done.set()
        release.wait()

    return threading.Thread(target=work, name=name), go, done, release


def test_thread_groups() -> None:
    assert thread_group("python", "", True) == "training"
    assert thread_group("pt_autograd_0", "", False) == "autograd"
    assert thread_group("python", "freescale-data-stage-rank0", False) == "data"
    assert thread_group("python", "freescale-loader-rank1", False) == "data"
    assert thread_group("python", "freescale-copy-engine-0", False) == "comm_workers"
    assert thread_group("python", "freescale-host-staged-1", False) == "comm_workers"
    assert thread_group("python", "freescale-watchdog", False) == "watchdog"
    assert thread_group("gloo_tcp_loop", "", False) == "gloo"
    assert thread_group("python", "freescale-gil-probe", False) == "probe"
    assert thread_group("python", "Thread-3", False) == "other"


def test_meter_attributes_cpu_time_to_the_right_threads() -> None:
    """A worker named like FreeScale's communicator workers spins 0.3 s of CPU while the
    caller spins 0.2 s: both show up in their groups (per step: / 10), within the
    kernel's tick resolution, and the process total covers both. The worker stays alive
    until the window closes (an exited thread's time leaves /proc with it)."""
    meter = ThreadCpuMeter()
    assert meter.available
    th, go, done, release = _spinner("freescale-copy-engine-test", 0.3)
    th.start()
    meter.start()
    go.set()
    _spin(0.2)
    assert done.wait(timeout=30)
    out = meter.stop(steps=10)
    release.set()
    th.join()
    assert out is not None
    g = out["by_group_ms_per_step"]
    assert g["training"] == pytest.approx(20.0, abs=3.0)  # 0.2 s / 10 steps
    assert g["comm_workers"] == pytest.approx(30.0, abs=5.0)  # 0.3 s / 10, 10 ms ticks
    assert out["process_cpu_ms_per_step"] >= 45.0
    assert out["wall_ms_per_step"] > 0 and out["cpu_over_wall"] > 0
    assert meter.stop(steps=10) is None  # one stop per start


def test_meter_lists_the_busiest_threads_of_no_known_role() -> None:
    """A thread of no FreeScale role (a library's, e.g. an OpenMP worker) that spins
    0.3 s inside the window is listed first under ``other_threads_top`` with its kernel
    name and ms per step, marked as created inside the window; an idle one is not."""
    meter = ThreadCpuMeter()
    th, go, done, release = _spinner("Thread-busy", 0.3)
    idle = threading.Thread(target=release.wait, name="Thread-idle")
    idle.start()
    meter.start()
    th.start()
    go.set()
    assert done.wait(timeout=30)
    out = meter.stop(steps=10)
    release.set()
    th.join()
    idle.join()
    assert out is not None
    top = out["other_threads_top"]
    assert top and top[0]["tid"] == th.native_id, top
    assert top[0]["ms_per_step"] == pytest.approx(30.0, abs=5.0) and top[0]["new"]
    assert isinstance(top[0]["kernel_name"], str)
    assert idle.native_id not in {t["tid"] for t in top}


def test_a_thread_that_exits_inside_the_window_counts_if_it_says_so() -> None:
    """The data stage and the loader call note_thread_exit as they end: their CPU time
    stays in the window; a thread that does not is lost with its /proc entry."""
    from freescale.metrics.host_cpu import note_thread_exit

    meter = ThreadCpuMeter()
    go = threading.Event()

    def work(note: bool) -> None:
        go.wait()
        _spin(0.2)
        if note:
            note_thread_exit()

    noted = threading.Thread(target=work, args=(True,), name="freescale-loader-rank0")
    silent = threading.Thread(target=work, args=(False,), name="freescale-data-stage-rank0")
    noted.start()
    silent.start()
    meter.start()
    go.set()
    noted.join()
    silent.join()
    out = meter.stop(steps=10)
    assert out is not None
    # 0.2 s / 10 steps from the noted thread; nothing from the silent one
    assert out["by_group_ms_per_step"]["data"] == pytest.approx(20.0, abs=3.0)


def test_a_joined_thread_still_in_proc_keeps_its_noted_role(monkeypatch) -> None:
    """Right after join() a thread's /proc entry may outlive its listing in
    ``threading`` (the kernel clears the join futex before it unlinks the task): the
    meter then reads its CPU from /proc and must still count it in the role it noted on
    exit, not as "other" (a race seen once in CI). Simulated: the thread notes its exit,
    stays alive, and is hidden from ``threading.enumerate``."""
    from freescale.metrics.host_cpu import note_thread_exit

    meter = ThreadCpuMeter()
    go, noted, release = threading.Event(), threading.Event(), threading.Event()

    def work() -> None:
        go.wait()
        _spin(0.2)
        note_thread_exit()
        noted.set()
        release.wait()

    th = threading.Thread(target=work, name="freescale-data-stage-rank0")
    th.start()
    meter.start()
    go.set()
    noted.wait()
    listed = threading.enumerate
    monkeypatch.setattr(threading, "enumerate", lambda: [t for t in listed() if t is not th])
    try:
        out = meter.stop(steps=10)
    finally:
        release.set()
        th.join()
    assert out is not None
    assert out["by_group_ms_per_step"]["data"] == pytest.approx(20.0, abs=3.0)
    assert th.native_id not in {t["tid"] for t in out["other_threads_top"]}


def test_gil_probe_statistics() -> None:
    """The probe's record: wakes counted, percentiles ordered, one start per stop (no
    timing asserted: lateness depends on the machine)."""
    with pytest.raises(ValueError, match="period_ms"):
        GilProbe(0.0)
    probe = GilProbe(period_ms=1.0)
    assert probe.stop() is None  # never started
    probe.start()
    with pytest.raises(RuntimeError, match="already started"):
        probe.start()
    end = time.perf_counter() + 0.2
    while time.perf_counter() < end:  # the caller holds the lock in Python code
        _spin(0.001)
    out = probe.stop()
    assert out is not None and out["wakes"] > 0 and out["period_ms"] == 1.0
    assert 0.0 <= out["p50_ms"] <= out["p90_ms"] <= out["p99_ms"] <= out["max_ms"]
    assert 0.0 <= out["share_over_1ms"] <= 1.0 and out["mean_ms"] <= out["max_ms"]
    assert not any(t.name == "freescale-gil-probe" for t in threading.enumerate())
    probe.start()  # restartable after stop
    probe.stop()
