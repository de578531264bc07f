"""Numba kernel: row-wise Euclidean lazy Adam, exactly ``torch.optim.SparseAdam`` (spec §2.2).

Kernels see arrays and scalars only. Preconditions, checked by the glue in ``_step``:
``srows`` unique (so the parallel loop has no write races), all row ids in range, ``G`` of
shape ``(len(srows), dim)`` in the store dtype, scalars already rounded to that dtype.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def adam_rows_euclid(W, wrows, woff, S, srows, moff, voff, G, sgn, a1, a2, eps, neg_s,
                     skip_nonfinite):
    """Update rows ``srows`` of the state ``S`` and rows ``wrows`` of the weights ``W``.

    Per coordinate, in storage dtype T (spec §2.2)::

        g  = sgn * G                       # sgn = -1 for maximize (exact)
        dm = (g - m) * a1 ;  dv = (g*g - v) * a2
        m' = m + dm ;  v' = v + dv
        p' = p + neg_s * ((dm + m) / (sqrt(v') + eps))

    ``W`` and ``S`` may be the same array (weights stored in the record) or not
    (``weights=False`` stores: ``W`` holds the caller's rows).
    """
    n = srows.shape[0]
    d = G.shape[1]
    for i in prange(n):
        if skip_nonfinite:
            ok = True
            for j in range(d):
                if not np.isfinite(G[i, j]):
                    ok = False
            if not ok:
                continue
        sr = srows[i]
        wr = wrows[i]
        for j in range(d):
            g = G[i, j] * sgn
            m = S[sr, moff + j]
            v = S[sr, voff + j]
            dm = (g - m) * a1
            dv = (g * g - v) * a2
            m2 = m + dm
            v2 = v + dv
            S[sr, moff + j] = m2
            S[sr, voff + j] = v2
            den = np.sqrt(v2) + eps
            W[wr, woff + j] = W[wr, woff + j] + neg_s * ((dm + m) / den)
