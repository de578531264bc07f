"""Range loads of a log store: a range's on-disk records read sequentially, in the background.

(Row sets -- ``dsa_core.load_rows``, ``LogStore.load_rows`` -- are loaded the same way: the
plan is built from the rows' locations, and their records, scattered over the segments, are
mostly read through the scattered-records path below, at queue depth.)

``dsa_core.load_range(state, start, stop)`` on a log store (``LogStore.load_range``) plans,
in the caller's thread, where the records of the range's non-resident rows lie: per segment,
the record indices sorted (records that were sealed together lie together: a partition
released by ``release_range`` was sealed in row order, in segments of a seal unit); rows never
written take their initial record (``_init``, a pure function of the row); a segment whose
write is still pending is copied from its buffer at once (that buffer is reused later).

:class:`Loader` (one thread per store and process) then reads each segment's records with
large ``preadv`` s: records closer than ``GAP_BYTES`` are read as one span (the gap is read
and dropped), a span holds at most ``CHUNK_BYTES``, and its pages are dropped from the page
cache afterwards (``POSIX_FADV_DONTNEED``: the records now live in the region, and a range
released later is sealed to new segments). Records that lie scattered (spans under
``SPAN_BYTES``: a range whose rows were evicted one by one among others, not released
together) are not worth a sequential read of everything between them: their pages are
handed to the kernel all at once (``read.advise``, reads at queue depth) and the records
copied from the segment's mapping. Each record read is checked against its sum
(``format.check_records``). The records go into *staging* chunks of at most
``CHUNK_BYTES``, at most ``STAGED`` of them read and not yet installed (back-pressure: the
thread waits until the engine has installed one), so the loads hold at most
``(STAGED + 2) * CHUNK_BYTES`` (48 MiB: the staged chunks, the one being filled and a sparse
span's read buffer) besides the region.

The engine installs finished chunks in its own thread -- the pool is not thread-safe -- at
the next ``acquire`` (a step or a write), ``load_range``/``release_range`` or
``wait_ranges`` (``Pool.install_loaded``): only rows still in an active range, not resident,
and at the location that was read (or read again where they moved). A segment file is
immutable and its id is never reused while the store is open, so a record read at any time
from the location a row still has is that row's current record; a file deleted meanwhile
(every record in it dead) makes its rows "moved". The thread only reads: a failed read is
reported once, by the next ``load_range``/``release_range``/``wait_ranges``, and its rows
are simply read when a step needs them.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass, field
import numpy as np

from .._init import InitSpec, initial_records
from .._os import Worker, preadv_fd
from .format import Segment, check_records, records_of, sums_of
from .read import advise

__all__ = ["CHUNK_BYTES", "GAP_BYTES", "SPAN_BYTES", "STAGED", "Job", "Loader", "loader_for",
           "plan_job"]

CHUNK_BYTES = 8 << 20   # records per staging chunk and per read at most
GAP_BYTES = 32 << 10    # dead records read through (and dropped) to keep one read: about
                        # what one random 4 KiB read costs in sequential transfer
SPAN_BYTES = 1 << 20    # a span this large is read with preadv; smaller ones at queue depth
STAGED = 4              # staging chunks held at once (read, not installed yet)


@dataclass
class Job:
    """One ``load_range`` or ``load_rows``: where its records lie (built by
    :func:`plan_job`). ``[start, stop)`` bounds its rows; ``rows`` is the sorted row set of
    a ``load_rows`` (None for a range: every row of ``[start, stop)``)."""

    id: int
    start: int
    stop: int
    files: list[tuple[Segment, int, np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=list)    # (segment, records offset in its file, ks, rows, locs)
    ready: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=list)    # (rows, locs, records) copied already (pending segments)
    fresh: np.ndarray | None = None  # rows never written: their initial records
    cancelled: bool = False
    rows: np.ndarray | None = None

    def covers(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` is one of this job's rows."""
        inside = (rows >= self.start) & (rows < self.stop)
        if self.rows is None or not inside.any():
            return inside
        k = np.minimum(np.searchsorted(self.rows, rows), self.rows.shape[0] - 1)
        return inside & (self.rows[k] == rows)


