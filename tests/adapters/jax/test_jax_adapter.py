"""adapters.jax: the optax-style sparse Adam transform over dsa_core stores (CPU).

Oracles: ``dsa_core.step`` called directly on a twin store (bit-for-bit), and
``torch.optim.SparseAdam`` driven by the same batches.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import dsa_core
from adapters import jax as dj
from dsa_core import _layout
from helpers import assert_same_bits, evicted, records
from helpers import digest as store_digest

pytestmark = pytest.mark.jax

N, D = 300, 8


# -- helpers ------------------------------------------------------------------------------------
def make_twins(tmp_path: Path, name: str = "t", *, num_rows: int = N, dim: int = D,
               curvature: float = 0.0, dtype="float32", seed: int = 0, **kw):
    """Two stores with the same initial weights: one for the adapter, one for the oracle."""
    rng = np.random.default_rng(seed)
    init = rng.standard_normal((num_rows, dim)) * 0.1
    if curvature > 0:
        init *= 0.5 / np.sqrt(curvature) / np.abs(init).max() / np.sqrt(dim)
    a = dsa_core.create(tmp_path / f"{name}-a", num_rows, dim, curvature=curvature,
                        dtype=dtype, init=init, lr=1e-2, progress=False, **kw)
    b = dsa_core.create(tmp_path / f"{name}-b", num_rows, dim, curvature=curvature,
                        dtype=dtype, init=init, lr=1e-2, progress=False, **kw)
    return a, b


def batches(seed: int, steps: int, *, num_rows: int = N, dim: int = D, batch: int = 24,
            dtype=np.float32):
    """(ids with duplicates, unsorted; gradient rows) per step."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        ids = rng.integers(0, num_rows // 3, batch)  # small range: many duplicates
        ids[:3] = ids[3]
        out.append((ids, rng.standard_normal((batch, dim)).astype(dtype)))
    return out


def assert_same_store(a: dsa_core.State, b: dsa_core.State) -> None:
    np.testing.assert_array_equal(a.weights, b.weights)
    np.testing.assert_array_equal(a.exp_avg, b.exp_avg)
    np.testing.assert_array_equal(a.exp_avg_sq, b.exp_avg_sq)


