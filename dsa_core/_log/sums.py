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
from numba import carray, njit

from .._claim import first_span, next_span
from .._intrinsics import prefetch_line_addr, u8_ptr

__all__ = ["KIND_NONE", "KIND_ONE", "KIND_SPLIT", "fill_sums", "gather_checked",
           "head_bytes", "record_pitch", "record_sums", "split_sums"]

_AHEAD = 8  # gather_checked prefetches the record this many ahead
# how a record read from a segment is checked (``gather_checked``'s ``kinds``)
KIND_NONE = 0   # not at all (a pending segment's buffer: never left memory)
KIND_ONE = 2    # one sum of the whole record, in the segment's sums part (segment version 2)
KIND_SPLIT = 3  # two sums beside the record: of its head (the weights) and of the rest (3)

@njit(cache=True, nogil=True, inline="always")
def _rotl(x, r):
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@njit(cache=True, nogil=True, inline="always")
def _hash_row(w):
    """The hash of one record's 32-bit words ``w`` (1-D uint32)."""
    p1 = np.uint64(0x9E3779B185EBCA87)
    p2 = np.uint64(0xC2B2AE3D27D4EB4F)
    p3 = np.uint64(0x165667B19E3779F9)
    p4 = np.uint64(0x85EBCA77C2B2AE63)
    sh32 = np.uint64(32)
    nw = w.shape[0]
    full = nw - nw % 8
    a0 = p1 + p2
    a1 = p2
    a2 = np.uint64(0)
    a3 = np.uint64(0) - p1
    j = 0
    while j < full:
        v0 = np.uint64(w[j]) | (np.uint64(w[j + 1]) << sh32)
        v1 = np.uint64(w[j + 2]) | (np.uint64(w[j + 3]) << sh32)
        v2 = np.uint64(w[j + 4]) | (np.uint64(w[j + 5]) << sh32)
        v3 = np.uint64(w[j + 6]) | (np.uint64(w[j + 7]) << sh32)
        a0 = _rotl(a0 + v0 * p2, 31) * p1
        a1 = _rotl(a1 + v1 * p2, 31) * p1
        a2 = _rotl(a2 + v2 * p2, 31) * p1
        a3 = _rotl(a3 + v3 * p2, 31) * p1
        j += 8
    h = _rotl(a0, 1) + _rotl(a1, 7) + _rotl(a2, 12) + _rotl(a3, 18)
    while j < nw:  # the words past the last group of eight
        h = _rotl(h ^ (np.uint64(w[j]) * p1), 23) * p2 + p4
        j += 1
    h += np.uint64(nw)
    h ^= h >> np.uint64(33)
    h *= p2
    h ^= h >> np.uint64(29)
    h *= p3
    h ^= h >> sh32
    return h


@njit(cache=True, nogil=True)
def _sums(words, out):
    """``out[i]`` = the hash of row ``i`` of ``words`` ((k, nw) uint32, C order)."""
    for i in range(words.shape[0]):
        out[i] = _hash_row(words[i])


@njit(cache=True, nogil=True)
def _sums_split(words, hw, out):
    """``out[i]`` = the hashes of words ``[0, hw)`` and ``[hw, nw)`` of row ``i``."""
    for i in range(words.shape[0]):
        out[i, 0] = _hash_row(words[i, :hw])
        out[i, 1] = _hash_row(words[i, hw:])


