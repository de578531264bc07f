"""The Numba kernels (through ``dsa_core.step``) against the NumPy oracle ``dsa_core._reference``.

Equality is exact wherever the kernel and the oracle do the same IEEE operations in the same
order: the Euclidean kernel (elementwise, no FMA), and the ball kernel in float32 (row
reductions accumulated in float64 and rounded once to float32 in both) and in float64 for
dim < 8 (numpy's pairwise sum is a plain sequential loop below 8 elements). For the ball in
float64 with dim >= 8, numpy's pairwise float64 sums and the kernel's sequential ones differ in
the last bit; there a tight relative tolerance is used (measured: <= 4.4e-16 absolute after
20 steps of 40 rows).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba import njit

import dsa_core
from dsa_core._claim import first_span, next_span, spin, spins_per_second
from helpers import num_threads
from kernel_oracle import (
    Bf16,
    DTYPES,
    GEOMS,
    NO_BALL_HALF,
    Rowwise,
    RowwiseBf16,
    assert_matches,
    batch_stream,
    bf16,
    geo_kw,
    hp,
    init_rows,
    make_store,
    oracle_state,
    ref_step,
    store_arrays,
)


DIMS = (1, 3, 16, 128)
MAX_THREADS = 2  # dsa_core's pool takes any count; 2 exercises the hand-off
THREADS = [1, pytest.param(2, marks=pytest.mark.skipif(
    MAX_THREADS < 2, reason="single thread"))]
N = 40


# -- kernels vs reference ---------------------------------------------------------------------
@pytest.mark.parametrize("threads", THREADS)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", GEOMS)
def test_step_matches_reference(tmp_path, geom, dt, dim, threads):
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng([dim, int(10 * c), len(dt)])
    init = init_rows(rng, N, dim, c, dtype)
    state = make_store(tmp_path / "s", c, dtype, init, lr=0.05)
    P, M, V = oracle_state(init, c)
    with num_threads(threads):
        for t, (idx, G) in enumerate(batch_stream(rng, N, dim, dtype), start=1):
            before = state.store.data.copy()
            state = dsa_core.step(state, idx, G)
            assert state.count == t
            ref_step(P, M, V, idx, G, t, c, **hp(state))
            assert_matches(store_arrays(state), (P, M, V), c, dtype, dim, f"t={t}")
            # laziness: every row outside the batch is bit-for-bit unchanged
            out = np.ones(N, bool)
            out[idx] = False
            np.testing.assert_array_equal(state.store.data[out].view(np.uint8),
                                          before[out].view(np.uint8))
    if c > 0:  # every touched row ends inside the ball
        assert (np.linalg.norm(state.weights.astype(np.float64), axis=1) < 1 / np.sqrt(c)).all()
    dsa_core.close(state)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_thread_count_does_not_change_results(tmp_path, geom, dt):
    """Rows are independent: 1 and 2 threads give byte-identical stores."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    n, dim = 600, 16
    rng = np.random.default_rng(7)
    init = init_rows(rng, n, dim, c, dtype)
    batches = [(rng.integers(0, n, 512), rng.standard_normal((512, dim)).astype(dtype))
               for _ in range(6)]
    results = []
    for threads in (1, 2):
        state = make_store(tmp_path / f"t{threads}", c, dtype, init)
        with num_threads(threads):
            assert dsa_core.get_num_threads() == threads
            for idx, G in batches:
                state = dsa_core.step(state, idx, G)
        results.append(state.store.data.tobytes())
        dsa_core.close(state)
    assert results[0] == results[1]


def test_set_num_threads_sets_and_checks():
    from dsa_core import _pool

    old = (_pool._POOL.threads, _pool._POOL.source)  # the count and who set it
    try:
        dsa_core.set_num_threads(1)
        assert dsa_core.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads must be >= 1, got 0"):
            dsa_core.set_num_threads(0)
        with pytest.raises(TypeError, match="num_threads must be an int >= 1, got 1.5"):
            dsa_core.set_num_threads(1.5)
        assert dsa_core.get_num_threads() == 1  # a refused value changes nothing
    finally:
        _pool._POOL.threads, _pool._POOL.source = old


