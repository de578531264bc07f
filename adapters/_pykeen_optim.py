"""``DiskAdam`` and ``DiskAdagrad``: DiskSparseAdam and DiskSparseAdagrad that PyKEEN's training
loop can rebuild from their param groups."""

from __future__ import annotations

import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from ._pykeen_repr import write_pending
from ._torch_embedding import DiskWeight
from ._torch_adagrad import DiskSparseAdagrad
from ._torch_optim import DiskSparseAdam

__all__ = ["DiskAdagrad", "DiskAdam"]

#: the param-group key naming the optimizer a rebuild comes from
LINEAGE_KEY = "dsa_lineage"
# the constructor's settings that a rebuild from ``state_dict()["param_groups"][0]`` needs
_SETTINGS = ("state_dir", "access", "second_moment", "first_moment", "nonfinite",
             "per_row_step", "decay_missed_steps", "storage", "memory", "keep_snapshots")

# lineage token -> live DiskAdam or DiskAdagrad (in this process)
_LIVE: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def _under(path: Any, root: Path | None) -> bool:
    return root is not None and Path(path).resolve().parent == root.resolve()


class _Rebuilt:
    """What makes a DSA optimizer one that PyKEEN's training loop can rebuild (see
    :class:`DiskAdam`): the take-over of a live optimizer named by its token, the settings
    and the token in the first param group, the pending resets written first."""

    _SETTINGS = _SETTINGS

    def _take_over(self, dsa_lineage, state_dir, resume: bool, overwrite: bool):
        """Close the live optimizer ``dsa_lineage`` names (if any); the ``(resume,
        overwrite)`` this one opens ``state_dir`` with."""
        old = _LIVE.get(dsa_lineage) if dsa_lineage is not None else None
        if old is not None and not old._closed:
            root = old.state_dir
            stepped = any(st.count for st in old.stores.values() if _under(st.path, root))
            old.close()  # flush, release state_dir and the DiskEmbeddings it stepped
            if root is not None and state_dir is not None \
                    and Path(state_dir).resolve() == root.resolve():
                resume, overwrite = (False, True) if stepped else (True, False)
        return resume, overwrite

    def _register(self, state_dir, options: dict[str, Any]) -> None:
        self._settings = {"state_dir": None if state_dir is None else str(state_dir),
                          **{k: v for k, v in options.items() if k in self._SETTINGS}}
        self._lineage = uuid.uuid4().hex
        _LIVE[self._lineage] = self

    def _prepare(self, p, where: str, hp: tuple):
        # a dense gradient here is (nearly always) a PyKEEN model built with its default
        # Embedding tables: say so, and how to give it sparse ones, instead of SparseAdam's
        # "please consider Adam instead" (step checks every gradient before it writes)
        g = p.grad
        if g is not None and g.layout == torch.strided and not isinstance(p, DiskWeight):
            kind = self._store_optimizer()  # the optimizer state this one keeps, and its name
            state = {"adam": "m and v", "adagrad": "the Adagrad accumulators",
                     "rowwise_adagrad": "the row-wise Adagrad accumulators"}[kind]
            disk_args = "root" if kind == "adam" else f"root, optimizer={kind!r}"
            raise RuntimeError(
                f"{type(self).__name__} steps row-sparse gradients only, but {where} (shape "
                f"{tuple(p.shape)}) got a dense one; nothing was written. A PyKEEN model "
                "gives them when its tables are SparseEmbedding or DiskBackedEmbedding, which "
                "its default Embedding tables are not: build it with "
                "model_kwargs=dict(..., **adapters.pykeen.sparse_representations()) (weights "
                f"in RAM, {state} in state_dir) or "
                f"model_kwargs=dict(..., **adapters.pykeen.disk_representations({disk_args})) "
                "(weights on disk too). Models with dense parameters beside their tables "
                "(ConvE, ConvKB, ERMLP, ...) need a dense optimizer (docs/pykeen.md)")
        return super()._prepare(p, where, hp)

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def step(self, closure=None):  # noqa: D102 - the base optimizer's
        write_pending(self._params())  # nothing to write after a forward (which writes it)
        return super().step(closure)

    def checkpoint(self, dest_dir, **kwargs) -> Path:  # noqa: D102 - the base's
        write_pending(self._params())
        return super().checkpoint(dest_dir, **kwargs)

    def load_checkpoint(self, src_dir) -> dict[str, Any]:  # noqa: D102 - the base's
        write_pending(self._params())  # else the pending reset would overwrite what it loads
        return super().load_checkpoint(src_dir)

    def state_dict(self) -> dict[str, Any]:
        """The state dict of ``DiskSparseAdam`` (a description before the first step), with
        the constructor's settings and this optimizer's token in its first param group."""
        if any(st.count for st in self.stores.values()):
            write_pending(self._params())
            sd = super().state_dict()
        else:
            sd = self._describe()
        if sd["param_groups"]:
            sd["param_groups"][0].update(self._settings)
            sd["param_groups"][0][LINEAGE_KEY] = self._lineage
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``DiskSparseAdam``'s; the settings a state dict carries are not group keys."""
        write_pending(self._params())
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for k in (*self._SETTINGS, LINEAGE_KEY):
                if k not in self.defaults:
                    group.pop(k, None)


