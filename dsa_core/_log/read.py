"""Reading a log store's on-disk records at queue depth (read-ahead, cleaning reads).

A record that is not resident in the region lies in a read-only mapping of its segment
(``format.map_segment``, ``MADV_RANDOM``: a page fault reads that one 4 KiB page and
nothing around it). Copying a batch's misses out of those mappings one after another would
read them at queue depth 1: each fault waits for the disk before the next is issued, and a
record that straddles two pages costs two such waits.

Instead, the page spans of the records are first handed to the kernel with
``madvise(MADV_WILLNEED)``: for a file mapping that is ``posix_fadvise(WILLNEED)`` on the
file range, which queues the reads (one request per record span, two pages for a straddling
record) and returns without waiting. The copy that follows then waits only for reads that
are already in flight, all at once: the device sees the whole batch (up to its own queue
limit) instead of one read at a time.

* :func:`hint_uncached` does that for ``acquire``'s misses, synchronously, but only when a
  small sample of them is not in the page cache (:func:`sample_uncached`, ``mincore``): a
  store whose segments are cached (a table that fits in memory) pays a few syscalls per
  batch, not one per record.
* :class:`ReadAhead` does it in a background thread for the rows of a *future* batch
  (``dsa_core.prefetch`` / ``prefetched`` on a log store), so that the reads overlap the
  current step.
* :class:`CleaningReads` reads a segment that cleaning is about to copy from *whole*, with
  large sequential ``pread`` s into a buffer, one seal ahead in a background thread. Copying
  its live records out of the mapping instead faulted one 4 KiB page at a time whenever the
  read-ahead pages had been reclaimed again, which under a memory cap they mostly were: out
  of core (4M x 128 under a 1 GiB cgroup) a seal that cleaned spent ~0.35 s in such faults.
  :func:`advise_whole` remains for segments too large for a buffer.

Hints never change a value: the records are still copied from the mappings, under the
engine's own control, so a hint that is late, early or wrong (a location that moved since)
costs at most a wasted read. A task holds references to the segments it hints, so their
mappings stay valid until it has run.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numba import njit

from .._os import (
    MADV_RANDOM,
    MADV_WILLNEED,
    PAGE,
    advise_memory,
    madvise_addr,
    mincore_addr,
    preadv_all,
)

__all__ = ["MADV_RANDOM", "MADV_WILLNEED", "PAGE", "CleaningReads", "ReadAhead", "advise",
           "advise_whole", "hint_uncached", "read_file_into", "record_spans", "sample_uncached"]

SAMPLE = 16         # misses probed with mincore before deciding to issue read-ahead
WHOLE_MAX = 256 << 20  # cleaning reads a segment whole into a buffer up to this many bytes



# Not cache=True: the ctypes function addresses are baked into the machine code and change from
# process to process (ASLR), so a cached build would call a stale address.
@njit(nogil=True)
def _advise_spans(lo, hi, advice):
    """``madvise(advice)`` each span ``[lo[i], hi[i])`` of the sorted, page-aligned spans,
    merging those that touch; returns the number of calls."""
    calls = 0
    n = lo.shape[0]
    i = 0
    while i < n:
        a = lo[i]
        b = hi[i]
        i += 1
        while i < n and lo[i] <= b:
            if hi[i] > b:
                b = hi[i]
            i += 1
        madvise_addr(a, b - a, advice)
        calls += 1
    return calls


def record_spans(addrs: np.ndarray, rec_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted page-aligned spans ``(lo, hi)`` covering the records that start at ``addrs``."""
    a = np.sort(np.asarray(addrs, np.int64))
    lo = a & ~np.int64(PAGE - 1)
    hi = (a + (rec_bytes + PAGE - 1)) & ~np.int64(PAGE - 1)
    return lo, hi


def advise(addrs: np.ndarray, rec_bytes: int, advice: int = MADV_WILLNEED) -> int:
    """Issue ``advice`` for the pages of the records at ``addrs``; returns the syscalls made."""
    if not addrs.shape[0]:
        return 0
    lo, hi = record_spans(addrs, rec_bytes)
    return int(_advise_spans(lo, hi, advice))


def advise_whole(records: np.ndarray, advice: int = MADV_WILLNEED) -> None:
    """Issue ``advice`` for every page of a mapped records array (e.g. before cleaning it)."""
    advise_memory(records, advice)


