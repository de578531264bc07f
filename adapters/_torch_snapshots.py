"""State-dict snapshots: ``torch.save(opt.state_dict())`` is a checkpoint on every store.

torch's convention is that a state dict *is* the state: saved with ``torch.save``, loaded
later with ``load_state_dict``, it brings back exactly the point where it was taken. A DSA
state dict cannot hold the rows (they are the table), so ``state_dict()`` snapshots each
store (``dsa_core.checkpoint``) and names the snapshot, and ``load_state_dict`` restores
from it (``dsa_core.restore``), whatever the store's kind. What differs is only the cost
of taking one: a log store flushes, hard-links its immutable segment files and copies its
index (small); an in-place store flushes and reflinks its data file where the filesystem
supports it (nearly free, e.g. btrfs or XFS), else (e.g. ext4) hard-links the files of its
last snapshot and writes the rows changed since (a full copy when those would outgrow the
table, or after a new open: docs/storage.md). ``keep=0`` takes no snapshots: the state dict then
only describes the live
stores, and one of an earlier step is refused (again on both kinds).

Where: next to the store, ``<parent>/.dsa-snapshots/<store name>/<id>/`` (the same
filesystem, so a log store's segments are linked, not copied, and an in-place store's data
file can be reflinked; a hidden directory, which ``dsa info`` skips). For an optimizer's
own stores that is ``<state_dir>/.dsa-snapshots/group{i}_param{j}/``. The ``<id>`` is
``<tag>-<time in ns>-<pid>-<random>``: ``tag`` tells whose snapshot it is (``"opt"`` for a
DiskSparseAdam, ``"emb"`` for a DiskEmbedding's module state dict), so that one
``torch.save({"model": ..., "optim": ...})`` does not count twice against the optimizer's
``keep_snapshots``. That save snapshots a DiskEmbedding's store twice (once per taker):
the second has no row changed since the first, and is its files linked again.

How long: each taker keeps the newest ``keep`` snapshots of its tag per store and deletes
older ones when it takes a new one (``release`` deletes them on request). A snapshot stays
valid while training goes on and whichever other snapshot is deleted (an in-place
snapshot's files are never written again and it holds its own hard links to all of them; a
log snapshot's hard links keep its segments when the cleaner deletes them from the live
store). A snapshot
is staged in ``<id>.tmp-<pid>`` and renamed into place complete (``dsa_core.tools.staged_dir``),
so a ``kill -9`` or Ctrl-C while one is taken leaves no ``<id>`` a state dict could name;
the next taker of that tag deletes a dead process's ``.tmp-`` leftover. A state dict whose
snapshot is gone is refused with a clear error.

Also :func:`open_snapshot`, which opens any snapshot store (of a state dict or of a
checkpoint directory) read-only and checks it against the live store before a restore.

Private; the public names live in :mod:`adapters.torch`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsa_core

__all__ = ["CARRIED_DIR", "DEFAULT_KEEP", "SNAPSHOT_DIR", "carry_plan", "carry_into",
           "check_keep", "open_saved", "open_snapshot", "release", "resolve_carried", "take"]

SNAPSHOT_DIR = ".dsa-snapshots"
DEFAULT_KEEP = 3  # per store and taker: the state dicts of the last three saves load
CARRIED_DIR = "snapshots"  # in a checkpoint directory: the snapshots its extra= names
SNAPSHOT_KEY = "state_snapshot"  # the key of a snapshot entry, in a module's or optimizer's


def open_snapshot(src, live: dsa_core.State, what: str,
                  count: int | None = None) -> dsa_core.State:
    """Open the checkpoint store ``src`` read-only and check that it fits the store ``live``.

    The layouts (shape, dtype, curvature, weights, record stride) must be identical, and, when
    ``count`` is given, the snapshot must hold exactly that many steps. Nothing is written.
    """
    snap = dsa_core.open(src, mode="r")
    try:
        have, want = live.layout, snap.layout
        if have != want:
            raise ValueError(
                f"{what}: the checkpoint store {str(src)!r} holds a {want['num_rows']} x "
                f"{want['dim']} {want['dtype']} table with curvature {want['curvature']} "
                f"(layout {want}), but the live store {str(live.path)!r} is "
                f"{have['num_rows']} x {have['dim']} {have['dtype']} with curvature "
                f"{have['curvature']} (layout {have}); restore into a store created the "
                "same way")
        if count is not None and snap.count != count:
            raise ValueError(
                f"{what}: the checkpoint store {str(src)!r} is at step {snap.count}, but its "
                f"checkpoint manifest says {count}; the checkpoint directory was modified "
                "after it was written (did training continue in it?)")
    except BaseException:
        dsa_core.close(snap)
        raise
    return snap


def check_keep(keep: Any, what: str) -> int:
    """``keep_snapshots``: an int >= 0 (0: state dicts are descriptions, no snapshots)."""
    if isinstance(keep, (bool, np.bool_)) or not isinstance(keep, (int, np.integer)) \
            or keep < 0:
        raise ValueError(f"{what}: keep_snapshots must be an int >= 0 (how many state-dict "
                         f"snapshots of each store to keep; 0 takes none), got {keep!r}")
    return int(keep)


def root_of(store_path: Path) -> Path:
    """The directory of the snapshots of the store at ``store_path``."""
    p = Path(store_path)
    return p.parent / SNAPSHOT_DIR / p.name


def _ids(root: Path, tag: str) -> list[str]:
    """This tag's snapshot ids under ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(tag + "-") and ".tmp-" not in n)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete(path: Path) -> bool:
    """Delete one snapshot; False when a writer holds it (someone trains in it: kept)."""
    try:
        dsa_core.remove(path)
    except dsa_core.StoreLockedError:
        return False
    except (FileNotFoundError, ValueError):  # damaged or half-deleted: not a store any more
        shutil.rmtree(path, ignore_errors=True)
    return True


