"""Scale-out of the PyTorch adapter: row-sharded disk embeddings over ``torch.distributed``.

Launch N processes (``torchrun``, one or several machines) and initialise the process group
in each as usual (gloo on CPU, NCCL on GPUs; give it a ``timeout``, e.g.
``dist.init_process_group("gloo", timeout=timedelta(seconds=60))``). The training loop is
the single-process one; here it runs in one process, a group of one rank:

>>> import tempfile, torch, torch.distributed as dist
>>> from torch.nn.parallel import DistributedDataParallel as DDP
>>> from adapters.torch_dist import ShardedDiskEmbedding, DiskSparseAdam
>>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
>>> tmp = tempfile.mkdtemp()
>>> emb = ShardedDiskEmbedding(10_000, 16, state_dir=f"{tmp}/emb")  # rank k: emb/rank{k}
>>> opt = DiskSparseAdam(emb.parameters(), lr=1e-3)    # steps this rank's shard
>>> dense = DDP(torch.nn.Linear(16, 1))                # dense parts: DDP as usual
>>> dopt = torch.optim.Adam(dense.parameters(), lr=1e-3)
>>> for step in range(1, 5):                           # each rank its own batch
...     loss = dense(emb(torch.randint(0, 10_000, (32,)))).square().mean()
...     loss.backward(); opt.step(); dopt.step(); opt.zero_grad(); dopt.zero_grad()
...     if step % 2 == 0:                              # every rank; complete or absent
...         _ = emb.checkpoint(f"{tmp}/ckpt/step{step}")
>>> read_manifest(f"{tmp}/ckpt/step4")["count"]
4
>>> opt.close(); emb.close(); dist.destroy_process_group()

Row ``r`` lives on rank ``r % world_size`` at local row ``r // world_size`` (``plan="mod"``;
``plan="range"`` for contiguous blocks); each shard is an ordinary dsa_core store. The result
equals one process on the concatenation of all ranks' batches. A second run on the same
``state_dir`` says what it wants: ``resume=True`` continues the shards, ``overwrite=True``
replaces them. Restart after a failure with ``resume_from=`` a checkpoint of the same world
size; for another world size reshard it offline first (``python -m adapters.torch_reshard``).
See :class:`ShardedDiskEmbedding`; the on-disk format is :mod:`adapters._torch_shards`.
"""

from __future__ import annotations

from dsa_core import StoreLockedError

from ._torch_dist import ShardedDiskEmbedding, ShardExchangeError, ddp_ignore
from ._torch_optim import DiskSparseAdam
from ._torch_shards import MANIFEST_FILE, SHARD_FILE, ShardPlan, read_manifest, shard_path

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
