"""adapters.jax on log-structured stores (storage="log"): bit-identical to in-place stores.

Every log store gets a region far smaller than its table (SLOTS records), so rows are
evicted, sealed into segments and read back during the runs. The oracle is the same run on
in-place stores created with the same initial records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import dsa_core
from adapters import jax as dj
from dsa_core import _layout

pytestmark = pytest.mark.jax

N, D = 300, 8
SLOTS = 64  # region slots of each log store; a step has at most 40 distinct rows


def memory(dim: int = D, dtype: str = "float32", curvature: float = 0.0, weights: bool = True,
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


def twins(tmp_path: Path, name: str, **opts) -> dict[str, dsa_core.State]:
    """An in-place and a log store with the same initial records (create_store)."""
    store_opts = {k: v for k, v in opts.items() if k not in ("weight_decay",
                                                            "decoupled_weight_decay")}
    hp = {k: opts[k] for k in ("weight_decay", "decoupled_weight_decay") if k in opts}
    init = None if not opts.get("weights", True) else init_rows(
        curvature=opts.get("curvature", 0.0), dtype=opts.get("dtype", "float32"))
    return {kind: dj.create_store(tmp_path / f"{name}-{kind}", N, D, init=init, lr=1e-2, **hp,
                                  **store_opts, **kw)
            for kind, kw in (("inplace", {}),
                             ("log", {"storage": "log", "memory": memory(**store_opts)}))}


def batches(seed: int, steps: int, dtype: str = "float32"):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, N, 40)
        ids[:3] = ids[3]  # duplicates
        yield ids, rng.standard_normal((40, D)).astype(dtype)


def records(state: dsa_core.State) -> np.ndarray:
    return dsa_core.read_records(state, np.arange(state.num_rows))


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))  # bit for bit


def evicted(state: dsa_core.State) -> bool:
    st = state.store.engine.stats()
    return st["segments"] > 0 and st["slots"] < state.num_rows


def digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(path).rglob("*")) if f.is_file()}


def _loss(rows, inv, x):
    return jnp.sum(jnp.tanh(rows[inv]) * x)


def run(tx, opt_state, steps, seed: int = 1, dtype: str = "float32", in_jit: bool = False,
        name: str | None = None, skip: int = 0):
    """Train batches ``skip .. skip + steps`` of stream ``seed`` through gather_batch (padded)
    and update, on the lone table or on table ``name``; returns the rows and the state."""
    def pair(x):
        return x if name is None else {name: x}

    def step(s, rows, idx, inv, x):
        return tx.update(pair((idx, jax.grad(_loss)(rows, inv, x))), s)

    jitted = jax.jit(step)
    out = []
    for ids, g in list(batches(seed, skip + steps, dtype))[skip:]:
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
        stores = twins(tmp_path, "t", **opts)
        runs = {}
        for kind, store in stores.items():
            tx = dj.sparse_adam(3e-2, in_jit=in_jit)
            rows, st = run(tx, tx.init(store), 25, dtype=dtype, in_jit=in_jit)
            runs[kind] = (rows, dj.core_states(st))
        (ra, a), (rb, b) = runs["inplace"], runs["log"]
        assert b.storage == "log" and a.storage == "inplace" and evicted(b)
        assert a.count == b.count == 25
        for x, y in zip(ra, rb):
            assert_same(x, y)
        assert_same(records(a), records(b))
        for s in (a, b):
            dsa_core.close(s)


def test_weights_false_log_store_takes_params(tmp_path):
    """m and v on a log store, the weights in the caller's table: as in place."""
    stores = twins(tmp_path, "mv", weights=False)
    tables = {}
    for kind, store in stores.items():
        table = init_rows()
        tx = dj.sparse_adam(1e-2)
        st = tx.init(store)
        for ids, g in batches(3, 20):
            u = np.unique(ids)
            gr = np.zeros((len(u), D), np.float32)
            np.add.at(gr, np.searchsorted(u, ids), g)
            rows, st = tx.update((u, gr), st, params=table[u])
            table[u] = rows
        tables[kind] = (table, dj.core_states(st))
    assert evicted(tables["log"][1])
    assert_same(tables["inplace"][0], tables["log"][0])
    assert_same(records(tables["inplace"][1]), records(tables["log"][1]))
    for _, s in tables.values():
        dsa_core.close(s)


