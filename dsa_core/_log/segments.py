"""The segment table: the live segments of an open log store, mapped or still being written.

A segment is *live* while at least one row's newest on-disk record lies in it. Per segment
id the table counts its records (``seg_n``) and live records (``live``) and keeps the
address of its records in memory (``seg_addr``: the read-only mapping of its file, or the
buffer of a pending write, 0: none), so that a location ``((id << 32) | k) + 1`` turns into
an address without a lookup. ``total_records`` counts the records of the live segments,
``live_total`` the rows that have an on-disk location.

The files' lifecycle: ``unsynced`` (written since the last flush: fsync'd by the next),
``committed`` (listed by the last manifest), ``doomed`` (of those, dead: deleted right after
the next manifest that no longer lists them is committed). A segment no manifest ever listed
is private to this writer: when it dies its file becomes a *spare* (``spares``, at most
``SPARE_SEGMENTS``; past that it is deleted), which a later seal renames and overwrites
instead of creating a file (``take_spare``). Deleting a file frees its blocks, and on a
filesystem mounted with ``discard`` that sends the disk a discard of the whole file when the
journal commits: measured on this project's VM, a 27 MiB discard held the disk for 14 ms to
1 s, and the steps' reads queued behind it. A spare keeps its dead name, which no manifest
lists, so a crash leaves it to the next open's cleanup; ``close`` deletes the spares. A
committed segment is never reused: a reader (``mode="r"``) or a checkpoint may still use the
file under the manifest it read. Nor is a spare whose mapping something in this process
still holds (a range load's thread reading the segment as it died): overwriting or cutting
that file under a live mapping would hand the reader other bytes, or kill the process with
SIGBUS past the new end (seen once in CI); it waits until the mapping is gone.

Background writes (``writer``): a seal small enough is handed to this process's
:class:`~.writer.SegmentWriter`. Until written it is *pending* (``pending``): its records
are read from the seal's buffer, which :meth:`Segments.settle` replaces by the file's
mapping (same bytes) once the write is done, and keeps for the next seals (``spare``).
Those buffers are part of the memory budget (``budget``): each holds ``behind_records``
records, and at most ``budget.WRITE_BUFFERS`` of them exist at once, pending or spare; a
seal that needs one while that many are pending waits for the oldest write first.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from pathlib import Path

import numpy as np

from .._os import fsync_path
from .._paging import memory_limit
from .._pool import run_chunked
from . import format as _format
from .budget import WRITE_BUFFERS, behind_records
from .format import (
    SEG_VERSION,
    Segment,
    SegmentError,
    check_meta,
    crash_point,
    map_segment,
    record_pitch,
    seg_name,
)
from .read import FOREGROUND, advise_records, cold
from .sums import KIND_NONE, KIND_ONE, KIND_SPLIT, gather_checked
from .writer import SegmentWriter, WriteJob

__all__ = ["CACHE_SHARE", "LOW32", "cache_window", "SPARE_SEGMENTS", "Segments"]

# written segments whose pages stay in the page cache (the newest, as one window): this share
# of the memory the process may use (_paging.memory_limit, cgroup-aware; CACHE_MAX caps it
# when set); older ones are dropped (writer)
CACHE_SHARE = 0.125
CACHE_MAX: int | None = None  # None: the share alone; benchmarks set a cap for A/B runs
LOW32 = np.int64(0xFFFFFFFF)
# dead, never-committed segment files kept for the next seals to overwrite (module docstring);
# 0: every dead file is deleted
SPARE_SEGMENTS = 8


def _addr_of(sums) -> int:
    """The data address of a segment's sums array, 0 for none (nothing to check)."""
    return 0 if sums is None else int(sums.__array_interface__["data"][0])


def cache_window() -> int:
    """Bytes of written segments the writer keeps in the page cache: ``CACHE_SHARE`` of the
    memory the process may use, at most ``CACHE_MAX`` when a benchmark sets one."""
    share = int(CACHE_SHARE * memory_limit())
    return share if CACHE_MAX is None else min(share, int(CACHE_MAX))


def _mapping_of(arr):
    """The file mapping (``format._ReadOnlyMap``) under a mapped segment's array, else None
    (a segment still in its write buffer)."""
    while arr is not None:
        if isinstance(arr, _format._ReadOnlyMap):
            return arr
        arr = getattr(arr, "base", None)
    return None


