"""Snapshots of an in-place store that share disk: a base file and forward deltas.

A snapshot (``Store.checkpoint``, what ``dsa_core.checkpoint`` and the adapters' state dicts
write) of an in-place store is a directory with a ``manifest.json`` and either

* **a plain copy**: ``rows.dsa``, the data file at the snapshot's count (a reflink where the
  filesystem can, a hard link to an earlier snapshot's file when no row changed since it,
  else a full copy); or
* **a chain**: ``base.dsa``, a hard link to the data file of an earlier plain snapshot, and
  one or more delta files ``delta-NNNN.dsa`` (hard links to those of the previous snapshot,
  and the new one): each holds the rows changed since the snapshot before it, with their
  records at its count. The manifest's ``"chain"`` names them in order, with each delta's
  row count and checksum; its ``"version"`` is :data:`CHAIN_VERSION` (an older dsa_core
  refuses it with "upgrade dsa_core", and it finds no ``rows.dsa`` to misread).

Every file of a chain is written once and never again in place; every snapshot directory
holds its own hard links to all the files it needs, so deleting, moving or copying any
snapshot directory leaves every other one whole. A writer's open of a snapshot (``mode="r+"``:
training on in it) first gives it a data file of its own (:func:`make_private`), since the
files it holds may be other snapshots' too.

Delta file (little-endian)::

    header (64 B): b"DSADLT01" | u32 format 1 | u32 record bytes | u64 table rows | u64 n
                   | i64 count | u32 crc32 of the body | u32 crc32 of the 44 bytes before it
                   | zeros
    body         : n int64 row ids, sorted and unique | n records (the layout's stride, dtype)

Which rows changed: the writer's :class:`Tracker` (in memory, this process only) collects
them from the undo file's per-interval bitmap (``undo.UndoLog.saved``: every change of a row
with ``durability="flush"`` -- a step, ``write_records``, a restore -- saves its old record
there first) and, with ``durability="step"``, from the steps themselves. Where it cannot
know (no undo file, an interval whose undo writes failed, a writable whole-table view handed
out by ``State.weights`` & co., a store opened in this process without a snapshot yet), the
next snapshot is a full copy.

Which snapshot a new one builds on (:func:`write`): the last one this store object wrote, if
its files are still there, unchanged (same inode, size and mtime) and not open for writing
(checked before and after they are linked). Up to :data:`MERGE_FROM` deltas a chain only
grows (the kept snapshots share every delta); from then on a new delta takes in the newest
deltas of the chain that are not larger than it (their rows, with their current records),
and at :data:`MAX_DELTAS` the newest one whatever its size: a chain never holds more than
:data:`MAX_DELTAS` deltas, and merging writes a changed row again at most about log2(table /
delta) times. The rebase rule: when the chain's deltas would take more bytes than the data
file, the snapshot is a full copy instead, the base of the chains after it. A full copy is
then paid for by at least a table's worth of deltas before it: a snapshot costs O(rows
changed since the last one), amortized.

Opening a chain read-only (:func:`load` then :func:`apply` or :func:`build_temp`): every
delta's header and checksum is checked first (a damaged or missing file is refused with an
error naming it, nothing changed); then the base is mapped privately (copy-on-write) and the
deltas are written into the mapping (the pages they change take memory until the close), or,
when those pages would take more than a quarter of the memory available, the table is
built in an unlinked temporary file beside the snapshot (disk: one table, freed at close).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import struct
import tempfile
import weakref
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .. import _files, _layout
from .._files import copy_file, writer_alive
from .._layout import DATA_FILE, HEADER_BYTES, MANIFEST_FILE, layout_version
from .._os import drop_pages, fsync_fd, fsync_path, pwrite_all
from .._paging import memory_available
from .undo import _mark

__all__ = ["BASE_FILE", "CHAIN_KEY", "CHAIN_VERSION", "ChainError", "Delta", "Tracker",
           "apply", "build_temp", "chain_of", "check_files", "fits_private", "is_chain_file",
           "load", "make_private", "write"]

CHAIN_KEY = "chain"        # the manifest's field that names a chain's files
CHAIN_VERSION = 4          # a manifest naming a chain: older dsa_cores refuse it
BASE_FILE = "base.dsa"     # a chain's base: an earlier plain snapshot's data file
DELTA_MAGIC = b"DSADLT01"
DELTA_FORMAT = 1
_DHEAD = struct.Struct("<8sIIQQqI")  # magic, format, record bytes, table rows, n, count, body crc
DELTA_HEAD = 64
_DELTA_NAME = re.compile(r"delta-(\d+)\.dsa")
_CHUNK = 16 << 20  # bytes of records gathered, written or checksummed at a time
PRIVATE_SHARE = 4  # a read-only open keeps a chain's changed pages in memory up to 1/4 of it
MERGE_FROM = 4     # a chain of this many deltas: a new one takes in the newest not larger
MAX_DELTAS = 16    # a chain of this many deltas: a new one takes in the newest, whatever its size


class ChainError(ValueError):
    """A file of a snapshot chain is missing or does not check out."""


def is_chain_file(name: str) -> bool:
    return name == BASE_FILE or _DELTA_NAME.fullmatch(name) is not None


def chain_of(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The chain a manifest names (``{"base": ..., "deltas": [...]}``), or None."""
    chain = manifest.get(CHAIN_KEY)
    return chain if isinstance(chain, dict) else None


