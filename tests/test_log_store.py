"""The log-structured store (create(storage="log")) through the public core API.

Every parity test trains an in-place store and a log store from the same initial records on
the same batches (duplicates included) and asks for bit-identical records; the log store
gets a small region so that eviction, seals and cleaning happen during the run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsa_core
from dsa_core import _log
from dsa_core.__main__ import main as cli

N, D = 240, 6
B = 24          # ids per batch (with duplicates)
STEPS = 60
LAYOUT = {"num_rows": N, "stride": 3 * D, "dtype": "float32"}  # float32 [w | m | v]: memory_for


def _init(dtype="float32", scale=0.1, seed=0, n=N, d=D):
    return (np.random.default_rng(seed).standard_normal((n, d)) * scale).astype(dtype)


def _small_memory(state, rows=3 * B):
    """A region of ``rows`` slots: far fewer than the table, so that rows are evicted."""
    return _log.memory_for(state.layout, rows)


def _pair(tmp_path, **kw):
    """An in-place and a log store created from the same init array."""
    dt = kw.get("dtype", "float32")
    init = kw.pop("init", None)
    if init is None and kw.get("weights", True):
        init = _init(dt, scale=0.05 if kw.get("curvature", 0) else 0.1)
    a = dsa_core.create(tmp_path / "inplace", N, D, init=init, **kw)
    mem = _small_memory(a)
    b = dsa_core.create(tmp_path / "log", N, D, init=init, storage="log", memory=mem, **kw)
    return a, b


def _batches(dtype, steps=STEPS, seed=1, nan_every=0):
    rng = np.random.default_rng(seed)
    for k in range(steps):
        idx = rng.integers(0, N, B)
        idx[: B // 4] = idx[B // 4: B // 2]  # plenty of duplicates
        g = rng.standard_normal((B, D)).astype(dtype)
        if nan_every and k % nan_every == 0:
            g[rng.integers(0, B), rng.integers(0, D)] = np.nan
        yield idx, g


def _records(state):
    return dsa_core.read_records(state, np.arange(state.num_rows))


def _assert_same(a, b):
    assert a.count == b.count
    ra, rb = _records(a), _records(b)
    assert ra.dtype == rb.dtype and ra.shape == rb.shape
    # bit-for-bit (NaN payloads included): compare the raw bits
    np.testing.assert_array_equal(ra.view(np.uint8), rb.view(np.uint8))


PARITY = {
    "float32": {},
    "float64": {"dtype": "float64"},
    "rowwise": {"second_moment": "rowwise"},
    "poincare": {"curvature": 1.0},
    "poincare64": {"curvature": 0.5, "dtype": "float64"},
    "l2": {"weight_decay": 0.01},
    "decoupled_missed_rowstep": {"weight_decay": 0.02, "decoupled_weight_decay": True,
                                 "decay_missed_steps": True, "per_row_step": True},
    "rowstep_poincare": {"curvature": 1.0, "per_row_step": True},
    "skip_row": {"nonfinite": "skip_row"},
    "maximize": {"maximize": True, "lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
    "align": {"align": 64, "second_moment": "rowwise"},
    # bfloat16 m: the stochastic rounding is keyed by the row id, not by the region slot the
    # record sits in, so the log store rounds every value exactly as the in-place store
    "bf16m": {"first_moment": "bfloat16"},
    "bf16m_rowwise": {"first_moment": "bfloat16", "second_moment": "rowwise"},
    "bf16m_l2_skip_row": {"first_moment": "bfloat16", "weight_decay": 0.01,
                          "nonfinite": "skip_row"},
    "bf16m_decoupled_missed_rowstep": {"first_moment": "bfloat16", "weight_decay": 0.02,
                                       "decoupled_weight_decay": True,
                                       "decay_missed_steps": True, "per_row_step": True},
    "bf16m_rowwise_rowstep_maximize": {"first_moment": "bfloat16", "second_moment": "rowwise",
                                       "per_row_step": True, "maximize": True, "lr": 0.01},
}


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_with_inplace(tmp_path, name):
    kw = dict(PARITY[name])
    a, b = _pair(tmp_path, **kw)
    assert a.storage == "inplace" and b.storage == "log"
    assert b.layout == a.layout
    _assert_same(a, b)
    dt = a.dtype
    for k, (idx, g) in enumerate(_batches(dt, nan_every=7 if "skip_row" in name else 0)):
        lr = None if k % 5 else 0.02  # a per-step lr now and then
        a = dsa_core.step(a, idx, g, lr=lr)
        b = dsa_core.step(b, idx, g, lr=lr)
    _assert_same(a, b)
    probe = np.array([0, 5, 5, N - 1, 17])
    np.testing.assert_array_equal(dsa_core.gather(a, probe), dsa_core.gather(b, probe))
    st = b.store.engine.stats()
    assert st["seals"] > 0 and st["misses"] > 3 * B  # rows really left and came back
    assert b.store.engine.verify() == []
    dsa_core.close(a)
    dsa_core.close(b)


def test_cleaning_happens_and_parity_holds(tmp_path):
    a, b = _pair(tmp_path)
    for idx, g in _batches(a.dtype, steps=200, seed=3):
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
        if a.count % 50 == 0:
            dsa_core.flush(a)
            dsa_core.flush(b)
    _assert_same(a, b)
    st = b.store.engine.stats()
    assert st["cleaned_segments"] > 0
    assert b.store.engine.verify() == []
    dsa_core.close(a)
    dsa_core.close(b)


@pytest.mark.parametrize("how", ["params", "table"])
def test_parity_weights_false(tmp_path, how):
    a, b = _pair(tmp_path, weights=False)
    Wa = _init()
    Wb = Wa.copy()
    for idx, g in _batches(np.float32):
        if how == "params":
            pa, pb = Wa[idx], Wb[idx]
            a = dsa_core.step(a, idx, g, params=pa)
            b = dsa_core.step(b, idx, g, params=pb)
            Wa[idx], Wb[idx] = pa, pb
        else:
            a = dsa_core.step(a, idx, g, table=Wa)
            b = dsa_core.step(b, idx, g, table=Wb)
    np.testing.assert_array_equal(Wa, Wb)
    _assert_same(a, b)
    with pytest.raises(ValueError, match="weights=False"):
        dsa_core.gather(b, [0])
    dsa_core.close(a)
    dsa_core.close(b)


def test_empty_batch_counts_a_step(tmp_path):
    a, b = _pair(tmp_path)
    a = dsa_core.step(a, np.array([], np.int64), np.zeros((0, D), np.float32))
    b = dsa_core.step(b, np.array([], np.int64), np.zeros((0, D), np.float32))
    assert b.count == 1
    _assert_same(a, b)
    dsa_core.close(a)
    dsa_core.close(b)


# -- flush / close / open / checkpoint ----------------------------------------------------------
def test_flush_close_open_keeps_values_count_and_hyperparameters(tmp_path):
    kw = {"lr": 0.03, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.01,
          "decoupled_weight_decay": True, "nonfinite": "skip_row", "maximize": True}
    a, b = _pair(tmp_path, **kw)
    batches = list(_batches(np.float32, steps=40))
    for idx, g in batches[:20]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.flush(b)
    dsa_core.close(b)
    assert b.closed
    b = dsa_core.open(tmp_path / "log", memory=_small_memory(a))
    assert b.storage == "log" and b.count == 20
    for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "nonfinite",
              "maximize", "ball_eps", "durability"):
        assert getattr(b, k) == getattr(a, k), k
    _assert_same(a, b)
    for idx, g in batches[20:]:  # training resumes identically
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    _assert_same(a, b)
    dsa_core.close(b)
    r = dsa_core.open(tmp_path / "log", mode="r")  # read-only: no memory needed
    assert not r.writable and r.count == 40
    _assert_same(a, r)
    dsa_core.close(r)
    dsa_core.close(a)


def test_unflushed_steps_are_not_in_a_reader(tmp_path):
    _, b = _pair(tmp_path)
    dsa_core.flush(b)
    before = _records(b)
    for idx, g in _batches(np.float32, steps=5):
        b = dsa_core.step(b, idx, g)
    r = dsa_core.open(tmp_path / "log", mode="r")
    assert r.count == 0
    np.testing.assert_array_equal(_records(r), before)
    dsa_core.close(r)
    dsa_core.close(b)


def test_checkpoint_then_training_goes_on(tmp_path):
    a, b = _pair(tmp_path)
    batches = list(_batches(np.float32, steps=30))
    for idx, g in batches[:15]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    at_ckpt = _records(a)
    assert dsa_core.checkpoint(b, tmp_path / "ckpt") == tmp_path / "ckpt"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        dsa_core.checkpoint(b, tmp_path / "ckpt")
    for idx, g in batches[15:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    _assert_same(a, b)
    snap = dsa_core.open(tmp_path / "ckpt", mode="r")
    assert snap.storage == "log" and snap.count == 15 and snap.lr == b.lr
    np.testing.assert_array_equal(_records(snap), at_ckpt)
    # restore the snapshot into the live log store: back to the checkpoint exactly
    b = dsa_core.restore(b, snap)
    assert b.count == 15
    np.testing.assert_array_equal(_records(b), at_ckpt)
    dsa_core.close(snap)
    dsa_core.close(b)
    dsa_core.close(a)


@pytest.mark.parametrize("direction", ["inplace->log", "log->inplace"])
def test_convert_gives_identical_records_and_training(tmp_path, direction):
    a, b = _pair(tmp_path, per_row_step=True, weight_decay=0.01)
    batches = list(_batches(np.float32, steps=30))
    for idx, g in batches[:15]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    src, kind = (a, "log") if direction == "inplace->log" else (b, "inplace")
    mem = _small_memory(a) if kind == "log" else None
    c = dsa_core.convert(src, tmp_path / "conv", storage=kind, memory=mem)
    assert c.storage == kind and c.count == 15 and c.layout == a.layout
    assert (c.lr, c.betas, c.weight_decay) == (a.lr, a.betas, a.weight_decay)
    _assert_same(a, c)
    for idx, g in batches[15:]:
        a = dsa_core.step(a, idx, g)
        c = dsa_core.step(c, idx, g)
    _assert_same(a, c)
    with pytest.raises(FileExistsError):
        dsa_core.convert(src, tmp_path / "conv", storage=kind, memory=mem)
    for s in (a, b, c):
        dsa_core.close(s)


def test_bf16m_convert_and_reopen_with_another_region_keep_parity(tmp_path):
    # bfloat16 m through convert (in-place -> log) and a reopen with a different region
    # budget: the rows land in other slots each time, and the rounding must not notice
    a = dsa_core.create(tmp_path / "inplace", N, D, init=_init(), first_moment="bfloat16",
                        weight_decay=0.01)
    batches = list(_batches(np.float32, steps=40, seed=5))
    for idx, g in batches[:10]:
        a = dsa_core.step(a, idx, g)
    b = dsa_core.convert(a, tmp_path / "log", storage="log", memory=_small_memory(a))
    assert b.first_moment == "bfloat16" and b.layout == a.layout
    _assert_same(a, b)
    for idx, g in batches[10:25]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    _assert_same(a, b)
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "log", memory=_small_memory(a, rows=B + 5))
    for idx, g in batches[25:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    _assert_same(a, b)
    assert b.store.engine.stats()["misses"] > 3 * B
    dsa_core.close(a)
    dsa_core.close(b)


def test_create_replaces_the_other_kind_only_with_overwrite(tmp_path):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D)
    dsa_core.close(s)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        dsa_core.create(p, N, D, storage="log", memory="1MiB")
    s = dsa_core.create(p, N, D, storage="log", memory="1MiB", overwrite=True)
    assert s.storage == "log" and not (p / "rows.dsa").exists()
    dsa_core.close(s)
    s = dsa_core.create(p, N, D, overwrite=True)
    assert s.storage == "inplace" and not list(p.glob("seg-*"))
    dsa_core.close(s)
    dsa_core.remove(p)
    assert not p.exists()


def test_remove_and_named_init(tmp_path):
    s = dsa_core.create(tmp_path / "n", N, D, storage="log", init="normal", seed=3,
                        init_scale=0.5)
    w = dsa_core.gather(s, np.arange(N))
    assert np.isfinite(w).all() and 0.3 < w.std() < 0.7  # N(0, 0.5**2), per (seed, row)
    dsa_core.close(s)
    again = dsa_core.open(tmp_path / "n", mode="r")
    np.testing.assert_array_equal(dsa_core.gather(again, np.arange(N)), w)
    dsa_core.close(again)
    dsa_core.remove(tmp_path / "n")
    assert not (tmp_path / "n").exists()


# -- State rules --------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["step", "flush", "checkpoint", "write_records", "set_count"])
def test_stale_state_errors(tmp_path, op):
    _, b = _pair(tmp_path)
    s1 = dsa_core.step(b, [1, 2], np.ones((2, D), np.float32))
    dsa_core.flush(s1)
    s2 = dsa_core.step(s1, [1], np.ones((1, D), np.float32))
    before = _records(s2)
    manifest = (tmp_path / "log" / "manifest.json").read_text()
    calls = {
        "step": lambda: dsa_core.step(s1, [3], np.ones((1, D), np.float32)),
        "flush": lambda: dsa_core.flush(s1),
        "checkpoint": lambda: dsa_core.checkpoint(s1, tmp_path / "ck"),
        "write_records": lambda: dsa_core.write_records(s1, [0], dsa_core.read_records(s1, [5])),
        "set_count": lambda: dsa_core.set_count(s1, 7),
    }
    with pytest.raises(dsa_core.StaleStateError, match="outdated"):
        calls[op]()
    assert (tmp_path / "log" / "manifest.json").read_text() == manifest
    assert not (tmp_path / "ck").exists()
    np.testing.assert_array_equal(_records(s2), before)
    assert not s2.closed and s2.current
    dsa_core.close(s2)


def test_write_records_and_set_count(tmp_path):
    a, b = _pair(tmp_path)
    rec = dsa_core.read_records(a, [7, 3])
    rec[:, 0] = 42.0
    dsa_core.write_records(a, [3, 7], rec)
    dsa_core.write_records(b, [3, 7], rec)
    a = dsa_core.set_count(a, 9)
    b = dsa_core.set_count(b, 9)
    _assert_same(a, b)
    with pytest.raises(ValueError, match="must not repeat"):
        dsa_core.write_records(b, [1, 1], dsa_core.read_records(b, [1, 1]))
    with pytest.raises(ValueError, match="records must be a"):
        dsa_core.write_records(b, [1], np.zeros((1, 3), np.float32))
    _assert_same(a, b)
    dsa_core.close(b)
    assert json.loads((tmp_path / "log" / "manifest.json").read_text())["count"] == 9
    dsa_core.close(a)


def test_properties_and_views(tmp_path):
    _, b = _pair(tmp_path, per_row_step=True, decoupled_weight_decay=True,
                 decay_missed_steps=True)
    assert b.storage == "log" and b.access == "log" and b.shape == (N, D)
    assert b.has_weights and b.per_row_step and b.decay_missed_steps
    assert b.second_moment == "elementwise" and b.first_moment == "full"
    before = _records(b)
    for view in ("weights", "exp_avg", "exp_avg_sq", "row_steps", "last_steps"):
        with pytest.raises(ValueError, match="no whole-table view.*dsa_core.gather.*convert"):
            getattr(b, view)
    with pytest.raises(ValueError, match="no whole-table view"):
        b.set_exp_avg(np.zeros((N, D), np.float32))
    with pytest.raises(ValueError, match="no whole-table view"):
        b.store.data
    np.testing.assert_array_equal(_records(b), before)
    dsa_core.close(b)


# -- bad inputs leave the store unchanged ---------------------------------------------------------
@pytest.mark.parametrize("kw, exc, match", [
    ({"storage": "lsm"}, ValueError, "storage must be one of"),
    ({"storage": "log", "memory": "lots"}, ValueError, "memory must be a number of bytes"),
    ({"storage": "log", "memory": "12 parsecs"}, ValueError, "memory must be a number"),
    ({"storage": "log", "memory": -5}, ValueError, "memory must be > 0"),
    ({"storage": "log", "memory": 1.5}, TypeError, "memory must be"),
    ({"storage": "inplace", "memory": "1GiB"}, ValueError, "memory= is for storage='log'"),
    ({"storage": "log", "durability": "always"}, ValueError, "durability must be one of"),
    ({"storage": "log", "access": "ram"}, ValueError, "access='ram' is for in-place"),
    ({"storage": "log", "memory": 10}, ValueError, "raise the budget"),
    ({"storage": "log", "init": np.zeros((N, D + 1))}, ValueError, "init must have shape"),
    ({"storage": "log", "weights": False, "init": "normal"}, ValueError, "weights=False"),
])
def test_bad_create_arguments_write_nothing(tmp_path, kw, exc, match):
    with pytest.raises(exc, match=match):
        dsa_core.create(tmp_path / "s", N, D, **kw)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").iterdir())


def test_memory_strings():
    from dsa_core.validation import check_memory_arg
    assert check_memory_arg("4GiB") == 4 << 30
    assert check_memory_arg("512 MiB") == 512 << 20
    assert check_memory_arg("1.5G") == 1_500_000_000
    assert check_memory_arg("64k") == 64_000
    assert check_memory_arg("2Ki") == 2048
    assert check_memory_arg(np.int64(100)) == 100
    assert check_memory_arg(None) is None


def test_batch_larger_than_region_is_refused_before_writing(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, storage="log", memory=_log.memory_for(LAYOUT, 10))
    s = dsa_core.step(s, np.arange(8), np.ones((8, D), np.float32))
    before, stats = _records(s), s.store.engine.stats()
    idx = np.concatenate([np.arange(11), np.arange(11)])  # 11 unique rows > 10 slots
    with pytest.raises(ValueError, match="a batch needs 11: raise the budget"):
        dsa_core.step(s, idx, np.ones((22, D), np.float32))
    assert s.current and s.count == 1
    np.testing.assert_array_equal(_records(s), before)
    assert s.store.engine.stats()["seals"] == stats["seals"]
    s = dsa_core.step(s, np.repeat(np.arange(10), 2), np.ones((20, D), np.float32))  # fits
    assert s.count == 2
    # check_batch: the same answer without a step (for callers that step several stores)
    before, stats = _records(s), s.store.engine.stats()
    with pytest.raises(ValueError, match="a batch needs 11: raise the budget"):
        dsa_core.check_batch(s, idx)
    dsa_core.check_batch(s, np.repeat(np.arange(10), 2))  # 20 ids, 10 distinct rows: fits
    dsa_core.check_batch(s, np.array([], np.int64))
    with pytest.raises(IndexError, match=rf"\[0, {N}\); got {N}"):
        dsa_core.check_batch(s, [N])
    np.testing.assert_array_equal(_records(s), before)
    assert s.store.engine.stats()["acquires"] == stats["acquires"] and s.count == 2
    dsa_core.close(s)
    t = dsa_core.create(tmp_path / "t", N, D)  # an in-place store takes any batch
    dsa_core.check_batch(t, np.arange(N))
    dsa_core.close(t)


def test_open_refuses_inplace_options_and_memory_mismatch(tmp_path):
    _, b = _pair(tmp_path)
    slots = b.store.engine.slots
    dsa_core.close(b)
    with pytest.raises(ValueError, match="access='disk' is for in-place"):
        dsa_core.open(tmp_path / "log", access="disk")
    with pytest.raises(ValueError, match="memory= is for storage='log'"):
        dsa_core.open(tmp_path / "inplace", memory="1GiB")
    s = dsa_core.open(tmp_path / "log")  # the budget given to create (remembered)
    assert s.store.engine.slots == slots < N
    dsa_core.close(s)
    s = dsa_core.create(tmp_path / "log", N, D, storage="log", overwrite=True)
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "log")  # default budget
    assert s.store.engine.slots == N  # the whole (small) table fits: capped at one slot per row
    with pytest.raises(dsa_core.StoreLockedError):
        dsa_core.open(tmp_path / "log", memory="1MiB")
    dsa_core.close(s)


# -- hints: prefetch, residency, ranges, buckets ------------------------------------------------------
def test_hints_change_no_value_and_residency_counts_region_rows(tmp_path):
    _, b = _pair(tmp_path)
    before = _records(b)
    res = dsa_core.residency(b, np.arange(N))
    assert res < 1.0  # the region is smaller than the table
    dsa_core.prefetch(b, np.arange(N), wait=True)
    dsa_core.load_range(b, 0, N, wait=True)
    dsa_core.wait_ranges(b)
    assert dsa_core.residency(b, np.arange(N)) == res  # read-ahead: the region is unchanged
    dsa_core.release_range(b, 0, N, wait=True)
    assert dsa_core.residency(b, np.arange(N)) == 0.0  # a release empties the region
    np.testing.assert_array_equal(_records(b), before)
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        dsa_core.load_range(b, 5, N + 1)
    b = dsa_core.step(b, [1, 2, 3], np.ones((3, D), np.float32))
    assert dsa_core.residency(b, [1, 2, 3]) == 1.0
    assert dsa_core.residency(b, [1, 2, 3, 4]) == 0.75 + dsa_core.residency(b, [4]) / 4
    res45 = dsa_core.residency(b, [4, 5])
    dsa_core.gather(b, [4, 5])  # gather never changes residency
    assert dsa_core.residency(b, [4, 5]) == res45
    assert list(dsa_core.prefetched(b, [[1], [2]])) == [[1], [2]]
    np.testing.assert_array_equal(_records(b)[4:], before[4:])
    dsa_core.close(b)
    with pytest.raises(ValueError, match="closed"):
        dsa_core.load_range(b, 0, 1)
    with pytest.raises(ValueError, match="closed"):
        dsa_core.prefetch(b, [0])


def test_buckets_with_a_log_store(tmp_path):
    from dsa_core import buckets
    rng = np.random.default_rng(0)
    edges = rng.integers(0, N, (600, 2))
    plan = buckets.plan(edges, N, partitions=4, buffer=2, seed=1)
    mem = _log.memory_for(LAYOUT, 120)
    runs = []
    for name, use in (("with", True), ("without", False)):
        s = dsa_core.create(tmp_path / name, N, D, init=_init(), storage="log", memory=mem)
        it = plan.batches(32, negatives=2, stores=[s] if use else ())
        for bt in it:
            ids = np.concatenate([bt.edges[:, 0], bt.edges[:, 1], bt.negatives.ravel()])
            g = np.ones((ids.shape[0], D), np.float32) * 0.1
            s = dsa_core.step(s, ids, g)
        runs.append(s)
    assert runs[0].count == runs[1].count > 0
    _assert_same(runs[0], runs[1])
    for s in runs:
        dsa_core.close(s)


# -- the command line ---------------------------------------------------------------------------
def test_cli_info_and_verify(tmp_path, capsys):
    _, b = _pair(tmp_path)
    for idx, g in _batches(np.float32, steps=10):
        b = dsa_core.step(b, idx, g)
    dsa_core.flush(b)
    assert cli(["info", "--json", str(tmp_path / "log")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["storage"] == "log" and info["count"] == 10
    assert info["segments"] >= 1 and info["live_bytes"] > 0
    for k in ("region_budget_bytes", "dead_bytes", "write_amplification"):
        assert k in info
    assert cli(["verify", "--quiet", str(tmp_path / "log")]) == 0
    assert "CRCs checked" in capsys.readouterr().out
    assert cli(["export", "--quiet", str(tmp_path / "log"), str(tmp_path / "w.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"),
                                  dsa_core.gather(b, np.arange(N)))  # flushed: the same rows
    dsa_core.close(b)
    # a damaged segment is reported by verify
    from dsa_core._log.format import read_header, segment_geometry
    seg = sorted((tmp_path / "log").glob("seg-*.dsl"))[-1]
    head = read_header(seg)
    rec_off = segment_geometry(head["n"], head["stride"], head["itemsize"])[2]
    raw = bytearray(seg.read_bytes())
    raw[rec_off + 3] ^= 0xFF  # a bit of the first record
    seg.write_bytes(bytes(raw))
    assert cli(["verify", "--quiet", str(tmp_path / "log")]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_restore_between_kinds(tmp_path):
    a, b = _pair(tmp_path)
    for idx, g in _batches(np.float32, steps=10):
        a = dsa_core.step(a, idx, g)
    b = dsa_core.restore(b, a)  # in-place snapshot -> live log store
    _assert_same(a, b)
    for idx, g in _batches(np.float32, steps=10, seed=5):
        b = dsa_core.step(b, idx, g)
    a = dsa_core.restore(a, b)  # log store -> live in-place store
    _assert_same(a, b)
    dsa_core.close(a)
    dsa_core.close(b)


def test_kill_9_reopens_at_the_last_flush(tmp_path):
    import subprocess
    import sys
    import textwrap
    mem = _log.memory_for(LAYOUT, 3 * B)
    code = textwrap.dedent(f"""
        import os, signal, numpy as np, dsa_core
        rng = np.random.default_rng(0)
        s = dsa_core.create({str(tmp_path / 'log')!r}, {N}, {D}, storage="log",
                            memory={mem},
                            init=rng.standard_normal(({N}, {D})).astype(np.float32))
        for k in range(40):
            s = dsa_core.step(s, rng.integers(0, {N}, {B}),
                              rng.standard_normal(({B}, {D})).astype(np.float32))
            if k == 19:
                dsa_core.flush(s)
                np.save({str(tmp_path / 'flushed.npy')!r},
                        dsa_core.read_records(s, np.arange({N})))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    s = dsa_core.open(tmp_path / "log", memory="1MiB")  # the dead writer's lock is gone
    assert s.count == 20
    np.testing.assert_array_equal(_records(s), np.load(tmp_path / "flushed.npy"))
    assert s.store.engine.verify() == []
    dsa_core.close(s)