class CompileLog(logging.Handler):
    """Collects JAX's 'Finished XLA compilation' log lines (``jax.log_compiles``)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        m = re.match(r"Finished XLA compilation of (\S+)", record.getMessage())
        if m:
            self.names.append(m.group(1))


@pytest.fixture
def compile_log():
    h = CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(h)
    try:
        with jax.log_compiles():
            yield h
    finally:
        logger.removeHandler(h)


# -- equality with dsa_core.step --------------------------------------------------------------
@pytest.mark.parametrize(("curvature", "second_moment"),
                         [(0.0, "elementwise"), (0.0, "rowwise"), (1.0, "elementwise")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_matches_dsa_core_step(tmp_path, curvature, second_moment, dtype):
    """The transform is dsa_core.step, whatever the store keeps (row-wise v included)."""
    with jax.enable_x64(dtype == "float64"):
        a, b = make_twins(tmp_path, curvature=curvature, dtype=dtype,
                          second_moment=second_moment)
        tx = dj.sparse_adam(3e-2)
        st = tx.init(a)
        for t, (ids, g) in enumerate(batches(1, 12, dtype=dtype)):
            if t % 3 == 0:  # raw ids with duplicates, a jax gradient
                upd = (ids, jnp.asarray(g))
                ref_idx, ref_g = ids, g
            elif t % 3 == 1:  # via gather: unique rows, padded, autodiff-summed duplicates
                batch = dj.gather_batch(st.stores, ids, buckets="pow2")
                gr = jax.grad(lambda r, g=g, inv=batch.inverse:
                              jnp.sum(r[inv] * jnp.asarray(g)))(batch.rows)
                assert gr.dtype == np.dtype(dtype)
                assert not np.asarray(gr)[batch.num_unique:].any()
                upd = (batch.idx, gr)
                ref_idx = batch.idx[:batch.num_unique]
                ref_g = np.asarray(gr)[:batch.num_unique]
            else:  # numpy in, numpy out; B = 0 every few steps
                upd = (ids[:0], g[:0]) if t == 5 else (ids, g)
                ref_idx, ref_g = upd
            rows, st = tx.update(upd, st)
            b = dsa_core.step(b, ref_idx, ref_g, lr=3e-2)
            assert isinstance(rows, np.ndarray) == isinstance(upd[1], np.ndarray)
            assert rows.shape == np.shape(upd[1]) and rows.dtype == np.dtype(dtype)
            k = len(ref_idx)
            np.testing.assert_array_equal(np.asarray(rows)[:k], b.weights[ref_idx])
            assert int(st.count) == t + 1
        assert_same_store(a, b)
        assert dj.core_states(st).count == b.count == 12


def test_gather_dedups_and_pads(tmp_path):
    a, _ = make_twins(tmp_path)
    ids = np.array([[5, 2], [2, 9], [5, 5]])
    batch = dj.gather_batch(a, ids, buckets=(2, 4, 16))
    assert batch.num_unique == 3
    np.testing.assert_array_equal(batch.idx, [2, 5, 9, dj.PAD_ID])
    assert batch.inverse.shape == ids.shape and batch.inverse.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(batch.rows)[np.asarray(batch.inverse)],
                                  a.weights[ids])
    assert not np.asarray(batch.rows)[3:].any()
    # jax.grad of the block == the dense gradient restricted to the batch's rows
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 2, D)), jnp.float32)
    gb = jax.grad(lambda r: jnp.sum(jnp.sin(r[batch.inverse]) * x))(batch.rows)
    gd = jax.grad(lambda w: jnp.sum(jnp.sin(w[ids]) * x))(jnp.asarray(a.weights))
    np.testing.assert_allclose(np.asarray(gb)[:3], np.asarray(gd)[[2, 5, 9]], rtol=1e-6)
    assert not np.asarray(gb)[3:].any()
    assert np.count_nonzero(np.asarray(gd).any(axis=1)) == 3
    assert dj.bucket_size(100, "pow2") == 128 and dj.bucket_size(0, "pow2") == 1
    assert dj.bucket_size(100, (64, 256)) == 256 and dj.bucket_size(300, (64, 256)) == 512
    assert dj.bucket_size(7, None) == 7
    with pytest.raises(ValueError, match="buckets must be"):
        dj.bucket_size(3, "pow3")
    with pytest.raises(TypeError, match="integer row ids"):
        dj.gather_batch(a, np.array([1.0, 2.0]))
    with pytest.raises(IndexError, match=r"\[0, num_rows\)"):
        dj.gather_batch(a, np.array([1, N]))


def test_padding_rows_are_not_touched(tmp_path):
    a, b = make_twins(tmp_path)
    tx = dj.sparse_adam(1e-2)
    st = tx.init(a)
    ids = np.array([4, 1, 4])
    batch = dj.gather_batch(st.stores, ids, buckets=(8,))
    g = jax.grad(lambda r: jnp.sum(r[batch.inverse] ** 2))(batch.rows)
    rows, st = tx.update((batch.idx, g), st)
    b = dsa_core.step(b, ids, 2 * b.weights[ids], lr=1e-2)
    assert_same_store(a, b)  # rows 0 and N-1 (what -1 would wrap to) untouched
    assert not np.asarray(rows)[2:].any()
    # a padded row with a nonzero gradient means the loss read batch.rows directly
    before = a.weights.copy()
    g_bad = jax.grad(lambda r: jnp.sum(r ** 2) + jnp.sum(r[0]))(batch.rows + 1.0)
    with pytest.raises(ValueError, match="padding rows .* must have a zero gradient"):
        tx.update((batch.idx, g_bad), st)
    np.testing.assert_array_equal(a.weights, before)


# -- equality with torch.optim.SparseAdam ------------------------------------------------------
def _torch_setup(init: np.ndarray, lr: float):
    torch = pytest.importorskip("torch")
    emb = torch.nn.Embedding(init.shape[0], init.shape[1], sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    return torch, emb, torch.optim.SparseAdam(emb.parameters(), lr=lr)


def test_matches_torch_sparse_adam_same_grads(tmp_path):
    a, _ = make_twins(tmp_path)
    torch, emb, opt = _torch_setup(a.weights.copy(), 2e-2)
    tx = dj.sparse_adam(2e-2)
    st = tx.init(a)
    for ids, g in batches(2, 25):
        batch = dj.gather_batch(st.stores, ids)
        gr = jax.grad(lambda r, g=g, inv=batch.inverse:
                      jnp.sum(r[inv] * jnp.asarray(g)))(batch.rows)
        _, st = tx.update((batch.idx, gr), st)
        k = torch.from_numpy(batch.idx[None])
        emb.weight.grad = torch.sparse_coo_tensor(k, torch.from_numpy(np.asarray(gr).copy()),
                                                  emb.weight.shape, check_invariants=True)
        opt.step()
    # docs/algorithms.md §5 tolerances for float32 (the core's kernels may contract to FMA:
    # not bitwise)
    tol = {"rtol": 1e-5, "atol": 3e-6}
    np.testing.assert_allclose(a.weights, emb.weight.detach().numpy(), **tol)
    s = opt.state[emb.weight]
    np.testing.assert_allclose(a.exp_avg, s["exp_avg"].numpy(), **tol)
    np.testing.assert_allclose(a.exp_avg_sq, s["exp_avg_sq"].numpy(), **tol)
    assert s["step"] == int(st.count) == 25


def test_matches_torch_sparse_adam_trajectory(tmp_path):
    """Same model and batches in both frameworks (each computes its own gradients)."""
    a, _ = make_twins(tmp_path)
    torch, emb, opt = _torch_setup(a.weights.copy(), 1e-2)
    tx = dj.sparse_adam(1e-2)
    st = tx.init(a)
    rng = np.random.default_rng(3)
    target = rng.standard_normal(D).astype(np.float32)

    @jax.jit
    def grad_fn(rows, inv, y):
        def loss(rows):
            return jnp.mean((rows[inv] @ jnp.asarray(target) - y) ** 2)
        return jax.grad(loss)(rows)

    for _ in range(30):
        ids = rng.integers(0, 60, 32)
        y = rng.standard_normal(32).astype(np.float32)
        batch = dj.gather_batch(st.stores, ids, buckets="pow2")
        _, st = tx.update((batch.idx, grad_fn(batch.rows, batch.inverse, y)), st)
        opt.zero_grad()
        out = emb(torch.from_numpy(ids)) @ torch.from_numpy(target)
        torch.mean((out - torch.from_numpy(y)) ** 2).backward()
        opt.step()
    np.testing.assert_allclose(a.weights, emb.weight.detach().numpy(), rtol=1e-4, atol=1e-6)


# -- a small real model --------------------------------------------------------------------------
def test_matrix_factorization_trains(tmp_path):
    rng = np.random.default_rng(7)
    nu, ni, d, r = 120, 90, 8, 3
    U, V = rng.standard_normal((nu, r)), rng.standard_normal((ni, r))
    stores = {"user": dsa_core.create(tmp_path / "u", nu, d, init="normal", init_scale=0.3,
                                      progress=False),
              "item": dsa_core.create(tmp_path / "i", ni, d, init="normal", init_scale=0.3,
                                      seed=1, progress=False)}
    tx = dj.sparse_adam(5e-2)
    st = tx.init(stores)
    assert jax.tree.leaves(st) == [st.count]  # handles are static: no leaves

    @jax.jit
    def value_and_grad(rows, inv, y):
        def loss(rows):
            pred = jnp.sum(rows["user"][inv["user"]] * rows["item"][inv["item"]], -1)
            return jnp.mean((pred - y) ** 2)
        return jax.value_and_grad(loss)(rows)

    losses = []
    for _ in range(100):
        u, i = rng.integers(0, nu, 128), rng.integers(0, ni, 128)
        y = np.sum(U[u] * V[i], -1).astype(np.float32)
        bu = dj.gather_batch(st.stores["user"], u, buckets="pow2")
        bi = dj.gather_batch(st.stores["item"], i, buckets="pow2")
        loss, g = value_and_grad({"user": bu.rows, "item": bi.rows},
                                 {"user": bu.inverse, "item": bi.inverse}, y)
        _, st = tx.update({"user": (bu.idx, g["user"]), "item": (bi.idx, g["item"])}, st,)
        losses.append(float(loss))
    first, last = np.mean(losses[:10]), np.mean(losses[-10:])
    assert last < 0.3 * first, (first, last)
    dj.flush(st)
    assert dsa_core.open(tmp_path / "u", mode="r").count == 100


# -- jit: io_callback variant, no recompilation -------------------------------------------------
def _loss(rows, inv, x):
    return jnp.sum(jnp.tanh(rows[inv]) * x)


def test_in_jit_matches_outside_jit(tmp_path):
    a, b = make_twins(tmp_path)
    tx_out, tx_in = dj.sparse_adam(1e-2), dj.sparse_adam(1e-2, in_jit=True)
    sa, sb = tx_out.init(a), tx_in.init(b)

    @jax.jit
    def train_step(opt_state, rows, idx, inv, x):
        gr = jax.grad(_loss)(rows, inv, x)
        return tx_in.update((idx, gr), opt_state), gr

    # Both paths step with the very gradient the fused program computed: XLA on GPU fuses
    # the gradient differently in two programs (1 ULP apart, seen on an H200), and this test
    # is about the optimizer, not about XLA's fusion.
    for ids, g in batches(4, 10):
        x = jnp.asarray(g)
        bb = dj.gather_batch(sb.stores, ids, buckets="pow2")
        (rb, sb), gr = train_step(sb, bb.rows, bb.idx, bb.inverse, x)
        ba = dj.gather_batch(sa.stores, ids, buckets="pow2")
        np.testing.assert_array_equal(np.asarray(ba.rows), np.asarray(bb.rows))
        ra, sa = tx_out.update((ba.idx, gr), sa)
        np.testing.assert_array_equal(np.asarray(ra), np.asarray(rb))
    assert_same_store(a, b)
    assert int(sb.count) == 10 and isinstance(sb.count, jax.Array)


def test_in_jit_transform_eager_and_empty_batch(tmp_path):
    a, b = make_twins(tmp_path)
    tx = dj.sparse_adam(1e-2, in_jit=True)
    st = tx.init(a)
    ids, g = batches(17, 1)[0]
    rows, st = tx.update((ids, jnp.asarray(g)), st)  # io_callback also runs eagerly
    b = dsa_core.step(b, ids, g, lr=1e-2)
    np.testing.assert_array_equal(np.asarray(rows), b.weights[ids])
    step = jax.jit(lambda s, i, g: tx.update((i, g), s))
    rows, st = step(st, ids[:0], jnp.zeros((0, D), jnp.float32))  # B = 0 counts a step
    b = dsa_core.step(b, ids[:0], g[:0], lr=1e-2)
    assert rows.shape == (0, D) and int(st.count) == 2 == dj.core_states(st).count
    assert_same_store(a, b)


def test_float64_store_needs_x64(tmp_path):
    s = dsa_core.create(tmp_path / "f64", 10, 4, dtype="float64", progress=False)
    with jax.enable_x64(False):
        with pytest.raises(TypeError, match="store is float64 but JAX is in 32-bit mode"):
            dj.gather_batch(s, [1, 2])
        st = dj.sparse_adam(1e-2).init(s)
        with pytest.raises(TypeError, match="float64 needs jax.config.update"):
            dj.sparse_adam(1e-2).update(([1], jnp.ones((1, 4))), st)


def test_in_jit_scan_keeps_rows_on_device(tmp_path):
    """lax.scan of several steps on one batch, carrying the rows update returns."""
    a, b = make_twins(tmp_path)
    tx_in, tx_out = dj.sparse_adam(1e-2, in_jit=True), dj.sparse_adam(1e-2)
    sa, sb = tx_in.init(a), tx_out.init(b)
    ids = np.array([7, 3, 7, 11, 0])
    x = jnp.asarray(np.random.default_rng(5).standard_normal((5, D)), jnp.float32)
    batch = dj.gather_batch(sa.stores, ids)

    @jax.jit
    def run(opt_state, rows):
        def body(carry, _):
            st, r = carry
            new_rows, st = tx_in.update((batch.idx, jax.grad(_loss)(r, batch.inverse, x)), st)
            return (st, new_rows), None
        return jax.lax.scan(body, (opt_state, rows), None, length=6)[0]

    sa, rows = run(sa, batch.rows)
    r = dj.gather_batch(sb.stores, ids).rows
    for _ in range(6):
        r, sb = tx_out.update((batch.idx, jax.grad(_loss)(r, batch.inverse, x)), sb)
    # the scan body and the eager grad are compiled apart: tanh may differ in the last bit
    np.testing.assert_allclose(np.asarray(rows), np.asarray(r), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(rows), a.weights[batch.idx])
    np.testing.assert_allclose(a.weights, b.weights, rtol=1e-5, atol=1e-7)
    assert int(sa.count) == int(sb.count) == 6


def test_second_jitted_step_does_not_recompile(tmp_path, compile_log):
    a, b = make_twins(tmp_path)
    tx_in, tx_out = dj.sparse_adam(1e-2, in_jit=True), dj.sparse_adam(1e-2)
    sa, sb = tx_in.init(a), tx_out.init(b)

    @jax.jit
    def train_step(opt_state, rows, idx, inv, x):
        return tx_in.update((idx, jax.grad(_loss)(rows, inv, x)), opt_state)

    @jax.jit
    def grad_fn(rows, inv, x):
        return jax.grad(_loss)(rows, inv, x)

    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((24, D)), jnp.float32)
    seen = []
    for step in range(4):
        ids = rng.integers(0, 200, 24)  # a different number of unique ids each step ...
        ba = dj.gather_batch(sa.stores, ids, buckets=(32,))  # ... one bucket
        bb = dj.gather_batch(sb.stores, ids, buckets=(32,))
        seen.append(ba.num_unique)
        _, sa = train_step(sa, ba.rows, ba.idx, ba.inverse, x)
        _, sb = tx_out.update((bb.idx, grad_fn(bb.rows, bb.inverse, x)), sb)
        jax.block_until_ready(sa.count)
        if step == 0:
            assert any("train_step" in n for n in compile_log.names)
            assert any("grad_fn" in n for n in compile_log.names)
            compile_log.names.clear()
    assert len(set(seen)) > 1
    assert compile_log.names == []  # steps 2-4: nothing compiled at all
    assert train_step._cache_size() == 1 and grad_fn._cache_size() == 1
    assert_same_store(a, b)


# -- several tables ---------------------------------------------------------------------------
def test_dict_of_tables(tmp_path):
    u_a, u_b = make_twins(tmp_path, "u")
    i_a, i_b = make_twins(tmp_path, "i", num_rows=50, dim=4, curvature=0.5, seed=1)
    tx = dj.sparse_adam(5e-2)
    st = tx.init({"user": u_a, "item": i_a})
    for t, ((iu, gu), (ii, gi)) in enumerate(zip(batches(8, 6), batches(9, 6, num_rows=50,
                                                                         dim=4))):
        if t == 2:
            ii, gi = ii[:0], gi[:0]  # B = 0 for one table still counts its step
        rows, st = tx.update({"item": (ii, jnp.asarray(gi)), "user": (iu, jnp.asarray(gu))}, st)
        assert set(rows) == {"user", "item"} and rows["item"].shape == (len(ii), 4)
        u_b = dsa_core.step(u_b, iu, gu, lr=5e-2)
        i_b = dsa_core.step(i_b, ii, gi, lr=5e-2)
    assert_same_store(u_a, u_b)
    assert_same_store(i_a, i_b)
    cores = dj.core_states(st)
    assert cores["user"].count == cores["item"].count == 6
    with pytest.raises(ValueError, match="structure of the stores"):
        tx.update({"user": (iu, gu)}, st)


def test_stores_must_share_one_count(tmp_path):
    a, b = make_twins(tmp_path)
    b = dsa_core.step(b, [1], np.ones((1, D), np.float32))
    with pytest.raises(ValueError, match="different numbers of steps"):
        dj.sparse_adam(1e-2).init({"a": a, "b": b})
    with pytest.raises(ValueError, match="appears twice"):
        dj.sparse_adam(1e-2).init([a, a])
    with pytest.raises(TypeError, match="init takes open dsa_core stores"):
        dj.sparse_adam(1e-2).init({"a": jnp.zeros((N, D))})


# -- learning-rate schedules -----------------------------------------------------------------
def test_schedule_lr_per_step(tmp_path):
    a, b = make_twins(tmp_path)
    calls = []

    def schedule(count):
        calls.append(int(count))
        return 0.05 * 0.7 ** float(count)

    tx = dj.sparse_adam(schedule)
    st = tx.init(a)
    for t, (ids, g) in enumerate(batches(10, 8)):
        _, st = tx.update((ids, g), st)
        b = dsa_core.step(b, ids, g, lr=0.05 * 0.7**t)  # optax: lr of step t+1 = schedule(t)
    assert calls == list(range(8))
    assert_same_store(a, b)


def test_optax_schedule_in_and_out_of_jit(tmp_path):
    optax = pytest.importorskip("optax")
    a, b = make_twins(tmp_path)
    c, _ = make_twins(tmp_path, "c")
    sched = optax.linear_schedule(5e-2, 1e-2, transition_steps=5)
    tx_out, tx_in = dj.sparse_adam(sched), dj.sparse_adam(sched, in_jit=True)
    sa, sc = tx_out.init(a), tx_in.init(c)
    step_in = jax.jit(lambda s, i, g: tx_in.update((i, g), s))
    for t, (ids, g) in enumerate(batches(11, 7)):
        _, sa = tx_out.update((ids, g), sa)
        _, sc = step_in(sc, ids, jnp.asarray(g))
        b = dsa_core.step(b, ids, g, lr=float(sched(t)))
    assert_same_store(a, b)
    np.testing.assert_allclose(c.weights, b.weights, rtol=1e-6, atol=1e-7)


def test_zero_lr_from_schedule_moves_moments_only(tmp_path):
    a, b = make_twins(tmp_path)
    tx = dj.sparse_adam(lambda count: 0.0 if int(count) == 0 else 1e-2)
    st = tx.init(a)
    ids, g = batches(12, 1)[0]
    w0 = a.weights.copy()
    _, st = tx.update((ids, g), st)
    b = dsa_core.step(b, ids, g, lr=1e-2)
    np.testing.assert_array_equal(a.weights, w0)  # lr 0: weights unchanged
    np.testing.assert_array_equal(a.exp_avg, b.exp_avg)  # Euclidean moments: lr-independent
    np.testing.assert_array_equal(a.exp_avg_sq, b.exp_avg_sq)
    tx_bad = dj.sparse_adam(lambda count: -1.0)
    st = tx_bad.init(dj.core_states(st))
    with pytest.raises(ValueError, match="Invalid learning rate: -1.0"):
        tx_bad.update((ids, g), st)


def test_store_hyperparameters(tmp_path):
    a, b = make_twins(tmp_path)
    tx = dj.sparse_adam(b1=0.5, eps=1e-6)  # lr: the store's own (1e-2)
    st = tx.init(a)
    ids, g = batches(13, 1)[0]
    _, st = tx.update((ids, g), st)
    b = dsa_core.step(b._replace(betas=(0.5, 0.999), eps=1e-6), ids, g)
    assert_same_store(a, b)
    dj.flush(st)
    assert dsa_core.open(a.path, mode="r").betas == (0.5, 0.999)
    for kw, msg in [({"learning_rate": 0.0}, "Invalid learning rate"),
                    ({"b2": 1.0}, "Invalid beta parameter b2"),
                    ({"eps": -1.0}, "Invalid epsilon value")]:
        with pytest.raises(ValueError, match=msg):
            dj.sparse_adam(**kw)


def test_weights_false_store_takes_params(tmp_path):
    a = dsa_core.create(tmp_path / "a", N, D, weights=False, progress=False)
    b = dsa_core.create(tmp_path / "b", N, D, weights=False, progress=False)
    table = np.random.default_rng(14).standard_normal((N, D)).astype(np.float32)
    ref = table.copy()
    tx = dj.sparse_adam(1e-2)
    st = tx.init(a)
    for ids, g in batches(15, 4):
        rows, st = tx.update((ids, jnp.asarray(g)), st, params=jnp.asarray(table[ids]))
        table[ids] = np.asarray(rows)
        p = ref[ids].copy()
        b = dsa_core.step(b, ids, g, lr=1e-2, params=p)
        ref[ids] = p
    np.testing.assert_array_equal(table, ref)
    with pytest.raises(ValueError, match="weights=False: pass the current weight rows"):
        tx.update((ids, g), st)


# -- bad inputs leave the stores byte-identical ---------------------------------------------
def _reset_effect_tokens():
    """Forget JAX's ordered-effect tokens after a callback error (JAX-private API).

    On a GPU backend a failed ordered ``io_callback`` leaves the runtime token failed: every
    later ``jax.effects_barrier()`` -- and JAX's own atexit hook -- re-raises the error (seen
    on an H200, jax 0.11.2). On CPU the error is raised once. Later tests need a clean token.
    """
    from jax._src import dispatch

    dispatch.runtime_tokens.clear()


def test_bad_inputs_leave_stores_unchanged(tmp_path):
    u, _ = make_twins(tmp_path, "u")
    other, _ = make_twins(tmp_path, "o", dim=D + 1)
    tx = dj.sparse_adam(1e-2)
    st = tx.init({"user": u, "other": other})
    ids = np.array([3, 1, 3])
    g = np.ones((3, D), np.float32)
    go = np.ones((3, D + 1), np.float32)
    ok = (ids, go)
    before = {p: store_digest(p) for p in (u.path, other.path)}
    cases = [
        ({"user": jnp.zeros((N, D)), "other": ok}, TypeError,
         (r"table \['user'\]: update takes row gradients \(idx, grad_rows\), got a dense "
          r"table gradient of shape \(300, 8\)")),
        ({"user": (None, np.zeros((N, D), np.float32)), "other": ok}, TypeError,
         "dense table gradient"),
        ({"user": (ids, np.zeros((N, D), np.float32)), "other": ok}, ValueError,
         "looks like a dense table gradient"),
        ({"user": (ids, g.astype(np.float64)), "other": ok}, TypeError,
         "must have the store dtype float32, got float64"),
        ({"user": (ids, go), "other": ok}, ValueError,
         r"shape \(len\(idx\), dim\) = \(3, 8\), got \(3, 9\); the store has another dim"),
        ({"user": (ids[:2], g), "other": ok}, ValueError,
         "same length, got 2 ids and 3 gradient rows"),
        ({"user": (ids.astype(np.float32), g), "other": ok}, TypeError, "integer row ids"),
        ({"user": (ids[:, None], g), "other": ok}, ValueError, "idx must be 1-D"),
        ({"user": (ids, g), "other": (np.array([0, 1, N + 50]), go)}, IndexError,
         r"table \['other'\]: idx must lie in \[0, num_rows\)"),
        ({"user": (ids, g), "other": (np.array([0, -1, 2]), go)}, IndexError,
         "trailing block"),
        ({"user": (ids, g), "other": (np.array([0, 1, 2, -1]), np.ones((4, D + 1),
                                                                   np.float32))},
         ValueError, "padding rows"),
        ({"user": (ids, g)}, ValueError, "structure of the stores"),
    ]
    for upd, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            tx.update(upd, st)
    # the in_jit variant raises the static errors while tracing
    tx_in = dj.sparse_adam(1e-2, in_jit=True)
    st_in = tx_in.init(dj.core_states(st))
    with pytest.raises(TypeError, match="must have the store dtype float32"):
        jax.jit(lambda s, a, b: tx_in.update({"user": (a, b), "other": ok}, s))(
            st_in, ids, jnp.ones((3, D), jnp.int32))
    with pytest.raises(TypeError, match="dense table gradient"):
        jax.jit(lambda s, w: tx_in.update({"user": w, "other": ok}, s))(
            st_in, jnp.zeros((N, D)))
    # ... and the value errors in the callback, as a JAX runtime error with our message
    with pytest.raises(Exception, match=r"idx must lie in \[0, num_rows\)"):
        out = jax.jit(lambda s, i: tx_in.update({"user": (i, g), "other": ok}, s))(
            st_in, jnp.array([0, 1, N]))
        jax.block_until_ready(out)
        jax.effects_barrier()  # on GPU the callback's error surfaces here
    _reset_effect_tokens()
    after = {p: store_digest(p) for p in (u.path, other.path)}
    assert after == before
    assert dj.core_states(st_in)["user"].count == 0


def test_stale_and_misused_states(tmp_path):
    a, _ = make_twins(tmp_path)
    tx = dj.sparse_adam(1e-2)
    st0 = tx.init(a)
    ids, g = batches(16, 1)[0]
    _, st1 = tx.update((ids, g), st0)
    before = store_digest(a.path)
    # the old opt_state again: refused (it would count step 1 twice), nothing written
    with pytest.raises(dsa_core.StaleStateError,
                       match=r"^sparse_adam\.update: stale optimizer state: its count is 0 but "
                             r"the store has made 1 steps\..*pass the opt_state returned by "
                             r"the last update"):
        tx.update((ids, g), st0)
    with pytest.raises(dsa_core.StaleStateError, match="stale optimizer state"):
        dj.checkpoint(st0, tmp_path / "ck")
    assert store_digest(a.path) == before and not (tmp_path / "ck").exists()
    with pytest.raises(RuntimeError, match="inside jax.jit"):
        jax.jit(lambda s, g: tx.update((ids, g), s)[1].count)(st1, jnp.asarray(g))
    with pytest.raises(dsa_core.StaleStateError, match=r"^sparse_adam\.init: .* is stale"):
        tx.init(a)  # `a` is the count-0 dsa_core.State, the store is at 1
    # two optimizer states of one store: the first to step wins, the other is refused
    st2 = tx.init(dj.core_states(st1))
    _, st2 = tx.update((ids, g), st2)
    with pytest.raises(dsa_core.StaleStateError, match="through another optimizer state"):
        tx.update((ids, g), st1)
    with pytest.raises(dsa_core.StaleStateError, match="through another optimizer state"):
        dj.checkpoint(st1, tmp_path / "ck")
    assert dj.core_states(st2).count == 2
    _, st2 = tx.update((ids, g), st2)  # the winner goes on
    dj.close(st2)
    with pytest.raises(ValueError, match="closed"):
        tx.update((ids, g), st2)


def test_stale_state_in_jit(tmp_path):
    """An old opt_state inside jit: the callback refuses it, the store is untouched."""
    a, _ = make_twins(tmp_path)
    tx = dj.sparse_adam(1e-2, in_jit=True)
    step = jax.jit(lambda s, i, g: tx.update((i, g), s))
    ids, g = batches(18, 1)[0]
    st0 = tx.init(a)
    _, st1 = step(st0, ids, jnp.asarray(g))
    jax.block_until_ready(st1.count)
    before = store_digest(a.path)
    with pytest.raises(Exception, match="pass the opt_state returned by the last update"):
        out = step(st0, ids, jnp.asarray(g))
        jax.block_until_ready(out)
        jax.effects_barrier()
    _reset_effect_tokens()
    assert store_digest(a.path) == before
    _, st2 = step(st1, ids, jnp.asarray(g))
    assert int(st2.count) == 2 == dj.core_states(st2).count


def test_messages_name_the_call_not_the_store(tmp_path):
    """Messages start with the function called (and the table, for several), no 'the store:'."""
    a, _ = make_twins(tmp_path)
    tx = dj.sparse_adam(1e-2)
    st = tx.init(a)
    with pytest.raises(IndexError, match=r"^sparse_adam\.update: idx must lie in \[0, num_rows\)"):
        tx.update((np.array([N]), np.ones((1, D), np.float32)), st)
    with pytest.raises(TypeError, match=r"^sparse_adam\.update: grad_rows must have the store"):
        tx.update((np.array([1]), np.ones((1, D))), st)
    with pytest.raises(TypeError, match=r"^gather_batch: ids must hold integer row ids"):
        dj.gather_batch(st.stores, np.array([1.5]))
    with pytest.raises(ValueError, match=r"^sparse_adam: Invalid learning rate: 0\.0"):
        dj.sparse_adam(0.0)
    with pytest.raises(ValueError, match=r"^sparse_adam\.update \(learning-rate schedule at "
                                         r"count 0\): Invalid learning rate: -1\.0"):
        dj.sparse_adam(lambda c: -1.0).update((np.array([1]), np.ones((1, D), np.float32)),
                                              dj.sparse_adam(lambda c: -1.0).init(
                                                  dj.core_states(st)))
    b, _ = make_twins(tmp_path, "b")
    st2 = tx.init({"user": dj.core_states(st), "item": b})
    with pytest.raises(IndexError, match=r"^sparse_adam\.update: table \['item'\]: idx must"):
        tx.update({"user": (np.array([1]), np.ones((1, D), np.float32)),
                   "item": (np.array([N]), np.ones((1, D), np.float32))}, st2)
    for fn in (lambda: tx.update((np.array([N]), np.ones((1, D), np.float32)), st),
               lambda: tx.update((np.array([1.0]), np.ones((1, D), np.float32)), st)):
        with pytest.raises(Exception) as info:
            fn()
        assert "the store:" not in str(info.value)
    dj.close(st2)


def test_renamed_names():
    assert "DiskTable" in dj.__all__ and "gather_batch" in dj.__all__
    assert "StoreHandle" not in dj.__all__ and "gather" not in dj.__all__
    with pytest.warns(DeprecationWarning, match="now adapters.jax.gather_batch"):
        assert dj.gather is dj.gather_batch
    with pytest.warns(DeprecationWarning, match="now adapters.jax.DiskTable"):
        assert dj.StoreHandle is dj.DiskTable
    with pytest.raises(AttributeError):
        dj.no_such_name  # noqa: B018


def test_adapter_uses_the_public_core_api_only():
    """adapters.jax and its private modules import no dsa_core._* and reach no .store."""
    root = Path(dj.__file__).parent
    for f in [root / "jax.py", *sorted(root.glob("_jax_*.py"))]:
        text = f.read_text()
        assert not re.search(r"dsa_core\._|from dsa_core\._", text), f
        assert not re.search(r"\.store\.", text), f


# -- create_store: a second run is refused, resume and overwrite are asked for ----------------
def test_create_store_refuses_a_second_run(tmp_path):
    path = tmp_path / "emb"
    tx = dj.sparse_adam(1e-2)
    st = tx.init(dj.create_store(path, N, D, init="normal"))
    ids, g = batches(19, 1)[0]
    _, st = tx.update((ids, g), st)
    dj.close(st)
    before = store_digest(path)
    with pytest.raises(FileExistsError, match=r"^create_store: a store already exists at .* "
                                              r"last flushed at step 1\): pass resume=True .* "
                                              r"or overwrite=True .* Nothing was touched"):
        dj.create_store(path, N, D, init="normal")
    with pytest.raises(ValueError, match="pass one of them"):
        dj.create_store(path, N, D, resume=True, overwrite=True)
    with pytest.raises(TypeError, match="resume must be a bool"):
        dj.create_store(path, N, D, resume="yes")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['nope'\]"):
        dj.create_store(path, N, D, resume=True, nope=1)
    assert store_digest(path) == before


def test_create_store_resume(tmp_path):
    path = tmp_path / "emb"
    tx = dj.sparse_adam(1e-2)
    ids, g = batches(20, 1)[0]
    s = dj.create_store(path, N, D, init="normal", resume=True)  # nothing to resume: fresh
    assert s.count == 0
    w0 = s.weights.copy()
    st = tx.init(s)
    _, st = tx.update((ids, g), st)
    w1 = dj.core_states(st).weights.copy()
    dj.close(st)
    s = dj.create_store(path, N, D, init="normal", seed=9, resume=True)  # init ignored
    assert s.count == 1 and s.lr == 1e-2  # the transform's lr, flushed into the manifest
    np.testing.assert_array_equal(s.weights, w1)
    assert not np.array_equal(s.weights, w0)
    dsa_core.close(s)
    s = dj.create_store(path, N, D, resume=True, lr=5e-2, betas=(0.8, 0.99))  # given: applied
    assert (s.lr, s.betas, s.current) == (5e-2, (0.8, 0.99), True)
    _, st = tx.update((ids, g), tx.init(s))
    dj.close(st)
    assert dsa_core.open(path, mode="r").count == 2
    # a store made another way is refused, closed again, untouched
    before = store_digest(path)
    for kw, what in [({"num_rows": N + 1}, "shape"), ({"dim": D + 1}, "shape"),
                     ({"curvature": 1.0}, "curvature"), ({"dtype": "float64"}, "dtype"),
                     ({"weights": False}, "weights"), ({"second_moment": "rowwise"},
                                                       "second_moment")]:
        args = {"num_rows": N, "dim": D, **kw}
        with pytest.raises(ValueError, match=rf"^create_store: .* does not match this call: "
                                             rf"it has {what} "):
            dj.create_store(path, args.pop("num_rows"), args.pop("dim"), resume=True, **args)
    assert store_digest(path) == before
    s = dj.create_store(path, N, D, resume=True)  # not locked by the refusals
    assert s.count == 2
    with pytest.raises(dsa_core.StoreLockedError):
        dj.create_store(path, N, D, resume=True)  # a second writer
    dsa_core.close(s)


def test_create_store_overwrite(tmp_path):
    path = tmp_path / "emb"
    tx = dj.sparse_adam(1e-2)
    _, st = tx.update(batches(21, 1)[0], tx.init(dj.create_store(path, N, D)))
    dj.close(st)
    s = dj.create_store(path, N, D + 2, overwrite=True)  # a fresh store, any shape
    assert (s.count, s.shape) == (0, (N, D + 2))
    dsa_core.close(s)


def test_create_store_weights_false_rerun_is_refused(tmp_path):
    """The issue's case: fresh weights in the model would meet the old m, v and count."""
    path = tmp_path / "mv"
    tx = dj.sparse_adam(1e-2)
    table = np.zeros((N, D), np.float32)
    st = tx.init(dj.create_store(path, N, D, weights=False))
    ids, g = batches(22, 1)[0]
    _, st = tx.update((ids, g), st, params=table[ids])
    dj.close(st)
    with pytest.raises(FileExistsError, match="pass resume=True"):
        dj.create_store(path, N, D, weights=False)


