"""Read-ahead of an in-place store: bring the pages of the *next* batch's rows into the page
cache (its ``prefetch`` and ``residency``).

When the store is larger than memory every row touched by ``step`` is a page fault, served
synchronously at queue depth 1 per kernel thread. The ids of the next batch are known before
the current step ends (a data loader knows them), so a background thread asks the kernel to
read those pages now — ``posix_fadvise(POSIX_FADV_WILLNEED)`` per record range, which submits
the reads without waiting for them, i.e. at a high queue depth — while the current step
computes.

Read-ahead only fills the page cache: ``step`` still reads and writes every row through the
mapping, so a prefetch can never return a stale row or lose a write, whatever its timing.
A hint that arrives late only costs a page fault.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

import numpy as np
from numba import njit

from .._layout import HEADER_BYTES
from .._os import (
    PAGE,
    POSIX_FADV_WILLNEED,
    SYNC_FILE_RANGE_WRITE,
    Worker,
    fadvise_fd,
    mincore_addr,
    sync_file_range,
)
from .._validation import as_index

_WILLNEED = POSIX_FADV_WILLNEED
_fadvise = fadvise_fd
_sync_file_range = sync_file_range

__all__ = ["Prefetcher", "mapped_residency", "writeback"]


# Not cache=True: the ctypes function address is baked into the machine code and changes from
# process to process (ASLR), so a cached build would call a stale address.
@njit(nogil=True)
def _advise_rows(fd, rows, header, rec_bytes, page, advice, write):
    """Hint each record range of the sorted ``rows``, merging ranges that share pages.

    ``write=False``: ``posix_fadvise(advice)`` (read-ahead). ``write=True``:
    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which starts writing the dirty pages back
    without waiting, so that memory pressure later finds clean pages to drop.
    """
    done_to = -1
    calls = 0
    for t in range(rows.shape[0]):
        start = header + rows[t] * rec_bytes
        end = start + rec_bytes
        p0 = (start // page) * page
        p1 = ((end + page - 1) // page) * page
        if p0 < done_to:
            p0 = done_to
        if p1 > p0:
            if write:
                _sync_file_range(fd, p0, p1 - p0, advice)
            else:
                _fadvise(fd, p0, p1 - p0, advice)
            done_to = p1
            calls += 1
    return calls


def _row_pages(rows: np.ndarray, rec_bytes: int) -> np.ndarray:
    """Sorted unique page numbers (counted from the file start) covering the given rows."""
    start = HEADER_BYTES + rows.astype(np.int64) * rec_bytes
    first = start // PAGE
    last = (start + rec_bytes - 1) // PAGE
    spans = [np.arange(f, e + 1) for f, e in zip(first, last, strict=True)]
    return np.unique(np.concatenate(spans))


class Prefetcher:
    """Background threads that turn batches of row ids into read-ahead / write-back hints.

    Reads and writes have a thread each (``_os.Worker`` s; a forked child makes its own), so
    a write-back that waits on a congested request queue never delays the next batch's
    read-ahead. ``submit`` waits only while ``depth`` batches are already queued on that lane
    (back-pressure). Hints are never needed for correctness; an error is raised by the next call.
    """

    def __init__(self, store, depth: int = 4):
        self._store = store
        self._depth = depth
        self._rec_bytes = store.layout.stride * store.layout.dtype.itemsize
        self._lanes: dict[bool, Worker] = {}
        self._calls = {False: 0, True: 0}  # hint syscalls per lane (each counts its own)

    def _lane(self, write: bool) -> Worker:
        lane = self._lanes.get(write)
        if lane is None or lane.forked:
            lane = self._lanes[write] = Worker(
                "dsa-writeback" if write else "dsa-prefetch",
                lambda rows: self._hint(rows, write), maxsize=max(1, int(self._depth)))
        return lane

    def _hint(self, rows: np.ndarray, write: bool) -> None:
        fd = self._store._fd
        if fd >= 0 and not self._store._closed:
            self._calls[write] += _advise_rows(fd, rows, HEADER_BYTES, self._rec_bytes, PAGE,
                                               SYNC_FILE_RANGE_WRITE if write else _WILLNEED,
                                               write)

    @property
    def calls(self) -> int:
        return sum(self._calls.values())

    def submit(self, rows: np.ndarray, write: bool = False) -> None:
        lane = self._lane(write)
        lane.raise_error()
        lane.submit(np.unique(rows))

    def join(self) -> None:
        """Wait until every submitted hint has been issued (not until the I/O finishes)."""
        for lane in list(self._lanes.values()):
            lane.join()

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()


def _prefetcher(state) -> Prefetcher:
    st = state.store
    pf = st._prefetcher
    if pf is None:
        pf = st._prefetcher = Prefetcher(st)
    return pf


def writeback(state, idx: Any) -> None:
    """Start writing the (just updated) records of rows ``idx`` back to disk, in the background.

    ``sync_file_range(SYNC_FILE_RANGE_WRITE)``: the pages are queued for writing and stay
    cached, but are clean once written, so that under memory pressure the kernel could drop
    them without stalling on dirty-page writeback. Not exported: out of core it made steps
    slower, not faster (the writes compete with the reads the step waits on; figures:
    docs/notebook.md, design measurements), so it is kept only for
    ``benchmarks.ooc --modes pipeline``.
    """
    st = state.store
    if st._closed or st.mode != "r+" or not st.info.table_view:  # a mapping's pages only
        return
    rows = as_index(idx, st.layout.num_rows)
    if rows.size:
        _prefetcher(state).submit(rows, write=True)



def mapped_residency(st, rows: np.ndarray) -> float:
    """``residency`` of an in-place store: mincore over the mapped pages of ``rows``."""
    pages = _row_pages(rows, st.layout.stride * st.layout.dtype.itemsize)
    base = st.data.__array_interface__["data"][0] - HEADER_BYTES
    npages = -(-st.nbytes // PAGE)
    vec = np.zeros(npages, np.uint8)
    if mincore_addr(base, npages * PAGE, vec.ctypes.data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mincore failed: {os.strerror(err)}")
    return float((vec[pages] & 1).mean())
