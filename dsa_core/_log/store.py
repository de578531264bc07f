"""A log-structured store seen through the attributes that ``State`` and ``step`` use.

``_inplace.store.Store`` (the in-place store) exposes the layout as attributes (``w_off``,
``m_off``, ``stride``...), the mapped records as ``data`` and the live step count as
``count``. :class:`LogStore` gives a ``log_engine.LogEngine`` the same surface, except for
``data``: a log store has no whole-table array (its records live in an in-memory region of
slots and in immutable segments), so ``data`` and ``counters`` raise a clear error, and
``step`` and ``gather`` use :attr:`LogStore.engine` instead (``acquire``, ``region``,
``read``).

Read-ahead (``dsa_core.prefetch``) runs on a :class:`_log_read.ReadAhead` thread of the
store: it only hints the kernel to read the next batch's on-disk records, so it can never
change a value.
``durability="step"`` is the engine's commit log (``_log_wal``; ``_step`` drives it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from . import budget, pool, recovery
from . import engine as log_engine
from . import format as log_format
from .. import _exit
from .._engine import closed_error, scratch
from .._init import INIT_CHUNK_BYTES, chunks, progress_bar
from .._layout import Layout
from .format import FORMAT_NAME as LOG_FORMAT
from .format import MANIFEST_FILE, parse_name
from .read import ReadAhead
from .._paging import memory_limit
from .._settings import remembered, settings_field
from .._validation import check_memory_arg

__all__ = ["DEFAULT_MEMORY_SHARE", "LOG_FORMAT", "MIN_BATCH_ROWS", "SETTINGS", "LogStore",
           "check_settings", "create_store", "default_memory", "open_store", "region_memory",
           "remove_store"]

DEFAULT_MEMORY_SHARE = 0.25  # of _paging.memory_limit(): the default region budget
MIN_BATCH_ROWS = 4096        # the default budget always holds a batch of this many rows


def region_memory(layout: Any, rows: int) -> int:
    """The smallest ``memory=`` of a log store whose region holds ``rows`` records.

    ``layout`` is a ``State`` or its ``state.layout``. ``memory=`` is all the memory the
    store keeps: the index of the table (8 bytes per row: the row locations), each record
    slot (the record plus 42 bytes of bookkeeping), and buffers that grow with the region
    (background writes, cleaning reads, a seal's staging; at most about 210-250 MiB
    together, docs/storage.md "Memory"). One step's distinct rows must fit in the region.

    >>> import tempfile, dsa_core
    >>> s = dsa_core.create(tempfile.mkdtemp() + "/t", 1000, 8, storage="log", memory="1MiB")
    >>> need = dsa_core.region_memory(s, 100)
    >>> need > 1000 * 16 + 100 * (s.layout["stride"] * 4 + 42)  # the buffers come on top
    True
    >>> dsa_core.close(s)
    """
    lay = layout.layout if hasattr(layout, "layout") else layout
    if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)) \
            or rows < 1:
        raise ValueError(f"rows must be an int >= 1 (the records the region must hold), got "
                         f"{rows!r}")
    return budget.memory_for(dict(lay), int(rows))


def default_memory(layout: dict[str, Any]) -> int:
    """The default region budget of a log store, in bytes.

    ``DEFAULT_MEMORY_SHARE`` (25%) of the memory this process may use
    (``_paging.memory_limit()``: physical memory, capped by its cgroup), but never more than
    the whole table needs (one slot per row) and never less than a batch of
    ``MIN_BATCH_ROWS`` (4096) rows needs (or the whole table, if smaller).
    """
    n = int(layout["num_rows"])
    share = int(DEFAULT_MEMORY_SHARE * memory_limit())
    whole = budget.memory_for(layout, n)
    floor = budget.memory_for(layout, min(MIN_BATCH_ROWS, n))
    return max(floor, min(share, whole))


def _flush_unclosed(engine: log_engine.LogEngine, pid: int) -> None:
    """Flush a log store that was never closed: when its last ``State`` is garbage-collected,
    or when the interpreter exits normally (``weakref.finalize`` runs at exit too).

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
    try:
        if engine.closed:
            return
        gone = _exit.store_gone(engine.path, engine._lockfd, MANIFEST_FILE)
        if gone == "removed":
            engine.abandon()  # the user deleted the store: nothing to lose
            return
        if gone == "replaced":
            engine.abandon()
            raise FileNotFoundError(
                f"the writer lock file this store held was deleted since it was opened, and "
                f"{str(engine.path)!r} now holds a manifest.json: another store (or this one "
                "with its writer.lock removed). Not flushing into it. Close stores before "
                "deleting or replacing their directories")
        engine.close()  # flushes, then releases the writer lock
    except Exception as exc:  # nowhere to raise to: say so
        if not engine.closed and _exit.store_gone(engine.path, engine._lockfd,
                                                  MANIFEST_FILE) == "removed":
            engine.abandon()  # deleted while it flushed: nothing to lose either
            return
        _exit.report(f"dsa_core: flushing unclosed log store {str(engine.path)!r} failed, "
                     f"its steps since the last flush are lost: {exc!r}")


