"""``adapters.jax.sparse_adagrad`` (issue 43): ``sparse_adam``'s machinery over Adagrad stores.

Each run is checked against the same steps done by ``dsa_core.step`` on a twin store (bit
for bit: the gradients are small integers, so summing duplicates is exact in any order),
and the element-wise one against ``torch.optim.Adagrad`` on sparse gradients.
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
IDS = [np.array([1, 2, 2, 9]), np.array([0, 9, 5, 5, 5]), np.array([2, 3]),
       np.array([9, 1, 1])]
HP = {"lr_decay": 0.05, "initial_accumulator_value": 0.1, "eps": 1e-10}
KINDS = [("adagrad", "inplace"), ("rowwise_adagrad", "log")]


def _schedule(count):
    return 0.25 * 0.5 ** count  # exact in float32 and float64: host and jit agree bit for bit


def _store(path, optimizer, storage="inplace", **kw):
    init = np.random.default_rng(0).standard_normal((N, D)).astype(np.float32)
    return dsa_jax.create_store(path, N, D, init=init, optimizer=optimizer, storage=storage,
                                lr=0.01, **kw)


def _grads(ids, k):
    """Per-id gradient rows of small integers (exact sums)."""
    return (np.arange(len(ids) * D, dtype=np.float32).reshape(len(ids), D) % 5 - 2 + k)


def _table(state):
    return dsa_core.gather(state, np.arange(N))


def _reference(path, optimizer, storage, steps, wd=0.0, **hp):
    """The same steps through dsa_core directly (duplicates left for the core to sum)."""
    s = _store(path, optimizer, storage)._replace(weight_decay=wd, **hp)
    for k, ids in enumerate(IDS[:steps]):
        s = dsa_core.step(s, ids, _grads(ids, k), lr=_schedule(k))
    return s


def _batch_grads(batch, ids, k):
    """The gradient of batch.rows of a loss that reads rows[inverse] with _grads(ids, k)."""
    g = jnp.asarray(_grads(ids, k))
    return jax.grad(lambda rows: jnp.sum(rows[batch.inverse] * g))(batch.rows)


@pytest.mark.parametrize("optimizer,storage", KINDS)
def test_host_path_equals_dsa_core(tmp_path, optimizer, storage):
    wd = 0.01 if optimizer == "rowwise_adagrad" else 0.0
    tx = dsa_jax.sparse_adagrad(_schedule, rowwise=optimizer == "rowwise_adagrad",
                                weight_decay=wd, **HP)
    s = tx.init(_store(tmp_path / "a", optimizer, storage))
    assert type(s) is dsa_jax.DiskAdagradState and jax.tree.leaves(s) == [s.count]
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s.stores, ids, buckets="pow2")
        rows, s = tx.update((b.idx, _batch_grads(b, ids, k)), s)
        np.testing.assert_array_equal(np.asarray(rows)[:b.num_unique],
                                      dsa_core.gather(dsa_jax.core_states(s),
                                                      b.idx[:b.num_unique]))
    ref = _reference(tmp_path / "r", optimizer, storage, len(IDS), wd=wd, **HP)
    core = dsa_jax.core_states(s)
    assert int(s.count) == core.count == ref.count == len(IDS)
    assert (core.lr_decay, core.initial_accumulator_value, core.weight_decay) == (
        HP["lr_decay"], HP["initial_accumulator_value"], wd)
    np.testing.assert_array_equal(_table(core), _table(ref))
    np.testing.assert_array_equal(dsa_core.read_records(core, np.arange(N)),
                                  dsa_core.read_records(ref, np.arange(N)))
    dsa_jax.close(s)
    dsa_core.close(ref)


@pytest.mark.parametrize("optimizer,storage", KINDS)
def test_in_jit_path_equals_dsa_core(tmp_path, optimizer, storage):
    tx = dsa_jax.sparse_adagrad(_schedule, rowwise=optimizer == "rowwise_adagrad",
                                in_jit=True, **HP)
    s = tx.init(_store(tmp_path / "a", optimizer, storage))

    @jax.jit
    def train_step(s, rows, idx, inv, g):
        grad = jax.grad(lambda r: jnp.sum(r[inv] * g))(rows)
        return tx.update((idx, grad), s)
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s.stores, ids, buckets="pow2")
        _, s = train_step(s, b.rows, b.idx, b.inverse, jnp.asarray(_grads(ids, k)))
    assert int(s.count) == len(IDS)
    ref = _reference(tmp_path / "r", optimizer, storage, len(IDS), **HP)
    np.testing.assert_array_equal(dsa_core.read_records(dsa_jax.core_states(s),
                                                        np.arange(N)),
                                  dsa_core.read_records(ref, np.arange(N)))
    dsa_jax.close(s)
    dsa_core.close(ref)


@pytest.mark.slow  # torch's import alone takes seconds; dsa_core parity above is the default
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled")
def test_elementwise_follows_torch_adagrad(tmp_path):
    torch = pytest.importorskip("torch")
    lr = 0.1
    tx = dsa_jax.sparse_adagrad(lr, **HP)
    s = tx.init(_store(tmp_path / "a", "adagrad"))
    w = torch.nn.Parameter(torch.from_numpy(_table(dsa_jax.core_states(s)).copy()))
    opt = torch.optim.Adagrad([w], lr=lr, **HP)
    for k, ids in enumerate(IDS):
        b = dsa_jax.gather_batch(s.stores, ids)
        _, s = tx.update((b.idx, _batch_grads(b, ids, k)), s)
        w.grad = torch.sparse_coo_tensor(torch.from_numpy(ids)[None],
                                         torch.from_numpy(_grads(ids, k)), (N, D),
                                         check_invariants=True)
        opt.step()
    core = dsa_jax.core_states(s)
    touched = np.unique(np.concatenate(IDS))  # a row never updated holds 0 (read as iav)
    np.testing.assert_array_equal(core.accumulator[touched],
                                  opt.state[w]["sum"].numpy()[touched])
    np.testing.assert_allclose(_table(core), w.detach().numpy(), rtol=0, atol=1e-6)
    dsa_jax.close(s)


def test_checkpoint_restore_and_resume(tmp_path):
    tx = dsa_jax.sparse_adagrad(_schedule, rowwise=True, **HP)
    s = tx.init(_store(tmp_path / "a", "rowwise_adagrad", "log"))

    def step(s, k):
        b = dsa_jax.gather_batch(s.stores, IDS[k])
        return tx.update((b.idx, _batch_grads(b, IDS[k], k)), s)[1]
    s = step(step(s, 0), 1)
    dsa_jax.checkpoint(s, tmp_path / "ckpt")
    s = step(s, 2)
    after = dsa_core.read_records(dsa_jax.core_states(s), np.arange(N))
    s = dsa_jax.restore(s, tmp_path / "ckpt")
    assert type(s) is dsa_jax.DiskAdagradState and int(s.count) == 2
    s = step(s, 2)
    np.testing.assert_array_equal(dsa_core.read_records(dsa_jax.core_states(s),
                                                        np.arange(N)), after)
    dsa_jax.flush(s)
    dsa_jax.close(s)
    store = _store(tmp_path / "a", "rowwise_adagrad", "log", resume=True)
    assert store.count == 3 and store.optimizer == "rowwise_adagrad"
    s = step(tx.init(store), 3)
    ref = _reference(tmp_path / "r", "rowwise_adagrad", "log", len(IDS), **HP)
    np.testing.assert_array_equal(dsa_core.read_records(dsa_jax.core_states(s),
                                                        np.arange(N)),
                                  dsa_core.read_records(ref, np.arange(N)))
    dsa_jax.close(s)
    dsa_core.close(ref)


def test_a_store_of_another_optimizer_is_refused(tmp_path):
    adam = dsa_core.create(tmp_path / "adam", N, D)
    ada = dsa_core.create(tmp_path / "ada", N, D, optimizer="adagrad", lr=0.01)
    with pytest.raises(ValueError, match=r"optimizer='adam'.*optimizer='adagrad'"):
        dsa_jax.sparse_adagrad().init(adam)
    with pytest.raises(ValueError, match=r"optimizer='adagrad'.*sparse_adagrad\(\.\.\.\)"):
        dsa_jax.sparse_adam(1e-2).init(ada)
    with pytest.raises(ValueError, match="rowwise_adagrad"):
        dsa_jax.sparse_adagrad(rowwise=True).init(ada)
    assert ada.count == 0 and adam.count == 0  # nothing stepped
    dsa_core.close(adam)
    dsa_core.close(ada)
    with pytest.raises(ValueError, match="optimizer"):
        dsa_jax.create_store(tmp_path / "ada", N, D, resume=True)  # an Adam store asked
    with pytest.raises(ValueError, match="weight_decay"):
        dsa_jax.sparse_adagrad(weight_decay=0.1)  # elementwise: torch refuses it too
    with pytest.raises(ValueError, match="lr_decay"):
        dsa_jax.sparse_adagrad(lr_decay=-1.0)
    with pytest.raises(ValueError, match="epsilon"):
        dsa_jax.sparse_adagrad(eps=0.0)


def test_helpers_given_no_dsa_state_name_both_transforms():
    """flush / checkpoint / ... given a state with no DSA part name sparse_adagrad's state
    beside sparse_adam's (they named sparse_adam only)."""
    with pytest.raises(TypeError, match=r"^flush: the optimizer state holds no "
                                        r"adapters.jax.sparse_adam or sparse_adagrad state "
                                        r"\(DiskAdamState or DiskAdagradState\); got "
                                        r"ScaleByRssState\. .*built with sparse_adam or "
                                        r"sparse_adagrad"):
        dsa_jax.flush(optax.adagrad(0.1).init({"w": jnp.zeros(3)})[0])