def plan_job(job_id: int, start: int, stop: int, pool, segments, init: InitSpec,
             rec_off, rows: np.ndarray | None = None) -> Job:
    """The reads of the non-resident rows of ``[start, stop)`` -- or, given ``rows`` (sorted,
    unique, non-empty: a ``load_rows``), of those rows, with ``[start, stop)`` their bounds
    -- (``pool``: the row locations and which rows are resident; ``rec_off(seg)``: where a
    segment's records start in its file). Per segment the records are read in file order,
    whatever the rows."""
    job = Job(job_id, start, stop, rows=rows)
    if rows is None:
        lr = pool.disk_locs(np.arange(start, stop, dtype=np.int64))

        def ids(k):
            return k + start
    else:
        lr = pool.disk_locs(rows)

        def ids(k):
            return rows[k]
    on = np.flatnonzero(lr > 0)  # -1: resident, not read
    never = np.flatnonzero(lr == 0)
    if never.shape[0]:
        job.fresh = ids(never)
    if on.shape[0]:
        locs = lr[on]
        order = np.argsort(locs, kind="stable")
        locs = locs[order]
        rws = ids(on[order])
        used = locs - 1
        sids = used >> 32
        ks = used & np.int64(0xFFFFFFFF)
        cuts = np.flatnonzero(sids[1:] != sids[:-1]) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), sids.shape[0]], strict=True):
            sid = int(sids[a])
            seg = segments.segs[sid]
            if sid in segments.pending or seg.sums is None:  # in memory: copy it now
                job.ready.append((rws[a:b], locs[a:b], seg.records[ks[a:b]]))
            else:
                job.files.append((seg, rec_off(seg), ks[a:b], rws[a:b], locs[a:b]))
    return job


