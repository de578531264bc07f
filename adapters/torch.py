"""PyTorch adapter of dsa_core: sparse Adam with its state (and optionally weights) on disk.

Four entry points:

:class:`DiskSparseAdam`
    A drop-in for ``torch.optim.SparseAdam`` (``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``, parameters on CPU or CUDA): the same constructor, checks and
    semantics, plus ``state_dir`` (where m and v live), ``curvature`` (Poincaré ball,
    geoopt ``SparseRiemannianAdam`` semantics), ``weight_decay`` /
    ``decoupled_weight_decay`` (``torch.optim.Adam``'s L2 and AdamW, on the batch's rows)
    and the per-row options ``per_row_step`` / ``decay_missed_steps``.

:class:`DiskSparseAdagrad`
    ``torch.optim.Adagrad`` on sparse gradients (its arguments and defaults), its
    accumulators on disk; ``rowwise=True`` is PyTorch-BigGraph's ``RowAdagrad``. The same
    storage arguments, checkpoints and state dicts as :class:`DiskSparseAdam`.

:class:`DiskEmbedding`
    An embedding (or bag) module whose weights live on disk too, for tables larger than
    RAM; :class:`DiskSparseAdam` steps it in the same loop (``optimizer="adagrad"`` or
    ``"rowwise_adagrad"``: :class:`DiskSparseAdagrad`).

:class:`DiskSparseRiemannianAdam`
    The DSA article's API (``params={"emb": table}``, ``state_files``,
    ``step(updates=...)``, ``shutdown()``), so the article's code runs with one changed
    import line.

>>> import tempfile, torch
>>> from adapters.torch import DiskSparseAdam
>>> tmp = tempfile.mkdtemp()
>>> emb = torch.nn.Embedding(1000, 8, sparse=True)
>>> opt = DiskSparseAdam(emb.parameters(), lr=1e-3, state_dir=f"{tmp}/opt")
>>> emb(torch.tensor([3, 7, 3])).sum().backward(); opt.step(); opt.zero_grad()
>>> _ = opt.checkpoint(f"{tmp}/ck", extra={"model": emb.state_dict()})
>>> opt.close()

Existing state is reopened only when asked: ``DiskSparseAdam(..., resume=True)`` /
``DiskEmbedding(..., resume=True)`` continue from the stores in ``state_dir``,
``overwrite=True`` replaces them, and with neither an existing store is refused
(``FileExistsError``), so a script run twice never pairs new weights with old moments
unnoticed. The article's adapter keeps the article's behaviour (it reopens) and warns.

Checkpoints: ``opt.checkpoint(dest_dir, extra={...})`` writes a consistent snapshot of
every store the optimizer steps (``DiskEmbedding`` tables included), its state dict and the
``extra`` state dicts (model, scheduler), committed by one atomic rename;
``extra = opt.load_checkpoint(dest_dir)`` resumes from it. ``opt.state_dict()`` is a small
manifest that names a snapshot of each store (either kind), so
``torch.save(opt.state_dict())`` and ``load_state_dict`` bring back exactly that point (the
newest ``keep_snapshots`` are kept; a log store's snapshot links its segments, an in-place
store's links its last snapshot's files and writes the rows changed since). With
``keep_snapshots=0`` it is only a description, and
``load_state_dict`` refuses one whose step counts the stores have moved past.
``DiskEmbedding`` has ``checkpoint(dest)`` / ``load_checkpoint(src)`` for its table alone.

``StoreLockedError`` (from dsa_core) is raised when a second optimizer or module opens a
store that another one is writing; ``StaleStateError`` when a ``dsa_core.State`` obtained
before a step (``opt.store_for(p)``, ``emb.store``) is stepped, flushed or checkpointed
after it.
"""

from __future__ import annotations

from dsa_core import StaleStateError, StoreLockedError

from ._torch_adagrad import DiskSparseAdagrad
from ._torch_article import DiskSparseRiemannianAdam
from ._torch_embedding import DiskEmbedding, DiskWeight
from ._torch_optim import CHECKPOINT_FILE, EXTRA_FILE, MANIFEST_KEY, DiskSparseAdam

__all__ = [
    "CHECKPOINT_FILE",
    "EXTRA_FILE",
    "MANIFEST_KEY",
    "DiskEmbedding",
    "DiskSparseAdagrad",
    "DiskSparseAdam",
    "DiskSparseRiemannianAdam",
    "DiskWeight",
    "StaleStateError",
    "StoreLockedError",
]
