"""The DSA article's code, unchanged but for its import line, on adapters.torch.

The article's two loops at small size: the quick start (rows read through
``state_files["emb"]["w"][idx].copy()``, loss in torch, ``step(updates=...)``) and the
benchmark loop (random init, batch 2048, loss = mean(w**2)). Results must equal dsa_core used
directly, bit for bit; no read is stale and no update is dropped.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from adapters.torch import DiskSparseRiemannianAdam, StoreLockedError
from dsa_core import _layout, _reference
from helpers import digest, records


def same_store(state_files, ref: dsa_core.State):
    assert np.array_equal(state_files["w"], ref.weights)
    assert np.array_equal(state_files["m"], ref.exp_avg)
    assert np.array_equal(state_files["v"], np.broadcast_to(ref.exp_avg_sq,
                                                            state_files["v"].shape))


@pytest.mark.parametrize("k", [0.0, 1.0])
def test_quick_start_loop(tmp_path, k):
    """The article's quick start over an nn.Embedding table; equals dsa_core (and torch)."""
    torch.manual_seed(0)
    num_entities, embedding_dim = 1000, 16
    emb = torch.nn.Embedding(num_entities, embedding_dim)
    if k:
        with torch.no_grad():
            emb.weight.mul_(0.05)  # inside the unit ball
    init = emb.weight.detach().numpy().copy()

    # --- the article's code (only the import differs) ---
    optimizer = DiskSparseRiemannianAdam(
        params={"emb": emb.weight}, lr=0.01, k=k, disk_dir=str(tmp_path / "opt_cache"),
        max_queue_size=300)
    ref = dsa_core.create(tmp_path / "ref", num_entities, embedding_dim, curvature=k,
                          init=init, lr=0.01)
    target = torch.randn(embedding_dim) * 0.1
    for _ in range(30):
        batch_indices = torch.randint(0, num_entities, (64,))
        batch_indices[:6] = 7  # a hub row, several times in the batch
        idx_np = batch_indices.numpy()
        weights_np = optimizer.state_files["emb"]["w"][idx_np].copy()
        current_weights = torch.from_numpy(weights_np).requires_grad_(True)
        loss = ((current_weights - target) ** 2).sum()
        loss.backward()
        optimizer.step(updates={"emb": (batch_indices, current_weights.grad)})
        # --- dsa_core used directly, on the same rows and gradients ---
        rows = torch.from_numpy(dsa_core.gather(ref, idx_np)).requires_grad_(True)
        ((rows - target) ** 2).sum().backward()
        ref = dsa_core.step(ref, idx_np, rows.grad.numpy())
    same_store(optimizer.state_files["emb"], ref)
    assert optimizer.store("emb").count == ref.count == 30
    optimizer.shutdown(timeout=2.0)
    dsa_core.close(ref)


def test_quick_start_k0_is_torch_sparse_adam(tmp_path):
    torch.manual_seed(1)
    emb = torch.nn.Embedding(300, 16, sparse=True)
    optimizer = DiskSparseRiemannianAdam(params={"emb": emb.weight}, lr=0.01, k=0.0,
                                         disk_dir=tmp_path)
    opt_ref = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    for _ in range(25):
        idx = torch.randint(0, 300, (50,))
        w = torch.from_numpy(optimizer.state_files["emb"]["w"][idx.numpy()].copy())
        w.requires_grad_(True)
        (w.sin() * w).sum().backward()
        optimizer.step(updates={"emb": (idx, w.grad)})
        (emb(idx).sin() * emb(idx)).sum().backward()
        opt_ref.step()
        opt_ref.zero_grad()
    tol = {"rtol": 1e-5, "atol": 3e-6}
    np.testing.assert_allclose(optimizer.state_files["emb"]["w"], emb.weight.detach(), **tol)
    np.testing.assert_allclose(optimizer.state_files["emb"]["m"],
                               opt_ref.state[emb.weight]["exp_avg"], **tol)
    np.testing.assert_allclose(optimizer.state_files["emb"]["v"],
                               opt_ref.state[emb.weight]["exp_avg_sq"], **tol)
    optimizer.shutdown()


