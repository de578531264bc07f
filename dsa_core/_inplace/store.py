"""The open files of one store: the mapped records, the writer lock, the undo journal.

One process at a time may open a store for writing: the writer holds an exclusive ``flock``
on ``writer.lock`` for as long as the store is open. (Not on ``rows.dsa`` itself: ``mmap``
duplicates the data file's descriptor, which would keep such a lock alive until the mapping
is garbage-collected.) Read-only opens take no lock. The bytes are described in
``_layout``; the paging advice comes from ``_paging``.

Crash recovery with ``durability="flush"``: the rows reach the file whenever the kernel
writes the mapped pages back, so after a process stops between flushes (SIGTERM, kill -9, an
OOM kill) the rows may mix steps after the last flush with the manifest's count. The header's
unclean marker (:meth:`Store.mark_unclean`) is made durable once per flush interval, before
its first row changes, and cleared by the flush that makes the rows durable. Before each
row's first change in an interval its old record goes to the undo file (``undo.py``: page
cache only, never synced). A writer's ``open`` of a marked store that no writer holds writes
those records back when the undo file was written on this boot, and so reopens exactly at
the last flush; after a power cut or a reboot (or without a usable undo file) ``open``
refuses it (:class:`UncleanStopError`) unless told ``unclean="accept"``. A store never
closed is flushed when it is garbage-collected or at interpreter exit (:func:`_flush_unclosed`).

Snapshots (:meth:`Store.checkpoint`): a reflink where the filesystem can, else a chain on the
writer's last snapshot (its files hard-linked and a delta of the rows changed since, which the
undo file's bitmaps tell) or a full copy; the rules, the files and the reading of a chain are
in ``snapshots.py``. A writer's open of a snapshot first gives it a data file of its own.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import struct
import weakref
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from .. import _exit, _layout
from .._coalesce import gather_rows
from .._engine import Info
from .._files import (
    CHECKSUM_KEY,
    InDoubtError,
    StoreLockedError,
    copy_file,
    lock_writer,
    staged_dir,
    writer_alive,
)
from .._init import INIT_CHUNK_BYTES, InitSpec, chunks, fill_weights, progress_bar
from .._layout import (
    DATA_FILE,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_BYTES,
    HEADER_CRC_OFFSET,
    JOURNAL_FILE,
    Layout,
    MAGIC,
    MANIFEST_FILE,
    UNCLEAN_MARK,
    UNCLEAN_OFFSET,
    UNDO_FILE,
    counter_dtype,
    header_bytes,
    header_crc,
    layout_version,
    parse_header,
    read_manifest,
)
from .._os import fdatasync_fd, fsync_path, pwrite_all, pwritev_all
from .._paging import _RAM_STORES, auto_access, check_access
from .._pool import run_chunked
from .readahead import Prefetcher, mapped_residency
from .ranges import submit_mapped, submit_mapped_rows, wait_mapped
from . import snapshots as _snapshots
from . import undo as _undo
from .._settings import remembered
from .._validation import check_memory_arg, check_unclean

__all__ = ["SETTINGS", "Store", "StoreLockedError", "UncleanStopError", "check_settings",
           "create_store", "open_store", "remove_store"]

JOURNAL_MAGIC = b"DSAJRNL1"
_JHEAD = struct.Struct("<8sQQI")


class UncleanStopError(RuntimeError):
    """The store was stepped after its last flush, its writer ended without a flush or close,
    and its rows cannot be put back at the last flush (the machine restarted since, so the
    undo record of the interval cannot be trusted, or there is none): its rows may mix later
    steps with its count."""


def _unclean_message(path: Path, count: int, reason: str = "") -> str:
    p = str(path)
    why = (f" Its rows cannot be put back at count {count}: {reason}." if reason else "")
    return (
        f"store {p!r} was not stopped cleanly: it was stepped after its last flush (count "
        f"{count}, the count its manifest holds) and the process ended before the next flush "
        "or close (SIGTERM, kill -9, an OOM kill, os._exit, power loss)." + why + " Its rows "
        f"may mix the steps after {count} with those of step {count}, so training on from "
        f"count {count} would "
        "silently continue from a mixed state. Either restore it from a checkpoint: "
        f"`s = dsa_core.open({p!r}, unclean='accept'); "
        "s = dsa_core.restore(s, dsa_core.open(CHECKPOINT, mode='r'))` (or replace the "
        "directory with a copy of the checkpoint); or accept the rows as they are: "
        f"`dsa_core.open({p!r}, unclean='accept')` (the next flush or close clears this "
        "mark; `dsa_core.close(dsa_core.open(path, unclean='accept'))` does it once, for an "
        "adapter's resume, or pass unclean='accept' to the adapter). Stores created with "
        "durability='step' reopen exactly at their last step even after a power cut, log "
        "stores (storage='log') at their last flush.")


class _Files:
    """What an open store holds of the OS, and its live count, apart from the ``Store``.

    The finalizer that flushes a store nobody closed (:func:`_flush_unclosed`) reaches them
    through this object, so that it does not keep the ``Store`` itself alive.
    """

    __slots__ = ("path", "fd", "jfd", "lockfd", "mm", "count", "marked", "prepared", "undo",
                 "flushed")

    def __init__(self, path: Path):
        self.path = path
        self.fd = self.jfd = self.lockfd = -1
        self.mm: mmap.mmap | None = None
        self.count: int | None = None  # None until create/open know it: nothing to flush
        self.marked = False  # the unclean marker is set on disk (rows may be past the count)
        self.prepared: dict[str, Any] | None = None  # a group's prepared manifest (_group)
        self.undo: _undo.UndoLog | None = None  # r+, durability="flush": the undo file
        self.flushed: int | None = None  # the manifest's count (what the undo restores)

    def clear_mark(self) -> None:
        """Zero the unclean marker (not synced: a lost clear errs on the side of refusing).

        Called past the commit point (the rows synced, the manifest written): a clear that
        cannot be written (a failing disk) is a lost clear, not a failed commit, so its
        error is dropped; the marker is written again before the next change."""
        if self.marked:
            try:
                pwrite_all(self.fd, bytes(len(UNCLEAN_MARK)), UNCLEAN_OFFSET)
            except OSError:
                pass
            self.marked = False

    def void_journal(self) -> None:
        jpath = self.path / JOURNAL_FILE
        if self.jfd < 0 and not jpath.exists():
            return
        fd = self.jfd if self.jfd >= 0 else os.open(jpath, os.O_RDWR)
        try:
            os.ftruncate(fd, 0)
            fdatasync_fd(fd)
        finally:
            if fd != self.jfd:
                os.close(fd)

    def release(self) -> None:
        if self.undo is not None:
            self.undo.close()
            self.undo = None
        for name in ("jfd", "fd", "lockfd"):  # the lock goes last
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def _flush_unclosed(f: _Files, pid: int) -> None:
    """Flush an in-place store that was never closed: when its ``Store`` (every ``State`` of
    it) is garbage-collected, or when the interpreter exits normally (``weakref.finalize``
    runs at exit too); then release its files and writer lock.

    As ``dsa_core.flush`` with the live count and the hyperparameters of the last flush (the
    manifest on disk), as a log store does (``_log.store._flush_unclosed``): a forgotten
    ``close`` is no unclean stop. Nothing to write when no row changed and the count did not
    move since the last flush (a ``durability="step"`` store commits every step). Only in
    the process that opened the store (a forked child must never write the parent's store);
    a failure is printed to stderr (there is nowhere to raise to).
    """
    if os.getpid() != pid:
        return
    try:
        if f.prepared is not None:
            raise RuntimeError("a commit of several stores together was prepared and neither "
                               "installed nor cancelled; the next open installs it if its "
                               "group committed it")
        if f.fd >= 0 and f.count is not None:
            gone = _exit.store_gone(f.path, f.lockfd)
            if gone == "removed":
                return  # the user deleted the store (a TemporaryDirectory): nothing to lose
            if gone == "replaced":
                raise RuntimeError(
                    "the store's directory was deleted while it was open and another store "
                    "now stands at its path; nothing was written into that one (the steps "
                    "since the last flush are lost)")
            manifest = read_manifest(f.path)
            if f.marked or int(manifest["count"]) != f.count:
                f.mm.flush()  # msync: every row written so far is on disk
                f.void_journal()
                if f.undo is not None:
                    f.undo.synced(f.count)
                manifest["count"] = int(f.count)
                _layout.write_manifest(f.path, manifest)
                f.clear_mark()
                fdatasync_fd(f.fd)
            if f.undo is not None:
                f.undo.discard()
    except Exception as exc:  # nowhere to raise to: say so (and exit non-zero, _exit)
        if _exit.store_gone(f.path, f.lockfd) == "removed":
            return  # deleted while it flushed: nothing to lose either
        _exit.report(f"dsa_core: flushing unclosed store {str(f.path)!r} failed: {exc!r}")
    finally:
        f.release()


def _handle(name: str) -> property:
    return property(lambda self: getattr(self._f, name),
                    lambda self, value: setattr(self._f, name, value))


class Store:
    """The in-place engine (``_engine.Engine``): the mapped records, the lock, the layout.

    ``data`` is a plain ``numpy.ndarray`` of shape ``(num_rows, stride)`` over a
    shared ``mmap`` of ``rows.dsa`` (writes reach the file). The object is shared
    by every ``State`` derived from the one returned by ``create``/``open``.
    """

    kind = "inplace"

    def __init__(self, directory: Path, layout: dict[str, Any], mode: str,
                 access: str = "auto"):
        self.path = Path(directory)
        self._access = check_access(access)  # the paging asked for at open ("auto" too)
        self.access = ""  # "ram" or "disk" once mapped
        self.layout = Layout.from_dict(layout)  # the record layout, one frozen value
        self.mode = mode
        self._closed = False  # the core's Handle says so to the core; this, to its threads
        self._info: Info | None = None  # ``info``, once the mapping's paging is known
        self._journal_live = True  # the undo journal may hold a step (voided: False)
        # the descriptors, mapping, count and marker state (``_Files``); ``count`` is the
        # count of the last commit (a step's, a flush's): what an exit flush records
        self._f = _Files(self.path)
        self._finalizer: weakref.finalize | None = None  # r+: flushes it if never closed
        self.unclean = False  # opened with unclean="accept" on an unclean stop, not flushed
        self.data: np.ndarray | None = None
        self.counters: np.ndarray | None = None  # ``data`` viewed as ints (counter_dtype)
        self._prefetcher = None  # dsa_core._inplace.readahead.Prefetcher, created on first prefetch
        # dsa_core._inplace.ranges.RangeWorker, created on the first load/release_range
        self._ranges = None
        self._undo: tuple[np.ndarray, np.ndarray] | None = None  # the journaled step's rows
        self._begun = 0  # the count a begun step started from (``abort_step``)
        self.data_name = DATA_FILE  # the file mapped (a read-only snapshot chain: its base)
        self.chain: dict[str, Any] | None = None  # a snapshot chain opened read-only: what
        self._tracker: _snapshots.Tracker | None = None  # r+: rows changed since a snapshot

    count = _handle("count")
    _fd = _handle("fd")
    _jfd = _handle("jfd")
    _lockfd = _handle("lockfd")
    _mm = _handle("mm")

    # -- opening ---------------------------------------------------------------------------
    @property
    def file(self) -> Path:
        return self.path / self.data_name

    @property
    def tracker(self) -> _snapshots.Tracker:
        """The rows changed since this writer's last snapshot (``_inplace.snapshots``)."""
        if self._tracker is None:
            self._tracker = _snapshots.Tracker(self.layout.num_rows)
        return self._tracker

    @property
    def nbytes(self) -> int:
        lay = self.layout
        return HEADER_BYTES + lay.num_rows * lay.stride * lay.dtype.itemsize

    @property
    def info(self) -> Info:
        """What it is (``_engine.Info``): a whole-table view (``data``), rows a reader sees as
        the writer changes them, paged as ``access``, no memory of its own for rows (the
        page cache holds them), any batch."""
        if self._info is None:
            self._info = Info(
                table_view=True, reads_last_flush=False, access=self.access,
                memory_bytes=None, nbytes=self.nbytes, max_batch=self.layout.num_rows,
                description="one mapped file of records",
                checks="manifest checksum, header CRC and size ok")
        return self._info

    def _lock(self) -> None:
        self._lockfd = lock_writer(self.path)

    def advise(self, access: str) -> None:
        """Tell the kernel how the mapping will be used (see :func:`check_access`)."""
        access = check_access(access)
        _RAM_STORES.discard(self)  # not counted against its own "auto" decision
        resolved = access if access != "auto" else auto_access(self.nbytes)
        if resolved == "ram":
            _RAM_STORES.add(self)
        if resolved == "ram" and hasattr(mmap, "MADV_HUGEPAGE"):
            # The table stays in the page cache: 2 MiB folios, mapped by PMD entries (one
            # TLB entry and one fault per 2 MiB instead of 512). A fault reads (or, on never
            # written space, zero-fills) its whole 2 MiB. Fewer TLB misses make the warm
            # step faster (figures: docs/notebook.md, design measurements).
            if hasattr(mmap, "MADV_NORMAL"):
                self._mm.madvise(mmap.MADV_NORMAL)
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        elif hasattr(mmap, "MADV_RANDOM"):
            # Rows are touched in random order: the default read-around would read up to
            # 32 pages per fault, nearly all of them unused: out of core that made steps
            # two orders of magnitude slower (docs/notebook.md, design measurements).
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                self._mm.madvise(mmap.MADV_NOHUGEPAGE)
            self._mm.madvise(mmap.MADV_RANDOM)
        self.access = resolved
        self._info = None  # ``info.access`` follows

    def _map(self, private: bool = False) -> None:
        """Map the file (``private``: a read-only open's copy-on-write mapping, into which an
        unclean stop's undo records are written back without changing the file)."""
        writable = self.mode == "r+"
        self._mm = mmap.mmap(self._fd, self.nbytes,
                             access=mmap.ACCESS_WRITE if writable else
                             mmap.ACCESS_COPY if private else mmap.ACCESS_READ)
        self.advise(self._access)
        lay = self.layout
        arr = np.frombuffer(self._mm, dtype=lay.dtype, count=lay.num_rows * lay.stride,
                            offset=HEADER_BYTES)
        self.data = arr.reshape(lay.num_rows, lay.stride)
        if not writable and not private:
            self.data.flags.writeable = False
        self.counters = self.data.view(counter_dtype(lay.dtype))

    @classmethod
    def create_file(cls, directory: Path, layout: dict[str, Any],
                    access: str = "auto") -> Store:
        """Create ``rows.dsa`` (zeros, space reserved), lock it and map it."""
        st = cls(directory, layout, "r+", access)
        tmp = st.path / (DATA_FILE + ".tmp")
        st._lock()
        st._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(st._fd, 0, st.nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise OSError(
                        exc.errno,
                        f"not enough disk space for the store: it needs {st.nbytes:,} bytes "
                        f"({st.nbytes / 2**30:.2f} GiB) at {str(st.path)!r}; free space or "
                        "choose another directory") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(st._fd, st.nbytes)  # filesystem without fallocate
            pwrite_all(st._fd, header_bytes(layout), 0)
            st._map()
            st.count = 0
            st._f.flushed = 0
            st._watch()
        except BaseException:
            st._release()
            tmp.unlink(missing_ok=True)
            raise
        return st

    def commit_new_file(self) -> None:
        """Make the new data file durable and give it its final name."""
        self.sync()
        os.replace(self.path / (DATA_FILE + ".tmp"), self.file)
        fsync_path(self.path)

    @classmethod
    def open_file(cls, directory: Path, layout: dict[str, Any], mode: str,
                  access: str = "auto", *, unclean: str = "refuse",
                  count: int | None = None, lockfd: int | None = None,
                  data_name: str = DATA_FILE, fd: int | None = None,
                  private: bool = False) -> Store:
        """Open an existing ``rows.dsa``, check its header and size, lock (r+) and map it.

        A store whose unclean marker is set while no writer holds it (its writer stopped
        between a step and the next flush) raises :class:`UncleanStopError` (``count``: the
        manifest's, for the message) unless ``unclean="accept"``: then it opens with
        ``unclean`` True, and, for ``r+``, the marker stays until the next flush clears it.

        ``lockfd``: the writer lock, already taken (``open_store``); a read-only open of a
        snapshot chain maps ``data_name`` (its base) with ``private`` (copy-on-write: the
        deltas are written into the mapping), or the table built in the temporary file open
        at ``fd``. The store owns ``lockfd`` and ``fd`` from the call on.
        """
        unclean = check_unclean(unclean)
        st = cls(directory, layout, mode, access)
        st.data_name = data_name
        if fd is None and not st.file.is_file():
            if lockfd is not None:
                os.close(lockfd)
            raise FileNotFoundError(
                f"store {str(st.path)!r} has a manifest but no {DATA_FILE}; the store is "
                "incomplete (an interrupted create?). Recreate it with dsa_core.create")
        if fd is not None:
            st._fd = fd
        if mode == "r+":
            try:
                st._lockfd = lockfd if lockfd is not None else lock_writer(st.path)
            except BaseException:
                st._release()
                raise
        try:
            if fd is None:
                st._fd = os.open(st.file, os.O_RDWR if mode == "r+" else os.O_RDONLY)
            head = os.pread(st._fd, HEADER_BYTES, 0)
            newer = ValueError(
                f"{str(st.file)!r} has format version "
                f"{struct.unpack('<I', head[8:12])[0] if len(head) >= 12 else '?'}; this "
                f"dsa_core reads versions 1..{FORMAT_VERSION}. Upgrade dsa_core to open it")
            try:
                version, on_disk, has_crc = parse_header(st.file, head)
            except ValueError:
                if head[:8] == MAGIC and struct.unpack("<I", head[8:12])[0] > FORMAT_VERSION:
                    raise newer from None  # a newer header: its CRC may cover other bytes
                raise
            if version > FORMAT_VERSION:
                raise newer
            if on_disk != layout:
                raise ValueError(
                    f"{str(st.file)!r} header layout {on_disk} does not match the manifest "
                    f"layout {layout}; the store is damaged or its files were mixed up")
            size = os.fstat(st._fd).st_size
            if size != st.nbytes:
                lay = st.layout
                raise ValueError(
                    f"{str(st.file)!r} is truncated or padded: it has {size:,} bytes, the "
                    f"layout needs {st.nbytes:,} ({lay.num_rows} rows x {lay.stride} x "
                    f"{lay.dtype.itemsize} B + {HEADER_BYTES} B header)")
            if not has_crc and mode == "r+":  # a header from before its CRC: add it
                pwrite_all(st._fd, header_crc(head), HEADER_CRC_OFFSET)
            marked = head[UNCLEAN_OFFSET:HEADER_BYTES] == UNCLEAN_MARK
            verdict = None
            # read-only beside a live writer: the mark is that writer's interval, no stop
            if marked and (mode == "r+" or not writer_alive(st.path)):
                lay = st.layout
                verdict = (_undo.inspect(st.path, count, lay.num_rows, lay.stride, lay.dtype)
                           if count is not None else
                           _undo.Verdict("refuse", "the manifest's count is unknown"))
                if verdict.kind == "refuse":
                    if unclean == "refuse":
                        raise UncleanStopError(_unclean_message(
                            st.path, count if count is not None else "unknown",
                            verdict.reason))
                    st.unclean = True
                    st._f.marked = mode == "r+"
                    if mode == "r+":  # the rows taken as they are: no undo goes back to them
                        _undo.discard(st.path)
                    verdict = None
            st._map(private=private or (verdict is not None and mode == "r"))
            if verdict is not None:
                st._recover(verdict)
            if count is not None:
                st.count = int(count)
                st._f.flushed = int(count)
            st._watch()
        except BaseException:
            st._release()
            raise
        return st

    def _recover(self, verdict: _undo.Verdict) -> None:
        """Put an unclean stop's rows back at the manifest's count (:func:`_undo.inspect`
        said how). A writer writes the undo records back, syncs them, clears the marker and
        empties the undo file (a kill on the way repeats the same at the next open); a
        reader writes them into its private mapping only."""
        verdict.apply(self.data)
        if self.mode != "r+":
            self.data.flags.writeable = False
            return
        self._mm.flush()
        fdatasync_fd(self._fd)
        pwrite_all(self._fd, bytes(len(UNCLEAN_MARK)), UNCLEAN_OFFSET)
        fdatasync_fd(self._fd)
        _undo.discard(self.path)

    def _watch(self) -> None:
        """Flush this store if it is never closed (r+ only): see :func:`_flush_unclosed`."""
        if self.mode == "r+":
            self._finalizer = _exit.watch(self, _flush_unclosed, self._f, os.getpid())

    # -- the unclean marker (durability="flush") ----------------------------------------
    def mark_unclean(self) -> None:
        """Make the unclean marker durable before rows change after a flush (or the open).

        Called before a step (``durability="flush"``) or a whole-record write changes rows;
        does something only on the first call after each open or flush: one 8-byte write
        into the header and one fdatasync of the data file (which has no other dirty pages
        right after a flush) per flush interval, never per step. From then on the kernel may
        write any changed row page back: a stop before the next flush is then seen by
        ``open`` (:class:`UncleanStopError`), never taken for the manifest's count.
        """
        f = self._f
        if f.marked:
            return
        if f.undo is None and _undo.ENABLED:
            f.undo = _undo.UndoLog(self.path, self.layout.num_rows,
                                   self.layout.stride * self.layout.dtype.itemsize)
        if f.undo is not None:  # the interval's undo header (page cache), then the marker
            if self._tracker is not None:  # the last interval's rows, before begin drops them
                self._tracker.absorb(f.undo)
            f.undo.begin(f.flushed if f.flushed is not None else self.count)
        try:
            pwrite_all(f.fd, UNCLEAN_MARK, UNCLEAN_OFFSET)
            fdatasync_fd(f.fd)
        except OSError as exc:  # not marked: the next change tries again
            raise OSError(exc.errno, f"setting the unclean marker of {str(self.file)!r} "
                          f"failed: {exc.strerror}; no row was changed") from exc
        f.marked = True

    def before_change(self, rows: np.ndarray) -> None:
        """Before the unique ``rows`` change (``durability="flush"``): the marker, then the
        old records of those not yet saved since the last flush (the undo file)."""
        self.mark_unclean()
        if self._f.undo is not None:
            self._f.undo.save(self.data, rows)
        elif self._tracker is not None:
            self._tracker.lose()  # no undo file: no bitmap sees the change

    def before_change_range(self, lo: int, hi: int) -> None:
        """:meth:`before_change` of the rows ``lo:hi``."""
        self.mark_unclean()
        if self._f.undo is not None:
            self._f.undo.save_range(self.data, lo, hi)
        elif self._tracker is not None:
            self._tracker.lose()

    def mark_clean(self) -> None:
        """Clear the unclean marker: the rows are synced and the manifest holds their count
        (``flush`` calls this last). Not synced itself: the next msync or write-back carries
        it, and a clear lost to a power cut only makes ``open`` refuse a clean store."""
        self._f.clear_mark()
        self.unclean = False

    # -- the undo journal (durability="step") -------------------------------------------
    def journal_write(self, rows, count_before: int) -> np.ndarray:
        """Save the records of ``rows`` as they are now, durably, before a step changes them.

        Commit protocol of one journaled step ``t = count_before + 1``:

        1. this journal (old records + ``count_before`` + crc32) is written and fdatasync'd;
        2. the kernel updates the rows in the mapping;
        3. the data file is fdatasync'd;
        4. the manifest with ``count = t`` replaces the old one atomically  <- commit point.

        On ``open``, a valid journal whose ``count_before`` equals the manifest's count
        belongs to a step that never committed: its records are written back (roll back).
        A torn journal (bad crc) means the crash came before step 2: the data is untouched.
        Returns the saved records (the in-process undo if a later stage of the step fails).
        """
        rec = np.ascontiguousarray(self.data[rows])
        ids = np.ascontiguousarray(rows, dtype=np.int64)
        crc = zlib.crc32(rec.data, zlib.crc32(ids.data))
        head = _JHEAD.pack(JOURNAL_MAGIC, int(count_before), ids.shape[0], crc)
        self._journal_live = True  # from here on it may hold this step
        if self._jfd < 0:
            self._jfd = os.open(self.path / JOURNAL_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        total = len(head) + ids.nbytes + rec.nbytes
        try:  # reserve the journal's space: a full disk fails here, before any row changes
            os.posix_fallocate(self._jfd, 0, total)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        try:  # a journal written or synced in part cannot roll back: no row changes
            pwritev_all(self._jfd, [memoryview(head), *(memoryview(a.reshape(-1).view(np.uint8))
                                                        for a in (ids, rec))], 0)
            fdatasync_fd(self._jfd)
        except OSError as exc:
            raise OSError(exc.errno, f"writing the undo journal of {str(self.path)!r} "
                          f"({total} bytes) failed: {exc.strerror}; no row was changed"
                          ) from exc
        return rec

    def journal_void(self) -> None:
        """Truncate the undo journal durably: no journal may roll back past a flush."""
        self._f.void_journal()
        self._journal_live = False

    def data_sync(self) -> None:
        """fdatasync the data file: every row written through the mapping is on disk."""
        fdatasync_fd(self._fd)

    def journal_recover(self, manifest_count: int) -> str:
        """Roll back an uncommitted journaled step; returns what was done (for messages)."""
        jpath = self.path / JOURNAL_FILE
        if not jpath.exists():
            return "none"
        raw = jpath.read_bytes()
        action = "torn"
        if len(raw) >= _JHEAD.size:
            magic, count_before, n, crc = _JHEAD.unpack_from(raw)
            k, dt = self.layout.stride, self.layout.dtype
            nbytes = n * 8 + n * k * dt.itemsize
            body = raw[_JHEAD.size:_JHEAD.size + nbytes]
            if magic == JOURNAL_MAGIC and len(body) == nbytes:
                ids = np.frombuffer(body, np.int64, n)
                rec = np.frombuffer(body, dt, offset=n * 8).reshape(n, k)
                if zlib.crc32(rec.data, zlib.crc32(ids.data)) == crc:
                    if count_before == manifest_count:
                        self.data[ids] = rec
                        self.data_sync()
                        action = "rolled back"
                    else:
                        action = "committed"
        jpath.unlink()
        fsync_path(self.path)
        return action

    # -- the engine interface (dsa_core._engine) -----------------------------------------
    def begin_step(self, rows: np.ndarray, count: int, meta: dict[str, Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The mapped rows themselves; with ``durability="step"`` their undo record first
        (:meth:`journal_write`: nothing changes if it cannot be written in full)."""
        self._undo = None
        self._begun = count
        if meta.get("durability") == "step":
            if rows.shape[0]:
                self._undo = (rows, self.journal_write(rows, count))
                if self._tracker is not None:  # no undo file sees a journaled step
                    self._tracker.mark(rows)
        elif rows.shape[0]:
            self.before_change(rows)  # marker once per interval; old records once per row
        return self.data, rows

    def commit_step(self, t: int, meta: dict[str, Any]) -> None:
        """``durability="step"``: fdatasync the rows, then the manifest with ``t`` (the
        commit point); ``"flush"``: the rows are in the mapping, durable at the next flush.

        An :class:`InDoubtError` (the manifest was renamed in, the directory's sync failed)
        is raised with the step taken: past the rename the directory reopens at ``t`` with
        its rows (or, if a power cut loses the rename, at ``t - 1``, whose journal rolls the
        rows back), so putting the rows back here would pair count ``t`` with the rows of
        ``t - 1``."""
        if meta.get("durability") == "step":
            if self._undo is not None:
                self.data_sync()
            try:
                _layout.write_manifest(self.path, self.manifest(t, meta))
            except InDoubtError:
                self._undo = None
                self.count = t
                raise
        self._undo = None
        self.count = t

    def abort_step(self) -> None:
        """Roll a journaled step back in place (``"flush"``: nothing was saved to undo);
        the count back to the begun one."""
        undo, self._undo = self._undo, None
        if undo is not None:
            self.data[undo[0]] = undo[1]
        self.count = self._begun

    def manifest(self, count: int, meta: dict[str, Any]) -> dict[str, Any]:
        """The manifest committing ``count`` with ``meta`` (hparams, durability, settings)."""
        lay = self.layout.as_dict()
        return {"format": FORMAT_NAME, "version": layout_version(lay), "layout": lay,
                "count": int(count), **meta}

    def read(self, rows: np.ndarray | slice, cols: slice | None = None, *,
             view: bool = False) -> np.ndarray:
        """A copy of the records of ids; the mapped rows themselves for a slice. ``view``:
        a writable whole-table view (``State.weights`` & co.) is handed out: rows may change
        through it where no undo file or bitmap sees them, so every later snapshot of this
        open is a full copy."""
        if view and self.mode == "r+":
            self.tracker.views = True
        return self.data[rows] if cols is None else self.data[rows, cols]

    def write(self, rows: np.ndarray | slice, records: np.ndarray) -> None:
        """A range write (restore, convert) voids the undo journal first: a journal of the
        last step could roll the rows back at the next open."""
        if isinstance(rows, slice):
            if self._journal_live:
                self.journal_void()
            self.before_change_range(rows.start, rows.stop)
        else:
            self.before_change(rows)
        self.data[rows] = records

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        run_chunked(gather_rows, (self.data, rows, self.layout.w_off, out), rows.shape[0],
                    max(16, 16384 // self.layout.dim))

    def _flush(self, count: int, meta: dict[str, Any]) -> None:
        """msync the rows, void the undo journal, then the manifest (the commit point)."""
        self._not_in_doubt()
        self.sync()
        self.journal_void()  # a stale undo record must never roll back flushed rows
        if self._f.undo is not None:
            self._f.undo.synced(count)  # a stop before the marker's clear: rows exact
        _layout.write_manifest(self.path, self.manifest(count, meta))
        self._f.flushed = self.count = int(count)
        self.mark_clean()  # rows synced, count written: no unclean stop from here

    # -- a commit of several stores together (dsa_core._group) -------------------------
    def _not_in_doubt(self) -> None:
        if self._f.prepared is not None:
            raise RuntimeError(
                f"store {str(self.path)!r} has a prepared commit (a commit of several stores "
                "together) that was neither installed nor cancelled; it cannot flush on its "
                "own. Close the process; dsa_core.open installs the commit if its group "
                "committed it")

    def prepare_commit(self, count: int, meta: dict[str, Any], *, lone: bool = False
                       ) -> dict[str, Any]:
        """msync the rows and void the undo journal; returns the manifest that would commit
        them, not yet written (the unclean marker stays until :meth:`install_commit`). A
        flush (``lone``) writes the manifest even when nothing changed."""
        self._not_in_doubt()
        self.sync()
        self.journal_void()
        if self._f.undo is not None:
            self._f.undo.synced(count)
        manifest = self.manifest(count, meta)
        self._f.prepared = manifest
        return dict(manifest)

    def install_commit(self, durable: bool = True) -> None:
        """Write the prepared manifest, then clear the unclean marker (``durable=False``:
        the manifest is not synced; :meth:`sync_commit` does it later)."""
        manifest = self._f.prepared
        _layout.write_manifest(self.path, manifest, durable)
        self._f.prepared = None
        self._f.flushed = self.count = int(manifest["count"])
        self.mark_clean()

    def cancel_commit(self) -> None:
        self._f.prepared = None

    def checkpoint(self, dest: Path, count: int, meta: dict[str, Any], *,
                   overwrite: bool, share: bool = True) -> Path:
        """Flush, then write the snapshot into a staged directory renamed into place:
        ``share=True`` a reflink of the data file where the filesystem can, else a chain on
        this writer's last snapshot (a delta of the rows changed since it) or a full copy
        (``_inplace.snapshots``); ``share=False`` a full copy that shares nothing, which no
        later snapshot builds on."""
        self._flush(count, meta)
        dest.parent.mkdir(parents=True, exist_ok=True)
        snap = {k: v for k, v in meta.items() if k != "group"}  # a snapshot is in no group
        manifest = self.manifest(count, snap)
        if not share:
            with staged_dir(dest, overwrite) as tmp:
                copy_file(self.file, tmp / DATA_FILE, share=False)
                _layout.write_manifest(tmp, manifest)
            return dest
        tracker = self.tracker
        tracker.absorb(self._f.undo)  # the rows of the interval this flush ended
        with staged_dir(dest, overwrite) as tmp:
            last = _snapshots.write(self, tracker, tmp, manifest, count)
        if last is not None:
            last.path = Path(os.path.abspath(dest))  # renamed: the same files
        tracker.taken(last)
        return dest

    def submit(self, kind: str, rows: np.ndarray | slice, wait: bool) -> None:
        """A hint: the page-cache read-ahead thread; a range or a row set: the range
        thread (``_inplace.ranges``)."""
        if kind == "hint":
            if self._prefetcher is None:
                self._prefetcher = Prefetcher(self)
            self._prefetcher.submit(rows)
            if wait:
                self._prefetcher.join()
        elif isinstance(rows, slice):
            submit_mapped(self, kind, rows.start, rows.stop, wait)
        else:
            submit_mapped_rows(self, kind, rows, wait)

    def residency(self, rows: np.ndarray) -> float:
        return mapped_residency(self, rows)

    def wait(self) -> None:
        wait_mapped(self)

    def stats(self) -> dict[str, Any]:
        """An unclean stop accepted at open (``unclean_stop``), a snapshot chain's files
        (opened read-only); else nothing beyond what ``dsa info`` reads from the State."""
        out: dict[str, Any] = {"unclean_stop": True} if self.unclean else {}
        if self.chain:
            out["snapshot_chain"] = self.chain
        return out

    def verify(self) -> list[str]:
        """Header, layout and size are checked at open; nothing more to check here."""
        return []

    # -- lifetime ----------------------------------------------------------------------------
    def sync(self) -> None:
        """msync the mapping: every row written so far is on disk when this returns."""
        if self._mm is not None and self.mode == "r+" and not self._closed:
            self._mm.flush()

    def close(self) -> None:
        """Release the writer lock; the mapping lives on until the arrays are collected."""
        if self._closed:
            return
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._ranges is not None:  # drops queued range requests, joins the thread
            self._ranges.close()
        self.sync()
        if self._f.undo is not None and not self._f.marked:
            self._f.undo.discard()  # flushed: nothing to undo
        self._closed = True
        if self.data is not None:
            self.data.flags.writeable = False
            self.counters.flags.writeable = False
        self._release()

    def abandon(self) -> None:
        """Release the store without a flush (an open that failed after the files were
        opened): the manifest keeps what it said."""
        self.close()

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer.detach()
        _RAM_STORES.discard(self)
        self._f.release()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.mode
        lay = self.layout
        return (f"Store({str(self.path)!r}, rows={lay.num_rows}, dim={lay.dim}, "
                f"dtype={lay.dtype.name}, curvature={lay.curvature}, {state})")


# -- the engine's life cycle (dsa_core._engines) ----------------------------------------------
SETTINGS = ("access",)  # the open-time settings an in-place store takes and remembers


def check_settings(layout: dict[str, Any], *, access: str, memory: Any,
                   space_ratio: Any) -> dict[str, Any]:
    """The settings of a new in-place store (``access``), refusing a log store's."""
    check_memory_arg(memory, "inplace")
    if space_ratio is not None:
        raise ValueError("space_ratio= bounds the segment files of a log store "
                         "(storage='log'); an in-place store (storage='inplace') has one file "
                         "of fixed size: drop space_ratio= or pass storage='log'")
    return {"access": access} if access != "auto" else {}


def _fill(store: Store, init: Any, init_scale: float, seed: int, ball_maxnorm: float | None,
          progress: bool | None) -> None:
    """Write the initial weights in chunks (m and v stay zero from fallocate)."""
    if init is None or store.layout.w_off is None:
        return
    lay = store.layout
    d, o = lay.dim, lay.w_off
    rows = max(1, INIT_CHUNK_BYTES // (lay.stride * lay.dtype.itemsize))
    blocks = list(chunks(lay.num_rows, rows))
    bar = progress_bar(len(blocks), progress, f"init {store.path.name}")
    named = init if isinstance(init, str) else None
    mn = ball_maxnorm
    spec = InitSpec(named, init_scale, seed, mn, d, o, lay.stride, lay.dtype) \
        if named else None
    try:
        for lo, hi in blocks:
            if named:  # the log store's function of (seed, row): the same bits
                fill_weights(store.data[lo:hi, o:o + d], lo, spec)
            else:
                store.data[lo:hi, o:o + d] = np.asarray(init[lo:hi], dtype=lay.dtype)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()




def create_store(directory: Path, layout: dict[str, Any], settings: dict[str, Any], *,
                 init: Any, init_scale: float, seed: int, ball_maxnorm: float | None,
                 meta: dict[str, Any], overwrite: bool, progress: bool | None,
                 space_ratio: None = None) -> Store:
    """A new in-place store at ``directory`` (arguments checked by ``dsa_core.create``):
    ``rows.dsa.tmp`` filled, synced and renamed, then the manifest (the commit point); on
    any error the files it made are removed."""
    existing = [p for p in (MANIFEST_FILE, DATA_FILE) if (directory / p).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"{str(directory)!r} holds a data file ({DATA_FILE}) but no {MANIFEST_FILE}: a "
            "damaged store (its manifest was deleted) that cannot be opened. Restore it from "
            "a checkpoint, or pass overwrite=True to replace it with a new store")
    directory.mkdir(parents=True, exist_ok=True)
    if existing:
        # refuse to replace a store that a writer holds: take its lock first
        probe = Store(directory, layout, "r+")
        probe._lock()
        probe._release()
        for name in (MANIFEST_FILE, DATA_FILE, JOURNAL_FILE, UNDO_FILE, *(
                n for n in os.listdir(directory) if _snapshots.is_chain_file(n))):
            (directory / name).unlink(missing_ok=True)
    store = Store.create_file(directory, layout, settings.get("access", "auto"))
    try:
        _fill(store, init, init_scale, seed, ball_maxnorm, progress)
        store.commit_new_file()
        _layout.write_manifest(directory, store.manifest(0, meta))
    except BaseException:
        store.close()
        (directory / (DATA_FILE + ".tmp")).unlink(missing_ok=True)
        (directory / DATA_FILE).unlink(missing_ok=True)
        raise
    return store


def open_store(directory: Path, mode: str, *, access: str, memory: Any,
               unclean: str) -> tuple[Store, int, dict[str, Any], dict[str, Any]]:
    """Open an in-place store: ``(store, count, meta, settings)`` of its manifest (the
    settings to remember: ``access`` if recorded or given). A journaled step that never
    committed is rolled back (r+); an unclean stop is refused (``unclean``).

    A snapshot chain (``_inplace.snapshots``) opens read-only as the table at its count; a
    writer first gives a snapshot's directory a data file of its own, under its lock
    (:func:`_snapshots.make_private`)."""
    check_memory_arg(memory, "inplace")
    manifest = read_manifest(directory)
    lockfd = lock_writer(Path(directory)) if mode == "r+" else None
    try:
        if lockfd is not None:
            manifest = _snapshots.make_private(Path(directory), manifest)
        layout = manifest["layout"]
        count = int(manifest["count"])
        meta = {"hparams": manifest["hparams"],
                "durability": manifest.get("durability", "flush")}
        if isinstance(manifest.get("group"), dict):
            meta["group"] = manifest["group"]
        settings = remembered(directory, manifest.get("settings"), "access",
                              None if access == "auto" else access)
        access = settings.get("access", "auto")
        if lockfd is None and _snapshots.chain_of(manifest) is not None:
            store = _open_chain(Path(directory), manifest, access, unclean, count)
        else:
            fd, lockfd = lockfd, None  # the store owns the lock from here
            store = Store.open_file(directory, layout, mode, access, unclean=unclean,
                                    count=count, lockfd=fd)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"manifest of {str(directory)!r} is missing a field ({exc}); "
                         "the store is damaged") from None
    finally:
        if lockfd is not None:
            os.close(lockfd)
    try:
        if mode == "r+":
            store.journal_recover(count)  # roll back a journaled step that never committed
        store.count = count
    except BaseException:
        store.abandon()
        raise
    return store, count, meta, settings


def _open_chain(directory: Path, manifest: dict[str, Any], access: str, unclean: str,
                count: int) -> Store:
    """A snapshot chain opened read-only: its files checked, then its base mapped privately
    with the deltas written into the mapping, or (changed pages beyond the memory share) the
    table built in an unlinked temporary file."""
    layout = manifest["layout"]
    base, deltas = _snapshots.load(directory, manifest)
    rec = int(layout["stride"]) * np.dtype(layout["dtype"]).itemsize
    if _snapshots.fits_private(deltas, rec):
        st = Store.open_file(directory, layout, "r", access, unclean=unclean, count=count,
                             data_name=base, private=True)
        try:
            _snapshots.apply(st.data, deltas)
        except BaseException:
            st.abandon()
            raise
        st.data.flags.writeable = False
        st.counters.flags.writeable = False
        how = "the changed pages held in memory"
    else:
        fd = _snapshots.build_temp(directory, base, deltas, layout)
        st = Store.open_file(directory, layout, "r", access, unclean=unclean, count=count,
                             fd=fd)
        how = "the table built in a temporary file (freed at close)"
    st.chain = {"base": base, "deltas": [d.path.name for d in deltas],
                "changed_rows": int(sum(d.ids.shape[0] for d in deltas)), "opened": how}
    return st


def check_files(directory: Path) -> list[tuple[str, str | None, str]]:
    """Every file of the in-place store checked on its own, without opening it (``dsa
    verify``): ``(file, problem or None, what was checked)`` for the manifest (checksum),
    the data file's header (CRC, layout against the manifest) and size, and a journal of a
    step in progress (``durability="step"``), if any."""
    out: list[tuple[str, str | None, str]] = []
    try:
        manifest = read_manifest(directory)
        layout = manifest["layout"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [(MANIFEST_FILE, str(exc), "checksum")]
    out.append((MANIFEST_FILE, None, "checksum" if manifest.get(CHECKSUM_KEY) else
                "no checksum (written before checksums: the next flush adds one)"))
    if _snapshots.chain_of(manifest) is not None:  # a snapshot chain: its base and deltas
        return out + _snapshots.check_files(directory, manifest)
    path = Path(directory) / DATA_FILE
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        _, on_disk, has_crc = parse_header(path, head)
        if on_disk != layout:
            raise ValueError(f"{str(path)!r} header layout {on_disk} does not match the "
                             f"manifest layout {layout}; the store is damaged or its files "
                             "were mixed up")
        dt = np.dtype(layout["dtype"])
        want = HEADER_BYTES + int(layout["num_rows"]) * int(layout["stride"]) * dt.itemsize
        size = os.stat(path).st_size
        if size != want:
            raise ValueError(f"{str(path)!r} is truncated or padded: it has {size:,} bytes, "
                             f"the layout needs {want:,}")
        out.append((DATA_FILE, None, "header " + ("CRC, " if has_crc else "(no CRC: "
                    "written before header CRCs; a writer's open adds one), ") +
                    "layout and size (its rows carry no checksums)"))
    except (OSError, ValueError) as exc:
        out.append((DATA_FILE, str(exc), "header and size"))
    jpath = Path(directory) / JOURNAL_FILE
    if jpath.exists():
        out.append((JOURNAL_FILE, None, "the undo record of a step in progress (a writer's "
                    "open rolls it back if it checks out, else the step never began)"))
    return out


def warmup() -> None:
    """Compile the engine's own kernels (``dsa_core.warmup``): the undo file's."""
    _undo.warmup()


def check_batch(layout: dict[str, Any], memory_bytes: int, rows: int) -> None:
    """Nothing: an in-place store steps any batch of its rows (``info.max_batch`` is the
    table's rows), so no budget refuses one."""


def owns_file(name: str) -> bool:
    """One of an in-place store's own files (the data file, the journal, the undo file, a
    snapshot chain's base and deltas). Not the data file's temporary: alone, it is what an
    interrupted ``create`` leaves, which the next ``create`` replaces."""
    return name in (DATA_FILE, JOURNAL_FILE, UNDO_FILE) or _snapshots.is_chain_file(name)


def read_group_ref(directory: Path) -> dict[str, Any] | None:
    """The commit group an in-place store's manifest names, or None."""
    ref = read_manifest(directory).get("group")
    return ref if isinstance(ref, dict) else None


def roll_forward(directory: Path, payload: dict[str, Any]) -> None:
    """Install the manifest a group committed for this store (``dsa_core._group``): its rows
    were synced before the group's commit point, so the unclean marker goes too. Under the
    writer lock."""
    fd = lock_writer(directory)
    try:
        _layout.write_manifest(directory, payload)
        dfd = os.open(directory / DATA_FILE, os.O_RDWR)
        try:
            pwrite_all(dfd, bytes(len(UNCLEAN_MARK)), UNCLEAN_OFFSET)
            fdatasync_fd(dfd)
        finally:
            os.close(dfd)
        _undo.discard(directory)  # the group's rows are synced: nothing to undo
    finally:
        os.close(fd)


def remove_store(directory: Path) -> None:
    """Delete an in-place store's directory (refused while a writer holds it). A snapshot
    chain's files are hard links: the other snapshots keep theirs."""
    manifest = read_manifest(directory)
    if _snapshots.chain_of(manifest) is not None:
        fd = lock_writer(Path(directory))
        try:
            shutil.rmtree(directory)
        finally:
            os.close(fd)
        return
    st = Store.open_file(directory, manifest["layout"], "r+", unclean="accept")
    st.close()
    shutil.rmtree(directory)
