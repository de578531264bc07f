"""The optimizer state of :mod:`adapters.jax`: ``DiskAdamState`` and its per-table leaves.

Private; the public names live in :mod:`adapters.jax`.

``DiskAdamState(count, stores)`` is what ``init`` returns and ``update`` takes and returns:
``count`` is its only pytree leaf; ``stores`` holds one :class:`DiskTable` per table, in the
structure given to ``init``. A ``DiskTable`` is a *static* pytree node, so ``jax.jit``
passes it through without retracing, and it is mutable on purpose: it holds the newest
``dsa_core.State`` of its store and replaces it at every step (``dsa_core.step`` returns a
new State each time). An old ``DiskAdamState`` therefore still points at the same tables,
but its ``count`` no longer matches theirs, which is how ``update`` recognises it (and
refuses it, see :func:`stale_state_error`). Two ``DiskTable``\\ s of one store (two ``init``
calls) are told apart by ``dsa_core``: the one that steps second holds an outdated State
and gets ``dsa_core.StaleStateError``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

import dsa_core

__all__ = [
    "PAD_ID",
    "Batch",
    "DiskAdagradState",
    "DiskAdamState",
    "DiskTable",
    "SparseGradientTransformation",
    "close",
    "core_states",
    "dsa_states",
    "flatten_stores",
    "flatten_tables",
    "flush",
    "one_dsa_state",
    "replace_dsa_state",
    "prefix",
    "stale_state_error",
]

PAD_ID = -1
"""Row id of a padding row in ``Batch.idx``: its gradient must be zero and it is never stepped."""


@jax.tree_util.register_static
class DiskTable:
    """One table of ``opt_state.stores``: the optimizer's grip on one open ``dsa_core`` store.

    ``jax.tree_util.register_static`` makes it a pytree node with no leaves: it is invisible
    to ``jax.tree.map``/``leaves``, and ``jax.jit`` passes it through as static data, hashed
    by identity (a new table means a retrace; the same table never does).

    It holds the current ``dsa_core.State`` of its store and replaces it after every step
    (``dsa_core.step`` returns a new State with ``count + 1``). Read it with
    :attr:`core_state`, e.g. to read the weights. ``init`` of ``sparse_adam`` makes the
    tables; pass a table (``opt_state.stores["user"]``) to ``gather_batch``. Do not step the
    store by other means while a table drives it: ``dsa_core`` then refuses this table's
    next step as outdated (``dsa_core.StaleStateError``).

    Attributes
    ----------
    name : str
        The table's key path in the stores pytree (``"['user']"``; ``""`` for a lone store),
        used in error messages and as the table's name in checkpoints.

    Examples
    --------
    >>> import tempfile, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> opt_state = dsa_jax.sparse_adam(1e-2).init(
    ...     {"user": dsa_core.create(tempfile.mkdtemp() + "/u", 10, 4)})
    >>> table = opt_state.stores["user"]
    >>> table.name, table.num_rows, table.dim, table.core_state.count
    ("['user']", 10, 4, 0)
    >>> dsa_jax.close(opt_state)
    """

    __slots__ = ("_async", "_core", "name")

    def __init__(self, core_state: dsa_core.State, name: str = "", *,
                 in_jit: bool = False) -> None:
        self._core = core_state
        self._async = in_jit  # steps may still be pending in an io_callback
        self.name = name

    @property
    def core_state(self) -> dsa_core.State:
        """The current ``dsa_core.State`` of the store (its ``count`` is the global t)."""
        self.sync()
        return self._core

    def sync(self) -> None:
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

    def __repr__(self) -> str:
        c = self._core
        return (f"DiskTable({str(c.path)!r}, num_rows={c.num_rows}, dim={c.dim}, "
                f"dtype={c.dtype.name}, curvature={c.curvature}, count={c.count})")


def prefix(where: str, table: DiskTable | None = None) -> str:
    """The start of an error message: ``"sparse_adam.update: table ['user']: "``.

    The table is named only in a pytree of several (a lone store has the name ``""``).
    """
    name = table.name if table is not None else ""
    return f"{where}: table {name}: " if name else f"{where}: "


def stale_state_error(where: str, table: DiskTable, count: int) -> dsa_core.StaleStateError:
    """The error for an optimizer state that its tables have left behind.

    ``count`` is the state's; the table is at ``table._core.count`` (an old ``DiskAdamState``
    reused after an ``update``), or at that count while its store has moved on through
    another table of the same store (a second ``init``): ``dsa_core`` refuses both.
    """
    core = table._core
    if core.count != count:
        return dsa_core.StaleStateError(
            f"{prefix(where, table)}stale optimizer state: its count is {count} but the "
            f"store has made {core.count} steps. update steps the stores in place and returns "
            "a new opt_state; an old one no longer matches its stores (stepping it again "
            "would count steps twice): pass the opt_state returned by the last update, "
            "`rows, opt_state = tx.update(grads, opt_state)`")
    return dsa_core.StaleStateError(
        f"{prefix(where, table)}the store {str(core.path)!r} was stepped past step {count} "
        "through another optimizer state (a second init on the same store) or dsa_core.step: "
        "two optimizer states may not train one store. Continue with that optimizer state, "
        "or init again from its tables: tx.init(core_states(opt_state))")


def _is_store_leaf(x: Any) -> bool:
    return isinstance(x, (dsa_core.State, DiskTable))


def flatten_tables(stores: Any) -> tuple[list[DiskTable], Any]:
    """The ``DiskTable`` leaves of ``opt_state.stores`` and their tree structure."""
    leaves, treedef = jax.tree_util.tree_flatten(stores, is_leaf=_is_store_leaf)
    for leaf in leaves:
        if not isinstance(leaf, DiskTable):
            raise TypeError(
                f"opt_state.stores must hold DiskTables (made by init), got "
                f"{type(leaf).__name__}; pass the state returned by tx.init(stores)")
    return leaves, treedef


def flatten_stores(stores: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(key path, leaf)`` of every store given to ``init``, and the tree structure."""
    paths = jax.tree_util.tree_flatten_with_path(stores, is_leaf=_is_store_leaf)[0]
    return paths, jax.tree_util.tree_structure(stores, is_leaf=_is_store_leaf)