def test_warmup_runs():
    dj.warmup(("float32",))


# -- weight decay and per-row steps (docs/algorithms.md §7.1, §7.2) -----------------------------
@pytest.mark.parametrize("opts", [
    {"weight_decay": 0.1},
    {"weight_decay": 0.1, "decoupled_weight_decay": True},
    {"weight_decay": 0.1, "decoupled_weight_decay": True, "decay_missed_steps": True},
    {"per_row_step": True},
    {"weight_decay": 0.1, "decoupled_weight_decay": True, "decay_missed_steps": True,
     "per_row_step": True}])
@pytest.mark.parametrize("in_jit", [False, True])
def test_weight_decay_matches_dsa_core_step(tmp_path, opts, in_jit):
    """``sparse_adam(weight_decay=, decoupled_weight_decay=)`` on stores made by
    ``create_store(per_row_step=, decay_missed_steps=)`` is ``dsa_core.step`` with the same
    options, bit for bit, with a schedule and rows that skip steps."""
    hp = {k: opts[k] for k in ("weight_decay", "decoupled_weight_decay") if k in opts}
    layout = {k: opts[k] for k in ("per_row_step", "decay_missed_steps") if k in opts}
    init = np.random.default_rng(0).standard_normal((N, D)) * 0.1
    # the transform brings the decay; a store that catches up decay is made decoupled
    made = {"decoupled_weight_decay": True} if layout.get("decay_missed_steps") else {}
    a = dj.create_store(tmp_path / "a", N, D, init=init, lr=1e-2, **layout, **made)
    b = dsa_core.create(tmp_path / "b", N, D, init=init, lr=1e-2, **layout, **hp)
    assert (a.per_row_step, a.decay_missed_steps) == (b.per_row_step, b.decay_missed_steps)
    # a schedule on the host; inside jit a constant (a traced schedule may differ from the
    # host's in the last bit, see sparse_adam)
    sched = (lambda count: 3e-2) if in_jit else (lambda count: 3e-2 * 0.95 ** count)
    tx = dj.sparse_adam(3e-2 if in_jit else sched, **hp, in_jit=in_jit)
    st = tx.init(a)
    step = jax.jit(lambda s, i, g: tx.update((i, g), s)) if in_jit else \
        (lambda s, i, g: tx.update((i, g), s))
    for t, (ids, g) in enumerate(batches(7, 10)):
        if t >= 5:
            ids = ids + N // 2  # rows first seen late (and rows that miss steps)
        _, st = step(st, ids, jnp.asarray(g))
        b = dsa_core.step(b, ids, g, lr=float(sched(np.int32(t))))
    a = dj.core_states(st)
    assert_same_store(a, b)
    assert (a.weight_decay, a.decoupled_weight_decay) == (b.weight_decay,
                                                          b.decoupled_weight_decay)
    if b.per_row_step:
        np.testing.assert_array_equal(a.row_steps, b.row_steps)
    if b.decay_missed_steps:
        np.testing.assert_array_equal(a.last_steps, b.last_steps)
    dj.flush(st)
    snap = dsa_core.open(a.path, mode="r")  # the transform's decay is in the manifest
    assert snap.weight_decay == hp.get("weight_decay", 0.0)
    dsa_core.close(snap)
    dj.close(st)
    dsa_core.close(b)


