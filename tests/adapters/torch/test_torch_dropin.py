"""DiskEmbedding as a word-for-word swap for nn.Embedding / nn.EmbeddingBag ("Drop-in means
drop-in"): torch's keywords work or are refused with the reason, from_pretrained, state dicts
that load both ways with strict=True, and model.double() / .half() on a model that holds one.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from adapters.torch import DiskEmbedding, DiskSparseAdam

nn = torch.nn


def test_nn_embedding_keywords_give_the_same_module(tmp_path):
    """nn.Embedding's and nn.EmbeddingBag's keywords, word for word, give the same lookups."""
    torch.manual_seed(0)
    w = torch.randn(12, 4)
    ids = torch.tensor([[1, 2, 3], [3, 0, 11]])
    kw = {"padding_idx": 3, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False,
          "sparse": True, "_weight": w, "_freeze": False, "device": "cpu",
          "dtype": torch.float32}
    ref = nn.Embedding(12, 4, **kw)
    de = DiskEmbedding(num_embeddings=12, embedding_dim=4, state_dir=tmp_path / "e", **kw)
    assert torch.equal(de.to_tensor(), w)  # _weight is the table; its padding row kept
    assert torch.equal(de(ids), ref(ids))
    de(ids).pow(2).sum().backward()
    ref(ids).pow(2).sum().backward()
    assert torch.equal(de.weight.grad.to_dense(), ref.weight.grad.to_dense())
    de.close()

    bkw = {"mode": "sum", "include_last_offset": True, "padding_idx": 0, "max_norm": None,
           "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": True, "_weight": w,
           "device": "cpu", "dtype": torch.float32}
    bag = nn.EmbeddingBag(12, 4, **bkw)
    dbag = DiskEmbedding(12, 4, state_dir=tmp_path / "b", **bkw)
    flat, offsets = torch.tensor([1, 0, 2, 5, 5, 7]), torch.tensor([0, 2, 6])
    psw = torch.rand(6)
    assert torch.allclose(dbag(flat, offsets, per_sample_weights=psw),
                          bag(flat, offsets, per_sample_weights=psw))
    dbag.close()

    frozen = DiskEmbedding(12, 4, state_dir=tmp_path / "f", _weight=w, _freeze=True)
    assert not frozen.weight.requires_grad and not frozen(ids).requires_grad
    assert not nn.Embedding(12, 4, _weight=w, _freeze=True).weight.requires_grad
    frozen.close()
    # _weight's dtype is the table's (nn.Embedding's weight is _weight)
    d64 = DiskEmbedding(12, 4, state_dir=tmp_path / "d", _weight=w.double())
    assert d64.weight.dtype == torch.float64 and d64.store.dtype == np.float64
    d64.close()


@pytest.mark.parametrize("kw, err, match", [
    ({"sparse": False}, ValueError,
     r"sparse=False asks for a dense gradient.*always row-sparse.*DiskSparseAdam.*Leave "
     r"sparse out or pass sparse=True"),
    ({"max_norm": 1.0}, ValueError,
     r"max_norm=1.0 is not supported.*in place inside forward.*Leave max_norm out"),
    ({"norm_type": "l2"}, TypeError, r"norm_type must be a number"),
    ({"_freeze": "yes"}, TypeError, r"_freeze must be a bool"),
    ({"_weight": torch.zeros(5, 4)}, ValueError,
     r"_weight must have the shape \(num_embeddings, embedding_dim\) = \(12, 4\), got \(5, 4\)"),
    ({"_weight": torch.zeros(12, 4), "init": "zeros"}, ValueError,
     r"_weight= and init= both give the initial table"),
    ({"paddding_idx": 1}, TypeError,
     r"unexpected keyword argument\(s\) 'paddding_idx' \(did you mean 'padding_idx'\?\)\. It "
     r"takes nn.Embedding's and nn.EmbeddingBag's keywords \(num_embeddings, .*\) and its own "
     r"\(state_dir, .*\)"),
])
def test_keywords_without_a_meaning_here_are_refused_with_the_reason(tmp_path, kw, err, match):
    with pytest.raises(err, match=match):
        DiskEmbedding(12, 4, state_dir=tmp_path / "e", **kw)
    assert not (tmp_path / "e").exists()  # nothing created


def test_from_pretrained_as_nn_embedding(tmp_path):
    torch.manual_seed(1)
    w = torch.randn(10, 3)
    ids = torch.tensor([0, 4, 4, 9])
    ref = nn.Embedding.from_pretrained(w, padding_idx=0)
    de = DiskEmbedding.from_pretrained(w, padding_idx=0, state_dir=tmp_path / "a")
    assert torch.equal(de(ids), ref(ids)) and de.padding_idx == 0
    assert not de.weight.requires_grad and not de(ids).requires_grad  # freeze=True
    de.close()

    de = DiskEmbedding.from_pretrained(w, freeze=False, state_dir=tmp_path / "b")
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    de(ids).sum().backward()
    opt.step()
    assert not torch.equal(de.weight_rows([4]), w[[4]])  # trainable
    opt.close()
    de.close()

    bag = nn.EmbeddingBag.from_pretrained(w, mode="sum")
    dbag = DiskEmbedding.from_pretrained(w, mode="sum", state_dir=tmp_path / "c")
    x = torch.tensor([[1, 2], [3, 3]])
    assert torch.allclose(dbag(x), bag(x))
    dbag.close()
    with pytest.raises(ValueError, match=r"embeddings must be 2-D .* got shape \(2, 3, 4\)"):
        DiskEmbedding.from_pretrained(torch.zeros(2, 3, 4), state_dir=tmp_path / "d")
    with pytest.raises(ValueError, match="sparse=False"):
        DiskEmbedding.from_pretrained(w, sparse=False, state_dir=tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_state_dicts_load_both_ways_with_strict(tmp_path):
    """A small DiskEmbedding's state dict has nn.Embedding's keys: each loads the other's with
    strict=True, alone and inside a model; saved and loaded through torch.save it is still a
    checkpoint of the table (m, v and count too)."""
    torch.manual_seed(2)
    de = DiskEmbedding(20, 4, state_dir=tmp_path / "e", seed=0)
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    de(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    opt.zero_grad()

    ne = nn.Embedding(20, 4)
    ne.load_state_dict(de.state_dict())  # strict=True
    assert torch.equal(ne.weight.detach(), de.to_tensor())
    other = nn.Embedding(20, 4)
    de.load_state_dict(other.state_dict())  # strict=True
    assert torch.equal(de.to_tensor(), other.weight.detach())
    assert de.store.count == 1  # an nn.Embedding weight: the rows only, m and v kept

    disk_model = nn.Sequential(de, nn.Linear(4, 2))
    nn_model = nn.Sequential(nn.Embedding(20, 4), nn.Linear(4, 2))
    nn_model.load_state_dict(disk_model.state_dict())
    assert torch.equal(nn_model[0].weight.detach(), de.to_tensor())
    with torch.no_grad():
        nn_model[0].weight.mul_(2)
    disk_model.load_state_dict(nn_model.state_dict())
    assert torch.equal(de.to_tensor(), nn_model[0].weight.detach())

    # through torch.save: the rest of the records travels in the state dict's metadata
    buf = io.BytesIO()
    torch.save(disk_model.state_dict(), buf)
    m_saved, count = de.store.exp_avg.copy(), de.store.count
    de(torch.tensor([1, 5])).sum().backward()
    opt.step()
    buf.seek(0)
    disk_model.load_state_dict(torch.load(buf, weights_only=True))
    assert de.store.count == count and np.array_equal(de.store.exp_avg, m_saved)
    # a missing weight is reported as nn.Embedding reports it
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "weight"'):
        de.load_state_dict({})
    opt.close()
    de.close()


def test_model_double_and_half_keep_the_table_and_cast_outputs(tmp_path):
    """model.double() / .half() on a model with a DiskEmbedding: the table keeps its store's
    dtype (one warning, naming dtype=torch.float64), its outputs follow the model's dtype, the
    gradient stays in the table's, and training goes on."""
    torch.manual_seed(3)
    w = torch.randn(15, 4)
    de = DiskEmbedding(15, 4, state_dir=tmp_path / "e", init=w)
    model = nn.Sequential(de, nn.Linear(4, 1))
    ids = torch.tensor([[1, 2], [2, 14]])
    with pytest.warns(UserWarning, match=r"DiskEmbedding\(15, 4\) keeps its table in float32.*"
                                         r"cast to torch.float64.*DiskEmbedding\(\.\.\., "
                                         r"dtype=torch.float64\)"):
        model.double()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per table
        model.double()
        model.to(torch.float64)
    assert de.weight.dtype == torch.float32 and de.store.dtype == np.float32
    out = model(ids)
    assert out.dtype == torch.float64
    ref = nn.Sequential(nn.Embedding.from_pretrained(w), model[1]).double()
    assert torch.allclose(out, ref(ids))
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    out.sum().backward()
    assert de.weight.grad.dtype == torch.float32
    opt.step()
    assert not torch.equal(de.weight_rows([2]), w[[2]])
    model.float()
    assert model(ids).dtype == torch.float32
    model.half()
    assert de(ids).dtype == torch.float16
    model.to("cpu")  # a move keeps the cast
    assert de(ids).dtype == torch.float16
    opt.close()
    de.close()

    bag = DiskEmbedding(15, 4, state_dir=tmp_path / "b", mode="sum", init=w)
    with pytest.warns(UserWarning, match="keeps its table in float32"):
        bag.double()
    x, psw = torch.tensor([[1, 2], [3, 4]]), torch.rand(2, 2, dtype=torch.float64)
    out = bag(x, per_sample_weights=psw)  # the model's float64 weights are taken
    assert out.dtype == torch.float64
    assert torch.allclose(out, nn.EmbeddingBag.from_pretrained(w.double(), mode="sum")(
        x, per_sample_weights=psw))
    bag.close()
