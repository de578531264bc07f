"""``DiskSparseAdagrad``: ``torch.optim.Adagrad`` on sparse gradients (and PyTorch-BigGraph's
``RowAdagrad`` with ``rowwise=True``) with its accumulators in dsa_core stores.

The machinery (stores per parameter, DiskEmbeddings, checkpoints, state dicts, commit
groups, CUDA staging) is :class:`~adapters._torch_optim.DiskSparseAdam`'s; this class
overrides only what is the optimizer's own: its arguments and checks, the hyperparameters
of a step, the stores' ``optimizer=``, and the import of a torch state dict (``"sum"``).
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch

import dsa_core
from dsa_core.tools import validation

from ._storage import STORAGE_DEFAULT
from ._torch_common import set_columns
from ._torch_optim import DiskSparseAdam
from ._torch_snapshots import DEFAULT_KEEP

__all__ = ["DiskSparseAdagrad"]


def check_torch_adagrad_hparams(lr: Any, lr_decay: Any, weight_decay: Any,
                                initial_accumulator_value: Any, eps: Any) -> None:
    """``torch.optim.Adagrad``'s constructor checks, word for word and in its order (a
    non-number named, as :func:`~adapters._torch_common.check_torch_hparams` does), then
    the core's stricter two: ``lr > 0`` and ``eps > 0``."""
    for name, value in (("lr", lr), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                        ("initial_accumulator_value", initial_accumulator_value),
                        ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{name} must be a number (a float, or a 1-element tensor), got "
                            f"the {type(value).__name__} {value!r}; torch's optimizers refuse "
                            f"it too: pass a number as {name}")
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= lr_decay:
        raise ValueError(f"Invalid lr_decay value: {lr_decay}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not 0.0 <= initial_accumulator_value:
        raise ValueError(f"Invalid initial_accumulator_value value: "
                         f"{initial_accumulator_value}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 < lr:
        raise ValueError(f"Invalid learning rate: {lr}; DiskSparseAdagrad needs lr > 0 (a "
                         "store records it; torch.optim.Adagrad takes 0, which never moves "
                         "a weight)")
    if not 0.0 < eps:
        raise ValueError(f"Invalid epsilon value: {eps}; DiskSparseAdagrad needs eps > 0 "
                         "(eps = 0 divides 0 by 0 for a row whose accumulator and gradient "
                         "are 0), e.g. eps=1e-10")


class DiskSparseAdagrad(DiskSparseAdam):
    r"""``torch.optim.Adagrad`` on sparse gradients, its accumulators on disk; with
    ``rowwise=True``, PyTorch-BigGraph's ``RowAdagrad`` (one accumulator per row).

    The arguments and defaults of ``torch.optim.Adagrad`` (its checks and messages, in its
    order), plus ``rowwise`` and :class:`DiskSparseAdam`'s storage arguments (``state_dir``,
    ``resume``, ``overwrite``, ``access``, ``nonfinite``, ``storage``, ``memory``,
    ``keep_snapshots``, ``unclean``), which mean what they mean there. It steps
    ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag(sparse=True)`` parameters (their
    accumulators in a store per parameter under ``state_dir``, the weights in the
    parameter, CPU or CUDA) and :class:`DiskEmbedding`\ s created with
    ``optimizer="adagrad"`` (or ``"rowwise_adagrad"`` for ``rowwise=True``), whose store holds
    weights and accumulators.

    Parameters
    ----------
    params : iterable
        Parameters or param groups; 2-D float32/float64 tables with row-sparse gradients.
    lr : float or Tensor, default 1e-2
        Read from ``group["lr"]`` at every step (schedulers). Must be > 0 (torch takes 0).
    lr_decay : float, default 0
        The step size at step ``t`` is ``lr / (1 + (t - 1) * lr_decay)``, ``t`` the
        parameter's global step count (every ``step()`` in which it has a gradient). torch
        keeps ``t`` in a float32 tensor, which stops counting at 2**24 steps; this count
        does not (docs/algorithms.md §7.5).
    weight_decay : float, default 0
        Elementwise: refused unless 0, as ``torch.optim.Adagrad`` refuses it with sparse
        gradients ("weight_decay option is not compatible with sparse gradients").
        ``rowwise=True``: FBGEMM's L2 decay, ``g + weight_decay * p`` in the accumulator and
        the update of the batch's rows.
    initial_accumulator_value : float, default 0
        What an accumulator starts at. A row never updated holds 0 on disk, read as this
        value (the state dict's ``"sum"`` of such a row reads it too). A hyperparameter
        of the stores like ``lr``: a group's value is recorded at each step.
    eps : float, default 1e-10
        Added after the square root. Must be > 0 (torch takes 0).
    foreach, fused : None or False; differentiable : False
        torch's implementation switches; they mean nothing for a host update of mapped
        records and ``True`` is refused.
    maximize : bool, default False
    rowwise : bool, default False
        ``True``: one accumulator per row, grown by the row mean of ``g²`` (PyTorch-BigGraph's
        ``RowAdagrad``; FBGEMM's row-wise Adagrad), a record of ``dim + 1`` values for a
        DiskEmbedding, one value per row in an own store. Fixed when a store is created.

    Notes
    -----
    Elementwise, per coordinate of each touched row (torch's order and roundings,
    docs/algorithms.md §7.5; rows absent from the batch are untouched):

    .. math::

        s \leftarrow s + g^2,\qquad p \leftarrow p - \frac{\mathrm{lr}}{1 + (t-1)\,
        \mathrm{lr\_decay}}\,\frac{g}{\sqrt{s} + \epsilon}

    The accumulators equal torch's bit for bit; the weights differ from torch's in the last
    bit where torch's square root (not correctly rounded on CPU) does.

    :meth:`state_dict` is :class:`DiskSparseAdam`'s (per-parameter ``{"step": t}`` and the
    manifest of the stores; the accumulators stay in the stores).
    :meth:`load_state_dict` also takes a ``torch.optim.Adagrad`` state dict (``"step"``,
    ``"sum"``), and PyTorch-BigGraph's ``RowAdagrad`` sums (one per row) for
    ``rowwise=True``: a ``rowwise`` store takes the row mean of an elementwise ``"sum"``
    (exact up to rounding: the coordinates of a row are updated together).

    Examples
    --------
    >>> import tempfile, torch
    >>> from adapters.torch import DiskSparseAdagrad
    >>> tmp = tempfile.mkdtemp()
    >>> emb = torch.nn.Embedding(1000, 16, sparse=True)
    >>> opt = DiskSparseAdagrad(emb.parameters(), lr=0.1, state_dir=f"{tmp}/opt")
    >>> emb(torch.tensor([1, 2, 2])).sum().backward(); opt.step(); opt.zero_grad()
    >>> opt.store_for(emb.weight).count, opt.store_for(emb.weight).optimizer
    (1, 'adagrad')
    >>> opt.close()
    """

    _NAME = "DiskSparseAdagrad"
    _TORCH = "DiskSparseAdagrad"
    _DENSE = "torch.optim.Adagrad"
    _kept_keys = ("curvature",)

    def __init__(self, params, lr: float | torch.Tensor = 1e-2, lr_decay: float = 0,
                 weight_decay: float = 0, initial_accumulator_value: float = 0,
                 eps: float = 1e-10, foreach: bool | None = None, *, maximize: bool = False,
                 differentiable: bool = False, fused: bool | None = None,
                 rowwise: bool = False, state_dir=None, resume: bool = False,
                 overwrite: bool = False, access: str = "auto", nonfinite: str | None = None,
                 storage: str = STORAGE_DEFAULT, memory: int | str | None = None,
                 keep_snapshots: int = DEFAULT_KEEP, unclean: str = "refuse"):
        check_torch_adagrad_hparams(lr, lr_decay, weight_decay, initial_accumulator_value,
                                    eps)
        what = self._NAME
        for name, flag in (("foreach", foreach), ("fused", fused),
                           ("differentiable", differentiable)):
            if flag:
                raise ValueError(f"{what}: {name}={flag!r} selects one of torch's "
                                 "implementations (multi-tensor or fused CUDA kernels), which "
                                 "mean nothing for DSA's update of mapped records; leave it "
                                 "out")
        for name, flag in (("maximize", maximize), ("rowwise", rowwise)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{what}: {name} must be a bool, got {flag!r}")
        self._rowwise = bool(rowwise)
        validation.check_adagrad_options(self._store_optimizer(),
                                         weight_decay=float(weight_decay), what=what)
        self._second_moment = self._first_moment = None  # Adam's: none here
        self._per_row_step = self._decay_missed = None
        defaults = {"lr": lr, "lr_decay": lr_decay, "eps": eps, "weight_decay": weight_decay,
                    "initial_accumulator_value": initial_accumulator_value,
                    "foreach": foreach, "maximize": maximize,
                    "differentiable": differentiable, "fused": fused, "curvature": 0.0}
        self._start(params, defaults, state_dir=state_dir, resume=resume,
                    overwrite=overwrite, access=access, nonfinite=nonfinite, storage=storage,
                    memory=memory, keep_snapshots=keep_snapshots, unclean=unclean)

    # -- the optimizer's own part -------------------------------------------------------
    def _store_optimizer(self) -> str:
        return "rowwise_adagrad" if self._rowwise else "adagrad"

    def _hparams(self, group: dict) -> tuple:
        """``(lr, lr_decay, eps, initial_accumulator_value, maximize, weight_decay)`` of a
        param group for this step: torch's checks (schedulers write ``group["lr"]``)."""
        lr, wd = group["lr"], group.get("weight_decay", 0.0)
        iav, lr_decay, eps = group["initial_accumulator_value"], group["lr_decay"], group["eps"]
        check_torch_adagrad_hparams(lr, lr_decay, wd, iav, eps)
        wd = validation.check_adagrad_options(self._store_optimizer(), weight_decay=float(wd),
                                              what=self._NAME)
        lr, lr_decay, eps, iav, maximize, _ = validation.check_adagrad_hparams(
            float(lr), lr_decay, eps, iav, group.get("maximize", False), "propagate",
            what=self._NAME)
        return lr, lr_decay, eps, iav, maximize, wd

    @staticmethod
    def _decoupled(hp: tuple) -> bool:
        return False

    def _create_kw(self, hp: tuple, c: float) -> dict[str, Any]:
        lr, lr_decay, eps, iav, maximize, wd = hp
        return {"optimizer": self._store_optimizer(), "lr": lr, "lr_decay": lr_decay,
                "eps": eps, "initial_accumulator_value": iav, "maximize": maximize,
                "weight_decay": wd}

    def _expect(self, c: float) -> dict[str, Any]:
        return {"optimizer": self._store_optimizer()}

    def _with_hparams(self, st: dsa_core.State, hp: tuple) -> dsa_core.State:
        lr, lr_decay, eps, iav, maximize, wd = hp
        if (st.lr, st.lr_decay, st.eps, st.initial_accumulator_value, st.maximize,
                st.weight_decay) != hp:
            st = st._replace(lr=lr, lr_decay=lr_decay, eps=eps, initial_accumulator_value=iav,
                             maximize=maximize, weight_decay=wd)
        return st

    @staticmethod
    def _describe_hparams(st: dsa_core.State) -> dict[str, Any]:
        return {"lr": st.lr, "lr_decay": st.lr_decay, "eps": st.eps,
                "initial_accumulator_value": st.initial_accumulator_value,
                "maximize": st.maximize, "weight_decay": st.weight_decay}

    def _import_torch_state(self, params, ids, saved_state) -> list[int]:
        """Copy a ``torch.optim.Adagrad`` per-parameter state (``step``, ``sum``) into the
        stores: ``sum`` as it is elementwise; its row mean, or a PBG ``RowAdagrad`` sum
        (one per row), row-wise. Checked for every parameter before any store is written."""
        todo = []
        for p, i in zip(params, ids):
            s = saved_state.get(i, {})
            st = self._slots[p].handle.state
            step = int(torch.as_tensor(s.get("step", 0)))
            if "sum" not in s:
                if "exp_avg" in s:
                    raise ValueError(
                        f"{self._NAME}.load_state_dict: the state of parameter {i} holds "
                        "exp_avg (an Adam state dict); this optimizer's stores hold Adagrad "
                        "accumulators. Load it into DiskSparseAdam; nothing was changed")
                todo.append((st, step, None))
                continue
            a = torch.as_tensor(s["sum"]).detach().cpu()
            n, d = st.num_rows, st.dim
            rowwise = st.optimizer == "rowwise_adagrad"
            if tuple(a.shape) == (n, d):
                if rowwise:  # the coordinates of a row are updated together: exact mean
                    a = a.double().mean(dim=1, keepdim=True)
            elif rowwise and tuple(a.shape) in ((n,), (n, 1)):
                a = a.reshape(n, 1)
            else:
                raise ValueError(
                    f"{self._NAME}.load_state_dict: the saved sum of parameter {i} has shape "
                    f"{tuple(a.shape)}; the {n} x {d} store {str(st.path)!r} needs ({n}, {d})"
                    + (f" or one value per row, ({n},)" if rowwise else "")
                    + "; nothing was changed")
            todo.append((st, step, a))
        for st, _, a in todo:  # through the stores' write paths on both kinds
            if a is not None:
                lay = st.layout
                an = a.numpy()
                set_columns(st, lay["v"], lay["v_width"], lambda lo, hi: an[lo:hi])
        return [t for _, t, _ in todo]
