"""adapters.torch.DiskSparseAdam against torch.optim.SparseAdam and geoopt, in real loops.

Tolerances are the spec's (ALGORITHMS.md §5): Euclidean f32 rtol=1e-5 atol=3e-6, f64
rtol=1e-12 atol=1e-13; ball f32 (d >= 10) P atol=2e-5, M atol=5e-7, V rtol=1e-4 atol=4e-6.
"""

from __future__ import annotations

import copy
import io
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from helpers import assert_close as close
from helpers import assert_matches_sparse_adam, digest
from adapters.torch import MANIFEST_KEY, DiskSparseAdam, DiskWeight, StoreLockedError

F = torch.nn.functional
TOL = {torch.float32: {"rtol": 1e-5, "atol": 3e-6},
       torch.float64: {"rtol": 1e-12, "atol": 1e-13}}
REPO = Path(__file__).resolve().parents[3]


def batch(gen, n, b=48, dup=3):
    """Ids with heavy duplicates: row ``dup`` five times, then random rows."""
    ids = torch.randint(0, n, (b,), generator=gen)
    ids[:5] = dup
    return ids[torch.randperm(b, generator=gen)]


def compare_state(opt_ref, p_ref, opt_dsk, p_dsk, tol):
    st = opt_dsk.store_for(p_dsk)
    assert st.count == opt_dsk.state[p_dsk]["step"]
    assert_matches_sparse_adam(st, opt_ref, p_ref, tol, weights=p_dsk.detach())


# -- trajectory parity ---------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "maximize"), [(torch.float32, False),
                                                 (torch.float32, True),
                                                 (torch.float64, False)])
def test_embedding_loop_matches_sparse_adam_with_scheduler(tmp_path, dtype, maximize):
    n, d = 300, 16
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Embedding(n, d, sparse=True, dtype=dtype)
    dsk = copy.deepcopy(ref)
    w0 = ref.weight.detach().clone()
    target = torch.randn(d, dtype=dtype, generator=gen)
    kw = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "maximize": maximize}
    o_ref = torch.optim.SparseAdam(ref.parameters(), **kw)
    o_dsk = DiskSparseAdam(dsk.parameters(), **kw, state_dir=tmp_path / "opt")
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, step_size=10, gamma=0.5)
    s_dsk = torch.optim.lr_scheduler.StepLR(o_dsk, step_size=10, gamma=0.5)
    seen = torch.zeros(n, dtype=torch.bool)
    for _ in range(40):
        ids = batch(gen, n)
        seen[ids] = True
        o_dsk.prefetch(ids)  # a page-cache hint only: results must not change
        for emb, opt, sch in ((ref, o_ref, s_ref), (dsk, o_dsk, s_dsk)):
            loss = ((emb(ids) - target) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sch.step()
    assert o_dsk.param_groups[0]["lr"] == o_ref.param_groups[0]["lr"] == 0.05 / 16
    compare_state(o_ref, ref.weight, o_dsk, dsk.weight, TOL[dtype])
    assert (~seen).any()
    assert torch.equal(dsk.weight.detach()[~seen], w0[~seen])  # lazy: untouched rows exact
    o_dsk.close()


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_batches_without_triples_skip_coalesce_and_match_it_bit_for_bit(tmp_path, monkeypatch,
                                                                      storage):
    """A CPU gradient in which no id occurs three times is handed over without torch's
    coalesce (uncoalesced, unsorted; the core sums the pairs); one with a triple is coalesced
    as before. Both give exactly the bytes of the run that coalesces every batch, and
    SparseAdam's trajectory. The premise: torch and the core both add a pair as "the first
    copied, the second added" (two -0.0 sum to -0.0; a sum started from zero gives +0.0)."""
    from dsa_core._coalesce import coalesce as core_coalesce

    pair = torch.sparse_coo_tensor(torch.tensor([[3, 3]]), torch.full((2, 4), -0.0), (5, 4),
                                   check_invariants=True)
    assert torch.signbit(pair.coalesce()._values()).all()
    _, summed, _ = core_coalesce(np.array([3, 3]), np.full((2, 4), -0.0, np.float32))
    assert summed.shape == (1, 4) and np.signbit(summed).all()
    n, d = 300, 16
    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.Embedding(n, d, sparse=True)
    fast, slow = copy.deepcopy(ref), copy.deepcopy(ref)
    target = torch.randn(d, generator=gen)
    kw = {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6, "storage": storage}
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.05, betas=(0.8, 0.99), eps=1e-6)
    o_fast = DiskSparseAdam(fast.parameters(), **kw, state_dir=tmp_path / "fast")
    o_slow = DiskSparseAdam(slow.parameters(), **kw, state_dir=tmp_path / "slow")
    calls = []
    real = torch.Tensor.coalesce
    monkeypatch.setattr(torch.Tensor, "coalesce", lambda t: calls.append(1) or real(t))
    repeats = dsa_core.tools.max_repeats
    for i in range(36):
        kind = i % 3  # 0: a row five times; 1: no repeat; 2: pairs only
        perm = torch.randperm(n, generator=gen)
        ids = (batch(gen, n) if kind == 0 else perm[:40] if kind == 1
               else torch.cat([perm[:30], perm[:10]])[torch.randperm(40, generator=gen)])
        for emb, opt in ((ref, o_ref), (fast, o_fast), (slow, o_slow)):
            monkeypatch.setattr(dsa_core.tools, "max_repeats",
                                (lambda ids: 99) if opt is o_slow else repeats)
            if i == 5:  # pairs of -0.0 rows, given as such
                vals = torch.full((40, d), -0.0)
                emb.weight.grad = torch.sparse_coo_tensor(ids[None], vals, (n, d),
                                                          check_invariants=True)
            else:
                loss = ((emb(ids) - target) ** 2).sum()
                loss.backward()
            calls.clear()
            opt.step()
            if opt is o_fast:  # torch's coalesce only where an id occurs three times
                assert len(calls) == (1 if kind == 0 else 0)
            opt.zero_grad()
    assert torch.equal(fast.weight, slow.weight)
    s_fast, s_slow = o_fast.store_for(fast.weight), o_slow.store_for(slow.weight)
    assert s_fast.count == s_slow.count == 36
    rows = np.arange(n)
    np.testing.assert_array_equal(dsa_core.read_records(s_fast, rows).view(np.uint32),
                                  dsa_core.read_records(s_slow, rows).view(np.uint32))
    if storage == "inplace":
        compare_state(o_ref, ref.weight, o_fast, fast.weight, TOL[torch.float32])
    else:
        close(fast.weight.detach(), ref.weight.detach(), TOL[torch.float32])
    o_fast.close()
    o_slow.close()


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_embedding_bag_loop_matches_sparse_adam(tmp_path, mode):
    n, d = 200, 12
    gen = torch.Generator().manual_seed(1)
    ref = torch.nn.EmbeddingBag(n, d, mode=mode, sparse=True, padding_idx=7)
    dsk = copy.deepcopy(ref)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.02)
    o_dsk = DiskSparseAdam(dsk.parameters(), lr=0.02, state_dir=tmp_path)
    for _ in range(30):
        ids = batch(gen, n, b=60, dup=7)  # the padding row, many times
        offsets = torch.tensor([0, 10, 10, 25, 40])  # one empty bag
        psw = torch.rand(60, generator=gen) if mode == "sum" else None
        for emb, opt in ((ref, o_ref), (dsk, o_dsk)):
            out = emb(ids, offsets, per_sample_weights=psw)
            (out.sin().sum() + (out ** 2).sum()).backward()
            opt.step()
            opt.zero_grad()
    compare_state(o_ref, ref.weight, o_dsk, dsk.weight, TOL[torch.float32])
    assert torch.equal(dsk.weight.detach()[7], ref.weight.detach()[7])
    o_dsk.close()


def test_two_groups_grad_none_and_empty_gradient(tmp_path):
    """Two groups with their own lr; a param without grad gets no step; nnz=0 still counts."""
    gen = torch.Generator().manual_seed(2)
    ref = [torch.nn.Embedding(100, 10, sparse=True), torch.nn.Embedding(50, 10, sparse=True)]
    dsk = copy.deepcopy(ref)

    def groups(m):
        return [{"params": m[0].parameters()}, {"params": m[1].parameters(), "lr": 0.03}]

    o_ref = torch.optim.SparseAdam(groups(ref), lr=0.01)
    o_dsk = DiskSparseAdam(groups(dsk), lr=0.01, state_dir=tmp_path)
    sch = [torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.7) for o in (o_ref, o_dsk)]
    for t in range(25):
        ids0, ids1 = batch(gen, 100), batch(gen, 50, b=20, dup=1)
        for m, opt, s in ((ref, o_ref, sch[0]), (dsk, o_dsk, sch[1])):
            loss = (m[0](ids0) ** 2).sum()
            if t % 3 == 0:  # the second table only every third step: grad None otherwise
                loss = loss + m[1](ids1).cos().sum()
            loss.backward()
            if t == 5:  # an explicit gradient with no rows: torch counts the step
                m[1].weight.grad = torch.sparse_coo_tensor(
                    torch.zeros((1, 0), dtype=torch.long), torch.zeros((0, 10)), (50, 10),
                    check_invariants=True)
            opt.step()
            opt.zero_grad()
            s.step()
    assert o_ref.state[ref[1].weight]["step"] == 10  # 9 multiples of 3 below 25, plus t=5
    for k in range(2):
        compare_state(o_ref, ref[k].weight, o_dsk, dsk[k].weight, TOL[torch.float32])
    assert sorted(o_dsk.stores) == ["group0_param0", "group1_param0"]
    o_dsk.close()


