"""GPU self-check of the SM-free backends against NCCL (2 GPUs, under a minute).

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/gpu_check_comm.py

For random variable splits (and empty, self-only, skewed, bf16/int64/2-D rows, 64 MB),
every rank compares the output of
* CopyEngineCommunicator with symmetric peer memory (all_to_all_v and the zero-copy
  all_to_all_v_segments), with CUDA IPC peer memory, and
* HostStagedCommunicator
with NCCL's ``all_to_all_single`` on the same input (the reference collective), bitwise;
and all_gather (contiguous and views) with ``all_gather_into_tensor``. Inputs are
written on the current stream behind a long GEMM right before each call (a backend that
does not order itself after the caller's stream reads stale data); one round runs with
a side stream as the current stream; a growth loop reuses and grows the receive buffers.

``--cpu`` runs the same control flow on CPU ranks (gloo reference, the copy-engine
protocol over /dev/shm peer memory, host_staged through its staging pool): a check of
this script, not of the GPU paths.

Prints one ``OK`` / ``MISMATCH`` / ``UNAVAILABLE`` line per check and rank, then a
summary on rank 0; exits non-zero if any check mismatched, if host_staged or both
copy-engine peer memories were unavailable, or if the run exceeds --timeout-s (a
watchdog kills it rather than let it hang). NVLink multicast stays off.
"""

from __future__ import annotations

import os

_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
for _k, _v in _SAFE_ENV.items():
    if os.environ.setdefault(_k, _v) != _v:
        raise SystemExit(f"refusing to run: {_k}={os.environ[_k]} would allow NVLink multicast")

import argparse  # noqa: E402
import datetime as dt  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

try:
    import freescale  # noqa: F401
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from freescale.comm import (  # noqa: E402
    CopyEngineCommunicator,
    CopyEngineConfig,
    HostStagedCommunicator,
    HostStagedConfig,
)
from freescale.comm.copy_engine import symm_available, symm_backend  # noqa: E402


def splits(seed: int, world: int, hi: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, hi + 1, (world, world), generator=g).tolist()