def test_weight_decay_arguments_and_the_stores_own(tmp_path):
    a, b = make_twins(tmp_path, weight_decay=0.2, decoupled_weight_decay=True)
    st = dj.sparse_adam(1e-2).init(a)  # None: the store's own decay
    ids, g = batches(3, 1)[0]
    _, st = dj.sparse_adam(1e-2).update((ids, g), st)
    b = dsa_core.step(b, ids, g)
    assert_same_store(dj.core_states(st), b)
    dj.close(st)
    dsa_core.close(b)
    for kw, exc, msg in [({"weight_decay": -0.1}, ValueError,
                          r"^sparse_adam: Invalid weight_decay value: -0.1"),
                         ({"weight_decay": float("inf")}, ValueError, "Invalid weight_decay"),
                         ({"weight_decay": "0.1x"}, TypeError, "weight_decay must be"),
                         ({"decoupled_weight_decay": 1}, TypeError,
                          "decoupled_weight_decay must be a bool")]:
        with pytest.raises(exc, match=msg):
            dj.sparse_adam(1e-2, **kw)
    # a store that catches up decoupled decay refuses an L2 transform at init
    s = dj.create_store(tmp_path / "dm", N, D, weight_decay=0.1, decoupled_weight_decay=True,
                        decay_missed_steps=True)
    with pytest.raises(ValueError, match=r"decay_missed_steps=True.*decoupled_weight_decay="
                                         r"True"):
        dj.sparse_adam(1e-2, decoupled_weight_decay=False).init(s)
    dsa_core.close(s)


