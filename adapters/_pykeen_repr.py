"""PyKEEN representations with row-sparse gradients: in RAM, or with the weights on disk."""

from __future__ import annotations

import atexit
import difflib
import functools
import math
import os
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pykeen.nn.init import PretrainedInitializer, initializer_resolver
from pykeen.nn.representation import (
    Embedding,
    Representation,
    constrainer_resolver,
    process_max_id,
    process_shape,
)
from pykeen.utils import compose

import dsa_core

from ._storage import STORAGE_DEFAULT
from ._torch_common import SharedState, close_quietly
from ._torch_embedding import DiskEmbedding, DiskWeight

__all__ = ["DiskBackedEmbedding", "SparseEmbedding"]

#: rows per chunk when a whole table is initialised, constrained or read
CHUNK_ROWS = 1 << 16

#: the store options that ``disk_representations`` / ``DiskBackedEmbedding.at`` bind
OPTIONS = ("overwrite", "storage", "memory", "access", "max_full_rows", "chunk_rows",
           "optimizer")

#: why a DiskBackedEmbedding never resumes its store, and what works instead
NO_RESUME = (
    "PyKEEN re-initialises a model's tables when it trains (reset_parameters_() at the start "
    "of every train() without continue_training), which would overwrite the weights, m and v "
    "of a resumed store before its first step. To continue an earlier run, train with "
    "PyKEEN's checkpoints (training_kwargs=dict(checkpoint_name=...)) and rerun with "
    "overwrite=True (disk_representations(root, overwrite=True)): PyKEEN then loads the "
    "checkpoint's tables and moments into the new stores. To start afresh, pass "
    "overwrite=True too, or use another directory")