def _prune(root: Path, tag: str, keep: int) -> int:
    """Delete this tag's snapshots under ``root`` but the newest ``keep``; also what a
    ``kill -9`` left half-written (``<id>.tmp-<pid>`` of a dead process). Returns how many
    snapshots were deleted."""
    ids = _ids(root, tag)
    removed = 0
    for sid in ids[:max(0, len(ids) - keep)]:
        removed += _delete(root / sid)
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            head, sep, pid = name.rpartition(".tmp-")
            if sep and head.startswith(tag + "-") and pid.isdigit() \
                    and int(pid) != os.getpid() and not _pid_alive(int(pid)):
                shutil.rmtree(root / name, ignore_errors=True)
    return removed


def take(state: dsa_core.State, tag: str, keep: int) -> dict[str, Any]:
    """Snapshot the (current) store ``state``, of either kind; returns the entry a state
    dict records.

    ``dsa_core.checkpoint`` into ``root_of(store) / <id>`` (it flushes first; staged and
    renamed, so an interruption leaves no ``<id>``), then this tag's older snapshots beyond
    the newest ``keep`` are deleted.
    """
    root = root_of(state.path)
    sid = f"{tag}-{time.time_ns():020d}-{os.getpid()}-{secrets.token_hex(4)}"
    dest = dsa_core.checkpoint(state, root / sid)
    _prune(root, tag, keep)
    return {"id": sid, "path": str(Path(dest).resolve()),
            "store": str(Path(state.path).resolve()), "count": int(state.count)}


def release(store_path: Path, tag: str, keep: int = 0) -> int:
    """Delete this tag's snapshots of the store at ``store_path`` but the newest ``keep``."""
    root = root_of(store_path)
    removed = _prune(root, tag, keep)
    with contextlib.suppress(OSError):  # empty now: leave no directories behind
        root.rmdir()
        root.parent.rmdir()
    return removed


def _valid_id(sid: str) -> bool:
    return bool(sid) and "/" not in sid and not sid.startswith(".") and ".tmp-" not in sid


def _find(entry: dict[str, Any], store_path) -> Path | None:
    """Where the snapshot of ``entry`` is: next to the store at ``store_path`` (a moved
    directory finds its own), else where it was taken (a state dict of another store of the
    same layout, or the copy a checkpoint carries)."""
    sid = str(entry.get("id", ""))
    if not _valid_id(sid):  # staged: never one
        return None
    for p in (root_of(Path(store_path)) / sid, Path(str(entry.get("path", "")))):
        if p.name == sid and (p / "manifest.json").is_file():
            return p
    return None


