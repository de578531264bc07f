"""``step`` and ``gather``: validate and canonicalise, then hand arrays to a kernel.

All policy lives here (coalescing, bias correction, which kernel, threads); the kernels see
arrays only, their hyperparameters packed into one array by the ``*_hparams`` function that
sits beside each kernel. Every check runs before any kernel touches the mapped rows, so a
rejected call leaves the store byte-identical.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import _pool
from ._claim import control, spin, spin_for_job, spin_until_done
from ._coalesce import bounds, coalesce, gather_rows, is_strictly_increasing
from ._engine import Engine, closed_error, scratch
from ._engines import ENGINES, warmup_engines
from ._files import InDoubtError
from ._intrinsics import NO_OPTIONS, WD_DECOUPLED, WD_L2, WD_NONE, options_array
from ._kernels_adagrad import adagrad_hparams, adagrad_rows, rowwise_adagrad_options_kernel
from ._kernels_euclid import (
    adam_rows_euclid,
    adam_rows_euclid_bf16m,
    adam_rows_euclid_rowwise,
    euclid_bf16m_options_kernel,
    euclid_hparams,
    euclid_options_kernel,
    euclid_rowwise_options_kernel,
)
from ._kernels_poincare import adam_rows_poincare, poincare_hparams, poincare_options_kernel
from ._state import State, maxnorm, require_current, state_meta
from ._validation import as_index, check_lr, check_weight_decay

__all__ = ["StepPlan", "abort_step", "as_index", "begin_step", "commit_step", "gather",
           "in_doubt", "plan_step", "run_step", "step", "warmup"]


def refuse_batch(st: Engine, n: int) -> None:
    """Raise the ``ValueError`` of a step of ``n`` distinct rows, more than ``info.max_batch``
    (called before anything changes): they do not fit the store's memory budget (a log
    store's region), and the kind's error (``check_batch``) says what ``memory=`` would
    hold them."""
    ENGINES[st.kind].check_batch(st.layout.as_dict(), st.info.memory_bytes or 0, int(n))
    raise ValueError(f"store {str(st.path)!r} steps at most {st.info.max_batch} distinct rows "
                     f"at once, got {int(n)}")


def _as_rows(a: Any, n: int, dim: int, dtype: np.dtype, name: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != dtype:
        raise TypeError(f"{name} must have the store dtype {dtype.name}, got {arr.dtype}; "
                        f"convert with {name}.astype(np.{dtype.name})")
    if arr.shape != (n, dim):
        raise ValueError(f"{name} must have shape (len(idx), dim) = ({n}, {dim}), got "
                         f"{arr.shape}")
    return read_only(np.ascontiguousarray(arr))


def read_only(a: np.ndarray) -> np.ndarray:
    """``a``, or a read-only view of it: the kernels never write a gradient, and numba
    compiles a separate specialisation of every kernel for read-only and writeable arrays
    (``np.asarray`` of a JAX array is read-only, a torch or NumPy gradient writeable), so the
    step hands them gradients of one kind only: half the compiling, at first use and in
    :func:`warmup`."""
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


def step(state: State, idx: Any, grad: Any, *, lr: float | None = None,
         params: np.ndarray | None = None, table: np.ndarray | None = None) -> State:
    r"""One lazy Adam step on the rows ``idx`` of the store, **in place**; returns ``count + 1``.

    Parameters
    ----------
    state : State
        From :func:`create` or :func:`open` (or a previous ``step``).
    idx : array-like of int, shape (B,)
        Row ids; duplicates are allowed and their gradients summed (in order of appearance).
        ``B = 0`` is legal and still counts a step (as torch and geoopt do).
    grad : array-like, shape (B, dim), the store dtype
        Gradient rows, one per id.
    lr : float, optional
        Learning rate for this step (schedules); defaults to ``state.lr``. May be 0 (warm-up
        schedules): the moments still advance, the weights stay put.
    params : ndarray, shape (B, dim), store dtype, writeable
        Only for ``weights=False`` stores: the current weight rows for ``idx`` (row ``k`` is
        the weight of ``idx[k]``). They are updated in place; duplicate ids all receive the
        new row.
    table : ndarray, shape (num_rows, dim), store dtype, C-contiguous, writeable
        Only for ``weights=False`` stores, instead of ``params``: the whole weight table
        (e.g. ``param.detach().numpy()`` of a CPU embedding). Rows ``idx`` are updated in
        place, no rows are copied out and back.

    Returns
    -------
    State
        ``state._replace(count=state.count + 1)``. The rows have already been written to the
        mapped file (durable after :func:`flush`); in a log store (``storage="log"``) into
        its memory region, sealed to segments as rows leave it and at :func:`flush` (with
        ``durability="step"``, appended to its commit log first: durable on return). The
        ``state`` passed in is now outdated:
        stepping, flushing or closing through it raises :class:`dsa_core.StaleStateError`.

    Notes
    -----
    ``curvature == 0`` is ``torch.optim.SparseAdam`` exactly (docs/algorithms.md §2.2):

    .. math::

        m \leftarrow m + (g - m)(1-\beta_1),\quad v \leftarrow v + (g^2 - v)(1-\beta_2),\quad
        p \leftarrow p - \frac{\mathrm{lr}\sqrt{1-\beta_2^t}}{1-\beta_1^t}
                          \frac{m}{\sqrt{v} + \epsilon}

    with one global step ``t`` for every row; rows not in ``idx`` are left bit-for-bit
    unchanged (their moments do not decay). A ``second_moment="rowwise"`` store
    (docs/algorithms.md §7.3, FBGEMM's partial row-wise Adam) keeps the same m but one v per
    row:

    .. math::

        v \leftarrow v + (\mathrm{mean}_j\, g_j^2 - v)(1-\beta_2),\quad
        p \leftarrow p - \mathrm{lr}\,\frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    ``curvature > 0`` is geoopt's ``SparseRiemannianAdam`` on the ball (docs/algorithms.md
    §3.2): Riemannian gradient, one second-moment scalar per row, retraction + projection,
    transported first moment.

    The options of :func:`create` (docs/algorithms.md §7.1–§7.2): ``state.weight_decay``
    alone adds ``wd * p`` to each row's summed gradient (L2, ``torch.optim.Adam``); with
    ``state.decoupled_weight_decay`` each row is first multiplied by ``1 - lr * wd``
    (``torch.optim.AdamW``), by ``(1 - lr * wd) ** (t - last)`` in a ``decay_missed_steps``
    store; a ``per_row_step`` store takes the bias corrections from each row's own count.
    ``lr`` is this step's. Rows not in ``idx`` and rows skipped for non-finite gradients are
    not decayed and keep their counters.

    A store created with ``optimizer="adagrad"`` steps ``torch.optim.Adagrad`` on sparse
    gradients, ``"rowwise_adagrad"`` PyTorch-BigGraph's ``RowAdagrad`` (docs/algorithms.md
    §7.5), with ``clr = lr / (1 + (t - 1) * lr_decay)`` from the store's global ``t``
    (never frozen: torch's float32 step tensor stops counting at 2**24):

    .. math::

        s \leftarrow s + g^2,\quad p \leftarrow p - \mathrm{clr}\,\frac{g}{\sqrt{s} +
        \epsilon}

    elementwise; row-wise, ``s`` is one number per row and grows by ``mean_j g_j²`` (with
    ``weight_decay``, FBGEMM's L2: ``g + wd * p`` in both places).

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> s = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", num_rows=5, dim=2)
    >>> s = dsa_core.step(s, [1, 3, 1], np.ones((3, 2), np.float32), lr=0.1)
    >>> s.count   # Adam's first step moves each touched coordinate by about lr
    1
    >>> np.round(dsa_core.gather(s, [1, 0]), 4)   # row 0 is not in the batch: untouched
    array([[-0.1, -0.1],
           [ 0. ,  0. ]], dtype=float32)
    >>> dsa_core.close(s)
    """
    plan = plan_step(state, idx, grad, lr=lr, params=params, table=table)
    begin_step(plan)
    try:
        run_step(plan)
        commit_step(plan)
    except InDoubtError as exc:
        if plan.begun:  # raised before the commit point (not by the engine's commit)
            abort_step(plan)
            raise
        raise in_doubt(exc, [plan]) from exc
    except BaseException:
        abort_step(plan)
        raise
    return state._replace(count=plan.t)


class StepPlan:
    """One checked, coalesced step of one store, not begun yet (:func:`plan_step`).

    The phases of ``step`` as separate calls, for callers that step several stores as one
    (``dsa_core._group``): every store's plan first (all checks), then every store's
    :func:`begin_step` and :func:`run_step`, then every :func:`commit_step`; on an error
    :func:`abort_step` of each begun one (``undo=True`` plans also put back records that an
    engine cannot roll back itself)."""

    __slots__ = ("state", "t", "lr", "srows", "G", "inv", "params", "table", "meta", "kept",
                 "kept_rows", "data", "drows", "undo", "saved", "begun")

    def __init__(self, state, t, lr, srows, G, inv, params, table, meta):
        self.state, self.t, self.lr = state, t, lr
        self.srows, self.G, self.inv = srows, G, inv
        self.params, self.table, self.meta = params, table, meta
        self.kept = self.kept_rows = self.data = self.drows = self.saved = None
        self.undo = False
        self.begun = False


def plan_step(state: State, idx: Any, grad: Any, *, lr: float | None = None,
              params: np.ndarray | None = None, table: np.ndarray | None = None,
              undo: bool = False) -> StepPlan:
    """Check and coalesce one step of ``state`` (``step``'s arguments); changes nothing.

    ``undo=True``: the plan keeps what it needs to put the store's records and the
    caller's rows back even after :func:`commit_step` (``abort_step``)."""
    require_current(state)
    h = state.handle
    st = h.store
    lay = st.layout
    lr = state.lr if lr is None else check_lr(lr, allow_zero=True)  # schedules may hit 0
    if state.weight_decay:  # set by _replace: checked as create checks it
        check_weight_decay(state.weight_decay, what="State.weight_decay")
        if lay.optimizer == "adagrad":
            raise ValueError(f"State.weight_decay: optimizer='adagrad': weight_decay option "
                             f"is not compatible with sparse gradients (as in "
                             f"torch.optim.Adagrad), got {state.weight_decay}; nothing was "
                             "written. Set it back to 0, or use a rowwise_adagrad store")
    if lay.optimizer != "adam" and not (math.isfinite(state.lr_decay) and state.lr_decay >= 0
                                        and math.isfinite(state.initial_accumulator_value)
                                        and state.initial_accumulator_value >= 0):
        raise ValueError(f"State.lr_decay and State.initial_accumulator_value must be finite "
                         f"numbers >= 0, got {state.lr_decay!r} and "
                         f"{state.initial_accumulator_value!r}; nothing was written")
    idx = as_index(idx, lay.num_rows)
    b = idx.shape[0]
    grad = _as_rows(grad, b, lay.dim, lay.dtype, "grad")
    if lay.w_off is None:
        if (params is None) == (table is None):
            raise ValueError("this store was created with weights=False: pass the current "
                             "weight rows as step(state, idx, grad, params=rows), rows of "
                             f"shape (len(idx), {lay.dim}), or the whole weight table as "
                             f"table=W of shape ({lay.num_rows}, {lay.dim}) -- one of the two")
        if params is not None:
            params = np.asarray(params)
            if params.dtype != lay.dtype or params.shape != (b, lay.dim):
                raise ValueError(f"params must be a ({b}, {lay.dim}) {lay.dtype.name} array "
                                 f"(the weight rows of idx), got {params.shape} "
                                 f"{params.dtype}")
            if not params.flags.writeable:
                raise ValueError("params must be writeable: step updates the rows in place")
        else:
            if not isinstance(table, np.ndarray) or table.dtype != lay.dtype \
                    or table.shape != (lay.num_rows, lay.dim):
                raise ValueError(
                    f"table must be the ({lay.num_rows}, {lay.dim}) {lay.dtype.name} weight "
                    f"table, got {getattr(table, 'shape', type(table).__name__)} "
                    f"{getattr(table, 'dtype', '')}")
            if not (table.flags.c_contiguous and table.flags.writeable):
                raise ValueError("table must be C-contiguous and writeable (step updates its "
                                 "rows in place); pass np.ascontiguousarray(table) and copy "
                                 "it back, or use params=")
    elif params is not None or table is not None:
        raise ValueError("params/table are only for weights=False stores; this store holds "
                         "the weights itself (read them with dsa_core.gather)")
    if state.nonfinite == "raise" and b and not np.isfinite(grad).all():
        rows = np.unique(idx[~np.isfinite(grad).all(axis=1)])
        raise FloatingPointError(
            f"grad holds NaN or Inf for row(s) {rows[:10].tolist()}; nothing was written "
            "(nonfinite='raise'). Use nonfinite='skip_row' to skip such rows")

    t = state.count + 1
    if b:
        if is_strictly_increasing(idx):
            srows, G, inv = idx, grad, None
        else:
            srows, G, inv = coalesce(idx, grad, want_inverse=lay.w_off is None,
                                     out=scratch(h.scratch, "coalesced", b * lay.dim,
                                                 lay.dtype))
            G = read_only(G)
        if srows.shape[0] > st.info.max_batch:  # before anything changes
            refuse_batch(st, srows.shape[0])
    else:
        srows, G, inv = idx, grad, None
    plan = StepPlan(state, t, lr, srows, G, inv, params, table, state_meta(state))
    plan.undo = bool(undo) and bool(b)
    # durability="step" promises that a failed step changes nothing: the caller's rows too
    if b and (plan.undo or state.durability == "step"):
        plan.kept = params.copy() if params is not None else None
        plan.kept_rows = table[srows] if table is not None else None
    return plan


def begin_step(plan: StepPlan) -> None:
    """The engine's ``begin_step``: where the kernels will write (``undo``: a copy of those
    records first)."""
    st = plan.state.handle.store
    plan.data, plan.drows = st.begin_step(plan.srows, plan.state.count, plan.meta)
    plan.begun = True
    if plan.undo:
        plan.saved = plan.data[plan.drows]  # a copy (fancy indexing)


def run_step(plan: StepPlan) -> None:
    """The kernels on the begun records."""
    if plan.srows.shape[0]:
        _apply(plan.state, plan.t, plan.lr, plan.srows, plan.G, plan.inv, plan.params,
               plan.table, data=plan.data, drows=plan.drows)


def commit_step(plan: StepPlan) -> None:
    """The engine's ``commit_step``: the step takes effect (``count`` becomes ``t``, the
    newest State's, in its Handle). An :class:`InDoubtError` from the engine comes after
    its commit point: the step has taken effect all the same (nothing to abort)."""
    h = plan.state.handle
    try:
        h.store.commit_step(plan.t, plan.meta)
    except InDoubtError:
        plan.begun = False  # abort_step leaves it: the step stands
        h.count = plan.t
        h.meta = plan.meta
        raise
    h.count = plan.t
    h.meta = plan.meta


def in_doubt(exc: InDoubtError, plans: list[StepPlan]) -> InDoubtError:
    """The error a step raises when a store's commit point passed but its directory could
    not be synced: the steps of ``plans`` all stand; ``states`` (and, for one store,
    ``state``) are the States to go on from."""
    states = [p.state._replace(count=p.t) for p in plans]
    where = ", ".join(f"{str(p.state.path)!r} (step {p.t})" for p in plans)
    err = InDoubtError(exc.errno, (
        f"{exc.strerror}. The step was taken: {where} reopen at it, unless a power cut "
        "loses the directory's last change, which leaves the step before it (consistent "
        "either way). This process is at the new step: go on from the States this error "
        "carries (`state = err.state` after dsa_core.step, `states = err.states` after "
        "step_many), or close and reopen; check the disk (the sync failed)"))
    err.states = states
    err.state = states[0] if len(states) == 1 else None
    return err


def abort_step(plan: StepPlan) -> None:
    """Undo a begun step whose kernels or commit raised: the engine's ``abort_step``, the
    saved records (``undo``) and the caller's rows put back."""
    if not plan.begun:
        return
    plan.begun = False
    st = plan.state.handle.store
    st.abort_step()
    if plan.saved is not None:
        plan.data[plan.drows] = plan.saved
        plan.saved = None
    if plan.kept is not None:
        plan.params[...] = plan.kept
    if plan.kept_rows is not None:
        plan.table[plan.srows] = plan.kept_rows


def check_batch(state: State, idx: Any) -> None:
    """Raise ``ValueError`` unless one :func:`step` of the ids ``idx`` fits the store.

    A log store (``storage="log"``) steps a batch in its memory region: the distinct rows of
    ``idx`` must fit in it (:func:`step` refuses a batch that does not, before writing
    anything). An in-place store takes any batch. For callers that step several stores in
    one update (the adapters' optimizers): check every store first, so that a batch refused
    by the second store does not leave the first one stepped. Writes nothing.
    """
    st = state.store
    lay = st.layout
    idx = as_index(idx, lay.num_rows)
    n = idx.shape[0]
    if n > st.info.max_batch:  # only a batch longer than the limit can fail: count its rows
        n = np.unique(idx).shape[0]
        if n > st.info.max_batch:
            refuse_batch(st, n)


def _min_chunk(dim: int) -> int:
    """Rows per chunk so that one chunk is worth a thread hand-off (~16k elements)."""
    return max(16, 16384 // dim)


def _apply(state: State, t: int, lr: float, srows, G, inv, params, table, *,
           data: np.ndarray, drows: np.ndarray) -> None:
    """Run the kernel on the records ``data[drows]`` of the unique rows ``srows`` (the
    engine's ``begin_step``); the caller's ``params``/``table`` are indexed as rows."""
    h = state.handle
    lay = h.store.layout
    if lay.optimizer != "adam":
        _apply_adagrad(state, t, lr, srows, G, inv, params, table, data=data, drows=drows)
        return
    W, wrows, woff = _weights(lay, data, drows, srows, inv, params, table)
    b1, b2 = state.betas
    bc1 = 1.0 - b1**t  # one global step t for every row (per_row_step: the kernels, per row)
    bc2 = 1.0 - b2**t
    skip = state.nonfinite == "skip_row"
    n, chunk = srows.shape[0], _min_chunk(lay.dim)
    wd = state.weight_decay
    # docs/algorithms.md §7.1-§7.2: with an option on, the kernel's specialisation for the
    # options (compiled on first use) and the float64 options array (kept in the Handle: its
    # bias table is built once); else the plain specialisation and the constant NO_OPTIONS
    opts, spec = NO_OPTIONS, None
    if wd != 0.0 or lay.rs_off >= 0 or lay.ls_off >= 0:
        mode = WD_NONE if wd == 0.0 else WD_DECOUPLED if state.decoupled_weight_decay else WD_L2
        spec = (lay.rs_off >= 0, lay.ls_off >= 0, mode)
        opts = options_array(rs_off=lay.rs_off, ls_off=lay.ls_off, t=t, wd_mode=mode, lr=lr,
                             betas=state.betas, weight_decay=wd, dtype=lay.dtype,
                             out=h.scratch.get("options"))
        h.scratch["options"] = opts
    if lay.curvature == 0.0:
        hp = euclid_hparams(lay.dtype, lr=lr, betas=state.betas, bc1=bc1, bc2=bc2,
                            eps=state.eps, maximize=state.maximize, weight_decay=wd)
        if lay.m_bf16:  # first_moment="bfloat16" (docs/algorithms.md §6), either second moment
            m16 = data.view(np.uint16)  # the records as uint16: m at twice its f32 offset
            # records drows, rounding keyed by the row ids srows (a log store's records are
            # region slots: the same bits as in place; in place drows is srows)
            kernel = euclid_bf16m_options_kernel(*spec) if spec else adam_rows_euclid_bf16m
            _pool.run_chunked(kernel, (W, wrows, woff, data, m16, drows, srows, 2 * lay.m_off,
                                       lay.v_off, G, hp, lay.rowwise, t, skip, opts), n, chunk)
        else:  # second_moment="rowwise" (docs/algorithms.md §7.3), or SparseAdam's
            if lay.rowwise:
                kernel = euclid_rowwise_options_kernel(*spec) if spec else adam_rows_euclid_rowwise
            else:
                kernel = euclid_options_kernel(*spec) if spec else adam_rows_euclid
            _pool.run_chunked(kernel, (W, wrows, woff, data, drows, lay.m_off, lay.v_off, G, hp,
                                       skip, opts), n, chunk)
    else:  # the ball (create refuses rowwise and bfloat16 m here)
        hp = poincare_hparams(lay.dtype, curvature=lay.curvature, lr=lr, betas=state.betas,
                              bc1=bc1, bc2=bc2, eps=state.eps,
                              maxnorm=maxnorm(lay.curvature, state.ball_eps, lay.dtype),
                              maximize=state.maximize, weight_decay=wd)
        Y = scratch(h.scratch, "poincare_y", G.size, lay.dtype).reshape(G.shape)
        _pool.run_chunked(poincare_options_kernel(*spec) if spec else adam_rows_poincare,
                          (W, wrows, woff, data, drows, lay.m_off, lay.v_off, G, Y, hp, skip,
                           opts), n, chunk)
    _weights_back(lay, W, inv, params, table)


def _weights(lay, data, drows, srows, inv, params, table):
    """``(W, wrows, woff)`` for the kernels: the records' weights, the caller's table, or
    one row per unique id of the caller's ``params`` (``weights=False`` stores)."""
    if lay.w_off is not None:
        return data, drows, lay.w_off
    if table is not None:  # the caller's whole table: its rows srows, in place
        return table, srows, 0
    if inv is None:
        W = np.ascontiguousarray(params)
    else:  # one row per unique id: the first occurrence
        first = np.empty(srows.shape[0], np.int64)
        first[inv[::-1]] = np.arange(inv.shape[0] - 1, -1, -1)
        W = params[first]
    return W, np.arange(srows.shape[0], dtype=np.int64), 0


def _weights_back(lay, W, inv, params, table) -> None:
    """The new weight rows into the caller's ``params`` (``weights=False``, no table)."""
    if lay.w_off is None and table is None:
        if inv is None:
            if W is not params:
                params[...] = W
        else:
            params[...] = W[inv]


def _apply_adagrad(state: State, t: int, lr: float, srows, G, inv, params, table, *,
                   data: np.ndarray, drows: np.ndarray) -> None:
    """:func:`_apply` for an Adagrad store (docs/algorithms.md §7.5): elementwise
    (``torch.optim.Adagrad``) or row-wise (PBG's ``RowAdagrad``; ``weight_decay``: FBGEMM's
    L2), the accumulator at the layout's v offset. ``t`` is the store's global count, never
    frozen (torch's float32 step tensor stops at 2**24)."""
    lay = state.handle.store.layout
    W, wrows, woff = _weights(lay, data, drows, srows, inv, params, table)
    rowwise = lay.optimizer == "rowwise_adagrad"
    wd = state.weight_decay if rowwise else 0.0
    hp = adagrad_hparams(lay.dtype, lr=lr, t=t, lr_decay=state.lr_decay, eps=state.eps,
                         initial_accumulator_value=state.initial_accumulator_value,
                         maximize=state.maximize, weight_decay=wd)
    if rowwise:
        kernel = rowwise_adagrad_options_kernel(WD_L2 if wd else WD_NONE)
    else:
        kernel = adagrad_rows
    _pool.run_chunked(kernel, (W, wrows, woff, data, drows, lay.v_off, G, hp,
                               state.nonfinite == "skip_row", NO_OPTIONS),
                      srows.shape[0], _min_chunk(lay.dim))
    _weights_back(lay, W, inv, params, table)


def gather(state: State, idx: Any, out: np.ndarray | None = None) -> np.ndarray:
    """Copy the weight rows ``idx`` out of the store: shape ``(len(idx), dim)``, store dtype."""
    st = state.handle.store
    lay = st.layout
    if state.handle.closed:
        raise closed_error(st)
    if lay.w_off is None:
        raise ValueError(f"store {str(st.path)!r} was created with weights=False and holds no "
                         "weights to gather")
    idx = as_index(idx, lay.num_rows)
    if out is None:
        out = np.empty((idx.shape[0], lay.dim), lay.dtype)
    elif out.shape != (idx.shape[0], lay.dim) or out.dtype != lay.dtype \
            or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous ({idx.shape[0]}, {lay.dim}) "
                         f"{lay.dtype.name} array, got {out.shape} {out.dtype}")
    if idx.shape[0]:
        st.gather(idx, out)
    return out


def warmup(dtypes=("float32", "float64"), *, readonly: bool = True,
           options: bool = False) -> None:
    """Compile (or load from numba's cache) every kernel specialisation used by ``step``.

    ``readonly`` is kept for old callers and changes nothing: the step hands every gradient
    to the kernels read-only (:func:`read_only`), so one variant serves a JAX array, a
    read-only memmap and a writeable array alike. ``options=True`` also
    builds the kernels of stores with weight decay or per-row counters (docs/algorithms.md
    §7.1–§7.2), which otherwise compile at their first step.
    """
    rows = np.arange(2, dtype=np.int64)
    c = control(2)  # the pool's calls pass one (_claim): their compiled code, not the bare one
    for dt in dtypes:
        dt = np.dtype(dt)
        data = np.zeros((2, 6), dt)
        hp = euclid_hparams(dt, lr=1e-3, betas=(0.9, 0.999), bc1=0.1, bc2=1e-3, eps=1e-8,
                            maximize=False)
        php = poincare_hparams(dt, curvature=1.0, lr=1e-3, betas=(0.9, 0.999), bc1=0.1,
                               bc2=1e-3, eps=1e-8, maxnorm=dt.type(0.99), maximize=False)
        op = options_array(rs_off=5, ls_off=-1, t=1, wd_mode=WD_L2, lr=1e-3,
                           betas=(0.9, 0.999), dtype=dt)
        # the combinations of options (docs/algorithms.md §7.1-§7.2; else compiled on first
        # use); the plain kernels are the one with none on, run with NO_OPTIONS
        specs = [(p, la, m) for p in (False, True) for la in (False, True)
                 for m in (WD_NONE, WD_L2, WD_DECOUPLED) if options or not (p or la or m)]
        G = read_only(np.zeros((2, 2), dt))  # as the step passes them (read_only)
        G3 = read_only(np.zeros((3, 2), dt))  # one duplicate id: the coalescing path
        Y = np.zeros((2, 2), dt)
        for spec in specs:
            o = op if any(spec) else NO_OPTIONS
            euclid_options_kernel(*spec)(data, rows, 0, data, rows, 2, 4, G, hp, False, o,
                                         0, 2, c)
            euclid_rowwise_options_kernel(*spec)(data, rows, 0, data, rows, 2, 4, G, hp,
                                                 False, o, 0, 2, c)
            if dt == np.float32:
                for rw in (False, True):
                    euclid_bf16m_options_kernel(*spec)(data, rows, 0, data,
                                                       data.view(np.uint16), rows, rows, 4,
                                                       4, G, hp, rw, 1, False, o, 0, 2, c)
            poincare_options_kernel(*spec)(data, rows, 0, data, rows, 2, 4, G, Y, php,
                                           False, o, 0, 2, c)
        ahp = adagrad_hparams(dt, lr=1e-2, t=1)
        adagrad_rows(data, rows, 0, data, rows, 2, G, ahp, False, NO_OPTIONS, 0, 2, c)
        for m in (WD_NONE, WD_L2):
            rowwise_adagrad_options_kernel(m)(data, rows, 0, data, rows, 2, G, ahp, False,
                                              NO_OPTIONS, 0, 2, c)
        coalesce(np.array([1, 0, 1], np.int64), G3, want_inverse=True)
        gather_rows(data, rows, 0, np.empty((2, 2), dt), 0, 2, c)
    spin_until_done(c, 0, 0)  # the pool's spins (_claim)
    spin_for_job(c, -1, 0)
    spin(0)
    is_strictly_increasing(rows)
    bounds(rows)
    warmup_engines()
