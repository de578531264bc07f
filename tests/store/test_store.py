"""The store's life cycle: create/open/flush/close, resume in a new process, compile hygiene,
the writer lock, named inits, views, the documented plain-numpy layout, and a table of bad
inputs that must be rejected before anything is written.

The life-cycle, lock, init and bad-input tests take the ``kind`` fixture (both kinds
promise the same; the damaged ``rows.dsa`` cases are the in-place kind's). In place only, as docs/storage.md ("What still differs") lists: the
whole-table views, a reader that sees the writer's unflushed rows, the ``rows.dsa`` file
format and its damage cases, ``access=`` paging and the mapping's unmapping."""

from __future__ import annotations

import errno
import json
import math
import struct
import zlib
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import dsa_core
from helpers import TESTS, create, num_threads, records, varied_steps
from dsa_core._kernels_euclid import adam_rows_euclid
from dsa_core._kernels_poincare import adam_rows_poincare

HEADER = 4096  # documented in dsa_core/_layout.py


def _grad(b, dim=4, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((b, dim)).astype(dtype)


def _tree(path: Path, store_digest) -> tuple:
    """Every file's sha256 plus every directory name under ``path``."""
    dirs = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_dir())
    return store_digest(path), dirs


def _read_with_numpy(path: Path):
    """Exactly the recipe of the dsa_core._layout docstring (plus m and v)."""
    with open(path / "manifest.json") as f:
        lay = json.load(f)["layout"]
    rec = np.memmap(path / "rows.dsa", dtype=lay["dtype"], mode="r", offset=HEADER,
                    shape=(lay["num_rows"], lay["stride"]))
    w = None if lay["w"] is None else rec[:, lay["w"]:lay["w"] + lay["dim"]]
    m = rec[:, lay["m"]:lay["m"] + lay["dim"]]
    v = rec[:, lay["v"]:lay["v"] + lay["v_width"]]
    return lay, w, m, v


# -- create / open / flush / close ------------------------------------------------------------
def test_create_step_flush_close_open_roundtrip(tmp_path, kind):
    p = tmp_path / "s"
    s = dsa_core.create(p, 50, 6, curvature=0.5, lr=0.02, betas=(0.8, 0.99), eps=1e-7,
                        maximize=True, nonfinite="skip_row", dtype="float64", ball_eps=1e-4,
                        init="uniform", init_scale=0.1, seed=4, storage=kind)
    assert (s.count, s.num_rows, s.dim, s.dtype, s.curvature) == (0, 50, 6, np.float64, 0.5)
    assert s.has_weights
    assert s.path == p
    for k in range(3):
        s = dsa_core.step(s, [k, 7, k], _grad(3, 6, np.float64, k))
    s = s._replace(lr=0.03, betas=(0.7, 0.95))  # persisted by the next flush
    # before the flush a reader sees the last commit (count 0); after it, count 3
    ro = dsa_core.open(p, mode="r")  # allowed while the writer holds the store
    assert (ro.count, ro.lr) == (0, 0.02)
    dsa_core.close(ro)
    dsa_core.flush(s)
    ro = dsa_core.open(p, mode="r")
    assert (ro.count, ro.lr, ro.betas) == (3, 0.03, (0.7, 0.95))
    data = records(s)
    np.testing.assert_array_equal(records(ro), data)
    dsa_core.close(s)
    dsa_core.close(s)  # safe twice
    with pytest.raises(ValueError, match="is closed"):
        dsa_core.step(s, [0], _grad(1, 6, np.float64))
    with pytest.raises(ValueError, match="is closed"):
        dsa_core.gather(s, [0])
    o = dsa_core.open(p)
    assert o.count == 3
    assert (o.lr, o.betas, o.eps, o.maximize) == (0.03, (0.7, 0.95), 1e-7, True)
    assert (o.ball_eps, o.nonfinite) == (1e-4, "skip_row")
    assert (o.num_rows, o.dim, o.dtype, o.curvature, o.has_weights) == (50, 6, np.float64, 0.5,
                                                                      True)
    np.testing.assert_array_equal(records(o), data)
    np.testing.assert_array_equal(dsa_core.gather(o, [7, 0]), data[[7, 0], :6])
    dsa_core.close(o)
    dsa_core.close(ro)


def test_overwrite_replaces_a_closed_store(tmp_path, kind):
    p = tmp_path / "s"
    s = create(p, 10, 4, kind, seed=1)
    s = dsa_core.step(s, [1], _grad(1))
    dsa_core.close(s)
    s = dsa_core.create(p, 20, 3, overwrite=True, storage=kind)
    assert (s.count, s.num_rows, s.dim, s.storage) == (0, 20, 3, kind)
    assert not records(s).any()
    dsa_core.close(s)
    assert dsa_core.open(p, mode="r").num_rows == 20


def test_remove(tmp_path, kind):
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, 10, 4, storage=kind))
    r = dsa_core.open(p, mode="r")
    assert r.storage == kind
    dsa_core.close(r)
    dsa_core.remove(p)
    assert not p.exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        dsa_core.open(p)


