"""PyKEEN integration: train a PyKEEN model with its optimizer state (and weights) on disk.

Needs PyKEEN (``pip install "dsa-core[pykeen]"``); imported only from here. Three pieces,
used through PyKEEN's own ``pipeline()`` or training loops (sLCWA and LCWA):

:class:`DiskAdam`
    The optimizer: ``torch.optim.SparseAdam``'s update with m and v on disk
    (:class:`adapters.torch.DiskSparseAdam`), which PyKEEN's training loop can rebuild
    from its param groups (it does at the start of each ``train()``). :class:`DiskAdagrad`
    is the same for ``torch.optim.Adagrad``'s update (and PyTorch-BigGraph's row-wise one,
    ``rowwise=True``).
:class:`SparseEmbedding`
    PyKEEN's ``Embedding`` with row-sparse gradients and the constrainer applied to the
    rows a batch used: weights in RAM, optimizer state on disk.
:class:`DiskBackedEmbedding`
    The weights on disk too, for tables larger than memory.

:func:`sparse_representations` and :func:`disk_representations` give the ``model_kwargs``
that put them in any model built from ``Embedding`` representations (TransE, DistMult,
ComplEx, RotatE, ...). Importing this module registers the three classes with PyKEEN's
resolvers, so ``optimizer="DiskAdam"`` (or ``"DiskAdagrad"``) and
``entity_representations="SparseEmbedding"``
work as names too.

>>> import tempfile
>>> from pykeen.pipeline import pipeline
>>> from adapters import pykeen as dsa
>>> tmp = tempfile.mkdtemp()
>>> result = pipeline(
...     dataset="Nations", model="TransE", random_seed=0,
...     model_kwargs=dict(embedding_dim=8, **dsa.disk_representations(f"{tmp}/tables")),
...     optimizer=dsa.DiskAdam, optimizer_kwargs=dict(lr=1e-2),
...     training_kwargs=dict(num_epochs=1, batch_size=256, use_tqdm=False),
...     evaluation_kwargs=dict(slice_size=8, use_tqdm=False))
>>> 0 < result.get_metric("mrr") <= 1
True
>>> dsa.close(result.model, result.training_loop.optimizer)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from class_resolver.contrib.torch import optimizer_resolver
from pykeen.nn import representation_resolver

from ._pykeen_optim import DiskAdagrad, DiskAdam
from ._pykeen_repr import DiskBackedEmbedding, SparseEmbedding, check_options

__all__ = ["DiskAdagrad", "DiskAdam", "DiskBackedEmbedding", "SparseEmbedding", "close",
           "disk_representations", "sparse_representations"]

for _opt in (DiskAdam, DiskAdagrad):
    optimizer_resolver.register(_opt, raise_on_conflict=False)
for _cls in (SparseEmbedding, DiskBackedEmbedding):
    representation_resolver.register(_cls, raise_on_conflict=False)


def sparse_representations() -> dict[str, Any]:
    """``model_kwargs`` entries giving a model :class:`SparseEmbedding` tables.

    ``pipeline(model="TransE", model_kwargs=dict(embedding_dim=50,
    **sparse_representations()), optimizer=DiskAdam, optimizer_kwargs=dict(state_dir=...))``:
    the weights stay in RAM, the optimizer's m and v go to ``state_dir``.
    """
    return {"entity_representations": SparseEmbedding,
            "relation_representations": SparseEmbedding}


def disk_representations(root_dir, *, overwrite: bool = False, **options: Any) -> dict[str, Any]:
    """``model_kwargs`` entries giving a model :class:`DiskBackedEmbedding` tables.

    The entity table's store goes to ``<root_dir>/entities`` and the relation table's to
    ``<root_dir>/relations``; then :class:`DiskAdam` needs no ``state_dir``. ``options``
    (``storage``, ``memory``, ``access``, ``max_full_rows``, ``chunk_rows``, ``optimizer``)
    apply to both; ``optimizer="adagrad"`` (or ``"rowwise_adagrad"``) makes tables for
    :class:`DiskAdagrad` (``rowwise=True``), whose state the records hold.
    Another keyword is refused (``TypeError``), and ``resume`` too (``ValueError``): PyKEEN
    re-initialises the tables when it trains, so a store is continued through PyKEEN's
    checkpoints with ``overwrite=True`` instead (docs/pykeen.md, "Stopping and resuming").
    A model with several entity (or relation) representations takes a list: pass
    ``entity_representations=[DiskBackedEmbedding.at(dir1), DiskBackedEmbedding.at(dir2)]``
    yourself.
    """
    check_options({"overwrite": overwrite, **options}, "disk_representations")
    root = Path(root_dir)
    return {"entity_representations": at(root / "entities", overwrite=overwrite, **options),
            "relation_representations": at(root / "relations", overwrite=overwrite,
                                           **options)}


def at(state_dir, **options: Any) -> type[DiskBackedEmbedding]:
    """A :class:`DiskBackedEmbedding` class bound to ``state_dir`` (and ``options``).

    PyKEEN models build their representations from a class and the kwargs they choose, so
    the store's place travels in the class.
    """
    check_options(options, "DiskBackedEmbedding.at")
    return type("DiskBackedEmbedding", (DiskBackedEmbedding,),
                {"bound_state_dir": Path(state_dir), "bound_options": dict(options),
                 "__module__": __name__})


DiskBackedEmbedding.at = staticmethod(at)


def close(model, optimizer=None) -> None:
    """Close ``optimizer`` (a :class:`DiskAdam`) and every :class:`DiskBackedEmbedding` of
    ``model``: everything flushed, every lock released. Safe to call twice; a forgotten
    close is done at garbage collection or interpreter exit."""
    if optimizer is not None and hasattr(optimizer, "close"):
        optimizer.close()
    for m in model.modules():
        if isinstance(m, DiskBackedEmbedding):
            m.close()
