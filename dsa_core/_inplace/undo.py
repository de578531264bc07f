"""The undo file of an in-place store: the old records of the rows changed since the last flush.

With ``durability="flush"`` an in-place store's rows reach its file whenever the kernel writes
the mapped pages back. A process that ends between two flushes (SIGTERM, kill -9, an OOM kill,
``os._exit``) leaves rows of later steps in the file (or in the page cache, which outlives the
process) beside the manifest's count. To reopen exactly at the last flush, the old bytes of
every row changed since that flush must outlive the process too: before a row's first change
in a flush interval, its record is appended to ``undo.dsa``. That write goes to the page cache
and is **not synced**: the page cache outlives the process but not the machine, so the file is
trusted only when the boot that wrote it is the current one (the kernel's boot id). After a
power cut or a reboot the store is refused as before (``UncleanStopError``).

Layout (all little-endian)::

    header (4096 B) : b"DSAUNDO1" | boot id (36 ASCII bytes, zero-padded to 40) | u64 epoch
                      | i64 base count | i64 synced count | u32 flags | u32 crc32 of the
                      bytes before it | zero padding
    block           : head page (4096 B): b"DSAUBLK1" | u64 epoch | u64 n | u32 crc32 of
                      the 24 bytes before it | zeros;
                      body: n int64 row ids | n records (the store's stride and dtype) |
                      zeros to a whole page

``base``: the manifest count the blocks restore the rows to; ``epoch``: a random number drawn
when the interval begins, which every block of the interval repeats (should an older
interval's blocks be left past the end, they fail this check). A block's body is
written before its head, and the rows only change after both: a head that checks out names
a complete body. ``synced``: the count whose rows a flush has synced before writing its
manifest (-1 until then): a process that dies between that manifest and the marker's clear
leaves rows that are exactly the manifest's. ``flags`` bit 0: the interval changed rows
without saving them (the undo write failed, e.g. a full disk): a stop is refused as before.

Recovery (:func:`inspect` and :meth:`Verdict.apply`) writes the saved records back, syncs the
data file and clears the store's marker: repeated after a kill during recovery it does the
same again. The file is truncated when an interval begins (the last interval's blocks are
dropped with their page-cache pages, most of them before the kernel writes them to the disk)
and at a clean close.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from numba import njit

from .._coalesce import gather_rows
from .._intrinsics import prefetch_line
from .._layout import UNDO_FILE
from .._os import pwrite_all
from .._pool import run_chunked

__all__ = ["UndoLog", "Verdict", "boot_id", "discard", "inspect", "warmup"]

MAGIC = b"DSAUNDO1"
BLOCK_MAGIC = b"DSAUBLK1"
_HEAD = struct.Struct("<8s40sQqqI")   # magic, boot id, epoch, base, synced, flags (+ crc)
_BLOCK = struct.Struct("<8sQQ")       # magic, epoch, n (+ crc, 4 zeros)
HEADER_BYTES = 4096
PAGE = 4096  # blocks are whole pages at page offsets: O_DIRECT writes them as they are
BLOCK_HEAD = PAGE  # a block's head has a page of its own, written after its body
INCOMPLETE = 1  # flags: rows changed without their undo (the write failed)
# tables of at least this many bytes write their undo file with O_DIRECT (smaller ones
# through the page cache: a few fresh pages cost less than a synchronous disk write each)
DIRECT_MIN_BYTES = 64 << 20
# an O_DIRECT undo file keeps its blocks from one interval to the next (rewriting allocated
# blocks costs no allocation), up to this size; beyond it, and beyond twice what the last
# interval used, the next interval gives the rest back (a one-off pass over every row left a
# file as large as the table on disk until close)
TRIM_MIN_BYTES = 64 << 20
ENABLED = True  # False: no undo file (benchmarks/undo_cost.py's A/B only; stops are refused)
_BOOT_FILE = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This boot's id (Linux); "" where the kernel does not say (the file is then never
    trusted)."""
    try:
        with open(_BOOT_FILE, "rb") as f:
            return f.read().strip().decode("ascii", "replace")[:40]
    except OSError:
        return ""