# -- resume in a new process ------------------------------------------------------------------
RESUME_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import dsa_core
    path, batches = sys.argv[1], np.load(sys.argv[2])
    state = dsa_core.open(path)
    assert state.count == 50, state.count
    for k in range(len(batches.files) // 2):
        state = dsa_core.step(state, batches[f"i{k}"], batches[f"g{k}"])
    dsa_core.close(state)
    print("count", state.count)
""")


@pytest.mark.parametrize(("kind", "curvature"), [  # the kinds, as the kind fixture's
    ("inplace", 0.0), ("inplace", 1.0), ("log", 0.0),
    pytest.param("log", 1.0, marks=pytest.mark.slow)])
def test_resume_in_new_process_is_bitwise_identical(tmp_path, spec_batches, curvature, kind):
    """create -> 50 steps -> close -> open in a NEW process -> 50 steps == 100 steps in one."""
    dim = 16
    batches = spec_batches(0, dim, steps=100)
    kw = {"curvature": curvature, "lr": 0.05, "init": "normal", "init_scale": 0.3, "seed": 3,
          "storage": kind}
    if kind == "log":  # a region of 200 of the 1000 rows: the rows go to segments and back
        kw["memory"] = dsa_core.region_memory(
            {"num_rows": 1000, "stride": 2 * dim + (dim if curvature == 0 else 1),
             "dtype": "float32"}, 200)
    one = dsa_core.create(tmp_path / "one", 1000, dim, **kw)
    two = dsa_core.create(tmp_path / "two", 1000, dim, **kw)
    for idx, vals in batches:
        one = dsa_core.step(one, idx, vals)
    dsa_core.close(one)
    for idx, vals in batches[:50]:
        two = dsa_core.step(two, idx, vals)
    dsa_core.flush(two)
    dsa_core.close(two)
    npz = tmp_path / "rest.npz"
    np.savez(npz, **{f"i{k}": i for k, (i, _) in enumerate(batches[50:])},
             **{f"g{k}": g for k, (_, g) in enumerate(batches[50:])})
    run = subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(tmp_path / "two"), str(npz)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["count", "100"]
    one, two = dsa_core.open(tmp_path / "one", "r"), dsa_core.open(tmp_path / "two", "r")
    assert one.count == two.count == 100
    assert one[1:] == two[1:]  # the count and every hyperparameter
    assert records(one).tobytes() == records(two).tobytes()
    if kind == "inplace":  # the same files too
        for name in ("rows.dsa", "manifest.json"):
            assert (one.path / name).read_bytes() == (two.path / name).read_bytes()
    # the 100 steps did change the store (the comparison above has teeth)
    fresh = dsa_core.create(tmp_path / "fresh", 1000, dim, **kw)
    assert records(fresh).tobytes() != records(one).tobytes()
    for x in (fresh, one, two):
        dsa_core.close(x)


# -- compile hygiene --------------------------------------------------------------------------
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("curvature", [0.0, 1.0])
def test_second_step_compiles_nothing_new(tmp_path, curvature, dt):
    kernel = adam_rows_euclid if curvature == 0 else adam_rows_poincare
    s = dsa_core.create(tmp_path / "s", 10, 4, curvature=curvature, dtype=dt)
    s = dsa_core.step(s, [3, 1, 3], _grad(3, 4, np.dtype(dt)))  # may compile or load a cache
    n = len(kernel.signatures)
    assert n >= 1
    s = varied_steps(s, np.dtype(dt))
    assert len(kernel.signatures) == n, kernel.signatures
    dsa_core.close(s)


# Run in a fresh process: in this one, earlier tests (or other test files) may already have
# compiled a specialisation that warmup() misses, which would hide the miss.
WARMUP_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import numpy as np
    import dsa_core
    from dsa_core import _coalesce
    from dsa_core._kernels_euclid import adam_rows_euclid
    from dsa_core._kernels_poincare import adam_rows_poincare
    sys.path.insert(0, sys.argv[2])
    from helpers import varied_steps

    def signatures():
        fns = {"euclid": adam_rows_euclid, "poincare": adam_rows_poincare,
               "dedup": _coalesce._dedup, "sum_rows": _coalesce._sum_rows,
               "gather_rows": _coalesce.gather_rows,
               "bounds": _coalesce.bounds,
               "is_strictly_increasing": _coalesce.is_strictly_increasing}
        return {k: len(f.signatures) for k, f in fns.items()}

    tmp = Path(sys.argv[1])
    dsa_core.warmup()
    out = {"warmup": signatures()}
    for dt in (np.float32, np.float64):
        for c in (0.0, 1.0):
            name = f"{c}-{dt.__name__}"
            s = dsa_core.create(tmp / ("w" + name), 10, 4, curvature=c, dtype=dt.__name__)
            s = varied_steps(s, dt)
            dsa_core.gather(s, [3, 1, 3])
            dsa_core.close(s)
            ext = np.zeros((10, 4), dt)
            nw = dsa_core.create(tmp / ("n" + name), 10, 4, curvature=c, dtype=dt.__name__,
                                 weights=False)
            nw = varied_steps(nw, dt, params_of=lambda idx, ext=ext: ext[np.asarray(idx)])
            dsa_core.close(nw)
    out["writeable"] = signatures()
    for what in ("grad", "idx"):
        for c in (0.0, 1.0):
            s = dsa_core.create(tmp / f"ro-{what}-{c}", 10, 4, curvature=c)
            for ids in ([1, 2, 3], [3, 1, 3]):
                i = np.array(ids, np.int64)
                g = np.ones((3, 4), np.float32)
                (g if what == "grad" else i).flags.writeable = False
                s = dsa_core.step(s, i, g)
            dsa_core.close(s)
        out["read-only " + what] = signatures()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def warmup_report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("warmup")
    run = subprocess.run([sys.executable, "-c", WARMUP_SCRIPT, str(tmp),
                          str(TESTS)],
                         capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def test_after_warmup_no_step_compiles_anything(warmup_report):
    """After warmup(), steps with every canonicalised input variant, both geometries and
    dtypes, weights=True/False, and gather compile nothing (checked in a fresh process)."""
    assert warmup_report["warmup"]["euclid"] >= 2  # f32 and f64
    assert warmup_report["writeable"] == warmup_report["warmup"]


def test_after_warmup_readonly_grad_compiles_nothing(warmup_report):
    """Read-only gradients (np.asarray of a jax.Array is read-only) are warmed too."""
    assert warmup_report["read-only grad"] == warmup_report["warmup"]


def test_after_warmup_readonly_idx_compiles_nothing(warmup_report):
    assert warmup_report["read-only idx"] == warmup_report["read-only grad"]


def test_read_only_and_writeable_gradients_share_one_compiled_variant(warmup_report):
    """numba compiles a kernel apart for read-only arrays: the step hands every gradient over
    read-only, so each kernel has one variant per dtype (float32, float64), whatever the
    caller's gradients were (both kinds were stepped above)."""
    for fn in ("euclid", "poincare", "sum_rows"):
        assert warmup_report["read-only idx"][fn] == 2, (fn, warmup_report)


# -- writer lock ------------------------------------------------------------------------------
LOCK_PROBE = textwrap.dedent("""
    import sys, dsa_core
    try:
        dsa_core.open(sys.argv[1])
    except dsa_core.StoreLockedError as exc:
        print("locked:", exc)
    else:
        print("opened")
    s = dsa_core.open(sys.argv[1], mode="r")
    print("read-only count", s.count)
""")


def test_writer_lock(tmp_path, store_digest, kind):
    p = tmp_path / "s"
    a = dsa_core.create(p, 10, 4, storage=kind)
    assert issubclass(dsa_core.StoreLockedError, RuntimeError)
    with pytest.raises(dsa_core.StoreLockedError, match="already open for writing"):
        dsa_core.open(p)
    with pytest.raises(dsa_core.StoreLockedError, match="already open for writing"):
        dsa_core.open(p, mode="r+")
    ro = dsa_core.open(p, mode="r")  # readers take no lock
    a = dsa_core.step(a, [2, 5], _grad(2))
    # what a reader sees of unflushed steps differs (docs/storage.md): the same mapping in
    # place, the last flush in a log store
    seen = dsa_core.gather(ro, [2])
    assert seen.any() if kind == "inplace" else not seen.any()
    with pytest.raises(ValueError, match="read-only"):
        dsa_core.step(ro, [1], _grad(1))
    dsa_core.flush(a)
    files = store_digest(p)
    with pytest.raises(dsa_core.StoreLockedError):
        dsa_core.create(p, 10, 4, overwrite=True)
    with pytest.raises(dsa_core.StoreLockedError):
        dsa_core.remove(p)
    assert store_digest(p) == files
    # another process is refused too, but may read
    run = subprocess.run([sys.executable, "-c", LOCK_PROBE, str(p)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith("locked: store")
    assert run.stdout.splitlines()[1] == "read-only count 1"
    np.testing.assert_array_equal(dsa_core.gather(dsa_core.open(p, mode="r"), [2, 5]),
                                  dsa_core.gather(a, [2, 5]))  # flushed: every reader sees it
    dsa_core.close(a)  # releases the lock
    b = dsa_core.open(p)
    assert b.count == 1
    dsa_core.close(b)
    c = dsa_core.open(p)  # and again after the second close
    dsa_core.close(c)
    dsa_core.close(ro)


# -- named inits ------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_named_init_normal(tmp_path, dt, kind):
    s = create(tmp_path / "a", 4000, 8, kind, init_scale=0.05, seed=1, dtype=dt)
    rec = records(s)
    w = rec[:, :8].astype(np.float64)
    assert abs(w.mean()) < 0.05 * 0.02
    assert w.std() == pytest.approx(0.05, rel=0.03)
    assert not rec[:, 8:].any()  # m and v
    same = create(tmp_path / "b", 4000, 8, kind, init_scale=0.05, seed=1, dtype=dt)
    other = create(tmp_path / "c", 4000, 8, kind, init_scale=0.05, seed=2, dtype=dt)
    assert rec.tobytes() == records(same).tobytes()
    assert not np.array_equal(w, records(other)[:, :8])
    for x in (s, same, other):
        dsa_core.close(x)


def test_named_init_uniform_and_default_zeros(tmp_path, kind):
    s = create(tmp_path / "u", 4000, 8, kind, init="uniform", init_scale=0.2, seed=0)
    w = dsa_core.gather(s, np.arange(4000)).astype(np.float64)
    assert w.min() >= -0.2
    assert w.max() <= 0.2
    assert w.min() < -0.199
    assert w.max() > 0.199
    assert w.std() == pytest.approx(0.2 / math.sqrt(3), rel=0.03)
    z = dsa_core.create(tmp_path / "z", 100, 8, storage=kind)
    assert not records(z).any()
    dsa_core.close(s)
    dsa_core.close(z)


@pytest.mark.parametrize("init", ["normal", "uniform"])
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("curvature", [1.0, 2.0])
def test_named_init_inside_the_ball(tmp_path, curvature, dt, init, kind):
    """c > 0: named inits start inside the usable ball; rows drawn beyond the projection
    radius (1 - ball_eps)/sqrt(c) are projected onto it, the others are left as drawn."""
    dtype = np.dtype(dt)
    every = np.arange(500)
    big = dsa_core.create(tmp_path / "big", 500, 16, curvature=curvature, init=init,
                          init_scale=1.0, dtype=dt, storage=kind)
    ball_eps = 4e-3 if dtype == np.float32 else 1e-5
    radius = (1 - ball_eps) / math.sqrt(curvature)
    nrm = np.linalg.norm(dsa_core.gather(big, every).astype(np.float64), axis=1)
    tol = 8 * np.finfo(dtype).eps
    assert (nrm < 1 / math.sqrt(curvature)).all()
    assert (nrm <= radius * (1 + tol)).all()
    # with scale 1 in 16 dims nearly every draw lands beyond the radius: projected onto it
    assert np.isclose(nrm, radius, rtol=tol, atol=0).mean() > 0.95
    small = dsa_core.create(tmp_path / "small", 500, 16, curvature=curvature, init=init,
                            init_scale=0.01, dtype=dt, storage=kind)
    nrm = np.linalg.norm(dsa_core.gather(small, every).astype(np.float64), axis=1)
    assert nrm.max() < 0.2 * radius  # nothing projected
    assert dsa_core.gather(small, every).std() == pytest.approx(0.01 if init == "normal" else 0.01 / math.sqrt(3),
                                                rel=0.05)
    big = dsa_core.step(big, np.arange(0, 500, 3), _grad(167, 16, dtype))
    nrm = np.linalg.norm(dsa_core.gather(big, every).astype(np.float64), axis=1)
    assert (nrm < 1 / math.sqrt(curvature)).all()
    dsa_core.close(big)
    dsa_core.close(small)


def test_array_init_is_stored_as_given(tmp_path, kind):
    init = np.random.default_rng(0).uniform(-0.5, 0.5, (30, 5))
    s = dsa_core.create(tmp_path / "s", 30, 5, init=init, dtype="float64", storage=kind)
    np.testing.assert_array_equal(dsa_core.gather(s, np.arange(30)), init)
    ball = dsa_core.create(tmp_path / "b", 30, 5, curvature=1.0, init=init * 0.3, storage=kind)
    np.testing.assert_array_equal(dsa_core.gather(ball, np.arange(30)),
                                  (init * 0.3).astype(np.float32))
    dsa_core.close(s)
    dsa_core.close(ball)


# -- views and the on-disk layout (in place only: docs/storage.md, "What still differs") ------
@pytest.mark.parametrize("curvature", [0.0, 1.0])
def test_views(tmp_path, curvature):
    p = tmp_path / "s"
    s = dsa_core.create(p, 12, 5, curvature=curvature, init="uniform", init_scale=0.1)
    assert s.weights.shape == (12, 5)
    assert s.exp_avg.shape == (12, 5)
    assert s.exp_avg_sq.shape == ((12, 5) if curvature == 0 else (12, 1))
    for view in (s.weights, s.exp_avg, s.exp_avg_sq):
        assert np.shares_memory(view, s.store.data)
    s = dsa_core.step(s, [3, 4, 3], _grad(3, 5))
    rows = dsa_core.gather(s, [4, 3, 4])
    np.testing.assert_array_equal(rows, s.weights[[4, 3, 4]])
    rows[:] = 9.0  # gather returns a copy
    assert not (s.weights == 9.0).any()
    out = np.empty((2, 5), np.float32)
    assert dsa_core.gather(s, [0, 1], out=out) is out
    s.weights[7] = 0.25  # writes through the view reach the file
    s.exp_avg[7] = -1.5
    dsa_core.flush(s)
    _, w, m, v = _read_with_numpy(p)
    np.testing.assert_array_equal(w, s.weights)
    np.testing.assert_array_equal(m, s.exp_avg)
    np.testing.assert_array_equal(v, s.exp_avg_sq)
    assert (w[7] == 0.25).all()
    assert (m[7] == -1.5).all()
    dsa_core.close(s)
    nw = dsa_core.create(tmp_path / "nw", 12, 5, curvature=curvature, weights=False)
    assert nw.exp_avg.shape == (12, 5)
    with pytest.raises(ValueError, match="weights=False"):
        _ = nw.weights
    with pytest.raises(ValueError, match="weights=False"):
        dsa_core.gather(nw, [0])
    dsa_core.close(nw)


@pytest.mark.parametrize(("curvature", "dt", "weights", "align", "sm"), [
    (0.0, "float32", True, 0, "elementwise"), (1.0, "float64", True, 0, "elementwise"),
    (0.0, "float32", True, 512, "elementwise"), (1.0, "float32", False, 64, "elementwise"),
    (0.0, "float32", True, 0, "rowwise"), (0.0, "float64", False, 64, "rowwise")])
def test_store_is_readable_with_plain_numpy(tmp_path, curvature, dt, weights, align, sm):
    """The layout documented in dsa_core/_layout.py: header, record stride and offsets."""
    p = tmp_path / "s"
    n, d = 33, 7
    s = dsa_core.create(p, n, d, curvature=curvature, dtype=dt, weights=weights, align=align,
                        init="normal" if weights else None, init_scale=0.1, second_moment=sm)
    params = np.zeros((4, d), dt)
    s = dsa_core.step(s, [1, 30, 1, 2], _grad(4, d, np.dtype(dt)),
                      **({} if weights else {"params": params}))
    dsa_core.close(s)
    lay, w, m, v = _read_with_numpy(p)
    s = dsa_core.open(p, mode="r")
    itemsize = np.dtype(dt).itemsize
    assert lay["dtype"] == dt
    assert lay["num_rows"] == n
    assert lay["dim"] == d
    assert lay["v_width"] == (1 if curvature or sm == "rowwise" else d)
    assert lay.get("second_moment", "elementwise") == sm
    if align:
        assert (lay["stride"] * itemsize) % align == 0
    assert lay["stride"] >= (d if weights else 0) + d + lay["v_width"]
    raw = (p / "rows.dsa").read_bytes()
    assert len(raw) == HEADER + n * lay["stride"] * itemsize
    assert raw[:8] == b"DSASTORE"
    version, size = struct.unpack("<II", raw[8:16])
    assert version == (2 if sm == "rowwise" else 1)  # v1 readers can read elementwise stores
    assert json.loads((p / "manifest.json").read_text())["version"] == version
    assert json.loads(raw[16:16 + size]) == lay
    crc_at = HEADER - 24  # the header CRC: b"DSAHCRC1" | crc32 | 4 zeros, then the marker
    assert not raw[16 + size:crc_at].strip(b"\0") and not raw[crc_at + 16:HEADER].strip(b"\0")
    assert raw[crc_at:crc_at + 8] == b"DSAHCRC1"
    assert struct.unpack("<I", raw[crc_at + 8:crc_at + 12])[0] == zlib.crc32(raw[:16 + size])
    if weights:
        np.testing.assert_array_equal(w, s.weights)
        assert w[1].any()
        assert w[30].any()
    else:
        assert lay["w"] is None
    np.testing.assert_array_equal(m, s.exp_avg)
    np.testing.assert_array_equal(v, s.exp_avg_sq)
    assert m[30].any()
    assert v[2].any()
    assert not m[0].any()
    dsa_core.close(s)


# -- validation matrix ------------------------------------------------------------------------
BASE = {"num_rows": 10, "dim": 4}
NAN, INF = float("nan"), float("inf")


def _init(value=0.1, shape=(10, 4), row=None, row_value=None):
    a = np.full(shape, value)
    if row is not None:
        a[row] = row_value
    return a


CREATE_CASES = [
    ("lr-zero", {"lr": 0.0}, ValueError, r"Invalid learning rate: 0\.0"),
    ("lr-negative", {"lr": -1e-3}, ValueError, r"Invalid learning rate: -0\.001"),
    ("lr-nan", {"lr": NAN}, ValueError, r"Invalid learning rate: nan"),
    ("lr-inf", {"lr": INF}, ValueError, r"Invalid learning rate: inf"),
    ("lr-string", {"lr": "fast"}, TypeError, r"lr must be a real number"),
    ("eps-zero", {"eps": 0.0}, ValueError, r"Invalid epsilon value: 0\.0"),
    ("eps-negative", {"eps": -1e-8}, ValueError, r"Invalid epsilon value: -1e-08"),
    ("beta0-one", {"betas": (1.0, 0.999)}, ValueError, r"Invalid beta parameter at index 0: 1\.0"),
    ("beta0-negative", {"betas": (-0.1, 0.999)}, ValueError,
     r"Invalid beta parameter at index 0: -0\.1"),
    ("beta1-one", {"betas": (0.9, 1.0)}, ValueError, r"Invalid beta parameter at index 1: 1\.0"),
    ("beta1-big", {"betas": (0.9, 1.5)}, ValueError, r"Invalid beta parameter at index 1: 1\.5"),
    ("curvature-negative", {"curvature": -1.0}, ValueError, r"curvature must be finite and >= 0"),
    ("curvature-nan", {"curvature": NAN}, ValueError, r"curvature must be finite and >= 0"),
    ("curvature-inf", {"curvature": INF}, ValueError, r"curvature must be finite and >= 0"),
    ("num_rows-zero", {"num_rows": 0}, ValueError, r"num_rows must be a positive int, got 0"),
    ("num_rows-negative", {"num_rows": -5}, ValueError, r"num_rows must be a positive int"),
    ("num_rows-float", {"num_rows": 10.0}, TypeError, r"num_rows must be a positive int"),
    ("dim-zero", {"dim": 0}, ValueError, r"dim must be a positive int, got 0"),
    ("dim-negative", {"dim": -1}, ValueError, r"dim must be a positive int"),
    ("dtype-float16", {"dtype": "float16"}, ValueError, r"dtype float16 is not supported"),
    ("dtype-np-float16", {"dtype": np.float16}, ValueError, r"float16"),
    ("dtype-bfloat16", {"dtype": "bfloat16"}, ValueError, r"dtype bfloat16 is not supported"),
    ("dtype-int32", {"dtype": "int32"}, ValueError, r"dtype must be 'float32' or 'float64'"),
    ("dtype-np-int64", {"dtype": np.int64}, ValueError, r"dtype must be 'float32' or 'float64'"),
    ("init-shape", {"init": np.zeros((10, 5))}, ValueError,
     r"init must have shape \(num_rows, dim\) = \(10, 4\), got \(10, 5\)"),
    ("init-transposed", {"init": np.zeros((4, 10))}, ValueError, r"init must have shape"),
    ("init-nan", {"init": _init(row=7, row_value=NAN)}, ValueError,
     r"init must be finite; row 7"),
    ("init-inf", {"init": _init(row=2, row_value=INF)}, ValueError, r"init must be finite; row 2"),
    ("init-outside-ball", {"curvature": 1.0, "init": _init(row=6, row_value=0.6)}, ValueError,
     r"inside the Poincaré ball.*row 6 has norm 1\.2"),
    ("init-on-ball-boundary", {"curvature": 1.0, "init": _init(row=0, row_value=0.5)}, ValueError,
     r"inside the Poincaré ball.*row 0 has norm 1\b"),
    ("init-outside-ball-c4", {"curvature": 4.0, "init": _init(value=0.3)}, ValueError,
     r"inside the Poincaré ball of curvature -4\.0"),
    ("init-weights-false", {"init": _init(), "weights": False}, ValueError,
     r"init sets the weights, but weights=False"),
    ("init-named-weights-false", {"init": "normal", "weights": False}, ValueError,
     r"weights=False stores hold none"),
    ("init-unknown-name", {"init": "xavier"}, ValueError, r"init must be None, an array"),
    ("init-complex", {"init": np.zeros((10, 4), complex)}, TypeError,
     r"init must hold real numbers"),
    ("nonfinite-mode", {"nonfinite": "ignore"}, ValueError, r"nonfinite must be one of"),
    ("maximize-not-bool", {"maximize": "yes"}, TypeError, r"maximize must be a bool"),
    ("ball_eps-one", {"curvature": 1.0, "ball_eps": 1.0}, ValueError, r"ball_eps must lie in"),
    ("align-odd", {"align": 3}, ValueError, r"align must be 0 or a positive multiple of 4"),
]


@pytest.fixture
def ctx(tmp_path, kind):
    """A writable float32 store (10 x 4, c = 0) of each kind that has taken two steps."""
    path = tmp_path / "store"
    state = dsa_core.create(path, 10, 4, init="normal", init_scale=0.1, storage=kind)
    state = dsa_core.step(state, [1, 3, 1], _grad(3))
    state = dsa_core.step(state, [2], _grad(1, seed=1))
    dsa_core.flush(state)
    c = SimpleNamespace(tmp_path=tmp_path, path=path, state=state, others=[], kind=kind)
    yield c
    for s in [c.state, *c.others]:
        dsa_core.close(s)


@pytest.mark.parametrize("target", ["fresh-path", "existing-store-overwrite"])
@pytest.mark.parametrize(("kwargs", "exc", "match"),
                         [pytest.param(k, e, m, id=i) for i, k, e, m in CREATE_CASES])
def test_create_rejects(ctx, store_digest, target, kwargs, exc, match):
    """Bad create() arguments raise before anything is written: no directory appears at a
    fresh path, and an existing (closed) store is not touched even with overwrite=True."""
    dsa_core.close(ctx.state)
    before = _tree(ctx.tmp_path, store_digest)
    args = {**BASE, **kwargs}
    if target == "fresh-path":
        path, extra = ctx.tmp_path / "new", {}
    else:
        path, extra = ctx.path, {"overwrite": True}
    with pytest.raises(exc, match=match):
        dsa_core.create(path, args.pop("num_rows"), args.pop("dim"), **args, **extra)
    assert _tree(ctx.tmp_path, store_digest) == before
    dsa_core.open(ctx.path, mode="r")  # still a valid store


def _weights_false_store(c):
    c.others.append(dsa_core.create(c.tmp_path / "nw", 10, 4, weights=False))
    return c.others[-1]


def _close_then(fn):
    def run(c):
        dsa_core.close(c.state)
        return fn(c)
    return run


def _read_only(c):
    c.others.append(dsa_core.open(c.path, mode="r"))
    return c.others[-1]


def _readonly_params():
    a = np.zeros((2, 4), np.float32)
    a.flags.writeable = False
    return a


g1, g2 = _grad(1), _grad(2)

# (id, prepare(ctx) -> obj or None, call(ctx, obj), exception, match)
CALL_CASES = [
    ("step-idx-out-of-range", None, lambda c, o: dsa_core.step(c.state, [10], g1), IndexError,
     r"idx must lie in \[0, num_rows\) = \[0, 10\); got 10"),
    ("step-idx-far-out-of-range", None,
     lambda c, o: dsa_core.step(c.state, [3, 2**40], g2), IndexError, r"got 1099511627776"),
    ("step-idx-negative", None, lambda c, o: dsa_core.step(c.state, [3, -1], g2), IndexError,
     r"got -1 \(min -1, max 3\)"),
    ("step-idx-float", None, lambda c, o: dsa_core.step(c.state, [1.0], g1), TypeError,
     r"idx must hold integer row ids, got dtype float64"),
    ("step-idx-bool", None, lambda c, o: dsa_core.step(c.state, [True, False], g2), TypeError,
     r"integer row ids, got dtype bool"),
    ("step-idx-2d", None, lambda c, o: dsa_core.step(c.state, [[1, 2]], g2), ValueError,
     r"idx must be 1-D"),
    ("step-idx-scalar", None, lambda c, o: dsa_core.step(c.state, 3, g1), ValueError,
     r"idx must be 1-D"),
    ("step-grad-wrong-dim", None, lambda c, o: dsa_core.step(c.state, [1, 2], _grad(2, 3)),
     ValueError, r"grad must have shape \(len\(idx\), dim\) = \(2, 4\), got \(2, 3\)"),
    ("step-grad-wrong-rows", None, lambda c, o: dsa_core.step(c.state, [1, 2], _grad(3)),
     ValueError, r"= \(2, 4\), got \(3, 4\)"),
    ("step-grad-1d", None, lambda c, o: dsa_core.step(c.state, [1], g1[0]), ValueError,
     r"got \(4,\)"),
    ("step-grad-float64", None,
     lambda c, o: dsa_core.step(c.state, [1, 2], g2.astype(np.float64)), TypeError,
     r"grad must have the store dtype float32, got float64"),
    ("step-grad-int", None,
     lambda c, o: dsa_core.step(c.state, [1, 2], np.ones((2, 4), np.int32)), TypeError,
     r"store dtype float32, got int32"),
    ("step-lr-inf", None, lambda c, o: dsa_core.step(c.state, [1], g1, lr=INF), ValueError,
     r"Invalid learning rate: inf"),
    ("step-lr-negative", None, lambda c, o: dsa_core.step(c.state, [1], g1, lr=-0.1),
     ValueError, r"Invalid learning rate: -0\.1"),
    ("step-lr-nan", None, lambda c, o: dsa_core.step(c.state, [1], g1, lr=NAN), ValueError,
     r"Invalid learning rate: nan"),
    ("step-params-on-weights-store", None,
     lambda c, o: dsa_core.step(c.state, [1, 2], g2, params=np.zeros((2, 4), np.float32)),
     ValueError, r"params/table are only for weights=False stores"),
    ("step-table-on-weights-store", None,
     lambda c, o: dsa_core.step(c.state, [1, 2], g2, table=np.zeros((10, 4), np.float32)),
     ValueError, r"params/table are only for weights=False stores"),
    ("step-closed-state", _close_then(lambda c: None),
     lambda c, o: dsa_core.step(c.state, [1], g1), ValueError, r"is closed; reopen it"),
    ("step-read-only-state", _read_only, lambda c, o: dsa_core.step(o, [1], g1), ValueError,
     r"opened read-only \(mode='r'\)"),
    ("step-params-missing", _weights_false_store, lambda c, o: dsa_core.step(o, [1, 2], g2),
     ValueError, r"created with weights=False: pass the current weight rows"),
    ("step-params-wrong-shape", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, params=np.zeros((3, 4), np.float32)),
     ValueError, r"params must be a \(2, 4\) float32 array"),
    ("step-params-wrong-dtype", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, params=np.zeros((2, 4))), ValueError,
     r"params must be a \(2, 4\) float32 array"),
    ("step-params-and-table", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, params=np.zeros((2, 4), np.float32),
                                table=np.zeros((10, 4), np.float32)),
     ValueError, r"or the whole weight table as table=W of shape \(10, 4\) -- one of the two"),
    ("step-table-wrong-shape", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, table=np.zeros((9, 4), np.float32)),
     ValueError, r"table must be the \(10, 4\) float32 weight table, got \(9, 4\) float32"),
    ("step-table-wrong-dtype", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, table=np.zeros((10, 4))),
     ValueError, r"table must be the \(10, 4\) float32 weight table, got \(10, 4\) float64"),
    ("step-table-not-contiguous", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, table=np.zeros((10, 8), np.float32)[:, ::2]),
     ValueError, r"table must be C-contiguous and writeable"),
    ("step-params-read-only", _weights_false_store,
     lambda c, o: dsa_core.step(o, [1, 2], g2, params=_readonly_params()), ValueError,
     r"params must be writeable"),
    ("flush-read-only-state", _read_only, lambda c, o: dsa_core.flush(o), ValueError,
     r"read-only"),
    ("gather-out-of-range", None, lambda c, o: dsa_core.gather(c.state, [0, 10]), IndexError,
     r"\[0, 10\)"),
    ("create-existing-no-overwrite", None,
     lambda c, o: dsa_core.create(c.path, 10, 4), FileExistsError,
     r"a store already exists at .*pass overwrite=True"),
    ("create-path-is-a-file", lambda c: (c.tmp_path / "f").write_bytes(b"x"),
     lambda c, o: dsa_core.create(c.tmp_path / "f", 10, 4), FileExistsError,
     r"exists and is not a directory"),
    ("open-missing-path", None, lambda c, o: dsa_core.open(c.tmp_path / "nope"),
     FileNotFoundError, r"the directory does not exist"),
    ("open-dir-not-a-store", lambda c: (c.tmp_path / "other").mkdir(),
     lambda c, o: dsa_core.open(c.tmp_path / "other"), FileNotFoundError,
     r"is not a DSA store: it has no manifest\.json"),
    ("open-mode-w", None, lambda c, o: dsa_core.open(c.path, mode="w"), ValueError,
     r"mode must be 'r' \(read-only\) or 'r\+'"),
    ("open-second-writer", None, lambda c, o: dsa_core.open(c.path), dsa_core.StoreLockedError,
     r"already open for writing"),
]


