"""Torch conventions that used to return wrong values or fail obscurely on a DiskEmbedding.

Each test here failed on the code before these fixes (issue 26): ``emb.weight`` read as
zeros, ``torch.optim.SparseAdam`` died on a memory-overlap error, ``device="cuda"`` without
CUDA left a store behind, ``state_dir`` was silently ignored, ``dsa info`` showed the
create-time lr, a second DiskEmbedding on a store advised ``dsa_core.close``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dsa_core  # noqa: E402
from adapters.torch import DiskEmbedding, DiskSparseAdam, DiskWeight  # noqa: E402

pytestmark = pytest.mark.torch
KINDS = ["inplace", "log"]
N, D = 50, 6


def _trained(path, storage, lr=0.01, steps=3):
    emb = DiskEmbedding(N, D, state_dir=path, seed=0, storage=storage)
    opt = DiskSparseAdam(emb.parameters(), lr=lr)
    for s in range(steps):
        emb(torch.tensor([1, 5, 5, 7 + s])).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return emb, opt


@pytest.mark.parametrize("storage", KINDS)
def test_weight_reads_the_real_rows(tmp_path, storage):
    emb, opt = _trained(tmp_path / "e", storage)
    rows = emb.weight_rows(torch.arange(N))
    assert rows.abs().sum() > 0
    assert torch.equal(emb.weight[5].detach(), rows[5])                 # was all zeros
    assert np.array_equal(emb.weight.detach().cpu().numpy(), rows.numpy())
    assert np.array_equal(np.asarray(emb.weight.detach()), rows.numpy())
    with torch.no_grad():
        assert torch.equal(emb.weight.norm(dim=1), rows.norm(dim=1))
    assert torch.equal(emb.to_tensor(), rows)
    # the copy of nn.Embedding.from_pretrained is the trained table
    pre = nn.Embedding.from_pretrained(emb.to_tensor())
    assert torch.equal(pre(torch.tensor([5, 7])), rows[[5, 7]])
    # metadata costs nothing and is the table's
    assert emb.weight.shape == (N, D) and emb.weight.numel() == N * D
    assert emb.weight.untyped_storage().nbytes() == 4
    opt.close()
    emb.close()


@pytest.mark.parametrize("storage", KINDS)
def test_export_writes_the_table(tmp_path, storage):
    emb, opt = _trained(tmp_path / "e", storage)
    out = emb.export(tmp_path / "w.npy")
    assert np.array_equal(np.load(out), emb.to_tensor().numpy())
    with pytest.raises(FileExistsError, match="overwrite=True"):
        emb.export(out)
    emb.export(out, overwrite=True)
    assert not list(tmp_path.glob(".w.npy.tmp-*"))
    opt.close()
    emb.close()


def test_large_table_refuses_whole_reads(tmp_path, monkeypatch):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    monkeypatch.setattr(DiskWeight, "read_limit", 64)  # bytes: the table is 1200
    for read in (lambda: emb.weight[5], lambda: emb.weight.detach().cpu().numpy(),
                 lambda: np.asarray(emb.weight)):
        with pytest.raises(RuntimeError, match=r"weight_rows\(ids\).*to_tensor\(\).*export"):
            read()
    assert emb.to_tensor().shape == (N, D)  # explicit: no limit
    emb.close()


def test_from_pretrained_and_writes_are_refused(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    before = emb.to_tensor()
    with pytest.raises(TypeError, match=r"emb\.to_tensor\(\)"):
        nn.Embedding.from_pretrained(emb.weight)
    with pytest.raises(RuntimeError, match="DiskSparseAdam"):
        nn.init.normal_(emb.weight)
    with pytest.raises(RuntimeError, match="in place.*DiskSparseAdam"):
        emb.weight.data.uniform_()
    assert emb.weight.data.device == emb.weight.device  # metadata through .data (PyKEEN)
    assert not emb.weight.data.requires_grad
    assert torch.equal(emb.weight.data[3], before[3])  # a read through .data: real rows
    with pytest.raises(RuntimeError, match="in place"), torch.no_grad():
        emb.weight[0] = 1.0
    with pytest.raises(RuntimeError, match="in place"):
        emb.weight.data = torch.zeros(N, D)
    assert torch.equal(emb.to_tensor(), before)
    emb.close()


def test_dense_gradient_from_a_whole_table_term_is_refused(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    before = emb.to_tensor()
    (emb(torch.tensor([1, 2])).sum() + emb.weight.pow(2).sum()).backward()
    assert emb.weight.grad.layout == torch.strided
    with pytest.raises(RuntimeError, match=r"read emb\.weight as a whole"):
        opt.step()
    assert torch.equal(emb.to_tensor(), before) and emb.store.count == 0
    opt.close()
    emb.close()


def test_torch_sparse_adam_names_disk_sparse_adam(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    before = emb.to_tensor()
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="DiskSparseAdam"):
        opt.step()
    assert torch.equal(emb.to_tensor(), before)
    emb.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_device_creates_nothing(tmp_path):
    with pytest.raises(ValueError, match="nothing was created"):
        DiskEmbedding(N, D, state_dir=tmp_path / "e", device="cuda")
    assert not (tmp_path / "e").exists()
    DiskEmbedding(N, D, state_dir=tmp_path / "e").close()  # the retry on the CPU works


def test_unused_state_dir_warns(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    with pytest.warns(UserWarning, match="state_dir=.* is not used"):
        opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "opt")
    opt.close()
    # a parameter held in memory uses it: no warning
    dense = nn.Embedding(N, D, sparse=True)
    opt = DiskSparseAdam([*emb.parameters(), *dense.parameters()], state_dir=tmp_path / "o2")
    opt.close()
    # two DiskEmbeddings: their group's commit file lives there, no warning
    emb2 = DiskEmbedding(N, D, state_dir=tmp_path / "e2", seed=1)
    opt = DiskSparseAdam([*emb.parameters(), *emb2.parameters()], state_dir=tmp_path / "o3")
    opt.step()  # joins the group: the commit file is written in state_dir
    assert (tmp_path / "o3" / dsa_core.tools.GROUP_FILE).exists()
    opt.close()
    emb2.close()
    emb.close()


@pytest.mark.parametrize("storage", KINDS)
def test_store_records_the_optimizer_lr(tmp_path, storage):
    emb, opt = _trained(tmp_path / "e", storage, lr=0.01)
    opt.close()
    emb.close()
    st = dsa_core.open(tmp_path / "e", mode="r")
    try:
        assert st.lr == 0.01 and st.count == 3  # was the create-time 0.001
    finally:
        dsa_core.close(st)


def test_second_embedding_on_a_store_names_emb_close(tmp_path):
    first = DiskEmbedding(N, D, state_dir=tmp_path / "e", seed=0)
    for kw in ({"resume": True}, {"overwrite": True}):  # the notebook cell run again
        with pytest.raises(dsa_core.StoreLockedError, match=r"emb\.close\(\)"):
            DiskEmbedding(N, D, state_dir=tmp_path / "e", **kw)
    first.close()
    DiskEmbedding(N, D, state_dir=tmp_path / "e", resume=True).close()


# -- dsa_core.close through an outdated State (the docs call close safe to repeat) ----------
@pytest.mark.parametrize("storage", KINDS)
def test_close_through_an_outdated_state_closes_at_the_newest_count(tmp_path, storage):
    s0 = dsa_core.create(tmp_path / "s", N, D, init="normal", seed=1, storage=storage)
    s1 = dsa_core.step(s0, [1, 4], np.ones((2, D), np.float32))
    s2 = dsa_core.step(s1._replace(lr=0.05), [4, 9], np.ones((2, D), np.float32))
    rows = dsa_core.gather(s2, np.arange(N))
    dsa_core.close(s0)           # was StaleStateError
    assert s2.closed
    dsa_core.close(s1)           # again, and through the newest one: nothing left to do
    dsa_core.close(s2)
    st = dsa_core.open(tmp_path / "s")   # a clean stop: opens for writing
    try:
        assert st.count == 2 and st.lr == 0.05  # the newest step's count and settings
        assert np.array_equal(dsa_core.gather(st, np.arange(N)), rows)
    finally:
        dsa_core.close(st)


def test_close_an_embeddings_old_store_state(tmp_path):
    emb, opt = _trained(tmp_path / "e", "inplace", steps=1)
    old = emb.store
    emb(torch.tensor([2, 3])).sum().backward()
    opt.step()
    dsa_core.close(old)          # was StaleStateError
    opt.close()
    emb.close()
    st = dsa_core.open(tmp_path / "e", mode="r")
    assert st.count == 2
    dsa_core.close(st)


_KILL_AFTER_CLOSE = """
import os, signal, sys, numpy as np
sys.path.insert(0, sys.argv[3])
import dsa_core
s0 = dsa_core.create(sys.argv[1], 50, 6, init="normal", seed=1, storage=sys.argv[2])
s1 = dsa_core.step(s0, [1, 4], np.ones((2, 6), np.float32))
s2 = dsa_core.step(s1, [4, 9], np.ones((2, 6), np.float32))
np.save(sys.argv[1] + ".rows.npy", dsa_core.gather(s2, np.arange(50)))
dsa_core.close(s0)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("storage", KINDS)
def test_close_through_an_outdated_state_is_durable_under_kill(tmp_path, storage):
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[3])
    p = subprocess.run([sys.executable, "-c", _KILL_AFTER_CLOSE, str(tmp_path / "s"), storage,
                        repo], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    st = dsa_core.open(tmp_path / "s")  # clean: no UncleanStopError, count and rows kept
    try:
        assert st.count == 2
        assert np.array_equal(dsa_core.gather(st, np.arange(N)),
                              np.load(str(tmp_path / "s") + ".rows.npy"))
    finally:
        dsa_core.close(st)
