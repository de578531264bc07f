"""PyTorch adapter of dsa_core: sparse Adam with its state (and optionally weights) on disk.

Three entry points:

:class:`DiskSparseAdam`
    A drop-in for ``torch.optim.SparseAdam`` (``nn.Embedding`` / ``nn.EmbeddingBag`` with
    ``sparse=True``, parameters on CPU or CUDA): the same constructor, checks and
    semantics, plus ``state_dir`` (where m and v live) and ``curvature`` (Poincaré ball,
    geoopt ``SparseRiemannianAdam`` semantics)::

        opt = DiskSparseAdam(emb.parameters(), lr=1e-3, state_dir="runs/opt")
        loss.backward(); opt.step(); opt.zero_grad()

:class:`DiskEmbedding`
    An embedding (or bag) module whose weights live on disk too, for tables larger than
    RAM; :class:`DiskSparseAdam` steps it in the same loop.

:class:`DiskSparseRiemannianAdam`
    The DSA article's API (``params={"emb": table}``, ``state_files``,
    ``step(updates=...)``, ``shutdown()``), so the article's code runs with one changed
    import line.

Checkpoints: ``opt.checkpoint(dest_dir)`` writes a consistent snapshot of every store the
optimizer steps (``DiskEmbedding`` tables included) plus its state dict, committed by one
atomic rename; ``opt.load_checkpoint(dest_dir)`` resumes from it. ``DiskEmbedding`` has
``checkpoint(dest)`` / ``load_checkpoint(src)`` for its table alone.

``StoreLockedError`` (from dsa_core) is raised when a second optimizer or module opens a
store that another one is writing.
"""

from __future__ import annotations

from dsa_core import StoreLockedError

from ._torch_article import DiskSparseRiemannianAdam
from ._torch_embedding import DiskEmbedding, DiskWeight
from ._torch_optim import CHECKPOINT_FILE, MANIFEST_KEY, DiskSparseAdam

__all__ = [
    "CHECKPOINT_FILE",
    "MANIFEST_KEY",
    "DiskEmbedding",
    "DiskSparseAdam",
    "DiskSparseRiemannianAdam",
    "DiskWeight",
    "StoreLockedError",
]
