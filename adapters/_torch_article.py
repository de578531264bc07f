"""``DiskSparseRiemannianAdam``: the DSA article's optimizer API, over dsa_core."""

from __future__ import annotations

import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dsa_core
from dsa_core.tools import validation

from ._row_view import RowView
from ._storage import STORAGE_DEFAULT
from ._torch_common import (
    SharedState,
    check_storage_args,
    close_quietly,
    np_dtype,
    peek_existing,
    reopen,
)

__all__ = ["DiskSparseRiemannianAdam"]

_MANIFEST_FORMAT = "dsa-torch-article"


def _close_all(group, handles: list) -> None:
    """The finalizer: one commit of the tables' group, then each store closed."""
    if group is not None:
        try:
            group.close()
        except Exception:  # noqa: BLE001 - best effort at exit, as close_quietly
            pass
    close_quietly(handles)


def _table_array(value: Any, name: str) -> Any:
    """An initial table as something dsa_core.create can read in chunks (no full copy)."""
    if isinstance(value, torch.Tensor):
        value = value.detach()
        if value.device.type != "cpu":
            value = value.cpu()
        if value.dtype not in (torch.float32, torch.float64):
            value = value.float()
        return value.numpy()
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return value  # numpy array or memmap: read in chunks by dsa_core
    raise TypeError(f"params[{name!r}] must be a 2-D torch tensor or numpy array (the initial "
                    f"table), got {type(value).__name__}")


