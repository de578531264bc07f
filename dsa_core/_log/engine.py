"""The engine of a log-structured store: records in immutable segments, a region in memory.

The in-place store (``_inplace``) updates each row where it lies in one big mapped file: once
the dirty rows exceed the kernel's write-back budget, or the table exceeds RAM, every
updated row costs a random read and later a random 4 KiB write-back. This engine keeps the
same records (``_layout``: ``[w | m | v | counters]``) but never overwrites one on disk:

* updates happen in place in an in-memory **region** of ``S`` record slots (``pool``);
* a slot leaving the region while dirty is appended, with many others, to a new immutable
  **segment** file in one sequential write, a *seal* (``commit``; written in the background
  by ``writer``; the live segments are ``segments``');
* an **index** maps each row to the newest record of it in a segment (or to nothing: the
  row then reads as its deterministic initial record, ``_init``);
* a **cleaner** (``cleaner``) copies the still-live records of the emptiest segments, read
  in the background, into the next seals so that the segments hold about ``space_ratio``
  times the live records (at most that plus a slack);
* a **flush** seals every dirty slot, fsyncs the new segments, writes a new index generation
  and commits a new manifest (``commit``; ``format`` describes the files); ``durability=
  "step"`` stores also append every step to a commit log (``wal``);
* an **open** returns the state of the last flush plus the commit log's steps
  (``recovery``).

:class:`LogStore` composes those components and is the only thing callers see: it
implements the ``Engine`` protocol (``dsa_core._engine``) directly on them, with no layer
between. ``dsa_core.step`` coalesces a batch's ids; :meth:`LogStore.begin_step` acquires
their slots (:meth:`LogStore.acquire`) and hands out the region (``pool.Pool.region``); the
kernels run on it with the slots in place of the row ids; :meth:`LogStore.commit_step` sets
the count. ``gather``/export use :meth:`LogStore.read`.

Memory budget
    ``memory_bytes`` is everything the store keeps in memory (``budget``): the index (8 bytes
    per row), the write buffers of the background seals, the cleaning reads' buffers and a
    seal's staging (all sized from the seal unit, and given to the writer and the cleaner
    from the same ``budget`` functions),
    and the region's ``S`` slots with what is left. A batch of ``M`` rows needs ``S >= M``:
    :func:`check_memory` (called by :func:`create` and :func:`open` with ``max_batch``, and
    by every :meth:`LogStore.acquire`) names the budget that would hold it.
Durability
    Only :meth:`LogStore.flush` (and :meth:`LogStore.checkpoint`, :meth:`LogStore.close`)
    make anything durable, and every committed step of a store with a commit log: unlike the
    in-place store, whose mapped pages reach the file even without a flush, updates since
    the last flush live in the region only. After ``kill -9`` at any moment :func:`open`
    returns exactly the state of the last completed flush plus the logged steps.
Deterministic init
    A never-written row reads as ``_init.initial_records``: a pure function of
    ``(seed, row)``, the same bits on every machine, and the values the in-place store
    writes at create for the same arguments.
Concurrency
    The engine's state changes in the caller's thread only: seals and cleaning decisions run
    inside :meth:`LogStore.acquire`, :meth:`LogStore.release` and :meth:`LogStore.flush`.
    Four kinds of background threads only do I/O on buffers and files the engine hands them:
    the segment writer (``writer``: writes sealed segments; a segment is readable from its
    buffer until written), the cleaning reads (``read.CleaningReads``: read the live records
    of the next seals' victims into buffers), the range loads (``ranges.Loader``: read a
    loaded range's or row set's records into staging buffers, which :meth:`LogStore.acquire`
    and the range calls install in the caller's thread) and the read-ahead of
    future batches (``read.ReadAhead``: hints only). A flush waits for every pending write before it
    commits. One writer per store (an exclusive ``flock`` on ``writer.lock`` in
    ``mode="r+"``); readers (``mode="r"``) map the files of the manifest they read and never
    write.
"""

from __future__ import annotations

import mmap
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from .. import _exit
from .._engine import Info, closed_error, no_view_error, scratch
from .._files import CHECKSUM_KEY, ForkedReadError
from .._init import InitSpec
from .._layout import Layout
from .budget import (
    SLOT_OVERHEAD,
    check_memory,
    check_memory_bytes,
    default_memory,
    memory_for,
    seal_unit_for,
    slots_for,
)
from .budget import split as split_budget
from .checks import check_count, check_init_settings, check_layout, check_meta
from .cleaner import Cleaner
from .commit import Commit
from .sums import head_bytes
from .format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FILE,
    Segment,
    SegmentError,
    parse_name,
    read_manifest,
    segment_geometry,
    unmap_pending,
    write_manifest,
)
from .pool import Pool, gather_records
from .ranges import Job, Loader, loader_for, plan_job
from .recovery import install_log, load, lock, log_entries, remove_garbage, replay_log, verify
from .read import ReadAhead
from .segments import Segments

__all__ = ["SLOT_OVERHEAD", "ForkGuard", "ForkedReadError", "LogStore", "check_memory",
           "create", "gather_records", "memory_for", "open", "remove", "slots_for"]


class ForkGuard:
    """What a process forked from a log store's writer checks before and after each read.

    A log store's current rows live in the writer's memory region (and its index of the
    segments); a forked child (a data-loader worker) holds a copy of both as of the fork. An
    in-place store has no such problem (its rows are a shared mapping of the file).
    ``version`` is an 8-byte counter in a shared anonymous mapping (``mmap(-1, 8)`` is
    ``MAP_SHARED | MAP_ANONYMOUS``: the child and the parent see one counter), bumped by the
    writer whenever rows are about to change (:meth:`bump`: every step, write, restore) and
    before a dead segment file is overwritten (a child's index may still point into it).
    ``seen`` is each process's own copy: in the writer always equal to ``version``, in a
    child the value at the fork. They differ only in a child whose parent changed the store
    since the fork, whose reads then raise :class:`ForkedReadError` (:meth:`check`); a child
    whose parent changed nothing (evaluation workers forked after training) reads.

    Cost to the writer: a bump is one add and one 8-byte store into a page that stays
    resident, once per step (twice for a logged step), against the step's own work of
    microseconds at least; a read compares two integers (the process id is asked only on a
    mismatch). Nothing is written to disk.
    """

    __slots__ = ("version", "seen", "pid")

    def __init__(self) -> None:
        self.version = memoryview(mmap.mmap(-1, 8)).cast("q")
        self.seen = 0
        self.pid = os.getpid()

    def bump(self) -> None:
        self.seen = self.version[0] = self.version[0] + 1

    def check(self, path: Path) -> None:
        v = self.version[0]
        if v == self.seen:
            return
        if os.getpid() == self.pid:  # the writer: a forked child bumped (its own copy's)
            self.seen = v
            return
        raise ForkedReadError(
            f"log store {str(path)!r}: this process (pid {os.getpid()}) was forked from the "
            f"process that opened it for writing (pid {self.pid}), which has changed rows "
            "(or, sealing rows changed before the fork, rewritten a segment file) since the "
            "fork. A log store's current rows live in the memory region of the training "
            "process, which a forked process (a DataLoader worker, say) cannot see: it holds "
            "a copy as of the fork, and reading it would return older rows. Workers forked "
            "right after a dsa_core.flush read until the training process changes rows. "
            "Read rows in the training process (pass workers ids "
            "only, and gather in the main process), or dsa_core.flush(state) and open the "
            "store with mode='r' in the worker (it reads the last flush), or use "
            "storage='inplace' for a table that fits in memory (its mapping is shared with "
            "forked processes)")

