"""Range load / release of an in-place store: its ``submit_range``, ``submit_rows`` and
``wait_ranges``.

The public calls (``dsa_core.load_range`` / ``release_range`` / ``wait_ranges``) check their
arguments in ``dsa_core._ranges`` and hand the range to the store; this module is what an
in-place store does with it.

Partition-ordered training touches one block of rows (a partition) for a while, then moves
on. Instead of paying one random page fault per row, the block can be read **sequentially**
before it is needed and written back **sequentially** when it is done:

- ``load_range``: read the records' bytes in, in file order, and map them
  (``madvise(MADV_POPULATE_READ)``), so that the steps take no major faults on them (a step's
  first write to a page still takes one minor fault, which marks the page dirty). A "disk"
  store (``MADV_RANDOM``: its faults read 4 KiB each) is read with large ``pread`` calls on a
  private descriptor first; a "ram" store is populated through the mapping alone, whose
  huge-page read-ahead reads and maps 2 MiB folios.
- ``load_rows`` (a row set, e.g. partition-ordered training's negatives' pool): the pages of
  the rows asked for at once (``POSIX_FADV_WILLNEED``, at queue depth), then mapped
  (``MADV_POPULATE_READ``) on the same thread, in the same queue as the ranges;
  ``release_rows`` does nothing beyond reporting errors (and waiting, with ``wait=True``): the
  pages stay cached until the kernel reclaims them (``submit_mapped_rows``).
- ``release_range``: ``sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`` writes the dirty
  pages of the range in file order; then ``madvise(MADV_PAGEOUT)`` on the mapped range and
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the byte range let the kernel drop the (now clean)
  pages.

Both only hint: ``step`` still reads and writes every row through the shared mapping, whose
pages are the page cache itself, so no value can change, go stale or get lost whatever the
timing. The kernel never drops a dirty page without writing it first, so a row a step writes
while its range is being released is kept (or written again). No call here can discard data:
``MADV_DONTNEED``, ``MADV_FREE`` and ``MADV_REMOVE`` are never used.

Requests of one store run in submission order on one daemon thread per store, created on
first use and stopped by ``Store.close`` before it syncs. The thread uses its own descriptor
(its own open file description) on the data file: a write error it is told about
(``sync_file_range`` consumes the error report of the file description it is given) is still
reported to the store's own ``flush``/``close``, and the store's descriptors may be closed
while a request runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import weakref
from typing import Any

import numpy as np

from .._engine import closed_error
from .._layout import HEADER_BYTES
from .._os import (
    MADV_PAGEOUT,
    MADV_POPULATE_READ,
    PAGE,
    POSIX_FADV_WILLNEED,
    SYNC_FILE_RANGE_WAIT_AFTER,
    SYNC_FILE_RANGE_WAIT_BEFORE,
    SYNC_FILE_RANGE_WRITE,
    Worker,
    madvise_addr,
)
from .._os import sync_file_range as _sync_file_range
from .readahead import _advise_rows

__all__ = ["RangeWorker", "page_runs", "submit_mapped", "submit_mapped_rows", "wait_mapped"]

LOAD_CHUNK = 8 << 20      # bytes per pread of a load (one reused buffer)
RELEASE_CHUNK = 64 << 20  # bytes written back and dropped per release step
POPULATE = True           # map loaded pages (MADV_POPULATE_READ) after reading them


_CREATE_LOCK = threading.Lock()


class _Request:
    __slots__ = ("kind", "start", "stop", "huge", "done", "rows")

    def __init__(self, kind: str, start: int, stop: int, huge: bool = False, rows=None):
        self.kind, self.start, self.stop = kind, start, stop
        self.huge = huge  # the store is mapped "ram" (huge folios): load through the mapping
        self.rows = rows  # kind "rows": the sorted unique rows of a load_rows
        self.done = threading.Event()

    def __repr__(self) -> str:
        if self.kind == "rows":
            return f"load_rows({self.rows.shape[0]:,} rows in [{self.start}, {self.stop}))"
        name = {"load": "load_range", "release": "release_range"}.get(self.kind, self.kind)
        return f"{name}(rows [{self.start}, {self.stop}))"


def _private_fd(fd: int, writable: bool) -> int:
    """A new open file description of the same file (its own error-report and read-ahead
    state); a plain ``dup`` if /proc is not mounted."""
    want = os.fstat(fd)
    try:
        new = os.open(f"/proc/self/fd/{fd}",
                      (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)
    except OSError:
        return os.dup(fd)
    got = os.fstat(new)
    if (got.st_dev, got.st_ino) != (want.st_dev, want.st_ino):  # never another file
        os.close(new)
        return os.dup(fd)
    return new


class RangeWorker:
    """The background thread of one store's range requests, and their FIFO queue (an
    ``_os.Worker``).

    Holds no reference to the ``Store``: only its mapped array (which keeps the mapping, and
    so the addresses it advises, alive) and a private descriptor of the data file.
    """

    def __init__(self, store):
        self.path = store.path
        self.pid = os.getpid()  # a forked child gets a worker of its own
        self._data = store.data  # a buffer export of the mmap: the mapping cannot go away
        self._base = store.data.__array_interface__["data"][0] - HEADER_BYTES
        self._map_end = -(-store.nbytes // PAGE) * PAGE
        self._file_bytes = store.nbytes
        self._rec = store.layout.stride * store.layout.dtype.itemsize
        self._fd = _private_fd(store._fd, store.mode == "r+")
        try:
            # No read-ahead on this descriptor: the loads' reads are already large and
            # sequential, and read-ahead past a range's end would bring back the neighbouring
            # partition that was just released (measured: rows beyond a 1k-row load resident).
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_RANDOM)
        except (OSError, AttributeError):
            pass
        self._can_pageout = True
        self._can_populate = POPULATE
        self.loaded_bytes = 0    # bytes read by loads (for tests and benchmarks)
        self.released_bytes = 0  # bytes covered by releases
        self._lock = threading.Lock()  # a submit and a stop: never a request after the stop
        self._worker = Worker("dsa-ranges", self._run, on_exit=self._close_fd,
                              on_drop=lambda req: req.done.set())  # its waiters return
        self._finalizer = weakref.finalize(store, self.stop)  # a store dropped unclosed

    # -- caller side -------------------------------------------------------------------------
    def submit(self, kind: str, start: int, stop: int, st, rows=None) -> _Request:
        req = _Request(kind, start, stop, getattr(st, "access", "") == "ram", rows)
        with self._lock:
            if self._worker.stopping:
                raise closed_error(st)
            self._worker.submit(req)
        return req

    def raise_error(self) -> None:
        """Re-raise (once) the first error a request met in the background."""
        failed = self._worker.error()
        if failed is not None:
            req, exc = failed
            if isinstance(exc, OSError):
                raise OSError(exc.errno, f"background {req!r} of store {str(self.path)!r} "
                              f"failed: {exc.strerror or exc}; it was only a hint (no value "
                              "was changed), but the error is the disk's: check it, then "
                              "flush") from exc
            raise RuntimeError(f"background {req!r} of store {str(self.path)!r} failed: "
                               f"{exc!r}") from exc

    def stop(self) -> None:
        """Drop the queued requests, end the running one at its next chunk, let the thread
        exit (it closes its descriptor). Does not wait; nothing in a forked child."""
        with self._lock:
            self._worker.close(drop=True, wait=False)

    def close(self) -> None:
        """Stop and wait for the thread (``Store.close`` calls this before it syncs)."""
        self.stop()
        self._worker.close(drop=True)
        self._finalizer.detach()

    # -- worker side -------------------------------------------------------------------------
    def _run(self, req: _Request) -> None:
        try:
            if req.kind == "load":
                self._load(req.start, req.stop, req.huge)
            elif req.kind == "release":
                self._release(req.start, req.stop)
            elif req.kind == "rows":
                self._load_rows(req.rows)
        finally:  # an error is kept by the worker: the next call on this store raises it
            req.done.set()

    def _close_fd(self) -> None:
        os.close(self._fd)
        self._fd = -1

    def _span(self, start: int, stop: int) -> tuple[int, int]:
        """The file bytes of rows [start, stop), widened outward to whole pages."""
        lo = HEADER_BYTES + start * self._rec
        hi = HEADER_BYTES + stop * self._rec
        return (lo // PAGE) * PAGE, min(-(-hi // PAGE) * PAGE, self._map_end)

    def _advise(self, off: int, length: int, advice: int) -> bool:
        """madvise the mapped bytes [off, off+length); False if the kernel lacks ``advice``."""
        if madvise_addr(self._base + off, length, advice) == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.EINVAL:  # advice unknown to this kernel (or not for this mapping)
            return False
        if err in (errno.EAGAIN, errno.EINTR):  # transient (e.g. a page under reclaim)
            return True
        raise OSError(err, f"madvise({advice}) failed: {os.strerror(err)}")

    def _load(self, start: int, stop: int, huge: bool) -> None:
        """Read [start, stop) in, in LOAD_CHUNK pieces (aligned to LOAD_CHUNK in the file).

        "disk" stores: ``pread`` into a reused buffer (this descriptor's read-ahead makes the
        I/Os large and sequential), then ``MADV_POPULATE_READ`` maps the cached pages.
        "ram" stores: ``MADV_POPULATE_READ`` alone: its faults read through the mapping,
        whose huge-page advice makes the read-ahead fill 2 MiB folios that are mapped whole;
        pages read by ``pread`` would come in smaller folios and be mapped 4 KiB at a time,
        for the rest of the mapping's life.
        """
        lo, hi = self._span(start, stop)
        hi_file = min(hi, self._file_bytes)
        view = None
        off = lo
        while off < hi and not self._worker.stopping:
            end = min((off // LOAD_CHUNK + 1) * LOAD_CHUNK, hi)
            if huge and self._can_populate:
                self._can_populate = self._advise(off, end - off, MADV_POPULATE_READ)
                if self._can_populate:
                    self.loaded_bytes += end - off
                    off = end
                    continue
            if view is None:
                view = memoryview(bytearray(min(LOAD_CHUNK, max(hi_file - lo, PAGE))))
            pos = off
            while pos < min(end, hi_file):  # CPython releases the GIL around preadv
                n = os.preadv(self._fd, [view[:min(end, hi_file) - pos]], pos)
                if n <= 0:
                    break
                pos += n
            self.loaded_bytes += pos - off
            if self._can_populate and not self._worker.stopping:
                self._can_populate = self._advise(off, end - off, MADV_POPULATE_READ)
            off = end

    def _load_rows(self, rows) -> None:
        """Read the pages of the sorted unique ``rows`` in: every page run asked for at once
        (``POSIX_FADV_WILLNEED``, the read-ahead's ``_advise_rows``: reads at queue depth),
        then each run mapped (``MADV_POPULATE_READ``, which waits for its pages), or read
        with ``pread`` where the kernel cannot populate; done when every page is cached."""
        if not rows.shape[0]:
            return
        _advise_rows(self._fd, rows, HEADER_BYTES, self._rec, PAGE, POSIX_FADV_WILLNEED,
                     False)
        lo, hi = page_runs(rows, self._rec)
        lo, hi = lo * PAGE, np.minimum(hi * PAGE, self._map_end)
        buf = None
        for n in range(lo.shape[0]):
            if self._worker.stopping:
                return
            off, end = int(lo[n]), int(hi[n])
            if self._can_populate:
                self._can_populate = self._advise(off, end - off, MADV_POPULATE_READ)
            if not self._can_populate:  # read them (the page cache keeps them)
                end = min(end, self._file_bytes)
                if buf is None or len(buf) < end - off:
                    buf = memoryview(bytearray(max(end - off, PAGE)))
                pos = off
                while pos < end:
                    k = os.preadv(self._fd, [buf[:end - pos]], pos)
                    if k <= 0:
                        break
                    pos += k
            self.loaded_bytes += end - off

    def _inner(self, start: int, stop: int) -> tuple[int, int]:
        """The file bytes of rows [start, stop), narrowed inward to whole pages: the pages
        that hold no byte of a row outside the range (those a release may drop)."""
        lo = HEADER_BYTES + start * self._rec
        hi = HEADER_BYTES + stop * self._rec
        if stop * self._rec + HEADER_BYTES >= self._file_bytes:
            hi = self._map_end  # the last page holds no other row
        lo, hi = -(-lo // PAGE) * PAGE, (hi // PAGE) * PAGE
        return lo, max(lo, hi)

    def _release(self, start: int, stop: int) -> None:
        """Write [start, stop) back (pages widened outward: syncing a neighbour's page is
        harmless), then drop only the pages inside the range, so that the page a released
        partition shares with a resident neighbour stays mapped."""
        lo, hi = self._span(start, stop)
        keep_lo, keep_hi = self._inner(start, stop)
        flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER
        off = lo
        while off < hi and not self._worker.stopping:
            end = min(off + RELEASE_CHUNK, hi)
            if _sync_file_range(self._fd, off, end - off, flags) != 0:
                err = ctypes.get_errno()
                # not written: nothing is dropped (the kernel would keep dirty pages anyway)
                raise OSError(err, f"sync_file_range failed: {os.strerror(err)}")
            d0, d1 = max(off, keep_lo), min(end, keep_hi)
            if d1 > d0:
                if self._can_pageout:
                    self._can_pageout = self._advise(d0, d1 - d0, MADV_PAGEOUT)
                os.posix_fadvise(self._fd, d0, d1 - d0, os.POSIX_FADV_DONTNEED)
            self.released_bytes += end - off
            off = end



def _worker(st, create: bool) -> RangeWorker | None:
    w = getattr(st, "_ranges", None)
    if w is not None and w.pid != os.getpid():
        w = None  # inherited through fork: its thread and queue are the parent's
    if w is not None or not create:
        return w
    with _CREATE_LOCK:
        w = st._ranges
        if w is None or w.pid != os.getpid():
            if st._closed:
                raise closed_error(st)
            w = st._ranges = RangeWorker(st)
    return w



def submit_mapped(st: Any, kind: str, start: int, stop: int, wait: bool) -> None:
    """The range calls of an in-place store (its ``submit_range``): queued on its range
    thread."""
    w = _worker(st, create=stop > start)
    if w is not None:
        w.raise_error()
    if stop == start or w is None:
        return
    req = w.submit(kind, start, stop, st)
    if wait:
        req.done.wait()
        w.raise_error()



def page_runs(rows, rec_bytes: int):
    """``(lo, hi)``: the runs of consecutive file pages ``[lo, hi)`` (page numbers) that hold
    the records of the sorted ``rows``, neighbouring and shared pages merged."""
    start = HEADER_BYTES + rows.astype(np.int64) * rec_bytes
    first = start // PAGE
    last = (start + rec_bytes - 1) // PAGE + 1  # exclusive; non-decreasing as rows are sorted
    new = np.ones(rows.shape[0], bool)
    new[1:] = first[1:] > last[:-1]  # a gap of at least one page before this record
    heads = np.flatnonzero(new)
    tails = np.append(heads[1:], rows.shape[0]) - 1
    return first[heads], last[tails]


def submit_mapped_rows(st: Any, kind: str, rows, wait: bool) -> None:
    """The row-set calls of an in-place store (its ``submit_rows``). A load is queued on
    the range thread (``RangeWorker._load_rows``: the rows' pages read into the page cache
    and mapped). A release drops nothing: the rows' pages stay cached like any page a step
    touched, until the kernel reclaims them -- dropping a scattered row's page would drop
    the rows sharing it too (of a loaded partition, say), and the page cache writes the
    changes back by itself; ``wait`` waits for the requests queued before it."""
    if kind != "load":
        if wait:
            wait_mapped(st)
            return
        w = _worker(st, create=False)
        if w is not None:
            w.raise_error()
        return
    w = _worker(st, create=rows.shape[0] > 0)
    if w is not None:
        w.raise_error()
    if not rows.shape[0] or w is None:
        return
    req = w.submit("rows", int(rows[0]), int(rows[-1]) + 1, st, rows)
    if wait:
        req.done.wait()
        w.raise_error()


def wait_mapped(st: Any) -> None:
    """``wait_ranges`` of an in-place store: a barrier through its range thread."""
    w = _worker(st, create=False)
    if w is None:
        if st._closed:
            raise closed_error(st)
        return
    try:
        req = w.submit("barrier", 0, 0, st)
    except ValueError:
        if st._closed:
            raise
        req = None
    if req is not None:
        req.done.wait()
    w.raise_error()
