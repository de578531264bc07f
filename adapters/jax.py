r"""JAX adapter: an optax-style sparse Adam transform whose state lives in ``dsa_core`` stores.

The embedding tables stay on disk (``dsa_core`` stores, mapped into memory); a training
step only ever moves the rows of its batch:

1. :func:`gather` deduplicates the batch's ids, reads those rows from the store and puts
   them on the device as one ``(K, dim)`` block (optionally padded to a bucket size);
2. the loss is a function of that block (``block[batch.inverse]``), so ``jax.grad`` gives
   exactly the row gradients, duplicates summed;
3. ``update((batch.idx, grad_rows), opt_state)`` of the transform from :func:`sparse_adam`
   applies one lazy Adam step to those rows in the store (``dsa_core.step``) and returns
   the new rows, so the caller can keep them on the device.

Checkpoints: :func:`checkpoint` writes a consistent snapshot of every table (committed by one
atomic rename) and :func:`restore` copies one back into the live stores.

``update`` runs on the host, outside ``jax.jit`` (the default, and the cheapest), or, for a
transform built with ``in_jit=True``, inside ``jit``/``lax.scan`` through an ordered
``jax.experimental.io_callback``.

Examples
--------
>>> import tempfile, numpy as np, jax, jax.numpy as jnp, dsa_core
>>> from adapters import jax as dsa_jax
>>> tmp = tempfile.mkdtemp()
>>> store = dsa_core.create(tmp + "/emb", 1000, 8, init="normal", progress=False)
>>> tx = dsa_jax.sparse_adam(1e-2)
>>> opt_state = tx.init(store)
>>> batch = dsa_jax.gather(opt_state.stores, np.array([3, 7, 3]))
>>> batch.idx, batch.inverse.tolist()
(array([3, 7]), [0, 1, 0])
>>> g = jax.grad(lambda block: jnp.sum(block[batch.inverse] ** 2))(batch.rows)
>>> rows, opt_state = tx.update((batch.idx, g), opt_state)
>>> rows.shape, int(opt_state.count)
((2, 8), 1)
>>> dsa_jax.close(opt_state)
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import dsa_core
from dsa_core._format import staged_dir
from dsa_core._state import restore_rows

__all__ = [
    "PAD_ID",
    "Batch",
    "DiskAdamState",
    "SparseGradientTransformation",
    "StoreHandle",
    "bucket_size",
    "checkpoint",
    "close",
    "core_states",
    "flush",
    "gather",
    "restore",
    "sparse_adam",
    "warmup",
]

PAD_ID = -1
"""Row id of a padding row in ``Batch.idx``: its gradient must be zero and it is never stepped."""

_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------
# The store handle: a static (leafless) pytree node
# ---------------------------------------------------------------------------------------------
# One live handle per open store: a second ``init`` on the same store retires the first handle,
# so an old optimizer state can never step the store with a stale count.
_LIVE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@jax.tree_util.register_static
class StoreHandle:
    """The optimizer's grip on one open ``dsa_core`` store; static for ``jax.tree``.

    ``jax.tree_util.register_static`` makes a handle a pytree node with no leaves: it is
    invisible to ``jax.tree.map``/``leaves``, and ``jax.jit`` passes it through as static
    data, hashed by identity (a new handle means a retrace; the same handle never does).

    The handle holds the current ``dsa_core.State`` of its store and replaces it after every
    step (``dsa_core.step`` returns a new state with ``count + 1``). Read it with
    :attr:`core_state`, e.g. to flush or close the store. Handles are made by
    ``init`` of :func:`sparse_adam`; do not step the store by other means while a handle
    drives it.

    Attributes
    ----------
    name : str
        The table's key path in the stores pytree (``"['user']"``; ``""`` for a lone store),
        used in error messages.
    """

    __slots__ = ("__weakref__", "_async", "_core", "_retired", "name")

    def __init__(self, core_state: dsa_core.State, name: str = "", *,
                 in_jit: bool = False) -> None:
        self._core = core_state
        self._retired = False
        self._async = in_jit  # steps may still be pending in an io_callback
        self.name = name

    @property
    def core_state(self) -> dsa_core.State:
        """The current ``dsa_core.State`` of the store (its ``count`` is the global t)."""
        self._sync()
        return self._core

    def _sync(self) -> None:
        """Wait for steps dispatched inside jit (ordered io_callbacks) to finish."""
        if self._async:
            jax.effects_barrier()

    @property
    def path(self) -> Path:
        return self._core.path

    @property
    def num_rows(self) -> int:
        return self._core.num_rows

    @property
    def dim(self) -> int:
        return self._core.dim

    @property
    def dtype(self) -> np.dtype:
        return self._core.dtype

    @property
    def curvature(self) -> float:
        return self._core.curvature

    @property
    def has_weights(self) -> bool:
        return self._core.has_weights

    def _label(self) -> str:
        return f"table {self.name}" if self.name else "the store"

    def __repr__(self) -> str:
        c = self._core
        return (f"StoreHandle({str(c.path)!r}, num_rows={c.num_rows}, dim={c.dim}, "
                f"dtype={c.dtype.name}, curvature={c.curvature}, count={c.count})")


def _is_store_leaf(x: Any) -> bool:
    return isinstance(x, (dsa_core.State, StoreHandle))


def _flatten_handles(stores: Any) -> tuple[list[StoreHandle], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(stores, is_leaf=_is_store_leaf)
    for leaf in leaves:
        if not isinstance(leaf, StoreHandle):
            raise TypeError(
                f"opt_state.stores must hold StoreHandles (made by init), got "
                f"{type(leaf).__name__}; pass the state returned by tx.init(stores)")
    return leaves, treedef


# ---------------------------------------------------------------------------------------------
# State and transformation types
# ---------------------------------------------------------------------------------------------
class DiskAdamState(NamedTuple):
    """State of :func:`sparse_adam`: a step counter plus the store handles.

    The moments live in the stores, not here: ``jax.tree.leaves(state)`` is ``[count]``.
    """

    count: Any  # shape=(), dtype=int32: completed steps, the global t (numpy on the host
    #             path, jax.Array with in_jit=True)
    stores: Any  # pytree of StoreHandle (static: no leaves), the structure given to init


class SparseGradientTransformation(NamedTuple):
    """``(init, update)`` in the shape of ``optax.GradientTransformation``.

    It is deliberately *not* an ``optax.GradientTransformation``: ``update`` takes row
    gradients ``(idx, grad_rows)`` and returns new rows, not additive updates, so it must
    not be combined with ``optax.chain``.
    """

    init: Callable[[Any], DiskAdamState]
    update: Callable[..., tuple[Any, DiskAdamState]]


class Batch(NamedTuple):
    """The deduplicated rows of one batch, from :func:`gather`.

    ``idx`` holds the sorted unique ids, then ``PAD_ID`` (-1) for each padding row; ``rows``
    the matching weight rows on the device (padding rows are zeros); ``inverse`` maps every
    id of the batch to its row of ``rows`` (same shape as the ids), so ``rows[inverse]`` is
    the batch's embedding lookup. Pass ``(batch.idx, grad_rows)`` to ``update``.
    """

    rows: jax.Array  # (K_pad, dim), store dtype, on the device
    idx: np.ndarray  # (K_pad,), int64, host: sorted unique ids then PAD_ID padding
    inverse: jax.Array  # ids.shape, int32, on the device: position of each id in rows
    num_unique: int  # K: the number of real (non-padding) rows


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------
def _check_positive(name: str, value: Any, *, allow_zero: bool = False) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    ok = math.isfinite(v) and (v >= 0.0 if allow_zero else v > 0.0)
    if not ok:
        raise ValueError(f"Invalid {name}: {value!r}; it must be a finite number "
                         f"{'>= 0' if allow_zero else '> 0'}")
    return v


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _to_host(xs: list) -> list:
    """numpy views of a list of arrays; device (GPU/TPU) arrays are copied asynchronously first.

    On CPU ``np.asarray(jax_array)`` is a zero-copy read-only view; on an accelerator all the
    device-to-host copies are started together before the first blocking ``np.asarray``.
    """
    for x in xs:
        if isinstance(x, jax.Array) and not _on_cpu(x):
            x.copy_to_host_async()
    return [None if x is None else np.asarray(x) for x in xs]


def _on_cpu(x: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in x.devices())


def _default_device() -> Any:
    dev = jax.config.jax_default_device
    return dev if dev is not None and not isinstance(dev, str) else jax.devices()[0]


def _put(x: np.ndarray, where: Any = None) -> jax.Array:
    """Host array to device. ``where``: None (default device), a Device/Sharding, or a
    ``jax.Array`` whose placement to copy.

    ``jnp.asarray`` onto the default device is about twice as fast as ``jax.device_put``
    (17 vs 29 µs for a small array on CPU), so it is used whenever the target is the default.
    """
    if isinstance(where, jax.Array):
        devs = where.devices()
        if len(devs) == 1 and next(iter(devs)) == _default_device():
            return jnp.asarray(x)
        return jax.device_put(x, where.sharding, may_alias=True)
    if where is None:
        return jnp.asarray(x)
    return jax.device_put(x, where, may_alias=True)


def bucket_size(k: int, buckets: None | str | Sequence[int]) -> int:
    """The padded size of ``k`` unique rows under a bucket policy.

    Parameters
    ----------
    k : int
        Number of unique rows.
    buckets : None, "pow2" or sequence of int
        ``None``: no padding (``k``). ``"pow2"``: the next power of two ``>= max(k, 1)``.
        A sequence: the smallest bucket ``>= k``; a ``k`` above the largest bucket falls back
        to the next power of two (one more compiled shape, never an error).

    Returns
    -------
    int

    Examples
    --------
    >>> bucket_size(100, "pow2"), bucket_size(100, (64, 256, 1024)), bucket_size(100, None)
    (128, 256, 100)
    """
    if buckets is None:
        return k
    pow2 = 1 << max(0, (max(k, 1) - 1).bit_length())
    if isinstance(buckets, str):
        if buckets != "pow2":
            raise ValueError(f"buckets must be None, 'pow2' or a sequence of sizes, got "
                             f"{buckets!r}")
        return pow2
    sizes = sorted(int(b) for b in buckets)
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"buckets must be positive sizes, got {list(buckets)!r}")
    for b in sizes:
        if b >= k:
            return b
    return max(pow2, sizes[-1])


# ---------------------------------------------------------------------------------------------
# gather
# ---------------------------------------------------------------------------------------------
def gather(store: Any, ids: Any, *, buckets: None | str | Sequence[int] = None,
           device: Any = None) -> Batch:
    """Deduplicate a batch's ids and put their weight rows on the device as one block.

    Parameters
    ----------
    store : StoreHandle, dsa_core.State or DiskAdamState.stores with one table
        The table to read (``opt_state.stores["user"]``, or a ``dsa_core.State``).
    ids : array-like of int, any shape
        The batch's row ids (e.g. ``(B,)`` or ``(B, 2)``); duplicates allowed. A jax array is
        copied to the host.
    buckets : None, "pow2" or sequence of int, optional
        Pad the number of unique rows ``K`` to a bucket size (see :func:`bucket_size`), so a
        jitted loss sees a few shapes instead of a new one for every ``K``. Padding rows are
        zeros with id ``PAD_ID`` (-1); no id maps to them, so their gradient is exactly zero,
        and ``update`` drops them: they are not counted as touched and not stepped.
    device : jax.Device or jax.sharding.Sharding, optional
        Where to put ``rows`` and ``inverse`` (default: JAX's default device).

    Returns
    -------
    Batch
        ``rows`` ``(K_pad, dim)`` on the device, ``idx`` ``(K_pad,)`` int64 on the host,
        ``inverse`` (``ids.shape``, int32) on the device and ``num_unique = K``.

    Raises
    ------
    TypeError
        ``ids`` are not integers.
    IndexError
        An id is outside ``[0, num_rows)``.
    ValueError
        The store holds no weights (``weights=False``) or is closed.

    Notes
    -----
    ``np.unique(ids, return_inverse=True)`` sorts the ids, so ``idx`` is sorted and unique:
    ``dsa_core.step`` takes its no-copy fast path. The loss must read the block only through
    ``rows[inverse]``; then ``jax.grad`` of the loss with respect to ``rows`` is the row
    gradient, with duplicate ids summed, and zero on padding rows.

    Examples
    --------
    >>> import tempfile, numpy as np, dsa_core
    >>> core = dsa_core.create(tempfile.mkdtemp() + "/t", 100, 4, progress=False)
    >>> batch = gather(core, np.array([[5, 2], [2, 9]]), buckets="pow2")
    >>> batch.idx, batch.inverse.tolist(), batch.num_unique, batch.rows.shape
    (array([ 2,  5,  9, -1]), [[1, 0], [0, 2]], 3, (4, 4))
    >>> dsa_core.close(core)
    """
    core = _core_of(store)
    _require_x64(core.dtype, "gather")
    ids_np = np.asarray(ids)
    if ids_np.dtype == np.bool_ or ids_np.dtype.kind not in "iu":
        raise TypeError(f"ids must hold integer row ids, got dtype {ids_np.dtype}; convert "
                        "with ids.astype(np.int64)")
    uniq, inv = np.unique(ids_np.reshape(-1), return_inverse=True)
    k = int(uniq.shape[0])
    kp = bucket_size(k, buckets)
    idx = np.full(kp, PAD_ID, np.int64)
    idx[:k] = uniq
    rows = np.zeros((kp, core.dim), core.dtype)
    dsa_core.gather(core, idx[:k], out=rows[:k])   # range checks; (0, dim) for k == 0
    inverse = inv.reshape(ids_np.shape).astype(np.int32)
    return Batch(_put(rows, device), idx, _put(inverse, device), k)


def _require_x64(dtype: np.dtype, what: str) -> None:
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{what}: the store is float64 but JAX is in 32-bit mode and would "
                        "round its rows to float32; enable float64 with "
                        "jax.config.update('jax_enable_x64', True) (or create the store "
                        "with dtype='float32')")


def _core_of(store: Any) -> dsa_core.State:
    if isinstance(store, StoreHandle):
        store._sync()  # a jitted step may still be writing these rows (async dispatch)
        return store._core
    if isinstance(store, dsa_core.State):
        return store
    raise TypeError(f"store must be a StoreHandle (opt_state.stores[...]) or a dsa_core.State, "
                    f"got {type(store).__name__}")


# ---------------------------------------------------------------------------------------------
# Validation of (idx, grad) pairs: static part (shapes/dtypes; runs at trace time under jit)
# ---------------------------------------------------------------------------------------------
def _split_pairs(updates: Any, treedef: Any, handles: list[StoreHandle]) -> list[tuple]:
    try:
        leaves = treedef.flatten_up_to(updates)
    except (ValueError, TypeError) as exc:
        raise ValueError(
            "updates must have the structure of the stores given to init, with one "
            f"(idx, grad_rows) pair per table; stores: {treedef}. ({exc})") from None
    pairs = []
    for h, leaf in zip(handles, leaves):
        if isinstance(leaf, (tuple, list)) and len(leaf) == 2 and leaf[0] is not None:
            pairs.append((leaf[0], leaf[1]))
            continue
        shape = getattr(leaf[1] if isinstance(leaf, (tuple, list)) and len(leaf) == 2
                        else leaf, "shape", None)
        dense = shape is not None and len(shape) == 2 and shape[0] == h.num_rows
        what = (f"a dense table gradient of shape {tuple(shape)} (num_rows = {h.num_rows})"
                if dense else f"{type(leaf).__name__}"
                + (f" of shape {tuple(shape)}" if shape is not None else ""))
        raise TypeError(
            f"{h._label()}: update takes row gradients (idx, grad_rows), got {what}. A dense "
            "gradient of the whole table defeats an out-of-core optimizer (and would be "
            "num_rows x dim on the device): gather the batch's rows with "
            "adapters.jax.gather(store, ids), differentiate the loss with respect to "
            "batch.rows and pass (batch.idx, grad_rows)")
    return pairs


def _dtype_of(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)  # arrays and tracers; lists go through numpy
    return np.dtype(dt) if dt is not None else np.asarray(x).dtype


def _check_pair_static(h: StoreHandle, idx: Any, grad: Any, param: Any) -> None:
    """Shape/dtype checks that need no values (so they also run while tracing)."""
    lab = h._label()
    idx_dt = _dtype_of(idx)
    idx_shape = tuple(np.shape(idx))
    if idx_dt == np.bool_ or idx_dt.kind not in "iu":
        raise TypeError(f"{lab}: idx must hold integer row ids, got dtype {idx_dt}; convert "
                        "with idx.astype(np.int64) (floats are not rounded for you)")
    if len(idx_shape) != 1:
        raise ValueError(f"{lab}: idx must be 1-D (one row id per gradient row), got shape "
                         f"{idx_shape}; flatten the ids and reshape grad_rows to "
                         f"(len(idx), {h.dim})")
    if idx_dt.itemsize < 8 and h.num_rows - 1 > np.iinfo(idx_dt).max:
        raise TypeError(f"{lab}: idx of dtype {idx_dt} cannot address {h.num_rows} rows; "
                        "use int64 ids (inside jit: enable jax_enable_x64)")
    g_shape = tuple(np.shape(grad))
    g_dt = _dtype_of(grad)
    b = idx_shape[0]
    if len(g_shape) != 2 or g_shape[1] != h.dim:
        raise ValueError(
            f"{lab}: grad_rows must have shape (len(idx), dim) = ({b}, {h.dim}), got "
            f"{g_shape}" + ("; the store has another dim: is this the right table?"
                            if len(g_shape) == 2 else ""))
    if g_shape[0] != b:
        dense = g_shape[0] == h.num_rows
        raise ValueError(
            f"{lab}: idx and grad_rows must have the same length, got {b} ids and "
            f"{g_shape[0]} gradient rows"
            + ("; grad_rows has num_rows rows: it looks like a dense table gradient. "
               "Differentiate with respect to batch.rows from adapters.jax.gather instead"
               if dense else ""))
    if g_dt != h.dtype:
        hint = ("; float64 needs jax.config.update('jax_enable_x64', True)"
                if h.dtype == np.float64 and g_dt == np.float32
                and not jax.config.jax_enable_x64 else "")
        raise TypeError(f"{lab}: grad_rows must have the store dtype {h.dtype.name}, got "
                        f"{g_dt}; convert with grad.astype(np.{h.dtype.name}){hint}")
    if h.has_weights:
        if param is not None:
            raise ValueError(f"{lab}: params is only for stores created with weights=False; "
                             "this store holds the weights itself (pass None for it)")
    else:
        if param is None:
            raise ValueError(f"{lab}: this store was created with weights=False: pass the "
                             f"current weight rows of idx as params, shape ({b}, {h.dim})")
        p_shape = tuple(np.shape(param))
        p_dt = _dtype_of(param)
        if p_shape != (b, h.dim) or p_dt != h.dtype:
            raise ValueError(f"{lab}: params must be a ({b}, {h.dim}) {h.dtype.name} array "
                             f"(the weight rows of idx), got {p_shape} {p_dt}")


def _split_params(params: Any, treedef: Any, n: int) -> list:
    if params is None:
        return [None] * n
    try:
        return treedef.flatten_up_to(params)
    except (ValueError, TypeError) as exc:
        raise ValueError("params must have the structure of the stores (None for a table "
                         f"that holds its weights); stores: {treedef}. ({exc})") from None


# ---------------------------------------------------------------------------------------------
# The host step: validate every table, then step every table
# ---------------------------------------------------------------------------------------------
def _unpadded_length(idx: np.ndarray) -> int:
    """Length of ``idx`` without its trailing run of ``PAD_ID`` entries."""
    n = idx.shape[0]
    if n == 0 or idx[-1] != PAD_ID:
        return n
    real = np.flatnonzero(idx != PAD_ID)
    return int(real[-1]) + 1 if real.size else 0


def _host_step(handles: list[StoreHandle], count: int, lr: float | None, idxs: list,
               grads: list, params: list, return_rows: bool) -> list:
    """One Adam step on every table. Everything is checked before the first byte is written.

    ``lr=None`` steps each table at its store's own ``lr``.
    """
    if lr is not None and not (math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"Invalid learning rate: {lr} at count {count}; the learning rate "
                         "(or the schedule's value) must be a finite number >= 0")
    multi = len(handles) > 1
    plans = []
    for h, idx, g, p in zip(handles, idxs, grads, params):
        lab = h._label()
        if h._retired:
            raise RuntimeError(
                f"{lab}: this optimizer state was superseded by a later init on the same "
                f"store ({str(h.path)!r}); use the state returned by that init")
        core = h._core
        st = core.store
        if st.closed or st.mode != "r+":
            raise ValueError(f"{lab}: store {str(core.path)!r} is "
                             f"{'closed' if st.closed else 'read-only'}; reopen it with "
                             "dsa_core.open(path) (mode 'r+') and init again")
        if core.count != count:
            raise RuntimeError(
                f"{lab}: stale optimizer state: its count is {count} but the store has made "
                f"{core.count} steps. update mutates the store in place: always continue "
                "with the state returned by the previous update")
        idx = np.asarray(idx)
        g = np.asarray(g)
        _check_pair_static(h, idx, g, p)
        n = _unpadded_length(idx)
        if n < idx.shape[0]:
            if g[n:].any():
                raise ValueError(
                    f"{lab}: padding rows (id {PAD_ID}) must have a zero gradient, but "
                    f"{int(np.count_nonzero(g[n:].any(axis=1)))} of them do not: the loss "
                    "reads batch.rows directly; read it only through rows[batch.inverse]")
            idx_t, g_t = idx[:n], g[:n]
        else:
            idx_t, g_t = idx, g
        if n:  # dsa_core.step checks too, but per table: check every table first
            lo, hi = int(idx_t.min()), int(idx_t.max())
            if lo < 0 or hi >= h.num_rows:
                raise IndexError(f"{lab}: idx must lie in [0, num_rows) = [0, {h.num_rows}); "
                                 f"got {lo if lo < 0 else hi} (min {lo}, max {hi}); padding "
                                 f"ids ({PAD_ID}) are allowed only as a trailing block")
            if multi and core.nonfinite == "raise" and not np.isfinite(g_t).all():
                raise FloatingPointError(f"{lab}: grad_rows hold NaN or Inf; nothing was "
                                         "written (nonfinite='raise')")
        p_t = None
        if p is not None:
            p_t = np.array(np.asarray(p)[:n], dtype=h.dtype, order="C")  # writable copy
        plans.append((h, idx.shape[0], n, idx_t, g_t, p_t))

    out = []
    for h, b, n, idx_t, g_t, p_t in plans:
        # lr may be 0 (a warm-up schedule): dsa_core.step accepts it per step
        h._core = dsa_core.step(h._core, idx_t, g_t, lr=lr, params=p_t)
        if not return_rows:
            out.append(None)
            continue
        rows = np.zeros((b, h.dim), h.dtype)
        if p_t is not None:
            rows[:n] = p_t
        elif n:
            dsa_core.gather(h._core, idx_t, out=rows[:n])
        out.append(rows)
    return out


# ---------------------------------------------------------------------------------------------
# The transform
# ---------------------------------------------------------------------------------------------
def sparse_adam(learning_rate: float | Callable[[Any], Any] | None = None,
                b1: float | None = None, b2: float | None = None, eps: float | None = None,
                *, maximize: bool | None = None, in_jit: bool = False,
                return_rows: bool = True) -> SparseGradientTransformation:
    r"""Lazy (sparse) Adam over ``dsa_core`` stores, as an optax-style ``(init, update)`` pair.

    Parameters
    ----------
    learning_rate : float or callable, optional
        A float ``> 0``, or a schedule ``callable(count) -> lr`` as in optax (called with the
        number of completed steps, 0 for the first update; a schedule may return 0, e.g. a
        warmup: the moments then move but the weights do not). ``None``: each store's own
        ``lr`` (from ``dsa_core.create``/``open``).
    b1, b2, eps : float, optional
        Adam hyperparameters. ``None`` keeps each store's own values; a value overrides them
        for every table (and is written to the store's manifest at the next flush).
    maximize : bool, optional
        Ascend instead of descend; ``None`` keeps the stores' setting.
    in_jit : bool, default False
        ``False``: ``update`` runs on the host and must be called outside ``jax.jit``
        (the default and the fastest). ``True``: ``update`` emits one ordered
        ``jax.experimental.io_callback`` so that the whole train step can be jitted or put in
        ``lax.scan``; it costs a few hundred microseconds more per step (see Notes).
    return_rows : bool, default True
        Return the updated rows from ``update``; ``False`` returns ``None`` and skips the
        read-back and the host-to-device copy.

    Returns
    -------
    SparseGradientTransformation
        ``init(stores) -> DiskAdamState`` and
        ``update(updates, state, params=None) -> (rows, DiskAdamState)``.

        * ``stores``: a ``dsa_core.State`` opened for writing, or a pytree of them (e.g. a dict
          of tables). All must have made the same number of steps (fresh stores: 0).
        * ``updates``: the same structure with one ``(idx, grad_rows)`` pair per table:
          ``idx`` ``(B,)`` integer ids (a trailing block of ``PAD_ID`` padding allowed),
          ``grad_rows`` ``(B, dim)`` in the store dtype — the gradient of the gathered rows,
          never a dense table gradient. numpy or JAX arrays, on any device.
        * ``params``: only for stores created with ``weights=False``: the current weight rows
          ``(B, dim)`` of ``idx`` (``None`` for tables that hold their weights).
        * ``rows``: the structure of the stores with the updated ``(B, dim)`` rows of each
          table (padding rows are zeros), on the device of ``grad_rows`` (numpy in, numpy
          out), or ``None`` with ``return_rows=False``.

    Raises
    ------
    TypeError
        A dense gradient instead of ``(idx, grad_rows)``; non-integer ids; a dtype other than
        the store's.
    ValueError
        A shape mismatch (``idx``/``grad_rows`` lengths, a store of another ``dim``), a closed
        or read-only store, a bad hyperparameter, a nonzero gradient on a padding row.
    IndexError
        An id outside ``[0, num_rows)``.
    RuntimeError
        A stale state (an old ``DiskAdamState`` used again: the stores have moved on), or
        ``update`` of an ``in_jit=False`` transform called under ``jax.jit``.

    Every check runs before any table is written: a rejected update leaves every store
    byte-identical. Under ``in_jit=True`` the shape and dtype checks run at trace time; the
    value checks (id range, padding, staleness) run in the callback and surface as a JAX
    runtime error carrying the same message.

    Notes
    -----
    Semantics are those of ``dsa_core.step``: with ``curvature == 0`` the store follows
    ``torch.optim.SparseAdam`` (lazy Adam: one global step count ``t`` for bias correction;
    rows absent from a batch are not touched and their moments do not decay),

    .. math::

        m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        p \leftarrow p - \frac{\mathrm{lr}\sqrt{1-\beta_2^t}}{1-\beta_1^t}
                        \frac{m}{\sqrt{v}+\epsilon},

    and with ``curvature > 0`` geoopt's ``SparseRiemannianAdam`` on the Poincaré ball. The
    store decides the geometry; this transform only moves arrays.

    ``update`` mutates the stores in place: the returned state is the only valid one (an
    old state raises ``RuntimeError``). Every update counts one step for every table, even
    one with ``B = 0`` (as torch does for a parameter whose gradient is empty). The store
    handles are static pytree nodes: ``jax.tree.leaves(state) == [count]`` and ``jax.jit``
    passes them through without retracing.

    **Padding.** Trailing ids equal to ``PAD_ID`` (-1), as :func:`gather` pads with, are
    padding: ``update`` checks that their gradient is zero, drops them (they are not stepped
    and not counted as touched; row ``num_rows - 1`` is never hit by a wrapped -1) and
    returns zero rows for them. A -1 anywhere but in the trailing block is an IndexError.

    **Learning rate.** A schedule gets the count of completed steps (optax's convention:
    step ``t`` uses ``schedule(t - 1)``). Outside ``jit`` it is called on the host with a
    numpy int32 scalar; with ``in_jit=True`` it is traced into the program (optax schedules
    work in both), and in float32 the two evaluations can differ in the last bit.
    A schedule may return 0 (warm-up): the weights then stay where they are and the moments
    advance, as ``dsa_core.step(..., lr=0)`` does.

    **Inside jit** (``in_jit=True``): the callback is ordered, so steps run once each, in
    program order, and are never removed as dead code; it cannot be ``vmap``-ed, has no
    gradient, and on an accelerator it forces a device-to-host copy of the gradient and a
    host sync every step. The new ``count`` is the callback's output, so waiting on it waits
    for the step; :func:`gather`, :func:`core_states`, :func:`flush` and :func:`close` call
    ``jax.effects_barrier()`` first, so they never read rows a dispatched step is still
    writing. Cost, measured with ``python -m benchmarks.jax_overhead`` (2 shared CPU cores
    under a load of about 5, 64-wide float32 rows, medians): the in-jit step took about
    0.4 ms more than the jitted gradient followed by the host ``update`` at K = 8 rows
    (0.57 vs 0.17 ms a step) and 0.8-0.95 ms more at K = 2000 (2.1-2.3 vs 1.2-1.4 ms): a
    bare ordered ``io_callback`` costs 0.20-0.24 ms here (STYLE.md §2.2: 160-235 µs), each
    argument about 20-40 µs more, and the gradient and the rows cross the callback as
    copies. Prefer the default unless the step must live inside ``jit``/``lax.scan``.

    Examples
    --------
    Two tables of a matrix factorisation, trained outside ``jit``:

    >>> stores = {"user": dsa_core.create(d / "u", 10_000, 16, init="normal"),
    ...           "item": dsa_core.create(d / "i", 5_000, 16, init="normal")}  # doctest: +SKIP
    >>> tx = sparse_adam(optax.linear_schedule(1e-2, 1e-3, 1000))           # doctest: +SKIP
    >>> opt_state = tx.init(stores)                                         # doctest: +SKIP
    >>> @jax.jit
    ... def grads(rows, inv, r):
    ...     def loss(rows):
    ...         u, i = rows["user"][inv["user"]], rows["item"][inv["item"]]
    ...         return jnp.mean((jnp.sum(u * i, -1) - r) ** 2)
    ...     return jax.value_and_grad(loss)(rows)                           # doctest: +SKIP
    >>> bu = gather(opt_state.stores["user"], users, buckets="pow2")        # doctest: +SKIP
    >>> bi = gather(opt_state.stores["item"], items, buckets="pow2")        # doctest: +SKIP
    >>> loss, g = grads({"user": bu.rows, "item": bi.rows},
    ...                 {"user": bu.inverse, "item": bi.inverse}, ratings)  # doctest: +SKIP
    >>> _, opt_state = tx.update({"user": (bu.idx, g["user"]),
    ...                           "item": (bi.idx, g["item"])}, opt_state)  # doctest: +SKIP
    >>> flush(opt_state)                                                    # doctest: +SKIP

    The whole step inside ``jit`` (``in_jit=True``):

    >>> tx = sparse_adam(1e-2, in_jit=True)                                 # doctest: +SKIP
    >>> @jax.jit
    ... def train_step(opt_state, rows, idx, inv, x):
    ...     g = jax.grad(lambda r: loss(r[inv], x))(rows)
    ...     return tx.update((idx, g), opt_state)                          # doctest: +SKIP
    """
    if learning_rate is not None and not callable(learning_rate):
        learning_rate = _check_positive("learning rate", learning_rate)
    schedule = learning_rate if callable(learning_rate) else None
    const_lr = None if schedule is not None else learning_rate
    overrides: dict[str, Any] = {}
    if b1 is not None or b2 is not None:
        for i, b in enumerate((b1, b2)):
            if b is not None:
                _check_beta(i, b)
        overrides["betas"] = (b1, b2)
    if eps is not None:
        overrides["eps"] = _check_positive("epsilon value", eps)
    if maximize is not None:
        if not isinstance(maximize, (bool, np.bool_)):
            raise TypeError(f"maximize must be a bool or None, got {maximize!r}")
        overrides["maximize"] = bool(maximize)
    if not isinstance(in_jit, (bool, np.bool_)):
        raise TypeError(f"in_jit must be a bool, got {in_jit!r}")
    return_rows = bool(return_rows)

    def init(stores: Any) -> DiskAdamState:
        paths = jax.tree_util.tree_flatten_with_path(stores, is_leaf=_is_store_leaf)[0]
        treedef = jax.tree_util.tree_structure(stores, is_leaf=_is_store_leaf)
        if not paths:
            raise ValueError("init needs at least one dsa_core store (got an empty pytree)")
        handles, counts, seen = [], set(), {}
        for path, leaf in paths:
            name = jax.tree_util.keystr(path)
            if not isinstance(leaf, dsa_core.State):
                raise TypeError(
                    f"init takes open dsa_core stores (dsa_core.create/open), or a pytree of "
                    f"them; got {type(leaf).__name__} at {name or 'the root'}. The tables live "
                    "on disk: create one with dsa_core.create(path, num_rows, dim)")
            st = leaf.store
            if st.closed or st.mode != "r+":
                raise ValueError(f"store {str(leaf.path)!r} is "
                                 f"{'closed' if st.closed else 'read-only'}; open it with "
                                 "dsa_core.open(path) (mode 'r+') to train")
            if id(st) in seen:
                raise ValueError(f"store {str(leaf.path)!r} appears twice in the stores "
                                 f"({seen[id(st)] or 'root'} and {name}); give each table "
                                 "its own store")
            seen[id(st)] = name
            live = _LIVE.get(st)
            if (live is not None and not live._retired
                    and live.core_state.count != leaf.count):
                raise RuntimeError(
                    f"store {str(leaf.path)!r} is driven by an optimizer state at count "
                    f"{live._core.count}, but this dsa_core.State is at count "
                    f"{leaf.count} (stale). Keep using that optimizer state, or init "
                    "from its current stores: tx.init(core_states(opt_state))")
            core = leaf
            if overrides:
                rep = dict(overrides)
                if "betas" in rep:
                    rep["betas"] = tuple(float(n if n is not None else o)
                                         for n, o in zip(rep["betas"], leaf.betas))
                core = core._replace(**rep)
            if const_lr is not None:
                core = core._replace(lr=const_lr)
            handles.append(StoreHandle(core, name, in_jit=bool(in_jit)))
            counts.add(int(leaf.count))
        if len(counts) > 1:
            raise ValueError(
                f"the stores have made different numbers of steps {sorted(counts)}; one "
                "transform keeps one global step count for all its tables. Use stores "
                "trained together, or one transform per table")
        for h in handles:  # retire the previous handles only once everything is accepted
            st = h._core.store
            old = _LIVE.get(st)
            if old is not None:
                old._retired = True
            _LIVE[st] = h
        (count,) = counts
        # in_jit: a jax.Array from the start, so the jitted step sees one argument type
        count = jnp.asarray(count, jnp.int32) if in_jit else np.asarray(count, np.int32)
        return DiskAdamState(count, treedef.unflatten(handles))

    def lr_on_host(count: int) -> float | None:
        if schedule is None:
            return const_lr  # None: each store's own lr
        return float(schedule(np.asarray(count, np.int32)))

    def update_host(updates: Any, state: DiskAdamState, params: Any = None):
        handles, treedef = _flatten_handles(state.stores)
        pairs = _split_pairs(updates, treedef, handles)
        plist = _split_params(params, treedef, len(handles))
        flat = [a for pr in pairs for a in pr] + plist
        if _is_tracer(state.count) or any(_is_tracer(a) for a in flat):
            raise RuntimeError(
                "update was called inside jax.jit (or another transformation) but this "
                "transform runs on the host: call it outside jit with the gradients the "
                "jitted function returned, or build it with sparse_adam(..., in_jit=True)")
        if any(h._async for h in handles):
            jax.effects_barrier()  # the state was last stepped inside jit
        count = int(state.count)
        n = len(handles)
        host = _to_host(flat)
        rows = _host_step(handles, count, lr_on_host(count), host[0:2 * n:2],
                          host[1:2 * n:2], host[2 * n:], return_rows)
        new_state = DiskAdamState(np.asarray(count + 1, np.int32), state.stores)
        if not return_rows:
            return None, new_state
        placed = [_put(r, g) if isinstance(g, jax.Array) else r
                  for r, (_, g) in zip(rows, pairs)]
        return treedef.unflatten(placed), new_state

    def update_jit(updates: Any, state: DiskAdamState, params: Any = None):
        handles, treedef = _flatten_handles(state.stores)
        pairs = _split_pairs(updates, treedef, handles)
        plist = _split_params(params, treedef, len(handles))
        for h, (i, g), p in zip(handles, pairs, plist):  # at trace time: shapes and dtypes
            _check_pair_static(h, i, g, p)
        n = len(handles)
        count = jnp.asarray(state.count, jnp.int32)
        has_p = [p is not None for p in plist]
        # every callback argument costs a transfer (~20-40 us on CPU): pass only what is used
        args = [count]
        if schedule is not None:  # traced into the program; the value reaches the host
            args.append(jnp.asarray(schedule(count)))
        args += [a for pr in pairs for a in pr] + [p for p in plist if p is not None]

        def callback(count_a, *arrays):
            c = int(np.asarray(count_a))
            if schedule is not None:
                lr, arrays = float(np.asarray(arrays[0])), arrays[1:]
            else:
                lr = const_lr
            host = [np.asarray(a) for a in arrays]
            rest = iter(host[2 * n:])
            ps = [next(rest) if hp else None for hp in has_p]
            rows = _host_step(handles, c, lr, host[0:2 * n:2], host[1:2 * n:2], ps,
                              return_rows)
            new_count = np.asarray(c + 1, np.int32)
            return (rows, new_count) if return_rows else new_count

        count_shape = jax.ShapeDtypeStruct((), jnp.int32)
        if return_rows:
            shapes = ([jax.ShapeDtypeStruct(tuple(np.shape(g)), h.dtype)
                       for h, (_, g) in zip(handles, pairs)], count_shape)
        else:
            shapes = count_shape
        out = io_callback(callback, shapes, *args, ordered=True)
        # the new count is the callback's output: waiting on it waits for the step
        if return_rows:
            rows, new_count = out
            return treedef.unflatten(rows), DiskAdamState(new_count, state.stores)
        return None, DiskAdamState(out, state.stores)

    return SparseGradientTransformation(init, update_jit if in_jit else update_host)


def _check_beta(i: int, b: Any) -> float:
    try:
        v = float(b)
    except (TypeError, ValueError):
        raise TypeError(f"b{i + 1} must be a float in [0, 1), got {b!r}") from None
    if not 0.0 <= v < 1.0:
        raise ValueError(f"Invalid beta parameter b{i + 1}: {b}; it must lie in [0, 1), e.g. "
                         "b1=0.9, b2=0.999")
    return v


# ---------------------------------------------------------------------------------------------
# Store life cycle through the optimizer state
# ---------------------------------------------------------------------------------------------
def core_states(state: DiskAdamState) -> Any:
    """The current ``dsa_core.State`` of every table, in the structure of the stores.

    Examples
    --------
    >>> core_states(opt_state)["user"].count == int(opt_state.count)   # doctest: +SKIP
    True
    """
    handles, treedef = _flatten_handles(state.stores)
    return treedef.unflatten([h.core_state for h in handles])


def flush(state: DiskAdamState) -> None:
    """Make every step so far durable in every table (``dsa_core.flush``: rows + count).

    Examples
    --------
    >>> flush(opt_state)  # at a checkpoint; resume with dsa_core.open  # doctest: +SKIP
    """
    for h in _flatten_handles(state.stores)[0]:
        dsa_core.flush(h.core_state)


def close(state: DiskAdamState) -> None:
    """Flush and close every table (``dsa_core.close``); the state cannot step afterwards.

    Examples
    --------
    >>> close(opt_state)                                                   # doctest: +SKIP
    """
    for h in _flatten_handles(state.stores)[0]:
        dsa_core.close(h.core_state)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------
CHECKPOINT_MANIFEST = "checkpoint.json"
_CHECKPOINT_FORMAT = "dsa-jax-checkpoint"


def _table_names(handles: list[StoreHandle]) -> list[str]:
    """Directory names for the tables of a checkpoint: the key path, made file-name safe.

    ``"['user']"`` -> ``user``, ``"['a'][0]"`` -> ``a_0``, a lone store -> ``store``;
    a clash gets a ``-<position>`` suffix.
    """
    names: list[str] = []
    for k, h in enumerate(handles):
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", h.name).strip("_.") or "store"
        if name in names:
            name = f"{name}-{k}"
        names.append(name)
    return names


def checkpoint(state: DiskAdamState, dest, *, overwrite: bool = False) -> Path:
    """Write a consistent snapshot of every table to ``dest``; training may go on afterwards.

    ``dest`` receives one ``dsa_core.checkpoint`` per table (named after its key in the stores
    pytree: ``{"user": ..., "item": ...}`` gives ``dest/user`` and ``dest/item``; a lone store
    gives ``dest/store``) and ``checkpoint.json`` (the count and the table names). Everything
    is built in a temporary sibling directory, fsync'd and renamed into place at once: a
    crash at any moment leaves either no ``dest`` or a complete one. Replacing an existing
    checkpoint needs ``overwrite=True`` (swapped atomically where the filesystem allows).

    Resume with :func:`restore` (copies the snapshots into the live stores of an optimizer
    state), or open the snapshots themselves (``dsa_core.open(dest / "user")``, then
    ``tx.init``; training then continues *in* the checkpoint).

    Returns
    -------
    Path
        ``dest``.

    Examples
    --------
    >>> checkpoint(opt_state, "runs/ckpt-1000")                       # doctest: +SKIP
    >>> opt_state = restore(tx.init(stores), "runs/ckpt-1000")        # doctest: +SKIP
    """
    handles, _ = _flatten_handles(state.stores)
    cores = [h.core_state for h in handles]  # waits for steps dispatched inside jit
    count = int(np.asarray(state.count))
    dest = Path(dest)
    dest_r = dest.resolve()
    for h, core in zip(handles, cores):
        if h._retired:
            raise RuntimeError(f"{h._label()}: this optimizer state was superseded by a later "
                               "init on the same store; checkpoint the current state")
        if core.count != count:
            raise RuntimeError(f"{h._label()}: stale optimizer state: its count is {count} but "
                               f"the store has made {core.count} steps; checkpoint the state "
                               "returned by the last update")
        p = core.path.resolve()
        if dest_r == p or dest_r in p.parents:
            raise ValueError(f"checkpoint destination {str(dest)!r} would replace or contain "
                             f"the live store {str(p)!r}; choose another directory")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                              "overwrite=True to replace it")
    names = _table_names(handles)
    manifest = {"format": _CHECKPOINT_FORMAT, "version": 1, "count": count,
                "tables": [{"key": h.name, "name": n, "num_rows": c.num_rows, "dim": c.dim,
                            "dtype": c.dtype.name, "curvature": c.curvature}
                           for h, n, c in zip(handles, names, cores)]}
    dest_r.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(dest_r, overwrite) as tmp:
        for n, core in zip(names, cores):
            dsa_core.checkpoint(core, tmp / n)
        with open(tmp / CHECKPOINT_MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    return dest


def restore(state: DiskAdamState, src) -> DiskAdamState:
    """Copy the checkpoint at ``src`` (from :func:`checkpoint`) into the stores of ``state``.

    Tables are matched by their key in the stores pytree and must have the same layout
    (shape, dtype, curvature, weights); everything is checked before anything is written.
    Then every table's records (weights, m, v) are copied in, its count set to the
    checkpoint's and the store flushed. Returns the optimizer state to continue with (the
    given one becomes stale). The checkpoint is never modified. Not atomic: after a crash
    during a restore, restore again.

    Examples
    --------
    >>> opt_state = restore(tx.init(stores), "runs/ckpt-1000")        # doctest: +SKIP
    """
    handles, _ = _flatten_handles(state.stores)
    src = Path(src)
    mpath = src / CHECKPOINT_MANIFEST
    if not mpath.is_file():
        raise FileNotFoundError(f"{str(src)!r} is not an adapters.jax checkpoint: it has no "
                                f"{CHECKPOINT_MANIFEST}; write one with checkpoint(opt_state, "
                                "dest)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError as exc:
        raise ValueError(f"{str(mpath)!r} is not a checkpoint manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"{str(mpath)!r} is not an adapters.jax checkpoint manifest")
    count = int(manifest["count"])
    tables = {t["key"]: t for t in manifest["tables"]}
    keys = [h.name for h in handles]
    if sorted(tables) != sorted(keys):
        raise ValueError(f"the checkpoint holds the tables {sorted(tables)}, the optimizer "
                         f"state {sorted(keys)}; restore into stores of the same structure")
    plans = []
    try:
        for h in handles:
            lab = h._label()
            if h._retired:
                raise RuntimeError(f"{lab}: this optimizer state was superseded by a later "
                                   "init on the same store; restore into the current state")
            core = h.core_state
            if core.store.closed or core.store.mode != "r+":
                raise ValueError(f"{lab}: store {str(core.path)!r} is "
                                 f"{'closed' if core.store.closed else 'read-only'}")
            snap_path = src / tables[h.name]["name"]
            if snap_path.resolve() == core.path.resolve():
                if core.count != count:
                    raise ValueError(f"{lab}: the optimizer trains in the checkpoint store "
                                     f"{str(snap_path)!r} itself, now at step {core.count}, "
                                     f"not {count}; it is no longer that checkpoint")
                plans.append((h, None))
                continue
            snap = dsa_core.open(snap_path, mode="r")
            plans.append((h, snap))
            have, want = core.store.layout, snap.store.layout
            if have != want:
                raise ValueError(f"{lab}: the checkpoint store {str(snap_path)!r} has layout "
                                 f"{want}, the live store {str(core.path)!r} {have}; restore "
                                 "into a store created the same way")
            if snap.count != count:
                raise ValueError(f"{lab}: the checkpoint store {str(snap_path)!r} is at step "
                                 f"{snap.count}, but the checkpoint says {count}; it was "
                                 "modified after it was written")
        for h, snap in plans:
            if snap is None:
                continue
            h._core = restore_rows(h._core, snap)  # snap.count == count, checked above
    finally:
        for _, snap in plans:
            if snap is not None:
                dsa_core.close(snap)
    in_jit = any(h._async for h in handles)
    new_count = jnp.asarray(count, jnp.int32) if in_jit else np.asarray(count, np.int32)
    return DiskAdamState(new_count, state.stores)


def warmup(dtypes: Sequence[str] = ("float32", "float64")) -> None:
    """Compile the kernel specialisations that JAX inputs need, on a throwaway store.

    ``np.asarray`` of a CPU ``jax.Array`` is a read-only view, which numba treats as another
    argument type than the writable arrays of ``dsa_core.warmup``: the first ``update`` would
    compile (about 0.5 s per kernel, cached on disk afterwards). Call this once at start-up
    to pay that cost up front.

    Examples
    --------
    >>> warmup(("float32",))                                              # doctest: +SKIP
    """
    dsa_core.warmup(tuple(dtypes))
    with tempfile.TemporaryDirectory(prefix="dsa-jax-warmup-") as tmp:
        for dt in dtypes:
            for c in (0.0, 1.0):
                core = dsa_core.create(Path(tmp) / f"{dt}-{c}", 4, 2, curvature=c, dtype=dt,
                                       progress=False)
                try:
                    for ids in ([0, 2], [2, 0, 2]):  # sorted-unique fast path, coalesce path
                        g = np.zeros((len(ids), 2), dt)
                        g.flags.writeable = False   # what np.asarray(jax_array) gives
                        core = dsa_core.step(core, np.array(ids), g)
                finally:
                    dsa_core.close(core)
