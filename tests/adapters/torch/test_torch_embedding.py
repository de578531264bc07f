"""adapters.torch.DiskEmbedding (+ DiskSparseAdam) against nn.Embedding/EmbeddingBag + SparseAdam."""

from __future__ import annotations

import copy
import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from helpers import assert_same_store as same_records
from helpers import assert_close, assert_matches_sparse_adam, digest, evicted

from adapters.torch import (
    DiskEmbedding,
    DiskSparseAdam,
    DiskWeight,
    StoreLockedError,
)

nn = torch.nn
TOL = {"rtol": 1e-5, "atol": 3e-6}


def close(a, b, tol=TOL):
    assert_close(a, b, tol)


def ids_2d(gen, n, shape=(6, 8), hot=(3, 5)):
    x = torch.randint(0, n, shape, generator=gen)
    x[0, :4] = hot[0]  # duplicates
    x[1, :3] = hot[1]  # the padding row in the tests that use padding_idx=5
    return x


def compare(opt_ref, ref_weight, de, tol=TOL):
    assert_matches_sparse_adam(de.store, opt_ref, ref_weight, tol)


def test_matches_embedding_with_sparse_adam(tmp_path):
    n, d = 200, 16
    gen = torch.Generator().manual_seed(0)
    ref = nn.Embedding(n, d, sparse=True, padding_idx=5)
    de = DiskEmbedding(n, d, state_dir=tmp_path / "emb", padding_idx=5, init=ref.weight)
    w0 = ref.weight.detach().clone()
    assert isinstance(de.weight, DiskWeight) and de.weight.shape == (n, d)
    assert de.weight.untyped_storage().nbytes() == 4  # one float: no table in memory
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.03)
    o_de = DiskSparseAdam(de.parameters(), lr=0.03)  # no state_dir: the store is the module's
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, 8, 0.5)
    s_de = torch.optim.lr_scheduler.StepLR(o_de, 8, 0.5)
    target = torch.randn(d, generator=gen)
    seen = torch.zeros(n, dtype=torch.bool)
    for _ in range(30):
        x = ids_2d(gen, n)
        seen[x] = True
        de.prefetch(x)  # a page-cache hint only: results must not change
        outs = []
        for emb, opt, sch in ((ref, o_ref, s_ref), (de, o_de, s_de)):
            out = emb(x)
            outs.append(out.detach())
            ((out - target) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
            sch.step()
        assert outs[1].shape == (6, 8, d)
        close(outs[1], outs[0])
    compare(o_ref, ref.weight, de)
    st = de.store
    assert np.array_equal(st.weights[5], np.zeros(d, np.float32))          # padding row
    assert not st.exp_avg[5].any() and not st.exp_avg_sq[5].any()           # never stepped
    assert np.array_equal(st.weights[~seen.numpy()], w0[~seen].numpy())     # lazy
    o_de.close()
    de.close()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_modes_match_embedding_bag(tmp_path, mode):
    n, d = 150, 12
    gen = torch.Generator().manual_seed(1)
    ref = nn.EmbeddingBag(n, d, mode=mode, sparse=True, padding_idx=5)
    de = DiskEmbedding(n, d, state_dir=tmp_path, mode=mode, padding_idx=5, init=ref.weight)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.02)
    o_de = DiskSparseAdam(de.parameters(), lr=0.02)
    for t in range(25):
        if t % 2:  # 1-D ids with offsets (an empty bag), per-sample weights for "sum"
            x = ids_2d(gen, n, (4, 10)).reshape(-1)
            x[7:10] = 5
            args = (x, torch.tensor([0, 7, 7, 22]))
            kw = {"per_sample_weights": torch.rand(40, generator=gen)} if mode == "sum" else {}
        else:      # fixed-size bags as a 2-D input
            args, kw = (ids_2d(gen, n, (5, 6)),), {}
        for emb, opt in ((ref, o_ref), (de, o_de)):
            out = emb(*args, **kw)
            (out.tanh().sum() + (out ** 2).sum()).backward()
            opt.step()
            opt.zero_grad()
    compare(o_ref, ref.weight, de)
    o_de.close()
    de.close()


def test_gradient_holds_the_batch_rows_only(tmp_path):
    n, d = 1000, 8
    ref = nn.Embedding(n, d, sparse=True, padding_idx=5)
    de = DiskEmbedding(n, d, state_dir=tmp_path, padding_idx=5, init=ref.weight)
    x = torch.tensor([[7, 3, 5, 3], [999, 5, 7, 7]])
    for _ in range(2):  # gradient accumulation over two backward passes
        for emb in (ref, de):
            (emb(x) * torch.arange(d)).sum().backward()
    g = de.weight.grad
    assert g.layout == torch.sparse_coo and g.shape == (n, d)
    gc = g.coalesce()
    assert gc.indices()[0].tolist() == [3, 7, 999]  # sorted, unique, padding row left out
    close(gc.values(), ref.weight.grad.coalesce().values(), {"rtol": 0, "atol": 0})
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
    o_de = DiskSparseAdam(de.parameters(), lr=0.1)
    o_ref.step()
    o_de.step()
    compare(o_ref, ref.weight, de)
    assert torch.equal(de.weight_rows([3, 999]), ref.weight.detach()[[3, 999]])
    o_de.close()
    de.close()