def _as_index(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        x = x.numpy()
    x = np.asarray(x)
    if x.ndim != 1:
        x = x.reshape(-1)
    if x.dtype.kind not in "iu":
        raise TypeError(f"updates[{name!r}]: indices must be integers, got {x.dtype}")
    return x


def _as_grad(x: Any, dtype: np.dtype) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.device.type != "cpu":
            x = x.cpu()
        if x.is_sparse:
            raise TypeError("grads must be dense (len(indices), dim) rows, got a sparse tensor")
        x = x.numpy()
    x = np.asarray(x)
    return x if x.dtype == dtype else x.astype(dtype)  # the article cast with .float()


class DiskSparseRiemannianAdam(torch.optim.Optimizer):
    r"""The optimizer of the DSA article, on dsa_core: its code runs with one changed import.

    ``from dsa import DiskSparseRiemannianAdam`` becomes
    ``from adapters.torch import DiskSparseRiemannianAdam``. Each table of ``params`` becomes
    a dsa_core store ``<disk_dir>/<name>`` holding its weights, m and v; the training loop
    reads rows through :attr:`state_files` and hands ``(indices, grads)`` to :meth:`step`.

    Parameters
    ----------
    params : dict[str, Tensor | ndarray] (or a list, named ``param_0``, ``param_1``, ...)
        Name -> initial 2-D table ``(num_rows, dim)``; its values become the stored weights
        (read in chunks, not copied whole). If ``<disk_dir>/<name>`` already holds a store of
        that shape it is reopened and training resumes from it, as the article did with its
        existing files (code written for the article relies on it); the given values are
        then ignored, and a ``UserWarning`` says so, since a second run of a script
        otherwise goes on from the first one's state without a word. Delete ``disk_dir``
        (or use another) to start from the given values.
    lr : float, default 1e-3
        Learning rate; ``param_groups[0]["lr"]`` is read at every step (LR schedulers work).
    beta1, beta2, eps : float
        Adam hyperparameters (the article's names), read at every step.
    weight_decay : float, default 0
        L2 weight decay, as geoopt's ``RiemannianAdam`` (which the article's optimizer
        mimics) and ``torch.optim.Adam``: ``g <- g + weight_decay * w`` on the Euclidean
        gradient of each row of the batch, before the step (for ``k > 0`` before the
        conversion to the Riemannian gradient, ``egrad2rgrad``, as geoopt does). Lazy:
        rows not in ``updates`` do not decay. ``param_groups[0]["weight_decay"]`` is read
        at every step. Negative values raise torch's ``Invalid weight_decay value: ...``.
    k : float, default 0.0
        ``0.0``: Euclidean, exactly ``torch.optim.SparseAdam``. ``k > 0``: Riemannian Adam on
        the Poincaré ball of curvature ``-k`` (``k = 1.0``: the unit ball), exactly geoopt
        ``SparseRiemannianAdam``. Fixed when the stores are created.
    disk_dir : str or Path, default "./opt_cache"
        Directory of the stores.
    max_queue_size : int, default 300
        Accepted for compatibility and ignored: every write is synchronous and lands in the
        mapped store before :meth:`step` returns, so there is no queue to size, no update is
        ever dropped and a read right after a step sees the new rows.
    dtype : "float32" or "float64", optional
        Storage dtype; default float64 for float64 tables, else float32 (the article's).
    storage : "auto", "inplace" or "log", default "auto"
        The kind of every table's store (``dsa_core.create``'s ``storage``). ``"auto"`` (the
        default): ``dsa_core.create``'s rule -- a log store when the
        table is larger than the kernel's background-writeback threshold or ``memory`` is
        given, else in place; a resumed store keeps whatever kind it has. ``"log"``: log-structured
        stores, whose in-memory region of at most ``memory``
        bytes takes the steps; training is bit-identical. Their :attr:`state_files` read
        rows on indexing instead of being numpy views (below). A store reopened from
        ``disk_dir`` must be of the kind asked for.
    memory : int or str, optional
        ``storage="log"`` only: the memory budget of **each** table's store (index,
        buffers and region), bytes or a string such as ``"4GiB"`` (default: the core's).
        Refused with ``storage="inplace"``.

    Attributes
    ----------
    state_files : dict[str, dict[str, ndarray or RowView]]
        ``state_files[name]["w"]``, ``["m"]``, ``["v"]``: the stored weights, first and
        second moments ``(num_rows, dim)``, read-only and always current
        (``state_files[name]["w"][idx].copy()`` returns the rows as of the last step).
        For ``k > 0`` the second moment is one scalar per row, shown broadcast over the
        ``dim`` columns. Update rows through :meth:`step` only. In-place stores give numpy
        views of the mapped file. Log stores give array-likes (``RowView``: ``shape``,
        ``dtype``, ``len``) whose indexing (ids, slices, masks, then columns, with numpy's
        semantics) reads just those rows and returns a new array; they refuse writes and
        ``np.asarray(view)`` of the whole table, and raise after :meth:`shutdown`.

    Notes
    -----
    Differences from the article's implementation: ``k > 0`` is true Riemannian Adam
    (Riemannian gradient, one adaptive scale per row, retraction with projection and
    parallel transport of the momentum) instead of a rescaled Euclidean step; ``k = 0``
    is bit-for-bit lazy Adam as ``torch.optim.SparseAdam`` (eps added before the bias
    correction); writes are never dropped or read stale; each table has its own step count,
    advanced when the table is in ``updates`` (also with no rows); ``weight_decay`` is
    geoopt's L2 on the rows of the batch (duplicates of a row decay it once).

    Examples
    --------
    The article's loop: read rows, compute the loss in torch, hand back the gradients.

    >>> import tempfile, torch
    >>> from adapters.torch import DiskSparseRiemannianAdam
    >>> emb = torch.nn.Embedding(100, 4)
    >>> opt = DiskSparseRiemannianAdam(params={"emb": emb.weight}, lr=0.01,
    ...                                disk_dir=tempfile.mkdtemp())
    >>> idx = torch.tensor([3, 7, 3])
    >>> w = torch.from_numpy(opt.state_files["emb"]["w"][idx.numpy()].copy())
    >>> w.requires_grad_(True).pow(2).sum().backward()
    >>> opt.step(updates={"emb": (idx, w.grad)})
    >>> opt.store("emb").count
    1
    >>> opt.shutdown()
    """

    def __init__(self, params: dict | list, lr: float = 1e-3, beta1: float = 0.9,
                 beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                 k: float = 0.0, disk_dir="./opt_cache", max_queue_size: int = 300, *,
                 dtype: Any = None, storage: str = STORAGE_DEFAULT,
                 memory: int | str | None = None):
        if isinstance(params, dict):
            tables = dict(params)
        else:
            tables = {f"param_{i}": t for i, t in enumerate(params)}
        if not tables:
            raise ValueError("params is empty: pass {name: initial 2-D table, ...}")
        if not 0.0 < lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 < eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not 0.0 <= beta1 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 0: {beta1}")
        if not 0.0 <= beta2 < 1.0:
            raise ValueError(f"Invalid beta parameter at index 1: {beta2}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        weight_decay = validation.check_weight_decay(weight_decay,
                                                     what="DiskSparseRiemannianAdam")
        c = validation.check_curvature(k, what="DiskSparseRiemannianAdam k")
        storage, memory = check_storage_args(storage, memory, "auto",
                                             "DiskSparseRiemannianAdam")
        arrays = {}
        for name, value in tables.items():
            if not isinstance(name, str) or not name or name in (".", "..") \
                    or os.sep in name or (os.altsep and os.altsep in name):
                raise ValueError(f"table name {name!r} must be a plain file name (it names "
                                 "the store directory under disk_dir)")
            arr = _table_array(value, name)
            if len(arr.shape) != 2:
                raise ValueError(f"params[{name!r}] must be 2-D (num_rows, dim), got shape "
                                 f"{tuple(arr.shape)}")
            arrays[name] = arr
        self.disk_dir = Path(disk_dir).absolute()
        self.max_queue_size = max_queue_size
        self._closed = False
        self._handles: dict[str, SharedState] = {}
        # One zero-size placeholder tensor per table: a real torch Optimizer (LR schedulers
        # accept it) that never holds the tables themselves.
        self._placeholders = {name: torch.zeros(0) for name in arrays}
        defaults = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
                    "weight_decay": weight_decay, "k": c}
        super().__init__([{"params": list(self._placeholders.values())}], defaults)
        self._open_all(arrays, c, dtype, storage, memory)
        # the tables step all or nothing and commit together (dsa_core.join); tables found
        # at other steps than their group's last commit (a crash between their commits)
        # are refused here: restore them together
        self._group = None
        if len(self._handles) > 1:
            try:
                self._group = dsa_core.join([h.state for h in self._handles.values()],
                                            self.disk_dir / "commit-group.json")
            except BaseException:
                close_quietly(list(self._handles.values()))
                raise
        self._finalizer = weakref.finalize(self, _close_all, self._group,
                                           list(self._handles.values()))
        self.state_files = {name: self._views(h) for name, h in self._handles.items()}

    def _open_all(self, arrays: dict, c: float, dtype: Any, storage: str,
                  memory: int | None) -> None:
        group = self.param_groups[0]
        opened, created = [], []
        if isinstance(dtype, torch.dtype):
            dtype = np_dtype(dtype, "dtype")
        try:
            for name, arr in arrays.items():
                dt = np.dtype(dtype) if dtype is not None else (
                    np.dtype(np.float64) if np.dtype(arr.dtype) == np.float64
                    else np.dtype(np.float32))
                path = self.disk_dir / name
                n, d = (int(s) for s in arr.shape)
                what = f"DiskSparseRiemannianAdam[{name!r}]"
                expect = {"num_rows": n, "dim": d, "dtype": dt, "curvature": c,
                          "weights": True, "what": what, "storage": storage}
                count = peek_existing(path, **expect)
                if count is not None:
                    st = reopen(path, memory=memory, **expect)
                    warnings.warn(
                        f"{what}: {str(path)!r} already holds this table ({n} x {d} "
                        f"{dt.name}, trained {count} steps); it is reopened and training "
                        f"resumes from it, as in the DSA article, so the initial values "
                        f"given in params[{name!r}] are ignored. Delete the directory (or "
                        "use another disk_dir) to start from them", UserWarning, stacklevel=3)
                else:
                    st = dsa_core.create(path, n, d, curvature=c, dtype=dt.name,
                                         weights=True, init=arr, lr=group["lr"],
                                         betas=(group["beta1"], group["beta2"]),
                                         eps=group["eps"],
                                         weight_decay=group["weight_decay"],
                                         storage=storage, memory=memory)
                    created.append(path)
                opened.append(st)
                self._handles[name] = SharedState(st)
        except BaseException:  # all or nothing: close what was opened, remove what was made
            for st in opened:
                dsa_core.close(st)
            for path in created:
                dsa_core.remove(path)
            raise

    @staticmethod
    def _views(h: SharedState) -> dict[str, Any]:
        """Read-only numpy views of an in-place store; for a log store (no whole-table
        view), ``RowView`` objects that read the handle's current State on indexing."""
        st = h.state
        if not st.has_table_view:
            return {part: RowView(lambda: h.state, part) for part in ("w", "m", "v")}

        def ro(a):
            a = a.view()
            a.flags.writeable = False
            return a
        v = st.exp_avg_sq
        if v.shape[1] != st.dim:
            v = np.broadcast_to(v, (st.num_rows, st.dim))
        return {"w": ro(st.weights), "m": ro(st.exp_avg), "v": ro(v)}

    # -- training ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, updates: dict[str, tuple[Any, Any]] | None = None,
             current_k: float | torch.Tensor | None = None):
        """Apply one lazy (Riemannian) Adam step to the rows of each table in ``updates``.

        Parameters
        ----------
        updates : dict[str, (indices, grads)]
            ``indices``: integer tensor (CPU or CUDA) or array ``(B,)``; ``grads``: ``(B, dim)``
            tensor or array (cast to the store dtype). Duplicate indices are summed. Every
            table's input is checked before any table is written.
        current_k : float, optional
            Accepted for compatibility; must equal ``k`` (the curvature of a store is fixed).
        """
        self._check_open()
        dsa_core.tools.follow_threads(torch.get_num_threads())  # as DiskSparseAdam.step
        if updates is None:
            raise TypeError("step() needs updates={name: (indices, grads)}")
        if current_k is not None:
            ck = float(current_k)
            if ck != self.param_groups[0]["k"]:
                raise ValueError(f"current_k={ck} differs from k={self.param_groups[0]['k']}: "
                                 "the curvature of a store is fixed when it is created")
        group = self.param_groups[0]
        lr = float(group["lr"])
        betas = (float(group["beta1"]), float(group["beta2"]))
        eps = float(group["eps"])
        if not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"Invalid learning rate: {lr}")
        wd = group.get("weight_decay", 0.0)
        if not 0.0 <= wd:
            raise ValueError(f"Invalid weight_decay value: {wd}")
        wd = validation.check_weight_decay(float(wd), what="DiskSparseRiemannianAdam")
        jobs = []
        for name, pair in updates.items():
            if name not in self._handles:
                raise KeyError(f"updates names table {name!r}, which this optimizer does not "
                               f"have; its tables are {sorted(self._handles)}")
            indices, grads = pair
            st = self._handles[name].state
            idx = _as_index(indices, name)
            g = _as_grad(grads, st.dtype)
            if g.shape != (idx.shape[0], st.dim):
                raise ValueError(f"updates[{name!r}]: grads must have shape (len(indices), "
                                 f"dim) = ({idx.shape[0]}, {st.dim}), got {g.shape}")
            if idx.size and (idx.min() < 0 or idx.max() >= st.num_rows):
                raise IndexError(f"updates[{name!r}]: indices must lie in [0, "
                                 f"{st.num_rows}), got {idx.min()}..{idx.max()}")
            jobs.append((name, idx, g))
        # L2 (geoopt's RiemannianAdam: g + wd * x before egrad2rgrad), never decoupled
        ups = [(self._handles[name].state._replace(betas=betas, eps=eps, weight_decay=wd,
                                                   decoupled_weight_decay=False),
                idx, g, {"lr": lr}) for name, idx, g in jobs]
        def adopt(new):
            for (name, _, _), st in zip(jobs, new, strict=True):
                self._handles[name].state = st
                self.state[self._placeholders[name]]["step"] = st.count

        with dsa_core.tools.deferred_sigint():  # every table or none, a Ctrl-C after the step
            dsa_core.tools.step_many_into(ups, adopt)  # (also a step that stood in doubt)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """No-op (gradients are passed explicitly to :meth:`step`), as in the article."""

    # -- life cycle --------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Make every update durable, close the stores and release them. Safe to call twice.

        ``timeout`` is accepted for compatibility and unused (writes are synchronous; there
        is no writer thread to wait for). Afterwards :meth:`step` and the other methods
        raise; the :attr:`state_files` of in-place stores stay readable (read-only) for
        inspection and export (those of log stores raise: read them before, or
        ``dsa_core.open(path, mode="r")`` the store).
        """
        del timeout
        if self._closed:
            return
        self._closed = True
        self._finalizer()

    close = shutdown

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this DiskSparseRiemannianAdam was shut down; create a new one "
                               "on the same disk_dir to continue training (it resumes from "
                               "the stores)")

    def flush(self) -> None:
        """Make every step so far durable (msync + manifest), without closing."""
        self._check_open()
        dsa_core.flush_many([h.state for h in self._handles.values() if not h.closed])

    def store(self, name: str) -> dsa_core.State:
        """The ``dsa_core.State`` of table ``name``."""
        return self._handles[name].state

    def __getstate__(self):
        raise TypeError("DiskSparseRiemannianAdam cannot be pickled: its tables live on disk. "
                        "Save state_dict() and keep disk_dir")

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"dsa_manifest"`` (tables, paths, counts); flushes first."""
        self.flush()
        sd = super().state_dict()
        sd["dsa_manifest"] = {
            "format": _MANIFEST_FORMAT, "version": 1, "disk_dir": str(self.disk_dir),
            "tables": {name: {"path": str(h.state.path), "count": int(h.state.count),
                              "num_rows": h.state.num_rows, "dim": h.state.dim,
                              "dtype": h.state.dtype.name, "k": h.state.curvature}
                       for name, h in self._handles.items()}}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters (lr, betas, ... as schedulers left them) from :meth:`state_dict`.

        The tables stay in their stores, so the state dict's step counts must be the
        stores' own: one taken before further steps is refused with a ``ValueError`` (it
        would pair an old count with newer rows), nothing changed. To roll back, copy
        ``disk_dir`` together with each state dict.
        """
        self._check_open()
        sd = dict(state_dict)
        manifest = sd.pop("dsa_manifest", None)
        if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
            raise ValueError("not a DiskSparseRiemannianAdam state dict (no dsa_manifest)")
        tables = manifest["tables"]
        if sorted(tables) != sorted(self._handles):
            raise ValueError(f"the state dict has tables {sorted(tables)}, this optimizer "
                             f"{sorted(self._handles)}")
        for name, e in tables.items():
            st = self._handles[name].state
            if (e["num_rows"], e["dim"], e["dtype"], e["k"]) != (
                    st.num_rows, st.dim, st.dtype.name, st.curvature):
                raise ValueError(f"table {name!r} in the state dict does not match the store "
                                 f"{str(st.path)!r}")
            if int(e["count"]) != st.count:
                raise ValueError(
                    f"DiskSparseRiemannianAdam.load_state_dict: the state dict was taken at "
                    f"step {e['count']} of table {name!r}, but its store {str(st.path)!r} is "
                    f"at step {st.count}. A state dict holds no rows (they stay in the store "
                    f"and kept moving), so loading it would pair step {e['count']} with the "
                    f"rows of step {st.count}; nothing was changed. To go back to an "
                    "earlier point, copy disk_dir together with each state dict (or train "
                    "with adapters.torch.DiskSparseAdam, whose opt.checkpoint(dest) / "
                    "opt.load_checkpoint(dest) do it atomically)")
        super().load_state_dict(sd)
