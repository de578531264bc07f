"""The log-structured store's engine (dsa_core._log): white-box tests against a numpy reference.

The reference is a plain numpy table of records updated by the same deterministic function
as the engine's region; every comparison is bit for bit. Small memory budgets make seals,
evictions and cleaning happen many times per test. Crash tests fork a child that trains and
is killed with SIGKILL, at chosen crash points or at random moments; the parent reopens the
store and compares it with the reference at the child's last flush, or, for steps committed
to the commit log (durability="step"), at the child's last completed step.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from dsa_core import _init as _log_init, _layout, _log
from dsa_core._log import budget
from dsa_core._log import format as _log_format
from dsa_core._log import segments as _segments
from dsa_core._log import wal as _log_wal
from dsa_core._log.sums import record_pitch, record_sums, split_sums
from dsa_core import StoreLockedError

N = 3000


def _layout_of(kind: str, num_rows: int = N, dim: int = 8) -> dict:
    if kind == "f32":
        return _layout.make_layout(num_rows, dim, np.float32, 0.0, True, 0)
    if kind == "f64":
        return _layout.make_layout(num_rows, dim, np.float64, 0.0, True, 0)
    if kind == "counters":
        return _layout.make_layout(num_rows, dim, np.float32, 0.0, True, 0, per_row_step=True,
                                   decay_missed_steps=True)
    if kind == "noweights":
        return _layout.make_layout(num_rows, dim, np.float64, 0.0, False, 0)
    raise AssertionError(kind)


def update(rec: np.ndarray, t: int, rows: np.ndarray, lay: dict) -> np.ndarray:
    """The deterministic 'training step' applied to engine and reference alike."""
    T = np.dtype(lay["dtype"]).type
    out = rec * T(0.5) + T(t) + (rows % 7).astype(rec.dtype)[:, None]
    for key in ("row_step", "last_step"):
        if key in lay:  # counters: integer updates on the int view, as the kernels do
            ints = out.view(_layout.counter_dtype(rec.dtype))
            old = rec.view(_layout.counter_dtype(rec.dtype))[:, lay[key]]
            ints[:, lay[key]] = old + 1 if key == "row_step" else t
    return out


_ZIPF_P: dict[int, np.ndarray] = {}


def batch_rows(t: int, num_rows: int, size: int, dist: str, seed: int = 0) -> np.ndarray:
    """Unique rows of step ``t`` (shuffled): a pure function of its arguments."""
    rng = np.random.default_rng([seed, t])
    if dist == "uniform":
        rows = rng.integers(0, num_rows, size)
    else:
        p = _ZIPF_P.get(num_rows)
        if p is None:
            p = 1.0 / (np.arange(num_rows) + 1.0) ** 1.1
            p = _ZIPF_P[num_rows] = p / p.sum()
        rows = rng.choice(num_rows, size=size, p=p)
    rows = np.unique(rows)
    return rows[rng.permutation(rows.shape[0])]


def logged_step(eng, t: int, rows: np.ndarray, lay: dict) -> None:
    """Step t committed to the commit log, as dsa_core.step does with durability="step"."""
    eng._commit.begin_step(t - 1, eng._commit.meta)
    slots = eng.acquire(rows)
    eng._commit.commit_step(t, rows, slots, update(eng._pool.region[slots], t, rows, lay))


def train(eng, ref, lay, t0: int, t1: int, size: int, dist: str, *, check_every: int = 0,
          flush_every: int = 0, seed: int = 0, logged: bool = False) -> None:
    """Steps t0..t1-1 on the engine and on the reference table (``logged``: each committed
    to the commit log)."""
    everything = np.arange(lay["num_rows"])
    for t in range(t0, t1):
        rows = batch_rows(t, lay["num_rows"], size, dist, seed)
        if logged:
            logged_step(eng, t, rows, lay)
        else:
            slots = eng.acquire(rows)
            eng._pool.region[slots] = update(eng._pool.region[slots], t, rows, lay)
        if ref is not None:
            ref[rows] = update(ref[rows], t, rows, lay)
        eng._commit.count = t
        if check_every and t % check_every == 0:
            np.testing.assert_array_equal(eng.read(everything), ref, err_msg=f"step {t}")
        if flush_every and t % flush_every == 0:
            eng.flush()


def files_of(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def referenced(path: Path) -> set[str]:
    """The files a store may hold after a writer's open or flush: the manifest's, plus its
    commit log and the retired log kept for reuse under the next generation's name."""
    m = _log_format.read_manifest(path)
    index = set() if m["index"] is None else {m["index"]}  # none until a row is written
    wal = set()
    if m.get("wal") is not None:
        spare = _log_wal.wal_name(_log_format.parse_name(m["wal"])[1] + 1)
        wal = {m["wal"]} | ({spare} if (path / spare).exists() else set())
    return {_log_format.seg_name(s) for s in m["segments"]} | index | {"manifest.json",
                                                                      "writer.lock"} | wal


# -- the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["f32", "f64", "counters", "noweights"])
@pytest.mark.parametrize("dist", ["uniform", "zipf"])
def test_engine_matches_the_reference_bit_for_bit(tmp_path, kind, dist):
    lay = _layout_of(kind)
    init = "zeros" if kind == "noweights" else "normal"
    mem = _log.memory_for(lay, 160)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=mem, init=init, init_scale=0.1, seed=4,
                      max_batch=120)
    everything = np.arange(N)
    ref = eng.read(everything)
    train(eng, ref, lay, 1, 121, 120, dist, check_every=7, flush_every=40)
    st = eng.log_stats()
    assert st["seals"] > 30 and st["cleaned_segments"] > 5, st  # the machinery ran
    assert eng.check_index() == []
    eng.close()
    eng = _log.open(tmp_path / "s", memory_bytes=_log.memory_for(lay, 130))
    assert eng.count == 120
    np.testing.assert_array_equal(eng.read(everything), ref)
    assert eng.check_index() == []
    train(eng, ref, lay, 121, 161, 120, dist, check_every=5)  # go on after the reopen
    eng.close()
    eng = _log.open(tmp_path / "s", mode="r")
    np.testing.assert_array_equal(eng.read(everything), ref)
    assert files_of(tmp_path / "s") == referenced(tmp_path / "s")
    eng.close()