@pytest.mark.parametrize("in_jit", [False, True])
def test_optax_chain_with_clip_and_helpers(tmp_path, in_jit):
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     dsa_jax.sparse_adagrad(0.1, in_jit=in_jit, **HP))
    ref = dsa_jax.sparse_adagrad(0.1, **HP)
    s, r = tx.init(_store(tmp_path / "a", "adagrad")), ref.init(_store(tmp_path / "b",
                                                                       "adagrad"))

    def step(idx, g, s):
        return tx.update(dsa_jax.row_grads(idx, g), s)
    if in_jit:
        step = jax.jit(step)
    for k, ids in enumerate(IDS[:3]):
        b = dsa_jax.gather_batch(s, ids)  # gather_batch finds the one table in the chain
        g = _batch_grads(b, ids, k)
        _, s = step(b.idx, g, s)
        clipped = g * jnp.minimum(1.0, 1.0 / optax.tree.norm(g))  # optax's own rule
        _, r = ref.update((b.idx, clipped), r)
    dsa_jax.flush(s)
    assert dsa_jax.core_states(s).count == 3
    np.testing.assert_allclose(_table(dsa_jax.core_states(s)), _table(dsa_jax.core_states(r)),
                               rtol=0, atol=1e-7)
    dsa_jax.checkpoint(s, tmp_path / "ckpt")
    s2 = dsa_jax.restore(s, tmp_path / "ckpt")
    assert type(s2[1]) is dsa_jax.DiskAdagradState and int(s2[1].count) == 3
    dsa_jax.close(s2)
    dsa_jax.close(r)
    assert dsa_jax.core_states(s2).closed


