"""``adapters.torch.DiskSparseAdagrad`` and ``DiskEmbedding(optimizer=...)`` (issue 43):
torch training loops against ``torch.optim.Adagrad`` on ``nn.Embedding(sparse=True)`` with an
lr scheduler, row-wise against PyTorch-BigGraph's ``RowAdagrad``; torch's argument checks;
the optimizer a DiskEmbedding was created for; state dicts (ours and torch's) and
checkpoints. Both store kinds.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

# the PBG transcription of the kernel tests (tests/core, on the path when they are collected)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "core"))
from test_adagrad_kernels import PBGRowAdagrad  # noqa: E402

from adapters.torch import DiskEmbedding, DiskSparseAdagrad, DiskSparseAdam  # noqa: E402

N, D, STEPS = 60, 8, 8
KW = {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.05}


def batches(seed=0, steps=STEPS, n=N):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, n, (24,), generator=g) for _ in range(steps)]


def loss(out, t):
    """A loss whose row gradients differ per coordinate, per position in the batch and per
    step (duplicates summed), and do not depend on the weights: the accumulators then see
    the same gradients as torch's although the weights differ in the last bit (torch's
    square root), and can be compared bit for bit."""
    w = torch.linspace(-1.0, 2.0, out.shape[-1], dtype=out.dtype) * (1 + t % 3)
    pos = torch.sin(torch.arange(out.shape[0], dtype=out.dtype) * 0.7 + t)[:, None]
    return (out * w * pos).sum()


def train(emb, opt, ids, t0=0) -> None:
    """One step of ``opt`` per batch of ``ids`` on ``emb``'s loss, numbered from ``t0``."""
    for t, i in enumerate(ids, t0):
        opt.zero_grad()
        loss(emb(i), t).backward()
        opt.step()


def run(model, opt, sched, ids_list, emb_of=lambda m: m):
    for t, ids in enumerate(ids_list):
        opt.zero_grad()
        loss(emb_of(model)(ids), t).backward()
        with torch.sparse.check_sparse_tensor_invariants():
            opt.step()
        sched.step()


def reference(init, ids_list, **kw):
    emb = torch.nn.Embedding(N, D, sparse=True, dtype=init.dtype)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = torch.optim.Adagrad(emb.parameters(), **kw)
    run(emb, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), ids_list)
    return emb.weight.detach(), opt.state[emb.weight]["sum"]


def accumulators(st, iav):
    import dsa_core

    lay = st.layout
    a = dsa_core.read_records(st, np.arange(st.num_rows))[:, lay["v"]:lay["v"] + lay["v_width"]]
    return np.where(a == 0, st.dtype.type(iav), a)


