"""The seam between the functional core and its storage engines.

``dsa_core``'s functions (``step``, ``gather``, ``flush``, ``checkpoint``, ``restore``,
``convert``, ``read_records``/``write_records``, the read-ahead and range hints, the CLI) talk
to an open store only through the :class:`Engine` protocol below: a pager's width of verbs
(after SQLite's ``sqlite3_io_methods``: verbs, no data) and a transaction's life (after LMDB's
``txn_begin``/``commit``/``abort``). Two engines implement it:

* ``_inplace.store.Store`` -- the **in-place** store: one mapped file of fixed-size records, updated
  where they lie;
* ``_log.engine.LogStore`` -- the **log-structured** store: records in immutable segment
  files, a memory region of slots in front of them, an index and a cleaner.

Which one a store uses is a performance choice (``storage=``), never a behaviour: the same
calls give the same numbers, the same files mean the same thing, a crash is recovered the
same way. What an engine cannot hide is declared as data, in one frozen :class:`Info`
(``Engine.info``: ``table_view``, ``reads_last_flush``, and what it tells ``dsa info`` and
the checks) and listed with its reason in ``docs/storage.md``; code outside the engines never
asks which kind it holds (``tests/store/test_engine_seam.py`` guards that). What the core
keeps about an open store -- the newest State's count and meta, the settings to remember,
the commit group, its reused buffers, whether it is closed -- lives in the core's
``_handle.Handle``, never on the engine: an engine knows nothing of States or groups.

The step protocol, for one step ``t = count + 1`` of the unique rows ``rows``:

1. the core refuses a batch of more than ``info.max_batch`` distinct rows before anything
   changes (``_step.refuse_batch``: a log store's region must hold them);
2. ``data, where = begin_step(rows, count, meta)`` -- the records the kernels update are
   ``data[where[k]]`` for ``rows[k]`` (the mapped rows themselves in place; region slots,
   or a private copy of them when each step is committed on its own);
3. the kernels run on ``data[where]``;
4. ``commit_step(t, meta)`` -- the step takes effect (``durability="step"``: durably);
   or ``abort_step()`` if anything in 3-4 raised: the records are as before 2, the count
   that of 2 (also after an in-memory ``commit_step`` that a later store's failure takes
   back, ``_group``; the records then come back from the core's copy).

``meta`` is the dict of the store's hyperparameters and durability that a commit records
(``{"hparams": {...}, "durability": ...}``, ``"settings"``: the open-time settings to remember,
and ``"group"``: the commit group the store belongs to, if any); every commit point writes it
with the count.

A commit in two halves: ``payload = prepare_commit(count, meta)`` makes the new state
durable without installing it and returns the manifest that would commit it;
``install_commit()`` writes it; ``cancel_commit()`` drops it. Between prepare and
install/cancel the store refuses to commit on its own. A flush is both halves at once
(:func:`commit`: ``prepare_commit(..., lone=True)``, which returns None when the last
commit already holds everything, then ``install_commit()``); a group of stores that commit
together (``_group``) installs each member's after the group's commit file recorded every
payload, with ``install_commit(durable=False)`` and :func:`sync_commit` later. Each engine
module also provides ``read_group_ref(directory)`` and ``roll_forward(directory, payload)``
(``_engines``).

``tests/store/test_engine_seam.py`` pins the protocol's size: a new member is a decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._layout import MANIFEST_FILE, Layout
from ._os import fsync_path

__all__ = ["Engine", "Info", "closed_error", "commit", "no_view_error", "scratch", "sync_commit"]


@dataclass(frozen=True, slots=True)
class Info:
    """What an open store is, as data (fixed once it is open): what an engine cannot hide
    and what the core reports of it. One frozen value (``Engine.info``), never a verb."""

    table_view: bool          # ``.data``/``.counters`` are the whole table as ndarrays (in
    #                           place only; ``read(slice, cols, view=True)`` hands them out)
    reads_last_flush: bool    # a reader beside a writer sees the writer's last flush
    access: str               # how its memory is paged ("ram" | "disk" | "log": State.access)
    memory_bytes: int | None  # the anonymous memory it holds for rows beside the page cache
    #                           (a log store's region budget); None when it holds none (an
    #                           in-place store, a read-only open)
    nbytes: int               # the bytes of its records (and header) as one table
    max_batch: int            # the most distinct rows one step may hold (``num_rows``
    #                           when unbounded; a log store's region: its budget's slots)
    description: str          # what ``dsa info`` says of the kind
    checks: str               # what its open checked (``dsa verify``)


@runtime_checkable
class Engine(Protocol):
    """An open store as the functional core sees it (shared by every ``State`` of it)."""

    # -- what it is (read-only after open) ---------------------------------------------------
    kind: str                  # "inplace" | "log": for messages, stats and ``State.storage``
    path: Path
    mode: str                  # "r+" (the one writer) | "r"
    layout: Layout             # the record layout, one frozen value: sizes, dtype, curvature,
                               #   offsets (``_layout.Layout``; ``as_dict()``: the manifest's)
    info: Info                 # the rest of what it is, as data (:class:`Info`)

    # -- live state ---------------------------------------------------------------------------
    count: int                 # the count of its last commit (``commit_step``,
                               #   ``install_commit``; ``abort_step`` takes one back)

    # -- stepping (a transaction: begin, commit, abort) ---------------------------------------
    def begin_step(self, rows: np.ndarray, count: int, meta: dict[str, Any]
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Where the kernels update the records of ``rows`` (unique, checked ids, at most
        ``info.max_batch`` of them)."""

    def commit_step(self, t: int, meta: dict[str, Any]) -> None:
        """Step ``t`` takes effect (``count`` becomes ``t``)."""

    def abort_step(self) -> None:
        """Undo a begun step whose kernels or commit raised; ``count`` back to the one
        ``begin_step`` was given (after an in-memory ``commit_step`` too)."""

    # -- records ----------------------------------------------------------------------------
    def read(self, rows: np.ndarray | slice, cols: slice | None = None, *,
             view: bool = False) -> np.ndarray:
        """The records (or the columns ``cols`` of them) of checked ids, a copy; or of the
        rows ``slice(lo, hi)`` (restore, convert: chunks of a table), maybe a view.
        ``view=True`` (``info.table_view`` engines: ``State.weights`` & co.): the mapped
        rows themselves, a writable view handed out -- rows may change through it where the
        engine does not see them (an in-place store's later snapshots are full copies)."""

    def write(self, rows: np.ndarray | slice, records: np.ndarray) -> None:
        """Overwrite the whole records of unique checked ids, or of the rows
        ``slice(lo, hi)`` (durable at the next flush). A range write is a bulk overwrite
        (restore, convert): no record of an earlier step may roll its rows back at the next
        open (an in-place store voids its undo journal first)."""

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """The weight rows of checked ids into ``out`` (len(rows), dim); residency unchanged."""

    # -- hints and loads (never change a value) ---------------------------------------------
    def submit(self, kind: str, rows: np.ndarray | slice, wait: bool) -> None:
        """Hand the engine a hint or a load of ``rows``; ``wait``: return once done. Never
        changes a value.

        ``kind="hint"`` (``dsa_core.prefetch``): ``rows`` checked ids (any order, repeats),
        read ahead in the background (in place: their pages into the page cache; a log
        store: the on-disk records of those neither resident nor never written).

        ``kind="load"`` of a range ``slice(start, stop)``: bring its records into the
        engine's memory with sequential reads, in the background (in place: the page cache;
        a log store: its region, where they stay pinned until the release; a ``ValueError``,
        before anything changes, when they cannot fit there); ``kind="release"``: write the
        range's changes back sequentially and give its memory back.

        ``kind="load"`` of a row set (``rows`` sorted, unique, checked ids; maybe none):
        bring their records into the engine's memory in the background, from where they
        lie (in place: their pages into the page cache, read at queue depth; a log store:
        its region, pinned -- beside the loaded ranges -- until the release; a
        ``ValueError``, before anything changes, when the union of what is loaded cannot
        fit); ``kind="release"``: give that memory back (a log store: the rows no other
        active load holds are unpinned, the dirty ones sealed, their slots freed; in place:
        nothing is dropped)."""

    def wait(self) -> None:
        """Until every load and release submitted so far is done; then raise the first
        error one met in the background, once."""

    def residency(self, rows: np.ndarray) -> float:
        """The fraction of ``rows`` (unique checked ids) in the engine's memory (in place:
        of their pages in the page cache; a log store: resident in its region)."""

    # -- durability -------------------------------------------------------------------------
    def prepare_commit(self, count: int, meta: dict[str, Any], *, lone: bool = False
                       ) -> dict[str, Any] | None:
        """The first half of a commit at ``count`` with ``meta``: durable, not installed;
        the manifest to install. ``lone=True`` (a flush, :func:`commit`): None when the
        store's last commit already holds all of it -- nothing to write."""

    def install_commit(self, durable: bool = True) -> None:
        """The second half: the prepared manifest written (the store is at ``count``);
        ``durable=False``: not synced yet (its group's commit file holds it;
        :func:`sync_commit`)."""

    def cancel_commit(self) -> None:
        """Drop a prepared commit: the store stays at its last commit."""

    def checkpoint(self, dest: Path, count: int, meta: dict[str, Any], *,
                   overwrite: bool, share: bool = True) -> Path:
        """Flush, then a consistent, openable snapshot at ``dest`` (atomic: all or nothing;
        it names no commit group) that later changes of the store never reach (it may
        share disk with the store or with earlier snapshots); ``share=False``: one that
        shares no disk blocks with anything (a full copy)."""

    # -- information and life cycle ---------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """What ``dsa info`` prints about the engine (JSON-able); ``"unclean_stop": True``
        when it was opened with ``unclean="accept"`` after an unclean stop."""

    def verify(self) -> list[str]:
        """The engine's own checks of its files; a list of problems (empty: ok)."""

    def close(self) -> None:
        """Flush (when writable) and release its files and writer lock; safe twice. Only
        the core calls it (``dsa_core.close``, which marks the ``Handle`` closed)."""