class Segments:
    """The live segments of one open store (see the module docstring)."""

    def __init__(self, path: Path, stride: int, dtype: np.dtype, seal_unit: int,
                 next_segment: int, head: int = 0, num_rows: int = 1 << 62):
        self.path = path
        self.num_rows = int(num_rows)  # row ids of a segment lie in [0, num_rows)
        self.stride, self.dtype = stride, dtype
        self.rec_bytes = stride * dtype.itemsize
        self.head = int(head)  # the record bytes a segment's first sum covers (sums.head_bytes)
        # bytes per record in the segments written now (and in the seals' buffers): the
        # record, then its sums (format.record_pitch); what a read of one record touches
        self.rec_pitch = record_pitch(stride, dtype.itemsize)
        self.seal_unit = seal_unit
        # the largest seal written behind, and the size of every write buffer (budget)
        self.behind_records = behind_records(seal_unit)
        self.behind_bytes = self.behind_records * self.rec_pitch  # a write buffer's bytes
        self.next_segment = next_segment
        self.segs: dict[int, Segment] = {}          # live segments (>= 1 live record), mapped
        self.live = np.zeros(16, np.int64)          # live records per segment id
        self.seg_n = np.zeros(16, np.int64)         # records per segment id
        self.seg_addr = np.zeros(16, np.int64)      # address of its mapped records, 0: none
        self.sum_addr = np.zeros(16, np.int64)      # address of its mapped sums, 0: none
        self.chk_addr = np.zeros(16, np.int64)      # address of the sums reads check, 0: none
        self.pitch = np.zeros(16, np.int64)         # bytes from a record to the next
        self.chk_pitch = np.zeros(16, np.int64)     # ... from a record's sums to the next's
        self.kind = np.zeros(16, np.int64)          # how its reads are checked (sums.KIND_*)
        self.total_records = 0                      # records of the live segments
        self.live_total = 0                         # rows with an on-disk location
        self.committed: set[int] = set()            # segments the last manifest lists
        self.doomed: set[int] = set()               # of those, dead: delete after next commit
        self.unsynced: set[int] = set()             # written since the last flush
        self.pending: dict[int, WriteJob] = {}      # segments still being written (writer)
        self.writer: SegmentWriter | None = None
        self.spare: list[np.ndarray] = []           # seal buffers to reuse (no page faults)
        self.spares: list[tuple[Path, int]] = []    # dead files to overwrite: (path, bytes)
        self.spare_maps: dict[Path, weakref.ref] = {}  # a spare's old mapping, while it lives
        self.spares_pid = os.getpid()               # whose they are (a forked child: not its)
        self.recycled = 0                           # segment files overwritten, this open
        self.on_recycle = None  # called before a spare is handed out (LogStore: a forked
        #                         child may still map that file: its reads must refuse)

    # -- the table ---------------------------------------------------------------------------
    def ensure_id(self, seg_id: int) -> None:
        """Grow the per-id arrays to hold ``seg_id``."""
        if seg_id >= self.live.shape[0]:
            size = max(2 * self.live.shape[0], seg_id + 1)
            for name in ("live", "seg_n", "seg_addr", "sum_addr", "chk_addr", "pitch",
                         "chk_pitch", "kind"):
                old = getattr(self, name)
                new = np.zeros(size, np.int64)
                new[:old.shape[0]] = old
                setattr(self, name, new)

    def map(self, path: Path, sid: int, n: int, version: int = SEG_VERSION) -> None:
        """Map segment ``sid`` (``n`` records, segment format ``version``) and note where
        its records and their sums lie."""
        seg = self.segs[sid] = map_segment(path, sid, n, self.stride, self.dtype, version,
                                           self.head)
        self.seg_addr[sid] = seg.records.__array_interface__["data"][0]
        self.pitch[sid] = record_pitch(self.stride, self.dtype.itemsize, version)
        self.chk_addr[sid] = _addr_of(seg.sums)
        if version >= 3:  # beside each record: read with it
            self.sum_addr[sid] = 0
            self.chk_pitch[sid] = self.pitch[sid]
            self.kind[sid] = KIND_SPLIT
        else:  # a part of their own (a version-1 segment's: computed in memory, not read)
            self.sum_addr[sid] = self.chk_addr[sid] if version == 2 else 0
            self.chk_pitch[sid] = 8
            self.kind[sid] = KIND_ONE

    def add(self, seg: Segment) -> None:
        """A segment whose records are in memory (a pending write's buffer)."""
        self.segs[seg.id] = seg
        self.seg_addr[seg.id] = seg.records.__array_interface__["data"][0]
        self.pitch[seg.id] = seg.records.strides[0]
        self.sum_addr[seg.id] = 0
        self.chk_addr[seg.id] = 0
        self.chk_pitch[seg.id] = 0
        self.kind[seg.id] = KIND_NONE

    def sealed(self, sid: int, n: int) -> None:
        """Count the new segment ``sid`` of ``n`` records, all live, not yet fsync'd."""
        self.next_segment = sid + 1
        self.ensure_id(sid + 1)
        self.unsynced.add(sid)
        self.seg_n[sid] = n
        self.live[sid] = n
        self.total_records += n

    def kill(self, dead: np.ndarray) -> list[int]:
        """The records at locations ``dead`` (0-based, ``(id << 32) | k``) are superseded:
        count them; returns the segments left without a live record."""
        if not dead.shape[0]:
            return []
        ids, cnt = np.unique(dead >> 32, return_counts=True)
        self.live[ids] -= cnt
        return ids[self.live[ids] == 0].tolist()

    def drop(self, ids: list[int]) -> None:
        """Segments without a live record: unmap; delete the file now if no manifest lists
        it, else after the next commit."""
        for sid in ids:
            seg = self.segs.pop(sid)
            self.seg_addr[sid] = 0
            self.sum_addr[sid] = 0
            self.chk_addr[sid] = 0
            self.kind[sid] = KIND_NONE
            job = self.pending.pop(sid, None)
            if job is not None:  # let its write end before the file goes
                self.wait_job(job)
                self.reuse(job.records)
            self.total_records -= seg.n
            if sid in self.committed:
                self.doomed.add(sid)
            else:
                self.unsynced.discard(sid)
                self.retire(seg.path, seg.nbytes, _mapping_of(seg.records))

    # -- spare files ---------------------------------------------------------------------------
    def retire(self, path: Path, nbytes: int, mapping=None) -> None:
        """A dead segment file no manifest ever listed: keep it as a spare, or delete it when
        ``SPARE_SEGMENTS`` are kept already (or in a forked child, whose files are not its
        own to reuse). ``mapping``: the file's mapping (``format._ReadOnlyMap``), if it was
        mapped: the spare is not taken while anything still holds it."""
        if (len(self.spares) < SPARE_SEGMENTS and self.spares_pid == os.getpid()
                and path.exists()):  # a failed write left no file
            self.spares.append((path, int(nbytes)))
            if mapping is not None:
                self.spare_maps[path] = weakref.ref(mapping)
            return
        path.unlink(missing_ok=True)  # a mapping still held keeps the old file's pages

    def _spare_free(self, path: Path) -> bool:
        """Nothing in this process holds the old mapping of spare ``path`` any more."""
        ref = self.spare_maps.get(path)
        if ref is None:
            return True
        if ref() is None:
            del self.spare_maps[path]
            return True
        return False

    def take_spare(self, nbytes: int) -> Path | None:
        """A spare file for a segment of ``nbytes``, removed from the spares; None if there
        is none. The largest not larger (the file grows: no block freed), else the smallest
        (cut to size: only its tail's blocks are freed)."""
        if not self.spares or self.spares_pid != os.getpid():
            return None
        free = [i for i, (p, _) in enumerate(self.spares) if self._spare_free(p)]
        if not free:
            return None
        below = [i for i in free if self.spares[i][1] <= nbytes]
        if below:
            i = max(below, key=lambda j: self.spares[j][1])
        else:
            i = min(free, key=lambda j: self.spares[j][1])
        self.recycled += 1
        if self.on_recycle is not None:
            self.on_recycle()
        self.spare_maps.pop(self.spares[i][0], None)
        return self.spares.pop(i)[0]

    def delete_spares(self) -> None:
        """Delete the spare files (at close: nothing of the store is left but what its
        manifest lists)."""
        spares, self.spares = self.spares, []
        self.spare_maps.clear()
        if self.spares_pid != os.getpid():
            return
        for path, _ in spares:
            path.unlink(missing_ok=True)

    # -- reading -------------------------------------------------------------------------------
    def read_into(self, locs: np.ndarray, out: np.ndarray, out_idx: np.ndarray,
                  cols: slice = slice(None)) -> None:
        """``out[out_idx[i]] = record at locs[i]`` (locations > 0; columns ``cols``; ``out``
        C-contiguous). The records not in the page cache are read ahead first, all at once;
        then one kernel (``sums.gather_checked``, on the kernels' threads) copies every
        record in location order, whatever segment it lies in, and checks each one copied
        out of a segment file against its sum on the copy it serves: a damaged one is never
        written to ``out`` and raises ``SegmentError`` naming the file and the rows (``out``
        then holds the other records: both callers drop it).

        A read whose records a sample finds cached holds ``read.FOREGROUND`` while it copies;
        one that finds them on the disk queues their reads and does not (read's docstring:
        which reads go first)."""
        n = locs.shape[0]
        if not n:
            return
        order = np.argsort(locs, kind="stable")
        used = locs[order] - 1
        sids = used >> 32
        ks = used & LOW32
        addrs = self.seg_addr[sids] + ks * self.pitch[sids]
        on_disk = cold(addrs, self.rec_pitch)
        with contextlib.nullcontext() if on_disk else FOREGROUND:
            if on_disk:  # queue the reads of the records and of their sums all at once
                # (queue depth), then copy: the copy waits only for reads in flight (read)
                advise_records(addrs, self.rec_pitch, self.sum_addresses(sids, ks))
            held = [self.segs.get(int(sid)) for sid in np.unique(sids)]  # alive while copied
            if None in held:  # pragma: no cover - an engine bug: verify() would report it
                sid = int(np.unique(sids)[held.index(None)])
                raise RuntimeError(f"log store {str(self.path)!r}: a location points at "
                                   f"segment {sid}, which is not live; run verify()")
            kinds = self.kind[sids] if _format.CHECK_RECORDS else np.zeros(n, np.int64)
            sums = self.chk_addr[sids] + ks * self.chk_pitch[sids]
            isz = self.dtype.itemsize
            b0, b1, _ = cols.indices(self.stride)
            dest = np.ascontiguousarray(out_idx[order], np.int64)
            rows = out.view(np.uint8).reshape(out.shape[0], -1)
            bad = np.zeros(n, np.uint8)
            run_chunked(gather_checked, (addrs, sums, kinds, self.rec_bytes, self.head,
                                         b0 * isz, b1 * isz, rows, dest, bad), n, 64)
            del held
            if bad.any():  # a damaged record is never served: name the first segment's
                first = np.flatnonzero(bad)
                sid = int(sids[first[0]])
                wrong = first[sids[first] == sid]
                raise SegmentError(_format._record_damage(self.segs[sid].path, ks[wrong],
                                                          self.segs[sid].rows))

    def addresses(self, locs: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Segment]]:
        """The addresses of the records at ``locs`` (locations > 0), of their sums (those
        read from a file: :meth:`sum_addresses`) and their segments."""
        used = locs - 1
        sids = used >> 32
        ks = used & LOW32
        addrs = self.seg_addr[sids] + ks * self.pitch[sids]
        return (addrs, self.sum_addresses(sids, ks),
                [self.segs[int(s)] for s in np.unique(sids)])

    def sum_addresses(self, sids: np.ndarray, ks: np.ndarray) -> np.ndarray:
        """The mapped addresses of the sums of records ``ks`` of segments ``sids`` whose
        sums lie in their file (8 bytes each), to read ahead with the records: a record read
        from a file is checked against its sum, and a sum not in the page cache is one more
        read (``format.map_segment``)."""
        base = self.sum_addr[sids]
        on = base != 0
        return base[on] + ks[on] * 8

    def check_meta(self, seg: Segment) -> None:
        """Before ``seg``'s row ids or steps are used (cleaning, checks): the CRCs an open
        left for later (``format.check_meta``; once). Raises ``SegmentError``."""
        if seg.unchecked:
            check_meta(seg, self.num_rows)

    def check_rows_of_records(self, disk: np.ndarray) -> list[str]:
        """Each located row's record must carry that row's id (one pass per segment)."""
        problems = []
        rows = np.flatnonzero(disk > 0)
        used = disk[rows] - 1
        order = np.argsort(used, kind="stable")
        used, rows = used[order], rows[order]
        sids = used >> 32
        cuts = np.flatnonzero(sids[1:] != sids[:-1]) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), sids.shape[0]], strict=True):
            if a == b:
                continue
            sid = int(sids[a])
            seg = self.segs.get(sid)
            if seg is None:
                problems.append(f"rows {rows[a:b][:5].tolist()} point at segment {sid}, which "
                                "has no live mapping")
                continue
            ks = used[a:b] & LOW32
            try:
                self.check_meta(seg)
            except SegmentError as exc:
                problems.append(str(exc))
                continue
            if (ks >= seg.n).any():
                problems.append(f"rows {rows[a:b][ks >= seg.n][:5].tolist()} point past the end "
                                f"of segment {sid} ({seg.n} records)")
                continue
            wrong = seg.rows[ks] != rows[a:b]
            if wrong.any():
                i = int(np.flatnonzero(wrong)[0])
                problems.append(f"row {int(rows[a + i])} points at record {int(ks[i])} of "
                                f"segment {sid}, which holds row {int(seg.rows[ks[i]])}")
        return problems

    # -- background writes -----------------------------------------------------------------
    def write_behind(self, job: WriteJob) -> None:
        """Hand ``job`` to this process's writer thread (a forked child writes at once)."""
        w = self.writer
        if w is None or w.pid != os.getpid():
            if w is None:
                w = self.writer = SegmentWriter(cache_bytes=cache_window())
            else:  # inherited through fork: its thread is the parent's
                job.run()
                if job.error is not None:
                    raise job.error
                return
        self.pending[job.sid] = w.submit(job)

    def wait_job(self, job: WriteJob) -> None:
        """Wait for a background write; a writer thread that ended without finishing it (it
        cannot, short of an interpreter bug) is an error, not a hang."""
        while not job.done.wait(1.0):
            w = self.writer
            if w is None or not w.alive:  # pragma: no cover - see the docstring
                raise RuntimeError(
                    f"log store {str(self.path)!r}: the segment writer thread ended before "
                    f"writing segment {job.sid}; abandon this state and open the store again "
                    "(it reopens at its last flush)")

    def quiesce(self) -> None:
        """Wait until no background write is running, whatever its outcome (a write that
        failed stays pending: the next :meth:`settle` retries it). Called when a seal or a
        flush raises: the error then reaches its caller with nothing left changing the
        directory behind it (the writer thread removes the file of a write that fails), so
        the files are as a kill -9 at that moment would leave them, and a caller that copies
        the directory (a backup after a full disk) copies a still one."""
        for job in list(self.pending.values()):
            try:
                self.wait_job(job)
            except RuntimeError:  # pragma: no cover - a writer thread gone (wait_job)
                return

    def seal_buffer(self, n: int) -> np.ndarray:
        """An ``(n, pitch)`` byte buffer for a background seal, its rows laid out as in the
        file (each record, then its sums: ``format.records_of`` views its records; the
        writer fills the sums in): a spare one when it is large
        enough (fresh memory costs a page fault per page, as much as the copy itself), else
        a new one of ``behind_records`` records (or ``n``, if more). At most
        ``WRITE_BUFFERS`` buffers exist at once (pending or spare, ``budget``): while that
        many do, a spare too small is dropped, else the oldest pending write is waited for
        and its buffer let go (its segment then reads from the file). Not reused: the seal
        asking may still copy from it (cleaning a pending segment), so a new one is taken;
        the old one is freed once nothing refers to it."""
        while True:
            for i, buf in enumerate(self.spare):
                if buf.shape[0] >= n:
                    return self.spare.pop(i)[:n]
            if len(self.pending) + len(self.spare) < WRITE_BUFFERS:
                break
            if self.spare:
                self.spare.pop(0)  # too small for this seal: freed, a larger one replaces it
                continue
            self.settle_oldest()
        cap = max(n, self.behind_records)
        return np.empty((cap, self.rec_pitch), np.uint8)[:n]

    def reuse(self, records: np.ndarray) -> None:
        """Keep the buffer behind a written segment's records for the next seals, unless
        ``WRITE_BUFFERS`` are held already or it is larger than a write buffer (a seal
        larger than ``behind_records`` that was written behind all the same: freed)."""
        base = records.base if records.base is not None else records
        if (len(self.pending) + len(self.spare) < WRITE_BUFFERS
                and isinstance(base, np.ndarray) and base.ndim == 2
                and base.shape[0] <= max(self.behind_records, 1)):
            self.spare.append(base)

    def settle_oldest(self) -> None:
        """Wait for the oldest pending write and map its segment (a failed write is
        retried, as :meth:`settle` does); its buffer is not kept (:meth:`seal_buffer`)."""
        sid = next(iter(self.pending))
        self.wait_job(self.pending[sid])
        self._settle_one(sid, self.pending[sid], keep=False)

    def settle(self, block: bool) -> None:
        """Map the segments whose background writes are done (all of them with ``block``).

        A write that failed is retried here, synchronously, from its buffer; if it fails
        again its error is raised and nothing else changes (the segment stays pending and
        readable: the next seal or flush retries it).
        """
        for sid, job in list(self.pending.items()):
            if not job.done.is_set():
                if not block:
                    continue
                self.wait_job(job)
            self._settle_one(sid, job)

    def _settle_one(self, sid: int, job: WriteJob, keep: bool = True) -> None:
        """A finished write (retried once if it failed): map its segment, reuse its buffer
        (``keep``)."""
        if job.error is not None:
            job.run()
            if job.error is not None:
                msg = (f"log store {str(self.path)!r}: writing segment {sid} failed "
                       f"({job.error!r}); its records are kept in memory and the next seal "
                       "or flush tries again")
                code = getattr(job.error, "errno", None)  # ENOSPC stays ENOSPC, EIO EIO
                raise (OSError(msg) if code is None else OSError(code, msg)) from job.error
        del self.pending[sid]
        seg = self.segs.get(sid)
        if seg is not None and seg.sums is None:  # still live, in the buffer: map the file
            self.map(job.path, sid, seg.n)
        if keep:
            self.reuse(job.records)

    def stop_writer(self) -> None:
        """Stop this process's writer thread (a forked child's is its parent's: left
        alone)."""
        w, self.writer = self.writer, None
        if w is not None and w.pid == os.getpid():
            w.close()
        self.pending.clear()

    # -- opening and commits ------------------------------------------------------------------
    def adopt(self, ns: dict[int, int], live: np.ndarray, live_total: int,
              versions: dict[int, int] | None = None, unchecked: bool = False) -> None:
        """Take the segments a manifest lists (``ns``: id -> records, checked; ``versions``:
        id -> segment format, 2 if absent) with their live counts: map the live ones; a dead
        one (an older writer's choice) goes at the next flush. ``unchecked``: the open
        checked their headers only (``format.check_segment`` without ``meta``): their row
        ids, steps and sums are checked before first use (:meth:`check_meta`)."""
        versions = versions or {}
        for sid, n in ns.items():
            self.seg_n[sid] = n
        self.live[:] = live[:self.live.shape[0]]
        self.live_total = live_total
        self.committed = set(ns)
        for sid, n in ns.items():
            if self.live[sid] > 0:
                self.map(self.path / seg_name(sid), sid, n, versions.get(sid, 2))
                self.segs[sid].unchecked = unchecked
                self.total_records += n
            else:
                self.doomed.add(sid)

    def sync_new(self) -> None:
        """fsync the segments written since the last flush."""
        for sid in sorted(self.unsynced):
            fsync_path(self.path / seg_name(sid))
        self.unsynced.clear()

    def committed_now(self) -> None:
        """A manifest listing exactly the live segments is durable."""
        self.committed = set(self.segs)

    def delete_doomed(self) -> None:
        """Delete the files of the dead segments that the last manifest no longer lists."""
        for sid in sorted(self.doomed):
            (self.path / seg_name(sid)).unlink(missing_ok=True)
            crash_point("flush-deleted")
        self.doomed.clear()
