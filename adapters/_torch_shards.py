"""The on-disk format of a sharded embedding table: ownership plan, shard descriptions, manifests.

Private module; its names (no leading underscore) are the interface shared by the training
side (:mod:`adapters._torch_dist`, public in :mod:`adapters.torch_dist`) and the offline
resharder (:mod:`adapters.torch_reshard`), so that the format has one definition.

Layout on disk (one directory tree per machine; each rank writes only its own shard)::

    state_dir/rank{k}/            an ordinary dsa_core store (rows.dsa, manifest.json)
    state_dir/rank{k}/shard.json  which shard it is: rank, world size, plan, table settings
    ckpt/dsa-sharded.json         checkpoints only: written last, marks a complete checkpoint

A shard description (``shard.json``) and a manifest (``dsa-sharded.json``) are JSON objects
that share the *table* keys (:data:`TABLE_KEYS`: shape, dtype, curvature, padding row, the
reduced-state settings and the per-row options) and the plan (``{"kind", "world_size",
"num_rows"}``); a shard adds its ``rank`` and ``local_rows``, a manifest the step ``count``
and every shard's directory and row count. Both are written with
:func:`dsa_core.tools.write_json` (atomic and durable).

>>> import tempfile, pathlib
>>> plan = ShardPlan(10, 3)
>>> [plan.local_rows(k) for k in range(3)], int(plan.owner(7)), int(plan.local(7))
([4, 3, 3], 1, 2)
>>> table = {"num_embeddings": 10, "embedding_dim": 4, "dtype": "float32", "curvature": 0.0,
...          "padding_idx": None, "second_moment": "elementwise", "first_moment": "full",
...          "per_row_step": False, "decay_missed_steps": False}
>>> root = pathlib.Path(tempfile.mkdtemp())
>>> write_manifest(root, manifest(plan, table, count=5))
>>> m = read_manifest(root)
>>> m["count"], m["shards"], ShardPlan.from_json(m["plan"]) == plan
(5, ['rank0', 'rank1', 'rank2'], True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

import dsa_core

__all__ = [
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "PLANS",
    "SHARD_FILE",
    "SHARD_FORMAT",
    "TABLE_KEYS",
    "ShardPlan",
    "check_shard_meta",
    "describe_plan",
    "manifest",
    "read_manifest",
    "read_shard_meta",
    "shard_meta",
    "shard_path",
    "store_settings",
    "table_of",
    "write_manifest",
    "write_shard_meta",
]

SHARD_FILE = "shard.json"
MANIFEST_FILE = "dsa-sharded.json"
SHARD_FORMAT = "dsa-torch-shard"
MANIFEST_FORMAT = "dsa-torch-sharded"
FORMAT_VERSION = 1
PLANS = ("mod", "range")
TABLE_KEYS = ("num_embeddings", "embedding_dim", "dtype", "curvature", "padding_idx",
              "second_moment", "first_moment", "per_row_step", "decay_missed_steps",
              "optimizer")
# written before the reduced state (or the per-row options, or Adagrad) existed: such shards
# and manifests hold Adam's full moments and no per-row fields
_SETTING_DEFAULTS = {"second_moment": "elementwise", "first_moment": "full",
                     "per_row_step": False, "decay_missed_steps": False, "optimizer": "adam"}


# -- ownership plan -------------------------------------------------------------------------------
class ShardPlan:
    """Which rank owns global row ``r``, and where it sits in that rank's shard.

    ``"mod"`` (default): owner ``r % W``, local row ``r // W``; hot low ids spread over all
    ranks. ``"range"``: contiguous blocks of ``ceil(n / W)`` rows: owner ``r // block``, local
    row ``r - owner * block``. Every shard must hold at least one row.

    >>> plan = ShardPlan(10, 3, "range")
    >>> plan.block, [plan.local_rows(k) for k in range(3)]
    (4, [4, 4, 2])
    >>> plan.global_ids(2, [0, 1]).tolist()
    [8, 9]
    >>> ShardPlan(2, 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    ValueError: a 2-row table cannot be split over 3 ranks ...: rank(s) [2] would own no row...
    """

    def __init__(self, num_rows: int, world_size: int, kind: str = "mod"):
        if kind not in PLANS:
            raise ValueError(f"plan must be one of {PLANS}, got {kind!r}")
        self.num_rows, self.world_size, self.kind = int(num_rows), int(world_size), kind
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.block = -(-self.num_rows // self.world_size)
        empty = [k for k in range(self.world_size) if self.local_rows(k) <= 0]
        if empty:
            raise ValueError(
                f"a {self.num_rows}-row table cannot be split over {self.world_size} ranks with "
                f"plan {kind!r}: rank(s) {empty} would own no row. Use fewer ranks"
                + (" or plan='mod'" if kind == "range" else ""))

    def owner(self, ids):
        """Owner rank of each global id (torch tensor or numpy array, same kind back)."""
        return ids % self.world_size if self.kind == "mod" else ids // self.block

    def local(self, ids):
        """Row of each global id inside its owner's shard."""
        if self.kind == "mod":
            return ids // self.world_size
        return ids - (ids // self.block) * self.block

    def global_ids(self, rank: int, local) -> np.ndarray:
        """Global ids of the local rows ``local`` of shard ``rank`` (numpy int64)."""
        local = np.asarray(local, dtype=np.int64)
        if self.kind == "mod":
            return local * self.world_size + rank
        return local + rank * self.block

    def local_rows(self, rank: int) -> int:
        """Number of rows in shard ``rank``."""
        n, w = self.num_rows, self.world_size
        if self.kind == "mod":
            return (n - rank + w - 1) // w
        return max(0, min(self.block, n - rank * self.block))

    def to_json(self) -> dict[str, Any]:
        """The plan as it is recorded in shard descriptions and manifests."""
        return {"kind": self.kind, "world_size": self.world_size, "num_rows": self.num_rows}

    @classmethod
    def from_json(cls, obj: Any) -> ShardPlan:
        """The plan recorded by :meth:`to_json` (checked: a hand-edited file may lie)."""
        if not isinstance(obj, dict) or set(obj) != {"kind", "world_size", "num_rows"}:
            raise ValueError(f"not a shard plan (expected kind, world_size, num_rows): {obj!r}")
        return cls(obj["num_rows"], obj["world_size"], obj["kind"])

    def __eq__(self, other) -> bool:
        return isinstance(other, ShardPlan) and self.to_json() == other.to_json()

    def __repr__(self) -> str:
        return (f"ShardPlan({self.num_rows}, world_size={self.world_size}, "
                f"kind={self.kind!r})")


def shard_path(state_dir, rank: int, world_size: int) -> Path:
    """The directory of shard ``rank``: ``state_dir`` formatted with ``{rank}`` and
    ``{world_size}`` when it holds ``{rank}``, else ``state_dir/rank{rank}``.

    >>> shard_path("/runs/emb", 2, 4).as_posix(), shard_path("/ssd{rank}/emb", 2, 4).as_posix()
    ('/runs/emb/rank2', '/ssd2/emb')
    """
    s = os.fspath(state_dir)
    if "{rank}" in s:
        return Path(s.format(rank=rank, world_size=world_size))
    return Path(s) / f"rank{rank}"


def describe_plan(meta: dict) -> str:
    """``"world size W, plan 'kind'"`` of a shard description or manifest (for messages)."""
    p = meta["plan"]
    return f"world size {p['world_size']}, plan {p['kind']!r}"


# -- the table settings ---------------------------------------------------------------------------
def store_settings(state: dsa_core.State) -> dict[str, Any]:
    """``second_moment``, ``first_moment``, ``per_row_step``, ``decay_missed_steps`` and
    ``optimizer`` of a shard store, as ShardedDiskEmbedding's (and ``dsa_core.create``'s)
    arguments name them (the ball's per-row v is its default, "elementwise"; an Adagrad
    store's are the defaults: it has no moments and no counters)."""
    if state.optimizer != "adam":
        return {**_SETTING_DEFAULTS, "optimizer": state.optimizer}
    return {"second_moment": "rowwise" if state.second_moment == "rowwise" else "elementwise",
            "first_moment": state.first_moment, "per_row_step": bool(state.per_row_step),
            "decay_missed_steps": bool(state.decay_missed_steps), "optimizer": "adam"}


def table_of(meta: dict) -> dict[str, Any]:
    """The :data:`TABLE_KEYS` of a shard description or manifest (None where one lacks a
    key; files written before the reduced state existed get its defaults)."""
    full = {**_SETTING_DEFAULTS, **meta}
    return {k: full.get(k) for k in TABLE_KEYS}


# -- shard descriptions ---------------------------------------------------------------------------
def shard_meta(plan: ShardPlan, rank: int, table: dict[str, Any]) -> dict[str, Any]:
    """The description (``shard.json``) of shard ``rank`` of a table split by ``plan``."""
    return {"format": SHARD_FORMAT, "version": FORMAT_VERSION, "rank": int(rank),
            "world_size": plan.world_size, "plan": plan.to_json(), **table_of(table),
            "local_rows": plan.local_rows(rank)}


def write_shard_meta(path, meta: dict[str, Any]) -> None:
    """Write ``meta`` as ``path/shard.json`` (atomic, durable)."""
    dsa_core.tools.write_json(Path(path) / SHARD_FILE, meta, checksum=True)


def _read_json(p: Path, fmt: str, what: str, keys: tuple[str, ...],
               missing: Exception) -> dict[str, Any]:
    """Read the JSON file ``p`` of format ``fmt`` (a ``what``) and check its version and keys.

    ``missing`` is raised when there is no such file (each caller says what that means).
    """
    try:
        obj = dsa_core.tools.read_json(p)  # its checksum checked (files written before: none)
    except FileNotFoundError:
        raise missing from None
    except ValueError as exc:  # damaged: the core's message names the file (and, for a
        msg = f"{exc} (the {what})"  # checksum, the remedy); say the remedy once
        if "restore" not in str(exc):
            msg += "; restore it from a checkpoint"
        raise ValueError(msg) from None
    if not isinstance(obj, dict) or obj.get("format") != fmt:
        raise ValueError(f"{str(p)!r} is not a {what}")
    _check_version(p, obj)
    _check_keys(p, obj, keys)
    return obj


def read_shard_meta(path) -> dict[str, Any]:
    """The description of the shard store at ``path`` (its ``shard.json``), checked."""
    path = Path(path)
    return _read_json(
        path / SHARD_FILE, SHARD_FORMAT, "shard description",
        ("rank", "world_size", "plan", "local_rows", "num_embeddings", "embedding_dim",
         "dtype", "curvature", "padding_idx"),
        ValueError(f"{str(path)!r} holds a dsa_core store but no {SHARD_FILE}: it is not a "
                   "shard of a ShardedDiskEmbedding (or a checkpoint of one cut short). Use "
                   "another state_dir"))


def check_shard_meta(where: str, have: dict, want: dict) -> None:
    """Raise ``ValueError`` unless shard description ``have`` is the shard ``want`` describes.

    A different plan or world size gets the advice to reshard; any other difference names
    each key that differs.
    """
    if have.get("plan") != want["plan"]:
        raise ValueError(
            f"{where} belongs to a run with {describe_plan(have)}; this run has "
            f"{describe_plan(want)}. Resuming with a different world size or plan needs the "
            "rows moved first: python -m adapters.torch_reshard SRC DEST --world-size "
            f"{want['world_size']} (offline, on a checkpoint), then resume_from=DEST")
    keys = ("rank",) + TABLE_KEYS
    have = {**_SETTING_DEFAULTS, **have}
    bad = [k for k in keys if have.get(k) != want[k]]
    if bad:
        raise ValueError(f"{where} is a shard of another table: " + ", ".join(
            f"{k} {have.get(k)!r} there, {want[k]!r} here" for k in bad))


# -- manifests of complete checkpoints ------------------------------------------------------------
def manifest(plan: ShardPlan, table: dict[str, Any], count: int,
             **extra: Any) -> dict[str, Any]:
    """The manifest of a complete checkpoint of ``plan.world_size`` shards at step ``count``.

    ``extra`` adds keys (the resharder records where the rows came from).
    """
    return {"format": MANIFEST_FORMAT, "version": FORMAT_VERSION,
            "world_size": plan.world_size, "plan": plan.to_json(), **table_of(table),
            "count": int(count), "shards": [f"rank{k}" for k in range(plan.world_size)],
            "local_rows": [plan.local_rows(k) for k in range(plan.world_size)], **extra}


def write_manifest(root, obj: dict[str, Any]) -> None:
    """Write ``obj`` as ``root/dsa-sharded.json`` (atomic, durable): the last file of a
    checkpoint, whose presence says that every shard is complete. Every rank of a run may
    write the same manifest to a shared directory at once (temporaries are per process)."""
    dsa_core.tools.write_json(Path(root) / MANIFEST_FILE, obj, checksum=True)


def read_manifest(root) -> dict[str, Any]:
    """The manifest of a complete sharded checkpoint (``root/dsa-sharded.json``), checked."""
    path = Path(root) / MANIFEST_FILE
    m = _read_json(
        path, MANIFEST_FORMAT, "sharded-embedding manifest",
        ("world_size", "plan", "count", "num_embeddings", "embedding_dim", "dtype",
         "curvature", "padding_idx"),
        FileNotFoundError(
            f"{str(root)!r} is not a complete sharded checkpoint: it has no {MANIFEST_FILE}. "
            "A live state_dir is not a checkpoint (write one with emb.checkpoint(DEST)); a "
            "checkpoint cut short by a failure has no manifest either (the manifest is "
            "written last, once every shard is in place): use an older one"))
    plan = ShardPlan.from_json(m["plan"])
    if plan.world_size != m["world_size"] or plan.num_rows != m["num_embeddings"]:
        raise ValueError(f"{str(path)!r} contradicts itself: plan {m['plan']} for a "
                         f"{m['num_embeddings']}-row table over {m['world_size']} ranks")
    return m


def _check_version(path: Path, obj: dict) -> None:
    if obj.get("version") != FORMAT_VERSION:
        raise ValueError(f"{str(path)!r} has format version {obj.get('version')!r}; this "
                         f"version of DSA reads version {FORMAT_VERSION} (was it written by "
                         "a newer one?)")


def _check_keys(path: Path, obj: dict, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{str(path)!r} lacks {', '.join(missing)}; it was cut short or "
                         "edited by hand")
