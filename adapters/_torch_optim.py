"""``DiskSparseAdam``: ``torch.optim.SparseAdam`` with its moments in dsa_core stores."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

import dsa_core
from dsa_core.tools import validation

from ._storage import STORAGE_DEFAULT, check_unclean_arg
from ._torch_common import (
    DirLock,
    SharedState,
    check_reopen,
    check_storage_args,
    check_torch_hparams,
    close_quietly,
    manifold_curvature,
    np_dtype,
    peek_existing,
    reopen,
    row_options,
    set_columns,
    store_second_moment,
    to_device,
    to_host,
)
from ._torch_embedding import DiskWeight
from ._torch_guard import install as _install_guard
from ._torch_snapshots import (
    DEFAULT_KEEP,
    all_records,
    carry_into,
    carry_plan,
    check_keep,
    check_rows,
    close_saved,
    open_saved,
    open_snapshot,
    release,
    resolve_carried,
    restore_from,
    rows_fit,
    take,
)

__all__ = ["CHECKPOINT_FILE", "EXTRA_FILE", "MANIFEST_KEY", "DiskSparseAdam"]

MANIFEST_KEY = "dsa_manifest"
CHECKPOINT_FILE = "optimizer.pt"
EXTRA_FILE = "extra.pt"  # checkpoint(extra=...): the user's state dicts, in the same directory
_MANIFEST_FORMAT = "dsa-torch-optimizer"
# param-group keys that a loaded state dict without them leaves as this optimizer has them
_KEPT_KEYS = ("weight_decay", "decoupled_weight_decay")


class _Slot(NamedTuple):
    name: str              # "group{i}_param{j}" (own store) or the DiskEmbedding store path
    handle: SharedState    # the store; shared with a DiskEmbedding for DiskWeight params
    owned: bool            # True: weights=False store created/opened by this optimizer


class _Job(NamedTuple):
    p: torch.Tensor
    where: str             # "parameter [i, j]", for messages
    slot: _Slot
    hp: tuple              # (lr, (beta1, beta2), eps, maximize, weight_decay, decoupled)
    idx_dev: torch.Tensor  # coalesced row ids on p's device (for index_copy_)
    host: list             # [idx, vals, rows?] on the host (pinned for CUDA)


def _in_place(p: torch.Tensor) -> bool:
    """True when the kernel can update ``p``'s rows where they are (a dense CPU table).

    Saves copying the batch's rows out (``index_select``) and back (``index_copy_``), a
    noticeable share of a small step (docs/notebook.md, "Torch end to end").
    """
    return p.device.type == "cpu" and p.layout == torch.strided and p.is_contiguous() \
        and p.dim() == 2 and p.dtype in (torch.float32, torch.float64)


class _Owned:
    """What a DiskSparseAdam must release: its own stores and its state_dir lock."""

    def __init__(self):
        self.handles: list[SharedState] = []
        self.lock: DirLock | None = None
        self.group = None  # the stores' dsa_core.Group: one commit, then released

    def close(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            with contextlib.suppress(Exception):  # best effort at exit, as close_quietly
                group.close()
        close_quietly(self.handles, self.lock)
        self.lock = None


def _group_hparams(group: dict) -> tuple:
    """Read a param group's hyperparameters for this step (schedulers may have changed them).

    ``(lr, (beta1, beta2), eps, maximize, weight_decay, decoupled_weight_decay)``; torch's
    checks and messages first, then the core's (a finite weight decay).
    """
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    wd = group.get("weight_decay", 0.0)
    decoupled = group.get("decoupled_weight_decay", False)
    check_torch_hparams(lr, betas, eps, wd, decoupled)
    lr = float(lr)
    if not math.isfinite(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    wd = validation.check_weight_decay(float(wd), what="DiskSparseAdam")
    return (lr, (float(betas[0]), float(betas[1])), float(eps),
            bool(group.get("maximize", False)), wd, bool(decoupled))


def _check_catch_up(st: dsa_core.State, decoupled: bool, where: str) -> None:
    """``ValueError`` if a ``decay_missed_steps`` store would be stepped with L2 decay."""
    if st.decay_missed_steps and not decoupled:
        raise ValueError(
            f"{where}: its store {str(st.path)!r} was created with decay_missed_steps=True, "
            "which catches up the decoupled (AdamW) weight decay of the steps a row missed; "
            "its param group has decoupled_weight_decay=False (L2 decay has no closed form "
            "for missed steps). Set decoupled_weight_decay=True for that group, or use a "
            "store created without decay_missed_steps")


def _live(h: SharedState, gp: int) -> dsa_core.State:
    """The open store of parameter ``gp``, or ``RuntimeError`` (a load would write it)."""
    if h.closed:
        raise RuntimeError(f"the store of parameter {gp} ({str(h.state.path)!r}) is closed")
    return h.state


def _close_all(snaps: list) -> None:
    for snap in snaps:
        if snap is not None:
            close_saved(snap)


def _save_durably(obj: Any, path: Path) -> None:
    """``torch.save`` to ``path`` and fsync it (the checkpoint commits only durable files)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _check_loadable(path: Path) -> None:
    """``TypeError`` unless ``torch.load(path, weights_only=True)`` reads it back.

    Mapped (``mmap=True``), so checking a large model state dict reads no tensor data.
    """
    try:
        torch.load(path, weights_only=True, mmap=True)
    except Exception as exc:  # torch raises UnpicklingError (and others) for such objects
        raise TypeError(
            "checkpoint(extra=...) holds something torch.load(weights_only=True) refuses "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "keep to tensors, dicts, lists, numbers and strings, e.g. the state_dict() of "
            "the model and the scheduler. Nothing was written") from None


