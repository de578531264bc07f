"""Durable file operations: atomic JSON, atomic directories, store-file copies.

Nothing here knows the record layout: these are the primitives that the store, its
checkpoints and the adapters' multi-store checkpoints share, so that each fact
("a JSON file is replaced atomically", "a directory appears complete or not at all")
has one implementation.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import fnmatch
import json
import mmap
import os
import shutil
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from ._os import drop_pages, fsync_fd, fsync_path, libc, page_residency, pwrite_all

__all__ = ["CHECKSUM_KEY", "COMMIT_HOOKS", "InDoubtError", "check_json_checksum", "commit_dir",
           "copy_file", "copy_tree", "json_checksum", "reflink", "staged_dir", "write_json"]

CHECKSUM_KEY = "checksum"  # a manifest's own checksum: "crc32:<8 hex digits>"


class InDoubtError(OSError):
    """A file was renamed into place but its directory could not be synced: readers see
    the new file, and whether it survives a power cut is unknown."""


def json_checksum(obj: dict[str, Any]) -> str:
    """``"crc32:<hex>"`` of the canonical JSON text of ``obj`` without its
    :data:`CHECKSUM_KEY` (sorted keys, no spaces): what a checksummed manifest stores.

    >>> json_checksum({"count": 3}) == json_checksum({"count": 3, "checksum": "x"})
    True
    """
    body = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return f"crc32:{zlib.crc32(text.encode()):08x}"


def check_json_checksum(path: Path, obj: Any, *, required: bool) -> bool:
    """Check the checksum a JSON file ``path`` (already parsed into ``obj``) stores.

    Returns True when it holds one and it matches, False when it holds none and
    ``required`` is false (a file written before checksums); raises ``ValueError``
    naming the file otherwise (a flipped bit, an edit by hand, or none where one must be).
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{str(path)!r} is damaged: it holds a JSON "
                         f"{type(obj).__name__}, not an object; restore the store from a "
                         "checkpoint")
    stored = obj.get(CHECKSUM_KEY)
    if stored is None and not required:
        return False
    want = json_checksum(obj)
    if stored != want:
        raise ValueError(
            f"{str(path)!r} is damaged: its checksum does not match its contents "
            f"(stored {stored!r}, computed {want!r}; a flipped bit on disk or an edit by "
            "hand). Nothing was changed; restore the store from a checkpoint")
    return True


def read_json(path) -> Any:
    """The JSON file ``path`` (from :func:`write_json`), its checksum checked when it holds
    one (``write_json(..., checksum=True)``): ``ValueError`` naming the file when the
    checksum does not match (a flipped bit, an edit by hand) or the text is not JSON.
    A file without a checksum (written before checksums) is read as it is. The object
    returned does not hold the checksum itself.

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "meta.json"
    >>> write_json(p, {"count": 3}, checksum=True)
    >>> read_json(p)["count"]
    3
    """
    path = Path(path)
    try:
        obj = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{str(path)!r} is damaged: it is not valid JSON ({exc})") from None
    if isinstance(obj, dict) and CHECKSUM_KEY in obj:
        check_json_checksum(path, obj, required=True)
        del obj[CHECKSUM_KEY]
    return obj