def test_create_store_resume_checks_the_row_options(tmp_path):
    path = tmp_path / "emb"
    s = dj.create_store(path, N, D, per_row_step=True, decay_missed_steps=True,
                        weight_decay=0.1, decoupled_weight_decay=True)
    tx = dj.sparse_adam(1e-2)
    _, st = tx.update(batches(4, 1)[0], tx.init(s))
    dj.checkpoint(st, tmp_path / "ck")
    dj.close(st)
    before = store_digest(path)
    for kw, what in [({"per_row_step": False, "decay_missed_steps": True},
                      r"per_row_step True \(asked: False\)"),
                     ({"per_row_step": True}, r"decay_missed_steps True \(asked: False\)")]:
        with pytest.raises(ValueError, match=rf"does not match this call: it has {what}"):
            dj.create_store(path, N, D, resume=True, decoupled_weight_decay=True, **kw)
    with pytest.raises(ValueError, match="decay_missed_steps=True, which needs "
                                         "decoupled_weight_decay=True"):
        dj.create_store(path, N, D, resume=True, per_row_step=True, decay_missed_steps=True,
                        decoupled_weight_decay=False)
    assert store_digest(path) == before
    s = dj.create_store(path, N, D, resume=True, per_row_step=True, decay_missed_steps=True,
                        weight_decay=0.3)  # a given hyperparameter replaces the store's
    assert (s.count, s.weight_decay, s.decoupled_weight_decay) == (1, 0.3, True)
    row_steps = s.row_steps.copy()
    assert row_steps.max() == 1
    # a checkpoint restores the per-row fields; a store without them is refused
    st = tx.init(s)
    _, st = tx.update(batches(5, 1)[0], st)
    st = dj.restore(st, tmp_path / "ck")
    np.testing.assert_array_equal(dj.core_states(st).row_steps, row_steps)
    dj.close(st)
    plain = tx.init(dj.create_store(tmp_path / "plain", N, D))
    with pytest.raises(ValueError, match="layout"):
        dj.restore(plain, tmp_path / "ck")
    dj.close(plain)


