"""The same ``create`` arguments give the same initial table on both store kinds.

Both kinds compute a row's initial weights as a pure function of ``(seed, row)``
(``dsa_core._init``): the log store when a never-written row is read, the in-place store
when it fills its file at create (in chunks, on the kernels' thread pool).
"""

from __future__ import annotations

import numpy as np
import pytest

import dsa_core
from dsa_core import _init, _state
from dsa_core._inplace import store as _store

N, D = 1500, 13  # odd dim: the last column of a row is half of a polar pair


def _table(state):
    return dsa_core.read_records(state, np.arange(state.num_rows))


def _both(tmp_path, **kw):
    a = dsa_core.create(tmp_path / "inplace", storage="inplace", overwrite=True, **kw)
    b = dsa_core.create(tmp_path / "log", storage="log", overwrite=True, **kw)
    try:
        return _table(a), _table(b)
    finally:
        dsa_core.close(a)
        dsa_core.close(b)


@pytest.mark.parametrize("init", ["normal", "uniform"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("curvature", [0.0, 1.0, 900.0])  # 900: the ball's radius projects
def test_named_inits_are_bit_identical_on_both_kinds(tmp_path, init, dtype, curvature):
    a, b = _both(tmp_path, num_rows=N, dim=D, init=init, init_scale=0.1, seed=7, dtype=dtype,
                 curvature=curvature)
    assert a.dtype == b.dtype == np.dtype(dtype)
    assert a.tobytes() == b.tobytes()
    w = a[:, :D].astype(np.float64)
    assert w.std() > 0 and not a[:, D:].any()  # weights drawn, m and v zero
    if curvature == 900.0:  # every row was projected onto the usable ball
        radius = float(_state.maxnorm(curvature, _state.default_ball_eps(dtype), dtype))
        assert np.linalg.norm(w, axis=1).max() <= radius * (1 + 1e-6)


@pytest.mark.parametrize("kw", [
    {"weights": False},
    {"init": None},
    {"init": "zeros", "second_moment": "rowwise"},
    {"init": "normal", "first_moment": "bfloat16", "align": 512},
    {"init": "uniform", "per_row_step": True, "decoupled_weight_decay": True,
     "decay_missed_steps": True, "weight_decay": 0.1},
])
def test_every_layout_starts_the_same_on_both_kinds(tmp_path, kw):
    a, b = _both(tmp_path, num_rows=N, dim=D, seed=3, **kw)
    assert a.tobytes() == b.tobytes()


def test_the_fill_does_not_depend_on_chunks_or_threads(tmp_path, monkeypatch):
    kw = dict(num_rows=N, dim=D, init="normal", seed=11, storage="inplace", overwrite=True)
    ref = dsa_core.create(tmp_path / "ref", **kw)
    want = _table(ref)
    dsa_core.close(ref)
    monkeypatch.setattr(_store, "INIT_CHUNK_BYTES", 1000)  # rows of many small chunks
    threads = dsa_core.get_num_threads()
    try:
        for n in (1, 3):
            dsa_core.set_num_threads(n)
            s = dsa_core.create(tmp_path / f"t{n}", **kw)
            assert _table(s).tobytes() == want.tobytes()
            dsa_core.close(s)
    finally:
        dsa_core.set_num_threads(threads)
    rows = np.array([N - 1, 0, 700, 0])  # and they are the log store's values of those rows
    spec = _init.InitSpec("normal", 1e-2, 11, None, D, 0, want.shape[1], want.dtype)
    np.testing.assert_array_equal(_init.initial_records(rows, spec), want[rows])


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_the_values_are_pinned(tmp_path, storage):
    """The function is part of the format: a log store's unwritten rows read as it, so it
    may never change. Row 0 of ``create(..., init="normal", seed=0)`` (init_scale 0.01)."""
    s = dsa_core.create(tmp_path / "s", 10, 4, init="normal", seed=0, storage=storage)
    want = np.array([0.00082483387, -0.00525732, 0.0019962885, -0.0038447788], np.float32)
    np.testing.assert_array_equal(dsa_core.gather(s, [0])[0], want)  # every bit
    dsa_core.close(s)


@pytest.mark.parametrize("storage", ["inplace", "log"])
@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, True, "0", None])
def test_seed_is_checked_the_same_on_both_kinds(tmp_path, storage, seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\)"):
        dsa_core.create(tmp_path / "s", 10, 4, init="normal", seed=seed, storage=storage)
    assert not (tmp_path / "s").exists()


def test_the_largest_seed_works_on_both_kinds(tmp_path):
    a, b = _both(tmp_path, num_rows=50, dim=4, init="normal", seed=2**64 - 1)
    assert a.tobytes() == b.tobytes() and a[:, :4].any()
    c, _ = _both(tmp_path, num_rows=50, dim=4, init="normal", seed=np.uint64(2**64 - 1))
    assert c.tobytes() == a.tobytes()