# -- the snapshots a checkpoint's extra= names travel with it ----------------------------
def _rewrite(obj: Any, fix) -> Any:
    """``obj`` with every snapshot entry (``{"id", "path", "store", "count"}`` under
    ``"state_snapshot"``: a DiskEmbedding's ``_extra_state``, an optimizer manifest's
    params) replaced by ``fix(entry)``; containers that hold one are shallow-copied (an
    ``OrderedDict`` keeps its ``_metadata``), nothing of the
    caller's is modified, tensors are shared."""
    if isinstance(obj, dict):
        new = None
        for k, v in obj.items():
            if k == SNAPSHOT_KEY and isinstance(v, dict) and "id" in v:
                w = fix(v)
            else:
                w = _rewrite(v, fix)
            if w is not v:
                if new is None:
                    new = copy.copy(obj)
                new[k] = w
        return obj if new is None else new
    if isinstance(obj, (list, tuple)):
        items = [_rewrite(v, fix) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            return type(obj)(items) if isinstance(obj, list) else tuple(items)
    return obj


def carry_plan(extra: Any, what: str) -> tuple[Any, list[tuple[str, Path]]]:
    """The snapshots that ``extra`` names, found on disk, and ``extra`` rewritten to name
    the copies a checkpoint will carry (``snapshots/<id>``, relative to the checkpoint).

    Returns ``(new extra, [(id, source directory)])``. A snapshot that is gone raises
    ``ValueError`` (nothing is written). ``extra`` itself is not modified.
    """
    entries: list = []
    _rewrite(extra, lambda e: entries.append(e) or e)  # (a fix that changes nothing)
    plan: dict[str, Path] = {}
    for e in entries:
        sid = str(e.get("id", ""))
        if sid in plan:
            continue
        src = _find(e, str(e.get("store", ""))) if not e.get("in_checkpoint") else None
        if src is None and e.get("in_checkpoint"):
            p = Path(str(e.get("path", "")))
            src = p if p.is_absolute() and (p / "manifest.json").is_file() else None
        if src is None:
            raise ValueError(
                f"{what}: extra= holds a state dict that names the snapshot {sid!r} (step "
                f"{e.get('count')}) of the store {e.get('store')!r}, which is gone (looked in "
                f"{str(root_of(Path(str(e.get('store', '')))))!r} and {e.get('path')!r}); a "
                "checkpoint carries the snapshots its extra= names, so it cannot be written. "
                "Nothing was written. Take the state dict again just before the checkpoint "
                "(extra={'model': model.state_dict()})")
        plan[sid] = src

    def fix(e):
        sid = str(e["id"])
        return {**e, "path": f"{CARRIED_DIR}/{sid}", "in_checkpoint": True}
    return (_rewrite(extra, fix) if plan else extra), list(plan.items())


def carry_into(plan: list[tuple[str, Path]], dest: Path) -> None:
    """Put the snapshots of ``plan`` (from :func:`carry_plan`) into ``dest/snapshots/``.

    Each file is hard-linked (the snapshot's files are never written again: an in-place
    snapshot's data file, a log snapshot's immutable segments and index), so this costs no
    disk until the original is pruned; across filesystems it is copied (a reflink where the
    filesystem allows).
    """
    if not plan:
        return
    root = dest / CARRIED_DIR
    root.mkdir()
    for sid, src in plan:
        dsa_core.tools.link_files(src, root / sid)


def resolve_carried(extra: Any, src: Path) -> Any:
    """``extra`` of the checkpoint at ``src``, its carried snapshot entries pointing into
    ``src`` (wherever the directory is now)."""
    src = Path(src).resolve()

    def fix(e):
        if not e.get("in_checkpoint"):
            return e
        return {**e, "path": str(src / CARRIED_DIR / str(e["id"]))}
    return _rewrite(extra, fix)


def open_saved(entry: Any, live: dsa_core.State, what: str, count: int,
               keep_hint: str) -> dsa_core.State:
    """Open the snapshot a state dict names, read-only and checked against ``live``.

    :func:`open_snapshot` checks the layout and that the snapshot holds ``count`` steps.
    A snapshot that is gone raises ``ValueError`` saying so and what to do; nothing is
    changed.
    """
    if not isinstance(entry, dict) or int(entry.get("count", -1)) != int(count):
        raise ValueError(f"{what}: the state dict's snapshot entry {entry!r} is malformed "
                         f"(it must name the snapshot taken at step {count})")
    path = _find(entry, live.path)
    if path is None and entry.get("in_checkpoint") and not Path(
            str(entry.get("path", ""))).is_absolute():
        raise ValueError(
            f"{what}: this state dict came out of a checkpoint directory (its extra.pt) and "
            f"names the snapshot {entry.get('id')!r} that the checkpoint carries, by a path "
            f"relative to that directory ({entry.get('path')!r}). Nothing was changed. Get it "
            "through opt.load_checkpoint(CKPT), whose returned extra points into CKPT "
            "wherever it now is")
    if path is None:
        sid = str(entry.get("id", ""))
        tag = sid.split("-", 1)[0]
        newer = [n for n in _ids(root_of(live.path), tag) if n > sid] if _valid_id(sid) \
            else []
        if newer:
            why = (f"it was pruned after {len(newer)} newer state dict(s) of this store were "
                   "taken (each state_dict() call takes one, calls for logging included; "
                   f"{keep_hint}: only the newest are kept)")
        else:
            why = ("snapshots are deleted when newer state dicts are taken "
                   f"({keep_hint}), by release_snapshots(), or with their directory")
        raise ValueError(
            f"{what}: this state dict was taken at step {count} and names the snapshot "
            f"{entry.get('id')!r} of the store {entry.get('store')!r}, which is gone "
            f"(looked in {str(root_of(live.path))!r} and {entry.get('path')!r}): {why}. "
            "Nothing was changed. Load a newer state dict; to keep points such as a best "
            "model, save them with opt.checkpoint(dest, extra={'model': "
            "model.state_dict()}) (self-contained, kept until you delete it), or raise "
            "keep_snapshots= (DiskEmbedding(..., keep_snapshots=K) / DiskSparseAdam(..., "
            "keep_snapshots=K)) above the number of state dicts taken between a save and "
            "its load")
    return open_snapshot(path, live, what, count=int(count))


# -- small tables: the rows themselves in the state dict -----------------------------------
def rows_fit(state: dsa_core.State) -> bool:
    """Whether a state dict holds this store's rows instead of naming a snapshot.

    The threshold of ``emb.weight``'s real reads: a table of at most
    ``DiskWeight.read_limit`` bytes of weights (256 MiB), as ``nn.Embedding`` and
    ``torch.optim.SparseAdam`` keep their tensors in their state dicts.
    """
    from ._torch_embedding import DiskWeight  # that module imports this one
    return state.num_rows * state.dim * state.dtype.itemsize <= DiskWeight.read_limit


def all_records(state: dsa_core.State) -> np.ndarray:
    """Every record of ``state`` (weights, m, v, per-row counters, bit for bit)."""
    return dsa_core.read_records(state, np.arange(state.num_rows, dtype=np.int64))


class SavedRows:
    """The records a state dict holds, checked against a live store: restored by
    :func:`restore_from` as a snapshot would be."""

    def __init__(self, records: np.ndarray, count: int):
        self.records, self.count = records, int(count)


def check_rows(records: Any, live: dsa_core.State, what: str, count: int) -> SavedRows:
    """``ValueError`` unless ``records`` are the whole records of a store laid out as
    ``live`` (shape ``(num_rows, stride)``, its dtype); nothing is written."""
    import torch
    want = (live.num_rows, int(live.layout["stride"]))
    if not isinstance(records, torch.Tensor) or tuple(records.shape) != want \
            or str(records.dtype).removeprefix("torch.") != live.dtype.name:
        got = (f"a {tuple(records.shape)} {records.dtype} tensor"
               if isinstance(records, torch.Tensor) else type(records).__name__)
        raise ValueError(f"{what}: the state dict's rows must be the {want[0]} x {want[1]} "
                         f"{live.dtype.name} records of the store {str(live.path)!r}, got "
                         f"{got}; nothing was changed. Load a state dict of this table")
    return SavedRows(records.detach().cpu().numpy(), count)


def restore_from(live: dsa_core.State, snap) -> dsa_core.State:
    """``dsa_core.restore`` from a snapshot store, or the same from :class:`SavedRows`:
    every record written, then the count set (and the store flushed)."""
    if not isinstance(snap, SavedRows):
        return dsa_core.restore(live, snap)
    # as dsa_core.restore: range writes, which no undo record may roll back
    return dsa_core.tools.restore_records(live, snap.records, snap.count)


def close_saved(snap) -> None:
    if isinstance(snap, dsa_core.State):
        dsa_core.close(snap)
