"""Vectorised NumPy transcription of the spec: the test oracle for the Numba kernels.

Slow and simple on purpose. Works on plain ``(n, dim)`` arrays ``P, M, V`` (``V`` is
``(n, 1)`` for the ball) that it updates in place, with the step count ``t`` already
incremented. The Adagrad steps (§7.5) take the weights ``P`` and the accumulator ``S``
(``(n, dim)``, or ``(n, 1)`` row-wise) instead.

The options of docs/algorithms.md §7.1–§7.2, the same keywords for every step function:
``weight_decay`` (L2 alone; AdamW's decoupled decay with ``decoupled_weight_decay=True``),
``row_steps`` (an int array ``(n,)`` of per-row update counts, updated in place: passing it
means ``per_row_step``), ``last_steps`` (an int array ``(n,)`` of the step of each row's last
update, 0 for never, updated in place: passing it means ``decay_missed_steps``, whose catch-up
applies with decoupled decay). The per-row powers are Python's ``b ** t`` (libm ``pow``), one
row at a time, as the kernels and the glue compute them.
"""

from __future__ import annotations

import math
from fractions import Fraction

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


def _row_counts(uidx, t, row_steps, last_steps):
    """Advance the per-row counters of the rows ``uidx`` at step ``t``; returns ``(tr, k)``:
    the rows' own counts (``None`` without ``row_steps``) and the number of steps whose decay
    each row takes now (ones without ``last_steps``)."""
    tr = None
    if row_steps is not None:
        tr = row_steps[uidx].astype(np.int64) + 1
        row_steps[uidx] = tr
    k = np.ones(uidx.shape[0], np.int64)
    if last_steps is not None:
        k = np.maximum(t - last_steps[uidx].astype(np.int64), 1)
        last_steps[uidx] = t
    return tr, k


def _corrections(b1, b2, t, tr):
    """Bias corrections in float64, shape (rows, 1): the global t, or each row's own count."""
    if tr is None:
        return np.array([[1 - b1**t]]), np.array([[1 - b2**t]])
    return (np.array([[1 - b1 ** int(x)] for x in tr]),
            np.array([[1 - b2 ** int(x)] for x in tr]))


def decay_power(keep, k):
    """``keep**k`` by binary powering in double: the product, lowest bit first, of
    ``keep**(2**i)`` (Python's ``**``) over the set bits of ``k``; ``keep`` for ``k == 1``."""
    if k == 1:
        return keep
    f, i = 1.0, 0
    while k:
        if k & 1:
            f *= keep ** (1 << i)
        k >>= 1
        i += 1
    return f


def _decoupled(p, k, lr, weight_decay):
    """AdamW's decay of each row for ``k`` steps: p * fl((1 - lr*wd)**k), one rounding (the
    power by :func:`decay_power`)."""
    keep = 1.0 - lr * weight_decay
    f = np.array([[decay_power(keep, int(x))] for x in k]).astype(p.dtype)
    return p * f


def _decay(g, p, k, lr, weight_decay, decoupled_weight_decay):
    """The weight decay of docs/algorithms.md §7.1 on one coalesced batch (sign applied):
    returns ``(g, p)``, the gradient with L2 added, or the weights decayed."""
    if not weight_decay:
        return g, p
    if decoupled_weight_decay:
        return g, _decoupled(p, k, lr, weight_decay)
    return g + p.dtype.type(weight_decay) * p, p