_STATS = ("seals", "cleaned_segments", "user_records", "sealed_records", "cleaned_records",
          "file_bytes_written", "acquires", "misses", "evicted_clean", "range_loads",
          "range_records", "range_rereads", "range_pins_dropped", "row_loads", "index_rebases")



def _flush_unclosed(parts: dict[str, Any], pid: int) -> None:
    """Flush a log store that was never closed: when its last ``State`` is garbage-collected,
    or when the interpreter exits normally (``weakref.finalize`` runs at exit too).

    ``parts`` is the store's ``__dict__`` (its components and its ``_closed`` flag and lock,
    not the store itself, which the finalizer must not keep alive): the flush runs on a
    :class:`LogStore` shell over them (:meth:`LogStore._watch`).

    An in-place store's rows reach its file through the shared mapping even when the
    program never calls ``close``; a log store's steps since the last flush live only in
    its memory region. Python flushes open files that are dropped or left open at exit; so
    does this, so that forgetting ``close`` does not silently lose training. (After
    ``kill -9`` or ``os._exit`` nothing runs: the store reopens at its last flush.)

    Only in the process that opened the store: a forked child (a data-loader worker, say)
    holds a copy of the region and must never write the parent's store. At exit it runs
    before Python shuts its thread pools down (``_exit``: a cleaning read still works); a
    failure is printed to stderr and makes the exit status non-zero.

    A store whose directory was deleted since it was opened (a ``TemporaryDirectory``
    left without ``close``; ``_exit.store_gone``) has nothing to save: it is let go
    without a flush and without a word -- a flush would write a partial store into an empty
    directory made at the same path since. If only its lock file was removed, or the
    directory was replaced by another holding a manifest, it is not flushed into whatever
    is there now, and that is reported as a failure.
    """
    if os.getpid() != pid:
        return
    store = LogStore.__new__(LogStore)
    store.__dict__ = parts
    try:
        if store._closed:
            return
        gone = _exit.store_gone(store.path, store._lockfd, MANIFEST_FILE)
        if gone == "removed":
            store._shut(flush=False)  # the user deleted the store: nothing to lose
            return
        if gone == "replaced":
            store._shut(flush=False)
            raise FileNotFoundError(
                f"the writer lock file this store held was deleted since it was opened, and "
                f"{str(store.path)!r} now holds a manifest.json: another store (or this one "
                "with its writer.lock removed). Not flushing into it. Close stores before "
                "deleting or replacing their directories")
        store._shut(flush=True)  # flushes, then releases the writer lock
    except Exception as exc:  # nowhere to raise to: say so
        if not store._closed and _exit.store_gone(store.path, store._lockfd,
                                                 MANIFEST_FILE) == "removed":
            store._shut(flush=False)  # deleted while it flushed: nothing to lose either
            return
        _exit.report(f"dsa_core: flushing unclosed log store {str(store.path)!r} failed, "
                     f"its steps since the last flush are lost: {exc!r}")


