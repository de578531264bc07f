"""A log-structured store seen through the attributes that ``State`` and ``step`` use.

``_store.Store`` (the in-place store) exposes the layout as attributes (``w_off``,
``m_off``, ``stride``...), the mapped records as ``data`` and the live step count as
``count``. :class:`LogStore` gives a ``_log.LogEngine`` the same surface, except for
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

import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from . import _log
from ._log_read import ReadAhead
from ._log_format import FORMAT_NAME as LOG_FORMAT
from ._log_format import MANIFEST_FILE
from ._paging import memory_limit

__all__ = ["DEFAULT_MEMORY_SHARE", "LOG_FORMAT", "MIN_BATCH_ROWS", "LogStore",
           "default_memory", "store_kind"]

DEFAULT_MEMORY_SHARE = 0.25  # of _paging.memory_limit(): the default region budget
MIN_BATCH_ROWS = 4096        # the default budget always holds a batch of this many rows


def store_kind(directory: Path) -> str | None:
    """``"log"`` or ``"inplace"`` from the manifest's format field; None without a manifest.

    Both kinds keep a ``manifest.json``; its ``"format"`` tells them apart (``"dsa-log"``
    for log stores, anything else is left to the in-place reader and its checks).
    """
    try:
        manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        return "inplace"  # let the in-place reader report what is wrong with it
    if isinstance(manifest, dict) and manifest.get("format") == LOG_FORMAT:
        return "log"
    return "inplace"


def default_memory(layout: dict[str, Any]) -> int:
    """The default region budget of a log store, in bytes.

    ``DEFAULT_MEMORY_SHARE`` (25%) of the memory this process may use
    (``_paging.memory_limit()``: physical memory, capped by its cgroup), but never more than
    the whole table needs (one slot per row) and never less than a batch of
    ``MIN_BATCH_ROWS`` (4096) rows needs (or the whole table, if smaller).
    """
    n = int(layout["num_rows"])
    share = int(DEFAULT_MEMORY_SHARE * memory_limit())
    whole = _log.memory_for(layout, n)
    floor = _log.memory_for(layout, min(MIN_BATCH_ROWS, n))
    return max(floor, min(share, whole))


def _flush_unclosed(engine: _log.LogEngine, pid: int) -> None:
    """Flush a log store that was never closed: when its last ``State`` is garbage-collected,
    or when the interpreter exits normally (``weakref.finalize`` runs at exit too).

    An in-place store's rows reach its file through the shared mapping even when the
    program never calls ``close``; a log store's steps since the last flush live only in
    its memory region. Python flushes open files that are dropped or left open at exit; so
    does this, so that forgetting ``close`` does not silently lose training. (After
    ``kill -9`` or ``os._exit`` nothing runs: the store reopens at its last flush.)

    Only in the process that opened the store: a forked child (a data-loader worker, say)
    holds a copy of the region and must never write the parent's store.
    """
    if os.getpid() != pid:
        return
    try:
        if not engine.closed:
            engine.close()  # flushes, then releases the writer lock
    except Exception as exc:  # nowhere to raise to: say so
        print(f"dsa_core: flushing unclosed log store {str(engine.path)!r} failed: {exc!r}",
              file=sys.stderr)


class LogStore:
    """The open engine of a log store with the attribute surface of ``_store.Store``.

    Shared by every ``State`` derived from one ``create``/``open``, like a ``Store``.
    ``count`` is the engine's count (the live step count: that of the newest State, and the
    one the next seal and flush record).
    """

    storage = "log"
    access = "log"  # no mapping to page: the region is the memory (``State.access``)

    def __init__(self, engine: _log.LogEngine):
        self.engine = engine
        lay = self.layout = dict(engine.layout)
        self.path = Path(engine.path)
        self.mode = engine.mode
        self.num_rows = int(lay["num_rows"])
        self.dim = int(lay["dim"])
        self.dtype = np.dtype(lay["dtype"])
        self.curvature = float(lay["curvature"])
        self.stride = int(lay["stride"])
        self.w_off = lay["w"]
        self.m_off = lay["m"]
        self.v_off = lay["v"]
        self.v_width = lay["v_width"]
        self.rowwise = lay.get("second_moment") == "rowwise"
        self.m_bf16 = lay.get("first_moment") == "bfloat16"
        self.m_width = lay.get("m_width", self.dim)
        self.rs_off = lay.get("row_step", -1)
        self.ls_off = lay.get("last_step", -1)
        self.scratch: dict[str, np.ndarray] = {}
        self.access_request = "auto"
        self.settings: dict[str, Any] = {}  # open-time settings to remember: {"memory": bytes}
        self._fd = -1
        self._prefetcher = None
        self._ranges = None
        self._readahead: ReadAhead | None = None
        if self.mode == "r+":
            weakref.finalize(self, _flush_unclosed, engine, os.getpid())

    # -- the engine's state ----------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.engine.closed

    @property
    def count(self) -> int:
        return self.engine.count

    @count.setter
    def count(self, value: int) -> None:
        self.engine.count = int(value)

    @property
    def memory_bytes(self) -> int | None:
        """The region's budget in bytes (None for a read-only open)."""
        return self.engine.memory_bytes

    @property
    def slots(self) -> int:
        return self.engine.slots

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.stride * self.dtype.itemsize

    def _no_view(self, what: str):
        raise ValueError(
            f"store {str(self.path)!r} is a log-structured store (storage='log'), which has "
            f"no whole-table view ({what}): its records live in a memory region and in "
            "immutable segments. Read rows with dsa_core.gather(state, idx) or "
            "dsa_core.read_records(state, idx) in chunks, or convert it to an in-place store "
            "with dsa_core.convert(state, dest, storage='inplace')")

    @property
    def data(self):
        self._no_view("state.store.data")

    @property
    def counters(self):
        self._no_view("state.store.counters")

    def prefetch(self, rows: np.ndarray, wait: bool = False) -> None:
        """Read the on-disk records of ``rows`` (checked ids) ahead, in the background."""
        ra = self._readahead
        if ra is None or ra.pid != os.getpid():  # none yet, or the parent's (fork)
            ra = self._readahead = ReadAhead(self.engine.rec_bytes)
        addrs, keep = self.engine.readahead(rows)
        ra.submit(addrs, keep)
        if wait:
            ra.join()

    # -- life cycle ----------------------------------------------------------------------------
    def sync(self) -> None:
        """Everything so far durable (the engine's flush at its count and meta)."""
        self.engine.flush()

    def journal_void(self) -> None:
        """No undo journal to void: a log store's commit log (durability='step') holds only
        steps after its manifest's count, and every flush starts a new one."""

    def close(self) -> None:
        ra, self._readahead = self._readahead, None
        if ra is not None and ra.pid == os.getpid():
            ra.close()
        self.engine.close()

    def __repr__(self) -> str:
        return f"LogStore({self.engine!r})"