@pytest.mark.parametrize("k", [0.0, 1.0])
def test_benchmark_loop(tmp_path, k):
    """The article's benchmark (1M x 128 there, 20k x 128 here), batch 2048, mean(w**2)."""
    num_nodes, dim, batch_size, steps = 20_000, 128, 2048, 5
    torch.manual_seed(2)
    init = torch.randn(num_nodes, dim) * (0.005 if k else 1.0)
    optimizer = DiskSparseRiemannianAdam(params={"emb": init}, lr=0.001, k=k,
                                         disk_dir=tmp_path / "cache")
    ref = dsa_core.create(tmp_path / "ref", num_nodes, dim, curvature=k, init=init.numpy(),
                          lr=0.001)
    for _ in range(steps):
        idx = torch.randint(0, num_nodes, (batch_size,))
        w = torch.from_numpy(optimizer.state_files["emb"]["w"][idx.numpy()].copy())
        w.requires_grad_(True)
        loss = torch.mean(w ** 2)
        loss.backward()
        optimizer.step(updates={"emb": (idx, w.grad)})
        r = torch.from_numpy(dsa_core.gather(ref, idx.numpy())).requires_grad_(True)
        torch.mean(r ** 2).backward()
        ref = dsa_core.step(ref, idx.numpy(), r.grad.numpy())
    same_store(optimizer.state_files["emb"], ref)
    assert optimizer.state_files["emb"]["v"].shape == (num_nodes, dim)
    optimizer.shutdown()
    dsa_core.close(ref)


def test_reads_are_never_stale_and_no_update_is_dropped(tmp_path):
    """Back-to-back steps on the same rows, each reading what the previous one wrote."""
    n, d, steps = 50, 8, 400
    rng = np.random.default_rng(3)
    P = rng.standard_normal((n, d), dtype=np.float32)
    M, V = np.zeros_like(P), np.zeros_like(P)
    optimizer = DiskSparseRiemannianAdam(params={"emb": P.copy()}, lr=0.01, k=0.0,
                                         disk_dir=tmp_path, max_queue_size=1)
    w = optimizer.state_files["emb"]["w"]
    for t in range(1, steps + 1):
        idx = np.concatenate([[0, 0], rng.integers(0, n, 3)])  # row 0 in every step
        rows = w[idx].copy()
        assert np.array_equal(rows, P[idx])  # the read sees every earlier step's write
        g = (rows * 2.0 - 1.0).astype(np.float32)  # the gradient depends on what was read
        optimizer.step(updates={"emb": (idx, g)})
        _reference.euclid_step(P, M, V, idx, g, t, lr=0.01)  # the NumPy oracle, in RAM
    assert optimizer.store("emb").count == steps
    assert np.array_equal(w, P)
    assert np.array_equal(optimizer.state_files["emb"]["m"], M)
    assert np.array_equal(optimizer.state_files["emb"]["v"], V)
    optimizer.shutdown()
    assert dsa_core.open(tmp_path / "emb", mode="r").count == steps  # durable


def test_inputs_numpy_int32_float64_and_duplicates(tmp_path):
    init = np.arange(40, dtype=np.float32).reshape(10, 4) / 40
    a = DiskSparseRiemannianAdam({"emb": init}, lr=0.1, disk_dir=tmp_path / "a")
    b = DiskSparseRiemannianAdam({"emb": torch.from_numpy(init)}, lr=0.1,
                                 disk_dir=tmp_path / "b")
    g = np.ones((3, 4))
    a.step(updates={"emb": (np.array([2, 5, 2], np.int32), g)})                   # numpy
    b.step(updates={"emb": (torch.tensor([2, 5]), torch.tensor([[2.0] * 4, [1.0] * 4]))})
    same_store(a.state_files["emb"], b.store("emb"))  # duplicates summed
    assert a.state_files["emb"]["w"].dtype == np.float32
    a.shutdown()
    b.shutdown()