def close_weights(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if dtype == torch.float64:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    else:  # torch's square root is not correctly rounded (test_adagrad_kernels.py: <1 ulp)
        assert np.abs(got - want).max() <= 3 * np.finfo(np.float32).eps * np.abs(want).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_embedding_parity_with_torch_adagrad(tmp_path, kind, dtype):
    """nn.Embedding(sparse=True) stepped by DiskSparseAdagrad and by torch.optim.Adagrad,
    with StepLR: the same weights (float64 to 1e-10, float32 within torch's sqrt), the same
    sums bit for bit, torch's state-dict param groups."""
    init = torch.randn(N, D, dtype=dtype, generator=torch.Generator().manual_seed(1))
    ids = batches()
    W, S = reference(init, ids, maximize=True, **KW)
    emb = torch.nn.Embedding(N, D, sparse=True, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = DiskSparseAdagrad(emb.parameters(), maximize=True, state_dir=tmp_path / "o",
                            storage=kind, **KW)
    run(emb, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), ids)
    close_weights(emb.weight.detach(), W, dtype)
    np.testing.assert_array_equal(accumulators(opt.store_for(emb.weight), KW[
        "initial_accumulator_value"]), S.numpy())
    sd = opt.state_dict()
    ref_keys = set(torch.optim.Adagrad([torch.zeros(1)]).state_dict()["param_groups"][0])
    assert ref_keys <= set(sd["param_groups"][0])
    assert sd["state"][0]["step"] == STEPS
    opt.close()


def test_disk_embedding_parity_with_torch_adagrad(tmp_path, kind):
    """DiskEmbedding(optimizer="adagrad") stepped by DiskSparseAdagrad matches nn.Embedding
    with torch.optim.Adagrad (float64: to 1e-10), over steps with an lr scheduler."""
    init = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ids = batches(seed=3)
    W, S = reference(init, ids, **KW)
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", optimizer="adagrad", init=init,
                        dtype=torch.float64, storage=kind)
    opt = DiskSparseAdagrad(emb.parameters(), **KW)
    run(emb, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5), ids)
    import dsa_core

    got = dsa_core.gather(emb.store, np.arange(N))
    close_weights(got, W, torch.float64)
    np.testing.assert_array_equal(accumulators(emb.store, KW["initial_accumulator_value"]),
                                  S.numpy())
    assert emb.optimizer == "adagrad" and emb.store.count == STEPS
    opt.close()
    emb.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_rowwise_is_pbg_row_adagrad(tmp_path, kind, dtype):
    """DiskSparseAdagrad(rowwise=True) against the PBG RowAdagrad transcription of
    test_adagrad_kernels (torch's row mean and sqrt: within 6 ulp of the largest weight, the
    kernel tests' measured bound), through an nn.Embedding and a DiskEmbedding alike."""
    init = torch.randn(N, D, dtype=dtype, generator=torch.Generator().manual_seed(4))
    ids = batches(seed=5)
    ref = init.clone()
    pbg = PBGRowAdagrad(ref, lr=0.1, lr_decay=0.01)
    emb = torch.nn.Embedding(N, D, sparse=True, dtype=dtype)
    with torch.no_grad():
        emb.weight.copy_(init)
    opt = DiskSparseAdagrad(emb.parameters(), lr=0.1, lr_decay=0.01, rowwise=True,
                            state_dir=tmp_path / "o", storage=kind)
    demb = DiskEmbedding(N, D, state_dir=tmp_path / "e", optimizer="rowwise_adagrad",
                         init=init, dtype=dtype, storage=kind)
    dopt = DiskSparseAdagrad(demb.parameters(), lr=0.1, lr_decay=0.01, rowwise=True)
    for t, i in enumerate(ids):
        for m, o in ((emb, opt), (demb, dopt)):
            o.zero_grad()
            loss(m(i), t).backward()
            o.step()
        g = torch.sparse_coo_tensor(i[None], torch.ones(len(i), D, dtype=dtype), (N, D))
        e = torch.nn.Embedding(N, D, sparse=True, dtype=dtype)
        with torch.no_grad():
            e.weight.copy_(ref)
        loss(e(i), t).backward()
        g = e.weight.grad.coalesce()
        pbg.step(g.indices()[0], g.values())
    import dsa_core

    tol = 6 * np.finfo(np.dtype(str(dtype).split(".")[1])).eps * ref.abs().max().item()
    assert (emb.weight.detach() - ref).abs().max().item() <= tol
    got = dsa_core.gather(demb.store, np.arange(N))
    np.testing.assert_array_equal(got, emb.weight.detach().numpy())  # one kernel, two homes
    assert opt.store_for(emb.weight).layout["v_width"] == 1
    for o in (opt, dopt):
        o.close()
    demb.close()


# -- arguments and the optimizer a table was created for ---------------------------------------
@pytest.mark.parametrize(("kw", "err", "match"), [
    ({"lr": -0.1}, ValueError, r"^Invalid learning rate: -0.1$"),
    ({"lr_decay": -1}, ValueError, r"^Invalid lr_decay value: -1$"),
    ({"weight_decay": -1}, ValueError, r"^Invalid weight_decay value: -1$"),
    ({"initial_accumulator_value": -1}, ValueError,
     r"^Invalid initial_accumulator_value value: -1$"),
    ({"eps": -1}, ValueError, r"^Invalid epsilon value: -1$"),
    ({"lr": 0.0}, ValueError, "needs lr > 0"),
    ({"weight_decay": 0.1}, ValueError, "not compatible with sparse gradients"),
    ({"foreach": True}, ValueError, "foreach=True selects one of torch's"),
    ({"lr": "0.1"}, TypeError, "lr must be a number"),
])
def test_torch_checks(tmp_path, kw, err, match):
    emb = torch.nn.Embedding(N, D, sparse=True)
    if not match.startswith("^"):
        with pytest.raises(err, match=match):
            DiskSparseAdagrad(emb.parameters(), state_dir=tmp_path / "o", **kw)
    else:
        with pytest.raises(err, match=match):
            torch.optim.Adagrad(emb.parameters(), **kw)  # torch's own message, word for word
        with pytest.raises(err, match=match):
            DiskSparseAdagrad(emb.parameters(), state_dir=tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_rowwise_takes_l2_and_dense_gradients_are_refused(tmp_path):
    emb = torch.nn.Embedding(N, D, sparse=True)
    opt = DiskSparseAdagrad(emb.parameters(), rowwise=True, weight_decay=0.01,
                            state_dir=tmp_path / "o")
    assert opt.store_for(emb.weight).weight_decay == 0.01
    opt.close()
    dense = torch.nn.Embedding(N, D)
    opt = DiskSparseAdagrad(dense.parameters(), state_dir=tmp_path / "d")
    dense(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="please consider torch.optim.Adagrad instead"):
        opt.step()
    opt.close()


def test_wrong_optimizer_for_a_disk_embedding(tmp_path, kind):
    """A DiskEmbedding holds one optimizer's state: stepping it with another is an error that
    names ``optimizer=``; resuming it as another is refused; Adam's options are refused."""
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "g", optimizer="adagrad", storage=kind)
    with pytest.raises(ValueError, match=r"optimizer='adagrad'.*DiskEmbedding\(\.\.\., "
                                         r"optimizer='adam'\)"):
        DiskSparseAdam(emb.parameters())
    with pytest.raises(ValueError, match=r"needs DiskEmbedding\(\.\.\., "
                                         r"optimizer='rowwise_adagrad'\)"):
        DiskSparseAdagrad(emb.parameters(), rowwise=True)
    emb.close()
    with pytest.raises(ValueError, match="created with optimizer='adagrad'.*'adam' was asked"):
        DiskEmbedding(N, D, state_dir=tmp_path / "g", resume=True, storage=kind)
    adam = DiskEmbedding(N, D, state_dir=tmp_path / "a", storage=kind)
    with pytest.raises(ValueError, match=r"needs DiskEmbedding\(\.\.\., optimizer='adagrad'\)"):
        DiskSparseAdagrad(adam.parameters())
    adam.close()
    with pytest.raises(ValueError, match="second_moment='rowwise' is Adam's"):
        DiskEmbedding(N, D, state_dir=tmp_path / "x", optimizer="adagrad",
                      second_moment="rowwise")
    with pytest.raises(ValueError, match="optimizer must be one of"):
        DiskEmbedding(N, D, state_dir=tmp_path / "x", optimizer="sgd")
    # an optimizer's own stores: resuming them as the other optimizer is refused
    e = torch.nn.Embedding(N, D, sparse=True)
    DiskSparseAdagrad(e.parameters(), state_dir=tmp_path / "o", storage=kind).close()
    with pytest.raises(ValueError, match="created with optimizer='adagrad'"):
        DiskSparseAdam(e.parameters(), state_dir=tmp_path / "o", resume=True)


