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

* ``segments.Segments.read_into`` does that for a step's or a gather's misses,
  synchronously, but only when a small sample of them is not in the page cache
  (:func:`sample_uncached`, ``mincore``): a store whose segments are cached (a table that
  fits in memory) pays a few syscalls per batch, not one per record.
* :class:`ReadAhead` does it in a background thread for the rows of a *future* batch
  (``dsa_core.prefetch`` / ``prefetched`` on a log store), so that the reads overlap the
  current step.
* :class:`CleaningReads` reads the live records of the segments cleaning will copy from,
  in a background thread, with sequential ``pread`` s into buffers of their own (one
  request of at most ``CLEAN_READ_BYTES`` at a time, so that the disk's queue serves the
  steps first; dead stretches up to ``CLEAN_GAP_BYTES`` read through, longer ones skipped:
  :func:`read_plan`), at most ``CLEAN_HELD_BYTES`` of buffers in all, and paced: after a
  request that took ``t`` seconds the thread rests ``t * (1 - CLEAN_DUTY) / CLEAN_DUTY``
  (a quarter: three times ``t``), so that cleaning holds the disk at most ``CLEAN_DUTY`` of
  the time, but only until the next seal: each seal ends the rests of the reads started
  before it (the seal after it needs them: ``hurry_all``), and so does a seal that waits
  for a read (``get``). Unpaced, a seal's reads
  ahead (the next victims' ~45 MiB, out of core at the space bound) ran back to back right
  after it, and the steps' reads in that window waited twice as long for the disk (4M x 128
  under a 1 GiB cgroup: a step that sealed took 140-180 ms against ~35 for the others, 115
  of them in its misses' reads). Paced at a quarter the same store ran 1.14x the rows/s
  (medians of three and four alternated runs) and its p99 step fell from 5.5-6.3x the
  median to 2.7-3.1x; at a half, no faster than unpaced. Copying the live
  records out of the mapping instead faulted one 4 KiB page at a time whenever the
  read-ahead pages had been reclaimed again, which under a memory cap they mostly were: out
  of core (4M x 128 under a 1 GiB cgroup) a seal that cleaned spent ~0.35 s in such faults.
  The cleaner (``cleaner``) decides what is read and when.

**Reads someone waits for go first.** A read-ahead for a later batch queues one request per
record; the device serves requests in the order they arrive (a virtual disk's queue, 256
deep here, whatever the scheduler), so while it runs, a miss of the batch being stepped or
gathered now -- a record whose page was reclaimed since its own read-ahead, a sum's page --
waits behind hundreds of the later batch's requests, and the copy that needs it waits for
the whole stream: in the random-order torch loop out of core (2M x 128 log store, 1 GiB
cgroup, 24.6k rows per batch, the next batch prefetched) a gather lasted as long as the next
batch's read-ahead, ~530 ms, of which ~150 ms was copying. So :meth:`Segments.read_into`
(``segments``) holds :data:`FOREGROUND` while it copies, and the background read-ahead
issues its requests in chunks of :data:`HINT_CHUNK` records, waiting before each chunk until
no foreground read is running (at most :data:`HINT_WAIT` seconds per chunk: a hint is never
starved for good). Measured: docs/notebook.md (issue 44, foreground reads first).

But only a read whose records are cached holds it (its sample finds none on the disk): a
copy of a batch the read-ahead brought in, which must neither wait behind the next batch's
requests for the few pages it still faults in nor see them pushed out while it copies. A
read that finds its records on the disk (out of core, the step of a batch whose read-ahead
has not finished: the disk is the bottleneck) queues its own reads and lets the read-ahead
of the batches after it go on: holding the foreground there stopped the read-ahead for most
of every step and the device's queue drained at the end of each batch's reads (2M x 128
under 512 MiB, ``benchmarks.guard --only ooc``: 59-66k rows/s held, 70-76k not, alternated;
the random-order torch loop the same either way).

Hints never change a value: the records are still copied from the mappings, under the
engine's own control, so a hint that is late, early or wrong (a location that moved since)
costs at most a wasted read. A task holds references to the segments it hints, so their
mappings stay valid until it has run.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
from numba import njit

from . import budget as _budget
from .._os import (
    MADV_RANDOM,
    MADV_WILLNEED,
    PAGE,
    Worker,
    advise_memory,
    madvise_addr,
    mincore_addr,
    preadv_all,
    preadv_fd,
)

__all__ = ["CLEAN_DUTY", "CLEAN_GAP_BYTES", "CLEAN_HELD_BYTES", "CLEAN_READ_BYTES", "FOREGROUND",
           "HINT_CHUNK", "HINT_WAIT",
           "MADV_RANDOM", "MADV_WILLNEED", "PAGE", "WHOLE_MAX", "CleaningReads", "ReadAhead", "advise",
           "advise_records", "advise_whole", "cold", "hint_uncached", "read_file_into", "read_plan",
           "record_spans", "sample_uncached"]

SAMPLE = 16         # misses probed with mincore before deciding to issue read-ahead
HINT_CHUNK = 256    # background read-ahead: records advised between two looks at FOREGROUND
HINT_WAIT = 1.0     # the longest a background chunk waits for the foreground reads (seconds)
# cleaning reads (CleaningReads): what they may hold and how they meet the disk. The sizes
# are the budget's (budget.cleaning_limits scales them down for a small store); these are
# the defaults of a CleaningReads of its own, and caps the cleaner applies on top of the
# budget's (lowering one here, as a test or a benchmark may, lowers what the cleaner uses)
WHOLE_MAX = _budget.WHOLE_MAX  # a segment's live records read into a buffer up to this
CLEAN_HELD_BYTES = _budget.CLEAN_BUFFERS * WHOLE_MAX  # buffers held (done or running) at most
CLEAN_READ_BYTES = _budget.CLEAN_READ_BYTES  # one cleaning read request at most; one at a time
CLEAN_GAP_BYTES = 256 << 10  # dead bytes between two live records read through, not skipped
# the share of the time the reading thread may keep a request at the disk (1: back to back);
# a read on a seal's own thread (CleaningReads.now: the seal must not wait) is not paced
CLEAN_DUTY = 0.25



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


@njit(cache=True, nogil=True)
def _pick_rows(blk, ks, k_lo, out):
    """``out[i] = blk[ks[i] - k_lo]`` (byte rows), with no temporary."""
    for i in range(ks.shape[0]):
        out[i, :] = blk[ks[i] - k_lo, :]


class Foreground:
    """Counts the reads running now that a caller waits for (``with FOREGROUND:``); the
    background read-ahead waits for none to be running before each chunk (``wait_idle``).
    One per process: the reads of every store in it share the device's queue."""

    def __init__(self):
        self._cv = threading.Condition(threading.Lock())
        self._n = 0

    def __enter__(self) -> Foreground:
        with self._cv:
            self._n += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cv:
            self._n -= 1
            if not self._n:
                self._cv.notify_all()

    @property
    def busy(self) -> bool:
        return self._n > 0

    def wait_idle(self, most: float) -> None:
        """Until no foreground read runs, or ``most`` seconds."""
        if self._n:
            with self._cv:
                self._cv.wait_for(lambda: not self._n, timeout=most)


FOREGROUND = Foreground()
if hasattr(os, "register_at_fork"):  # a child starts with no foreground read of its own
    os.register_at_fork(after_in_child=lambda: FOREGROUND.__init__())


def record_spans(addrs: np.ndarray, rec_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted page-aligned spans ``(lo, hi)`` covering the records that start at ``addrs``."""
    a = np.sort(np.asarray(addrs, np.int64))
    lo = a & ~np.int64(PAGE - 1)
    hi = (a + (rec_bytes + PAGE - 1)) & ~np.int64(PAGE - 1)
    return lo, hi


def advise(addrs: np.ndarray, rec_bytes: int, advice: int = MADV_WILLNEED,
           yield_to: Foreground | None = None) -> int:
    """Issue ``advice`` for the pages of the records at ``addrs``; returns the syscalls made.
    ``yield_to``: in chunks of :data:`HINT_CHUNK` records, each after its foreground reads
    (``Foreground.wait_idle``)."""
    if not addrs.shape[0]:
        return 0
    lo, hi = record_spans(addrs, rec_bytes)
    if yield_to is None:
        return int(_advise_spans(lo, hi, advice))
    calls = 0
    for i in range(0, lo.shape[0], HINT_CHUNK):
        yield_to.wait_idle(HINT_WAIT)
        calls += int(_advise_spans(lo[i:i + HINT_CHUNK], hi[i:i + HINT_CHUNK], advice))
    return calls


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


def cold(addrs: np.ndarray, rec_bytes: int) -> bool:
    """Whether the records at ``addrs`` are worth reading ahead: two or more, and a sample
    of them not all in the page cache (:func:`sample_uncached`; one record faults alone)."""
    return addrs.shape[0] >= 2 and sample_uncached(addrs, rec_bytes)


def advise_records(addrs: np.ndarray, rec_bytes: int, sums: np.ndarray | None = None,
                   yield_to: Foreground | None = None) -> int:
    """Read ahead the records at ``addrs``, then the 8-byte sums at ``sums`` (each record
    read is checked against its sum); returns the syscalls made. ``yield_to``: a background
    read-ahead's, issued around the foreground reads (:func:`advise`)."""
    calls = advise(addrs, rec_bytes, yield_to=yield_to)
    if sums is not None:  # (none to advise: advise returns 0 at once)
        calls += advise(sums, 8, yield_to=yield_to)
    return calls


def hint_uncached(addrs: np.ndarray, rec_bytes: int, sums: np.ndarray | None = None,
                  yield_to: Foreground | None = None) -> int:
    """:func:`advise_records` if the records are :func:`cold`; returns the syscalls made
    (0: the sample was cached, nothing issued)."""
    return advise_records(addrs, rec_bytes, sums, yield_to) if cold(addrs, rec_bytes) else 0


class ReadAhead:
    """One background thread (an ``_os.Worker``) issuing read-ahead for queued addresses.

    ``submit(addrs, keep)`` queues the addresses (``keep``: the segments they lie in, held
    until the hint has run) and returns at once, unless ``depth`` tasks are already queued
    (back-pressure). ``join`` waits until every queued task has been issued (not until the
    reads finish); an error (not a hint's ``OSError``) is raised by the next call. Created
    per process: a forked child gets a new one (see ``LogStore``).
    """

    def __init__(self, rec_bytes: int, depth: int = 4):
        self.rec_bytes = int(rec_bytes)
        self.tasks = 0
        self.calls = 0
        self._worker = Worker("dsa-log-readahead", self._run, maxsize=max(1, int(depth)))
        self.pid = self._worker.pid

    def _run(self, task) -> None:
        addrs, sums, _keep = task
        try:
            self.calls += hint_uncached(addrs, self.rec_bytes, sums, yield_to=FOREGROUND)
        except OSError:  # pragma: no cover - a hint that fails changes nothing
            return
        self.tasks += 1

    def submit(self, addrs: np.ndarray, keep, sums: np.ndarray | None = None) -> None:
        """Queue the hint of the records at ``addrs`` (and of their sums at ``sums``)."""
        self._worker.raise_error()
        if addrs.shape[0]:
            self._worker.submit((addrs, sums, keep))

    def join(self) -> None:
        self._worker.join()

    def close(self) -> None:
        self._worker.close()


def read_file_into(path: Path, offset: int, out: np.ndarray) -> np.ndarray:
    """Fill the C-contiguous array ``out`` with the bytes of ``path`` from ``offset`` on
    (sequential ``preadv`` s; a file shorter than that is an error). Returns ``out``."""
    preadv_all(path, offset, memoryview(out).cast("B"))
    return out


def read_plan(ks: np.ndarray, rec_bytes: int, gap: int | None = None,
              chunk: int | None = None) -> list[tuple[int, int, int, int]]:
    """How cleaning reads the records ``ks`` (sorted record numbers of one segment): a list
    of requests ``(k_lo, k_hi, i_lo, i_hi)``, each one ``pread`` of the records
    ``[k_lo, k_hi)``, which hold ``ks[i_lo:i_hi]``.

    Two wanted records at most ``gap`` bytes of unwanted ones apart share a request (the
    records between are read through: one larger read costs the disk less than two);
    ``gap=None`` reads from the first wanted record to the last in one span. A request holds
    at most ``max(1, chunk // rec_bytes)`` records (``chunk=None``: no limit), so the disk
    never sees a cleaning read larger than ``chunk`` bytes.

    >>> read_plan(np.array([0, 1, 2, 9]), 100, gap=200, chunk=250)
    [(0, 2, 0, 2), (2, 3, 2, 3), (9, 10, 3, 4)]
    >>> read_plan(np.array([0, 1, 2, 9]), 100)
    [(0, 10, 0, 4)]
    """
    n = ks.shape[0]
    if not n:
        return []
    ks = np.asarray(ks, np.int64)
    if gap is None:
        cuts = np.empty(0, np.int64)
    else:
        dead = (ks[1:] - ks[:-1] - 1) * rec_bytes
        cuts = np.flatnonzero(dead > gap) + 1
    per = 1 << 62 if chunk is None else max(1, int(chunk) // rec_bytes)
    plan = []
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), n], strict=True):
        k_lo, k_end = int(ks[a]), int(ks[b - 1]) + 1
        while k_lo < k_end:
            k_hi = min(k_lo + per, k_end)
            i_lo = int(np.searchsorted(ks, k_lo))
            i_hi = int(np.searchsorted(ks, k_hi))
            if i_hi > i_lo:  # a chunk of the span may hold no wanted record: not read
                plan.append((k_lo, k_hi, i_lo, i_hi))
            k_lo = k_hi
    return plan