# -- the core's side of the seam: what every engine's verbs make ------------------------------
def commit(st: Engine, count: int, meta: dict[str, Any]) -> None:
    """A flush: every step so far durable, committed at ``count`` with ``meta``
    (``prepare_commit`` and ``install_commit`` at once; nothing written when the last commit
    already holds it all). A failed install leaves no prepared commit behind."""
    if st.prepare_commit(count, meta, lone=True) is None:
        return
    try:
        st.install_commit()
    except BaseException:
        st.cancel_commit()
        raise


def sync_commit(st: Engine) -> None:
    """Make the manifest an ``install_commit(durable=False)`` wrote durable: the file, then
    its directory (both kinds keep it at ``path / MANIFEST_FILE``)."""
    fsync_path(st.path / MANIFEST_FILE)
    fsync_path(st.path)


_SCRATCH_MAX_BYTES = 16 << 20


def scratch(buffers: dict[str, np.ndarray], key: str, n: int, dtype: np.dtype) -> np.ndarray:
    """A reused 1-D buffer of at least ``n`` elements of ``dtype``, kept in ``buffers`` (the
    core's: ``Handle.scratch``; an engine's own).

    Fresh ``np.empty`` blocks of ~1 MB come from mmap and page-fault on every step, a visible
    share of a small step (figures: docs/notebook.md, design measurements). A store has
    one writer and its steps run one after another, so one buffer per use is safe.
    """
    buf = buffers.get(key)
    if buf is None or buf.shape[0] < n:
        buf = np.empty(max(n, 1), dtype)
        if buf.nbytes <= _SCRATCH_MAX_BYTES:  # a one-off huge batch is not kept
            buffers[key] = buf
    return buf[:n]


def no_view_error(st: Engine, what: str) -> ValueError:
    """The error of asking a store without whole-table views (``info.table_view`` False: a
    log store) for one (``what``): the one text of it, kind-neutral (``info.description``
    names the kind), with the calls that work on every store."""
    return ValueError(
        f"store {str(st.path)!r} ({st.info.description}) has no whole-table view ({what}): "
        "its records are not one array. Read rows with dsa_core.gather(state, idx) or "
        "dsa_core.read_records(state, idx) in chunks, or convert it to an in-place store "
        "with dsa_core.convert(state, dest, storage='inplace')")


def closed_error(st: Engine, role: str = "", *, read_only: bool = False) -> ValueError:
    """The error of any call on a closed store: the one text of it. ``role`` says which
    store of a call this is (``"the snapshot"``); ``read_only``: the call needs only a
    read-only open (``mode='r'``)."""
    role = f" ({role})" if role else ""
    how = "dsa_core.open(path, mode='r')" if read_only else "dsa_core.open(path)"
    return ValueError(f"store {str(st.path)!r}{role} is closed; reopen it with {how}")