@njit(nogil=True)
def _slow_marks(out, per_row, lo, hi, ctl=None):
    """Add 1 to ``out[i]`` for each row the call claims, ``per_row`` spin rounds each (the
    pool's kernel protocol, ``dsa_core._claim``); returns the rows this call ran."""
    ran = 0
    c0, c1 = first_span(ctl, lo, hi)
    while c0 < c1:
        for i in range(c0, c1):
            out[i] += 1
            spin(per_row)
        ran += c1 - c0
        c0, c1 = next_span(ctl, lo, hi, c0, c1)
    return ran


def test_pool_runs_every_chunk_once_and_uses_the_workers():
    """The pool's threads claim chunks of [0, n) in the kernel: every row runs exactly once,
    and a woken worker takes part."""
    import threading

    from dsa_core import _pool

    out, ran = np.zeros(1000, np.int64), {}

    def fn(out, per_row, lo, hi, ctl):
        name = threading.current_thread().name
        ran[name] = ran.get(name, 0) + _slow_marks(out, per_row, lo, hi, ctl)

    per_row = int(80e-6 * spins_per_second())
    with num_threads(2):  # ~80 ms of rows: the worker wakes long before they are all claimed
        _pool.run_chunked(fn, (out, per_row), 1000, min_chunk=10)
    np.testing.assert_array_equal(out, 1)
    assert len(ran) == 2 and min(ran.values()) > 0 and sum(ran.values()) == 1000

    out[:] = 0  # one thread (a batch too small to share): the same kernel code, every row once
    _pool.run_chunked(fn, (out, 0), 1000, min_chunk=1000)
    np.testing.assert_array_equal(out, 1)

    def bad(lo, hi, ctl):
        raise ZeroDivisionError("chunk failed")

    with pytest.raises(ZeroDivisionError, match="chunk failed"), num_threads(2):
        _pool.run_chunked(bad, (), 1000, min_chunk=10)


def test_pool_jobs_back_to_back_run_every_row_once():
    """Jobs in quick succession (the workers then wait for the next one spinning, and a late
    worker may still hold an earlier job): every job runs each of its rows exactly once."""
    from dsa_core import _pool

    out = np.zeros(5000, np.int64)
    with num_threads(2):
        for k in range(300):
            n = 5000 - 7 * k  # jobs of different sizes: a stale job's claims would show
            _pool.run_chunked(_slow_marks, (out, 0), n, min_chunk=64)
    want = np.array([sum(1 for k in range(300) if i < 5000 - 7 * k) for i in range(5000)])
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("failing", ["caller", "worker"])
def test_pool_raises_after_every_claimed_chunk(failing):
    """A thread whose kernel raises stops the claims; the error reaches the caller only after
    every chunk another thread claimed has finished (nothing writes after the step raised),
    and no row runs twice."""
    import threading
    import time

    from dsa_core import _pool

    out = np.zeros(400, np.int64)
    # compiled first: a compile inside the race (~1 s in a new process, where this test runs
    # first) lets the failing side stop the claims before a row ran
    _pool.run_chunked(_slow_marks, (np.zeros(64, np.int64), 0), 64, min_chunk=64)
    started = threading.Event()
    entered = threading.Event()  # the pool's worker holds a chunk
    per_row = int(200e-6 * spins_per_second())  # ~0.2 ms per row, 80 ms in all

    def fn(out, lo, hi, ctl):
        caller = threading.current_thread() is threading.main_thread()
        if not caller:
            entered.set()
        if caller == (failing == "caller"):  # the failing side raises once the other runs
            if not started.wait(5):
                pytest.fail("the other thread never started")
            time.sleep(0.005)  # while the other thread runs its first chunks
            raise ZeroDivisionError("chunk failed")
        # on a loaded machine the worker may get a core only after the caller claimed every
        # chunk (no error to see): the caller's rows start once the worker holds one
        if caller and not entered.wait(5):
            pytest.fail("the pool's worker never claimed a chunk")
        started.set()
        _slow_marks(out, per_row, lo, hi, ctl)

    with pytest.raises(ZeroDivisionError, match="chunk failed"), num_threads(2):
        _pool.run_chunked(fn, (out,), 400, min_chunk=10)
    seen = out.copy()
    time.sleep(0.05)  # a thread still in a chunk would change out now
    np.testing.assert_array_equal(out, seen)
    assert out.max() <= 1 and 0 < out.sum() < 400  # some rows ran, the claims stopped early


