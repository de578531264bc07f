"""Numba helpers of the glue: duplicate coalescing, row gather and scatter.

Coalescing in NumPy (``np.add.at`` or argsort + ``np.add.reduceat``) costs more than the Adam
kernel itself (figures: docs/notebook.md, design measurements); here it is one hash pass over
the ids and, only when there are duplicates, one pass summing their rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._claim import first_span, next_span
from ._intrinsics import prefetch_line

_HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing


@njit(cache=True, nogil=True)
def _dedup(idx):
    """Unique ids in order of first appearance, and each position's unique number.

    Open addressing with linear probing in a table of at least twice ``len(idx)`` slots:
    one pass, no sort. Returns ``(uidx, inv, nuniq)`` with ``uidx[:nuniq]`` the unique ids and
    ``uidx[inv[k]] == idx[k]``.
    """
    b = idx.shape[0]
    bits = 1
    while (1 << bits) < 2 * b:
        bits += 1
    mask = (1 << bits) - 1
    slot_u = np.full(1 << bits, -1, np.int64)  # slot -> unique number, -1 = empty
    uidx = np.empty(b, np.int64)
    inv = np.empty(b, np.int64)
    nu = 0
    for k in range(b):
        x = idx[k]
        h = ((x * _HASH_MUL) >> (64 - bits)) & mask
        while True:
            u = slot_u[h]
            if u < 0:
                slot_u[h] = nu
                uidx[nu] = x
                inv[k] = nu
                nu += 1
                break
            if uidx[u] == x:
                inv[k] = u
                break
            h = (h + 1) & mask
    return uidx, inv, nu


@njit(cache=True, nogil=True, error_model="numpy")
def _sum_rows(G, inv, Gc):
    """``Gc[u]`` = sum of the rows ``G[k]`` with ``inv[k] == u``, added in order of appearance."""
    seen = np.zeros(Gc.shape[0], np.bool_)
    d = G.shape[1]
    for k in range(G.shape[0]):
        u = inv[k]
        out = Gc[u]
        src = G[k]
        if seen[u]:
            for j in range(d):
                out[j] += src[j]
        else:
            seen[u] = True
            for j in range(d):
                out[j] = src[j]


def coalesce(idx, G, want_inverse=False, out=None):
    """Sum the gradient rows of duplicate ids (docs/algorithms.md §1.1).

    Returns ``(uidx, Gc, inv)``: ``uidx`` the unique ids **in order of first appearance**,
    ``Gc[u]`` the sum of the rows ``G[k]`` with ``idx[k] == uidx[u]`` added in order of
    appearance, and ``inv[k]`` the position of ``idx[k]`` in ``uidx`` (``None`` unless
    ``want_inverse``). When ``idx`` has no duplicate, ``idx`` and ``G`` themselves come back
    (no copy) and ``inv`` is ``None`` (the identity). ``out``: an optional C-contiguous
    buffer of ``G``'s dtype with at least ``len(idx) * dim`` elements for ``Gc`` (a reused
    buffer saves the page faults of fresh memory on every step).

    One hash pass, no sort (rows are independent, docs/algorithms.md §1.1: any order will
    do), and no copy at all for a batch without duplicates, the common case: a stable sort
    plus segment sums copied every row.
    """
    uidx, inv, nu = _dedup(idx)
    if nu == idx.shape[0]:
        return idx, G, None
    if out is None:
        Gc = np.empty((nu, G.shape[1]), G.dtype)
    else:
        Gc = out[:nu * G.shape[1]].reshape(nu, G.shape[1])
    _sum_rows(G, inv, Gc)
    return uidx[:nu], Gc, (inv if want_inverse else None)


def max_repeats(idx) -> int:
    """The most times one id occurs in the int64 ids ``idx`` (0 when empty, 1 when none
    repeats): one hash pass, no sort. A caller whose framework sums duplicates its own way
    (torch's ``coalesce``) needs that sum only for ids that occur three times or more: a sum
    of two is the same in either order, and this core adds a pair the same way (the first
    copied, the second added)."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    if idx.shape[0] < 2:
        return int(idx.shape[0])
    _, inv, nu = _dedup(idx)
    if nu == idx.shape[0]:
        return 1
    return int(np.bincount(inv, minlength=nu).max())


_GATHER_AHEAD = 8  # rows of software-prefetch distance in gather_rows


@njit(cache=True, nogil=True)
def gather_rows(src, rows, off, out, lo, hi, ctl=None):
    """``out[i, :] = src[rows[i], off:off + out.shape[1]]`` for ``lo <= i < hi``.

    Each source row is a DRAM miss at a random place: prefetching the row a few ahead and
    copying through 1-D row views overlaps those misses (figures: docs/notebook.md, design
    measurements).
    """
    d = out.shape[1]
    line = 64 // src.itemsize
    n = rows.shape[0]
    c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
    while c0 < c1:
        for i in range(c0, c1):
            if i + _GATHER_AHEAD < n:
                r2 = rows[i + _GATHER_AHEAD]
                for c in range(off, off + d, line):
                    prefetch_line(src, r2, c)
            s = src[rows[i]][off:off + d]
            o = out[i]
            for j in range(d):
                o[j] = s[j]
        c0, c1 = next_span(ctl, lo, hi, c0, c1)


@njit(cache=True, nogil=True)
def is_strictly_increasing(idx):
    """True when ``idx`` is sorted and has no duplicates (the kernels' fast path)."""
    for t in range(1, idx.shape[0]):
        if idx[t] <= idx[t - 1]:
            return False
    return True


@njit(cache=True, nogil=True)
def bounds(idx):
    """``(min, max)`` of a non-empty id array, in one pass."""
    lo = idx[0]
    hi = idx[0]
    for t in range(1, idx.shape[0]):
        x = idx[t]
        if x < lo:
            lo = x
        if x > hi:
            hi = x
    return lo, hi
