"""Numba kernels: row-wise Euclidean lazy Adam = SparseAdam (docs/algorithms.md §2.2).

Kernels see arrays only. Preconditions, checked by the glue in ``_step``: ``srows`` unique
(so chunks running on different threads never write the same record), all row ids in range,
``G`` of shape ``(len(srows), dim)`` in the store dtype, and the step's scalars in ``hp``, the
array :func:`euclid_hparams` packs (already rounded to that dtype); every kernel here reads it
with :func:`unpack_euclid`.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from ._claim import first_span, next_span
from ._intrinsics import (
    N_STEP,
    OP_LR,
    OP_STEP,
    PREFETCH_ROWS,
    WD_DECOUPLED,
    WD_L2,
    WD_NONE,
    bits_f32,
    counter_view,
    decay_factor,
    dot64,
    f32_bits,
    prefetch_record,
    read_counters,
    row_bias_corrections,
    row_corrections,
    row_is_finite,
    unpack_options,
    write_counters,
)

# -- hyperparameters: one T array ``hp``, the same layout for every kernel of this module -----
# indices into ``hp`` (all values already rounded to T)
(HP_A1, HP_A2, HP_BC1, HP_BC2, HP_EPS, HP_NEG_LR, HP_SGN, HP_NEG_S, HP_WD,
 HP_KEEP) = range(10)
HP_SIZE = 10


def euclid_hparams(dtype, *, lr: float, betas: tuple[float, float], bc1: float, bc2: float,
                   eps: float, maximize: bool, weight_decay: float = 0.0) -> np.ndarray:
    """The ``hp`` array of this module's kernels for one step, each value rounded once to T.

    ``bc1``, ``bc2`` are the bias corrections ``1 - beta**t``. Each value is computed in float64
    and rounded once, when stored: the elementwise kernels take SparseAdam's step size with both
    corrections folded in, ``neg_s = -(lr * sqrt(bc2)) / bc1`` (torch's order of operations);
    the row-wise ones divide by ``bc1`` and ``sqrt(v / bc2)`` themselves. ``wd`` is the L2
    coefficient, ``keep = 1 - lr*wd`` the one-step decoupled decay (docs/algorithms.md §7.1).
    """
    b1, b2 = betas
    hp = np.empty(HP_SIZE, dtype)
    hp[HP_A1] = 1.0 - b1
    hp[HP_A2] = 1.0 - b2
    hp[HP_BC1] = bc1
    hp[HP_BC2] = bc2
    hp[HP_EPS] = eps
    hp[HP_NEG_LR] = -lr
    hp[HP_SGN] = -1.0 if maximize else 1.0  # exact in T: maximize negates g, bit for bit
    hp[HP_NEG_S] = -((lr * math.sqrt(bc2)) / bc1)
    hp[HP_WD] = weight_decay
    hp[HP_KEEP] = 1.0 - lr * weight_decay
    return hp


@njit(inline="always")
def unpack_euclid(hp):
    """``hp`` as named T scalars: a1 = 1-b1, a2 = 1-b2, bc1, bc2, eps, neg_lr = -lr, sgn,
    neg_s, wd, keep = 1-lr*wd (see :func:`euclid_hparams`). Unused ones cost nothing: LLVM
    drops their loads."""
    return (hp[HP_A1], hp[HP_A2], hp[HP_BC1], hp[HP_BC2], hp[HP_EPS], hp[HP_NEG_LR],
            hp[HP_SGN], hp[HP_NEG_S], hp[HP_WD], hp[HP_KEEP])


@njit(inline="always")
def row_step_size(T, op, tr, neg_s):
    """SparseAdam's ``fl(-(lr*sqrt(bc2))/bc1)`` with the row's own count ``tr``
    (docs/algorithms.md §7.2), evaluated in float64 as :func:`euclid_hparams` does for the
    global t; ``neg_s`` (the global one) when ``tr == 0`` (no ``per_row_step``)."""
    if tr == 0:
        return neg_s
    if tr < N_STEP:  # the few-updates rows: precomputed for this lr, the same bits
        return T(op[OP_STEP + tr])
    bc1, _, sq2 = row_bias_corrections(op, tr)
    return T(-((op[OP_LR] * sq2) / bc1))


@functools.cache
def euclid_options_kernel(per_row: bool, last: bool, mode: int):
    """:func:`adam_rows_euclid` for one combination of options, compiled on first use.

    ``per_row`` (a ``row_step`` counter), ``last`` (a ``last_step`` counter) and ``mode``
    (``WD_NONE``, ``WD_L2``, ``WD_DECOUPLED``) are closure constants, which numba freezes into
    the compiled code: each specialisation holds only the code of its options (one kernel
    with run-time switches for all of them measured 5-15% slower per warm step: a 128-wide
    row has little work besides). ``(False, False, WD_NONE)`` is the plain kernel
    (:data:`adam_rows_euclid`), SparseAdam exactly, as fast as a kernel written without the
    options (within 1% on 2048 cache-hot rows) because what the options need is made only
    under a constant: the counter view of the records (made but unused, it cost 5%) and the
    per-row helpers' calls. numba's cache keeps one entry per combination: its key hashes the
    closure's values, so each of the three must stay a closure variable of the kernel (read
    in its body), or two combinations would share an entry and one would run the other's code.
    """
    @njit(cache=True, nogil=True, error_model="numpy")
    def adam_rows_euclid(W, wrows, woff, S, srows, moff, voff, G, hp, skip_nonfinite, op,
                         lo, hi, ctl=None):
        """Update rows ``srows`` of the state ``S`` and rows ``wrows`` of the weights ``W``.

        Per coordinate, in storage dtype T (docs/algorithms.md §2.2)::

            g  = sgn * G                       # sgn = -1 for maximize (exact)
            dm = (g - m) * a1 ;  dv = (g*g - v) * a2
            m' = m + dm ;  v' = v + dv
            p' = p + neg_s * ((dm + m) / (sqrt(v') + eps))

        ``W`` and ``S`` may be the same array (weights stored in the record) or not
        (``weights=False`` stores: ``W`` holds the caller's rows). Runs rows ``lo:hi`` of the
        batch with the GIL released, or, given ``ctl``, the chunks of them it claims
        (``_claim``: how ``_pool.run_chunked`` shares a batch between threads).

        The options of docs/algorithms.md §7.1–§7.2, as compiled in: ``op`` is the float64
        options array of ``_intrinsics.options_array`` (the same for every kernel;
        ``_intrinsics.NO_OPTIONS`` when none is on): the offsets of the ``row_step`` /
        ``last_step`` counters in the records (-1: absent; the counters are read through
        ``counter_view(S)``, the records as ints), the global step ``t``, and the float64
        values the per-row ones are computed from. ``WD_L2``: ``g <- sgn*g + wd*p``, then the
        update; ``WD_DECOUPLED``: ``p <- p * f`` first, ``f = decay_factor(...)``, fused into
        the update's pass with the same roundings as two passes. With ``per_row_step`` the
        step size is the row's own (:func:`row_step_size`). A skipped (non-finite) row keeps
        its counters and is not decayed.
        """
        a1, a2, _, _, eps, _, sgn, neg_s0, wd, keep = unpack_euclid(hp)
        T = hp.dtype.type
        rs_off, ls_off, t, _ = unpack_options(op)
        if not per_row:  # compile-time constants: LLVM drops the code they switch off
            rs_off = -1
        if not last:
            ls_off = -1
        wd_mode = mode
        if per_row or last:  # compile-time constant: no view without counters (+5% unused)
            C = counter_view(S)  # the records as ints: the counters
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
                # 1-D row views: with them LLVM vectorises the loop (measured 3.3 -> 0.63 ms for
                # 2048 x 128 on one thread); 2-D indexing of one array kept it scalar.
                r = srows[i]
                rec = S[r]
                m_ = rec[moff:moff + d]
                v_ = rec[voff:voff + d]
                w_ = W[wrows[i]][woff:woff + d]
                tr, k = read_counters(C, r, rs_off, ls_off, t) if per_row or last else (0, 1)
                neg_s = row_step_size(T, op, tr, neg_s0) if per_row else neg_s0
                if wd_mode == WD_DECOUPLED:  # AdamW: decay first, then the step on the decayed p
                    f = decay_factor(keep, op, k)
                    for j in range(d):  # the decay fused into the step's pass (one pass measured
                        g = g_[j] * sgn  # cheaper than two after the pow), the same roundings
                        m = m_[j]
                        v = v_[j]
                        dm = (g - m) * a1
                        dv = (g * g - v) * a2
                        m2 = m + dm
                        v2 = v + dv
                        m_[j] = m2
                        v_[j] = v2
                        w_[j] = (w_[j] * f) + neg_s * ((dm + m) / (np.sqrt(v2) + eps))
                elif wd_mode == WD_L2:  # torch.optim.Adam's weight_decay: g + wd*p
                    for j in range(d):
                        g = g_[j] * sgn + wd * w_[j]
                        m = m_[j]
                        v = v_[j]
                        dm = (g - m) * a1
                        dv = (g * g - v) * a2
                        m2 = m + dm
                        v2 = v + dv
                        m_[j] = m2
                        v_[j] = v2
                        w_[j] = w_[j] + neg_s * ((dm + m) / (np.sqrt(v2) + eps))
                else:
                    for j in range(d):
                        g = g_[j] * sgn
                        m = m_[j]
                        v = v_[j]
                        dm = (g - m) * a1
                        dv = (g * g - v) * a2
                        m2 = m + dm
                        v2 = v + dv
                        m_[j] = m2
                        v_[j] = v2
                        w_[j] = w_[j] + neg_s * ((dm + m) / (np.sqrt(v2) + eps))
                if per_row or last:
                    write_counters(C, r, rs_off, ls_off, tr, t)  # after the row's update loops
            c0, c1 = next_span(ctl, lo, hi, c0, c1)

    return adam_rows_euclid


# SparseAdam without options (docs/algorithms.md §2.2), called with ``op = NO_OPTIONS``
adam_rows_euclid = euclid_options_kernel(False, False, WD_NONE)

@njit(inline="always")
def l2_gradient(y_, g_, w_, sgn, wd):
    """``y = sgn*g + wd*p`` into the scratch row ``y_`` (L2 decay, docs/algorithms.md §7.1)."""
    for j in range(y_.shape[0]):
        y_[j] = g_[j] * sgn + wd * w_[j]


@functools.cache
def euclid_rowwise_options_kernel(per_row: bool, last: bool, mode: int):
    """:func:`adam_rows_euclid_rowwise` for one combination of options (as
    :func:`euclid_options_kernel`, whose notes hold here too); ``(False, False, WD_NONE)`` is
    the plain kernel (:data:`adam_rows_euclid_rowwise`).
    """
    @njit(cache=True, nogil=True, error_model="numpy")
    def adam_rows_euclid_rowwise(W, wrows, woff, S, srows, moff, voff, G, hp, skip_nonfinite,
                                 op, lo, hi, ctl=None):
        """Partial row-wise Adam (docs/algorithms.md §7.3, FBGEMM ``PARTIAL_ROWWISE_ADAM``).

        One v per row.

        Per row, in storage dtype T::

            g  = sgn * G
            dm = (g - m) * a1 ;  m' = m + dm           # per coordinate: SparseAdam's m
            q  = T(sum_j(g_j * g_j) / d)               # products in T, sum in float64
            v' = v + (q - v) * a2                      # one scalar per row
            den = sqrt(v' / bc2) + eps                 # eps after the bias-corrected sqrt
            p' = p + (-lr) * ((m' / bc1) / den)

        The mean (not the sum) keeps lr meaning what it means for elementwise Adam. Same
        preconditions as :func:`adam_rows_euclid` (unique ``srows``, ids in range).

        The options as compiled in (``op`` as for :func:`adam_rows_euclid`). L2 needs the
        whole gradient row with the decay for the row mean of g², so it is written to a
        scratch row first; with ``per_row_step`` bc1 and bc2 are the row's own.
        """
        a1, a2, bc1_0, bc2_0, eps, neg_lr, sgn, _, wd, keep = unpack_euclid(hp)
        T = hp.dtype.type
        rs_off, ls_off, t, _ = unpack_options(op)
        if not per_row:  # compile-time constants: LLVM drops the code they switch off
            rs_off = -1
        if not last:
            ls_off = -1
        wd_mode = mode
        if per_row or last:
            C = counter_view(S)  # the records as ints: the counters
        n = srows.shape[0]
        d = G.shape[1]
        if wd_mode == WD_L2:  # compile-time constant
            y_ = np.empty(d, hp.dtype)  # the L2 gradient of one row
        c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
        while c0 < c1:
            for i in range(c0, c1):
                if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
                    prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS],
                                    woff, d)
                g_ = G[i]
                if skip_nonfinite and not row_is_finite(g_):
                    continue
                r = srows[i]
                rec = S[r]
                m_ = rec[moff:moff + d]
                w_ = W[wrows[i]][woff:woff + d]
                tr, k = read_counters(C, r, rs_off, ls_off, t) if per_row or last else (0, 1)
                bc1, bc2 = row_corrections(T, op, tr, bc1_0, bc2_0) if per_row else (bc1_0, bc2_0)
                if wd_mode == WD_L2:
                    l2_gradient(y_, g_, w_, sgn, wd)
                    q = T(dot64(y_, y_) / d)
                    v = rec[voff]
                    v2 = v + (q - v) * a2
                    rec[voff] = v2
                    den = np.sqrt(v2 / bc2) + eps
                    for j in range(d):
                        m = m_[j]
                        m2 = m + (y_[j] - m) * a1
                        m_[j] = m2
                        w_[j] = w_[j] + neg_lr * ((m2 / bc1) / den)
                else:
                    q = T(dot64(g_, g_) / d)  # (sgn*g)^2 == g^2: sgn is exactly +-1
                    v = rec[voff]  # after the sum: loaded before it, the step measured 9% slower
                    v2 = v + (q - v) * a2
                    rec[voff] = v2
                    den = np.sqrt(v2 / bc2) + eps
                    if wd_mode == WD_DECOUPLED:  # decay first, fused into the pass
                        f = decay_factor(keep, op, k)
                        for j in range(d):
                            m = m_[j]
                            m2 = m + ((g_[j] * sgn) - m) * a1
                            m_[j] = m2
                            w_[j] = (w_[j] * f) + neg_lr * ((m2 / bc1) / den)
                    else:
                        for j in range(d):
                            m = m_[j]
                            m2 = m + ((g_[j] * sgn) - m) * a1
                            m_[j] = m2
                            w_[j] = w_[j] + neg_lr * ((m2 / bc1) / den)
                if per_row or last:
                    write_counters(C, r, rs_off, ls_off, tr, t)  # after the row's update loops
            c0, c1 = next_span(ctl, lo, hi, c0, c1)

    return adam_rows_euclid_rowwise


# partial row-wise Adam without options (docs/algorithms.md §7.3), ``op = NO_OPTIONS``
adam_rows_euclid_rowwise = euclid_rowwise_options_kernel(False, False, WD_NONE)

# -- bfloat16 first moment (docs/algorithms.md §6: stochastically rounded m, v in float32) --
_U16 = np.uint64(16)
_U32 = np.uint64(32)
_EXP = np.uint64(0x7F800000)
_MANT = np.uint64(0x007FFFFF)
_QNAN = np.uint64(0x40)
_SM_ADD = np.uint64(0x9E3779B97F4A7C15)
_SM_M1 = np.uint64(0xBF58476D1CE4E5B9)
_SM_M2 = np.uint64(0x94D049BB133111EB)


@njit(inline="always")
def sr_bits(t, row, d, j):
    """16 random bits for coordinate ``j`` of ``row`` at step ``t``: splitmix64 of
    ``(t << 32) ^ (row * d + j)``, top 16 bits (wrapping uint64 arithmetic)."""
    z = ((np.uint64(t) << _U32) ^ (np.uint64(row) * np.uint64(d) + np.uint64(j))) + _SM_ADD
    z = (z ^ (z >> np.uint64(30))) * _SM_M1
    z = (z ^ (z >> np.uint64(27))) * _SM_M2
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(48)


@njit(inline="always")
def bf16_from_f32(x, rnd):
    """float32 ``x`` to bfloat16 bits, rounded stochastically with the 16 random bits ``rnd``:
    up (in magnitude) with probability (dropped bits) / 2^16. Inf stays Inf, NaN stays NaN."""
    b = np.uint64(f32_bits(x))
    if (b & _EXP) == _EXP:
        hi = b >> _U16
        if (b & _MANT) != np.uint64(0):
            hi = hi | _QNAN
        return np.uint16(hi)
    return np.uint16((b + rnd) >> _U16)


@njit(inline="always")
def f32_from_bf16(h):
    return bits_f32(np.uint64(h) << _U16)


@functools.cache
def euclid_bf16m_options_kernel(per_row: bool, last: bool, mode: int):
    """:func:`adam_rows_euclid_bf16m` for one combination of options (as
    :func:`euclid_options_kernel`, whose notes hold here too); ``(False, False, WD_NONE)`` is
    the plain kernel (:data:`adam_rows_euclid_bf16m`).
    """
    @njit(cache=True, nogil=True, error_model="numpy")
    def adam_rows_euclid_bf16m(W, wrows, woff, S, M16, srows, hrows, m16off, voff, G, hp,
                               rowwise, t, skip_nonfinite, op, lo, hi, ctl=None):
        """Euclidean lazy Adam with m stored as bfloat16 (``M16`` = the records as uint16).

        Per coordinate, in float32: ``m = f32(m16)``, then exactly :func:`adam_rows_euclid`
        (``rowwise=False``: SparseAdam's v and update) or :func:`adam_rows_euclid_rowwise`
        (``rowwise=True``) with that m, the weight updated with the unrounded new m, and the
        new m stored as ``bf16_from_f32(m', sr_bits(t, row, d, j))``.

        ``srows[i]`` is the record of batch row ``i`` in ``S``/``M16``; ``hrows[i]`` is its row
        id, which keys the rounding hash. An in-place store passes its rows as both; a log
        store passes the region slots as ``srows`` and the row ids as ``hrows``, so the
        rounding (and every bit of the result) does not depend on where a record happens to
        sit.

        The options as compiled in (``op`` as for :func:`adam_rows_euclid`; the step ``t`` is
        the argument, which also seeds the rounding). L2 writes the gradient with the decay
        to a scratch row first; the decoupled decay is a pass of its own here: this kernel is
        compute-bound.
        """
        a1, a2, bc1_0, bc2_0, eps, neg_lr, sgn, neg_s0, wd, keep = unpack_euclid(hp)
        T = hp.dtype.type
        rs_off, ls_off, _, _ = unpack_options(op)
        if not per_row:  # compile-time constants: LLVM drops the code they switch off
            rs_off = -1
        if not last:
            ls_off = -1
        wd_mode = mode
        if per_row or last:
            C = counter_view(S)  # the records as ints: the counters
        n = srows.shape[0]
        d = G.shape[1]
        l2 = wd_mode == WD_L2
        y_ = np.empty(d if l2 else 0, hp.dtype)  # the L2 gradient of one row
        c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
        while c0 < c1:
            for i in range(c0, c1):
                if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
                    prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS],
                                    woff, d)
                g_ = G[i]
                if skip_nonfinite and not row_is_finite(g_):
                    continue
                r = srows[i]
                h = hrows[i]  # the row id: the rounding hash's key
                rec = S[r]
                m_ = M16[r][m16off:m16off + d]
                w_ = W[wrows[i]][woff:woff + d]
                tr, k = read_counters(C, r, rs_off, ls_off, t) if per_row or last else (0, 1)
                if wd_mode == WD_DECOUPLED:
                    f = decay_factor(keep, op, k)
                    for j in range(d):
                        w_[j] = w_[j] * f
                if l2:  # the L2 gradient sgn*g + wd*p, in the scratch row; read back with sign +1
                    l2_gradient(y_, g_, w_, sgn, wd)
                if rowwise:
                    bc1, bc2 = (row_corrections(T, op, tr, bc1_0, bc2_0) if per_row
                                else (bc1_0, bc2_0))
                    q = T(dot64(y_, y_) / d) if l2 else T(dot64(g_, g_) / d)
                    v = rec[voff]
                    v2 = v + (q - v) * a2
                    rec[voff] = v2
                    den = np.sqrt(v2 / bc2) + eps
                    if l2:
                        for j in range(d):
                            m = f32_from_bf16(m_[j])
                            m2 = m + (y_[j] - m) * a1
                            m_[j] = bf16_from_f32(m2, sr_bits(t, h, d, j))
                            w_[j] = w_[j] + neg_lr * ((m2 / bc1) / den)
                    else:
                        for j in range(d):
                            m = f32_from_bf16(m_[j])
                            m2 = m + ((g_[j] * sgn) - m) * a1
                            m_[j] = bf16_from_f32(m2, sr_bits(t, h, d, j))
                            w_[j] = w_[j] + neg_lr * ((m2 / bc1) / den)
                else:
                    neg_s = row_step_size(T, op, tr, neg_s0) if per_row else neg_s0
                    v_ = rec[voff:voff + d]
                    if l2:
                        for j in range(d):
                            g = y_[j]
                            m = f32_from_bf16(m_[j])
                            v = v_[j]
                            dm = (g - m) * a1
                            dv = (g * g - v) * a2
                            m2 = m + dm
                            v2 = v + dv
                            m_[j] = bf16_from_f32(m2, sr_bits(t, h, d, j))
                            v_[j] = v2
                            w_[j] = w_[j] + neg_s * ((dm + m) / (np.sqrt(v2) + eps))
                    else:
                        for j in range(d):
                            g = g_[j] * sgn
                            m = f32_from_bf16(m_[j])
                            v = v_[j]
                            dm = (g - m) * a1
                            dv = (g * g - v) * a2
                            m2 = m + dm
                            v2 = v + dv
                            m_[j] = bf16_from_f32(m2, sr_bits(t, h, d, j))
                            v_[j] = v2
                            w_[j] = w_[j] + neg_s * ((dm + m) / (np.sqrt(v2) + eps))
                if per_row or last:
                    write_counters(C, r, rs_off, ls_off, tr, t)  # after the row's update loops
            c0, c1 = next_span(ctl, lo, hi, c0, c1)

    return adam_rows_euclid_bf16m


# the bfloat16-m kernel without options (docs/algorithms.md §6), ``op = NO_OPTIONS``
adam_rows_euclid_bf16m = euclid_bf16m_options_kernel(False, False, WD_NONE)