class Loader:
    """The range-load thread of one store (module docstring; an ``_os.Worker``), per process.

    ``submit(job)`` queues a job; ``poll()`` returns what is done so far without waiting:
    ``(job_id, rows, locs, records)`` chunks, ``(job_id, None, None, exc)`` for a failed
    job, ``(job_id, None, None, None)`` at a job's end; ``get()`` waits for the next one.
    Every chunk returned must be handed back with ``done_with()`` (it frees a staging slot).
    ``stats``: ``reads`` and ``read_bytes`` (the sequential reads: syscalls, bytes) and
    ``mapped_records`` (scattered records copied from the mappings after a hint).
    """

    def __init__(self, stride: int, dtype: np.dtype, init: InitSpec):
        self.stride, self.dtype, self.init = stride, np.dtype(dtype), init
        self.rec_bytes = stride * self.dtype.itemsize
        self.stats = {"reads": 0, "read_bytes": 0, "mapped_records": 0}
        self._out: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(STAGED)
        self._worker = Worker("dsa-log-range-load", self._run)
        self.pid = self._worker.pid

    # -- the caller's side --------------------------------------------------------------
    def submit(self, job: Job) -> None:
        self._worker.submit(job)

    def poll(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self._out.get_nowait())
            except queue.Empty:
                return out

    def get(self) -> tuple:
        return self._out.get()

    def done_with(self) -> None:
        self._room.release()

    def close(self) -> None:
        """Stop: queued jobs are dropped, a read in flight ends first."""
        self._worker.close(drop=True)

    # -- the thread ---------------------------------------------------------------------
    def _stage(self) -> bool:
        """Wait for a free staging slot; False once the loader is stopping."""
        while not self._room.acquire(timeout=0.05):
            if self._worker.stopping:
                return False
        if self._worker.stopping:
            self._room.release()
            return False
        return True

    def _run(self, job: Job) -> None:
        try:
            self._load(job)
            err = None
        except BaseException as exc:  # reported by the engine's next range call; the
            err = exc                 # end is always put, so no wait can hang
        self._out.put((job.id, None, None, err))

    def _emit(self, job: Job, rows, locs, records) -> bool:
        if not self._stage():
            return False
        self._out.put((job.id, rows, locs, records))
        return True

    def _load(self, job: Job) -> None:
        per = max(1, CHUNK_BYTES // self.rec_bytes)
        for rows, locs, records in job.ready:
            if not self._emit(job, rows, locs, records):
                return
        if job.fresh is not None:
            for lo in range(0, job.fresh.shape[0], per):
                if job.cancelled:
                    return
                rows = job.fresh[lo:lo + per]
                if not self._emit(job, rows, np.zeros(rows.shape[0], np.int64),
                                  initial_records(rows, self.init)):
                    return
        buf = np.empty((per, self.stride), self.dtype)
        fill = 0
        rows_out: list[np.ndarray] = []
        locs_out: list[np.ndarray] = []
        for seg, off, ks, rows, locs in job.files:
            fd = -1
            try:
                try:
                    fd = os.open(seg.path, os.O_RDONLY)
                except FileNotFoundError:  # deleted: every record in it is dead (moved)
                    continue
                spans = list(self._spans(ks, per))
                big = [(i, j) for i, j in spans
                       if (ks[j - 1] - ks[i] + 1) * self.rec_bytes >= SPAN_BYTES]
                small = [np.arange(i, j) for i, j in spans
                         if (ks[j - 1] - ks[i] + 1) * self.rec_bytes < SPAN_BYTES]
                pieces: list[tuple[np.ndarray | None, int, int]] = [(None, i, j)
                                                                    for i, j in big]
                if small:  # scattered records: read at queue depth through the mapping
                    sel = np.concatenate(small)
                    pitch = seg.records.strides[0]  # with its sums beside it (version 3)
                    advise(seg.records.__array_interface__["data"][0] + ks[sel] * pitch, pitch)
                    pieces += [(sel[a:a + per], 0, 0) for a in range(0, sel.shape[0], per)]
                for sel, i, j in pieces:
                    if job.cancelled or self._worker.stopping:
                        return
                    m = (j - i) if sel is None else sel.shape[0]
                    if fill + m > per:  # the chunk is full: hand it over
                        if not self._emit(job, np.concatenate(rows_out),
                                          np.concatenate(locs_out), buf[:fill]):
                            return
                        buf = np.empty((per, self.stride), self.dtype)
                        fill, rows_out, locs_out = 0, [], []
                    if sel is None:
                        self._read_span(fd, off, seg, ks[i:j], buf[fill:fill + m])
                        sel = np.arange(i, j)
                    else:
                        out = buf[fill:fill + m]
                        np.take(seg.records, ks[sel], axis=0, out=out)
                        check_records(seg, ks[sel], out)
                        self.stats["mapped_records"] += m
                    rows_out.append(rows[sel])
                    locs_out.append(locs[sel])
                    fill += m
            finally:
                if fd >= 0:
                    os.close(fd)
        if fill:
            self._emit(job, np.concatenate(rows_out), np.concatenate(locs_out), buf[:fill])

    def _spans(self, ks: np.ndarray, per: int):
        """``(i, j)``: the records ``ks[i:j]`` (sorted) read as one span -- neighbours at
        most ``GAP_BYTES`` apart, ``per`` record positions at most."""
        gap = max(1, GAP_BYTES // self.rec_bytes)
        cuts = (np.flatnonzero(np.diff(ks) > gap) + 1).tolist()
        for a, b in zip([0, *cuts], [*cuts, ks.shape[0]], strict=True):
            i = a
            while i < b:
                j = i + int(np.searchsorted(ks[i:b], ks[i] + per))
                yield i, j
                i = j

    def _read_span(self, fd: int, off: int, seg: Segment, ks: np.ndarray,
                   out: np.ndarray) -> None:
        """``out[:] =`` the records ``ks`` (sorted, one span) of the segment file ``fd``."""
        k0, k1 = int(ks[0]), int(ks[-1]) + 1
        pitch = seg.records.strides[0]  # the record and, in a version-3 file, its sums
        pos = off + k0 * pitch
        dense = k1 - k0 == ks.shape[0]
        sums = None
        if pitch != self.rec_bytes:  # as they lie: records and their sums
            dst = np.empty((k1 - k0, pitch), np.uint8)
        else:
            dst = out if dense else np.empty((k1 - k0, self.stride), self.dtype)
        view = memoryview(dst).cast("B")
        total = len(view)
        self.stats["reads"] += preadv_fd(fd, view, pos, seg.path)
        self.stats["read_bytes"] += total
        if pitch != self.rec_bytes:
            pick = dst[ks - k0]
            out[...] = records_of(pick, self.stride, self.dtype)
            sums = sums_of(pick)
        elif not dense:
            np.take(dst, ks - k0, axis=0, out=out)
        check_records(seg, ks, out, sums)  # a damaged record is never installed
        try:
            os.posix_fadvise(fd, pos, total, os.POSIX_FADV_DONTNEED)
        except (AttributeError, OSError):  # pragma: no cover - a hint
            pass


def loader_for(current: Loader | None, stride: int, dtype, init: InitSpec) -> Loader:
    """``current`` if it belongs to this process, else a new one (a forked child's)."""
    if current is not None and current.pid == os.getpid():
        return current
    return Loader(stride, dtype, init)

