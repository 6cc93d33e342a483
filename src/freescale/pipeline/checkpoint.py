"""Atomic, re-shardable checkpoints of a training run (``torch.distributed.checkpoint``).

Owns :func:`save_checkpoint`, :func:`load_checkpoint`, :func:`resolve_checkpoint`,
:class:`CheckpointHook` (save every N steps from inside ``Trainer.train``) and
:class:`CheckpointError`. It reads and writes the trainer's state through public
attributes only (``sparse.weight`` / ``sparse.optimizer.state`` / ``sparse.plan``,
``dense``, ``optimizer``, ``step``, ``hooks``); it may not change the training loop,
the embedding schedule or the data path.

Layout of one checkpoint (``DIR/step_<N>``; ``DIR/latest`` names the newest complete one)::

    .metadata, __<rank>_0.distcp     DCP: every rank writes its own shards
    extra_rank<r>.pt                 rank r: RNG states, dense optimizer param groups,
                                     state of hooks that have ``state_dict``
    meta.json                        format version, step, world size, config hash,
                                     tables and the global row range of every piece

DCP keys. Sharded tables and their fused optimizer state are saved as *pieces* keyed
by their global first row: ``sparse/<table>/<weight|state name>/<first row>``, one per
rank that owns rows (the row-wise plan's ranges, listed in ``meta.json``). Loading
with any world size, every rank reads the pieces that overlap its new row range and
copies the overlap, so a 2-rank checkpoint resumes on 4 ranks (or 1). The dense model
(``dense/<name>``) and the dense Adam state (``dense_optim/<param index>/<name>``) are
replicated: every rank offers them and DCP's de-duplication writes each once.

Atomicity. Deferred (prioritized) updates are flushed first. Everything is written to
``DIR/step_<N>.tmp``; only after every rank reported success (one all-reduce) does
rank 0 write ``meta.json``, rename the directory to ``step_<N>`` and replace
``latest`` (temp file + ``os.replace``). A crash or exception at any point before the
rename leaves the previous checkpoint and ``latest`` untouched; a stale ``.tmp`` is
ignored by loading and removed by the next save of that step. All ranks agree on
success or failure at every stage (no rank is left inside a collective), and errors
name the rank and the piece. Checkpoint directories must be on a file system all
ranks share.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .trainer import Trainer, TrainerHook

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointHook",
    "save_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
]

FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_META = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names rank and piece."""


# ----------------------------------------------------------------- helpers
def _agree(trainer: Trainer, err: BaseException | None, what: str) -> None:
    """One all-reduce of failure flags: every rank raises if any rank failed ``what``."""
    w, r = trainer.world_size, trainer.rank
    bad = [r] if err is not None else []
    if w > 1:
        vec = torch.zeros(w, dtype=torch.float64)
        if err is not None:
            vec[r] = 1.0
        comm = trainer.meta_comm
        vec = comm.all_reduce(vec.to(comm.device), name=f"checkpoint:{what}").wait().cpu()
        bad = [i for i in range(w) if vec[i] > 0]
    if err is not None:
        if isinstance(err, CheckpointError):
            raise err
        raise CheckpointError(f"rank {r}: checkpoint {what} failed: {_describe(err)}") from err
    if bad:
        raise CheckpointError(
            f"rank {r}: checkpoint {what} failed on rank(s) {bad} (see the error there)"
        )


def _describe(err: BaseException) -> str:
    """One line per failing rank for DCP's aggregated exception, else ``Type: msg``."""
    failures = getattr(err, "failures", None)
    if isinstance(err, CheckpointException) and isinstance(failures, dict):
        parts = []
        for k, v in sorted(failures.items()):
            e = v[0] if isinstance(v, tuple) and v else v  # (exception, frames)
            parts.append(f"on rank {k}: {type(e).__name__}: {e}")
        return "; ".join(parts)
    return f"{type(err).__name__}: {err}"


def _piece_key(table: str, name: str, lo: int) -> str:
    return f"sparse/{table}/{name}/{lo}"


