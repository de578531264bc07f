"""The OS layer: the system calls the storage engines make beyond Python's ``os`` module.

One place for the page size, the C library and the calls reached through it (``madvise``,
``mincore``, ``sync_file_range``, ``mmap``/``munmap`` without a descriptor), and for the
loops that finish short ``pwrite``/``pwritev``/``preadv`` calls, the syncs
(:func:`fsync_path`: a file or a directory by path; :func:`fsync_fd`, :func:`fdatasync_fd`:
an open file), the page-cache probes of the checkpoint copy (:func:`page_residency`,
:func:`drop_pages`), and the one background thread shape (:class:`Worker`). Nothing here
knows about records, segments or stores.

Every ``pwrite``, ``pwritev``, ``fsync`` and ``fdatasync`` of the package goes through
:func:`pwrite_all`, :func:`pwritev_all`, :func:`fsync_path`, :func:`fsync_fd` and
:func:`fdatasync_fd` (called by these names, so that tests/helpers.py ``os_fault`` reaches
them all). Not through them: the writes of mappings (``msync``, the kernel's write-back),
``posix_fallocate``/``ftruncate``/``copy_file_range``, and ``np.save`` of the bucket plans
(buckets.py, through a file object; the file is then synced with :func:`fsync_fd`).

Users: both engines (``dsa_core._log``, ``dsa_core._inplace``) and the durable file
operations (``dsa_core._files``).

Each typed C function is a separate function object (``libc["name"]``, not ``libc.name``,
which ctypes caches and shares): setting one caller's ``argtypes`` never changes another's.
The ones taking addresses as ``size_t`` (:data:`madvise_addr`, :data:`mincore_addr`) can be
called from numba kernels, which then bake their addresses into the machine code: such
kernels must not be compiled with ``cache=True`` (the addresses change from process to
process).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MADV_PAGEOUT", "MADV_POPULATE_READ", "MADV_RANDOM", "MADV_WILLNEED", "MAP_FAILED",
           "PAGE", "POSIX_FADV_WILLNEED", "SYNC_FILE_RANGE_WAIT_AFTER",
           "SYNC_FILE_RANGE_WAIT_BEFORE", "SYNC_FILE_RANGE_WRITE", "Worker", "advise_memory",
           "drop_pages", "fadvise_fd", "fsync_path", "libc", "madvise_addr", "mincore_addr",
           "mmap_fn", "munmap_fn", "page_residency", "preadv_all", "preadv_fd", "pwrite_all",
           "pwritev_all", "start_writeback", "sync_file_range", "wait_written_back",
           "write_back"]

# the memory page size: the unit of madvise/mincore spans (4096 on x86-64)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MADV_RANDOM = 1
MADV_WILLNEED = 3
MADV_PAGEOUT = 21        # reclaim the range's pages (clean file pages are dropped)
MADV_POPULATE_READ = 22  # map the range's pages now (read faults), without dirtying them
POSIX_FADV_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)
SYNC_FILE_RANGE_WAIT_BEFORE = 1
SYNC_FILE_RANGE_WRITE = 2
SYNC_FILE_RANGE_WAIT_AFTER = 4

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

# addresses as size_t: numba passes them as plain integers (same ABI as a pointer on Linux)
madvise_addr = libc["madvise"]
madvise_addr.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]
madvise_addr.restype = ctypes.c_int
mincore_addr = libc["mincore"]
mincore_addr.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_size_t]
mincore_addr.restype = ctypes.c_int

# posix_fadvise(fd, offset, len, advice) -> 0 or an error number (not errno), callable from
# numba kernels
fadvise_fd = libc["posix_fadvise"]
fadvise_fd.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
fadvise_fd.restype = ctypes.c_int

mmap_fn = libc["mmap"]
mmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_long]
mmap_fn.restype = ctypes.c_void_p
munmap_fn = libc["munmap"]
munmap_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
munmap_fn.restype = ctypes.c_int
MAP_FAILED = ctypes.c_void_p(-1).value

try:
    sync_file_range = libc["sync_file_range"]
    sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    sync_file_range.restype = ctypes.c_int
except AttributeError:  # pragma: no cover - not Linux
    sync_file_range = None


def advise_memory(arr, advice: int) -> None:
    """``madvise(advice)`` every page of the memory of ``arr`` (an object with ``nbytes``
    and ``__array_interface__``: a numpy array over a mapping, say)."""
    if arr.nbytes:
        base = arr.__array_interface__["data"][0]
        lo = base & ~(PAGE - 1)
        madvise_addr(lo, base + arr.nbytes - lo, advice)


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Start writing the file's dirty pages back without waiting (a later fsync then has
    little left to do, and dirty page cache does not pile up); ``nbytes`` bytes from
    ``offset`` (0: to the end of the file). A hint: does nothing where the call is missing."""
    if sync_file_range is None:  # pragma: no cover - not Linux
        return
    try:
        sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)
    except OSError:  # pragma: no cover
        pass


