"""``DiskEmbedding``: an embedding table whose weights live in a dsa_core store on disk."""

from __future__ import annotations

import math
import os
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import dsa_core
from dsa_core.tools import validation

from ._storage import STORAGE_DEFAULT, check_unclean_arg, zero_weight_row
from ._torch_common import (
    SharedState,
    check_reopen,
    check_storage_args,
    check_device,
    check_table_args,
    close_quietly,
    move_disk_weight,
    np_dtype,
    peek_existing,
    reopen,
    row_options,
    set_columns,
)
from ._torch_snapshots import (
    DEFAULT_KEEP,
    all_records,
    check_keep,
    check_rows,
    open_saved,
    open_snapshot,
    release,
    restore_from,
    rows_fit,
    take,
)

__all__ = ["DiskEmbedding", "DiskWeight"]

_EXTRA_FORMAT = "dsa-torch-embedding"
_META_KEY = "dsa_embedding"  # a small table's manifest and m, v in state_dict()._metadata


_READ_LIMIT_BYTES = 256 << 20  # the largest table a whole read of ``emb.weight`` copies
_CHUNK_ROWS = 1 << 16

# Functions that read no value of a tensor (its metadata, its gradient, autograd plumbing): on
# a DiskWeight they run on the stand-in itself. Everything else reads the table's values.
_META_ATTRS = ("shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "grad_fn",
               "layout", "is_sparse", "is_sparse_csr", "is_cuda", "is_cpu", "is_meta",
               "is_mps", "is_xpu", "is_quantized", "is_mkldnn", "is_nested", "ndim",
               "_version", "output_nr", "retains_grad", "_base", "names", "name", "_grad",
               "_grad_fn", "_backward_hooks", "_post_accumulate_grad_hooks", "itemsize",
               "nbytes", "_cdata", "grad_dtype")
_META_METHODS = ("dim", "ndimension", "size", "numel", "nelement", "element_size", "stride",
                 "is_floating_point", "is_complex", "is_contiguous", "get_device",
                 "requires_grad_", "register_hook", "register_post_accumulate_grad_hook",
                 "retain_grad", "storage_offset", "is_pinned", "is_shared", "is_inference",
                 "_is_view", "__len__", "__hash__", "untyped_storage", "data_ptr")
_IN_PLACE_DUNDERS = frozenset(("__setitem__", "__iadd__", "__isub__", "__imul__",
                               "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                               "__iand__", "__ior__", "__ixor__", "__ilshift__",
                               "__irshift__", "__imatmul__", "data.__set__"))


def _meta_functions() -> frozenset:
    out = set()
    for name in _META_ATTRS:
        attr = torch.Tensor.__dict__.get(name) or torch._C.TensorBase.__dict__.get(name)
        for op in ("__get__", "__set__", "__delete__"):
            f = getattr(attr, op, None)
            if f is not None:
                out.add(f)
    for name in _META_METHODS:
        f = getattr(torch.Tensor, name, None)
        if f is not None:
            out.add(f)
    return frozenset(out)


_META = _meta_functions()
_disabled = torch._C._disabled_torch_function_impl


def _func_name(func) -> str:
    name = getattr(func, "__name__", None) or repr(func)
    owner = getattr(func, "__self__", None)
    if name in ("__get__", "__set__", "__delete__") and hasattr(owner, "__name__"):
        return f"{owner.__name__}.{name}"  # an attribute: data.__get__, data.__set__
    return name


def _disk_weights(x, found: dict) -> None:
    if isinstance(x, DiskWeight):
        found[id(x)] = x
    elif isinstance(x, (list, tuple)):
        for v in x:
            _disk_weights(v, found)


def _swap(x, tables: dict):
    if isinstance(x, DiskWeight):
        return tables[id(x)]
    if isinstance(x, (list, tuple)):
        return type(x)(_swap(v, tables) for v in x)
    return x


def copy_rows(state: dsa_core.State, out: np.ndarray) -> np.ndarray:
    """Copy every weight row of ``state`` into ``out`` (``(num_rows, dim)``), in chunks."""
    for lo in range(0, state.num_rows, _CHUNK_ROWS):
        hi = min(state.num_rows, lo + _CHUNK_ROWS)
        dsa_core.gather(state, np.arange(lo, hi, dtype=np.int64), out=out[lo:hi])
    return out


# nn.Embedding's and nn.EmbeddingBag's keywords; the rest of DiskEmbedding's are DSA's own
_TORCH_KEYWORDS = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
                   "scale_grad_by_freq", "sparse", "_weight", "_freeze", "device", "dtype",
                   "mode", "include_last_offset")