# -- duplicates, ordering, empty batches ------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_duplicates_are_summed_in_order_of_appearance(tmp_path, geom, dt):
    """A batch with duplicate ids equals the batch of its sums, added left to right in T
    (an oracle independent of dsa_core's coalescing); unsorted unique ids equal sorted ones."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(3)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    idx = np.array([7, 2, 7, 30, 7, 2, 11, 7], np.int64)
    G = (rng.standard_normal((idx.size, dim)) * 10.0 ** rng.uniform(-4, 2, (idx.size, 1))
         ).astype(dtype)
    uniq = np.array([2, 7, 11, 30], np.int64)
    summed = np.stack([
        G[1] + G[5],
        ((G[0] + G[2]) + G[4]) + G[7],
        G[6],
        G[3],
    ])
    a = make_store(tmp_path / "a", c, dtype, init)
    b = make_store(tmp_path / "b", c, dtype, init)
    perm = np.array([3, 0, 2, 1])
    cc = make_store(tmp_path / "c", c, dtype, init)
    for _ in range(3):
        a = dsa_core.step(a, idx, G)
        b = dsa_core.step(b, uniq, summed)
        cc = dsa_core.step(cc, uniq[perm], summed[perm])
    assert a.store.data.tobytes() == b.store.data.tobytes() == cc.store.data.tobytes()
    for s in (a, b, cc):
        dsa_core.close(s)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_empty_batch_counts_a_step_and_changes_nothing(tmp_path, geom, dt, store_digest):
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(5)
    dim = 3
    init = init_rows(rng, N, dim, c, dtype)
    state = make_store(tmp_path / "s", c, dtype, init)
    P, M, V = oracle_state(init, c)
    idx = np.array([4, 9, 4], np.int64)
    G = rng.standard_normal((3, dim)).astype(dtype)
    state = dsa_core.step(state, idx, G)
    ref_step(P, M, V, idx, G, 1, c, **hp(state))
    dsa_core.flush(state)
    files = store_digest(tmp_path / "s")
    data = state.store.data.tobytes()
    for t in (2, 3):  # B = 0, twice; idx may also be a plain empty int list
        empty = np.empty(0, np.int64) if t == 2 else np.array([], dtype=np.int32)
        state = dsa_core.step(state, empty, np.empty((0, dim), dtype))
        assert state.count == t
        assert state.store.data.tobytes() == data
    assert store_digest(tmp_path / "s") == files  # nothing written, manifest not rewritten
    # the counter moved: the next step's bias correction uses t = 4
    state = dsa_core.step(state, idx, G)
    ref_step(P, M, V, idx, G, 4, c, **hp(state))
    assert_matches(store_arrays(state), (P, M, V), c, dtype, dim)
    # and differs from a step with t = 2 (so the check above has teeth)
    P2, M2, V2 = oracle_state(init, c)
    ref_step(P2, M2, V2, idx, G, 1, c, **hp(state))
    ref_step(P2, M2, V2, idx, G, 2, c, **hp(state))
    assert not np.array_equal(P2, P)
    dsa_core.close(state)


# -- weights=False stores --------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_weights_false_with_params(tmp_path, geom, dt):
    """``weights=False``: the caller's rows are updated in place, duplicates all receive the
    new row, and the result equals a weights=True store and the oracle."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(11)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    ext = init.copy()  # the caller's table
    nw = dsa_core.create(tmp_path / "nw", N, dim, curvature=c, weights=False, lr=0.05,
                         **geo_kw(c, dtype), dtype=np.dtype(dtype).name)
    assert not nw.has_weights
    with pytest.raises(ValueError, match="weights=False"):
        _ = nw.weights
    w = make_store(tmp_path / "w", c, dtype, init)
    P, M, V = oracle_state(init, c)
    for t, (idx, G) in enumerate(batch_stream(rng, N, dim, dtype), start=1):
        params = ext[idx]  # (B, dim) copy, duplicates included
        before = params.copy()
        nw = dsa_core.step(nw, idx, G, params=params)
        w = dsa_core.step(w, idx, G)
        ref_step(P, M, V, idx, G, t, c, **hp(w))
        for r in np.unique(idx):  # every copy of a duplicate id got the same new row
            rows = params[idx == r]
            np.testing.assert_array_equal(rows, np.broadcast_to(rows[0], rows.shape))
        ext[idx] = params
        if idx.size:
            assert not np.array_equal(params, before)
        np.testing.assert_array_equal(ext, w.weights)
        np.testing.assert_array_equal(nw.exp_avg, w.exp_avg)
        np.testing.assert_array_equal(nw.exp_avg_sq, w.exp_avg_sq)
        assert_matches((ext, nw.exp_avg, nw.exp_avg_sq), (P, M, V), c, dtype, dim, f"t={t}")
    dsa_core.close(nw)
    dsa_core.close(w)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_weights_false_with_table(tmp_path, geom, dt):
    """``table=``: the caller's whole table is updated in place, rows ``idx`` only, equal to a
    weights=True store and the oracle; a journaled store rolls the table back too."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(12)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    table = init.copy()
    nw = dsa_core.create(tmp_path / "nw", N, dim, curvature=c, weights=False, lr=0.05,
                         **geo_kw(c, dtype), dtype=np.dtype(dtype).name)
    w = make_store(tmp_path / "w", c, dtype, init)
    P, M, V = oracle_state(init, c)
    for t, (idx, G) in enumerate(batch_stream(rng, N, dim, dtype), start=1):
        untouched = np.setdiff1d(np.arange(N), idx)
        before = table[untouched].copy()
        nw = dsa_core.step(nw, idx, G, table=table)
        w = dsa_core.step(w, idx, G)
        ref_step(P, M, V, idx, G, t, c, **hp(w))
        np.testing.assert_array_equal(table[untouched], before)
        np.testing.assert_array_equal(table, w.weights)
        np.testing.assert_array_equal(nw.exp_avg, w.exp_avg)
        np.testing.assert_array_equal(nw.exp_avg_sq, w.exp_avg_sq)
        assert_matches((table, nw.exp_avg, nw.exp_avg_sq), (P, M, V), c, dtype, dim, f"t={t}")
    dsa_core.close(nw)
    dsa_core.close(w)


def test_table_rolls_back_with_a_failed_journaled_step(tmp_path, monkeypatch):
    from dsa_core import _layout

    nw = dsa_core.create(tmp_path / "nw", N, 4, weights=False, durability="step")
    table = np.arange(N * 4, dtype=np.float32).reshape(N, 4) / 100
    keep = table.copy()

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_layout, "write_manifest", broken)
    with pytest.raises(OSError, match="No space left"):
        dsa_core.step(nw, np.array([3, 1, 3]), np.ones((3, 4), np.float32), table=table)
    np.testing.assert_array_equal(table, keep)
    assert not nw.exp_avg.any()
    monkeypatch.undo()
    dsa_core.close(nw)


@pytest.mark.parametrize("geom", NO_BALL_HALF)
@pytest.mark.parametrize("pattern", ["sorted", "dups"])
def test_weights_false_noncontiguous_params(tmp_path, geom, pattern):
    """A writeable strided view as params is updated in place (the kernel may work on a copy)."""
    c = GEOMS[geom]
    rng = np.random.default_rng(2)
    dim = 4
    init = init_rows(rng, N, dim, c, np.float32)
    idx = np.array([1, 5, 9], np.int64) if pattern == "sorted" else np.array([9, 1, 9], np.int64)
    G = rng.standard_normal((3, dim)).astype(np.float32)
    buf = np.zeros((3, 2 * dim), np.float32)
    view = buf[:, ::2]
    view[...] = init[idx]
    assert not view.flags.c_contiguous
    nw = dsa_core.create(tmp_path / "nw", N, dim, curvature=c, weights=False, lr=0.05,
                         **geo_kw(c))
    nw = dsa_core.step(nw, idx, G, params=view)
    w = make_store(tmp_path / "w", c, np.float32, init)
    w = dsa_core.step(w, idx, G)
    np.testing.assert_array_equal(buf[:, ::2], w.weights[idx])
    assert not buf[:, 1::2].any()  # the gaps of the view were not written
    dsa_core.close(nw)
    dsa_core.close(w)


# -- maximize ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_maximize(tmp_path, geom, dt):
    """maximize=True equals the oracle with maximize, and a minimising store fed -grad;
    it differs from a minimising store fed +grad."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(13)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    mx = make_store(tmp_path / "max", c, dtype, init, maximize=True)
    neg = make_store(tmp_path / "neg", c, dtype, init)
    pos = make_store(tmp_path / "pos", c, dtype, init)
    P, M, V = oracle_state(init, c)
    for t, (idx, G) in enumerate(batch_stream(rng, N, dim, dtype), start=1):
        mx = dsa_core.step(mx, idx, G)
        neg = dsa_core.step(neg, idx, -G)
        pos = dsa_core.step(pos, idx, G)
        ref_step(P, M, V, idx, G, t, c, **hp(mx))
    assert mx.maximize
    assert not pos.maximize
    assert mx.store.data.tobytes() == neg.store.data.tobytes()
    assert mx.store.data.tobytes() != pos.store.data.tobytes()
    assert_matches(store_arrays(mx), (P, M, V), c, dtype, dim)
    for s in (mx, neg, pos):
        dsa_core.close(s)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_step_lr_zero(tmp_path, geom, dt):
    """A per-step lr of 0 (a warm-up schedule): the moments advance as in the oracle, the
    weights stay put -- except, on the ball, rows beyond the projection radius, which the
    retraction projects (geoopt does the same)."""
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(29)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    state = make_store(tmp_path / "s", c, dtype, init, lr=0.05)
    P, M, V = oracle_state(init, c)
    idx = np.arange(0, N, 2)
    G = rng.standard_normal((idx.size, dim)).astype(dtype)
    state = dsa_core.step(state, idx, G, lr=0.0)
    ref_step(P, M, V, idx, G, 1, c, **{**hp(state), "lr": 0.0})
    assert_matches(store_arrays(state), (P, M, V), c, dtype, dim)
    assert state.exp_avg[idx].any()
    moved = np.flatnonzero((state.weights != init).any(axis=1))
    if c == 0 or dtype == np.float64:  # row 0 (norm 0.9999) is inside the float64 radius
        assert moved.size == 0
    else:
        np.testing.assert_array_equal(moved, [0])  # projected from 0.9999 to 0.996
        assert np.linalg.norm(state.weights[0]) == pytest.approx(0.996, rel=1e-6)
    dsa_core.close(state)