class _Read:
    """One segment's records read (or being read) for cleaning; ``nbytes``: what it holds
    (its buffer and its record numbers)."""

    __slots__ = ("fut", "hurry", "ks", "nbytes", "out")

    def __init__(self, ks: np.ndarray, out: np.ndarray, fut: Future,
                 hurry: threading.Event | None = None):
        self.ks, self.out, self.fut = ks, out, fut
        self.hurry = hurry  # set: its remaining requests are not paced (a seal waits for it)
        self.nbytes = out.nbytes + ks.nbytes


class CleaningReads:
    """Reads of the records cleaning will copy, in one background thread, one request at a time.

    ``ahead(sid, path, offset, ks, stride, dtype)`` starts reading the records ``ks`` (sorted
    record numbers) of a segment file whose records start at byte ``offset`` into a buffer
    of their own, ``(len(ks), stride)``: the requests of :func:`read_plan` (``gap``,
    ``chunk``), issued one after another by the thread, so that cleaning keeps at most one
    read of at most ``chunk`` bytes in the disk's queue and the steps' random reads keep
    theirs. ``now`` reads on the caller's thread instead (a seal that must not wait for the
    queue). Both refuse (False, None: nothing read) when the buffers held would exceed
    ``held_bytes``; a read counts its buffer and its ``ks`` (8 bytes per record) until ``release`` (its records were copied) or
    ``forget`` (not needed: a running read ends on its own, its buffer counted until then).
    ``ready(sid)``: that read is done; ``get(sid)``: ``(buffer, ks)``, waiting for it.

    Memory: at most ``held_bytes`` of buffers and their ``ks``, plus the thread's request buffer and, during
    :meth:`now`, one more of the caller's (each :attr:`request_bytes`: ``chunk`` in whole
    records, at least one; used only by a request with dead records between live ones).
    Nothing else of a record's size: the live records are picked out of a request buffer
    straight into their own buffer. ``budget.cleaning_limits`` sizes both for a store.

    A segment file is immutable once written, so a buffer read at any time holds exactly its
    records. ``bytes_read`` and ``requests`` count what was read (both threads). Created per
    process (``pid``).
    """

    def __init__(self, held_bytes: int | None = None, chunk: int | None = None,
                 gap: int | None = None):
        self.pid = os.getpid()
        self.held_bytes = CLEAN_HELD_BYTES if held_bytes is None else int(held_bytes)
        self.chunk = CLEAN_READ_BYTES if chunk is None else int(chunk)
        self.gap = CLEAN_GAP_BYTES if gap is None else int(gap)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsa-log-clean-read")
        self._reads: dict[int, _Read] = {}
        self._dropping: list[_Read] = []  # forgotten while running: counted until they end
        self.held = 0  # bytes of the buffers of the reads held (and of those running)
        self.bytes_read = 0
        self.requests = 0
        self._count = threading.Lock()
        self._scratch: np.ndarray | None = None  # the thread's, for requests with gaps
        self.rested = 0.0  # seconds the reading thread rested (pacing, CLEAN_DUTY)
        self.busy = 0.0  # seconds the requests took (both threads)
        self._rest_until = 0.0  # the thread's next paced request starts no earlier

    def _read(self, path: Path, offset: int, ks: np.ndarray, out: np.ndarray,
              scratch: np.ndarray | None, hurry: threading.Event | None = None) -> np.ndarray:
        """Read the records ``ks`` into ``out`` (rows in ``ks`` order); returns ``out``.
        ``hurry``: paced (``CLEAN_DUTY``, module docstring) until that event is set."""
        paced = hurry is not None
        rec = out.shape[1] * out.dtype.itemsize
        plan = read_plan(ks, rec, self.gap, self.chunk)
        flat = out.reshape(-1).view(np.uint8)
        rows = flat.reshape(-1, rec)
        fd = os.open(path, os.O_RDONLY)
        try:
            for k_lo, k_hi, i_lo, i_hi in plan:
                if paced:
                    self._rest(hurry)
                t_req = time.perf_counter()
                nbytes = (k_hi - k_lo) * rec  # at most request_bytes (read_plan's chunk)
                if i_hi - i_lo == k_hi - k_lo:  # every record wanted: straight into out
                    _pread_full(fd, memoryview(flat[i_lo * rec:i_hi * rec]),
                                offset + k_lo * rec, path)
                else:
                    if scratch is None or scratch.nbytes < nbytes:
                        scratch = np.empty(self.request_bytes(rec), np.uint8)
                    _pread_full(fd, memoryview(scratch[:nbytes]), offset + k_lo * rec, path)
                    _pick_rows(scratch[:nbytes].reshape(k_hi - k_lo, rec), ks[i_lo:i_hi],
                               np.int64(k_lo), rows[i_lo:i_hi])
                end = time.perf_counter()
                if paced:  # what the next request waits for (idle time counts)
                    duty = min(1.0, max(CLEAN_DUTY, 0.01))
                    self._rest_until = end + (end - t_req) * (1.0 - duty) / duty
                with self._count:
                    self.bytes_read += nbytes
                    self.requests += 1
                    self.busy += end - t_req
        finally:
            os.close(fd)
        return out

    def _rest(self, hurry: threading.Event) -> None:
        """Before a paced request: rest until ``t * (1 - CLEAN_DUTY) / CLEAN_DUTY`` after
        the previous one, which took ``t`` (time without a request counts as rest), unless
        ``hurry`` is set (then, or once it is set)."""
        wait = self._rest_until - time.perf_counter()
        if wait > 0 and not hurry.is_set():
            t0 = time.perf_counter()
            hurry.wait(wait)
            self.rested += time.perf_counter() - t0

    def request_bytes(self, rec_bytes: int) -> int:
        """The largest request (and request buffer) for records of ``rec_bytes``: ``chunk``
        in whole records, at least one (``read_plan``)."""
        return max(1, self.chunk // rec_bytes) * rec_bytes

    def _run(self, path: Path, offset: int, ks: np.ndarray, out: np.ndarray,
             hurry: threading.Event) -> np.ndarray:
        rec = out.shape[1] * out.dtype.itemsize
        if self._scratch is None:  # the thread's own request buffer, reused
            self._scratch = np.empty(self.request_bytes(rec), np.uint8)
        return self._read(path, offset, ks, out, self._scratch, hurry)

    def _purge(self) -> None:
        """Stop counting the buffers of forgotten reads that have ended."""
        if self._dropping:
            ended = [r for r in self._dropping if r.fut.done()]
            for r in ended:
                self._dropping.remove(r)
                self.held -= r.nbytes

    @staticmethod
    def _buffer(ks: np.ndarray, stride: int, dtype, pitch: int | None) -> np.ndarray:
        """The buffer of a read of the records ``ks``: ``(len(ks), stride)`` records, or, in
        a file whose records are ``pitch`` bytes apart with their sums beside them (segment
        version 3), ``(len(ks), pitch)`` bytes read as they lie: records and sums."""
        rb = stride * np.dtype(dtype).itemsize
        if pitch is None or pitch == rb:
            return np.empty((ks.shape[0], stride), dtype)
        return np.empty((ks.shape[0], pitch), np.uint8)

    @staticmethod
    def cost(ks: np.ndarray, stride: int, dtype, pitch: int | None = None) -> int:
        """What a read of the records ``ks`` holds: its buffer and ``ks``."""
        width = stride * np.dtype(dtype).itemsize if pitch is None else pitch
        return ks.shape[0] * width + ks.nbytes

    def room(self, nbytes: int) -> bool:
        """Whether a buffer of ``nbytes`` more stays within ``held_bytes``."""
        self._purge()
        return self.held + nbytes <= self.held_bytes

    def ahead(self, sid: int, path: Path, offset: int, ks: np.ndarray, stride: int,
              dtype, pitch: int | None = None) -> bool:
        if sid in self._reads:
            return True
        if not self.room(self.cost(ks, stride, dtype, pitch)):
            return False
        out = self._buffer(ks, stride, dtype, pitch)
        hurry = threading.Event()
        try:
            fut = self._pool.submit(self._run, path, offset, ks, out, hurry)
        except RuntimeError:  # the pool is shut (interpreter exit): read now instead
            return False
        self._reads[sid] = _Read(ks, out, fut, hurry)
        self.held += self._reads[sid].nbytes
        return True

    def now(self, sid: int, path: Path, offset: int, ks: np.ndarray, stride: int,
            dtype, pitch: int | None = None) -> np.ndarray | None:
        """Read the records ``ks`` on the caller's thread into a buffer held as a read of
        ``sid`` (``release`` it); None, nothing read, when it would exceed ``held_bytes``."""
        self.forget(sid)
        if not self.room(self.cost(ks, stride, dtype, pitch)):
            return None
        out = self._read(path, offset, ks, self._buffer(ks, stride, dtype, pitch), None)
        fut: Future = Future()
        fut.set_result(out)
        self._reads[sid] = _Read(ks, out, fut)
        self.held += self._reads[sid].nbytes
        return out

    def has(self, sid: int) -> bool:
        """A read of ``sid`` was started (done or not)."""
        return sid in self._reads

    def ready(self, sid: int) -> bool:
        r = self._reads.get(sid)
        return r is not None and r.fut.done()

    def get(self, sid: int) -> tuple[np.ndarray, np.ndarray] | None:
        """``(buffer, ks)`` of the read of ``sid``, waiting for it if it runs; None when
        there is none, or it failed (it is dropped: read again with :meth:`now`, whose
        error, if any, is the one raised)."""
        r = self._reads.get(sid)
        if r is None:
            return None
        if not r.fut.done():  # a seal waits for it (and the reads queued before it)
            self.hurry_all()
        try:
            return r.fut.result(), r.ks
        except OSError:
            self.forget(sid)
            return None

    def join(self) -> None:
        """Wait until every read started is done (a deterministic benchmark, tests)."""
        for r in list(self._reads.values()):
            try:
                r.fut.result()
            except OSError:
                pass  # get drops it, and reading it again raises its error

    def hurry_all(self) -> None:
        """The reads started so far (running or queued) rest no more: the cleaner calls it
        at each seal for the reads of the seals before (the next seal needs them), and
        :meth:`get` when a seal waits. A read rests at most about one seal's interval."""
        for r in [*self._reads.values(), *self._dropping]:
            if r.hurry is not None:
                r.hurry.set()

    def release(self, sid: int) -> None:
        """The buffer of ``sid``'s read is not used any more."""
        r = self._reads.pop(sid, None)
        if r is not None:
            self.held -= r.nbytes

    def forget(self, sid: int) -> None:
        """Drop a read not needed any more; a running one ends on its own, and its buffer
        counts until then."""
        r = self._reads.pop(sid, None)
        if r is not None:
            if r.fut.cancel() or r.fut.done():
                self.held -= r.nbytes
            else:
                self._dropping.append(r)

    def close(self) -> None:
        self.hurry_all()  # a read still running ends without its rests
        for sid in list(self._reads):
            self.forget(sid)
        self._pool.shutdown(wait=True)
        self._purge()


def _pread_full(fd: int, view: memoryview, offset: int, path: Path) -> None:
    preadv_fd(fd, view, offset, path, "the records to clean")
