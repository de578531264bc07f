"""Where each row's newest on-disk record lies: a log store's row index.

A location is ``((segment_id << 32) | k) + 1`` for record ``k`` of a segment, 0 for a row
never written (it reads as its initial record, ``_init``). Whether a row is resident is not
the index's business (``resident``): a row keeps its location while it is in the region.

Two parts, read through one lookup (:func:`loc_of`, for the kernels; :meth:`RowIndex.get`):

``base``
    ``(num_rows,)`` int64, the locations of every row; an empty array stands for all 0.
``delta``
    a map row -> location (``resident``'s table, its values locations) of the rows whose
    location changed since the base was read, kept only while the base is read-only.

Today the base is an array in memory (``np.zeros``, or the base file read whole at open)
that changes in place, and the delta stays empty: :meth:`RowIndex.set` writes the base.
The delta is the seam for a base that is not all in memory (a read-only mapping of the
base file, ``docs/log-index-plan.md``): the kernels already look a row up through both.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .resident import LOAD, MIN_ENTRIES, find_one

__all__ = ["RowIndex", "loc_of", "locs_of"]


@njit(cache=True, nogil=True)
def loc_of(base, delta, row):
    """The location of ``row``: its delta entry, else its base entry (0 without a base)."""
    v = find_one(delta, row)
    if v >= 0:
        return v
    if base.shape[0]:
        return base[row]
    return 0


@njit(cache=True, nogil=True)
def locs_of(base, delta, rows, out):
    """``out[i]`` = the location of ``rows[i]``."""
    for k in range(rows.shape[0]):
        out[k] = loc_of(base, delta, rows[k])


@njit(cache=True, nogil=True)
def _upsert(delta, rows, locs):
    """Set the delta entry of each of ``rows`` to ``locs``; returns the new entries made."""
    n = delta.shape[0]
    made = 0
    for k in range(rows.shape[0]):
        row = rows[k]
        h = np.uint64(row) * np.uint64(0x9E3779B97F4A7C15)
        i = np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))
        while True:
            r = delta[i, 0]
            if r == row:
                delta[i, 1] = locs[k]
                break
            if r < 0:
                delta[i, 0] = row
                delta[i, 1] = locs[k]
                made += 1
                break
            i += 1
            if i == n:
                i = 0
    return made


def _table(entries: int) -> np.ndarray:
    return np.full((max(MIN_ENTRIES, LOAD * int(entries)), 2), -1, np.int64)


class RowIndex:
    """The row index of one open store (module docstring)."""

    def __init__(self, num_rows: int):
        self.num_rows = int(num_rows)
        self.base = np.zeros(self.num_rows, np.int64)  # anonymous: untouched pages cost 0
        self.delta = _table(0)
        self.entries = 0  # rows in the delta

    # -- lookups ---------------------------------------------------------------------------
    def get(self, rows: np.ndarray) -> np.ndarray:
        """The location of each of ``rows`` (checked int64 ids)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        out = np.empty(rows.shape[0], np.int64)
        locs_of(self.base, self.delta, rows, out)
        return out

    def chunks(self, rows: int):
        """Every row's location, in pieces of at most ``rows`` rows (a base file's parts)."""
        for lo in range(0, self.num_rows, rows):
            yield self.get(np.arange(lo, min(lo + rows, self.num_rows), dtype=np.int64))

    def all(self) -> np.ndarray:
        """Every row's location, as one array (checks)."""
        return self.get(np.arange(self.num_rows, dtype=np.int64))

    # -- changes ---------------------------------------------------------------------------
    def set(self, rows: np.ndarray, locs: np.ndarray) -> None:
        """Rows ``rows`` (unique) now lie at ``locs``."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if not rows.shape[0]:
            return
        if self.base.flags.writeable and self.base.shape[0]:
            self.base[rows] = locs
            return
        need = self.entries + rows.shape[0]
        if LOAD * need > self.delta.shape[0]:  # grow: at most half full
            self._regrow(max(need, 2 * self.entries))
        self.entries += _upsert(self.delta, rows, np.ascontiguousarray(locs, np.int64))

    def _regrow(self, entries: int) -> None:
        old = self.delta
        self.delta = _table(entries)
        keyed = old[:, 0] >= 0
        self.entries = _upsert(self.delta, old[keyed, 0].copy(), old[keyed, 1].copy())

    def adopt(self, base: np.ndarray) -> None:
        """Take ``base`` (checked: every row's location) as the base, with an empty delta
        (an open)."""
        self.base = base
        self.delta = _table(0)
        self.entries = 0