def test_tensor_lr_and_closure(tmp_path):
    ref = torch.nn.Embedding(40, 10, sparse=True)
    dsk = copy.deepcopy(ref)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=torch.tensor(0.01))
    o_dsk = DiskSparseAdam(dsk.parameters(), lr=torch.tensor(0.01), state_dir=tmp_path)
    ids = torch.tensor([1, 2, 2, 9])
    for emb, opt in ((ref, o_ref), (dsk, o_dsk)):
        def closure(emb=emb, opt=opt):
            opt.zero_grad()
            loss = emb(ids).sum()
            loss.backward()
            return loss
        for _ in range(3):
            assert opt.step(closure) is not None
    compare_state(o_ref, ref.weight, o_dsk, dsk.weight, TOL[torch.float32])
    o_dsk.close()


# -- Poincaré ball vs geoopt -----------------------------------------------------------------
def _ball_init(n, d, c, gen):
    x = torch.randn(n, d, generator=gen)
    x = x / x.norm(dim=1, keepdim=True)
    r = torch.rand(n, 1, generator=gen) * 0.9  # rows at the boundary (c|x|^2 -> 1) would
    return x * r / c ** 0.5                    # need looser tolerances (docs/algorithms.md §6)


@pytest.mark.parametrize(("manifold", "c", "explicit"), [("ball", 1.0, False),
                                                         ("ball", 1.0, True),
                                                         ("stereo", 0.5, False)])
def test_poincare_loop_matches_geoopt(tmp_path, manifold, c, explicit):
    geoopt = pytest.importorskip("geoopt")
    n, d = 150, 10
    gen = torch.Generator().manual_seed(3)
    init = _ball_init(n, d, c, gen)
    man = geoopt.PoincareBall(c=c) if manifold == "ball" else geoopt.Stereographic(
        torch.tensor(-c))
    p_ref = geoopt.ManifoldParameter(init.clone(), manifold=man)
    if explicit:  # a plain parameter, curvature given by hand
        p_dsk = torch.nn.Parameter(init.clone())
        o_dsk = DiskSparseAdam([p_dsk], lr=0.05, curvature=c, state_dir=tmp_path)
    else:         # the curvature comes from the ManifoldParameter
        p_dsk = geoopt.ManifoldParameter(init.clone(), manifold=man)
        o_dsk = DiskSparseAdam([p_dsk], lr=0.05, state_dir=tmp_path)
    o_ref = geoopt.optim.SparseRiemannianAdam([p_ref], lr=0.05)
    target = torch.randn(d, generator=gen) * 0.3
    for _ in range(40):
        ids = batch(gen, n, b=32)
        for p, opt in ((p_ref, o_ref), (p_dsk, o_dsk)):
            ((F.embedding(ids, p, sparse=True) - target) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    st = o_dsk.store_for(p_dsk)
    assert st.curvature == c and st.count == o_ref.state[p_ref]["step"]
    close(p_dsk.detach(), p_ref.detach(), {"rtol": 0, "atol": 2e-5})
    close(st.exp_avg, o_ref.state[p_ref]["exp_avg"], {"rtol": 0, "atol": 5e-7})
    v_ref = o_ref.state[p_ref]["exp_avg_sq"].numpy()
    close(np.broadcast_to(st.exp_avg_sq, v_ref.shape), v_ref, {"rtol": 1e-4, "atol": 4e-6})
    o_dsk.close()


def test_manifold_curvature_conflict_and_unsupported_manifolds(tmp_path):
    geoopt = pytest.importorskip("geoopt")
    p = geoopt.ManifoldParameter(torch.zeros(5, 3), manifold=geoopt.PoincareBall(c=1.0))
    with pytest.raises(ValueError, match="curvature 1.0, but its group asks for curvature 2"):
        DiskSparseAdam([p], curvature=2.0, state_dir=tmp_path / "a")
    for man, exc, match in ((geoopt.PoincareBallExact(), TypeError, "exponential map"),
                            (geoopt.SphereProjection(), ValueError, "not a Poincaré ball"),
                            (geoopt.Sphere(), TypeError, "not supported")):
        q = geoopt.ManifoldParameter(torch.zeros(5, 3), manifold=man)
        with pytest.raises(exc, match=match):
            DiskSparseAdam([q], state_dir=tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- bad inputs: clear errors, nothing written ---------------------------------------------
@pytest.mark.parametrize("kw", [{"lr": 0.0}, {"lr": -1e-3}, {"eps": 0.0}, {"eps": -1.0},
                                {"betas": (1.0, 0.9)}, {"betas": (0.9, 1.0)},
                                {"betas": (-0.1, 0.9)}, {"lr": 0.0, "eps": 0.0},
                                {"lr": torch.tensor([0.1, 0.2])}])
def test_invalid_hyperparameters_match_torch_word_for_word(tmp_path, kw):
    p = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError) as want:
        torch.optim.SparseAdam([p], **kw)
    with pytest.raises(ValueError) as got:
        DiskSparseAdam([p], **kw, state_dir=tmp_path / "opt")
    assert str(got.value) == str(want.value)
    assert not (tmp_path / "opt").exists()


def test_sparse_and_complex_params_match_torch(tmp_path):
    dense = torch.nn.Parameter(torch.zeros(4, 3))
    sparse = torch.nn.Parameter(torch.zeros(4, 3).to_sparse())
    cplx = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.complex64))
    for params in ([dense, sparse], [{"params": [dense]}, {"params": [cplx]}]):
        with pytest.raises(ValueError) as want:
            torch.optim.SparseAdam(params)
        with pytest.raises(ValueError) as got:
            DiskSparseAdam(params, state_dir=tmp_path / "opt")
        assert str(got.value) == str(want.value)
    assert not (tmp_path / "opt").exists()


@pytest.mark.parametrize("shape", [(10,), (4, 3, 2), ()])
def test_non_2d_params_refused(tmp_path, shape):
    ok = torch.nn.Parameter(torch.zeros(4, 3))
    bad = torch.nn.Parameter(torch.zeros(shape))
    with pytest.raises(ValueError, match=r"needs 2-D .* parameter \[0, 1\] has shape"):
        DiskSparseAdam([ok, bad], state_dir=tmp_path / "opt")
    with pytest.raises(TypeError, match="float16"):
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float16))],
                       state_dir=tmp_path / "opt")
    with pytest.raises(ValueError, match="needs state_dir"):
        DiskSparseAdam([ok])
    assert not (tmp_path / "opt").exists()