@pytest.mark.parametrize("kind", ["f32", "f64", "counters", "noweights"])
def test_logged_steps_replay_bit_for_bit(tmp_path, kind):
    """Steps committed to the commit log (small region, a small log bound: seals, cleaning and
    the log's own flushes all happen) read back exactly after a crash, read-only and by a
    writer, and training goes on from there."""
    lay = _layout_of(kind)
    mem = _log.memory_for(lay, 160)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=mem, init="zeros" if kind ==
                      "noweights" else "normal", init_scale=0.1, seed=4)
    eng._commit.wal_bound = 8 * 8192
    everything = np.arange(N)
    ref = eng.read(everything)
    train(eng, ref, lay, 1, 81, 120, "zipf", check_every=9, logged=True)
    st = eng.log_stats()
    assert st["seals"] > 10 and st["cleaned_segments"] > 0, st
    assert 0 < _log_format.read_manifest(tmp_path / "s")["count"] < 80  # flushed by itself
    eng.abandon()  # a crash: no flush
    r = _log.open(tmp_path / "s", mode="r")
    assert r.count == 80 and r.check_index() == []
    np.testing.assert_array_equal(r.read(everything), ref)
    eng = _log.open(tmp_path / "s", memory_bytes=mem)
    assert eng.count == 80 and _log_format.read_manifest(tmp_path / "s")["count"] == 80
    np.testing.assert_array_equal(eng.read(everything), ref)
    assert eng.check_index() == [] and files_of(tmp_path / "s") == referenced(tmp_path / "s")
    eng._commit.wal_bound = 8 * 8192
    train(eng, ref, lay, 81, 121, 120, "uniform", logged=True)
    eng.abandon()
    eng = _log.open(tmp_path / "s", memory_bytes=mem)
    np.testing.assert_array_equal(eng.read(everything), ref)
    eng.close()
    r.close()


def test_batch_as_large_as_the_region_never_evicts_its_own_rows(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 64))
    ref = eng.read(np.arange(N))
    rows0 = None
    for t in range(1, 60):
        # half of each batch was in the previous one (hits to pin), the rest is new
        rows = batch_rows(t, N, 64, "uniform")[:64]
        if rows0 is not None:
            rows = np.unique(np.concatenate([rows0[:32], rows]))[:64]
        slots = eng.acquire(rows)
        assert np.unique(slots).shape[0] == rows.shape[0]
        assert (eng._pool.slot_row[slots] == rows).all()
        eng._pool.region[slots] = update(eng._pool.region[slots], t, rows, lay)
        ref[rows] = update(ref[rows], t, rows, lay)
        rows0 = rows
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.check_index() == []
    eng.close()


def test_read_with_duplicates_and_write_whole_records(tmp_path):
    lay = _layout_of("f64")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 50),
                      init="uniform", init_scale=0.5, seed=1)
    ref = eng.read(np.arange(N))
    rows = np.arange(0, N, 3)[::-1].copy()  # 1000 rows through a 50-slot region
    rec = np.random.default_rng(0).standard_normal((rows.shape[0], lay["stride"]))
    eng.write(rows, rec)
    ref[rows] = rec
    idx = np.array([5, 3, 3, 0, 2999, 5, 6])
    pool = eng._pool
    where = (pool.disk_locations(), pool.slot_row.copy(), pool.dirty.copy(), eng.log_stats())
    np.testing.assert_array_equal(eng.read(idx), ref[idx])
    after = (pool.disk_locations(), pool.slot_row, pool.dirty, eng.log_stats())
    assert all(np.array_equal(a, b) for a, b in zip(where[:3], after[:3], strict=True))
    assert where[3] == after[3]  # read never changes residency
    w = slice(lay["w"], lay["w"] + lay["dim"])
    np.testing.assert_array_equal(eng.read(idx, cols=w), ref[idx][:, w])  # gather's columns
    np.testing.assert_array_equal(eng.read(idx, cols=slice(20, None)), ref[idx][:, 20:])
    with pytest.raises(ValueError, match="cols must be a slice"):
        eng.read(idx, cols=[1, 2])
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.read(np.array([], np.int64)).shape == (0, lay["stride"])
    assert eng.acquire(np.array([], np.int64)).shape == (0,)
    eng.close()
    eng = _log.open(tmp_path / "s", mode="r")
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)


def test_region_accounting(tmp_path):
    lay = _layout_of("f32")
    mem = 8 * lay["num_rows"] + 12345  # the index (8 B per row) first
    eng = _log.create(tmp_path / "s", lay, memory_bytes=mem)
    S = eng.slots
    parts = budget.split(lay, mem)
    assert S == parts["slots"] and eng.seal_unit == parts["seal_unit"]
    assert parts["index"] == 8 * lay["num_rows"]
    assert parts["region"] == S * (lay["stride"] * 4 + _log.SLOT_OVERHEAD)
    # the buffers: two write buffers of 2 seal units; cleaning: two of those and two
    # request buffers (an eighth of one, at least a record); a seal's staging
    rb = lay["stride"] * 4
    pitch = record_pitch(rb)  # a record as the segment file holds it: followed by its sums
    behind = 2 * eng.seal_unit * pitch
    assert parts["write_buffers"] == 2 * behind
    assert parts["cleaning_buffers"] == 2 * behind + 2 * max(pitch, behind // 8 // pitch * pitch)
    # the cleaner's reads are given exactly that share
    lim = eng._cleaner.limits
    assert lim["held"] + 2 * lim["request"] == parts["cleaning_buffers"]
    r = eng._cleaner._reader()
    assert r.held_bytes == lim["held"] and r.request_bytes(record_pitch(rb)) == lim["request"]
    assert parts["staging"] == min(8 << 20, S * record_pitch(rb)) + 64 * 2 * eng.seal_unit
    assert parts["total"] <= mem < budget.memory_for(lay, S + 1)
    assert 2 * S >= 16  # the resident map's smallest size: two entries per slot from here
    per_slot = sum(getattr(eng._pool, a).nbytes for a in (
        "slot_row", "slot_loc", "table", "pin", "mark", "free", "dirty", "ref")) / S
    assert per_slot == _log.SLOT_OVERHEAD
    assert eng._pool.index.base.nbytes == 8 * lay["num_rows"]
    with pytest.raises(ValueError, match="must pay for the index and at least one record"):
        _log.create(tmp_path / "t", lay, memory_bytes=8 * lay["num_rows"] + 100)
    region = eng._pool.region
    assert region.shape == (S, lay["stride"]) and region.nbytes == S * lay["stride"] * 4
    eng.close()


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_mapped_segments_hold_no_file_descriptors(tmp_path):
    """Python's mmap keeps a descriptor per mapping: thousands of segments would hit the
    process's descriptor limit (often 1024)."""
    lay = _layout_of("f32", 20000, dim=4)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 16),
                      space_ratio=50.0)
    fds = len(os.listdir("/proc/self/fd"))
    train(eng, None, lay, 1, 400, 8, "uniform")
    eng.flush()  # background writes done: a segment being written holds its descriptor
    assert len(eng._segments.segs) > 150
    assert len(os.listdir("/proc/self/fd")) <= fds
    rec = next(iter(eng._segments.segs.values())).records
    assert not rec.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        rec[0, 0] = 1
    eng.close()
    del rec


