"""MovieLens-format reader serving the same interface as the synthetic source.

Owns :func:`load_interactions` (parsers for three on-disk formats) and
:class:`MovieLensSource` (time-ordered histories per user, dense id maps, the held-out
split, and deterministic samples). It may not touch ranks, devices, tables or the
model; like the synthetic source, sample ``g`` of step ``t`` is a pure function of
``(cfg.seed, split, t, g)`` and of the file, never of rank or world size.

Formats (auto-detected from the file name, or pass ``fmt``):

* ``"inter"``: RecBole atomic file (``ml-100k.inter``): tab separated, a header of
  ``name:type`` fields such as ``user_id:token  item_id:token  rating:float
  timestamp:float``; columns are found by name, in any order.
* ``"dat"``: ML-1M ``ratings.dat``: ``UserID::MovieID::Rating::Timestamp``, no header.
* ``"sasrec"``: ``sasrec_format.csv`` written by generative-recommenders' MovieLens
  preprocessing: a header with ``user_id, sequence_item_ids, sequence_ratings,
  sequence_timestamps`` (plus ``index`` and, for ML-1M, user features, ignored), each
  sequence a comma-separated list in a quoted field, in time order.

No MovieLens data ships with FreeScale (its licence forbids redistribution); see
``docs/data.md`` for getting ML-100K locally.

Samples: every (user, cut) pair with ``1 <= cut < n_user`` is one possible sample;
sample ``(t, g)`` draws one of them uniformly (so each interaction is equally likely
to be a prediction point). UIH = the user's interactions before the cut, truncated to
the most recent ``cfg.max_uih``; candidates = the next ``cfg.num_candidates``
interactions (fewer at the end of the history: ``num_candidates`` varies per sample);
labels = ``rating >= positive_rating`` (4 by default). ``uih_action`` is the rating
bucket ``ceil(rating) - 1`` clipped to ``[0, 4]`` (5 actions). Held-out users
(``eval_fraction`` of users with >= 2 interactions, at least one, chosen by a seeded
hash of the dense user id) form split ``"eval"``; the others form ``"train"``.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import torch

from freescale.config import CANDIDATE_FEATURE, DataConfig
from freescale.data.batch import JaggedBatch
from freescale.data.synthetic import SPLITS, GlobalBatchSource, _draws, _key, _uniform

__all__ = ["MovieLensSource", "Interactions", "load_interactions", "detect_format", "FORMATS"]

FORMATS = ("inter", "dat", "sasrec")
NUM_RATING_ACTIONS = 5
_FILES = {"inter": "ml-100k.inter", "dat": "ratings.dat", "sasrec": "sasrec_format.csv"}
_STREAM_PICK = 11


@dataclass
class Interactions:
    """Raw interactions in file order (raw ids as read: int64 if all are integers,
    else strings)."""

    user: np.ndarray
    item: np.ndarray
    rating: np.ndarray  # float64
    timestamp: np.ndarray  # int64


def detect_format(path: str) -> tuple[str, str]:
    """``(format, file)`` for a file or a folder holding one of the known files."""
    if os.path.isdir(path):
        for fmt, name in _FILES.items():
            if os.path.isfile(os.path.join(path, name)):
                return fmt, os.path.join(path, name)
        inters = sorted(f for f in os.listdir(path) if f.endswith(".inter"))
        if inters:
            return "inter", os.path.join(path, inters[0])
        raise ValueError(f"no MovieLens-format file in {path} (looked for {list(_FILES.values())})")
    name = os.path.basename(path)
    if name.endswith(".inter"):
        return "inter", path
    if name.endswith(".dat"):
        return "dat", path
    if name.endswith(".csv"):
        return "sasrec", path
    raise ValueError(
        f"cannot tell the format of '{path}' from its name; pass fmt= one of {FORMATS}"
    )


def _ids(values: list[str]) -> np.ndarray:
    try:
        return np.array([int(v) for v in values], dtype=np.int64)
    except ValueError:
        return np.array(values, dtype=object)


def _read_inter(path: str) -> Interactions:
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        names = [h.split(":")[0].strip() for h in header]
        need = ("user_id", "item_id", "rating", "timestamp")
        missing = [n for n in need if n not in names]
        if missing:
            raise ValueError(f"{path}: header {header} lacks fields {missing}")
        cols = [names.index(n) for n in need]
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for i, r in enumerate(rows):
        if len(r) < len(names):
            raise ValueError(f"{path}:{i + 2}: expected {len(names)} fields, got {len(r)}")
    u, it, ra, ts = ([r[c] for r in rows] for c in cols)
    return Interactions(
        _ids(u), _ids(it), np.array(ra, dtype=np.float64), np.array(ts, float).astype(np.int64)
    )


def _read_dat(path: str) -> Interactions:
    u, it, ra, ts = [], [], [], []
    with open(path, encoding="latin-1") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            p = line.rstrip("\n").split("::")
            if len(p) != 4:
                raise ValueError(f"{path}:{i + 1}: expected UserID::MovieID::Rating::Timestamp")
            u.append(p[0])
            it.append(p[1])
            ra.append(p[2])
            ts.append(p[3])
    return Interactions(
        _ids(u), _ids(it), np.array(ra, dtype=np.float64), np.array(ts, float).astype(np.int64)
    )


def _split_list(s: str) -> list[str]:
    s = s.strip().strip("[]")
    return [v.strip() for v in s.split(",")] if s else []


def _read_sasrec(path: str) -> Interactions:
    u, it, ra, ts = [], [], [], []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        need = ("user_id", "sequence_item_ids", "sequence_ratings", "sequence_timestamps")
        missing = [n for n in need if n not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: columns {reader.fieldnames} lack {missing}")
        for row in reader:
            items = _split_list(row["sequence_item_ids"])
            ratings = _split_list(row["sequence_ratings"])
            times = _split_list(row["sequence_timestamps"])
            if not len(items) == len(ratings) == len(times):
                raise ValueError(
                    f"{path}: user {row['user_id']}: {len(items)} items, {len(ratings)} "
                    f"ratings, {len(times)} timestamps"
                )
            u.extend([row["user_id"]] * len(items))
            it.extend(items)
            ra.extend(ratings)
            ts.extend(times)
    return Interactions(
        _ids(u), _ids(it), np.array(ra, dtype=np.float64), np.array(ts, float).astype(np.int64)
    )


def load_interactions(path: str, fmt: str | None = None) -> Interactions:
    """Parse one MovieLens-format file (see module docstring for the formats)."""
    if fmt is None:
        fmt, path = detect_format(path)
    elif os.path.isdir(path):
        path = os.path.join(path, _FILES[fmt])
    if fmt not in FORMATS:
        raise ValueError(f"unknown MovieLens format '{fmt}' (one of {FORMATS})")
    return {"inter": _read_inter, "dat": _read_dat, "sasrec": _read_sasrec}[fmt](path)


class MovieLensSource(GlobalBatchSource):
    """Samples from MovieLens-format histories; same interface as SyntheticSource.

    Table sizes come from the file: use :attr:`num_items`, :attr:`num_actions`,
    :meth:`feature_rows` or :meth:`data_config` (a copy of ``cfg`` with them filled
    in), not ``cfg.num_items``.
    """

    uih_keys: list[str] = ["uih_item", "uih_action"]

    def __init__(
        self,
        cfg: DataConfig,
        path: str | None = None,
        *,
        fmt: str | None = None,
        eval_fraction: float = 0.1,
        positive_rating: float = 4.0,
        with_timestamps: bool = False,
    ) -> None:
        path = path if path is not None else cfg.path
        if path is None:
            raise ValueError("MovieLensSource needs a path (argument or DataConfig.path)")
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
        self.cfg = cfg
        self.path = path
        self.uih_keys = list(type(self).uih_keys)
        self.positive_rating = positive_rating
        self.with_timestamps = with_timestamps
        inter = load_interactions(path, fmt)
        if inter.user.size == 0:
            raise ValueError(f"{path}: no interactions")

        # dense ids (sorted raw ids -> 0..n-1); keep the maps
        self.user_raw_ids, user = np.unique(inter.user, return_inverse=True)
        self.item_raw_ids, item = np.unique(inter.item, return_inverse=True)
        self._item_index: dict[object, int] | None = None
        # time order per user (stable: ties keep file order)
        order = np.lexsort((np.arange(user.size), inter.timestamp, user))
        self.user = user[order].astype(np.int64)
        self.item = item[order].astype(np.int64)
        self.rating = inter.rating[order]
        self.timestamp = inter.timestamp[order]
        self.action = np.clip(np.ceil(self.rating) - 1, 0, NUM_RATING_ACTIONS - 1).astype(np.int64)
        self.label = (self.rating >= positive_rating).astype(np.float32)
        U = self.user_raw_ids.size
        counts = np.bincount(self.user, minlength=U)
        self.user_start = np.zeros(U + 1, dtype=np.int64)
        np.cumsum(counts, out=self.user_start[1:])
        self.user_count = counts.astype(np.int64)

        # held-out users among those with >= 2 interactions
        eligible = np.flatnonzero(counts >= 2)
        if eligible.size == 0:
            raise ValueError(f"{path}: no user has 2 or more interactions")
        seed = int(cfg.seed) & ((1 << 64) - 1)
        h = _draws(np.broadcast_to(_key(seed, 0xE1), eligible.shape), eligible)
        n_eval = 0
        if eval_fraction > 0 and eligible.size >= 2:
            n_eval = max(1, int(round(eval_fraction * eligible.size)))
        by_hash = eligible[np.argsort(h, kind="stable")]
        eval_users = np.sort(by_hash[:n_eval])
        train_users = np.sort(by_hash[n_eval:])
        self.split_users = {"train": train_users, "eval": eval_users}
        # (user, cut) pairs: cumulative counts of cuts per split user
        self._cuts = {}
        for sp, us in self.split_users.items():
            c = np.zeros(us.size + 1, dtype=np.int64)
            np.cumsum(self.user_count[us] - 1, out=c[1:])
            self._cuts[sp] = c
        self._base = {sp: _key(seed, sid, _STREAM_PICK) for sp, sid in SPLITS.items()}

    # ------------------------------------------------------------------ sizes and maps
    @property
    def num_items(self) -> int:
        return int(self.item_raw_ids.size)

    @property
    def num_actions(self) -> int:
        return NUM_RATING_ACTIONS

    @property
    def num_users(self) -> int:
        return int(self.user_raw_ids.size)

    @property
    def num_interactions(self) -> int:
        return int(self.item.size)

    def feature_rows(self) -> dict[str, int]:
        """Feature -> rows of its table (what :func:`validate_batch` checks against)."""
        return {
            "uih_item": self.num_items,
            "uih_action": self.num_actions,
            CANDIDATE_FEATURE: self.num_items,
        }

    def data_config(self) -> DataConfig:
        """``cfg`` with ``num_items`` / ``num_actions`` set to this file's table sizes."""
        return dataclasses.replace(
            self.cfg, source="movielens", num_items=self.num_items, num_actions=self.num_actions
        )

    def dense_item(self, raw: object) -> int:
        """Dense id of a raw item id (KeyError if unknown)."""
        if self._item_index is None:
            self._item_index = {v: i for i, v in enumerate(self.item_raw_ids.tolist())}
        return self._item_index[raw]

    def history(self, dense_user: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(items, ratings, timestamps) of one user, in time order (dense item ids)."""
        s, e = self.user_start[dense_user], self.user_start[dense_user + 1]
        return self.item[s:e], self.rating[s:e], self.timestamp[s:e]

    # ------------------------------------------------------------------ samples
    def pick(
        self, step: int, sample_ids: np.ndarray, split: str = "train"
    ) -> tuple[np.ndarray, np.ndarray]:
        """(dense user, cut) of samples ``sample_ids`` at ``step``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}' (one of {sorted(SPLITS)})")
        users, cuts = self.split_users[split], self._cuts[split]
        if users.size == 0:
            raise ValueError(f"split '{split}' has no users in {self.path}")
        g = np.asarray(sample_ids, dtype=np.int64)
        with np.errstate(over="ignore"):
            k = self._base[split] + np.uint64((step + 1) & ((1 << 64) - 1)) * np.uint64(
                0x9E3779B97F4A7C15
            )
        u = _uniform(_draws(np.broadcast_to(k, g.shape), g))
        idx = np.minimum(np.floor(u * cuts[-1]).astype(np.int64), cuts[-1] - 1)
        j = np.searchsorted(cuts, idx, side="right") - 1
        return users[j], idx - cuts[j] + 1

    def samples(
        self, step: int, sample_ids: torch.Tensor | np.ndarray, split: str = "train"
    ) -> JaggedBatch:
        """Samples ``sample_ids`` (global ids, in this order) of ``step``."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        g = torch.as_tensor(sample_ids, dtype=torch.int64).cpu().numpy().astype(np.int64)
        if g.size and g.min() < 0:
            raise ValueError("sample ids must be >= 0")
        user, cut = self.pick(step, g, split)
        start = self.user_start[user]
        hist_lo = start + np.maximum(0, cut - self.cfg.max_uih)
        hist_hi = start + cut
        cand_hi = np.minimum(hist_hi + self.cfg.num_candidates, start + self.user_count[user])
        tok = _ranges(hist_lo, hist_hi)
        ctok = _ranges(hist_hi, cand_hi)
        L = torch.from_numpy(hist_hi - hist_lo)
        timestamps = None
        if self.with_timestamps:
            ts = torch.from_numpy(self.timestamp[tok])
            timestamps = {k: ts for k in self.uih_keys}
        return JaggedBatch(
            sample_ids=torch.from_numpy(g.copy()),
            uih={
                "uih_item": torch.from_numpy(self.item[tok]),
                "uih_action": torch.from_numpy(self.action[tok]),
            },
            uih_lengths={"uih_item": L, "uih_action": L.clone()},
            candidates=torch.from_numpy(self.item[ctok]),
            num_candidates=torch.from_numpy(cand_hi - hist_hi),
            labels=torch.from_numpy(self.label[ctok]),
            timestamps=timestamps,
            step=step,
            extras={},
        )

    def global_batch(self, step: int, split: str = "train") -> JaggedBatch:
        return self.samples(step, np.arange(self.cfg.global_batch_size, dtype=np.int64), split)


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(lo[i], hi[i])`` (vectorised)."""
    n = hi - lo
    total = int(n.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.zeros(n.size + 1, dtype=np.int64)
    np.cumsum(n, out=offs[1:])
    seg = np.repeat(np.arange(n.size), n)
    return lo[seg] + np.arange(total, dtype=np.int64) - offs[:-1][seg]