# ---------------------------------------------------------------------------------------------
# State and transformation types
# ---------------------------------------------------------------------------------------------
class DiskAdamState(NamedTuple):
    """State of ``sparse_adam``: a step counter plus the tables.

    The moments live in the stores, not here: ``jax.tree.leaves(state)`` is ``[count]``.
    Each ``update`` returns a new one; continue with that (an old one is refused).
    """

    count: Any  # shape=(), dtype=int32: completed steps, the global t (numpy on the host
    #             path, jax.Array with in_jit=True)
    stores: Any  # pytree of DiskTable (static: no leaves), the structure given to init


class DiskAdagradState(DiskAdamState):
    """State of ``sparse_adagrad``: ``DiskAdamState``'s fields and behaviour, another name.

    A subclass, so that :func:`flush`, :func:`close`, :func:`core_states`, ``checkpoint``
    and ``restore`` find it inside an optax state as they find ``sparse_adam``'s. The
    accumulators live in the stores: ``jax.tree.leaves(state)`` is ``[count]``.
    """

    __slots__ = ()


class SparseGradientTransformation(NamedTuple):
    """``(init, update)`` in the shape of ``optax.GradientTransformation``.

    It is deliberately *not* an ``optax.GradientTransformation``: ``update`` takes row
    gradients ``(idx, grad_rows)`` and returns new rows, not additive updates, so it must
    not be combined with ``optax.chain``.
    """

    init: Callable[[Any], DiskAdamState]
    update: Callable[..., tuple[Any, DiskAdamState]]