# -- non-finite gradients ---------------------------------------------------------------------
def _nonfinite_batch(rng, dim, dtype):
    """Rows 3 (NaN), 8 (+Inf), 12 (finite copy then -Inf copy) are bad; 1, 5, 20 are fine."""
    idx = np.array([5, 3, 12, 1, 8, 12, 20], np.int64)
    G = rng.standard_normal((idx.size, dim)).astype(dtype)
    G[1, 0] = np.nan
    G[4, dim - 1] = np.inf
    G[5, dim // 2] = -np.inf
    return idx, G, np.array([3, 8, 12])


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_nonfinite_skip_row(tmp_path, geom, dt):
    c, dtype = GEOMS[geom], DTYPES[dt]
    rng = np.random.default_rng(17)
    dim = 16
    init = init_rows(rng, N, dim, c, dtype)
    state = make_store(tmp_path / "s", c, dtype, init, nonfinite="skip_row")
    P, M, V = oracle_state(init, c)
    warm = np.arange(0, 24, dtype=np.int64)  # give every row some state first
    Gw = rng.standard_normal((warm.size, dim)).astype(dtype)
    state = dsa_core.step(state, warm, Gw)
    ref_step(P, M, V, warm, Gw, 1, c, **hp(state))
    before = state.store.data.copy()
    idx, G, bad = _nonfinite_batch(rng, dim, dtype)
    state = dsa_core.step(state, idx, G)
    assert state.count == 2
    # bad rows: weights and state untouched, bit for bit
    np.testing.assert_array_equal(state.store.data[bad].view(np.uint8),
                                  before[bad].view(np.uint8))
    # good rows: exactly the oracle on the batch without the bad rows
    keep = ~np.isin(idx, bad)
    ref_step(P, M, V, idx[keep], G[keep], 2, c, **hp(state))
    assert_matches(store_arrays(state), (P, M, V), c, dtype, dim)
    assert np.isfinite(state.store.data).all()
    dsa_core.close(state)


@pytest.mark.parametrize("geom", NO_BALL_HALF)
def test_nonfinite_raise_writes_nothing(tmp_path, geom, store_digest):
    c = GEOMS[geom]
    rng = np.random.default_rng(19)
    dim = 16
    init = init_rows(rng, N, dim, c, np.float32)
    state = make_store(tmp_path / "s", c, np.float32, init, nonfinite="raise")
    state = dsa_core.step(state, np.arange(24), rng.standard_normal((24, dim)).astype(np.float32))
    dsa_core.flush(state)
    files = store_digest(tmp_path / "s")
    data = state.store.data.tobytes()
    idx, G, _ = _nonfinite_batch(rng, dim, np.float32)
    with pytest.raises(FloatingPointError, match=r"NaN or Inf for row\(s\) \[3, 8, 12\]"):
        dsa_core.step(state, idx, G)
    assert state.store.data.tobytes() == data
    assert store_digest(tmp_path / "s") == files
    # the state is still usable and its count did not move
    state2 = dsa_core.step(state, idx[:1], G[:1])
    assert state2.count == 2
    dsa_core.close(state2)


def _torch_sparse_adam_run(init, batches, **kw):
    torch = pytest.importorskip("torch")
    p = torch.nn.Parameter(torch.from_numpy(init.copy()))
    opt = torch.optim.SparseAdam([p], **kw)
    for idx, G in batches:
        p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], torch.from_numpy(G),
                                         p.shape, check_invariants=True)
        opt.step()
    s = opt.state[p]
    return p.detach().numpy(), s["exp_avg"].numpy(), s["exp_avg_sq"].numpy()


