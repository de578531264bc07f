r"""``sparse_adam`` and ``sparse_adagrad``: optax-style ``(init, update)`` pairs over ``dsa_core``
stores.

Private; the public names live in :mod:`adapters.jax`.

``sparse_adam(...)`` and ``sparse_adagrad(...)`` check their hyperparameters once and bind
them, as a :class:`Config`, to the module-level :func:`init` and to :func:`update_host`
(outside ``jit``) or :func:`update_in_jit` (an ordered ``io_callback``) with
``functools.partial`` (:func:`_transform`). The two differ only in their arguments, the
hyperparameters they set in the stores and the optimizer the stores must have been created
for; the step itself is :func:`adapters._jax_step.host_step` in every case, and
``dsa_core.step`` dispatches on the store's optimizer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import dsa_core
from dsa_core.tools import validation

from ._jax_io import put, to_host
from ._jax_state import (
    DiskAdagradState,
    DiskAdamState,
    DiskTable,
    SparseGradientTransformation,
    flatten_stores,
    flatten_tables,
)
from ._jax_step import check_pair_static, host_step, split_pairs, split_params

__all__ = ["Config", "init", "sparse_adagrad", "sparse_adam", "update_host", "update_in_jit"]

INIT = "sparse_adam.init"  # sparse_adam's name in messages (Config.init_name)


class Config(NamedTuple):
    """The checked hyperparameters of one ``sparse_adam`` / ``sparse_adagrad`` transform."""

    schedule: Callable[[Any], Any] | None  # learning-rate schedule(count), or None
    lr: float | None        # constant learning rate; None: the schedule's, or each store's
    overrides: dict         # State fields set in every table at init: betas, eps, maximize,
    #                         weight_decay, decoupled_weight_decay (Adam); lr_decay, eps,
    #                         initial_accumulator_value, maximize, weight_decay (Adagrad)
    in_jit: bool            # update emits an ordered io_callback (jit/scan-able)
    return_rows: bool       # update returns the new rows
    optimizer: str = "adam"  # the stores' optimizer= (dsa_core.create): "adam", "adagrad"
    #                          or "rowwise_adagrad"; init refuses a store of another
    name: str = "sparse_adam"  # the factory's name, for messages

    @property
    def init_name(self) -> str:
        return f"{self.name}.init"

    @property
    def update_name(self) -> str:
        return f"{self.name}.update"

    @property
    def state_cls(self) -> type:
        return DiskAdamState if self.optimizer == "adam" else DiskAdagradState


def sparse_adam(learning_rate: float | Callable[[Any], Any] | None = None,
                b1: float | None = None, b2: float | None = None, eps: float | None = None,
                *, maximize: bool | None = None, weight_decay: float | None = None,
                decoupled_weight_decay: bool | None = None, in_jit: bool = False,
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
    weight_decay : float, optional
        Weight decay ``>= 0`` of the rows of each batch (lazy: rows absent from a batch do
        not decay, unless their store was created with ``decay_missed_steps=True``). With
        ``decoupled_weight_decay`` false it is L2, ``g <- g + weight_decay * p`` before the
        Adam update (``torch.optim.Adam(weight_decay=)``); true, it is AdamW's
        ``p <- p * (1 - lr * weight_decay)`` before the Adam update (``optax.adamw`` and
        ``torch.optim.AdamW`` scale the decay by the learning rate the same way, optax with
        the schedule's value). ``None`` keeps each store's own value (0 for a new store);
        a value overrides it for every table (written to the manifest at the next flush).
    decoupled_weight_decay : bool, optional
        ``True``: AdamW's decoupled decay; ``False``: L2 (torch's name and meaning). ``None``
        keeps the stores' setting. A store created with ``decay_missed_steps=True`` needs
        it true. The per-row options ``per_row_step`` and ``decay_missed_steps`` belong to
        the stores (:func:`create_store`), fixed when they are created.
    in_jit : bool, default False
        ``False``: ``update`` runs on the host and must be called outside ``jax.jit``
        (the default and the cheapest). ``True``: ``update`` emits one ordered
        ``jax.experimental.io_callback`` so that the whole train step can be jitted or put in
        ``lax.scan``, at a cost per step (see Notes).
    return_rows : bool, default True
        Return the updated rows from ``update``; ``False`` returns ``None`` and skips the
        read-back and the host-to-device copy.

    Returns
    -------
    SparseGradientTransformation
        ``init(stores) -> DiskAdamState`` and
        ``update(updates, state, params=None) -> (rows, DiskAdamState)``.

        * ``stores``: a ``dsa_core.State`` opened for writing, or a pytree of them (e.g. a dict
          of tables). All must have made the same number of steps (fresh stores: 0). ``init``
          takes the stores as they are: it never creates or reopens one (that is
          ``create_store``'s job, where reopening must be asked for with ``resume=True``).
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
    dsa_core.StaleStateError
        An old ``DiskAdamState`` used again (``update`` returned a newer one: pass that), or
        a store that another optimizer state has stepped since. A ``RuntimeError``.
    RuntimeError
        ``update`` of an ``in_jit=False`` transform called under ``jax.jit``.

    Every check runs before any table is written: a rejected update leaves every store
    byte-identical. Under ``in_jit=True`` the shape and dtype checks run at trace time; the
    value checks (id range, padding, staleness) run in the callback and surface as a JAX
    runtime error carrying the same message.

    Notes
    -----
    Semantics are those of ``dsa_core.step``: with ``curvature == 0`` the store follows
    ``torch.optim.SparseAdam`` (lazy Adam: one global step count ``t`` for bias correction,
    or each row's own with ``per_row_step`` stores; rows absent from a batch are not
    touched and their moments do not decay),

    .. math::

        m \leftarrow \beta_1 m + (1-\beta_1) g,\quad
        v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        p \leftarrow p - \frac{\mathrm{lr}\sqrt{1-\beta_2^t}}{1-\beta_1^t}
                        \frac{m}{\sqrt{v}+\epsilon},

    and with ``curvature > 0`` geoopt's ``SparseRiemannianAdam`` on the Poincaré ball
    (docs/algorithms.md §3). The store decides the geometry; this transform only moves arrays.
    Weight decay (above) comes first, on the rows of the batch.

    ``update`` mutates the stores in place, so the state it returns is the only valid one:
    an old state would count its steps a second time, and raises
    ``dsa_core.StaleStateError`` instead. Every update counts one step for every table,
    even one with ``B = 0`` (as torch does for a parameter whose gradient is empty). The
    tables are static pytree nodes: ``jax.tree.leaves(state) == [count]`` and ``jax.jit``
    passes them through without retracing.

    **Padding.** Trailing ids equal to ``PAD_ID`` (-1), as ``gather_batch`` pads with, are
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
    for the step; ``gather_batch``, :func:`core_states`, :func:`flush` and :func:`close`
    call ``jax.effects_barrier()`` first, so they never read rows a dispatched step is still
    writing. It costs more per step than the default: an ordered ``io_callback`` has a
    fixed cost of its own, each argument crossing it is one more transfer, and the gradient
    and the new rows cross it as copies (``python -m benchmarks.jax_overhead`` measures
    both paths; docs/benchmarks.md, "JAX", has the figures). Prefer the default unless the step
    must live inside ``jit``/``lax.scan``.

    Examples
    --------
    Two tables of a matrix factorisation, trained outside ``jit`` with a learning-rate
    schedule (an optax schedule such as ``optax.linear_schedule(1e-2, 1e-3, 1000)`` works
    the same):

    >>> import tempfile, pathlib, numpy as np, jax, jax.numpy as jnp, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> stores = {"user": dsa_core.create(d / "u", 100, 8, init="normal"),
    ...           "item": dsa_core.create(d / "i", 50, 8, init="normal", seed=1)}
    >>> tx = dsa_jax.sparse_adam(lambda count: 1e-2 * 0.99 ** count)
    >>> opt_state = tx.init(stores)
    >>> @jax.jit
    ... def grads(rows, inv, r):
    ...     def loss(rows):
    ...         u, i = rows["user"][inv["user"]], rows["item"][inv["item"]]
    ...         return jnp.mean((jnp.sum(u * i, -1) - r) ** 2)
    ...     return jax.value_and_grad(loss)(rows)
    >>> users, items, ratings = np.array([3, 7, 3]), np.array([1, 1, 4]), jnp.ones(3)
    >>> bu = dsa_jax.gather_batch(opt_state.stores["user"], users, buckets="pow2")
    >>> bi = dsa_jax.gather_batch(opt_state.stores["item"], items, buckets="pow2")
    >>> loss, g = grads({"user": bu.rows, "item": bi.rows},
    ...                 {"user": bu.inverse, "item": bi.inverse}, ratings)
    >>> rows, opt_state = tx.update({"user": (bu.idx, g["user"]),
    ...                              "item": (bi.idx, g["item"])}, opt_state)
    >>> rows["user"].shape, int(opt_state.count)
    ((2, 8), 1)
    >>> dsa_jax.close(opt_state)

    The whole step inside ``jit`` (``in_jit=True``):

    >>> tx = dsa_jax.sparse_adam(1e-2, in_jit=True)
    >>> opt_state = tx.init(dsa_core.create(d / "e", 100, 8, init="normal"))
    >>> @jax.jit
    ... def train_step(opt_state, rows, idx, inv):
    ...     g = jax.grad(lambda r: jnp.sum(r[inv] ** 2))(rows)
    ...     return tx.update((idx, g), opt_state)
    >>> batch = dsa_jax.gather_batch(opt_state.stores, np.array([5, 2, 5]))
    >>> rows, opt_state = train_step(opt_state, batch.rows, batch.idx, batch.inverse)
    >>> rows.shape, int(opt_state.count)
    ((2, 8), 1)
    >>> dsa_jax.close(opt_state)
    """
    what = "sparse_adam"
    lr = _learning_rate(what, learning_rate)
    overrides: dict[str, Any] = {}
    if b1 is not None or b2 is not None:
        for i, b in enumerate((b1, b2)):
            if b is not None:
                _check_beta(i, b)
        overrides["betas"] = (b1, b2)
    if eps is not None:
        # the core's eps rule (the other values are neutral placeholders)
        overrides["eps"] = validation.check_hparams(1.0, (0.0, 0.0), eps, False, "propagate",
                                                    what=what)[2]
    if maximize is not None:
        if not isinstance(maximize, (bool, np.bool_)):
            raise TypeError(f"{what}: maximize must be a bool or None, got {maximize!r}")
        overrides["maximize"] = bool(maximize)
    if weight_decay is not None:
        overrides["weight_decay"] = validation.check_weight_decay(weight_decay, what=what)
    if decoupled_weight_decay is not None:
        if not isinstance(decoupled_weight_decay, (bool, np.bool_)):
            raise TypeError(f"{what}: decoupled_weight_decay must be a bool or None, got "
                            f"{decoupled_weight_decay!r}")
        overrides["decoupled_weight_decay"] = bool(decoupled_weight_decay)
    return _transform(what, "adam", lr, overrides, in_jit, return_rows)