def check_options(options: Mapping[str, Any], what: str) -> None:
    """``TypeError`` for a keyword that is not a store option (naming the known ones and the
    nearest); ``ValueError`` for ``resume`` (see :data:`NO_RESUME`)."""
    if "resume" in options:
        raise ValueError(f"{what}: resume={options['resume']!r} is not supported: {NO_RESUME}")
    bad = [k for k in options if k not in OPTIONS]
    if bad:
        near = difflib.get_close_matches(bad[0], OPTIONS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise TypeError(
            f"{what}: unknown option(s) {', '.join(map(repr, bad))}{hint}; nothing was "
            f"created. The options are {', '.join(OPTIONS)}")


class _Touched:
    """The row ids a representation looked up with gradients since its last constraint."""

    def __init__(self):
        self.ids: list[torch.Tensor] = []
        self.held = 0
        self.all = False

    def add(self, ids: torch.Tensor | None) -> None:
        if ids is None:
            self.all, self.ids, self.held = True, [], 0
        elif not self.all:
            self.ids.append(ids.detach().reshape(-1).cpu())
            self.held += self.ids[-1].numel()
            if self.held > 1 << 20:  # a loop that never constrains: keep the distinct ids only
                self.ids = [torch.unique(torch.cat(self.ids))]
                self.held = self.ids[0].numel()

    def take(self) -> torch.Tensor | None:
        """The distinct ids (sorted), or None for "every row"; then forgets them."""
        every, ids = self.all, self.ids
        self.all, self.ids, self.held = False, [], 0
        if every:
            return None
        if not ids:
            return torch.empty(0, dtype=torch.long)
        return torch.unique(torch.cat(ids))


def _constrain(constrainer, x: torch.Tensor, shape: Sequence[int], is_complex: bool,
               width: int) -> torch.Tensor:
    """``constrainer`` applied to flat rows ``x`` (k, width); the flat rows it returns."""
    y = x.view(x.shape[0], *shape)
    if is_complex:
        y = torch.view_as_complex(y)
    y = constrainer(y)
    if is_complex:
        y = torch.view_as_real(y)
    return y.reshape(x.shape[0], width)


class _Redraw(torch.nn.Module):
    """Where a PyKEEN Embedding has its ``nn.Embedding``: a child whose ``reset_parameters``
    draws ``N(0, 1)`` for the table as that one does, in the same place of a model's reset
    (PyKEEN resets children before parents), for a table of one chunk; the parent hands the
    draw to its initializer."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, limit: int):
        super().__init__()
        self.rows, self.width, self.dtype, self.limit = rows, width, dtype, limit
        self.drawn: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        if self.rows <= self.limit:
            self.drawn = torch.empty(self.rows, self.width, dtype=self.dtype).normal_()

    def take(self, lo: int, hi: int) -> torch.Tensor:
        if self.drawn is not None and (lo, hi) == (0, self.rows):
            x, self.drawn = self.drawn, None
            return x
        return torch.empty(hi - lo, self.width, dtype=self.dtype).normal_()


# the modules whose initializers draw from torch's global generator only, so that drawing
# again from a saved state of it gives the same rows (PyKEEN's and torch's own)
_REPLAYABLE_MODULES = ("torch.nn.init", "torch.nn.functional", "pykeen.nn.init")


def replays(initializer: Any) -> bool:
    """Whether ``initializer`` gives the same rows when called again from the same state of
    torch's global generator: a ``PretrainedInitializer`` (no draws), an initializer of
    PyKEEN's or ``torch.nn.init`` (also bound to keywords by PyKEEN's resolver, without a
    ``generator`` of its own), or PyKEEN's composition of them. Any other callable may draw
    from elsewhere (numpy, its own generator), so its reset is written at once."""
    if isinstance(initializer, PretrainedInitializer):
        return True
    if isinstance(initializer, functools.partial):
        return "generator" not in initializer.keywords and replays(initializer.func)
    if isinstance(initializer, compose):
        return all(map(replays, initializer.operations))
    return callable(initializer) and getattr(initializer, "__module__", None) in \
        _REPLAYABLE_MODULES


def _chunks(rows: int, chunk_rows: int):
    for lo in range(0, rows, chunk_rows):
        yield lo, min(rows, lo + chunk_rows)


def _write_rows(state: dsa_core.State, ids: np.ndarray, rows: torch.Tensor, *,
                fresh: bool) -> None:
    """Write weight rows ``rows`` of ``ids``; ``fresh``: zero their moments as well."""
    lay = state.layout
    rec = (np.zeros((ids.shape[0], int(lay["stride"])), state.dtype) if fresh
           else dsa_core.read_records(state, ids))
    o = int(lay["w"])
    rec[:, o:o + state.dim] = rows.detach().cpu().numpy()
    dsa_core.write_records(state, ids, rec)


class _Init:
    """How a DiskBackedEmbedding's rows start: its initializer, chunk by chunk.

    Holds no module, so a reset waiting to be written (:class:`_Pending`) can outlive the
    representation (it is written when the store closes, at garbage collection too).
    """

    def __init__(self, max_id: int, chunk_rows: int, shape: tuple[int, ...], width: int,
                 dtype: torch.dtype, is_complex: bool, initializer: Any):
        self.max_id, self.chunk_rows, self.shape, self.width = max_id, chunk_rows, shape, width
        self.dtype, self.is_complex, self.initializer = dtype, is_complex, initializer

    def chunks(self):
        return _chunks(self.max_id, self.chunk_rows)

    def rows(self, lo: int, hi: int, normal: torch.Tensor | None = None) -> torch.Tensor:
        """The initial rows ``lo:hi`` (flat, ``(hi - lo, width)``), drawn from torch's
        generator as PyKEEN's Embedding draws them: its ``N(0, 1)`` (``normal``, else drawn
        here) handed to the initializer; a ``PretrainedInitializer`` is sliced."""
        if isinstance(self.initializer, PretrainedInitializer):
            x = self.initializer.tensor[lo:hi]  # the rows a whole-table call returns
            if x.is_complex():
                x = torch.view_as_real(x)
            x = x.to(self.dtype)
        else:
            if normal is None:
                normal = torch.empty(hi - lo, self.width, dtype=self.dtype).normal_()
            x = self.initializer(normal.view(hi - lo, *self.shape))
        return x.reshape(hi - lo, self.width)


class _Pending:
    """A reset not written yet: the state of torch's generator when it was drawn, and the
    constrainer to apply after it (the model's ``post_parameter_update`` of every row)."""

    def __init__(self, init: _Init, rng: torch.Tensor):
        self.init, self.rng = init, rng
        self.constrainer = None

    def write(self, state: dsa_core.State) -> None:
        """Draw the reset's rows again from the saved generator state and write them (fresh
        moments); torch's generator is left where it was."""
        init, now = self.init, torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            with torch.no_grad():
                for lo, hi in init.chunks():
                    x = init.rows(lo, hi).to(init.dtype)  # as the eager reset stores them
                    if self.constrainer is not None:
                        x = _constrain(self.constrainer, x, init.shape, init.is_complex,
                                       init.width)
                    _write_rows(state, np.arange(lo, hi, dtype=np.int64), x, fresh=True)
        finally:
            torch.set_rng_state(now)


class _Handle(SharedState):
    """The shared State of a DiskBackedEmbedding's table, with the reset waiting to be written
    (``pending``): flushing or closing the store writes it first, whoever does it (the
    module, the optimizer, garbage collection; at interpreter exit :func:`_write_at_exit`).
    Only the process that built the table writes it: a forked child (a DataLoader worker)
    never writes its parent's store, also not when it exits."""

    __slots__ = ("pending", "pid")

    def __init__(self, state: dsa_core.State):
        super().__init__(state)
        self.pending: _Pending | None = None
        self.pid = os.getpid()
        _HANDLES.add(self)

    def write_pending(self) -> None:
        """Write the pending reset, if any (then flush: the first rows are durable)."""
        p = self.pending
        if p is None or self.closed:
            return
        if os.getpid() != self.pid:
            raise RuntimeError(
                f"the table at {str(self.state.path)!r} has not been written since its last "
                f"reset, and only the process that built it (pid {self.pid}) writes it; this "
                f"one (pid {os.getpid()}) was forked from it. Read or flush the table "
                "(rep.flush()) before forking")
        p.write(self.state)
        self.pending = None
        dsa_core.flush(self.state)

    def flush(self) -> None:
        self.write_pending()
        super().flush()

    def close(self) -> None:
        try:
            if os.getpid() == self.pid:
                self.write_pending()
        finally:
            super().close()


_HANDLES: weakref.WeakSet[_Handle] = weakref.WeakSet()  # every table's, for the exit


def _write_at_exit() -> None:
    """Write the pending resets of the tables nobody closed, at interpreter exit.

    It must run before dsa_core's exit-time flush of unclosed stores, which leaves their
    files closed (a ``weakref.finalize`` at exit runs after it: too late). Both hooks are
    ``threading._register_atexit`` callbacks, which run newest first, and dsa_core, imported
    before this module, registered its own at import. A failure is printed (nowhere to
    raise to); the table then keeps its zeros, at step 0.
    """
    for h in list(_HANDLES):
        if h.pid != os.getpid():  # a forked child's copy: its parent writes it
            continue
        try:
            h.write_pending()
        except BaseException as exc:  # noqa: BLE001 - at exit: say so, go on
            print(f"adapters.pykeen: the first rows of {str(h.state.path)!r} could not be "
                  f"written at exit ({exc!r}); the store holds zeros at step 0",
                  file=sys.stderr, flush=True)


try:
    threading._register_atexit(_write_at_exit)
except (AttributeError, RuntimeError):  # pragma: no cover - another Python, or at shutdown
    atexit.register(_write_at_exit)


def _written_first(method):
    """``method`` of DiskEmbedding, after the table's pending reset is written."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._handle.write_pending()
        return method(self, *args, **kwargs)
    return wrapper


class _Weight(DiskWeight):
    """The table's stand-in weight: reading its values writes a pending reset first."""

    def _dsa_table(self) -> torch.Tensor:
        h = self._dsa_handle
        if isinstance(h, _Handle):
            h.write_pending()
        return super()._dsa_table()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs)
        if type(out) is DiskWeight and isinstance(out._dsa_handle, _Handle):  # .data
            out = _Weight(out._dsa_handle, out.dtype, out.device, what=out._dsa_what,
                          readable=out._dsa_readable, requires_grad=False)
        return out


