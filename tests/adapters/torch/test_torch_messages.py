"""Drop-in conventions a torch user tries first (issue "Drop-in means drop-in").

Each failed before this fix: numpy or list ids (``got int64``, ``AttributeError: 'list'
object has no attribute 'dtype'``), ``torch.optim.Adam`` over a DiskEmbedding (torch's
"consider SparseAdam", though the docs promise a message naming DiskSparseAdam), and
``torch.optim.SparseAdam.load_state_dict(DiskSparseAdam's state dict)`` (accepted, then
``KeyError: 'exp_avg'`` at the next step).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from adapters.torch import DiskEmbedding, DiskSparseAdam  # noqa: E402

pytestmark = pytest.mark.torch
N, D = 30, 4


@pytest.mark.parametrize("mode", [None, "sum"])
def test_numpy_and_list_ids_are_taken(tmp_path, mode):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0, mode=mode)
    ids = [[1, 5, 5], [7, 0, 2]]
    want = emb(torch.tensor(ids))
    for x in (np.array(ids), np.array(ids, np.int32), ids, tuple(map(tuple, ids))):
        assert torch.equal(emb(x), want)
    if mode is not None:  # flat ids with offsets, both as numpy / lists
        flat = torch.tensor([1, 5, 5, 7])
        want = emb(flat, torch.tensor([0, 2]))
        assert torch.equal(emb(flat.numpy(), np.array([0, 2])), want)
        assert torch.equal(emb([1, 5, 5, 7], [0, 2]), want)
    # a step from list ids moves exactly the rows of the batch
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    before = emb.to_tensor()
    emb(ids).pow(2).sum().backward()
    opt.step()
    moved = (emb.to_tensor() != before).any(1).nonzero().flatten().tolist()
    assert moved == [0, 1, 2, 5, 7]
    opt.close()
    emb.close()


def test_ids_of_other_types_are_refused_naming_them(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    with pytest.raises(TypeError, match=r"got a list of float64\. Pass integer ids"):
        emb([1.5, 2.0])
    with pytest.raises(TypeError, match=r"got a str\. Pass torch\.as_tensor"):
        emb("12")
    with pytest.raises(TypeError, match=r"got a tensor of torch\.float32\. Convert it"):
        emb(torch.tensor([1.0]))
    emb.close()


@pytest.mark.parametrize("name", ["Adam", "AdamW", "RMSprop", "SGD", "SparseAdam"])
def test_torch_optimizers_refuse_a_disk_embedding_naming_disk_sparse_adam(tmp_path, name):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    dense = nn.Linear(D, 1)
    before = emb.to_tensor()
    opt = getattr(torch.optim, name)([*dense.parameters(), *emb.parameters()], lr=0.1)
    dense(emb(torch.tensor([1, 2]))).sum().backward()
    w = dense.weight.detach().clone()
    with pytest.raises(RuntimeError, match=(
            rf"torch\.optim\.{name} cannot step a DiskEmbedding's weight \(parameter \[0, 2\]\)"
            r".*only adapters\.torch\.DiskSparseAdam updates.*Nothing was changed.*"
            r"DiskSparseAdam\(emb\.parameters\(\)")):
        opt.step()
    assert torch.equal(emb.to_tensor(), before) and torch.equal(dense.weight, w)
    emb.close()


def test_sparse_adam_refuses_a_disk_sparse_adam_state_dict_at_its_step(tmp_path):
    emb = nn.Embedding(N, D, sparse=True)
    dsa = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "o")
    emb(torch.tensor([1, 2])).sum().backward()
    dsa.step()
    dsa.zero_grad()
    sd = dsa.state_dict()
    sparse_adam = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    sparse_adam.load_state_dict(sd)  # torch checks only the groups' sizes
    emb(torch.tensor([1, 2])).sum().backward()
    w = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match=(
            r"torch\.optim\.SparseAdam holds a state without exp_avg for parameter \[0, 0\]: "
            r"it was given an adapters\.torch\.DiskSparseAdam state dict.*Load it into a "
            r"DiskSparseAdam")):
        sparse_adam.step()
    assert torch.equal(emb.weight, w)
    # the other way round works: DiskSparseAdam imports a SparseAdam state dict
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    ref.step()
    dsa.load_state_dict(ref.state_dict())
    assert dsa.state[emb.weight]["step"] == 1
    dsa.close()


def test_the_guard_leaves_torch_optimizers_on_torch_parameters_alone():
    emb = nn.Embedding(N, D, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    for _ in range(2):
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.state[emb.weight]["step"] == 2