def sparse_adagrad(learning_rate: float | Callable[[Any], Any] | None = 1e-2, *,
                   lr_decay: float = 0.0, initial_accumulator_value: float = 0.0,
                   eps: float = 1e-10, rowwise: bool = False, weight_decay: float = 0.0,
                   maximize: bool = False, in_jit: bool = False,
                   return_rows: bool = True) -> SparseGradientTransformation:
    r"""Sparse Adagrad over ``dsa_core`` Adagrad stores, as an optax-style ``(init, update)``.

    The twin of :func:`sparse_adam` (the same ``init``/``update``, ``in_jit``,
    ``return_rows``, padding, ``row_grads``, several tables as a pytree, errors before any
    write) for stores created with ``optimizer="adagrad"`` (``rowwise=True``:
    ``"rowwise_adagrad"``), e.g. ``create_store(path, n, dim, optimizer="adagrad")``. The
    step is ``dsa_core.step`` on such a store: ``torch.optim.Adagrad``'s sparse step, or
    PyTorch-BigGraph's ``RowAdagrad`` (docs/algorithms.md §7.5); rows absent from a batch
    are untouched.

    Parameters
    ----------
    learning_rate : float or callable, default 1e-2
        A float ``> 0`` or an optax schedule ``callable(count)`` (count = completed steps;
        it may return 0); ``None``: each store's own ``lr``. The step size of step ``t`` is
        ``lr / (1 + (t - 1) * lr_decay)``, ``t`` the global step count.
    lr_decay : float, default 0
        ``>= 0``, torch's ``lr_decay``.
    initial_accumulator_value : float, default 0
        ``>= 0``: what an accumulator of a row not yet updated reads as.
    eps : float, default 1e-10
        ``> 0`` (torch takes 0), added after the square root.
    rowwise : bool, default False
        ``True``: one accumulator per row (``optimizer="rowwise_adagrad"`` stores), grown by
        the row mean of ``g²``.
    weight_decay : float, default 0
        ``rowwise=True`` only: FBGEMM's L2 decay ``g + weight_decay * p`` on the batch's
        rows. Elementwise refuses anything but 0, as ``torch.optim.Adagrad`` does with
        sparse gradients.
    maximize : bool, default False
        Ascend instead of descend.
    in_jit, return_rows : bool
        As for :func:`sparse_adam`.

    Unlike :func:`sparse_adam`'s ``None`` defaults, every hyperparameter here is a value
    (torch's defaults) and replaces the stores' own at ``init`` (written to each manifest
    at the next flush). Under ``optax.inject_hyperparams`` the learning rate is read at
    every update; the others take the values they had at ``init``. The state is a
    :class:`DiskAdagradState` (``DiskAdamState``'s fields), which :func:`flush`,
    :func:`close`, :func:`core_states`, ``checkpoint`` and ``restore`` take, alone or
    inside an optax state.

    Raises
    ------
    ValueError
        At ``init``: a store created for another optimizer (the message names
        ``optimizer=``); a bad hyperparameter at construction. Otherwise as
        :func:`sparse_adam`.

    Examples
    --------
    >>> import tempfile, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> store = dsa_jax.create_store(tempfile.mkdtemp() + "/emb", 100, 8, init="normal",
    ...                              optimizer="adagrad")
    >>> tx = dsa_jax.sparse_adagrad(0.1)
    >>> opt_state = tx.init(store)
    >>> rows, opt_state = tx.update(([3, 5, 3], np.ones((3, 8), np.float32)), opt_state)
    >>> rows.shape, int(opt_state.count), type(opt_state).__name__
    ((3, 8), 1, 'DiskAdagradState')
    >>> dsa_jax.close(opt_state)
    """
    what = "sparse_adagrad"
    lr = _learning_rate(what, learning_rate)
    if not isinstance(rowwise, (bool, np.bool_)):
        raise TypeError(f"{what}: rowwise must be a bool, got {rowwise!r}")
    optimizer = "rowwise_adagrad" if rowwise else "adagrad"
    given = {"lr_decay": lr_decay, "eps": eps, "initial_accumulator_value":
             initial_accumulator_value, "weight_decay": weight_decay}
    # optax.inject_hyperparams rebuilds the transform at every update with its values as
    # arrays, traced under jit: only init sets them in the stores, so a traced one (an
    # update's) is left out of the checks, as for learning_rate (which is read per update)
    traced = {k for k, v in given.items() if _is_tracer(v)}
    conc = {k: (1.0 if k == "eps" else 0.0) if k in traced else v for k, v in given.items()}
    # the core's checks and messages (1.0: a neutral placeholder for the lr checked above)
    _, ld, ep, iav, maximize, _ = validation.check_adagrad_hparams(
        1.0, conc["lr_decay"], conc["eps"], conc["initial_accumulator_value"], maximize,
        "propagate", what=what)
    wd = validation.check_adagrad_options(optimizer, weight_decay=conc["weight_decay"],
                                          what=what)
    overrides = {k: v for k, v in (("lr_decay", ld), ("eps", ep),
                                   ("initial_accumulator_value", iav),
                                   ("weight_decay", wd)) if k not in traced}
    overrides["maximize"] = maximize
    return _transform(what, optimizer, lr, overrides, in_jit, return_rows)


