"""Per-record checksums of a log store's segments: a 64-bit hash of each record's bytes.

A segment (format version 2, ``format``) stores one ``uint64`` per record, computed when
the record is sealed; every record read back from a segment file (a miss of ``acquire``,
``read``/``gather``/export/convert, a cleaning copy, ``dsa verify``) is hashed again and
compared, so a damaged record is named, never served nor copied into a fresh segment.

The hash is four independent 64-bit multiply-rotate lanes over the record's 32-bit words
(the round of xxHash64), merged and avalanched: a change of any word changes its lane's
state bijectively, so a flipped bit is always seen before the merge and missed after it
with a chance of about 2**-64. It runs at memory speed (several GB/s per core), a small
share of the disk read that brought the record in.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["record_sums"]

@njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, nogil=True)
def _sums(words, out):
    """``out[i]`` = the hash of row ``i`` of ``words`` ((k, nw) uint32, C order)."""
    p1 = np.uint64(0x9E3779B185EBCA87)
    p2 = np.uint64(0xC2B2AE3D27D4EB4F)
    p3 = np.uint64(0x165667B19E3779F9)
    p4 = np.uint64(0x85EBCA77C2B2AE63)
    sh32 = np.uint64(32)
    nw = words.shape[1]
    full = nw - nw % 8
    for i in range(words.shape[0]):
        a0 = p1 + p2
        a1 = p2
        a2 = np.uint64(0)
        a3 = np.uint64(0) - p1
        j = 0
        while j < full:
            v0 = np.uint64(words[i, j]) | (np.uint64(words[i, j + 1]) << sh32)
            v1 = np.uint64(words[i, j + 2]) | (np.uint64(words[i, j + 3]) << sh32)
            v2 = np.uint64(words[i, j + 4]) | (np.uint64(words[i, j + 5]) << sh32)
            v3 = np.uint64(words[i, j + 6]) | (np.uint64(words[i, j + 7]) << sh32)
            a0 = _rotl(a0 + v0 * p2, 31) * p1
            a1 = _rotl(a1 + v1 * p2, 31) * p1
            a2 = _rotl(a2 + v2 * p2, 31) * p1
            a3 = _rotl(a3 + v3 * p2, 31) * p1
            j += 8
        h = _rotl(a0, 1) + _rotl(a1, 7) + _rotl(a2, 12) + _rotl(a3, 18)
        while j < nw:  # the words past the last group of eight
            h = _rotl(h ^ (np.uint64(words[i, j]) * p1), 23) * p2 + p4
            j += 1
        h += np.uint64(nw)
        h ^= h >> np.uint64(33)
        h *= p2
        h ^= h >> np.uint64(29)
        h *= p3
        h ^= h >> sh32
        out[i] = h


def record_sums(records: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The checksum of each record of ``records`` ((k, stride), any store dtype): uint64 (k,)."""
    rec = np.ascontiguousarray(records)
    k = rec.shape[0]
    if out is None:
        out = np.empty(k, np.uint64)
    if k:
        _sums(rec.reshape(k, -1).view(np.uint32), out)
    return out