def _trained(tmp_path, steps=3):
    gen = torch.Generator().manual_seed(4)
    embs = [torch.nn.Embedding(30, 6, sparse=True), torch.nn.Embedding(20, 6, sparse=True)]
    opt = DiskSparseAdam([e.weight for e in embs], lr=0.01, state_dir=tmp_path / "opt")
    for _ in range(steps):
        for e in embs:
            e(batch(gen, e.num_embeddings, b=8, dup=2)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    return embs, opt


def _bad_step(opt, embs, make_grad, exc, match):
    before = digest(opt.state_dir)
    w_before = [e.weight.detach().clone() for e in embs]
    counts = [opt.store_for(e.weight).count for e in embs]
    embs[0](torch.tensor([1, 2, 2])).sum().backward()  # a good gradient on the first...
    embs[1].weight.grad = make_grad()                   # ...and a bad one on the second
    with pytest.raises(exc, match=match):
        opt.step()
    opt.zero_grad()
    opt.flush()
    assert digest(opt.state_dir) == before
    assert all(torch.equal(e.weight.detach(), w) for e, w in zip(embs, w_before))
    assert [opt.store_for(e.weight).count for e in embs] == counts


def test_dense_gradient_refused_with_torch_message(tmp_path):
    embs, opt = _trained(tmp_path)
    _bad_step(opt, embs, lambda: torch.ones(20, 6), RuntimeError,
              "^SparseAdam does not support dense gradients, please consider Adam instead$")
    p = torch.nn.Parameter(torch.zeros(4, 3))
    p.grad = torch.ones(4, 3)
    ref = torch.optim.SparseAdam([p])
    with pytest.raises(RuntimeError) as want:
        ref.step()
    assert str(want.value) == "SparseAdam does not support dense gradients, please consider Adam instead"
    opt.close()


def test_element_sparse_gradient_refused(tmp_path):
    embs, opt = _trained(tmp_path)
    _bad_step(opt, embs, lambda: torch.sparse_coo_tensor(
        torch.tensor([[1, 3], [0, 5]]), torch.tensor([1.0, 2.0]), (20, 6),
        check_invariants=True), ValueError, "sparse_dim == 1 .* got sparse_dim=2")
    opt.close()


def test_out_of_range_gradient_rows_refused(tmp_path):
    embs, opt = _trained(tmp_path)
    _bad_step(opt, embs, lambda: torch.sparse_coo_tensor(
        torch.tensor([[3, 25]]), torch.ones(2, 6), (20, 6), check_invariants=False),
        IndexError, r"must lie in \[0, 20\)")
    opt.close()


def test_two_optimizers_on_one_state_dir(tmp_path):
    embs, opt = _trained(tmp_path)
    before = digest(opt.state_dir)
    with pytest.raises(StoreLockedError, match="already used by another DiskSparseAdam"):
        DiskSparseAdam([e.weight for e in embs], state_dir=opt.state_dir)
    # a store opened directly is refused too (dsa_core's own writer lock)
    opt2 = DiskSparseAdam([embs[0].weight], state_dir=tmp_path / "other")
    with pytest.raises(StoreLockedError):
        dsa_core.open(opt2.state_dir / "group0_param0")
    opt2.close()
    assert digest(opt.state_dir) == before
    opt.close()
    opt.close()  # safe twice
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    DiskSparseAdam([e.weight for e in embs], state_dir=opt.state_dir, resume=True).close()


def test_mismatched_store_refused_without_writing(tmp_path):
    embs, opt = _trained(tmp_path)
    opt.close()
    before = digest(tmp_path / "opt")
    wrong = [torch.nn.Parameter(torch.zeros(30, 6)), torch.nn.Parameter(torch.zeros(21, 6))]
    with pytest.raises(ValueError, match="holds a 20 x 6 float32 table"):
        DiskSparseAdam(wrong, state_dir=tmp_path / "opt")
    with pytest.raises(ValueError, match="curvature"):
        DiskSparseAdam([e.weight for e in embs], curvature=1.0, state_dir=tmp_path / "opt")
    assert digest(tmp_path / "opt") == before
    DiskSparseAdam([e.weight for e in embs], state_dir=tmp_path / "opt", resume=True).close()


def test_add_param_group_creates_store(tmp_path):
    a, b = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(12, 4, sparse=True)
    opt = DiskSparseAdam(a.parameters(), state_dir=tmp_path)
    with pytest.raises(ValueError, match="needs 2-D"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": b.parameters(), "lr": 0.5})
    assert list(opt.stores) == ["group0_param0", "group1_param0"]
    b(torch.tensor([3])).sum().backward()
    opt.step()
    assert opt.store_for(b.weight).count == 1 and opt.store_for(a.weight).count == 0
    opt.close()


# -- checkpoints -----------------------------------------------------------------------------
def _run(opt, emb, steps, seed0):
    for t in range(seed0, seed0 + steps):
        gen = torch.Generator().manual_seed(100 + t)
        ids = batch(gen, emb.num_embeddings, b=40)
        ((emb(ids) - 0.3) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()


def _fresh(dtype=torch.float32):
    torch.manual_seed(7)
    return torch.nn.Embedding(500, 12, sparse=True, dtype=dtype)


def test_state_dict_is_a_small_manifest(tmp_path, monkeypatch):
    # a large table's (a small one's state dict holds its records, as SparseAdam's its moments)
    monkeypatch.setattr(DiskWeight, "read_limit", 0)
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path)
    _run(opt, emb, 3, 0)
    sd = opt.state_dict()
    man = sd[MANIFEST_KEY]
    assert sd["state"] == {0: {"step": 3}}
    assert man["params"][0]["name"] == "group0_param0" and man["params"][0]["count"] == 3
    json.dumps(man)  # plain data only
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert buf.tell() < 4096  # the moments (2 x 500 x 12 floats) are not in it
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded[MANIFEST_KEY] == man
    # state_dict flushed: the store's own manifest already has the count
    assert dsa_core.open(tmp_path / "group0_param0", mode="r").count == 3
    opt.close()


def test_state_dict_round_trip_is_bit_exact(tmp_path):
    emb_ref = _fresh()
    o_ref = DiskSparseAdam(emb_ref.parameters(), lr=0.02, state_dir=tmp_path / "ref")
    s_ref = torch.optim.lr_scheduler.StepLR(o_ref, 4, 0.5)
    for t in range(12):
        _run(o_ref, emb_ref, 1, t)
        s_ref.step()

    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "run")
    sch = torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)
    for t in range(6):
        _run(opt, emb, 1, t)
        sch.step()
    ckpt = io.BytesIO()
    torch.save({"model": emb.state_dict(), "opt": opt.state_dict(),
                "sched": sch.state_dict()}, ckpt)
    opt.close()
    del emb, opt, sch

    ckpt.seek(0)
    ck = torch.load(ckpt, weights_only=True)
    emb = _fresh()
    emb.load_state_dict(ck["model"])
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "run", resume=True)
    sch = torch.optim.lr_scheduler.StepLR(opt, 4, 0.5)
    opt.load_state_dict(ck["opt"])
    sch.load_state_dict(ck["sched"])
    for t in range(6, 12):
        _run(opt, emb, 1, t)
        sch.step()
    assert torch.equal(emb.weight, emb_ref.weight)
    a, b = opt.store_for(emb.weight), o_ref.store_for(emb_ref.weight)
    assert a.count == b.count == 12
    assert np.array_equal(a.exp_avg, b.exp_avg) and np.array_equal(a.exp_avg_sq, b.exp_avg_sq)
    opt.close()
    o_ref.close()


_RESUME_SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch._dynamo
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {repo!r} + "/tests")  # helpers
    sys.path.insert(0, {repo!r} + "/tests/adapters/torch")  # this module
    from adapters.torch import DiskSparseAdam
    from test_torch_adapter import _fresh, _run
    from dsa_core.tools import validation
    as_index = validation.as_index
    as_index([0], 1)  # numba's first kernel load (its registries: ~1 s) once, here; a plain
    # kernel (not parallel): no numba thread starts
    root, modes = sys.argv[1], sys.argv[2:]
    # one interpreter start: each phase is a process forked from this one (before any torch
    # computation, so torch's thread pool does not exist yet; torch._dynamo, which the first
    # optimizer imports, is imported above once) that runs the code below the loop as a
    # script's main code, and so ends as a script ends; the second starts after the first
    # ended
    for phase in ("first", "second"):
        pid = os.fork()
        if pid == 0:
            break
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            sys.exit(f"the {{phase}} phase ended with status {{os.waitstatus_to_exitcode(status)}}")
    else:
        os._exit(0)  # this process opened no store; its interpreter teardown would take ~2 s
    kept = []  # the first phase's optimizers live until the interpreter exits
    for mode in modes:  # each mode in its own directory, with its own optimizer
        d = root + "/" + mode
        emb = _fresh()
        opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=d + "/opt", resume=True)
        if phase == "first":
            _run(opt, emb, 5, 0)
            ck = {{"model": emb.state_dict()}}
            if mode == "load":
                ck["opt"] = opt.state_dict()
            torch.save(ck, d + "/ckpt.pt")
            kept.append((emb, opt))
            # no close(): at interpreter exit the optimizer is finalized (flush + unlock);
            # with mode "state_dir_only" nothing else flushed the count of the 5 steps
        else:
            ck = torch.load(d + "/ckpt.pt", weights_only=True)
            emb.load_state_dict(ck["model"])
            if mode == "load":
                opt.load_state_dict(ck["opt"])
            _run(opt, emb, 5, 5)
            torch.save(emb.weight.detach(), d + "/final.pt")
            opt.close()
    if phase == "second":  # everything closed: skip the interpreter teardown (~2 s)
        os._exit(0)