def test_a_store_left_open_is_flushed_at_normal_exit(tmp_path):
    """Forgetting close() must not silently lose the steps since the last flush: an in-place
    store's rows reach its file through the mapping, a log store's live in its region, so
    the interpreter's exit flushes it (as Python flushes open files)."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import numpy as np, dsa_core
        rng = np.random.default_rng(0)
        s = dsa_core.create({str(tmp_path / 'log')!r}, {N}, {D}, storage="log",
                            memory="1MiB", init="normal")
        for k in range(7):
            s = dsa_core.step(s, rng.integers(0, {N}, {B}),
                              rng.standard_normal(({B}, {D})).astype(np.float32))
        np.save({str(tmp_path / 'live.npy')!r}, dsa_core.read_records(s, np.arange({N})))
        # no flush, no close: the program just ends
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    s = dsa_core.open(tmp_path / "log", memory="1MiB")
    assert s.count == 7
    np.testing.assert_array_equal(_records(s), np.load(tmp_path / "live.npy"))
    dsa_core.close(s)


def test_a_store_dropped_unclosed_is_flushed_when_collected(tmp_path):
    import gc

    def train():
        s = dsa_core.create(tmp_path / "log", N, D, storage="log", memory="1MiB")
        rng = np.random.default_rng(0)
        for _ in range(5):
            s = dsa_core.step(s, rng.integers(0, N, B),
                              rng.standard_normal((B, D)).astype(np.float32))
        return dsa_core.read_records(s, np.arange(N))  # s goes out of scope unclosed

    live = train()
    gc.collect()
    s = dsa_core.open(tmp_path / "log", memory="1MiB")  # the lock was released too
    assert s.count == 5
    np.testing.assert_array_equal(_records(s), live)
    dsa_core.close(s)


def test_a_forked_child_never_flushes_the_parents_store(tmp_path):
    """A forked child (a data-loader worker) holds a copy of the region: when it exits
    normally, its copy must not be flushed into the parent's store."""
    import os
    import sys
    s = dsa_core.create(tmp_path / "log", N, D, storage="log", memory="1MiB")
    rng = np.random.default_rng(0)
    for _ in range(3):
        s = dsa_core.step(s, rng.integers(0, N, B),
                          rng.standard_normal((B, D)).astype(np.float32))
    dsa_core.flush(s)
    before = sorted(p.name for p in (tmp_path / "log").iterdir())
    manifest = (tmp_path / "log" / "manifest.json").read_bytes()
    pid = os.fork()
    if pid == 0:  # the child steps its copy, then runs what a normal exit runs
        code = 1
        try:
            dsa_core.step(s, rng.integers(0, N, B),
                          rng.standard_normal((B, D)).astype(np.float32))
            import atexit
            atexit._run_exitfuncs()  # weakref.finalize's exit hook among them
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(p.name for p in (tmp_path / "log").iterdir()) == before
    assert (tmp_path / "log" / "manifest.json").read_bytes() == manifest
    dsa_core.close(s)