def test_seals_are_large_sequential_units(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 400))
    assert eng.seal_unit == 50
    train(eng, None, lay, 1, 80, 40, "uniform")  # no flush: every seal is an eviction
    sizes = [s.n for s in eng._segments.segs.values()]
    assert eng.log_stats()["seals"] > 20 and min(sizes) >= eng.seal_unit, sizes
    eng.close()


# -- deterministic init -------------------------------------------------------------------
def _py_mix(z: int) -> int:
    M = (1 << 64) - 1
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)


def _py_ln(x: float) -> float:
    m, e = math.frexp(x)
    if m < 0.7071067811865476:
        m, e = m * 2.0, e - 1
    t = (m - 1.0) / (m + 1.0)
    t2 = t * t
    p = 1.0 / 25.0
    for k in range(23, 0, -2):
        p = p * t2 + 1.0 / k
    return float(e) * 0.6931471805599453 + 2.0 * t * p


def _py_normal_weights(seed: int, row: int, dim: int, scale: float) -> list[float]:
    """The documented generator in plain Python (Python floats are IEEE doubles)."""
    M, G = (1 << 64) - 1, 0x9E3779B97F4A7C15
    key = _py_mix((_py_mix(seed ^ 0xD1B54A32D192ED03) + row * G) & M)

    def uni(c):
        return (_py_mix((key + c * G) & M) >> 11) * (1.0 / 9007199254740992.0)

    out = []
    for p in range((dim + 1) // 2):
        for a in range(256):
            c = 2 * (256 * p + a)
            v1, v2 = 2.0 * uni(c) - 1.0, 2.0 * uni(c + 1) - 1.0
            s = v1 * v1 + v2 * v2
            if 0.0 < s < 1.0:
                f = math.sqrt(-2.0 * _py_ln(s) / s)
                out += [scale * (v1 * f), scale * (v2 * f)]
                break
    return out[:dim]


def test_init_is_the_documented_function_of_seed_and_row():
    """Compiled = plain IEEE arithmetic, so the bits cannot depend on the machine's libm."""
    spec = _log_init.InitSpec("normal", 0.3, 12345, None, 7, 0, 7, np.dtype(np.float64))
    rows = np.array([0, 1, 77, 2**40 + 3])
    got = _log_init.initial_weights(rows, spec)
    for i, r in enumerate(rows.tolist()):
        assert got[i].tolist() == _py_normal_weights(12345, r, 7, 0.3)
    xs = np.random.default_rng(1).uniform(1e-300, 1.0, 2000).tolist() + [1e-320, 0.5, 1.0]
    assert max(abs(_py_ln(x) - math.log(x)) / abs(math.log(x) or 1) for x in xs) < 1e-15


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_init_same_bits_differs_by_seed_plausible_statistics(tmp_path, dtype):
    lay = _layout.make_layout(20000, 16, dtype, 0.0, True, 0)
    mem = _log.memory_for(lay, 10)
    a = _log.create(tmp_path / "a", lay, memory_bytes=mem, init="normal", init_scale=0.2,
                    seed=9)
    b = _log.create(tmp_path / "b", lay, memory_bytes=mem, init="normal", init_scale=0.2,
                    seed=9)
    c = _log.create(tmp_path / "c", lay, memory_bytes=mem, init="normal", init_scale=0.2,
                    seed=10)
    u = _log.create(tmp_path / "u", lay, memory_bytes=mem, init="uniform", init_scale=0.2,
                    seed=9)
    z = _log.create(tmp_path / "z", lay, memory_bytes=mem)
    everything = np.arange(20000)
    ra, rb, rc, ru = (e.read(everything) for e in (a, b, c, u))
    assert ra.tobytes() == rb.tobytes()
    assert (ra[:, :16] != rc[:, :16]).mean() > 0.99
    w = ra[:, :16].astype(np.float64)
    assert abs(w.mean()) < 0.005 and abs(w.std() - 0.2) < 0.005
    assert abs(np.mean(np.abs(w) < 0.2) - 0.6827) < 0.01  # one sigma
    assert (ra[:, 16:] == 0).all()  # m, v zero
    wu = ru[:, :16].astype(np.float64)
    assert wu.min() >= -0.2 and wu.max() < 0.2 and abs(wu.std() - 0.2 / math.sqrt(3)) < 0.003
    assert not z.read(everything).any()
    # rows read alone, in any order, equal the whole-table read (a function of the row)
    pick = np.array([19999, 3, 3, 12000])
    np.testing.assert_array_equal(a.read(pick), ra[pick])
    for e in (a, b, c, u, z):
        e.close()


def test_init_projects_onto_the_ball(tmp_path):
    from dsa_core._state import maxnorm
    lay = _layout.make_layout(5000, 6, np.float32, 1.0, True, 0)
    mn = maxnorm(1.0, 4e-3, np.float32)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 10),
                      init="normal", init_scale=0.5, ball_maxnorm=float(mn))
    w = eng.read(np.arange(5000))[:, :6]
    nrm = np.sqrt(np.einsum("ij,ij->i", w, w, dtype=np.float64))
    assert (nrm <= float(mn) * (1 + 1e-6)).all()
    assert np.mean(nrm > 0.99 * float(mn)) > 0.3  # many rows were projected...
    assert np.mean(nrm < 0.9 * float(mn)) > 0.1   # ...and the others left alone
    raw = _log_init.initial_weights(np.arange(5000), eng.init._replace(maxnorm=None))
    # the documented projection: norm summed in float64 in column order, rounded to float32,
    # rows beyond the radius scaled in float32 as (w / norm) * maxnorm
    sq = np.zeros(5000)
    for j in range(6):
        sq += raw[:, j].astype(np.float64) ** 2
    nrm32 = np.sqrt(sq).astype(np.float32)
    over = nrm32 > mn
    want = raw.copy()
    want[over] = (raw[over] / nrm32[over, None]) * mn
    np.testing.assert_array_equal(w, want)
    assert 0.3 < over.mean() < 0.9
    eng.close()


def test_meta_is_committed_with_each_flush(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=10**5, meta={"lr": 0.1})
    eng._commit.meta["lr"] = 0.05  # only the meta changed: the flush still commits it
    eng.flush()
    assert _log_format.read_manifest(tmp_path / "s")["meta"] == {"lr": 0.05}
    eng._commit.meta["bad"] = object()
    before = files_of(tmp_path / "s")
    with pytest.raises(TypeError, match="meta must be JSON-serialisable"):
        eng.flush()
    assert files_of(tmp_path / "s") == before
    del eng._commit.meta["bad"]
    ck = eng.checkpoint(tmp_path / "ck")
    eng.close()
    for p in (tmp_path / "s", ck):
        with _log.open(p, mode="r") as r:
            assert r._commit.meta == {"lr": 0.05}
    with pytest.raises(TypeError, match="meta must be a dict"):
        _log.create(tmp_path / "t", lay, memory_bytes=10**5, meta=[1])


