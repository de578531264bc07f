"""The commit log of a log-structured store (``durability="step"``): its file format.

One concern: the bytes of ``wal-<gen:08d>.log`` files, written and read back. When a log
store commits each step, the step's rows (their whole records after the step) are appended
here with one ``fdatasync``: one sequential append per step instead of the in-place store's
undo journal, data fdatasync and manifest rename. The manifest names the
current generation and its random ``salt``; every flush starts a new generation
(``commit.Commit.flush``), so a log never holds a step that its manifest already counts.

File layout: a sequence of entries, each starting on a 4096-byte boundary (a page that
holds a committed entry is never written again, so a torn write of the next entry cannot
damage it)::

    header  (48 B): b"DSAWAL01" | u64 t | u64 n | u32 stride | u32 itemsize | u64 salt
                    | u32 0 | u32 hcrc = crc32 of the header bytes before it
    payload       : n int64 row ids (unique), then their n records (n, stride) in the store
                    dtype: the rows' whole records after step t
    trailer  (4 B): u32 crc32 of the payload, continued from hcrc (it binds the two)
    (unwritten)   : up to the next 4096-byte boundary; whatever bytes lie there are skipped

(little-endian). An entry is *valid* when its header CRC, salt, record geometry and trailer
CRC check out and its ``t`` is the previous entry's plus one (the first entry's ``t`` is the
manifest's count plus one). Reading stops at the first entry that is not valid: a torn
append, bytes of an older generation in a recycled file (another salt), zeros -- but only
if it is the log's *tail*: when a later page holds a header of this generation (its salt,
its header CRC) for a later step, that later step was appended after the invalid one had
been written whole (appends are sequential and each waits for its ``fdatasync``; a failed
append zeroes its header and makes the store start a new generation), so the invalid entry
is damage, not a torn write: :class:`WalError` names the file and the step, and nothing is
replayed, flushed or removed. A valid entry whose row ids are out of range or repeated is
damage the CRC cannot explain: an error too, never silently skipped.

Writing an entry: header and payload with one ``pwritev`` (a copy into the page cache),
their write-back started at once (``sync_file_range``), the payload's CRC computed while the
disk writes, the trailer written, one ``fdatasync``. The CRC costs about as much as the
disk (3 MB: ~1.5 ms each on the benchmark machine), so the overlap saves most of one of
them; the trailer re-dirties the entry's last page, a few bytes more for the same sync.

Commit point of step ``t``: its entry, trailer included, is in the file. A killed process
leaves its writes in the page cache, so an entry written in full before a ``kill -9``
counts even if its ``fdatasync`` never ran; after a power loss only ``fdatasync``'d
entries are sure to be there (``append`` returns after the ``fdatasync``).
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .._os import fdatasync_fd, pwrite_all, pwritev_all, start_writeback
from .format import PAGE, crash_point

__all__ = ["WAL_MAGIC", "WAL_MIN_BOUND", "WalEntry", "WalError", "WalWriter", "read_entries",
           "wal_bound", "wal_name"]

WAL_MAGIC = b"DSAWAL01"
WAL_MIN_BOUND = 256 << 20  # bytes: a commit log is flushed away once it passes wal_bound()
_HEAD = struct.Struct("<8sQQIIQI")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size  # 48
TRAILER_BYTES = _CRC.size


class WalError(ValueError):
    """A commit log named by the manifest is missing, or holds a damaged valid entry."""


class WalEntry(NamedTuple):
    t: int                  # the step this entry commits
    rows: np.ndarray        # (n,) int64, unique
    records: np.ndarray     # (n, stride), the store dtype: the records after step t
    next_offset: int        # where the entry after it starts


def wal_name(gen: int) -> str:
    return f"wal-{gen:08d}.log"


def wal_bound(num_rows: int) -> int:
    """Bytes of commit log after which the store flushes at its next step:
    ``max(256 MiB, 4 x index bytes)`` (the index is 8 bytes per row, rewritten by every
    flush: the bound amortises it over at least four times as many logged bytes).

    >>> wal_bound(1000) == 256 << 20, wal_bound(100_000_000) == 3_200_000_000
    (True, True)
    """
    return max(WAL_MIN_BOUND, 4 * 8 * int(num_rows))


def _aligned(offset: int) -> int:
    return -(-offset // PAGE) * PAGE


def _pwritev_all(fd: int, bufs: list, offset: int) -> None:
    """``pwritev`` of ``bufs`` (bytes or arrays) at ``offset``, all of them."""
    pwritev_all(fd, [memoryview(np.ascontiguousarray(b).reshape(-1).view(np.uint8))
                     if isinstance(b, np.ndarray) else memoryview(b).cast("B") for b in bufs],
                offset)


class WalWriter:
    """Appends entries to one commit-log generation (the writer's, under the store lock).

    ``offset`` is where the next entry goes. A failed :meth:`append` sets ``broken``: the
    entry may be partly (or, if only the ``fdatasync`` failed, wholly) in the file, so the
    store must start a new generation before it logs another step.
    """

    def __init__(self, path: Path, fd: int, salt: int, offset: int, stride: int,
                 dtype: np.dtype):
        self.path, self.fd, self.salt, self.offset = Path(path), fd, int(salt), int(offset)
        self.stride, self.dtype = int(stride), np.dtype(dtype)
        self.broken = False

    @classmethod
    def start(cls, path: Path, salt: int, stride: int, dtype: np.dtype,
              recycle: Path | None = None) -> WalWriter:
        """A new generation at ``path``, empty as far as readers go (no entry with ``salt``).

        ``recycle``: a retired log file to rename to ``path`` and overwrite from its start
        (its old entries carry another salt, so they are never read as this generation's).
        Its blocks are already allocated and written: an append then changes no file
        metadata and its ``fdatasync`` writes the data only, where appending to a growing
        file (or into ``posix_fallocate``'d, unwritten extents) also commits the
        filesystem's journal. Else a fresh empty file. The caller makes the name durable
        (directory fsync) before a manifest names it.
        """
        if recycle is not None and recycle != path:
            try:
                os.replace(recycle, path)
            except FileNotFoundError:
                recycle = None
        if recycle is None:
            try:
                os.unlink(path)  # a leftover of a crash before a commit: never ours to keep
            except FileNotFoundError:
                pass
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        return cls(path, fd, salt, 0, stride, dtype)

    @classmethod
    def resume(cls, path: Path, salt: int, offset: int, stride: int,
               dtype: np.dtype) -> WalWriter:
        """Append to an existing generation at ``offset`` (the end of its valid entries)."""
        fd = os.open(path, os.O_RDWR)
        return cls(path, fd, salt, offset, stride, dtype)

    def append(self, t: int, rows: np.ndarray, records: np.ndarray) -> None:
        """Write the entry of step ``t`` at ``offset`` (see the module docstring) and
        ``fdatasync`` it; ``offset`` moves on only when everything succeeded.

        ``rows``: (n,) int64 unique row ids; ``records``: C-contiguous (n, stride) of the
        store dtype. On any error the entry's header is overwritten with zeros (best
        effort, so that a process that dies next does not replay a step that raised),
        ``broken`` is set and the error re-raised.
        """
        if self.broken:
            raise RuntimeError(f"commit log {str(self.path)!r} had a failed append; a new "
                               "generation must be started (flush) before the next step")
        rows = np.ascontiguousarray(rows, np.int64)
        records = np.ascontiguousarray(records)
        n = rows.shape[0]
        if records.dtype != self.dtype or records.shape != (n, self.stride):
            raise ValueError(f"records must be ({n}, {self.stride}) {self.dtype.name}, got "
                             f"{records.shape} {records.dtype}")
        head = _HEAD.pack(WAL_MAGIC, int(t), n, self.stride, self.dtype.itemsize, self.salt,
                          0)
        hcrc = zlib.crc32(head)
        head += _CRC.pack(hcrc)
        end = self.offset + HEADER_BYTES + rows.nbytes + records.nbytes
        try:
            crash_point("wal-append")
            _pwritev_all(self.fd, [head, rows, records], self.offset)
            start_writeback(self.fd, self.offset, end - self.offset)
            crc = zlib.crc32(records, zlib.crc32(rows, hcrc))  # while the disk writes
            crash_point("wal-payload")
            pwrite_all(self.fd, _CRC.pack(crc), end)
            crash_point("wal-written")
            fdatasync_fd(self.fd)
            crash_point("wal-synced")
        except BaseException:
            self.broken = True
            try:
                pwrite_all(self.fd, bytes(HEADER_BYTES), self.offset)
                fdatasync_fd(self.fd)
            except OSError:
                pass
            raise
        self.offset = _aligned(end + TRAILER_BYTES)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


_SCAN_BYTES = 8 << 20  # bytes read at once when looking past an invalid entry


def _end_of_log(fd: int, path: Path, off: int, size: int, salt: int, t: int) -> None:
    """The entry of step ``t`` at ``off`` is not valid: fine if it is the log's tail, else
    (a later page holds a header of this generation for a later step) :class:`WalError`.

    The pages after ``off`` are scanned for headers up to the first valid header of another
    generation (another salt: a recycled file's old entries): a generation's entries lie
    one after the other from the file's start, and the pages of a completed entry hold
    only its own bytes, so no entry of this generation can follow an older generation's
    header. That keeps the scan of a recycled file short (the usual case at open)."""
    pos = _aligned(off + 1)
    while pos + HEADER_BYTES <= size:
        blk = os.pread(fd, min(_SCAN_BYTES, size - pos), pos)
        if not blk:
            return
        for rel in range(0, len(blk) - HEADER_BYTES + 1, PAGE):
            if blk[rel:rel + 8] != WAL_MAGIC:
                continue
            head = blk[rel:rel + _HEAD.size]
            _, et, _, _, _, esalt, _ = _HEAD.unpack(head)
            if _CRC.unpack(blk[rel + _HEAD.size:rel + HEADER_BYTES])[0] != zlib.crc32(head):
                continue
            if esalt != salt:
                return  # an older generation's entries: this one ended before them
            if et > t:
                raise WalError(
                    f"commit log {str(path)!r} is damaged: the entry of step {t} (at byte "
                    f"{off:,}) does not check out, but the log goes on with step {et} (at "
                    f"byte {pos + rel:,}), so it is not a torn last write. Steps {t} and "
                    "later cannot be replayed; nothing was changed. Restore the store from "
                    "a checkpoint")
        pos += len(blk) - len(blk) % PAGE or PAGE
    return


def read_entries(path: Path, salt: int, first_t: int, stride: int, dtype: np.dtype,
                 num_rows: int) -> Iterator[WalEntry]:
    """The valid entries of a commit log, in order, from step ``first_t`` on.

    Stops at the first entry that is torn, corrupt, of another generation (salt) or out of
    sequence (see the module docstring), if it is the tail; an invalid entry followed by a
    later step of this generation raises :class:`WalError` naming the file and the step. A
    missing file raises ``FileNotFoundError`` naming it; a valid entry with row ids out of
    ``[0, num_rows)`` or repeated raises :class:`WalError`.
    """
    dtype = np.dtype(dtype)
    rec_bytes = stride * dtype.itemsize
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"commit log {str(path)!r} named by the "
                                "manifest is missing (deleted by hand?); the steps it held "
                                "are lost: restore the store from a checkpoint") from None
    try:
        size = os.fstat(fd).st_size
        off, t = 0, int(first_t)
        while off + HEADER_BYTES <= size:
            raw = os.pread(fd, HEADER_BYTES, off)
            if len(raw) < HEADER_BYTES:
                return _end_of_log(fd, path, off, size, salt, t)
            head = raw[:_HEAD.size]
            magic, et, n, es, ei, esalt, _ = _HEAD.unpack(head)
            hcrc = zlib.crc32(head)
            if (magic != WAL_MAGIC or _CRC.unpack(raw[_HEAD.size:])[0] != hcrc
                    or esalt != salt or et != t or (es, ei) != (stride, dtype.itemsize)):
                return _end_of_log(fd, path, off, size, salt, t)
            nbytes = n * (8 + rec_bytes)
            end = off + HEADER_BYTES + nbytes + TRAILER_BYTES
            if end > size:
                return _end_of_log(fd, path, off, size, salt, t)
            raw = os.pread(fd, nbytes + TRAILER_BYTES, off + HEADER_BYTES)
            if len(raw) != nbytes + TRAILER_BYTES:
                return _end_of_log(fd, path, off, size, salt, t)
            body = memoryview(raw)[:nbytes]
            if zlib.crc32(body, hcrc) != _CRC.unpack(raw[nbytes:])[0]:
                return _end_of_log(fd, path, off, size, salt, t)
            rows = np.frombuffer(body, np.int64, n)
            records = np.frombuffer(body, dtype, n * stride, 8 * n).reshape(n, stride)
            if n and (rows.min() < 0 or rows.max() >= num_rows
                      or np.unique(rows).shape[0] != n):
                raise WalError(f"commit log {str(path)!r}: the entry of step {t} checks out "
                               f"(CRC) but its row ids are out of [0, {num_rows}) or repeat; "
                               "the store is damaged, restore it from a checkpoint")
            yield WalEntry(t, rows, records, _aligned(end))
            off, t = _aligned(end), t + 1
    finally:
        os.close(fd)
