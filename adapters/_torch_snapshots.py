"""State-dict snapshots: ``torch.save(opt.state_dict())`` is a checkpoint on every store.

torch's convention is that a state dict *is* the state: saved with ``torch.save``, loaded
later with ``load_state_dict``, it brings back exactly the point where it was taken. A DSA
state dict cannot hold the rows (they are the table), so ``state_dict()`` snapshots each
store (``dsa_core.checkpoint``) and names the snapshot, and ``load_state_dict`` restores
from it (``dsa_core.restore``), whatever the store's kind. What differs is only the cost
of taking one: a log store flushes, hard-links its immutable segment files and copies its
index (small); an in-place store flushes and copies its data file (a reflink, nearly free,
where the filesystem supports it, e.g. btrfs or XFS; a full copy of the table elsewhere,
e.g. ext4). ``keep=0`` takes no snapshots: the state dict then only describes the live
stores, and one of an earlier step is refused (again on both kinds).

Where: next to the store, ``<parent>/.dsa-snapshots/<store name>/<id>/`` (the same
filesystem, so a log store's segments are linked, not copied, and an in-place store's data
file can be reflinked; a hidden directory, which ``dsa info`` skips). For an optimizer's
own stores that is ``<state_dir>/.dsa-snapshots/group{i}_param{j}/``. The ``<id>`` is
``<tag>-<time in ns>-<pid>-<random>``: ``tag`` tells whose snapshot it is (``"opt"`` for a
DiskSparseAdam, ``"emb"`` for a DiskEmbedding's module state dict), so that one
``torch.save({"model": ..., "optim": ...})`` does not count twice against the optimizer's
``keep_snapshots``. That save snapshots a DiskEmbedding's store twice (once per taker):
on an in-place store without reflinks, two copies of the table.

How long: each taker keeps the newest ``keep`` snapshots of its tag per store and deletes
older ones when it takes a new one (``release`` deletes them on request). A snapshot stays
valid while training goes on (an in-place snapshot is a file of its own; a log snapshot's
hard links keep its segments when the cleaner deletes them from the live store). A snapshot
is staged in ``<id>.tmp-<pid>`` and renamed into place complete (``dsa_core.staged_dir``),
so a ``kill -9`` or Ctrl-C while one is taken leaves no ``<id>`` a state dict could name;
the next taker of that tag deletes a dead process's ``.tmp-`` leftover. A state dict whose
snapshot is gone is refused with a clear error.

Also :func:`open_snapshot`, which opens any snapshot store (of a state dict or of a
checkpoint directory) read-only and checks it against the live store before a restore.

Private; the public names live in :mod:`adapters.torch`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsa_core

__all__ = ["DEFAULT_KEEP", "SNAPSHOT_DIR", "check_keep", "open_saved", "open_snapshot", "release",
           "take"]

SNAPSHOT_DIR = ".dsa-snapshots"
DEFAULT_KEEP = 3  # per store and taker: the state dicts of the last three saves load


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


def _find(entry: dict[str, Any], live: dsa_core.State) -> Path | None:
    """Where the snapshot of ``entry`` is: next to the live store (a moved directory finds
    its own), else where it was taken (a state dict of another store of the same layout)."""
    sid = str(entry.get("id", ""))
    if not sid or "/" in sid or sid.startswith(".") or ".tmp-" in sid:  # staged: never one
        return None
    for p in (root_of(live.path) / sid, Path(str(entry.get("path", "")))):
        if p.name == sid and (p / "manifest.json").is_file():
            return p
    return None


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
    path = _find(entry, live)
    if path is None:
        raise ValueError(
            f"{what}: this state dict was taken at step {count} and names the snapshot "
            f"{entry.get('id')!r} of the store {entry.get('store')!r}, which is gone "
            f"(looked in {str(root_of(live.path))!r} and {entry.get('path')!r}): snapshots "
            f"are deleted when newer state dicts are taken ({keep_hint}), by "
            "release_snapshots(), or with their directory. Nothing was changed. Load a newer "
            "state dict, raise keep_snapshots to keep more, or use opt.checkpoint(dest) / "
            "load_checkpoint(dest) for points kept until you delete them")
    return open_snapshot(path, live, what, count=int(count))