def test_dict_of_log_tables(tmp_path):
    """Two tables in one transform (a matrix factorisation), log, mixed and in place."""
    def make(kinds):
        out = {}
        for name, kind, seed in (("user", kinds[0], 0), ("item", kinds[1], 1)):
            kw = {"storage": "log", "memory": memory()} if kind == "log" else {}
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
            assert_same(finals[kinds][name], ref[name])


def test_checkpoint_and_restore_on_log_stores(tmp_path):
    """checkpoint writes log snapshots; restore rolls back; training then goes on exactly
    as an uninterrupted in-place run. A checkpoint restores across the two kinds."""
    stores = {kind: {"user": s} for kind, s in twins(tmp_path, "u").items()}
    tx = dj.sparse_adam(3e-2)
    _, ref = run(tx, tx.init(stores["inplace"]), 10, name="user")  # uninterrupted, in place
    st = tx.init(stores["log"])
    _, st = run(tx, st, 5, name="user")
    dj.checkpoint(st, tmp_path / "ck")
    snap = dsa_core.open(tmp_path / "ck" / "user", mode="r")
    assert snap.storage == "log" and snap.count == 5
    at5 = records(snap)
    dsa_core.close(snap)
    _, st = run(tx, st, 3, seed=9, name="user")  # other steps, then back to the checkpoint
    st = dj.restore(st, tmp_path / "ck")
    assert int(st.count) == 5
    assert_same(records(dj.core_states(st)["user"]), at5)
    _, st = run(tx, st, 5, name="user", skip=5)  # steps 6..10 of the same stream
    assert evicted(dj.core_states(st)["user"])
    assert_same(records(dj.core_states(st)["user"]), records(dj.core_states(ref)["user"]))
    # an in-place checkpoint restored into the log store (layouts are equal)
    dj.checkpoint(ref, tmp_path / "ck-inplace")
    st = dj.restore(st, tmp_path / "ck-inplace")
    assert dj.core_states(st)["user"].storage == "log"
    assert_same(records(dj.core_states(st)["user"]), records(dj.core_states(ref)["user"]))
    dj.close(ref)
    dj.close(st)


def test_create_store_resume_and_refusals_on_log(tmp_path):
    path, mem = tmp_path / "emb", memory()
    tx = dj.sparse_adam(1e-2)
    s = dj.create_store(path, N, D, init=init_rows(), storage="log", memory=mem)
    _, st = run(tx, tx.init(s), 3)
    dj.flush(st)
    assert dsa_core.open(path, mode="r").count == 3
    dj.close(st)
    with pytest.raises(FileExistsError, match="a store already exists .* last flushed at step "
                                              "3"):
        dj.create_store(path, N, D, storage="log", memory=mem)
    s = dj.create_store(path, N, D, resume=True, storage="log", memory=mem)
    assert (s.storage, s.count) == ("log", 3) and s.store.engine.slots == SLOTS
    dsa_core.close(s)
    other = dj.create_store(tmp_path / "ip", N, D)
    dsa_core.close(other)
    before = {p: digest(p) for p in (path, tmp_path / "ip")}
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
    assert {p: digest(p) for p in (path, tmp_path / "ip")} == before
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
    stores = twins(tmp_path, "dur", durability="step")
    runs = {}
    for kind, store in stores.items():
        tx = dj.sparse_adam(3e-2)
        rows, st = run(tx, tx.init(store), 12)
        runs[kind] = dj.core_states(st)
    a, b = runs["inplace"], runs["log"]
    assert (a.durability, b.durability, b.storage) == ("step", "step", "log") and evicted(b)
    want = records(a)
    assert_same(want, records(b))
    path = b.path
    b.store.engine.abandon()  # as if the process died: nothing flushed since create
    again = dsa_core.open(path, mode="r")
    assert again.count == 12
    assert_same(want, records(again))
    dsa_core.close(again)
    dsa_core.close(a)
