"""``second_moment="rowwise"`` (docs/algorithms.md §7.3): one second moment per row, c == 0.

The kernel is checked against the NumPy oracle in ``test_core_kernels`` (it runs every
geometry there); these tests pin what the option means: the same m as SparseAdam, the same
v when every coordinate of a row has the same |g|, a smaller record, a format version that
older readers refuse, and clear errors.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsa_core
from dsa_core import _layout

N, D = 50, 16


def _batches(rng, steps=6, b=40, same_magnitude=False):
    out = []
    for _ in range(steps):
        if same_magnitude:  # |g_ij| equal along each row, random signs; unique ids (a sum
            idx = rng.choice(N, b, replace=False)  # of duplicates would mix magnitudes)
            g = rng.uniform(1e-3, 2.0, (b, 1)) * rng.choice([-1.0, 1.0], (b, D))
        else:
            idx = rng.integers(0, N, b)
            g = rng.standard_normal((b, D)) * 10.0 ** rng.uniform(-3, 1, (b, 1))
        out.append((idx, g.astype(np.float32)))
    return out


def _pair(tmp_path, **kw):
    init = (0.1 * np.random.default_rng(0).standard_normal((N, D))).astype(np.float32)
    el = dsa_core.create(tmp_path / "el", N, D, init=init, lr=0.05, **kw)
    rw = dsa_core.create(tmp_path / "rw", N, D, init=init, lr=0.05, second_moment="rowwise",
                         **kw)
    return el, rw


@pytest.mark.parametrize("maximize", [False, True])
def test_first_moment_is_sparse_adams(tmp_path, maximize):
    """m depends on the gradients only, so it equals the elementwise store's bit for bit."""
    el, rw = _pair(tmp_path, maximize=maximize)
    for idx, g in _batches(np.random.default_rng(1)):
        el = dsa_core.step(el, idx, g)
        rw = dsa_core.step(rw, idx, g)
    np.testing.assert_array_equal(rw.exp_avg, el.exp_avg)
    assert rw.exp_avg_sq.shape == (N, 1)
    assert not np.array_equal(rw.weights, el.weights)  # the update itself differs
    dsa_core.close(el)
    dsa_core.close(rw)


def test_equal_magnitudes_give_the_elementwise_v(tmp_path):
    """mean_j g_j^2 == g_j^2 when |g_j| is constant along the row: v agrees coordinate-wise,
    and the weights agree up to the placement of eps (after vs before the bias correction)."""
    el, rw = _pair(tmp_path)
    for idx, g in _batches(np.random.default_rng(2), same_magnitude=True):
        el = dsa_core.step(el, idx, g)
        rw = dsa_core.step(rw, idx, g)
    touched = el.exp_avg_sq.any(axis=1)
    np.testing.assert_array_equal(np.broadcast_to(rw.exp_avg_sq, (N, D))[touched],
                                  el.exp_avg_sq[touched])
    np.testing.assert_allclose(rw.weights, el.weights, rtol=0, atol=1e-6)
    dsa_core.close(el)
    dsa_core.close(rw)


@pytest.mark.parametrize(("weights", "itemsize", "expect"), [
    (True, 4, (2 * D + 1) * 4), (False, 4, (D + 1) * 4), (False, 8, (D + 1) * 8)])
def test_record_holds_one_v(tmp_path, weights, itemsize, expect):
    st = dsa_core.create(tmp_path / "s", N, D, weights=weights, second_moment="rowwise",
                         dtype="float32" if itemsize == 4 else "float64")
    assert st.store.layout.stride * itemsize == expect
    assert (tmp_path / "s" / "rows.dsa").stat().st_size == 4096 + N * expect
    assert st.second_moment == "rowwise"
    dsa_core.close(st)


def test_resume_continues_the_same_trajectory(tmp_path):
    """Reopened, a row-wise store keeps its kind and continues exactly as one never closed."""
    _, a = _pair(tmp_path)
    dsa_core.close(_)
    b = dsa_core.create(tmp_path / "b", N, D, init=a.weights.copy(), lr=0.05,
                        second_moment="rowwise")
    batches = _batches(np.random.default_rng(3), steps=8)
    for idx, g in batches[:4]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "b")
    assert b.second_moment == "rowwise" and b.count == 4
    for idx, g in batches[4:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert a.store.data.tobytes() == b.store.data.tobytes()
    dsa_core.close(a)
    dsa_core.close(b)


def test_older_readers_refuse_rowwise_stores(tmp_path, monkeypatch):
    """Version 2 in header and manifest: a version-1 reader says "upgrade" instead of
    reading v as dim elements past the record's end. Elementwise stores stay version 1."""
    el, rw = _pair(tmp_path)
    dsa_core.close(el)
    dsa_core.close(rw)
    assert json.loads((tmp_path / "el" / "manifest.json").read_text())["version"] == 1
    assert json.loads((tmp_path / "rw" / "manifest.json").read_text())["version"] == 2
    monkeypatch.setattr(_layout, "FORMAT_VERSION", 1)
    dsa_core.close(dsa_core.open(tmp_path / "el"))
    with pytest.raises(ValueError, match=r"format version 2; this dsa_core reads versions "
                                         r"1\.\.1\. Upgrade dsa_core"):
        dsa_core.open(tmp_path / "rw")


@pytest.mark.parametrize(("kw", "exc", "msg"), [
    ({"second_moment": "row"}, ValueError,
     r"second_moment must be one of \('elementwise', 'rowwise'\) .*, got 'row'"),
    ({"second_moment": None}, ValueError, r"second_moment must be one of"),
    ({"second_moment": "rowwise", "curvature": 1.0}, ValueError,
     (r"second_moment='rowwise' is for curvature == 0: the ball kernel \(curvature 1\.0\) "
      r"already keeps one second-moment scalar per row")),
])
def test_bad_second_moment_writes_nothing(tmp_path, kw, exc, msg):
    with pytest.raises(exc, match=msg):
        dsa_core.create(tmp_path / "s", N, D, **kw)
    assert not (tmp_path / "s").exists()


def test_ball_and_elementwise_report_their_kind(tmp_path):
    b = dsa_core.create(tmp_path / "b", N, D, curvature=1.0)
    e = dsa_core.create(tmp_path / "e", N, D)
    assert (b.second_moment, e.second_moment) == ("riemannian", "elementwise")
    assert "second_moment" not in e.layout  # byte-identical to format version 1
    dsa_core.close(b)
    dsa_core.close(e)