def euclid_step(P, M, V, idx, G, t, *, lr, betas=(0.9, 0.999), eps=1e-8, maximize=False,
                weight_decay=0.0, decoupled_weight_decay=False, row_steps=None,
                last_steps=None):
    """torch.optim.SparseAdam, docs/algorithms.md §2.2, on the rows of ``idx``; the options of
    §7.1–§7.2 as in the module docstring."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    b1, b2 = betas
    a1, a2, e = T(1 - b1), T(1 - b2), T(eps)
    tr, k = _row_counts(uidx, t, row_steps, last_steps)
    m, v, p = M[uidx], V[uidx], P[uidx]
    g, p = _decay(g, p, k, lr, weight_decay, decoupled_weight_decay)
    dm = (g - m) * a1
    dv = (g * g - v) * a2
    m2 = m + dm
    v2 = v + dv
    den = np.sqrt(v2) + e
    bc1, bc2 = _corrections(b1, b2, t, tr)
    s = np.array([[(lr * math.sqrt(c2)) / c1] for c1, c2 in zip(bc1[:, 0], bc2[:, 0],
                                                                 strict=True)])
    M[uidx] = m2
    V[uidx] = v2
    P[uidx] = p + (-s).astype(P.dtype) * ((dm + m) / den)


def euclid_rowwise_step(P, M, V, idx, G, t, *, lr, betas=(0.9, 0.999), eps=1e-8,
                        maximize=False, weight_decay=0.0, decoupled_weight_decay=False,
                        row_steps=None, last_steps=None):
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
    tr, k = _row_counts(uidx, t, row_steps, last_steps)
    m, v, p = M[uidx], V[uidx], P[uidx]
    g, p = _decay(g, p, k, lr, weight_decay, decoupled_weight_decay)
    m2 = m + (g - m) * a1
    q = (g * g).astype(np.float64).sum(axis=1, keepdims=True) / g.shape[1]
    v2 = v + (q.astype(P.dtype) - v) * a2
    bc1, bc2 = (c.astype(P.dtype) for c in _corrections(b1, b2, t, tr))
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
                      maximize=False, **options):
    """float32 Euclidean step with m stored as bfloat16 (``M`` holds bf16 values as float32):
    the full-precision step (:func:`euclid_step`, or :func:`euclid_rowwise_step`) from the
    stored m -- which updates the weights with the unrounded new m -- then the touched rows'
    new m rounded stochastically with :func:`sr_bits` of (t, row, coordinate). ``options``:
    the keywords of §7.1–§7.2 (module docstring), passed on."""
    if len(idx) == 0:
        return
    full = euclid_rowwise_step if rowwise else euclid_step
    full(P, M, V, idx, G, t, lr=lr, betas=betas, eps=eps, maximize=maximize, **options)
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
                  maximize=False, ball_eps=None, weight_decay=0.0,
                  decoupled_weight_decay=False, row_steps=None, last_steps=None):
    """geoopt SparseRiemannianAdam on Stereographic(k=-c), docs/algorithms.md §3.2; ``V`` is (n,
    1). Options (§7.1–§7.2): L2 adds ``wd*x`` to the Euclidean gradient before egrad2rgrad;
    decoupled decay shrinks the point ``x*(1 - lr*wd)`` before the step."""
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
    tr, steps = _row_counts(uidx, t, row_steps, last_steps)
    x, m, v = P[uidx], M[uidx], V[uidx]
    g, x = _decay(g, x, steps, lr, weight_decay, decoupled_weight_decay)
    lam = lambda_x(x, k)
    l2 = lam * lam
    rg = g / l2
    m = m * T(b1) + T(1 - b1) * rg
    w = l2 * _rowdot(rg, rg)
    v = v * T(b2) + T(1 - b2) * w
    bc1, bc2 = (c.astype(P.dtype) for c in _corrections(b1, b2, t, tr))
    den = np.sqrt(v / bc2) + T(eps)
    u = T(-lr) * ((m / bc1) / den)
    y = project(x + u, maxnorm(curvature, ball_eps, P.dtype))  # retraction: x + u, projected
    m_t = (gyration(y, -x, m, k) * lam) / lambda_x(y, k)
    P[uidx] = y
    M[uidx] = m_t
    V[uidx] = v


# -- Adagrad (docs/algorithms.md §7.5) ----------------------------------------------------------
def _fma32(a, x, y):
    """float32 ``a*x + y`` rounded once: the product is exact in double, the sum is rounded to
    odd in double (TwoSum's error says whether it was exact, and on which side), and a
    round-to-odd result with 29 more bits than float32 rounds to float32 as the exact value
    would (Boldo & Melquiond)."""
    p = np.float64(a) * x.astype(np.float64)
    y = y.astype(np.float64)
    s = p + y
    b = s - p
    e = (p - (s - b)) + (y - b)  # s + e == p + y exactly (finite s)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    fix = np.isfinite(s) & (e != 0) & even
    s = np.where(fix, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def _fma64_one(a: float, x: float, y: float) -> float:
    if not (math.isfinite(a) and math.isfinite(x) and math.isfinite(y)):
        return a * x + y  # Inf/NaN operands: the fused and the unfused results agree
    exact = Fraction(a) * Fraction(x) + Fraction(y)
    try:
        return float(exact)  # Fraction -> float is correctly rounded
    except OverflowError:
        return math.copysign(math.inf, exact)


def fma(a, x, y):
    """``a*x + y`` rounded once to ``y``'s dtype (IEEE fusedMultiplyAdd), elementwise; ``a`` a
    T scalar, ``x`` and ``y`` T arrays of one shape. float64 goes through exact rationals, one
    element at a time (slow, and obviously right)."""
    if y.dtype == np.float32:
        return _fma32(a, x, y)
    f = np.vectorize(_fma64_one, otypes=[np.float64])
    return f(np.float64(a), x, y)


def _lazy_initial(s, initial_accumulator_value):
    """An accumulator of exactly 0 stands for ``fl(iav)`` (a store may leave untouched rows
    zero-filled; a touched accumulator is at least ``fl(iav)``)."""
    T = s.dtype.type
    return np.where(s == 0, T(initial_accumulator_value), s)


def adagrad_step(P, S, idx, G, t, *, lr, lr_decay=0.0, eps=1e-10,
                 initial_accumulator_value=0.0, maximize=False, sqrt=np.sqrt):
    """torch.optim.Adagrad on a sparse gradient (docs/algorithms.md §7.5) on the rows of ``idx``:
    ``S`` is the ``(n, dim)`` accumulator ("sum"). ``sqrt`` is the square root on T arrays
    (a test passes torch's, which is not correctly rounded, to compare with torch bit for
    bit)."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    clr = lr / (1 + (t - 1) * lr_decay)
    s2 = _lazy_initial(S[uidx], initial_accumulator_value) + g * g
    std = sqrt(s2) + T(eps)
    S[uidx] = s2
    P[uidx] = fma(T(-clr), g / std, P[uidx])  # torch's sparse add(alpha=-clr): one rounding


def row_mean_sq(g):
    """``T(sum_j(g_j * g_j) / d)`` per row, shape ``(rows, 1)``: products in T, summed in
    float64 over the columns in order (the kernels' order), divided and rounded once."""
    acc = np.zeros(g.shape[0])
    for j in range(g.shape[1]):
        acc = acc + (g[:, j] * g[:, j]).astype(np.float64)
    return (acc / g.shape[1]).astype(g.dtype)[:, None]


def rowwise_adagrad_step(P, S, idx, G, t, *, lr, lr_decay=0.0, eps=1e-10,
                         initial_accumulator_value=0.0, maximize=False, weight_decay=0.0,
                         sqrt=np.sqrt, row_mean=row_mean_sq):
    """PyTorch-BigGraph RowAdagrad (docs/algorithms.md §7.5) on the rows of ``idx``: ``S`` is
    ``(n, 1)``, one accumulator per row. ``weight_decay``: L2 (FBGEMM's ``weight_decay_mode
    = 1``), ``g + fl(wd)*p`` in the accumulator and in the update. ``sqrt`` and ``row_mean``
    (T arrays -> T arrays) are replaceable, so a test can pass torch's and compare with a
    torch transcription of PBG bit for bit."""
    T = P.dtype.type
    if len(idx) == 0:
        return
    uidx, g = coalesce_ref(idx, G)
    if maximize:
        g = -g
    p = P[uidx]
    if weight_decay:
        g = g + T(weight_decay) * p
    clr = lr / (1 + (t - 1) * lr_decay)
    s2 = _lazy_initial(S[uidx], initial_accumulator_value) + row_mean(g)
    std = sqrt(s2) + T(eps)
    S[uidx] = s2
    P[uidx] = p + (T(-clr) * g) / std