def _learning_rate(what: str, learning_rate: Any) -> tuple[Callable | None, float | None]:
    """``(schedule, const_lr)``: a float, a schedule, an injected array (a schedule of one
    value), or ``None`` (each store's own lr) checked."""
    schedule = learning_rate if callable(learning_rate) else None
    const_lr = None
    if isinstance(learning_rate, (jax.Array, jax.core.Tracer)):
        # a value optax.inject_hyperparams injects (traced inside jit): read at each update
        if not isinstance(learning_rate, jax.core.Tracer):
            validation.check_lr(float(learning_rate), what=what)
        schedule = functools.partial(_constant, learning_rate)
    elif learning_rate is not None and schedule is None:
        const_lr = validation.check_lr(learning_rate, what=what)
    return schedule, const_lr


def _transform(what: str, optimizer: str, lr: tuple, overrides: dict, in_jit: Any,
               return_rows: Any) -> SparseGradientTransformation:
    """The ``(init, update)`` pair of either factory, its settings bound as a Config."""
    schedule, const_lr = lr
    if not isinstance(in_jit, (bool, np.bool_)):
        raise TypeError(f"{what}: in_jit must be a bool, got {in_jit!r}")
    cfg = Config(schedule, const_lr, overrides, bool(in_jit), bool(return_rows), optimizer,
                 what)
    update = update_in_jit if cfg.in_jit else update_host
    return SparseGradientTransformation(functools.partial(init, cfg),
                                        functools.partial(update, cfg))