def _unknown_keywords(what: str, unknown: dict, func) -> str:
    """The message for keywords ``func`` does not take: which, and the ones it does."""
    import difflib
    import inspect

    known = [n for n, p in inspect.signature(func).parameters.items()
             if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    own = [n for n in known if n not in _TORCH_KEYWORDS]
    bad = sorted(unknown)
    hints = [f"{b!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(b, known, 1))
             else repr(b) for b in bad]
    return (f"{what} got unexpected keyword argument(s) {', '.join(hints)}. It takes "
            f"nn.Embedding's and nn.EmbeddingBag's keywords ({', '.join(_TORCH_KEYWORDS)}; "
            f"per_sample_weights and offsets go to forward) and its own ({', '.join(own)})")


def _check_torch_only_args(what: str, max_norm: Any, norm_type: Any, sparse: Any,
                           freeze: Any) -> float:
    """Check the ``nn.Embedding`` arguments that have no DSA meaning; returns ``norm_type``."""
    if max_norm is not None:
        raise ValueError(
            f"{what}: max_norm={max_norm!r} is not supported. nn.Embedding's max_norm "
            "rescales the looked-up rows of the weight in place inside forward, and a "
            "DiskEmbedding's rows change only through its optimizer's step "
            "(adapters.torch.DiskSparseAdam). Leave max_norm out (None), and renormalise "
            "the output instead if the model needs it, e.g. torch.renorm(emb(ids), 2, 0, "
            "max_norm) for 2-D outputs (it bounds what the model sees, not the stored rows)")
    try:
        norm_type = float(norm_type)
    except (TypeError, ValueError):
        raise TypeError(f"{what}: norm_type must be a number (as nn.Embedding's, used only "
                        f"with max_norm), got {norm_type!r}") from None
    if not isinstance(sparse, (bool, np.bool_)):
        raise TypeError(f"{what}: sparse must be a bool, got {sparse!r}")
    if not sparse:
        raise ValueError(
            f"{what}: sparse=False asks for a dense gradient, a tensor of the whole table's "
            "size, which a table on disk cannot take. A DiskEmbedding's gradient is always "
            "row-sparse (the batch's rows, nn.Embedding(sparse=True)'s gradient), and "
            "adapters.torch.DiskSparseAdam steps it in place of a dense optimizer (give it "
            "emb.parameters(); the rest of the model keeps its own optimizer). Leave sparse "
            "out or pass sparse=True")
    if not isinstance(freeze, (bool, np.bool_)):
        raise TypeError(f"{what}: _freeze must be a bool, got {freeze!r}")
    return norm_type


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


class _ReadTable(torch.autograd.Function):
    """A copy of the whole table; backward passes the (dense) gradient to the DiskWeight.

    A whole-table read of ``emb.weight`` inside autograd (``emb.weight.pow(2).sum()``) thus
    gives the weight a dense gradient, as it does an ``nn.Embedding(sparse=True)``'s, and
    ``DiskSparseAdam`` refuses it with a clear error instead of dropping that term.
    """

    @staticmethod
    def forward(ctx, weight):
        return weight._dsa_table()

    @staticmethod
    def backward(ctx, grad):
        return grad


class DiskWeight(nn.Parameter):
    """The stand-in parameter of a :class:`DiskEmbedding` (``emb.weight``).

    It has the table's shape ``(num_embeddings, embedding_dim)`` and dtype, so autograd can
    give it the row-sparse gradient of a batch exactly as ``nn.Embedding(sparse=True)``
    gives its weight one, and an optimizer can be handed it through ``model.parameters()``.
    Its own memory holds **no data** (one zero broadcast over the shape); the rows are in
    the store. What reads it:

    - metadata (``shape``, ``dtype``, ``device``, ``numel()``, ``grad``, ...) comes from the
      stand-in, at no cost;
    - anything that reads values (``emb.weight[5]``, ``emb.weight.detach().cpu().numpy()``,
      ``emb.weight.norm(dim=1)``, ``np.asarray(emb.weight)``) runs on a **copy of the whole
      table** read from the store, for tables of at most 256 MiB (``DiskWeight.read_limit``);
      a larger one raises ``RuntimeError`` naming :meth:`DiskEmbedding.weight_rows`,
      :meth:`DiskEmbedding.to_tensor` and :meth:`DiskEmbedding.export`. Each such read
      copies the table again: for repeated reads take ``emb.to_tensor()`` once. Inside
      autograd the copy passes a dense gradient back (as ``nn.Embedding(sparse=True)``'s
      weight gets one), which :class:`DiskSparseAdam` refuses with a clear error;
    - ``emb.weight.data`` is the same stand-in outside autograd (``requires_grad`` False):
      libraries that read ``p.data.device`` or ``p.data.norm()`` get the metadata or a copy
      as above;
    - in-place writes (``emb.weight.data.uniform_()``, ``nn.init.*_``, ``emb.weight[0] =
      ...``, ``emb.weight.data = ...``, a ``torch.optim`` optimizer's update) raise: the rows
      change only through :class:`DiskSparseAdam` (or ``load_state_dict({"weight": W})``);
    - ``nn.Parameter(emb.weight)`` / ``nn.Embedding.from_pretrained(emb.weight)`` raise,
      naming ``emb.to_tensor()``.

    It cannot be pickled or deep-copied.
    """

    _dsa_handle: SharedState
    _dsa_what: str
    _dsa_readable: bool
    read_limit: int = _READ_LIMIT_BYTES

    def __new__(cls, handle: SharedState, dtype: torch.dtype, device: Any = None, *,
                what: str = "DiskEmbedding", readable: bool = True, requires_grad: bool = True):
        st = handle.state
        data = torch.zeros((), dtype=dtype, device=device).expand(st.num_rows, st.dim)
        self = super().__new__(cls, data, requires_grad=requires_grad)
        self._dsa_handle = handle
        self._dsa_what = what
        self._dsa_readable = readable
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if func in _META:
            return _disabled(func, types, args, kwargs)
        name = _func_name(func)
        found: dict[int, DiskWeight] = {}
        # what an in-place function writes: its first argument (nn.init.* pass it by name)
        target = args[0] if args else next(
            (kwargs[k] for k in ("tensor", "input", "self") if k in kwargs), None)
        _disk_weights(target, found)
        _disk_weights(kwargs.get("out"), found)
        if found and (name in _IN_PLACE_DUNDERS or kwargs.get("out") is not None
                      or (name.endswith("_") and not name.endswith("__"))):
            raise RuntimeError(next(iter(found.values()))._dsa_write_error(name))
        for v in list(args[1:]) + list(kwargs.values()):
            _disk_weights(v, found)
        if name == "detach" and sys._getframe(1).f_code is nn.Parameter.__new__.__code__:
            w = next(iter(found.values()))
            raise TypeError(
                f"nn.Parameter(emb.weight) (as in nn.Embedding.from_pretrained(emb.weight)) "
                f"cannot wrap a {w._dsa_what}'s weight: it holds no values, its rows live in "
                "the store on disk. Pass a copy of them, emb.to_tensor() "
                f"({w._dsa_size()}), or save them with emb.export(path)")
        if name == "data.__get__":  # the same stand-in, outside autograd (as .data is)
            w = args[0]
            return DiskWeight(w._dsa_handle, w.dtype, w.device, what=w._dsa_what,
                              readable=w._dsa_readable, requires_grad=False)
        tables = {}
        for key, w in found.items():
            if name == "detach" or not (torch.is_grad_enabled() and w.requires_grad):
                tables[key] = w._dsa_table()
            else:
                tables[key] = _ReadTable.apply(w)
        if name == "detach":  # a copy, not an alias: writes into it do not reach the store
            return tables[id(args[0])]
        return func(*_swap(tuple(args), tables),
                    **{k: _swap(v, tables) for k, v in kwargs.items()})

    def _dsa_size(self) -> str:
        st = self._dsa_handle.state
        return f"{st.num_rows} x {st.dim} {st.dtype.name}, {_mib(self._dsa_bytes())}"

    def _dsa_bytes(self) -> int:
        st = self._dsa_handle.state
        return st.num_rows * st.dim * st.dtype.itemsize

    def _dsa_write_error(self, name: str) -> str:
        return (f"{self._dsa_what}.weight cannot be written in place ({name}): it stands for "
                "rows that live in a store on disk, which such a write would not reach. Its "
                "rows change through adapters.torch.DiskSparseAdam (a torch.optim optimizer "
                "such as SparseAdam cannot step it: give emb.parameters() to DiskSparseAdam "
                "instead); set them at creation (init=...) or with "
                "emb.load_state_dict({'weight': W})")

    def _dsa_table(self) -> torch.Tensor:
        """A copy of the whole table on this parameter's device, or a clear error."""
        st = self._dsa_handle.state
        if not self._dsa_readable:
            raise RuntimeError(
                f"{self._dsa_what}.weight stands for this rank's shard, whose rows live in a "
                "store on disk; it holds no values to read. Read rows with emb.lookup(ids) "
                "(on every rank), or export a shard with `dsa export STORE OUT.npy`")
        if st.closed:
            raise RuntimeError(f"{self._dsa_what} store {str(st.path)!r} is closed: its "
                               "weight cannot be read")
        if self._dsa_bytes() > self.read_limit:
            raise RuntimeError(
                f"{self._dsa_what}.weight stands for a table that lives on disk "
                f"({self._dsa_size()}); reading it as a whole would copy all of it into "
                f"memory, which emb.weight does for tables of at most {_mib(self.read_limit)} "
                "(DiskWeight.read_limit). Read rows with emb.weight_rows(ids), copy the "
                "table with emb.to_tensor() (it must fit in memory), or write it to a .npy "
                "file in chunks with emb.export(path). (A torch.optim optimizer given "
                "emb.parameters() cannot step it: use adapters.torch.DiskSparseAdam.)")
        out = torch.empty((st.num_rows, st.dim), dtype=self.dtype)
        copy_rows(st, out.numpy())
        return out.to(self.device)

    def __repr__(self) -> str:
        st = self._dsa_handle.state
        return (f"DiskWeight(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device}, store={str(st.path)!r})")

    def __format__(self, spec: str) -> str:  # f"{emb.weight}" describes it, reads no rows
        return format(repr(self), spec)

    def __reduce_ex__(self, proto):
        raise TypeError("a DiskWeight cannot be pickled or deep-copied: its rows live in a "
                        "store on disk. Snapshot them with emb.checkpoint(dest) (or the "
                        "optimizer's opt.checkpoint(dest), which includes them); for a copy "
                        "of the weights use emb.to_tensor() or emb.export(path)")

    def __deepcopy__(self, memo):
        return self.__reduce_ex__(2)


class _GatherRows(torch.autograd.Function):
    """rows = store[ids] on ``device``; backward: a row-sparse gradient for the DiskWeight."""

    @staticmethod
    def forward(ctx, weight, ids, handle, pad, device, coalesced):
        st = handle.state
        if st.closed:
            raise RuntimeError(f"DiskEmbedding store {str(st.path)!r} is closed; to continue, "
                               "create a new DiskEmbedding on the same state_dir with "
                               "resume=True")
        dsa_core.tools.follow_threads(torch.get_num_threads())  # the gather is threaded too
        idx = ids.numpy()
        if device.type == "cuda":
            buf = torch.empty((idx.shape[0], st.dim), dtype=weight.dtype, pin_memory=True)
            dsa_core.gather(st, idx, out=buf.numpy())
            rows = buf.to(device, non_blocking=True)
        else:
            rows = torch.from_numpy(dsa_core.gather(st, idx)).to(device)
        ctx.ids = ids
        ctx.pad = pad
        ctx.coalesced = coalesced  # ids sorted and unique (else: one row per lookup)
        ctx.shape = weight.shape
        ctx.weight_device = weight.device
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        ids = ctx.ids
        if ctx.pad is not None:  # nn.Embedding leaves the padding row out of the gradient
            keep = ids != ctx.pad
            ids = ids[keep]
            grad_rows = grad_rows[keep.to(grad_rows.device)]
        dev = ctx.weight_device
        grad = torch.sparse_coo_tensor(ids.to(dev)[None], grad_rows.to(dev), ctx.shape,
                                       is_coalesced=ctx.coalesced, check_invariants=False)
        return grad, None, None, None, None, None


def _ids_tensor(x, what: str) -> torch.Tensor:
    """``x`` as an integer tensor, or a TypeError naming what came and what to pass.

    Integer tensors pass as they are (``torch.long`` / ``torch.int``, as ``nn.Embedding``
    takes). Numpy integer arrays and (nested) lists or tuples of ints are converted to a CPU
    ``torch.long`` tensor; other tensors, arrays and objects are refused.
    """
    must = (f"DiskEmbedding expects integer ids as {what} (a torch.long or torch.int tensor, "
            "a numpy integer array or a list of ints)")
    if isinstance(x, torch.Tensor):
        if x.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{must}, got a tensor of {x.dtype}. Convert it with "
                            f"{what}.long()")
        return x
    if not isinstance(x, (np.ndarray, list, tuple)):
        raise TypeError(f"{must}, got a {type(x).__name__}. Pass "
                        "torch.as_tensor(ids, dtype=torch.long)")
    came = "a numpy array" if isinstance(x, np.ndarray) else f"a {type(x).__name__}"
    try:
        arr = np.asarray(x)
    except ValueError as exc:  # ragged lists
        raise TypeError(f"{must}, got {came} that is not a rectangular array ({exc})") from None
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{must}, got {came} of {arr.dtype}. Pass integer ids (e.g. "
                        "np.asarray(ids, dtype=np.int64))")
    return torch.as_tensor(arr.astype(np.int64, copy=False))