# -- both store kinds: the same bits ---------------------------------------------------------------
# (was test_jax_log.py) Every log store gets a region far smaller than its table (SLOTS
# records), so rows are evicted, sealed into segments and read back during the runs. The
# oracle is the same run on in-place stores created with the same initial records: these
# tests compare the two kinds, so they build both themselves instead of taking ``kind``.
SLOTS = 64  # region slots of each log store; a step has at most 40 distinct rows


def log_region(dim: int = D, dtype: str = "float32", curvature: float = 0.0, weights: bool = True,
           second_moment: str = "elementwise", first_moment: str = "full", **opts) -> int:
    """A region budget of SLOTS records of a store with these options."""
    lay = _layout.make_layout(N, dim, np.dtype(dtype), curvature, weights, 0, second_moment,
                              first_moment, per_row_step=opts.get("per_row_step", False),
                              decay_missed_steps=opts.get("decay_missed_steps", False))
    return dsa_core.region_memory(lay, SLOTS)


def init_rows(seed: int = 0, curvature: float = 0.0, dtype: str = "float32") -> np.ndarray:
    rows = np.random.default_rng(seed).standard_normal((N, D)) * 0.1
    if curvature > 0:
        rows *= 0.5 / np.sqrt(curvature) / np.abs(rows).max() / np.sqrt(D)
    return rows.astype(dtype)