""")


def test_resume_in_a_new_process_is_bit_exact(tmp_path):
    """5 steps in one process that ends without close(), 5 more in a new one: the weights,
    count and moments of 10 uninterrupted steps, bit for bit -- whether the new process loads
    the optimizer's state dict ("load") or only reopens its state_dir ("state_dir_only").
    One pair of processes runs both modes, each in its own directory (both forked from one
    interpreter start, the second after the first ended)."""
    script = tmp_path / "resume.py"
    script.write_text(_RESUME_SCRIPT.format(repo=str(REPO)))
    modes = ["load", "state_dir_only"]
    r = subprocess.run([sys.executable, str(script), str(tmp_path), *modes],
                       check=False, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "ref")
    _run(opt, emb, 10, 0)
    st = opt.store_for(emb.weight)
    for mode in modes:
        d = tmp_path / mode
        assert torch.equal(torch.load(d / "final.pt", weights_only=True),
                           emb.weight.detach()), mode
        resumed = dsa_core.open(d / "opt" / "group0_param0", mode="r")
        assert resumed.count == 10, mode
        assert np.array_equal(resumed.exp_avg, st.exp_avg), mode
        assert np.array_equal(resumed.exp_avg_sq, st.exp_avg_sq), mode
    opt.close()


def test_load_torch_sparse_adam_checkpoint(tmp_path):
    ref = _fresh()
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.02)
    _run(o_ref, ref, 5, 0)
    dsk = copy.deepcopy(ref)
    o_dsk = DiskSparseAdam(dsk.parameters(), lr=0.02, state_dir=tmp_path)
    o_dsk.load_state_dict(o_ref.state_dict())
    assert set(o_dsk.state[dsk.weight]) == {"step"}  # no table-sized tensors kept
    _run(o_ref, ref, 5, 5)
    _run(o_dsk, dsk, 5, 5)
    compare_state(o_ref, ref.weight, o_dsk, dsk.weight, TOL[torch.float32])
    o_dsk.close()


def test_state_dict_of_an_earlier_step_restores_it(tmp_path):
    """torch.save(opt.state_dict()) at step 5 of an in-place store, trained to 25, loaded:
    the store's snapshot brings m, v, the count and the param groups back to step 5 (the
    same on log stores: test_torch_snapshots.py)."""
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path)
    sch = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
    for t in range(5):
        _run(opt, emb, 1, t)
        sch.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    st = opt.store_for(emb.weight)
    assert st.storage == "inplace"
    at5 = dsa_core.read_records(st, np.arange(st.num_rows))
    for t in range(5, 25):
        _run(opt, emb, 1, t)
        sch.step()
    buf.seek(0)
    opt.load_state_dict(torch.load(buf, weights_only=True))
    st = opt.store_for(emb.weight)
    assert st.count == 5 and opt.state[emb.weight]["step"] == 5
    assert opt.param_groups[0]["lr"] == 0.02
    np.testing.assert_array_equal(dsa_core.read_records(st, np.arange(st.num_rows)), at5)
    opt.close()


def test_state_dict_of_an_earlier_step_without_snapshots_is_refused(tmp_path):
    """Issue 18 §5: with keep_snapshots=0, torch.save(opt.state_dict()) at step 5, trained
    to 25, loaded: refused (it holds no rows, so it would pair count 5 with the moments of
    step 25), nothing changed, and the message names the real checkpoint."""
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path, keep_snapshots=0)
    sch = torch.optim.lr_scheduler.StepLR(opt, 10, 0.5)
    for t in range(5):
        _run(opt, emb, 1, t)
        sch.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    for t in range(5, 25):
        _run(opt, emb, 1, t)
        sch.step()
    opt.flush()
    before = digest(tmp_path)
    lr = opt.param_groups[0]["lr"]
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    with pytest.raises(ValueError, match=r"taken at step 5 .* is at step 25.*nothing was "
                                         r"changed.*opt\.checkpoint\(dest\).*"
                                         r"opt\.load_checkpoint\(dest\)") as err:
        opt.load_state_dict(sd)
    assert "parameter [0, 0]" in str(err.value)
    assert opt.store_for(emb.weight).count == 25 and opt.state[emb.weight]["step"] == 25
    assert opt.param_groups[0]["lr"] == lr == 0.02 * 0.5 ** 2
    assert digest(tmp_path) == before
    # a state dict of the stores as they are loads (here: the param groups it carries)
    now = opt.state_dict()
    opt.param_groups[0]["lr"] = 1.0
    opt.load_state_dict(now)
    assert opt.param_groups[0]["lr"] == lr and opt.store_for(emb.weight).count == 25
    # a layout mismatch is refused too
    bad = copy.deepcopy(now)
    bad[MANIFEST_KEY]["params"][0]["dim"] = 13
    with pytest.raises(ValueError, match="500 x 13"):
        opt.load_state_dict(bad)
    opt.close()
    # and a fresh optimizer (stores at step 0) refuses a state dict of step 25
    emb2 = _fresh()
    opt2 = DiskSparseAdam(emb2.parameters(), lr=0.02, state_dir=tmp_path / "fresh",
                          keep_snapshots=0)
    with pytest.raises(ValueError, match=r"taken at step 25 .* is at step 0"):
        opt2.load_state_dict(now)
    assert opt2.store_for(emb2.weight).count == 0
    opt2.close()


def test_pickling_refused(tmp_path):
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path)
    with pytest.raises(TypeError, match="cannot be pickled"):
        copy.deepcopy(opt)
    opt.close()


# -- CUDA ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bag", [False, True])
def test_cuda_loop_matches_sparse_adam(tmp_path, bag):
    n, d = 2000, 32
    gen = torch.Generator().manual_seed(5)
    if bag:
        ref = torch.nn.EmbeddingBag(n, d, mode="mean", sparse=True).cuda()
    else:
        ref = torch.nn.Embedding(n, d, sparse=True).cuda()
    dsk = copy.deepcopy(ref)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    o_dsk = DiskSparseAdam(dsk.parameters(), lr=0.01, state_dir=tmp_path)
    for _ in range(20):
        ids = batch(gen, n, b=256).cuda()
        for emb, opt in ((ref, o_ref), (dsk, o_dsk)):
            out = emb(ids.view(32, 8)) if bag else emb(ids)
            ((out - 0.1) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()
    assert dsk.weight.is_cuda
    st = o_dsk.store_for(dsk.weight)
    close(dsk.weight.detach().cpu(), ref.weight.detach().cpu(), TOL[torch.float32])
    close(st.exp_avg, o_ref.state[ref.weight]["exp_avg"].cpu(), TOL[torch.float32])
    close(st.exp_avg_sq, o_ref.state[ref.weight]["exp_avg_sq"].cpu(), TOL[torch.float32])
    o_dsk.close()


def test_access_reaches_the_stores_and_a_bad_one_writes_nothing(tmp_path):
    from adapters.torch import DiskEmbedding

    emb = torch.nn.Embedding(50, 4, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "o", access="disk")
    emb(torch.tensor([1, 2, 1])).sum().backward()
    opt.step()
    assert [s.access for s in opt.stores.values()] == ["disk"]
    opt.close()
    de = DiskEmbedding(50, 4, state_dir=tmp_path / "e", access="ram")
    assert de.store.access == "ram"
    de.close()
    with pytest.raises(ValueError, match=r"access must be one of \('auto', 'ram', 'disk'\)"):
        DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "x", access="fast")
    with pytest.raises(ValueError, match="access must be one of"):
        DiskEmbedding(50, 4, state_dir=tmp_path / "y", access="huge")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# -- second_moment="rowwise" ---------------------------------------------------------------
def test_rowwise_loop_is_dsa_core_rowwise_and_keeps_sparse_adams_m(tmp_path):
    """DiskSparseAdam(second_moment="rowwise") hands torch's coalesced gradient to a
    row-wise store: its weights equal dsa_core.step on such a store bit for bit, and its m
    equals torch.optim.SparseAdam's (m depends on the gradients only, and this loss's
    gradients do not depend on the weights)."""
    from adapters.torch import DiskEmbedding

    n, d = 200, 16
    gen = torch.Generator().manual_seed(4)
    ref = torch.nn.Embedding(n, d, sparse=True)
    dsk = copy.deepcopy(ref)
    w0 = ref.weight.detach().clone()
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    o_dsk = DiskSparseAdam(dsk.parameters(), lr=0.05, state_dir=tmp_path / "opt",
                           second_moment="rowwise")
    core = dsa_core.create(tmp_path / "core", n, d, init=w0.numpy(), lr=0.05,
                           second_moment="rowwise")
    coef = torch.randn(48, d, generator=gen)
    for _ in range(15):
        ids = batch(gen, n)
        for emb, opt in ((ref, o_ref), (dsk, o_dsk)):
            (emb(ids) * coef).sum().backward()
            g = emb.weight.grad.coalesce()
            opt.step()
            opt.zero_grad()
        core = dsa_core.step(core, g.indices()[0].numpy(), g.values().numpy())
    st = o_dsk.store_for(dsk.weight)
    assert st.second_moment == "rowwise" and st.exp_avg_sq.shape == (n, 1)
    np.testing.assert_array_equal(dsk.weight.detach().numpy(), core.weights)
    np.testing.assert_array_equal(st.exp_avg_sq, core.exp_avg_sq)
    np.testing.assert_array_equal(st.exp_avg, o_ref.state[ref.weight]["exp_avg"].numpy())
    assert not torch.equal(dsk.weight, ref.weight)
    sd = o_dsk.state_dict()
    assert sd[MANIFEST_KEY]["params"][0]["second_moment"] == "rowwise"
    o_dsk.close()
    dsa_core.close(core)
    # a DiskEmbedding keeps its own setting; the optimizer may repeat it, not contradict it
    emb = DiskEmbedding(n, d, state_dir=tmp_path / "emb", second_moment="rowwise")
    assert emb.store.second_moment == "rowwise"
    with pytest.raises(ValueError, match=r"DiskEmbedding whose store keeps a rowwise second "
                                         r"moment, but this optimizer asks for "
                                         r"second_moment='elementwise'"):
        DiskSparseAdam(emb.parameters(), second_moment="elementwise")
    opt = DiskSparseAdam(emb.parameters(), lr=0.05, second_moment="rowwise")
    emb(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    assert emb.store.count == 1
    opt.close()
    emb.close()


def test_rowwise_mismatches_are_refused_without_writing(tmp_path):
    from adapters.torch import DiskEmbedding

    emb = torch.nn.Embedding(50, 4, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "opt", second_moment="rowwise")
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd_rw = opt.state_dict()
    opt.close()
    before = digest(tmp_path / "opt")
    # resuming the stores with the other setting
    with pytest.raises(ValueError, match=r"keeps a rowwise second moment, but "
                                         r"second_moment='elementwise' was asked for"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "opt")
    assert digest(tmp_path / "opt") == before
    # a row-wise manifest into elementwise stores
    opt = DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "el")
    with pytest.raises(ValueError, match=r"keeps a rowwise second moment, but the parameter in "
                                         r"its position has a elementwise store"):
        opt.load_state_dict(sd_rw)
    opt.close()
    # bad values and the ball
    with pytest.raises(ValueError, match=r"^DiskSparseAdam: second_moment must be .*"
                                         r"'elementwise'.*'rowwise'.* got 'mean'"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "x", second_moment="mean")
    with pytest.raises(ValueError, match=r"second_moment='rowwise' is for curvature == 0"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "x", curvature=1.0,
                       second_moment="rowwise")
    with pytest.raises(ValueError, match=r"second_moment='rowwise' is for curvature == 0"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "e", curvature=1.0, second_moment="rowwise")
    assert not (tmp_path / "x").exists() and not (tmp_path / "e").exists()
    emb2 = DiskEmbedding(10, 4, state_dir=tmp_path / "e2")
    emb2.close()
    with pytest.raises(ValueError, match=r"keeps a elementwise second moment, but "
                                         r"second_moment='rowwise' was asked for"):
        DiskEmbedding(10, 4, state_dir=tmp_path / "e2", second_moment="rowwise")


@pytest.mark.parametrize("second_moment,first_moment", [("rowwise", "full"),
                                                         ("elementwise", "bfloat16"),
                                                         ("rowwise", "bfloat16")])
def test_sparse_adam_state_dict_into_reduced_stores(tmp_path, second_moment, first_moment):
    """A torch SparseAdam state dict loads into reduced stores: row-wise v is the row mean of
    SparseAdam's v (exact: a row's coordinates are updated together), and m is rounded to the
    nearest bfloat16 (torch's own conversion). Checked against a run that kept the reduced
    state from the start on the same gradients, which do not depend on the weights."""
    n, d, steps = 60, 8, 7
    gen = torch.Generator().manual_seed(11)
    grads = []
    for _ in range(steps):
        ids = batch(gen, n)
        vals = torch.randn(ids.numel(), d, generator=gen) * torch.rand(1, d, generator=gen) * 3
        grads.append(torch.sparse_coo_tensor(ids[None], vals, (n, d), check_invariants=True))
    ref_p = torch.nn.Parameter(torch.zeros(n, d))
    red_p = torch.nn.Parameter(torch.zeros(n, d))
    ref = torch.optim.SparseAdam([ref_p], lr=0.01)
    red = DiskSparseAdam([red_p], lr=0.01, state_dir=tmp_path / "red",
                         second_moment=second_moment, first_moment=first_moment)
    for g in grads:
        ref_p.grad, red_p.grad = g.clone(), g.clone()
        ref.step()
        red.step()
    red_st = red.store_for(red_p)
    q = torch.nn.Parameter(ref_p.detach().clone())
    opt = DiskSparseAdam([q], lr=0.01, state_dir=tmp_path / "loaded",
                         second_moment=second_moment, first_moment=first_moment)
    sd = ref.state_dict()
    sd["param_groups"][0]["params"] = [0]
    opt.load_state_dict(sd)
    st = opt.store_for(q)
    assert st.count == steps
    m_ref = ref.state[ref_p]["exp_avg"]
    v_ref = ref.state[ref_p]["exp_avg_sq"]
    if first_moment == "bfloat16":
        np.testing.assert_array_equal(st.exp_avg, m_ref.to(torch.bfloat16).float().numpy())
        # the reduced run's m carries its steps' stochastic roundings: each moves m by under
        # one bfloat16 ulp (2^-7 of |m|), and b1 = 0.9 decays the older ones, so the gap stays
        # under sum(0.9^k, k < steps) * 2^-7 = 0.041 of the row's scale (measured: 0.012)
        scale = np.abs(m_ref.numpy()).max(axis=1, keepdims=True)
        bound = 2.0 ** -7 * (1 - 0.9 ** steps) / (1 - 0.9)
        assert (np.abs(st.exp_avg - red_st.exp_avg) <= bound * scale).all()
    else:
        np.testing.assert_array_equal(st.exp_avg, m_ref.numpy())
        np.testing.assert_array_equal(st.exp_avg, red_st.exp_avg)  # m does not see v
    if second_moment == "rowwise":
        assert st.exp_avg_sq.shape == (n, 1)
        # the reduced run's own v, up to float32 rounding of the two summation orders
        np.testing.assert_allclose(st.exp_avg_sq, red_st.exp_avg_sq, rtol=2e-6, atol=0)
        np.testing.assert_array_equal(
            st.exp_avg_sq[:, 0], v_ref.double().mean(1).float().numpy())
    else:
        np.testing.assert_array_equal(st.exp_avg_sq, v_ref.numpy())
    opt.close()
    red.close()


def test_bfloat16_first_moment_through_the_adapters(tmp_path):
    """DiskSparseAdam(first_moment="bfloat16") steps like dsa_core.step on such a store, bit
    for bit; mismatches are refused without writing."""
    from adapters.torch import DiskEmbedding

    n, d = 120, 8
    gen = torch.Generator().manual_seed(5)
    emb = torch.nn.Embedding(n, d, sparse=True)
    core = dsa_core.create(tmp_path / "core", n, d, init=emb.weight.detach().numpy().copy(),
                           lr=0.05, first_moment="bfloat16")
    opt = DiskSparseAdam(emb.parameters(), lr=0.05, state_dir=tmp_path / "opt",
                         first_moment="bfloat16")
    for _ in range(10):
        ids = batch(gen, n)
        emb(ids).pow(2).sum().backward()
        g = emb.weight.grad.coalesce()
        opt.step()
        opt.zero_grad()
        core = dsa_core.step(core, g.indices()[0].numpy(), g.values().numpy())
    st = opt.store_for(emb.weight)
    assert st.first_moment == "bfloat16"
    np.testing.assert_array_equal(emb.weight.detach().numpy(), core.weights)
    np.testing.assert_array_equal(st.exp_avg, core.exp_avg)
    assert opt.state_dict()[MANIFEST_KEY]["params"][0]["first_moment"] == "bfloat16"
    opt.close()
    dsa_core.close(core)
    before = digest(tmp_path / "opt")
    with pytest.raises(ValueError, match=r"keeps its first moment as 'bfloat16', but "
                                         r"first_moment='full' was asked for"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "opt", first_moment="full")
    with pytest.raises(ValueError, match=r"DiskSparseAdam parameter \[0, 0\]: "
                                         r"first_moment='bfloat16' is for float32 stores"):
        DiskSparseAdam([torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float64))],
                       state_dir=tmp_path / "x", first_moment="bfloat16")
    with pytest.raises(ValueError, match=r"^DiskSparseAdam: first_moment must be .*'full'.*"
                                         r"'bfloat16'.* got 'half'"):
        DiskSparseAdam(emb.parameters(), state_dir=tmp_path / "x", first_moment="half")
    assert digest(tmp_path / "opt") == before and not (tmp_path / "x").exists()
    de = DiskEmbedding(20, 4, state_dir=tmp_path / "de", first_moment="bfloat16")
    assert de.store.first_moment == "bfloat16"
    with pytest.raises(ValueError, match=r"whose store keeps m as 'bfloat16', but this "
                                         r"optimizer asks for first_moment='full'"):
        DiskSparseAdam(de.parameters(), first_moment="full")
    de.close()


# -- issue 18: reopening must be asked for, stale States, checkpoint(extra=), nonfinite ------
def test_rerun_on_an_existing_state_dir_is_refused_unless_asked(tmp_path):
    """Issue 18 §5: a second run with the same state_dir paired fresh weights with the old m
    and v and went on from count 20 without a word. Now it is refused (FileExistsError,
    offering resume=True and overwrite=True, nothing touched) unless asked for."""
    sd_dir = tmp_path / "opt"
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=sd_dir, resume=True)  # creates
    _run(opt, emb, 20, 0)
    m20 = opt.store_for(emb.weight).exp_avg.copy()
    opt.close()
    before = digest(sd_dir)
    emb = _fresh()  # the second run of the script: freshly initialised weights
    with pytest.raises(FileExistsError, match=r"already holds the stores of an earlier run: "
                                              r"group0_param0 \(step 20\); nothing was "
                                              r"changed\. Pass resume=True .* or "
                                              r"overwrite=True"):
        DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=sd_dir)
    with pytest.raises(ValueError, match="resume=True and overwrite=True contradict"):
        DiskSparseAdam(emb.parameters(), state_dir=sd_dir, resume=True, overwrite=True)
    with pytest.raises(TypeError, match="resume must be a bool"):
        DiskSparseAdam(emb.parameters(), state_dir=sd_dir, resume="yes")
    assert digest(sd_dir) == before
    # resume=True: the moments and the count carry on
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=sd_dir, resume=True)
    st = opt.store_for(emb.weight)
    assert st.count == 20 and opt.state[emb.weight]["step"] == 20
    assert np.array_equal(st.exp_avg, m20)
    opt.close()
    # overwrite=True: new stores, step 0, zero moments
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=sd_dir, overwrite=True)
    st = opt.store_for(emb.weight)
    assert st.count == 0 and not st.exp_avg.any() and not st.exp_avg_sq.any()
    assert opt.state[emb.weight] == {}
    _run(opt, emb, 1, 0)
    opt.close()


def test_add_param_group_refuses_an_existing_store_unless_resumed(tmp_path):
    a, b = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(12, 4, sparse=True)
    DiskSparseAdam([{"params": [a.weight]}, {"params": [b.weight]}],
                   state_dir=tmp_path).close()
    shutil.rmtree(tmp_path / "group0_param0")
    opt = DiskSparseAdam([a.weight], state_dir=tmp_path)  # group0_param0 is new
    with pytest.raises(FileExistsError, match=r"group1_param0 \(step 0\)"):
        opt.add_param_group({"params": [b.weight]})
    assert len(opt.param_groups) == 1
    opt.close()
    opt = DiskSparseAdam([a.weight], state_dir=tmp_path, resume=True)
    opt.add_param_group({"params": [b.weight]})
    assert list(opt.stores) == ["group0_param0", "group1_param0"]
    opt.close()


def test_a_state_obtained_before_a_step_is_stale(tmp_path):
    """dsa_core refuses to step, flush or checkpoint an outdated State; through the
    adapter that is a State taken with store_for() (or .stores) before opt.step()."""
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "opt")
    old = opt.store_for(emb.weight)
    _run(opt, emb, 1, 0)
    assert old.count == 0 and not old.current
    for call in (lambda: dsa_core.flush(old),
                 lambda: dsa_core.checkpoint(old, tmp_path / "ck"),
                 lambda: dsa_core.step(old, [1], np.ones((1, 12), np.float32),
                                       table=emb.weight.detach().numpy())):
        with pytest.raises(dsa_core.StaleStateError, match="outdated"):
            call()
    assert not (tmp_path / "ck").exists()
    assert np.array_equal(old.exp_avg, opt.store_for(emb.weight).exp_avg)  # reads still work
    new = opt.store_for(emb.weight)
    assert new.current and new.count == 1
    dsa_core.flush(new)
    _run(opt, emb, 1, 1)  # the optimizer keeps the current State itself
    assert opt.store_for(emb.weight).count == 2
    opt.close()


def _model_and_opt(state_dir, **kw):
    torch.manual_seed(3)
    model = torch.nn.ModuleDict({"emb": torch.nn.Embedding(300, 8, sparse=True),
                                 "lin": torch.nn.Linear(8, 1)})
    opt = DiskSparseAdam(model["emb"].parameters(), lr=0.05, state_dir=state_dir, **kw)
    dense = torch.optim.Adam(model["lin"].parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    return model, opt, dense, sched


def _train(model, opt, dense, sched, t0, steps):
    for t in range(t0, t0 + steps):
        gen = torch.Generator().manual_seed(200 + t)
        ids = torch.randint(0, 300, (32,), generator=gen)
        y = torch.randn(32, 1, generator=gen)
        ((model["lin"](model["emb"](ids)) - y) ** 2).mean().backward()
        for o in (opt, dense):
            o.step()
            o.zero_grad()
        sched.step()


def test_checkpoint_extra_carries_the_model_and_scheduler(tmp_path):
    """opt.checkpoint(dest, extra={...}) puts the model's and the schedulers' state dicts in
    the same atomic directory; load_checkpoint returns them and the run resumes bit-exact."""
    model, opt, dense, sched = _model_and_opt(tmp_path / "ref")
    _train(model, opt, dense, sched, 0, 12)
    ref_w = {k: v.clone() for k, v in model.state_dict().items()}
    ref_st = opt.store_for(model["emb"].weight)
    ref_m, ref_v = ref_st.exp_avg.copy(), ref_st.exp_avg_sq.copy()
    opt.close()

    model, opt, dense, sched = _model_and_opt(tmp_path / "run")
    _train(model, opt, dense, sched, 0, 5)
    ck = opt.checkpoint(tmp_path / "ck", extra={"model": model.state_dict(),
                                               "dense": dense.state_dict(),
                                               "sched": sched.state_dict(), "epoch": 5})
    assert sorted(p.name for p in ck.iterdir()) == ["extra.pt", "group0_param0",
                                                    "optimizer.pt"]
    _train(model, opt, dense, sched, 5, 4)  # trained on past the checkpoint, then lost
    opt.close()
    del model, opt, dense, sched

    model, opt, dense, sched = _model_and_opt(tmp_path / "run", overwrite=True)
    extra = opt.load_checkpoint(tmp_path / "ck")
    assert sorted(extra) == ["dense", "epoch", "model", "sched"] and extra["epoch"] == 5
    model.load_state_dict(extra["model"])
    dense.load_state_dict(extra["dense"])
    sched.load_state_dict(extra["sched"])
    assert opt.store_for(model["emb"].weight).count == 5
    _train(model, opt, dense, sched, 5, 7)
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_w[k]), k
    st = opt.store_for(model["emb"].weight)
    assert st.count == 12
    assert np.array_equal(st.exp_avg, ref_m) and np.array_equal(st.exp_avg_sq, ref_v)
    # a checkpoint without extra gives {}
    opt.checkpoint(tmp_path / "plain")
    assert not (tmp_path / "plain" / "extra.pt").exists()
    assert opt.load_checkpoint(tmp_path / "plain") == {}
    opt.close()


class _NotWeights:
    """Pickles fine, but torch.load(weights_only=True) refuses it."""


def test_checkpoint_extra_that_cannot_be_resumed_is_refused(tmp_path):
    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "opt")
    _run(opt, emb, 2, 0)
    with pytest.raises(TypeError, match="extra must be a dict"):
        opt.checkpoint(tmp_path / "ck", extra=[emb.state_dict()])
    with pytest.raises(TypeError, match=r"torch\.load\(weights_only=True\) refuses.*Nothing "
                                        r"was written"):
        opt.checkpoint(tmp_path / "ck", extra={"obj": _NotWeights()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt"]  # no ck, no ck.tmp-*
    opt.close()


def test_a_failure_mid_checkpoint_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    """An error after the stores were snapshotted (here: writing optimizer.pt) leaves no
    dest and no temporary directory, and an older checkpoint being replaced stays whole.
    (SIGKILL at every point of a checkpoint: tests/store/test_reliability.py.)"""
    import adapters._torch_optim as topt

    emb = _fresh()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "opt")
    _run(opt, emb, 2, 0)
    opt.checkpoint(tmp_path / "old", extra={"model": emb.state_dict()})
    old = digest(tmp_path / "old")
    _run(opt, emb, 2, 2)
    real = topt._save_durably

    def crash(obj, path):
        if path.name == topt.CHECKPOINT_FILE:
            assert (path.parent / "group0_param0").is_dir()  # the stores are already there
            raise OSError(28, "No space left on device")
        real(obj, path)

    monkeypatch.setattr(topt, "_save_durably", crash)
    for dest, kw in ((tmp_path / "new", {}), (tmp_path / "old", {"overwrite": True})):
        with pytest.raises(OSError, match="No space left"):
            opt.checkpoint(dest, extra={"model": emb.state_dict()}, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "opt"]
    assert digest(tmp_path / "old") == old
    monkeypatch.setattr(topt, "_save_durably", real)
    opt.checkpoint(tmp_path / "old", overwrite=True)  # the optimizer is still usable
    assert torch.load(tmp_path / "old" / "optimizer.pt",
                      weights_only=True)[MANIFEST_KEY]["params"][0]["count"] == 4
    opt.close()


def _nan_grad(n, d, rows, bad_row):
    vals = torch.ones(len(rows), d)
    vals[rows.index(bad_row), 1] = float("nan")
    return torch.sparse_coo_tensor(torch.tensor([rows]), vals, (n, d), check_invariants=True)


def test_nonfinite_policies(tmp_path):
    n, d = 20, 4
    w0 = torch.randn(n, d, generator=torch.Generator().manual_seed(0))

    def one_step(policy, where):
        p = torch.nn.Parameter(w0.clone())
        kw = {} if policy is None else {"nonfinite": policy}
        opt = DiskSparseAdam([p], lr=0.1, state_dir=tmp_path / where, **kw)
        p.grad = _nan_grad(n, d, [2, 5, 7], 5)
        return p, opt

    # "propagate" (the default): NaN spreads into row 5, as torch.optim.SparseAdam does
    p, opt = one_step(None, "prop")
    ref = torch.nn.Parameter(w0.clone())
    ref.grad = p.grad.clone()
    torch.optim.SparseAdam([ref], lr=0.1).step()
    opt.step()
    assert torch.isnan(p[5]).any() and torch.allclose(p[[2, 7]], ref[[2, 7]])
    assert opt.store_for(p).nonfinite == "propagate"
    opt.close()
    # "skip_row": row 5 and its moments untouched, the others stepped
    p, opt = one_step("skip_row", "skip")
    opt.step()
    st = opt.store_for(p)
    assert torch.equal(p[5], w0[5]) and not st.exp_avg[5].any() and not st.exp_avg_sq[5].any()
    assert torch.allclose(p[[2, 7]], ref[[2, 7]]) and st.count == 1
    opt.close()
    assert dsa_core.open(tmp_path / "skip" / "group0_param0", mode="r").nonfinite == "skip_row"
    # "raise": FloatingPointError before any store is written (a good gradient on the first
    # parameter is not applied either)
    good = torch.nn.Parameter(w0.clone())
    bad = torch.nn.Parameter(w0.clone())
    opt = DiskSparseAdam([good, bad], lr=0.1, state_dir=tmp_path / "raise", nonfinite="raise")
    opt.flush()
    before = digest(tmp_path / "raise")
    good.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, d), (n, d),
                                        check_invariants=True)
    bad.grad = _nan_grad(n, d, [2, 5, 7], 5)
    with pytest.raises(FloatingPointError, match=r"parameter \[0, 1\] holds NaN or Inf for "
                                                 r"row\(s\) \[5\]; nothing was written"):
        opt.step()
    opt.flush()
    assert digest(tmp_path / "raise") == before
    assert torch.equal(good, w0) and torch.equal(bad, w0)
    assert opt.store_for(good).count == opt.store_for(bad).count == 0
    opt.close()
    # resumed: None keeps the store's policy, a value replaces it (recorded at the flush)
    p = torch.nn.Parameter(w0.clone())
    opt = DiskSparseAdam([p], state_dir=tmp_path / "skip", resume=True)
    assert opt.store_for(p).nonfinite == "skip_row"
    opt.close()
    opt = DiskSparseAdam([p], state_dir=tmp_path / "skip", resume=True, nonfinite="raise")
    assert opt.store_for(p).nonfinite == "raise"
    opt.close()
    assert dsa_core.open(tmp_path / "skip" / "group0_param0", mode="r").nonfinite == "raise"
    with pytest.raises(ValueError, match=r"^DiskSparseAdam: nonfinite must be one of"):
        DiskSparseAdam([p], state_dir=tmp_path / "x", nonfinite="ignore")
    assert not (tmp_path / "x").exists()


# -- weight decay and per-row step counts (docs/algorithms.md §7.1, §7.2) ------------------
@pytest.mark.parametrize("kw", [{"weight_decay": -0.1}, {"weight_decay": -1e-12},
                                {"weight_decay": float("nan")},
                                {"lr": -1.0, "weight_decay": -1.0},
                                {"betas": (0.9, 1.0), "weight_decay": -1.0},
                                {"eps": -1.0, "weight_decay": -1.0}])
def test_invalid_weight_decay_matches_torch_adam_word_for_word(tmp_path, kw):
    """torch.optim.Adam's message and order (lr, eps, betas, then weight_decay; lr and eps
    stay SparseAdam's: 0 is refused, where Adam accepts it)."""
    p = torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError) as want:
        torch.optim.Adam([p], **kw)
    with pytest.raises(ValueError) as got:
        DiskSparseAdam([p], **kw, state_dir=tmp_path / "opt")
    assert str(got.value) == str(want.value)
    assert not (tmp_path / "opt").exists()


