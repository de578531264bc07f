"""Scale-out of the PyTorch adapter: row-sharded disk embeddings over ``torch.distributed``.

Launch N processes (``torchrun``, one or several machines), initialise the process group
as usual (gloo on CPU, NCCL on GPUs; give it a ``timeout``), then::

    from adapters.torch_dist import ShardedDiskEmbedding, DiskSparseAdam, ddp_ignore

    emb = ShardedDiskEmbedding(10**9, 64, state_dir="/local/ssd/emb")   # rank k: .../rank{k}
    opt = DiskSparseAdam(emb.parameters(), lr=1e-3)     # steps this rank's shard
    dense = DDP(dense_model)                            # dense parts: DDP as usual
    for ids, y in loader:                               # each rank its own batch
        loss = loss_fn(dense(emb(ids)), y); loss.backward(); opt.step(); opt.zero_grad()
        if step % 1000 == 0:
            emb.checkpoint(f"ckpts/step{step}")         # every rank; complete or absent

Row ``r`` lives on rank ``r % world_size`` at local row ``r // world_size`` (``plan="mod"``;
``plan="range"`` for contiguous blocks); each shard is an ordinary dsa_core store. The result
equals one process on the concatenation of all ranks' batches. Restart after a failure with
``resume_from=`` a checkpoint of the same world size; for another world size reshard it
offline first (``python -m adapters.torch_reshard``). See :class:`ShardedDiskEmbedding`.
"""

from __future__ import annotations

from dsa_core import StoreLockedError

from ._torch_dist import (
    MANIFEST_FILE,
    SHARD_FILE,
    ShardedDiskEmbedding,
    ShardExchangeError,
    ShardPlan,
    ddp_ignore,
    read_manifest,
    shard_path,
)
from ._torch_optim import DiskSparseAdam

__all__ = [
    "MANIFEST_FILE",
    "SHARD_FILE",
    "DiskSparseAdam",
    "ShardExchangeError",
    "ShardPlan",
    "ShardedDiskEmbedding",
    "StoreLockedError",
    "ddp_ignore",
    "read_manifest",
    "shard_path",
]