@njit(cache=True, nogil=True)
def gather_checked(addrs, sum_addrs, kinds, rec_bytes, head, b0, b1, out, dest, bad, lo, hi,
                   ctl=None):
    """Copy the records at the addresses ``addrs[lo:hi]`` into ``out[dest[i]]`` (its bytes
    ``b0:b1`` of each record) and check each against its sums at ``sum_addrs[i]``, as
    ``kinds[i]`` says (``KIND_*``: none, one sum of the record, or the sums of its first
    ``head`` bytes and of the rest -- of which only the head's when the bytes served lie
    in the head: ``gather`` of the weights hashes the weights alone); where it fails,
    ``bad[i] = 1`` and ``out[dest[i]]`` is not written. ``out``: the destination rows as
    bytes ((n, b1 - b0) uint8, C order).

    Hashed while copied: each record is copied once, whole, into a scratch row, hashed
    there, and the bytes served are taken from that same copy, so what is checked is what
    is served (a mapping read twice could change in between). One call for a whole batch,
    whatever the number of segments its records lie in (a check per segment cost ~35 us
    of Python each: 3.8 ms per step at a 25% region whose misses hit ~110 segments). The
    caller holds the segments (their mappings or buffers) for the duration."""
    tmp = np.empty(rec_bytes, np.uint8)
    words = tmp.view(np.uint32)
    hw = head // 4
    head_only = b1 <= 4 * hw  # the bytes served lie in the head: its sum alone checks them
    width = b1 - b0
    served = tmp[b0:b1]  # the bytes served, of the checked copy
    c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
    while c0 < c1:
        for i in range(c0, c1):
            if i + _AHEAD < hi:  # every line the copy of a later record reads, and its sums:
                j = i + _AHEAD   # the hash's dependent chain stalls the core, so the hardware
                kj = kinds[j]    # would not run ahead to them on its own (433 -> 289 ns a row)
                if kj == KIND_NONE:
                    a, nb = addrs[j] + b0, width
                else:
                    a, nb = addrs[j], (4 * hw if kj == KIND_SPLIT and head_only else rec_bytes)
                    prefetch_line_addr(sum_addrs[j])
                for c in range(0, nb, 64):
                    prefetch_line_addr(a + c)
            kind = kinds[i]
            row = out[dest[i]]
            if kind == KIND_NONE:  # not checked (a pending segment's buffer): the bytes served
                src = carray(u8_ptr(addrs[i] + b0), (width,))
                for j in range(width):
                    row[j] = src[j]
                continue
            n = 4 * hw if kind == KIND_SPLIT and head_only else rec_bytes  # bytes hashed
            src = carray(u8_ptr(addrs[i]), (n,))
            for j in range(n):
                tmp[j] = src[j]
            sums = carray(u8_ptr(sum_addrs[i]), (16 if kind == KIND_SPLIT else 8,)).view(np.uint64)
            if kind == KIND_SPLIT:
                ok = _hash_row(words[:hw]) == sums[0] and (
                    head_only or _hash_row(words[hw:]) == sums[1])
            else:
                ok = _hash_row(words) == sums[0]
            if not ok:
                bad[i] = 1  # never served: its row is left as it was
                continue
            for j in range(width):  # a view, not tmp[b0 + j]: numba's negative-index check
                row[j] = served[j]  # on b0 + j kept this copy scalar (+170 ns a 512-B row)
        c0, c1 = next_span(ctl, lo, hi, c0, c1)


def record_sums(records: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The checksum of each record of ``records`` ((k, stride), any store dtype): uint64 (k,)."""
    rec = np.ascontiguousarray(records)
    k = rec.shape[0]
    if out is None:
        out = np.empty(k, np.uint64)
    if k:
        _sums(rec.reshape(k, -1).view(np.uint32), out)
    return out


def split_sums(records: np.ndarray, head: int, out: np.ndarray | None = None) -> np.ndarray:
    """The two checksums of each record of ``records`` ((k, stride), any store dtype) beside
    it in a version-3 segment: of its first ``head`` bytes (a multiple of 4: the weights,
    :func:`head_bytes`) and of the rest; uint64 (k, 2)."""
    rec = np.ascontiguousarray(records)
    k = rec.shape[0]
    if out is None:
        out = np.empty((k, 2), np.uint64)
    if k:
        _sums_split(rec.reshape(k, -1).view(np.uint32), int(head) // 4, out)
    return out


def head_bytes(w_off, dim: int, itemsize: int) -> int:
    """The bytes of a record that its first sum covers: its weights (the whole 4-byte words
    of them, at the record's start; what ``gather`` serves), 0 for a store without."""
    return 0 if w_off is None else (int(dim) * int(itemsize)) // 4 * 4


def record_pitch(rec_bytes: int, version: int = 3) -> int:
    """Bytes from one record of a segment file to the next: the record's own ``rec_bytes``,
    and for ``version`` 3 its two sums after it (on a multiple of 8 bytes)."""
    rb = int(rec_bytes)
    return -(-rb // 8) * 8 + 16 if version >= 3 else rb


def fill_sums(raw: np.ndarray, rec_bytes: int, head: int) -> None:
    """Rows laid out as in a version-3 segment ((k, pitch) bytes, C order, the record in
    each row's first ``rec_bytes``): write each row's two sums (:func:`split_sums`) into its
    last 16 bytes and zero the bytes between, in place."""
    if raw.shape[0]:
        rb, at = int(rec_bytes), raw.shape[1] - 16
        raw[:, rb:at] = 0
        _sums_split(raw[:, :rb].view(np.uint32), int(head) // 4, raw[:, at:].view(np.uint64))
