"""``freescale`` command line: ``train``, ``simulate``, ``bench``.

Owns flag parsing into typed configs and process launching through torch's own
launcher: ``freescale train --nproc N`` starts N local ranks with
``torch.distributed.launcher.api.elastic_launch`` (what torchrun uses); under torchrun
(RANK / WORLD_SIZE already set) it runs the rank directly, which is how multi-node
jobs start (``torchrun --nnodes ... -m freescale.cli train ...``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import uuid
from typing import Any

from .config import DataConfig, ModelConfig, SparseOptimConfig, TrainConfig

__all__ = ["main", "build_train_config", "run_rank"]

# The embedded default of ``freescale train``: 2 CPU ranks (or one per GPU), synthetic
# skewed UIH; about two minutes on a 2-core CPU.
DEFAULT_STEPS = 400


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="local ranks (default: one per GPU, else 2 CPU ranks)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help="total steps of the run (a resumed run trains the remaining ones)",
    )
    p.add_argument(
        "--resume",
        default=None,
        help="checkpoint root (follows 'latest') or a step_N folder to resume from",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="write checkpoints here: at the end of training, and every --checkpoint-every steps",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=0,
        help="steps between checkpoints (needs --checkpoint-dir; 0: at the end only)",
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per step over all ranks (default 64 per rank on CPU, 128 per rank on GPU)",
    )
    p.add_argument("--source", choices=["synthetic", "movielens"], default="synthetic")
    p.add_argument("--data-path", default=None, help="MovieLens-format file")
    p.add_argument("--num-items", type=int, default=None)
    p.add_argument("--max-uih", type=int, default=None)
    p.add_argument("--median-uih", type=int, default=None)
    p.add_argument("--length-dist", choices=["lognormal", "powerlaw"], default=None)
    p.add_argument("--num-candidates", type=int, default=None)
    p.add_argument("--zipf-s", type=float, default=None, help="item popularity exponent")
    p.add_argument("--embedding-dim", type=int, default=None)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--num-heads", type=int, default=None)
    p.add_argument("--attention", choices=["auto", "reference", "sdpa", "flex"], default="auto")
    p.add_argument(
        "--attention-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="attention compute dtype (auto: bfloat16 for flex on CUDA, else the model's)",
    )
    p.add_argument(
        "--sparse-optim", choices=["sgd", "rowwise_adagrad", "adam"], default="rowwise_adagrad"
    )
    p.add_argument("--sparse-lr", type=float, default=None)
    p.add_argument("--dense-lr", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--eval-samples", type=int, default=None)
    p.add_argument(
        "--mode",
        choices=["vanilla", "sdd", "prioritized", "freescale"],
        default="vanilla",
        help="embedding schedule (sdd: ids of t+1 ahead; prioritized: DESIGN.md 2.2; both "
        "bitwise equal to vanilla); freescale = prioritized + --balance sticky on a "
        "cost model refitted every 20 steps + --overlap-backend auto unless those flags "
        "say otherwise",
    )
    p.add_argument(
        "--overlap-backend",
        choices=["default", "auto", "host_staged", "copy_engine"],
        default=None,
        help="backend of the overlapped embedding traffic (sdd / prioritized): default = "
        "a side group of the main backend; auto = SM-free by topology (copy engine in a "
        "node on CUDA, host-staged otherwise)",
    )
    p.add_argument(
        "--timing",
        choices=["sync", "events"],
        default="sync",
        help="stage timing: sync (exact stage times, serialises the GPU at stage "
        "boundaries) or events (CUDA events read a step later; for throughput)",
    )
    p.add_argument(
        "--defer-metrics",
        action="store_true",
        help="with --timing events: finish each step's record (stage-times all-gather, "
        "hooks, log) one step later still, so the all-gather is not a per-step host "
        "barrier between the ranks. Same numerics",
    )
    p.add_argument(
        "--copy-engine-completion",
        choices=["auto", "host", "device"],
        default="auto",
        help="how the copy engine (SM-free overlap backend) completes a collective: host "
        "(its worker waits for the GPU) or device (CUDA inter-process events, no host "
        "wait); auto = $FREESCALE_COPY_ENGINE_COMPLETION, else device. Bit-identical",
    )
    p.add_argument(
        "--copy-engine-handshake",
        choices=["auto", "shm", "gloo"],
        default="auto",
        help="how the copy engine's per-collective handshakes travel: shm (a shared-memory "
        "file for the host's ranks) or gloo (two gloo collectives per call); auto = "
        "$FREESCALE_COPY_ENGINE_HANDSHAKE, else shm where available. Bit-identical",
    )
    p.add_argument(
        "--gil-switch-interval-ms",
        type=float,
        default=None,
        help="Python's thread switch interval while training, ms (default: the "
        "interpreter's, 5 ms): how long the training thread may wait for the interpreter "
        "lock behind the data-stage and communicator threads",
    )
    p.add_argument(
        "--stall-dump-s",
        type=float,
        default=0.0,
        help="debugging hangs: if no step finishes within this many seconds, print every "
        "thread's Python stack to stderr (once per stall; 0 = off)",
    )
    p.add_argument(
        "--gil-probe-ms",
        type=float,
        default=0.0,
        help="measure that wait over the timed steps: a probe thread wakes every this "
        "many ms and records how late it runs (0 = off; summary line 'GIL wait')",
    )
    p.add_argument(
        "--pin-threads",
        action="store_true",
        help="pin this rank's host threads by role: training and autograd threads a "
        "physical core each, data stage and loader a CPU each, the rest the other cores "
        "of the rank's share (Linux; summary line 'placement')",
    )
    p.add_argument(
        "--late-prepare",
        action="store_true",
        help="prioritized: run the gradient-free part of the backward when the dense "
        "backward reaches the embeddings, not between the forward and loss.backward() "
        "(TrainConfig.early_prepare=False; same bits)",
    )
    p.add_argument(
        "--sparse-update",
        choices=["auto", "sync", "padded", "ahead"],
        default="auto",
        help="owner's sparse update: ahead (rows grouped in the forward, the count read "
        "in the backward from a copy made then; auto on CUDA), padded (one slot per id, "
        "no read-back) or sync (reads the row count back; auto on CPU). Bit-identical",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile the last N steps: GPU compute / communication / bubble per step",
    )
    p.add_argument(
        "--profile-activities",
        choices=["auto", "cpu_cuda", "cuda"],
        default="auto",
        help="what the profiled steps record: cpu_cuda (host ops, stage ranges, GPU "
        "kernels; auto) or cuda (GPU activity only: what the accounting reads, with less "
        "host cost per op)",
    )
    p.add_argument(
        "--trace-dir", default=None, help="keep each rank's Chrome trace here (Perfetto)"
    )
    p.add_argument(
        "--host-counts",
        choices=["auto", "on", "off"],
        default="auto",
        help="count the id dist's split sizes on the host one step ahead (auto: on with CUDA)",
    )
    p.add_argument(
        "--data-thread",
        choices=["auto", "on", "off"],
        default="auto",
        help="run the data stage (input agreement, balancing, id counts) of the next steps "
        "on a background thread (auto: on with CUDA)",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch intra-op threads per rank (default: OMP_NUM_THREADS if set, else the "
        "machine's cores / local ranks / 2, at most 8)",
    )
    p.add_argument(
        "--max-collision-rate",
        type=float,
        default=0.9,
        help="prioritized guardrail: above this occurrence share, run synchronously",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--log", default=None, help="JSON-lines log path (rank 0)")
    p.add_argument("--summary", default=None, help="write the final summary JSON here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    from .balance.hook import add_balance_flags

    add_balance_flags(p)


def resolve_launch(args: argparse.Namespace) -> tuple[bool, bool]:
    """(running under torchrun, training on GPUs); fills ``args.nproc`` when unset: the
    torchrun world size, else one rank per GPU, else 2 CPU ranks."""
    import torch

    in_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.nproc is None:
        args.nproc = (
            int(os.environ["WORLD_SIZE"])
            if in_torchrun
            else (torch.cuda.device_count() if gpu else 2)
        )
    return in_torchrun, gpu


def local_ranks(nproc: int, in_torchrun: bool) -> int:
    """Ranks on this host: torchrun's LOCAL_WORLD_SIZE, else ``nproc``."""
    if in_torchrun:
        return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    return nproc


