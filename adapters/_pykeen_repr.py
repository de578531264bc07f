"""PyKEEN representations with row-sparse gradients: in RAM, or with the weights on disk."""

from __future__ import annotations

import difflib
import math
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

import dsa_core

from ._storage import STORAGE_DEFAULT
from ._torch_embedding import DiskEmbedding

__all__ = ["DiskBackedEmbedding", "SparseEmbedding"]

#: rows per chunk when a whole table is initialised, constrained or read
CHUNK_ROWS = 1 << 16

#: the store options that ``disk_representations`` / ``DiskBackedEmbedding.at`` bind
OPTIONS = ("overwrite", "storage", "memory", "access", "max_full_rows", "chunk_rows")

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
    initializers depend on the row shape only; a ``PretrainedInitializer`` is sliced).

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
                 chunk_rows: int | None = None, **kwargs):
        opts = dict(self.bound_options)
        for k, v in (("overwrite", overwrite), ("storage", storage), ("memory", memory),
                     ("access", access), ("max_full_rows", max_full_rows),
                     ("chunk_rows", chunk_rows)):
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
        self.table = DiskEmbedding(
            max_id, self.width, state_dir=state_dir, init=init, dtype=dtype,
            overwrite=bool(opts.get("overwrite", False)),
            storage=opts.get("storage", STORAGE_DEFAULT), memory=opts.get("memory"),
            access=opts.get("access", "auto"), progress=False,
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
    def _chunks(self):
        for lo in range(0, self.max_id, self.chunk_rows):
            yield lo, min(self.max_id, lo + self.chunk_rows)

    def _write_weights(self, ids: np.ndarray, rows: torch.Tensor, *, fresh: bool) -> None:
        """Write weight rows ``rows`` of ``ids``; ``fresh``: zero their moments as well."""
        st = self.table.store
        rec = (np.zeros((ids.shape[0], int(st.layout["stride"])), st.dtype) if fresh
               else dsa_core.read_records(st, ids))
        o = int(st.layout["w"])
        rec[:, o:o + st.dim] = rows.detach().cpu().numpy()
        dsa_core.write_records(st, ids, rec)

    def reset_parameters(self) -> None:
        """Initialise every row with the initializer and restart its m, v and step count."""
        h = self.table.weight._dsa_handle
        if h.state.count:  # the moments of the old weights must go with them
            h.state = dsa_core.set_count(h.state, 0)
        for lo, hi in self._chunks():
            ids = np.arange(lo, hi, dtype=np.int64)
            if isinstance(self.initializer, PretrainedInitializer):
                x = self.initializer.tensor[lo:hi]  # the rows a whole-table call returns
                if x.is_complex():
                    x = torch.view_as_real(x)
                x = x.to(self.table.weight.dtype)
            else:
                # PyKEEN's model reset first re-draws the nn.Embedding's N(0, 1) weights and
                # hands them to the initializer: the same draw here (per chunk)
                x = self.initializer(self._redraw.take(lo, hi).view(hi - lo, *self._shape))
            x = x.reshape(hi - lo, self.width)
            self._write_weights(ids, x, fresh=True)
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
        if ids is None:
            spans = [np.arange(lo, hi, dtype=np.int64) for lo, hi in self._chunks()]
        else:
            idx = ids.numpy()
            spans = [idx[i:i + self.chunk_rows] for i in range(0, idx.shape[0],
                                                              self.chunk_rows)]
        with torch.no_grad():
            for idx in spans:
                rows = self.table.weight_rows(idx)
                new = _constrain(self.constrainer, rows, self._shape, self.is_complex,
                                 self.width)
                self._write_weights(idx, new, fresh=False)

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
        yield f"state_dir={str(self.table.store.path)!r}"