def _geoopt_run(init, batches, c, **kw):
    torch = pytest.importorskip("torch")
    geoopt = pytest.importorskip("geoopt")
    data = torch.from_numpy(init.copy())
    p = geoopt.ManifoldParameter(
        data, manifold=geoopt.Stereographic(torch.tensor(-c, dtype=data.dtype)))
    opt = geoopt.optim.SparseRiemannianAdam([p], **kw)
    for idx, G in batches:
        p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], torch.from_numpy(G),
                                         p.shape, check_invariants=True)
        opt.step()
    s = opt.state[p]
    return p.detach().numpy(), s["exp_avg"].numpy(), s["exp_avg_sq"].numpy()


@pytest.mark.torch
@pytest.mark.parametrize("geom", ["euclid", "ball1"])
def test_nonfinite_propagate_like_the_anchors(tmp_path, geom):
    """Default mode: NaN/Inf spread exactly where torch (per coordinate) and geoopt (per row,
    through the row reductions) spread them (docs/algorithms.md §6); then finite steps on the
    same rows."""
    c = GEOMS[geom]
    rng = np.random.default_rng(23)
    dim = 10
    init = init_rows(rng, N, dim, c, np.float32)
    idx, G, bad = _nonfinite_batch(rng, dim, np.float32)
    batches = [(idx, G)] + [
        (np.concatenate([bad, rng.integers(0, N, 6)]),
         rng.standard_normal((9, dim)).astype(np.float32)) for _ in range(2)]
    state = make_store(tmp_path / "s", c, np.float32, init, lr=0.05)
    assert state.nonfinite == "propagate"
    P, M, V = oracle_state(init, c)
    for t, (i, g) in enumerate(batches, start=1):
        state = dsa_core.step(state, i, g)
        ref_step(P, M, V, i, g, t, c, **hp(state))
    ours = store_arrays(state)
    assert_matches(ours, (P, M, V), c, np.float32, dim)
    kw = {"lr": 0.05}
    if c == 0:
        anchor = _torch_sparse_adam_run(init, batches, **kw)
    else:
        anchor = _geoopt_run(init, batches, c, **kw)
    for name, a, b in zip("PMV", ours, anchor, strict=True):
        a = np.broadcast_to(a, b.shape)
        np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"NaN mask of {name}")
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=f"Inf mask of {name}")
    assert np.isnan(ours[0][bad]).any()
    good = np.setdiff1d(np.arange(N), bad)
    assert np.isfinite(ours[0][good]).all()
    if c == 0:  # the finite values match torch as well (docs/algorithms.md §5 float32 tolerance)
        for a, b in zip(ours, anchor, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=3e-6)
    else:  # geoopt: NaN fills the whole row of P and M after the step that follows
        assert np.isnan(ours[0][bad]).all()
        assert np.isnan(ours[1][bad]).all()
    dsa_core.close(state)