def resolve_mode(args: argparse.Namespace) -> None:
    """``--mode freescale``: every technique on (prioritized updates, balancing, SM-free
    overlapped traffic), each overridable by its own flag. The balancer, unless
    ``--balance`` names one: ``sticky`` on the cost model refitted every 20 steps
    (``balance.hook.FREESCALE_PARTITIONER`` / ``FREESCALE_REFIT_EVERY``; a
    ``--balance-cost-model`` or ``--balance-refit-every`` given keeps its value, and
    ``--balance-autotune`` plans on ``L^alpha`` instead). Those plans depend on measured
    times, so with ``--log PATH`` and no ``--balance-log`` they are logged (compact) to
    PATH's stem + ``.plans.jsonl``: ``--balance-replay`` on that file reproduces them."""
    if getattr(args, "mode", None) != "freescale":
        return
    from .balance.hook import FREESCALE_PARTITIONER, FREESCALE_REFIT_EVERY

    args.mode = "prioritized"
    if getattr(args, "balance", None) is None:
        args.balance = FREESCALE_PARTITIONER
        if (
            getattr(args, "balance_refit_every", None) is None
            and not getattr(args, "balance_cost_model", None)
            and not getattr(args, "balance_autotune", False)
        ):
            args.balance_refit_every = FREESCALE_REFIT_EVERY
            # its plans depend on measured times (DESIGN.md 2.1: log every plan, replay
            # on resume): next to the run log when there is one, compact
            log = getattr(args, "log", None)
            if log and getattr(args, "balance_log", None) is None:
                args.balance_log = os.path.splitext(log)[0] + ".plans.jsonl"
                if getattr(args, "balance_log_detail", None) is None:
                    args.balance_log_detail = "compact"
    if getattr(args, "overlap_backend", None) is None:
        args.overlap_backend = "auto"


