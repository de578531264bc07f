"""The NumPy oracle harness of the kernel tests (core/test_core_kernels.py, test_weight_decay.py,
test_per_row_step.py): the geometries a test runs on, initial rows and batch streams, one
oracle step, the comparison kernel vs oracle (exact, or the float64-ball tolerance explained in
test_core_kernels' docstring), and ``Oracle``: the oracle's arrays and counters for one store.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dsa_core
from dsa_core import _reference as R


class Rowwise(float):
    """c == 0 with ``second_moment="rowwise"`` (docs/algorithms.md §7.3); a float, so
    ``c == 0`` holds."""

    rowwise = True


class Bf16(float):
    """c == 0 with ``first_moment="bfloat16"`` (docs/algorithms.md §6); float32 stores only."""

    bf16 = True


class RowwiseBf16(float):
    rowwise = True
    bf16 = True


def rowwise(c) -> bool:
    return getattr(c, "rowwise", False)


def bf16(c) -> bool:
    return getattr(c, "bf16", False)


def sm(c) -> str:
    """The ``second_moment`` argument for geometry ``c``."""
    return "rowwise" if rowwise(c) else "elementwise"


def geo_kw(c, dtype=np.float32) -> dict:
    """create() keywords of geometry ``c`` (skips the test: bfloat16 m is float32-only)."""
    if bf16(c) and np.dtype(dtype) != np.float32:
        pytest.skip("first_moment='bfloat16' is for float32 stores")
    return {"second_moment": sm(c), "first_moment": "bfloat16" if bf16(c) else "full"}


GEOMS = {"euclid": 0.0, "euclid_rw": Rowwise(0.0), "euclid_bf16": Bf16(0.0),
         "euclid_rw_bf16": RowwiseBf16(0.0), "ball1": 1.0, "ball.5": 0.5}
NO_BALL_HALF = ["euclid", "euclid_rw", "euclid_bf16", "euclid_rw_bf16", "ball1"]
DTYPES = {"f32": np.float32, "f64": np.float64}


# -- oracles --------------------------------------------------------------------------------
def ref_step(P, M, V, idx, G, t, c, **kw):
    """One oracle step on plain arrays (numpy warnings off: NaN/Inf cases are intended)."""
    with np.errstate(all="ignore"):
        if c == 0:
            kw.pop("ball_eps", None)
            if bf16(c):
                R.euclid_bf16m_step(P, M, V, idx, G, t, rowwise=rowwise(c), **kw)
            else:
                (R.euclid_rowwise_step if rowwise(c) else R.euclid_step)(P, M, V, idx, G, t,
                                                                         **kw)
        else:
            R.poincare_step(P, M, V, idx, G, t, curvature=c, **kw)


def exact(c: float, dtype, dim: int) -> bool:
    """Row reductions (the ball's, and the row-wise mean of g²) in float64 storage with
    dim >= 8 sum in numpy's pairwise order in the oracle: last-bit differences."""
    return (c == 0 and not rowwise(c)) or dtype == np.float32 or dim < 8


def assert_matches(actual, desired, c, dtype, dim, what=""):
    """Kernel vs oracle: exact (NaN positions equal) or float64-ball tolerance (module doc)."""
    for name, a, b in zip("PMV", actual, desired, strict=True):
        if exact(c, dtype, dim):
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {name}")
        else:
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"{what} {name}")


def init_rows(rng, n, dim, c, dtype):
    """Weights for tests: N(0, 0.1^2) for c == 0; inside the ball for c > 0, with one row
    beyond the float32 projection radius, one near it and one at the origin."""
    if c == 0:
        return (0.1 * rng.standard_normal((n, dim))).astype(dtype)
    x = rng.standard_normal((n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    r = rng.uniform(0.0, 0.95, n)
    k = min(n, 3)
    r[:k] = (0.9999, 0.995, 0.0)[:k]
    return (x * (r / np.sqrt(c))[:, None]).astype(dtype)


def batch_stream(rng, n, dim, dtype, steps=8):
    """Mixed batches: unsorted with duplicates, sorted unique (fast path), empty, one id
    repeated, a single row; gradient scales from 1e-3 to 10."""
    kinds = itertools.cycle(["dups", "sorted", "dups", "empty", "same", "single"])
    out = []
    for _ in range(steps):
        kind = next(kinds)
        if kind == "dups":
            idx = rng.integers(0, n, 3 * n // 2)
        elif kind == "sorted":
            idx = np.sort(rng.choice(n, n // 2, replace=False))
        elif kind == "empty":
            idx = np.empty(0, np.int64)
        elif kind == "same":
            idx = np.full(5, rng.integers(n))
        else:
            idx = rng.integers(0, n, 1)
        scale = 10.0 ** rng.uniform(-3, 1)
        out.append((idx.astype(np.int64), (scale * rng.standard_normal((idx.size, dim)))
                    .astype(dtype)))
    return out


def make_store(path, c, dtype, init, **kw):
    kw.setdefault("lr", 0.05)
    for k, v in geo_kw(c, dtype).items():
        kw.setdefault(k, v)
    return dsa_core.create(path, init.shape[0], init.shape[1], curvature=c, init=init,
                           dtype=np.dtype(dtype).name, **kw)


def oracle_state(init, c):
    v_width = 1 if (c or rowwise(c)) else init.shape[1]
    return init.copy(), np.zeros_like(init), np.zeros((init.shape[0], v_width), init.dtype)


def store_arrays(state):
    return state.weights, state.exp_avg, state.exp_avg_sq


def hp(state):
    return {"lr": state.lr, "betas": state.betas, "eps": state.eps, "maximize": state.maximize,
                "ball_eps": state.ball_eps}


class Oracle:
    """The oracle's arrays and counters for one store, stepped like it."""

    def __init__(self, init, c, opts):
        self.c = c
        self.P, self.M, self.V = oracle_state(init, c)
        n = init.shape[0]
        self.rows = np.zeros(n, np.int64) if opts.get("per_row_step") else None
        self.last = np.zeros(n, np.int64) if opts.get("decay_missed_steps") else None
        self.wd = opts.get("weight_decay", 0.0)
        self.decoupled = opts.get("decoupled_weight_decay", False)

    def step(self, state, idx, G, t, lr=None):
        kw = {"lr": state.lr if lr is None else lr, "betas": state.betas, "eps": state.eps,
              "maximize": state.maximize, "ball_eps": state.ball_eps,
              "weight_decay": self.wd, "decoupled_weight_decay": self.decoupled,
              "row_steps": self.rows, "last_steps": self.last}
        ref_step(self.P, self.M, self.V, idx, G, t, self.c, **kw)

    def check(self, state, dtype, dim, what="", long_run=False):
        if long_run and self.c > 0 and dtype == np.float64 and dim >= 8:
            # 200 steps: the last-bit differences of numpy's pairwise sums compound near the
            # boundary; the §5 float64 ball tolerance (test_core_kernels' module docstring)
            for a, b in zip(store_arrays(state), (self.P, self.M, self.V), strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-11, err_msg=what)
        else:
            assert_matches(store_arrays(state), (self.P, self.M, self.V), self.c, dtype, dim,
                           what)
        if self.rows is not None:
            np.testing.assert_array_equal(state.row_steps, self.rows, err_msg=what)
        if self.last is not None:
            np.testing.assert_array_equal(state.last_steps, self.last, err_msg=what)
