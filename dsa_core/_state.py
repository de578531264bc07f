"""The ``State`` value and the store's life cycle: create, open, flush, checkpoint, close.

Policy only: initialisation, the manifest contents, which State is current. The bytes on
disk are ``_layout``'s and the engines' business, the argument rules ``_validation``'s.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _layout
from ._init import INIT_CHUNK_BYTES, chunks
from ._paging import auto_storage, check_access
from ._settings import settings_field
from ._engine import closed_error, commit, no_view_error
from ._files import copy_tree, staged_dir
from ._engines import ENGINES, kind_of, orphaned_files, orphans_error, remove_orphans
from ._group_file import recover
from ._handle import Handle
from ._validation import (
    DURABILITY_MODES,
    INIT_NAMES,
    check_adagrad_hparams,
    check_adagrad_options,
    check_curvature,
    check_dtype,
    check_first_moment,
    check_hparams,
    check_memory_arg,
    check_optimizer,
    check_positive_int,
    check_second_moment,
    check_seed,
    check_storage,
    check_unclean,
    check_weight_decay_options,
)
from ._validation import as_index



class State(NamedTuple):
    """An open store plus the optimizer's scalars; a small immutable value.

    ``store`` is the open files (shared by every ``State`` derived from one ``create`` or
    ``open``): :func:`dsa_core.step` updates its mapped rows **in place** and returns a new
    ``State`` whose ``count`` is one higher. Keep using the returned value.
    """

    handle: Handle          # the open store as the core keeps it (dsa_core._handle), shared
    count: int              # completed steps: the global t of the spec (bias correction)
    lr: float               # default learning rate (``step(..., lr=...)`` overrides it)
    betas: tuple[float, float] | None  # Adam's; None for an Adagrad store
    eps: float
    maximize: bool
    ball_eps: float         # projection margin of the ball (c > 0); 0.0 for c == 0
    nonfinite: str          # "propagate" | "skip_row" | "raise"
    durability: str = "flush"  # "flush": durable at flush(); "step": every step is atomic
    weight_decay: float = 0.0  # docs/algorithms.md §7.1: L2, or AdamW's with the flag below
    decoupled_weight_decay: bool = False
    lr_decay: float = 0.0   # Adagrad's (docs/algorithms.md §7.5): lr / (1 + (t-1)*lr_decay)
    initial_accumulator_value: float = 0.0  # Adagrad's: what an accumulator of 0 reads as

    # -- read-only conveniences ------------------------------------------------------------
    @property
    def store(self) -> Any:
        """The open engine (``dsa_core._engine.Engine``): records, lock, layout."""
        return self.handle.store

    @property
    def path(self) -> Path:
        return self.handle.store.path

    @property
    def shape(self) -> tuple[int, int]:
        """``(num_rows, dim)``: the shape of the embedding table."""
        return (self.handle.store.layout.num_rows, self.handle.store.layout.dim)

    @property
    def closed(self) -> bool:
        """True after :func:`dsa_core.close` (by this or any State of the same store)."""
        return self.handle.closed

    @property
    def writable(self) -> bool:
        """True while the store is open for writing (``mode="r+"``, not closed)."""
        return not self.handle.closed and self.handle.store.mode == "r+"

    @property
    def current(self) -> bool:
        """True if this is the store's newest State: the one that may step, flush, checkpoint.

        ``s1 = step(s0, ...)`` makes ``s0`` outdated: its ``count`` no longer says how many
        steps the rows on disk have taken. ``s1._replace(lr=...)`` stays current.
        """
        return self.count == self.handle.count

    @property
    def layout(self) -> dict[str, Any]:
        """The record layout (a copy): shape, dtype, curvature, column offsets, stride.

        Two stores can exchange records (:func:`dsa_core.restore`,
        :func:`dsa_core.write_records`) exactly when their layouts are equal.
        """
        return self.handle.store.layout.as_dict()

    @property
    def access(self) -> str:
        """How the mapping is paged: ``"ram"`` or ``"disk"`` (``"auto"`` resolved at open);
        ``"log"`` for a log-structured store (no mapping: its region is its memory)."""
        return self.handle.store.info.access

    @property
    def storage(self) -> str:
        """The store kind: ``"inplace"`` (one mapped file of records, updated in place) or
        ``"log"`` (the log-structured store; ``create(storage="log")``)."""
        return self.handle.store.kind

    @property
    def has_table_view(self) -> bool:
        """True when the store has whole-table numpy views (:attr:`weights`,
        :attr:`exp_avg`, :attr:`exp_avg_sq`, :attr:`row_steps`...): an in-place store's
        mapped file. A log store has none (its records live in a memory region and in
        segments): read and write rows with :func:`dsa_core.gather`,
        :func:`dsa_core.read_records` and :func:`dsa_core.write_records`, which work on
        every store."""
        return self.handle.store.info.table_view

    def _require_view(self, name: str) -> None:
        if not self.handle.store.info.table_view:
            raise no_view_error(self.handle.store, f"State.{name}")

    def _handed_out(self, cols: slice) -> np.ndarray:
        """A writable whole-table view of the columns ``cols`` leaves the store's sight
        (``read(..., view=True)``): rows written through it are seen by no undo record, so
        its later snapshots are full copies."""
        return self.handle.store.read(slice(None), cols, view=True)

    @property
    def num_rows(self) -> int:
        return self.handle.store.layout.num_rows

    @property
    def dim(self) -> int:
        return self.handle.store.layout.dim

    @property
    def dtype(self) -> np.dtype:
        return self.handle.store.layout.dtype

    @property
    def curvature(self) -> float:
        return self.handle.store.layout.curvature

    @property
    def optimizer(self) -> str:
        """What the records hold state for, fixed at creation: ``"adam"`` (m and v),
        ``"adagrad"`` or ``"rowwise_adagrad"`` (one accumulator per coordinate or per row,
        docs/algorithms.md §7.5)."""
        return self.handle.store.layout.optimizer

    @property
    def second_moment(self) -> str:
        """``"elementwise"`` (SparseAdam's v), ``"rowwise"`` (docs/algorithms.md §7.3) or,
        for c > 0, ``"riemannian"`` (the ball's one scalar per row). For an Adagrad store:
        the accumulator's, ``"elementwise"`` or ``"rowwise"``."""
        lay = self.handle.store.layout
        if lay.optimizer != "adam":
            return "rowwise" if lay.v_width == 1 and lay.optimizer != "adagrad" \
                else "elementwise"
        if lay.curvature > 0:
            return "riemannian"
        return "rowwise" if lay.rowwise else "elementwise"

    @property
    def accumulator(self) -> np.ndarray:
        """Adagrad stores: a (num_rows, dim) view (``"rowwise_adagrad"``: (num_rows, 1)) of
        the accumulators, torch's ``"sum"``, no copy (writes reach the file). A value of
        exactly 0 stands for ``initial_accumulator_value`` (a row never updated; a state
        dict reports ``fl(iav)`` there, as torch's does). Not on log stores."""
        self._require_view("accumulator")
        lay = self.handle.store.layout
        if lay.optimizer == "adam":
            raise ValueError(f"store {str(self.path)!r} is an Adam store (optimizer='adam') and "
                             "keeps no Adagrad accumulator; its state is exp_avg and "
                             "exp_avg_sq")
        return self._handed_out(slice(lay.v_off, lay.v_off + lay.v_width))

    def _require_adam(self, name: str) -> None:
        opt = self.handle.store.layout.optimizer
        if opt != "adam":
            raise ValueError(f"store {str(self.path)!r} was created with optimizer={opt!r} "
                             f"and keeps no {name} (Adam's); its state is the accumulator "
                             "(State.accumulator, torch's 'sum')")

    @property
    def has_weights(self) -> bool:
        return self.handle.store.layout.w_off is not None

    @property
    def per_row_step(self) -> bool:
        """True if each row keeps its own step count for the bias correction
        (``create(per_row_step=True)``, docs/algorithms.md §7.2)."""
        return self.handle.store.layout.rs_off >= 0

    @property
    def decay_missed_steps(self) -> bool:
        """True if each row records the step of its last update, so that decoupled weight
        decay catches up on the steps it missed (``create(decay_missed_steps=True)``,
        docs/algorithms.md §7.1)."""
        return self.handle.store.layout.ls_off >= 0

    @property
    def row_steps(self) -> np.ndarray:
        """A (num_rows,) int view of each row's own update count t_r (``per_row_step``
        stores); 0 for a row never updated. No copy: writes reach the file (importers)."""
        return self._counter(self.handle.store.layout.rs_off, "row_steps", "per_row_step")

    @property
    def last_steps(self) -> np.ndarray:
        """A (num_rows,) int view of the global step at which each row was last updated
        (``decay_missed_steps`` stores); 0 for never. No copy: writes reach the file."""
        return self._counter(self.handle.store.layout.ls_off, "last_steps",
                             "decay_missed_steps")

    def _counter(self, off: int, name: str, option: str) -> np.ndarray:
        self._require_view(name)
        if off < 0:
            raise ValueError(f"store {str(self.path)!r} was created without {option}=True "
                             f"and keeps no {name}; create the store with "
                             f"dsa_core.create(..., {option}=True) to have them")
        ints = _layout.counter_dtype(self.handle.store.layout.dtype)  # the records as ints
        return self._handed_out(slice(off, off + 1)).view(ints)[:, 0]

    @property
    def weights(self) -> np.ndarray:
        """A (num_rows, dim) view of the stored weights (no copy; writes reach the file).

        Log stores have no whole-table view: ``ValueError`` (use :func:`dsa_core.gather`)."""
        self._require_view("weights")
        if self.handle.store.layout.w_off is None:
            raise ValueError(
                f"store {str(self.path)!r} was created with weights=False and holds no "
                "weights; the caller keeps them (pass them to step(..., params=rows))")
        o = self.handle.store.layout.w_off
        return self._handed_out(slice(o, o + self.dim))

    @property
    def first_moment(self) -> str:
        """``"full"`` (m in the store dtype) or ``"bfloat16"`` (m packed, docs/algorithms.md
        §6)."""
        return "bfloat16" if self.handle.store.layout.m_bf16 else "full"

    @property
    def exp_avg(self) -> np.ndarray:
        """A (num_rows, dim) view of the first moments m.

        For ``first_moment="bfloat16"`` stores: a decoded float32 **copy** (read-only; it is
        num_rows x dim x 4 bytes), since the file holds bfloat16. Not on log stores.
        """
        self._require_view("exp_avg")
        self._require_adam("exp_avg")
        st = self.handle.store
        o = st.layout.m_off
        if st.layout.m_bf16:
            packed = st.read(slice(None), slice(o, o + st.layout.m_width))  # not handed out
            raw = packed.view(np.uint16)[:, :self.dim]
            out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
            out.flags.writeable = False
            return out
        return self._handed_out(slice(o, o + self.dim))

    def set_exp_avg(self, m: Any) -> None:
        """Write the first moments: ``m`` of shape (num_rows, dim), any real dtype.

        For a full store this is ``state.exp_avg[...] = m``. A ``first_moment="bfloat16"``
        store takes each value rounded to the nearest bfloat16 (ties to even, as
        ``torch.Tensor.to(torch.bfloat16)``; NaN stays NaN): a one-time conversion wants the
        smallest error, not the step's stochastic rounding. Checked before anything is written.
        The same on every store kind: chunks of records (:func:`read_records`, the m columns
        replaced, :func:`write_records`; the other columns keep their bits), durable at the
        next flush.
        """
        st = self.handle.store
        self._require_adam("exp_avg")
        m = np.asarray(m)
        if m.shape != (self.num_rows, self.dim) or not (
                np.issubdtype(m.dtype, np.floating) or np.issubdtype(m.dtype, np.integer)):
            raise ValueError(f"exp_avg must be a real ({self.num_rows}, {self.dim}) array for "
                             f"store {str(self.path)!r}; got {m.dtype} of shape {m.shape}")
        if self.handle.closed:
            raise closed_error(st)
        if st.mode != "r+":
            raise ValueError(f"store {str(self.path)!r} is open read-only (mode='r'); open it "
                             "with dsa_core.open(path) (mode='r+', the writer) to set its moments")
        require_current(self)  # as write_records, before anything is written
        # one path for every kind: chunks of whole records read, their m columns replaced,
        # written back (the other columns keep their bits; an in-place store saves each
        # row's old record for its undo file as any write does)
        lay = self.layout
        o, bf16 = lay["m"], lay.get("first_moment") == "bfloat16"
        for lo, hi in _record_chunks(st.layout):
            idx = np.arange(lo, hi, dtype=np.int64)
            rec = read_records(self, idx)
            if bf16:
                x = np.ascontiguousarray(m[lo:lo + idx.size], dtype=np.float32)
                rec[:, o:o + lay["m_width"]].view(np.uint16)[:, :self.dim] = \
                    bf16_nearest_even(x)
            else:
                rec[:, o:o + self.dim] = m[lo:lo + idx.size]
            write_records(self, idx, rec)

    @property
    def exp_avg_sq(self) -> np.ndarray:
        """A view of the second moments v: (num_rows, dim) for elementwise stores, (num_rows, 1)
        for ``second_moment="rowwise"`` and for c > 0. Not on log stores."""
        self._require_view("exp_avg_sq")
        self._require_adam("exp_avg_sq")
        o = self.handle.store.layout.v_off
        return self._handed_out(slice(o, o + self.handle.store.layout.v_width))

    def __repr__(self) -> str:
        if self.optimizer != "adam":
            return (f"dsa_core.State(path={str(self.path)!r}, num_rows={self.num_rows}, "
                    f"dim={self.dim}, dtype={self.dtype.name}, optimizer={self.optimizer!r}, "
                    f"count={self.count}, lr={self.lr}, lr_decay={self.lr_decay}, "
                    f"initial_accumulator_value={self.initial_accumulator_value}, "
                    f"eps={self.eps}, maximize={self.maximize}"
                    + (f", weight_decay={self.weight_decay}" if self.weight_decay else "")
                    + ")")
        return (f"dsa_core.State(path={str(self.path)!r}, num_rows={self.num_rows}, "
                f"dim={self.dim}, dtype={self.dtype.name}, curvature={self.curvature}, "
                f"count={self.count}, lr={self.lr}, betas={self.betas}, eps={self.eps}, "
                f"maximize={self.maximize}"
                + (f", weight_decay={self.weight_decay}" if self.weight_decay else "")
                + (", decoupled_weight_decay=True" if self.decoupled_weight_decay else "")
                + (", per_row_step=True" if self.per_row_step else "")
                + (", decay_missed_steps=True" if self.decay_missed_steps else "") + ")")


class StaleStateError(RuntimeError):
    """A ``State`` older than its store's newest one was stepped, flushed or checkpointed."""


def bf16_nearest_even(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16) nearest to float32 ``x``, ties to even; NaN stays NaN."""
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a NaN (rounding could carry its mantissa into inf)
        r[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def default_ball_eps(dtype: np.dtype) -> float:
    """geoopt's projection margin: 4e-3 for float32, 1e-5 for float64 (docs/algorithms.md §3.1)."""
    return 4e-3 if np.dtype(dtype) == np.float32 else 1e-5


def maxnorm(c: float, ball_eps: float, dtype: np.dtype):
    """The projection radius in T: fl(1/sqrt(c + 1e-15)) * fl(1 - ball_eps) (docs/algorithms.md
    §4)."""
    T = np.dtype(dtype).type
    return (T(1) / np.sqrt(T(c) + T(1e-15))) * T(1 - ball_eps)


# -- initialisation ----------------------------------------------------------------------------
def _validate_init_array(init: Any, num_rows: int, dim: int, curvature: float,
                         chunk_rows: int) -> Any:
    if not hasattr(init, "shape"):
        init = np.asarray(init)
    shape = tuple(init.shape)
    if shape != (num_rows, dim):
        raise ValueError(f"init must have shape (num_rows, dim) = ({num_rows}, {dim}), "
                         f"got {shape}; pass an array of that shape or a named init")
    kind = np.dtype(getattr(init, "dtype", np.float64)).kind if hasattr(init, "dtype") else "f"
    if kind not in "fiu":
        raise TypeError(f"init must hold real numbers, got dtype {init.dtype}")
    radius2 = 1.0 / curvature if curvature > 0 else math.inf
    for lo, hi in chunks(num_rows, chunk_rows):
        blk = np.asarray(init[lo:hi], dtype=np.float64)
        if not np.isfinite(blk).all():
            bad = lo + int(np.argwhere(~np.isfinite(blk))[0, 0])
            raise ValueError(f"init must be finite; row {bad} holds NaN or Inf")
        if curvature > 0:
            sq = np.einsum("ij,ij->i", blk, blk)
            out = np.nonzero(sq >= radius2)[0]
            if out.size:
                r = lo + int(out[0])
                raise ValueError(
                    f"init points must lie inside the Poincaré ball of curvature -{curvature} "
                    f"(norm < 1/sqrt(c) = {math.sqrt(radius2):.6g}); row {r} has norm "
                    f"{math.sqrt(sq[out[0]]):.6g} ({out.size} such rows in rows {lo}..{hi - 1}). "
                    "Scale the init down or project it first")
    return init


# -- life cycle ----------------------------------------------------------------------------------
def state_meta(state: State, handle: Handle | None = None, optimizer: str | None = None
               ) -> dict[str, Any]:
    """What every commit point of the store records beside the count: the hyperparameters
    and the durability of ``state`` and the settings and commit group its store's Handle
    holds (an engine's ``flush``/``commit_step`` ``meta``). ``handle``: whose, if not
    ``state.handle``; ``optimizer``: the store's, while ``create`` makes its engine. An
    Adagrad store records its own hyperparameters (no betas: an older
    dsa_core, which reads Adam's, refuses its manifest)."""
    h = state.handle if handle is None else handle
    opt = h.store.layout.optimizer if optimizer is None else optimizer
    if opt != "adam":
        return _meta({
            "optimizer": opt,
            "lr": state.lr,
            "lr_decay": state.lr_decay,
            "initial_accumulator_value": state.initial_accumulator_value,
            "eps": state.eps,
            "maximize": state.maximize,
            "nonfinite": state.nonfinite,
            "weight_decay": state.weight_decay,
        }, state.durability, h)
    return _meta({
        "lr": state.lr,
        "betas": list(state.betas),
        "eps": state.eps,
        "maximize": state.maximize,
        "ball_eps": state.ball_eps,
        "nonfinite": state.nonfinite,
        "weight_decay": state.weight_decay,
        "decoupled_weight_decay": state.decoupled_weight_decay,
    }, state.durability, h)



def newest_meta(h: Handle) -> dict[str, Any]:
    """The ``meta`` of the store's newest State (its last step's, flush's or a group's
    note), with the settings and commit group the Handle holds now."""
    return _meta(dict(h.meta["hparams"]), h.meta["durability"], h)


def _meta(hparams: dict[str, Any], durability: str, h: Handle) -> dict[str, Any]:
    return {"hparams": hparams, "durability": durability, **settings_field(h.settings),
            **group_field(h.group_ref)}


def newest_state(h: Handle) -> State:
    """The store's newest State, from what its Handle holds (a group's members)."""
    return _state_from(h, h.count, h.meta)


def group_field(ref: dict[str, Any] | None) -> dict[str, Any]:
    """``{"group": {"file", "id", "seq"}}``: the commit group a store belongs to
    (``_group``, its Handle's ``group_ref``), recorded with every commit so that ``open`` can
    finish an interrupted group commit (``_group_file.recover``); nothing for a store in no
    group."""
    return {"group": dict(ref)} if ref else {}


def create(path, num_rows: int, dim: int, *, curvature: float = 0.0, lr: float = 1e-3,
           betas: tuple[float, float] | None = None, eps: float | None = None,
           maximize: bool = False, weights: bool = True, init: Any = None,
           init_scale: float = 1e-2, seed: int = 0, dtype: Any = "float32",
           ball_eps: float | None = None, nonfinite: str = "propagate", align: int = 0,
           durability: str = "flush", overwrite: bool = False, access: str = "auto",
           second_moment: str = "elementwise", first_moment: str = "full",
           weight_decay: float = 0.0, decoupled_weight_decay: bool = False,
           decay_missed_steps: bool = False, per_row_step: bool = False,
           progress: bool | None = None, storage: str = "auto",
           memory: int | str | None = None, space_ratio: float | None = None,
           optimizer: str = "adam", lr_decay: float = 0.0,
           initial_accumulator_value: float = 0.0) -> State:
    """Create a store at ``path`` and return its open ``State`` (count 0).

    Parameters
    ----------
    path : str or Path
        Directory of the store (created if missing).
    num_rows, dim : int
        Shape of the embedding table.
    curvature : float, default 0.0
        ``0``: Euclidean lazy Adam, exactly ``torch.optim.SparseAdam``. ``c > 0``: Riemannian
        Adam on the Poincaré ball of curvature ``-c`` (geoopt ``SparseRiemannianAdam``).
    lr, betas, eps, maximize : as in ``torch.optim.SparseAdam``
        Stored in the manifest; ``lr`` can be overridden on every ``step``. ``betas``
        defaults to (0.9, 0.999) (Adam only); ``eps`` to the optimizer's default: 1e-8 for
        Adam, 1e-10 for Adagrad (torch's). Give ``lr`` for Adagrad (torch's default is 1e-2,
        this function's 1e-3).
    weights : bool, default True
        ``False``: only m and v live here; the caller passes its weight rows to
        ``step(..., params=rows)``, which updates them in place.
    init : None, array-like of shape (num_rows, dim), "normal" or "uniform"
        Initial weights. ``None`` means zeros. Named inits draw ``N(0, init_scale^2)`` or
        ``U(-init_scale, init_scale)`` from a counter-based generator: each row's weights are
        a pure function of ``(seed, row)`` (``seed`` an int in ``[0, 2**64)``), the same bits
        on every machine and on both store kinds (the log store computes a row when it is
        first read, the in-place store writes every row at create, on the kernels' threads).
        For ``c > 0`` rows beyond the projection radius are projected onto it. (Before this
        generator, in-place stores drew from ``numpy.random.default_rng(seed)``: the same
        arguments now give other numbers than they did then.) An array is checked (shape,
        finite, inside the ball for ``c > 0``) before anything is written.
    dtype : "float32" or "float64"
        Storage dtype of weights and state. float16/bfloat16 are refused (docs/algorithms.md §6).
    ball_eps : float, optional
        Projection margin for ``c > 0``; default 4e-3 (float32) or 1e-5 (float64), as geoopt.
    nonfinite : "propagate", "skip_row" or "raise"
        What a NaN/Inf gradient does: spread as in torch/geoopt (default), leave that row and
        its state untouched, or raise before anything is written.
    align : int, default 0
        Pad each record to a multiple of this many bytes (e.g. 512 or 4096); 0 packs them.
    durability : "flush" or "step"
        ``"flush"`` (default): rows are written through the mapping and made durable by
        :func:`flush`, :func:`close` and :func:`checkpoint`; after a crash, steps taken since
        the last flush may be partly on disk (the OS writes dirty pages back at any time)
        while the manifest's count is the flushed one: :func:`open` then raises
        :class:`dsa_core.UncleanStopError` (restore a checkpoint, or ``unclean="accept"``).
        ``"step"``: every step is atomic: after a crash, ``open`` returns exactly the state
        after the last completed step and ``count`` says which. In place: undo journal +
        fdatasync + manifest commit, two fdatasyncs and a manifest rename per step; on a
        log store (``storage="log"``): the step's new records appended to a commit log, one
        sequential write and one fdatasync per step (docs/storage.md).
    overwrite : bool, default False
        Replace an existing store at ``path`` (refused while another writer holds it).
    second_moment : "elementwise" or "rowwise", default "elementwise"
        ``curvature == 0`` only. ``"elementwise"``: SparseAdam's v, one per coordinate (parity).
        ``"rowwise"``: one v per row from the mean of ``g²`` over the row (FBGEMM's partial
        row-wise Adam, docs/algorithms.md §7.3): the state shrinks from ``2*dim`` to ``dim + 1``
        values per row, the update is no longer SparseAdam's (m still is, bit for bit). See
        :func:`dsa_core.step` for the formula. Stores written with it are format version 2.
    first_moment : "full" or "bfloat16", default "full"
        float32 stores with ``curvature == 0`` only. ``"bfloat16"``: m is stored as
        bfloat16 with stochastic rounding (docs/algorithms.md §6; v stays float32), 2 bytes per
        coordinate instead of 4. The step computes in float32 from the stored m and rounds
        the new m up or down with probability by its distance (random bits from a hash of
        the step, row and coordinate: reproducible, independent of threads and batch
        order); the weight update uses the unrounded new m. Format version 2.
    weight_decay : float, default 0.0
        Finite, >= 0. Alone it is L2 decay as in ``torch.optim.Adam``: ``g <- g + wd*p`` for
        the batch's rows (after duplicates are summed and maximize applied), before the Adam
        update (docs/algorithms.md §7.1). On the ball ``wd*x`` joins the Euclidean gradient
        before it becomes Riemannian (geoopt ``RiemannianAdam``). A hyperparameter: stored
        in the manifest, changeable with ``state._replace(weight_decay=...)``.
    decoupled_weight_decay : bool, default False
        ``True``: AdamW, in ``torch.optim.AdamW``'s order: ``p <- p*(1 - lr*wd)`` first, then
        the Adam step (from the gradient without decay) on the decayed ``p``; on the ball the
        point is shrunk the same way, toward the origin, inside the ball. Lazy: only the
        batch's rows decay. A hyperparameter like ``weight_decay``.
    decay_missed_steps : bool, default False
        Needs ``decoupled_weight_decay=True``. Each row records the global step of its last
        update; a row updated at step t decays by ``(1 - lr*wd)**(t - last)``: the steps it
        missed and this one, so its decay is that of dense AdamW, exactly for a constant lr
        (with a schedule the missed steps are decayed at the current lr). A layout option,
        fixed at creation (one counter per record, format version 3).
    per_row_step : bool, default False
        Each row keeps its own update count ``t_r`` and its bias corrections use
        ``1 - beta**t_r`` instead of the global step (docs/algorithms.md §7.2): a row seen
        first at step 1000 takes the first step of a fresh Adam. The global count still
        counts steps (schedules). A layout option, fixed at creation (format version 3).
    access : "auto", "ram" or "disk", default "auto"
        How the mapping is paged. ``"ram"`` or ``"disk"`` is remembered (recorded in the
        manifest): :func:`open` uses it unless given another one. ``"ram"``:
        the table stays in the page cache -- 2 MiB huge folios mapped by PMD entries, far
        fewer TLB misses and page faults (a fault reads or zero-fills 2 MiB). ``"disk"``: the
        table is larger than memory -- ``MADV_RANDOM``, one 4 KiB page per fault, no
        read-around; pair it with :func:`prefetch`. ``"auto"``: "ram" when the data file fits
        in 70% of the memory this process may still take (``MemAvailable``, capped by its
        memory cgroup's limit less the memory it holds beyond reclaimable page cache) *and*
        under the kernel's background-writeback threshold (``vm.dirty_background_*``, scaled
        to the cgroup's memory inside one: a dirty huge folio is written back whole, 2 MiB
        for one row), else "disk"; the
        environment variable ``DSA_ACCESS`` overrides "auto". The resolved
        value is ``state.store.access``.
    progress : bool, optional
        Show a tqdm bar while writing a named/array init (default: for large tables).
    storage : "auto", "inplace" or "log", default "auto"
        ``"auto"``: ``"log"`` when the table's records are larger than the kernel's
        background-writeback threshold (about 10% of available memory, or of the memory
        cgroup's dirtyable memory inside one: the in-place store's
        random write-back makes it disk-bound past that), or when ``memory=`` or
        ``space_ratio=`` is given; else ``"inplace"`` (the faster kind for a table that
        stays in memory; ``access=`` other than "auto" keeps it). The environment variable
        ``DSA_STORAGE`` replaces the size rule; ``state.storage`` says what was chosen.
        ``"inplace"``: one mapped file of records, updated in place (everything above).
        ``"log"``: the log-structured store -- updates go to an in-memory
        region of ``memory`` bytes, leaving records are appended to immutable segment files
        in large sequential writes, ``flush`` commits a manifest (docs/storage.md, "The
        log-structured store"). It takes every option above except ``access`` other than
        ``"auto"`` (refused: it has no mapping to page); ``align`` pads its records
        the same way (it changes nothing else there); ``first_moment="bfloat16"`` rounds
        exactly as in place (keyed by the row id). Every init gives the same records as
        on an in-place store (named inits are computed when a row is first read, an array
        is written at create, in chunks).
    memory : int or str, optional
        ``storage="log"`` only: all the memory the store keeps, bytes or a string such
        as ``"4GiB"``, ``"512MiB"``, ``"1.5G"`` (SI k/M/G/T, IEC Ki/Mi/Gi/Ti): its index
        (8 bytes per row, or half the budget, mapped from its file, when that is less), the
        buffers of its background writes and of cleaning (growing
        with the region, up to about 210-250 MiB together) and, with the rest, its in-memory
        region (docs/storage.md, "Memory"; ``dsa info`` shows the split). Default: 25%
        of the memory this process may use (cgroup-aware), at most what the whole table
        needs, at least what a batch of 4096 rows needs. A step's unique rows must fit in
        the region (a clear error names the budget that would hold them). Remembered in bytes
        (recorded in the manifest): :func:`open` uses it unless given another one.
    space_ratio : float > 1, optional
        ``storage="log"`` only: the bound on its segment files' records as a multiple of
        the live records (default 2.0): the cleaner copies the live records out of the
        emptiest segments to keep disk use under it. Lower saves disk and costs more
        cleaning writes (``dsa info`` shows the write amplification). Stored with the store.

    optimizer : "adam", "adagrad" or "rowwise_adagrad", default "adam"
        What the records hold state for, fixed at creation (docs/algorithms.md §7.5):
        ``"adagrad"`` is ``torch.optim.Adagrad`` on sparse gradients (one accumulator per
        coordinate, torch's ``"sum"``), ``"rowwise_adagrad"`` PyTorch-BigGraph's
        ``RowAdagrad`` (one accumulator per row, from the row mean of ``g²``; with
        ``weight_decay``, FBGEMM's L2). Records ``[w | acc | padding]``, format version 5.
        Adagrad takes ``lr``, ``lr_decay``, ``initial_accumulator_value``, ``eps``,
        ``maximize``, ``nonfinite``, ``weight_decay`` (row-wise only) and every storage
        argument; the Adam options (``curvature > 0``, ``betas``, ``second_moment``,
        ``first_moment="bfloat16"``, ``decoupled_weight_decay``, ``decay_missed_steps``,
        ``per_row_step``) are refused, and so is ``weight_decay`` elementwise (torch refuses
        it with sparse gradients). The step count ``t`` is the store's global count: torch's
        float32 step tensor stops counting at 2**24 (so its ``lr_decay`` freezes there);
        this one does not.
    lr_decay, initial_accumulator_value : float >= 0, default 0.0
        Adagrad only (``torch.optim.Adagrad``'s): this step's lr is
        ``lr / (1 + (t - 1) * lr_decay)``; an accumulator starts at
        ``initial_accumulator_value`` (the file holds 0 for a row never updated, read as it).

    Returns
    -------
    State
        Open for writing; this process holds the store's writer lock until ``close``.

    Examples
    --------
    >>> import tempfile, pathlib, dsa_core
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "emb"
    >>> s = dsa_core.create(path, num_rows=1000, dim=16, init="normal", seed=0)
    >>> s.shape, s.count, s.dtype.name
    ((1000, 16), 0, 'float32')
    >>> dsa_core.close(s)
    >>> dsa_core.create(path, num_rows=1000, dim=16)
    Traceback (most recent call last):
        ...
    FileExistsError: a store already exists at ... pass overwrite=True to replace it
    >>> s = dsa_core.open(path)   # resume: same hyperparameters, same count
    >>> dsa_core.close(s)
    """
    num_rows = check_positive_int("num_rows", num_rows)
    dim = check_positive_int("dim", dim)
    dt = check_dtype(dtype)
    c = check_curvature(curvature)
    optimizer = check_optimizer(optimizer)
    if optimizer == "adam":
        if lr_decay != 0.0 or initial_accumulator_value != 0.0:
            raise ValueError(
                f"lr_decay and initial_accumulator_value are Adagrad's; optimizer='adam' takes "
                f"neither, got lr_decay={lr_decay!r}, initial_accumulator_value="
                f"{initial_accumulator_value!r}. Pass optimizer='adagrad', or drop them")
        lr, betas, eps, maximize, nonfinite = check_hparams(
            lr, (0.9, 0.999) if betas is None else betas, 1e-8 if eps is None else eps,
            maximize, nonfinite)
        second_moment = check_second_moment(second_moment, c)
        first_moment = check_first_moment(first_moment, c, dt)
        weight_decay, decoupled_weight_decay, decay_missed_steps, per_row_step = \
            check_weight_decay_options(weight_decay, decoupled_weight_decay,
                                       decay_missed_steps, per_row_step)
    else:
        weight_decay = check_adagrad_options(
            optimizer, curvature=c, betas=betas, second_moment=second_moment,
            first_moment=first_moment, weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            decay_missed_steps=decay_missed_steps, per_row_step=per_row_step)
        lr, lr_decay, eps, initial_accumulator_value, maximize, nonfinite = \
            check_adagrad_hparams(lr, lr_decay, 1e-10 if eps is None else eps,
                                  initial_accumulator_value, maximize, nonfinite)
        betas = None
        decoupled_weight_decay = decay_missed_steps = per_row_step = False
    if ball_eps is None:
        ball_eps = default_ball_eps(dt) if c > 0 else 0.0
    ball_eps = float(ball_eps)
    if c > 0 and not 0.0 <= ball_eps < 1.0:
        raise ValueError(f"ball_eps must lie in [0, 1), got {ball_eps}")
    if not isinstance(weights, (bool, np.bool_)):
        raise TypeError(f"weights must be a bool, got {weights!r}")
    if durability not in DURABILITY_MODES:
        raise ValueError(f"durability must be one of {DURABILITY_MODES} ('flush': durable at "
                         "flush/checkpoint; 'step': every step atomic), got "
                         f"{durability!r}")
    check_access(access)
    seed = check_seed(seed)
    if isinstance(align, (bool, np.bool_)) or not isinstance(align, (int, np.integer)) \
            or align < 0 or (align and align % dt.itemsize):
        raise ValueError(f"align must be 0 or a positive multiple of {dt.itemsize} bytes, "
                         f"got {align!r}")
    storage = check_storage(storage)
    memory = check_memory_arg(memory, storage)
    layout = _layout.make_layout(num_rows, dim, dt, c, bool(weights), int(align),
                                 second_moment, first_moment, per_row_step=per_row_step,
                                 decay_missed_steps=decay_missed_steps, optimizer=optimizer)
    if storage == "auto":
        storage = auto_storage(num_rows * layout["stride"] * dt.itemsize,
                               memory is not None or space_ratio is not None, access)
    if space_ratio is not None:
        if isinstance(space_ratio, (bool, np.bool_)) or not isinstance(
                space_ratio, (int, float, np.integer, np.floating)) \
                or not (math.isfinite(space_ratio) and space_ratio > 1.0):
            raise ValueError(f"space_ratio must be a finite number > 1 (segment records as a "
                             f"multiple of the live ones; 2.0 by default), got "
                             f"{space_ratio!r}")
        space_ratio = float(space_ratio)
    engine = ENGINES[storage]
    settings = engine.check_settings(layout, access=access, memory=memory,
                                     space_ratio=space_ratio)
    if isinstance(init, str) and init == "zeros":
        init = None  # the records start as zeros (fallocate)
    if init is not None:
        if not weights:
            raise ValueError("init sets the weights, but weights=False stores hold none; "
                             "drop init or use weights=True")
        if isinstance(init, str):
            if init not in INIT_NAMES:
                raise ValueError(f"init must be None, an array of shape ({num_rows}, {dim}) "
                                 f"or one of {INIT_NAMES}; got {init!r}")
            init_scale = float(init_scale)
            if not (math.isfinite(init_scale) and init_scale >= 0):
                raise ValueError(f"init_scale must be finite and >= 0, got {init_scale}")
        else:
            rows = max(1, INIT_CHUNK_BYTES // (layout["stride"] * dt.itemsize))
            init = _validate_init_array(init, num_rows, dim, c, rows)

    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{str(directory)!r} exists and is not a directory")
    orphans = orphaned_files(directory)
    if orphans and not overwrite:  # a store's files without a manifest: damaged, not empty
        raise orphans_error(directory, orphans)
    if orphans:
        remove_orphans(directory)
    kind = kind_of(directory)
    if kind is not None and not overwrite:
        raise FileExistsError(
            f"a store already exists at {str(directory)!r} ({_layout.MANIFEST_FILE}, "
            f"storage={kind!r}); open it with dsa_core.open(path) or pass overwrite=True to "
            "replace it")
    if kind is not None and kind != storage:
        remove(directory)  # the other kind's files (refused while a writer holds it)
    h = Handle(None, 0, settings)  # the engine comes next
    state = State(h, 0, lr, betas, eps, maximize, ball_eps, nonfinite, durability,
                  weight_decay, decoupled_weight_decay, float(lr_decay),
                  float(initial_accumulator_value))
    ball = float(maxnorm(c, ball_eps, dt)) if c > 0 else None
    with _cleanup_on_sigterm():  # a SIGTERM removes the half-written files first
        h.store = engine.create_store(
            directory, layout, settings, init=init, init_scale=init_scale, seed=seed,
            ball_maxnorm=ball, meta=state_meta(state, optimizer=optimizer), overwrite=overwrite,
            progress=progress, space_ratio=space_ratio)
    return state


def _state_from(h: Handle, count: int, meta: dict[str, Any]) -> State:
    """The State of an opened store from the ``meta`` its last commit point recorded."""
    store = h.store
    hp, durability = meta.get("hparams"), meta.get("durability", "flush")
    if not isinstance(hp, dict):
        raise ValueError(f"store {str(store.path)!r} records no hyperparameters (it was not "
                         "written by dsa_core.create); the store is damaged or foreign")
    if durability not in DURABILITY_MODES:
        raise ValueError(f"store {str(store.path)!r} records durability {durability!r}, not "
                         f"one of {DURABILITY_MODES}; the store is damaged")
    opt = store.layout.optimizer
    if hp.get("optimizer", "adam") != opt:
        raise ValueError(f"store {str(store.path)!r} records hyperparameters of optimizer "
                         f"{hp.get('optimizer', 'adam')!r} beside records of {opt!r}; the store "
                         "is damaged. Nothing was changed; restore the store from a checkpoint")
    if opt != "adam":
        return _adagrad_state_from(h, count, hp, durability)
    try:
        state = State(h, int(count), float(hp["lr"]),
                      tuple(float(b) for b in hp["betas"]), float(hp["eps"]),
                      bool(hp["maximize"]), float(hp["ball_eps"]),
                      str(hp.get("nonfinite", "propagate")), durability,
                      float(hp.get("weight_decay", 0.0)),
                      bool(hp.get("decoupled_weight_decay", False)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"store {str(store.path)!r} records hyperparameters {hp!r} that "
                         f"lack or mangle a field ({exc!r}); the store is damaged") from None
    try:  # the rules create applies: a value create refuses is damage, not a setting
        check_hparams(hp["lr"], hp["betas"], hp["eps"], hp["maximize"], state.nonfinite)
        check_weight_decay_options(hp.get("weight_decay", 0.0),
                                   hp.get("decoupled_weight_decay", False))
        if not 0.0 <= state.ball_eps < 1.0:
            raise ValueError(f"ball_eps must lie in [0, 1), got {state.ball_eps}")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"store {str(store.path)!r} records hyperparameters that create "
                         f"refuses ({exc}); its manifest is damaged or was edited by hand. "
                         "Nothing was changed; restore the store from a checkpoint") from None
    return state


def _adagrad_state_from(h: Handle, count: int, hp: dict[str, Any], durability: str) -> State:
    """:func:`_state_from` for an Adagrad store (its hyperparameters, create's rules)."""
    store = h.store
    try:
        args = (hp["lr"], hp["lr_decay"], hp["eps"], hp["initial_accumulator_value"],
                hp["maximize"], hp.get("nonfinite", "propagate"))
        wd = hp.get("weight_decay", 0.0)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"store {str(store.path)!r} records hyperparameters {hp!r} that "
                         f"lack or mangle a field ({exc!r}); the store is damaged") from None
    try:
        lr, lr_decay, eps, iav, maximize, nonfinite = check_adagrad_hparams(*args)
        wd = check_adagrad_options(store.layout.optimizer, weight_decay=wd)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"store {str(store.path)!r} records hyperparameters that create "
                         f"refuses ({exc}); its manifest is damaged or was edited by hand. "
                         "Nothing was changed; restore the store from a checkpoint") from None
    return State(h, int(count), lr, None, eps, maximize, 0.0, nonfinite, durability, wd,
                 False, lr_decay, iav)


class _Terminated(BaseException):
    """SIGTERM arrived while ``create`` wrote a new store (see :func:`_cleanup_on_sigterm`)."""


@contextlib.contextmanager
def _cleanup_on_sigterm() -> Iterator[None]:
    """Let a SIGTERM during ``create`` remove the half-written files, then end the process.

    The default SIGTERM action ends the process at once, without running ``finally`` blocks:
    ``rows.dsa.tmp`` (possibly gigabytes) would stay behind. Here the signal raises inside
    the block instead, the caller's cleanup runs, and the process is then ended by the same
    signal (exit status as before). Only where SIGTERM has its default action and only in
    the main thread (Python delivers signals there); a program's own handler is left alone.
    """
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def _raise(signum, frame):
        raise _Terminated

    signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        raise  # pragma: no cover - the signal ends the process first
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def open(path, mode: str = "r+", *, access: str = "auto",
         memory: int | str | None = None, unclean: str = "refuse",
         optimizer: str | None = None) -> State:
    """Open an existing store; the state resumes with the stored hyperparameters and count.

    ``mode="r+"`` (default) takes the store's writer lock (a second writer gets a clear
    error); ``mode="r"`` maps it read-only, without a lock, for inspection and export while
    a training process writes. ``access`` is the paging hint, as for :func:`create`.

    The store kind (in-place or log-structured) is read from the directory. A log store
    (``create(storage="log")``) reopens at its last flush; ``memory`` is the budget of its
    region (as for :func:`create`). It takes only ``access="auto"``; ``memory=`` for an
    in-place store is an error.

    Settings are remembered: without ``access`` (or with ``"auto"``) an in-place store is
    paged as its manifest records (the ``access`` given to ``create`` or to an earlier
    ``open``), else chosen by size; without ``memory`` a log store gets its recorded budget,
    else the default (25% of this process's memory, see :func:`create`). One given here
    replaces the recorded one and is recorded from the next flush on. Stores written
    before settings were recorded open with the defaults.

    An in-place store whose writer stopped after a step and before the next flush or close
    (kill -9, power loss, ``os._exit``) may hold rows of later steps than its count: ``open``
    (either mode) raises :class:`dsa_core.UncleanStopError` saying so, unless
    ``unclean="accept"`` (open the rows as they are; the next flush clears the mark). Log
    stores and ``durability="step"`` stores reopen exactly (docs/storage.md, crash recovery).

    A store of a group that commits together (:func:`dsa_core.join`) whose group committed
    after the store's own manifest was written (a crash between the group's commit point
    and this store's part of it) is first brought to that commit (docs/storage.md,
    "Several tables: one commit"), unless another process holds it for writing.

    ``optimizer`` (``"adam"``, ``"adagrad"``, ``"rowwise_adagrad"``): the one the caller
    means to step the store with; a store created for another raises ``ValueError`` (its
    records hold another optimizer's state) after changing nothing. ``None``: any.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' (read-only) or 'r+' (read-write), got {mode!r}")
    if optimizer is not None:
        optimizer = check_optimizer(optimizer)
    check_access(access)
    check_unclean(unclean)
    directory = Path(path)
    recover(directory)  # a group commit a crash interrupted: finished first (_group_file)
    engine = ENGINES[kind_of(directory) or "inplace"]  # none: the in-place reader says why
    store, count, meta, settings = engine.open_store(directory, mode, access=access,
                                                     memory=memory, unclean=unclean)
    try:
        if optimizer is not None:
            check_store_optimizer(store.layout.optimizer, optimizer, store.path)
        ref = meta.get("group")
        return _state_from(Handle(store, count, settings,
                                  dict(ref) if isinstance(ref, dict) and mode == "r+"
                                  else None), count, meta)
    except BaseException:
        store.abandon()
        raise


def check_store_optimizer(have: str, want: str, path: Any, what: str = "") -> None:
    """``ValueError`` unless a store of optimizer ``have`` may be stepped as ``want``."""
    if have != want:
        raise ValueError(
            f"{what + ': ' if what else ''}store {str(path)!r} was created with "
            f"optimizer={have!r}, not {want!r}: its records hold {have}'s state, which "
            f"{want} cannot step. Nothing was changed; step it with its own optimizer, or "
            f"create a new store with optimizer={want!r}")


def flush(state: State) -> None:
    """Make every step so far durable: msync the rows, then replace the manifest (count).

    ``state`` must be the store's current State (the one the last :func:`step` returned):
    an outdated one would write an old count beside newer rows, and raises
    :class:`StaleStateError` instead.
    """
    require_current(state)
    h = state.handle
    meta = state_meta(state)
    g = h.group
    if g is not None:  # a member of a group (dsa_core._group): its stores commit together
        g.note([state])
        if g.stepped_since():
            g.flush([state])
            h.meta = meta
            return
    commit(h.store, int(state.count), meta)
    h.meta = meta  # the newest State's (its count is h.count)


def checkpoint(state: State, dest, *, overwrite: bool = False, copy: bool = False) -> Path:
    """Write a consistent snapshot of the store to ``dest``; training may go on afterwards.

    Flushes the live store, writes its rows (see below) and the manifest with the current
    count and hyperparameters, fsyncs them and renames the directory into place: a ``kill
    -9`` at any moment leaves either no ``dest`` or a complete one. ``dsa_core.open(dest)``
    resumes from it exactly. Replacing an existing snapshot needs ``overwrite=True``
    (swapped atomically where the filesystem allows). ``state`` must be current (see
    :func:`flush`).

    By default a snapshot may share disk blocks with the live store or with earlier
    snapshots: a log store's segments (immutable files) are hard-linked; an in-place store's
    data file is reflinked where the filesystem can, else the snapshot is the last one this
    writer took (its files hard-linked) plus the rows changed since, or a full copy
    (docs/storage.md, "Snapshots that share disk"). That makes a checkpoint cheap, but a
    block damaged on disk is then damaged in each (``dsa verify`` on the checkpoint reports
    it). ``copy=True`` writes a full copy instead, which shares no blocks with anything
    (costs a read and a write of the whole store).

    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> s = dsa_core.create(tmp / "emb", num_rows=10, dim=4)
    >>> s = dsa_core.step(s, [1], np.ones((1, 4), np.float32))
    >>> dsa_core.checkpoint(s, tmp / "ckpt").name
    'ckpt'
    >>> s = dsa_core.step(s, [1], np.ones((1, 4), np.float32))   # training goes on
    >>> snap = dsa_core.open(tmp / "ckpt", mode="r")
    >>> snap.count, s.count
    (1, 2)
    >>> dsa_core.close(snap); dsa_core.close(s)
    """
    require_current(state)
    dest = Path(dest)
    if dest.resolve() == state.store.path.resolve():
        raise ValueError(f"checkpoint destination {str(dest)!r} is the live store itself; "
                         "choose another directory")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                              "overwrite=True to replace it")
    if not isinstance(copy, (bool, np.bool_)):
        raise TypeError(f"copy must be a bool (True: a full copy that shares no blocks with "
                        f"the store), got {copy!r}")
    g = state.handle.group
    if g is not None:  # its group commits first, together
        g.note([state])
        if g.stepped_since():
            g.flush([state])
    return state.store.checkpoint(dest, int(state.count), state_meta(state),
                                  overwrite=overwrite, share=not copy)


def checkpoint_many(dest, stores: Mapping[str, Any], *, overwrite: bool = False,
                    copy: bool = False, live: Iterable = (), what: str = ""
                    ) -> contextlib.AbstractContextManager[Path]:
    """Write several stores, and what else a ``with`` block writes, as one directory
    ``dest`` that appears complete or not at all: the multi-store checkpoint of the
    adapters.

    Each entry of ``stores`` goes to ``dest/<name>``: an open ``State`` as its
    :func:`checkpoint` (flushed first; ``copy`` as there), a directory (a closed store,
    or a snapshot or checkpoint of one) as a copy of its files (never hard links: the copy
    may be trained in place; reflinked where the filesystem can unless ``copy``, else read
    with ``O_DIRECT``; not its ``writer.lock`` nor ``*.tmp*`` leftovers). The name
    ``"."`` (a directory, the only entry) copies it into ``dest`` itself. The ``with``
    block then writes the rest into the staging directory it is given (a manifest, a
    framework's state dict; or new stores, with ``stores`` empty); when it ends,
    everything is fsync'd and renamed into place at once (an existing ``dest`` swapped
    atomically where the filesystem allows). An error anywhere, in the block too, leaves
    ``dest`` as it was.

    Checked when called, before anything is written: ``dest`` neither is nor contains a
    live store (the directory of each ``State`` and each directory of ``live``:
    ``ValueError``), and an existing ``dest`` needs ``overwrite=True``
    (``FileExistsError``). ``what`` (the caller's name) starts both messages.

    >>> import tempfile, pathlib, dsa_core
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> u, i = dsa_core.create(tmp / "u", 10, 4), dsa_core.create(tmp / "i", 20, 4)
    >>> with dsa_core.checkpoint_many(tmp / "ckpt", {"user": u, "item": i}) as staged:
    ...     dsa_core.tools.write_json(staged / "meta.json", {"epoch": 3})
    >>> sorted(p.name for p in (tmp / "ckpt").iterdir())
    ['item', 'meta.json', 'user']
    >>> dsa_core.close(u); dsa_core.close(i)
    """
    dest = Path(dest)
    dest_r = dest.resolve()
    head = f"{what}: " if what else ""
    states = {n: s for n, s in stores.items() if isinstance(s, State)}
    dirs = {n: Path(s) for n, s in stores.items() if not isinstance(s, State)}
    if "." in stores and (len(stores) > 1 or states):
        raise ValueError(f"{head}the name '.' (a directory copied into the checkpoint "
                         "itself) must name a directory and be the only entry")
    for p in [*(Path(s.path) for s in states.values()), *map(Path, live)]:
        p = p.resolve()
        if dest_r == p or dest_r in p.parents:
            raise ValueError(f"{head}checkpoint destination {str(dest)!r} would replace or "
                             f"contain the live store directory {str(p)!r}; choose another "
                             "directory")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{head}checkpoint destination {str(dest)!r} exists; pass "
                              "overwrite=True to replace it")
    return _staged_checkpoint(dest_r, states, dirs, overwrite, copy)


@contextlib.contextmanager
def _staged_checkpoint(dest: Path, states: dict[str, State], dirs: dict[str, Path],
                       overwrite: bool, copy: bool) -> Iterator[Path]:
    """:func:`checkpoint_many` once checked: the stores staged, then the block."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(dest, overwrite) as tmp:
        for name, st in states.items():
            checkpoint(st, tmp / name, copy=copy)
        for name, src in dirs.items():
            copy_tree(src, tmp / name, share=not copy)
        yield tmp


_RESTORE_CHUNK_BYTES = 1 << 24  # 16 MiB of records per copy chunk


def check_same_layout(live: State, other: State, what: str = "") -> None:
    """Raise ``ValueError`` unless the two stores have identical record layouts."""
    have, want = live.store.layout.as_dict(), other.store.layout.as_dict()
    ho, wo = have.get("optimizer", "adam"), want.get("optimizer", "adam")
    if ho != wo:
        raise ValueError(
            f"{what + ': ' if what else ''}the store {str(other.path)!r} holds {wo}'s state "
            f"(optimizer={wo!r}), but the store {str(live.path)!r} is {ho}'s (optimizer="
            f"{ho!r}); records move only between stores of one optimizer")
    if have != want:
        raise ValueError(
            f"{what + ': ' if what else ''}the store {str(other.path)!r} holds a "
            f"{want['num_rows']} x {want['dim']} {want['dtype']} table with curvature "
            f"{want['curvature']} (layout {want}), but the store {str(live.path)!r} is "
            f"{have['num_rows']} x {have['dim']} {have['dtype']} with curvature "
            f"{have['curvature']} (layout {have}); records move only between stores created "
            "the same way")


def restore(live: State, snapshot: State) -> State:
    """Copy every record of ``snapshot`` into the store of ``live``; returns its new State.

    For resuming into stores that already exist (an optimizer's own stores) from a
    checkpoint: the layouts must be equal (checked before anything is written). The undo
    journal is voided first (a journal of the last step could otherwise roll restored rows
    back at the next ``open``), the records are copied in chunks, and ``live`` is flushed
    at the snapshot's count (its hyperparameters stay ``live``'s). Not atomic: a crash in the middle
    leaves ``live`` mixed (its ``open`` then refuses it: UncleanStopError); open it with
    ``unclean="accept"`` and run the restore again. ``live`` must be current; the State
    returned is, and earlier ones are outdated.

    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> s = dsa_core.create(tmp / "emb", num_rows=10, dim=4)
    >>> s = dsa_core.step(s, [3], np.ones((1, 4), np.float32))
    >>> _ = dsa_core.checkpoint(s, tmp / "ckpt")
    >>> s = dsa_core.step(s, [3], np.ones((1, 4), np.float32))
    >>> snap = dsa_core.open(tmp / "ckpt", mode="r")
    >>> s = dsa_core.restore(s, snap); dsa_core.close(snap)
    >>> s.count
    1
    >>> dsa_core.close(s)
    """
    require_current(live)
    check_same_layout(live, snapshot)
    if snapshot.closed:
        raise closed_error(snapshot.store, "the snapshot", read_only=True)
    _copy_records(snapshot, live)  # range writes: no undo journal rolls them back
    return set_count(live, snapshot.count)


def restore_records(live: State, records: Any, count: int) -> State:
    """:func:`restore` from every record of a store held in memory (a state dict's rows)
    rather than from a snapshot store: ``records`` of shape ``(num_rows, stride)`` in the
    store dtype (:func:`read_records` of every row), written in chunks of ~16 MiB as range
    writes (no undo journal of the last step may roll them back), then ``live`` flushed at
    ``count``. Checked before anything is written; ``live`` must be current; the State
    returned is, and earlier ones are outdated.
    """
    require_current(live)
    st = live.store
    lay = st.layout
    rec = np.asarray(records)
    if rec.dtype != lay.dtype or rec.shape != (lay.num_rows, lay.stride):
        raise ValueError(f"records must be a ({lay.num_rows}, {lay.stride}) {lay.dtype.name} "
                         f"array (every record of store {str(st.path)!r}), got "
                         f"{rec.shape} {rec.dtype}")
    for lo, hi in _record_chunks(lay):
        st.write(slice(lo, hi), rec[lo:hi])
    return set_count(live, count)


def _record_chunks(lay) -> Iterator[tuple[int, int]]:
    """Row ranges ``(lo, hi)`` of ~16 MiB of records (``_RESTORE_CHUNK_BYTES``) covering the
    table of layout ``lay``: the unit of every whole-table copy."""
    step = max(1, _RESTORE_CHUNK_BYTES // (lay.stride * lay.dtype.itemsize))
    for lo in range(0, lay.num_rows, step):
        yield lo, min(lay.num_rows, lo + step)


def _copy_records(src: State, dst: State) -> None:
    """Every record of ``src`` into ``dst`` (equal layouts), in chunks of ~16 MiB."""
    st = dst.store
    for lo, hi in _record_chunks(st.layout):
        st.write(slice(lo, hi), src.store.read(slice(lo, hi)))  # in place: marked unclean first


def convert(src: State, dest, *, storage: str, memory: int | str | None = None,
            overwrite: bool = False, optimizer: str | None = None) -> State:
    """Copy a store into a new one of another kind; returns the new store's open State.

    ``dest`` gets ``src``'s layout (shape, dtype, options), hyperparameters, durability and
    count, and every record of ``src``, copied in chunks of ~16 MiB: the two stores then
    hold the same bits and train identically. Either direction: ``storage="log"``
    (``memory`` as for :func:`create`) or ``storage="inplace"``. ``src`` may be read-only or
    outdated (it is only read: the records on disk and in memory now, at the count of
    ``src``'s store); it stays open. ``dest`` remembers ``src``'s remembered settings that
    its kind takes (``access`` in place, ``memory`` for a log store, unless ``memory`` is
    given). A failed copy leaves a ``dest`` that must not be used (create it again with
    ``overwrite=True``). ``optimizer``, if given, must be ``src``'s (records do not convert
    between optimizers: a clear error, before anything is written).

    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> s = dsa_core.create(tmp / "a", num_rows=10, dim=4, init="normal")
    >>> s = dsa_core.step(s, [3], np.ones((1, 4), np.float32))
    >>> t = dsa_core.convert(s, tmp / "b", storage="log", memory="1MiB")
    >>> same = dsa_core.gather(t, range(10)) == dsa_core.gather(s, range(10))
    >>> t.storage, t.count, bool(same.all())
    ('log', 1, True)
    >>> dsa_core.close(t); dsa_core.close(s)
    """
    storage = check_storage(storage, auto=False)
    memory = check_memory_arg(memory, storage)
    h = src.handle
    st = h.store
    if h.closed:
        raise closed_error(st, "the source", read_only=True)
    if optimizer is not None:
        check_store_optimizer(st.layout.optimizer, check_optimizer(optimizer), st.path,
                              "convert")
    if Path(dest).resolve() == Path(st.path).resolve():
        raise ValueError(f"convert destination {str(dest)!r} is the source store itself; "
                         "choose another directory")
    lay = st.layout.as_dict()
    # src's remembered settings that dest's kind takes (an explicit memory= wins)
    keep = {k: v for k, v in h.settings.items() if k in ENGINES[storage].SETTINGS}
    if memory is None:
        memory = keep.get("memory")
    out = create(dest, lay["num_rows"], lay["dim"], curvature=lay["curvature"], lr=src.lr,
                 betas=src.betas, eps=src.eps, maximize=src.maximize,
                 optimizer=lay.get("optimizer", "adam"), lr_decay=src.lr_decay,
                 initial_accumulator_value=src.initial_accumulator_value,
                 weights=lay["w"] is not None, dtype=lay["dtype"],
                 ball_eps=src.ball_eps if lay["curvature"] > 0 else None,
                 nonfinite=src.nonfinite, align=int(lay.get("align", 0)),
                 durability=src.durability if src.durability in DURABILITY_MODES
                 else "flush", overwrite=overwrite,
                 second_moment=lay.get("second_moment", "elementwise"),
                 first_moment=lay.get("first_moment", "full"),
                 weight_decay=src.weight_decay,
                 decoupled_weight_decay=src.decoupled_weight_decay,
                 decay_missed_steps="last_step" in lay, per_row_step="row_step" in lay,
                 storage=storage, memory=memory, progress=False,
                 access=keep.get("access", "auto"))
    try:
        check_same_layout(out, src, "convert")
        _copy_records(src, out)
        return set_count(out, h.count)
    except BaseException:
        close(out)
        raise


def set_count(state: State, count: int) -> State:
    """Declare that the rows of the store have taken ``count`` steps; returns that State.

    For importers that write moments themselves (e.g. from a ``torch.optim.SparseAdam``
    state dict, or a reshard): the bias correction of the next step uses ``count + 1``.
    The new count is made durable at once (flush); ``state`` must be current, and becomes
    outdated.
    """
    require_current(state)
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) \
            or count < 0:
        raise ValueError(f"count must be an int >= 0 (the number of completed steps), got "
                         f"{count!r}")
    new = state._replace(count=int(count))
    state.handle.count = new.count  # the engine's: at the flush
    flush(new)
    return new


def read_records(state: State, idx: Any) -> np.ndarray:
    """A copy of the whole records (weights, m, v, padding) of rows ``idx``.

    Shape ``(len(idx), state.layout["stride"])`` in the store dtype, in the layout of
    ``state.layout``. With :func:`write_records`, this moves rows between stores of equal
    layout entries (resharding, merging) without knowing what a record holds.
    """
    st = state.store
    if state.closed:
        raise closed_error(st)
    return st.read(as_index(idx, st.layout.num_rows))


def write_records(state: State, idx: Any, records: Any) -> None:
    """Overwrite the whole records of rows ``idx`` (unique ids) with ``records``.

    ``records`` must have shape ``(len(idx), stride)`` and the store dtype, as
    :func:`read_records` returns them for a store of the same layout. Checked before
    anything is written; ``state`` must be current. Durable at the next flush.
    """
    require_current(state)
    st = state.store
    idx = as_index(idx, st.layout.num_rows)
    rec = np.asarray(records)
    lay = st.layout
    if rec.dtype != lay.dtype or rec.shape != (idx.shape[0], lay.stride):
        raise ValueError(f"records must be a ({idx.shape[0]}, {lay.stride}) {lay.dtype.name} "
                         f"array (whole records of store {str(st.path)!r}), got "
                         f"{rec.shape} {rec.dtype}")
    if idx.shape[0] > 1 and np.unique(idx).shape[0] != idx.shape[0]:
        raise ValueError("idx must not repeat a row in write_records (which record would win "
                         "is undefined); pass unique row ids")
    st.write(idx, rec)


def close(state: State) -> None:
    """Flush (if writable) and release the writer lock. Safe to call twice, through any
    State of the store.

    Through an outdated State (one that :func:`step` has since replaced) it closes the store
    at its newest count, with the settings of the newest step or flush: never the outdated
    State's count, which would pair an old count with newer rows.
    """
    h = state.handle
    st = h.store
    if h.closed:
        return
    if st.mode == "r+":
        if state.count != h.count:
            if h.meta is None:  # no step or flush recorded the newest State's meta
                require_current(state)
            g = h.group
            if g is not None and g.stepped_since():
                g.flush()  # every member at its newest step, as one commit
            else:
                commit(st, h.count, h.meta)
        else:
            flush(state)  # with its group, if a member stepped since the group's last commit
    if h.group is not None:  # it leaves its group (which commits without it from now on)
        h.group.leave(h)
    st.close()
    h.closed = True


def _require_writable(state: State) -> None:
    st = state.handle.store
    if state.handle.closed:
        raise closed_error(st)
    if st.mode != "r+":
        raise ValueError(f"store {str(st.path)!r} was opened read-only (mode='r'); "
                         "open it with mode='r+' to train")


def require_current(state: State) -> None:
    """The store is open for writing and ``state`` is its newest State, or a clear error."""
    _require_writable(state)
    if state.count != state.handle.count:
        raise StaleStateError(
            f"this State of store {str(state.path)!r} is outdated: it is at step "
            f"{state.count}, but the store has moved on to step {state.handle.count} through "
            "a newer State. dsa_core.step returns a new State and the old one may not step, "
            "flush, checkpoint or close again (that would mix counts with rows): keep the "
            "returned value, `state = dsa_core.step(state, idx, grad)`")


def remove(path) -> None:
    """Delete a store directory (refused while a writer holds it)."""
    directory = Path(path)
    ENGINES[kind_of(directory) or "inplace"].remove_store(directory)