# -- property test ----------------------------------------------------------------------------
finite_values = st.one_of(
    st.floats(-3.0, 3.0),
    st.sampled_from([0.0, -0.0, 1e-30, -1e-30, 1e-42, 1e20, -1e20, 3e30, -3e30]),
)


@st.composite
def batch_sequences(draw):
    c = draw(st.sampled_from([0.0, Rowwise(0.0), Bf16(0.0), RowwiseBf16(0.0), 1.0, 0.5]))
    dtype = np.float32 if bf16(c) else draw(st.sampled_from([np.float32, np.float64]))
    dim = draw(st.sampled_from([1, 2, 3, 5]))
    n = draw(st.integers(1, 6))
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        b = draw(st.integers(0, 8))
        idx = draw(st.lists(st.integers(0, n - 1), min_size=b, max_size=b))
        vals = draw(st.lists(finite_values, min_size=b * dim, max_size=b * dim))
        steps.append((np.array(idx, np.int64).reshape(b),
                      np.array(vals, np.float64).reshape(b, dim).astype(dtype)))
    lr = draw(st.sampled_from([1e-3, 0.05, 1.0]))
    maximize = draw(st.booleans())
    return c, dtype, dim, n, steps, lr, maximize


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=batch_sequences())
def test_property_store_equals_reference(tmp_path, case):
    """Random batch sequences (duplicates, empty batches, tiny/huge/subnormal values,
    maximize, both geometries and dtypes): the store equals the oracle exactly."""
    c, dtype, dim, n, steps, lr, maximize = case
    rng = np.random.default_rng(n)
    init = init_rows(rng, n, dim, c, dtype)
    state = make_store(tmp_path / uuid.uuid4().hex, c, dtype, init, lr=lr, maximize=maximize)
    P, M, V = oracle_state(init, c)
    for t, (idx, G) in enumerate(steps, start=1):
        state = dsa_core.step(state, idx, G)
        ref_step(P, M, V, idx, G, t, c, **hp(state))
    assert state.count == len(steps)
    assert_matches(store_arrays(state), (P, M, V), c, dtype, dim)
    dsa_core.close(state)


