"""dsa_core against its anchors, following the reference-test recipe of docs/algorithms.md §5.

* ``curvature == 0`` against ``torch.optim.SparseAdam`` (docs/algorithms.md §2.2);
* ``curvature > 0`` against ``geoopt.optim.SparseRiemannianAdam`` on
  ``Stereographic(k=-c)`` (docs/algorithms.md §3.2), comparing our (n, 1) second moment with
  every column of geoopt's (n, d) ``exp_avg_sq``.

Both anchors are driven exactly as the spec says: ``p.grad = torch.sparse_coo_tensor(idx[None],
vals, p.shape)`` (uncoalesced, duplicates included), then ``opt.step()``; the store gets the
same ``(idx, vals)``. Tolerances are the spec's recommended ``assert_allclose`` tolerances
(§5), unchanged. Where §5 gives only ``atol`` for a quantity, ``rtol=0`` is used (stricter
than numpy's default).

The default run covers a representative subset (every config and dim at least once, both
dtypes); the full 3 seeds x 3 dims x 6 configs x 2 dtypes grid is marked ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

import dsa_core

torch = pytest.importorskip("torch")
geoopt = pytest.importorskip("geoopt")

pytestmark = pytest.mark.torch

STEPS = 200
SEEDS = (0, 1, 2)
DIMS = (16, 10, 3)
DTYPES = {"f32": np.float32, "f64": np.float64}

# docs/algorithms.md §5 configs: name -> (curvature, create() kwargs)
CONFIGS = {
    "euclid-default": (0.0, {"lr": 1e-2}),
    "euclid-lr.1-max": (0.0, {"lr": 0.1, "betas": (0.5, 0.99), "eps": 1e-6, "maximize": True}),
    "ball-c1-lr.01": (1.0, {"lr": 0.01}),
    "ball-c1-lr.05": (1.0, {"lr": 0.05}),
    "ball-c.5-lr.01": (0.5, {"lr": 0.01}),
    "ball-c2-lr.05": (2.0, {"lr": 0.05}),
}

# the representative subset that runs by default: (seed, dim, config, dtype)
DEFAULT_CASES = {
    (0, 16, "euclid-default", "f32"), (0, 10, "euclid-lr.1-max", "f32"),
    (0, 3, "euclid-default", "f32"), (1, 3, "euclid-lr.1-max", "f32"),
    (0, 10, "euclid-default", "f64"), (0, 16, "euclid-lr.1-max", "f64"),
    (0, 16, "ball-c1-lr.01", "f32"), (0, 16, "ball-c1-lr.05", "f32"),
    (0, 10, "ball-c.5-lr.01", "f32"), (0, 10, "ball-c2-lr.05", "f32"),
    (1, 3, "ball-c1-lr.05", "f32"),  # d = 3, lr = .05: the worst case measured in §5
    (0, 3, "ball-c2-lr.05", "f64"), (0, 10, "ball-c1-lr.01", "f64"),
}


def _tol(curvature: float, dtype, dim: int) -> dict[str, dict[str, float]]:
    """The §5 ``assert_allclose`` tolerances for P, M and V."""
    if curvature == 0:
        t = {"rtol": 1e-5, "atol": 3e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-13}
        return {"P": t, "M": t, "V": t}
    if dtype == np.float64:
        t = {"rtol": 1e-10, "atol": 1e-11}
        return {"P": t, "M": t, "V": t}
    v = {"rtol": 1e-4, "atol": 4e-6}
    if dim >= 10:
        return {"P": {"rtol": 0, "atol": 2e-5}, "M": {"rtol": 0, "atol": 5e-7}, "V": v}
    return {"P": {"rtol": 0, "atol": 2e-4}, "M": {"rtol": 0, "atol": 2e-6}, "V": v}


LOCKSTEP_TOL = {"P": {"rtol": 0, "atol": 2e-7}, "M": {"rtol": 0, "atol": 1e-6},
                "V": {"rtol": 1e-6, "atol": 1e-7}}


def _anchor(init: np.ndarray, curvature: float, kw: dict):
    """The anchor optimizer on a copy of ``init`` (torch SparseAdam or geoopt,
    docs/algorithms.md §5)."""
    data = torch.from_numpy(init.copy())
    if curvature == 0:
        p = torch.nn.Parameter(data)
        opt = torch.optim.SparseAdam([p], **kw)
    else:
        k = torch.tensor(-curvature, dtype=data.dtype)  # float64 params need a float64 k
        p = geoopt.ManifoldParameter(data, manifold=geoopt.Stereographic(k))
        opt = geoopt.optim.SparseRiemannianAdam([p], **kw)
    return p, opt


def _anchor_step(p, opt, idx: np.ndarray, vals: np.ndarray) -> None:
    p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], torch.from_numpy(vals),
                                     p.shape, check_invariants=True)
    opt.step()


def _anchor_state(p, opt):
    s = opt.state[p]
    return (p.detach().numpy().copy(), s["exp_avg"].numpy().copy(),
            s["exp_avg_sq"].numpy().copy())


def _compare(ours, anchor, tol, what: str) -> dict[str, float]:
    """assert_allclose on P, M and V (our (n, 1) V against every column of the anchor's)."""
    dev = {}
    for name, a, b in zip("PMV", ours, anchor, strict=True):
        a = np.broadcast_to(a, b.shape)
        np.testing.assert_allclose(a, b, err_msg=f"{what}: {name}", **tol[name])
        dev[name] = float(np.abs(a.astype(np.float64) - b).max())
    return dev


def _cases():
    for cfg in CONFIGS:
        for dt in DTYPES:
            for dim in DIMS:
                for seed in SEEDS:
                    marks = [] if (seed, dim, cfg, dt) in DEFAULT_CASES else [pytest.mark.slow]
                    yield pytest.param(seed, dim, cfg, dt, marks=marks,
                                       id=f"{cfg}-d{dim}-{dt}-s{seed}")


@pytest.mark.parametrize(("seed", "dim", "cfg", "dt"), list(_cases()))
def test_free_running_200_steps(tmp_path, spec_batches, spec_init, spec_touched,
                                seed, dim, cfg, dt):
    """§5: 200 free-running steps against the anchor; never-touched rows bitwise unchanged."""
    curvature, kw = CONFIGS[cfg]
    dtype = DTYPES[dt]
    init = spec_init(seed, dim, curvature, dtype)
    batches = spec_batches(seed, dim)
    state = dsa_core.create(tmp_path / "s", 1000, dim, curvature=curvature, init=init,
                            dtype=np.dtype(dtype).name, **kw)
    p, opt = _anchor(init, curvature, kw)
    for idx, vals in batches:
        vals = vals.astype(dtype)
        _anchor_step(p, opt, idx, vals)
        state = dsa_core.step(state, idx, vals)
    assert state.count == opt.state[p]["step"] == STEPS

    ours = (state.weights, state.exp_avg, state.exp_avg_sq)
    assert state.exp_avg_sq.shape == ((1000, dim) if curvature == 0 else (1000, 1))
    anchor = _anchor_state(p, opt)
    _compare(ours, anchor, _tol(curvature, dtype, dim), cfg)

    untouched = ~spec_touched(batches)
    assert 50 < untouched.sum() < 200  # §5: "about 100 rows are never touched"
    assert not untouched[:3].any()
    np.testing.assert_array_equal(state.weights[untouched], init[untouched])
    assert not state.exp_avg[untouched].any()
    assert not state.exp_avg_sq[untouched].any()
    np.testing.assert_array_equal(anchor[0][untouched], init[untouched])
    dsa_core.close(state)


LOCKSTEP_CASES = [
    pytest.param(cfg, dim, id=f"{cfg}-d{dim}")
    for cfg in ("euclid-default", "ball-c1-lr.05") for dim in DIMS
]


@pytest.mark.parametrize(("cfg", "dim"), LOCKSTEP_CASES)
def test_lock_step(tmp_path, spec_batches, spec_init, cfg, dim):
    """§5 lock-step (float32): copy the anchor's state in, one step each, compare.

    Separates the per-step error from the error that compounds over 200 steps. Rows that are
    not in a batch must be bitwise equal to the anchor's (both left them untouched).
    """
    curvature, kw = CONFIGS[cfg]
    init = spec_init(0, dim, curvature, np.float32)
    state = dsa_core.create(tmp_path / "s", 1000, dim, curvature=curvature, init=init, **kw)
    p, opt = _anchor(init, curvature, kw)
    worst = dict.fromkeys("PMV", 0.0)
    for t, (idx, vals) in enumerate(spec_batches(0, dim), start=1):
        if t > 1:
            P, M, V = _anchor_state(p, opt)
            state.weights[...] = P
            state.exp_avg[...] = M
            state.exp_avg_sq[...] = V[:, :state.exp_avg_sq.shape[1]]
        state = state._replace(count=t - 1)
        _anchor_step(p, opt, idx, vals)
        state = dsa_core.step(state, idx, vals)
        anchor = _anchor_state(p, opt)
        ours = (state.weights, state.exp_avg, state.exp_avg_sq)
        dev = _compare(ours, anchor, LOCKSTEP_TOL, f"{cfg} lock-step t={t}")
        worst = {k: max(worst[k], dev[k]) for k in worst}
        out = np.ones(1000, bool)
        out[idx] = False
        np.testing.assert_array_equal(state.weights[out], anchor[0][out])
        np.testing.assert_array_equal(state.exp_avg[out], anchor[1][out])
    assert state.count == STEPS
    dsa_core.close(state)
