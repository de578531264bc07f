"""Vectorised NumPy transcription of the spec: the test oracle for the Numba kernels.

Slow and simple on purpose. Works on plain ``(n, dim)`` arrays ``P, M, V`` (``V`` is
``(n, 1)`` for the ball) that it updates in place, with the step count ``t`` already
incremented.
"""

from __future__ import annotations

import math

import numpy as np


def coalesce_ref(idx, G):
    """Sorted unique ids and the duplicate sums, added in order of appearance."""
    idx = np.asarray(idx, dtype=np.int64)
    uidx, inv = np.unique(idx, return_inverse=True)
    Gc = np.zeros((uidx.shape[0], G.shape[1]), G.dtype)
    seen = np.zeros(uidx.shape[0], bool)
    for k in range(idx.shape[0]):
        u = inv[k]
        if seen[u]:
            Gc[u] += G[k]
        else:
            Gc[u] = G[k]
            seen[u] = True
    return uidx, Gc


def euclid_step(P, M, V, idx, G, t, *, lr, betas=(0.9, 0.999), eps=1e-8, maximize=False):
    """torch.optim.SparseAdam, docs/algorithms.md §2.2, on the rows of ``idx``."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    b1, b2 = betas
    a1, a2, e = T(1 - b1), T(1 - b2), T(eps)
    m, v, p = M[uidx], V[uidx], P[uidx]
    dm = (g - m) * a1
    dv = (g * g - v) * a2
    m2 = m + dm
    v2 = v + dv
    den = np.sqrt(v2) + e
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    s = (lr * math.sqrt(bc2)) / bc1
    M[uidx] = m2
    V[uidx] = v2
    P[uidx] = p + T(-s) * ((dm + m) / den)


def euclid_rowwise_step(P, M, V, idx, G, t, *, lr, betas=(0.9, 0.999), eps=1e-8,
                        maximize=False):
    """Partial row-wise Adam (docs/algorithms.md §7.3, FBGEMM PARTIAL_ROWWISE_ADAM); ``V`` is
    (n, 1)."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    b1, b2 = betas
    a1, a2 = T(1 - b1), T(1 - b2)
    m, v, p = M[uidx], V[uidx], P[uidx]
    m2 = m + (g - m) * a1
    q = (g * g).astype(np.float64).sum(axis=1, keepdims=True) / g.shape[1]
    v2 = v + (q.astype(P.dtype) - v) * a2
    bc1, bc2 = T(1 - b1**t), T(1 - b2**t)
    den = np.sqrt(v2 / bc2) + T(eps)
    M[uidx] = m2
    V[uidx] = v2
    P[uidx] = p + T(-lr) * ((m2 / bc1) / den)


def sr_bits(t, rows, d):
    """The kernels' random bits (``_kernels_euclid.sr_bits``) for ``rows`` x ``d``."""
    key = (np.uint64(t) << np.uint64(32)) ^ (
        np.asarray(rows).astype(np.uint64)[:, None] * np.uint64(d)
        + np.arange(d, dtype=np.uint64)[None, :])
    z = key + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(48)


