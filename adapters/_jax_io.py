"""Moving rows between the stores (host memory) and JAX devices; bucket sizes; warm-up.

Private; the public names live in :mod:`adapters.jax`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dsa_core

from ._jax_state import PAD_ID, Batch, DiskTable, flatten_tables, one_dsa_state

__all__ = ["bucket_size", "core_of", "gather_batch", "put", "require_x64", "to_host",
           "warmup"]


def to_host(xs: list) -> list:
    """numpy views of a list of arrays; device (GPU/TPU) arrays are copied asynchronously first.

    On CPU ``np.asarray(jax_array)`` is a zero-copy read-only view; on an accelerator all the
    device-to-host copies are started together before the first blocking ``np.asarray``, so
    they overlap instead of running one after another.
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


def put(x: np.ndarray, where: Any = None) -> jax.Array:
    """Host array to device. ``where``: None (default device), a Device/Sharding, or a
    ``jax.Array`` whose placement to copy.

    ``jnp.asarray`` onto the default device skips the sharding machinery of
    ``jax.device_put`` (noticeable for the small arrays of a step), so it is used whenever
    the target is the default device.
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

    A jitted loss compiles once per input shape; padding the number of unique rows to a few
    bucket sizes keeps it to a few compilations.

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
    >>> from adapters.jax import bucket_size
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


def gather_batch(store: Any, ids: Any, *, buckets: None | str | Sequence[int] = None,
                 device: Any = None) -> Batch:
    """Deduplicate a batch's ids and put their weight rows on the device as one block.

    Not ``dsa_core.gather``, which copies rows ``idx`` out of a store into a numpy array,
    one per id: this is the first half of a JAX training step. It returns a :class:`Batch`:
    the batch's *unique* rows on the device (``rows``, padded to a bucket size), their ids
    on the host (``idx``, what ``update`` takes) and the map from every id of the batch to
    its row (``inverse``), so that the loss reads ``rows[inverse]`` and ``jax.grad`` with
    respect to ``rows`` is exactly the row gradient ``update`` wants.

    Parameters
    ----------
    store : DiskTable, dsa_core.State, DiskAdamState.stores with one table, or opt_state
        The table to read (``opt_state.stores["user"]``, or a ``dsa_core.State``); an
        optimizer state of one table (sparse_adam's, or an optax state that holds it, such
        as ``optax.chain``'s) reads that table.
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
    >>> from adapters import jax as dsa_jax
    >>> core = dsa_core.create(tempfile.mkdtemp() + "/t", 100, 4)
    >>> batch = dsa_jax.gather_batch(core, np.array([[5, 2], [2, 9]]), buckets="pow2")
    >>> batch.idx, batch.inverse.tolist(), batch.num_unique, batch.rows.shape
    (array([ 2,  5,  9, -1]), [[1, 0], [0, 2]], 3, (4, 4))
    >>> dsa_core.close(core)
    """
    core = core_of(store)
    require_x64(core.dtype, "gather_batch")
    ids_np = np.asarray(ids)
    if ids_np.dtype == np.bool_ or ids_np.dtype.kind not in "iu":
        raise TypeError(f"gather_batch: ids must hold integer row ids, got dtype "
                        f"{ids_np.dtype}; convert with ids.astype(np.int64)")
    uniq, inv = np.unique(ids_np.reshape(-1), return_inverse=True)
    k = int(uniq.shape[0])
    kp = bucket_size(k, buckets)
    idx = np.full(kp, PAD_ID, np.int64)
    idx[:k] = uniq
    rows = np.zeros((kp, core.dim), core.dtype)
    dsa_core.gather(core, idx[:k], out=rows[:k])   # range checks; (0, dim) for k == 0
    inverse = inv.reshape(ids_np.shape).astype(np.int32)
    return Batch(put(rows, device), idx, put(inverse, device), k)


def require_x64(dtype: np.dtype, what: str) -> None:
    """Refuse a float64 store while JAX is in 32-bit mode (it would round the rows)."""
    if dtype == np.float64 and not jax.config.jax_enable_x64:
        raise TypeError(f"{what}: the store is float64 but JAX is in 32-bit mode and would "
                        "round its rows to float32; enable float64 with "
                        "jax.config.update('jax_enable_x64', True) (or create the store "
                        "with dtype='float32')")


def core_of(store: Any) -> dsa_core.State:
    """The ``dsa_core.State`` to read: a table's current one, or the State given."""
    if isinstance(store, DiskTable):
        store.sync()  # a jitted step may still be writing these rows (async dispatch)
        return store._core
    if isinstance(store, dsa_core.State):
        return store
    try:  # an optimizer state (optax.chain & co. too) that holds one table
        tables = flatten_tables(one_dsa_state(store, "gather_batch").stores)[0]
    except (TypeError, ValueError):
        tables = None
    if tables is not None and len(tables) == 1:
        return core_of(tables[0])
    raise TypeError(f"gather_batch: store must be a DiskTable (opt_state.stores[...]), a "
                    f"dsa_core.State or an optimizer state of one table, got "
                    f"{type(store).__name__}"
                    + (f" holding {len(tables)} tables {[t.name for t in tables]}: pass one "
                       "of them (opt_state.stores[...])" if tables else ""))


def warmup(dtypes: Sequence[str] = ("float32", "float64")) -> None:
    """Compile the kernel specialisations that JAX inputs need, on a throwaway store.

    ``np.asarray`` of a CPU ``jax.Array`` is a read-only view, which numba treats as another
    argument type than a writable array: without this, the first ``update`` would stop to
    compile (numba caches the result on disk, so this is paid once per machine). Call it
    once at start-up to pay that cost up front instead of inside the first step.

    Examples
    --------
    >>> from adapters import jax as dsa_jax
    >>> dsa_jax.warmup(("float32",))
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