def test_bad_updates_write_nothing(tmp_path):
    opt = DiskSparseRiemannianAdam({"a": torch.zeros(10, 4), "b": torch.zeros(20, 4)},
                                   lr=0.1, disk_dir=tmp_path)
    opt.step(updates={"a": (torch.tensor([1]), torch.ones(1, 4))})
    opt.flush()
    before = digest(tmp_path)
    good = (torch.tensor([1, 2]), torch.ones(2, 4))
    for bad, exc, match in (
            ({"c": good}, KeyError, "does not have"),
            ({"b": (torch.tensor([1, 20]), torch.ones(2, 4))}, IndexError, r"\[0, 20\)"),
            ({"b": (torch.tensor([1, 2]), torch.ones(2, 5))}, ValueError, r"\(2, 4\)"),
            ({"b": (torch.tensor([1.0]), torch.ones(1, 4))}, TypeError, "integers")):
        with pytest.raises(exc, match=match):
            opt.step(updates={"a": good, **bad})  # the good table is not written either
    opt.flush()
    assert digest(tmp_path) == before
    assert opt.store("a").count == 1
    opt.shutdown()


def test_shutdown_flushes_and_is_final(tmp_path):
    opt = DiskSparseRiemannianAdam({"emb": torch.zeros(10, 4)}, lr=0.1, disk_dir=tmp_path)
    opt.step(updates={"emb": (torch.tensor([3]), torch.ones(1, 4))})
    opt.shutdown(timeout=1.0)
    opt.shutdown()  # safe twice
    assert dsa_core.open(tmp_path / "emb", mode="r").count == 1
    with pytest.raises(RuntimeError, match="shut down"):
        opt.step(updates={"emb": (torch.tensor([3]), torch.ones(1, 4))})
    with pytest.raises(RuntimeError, match="shut down"):
        opt.state_dict()
    w = opt.state_files["emb"]["w"]
    assert w[3].copy().tolist() == pytest.approx([-0.1] * 4)  # still readable...
    with pytest.raises(ValueError, match="read-only"):
        w[3] = 0.0                                           # ...never writable


