"""Deterministic initial records of a log-structured store: a pure function of (seed, row).

A log store never writes the rows nobody has updated: a row without a location in the index
reads as its initial record, computed on demand. So the initial weights must be a function
of the row id alone, not of a random stream consumed in row order (as the in-place store's
``numpy.random.default_rng(seed)`` fill is). The two fills therefore give different numbers
for the same seed; converting a store between the two formats copies the rows explicitly.

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
dtype, ``(w / norm) * maxnorm``, as the in-place fill does. The same (seed, row, dtype) give
the same bits on every machine.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

__all__ = ["INIT_KINDS", "InitSpec", "initial_records"]

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
def _weights(rows, seed, kind, scale, out):
    """``out[i, :]`` = the initial weights (float64) of row ``rows[i]``."""
    skey = _mix(np.uint64(seed) ^ _A)
    d = out.shape[1]
    for i in range(rows.shape[0]):
        key = _mix(skey + np.uint64(rows[i]) * _G)
        if kind == 2:  # uniform in [-scale, scale)
            for j in range(d):
                out[i, j] = scale * (2.0 * _uniform(key, j) - 1.0)
            continue
        for p in range((d + 1) // 2):  # normal: one polar pair per two columns
            z0 = 0.0
            z1 = 0.0
            for a in range(256):  # 0.215**256: never exhausted in practice
                c = 2 * (256 * p + a)
                v1 = 2.0 * _uniform(key, c) - 1.0
                v2 = 2.0 * _uniform(key, c + 1) - 1.0
                s = v1 * v1 + v2 * v2
                if 0.0 < s < 1.0:
                    f = math.sqrt(-2.0 * _ln(s) / s)
                    z0 = v1 * f
                    z1 = v2 * f
                    break
            out[i, 2 * p] = scale * z0
            if 2 * p + 1 < d:
                out[i, 2 * p + 1] = scale * z1


@njit(cache=True, nogil=True)
def _project(w, mn, tmp):
    """Scale each row of ``w`` (store dtype) whose norm exceeds ``mn[0]`` onto that radius.

    The norm is summed in float64 and rounded to the store dtype (``tmp``, one element), the
    scaling ``(w / norm) * mn`` runs in the store dtype.
    """
    d = w.shape[1]
    for i in range(w.shape[0]):
        sq = 0.0
        for j in range(d):
            x = np.float64(w[i, j])
            sq += x * x
        tmp[0] = math.sqrt(sq)
        nrm = tmp[0]
        if nrm > mn[0]:
            for j in range(d):
                w[i, j] = (w[i, j] / nrm) * mn[0]


def initial_weights(rows: np.ndarray, spec: InitSpec) -> np.ndarray:
    """The initial weights of ``rows`` (int64, any order, duplicates allowed), shape
    ``(len(rows), dim)`` in the store dtype (zeros for ``"zeros"``)."""
    n = rows.shape[0]
    if spec.kind == "zeros":
        return np.zeros((n, spec.dim), spec.dtype)
    w64 = np.empty((n, spec.dim), np.float64)
    _weights(np.ascontiguousarray(rows, np.int64), spec.seed, _KIND_CODE[spec.kind],
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
