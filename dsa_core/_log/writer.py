"""Writing sealed segments in the background (write-behind for ``commit``'s seals).

A seal used to write its segment in the step that needed room: gather the records, CRC them,
``pwrite`` them into the page cache -- about 3 us per 1 KiB record, most of it the write and
the checksum, so out of core every ~16th step stalled for ~100 ms. Now the engine only
gathers the seal's records into a buffer of its own (the region's slots are then free at
once) and hands the buffer to this module's thread, which computes the CRCs and writes the
file (``format.write_segment``; both release the GIL) while the next steps run.

Until its write is done a segment is *pending*: the segment table (``segments``) keeps it
with its records in that buffer, so every read of it -- a miss, ``read``, cleaning,
``verify`` -- sees exactly the bytes being written. Once written the table maps the file in
place of the buffer (same bytes) and keeps the buffer for the next seals. Nothing in the
manifest refers to a pending segment: ``flush`` waits for every pending write, then fsyncs,
then commits, so a crash during a background write leaves a file that the next ``open``
removes as garbage, and the store reopens at its last flush as before.

Once written, the thread waits for the file's pages to reach the disk (``sync_file_range``),
so that no dirty page cache is left behind: a memory cgroup's reclaim must wait for dirty
pages -- out of core under a 2 GiB cap, steps that allocated anything stalled for ~0.4 s behind
the segments' write-back. The clean pages of the most recent segments stay in the page cache,
up to ``cache_bytes`` (the engine's window: a share of the memory the process may use); past
it the oldest written segment's pages are dropped (``POSIX_FADV_DONTNEED``). Rows that just
left the region are then read back from memory when a step wants them again soon, and the
pages a new segment needs are the ones just freed, which costs little: on a virtual machine
memory that has been free a while is backed again by the host on its first touch (writing a
32 MiB segment into such pages took ~100 ms of CPU, into recycled ones ~10 ms). (``flush``
still fsyncs.)

The window is ``CACHE_SHARE`` (1/8) of the memory the process may use, with no smaller cap
(``segments.cache_window``; ``segments.CACHE_MAX`` caps it in A/B runs). Growing the page
cache is what a write costs most while the window fills: ``benchmarks/write_path.py``
measured 115 ms of CPU to write 32 MiB into pages the page cache takes for the first time on
the project's VM, 11.7 ms into pages just freed; once the window is full every segment
reuses the pages the oldest one's drop frees. From 2026-12-03 to 12-06 the window was capped
at one seal unit (32 MiB) to spare that one-off CPU, which sent every row that left the
region back to the disk: in the steady state of a long run (every row sealed once; 2M x 128,
region 25% of the state, uniform batches of 2048, ``dsa_core.step``) the capped window ran
78-98k rows/s against 115-189k with the 1/8 share (three alternated pairs;
docs/notebook.md, "The written-segment window"). Each job's CPU time (the thread's own,
``time.thread_time``) is counted: ``SegmentWriter.cpu_s`` / ``jobs``, shown by the store's
``stats()`` (``dsa info``).

The records go to the disk ``PACE_BYTES`` (4 MiB) at a time, each block written back
(``sync_file_range`` with waits) before the next is written: a 32 MiB segment written at once
sat in the device's queue ahead of the next steps' misses. Out of core at a 25% region (1M x
128, two runs each) the steps' p90 went from 31.7-34.3 to 26.3-29.7 ms and the median step
that sealed from 32.9-34.0 to 29.1-31.0 ms, at the same mean; the warm step at a 25% region
(``benchmarks.log_warm``) did not change (0.95-1.04 of the in-place store either way).

A write that fails is retried once, synchronously, by the next seal or flush of the engine
(the records are still in the buffer); if the retry fails too, that seal or flush raises
before it changes anything, and the segment stays pending, readable, for a later retry.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np

from .._os import Worker, wait_written_back
from .budget import WRITE_BUFFERS
from .format import write_segment

__all__ = ["DEPTH", "PACE_BYTES", "SegmentWriter", "WriteJob"]

# writes queued or running at once; a seal beyond that waits for the oldest (segments: the
# buffers, pending or spare, are at most budget.WRITE_BUFFERS, which this equals)
DEPTH = WRITE_BUFFERS
# a segment is written in blocks of this many bytes, each on the disk before the next (0: at
# once): the steps' reads then never queue behind more than a block of a segment's writes
PACE_BYTES = 4 << 20


class WriteJob:
    """One segment to write: its file, rows, steps and records (an in-memory buffer)."""

    __slots__ = ("count", "cpu_s", "done", "dtype", "error", "head", "path", "records",
                 "recycle", "rows", "sid", "size", "steps", "stride")

    def __init__(self, path: Path, sid: int, rows: np.ndarray, steps: np.ndarray,
                 records: np.ndarray, count: int, recycle: Path | None = None,
                 head: int = 0, stride: int | None = None, dtype=None):
        self.path, self.sid, self.rows, self.steps = path, sid, rows, steps
        self.head = int(head)  # the record bytes the first sum covers (format.write_segment)
        self.recycle = recycle  # a dead file to overwrite (format.write_segment), used once
        # the records: (n, stride) of the store's dtype, or (n, pitch) bytes laid out as in
        # the file (a seal's buffer: format.laid_out), whose sums the write fills in
        self.records, self.count = records, int(count)
        self.stride = records.shape[1] if stride is None else int(stride)
        self.dtype = records.dtype if dtype is None else np.dtype(dtype)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.size = 0
        self.cpu_s = 0.0  # CPU time of the thread that ran it, in run()

    def run(self, drop: bool = True) -> None:
        """Write the file now (in the calling thread); records the error instead of raising.

        ``drop``: drop its pages from the page cache once on the disk (the writer thread keeps
        a window of recent segments cached instead, and drops them later).
        """
        self.error = None
        t0 = time.thread_time()
        try:
            k = max(1, PACE_BYTES // self.records[:1].nbytes) if PACE_BYTES else 0
            blocks = ([self.records[lo:lo + k] for lo in range(0, self.rows.shape[0], k)] if k
                      else [self.records])
            recycle, self.recycle = self.recycle, None  # a retry writes a new file
            self.size = write_segment(self.path, self.sid, self.rows, self.steps, blocks,
                                      self.stride, self.dtype, self.count, paced=bool(k),
                                      recycle=recycle, head=self.head)
            wait_written_back(self.path)
            if drop:
                _drop_cached(self.path)
        except BaseException as exc:  # handed to the engine: its next seal or flush raises
            self.error = exc
        finally:
            self.cpu_s += time.thread_time() - t0
            self.done.set()


def _drop_cached(path: Path) -> None:
    """Drop a written segment's clean pages from the page cache (gone already: nothing to do;
    pages mapped by a reader stay, the kernel reclaims those)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # cleaned and deleted since; any other failure only leaves pages cached
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:  # pragma: no cover - a hint
        pass
    finally:
        os.close(fd)


