"""``adapters.jax.sparse_adam`` composed with optax (issue 26).

``optax.chain(optax.clip_by_global_norm(1.0), sparse_adam(1e-2))`` failed with "lax.select
requires arguments to have the same dtypes" (the clip mapped over the integer ids). The
gradient of a table is now passed as ``row_grads(idx, g)``, whose ids are not a leaf; each
composition below is checked against the same step done by hand, bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import dsa_core  # noqa: E402
from adapters import jax as dsa_jax  # noqa: E402

pytestmark = pytest.mark.jax
N, D = 30, 4
IDS = [np.array([1, 2, 2, 9]), np.array([0, 9, 5]), np.array([2, 3])]


def _store(path):
    return dsa_core.create(path, N, D, init="normal", seed=3)


def _grads(batch, k):
    return (k + 2.0) * jnp.ones_like(batch.rows) + jnp.arange(batch.rows.size,
                                                               dtype=jnp.float32
                                                               ).reshape(batch.rows.shape)


def _table(state):
    return dsa_core.gather(state, np.arange(N))


@pytest.mark.parametrize("in_jit", [False, True])
def test_clip_by_global_norm_then_sparse_adam(tmp_path, in_jit):
    tx = optax.chain(optax.clip_by_global_norm(1.0), dsa_jax.sparse_adam(1e-2, in_jit=in_jit))
    ref = dsa_jax.sparse_adam(1e-2)
    s, r = tx.init(_store(tmp_path / "a")), ref.init(_store(tmp_path / "b"))

    def step(idx, g, s):
        return tx.update(dsa_jax.row_grads(idx, g), s)
    if in_jit:
        step = jax.jit(step)
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s[1].stores, ids)
        g = _grads(b, k)
        _, s = step(b.idx, g, s)
        clipped = g * jnp.minimum(1.0, 1.0 / optax.tree.norm(g))  # optax's own rule
        _, r = ref.update((b.idx, clipped), r)
    jax.effects_barrier()
    a, want = _table(dsa_jax.core_states(s[1])), _table(dsa_jax.core_states(r))
    np.testing.assert_allclose(a, want, rtol=0, atol=1e-7)
    dsa_jax.close(s[1])
    dsa_jax.close(r)


def test_elementwise_clip_then_sparse_adam(tmp_path):
    tx = optax.chain(optax.clip(0.5), dsa_jax.sparse_adam(1e-2))
    ref = dsa_jax.sparse_adam(1e-2)
    s, r = tx.init(_store(tmp_path / "a")), ref.init(_store(tmp_path / "b"))
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s[1].stores, ids)
        g = _grads(b, k) - 3.0
        _, s = tx.update(dsa_jax.row_grads(b.idx, g), s)
        _, r = ref.update((b.idx, jnp.clip(g, -0.5, 0.5)), r)
    assert np.array_equal(_table(dsa_jax.core_states(s[1])), _table(dsa_jax.core_states(r)))
    dsa_jax.close(s[1])
    dsa_jax.close(r)


@pytest.mark.parametrize("in_jit", [False, True])
def test_inject_hyperparams_schedules_the_lr(tmp_path, in_jit):
    sched = optax.linear_schedule(1e-2, 1e-3, 3)
    tx = optax.inject_hyperparams(dsa_jax.sparse_adam, static_args=("in_jit",),
                                  hyperparam_dtype=jnp.float32)(learning_rate=sched,
                                                                in_jit=in_jit)
    ref = dsa_jax.sparse_adam(sched)
    s, r = tx.init(_store(tmp_path / "a")), ref.init(_store(tmp_path / "b"))

    def step(idx, g, s):
        return tx.update(dsa_jax.row_grads(idx, g), s)
    if in_jit:
        step = jax.jit(step)
    lrs = []
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s.inner_state.stores, ids)
        _, s = step(b.idx, _grads(b, k), s)
        lrs.append(float(s.hyperparams["learning_rate"]))
        _, r = ref.update((b.idx, _grads(b, k)), r)
    jax.effects_barrier()
    # inside jit the schedule is traced (float32; may differ from the host's in the last bit)
    want = [float(sched(k)) for k in range(len(IDS))]
    if in_jit:
        np.testing.assert_allclose(lrs, want, rtol=2e-7)
    else:
        assert lrs == want
    np.testing.assert_allclose(_table(dsa_jax.core_states(s.inner_state)),
                               _table(dsa_jax.core_states(r)), rtol=0, atol=1e-7)
    dsa_jax.close(s.inner_state)
    dsa_jax.close(r)


def _mlp_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w": jax.random.normal(k1, (D, 3)), "b": jax.random.normal(k2, (3,))}


@pytest.mark.parametrize("combine", ["multi_transform", "masked"])
def test_dense_optax_optimizer_beside_the_table(tmp_path, combine):
    """A clipped model: optax.adam for the MLP, sparse_adam for the table, one chain."""
    labels = {"mlp": "dense", "emb": "sparse"}
    if combine == "multi_transform":
        inner = optax.multi_transform({"dense": optax.adam(1e-3),
                                       "sparse": dsa_jax.sparse_adam(1e-2)}, labels)
    else:
        inner = optax.chain(optax.masked(optax.adam(1e-3), {"mlp": True, "emb": False}),
                            optax.masked(dsa_jax.sparse_adam(1e-2),
                                         {"mlp": False, "emb": True}))
    tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
    mlp = _mlp_params()
    state = tx.init({"mlp": mlp, "emb": _store(tmp_path / "a")})
    ref_d, ref_s = optax.adam(1e-3), dsa_jax.sparse_adam(1e-2)
    mlp_ref, rd, rs = mlp, optax.adam(1e-3).init(mlp), ref_s.init(_store(tmp_path / "b"))
    store = dsa_core.open(tmp_path / "a", mode="r")  # reads the live rows, no lock
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(store, ids)
        gd = jax.tree.map(lambda p: (k + 1.0) * jnp.ones_like(p), mlp)
        gs = _grads(b, k)
        updates, state = tx.update({"mlp": gd, "emb": dsa_jax.row_grads(b.idx, gs)}, state)
        mlp = optax.apply_updates(mlp, updates["mlp"])
        assert updates["emb"].shape == (b.idx.shape[0], D)  # the table's new rows
        # the same step by hand: one global norm over both parts, then each optimizer
        scale = jnp.minimum(1.0, 1.0 / optax.tree.norm((gd, gs)))
        u, rd = ref_d.update(jax.tree.map(lambda g: g * scale, gd), rd)
        mlp_ref = optax.apply_updates(mlp_ref, u)
        _, rs = ref_s.update((b.idx, gs * scale), rs)
    for key in mlp:
        np.testing.assert_allclose(mlp[key], mlp_ref[key], rtol=0, atol=1e-7)
    np.testing.assert_allclose(_table(store), _table(dsa_jax.core_states(rs)), rtol=0,
                               atol=1e-7)
    dsa_core.close(store)
    dsa_jax.close(rs)
    for leaf in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, dsa_jax.DiskAdamState)):
        if isinstance(leaf, dsa_jax.DiskAdamState):
            dsa_jax.close(leaf)


def test_row_grads_hides_the_ids():
    rg = dsa_jax.row_grads(np.array([4, 1]), np.ones((2, D), np.float32))
    assert len(jax.tree.leaves(rg)) == 1
    doubled = jax.tree.map(lambda g: 2 * g, rg)
    assert doubled.idx.tolist() == [4, 1] and float(doubled.grads.sum()) == 4.0 * D


def test_example_model_with_dense_parameters_and_a_table(tmp_path):
    from examples import jax_mlp_table

    res = jax_mlp_table.train(tmp_path, num_ids=2_000, steps=60, batch=128)
    assert res["last"] < 0.9 * res["first"]  # both parts learn (1.77 -> 1.47 at seed 0)
