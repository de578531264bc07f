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


# -- the helpers take any optax state that holds sparse_adam's ("Drop-in means drop-in", B) --
def _composed(kind):
    """(transform, init params, grads of a batch) for sparse_adam inside an optax state."""
    if kind == "chain":
        tx = optax.chain(optax.clip_by_global_norm(1.0), dsa_jax.sparse_adam(1e-2))
        return tx, lambda store: store, lambda b, g: dsa_jax.row_grads(b.idx, g)
    if kind == "multi_transform":
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
            {"dense": optax.adam(1e-3), "sparse": dsa_jax.sparse_adam(1e-2)},
            {"mlp": "dense", "emb": "sparse"}))
        mlp = _mlp_params()
        return (tx, lambda store: {"mlp": mlp, "emb": store},
                lambda b, g: {"mlp": jax.tree.map(jnp.ones_like, mlp),
                              "emb": dsa_jax.row_grads(b.idx, g)})
    tx = optax.inject_hyperparams(dsa_jax.sparse_adam, static_args=("in_jit",),
                                  hyperparam_dtype=jnp.float32)(learning_rate=1e-2)
    return tx, lambda store: store, lambda b, g: dsa_jax.row_grads(b.idx, g)


@pytest.mark.parametrize("kind", ["chain", "multi_transform", "inject_hyperparams"])
def test_helpers_find_sparse_adam_inside_an_optax_state(tmp_path, kind):
    """flush, core_states, checkpoint, restore, close and gather_batch take the optax
    state itself (no opt_state[1].inner_states["sparse"].inner_state)."""
    tx, params, grads = _composed(kind)
    state = tx.init(params(_store(tmp_path / "emb")))

    def step(state, k):
        b = dsa_jax.gather_batch(state, IDS[k % len(IDS)])  # the state's one table
        return tx.update(grads(b, _grads(b, k)), state)[1]

    for k in range(2):
        state = step(state, k)
    dsa_jax.flush(state)
    assert dsa_core.open(tmp_path / "emb", mode="r").count == 2
    core = dsa_jax.core_states(state)
    assert (core["emb"] if kind == "multi_transform" else core).count == 2
    at_2 = _table(dsa_core.open(tmp_path / "emb", mode="r"))
    dsa_jax.checkpoint(state, tmp_path / "ck")
    state = step(state, 2)
    back = dsa_jax.restore(state, tmp_path / "ck")
    assert type(back) is type(state)  # the same optax structure, sparse_adam's part replaced
    assert jax.tree.structure(back) == jax.tree.structure(state)
    assert np.array_equal(_table(dsa_core.open(tmp_path / "emb", mode="r")), at_2)
    back = step(back, 3)  # training goes on from the restored state
    dsa_jax.close(back)
    core = dsa_jax.core_states(back)
    assert (core["emb"] if kind == "multi_transform" else core).closed


def test_helpers_refuse_a_state_without_or_with_two_sparse_adams(tmp_path):
    with pytest.raises(TypeError, match=r"flush: the optimizer state holds no "
                                        r"adapters.jax.sparse_adam or sparse_adagrad state "
                                        r".* got ScaleByAdamState"):
        dsa_jax.flush(optax.scale_by_adam().init(_mlp_params()))
    tx = optax.multi_transform({"a": dsa_jax.sparse_adam(1e-2), "b": dsa_jax.sparse_adam(1e-3)},
                               {"u": "a", "i": "b"})
    state = tx.init({"u": _store(tmp_path / "u"), "i": _store(tmp_path / "i")})
    dsa_jax.flush(state)  # every sparse_adam state in it
    with pytest.raises(ValueError, match=r"checkpoint: the optimizer state holds 2 sparse_adam "
                                         r"states .* pass the one you mean"):
        dsa_jax.checkpoint(state, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()
    dsa_jax.close(state)
    inner = [s.inner_state for s in state.inner_states.values()]
    tables = [t for s in inner for t in jax.tree.leaves(
        s.stores, is_leaf=lambda x: isinstance(x, dsa_jax.DiskTable))]
    assert len(tables) == 2 and all(t.core_state.closed for t in tables)


def test_a_tuple_through_a_transform_gets_dsa_message(tmp_path):
    """A plain (idx, g) tuple in a chain: a transform before sparse_adam maps over the ids
    too. Where they reach sparse_adam (scaled into floats) its message names row_grads."""
    tx = optax.chain(optax.scale(0.5), dsa_jax.sparse_adam(1e-2))
    state = tx.init(_store(tmp_path / "a"))
    b = dsa_jax.gather_batch(state, IDS[0])
    with pytest.raises(TypeError, match=r"idx must hold integer row ids, got dtype float.*"
                                        r"optax transform runs before sparse_adam.*"
                                        r"row_grads\(batch.idx, grad_rows\)"):
        tx.update((b.idx, _grads(b, 0)), state)
    dsa_jax.close(state)


def test_the_jax_extra_installs_optax():
    """The docs compose sparse_adam with optax: pip install '.[jax]' must bring it (a range)."""
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
                           )["project"]["optional-dependencies"]
    optax_req = [r for r in extras["jax"] if r.split(">")[0].split("=")[0].strip() == "optax"]
    assert optax_req and "==" not in optax_req[0] and ">=" in optax_req[0]