def test_bad_weight_decay_options_write_nothing(tmp_path):
    p = torch.nn.Parameter(torch.zeros(4, 3))
    q = torch.nn.Parameter(torch.zeros(5, 3))
    # a group override is checked as the default is (torch's message), before any store
    with pytest.raises(ValueError, match=r"^Invalid weight_decay value: -0.5$"):
        DiskSparseAdam([{"params": [p]}, {"params": [q], "weight_decay": -0.5}],
                       state_dir=tmp_path / "opt")
    with pytest.raises(ValueError, match=r"Invalid weight_decay value: inf"):
        DiskSparseAdam([p], weight_decay=float("inf"), state_dir=tmp_path / "opt")
    with pytest.raises(TypeError, match="decoupled_weight_decay must be a bool"):
        DiskSparseAdam([p], weight_decay=0.1, decoupled_weight_decay="yes",
                       state_dir=tmp_path / "opt")
    with pytest.raises(TypeError, match="per_row_step must be a bool"):
        DiskSparseAdam([p], per_row_step=1, state_dir=tmp_path / "opt")
    # catching up missed decay is a form of decoupled decay
    with pytest.raises(ValueError, match=r"decay_missed_steps=True .* param group 1 .* "
                                         r"decoupled_weight_decay=False"):
        DiskSparseAdam([{"params": [p]}, {"params": [q], "decoupled_weight_decay": False}],
                       weight_decay=0.1, decoupled_weight_decay=True, decay_missed_steps=True,
                       state_dir=tmp_path / "opt")
    assert not (tmp_path / "opt").exists()
    # a group switched to L2 between steps: refused at the step, before any store is written
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), weight_decay=0.1, decoupled_weight_decay=True,
                         decay_missed_steps=True, state_dir=tmp_path / "ok")
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    opt.flush()
    before, w = digest(tmp_path / "ok"), emb.weight.detach().clone()
    opt.param_groups[0]["decoupled_weight_decay"] = False
    with pytest.raises(ValueError, match="decay_missed_steps=True"):
        opt.step()
    opt.param_groups[0]["decoupled_weight_decay"] = True
    opt.param_groups[0]["weight_decay"] = -1.0
    with pytest.raises(ValueError, match=r"^Invalid weight_decay value: -1.0$"):
        opt.step()
    assert digest(tmp_path / "ok") == before and torch.equal(emb.weight.detach(), w)
    opt.close()