def write_back(fd: int, offset: int = 0, nbytes: int = 0, path: Path | None = None) -> None:
    """Write ``nbytes`` bytes of the file from ``offset`` (0: to its end) back and wait until
    they are on the disk (``sync_file_range`` ``WAIT_BEFORE | WRITE | WAIT_AFTER``: data only,
    no metadata, no disk cache flush). A wait only: does nothing where the call is missing (a
    later fsync still makes them durable). ``path`` names the file in the error."""
    if sync_file_range is None:  # pragma: no cover - not Linux
        return
    if sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE
                       | SYNC_FILE_RANGE_WAIT_AFTER) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"writing {str(path or fd)!r} back failed: {os.strerror(err)}")


def wait_written_back(path: Path) -> None:
    """:func:`write_back` of the whole file ``path``."""
    if sync_file_range is None:  # pragma: no cover - not Linux
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        write_back(fd, path=path)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """fsync the file or directory ``path`` (opened read-only for it): a file's data, or a
    directory's entries (the renames and creations inside it). The one fsync by path of
    the package; an open file is synced with :func:`fsync_fd`."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_fd(fd: int) -> None:
    """``fsync`` the open file ``fd``: its data and metadata (size, blocks)."""
    os.fsync(fd)


def fdatasync_fd(fd: int) -> None:
    """``fdatasync`` the open file ``fd``: its data (and the metadata needed to read it)."""
    os.fdatasync(fd)


def page_residency(fd: int, nbytes: int) -> np.ndarray:
    """Which pages of the first ``nbytes`` bytes of the open file ``fd`` are in the page
    cache now: one bool per :data:`PAGE` (``mincore`` over a read-only shared mapping of
    the file, which reads nothing)."""
    npages = -(-nbytes // PAGE)
    vec = np.zeros(npages, np.uint8)
    if not npages:
        return vec.astype(bool)
    addr = mmap_fn(None, npages * PAGE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, MAP_FAILED):
        err = ctypes.get_errno()
        raise OSError(err, f"mmap for mincore failed: {os.strerror(err)}")
    try:
        if mincore_addr(addr, npages * PAGE, vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"mincore failed: {os.strerror(err)}")
    finally:
        munmap_fn(addr, npages * PAGE)
    return (vec & 1).astype(bool)


def drop_pages(fd: int, keep: np.ndarray | None = None) -> None:
    """Drop the open file's clean pages from the page cache (``POSIX_FADV_DONTNEED``; pages
    some process maps stay). With ``keep`` (a :func:`page_residency` result), only the
    runs of pages where it is False, so that the pages cached before stay cached. A hint:
    does nothing where the call is missing."""
    if keep is None:
        runs = [(0, 0)]  # the whole file
    else:  # runs of False; one that ends the file goes to its end (a folio past its size)
        edges = np.flatnonzero(np.diff(np.concatenate(([True], keep, [True])).astype(np.int8)))
        runs = [(int(a) * PAGE, 0 if b == keep.shape[0] else int(b - a) * PAGE)
                for a, b in zip(edges[::2], edges[1::2], strict=True)]
    for off, n in runs:
        try:
            os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            return


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of ``data`` (a buffer) at ``offset``, finishing short writes. A write that
    fails after a short one (a disk that filled up during it) raises its error saying how
    many bytes were written."""
    view = memoryview(data).cast("B")
    total = view.nbytes
    while view.nbytes:
        try:
            n = os.pwrite(fd, view, offset)
        except OSError as exc:
            if view.nbytes == total:
                raise
            raise OSError(exc.errno, f"{exc.strerror} after a short write "
                          f"({total - view.nbytes} of {total} bytes written)") from None
        if n <= 0:  # pragma: no cover - pwrite raises on a full disk
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: pwrite wrote nothing "
                          f"({total - view.nbytes} of {total} bytes written)")
        view, offset = view[n:], offset + n


def pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    """``pwritev`` of the byte ``views`` at ``offset``, finishing a short write view by
    view."""
    done = os.pwritev(fd, views, offset)
    for v in views:  # only after a short write (e.g. a nearly full disk) is anything left
        if done >= v.nbytes:
            done -= v.nbytes
            offset += v.nbytes
            continue
        pwrite_all(fd, v[done:], offset + done)
        offset += v.nbytes
        done = 0


def preadv_all(path: Path, offset: int, view: memoryview) -> None:
    """Fill the byte ``view`` with the bytes of the file ``path`` from ``offset`` on
    (sequential ``preadv`` s); a file shorter than that is an ``OSError``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        preadv_fd(fd, view, offset, path)
    finally:
        os.close(fd)


def preadv_fd(fd: int, view: memoryview, offset: int, path: Path,
              what: str = "its records") -> int:
    """:func:`preadv_all` on an open descriptor ``fd`` of ``path`` (named in the error, which
    says the file is ``... bytes short of <what>``); returns the ``preadv`` calls made."""
    done, total, calls = 0, len(view), 0
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        calls += 1
        if n <= 0:
            raise OSError(errno.EIO, f"{str(path)!r} ended at byte {offset + done}, "
                          f"{total - done} bytes short of {what}")
        done += n
    return calls



class Worker:
    """A daemon thread ``name`` calling ``run(item)`` for each submitted item, in order (each
    background thread of the engines is one, made by its owner when first needed).

    ``submit`` is the queue's own ``put`` (an item is never None or a ``threading.Event``:
    the worker's signals); ``maxsize`` bounds the queue, ``simple`` makes it a
    ``SimpleQueue``. ``join()`` waits for the items submitted before it, then raises the
    first exception that escaped ``run`` (kept until taken: :meth:`raise_error`, or
    :meth:`error` as ``(item, exc)``; the thread goes on). ``close()`` ends the thread after
    the queued items, ``drop=True`` without them (``on_drop(item)`` each), setting
    ``stopping`` first (a long item may check it); it waits unless ``wait=False`` (never for
    its own thread) and is safe twice; ``on_exit()`` runs on the thread as it ends. In a
    forked child (``forked``) ``join``/``close`` do nothing and the owner must not ``submit``.
    """

    def __init__(self, name: str, run: Callable[[Any], Any], maxsize: int = 0,
                 simple: bool = False, on_drop: Callable[[Any], Any] | None = None,
                 on_exit: Callable[[], Any] | None = None):
        self.pid, self.stopping, self._error = os.getpid(), False, None
        self._run, self._on_drop, self._on_exit = run, on_drop, on_exit
        self._q = queue.SimpleQueue() if simple else queue.Queue(maxsize)
        self.submit = self._q.put
        self._lock = threading.Lock()  # the kept error's (never taken per item)
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    @property
    def forked(self) -> bool:  # a child forked since: the thread is not here
        return self.pid != os.getpid()

    def _loop(self) -> None:
        get, run, event = self._q.get, self._run, threading.Event
        try:
            while (item := get()) is not None:  # None: close's stop
                if item.__class__ is event:  # join's marker
                    item.set()
                    continue
                try:
                    run(item)
                except BaseException as exc:  # kept for the owner; the thread goes on
                    with self._lock:
                        self._error = self._error or (item, exc)
                item = None  # hold nothing while waiting (arrays, mappings)
        finally:
            self._drop_queued()
            if self._on_exit is not None:
                self._on_exit()

    def _drop_queued(self) -> None:
        """Empty the queue: ``on_drop`` each item, release each joiner (a stop just goes)."""
        while True:
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if item.__class__ is threading.Event:
                item.set()
            elif item is not None and self._on_drop is not None:
                self._on_drop(item)

    def join(self) -> None:
        if self.pid == os.getpid() and self.thread is not threading.current_thread():
            if self.thread.is_alive():
                self._q.put(done := threading.Event())
                while not done.wait(1.0) and self.thread.is_alive():
                    pass  # never a hang on a thread that is gone
            self.raise_error()

    def error(self) -> tuple[Any, BaseException] | None:
        with self._lock:
            err, self._error = self._error, None
        return err

    def raise_error(self) -> None:
        if self._error is not None and (err := self.error()) is not None:
            raise err[1]

    def close(self, drop: bool = False, wait: bool = True) -> None:
        if self.pid != os.getpid():
            return
        first, self.stopping = not self.stopping, True
        if drop:
            self._drop_queued()  # an earlier close's stop too: it is put again
        if (first or drop) and self.thread.is_alive():
            self._q.put(None)
        if wait and self.thread is not threading.current_thread():
            self.thread.join()
