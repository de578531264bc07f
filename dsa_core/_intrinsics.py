"""Helpers shared by the two kernel modules: a software-prefetch intrinsic (``llvm.prefetch``),
the per-row prelude (record prefetch, finiteness check) and the per-row options of
docs/algorithms.md §7.1–§7.2 (counters, per-row bias corrections, weight decay factors).

Rows of a batch are scattered over a table much larger than the CPU caches, so every record
is a DRAM (or page-cache) miss; asking for the record a few rows ahead hides that latency.
Measured on 2048 sorted random rows of a 1M x 128 float32 table, 2 threads: 0.281 -> 0.206 ms
per Euclidean step (median of 300).

Note for numba's cache: a cached kernel is invalidated by changes to its own source file only,
so after editing this module clear ``dsa_core/__pycache__/*.nb[ic]``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload


def _prefetch(builder, i8ptr, write: bool) -> None:
    """Emit ``llvm.prefetch`` of the byte at ``i8ptr``: for a write or a read, locality 3
    (keep in all cache levels), the data cache."""
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
    builder.call(fn, [i8ptr, ir.Constant(i32, int(write)), ir.Constant(i32, 3),
                      ir.Constant(i32, 1)])


@intrinsic
def prefetch_line(typingctx, arr, row, col):
    """Hint that ``arr[row, col]``'s cache line will be written soon (no fault, no effect)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None
    sig = types.void(arr, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [args[1], args[2]],
                                       wraparound=False)
        _prefetch(builder, builder.bitcast(ptr, ir.IntType(8).as_pointer()), write=True)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_line_addr(typingctx, addr):
    """Hint that the cache line at the address ``addr`` will be read soon (no fault: an
    address whose page is not mapped yet is simply not prefetched)."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.void(types.int64)

    def codegen(context, builder, signature, args):
        _prefetch(builder, builder.inttoptr(args[0], ir.IntType(8).as_pointer()), write=False)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def u8_ptr(typingctx, addr):
    """The address ``addr`` (an int64: a mapping's or an array's data address) as a
    ``uint8*``, for ``numba.carray(u8_ptr(addr), n)``: a view of ``n`` bytes there. The
    caller keeps whatever owns that memory alive for as long as the view is used."""
    if not isinstance(addr, types.Integer):
        return None
    sig = types.CPointer(types.uint8)(types.int64)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return sig, codegen


@intrinsic
def f32_bits(typingctx, x):
    """The IEEE bits of a float32, as uint32 (a bitcast, no conversion)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def bits_f32(typingctx, u):
    """The float32 whose IEEE bits are the low 32 bits of the integer ``u`` (a bitcast).

    Any integer type is taken: numba widens ``uint32 << uint32`` to 64 bits.
    """
    if not isinstance(u, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if u.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        elif u.bitwidth < 32:
            v = builder.zext(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(u), codegen


PREFETCH_ROWS = 4  # software-prefetch distance, in rows of the batch


@njit(inline="always")
def prefetch_record(S, sr, W, wr, woff, d):
    """Prefetch state record ``S[sr]`` (and weight row ``W[wr]`` when it is separate)."""
    line = 64 // S.itemsize
    for c in range(0, S.shape[1], line):
        prefetch_line(S, sr, c)
    if W is not S:  # weights=False: the caller's weight row is a separate array
        for c in range(woff, woff + d, line):
            prefetch_line(W, wr, c)


@njit(inline="always")
def row_is_finite(g):
    """True when every element of the 1-D row ``g`` is finite."""
    for j in range(g.shape[0]):
        if not np.isfinite(g[j]):
            return False
    return True


@njit(nogil=True, fastmath={"reassoc"})
def _dot64_lanes(a, b):
    """float32 rows: the float64 sum vectorised (``reassoc`` on these instructions only)."""
    s = 0.0
    for j in range(a.shape[0]):
        s += np.float64(a[j] * b[j])
    return s


@njit(nogil=True)
def _dot64_serial(a, b):
    """float64 rows: one sequential sum, numpy's order below 8 elements."""
    s = 0.0
    for j in range(a.shape[0]):
        s += a[j] * b[j]
    return s


def dot64(a, b):
    """``sum(a[j] * b[j])`` of two 1-D rows: products in their dtype, sums in float64.

    float32 rows (``_dot64_lanes``): the sum runs in SIMD lanes. Without ``reassoc`` LLVM
    keeps a float reduction scalar (``vaddsd``), and 7 such passes per row made the Poincaré
    kernel compute-bound (0.85 -> 0.46 ms on 2048 cached rows). The float64 sum of float32
    products is exact or all but exact, so the order does not show after the final rounding
    to float32: results stay bit-identical to the reference.
    float64 rows (``_dot64_serial``): a sequential sum, as before. There the order does show,
    and the ball's transport can amplify a last-bit difference to 1e-5 relative with extreme
    gradients (hypothesis found one with a lanes sum), so float64 keeps the reference's order.
    """
    s = 0.0
    for j in range(a.shape[0]):
        s += float(a[j] * b[j])
    return s


@overload(dot64)
def _dot64_overload(a, b):
    if a.dtype == types.float32 and b.dtype == types.float32:
        return lambda a, b: _dot64_lanes(a, b)
    return lambda a, b: _dot64_serial(a, b)


# -- per-row options (docs/algorithms.md §7.1, §7.2) -------------------------------------------
# Weight decay modes.
WD_NONE, WD_L2, WD_DECOUPLED = 0, 1, 2

# Every kernel is compiled per combination of options (the plain kernels are the
# combination with none on) and takes one float64 array ``op`` for everything the options
# need, packed by :func:`options_array` (:data:`NO_OPTIONS` when none is on): one argument,
# because each argument of a kernel call
# costs the dispatcher time and a step makes 16 calls. The integers (counter offsets, the
# step, the mode) are exact in float64. The per-row values are computed in double and
# rounded once to T, as the glue computes the global ones (a T array cannot hold them:
# fl32(0.9) is not 0.9). Indices into ``op``:
OP_RS, OP_LS, OP_T, OP_MODE, OP_LR, OP_B1, OP_B2, OP_KEEP, OP_NTAB, OP_SAT = range(10)
# ``OP_RS`` / ``OP_LS``: element offsets of the ``row_step`` / ``last_step`` counters, -1 if
# absent. ``OP_POW``: 64 powers keep**(2**i) (each libm pow) for the catch-up decay of
# ``k`` steps by binary powering (:func:`decay_factor`: ``popcount(k)`` multiplications
# instead of a pow call per row, which measured +7% on a warm 1M x 128 step).
OP_POW = 10
N_POW = 64
# ``OP_STEP``: SparseAdam's per-row step size fl(-(lr*sqrt(bc2))/bc1) of the counts below
# N_STEP, for the current lr (the elementwise kernel's per_row_step: a lookup instead of a
# division for the many rows with few updates), as float64 holding float32 or float64 values.
OP_STEP = OP_POW + N_POW
N_STEP = 256
# Then, for per_row_step stores, a table of the bias corrections of the counts 0..ntab-1,
# three values per count: 1 - b1**t, 1 - b2**t, sqrt(1 - b2**t) -- the bits of the pow calls
# (libm's pow, as numba's math.pow and Python's ** call it) without two pow calls per row
# (with them: +10% on a warm 1M x 128 step). ``OP_SAT`` = 1 when the table reaches the count
# past which both corrections are exactly 1.0 (b**t <= 2**-54).
OP_TAB = OP_STEP + N_STEP
BIAS_TABLE_MAX = 1 << 16  # counts in the table (1.5 MiB); larger ones call pow


@njit(cache=True)
def _fill_bias_table(op, b1, b2, ntab):
    for t in range(ntab):
        ft = float(t)
        c1 = 1.0 - math.pow(b1, ft)
        c2 = 1.0 - math.pow(b2, ft)
        o = OP_TAB + 3 * t
        op[o] = c1
        op[o + 1] = c2
        op[o + 2] = math.sqrt(c2)


def _saturation(b: float) -> int:
    """The smallest count t >= 1 from which ``1 - b**t == 1.0`` in double (monotone in t)."""
    if b == 0.0:
        return 1
    t = max(1, math.ceil(-54 * math.log(2) / math.log(b)))
    while t > 1 and 1.0 - b ** (t - 1) == 1.0:
        t -= 1
    while 1.0 - b**t != 1.0:
        t += 1
    return t


def options_array(*, rs_off: int = -1, ls_off: int = -1, t: int = 0, wd_mode: int = WD_NONE,
                  lr: float = 0.0, betas: tuple[float, float] = (0.0, 0.0),
                  weight_decay: float = 0.0, dtype: Any = np.float32,
                  out: np.ndarray | None = None) -> np.ndarray:
    """The kernels' ``op`` array for one step (module comment above).

    ``rs_off``, ``ls_off``: the counters' offsets (-1: absent); ``t`` the global step;
    ``wd_mode`` one of ``WD_NONE``, ``WD_L2``, ``WD_DECOUPLED``; ``lr``, ``betas`` and
    ``keep = 1 - lr*wd`` unrounded; ``dtype`` the store's (the rounding of the per-row step
    sizes). ``out``, an earlier result of the same store, is updated in place: the bias table
    (``rs_off >= 0``) is built once per betas, the powers and step sizes once per lr and wd.
    """
    b1, b2 = betas
    table = rs_off >= 0
    if out is None or out[OP_B1] != b1 or out[OP_B2] != b2 or (out[OP_NTAB] > 0) != table:
        ntab, sat = 0, 0.0
        if table:
            ntab = max(_saturation(b1), _saturation(b2))
            sat = 1.0 if ntab <= BIAS_TABLE_MAX else 0.0
            ntab = min(ntab, BIAS_TABLE_MAX)
        out = np.full(OP_TAB + 3 * ntab, np.nan)
        out[OP_B1], out[OP_B2], out[OP_NTAB], out[OP_SAT] = b1, b2, ntab, sat
        if ntab:
            _fill_bias_table(out, b1, b2, ntab)
    out[OP_RS], out[OP_LS], out[OP_T], out[OP_MODE] = rs_off, ls_off, t, wd_mode
    if table and (out[OP_LR] != lr or np.isnan(out[OP_STEP + 1])):
        _fill_step_sizes(out, lr, np.dtype(dtype) == np.float32)
    out[OP_LR] = lr
    keep = 1.0 - lr * weight_decay
    if out[OP_KEEP] != keep or out[OP_POW] != keep:  # new: the powers of this keep
        out[OP_KEEP] = keep
        out[OP_POW:OP_POW + N_POW] = decay_powers(keep)
    return out


def decay_powers(keep: float) -> list[float]:
    """``keep ** (2 ** i)`` for ``i < 64``, in double (Python's ``**``: libm pow)."""
    return [keep ** (1 << i) for i in range(N_POW)]


NO_OPTIONS = options_array()
"""The ``op`` of a step with no option on, shared by every store (read-only: the kernels
compiled without options read none of it, and ``options_array`` never takes it as ``out``)."""
NO_OPTIONS.flags.writeable = False


@njit(inline="always")
def unpack_options(op):
    """``(rs_off, ls_off, t, wd_mode)`` of ``op`` as ints."""
    return int(op[OP_RS]), int(op[OP_LS]), int(op[OP_T]), int(op[OP_MODE])


def counter_view(S):
    """``S`` (the records) viewed as the counters' ints: int32 for float32 records, int64 for
    float64 (``_layout.counter_dtype``); same shape, so the same element offsets."""
    return S.view(np.int32 if S.dtype == np.float32 else np.int64)


@overload(counter_view)
def _counter_view_overload(S):
    if S.dtype == types.float32:
        return lambda S: S.view(np.int32)
    return lambda S: S.view(np.int64)


_I32_MAX = np.int64(2**31 - 1)
_I64_MAX = np.int64(2**63 - 1)
_U32_MASK = np.int64(2**32 - 1)


@njit(inline="always")
def read_counters(C, r, rs_off, ls_off, t):
    """The counters of record ``r`` for an update at global step ``t``: ``(tr, k)``.

    ``C`` is the records viewed as ints. With a ``row_step`` slot (``rs_off >= 0``), ``tr =
    t_r + 1``, the row's own count for this update (else ``tr = 0``: the global corrections).
    With a ``last_step`` slot, ``k = t - last``, the number of steps whose decay the row takes
    now (the missed ones and this one; at least 1, should a count have been set back); else
    ``k = 1``. ``tr`` is at least 1 (a negative count written by an importer cannot index
    outside the bias table). int32 counters (float32 stores): ``t_r`` saturates at 2**31 - 1 (every
    correction is exactly 1.0 long before, for any beta up to 1 - 1e-8), and ``last`` holds
    ``t`` modulo 2**32, the gap taken modulo 2**32 too: exact for any gap below 2**32 steps.
    Reading only: :func:`write_counters` stores them after the row's update.
    """
    narrow = C.itemsize == 4
    tr = 0
    if rs_off >= 0:
        tr = min(max(C[r, rs_off] + 1, 1), _I32_MAX if narrow else _I64_MAX)
    k = 1
    if ls_off >= 0:
        k = t - C[r, ls_off]
        if narrow:
            k &= _U32_MASK
        k = max(k, 1)
    return tr, k


@njit(inline="always")
def write_counters(C, r, rs_off, ls_off, tr, t):
    """Store ``t_r = tr`` and ``last = t`` (an int32 slot keeps the low 32 bits) in record
    ``r``. Called after the row's update loops, not before: a store to the record's last cache
    line, which arrives last, stalled the stores of the whole row behind it (measured +10% on a
    warm 1M x 128 step; after the loops, +1%)."""
    if rs_off >= 0:
        C[r, rs_off] = tr
    if ls_off >= 0:
        C[r, ls_off] = t


@njit(inline="always")
def row_bias_corrections(op, tr):
    """``(1 - b1**tr, 1 - b2**tr, sqrt(1 - b2**tr))`` in float64, bit for bit as libm's ``pow``
    (and Python's ``b**t`` in the glue) gives them: from the table of ``op``, or 1.0 past the
    saturation count, or pow calls. A row with ``tr == t`` gets the global corrections."""
    ntab = int(op[OP_NTAB])
    if tr < ntab:
        o = OP_TAB + 3 * tr
        return op[o], op[o + 1], op[o + 2]
    if op[OP_SAT] != 0.0:
        return 1.0, 1.0, 1.0
    ftr = float(tr)
    c2 = 1.0 - math.pow(op[OP_B2], ftr)
    return 1.0 - math.pow(op[OP_B1], ftr), c2, math.sqrt(c2)


@njit(cache=True)
def _fill_step_sizes(op, lr, single):
    """``op[OP_STEP + t] = fl(-(lr*sqrt(bc2))/bc1)`` for ``1 <= t < N_STEP`` (rounded to
    float32 when ``single``), from :func:`row_bias_corrections`: the same bits the kernel would
    compute."""
    for t in range(1, N_STEP):
        bc1, _, sq2 = row_bias_corrections(op, t)
        s = -((lr * sq2) / bc1)
        op[OP_STEP + t] = np.float32(s) if single else s


@njit(inline="always")
def row_corrections(T, op, tr, bc1, bc2):
    """``(fl(bc1), fl(bc2))`` in T with the row's own count ``tr``, for the kernels that divide
    by the corrections themselves; the global ``bc1``, ``bc2`` (already T) for ``tr == 0``."""
    if tr == 0:
        return bc1, bc2
    c1, c2, _ = row_bias_corrections(op, tr)
    return T(c1), T(c2)


@njit(inline="always")
def decay_factor(keep, op, k):
    """The decoupled decay of ``k`` steps in T: ``keep = fl(1 - lr*wd)`` for ``k == 1``, else
    ``(1 - lr*wd)**k`` by binary powering in float64 -- the product, from the lowest bit of
    ``k`` up, of the powers ``keep**(2**i)`` of its set bits (``OP_POW``) -- rounded once to T.
    Within ``popcount(k)`` double roundings of the exact power (about 1e-15 relative)."""
    if k == 1:
        return keep
    f = 1.0
    i = OP_POW
    while k:
        if k & 1:
            f *= op[i]
        k >>= 1
        i += 1
    return type(keep)(f)