def test_mixed_model_with_a_dense_optimizer(tmp_path):
    """DiskEmbedding -> Linear: DiskSparseAdam for the table, torch Adam for the rest."""
    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(0)
    ref = nn.ModuleDict({"emb": nn.Embedding(80, 10, sparse=True), "lin": nn.Linear(10, 1)})
    dsk = nn.ModuleDict({"emb": DiskEmbedding(80, 10, state_dir=tmp_path,
                                              init=ref["emb"].weight),
                         "lin": copy.deepcopy(ref["lin"])})
    opts = {}
    for name, m, cls in (("ref", ref, torch.optim.SparseAdam), ("dsk", dsk, DiskSparseAdam)):
        opts[name] = [cls(m["emb"].parameters(), lr=0.01),
                      torch.optim.Adam(m["lin"].parameters(), lr=0.01)]
    for _ in range(15):
        x = torch.randint(0, 80, (16,), generator=gen)
        y = torch.randn(16, 1, generator=gen)
        for name, m in (("ref", ref), ("dsk", dsk)):
            loss = ((m["lin"](m["emb"](x)) - y) ** 2).mean()
            loss.backward()
            for o in opts[name]:
                o.step()
                o.zero_grad()
    close(dsk["lin"].weight.detach(), ref["lin"].weight.detach())
    compare(opts["ref"][0], ref["emb"].weight, dsk["emb"])
    opts["dsk"][0].close()
    dsk["emb"].close()


def test_poincare_embedding_matches_geoopt(tmp_path):
    geoopt = pytest.importorskip("geoopt")
    n, d = 120, 10
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, d, generator=gen)
    init = x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=gen) * 0.8
    p_ref = geoopt.ManifoldParameter(init.clone(), manifold=geoopt.PoincareBall(c=1.0))
    o_ref = geoopt.optim.SparseRiemannianAdam([p_ref], lr=0.05)
    de = DiskEmbedding(n, d, state_dir=tmp_path, curvature=1.0, init=init)
    o_de = DiskSparseAdam(de.parameters(), lr=0.05)
    target = torch.randn(d, generator=gen) * 0.3
    for _ in range(30):
        ids = torch.randint(0, n, (24,), generator=gen)
        ((nn.functional.embedding(ids, p_ref, sparse=True) - target) ** 2).sum().backward()
        ((de(ids) - target) ** 2).sum().backward()
        for o in (o_ref, o_de):
            o.step()
            o.zero_grad()
    st = de.store
    close(st.weights, p_ref.detach(), {"rtol": 0, "atol": 2e-5})
    close(st.exp_avg, o_ref.state[p_ref]["exp_avg"], {"rtol": 0, "atol": 5e-7})
    v = o_ref.state[p_ref]["exp_avg_sq"].numpy()
    close(np.broadcast_to(st.exp_avg_sq, v.shape), v, {"rtol": 1e-4, "atol": 4e-6})
    o_de.close()
    de.close()