# -- space and write amplification --------------------------------------------------------------
def _passes(tmp_path, ratio: float, passes: int = 10):
    num_rows, batch = 4000, 100
    lay = _layout_of("f32", num_rows)
    eng = _log.create(tmp_path / f"s{ratio}", lay, memory_bytes=_log.memory_for(lay, 400),
                      space_ratio=ratio)
    steps = passes * num_rows // batch
    for t in range(1, steps + 1):
        rng = np.random.default_rng([5, t])
        rows = np.unique(rng.integers(0, num_rows, batch))
        slots = eng.acquire(rows)
        eng._pool.region[slots] += 1
        eng._commit.count = t
        if t % 100 == 0:
            eng.flush()
    eng.flush()
    return eng


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0])
def test_space_bound_after_ten_passes(tmp_path, ratio):
    eng = _passes(tmp_path, ratio)
    st = eng.log_stats()
    rb = eng.rec_bytes
    seg_rec_bytes = st["segment_records"] * rb
    # within the slack the store may run above space_ratio while cleaning reads are in flight
    assert seg_rec_bytes <= ratio * st["live_bytes"] + st["clean_slack_records"] * rb, st
    assert st["pending_delete"] == 0 and eng.check_index() == []
    on_disk = sum(p.stat().st_size for p in eng.path.glob("seg-*.dsl"))
    # no dead file left after the flush but the spares (at most SPARE_SEGMENTS, kept for the
    # next seals to overwrite; close deletes them)
    assert on_disk == st["segment_bytes"] + st["spare_bytes"]
    assert st["spare_segments"] <= _segments.SPARE_SEGMENTS
    print(f"\nspace_ratio {ratio}: write amplification {st['write_amplification']:.3f} "
          f"(cleaning overhead {st['cleaning_overhead']:.3f}), segments hold "
          f"{st['space_used']:.3f}x the live records, {st['segments']} segments, files "
          f"{on_disk / st['live_bytes']:.2f}x the live record bytes (headers and 4 KiB "
          f"padding of {st['seal_unit']}-record seals)")
    assert 1.0 <= st["cleaning_overhead"] < 1.0 + 2.5 / (ratio - 1)  # plausible, finite
    eng.close()


# -- checkpoints and readers ---------------------------------------------------------------------
def test_checkpoint_stays_valid_while_the_source_trains_and_is_deleted(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150),
                      init="normal", seed=2, space_ratio=1.5)
    ref = eng.read(np.arange(N))
    train(eng, ref, lay, 1, 41, 100, "uniform", flush_every=15)
    ck = eng.checkpoint(tmp_path / "ck")
    ref_ck = ref.copy()
    snap = _log.open(ck, mode="r")
    assert snap.count == 40
    cleaned0 = eng.log_stats()["cleaned_segments"]
    for t0 in range(41, 161, 30):
        train(eng, ref, lay, t0, t0 + 30, 100, "uniform", flush_every=10)
        np.testing.assert_array_equal(snap.read(np.arange(N)), ref_ck)
        again = _log.open(ck, mode="r")  # a fresh open verifies every CRC too
        np.testing.assert_array_equal(again.read(np.arange(N)), ref_ck)
        assert again.check_index() == []
        again.close()
    assert eng.log_stats()["cleaned_segments"] > cleaned0 + 10
    # the source has deleted segments the checkpoint holds: the hard links keep them
    src_segs = set(_log_format.read_manifest(tmp_path / "s")["segments"])
    ck_segs = set(_log_format.read_manifest(ck)["segments"])
    assert ck_segs - src_segs
    eng.close()
    shutil.rmtree(tmp_path / "s")
    np.testing.assert_array_equal(snap.read(np.arange(N)), ref_ck)
    snap.close()
    # the checkpoint is a working store: resume from it
    eng = _log.open(ck, memory_bytes=_log.memory_for(lay, 150))
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref_ck)
    train(eng, ref_ck, lay, 41, 61, 100, "uniform", check_every=10)
    eng.close()


def test_checkpoint_overwrite_and_refusals(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150))
    train(eng, None, lay, 1, 11, 100, "uniform")
    eng.checkpoint(tmp_path / "ck")
    train(eng, None, lay, 11, 21, 100, "uniform")
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        eng.checkpoint(tmp_path / "ck")
    with pytest.raises(ValueError, match="is the live store itself"):
        eng.checkpoint(tmp_path / "s", overwrite=True)
    eng.checkpoint(tmp_path / "ck", overwrite=True)
    snap = _log.open(tmp_path / "ck", mode="r")
    assert snap.count == 20
    np.testing.assert_array_equal(snap.read(np.arange(N)), eng.read(np.arange(N)))
    snap.close()
    eng.close()


def test_checkpoint_copies_where_links_are_refused(tmp_path, monkeypatch):
    import errno

    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150),
                      init="uniform")
    train(eng, None, lay, 1, 11, 100, "uniform")

    def no_link(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    ck = eng.checkpoint(tmp_path / "ck")
    seg = next(ck.glob("seg-*.dsl"))
    assert os.stat(seg).st_nlink == 1  # a copy, not a link
    with _log.open(ck, mode="r") as snap:
        np.testing.assert_array_equal(snap.read(np.arange(N)), eng.read(np.arange(N)))
    eng.close()


def test_reader_keeps_its_flush_while_the_writer_moves_on(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150))
    ref = eng.read(np.arange(N))
    train(eng, ref, lay, 1, 31, 100, "uniform")
    eng.flush()
    reader = _log.open(tmp_path / "s", mode="r")
    seen = ref.copy()
    train(eng, ref, lay, 31, 121, 100, "uniform", flush_every=10)
    with pytest.raises(ValueError, match="read-only"):
        reader.acquire([1])
    with pytest.raises(ValueError, match="read-only"):
        reader.flush()
    np.testing.assert_array_equal(reader.read(np.arange(N)), seen)  # mapped files live on
    reader.close()
    eng.close()


# -- crashes ---------------------------------------------------------------------------------
CRASH_ROWS, CRASH_STEPS, CRASH_FLUSH, CRASH_BATCH = 2000, 90, 10, 80
CRASH_POINTS = ("seal-rows", "seal-chunk", "seal-header", "sealed", "clean", "clean-copied",
                "flush-sealed", "flush-synced", "flush-index", "flush-committed",
                "flush-deleted", "ckpt-link", "ckpt-staged", "open-clean")
# inside a logged step's append, at the flushes' log rotation, during the replay at open
WAL_POINTS = ("wal-append", "wal-payload", "wal-written", "wal-synced", "wal-started",
              "wal-retired", "wal-replayed")
