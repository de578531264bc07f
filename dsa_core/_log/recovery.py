"""Opening a log store: the writer lock, loading a manifest's state, garbage, replay, checks.

After ``kill -9`` at any moment an open returns exactly the state of the last completed
flush (``commit``) plus the steps of its commit log: the manifest is the commit point, so
:func:`load` checks and maps the segments it lists and reads the index generation it names;
a writer then reads the whole commit log (damage in it stops the open here, before any
file changes), deletes the store's files that the manifest proves are garbage
(:func:`remove_garbage`: segments and index generations written after the last commit or
no longer named by it, a torn manifest's temporary file) and replays the commit log's
valid entries (:func:`replay_log`, then one flush: the replayed log is never read again). A reader writes nothing: it puts the log's entries into
its own region (:func:`install_log`). The files of the last manifest are never modified
nor deleted before a newer manifest is durable.

:func:`verify` checks an open store's in-memory state against its segments.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._files import CHECKSUM_KEY, lock_writer
from .._os import fsync_path
from .commit import Commit
from .format import (
    MANIFEST_FILE,
    check_index_pages,
    check_segment,
    crash_point,
    map_index,
    parse_name,
    read_index,
    read_manifest,
    seg_name,
)
from .pool import Pool
from .segments import LOW32, Segments
from .sums import head_bytes
from .wal import WalEntry, read_entries, wal_name

__all__ = ["check_files", "install_log", "load", "lock", "log_entries", "remove_garbage",
           "replay_log", "verify"]

def lock(directory: Path) -> int:
    """Take the store's writer lock (``_files.lock_writer``, as the in-place store does)."""
    return lock_writer(directory)


def load(path: Path, manifest: dict[str, Any], full_check: bool, pool: Pool,
         segments: Segments) -> None:
    """Check and map the manifest's segments, load its index, count live records (into a
    fresh ``pool`` and ``segments``)."""
    listed = sorted(int(s) for s in manifest["segments"])
    index_from = int(manifest["index_from"])
    ns, versions, newer = {}, {}, []
    for sid in listed:
        if not 0 < sid < segments.next_segment:
            raise ValueError(f"manifest of {str(path)!r} lists segment {sid} outside "
                             f"[1, next_segment={segments.next_segment}); the store is "
                             "damaged")
        got = check_segment(path / seg_name(sid), sid, pool.stride, pool.dtype.itemsize,
                            pool.num_rows, full_check, with_rows=sid >= index_from,
                            head=segments.head, meta=full_check)
        ns[sid], versions[sid] = got[:2]
        if sid >= index_from:
            newer.append((sid, got[2]))
    name, crc = manifest["index"], manifest.get("index_crc32")
    paged, entries = manifest.get("index_pages") is not None, manifest.get("index_entries")
    if name is None:
        if pool.index_mapped:
            pool.index.unmapped()
    elif pool.index_mapped and paged:  # mapped: read as rows are looked up
        pool.index.map(path / name, *map_index(path / name, pool.num_rows, crc, entries))
    else:  # in memory (a base written before the pages: in memory whatever the budget)
        pool.adopt_index(read_index(path / name, pool.num_rows, crc, paged, entries))
    for sid, rows in newer:  # the segments sealed after the base, oldest first
        pool.index.set(rows, np.int64((sid << 32) + 1)
                       + np.arange(rows.shape[0], dtype=np.int64))
    newer = None
    segments.ensure_id(segments.next_segment)
    size = segments.live.shape[0]
    if pool.index.mapped and manifest.get("live") is not None and not full_check:
        # the live counts the writer committed: an open reads no page of the base
        live = np.zeros(size, np.int64)
        for sid, n in zip(listed, sorted_live(manifest), strict=True):
            if n > ns[sid]:
                raise ValueError(f"manifest of {str(path)!r} counts {n} live records in "
                                 f"segment {sid} of {ns[sid]}; the store is damaged, restore "
                                 "it from a checkpoint")
            live[sid] = n
        segments.adopt(ns, live, int(manifest["located"]), versions, not full_check)
        return
    index = pool.index.base if not pool.index.mapped else pool.disk_locations()
    used = index[index > 0] - 1
    sids, ks = used >> 32, used & LOW32
    problems = []
    if (index < 0).any():
        problems.append(f"rows {np.flatnonzero(index < 0)[:5].tolist()} have negative "
                        "locations")
    known = np.zeros(size, bool)
    known[list(ns)] = True
    outside = (sids >= known.shape[0]) | ~known[np.minimum(sids, known.shape[0] - 1)]
    if outside.any():
        rows = np.flatnonzero(index > 0)[outside][:5].tolist()
        problems.append(f"rows {rows} point at segments the manifest does not list")
    seg_n = np.zeros(size, np.int64)
    for sid, n in ns.items():
        seg_n[sid] = n
    if not problems and ks.shape[0] and (ks >= seg_n[sids]).any():
        rows = np.flatnonzero(index > 0)[ks >= seg_n[sids]][:5].tolist()
        problems.append(f"rows {rows} point past the end of their segments")
    if problems:
        raise ValueError(f"index {manifest['index']!r} of log store {str(path)!r} does "
                         f"not match its segments: {'; '.join(problems)}; restore the store "
                         "from a checkpoint")
    live = np.bincount(sids, minlength=size) if sids.shape[0] else np.zeros(size, np.int64)
    segments.adopt(ns, live, int(used.shape[0]), versions, not full_check)
    bad = segments.check_rows_of_records(index)
    if bad:
        raise ValueError(f"index {manifest['index']!r} of log store {str(path)!r} "
                         f"does not match its segments: {bad[0]}; restore the store from a "
                         "checkpoint")