def make_input(seed: int, rank: int, rows: int, feat, dtype, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        return torch.randn((rows, *feat), generator=g, device=dev).to(dtype)
    return torch.randint(-(2**40), 2**40, (rows, *feat), generator=g, device=dev).to(dtype)


class Checker:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.failures = 0
        self.caught = 0
        self.caught_by: dict[str, int] = {}  # per mutant communicator
        self.lines: list[str] = []

    def report(self, status: str, what: str, detail: str = "") -> None:
        if status == "MISMATCH" and "mutant" in what:
            status = "CAUGHT"  # the deliberate bug of the mutant communicator was seen
        line = f"[rank {self.rank}] {status:<11} {what}" + (f"  ({detail})" if detail else "")
        print(line, flush=True)
        if status == "CAUGHT":
            self.caught += 1
            who = what.split()[0]
            self.caught_by[who] = self.caught_by.get(who, 0) + 1
        elif status != "OK":
            self.failures += status == "MISMATCH"

    def compare(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if got.shape != want.shape or got.dtype != want.dtype:
            self.report(
                "MISMATCH",
                what,
                f"shape/dtype {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}",
            )
            return
        if torch.equal(got, want):
            self.report("OK", what, f"{got.numel() * got.element_size() / 2**20:.1f} MB")
            return
        diff = (got != want).reshape(got.shape[0], -1).any(1) if got.dim() else got != want
        first = int(diff.nonzero()[0, 0]) if diff.any() else -1
        self.report("MISMATCH", what, f"{int(diff.sum())} rows differ, first at row {first}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout-s", type=float, default=100.0)
    p.add_argument("--cpu", action="store_true", help="control-flow check on CPU ranks")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        choices=["symmetric", "ipc", "host_staged"],
        help="check only these (default: copy engine over symmetric and ipc, host_staged)",
    )
    a = p.parse_args()

    def watchdog() -> None:
        print(f"gpu_check_comm: WATCHDOG: not done after {a.timeout_s} s, aborting", flush=True)
        os._exit(3)

    timer = threading.Timer(a.timeout_s, watchdog)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    ctrl = dist.new_group(backend="gloo", timeout=dt.timedelta(seconds=a.timeout_s))
    chk = Checker(rank)
    if rank == 0 and not a.cpu:
        ok, why = symm_available()
        print(
            f"torch {torch.__version__}, cuda {torch.version.cuda}, nccl "
            f"{'.'.join(map(str, torch.cuda.nccl.version()))}, {world}x "
            f"{torch.cuda.get_device_name(dev)}; symmetric memory available: {ok} {why}; "
            f"env {[f'{k}={os.environ[k]}' for k in _SAFE_ENV]}",
            flush=True,
        )
    cfg = dict(initial_buffer_bytes=1 << 20, growth_factor=1.5, timeout_s=60)
    peer_memories = ["host_shm"] if a.cpu else ["symmetric", "ipc"]
    if a.only is not None and not a.cpu:
        peer_memories = [pm for pm in peer_memories if pm in a.only]
    comms = {
        f"copy_engine[{pm}]": CopyEngineCommunicator.create(
            name=f"ce_{pm}",
            config=CopyEngineConfig(peer_memory=pm, completion="host", **cfg),
            device=dev,
        )
        for pm in peer_memories
    }
    # device-side completion (inter-process events), and a mutant of it that skips the
    # wait for the peers' copies: the checks must catch the mutant (CAUGHT lines)
    for pm in peer_memories:
        comms[f"copy_engine[{pm},device]"] = CopyEngineCommunicator.create(
            name=f"ce_{pm}_dev",
            config=CopyEngineConfig(peer_memory=pm, completion="device", **cfg),
            device=dev,
        )
        # the per-collective handshakes on gloo (the default is the shared-memory exchange)
        comms[f"copy_engine[{pm},device,gloo_handshake]"] = CopyEngineCommunicator.create(
            name=f"ce_{pm}_dev_gloo",
            config=CopyEngineConfig(peer_memory=pm, completion="device", handshake="gloo", **cfg),
            device=dev,
        )
    if not a.cpu and peer_memories:
        pm = peer_memories[0]
        mutant = CopyEngineCommunicator.create(
            name="ce_mutant",
            config=CopyEngineConfig(peer_memory=pm, completion="device", **cfg),
            device=dev,
        )
        mutant._mutation = "skip_sent_wait"
        comms[f"copy_engine[{pm},device,mutant]"] = mutant
    if a.only is None or "host_staged" in a.only:
        comms["host_staged"] = HostStagedCommunicator.create(
            name="hs",
            config=HostStagedConfig(chunk_bytes=4 << 20, timeout_s=60, stage_host_tensors=a.cpu),
        )
    broken: dict[str, str] = {}
    heavy = torch.randn(256 if a.cpu else 4096, 256 if a.cpu else 4096, device=dev)

    def produce(seed: int, rows: int, feat, dtype) -> torch.Tensor:
        """The input, written on the current stream behind ~ms of GEMMs."""
        x = torch.zeros((rows, *feat), dtype=dtype, device=dev)
        y = heavy
        for _ in range(3):
            y = y @ heavy
        x.copy_(make_input(seed, rank, rows, feat, dtype, dev))
        return x

    def run_case(label: str, S, feat, dtype, seed: int) -> None:
        in_s = S[rank]
        out_s = [S[s][rank] for s in range(world)]
        x = produce(seed, sum(in_s), feat, dtype)
        want = torch.empty((sum(out_s), *feat), dtype=dtype, device=dev)
        dist.all_to_all_single(want, x, out_s, in_s)  # the reference collective
        for name, comm in comms.items():
            if name in broken:
                continue
            try:
                x = produce(seed, sum(in_s), feat, dtype)
                got = comm.all_to_all_v(x, in_s, out_s, name=label).wait()
                chk.compare(f"{name:<22} all_to_all_v {label}", got, want)
                if name.startswith("copy_engine"):
                    x = produce(seed, sum(in_s), feat, dtype)
                    h = comm.all_to_all_v_segments(x, in_s, out_s, name=label)
                    got = torch.cat(h.wait())
                    h.release()
                    chk.compare(f"{name:<22} segments     {label}", got, want)
            except Exception as e:  # noqa: BLE001 - reported, the others go on
                broken[name] = f"{type(e).__name__}: {e}"
                chk.report("UNAVAILABLE", f"{name} ({label})", broken[name][:300])
                if os.environ.get("FREESCALE_CHECK_TRACEBACK"):
                    traceback.print_exc()

    F32, BF16, I64 = torch.float32, torch.bfloat16, torch.int64
    self_only = [[7 if s == d else 0 for d in range(world)] for s in range(world)]
    skewed = splits(5, world, 4000)
    skewed[0] = [0] * world
    for s in range(world):
        skewed[s][world - 1] = 0
    mb64 = (64 << 20) // 512 // world
    cases = [
        ("random_small", splits(1, world, 50), (16,), F32),
        ("random_bf16_2d", splits(2, world, 3000), (4, 8), BF16),
        ("random_int64_1d", splits(3, world, 50000), (), I64),
        ("random_32MB", splits(4, world, 2 * (32 << 20) // 512 // world), (128,), F32),
        ("skewed_empty", skewed, (16,), F32),
        ("all_empty", [[0] * world for _ in range(world)], (16,), F32),
        ("self_only", self_only, (16,), F32),
        ("large_64MB", [[mb64] * world for _ in range(world)], (128,), F32),
    ]
    for i, (label, S, feat, dtype) in enumerate(cases):
        run_case(label, S, feat, dtype, seed=100 + i)
    # the same through a side stream as the current stream
    if not a.cpu:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_case("on_side_stream", splits(9, world, 20000), (32,), F32, seed=9)
        torch.cuda.current_stream().wait_stream(side)
    # buffer reuse and growth: sizes go up and down
    for j, hi in enumerate([100, 5000, 300, 60000, 20, 120000, 7]):
        run_case(f"grow_{j}", splits(200 + j, world, hi), (64,), F32, seed=200 + j)
    # all-gather against all_gather_into_tensor
    for label, shape in (("ag_small", (33, 5)), ("ag_16MB", ((16 << 20) // 4 // 64, 64))):
        x = make_input(300, rank, shape[0], shape[1:], F32, dev)
        want = torch.empty((world * shape[0], *shape[1:]), device=dev)
        dist.all_gather_into_tensor(want, x)
        for name, comm in comms.items():
            if name in broken:
                continue
            modes = (False, True) if name.startswith("copy_engine") else (False,)
            for views in modes:
                try:
                    if views:
                        h = comm.all_gather(x, name=label, views=True)
                        got = torch.cat(h.wait())
                        h.release()
                    else:
                        got = torch.cat(comm.all_gather(x, name=label).wait())
                    chk.compare(
                        f"{name:<22} all_gather{'[views]' if views else ''} {label}", got, want
                    )
                except Exception as e:  # noqa: BLE001
                    broken[name] = f"{type(e).__name__}: {e}"
                    chk.report("UNAVAILABLE", f"{name} ({label})", broken[name][:300])
    if not a.cpu:
        torch.cuda.synchronize()
    for name, comm in comms.items():
        if name.startswith("copy_engine") and name not in broken:
            print(
                f"[rank {rank}] {name}: peer memory {comm.peer_memory} "
                f"(symm backend {symm_backend(dev) if comm.peer_memory == 'symmetric' else '-'}) "
                f"{comm.memory_stats()} {comm.peer_memory_note}",
                flush=True,
            )
        comm.close()
    fatal = int("host_staged" in broken) + int(
        bool(peer_memories) and all(f"copy_engine[{pm}]" in broken for pm in peer_memories)
    )
    mutants = sorted(n for n in comms if "mutant" in n)
    missed = sum(1 for n in mutants if not chk.caught_by.get(n))  # a mutant no check saw
    flags = torch.tensor([chk.failures, fatal, len(broken), chk.caught, missed], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctrl)
    mism, fat, nbroken, caught, nmissed = (int(v) for v in flags)
    print(f"[rank {rank}] caught per mutant: {dict(chk.caught_by)} of {mutants}", flush=True)
    device_runs = {
        n: c.device_completions
        for n, c in comms.items()
        if isinstance(c, CopyEngineCommunicator) and "device" in n
    }
    print(f"[rank {rank}] device completions per communicator: {device_runs}", flush=True)
    handshakes = {n: c.handshake for n, c in comms.items() if isinstance(c, CopyEngineCommunicator)}
    print(f"[rank {rank}] handshake per communicator: {handshakes}", flush=True)
    if rank == 0:
        verdict = "PASS" if mism == 0 and fat == 0 else "FAIL"
        power = (
            "ok"
            if (caught and not nmissed) or a.cpu
            else f"{nmissed} mutant(s) NOT CAUGHT: the check cannot see the race"
        )
        print(
            f"gpu_check_comm: {verdict}: {mism} mismatch(es) on the worst rank, "
            f"{nbroken} backend(s) unavailable somewhere ({sorted(broken) or 'none'} here), "
            f"mutants caught in {caught} check(s) on the worst rank "
            f"({power}), "
            f"{time.monotonic() - t0:.1f} s",
            flush=True,
        )
    dist.barrier(group=ctrl)
    dist.destroy_process_group()
    timer.cancel()
    return 1 if (mism or fat) else 0


if __name__ == "__main__":
    sys.exit(main())
