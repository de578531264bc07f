"""On-disk format of a log-structured store: segment files, index generations, the manifest.

Nothing here knows about memory budgets or eviction (``pool``, ``commit``); this module reads,
writes and checks the bytes. Files of a log store directory:

``manifest.json``
    ``{"format": "dsa-log", "version": 7, "layout": {...}, "count": int, "seed": int,
    "init": "zeros"|"normal"|"uniform", "init_scale": float, "ball_maxnorm": float|null,
    "index": "index-<gen:08d>.bin"|null, "index_crc32": int|null, "index_from": int,
    "segments": [ids], "next_segment": int, "space_ratio": float, "meta": {...}, "wal": "wal-<gen:08d>.log"|null, "wal_salt":
    int}`` (``meta``: the caller's JSON data, e.g. the optimizer's hyperparameters;
    ``wal``/``wal_salt``: the commit log of ``durability="step"`` stores, ``wal``; a
    manifest without them has none; ``checksum``: ``_files.json_checksum`` of the rest,
    checked at every read, required from version 3 on, absent in older manifests),
    replaced atomically (``write_json``). It is the commit point of a flush: the state of a
    store is what its manifest references (plus the valid entries of its commit log),
    nothing else. Its settings are checked at every read with ``create``'s rules.
``seg-<id:08d>.dsl``
    One immutable segment of ``n`` records. Four parts, each starting on a 4096-byte
    boundary (zero padding between them)::

        header (4096 B): b"DSALOG01" | u64 id | u64 n | u32 stride | u32 itemsize
                         | u64 count | u32 crc32(rows) | u32 crc32(steps) | u32 crc32(records)
                         | u32 crc32 of the header bytes before it
                         | b"DSASUM03" | u32 head | u32 crc32 of the 68 bytes before
                         | zeros
        rows           : n int64, the row of each record
        steps          : n int64, the step count at which each record was written
        records        : n rows of ``record_pitch`` bytes: the record ((stride,) in the store
                         dtype), zeros to a multiple of 8 bytes, then two uint64 checksums
                         (``sums.split_sums``): of its first ``head`` bytes (the weights:
                         ``sums.head_bytes``) and of the rest

    (little-endian; the CRCs cover the unpadded parts, the records' CRC the whole rows
    with their checksums). This is segment version 3 (manifest version 6): every record read
    back from the file is checked against its checksums, which a read of the record brings
    in with it (``segments.Segments.read_into``, the cleaner's copies, ``dsa verify``); a
    read of the weights alone (``gather``) checks the first. Older segments are still read:
    version 2 (header extension ``b"DSASUM01" | u32 crc32(sums)``; the records ``(n,
    stride)`` back to back, then a fifth part ``sums``: n uint64, one checksum of each whole
    record, ``sums.record_sums``) and version 1 (no extension: zeros there, no checksums; at
    open its records are read whole, checked against the file's records CRC and hashed, so
    reads of it are checked against those sums). A segment is written under its final
    name with a few large ``pwrite`` calls, records in chunks, the header last; it is only
    part of the store once a manifest lists it. At open, a writer removes the segment files
    that a checksummed manifest proves are garbage (``recovery.remove_garbage``).
``index-<gen:08d>.bin``
    The *base* of the index. Absent (``"index": null``) until a flush writes one: every row
    then reads as its initial record, so creating a store writes nothing of the table's
    size. A row's location is 0 for a row never written (it reads as its initial record),
    else ``((segment_id << 32) | slot) + 1``, the record ``slot`` of that segment. A base
    is *dense* (``num_rows`` int64 locations; pages of zeros left holes) or, when fewer
    than a quarter of the rows have a location (manifest ``index_entries``: how many it
    lists, version 7), *sparse*: the rows with a location and theirs, in ascending row
    order; both in checksummed 4 KiB pages (:func:`write_index`).
    The index is the base plus the segments sealed after it: ``index_from`` (manifest
    version 5) is the first segment id the base does not reflect, and an open applies the
    row ids of every listed segment from ``index_from`` on, in id order, over the base (a
    row's newest record is in the highest segment that holds it: seals and the cleaner's
    copies only ever write into new, higher ids). A flush writes a new base only when the
    records those segments hold pass a quarter of the table's rows
    (``commit.BASE_REPLAY_SHARE``), so a flush of a few changed rows writes their records
    and a manifest, not 8 bytes per row of the table; the old base is removed once the
    manifest naming the new one is durable. Without ``index_from`` (versions 1-4) the base
    is the whole index.
``wal-<gen:08d>.log``
    The commit log named by the manifest (``wal`` describes it); the next generation's
    name may hold a retired log kept for reuse. Others are garbage, removed at open.
``writer.lock``
    The writer's exclusive ``flock`` (as for the in-place store).

Crash points (:func:`crash_point`) let tests kill the process at chosen moments.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import mmap
import os
import signal
import struct
import sys
import threading
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .._files import CHECKSUM_KEY, check_json_checksum, write_json
from .._os import (
    MADV_RANDOM,
    MADV_WILLNEED,
    MAP_FAILED,
    Worker,
    advise_memory,
    fsync_fd,
    mmap_fn,
    munmap_fn,
    pwrite_all,
    start_writeback,
    write_back,
)
from .checks import check_count, check_init_settings, check_layout
from .sums import fill_sums, record_sums, split_sums
from .sums import record_pitch as _pitch

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "FORMAT_VERSION_INDEX_FROM", "FORMAT_VERSION_OPTIMIZER",
    "FORMAT_VERSION_SPARSE_INDEX", "FORMAT_VERSION_SPLIT_SUMS", "FORMAT_VERSION_SUMS",
    "SEG_VERSION", "laid_out",
    "record_offset", "record_pitch", "records_of", "sums_of",
    "FORMAT_VERSION_WAL", "LOCK_FILE",
    "MANIFEST_FILE", "MAX_SEGMENT_ID", "PAGE", "check_records",
    "SEG_MAGIC", "Segment", "SegmentError", "check_meta", "check_segment", "crash_point",
    "index_name",
    "INDEX_PAGE_ENTRIES", "INDEX_PAGE_ROWS", "NO_ROW", "check_index_pages", "check_pages",
    "dense_entries",
    "index_damage", "index_geometry", "map_index", "page_sums", "sparse_base", "sparse_rows",
    "map_segment", "parse_name", "read_header", "read_index", "read_manifest", "seg_name",
    "segment_geometry", "set_crash", "unmap_pending", "write_index", "write_manifest",
    "write_segment",
]

FORMAT_NAME = "dsa-log"
FORMAT_VERSION = 1
FORMAT_VERSION_WAL = 2  # a manifest that names a commit log (an older reader would ignore it)
# segments with per-record checksums (an older reader would call them torn) and a
# checksummed manifest: what this module writes
FORMAT_VERSION_SUMS = 3
# a manifest whose layout names an optimizer other than Adam (``"optimizer"``: Adagrad's
# records hold an accumulator where Adam's hold m and v): a reader of version 3 would step
# Adam on them, so it must refuse them ("upgrade dsa_core"). Adam stores stay version 3.
FORMAT_VERSION_OPTIMIZER = 4
# a manifest with ``index_from``: the index is its base plus the segments from that id on (a
# reader of version 4 would take the base for the whole index and serve stale records, so it
# must refuse it). What this module writes, for every optimizer.
FORMAT_VERSION_INDEX_FROM = 5
# segments of version 3 (each record followed by its two sums: an older reader would call
# their headers corrupt, so it must refuse the manifest first). What this module writes.
FORMAT_VERSION_SPLIT_SUMS = 6
# a manifest whose index base may be sparse (``index_entries``: the base lists its rows; an
# older reader would take it for a dense base of the wrong size and call the store damaged,
# so it must refuse it). What this module writes.
FORMAT_VERSION_SPARSE_INDEX = 7
READ_VERSIONS = (FORMAT_VERSION, FORMAT_VERSION_WAL, FORMAT_VERSION_SUMS,
                 FORMAT_VERSION_OPTIMIZER, FORMAT_VERSION_INDEX_FROM,
                 FORMAT_VERSION_SPLIT_SUMS, FORMAT_VERSION_SPARSE_INDEX)
SEG_MAGIC = b"DSALOG01"
SUM_MAGIC = b"DSASUM01"  # the header extension of a segment with per-record sums
SPLIT_MAGIC = b"DSASUM03"  # ... of a segment whose records carry their two sums (version 3)
SEG_VERSION = 3  # the segment version this module writes
# segment parts start on multiples of this many bytes (a format constant, not the OS's page)
PAGE = 4096
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "writer.lock"
MAX_SEGMENT_ID = (1 << 31) - 1  # locations are int64: (id << 32 | slot) + 1
MAX_SEGMENT_RECORDS = 1 << 32
_HEAD = struct.Struct("<8sQQIIQIII")
_HCRC = struct.Struct("<I")
_HEXT = struct.Struct("<8sI")  # after the header's CRC: SUM_MAGIC | crc32(sums)
_HEAD_ALL = _HEAD.size + _HCRC.size + _HEXT.size + _HCRC.size
# only the engine's benchmark turns this off (benchmarks/record_checks.py): the cost of
# checking every record read from a segment file
CHECK_RECORDS = True
_IO_CHUNK = 8 << 20  # bytes per pwrite / pread when writing or checking a file


class SegmentError(ValueError):
    """A segment file referenced by the manifest is missing, torn or corrupt."""


# -- crash points for tests -----------------------------------------------------------------
_crash_at: tuple[str, int] | None = None
_crash_hits: Counter = Counter()


def set_crash(point: str | None, nth: int = 1) -> None:
    """SIGKILL this process the ``nth`` time :func:`crash_point` ``point`` is reached (tests).

    ``set_crash(None)`` disarms. The environment variable ``DSA_LOG_CRASH=point:nth`` arms
    it at import (for a subprocess).
    """
    global _crash_at
    _crash_at = None if point is None else (str(point), int(nth))
    _crash_hits.clear()


def crash_point(point: str) -> None:
    """A place where a test may kill the process (see :func:`set_crash`); free otherwise."""
    if _crash_at is None:
        return
    _crash_hits[point] += 1
    if _crash_at[0] == point and _crash_hits[point] == _crash_at[1]:
        os.kill(os.getpid(), signal.SIGKILL)


if os.environ.get("DSA_LOG_CRASH"):
    _p, _, _k = os.environ["DSA_LOG_CRASH"].partition(":")
    set_crash(_p, int(_k or 1))


# -- names ---------------------------------------------------------------------------------
def seg_name(seg_id: int) -> str:
    return f"seg-{seg_id:08d}.dsl"


def index_name(gen: int) -> str:
    return f"index-{gen:08d}.bin"


def parse_name(name: str) -> tuple[str, int] | None:
    """``("seg", id)`` / ``("index", gen)`` / ``("wal", gen)`` (a commit log,
    ``wal``) for the store's own file names, else None."""
    for kind, pre, suf in (("seg", "seg-", ".dsl"), ("index", "index-", ".bin"),
                           ("wal", "wal-", ".log")):
        if name.startswith(pre) and name.endswith(suf):
            mid = name[len(pre):-len(suf)]
            if mid.isdigit():
                return kind, int(mid)
    return None