class DiskSparseAdam(torch.optim.Optimizer):
    r"""``torch.optim.SparseAdam`` whose moments live on disk: a drop-in for huge embeddings.

    Each parameter gets a dsa_core store (m and v, one record per row) under ``state_dir``;
    the weights stay in the parameter, wherever it lives (CPU or CUDA). A step coalesces
    each row-sparse gradient with torch's own ``coalesce()``, hands the row ids, gradient
    rows and current weight rows to ``dsa_core.step`` (which updates m and v in the mapped
    file) and writes the new rows back with ``index_copy_``. Memory used by the optimizer is
    O(batch), not O(table). Parameters of a :class:`DiskEmbedding` (whose weights are in a
    store too) are stepped in their own store.

    Parameters
    ----------
    params : iterable
        Parameters or param groups, as for any ``torch.optim.Optimizer``. Each must be a
        2-D float32/float64 table receiving row-sparse gradients (``nn.Embedding`` /
        ``nn.EmbeddingBag`` with ``sparse=True``, or a :class:`DiskEmbedding`).
    lr : float or Tensor, default 1e-3
        Learning rate; ``group["lr"]`` is read at every step, so LR schedulers work.
    betas : (float, float), default (0.9, 0.999)
    eps : float, default 1e-8
    maximize : bool, default False
        As ``torch.optim.SparseAdam`` (same checks, same messages, in the same order).
    weight_decay : float, default 0.0
        As ``torch.optim.Adam`` (its check and message, ``Invalid weight_decay value: ...``),
        a per-group hyperparameter read at every step. With ``decoupled_weight_decay=False``
        it is L2: ``g <- g + weight_decay * p`` for the rows of the batch before the Adam
        update (``torch.optim.Adam(weight_decay=...)`` on those rows). Lazy, like the
        moments: rows absent from a batch do not decay (unless ``decay_missed_steps``).
    decoupled_weight_decay : bool, default False
        As ``torch.optim.Adam``: ``True`` is AdamW, ``p <- p * (1 - lr * weight_decay)`` and
        then the Adam step, in ``torch.optim.AdamW``'s order. Per group.
    state_dir : str or Path
        Directory of this optimizer's stores: ``<state_dir>/group{i}_param{j}`` for the
        ``j``-th parameter of the ``i``-th group, a stable name, so an optimizer built the
        same way on the same ``state_dir`` can resume from the stores (see ``resume``). One
        optimizer per ``state_dir`` (a lock file; a second one raises
        ``dsa_core.StoreLockedError``). Not needed when every parameter is a DiskEmbedding's
        (given then, it is unused, and a ``UserWarning`` says so).
    resume : bool, default False
        Whether existing stores under ``state_dir`` are reopened. They hold the m, v and
        step counts of an earlier run, but not its weights (those are the model's): a
        script run twice would otherwise pair freshly initialised weights with the old
        moments without a word. ``resume=True``: reopen each store that exists (its
        moments and step count carry on) and create the others, so the same line starts a
        run and continues it; restore the model's weights yourself (e.g. from
        :meth:`checkpoint`'s ``extra``). ``resume=False`` (default): existing stores are
        refused with ``FileExistsError``, nothing touched.
    overwrite : bool, default False
        Replace existing stores with new ones (their moments are deleted). ``resume=True``
        with ``overwrite=True`` is refused.
    curvature : float, default 0.0
        ``0``: Euclidean, exactly ``torch.optim.SparseAdam``. ``c > 0``: Riemannian Adam on
        the Poincaré ball of curvature ``-c``, exactly geoopt ``SparseRiemannianAdam``. Also
        a per-group key. A geoopt ``ManifoldParameter`` on ``PoincareBall(c)`` or
        ``Stereographic(k<0)`` brings its own ``c`` (``float(manifold.c)`` / ``-k``).
    access : "auto", "ram" or "disk", default "auto"
        How this optimizer's stores are paged (``dsa_core.create``'s ``access``): "ram"
        maps them with huge pages (they fit in memory), "disk" for state larger than
        memory; "auto" chooses by size (and ``DSA_ACCESS``).
    second_moment : "elementwise" or "rowwise", optional
        The second moment of this optimizer's stores (``c == 0`` only). ``"elementwise"``
        (the default): SparseAdam's v, one per coordinate, exact parity. ``"rowwise"``: one
        v per row from the mean of ``g²`` (FBGEMM's partial row-wise Adam,
        docs/algorithms.md §7.3): the stores hold ``dim + 1`` instead of ``2 * dim`` values
        per row, the update is no longer SparseAdam's (its accuracy and speed:
        docs/notebook.md, "Reduced state"). Fixed when a store is created; a resumed store
        must match. A DiskEmbedding's parameter keeps its own store's setting (given here,
        it must match).
    first_moment : "full" or "bfloat16", optional
        How the stores keep m (float32 parameters, ``c == 0``). ``"full"`` (the default):
        in the parameter's dtype. ``"bfloat16"``: 2 bytes per coordinate, stochastic
        rounding (docs/algorithms.md §6; v stays float32); not SparseAdam's trajectory any
        more. Same rules as ``second_moment`` for resumed stores and DiskEmbeddings.
    nonfinite : "propagate", "skip_row" or "raise", optional
        What a NaN or Inf in a gradient row does: ``"propagate"`` spreads it into that row's
        weights and moments, as torch does; ``"skip_row"`` leaves such a row untouched (its
        moments do not decay); ``"raise"`` raises ``FloatingPointError`` before any store is
        written. Recorded in each store. The default, None, keeps what a store records
        (``"propagate"`` for a new one); a value applies to this optimizer's own stores, new
        and resumed alike (a policy, not a property of the rows, so a resumed store may
        change it). A DiskEmbedding's parameter keeps its module's setting (given here, it
        must match), as for ``second_moment``.
    per_row_step : bool, optional
        ``True``: each row keeps its own step count ``t_r`` (incremented when the row is in
        a batch) for the bias correction, so a row first seen late takes a first step of
        about ``lr * sign(g)`` instead of a global-``t`` one (docs/algorithms.md §7.2); the
        global count stays (``state[p]["step"]``, schedules). A layout option of the stores
        (an int32 per row), fixed when a store is created, like ``second_moment``: the
        default, None, is False for this optimizer's own stores and keeps a DiskEmbedding's
        setting (given here, it must match). Not a param-group key.
    decay_missed_steps : bool, optional
        ``True``: a row that comes back after missing steps first gets the decoupled decay of
        every step it missed, so decay behaves as if applied to every row at every step
        (exact for a constant lr; docs/algorithms.md §7.1). Needs
        ``decoupled_weight_decay=True`` in every group that steps such a store. A layout
        option (a per-row last step), with the same rules as ``per_row_step``.
    storage : "auto", "inplace" or "log", default "auto"
        The kind of this optimizer's own stores (those of in-RAM parameters such as an
        ``nn.Embedding`` weight; ``dsa_core.create``'s ``storage``). ``"auto"`` (the default):
        ``dsa_core.create``'s rule -- a log store when the
        table is larger than the kernel's background-writeback threshold or ``memory`` is
        given, else in place; a resumed store keeps whatever kind it has. ``"log"``: log-structured
        stores whose in-memory region of at most ``memory``
        bytes takes the steps; training is bit-identical. They take ``access="auto"``
        only; resumed stores must be of the kind asked for. A
        DiskEmbedding's parameter keeps its module's store, whatever its kind.
    memory : int or str, optional
        ``storage="log"`` only: the memory budget of **each** own store (index, buffers
        and region), bytes or a string such as ``"4GiB"`` (default: the core's). Refused
        with ``storage="inplace"``.
    unclean : "refuse" or "accept", default "refuse"
        ``resume=True`` only: what a store left unclean does (its writer ended between
        flushes and its rows could not be brought back to the last flush: the machine
        restarted, or its undo record was unavailable). ``"refuse"``: raise
        ``dsa_core.UncleanStopError`` naming the cause and the remedy, nothing changed.
        ``"accept"``: open its rows as they are (``dsa_core.open``'s ``unclean``); follow
        with :meth:`load_checkpoint` to go back to a checkpoint.
    keep_snapshots : int, default 3
        How many :meth:`state_dict` snapshots of each store this optimizer keeps (in
        ``.dsa-snapshots/`` beside the store; older ones are deleted when a new one is
        taken), on both store kinds. ``0``: no snapshots; a state dict is then a
        description of the stores, refused once they have stepped on.

    Raises
    ------
    FileExistsError
        ``state_dir`` holds stores of an earlier run and neither ``resume`` nor
        ``overwrite`` is True.
    ValueError
        Invalid hyperparameters (torch's messages), sparse or complex parameters (torch's
        messages), parameters that are not 2-D, a store under ``state_dir`` that does not
        match its parameter (shape, moments, ``per_row_step``, ``decay_missed_steps``),
        ``decay_missed_steps`` without ``decoupled_weight_decay``. Nothing is written when
        construction fails.
    TypeError
        Parameters that are not float32/float64, or on an unsupported geoopt manifold.
    dsa_core.StoreLockedError
        Another optimizer holds ``state_dir`` (or the DiskEmbedding).

    Notes
    -----
    For ``curvature == 0`` the update is SparseAdam's (docs/algorithms.md §2.2), per
    touched row:

    .. math::

        m \leftarrow m + (g - m)(1-\beta_1),\quad v \leftarrow v + (g^2 - v)(1-\beta_2),\quad
        p \leftarrow p - \frac{\mathrm{lr}\sqrt{1-\beta_2^t}}{1-\beta_1^t}
                          \frac{m}{\sqrt{v} + \epsilon}

    with one global step ``t`` per parameter, incremented at every ``step()`` in which the
    parameter has a gradient (even one with no rows); rows absent from the gradient are
    left bit-for-bit untouched (their moments do not decay). ``weight_decay`` adds
    ``wd * p`` to ``g`` first (L2) or, with ``decoupled_weight_decay``, multiplies ``p`` by
    ``1 - lr * wd`` first (AdamW), for the touched rows; when every row is in every batch
    this is ``torch.optim.Adam`` / ``AdamW`` up to SparseAdam's placement of ``eps``
    (``sqrt(v) + eps`` before the bias correction, not after). ``per_row_step`` replaces
    ``t`` by the row's own count in the bias correction. For ``c > 0`` the second moment
    is one scalar per row (the squared Riemannian gradient norm) and the first moment is
    parallel-transported (docs/algorithms.md §3.2).

    Checkpoints: :meth:`checkpoint` writes a consistent snapshot of every store it steps
    (one ``dsa_core.checkpoint`` per store, named as in ``state_dir``), the state dict
    (``optimizer.pt``) pointing at them and, if given, the ``extra`` state dicts (the
    model's, the scheduler's), all committed by one atomic rename: a crash leaves no
    checkpoint or a complete one. :meth:`load_checkpoint` resumes from it (rows, counts,
    param groups) and returns ``extra``.

    :meth:`state_dict` flushes every store and adds a small manifest under the top-level
    key ``"dsa_manifest"`` (store names and paths, counts, hyperparameters); m and v stay
    in the stores. It is a checkpoint in torch's sense on both store kinds: each store is
    snapshotted and the manifest names the snapshot, so ``torch.save(opt.state_dict(), f)``
    and, later or in a new process, ``opt.load_state_dict(torch.load(f))`` restore exactly
    that point. A log store's snapshot is cheap (hard links to its immutable segments and a
    copy of its index); an in-place store's is a reflink of its data file where the
    filesystem supports it, else its last snapshot's files linked and the rows changed since
    (a full copy the first time). ``keep_snapshots`` (default 3)
    snapshots per store are kept, older ones deleted when a new state dict is taken;
    :meth:`release_snapshots` deletes them on request. With ``keep_snapshots=0`` a state
    dict is only a description: m and v keep moving with training, so
    :meth:`load_state_dict` refuses one whose step counts differ from the stores' (it
    would pair an old count with newer moments); one that matches (saved and loaded with
    no step in between) loads.
    It also accepts a ``torch.optim.SparseAdam`` (or geoopt ``SparseRiemannianAdam``) state
    dict and copies its ``exp_avg`` / ``exp_avg_sq`` into the stores. Into reduced stores:
    ``second_moment="rowwise"`` takes the row mean of ``exp_avg_sq`` (the row-wise v of
    the same gradients: a row's coordinates are always updated together),
    ``first_moment="bfloat16"`` the nearest bfloat16 of ``exp_avg``.

    CUDA parameters: the coalesced ids, gradient rows and current weight rows are copied
    into pinned host buffers with ``non_blocking=True`` (one stream synchronize per step,
    before the host reads them); the new rows go back with a non-blocking copy and
    ``index_copy_`` on the parameter's stream.

    Examples
    --------
    >>> import tempfile, torch
    >>> from adapters.torch import DiskSparseAdam
    >>> tmp = tempfile.mkdtemp()
    >>> emb = torch.nn.Embedding(1000, 16, sparse=True)
    >>> opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=f"{tmp}/opt")
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    >>> for _ in range(3):
    ...     emb(torch.tensor([1, 2, 2])).sum().backward(); opt.step(); opt.zero_grad()
    ...     sched.step()
    >>> opt.store_for(emb.weight).count
    3

    A checkpoint that can be resumed from, with the model and the scheduler:

    >>> _ = opt.checkpoint(f"{tmp}/ck", extra={"model": emb.state_dict(),
    ...                                        "sched": sched.state_dict()})
    >>> opt.close()

    The same script run again must say what it wants done with the stores:

    >>> emb = torch.nn.Embedding(1000, 16, sparse=True)
    >>> DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=f"{tmp}/opt")
    Traceback (most recent call last):
        ...
    FileExistsError: DiskSparseAdam: state_dir ... already holds the stores of an earlier run: ...
    >>> opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=f"{tmp}/opt",
    ...                      overwrite=True)
    >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    >>> extra = opt.load_checkpoint(f"{tmp}/ck")
    >>> _ = emb.load_state_dict(extra["model"]); sched.load_state_dict(extra["sched"])
    >>> opt.store_for(emb.weight).count
    3
    >>> opt.close()
    """

    _dsa_steps_disk_weights = True  # the step guard (adapters/_torch_guard.py) skips it
    # what differs between the optimizers on this machinery (DiskSparseAdagrad overrides)
    _NAME = "DiskSparseAdam"      # in messages
    _TORCH = "SparseAdam"         # the torch optimizer it mirrors (its messages)
    _DENSE = "Adam"               # what to use for dense gradients
    _kept_keys = _KEPT_KEYS       # group keys a loaded torch state dict may lack

    def __init__(self, params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 maximize: bool = False, *, weight_decay: float = 0.0,
                 decoupled_weight_decay: bool = False, state_dir=None, resume: bool = False,
                 overwrite: bool = False, curvature: float = 0.0, access: str = "auto",
                 second_moment: str | None = None, first_moment: str | None = None,
                 nonfinite: str | None = None, per_row_step: bool | None = None,
                 decay_missed_steps: bool | None = None, storage: str = STORAGE_DEFAULT,
                 memory: int | str | None = None, keep_snapshots: int = DEFAULT_KEEP,
                 unclean: str = "refuse"):
        check_torch_hparams(lr, betas, eps, weight_decay, decoupled_weight_decay)
        what = self._NAME
        validation.check_weight_decay(weight_decay, what=what)
        for name, flag in (("per_row_step", per_row_step),
                           ("decay_missed_steps", decay_missed_steps)):
            if flag is not None and not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{what}: {name} must be a bool (or None), got {flag!r}")
        c = validation.check_curvature(curvature, what=what)
        if second_moment is not None:
            validation.check_second_moment(second_moment, c, what=what)
        if first_moment is not None:  # the value here; float32 and c == 0 per parameter
            validation.check_first_moment(first_moment, 0.0, "float32", what=what)
        self._second_moment = second_moment
        self._first_moment = first_moment
        self._per_row_step = None if per_row_step is None else bool(per_row_step)
        self._decay_missed = None if decay_missed_steps is None else bool(decay_missed_steps)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "maximize": maximize,
                    "weight_decay": weight_decay,
                    "decoupled_weight_decay": bool(decoupled_weight_decay), "curvature": c}
        self._start(params, defaults, state_dir=state_dir, resume=resume,
                    overwrite=overwrite, access=access, nonfinite=nonfinite, storage=storage,
                    memory=memory, keep_snapshots=keep_snapshots, unclean=unclean)

    def _start(self, params, defaults: dict[str, Any], *, state_dir, resume: bool,
               overwrite: bool, access: str, nonfinite: str | None, storage: str,
               memory: int | str | None, keep_snapshots: int, unclean: str) -> None:
        """The storage arguments checked, torch's ``Optimizer.__init__``, then the stores
        opened or created: the part of construction every optimizer of this machinery
        shares (DiskSparseAdagrad's too)."""
        what = self._NAME
        self._unclean = check_unclean_arg(unclean, what)
        self._keep_snapshots = check_keep(keep_snapshots, what)
        dsa_core.tools.check_access(access)
        if nonfinite is not None:
            validation.check_nonfinite(nonfinite, what=what)
        self._resume, self._overwrite = check_reopen(resume, overwrite, what)
        self._storage, self._memory = check_storage_args(storage, memory, access, what)
        self._access = access
        self._nonfinite = nonfinite
        self._ready = False
        self._closed = False
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._owned = _Owned()
        self._group = None      # dsa_core.Group of the stores (two or more): one commit
        self._mismatch = None   # why the stores cannot form their group (different steps)
        self.state_dir = None if state_dir is None else Path(state_dir)
        super().__init__(params, defaults)
        self._finalizer = weakref.finalize(self, _Owned.close, self._owned)
        self._attach(range(len(self.param_groups)))
        self._ready = True

    # -- construction ---------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (as torch); its parameters get stores ``group{i}_param{j}``."""
        super().add_param_group(param_group)
        if not self._ready:
            return  # __init__ attaches every group at once
        try:
            self._check_open()
            self._attach([len(self.param_groups) - 1])
        except BaseException:
            self.param_groups.pop()
            raise

    # -- the optimizer's own part (DiskSparseAdagrad overrides these) ---------------------
    def _hparams(self, group: dict) -> tuple:
        """A param group's hyperparameters for this step, checked (:func:`_group_hparams`)."""
        return _group_hparams(group)

    @staticmethod
    def _decoupled(hp: tuple) -> bool:
        """Whether ``hp`` (of :meth:`_hparams`) asks for decoupled weight decay."""
        return hp[5]

    def _create_kw(self, hp: tuple, c: float) -> dict[str, Any]:
        """``dsa_core.create``'s optimizer keywords for an own store of curvature ``c``."""
        lr, betas, eps, maximize, wd, decoupled = hp
        return {"curvature": c, "lr": lr, "betas": betas, "eps": eps, "maximize": maximize,
                "weight_decay": wd, "decoupled_weight_decay": decoupled,
                "second_moment": self._sm(c), "first_moment": self._first_moment or "full",
                **self._row_options()}

    def _expect(self, c: float) -> dict[str, Any]:
        """What an existing own store must be (``check_existing``'s optimizer keywords)."""
        return {"optimizer": "adam", "second_moment": self._sm(c),
                "first_moment": self._first_moment or "full", **self._row_options()}

    def _with_hparams(self, st: dsa_core.State, hp: tuple) -> dsa_core.State:
        """``st`` with the hyperparameters ``hp`` of this step (recorded at the next flush:
        ``dsa info``, a resume)."""
        lr, betas, eps, maximize, wd, decoupled = hp
        if (st.lr, st.betas, st.eps, st.maximize, st.weight_decay,
                st.decoupled_weight_decay) != (lr, betas, eps, maximize, wd, decoupled):
            st = st._replace(lr=lr, betas=betas, eps=eps, maximize=maximize,
                             weight_decay=wd, decoupled_weight_decay=decoupled)
        return st

    @staticmethod
    def _describe_hparams(st: dsa_core.State) -> dict[str, Any]:
        """The hyperparameters a state dict's manifest records for the store ``st``."""
        return {"lr": st.lr, "betas": list(st.betas), "eps": st.eps,
                "maximize": st.maximize, "weight_decay": st.weight_decay,
                "decoupled_weight_decay": st.decoupled_weight_decay}

    def _store_optimizer(self) -> str:
        """The ``optimizer`` of the stores this optimizer steps (``dsa_core.create``'s)."""
        return "adam"

    def _check_embedding_optimizer(self, st: dsa_core.State, where: str) -> None:
        """``ValueError`` unless the DiskEmbedding store ``st`` holds this optimizer's state
        (``DiskEmbedding(optimizer=...)``)."""
        want = self._store_optimizer()
        if st.optimizer != want:
            right = "DiskSparseAdam" if st.optimizer == "adam" else (
                "DiskSparseAdagrad" + ("(rowwise=True)" if st.optimizer == "rowwise_adagrad"
                                       else ""))
            raise ValueError(
                f"{self._NAME}: {where} is a DiskEmbedding created with "
                f"optimizer={st.optimizer!r} (its store {str(st.path)!r} holds "
                f"{st.optimizer}'s state), which this optimizer cannot step: it needs "
                f"DiskEmbedding(..., optimizer={want!r}). Step that embedding with {right}, "
                "or create it with the optimizer you mean to use; nothing was changed")

    def _sm(self, c: float) -> str:
        """``dsa_core.create``'s second_moment for an own store of curvature ``c``."""
        return "elementwise" if c > 0 else (self._second_moment or "elementwise")

    def _kind(self) -> dict[str, Any]:
        """``dsa_core.create``'s ``storage`` / ``memory`` for an own store."""
        return {"storage": self._storage, "memory": self._memory}

    def _row_options(self) -> dict[str, bool]:
        """``per_row_step`` and ``decay_missed_steps`` of this optimizer's own stores."""
        return {"per_row_step": bool(self._per_row_step),
                "decay_missed_steps": bool(self._decay_missed)}

    def _plan(self, groups) -> list[tuple]:
        """Validate the parameters of ``groups``; no I/O. Returns one entry per parameter."""
        sparse, cplx = [], []
        for gi in groups:
            for pj, p in enumerate(self.param_groups[gi]["params"]):
                if p.is_sparse:
                    sparse.append([gi, pj])
                if p.is_complex():
                    cplx.append([gi, pj])
        if sparse:
            raise ValueError(f"Sparse params at indices {sparse}: {self._TORCH} requires "
                             "dense parameter tensors")
        if cplx:
            raise ValueError(f"Complex params at indices {cplx}: {self._TORCH} does not "
                             "support complex parameters")
        plan = []
        for gi in groups:
            group = self.param_groups[gi]
            gc = validation.check_curvature(group.get("curvature", 0.0),
                                            what=f"{self._NAME} param group {gi}")
            group["curvature"] = gc
            decoupled = self._decoupled(self._hparams(group))  # torch's checks, overrides too
            for pj, p in enumerate(group["params"]):
                where = f"parameter [{gi}, {pj}]"
                if p.dim() != 2:
                    raise ValueError(
                        f"{self._NAME} needs 2-D (num_rows, dim) parameters such as "
                        f"nn.Embedding.weight; {where} has shape {tuple(p.shape)}. Optimize "
                        "it with another optimizer (e.g. torch.optim.Adam)")
                dt = np_dtype(p.dtype, where)
                if isinstance(p, DiskWeight):
                    h = p._dsa_handle
                    if h.closed:
                        raise ValueError(f"{where} belongs to a closed DiskEmbedding")
                    other = h.borrower() if h.borrower is not None else None
                    if other is not None and other is not self:
                        raise dsa_core.StoreLockedError(
                            f"the DiskEmbedding of {where} (store {str(h.state.path)!r}) is "
                            f"already stepped by another {self._NAME}; close that one first")
                    c = h.state.curvature
                    self._check_embedding_optimizer(h.state, where)
                    if gc not in (0.0, c):
                        raise ValueError(
                            f"{where} is a DiskEmbedding created with curvature {c}, but its "
                            f"group asks for curvature {gc}; the curvature of a store is "
                            "fixed when it is created (DiskEmbedding(curvature=...))")
                    sm = self._second_moment
                    if sm is not None:
                        validation.check_second_moment(sm, c, what=f"{self._NAME} {where}")
                    fm, nf, st = self._first_moment, self._nonfinite, h.state
                    pr, dm = self._per_row_step, self._decay_missed
                    for name, asked, want, kept in (
                            ("second_moment", sm, sm and store_second_moment(sm, c),
                             f"keeps a {st.second_moment} second moment"),
                            ("first_moment", fm, fm, f"keeps m as {st.first_moment!r}"),
                            ("nonfinite", nf, nf, "handles non-finite gradients with "
                                                  f"nonfinite={st.nonfinite!r}"),
                            ("per_row_step", pr, pr,
                             f"was created with per_row_step={st.per_row_step}"),
                            ("decay_missed_steps", dm, dm, "was created with "
                             f"decay_missed_steps={st.decay_missed_steps}")):
                        if asked is not None and getattr(st, name) != want:
                            raise ValueError(
                                f"{where} is a DiskEmbedding whose store {kept}, but this "
                                f"optimizer asks for {name}={asked!r}; set it on the embedding "
                                f"(DiskEmbedding({name}=...)) and leave it out here")
                    _check_catch_up(st, decoupled, f"{self._NAME} {where}")
                    plan.append((gi, pj, p, None, dt, c))
                    continue
                mc = manifold_curvature(p)
                if mc is not None and gc not in (0.0, mc):
                    raise ValueError(f"{where} lives on a manifold of curvature {mc}, but its "
                                     f"group asks for curvature {gc}; drop curvature= (the "
                                     "manifold's is used) or make them equal")
                c = gc if mc is None else mc
                if self._second_moment is not None:
                    validation.check_second_moment(self._second_moment, c,
                                                   what=f"{self._NAME} {where}")
                if self._first_moment is not None:
                    validation.check_first_moment(self._first_moment, c, dt,
                                                  what=f"{self._NAME} {where}")
                if self._decay_missed and not decoupled:
                    raise ValueError(
                        f"{self._NAME}: decay_missed_steps=True catches up the decoupled "
                        f"(AdamW) weight decay of the steps a row missed, but param group "
                        f"{gi} (of {where}) has decoupled_weight_decay=False; pass "
                        "decoupled_weight_decay=True")
                if self.state_dir is None:
                    raise ValueError(f"{self._NAME} needs state_dir=...: the moments of "
                                     f"{where} are kept in a store there")
                plan.append((gi, pj, p, self.state_dir / f"group{gi}_param{pj}", dt, c))
        return plan

    def _attach(self, groups) -> None:
        """Open (resume) or create the stores of ``groups``; all or nothing.

        Every existing store is first looked at read-only (shape and layout checked, and
        refused unless ``resume`` or ``overwrite`` was asked for), so a refusal leaves the
        disk as it was; only then are stores opened for writing or created.
        """
        plan = self._plan(groups)
        own = [e for e in plan if e[3] is not None]
        # with two tables or more, state_dir holds their group's commit file (_regroup)
        if not self._ready and not own and len(plan) < 2 and self.state_dir is not None:
            warnings.warn(
                f"{self._NAME}: state_dir={str(self.state_dir)!r} is not used: the one "
                "parameter is a DiskEmbedding's weight, whose m and v live in that "
                "embedding's own store (its state_dir), and nothing is written here. Leave "
                "state_dir out (it is needed for parameters held in memory, such as an "
                "nn.Embedding's weight, and for the commit file of two tables or more)",
                UserWarning, stacklevel=3)
        new_lock = None
        if own and self._owned.lock is None:
            new_lock = DirLock(self.state_dir, self._NAME)
        opened: list[dsa_core.State] = []
        created: list[Path] = []
        try:
            expect, found = [], []
            for gi, pj, p, path, dt, c in own:  # pass 1: look, write nothing
                kw = {"num_rows": p.shape[0], "dim": p.shape[1], "dtype": dt, "curvature": c,
                      "weights": False, "what": f"{self._NAME} parameter [{gi}, {pj}]",
                      "storage": self._storage, **self._expect(c)}
                expect.append(kw)
                found.append(None if self._overwrite
                             else peek_existing(path, unclean=self._unclean, **kw))
            old = [(e[3].name, n) for e, n in zip(own, found) if n is not None]
            if old and not self._resume:
                listed = ", ".join(f"{name} (step {n})" for name, n in old[:4])
                more = f" and {len(old) - 4} more" if len(old) > 4 else ""
                raise FileExistsError(
                    f"{self._NAME}: state_dir {str(self.state_dir)!r} already holds the "
                    f"stores of an earlier run: {listed}{more}; nothing was changed. Pass "
                    "resume=True to continue from them (their m, v and step counts; restore "
                    "the model's weights too, e.g. from the extra= of opt.checkpoint), or "
                    "overwrite=True to delete them and start afresh")
            states = []
            for k, (gi, pj, p, path, dt, c) in enumerate(own):  # pass 2: open or create
                if found[k] is not None:
                    st = reopen(path, access=self._access, memory=self._memory,
                                unclean=self._unclean, **expect[k])
                else:
                    st = dsa_core.create(path, p.shape[0], p.shape[1], weights=False,
                                         dtype=dt.name, access=self._access,
                                         nonfinite=self._nonfinite or "propagate",
                                         overwrite=self._overwrite, **self._kind(),
                                         **self._create_kw(self._hparams(self.param_groups[gi]),
                                                           c))
                    created.append(path)
                opened.append(st)
                if self._nonfinite is not None and st.nonfinite != self._nonfinite:
                    st = st._replace(nonfinite=self._nonfinite)  # recorded at the next flush
                states.append(st)
        except BaseException:
            for st in opened:
                dsa_core.close(st)
            for path in created:
                dsa_core.remove(path)
            if new_lock is not None:
                new_lock.release()
            raise
        if new_lock is not None:
            self._owned.lock = new_lock
        k = 0
        for gi, pj, p, path, _, _ in plan:
            if path is None:
                h = p._dsa_handle
                h.borrower = weakref.ref(self)
                slot = _Slot(str(h.state.path), h, False)
            else:
                h = SharedState(states[k])
                k += 1
                self._owned.handles.append(h)
                slot = _Slot(path.name, h, True)
            self._slots[p] = slot
            if h.state.count:
                self.state[p]["step"] = h.state.count
        self._regroup()

    def _regroup(self, fresh: bool = False) -> None:
        """Make this optimizer's stores one commit group (``dsa_core.join``): they step all
        or nothing and commit together, so that after a crash they reopen at the same step.
        A group that finds its stores at different steps (they did not stop together) is
        not formed: :meth:`step` and :meth:`flush` then refuse, until
        :meth:`load_checkpoint` restores them (``fresh``: a new group after that)."""
        old, self._group = self._group, None
        self._owned.group = None
        if old is not None:
            old.close()
        states = [s.handle.state for s in self._ordered_slots() if not s.handle.closed]
        self._mismatch = None
        if len(states) < 2:
            return
        file = None
        if self.state_dir is not None:  # every table a DiskEmbedding: nothing made it yet
            self.state_dir.mkdir(parents=True, exist_ok=True)
            file = self.state_dir / dsa_core.tools.GROUP_FILE
        try:
            self._group = dsa_core.join(states, file, fresh=fresh)
        except dsa_core.GroupMismatchError as exc:
            self._mismatch = str(exc)
        self._owned.group = self._group

    def _check_in_step(self) -> None:
        if self._mismatch is not None:
            raise dsa_core.GroupMismatchError(
                f"{self._NAME}: {self._mismatch}. Nothing was written; "
                "opt.load_checkpoint(dir) restores every store from a checkpoint")

    # -- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step (as ``torch.optim.SparseAdam.step``).

        Every gradient is checked (and coalesced and copied to the host) before any store
        is written, so a bad gradient raises with nothing changed. Raises ``RuntimeError``
        for a dense gradient (torch's message), ``ValueError`` for a gradient whose
        ``sparse_dim`` is not 1 or whose rows do not fit a log store's memory region, and
        ``FloatingPointError`` for a NaN or Inf in the gradient of a store with
        ``nonfinite="raise"``.
        """
        self._check_open()
        # DSA's kernels take torch's thread count (torch.set_num_threads, OMP_NUM_THREADS)
        # unless the user set DSA's own (dsa_core.set_num_threads, DSA_NUM_THREADS)
        dsa_core.tools.follow_threads(torch.get_num_threads())
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs: list[_Job] = []
        devices = set()
        for gi, group in enumerate(self.param_groups):
            hp = None
            for pj, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if hp is None:
                    hp = self._hparams(group)
                job = self._prepare(p, f"parameter [{gi}, {pj}]", hp)
                if job.idx_dev.device.type == "cuda":
                    devices.add(job.idx_dev.device)
                jobs.append(job)
        for dev in devices:  # the non_blocking copies to pinned memory must have landed
            torch.cuda.current_stream(dev).synchronize()
        for job in jobs:  # refuse before *any* store is written
            # a log store's region must hold the batch's rows (the core would refuse it only
            # when its turn comes, after the stores before it had been stepped)
            dsa_core.check_batch(job.slot.handle.state, job.host[0].numpy())
            if job.slot.handle.state.nonfinite == "raise":
                vals = job.host[1].numpy()
                if not np.isfinite(vals).all():
                    bad = job.host[0].numpy()[~np.isfinite(vals).all(axis=1)]
                    raise FloatingPointError(
                        f"the gradient of {job.where} holds NaN or Inf for row(s) "
                        f"{bad[:10].tolist()}; nothing was written (nonfinite='raise'). Use "
                        "nonfinite='skip_row' to skip such rows")
        self._check_in_step()
        updates = [self._update(job) for job in jobs]
        # one step over every store: all or nothing (an error or a Ctrl-C never leaves
        # them one step apart), recorded by their group (dsa_core.step_many)
        def adopt(new):
            for job, st in zip(jobs, new, strict=True):
                self._after(job, st)

        with dsa_core.tools.deferred_sigint():  # a Ctrl-C waits until the handles are updated too
            dsa_core.tools.step_many_into(updates, adopt)  # (also a step that stood in doubt)
        return loss

    def _prepare(self, p: torch.Tensor, where: str, hp: tuple) -> _Job:
        g = p.grad
        if g.layout == torch.strided:
            if isinstance(p, DiskWeight):
                raise RuntimeError(
                    f"{self._TORCH} does not support dense gradients: {where} is the weight of "
                    f"a {p._dsa_what}, and it got a dense gradient because the loss read "
                    "emb.weight as a whole (e.g. a regularizer such as "
                    "emb.weight.pow(2).sum()), which gives every row a gradient. Apply such "
                    "terms to the rows the forward returns (emb(ids)); nothing was written")
            raise RuntimeError(f"{self._TORCH} does not support dense gradients, please "
                               f"consider {self._DENSE} instead")
        if g.layout != torch.sparse_coo:
            raise ValueError(f"{self._NAME} needs sparse COO gradients; {where} has a "
                             f"{g.layout} gradient. Convert it with grad.to_sparse_coo()")
        if g.sparse_dim() != 1:
            raise ValueError(
                f"{self._NAME} updates whole rows: the gradient of {where} must have "
                f"sparse_dim == 1 (row ids + dense rows, as nn.Embedding(sparse=True) "
                f"gives), got sparse_dim={g.sparse_dim()}. Build it as "
                "torch.sparse_coo_tensor(row_ids[None], rows, size), or convert it with "
                "grad.to_dense().to_sparse(sparse_dim=1)")
        if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
            raise ValueError(f"the gradient of {where} is {tuple(g.shape)} {g.dtype} on "
                             f"{g.device}, the parameter {tuple(p.shape)} {p.dtype} on "
                             f"{p.device}")
        slot = self._slots[p]
        if slot.handle.closed:
            raise RuntimeError(f"the store of {where} ({str(slot.handle.state.path)!r}) is "
                               "closed")
        _check_catch_up(slot.handle.state, hp[5], f"{self._NAME} {where}")
        raw = g._indices()[0]
        if raw.numel():  # before coalesce(): torch's coalesce corrupts memory on a negative id
            lo, hi = (int(v) for v in torch.aminmax(raw))  # one sync on CUDA
            if lo < 0 or hi >= p.shape[0]:
                raise IndexError(f"the gradient of {where} has row ids {lo}..{hi}; they must "
                                 f"lie in [0, {p.shape[0]})")
        # torch's own duplicate sums: bit-identical inputs (docs/algorithms.md §1.1). A CPU
        # batch whose ids occur at most twice is handed over as it is (uncoalesced, in its
        # own order): rows are independent, and a sum of two is the same in either order,
        # which dsa_core takes as torch does (the first copied, the second added). That saves
        # coalesce's sort and copy (docs/notebook.md). Rows updated through index_copy_ (a
        # CUDA or strided table) must be unique: coalesced as before.
        if (raw.device.type == "cpu" and not g.is_coalesced()
                and g.dtype in (torch.float32, torch.float64)
                and (not slot.owned or _in_place(p))
                and dsa_core.tools.max_repeats(raw.numpy()) <= 2):
            idx = raw
            vals = g._values().contiguous()
        else:
            c = g.coalesce()
            idx = c._indices()[0]
            vals = c._values()
        dev = [idx, vals]
        if slot.owned and not _in_place(p):
            dev.append(p.detach().index_select(0, idx))
        host, _ = to_host(dev)
        return _Job(p, where, slot, hp, idx, host)

    def _update(self, job: _Job) -> tuple:
        """``(state, idx, grad, kwargs)`` of ``job`` for ``dsa_core.step_many``."""
        lr = job.hp[0]
        # the store records the settings this step uses (`dsa info`, a resume): lr too
        st = self._with_hparams(job.slot.handle.state, job.hp)
        idx, vals = job.host[0].numpy(), job.host[1].numpy()
        if job.slot.owned and len(job.host) == 2:  # a CPU table: its rows updated in place
            return st, idx, vals, {"lr": lr, "table": job.p.detach().numpy()}
        if job.slot.owned:
            return st, idx, vals, {"lr": lr, "params": job.host[2].numpy()}
        return st, idx, vals, {"lr": lr}

    def _after(self, job: _Job, st: dsa_core.State) -> None:
        """What follows the step of ``job``'s store (its new State ``st``)."""
        h = job.slot.handle
        h.state = st
        if job.slot.owned and len(job.host) == 2:
            torch.autograd.graph.increment_version(job.p)  # autograd sees it, as after add_
        elif job.slot.owned:
            job.p.index_copy_(0, job.idx_dev, to_device(job.host[2], job.p.device))
        self.state[job.p]["step"] = h.state.count

    # -- inspection, durability, life cycle -----------------------------------------------
    def store_for(self, p: torch.Tensor) -> dsa_core.State:
        """The current ``dsa_core.State`` of parameter ``p`` (``.exp_avg``, ``.exp_avg_sq``,
        ``.count``; a log store has no whole-table views: ``dsa_core.read_records``).

        A value, not a live handle: the next :meth:`step` makes a new State and this one
        outdated. Its rows stay readable (the same mapped views), but ``dsa_core.step``,
        ``flush`` or ``checkpoint`` on it raise ``dsa_core.StaleStateError`` (they would
        record an old count beside newer rows); call ``store_for`` again.
        """
        try:
            return self._slots[p].handle.state
        except KeyError:
            raise KeyError("that tensor is not a parameter of this optimizer") from None

    def prefetch(self, ids, param: torch.Tensor | None = None) -> None:
        """Start reading the state rows ``ids`` (e.g. the next batch) into the page cache.

        A hint for out-of-core tables (``dsa_core.prefetch``, in the background); results
        never change. ``param`` selects the table; it may be omitted when the optimizer has
        a single parameter.
        """
        if param is None:
            if len(self._slots) != 1:
                raise ValueError("this optimizer has several parameters: pass param=")
            param = next(iter(self._slots))
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().reshape(-1).cpu().numpy()
        dsa_core.prefetch(self.store_for(param), ids)

    @property
    def stores(self) -> dict[str, dsa_core.State]:
        """Store name -> current ``dsa_core.State``, in parameter order (see :meth:`store_for`)."""
        return {s.name: s.handle.state for s in self._ordered_slots()}

    def _ordered_slots(self) -> list[_Slot]:
        return [self._slots[p] for g in self.param_groups for p in g["params"]]

    def flush(self) -> None:
        """Make every step so far durable: msync each store and rewrite its manifest."""
        self._check_open()
        self._check_in_step()
        dsa_core.flush_many([s.handle.state for s in self._ordered_slots()
                             if not s.handle.closed])

    def close(self) -> None:
        """Flush and close this optimizer's stores and release ``state_dir``. Safe twice.

        DiskEmbedding stores stay open (their module owns them). Any later use raises.
        """
        if self._closed:
            return
        self._closed = True
        if self._group is not None:  # one commit of every store, then each closes alone
            group, self._group = self._group, None
            self._owned.group = None
            group.close()
        for s in self._slots.values():
            if not s.owned and s.handle.borrower is not None \
                    and s.handle.borrower() is self:
                s.handle.borrower = None
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self._NAME} is closed; to continue, create a new one "
                               "on the same state_dir with resume=True (it reopens the "
                               "stores)")

    def __getstate__(self):
        raise TypeError(f"{self._NAME} cannot be pickled or deep-copied: its state lives in "
                        "stores on disk. Save it with opt.checkpoint(dest) and resume with "
                        "opt.load_checkpoint(dest)")

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, dest_dir, *, overwrite: bool = False,
                   extra: dict[str, Any] | None = None) -> Path:
        """Write a consistent snapshot of the optimizer to ``dest_dir``; training goes on.

        ``dest_dir`` receives one ``dsa_core.checkpoint`` per parameter, named as in
        ``state_dir`` (``group{i}_param{j}``; a :class:`DiskEmbedding`'s store, weights
        included, under the name of its position too), ``optimizer.pt``: this optimizer's
        :meth:`state_dict` whose ``"dsa_manifest"`` points at those snapshots, and, if
        ``extra`` is given, ``extra.pt``. Everything is built in a temporary sibling
        directory, fsync'd, and renamed into place at once, so a crash (``kill -9``, power
        loss) at any moment leaves either no ``dest_dir`` or a complete one (at worst a
        ``<dest_dir>.tmp-<pid>`` leftover), and an error while writing leaves ``dest_dir``
        as it was. Replacing an existing checkpoint needs ``overwrite=True`` (swapped
        atomically where the filesystem allows).

        Resume with :meth:`load_checkpoint` on an optimizer built the same way (it copies the
        snapshots into that optimizer's stores), or build the optimizer with
        ``state_dir=dest_dir, resume=True`` (it then trains *in* the checkpoint, which stops
        being one).

        Parameters
        ----------
        dest_dir : str or Path
            The checkpoint directory; neither a live store nor one containing ``state_dir``.
        overwrite : bool, default False
            Replace an existing ``dest_dir``.
        extra : dict, optional
            What else a resumed run needs, typically ``{"model": model.state_dict(),
            "sched": scheduler.state_dict()}`` (the weights of ordinary parameters are the
            model's, not the optimizer's). Saved with ``torch.save`` inside the same atomic
            directory, so it can never disagree with the stores, and returned by
            :meth:`load_checkpoint`. It must load with ``torch.load(weights_only=True)``
            (tensors, dicts, lists, numbers, strings): that is checked before the checkpoint
            is committed, so a checkpoint that could not be resumed is never written.
            Every state-dict snapshot that ``extra`` names (a :class:`DiskEmbedding`'s
            ``_extra_state``, an optimizer state dict) travels with the checkpoint: it is
            hard-linked into ``dest_dir/snapshots/<id>`` (copied, or reflinked, across
            filesystems) and the saved entry names it relative to ``dest_dir``, so the
            checkpoint restores after any number of later state dicts (which prune the
            originals), after ``state_dir`` is deleted, and after ``dest_dir`` is moved or
            copied. The dict you pass is not modified.

        Returns
        -------
        Path
            ``dest_dir``.
        """
        self._check_open()
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict of what to save with the checkpoint (e.g. "
                            f"{{'model': model.state_dict()}}), got {type(extra).__name__}")
        dest = Path(dest_dir)
        dest_r = dest.resolve()
        slots = []
        for gi, group in enumerate(self.param_groups):
            for pj, p in enumerate(group["params"]):
                s = self._slots[p]
                if s.handle.closed:
                    raise RuntimeError(f"the store of parameter [{gi}, {pj}] "
                                       f"({str(s.handle.state.path)!r}) is closed")
                slots.append((f"group{gi}_param{pj}", s))
        # checked here, before anything is flushed or written; committed below
        staged = dsa_core.checkpoint_many(
            dest, {name: s.handle.state for name, s in slots}, overwrite=overwrite,
            live=[] if self.state_dir is None else [self.state_dir])
        carried: list = []
        if extra is not None:  # the snapshots its state dicts name travel with it
            extra, carried = carry_plan(extra, f"{self._NAME}.checkpoint")
        sd = self._describe()  # flushes every store; the checkpoint holds the snapshots
        man = sd[MANIFEST_KEY]
        man["checkpoint"] = str(dest_r)
        man["extra"] = EXTRA_FILE if extra is not None else None
        for e, (name, _) in zip(man["params"], slots):
            e["snapshot"] = name
            e["path"] = str(dest_r / name)
        with staged as tmp:  # the stores' snapshots are in it
            if extra is not None:
                carry_into(carried, tmp)
                _save_durably(extra, tmp / EXTRA_FILE)
                _check_loadable(tmp / EXTRA_FILE)
            _save_durably(sd, tmp / CHECKPOINT_FILE)
        return dest

    def load_checkpoint(self, src_dir) -> dict[str, Any]:
        """Resume from a checkpoint written by :meth:`checkpoint`; returns its ``extra``.

        The optimizer must have the same parameters (order, shapes, dtypes, curvatures) as
        the one that wrote it; the directory may have moved. Every snapshot is checked
        before anything is written; then its rows (m and v, and the weights of a
        :class:`DiskEmbedding`) are copied into this optimizer's stores, the step counts
        and param groups (lr, betas, weight_decay, ...) are restored, and the stores are
        flushed. The checkpoint itself is never modified.

        Returns
        -------
        dict
            The ``extra`` given to :meth:`checkpoint` (``{}`` if there was none). The
            weights of ordinary parameters are the model's: restore them from it, e.g.
            ``model.load_state_dict(extra["model"])``, after this call. The snapshots its
            state dicts name (a :class:`DiskEmbedding`'s) are those the checkpoint carries:
            the returned ``extra`` names them inside ``src_dir``, wherever it now is.
        """
        self._check_open()
        src = Path(src_dir)
        f = src / CHECKPOINT_FILE
        if not f.is_file():
            raise FileNotFoundError(
                f"{str(src)!r} is not a {self._NAME} checkpoint: it has no {CHECKPOINT_FILE}; "
                "write one with opt.checkpoint(dest_dir)")
        sd = torch.load(f, weights_only=True)
        man = sd.get(MANIFEST_KEY) if isinstance(sd, dict) else None
        if not isinstance(man, dict) or "checkpoint" not in man:
            raise ValueError(f"{str(f)!r} is not a {self._NAME} checkpoint state dict (no "
                             f"{MANIFEST_KEY!r} with a 'checkpoint' entry)")
        extra: dict[str, Any] = {}
        if man.get("extra"):
            extra = torch.load(src / str(man["extra"]), weights_only=True)
            extra = resolve_carried(extra, src)  # its state dicts' snapshots: inside src
        man["checkpoint"] = str(src.resolve())
        self.load_state_dict(sd)
        return extra

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"dsa_manifest"``; flushes every store first.

        Per-parameter state holds only ``{"step": t}``; m and v stay in the stores, and the
        manifest says which. Each store, of either kind, is snapshotted as it is now
        (``dsa_core.checkpoint`` into ``.dsa-snapshots/`` beside the store) and the manifest
        names the snapshot, so ``torch.save(opt.state_dict(), f)`` is a checkpoint in
        torch's sense: :meth:`load_state_dict` of it, later or in a new process, restores
        exactly this point (rows, m, v, counts, param groups) while the snapshot is kept
        (the newest ``keep_snapshots`` per store, see :meth:`release_snapshots`). The kind
        sets only the cost: a log store links its immutable segments and copies its index
        (small); an in-place store reflinks its data file where the filesystem supports it,
        else links the files of its last snapshot and writes the rows changed since (the
        first snapshot after an open, and one whose deltas would outgrow the table, is a
        full copy: about the time of reading and writing it once). With
        ``keep_snapshots=0`` no snapshot is taken: the state dict describes the stores
        *now*, and after further steps :meth:`load_state_dict` refuses it.
        """
        sd = self._describe()
        if self._keep_snapshots:
            for e, s in zip(sd[MANIFEST_KEY]["params"], self._ordered_slots()):
                st = s.handle.state
                if rows_fit(st):  # a small table: its records here, as SparseAdam's moments
                    e["state_rows"] = torch.from_numpy(all_records(st))
                else:
                    e["state_snapshot"] = take(st, "opt", self._keep_snapshots)
        return sd

    def release_snapshots(self, keep: int = 0) -> int:
        """Delete the state-dict snapshots this optimizer's kind of taker made of its
        stores, but the newest ``keep`` per store; returns how many were deleted.

        State dicts that name a deleted snapshot can no longer be loaded (a clear error
        says so). Checkpoints written by :meth:`checkpoint` are not touched. A snapshot
        that a writer holds (someone resumed training in it) is kept.
        """
        self._check_open()
        keep = check_keep(keep, f"{self._NAME}.release_snapshots")
        return sum(release(s.handle.state.path, "opt", keep) for s in self._ordered_slots())

    def _describe(self) -> dict[str, Any]:
        """:meth:`state_dict` without snapshots: the manifest of the live stores (flushed)."""
        self.flush()
        sd = super().state_dict()
        entries = []
        for gi, group in enumerate(self.param_groups):
            for pj, p in enumerate(group["params"]):
                s = self._slots[p]
                st = s.handle.state
                entries.append({
                    "group": gi, "index": pj, "name": s.name, "path": str(st.path),
                    "owned": s.owned, "count": int(st.count), "num_rows": st.num_rows,
                    "dim": st.dim, "dtype": st.dtype.name, "curvature": st.curvature,
                    "second_moment": st.second_moment, "first_moment": st.first_moment,
                    **row_options(st), "optimizer": st.optimizer,
                    "hparams": self._describe_hparams(st)})
        sd[MANIFEST_KEY] = {"format": _MANIFEST_FORMAT, "version": 1,
                            "state_dir": None if self.state_dir is None
                            else str(self.state_dir.resolve()),
                            "params": entries}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, a checkpoint, or torch's SparseAdam.

        A DSA state dict (with ``"dsa_manifest"``) holds no rows: m and v stay in the
        stores. Each entry is matched to the parameter in the same position (same shape,
        dtype, curvature, moment layout and per-row options). An entry names the snapshot
        :meth:`state_dict` took (on either store kind): its records (m, v, and a
        DiskEmbedding's weights) and step count are copied back into the store, so the
        optimizer is exactly where it was when the state dict was taken, whatever happened
        since (``dsa_core.restore``: it reads and writes the whole table). A snapshot that
        is gone (deleted by newer state dicts beyond ``keep_snapshots``, or by
        :meth:`release_snapshots`) is refused with a ``ValueError`` that says so. An entry
        without a snapshot (``keep_snapshots=0``, or a state dict written before in-place
        stores took snapshots) is a description: its step count must equal the store's,
        and one taken at step 5 of stores now at step 25 is **refused** with a
        ``ValueError`` (loading it would pair count 5 with the moments of step 25), nothing
        changed; one that matches (no step since it was taken) loads. Either way the param
        groups (lr, betas, weight_decay, ... as schedulers left them) are restored. Stores
        and snapshots are found by this optimizer's stores (a moved directory is fine).

        The state dict of a checkpoint (``optimizer.pt`` from :meth:`checkpoint`) brings
        the rows too: each snapshot store is copied into this optimizer's store.

        A ``torch.optim.SparseAdam`` or geoopt state dict (no manifest): the saved
        ``exp_avg`` / ``exp_avg_sq`` tensors and step counts are copied into the stores
        (reduced stores: row mean of ``exp_avg_sq``, nearest bfloat16 of ``exp_avg``). Its
        param groups have no ``weight_decay`` / ``decoupled_weight_decay``: this optimizer's
        values are kept. A ``decay_missed_steps`` store counts the missed decay from the
        imported step on (SparseAdam decayed nothing); a ``per_row_step`` store refuses it
        (one global step cannot give each row its own count).

        All checks run before anything is changed.
        """
        self._check_open()
        sd = dict(state_dict)
        manifest = sd.pop(MANIFEST_KEY, None)
        params = [p for g in self.param_groups for p in g["params"]]
        saved_groups = sd.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups) or any(
                len(a["params"]) != len(b["params"])
                for a, b in zip(saved_groups, self.param_groups)):
            raise ValueError("loaded state dict has a different number of parameter groups, "
                             "or a group of a different size")
        ids = [i for g in saved_groups for i in g["params"]]
        saved_state = sd.get("state", {})
        for gi, (sg, g) in enumerate(zip(saved_groups, self.param_groups)):
            decoupled = sg.get("decoupled_weight_decay", g.get("decoupled_weight_decay"))
            for pj, p in enumerate(g["params"]):
                st = self._slots[p].handle.state
                if st.decay_missed_steps and not decoupled:
                    raise ValueError(
                        f"{self._NAME}.load_state_dict: param group {gi} of the state dict "
                        "has decoupled_weight_decay=False, but the store of parameter "
                        f"[{gi}, {pj}] ({str(st.path)!r}) was created with "
                        "decay_missed_steps=True, which needs decoupled weight decay; "
                        "nothing was changed")
        snaps = [None] * len(params)
        if manifest is not None:
            entries = manifest.get("params", []) if isinstance(manifest, dict) else []
            if len(entries) != len(params):
                raise ValueError(f"the dsa_manifest lists {len(entries)} stores, this "
                                 f"optimizer has {len(params)} parameters")
            counts = []
            for e, p in zip(entries, params):
                st = self._slots[p].handle.state
                have = (st.num_rows, st.dim, st.dtype.name, st.curvature)
                want = (e["num_rows"], e["dim"], e["dtype"], e["curvature"])
                want_opt = e.get("optimizer", "adam")  # written since Adagrad stores exist
                if st.optimizer != want_opt:
                    raise ValueError(
                        f"{self._NAME}.load_state_dict: checkpoint store {e['name']!r} holds "
                        f"{want_opt}'s state (optimizer={want_opt!r}), but the parameter in "
                        f"its position has a store of optimizer={st.optimizer!r}; load it "
                        "into the optimizer that wrote it. Nothing was changed")
                if have != want:
                    raise ValueError(
                        f"checkpoint store {e['name']!r} is {want[0]} x {want[1]} {want[2]} "
                        f"with curvature {want[3]}, but the parameter in its position has "
                        f"a {have[0]} x {have[1]} {have[2]} store with curvature {have[3]}")
                want_sm = e.get("second_moment",  # written since rowwise stores exist
                                "riemannian" if e["curvature"] > 0 else "elementwise")
                if st.second_moment != want_sm:
                    raise ValueError(
                        f"checkpoint store {e['name']!r} keeps a {want_sm} second moment, but "
                        f"the parameter in its position has a {st.second_moment} store; "
                        "build the optimizer with the checkpoint's second_moment")
                want_fm = e.get("first_moment", "full")
                if st.first_moment != want_fm:
                    raise ValueError(
                        f"checkpoint store {e['name']!r} keeps m as {want_fm!r}, but the "
                        f"parameter in its position has a store with {st.first_moment!r}; "
                        "build the optimizer with the checkpoint's first_moment")
                have_ro = row_options(st)  # written since per-row options exist
                want_ro = {k: bool(e.get(k, False)) for k in have_ro}
                bad = [k for k in have_ro if have_ro[k] != want_ro[k]]
                if bad:
                    raise ValueError(
                        f"checkpoint store {e['name']!r} was created with "
                        + ", ".join(f"{k}={want_ro[k]}" for k in bad)
                        + ", but the parameter in its position has a store with "
                        + ", ".join(f"{k}={have_ro[k]}" for k in bad)
                        + "; build the optimizer with the checkpoint's "
                        + " and ".join(bad) + ". Nothing was changed")
                counts.append(int(e["count"]))
            if manifest.get("checkpoint") is not None:
                snaps = self._open_snapshots(Path(manifest["checkpoint"]), entries, params)
            else:  # a state dict names its snapshots (unless keep_snapshots=0)
                snaps = self._open_state_snapshots(entries, params)
            try:
                self._check_counts(entries, params, counts, snaps)
            except BaseException:
                _close_all(snaps)
                raise
        else:
            counts = self._import_torch_state(params, ids, saved_state)
        new_state = {}
        for i, cnt in zip(ids, counts):
            if cnt:
                new_state[i] = {"step": cnt}
        sd["state"] = new_state
        curvatures = [g["curvature"] for g in self.param_groups]
        # A SparseAdam (or geoopt) state dict has no weight decay: its groups keep this
        # optimizer's values for the keys they lack, rather than losing them
        kept = [{k: g[k] for k in self._kept_keys if k not in sg and k in g}
                for g, sg in zip(self.param_groups, saved_groups)]
        if self._group is not None:  # restored one by one: no group commit in between
            group, self._group = self._group, None
            self._owned.group = None
            group.close()
        try:
            super().load_state_dict(sd)
            for p, snap in zip(params, snaps):
                if snap is not None:
                    h = self._slots[p].handle
                    h.state = restore_from(h.state, snap)
        finally:
            _close_all(snaps)
        for g, c, k in zip(self.param_groups, curvatures, kept):
            g["curvature"] = c  # fixed by the stores (a SparseAdam checkpoint has none)
            g.update(k)
        for p, cnt, snap in zip(params, counts, snaps):
            h = self._slots[p].handle
            if snap is None and h.state.count != cnt:  # imported from a torch state dict
                h.state = dsa_core.set_count(h.state, cnt)
        self._regroup(fresh=True)  # restored together: they commit together again

    def _check_counts(self, entries: list, params: list, counts: list, snaps: list) -> None:
        """``ValueError`` unless every store whose rows stay has the state dict's count."""
        for gp, (e, p, cnt, snap) in enumerate(zip(entries, params, counts, snaps)):
            st = self._slots[p].handle.state
            if snap is not None or st.count == cnt:
                continue
            where = f"parameter [{e.get('group', '?')}, {e.get('index', gp)}]"
            raise ValueError(
                f"{self._NAME}.load_state_dict: this state dict was taken at step {cnt} of "
                f"{where} (store {e.get('name')!r}), but that store {str(st.path)!r} is at "
                f"step {st.count}. A state dict holds no rows (m and v stay in the stores and "
                f"kept moving), so loading it would pair step {cnt} with the moments of step "
                f"{st.count}; nothing was changed. This state dict names no snapshot "
                "(taken with keep_snapshots=0, or by a version that snapshotted log stores "
                "only): keep the default keep_snapshots=3, whose "
                "state dicts snapshot the stores and load as checkpoints, or write one with "
                "opt.checkpoint(dest) (extra={'model': model.state_dict(), ...} carries the "
                "rest) and resume with opt.load_checkpoint(dest)")

    def _open_state_snapshots(self, entries: list, params: list) -> list:
        """The snapshots a :meth:`state_dict` names, opened read-only and checked (None
        where an entry names none: ``keep_snapshots=0``). All or nothing."""
        def one(gp, e, h):
            where = (f"{self._NAME}.load_state_dict: parameter [{e.get('group', '?')}, "
                     f"{e.get('index', gp)}]")
            if e.get("state_rows") is not None:  # a small table's records, in the state dict
                return check_rows(e["state_rows"], _live(h, gp), where, int(e["count"]))
            saved = e.get("state_snapshot")
            if saved is None:
                return None
            return open_saved(saved, _live(h, gp), f"{self._NAME}.load_state_dict: "
                              f"parameter [{e.get('group', '?')}, {e.get('index', gp)}]",
                              int(e["count"]), f"keep_snapshots={self._keep_snapshots} here")
        return self._open_each(entries, params, one)

    def _open_snapshots(self, root: Path, entries: list, params: list) -> list:
        """Open and check every snapshot store of a checkpoint manifest (read-only).

        Returns one ``dsa_core.State`` per parameter, or None where the optimizer already
        trains in that very store (``state_dir=`` the checkpoint). All or nothing.
        """
        def one(gp, e, h):
            live = _live(h, gp)
            name = e.get("snapshot")
            if not name:
                raise ValueError(f"the checkpoint manifest entry {gp} names no snapshot store")
            src = root / str(name)
            if src.resolve() == live.path.resolve():
                return None
            return open_snapshot(src, live, f"checkpoint store {name!r}",
                                 count=int(e["count"]))
        return self._open_each(entries, params, one)

    def _open_each(self, entries: list, params: list, one) -> list:
        """``one(position, entry, handle)`` for each parameter: a snapshot opened read-only,
        or None. All or nothing: on an error the snapshots opened so far are closed."""
        snaps: list = []
        try:
            for gp, (e, p) in enumerate(zip(entries, params)):
                snaps.append(one(gp, e, self._slots[p].handle))
        except BaseException:
            _close_all(snaps)
            raise
        return snaps

    def _import_torch_state(self, params, ids, saved_state) -> list[int]:
        """Copy a torch/geoopt per-parameter state (step, exp_avg, exp_avg_sq) into stores."""
        todo = []
        for p, i in zip(params, ids):
            s = saved_state.get(i, {})
            st = self._slots[p].handle.state
            if st.per_row_step and ("exp_avg" in s or int(torch.as_tensor(s.get("step", 0)))):
                raise ValueError(
                    f"{self._NAME}.load_state_dict: the store {str(st.path)!r} was created "
                    "with per_row_step=True, which keeps each row's own step count; a "
                    "torch.optim.SparseAdam state dict has only one global step, so the rows' "
                    "counts cannot be recovered from it. Import it into a store created "
                    "without per_row_step; nothing was changed")
            if "exp_avg" not in s and "sum" in s:
                raise ValueError(
                    f"{self._NAME}.load_state_dict: the state of parameter {i} holds sum (an "
                    "Adagrad state dict); this optimizer's stores hold Adam's moments. Load it "
                    "into DiskSparseAdagrad; nothing was changed")
            if "exp_avg" not in s:
                todo.append((st, int(s.get("step", 0)), None, None))
                continue
            m = torch.as_tensor(s["exp_avg"]).detach().cpu()
            v = torch.as_tensor(s["exp_avg_sq"]).detach().cpu()
            if tuple(m.shape) != (st.num_rows, st.dim) or m.shape != v.shape:
                raise ValueError(f"saved exp_avg of shape {tuple(m.shape)} does not fit the "
                                 f"{st.num_rows} x {st.dim} store {str(st.path)!r}")
            if st.curvature > 0:
                v = v[:, :1]  # geoopt repeats the per-row scalar over the d columns
            elif st.second_moment == "rowwise":
                # Exact: a row's coordinates are always updated together, so the EMA of
                # mean(g^2) that row-wise v keeps is the row mean of SparseAdam's v.
                v = v.double().mean(dim=1, keepdim=True)
            todo.append((st, int(torch.as_tensor(s.get("step", 0))), m, v))
        # Through the stores' write paths on both kinds (never the whole-table views: rows
        # written through a view are seen by no undo record, so a kill -9 in the import
        # could not be rolled back, and by no snapshot delta)
        for st, t, m, v in todo:
            lay = st.layout
            if m is not None:
                st.set_exp_avg(m.numpy())  # cast to the store (bfloat16 m: to nearest)
                vn = v.numpy()
                set_columns(st, lay["v"], lay["v_width"], lambda lo, hi: vn[lo:hi])
            if st.decay_missed_steps:
                # SparseAdam decayed nothing: no row has missed a decay before step t
                set_columns(st, lay["last_step"], 1, lambda lo, hi: t, as_int=True)
        return [t for _, t, _, _ in todo]


_install_guard()  # torch.optim optimizers refuse DSA's objects with DSA's message
