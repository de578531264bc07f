"""``DiskSparseAdam``: ``torch.optim.SparseAdam`` with its moments in dsa_core stores."""

from __future__ import annotations

import math
import os
import warnings
import weakref
from pathlib import Path
from typing import Any, NamedTuple

import torch

import dsa_core

from ._torch_common import (
    DirLock,
    SharedState,
    check_curvature,
    check_first_moment,
    check_second_moment,
    check_torch_hparams,
    close_quietly,
    manifold_curvature,
    np_dtype,
    open_existing,
    store_second_moment,
    to_device,
    to_host,
)
from ._torch_embedding import DiskWeight, open_snapshot

__all__ = ["CHECKPOINT_FILE", "MANIFEST_KEY", "DiskSparseAdam"]

MANIFEST_KEY = "dsa_manifest"
CHECKPOINT_FILE = "optimizer.pt"
_MANIFEST_FORMAT = "dsa-torch-optimizer"


class _Slot(NamedTuple):
    name: str              # "group{i}_param{j}" (own store) or the DiskEmbedding store path
    handle: SharedState    # the store; shared with a DiskEmbedding for DiskWeight params
    owned: bool            # True: weights=False store created/opened by this optimizer


class _Job(NamedTuple):
    p: torch.Tensor
    slot: _Slot
    hp: tuple              # (lr, (beta1, beta2), eps, maximize)
    idx_dev: torch.Tensor  # coalesced row ids on p's device (for index_copy_)
    host: list             # [idx, vals, rows?] on the host (pinned for CUDA)


def _in_place(p: torch.Tensor) -> bool:
    """True when the kernel can update ``p``'s rows where they are (a dense CPU table).

    Saves copying the batch's rows out (``index_select``) and back (``index_copy_``): 0.2-0.3
    ms of a 2048 x 128 step on the 2-core box.
    """
    return p.device.type == "cpu" and p.layout == torch.strided and p.is_contiguous() \
        and p.dim() == 2 and p.dtype in (torch.float32, torch.float64)


class _Owned:
    """What a DiskSparseAdam must release: its own stores and its state_dir lock."""

    def __init__(self):
        self.handles: list[SharedState] = []
        self.lock: DirLock | None = None

    def close(self) -> None:
        close_quietly(self.handles, self.lock)
        self.lock = None


