"""The per-row options as store features (docs/algorithms.md §7.1–§7.2): layout and format
version 3, the counters' views, the manifest, resume / checkpoint / restore, the bias-table
paths of the kernels, and bad inputs rejected with nothing written.

The kernels against the oracle and the dense anchors: ``test_weight_decay.py``.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import batches
from kernel_oracle import GEOMS, Oracle, geo_kw, init_rows, store_arrays

import dsa_core
from dsa_core import _layout

N, D = 50, 16
ALL = {"weight_decay": 0.1, "decoupled_weight_decay": True, "decay_missed_steps": True,
       "per_row_step": True}


# -- layout and format ------------------------------------------------------------------------
@pytest.mark.parametrize(("kw", "extra", "version"), [
    ({}, 0, 1),
    ({"per_row_step": True}, 1, 3),
    ({"decay_missed_steps": True, "decoupled_weight_decay": True}, 1, 3),
    ({"per_row_step": True, "decay_missed_steps": True, "decoupled_weight_decay": True}, 2, 3),
    ({"weight_decay": 0.1}, 0, 1),  # a hyperparameter: same layout, same version
    ({"second_moment": "rowwise", "per_row_step": True}, 1, 3),
    ({"second_moment": "rowwise"}, 0, 2),
])
@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_layout_counters_and_versions(tmp_path, kw, extra, version, dt):
    base = dsa_core.create(tmp_path / "base", N, D, dtype=dt,
                           second_moment=kw.get("second_moment", "elementwise"))
    s = dsa_core.create(tmp_path / "s", N, D, dtype=dt, **kw)
    lay = s.layout
    assert lay["stride"] == base.layout["stride"] + extra
    assert (tmp_path / "s" / "rows.dsa").stat().st_size == \
        4096 + N * lay["stride"] * np.dtype(dt).itemsize
    assert s.per_row_step == ("row_step" in lay) == kw.get("per_row_step", False)
    assert s.decay_missed_steps == ("last_step" in lay) == kw.get("decay_missed_steps", False)
    used = base.layout["stride"]
    if s.per_row_step:  # the counters follow v, row_step first
        assert lay["row_step"] == used
        assert s.row_steps.shape == (N,) and s.row_steps.dtype == _layout.counter_dtype(dt)
        assert not s.row_steps.any()
    if s.decay_missed_steps:
        assert lay["last_step"] == used + s.per_row_step
        assert s.last_steps.shape == (N,) and not s.last_steps.any()
    for k in ("w", "m", "v", "v_width"):  # the columns of the old layout stay where they were
        assert lay[k] == base.layout[k]
    dsa_core.close(s)
    dsa_core.close(base)
    man = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert man["version"] == version
    head = (tmp_path / "s" / "rows.dsa").read_bytes()[:16]
    assert int.from_bytes(head[8:12], "little") == version
    assert man["hparams"]["weight_decay"] == kw.get("weight_decay", 0.0)
    assert man["hparams"]["decoupled_weight_decay"] == kw.get("decoupled_weight_decay", False)


def test_stores_without_the_options_keep_their_bytes(tmp_path):
    """A store created without the options has the header, layout and size of before (format
    version 1): its rows.dsa header holds no new key."""
    s = dsa_core.create(tmp_path / "s", N, D)
    dsa_core.close(s)
    lay = json.loads((tmp_path / "s" / "manifest.json").read_text())["layout"]
    assert set(lay) == {"num_rows", "dim", "dtype", "curvature", "stride", "w", "m", "v",
                        "v_width", "align"}
    assert lay["stride"] == 3 * D


def test_counter_views_need_the_option(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D)
    assert not s.per_row_step and not s.decay_missed_steps
    with pytest.raises(ValueError, match=r"created without per_row_step=True and keeps no "
                                         r"row_steps"):
        _ = s.row_steps
    with pytest.raises(ValueError, match=r"created without decay_missed_steps=True"):
        _ = s.last_steps
    dsa_core.close(s)


def test_older_readers_refuse_version_3(tmp_path, monkeypatch):
    """A version-2 reader says "upgrade" instead of ignoring the counters; stores without the
    options still open."""
    s = dsa_core.create(tmp_path / "s", N, D, per_row_step=True)
    rw = dsa_core.create(tmp_path / "rw", N, D, second_moment="rowwise", weight_decay=0.1)
    dsa_core.close(s)
    dsa_core.close(rw)
    assert dsa_core.FORMAT_VERSION >= 3  # 4: a manifest naming a snapshot chain
    monkeypatch.setattr(_layout, "FORMAT_VERSION", 2)
    dsa_core.close(dsa_core.open(tmp_path / "rw"))
    with pytest.raises(ValueError, match=r"format version 3; this dsa_core reads versions "
                                         r"1\.\.2\. Upgrade dsa_core"):
        dsa_core.open(tmp_path / "s")


# -- manifest, resume, checkpoint, restore ----------------------------------------------------
def test_manifest_round_trip_and_replace(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, **ALL)
    assert (s.weight_decay, s.decoupled_weight_decay) == (0.1, True)
    assert "weight_decay=0.1" in repr(s) and "per_row_step=True" in repr(s)
    s = s._replace(weight_decay=0.02)  # like lr: persisted by the next flush
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "s")
    assert (r.weight_decay, r.decoupled_weight_decay, r.per_row_step, r.decay_missed_steps) \
        == (0.02, True, True, True)
    dsa_core.close(r)


def test_older_manifests_read_as_no_decay(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D)
    dsa_core.close(s)
    path = tmp_path / "s" / "manifest.json"
    man = json.loads(path.read_text())
    del man["hparams"]["weight_decay"], man["hparams"]["decoupled_weight_decay"]
    del man["checksum"]  # older manifests had none either
    path.write_text(json.dumps(man))
    r = dsa_core.open(tmp_path / "s")
    assert (r.weight_decay, r.decoupled_weight_decay) == (0.0, False)
    dsa_core.close(r)


@pytest.mark.parametrize("geom", ["euclid", "euclid_rw", "ball1"])
def test_resume_continues_the_same_trajectory(tmp_path, geom):
    """Closed and reopened, a store with every option continues exactly as one never closed:
    the counters are in the records, the hyperparameters in the manifest."""
    c = GEOMS[geom]
    init = init_rows(np.random.default_rng(0), N, D, c, np.float32)
    kw = {"curvature": c, "init": init, "lr": 0.05, **geo_kw(c), **ALL}
    a = dsa_core.create(tmp_path / "a", N, D, **kw)
    b = dsa_core.create(tmp_path / "b", N, D, **kw)
    plan = batches(10, N, D, batch=30, seed=1)
    for idx, g in plan[:5]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "b")
    for idx, g in plan[5:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert a.store.data.tobytes() == b.store.data.tobytes()
    assert b.row_steps.sum() > 0 and b.last_steps.max() == 10
    dsa_core.close(a)
    dsa_core.close(b)


def test_checkpoint_and_restore_carry_the_counters(tmp_path):
    rng = np.random.default_rng(2)
    s = dsa_core.create(tmp_path / "s", N, D, lr=0.05, **ALL)
    plan = batches(8, N, D, batch=30, seed=rng)
    for idx, g in plan[:4]:
        s = dsa_core.step(s, idx, g)
    dsa_core.checkpoint(s, tmp_path / "ckpt")
    rows_at_4, last_at_4 = s.row_steps.copy(), s.last_steps.copy()
    data_at_4 = s.store.data.copy()
    for idx, g in plan[4:]:
        s = dsa_core.step(s, idx, g)
    assert not np.array_equal(s.row_steps, rows_at_4)
    snap = dsa_core.open(tmp_path / "ckpt", mode="r")
    np.testing.assert_array_equal(snap.row_steps, rows_at_4)
    np.testing.assert_array_equal(snap.last_steps, last_at_4)
    assert not snap.row_steps.flags.writeable  # a read-only open: read-only views
    s = dsa_core.restore(s, snap)
    dsa_core.close(snap)
    assert s.count == 4
    np.testing.assert_array_equal(s.store.data, data_at_4)
    # and restore continues exactly as the run did from step 4
    r = dsa_core.open(tmp_path / "ckpt")
    for idx, g in plan[4:]:
        s = dsa_core.step(s, idx, g)
        r = dsa_core.step(r, idx, g)
    assert s.store.data.tobytes() == r.store.data.tobytes()
    # whole records move between stores of the same layout, counters included
    recs = dsa_core.read_records(s, [3, 7])
    o = dsa_core.create(tmp_path / "o", N, D, lr=0.05, **ALL)
    dsa_core.write_records(o, [3, 7], recs)
    np.testing.assert_array_equal(o.row_steps[[3, 7]], s.row_steps[[3, 7]])
    for x in (s, r, o):
        dsa_core.close(x)


@pytest.mark.parametrize("other", [{}, {"per_row_step": True},
                                   {"decoupled_weight_decay": True,
                                    "decay_missed_steps": True}])
def test_restore_between_layouts_is_refused(tmp_path, store_digest, other):
    s = dsa_core.create(tmp_path / "s", N, D, **ALL)
    o = dsa_core.create(tmp_path / "o", N, D, **other)
    dsa_core.flush(s)
    before = store_digest(tmp_path / "s")
    with pytest.raises(ValueError, match="records move only between stores created the same"):
        dsa_core.restore(s, o)
    assert store_digest(tmp_path / "s") == before
    dsa_core.close(s)
    dsa_core.close(o)


def test_journaled_step_rolls_the_counters_back(tmp_path, monkeypatch):
    """durability="step": the undo journal holds whole records, so a step that fails after
    the kernel ran leaves counters and decayed weights as they were."""
    s = dsa_core.create(tmp_path / "s", N, D, durability="step", init="normal", **ALL)
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    keep = s.store.data.copy()

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_layout, "write_manifest", broken)
    with pytest.raises(OSError, match="No space left"):
        dsa_core.step(s, [2, 5], np.ones((2, D), np.float32))
    np.testing.assert_array_equal(s.store.data, keep)
    monkeypatch.undo()
    dsa_core.close(s)


# -- the bias table and its edges ---------------------------------------------------------------
@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.5, 0.9999), (0.0, 0.99)])
@pytest.mark.parametrize("geom", ["euclid", "euclid_rw", "ball1"])
def test_per_row_counts_past_the_table(tmp_path, geom, betas):
    """Per-row counts set by an importer anywhere: inside the bias table, at and past the
    count where both corrections are exactly 1.0, past the table's size (pow calls for
    b2 = 0.9999, whose corrections saturate only at t ~ 374k): kernel == oracle, bit for
    bit."""
    c = GEOMS[geom]
    dtype = np.float32
    rng = np.random.default_rng(3)
    n = 40
    init = init_rows(rng, n, D, c, dtype)
    s = dsa_core.create(tmp_path / "s", n, D, curvature=c, init=init, lr=0.05, betas=betas,
                        per_row_step=True, **geo_kw(c))
    sat = max(math.ceil(math.log(2.0**-54) / math.log(b)) if b else 1 for b in betas)
    counts = np.array([0, 1, 2, 354, 355, 356, 3725, 36000, 37411, 37412, 37413, 65534,
                       65535, 65536, 70000, sat - 2, sat - 1, sat, sat + 1, 10**6, 2**31 - 9,
                       7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
                       25], np.int64)
    s.row_steps[:] = counts
    s = dsa_core.set_count(s, 1000)
    ref = Oracle(init, c, {"per_row_step": True})
    ref.rows[:] = counts
    for idx, g in batches(4, n, D, batch=60, seed=rng):  # rng: after init_rows
        s = dsa_core.step(s, idx, g)
        ref.step(s, idx, g, s.count)
    ref.check(s, dtype, D)
    dsa_core.close(s)


def test_bias_table_matches_python_pow():
    """The kernels' table holds exactly Python's 1 - b**t (libm pow), and the saturation
    count is the first t where both are 1.0."""
    from dsa_core._intrinsics import OP_NTAB, OP_SAT, OP_TAB, options_array

    for betas in ((0.9, 0.999), (0.5, 0.99), (0.0, 0.0), (0.95, 0.9999)):
        op = options_array(rs_off=0, betas=betas)
        ntab = int(op[OP_NTAB])
        tab = op[OP_TAB:].reshape(ntab, 3)
        t = np.unique(np.r_[1:50, np.linspace(1, ntab - 1, 2000).astype(int)])
        t = t[t < ntab]  # betas (0, 0): ntab = 1, every count >= 1 is past saturation
        for c, b in ((0, betas[0]), (1, betas[1])):
            np.testing.assert_array_equal(tab[t, c], [1.0 - b ** int(x) for x in t])
        np.testing.assert_array_equal(tab[t, 2], [math.sqrt(1.0 - betas[1] ** int(x))
                                                  for x in t])
        if op[OP_SAT]:
            assert all(1.0 - b**ntab == 1.0 for b in betas)
            assert any(1.0 - b ** (ntab - 1) != 1.0 for b in betas)
        else:
            assert ntab == 1 << 16


# -- bad inputs: rejected with nothing written -------------------------------------------------
@pytest.mark.parametrize(("kw", "exc", "msg"), [
    ({"weight_decay": -0.1}, ValueError, r"Invalid weight_decay value: -0\.1; weight_decay "
                                         r"must be a finite number >= 0"),
    ({"weight_decay": float("nan")}, ValueError, r"Invalid weight_decay value: nan"),
    ({"weight_decay": float("inf")}, ValueError, r"Invalid weight_decay value: inf"),
    ({"weight_decay": "0.1"}, TypeError, r"weight_decay must be a real number >= 0"),
    ({"weight_decay": True}, TypeError, r"weight_decay must be a real number >= 0"),
    ({"decoupled_weight_decay": 1}, TypeError, r"decoupled_weight_decay must be a bool"),
    ({"per_row_step": "yes"}, TypeError, r"per_row_step must be a bool"),
    ({"decay_missed_steps": None}, TypeError, r"decay_missed_steps must be a bool"),
    ({"decay_missed_steps": True}, ValueError,
     r"decay_missed_steps=True needs decoupled_weight_decay=True"),
    ({"decay_missed_steps": True, "weight_decay": 0.1}, ValueError,
     r"decay_missed_steps=True needs decoupled_weight_decay=True"),
])
def test_bad_options_write_nothing(tmp_path, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        dsa_core.create(tmp_path / "s", N, D, **kw)
    assert not (tmp_path / "s").exists()


def test_validation_names_the_caller():
    from dsa_core.tools import validation

    with pytest.raises(ValueError, match=r"^DiskSparseAdam: Invalid weight_decay value: -1\.0"):
        validation.check_weight_decay(-1, what="DiskSparseAdam")
    assert validation.check_weight_decay(0) == 0.0
    assert validation.check_weight_decay_options(1e-2, True, True, True) == \
        (1e-2, True, True, True)
    with pytest.raises(ValueError, match=r"^sparse_adam: decay_missed_steps=True needs"):
        validation.check_weight_decay_options(0.1, False, True, what="sparse_adam")


def test_a_replaced_bad_weight_decay_is_refused_at_step(tmp_path, store_digest):
    s = dsa_core.create(tmp_path / "s", N, D)
    dsa_core.flush(s)
    before = store_digest(tmp_path / "s")
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="State.weight_decay: Invalid weight_decay value"):
            dsa_core.step(s._replace(weight_decay=bad), [1], np.ones((1, D), np.float32))
    assert store_digest(tmp_path / "s") == before
    assert s.current
    dsa_core.close(s)


def test_decoupled_switched_off_later_falls_back_to_l2_and_keeps_counting(tmp_path):
    """The layout option stays; with decoupled decay _replace'd off the store runs L2 (the
    catch-up needs decoupled decay), and ``last_steps`` keeps recording updates."""
    rng = np.random.default_rng(4)
    init = (0.1 * rng.standard_normal((N, D))).astype(np.float32)
    opts = {"weight_decay": 0.1, "decoupled_weight_decay": True, "decay_missed_steps": True}
    s = dsa_core.create(tmp_path / "s", N, D, init=init, lr=0.05, **opts)
    s = s._replace(decoupled_weight_decay=False)
    ref = Oracle(init, 0.0, {**opts, "decoupled_weight_decay": False})
    for t, (idx, g) in enumerate(batches(5, N, D, batch=30, seed=rng), start=1):
        s = dsa_core.step(s, idx, g)
        ref.step(s, idx, g, t)
    ref.check(s, np.float32, D)
    assert s.last_steps.max() == 5
    dsa_core.close(s)


def test_store_arrays_of_counter_stores_are_the_usual_views(tmp_path):
    """weights / exp_avg / exp_avg_sq are unchanged views of a store with counters."""
    s = dsa_core.create(tmp_path / "s", N, D, init="normal", **ALL)
    w, m, v = store_arrays(s)
    assert w.shape == m.shape == v.shape == (N, D)
    s = dsa_core.step(s, [4], np.ones((1, D), np.float32))
    assert m[4].any() and v[4].any() and s.row_steps[4] == 1 and s.last_steps[4] == 1
    dsa_core.close(s)


def test_counters_past_int32(tmp_path):
    """float32 stores keep int32 counters: ``last_step`` holds the step modulo 2**32 and the
    gap is taken modulo 2**32 (exact below 2**32 steps), ``row_step`` saturates at 2**31 - 1
    (where every correction is exactly 1.0)."""
    lr, wd = 0.01, 0.3
    init = np.full((4, D), 0.5, np.float32)
    s = dsa_core.create(tmp_path / "s", 4, D, init=init, lr=lr, weight_decay=wd,
                        decoupled_weight_decay=True, decay_missed_steps=True,
                        per_row_step=True)
    t0 = 2**31 + 2  # the last update of row 1, past int32
    s.last_steps[1] = np.int64(t0).astype(np.int32)  # its low 32 bits, as a step stores it
    s.row_steps[2] = 2**31 - 1
    s = dsa_core.set_count(s, t0 + 2)
    s = dsa_core.step(s, [1, 2], np.zeros((2, D), np.float32))  # step t0 + 3: row 1 missed 2
    keep = 1.0 - lr * wd
    np.testing.assert_array_equal(s.weights[1], init[1] * np.float32(keep**3))
    assert s.last_steps[1] == np.int64(t0 + 3).astype(np.int32)
    assert s.row_steps[2] == 2**31 - 1
    assert np.isfinite(s.weights).all()
    dsa_core.close(s)
