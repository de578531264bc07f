"""Deterministic initial weights of a store: a pure function of (seed, row), for both kinds.

A log store never writes the rows nobody has updated: a row without a location in the index
reads as its initial record, computed on demand. So the initial weights must be a function
of the row id alone, not of a random stream consumed in row order. The in-place store
writes the same function's values at create (:func:`fill_weights`, in parallel), so the same
``create`` arguments give the same bits on both kinds.

Generator
    Counter-based: the row's key is ``k = mix(mix(seed ^ A) + row * G)`` and its ``c``-th
    random word is ``mix(k + c * G)``, with ``mix`` the SplitMix64 finaliser, ``G`` the 64-bit
    golden ratio and ``A`` a fixed constant. A word gives the uniform ``(word >> 11) * 2**-53``
    in ``[0, 1)``.
``"uniform"``
    Weight ``j`` is ``init_scale * (2 u - 1)`` with ``u`` the row's ``j``-th uniform: in
    ``[-init_scale, init_scale)``.
``"normal"``
    Columns ``2p`` and ``2p + 1`` are one pair of Marsaglia's polar method (attempt ``a`` of
    pair ``p`` uses words ``2 (256 p + a)`` and ``2 (256 p + a) + 1``; a rejected pair, 21.5 %
    of them, moves to the next attempt), scaled by ``init_scale``: ``N(0, init_scale**2)``.
    The logarithm is computed here with IEEE additions, multiplications and divisions only
    (``frexp`` and a series for ``atanh``), and the square root is IEEE's, so the bits do not
    depend on the C library of the machine.
``"zeros"``
    All zero.

Every value is computed in float64 and rounded once to the store dtype; m, v, the counters
and the padding are zero. With a ball radius (``ball_maxnorm``, Poincaré stores), a row whose
norm (summed in float64, rounded to the store dtype) exceeds it is scaled onto it in the store
dtype, ``(w / norm) * maxnorm``. The same (seed, row, dtype) give the same bits on every
machine and on both store kinds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
from numba import njit

from ._claim import first_span, next_span

__all__ = ["INIT_CHUNK_BYTES", "INIT_KINDS", "InitSpec", "chunks", "fill_weights",
           "initial_records", "initial_weights", "progress_bar"]

INIT_KINDS = ("zeros", "normal", "uniform")
_KIND_CODE = {"normal": 1, "uniform": 2}

_G = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: SplitMix64's increment
_A = np.uint64(0xD1B54A32D192ED03)  # separates the seed's key from a row's words
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TWO_M53 = 1.0 / 9007199254740992.0  # 2**-53
_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476


class InitSpec(NamedTuple):
    """What a never-written row holds: the named init and where the weights sit."""

    kind: str                 # "zeros" | "normal" | "uniform"
    scale: float              # init_scale
    seed: int                 # 0 <= seed < 2**64
    maxnorm: float | None     # the ball's projection radius (Poincaré stores), else None
    dim: int
    w_off: int | None         # column of the weights in the record, None without weights
    stride: int
    dtype: np.dtype


@njit(cache=True, nogil=True)
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def _uniform(key, c):
    """The ``c``-th uniform in [0, 1) of the row whose key is ``key`` (53 random bits)."""
    w = _mix(key + np.uint64(c) * _G)
    return np.float64(w >> _S11) * _TWO_M53


@njit(cache=True, nogil=True)
def _ln(x):
    """Natural logarithm of a finite ``x > 0`` with IEEE basic operations only.

    ``x = m * 2**e`` with ``m`` in [sqrt(1/2), sqrt(2)) (``frexp``, exact), then
    ``ln m = 2 atanh(t)``, ``t = (m - 1) / (m + 1)``, ``|t| <= 0.172``: thirteen terms of the
    series leave an error below 1e-18 relative.
    """
    m, e = math.frexp(x)
    if m < _SQRT_HALF:
        m = m * 2.0
        e = e - 1
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    p = 1.0 / 25.0
    p = p * t2 + 1.0 / 23.0
    p = p * t2 + 1.0 / 21.0
    p = p * t2 + 1.0 / 19.0
    p = p * t2 + 1.0 / 17.0
    p = p * t2 + 1.0 / 15.0
    p = p * t2 + 1.0 / 13.0
    p = p * t2 + 1.0 / 11.0
    p = p * t2 + 1.0 / 9.0
    p = p * t2 + 1.0 / 7.0
    p = p * t2 + 1.0 / 5.0
    p = p * t2 + 1.0 / 3.0
    p = p * t2 + 1.0
    return np.float64(e) * _LN2 + 2.0 * t * p


@njit(cache=True, nogil=True)
def _row_weights(key, kind, scale, out, buf):
    """``out[:]`` = the initial weights (float64) of the row whose key is ``key``; ``buf``:
    scratch of shape (5, (dim + 1) // 2)."""
    d = out.shape[0]
    if kind == 2:  # uniform in [-scale, scale)
        for j in range(d):
            out[j] = scale * (2.0 * _uniform(key, j) - 1.0)
        return
    _normal_row(key, scale, out, buf)


_EXP_MASK = np.uint64(0x7FF << 52)
_HALF_EXP = np.uint64(1022 << 52)  # the exponent field of [0.5, 1)
_S52 = np.uint64(52)


@njit(cache=True, nogil=True)
def _normal_row(key, scale, out, buf):
    """The ``"normal"`` weights (float64) of one row into ``out``; ``buf`` is scratch of
    shape (5, pairs).

    The values of the module's polar method, computed in passes that the compiler can
    vectorise: every pair's first attempt, then the rare rejected pairs one by one, then
    the logarithm of all pairs (``frexp`` from the bits: ``s`` is a normal number, as
    ``v**2 >= 2**-104``), then the scaling. Each value sees the same IEEE operations in the
    same order as a straight loop would apply, so the bits are the same.
    """
    d = out.shape[0]
    npair = (d + 1) // 2
    v1b, v2b, sb, mb, eb = buf[0], buf[1], buf[2], buf[3], buf[4]
    for p in range(npair):  # attempt 0 of every pair: words 512 p, 512 p + 1
        c = 512 * p
        v1 = 2.0 * _uniform(key, c) - 1.0
        v2 = 2.0 * _uniform(key, c + 1) - 1.0
        v1b[p] = v1
        v2b[p] = v2
        sb[p] = v1 * v1 + v2 * v2
    for p in range(npair):  # a rejected pair (21.5 %) tries attempts 1, 2, ... in turn
        s = sb[p]
        if 0.0 < s < 1.0:
            continue
        v1b[p] = 0.0  # 256 rejected attempts: the pair is (0, 0)
        v2b[p] = 0.0
        sb[p] = 0.5
        c = 512 * p + 2  # words 2 (256 p + a), 2 (256 p + a) + 1 of attempt a
        end = 512 * p + 512  # 0.215**256: never exhausted in practice
        while c < end:
            v1 = 2.0 * _uniform(key, c) - 1.0
            v2 = 2.0 * _uniform(key, c + 1) - 1.0
            s = v1 * v1 + v2 * v2
            if 0.0 < s < 1.0:
                v1b[p] = v1
                v2b[p] = v2
                sb[p] = s
                break
            c += 2
    sbits = sb.view(np.uint64)
    mbits = mb.view(np.uint64)
    for p in range(npair):  # frexp of a normal s in (0, 1): m in [0.5, 1), s = m 2**e
        b = sbits[p]
        mbits[p] = (b & ~_EXP_MASK) | _HALF_EXP
        eb[p] = np.float64(np.int64((b & _EXP_MASK) >> _S52) - 1022)
    for p in range(npair):
        m = mb[p]
        e = eb[p]
        if m < _SQRT_HALF:
            m = m * 2.0
            e = e - 1.0
        t = (m - 1.0) / (m + 1.0)
        t2 = t * t
        q = 1.0 / 25.0
        q = q * t2 + 1.0 / 23.0
        q = q * t2 + 1.0 / 21.0
        q = q * t2 + 1.0 / 19.0
        q = q * t2 + 1.0 / 17.0
        q = q * t2 + 1.0 / 15.0
        q = q * t2 + 1.0 / 13.0
        q = q * t2 + 1.0 / 11.0
        q = q * t2 + 1.0 / 9.0
        q = q * t2 + 1.0 / 7.0
        q = q * t2 + 1.0 / 5.0
        q = q * t2 + 1.0 / 3.0
        q = q * t2 + 1.0
        s = sb[p]
        f = math.sqrt(-2.0 * (e * _LN2 + 2.0 * t * q) / s)  # _ln(s), inlined
        mb[p] = scale * (v1b[p] * f)
        eb[p] = scale * (v2b[p] * f)
    for p in range(d // 2):
        out[2 * p] = mb[p]
        out[2 * p + 1] = eb[p]
    if d % 2:
        out[d - 1] = mb[npair - 1]


@njit(cache=True, nogil=True)
def _weights(rows, seed, kind, scale, out):
    """``out[i, :]`` = the initial weights (float64) of row ``rows[i]``."""
    skey = _mix(np.uint64(seed) ^ _A)
    buf = np.empty((5, (out.shape[1] + 1) // 2), np.float64)
    for i in range(rows.shape[0]):
        _row_weights(_mix(skey + np.uint64(rows[i]) * _G), kind, scale, out[i], buf)


@njit(cache=True, nogil=True)
def _project_row(w, mn, tmp):
    """Scale the row ``w`` (store dtype) onto the radius ``mn[0]`` if its norm exceeds it.

    The norm is summed in float64 and rounded to the store dtype (``tmp``, one element), the
    scaling ``(w / norm) * mn`` runs in the store dtype.
    """
    d = w.shape[0]
    sq = 0.0
    for j in range(d):
        x = np.float64(w[j])
        sq += x * x
    tmp[0] = math.sqrt(sq)
    nrm = tmp[0]
    if nrm > mn[0]:
        for j in range(d):
            w[j] = (w[j] / nrm) * mn[0]


@njit(cache=True, nogil=True)
def _project(w, mn, tmp):
    """:func:`_project_row` for each row of ``w``."""
    for i in range(w.shape[0]):
        _project_row(w[i], mn, tmp)


@njit(cache=True, nogil=True)
def _fill_block(out, first, seed, kind, scale, mn, lo, hi, ctl=None):
    """Rows ``lo..hi-1`` of ``out`` (store dtype) = the initial weights of rows
    ``first + lo ..``, each computed in float64, rounded once, then projected when ``mn``
    holds a radius (one element; empty: no ball): the bits of :func:`initial_weights`."""
    w64 = np.empty(out.shape[1], np.float64)
    buf = np.empty((5, (out.shape[1] + 1) // 2), np.float64)
    tmp = np.empty(1, mn.dtype)
    skey = _mix(np.uint64(seed) ^ _A)
    c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
    while c0 < c1:
        for i in range(c0, c1):
            _row_weights(_mix(skey + np.uint64(first + i) * _G), kind, scale, w64, buf)
            row = out[i]
            for j in range(w64.shape[0]):
                row[j] = w64[j]
            if mn.shape[0]:
                _project_row(row, mn, tmp)
        c0, c1 = next_span(ctl, lo, hi, c0, c1)


def initial_weights(rows: np.ndarray, spec: InitSpec) -> np.ndarray:
    """The initial weights of ``rows`` (int64, any order, duplicates allowed), shape
    ``(len(rows), dim)`` in the store dtype (zeros for ``"zeros"``)."""
    n = rows.shape[0]
    if spec.kind == "zeros":
        return np.zeros((n, spec.dim), spec.dtype)
    w64 = np.empty((n, spec.dim), np.float64)
    _weights(np.ascontiguousarray(rows, np.int64), np.uint64(spec.seed), _KIND_CODE[spec.kind],
             float(spec.scale), w64)
    w = w64.astype(spec.dtype)
    if spec.maxnorm is not None and n:
        _project(w, np.array([spec.maxnorm], spec.dtype), np.empty(1, spec.dtype))
    return w


def initial_records(rows: np.ndarray, spec: InitSpec) -> np.ndarray:
    """The whole initial records of ``rows``: shape ``(len(rows), stride)``, store dtype.

    Weights as :func:`initial_weights` (when the layout has them), everything else zero.

    >>> import numpy as np
    >>> spec = InitSpec("normal", 0.1, 7, None, 4, 0, 12, np.dtype(np.float32))
    >>> a = initial_records(np.array([5, 2, 5]), spec)
    >>> a.shape, bool((a[0] == a[2]).all()), bool((a[:, 4:] == 0).all())
    ((3, 12), True, True)
    """
    out = np.zeros((rows.shape[0], spec.stride), spec.dtype)
    if spec.w_off is not None and spec.kind != "zeros":
        out[:, spec.w_off:spec.w_off + spec.dim] = initial_weights(rows, spec)
    return out


def fill_weights(out: np.ndarray, first: int, spec: InitSpec) -> None:
    """Write the initial weights of rows ``first, first + 1, ...`` into ``out`` in place.

    ``out`` is a ``(n, dim)`` array of the store dtype, typically the weight columns of a
    block of mapped records (any strides). The values are those of :func:`initial_weights`
    bit for bit; the rows are spread over the kernels' thread pool (each row is computed by
    one thread, so the result does not depend on the number of threads).
    """
    from ._pool import run_chunked
    if spec.kind == "zeros":
        out[...] = 0
        return
    mn = np.array([] if spec.maxnorm is None else [spec.maxnorm], spec.dtype)
    run_chunked(_fill_block, (out, int(first), np.uint64(spec.seed), _KIND_CODE[spec.kind],
                              float(spec.scale), mn), out.shape[0], 256)


INIT_CHUNK_BYTES = 1 << 24  # 16 MiB of records per initialisation chunk


def chunks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` blocks of ``rows`` rows covering ``range(n)`` (a create's chunks)."""
    for lo in range(0, n, rows):
        yield lo, min(n, lo + rows)


def progress_bar(total: int, enabled: bool | None, desc: str):
    """A tqdm bar over ``total`` chunks (None when disabled; by default past 8 chunks)."""
    if enabled is None:
        enabled = total > 8
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="chunk")