@pytest.mark.parametrize("in_jit", [False, True])
def test_inject_hyperparams(tmp_path, in_jit):
    """Injected values are arrays (traced under jit): the lr is read at every update, the
    others set the stores at init."""
    hp = {"lr_decay": 0.0625, "initial_accumulator_value": 0.125}  # exact in float32
    tx = optax.inject_hyperparams(dsa_jax.sparse_adagrad, static_args=("in_jit",),
                                  hyperparam_dtype=jnp.float32)(
        learning_rate=0.25, in_jit=in_jit, **hp)
    ref = dsa_jax.sparse_adagrad(_schedule, **hp)
    s, r = tx.init(_store(tmp_path / "a", "adagrad")), ref.init(_store(tmp_path / "b",
                                                                       "adagrad"))

    def step(idx, g, s, k):
        s.hyperparams["learning_rate"] = jnp.asarray(_schedule(k), jnp.float32)
        return tx.update(dsa_jax.row_grads(idx, g), s)
    if in_jit:
        step = jax.jit(step)
    for k, ids in enumerate(IDS[:3]):
        b = dsa_jax.gather_batch(s, ids)
        g = _batch_grads(b, ids, k)
        _, s = step(b.idx, g, s, k)
        _, r = ref.update((b.idx, g), r)
    core = dsa_jax.core_states(s)
    assert (core.lr_decay, core.initial_accumulator_value, core.count) == (0.0625, 0.125, 3)
    np.testing.assert_allclose(dsa_core.read_records(core, np.arange(N)),
                               dsa_core.read_records(dsa_jax.core_states(r), np.arange(N)),
                               rtol=0, atol=1e-6)
    dsa_jax.close(s)
    dsa_jax.close(r)