# -- one kernel per geometry, the options as compile-time constants -----------------------------
# Each kernel module has one body per geometry (and moment layout), built by a functools.cache
# factory per combination of options (per_row, last, decay mode); the plain kernel is the
# combination with none on. numba's on-disk cache keys an entry by the function's bytecode and
# the values of its closure, not by anything else that tells two dispatchers of one Python
# function apart: two combinations with equal closures would share one entry, and the one
# compiled first would then run for both (docs/algorithms.md §7.1-§7.2).

def _option_factories():
    from dsa_core import _kernels_euclid as E
    from dsa_core import _kernels_poincare as P
    return {"euclid": E.euclid_options_kernel, "rowwise": E.euclid_rowwise_options_kernel,
            "bf16m": E.euclid_bf16m_options_kernel, "ball": P.poincare_options_kernel}


def _option_specs():
    from dsa_core._intrinsics import WD_DECOUPLED, WD_L2, WD_NONE
    return list(itertools.product((False, True), (False, True), (WD_NONE, WD_L2, WD_DECOUPLED)))


@pytest.mark.parametrize("name", ["euclid", "rowwise", "bf16m", "ball"])
def test_each_option_combination_has_its_own_cache_key(name):
    """The 12 specialisations of a factory get 12 distinct numba cache keys (the same
    signature, the key numba computes), and the plain kernel is the no-option one."""
    from dsa_core import _kernels_euclid as E
    from dsa_core import _kernels_poincare as P
    from dsa_core._intrinsics import WD_NONE
    factory = _option_factories()[name]
    kernels = [factory(*spec) for spec in _option_specs()]
    assert len({id(k) for k in kernels}) == 12
    keys = {k._cache._index_key((), k.targetctx.codegen()) for k in kernels}
    assert len(keys) == 12
    plain = {"euclid": E.adam_rows_euclid, "rowwise": E.adam_rows_euclid_rowwise,
             "bf16m": E.adam_rows_euclid_bf16m, "ball": P.adam_rows_poincare}[name]
    assert plain is factory(False, False, WD_NONE)