# a logged step's entry: up to 80 rows x (8 + 25 x 4 bytes) + header, page-aligned 8 or 12
# KiB: the log flushes itself every 6 to 9 logged steps unless an explicit flush came first
CRASH_WAL_BOUND = 6 * 12288


# crash points inside a flush -> how many flushes of the run have committed when it strikes
_FLUSHES_DONE = {"flush-sealed": 0, "flush-synced": 0, "flush-index": 0, "flush-committed": 1}


def _pick_kill(rng, count: int, logged: bool, pending: int) -> tuple[str, int]:
    """A crash point that a run resuming at ``count`` reaches, and which time it strikes
    (``pending``: commit-log entries its open will replay)."""
    flushes = (CRASH_STEPS - count) // CRASH_FLUSH
    ckpts = len([t for t in range(count + 1, CRASH_STEPS + 1) if t % 30 == 0])
    points = CRASH_POINTS + (WAL_POINTS if logged else ())
    if pending and rng.random() < 0.5:  # the open will replay: kill it in the middle
        return "wal-replayed", int(rng.integers(1, pending + 1))
    while True:
        point = points[int(rng.integers(len(points)))]
        if point == "wal-replayed":
            if pending:
                return point, int(rng.integers(1, pending + 1))
            continue
        if point in ("wal-append", "wal-payload", "wal-written", "wal-synced") \
                and count < CRASH_STEPS:
            return point, int(rng.integers(1, CRASH_STEPS - count + 1))
        if point in ("wal-started", "wal-retired") and flushes:
            return point, int(rng.integers(1, flushes + 1))
        if point.startswith(("seal", "clean")):
            return point, int(rng.integers(1, 30))
        if point.startswith("flush") and flushes:
            return point, int(rng.integers(1, (flushes + 1) // (2 if "deleted" in point
                                                                else 1) + 1))
        if point.startswith("ckpt") and ckpts:
            return point, int(rng.integers(1, ckpts + 1))
        if point == "open-clean":
            return point, 1


def _crash_layout():
    return _layout.make_layout(CRASH_ROWS, 8, np.float32, 0.0, True, 0, per_row_step=True)


def _crash_mem(lay):
    return _log.memory_for(lay, 120)


def _run_child(path: Path, ck: Path, point, nth: int, logged: bool = False,
               report: int = -1) -> int:
    """Fork a child running :func:`_crash_child`; returns its pid."""
    pid = os.fork()
    if pid == 0:
        _crash_child(path, ck, point, nth, logged, report)
    return pid


def _crash_child(path: Path, ck: Path, point, nth: int, logged: bool, report: int) -> None:
    """Runs in the forked child: open (recovering), train to CRASH_STEPS, flush every
    CRASH_FLUSH steps, checkpoint every 30. ``logged``: every step is committed to the
    commit log and its count then written to the pipe ``report`` (the parent learns the
    last completed step). Never returns."""
    code = 1
    try:
        lay = _crash_layout()
        if point is not None:
            _log_format.set_crash(point, nth)
        eng = _log.open(path, memory_bytes=_crash_mem(lay))
        eng._commit.wal_bound = CRASH_WAL_BOUND
        for t in range(eng.count + 1, CRASH_STEPS + 1):
            rows = batch_rows(t, CRASH_ROWS, CRASH_BATCH, "uniform" if t % 3 else "zipf")
            if logged:
                logged_step(eng, t, rows, lay)
                os.write(report, struct.pack("<q", t))
            else:
                slots = eng.acquire(rows)
                eng._pool.region[slots] = update(eng._pool.region[slots], t, rows, lay)
                eng._commit.count = t
            if t % CRASH_FLUSH == 0:
                if t % 30 == 0:
                    eng.checkpoint(ck, overwrite=True)
                else:
                    eng.flush()
        eng.close()
        code = 0
    except BaseException:  # noqa: BLE001 - report and leave; never return into pytest
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def _reference_at(lay, every: int) -> dict[int, np.ndarray]:
    """The reference table after every ``every``-th step (0 = fresh)."""
    with_init = _log_init.InitSpec("normal", 0.1, 11, None, lay["dim"], lay["w"], lay["stride"],
                                   np.dtype(lay["dtype"]))
    ref = _log_init.initial_records(np.arange(CRASH_ROWS), with_init)
    out = {0: ref.copy()}
    for t in range(1, CRASH_STEPS + 1):
        rows = batch_rows(t, CRASH_ROWS, CRASH_BATCH, "uniform" if t % 3 else "zipf")
        ref[rows] = update(ref[rows], t, rows, lay)
        if t % every == 0:
            out[t] = ref.copy()
    return out


def _read_reports(fd: int) -> list[int]:
    raw = b""
    while chunk := os.read(fd, 4096):
        raw += chunk
    os.close(fd)
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