def _dense_pair(dtype, seed=0, n=40, d=8):
    torch.manual_seed(seed)
    sparse = torch.nn.Embedding(n, d, sparse=True, dtype=dtype)
    dense = torch.nn.Embedding(n, d, sparse=False, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(sparse.weight)
    return sparse, dense


# Max |DiskSparseAdam - torch.optim.Adam/AdamW| over the weights of 100 steps, measured (L2 /
# AdamW), and the tolerance asserted, per (dtype, eps); see the test's docstring.
DENSE_TOL = {(torch.float64, 1e-8): 1e-6,     # measured 3.2e-7 / 2.2e-7: eps placement
             (torch.float64, 1e-16): 1e-13,   # measured 3.1e-15 / 2.2e-15: rounding
             (torch.float32, 1e-8): 2e-6}     # measured 3.6e-7 / 3.6e-7: 3 float32 ulps


@pytest.mark.parametrize(("dtype", "eps"), list(DENSE_TOL))
@pytest.mark.parametrize("decoupled", [False, True])
def test_every_row_every_step_is_dense_adam_with_weight_decay(tmp_path, dtype, eps, decoupled):
    """When every row is in every batch, lazy decay is dense decay: DiskSparseAdam with
    ``decoupled_weight_decay=True`` follows ``torch.optim.AdamW(weight_decay=wd)``, with
    False ``torch.optim.Adam(weight_decay=wd)`` (L2), on the same loss with an LR scheduler.

    The one difference is SparseAdam's placement of eps: DSA steps by
    ``lr / bc1 * m / (sqrt(v / bc2) + eps / sqrt(bc2))``, Adam by
    ``lr / bc1 * m / (sqrt(v / bc2) + eps)``: an eps larger by ``1 / sqrt(bc2)`` (31.6 at
    t = 1), so the steps differ by about ``lr * eps * (1 / sqrt(bc2) - 1) / sqrt(v_hat)``,
    most in the first steps and on coordinates with a small gradient. Measured over 100
    steps (n=40, d=8, lr=0.02 halved every 30 steps, wd=0.1), the max weight deviation is,
    L2 / AdamW: float64 with eps=1e-8 3.2e-7 / 2.2e-7, and it scales with eps (3.2e-11 /
    2.2e-11 at eps=1e-12), down to float64 rounding at eps=1e-16 (3.1e-15 / 2.2e-15): the
    eps placement is the whole difference. float32, eps=1e-8: 3.6e-7 / 3.6e-7 (3 ulps of
    weights ~1; the sparse and dense backward also sum duplicates in different orders).
    Asserted: 1e-6, 1e-13 and 2e-6 (``DENSE_TOL``), while the decay itself moves the
    weights by more than 1e-2 (checked, so a missing or doubled decay would be seen).
    """
    n, d, wd, steps = 40, 8, 0.1, 100
    tol = DENSE_TOL[(dtype, eps)]
    sparse, dense = _dense_pair(dtype)
    nodecay = copy.deepcopy(sparse)
    kw = {"lr": 0.02, "betas": (0.9, 0.999), "eps": eps}
    ref_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    o_ref = ref_cls(dense.parameters(), **kw, weight_decay=wd)
    o_dsk = DiskSparseAdam(sparse.parameters(), **kw, weight_decay=wd,
                           decoupled_weight_decay=decoupled, state_dir=tmp_path / "opt")
    o_nod = DiskSparseAdam(nodecay.parameters(), **kw, state_dir=tmp_path / "nodecay")
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=30, gamma=0.5)
              for o in (o_ref, o_dsk, o_nod)]
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(n, d, dtype=dtype, generator=gen)
    dev = 0.0
    for _ in range(steps):
        ids = torch.cat([torch.randperm(n, generator=gen),
                         torch.randint(0, n, (20,), generator=gen)])  # every row, + dups
        for emb, opt in ((dense, o_ref), (sparse, o_dsk), (nodecay, o_nod)):
            out = emb(ids)
            (((out - target[ids]) ** 2).sum() + out.sin().sum()).backward()
            opt.step()
            opt.zero_grad()
        for s in scheds:
            s.step()
        dev = max(dev, float((sparse.weight - dense.weight).detach().abs().max()))
    assert o_dsk.param_groups[0]["lr"] == o_ref.param_groups[0]["lr"] == 0.02 / 8
    assert dev < tol, dev
    st, ref = o_dsk.store_for(sparse.weight), o_ref.state[dense.weight]
    assert st.count == ref["step"] == steps
    assert st.weight_decay == wd and st.decoupled_weight_decay == decoupled
    np.testing.assert_allclose(st.exp_avg, ref["exp_avg"].numpy(), rtol=0, atol=10 * tol)
    np.testing.assert_allclose(st.exp_avg_sq, ref["exp_avg_sq"].numpy(), rtol=0,
                               atol=10 * tol)
    assert float((nodecay.weight - sparse.weight).detach().abs().max()) > 1e-2
    o_dsk.close()
    o_nod.close()