def test_resume_lock_scheduler_and_options(tmp_path):
    init = torch.randn(30, 4)
    opt = DiskSparseRiemannianAdam({"emb": init}, lr=0.1, disk_dir=tmp_path)
    assert isinstance(opt, torch.optim.Optimizer)
    with pytest.raises(StoreLockedError):
        DiskSparseRiemannianAdam({"emb": init}, disk_dir=tmp_path)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = dsa_core.create(tmp_path / "ref", 30, 4, init=init.numpy())
    for t in range(4):
        idx, g = torch.tensor([1, 2, t]), torch.randn(3, 4)
        opt.step(updates={"emb": (idx, g)})
        ref = dsa_core.step(ref, idx.numpy(), g.numpy(), lr=0.1 * 0.5 ** t)
        sched.step()
    sd = opt.state_dict()
    opt.shutdown()
    with pytest.warns(UserWarning, match=r"reopened .* the initial values given in "
                                         r"params\['emb'\] are ignored"):
        resumed = DiskSparseRiemannianAdam({"emb": torch.zeros(30, 4)}, lr=0.1,
                                           disk_dir=tmp_path)
    resumed.load_state_dict(sd)
    assert resumed.param_groups[0]["lr"] == 0.1 * 0.5 ** 4
    assert resumed.store("emb").count == 4
    idx, g = torch.tensor([5, 2]), torch.randn(2, 4)
    resumed.step(updates={"emb": (idx, g)})
    ref = dsa_core.step(ref, idx.numpy(), g.numpy(), lr=0.1 * 0.5 ** 4)
    same_store(resumed.state_files["emb"], ref)
    with pytest.raises(ValueError, match="current_k"):
        resumed.step(updates={"emb": (idx, g)}, current_k=1.0)
    resumed.shutdown()
    dsa_core.close(ref)
    for wd in (-0.01, float("nan")):  # torch.optim.Adam's message
        with pytest.raises(ValueError, match=rf"^Invalid weight_decay value: {wd}$"):
            DiskSparseRiemannianAdam({"x": init}, weight_decay=wd, disk_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="Invalid learning rate"):
        DiskSparseRiemannianAdam({"x": init}, lr=0.0, disk_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="inside the Poincaré ball"):
        DiskSparseRiemannianAdam({"x": init * 10}, k=1.0, disk_dir=tmp_path / "x")
    with pytest.raises(ValueError, match="plain file name"):
        DiskSparseRiemannianAdam({"a/b": init}, disk_dir=tmp_path / "x")
    assert not (tmp_path / "x" / "x").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grads(tmp_path):
    init = torch.randn(100, 8)
    opt = DiskSparseRiemannianAdam({"emb": init.cuda()}, lr=0.01, disk_dir=tmp_path / "a")
    ref = dsa_core.create(tmp_path / "ref", 100, 8, init=init.numpy(), lr=0.01)
    for _ in range(5):
        idx = torch.randint(0, 100, (16,), device="cuda")
        w = torch.from_numpy(opt.state_files["emb"]["w"][idx.cpu().numpy()].copy()).cuda()
        w.requires_grad_(True)
        (w ** 2).mean().backward()
        opt.step(updates={"emb": (idx, w.grad)})
        ref = dsa_core.step(ref, idx.cpu().numpy(), w.grad.cpu().numpy())
    same_store(opt.state_files["emb"], ref)
    opt.shutdown()


def test_reopen_warns_and_an_older_state_dict_is_refused(tmp_path):
    """The article's behaviour stays (an existing store is reopened and the given table
    ignored), but it is said; a state dict the store has moved past is refused."""
    init = torch.randn(30, 4)
    opt = DiskSparseRiemannianAdam({"emb": init}, lr=0.1, disk_dir=tmp_path)
    opt.step(updates={"emb": (torch.tensor([1, 2]), torch.ones(2, 4))})
    sd = opt.state_dict()
    opt.step(updates={"emb": (torch.tensor([3]), torch.ones(1, 4))})
    w = opt.state_files["emb"]["w"].copy()
    opt.shutdown()
    with pytest.warns(UserWarning, match=r"DiskSparseRiemannianAdam\['emb'\]: .* already holds "
                                         r"this table \(30 x 4 float32, trained 2 steps\); it "
                                         r"is reopened"):
        opt = DiskSparseRiemannianAdam({"emb": torch.zeros(30, 4)}, lr=0.1, disk_dir=tmp_path)
    assert np.array_equal(opt.state_files["emb"]["w"], w)
    before = digest(tmp_path)
    with pytest.raises(ValueError, match=r"taken at step 1 of table 'emb', but its store .* "
                                         r"is at step 2.*nothing was changed"):
        opt.load_state_dict(sd)
    assert opt.store("emb").count == 2
    opt.load_state_dict(opt.state_dict())  # the state as it is loads
    opt.shutdown()
    assert digest(tmp_path) == before


