"""A guard before every ``torch.optim`` step: DSA's objects in a torch optimizer raise clearly.

Two mistakes that torch itself reports with a message that points the wrong way, or late:

- a ``torch.optim`` optimizer given a ``DiskEmbedding``'s parameter (``torch.optim.Adam(
  model.parameters())``): Adam, AdamW, RMSprop... refuse its row-sparse gradient with
  torch's "does not support sparse gradients, please consider SparseAdam instead", and
  SparseAdam or SGD fail on the in-place write. The rows live in a store on disk, which only
  ``DiskSparseAdam`` updates: the guard says so, before the optimizer touches anything;
- ``torch.optim.SparseAdam.load_state_dict(disk_sparse_adam.state_dict())``: torch accepts
  it (it checks only the groups' sizes) and its next step dies with ``KeyError: 'exp_avg'``,
  because DSA's state dict keeps m and v in its stores (named in ``dsa_manifest``), not in
  ``state``. The guard refuses that step with the reason.

It is one global optimizer-step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``), installed when ``adapters.torch`` is imported. Its cost
per step is a pass over the optimizer's parameters only when they or its state changed
(the verdict is cached per optimizer); DSA's own optimizers skip it.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._torch_embedding import DiskWeight

# the Adam family: their state for a stepped parameter always has exp_avg beside step
_ADAM_LIKE = (torch.optim.SparseAdam, torch.optim.Adam, torch.optim.AdamW)
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_installed = False


def _key(opt) -> tuple:
    return (id(opt.state), len(opt.state),
            tuple((id(g["params"]), len(g["params"])) for g in opt.param_groups))


def _check(opt) -> None:
    name = f"torch.optim.{type(opt).__name__}" if type(opt).__module__.startswith(
        "torch.optim") else type(opt).__name__
    for gi, group in enumerate(opt.param_groups):
        for pj, p in enumerate(group["params"]):
            if isinstance(p, DiskWeight):
                raise RuntimeError(
                    f"{name} cannot step a {p._dsa_what}'s weight (parameter [{gi}, {pj}]): "
                    "its rows live in a store on disk, which only adapters.torch."
                    "DiskSparseAdam updates (DiskSparseAdagrad, if the embedding was "
                    "created with optimizer='adagrad'; a torch.optim optimizer would refuse its "
                    "row-sparse gradient or write into a stand-in). Nothing was changed. "
                    "Give the embedding's parameters to DiskSparseAdam(emb.parameters(), "
                    "lr=...) and the other parameters to this optimizer (two optimizers, "
                    "both stepped each iteration)")
            st = opt.state.get(p) if isinstance(opt, torch.optim.Adagrad) else None
            if st and "step" in st and "sum" not in st:
                raise RuntimeError(
                    f"{name} holds a state without sum for parameter [{gi}, {pj}]: it was "
                    "given an adapters.torch.DiskSparseAdagrad state dict (load_state_dict), "
                    "whose accumulators live in DSA's stores on disk (named in its "
                    "dsa_manifest), not in the state dict, so this optimizer cannot continue "
                    "from it. Load it into a DiskSparseAdagrad over the same parameters "
                    "instead (it also loads torch.optim.Adagrad state dicts), or start this "
                    "optimizer without it")
            st = opt.state.get(p) if isinstance(opt, _ADAM_LIKE) else None
            if st and "step" in st and "exp_avg" not in st:
                raise RuntimeError(
                    f"{name} holds a state without exp_avg for parameter [{gi}, {pj}]: it "
                    "was given an adapters.torch.DiskSparseAdam state dict "
                    "(load_state_dict), whose m and v live in DSA's stores on disk (named "
                    "in its dsa_manifest), not in the state dict, so this optimizer cannot "
                    "continue from it. Load it into a DiskSparseAdam over the same "
                    "parameters instead (DiskSparseAdam also loads torch.optim.SparseAdam "
                    "state dicts), or start this optimizer without it")


def _guard(opt, args, kwargs) -> None:
    if getattr(opt, "_dsa_steps_disk_weights", False):
        return
    key = _key(opt)
    try:
        if _checked.get(opt) == key:
            return
    except TypeError:  # an optimizer that cannot be weakly referenced: check each step
        _check(opt)
        return
    _check(opt)
    _checked[opt] = key


def install() -> None:
    """Register the guard once per process."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_guard)
        _installed = True