@torch.compiler.disable
def _gather_rows(emb, ids, pad, coalesced, device):
    """``_GatherRows.apply`` for ``emb``, run eagerly under ``torch.compile``: a graph break.

    The gather reads the store through numpy, which dynamo cannot trace, and dynamo cannot
    even look at ``emb.weight``: making a fake tensor of it reads attributes that a
    ``DiskWeight`` answers with a copy of the table (an internal error). So the weight is
    read here, outside the traced code; the ops before and after the gather are compiled,
    and autograd runs ``_GatherRows.backward`` as in eager mode.
    """
    return _GatherRows.apply(emb.weight, ids, emb._handle, pad, device, coalesced)


class DiskEmbedding(nn.Module):
    r"""An embedding table (or bag) whose weights, m and v live in one dsa_core store.

    For tables larger than RAM. ``forward`` reads only the batch's distinct rows from disk
    (``dsa_core.gather``) onto the input's device; ``backward`` gives :attr:`weight` the
    row-sparse gradient of those rows only (duplicates summed, the padding row left out,
    exactly the gradient of ``nn.Embedding(sparse=True)``); :class:`DiskSparseAdam`'s
    ``step`` writes the new rows back through ``dsa_core.step``. The training loop is
    unchanged.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        Shape of the table.
    state_dir : str or Path
        Directory of the store (weights, m and v, one record per row).
    resume : bool, default False
        Whether an existing store at ``state_dir`` is reopened. A store there holds the
        weights, m, v and step count of an earlier run; continuing from it must be asked
        for, since a script run twice would otherwise go on from the first run's state
        without a word. ``resume=True``: reopen it if there is one (``init`` is then unused
        and training continues from its step), else create a new one, so the same line
        starts a run and continues it. ``resume=False`` (default): an existing store is
        refused with ``FileExistsError``, nothing touched.
    overwrite : bool, default False
        Replace an existing store at ``state_dir`` with a new one (its rows are deleted).
        ``resume=True`` with ``overwrite=True`` is refused.
    padding_idx : int, optional
        As ``nn.Embedding``: that row is zeroed at creation, gets no gradient and is never
        updated; in bag modes it is left out of the reduction.
    mode : None, "sum" or "mean"
        ``None``: ``nn.Embedding`` (output ``input.shape + (dim,)``). ``"sum"`` / ``"mean"``:
        ``nn.EmbeddingBag`` (2-D ``input`` of fixed-size bags, or 1-D ``input`` with
        ``offsets``; ``per_sample_weights`` with ``"sum"``).
    curvature : float, default 0.0
        ``0``: Euclidean rows (``torch.optim.SparseAdam`` semantics). ``c > 0``: points of
        the Poincaré ball of curvature ``-c`` (geoopt ``SparseRiemannianAdam`` semantics).
        Fixed when the store is created.
    init : "normal", "uniform", "zeros", or array-like/tensor of shape (num_embeddings, dim)
        Initial weights of a new store, written in chunks (``dsa_core.create``'s ``init``,
        passed through). ``"normal"`` draws ``N(0, init_scale^2)`` (``nn.Embedding``'s
        ``N(0, 1)`` with the default scale for ``c == 0``), ``"uniform"``
        ``U(-init_scale, init_scale)``, ``"zeros"`` leaves every row 0.
    init_scale : float, optional
        Default 1.0 for ``c == 0`` (as ``nn.Embedding``) and 1e-3 for ``c > 0`` (points
        near the origin of the ball, as in Poincaré embeddings).
    seed : int, optional
        Seed of the named inits; by default drawn from torch's global generator, so
        ``torch.manual_seed`` makes it reproducible.
    dtype : torch.float32 or torch.float64, optional
        Storage and compute dtype of the rows (default float32, or ``_weight``'s dtype).
        Fixed with the store: ``model.double()`` / ``.half()`` keep it and cast the outputs
        (with one warning; docs/adapters.md).
    scale_grad_by_freq, include_last_offset : bool
        As ``nn.Embedding`` / ``nn.EmbeddingBag``.
    device : torch.device, optional
        Device of :attr:`weight` (where gradients accumulate); outputs are always on the
        input's device. ``module.to(device)`` moves it without touching the store.
    progress : bool, optional
        Progress bar while a new table is initialised (default: only for large tables).
    access : "auto", "ram" or "disk", default "auto"
        How the store is paged (``dsa_core.create``'s ``access``): "ram" when the table fits
        in memory (huge pages), "disk" when it does not; "auto" chooses by size.
    second_moment : "elementwise" or "rowwise", default "elementwise"
        ``curvature == 0`` only: SparseAdam's per-coordinate v (parity), or one v per row
        (docs/algorithms.md §7.3, FBGEMM's partial row-wise Adam; a record of ``2*dim + 1``
        instead of ``3*dim`` values). Fixed when the store is created; a resumed store
        must match.
    first_moment : "full" or "bfloat16", default "full"
        float32 tables with ``curvature == 0`` only: ``"bfloat16"`` keeps m as bfloat16
        with stochastic rounding (docs/algorithms.md §6; v stays float32). Fixed at
        creation.
    optimizer : "adam", "adagrad" or "rowwise_adagrad", default "adam"
        Which optimizer's state the store's records hold beside the weights, fixed at
        creation: ``"adam"`` (m and v; stepped by :class:`DiskSparseAdam`), ``"adagrad"``
        (one accumulator per coordinate) or ``"rowwise_adagrad"`` (one per row, a record of
        ``dim + 1`` values; both stepped by :class:`DiskSparseAdagrad`, ``rowwise=True``
        for the latter). Stepping the table with another optimizer is an error naming this
        argument; a resumed store must match. The Adam options (``curvature > 0``,
        ``second_moment``, ``first_moment``, ``per_row_step``, ``decay_missed_steps``) are
        refused with an Adagrad one.
    nonfinite : "propagate", "skip_row" or "raise", optional
        What a NaN or Inf in a gradient row does when :class:`DiskSparseAdam` steps this
        table: ``"propagate"`` spreads it into that row as torch does, ``"skip_row"`` leaves
        such a row untouched (and does not decay its moments), ``"raise"`` raises
        ``FloatingPointError`` before anything is written. It is recorded in the store. The
        default, None, keeps what the store records (``"propagate"`` for a new one); a value
        applies from now on, to a resumed store too: unlike the moments' layout it is a
        policy, not a property of the rows.
    per_row_step : bool, default False
        Each row keeps its own step count for the bias correction (a row first seen late
        takes a first step of about ``lr * sign(g)``; docs/algorithms.md §7.2). A layout
        option of the store (one int32 per row), fixed when it is created; a resumed store
        must match. :class:`DiskSparseAdam` honours it (given there too, it must agree).
    decay_missed_steps : bool, default False
        A row that comes back after missing steps first gets the decoupled weight decay of
        every step it missed (docs/algorithms.md §7.1; a per-row last step in the record),
        so decay acts as if every row were decayed at every step. Fixed at creation; the
        optimizer that steps the table must use ``decoupled_weight_decay=True``.
    storage : "auto", "inplace" or "log", default "auto"
        The kind of store (``dsa_core.create``'s ``storage``). ``"auto"`` (the default):
        ``dsa_core.create``'s rule -- a log store when the
        table is larger than the kernel's background-writeback threshold or ``memory`` is
        given, else in place; a resumed store keeps whatever kind it has. ``"inplace"``: one
        mapped file of records updated in place. ``"log"``: the log-structured
        store, whose in-memory region of at most ``memory`` bytes takes the steps and
        writes evicted rows to disk in large sequential writes; training is bit-identical.
        A log store has no mapping (``access`` must stay "auto"). A resumed store must be
        of the kind asked for.
    memory : int or str, optional
        ``storage="log"`` only: the budget of the log store's region, bytes or a string
        such as ``"4GiB"`` (default: the core's). Refused with ``storage="inplace"``.
    unclean : "refuse" or "accept", default "refuse"
        ``resume=True`` only: what a store left unclean does (its writer ended between
        flushes and its rows could not be brought back to the last flush: the machine
        restarted, or its undo record was unavailable). ``"refuse"``: raise
        ``dsa_core.UncleanStopError`` naming the cause and the remedy, nothing changed.
        ``"accept"``: open its rows as they are; follow with ``opt.load_checkpoint(CKPT)`` or
        :meth:`load_checkpoint` to go back to a checkpoint.
    max_norm, norm_type, sparse, _weight, _freeze
        ``nn.Embedding``'s keywords, so that it is a word-for-word swap. ``sparse=True`` is
        accepted and changes nothing (the gradient is always row-sparse); ``sparse=False``
        (a dense, table-sized gradient) is refused, as is ``max_norm`` other than None
        (torch rescales the weight's rows in place inside forward; a disk table's rows
        change only through its optimizer). ``norm_type`` is accepted (used only with
        ``max_norm``). ``_weight`` is the initial table (``init`` by torch's name; its
        padding row kept as given); ``_freeze=True`` makes :attr:`weight` not require grad.
        Any other keyword is refused with a ``TypeError`` that names the known ones. See
        also :meth:`from_pretrained`.
    keep_snapshots : int, default 3
        How many snapshots of the table its module ``state_dict()`` keeps (in
        ``.dsa-snapshots/`` beside ``state_dir``; older ones are deleted when a new one is
        taken), on both store kinds. ``0``: no snapshots; the state dict is then a
        description of the store, refused once it has stepped on. See Notes.

    The weight decay itself is not a module argument: as for ``nn.Embedding``, it is the
    optimizer's hyperparameter (``DiskSparseAdam(emb.parameters(), weight_decay=...,
    decoupled_weight_decay=...)``, per param group, changeable between steps). The module
    only fixes what the rows' records must hold.

    Attributes
    ----------
    weight : DiskWeight
        The data-less stand-in parameter that receives the sparse gradient (see
        :class:`DiskWeight`); give it (``emb.parameters()``) to :class:`DiskSparseAdam`.
        Reading its values (``emb.weight[5]``, ``emb.weight.detach()``) copies the whole
        table from the store, for tables up to 256 MiB; larger ones raise. The trained
        table: :meth:`to_tensor` (a CPU tensor), :meth:`export` (a ``.npy`` file, in
        chunks), :meth:`weight_rows` (some rows).
    store : dsa_core.State
        The store's current State (for an in-place store, ``store.weights``,
        ``store.exp_avg``, ``store.exp_avg_sq`` are views of the rows on disk; a log store
        has no such views: read rows with ``dsa_core.gather`` / ``dsa_core.read_records``).

    Raises
    ------
    FileExistsError
        ``state_dir`` holds a store and neither ``resume`` nor ``overwrite`` is True.
    ValueError
        Invalid arguments, or an existing store of another shape, dtype, curvature or moment
        layout (it cannot be resumed; ``overwrite=True`` replaces it). Nothing is written.
    dsa_core.StoreLockedError
        Another module or process writes the store.

    Notes
    -----
    Memory: a forward holds the batch's distinct rows (and the autograd graph holds their
    gradient); nothing of size ``num_embeddings`` is ever allocated, so anonymous memory is
    O(batch). The page cache holds whatever rows the kernel keeps; that memory is
    reclaimable. ``max_norm`` and ``mode="max"`` are not supported (``max_norm`` rewrites
    weights inside forward; ``max`` bags would update rows that got no gradient).

    A small table's (at most ``DiskWeight.read_limit`` bytes of weights) module state dict
    has ``nn.Embedding``'s keys (``weight``), so each loads the other's with
    ``strict=True``; the rest of its records and its step count ride in the state dict's
    metadata. Larger tables' state dicts are described below.

    The store's step count is the optimizer's ``t`` (bias correction). The module's
    ``state_dict()`` flushes the store and saves a small manifest (``_extra_state``),
    never the rows. It also snapshots the table, whatever the store's kind, and names the
    snapshot, so ``torch.save(model.state_dict(), f)`` and
    ``model.load_state_dict(torch.load(f))`` bring the table (weights, m, v, step count)
    back to exactly that point, while the snapshot is kept (the newest ``keep_snapshots``;
    :meth:`release_snapshots`). A log store's snapshot is cheap (hard links to its
    immutable segments, a copy of its index); an in-place store's reflinks its data file
    where the filesystem supports it, else links its last snapshot's files and writes the
    rows changed since (a full copy the first time). The optimizer's
    ``state_dict()`` snapshots this table too (its own snapshots). With
    ``keep_snapshots=0`` the state dict is only a description: loading one whose step
    count differs from the store's is refused (it would claim rows the store no longer
    holds). :meth:`checkpoint` / :meth:`load_checkpoint`, or the optimizer's
    ``checkpoint``, which includes this table, keep points until you delete them. Loading
    an ``nn.Embedding`` state dict (a ``weight`` tensor) copies those weights into the
    store.

    Examples
    --------
    >>> import tempfile, torch
    >>> from adapters.torch import DiskEmbedding, DiskSparseAdam
    >>> tmp = tempfile.mkdtemp()
    >>> emb = DiskEmbedding(1000, 8, state_dir=f"{tmp}/emb", seed=0)
    >>> opt = DiskSparseAdam(emb.parameters(), lr=1e-2)   # no state_dir: the store is emb's
    >>> emb(torch.tensor([[1, 2], [2, 3]])).pow(2).sum().backward()
    >>> opt.step(); opt.zero_grad()
    >>> emb.store.count, emb.weight_rows([2]).shape
    (1, torch.Size([1, 8]))
    >>> opt.close(); emb.close()

    A second run on the same ``state_dir`` must say what it wants:

    >>> DiskEmbedding(1000, 8, state_dir=f"{tmp}/emb")
    Traceback (most recent call last):
        ...
    FileExistsError: DiskEmbedding(1000, 8): state_dir ... already holds a store ...
    >>> emb = DiskEmbedding(1000, 8, state_dir=f"{tmp}/emb", resume=True)
    >>> emb.store.count
    1
    >>> emb.close()
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, state_dir,
                 resume: bool = False, overwrite: bool = False,
                 padding_idx: int | None = None, mode: str | None = None,
                 curvature: float = 0.0, init: Any = "normal",
                 init_scale: float | None = None, seed: int | None = None,
                 dtype: torch.dtype | None = None, scale_grad_by_freq: bool = False,
                 include_last_offset: bool = False, device: Any = None,
                 progress: bool | None = None, access: str = "auto",
                 second_moment: str = "elementwise", first_moment: str = "full",
                 nonfinite: str | None = None, per_row_step: bool = False,
                 decay_missed_steps: bool = False, storage: str = STORAGE_DEFAULT,
                 memory: int | str | None = None, keep_snapshots: int = DEFAULT_KEEP,
                 unclean: str = "refuse", optimizer: str = "adam",
                 max_norm: float | None = None,
                 norm_type: float = 2.0, sparse: bool = True, _weight: Any = None,
                 _freeze: bool = False, **unknown: Any):
        super().__init__()
        if unknown:
            raise TypeError(_unknown_keywords("DiskEmbedding", unknown, DiskEmbedding.__init__))
        dsa_core.tools.check_access(access)
        num_embeddings, embedding_dim, padding_idx = check_table_args(
            num_embeddings, embedding_dim, mode, padding_idx)
        what = f"DiskEmbedding({num_embeddings}, {embedding_dim})"
        norm_type = _check_torch_only_args(what, max_norm, norm_type, sparse, _freeze)
        if _weight is not None:  # nn.Embedding's initial table: init= by another name
            if not (isinstance(init, str) and init == "normal"):
                raise ValueError(f"{what}: _weight= and init= both give the initial table; "
                                 "pass one of them (init=W is DSA's name for _weight=W)")
            w_shape = tuple(getattr(_weight, "shape", np.shape(_weight)))
            if w_shape != (num_embeddings, embedding_dim):
                raise ValueError(f"{what}: _weight must have the shape (num_embeddings, "
                                 f"embedding_dim) = {(num_embeddings, embedding_dim)}, got "
                                 f"{w_shape} (nn.Embedding: 'Shape of weight does not match "
                                 "num_embeddings and embedding_dim')")
            if dtype is None and isinstance(_weight, torch.Tensor):
                dtype = _weight.dtype  # as nn.Embedding: the weight is _weight
            init = _weight
        if dtype is None:
            dtype = torch.float32
        keep_snapshots = check_keep(keep_snapshots, what)
        unclean = check_unclean_arg(unclean, what)
        storage, memory = check_storage_args(storage, memory, access, what)
        dt = np_dtype(dtype, "DiskEmbedding")
        check_device(device, dtype, what)  # before anything is created on disk
        c = validation.check_curvature(curvature, what=what)
        optimizer = validation.check_optimizer(optimizer, what=what)
        if optimizer != "adam":
            validation.check_adagrad_options(
                optimizer, curvature=c, second_moment=second_moment, first_moment=first_moment,
                per_row_step=per_row_step, decay_missed_steps=decay_missed_steps, what=what)
        validation.check_second_moment(second_moment, c, what=what)
        validation.check_first_moment(first_moment, c, dt, what=what)
        if nonfinite is not None:
            validation.check_nonfinite(nonfinite, what=what)
        for name, flag in (("per_row_step", per_row_step),
                           ("decay_missed_steps", decay_missed_steps)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{what}: {name} must be a bool, got {flag!r}")
        rows = {"per_row_step": bool(per_row_step),
                "decay_missed_steps": bool(decay_missed_steps)}
        resume, overwrite = check_reopen(resume, overwrite, what)
        path = Path(state_dir)
        expect = {"num_rows": num_embeddings, "dim": embedding_dim, "dtype": dt,
                  "curvature": c, "weights": True, "what": what,
                  "second_moment": second_moment, "first_moment": first_moment,
                  "storage": storage, "optimizer": optimizer, **rows}
        count = None if overwrite else peek_existing(path, unclean=unclean, **expect)
        if count is not None and not resume:
            raise FileExistsError(
                f"{what}: state_dir {str(path)!r} already holds a store ({num_embeddings} x "
                f"{embedding_dim} {dt.name}, trained {count} steps) from an earlier run; "
                "nothing was changed. Pass resume=True to continue training from it (its "
                "weights, m, v and step count; init is then unused), or overwrite=True to "
                "replace it with a new table")
        try:
            if count is not None:
                state = reopen(path, access=access, memory=memory, unclean=unclean, **expect)
            else:
                # nn.Embedding keeps a given _weight's padding row as it is
                state = self._create(path, num_embeddings, embedding_dim, dt, c, init,
                                     init_scale, seed,
                                     None if _weight is not None else padding_idx,
                                     overwrite, progress,
                                     access, second_moment, first_moment,
                                     nonfinite or "propagate", rows, storage, memory,
                                     optimizer)
        except dsa_core.StoreLockedError as exc:
            raise dsa_core.StoreLockedError(
                f"{what}: the store at {str(path)!r} is already open for writing in another "
                "DiskEmbedding (in this process, e.g. a notebook cell run twice, or in "
                "another one); a store "
                "has one writer at a time, and nothing was changed. Call .close() on the "
                "other one (emb.close(), and opt.close() on an optimizer that steps it; "
                "`del emb` alone leaves it open while anything still refers to it), or use "
                "another state_dir") from exc
        if nonfinite is not None and state.nonfinite != nonfinite:
            state = state._replace(nonfinite=nonfinite)  # recorded at the next flush
        self._handle = SharedState(state)
        self._keep_snapshots = keep_snapshots
        self._finalizer = weakref.finalize(self, close_quietly, [self._handle])
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.mode = mode
        self.scale_grad_by_freq = bool(scale_grad_by_freq)
        self.include_last_offset = bool(include_last_offset)
        self.max_norm = None
        self.norm_type = norm_type
        self.sparse = True  # the gradient is always row-sparse
        self._compute_dtype: torch.dtype | None = None  # model.double() & co.: outputs' dtype
        self.weight = DiskWeight(self._handle, dtype, device, requires_grad=not _freeze)

    @staticmethod
    def _create(path, n, d, dt, c, init, init_scale, seed, padding_idx, overwrite, progress,
                access, second_moment, first_moment, nonfinite, rows, storage, memory,
                optimizer="adam"):
        if init_scale is None:
            init_scale = 1.0 if c == 0 else 1e-3
        if seed is None:
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        if isinstance(init, torch.Tensor):
            init = init.detach().cpu().numpy()
        state = dsa_core.create(path, n, d, curvature=c, dtype=dt.name, weights=True,
                                init=init, init_scale=init_scale, seed=seed,
                                overwrite=overwrite, progress=progress, access=access,
                                second_moment=second_moment, first_moment=first_moment,
                                nonfinite=nonfinite, **rows, storage=storage,
                                memory=memory, optimizer=optimizer,
                                # the optimizer sets the decay at each step; a store that
                                # catches up decay is created with the decoupled kind
                                decoupled_weight_decay=rows["decay_missed_steps"])
        if padding_idx is not None:
            zero_weight_row(state, padding_idx)
        return state

    @classmethod
    def from_pretrained(cls, embeddings: Any, freeze: bool = True,
                        padding_idx: int | None = None, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = True, *, state_dir, **kwargs: Any) -> DiskEmbedding:
        """A new table holding ``embeddings`` (2-D), as ``nn.Embedding.from_pretrained``.

        The arguments are ``nn.Embedding.from_pretrained``'s, plus ``state_dir`` (where the
        store is created) and any other :class:`DiskEmbedding` keyword (``mode="sum"`` /
        ``"mean"`` and ``include_last_offset`` for ``nn.EmbeddingBag.from_pretrained``,
        ``resume``, ``overwrite``, ``storage``, ...). ``freeze=True`` (the default, as
        torch's) makes :attr:`weight` not require grad; the table's dtype and the weight's
        device are those of ``embeddings`` unless ``dtype=`` / ``device=`` say otherwise.
        The padding row is kept as given, as torch keeps it. The rows are written to the
        store in chunks; with ``resume=True`` an existing store is reopened and
        ``embeddings`` unused, as ``init`` is.

        Examples
        --------
        >>> import tempfile, torch
        >>> from adapters.torch import DiskEmbedding
        >>> w = torch.arange(12.0).reshape(4, 3)
        >>> emb = DiskEmbedding.from_pretrained(w, state_dir=f"{tempfile.mkdtemp()}/emb")
        >>> emb(torch.tensor([2])), emb.weight.requires_grad
        (tensor([[6., 7., 8.]]), False)
        >>> emb.close()
        """
        if not isinstance(embeddings, torch.Tensor):
            embeddings = torch.as_tensor(np.asarray(embeddings))
        if embeddings.dim() != 2:
            raise ValueError(f"DiskEmbedding.from_pretrained: embeddings must be 2-D "
                             f"(num_embeddings, embedding_dim), got shape "
                             f"{tuple(embeddings.shape)} (torch: 'Embeddings parameter is "
                             "expected to be 2-dimensional')")
        if "init" in kwargs or "_weight" in kwargs:
            raise ValueError("DiskEmbedding.from_pretrained: the table is `embeddings`; "
                             "init= and _weight= cannot be given too")
        if not isinstance(freeze, (bool, np.bool_)):
            raise TypeError(f"DiskEmbedding.from_pretrained: freeze must be a bool, got "
                            f"{freeze!r}")
        kwargs.setdefault("device", embeddings.device)
        rows, dim = embeddings.shape
        return cls(rows, dim, state_dir=state_dir, _weight=embeddings, _freeze=bool(freeze),
                   padding_idx=padding_idx, max_norm=max_norm, norm_type=norm_type,
                   scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, **kwargs)

    # -- access ---------------------------------------------------------------------------
    @property
    def optimizer(self) -> str:
        """The optimizer whose state the store holds (``DiskEmbedding(optimizer=...)``)."""
        return self._handle.state.optimizer

    @property
    def store(self) -> dsa_core.State:
        """The current ``dsa_core.State`` of the table (its ``count`` is the step ``t``).

        A value, not a live handle: each optimizer step makes a new State, and one read
        before a step is then outdated. Reading its rows still works (they are the same
        mapped views), but ``dsa_core.step`` / ``flush`` / ``checkpoint`` on it raise
        ``dsa_core.StaleStateError``; read ``emb.store`` again after stepping
        (``dsa_core.close`` through it closes the store at its newest count).
        """
        return self._handle.state

    def weight_rows(self, ids) -> torch.Tensor:
        """Copy of the rows ``ids`` (any integer tensor/array) as a CPU tensor ``(len, dim)``."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().reshape(-1).numpy()
        return torch.from_numpy(dsa_core.gather(self._handle.state, ids))

    def to_tensor(self) -> torch.Tensor:
        """A copy of the whole table as a CPU tensor ``(num_embeddings, embedding_dim)``.

        The trained weights for the usual next steps (``nn.Embedding.from_pretrained(
        emb.to_tensor())``, ``torch.save``, nearest neighbours); read in chunks, any size
        that fits in memory (for a table that does not, :meth:`export` writes a ``.npy``
        file). Unlike ``emb.weight.detach()`` it has no size limit. A copy: writing into it
        does not change the table.

        Examples
        --------
        >>> import tempfile, torch
        >>> from adapters.torch import DiskEmbedding
        >>> emb = DiskEmbedding(100, 4, state_dir=f"{tempfile.mkdtemp()}/emb", seed=0)
        >>> w = emb.to_tensor()
        >>> torch.equal(w[[5, 7]], emb.weight_rows([5, 7]))
        True
        >>> torch.nn.Embedding.from_pretrained(w).weight.shape
        torch.Size([100, 4])
        >>> emb.close()
        """
        st = self._handle.state
        if st.closed:
            raise RuntimeError(f"DiskEmbedding store {str(st.path)!r} is closed; reopen it "
                               "(DiskEmbedding(..., resume=True)) or export it with "
                               "`dsa export STORE OUT.npy`")
        out = torch.empty((st.num_rows, st.dim), dtype=self.weight.dtype)
        copy_rows(st, out.numpy())
        return out

    def export(self, path, *, overwrite: bool = False) -> Path:
        """Write the weights to the ``.npy`` file ``path``, in chunks; returns its path.

        For tables of any size (the rows are copied a chunk at a time, never all in
        memory), what ``dsa export STORE OUT.npy`` writes; ``np.load(path, mmap_mode="r")``
        reads it back without loading it. The file is written beside ``path`` and renamed
        into place when complete, so an interrupted export leaves no ``path``. Replacing an
        existing file needs ``overwrite=True``.
        """
        st = self._handle.state
        if st.closed:
            raise RuntimeError(f"DiskEmbedding store {str(st.path)!r} is closed; export it "
                               "with `dsa export STORE OUT.npy`")
        out = Path(path)
        if out.exists() and not overwrite:
            raise FileExistsError(f"{str(out)!r} exists; pass overwrite=True to replace it")
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:
            dst = np.lib.format.open_memmap(tmp, mode="w+", dtype=st.dtype,
                                            shape=(st.num_rows, st.dim))
            copy_rows(st, dst)
            dst.flush()
            del dst
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
        return out

    def prefetch(self, ids) -> None:
        """Start reading the rows ``ids`` (e.g. the next batch) into the page cache.

        A hint for out-of-core tables, run in the background by ``dsa_core.prefetch``: it
        only warms the cache, so results never change. Call it with the next batch's ids
        before the current step.
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().reshape(-1).cpu().numpy()
        dsa_core.prefetch(self._handle.state, ids)

    def flush(self) -> None:
        """Make every step so far durable (msync + the store's manifest)."""
        self._handle.flush()

    def close(self) -> None:
        """Flush and close the store (releases its writer lock). Safe to call twice."""
        self._finalizer()

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, dest, *, overwrite: bool = False) -> Path:
        """Write a consistent snapshot of the table (weights, m, v, step count) to ``dest``.

        ``dsa_core.checkpoint`` of the store: flushed, copied, fsync'd and renamed into place
        in one step, so a crash at any moment leaves either no ``dest`` or a complete one.
        Training goes on in the live store. Resume with :meth:`load_checkpoint` (copies the
        snapshot into this table's store) or by building a ``DiskEmbedding`` with
        ``state_dir=dest, resume=True`` (training then continues *in* the snapshot, which
        stops being one). Replacing an existing ``dest`` needs ``overwrite=True``.
        """
        return dsa_core.checkpoint(self._handle.state, dest, overwrite=overwrite)

    def load_checkpoint(self, src) -> None:
        """Copy the snapshot at ``src`` (from :meth:`checkpoint`) into this table's store.

        The rows (weights, m, v) and the step count become the snapshot's; the store must
        have the same shape, dtype and curvature (checked before anything is written). The
        snapshot itself is left untouched.

        Examples
        --------
        >>> import tempfile, torch
        >>> from adapters.torch import DiskEmbedding, DiskSparseAdam
        >>> tmp = tempfile.mkdtemp()
        >>> emb = DiskEmbedding(100, 4, state_dir=f"{tmp}/emb", seed=0)
        >>> opt = DiskSparseAdam(emb.parameters(), lr=0.1)
        >>> def train(steps):
        ...     for _ in range(steps):
        ...         emb(torch.tensor([1, 2])).sum().backward(); opt.step(); opt.zero_grad()
        >>> train(2); _ = emb.checkpoint(f"{tmp}/ck"); train(3)
        >>> emb.load_checkpoint(f"{tmp}/ck")
        >>> emb.store.count
        2
        >>> opt.close(); emb.close()
        """
        live = self._handle.state
        if Path(src).resolve() == live.path.resolve():
            return  # this table already trains in that store
        snap = open_snapshot(src, live, f"DiskEmbedding({self.num_embeddings}, "
                                        f"{self.embedding_dim})")
        try:
            self._handle.state = dsa_core.restore(live, snap)
        finally:
            dsa_core.close(snap)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def extra_repr(self) -> str:
        st = self._handle.state
        s = f"{self.num_embeddings}, {self.embedding_dim}, state_dir={str(st.path)!r}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.mode is not None:
            s += f", mode={self.mode!r}"
        if st.curvature:
            s += f", curvature={st.curvature}"
        return s

    # -- forward --------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Look up (``mode=None``) or reduce bags of (``"sum"``/``"mean"``) rows of ``input``.

        Same arguments and output as ``nn.Embedding.forward`` / ``nn.EmbeddingBag.forward``;
        the output is on ``input``'s device.
        """
        input = _ids_tensor(input, "input")
        if offsets is not None:
            offsets = _ids_tensor(offsets, "offsets")
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets and per_sample_weights are for bag modes; this "
                             "DiskEmbedding has mode=None (create it with mode='sum' or "
                             "'mean')")
        if self.mode is None and not self.scale_grad_by_freq:
            # One row per lookup, as nn.Embedding(sparse=True): the output is the gathered
            # block itself and the gradient the uncoalesced (ids, grad rows) pair, which the
            # optimizer coalesces with torch's own coalesce(). Saves torch.unique, a second
            # gather and the dense embedding backward, most of a small forward + backward
            # (figures: docs/notebook.md, "Torch end to end").
            ids = input.reshape(-1).to("cpu", torch.int64)
            rows = _gather_rows(self, ids, self.padding_idx, False, input.device)
            return self._cast(rows.view(*input.shape, rows.shape[-1]))
        uniq, inv = torch.unique(input.reshape(-1), sorted=True, return_inverse=True)
        ids = uniq.to("cpu", torch.int64)
        pad = None
        if self.padding_idx is not None and ids.numel():
            pos = int(torch.searchsorted(ids, self.padding_idx))
            if pos < ids.numel() and int(ids[pos]) == self.padding_idx:
                pad = pos
        rows = _gather_rows(self, ids, None if pad is None else self.padding_idx, True,
                            input.device)
        inv = inv.view(input.shape)
        if self.mode is None:
            return self._cast(F.embedding(inv, rows, pad, None, 2.0, self.scale_grad_by_freq,
                                          False))
        if offsets is not None:
            offsets = offsets.to(torch.int64)
        if per_sample_weights is not None and self._compute_dtype is not None:
            per_sample_weights = per_sample_weights.to(rows.dtype)  # the model's dtype
        return self._cast(F.embedding_bag(inv, rows, offsets, None, 2.0,
                                          self.scale_grad_by_freq, self.mode, False,
                                          per_sample_weights, self.include_last_offset, pad))

    def _cast(self, out: torch.Tensor) -> torch.Tensor:
        """The output in the model's dtype (after ``model.double()`` & co.), else as read."""
        return out if self._compute_dtype is None else out.to(self._compute_dtype)

    # -- module plumbing ------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """``to()`` / ``cuda()`` / ``cpu()`` move :attr:`weight`; the store stays on disk.

        A dtype change (``model.double()``, ``.half()``, ``.to(torch.float64)``) keeps the
        store's dtype (fixed at creation: the rows on disk are not converted) and casts the
        outputs to the new dtype from then on, so the rest of the model gets what it
        expects; it warns once per table, naming how to make a table of that dtype.
        """
        return move_disk_weight(self, fn, "DiskEmbedding", self._compute_dtype,
                                self._set_compute_dtype)

    def _set_compute_dtype(self, dtype: torch.dtype) -> None:
        store = self.weight.dtype
        if not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"a DiskEmbedding's outputs cannot be converted to {dtype}")
        self._compute_dtype = None if dtype == store else dtype
        if self._compute_dtype is None or getattr(self, "_dtype_warned", False):
            return
        self._dtype_warned = True
        name = str(store).replace("torch.", "")
        warnings.warn(
            f"DiskEmbedding({self.num_embeddings}, {self.embedding_dim}) keeps its table in "
            f"{name}, its store's dtype (fixed when the store was created; the rows on disk "
            f"are not converted, and emb.weight.dtype stays {store}); its outputs are cast to "
            f"{dtype} from now on, as the rest of the model expects, and the gradient comes "
            "back in the table's dtype. For a table stored in float64, create it with "
            "DiskEmbedding(..., dtype=torch.float64) (float16 and bfloat16 tables are not "
            "offered: Adam's moments need float32)", UserWarning, stacklevel=3)

    def get_extra_state(self) -> dict:
        """A small manifest of the store (flushed first); the rows never enter a state dict.

        The store, of either kind, is snapshotted too (``"state_snapshot"`` names it;
        none with ``keep_snapshots=0``), so the state dict can bring the table back to this
        point (:meth:`set_extra_state`).
        """
        st = self._handle.state
        self._handle.flush()
        out = {"format": _EXTRA_FORMAT, "version": 1, "path": str(st.path),
               "num_embeddings": st.num_rows, "embedding_dim": st.dim,
               "dtype": st.dtype.name, "curvature": st.curvature, "count": st.count,
               "padding_idx": self.padding_idx, "mode": self.mode,
               "second_moment": st.second_moment, "first_moment": st.first_moment,
               "optimizer": st.optimizer, **row_options(st)}
        if self._keep_snapshots and rows_fit(st):
            out["rows"] = "in_state_dict"  # the weight beside it, the rest of each record here
        elif self._keep_snapshots:
            out["state_snapshot"] = take(st, "emb", self._keep_snapshots)
        return out

    def release_snapshots(self, keep: int = 0) -> int:
        """Delete the snapshots this table's module state dicts took, but the newest
        ``keep``; returns how many were deleted.

        State dicts that name a deleted snapshot can no longer be loaded (a clear error
        says so). :meth:`checkpoint` directories and the optimizer's own state-dict
        snapshots of this table are not touched.
        """
        keep = check_keep(keep, "DiskEmbedding.release_snapshots")
        st = self._handle.state
        return release(st.path, "emb", keep)

    def set_extra_state(self, state: Any) -> None:
        self._set_extra_state(state, None)

    def _set_extra_state(self, state: Any, weight: Any) -> None:
        """Check that a saved manifest describes this table; restore the snapshot it names.

        Shape, dtype, curvature, moment layout and per-row options must match. A manifest
        that names a snapshot (any state dict taken with ``keep_snapshots`` > 0, either
        store kind) brings the table back to it (weights, m, v, step count; the whole table
        is copied). Otherwise the step count must match: a manifest of another step
        describes rows the store no longer holds.
        """
        st = self._handle.state
        if not isinstance(state, dict) or state.get("format") != _EXTRA_FORMAT:
            raise ValueError("not a DiskEmbedding state dict entry (expected the manifest "
                             "written by DiskEmbedding.state_dict())")
        have = (st.num_rows, st.dim, st.dtype.name, st.curvature)
        want = (state["num_embeddings"], state["embedding_dim"], state["dtype"],
                state["curvature"])
        if have != want:
            raise ValueError(f"the saved DiskEmbedding is {want[0]} x {want[1]} {want[2]} "
                             f"with curvature {want[3]}, this one {have[0]} x {have[1]} "
                             f"{have[2]} with curvature {have[3]}")
        want_opt = state.get("optimizer", "adam")  # written since Adagrad stores exist
        if st.optimizer != want_opt:
            raise ValueError(f"the saved DiskEmbedding holds {want_opt}'s state, this one "
                             f"{st.optimizer}'s; build it with the saved optimizer "
                             f"(DiskEmbedding(..., optimizer={want_opt!r}))")
        want_sm = state.get("second_moment",  # written since rowwise stores exist
                            "riemannian" if state["curvature"] > 0 else "elementwise")
        if st.second_moment != want_sm:
            raise ValueError(f"the saved DiskEmbedding keeps a {want_sm} second moment, this "
                             f"one a {st.second_moment} one; build it with the saved "
                             "second_moment")
        want_fm = state.get("first_moment", "full")
        if st.first_moment != want_fm:
            raise ValueError(f"the saved DiskEmbedding keeps m as {want_fm!r}, this one as "
                             f"{st.first_moment!r}; build it with the saved first_moment")
        have_ro = row_options(st)  # written since the per-row options exist
        want_ro = {k: bool(state.get(k, False)) for k in have_ro}
        bad = [k for k in have_ro if have_ro[k] != want_ro[k]]
        if bad:
            raise ValueError(
                "the saved DiskEmbedding was created with "
                + ", ".join(f"{k}={want_ro[k]}" for k in bad) + ", this one with "
                + ", ".join(f"{k}={have_ro[k]}" for k in bad) + "; build it with the saved "
                + " and ".join(bad))
        saved = state.get("count")
        if state.get("rows") == "in_state_dict":  # a small table: weight + the rest
            if st.closed:
                raise RuntimeError(f"DiskEmbedding store {str(st.path)!r} is closed")
            self._handle.state = restore_from(st, self._saved_rows(state, weight))
            return
        if state.get("state_snapshot") is not None:
            if st.closed:
                raise RuntimeError(f"DiskEmbedding store {str(st.path)!r} is closed")
            what = f"DiskEmbedding({self.num_embeddings}, {self.embedding_dim})"
            snap = open_saved(state["state_snapshot"], st, what, int(saved),
                              f"keep_snapshots={self._keep_snapshots} here")
            try:
                self._handle.state = dsa_core.restore(st, snap)
            finally:
                dsa_core.close(snap)
            return
        if saved is not None and int(saved) != st.count:
            raise ValueError(
                f"the saved DiskEmbedding state was taken at step {saved}, but its store "
                f"{str(st.path)!r} is at step {st.count}: a state dict holds no rows, so "
                f"loading it would pair step {saved} with the rows of step {st.count}. "
                "Nothing was changed. This state dict names no snapshot (taken "
                "with keep_snapshots=0, or by a version that snapshotted log stores only): "
                "keep the default keep_snapshots=3, whose state "
                "dicts snapshot the table and load as checkpoints, or save with "
                "opt.checkpoint(dest) or emb.checkpoint(dest) (snapshots of the rows) and "
                "resume with opt.load_checkpoint(dest) / emb.load_checkpoint(dest)")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        extra = self.get_extra_state()
        if extra.get("rows") == "in_state_dict":
            # A small table: its keys are nn.Embedding's ('weight' alone), so either module
            # loads the other's state dict with strict=True. The rest of each record (m, v,
            # per-row counters) and the manifest go to the state dict's metadata, which
            # torch.save / torch.load (weights_only too) and load_state_dict carry along
            # and nn.Embedding ignores; a copy without it (a plain dict) loads the weights.
            st = self._handle.state
            rec = all_records(st)
            w = int(st.layout["w"])
            rest = np.delete(rec, np.s_[w:w + st.dim], axis=1)
            destination[prefix + "weight"] = torch.from_numpy(
                np.ascontiguousarray(rec[:, w:w + st.dim]))
            extra["rest"] = torch.from_numpy(np.ascontiguousarray(rest))
            meta = getattr(destination, "_metadata", None)
            if meta is not None:
                meta.setdefault(prefix[:-1], {})[_META_KEY] = extra
            return
        destination[prefix + "_extra_state"] = extra

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key, wkey = prefix + "_extra_state", prefix + "weight"
        saved = (local_metadata or {}).get(_META_KEY)
        try:
            if key in state_dict:  # a large table's snapshot (or a small one's, before)
                self._set_extra_state(state_dict[key], state_dict.get(wkey))
            elif wkey in state_dict and isinstance(saved, dict) \
                    and saved.get("rows") == "in_state_dict":  # a small DiskEmbedding's
                self._set_extra_state(saved, state_dict[wkey])
            elif wkey in state_dict:  # nn.Embedding's, or a copy without the metadata
                self._import_weights(state_dict[wkey])
            elif strict:
                small = self._keep_snapshots and rows_fit(self._handle.state)
                missing_keys.append(wkey if small else key)
        except (ValueError, TypeError) as exc:
            error_msgs.append(str(exc))
        if strict:
            for k in state_dict:
                if k.startswith(prefix) and k not in (key, wkey) \
                        and "." not in k[len(prefix):]:
                    unexpected_keys.append(k)

    def _saved_rows(self, state: dict, weight: Any):
        """The records of a small table's state dict (its weight and ``rest``), checked."""
        st = self._handle.state
        what = f"DiskEmbedding({self.num_embeddings}, {self.embedding_dim})"
        rest = state.get("rest")
        if not isinstance(weight, torch.Tensor) or not isinstance(rest, torch.Tensor):
            raise ValueError(
                f"{what}: this state dict holds the table's rows (a small table) in 'weight' "
                "and '_extra_state' together, but "
                + ("its 'weight' is missing" if not isinstance(weight, torch.Tensor)
                   else "its '_extra_state' lacks the rest of the records")
                + "; nothing was changed. Load the whole module state dict as saved")
        w = int(st.layout["w"])
        wt, rt = weight.detach().cpu(), rest.detach().cpu()
        rec = torch.cat([rt[:, :w], wt, rt[:, w:]], dim=1) \
            if wt.dim() == 2 and rt.dim() == 2 and wt.shape[0] == rt.shape[0] \
            and wt.dtype == rt.dtype else wt
        return check_rows(rec, st, what, int(state.get("count", 0)))

    def _import_weights(self, weight: Any) -> None:
        """Copy an ``nn.Embedding`` weight tensor into the store, in chunks."""
        st = self._handle.state
        w = weight.detach().cpu() if isinstance(weight, torch.Tensor) else torch.as_tensor(
            weight)
        if tuple(w.shape) != (st.num_rows, st.dim):
            raise ValueError(f"size mismatch for weight: copying a param with shape "
                             f"{tuple(w.shape)}, the DiskEmbedding is {(st.num_rows, st.dim)}")
        if st.curvature > 0:
            sq = (w.double() ** 2).sum(1)
            if bool((sq >= 1.0 / st.curvature).any()):
                raise ValueError("weight rows must lie inside the Poincaré ball "
                                 f"(norm < {1 / math.sqrt(st.curvature):.6g})")
        # record chunks, the other columns kept, on both kinds: through the store's write
        # path (its undo record and snapshot deltas see the rows), never the weights view
        set_columns(st, st.layout["w"], st.dim, lambda lo, hi: w[lo:hi].numpy())