def _constant(value: Any, count: Any) -> Any:
    del count
    return value


def _check_beta(i: int, b: Any) -> float:
    """b1/b2 in [0, 1); optax's names (b1, b2) in the message rather than torch's betas."""
    try:
        v = float(b)
    except (TypeError, ValueError):
        raise TypeError(f"sparse_adam: b{i + 1} must be a float in [0, 1), got {b!r}") from None
    if not 0.0 <= v < 1.0:
        raise ValueError(f"sparse_adam: Invalid beta parameter b{i + 1}: {b}; it must lie in "
                         "[0, 1), e.g. b1=0.9, b2=0.999")
    return v


def init(cfg: Config, stores: Any) -> DiskAdamState:
    where = cfg.init_name
    """``tx.init(stores)``: wrap each open store in a :class:`DiskTable`; the count is theirs.

    Everything is checked before anything is made: every leaf an open, writable, current
    ``dsa_core.State``; no store twice; one count for all.
    """
    paths, treedef = flatten_stores(stores)
    if not paths:
        raise ValueError(f"{where}: init needs at least one dsa_core store (got an empty "
                         "pytree)")
    cores, names, counts, seen = [], [], set(), {}
    for path, leaf in paths:
        name = jax.tree_util.keystr(path)
        if not isinstance(leaf, dsa_core.State):
            raise TypeError(
                f"{where} takes open dsa_core stores (dsa_core.create/open, or "
                f"adapters.jax.create_store), or a pytree of them; got {type(leaf).__name__} "
                f"at {name or 'the root'}. The tables live on disk: create one with "
                "create_store(path, num_rows, dim)")
        if not leaf.writable:
            raise ValueError(f"{where}: store {str(leaf.path)!r} is "
                             f"{'closed' if leaf.closed else 'read-only'}; open it with "
                             "dsa_core.open(path) (mode 'r+') to train")
        key = leaf.path.resolve()
        if key in seen:
            raise ValueError(f"{where}: store {str(leaf.path)!r} appears twice in the stores "
                             f"({seen[key] or 'root'} and {name}); give each table its own "
                             "store")
        seen[key] = name
        if not leaf.current:
            raise dsa_core.StaleStateError(
                f"{where}: this dsa_core.State of store {str(leaf.path)!r} is stale: it is at "
                f"step {leaf.count}, but the store has been stepped since (through an "
                "optimizer state, or dsa_core.step). init from the current States, e.g. "
                "tx.init(core_states(opt_state))")
        if leaf.optimizer != cfg.optimizer:
            raise ValueError(_optimizer_error(cfg, leaf))
        core = leaf
        if cfg.overrides:
            rep = dict(cfg.overrides)
            if rep.get("betas") is not None:
                rep["betas"] = tuple(float(n if n is not None else o)
                                     for n, o in zip(rep["betas"], leaf.betas))
            core = core._replace(**rep)
        if cfg.lr is not None:
            core = core._replace(lr=cfg.lr)
        if cfg.optimizer == "adam" and core.decay_missed_steps \
                and not core.decoupled_weight_decay:
            raise ValueError(
                f"{where}: store {str(leaf.path)!r} was created with decay_missed_steps=True, "
                "which catches up the decoupled (AdamW) weight decay of the steps a row "
                "missed, but this transform steps it with decoupled_weight_decay=False (L2); "
                "pass sparse_adam(..., decoupled_weight_decay=True)")
        cores.append(core)
        names.append(name)
        counts.add(int(leaf.count))
    if len(counts) > 1:
        raise ValueError(
            f"{where}: the stores have made different numbers of steps {sorted(counts)}; one "
            "transform keeps one global step count for all its tables. Use stores trained "
            "together, or one transform per table. Stores of one transform that stopped apart "
            "(a crash between their commits) must be restored from the last checkpoint: "
            "s = dsa_core.restore(dsa_core.open(path), dsa_core.open(ckpt / name, mode='r')) "
            "for each table")
    (count,) = counts
    if len(cores) > 1:  # the tables step all or nothing and commit together (a crash
        # leaves them at one step; a resume that finds them apart refuses)
        dsa_core.join(cores)
    tables = [DiskTable(core, name, in_jit=cfg.in_jit) for core, name in zip(cores, names)]
    # in_jit: a jax.Array from the start, so the jitted step sees one argument type
    count = jnp.asarray(count, jnp.int32) if cfg.in_jit else np.asarray(count, np.int32)
    return cfg.state_cls(count, treedef.unflatten(tables))