def test_reopen_resumes_bit_exact(tmp_path, monkeypatch):
    # a large table's state dicts hold no rows (a small one's hold them, as nn.Embedding's):
    # every table counts as large here
    monkeypatch.setattr(DiskWeight, "read_limit", 0)

    def run(de, opt, steps, t0):
        for t in range(t0, t0 + steps):
            x = ids_2d(torch.Generator().manual_seed(t), 60, (4, 5))
            (de(x) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    init = torch.randn(60, 8)
    ref = DiskEmbedding(60, 8, state_dir=tmp_path / "ref", init=init)
    o_ref = DiskSparseAdam(ref.parameters(), lr=0.05)
    run(ref, o_ref, 10, 0)

    de = DiskEmbedding(60, 8, state_dir=tmp_path / "run", init=init)
    opt = DiskSparseAdam(de.parameters(), lr=0.05)
    run(de, opt, 4, 0)
    buf = io.BytesIO()
    torch.save({"model": de.state_dict(), "opt": opt.state_dict()}, buf)
    assert buf.tell() < 4096
    opt.close()
    de.close()
    with pytest.raises(RuntimeError, match="closed"):
        de(torch.tensor([1]))

    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    assert list(ck["model"]) == ["_extra_state"] and ck["model"]["_extra_state"]["count"] == 4
    de = DiskEmbedding(60, 8, state_dir=tmp_path / "run", init="zeros",  # init unused
                       resume=True)
    de.load_state_dict(ck["model"])
    opt = DiskSparseAdam(de.parameters(), lr=0.05)
    opt.load_state_dict(ck["opt"])
    assert de.store.count == 4
    run(de, opt, 6, 4)
    for a, b in ((de.store.weights, ref.store.weights), (de.store.exp_avg, ref.store.exp_avg),
                 (de.store.exp_avg_sq, ref.store.exp_avg_sq)):
        assert np.array_equal(a, b)
    for o, m in ((opt, de), (o_ref, ref)):
        o.close()
        m.close()


def test_load_nn_embedding_state_dict_and_wrong_shapes(tmp_path):
    ref = nn.Embedding(30, 4)
    de = DiskEmbedding(30, 4, state_dir=tmp_path / "a", init="zeros")
    de.load_state_dict(ref.state_dict())
    assert torch.equal(de.weight_rows(torch.arange(30)), ref.weight.detach())
    with pytest.raises(RuntimeError, match="size mismatch"):
        de.load_state_dict(nn.Embedding(31, 4).state_dict())
    other = DiskEmbedding(30, 5, state_dir=tmp_path / "b")
    with pytest.raises(RuntimeError, match="30 x 5 float32"):
        de.load_state_dict(other.state_dict())
    de.close()
    other.close()


def test_locks_and_mismatched_store(tmp_path):
    de = DiskEmbedding(40, 4, state_dir=tmp_path)
    de.flush()
    before = digest(tmp_path)
    with pytest.raises(StoreLockedError):
        DiskEmbedding(40, 4, state_dir=tmp_path, resume=True)
    opt = DiskSparseAdam(de.parameters())
    with pytest.raises(StoreLockedError, match="already stepped by another DiskSparseAdam"):
        DiskSparseAdam(de.parameters())
    opt.close()
    DiskSparseAdam(de.parameters()).close()  # free again once the first one is closed
    de.close()
    assert digest(tmp_path) == before
    for kw in ({"num_embeddings": 41, "embedding_dim": 4},
               {"num_embeddings": 40, "embedding_dim": 4, "curvature": 1.0},
               {"num_embeddings": 40, "embedding_dim": 4, "dtype": torch.float64}):
        with pytest.raises(ValueError, match="existing store"):
            DiskEmbedding(**kw, state_dir=tmp_path)
    assert digest(tmp_path) == before


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="'max' bags are not supported"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "a", mode="max")
    with pytest.raises(ValueError, match="Padding_idx must be within num_embeddings"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "a", padding_idx=10)
    with pytest.raises(TypeError, match="float16"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "a", dtype=torch.float16)
    assert not (tmp_path / "a").exists()
    de = DiskEmbedding(10, 4, state_dir=tmp_path / "b", padding_idx=-1)
    assert de.padding_idx == 9 and not de.weight_rows([9]).any()
    with pytest.raises(TypeError, match="integer ids"):
        de(torch.tensor([1.0]))
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        de(torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="bag modes"):
        de(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.warns(UserWarning, match="keeps its table in float32"):
        de.double()  # the store keeps its dtype; the outputs follow the model (below)
    assert de.to("cpu") is de and de.float() is de
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(de.weight)
    out = de(torch.zeros((0,), dtype=torch.long))
    assert out.shape == (0, 4)
    de.close()
    de.close()  # safe twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_embedding(tmp_path):
    n, d = 3000, 32
    gen = torch.Generator().manual_seed(4)
    ref = nn.Embedding(n, d, sparse=True, padding_idx=5).cuda()
    de = DiskEmbedding(n, d, state_dir=tmp_path, padding_idx=5,
                       init=ref.weight.detach().cpu()).cuda()
    assert de.weight.is_cuda and de.weight.untyped_storage().nbytes() == 4
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    o_de = DiskSparseAdam(de.parameters(), lr=0.01)
    for _ in range(20):
        x = ids_2d(gen, n, (32, 16)).cuda()
        for emb, opt in ((ref, o_ref), (de, o_de)):
            out = emb(x)
            assert out.is_cuda
            ((out - 0.2) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    st = de.store
    ref_state = o_ref.state[ref.weight]
    close(st.weights, ref.weight.detach().cpu())
    close(st.exp_avg, ref_state["exp_avg"].cpu())
    close(st.exp_avg_sq, ref_state["exp_avg_sq"].cpu())
    o_de.close()
    de.close()


# -- issue 18: reopening must be asked for, init="zeros", nonfinite, stale States ------------
def test_rerun_on_an_existing_store_is_refused_unless_asked(tmp_path):
    path = tmp_path / "emb"
    de = DiskEmbedding(40, 4, state_dir=path, resume=True, seed=0)  # nothing there: creates
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    for _ in range(3):
        de(torch.tensor([1, 2, 2])).sum().backward()
        opt.step()
        opt.zero_grad()
    rows = de.weight_rows(torch.arange(40))
    opt.close()
    de.close()
    before = digest(path)
    with pytest.raises(FileExistsError, match=r"DiskEmbedding\(40, 4\): state_dir .* already "
                                              r"holds a store \(40 x 4 float32, trained 3 "
                                              r"steps\).*nothing was changed\. Pass "
                                              r"resume=True .* or overwrite=True"):
        DiskEmbedding(40, 4, state_dir=path)
    with pytest.raises(ValueError, match="resume=True and overwrite=True contradict"):
        DiskEmbedding(40, 4, state_dir=path, resume=True, overwrite=True)
    with pytest.raises(ValueError, match=r"existing store .* holds a 40 x 4 float32 table.*"
                                         r"overwrite=True to replace it"):
        DiskEmbedding(41, 4, state_dir=path)  # a mismatch is named even without resume
    assert digest(path) == before
    de = DiskEmbedding(40, 4, state_dir=path, resume=True, init="zeros")  # init unused
    assert de.store.count == 3 and torch.equal(de.weight_rows(torch.arange(40)), rows)
    de.close()
    de = DiskEmbedding(40, 4, state_dir=path, overwrite=True, init="zeros")
    st = de.store
    assert st.count == 0 and not st.weights.any() and not st.exp_avg.any()
    de.close()


def test_init_zeros_is_passed_through_to_dsa_core(tmp_path):
    de = DiskEmbedding(30, 4, state_dir=tmp_path / "de", init="zeros", padding_idx=2)
    core = dsa_core.create(tmp_path / "core", 30, 4, init="zeros")
    assert np.array_equal(de.store.weights, core.weights) and not core.weights.any()
    de.close()
    dsa_core.close(core)
    with pytest.raises(ValueError, match="init must be"):
        DiskEmbedding(30, 4, state_dir=tmp_path / "bad", init="ones")
    assert not (tmp_path / "bad" / "rows.dsa").exists()


def test_nonfinite_is_recorded_and_kept_on_resume(tmp_path):
    path = tmp_path / "de"
    de = DiskEmbedding(20, 4, state_dir=path, init="uniform", seed=1, nonfinite="skip_row")
    w0 = de.weight_rows(torch.arange(20))
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    out = de(torch.tensor([3, 4]))
    (out * torch.tensor([[1.0], [float("nan")]])).sum().backward()  # row 4: NaN gradient
    opt.step()
    st = de.store
    assert torch.equal(de.weight_rows([4]), w0[[4]]) and not st.exp_avg[4].any()
    assert not torch.equal(de.weight_rows([3]), w0[[3]]) and st.count == 1
    opt.close()
    with pytest.raises(ValueError, match=r"DiskEmbedding whose store handles non-finite "
                                         r"gradients with nonfinite='skip_row', but this "
                                         r"optimizer asks for nonfinite='raise'"):
        DiskSparseAdam(de.parameters(), nonfinite="raise")
    de.close()
    assert dsa_core.open(path, mode="r").nonfinite == "skip_row"
    de = DiskEmbedding(20, 4, state_dir=path, resume=True)  # None: the store's own
    assert de.store.nonfinite == "skip_row"
    de.close()
    de = DiskEmbedding(20, 4, state_dir=path, resume=True, nonfinite="raise")
    opt = DiskSparseAdam(de.parameters(), lr=0.1, nonfinite="raise")  # may repeat it
    (de(torch.tensor([3])) * float("inf")).sum().backward()
    with pytest.raises(FloatingPointError, match="nothing was written"):
        opt.step()
    assert de.store.count == 1
    opt.close()
    de.close()
    assert dsa_core.open(path, mode="r").nonfinite == "raise"
    with pytest.raises(ValueError, match=r"^DiskEmbedding\(20, 4\): nonfinite must be one of"):
        DiskEmbedding(20, 4, state_dir=tmp_path / "x", nonfinite="nan")
    assert not (tmp_path / "x").exists()


def test_a_state_read_before_a_step_is_stale(tmp_path):
    de = DiskEmbedding(20, 4, state_dir=tmp_path / "de", seed=0)
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    old = de.store
    de(torch.tensor([1, 2])).sum().backward()
    opt.step()
    with pytest.raises(dsa_core.StaleStateError, match="outdated"):
        dsa_core.checkpoint(old, tmp_path / "ck")
    with pytest.raises(dsa_core.StaleStateError):
        dsa_core.step(old, [1], np.ones((1, 4), np.float32))
    assert not (tmp_path / "ck").exists()
    de.checkpoint(tmp_path / "ck")  # the module checkpoints its current State
    assert dsa_core.open(tmp_path / "ck", mode="r").count == 1
    opt.close()
    de.close()


@pytest.mark.parametrize("keep", [3, 0])
def test_module_state_dict_of_an_earlier_step(tmp_path, keep):
    """Restored from its snapshot (the default), or, with keep_snapshots=0 (no snapshot),
    refused with nothing changed."""
    model = nn.ModuleDict({"emb": DiskEmbedding(20, 4, state_dir=tmp_path / "de", seed=0,
                                                keep_snapshots=keep),
                           "lin": nn.Linear(4, 1)})
    opt = DiskSparseAdam(model["emb"].parameters(), lr=0.1)

    def step():
        model["lin"](model["emb"](torch.tensor([1, 2]))).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    sd = model.state_dict()
    at1 = dsa_core.read_records(model["emb"].store, np.arange(20))
    step()
    step()
    if keep:
        model.load_state_dict(sd)  # back to step 1 (the in-place store's snapshot)
        assert model["emb"].store.count == 1
        np.testing.assert_array_equal(dsa_core.read_records(model["emb"].store,
                                                            np.arange(20)), at1)
        opt.close()
        model["emb"].close()
        return
    before = digest(tmp_path / "de")
    with pytest.raises(RuntimeError, match=r"taken at step 1, but its store .* is at step 3.*"
                                           r"Nothing was changed.*opt\.checkpoint\(dest\)"):
        model.load_state_dict(sd)
    assert digest(tmp_path / "de") == before and model["emb"].store.count == 3
    model.load_state_dict(model.state_dict())  # the state as it is loads
    # through a checkpoint: load_checkpoint first, then the model's state dict matches
    opt.checkpoint(tmp_path / "ck", extra={"model": model.state_dict()})
    step()
    extra = opt.load_checkpoint(tmp_path / "ck")
    model.load_state_dict(extra["model"])
    assert model["emb"].store.count == 3
    opt.close()
    model["emb"].close()


# -- per-row options (docs/algorithms.md §7.1, §7.2) ----------------------------------------
def test_row_options_resume_state_dict_and_refusals(tmp_path):
    """``per_row_step`` / ``decay_missed_steps`` are the module's (it owns the store): fixed
    at creation, recorded in its state dict, refused on resume or load when they differ
    (both values named, nothing written); the decay itself is the optimizer's."""
    def run(de, opt, t0, t1):
        for t in range(t0, t1):
            x = ids_2d(torch.Generator().manual_seed(t), 60, (3, 4))
            (de(x) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()

    rows = {"per_row_step": True, "decay_missed_steps": True}
    hp = {"lr": 0.05, "weight_decay": 0.2, "decoupled_weight_decay": True}
    torch.manual_seed(0)
    init = torch.randn(60, 8)
    ref = DiskEmbedding(60, 8, state_dir=tmp_path / "ref", init=init, **rows)
    o_ref = DiskSparseAdam(ref.parameters(), **hp)
    run(ref, o_ref, 0, 8)

    de = DiskEmbedding(60, 8, state_dir=tmp_path / "run", init=init, **rows)
    opt = DiskSparseAdam(de.parameters(), **hp)
    run(de, opt, 0, 3)
    sd = de.state_dict()
    osd = opt.state_dict()
    # a small table: nn.Embedding's keys; the manifest rides in the state dict's metadata
    extra = sd._metadata[""]["dsa_embedding"]
    assert list(sd) == ["weight"] and extra["per_row_step"] and extra["decay_missed_steps"]
    opt.close()
    de.close()
    before = digest(tmp_path / "run")
    for other in ({"per_row_step": False}, {"decay_missed_steps": False}):
        (name, value), = other.items()
        with pytest.raises(ValueError, match=rf"created with {name}=True, but {name}=False "
                                             "was asked for"):
            DiskEmbedding(60, 8, state_dir=tmp_path / "run", resume=True, **{**rows, **other})
    assert digest(tmp_path / "run") == before
    # a module without the options refuses the state dict of one with them
    plain = DiskEmbedding(60, 8, state_dir=tmp_path / "plain", init=init)
    with pytest.raises(RuntimeError, match=r"was created with per_row_step=True, "
                                           r"decay_missed_steps=True, this one with "
                                           r"per_row_step=False, decay_missed_steps=False"):
        plain.load_state_dict(sd)
    plain.close()
    # the same options resume bit for bit
    de = DiskEmbedding(60, 8, state_dir=tmp_path / "run", resume=True, **rows)
    de.load_state_dict(sd)
    # the state dict brings lr and weight_decay; the group must allow the catch-up already
    opt = DiskSparseAdam(de.parameters(), lr=0.5, decoupled_weight_decay=True)
    opt.load_state_dict(osd)
    assert opt.param_groups[0]["weight_decay"] == 0.2
    run(de, opt, 3, 8)
    for name in ("weights", "exp_avg", "exp_avg_sq", "row_steps", "last_steps"):
        assert np.array_equal(getattr(de.store, name), getattr(ref.store, name)), name
    # an optimizer with L2 decay cannot step a store that catches up decoupled decay
    opt.close()
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        DiskSparseAdam(de.parameters(), lr=0.05, weight_decay=0.2)
    de.close()
    o_ref.close()
    ref.close()
    # bad values, before anything is written
    with pytest.raises(TypeError, match="per_row_step must be a bool"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "bad", per_row_step="yes")
    assert not (tmp_path / "bad").exists()


def test_row_options_survive_a_checkpoint(tmp_path):
    de = DiskEmbedding(30, 4, state_dir=tmp_path / "e", seed=1, per_row_step=True)
    opt = DiskSparseAdam(de.parameters(), lr=0.1)
    for ids in ([1, 2], [2, 3], [2]):
        de(torch.tensor(ids)).sum().backward()
        opt.step()
        opt.zero_grad()
    de.checkpoint(tmp_path / "ck")
    steps = de.store.row_steps.copy()
    assert steps[[1, 2, 3, 4]].tolist() == [1, 3, 1, 0]
    de(torch.tensor([4])).sum().backward()
    opt.step()
    de.load_checkpoint(tmp_path / "ck")
    assert np.array_equal(de.store.row_steps, steps) and de.store.count == 3
    opt.close()
    de.close()
    other = DiskEmbedding(30, 4, state_dir=tmp_path / "o", seed=1)  # no per-row steps
    with pytest.raises(ValueError, match="layout"):
        other.load_checkpoint(tmp_path / "ck")
    other.close()


# -- both store kinds ------------------------------------------------------------------------------
# (was test_torch_log.py) Every log store here gets a region far smaller than its table, so
# rows are evicted, sealed into segments and read back during the run. The parity tests train
# an in-place and a log store side by side and ask for the same bits: they build both kinds
# themselves; the others take the ``kind`` fixture.
N, D = 300, 8
SLOTS = 60  # region slots of each log store: a batch has at most 48 distinct rows


def small_memory(num_rows=N, dim=D, **kw) -> int:
    """A budget of SLOTS record slots for a store of this shape (far fewer than N rows)."""
    probe = dsa_core.create(kw.pop("_path"), num_rows, dim, storage="log",
                            memory="1MiB", **kw)
    try:
        return dsa_core.region_memory(probe.layout, SLOTS)
    finally:
        dsa_core.close(probe)


@pytest.fixture
def mem(tmp_path):
    """The region budget of a weights-and-moments store of N x D float32 rows."""
    return small_memory(_path=tmp_path / "probe_w")


def batches(steps, seed=0, n=N):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, n, (6, 8), generator=gen)
        x[0, :4] = 3  # duplicates
        x[1, :3] = 5  # the padding row
        yield x


def all_rows(state):
    idx = np.arange(state.num_rows)
    return dsa_core.gather(state, idx), dsa_core.read_records(state, idx)


def assert_same_store(a, b):
    """Same count and records bit for bit (helpers), and the same weights through gather."""
    same_records(a, b)
    np.testing.assert_array_equal(all_rows(a)[0], all_rows(b)[0])


def train(emb, opt, xs):
    for x in xs:
        emb(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("opts", [
    {},
    {"decay_missed_steps": True, "wd": 0.1},
    {"per_row_step": True, "mode": "sum"},
    {"curvature": 1.0},
    {"first_moment": "bfloat16"},
    {"first_moment": "bfloat16", "second_moment": "rowwise", "per_row_step": True},
    {"dtype": torch.float64, "decay_missed_steps": True, "wd": 0.1},
])
def test_disk_embedding_log_matches_inplace(tmp_path, mem, opts):
    opts = dict(opts)
    wd = opts.pop("wd", 0.0)
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(1)) * 0.1
    if opts.get("dtype") == torch.float64:
        init = init.double()
        mem = small_memory(_path=tmp_path / "probe64", dtype="float64", **{
            k: v for k, v in opts.items() if k == "decay_missed_steps"},
            decoupled_weight_decay=True)
    embs, opts_ = [], []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = DiskEmbedding(N, D, state_dir=tmp_path / kind, init=init, padding_idx=5,
                          **opts, **kw)
        o = DiskSparseAdam(e.parameters(), lr=0.05, weight_decay=wd,
                           decoupled_weight_decay=bool(opts.get("decay_missed_steps")))
        train(e, o, batches(15))
        embs.append(e)
        opts_.append(o)
    a, b = embs[0].store, embs[1].store
    assert b.storage == "log" and a.storage == "inplace"
    assert evicted(b)
    assert_same_store(a, b)
    np.testing.assert_array_equal(all_rows(b)[0][5], 0)  # padding row zeroed, never updated
    for o in opts_:
        o.close()
    for e in embs:
        e.close()


def test_optimizer_own_log_stores_match_inplace(tmp_path):
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(2))
    mem = small_memory(_path=tmp_path / "probe", weights=False)
    runs = []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = nn.Embedding(N, D, sparse=True, padding_idx=5)
        with torch.no_grad():
            e.weight.copy_(init)
        o = DiskSparseAdam(e.parameters(), lr=0.05, state_dir=tmp_path / kind, **kw)
        train(e, o, batches(15, seed=4))
        runs.append((e, o))
    (ea, oa), (eb, ob) = runs
    assert torch.equal(ea.weight, eb.weight)
    sa, sb = oa.store_for(ea.weight), ob.store_for(eb.weight)
    assert sb.storage == "log" and evicted(sb)
    ra = dsa_core.read_records(sa, np.arange(N))
    rb = dsa_core.read_records(sb, np.arange(N))
    np.testing.assert_array_equal(ra.view(np.uint32), rb.view(np.uint32))
    oa.close()
    ob.close()


def test_state_dicts_on_both_kinds(tmp_path, mem, kind):
    """keep_snapshots=0 state dicts describe, default ones are snapshots; an nn.Embedding state
    dict's weights land in the store (m and v kept). The same on both kinds."""
    kw = {"storage": "log", "memory": mem} if kind == "log" else {"storage": "inplace"}
    # keep_snapshots=0: a state dict is a description (on either kind)
    e0 = DiskEmbedding(N, D, state_dir=tmp_path / "e0", seed=0, **kw, keep_snapshots=0)
    assert e0.store.storage == kind
    o0 = DiskSparseAdam(e0.parameters(), lr=0.05, keep_snapshots=0)
    train(e0, o0, batches(4))
    sd0 = {"model": e0.state_dict(), "opt": o0.state_dict()}
    assert "state_snapshot" not in sd0["model"]["_extra_state"]
    assert not (tmp_path / ".dsa-snapshots").exists()
    e0.load_state_dict(sd0["model"])  # same step: accepted, nothing changes
    o0.load_state_dict(sd0["opt"])
    train(e0, o0, batches(1, seed=9))
    with pytest.raises(RuntimeError, match="taken at step 4"):
        e0.load_state_dict(sd0["model"])  # a description of step 4 is no snapshot
    with pytest.raises(ValueError, match="taken at step 4"):
        o0.load_state_dict(sd0["opt"])
    o0.close()
    e0.close()
    # by default a state dict is a snapshot (test_torch_snapshots.py)
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", seed=0, **kw)
    opt = DiskSparseAdam(emb.parameters(), lr=0.05)
    train(emb, opt, batches(4))
    f = tmp_path / "sd.pt"
    torch.save({"model": emb.state_dict(), "opt": opt.state_dict()}, f)
    sd = torch.load(f, weights_only=True)
    at4 = dsa_core.read_records(emb.store, np.arange(N))
    train(emb, opt, batches(1, seed=9))
    emb.load_state_dict(sd["model"])  # back to step 4
    assert emb.store.count == 4
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)), at4)
    # An nn.Embedding state dict: its weights are copied into the store, m and v kept
    before = dsa_core.read_records(emb.store, np.arange(N))
    w = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    emb.load_state_dict({"weight": w})
    after = dsa_core.read_records(emb.store, np.arange(N))
    np.testing.assert_array_equal(dsa_core.gather(emb.store, np.arange(N)), w.numpy())
    lay = emb.store.layout
    np.testing.assert_array_equal(np.delete(after, np.s_[lay["w"]:lay["w"] + D], axis=1),
                                  np.delete(before, np.s_[lay["w"]:lay["w"] + D], axis=1))
    opt.close()
    emb.close()