class Batch(NamedTuple):
    """The deduplicated rows of one batch, from ``gather_batch``.

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
# Finding DSA's state inside an optax state (chain, multi_transform, inject_hyperparams, ...)
# ---------------------------------------------------------------------------------------------
def _is_dsa(x: Any) -> bool:
    return isinstance(x, DiskAdamState)


def dsa_states(state: Any, where: str) -> list[DiskAdamState]:
    """Every ``DiskAdamState`` in ``state``: itself, or the ones an optax state holds.

    optax's states are pytrees of NamedTuples, tuples and dicts (``optax.chain``'s tuple,
    ``multi_transform``'s ``inner_states``, ``masked``'s and ``inject_hyperparams``'
    ``inner_state``), so one walk of the pytree finds sparse_adam's, wherever it sits.
    """
    if _is_dsa(state):
        return [state]
    found = [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_dsa) if _is_dsa(x)]
    if not found:
        raise TypeError(
            f"{where}: the optimizer state holds no adapters.jax.sparse_adam or "
            f"sparse_adagrad state (DiskAdamState or DiskAdagradState); got "
            f"{type(state).__name__}. Pass the state that tx.init / tx.update returned for a "
            "transform built with sparse_adam or sparse_adagrad: on its own, or in "
            "optax.chain, multi_transform, masked or inject_hyperparams")
    return found


def one_dsa_state(state: Any, where: str) -> DiskAdamState:
    """The one ``DiskAdamState`` in ``state`` (see :func:`dsa_states`), or a clear error."""
    found = dsa_states(state, where)
    if len(found) > 1:
        raise ValueError(
            f"{where}: the optimizer state holds {len(found)} sparse_adam states (one per "
            "sparse_adam in the transform), each with its own step count; pass the one you "
            "mean (e.g. opt_state.inner_states[label].inner_state), or train the tables "
            "with one sparse_adam over a dict of stores")
    return found[0]


def replace_dsa_state(state: Any, new: DiskAdamState) -> Any:
    """``state`` with its one ``DiskAdamState`` replaced by ``new`` (same structure)."""
    if _is_dsa(state):
        return new
    return jax.tree_util.tree_map(lambda x: new if _is_dsa(x) else x, state, is_leaf=_is_dsa)


# ---------------------------------------------------------------------------------------------
# The stores' life cycle through the optimizer state
# ---------------------------------------------------------------------------------------------
def core_states(state: Any) -> Any:
    """The current ``dsa_core.State`` of every table, in the structure of the stores.

    For reading the tables (``dsa_core.gather`` / ``read_records`` on any store; the
    whole-table views ``.weights``, ``.exp_avg`` on in-place stores only) or handing them
    to another transform: ``tx2.init(core_states(opt_state))``. ``state`` may be any optax
    state that holds sparse_adam's (``optax.chain``, ``multi_transform``, ...), as for
    :func:`flush`, :func:`close`, :func:`~adapters.jax.checkpoint` and
    :func:`~adapters.jax.restore`.

    Examples
    --------
    >>> import tempfile, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> tx = dsa_jax.sparse_adam(1e-2)
    >>> opt_state = tx.init({"user": dsa_core.create(tempfile.mkdtemp() + "/u", 10, 4)})
    >>> _, opt_state = tx.update({"user": ([1], np.ones((1, 4), np.float32))}, opt_state)
    >>> dsa_jax.core_states(opt_state)["user"].count == int(opt_state.count) == 1
    True
    >>> dsa_jax.close(opt_state)
    """
    state = one_dsa_state(state, "core_states")
    tables, treedef = flatten_tables(state.stores)
    return treedef.unflatten([t.core_state for t in tables])


def flush(state: Any) -> None:
    """Make every step so far durable in every table (``dsa_core.flush``: rows + count).

    ``state`` is sparse_adam's state or any optax state that holds it (``optax.chain``,
    ``multi_transform``, ``inject_hyperparams``...): every sparse_adam state in it is
    flushed.

    After a crash, ``dsa_core.open`` of each store resumes from the last flush, or, for an
    in-place store stepped since, refuses it (``dsa_core.UncleanStopError``: restore from a
    ``checkpoint``, which also keeps a copy).

    Examples
    --------
    >>> import tempfile, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> path = tempfile.mkdtemp() + "/emb"
    >>> tx = dsa_jax.sparse_adam(1e-2)
    >>> opt_state = tx.init(dsa_core.create(path, 10, 4))
    >>> _, opt_state = tx.update(([1], np.ones((1, 4), np.float32)), opt_state)
    >>> dsa_jax.flush(opt_state)
    >>> dsa_core.open(path, mode="r").count      # what a restart would resume from
    1
    >>> dsa_jax.close(opt_state)
    """
    # one group commit of every table (dsa_core.flush_many; the tables commit together)
    dsa_core.flush_many([t.core_state for s in dsa_states(state, "flush")
                         for t in flatten_tables(s.stores)[0]])


def close(state: Any) -> None:
    """Flush and close every table (``dsa_core.close``); the state cannot step afterwards.

    Closing releases each store's writer lock, so another process may open it. ``state``
    may be any optax state that holds sparse_adam's (every one in it is closed).

    Examples
    --------
    >>> import tempfile, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> store = dsa_core.create(tempfile.mkdtemp() + "/emb", 10, 4)
    >>> opt_state = dsa_jax.sparse_adam(1e-2).init(store)
    >>> dsa_jax.close(opt_state)
    >>> dsa_jax.core_states(opt_state).closed
    True
    """
    for s in dsa_states(state, "close"):
        for t in flatten_tables(s.stores)[0]:
            dsa_core.close(t.core_state)