def _damage(kind):
    """Close the store, then damage one of its files in a given way."""
    def prepare(c):
        dsa_core.close(c.state)
        man_path = c.path / "manifest.json"
        rows = c.path / "rows.dsa"
        man = json.loads(man_path.read_text())
        man.pop("checksum", None)  # edited by hand below: as a manifest written before checksums
        if kind == "foreign-manifest":
            man_path.write_text(json.dumps({"format": "someone-else", "version": 1}))
        elif kind == "manifest-not-json":
            man_path.write_text("<xml/>")
        elif kind == "manifest-newer-version":
            man["version"] = dsa_core.FORMAT_VERSION + 1
            man_path.write_text(json.dumps(man))
        elif kind == "manifest-missing-field":
            del man["hparams"]
            man_path.write_text(json.dumps(man))
        elif kind == "header-newer-version":
            with open(rows, "r+b") as f:
                f.seek(8)
                f.write(struct.pack("<I", dsa_core.FORMAT_VERSION + 1))
        elif kind == "bad-magic":
            with open(rows, "r+b") as f:
                f.write(b"NOTADSA!")
        elif kind == "truncated":
            with open(rows, "r+b") as f:
                f.truncate(rows.stat().st_size - 16)
        elif kind == "rows-missing":
            rows.rename(c.tmp_path / "moved.dsa")
        else:  # pragma: no cover
            raise AssertionError(kind)
    return prepare


