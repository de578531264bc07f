"""Numba helpers of the glue: duplicate coalescing, row gather and scatter.

Coalescing in NumPy (``np.add.at`` or argsort + ``np.add.reduceat``) cost 1.4-1.7 ms for a
2048 x 128 batch, more than the Adam kernel itself (STYLE.md §0.7); here it is one stable
sort plus one pass.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, error_model="numpy")
def coalesce(idx, G):
    """Sum the gradient rows of duplicate ids (spec §1.1).

    Returns ``(uidx, Gc, inv)``: ``uidx`` the sorted unique ids, ``Gc[u]`` the sum of the
    rows ``G[k]`` with ``idx[k] == uidx[u]`` added **in order of appearance** (stable sort),
    and ``inv[k]`` the position of ``idx[k]`` in ``uidx``.
    """
    b = idx.shape[0]
    d = G.shape[1]
    order = np.argsort(idx, kind="mergesort")
    inv = np.empty(b, np.int64)
    nuniq = 0
    prev = -1
    for t in range(b):
        r = idx[order[t]]
        if t == 0 or r != prev:
            nuniq += 1
            prev = r
        inv[order[t]] = nuniq - 1
    uidx = np.empty(nuniq, np.int64)
    Gc = np.zeros((nuniq, d), G.dtype)
    seen = np.zeros(nuniq, np.bool_)
    for t in range(b):
        k = order[t]
        u = inv[k]
        if not seen[u]:
            seen[u] = True
            uidx[u] = idx[k]
            for j in range(d):
                Gc[u, j] = G[k, j]
        else:
            for j in range(d):
                Gc[u, j] += G[k, j]
    return uidx, Gc, inv


@njit(parallel=True, cache=True, nogil=True)
def gather_rows(src, rows, off, out):
    """``out[i, :] = src[rows[i], off:off + out.shape[1]]``."""
    d = out.shape[1]
    for i in prange(rows.shape[0]):
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