def bf16_round(x, rnd):
    """float32 ``x`` rounded stochastically to bfloat16 with 16 random bits ``rnd`` (uint64),
    returned as float32 values; Inf stays Inf, NaN stays NaN (docs/algorithms.md §6)."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    special = (b & np.uint64(0x7F800000)) == np.uint64(0x7F800000)
    nan_bit = np.where((b & np.uint64(0x007FFFFF)) != 0, np.uint64(0x40), np.uint64(0))
    hi = np.where(special, (b >> np.uint64(16)) | nan_bit, (b + rnd) >> np.uint64(16))
    return (hi.astype(np.uint32) << np.uint32(16)).view(np.float32)


def euclid_bf16m_step(P, M, V, idx, G, t, *, rowwise, lr, betas=(0.9, 0.999), eps=1e-8,
                      maximize=False):
    """float32 Euclidean step with m stored as bfloat16 (``M`` holds bf16 values as float32):
    the full-precision step (:func:`euclid_step`, or :func:`euclid_rowwise_step`) from the
    stored m -- which updates the weights with the unrounded new m -- then the touched rows'
    new m rounded stochastically with :func:`sr_bits` of (t, row, coordinate)."""
    if len(idx) == 0:
        return
    full = euclid_rowwise_step if rowwise else euclid_step
    full(P, M, V, idx, G, t, lr=lr, betas=betas, eps=eps, maximize=maximize)
    uidx = np.unique(np.asarray(idx, dtype=np.int64))
    M[uidx] = bf16_round(M[uidx], sr_bits(t, uidx, M.shape[1]))


def _rowdot(a, b):
    """Row inner products: products in T, sum in float64, rounded once to T."""
    return (a * b).astype(np.float64).sum(axis=1, keepdims=True).astype(a.dtype)


def maxnorm(c, ball_eps, dtype):
    """Largest norm kept by the projection, in T (docs/algorithms.md §4)."""
    T = np.dtype(dtype).type
    return (T(1) / np.sqrt(T(c) + T(1e-15))) * T(1 - ball_eps)


def lambda_x(x, k):
    T = x.dtype.type
    return T(2) / np.maximum(T(1) + k * _rowdot(x, x), T(1e-15))


def mobius_add(x, u, k):
    T = x.dtype.type
    xx, uu, xu = _rowdot(x, x), _rowdot(u, u), _rowdot(x, u)
    cx = (T(1) - (T(2) * k) * xu) - k * uu
    cu = T(1) + k * xx
    den = np.maximum((T(1) - (T(2) * k) * xu) + (k * k * xx) * uu, T(1e-15))
    return (cx * x + cu * u) / den


def project(y, mn):
    T = y.dtype.type
    nrm = np.maximum(np.sqrt(_rowdot(y, y)), T(1e-15))
    return np.where(nrm > mn, (y / nrm) * mn, y)


def gyration(a, b, w, k):
    T = a.dtype.type
    a2, b2, ab = _rowdot(a, a), _rowdot(b, b), _rowdot(a, b)
    aw, bw = _rowdot(a, w), _rowdot(b, w)
    K2 = k * k
    A = (((-K2) * aw) * b2 - k * bw) + ((T(2) * K2) * ab) * bw
    B = ((-K2) * bw) * a2 + k * aw
    D = (T(1) - (T(2) * k) * ab) + (K2 * a2) * b2
    return w + (T(2) * (A * a + B * b)) / np.maximum(D, T(1e-15))


def poincare_step(P, M, V, idx, G, t, *, curvature, lr, betas=(0.9, 0.999), eps=1e-8,
                  maximize=False, ball_eps=None):
    """geoopt SparseRiemannianAdam on Stereographic(k=-c), docs/algorithms.md §3.2; ``V`` is (n,
    1)."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    if ball_eps is None:
        ball_eps = 4e-3 if P.dtype == np.float32 else 1e-5
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    b1, b2 = betas
    k = T(-curvature)
    x, m, v = P[uidx], M[uidx], V[uidx]
    lam = lambda_x(x, k)
    l2 = lam * lam
    rg = g / l2
    m = m * T(b1) + T(1 - b1) * rg
    w = l2 * _rowdot(rg, rg)
    v = v * T(b2) + T(1 - b2) * w
    bc1 = 1 - b1**t
    bc2 = 1 - b2**t
    den = np.sqrt(v / T(bc2)) + T(eps)
    u = T(-lr) * ((m / T(bc1)) / den)
    y = project(x + u, maxnorm(curvature, ball_eps, P.dtype))  # retraction: x + u, projected
    m_t = (gyration(y, -x, m, k) * lam) / lambda_x(y, k)
    P[uidx] = y
    M[uidx] = m_t
    V[uidx] = v