# -- weight decay: the article's argument, with geoopt RiemannianAdam's meaning (L2) ---------
@pytest.mark.parametrize("k", [0.0, 1.0])
def test_weight_decay_is_l2_as_in_dsa_core(tmp_path, k):
    """``weight_decay`` is L2 (``g + wd * w`` before the step; on the ball before
    egrad2rgrad): bit for bit dsa_core with ``weight_decay=wd`` and
    ``decoupled_weight_decay=False``, duplicates decaying a row once, through a schedule
    and a change of the group's weight_decay."""
    torch.manual_seed(3)
    init = torch.randn(200, 8) * (0.05 if k else 1.0)
    opt = DiskSparseRiemannianAdam({"emb": init}, lr=0.01, k=k, weight_decay=0.3,
                                   disk_dir=tmp_path / "cache")
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    ref = dsa_core.create(tmp_path / "ref", 200, 8, curvature=k, init=init.numpy(), lr=0.01,
                          weight_decay=0.3)
    for t in range(12):
        if t == 6:
            opt.param_groups[0]["weight_decay"] = 0.1
            ref = ref._replace(weight_decay=0.1)
        idx = torch.randint(0, 200, (40,))
        idx[:4] = 9
        w = torch.from_numpy(opt.state_files["emb"]["w"][idx.numpy()].copy())
        w.requires_grad_(True)
        (w.sin() * w).sum().backward()
        opt.step(updates={"emb": (idx, w.grad)})
        ref = dsa_core.step(ref, idx.numpy(), w.grad.numpy(), lr=0.01 * 0.9 ** t)
        sched.step()
    same_store(opt.state_files["emb"], ref)
    st = opt.store("emb")
    assert st.weight_decay == 0.1 and not st.decoupled_weight_decay
    opt.shutdown()
    assert dsa_core.open(tmp_path / "cache" / "emb", mode="r").weight_decay == 0.1
    dsa_core.close(ref)


def test_weight_decay_on_the_ball_follows_geoopt_riemannian_adam(tmp_path):
    """When every row is in every step, the article's optimizer with ``k=1`` and
    ``weight_decay`` follows geoopt's dense ``RiemannianAdam(weight_decay=)`` on a
    PoincareBall parameter (the same formulas on all rows: same eps placement, L2 added to
    the Euclidean gradient before egrad2rgrad), in float64. Measured max deviation over 60
    steps: 1.1e-16 on the points (the points move by 0.24); asserted 1e-12."""
    geoopt = pytest.importorskip("geoopt")
    n, d, wd = 30, 5, 0.5
    torch.manual_seed(4)
    init = (torch.randn(n, d, dtype=torch.float64) * 0.2)
    ball = geoopt.PoincareBall(c=1.0)
    x = geoopt.ManifoldParameter(init.clone(), manifold=ball)
    ref = geoopt.optim.RiemannianAdam([x], lr=0.01, weight_decay=wd, eps=1e-8)
    opt = DiskSparseRiemannianAdam({"emb": init}, lr=0.01, k=1.0, weight_decay=wd, eps=1e-8,
                                   disk_dir=tmp_path)
    target = torch.randn(n, d, dtype=torch.float64) * 0.3
    idx = torch.arange(n)
    dev = 0.0
    for _ in range(60):
        w = torch.from_numpy(opt.state_files["emb"]["w"].copy()).requires_grad_(True)
        ((w - target) ** 2).sum().backward()
        opt.step(updates={"emb": (idx, w.grad)})
        ref.zero_grad()
        ((x - target) ** 2).sum().backward()
        ref.step()
        dev = max(dev, float(np.abs(opt.state_files["emb"]["w"] - x.detach().numpy()).max()))
    assert dev < 1e-12, dev
    moved = float(np.abs(opt.state_files["emb"]["w"] - init.numpy()).max())
    assert moved > 1e-2  # the comparison is not vacuous
    opt.shutdown()


# -- both store kinds ------------------------------------------------------------------------------
# (was test_article_log.py) The article's loop reads rows through
# ``optimizer.state_files["emb"]["w"][idx]``; on a log store that is a ``RowView`` which reads
# the rows asked for. Training must be bit-identical to the in-place adapter, and the views
# must index exactly as the in-place numpy views do: these tests compare the two kinds side by
# side, so they build both themselves.
N, D = 400, 16
SLOTS = 80  # region slots of each log store: a batch has at most 64 distinct rows