DAMAGE_CASES = [
    ("foreign-manifest", ValueError, r"is not a DSA manifest: format is 'someone-else'"),
    ("manifest-not-json", ValueError, r"is not a DSA manifest \(expected JSON"),
    ("manifest-newer-version", ValueError,
     rf"has format version {dsa_core.FORMAT_VERSION + 1}; this dsa_core reads versions"),
    ("manifest-missing-field", ValueError, r"is missing a field"),
    ("header-newer-version", ValueError,
     rf"rows\.dsa' has format version {dsa_core.FORMAT_VERSION + 1}"),
    ("bad-magic", ValueError, r"is not a DSA data file: magic is b'NOTADSA!'"),
    ("truncated", ValueError, r"is truncated or padded"),
    ("rows-missing", FileNotFoundError, r"has a manifest but no rows\.dsa"),
]
for _kind, _exc, _match in DAMAGE_CASES:
    for _mode in ("r+", "r"):
        CALL_CASES.append((f"open-{_kind}-{_mode}", _damage(_kind),
                           lambda c, o, m=_mode: dsa_core.open(c.path, mode=m), _exc, _match))


@pytest.mark.parametrize(("prepare", "call", "exc", "match"),
                         [pytest.param(p, f, e, m, id=i) for i, p, f, e, m in CALL_CASES])
