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

:class:`LogEngine` composes those components and is the only thing callers see:
``dsa_core.step`` (through ``_log.store.LogStore``) coalesces a batch's ids,
``slots = eng.acquire(unique_rows)``, runs the kernels on ``eng.region`` with ``slots`` in
place of the row ids, then sets ``eng.count``; ``gather``/export use :meth:`LogEngine.read`.

Memory budget
    ``memory_bytes`` is everything the store keeps in memory (``budget``): the index (8 bytes
    per row), the write buffers of the background seals, the cleaning reads' buffers and a
    seal's staging (all sized from the seal unit, and given to the writer and the cleaner
    from the same ``budget`` functions),
    and the region's ``S`` slots with what is left. A batch of ``M`` rows needs ``S >= M``:
    :func:`check_memory` (called by :func:`create` and :func:`open` with ``max_batch``, and
    by every :meth:`LogEngine.acquire`) names the budget that would hold it.
Durability
    Only :meth:`LogEngine.flush` (and :meth:`LogEngine.checkpoint`, :meth:`LogEngine.close`)
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
    inside :meth:`LogEngine.acquire`, :meth:`LogEngine.release` and :meth:`LogEngine.flush`.
    Four kinds of background threads only do I/O on buffers and files the engine hands them:
    the segment writer (``writer``: writes sealed segments; a segment is readable from its
    buffer until written), the cleaning reads (``read.CleaningReads``: read the live records
    of the next seals' victims into buffers), the range loads (``ranges.Loader``: read a
    loaded range's or row set's records into staging buffers, which :meth:`LogEngine.acquire`
    and the range calls install in the caller's thread) and, for ``LogStore``, the read-ahead of
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

from .._engine import closed_error
from .._files import CHECKSUM_KEY, ForkedReadError
from .._init import InitSpec
from .budget import (
    SLOT_OVERHEAD,
    check_memory,
    check_memory_bytes,
    memory_for,
    seal_unit_for,
    slots_for,
)
from .checks import check_count, check_init_settings, check_layout, check_meta
from .cleaner import Cleaner
from .commit import Commit
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
from .segments import Segments

__all__ = ["SLOT_OVERHEAD", "ForkGuard", "ForkedReadError", "LogEngine", "check_memory",
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
          "range_records", "range_rereads", "range_pins_dropped", "row_loads")


def _forward(component: str, name: str, doc: str) -> property:
    """An attribute of the engine that is the attribute ``name`` of one of its components."""
    def get(self):
        return getattr(getattr(self, component), name)

    def put(self, value):
        setattr(getattr(self, component), name, value)

    return property(get, put, doc=doc)


class LogEngine:
    """An open log-structured store: the region, the index, the mapped segments.

    Obtain one with :func:`create` or :func:`open`. Attributes used by callers: ``region``
    (S, stride) records that :meth:`acquire`'s slots index, ``count`` (the step count that
    seals record and :meth:`flush` commits; set it after each step), ``meta`` (a JSON-able
    dict committed with every flush: the caller's hyperparameters), ``layout``,
    ``num_rows``, ``stride``, ``dtype``, ``slots`` (S), ``seal_unit``, ``mode``, ``closed``.

    The work is done by its components, each holding the state it owns and references to
    the components it uses: ``_pool`` (``pool.Pool``: region, slots, index, CLOCK),
    ``_segments`` (``segments.Segments``: the live segments and their background writes),
    ``_cleaner`` (``cleaner.Cleaner``), ``_commit`` (``commit.Commit``: seals, flushes,
    checkpoints, the commit log); opening and checking are ``recovery``'s.
    """

    # the pool's
    region = _forward("_pool", "region", "(S, stride) records: the slots of acquire")
    loc = _forward("_pool", "loc", "per row: < 0 resident in slot -loc - 1, else on disk")
    slot_row = _forward("_pool", "slot_row", "per slot: its row, -1 when free")
    slot_disk = _forward("_pool", "slot_disk", "per slot: its row's newest on-disk record")
    dirty = _forward("_pool", "dirty", "per slot: 1 when changed since its last seal")
    memory_bytes = _forward("_pool", "memory_bytes", "the budget batches are checked against")
    # the segment table's
    segs = _forward("_segments", "segs", "live segments by id")
    next_segment = _forward("_segments", "next_segment", "the id of the next seal")
    total_records = _forward("_segments", "total_records", "records of the live segments")
    live_total = _forward("_segments", "live_total", "rows with an on-disk location")
    _live = _forward("_segments", "live", "live records per segment id")
    _pending = _forward("_segments", "pending", "segments still being written, by id")
    _writer = _forward("_segments", "writer", "this process's segment writer, or None")
    # the commit protocol's
    count = _forward("_commit", "count", "the step count that seals record and flush commits")
    meta = _forward("_commit", "meta", "JSON-able caller data committed with every flush")
    wal_on = _forward("_commit", "wal_on", "flushes start a new commit-log generation")
    wal_bound = _forward("_commit", "wal_bound", "log bytes that make the next step flush")

    def __init__(self, directory: Path, manifest: dict[str, Any], mode: str,
                 memory_bytes: int | None, lockfd: int):
        self.path = Path(directory)
        self.mode = mode
        self.closed = False
        self._lockfd = lockfd
        lay = self.layout = dict(manifest["layout"])
        self.num_rows = int(lay["num_rows"])
        self.stride = int(lay["stride"])
        self.dtype = np.dtype(lay["dtype"])
        self.rec_bytes = self.stride * self.dtype.itemsize
        self.space_ratio = float(manifest["space_ratio"])
        mn = manifest["ball_maxnorm"]
        self.init = InitSpec(str(manifest["init"]), float(manifest["init_scale"]),
                             int(manifest["seed"]), None if mn is None else float(mn),
                             int(lay["dim"]), lay["w"], self.stride, self.dtype)
        S = self.slots = 0 if memory_bytes is None else slots_for(lay, memory_bytes)
        self.seal_unit = seal_unit_for(S, self.rec_bytes)
        self._stats = dict.fromkeys(_STATS, 0)
        self._segments = Segments(self.path, self.stride, self.dtype, self.seal_unit,
                                  int(manifest["next_segment"]))
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

    # -- guards ---------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self.closed:
            raise closed_error(self)

    def _require_writable(self) -> None:
        self._require_open()
        if self.mode != "r+":
            raise ValueError(f"log store {str(self.path)!r} was opened read-only (mode='r'); "
                             "open it with mode='r+' to change it")

    def check_batch(self, batch: int) -> None:
        """Raise ``ValueError`` unless the region holds a batch of ``batch`` rows."""
        self._pool.check_batch(batch)

    def _changed(self) -> None:
        """Rows are about to change (a step, a write, a restore): see :class:`ForkGuard`."""
        if self._fork is not None:
            self._fork.bump()

    def _check_fork(self) -> None:
        """Refuse a read in a process forked from this writer after it changed the store."""
        if self._fork is not None:
            self._fork.check(self.path)

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

    def read(self, rows: Any, cols: slice | None = None) -> np.ndarray:
        """A copy of the records of ``rows``: shape ``(len(rows), stride)``, store dtype.

        Any rows, duplicates allowed. Resident rows come from the region, others from their
        segment's mapping or, never written, as their initial record. Residency is not
        changed (for gather and export). ``cols``: a ``slice`` of record columns to copy
        (e.g. the weights ``slice(w, w + dim)`` for gather); the result then has that many
        columns.
        """
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
        """Overwrite the whole records of ``rows`` (unique ids) with ``records``.

        ``records``: shape ``(len(rows), stride)`` in the store dtype. Checked before anything
        changes; goes through :meth:`acquire` in chunks of at most ``slots`` rows, without
        reading the old records. Durable at the next flush.
        """
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
        range call or :meth:`wait_ranges`. An :meth:`acquire` that misses rows of a range
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
            need = memory_for(self.layout, pinned + room)
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
        job = plan_job(self._job_seq, start, stop, self._pool.loc, self._segments, self.init,
                       self._records_offset, rows)
        if job.files or job.ready or job.fresh is not None:
            if self._loader is None or self._loader.pid != os.getpid():
                self._jobs.clear()  # a forked child: its parent's loads are not its own
            self._loader = loader_for(self._loader, self.stride, self.dtype, self.init)
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

    def wait_ranges(self) -> None:
        """Wait until every load in flight is read and installed; then raise the error an
        earlier load met, once."""
        self._require_open()
        self._install_loaded(wait_for=set(self._jobs))
        self._raise_load_error()

    def _records_offset(self, seg: Segment) -> int:
        return segment_geometry(seg.n, self.stride, self.dtype.itemsize)[2]

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
        r = r[(r >= 0) & (r < self.num_rows)]
        miss = r[self._pool.loc[r] >= 0]
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

    # -- flushing -------------------------------------------------------------------------
    def flush(self, count: int | None = None) -> None:
        """Make everything so far durable, at step ``count`` (default: ``self.count``).

        Seals every dirty slot (segments of a seal unit, with cleaning as any seal), fsyncs the new
        segments, writes the next index generation (fsync'd), starts the next commit-log
        generation when ``wal_on``, commits the manifest, then deletes the previous index
        generation and the segments that no manifest lists any more, and retires the
        previous commit log (kept for reuse while ``wal_on``, else deleted). After a flush
        every slot is clean (and still resident).
        """
        self._require_writable()
        self._commit.flush(count)

    def prepare(self, count: int | None = None) -> dict[str, Any]:
        """The first half of :meth:`flush` (a commit of several stores together): everything
        durable but not committed; returns the manifest that :meth:`install` writes (see
        ``commit.Commit.prepare``). Until then the store cannot flush on its own."""
        self._require_writable()
        return self._commit.prepare(count)

    def install(self, durable: bool = True) -> None:
        """The second half of :meth:`flush`: the prepared manifest is written (``durable=
        False``: not synced; :meth:`sync_manifest` does it later)."""
        self._require_writable()
        self._commit.install(durable)

    def sync_manifest(self) -> None:
        """Sync a manifest installed with ``durable=False``."""
        self._commit.sync_manifest()

    def cancel(self) -> None:
        """Drop a prepared commit (its files are garbage)."""
        self._commit.cancel()

    def checkpoint(self, dest, count: int | None = None, *, overwrite: bool = False,
                   share: bool = True) -> Path:
        """Flush, then write a snapshot of the flushed state to ``dest``; returns ``dest``.

        The snapshot is built in a temporary directory (hard links to the manifest's
        segments, which are immutable, or copies where links are refused; a copy of the
        index generation and of the manifest) and renamed into place: ``dest`` is complete
        or absent. It opens as a log store with exactly the flushed state and stays valid
        while this store trains, cleans and deletes (those only unlink its own names). It
        names no commit log (everything is in its segments); a writer that opens it starts
        one at its first logged step. ``share=False``: copies of the segments instead of
        links (a snapshot that shares no blocks with the store).
        """
        self._require_writable()
        return self._commit.checkpoint(dest, count, overwrite=overwrite, share=share)

    # -- the commit log (durability="step"; commit) ---------------------------------------
    def step_ready(self, count: int, meta: dict[str, Any] | None = None) -> bool:
        """True when step ``count + 1`` may be logged now (:meth:`commit_step`).

        That is: a commit-log generation is open and healthy, ``count`` is the engine's
        count and the last one the manifest plus the log hold, no :meth:`acquire` (hence
        no :meth:`write`, no unlogged step) changed the region since, the log is under
        ``wal_bound`` bytes, and ``meta`` (when given) is the committed one. Then the
        state that a replay rebuilds is exactly the current one, and an entry appended now
        replays onto it.
        """
        return self._commit.step_ready(count, meta)

    def begin_step(self, count: int, meta: dict[str, Any]) -> None:
        """Prepare to log step ``count + 1``: unless :meth:`step_ready`, turn ``wal_on``
        on and flush at ``count`` with ``meta`` (which starts a fresh commit-log
        generation). Nothing of the step has changed yet, so an error here (a failed flush)
        leaves the caller at ``count``.
        """
        self._require_writable()
        self._commit.begin_step(count, meta)

    def commit_step(self, t: int, rows: np.ndarray, slots: np.ndarray,
                    records: np.ndarray) -> None:
        """Commit step ``t``: append ``(rows, records)`` to the commit log (one write, one
        fdatasync), then copy ``records`` into ``region[slots]`` and set ``count = t``.

        ``rows``: the step's unique rows, ``slots`` their slots from the :meth:`acquire`
        made after :meth:`begin_step` (the only acquire since), ``records``: their
        C-contiguous new records. On any error (the log's write or sync) the region is left
        as it was and the log marked broken: the next :meth:`begin_step` flushes (a new
        generation), so the failed step is never replayed.
        """
        self._require_writable()
        self._changed()
        self._commit.commit_step(t, rows, slots, records)

    def wal_bytes(self) -> int:
        """Bytes of the open commit-log generation holding entries (0 without one)."""
        return self._commit.wal_bytes()

    # -- inspection ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
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
            "slots_used": self.slots - self._pool.nfree,
            "slots_dirty": int(np.count_nonzero(self._pool.dirty)),
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

    def verify(self) -> list[str]:
        """Check the index against the segments and the region; returns the problems found.

        Every location (``loc``, or a resident row's ``slot_disk``) must point inside a live
        segment at a record that carries that row; live counts, record totals, residency
        (``loc`` <-> ``slot_row``) and the free-slot stack must agree. An empty list: all
        consistent.
        """
        self._require_open()
        return verify(self._pool, self._segments)

    # -- closing ------------------------------------------------------------------------------
    def _stop_threads(self) -> None:
        """Stop this process's writer and cleaning-read threads (a forked child's are its
        parent's: left alone)."""
        self._stop_loader()
        self._segments.stop_writer()
        self._cleaner.stop()

    def close(self) -> None:
        """Flush (when writable and anything changed) and release the lock. Safe twice."""
        if self.closed:
            return
        if self.mode == "r+":
            self.flush()  # a failed flush leaves the engine open: fix the cause, close again
        self._commit.close_wal()
        self._stop_threads()
        self.closed = True
        self._segments.delete_spares()
        self._segments.segs.clear()
        unmap_pending()  # the segments no array uses any more are unmapped on return
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def abandon(self) -> None:
        """Close without flushing: the descriptors and the lock released, nothing written
        (what a crash leaves; for cleaning up after a failed create or open, and tests).
        Safe twice."""
        if self.closed:
            return
        self._stop_threads()  # its segment files are garbage for the next open
        self.closed = True
        self._segments.delete_spares()
        self._segments.segs.clear()
        unmap_pending()
        self._commit.close_wal()
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def __enter__(self) -> LogEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return (f"LogEngine({str(self.path)!r}, rows={self.num_rows}, stride={self.stride}, "
                f"dtype={self.dtype.name}, slots={self.slots}, count={self.count}, {state})")


# -- create / open ------------------------------------------------------------------------------
def create(path, layout: dict[str, Any], *, memory_bytes: int, init: str = "zeros",
           init_scale: float = 1e-2, seed: int = 0, ball_maxnorm: float | None = None,
           space_ratio: float = 2.0, count: int = 0, max_batch: int | None = None,
           meta: dict[str, Any] | None = None, overwrite: bool = False) -> LogEngine:
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
        JSON-able caller data committed with every flush (``LogEngine.meta``).
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
            "next_segment": 1, "space_ratio": space_ratio, "meta": meta,
        }
        write_manifest(directory, manifest)
        eng = LogEngine(directory, manifest, "r+", memory_bytes, lockfd)
    except BaseException:
        os.close(lockfd)
        raise
    return eng


def open(path, mode: str = "r+", *, memory_bytes: int | None = None,
         max_batch: int | None = None, check: str = "full") -> LogEngine:  # noqa: A001
    """Open a log store: the state of its last completed flush, plus the steps of its
    commit log (``durability="step"``), if the manifest names one.

    ``mode="r+"`` takes the writer lock, removes files no manifest references (left by a
    crash), replays the commit log's valid entries through :meth:`LogEngine.write` and, if
    there were any, flushes once; ``memory_bytes`` is then required. ``mode="r"`` maps the
    files read-only without a lock and writes nothing (``memory_bytes`` optional: only
    :meth:`LogEngine.read` is available); the commit log's rows are read into a region of
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
                eng = LogEngine(directory, manifest, mode, mem, lockfd)
                eng.memory_bytes = memory_bytes
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