def kind_twins(tmp_path: Path, name: str, **opts) -> dict[str, dsa_core.State]:
    """An in-place and a log store with the same initial records (create_store)."""
    store_opts = {k: v for k, v in opts.items() if k not in ("weight_decay",
                                                            "decoupled_weight_decay")}
    hp = {k: opts[k] for k in ("weight_decay", "decoupled_weight_decay") if k in opts}
    init = None if not opts.get("weights", True) else init_rows(
        curvature=opts.get("curvature", 0.0), dtype=opts.get("dtype", "float32"))
    return {kind: dj.create_store(tmp_path / f"{name}-{kind}", N, D, init=init, lr=1e-2, **hp,
                                  **store_opts, **kw)
            for kind, kw in (("inplace", {}),
                             ("log", {"storage": "log", "memory": log_region(**store_opts)}))}


def kind_batches(seed: int, steps: int, dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, N, 40)
        ids[:3] = ids[3]  # duplicates
        yield ids, rng.standard_normal((40, D)).astype(dtype)


def kind_run(tx, opt_state, steps, seed: int = 1, dtype: str = "float32", in_jit: bool = False,
        name: str | None = None, skip: int = 0):
    """Train batches ``skip .. skip + steps`` of stream ``seed`` through gather_batch (padded)
    and update, on the lone table or on table ``name``; returns the rows and the state."""
    def pair(x):
        return x if name is None else {name: x}

    def step(s, rows, idx, inv, x):
        return tx.update(pair((idx, jax.grad(_loss)(rows, inv, x))), s)

    jitted = jax.jit(step)
    out = []
    for ids, g in list(kind_batches(seed, skip + steps, dtype))[skip:]:
        b = dj.gather_batch(opt_state.stores if name is None else opt_state.stores[name], ids,
                            buckets="pow2")
        rows, opt_state = (jitted if in_jit else step)(opt_state, b.rows, b.idx, b.inverse,
                                                       jnp.asarray(g))
        out.append(np.asarray(rows if name is None else rows[name]))
    return out, opt_state


@pytest.mark.parametrize("in_jit", [False, True])
@pytest.mark.parametrize("opts", [
    {},
    {"curvature": 1.0},
    {"second_moment": "rowwise", "first_moment": "bfloat16", "per_row_step": True},
    {"decay_missed_steps": True, "weight_decay": 0.05, "decoupled_weight_decay": True},
    {"dtype": "float64", "weight_decay": 0.05},
])
def test_sparse_adam_on_log_matches_inplace(tmp_path, opts, in_jit):
    dtype = opts.get("dtype", "float32")
    with jax.enable_x64(dtype == "float64"):
        stores = kind_twins(tmp_path, "t", **opts)
        runs = {}
        for kind, store in stores.items():
            tx = dj.sparse_adam(3e-2, in_jit=in_jit)
            rows, st = kind_run(tx, tx.init(store), 25, dtype=dtype, in_jit=in_jit)
            runs[kind] = (rows, dj.core_states(st))
        (ra, a), (rb, b) = runs["inplace"], runs["log"]
        assert b.storage == "log" and a.storage == "inplace" and evicted(b)
        assert a.count == b.count == 25
        for x, y in zip(ra, rb):
            assert_same_bits(x, y)
        assert_same_bits(records(a), records(b))
        for s in (a, b):
            dsa_core.close(s)


def test_weights_false_log_store_takes_params(tmp_path):
    """m and v on a log store, the weights in the caller's table: as in place."""
    stores = kind_twins(tmp_path, "mv", weights=False)
    tables = {}
    for kind, store in stores.items():
        table = init_rows()
        tx = dj.sparse_adam(1e-2)
        st = tx.init(store)
        for ids, g in kind_batches(3, 20):
            u = np.unique(ids)
            gr = np.zeros((len(u), D), np.float32)
            np.add.at(gr, np.searchsorted(u, ids), g)
            rows, st = tx.update((u, gr), st, params=table[u])
            table[u] = rows
        tables[kind] = (table, dj.core_states(st))
    assert evicted(tables["log"][1])
    assert_same_bits(tables["inplace"][0], tables["log"][0])
    assert_same_bits(records(tables["inplace"][1]), records(tables["log"][1]))
    for _, s in tables.values():
        dsa_core.close(s)


def test_dict_of_log_tables(tmp_path):
    """Two tables in one transform (a matrix factorisation), log, mixed and in place."""
    def make(kinds):
        out = {}
        for name, kind, seed in (("user", kinds[0], 0), ("item", kinds[1], 1)):
            kw = {"storage": "log", "memory": log_region()} if kind == "log" else {}
            out[name] = dj.create_store(tmp_path / f"{name}-{kinds}", N, D,
                                        init=init_rows(seed), **kw)
        return out

    @jax.jit
    def grads(rows, inv, r):
        def loss(rows):
            u, i = rows["user"][inv["user"]], rows["item"][inv["item"]]
            return jnp.mean((jnp.sum(u * i, -1) - r) ** 2)
        return jax.grad(loss)(rows)

    finals = {}
    for kinds in (("inplace", "inplace"), ("log", "log"), ("log", "inplace")):
        tx = dj.sparse_adam(5e-2)
        st = tx.init(make(kinds))
        rng = np.random.default_rng(5)
        for _ in range(20):
            users, items = rng.integers(0, N, 32), rng.integers(0, N, 32)
            bu = dj.gather_batch(st.stores["user"], users, buckets="pow2")
            bi = dj.gather_batch(st.stores["item"], items, buckets="pow2")
            g = grads({"user": bu.rows, "item": bi.rows},
                      {"user": bu.inverse, "item": bi.inverse}, jnp.ones(32))
            _, st = tx.update({"user": (bu.idx, g["user"]), "item": (bi.idx, g["item"])}, st)
        cores = dj.core_states(st)
        assert [cores[n].storage for n in ("user", "item")] == list(kinds)
        finals[kinds] = {n: records(c) for n, c in cores.items()}
        dj.close(st)
    ref = finals[("inplace", "inplace")]
    for kinds in (("log", "log"), ("log", "inplace")):
        for name in ("user", "item"):
            assert_same_bits(finals[kinds][name], ref[name])