def log_region(dtype=np.float32, curvature: float = 0.0) -> int:
    lay = _layout.make_layout(N, D, np.dtype(dtype), curvature, True, 0)
    return dsa_core.region_memory(lay, SLOTS)


def article_loop(optimizer, steps: int, seed: int = 0, wd_from: int | None = None) -> None:
    """The article's quick start: read rows, loss in torch, hand back the gradients."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(D, generator=gen) * 0.1
    for t in range(steps):
        batch_indices = torch.randint(0, N, (64,), generator=gen)
        batch_indices[:6] = 7  # a hub row, several times in the batch
        w = optimizer.state_files["emb"]["w"][batch_indices.numpy()].copy()
        current_weights = torch.from_numpy(w).requires_grad_(True)
        ((current_weights - target) ** 2).sum().backward()
        if wd_from is not None and t == wd_from:
            optimizer.param_groups[0]["weight_decay"] = 0.01  # read at every step
        optimizer.step(updates={"emb": (batch_indices, current_weights.grad)})


def pair(tmp_path: Path, k: float, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    table = (torch.randn(N, D, generator=gen, dtype=dtype) * (0.05 if k else 1.0))
    mem = log_region(np.float64 if dtype == torch.float64 else np.float32, k)
    return {kind: DiskSparseRiemannianAdam(params={"emb": table}, lr=0.01, k=k,
                                           disk_dir=str(tmp_path / kind), **kw)
            for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem}))}


def opt_records(opt) -> np.ndarray:
    return records(opt.store("emb"))


@pytest.mark.parametrize("k, dtype", [(0.0, torch.float32), (1.0, torch.float32),
                                      (1.0, torch.float64)])
def test_article_loop_on_log_matches_inplace(tmp_path, k, dtype):
    opts = pair(tmp_path, k, dtype)
    for opt in opts.values():
        article_loop(opt, 30, wd_from=20)
    a, b = opts["inplace"], opts["log"]
    st = b.store("emb")
    assert st.storage == "log" and st.count == a.store("emb").count == 30
    eng = st.store.log_stats()
    assert eng["segments"] > 0 and eng["slots"] < N  # rows were evicted and read back
    np.testing.assert_array_equal(opt_records(a).view(np.uint8), opt_records(b).view(np.uint8))
    for part in "wmv":  # the views: every row, read in chunks
        for lo in range(0, N, 150):
            np.testing.assert_array_equal(b.state_files["emb"][part][lo:lo + 150],
                                          a.state_files["emb"][part][lo:lo + 150])
    for opt in opts.values():
        opt.shutdown()


KEYS = [
    3, -1, np.int64(17), [5, 2, 5, -3], np.array([[1, 2], [399, 0]]), torch.tensor([9, 4, 9]),
    slice(None, 10), slice(395, None), slice(None, None, -97), slice(10, 3),
    (np.arange(N) % 7 == 0), ([4, 1, 4], 2), ([4, 1, 4], slice(3, 9)), (slice(2, 6), -1),
    ([4, 1], [0, 15]), (np.array([[3], [8]]), np.array([0, 1, 2])), (7, slice(None, 4)),
    ([2, 3], ...), np.array([], np.int64),
]


@pytest.mark.parametrize("k", [0.0, 1.0])
def test_state_files_index_as_the_numpy_views(tmp_path, k):
    """A log store's state_files index exactly as the in-place numpy views (v of the ball
    broadcast over the columns included); bad indices raise the same error types."""
    opts = pair(tmp_path, k)
    for opt in opts.values():
        article_loop(opt, 8)
    a, b = (opts[kind].state_files["emb"] for kind in ("inplace", "log"))
    for part in "wmv":
        va, vb = a[part], b[part]
        assert (vb.shape, vb.dtype, len(vb), vb.ndim, vb.size) == \
            (va.shape, va.dtype, len(va), va.ndim, va.size)
        for key in KEYS:
            np_key = key.numpy() if isinstance(key, torch.Tensor) else key
            got, want = vb[key], va[np_key]
            assert np.shape(got) == np.shape(want), (part, key)
            np.testing.assert_array_equal(got, want)
        for bad, exc in ((N, IndexError), (-N - 1, IndexError), ([1, N], IndexError),
                         (np.array([0.5]), IndexError), (np.ones(3, bool), IndexError),
                         (([1, 2], 16), IndexError)):
            with pytest.raises(exc):
                va[bad]
            with pytest.raises(exc):
                vb[bad]
    for opt in opts.values():
        opt.shutdown()


def test_state_files_of_a_log_store_refuse_writes_and_whole_arrays(tmp_path):
    opt = pair(tmp_path, 0.0)["log"]
    w = opt.state_files["emb"]["w"]
    rows = w[[1, 2]]
    rows[:] = 5.0  # a copy: nothing changes in the store
    assert not (w[[1, 2]] == 5.0).any()
    before = digest(tmp_path / "log")
    with pytest.raises(ValueError, match="read-only: rows change only through the "
                                         "optimizer's step"):
        w[1] = 0.0
    with pytest.raises(TypeError, match=r"reads rows on indexing .* view\[lo:hi\]"):
        np.asarray(w)
    with pytest.raises(IndexError, match="whole table"):
        w[...]
    assert "read on indexing" in repr(w)
    assert digest(tmp_path / "log") == before
    opt.shutdown()
    with pytest.raises(ValueError, match="is closed"):  # the store is closed: reads raise
        w[[1]]
    pair(tmp_path / "other", 0.0)["inplace"].shutdown()


def test_resume_state_dict_and_refusals_on_log(tmp_path):
    """A log disk_dir reopens (with a warning) and resumes as in place; a store of the
    other kind and bad storage options are refused, nothing written."""
    opts = pair(tmp_path, 1.0)
    for opt in opts.values():
        article_loop(opt, 10)
        sd = opt.state_dict()
        opt.shutdown()
    assert sd["dsa_manifest"]["tables"]["emb"]["count"] == 10
    table = torch.zeros(N, D)
    mem = log_region(curvature=1.0)
    resumed = {}
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        with pytest.warns(UserWarning, match="reopened and training resumes"):
            opt = DiskSparseRiemannianAdam(params={"emb": table}, lr=0.01, k=1.0,
                                           disk_dir=str(tmp_path / kind), **kw)
        if kind == "log":
            opt.load_state_dict(sd)
        assert opt.store("emb").count == 10 and opt.store("emb").storage == kind
        article_loop(opt, 5, seed=3)
        resumed[kind] = opt_records(opt)
        opt.shutdown()
    np.testing.assert_array_equal(resumed["inplace"].view(np.uint8),
                                  resumed["log"].view(np.uint8))
    before = {k: digest(tmp_path / k) for k in ("inplace", "log")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any reopen warning
        with pytest.raises(ValueError, match=r"DiskSparseRiemannianAdam\['emb'\]: the existing "
                                             r"store .* is a storage='log' store, but "
                                             r"storage='inplace'"):
            DiskSparseRiemannianAdam(params={"emb": table}, k=1.0,
                                     disk_dir=str(tmp_path / "log"), storage="inplace")
        with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
            DiskSparseRiemannianAdam(params={"emb": table}, k=1.0,
                                     disk_dir=str(tmp_path / "inplace"), storage="log")
        for kw, match in (({"storage": "inplace", "memory": mem},
                           "^DiskSparseRiemannianAdam: memory= is for storage='log'"),
                          ({"storage": "lsm"}, "storage must be one of")):
            with pytest.raises(ValueError, match=match):
                DiskSparseRiemannianAdam(params={"emb": table}, disk_dir=str(tmp_path / "new"),
                                         **kw)
    assert {k: digest(tmp_path / k) for k in ("inplace", "log")} == before
    assert not (tmp_path / "new").exists()