@pytest.mark.parametrize("rows", [{}, {"decay_missed_steps": True}])
def test_sparse_adam_state_dict_import_into_log(tmp_path, rows):
    """A torch.optim.SparseAdam state dict (exp_avg, exp_avg_sq, step) into own stores."""
    ref = nn.Embedding(N, D, sparse=True)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    train(ref, ropt, batches(3))
    sd = ropt.state_dict()
    mem = small_memory(_path=tmp_path / "probe", weights=False, **rows,
                       decoupled_weight_decay=bool(rows))
    stores = []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = nn.Embedding(N, D, sparse=True)
        o = DiskSparseAdam(e.parameters(), lr=0.05, state_dir=tmp_path / kind,
                           decoupled_weight_decay=bool(rows), **rows, **kw)
        o.load_state_dict(sd)
        stores.append(o)
    sa = stores[0].store_for(stores[0].param_groups[0]["params"][0])
    sb = stores[1].store_for(stores[1].param_groups[0]["params"][0])
    assert sb.count == sa.count == 3
    np.testing.assert_array_equal(dsa_core.read_records(sa, np.arange(N)).view(np.uint32),
                                  dsa_core.read_records(sb, np.arange(N)).view(np.uint32))
    m = ropt.state[ref.weight]["exp_avg"].numpy()
    v = ropt.state[ref.weight]["exp_avg_sq"].numpy()
    lay, rec = sb.layout, dsa_core.read_records(sb, np.arange(N))
    np.testing.assert_array_equal(rec[:, lay["m"]:lay["m"] + D], m)
    np.testing.assert_array_equal(rec[:, lay["v"]:lay["v"] + D], v)
    if rows:  # SparseAdam decayed nothing: every row's last decay is the imported step
        np.testing.assert_array_equal(rec.view(np.int32)[:, lay["last_step"]], 3)
    for o in stores:
        o.close()