def _sparse_named(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The shard tensors sliced per table: ``weight`` and every optimizer state."""
    return {"weight": trainer.sparse.weight, **trainer.sparse.optimizer.state}


def _stateful_hooks(trainer: Trainer) -> list[tuple[int, Any]]:
    return [
        (i, h)
        for i, h in enumerate(trainer.hooks)
        if callable(getattr(h, "state_dict", None))
        and callable(getattr(h, "load_state_dict", None))
    ]


def _rng_state(device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _complete_steps(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = _STEP_RE.match(name)
        if m and os.path.isfile(os.path.join(directory, name, _META)):
            out.append(int(m.group(1)))
    return sorted(out)


# -------------------------------------------------------------------- save
def save_checkpoint(
    trainer: Trainer,
    directory: str,
    step: int | None = None,
    keep: int | None = None,
) -> str:
    """Write a checkpoint of ``trainer`` to ``directory/step_<step>`` (collective: call on
    every rank). ``step`` defaults to ``trainer.step`` (pass it from hooks that run
    before the trainer counts the step, e.g. ``after_optimizer``). ``keep``: after a
    successful save, delete all but the newest ``keep`` complete checkpoints. Returns
    the checkpoint's path. Raises :class:`CheckpointError` on every rank if any rank
    failed; the previous checkpoint then stays the ``latest``."""
    step = trainer.step if step is None else int(step)
    rank, world = trainer.rank, trainer.world_size
    directory = os.path.abspath(directory)
    final = os.path.join(directory, f"step_{step}")
    tmp = final + ".tmp"
    trainer.flush()  # deferred (prioritized) updates belong to this checkpoint
    trainer._sync()

    # 1. rank 0 prepares a clean temporary directory
    err: BaseException | None = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except Exception as e:  # noqa: BLE001 - reported to every rank
            err = e
    _agree(trainer, err, f"preparing {tmp}")

    # 2. every rank: its own extras file, then the DCP write (collective)
    sparse, plan = trainer.sparse, trainer.sparse.plan
    state: dict[str, torch.Tensor] = {}
    for ti, t in enumerate(plan.tables):
        lo, hi = plan.row_range(ti)
        off = plan.local_offset[ti]
        if hi > lo:
            for name, full in _sparse_named(trainer).items():
                state[_piece_key(t.name, name, lo)] = full[off : off + hi - lo].detach()
    for k, v in trainer.dense.state_dict().items():
        state[f"dense/{k}"] = v.detach()
    opt_sd = trainer.optimizer.state_dict()
    for idx, st in opt_sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                state[f"dense_optim/{idx}/{name}"] = v.detach()
    extras = {
        "rank": rank,
        "rng": _rng_state(trainer.device),
        "dense_optim_param_groups": opt_sd["param_groups"],
        "dense_optim_scalars": {
            idx: {n: v for n, v in st.items() if not isinstance(v, torch.Tensor)}
            for idx, st in opt_sd["state"].items()
        },
        "hooks": [
            {"index": i, "class": type(h).__name__, "state": h.state_dict()}
            for i, h in _stateful_hooks(trainer)
        ],
    }
    err = None
    try:
        torch.save(extras, os.path.join(tmp, f"extra_rank{rank}.pt"))
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(trainer, err, f"writing extra_rank{rank}.pt")
    err = None
    try:
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=world == 1)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - raised on every rank
        err = e
    _agree(trainer, err, f"DCP write of step {step}")

    # 3. rank 0 commits: meta.json, rename, latest
    err = None
    if rank == 0:
        try:
            meta = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "world_size": world,
                "config_hash": trainer.config_hash,
                "mode": trainer.cfg.mode,
                "dtype": str(sparse.dtype),
                "sparse_optim": trainer.cfg.sparse_optim.kind,
                "sparse_state": sorted(sparse.optimizer.state),
                "tables": [
                    {
                        "name": t.name,
                        "rows": t.num_embeddings,
                        "dim": t.embedding_dim,
                        "pieces": [
                            list(plan.row_range(ti, r))
                            for r in range(world)
                            if plan.row_range(ti, r)[1] > plan.row_range(ti, r)[0]
                        ],
                    }
                    for ti, t in enumerate(plan.tables)
                ],
                "dense_keys": sorted(trainer.dense.state_dict()),
                "hooks": [type(h).__name__ for _, h in _stateful_hooks(trainer)],
                "torch": torch.__version__,
                "time": time.time(),
            }
            _write_atomic(os.path.join(tmp, _META), json.dumps(meta, indent=1) + "\n")
            _fsync_dir(tmp)
            old = None
            if os.path.exists(final):  # re-saving a step: move the old one aside first
                old = f"{final}.old.{os.getpid()}"
                os.rename(final, old)
            os.rename(tmp, final)
            _fsync_dir(directory)
            _write_atomic(os.path.join(directory, "latest"), f"step_{step}\n")
            _fsync_dir(directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            if keep is not None and keep > 0:
                for s in _complete_steps(directory)[:-keep]:
                    if s != step:
                        shutil.rmtree(os.path.join(directory, f"step_{s}"), ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            err = e
    _agree(trainer, err, f"commit of {final}")
    return final


# -------------------------------------------------------------------- load
def resolve_checkpoint(path: str, rank: int = 0) -> str:
    """The complete checkpoint ``path`` names: a ``step_<N>`` directory itself, else the
    one ``path/latest`` names, else the highest complete ``path/step_<N>``."""
    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, _META)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        cand = os.path.join(path, name)
        if not os.path.isfile(os.path.join(cand, _META)):
            raise CheckpointError(
                f"rank {rank}: {latest} names '{name}', which is not a complete checkpoint "
                f"(no {os.path.join(cand, _META)})"
            )
        return cand
    steps = _complete_steps(path)
    if not steps:
        raise CheckpointError(f"rank {rank}: no complete checkpoint in {path}")
    return os.path.join(path, f"step_{steps[-1]}")


def _check_meta(trainer: Trainer, meta: dict[str, Any], where: str, strict: bool) -> None:
    r = trainer.rank
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"rank {r}: {where} has format version {meta.get('format_version')}, this "
            f"FreeScale reads {FORMAT_VERSION}"
        )
    sparse = trainer.sparse
    if meta["dtype"] != str(sparse.dtype):
        raise CheckpointError(
            f"rank {r}: {where} holds {meta['dtype']} tables, the trainer uses {sparse.dtype}"
        )
    if sorted(sparse.optimizer.state) != meta["sparse_state"]:
        raise CheckpointError(
            f"rank {r}: {where} holds sparse optimizer state {meta['sparse_state']} "
            f"({meta['sparse_optim']}), the trainer has {sorted(sparse.optimizer.state)} "
            f"({trainer.cfg.sparse_optim.kind})"
        )
    saved = {t["name"]: t for t in meta["tables"]}
    for t in sparse.plan.tables:
        s = saved.get(t.name)
        if s is None:
            raise CheckpointError(f"rank {r}: table '{t.name}' is missing from {where}")
        if (s["rows"], s["dim"]) != (t.num_embeddings, t.embedding_dim):
            raise CheckpointError(
                f"rank {r}: table '{t.name}' is {s['rows']}x{s['dim']} in {where}, "
                f"{t.num_embeddings}x{t.embedding_dim} in the trainer"
            )
        cover = 0
        for lo, hi in sorted(s["pieces"]):
            if lo != cover:
                raise CheckpointError(
                    f"rank {r}: the pieces of table '{t.name}' in {where} do not tile its rows "
                    f"(gap or overlap at row {cover})"
                )
            cover = hi
        if cover != t.num_embeddings:
            raise CheckpointError(
                f"rank {r}: the pieces of table '{t.name}' in {where} end at row {cover} "
                f"of {t.num_embeddings}"
            )
    extra = set(saved) - {t.name for t in sparse.plan.tables}
    if extra:
        raise CheckpointError(f"rank {r}: {where} has tables {sorted(extra)} the trainer lacks")
    if meta["config_hash"] != trainer.config_hash:
        msg = (
            f"rank {r}: {where} was written with config hash {meta['config_hash']}, the "
            f"trainer has {trainer.config_hash}"
        )
        if strict:
            raise CheckpointError(msg)
        warnings.warn(msg + " (shapes match; resuming anyway)", stacklevel=3)


def load_checkpoint(trainer: Trainer, path: str, strict_config: bool = False) -> int:
    """Restore ``trainer`` from the checkpoint ``path`` names (see
    :func:`resolve_checkpoint`); collective. Any world size: tables and their
    optimizer state are re-sharded to the trainer's plan. Returns the restored step;
    ``trainer.train(cfg.steps - step)`` then continues the run. ``strict_config``:
    a different config hash is an error (default: a warning when shapes match).

    Hook states are loaded right away when the hook accepts them, else (e.g. a
    ``BalanceHook``, whose planner is built in ``on_train_start``) at the start of the
    next ``train()``."""
    rank = trainer.rank
    trainer.flush()  # pending deferred updates would otherwise land on the loaded rows
    err: BaseException | None = None
    ckpt, meta, reader, want, extras = "", {}, None, {}, {}
    try:
        ckpt = resolve_checkpoint(path, rank)
        with open(os.path.join(ckpt, _META)) as f:
            meta = json.load(f)
        _check_meta(trainer, meta, ckpt, strict_config)
        reader = FileSystemReader(ckpt)
        md = reader.read_metadata().state_dict_metadata
        want = _load_targets(trainer, meta, md, ckpt)
        src = rank if rank < meta["world_size"] else 0
        ex_path = os.path.join(ckpt, f"extra_rank{src}.pt")
        if not os.path.isfile(ex_path):
            raise CheckpointError(f"rank {rank}: {ex_path} is missing")
        extras = torch.load(ex_path, weights_only=False)
    except Exception as e:  # noqa: BLE001 - reported to every rank
        err = e
    _agree(trainer, err, f"reading {ckpt or path}")
    step = torch.tensor([float(meta["step"]), -float(meta["step"])], dtype=torch.float64)
    if trainer.world_size > 1:
        comm = trainer.meta_comm
        step = comm.all_reduce(step.to(comm.device), dist.ReduceOp.MAX, "checkpoint:step").wait()
        step = step.cpu()
    if float(step[0]) != -float(step[1]):
        raise CheckpointError(
            f"rank {rank}: ranks resolved {path} to different checkpoints (steps "
            f"{-float(step[1]):.0f}..{float(step[0]):.0f}); is a save still running?"
        )
    err = None
    try:
        dcp.load(want, storage_reader=reader, no_dist=trainer.world_size == 1)
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        err = e
    _agree(trainer, err, f"DCP read of {ckpt}")
    err = None
    try:
        _apply(trainer, meta, want, extras)
    except Exception as e:  # noqa: BLE001
        err = e
    _agree(trainer, err, f"restoring {ckpt}")
    return trainer.step


def _load_targets(
    trainer: Trainer, meta: dict[str, Any], md: dict[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """Empty CPU tensors, shaped as in the checkpoint, for every key this rank reads."""
    rank = trainer.rank

    def target(key: str) -> torch.Tensor:
        m = md.get(key)
        if m is None or not hasattr(m, "size"):
            raise CheckpointError(f"rank {rank}: piece '{key}' is missing from {where}")
        return torch.empty(tuple(m.size), dtype=m.properties.dtype)

    want: dict[str, torch.Tensor] = {}
    plan = trainer.sparse.plan
    saved = {t["name"]: t for t in meta["tables"]}
    names = list(_sparse_named(trainer))
    for ti, t in enumerate(plan.tables):
        lo, hi = plan.row_range(ti)
        for plo, phi in saved[t.name]["pieces"]:
            if plo < hi and lo < phi:
                for name in names:
                    want[_piece_key(t.name, name, plo)] = target(_piece_key(t.name, name, plo))
    for k, v in trainer.dense.state_dict().items():
        want[f"dense/{k}"] = target(f"dense/{k}")
        if tuple(want[f"dense/{k}"].shape) != tuple(v.shape):
            raise CheckpointError(
                f"rank {rank}: dense '{k}' is {tuple(want[f'dense/{k}'].shape)} in {where}, "
                f"{tuple(v.shape)} in the trainer"
            )
    for key in md:
        if key.startswith("dense_optim/"):
            want[key] = target(key)
    return want


@torch.no_grad()
def _apply(
    trainer: Trainer, meta: dict[str, Any], got: dict[str, torch.Tensor], extras: dict
) -> None:
    sparse, plan = trainer.sparse, trainer.sparse.plan
    named = _sparse_named(trainer)
    saved = {t["name"]: t for t in meta["tables"]}
    for ti, t in enumerate(plan.tables):
        lo, hi = plan.row_range(ti)
        off = plan.local_offset[ti]
        for plo, phi in saved[t.name]["pieces"]:
            a, b = max(lo, plo), min(hi, phi)
            if a >= b:
                continue
            for name, full in named.items():
                piece = got[_piece_key(t.name, name, plo)]
                full[off + a - lo : off + b - lo].copy_(piece[a - plo : b - plo])
    for k, v in trainer.dense.state_dict().items():
        v.copy_(got[f"dense/{k}"])
    state: dict[int, dict[str, Any]] = {}
    for key, v in got.items():
        if key.startswith("dense_optim/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = v
    for idx, sc in extras.get("dense_optim_scalars", {}).items():
        state.setdefault(int(idx), {}).update(sc)
    trainer.optimizer.load_state_dict(
        {"state": state, "param_groups": extras["dense_optim_param_groups"]}
    )
    _set_rng_state(extras["rng"], trainer.device)
    hooks = _stateful_hooks(trainer)
    saved_hooks = extras.get("hooks", [])
    if [type(h).__name__ for _, h in hooks] != [s["class"] for s in saved_hooks]:
        raise CheckpointError(
            f"rank {trainer.rank}: the checkpoint holds state of hooks "
            f"{[s['class'] for s in saved_hooks]}, the trainer has stateful hooks "
            f"{[type(h).__name__ for _, h in hooks]}"
        )
    for (_, h), s in zip(hooks, saved_hooks):
        if getattr(h, "planner", True) is None:  # BalanceHook before on_train_start
            trainer.hooks.append(_RestoreAtStart(h, s["state"]))
        else:
            h.load_state_dict(s["state"])
    trainer.step = int(meta["step"])
    sparse.set_step(trainer.step + 1)


class _RestoreAtStart(TrainerHook):
    """Loads a hook's state once that hook's ``on_train_start`` has run (hooks run in
    list order and this one is appended after it)."""

    def __init__(self, hook: Any, state: Any) -> None:
        self.hook, self.state = hook, state

    def on_train_start(self, trainer: Trainer) -> None:
        if self.state is not None:
            self.hook.load_state_dict(self.state)
            self.state = None


# -------------------------------------------------------------------- hook
class CheckpointHook(TrainerHook):
    """Saves a checkpoint every ``every`` steps (after the optimizer of step t, t % every
    == 0; ``every=0``: none during training) and, with ``final``, at the end of
    ``train()``. Keeps the newest ``keep``."""

    def __init__(
        self, directory: str, every: int, keep: int | None = 3, final: bool = True
    ) -> None:
        if every < 0 or (every == 0 and not final):
            raise ValueError(
                f"checkpoint every must be >= 1 (or 0 with final=True: at the end only), "
                f"got {every}"
            )
        self.directory, self.every, self.keep, self.final = directory, every, keep, final
        self.last_saved: int | None = None

    def after_optimizer(self, trainer: Trainer, step: int) -> None:
        if self.every and step % self.every == 0:
            save_checkpoint(trainer, self.directory, step=step, keep=self.keep)
            self.last_saved = step

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        if self.final and self.last_saved != trainer.step:
            save_checkpoint(trainer, self.directory, keep=self.keep)
            self.last_saved = trainer.step