def _header(boot: str, epoch: int, base: int, synced: int, flags: int) -> bytes:
    head = _HEAD.pack(MAGIC, boot.encode("ascii", "replace")[:40], epoch, base, synced, flags)
    return head + struct.pack("<I", zlib.crc32(head))


def _block_head(epoch: int, n: int) -> bytes:
    head = _BLOCK.pack(BLOCK_MAGIC, epoch, n)
    return head + struct.pack("<I", zlib.crc32(head)) + bytes(4)


@njit(cache=True, nogil=True)
def _unsaved(saved, rows, out):
    """``out[:k]`` = the ``rows`` not saved yet (``saved``: a bitmap, one bit per row, as a
    ``(bytes, 1)`` uint8 array); returns ``k``. A bit per row keeps the map 8x smaller than
    a bool per row (125 KB per 1M rows), and each look-up is prefetched 16 rows ahead: the
    step's records push the map out of the caches, and a plain numpy mask of bools cost 0.2
    ms per 2048 rows at 1M rows."""
    n = rows.shape[0]
    k = 0
    for i in range(n):
        if i + 16 < n:
            prefetch_line(saved, rows[i + 16] >> 3, 0)
        r = rows[i]
        if not (saved[r >> 3, 0] >> (r & 7)) & 1:
            out[k] = r
            k += 1
    return k


@njit(cache=True, nogil=True)
def _unsaved_range(saved, lo, hi, out):
    """:func:`_unsaved` of the rows ``lo:hi``."""
    k = 0
    for r in range(lo, hi):
        if not (saved[r >> 3, 0] >> (r & 7)) & 1:
            out[k] = r
            k += 1
    return k


@njit(cache=True, nogil=True)
def _mark(saved, rows):
    """Set the bits of ``rows``."""
    for i in range(rows.shape[0]):
        r = rows[i]
        saved[r >> 3, 0] |= np.uint8(1 << (r & 7))


def warmup() -> None:
    """Compile (or load from numba's cache) the undo file's kernels."""
    bits = np.zeros((1, 1), np.uint8)
    rows = np.arange(2, dtype=np.int64)
    out = np.empty(2, np.int64)
    _mark(bits, rows)
    _unsaved(bits, rows, out)
    _unsaved_range(bits, 0, 2, out)