CACHE_SCRIPT = textwrap.dedent("""
    import hashlib, json
    import numpy as np
    from dsa_core._intrinsics import WD_DECOUPLED, WD_L2, WD_NONE, NO_OPTIONS, options_array
    from dsa_core._kernels_euclid import euclid_hparams, euclid_options_kernel

    # records of 8 rows, dim 4: w, m, v, then the row_step and last_step counters (int32)
    d, n, t = 4, 8, 10
    rng = np.random.default_rng(3)
    S0 = np.zeros((n, 3 * d + 2), np.float32)
    S0[:, :3 * d] = rng.uniform(0.1, 1.0, (n, 3 * d))
    C = S0.view(np.int32)
    C[:, 3 * d] = 4          # row_step: this update is the row's 5th
    C[:, 3 * d + 1] = t - 3  # last_step: the decay of 3 steps to catch up
    G = rng.standard_normal((n, d)).astype(np.float32)
    rows = np.arange(n, dtype=np.int64)
    hp = euclid_hparams(np.float32, lr=0.05, betas=(0.9, 0.999), bc1=1 - 0.9**t,
                        bc2=1 - 0.999**t, eps=1e-8, maximize=False, weight_decay=0.1)
    out, stats = {}, {}
    for spec in [(False, False, WD_NONE), (False, False, WD_L2), (True, False, WD_NONE),
                 (False, False, WD_DECOUPLED), (False, True, WD_DECOUPLED)]:
        op = NO_OPTIONS if spec == (False, False, WD_NONE) else options_array(
            rs_off=3 * d, ls_off=3 * d + 1, t=t, wd_mode=spec[2], lr=0.05,
            betas=(0.9, 0.999), weight_decay=0.1)
        k = euclid_options_kernel(*spec)
        S = S0.copy()
        k(S, rows, 0, S, rows, d, 2 * d, G, hp, False, op, 0, n)
        out[str(spec)] = hashlib.sha256(S.tobytes()).hexdigest()
        stats[str(spec)] = [len(k.stats.cache_hits), len(k.stats.cache_misses)]
    print(json.dumps({"out": out, "stats": stats}))
""")


@pytest.mark.slow  # compiles five specialisations from nothing in a child (~30 s here)
def test_cached_specialisations_each_run_their_own_code(tmp_path):
    """Five combinations compiled in one process, then loaded from numba's cache in a fresh
    one: each loads (no compile) and gives its own bytes, the same as when compiled."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        p = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], capture_output=True, text=True,
                           timeout=600, check=False, env=env)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout.splitlines()[-1])

    first, second = run(), run()
    assert all(hits == 0 and misses == 1 for hits, misses in first["stats"].values()), first
    assert all(hits == 1 and misses == 0 for hits, misses in second["stats"].values()), second
    assert second["out"] == first["out"]
    assert len(set(first["out"].values())) == len(first["out"])  # each its own code
