"""Numba kernels: sparse Adagrad = ``torch.optim.Adagrad`` on sparse gradients, and row-wise
Adagrad = PyTorch-BigGraph's ``RowAdagrad`` (docs/algorithms.md §7.5).

Kernels see arrays only. Preconditions, checked by the glue: ``srows`` unique (so chunks
running on different threads never write the same record), all row ids in range, ``G`` of
shape ``(len(srows), dim)`` in the store dtype T, and the step's scalars in ``hp``, the array
:func:`adagrad_hparams` packs (already rounded to T); every kernel here reads it with
:func:`unpack_adagrad`.

The state is one accumulator per coordinate (elementwise: ``dim`` values) or one per row
(row-wise: one value), at element offset ``aoff`` of each record of ``S`` -- where Adam's v
sits; there is no first moment. An accumulator of exactly 0 stands for ``fl(iav)`` (torch's
``initial_accumulator_value``): a touched accumulator is at least ``fl(iav)``, never 0 when
``fl(iav) > 0``, so a store may leave untouched rows zero-filled (or hold ``fl(iav)`` in them:
the same bits either way).

Note for numba's cache: a cached kernel is invalidated by changes to its own source file only,
so after editing ``_intrinsics`` clear ``dsa_core/__pycache__/*.nb[ic]``.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from ._claim import first_span, next_span
from ._intrinsics import PREFETCH_ROWS, WD_L2, WD_NONE, dot64, prefetch_record, row_is_finite

# -- hyperparameters: one T array ``hp``, the same layout for both kernels of this module ------
# indices into ``hp`` (all values already rounded to T)
HP_NEG_CLR, HP_EPS, HP_SGN, HP_IAV, HP_WD = range(5)
HP_SIZE = 5


def adagrad_clr(lr: float, lr_decay: float, t: int) -> float:
    """torch's step size at step ``t`` (>= 1, already incremented), in double:
    ``lr / (1 + (t - 1) * lr_decay)``; ``lr`` itself when ``lr_decay == 0``."""
    return lr / (1 + (t - 1) * lr_decay)


def adagrad_hparams(dtype, *, lr: float, t: int, lr_decay: float = 0.0, eps: float = 1e-10,
                    initial_accumulator_value: float = 0.0, maximize: bool = False,
                    weight_decay: float = 0.0) -> np.ndarray:
    """The ``hp`` array of this module's kernels for step ``t``, each value rounded once to T.

    ``neg_clr = fl(-clr)`` with ``clr`` of :func:`adagrad_clr` (torch passes ``alpha=-clr`` to
    its sparse add, PBG multiplies by the Python float ``-clr``: both round it to T once);
    ``eps``, ``iav`` and ``wd`` (the row-wise kernel's L2 coefficient) as ``fl``; ``sgn = -1``
    for maximize (exact in T). ``t`` is the caller's count: torch keeps its step in a float32
    tensor, which stops counting at 2**24 (docs/algorithms.md §7.5).
    """
    hp = np.empty(HP_SIZE, dtype)
    hp[HP_NEG_CLR] = -adagrad_clr(lr, lr_decay, t)
    hp[HP_EPS] = eps
    hp[HP_SGN] = -1.0 if maximize else 1.0
    hp[HP_IAV] = initial_accumulator_value
    hp[HP_WD] = weight_decay
    return hp


@njit(inline="always")
def unpack_adagrad(hp):
    """``hp`` as named T scalars: neg_clr, eps, sgn, iav, wd (see :func:`adagrad_hparams`)."""
    return hp[HP_NEG_CLR], hp[HP_EPS], hp[HP_SGN], hp[HP_IAV], hp[HP_WD]


@intrinsic
def fma(typingctx, x, y, z):
    """``x*y + z`` rounded once (``llvm.fma``: one vfmadd where the CPU has FMA, a correctly
    rounded libm call where not). Three floats of one type."""
    if not (isinstance(x, types.Float) and x == y == z):
        return None

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return x(x, y, z), codegen


@njit(cache=True, nogil=True, error_model="numpy")
def adagrad_rows(W, wrows, woff, S, srows, aoff, G, hp, skip_nonfinite, op, lo, hi,
                 ctl=None):
    """Elementwise sparse Adagrad: update rows ``srows`` of ``S`` and rows ``wrows`` of ``W``.

    Per coordinate, in storage dtype T (docs/algorithms.md §7.5), torch's
    ``_single_tensor_adagrad`` sparse branch in its order::

        g   = sgn * G                            # maximize negates g (exact)
        s   = iav if s == 0 else s               # the lazy initial accumulator (exact)
        s'  = s + g*g                            # stored ("sum")
        p'  = fma(neg_clr, g / (sqrt(s') + eps), p)   # one rounding: torch's sparse add

    torch adds the sparse update with ``alpha=-clr`` through ``cpublas::axpy`` (MKL's
    ``?axpy``), which fuses the multiply and the add: the last line is one rounding, not two
    (measured: the unfused form differs from torch in about 9% of coordinates). The
    accumulator is ``dim`` values at offset ``aoff`` of the record.

    ``W`` and ``S`` may be the same array (weights stored in the record) or not
    (``weights=False`` stores: ``W`` holds the caller's rows). Runs rows ``lo:hi`` of the
    batch with the GIL released, or, given ``ctl``, the chunks of them it claims (``_claim``).
    ``op`` (``_intrinsics.NO_OPTIONS``) is taken for a call like the Adam kernels' and read
    for nothing: Adagrad has no bias correction, no per-row counters, and torch refuses
    weight decay with sparse gradients.
    """
    neg_clr, eps, sgn, iav, _ = unpack_adagrad(hp)
    n = srows.shape[0]
    d = G.shape[1]
    c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
    while c0 < c1:
        for i in range(c0, c1):
            if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
                prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS], woff, d)
            g_ = G[i]
            if skip_nonfinite and not row_is_finite(g_):
                continue
            # 1-D row views: with them LLVM vectorises the loop (the select and the fma too)
            a_ = S[srows[i]][aoff:aoff + d]
            w_ = W[wrows[i]][woff:woff + d]
            for j in range(d):
                g = g_[j] * sgn
                s = a_[j]
                if s == 0:
                    s = iav
                s2 = s + g * g
                a_[j] = s2
                w_[j] = fma(neg_clr, g / (np.sqrt(s2) + eps), w_[j])
        c0, c1 = next_span(ctl, lo, hi, c0, c1)


@functools.cache
def rowwise_adagrad_options_kernel(mode: int):
    """:func:`rowwise_adagrad_rows` for one weight-decay mode, compiled on first use.

    ``mode`` is ``WD_NONE`` or ``WD_L2`` (a closure constant, as in
    ``_kernels_euclid.euclid_options_kernel``: numba freezes it into the compiled code, and
    its cache keys on it, so it must stay a closure variable read in the body).
    ``WD_NONE`` is the plain kernel (:data:`rowwise_adagrad_rows`), PBG's ``RowAdagrad``.
    """
    if mode not in (WD_NONE, WD_L2):
        raise ValueError(f"row-wise Adagrad takes weight-decay mode WD_NONE ({WD_NONE}) or "
                         f"WD_L2 ({WD_L2}), got {mode!r}")

    @njit(cache=True, nogil=True, error_model="numpy")
    def rowwise_adagrad_rows(W, wrows, woff, S, srows, aoff, G, hp, skip_nonfinite, op, lo,
                             hi, ctl=None):
        """Row-wise Adagrad (docs/algorithms.md §7.5): one accumulator per row, at ``aoff``.

        Per row, in storage dtype T, PyTorch-BigGraph ``RowAdagrad``'s sparse branch in its
        order::

            g   = sgn * G
            g   = g + wd * p                     # WD_L2 only (FBGEMM's L2): one rounding each
            q   = T(sum_j(g_j * g_j) / d)        # the row mean: products in T, sum in float64
            s   = iav if s == 0 else s
            s'  = s + q                          # stored
            std = sqrt(s') + eps
            p'  = p + (neg_clr * g) / std        # per coordinate, -clr*g first (PBG's order)

        Two passes over the row's gradient (the mean needs all of it before the update) and
        one read-modify-write of the weights. With L2 the decayed gradient is written to a
        scratch row first: the accumulator and the update both see it. The arguments as for
        :func:`adagrad_rows` (``op`` read for nothing).
        """
        neg_clr, eps, sgn, iav, wd = unpack_adagrad(hp)
        T = hp.dtype.type
        wd_mode = mode
        n = srows.shape[0]
        d = G.shape[1]
        if wd_mode == WD_L2:  # compile-time constant: no allocation without L2
            y_ = np.empty(d, hp.dtype)  # the L2 gradient of one row
        c0, c1 = first_span(ctl, lo, hi)  # chunks claimed (_claim), or lo:hi
        while c0 < c1:
            for i in range(c0, c1):
                if i + PREFETCH_ROWS < n:  # hide the DRAM miss of a record a few rows ahead
                    prefetch_record(S, srows[i + PREFETCH_ROWS], W, wrows[i + PREFETCH_ROWS], woff,
                                    d)
                g_ = G[i]
                if skip_nonfinite and not row_is_finite(g_):
                    continue
                rec = S[srows[i]]
                w_ = W[wrows[i]][woff:woff + d]
                if wd_mode == WD_L2:  # compile-time constant
                    for j in range(d):
                        y_[j] = g_[j] * sgn + wd * w_[j]
                    q = T(dot64(y_, y_) / d)
                else:
                    q = T(dot64(g_, g_) / d)  # (sgn*g)^2 == g^2: sgn is exactly +-1
                s = rec[aoff]  # after the sum, as in the row-wise Adam kernel
                if s == 0:
                    s = iav
                s2 = s + q
                rec[aoff] = s2
                std = np.sqrt(s2) + eps
                if wd_mode == WD_L2:
                    for j in range(d):
                        w_[j] = w_[j] + (neg_clr * y_[j]) / std
                else:
                    for j in range(d):
                        w_[j] = w_[j] + (neg_clr * (g_[j] * sgn)) / std
            c0, c1 = next_span(ctl, lo, hi, c0, c1)

    return rowwise_adagrad_rows


# PBG's RowAdagrad without weight decay (docs/algorithms.md §7.5), ``op = NO_OPTIONS``
rowwise_adagrad_rows = rowwise_adagrad_options_kernel(WD_NONE)
