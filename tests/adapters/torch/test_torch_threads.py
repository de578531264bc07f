"""DSA's kernels take torch's thread count (issue "Drop-in means drop-in").

Before, ``torch.set_num_threads(1)`` (or a launcher's ``OMP_NUM_THREADS=1``) left DSA's
kernels on every core: a job of one process per core oversubscribed the machine. Now the
torch adapter sets DSA's count to ``torch.get_num_threads()`` at each step and each
``DiskEmbedding`` gather, unless the user set DSA's own (an explicit
``dsa_core.set_num_threads`` wins).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dsa_core  # noqa: E402
from adapters.torch import DiskEmbedding, DiskSparseAdam  # noqa: E402
from dsa_core import _pool  # noqa: E402

pytestmark = pytest.mark.torch


@pytest.fixture
def following(monkeypatch):
    """DSA's count at its default (following torch), torch's and DSA's restored after."""
    for k in ("DSA_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    old_torch, old_dsa = torch.get_num_threads(), (_pool._POOL.threads, _pool._POOL.source)
    monkeypatch.setattr(_pool, "_cpus", lambda: 4)  # a 4-CPU process, whatever runs this
    dsa_core.set_num_threads(None)
    assert dsa_core.get_num_threads() == 4
    yield
    torch.set_num_threads(old_torch)
    _pool._POOL.threads, _pool._POOL.source = old_dsa


def _step(emb, opt, ids):
    emb(torch.tensor(ids)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_dsa_follows_torch_set_num_threads(tmp_path, following):
    emb = nn.Embedding(20, 4, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "opt")
    torch.set_num_threads(1)
    _step(emb, opt, [1, 2, 3])
    assert dsa_core.get_num_threads() == 1
    torch.set_num_threads(3)
    _step(emb, opt, [1, 2, 3])
    assert dsa_core.get_num_threads() == 3
    torch.set_num_threads(16)  # capped by the CPUs this process may use
    _step(emb, opt, [1, 2, 3])
    assert dsa_core.get_num_threads() == 4
    # an explicit count wins over torch's, from then on
    dsa_core.set_num_threads(2)
    torch.set_num_threads(1)
    _step(emb, opt, [1, 2, 3])
    assert dsa_core.get_num_threads() == 2
    opt.close()


def test_disk_embedding_gather_follows_torch(tmp_path, following):
    emb = DiskEmbedding(20, 4, state_dir=tmp_path / "e", seed=0)
    torch.set_num_threads(1)
    with torch.no_grad():
        emb(torch.tensor([1, 2]))  # no optimizer step yet: the forward's gather follows
    assert dsa_core.get_num_threads() == 1
    emb.close()