def write_json(path, obj: Any, *, shared: bool = True, checksum: bool = False,
               durable: bool = True) -> None:
    """Replace the JSON file ``path`` atomically and durably: the one JSON writer.

    The text goes to a temporary file beside it, which is written in full
    (``_os.pwrite_all``: a write may write less than asked, e.g. on a nearly full disk),
    fsync'd and renamed over ``path``; then the directory is fsync'd. A reader sees the old file or
    the
    new one, never a mix. A failure before the rename (a full disk, an I/O error) leaves
    the old file and removes the temporary; only a crash can leave the temporary behind.
    A failure of the directory's sync after the rename raises :class:`InDoubtError` (an
    ``OSError``): the new file is in place, whether it is durable is unknown.

    ``shared=True`` (default) names the temporary after this process and thread, so that
    concurrent writers of one path never share one. ``shared=False`` is for a file with a
    single writer (a store's manifest, under its writer lock): a fixed name, so that the
    temporary a crash left behind is reused rather than piling up.

    ``checksum=True`` stores :func:`json_checksum` of ``obj`` under :data:`CHECKSUM_KEY`
    (``obj`` itself is not changed); :func:`check_json_checksum` checks it when read.

    ``durable=False`` skips the two syncs (still atomic for readers and after ``kill -9``,
    not after a power cut): for a file whose content is durable elsewhere until it is
    synced (a group member's manifest, held by its group's commit file, ``dsa_core._group``).

    >>> import json, tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "meta.json"
    >>> write_json(p, {"count": 3})
    >>> json.loads(p.read_text())
    {'count': 3}
    """
    path = Path(path)
    tag = f"-{os.getpid()}-{threading.get_ident()}" if shared else ""
    tmp = path.with_name(f"{path.name}.tmp{tag}")
    if checksum:
        obj = json.loads(json.dumps(obj))  # as a reader will see it (tuples -> lists, ...)
        obj[CHECKSUM_KEY] = json_checksum(obj)
    data = memoryview(json.dumps(obj, indent=1, sort_keys=True).encode())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            pwrite_all(fd, data, 0)  # finishes short writes (a nearly full disk)
            if durable:
                fsync_fd(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        try:
            fsync_path(path.parent)
        except OSError as exc:
            raise InDoubtError(exc.errno, f"{str(path)!r} was renamed into place but its "
                               f"directory could not be synced ({exc})") from exc


_COPY_CHUNK = 16 << 20  # bytes per read of a copy: a multiple of any O_DIRECT alignment


def _copy_direct(src: Path, fd_out: int) -> int:
    """Copy ``src`` from its start to the same offsets of the open ``fd_out``, reading with
    ``O_DIRECT``; returns how many bytes it copied: the whole file, or fewer where direct
    reads stop (0: the filesystem refuses them: tmpfs, some FUSE and network filesystems;
    a short read in the middle, after which the offset is no longer aligned). The caller
    copies the rest (:func:`_copy_cached`).

    Why: a read through the page cache (``read``, ``copy_file_range``, ``cp``) fills it
    with large folios (up to 2 MiB on ext4 with large-folio support), and a store whose
    cache holds such folios writes a whole folio back for every row a step changes,
    hundreds of times the 4 KiB that the row needs (``python -m benchmarks.folio_check``;
    docs/storage.md, "Copy stores with checkpoint, not cp"). ``O_DIRECT`` leaves the
    source's cache as it was. The buffer is an anonymous mapping (page-aligned, as
    ``O_DIRECT`` needs); the last read returns the file's unaligned tail. The caller has
    flushed the store, so the disk holds the rows.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    if flags == os.O_RDONLY:  # pragma: no cover - no O_DIRECT on this platform
        return 0
    try:
        fd = os.open(src, flags)
    except OSError:
        return 0
    buf = mmap.mmap(-1, _COPY_CHUNK)
    try:
        size, off = os.fstat(fd).st_size, 0
        while off < size:
            try:
                n = os.preadv(fd, [buf], off)
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    return off  # direct reads refused here: the rest through the cache
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"{str(src)!r} ended at {off:,} of {size:,} bytes")
            pwrite_all(fd_out, memoryview(buf)[:n], off)
            off += n
            if n < _COPY_CHUNK:  # the tail, or a short read: the next offset is unaligned
                return off
        return off
    finally:
        os.close(fd)
        # only an error's traceback can still hold views of the buffer (pwrite_all's, when
        # a write fails: ENOSPC, EIO); closing it would then raise BufferError in place of
        # that error, so the mapping goes with the traceback instead
        with contextlib.suppress(BufferError):
            buf.close()


def _copy_cached(fd_in: int, fd_out: int, off: int, size: int, share: bool) -> None:
    """Copy bytes ``[off, size)`` of ``fd_in`` to ``fd_out`` through the page cache (where
    :func:`_copy_direct` could not), then drop from the cache the source's pages that
    were not in it before the copy (:func:`_os.page_residency` before,
    :func:`_os.drop_pages` after): the cache is left as it was found, as a direct read
    leaves it, except for a page another process faulted in meanwhile. ``share=True``
    lets ``copy_file_range`` copy (it may share blocks); else reads and writes."""
    try:
        before = page_residency(fd_in, size)
    except OSError:  # pragma: no cover - the file cannot be mapped: drop all it reads
        before = None
    try:
        while share and off < size:
            try:
                n = os.copy_file_range(fd_in, fd_out, min(1 << 30, size - off), off, off)
            except OSError:
                n = 0
            if n <= 0:  # no copy_file_range here: reads and writes for the rest
                break
            off += n
        buf = memoryview(bytearray(min(_COPY_CHUNK, max(size - off, 0))))
        while off < size:
            n = os.preadv(fd_in, [buf[:size - off]], off)
            if n <= 0:
                raise OSError(errno.EIO, f"the file ended at {off:,} of {size:,} bytes")
            pwrite_all(fd_out, buf[:n], off)
            off += n
    finally:
        drop_pages(fd_in, keep=before)


def _ficlone(fi, fo) -> None:
    """Make the open file ``fo`` a reflink of ``fi`` (shared extents); OSError where the
    filesystem cannot (ext4, tmpfs, two filesystems)."""
    FICLONE = 0x40049409
    fcntl.ioctl(fo.fileno(), FICLONE, array.array("i", [fi.fileno()])[0])


def reflink(src: Path, dst: Path) -> bool:
    """Create ``dst`` as a reflink of ``src`` (fsync'd); False, and no ``dst``, where the
    filesystem cannot."""
    with src.open("rb") as fi, dst.open("wb") as fo:
        try:
            _ficlone(fi, fo)
        except OSError:
            ok = False
        else:
            ok = True
            fsync_fd(fo.fileno())
    if not ok:
        dst.unlink(missing_ok=True)
    return ok


def copy_file(src: Path, dst: Path, *, share: bool = True) -> None:
    """The one copy routine of checkpoints, snapshots and store copies: every file they
    copy goes through it, and it leaves the page cache as it found it.

    ``share=True``: a reflink (FICLONE) where the filesystem can. Otherwise the bytes are
    read with ``O_DIRECT`` (:func:`_copy_direct`: the source's cache is not touched) and
    written to ``dst``. Where the filesystem refuses direct reads, the rest is copied
    through the cache (``copy_file_range`` when ``share``, else reads and writes) and the
    source's pages that the copy brought into the cache are dropped again
    (:func:`_copy_cached`; pages that were cached before stay). ``dst`` is fsync'd and
    then dropped from the page cache, so a store opened from it starts with small folios
    too.

    ``share=False``: never share blocks with ``src`` (no reflink, no ``copy_file_range``,
    which may clone too): the bytes are read and written again, so damage to one copy's
    blocks never reaches the other."""
    src, dst = Path(src), Path(dst)
    with src.open("rb") as fi, dst.open("wb") as fo:
        try:
            if not share:
                raise OSError(errno.EOPNOTSUPP, "a full copy was asked for")
            _ficlone(fi, fo)
        except OSError:
            size = os.fstat(fi.fileno()).st_size
            off = _copy_direct(src, fo.fileno())
            if off < size:
                _copy_cached(fi.fileno(), fo.fileno(), off, size, share)
        fsync_fd(fo.fileno())
        drop_pages(fo.fileno())


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        fn = libc["renameat2"]
    except AttributeError:  # pragma: no cover - an old C library
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    r = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return r == 0


# called as hook(tmp, dest) after commit_dir renamed tmp to dest: an in-place store that
# remembers its last snapshot by path (``_inplace.snapshots``) follows it there
COMMIT_HOOKS: list = []


def commit_dir(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Give the complete directory ``tmp`` the name ``dest`` in one atomic step (fsync'd).

    An existing ``dest`` (only with ``overwrite``) is swapped with ``tmp`` atomically
    (renameat2 RENAME_EXCHANGE) where the filesystem allows, so ``dest`` always names one
    complete snapshot; the old one is deleted afterwards. Used by every checkpoint writer
    (``dsa_core.checkpoint`` and the adapters' multi-store checkpoints); then each of
    :data:`COMMIT_HOOKS` is told.
    """
    tmp, dest = Path(tmp), Path(dest)
    tmp_named = tmp
    fsync_path(tmp)
    if dest.exists():
        if not overwrite:
            raise FileExistsError(f"{str(dest)!r} exists; pass overwrite=True to replace it")
        if not _exchange(tmp, dest):  # no atomic swap here: a short window without dest
            old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
            os.rename(tmp, dest)
            tmp = old
        fsync_path(dest.parent)
        for hook in COMMIT_HOOKS:
            hook(tmp_named, dest)
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, dest)
        fsync_path(dest.parent)
        for hook in COMMIT_HOOKS:
            hook(tmp, dest)


@contextlib.contextmanager
def staged_dir(dest: Path, overwrite: bool):
    """Build a directory in ``dest.tmp-<pid>``; on success commit it as ``dest`` (``commit_dir``).

    On any error the temporary directory is removed and ``dest`` is left as it was. The
    snapshot writers (``dsa_core.checkpoint`` and the adapters' multi-store checkpoints)
    write their files into the yielded path.
    """
    dest = Path(dest)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        commit_dir(tmp, dest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class ForkedReadError(RuntimeError):
    """A process forked from a log store's writer read the store after the writer changed
    rows: its copy of the writer's memory region is older than the store."""


def link_files(src: Path, dest: Path) -> Path:
    """Put the files of the closed store (or snapshot) directory ``src`` into the new
    directory ``dest``: hard links where the filesystem allows (the files must never be
    written again in place: a checkpoint's or a snapshot's), else a reflink or a copy
    (:func:`copy_file`); ``dest`` and its parent are fsync'd. ``dest`` must not exist. Not
    the writer lock file (two directories sharing one would lock each other)."""
    src, dest = Path(src), Path(dest)
    dest.mkdir()
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != WRITER_LOCK:
            try:
                os.link(f, dest / f.name)
            except OSError:
                copy_file(f, dest / f.name)
    fsync_path(dest)
    fsync_path(dest.parent)
    return dest


def copy_tree(src: Path, dest: Path, *, share: bool = True) -> None:
    """Copy the directory ``src`` (a closed store, a snapshot, a checkpoint) into
    ``dest`` (made if missing), subdirectories too, every file with :func:`copy_file`
    (never hard links: the copy may be written in place) and ``dest``'s directories
    fsync'd; not the writer lock nor ``*.tmp*`` leftovers (a staged directory, a
    manifest's temporary)."""
    src, dest = Path(src), Path(dest)
    dest.mkdir(exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.name == WRITER_LOCK or fnmatch.fnmatch(f.name, "*.tmp*"):
            continue
        if f.is_dir():
            copy_tree(f, dest / f.name, share=share)
        else:
            copy_file(f, dest / f.name, share=share)
    fsync_path(dest)


class StoreLockedError(RuntimeError):
    """Another writer holds the store."""


WRITER_LOCK = "writer.lock"  # the writer holds LOCK_EX on it while the store is open
_LOCK_TRIES, _LOCK_WAIT_S = 5, 0.01  # a held lock is reported after ~40 ms


def lock_writer(directory: Path) -> int:
    """Take a store's writer lock, both kinds': an exclusive ``flock`` on ``writer.lock``
    (not on a data file: ``mmap`` duplicates a file's descriptor, which would keep such a lock
    alive until the mapping is collected). Returns its descriptor (close it to release), or
    raises :class:`StoreLockedError` after a few short waits (``dsa info`` probes the lock
    with a shared flock for a few microseconds: a writer opening then waits it out)."""
    fd = os.open(Path(directory) / WRITER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if attempt + 1 < _LOCK_TRIES:
                time.sleep(_LOCK_WAIT_S)
    os.close(fd)
    raise StoreLockedError(
        f"store {str(directory)!r} is already open for writing (by this or another process); "
        "a store has one writer at a time. Close the other optimizer/state (dsa_core.close) "
        "or open this one read-only with mode='r'")


def writer_alive(directory: Path) -> bool:
    """Does an open file (another process's writer, or this one's) hold ``writer.lock``?"""
    try:
        fd = os.open(Path(directory) / WRITER_LOCK, os.O_RDONLY)
    except OSError:  # none (never opened for writing), or unreadable: no writer seen
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)
