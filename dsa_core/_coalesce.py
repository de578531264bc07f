"""Numba helpers of the glue: duplicate coalescing, row gather and scatter.

Coalescing in NumPy (``np.add.at`` or argsort + ``np.add.reduceat``) cost 1.4-1.7 ms for a
2048 x 128 batch, more than the Adam kernel itself (STYLE.md §0.7); here it is one stable
sort plus one pass over the unique ids, chunked over threads (0.14 ms serial for 2048 x 128).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._pool import run_chunked


def _stable_order(idx):
    """Positions of ``idx`` sorted by id, ties in order of appearance (a stable argsort).

    Sorting the composite keys ``id * B + position`` with numpy's (SIMD) sort is stable by
    construction and took 40 us for 2048 ids, against 88 us for numba's mergesort argsort.
    """
    b = idx.shape[0]
    if b and int(idx.max()) < (1 << 62) // b:
        key = idx * b + np.arange(b, dtype=np.int64)
        key.sort()
        return key % b
    return np.argsort(idx, kind="stable")


@njit(cache=True, nogil=True)
def _segments(idx, order):
    """Start of each run of equal ids in ``idx[order]`` (plus the end)."""
    b = idx.shape[0]
    starts = np.empty(b + 1, np.int64)
    u = 0
    for t in range(b):
        if t == 0 or idx[order[t]] != idx[order[t - 1]]:
            starts[u] = t
            u += 1
    starts[u] = b
    return starts[:u + 1]


@njit(cache=True, nogil=True, error_model="numpy")
def _segment_sums(idx, G, order, starts, uidx, Gc, lo, hi):
    """``Gc[u]`` = sum of segment ``u``'s rows in order of appearance, for ``lo <= u < hi``."""
    d = G.shape[1]
    for u in range(lo, hi):
        s = starts[u]
        e = starts[u + 1]
        k = order[s]
        uidx[u] = idx[k]
        out = Gc[u]
        src = G[k]
        for j in range(d):
            out[j] = src[j]
        for t in range(s + 1, e):
            src = G[order[t]]
            for j in range(d):
                out[j] += src[j]


def coalesce(idx, G, want_inverse=False):
    """Sum the gradient rows of duplicate ids (spec §1.1).

    Returns ``(uidx, Gc, inv)``: ``uidx`` the sorted unique ids, ``Gc[u]`` the sum of the
    rows ``G[k]`` with ``idx[k] == uidx[u]`` added **in order of appearance** (stable sort),
    and ``inv[k]`` the position of ``idx[k]`` in ``uidx`` (``None`` unless ``want_inverse``).
    One serial stable sort, then the sums in parallel over the unique ids.
    """
    order = _stable_order(idx)
    starts = _segments(idx, order)
    nuniq = starts.shape[0] - 1
    uidx = np.empty(nuniq, np.int64)
    Gc = np.empty((nuniq, G.shape[1]), G.dtype)
    run_chunked(_segment_sums, (idx, G, order, starts, uidx, Gc), nuniq,
                max(16, 16384 // max(1, G.shape[1])))
    inv = None
    if want_inverse:
        inv = np.empty(idx.shape[0], np.int64)
        inv[order] = np.repeat(np.arange(nuniq, dtype=np.int64), np.diff(starts))
    return uidx, Gc, inv


@njit(cache=True, nogil=True)
def gather_rows(src, rows, off, out, lo, hi):
    """``out[i, :] = src[rows[i], off:off + out.shape[1]]`` for ``lo <= i < hi``."""
    d = out.shape[1]
    for i in range(lo, hi):
        r = rows[i]
        for j in range(d):
            out[i, j] = src[r, off + j]


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