def _group_hparams(group: dict) -> tuple:
    """Read a param group's hyperparameters for this step (schedulers may have changed them)."""
    lr, betas, eps = group["lr"], group["betas"], group["eps"]
    check_torch_hparams(lr, betas, eps)
    lr = float(lr)
    if not math.isfinite(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    return lr, (float(betas[0]), float(betas[1])), float(eps), bool(group.get("maximize", False))


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
    state_dir : str or Path
        Directory of this optimizer's stores: ``<state_dir>/group{i}_param{j}`` for the
        ``j``-th parameter of the ``i``-th group, a stable name, so an optimizer built the
        same way on the same ``state_dir`` resumes from the stores (counts included). One
        optimizer per ``state_dir`` (a lock file; a second one raises
        ``dsa_core.StoreLockedError``). Not needed when every parameter is a DiskEmbedding's.
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
        v per row from the mean of ``g²`` (FBGEMM's partial row-wise Adam, spec §7.3): the
        stores hold ``dim + 1`` instead of ``2 * dim`` values per row, the update is no
        longer SparseAdam's (see README "Row-wise second moment" for the measured cost).
        Fixed when a store is created; a resumed store must match. A DiskEmbedding's
        parameter keeps its own store's setting (given here, it must match).
    first_moment : "full" or "bfloat16", optional
        How the stores keep m (float32 parameters, ``c == 0``). ``"full"`` (the default):
        in the parameter's dtype. ``"bfloat16"``: 2 bytes per coordinate, stochastic
        rounding (spec §6; v stays float32); not SparseAdam's trajectory any more. Same
        rules as ``second_moment`` for resumed stores and DiskEmbeddings.

    Raises
    ------
    ValueError
        Invalid hyperparameters (torch's messages), sparse or complex parameters (torch's
        messages), parameters that are not 2-D, a store under ``state_dir`` that does not
        match its parameter. Nothing is written when construction fails.
    TypeError
        Parameters that are not float32/float64, or on an unsupported geoopt manifold.
    dsa_core.StoreLockedError
        Another optimizer holds ``state_dir`` (or the DiskEmbedding).

    Notes
    -----
    For ``curvature == 0`` the update is SparseAdam's (spec §2.2), per touched row:

    .. math::

        m \leftarrow m + (g - m)(1-\beta_1),\quad v \leftarrow v + (g^2 - v)(1-\beta_2),\quad
        p \leftarrow p - \frac{\mathrm{lr}\sqrt{1-\beta_2^t}}{1-\beta_1^t}
                          \frac{m}{\sqrt{v} + \epsilon}

    with one global step ``t`` per parameter, incremented at every ``step()`` in which the
    parameter has a gradient (even one with no rows); rows absent from the gradient are
    left bit-for-bit untouched (their moments do not decay). For ``c > 0`` the second moment
    is one scalar per row (the squared Riemannian gradient norm) and the first moment is
    parallel-transported (spec §3.2).

    Checkpoints: :meth:`checkpoint` writes a consistent snapshot of every store it steps
    (one ``dsa_core.checkpoint`` per store, named as in ``state_dir``) plus the state dict
    (``optimizer.pt``) pointing at them, all committed by one atomic rename: a crash leaves
    no checkpoint or a complete one. :meth:`load_checkpoint` resumes from it (rows, counts,
    param groups). :meth:`state_dict` alone flushes every store and adds a small manifest
    under the top-level key ``"dsa_manifest"`` (store names and paths, counts,
    hyperparameters); the stores themselves are never pickled and are **not snapshots**:
    the files keep moving with training. ``load_state_dict`` also accepts a
    ``torch.optim.SparseAdam`` (or geoopt ``SparseRiemannianAdam``) state dict and copies its
    ``exp_avg`` / ``exp_avg_sq`` into the stores. Into reduced stores: ``second_moment=
    "rowwise"`` takes the row mean of ``exp_avg_sq`` (the row-wise v of the same gradients:
    a row's coordinates are always updated together), ``first_moment="bfloat16"`` the
    nearest bfloat16 of ``exp_avg``.

    CUDA parameters: the coalesced ids, gradient rows and current weight rows are copied
    into pinned host buffers with ``non_blocking=True`` (one stream synchronize per step,
    before the host reads them); the new rows go back with a non-blocking copy and
    ``index_copy_`` on the parameter's stream.

    Examples
    --------
    >>> emb = torch.nn.Embedding(1000, 16, sparse=True)          # doctest: +SKIP
    >>> opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=tmp / "opt")
    >>> emb(torch.tensor([1, 2, 2])).sum().backward(); opt.step(); opt.zero_grad()
    >>> opt.close()
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 maximize: bool = False, *, state_dir=None, curvature: float = 0.0,
                 access: str = "auto", second_moment: str | None = None,
                 first_moment: str | None = None):
        check_torch_hparams(lr, betas, eps)
        c = check_curvature(curvature)
        dsa_core.check_access(access)
        if second_moment is not None:
            check_second_moment(second_moment, c, "DiskSparseAdam")
        if first_moment is not None:  # the value here; float32 and c == 0 per parameter
            check_first_moment(first_moment, 0.0, "float32", "DiskSparseAdam")
        self._access = access
        self._second_moment = second_moment
        self._first_moment = first_moment
        self._ready = False
        self._closed = False
        self._slots: dict[torch.Tensor, _Slot] = {}
        self._owned = _Owned()
        self.state_dir = None if state_dir is None else Path(state_dir)
        defaults = {"lr": lr, "betas": betas, "eps": eps, "maximize": maximize,
                    "curvature": c}
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

    def _sm(self, c: float) -> str:
        """``dsa_core.create``'s second_moment for an own store of curvature ``c``."""
        return "elementwise" if c > 0 else (self._second_moment or "elementwise")

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
            raise ValueError(f"Sparse params at indices {sparse}: SparseAdam requires dense "
                             "parameter tensors")
        if cplx:
            raise ValueError(f"Complex params at indices {cplx}: SparseAdam does not support "
                             "complex parameters")
        plan = []
        for gi in groups:
            group = self.param_groups[gi]
            gc = check_curvature(group.get("curvature", 0.0))
            group["curvature"] = gc
            for pj, p in enumerate(group["params"]):
                where = f"parameter [{gi}, {pj}]"
                if p.dim() != 2:
                    raise ValueError(
                        f"DiskSparseAdam needs 2-D (num_rows, dim) parameters such as "
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
                            "already stepped by another DiskSparseAdam; close that one first")
                    c = h.state.curvature
                    if gc not in (0.0, c):
                        raise ValueError(
                            f"{where} is a DiskEmbedding created with curvature {c}, but its "
                            f"group asks for curvature {gc}; the curvature of a store is "
                            "fixed when it is created (DiskEmbedding(curvature=...))")
                    sm = self._second_moment
                    if sm is not None:
                        check_second_moment(sm, c, f"DiskSparseAdam {where}")
                    if sm is not None and h.state.second_moment != store_second_moment(sm, c):
                        raise ValueError(
                            f"{where} is a DiskEmbedding whose store keeps a "
                            f"{h.state.second_moment} second moment, but this optimizer asks "
                            f"for second_moment={sm!r}; set it on the embedding "
                            "(DiskEmbedding(second_moment=...)) and leave it out here")
                    fm = self._first_moment
                    if fm is not None and h.state.first_moment != fm:
                        raise ValueError(
                            f"{where} is a DiskEmbedding whose store keeps m as "
                            f"{h.state.first_moment!r}, but this optimizer asks for "
                            f"first_moment={fm!r}; set it on the embedding "
                            "(DiskEmbedding(first_moment=...)) and leave it out here")
                    plan.append((gi, pj, p, None, dt, c))
                    continue
                mc = manifold_curvature(p)
                if mc is not None and gc not in (0.0, mc):
                    raise ValueError(f"{where} lives on a manifold of curvature {mc}, but its "
                                     f"group asks for curvature {gc}; drop curvature= (the "
                                     "manifold's is used) or make them equal")
                c = gc if mc is None else mc
                if self._second_moment is not None:
                    check_second_moment(self._second_moment, c, f"DiskSparseAdam {where}")
                if self._first_moment is not None:
                    check_first_moment(self._first_moment, c, dt, f"DiskSparseAdam {where}")
                if self.state_dir is None:
                    raise ValueError(f"DiskSparseAdam needs state_dir=...: the moments of "
                                     f"{where} are kept in a store there")
                plan.append((gi, pj, p, self.state_dir / f"group{gi}_param{pj}", dt, c))
        return plan

    def _attach(self, groups) -> None:
        """Open (resume) or create the stores of ``groups``; all or nothing."""
        plan = self._plan(groups)
        own = [e for e in plan if e[3] is not None]
        new_lock = None
        if own and self._owned.lock is None:
            new_lock = DirLock(self.state_dir, "DiskSparseAdam")
        opened: list[tuple] = []
        created: list[Path] = []
        try:
            states = []
            for gi, pj, p, path, dt, c in own:  # pass 1: existing stores (no writes)
                st = open_existing(path, num_rows=p.shape[0], dim=p.shape[1], dtype=dt,
                                   curvature=c, weights=False,
                                   what=f"DiskSparseAdam parameter [{gi}, {pj}]",
                                   access=self._access, second_moment=self._sm(c),
                                   first_moment=self._first_moment or "full")
                states.append(st)
                if st is not None:
                    opened.append(st)
            for k, (gi, pj, p, path, dt, c) in enumerate(own):  # pass 2: new stores
                if states[k] is None:
                    lr, betas, eps, maximize = _group_hparams(self.param_groups[gi])
                    states[k] = dsa_core.create(path, p.shape[0], p.shape[1], curvature=c,
                                                lr=lr, betas=betas, eps=eps,
                                                maximize=maximize, weights=False,
                                                dtype=dt.name, access=self._access,
                                                second_moment=self._sm(c),
                                                first_moment=self._first_moment or "full")
                    opened.append(states[k])
                    created.append(path)
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

    # -- stepping -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step (as ``torch.optim.SparseAdam.step``).

        Every gradient is checked (and coalesced and copied to the host) before any store
        is written, so a bad gradient raises with nothing changed. Raises ``RuntimeError``
        for a dense gradient (torch's message) and ``ValueError`` for a gradient whose
        ``sparse_dim`` is not 1.
        """
        self._check_open()
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
                    hp = _group_hparams(group)
                job = self._prepare(p, f"parameter [{gi}, {pj}]", hp)
                if job.idx_dev.device.type == "cuda":
                    devices.add(job.idx_dev.device)
                jobs.append(job)
        for dev in devices:  # the non_blocking copies to pinned memory must have landed
            torch.cuda.current_stream(dev).synchronize()
        for job in jobs:
            self._apply(job)
        return loss

    def _prepare(self, p: torch.Tensor, where: str, hp: tuple) -> _Job:
        g = p.grad
        if g.layout == torch.strided:
            raise RuntimeError(
                "SparseAdam does not support dense gradients, please consider Adam instead")
        if g.layout != torch.sparse_coo:
            raise ValueError(f"DiskSparseAdam needs sparse COO gradients; {where} has a "
                             f"{g.layout} gradient. Convert it with grad.to_sparse_coo()")
        if g.sparse_dim() != 1:
            raise ValueError(
                f"DiskSparseAdam updates whole rows: the gradient of {where} must have "
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
        raw = g._indices()[0]
        if raw.numel():  # before coalesce(): torch's coalesce corrupts memory on a negative id
            lo, hi = (int(v) for v in torch.aminmax(raw))  # one sync on CUDA
            if lo < 0 or hi >= p.shape[0]:
                raise IndexError(f"the gradient of {where} has row ids {lo}..{hi}; they must "
                                 f"lie in [0, {p.shape[0]})")
        c = g.coalesce()  # torch's own duplicate sums: bit-identical inputs (spec §1.1)
        idx = c._indices()[0]
        vals = c._values()
        dev = [idx, vals]
        if slot.owned and not _in_place(p):
            dev.append(p.detach().index_select(0, idx))
        host, _ = to_host(dev)
        return _Job(p, slot, hp, idx, host)

    def _apply(self, job: _Job) -> None:
        lr, betas, eps, maximize = job.hp
        h = job.slot.handle
        st = h.state
        if (st.betas, st.eps, st.maximize) != (betas, eps, maximize):
            st = st._replace(betas=betas, eps=eps, maximize=maximize)
        idx, vals = job.host[0].numpy(), job.host[1].numpy()
        if job.slot.owned and len(job.host) == 2:  # a CPU table: its rows updated in place
            h.state = dsa_core.step(st, idx, vals, lr=lr, table=job.p.detach().numpy())
            torch.autograd.graph.increment_version(job.p)  # autograd sees it, as after add_
        elif job.slot.owned:
            rows = job.host[2]
            h.state = dsa_core.step(st, idx, vals, lr=lr, params=rows.numpy())
            job.p.index_copy_(0, job.idx_dev, to_device(rows, job.p.device))
        else:
            h.state = dsa_core.step(st, idx, vals, lr=lr)
        self.state[job.p]["step"] = h.state.count

    # -- inspection, durability, life cycle -----------------------------------------------
    def store_for(self, p: torch.Tensor) -> dsa_core.State:
        """The ``dsa_core.State`` of parameter ``p`` (``.exp_avg``, ``.exp_avg_sq``, ``.count``)."""
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
        """Store name -> ``dsa_core.State``, in parameter order."""
        return {s.name: s.handle.state for s in self._ordered_slots()}

    def _ordered_slots(self) -> list[_Slot]:
        return [self._slots[p] for g in self.param_groups for p in g["params"]]

    def flush(self) -> None:
        """Make every step so far durable: msync each store and rewrite its manifest."""
        self._check_open()
        for s in self._ordered_slots():
            s.handle.flush()

    def close(self) -> None:
        """Flush and close this optimizer's stores and release ``state_dir``. Safe twice.

        DiskEmbedding stores stay open (their module owns them). Any later use raises.
        """
        if self._closed:
            return
        self._closed = True
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
            raise RuntimeError("this DiskSparseAdam is closed; create a new one on the same "
                               "state_dir to continue (it resumes from the stores)")

    def __getstate__(self):
        raise TypeError("DiskSparseAdam cannot be pickled or deep-copied: its state lives in "
                        "stores on disk. Save opt.state_dict() (a small manifest) and keep "
                        "state_dir")

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, dest_dir, *, overwrite: bool = False) -> Path:
        """Write a consistent snapshot of the optimizer to ``dest_dir``; training goes on.

        ``dest_dir`` receives one ``dsa_core.checkpoint`` per parameter, named as in
        ``state_dir`` (``group{i}_param{j}``; a :class:`DiskEmbedding`'s store, weights
        included, under the name of its position too), and ``optimizer.pt``: this
        optimizer's :meth:`state_dict` whose ``"dsa_manifest"`` points at those snapshots.
        Everything is built in a temporary sibling directory, fsync'd, and renamed into
        place at once, so a crash (``kill -9``, power loss) at any moment leaves either no
        ``dest_dir`` or a complete one (at worst a ``<dest_dir>.tmp-<pid>`` leftover).
        Replacing an existing checkpoint needs ``overwrite=True`` (swapped atomically where
        the filesystem allows).

        Resume with :meth:`load_checkpoint` on an optimizer built the same way (it copies the
        snapshots into that optimizer's stores), or build the optimizer with
        ``state_dir=dest_dir`` (it then trains *in* the checkpoint, which stops being one).

        Returns
        -------
        Path
            ``dest_dir``.
        """
        self._check_open()
        dest = Path(dest_dir)
        dest_r = dest.resolve()
        slots = []
        live = [] if self.state_dir is None else [self.state_dir.resolve()]
        for gi, group in enumerate(self.param_groups):
            for pj, p in enumerate(group["params"]):
                s = self._slots[p]
                if s.handle.closed:
                    raise RuntimeError(f"the store of parameter [{gi}, {pj}] "
                                       f"({str(s.handle.state.path)!r}) is closed")
                slots.append((f"group{gi}_param{pj}", s))
                live.append(s.handle.state.path.resolve())
        for p in live:
            if dest_r == p or dest_r in p.parents:
                raise ValueError(f"checkpoint destination {str(dest)!r} would replace or "
                                 f"contain the live store directory {str(p)!r}; choose "
                                 "another directory")
        if dest.exists() and not overwrite:
            raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                                  "overwrite=True to replace it")
        sd = self.state_dict()  # flushes every store
        man = sd[MANIFEST_KEY]
        man["checkpoint"] = str(dest_r)
        for e, (name, _) in zip(man["params"], slots):
            e["snapshot"] = name
            e["path"] = str(dest_r / name)
        dest_r.parent.mkdir(parents=True, exist_ok=True)
        with dsa_core.staged_dir(dest_r, overwrite) as tmp:
            for name, s in slots:
                dsa_core.checkpoint(s.handle.state, tmp / name)
            with open(tmp / CHECKPOINT_FILE, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
        return dest

    def load_checkpoint(self, src_dir) -> None:
        """Resume from a checkpoint written by :meth:`checkpoint` (the directory may have moved).

        The optimizer must have the same parameters (order, shapes, dtypes, curvatures) as
        the one that wrote it. Every snapshot is checked before anything is written; then
        its rows (m and v, and the weights of a :class:`DiskEmbedding`) are copied into this
        optimizer's stores, the step counts and param groups (lr, betas, ...) are restored,
        and the stores are flushed. The checkpoint itself is never modified. The weights of
        ordinary parameters are the model's: restore them from the model's own state dict.
        """
        self._check_open()
        src = Path(src_dir)
        f = src / CHECKPOINT_FILE
        if not f.is_file():
            raise FileNotFoundError(
                f"{str(src)!r} is not a DiskSparseAdam checkpoint: it has no {CHECKPOINT_FILE}; "
                "write one with opt.checkpoint(dest_dir)")
        sd = torch.load(f, weights_only=True)
        man = sd.get(MANIFEST_KEY) if isinstance(sd, dict) else None
        if not isinstance(man, dict) or "checkpoint" not in man:
            raise ValueError(f"{str(f)!r} is not a DiskSparseAdam checkpoint state dict (no "
                             f"{MANIFEST_KEY!r} with a 'checkpoint' entry)")
        man["checkpoint"] = str(src.resolve())
        self.load_state_dict(sd)

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"dsa_manifest"``; flushes every store first.

        Per-parameter state holds only ``{"step": t}``; m and v stay in the stores.
        """
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
                    "hparams": {"lr": st.lr, "betas": list(st.betas), "eps": st.eps,
                                "maximize": st.maximize}})
        sd[MANIFEST_KEY] = {"format": _MANIFEST_FORMAT, "version": 1,
                            "state_dir": None if self.state_dir is None
                            else str(self.state_dir.resolve()),
                            "params": entries}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (or from torch's SparseAdam).

        With a ``"dsa_manifest"``, each entry is matched to the parameter in the same
        position (same shape, dtype and curvature required) and its step count restored;
        stores are found by this optimizer's ``state_dir`` (a moved directory is fine). The
        state dict of a checkpoint (``optimizer.pt`` from :meth:`checkpoint`) also brings
        the rows: each snapshot store is copied into this optimizer's store.
        Without one (a ``torch.optim.SparseAdam`` or geoopt checkpoint), the saved
        ``exp_avg`` / ``exp_avg_sq`` tensors are copied into the stores (reduced stores:
        row mean of ``exp_avg_sq``, nearest bfloat16 of ``exp_avg``). All checks run
        before anything is changed.
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
                counts.append(int(e["count"]))
            if manifest.get("checkpoint") is not None:
                snaps = self._open_snapshots(Path(manifest["checkpoint"]), entries, params)
        else:
            counts = self._import_torch_state(params, ids, saved_state)
        new_state = {}
        for i, cnt in zip(ids, counts):
            if cnt:
                new_state[i] = {"step": cnt}
        sd["state"] = new_state
        curvatures = [g["curvature"] for g in self.param_groups]
        try:
            super().load_state_dict(sd)
            for p, snap in zip(params, snaps):
                if snap is not None:
                    h = self._slots[p].handle
                    h.state = dsa_core.restore(h.state, snap)
        finally:
            for snap in snaps:
                if snap is not None:
                    dsa_core.close(snap)
        for g, c in zip(self.param_groups, curvatures):
            g["curvature"] = c  # fixed by the stores (a SparseAdam checkpoint has none)
        for p, cnt, snap in zip(params, counts, snaps):
            h = self._slots[p].handle
            if snap is not None:
                continue  # the rows and the count came from the snapshot
            if h.state.count != cnt and manifest is not None:
                warnings.warn(
                    f"store {str(h.state.path)!r} is at step {h.state.count} but the loaded "
                    f"state dict says {cnt}: stores are not snapshots, their rows keep the "
                    f"newer state. Copy state_dir together with each checkpoint to roll back",
                    RuntimeWarning, stacklevel=2)
            if h.state.count != cnt:
                h.state = dsa_core.set_count(h.state, cnt)

    def _open_snapshots(self, root: Path, entries: list, params: list) -> list:
        """Open and check every snapshot store of a checkpoint manifest (read-only).

        Returns one ``dsa_core.State`` per parameter, or None where the optimizer already
        trains in that very store (``state_dir=`` the checkpoint). All or nothing.
        """
        snaps: list = []
        try:
            for gp, (e, p) in enumerate(zip(entries, params)):
                h = self._slots[p].handle
                if h.closed:
                    raise RuntimeError(f"the store of parameter {gp} "
                                       f"({str(h.state.path)!r}) is closed")
                name = e.get("snapshot")
                if not name:
                    raise ValueError(f"the checkpoint manifest entry {gp} names no snapshot "
                                     "store")
                src = root / str(name)
                if src.resolve() == h.state.path.resolve():
                    snaps.append(None)
                    continue
                snaps.append(open_snapshot(src, h.state, f"checkpoint store {name!r}",
                                           count=int(e["count"])))
        except BaseException:
            for snap in snaps:
                if snap is not None:
                    dsa_core.close(snap)
            raise
        return snaps

    def _import_torch_state(self, params, ids, saved_state) -> list[int]:
        """Copy a torch/geoopt per-parameter state (step, exp_avg, exp_avg_sq) into stores."""
        todo = []
        for p, i in zip(params, ids):
            s = saved_state.get(i, {})
            st = self._slots[p].handle.state
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
        for st, _, m, v in todo:
            if m is not None:
                st.set_exp_avg(m.numpy())  # cast to the store (bfloat16 m: to nearest)
                st.exp_avg_sq[...] = v.numpy().astype(st.dtype, copy=False)
        return [t for _, t, _, _ in todo]

