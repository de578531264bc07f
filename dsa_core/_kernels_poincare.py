"""Numba kernel: Riemannian Adam on the Poincaré ball, geoopt parity (docs/algorithms.md §3).

The ball of curvature ``-c`` is geoopt's ``Stereographic(k)`` with ``k = -c``. All vector
operations run in the storage dtype T; the row reductions (inner products, norms) are
accumulated in float64 and rounded once to T (docs/algorithms.md §6 allows this; it is more robust
near the boundary than a float32 running sum), by ``dot64``: in SIMD lanes for float32 rows,
sequentially (the reference's order) for float64 rows.

Preconditions (checked by the glue): ``srows`` unique, ids in range, ``G`` of shape
``(len(srows), dim)`` in T, ``Y`` a scratch array of the same shape, ``hp`` the T array
:func:`poincare_hparams` packs.

The steps carry geoopt's names (``geoopt.manifolds.stereographic.math``): :func:`lambda_x`,
:func:`project`, :func:`gyration`. They are small helpers that numba inlines into the kernel
(``inline="always"``: no call, the same operations in the same order as one loop nest), so
the kernel reads as the algorithm at no cost in speed or bits.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit

from ._claim import first_span, next_span
from ._intrinsics import (
    PREFETCH_ROWS,
    WD_DECOUPLED,
    WD_L2,
    WD_NONE,
    counter_view,
    decay_factor,
    dot64,
    prefetch_record,
    read_counters,
    row_corrections,
    row_is_finite,
    unpack_options,
    write_counters,
)

# -- hyperparameters: one T array ``hp`` ------------------------------------------------------
# indices into ``hp`` (all values already rounded to T)
(HP_K, HP_A1, HP_B1, HP_A2, HP_B2, HP_BC1, HP_BC2, HP_EPS, HP_NEG_LR, HP_MAXNORM, HP_SGN,
 HP_WD, HP_KEEP) = range(13)
HP_SIZE = 13


def poincare_hparams(dtype, *, curvature: float, lr: float, betas: tuple[float, float],
                     bc1: float, bc2: float, eps: float, maxnorm: float,
                     maximize: bool, weight_decay: float = 0.0) -> np.ndarray:
    """The ``hp`` array of :func:`adam_rows_poincare` for one step, each value rounded once to T.

    ``k = -curvature`` is geoopt's ``Stereographic(k)`` (the ball has ``k < 0``); ``bc1``,
    ``bc2`` are the bias corrections ``1 - beta**t``; ``maxnorm`` the projection radius,
    already computed in T (``_state.maxnorm``), so storing it is exact. ``wd`` is the L2
    coefficient, ``keep = 1 - lr*wd`` the one-step decoupled shrink (docs/algorithms.md §7.1).
    """
    b1, b2 = betas
    hp = np.empty(HP_SIZE, dtype)
    hp[HP_K] = -curvature
    hp[HP_A1] = 1.0 - b1
    hp[HP_B1] = b1
    hp[HP_A2] = 1.0 - b2
    hp[HP_B2] = b2
    hp[HP_BC1] = bc1
    hp[HP_BC2] = bc2
    hp[HP_EPS] = eps
    hp[HP_NEG_LR] = -lr
    hp[HP_MAXNORM] = maxnorm
    hp[HP_SGN] = -1.0 if maximize else 1.0  # exact in T: maximize negates g, bit for bit
    hp[HP_WD] = weight_decay
    hp[HP_KEEP] = 1.0 - lr * weight_decay
    return hp


@njit(inline="always")
def unpack_poincare(hp):
    """``hp`` as named T scalars: k, a1 = 1-b1, b1, a2 = 1-b2, b2, bc1, bc2, eps,
    neg_lr = -lr, maxnorm, sgn, wd, keep = 1-lr*wd (see :func:`poincare_hparams`)."""
    return (hp[HP_K], hp[HP_A1], hp[HP_B1], hp[HP_A2], hp[HP_B2], hp[HP_BC1], hp[HP_BC2],
            hp[HP_EPS], hp[HP_NEG_LR], hp[HP_MAXNORM], hp[HP_SGN], hp[HP_WD], hp[HP_KEEP])


# -- the ball's operations, named as in geoopt (scalars in T, sums through dot64) ------------
@njit(inline="always")
def lambda_x(xx, k):
    """The conformal factor ``2 / (1 + k<x,x>)`` at a point x, given ``xx = <x,x>`` in T
    (geoopt's ``lambda_x``, clamped below at 1e-15 as there). Taking ``<x,x>`` rather than x
    lets the kernel reuse the norms it needs anyway, at x and at the new point."""
    T = type(xx)
    return T(2.0) / max(T(1.0) + k * xx, T(1e-15))


@njit(inline="always")
def project(y_, yy, maxnorm):
    """geoopt's ``project``: the row ``y_`` onto the ball of radius ``maxnorm``, in place.

    ``yy`` is ``<y,y>`` as ``dot64`` returns it. Returns whether ``y_`` was rescaled: a row
    inside the ball is unchanged, and so is ``<y,y>``, so the caller sums it again only then.
    The sums stay with the caller: with them in here, numba kept an incref/decref of the row
    per call (its refcount pruning did not remove them; float64 ``dot64`` is a call that can
    raise) and the float32 kernel measured ~3% slower.
    """
    T = y_.dtype.type
    nrm = max(np.sqrt(T(yy)), T(1e-15))
    moved = nrm > maxnorm
    if moved:
        for j in range(y_.shape[0]):
            y_[j] = (y_[j] / nrm) * maxnorm
    return moved


@njit(inline="always")
def gyration(uu, uv, uw, vv, vw, k):
    """geoopt's ``gyration`` ``gyr[u,v]w = w + 2 (a u + b v) / d``, as its row scalars.

    Takes the inner products ``<u,u>, <u,v>, <u,w>, <v,v>, <v,w>`` (T) and returns
    ``(a, b, d)`` with geoopt's expressions and clamp; the caller applies them per coordinate,
    fused with whatever else it does to the row (the transport's rescaling, here).
    """
    T = type(k)
    K2 = k * k
    a = (((-K2) * uw) * vv - k * vw) + ((T(2.0) * K2) * uv) * vw
    b = ((-K2) * vw) * uu + k * uw
    d = max((T(1.0) - (T(2.0) * k) * uv) + (K2 * uu) * vv, T(1e-15))
    return a, b, d


@functools.cache
def poincare_options_kernel(per_row: bool, last: bool, mode: int):
    """:func:`adam_rows_poincare` for one combination of options, compiled on first use (as
    ``_kernels_euclid.euclid_options_kernel``, whose notes hold here too: the options are
    closure constants, one numba cache entry per combination); ``(False, False, WD_NONE)`` is
    the plain kernel (:data:`adam_rows_poincare`), geoopt exactly.
    """
    @njit(cache=True, nogil=True, error_model="numpy")
    def adam_rows_poincare(W, wrows, woff, S, srows, moff, voff, G, Y, hp, skip_nonfinite, op,
                           lo, hi, ctl=None):
        """One Riemannian Adam step for each row in ``srows`` (docs/algorithms.md §3.2).

        Per row x with coalesced gradient g, first moment m (vector), second moment v
        (scalar)::

            L = lambda_x(x);  rg = g / L^2                       # egrad2rgrad
            m = m*b1 + a1*rg;  v = v*b2 + a2*(L^2 <rg,rg>)
            u = -lr * (m / bc1) / (sqrt(v / bc2) + eps)
            y = project(x + u);       m <- gyr[y, -x] m * L(x) / L(y)

        ``hp`` holds k, 1-b1, b1, 1-b2, b2, bc1, bc2, eps, -lr, maxnorm, sign, wd, keep (T
        values). Runs rows ``lo:hi`` of the batch, or, given ``ctl``, the chunks of them it
        claims (``_claim``: how ``_pool.run_chunked`` shares a batch between threads).

        The options of docs/algorithms.md §7.1–§7.2 as compiled in (``op`` as for
        ``_kernels_euclid.adam_rows_euclid``): ``WD_L2`` adds ``wd*x`` to the Euclidean
        gradient before ``egrad2rgrad`` (geoopt ``RiemannianAdam``'s weight decay);
        ``WD_DECOUPLED`` shrinks the point first, ``x <- x * decay_factor`` (a Euclidean
        shrink toward the origin: it stays inside the ball), and the step then starts from the
        shrunk point; ``per_row_step`` takes ``fl(bc1)``, ``fl(bc2)`` from the row's own count.
        """
        k, a1, b1, a2, b2, bc1_0, bc2_0, eps, neg_lr, maxnorm, sgn, wd, keep = unpack_poincare(hp)
        T = hp.dtype.type
        rs_off, ls_off, t, _ = unpack_options(op)
        if not per_row:  # compile-time constants: LLVM drops the code they switch off
            rs_off = -1
        if not last:
            ls_off = -1
        wd_mode = mode
        if per_row or last:
            C = counter_view(S)  # the records as ints: the counters
        two = T(2.0)
        n = srows.shape[0]
        d = G.shape[1]
        c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
        while c0 < c1:
            for i in range(c0, c1):
                if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
                    prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS],
                                    woff, d)
                g_ = G[i]
                if skip_nonfinite and not row_is_finite(g_):
                    continue
                # 1-D row views let LLVM vectorise the elementwise loops (see _kernels_euclid)
                r = srows[i]
                rec = S[r]
                m_ = rec[moff:moff + d]
                x_ = W[wrows[i]][woff:woff + d]
                y_ = Y[i]
                tr, steps = read_counters(C, r, rs_off, ls_off, t) if per_row or last else (0, 1)
                # per_row_step: the row's own corrections
                bc1, bc2 = row_corrections(T, op, tr, bc1_0, bc2_0) if per_row else (bc1_0, bc2_0)
                if wd_mode == WD_DECOUPLED:  # shrink toward the origin first, then step from there
                    f = decay_factor(keep, op, steps)
                    for j in range(d):
                        x_[j] = x_[j] * f
                xx = T(dot64(x_, x_))
                lam_x = lambda_x(xx, k)
                l2 = lam_x * lam_x
                # egrad2rgrad (kept in y_ for the norm), fused with the first moment
                if wd_mode == WD_L2:  # L2 decay on the Euclidean gradient, before egrad2rgrad
                    for j in range(d):
                        rg = (g_[j] * sgn + wd * x_[j]) / l2
                        m_[j] = m_[j] * b1 + a1 * rg
                        y_[j] = rg
                else:
                    for j in range(d):
                        rg = (g_[j] * sgn) / l2
                        m_[j] = m_[j] * b1 + a1 * rg
                        y_[j] = rg
                w = l2 * T(dot64(y_, y_))
                v = rec[voff] * b2 + a2 * w
                rec[voff] = v
                den = np.sqrt(v / bc2) + eps
                # retraction (geoopt Stereographic.retr, docs/algorithms.md §3.1):
                # y = project(x + u), a plain Euclidean step, u = -lr * m_hat / den
                for j in range(d):
                    y_[j] = x_[j] + neg_lr * ((m_[j] / bc1) / den)
                acc_yy = dot64(y_, y_)
                if project(y_, acc_yy, maxnorm):
                    acc_yy = dot64(y_, y_)  # else y, and so <y,y>, is unchanged: one pass saved
                yy = T(acc_yy)
                # parallel transport of the new m from x to y (geoopt transp):
                # gyr[y, -x] m * L(x) / L(y), with u = y, v = -x, w = m
                ga, gb, gd = gyration(yy, -T(dot64(x_, y_)), T(dot64(y_, m_)), xx,
                                      -T(dot64(x_, m_)), k)
                lam_y = lambda_x(yy, k)
                for j in range(d):
                    y = y_[j]
                    gyr = m_[j] + (two * (ga * y + gb * (-x_[j]))) / gd
                    m_[j] = (gyr * lam_x) / lam_y
                    x_[j] = y
                if per_row or last:
                    write_counters(C, r, rs_off, ls_off, tr, t)  # after the row's update loops
            c0, c1 = next_span(ctl, lo, hi, c0, c1)

    return adam_rows_poincare


# geoopt's SparseRiemannianAdam without options (docs/algorithms.md §3.2), ``op = NO_OPTIONS``
adam_rows_poincare = poincare_options_kernel(False, False, WD_NONE)