def _pad(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def record_pitch(stride: int, itemsize: int, version: int = SEG_VERSION) -> int:
    """Bytes from one record of a segment file to the next: the record's own, and for
    ``version`` 3 its two sums after it (``sums.record_pitch``)."""
    return _pitch(int(stride) * int(itemsize), version)


def segment_geometry(n: int, stride: int, itemsize: int,
                     version: int = SEG_VERSION) -> tuple[int, int, int, int]:
    """``(rows_offset, steps_offset, records_offset, file_size)`` of an ``n``-record segment
    (``version`` 2: with the ``sums`` part after the records, at :func:`sums_offset`; 3:
    each record followed by its sums, :func:`record_pitch` bytes apart)."""
    rows_off = PAGE
    steps_off = rows_off + _pad(8 * n)
    rec_off = steps_off + _pad(8 * n)
    end = rec_off + _pad(n * record_pitch(stride, itemsize, version))
    return rows_off, steps_off, rec_off, end + (_pad(8 * n) if version == 2 else 0)


def record_offset(header: dict[str, int], k: int) -> int:
    """Where record ``k`` of the segment whose header is ``header`` (:func:`read_header`)
    starts in its file (its sums follow it in a version-3 segment)."""
    rec_off = segment_geometry(header["n"], header["stride"], header["itemsize"],
                               header["version"])[2]
    return rec_off + int(k) * record_pitch(header["stride"], header["itemsize"],
                                           header["version"])


def sums_offset(n: int, stride: int, itemsize: int) -> int:
    """Where the per-record sums of a version-2 segment start."""
    return segment_geometry(n, stride, itemsize, 1)[3]


# -- segments --------------------------------------------------------------------------------
def write_segment(path: Path, seg_id: int, rows: np.ndarray, steps: np.ndarray,
                  chunks, stride: int, dtype: np.dtype, count: int,
                  paced: bool = False, recycle: Path | None = None, head: int = 0) -> int:
    """Write one segment file (version :data:`SEG_VERSION`: each record followed by its
    sums, of its first ``head`` bytes and of the rest); returns its size in bytes.

    ``rows``/``steps``: int64 ``(n,)``. ``chunks``: an iterable of record blocks whose
    lengths add up to ``n``, written in that order, each with one ``pwrite``: C-contiguous
    ``(k, pitch)`` uint8 rows laid out as in the file (:func:`record_pitch`; each record in
    its row's first ``stride * itemsize`` bytes: the seals' buffers are made so), whose sums
    are written into them here, in place; or ``(k, stride)`` records of the store dtype,
    laid out into a copy first (tools, tests). The file is created exclusively (a leftover
    of that name is unlinked first: only our own name goes, a checkpoint's hard link keeps
    its inode), sized with ``ftruncate``, filled, and its write-back started; the caller
    fsyncs it before a manifest refers to it. On any error the partial file is removed.
    ``paced``: each block is on the disk before the next is written (``write_back``), so
    that the device never holds more than a block of this file's writes in its queue (the
    background writer). ``recycle``: a dead segment file of this writer's that no manifest
    ever listed, renamed to ``path`` and overwritten instead of creating a new file
    (``_new_file``).
    """
    n = int(rows.shape[0])
    if not 0 < n < MAX_SEGMENT_RECORDS:
        raise ValueError(f"a segment holds 1 .. {MAX_SEGMENT_RECORDS - 1} records, got {n}")
    itemsize = np.dtype(dtype).itemsize
    rows_off, steps_off, rec_off, size = segment_geometry(n, stride, itemsize)
    rb = stride * itemsize
    pitch = record_pitch(stride, itemsize)
    if head % 4 or not 0 <= head <= rb:
        raise ValueError(f"head must be a multiple of 4 in [0, {rb}], got {head}")
    rows = np.ascontiguousarray(rows, np.int64)
    steps = np.ascontiguousarray(steps, np.int64)
    with_pad = np.zeros((rec_off - rows_off) // 8, np.int64)
    with_pad[:n] = rows
    with_pad[(steps_off - rows_off) // 8:(steps_off - rows_off) // 8 + n] = steps
    with _new_file(path, recycle) as (fd, reused):
        os.ftruncate(fd, size)
        pwrite_all(fd, with_pad, rows_off)
        crash_point("seal-rows")
        crc, off, done = 0, rec_off, 0
        for blk in chunks:
            blk = laid_out(blk, stride, dtype)
            if not blk.shape[0]:
                continue
            if done + blk.shape[0] > n:
                raise ValueError(f"segment {seg_id}: more than the {n} records announced")
            fill_sums(blk, rb, head)
            pwrite_all(fd, blk, off)
            if paced:
                write_back(fd, off, blk.nbytes, path)
            crc = zlib.crc32(blk, crc)
            off += blk.nbytes
            done += blk.shape[0]
            blk = None  # not held while the next block is built (one chunk at a time)
            crash_point("seal-chunk")
        if done != n:
            raise ValueError(f"segment {seg_id}: {done} records written, {n} announced")
        if reused:  # the padding after the records, as a new file's
            pwrite_all(fd, np.zeros(size - off, np.uint8), off)
        hdr = _HEAD.pack(SEG_MAGIC, seg_id, n, stride, itemsize, int(count),
                         zlib.crc32(rows), zlib.crc32(steps), crc)
        hdr += _HCRC.pack(zlib.crc32(hdr))
        hdr += _HEXT.pack(SPLIT_MAGIC, int(head))
        crash_point("seal-header")
        pwrite_all(fd, hdr + _HCRC.pack(zlib.crc32(hdr)), 0)
        start_writeback(fd)  # the flush's fsync then has little left to do
    return size


def laid_out(blk: np.ndarray, stride: int, dtype: np.dtype) -> np.ndarray:
    """A block of records as :func:`write_segment` writes it: ``(k, pitch)`` uint8 rows
    (C order) as given, or ``(k, stride)`` records of ``dtype`` copied into such rows."""
    blk = np.asarray(blk)
    rb = stride * np.dtype(dtype).itemsize
    pitch = record_pitch(stride, np.dtype(dtype).itemsize)
    if blk.dtype == np.uint8 and blk.ndim == 2 and blk.shape[1] == pitch \
            and blk.flags.c_contiguous:
        return blk
    if blk.dtype != dtype or blk.ndim != 2 or blk.shape[1] != stride:
        raise ValueError(f"record block {blk.shape} {blk.dtype} does not match the "
                         f"layout ({stride} x {np.dtype(dtype).name}, or {pitch}-byte rows "
                         "laid out as in a segment file)")
    out = np.empty((blk.shape[0], pitch), np.uint8)
    out[:, :rb] = np.ascontiguousarray(blk).reshape(blk.shape[0], -1).view(np.uint8)
    return out


def records_of(raw: np.ndarray, stride: int, dtype: np.dtype) -> np.ndarray:
    """The ``(k, stride)`` records (a strided view) of rows laid out as in a segment file."""
    return raw[:, :stride * np.dtype(dtype).itemsize].view(dtype)


def sums_of(raw: np.ndarray) -> np.ndarray:
    """The ``(k, 2)`` uint64 checksums (a strided view) of rows laid out as in a segment
    file: each row's last 16 bytes."""
    return raw[:, raw.shape[1] - 16:].view(np.uint64)


def _mismatched(records: np.ndarray, sums: np.ndarray, version: int, head: int) -> np.ndarray:
    """Which of ``records`` ((k, stride), whole) do not match their ``sums`` (a segment of
    ``version``'s: (k,) of the whole record, or (k, 2) of its first ``head`` bytes and the
    rest): their indices."""
    if version >= 3:
        return np.flatnonzero((split_sums(records, head) != sums).any(axis=1))
    return np.flatnonzero(record_sums(records) != sums)


@contextlib.contextmanager
def _new_file(path: Path, recycle: Path | None = None):
    """``(fd, reused)``: a descriptor of a fresh ``path`` (a leftover of that name is
    replaced), opened for writing, and whether it is ``recycle`` 's file; closed at the end,
    and the partial file removed if the block raises.

    ``recycle``: an old file of ours to rename to ``path`` and overwrite (its blocks stay
    allocated: no block is freed, so no discard reaches the disk, and none is allocated).
    Its header is zeroed first, so that until the new header is written it reads as torn,
    as a new file would. A file gone, or linked elsewhere (a hard link made since: never
    overwritten), is passed over for a new one.
    """
    fd = -1
    if recycle is not None:
        try:
            os.replace(recycle, path)
            fd = os.open(path, os.O_WRONLY)
            if os.fstat(fd).st_nlink != 1:
                os.close(fd)
                fd = -1
            else:
                pwrite_all(fd, np.zeros(_HEAD_ALL, np.uint8), 0)
                crash_point("seal-recycled")
        except OSError:
            if fd >= 0:
                os.close(fd)
                fd = -1
    reused = fd >= 0
    if fd < 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        yield fd, reused
    except BaseException:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        raise
    os.close(fd)


def read_header(path: Path) -> dict[str, int]:
    """Parse and check a segment header (its own CRC); :class:`SegmentError` names the file.

    The header's page only: the file is read without read-ahead (``POSIX_FADV_RANDOM``), which
    would bring in megabytes of each segment's rows and records with it (an open of a store
    of 112 segments read 897 MiB)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            raw = os.pread(fd, _HEAD_ALL, 0)
        finally:
            os.close(fd)
    except FileNotFoundError:
        raise SegmentError(f"segment file {str(path)!r} is missing: the store's manifest "
                           "refers to it (deleted by hand?); restore the store from a "
                           "checkpoint") from None
    if len(raw) < _HEAD.size + _HCRC.size:
        raise SegmentError(f"segment file {str(path)!r} is torn: {len(raw)} bytes, shorter "
                           "than its header; restore the store from a checkpoint")
    head = raw[:_HEAD.size]
    magic, seg_id, n, stride, itemsize, count, crc_r, crc_s, crc_rec = _HEAD.unpack(head)
    if magic != SEG_MAGIC:
        raise SegmentError(f"{str(path)!r} is not a DSA log segment: magic is {magic!r}, "
                           f"expected {SEG_MAGIC!r}; restore the store from a checkpoint")
    if _HCRC.unpack(raw[_HEAD.size:_HEAD.size + _HCRC.size])[0] != zlib.crc32(head):
        raise SegmentError(f"segment file {str(path)!r} has a corrupt header (CRC mismatch); "
                           "restore the store from a checkpoint")
    version, crc_sums, head_b = 1, None, 0
    ext = raw[_HEAD.size + _HCRC.size:]
    if len(ext) == _HEXT.size + _HCRC.size and any(ext):
        smagic, value = _HEXT.unpack(ext[:_HEXT.size])
        if smagic not in (SUM_MAGIC, SPLIT_MAGIC) or _HCRC.unpack(ext[_HEXT.size:])[0] \
                != zlib.crc32(raw[:-_HCRC.size]) or (
                    smagic == SPLIT_MAGIC and (value % 4 or value > stride * itemsize)):
            raise SegmentError(f"segment file {str(path)!r} has a corrupt header (the "
                               "extension naming its record checksums does not check out); "
                               "restore the store from a checkpoint")
        if smagic == SUM_MAGIC:
            version, crc_sums = 2, value
        else:
            version, head_b = 3, value
    return {"id": seg_id, "n": n, "stride": stride, "itemsize": itemsize, "count": count,
            "crc_rows": crc_r, "crc_steps": crc_s, "crc_records": crc_rec,
            "version": version, "crc_sums": crc_sums, "head": head_b}


def _crc_of_file_range(fd: int, off: int, nbytes: int) -> int:
    crc = 0
    while nbytes > 0:
        blk = os.pread(fd, min(_IO_CHUNK, nbytes), off)
        if not blk:
            break
        crc = zlib.crc32(blk, crc)
        off += len(blk)
        nbytes -= len(blk)
    return crc


def check_segment(path: Path, seg_id: int, stride: int, itemsize: int, num_rows: int,
                  full: bool = True, with_rows: bool = False, head: int | None = None,
                  meta: bool = True) -> tuple:
    """Check a referenced segment; returns ``(records, version)`` (``with_rows``: and its
    checked row ids, ``(records, version, rows)``) or raises :class:`SegmentError`.

    Header (magic, CRC, id, stride, itemsize), file size, and with ``meta`` the CRCs of rows,
    steps and (version 2) record sums, rows inside ``[0, num_rows)`` (without: only the
    rows of ``with_rows``; the rest waits for :func:`check_meta`, before the segment's rows
    or steps are first used), and with ``full`` (always for a version-1 segment, whose
    reads are checked against sums computed from a checked read) the CRC of the records and
    every record against its sums (a read of the whole file).
    """
    h = read_header(path)
    bad = f"segment file {str(path)!r}"
    fix = "; restore the store from a checkpoint"
    if h["id"] != seg_id:
        raise SegmentError(f"{bad} holds segment {h['id']}, expected {seg_id} (files mixed "
                           f"up?){fix}")
    if (h["stride"], h["itemsize"]) != (stride, itemsize):
        raise SegmentError(f"{bad} has records of {h['stride']} x {h['itemsize']} B, the "
                           f"layout needs {stride} x {itemsize} B{fix}")
    n, version = h["n"], h["version"]
    if version >= 3 and head is not None and h["head"] != head:
        raise SegmentError(f"{bad} checks the first {h['head']} bytes of each record apart, "
                           f"the layout's weights take {head}{fix}")
    rows_off, steps_off, rec_off, size = segment_geometry(n, stride, itemsize, version)
    actual = os.stat(path).st_size
    if actual != size:
        raise SegmentError(f"{bad} is torn: {actual:,} bytes, its header announces {n} "
                           f"records ({size:,} bytes){fix}")
    meta = meta or full or version < 2
    fd = os.open(path, os.O_RDONLY)
    try:
        rows = None
        if meta or with_rows:
            rows = np.frombuffer(os.pread(fd, 8 * n, rows_off), np.int64)
            if rows.shape[0] != n or zlib.crc32(rows) != h["crc_rows"]:
                raise SegmentError(f"{bad} is corrupt: the CRC of its row ids does not "
                                   f"match{fix}")
            if n and (rows.min() < 0 or rows.max() >= num_rows):
                raise SegmentError(f"{bad} holds row ids outside [0, {num_rows}){fix}")
        if meta and _crc_of_file_range(fd, steps_off, 8 * n) != h["crc_steps"]:
            raise SegmentError(f"{bad} is corrupt: the CRC of its step counts does not "
                               f"match{fix}")
        sums = None
        if version == 2 and meta:
            sums = np.frombuffer(os.pread(fd, 8 * n, sums_offset(n, stride, itemsize)),
                                 np.uint64)
            if sums.shape[0] != n or zlib.crc32(sums) != h["crc_sums"]:
                raise SegmentError(f"{bad} is corrupt: the CRC of its record checksums does "
                                   f"not match{fix}")
        if full or version < 2:
            rec_bytes = stride * itemsize
            pitch = record_pitch(stride, itemsize, version)
            per = max(1, _IO_CHUNK // pitch)
            crc, wrong = 0, []
            for lo in range(0, n, per):
                k = min(per, n - lo)
                blk = os.pread(fd, k * pitch, rec_off + lo * pitch)
                if len(blk) != k * pitch:
                    raise SegmentError(f"{bad} is torn: its records end early{fix}")
                crc = zlib.crc32(blk, crc)
                raw = np.frombuffer(blk, np.uint8).reshape(k, pitch)
                if version >= 3:
                    wrong.append(lo + _mismatched(raw[:, :rec_bytes], sums_of(raw), version,
                                                  h["head"]))
                elif sums is not None:
                    wrong.append(lo + _mismatched(raw, sums[lo:lo + k], version, 0))
            wrong = np.concatenate(wrong) if wrong else np.empty(0, np.int64)
            if crc != h["crc_records"]:
                which = f" ({_record_damage(path, wrong, rows, short=True)})" \
                    if wrong.shape[0] else ""
                raise SegmentError(f"{bad} is corrupt: the CRC of its records does not match "
                                   f"(a damaged or torn write){which}{fix}")
            if wrong.shape[0]:
                raise SegmentError(_record_damage(path, wrong, rows))
    finally:
        os.close(fd)
    return (n, version, rows) if with_rows else (n, version)


def check_meta(seg: Segment, num_rows: int) -> None:
    """The checks of :func:`check_segment` that an open left for later (``meta=False``),
    on the mapped segment ``seg``, once: the CRCs of its row ids, steps and (version 2)
    record sums, its rows inside ``[0, num_rows)``. Raises :class:`SegmentError`."""
    if not seg.unchecked:
        return
    h = read_header(seg.path)
    bad = f"segment file {str(seg.path)!r}"
    fix = "; restore the store from a checkpoint"
    for arr in (seg.rows, seg.steps, seg.sums if seg.version == 2 else None):
        if arr is not None:
            advise_memory(np.asarray(arr).view(np.uint8), MADV_WILLNEED)  # read at depth
    if zlib.crc32(seg.rows) != h["crc_rows"]:
        raise SegmentError(f"{bad} is corrupt: the CRC of its row ids does not match{fix}")
    if zlib.crc32(seg.steps) != h["crc_steps"]:
        raise SegmentError(f"{bad} is corrupt: the CRC of its step counts does not match{fix}")
    if seg.version == 2 and zlib.crc32(seg.sums) != h["crc_sums"]:
        raise SegmentError(f"{bad} is corrupt: the CRC of its record checksums does not "
                           f"match{fix}")
    if seg.n and (seg.rows.min() < 0 or seg.rows.max() >= num_rows):
        raise SegmentError(f"{bad} holds row ids outside [0, {num_rows}){fix}")
    seg.unchecked = False


def _record_damage(path: Path, ks: np.ndarray, rows: np.ndarray | None,
                   short: bool = False) -> str:
    """The message of records ``ks`` of segment ``path`` that fail their checksums."""
    which = ", ".join(f"{int(k)}" + ("" if rows is None else f" (row {int(rows[k])})")
                      for k in ks[:5])
    more = f" and {ks.shape[0] - 5} more" if ks.shape[0] > 5 else ""
    if short:
        return f"record {which}{more} fails its checksum"
    return (f"segment file {str(path)!r} is damaged: record {which}{more} does not match "
            "its checksum (a flipped bit on disk?); it was not served. Nothing was changed; "
            "restore the store from a checkpoint (dsa verify checks every record)")


def check_records(seg: Segment, ks: np.ndarray, records: np.ndarray,
                  sums: np.ndarray | None = None) -> None:
    """``records`` (copies of the records ``ks`` of ``seg``, whole) must match their sums
    (``sums``: read with them, else the segment's own: ``seg.sums[ks]``); else
    :class:`SegmentError` naming the file, the records and their rows. Free when
    ``CHECK_RECORDS`` is off (the benchmark's baseline) or the segment is in memory."""
    if not CHECK_RECORDS or seg.sums is None or not ks.shape[0]:
        return
    wrong = _mismatched(records, seg.sums[ks] if sums is None else sums, seg.version,
                        seg.head)
    if wrong.shape[0]:
        raise SegmentError(_record_damage(seg.path, ks[wrong], seg.rows))


class _Unmapper:
    """Unmaps segment mappings in a daemon thread of their own (an ``_os.Worker``).

    A segment's mapping goes when the seal that cleaned its last live record drops it, on
    the step's thread. There ``munmap`` of a 24 MiB segment took 25-120 ms in the kernel
    (``strace -T``, out of core at a 25% region, while the read-ahead and cleaning threads
    read), the largest single part of a seal step. Queued here, the step goes on at once.
    A child forked after the thread started (its parent's thread is not in it) unmaps in the
    calling thread.
    :func:`unmap_pending` waits until every queued mapping is gone (an engine's ``close``).
    """

    def __init__(self):
        self.worker: Worker | None = None
        # reentrant: a collection while the thread starts may drop another mapping there
        self.lock = threading.RLock()

    def put(self, addr: int, size: int, fn) -> None:
        w = self.worker
        # a forked child: its parent's thread is not here; an interpreter shutting down (a
        # reader never closed): a thread started now never runs, and start() waits for it
        # forever
        if (w is not None and w.forked) or sys.is_finalizing():
            fn(addr, size)
            return
        try:
            if w is None:
                with self.lock:
                    w = self.worker = self.worker or Worker("dsa-log-unmap", _unmap, simple=True)
            w.submit((addr, size, fn))
        except Exception:  # pragma: no cover - interpreter shutdown, no thread to start
            fn(addr, size)

    def drain(self) -> None:
        w = self.worker
        if w is not None and not w.forked:
            w.join()


def _unmap(item) -> None:
    with contextlib.suppress(Exception):  # a failed munmap only leaves it mapped; the
        item[2](item[0], item[1])          # thread goes on serving the queue and the drains


_UNMAPPER = _Unmapper()


def unmap_pending() -> None:
    """Wait until the segment mappings already released are unmapped (``_Unmapper``)."""
    _UNMAPPER.drain()


class _ReadOnlyMap:
    """A read-only shared mapping of a whole file that holds no file descriptor.

    Python's ``mmap`` (and so ``np.memmap``) keeps a duplicate descriptor per mapping: a store
    of thousands of segments would exhaust the process's descriptors (often 1024). This maps
    with libc and closes the file at once. ``np.asarray(self)`` is a read-only uint8 view whose
    base is this object, so the mapping lives exactly as long as some array uses it; when the
    last one goes it is unmapped in the background (``_Unmapper``).
    """

    def __init__(self, path: Path, size: int):
        self._addr, self._size = 0, size
        self._munmap = munmap_fn  # kept: module globals may be gone when __del__ runs
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = mmap_fn(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot map {str(path)!r} ({os.strerror(err)}); with very "
                          "many segments, raise vm.max_map_count")
        self._addr = addr
        self.__array_interface__ = {"data": (addr, True), "shape": (size,), "typestr": "|u1",
                                    "version": 3}

    def __del__(self):
        if self._addr:
            addr, self._addr = self._addr, 0
            try:
                _UNMAPPER.put(addr, self._size, self._munmap)
            except Exception:  # pragma: no cover - at exit, with the modules' globals gone
                self._munmap(addr, self._size)  # a ctypes function: needs no global


class Segment:
    """One mapped segment: read-only views of its rows, steps and records (page cache)."""

    __slots__ = ("head", "id", "n", "nbytes", "path", "records", "rows", "steps", "sums",
                 "unchecked", "version")

    def __init__(self, seg_id: int, n: int, path: Path, rows, steps, records, nbytes: int,
                 sums=None, version: int = 0, head: int = 0):
        self.id, self.n, self.path = seg_id, n, path
        self.rows, self.steps, self.records, self.nbytes = rows, steps, records, nbytes
        # per-record checksums (None: in memory, reads need no check): (n,) uint64 of the
        # whole record (version 1, 2), or (n, 2) of its first ``head`` bytes and the rest,
        # each beside its record (version 3: ``records`` is then a strided view)
        self.sums = sums
        self.version, self.head = version, head
        self.unchecked = False  # rows, steps, sums not CRC-checked since the open (check_meta)


def map_segment(path: Path, seg_id: int, n: int, stride: int, dtype: np.dtype,
                version: int = SEG_VERSION, head: int = 0) -> Segment:
    """Map a segment read-only (clean page-cache pages, reclaimable, never written back); no
    file descriptor stays open. The whole file is mapped ``MADV_RANDOM``: a fault reads its
    own page only (records are read one by one, with explicit read-ahead: ``read``). That
    includes the rows, steps and sums arrays: without it a fault on a record's sum read
    around it as much as the device's read-ahead allows (``read_ahead_kb``; 8 MiB on the
    project's VM), and out of core on an aged store those reads thrashed the page cache
    (474 MB/s read for 2,200 rows/s). The sums
    of a version-1 segment (checked by the caller: ``check_segment``) are computed from its
    records now, in memory."""
    itemsize = np.dtype(dtype).itemsize
    rows_off, steps_off, rec_off, size = segment_geometry(n, stride, itemsize, version)
    mm = np.asarray(_ReadOnlyMap(path, size))
    rows = mm[rows_off:rows_off + 8 * n].view(np.int64)
    steps = mm[steps_off:steps_off + 8 * n].view(np.int64)
    if version >= 3:
        pitch = record_pitch(stride, itemsize, version)
        part = mm[rec_off:rec_off + n * pitch].reshape(n, pitch)
        advise_memory(mm, MADV_RANDOM)
        return Segment(seg_id, n, path, np.asarray(rows), np.asarray(steps),
                       records_of(part, stride, dtype), size, sums_of(part), version, head)
    records = np.asarray(mm[rec_off:rec_off + n * stride * itemsize].view(dtype)
                         ).reshape(n, stride)
    if version >= 2:
        off = sums_offset(n, stride, itemsize)
        sums = np.asarray(mm[off:off + 8 * n].view(np.uint64))
    else:
        sums = record_sums(records)
    advise_memory(mm, MADV_RANDOM)
    return Segment(seg_id, n, path, np.asarray(rows), np.asarray(steps), records, size, sums,
                   version)


# -- index bases ---------------------------------------------------------------------------
INDEX_PAGE_ROWS = 512  # rows per checksummed page of a dense index base (4 KiB of locations)
INDEX_PAGE_ENTRIES = INDEX_PAGE_ROWS // 2  # (row, location) pairs per page of a sparse base
NO_ROW = np.iinfo(np.int64).max  # the row of an unused entry of a sparse base's last page
# a base lists its rows (sparse: 16 bytes per row with a location) when fewer than one row
# in SPARSE_SHARE has a location; else it holds every row's location (dense: 8 bytes a row)
SPARSE_SHARE = 4
_INDEX_WINDOW = 1 << 20  # bytes of pages a base is built and written in


def sparse_base(located: int, num_rows: int) -> bool:
    """Whether a base of ``num_rows`` rows, ``located`` of them with a location, is sparse."""
    return int(located) * SPARSE_SHARE < int(num_rows)


def index_geometry(num_rows: int, listed: int | None = None) -> tuple[int, int, int]:
    """``(pages, sums_offset, size)`` of a paged index base of ``num_rows`` rows: dense
    (``listed`` None), or sparse listing ``listed`` rows (its fence after the sums)."""
    if listed is None:
        pages = -(-int(num_rows) // INDEX_PAGE_ROWS)
        return pages, pages * INDEX_PAGE_ROWS * 8, pages * (INDEX_PAGE_ROWS * 8 + 8)
    pages = -(-int(listed) // INDEX_PAGE_ENTRIES)
    return pages, pages * INDEX_PAGE_ROWS * 8, pages * (INDEX_PAGE_ROWS * 8 + 16)


def page_sums(pages: np.ndarray) -> np.ndarray:
    """The checksum of each page of ``pages`` ((k, INDEX_PAGE_ROWS) int64)."""
    return record_sums(pages)


def dense_entries(locs: np.ndarray, lo: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The ``(rows, locations)`` entries (what :func:`write_index` takes) of the rows with a
    location among ``locs``, the locations of rows ``lo, lo + 1, ...``."""
    nz = np.flatnonzero(locs)
    return nz.astype(np.int64) + int(lo), np.asarray(locs, np.int64)[nz]


def _dense_pages(num_rows: int, entries, window: int):
    """A dense base's pages in order, ``(first page, (k, INDEX_PAGE_ROWS) locations)``,
    built from sorted ``entries`` pieces ``window`` pages at a time."""
    npages = -(-int(num_rows) // INDEX_PAGE_ROWS)
    buf = np.zeros((max(1, min(window, npages)), INDEX_PAGE_ROWS), np.int64)
    flat, p0, w = buf.reshape(-1), 0, buf.shape[0]
    for rows, locs in entries:
        while rows.shape[0]:
            k = int(np.searchsorted(rows, (p0 + w) * INDEX_PAGE_ROWS))
            flat[rows[:k] - p0 * INDEX_PAGE_ROWS] = locs[:k]
            if k == rows.shape[0]:
                break
            rows, locs = rows[k:], locs[k:]
            yield p0, buf[:min(w, npages - p0)]
            buf[:] = 0
            p0 += w
    while p0 < npages:
        yield p0, buf[:min(w, npages - p0)]
        buf[:] = 0
        p0 += w


def _sparse_pages(entries, window: int):
    """A sparse base's pages in order (each :data:`INDEX_PAGE_ENTRIES` rows ascending, then
    their locations; the last padded with :data:`NO_ROW` and 0), as ``(first page,
    pages)``, built from sorted ``entries`` pieces."""
    e = INDEX_PAGE_ENTRIES
    rows_c = locs_c = np.zeros(0, np.int64)
    p0 = 0

    def paged(r, v):
        out = np.empty((r.shape[0] // e, INDEX_PAGE_ROWS), np.int64)
        out[:, :e] = r.reshape(-1, e)
        out[:, e:] = v.reshape(-1, e)
        return out

    for rows, locs in entries:
        if rows_c.shape[0]:
            rows, locs = np.concatenate([rows_c, rows]), np.concatenate([locs_c, locs])
        whole = rows.shape[0] // e * e
        for a in range(0, whole, window * e):
            b = min(whole, a + window * e)
            yield p0, paged(rows[a:b], locs[a:b])
            p0 += (b - a) // e
        rows_c, locs_c = rows[whole:].copy(), locs[whole:].copy()
    if rows_c.shape[0]:
        pad = e - rows_c.shape[0]
        yield p0, paged(np.concatenate([rows_c, np.full(pad, NO_ROW, np.int64)]),
                        np.concatenate([locs_c, np.zeros(pad, np.int64)]))


def write_index(path: Path, num_rows: int, entries, located: int) -> tuple[int, int | None]:
    """Write an index base sequentially and fsync it; returns ``(crc, listed)``: the CRC32
    of its tail (the manifest's ``index_crc32``) and, for a sparse base, the number of rows
    it lists (the manifest's ``index_entries``; None for a dense base).

    ``entries``: an iterable of ``(rows, locations)`` int64 pieces, each row with a location
    once, rows ascending (``index.RowIndex.located``: the index is never built whole in
    memory); ``located``: how many there are, which picks the kind (:func:`sparse_base`).
    Either kind is pages of 4 KiB (``INDEX_PAGE_ROWS`` int64) followed by one uint64
    checksum per page (:func:`page_sums`), so that a page is checked alone when a lookup
    first reads it (``index.RowIndex``):

    dense
        the location of every row, 0 for none, padded with zeros to whole pages. A page of
        zeros is left a hole: the file takes disk only for pages that hold a location.
        The CRC covers the sums.
    sparse
        the rows with a location, :data:`INDEX_PAGE_ENTRIES` a page (their ids, then their
        locations), then after the sums the first row of each page (the *fence*: an open
        reads it to find a row's page without reading pages). The CRC covers the sums and
        the fence. 16 bytes per row written, whatever the table's rows."""
    sparse = sparse_base(located, num_rows)
    window = _INDEX_WINDOW // (8 * INDEX_PAGE_ROWS)  # pages built and written at a time
    pieces = _sparse_pages(entries, window) if sparse else _dense_pages(num_rows, entries,
                                                                        window)
    sums: list[np.ndarray] = []
    fence: list[np.ndarray] = []
    listed = npages = 0
    with _new_file(path) as (fd, _):
        for p0, pages in pieces:
            sums.append(page_sums(pages))
            if sparse:
                fence.append(pages[:, 0].view(np.uint64).copy())
                listed += int(np.count_nonzero(pages[:, :INDEX_PAGE_ENTRIES] != NO_ROW))
            used = np.flatnonzero(pages.any(axis=1))  # zero pages: holes
            for run in np.split(used, np.flatnonzero(np.diff(used) != 1) + 1):
                if run.shape[0]:
                    a, b = int(run[0]), int(run[-1]) + 1
                    pwrite_all(fd, memoryview(pages[a:b]).cast("B"),
                               (p0 + a) * INDEX_PAGE_ROWS * 8)
            npages = p0 + pages.shape[0]
        tail = np.concatenate([*sums, *fence]) if sums else np.zeros(0, np.uint64)
        os.ftruncate(fd, npages * INDEX_PAGE_ROWS * 8 + tail.nbytes)
        if tail.nbytes:
            pwrite_all(fd, memoryview(tail).cast("B"), npages * INDEX_PAGE_ROWS * 8)
        fsync_fd(fd)
    return zlib.crc32(tail), (listed if sparse else None)


def _index_size(path: Path, size_wanted: int, what: str) -> None:
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"index file {str(path)!r} named by the manifest is missing; "
                                "restore the store from a checkpoint") from None
    if size != size_wanted:
        raise ValueError(f"index file {str(path)!r} has {size:,} bytes, the store's "
                         f"{what} need {size_wanted:,}; restore the store from a checkpoint")


def _index_crc(path: Path, crc: Any) -> None:
    if not isinstance(crc, int) or isinstance(crc, bool):
        raise ValueError(f"the manifest names the index file {str(path)!r} but no CRC of it "
                         f"(index_crc32 is {crc!r}); the store is damaged, restore it from a "
                         "checkpoint")


def index_damage(path: Path, pages: np.ndarray) -> ValueError:
    """The error for pages of an index base whose checksums do not match."""
    return ValueError(f"index file {str(path)!r} is corrupt: page(s) {pages[:5].tolist()} do "
                      "not match their checksums; restore the store from a checkpoint")


def map_index(path: Path, num_rows: int, crc: Any, listed: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A paged index base, mapped read-only: ``(pages, sums, fence)``, ``pages`` the
    ``(P, INDEX_PAGE_ROWS)`` int64 pages (page cache: read when first touched), ``sums``
    their checksums and ``fence`` (sparse, ``listed`` rows: each page's first row; dense:
    empty) read and checked against the manifest's CRC now. The pages are checked against
    their sums when first used (``index.RowIndex``), not here: an open reads 8 bytes per
    512 rows of a dense base, 16 per 256 listed rows of a sparse one."""
    npages, off, size = index_geometry(num_rows, listed)
    what = (f"{num_rows} rows (in pages of {INDEX_PAGE_ROWS}, with sums)" if listed is None
            else f"{listed} listed rows (in pages of {INDEX_PAGE_ENTRIES}, with sums and "
            "fence)")
    _index_size(path, size, what)
    _index_crc(path, crc)
    tail = np.fromfile(path, np.uint64, size // 8 - off // 8, offset=off)
    if zlib.crc32(tail) != crc:
        raise ValueError(f"index file {str(path)!r} is corrupt (the CRC of its page checksums "
                         "does not match); restore the store from a checkpoint")
    sums, fence = tail[:npages], tail[npages:].view(np.int64)
    if listed is not None and npages and (
            (np.diff(fence) <= 0).any() or fence[0] < 0 or fence[-1] >= num_rows):
        raise ValueError(f"index file {str(path)!r} is damaged: its pages' first rows are not "
                         f"ascending rows of the table's {num_rows}; restore the store from a "
                         "checkpoint")
    if not npages:
        return np.zeros((0, INDEX_PAGE_ROWS), np.int64), sums, fence
    mm = np.memmap(path, np.int64, "r", 0, (npages, INDEX_PAGE_ROWS))
    advise_memory(np.asarray(mm).reshape(-1).view(np.uint8), MADV_RANDOM)
    return np.asarray(mm), sums, fence


def sparse_rows(path: Path, pages: np.ndarray, num_rows: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The ``(rows, locations)`` a sparse base's ``pages`` (checked) list, checking that
    they are rows of the table, ascending."""
    rows = pages[:, :INDEX_PAGE_ENTRIES].reshape(-1)
    locs = pages[:, INDEX_PAGE_ENTRIES:].reshape(-1)
    keep = rows != NO_ROW
    rows, locs = rows[keep], locs[keep]
    if rows.shape[0] and ((np.diff(rows) <= 0).any() or rows[0] < 0 or rows[-1] >= num_rows
                          or (locs <= 0).any()):
        raise ValueError(f"index file {str(path)!r} is damaged: it lists rows out of order, "
                         f"outside the table's {num_rows} rows or without a location; "
                         "restore the store from a checkpoint")
    return rows, locs


def check_pages(path: Path, at: np.ndarray, got: np.ndarray, sums: np.ndarray,
                fence: np.ndarray, num_rows: int) -> None:
    """Check ``got``, pages ``at`` of a base (read: ``(k, INDEX_PAGE_ROWS)``), against their
    sums (``sums``: every page's); a sparse base's (``fence`` not empty: every page's first
    row) also lists rows of the table, ascending (:func:`sparse_rows`), each page starting
    at its fence's row. Raises ``ValueError`` naming the file and the pages."""
    bad = np.flatnonzero(page_sums(got) != sums[at])
    if bad.shape[0]:
        raise index_damage(path, at[bad])
    if fence.shape[0]:
        sparse_rows(path, got, num_rows)
        if (got[:, 0] != fence[at]).any():
            raise ValueError(f"index file {str(path)!r} is damaged: a page's first row is "
                             "not its fence's; restore the store from a checkpoint")


def check_index_pages(path: Path, pages: np.ndarray, sums: np.ndarray, fence: np.ndarray,
                      num_rows: int, window: int = 2048) -> None:
    """Check every page of a mapped base (:func:`map_index`) (:func:`check_pages`),
    ``window`` pages at a time: a whole base is never read into memory at once."""
    for a in range(0, pages.shape[0], window):
        blk = np.array(pages[a:a + window])
        check_pages(path, np.arange(a, a + blk.shape[0]), blk, sums, fence, num_rows)


def read_index(path: Path, num_rows: int, crc: Any, pages: bool = True,
               listed: int | None = None) -> np.ndarray:
    """Load an index base whole as every row's location (``num_rows`` int64, a writable
    array), checking its size and CRC (which a manifest naming an index must give): with
    ``pages`` (manifests with ``index_pages``) the CRC of its tail and every page against
    its sum (a sparse base, ``listed`` rows: spread over the rows); without, the CRC of the
    whole file (bases written before the pages)."""
    if pages:
        table, sums, fence = map_index(path, num_rows, crc, listed)
        got = np.array(table)  # read whole once, then checked
        check_pages(path, np.arange(got.shape[0]), got, sums, fence, num_rows)
        if listed is None:
            return got.reshape(-1)[:num_rows]
        out = np.zeros(num_rows, np.int64)
        rows, locs = sparse_rows(path, got, num_rows)
        out[rows] = locs
        return out
    _index_size(path, 8 * num_rows, f"{num_rows} rows")
    _index_crc(path, crc)
    index = np.fromfile(path, np.int64, num_rows)
    if zlib.crc32(index) != crc:
        raise ValueError(f"index file {str(path)!r} is corrupt (CRC mismatch); restore the "
                         "store from a checkpoint")
    return index


# -- manifest ----------------------------------------------------------------------------------
_FIELDS = ("layout", "count", "seed", "init", "init_scale", "ball_maxnorm", "index",
           "segments", "next_segment", "space_ratio")


def write_manifest(directory: Path, manifest: dict[str, Any], durable: bool = True) -> None:
    """Replace ``manifest.json`` atomically and durably (one writer: the lock), as version
    :data:`FORMAT_VERSION_SPARSE_INDEX` with its checksum (``manifest["version"]`` is set;
    ``manifest["index_from"]`` must be there); ``durable=False``: not synced, see
    ``_files.write_json``."""
    if "index_from" not in manifest:  # pragma: no cover - every writer sets it
        raise ValueError("a manifest needs index_from")
    manifest["version"] = FORMAT_VERSION_SPARSE_INDEX
    manifest.pop(CHECKSUM_KEY, None)
    write_json(Path(directory) / MANIFEST_FILE, manifest, shared=False, checksum=True,
               durable=durable)


def read_manifest(directory: Path) -> dict[str, Any]:
    """Read and check a log store's manifest: its checksum (versions >= 3; an older one has
    none and is accepted), its fields and settings (``create``'s rules); clear errors for
    anything else. A directory that holds a log store's files but no manifest is a damaged
    store, not an empty directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no log store at {str(directory)!r}: the directory does not "
                                "exist; create one first")
    mpath = directory / MANIFEST_FILE
    if not mpath.is_file():
        left = sorted(e for e in os.listdir(directory) if parse_name(e) is not None)
        if left:
            raise FileNotFoundError(
                f"log store {str(directory)!r} is damaged: its {MANIFEST_FILE} is missing "
                f"(deleted?) but it holds {len(left)} of a log store's files ({left[:3]}"
                f"{' ...' if len(left) > 3 else ''}), which cannot be read without it. "
                "Nothing was changed; restore the store from a checkpoint")
        raise FileNotFoundError(f"{str(directory)!r} is not a log store: it has no "
                                f"{MANIFEST_FILE}; create one first")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(mpath)!r} is not a log store manifest (expected JSON with "
                         f"format={FORMAT_NAME!r}): {exc}; if it was one, the store is "
                         "damaged: restore it from a checkpoint") from None
    found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
    if found == "dsa-store":
        raise ValueError(f"{str(directory)!r} is an in-place DSA store (format 'dsa-store'), "
                         "not a log-structured one; open it with dsa_core.open")
    if found != FORMAT_NAME:
        raise ValueError(f"{str(mpath)!r} is not a log store manifest: format is {found!r}, "
                         f"expected {FORMAT_NAME!r}")
    version = manifest.get("version")
    if version not in READ_VERSIONS:
        raise ValueError(f"log store {str(directory)!r} has format version {version!r}; this "
                         f"dsa_core reads versions {READ_VERSIONS[0]} to {READ_VERSIONS[-1]}. "
                         "Upgrade dsa_core to open it")
    check_json_checksum(mpath, manifest, required=version >= FORMAT_VERSION_SUMS)
    missing = [k for k in _FIELDS if k not in manifest]
    if missing:
        raise ValueError(f"manifest of {str(directory)!r} lacks {missing}; the store is "
                         "damaged, restore it from a checkpoint")
    try:
        lay = check_layout(manifest["layout"])
        check_count(manifest["count"])
        check_init_settings(lay, manifest["init"], manifest["init_scale"], manifest["seed"],
                            manifest["ball_maxnorm"], manifest["space_ratio"])
        nxt = manifest["next_segment"]
        if isinstance(nxt, bool) or not isinstance(nxt, int) or nxt < 1:
            raise ValueError(f"next_segment must be an int >= 1, got {nxt!r}")
        segs = manifest["segments"]
        if not isinstance(segs, list) or any(
                isinstance(x, bool) or not isinstance(x, int) for x in segs):
            raise ValueError(f"segments must be a list of segment ids, got {segs!r}")
        if not isinstance(manifest.get("meta", {}), dict):
            raise ValueError(f"meta must be a JSON object, got {manifest['meta']!r}")
        if manifest["index"] is not None \
                and (parse_name(str(manifest["index"])) or ("",))[0] != "index":
            raise ValueError(f"index must name an index-<gen>.bin file, got "
                             f"{manifest['index']!r}")
        if manifest.get("index_pages", INDEX_PAGE_ROWS) != INDEX_PAGE_ROWS:
            raise ValueError(f"index_pages must be {INDEX_PAGE_ROWS}, got "
                             f"{manifest['index_pages']!r}")
        listed = manifest.get("index_entries")
        if listed is not None and (isinstance(listed, bool) or not isinstance(listed, int)
                                   or listed < 0 or manifest.get("index_pages") is None
                                   or manifest["index"] is None):
            raise ValueError(f"index_entries must be an int >= 0 beside index and "
                             f"index_pages, got {listed!r}")
        live = manifest.get("live")
        if live is not None and (
                not isinstance(live, list) or len(live) != len(segs)
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in live)
                or not isinstance(manifest.get("located"), int)
                or sum(live) != manifest["located"]):
            raise ValueError(f"live must list a count >= 0 per segment, summing to located; "
                             f"got live={str(live)[:80]}, located={manifest.get('located')!r}")
        if version >= FORMAT_VERSION_INDEX_FROM:
            ifrom = manifest.get("index_from")
            if isinstance(ifrom, bool) or not isinstance(ifrom, int) or not 1 <= ifrom <= nxt:
                raise ValueError(f"index_from must be an int in [1, next_segment={nxt}], got "
                                 f"{ifrom!r}")
        else:  # the base is the whole index: no segment is newer than it
            manifest["index_from"] = nxt
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"manifest {str(mpath)!r} holds a setting that create refuses: "
                         f"{exc}; the store is damaged (or the file was edited by hand), "
                         "restore it from a checkpoint") from None
    return manifest