def _crash_trials(tmp_path: Path, trials: int, seed: int, logged: bool = False) -> dict:
    """Kill a training child again and again; after every kill the store must reopen at
    the reference state: the last completed flush, or with ``logged`` steps the last
    completed step (or the one in flight, if its log entry was written in full)."""
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    lay = _crash_layout()
    refs = _reference_at(lay, 1 if logged else CRASH_FLUSH)
    path, ck = tmp_path / "s", tmp_path / "ck"
    rng = np.random.default_rng(seed)
    counts = {"kills": 0, "point-kills": 0, "timed-kills": 0, "completed": 0, "in-flight": 0,
              "replays-killed": 0, "writer-checks": 0}

    def fresh():
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(ck, ignore_errors=True)
        _log.create(path, lay, memory_bytes=_crash_mem(lay), init="normal", init_scale=0.1,
                    seed=11).close()

    # calibrate the random kill times: one uninterrupted run on a scratch store
    cal = tmp_path / "cal"
    _log.create(cal, lay, memory_bytes=_crash_mem(lay), init="normal", init_scale=0.1,
                seed=11).close()
    r, w = os.pipe()
    t0 = time.perf_counter()
    _, status = os.waitpid(_run_child(cal, tmp_path / "cal-ck", None, 0, logged, w), 0)
    per_step = (time.perf_counter() - t0) / CRASH_STEPS
    os.close(w)
    assert _read_reports(r) == (list(range(1, CRASH_STEPS + 1)) if logged else [])
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    fresh()
    count, pending = 0, 0
    for trial in range(trials):
        timed = trial % 3 == 2
        point, nth = (None, 0) if timed else _pick_kill(rng, count, logged, pending)
        if point == "open-clean":  # plant garbage for the opening child to remove
            for junk in (_log_format.seg_name(10**7), _log_format.index_name(10**7),
                         _log_wal.wal_name(10**7)):
                (path / junk).write_bytes(b"junk")
        r, w = os.pipe()
        pid = _run_child(path, ck, point, nth, logged, w)
        os.close(w)
        if timed:  # anywhere in the rest of the run: seals, cleaning, flushes, checkpoints
            time.sleep(float(rng.uniform(0.0, 0.8)) * per_step * (CRASH_STEPS - count))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        reports = _read_reports(r)
        killed = os.WIFSIGNALED(status)
        if killed:
            assert os.WTERMSIG(status) == signal.SIGKILL
            counts["kills"] += 1
            counts["timed-kills" if timed else "point-kills"] += 1
            counts["replays-killed"] += point == "wal-replayed"
        else:
            assert os.WEXITSTATUS(status) == 0, f"child failed (trial {trial}, {point}:{nth})"
            counts["completed"] += 1
        what = f"trial {trial}: {point}:{nth}, from {count}, reports {reports[-3:]}"
        if logged:
            # the last step that returned; a kill can only add the step in flight
            done = reports[-1] if reports else count
            assert reports == list(range(count + 1, done + 1)), what
            reader = _log.open(path, mode="r")  # replays the log in memory, writes nothing
            got = reader.count
            if not killed:
                assert got == done == CRASH_STEPS, what
            elif point in ("wal-written", "wal-synced"):  # the entry is in the file
                assert got == done + 1 == count + nth, what
            elif point is not None and not point.startswith("seal-"):
                assert got == done, what
            else:  # a timed kill, or a seal's point hit by the background writer thread:
                # at any moment of the main thread, also between a step's return and its report
                assert got in (done, done + 1), what
            counts["in-flight"] += got == done + 1
            np.testing.assert_array_equal(reader.read(np.arange(CRASH_ROWS)), refs[got],
                                          err_msg=what)
            assert reader.check_index() == []
            reader.close()
            pending = got - _log_format.read_manifest(path)["count"]
            check_writer = pending == 0 or rng.random() < 0.6 or got == CRASH_STEPS
        else:
            check_writer = True
        if check_writer:
            # reopen: exactly the reference state, nothing else on disk
            eng = _log.open(path, memory_bytes=_crash_mem(lay))
            counts["writer-checks"] += 1
            assert eng.count in refs, (what, eng.count)
            if logged:
                assert eng.count == got, what
                assert _log_format.read_manifest(path)["count"] == got  # replayed, flushed
                pending = 0
            if not logged and killed and point in _FLUSHES_DONE:  # before or after commit
                assert eng.count == count + CRASH_FLUSH * (nth - 1 + _FLUSHES_DONE[point]), \
                    (point, nth, count, eng.count)
            if not logged and killed and point in ("ckpt-link", "ckpt-staged"):
                # the checkpoint's flush committed; its snapshot is not in place. ckpt-staged
                # strikes once per checkpoint, ckpt-link once per segment linked
                ts = [t for t in range(count + 1, CRASH_STEPS + 1) if t % 30 == 0]
                assert eng.count == ts[nth - 1] if point == "ckpt-staged" else eng.count in ts
                assert not ck.exists() or _log_format.read_manifest(ck)["count"] < eng.count
            np.testing.assert_array_equal(eng.read(np.arange(CRASH_ROWS)), refs[eng.count],
                                          err_msg=what)
            assert eng.check_index() == []
            # and the open's own spares: segments its commit-log replay sealed and that died
            # before its flush listed them (kept to be overwritten; close deletes them)
            spares = {q.name for q, _ in eng._segments.spares}
            assert files_of(path) == referenced(path) | spares, what
            count = eng.count
            eng.close()
        else:
            count = got
        if ck.exists():  # a checkpoint is complete or absent
            snap = _log.open(ck, mode="r")
            np.testing.assert_array_equal(snap.read(np.arange(CRASH_ROWS)), refs[snap.count])
            assert snap.check_index() == []
            snap.close()
        if count == CRASH_STEPS:
            fresh()
            count, pending = 0, 0
    return counts


def test_kill_at_crash_points_and_random_moments_reopens_the_last_flush(tmp_path):
    """24 kills by default (the crash points at random and every third at a random moment;
    test_many_kills runs 130 with -m slow)."""
    counts = _crash_trials(tmp_path, 24, seed=1)
    print(f"\ncrash trials: {counts}")
    assert counts["kills"] >= 14 and counts["timed-kills"] >= 3


def test_logged_steps_kill_anywhere_reopens_the_last_completed_step(tmp_path):
    """durability="step": after every kill, open (read-only and writer) returns exactly the
    state after the last step that returned, or after the one in flight when its log
    entry was already written in full; kills inside the append, the log rotation of a
    flush and the replay at open included. 28 trials by default (test_many_kills_of_logged_steps
    runs 160 with -m slow)."""
    counts = _crash_trials(tmp_path, 28, seed=3, logged=True)
    print(f"\ncrash trials (logged steps): {counts}")
    assert counts["kills"] >= 17 and counts["timed-kills"] >= 5 and counts["in-flight"] >= 1


def test_crash_point_armed_by_the_environment(tmp_path):
    """``DSA_LOG_CRASH=point:nth`` arms a crash point in a subprocess (no fork needed)."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import numpy as np
        from dsa_core import _layout, _log
        lay = _layout.make_layout(500, 4, np.float32, 0.0, True, 0)
        eng = _log.create({str(tmp_path / "s")!r}, lay, memory_bytes=_log.memory_for(lay, 20))
        for t in range(1, 30):
            eng.acquire(np.arange(10 * t, 10 * t + 10) % 500)
            print(t, flush=True)
    """)
    env = dict(os.environ, DSA_LOG_CRASH="seal-header:2")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert 2 <= len(p.stdout.split()) < 29  # killed inside the second seal
    eng = _log.open(tmp_path / "s", memory_bytes=10**5)  # the torn segment is garbage
    assert eng.count == 0 and not eng._segments.segs and eng.check_index() == []
    assert not list((tmp_path / "s").glob("seg-*"))
    eng.close()


@pytest.mark.slow
def test_many_kills(tmp_path):
    counts = _crash_trials(tmp_path, 130, seed=2)
    print(f"\ncrash trials: {counts}")
    assert counts["kills"] >= 100


@pytest.mark.slow
def test_many_kills_of_logged_steps(tmp_path):
    counts = _crash_trials(tmp_path, 160, seed=4, logged=True)
    print(f"\ncrash trials (logged steps): {counts}")
    assert counts["kills"] >= 100 and counts["in-flight"] >= 5 and counts["replays-killed"] >= 3