def sorted_live(manifest: dict[str, Any]) -> list[int]:
    """The manifest's live counts in the order of its sorted segment ids."""
    pairs = sorted(zip(manifest["segments"], manifest["live"], strict=True))
    return [int(n) for _, n in pairs]


def log_entries(directory: Path, manifest: dict[str, Any]):
    """The valid commit-log entries of ``manifest`` (steps ``count + 1``, ...); none if it
    names no log."""
    name = manifest.get("wal")
    if name is None:
        return iter(())
    lay = manifest["layout"]
    return read_entries(Path(directory) / name, int(manifest["wal_salt"]),
                        int(manifest["count"]) + 1, int(lay["stride"]),
                        np.dtype(lay["dtype"]), int(lay["num_rows"]))


def remove_garbage(directory: Path, manifest: dict[str, Any]) -> list[str]:
    """Delete the store's own files that the manifest proves are garbage (writer only);
    returns their names.

    A manifest that passed its checksum (``read_manifest``) is the commit point: a file of
    the store that it does not reference is either newer than it (written after the last
    commit by a writer that died before the next one) or older (a segment, index or log
    that a later manifest stopped naming, not yet deleted when the writer died). Both go.
    The commit log the manifest names stays, and so does a retired one kept under the next
    generation's name (reused by the next flush). A manifest without a checksum (written
    before checksums, format version < 3) proves less: only the files newer than it go
    (segment ids from its ``next_segment`` on, index and log generations after the ones it
    names); older leftovers stay until the store is opened again (the writer's open
    rewrites such a manifest with its checksum). Files that are not the store's own are never touched.
    """
    trusted = manifest.get(CHECKSUM_KEY) is not None
    keep_segs = {int(s) for s in manifest["segments"]}
    nxt = int(manifest["next_segment"])
    index_gen = -1 if manifest["index"] is None else parse_name(manifest["index"])[1]
    keep_wal, wal_gen = set(), -1
    if manifest.get("wal") is not None:
        wal_gen = parse_name(manifest["wal"])[1]
        keep_wal = {manifest["wal"], wal_name(wal_gen + 1)}
    removed = []
    for entry in sorted(os.listdir(directory)):
        kind = parse_name(entry)
        if kind is None:
            stale = entry == MANIFEST_FILE + ".tmp"  # write_json's, from a torn commit
        elif kind[0] == "seg":
            stale = kind[1] not in keep_segs and (trusted or kind[1] >= nxt)
        elif kind[0] == "index":
            stale = entry != manifest["index"] and (trusted or kind[1] > index_gen)
        else:
            stale = entry not in keep_wal and (trusted or kind[1] > wal_gen + 1)
        if stale:
            os.unlink(directory / entry)
            removed.append(entry)
            crash_point("open-clean")
    if removed:
        fsync_path(directory)
    return removed


def replay_log(path: Path, commit: Commit, pool: Pool) -> int:
    """Writer at open: replay the commit log's valid entries through ``Pool.write``, then
    flush once (a new generation: the replayed log and its torn tail are never read
    again); with none to replay, append to the named log from its start. Returns the
    number of steps replayed."""
    if commit.manifest.get("wal") is None:
        return 0
    commit.keep_spare()
    done = 0
    for e in log_entries(path, commit.manifest):
        pool.write(e.rows, e.records, commit.make_room)
        commit.count = e.t
        done += 1
        crash_point("wal-replayed")
    if done:
        commit.flush()
    else:
        commit.resume_wal()
    return done


