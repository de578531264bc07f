r"""JAX adapter of dsa_core: an optax-style sparse Adam transform whose state lives on disk.

The embedding tables stay on disk (``dsa_core`` stores, mapped into memory); a training
step only ever moves the rows of its batch:

1. :func:`gather_batch` deduplicates the batch's ids, reads those rows from the store and
   puts them on the device as one ``(K, dim)`` block (optionally padded to a bucket size);
2. the loss is a function of that block (``block[batch.inverse]``), so ``jax.grad`` gives
   exactly the row gradients, duplicates summed;
3. ``update((batch.idx, grad_rows), opt_state)`` of the transform from :func:`sparse_adam`
   applies one lazy Adam step to those rows in the store (``dsa_core.step``) and returns
   the new rows, so the caller can keep them on the device.

The names:

:func:`sparse_adam`
    The transform: ``tx.init(stores) -> DiskAdamState``, ``tx.update(grads, opt_state)``.
:func:`sparse_adagrad` and :class:`DiskAdagradState`
    The same for Adagrad (element-wise, or ``rowwise=True``) over stores created with
    ``optimizer="adagrad"`` / ``"rowwise_adagrad"``.
:class:`DiskAdamState`
    The optimizer state: ``count`` (its only pytree leaf) and ``stores``, one
    :class:`DiskTable` per table (a static pytree node holding the table's current
    ``dsa_core.State``). ``update`` returns a new one; an old one is refused
    (``dsa_core.StaleStateError``), since the stores have moved on.
:func:`create_store`
    Creates a table's store, or reopens it when asked (``resume=True``); a second run of
    the same script is refused rather than silently resumed.
:func:`gather_batch` and :class:`Batch`
    A batch's unique rows on the device. (``dsa_core.gather`` is the core's plain row copy
    into numpy; this is the JAX step's lookup, with deduplication and padding.)
:func:`checkpoint` / :func:`restore`
    A consistent snapshot of every table, committed by one atomic rename, and back.
:func:`flush`, :func:`close`, :func:`core_states`, :func:`warmup`, :func:`bucket_size`

``update`` runs on the host, outside ``jax.jit`` (the default, and the cheapest), or, for a
transform built with ``in_jit=True``, inside ``jit``/``lax.scan`` through an ordered
``jax.experimental.io_callback``.

Examples
--------
>>> import tempfile, numpy as np, jax, jax.numpy as jnp
>>> from adapters import jax as dsa_jax
>>> store = dsa_jax.create_store(tempfile.mkdtemp() + "/emb", 1000, 8, init="normal")
>>> tx = dsa_jax.sparse_adam(1e-2)
>>> opt_state = tx.init(store)
>>> batch = dsa_jax.gather_batch(opt_state.stores, np.array([3, 7, 3]))
>>> batch.idx, batch.inverse.tolist()
(array([3, 7]), [0, 1, 0])
>>> g = jax.grad(lambda block: jnp.sum(block[batch.inverse] ** 2))(batch.rows)
>>> rows, opt_state = tx.update((batch.idx, g), opt_state)
>>> rows.shape, int(opt_state.count)
((2, 8), 1)
>>> dsa_jax.close(opt_state)
"""

from __future__ import annotations

import warnings
from typing import Any

from ._jax_checkpoint import CHECKPOINT_MANIFEST, checkpoint, restore
from ._jax_io import bucket_size, gather_batch, warmup
from ._jax_state import (
    PAD_ID,
    Batch,
    DiskAdagradState,
    DiskAdamState,
    DiskTable,
    SparseGradientTransformation,
    close,
    core_states,
    flush,
)
from ._jax_step import RowGrads, row_grads
from ._jax_stores import create_store
from ._jax_transform import sparse_adagrad, sparse_adam

__all__ = [
    "CHECKPOINT_MANIFEST",
    "PAD_ID",
    "RowGrads",
    "Batch",
    "DiskAdagradState",
    "DiskAdamState",
    "DiskTable",
    "SparseGradientTransformation",
    "bucket_size",
    "checkpoint",
    "close",
    "core_states",
    "create_store",
    "flush",
    "gather_batch",
    "restore",
    "row_grads",
    "sparse_adagrad",
    "sparse_adam",
    "warmup",
]

_RENAMED = {"gather": "gather_batch", "StoreHandle": "DiskTable"}


def __getattr__(name: str) -> Any:
    """The old names ``gather`` and ``StoreHandle``, with a ``DeprecationWarning``."""
    new = _RENAMED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"adapters.jax.{name} is now adapters.jax.{new} (the old name is kept for "
                  "a while)", DeprecationWarning, stacklevel=2)
    return globals()[new]