# -- bad inputs ---------------------------------------------------------------------------------
def test_memory_too_small_for_a_batch(tmp_path):
    lay = _layout_of("f32")
    need = _log.memory_for(lay, 11)
    assert need == budget.split(lay, 0, 11)["total"]
    with pytest.raises(ValueError, match=r"memory budget holds 10 records, a batch needs 11: "
                                         f"raise the budget \\(memory=\\) to at least {need} bytes "
                                         r".*or pass batches of at most 10 rows.* index .*region"):
        _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 10), max_batch=11)
    assert not (tmp_path / "s").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="must pay for the index and at least one record slot"):
        _log.create(tmp_path / "s", lay, memory_bytes=10)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 10))
    before = eng.read(np.arange(N))
    with pytest.raises(ValueError, match="memory budget holds 10 records, a batch needs 12"):
        eng.acquire(np.arange(12))
    eng.close()
    with pytest.raises(ValueError, match="a batch needs 50"):
        _log.open(tmp_path / "s", memory_bytes=_log.memory_for(lay, 10), max_batch=50)
    eng = _log.open(tmp_path / "s", memory_bytes=_log.memory_for(lay, 10))
    np.testing.assert_array_equal(eng.read(np.arange(N)), before)
    eng.close()


def test_bad_rows_change_nothing(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 100))
    train(eng, None, lay, 1, 10, 60, "uniform")
    before, st = eng.read(np.arange(N)), eng.log_stats()
    with pytest.raises(IndexError, match=r"rows must lie in \[0, num_rows\) = \[0, 3000\); "
                                         r"got 3000"):
        eng.acquire([1, 3000])
    with pytest.raises(IndexError, match="got -1"):
        eng.read([-1])
    with pytest.raises(ValueError, match=r"rows must be unique in acquire .* \[7\] repeat"):
        eng.acquire([7, 1, 7])
    with pytest.raises(TypeError, match="integer row ids"):
        eng.acquire(np.array([1.0]))
    with pytest.raises(ValueError, match="must be 1-D"):
        eng.acquire(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match=r"records must be a \(2, 24\) float32 array"):
        eng.write([1, 2], np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="must not repeat"):
        eng.write([1, 1], np.zeros((2, 24), np.float32))
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        eng.flush(-1)
    np.testing.assert_array_equal(eng.read(np.arange(N)), before)
    assert eng.log_stats() == st
    eng.close()
    with pytest.raises(ValueError, match="is closed"):
        eng.read([1])


def test_bad_create_arguments(tmp_path):
    lay = _layout_of("f32")
    mem = _log.memory_for(lay, 10)
    for kw, pat in [({"init": "ones"}, "init must be one of"),
                    ({"space_ratio": 1.0}, "space_ratio must be a finite float > 1"),
                    ({"init_scale": -1.0}, "init_scale must be finite and >= 0"),
                    ({"seed": -3}, r"seed must be an int in \[0, 2\*\*64\)"),
                    ({"ball_maxnorm": 0.0}, "ball_maxnorm must be a finite float > 0"),
                    ({"count": 1.5}, "count must be an int >= 0")]:
        with pytest.raises(ValueError, match=pat):
            _log.create(tmp_path / "s", lay, memory_bytes=mem, **kw)
    with pytest.raises(ValueError, match="this layout has none"):
        _log.create(tmp_path / "s", _layout_of("noweights"), memory_bytes=mem, init="normal")
    with pytest.raises(TypeError, match="memory_bytes must be an int"):
        _log.create(tmp_path / "s", lay, memory_bytes=1e6)
    with pytest.raises(ValueError, match="layout must be a record layout dict"):
        _log.create(tmp_path / "s", {"num_rows": 3}, memory_bytes=mem)
    assert not (tmp_path / "s").exists()
    _log.create(tmp_path / "s", lay, memory_bytes=mem).close()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        _log.create(tmp_path / "s", lay, memory_bytes=mem)
    eng = _log.create(tmp_path / "s", lay, memory_bytes=mem, overwrite=True)
    with pytest.raises(StoreLockedError):
        _log.create(tmp_path / "s", lay, memory_bytes=mem, overwrite=True)
    eng.close()


def test_opening_missing_or_foreign_stores(tmp_path):
    with pytest.raises(FileNotFoundError, match="the directory does not exist"):
        _log.open(tmp_path / "nope", memory_bytes=10**6)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no manifest.json"):
        _log.open(tmp_path / "empty", memory_bytes=10**6)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a log store manifest"):
        _log.open(tmp_path / "junk", memory_bytes=10**6)
    import dsa_core
    dsa_core.close(dsa_core.create(tmp_path / "inplace", 10, 4))
    with pytest.raises(ValueError, match="is an in-place DSA store"):
        _log.open(tmp_path / "inplace", memory_bytes=10**6)
    lay = _layout_of("f32")
    _log.create(tmp_path / "s", lay, memory_bytes=10**5).close()
    with pytest.raises(ValueError, match="memory_bytes is required"):
        _log.open(tmp_path / "s")
    with pytest.raises(ValueError, match="mode must be 'r'"):
        _log.open(tmp_path / "s", mode="w")


def _trained_store(tmp_path, flushes: int = 2):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150))
    ref = eng.read(np.arange(N))
    train(eng, ref, lay, 1, 1 + 20 * flushes, 100, "uniform", flush_every=20)
    eng.close()
    segs = _log_format.read_manifest(tmp_path / "s")["segments"]
    return lay, ref, [tmp_path / "s" / _log_format.seg_name(s) for s in segs]