def install_log(entries: list[WalEntry] | Any, limit: int, commit: Commit, pool: Pool) -> None:
    """Read-only open: put the first ``limit`` commit-log ``entries`` into the region (sized
    by the open to hold all their rows), so that reads see the state after the last logged
    step. Nothing is written."""
    for e in itertools.islice(entries, limit):
        pool.install(e.rows, e.records)
        commit.count = e.t


def check_files(directory: Path) -> list[tuple[str, str | None, str]]:
    """``dsa verify``'s look at every file of the store, one by one, without opening it:
    ``(file, problem or None, what was checked)`` for the manifest (checksum, settings),
    the index generation (size, CRC), every segment it lists (header, rows, steps, the
    records' CRC and every record against its checksum) and the commit log (every entry;
    damage before a valid entry). Reads only; a missing manifest stops the list there."""
    directory = Path(directory)
    out: list[tuple[str, str | None, str]] = []
    try:
        manifest = read_manifest(directory)
    except (OSError, ValueError) as exc:
        return [(MANIFEST_FILE, str(exc), "checksum and settings")]
    out.append((MANIFEST_FILE, None, "checksum and settings" if manifest.get(CHECKSUM_KEY)
                else "settings; no checksum (written before format 3: the next flush adds "
                "one)"))
    lay = manifest["layout"]
    stride, dtype, num_rows = int(lay["stride"]), np.dtype(lay["dtype"]), int(lay["num_rows"])
    if manifest["index"] is not None:
        try:
            ipath, crc = directory / manifest["index"], manifest.get("index_crc32")
            listed = manifest.get("index_entries")
            if manifest.get("index_pages") is not None:  # page by page, not whole in memory
                check_index_pages(ipath, *map_index(ipath, num_rows, crc, listed), num_rows)
                what = (f"size, CRC and every page ({num_rows} rows)" if listed is None else
                        f"size, CRC and every page ({listed} of {num_rows} rows listed)")
            else:
                read_index(ipath, num_rows, crc, pages=False)
                what = f"size and CRC ({num_rows} rows)"
            out.append((manifest["index"], None, what))
        except (OSError, ValueError) as exc:
            out.append((manifest["index"], str(exc), "size and CRC"))
    for sid in manifest["segments"]:
        name = seg_name(int(sid))
        try:
            n, version = check_segment(directory / name, int(sid), stride, dtype.itemsize,
                                       num_rows, True, head=head_bytes(
                                           lay["w"], int(lay["dim"]), dtype.itemsize))[:2]
            out.append((name, None, f"header, rows, steps and {n} records (" + (
                "each against its checksum)" if version >= 2 else
                "their CRC; a segment of format 1 has no per-record checksums)")))
        except (OSError, ValueError) as exc:
            out.append((name, str(exc), "header, rows, steps and records"))
    if manifest.get("wal") is not None:
        try:
            k = sum(1 for _ in log_entries(directory, manifest))
            out.append((manifest["wal"], None, f"{k} valid entr{'y' if k == 1 else 'ies'} "
                        "after the manifest's count, no damage before the tail"))
        except (OSError, ValueError) as exc:
            out.append((manifest["wal"], str(exc), "every entry"))
    return out


def verify(pool: Pool, segments: Segments) -> list[str]:
    """Check the index against the segments and the region; returns the problems found
    (see ``LogStore.check_index``)."""
    problems, go_on = pool.verify()
    if not go_on:
        return problems
    disk = pool.disk_locations()
    problems += segments.check_rows_of_records(disk)
    located = disk[disk > 0] - 1
    size = segments.live.shape[0]
    live = np.bincount(located >> 32, minlength=size) \
        if located.shape[0] else np.zeros(size, np.int64)
    for sid in sorted(segments.segs):
        if live[sid] != segments.live[sid]:
            problems.append(f"segment {sid}: {segments.live[sid]} live records counted, "
                            f"{live[sid]} located")
    stray = [int(s) for s in np.flatnonzero(live) if int(s) not in segments.segs]
    if stray:
        problems.append(f"rows point at segments {stray[:5]} that are not live")
    if segments.live_total != located.shape[0]:
        problems.append(f"{segments.live_total} located rows counted, {located.shape[0]} "
                        "found")
    total = sum(s.n for s in segments.segs.values())
    if total != segments.total_records:
        problems.append(f"{segments.total_records} segment records counted, {total} mapped")
    return problems