class _Table(DiskEmbedding):
    """The DiskEmbedding of a DiskBackedEmbedding: its store's rows may wait for a pending
    reset (:class:`_Handle`), which every read, save, load, flush and close writes first."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._finalizer.detach()
        self._handle = _Handle(self._handle.state)
        self._finalizer = weakref.finalize(self, close_quietly, [self._handle])
        w = self.weight
        self.weight = _Weight(self._handle, w.dtype, w.device, requires_grad=w.requires_grad)

    def _get_name(self) -> str:  # in a model's repr
        return "DiskEmbedding"

    store = property(_written_first(DiskEmbedding.store.fget),
                     doc=DiskEmbedding.store.__doc__)
    forward = _written_first(DiskEmbedding.forward)
    weight_rows = _written_first(DiskEmbedding.weight_rows)
    to_tensor = _written_first(DiskEmbedding.to_tensor)
    export = _written_first(DiskEmbedding.export)
    checkpoint = _written_first(DiskEmbedding.checkpoint)
    load_checkpoint = _written_first(DiskEmbedding.load_checkpoint)
    get_extra_state = _written_first(DiskEmbedding.get_extra_state)
    _save_to_state_dict = _written_first(DiskEmbedding._save_to_state_dict)
    _load_from_state_dict = _written_first(DiskEmbedding._load_from_state_dict)
    close = _written_first(DiskEmbedding.close)  # raises what the write raises (gc: quiet)


def write_pending(params) -> None:
    """Write the pending reset of every DiskBackedEmbedding table among ``params``."""
    for p in params:
        h = getattr(p, "_dsa_handle", None) if isinstance(p, DiskWeight) else None
        if isinstance(h, _Handle):
            h.write_pending()


class SparseEmbedding(Embedding):
    """PyKEEN's :class:`~pykeen.nn.representation.Embedding` with row-sparse gradients.

    The same arguments (``initializer``, ``constrainer``, ``regularizer``, ``normalizer``,
    ``dropout``, complex ``dtype``) and the same initial values for the same seed; three
    differences, so that a sparse optimizer (``torch.optim.SparseAdam``,
    :class:`adapters.pykeen.DiskAdam`) steps only the rows a batch used:

    - the table is an ``nn.Embedding(sparse=True)``: a batch gives it a gradient of its rows;
    - ``indices=None`` (1-to-all scoring, LCWA) looks every row up through the embedding,
      so the gradient is row-sparse too (all rows), never dense;
    - the constrainer runs after each step on the rows looked up since the last one (at a
      reset: on every row), not on the whole table. It must act on each row on its own
      (PyKEEN's ``normalize``, ``complex_normalize``, ``clamp``, ``clamp_norm`` do).

    ---
    name: Sparse Embedding
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._embeddings.sparse = True
        self._touched = _Touched()

    def reset_parameters(self) -> None:  # noqa: D102
        super().reset_parameters()
        self._touched.add(None)  # the model's post_parameter_update constrains every row

    def _plain_forward(self, indices: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        if indices is None:
            prefix = (self.max_id,)
            ids = torch.arange(self.max_id, device=self.device)
        else:
            prefix = indices.shape
            ids = indices.to(self.device)
        if torch.is_grad_enabled() and self._embeddings.weight.requires_grad:
            self._touched.add(indices)
        x = self._embeddings(ids).view(*prefix, *self._shape)
        if self.is_complex:
            x = torch.view_as_complex(x)
        return x

    def post_parameter_update(self) -> None:  # noqa: D102
        ids = self._touched.take()
        if self.constrainer is None or (ids is not None and ids.numel() == 0):
            return
        w = self._embeddings.weight.data
        if ids is None:
            ids = torch.arange(self.max_id)
        ids = ids.to(w.device)
        w[ids] = _constrain(self.constrainer, w[ids], self._shape, self.is_complex,
                            w.shape[1])


class DiskBackedEmbedding(Representation):
    """A PyKEEN embedding whose weights, m and v live in a dsa_core store on disk.

    For entity tables larger than memory. Takes :class:`~pykeen.nn.representation.Embedding`'s
    arguments (``max_id``, ``shape`` / ``embedding_dim``, ``initializer``, ``constrainer``,
    ``regularizer``, ``normalizer``, ``dropout``, complex ``dtype``) plus where the store goes.
    A forward reads only the looked-up rows from disk (``adapters.torch.DiskEmbedding``) and
    gives its parameter a row-sparse gradient; :class:`adapters.pykeen.DiskAdam` steps the
    store. The initializer and the constrainer run on chunks of ``chunk_rows`` rows (the
    constrainer after each step on the rows looked up since the last one), so nothing of the
    table's size is held in memory, except by ``indices=None`` (see ``max_full_rows``).

    Up to ``chunk_rows`` rows the table draws the same numbers from torch's generator as
    PyKEEN's Embedding, in the same order (the ``nn.Embedding``'s ``N(0, 1)`` at construction
    and at each reset, then the initializer), so a same-seeded pipeline starts from the same
    weights; a larger table draws per chunk, from the same distribution (PyKEEN's
    initializers depend on the row shape only; a ``PretrainedInitializer`` is sliced), and
    its reset is written when the table is first read, saved or closed (see
    :meth:`reset_parameters`), so that ``pipeline()``'s two resets write it once.

    Parameters (beyond Embedding's)
    -------------------------------
    state_dir : str or Path
        Directory of the store. Usually set by :func:`adapters.pykeen.disk_representations`,
        since a PyKEEN model passes its own ``*_representations_kwargs``.
    overwrite : bool, default False
        Replace a store already at ``state_dir`` (else ``FileExistsError``, naming what
        works). PyKEEN re-initialises the model when it trains, so a store is never resumed
        here (``resume=True`` raises ``ValueError``): to continue a run, use PyKEEN's
        checkpoints (``training_kwargs=dict(checkpoint_name=...)``) with ``overwrite=True``;
        the model's state dict names a snapshot of the table.
    storage, memory, access :
        As for ``adapters.torch.DiskEmbedding``.
    max_full_rows : int, default 2**22
        ``indices=None`` (1-to-all scoring, LCWA training, evaluation without ``slice_size``)
        gathers the whole table into memory; above this many rows it raises instead and
        names ``slice_size`` (evaluation streams the table in slices of that many rows).
    chunk_rows : int, default 65536
        Rows per chunk for the initializer and the constrainer.
    optimizer : "adam" (default), "adagrad" or "rowwise_adagrad"
        Whose state the records hold: :class:`adapters.pykeen.DiskAdam`'s, or
        :class:`adapters.pykeen.DiskAdagrad`'s (``rowwise=True`` for ``"rowwise_adagrad"``).

    ---
    name: Disk-backed Embedding
    """

    #: set on the subclasses that :func:`adapters.pykeen.disk_representations` binds
    bound_state_dir: ClassVar[Path | None] = None
    bound_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, max_id: int | None = None, num_embeddings: int | None = None,
                 embedding_dim: int | None = None, shape: None | int | Sequence[int] = None,
                 initializer: Any = None, initializer_kwargs: Mapping[str, Any] | None = None,
                 constrainer: Any = None, constrainer_kwargs: Mapping[str, Any] | None = None,
                 trainable: bool = True, dtype: torch.dtype | None = None, *,
                 state_dir=None, overwrite: bool | None = None,
                 storage: str | None = None, memory: int | str | None = None,
                 access: str | None = None, max_full_rows: int | None = None,
                 chunk_rows: int | None = None, optimizer: str | None = None, **kwargs):
        opts = dict(self.bound_options)
        for k, v in (("overwrite", overwrite), ("storage", storage), ("memory", memory),
                     ("access", access), ("max_full_rows", max_full_rows),
                     ("chunk_rows", chunk_rows), ("optimizer", optimizer)):
            if v is not None:
                opts[k] = v
        if "resume" in kwargs:
            check_options({"resume": kwargs.pop("resume")}, "DiskBackedEmbedding")
        if state_dir is None:
            state_dir = self.bound_state_dir
        if state_dir is None:
            raise ValueError(
                "DiskBackedEmbedding needs state_dir=... (where its store goes); in a PyKEEN "
                "model pass model_kwargs=adapters.pykeen.disk_representations(root_dir), "
                "which gives each table its own directory under root_dir")
        if not trainable:
            raise ValueError("DiskBackedEmbedding is for trained tables; a frozen one "
                             "(trainable=False) is PyKEEN's Embedding")
        max_id = process_max_id(max_id, num_embeddings)
        _, shape = process_shape(embedding_dim, shape)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        self.is_complex = dtype.is_complex
        self._shape = tuple(shape) + ((2,) if self.is_complex else ())
        if self.is_complex:
            dtype = getattr(torch, torch.finfo(dtype).dtype)
        kwargs.setdefault("unique", False)  # as Embedding: look duplicates up as they come
        super().__init__(max_id=max_id, shape=shape, **kwargs)
        self.initializer = initializer_resolver.make(initializer, initializer_kwargs)
        self.constrainer = constrainer_resolver.make_safe(constrainer, constrainer_kwargs)
        self.max_full_rows = int(opts.pop("max_full_rows", 1 << 22))
        self.chunk_rows = int(opts.pop("chunk_rows", CHUNK_ROWS))
        if self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")
        self.width = int(math.prod(self._shape))
        # nn.Embedding draws N(0, 1) at construction; draw it too (for a table of one chunk)
        # so that torch's generator is where PyKEEN's Embedding leaves it
        if not opts.get("overwrite", False):
            self._refuse_existing(Path(state_dir), max_id)
        init = (torch.empty(max_id, self.width, dtype=dtype).normal_()
                if max_id <= self.chunk_rows else "zeros")
        self.table = _Table(
            max_id, self.width, state_dir=state_dir, init=init, dtype=dtype,
            overwrite=bool(opts.get("overwrite", False)),
            storage=opts.get("storage", STORAGE_DEFAULT), memory=opts.get("memory"),
            access=opts.get("access", "auto"), optimizer=opts.get("optimizer", "adam"),
            progress=False,
            seed=0)  # unused (init is given); a None would draw from torch's generator
        self._redraw = _Redraw(max_id, self.width, dtype, self.chunk_rows)
        self._touched = _Touched()

    @staticmethod
    def _refuse_existing(path: Path, max_id: int) -> None:
        """``FileExistsError`` if a store is at ``path``: DiskEmbedding's own message would
        say resume=True, which a PyKEEN model cannot use (:data:`NO_RESUME`)."""
        try:
            snap = dsa_core.open(path, mode="r", unclean="accept")
        except Exception:  # noqa: BLE001 - no store (or a damaged one): DiskEmbedding reports
            return
        try:
            found = (f"a {snap.num_rows} x {snap.dim} {snap.dtype.name} table trained "
                     f"{snap.count} steps")
        finally:
            dsa_core.close(snap)
        raise FileExistsError(
            f"DiskBackedEmbedding({max_id} rows): state_dir {str(path)!r} already holds the "
            f"store of an earlier run ({found}); nothing was changed. {NO_RESUME}")

    # -- values ---------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """Initialise every row with the initializer and restart its m, v and step count.

        A table of more than ``chunk_rows`` rows whose initializer replays (see
        :func:`replays`) is not written here: torch's generator is advanced past the draws
        (made and dropped, chunk by chunk), and the rows are drawn again from the saved
        generator state and written when the table is first read, saved, flushed or closed.
        A second reset before that replaces the first, so ``pipeline()`` (which resets the
        model when it is built and again when it trains) writes the table once.
        """
        h = self.table._handle
        if h.closed:
            raise RuntimeError(f"DiskBackedEmbedding store {str(h.state.path)!r} is closed")
        h.pending = None  # an earlier reset still pending is never written
        if h.state.count:  # the moments of the old weights must go with them
            h.state = dsa_core.set_count(h.state, 0)
        init = _Init(self.max_id, self.chunk_rows, self._shape, self.width,
                     self.table.weight.dtype, self.is_complex, self.initializer)
        if self.max_id > self.chunk_rows and replays(init.initializer):
            rng = torch.get_rng_state()
            for lo, hi in init.chunks():
                init.rows(lo, hi)  # drawn and dropped: the generator moves on as it would
            h.pending = _Pending(init, rng)
        else:
            for lo, hi in init.chunks():
                # PyKEEN's model reset first re-draws the nn.Embedding's N(0, 1) weights and
                # hands them to the initializer: the same draw here (per chunk)
                x = init.rows(lo, hi, None if isinstance(init.initializer,
                                                         PretrainedInitializer)
                              else self._redraw.take(lo, hi))
                _write_rows(h.state, np.arange(lo, hi, dtype=np.int64), x, fresh=True)
            self.table.flush()
        self._touched.add(None)  # the model's post_parameter_update constrains every row

    def _plain_forward(self, indices: torch.Tensor | None = None) -> torch.Tensor:  # noqa: D102
        if indices is None:
            if self.max_id > self.max_full_rows:
                raise ValueError(
                    f"this scoring reads all {self.max_id} rows of a DiskBackedEmbedding at "
                    f"once (more than max_full_rows={self.max_full_rows}). Evaluate in slices "
                    "(pipeline(..., evaluation_kwargs=dict(slice_size=...)), or "
                    "evaluator.evaluate(..., slice_size=...)) and train with sLCWA, or raise "
                    "max_full_rows if the table fits in memory")
            prefix = (self.max_id,)
            ids = torch.arange(self.max_id)
        else:
            prefix = indices.shape
            ids = indices
        if torch.is_grad_enabled():
            self._touched.add(indices)
        x = self.table(ids.to(self.device) if ids.device != self.device else ids)
        x = x.view(*prefix, *self._shape)
        if self.is_complex:
            x = torch.view_as_complex(x)
        return x

    def post_parameter_update(self) -> None:  # noqa: D102
        ids = self._touched.take()
        if self.constrainer is None:
            return
        pending = self.table._handle.pending
        if pending is not None and ids is None:  # after a reset: constrained when written
            pending.constrainer = self.constrainer
            return
        if ids is None:
            spans = [np.arange(lo, hi, dtype=np.int64)
                     for lo, hi in _chunks(self.max_id, self.chunk_rows)]
        else:
            idx = ids.numpy()
            spans = [idx[i:i + self.chunk_rows] for i in range(0, idx.shape[0],
                                                              self.chunk_rows)]
        with torch.no_grad():
            for idx in spans:
                rows = self.table.weight_rows(idx)
                new = _constrain(self.constrainer, rows, self._shape, self.is_complex,
                                 self.width)
                _write_rows(self.table._handle.state, idx, new, fresh=False)

    # -- life cycle -----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:  # noqa: D102
        return self.table.weight.device

    def weight_rows(self, ids) -> torch.Tensor:
        """The rows ``ids`` as a CPU tensor ``(len(ids), *shape)`` (complex for complex tables)."""
        x = self.table.weight_rows(ids)
        x = x.view(x.shape[0], *self._shape)
        return torch.view_as_complex(x) if self.is_complex else x

    def flush(self) -> None:
        """Make every step and constraint so far durable."""
        self.table.flush()

    def close(self) -> None:
        """Flush and close the store (a later forward raises). Safe to call twice."""
        self.table.close()

    def iter_extra_repr(self):  # noqa: D102
        yield from super().iter_extra_repr()
        yield f"state_dir={str(self.table._handle.state.path)!r}"