class DiskAdam(_Rebuilt, DiskSparseAdam):
    """:class:`adapters.torch.DiskSparseAdam` for PyKEEN: rebuilt by PyKEEN's training loop.

    PyKEEN trains with ``optimizer.__class__(params=model.get_grad_params(),
    **optimizer.state_dict()["param_groups"][0])`` after re-initialising the model (at the
    start of every ``train()`` without ``continue_training``). So this optimizer writes its
    constructor's settings (``state_dir``, ``storage``, ...) and a token naming itself
    (``"dsa_lineage"``) into the first param group of its state dict, and a ``DiskAdam``
    built with the token of a live one **takes over** from it:

    - the old one is flushed and closed first (every step it took is on disk; any later
      use of it raises), so there is never a second writer on ``state_dir``;
    - the new one reopens the old one's stores if none has stepped yet (the usual case:
      PyKEEN rebuilds before the first batch), and otherwise starts them afresh, as any
      newly built torch optimizer starts with empty state: PyKEEN rebuilds only after
      re-initialising the weights, which the old moments no longer belong to. Tables of a
      :class:`adapters.pykeen.DiskBackedEmbedding` (weights, m and v in one store) are
      the representation's: its ``reset_parameters`` restarts them; the optimizer only
      hands them over.

    Without a token (or with the token of an optimizer that is gone) it is a plain
    ``DiskSparseAdam``: a second optimizer on a held ``state_dir`` raises
    ``StoreLockedError``, existing stores need ``resume=True`` or ``overwrite=True``.

    ``state_dict()`` before any step is a description of the stores (nothing to snapshot:
    they hold zeros); after steps it snapshots them as ``DiskSparseAdam``'s does, so
    PyKEEN's checkpoints (``training_kwargs=dict(checkpoint_name=...)``) restore them.
    A :class:`adapters.pykeen.DiskBackedEmbedding` table whose reset is not written yet
    (docs/pykeen.md, "Writes before the first step") is written before ``step``,
    ``checkpoint``, ``load_checkpoint``, ``load_state_dict`` and a snapshotting
    ``state_dict``, so none of them sees or keeps its zeros, and no load is undone by it.
    Arguments: those of ``DiskSparseAdam``.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, maximize=False, *,
                 state_dir=None, resume: bool = False, overwrite: bool = False,
                 dsa_lineage: str | None = None, **options):
        resume, overwrite = self._take_over(dsa_lineage, state_dir, resume, overwrite)
        super().__init__(params, lr, betas, eps, maximize, state_dir=state_dir,
                         resume=resume, overwrite=overwrite, **options)
        self._register(state_dir, options)


class DiskAdagrad(_Rebuilt, DiskSparseAdagrad):
    """:class:`adapters.torch.DiskSparseAdagrad` for PyKEEN, rebuilt by its training loop as
    :class:`DiskAdam` is (the same take-over, state dicts and pending resets).

    ``torch.optim.Adagrad``'s arguments and defaults (``lr=1e-2``, ``eps=1e-10``), plus
    ``rowwise`` (PyTorch-BigGraph's ``RowAdagrad``). A :class:`DiskBackedEmbedding` keeps the
    accumulator in its own records, so its tables are made for it:
    ``disk_representations(root, optimizer="adagrad")`` (``"rowwise_adagrad"`` with
    ``rowwise=True``); stepping a table made for another optimizer raises, naming
    ``optimizer=``. ``SparseEmbedding`` tables need nothing.
    """

    _SETTINGS = (*_SETTINGS, "rowwise")

    def __init__(self, params, lr=1e-2, lr_decay=0, weight_decay=0,
                 initial_accumulator_value=0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, rowwise: bool = False, state_dir=None,
                 resume: bool = False, overwrite: bool = False,
                 dsa_lineage: str | None = None, curvature: float = 0.0, **options):
        # a rebuild passes every param-group key back, the fixed curvature among them
        if curvature:
            raise ValueError(f"DiskAdagrad: curvature={curvature!r}; Adagrad is Euclidean only "
                             "(curvature 0). Use DiskAdam for a Poincare ball")
        resume, overwrite = self._take_over(dsa_lineage, state_dir, resume, overwrite)
        super().__init__(params, lr, lr_decay, weight_decay, initial_accumulator_value, eps,
                         foreach, maximize=maximize, differentiable=differentiable,
                         fused=fused, rowwise=rowwise, state_dir=state_dir, resume=resume,
                         overwrite=overwrite, **options)
        self._register(state_dir, {"rowwise": bool(rowwise), **options})