def _optimizer_error(cfg: Config, leaf: dsa_core.State) -> str:
    """A store created for another optimizer than this transform's: which, and the fix."""
    other = {"adam": "sparse_adam(...)", "adagrad": "sparse_adagrad(...)",
             "rowwise_adagrad": "sparse_adagrad(..., rowwise=True)"}
    return (f"{cfg.init_name}: store {str(leaf.path)!r} was created with "
            f"optimizer={leaf.optimizer!r}, but this transform trains "
            f"optimizer={cfg.optimizer!r} stores (its records hold another optimizer's "
            f"state). Train it with {other[leaf.optimizer]}, or create the store with "
            f"create_store(..., optimizer={cfg.optimizer!r})")


def _lr_on_host(cfg: Config, count: int) -> float | None:
    if cfg.schedule is None:
        return cfg.lr  # None: each store's own lr
    return float(cfg.schedule(np.asarray(count, np.int32)))


def _is_tracer(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def update_host(cfg: Config, updates: Any, state: DiskAdamState, params: Any = None):
    """``tx.update`` of an ``in_jit=False`` transform: the step on the host, now."""
    tables, treedef = flatten_tables(state.stores)
    pairs = split_pairs(updates, treedef, tables, cfg.update_name)
    plist = split_params(params, treedef, len(tables), cfg.update_name)
    flat = [a for pr in pairs for a in pr] + plist
    if _is_tracer(state.count) or any(_is_tracer(a) for a in flat):
        raise RuntimeError(
            f"{cfg.update_name} was called inside jax.jit (or another transformation) but "
            "this transform runs on the host: call it outside jit with the gradients the "
            f"jitted function returned, or build it with {cfg.name}(..., in_jit=True)")
    if any(t._async for t in tables):
        jax.effects_barrier()  # the state was last stepped inside jit
    count = int(state.count)
    n = len(tables)
    host = to_host(flat)
    rows = host_step(tables, count, _lr_on_host(cfg, count), host[0:2 * n:2],
                     host[1:2 * n:2], host[2 * n:], cfg.return_rows, cfg.update_name)
    new_state = cfg.state_cls(np.asarray(count + 1, np.int32), state.stores)
    if not cfg.return_rows:
        return None, new_state
    placed = [put(r, g) if isinstance(g, jax.Array) else r
              for r, (_, g) in zip(rows, pairs)]
    return treedef.unflatten(placed), new_state


def update_in_jit(cfg: Config, updates: Any, state: DiskAdamState, params: Any = None):
    """``tx.update`` of an ``in_jit=True`` transform: the step as an ordered ``io_callback``.

    Traceable: the static checks run now (at trace time), the step when the program runs.
    """
    tables, treedef = flatten_tables(state.stores)
    pairs = split_pairs(updates, treedef, tables, cfg.update_name)
    plist = split_params(params, treedef, len(tables), cfg.update_name)
    for t, (i, g), p in zip(tables, pairs, plist):  # at trace time: shapes and dtypes
        check_pair_static(t, i, g, p, cfg.update_name)
    count = jnp.asarray(state.count, jnp.int32)
    has_p = [p is not None for p in plist]
    # every callback argument is one more transfer: pass only what is used
    args = [count]
    if cfg.schedule is not None:  # traced into the program; the value reaches the host
        args.append(jnp.asarray(cfg.schedule(count)))
    args += [a for pr in pairs for a in pr] + [p for p in plist if p is not None]
    callback = functools.partial(_callback, cfg, tables, has_p)
    count_shape = jax.ShapeDtypeStruct((), jnp.int32)
    if cfg.return_rows:
        shapes = ([jax.ShapeDtypeStruct(tuple(np.shape(g)), t.dtype)
                   for t, (_, g) in zip(tables, pairs)], count_shape)
    else:
        shapes = count_shape
    out = io_callback(callback, shapes, *args, ordered=True)
    # the new count is the callback's output: waiting on it waits for the step
    if cfg.return_rows:
        rows, new_count = out
        return treedef.unflatten(rows), cfg.state_cls(new_count, state.stores)
    return None, cfg.state_cls(out, state.stores)


def _callback(cfg: Config, tables: list[DiskTable], has_p: list[bool], count_a, *arrays):
    """The host side of :func:`update_in_jit`: unpack the arguments and step."""
    c = int(np.asarray(count_a))
    if cfg.schedule is not None:
        lr, arrays = float(np.asarray(arrays[0])), arrays[1:]
    else:
        lr = cfg.lr
    n = len(tables)
    host = [np.asarray(a) for a in arrays]
    rest = iter(host[2 * n:])
    ps = [next(rest) if hp else None for hp in has_p]
    rows = host_step(tables, c, lr, host[0:2 * n:2], host[1:2 * n:2], ps, cfg.return_rows,
                     cfg.update_name)
    new_count = np.asarray(c + 1, np.int32)
    return (rows, new_count) if cfg.return_rows else new_count