def _remedy(directory: Path) -> str:
    return (f"Nothing was changed. The snapshot {str(directory)!r} cannot be read without "
            "it: load another state dict or checkpoint (every snapshot directory holds its own "
            "links to the files it needs, so deleting other snapshots never removes them: "
            "this one was deleted or damaged by hand or on disk)")


def _chain_error(directory: Path, name: str, what: str) -> ChainError:
    return ChainError(f"snapshot {str(directory)!r} is a chain of files (manifest "
                      f"'{CHAIN_KEY}': a base and deltas); its file {name!r} {what}. "
                      + _remedy(directory))


# -- delta files ---------------------------------------------------------------------------
def _delta_head(record_bytes: int, table_rows: int, n: int, count: int, crc: int) -> bytes:
    head = _DHEAD.pack(DELTA_MAGIC, DELTA_FORMAT, record_bytes, table_rows, n, count, crc)
    head += struct.pack("<I", zlib.crc32(head))
    return head + bytes(DELTA_HEAD - len(head))


def _write_delta(path: Path, data: np.ndarray, rows: np.ndarray, count: int) -> dict[str, Any]:
    """Write the records ``data[rows]`` (``rows`` sorted, unique) as a delta file at
    ``path``, synced; returns its manifest entry."""
    n = int(rows.shape[0])
    rec_bytes = data.shape[1] * data.dtype.itemsize
    ids = np.ascontiguousarray(rows, dtype=np.int64)
    crc = zlib.crc32(ids.data)
    per = max(1, _CHUNK // max(1, rec_bytes))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = DELTA_HEAD
        pwrite_all(fd, ids.data, off)
        off += ids.nbytes
        for a in range(0, n, per):
            blk = np.ascontiguousarray(data[ids[a:a + per]])
            crc = zlib.crc32(blk.data, crc)
            pwrite_all(fd, blk.data, off)
            off += blk.nbytes
        # the header last: a file cut short (a full disk) never has one that checks out
        pwrite_all(fd, _delta_head(rec_bytes, data.shape[0], n, count, crc), 0)
        fsync_fd(fd)
    finally:
        os.close(fd)
    return {"file": path.name, "rows": n, "count": int(count), "crc": f"{crc:08x}"}


class Delta:
    """One delta file of a chain, checked: ``ids`` (sorted, unique) and ``records`` (views of
    its read-only mapping)."""

    def __init__(self, path: Path, ids: np.ndarray, records: np.ndarray, count: int):
        self.path, self.ids, self.records, self.count = path, ids, records, count


def _read_delta(directory: Path, entry: Any, layout: dict[str, Any]) -> Delta:
    """Map the delta file of a manifest ``entry`` and check everything about it (header
    CRC, sizes against the layout and the entry, the body's CRC, sorted ids in range)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) \
            or _DELTA_NAME.fullmatch(entry["file"]) is None:
        raise ChainError(f"snapshot {str(directory)!r}: its manifest names a malformed delta "
                         f"entry {entry!r}. " + _remedy(directory))
    name = entry["file"]
    path = Path(directory) / name
    dtype = np.dtype(layout["dtype"])
    stride = int(layout["stride"])
    rec_bytes = stride * dtype.itemsize
    num_rows = int(layout["num_rows"])
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise _chain_error(directory, name, "is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size < DELTA_HEAD:
            raise _chain_error(directory, name, f"is truncated ({size} bytes)")
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
    head = bytes(mm[:_DHEAD.size + 4])
    magic, fmt, rb, rows, n, count, crc = _DHEAD.unpack(head[:_DHEAD.size])
    if magic != DELTA_MAGIC or struct.unpack("<I", head[_DHEAD.size:])[0] \
            != zlib.crc32(head[:_DHEAD.size]):
        raise _chain_error(directory, name, "is damaged: its header does not check out "
                           "(magic or CRC)")
    if fmt != DELTA_FORMAT or rb != rec_bytes or rows != num_rows:
        raise _chain_error(directory, name, f"belongs to another table (format {fmt}, "
                           f"{rows} rows of {rb} bytes; the manifest's layout: {num_rows} "
                           f"rows of {rec_bytes} bytes)")
    if n != entry.get("rows") or size != DELTA_HEAD + n * (8 + rec_bytes) \
            or f"{crc:08x}" != entry.get("crc") or count != entry.get("count"):
        raise _chain_error(directory, name, f"does not match the manifest's entry {entry} "
                           f"({n} rows, count {count}, crc {crc:08x}, {size} bytes): it was "
                           "replaced or damaged")
    body = memoryview(mm)[DELTA_HEAD:]
    got = 0
    for a in range(0, len(body), _CHUNK):
        got = zlib.crc32(body[a:a + _CHUNK], got)
    del body
    if got != crc:
        raise _chain_error(directory, name, f"is damaged: the CRC of its rows is {got:08x}, "
                           f"its header says {crc:08x} (a flipped bit on disk?)")
    ids = np.frombuffer(mm, np.int64, n, DELTA_HEAD)
    if n and (ids[0] < 0 or ids[-1] >= num_rows or (n > 1 and not (np.diff(ids) > 0).all())):
        raise _chain_error(directory, name, "is damaged: its row ids are not sorted, unique "
                           "ids of the table")
    recs = np.frombuffer(mm, dtype, n * stride, DELTA_HEAD + 8 * n).reshape(n, stride)
    return Delta(path, ids, recs, int(count))


def _base_check(directory: Path, name: str, layout: dict[str, Any]) -> None:
    path = Path(directory) / name
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        raise _chain_error(directory, name, "is missing (the chain's base: the table at "
                           "an earlier count)") from None
    _, on_disk, _ = _layout.parse_header(path, head)
    if on_disk != layout:
        raise _chain_error(directory, name, f"holds another table (header layout {on_disk})")
    want = HEADER_BYTES + int(layout["num_rows"]) * int(layout["stride"]) \
        * np.dtype(layout["dtype"]).itemsize
    if size != want:
        raise _chain_error(directory, name, f"is truncated or padded ({size:,} bytes, the "
                           f"layout needs {want:,})")


def load(directory: Path, manifest: dict[str, Any]) -> tuple[str, list[Delta]]:
    """The base file's name and the checked deltas of the chain ``manifest`` names (raises
    :class:`ChainError` for a missing or damaged file; nothing is written)."""
    chain = chain_of(manifest)
    layout = manifest["layout"]
    base = chain.get("base") if chain else None
    deltas = chain.get("deltas") if chain else None
    if base != BASE_FILE or not isinstance(deltas, list):
        raise ChainError(f"snapshot {str(directory)!r}: its manifest's '{CHAIN_KEY}' is "
                         f"malformed ({chain!r}). " + _remedy(Path(directory)))
    _base_check(Path(directory), base, layout)
    return base, [_read_delta(Path(directory), e, layout) for e in deltas]


def _touched_pages(deltas: list[Delta], record_bytes: int) -> int:
    """How many pages of the data file the deltas write (their rows' first and last pages)."""
    if not deltas:
        return 0
    ids = np.concatenate([d.ids for d in deltas])
    first = (HEADER_BYTES + ids * record_bytes) // mmap.PAGESIZE
    last = (HEADER_BYTES + (ids + 1) * record_bytes - 1) // mmap.PAGESIZE
    span = int(np.max(last - first)) + 1
    pages = np.unique(np.concatenate([np.minimum(first + k, last) for k in range(span)]))
    return int(pages.shape[0])


def fits_private(deltas: list[Delta], record_bytes: int) -> bool:
    """Whether the pages the deltas change fit in memory (a private mapping of the base)."""
    need = _touched_pages(deltas, record_bytes) * mmap.PAGESIZE
    return need <= memory_available() // PRIVATE_SHARE


def apply(data: np.ndarray, deltas: list[Delta]) -> None:
    """Write the deltas, in order, into ``data`` (the base's records)."""
    for d in deltas:
        per = max(1, _CHUNK // max(1, d.records.shape[1] * d.records.itemsize))
        for a in range(0, d.ids.shape[0], per):
            data[d.ids[a:a + per]] = d.records[a:a + per]


def _apply_file(fd: int, deltas: list[Delta], layout: dict[str, Any]) -> None:
    """Write the deltas into the data file open at ``fd`` (through a shared mapping), then
    sync it."""
    if deltas:
        dtype = np.dtype(layout["dtype"])
        num_rows, stride = int(layout["num_rows"]), int(layout["stride"])
        mm = mmap.mmap(fd, HEADER_BYTES + num_rows * stride * dtype.itemsize,
                       access=mmap.ACCESS_WRITE)
        try:
            data = np.frombuffer(mm, dtype, num_rows * stride, HEADER_BYTES
                                 ).reshape(num_rows, stride)
            apply(data, deltas)
            del data
            mm.flush()
        finally:
            mm.close()
    fsync_fd(fd)


def build_temp(directory: Path, base: str, deltas: list[Delta], layout: dict[str, Any]) -> int:
    """An unlinked temporary file holding the chain's table (a read-only open of a chain
    whose changed pages would not fit in memory): beside the snapshot, else in the system's
    temporary directory. Returns its descriptor; the file is gone when it is closed."""
    try:
        f = tempfile.TemporaryFile(dir=directory)
    except OSError:
        f = tempfile.TemporaryFile()
    fd = os.dup(f.fileno())
    f.close()
    try:
        with open(Path(directory) / base, "rb") as fi:
            size = os.fstat(fi.fileno()).st_size
            off = 0
            while off < size:
                try:
                    n = os.copy_file_range(fi.fileno(), fd, size - off, off, off)
                except OSError:
                    n = 0
                if n <= 0:  # no copy_file_range here: the rest through a buffer
                    fi.seek(off)
                    while buf := fi.read(_CHUNK):
                        pwrite_all(fd, buf, off)
                        off += len(buf)
                    break
                off += n
        _apply_file(fd, deltas, layout)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- a writer's open of a snapshot: a data file of its own ---------------------------------
def make_private(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Before a writer (``mode="r+"``, under its lock) opens the store at ``directory``:
    a chain is materialized (the table built in ``rows.dsa.tmp``, synced, renamed to
    ``rows.dsa``, then the manifest rewritten without the chain: the commit point; then the
    chain's files are deleted); a data file that other directories share (hard links: a
    snapshot's, a carried one's) is replaced by a copy of its own; chain files that no
    manifest names any more (a kill after the commit point) are deleted. A kill at any
    moment leaves the snapshot as it was or materialized. Returns the manifest in force."""
    directory = Path(directory)
    if chain_of(manifest) is not None:
        base, deltas = load(directory, manifest)
        tmp = directory / (DATA_FILE + ".tmp")
        try:
            copy_file(directory / base, tmp)  # a reflink where it can: blocks of its own
            fd = os.open(tmp, os.O_RDWR)
            try:
                _apply_file(fd, deltas, manifest["layout"])
                drop_pages(fd)  # small folios, as copy_file
            finally:
                os.close(fd)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        del deltas
        os.replace(tmp, directory / DATA_FILE)
        fsync_path(directory)
        manifest = {k: v for k, v in manifest.items()
                    if k not in (CHAIN_KEY, _files.CHECKSUM_KEY)}
        manifest["version"] = layout_version(manifest["layout"])
        _layout.write_manifest(directory, manifest)  # the commit point
    else:
        data = directory / DATA_FILE
        with contextlib.suppress(FileNotFoundError):
            if os.stat(data).st_nlink > 1:
                tmp = directory / (DATA_FILE + ".tmp")
                copy_file(data, tmp)
                os.replace(tmp, data)
                fsync_path(directory)
    stray = [n for n in os.listdir(directory) if is_chain_file(n)]
    for name in stray:
        (directory / name).unlink(missing_ok=True)
    if stray:
        fsync_path(directory)
    return manifest


# -- checks without opening (dsa verify) -----------------------------------------------------
def check_files(directory: Path, manifest: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    """``(file, problem or None, what was checked)`` for the base and each delta of the
    chain ``manifest`` names."""
    out: list[tuple[str, str | None, str]] = []
    chain = chain_of(manifest) or {}
    layout = manifest["layout"]
    try:
        _base_check(Path(directory), BASE_FILE, layout)
        out.append((BASE_FILE, None, "the chain's base: header CRC, layout and size (its rows "
                    "carry no checksums)"))
    except (OSError, ValueError) as exc:
        out.append((BASE_FILE, str(exc), "the chain's base"))
    for e in chain.get("deltas", []) if isinstance(chain.get("deltas"), list) else []:
        name = e.get("file", "?") if isinstance(e, dict) else "?"
        try:
            d = _read_delta(Path(directory), e, layout)
            out.append((name, None, f"a delta of {d.ids.shape[0]:,} rows at count {d.count}: "
                        "header CRC, sizes, CRC of its rows, sorted ids"))
            del d
        except (OSError, ValueError) as exc:
            out.append((name, str(exc), "a delta of the chain"))
    return out


# -- the writer's side ---------------------------------------------------------------------
def _identity(path: Path) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class Last:
    """The snapshot a store wrote last: where, its chain (``deltas``: manifest entries, empty
    for a plain copy) and the identity of its files (inode, size, mtime) when written."""

    def __init__(self, path: Path, base: str, deltas: list[dict[str, Any]]):
        self.path = Path(os.path.abspath(path))
        self.base = base
        self.deltas = deltas
        names = [base, MANIFEST_FILE] + [e["file"] for e in deltas]
        self.files = {n: _identity(self.path / n) for n in names}

    def unchanged(self) -> bool:
        try:
            return all(_identity(self.path / n) == ident for n, ident in self.files.items())
        except OSError:
            return False


_TRACKERS: weakref.WeakSet = weakref.WeakSet()


class Tracker:
    """The rows a writer changed since the last snapshot it wrote (in memory, this process).

    ``bits`` is a bitmap (one bit per row, as the undo file's) allocated at the first
    snapshot; ``complete`` is False once a change went unseen (then the next snapshot is a
    full copy); ``views`` is True once a writable whole-table view was handed out (rows may
    change through it unseen: every snapshot of this open is a full copy).
    """

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.bits: np.ndarray | None = None
        self.complete = True
        self.views = False
        self.last: Last | None = None
        self.absorbed = None  # the undo interval whose rows were taken in last
        _TRACKERS.add(self)

    def absorb(self, undo) -> None:
        """Take in the rows of the undo file's last interval (called once it has ended: when
        the next begins, and at a snapshot, after its flush)."""
        if undo is None or undo.saved is None or undo.epoch == self.absorbed:
            return
        self.absorbed = undo.epoch
        if self.bits is None:
            return
        if undo.incomplete:
            self.complete = False
        elif undo.nsaved:
            np.bitwise_or(self.bits, undo.saved, out=self.bits)

    def mark(self, rows: np.ndarray) -> None:
        """``rows`` change now (a journaled step: ``durability="step"``)."""
        if self.bits is not None and rows.shape[0]:
            _mark(self.bits, np.ascontiguousarray(rows, dtype=np.int64))

    def lose(self) -> None:
        """A change that no bitmap saw: the next snapshot is a full copy."""
        self.complete = False

    def changed(self) -> np.ndarray:
        """The rows changed since the last snapshot, sorted."""
        out = []
        flat = self.bits.reshape(-1)
        step = 1 << 22
        for lo in range(0, flat.shape[0], step):
            blk = flat[lo:lo + step]
            nz = np.flatnonzero(blk)
            if nz.shape[0]:
                bits = np.unpackbits(blk[nz], bitorder="little").reshape(-1, 8)
                r, c = np.nonzero(bits)
                out.append((lo + nz[r]).astype(np.int64) * 8 + c)
        rows = np.concatenate(out) if out else np.empty(0, np.int64)
        return rows[rows < self.num_rows]

    def taken(self, last: Last | None) -> None:
        """A snapshot was written (``last``: what later ones may build on, None for none)."""
        if self.bits is None:
            self.bits = np.zeros(((self.num_rows + 7) // 8, 1), np.uint8)
        else:
            self.bits.fill(0)
        self.complete = True
        self.last = last


def _moved(tmp: Path, dest: Path) -> None:
    """``_files.commit_dir`` renamed ``tmp`` to ``dest``: a snapshot remembered inside it
    (an adapter's checkpoint writes its stores' snapshots into a staged directory) is now
    under ``dest``."""
    a, b = os.path.abspath(tmp), os.path.abspath(dest)
    for t in list(_TRACKERS):
        last = t.last
        if last is None:
            continue
        p = str(last.path)
        if p == a or p.startswith(a + os.sep):
            last.path = Path(b + p[len(a):])


_files.COMMIT_HOOKS.append(_moved)


def _delta_name(seq: int) -> str:
    return f"delta-{seq:04d}.dsa"


def _seq(deltas: list[dict[str, Any]]) -> int:
    return max((int(_DELTA_NAME.fullmatch(e["file"]).group(1)) for e in deltas), default=0)


def _usable(last: Last) -> bool:
    """The last snapshot's files are there, unchanged, and no writer has it open (a
    writer's open copies a shared data file first, but one that opened before the files were
    linked does not know: checked again once they are linked)."""
    return last.unchanged() and not writer_alive(last.path)


def write(store, tracker: Tracker, tmp: Path, manifest: dict[str, Any], count: int
          ) -> Last | None:
    """Write the snapshot's files into the staged directory ``tmp`` (the live store flushed
    at ``count``, ``manifest`` its snapshot manifest): a reflink, a chain on the last
    snapshot, or a full copy (see the module docstring). Returns what later snapshots may
    build on: the description of this one (its path is ``tmp`` until renamed)."""
    if _files.reflink(store.file, tmp / DATA_FILE):
        _layout.write_manifest(tmp, manifest)
        return None  # a reflink shares blocks already: no chain on it
    last = tracker.last
    if last is not None and tracker.complete and not tracker.views and _usable(last):
        try:
            done = _chain(store, tracker, last, tmp, manifest, count)
            if done is not None and not _usable(last):
                done = None
        except (OSError, ChainError):  # a link refused (another filesystem), a bad delta
            done = None
        if done is not None:
            return done
        for p in tmp.iterdir():
            p.unlink()
    copy_file(store.file, tmp / DATA_FILE)
    _layout.write_manifest(tmp, manifest)
    return Last(tmp, DATA_FILE, [])


def _chain(store, tracker: Tracker, last: Last, tmp: Path, manifest: dict[str, Any],
           count: int) -> Last | None:
    """The snapshot as ``last``'s chain and a delta of the rows changed since it; None when
    the rebase rule says a full copy (nothing written then)."""
    rec_bytes = store.layout.stride * store.layout.dtype.itemsize
    new = tracker.changed()
    keep = list(last.deltas)

    def merge() -> np.ndarray:  # the chain's newest delta into the new one (rows as now)
        old = _read_delta(last.path, keep.pop(), store.layout.as_dict())
        return np.union1d(new, old.ids)
    if new.shape[0]:
        if len(keep) >= MAX_DELTAS:
            new = merge()
        if len(keep) >= MERGE_FROM:
            while keep and keep[-1]["rows"] <= new.shape[0]:
                new = merge()
    delta_bytes = sum(e["rows"] for e in keep) * (8 + rec_bytes)
    if new.shape[0]:
        delta_bytes += new.shape[0] * (8 + rec_bytes) + DELTA_HEAD
    if delta_bytes > store.nbytes:
        return None  # the rebase rule: a full copy costs no more than these deltas
    base_name = BASE_FILE if (keep or new.shape[0]) else DATA_FILE
    os.link(last.path / last.base, tmp / base_name)
    for e in keep:
        os.link(last.path / e["file"], tmp / e["file"])
    if new.shape[0]:
        keep.append(_write_delta(tmp / _delta_name(_seq(last.deltas) + 1), store.data, new,
                                 count))
    if keep:
        manifest = {**manifest, "version": max(CHAIN_VERSION, int(manifest["version"])),
                    CHAIN_KEY: {"base": BASE_FILE, "deltas": keep}}
    _layout.write_manifest(tmp, manifest)
    return Last(tmp, base_name, keep)