def test_checkpoint_and_restore_on_log_stores(tmp_path):
    """checkpoint writes log snapshots; restore rolls back; training then goes on exactly
    as an uninterrupted in-place run. A checkpoint restores across the two kinds."""
    stores = {kind: {"user": s} for kind, s in kind_twins(tmp_path, "u").items()}
    tx = dj.sparse_adam(3e-2)
    _, ref = kind_run(tx, tx.init(stores["inplace"]), 10, name="user")  # uninterrupted, in place
    st = tx.init(stores["log"])
    _, st = kind_run(tx, st, 5, name="user")
    dj.checkpoint(st, tmp_path / "ck")
    snap = dsa_core.open(tmp_path / "ck" / "user", mode="r")
    assert snap.storage == "log" and snap.count == 5
    at5 = records(snap)
    dsa_core.close(snap)
    _, st = kind_run(tx, st, 3, seed=9, name="user")  # other steps, then back to the checkpoint
    st = dj.restore(st, tmp_path / "ck")
    assert int(st.count) == 5
    assert_same_bits(records(dj.core_states(st)["user"]), at5)
    _, st = kind_run(tx, st, 5, name="user", skip=5)  # steps 6..10 of the same stream
    assert evicted(dj.core_states(st)["user"])
    assert_same_bits(records(dj.core_states(st)["user"]), records(dj.core_states(ref)["user"]))
    # an in-place checkpoint restored into the log store (layouts are equal)
    dj.checkpoint(ref, tmp_path / "ck-inplace")
    st = dj.restore(st, tmp_path / "ck-inplace")
    assert dj.core_states(st)["user"].storage == "log"
    assert_same_bits(records(dj.core_states(st)["user"]), records(dj.core_states(ref)["user"]))
    # a changed digit in the checkpoint's manifest is named; the stores are not touched
    mfile = tmp_path / "ck" / "checkpoint.json"
    text = mfile.read_text()
    assert '"count": 5' in text
    mfile.write_text(text.replace('"count": 5', '"count": 6'))
    before = records(dj.core_states(st)["user"])
    with pytest.raises(ValueError, match=r"checkpoint\.json.*checksum"):
        dj.restore(st, tmp_path / "ck")
    assert_same_bits(records(dj.core_states(st)["user"]), before)
    dj.close(ref)
    dj.close(st)


def test_create_store_resume_and_refusals_on_log(tmp_path):
    path, mem = tmp_path / "emb", log_region()
    tx = dj.sparse_adam(1e-2)
    s = dj.create_store(path, N, D, init=init_rows(), storage="log", memory=mem)
    _, st = kind_run(tx, tx.init(s), 3)
    dj.flush(st)
    assert dsa_core.open(path, mode="r").count == 3
    dj.close(st)
    with pytest.raises(FileExistsError, match="a store already exists .* last flushed at step "
                                              "3"):
        dj.create_store(path, N, D, storage="log", memory=mem)
    s = dj.create_store(path, N, D, resume=True, storage="log", memory=mem)
    assert (s.storage, s.count) == ("log", 3) and s.store.slots == SLOTS
    dsa_core.close(s)
    other = dj.create_store(tmp_path / "ip", N, D)
    dsa_core.close(other)
    before = {p: store_digest(p) for p in (path, tmp_path / "ip")}
    with pytest.raises(ValueError, match="^create_store: the existing store at .* is a "
                                         "storage='log' store, but storage='inplace'"):
        dj.create_store(path, N, D, resume=True, storage="inplace")
    with pytest.raises(ValueError, match="storage='inplace' store, but storage='log' was "
                                         "asked for.* dsa_core.convert"):
        dj.create_store(tmp_path / "ip", N, D, resume=True, storage="log", memory=mem)
    for kw, match in (({"storage": "inplace", "memory": mem},
                       "^create_store: memory= is for storage='log'"),
                      ({"storage": "log", "access": "ram"}, "access='ram' is for in-place"),
                      ({"storage": "lsm"}, "storage must be one of")):
        for p in (path, tmp_path / "new"):
            with pytest.raises(ValueError, match=match):
                dj.create_store(p, N, D, resume=True, **kw)
    assert {p: store_digest(p) for p in (path, tmp_path / "ip")} == before
    assert not (tmp_path / "new").exists()
    s = dj.create_store(path, N, D, resume=True, memory=mem)  # "auto": the kind it has
    assert (s.storage, s.count) == ("log", 3)
    dsa_core.close(s)
    s = dj.create_store(path, N, D, overwrite=True)  # overwrite replaces the other kind
    assert (s.storage, s.count) == ("inplace", 0)
    dsa_core.close(s)


def test_durability_step_on_log_stores_matches_inplace_and_survives_reopen(tmp_path):
    """durability='step' on a log store (its commit log): the same bits as in place, and a
    store abandoned without close reopens at its last step."""
    stores = kind_twins(tmp_path, "dur", durability="step")
    runs = {}
    for kind, store in stores.items():
        tx = dj.sparse_adam(3e-2)
        rows, st = kind_run(tx, tx.init(store), 12)
        runs[kind] = dj.core_states(st)
    a, b = runs["inplace"], runs["log"]
    assert (a.durability, b.durability, b.storage) == ("step", "step", "log") and evicted(b)
    want = records(a)
    assert_same_bits(want, records(b))
    path = b.path
    b.store.abandon()  # as if the process died: nothing flushed since create
    again = dsa_core.open(path, mode="r")
    assert again.count == 12
    assert_same_bits(want, records(again))
    dsa_core.close(again)
    dsa_core.close(a)


def test_a_step_in_doubt_stands_and_training_goes_on(tmp_path):
    """In place with durability='step', the directory's sync after a step's manifest was
    renamed in fails (dsa_core.InDoubtError): the step stands -- the error says so -- and
    the same optax state goes on from it, ending with the records of a run that met no
    fault (before, the rows went back while the new manifest stayed: count t, rows t - 1)."""
    from helpers import os_fault

    ends = []
    for fault in (False, True):
        s = dj.create_store(tmp_path / f"fault-{fault}", N, D, init=init_rows(), lr=1e-2,
                            durability="step")
        tx = dj.sparse_adam(3e-2)
        st = tx.init(s)
        for k, (ids, g) in enumerate(kind_batches(1, 6)):
            upd = (jnp.asarray(ids), jnp.asarray(g))
            if fault and k == 3:
                with os_fault("fsync_path", 1) as f, \
                        pytest.raises(dsa_core.InDoubtError, match="The step was taken"):
                    tx.update(upd, st)
                assert f.failed, "the fault never struck"
                core = dj.core_states(st)
                assert core.count == 4 and core.current  # the store is at the step that stood
                st = tx.init(core)  # an opt_state at that step, as after a reopen
                continue
            _, st = tx.update(upd, st)
        core = dj.core_states(st)
        assert core.count == 6
        ends.append(records(core))
        dj.close(st)
    assert_same_bits(ends[0], ends[1])