# -- state dicts and checkpoints --------------------------------------------------------------
def test_state_dict_round_trip_and_checkpoint(tmp_path, kind):
    """A state dict taken at step 4 and loaded after more steps brings the optimizer back;
    a checkpoint resumes in a new optimizer; both then train as the uninterrupted run."""
    ids = batches(seed=6)
    init = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))

    def fresh(path, **kw):
        emb = torch.nn.Embedding(N, D, sparse=True, dtype=torch.float64)
        with torch.no_grad():
            emb.weight.copy_(init)
        return emb, DiskSparseAdagrad(emb.parameters(), state_dir=path, storage=kind, **KW,
                                      **kw)

    ref, ropt = fresh(tmp_path / "ref")
    train(ref, ropt, ids)
    emb, opt = fresh(tmp_path / "o")
    train(emb, opt, ids[:4])
    sd = opt.state_dict()
    w4 = emb.weight.detach().clone()
    opt.checkpoint(tmp_path / "ck", extra={"model": emb.state_dict()})
    train(emb, opt, ids[4:6], 4)  # steps that the load takes back
    opt.load_state_dict(sd)
    with torch.no_grad():
        emb.weight.copy_(w4)
    assert opt.store_for(emb.weight).count == 4
    train(emb, opt, ids[4:], 4)
    assert torch.equal(emb.weight, ref.weight)
    opt.close()
    emb2, opt2 = fresh(tmp_path / "o2")
    extra = opt2.load_checkpoint(tmp_path / "ck")
    emb2.load_state_dict(extra["model"])
    train(emb2, opt2, ids[4:], 4)
    assert torch.equal(emb2.weight, ref.weight)
    opt2.close()
    ropt.close()


