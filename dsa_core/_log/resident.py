"""Which rows of a log store are in its region: a map from row id to slot, sized by the region.

The row index (``Pool.loc``) says where each row's newest on-disk record lies; whether a row
is resident, and in which slot, is this map's alone. It holds at most one entry per slot, so
its memory grows with the region, not with the table (the step towards an index that is not
all in memory: a hit never needs the row's location).

Layout: ``table`` is a ``(C, 2)`` int64 array of ``(row, slot)`` pairs, ``row == -1`` for an
empty entry, ``C = LOAD * slots`` entries, at least ``MIN_ENTRIES`` (at most half full:
one entry per resident row; at 2/3 full a lookup of a row that is not resident probed ~5
entries, 50 ns, against ~2 and 24 ns at 1/2; a hit costs ~7 ns, for 3M slots). Open addressing with linear probing from the row's hash (a
multiplicative hash, scaled to ``C`` without a division); a removal shifts the entries after
it back (no tombstones: a lookup stops at the first empty entry). One probe reads one cache
line: the key and its slot lie together. The kernels take the array and plain ints (njit),
so the pool's other kernels (eviction, the cleaner's scans) call them inline.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .._intrinsics import prefetch_line_addr

__all__ = ["AHEAD", "BYTES_PER_SLOT", "LOAD", "find", "find_one", "insert", "new_table",
           "prefetch_home", "probe", "remove", "remove_one", "slots_of"]

LOAD = 2              # entries per slot: at most half of the entries are used
MIN_ENTRIES = 16
BYTES_PER_SLOT = 16 * LOAD  # 16 bytes per entry: what the budget charges per slot
_MULT = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Fibonacci hashing)
# the batch loops (find, insert, remove) prefetch the home entry of the row this many ahead:
# a map of millions of slots lies far outside the caches, and a lookup's one cache miss is
# then most of its cost (1.5x faster per batch on a 10M-slot map: docs/notebook.md)
AHEAD = 8


def new_table(slots: int) -> np.ndarray:
    """An empty map for a region of ``slots`` slots."""
    n = max(MIN_ENTRIES, LOAD * int(slots))
    return np.full((n, 2), -1, np.int64)


@njit(cache=True, nogil=True, inline="always")
def _home(row, n):
    h = np.uint64(row) * _MULT
    return np.int64(((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32))


@njit(cache=True, nogil=True, inline="always")
def prefetch_home(table, row):
    """Hint that ``row``'s home entry of ``table`` will be read soon (no fault, no effect)."""
    prefetch_line_addr(table.ctypes.data + _home(row, table.shape[0]) * table.strides[0])


@njit(cache=True, nogil=True)
def probe(table, row):
    """The entry of ``table`` that holds ``row``, or the empty one where it would go."""
    n = table.shape[0]
    i = _home(row, n)
    while True:
        r = table[i, 0]
        if r == row or r < 0:
            return i
        i += 1
        if i == n:
            i = 0


@njit(cache=True, nogil=True)
def find_one(table, row):
    """The slot of ``row``, or -1 when it is not resident."""
    i = probe(table, row)
    return table[i, 1] if table[i, 0] == row else -1


@njit(cache=True, nogil=True)
def find(table, rows, out):
    """``out[i]`` = the slot of ``rows[i]``, -1 where it is not resident; returns the hits."""
    hits = 0
    m = rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            prefetch_home(table, rows[k + AHEAD])
        s = find_one(table, rows[k])
        out[k] = s
        if s >= 0:
            hits += 1
    return hits


@njit(cache=True, nogil=True)
def insert(table, rows, slots):
    """Map each of ``rows`` (not resident, unique) to its slot in ``slots``."""
    m = rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            prefetch_home(table, rows[k + AHEAD])
        i = probe(table, rows[k])
        table[i, 0] = rows[k]
        table[i, 1] = slots[k]


@njit(cache=True, nogil=True)
def remove_one(table, row):
    """Unmap ``row`` (a no-op when it is not resident): backward-shift deletion."""
    n = table.shape[0]
    i = probe(table, row)
    if table[i, 0] != row:
        return
    # entries after the hole whose home lies at or before it (cyclically) move into it
    j = i
    while True:
        j += 1
        if j == n:
            j = 0
        r = table[j, 0]
        if r < 0:
            break
        h = _home(r, n)
        # r may move from j to the hole i unless its home lies cyclically in (i, j]
        if (j > i and (h <= i or h > j)) or (j < i and (h <= i and h > j)):
            table[i, 0] = r
            table[i, 1] = table[j, 1]
            i = j
    table[i, 0] = -1
    table[i, 1] = -1


@njit(cache=True, nogil=True)
def remove(table, rows):
    """Unmap each of ``rows``."""
    m = rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            prefetch_home(table, rows[k + AHEAD])
        remove_one(table, rows[k])


def slots_of(table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The slot of each of ``rows`` (int64 ids), -1 where not resident."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    out = np.empty(rows.shape[0], np.int64)
    find(table, rows, out)
    return out