class SegmentWriter:
    """One daemon thread (an ``_os.Worker``) running :class:`WriteJob` s in submission order.

    ``submit`` waits while ``DEPTH`` jobs are queued or running (back-pressure: at most that
    many buffers beyond the region). Created per process (``pid``): a forked child gets none
    and writes synchronously. ``cache_bytes``: the written segments whose pages stay in the
    page cache, newest first (the module docstring).
    """

    def __init__(self, depth: int | None = None, cache_bytes: int = 0):
        self.cache_bytes = int(cache_bytes)
        self._cached: deque[tuple[Path, int]] = deque()  # written, pages kept: oldest first
        self._held = 0
        self.cpu_s = 0.0  # CPU time of this thread's jobs (write, checksums, cache drops)
        self.jobs = 0
        self._slots = threading.Semaphore(DEPTH if depth is None else depth)
        self._worker = Worker("dsa-log-writer", self._run)
        self.pid = self._worker.pid

    def _run(self, job: WriteJob) -> None:
        try:
            job.run(drop=False)
            t0 = time.thread_time()
            if job.error is None:
                self._keep(job.path, job.size)
            else:  # a retry by the engine writes it again, and drops it
                _drop_cached(job.path)
            self.cpu_s += job.cpu_s + time.thread_time() - t0
            self.jobs += 1
        finally:
            self._slots.release()

    def _keep(self, path: Path, size: int) -> None:
        """Keep ``path``'s pages cached; drop the oldest kept segments past ``cache_bytes``."""
        self._cached.append((path, size))
        self._held += size
        while self._held > self.cache_bytes:
            old, n = self._cached.popleft()
            self._held -= n
            _drop_cached(old)

    @property
    def alive(self) -> bool:
        return self._worker.thread.is_alive()

    def submit(self, job: WriteJob) -> WriteJob:
        self._worker.raise_error()
        self._slots.acquire()
        self._worker.submit(job)
        return job

    def close(self) -> None:
        """Finish the queued jobs, then stop the thread."""
        self._worker.close()