@pytest.mark.parametrize("opts", [
    {"weight_decay": 0.05},
    {"weight_decay": 0.05, "decoupled_weight_decay": True},
    {"weight_decay": 0.05, "decoupled_weight_decay": True, "decay_missed_steps": True},
    {"per_row_step": True},
    {"weight_decay": 0.05, "decoupled_weight_decay": True, "decay_missed_steps": True,
     "per_row_step": True, "maximize": True}])
@pytest.mark.parametrize("in_place", [True, False])
def test_adapter_steps_are_dsa_core_steps_with_the_options(tmp_path, opts, in_place):
    """Bit for bit ``dsa_core.step`` with the same options, through torch (coalesce, a
    schedule, rows that skip steps), on a CPU table updated in place and on one whose rows
    go out and back (a non-contiguous table: the path CUDA parameters take)."""
    n, d = 60, 6
    emb = torch.nn.Embedding(n, d, sparse=True)
    if not in_place:
        emb.weight = torch.nn.Parameter(emb.weight.detach().t().contiguous().t())
        assert not emb.weight.is_contiguous()
    init = emb.weight.detach().numpy().copy()
    layout = {k: opts.pop(k) for k in ("per_row_step", "decay_missed_steps") if k in opts}
    opt = DiskSparseAdam(emb.parameters(), lr=0.03, **opts, **layout,
                         state_dir=tmp_path / "opt")
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.97)
    ref = dsa_core.create(tmp_path / "ref", n, d, init=init, lr=0.03, **opts, **layout)
    gen = torch.Generator().manual_seed(5)
    for t in range(25):
        ids = batch(gen, 30 if t < 15 else n, b=12, dup=4)  # rows >= 30 first seen late
        ((emb(ids) - 0.5) ** 2).sum().backward()
        g = emb.weight.grad.coalesce()
        lr = opt.param_groups[0]["lr"]
        ref = dsa_core.step(ref, g.indices()[0].numpy(), g.values().numpy(), lr=lr)
        opt.step()
        opt.zero_grad()
        sched.step()
    st = opt.store_for(emb.weight)
    assert np.array_equal(emb.weight.detach().numpy(), ref.weights)
    assert np.array_equal(st.exp_avg, ref.exp_avg)
    assert np.array_equal(st.exp_avg_sq, ref.exp_avg_sq)
    if st.per_row_step:
        assert np.array_equal(st.row_steps, ref.row_steps)
        assert st.row_steps[4] == 25 and 0 < st.row_steps[40:].max() < 10  # hub, late rows
    if st.decay_missed_steps:
        assert np.array_equal(st.last_steps, ref.last_steps)
    opt.close()
    dsa_core.close(ref)