def _aligned(nbytes: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of at least ``nbytes`` (what ``O_DIRECT`` writes take)."""
    return mmap.mmap(-1, max(PAGE, -(-nbytes // PAGE) * PAGE))


class UndoLog:
    """The writer's side: one open ``undo.dsa`` of one store (``r+``, ``durability="flush"``).

    :meth:`begin` starts a flush interval (before the store's marker is set), :meth:`save`
    appends the records of rows not yet saved in the interval (before they change),
    :meth:`synced` records a flush's synced count, :meth:`discard` empties the file (a
    clean close).

    Blocks of tables of at least :data:`DIRECT_MIN_BYTES` are written with ``O_DIRECT``
    where the filesystem takes it: straight to the disk, so the undo file takes no page
    cache (allocating fresh page-cache pages cost 2-3x more per byte on the benchmark
    machine, and dirty pages would press on memory and the kernel's writeback); the file is
    overwritten in place from one interval to the next. Smaller tables, and filesystems
    without ``O_DIRECT``, write through the page cache and empty the file when an interval
    begins, so that the kernel rarely writes it back. A write that returned is in the page
    cache or the device either way: it outlives the process.
    """

    def __init__(self, path: Path, num_rows: int, record_bytes: int):
        self.file = Path(path) / UNDO_FILE
        self.num_rows = num_rows
        self.record_bytes = record_bytes
        self.fd = -1
        self.direct = False
        self.epoch = 0
        self.base = -1
        self.end = HEADER_BYTES   # where the next block goes
        self.incomplete = False
        self.unmarked = False  # incomplete, but the header on disk could not say so
        self.saved: np.ndarray | None = None  # bitmap (bytes, 1): saved in this interval
        self._new = np.empty(0, np.int64)  # the rows of a batch not saved yet
        self.nsaved = 0
        self._buf: mmap.mmap | None = None   # a block: head page, ids, records
        self._page = _aligned(PAGE)          # the file header's page
        self._boot = ""

    def _open(self) -> None:
        flags = os.O_RDWR | os.O_CREAT
        if hasattr(os, "O_DIRECT") and self.num_rows * self.record_bytes >= DIRECT_MIN_BYTES:
            try:
                self.fd = os.open(self.file, flags | os.O_DIRECT, 0o644)
                self.direct = True
                return
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
        self.fd = os.open(self.file, flags, 0o644)
        self.direct = False

    def _pwrite(self, buf, off: int) -> None:
        """Write ``buf`` (page-aligned, whole pages) at ``off`` (page-aligned); a filesystem
        that opened ``O_DIRECT`` but refuses its writes gets them through the page cache."""
        try:
            try:
                pwrite_all(self.fd, buf, off)
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                os.close(self.fd)
                self.fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
                self.direct = False
                pwrite_all(self.fd, buf, off)
        except OSError as exc:  # a short write says so (pwrite_all)
            raise OSError(exc.errno, f"writing {str(self.file)!r} failed: {exc.strerror}"
                          ) from None

    # -- the interval -------------------------------------------------------------------
    def begin(self, base: int) -> None:
        """A new interval whose blocks restore the rows to count ``base``. A header that
        cannot be written marks nothing: the interval is then incomplete (a stop refused)."""
        if self.saved is None:
            self.saved = np.zeros(((self.num_rows + 7) // 8, 1), np.uint8)
        elif self.nsaved:
            self.saved.fill(False)
        self.nsaved = 0
        used, self.end = self.end, HEADER_BYTES  # what the last interval used
        self.epoch = int.from_bytes(os.urandom(8), "little")
        self.base = int(base)
        self.incomplete = self.unmarked = False
        self._boot = boot_id()
        emptied = False
        try:
            if self.fd < 0:
                self._open()
            # the last interval's blocks are garbage since its flush (a stop now finds its
            # header, which says the rows are the manifest's: exact)
            if not self.direct:  # dropped with their pages, before the kernel writes them
                os.ftruncate(self.fd, 0)
                emptied = True
            elif os.fstat(self.fd).st_size > max(TRIM_MIN_BYTES, 2 * used):
                os.ftruncate(self.fd, used)  # kept: what an interval like the last takes
            self._write_header(-1)
        except OSError:
            if self.fd < 0 or emptied:  # no header names this interval or the last
                self.incomplete = True
            else:  # the last interval's header may still say the rows are exact
                self._fail()

    def _write_header(self, synced: int) -> None:
        head = _header(self._boot, self.epoch, self.base, synced,
                       INCOMPLETE if self.incomplete else 0)
        self._page[:] = bytes(PAGE)
        self._page[:len(head)] = head
        self._pwrite(self._page, 0)

    def _fail(self) -> None:
        """The interval goes on without undo: say so in the header (a stop is refused).

        Where neither that nor dropping the header's magic can be written (a disk that
        fails every write), the header still says the interval is complete while rows
        would change unsaved (a stop would then put back some rows and not others): an
        ``OSError`` is raised before any row changes, and each later :meth:`save` tries
        again until the header is written."""
        self.incomplete, self.unmarked = True, False
        try:
            self._write_header(-1)
        except OSError:
            # the header still names this interval without the flag, and its blocks end
            # before the rows that were not saved: drop the header's magic instead
            try:
                self._page[:] = bytes(PAGE)
                self._pwrite(self._page, 0)
            except OSError as exc:
                self.unmarked = True
                raise OSError(exc.errno, f"the undo file {str(self.file)!r} can neither be "
                              f"written nor marked incomplete ({exc.strerror}); no row was "
                              "changed") from exc

    def save(self, data: np.ndarray, rows: np.ndarray) -> None:
        """Append the records ``data[rows]`` of the rows not saved yet in this interval
        (``rows``: unique ids). Before those rows change."""
        if self.incomplete or rows.shape[0] == 0:
            if self.unmarked and rows.shape[0]:
                self._fail()
            return
        if self._new.shape[0] < rows.shape[0]:
            self._new = np.empty(max(rows.shape[0], 256), np.int64)
        k = _unsaved(self.saved, rows, self._new)
        if k:
            self._append(data, self._new[:k])

    def save_range(self, data: np.ndarray, lo: int, hi: int) -> None:
        """:meth:`save` of the rows ``lo:hi``, in bounded chunks."""
        if self.incomplete:
            if self.unmarked and hi > lo:
                self._fail()
            return
        step = max(1, (16 << 20) // max(1, self.record_bytes))
        out = np.empty(min(step, max(0, hi - lo)), np.int64)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            k = _unsaved_range(self.saved, a, b, out)
            if k:
                self._append(data, out[:k])
            if self.incomplete:
                return

    def _append(self, data: np.ndarray, new: np.ndarray) -> None:
        n = new.shape[0]
        body = n * (8 + self.record_bytes)
        padded = -(-body // PAGE) * PAGE
        if self._buf is None or len(self._buf) < PAGE + padded:
            old = 0 if self._buf is None else len(self._buf)
            # the old buffer is left to the garbage collector, not closed: the kernels'
            # thread pool may still hold views of it
            self._buf = _aligned(max(PAGE + padded, 2 * old))
        buf = self._buf
        ids = np.frombuffer(buf, np.int64, n, PAGE)
        rec = np.frombuffer(buf, data.dtype, n * data.shape[1], PAGE + 8 * n
                            ).reshape(n, data.shape[1])
        ids[...] = new
        # the kernels' threaded gather (prefetching rows ahead): ~2x np.take's random reads
        run_chunked(gather_rows, (data, ids, 0, rec), n, max(16, 16384 // data.shape[1]))
        if padded > body:
            buf[PAGE + body:PAGE + padded] = bytes(padded - body)
        view = memoryview(buf)
        try:
            # the body first, then the head page that makes it count
            self._pwrite(view[PAGE:PAGE + padded], self.end + BLOCK_HEAD)
            head = _block_head(self.epoch, n)
            buf[:PAGE] = bytes(PAGE)
            buf[:len(head)] = head
            self._pwrite(view[:PAGE], self.end)
        except OSError:
            self._fail()
            return
        finally:
            del ids, rec, view
        self.end += BLOCK_HEAD + padded
        _mark(self.saved, new)
        self.nsaved += n

    def synced(self, count: int) -> None:
        """A flush synced the rows at ``count`` and is about to write its manifest."""
        if self.fd < 0 or self.base < 0:
            return
        try:
            self._write_header(int(count))
        except OSError:
            pass  # a stop in the manifest's window is then refused, as before

    def discard(self) -> None:
        """Empty the file (a clean close: the rows are flushed, nothing to undo)."""
        if self.fd >= 0:
            try:
                os.ftruncate(self.fd, 0)
            except OSError:
                pass
        self.base = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self._buf = None  # (not closed: see _append)


class Verdict:
    """What an unclean stop's undo file says (:func:`inspect`): ``kind`` is ``"apply"``
    (:meth:`apply` restores the rows to the manifest's count), ``"exact"`` (the rows are the
    manifest's already: a flush synced them) or ``"refuse"`` (``reason`` says why)."""

    def __init__(self, kind: str, reason: str = "", path: Path | None = None, epoch: int = 0,
                 num_rows: int = 0, stride: int = 0, dtype=None):
        self.kind, self.reason = kind, reason
        self.path, self.epoch = path, epoch
        self.num_rows, self.stride, self.dtype = num_rows, stride, dtype

    def apply(self, data: np.ndarray) -> int:
        """Write the saved records back into ``data`` (the mapped rows), one block at a
        time (memory: the largest block, never the whole file); returns the rows restored.
        Blocks are read up to the first that does not check out (a torn last block: its
        rows had not changed yet)."""
        if self.kind != "apply":
            return 0
        itemsize = np.dtype(self.dtype).itemsize
        rec_bytes = self.stride * itemsize
        restored = 0
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            off = HEADER_BYTES
            while off + BLOCK_HEAD <= size:
                f.seek(off)
                raw = f.read(_BLOCK.size + 4)
                if len(raw) < _BLOCK.size + 4:
                    break
                head = raw[:_BLOCK.size]
                magic, e, n = _BLOCK.unpack(head)
                crc = struct.unpack_from("<I", raw, _BLOCK.size)[0]
                if magic != BLOCK_MAGIC or e != self.epoch or crc != zlib.crc32(head):
                    break
                body = n * (8 + rec_bytes)
                if off + BLOCK_HEAD + body > size:
                    break
                f.seek(off + BLOCK_HEAD)
                ids = np.fromfile(f, np.int64, n)
                recs = np.fromfile(f, self.dtype, n * self.stride).reshape(n, self.stride)
                if n and (ids.min() < 0 or ids.max() >= self.num_rows):
                    raise ValueError(f"{str(self.path)!r} names rows outside the table: the "
                                     "undo record is damaged; open the store with "
                                     "unclean='accept' or restore it from a checkpoint")
                data[ids] = recs
                restored += n
                off += BLOCK_HEAD + -(-body // PAGE) * PAGE
        return restored


def inspect(directory: Path, count: int, num_rows: int, stride: int,
            dtype: np.dtype) -> Verdict:
    """Read the header of ``undo.dsa`` of a store found marked with no writer; ``count`` is
    its manifest's. The blocks are read by :meth:`Verdict.apply`."""
    path = Path(directory) / UNDO_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEAD.size + 4)
    except FileNotFoundError:
        return Verdict("refuse", "it has no undo record (a store written by a dsa_core "
                       "before undo records)")
    except OSError as exc:
        return Verdict("refuse", f"its undo record could not be read ({exc})")
    if len(raw) < _HEAD.size + 4 or raw[:8] != MAGIC:
        return Verdict("refuse", "its undo record is empty or unreadable")
    fields = raw[:_HEAD.size]
    if struct.unpack_from("<I", raw, _HEAD.size)[0] != zlib.crc32(fields):
        return Verdict("refuse", "its undo record's header is damaged")
    _, boot, epoch, base, synced, flags = _HEAD.unpack(fields)
    now = boot_id()
    if not now or boot.rstrip(b"\0").decode("ascii", "replace") != now:
        return Verdict("refuse", "the machine restarted since (power loss or reboot: the "
                       "undo record lived in the page cache and cannot be trusted)")
    if synced >= 0 and synced == count:
        return Verdict("exact")
    if base != count:
        return Verdict("refuse", f"its undo record belongs to count {base}, not to the "
                       f"manifest's {count}")
    if flags & INCOMPLETE:
        return Verdict("refuse", "rows changed that could not be saved to its undo record "
                       "(a write to undo.dsa failed, e.g. a full disk)")
    return Verdict("apply", path=path, epoch=epoch, num_rows=num_rows, stride=stride,
                   dtype=np.dtype(dtype))


def discard(directory: Path) -> None:
    """Empty a store's undo file, if any (after a recovery or an accepted unclean stop)."""
    path = Path(directory) / UNDO_FILE
    try:
        os.truncate(path, 0)
    except FileNotFoundError:
        pass
