"""The host step of ``sparse_adam``: check every table's ``(idx, grad_rows)``, then step all.

Private; the public names live in :mod:`adapters.jax`.

Everything is checked before the first table is written, so a rejected update leaves every
store byte-identical. The shape and dtype checks (:func:`check_pair_static`) need no
values, so under ``jit`` they run at trace time; the rest (:func:`host_step`) runs on the
host, outside ``jit`` or in the ordered ``io_callback``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import dsa_core
from dsa_core.tools import validation

from ._jax_state import PAD_ID, DiskTable, prefix, stale_state_error

__all__ = ["UPDATE", "RowGrads", "check_pair_static", "host_step", "row_grads",
           "split_pairs", "split_params"]

UPDATE = "sparse_adam.update"  # how the messages name the function that was called


class _Ids:
    """The row ids of a :class:`RowGrads`, held as pytree metadata (compared by identity)."""

    __slots__ = ("idx",)

    def __init__(self, idx: Any):
        self.idx = idx

    def __repr__(self) -> str:
        return f"ids(shape={tuple(np.shape(self.idx))})"


@jax.tree_util.register_pytree_node_class
class RowGrads:
    """The gradient of one table's gathered rows, ``(idx, grads)``, as one pytree node.

    Its only leaf is ``grads`` (``(B, dim)``); the ids travel as metadata. So the optax
    transforms that map over every leaf of the updates before ``sparse_adam`` (clipping,
    ``optax.clip_by_global_norm``, ``optax.clip``, scaling, ``apply_if_finite``...) see the
    gradient rows only, never the integer ids, and ``sparse_adam`` gets the ids back. Build
    it with :func:`row_grads`; ``update`` takes it wherever it takes an ``(idx, grad_rows)``
    pair.
    """

    __slots__ = ("_ids", "grads")

    def __init__(self, idx: Any, grads: Any):
        self._ids = idx if isinstance(idx, _Ids) else _Ids(idx)
        self.grads = grads

    @property
    def idx(self) -> Any:
        return self._ids.idx

    def tree_flatten(self):
        return (self.grads,), self._ids

    @classmethod
    def tree_unflatten(cls, ids, children):
        return cls(ids, children[0])

    def __repr__(self) -> str:
        return f"RowGrads(idx={self._ids!r}, grads={self.grads!r})"


def row_grads(idx: Any, grads: Any) -> RowGrads:
    """``(idx, grads)`` as a :class:`RowGrads`: what to pass when optax transforms run first.

    A plain ``(idx, grad_rows)`` tuple is two leaves, so a transform chained before
    ``sparse_adam`` would also clip or scale the integer ids (and fail on their dtype);
    ``row_grads(batch.idx, g)`` hides the ids from it.

    >>> import numpy as np, jax
    >>> from adapters import jax as dsa_jax
    >>> rg = dsa_jax.row_grads(np.array([3, 7]), np.ones((2, 4), np.float32))
    >>> len(jax.tree.leaves(rg)), rg.idx.tolist()
    (1, [3, 7])
    """
    return RowGrads(idx, grads)


def split_pairs(updates: Any, treedef: Any, tables: list[DiskTable],
                where: str = UPDATE) -> list[tuple]:
    """One ``(idx, grad_rows)`` pair per table; a dense gradient is refused, with the reason."""
    try:
        leaves = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"{where}: updates must have the structure of the stores given to init, with one "
            f"(idx, grad_rows) pair per table; stores: {treedef}. ({exc})") from None
    pairs = []
    for t, leaf in zip(tables, leaves):
        if isinstance(leaf, RowGrads):
            pairs.append((leaf.idx, leaf.grads))
            continue
        if isinstance(leaf, (tuple, list)) and len(leaf) == 2 and leaf[0] is not None:
            pairs.append((leaf[0], leaf[1]))
            continue
        shape = getattr(leaf[1] if isinstance(leaf, (tuple, list)) and len(leaf) == 2
                        else leaf, "shape", None)
        dense = shape is not None and len(shape) == 2 and shape[0] == t.num_rows
        what = (f"a dense table gradient of shape {tuple(shape)} (num_rows = {t.num_rows})"
                if dense else f"{type(leaf).__name__}"
                + (f" of shape {tuple(shape)}" if shape is not None else ""))
        raise TypeError(
            f"{prefix(where, t)}update takes row gradients (idx, grad_rows), got {what}. A "
            "dense gradient of the whole table defeats an out-of-core optimizer (and would be "
            "num_rows x dim on the device): gather the batch's rows with "
            "adapters.jax.gather_batch(store, ids), differentiate the loss with respect to "
            "batch.rows and pass (batch.idx, grad_rows)")
    return pairs


def split_params(params: Any, treedef: Any, n: int, where: str = UPDATE) -> list:
    """The ``params`` rows per table (``None`` for tables that hold their weights)."""
    if params is None:
        return [None] * n
    try:
        return treedef.flatten_up_to(params)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{where}: params must have the structure of the stores (None for a "
                         f"table that holds its weights); stores: {treedef}. ({exc})") from None


def _dtype_of(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)  # arrays and tracers; lists go through numpy
    return np.dtype(dt) if dt is not None else np.asarray(x).dtype


def check_pair_static(t: DiskTable, idx: Any, grad: Any, param: Any,
                      where: str = UPDATE) -> None:
    """Shape/dtype checks that need no values (so they also run while tracing)."""
    lab = prefix(where, t)
    name = where.split(".")[0]
    idx_dt = _dtype_of(idx)
    idx_shape = tuple(np.shape(idx))
    if idx_dt == np.bool_ or idx_dt.kind not in "iu":
        raise TypeError(f"{lab}idx must hold integer row ids, got dtype {idx_dt}; convert "
                        "with idx.astype(np.int64) (floats are not rounded for you). If an "
                        f"optax transform runs before {name} (optax.chain(..., "
                        f"{name})), it mapped over the ids of an (idx, grad_rows) tuple: "
                        "pass adapters.jax.row_grads(batch.idx, grad_rows) instead, whose ids "
                        "no transform sees")
    if len(idx_shape) != 1:
        raise ValueError(f"{lab}idx must be 1-D (one row id per gradient row), got shape "
                         f"{idx_shape}; flatten the ids and reshape grad_rows to "
                         f"(len(idx), {t.dim})")
    if idx_dt.itemsize < 8 and t.num_rows - 1 > np.iinfo(idx_dt).max:
        raise TypeError(f"{lab}idx of dtype {idx_dt} cannot address {t.num_rows} rows; "
                        "use int64 ids (inside jit: enable jax_enable_x64)")
    g_shape = tuple(np.shape(grad))
    g_dt = _dtype_of(grad)
    b = idx_shape[0]
    if len(g_shape) != 2 or g_shape[1] != t.dim:
        raise ValueError(
            f"{lab}grad_rows must have shape (len(idx), dim) = ({b}, {t.dim}), got "
            f"{g_shape}" + ("; the store has another dim: is this the right table?"
                            if len(g_shape) == 2 else ""))
    if g_shape[0] != b:
        dense = g_shape[0] == t.num_rows
        raise ValueError(
            f"{lab}idx and grad_rows must have the same length, got {b} ids and "
            f"{g_shape[0]} gradient rows"
            + ("; grad_rows has num_rows rows: it looks like a dense table gradient. "
               "Differentiate with respect to batch.rows from adapters.jax.gather_batch "
               "instead" if dense else ""))
    if g_dt != t.dtype:
        hint = ("; float64 needs jax.config.update('jax_enable_x64', True)"
                if t.dtype == np.float64 and g_dt == np.float32
                and not jax.config.jax_enable_x64 else "")
        raise TypeError(f"{lab}grad_rows must have the store dtype {t.dtype.name}, got "
                        f"{g_dt}; convert with grad.astype(np.{t.dtype.name}){hint}")
    if t.has_weights:
        if param is not None:
            raise ValueError(f"{lab}params is only for stores created with weights=False; "
                             "this store holds the weights itself (pass None for it)")
    else:
        if param is None:
            raise ValueError(f"{lab}this store was created with weights=False: pass the "
                             f"current weight rows of idx as params, shape ({b}, {t.dim})")
        p_shape = tuple(np.shape(param))
        p_dt = _dtype_of(param)
        if p_shape != (b, t.dim) or p_dt != t.dtype:
            raise ValueError(f"{lab}params must be a ({b}, {t.dim}) {t.dtype.name} array "
                             f"(the weight rows of idx), got {p_shape} {p_dt}")


def _unpadded_length(idx: np.ndarray) -> int:
    """Length of ``idx`` without its trailing run of ``PAD_ID`` entries."""
    n = idx.shape[0]
    if n == 0 or idx[-1] != PAD_ID:
        return n
    real = np.flatnonzero(idx != PAD_ID)
    return int(real[-1]) + 1 if real.size else 0


def check_tables(where: str, tables: list[DiskTable], count: int) -> None:
    """Every table open for writing and at ``count``, its State current; or a clear error.

    An optimizer state whose ``count`` its tables have passed was used again after an
    ``update`` (:func:`~adapters._jax_state.stale_state_error`); a table whose State is no
    longer current lost its store to another optimizer state.
    """
    for t in tables:
        core = t._core
        if not core.writable:
            raise ValueError(f"{prefix(where, t)}store {str(core.path)!r} is "
                             f"{'closed' if core.closed else 'read-only'}; reopen it with "
                             "dsa_core.open(path) (mode 'r+') and init again")
        if core.count != count or not core.current:
            raise stale_state_error(where, t, count)


def host_step(tables: list[DiskTable], count: int, lr: float | None, idxs: list,
              grads: list, params: list, return_rows: bool,
              where: str = UPDATE) -> list:
    """One step of the stores' optimizer on every table; everything checked before the
    first byte is written.

    ``lr=None`` steps each table at its store's own ``lr``. Returns the updated rows of
    every table (``None`` each with ``return_rows=False``).
    """
    if lr is not None:  # a schedule's value (a constant lr was checked by sparse_adam)
        validation.check_lr(lr, allow_zero=True,
                            what=f"{where} (learning-rate schedule at count {count})")
    check_tables(where, tables, count)
    multi = len(tables) > 1
    plans = []
    for t, idx, g, p in zip(tables, idxs, grads, params):
        lab = prefix(where, t)
        idx = np.asarray(idx)
        g = np.asarray(g)
        check_pair_static(t, idx, g, p, where)
        n = _unpadded_length(idx)
        if n < idx.shape[0]:
            if g[n:].any():
                raise ValueError(
                    f"{lab}padding rows (id {PAD_ID}) must have a zero gradient, but "
                    f"{int(np.count_nonzero(g[n:].any(axis=1)))} of them do not: the loss "
                    "reads batch.rows directly; read it only through rows[batch.inverse]")
            idx_t, g_t = idx[:n], g[:n]
        else:
            idx_t, g_t = idx, g
        if n:  # dsa_core.step checks too, but per table: check every table first
            lo, hi = int(idx_t.min()), int(idx_t.max())
            if lo < 0 or hi >= t.num_rows:
                raise IndexError(f"{lab}idx must lie in [0, num_rows) = [0, {t.num_rows}); "
                                 f"got {lo if lo < 0 else hi} (min {lo}, max {hi}); padding "
                                 f"ids ({PAD_ID}) are allowed only as a trailing block")
            if multi:  # a log store's region must hold the rows: every table first
                dsa_core.check_batch(t._core, idx_t)
            if multi and t._core.nonfinite == "raise" and not np.isfinite(g_t).all():
                raise FloatingPointError(f"{lab}grad_rows hold NaN or Inf; nothing was "
                                         "written (nonfinite='raise')")
        p_t = None
        if p is not None:
            p_t = np.array(np.asarray(p)[:n], dtype=t.dtype, order="C")  # writable copy
        plans.append((t, idx.shape[0], n, idx_t, g_t, p_t))

    # one step over every table, all or nothing (an error in one table's update puts the
    # others back; a Ctrl-C takes effect once every table and handle is updated); lr may be
    # 0 (a warm-up schedule): dsa_core.step accepts it per step
    updates = [(t._core, idx_t, g_t, {"lr": lr, "params": p_t})
               for t, _, _, idx_t, g_t, p_t in plans]
    def adopt(new):
        for (t, *_), core in zip(plans, new, strict=True):
            t._core = core

    with dsa_core.tools.deferred_sigint():
        dsa_core.tools.step_many_into(updates, adopt)  # (also a step that stood in doubt)
    out = []
    for t, b, n, idx_t, g_t, p_t in plans:
        if not return_rows:
            out.append(None)
            continue
        rows = np.zeros((b, t.dim), t.dtype)
        if p_t is not None:
            rows[:n] = p_t
        elif n:
            dsa_core.gather(t._core, idx_t, out=rows[:n])
        out.append(rows)
    return out