def test_per_row_step_gives_a_late_row_a_fresh_first_step(tmp_path):
    """A row first seen at step 51 moves by ~lr * sign(g) with per_row_step=True (a fresh
    Adam's first step: m_hat = g, v_hat = g^2); with the global count it moves by
    lr * (1 - b1) / (1 - b1^51) * sqrt(1 - b2^51) / sqrt(1 - b2) = 0.709 lr."""
    lr, late = 0.01, 20
    moves = {}
    for per_row in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(30, 4, sparse=True)
        with torch.no_grad():  # |g| = 2|w| far above eps: the first step is lr * g / |g|
            emb.weight[late] = torch.tensor([0.5, -0.3, 0.2, -0.7])
        opt = DiskSparseAdam(emb.parameters(), lr=lr, per_row_step=per_row,
                             state_dir=tmp_path / f"opt{per_row}")
        for _ in range(50):
            emb(torch.tensor([0, 1, 2])).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        before = emb.weight.detach()[late].clone()
        emb(torch.tensor([0, late])).pow(2).sum().backward()
        g = emb.weight.grad.coalesce().to_dense()[late]
        opt.step()
        moves[per_row] = (emb.weight.detach()[late] - before) / (-lr * torch.sign(g))
        st = opt.store_for(emb.weight)
        assert st.count == opt.state[emb.weight]["step"] == 51  # the global count stays
        if per_row:
            assert st.row_steps[[0, 1, 2, late, 3]].tolist() == [51, 50, 50, 1, 0]
        opt.close()
    np.testing.assert_allclose(moves[True], 1.0, rtol=1e-5)
    np.testing.assert_allclose(moves[False], 0.7089, rtol=1e-3)


def test_row_options_are_fixed_per_store_and_checked_on_resume(tmp_path):
    """A resumed store, a state dict or a checkpoint with other per-row options is refused,
    naming both values, with nothing written; the same options resume bit-exactly."""
    def build(**kw):
        torch.manual_seed(1)
        emb = torch.nn.Embedding(50, 4, sparse=True)
        return emb, kw

    def train(emb, opt, t0, t1):
        for t in range(t0, t1):
            gen = torch.Generator().manual_seed(t)
            ((emb(batch(gen, 50, b=10)) - 0.2) ** 2).sum().backward()
            opt.step()
            opt.zero_grad()

    opts = {"weight_decay": 0.1, "decoupled_weight_decay": True, "per_row_step": True,
            "decay_missed_steps": True}
    emb, _ = build()
    opt = DiskSparseAdam(emb.parameters(), lr=0.02, **opts, state_dir=tmp_path / "opt")
    train(emb, opt, 0, 4)
    sd = opt.state_dict()
    g0 = sd["param_groups"][0]
    assert (g0["weight_decay"], g0["decoupled_weight_decay"]) == (0.1, True)
    e = sd[MANIFEST_KEY]["params"][0]
    assert (e["per_row_step"], e["decay_missed_steps"]) == (True, True)
    assert e["hparams"]["weight_decay"] == 0.1 and e["hparams"]["decoupled_weight_decay"]
    opt.checkpoint(tmp_path / "ck", extra={"model": emb.state_dict()})
    w_ck = emb.weight.detach().clone()
    train(emb, opt, 4, 8)  # the uninterrupted run
    w_end = emb.weight.detach().clone()
    opt.close()
    before = digest(tmp_path / "opt")
    for other, msg in (({"per_row_step": False}, r"per_row_step=True, but per_row_step=False"),
                       ({"decay_missed_steps": False},
                        r"decay_missed_steps=True, but decay_missed_steps=False")):
        with pytest.raises(ValueError, match=msg):
            DiskSparseAdam(emb.parameters(), lr=0.02, **{**opts, **other},
                           state_dir=tmp_path / "opt", resume=True)
    assert digest(tmp_path / "opt") == before
    # the checkpoint into an optimizer whose stores lack the options: refused, nothing written
    plain = DiskSparseAdam(emb.parameters(), lr=0.02, state_dir=tmp_path / "plain")
    plain.flush()
    before_plain = digest(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"created with per_row_step=True, decay_missed_steps="
                                         r"True, but .* per_row_step=False, "
                                         r"decay_missed_steps=False"):
        plain.load_checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError, match="per_row_step"):
        plain.load_state_dict(sd)
    assert digest(tmp_path / "plain") == before_plain
    plain.close()
    # the same options: resume from the checkpoint, bit for bit the uninterrupted run
    emb2, _ = build()
    opt2 = DiskSparseAdam(emb2.parameters(), lr=0.0123, **opts, state_dir=tmp_path / "opt2")
    extra = opt2.load_checkpoint(tmp_path / "ck")
    emb2.load_state_dict(extra["model"])
    assert torch.equal(emb2.weight.detach(), w_ck)
    assert opt2.param_groups[0]["lr"] == 0.02 and opt2.param_groups[0]["weight_decay"] == 0.1
    train(emb2, opt2, 4, 8)
    assert torch.equal(emb2.weight.detach(), w_end)
    opt2.close()
    # and through resume=True on the live stores (weights from the model as it was)
    opt3 = DiskSparseAdam(emb.parameters(), lr=0.02, **opts, state_dir=tmp_path / "opt",
                          resume=True)
    assert opt3.store_for(emb.weight).count == 8 and opt3.store_for(emb.weight).per_row_step
    opt3.close()


def test_weight_decay_is_a_param_group_hyperparameter(tmp_path):
    """Per-group values (an override, a change between steps) reach each store's State and
    its manifest; a torch.optim.SparseAdam state dict (no weight_decay) keeps this
    optimizer's values when it is imported."""
    a = torch.nn.Embedding(20, 4, sparse=True)
    b = torch.nn.Embedding(30, 4, sparse=True)
    opt = DiskSparseAdam([{"params": [a.weight]},
                          {"params": [b.weight], "weight_decay": 0.3,
                           "decoupled_weight_decay": True}],
                         lr=0.01, weight_decay=0.01, state_dir=tmp_path / "opt")
    for _ in range(2):
        (a(torch.tensor([1, 2])).sum() + b(torch.tensor([3])).sum()).backward()
        opt.step()
        opt.zero_grad()
    sa, sb = opt.store_for(a.weight), opt.store_for(b.weight)
    assert (sa.weight_decay, sa.decoupled_weight_decay) == (0.01, False)
    assert (sb.weight_decay, sb.decoupled_weight_decay) == (0.3, True)
    opt.param_groups[0]["weight_decay"] = 0.02
    (a(torch.tensor([1])).sum() + b(torch.tensor([3])).sum()).backward()
    opt.step()
    opt.flush()
    snap = dsa_core.open(tmp_path / "opt" / "group0_param0", mode="r")
    assert snap.weight_decay == 0.02 and not snap.decoupled_weight_decay
    dsa_core.close(snap)
    opt.close()
    # a SparseAdam state dict: moments imported, weight decay kept
    ref = torch.nn.Embedding(20, 4, sparse=True)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=0.01)
    ref(torch.tensor([1, 5])).sum().backward()
    o_ref.step()
    sd_ref = o_ref.state_dict()
    assert "weight_decay" not in sd_ref["param_groups"][0]
    dsk = copy.deepcopy(ref)
    o = DiskSparseAdam(dsk.parameters(), lr=0.5, weight_decay=0.2,
                       decoupled_weight_decay=True, decay_missed_steps=True,
                       state_dir=tmp_path / "imp")
    o.load_state_dict(sd_ref)
    g = o.param_groups[0]
    assert (g["lr"], g["weight_decay"], g["decoupled_weight_decay"]) == (0.01, 0.2, True)
    st = o.store_for(dsk.weight)
    assert st.count == 1 and np.array_equal(st.exp_avg, o_ref.state[ref.weight]["exp_avg"])
    assert (st.last_steps == 1).all()  # SparseAdam decayed nothing: no decay missed so far
    o.close()
    # ... but one global step cannot give each row its own count
    o = DiskSparseAdam(dsk.parameters(), per_row_step=True, state_dir=tmp_path / "prs")
    o.flush()
    before = digest(tmp_path / "prs")
    with pytest.raises(ValueError, match="per_row_step=True.* only one global step"):
        o.load_state_dict(sd_ref)
    assert digest(tmp_path / "prs") == before and o.store_for(dsk.weight).count == 0
    o.close()


def test_disk_embedding_row_options_meet_the_optimizer(tmp_path):
    """The module owns the store (and so the per-row options); the optimizer owns the decay."""
    from adapters.torch import DiskEmbedding

    emb = DiskEmbedding(40, 4, state_dir=tmp_path / "emb", seed=0, per_row_step=True,
                        decay_missed_steps=True)
    assert emb.store.per_row_step and emb.store.decay_missed_steps
    with pytest.raises(ValueError, match=r"was created with per_row_step=True, but this "
                                         r"optimizer asks for per_row_step=False"):
        DiskSparseAdam(emb.parameters(), per_row_step=False, weight_decay=0.1,
                       decoupled_weight_decay=True)
    with pytest.raises(ValueError, match=r"decay_missed_steps=True.*decoupled_weight_decay="
                                         r"False"):
        DiskSparseAdam(emb.parameters(), weight_decay=0.1)
    opt = DiskSparseAdam(emb.parameters(), lr=0.05, weight_decay=0.1,
                         decoupled_weight_decay=True)  # options: the store's
    ref = dsa_core.create(tmp_path / "ref", 40, 4, init=emb.store.weights.copy(), lr=0.05,
                          weight_decay=0.1, decoupled_weight_decay=True, per_row_step=True,
                          decay_missed_steps=True)
    for t in range(6):
        ids = torch.tensor([1, 2, 2] if t % 3 else [1, 9])
        rows = torch.from_numpy(dsa_core.gather(ref, ids.numpy())).requires_grad_(True)
        (rows ** 2).sum().backward()
        ref = dsa_core.step(ref, ids.numpy(), rows.grad.numpy())
        (emb(ids) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    assert np.array_equal(emb.store.weights, ref.weights)
    assert np.array_equal(emb.store.row_steps, ref.row_steps)
    assert emb.store.weight_decay == 0.1 and emb.store.decoupled_weight_decay
    opt.close()
    emb.close()
    dsa_core.close(ref)