def test_loads_a_torch_adagrad_state_dict(tmp_path, kind):
    """torch.optim.Adagrad's state dict (step, sum) loads into DiskSparseAdagrad, which then
    trains on as torch does; rowwise stores take the row mean of the sum."""
    ids = batches(seed=8)
    init = torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    tw = torch.nn.Embedding(N, D, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        tw.weight.copy_(init)
    topt = torch.optim.Adagrad(tw.parameters(), **KW)
    for t, i in enumerate(ids):
        if t == 4:
            sd = copy.deepcopy(topt.state_dict())  # torch hands out its live tensors
            w4 = tw.weight.detach().clone()
        topt.zero_grad()
        loss(tw(i), t).backward()
        with torch.sparse.check_sparse_tensor_invariants():  # Adagrad builds sparse tensors
            topt.step()
    emb = torch.nn.Embedding(N, D, sparse=True, dtype=torch.float64)
    opt = DiskSparseAdagrad(emb.parameters(), state_dir=tmp_path / "o", storage=kind, **KW)
    opt.load_state_dict(sd)
    with torch.no_grad():
        emb.weight.copy_(w4)
    assert opt.store_for(emb.weight).count == 4
    train(emb, opt, ids[4:], 4)
    close_weights(emb.weight.detach(), tw.weight.detach(), torch.float64)
    opt.close()
    e2 = torch.nn.Embedding(N, D, sparse=True, dtype=torch.float64)
    ropt = DiskSparseAdagrad(e2.parameters(), rowwise=True, state_dir=tmp_path / "r",
                             storage=kind, **KW)
    ropt.load_state_dict(sd)
    st = ropt.store_for(e2.weight)
    want = sd["state"][0]["sum"].double().mean(1, keepdim=True).numpy()
    np.testing.assert_allclose(accumulators(st, 0.0), want, rtol=1e-15)
    ropt.close()
    adam = torch.nn.Embedding(N, D, sparse=True)
    aopt = torch.optim.SparseAdam(adam.parameters())
    adam(torch.tensor([1])).sum().backward()
    aopt.step()
    o = DiskSparseAdagrad(adam.parameters(), state_dir=tmp_path / "x", storage=kind)
    with pytest.raises(ValueError, match="holds exp_avg"):
        o.load_state_dict(aopt.state_dict())
    o.close()


def test_torch_adagrad_refuses_our_state_dict(tmp_path):
    """torch.optim.Adagrad given a DiskSparseAdagrad state dict (no "sum": the accumulators
    are in the stores) is stopped by the guard with the reason, not a KeyError."""
    emb = torch.nn.Embedding(N, D, sparse=True)
    opt = DiskSparseAdagrad(emb.parameters(), state_dir=tmp_path / "o")
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd = opt.state_dict()
    opt.close()
    other = torch.optim.Adagrad(emb.parameters())
    other.load_state_dict(sd)
    with pytest.raises(RuntimeError, match="state without sum .*DiskSparseAdagrad state dict"):
        other.step()


def test_two_tables_commit_together(tmp_path, kind):
    """An nn.Embedding and a DiskEmbedding(optimizer="rowwise_adagrad") in one
    DiskSparseAdagrad(rowwise=True): one commit group, both at the same step after a
    checkpoint is loaded into a new optimizer."""
    a = torch.nn.Embedding(N, D, sparse=True)
    b = DiskEmbedding(N, D, state_dir=tmp_path / "b", optimizer="rowwise_adagrad",
                      storage=kind)
    opt = DiskSparseAdagrad([{"params": a.parameters()}, {"params": b.parameters(),
                                                        "lr": 0.5}],
                            rowwise=True, weight_decay=0.01, state_dir=tmp_path / "o",
                            storage=kind)
    assert opt._group is not None
    for t, i in enumerate(batches(seed=10, steps=3)):
        opt.zero_grad()
        (loss(a(i), t) + loss(b(i), t)).backward()
        opt.step()
    counts = {name: st.count for name, st in opt.stores.items()}
    assert set(counts.values()) == {3}
    assert b.store.lr == 0.5 and b.store.weight_decay == 0.01
    opt.checkpoint(tmp_path / "ck")
    opt.close()
    b.close()
    b2 = DiskEmbedding(N, D, state_dir=tmp_path / "b2", optimizer="rowwise_adagrad",
                       storage=kind)
    opt2 = DiskSparseAdagrad([{"params": a.parameters()}, {"params": b2.parameters()}],
                             rowwise=True, weight_decay=0.01, state_dir=tmp_path / "o2",
                             storage=kind)
    opt2.load_checkpoint(tmp_path / "ck")
    assert {st.count for st in opt2.stores.values()} == {3}
    assert opt2.param_groups[1]["lr"] == 0.5
    opt2.close()
    b2.close()


def test_disk_sparse_adam_refuses_an_adagrad_state_dict(tmp_path):
    emb = torch.nn.Embedding(N, D, sparse=True)
    topt = torch.optim.Adagrad(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with torch.sparse.check_sparse_tensor_invariants():
        topt.step()
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "o")
    with pytest.raises(ValueError, match="holds sum .* Load it into DiskSparseAdagrad"):
        opt.load_state_dict(topt.state_dict())
    assert opt.store_for(emb.weight).count == 0
    opt.close()


def test_a_row_view_of_m_or_v_refuses_an_adagrad_store(tmp_path):
    """The article adapter's RowView reads Adam's m and v; an Adagrad store holds neither."""
    import dsa_core
    from adapters._row_view import RowView

    st = dsa_core.create(tmp_path / "s", 10, 4, optimizer="adagrad", storage="log")
    try:
        assert RowView(lambda: st, "w")[[1, 2]].shape == (2, 4)
        for part in ("m", "v"):
            with pytest.raises(ValueError, match="accumulator"):
                RowView(lambda: st, part)[[1]]
    finally:
        dsa_core.close(st)