def test_checkpoint_and_resume_on_log_stores(tmp_path, mem):
    """opt.checkpoint / load_checkpoint and resume=True on log stores, against in-place."""
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(5)) * 0.1
    own = small_memory(_path=tmp_path / "probe", weights=False)

    def build(root, kind, resume=False):
        kw = {} if kind == "inplace" else {"storage": "log", "memory": mem}
        okw = {} if kind == "inplace" else {"storage": "log", "memory": own}
        emb = DiskEmbedding(N, D, state_dir=root / "emb", init=init, resume=resume, **kw)
        lin = nn.Embedding(N, D, sparse=True)
        with torch.no_grad():
            lin.weight.copy_(init)
        opt = DiskSparseAdam([emb.weight, lin.weight], lr=0.05, state_dir=root / "opt",
                             resume=resume, **okw)
        return emb, lin, opt

    def run(emb, lin, opt, xs):
        for x in xs:
            (emb(x).pow(2).sum() + lin(x).pow(3).sum()).backward()
            opt.step()
            opt.zero_grad()

    # the reference: 12 uninterrupted steps in place
    ref = build(tmp_path / "ref", "inplace")
    run(*ref, batches(12))
    # the log run: 5 steps, checkpoint, 3 other steps, back to the checkpoint, 3 steps,
    # restart with resume=True, 4 steps: the same 12 steps as the reference
    emb, lin, opt = build(tmp_path / "log2", "log")
    xs = list(batches(12))
    run(emb, lin, opt, xs[:5])
    opt.checkpoint(tmp_path / "ck", extra={"lin": lin.state_dict()})
    run(emb, lin, opt, batches(3, seed=11))
    extra = opt.load_checkpoint(tmp_path / "ck")
    lin.load_state_dict(extra["lin"])
    assert emb.store.count == 5
    run(emb, lin, opt, xs[5:8])
    # and a restart with resume=True
    lin_w = lin.state_dict()
    opt.close()
    emb.close()
    emb, lin, opt = build(tmp_path / "log2", "log", resume=True)
    lin.load_state_dict(lin_w)
    assert emb.store.count == 8 and emb.store.storage == "log"
    run(emb, lin, opt, xs[8:])
    assert torch.equal(lin.weight, ref[1].weight)
    assert_same_store(ref[0].store, emb.store)
    for p_ref, p in zip(ref[2].param_groups[0]["params"], opt.param_groups[0]["params"]):
        sa, sb = ref[2].store_for(p_ref), opt.store_for(p)
        assert sb.storage == "log"
        np.testing.assert_array_equal(
            dsa_core.read_records(sa, np.arange(N)).view(np.uint32),
            dsa_core.read_records(sb, np.arange(N)).view(np.uint32))
    # emb.checkpoint / load_checkpoint of the log table alone
    emb.checkpoint(tmp_path / "eck")
    snap = dsa_core.read_records(emb.store, np.arange(N))
    run(emb, lin, opt, batches(2, seed=12))
    emb.load_checkpoint(tmp_path / "eck")
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)), snap)
    for o in (ref[2], opt):
        o.close()
    for e in (ref[0], emb):
        e.close()