def test_torn_or_corrupt_referenced_segment_is_a_clear_error(tmp_path):
    lay, ref, segs = _trained_store(tmp_path)
    victim = segs[len(segs) // 2]
    raw = bytearray(victim.read_bytes())
    n = _log_format.read_header(victim)["n"]
    rec_off = _log_format.segment_geometry(n, lay["stride"], 4)[2]
    bit = rec_off + (n * lay["stride"] * 4) // 2
    raw[bit] ^= 0x01  # one bit in the records
    victim.write_bytes(bytes(raw))
    with pytest.raises(_log_format.SegmentError,
                       match=f"segment file .*{victim.name}.* is corrupt: the CRC of its records"):
        _log.open(tmp_path / "s", memory_bytes=10**6)
    with pytest.raises(_log_format.SegmentError, match=victim.name):
        _log.open(tmp_path / "s", mode="r")
    raw[bit] ^= 0x01
    raw[40] ^= 0x01  # the header
    victim.write_bytes(bytes(raw))
    with pytest.raises(_log_format.SegmentError, match=f"{victim.name}.* corrupt header"):
        _log.open(tmp_path / "s", memory_bytes=10**6, check="headers")
    raw[40] ^= 0x01
    victim.write_bytes(bytes(raw[:len(raw) - 4096]))  # torn
    with pytest.raises(_log_format.SegmentError, match=f"{victim.name}.* is torn"):
        _log.open(tmp_path / "s", memory_bytes=10**6, check="headers")
    victim.unlink()
    with pytest.raises(_log_format.SegmentError, match=f"{victim.name}.* is missing"):
        _log.open(tmp_path / "s", memory_bytes=10**6)
    victim.write_bytes(bytes(raw))  # repaired: opens again, nothing was lost
    eng = _log.open(tmp_path / "s", memory_bytes=10**6)
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    eng.close()


def test_corrupt_index_is_a_clear_error(tmp_path):
    lay, ref, segs = _trained_store(tmp_path)
    m = _log_format.read_manifest(tmp_path / "s")
    idx = tmp_path / "s" / m["index"]
    raw = bytearray(idx.read_bytes())
    raw[8 * 17] ^= 0x10
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"index file .*{m['index']}.* is corrupt"):
        _log.open(tmp_path / "s", memory_bytes=10**6)
    idx.write_bytes(bytes(raw[:-8]))
    with pytest.raises(ValueError, match=r"the store's 3000 rows \(in pages of 512, with "
                                         r"sums\) need 24,624"):
        _log.open(tmp_path / "s", memory_bytes=10**6)
    # an index with valid checksums whose locations do not fit the segments
    good = np.frombuffer(bytes(raw), np.int64)[:N].copy()
    good[17] ^= 0x10  # undo the flipped bit
    sid = m["segments"][0]
    n = _log_format.read_header(tmp_path / "s" / _log_format.seg_name(sid))["n"]
    for bad, pat in [((sid << 32) + n + 1, "point past the end of their segments"),
                     ((10**6 << 32) + 1, "point at segments the manifest does not list"),
                     (-5, "have negative locations")]:
        planted = good.copy()
        planted[3] = bad
        crc, _ = _log_format.write_index(idx, N, [_log_format.dense_entries(planted)], N)
        _log_format.write_manifest(tmp_path / "s", dict(m, index_crc32=crc))
        with pytest.raises(ValueError, match=f"does not match its segments: rows \\[3\\] {pat}"):
            _log.open(tmp_path / "s", mode="r")
    a, b = np.flatnonzero(good > 0)[:2].tolist()
    planted = good.copy()
    planted[b] = good[a]  # two rows, one record
    crc, _ = _log_format.write_index(idx, N, [_log_format.dense_entries(planted)], N)
    _log_format.write_manifest(tmp_path / "s", dict(m, index_crc32=crc))
    with pytest.raises(ValueError, match=f"row {b} points at record .* which holds row {a}"):
        _log.open(tmp_path / "s", mode="r")


def test_second_writer_is_locked_out(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=10**5)
    with pytest.raises(StoreLockedError, match="already open for writing"):
        _log.open(tmp_path / "s", memory_bytes=10**5)
    reader = _log.open(tmp_path / "s", mode="r")  # readers take no lock
    eng.close()
    _log.open(tmp_path / "s", memory_bytes=10**5).close()  # free again after close
    reader.close()


def test_garbage_is_removed_by_the_writer_and_ignored_by_readers(tmp_path):
    lay, ref, segs = _trained_store(tmp_path)
    s = tmp_path / "s"
    junk = {_log_format.seg_name(99999), _log_format.index_name(99999), "manifest.json.tmp"}
    for name in junk:
        (s / name).write_bytes(b"left by a crash")
    r = _log.open(s, mode="r")
    np.testing.assert_array_equal(r.read(np.arange(N)), ref)
    assert junk <= files_of(s)
    eng = _log.open(s, memory_bytes=10**6)
    assert not junk & files_of(s)
    assert files_of(s) == referenced(s)
    eng.close()
    r.close()


def test_verify_finds_planted_inconsistencies(tmp_path):
    lay = _layout_of("f32")
    eng = _log.create(tmp_path / "s", lay, memory_bytes=_log.memory_for(lay, 150))
    train(eng, None, lay, 1, 40, 100, "uniform", flush_every=13)
    assert eng.check_index() == []
    on_disk = np.flatnonzero(eng._pool.index.base > 0)
    a, b = int(on_disk[0]), int(on_disk[1])
    saved = eng._pool.index.base[a]
    eng._pool.index.base[a] = eng._pool.index.base[b]  # row a now points at row b's record
    problems = eng.check_index()
    assert any(f"row {a} points at record" in p and f"holds row {b}" in p for p in problems)
    assert any("live records counted" in p for p in problems), problems
    eng._pool.index.base[a] = saved
    assert eng.check_index() == []
    sid = next(iter(eng._segments.segs))
    eng._segments.live[sid] += 1
    assert any(f"segment {sid}:" in p for p in eng.check_index())
    eng._segments.live[sid] -= 1
    used = int(np.flatnonzero(eng._pool.slot_row >= 0)[0])
    eng._pool.slot_row[used], saved = -1, eng._pool.slot_row[used]
    assert any("resident in slots that hold other rows" in p for p in eng.check_index())
    eng._pool.slot_row[used] = saved
    assert eng.check_index() == []
    eng.close()


def test_crc_of_records_is_the_header_crc(tmp_path):
    """The segment format as documented: parts on 4 KiB boundaries, CRCs of the parts."""
    lay, ref, segs = _trained_store(tmp_path, flushes=1)
    seg = segs[0]
    h = _log_format.read_header(seg)
    rows_off, steps_off, rec_off, size = _log_format.segment_geometry(h["n"], lay["stride"], 4)
    raw = seg.read_bytes()
    assert len(raw) == size and raw[:8] == b"DSALOG01"
    assert rows_off % 4096 == steps_off % 4096 == rec_off % 4096 == 0
    rows = np.frombuffer(raw[rows_off:rows_off + 8 * h["n"]], np.int64)
    # version 3: each record followed by its two sums (of its weights, of the rest)
    rb = lay["stride"] * 4
    pitch = _log_format.record_pitch(lay["stride"], 4)
    assert h["version"] == 3 and pitch == -(-rb // 8) * 8 + 16
    part = np.frombuffer(raw[rec_off:rec_off + h["n"] * pitch], np.uint8).reshape(-1, pitch)
    assert zlib.crc32(rows) == h["crc_rows"] and zlib.crc32(part) == h["crc_records"]
    recs = part[:, :rb].copy().view(np.float32)
    sums = part[:, pitch - 16:].copy().view(np.uint64)
    assert h["head"] == 4 * lay["dim"]  # the weights
    np.testing.assert_array_equal(sums, split_sums(recs, h["head"]))
    np.testing.assert_array_equal(sums[:, 0], record_sums(recs[:, :lay["dim"]]))
    m = _log_format.read_manifest(tmp_path / "s")
    index = np.fromfile(tmp_path / "s" / m["index"], np.int64)
    mine = np.flatnonzero((index > 0) & ((index - 1) >> 32 == h["id"]))
    k = (index[mine] - 1) & 0xFFFFFFFF
    assert (rows[k] == mine).all()
    np.testing.assert_array_equal(recs.reshape(-1, lay["stride"])[k], ref[mine])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-s"]))
