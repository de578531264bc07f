"""The commit protocol of a log store: seals, flushes, checkpoints and the commit log.

Seals
    :meth:`Commit.seal` appends dirty slots, with the cleaner's copies (``cleaner``: the
    live records of its victims, read in the background), to a new immutable segment in one
    sequential write: a seal of at most ``min(BEHIND_BYTES, Segments.behind_bytes)`` (a
    write buffer of the memory budget, ``budget``) is gathered into a buffer and written in
    the background (``writer``; the segment is *pending* until then,
    ``segments``), a larger one (a flush, a range release) is streamed to its file at once.
    Then the rows point at the new segment, the records it supersedes are dead, and a
    segment left without a live record is dropped.
    :meth:`Commit.make_room` is the pool's eviction: CLOCK victims (``pool``), the dirty ones
    sealed together, so each seal is one large write of about ``seal_unit`` records.
Durability
    Only :meth:`Commit.flush` (and :meth:`Commit.checkpoint`, and the engine's ``close``)
    make anything durable: updates since the last flush live in the region only and are gone
    if the process ends without one. A flush seals every dirty slot (segments of a seal unit
    each), waits for the background writes, fsyncs the new segments, writes the next index
    base (fsync'd) when the segments sealed since the last base hold more than
    ``BASE_REPLAY_SHARE`` of the table's rows in records (else the manifest's
    ``index_from`` says which segments an open applies over the base: ``format``), starts
    the next commit-log generation when ``wal_on``, commits the manifest, and only then
    deletes the previous index base and the segments no manifest lists any more, and retires the previous commit log (kept for reuse while
    ``wal_on``): after ``kill -9`` at any moment the store reopens at the last completed
    flush (``recovery``).
The commit log (``durability="step"``)
    A store that commits every step logs it: :meth:`Commit.begin_step` (a flush first, unless
    the log can take the step), the caller acquires the rows and computes their new records
    outside the region, :meth:`Commit.commit_step` (one append + fdatasync to the commit
    log, ``wal``, then the region), so the region only ever holds committed steps. Each flush
    starts a new log generation that its manifest names; the open replays the named log's
    valid entries (``recovery``). After kill -9 at any moment, open returns the state after
    the last step whose entry is in the file: the last step that returned, or the one in
    flight if its entry was written in full.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np

from .._files import copy_file, staged_dir
from .._os import fsync_path
from .budget import SEAL_BYTES
from .checks import check_count, check_meta
from .cleaner import CLEAN_UNITS, Cleaner
from .format import (
    INDEX_PAGE_ROWS,
    MAX_SEGMENT_ID,
    Segment,
    check_records,
    crash_point,
    index_name,
    map_index,
    parse_name,
    records_of,
    seg_name,
    segment_geometry,
    write_index,
    write_manifest,
    write_segment,
)
from .pool import Pool
from .segments import Segments
from .wal import WalWriter, wal_bound, wal_name
from .writer import WriteJob

BASE_REPLAY_SHARE = 0.25  # a flush writes a new index base past this many records per row
                          # in the segments sealed since the last one (format: index_from)

__all__ = ["BEHIND_BYTES", "TOTALS", "Commit", "name_wal"]

# seals up to this size, and up to a write buffer of the memory budget
# (Segments.behind_bytes, budget.behind_records), are written in the background; larger
# ones (a flush, a range release, a seal with many cleaning copies) at once, in chunks.
# A cap only (tests set it to 0: no writer thread); the budget's buffer is what binds.
BEHIND_BYTES = (2 + CLEAN_UNITS) * SEAL_BYTES
_CHUNK_BYTES = 8 << 20   # records per pwrite of a seal
# write counters kept over the store's life (committed with every flush, "totals")
TOTALS = ("seals", "cleaned_segments", "user_records", "sealed_records", "cleaned_records",
          "file_bytes_written", "clean_waits", "clean_wait_us")


def name_wal(manifest: dict[str, Any], wal: WalWriter | None) -> None:
    """Name the commit log ``wal`` (or none) in ``manifest`` (``write_manifest`` gives it
    the format version: an older reader must refuse a store whose log it would ignore)."""
    manifest.update(wal=None if wal is None else wal.path.name,
                    wal_salt=None if wal is None else wal.salt)


def _link_or_copy(src: Path, dst: Path, share: bool = True) -> None:
    """Hard-link ``src`` as ``dst`` (immutable files: the link is a snapshot); copy where the
    filesystem refuses links (another device, no link support, too many links). With
    ``share=False`` a full copy that shares no blocks with ``src``."""
    if not share:
        copy_file(src, dst, share=False)
        return
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                             errno.EOPNOTSUPP, errno.EACCES):
            raise
        copy_file(src, dst)


class Commit:
    """Seals, flushes, checkpoints and the commit log of one open store (module docstring).

    It owns what a flush commits: ``count``, ``meta``, the last committed ``manifest``, the
    index base's generation and the first segment it does not reflect (``index_from``),
    whether the disk locations changed since the flush (``index_dirty``), the
    commit-log generation, and the write counters of earlier writers (``totals_base``).
    The region and slots are the ``pool``'s, the segments the ``segments``'; ``stats``: the
    engine's counters (the seal and write ones are counted here).
    """

    def __init__(self, path: Path, manifest: dict[str, Any], pool: Pool, segments: Segments,
                 cleaner: Cleaner, stats: dict[str, int]):
        self.path = path
        self.pool, self.segments, self.cleaner, self.stats = pool, segments, cleaner, stats
        for k in TOTALS:  # the cleaner counts its waits in the same counters
            stats.setdefault(k, 0)
        stats.update((k, stats[k] + v) for k, v in cleaner.stats.items())
        cleaner.stats = stats
        self.count = int(manifest["count"])
        self.meta = dict(manifest.get("meta", {}))
        # no index file (None): no row has been written yet, every row reads as its initial
        # record (create writes nothing of size num_rows: O(1))
        kind = ("index", 0) if manifest["index"] is None else parse_name(str(manifest["index"]))
        if kind is None or kind[0] != "index":
            raise ValueError(f"manifest of {str(path)!r} names the index "
                             f"{manifest['index']!r}, not an index-<gen>.bin file; the store "
                             "is damaged")
        self.gen = kind[1]  # the committed index base (0: none)
        # the base the index rests on now: the committed one, or one a rebase wrote since
        # (a mapped index, ``rebase``): its generation, CRC, whether it has page sums, the
        # rows it lists if sparse (else None), and the first segment it does not reflect
        # (``index_from``)
        self.cur_gen, self.cur_crc = self.gen, manifest.get("index_crc32")
        self.cur_pages = manifest.get("index_pages") is not None
        self.cur_listed = manifest.get("index_entries")
        self.index_from = int(manifest["index_from"])
        self.manifest = dict(manifest)              # the last committed manifest
        self.index_dirty = False                    # disk locations changed since the flush
        # the write counters of earlier writers, committed by their flushes (Engine.stats)
        self.totals_base = {k: int(manifest.get("totals", {}).get(k, 0)) for k in TOTALS}
        wal = manifest.get("wal")
        wkind = None if wal is None else parse_name(str(wal))
        if wal is not None and (wkind is None or wkind[0] != "wal"
                                or not isinstance(manifest.get("wal_salt"), int)):
            raise ValueError(f"manifest of {str(path)!r} names the commit log {wal!r} "
                             f"(salt {manifest.get('wal_salt')!r}), not a wal-<gen>.log file "
                             "with an int salt; the store is damaged")
        self.wal_on = wal is not None            # flushes start a new commit-log generation
        self.wal_bound = wal_bound(pool.num_rows)  # log bytes that make the next step flush
        self.wal: WalWriter | None = None        # the writer's open generation
        self.wal_gen = 0 if wkind is None else wkind[1]
        self.wal_count = self.count              # the count that manifest + log hold
        self.wal_acquires = 0                    # acquire calls that they reflect
        self.wal_spare: Path | None = None       # a retired log file, reused next
        self.prepared: tuple | None = None       # (manifest, index base, new log): prepare

    def totals(self) -> dict[str, int]:
        """The write counters over the store's life: earlier writers' plus this open's."""
        return {k: self.totals_base[k] + int(self.stats[k]) for k in TOTALS}

    # -- seals ----------------------------------------------------------------------------------
    def make_room(self, need: int, pinned: int) -> None:
        """The pool's eviction (``Pool.acquire``): CLOCK victims, the dirty ones sealed."""
        victims, ep = self.pool.evict(need, pinned)
        if victims.shape[0]:
            try:
                self.seal(victims, evict=True, ep=ep)
            except BaseException:
                self.segments.quiesce()  # the step's error leaves no write running behind it
                raise

    def seal(self, slots: np.ndarray, evict: bool, ep: int | None = None) -> None:
        """Write the records of ``slots`` (dirty) as one new segment, plus cleaning copies.

        ``evict``: the slots leave the region afterwards (their rows point at the new
        segment); else they stay resident, clean.
        """
        pool, segs, cleaner = self.pool, self.segments, self.cleaner
        segs.settle(block=False)  # raises a failed background write, changing nothing
        if ep is None:
            ep = pool.next_seal_epoch()
        pool.mark_sealing(slots, ep)
        n_new_loc = int(np.count_nonzero(pool.slot_locs(slots) == 0))
        res, copies = cleaner.choose(slots.shape[0], n_new_loc, ep)
        moving = slots.shape[0] + sum(r.shape[0] for r in res) + sum(c.ks.shape[0]
                                                                     for c in copies)
        if pool.index.full(moving):  # before any row moves: the new base is this state
            self.rebase()
        if copies:
            crash_point("clean")
        rslots = np.concatenate([slots, *res]) if res else slots
        m = rslots.shape[0]
        crow = [c.seg.rows[c.ks] for c in copies]
        n = m + sum(c.ks.shape[0] for c in copies)
        if n == 0:
            return
        sid = segs.next_segment
        if sid > MAX_SEGMENT_ID:  # pragma: no cover - 2**31 seals
            raise OverflowError(f"log store {str(self.path)!r} ran out of segment ids")
        rows = pool.rows_of_slots(rslots)
        if crow:
            rows = np.concatenate([rows, *crow])
        steps = np.concatenate([np.full(m, self.count, np.int64),
                                *[c.seg.steps[c.ks] for c in copies]])
        path = self.path / seg_name(sid)
        stride, dtype = pool.stride, pool.dtype
        size = segment_geometry(n, stride, dtype.itemsize)[3]  # the file's bytes
        # the victims' live records are in memory (cleaner: read in the background), or
        # in their segment's mapping; each copy is checked against its sums first
        if n * segs.rec_pitch <= min(BEHIND_BYTES, segs.behind_bytes):
            # write-behind (writer): gather the records into a buffer of the segment's
            # own, which serves its reads until the file is written and mapped
            raw = segs.seal_buffer(n)  # laid out as in the file: each record, then its sums
            recs = records_of(raw, stride, dtype)
            pool.gather_slots(rslots, recs)
            off = m
            for c in copies:
                k = c.ks.shape[0]
                # straight into the buffer, no temporary of k records (mode="clip": with
                # the default "raise", numpy buffers ``out``); idx is in range by construction
                np.take(c.records, c.idx, axis=0, out=recs[off:off + k], mode="clip")
                check_records(c.seg, c.ks, recs[off:off + k], c.sums_of())  # never copy damage
                off += k
            recs.flags.writeable = False  # as the mapping that replaces it
            if copies:
                crash_point("clean-copied")
            segs.write_behind(WriteJob(path, sid, rows, steps, raw, self.count,
                                       segs.take_spare(size), segs.head, stride, dtype))
            segs.add(Segment(sid, n, path, rows, steps, recs, size))
        else:  # a large seal (a flush, a range release): streamed in chunks, written now
            pitch = segs.rec_pitch  # a record and its sums, as the file holds them
            chunk = max(1, _CHUNK_BYTES // pitch)

            def blocks():
                for lo in range(0, m, chunk):
                    idx = rslots[lo:lo + chunk]
                    raw = np.empty((idx.shape[0], pitch), np.uint8)
                    pool.gather_slots(idx, records_of(raw, stride, dtype))
                    yield raw
                    raw = None  # one chunk at a time (staging): not held past its write
                for c in copies:
                    for lo in range(0, c.ks.shape[0], chunk):
                        idx = c.idx[lo:lo + chunk]
                        raw = np.empty((idx.shape[0], pitch), np.uint8)
                        blk = records_of(raw, stride, dtype)
                        np.take(c.records, idx, axis=0, out=blk, mode="clip")
                        check_records(c.seg, c.ks[lo:lo + chunk], blk,  # never copy damage
                                      c.sums_of(lo, lo + chunk))
                        yield raw
                        raw = blk = None

            write_segment(path, sid, rows, steps, blocks(), stride, dtype, self.count,
                          recycle=segs.take_spare(size), head=segs.head)
            segs.map(path, sid, n)
        for c in copies:  # a failed seal keeps them: its retry finds them read
            cleaner.done_with(c)
        segs.sealed(sid, n)
        self.index_dirty = True
        crash_point("sealed")
        # the old on-disk copies of everything in the seal are dead now
        newloc = np.int64((sid << 32) + 1) + np.arange(n, dtype=np.int64)
        rrows = rows[:m]  # the rows of the region's slots in the seal
        old = [pool.slot_locs(rslots)]
        segs.live_total += int(np.count_nonzero(old[0] == 0))
        pool.index.set(rrows, newloc[:m])
        n_user = pool.sealed_slots(rslots, newloc[:m])
        off = m
        for c, r in zip(copies, crow, strict=True):
            old.append(np.int64((c.seg.id << 32) + 1) + c.ks)
            pool.index.set(r, newloc[off:off + c.ks.shape[0]])
            off += c.ks.shape[0]
        dead = np.concatenate(old)
        gone = segs.kill(dead[dead > 0] - 1)
        if gone:
            for sid_gone in gone:
                cleaner.forget(sid_gone)
            segs.drop(gone)
        for c in copies:  # a cleaned segment has no live record left
            if segs.live[c.seg.id] != 0:  # pragma: no cover - an engine bug
                raise RuntimeError(f"log store {str(self.path)!r}: cleaned segment "
                                   f"{c.seg.id} still has {segs.live[c.seg.id]} live records")
        if evict:
            pool.free_slots(slots)
        cleaner.read_ahead()  # the next seals' victims, in the background
        st = self.stats
        st["seals"] += 1
        st["cleaned_segments"] += len(copies)
        st["sealed_records"] += n_user
        st["cleaned_records"] += n - n_user
        st["file_bytes_written"] += size

    def seal_all(self, slots: np.ndarray, evict: bool) -> None:
        """Seal many dirty slots (a flush, a range release) as segments of at most a seal
        unit each, in order: a segment as large as the region would later have to be
        cleaned in one piece, its live records copied in one seal (seconds)."""
        unit = self.pool.seal_unit
        for lo in range(0, slots.shape[0], unit):
            self.seal(slots[lo:lo + unit], evict=evict)

    # -- flushing -------------------------------------------------------------------------
    def flush(self, count: int | None = None) -> None:
        """Make everything so far durable, at step ``count`` (default: ``self.count``); see
        ``LogStore.flush``."""
        if self.prepare(count, if_changed=True) is not None:
            self.install()

    def _not_in_doubt(self) -> None:
        if self.prepared is not None:
            raise RuntimeError(
                f"log store {str(self.path)!r} has a prepared commit (a commit of several "
                "stores together) that was neither installed nor cancelled; it cannot flush "
                "on its own. Close the process; dsa_core.open installs the commit if its "
                "group committed it")

    def _seal_dirty(self) -> None:
        dirty = self.pool.dirty_slots()
        if dirty.shape[0]:
            self.seal_all(dirty, evict=False)
        self.segments.settle(block=True)  # every background write done (or retried) first
        crash_point("flush-sealed")

    def prepare(self, count: int | None = None, *, if_changed: bool = False
                ) -> dict[str, Any] | None:
        """The first half of a flush: every record sealed and synced, the next index
        generation and commit log written, and the manifest that would commit them built
        but not written (returned: a copy). Nothing is installed: without :meth:`install`
        the store reopens at its last commit and the new files are garbage. For a commit of
        several stores together (``dsa_core._group``): each member prepares, the group's
        commit file records every manifest, then each member installs its own.
        ``if_changed`` (a flush): None, nothing written past the seals, when the manifest
        already holds the count and meta, no seal changed the index and the commit log's
        generation need not change."""
        self._not_in_doubt()
        count = self.count if count is None else check_count(count)
        meta = check_meta(self.meta)
        self.count = count
        try:
            self._seal_dirty()
            if if_changed and not self.index_dirty and self.count == self.manifest["count"] \
                    and meta == self.manifest.get("meta", {}) and not self._wal_rotation_due():
                return None
            return self._prepare_sealed(meta)
        except BaseException:
            self.segments.quiesce()  # the error leaves no write running behind it
            raise

    def _prepare_sealed(self, meta: dict[str, Any]) -> dict[str, Any]:
        """:meth:`prepare` once every dirty slot is sealed (``meta`` checked)."""
        segs = self.segments
        segs.sync_new()
        crash_point("flush-synced")
        manifest = dict(self.manifest)
        base = (self.cur_gen, self.cur_crc, self.cur_pages, self.cur_listed, self.index_from)
        if self.index_dirty and not self.pool.index.mapped and self.base_due():
            gen = self.cur_gen + 1
            crc, listed = self._write_base(gen)
            base = (gen, crc, True, listed, int(segs.next_segment))
            crash_point("flush-index")
        gen, crc, pages, listed, ifrom = base
        manifest.update(index=index_name(gen) if gen else None, index_crc32=crc if gen else None,
                        index_from=ifrom)
        manifest.pop("index_pages", None)
        manifest.pop("index_entries", None)
        if pages and gen:
            manifest["index_pages"] = INDEX_PAGE_ROWS
            if listed is not None:
                manifest["index_entries"] = int(listed)
        new_wal = self._start_wal() if self.wal_on else None
        fsync_path(self.path)  # the new files' names are durable before the manifest is
        listed = sorted(segs.segs)
        manifest.update(totals=self.totals(), count=int(self.count), segments=listed,
                        next_segment=int(segs.next_segment), meta=meta,
                        live=[int(segs.live[sid]) for sid in listed],
                        located=int(segs.live_total))
        name_wal(manifest, new_wal)
        self.prepared = (manifest, base, new_wal)
        return dict(manifest)

    def rebase(self) -> None:
        """A mapped index whose delta is full: write base and delta together as the next
        base file, map it and empty the delta (``index.RowIndex``). Not a commit: the new
        base reflects every seal so far, and the next flush's manifest names it (with
        ``index_from`` the next segment id); until then the committed base stays, and a base
        that no manifest named is deleted when the next replaces it (garbage at an open
        after a crash)."""
        pool, segs = self.pool, self.segments
        gen = self.cur_gen + 1
        path = self.path / index_name(gen)
        crc, listed = self._write_base(gen)
        crash_point("rebase")
        pool.index.map(path, *map_index(path, pool.num_rows, crc, listed))
        old = self.cur_gen
        self.cur_gen, self.cur_crc, self.cur_pages, self.cur_listed = gen, crc, True, listed
        self.index_from = int(segs.next_segment)
        self.stats["index_rebases"] += 1
        if old and old != self.gen:  # written by an earlier rebase, named by no manifest
            (self.path / index_name(old)).unlink(missing_ok=True)

    def _write_base(self, gen: int) -> tuple[int, int | None]:
        """Write the index as it is now (base and delta) as base file ``gen``: dense, or
        sparse when few rows have a location (``format.write_index``); ``(crc, listed)``."""
        return write_index(self.path / index_name(gen), self.pool.num_rows,
                           self.pool.disk_entries(), int(self.segments.live_total))

    def replay_records(self) -> int:
        """Records in the segments an open would apply over the index base."""
        segs = self.segments
        return int(sum(segs.seg_n[sid] for sid in segs.segs if sid >= self.index_from))

    def base_due(self) -> bool:
        """A flush writes a new index base: the segments sealed since the last one hold more
        than ``BASE_REPLAY_SHARE`` records per row of the table (an open reads their row ids,
        8 bytes per record, against the base's 8 bytes per row; a base costs 8 bytes per
        row to write, so at most ``8 / BASE_REPLAY_SHARE`` = 32 bytes per sealed record)."""
        return self.replay_records() > BASE_REPLAY_SHARE * self.pool.num_rows

    def cancel(self) -> None:
        """Drop a prepared commit: its files are garbage (the next one rewrites them)."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None and prepared[2] is not None:
            prepared[2].close()  # not named by any manifest: the next generation's file
            self.wal_spare = prepared[2].path

    def install(self, durable: bool = True) -> None:
        """The second half of a flush: write the prepared manifest (the commit point of a
        lone store), then delete what it no longer references. ``durable=False``: the
        manifest is not synced (a group's commit file holds it; ``_engine.sync_commit`` later)."""
        manifest, base, new_wal = self.prepared
        gen = base[0]
        try:
            write_manifest(self.path, manifest, durable)
        except BaseException:
            self.cancel()
            raise
        self.prepared = None
        crash_point("flush-committed")
        segs = self.segments
        old_gen, self.gen = self.gen, gen
        self.cur_gen, self.cur_crc, self.cur_pages, self.cur_listed, self.index_from = base
        old_wal = self.manifest.get("wal")
        self.manifest = manifest
        segs.committed_now()
        self.index_dirty = False
        if old_gen and old_gen != gen:
            (self.path / index_name(old_gen)).unlink(missing_ok=True)
        segs.delete_doomed()
        self._retire_wal(old_wal, new_wal)

    def checkpoint(self, dest, count: int | None = None, *, overwrite: bool = False,
                   share: bool = True) -> Path:
        """Flush, then write a snapshot of the flushed state to ``dest``; returns ``dest``
        (see ``LogStore.checkpoint``)."""
        dest = Path(dest)
        if dest.resolve() == self.path.resolve():
            raise ValueError(f"checkpoint destination {str(dest)!r} is the live store itself; "
                             "choose another directory")
        if dest.exists() and not overwrite:
            raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                                  "overwrite=True to replace it")
        self.flush(count)
        manifest = dict(self.manifest)
        name_wal(manifest, None)  # flushed: the snapshot needs no commit log
        # a snapshot belongs to no commit group (dsa_core._group): the live store does
        manifest["meta"] = {k: v for k, v in manifest.get("meta", {}).items() if k != "group"}
        dest.parent.mkdir(parents=True, exist_ok=True)
        with staged_dir(dest, overwrite) as tmp:
            for sid in manifest["segments"]:
                _link_or_copy(self.path / seg_name(sid), tmp / seg_name(sid), share)
                crash_point("ckpt-link")
            if manifest["index"] is not None:  # immutable, as the segments: linked
                _link_or_copy(self.path / manifest["index"], tmp / manifest["index"], share)
            write_manifest(tmp, manifest)
            crash_point("ckpt-staged")
        return dest

    # -- the commit log (durability="step") -----------------------------------------------
    def step_ready(self, count: int, meta: dict[str, Any] | None = None) -> bool:
        """True when step ``count + 1`` may be logged now (``LogStore.commit_step``).

        That is: a commit-log generation is open and healthy, ``count`` is the store's
        count and the last one the manifest plus the log hold, no acquire (hence no write,
        no unlogged step) changed the region since, the log is under ``wal_bound`` bytes,
        and ``meta`` (when given) is the committed one. Then the state that a replay
        rebuilds is exactly the current one, and an entry appended now replays onto it.
        """
        w = self.wal
        return (w is not None and not w.broken and self.wal_on
                and self.count == int(count) == self.wal_count
                and self.stats["acquires"] == self.wal_acquires
                and w.offset < self.wal_bound
                and (meta is None or check_meta(meta) == self.manifest.get("meta", {})))

    def begin_step(self, count: int, meta: dict[str, Any]) -> None:
        """Unless :meth:`step_ready`, turn ``wal_on`` on and flush at ``count`` with
        ``meta`` (see ``LogStore.begin_step``)."""
        if self.step_ready(count, meta):
            return
        self.wal_on = True
        self.meta = meta
        self.flush(count)

    def commit_step(self, t: int, rows: np.ndarray, slots: np.ndarray,
                    records: np.ndarray) -> None:
        """Append step ``t`` to the commit log, then copy ``records`` into the region (see
        ``LogStore.commit_step``)."""
        if self.wal is None or int(t) != self.wal_count + 1 or self.count != self.wal_count:
            raise RuntimeError(f"log store {str(self.path)!r}: commit_step({t}) without "
                               f"begin_step({int(t) - 1}) (the log holds step "
                               f"{self.wal_count}, the engine is at {self.count})")
        self.wal.append(int(t), rows, records)
        if slots.shape[0]:
            self.pool.put_slots(slots, records)
        self.count = self.wal_count = int(t)
        self.wal_acquires = self.stats["acquires"]

    def wal_bytes(self) -> int:
        """Bytes of the open commit-log generation holding entries (0 without one)."""
        return 0 if self.wal is None else self.wal.offset

    def _wal_rotation_due(self) -> bool:
        """A flush must start a new commit-log generation even if nothing else changed."""
        if self.wal_on != (self.manifest.get("wal") is not None):
            return True
        w = self.wal
        return self.wal_on and (w is None or w.broken or w.offset > 0)

    def _start_wal(self) -> WalWriter:
        """The next generation's file, empty for readers (a fresh salt); not yet named."""
        path = self.path / wal_name(self.wal_gen + 1)
        spare, self.wal_spare = self.wal_spare, None
        w = WalWriter.start(path, int.from_bytes(os.urandom(8), "little"), self.pool.stride,
                            self.pool.dtype, recycle=spare)
        crash_point("wal-started")
        return w

    def _retire_wal(self, old_name: str | None, new: WalWriter | None) -> None:
        """After a commit: the previous generation's log is no longer named. Kept under the
        name of the generation after ``new`` for reuse (:meth:`_start_wal`), or deleted
        when no log is kept (``wal_on`` off)."""
        if self.wal is not None:
            self.wal.close()
        self.wal = new
        self.wal_count = self.count
        self.wal_acquires = self.stats["acquires"]
        if new is not None:
            self.wal_gen = parse_name(new.path.name)[1]
        if old_name is None:
            return
        old = self.path / old_name
        if new is not None:
            spare = self.path / wal_name(self.wal_gen + 1)
            try:
                os.replace(old, spare)
                self.wal_spare = spare
            except FileNotFoundError:  # pragma: no cover - removed by hand
                pass
        else:
            old.unlink(missing_ok=True)
            if self.wal_spare is not None:
                self.wal_spare.unlink(missing_ok=True)
                self.wal_spare = None
        crash_point("wal-retired")

    def keep_spare(self) -> None:
        """At open: a retired log kept under the next generation's name is reused next."""
        spare = self.path / wal_name(self.wal_gen + 1)
        self.wal_spare = spare if spare.exists() else None

    def resume_wal(self) -> None:
        """At open, with nothing to replay: append to the named log from its start."""
        self.wal = WalWriter.resume(self.path / self.manifest["wal"],
                                    int(self.manifest["wal_salt"]), 0, self.pool.stride,
                                    self.pool.dtype)
        self.wal_count, self.wal_acquires = self.count, self.stats["acquires"]

    def close_wal(self) -> None:
        """Close the open commit-log generation's file (nothing is written)."""
        if self.wal is not None:
            self.wal.close()