def test_resume_of_the_other_kind_is_refused(tmp_path, mem):
    DiskEmbedding(N, D, state_dir=tmp_path / "a", seed=0).close()
    with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
        DiskEmbedding(N, D, state_dir=tmp_path / "a", resume=True, storage="log")
    DiskEmbedding(N, D, state_dir=tmp_path / "b", seed=0, storage="log", memory=mem).close()
    with pytest.raises(ValueError, match="storage='log' store, but storage='inplace'"):
        DiskEmbedding(N, D, state_dir=tmp_path / "b", resume=True, storage="inplace")
    e = DiskEmbedding(N, D, state_dir=tmp_path / "b", resume=True, storage="log", memory=mem)
    assert e.store.storage == "log"
    e.close()
    for name, kind in (("a", "inplace"), ("b", "log")):  # "auto" (the default): either kind
        e = DiskEmbedding(N, D, state_dir=tmp_path / name, resume=True)
        assert e.store.storage == kind
        e.close()
    lin = nn.Embedding(N, D, sparse=True)
    DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "o").close()
    with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
        DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "o", resume=True,
                       storage="log")


@pytest.mark.parametrize("kw, match", [
    ({"storage": "inplace", "memory": "1MiB"}, "memory= is for storage='log'"),
    ({"storage": "lsm"}, "storage must be one of"),
    ({"storage": "log", "access": "ram"}, "access='ram' is for in-place stores"),
    ({"storage": "log", "memory": "lots"}, "memory must be a number of bytes"),
])
def test_bad_storage_options(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        DiskEmbedding(N, D, state_dir=tmp_path / "e", **kw)
    with pytest.raises(ValueError, match=match):
        DiskSparseAdam(nn.Embedding(N, D, sparse=True).parameters(),
                       state_dir=tmp_path / "o", **kw)
    assert not (tmp_path / "e").exists()
    assert not any((tmp_path / "o").glob("group*"))


def test_a_step_in_doubt_stands_and_training_goes_on(tmp_path):
    """A DiskEmbedding resumed on an in-place store made with durability='step': the
    directory's sync after a step's manifest was renamed in fails (dsa_core.InDoubtError).
    The step stands, the optimizer holds the store at it, and the next steps go on to the
    records of a run that met no fault."""
    from helpers import assert_same_bits, os_fault, records

    ends = []
    for fault in (False, True):
        d = tmp_path / f"fault-{fault}"
        dsa_core.close(dsa_core.create(d, 50, 4, durability="step", init="normal", seed=3))
        emb = DiskEmbedding(50, 4, state_dir=d, resume=True)
        opt = DiskSparseAdam(emb.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(0)
        for k in range(6):
            ids = torch.randint(0, 50, (16,), generator=gen)
            opt.zero_grad()
            emb(ids).pow(2).sum().backward()
            if fault and k == 3:
                with os_fault("fsync_path", 1) as f, \
                        pytest.raises(dsa_core.InDoubtError, match="The step was taken"):
                    opt.step()
                assert f.failed and emb.store.count == 4 and emb.store.current
                continue
            opt.step()
        assert emb.store.count == 6
        ends.append(records(emb.store))
        emb.close()
    assert_same_bits(ends[0], ends[1])
