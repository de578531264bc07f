"""Numba kernel: row-wise Riemannian Adam on the Poincaré ball (spec §3, geoopt parity).

The ball of curvature ``-c`` is geoopt's ``Stereographic(k)`` with ``k = -c``. All vector
operations run in the storage dtype T; the row reductions (inner products, norms) are
accumulated in float64 and rounded once to T (spec §6 allows this; it is more robust
near the boundary than a float32 running sum), by ``dot64``: in SIMD lanes for float32 rows,
sequentially (the reference's order) for float64 rows.

Preconditions (checked by the glue): ``srows`` unique, ids in range, ``G`` of shape
``(len(srows), dim)`` in T, ``Y`` a scratch array of the same shape, ``hp`` a T array of
the scalars listed in ``adam_rows_poincare``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ._intrinsics import PREFETCH_ROWS, dot64, prefetch_record, row_is_finite

# indices into the hyperparameter array ``hp`` (all values already rounded to T)
HP_K, HP_A1, HP_B1, HP_A2, HP_B2, HP_BC1, HP_BC2, HP_EPS, HP_NEG_LR, HP_MAXNORM, HP_SGN = range(11)
HP_SIZE = 11


@njit(cache=True, nogil=True, error_model="numpy")
def adam_rows_poincare(W, wrows, woff, S, srows, moff, voff, G, Y, hp, skip_nonfinite, lo, hi):
    """One Riemannian Adam step for each row in ``srows`` (spec §3.2).

    Per row x with coalesced gradient g, first moment m (vector), second moment v (scalar)::

        L = 2 / max(1 + k<x,x>, 1e-15);  rg = g / L^2
        m = m*b1 + a1*rg;  v = v*b2 + a2*(L^2 <rg,rg>)
        u = -lr * (m / bc1) / (sqrt(v / bc2) + eps)
        y = project(x + u);       m <- gyr[y, -x] m * L(x) / L(y)

    ``hp`` holds k, 1-b1, b1, 1-b2, b2, bc1, bc2, eps, -lr, maxnorm, sign (T values).
    Runs rows ``lo:hi`` of the batch; ``_pool.run_chunked`` spreads chunks over threads.
    """
    k = hp[HP_K]
    a1 = hp[HP_A1]
    b1 = hp[HP_B1]
    a2 = hp[HP_A2]
    b2 = hp[HP_B2]
    bc1 = hp[HP_BC1]
    bc2 = hp[HP_BC2]
    eps = hp[HP_EPS]
    neg_lr = hp[HP_NEG_LR]
    maxnorm = hp[HP_MAXNORM]
    sgn = hp[HP_SGN]
    T = hp.dtype.type
    one = T(1.0)
    two = T(2.0)
    tiny = T(1e-15)
    K2 = k * k
    n = srows.shape[0]
    d = G.shape[1]
    for i in range(lo, hi):
        if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
            prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS], woff, d)
        g_ = G[i]
        if skip_nonfinite and not row_is_finite(g_):
            continue
        # 1-D row views let LLVM vectorise the elementwise loops (see _kernels_euclid)
        rec = S[srows[i]]
        m_ = rec[moff:moff + d]
        x_ = W[wrows[i]][woff:woff + d]
        y_ = Y[i]
        # conformal factor at x
        xx = T(dot64(x_, x_))
        lam_x = two / max(one + k * xx, tiny)
        l2 = lam_x * lam_x
        # Riemannian gradient (kept in y_ for the norm), first moment
        for j in range(d):
            rg = (g_[j] * sgn) / l2
            m_[j] = m_[j] * b1 + a1 * rg
            y_[j] = rg
        w = l2 * T(dot64(y_, y_))
        v = rec[voff] * b2 + a2 * w
        rec[voff] = v
        den = np.sqrt(v / bc2) + eps
        # retraction (geoopt Stereographic.retr, spec §3.1): y = project(x + u), a plain
        # Euclidean step, u = -lr * m_hat / den
        for j in range(d):
            y_[j] = x_[j] + neg_lr * ((m_[j] / bc1) / den)
        # projection onto the ball of radius maxnorm
        acc_yy = dot64(y_, y_)
        nrm = max(np.sqrt(T(acc_yy)), tiny)
        if nrm > maxnorm:
            for j in range(d):
                y_[j] = (y_[j] / nrm) * maxnorm
            acc_yy = dot64(y_, y_)  # else y is unchanged and so is <y,y>: one pass saved
        # parallel transport of the new m from x to y: gyr[y, -x] m * L(x) / L(y)
        acc_xy = dot64(x_, y_)
        acc_ym = dot64(y_, m_)
        acc_xm = dot64(x_, m_)
        a2n = T(acc_yy)     # <a,a>, a = y
        ab = -T(acc_xy)     # <a,b>, b = -x
        aw = T(acc_ym)      # <a,w>, w = m
        bw = -T(acc_xm)     # <b,w>
        b2n = xx            # <b,b>
        ga = (((-K2) * aw) * b2n - k * bw) + ((two * K2) * ab) * bw
        gb = ((-K2) * bw) * a2n + k * aw
        gd = max((one - (two * k) * ab) + (K2 * a2n) * b2n, tiny)
        lam_y = two / max(one + k * a2n, tiny)
        for j in range(d):
            y = y_[j]
            gyr = m_[j] + (two * (ga * y + gb * (-x_[j]))) / gd
            m_[j] = (gyr * lam_x) / lam_y
            x_[j] = y