def sample_uncached(addrs: np.ndarray, rec_bytes: int, k: int = SAMPLE) -> bool:
    """Whether any of ``k`` records spread over ``addrs`` has a page not in the page cache."""
    n = addrs.shape[0]
    if not n:
        return False
    pick = addrs[np.linspace(0, n - 1, min(k, n)).astype(np.int64)]
    lo, hi = record_spans(pick, rec_bytes)
    vec = np.zeros((int((hi - lo).max()) // PAGE,), np.uint8)
    ptr = vec.ctypes.data
    for a, b in zip(lo.tolist(), hi.tolist(), strict=True):
        if mincore_addr(a, b - a, ptr) != 0:
            return True  # cannot tell (unmapped meanwhile?): read ahead, it is only a hint
        if not (vec[:(b - a) // PAGE] & 1).all():
            return True
    return False


def hint_uncached(addrs: np.ndarray, rec_bytes: int) -> int:
    """Read ahead the records at ``addrs`` if a sample of them is not cached; returns the
    syscalls made (0: the sample was cached, nothing issued)."""
    if addrs.shape[0] < 2 or not sample_uncached(addrs, rec_bytes):
        return 0
    return advise(addrs, rec_bytes)


class ReadAhead:
    """One background thread that issues read-ahead for queued record addresses.

    ``submit(addrs, keep)`` queues the addresses (``keep``: the segments they lie in, held
    until the hint has run) and returns at once, unless ``depth`` tasks are already queued
    (back-pressure). ``join`` waits until every queued task has been issued (not until the
    reads finish). Created per process: a forked child gets a new one (see ``LogStore``).
    """

    def __init__(self, rec_bytes: int, depth: int = 4):
        self.rec_bytes = int(rec_bytes)
        self.pid = os.getpid()
        self.tasks = 0
        self.calls = 0
        self._q: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
        self._thread = threading.Thread(target=self._run, name="dsa-log-readahead",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            task = self._q.get()
            try:
                if task is None:
                    return
                addrs, _keep = task
                self.calls += hint_uncached(addrs, self.rec_bytes)
                self.tasks += 1
            except OSError:  # pragma: no cover - a hint that fails changes nothing
                pass
            finally:
                task = None
                self._q.task_done()

    def submit(self, addrs: np.ndarray, keep) -> None:
        if addrs.shape[0]:
            self._q.put((addrs, keep))

    def join(self) -> None:
        self._q.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join()


def read_file_into(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    """Fill the C-contiguous array ``out`` with the bytes of ``path`` from ``offset`` on
    (sequential ``preadv`` s; a file shorter than that is an error). Returns ``out``."""
    preadv_all(path, offset, memoryview(out).cast("B"))
    return out


class CleaningReads:
    """Whole-segment reads for cleaning: one background thread, buffers reused.

    ``ahead(sid, path, offset, shape, dtype)`` starts reading a segment's records (``shape``
    ``(n, stride)`` at byte ``offset`` of its file) into a buffer (at most ``keep`` such reads
    are held: the oldest goes first); ``records`` returns them,
    from that read if one was started (waiting for it), else read now; ``release`` hands a
    buffer back for reuse; ``forget`` drops a read not needed any more (the segment died).
    A segment file is immutable once written, so a buffer read at any time holds exactly
    its records. A read ahead that fails (the file was deleted meanwhile) is done again
    by ``records``, whose own failure is raised. Created per process (``pid``).
    """

    def __init__(self, keep: int = 2, spares: int = 2):
        self.pid = os.getpid()
        self._keep = keep  # reads ahead kept at most (a seal cleans about CLEAN_UNITS)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsa-log-clean-read")
        self._ahead: dict[int, Future] = {}
        self._spare: list[np.ndarray] = []
        self._spares = spares

    def _buffer(self, shape: tuple[int, int], dtype) -> np.ndarray:
        nbytes = shape[0] * shape[1] * np.dtype(dtype).itemsize
        for i, buf in enumerate(self._spare):
            if buf.nbytes >= nbytes:
                return self._spare.pop(i)[:nbytes].view(dtype).reshape(shape)
        return np.empty(nbytes, np.uint8).view(dtype).reshape(shape)

    def ahead(self, sid: int, path: Path, offset: int, shape: tuple[int, int], dtype) -> None:
        if sid not in self._ahead:
            while len(self._ahead) >= self._keep:  # the oldest was not cleaned after all
                self.forget(next(iter(self._ahead)))
            try:
                fut = self._pool.submit(read_file_into, path, offset,
                                        self._buffer(shape, dtype))
            except RuntimeError:  # the pool is shut (interpreter exit): records reads it
                return
            self._ahead[sid] = fut

    def records(self, sid: int, path: Path, offset: int, shape: tuple[int, int],
                dtype) -> np.ndarray:
        fut = self._ahead.pop(sid, None)
        if fut is not None:
            try:
                return fut.result()
            except OSError:
                pass  # read again below: its error, if any, is the one raised
        return read_file_into(path, offset, self._buffer(shape, dtype))

    def release(self, buf: np.ndarray) -> None:
        base = buf.base
        while base is not None and base.base is not None:
            base = base.base
        if len(self._spare) < self._spares and isinstance(base, np.ndarray) and base.ndim == 1:
            self._spare.append(base)

    def forget(self, sid: int) -> None:
        fut = self._ahead.pop(sid, None)
        if fut is not None:
            fut.cancel()  # a read already running ends on its own; its buffer is dropped

    def close(self) -> None:
        self._ahead.clear()
        self._spare.clear()
        self._pool.shutdown(wait=True)