class LogStore:
    """An open log-structured store (``_engine.Engine``): the region, the index, the mapped
    segments.

    Obtain one with :func:`create` or :func:`open` (or ``dsa_core.create``/``open`` through
    ``_log.store``). Shared by every ``State`` derived from one ``create``/``open``.
    ``count`` is that of its last commit (the one the next seal and flush record); ``layout``
    the record layout (one frozen ``_layout.Layout``); ``slots`` (S), ``seal_unit``,
    ``mode``, ``memory_bytes`` (and ``info``, what it is as data: ``_engine.Info``).

    The work is done by its components, each holding the state it owns and references to
    the components it uses: ``_pool`` (``pool.Pool``: ``region`` (S, stride) records that
    :meth:`acquire`'s slots index, ``loc``, slots, CLOCK), ``_segments``
    (``segments.Segments``: the live segments and their background writes), ``_cleaner``
    (``cleaner.Cleaner``), ``_commit`` (``commit.Commit``: ``count``, ``meta`` committed
    with every flush, seals, flushes, checkpoints, the commit log); opening and checking are
    ``recovery``'s. This class holds the guards, the range loads (``ranges``) and the
    read-ahead (``read.ReadAhead``: it only hints the kernel to read the next batch's
    on-disk records, so it can never change a value), and implements the protocol on the
    components directly.
    """

    kind = "log"

    def __init__(self, directory: Path, manifest: dict[str, Any], mode: str,
                 memory_bytes: int | None, lockfd: int):
        self.path = Path(directory)
        self.mode = mode
        self._closed = False
        self._lockfd = lockfd
        lay = dict(manifest["layout"])
        self.layout = Layout.from_dict(lay)  # the record layout, one frozen value
        stride = int(lay["stride"])
        dtype = np.dtype(lay["dtype"])
        self.rec_bytes = stride * dtype.itemsize
        self.space_ratio = float(manifest["space_ratio"])
        mn = manifest["ball_maxnorm"]
        self.init = InitSpec(str(manifest["init"]), float(manifest["init_scale"]),
                             int(manifest["seed"]), None if mn is None else float(mn),
                             int(lay["dim"]), lay["w"], stride, dtype)
        S = self.slots = 0 if memory_bytes is None else slots_for(lay, memory_bytes)
        self.seal_unit = seal_unit_for(S, self.rec_bytes)
        self._stats = dict.fromkeys(_STATS, 0)
        self._segments = Segments(self.path, stride, dtype, self.seal_unit,
                                  int(manifest["next_segment"]),
                                  head_bytes(lay["w"], int(lay["dim"]), dtype.itemsize),
                                  int(lay["num_rows"]))
        self._pool = Pool(self.path, lay, S, self.seal_unit, memory_bytes, self.init,
                          self._segments, self._stats)
        self._cleaner = Cleaner(self._pool, self._segments, self.space_ratio)
        self._commit = Commit(self.path, manifest, self._pool, self._segments, self._cleaner,
                              self._stats)
        # range loads (``ranges``): the loads in flight, this process's loader thread, the
        # first error one met (raised once by the next range call), the largest batch
        self._jobs: dict[int, Job] = {}
        self._loader: Loader | None = None
        self._job_seq = 0
        self._load_error: BaseException | None = None
        self._max_batch = 0
        # readers forked from this writer: a shared version (``ForkGuard``) that rows
        # changes and segment-file reuse bump, and reads check
        self._fork = ForkGuard() if mode == "r+" else None
        self._segments.on_recycle = None if self._fork is None else self._fork.bump
        # the step protocol's: a logged step's copy of its records, the step itself, the
        # count a begun step started from (``abort_step``); the read-ahead thread; what
        # cancel_commit puts back; the budget remembered ("memory"), if any
        self._scratch: dict[str, np.ndarray] = {}
        self._step: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._begun = 0
        self._readahead: ReadAhead | None = None
        self._hint_next: np.ndarray | None = None  # rows whose index pages were hinted
        self._meta_before: tuple | None = None
        self._memory_setting: int | None = None
        self._info: Info | None = None  # ``info``, for the budget it was made for

    def _watch(self) -> None:
        """Flush this store if it is dropped unclosed, or left open at exit
        (:func:`_flush_unclosed`; ``_log.store`` calls it once an open succeeded)."""
        if self.mode == "r+":
            _exit.watch(self, _flush_unclosed, self.__dict__, os.getpid())

    # -- the store's state -----------------------------------------------------------------
    @property
    def count(self) -> int:
        """The step count that seals record and flush commits (the commit protocol's)."""
        return self._commit.count

    @property
    def memory_bytes(self) -> int | None:
        """The region's budget in bytes (None for a read-only open)."""
        return self._pool.memory_bytes

    @property
    def nbytes(self) -> int:
        lay = self.layout
        return lay.num_rows * lay.stride * lay.dtype.itemsize

    @property
    def info(self) -> Info:
        """What it is (``_engine.Info``): no whole table (records live in a region and in
        segments), a reader opens the files of the writer's last flush, no mapping to page
        (the region is the memory: ``access="log"``), a batch at most the slots its budget
        pays for (``budget.slots_for``: 0 without a budget, a read-only open)."""
        m = self._pool.memory_bytes
        if self._info is None or self._info.memory_bytes != m:
            self._info = Info(
                table_view=False, reads_last_flush=True, access="log", memory_bytes=m,
                nbytes=self.nbytes, max_batch=slots_for(self.layout.as_dict(), m or 0),
                description="log-structured, storage='log'",
                checks="manifest checksum, segment and index CRCs checked, every record's "
                "checksum")
        return self._info

    def no_view(self, what: str):
        raise no_view_error(self, what)

    @property
    def data(self):
        self.no_view("state.store.data")

    @property
    def counters(self):
        self.no_view("state.store.counters")

    # -- guards ---------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self._closed:
            raise closed_error(self)

    def _require_writable(self) -> None:
        self._require_open()
        if self.mode != "r+":
            raise ValueError(f"log store {str(self.path)!r} was opened read-only (mode='r'); "
                             "open it with mode='r+' to change it")

    def _changed(self) -> None:
        """Rows are about to change (a step, a write, a restore): see :class:`ForkGuard`."""
        if self._fork is not None:
            self._fork.bump()

    def _check_fork(self) -> None:
        """Refuse a read in a process forked from this writer after it changed the store."""
        if self._fork is not None:
            self._fork.check(self.path)

    # -- a step (dsa_core._step) -------------------------------------------------------------
    def begin_step(self, rows: np.ndarray, count: int, meta: dict[str, Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Region slots for ``rows``. With ``durability="step"`` (the commit log) a copy of
        the slots' records instead: the region takes the new records only once the step's
        log entry is durable (:meth:`commit_step`), so a failed step changes nothing.

        A logged step first prepares to log step ``count + 1``: unless the commit log can
        take it (``commit.Commit.step_ready``), ``wal_on`` is turned on and the store
        flushed at ``count`` with ``meta`` (which starts a fresh commit-log generation).
        Nothing of the step has changed yet, so an error there (a failed flush) leaves the
        caller at ``count``."""
        self._step = None
        self._begun = count
        if meta.get("durability") == "step":
            self._require_writable()
            self._commit.begin_step(count, meta)
            n = rows.shape[0]
            slots = self.acquire(rows, check=False) if n else np.empty(0, np.int64)
            lay = self.layout
            k = lay.stride
            rec = scratch(self._scratch, "logged_records", n * k, lay.dtype).reshape(n, k)
            if n:
                gather_records(self._pool.region, slots, rec)
            self._step = (rows, slots, rec)
            return rec, np.arange(n, dtype=np.int64)
        if rows.shape[0]:
            return self._pool.region, self.acquire(rows, check=False)
        return self._pool.region, rows

    def commit_step(self, t: int, meta: dict[str, Any]) -> None:
        """Commit step ``t``. A logged step: append ``(rows, records)`` to the commit log
        (one write, one fdatasync), then copy the records into ``region[slots]`` and set
        ``count = t``; on any error (the log's write or sync) the region is left as it was
        and the log marked broken: the next :meth:`begin_step` flushes (a new generation),
        so the failed step is never replayed. Otherwise: the count only."""
        step, self._step = self._step, None
        if step is not None:
            self._require_writable()
            self._changed()
            self._commit.commit_step(t, *step)
        else:
            self._commit.count = int(t)

    def abort_step(self) -> None:
        """Nothing to undo but the count: a logged step changed only its copy, an unlogged
        one the region (durable at the next flush, as in place)."""
        self._step = None
        self._commit.count = self._begun

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """The weights of ``rows`` into ``out`` (:meth:`read` of the weight columns). Never
        changes the region's residency."""
        lay = self.layout
        o = lay.w_off
        self._require_open()
        self._check_fork()
        got = self._pool.read(rows, slice(o, o + lay.dim))
        self._check_fork()  # the rows read were the store's rows until now
        out[...] = got

    def residency(self, rows: np.ndarray) -> float:
        """The fraction of ``rows`` resident in the region."""
        return self._pool.residency(rows)


    # -- reading ----------------------------------------------------------------------------
    def readahead(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Segment]]:
        """Where the on-disk records of ``rows`` (checked ids) lie, for read-ahead.

        Returns ``(addresses, sums, segments)``: the mapped address of the newest record of
        each row that is neither resident nor never written, the mapped addresses of those
        records' sums that lie in a file (a read record is checked against its sum), and
        the segments they lie in (hold
        them while the hint runs: their mappings stay valid). A hint only (``read``): a row
        that moves or becomes resident afterwards is still read correctly.
        """
        self._require_open()
        return self._pool.readahead(rows)

    def read(self, rows: Any, cols: slice | None = None, *, view: bool = False) -> np.ndarray:
        """A copy of the records of ``rows``: shape ``(len(rows), stride)``, store dtype.

        Any rows (or a ``slice(lo, hi)`` of them), duplicates allowed. Resident rows come
        from the region, others from their segment's mapping or, never written, as their
        initial record. Residency is not
        changed (for gather and export). ``cols``: a ``slice`` of record columns to copy
        (e.g. the weights ``slice(w, w + dim)`` for gather); the result then has that many
        columns. ``view``: there is no whole-table view to hand out (:meth:`no_view`).
        """
        if view:
            self.no_view("a whole-table view")
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        self._require_open()
        self._check_fork()
        out = self._pool.read(rows, cols)
        self._check_fork()  # the rows read were the store's rows until now
        return out

    # -- acquiring ----------------------------------------------------------------------------
    def acquire(self, rows: Any, *, load: bool = True, check: bool = True) -> np.ndarray:
        """Make ``rows`` resident and dirty; returns their slots (``region[slots[i]]`` is the
        record of ``rows[i]``, to be updated in place by the caller).

        Parameters
        ----------
        rows : 1-D int array
            Unique row ids (any order), at most ``slots`` of them.
        load : bool, default True
            ``False`` leaves the records of rows that were not resident undefined: for a
            caller that overwrites them whole (:meth:`write`).
        check : bool, default True
            ``False`` skips the range and uniqueness checks (the caller guarantees them,
            e.g. ``step`` after coalescing). The batch size is always checked.

        Misses are read from their segment (or initialised); making room may evict and seal
        other rows, never one of ``rows``. The returned array is the caller's.
        """
        self._require_writable()
        self._changed()
        if self._jobs:
            self._wait_loads_of(rows)
        try:
            self._max_batch = max(self._max_batch, len(rows))
        except TypeError:  # not a sequence: the pool's check says so
            pass
        return self._pool.acquire(rows, self._commit.make_room, load=load, check=check)

    def write(self, rows: Any, records: Any) -> None:
        """Overwrite the whole records of ``rows`` (unique ids, or a ``slice(lo, hi)``) with
        ``records``.

        ``records``: shape ``(len(rows), stride)`` in the store dtype. Checked before anything
        changes; goes through :meth:`acquire` in chunks of at most ``slots`` rows, without
        reading the old records. Durable at the next flush.
        """
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        if isinstance(records, np.ndarray):
            records = np.ascontiguousarray(records)
        self._require_writable()
        self._install_loaded()
        self._changed()
        self._pool.write(rows, records, self._commit.make_room)

    def release(self, rows: Any) -> int:
        """Write the resident records of ``rows`` out and make their slots free.

        The dirty ones are sealed together, in row order, in segments of a seal unit (so that a
        later read of the same rows is one sequential read), the clean ones just leave the
        region. For a caller that is done with a range of rows for a while (the bucket
        order's partitions): nothing changes but residency. Returns the rows released.
        """
        self._require_writable()
        return self._pool.release(rows, self._commit.seal_all)

    # -- range loads (``ranges``) ------------------------------------------------------------
    def load_range(self, start: int, stop: int) -> None:
        """Bring the rows ``[start, stop)`` into the region and keep them there until
        :meth:`release_range`.

        From now on the range's resident rows are pinned (CLOCK never evicts them); its
        other rows' records are read in the background, sequentially (``ranges``), and put
        into the region, clean and pinned, at the next :meth:`acquire`, :meth:`write`,
        range call or :meth:`wait`. An :meth:`acquire` that misses rows of a range
        still loading waits for that load first (one sequential read instead of random
        ones). No value changes: a row resident before its record arrives (maybe dirty) is
        kept as it is, one that moved meanwhile is read again from where it lies.

        Raises ``ValueError``, changing nothing, unless the rows of the active ranges and row
        sets (:meth:`load_rows`) and this one -- their union --, plus the largest batch
        stepped since this open (at least 1; rows written with :meth:`write` do not count),
        fit in the region; and first the error of an
        earlier load that failed, once. A larger batch stepped later still steps: the pins
        yield to it (``range_pins_dropped`` counts that).
        """
        self._require_writable()
        self._install_loaded()
        self._raise_load_error()
        pool = self._pool
        self._check_pins(f"load_range({start}, {stop})", "this one", pool.pinned_with(start, stop))
        pool.pin_range(start, stop)
        self._stats["range_loads"] += 1
        self._submit_job(start, stop)

    def load_rows(self, rows: np.ndarray) -> None:
        """Bring the sorted unique ``rows`` (checked ids, at least one) into the region and
        keep them there until :meth:`release_rows`: :meth:`load_range` for a row set.

        The set is *active* from now on, beside the ranges (``Pool.row_sets``): its resident
        rows are pinned, its other rows' records are read in the background from where they
        lie (per segment in file order; scattered records at queue depth) and installed,
        clean and pinned, as a range's are. Refused as :meth:`load_range` (``ValueError``,
        nothing changed) unless the union of the active ranges, the active row sets and
        these rows, plus the largest batch stepped since this open, fits in the region.
        """
        self._require_writable()
        self._install_loaded()
        self._raise_load_error()
        pool = self._pool
        n = rows.shape[0]
        self._check_pins(f"load_rows of {n:,} rows", "these rows", pool.pinned_with(rows=rows))
        pool.pin_rows(rows)
        self._stats["row_loads"] += 1
        self._submit_job(int(rows[0]), int(rows[-1]) + 1, rows)

    def _check_pins(self, what: str, this: str, pinned: int) -> None:
        """Refuse a load whose ``pinned`` rows (the union of what stays loaded with it) and
        the largest batch do not fit in the region (a ``ValueError`` that says what to set);
        nothing has changed yet."""
        room = max(self._max_batch, 1)
        if pinned + room > self.slots:
            need = memory_for(self.layout.as_dict(), pinned + room)
            raise ValueError(
                f"log store {str(self.path)!r}: {what} cannot keep its rows in the memory "
                f"region: the loaded ranges and row sets not yet released and {this} "
                f"cover {pinned} rows and a step needs room for {room} more (the largest "
                f"batch stepped since the store was opened), {pinned + room} in all, but "
                f"the region holds {self.slots} rows (memory={self.memory_bytes} bytes). "
                f"Nothing was changed. Release a range or row set first "
                f"(dsa_core.release_range, dsa_core.release_rows), load fewer rows, or "
                f"reopen the store with memory={need} or more (dsa_core.region_memory(state, "
                f"{pinned + room})); for partition-ordered training dsa_core.buckets.fit "
                "chooses P and c that fit")

    def _submit_job(self, start: int, stop: int, rows: np.ndarray | None = None) -> None:
        """Plan the reads of a load just made active and queue them on the loader."""
        self._job_seq += 1
        job = plan_job(self._job_seq, start, stop, self._pool, self._segments, self.init,
                       self._records_offset, rows)
        if job.files or job.ready or job.fresh is not None:
            if self._loader is None or self._loader.pid != os.getpid():
                self._jobs.clear()  # a forked child: its parent's loads are not its own
            lay = self.layout
            self._loader = loader_for(self._loader, lay.stride, lay.dtype, self.init)
            self._jobs[job.id] = job
            self._loader.submit(job)

    def release_range(self, start: int, stop: int) -> int:
        """End the load of ``[start, stop)`` (the equal active range, else every active
        range inside it) and :meth:`release` its rows that no other active range holds:
        unpinned, the dirty ones sealed in row order, their slots freed; rows of an active row
        set stay. A load of it still in flight stops; what it read is not installed. Returns
        the rows released."""
        self._require_writable()
        self._install_loaded()
        self._raise_load_error()
        for job in self._jobs.values():
            if job.rows is None and start <= job.start and job.stop <= stop:
                job.cancelled = True
        pool = self._pool
        pool.unpin_range(start, stop)
        rows = np.arange(start, stop, dtype=np.int64)
        if pool.loads_active:
            rows = rows[~pool.in_ranges(rows)]
        return pool.release(rows, self._commit.seal_all)

    def release_rows(self, rows: np.ndarray) -> int:
        """End the load of the sorted unique ``rows`` (the equal active row set, else every
        active row set inside them) and :meth:`release` those of them that no active range
        or row set still holds: unpinned, the dirty ones sealed together in row order,
        their slots freed. A load of an ended set still in flight stops. Returns the rows
        released."""
        self._require_writable()
        self._install_loaded()
        self._raise_load_error()
        pool = self._pool
        ended = pool.unpin_rows(rows)
        for job in self._jobs.values():
            if job.rows is not None and any(job.rows is r for r in ended):
                job.cancelled = True
        if pool.loads_active:
            rows = rows[~pool.in_ranges(rows)]
        return pool.release(rows, self._commit.seal_all)

    def _records_offset(self, seg: Segment) -> int:
        return segment_geometry(seg.n, self.layout.stride, self.layout.dtype.itemsize)[2]

    def _raise_load_error(self) -> None:
        err, self._load_error = self._load_error, None
        if err is not None:
            raise err

    def _wait_loads_of(self, rows: Any) -> None:
        """Install what the loads have read; if ``rows`` miss rows of a range still loading,
        wait for that load (and install it) first."""
        self._install_loaded()
        if not self._jobs:
            return
        r = np.asarray(rows)
        if r.dtype.kind not in "iu" or r.ndim != 1:
            return  # the pool's check says what is wrong
        r = r[(r >= 0) & (r < self.layout.num_rows)]
        miss = r[~self._pool.resident(r)]
        if not miss.shape[0]:
            return
        waits = {j.id for j in self._jobs.values() if not j.cancelled and j.covers(miss).any()}
        if waits:
            self._install_loaded(wait_for=waits)

    def _install_loaded(self, wait_for: set[int] | None = None) -> None:
        """Install the chunks the loader has read (``Pool.install_loaded``); with
        ``wait_for``, wait until those jobs are done. An install that fails (making room
        for it failed, a record read again was damaged) is kept for the next range call:
        a load never makes a step fail."""
        ld = self._loader
        if not self._jobs or ld is None or ld.pid != os.getpid():
            return
        while True:
            items = ld.poll()
            if not items:
                if not wait_for or not (wait_for & self._jobs.keys()):
                    return
                items = [ld.get()]
            for jid, rows, locs, rec in items:
                if rows is None:  # the job's end (rec: its error, or None)
                    self._jobs.pop(jid, None)
                    if rec is not None and self._load_error is None:
                        self._load_error = rec
                    continue
                try:
                    self._pool.install_loaded(rows, locs, rec, self._commit.make_room)
                except Exception as exc:
                    if self._load_error is None:
                        self._load_error = exc
                finally:
                    ld.done_with()

    def _stop_loader(self) -> None:
        ld, self._loader = self._loader, None
        self._jobs.clear()
        if ld is not None and ld.pid == os.getpid():
            ld.close()


    # -- hints and range loads (dsa_core.prefetch, load_range, load_rows) --------------------
    def submit(self, kind: str, rows: np.ndarray | slice, wait: bool) -> None:
        """A hint: the on-disk records of ``rows`` (checked ids) read ahead, in the
        background; a range (:meth:`_submit_range`) or a row set (:meth:`_submit_rows`)."""
        if kind == "hint":
            self._read_ahead(np.unique(rows), wait)
        elif isinstance(rows, slice):
            self._submit_range(kind, rows.start, rows.stop, wait)
        else:
            self._submit_rows(kind, rows, wait)

    def _read_ahead(self, rows: np.ndarray, wait: bool) -> None:
        """A hint of unique ``rows`` on this process's read-ahead thread.

        With a mapped index (``index``) a record's location is known only once its row's
        index page is read: looking the rows up now would fault those pages in one at a
        time, on the caller's thread. So the rows' index pages are hinted now (queued, not
        waited for) and the rows kept; their records are looked up and hinted at the next
        hint (the batch after: ``prefetched`` hints a batch ahead, so the pages have a
        step's time to arrive), at :meth:`wait`, or with ``wait``."""
        ra = self._readahead
        if ra is None or ra.pid != os.getpid():  # none yet, or the parent's (fork)
            ra = self._readahead = ReadAhead(self._segments.rec_pitch)
            self._hint_next = None
        ahead, self._hint_next = self._hint_next, None
        if ahead is not None:
            self._hint_records(ra, ahead)
        if self._pool.index.mapped and not wait:
            away = rows[~self._pool.resident(rows)]
            self._pool.index.hint(away)
            self._hint_next = away
            return
        self._hint_records(ra, rows)
        if wait:
            ra.join()

    def _hint_records(self, ra: ReadAhead, rows: np.ndarray) -> None:
        """The on-disk records of ``rows`` read ahead on ``ra``'s thread."""
        addrs, sums, keep = self.readahead(rows)
        ra.submit(addrs, keep, sums)

    def _submit_range(self, kind: str, start: int, stop: int, wait: bool) -> None:
        """A load (:meth:`load_range`) pins the range's rows in the region and reads its
        on-disk records sequentially on the store's range-load thread; they are installed
        at the next step, range call or wait. A release (:meth:`release_range`) unpins them,
        seals the range's dirty records in row order and frees its slots, at once (the
        caller's thread). A read-only open has no region to load into: a load only reads
        the records ahead into the page cache, a release does nothing."""
        if self.mode != "r+":
            if kind == "load" and stop > start:
                self._read_ahead(np.arange(start, stop, dtype=np.int64), wait)
            return
        if kind == "load":
            if stop > start:
                self.load_range(start, stop)
            if wait:
                self._wait_loads()
        else:
            self.release_range(start, stop)

    def _submit_rows(self, kind: str, rows: np.ndarray, wait: bool) -> None:
        """:meth:`_submit_range` for the sorted unique ``rows`` (:meth:`load_rows`,
        :meth:`release_rows`): pinned in the region beside the ranges, their records read
        from where they lie; released at once, the dirty ones sealed in row order. A
        read-only open reads them ahead into the page cache; a release does nothing."""
        if self.mode != "r+":
            if kind == "load" and rows.shape[0]:
                self._read_ahead(rows, wait)
            return
        if kind == "load":
            if rows.shape[0]:
                self.load_rows(rows)
            if wait:
                self._wait_loads()
        else:
            self.release_rows(rows)

    def wait(self) -> None:
        """Wait until every load in flight is read and installed (then raise the error an
        earlier load met, once), and every read-ahead hint is done."""
        self._require_open()
        if self.mode == "r+":
            self._wait_loads()
        ra = self._readahead
        if ra is not None and ra.pid == os.getpid():
            ahead, self._hint_next = self._hint_next, None
            if ahead is not None:
                self._hint_records(ra, ahead)
            ra.join()

    def _wait_loads(self) -> None:
        """Wait until every load in flight is read and installed; then raise the error an
        earlier load met, once."""
        self._require_open()
        self._install_loaded(wait_for=set(self._jobs))
        self._raise_load_error()


    # -- commits (flush, a commit of several stores together, checkpoint) ---------------
    def _commit_meta(self, meta: dict[str, Any]) -> None:
        c = self._commit
        c.meta = meta
        c.wal_on = meta.get("durability") == "step"  # a new commit log, or none

    def flush(self, count: int | None = None, meta: dict[str, Any] | None = None) -> None:
        """Make everything so far durable, at step ``count`` (default: ``self.count``), with
        ``meta`` (default: the committed one).

        Seals every dirty slot (segments of a seal unit, with cleaning as any seal), fsyncs
        the new segments, writes the next index generation (fsync'd), starts the next
        commit-log generation when ``wal_on``, commits the manifest, then deletes the previous
        index generation and the segments that no manifest lists any more, and retires the
        previous commit log (kept for reuse while ``wal_on``, else deleted). After a flush
        every slot is clean (and still resident).

        The engine's own (its close, the first commit of a new store, a standalone
        ``LogStore``); the core flushes through ``prepare_commit(lone=True)`` and
        ``install_commit`` (``_engine.commit``), which do the same.
        """
        if meta is not None:
            self._commit_meta(meta)
        self._require_writable()
        self._commit.flush(None if count is None else int(count))

    def prepare_commit(self, count: int, meta: dict[str, Any], *, lone: bool = False
                       ) -> dict[str, Any] | None:
        """The first half of :meth:`flush` (a group's, ``dsa_core._group``; a flush's,
        ``lone``): seal, sync the segments, write the next index (and commit log); returns
        the manifest that would commit them, not yet written (``commit.Commit.prepare``).
        Until then the store cannot flush on its own. ``lone``: None when nothing changed
        since the last commit (the count, the meta, the index and the commit log's
        generation as they are: nothing to write); ``meta`` stays this store's either way, as
        a flush leaves it (a cancel puts back only what a group's prepare found)."""
        c = self._commit
        if not lone:
            self._meta_before = (c.meta, c.wal_on)
        self._commit_meta(meta)
        self._require_writable()
        return c.prepare(int(count), if_changed=lone)

    def install_commit(self, durable: bool = True) -> None:
        """The second half of :meth:`flush`: the prepared manifest is written (``durable=
        False``: not synced; ``_engine.sync_commit`` does it later); the previous generation's
        files go."""
        self._require_writable()
        self._commit.install(durable)

    def cancel_commit(self) -> None:
        """Drop a prepared commit (its files are garbage)."""
        c = self._commit
        c.cancel()
        if self._meta_before is not None:
            c.meta, c.wal_on = self._meta_before
            self._meta_before = None

    def checkpoint(self, dest, count: int | None = None, meta: dict[str, Any] | None = None,
                   *, overwrite: bool = False, share: bool = True) -> Path:
        """Flush, then write a snapshot of the flushed state to ``dest``; returns ``dest``.

        The snapshot is built in a temporary directory (hard links to the manifest's
        segments, which are immutable, or copies where links are refused; a copy of the
        index generation and of the manifest) and renamed into place: ``dest`` is complete
        or absent. It opens as a log store with exactly the flushed state and stays valid
        while this store trains, cleans and deletes (those only unlink its own names). It
        names no commit log (everything is in its segments) and no commit group (it is no
        member of the live store's group); a writer that opens it starts a commit log at its
        first logged step. ``share=False``: copies of the segments instead of links (a
        snapshot that shares no blocks with the store).
        """
        if meta is not None:
            self._commit_meta(meta)
        self._require_writable()
        return self._commit.checkpoint(dest, None if count is None else int(count),
                                       overwrite=overwrite, share=share)

    # -- inspection ------------------------------------------------------------------------
    # -- inspection ------------------------------------------------------------------------
    def log_stats(self) -> dict[str, Any]:
        """Space, memory and write figures (the write counters since this open).

        ``segments``/``segment_records``/``segment_bytes``: the live segments (records, and
        their files' bytes with headers and padding); ``live_records``/``live_bytes``: rows
        with an on-disk record (record bytes); ``dead_bytes``: record bytes of superseded
        records in live segments; ``pending_delete``: dead segments whose files wait for
        the next commit; ``spare_segments``/``spare_bytes``: dead files kept for the next
        seals to overwrite (at most ``segments.SPARE_SEGMENTS``, deleted by ``close``);
        ``recycled_segments``: seals written over one, this open; ``space_used``:
        ``segment_records / live_records``; ``slots``/``slots_used``/``slots_dirty``;
        ``sealed_bytes`` (updated records written by seals), ``cleaned_bytes`` (records
        copied by cleaning), ``file_bytes_written`` (everything appended, headers and
        padding included), ``user_bytes`` (records handed out by acquire: ``len(rows) *
        record bytes`` per call); ``write_amplification`` =
        ``(sealed_bytes + cleaned_bytes) / user_bytes`` and ``cleaning_overhead`` =
        ``(sealed_bytes + cleaned_bytes) / sealed_bytes``. ``total_*``: the same over the
        store's life (every writer's counters as of its last flush, plus this open's):
        ``total_user_bytes``, ``total_written_bytes`` (seals and cleaning),
        ``total_file_bytes_written``, ``total_write_amplification``.

        Cleaning (``cleaner``): ``space_bound_records`` is the most records the live
        segments may hold after a seal (``space_ratio x live_records`` plus
        ``clean_slack_records``, the slack the store may run above ``space_ratio`` while
        cleaning reads are in flight); ``clean_waits`` counts the seals that waited for
        cleaning reads (only past the slack) and ``clean_wait_s`` the seconds they waited
        (``total_clean_waits``, ``total_clean_wait_s``: over the store's life);
        ``clean_read_bytes`` / ``clean_read_requests``: what the cleaning reads read;
        ``clean_read_s``: the seconds their requests took (the disk time cleaning took from
        the steps, at most); ``clean_rest_s``: the seconds the reading thread rested between
        requests (its pacing, ``read.CLEAN_DUTY``).
        """
        self._require_open()
        st, rb = self._stats, self.rec_bytes
        segs = self._segments
        written = (st["sealed_records"] + st["cleaned_records"]) * rb
        user = st["user_records"] * rb
        tot = self._commit.totals()
        t_written = (tot["sealed_records"] + tot["cleaned_records"]) * rb
        t_user = tot["user_records"] * rb
        clean_read = self._cleaner.read_counts()
        used, dirty = self._pool.occupancy()
        return {
            "segments": len(segs.segs),
            "segment_records": int(segs.total_records),
            "segment_bytes": int(sum(s.nbytes for s in segs.segs.values())),
            "live_records": int(segs.live_total),
            "live_bytes": int(segs.live_total) * rb,
            "dead_bytes": int(segs.total_records - segs.live_total) * rb,
            "pending_delete": len(segs.doomed),
            "spare_segments": len(segs.spares),
            "spare_bytes": int(sum(n for _, n in segs.spares)),
            "recycled_segments": segs.recycled,
            "space_used": segs.total_records / segs.live_total if segs.live_total else 0.0,
            "space_ratio": self.space_ratio,
            "slots": self.slots,
            "slots_used": used,
            "slots_dirty": dirty,
            "seal_unit": self.seal_unit,
            "seals": st["seals"],
            "cleaned_segments": st["cleaned_segments"],
            "sealed_bytes": st["sealed_records"] * rb,
            "cleaned_bytes": st["cleaned_records"] * rb,
            "file_bytes_written": st["file_bytes_written"],
            "user_bytes": user,
            "write_amplification": written / user if user else 0.0,
            "cleaning_overhead": written / (st["sealed_records"] * rb)
            if st["sealed_records"] else 0.0,
            "misses": st["misses"],
            "acquires": st["acquires"],
            "evicted_clean": st["evicted_clean"],
            "range_loads": st["range_loads"],
            "range_records": st["range_records"],
            "range_rereads": st["range_rereads"],
            "range_reads": 0 if self._loader is None else self._loader.stats["reads"],
            "range_read_bytes": 0 if self._loader is None
            else self._loader.stats["read_bytes"],
            "range_mapped_records": 0 if self._loader is None
            else self._loader.stats["mapped_records"],
            "range_pinned": self._pool.range_pinned,
            "range_pins_dropped": st["range_pins_dropped"],
            "row_loads": st["row_loads"],
            "index_mapped": self._pool.index.mapped,
            "index_rebases": st["index_rebases"],
            "index_page_reads": self._pool.index.page_reads,
            "index_delta_rows": self._pool.index.entries,
            "index_memory_bytes": self._pool.index.memory_bytes(),
            "total_user_bytes": t_user,
            "total_written_bytes": t_written,
            "total_file_bytes_written": tot["file_bytes_written"],
            "total_write_amplification": t_written / t_user if t_user else 0.0,
            "space_bound_records": self._cleaner.bound(),
            "clean_slack_records": self._cleaner.slack,
            "clean_waits": st["clean_waits"],
            "clean_wait_s": st["clean_wait_us"] / 1e6,
            "clean_read_bytes": clean_read[0],
            "clean_read_requests": clean_read[1],
            "clean_read_s": clean_read[2],
            "clean_rest_s": clean_read[3],
            "total_clean_waits": tot["clean_waits"],
            "total_clean_wait_s": tot["clean_wait_us"] / 1e6,
        }

    def check_index(self) -> list[str]:
        """Check the index against the segments and the region; returns the problems found.

        Every location (``loc``) must point inside a live segment at a record that carries
        that row; live counts, record totals, residency (the resident map <-> ``slot_row``)
        and the free-slot stack must agree. An empty list: all
        consistent.
        """
        self._require_open()
        return verify(self._pool, self._segments)

    def stats(self) -> dict[str, Any]:
        """The memory budget and its parts, segments, live and dead bytes, and the write
        counters over the store's life (those every writer committed with its flushes), for
        ``dsa info`` (:meth:`log_stats` has them all). A read-only open has no region: the
        budget shown is the default a writer gets. ``writer_cpu_ms_per_segment``: the CPU
        time of this open's background segment writer per segment it wrote (None before its
        first, or read-only)."""
        s = self.log_stats()
        nseg = s["segments"]
        lay = self.layout.as_dict()
        mem = self.memory_bytes or self._memory_setting or default_memory(lay)
        parts = split_budget(lay, mem)
        w = self._segments.writer
        jobs = 0 if w is None or w.pid != os.getpid() else w.jobs
        return {
            "region_budget_bytes": mem,
            "region_budget_note": "what a writer opening it without memory= gets: the budget "
            "recorded at create or at the last open that passed memory=, else the default"
            if self.memory_bytes is None else "this open's budget",
            "memory_index_bytes": parts["index"],
            "memory_region_bytes": parts["region"],
            "memory_write_buffers_bytes": parts["write_buffers"],
            "memory_cleaning_buffers_bytes": parts["cleaning_buffers"],
            "memory_staging_bytes": parts["staging"],
            "memory_note": "memory= (the budget above) is all the memory the store keeps, in "
            "these parts: the index (8 bytes per row: the row locations), "
            f"the region ({parts['slots']:,} record slots), the background writes' buffers, "
            "the cleaning reads' buffers, and a seal's staging; the page cache of the segment "
            "files comes on top (reclaimable)",
            "region_slots": parts["slots"],
            "writer_cpu_ms_per_segment": round(1e3 * w.cpu_s / jobs, 2) if jobs else None,
            "segments": nseg, "segment_bytes": s["segment_bytes"],
            "live_records": s["live_records"], "live_bytes": s["live_bytes"],
            "dead_bytes": s["dead_bytes"], "pending_delete_segments": s["pending_delete"],
            "space_used": round(s["space_used"], 4), "space_ratio": s["space_ratio"],
            "written_bytes": s["total_written_bytes"],
            "written_note": "records the seals and the cleaner wrote, over the store's life "
            "(as of each writer's last flush)",
            "updated_bytes": s["total_user_bytes"],
            "updated_note": "records the steps and writes updated, over the store's life",
            "write_amplification": round(s["total_write_amplification"], 4)
            if s["total_user_bytes"] else None,
            "write_amplification_note": "written / updated (below 1: the region absorbed "
            "repeated updates of the same rows)",
            "clean_waits": s["total_clean_waits"],
            "clean_wait_s": round(s["total_clean_wait_s"], 3),
            "clean_waits_note": "seals that waited for the cleaner's reads, and how long, over "
            "the store's life (as of each writer's last flush): a seal waits only when the "
            "segments would otherwise pass space_ratio",
            "summary": f"log store ({nseg} segment{'' if nseg == 1 else 's'})",
            **{k: s[k] for k in ("range_loads", "row_loads", "range_records", "range_reads",
                                 "range_read_bytes", "range_mapped_records", "range_rereads",
                                 "range_pins_dropped", "misses")},
            "range_note": "this open's range and row-set loads (load_range, load_rows): rows "
            "put into the region, "
            "the sequential reads (syscalls, bytes), scattered records read through the "
            "mappings, rows read again because they moved, pins given up for a batch; "
            "misses: rows steps read from disk",
        }

    def verify(self) -> list[str]:
        """Every file of the last flush read whole and CRC-checked (a read-only open with
        ``check="full"``), then the index checked against the segments."""
        eng = open(self.path, "r", check="full")
        try:
            return [f"index: {p}" for p in eng.check_index()]
        finally:
            eng.close()

    # -- closing ------------------------------------------------------------------------------
    def _stop_threads(self) -> None:
        """Stop this process's writer and cleaning-read threads (a forked child's are its
        parent's: left alone)."""
        self._stop_loader()
        self._segments.stop_writer()
        self._cleaner.stop()

    def _stop_readahead(self) -> None:
        ra, self._readahead = self._readahead, None
        self._hint_next = None
        if ra is not None and ra.pid == os.getpid():
            ra.close()

    def close(self) -> None:
        """Flush (when writable and anything changed) and release the lock. Safe twice."""
        self._stop_readahead()
        self._shut(flush=True)

    def abandon(self) -> None:
        """Close without flushing: the descriptors and the lock released, nothing written
        (what a crash leaves; for cleaning up after a failed create or open, and tests).
        Safe twice."""
        self._stop_readahead()
        self._shut(flush=False)

    def _shut(self, flush: bool) -> None:
        """:meth:`close` (``flush``) or :meth:`abandon` but the read-ahead thread (what the
        unclosed-store finalizer runs, :func:`_flush_unclosed`)."""
        if self._closed:
            return
        if flush:
            if self.mode == "r+":
                self.flush()  # a failed flush leaves the store open: fix the cause, close again
            self._commit.close_wal()
        self._stop_threads()  # abandoned: its segment files are garbage for the next open
        self._closed = True
        self._segments.delete_spares()
        self._segments.segs.clear()
        unmap_pending()  # the segments no array uses any more are unmapped on return
        if not flush:
            self._commit.close_wal()
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def __enter__(self) -> LogStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.mode
        lay = self.layout
        return (f"LogStore({str(self.path)!r}, rows={lay.num_rows}, stride={lay.stride}, "
                f"dtype={lay.dtype.name}, slots={self.slots}, count={self.count}, {state})")


# -- create / open ------------------------------------------------------------------------------
def create(path, layout: dict[str, Any], *, memory_bytes: int, init: str = "zeros",
           init_scale: float = 1e-2, seed: int = 0, ball_maxnorm: float | None = None,
           space_ratio: float = 2.0, count: int = 0, max_batch: int | None = None,
           meta: dict[str, Any] | None = None, overwrite: bool = False) -> LogStore:
    """Create an empty log store at ``path`` (every row at its initial record); returns it
    open for writing.

    Parameters
    ----------
    layout : dict
        A record layout (``dsa_core._layout.make_layout``).
    memory_bytes : int
        All the memory the store keeps: the index, the buffers and the region (``budget``;
        :func:`memory_for` gives the smallest that holds a batch).
    init, init_scale, seed, ball_maxnorm
        The deterministic initial weights (``_init``): ``"zeros"``, ``"normal"``
        (``N(0, init_scale**2)``) or ``"uniform"`` (``U(-init_scale, init_scale)``); rows
        beyond ``ball_maxnorm`` (Poincaré stores) are scaled onto it.
    space_ratio : float > 1, default 2.0
        Bound on the segments' records as a multiple of the live records (the cleaner's
        target): lower saves disk, costs more cleaning writes.
    count : int, default 0
        The initial step count.
    max_batch : int, optional
        Check now that the region holds batches of this many rows.
    meta : dict, optional
        JSON-able caller data committed with every flush (``commit.Commit.meta``).
    overwrite : bool
        Replace an existing log store (refused while a writer holds it).

    All arguments are checked before anything is written.
    """
    lay = check_layout(layout)
    memory_bytes = check_memory_bytes(memory_bytes, lay)
    if max_batch is not None:
        check_memory(lay, memory_bytes, int(max_batch))
    init, init_scale, seed, ball_maxnorm, space_ratio = check_init_settings(
        lay, init, init_scale, seed, ball_maxnorm, space_ratio)
    count = check_count(count)
    meta = check_meta({} if meta is None else meta)
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{str(directory)!r} exists and is not a directory")
    own = directory.is_dir() and any(parse_name(e) is not None for e in os.listdir(directory))
    if (directory / MANIFEST_FILE).exists() or own:
        if not overwrite and not (directory / MANIFEST_FILE).exists():
            raise FileExistsError(f"{str(directory)!r} holds a log store's files but no "
                                  f"{MANIFEST_FILE}: a damaged store. Nothing was changed; "
                                  "restore it from a checkpoint, or pass overwrite=True to "
                                  "replace it")
        if not overwrite:
            raise FileExistsError(f"a store already exists at {str(directory)!r}; open it or "
                                  "pass overwrite=True to replace it")
        fd = lock(directory)
        try:
            for entry in os.listdir(directory):
                if parse_name(entry) is not None or entry.startswith(MANIFEST_FILE):
                    os.unlink(directory / entry)
        finally:
            os.close(fd)
    directory.mkdir(parents=True, exist_ok=True)
    lockfd = lock(directory)
    try:
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "layout": lay, "count": count,
            "seed": int(seed), "init": init, "init_scale": init_scale,
            "ball_maxnorm": ball_maxnorm, "index": None, "index_crc32": None, "segments": [],
            "next_segment": 1, "index_from": 1, "space_ratio": space_ratio, "meta": meta,
        }
        write_manifest(directory, manifest)
        eng = LogStore(directory, manifest, "r+", memory_bytes, lockfd)
    except BaseException:
        os.close(lockfd)
        raise
    return eng


def open(path, mode: str = "r+", *, memory_bytes: int | None = None,
         max_batch: int | None = None, check: str = "full") -> LogStore:  # noqa: A001
    """Open a log store: the state of its last completed flush, plus the steps of its
    commit log (``durability="step"``), if the manifest names one.

    ``mode="r+"`` takes the writer lock, removes files no manifest references (left by a
    crash), replays the commit log's valid entries through :meth:`LogStore.write` and, if
    there were any, flushes once; ``memory_bytes`` is then required. ``mode="r"`` maps the
    files read-only without a lock and writes nothing (``memory_bytes`` optional: only
    :meth:`LogStore.read` is available); the commit log's rows are read into a region of
    their own, as large as they need (at most the log's size).
    ``check="full"`` verifies the CRC of every referenced segment's records (a sequential
    read of the whole store); ``"headers"`` checks headers, sizes, row ids and their CRCs
    only. A missing, torn or corrupt referenced file is a clear error naming it.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' (read-only) or 'r+' (read-write), got {mode!r}")
    if check not in ("full", "headers"):
        raise ValueError(f"check must be 'full' or 'headers', got {check!r}")
    directory = Path(path)
    manifest = read_manifest(directory)
    lay = check_layout(manifest["layout"])
    if mode == "r+" and memory_bytes is None:
        raise ValueError("memory_bytes is required to open a log store for writing (mode="
                         "'r+'): the memory it may keep (index, buffers and region)")
    if memory_bytes is not None:
        memory_bytes = check_memory_bytes(memory_bytes, lay)
        if max_batch is not None:
            check_memory(lay, memory_bytes, int(max_batch))
    lockfd = lock(directory) if mode == "r+" else -1
    try:
        for attempt in range(5):
            if mode == "r+" or attempt:
                manifest = read_manifest(directory)  # under the lock: the newest commit
            try:
                logged, mem = 0, memory_bytes
                if mode == "r":  # the region must hold every row of the commit log
                    rows = [e.rows for e in log_entries(directory, manifest)]
                    logged = len(rows)
                    if logged:
                        need = np.unique(np.concatenate(rows)).shape[0]
                        mem = max(memory_bytes or 0, memory_for(lay, max(need, 1)))
                eng = LogStore(directory, manifest, mode, mem, lockfd)
                eng._pool.memory_bytes = memory_bytes
                load(directory, manifest, check == "full", eng._pool, eng._segments)
                if logged:
                    install_log(log_entries(directory, manifest), logged, eng._commit,
                                eng._pool)
                break
            except (FileNotFoundError, SegmentError):
                # a reader can lose a race with the writer deleting files after a newer
                # commit: read the manifest again and retry; a writer cannot
                if mode == "r+" or attempt == 4:
                    raise
                time.sleep(0.01)
        if mode == "r+":
            # the commit log read through first: damage in it (an invalid entry with valid
            # ones after it) stops the open before any file is deleted or written
            for _ in log_entries(directory, manifest):
                pass
            remove_garbage(directory, manifest)
            replay_log(directory, eng._commit, eng._pool)
            if eng._commit.manifest.get(CHECKSUM_KEY) is None:  # written before checksums:
                write_manifest(directory, eng._commit.manifest)  # the same, with one now
    except BaseException:
        if lockfd >= 0:
            os.close(lockfd)
        raise
    return eng


def remove(path) -> None:
    """Delete a log store directory (refused while a writer holds it)."""
    directory = Path(path)
    read_manifest(directory)
    os.close(lock(directory))
    shutil.rmtree(directory)