def build_train_config(args: argparse.Namespace, gpu: bool) -> TrainConfig:
    nproc = args.nproc or 1
    per_rank = 128 if gpu else 32
    data = DataConfig(
        source=args.source,
        path=args.data_path,
        seed=args.data_seed,
        global_batch_size=args.global_batch_size or per_rank * nproc,
    )
    if gpu:  # long-UIH default on GPUs
        data.num_items, data.max_uih, data.median_uih = 1_000_000, 16_384, 1024
    for flag, attr in [
        ("num_items", "num_items"),
        ("max_uih", "max_uih"),
        ("median_uih", "median_uih"),
        ("length_dist", "length_dist"),
        ("num_candidates", "num_candidates"),
        ("zipf_s", "zipf_s"),
        ("eval_samples", "eval_samples"),
    ]:
        v = getattr(args, flag)
        if v is not None:
            setattr(data, attr, v)
    model = ModelConfig(
        attention=args.attention, attention_dtype=getattr(args, "attention_dtype", "auto")
    )
    if gpu:
        model.embedding_dim, model.num_heads = 128, 4
    for flag in ("embedding_dim", "num_layers", "num_heads"):
        v = getattr(args, flag)
        if v is not None:
            setattr(model, flag, v)
    sparse = SparseOptimConfig(kind=args.sparse_optim)
    if args.sparse_lr is not None:
        sparse.lr = args.sparse_lr
    cfg = TrainConfig(
        data=data,
        model=model,
        sparse_optim=sparse,
        steps=args.steps,
        seed=args.seed,
        device=args.device,
        log_path=args.log,
        progress=not args.no_progress,
        mode=args.mode,
        max_collision_rate=args.max_collision_rate,
        timing=args.timing,
        defer_metrics=getattr(args, "defer_metrics", False),
        sparse_update=getattr(args, "sparse_update", "auto"),
        copy_engine_completion=getattr(args, "copy_engine_completion", "auto"),
        copy_engine_handshake=getattr(args, "copy_engine_handshake", "auto"),
        early_prepare=not getattr(args, "late_prepare", False),
        gil_switch_interval_ms=getattr(args, "gil_switch_interval_ms", None),
        gil_probe_ms=getattr(args, "gil_probe_ms", 0.0),
        stall_dump_s=getattr(args, "stall_dump_s", 0.0),
        pin_threads=getattr(args, "pin_threads", False),
        overlap_backend=args.overlap_backend or "default",
        profile_steps=args.profile_steps,
        profile_activities=getattr(args, "profile_activities", "auto"),
        trace_dir=args.trace_dir,
        host_counts={"auto": None, "on": True, "off": False}[getattr(args, "host_counts", "auto")],
        cpu_threads=getattr(args, "cpu_threads", None),
        data_thread={"auto": None, "on": True, "off": False}[getattr(args, "data_thread", "auto")],
    )
    if args.dense_lr is not None:
        cfg.dense_lr = args.dense_lr
    cfg.eval_every = args.eval_every if args.eval_every is not None else max(args.steps // 2, 1)
    DataConfig.__post_init__(data)  # the flags were set after construction
    ModelConfig.__post_init__(model)
    return cfg


def check_devices(device: str, gpu: bool, local_ranks: int) -> None:
    """``--device cuda`` needs CUDA, and NCCL one GPU per local rank (two ranks on one
    GPU fail in NCCL's set-up): a ``ValueError`` naming the counts otherwise."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine")
    if gpu and local_ranks > torch.cuda.device_count():
        raise ValueError(
            f"{local_ranks} local ranks on CUDA need one GPU each; "
            f"{torch.cuda.device_count()} visible (CUDA_VISIBLE_DEVICES); pass "
            f"--nproc {torch.cuda.device_count()} or --device cpu"
        )


def check_checkpoint_flags(directory: str | None, every: int) -> None:
    """``--checkpoint-every`` alone would save nothing: it needs ``--checkpoint-dir``."""
    if every < 0:
        raise ValueError(f"--checkpoint-every must be >= 0, got {every}")
    if every and not directory:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to write them)")


def check_resume(resume: str | None, checkpoint_dir: str | None) -> None:
    """``--resume`` must exist, except when it is this run's own ``--checkpoint-dir``
    (one command line for every attempt of an elastic job: the first starts fresh, see
    ``faults.resume_point``)."""
    if not resume or os.path.exists(resume):
        return
    if checkpoint_dir and os.path.abspath(resume) == os.path.abspath(checkpoint_dir):
        return
    raise ValueError(f"--resume {resume!r} does not exist")


def check_launch(cfg: TrainConfig, world_size: int) -> None:
    """What every rank would find wrong at its first step, found before any rank starts
    (``ValueError`` naming the value): the global batch must split evenly over the
    ranks (contiguous placement, DESIGN.md section 1), and a MovieLens source needs an
    existing file or folder."""
    gb = cfg.data.global_batch_size
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    if gb % world_size:
        raise ValueError(
            f"--global-batch-size {gb} is not divisible by the {world_size} ranks; "
            f"choose a multiple of {world_size} (e.g. {max(1, gb // world_size) * world_size})"
        )
    if cfg.data.source == "movielens":
        if not cfg.data.path:
            raise ValueError("--source movielens needs --data-path (a MovieLens-format file)")
        if not os.path.exists(cfg.data.path):
            raise ValueError(f"--data-path {cfg.data.path!r} does not exist")


def _cfg_from_dict(d: dict[str, Any]) -> TrainConfig:
    from .config import TableConfig

    d = dict(d)
    data = DataConfig(**d.pop("data"))
    model = ModelConfig(**d.pop("model"))
    sparse = SparseOptimConfig(**d.pop("sparse_optim"))
    tables = d.pop("tables")
    tables = [TableConfig(**t) for t in tables] if tables else None
    return TrainConfig(data=data, model=model, sparse_optim=sparse, tables=tables, **d)


def run_rank(
    cfg_dict: dict[str, Any],
    summary_path: str | None,
    timeout: float,
    balance: Any = None,
    resume: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
) -> dict:
    """Entry point of one rank (module level so the launcher can pickle it).
    ``balance``: a picklable ``BalanceConfig`` (load balancing on) or None."""
    import torch.distributed as dist

    from .pipeline import faults
    from .pipeline.distributed import init_distributed
    from .pipeline.trainer import Trainer

    cfg = _cfg_from_dict(cfg_dict)
    restarted = faults.init_after_elastic_restart(cfg.device, timeout)  # torchrun restarts
    ctx = init_distributed(cfg.device, timeout_s=timeout)
    try:
        hooks = []
        if balance is not None:
            from .balance.hook import BalanceHook

            hooks.append(BalanceHook(balance))
        from .pipeline.checkpoint import CheckpointHook, load_checkpoint

        if checkpoint_dir:  # after the balancer (state order)
            hooks.append(CheckpointHook(checkpoint_dir, checkpoint_every))
        hooks.extend(faults.FaultInjector.all_from_env())  # test-only, FREESCALE_FAULT_*
        trainer = Trainer(cfg, ctx=ctx, hooks=hooks)
        monitor = faults.install(trainer, timeout)  # collective timeouts, lost ranks
        try:
            resume = faults.resume_point(resume, checkpoint_dir)
            if resume:
                load_checkpoint(trainer, resume)
                if trainer.step >= cfg.steps and ctx.rank == 0:
                    print(
                        f"freescale train: resumed at step {trainer.step}, --steps is "
                        f"{cfg.steps}: nothing left to train (--steps is the run's total)",
                        flush=True,
                    )
            summary = trainer.train(max(cfg.steps - trainer.step, 0))
        except Exception as e:
            clear = monitor.explain(e)
            if clear is not None:
                raise clear from e
            raise
        finally:
            monitor.close()
        trainer.close()
        if ctx.rank == 0:
            _print_summary(summary)
            if summary_path:  # its folder made, as --log's is
                os.makedirs(os.path.dirname(os.path.abspath(summary_path)), exist_ok=True)
                with open(summary_path, "w") as f:
                    json.dump({"summary": summary, "config": cfg_dict}, f, indent=2, default=float)
        return summary
    finally:
        if (ctx.owns_group or restarted) and dist.is_initialized():
            dist.destroy_process_group()


def _print_summary(s: dict[str, Any]) -> None:
    print("\n=== FreeScale summary ===")
    print(f"ranks {s['world_size']} ({s['backend']}, {s['device']}), steps {s['steps']}")
    print(f"QPS (samples/s, after warm-up): {s['qps']:.1f}")
    if "eval_ne" in s:
        print(
            f"eval NE {s['eval_ne']:.4f}   oracle NE {s['oracle_ne']:.4f}   "
            f"gap closed {s.get('ne_gap_closed', float('nan')):.1%}   AUC {s['eval_auc']:.4f}"
        )
    print(f"straggler share (median over steps): {s['straggler_share_median']:.3f}")
    stages = ", ".join(f"{k} {v:.1f}" for k, v in s["stage_ms"].items())
    print(f"stage ms (rank 0, mean): {stages}")
    hc = s.get("host_cpu")
    if hc:
        groups = ", ".join(f"{k} {v:.1f}" for k, v in hc["by_group_ms_per_step"].items())
        print(
            f"host CPU ms per step (rank 0): {groups}; process {hc['process_cpu_ms_per_step']:.1f}"
            f" over {hc['wall_ms_per_step']:.1f} wall (cpu/wall {hc['cpu_over_wall']:.2f})"
        )
        gw = hc.get("gil_wait")
        if gw:
            print(
                f"GIL wait (rank 0, probe every {gw['period_ms']:g} ms, {gw['wakes']} wakes): "
                f"mean {gw['mean_ms']:.2f} ms, p50 {gw['p50_ms']:.2f}, p90 {gw['p90_ms']:.2f}, "
                f"p99 {gw['p99_ms']:.2f}, max {gw['max_ms']:.1f}; "
                f"{gw['share_over_1ms']:.0%} of wakes over 1 ms"
            )
        cw = hc.get("host_wait_training")
        if cw is not None:
            top = sorted(cw.items(), key=lambda kv: -kv[1]["ms_per_step"])[:4]
            parts = ", ".join(f"{k} {v['ms_per_step']:.2f}" for k, v in top)
            print(
                f"training thread blocked in collectives' wait() and device waits (rank 0): "
                f"{hc['host_wait_training_ms']:.2f} ms per step" + (f" ({parts})" if parts else "")
            )
    sf = s.get("smfree")
    if sf:
        notes = f" ({'; '.join(sf['notes'])})" if sf.get("notes") else ""
        proto = (
            f": completion {sf['completion']}, handshake {sf['handshake']}"
            if sf["backend"] == "copy_engine"
            else ""
        )
        print(f"{sf['backend']} (overlapped traffic){proto}{notes}")
    dt = (s.get("data_thread") or {}).get("timing")
    if dt and dt.get("prepared"):
        print(
            f"data-stage thread (rank 0, ms per step): busy {dt['busy_ms']:.1f}, "
            f"blocked ahead {dt['blocked_ms']:.1f}, gate {dt['gate_ms']:.1f}"
        )
    pl = s.get("placement")
    if pl:
        topo = pl.get("topology", {})
        line = (
            f"placement (rank 0; host {topo.get('physical_cores')} cores x {topo.get('smt')} SMT): "
        )
        if pl.get("pinned"):
            cpus = "; ".join(f"{k} {v}" for k, v in pl["cpus"].items())
            print(line + f"pinned: {cpus} (threads per role {pl['threads']})")
        else:
            print(line + "not pinned" + (f" ({'; '.join(pl['notes'])})" if pl["notes"] else ""))
    acc = s.get("gpu_accounting")
    if acc and acc.get("available"):
        print(
            f"GPU per step (mean over ranks, last {acc['profiled_steps']} steps): "
            f"window {acc['window_ms']:.2f} ms, compute {acc['compute_ms']:.2f}, "
            f"bubble {acc['bubble_ms']:.2f} (exposed comm {acc['exposed_comm_ms']:.2f}, "
            f"other idle {acc['other_idle_ms']:.2f})"
        )
    elif acc:
        print(f"GPU accounting: not available ({acc.get('reason')})")
    if acc and (acc.get("jit_compiles_in_window") or acc.get("dynamo_graphs_in_window")):
        kernels = ", ".join(acc.get("jit_kernels_in_window_this_rank") or {}) or "-"
        print(
            f"warning: compiles inside the profiled steps (largest over ranks): "
            f"{acc['jit_compiles_in_window']:.0f} Triton ({acc['jit_compile_s_in_window']:.2f} s;"
            f" rank 0: {kernels}), {acc.get('dynamo_graphs_in_window')} torch.compile graphs;"
            f" the host stalls for each, and the GPU numbers above count it as bubble"
        )
    if acc and acc.get("trace_dir"):
        print(f"traces (open in https://ui.perfetto.dev): {acc['trace_dir']}/trace_rank*.json")
    sys.stdout.flush()


def cmd_train(args: argparse.Namespace) -> int:

    in_torchrun, gpu = resolve_launch(args)
    resolve_mode(args)
    from .balance.hook import balance_config_from_args

    try:  # a bad flag combination: one line naming it, before any rank starts
        cfg = build_train_config(args, gpu)
        balance = balance_config_from_args(args)
        check_devices(args.device, gpu, local_ranks(args.nproc, in_torchrun))
        check_launch(cfg, int(os.environ["WORLD_SIZE"]) if in_torchrun else args.nproc)
        check_checkpoint_flags(args.checkpoint_dir, args.checkpoint_every)
        check_resume(args.resume, args.checkpoint_dir)
    except ValueError as e:
        print(f"freescale train: error: {e}", file=sys.stderr)
        return 2
    cfg_dict = json.loads(json.dumps(dataclasses.asdict(cfg)))
    rank_args = (
        cfg_dict,
        args.summary,
        args.timeout,
        balance,
        args.resume,
        args.checkpoint_dir,
        args.checkpoint_every,
    )
    if not (in_torchrun or args.nproc == 1):
        print(
            f"freescale train: launching {args.nproc} local ranks "
            f"({'NCCL, one GPU each' if gpu else 'gloo on CPU'})",
            flush=True,
        )
    return launch_local(run_rank, rank_args, args.nproc, in_torchrun)


def failure_summary(err: BaseException) -> str:
    """One line for a failed local launch: the root-cause rank, its exit code, and the
    last line of its error (``ValueError: ...``) or the signal that ended it."""
    first = getattr(err, "get_first_failure", None)
    if first is None:
        return f"{type(err).__name__}: {err}"
    rank, failure = first()
    message = failure.message
    if isinstance(message, dict):  # the error file of torch's @record handler
        message = message.get("message", "")
    lines = [ln.strip() for ln in str(message or "").splitlines() if ln.strip()]
    what = lines[-1] if lines else "no error message"
    if failure.exitcode < 0:  # torch makes up the message of a signal
        what = f"ended by {failure.signal_name()}"
    return f"rank {rank} failed (exit code {failure.exitcode}): {what}"


def launch_local(
    entrypoint: Any, entry_args: tuple, nproc: int, in_torchrun: bool, name: str = "freescale"
) -> int:
    """Run ``entrypoint(*entry_args)`` here (under torchrun, or one rank) or on ``nproc``
    local ranks through torch's elastic launcher (what torchrun uses). Returns the exit
    code: 0, or 1 when a local rank failed. Then torch's report (``ChildFailedError``,
    root cause rank) goes to stderr, its last line a one-line summary
    (:func:`failure_summary`); each rank's traceback is in the launcher's log above it."""
    if in_torchrun or nproc == 1:
        entrypoint(*entry_args)
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.5,
        start_method="spawn",
    )
    try:
        elastic_launch(lc, entrypoint=entrypoint)(*entry_args)
    except ChildFailedError as e:
        print(f"ChildFailedError: {e}", file=sys.stderr)
        print(f"{name}: {failure_summary(e)}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "simulate":  # the simulator parses its own flags
        from .balance.simulator import simulate_main

        return simulate_main(argv[1:])
    if argv[:2] == ["bench", "e2e"]:  # the benchmark parses its own flags
        from .pipeline.bench_e2e import bench_e2e_main

        return bench_e2e_main(argv[2:])
    parser = argparse.ArgumentParser(prog="freescale", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="train the reference model (default: synthetic)")
    _add_train_flags(p_train)
    sub.add_parser("simulate", help="straggler simulator (see balance/README.md)")
    sub.add_parser("bench", help="benchmarks: 'bench e2e --out DIR' (all modes side by side)")
    args = parser.parse_args(argv)
    if args.cmd == "train":
        return cmd_train(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
