"""Creating the stores a JAX transform trains, or reopening them when asked: ``create_store``.

Private; the public names live in :mod:`adapters.jax`.

A script run twice must not quietly continue the first run: fresh weights in the model
(``weights=False``) paired with the old m and v and count, or a run the user meant to
start over. So reopening an existing store is asked for (``resume=True``), replacing it is
asked for (``overwrite=True``), and otherwise an existing store is refused, untouched.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

import dsa_core
from dsa_core.tools import validation

from ._storage import (
    STORAGE_DEFAULT,
    check_kind,
    check_storage_args,
    check_unclean_arg,
    unclean_error,
)

__all__ = ["create_store"]

_WHAT = "create_store"
_CREATE_ARGS = {n: p.default for n, p in inspect.signature(dsa_core.create).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
# fixed when a store is created: a reopened store must have been made with these values
_LAYOUT_ARGS = ("curvature", "dtype", "weights", "second_moment", "first_moment", "align",
                "per_row_step", "decay_missed_steps", "optimizer")
# the optimizer's settings: given ones replace a reopened store's, as if it was made with them
_HPARAM_ARGS = ("lr", "betas", "eps", "maximize", "nonfinite", "durability", "weight_decay",
                "decoupled_weight_decay", "lr_decay", "initial_accumulator_value")
_OWN_ARGS = ("overwrite", "access", "storage", "memory")  # create_store's own handling


def create_store(path, num_rows: int, dim: int, *, resume: bool = False,
                 overwrite: bool = False, access: str = "auto", storage: str = STORAGE_DEFAULT,
                 memory: int | str | None = None, unclean: str = "refuse",
                 **create_args: Any) -> dsa_core.State:
    """Create the store of one table at ``path``; with ``resume=True``, reopen the one there.

    The first call of a training script and every later one can be the same line: without
    ``resume``/``overwrite`` a second run is refused, because silently reopening would go on
    from the old run's count with its m and v (and, for ``weights=False`` stores, pair them
    with freshly initialised weights).

    Parameters
    ----------
    path : str or Path
        Directory of the store.
    num_rows, dim : int
        Shape of the table.
    resume : bool, default False
        Reopen an existing store at ``path`` and continue from its count (its last flush,
        see ``flush``/``checkpoint``). If there is nothing to resume (no store at ``path``),
        a fresh one is created, so the same call starts a run and resumes it. The existing
        store must match the call (below); its weights are kept and ``init`` is ignored.
    overwrite : bool, default False
        Replace an existing store with a fresh one (refused while another writer holds it).
    unclean : "refuse" or "accept", default "refuse"
        ``resume=True`` only: a store left unclean (its writer ended between flushes and its
        rows could not be brought back to the last flush) raises
        ``dsa_core.UncleanStopError`` naming the cause and the remedy, or with ``"accept"``
        opens with its rows as they are (then ``restore(tx.init(stores), CKPT)``).
    access : "auto", "ram" or "disk"
        How the store is paged (``dsa_core.create``/``open``); ``"auto"`` only for a log
        store.
    storage : "auto", "inplace" or "log", default "auto"
        The kind of store (``dsa_core.create``'s ``storage``). ``"auto"`` (the default):
        ``dsa_core.create``'s rule -- a log store when the
        table is larger than the kernel's background-writeback threshold or ``memory`` is
        given, else in place; a resumed store keeps whatever kind it has. ``"log"``:
        the log-structured store, whose in-memory region of at most ``memory`` bytes takes
        the steps and writes evicted rows to disk in large sequential appends; training is
        bit-identical to an in-place store created with the same initial records (its named
        inits ``"normal"``/``"uniform"`` are a function of (seed, row), so they differ from
        an in-place store's; an init array or zeros give the same records). A store
        reopened with ``resume=True`` must be of the
        kind asked for.
    memory : int or str, optional
        ``storage="log"`` only: the budget of the log store's region, bytes or a string such
        as ``"4GiB"`` (default: the core's), for a new store and a reopened one alike (a
        store remembers the last one given: a reopen without it uses that). The unique rows of one
        ``update`` must fit in it. Refused
        with ``storage="inplace"``.
    **create_args
        The keyword arguments of ``dsa_core.create``: ``curvature``, ``dtype``, ``weights``,
        ``init``, ``lr``, ``durability``, ``weight_decay``, ``per_row_step``, ... When a
        store is reopened, ``curvature``, ``dtype``, ``weights``, ``second_moment``,
        ``first_moment``, ``align``, ``per_row_step`` and ``decay_missed_steps`` (given or
        at their defaults, since the same call would have created it) and ``ball_eps`` (if
        given) must agree with it, or a ``ValueError`` names the difference and the store is
        closed again, untouched; ``lr``, ``betas``, ``eps``, ``maximize``, ``nonfinite``,
        ``durability``, ``weight_decay`` and ``decoupled_weight_decay``, where given,
        replace the store's own (written at its next flush); ``init``, ``init_scale``,
        ``seed`` and ``progress`` only shape a new store.

    Returns
    -------
    dsa_core.State
        Open for writing, for ``sparse_adam(...).init``.

    Raises
    ------
    FileExistsError
        A store exists at ``path`` and neither ``resume`` nor ``overwrite`` was given
        (nothing is touched); or ``path`` holds a damaged store (``dsa_core.create``'s
        message says what to do).
    ValueError
        ``resume=True`` and ``overwrite=True`` together; a reopened store that does not
        match the call (its kind included); ``memory`` without ``storage="log"``, or a log
        store with ``access`` or ``durability`` other than their defaults.
    dsa_core.StoreLockedError
        Another process is writing the store.

    Examples
    --------
    >>> import tempfile, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> path = tempfile.mkdtemp() + "/emb"
    >>> store = dsa_jax.create_store(path, 100, 8, init="normal")   # a fresh store
    >>> tx = dsa_jax.sparse_adam(1e-2)
    >>> opt_state = tx.init(store)
    >>> _, opt_state = tx.update(([3], np.ones((1, 8), np.float32)), opt_state)
    >>> dsa_jax.close(opt_state)

    Running the same line again is refused, and says what to choose:

    >>> dsa_jax.create_store(path, 100, 8, init="normal")
    Traceback (most recent call last):
        ...
    FileExistsError: create_store: a store already exists at '...' (100 x 8 float32, last
    flushed at step 1): pass resume=True to reopen it and ..., or overwrite=True to ...

    >>> store = dsa_jax.create_store(path, 100, 8, init="normal", resume=True)
    >>> store.count
    1
    >>> dsa_core.close(store)
    >>> dsa_jax.create_store(path, 100, 8, overwrite=True).count       # start over
    0
    """
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{_WHAT}: {name} must be a bool, got {flag!r}")
    if resume and overwrite:
        raise ValueError(f"{_WHAT}: resume=True reopens the store at {str(path)!r} and "
                         "overwrite=True replaces it; pass one of them")
    unknown = sorted(set(create_args) - set(_CREATE_ARGS) | set(create_args) & set(_OWN_ARGS))
    if unknown:
        raise TypeError(f"{_WHAT}: unexpected keyword argument(s) {unknown}; it takes "
                        f"resume, overwrite, {', '.join(_OWN_ARGS[1:])} and the keyword "
                        "arguments of dsa_core.create "
                        f"{sorted(set(_CREATE_ARGS) - set(_OWN_ARGS))}")
    storage, memory = check_storage_args(storage, memory, access, _WHAT)
    unclean = check_unclean_arg(unclean, _WHAT)
    if resume:
        remedy = ("create_store(..., resume=True, unclean=\"accept\"), then "
                  "adapters.jax.restore(tx.init(stores), CKPT)")
        try:  # read-only: a mismatch leaves it untouched
            probe = dsa_core.open(path, mode="r", unclean=unclean)
        except FileNotFoundError:
            probe = None  # nothing to resume: a fresh store (a damaged one: create says so)
        except dsa_core.UncleanStopError as exc:
            raise unclean_error(exc, _WHAT, path, remedy) from None
        if probe is not None:
            try:
                check_kind(probe, storage,
                           f"{_WHAT}: the existing store at {str(probe.path)!r}")
                _check_match(probe, num_rows, dim, create_args)
                hparams = _hparams(probe, create_args)
            finally:
                dsa_core.close(probe)
            try:
                st = dsa_core.open(path, access=access, memory=memory, unclean=unclean)
            except dsa_core.UncleanStopError as exc:
                raise unclean_error(exc, _WHAT, path, remedy) from None
            return st._replace(**hparams)
    try:
        return dsa_core.create(path, num_rows, dim, overwrite=overwrite, access=access,
                               storage=storage, memory=memory, **create_args)
    except FileExistsError as exc:
        try:
            found = dsa_core.open(path, mode="r")  # a real store (not a damaged one)?
        except (OSError, ValueError):
            raise exc from None
        count, shape, dtype = found.count, found.shape, found.dtype.name
        dsa_core.close(found)
        raise FileExistsError(
            f"{_WHAT}: a store already exists at {str(path)!r} ({shape[0]} x {shape[1]} "
            f"{dtype}, last flushed at step {count}): pass resume=True to reopen it and "
            f"continue from step {count}, or overwrite=True to replace it with a fresh store. "
            "Nothing was touched") from None


def _check_match(state: dsa_core.State, num_rows: int, dim: int,
                 create_args: dict[str, Any]) -> None:
    """A ``ValueError`` unless the store is what this call would have created."""
    want = {n: create_args.get(n, _CREATE_ARGS[n]) for n in _LAYOUT_ARGS}
    c = validation.check_curvature(want["curvature"], what=_WHAT)
    dt = validation.check_dtype(want["dtype"], what=_WHAT)
    validation.check_second_moment(want["second_moment"], c, what=_WHAT)
    expect = {
        "shape": ((int(num_rows), int(dim)), state.shape),
        "dtype": (dt.name, state.dtype.name),
        "curvature": (c, state.curvature),
        "weights": (bool(want["weights"]), state.has_weights),
        "second_moment": ("riemannian" if c > 0 else want["second_moment"],
                          state.second_moment),
        "first_moment": (want["first_moment"], state.first_moment),
        "align": (want["align"], state.layout.get("align", 0)),
        "per_row_step": (bool(want["per_row_step"]), bool(state.per_row_step)),
        "decay_missed_steps": (bool(want["decay_missed_steps"]),
                               bool(state.decay_missed_steps)),
        "optimizer": (want["optimizer"], state.optimizer),
    }
    if want["optimizer"] != "adam":  # an Adagrad store's moments follow from its optimizer
        del expect["second_moment"], expect["first_moment"]
    if create_args.get("ball_eps") is not None:
        expect["ball_eps"] = (float(create_args["ball_eps"]), state.ball_eps)
    diff = {k: v for k, v in expect.items() if v[0] != v[1]}
    if diff:
        desc = "; ".join(f"{k} {have!r} (asked: {asked!r})"
                         for k, (asked, have) in diff.items())
        raise ValueError(
            f"{_WHAT}: the store at {str(state.path)!r} does not match this call: it has "
            f"{desc}. resume=True continues a run with the settings that created it: pass "
            "the same ones, or use a fresh directory (or overwrite=True to replace it)")


def _hparams(state: dsa_core.State, create_args: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters this call gives a reopened store, checked (``{}`` if none)."""
    given = {n: create_args[n] for n in _HPARAM_ARGS if n in create_args}
    if not given:
        return {}
    if state.optimizer != "adam":
        return _adagrad_hparams(state, given)
    lr, betas, eps, maximize, nonfinite = validation.check_hparams(
        given.get("lr", state.lr), given.get("betas", state.betas),
        given.get("eps", state.eps), given.get("maximize", state.maximize),
        given.get("nonfinite", state.nonfinite), what=_WHAT)
    durability, wd = _durability_and_decay(state, given)
    decoupled = given.get("decoupled_weight_decay", state.decoupled_weight_decay)
    if not isinstance(decoupled, (bool, np.bool_)):
        raise TypeError(f"{_WHAT}: decoupled_weight_decay must be a bool, got {decoupled!r}")
    if state.decay_missed_steps and not decoupled:
        raise ValueError(f"{_WHAT}: the store at {str(state.path)!r} was created with "
                         "decay_missed_steps=True, which needs decoupled_weight_decay=True")
    return {"lr": lr, "betas": betas, "eps": eps, "maximize": maximize,
            "nonfinite": nonfinite, "durability": durability, "weight_decay": wd,
            "decoupled_weight_decay": bool(decoupled)}


def _durability_and_decay(state: dsa_core.State, given: dict[str, Any]) -> tuple[str, float]:
    """The ``durability`` and ``weight_decay`` given (else the store's), checked."""
    durability = given.get("durability", state.durability)
    if durability not in validation.DURABILITY_MODES:
        raise ValueError(f"{_WHAT}: durability must be one of "
                         f"{validation.DURABILITY_MODES}, got {durability!r}")
    wd = validation.check_weight_decay(given.get("weight_decay", state.weight_decay),
                                       what=_WHAT)
    return durability, wd


def _adagrad_hparams(state: dsa_core.State, given: dict[str, Any]) -> dict[str, Any]:
    """:func:`_hparams` of a reopened Adagrad store: its own hyperparameters, checked by the
    core's rules (``betas`` and Adam's weight-decay options refused as ``create`` does)."""
    validation.check_adagrad_options(
        state.optimizer, betas=given.get("betas"),
        weight_decay=given.get("weight_decay", state.weight_decay),
        decoupled_weight_decay=given.get("decoupled_weight_decay", False), what=_WHAT)
    lr, lr_decay, eps, iav, maximize, nonfinite = validation.check_adagrad_hparams(
        given.get("lr", state.lr), given.get("lr_decay", state.lr_decay),
        given.get("eps", state.eps),
        given.get("initial_accumulator_value", state.initial_accumulator_value),
        given.get("maximize", state.maximize), given.get("nonfinite", state.nonfinite),
        what=_WHAT)
    durability, wd = _durability_and_decay(state, given)
    return {"lr": lr, "lr_decay": lr_decay, "eps": eps, "initial_accumulator_value": iav,
            "maximize": maximize, "nonfinite": nonfinite, "durability": durability,
            "weight_decay": wd}