class LogStore:
    """The log-structured engine (``_engine.Engine``) over a ``log_engine.LogEngine``.

    Shared by every ``State`` derived from one ``create``/``open``, like a ``Store``.
    ``count`` is the engine's count (that of its last commit, and the one the next seal and
    flush record).
    """

    kind = "log"
    access = "log"  # no mapping to page: the region is the memory (``State.access``)
    table_view = False       # records live in a region and in segments: no whole table
    description = "log-structured, storage='log'"
    checks = "manifest checksum, segment and index CRCs checked, every record's checksum"
    reads_last_flush = True  # a reader opens the files of the writer's last flush

    def __init__(self, engine: log_engine.LogEngine):
        self.engine = engine
        self.layout = Layout.from_dict(engine.layout)  # the record layout, one frozen value
        self.path = Path(engine.path)
        self.mode = engine.mode
        self._scratch: dict[str, np.ndarray] = {}  # a logged step's copy of its records
        self._memory_setting: int | None = None  # the budget remembered ("memory"), if any
        self._step: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # logged step
        self._begun = 0  # the count a begun step started from (``abort_step``)
        self._fd = -1
        self._prefetcher = None
        self._ranges = None
        self._readahead: ReadAhead | None = None
        self._meta_before: tuple | None = None        # what cancel_commit puts back
        if self.mode == "r+":
            _exit.watch(self, _flush_unclosed, engine, os.getpid())

    # -- the engine's state ----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def count(self) -> int:
        return self.engine.count

    @property
    def memory_bytes(self) -> int | None:
        """The region's budget in bytes (None for a read-only open)."""
        return self.engine.memory_bytes

    @property
    def slots(self) -> int:
        return self.engine.slots

    @property
    def nbytes(self) -> int:
        lay = self.layout
        return lay.num_rows * lay.stride * lay.dtype.itemsize

    def view_handed_out(self) -> None:
        """Never called: a log store hands out no whole-table view (:meth:`no_view`)."""

    def no_view(self, what: str):
        raise ValueError(
            f"store {str(self.path)!r} is a log-structured store (storage='log'), which has "
            f"no whole-table view ({what}): its records live in a memory region and in "
            "immutable segments. Read rows with dsa_core.gather(state, idx) or "
            "dsa_core.read_records(state, idx) in chunks, or convert it to an in-place store "
            "with dsa_core.convert(state, dest, storage='inplace')")

    @property
    def data(self):
        self.no_view("state.store.data")

    @property
    def counters(self):
        self.no_view("state.store.counters")

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
        """:meth:`prefetch` of unique ``rows``."""
        ra = self._readahead
        if ra is None or ra.pid != os.getpid():  # none yet, or the parent's (fork)
            ra = self._readahead = ReadAhead(self.engine.rec_bytes)
        addrs, sums, keep = self.engine.readahead(rows)
        ra.submit(addrs, keep, sums)
        if wait:
            ra.join()

    # -- the engine interface (dsa_core._engine) -----------------------------------------
    def check_batch(self, n: int) -> None:
        """The ``n`` distinct rows of one step must fit in the region."""
        self.engine.check_batch(n)

    def max_batch(self) -> int:
        return self.engine.slots

    def begin_step(self, rows: np.ndarray, count: int, meta: dict[str, Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Region slots for ``rows``. With ``durability="step"`` (the commit log) a copy of
        the slots' records instead: the region takes the new records only once the step's
        log entry is durable (:meth:`commit_step`), so a failed step changes nothing."""
        eng = self.engine
        self._step = None
        self._begun = count
        if meta.get("durability") == "step":
            eng.begin_step(count, meta)  # flushes first unless the log can take the step
            n = rows.shape[0]
            slots = eng.acquire(rows, check=False) if n else np.empty(0, np.int64)
            k = self.layout.stride
            rec = scratch(self._scratch, "logged_records", n * k,
                          self.layout.dtype).reshape(n, k)
            if n:
                pool.gather_records(eng.region, slots, rec)
            self._step = (rows, slots, rec)
            return rec, np.arange(n, dtype=np.int64)
        if rows.shape[0]:
            return eng.region, eng.acquire(rows, check=False)
        return eng.region, rows

    def commit_step(self, t: int, meta: dict[str, Any]) -> None:
        step, self._step = self._step, None
        if step is not None:  # one append + fdatasync, then the region, then the count
            self.engine.commit_step(t, *step)
        else:
            self.engine.count = int(t)

    def abort_step(self) -> None:
        """Nothing to undo but the count: a logged step changed only its copy, an unlogged
        one the region (durable at the next flush, as in place)."""
        self._step = None
        self.engine.count = self._begun

    def read(self, rows: np.ndarray | slice, cols: slice | None = None) -> np.ndarray:
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        return self.engine.read(rows, cols=cols)

    def write(self, rows: np.ndarray | slice, records: np.ndarray) -> None:
        if isinstance(rows, slice):
            rows = np.arange(rows.start, rows.stop, dtype=np.int64)
        self.engine.write(rows, np.ascontiguousarray(records))

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """Never changes the region's residency."""
        o = self.layout.w_off
        out[...] = self.engine.read(rows, cols=slice(o, o + self.layout.dim))

    def _commit_meta(self, meta: dict[str, Any]) -> None:
        self.engine.meta = meta
        self.engine.wal_on = meta.get("durability") == "step"  # a new commit log, or none

    def flush(self, count: int, meta: dict[str, Any]) -> None:
        """Seal the dirty slots, commit a manifest with ``count`` and ``meta``."""
        self._commit_meta(meta)
        self.engine.flush(int(count))

    # -- a commit of several stores together (dsa_core._group) -------------------------
    def prepare_commit(self, count: int, meta: dict[str, Any]) -> dict[str, Any]:
        """Seal, sync the segments, write the next index (and commit log); returns the
        manifest that would commit them, not yet written."""
        self._meta_before = (self.engine.meta, self.engine.wal_on)
        self._commit_meta(meta)
        return self.engine.prepare(int(count))

    def install_commit(self, durable: bool = True) -> None:
        """Write the prepared manifest; the previous generation's files go."""
        self.engine.install(durable)

    def sync_commit(self) -> None:
        """Make the manifest of an ``install_commit(durable=False)`` durable."""
        self.engine.sync_manifest()

    def cancel_commit(self) -> None:
        self.engine.cancel()
        if self._meta_before is not None:
            self.engine.meta, self.engine.wal_on = self._meta_before
            self._meta_before = None

    def checkpoint(self, dest: Path, count: int, meta: dict[str, Any], *,
                   overwrite: bool, share: bool = True) -> Path:
        """Flush, then hard links to the immutable segments (and a copy of the index);
        ``share=False``: copies of them. The snapshot names no commit group (it is no member
        of the live store's group)."""
        self._commit_meta(meta)
        return self.engine.checkpoint(dest, int(count), overwrite=overwrite, share=share)

    def before_restore(self) -> None:
        """No undo journal: a commit log holds only steps after its manifest's count, and
        every flush starts a new one."""

    def residency(self, rows: np.ndarray) -> float:
        """The fraction of ``rows`` resident in the region."""
        return float((self.engine.loc[rows] < 0).mean())

    def _submit_range(self, kind: str, start: int, stop: int, wait: bool) -> None:
        """A load (``LogEngine.load_range``) pins the range's rows in the region and reads
        its on-disk records sequentially on the store's range-load thread; they are
        installed at the next step, range call or wait. A release
        (``LogEngine.release_range``) unpins them, seals the range's dirty records in row
        order and frees its slots, at once (the caller's thread). A read-only open has no
        region to load into: a load only reads the records ahead into the page cache, a
        release does nothing."""
        if self.mode != "r+":
            if kind == "load" and stop > start:
                self._read_ahead(np.arange(start, stop, dtype=np.int64), wait)
            return
        if kind == "load":
            if stop > start:
                self.engine.load_range(start, stop)
            if wait:
                self.engine.wait_ranges()
        else:
            self.engine.release_range(start, stop)

    def _submit_rows(self, kind: str, rows: np.ndarray, wait: bool) -> None:
        """:meth:`_submit_range` for the sorted unique ``rows`` (``LogEngine.load_rows``,
        ``LogEngine.release_rows``): pinned in the region beside the ranges, their records
        read from where they lie; released at once, the dirty ones sealed in row order. A
        read-only open reads them ahead into the page cache; a release does nothing."""
        if self.mode != "r+":
            if kind == "load" and rows.shape[0]:
                self._read_ahead(rows, wait)
            return
        if kind == "load":
            if rows.shape[0]:
                self.engine.load_rows(rows)
            if wait:
                self.engine.wait_ranges()
        else:
            self.engine.release_rows(rows)

    def wait_ranges(self) -> None:
        if self.closed:
            raise closed_error(self)
        if self.mode == "r+":
            self.engine.wait_ranges()
        ra = self._readahead
        if ra is not None and ra.pid == os.getpid():
            ra.join()

    def stats(self) -> dict[str, Any]:
        """The memory budget and its parts, segments, live and dead bytes, and the write
        counters over the store's life (those every writer committed with its flushes), for
        ``dsa info``. A read-only open has no region: the budget shown is the default a
        writer gets. ``writer_cpu_ms_per_segment``: the CPU time of this open's background
        segment writer per segment it wrote (None before its first, or read-only)."""
        s = self.engine.stats()
        nseg = s["segments"]
        lay = self.layout.as_dict()
        mem = self.memory_bytes or self._memory_setting or default_memory(lay)
        parts = budget.split(lay, mem)
        w = self.engine._segments.writer
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
        eng = log_engine.open(self.path, "r", check="full")
        try:
            return [f"index: {p}" for p in eng.verify()]
        finally:
            eng.close()

    # -- life cycle ----------------------------------------------------------------------------
    def abandon(self) -> None:
        """Close without a flush (an open that failed after the engine opened)."""
        ra, self._readahead = self._readahead, None
        if ra is not None and ra.pid == os.getpid():
            ra.close()
        self.engine.abandon()

    def close(self) -> None:
        ra, self._readahead = self._readahead, None
        if ra is not None and ra.pid == os.getpid():
            ra.close()
        self.engine.close()

    def __repr__(self) -> str:
        return f"LogStore({self.engine!r})"


# -- the engine's life cycle (dsa_core._engines) ----------------------------------------------
SETTINGS = ("memory",)  # the open-time settings a log store takes and remembers


def check_settings(layout: dict[str, Any], *, access: str, memory: Any,
                   space_ratio: Any) -> dict[str, Any]:
    """The settings of a new log store (``memory``), refusing an in-place store's; the
    budget (given or default) must hold at least one record."""
    if access != "auto":
        raise ValueError(f"access={access!r} is for in-place stores (how their mapping is "
                         "paged); a log store (storage='log') has no mapping and takes "
                         "memory= instead: leave access='auto'")
    memory = check_memory_arg(memory, "log")
    budget.check_memory(layout, default_memory(layout) if memory is None else memory, 1)
    return {} if memory is None else {"memory": memory}


def create_store(directory: Path, layout: dict[str, Any], settings: dict[str, Any], *,
                 init: Any, init_scale: float, seed: int, ball_maxnorm: float | None,
                 meta: dict[str, Any], overwrite: bool, progress: bool | None,
                 space_ratio: float | None) -> LogStore:
    """A new log store at ``directory`` (arguments checked by ``dsa_core.create``). Named
    inits are computed when a row is first read (``_init``); an init array is written in
    chunks; the first flush commits it. On any error its files are removed."""
    memory = settings.get("memory") or default_memory(layout)
    named = init if isinstance(init, str) else "zeros"
    dt = np.dtype(layout["dtype"])
    eng = log_engine.create(directory, layout, memory_bytes=memory, init=named,
                      init_scale=float(init_scale), seed=int(seed), ball_maxnorm=ball_maxnorm,
                      space_ratio=2.0 if space_ratio is None else space_ratio,
                      overwrite=overwrite)
    store = LogStore(eng)
    store._memory_setting = settings.get("memory")
    eng.meta = meta
    eng.wal_on = meta.get("durability") == "step"  # the first flush names a commit log
    try:
        if init is not None and not isinstance(init, str):
            lay = store.layout
            o, d = lay.w_off, lay.dim
            rows = max(1, INIT_CHUNK_BYTES // (lay.stride * dt.itemsize))
            blocks = list(chunks(lay.num_rows, rows))
            bar = progress_bar(len(blocks), progress, f"init {directory.name}")
            try:
                for lo, hi in blocks:
                    rec = np.zeros((hi - lo, lay.stride), dt)
                    rec[:, o:o + d] = np.asarray(init[lo:hi], dtype=dt)
                    eng.write(np.arange(lo, hi, dtype=np.int64), rec)
                    if bar is not None:
                        bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        eng.flush(0)
    except BaseException:
        eng.abandon()  # nothing of this create is worth keeping: drop it unflushed
        for entry in os.listdir(directory):  # only the log store's own files
            if parse_name(entry) is not None or entry.startswith(MANIFEST_FILE):
                (directory / entry).unlink(missing_ok=True)
        raise
    return store


def warmup() -> None:
    """Nothing of its own to compile beyond the core's kernels (``dsa_core.warmup``)."""


def open_store(directory: Path, mode: str, *, access: str, memory: Any,
               unclean: str) -> tuple[LogStore, int, dict[str, Any], dict[str, Any]]:
    """Open a log store at its last flush (a writer replays its commit log):
    ``(store, count, meta, settings)`` (the settings to remember: ``memory`` if recorded or
    given). ``unclean`` changes nothing: a log store never reopens mixed."""
    memory = check_memory_arg(memory, "log")
    if access != "auto":
        raise ValueError(f"access={access!r} is for in-place stores; {str(directory)!r} is "
                         "a log store (storage='log'): leave access='auto' and size its "
                         "region with memory=")
    manifest = log_format.read_manifest(directory)
    meta = manifest.get("meta")
    settings = remembered(directory, meta.get("settings") if isinstance(meta, dict) else None,
                          "memory", memory)
    if mode == "r+" and memory is None:  # the recorded budget, else the default
        memory = settings.get("memory") or default_memory(manifest["layout"])
    eng = log_engine.open(directory, mode, memory_bytes=memory, check="headers")
    store = LogStore(eng)
    store._memory_setting = settings.get("memory")
    eng.meta = {**eng.meta, **settings_field(settings)}  # any flush remembers a new one
    return store, eng.count, eng.meta, settings


def check_files(directory: Path) -> list[tuple[str, str | None, str]]:
    """Every file of the log store checked on its own, without opening it (``dsa verify``):
    ``(file, problem or None, what was checked)``; see ``_log.recovery.check_files``."""
    return recovery.check_files(directory)


def owns_file(name: str) -> bool:
    """One of a log store's own files (segments, index and log generations)."""
    return parse_name(name) is not None


def read_group_ref(directory: Path) -> dict[str, Any] | None:
    """The commit group a log store's manifest names (inside its ``meta``), or None."""
    meta = log_format.read_manifest(directory).get("meta")
    ref = meta.get("group") if isinstance(meta, dict) else None
    return ref if isinstance(ref, dict) else None


def roll_forward(directory: Path, payload: dict[str, Any]) -> None:
    """Install the manifest a group committed for this store (``dsa_core._group``): its
    files were made durable before the group's commit point; the writer lock is held."""
    fd = recovery.lock(directory)
    try:
        log_format.write_manifest(directory, payload)
    finally:
        os.close(fd)


def remove_store(directory: Path) -> None:
    """Delete a log store's directory (refused while a writer holds it)."""
    log_engine.remove(directory)
