"""``memory=`` of a log store covers its buffers too (dsa_core._log.budget, issue 28).

The parts add up to the budget; a batch too large for it is a clear error that names a
budget that works; the write buffers never exceed their share, also when the writer lags
or a write fails; the memory that numpy allocates during an aged run stays inside the
buffers' share.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import tracemalloc
import weakref

import numpy as np
import pytest

import dsa_core
from helpers import batches, create, records, train
from dsa_core import _log
from dsa_core._log import budget
from dsa_core._log import segments as _log_segments
from dsa_core._log import writer as _log_writer
from dsa_core._log.sums import record_pitch

N, D, B = 2000, 8, 64
BIG = {"num_rows": 4_000_000, "stride": 388, "dtype": "float32"}  # 4M x 128, 1,552-B records


def _layout():
    return {"num_rows": N, "stride": 3 * D, "dtype": "float32"}


@pytest.mark.parametrize("lay", [_layout(), BIG, {"num_rows": 10, "stride": 1,
                                                  "dtype": "float64"}])
def test_the_parts_add_up_to_the_budget_and_memory_for_is_the_smallest(lay):
    rb = lay["stride"] * np.dtype(lay["dtype"]).itemsize
    for batch in (1, 7, 100, 4096, 65_536, 500_000):
        need = budget.memory_for(lay, batch)
        assert budget.slots_for(lay, need) >= batch > budget.slots_for(lay, need - 1)
    for mem in (budget.memory_for(lay, 1), 3 << 20, 256 << 20, 1 << 30, 64 << 30):
        if mem < budget.memory_for(lay, 1):
            assert budget.slots_for(lay, mem) == 0
            continue
        p = budget.split(lay, mem)
        assert p["total"] <= mem < budget.memory_for(lay, p["slots"] + 1)
        assert p["total"] == sum(p[k] for k in ("index", "region", "write_buffers",
                                                "cleaning_buffers", "staging"))
        # the index in memory, or mapped in half the budget when its 8 bytes per row would
        # take more (and half pays for a delta of MIN_DELTA rows)
        mapped = 16 * lay["num_rows"] > mem >= budget._mapped_floor(lay)
        assert budget.index_mapped(lay, mem) == mapped
        assert p["index"] == (mem // 2 if mapped else 8 * lay["num_rows"])
        assert not mapped or budget.delta_capacity(lay, mem) >= budget.MIN_DELTA
        assert p["region"] == p["slots"] * (rb + budget.SLOT_OVERHEAD)
        assert p["seal_unit"] == budget.seal_unit_for(p["slots"], rb)
        # write buffers: two of two seal units, at most 128 MiB together
        # (each record as a segment file holds it: followed by its sums)
        assert p["write_buffers"] == 4 * p["seal_unit"] * record_pitch(rb)
        assert p["write_buffers"] <= 4 * budget.SEAL_BYTES
        # cleaning: two victims' buffers of at most a write buffer (at most 32 MiB) and two
        # request buffers of an eighth of that (at most 4 MiB, at least a record)
        pitch = record_pitch(rb)  # read as the file holds them, with their sums
        whole = min(32 << 20, 2 * p["seal_unit"] * pitch)
        request = max(pitch, min(4 << 20, whole // 8) // pitch * pitch)
        assert p["cleaning_buffers"] == 2 * whole + 2 * request <= 72 << 20
    # a large budget goes to the region: the buffers stop growing at 32 MiB seal units
    big = budget.split(BIG, 64 << 30)
    assert big["region"] > 0.99 * ((64 << 30) - big["index"]) - (300 << 20)


def test_a_batch_too_large_for_the_budget_is_a_clear_error_naming_one_that_works(tmp_path):
    lay = _layout()
    mem = budget.memory_for(lay, 100)
    s = dsa_core.create(tmp_path / "s", N, D, storage="log", memory=mem, init="normal", seed=1)
    rng = np.random.default_rng(0)
    for _ in range(5):
        s = dsa_core.step(s, rng.choice(N, 100, replace=False),
                          rng.standard_normal((100, D)).astype(np.float32))
    before = records(s)
    ids = rng.choice(N, 101, replace=False)
    g = rng.standard_normal((101, D)).astype(np.float32)
    with pytest.raises(ValueError) as err:
        dsa_core.step(s, ids, g)
    msg = str(err.value)
    # what must hold, what came, how to fix it, and what the budget pays for
    assert "memory budget holds 100 records, a batch needs 101" in msg
    assert "or pass batches of at most 100 rows" in msg
    lay = _layout()
    with pytest.raises(ValueError, match=r"to at least \d+ bytes .* \(this budget holds no "
                                         r"record at all\)\. memory="):
        budget.check_memory(lay, budget.memory_for(lay, 1) - 1, 1)  # not "at most 0 rows"
    for part in ("index", "region", "write buffers", "cleaning buffers", "seal staging"):
        assert part in msg
    need = int(re.search(r"to at least (\d+) bytes", msg).group(1))
    assert need == budget.memory_for(lay, 101)
    np.testing.assert_array_equal(records(s), before)  # nothing of the step happened
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "s", memory=need)  # the budget the error named works
    s = dsa_core.step(s, ids, g)
    assert s.count == 6
    dsa_core.close(s)
    with pytest.raises(ValueError, match=f"at least {budget.memory_for(lay, 1)} bytes"):
        dsa_core.create(tmp_path / "t", N, D, storage="log",
                        memory=budget.memory_for(lay, 1) - 1)
    with pytest.raises(ValueError, match="smallest budget that works for this table"):
        _log.create(tmp_path / "t", s.layout, memory_bytes=budget.memory_for(lay, 1) - 1)


def _track_buffers(monkeypatch):
    """Weak references to every buffer the segment table allocates."""
    made = []
    real = np.empty

    class _Numpy:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(*a, **kw):
            x = real(*a, **kw)
            made.append(weakref.ref(x))
            return x

    monkeypatch.setattr(_log_segments, "np", _Numpy())
    return made


# the stores (helpers.create): a region of 3 * B records (memory=budget.memory_for(_layout(),
# 3 * B)), the weights one fixed draw
INIT = (np.random.default_rng(0).standard_normal((N, D)) * 0.1).astype(np.float32)
INIT.flags.writeable = False  # one array for every store: none may change it
LOG = {"kind": "log", "slots": 3 * B, "init": INIT}
# the steps (helpers.train, batch=B, rows=HOT, unique=True): B distinct ids a step from a hot
# set a third larger than the region
HOT = np.arange(4 * B)


def test_write_buffers_stay_within_their_share_when_the_writer_lags(tmp_path, monkeypatch):
    """A slow writer: seals wait for the oldest write rather than take a third buffer; the
    records are those of a run that writes every seal at once."""
    with monkeypatch.context() as m:
        m.setattr(_log.commit, "BEHIND_BYTES", 0)  # the reference: no writer thread
        s = train(create(tmp_path / "sync", N, D, **LOG, space_ratio=1.2), 120, batch=B,
                  rows=HOT, unique=True)
        want = records(s)
        dsa_core.close(s)
    made = _track_buffers(monkeypatch)
    real_write = _log_writer.write_segment

    def slow_write(*a, **kw):
        time.sleep(0.01)
        return real_write(*a, **kw)

    monkeypatch.setattr(_log_writer, "write_segment", slow_write)
    s = create(tmp_path / "slow", N, D, **LOG, space_ratio=1.2)
    segs = s.store._segments  # commit writes behind at most a write buffer's seal
    most, real_seal = [0], _log.commit.Commit.seal

    def counting_seal(self, *a, **kw):
        real_seal(self, *a, **kw)
        alive = [r() for r in made if r() is not None]
        most[0] = max(most[0], len(alive))
        assert all(b.nbytes <= segs.behind_bytes for b in alive)

    monkeypatch.setattr(_log.commit.Commit, "seal", counting_seal)
    s = train(s, 120, batch=B, rows=HOT, unique=True)
    assert s.store.log_stats()["cleaned_segments"] > 0 and len(made) >= budget.WRITE_BUFFERS
    assert most[0] == budget.WRITE_BUFFERS  # used, never exceeded
    assert s.store.check_index() == []
    np.testing.assert_array_equal(records(s).view(np.uint8), want.view(np.uint8))
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "slow", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_a_failed_write_found_by_a_waiting_seal_changes_nothing(tmp_path, monkeypatch):
    """The seal that waits for the oldest write (both buffers pending) retries it when it
    failed (a full disk); a second failure raises before the step changes anything, and the
    same batch again ends as the reference."""
    with monkeypatch.context() as m:
        m.setattr(_log.commit, "BEHIND_BYTES", 0)
        s = train(create(tmp_path / "sync", N, D, **LOG, space_ratio=1.2), 100, batch=B,
                  rows=HOT, unique=True)
        want = records(s)
        dsa_core.close(s)
    real_write = _log_writer.write_segment
    fail = {"sid": None, "left": 0}
    lock = threading.Lock()
    waited = []
    real_oldest = _log_segments.Segments.settle_oldest

    def flaky_write(path, sid, *a, **kw):
        time.sleep(0.01)  # the writer lags: seals wait for it
        with lock:
            if sid == fail["sid"] and fail["left"]:
                fail["left"] -= 1
                raise OSError(28, "No space left on device")
        return real_write(path, sid, *a, **kw)

    def counting_oldest(self):
        waited.append(next(iter(self.pending)))
        return real_oldest(self)

    monkeypatch.setattr(_log_writer, "write_segment", flaky_write)
    monkeypatch.setattr(_log_segments.Segments, "settle_oldest", counting_oldest)
    s = create(tmp_path / "flaky", N, D, **LOG, space_ratio=1.2)
    plan = batches(100, N, D, batch=B, rows=HOT, unique=True)  # the reference's steps
    k, failures, arm = 0, 0, {30: 1, 60: 2}
    while k < len(plan):
        if k in arm:  # once: the retry succeeds; twice: the step raises (armed once, not
            fail.update(sid=s.store._segments.next_segment, left=arm.pop(k))  # per retry)
        before = s.count
        try:
            s = dsa_core.step(s, *plan[k])
        except OSError as exc:
            assert "the next seal or flush tries again" in str(exc)
            failures += 1
            assert s.current and s.count == before
            continue
        k += 1
    assert failures == 1 and fail["left"] == 0 and waited
    assert s.store.check_index() == []
    np.testing.assert_array_equal(records(s).view(np.uint8), want.view(np.uint8))
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "flaky", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_the_write_path_allocates_within_the_budget(tmp_path):
    """numpy's allocations during 300 steps and 3 flushes of a warm store, beyond what it
    held before: at most the write buffers, the seal staging and a flush's index copy, plus
    the steps' own arrays (tracemalloc counts numpy's data). Cleaning is off here
    (``space_ratio`` large): the cleaning reads' buffers are ``read.CleaningReads``', whose
    size the cleaner decides."""
    n, d, b = 20_000, 16, 256
    s = dsa_core.create(tmp_path / "s", n, d, storage="log", memory=3 << 20, space_ratio=50.0)
    parts = budget.split(s.layout, 3 << 20)
    rng = np.random.default_rng(0)
    g = rng.standard_normal((b, d)).astype(np.float32)
    for _ in range(100):  # warm: kernels compiled, region full, buffers allocated once
        s = dsa_core.step(s, rng.choice(n, b, replace=False), g)
    dsa_core.flush(s)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(300):
            s = dsa_core.step(s, rng.choice(n, b, replace=False), g)
            if i % 100 == 99:
                dsa_core.flush(s)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    st = s.store.log_stats()
    assert st["seals"] > 20 and st["cleaned_segments"] == 0
    steps_own = 4 * b * d * 4 + (64 << 10)  # a step's ids and gradients, Python objects
    allowed = parts["write_buffers"] + parts["staging"] + 8 * n + steps_own
    assert peak <= allowed, (peak, parts)
    dsa_core.close(s)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("nth", [2, 7])
def test_kill_while_seals_wait_for_the_writer_reopens_at_the_last_flush(tmp_path, nth):
    """kill -9 (a crash point in the writer thread's nth record block) while the writer
    lags and seals wait for its oldest write: the store reopens exactly at its last flush,
    without the unfinished segments (garbage for the writer's open)."""
    s = train(create(tmp_path / "k", N, D, **LOG, space_ratio=1.2), 30, batch=B, rows=HOT,
              unique=True)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "k", mode="r")
    want = records(r)
    dsa_core.close(r)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            real_write = _log_writer.write_segment

            def slow_write(*a, **kw):
                time.sleep(0.01)
                return real_write(*a, **kw)

            _log_writer.write_segment = slow_write
            _log.format.set_crash("seal-chunk", nth)
            s2 = dsa_core.open(tmp_path / "k", memory=budget.memory_for(_layout(), 3 * B))
            train(s2, 100, batch=B, rows=HOT, unique=True, seed=5)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    r = dsa_core.open(tmp_path / "k", memory=budget.memory_for(_layout(), 3 * B))
    assert r.count == 30
    np.testing.assert_array_equal(records(r), want)
    assert r.store.check_index() == []
    dsa_core.close(r)


def test_an_index_written_in_pieces_is_the_same_file(tmp_path):
    """``format.write_index`` takes the entries whole or in pieces of any length: same bytes,
    same CRC (a flush may then write it without a second copy of it in memory). Dense: the
    locations padded to whole pages of 512, then a checksum per page; sparse: the rows and
    their locations, 256 a page, then the checksums and each page's first row."""
    from dsa_core._log import format as _log_format

    rows = 300_001
    idx = np.random.default_rng(0).integers(0, 1 << 40, rows).astype(np.int64)
    idx[np.random.default_rng(1).random(rows) < 0.3] = 0  # rows never written
    few = np.zeros(rows, np.int64)
    few[::7] = idx[::7] | 1  # a seventh of the rows: a sparse base
    for locs, sparse in [(idx, False), (few, True)]:
        r, v = _log_format.dense_entries(locs)
        crc, listed = _log_format.write_index(tmp_path / "a", rows, [(r, v)], r.shape[0])
        assert (listed is not None) == sparse and listed in (None, r.shape[0])
        pieces = ((r[lo:lo + 65_537], v[lo:lo + 65_537]) for lo in range(0, r.shape[0], 65_537))
        assert _log_format.write_index(tmp_path / "b", rows, pieces, r.shape[0]) == (crc, listed)
        raw = (tmp_path / "a").read_bytes()
        assert raw == (tmp_path / "b").read_bytes()
        pages, off, size = _log_format.index_geometry(rows, listed)
        assert len(raw) == size
        got = np.frombuffer(raw[:off], np.int64).reshape(pages, 512)
        if sparse:
            np.testing.assert_array_equal(got[:, :256].reshape(-1)[:r.shape[0]], r)
            np.testing.assert_array_equal(got[:, 256:].reshape(-1)[:r.shape[0]], v)
            assert (got[:, :256].reshape(-1)[r.shape[0]:] == _log_format.NO_ROW).all()
            fence = np.frombuffer(raw[off + 8 * pages:], np.int64)
            np.testing.assert_array_equal(fence, got[:, 0])
        else:
            assert raw[:8 * rows] == locs.tobytes()
            assert raw[8 * rows:off] == bytes(off - 8 * rows)  # zero padding
        sums = np.frombuffer(raw[off:off + 8 * pages], np.uint64)
        np.testing.assert_array_equal(sums, _log_format.page_sums(got))
        np.testing.assert_array_equal(
            _log_format.read_index(tmp_path / "b", rows, crc, listed=listed), locs)


def test_a_dense_index_leaves_its_pages_of_zeros_holes(tmp_path):
    """Pages of a dense base that hold no location are not written: the file takes disk
    for the pages written (a table whose ids come in ranges), and reads back the same."""
    from dsa_core._log import format as _log_format

    rows = 4_000_000  # 7,813 pages, 31 MiB
    locs = np.zeros(rows, np.int64)
    locs[:1_500_000] = np.arange(1, 1_500_001)  # the first 2,930 pages only
    crc, listed = _log_format.write_index(tmp_path / "a", rows,
                                          [_log_format.dense_entries(locs)], 1_500_000)
    assert listed is None
    st = os.stat(tmp_path / "a")
    assert st.st_size == _log_format.index_geometry(rows)[2]
    if st.st_blocks * 512 >= st.st_size:  # pragma: no cover - a filesystem without holes
        pytest.skip("this filesystem allocates holes")
    assert st.st_blocks * 512 < 13 << 20  # 11.4 MiB of pages + 61 KiB of sums
    np.testing.assert_array_equal(_log_format.read_index(tmp_path / "a", rows, crc), locs)


def test_misses_are_copied_straight_into_place_with_one_record_of_scratch(tmp_path,
                                                                            monkeypatch):
    """A batch whose misses lie in many segments is copied by one kernel call (no piece or
    block of records held in between: one record of scratch), every record checked against
    its sum; the values are those written."""
    s = dsa_core.create(tmp_path / "s", N, D, storage="log", init="normal", seed=2,
                        memory=budget.memory_for(_layout(), 4 * B))
    rng = np.random.default_rng(0)
    for lo in range(0, 4 * B, B):  # rows [0, 4B) updated, then sealed in order
        s = dsa_core.step(s, np.arange(lo, lo + B), rng.standard_normal((B, D)).astype(np.float32))
    want = records(s)
    s.store.release(np.arange(4 * B))
    dsa_core.flush(s)  # the segments are files now, whose reads are checked
    s.store._segments.settle(block=True)
    calls, real = [], _log_segments.gather_checked

    def counting(addrs, sums, *rest):
        calls.append((int((sums != 0).sum()), rest[-1] - rest[-2]))  # checked, rows in it
        return real(addrs, sums, *rest)

    monkeypatch.setattr(_log_segments, "gather_checked", counting)
    monkeypatch.setattr(_log_segments, "run_chunked",
                        lambda fn, args, n, chunk: fn(*args, 0, n))  # one call, this thread
    got = s.store.read(np.arange(N))
    np.testing.assert_array_equal(got, want)
    assert len(calls) == 1 and calls[0][0] == calls[0][1] >= 4 * B  # all checked, one call
    dsa_core.close(s)


def test_a_flush_writes_the_index_in_pieces_within_the_staging_share(tmp_path, monkeypatch):
    """The budget charges 8 bytes per row for the index: a flush never builds a second whole
    index, it writes pieces of at most the staging chunk, which make up the same file."""
    s = train(create(tmp_path / "s", N, D, **LOG, space_ratio=1.2), 20, batch=B, rows=HOT,
              unique=True)
    eng = s.store
    pool = eng._pool
    whole = pool.disk_locations()
    rows = budget.index_piece_rows(pool.slots, eng.rec_bytes)
    assert rows * 8 <= budget.split(_layout(), eng.memory_bytes)["staging"]
    located = np.flatnonzero(whole)
    got = list(pool.disk_entries())  # (row, location) pairs: half as many as locations
    assert all(p[0].shape[0] <= rows // 2 for p in got)
    np.testing.assert_array_equal(np.concatenate([p[0] for p in got]), located)
    pieces = list(pool.disk_entries(300))  # pieces make up the same index
    assert len(pieces) == 14 and all(p[0].shape[0] <= 150 for p in pieces)  # 16 B an entry
    np.testing.assert_array_equal(np.concatenate([p[0] for p in pieces]), located)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in pieces]), whole[located])

    def no_whole_index(self):
        raise AssertionError("a flush built the whole index")

    monkeypatch.setattr(_log.pool.Pool, "disk_locations", no_whole_index)
    s = train(s, 5, batch=B, rows=HOT, unique=True)
    dsa_core.flush(s)
    monkeypatch.undo()
    want = records(s)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "s", mode="r")  # the index file read back whole, CRC checked
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)