def test_call_rejects(request, ctx, store_digest, prepare, call, exc, match):
    """Bad step/open/flush/gather/create calls: the right exception and message, and every
    file under tmp_path is byte-identical afterwards (nothing was written). The damaged-file
    cases are the in-place format's (``rows.dsa``); a log store's are in tests/log."""
    if ctx.kind == "log" and "open-" in request.node.callspec.id and any(
            f"open-{k}-" in request.node.callspec.id for k, _, _ in DAMAGE_CASES):
        pytest.skip("an in-place data file's damage (the log store's: tests/log)")
    obj = prepare(ctx) if prepare is not None else None
    before = _tree(ctx.tmp_path, store_digest)
    count = ctx.state.count
    with pytest.raises(exc, match=match):
        call(ctx, obj)
    assert _tree(ctx.tmp_path, store_digest) == before
    assert ctx.state.count == count



# -- the paging hint (access) ------------------------------------------------------------


def _smaps_file_pmd_kib(path: Path) -> int:
    """FilePmdMapped (KiB) of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("FilePmdMapped:"):
            total += int(head[1])
    return total


def test_access_modes_resolve_and_give_identical_results(tmp_path, monkeypatch):
    from dsa_core import _paging

    monkeypatch.delenv("DSA_ACCESS", raising=False)
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 64, 40), rng.standard_normal((40, 8)).astype(np.float32))
               for _ in range(5)]
    outs = {}
    for access in ("ram", "disk", "auto"):
        s = dsa_core.create(tmp_path / access, 64, 8, init="normal", access=access)
        assert s.store.access == ("ram" if access == "auto" else access)  # tiny: fits
        for i, g in batches:
            s = dsa_core.step(s, i, g)
        outs[access] = np.array(s.store.data)
        dsa_core.close(s)
        r = dsa_core.open(tmp_path / access, "r", access="disk")
        assert r.store.access == "disk"
        dsa_core.close(r)
    np.testing.assert_array_equal(outs["ram"], outs["disk"])
    np.testing.assert_array_equal(outs["ram"], outs["auto"])
    # "auto" is "disk" when the file does not fit in RAM_FRACTION of the memory limit
    monkeypatch.setattr(_paging, "memory_limit", lambda: 10_000)
    s = dsa_core.open(tmp_path / "auto")
    assert s.store.access == "disk"
    dsa_core.close(s)
    monkeypatch.setenv("DSA_ACCESS", "ram")  # the environment replaces "auto"
    s = dsa_core.open(tmp_path / "auto")
    assert s.store.access == "ram"
    dsa_core.close(s)


def test_bad_access_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"access must be one of \('auto', 'ram', 'disk'\), "
                                         r"got 'fast'"):
        dsa_core.create(tmp_path / "s", 10, 4, access="fast")
    assert not (tmp_path / "s").exists()
    s = dsa_core.create(tmp_path / "t", 10, 4)
    dsa_core.close(s)
    with pytest.raises(ValueError, match="access must be one of"):
        dsa_core.open(tmp_path / "t", access=None)
    monkeypatch.setenv("DSA_ACCESS", "huge")
    with pytest.raises(ValueError, match=r"DSA_ACCESS must be one of .* got 'huge'"):
        dsa_core.open(tmp_path / "t")


def test_memory_limit_reads_the_cgroup_cap():
    from dsa_core import _paging

    phys = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    assert 0 < _paging.memory_limit() <= phys


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux-only")
def test_ram_access_maps_huge_pages_where_the_kernel_can(tmp_path):
    """Informative on kernels without large folios for the filesystem: then it skips."""
    s = dsa_core.create(tmp_path / "h", 8192, 128, access="ram")  # 12 MiB of records
    s.store.data[:, 0] += 1.0  # write-touch every row
    pmd = _smaps_file_pmd_kib(s.store.file)
    dsa_core.close(s)
    if pmd == 0:
        pytest.skip("this kernel/filesystem maps the store with 4 KiB pages only")
    assert pmd >= 4096  # at least two 2 MiB PMD mappings


def test_auto_access_counts_the_ram_stores_already_open(tmp_path, monkeypatch):
    """The writeback threshold is per machine: two stores that fit it alone but not together
    are not both mapped with huge pages."""
    import gc

    from dsa_core import _paging

    # the count is per process: stores another test left open (or not yet collected) would
    # count too, so they are set aside while this test runs
    gc.collect()
    others = list(_paging._RAM_STORES)
    for st in others:
        _paging._RAM_STORES.discard(st)
    try:
        _check_ram_counting(tmp_path, monkeypatch, _paging)
    finally:
        for st in others:
            _paging._RAM_STORES.add(st)


def _check_ram_counting(tmp_path, monkeypatch, _paging):
    monkeypatch.delenv("DSA_ACCESS", raising=False)
    a = dsa_core.create(tmp_path / "a", 1000, 16)
    one = a.store.nbytes
    dsa_core.close(a)
    monkeypatch.setattr(_paging, "memory_limit", lambda: 100 * one)
    monkeypatch.setattr(_paging, "dirty_background_bytes", lambda: int(1.5 * one))
    assert _paging.ram_bytes_held() == 0
    a = dsa_core.open(tmp_path / "a")
    b = dsa_core.create(tmp_path / "b", 1000, 16)
    assert (a.store.access, b.store.access) == ("ram", "disk")
    assert _paging.ram_bytes_held() == one
    dsa_core.close(a)
    assert _paging.ram_bytes_held() == 0
    c = dsa_core.create(tmp_path / "c", 1000, 16)  # a's share is free again
    assert c.store.access == "ram"
    d = dsa_core.create(tmp_path / "d", 1000, 16, access="ram")  # explicit: as asked
    assert d.store.access == "ram" and _paging.ram_bytes_held() == 2 * one
    for s in (b, c, d):
        dsa_core.close(s)


# -- file copies (checkpoints) -----------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 4096, 5000, (16 << 20) + 123])
@pytest.mark.parametrize("path", ["direct", "copy_file_range", "plain"])
def test_copy_file_paths_copy_every_byte(tmp_path, monkeypatch, size, path):
    """Whichever copy path the filesystem allows (O_DIRECT reads, copy_file_range, a plain
    copy), the copy equals the source, including sizes that are not block multiples."""
    from dsa_core import _files

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(np.random.default_rng(size).integers(0, 256, size, np.uint8).tobytes())
    monkeypatch.setattr(_files.fcntl, "ioctl", _no_reflink)
    used = []
    real_direct = _files._copy_direct
    if path == "direct":
        def spy(s, fd_out):
            done = real_direct(s, fd_out)
            used.append(done)
            return done
        monkeypatch.setattr(_files, "_copy_direct", spy)
    else:
        monkeypatch.setattr(_files, "_copy_direct", lambda s, fd_out: 0)  # refused
    if path == "plain":
        def no_cfr(*a):
            raise OSError(errno.EXDEV, "no copy_file_range")
        monkeypatch.setattr(_files.os, "copy_file_range", no_cfr)
    _files.copy_file(src, dst)
    assert dst.read_bytes() == src.read_bytes()
    if path == "direct" and used[0] < size:
        pytest.skip("this filesystem refuses O_DIRECT reads; the fallback copied the file")


def _no_reflink(*a):
    raise OSError(errno.EOPNOTSUPP, "no reflink")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_closed_store_is_unmapped_after_a_pooled_step(tmp_path):
    """A pool worker must not keep the last job's arrays: they are views of the mapping, and
    a closed store has to be unmappable at once (its page cache evictable, a removed file's
    space freed). Before the fix the worker held them until the next pooled step."""
    import gc

    st = dsa_core.create(tmp_path / "s", 5000, 16, init="uniform")
    rng = np.random.default_rng(0)
    with num_threads(2):
        st = dsa_core.step(st, np.arange(4096), rng.standard_normal((4096, 16))
                           .astype(np.float32))
    dsa_core.close(st)
    del st
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(tmp_path / "s" / "rows.dsa") not in maps
