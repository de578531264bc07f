"""Reading a log store at queue depth: read-ahead hints, range loads and releases.

Hints must never change a value (the records are still copied from the segment mappings by
the engine itself); the range release must write every dirty row and free its slots.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import dsa_core
from helpers import batches, create, log_memory, records, train
from dsa_core._log import read as _log_read

N, D = 3000, 8
B = 64


# the stores (helpers.create with slots=): the weights one fixed draw
INIT = (np.random.default_rng(0).standard_normal((N, D)) * 0.1).astype(np.float32)
INIT.flags.writeable = False  # one array for every store: none may change it
LOG = {"kind": "log", "init": INIT}


def _evict_segments(path, state=None):
    """Drop the (clean, flushed) segment pages from the page cache; with ``state`` (an open
    log store) those its segment mappings hold as well, which ``posix_fadvise`` leaves (a
    page mapped in is not dropped: ``MADV_PAGEOUT`` on the mapping first)."""
    if state is not None:
        from dsa_core._os import MADV_PAGEOUT, advise_memory

        for seg in state.store._pool.segments.segs.values():
            for arr in (seg.records, seg.sums):
                advise_memory(arr, MADV_PAGEOUT)
    for name in os.listdir(path):
        if name.startswith("seg-"):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_readahead_reads_uncached_records_and_changes_nothing(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=500)
    s = train(s, 40, batch=B)
    dsa_core.close(s)  # flushed: every record is in a segment, none resident after reopen
    r = dsa_core.open(tmp_path / "log", mode="r")
    want = records(r)
    dsa_core.close(r)
    del r
    gc.collect()  # unmap the reader's segments: the kernel keeps pages that are mapped
    s = dsa_core.open(tmp_path / "log", memory=log_memory(s.layout, 500))
    rows = np.arange(0, N, 7)
    addrs, sums, keep = s.store.readahead(rows)
    assert addrs.shape[0] == rows.shape[0] and keep  # all on disk, none resident
    assert sums.shape[0] == 0  # each record's sums lie beside it: read with it
    _evict_segments(tmp_path / "log", s)
    if not _log_read.sample_uncached(addrs, s.store.rec_bytes):
        pytest.skip("this filesystem keeps the pages cached (tmpfs?): nothing to read ahead")
    dsa_core.prefetch(s, rows, wait=True)
    ra = s.store._readahead
    assert ra.tasks == 1 and ra.calls > 0  # the hints were issued
    # the engine's own reads hint too: gather of evicted rows, then a step that misses
    _evict_segments(tmp_path / "log", s)
    np.testing.assert_array_equal(dsa_core.gather(s, rows), want[rows, :D])
    np.testing.assert_array_equal(records(s), want)
    dsa_core.close(s)


def test_sample_uncached_and_spans():
    lo, hi = _log_read.record_spans(np.array([8192 + 4000, 100], np.int64), 200)
    assert lo.tolist() == [0, 8192] and hi.tolist() == [4096, 16384]  # sorted, straddling: 2
    assert not _log_read.sample_uncached(np.zeros(0, np.int64), 200)
    buf = np.ones(1 << 16, np.uint8)  # anonymous, touched: "in core"
    base = buf.__array_interface__["data"][0]
    assert not _log_read.sample_uncached(base + np.arange(0, 60000, 1000), 100)
    assert not _log_read.sample_uncached(base + np.array([4000]), 200)  # one, straddling
    # a mapping never touched has no page in core: any sampled record there says so, the
    # first, the last, or one straddling from a touched page into an untouched one
    import mmap

    m = mmap.mmap(-1, 1 << 20)
    fresh = np.frombuffer(m, np.uint8)
    fresh[:8192] = 1  # the first two pages touched
    b2 = fresh.__array_interface__["data"][0]
    assert _log_read.sample_uncached(b2 + np.arange(0, 60000, 1000), 100)
    assert not _log_read.sample_uncached(b2 + np.array([0, 1000, 4000]), 100)
    assert _log_read.sample_uncached(b2 + np.array([0, 1000, 8100]), 100)  # 2nd page of it
    assert _log_read.sample_uncached(b2 + np.array([0, 1000, 9000]), 100)  # the last
    assert _log_read.sample_uncached(b2 + np.array([9000, 1000, 2000]), 100)  # the first
    assert not _log_read.sample_uncached(b2 + np.arange(0, 8000, 10), 100, k=1000)  # k > n
    assert _log_read.sample_uncached(b2 + np.arange(0, 8200, 10), 100, k=1000)
    del fresh
    m.close()
    assert _log_read.sample_uncached(np.array([4096], np.int64), 100)  # unmapped: read ahead


@pytest.mark.parametrize("space_ratio", [1.3, 2.0])
def test_prefetch_and_releases_racing_steps_give_identical_records(tmp_path, space_ratio):
    """Read-ahead of future batches (a background thread) and range releases between steps,
    with a small region and a tight space bound (seals and cleaning all the time): the
    records are exactly those of the same run without any hint."""
    plan = batches(120, N, D, batch=B)
    runs = []
    for name, hints in (("plain", False), ("hinted", True)):
        s = create(tmp_path / name, N, D, **LOG, slots=2 * B, space_ratio=space_ratio)
        feed = dsa_core.prefetched(s, plan, ahead=3) if hints else plan
        held = []  # loaded ranges: at most two of 30 rows beside a batch of 64 in 128 slots
        for k, (idx, g) in enumerate(feed):
            s = dsa_core.step(s, idx, g)
            if hints and k % 7 == 0:
                lo = (k * 97) % N
                dsa_core.release_range(s, lo, min(N, lo + 500))  # any rows, loaded or not
                if len(held) == 2:
                    dsa_core.release_range(s, *held.pop(0))
                held.append(((lo + 500) % N, min(N, (lo + 500) % N + 30)))
                dsa_core.load_range(s, *held[-1])
        dsa_core.wait_ranges(s)
        assert s.store.check_index() == []
        runs.append(s)
    assert runs[1].store.log_stats()["cleaned_segments"] > 0  # cleaning did run
    np.testing.assert_array_equal(records(runs[0]).view(np.uint8),
                                  records(runs[1]).view(np.uint8))
    for s in runs:
        dsa_core.close(s)
    a = dsa_core.open(tmp_path / "plain", mode="r")
    b = dsa_core.open(tmp_path / "hinted", mode="r")
    np.testing.assert_array_equal(records(a), records(b))  # and so are the flushed stores
    dsa_core.close(a)
    dsa_core.close(b)


def test_release_seals_the_dirty_rows_in_row_order_and_frees_their_slots(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=1000)
    rows = np.random.default_rng(2).permutation(np.arange(100, 400))
    s = dsa_core.step(s, rows, np.ones((rows.shape[0], D), np.float32))
    s = dsa_core.step(s, [5, 6], np.ones((2, D), np.float32))
    dsa_core.flush(s)
    s = dsa_core.step(s, rows, np.ones((rows.shape[0], D), np.float32))  # dirty again
    want = records(s)
    eng = s.store
    used = eng.log_stats()["slots_used"]
    resident = int(eng._pool.resident(np.arange(450)).sum())
    assert resident >= 302  # the 300 dirty rows and the clean 5, 6
    dsa_core.release_range(s, 0, 450)
    assert eng.log_stats()["slots_used"] == used - resident
    assert dsa_core.residency(s, np.arange(0, 450)) == 0.0
    loc = eng._pool.index.get(np.arange(100, 400))
    segs = ((loc - 1) >> 32).tolist()
    # the rows in row order, in consecutive segments of a seal unit each
    assert (loc > 0).all() and (np.diff(loc) > 0).all()
    assert len(set(segs)) == -(-300 // eng.seal_unit) and sorted(set(segs)) == list(
        range(segs[0], segs[0] + len(set(segs))))
    np.testing.assert_array_equal(records(s), want)
    assert eng.check_index() == []
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_read_only_store_prefetches_and_ignores_releases(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=500)
    s = train(s, 10, batch=B)
    want = records(s)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    dsa_core.prefetch(r, np.arange(N), wait=True)
    dsa_core.load_range(r, 0, N, wait=True)
    dsa_core.release_range(r, 0, N, wait=True)
    dsa_core.wait_ranges(r)
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)
    with pytest.raises(ValueError, match="closed"):
        dsa_core.wait_ranges(r)


@pytest.mark.parametrize("bad", [1.0, 0.5, float("nan"), "2", True])
def test_space_ratio_is_checked_before_anything_is_written(tmp_path, bad):
    a = dsa_core.create(tmp_path / "s", N, D)  # an in-place store that overwrite would replace
    dsa_core.close(a)
    before = sorted(os.listdir(tmp_path / "s"))
    with pytest.raises(ValueError, match="space_ratio must be a finite number > 1"):
        dsa_core.create(tmp_path / "s", N, D, storage="log", space_ratio=bad, overwrite=True)
    assert sorted(os.listdir(tmp_path / "s")) == before
    with pytest.raises(ValueError, match="space_ratio= bounds the segment files"):
        dsa_core.create(tmp_path / "t", N, D, storage="inplace", space_ratio=2.0)


def test_space_ratio_is_stored_and_bounds_the_segments(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=2 * B, space_ratio=1.5)
    for idx, g in batches(150, N, D, batch=B):
        s = dsa_core.step(s, idx, g)
        st = s.store.log_stats()
        # after every step, within the slack the store may run above space_ratio
        assert st["segment_records"] <= 1.5 * st["live_records"] + st["clean_slack_records"]
        assert st["clean_slack_records"] == 4 * st["seal_unit"]
    assert st["space_ratio"] == 1.5 and st["cleaned_segments"] > 0
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    assert r.store.space_ratio == 1.5
    dsa_core.close(r)


def test_create_writes_nothing_of_the_table_size(tmp_path):
    """create is O(1): no index file until a row is written; rows read as their init."""
    n = 5_000_000
    s = dsa_core.create(tmp_path / "big", n, D, init="normal", seed=3, storage="log",
                        memory="84MiB")  # 80 MB: the index and a flush's copy of it
    assert sorted(os.listdir(tmp_path / "big")) == ["manifest.json", "writer.lock"]
    rows = np.array([0, 17, n - 1])
    first = dsa_core.gather(s, rows)
    assert first.std() > 0
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "big", memory="84MiB")
    np.testing.assert_array_equal(dsa_core.gather(s, rows), first)  # deterministic
    s = dsa_core.step(s, [17], np.ones((1, D), np.float32))
    dsa_core.close(s)
    names = os.listdir(tmp_path / "big")
    # the one changed row's record is in its segment, which the manifest says an open
    # applies over the (absent) index base: still nothing of the table's size on disk
    assert sum(x.startswith("index-") for x in names) == 0
    assert sum(x.startswith("seg-") for x in names) == 1
    r = dsa_core.open(tmp_path / "big", mode="r")
    got = dsa_core.gather(r, rows)
    np.testing.assert_array_equal(got[[0, 2]], first[[0, 2]])
    assert not np.array_equal(got[1], first[1])
    dsa_core.close(r)


def test_cleaning_reads_ahead_with_the_records_of_a_mapped_run(tmp_path, monkeypatch):
    """Cleaning copies the live records read ahead by a thread; the records are
    bit-identical to a run that reads nothing ahead (every victim copied through its
    mapping, at a wait past the slack)."""
    plan = batches(150, N, D, batch=B)
    runs = []
    for name, whole in (("mapped", 0), ("read", _log_read.WHOLE_MAX)):
        with monkeypatch.context() as m:
            m.setattr(_log_read, "WHOLE_MAX", whole)
            s = create(tmp_path / name, N, D, **LOG, slots=2 * B, space_ratio=1.3)
            s = train(s, plan)
            st = s.store.log_stats()
            assert st["cleaned_segments"] > 0
            assert s.store.check_index() == []
            runs.append((s, records(s), st))
    mapped, read = runs[0][2], runs[1][2]
    assert mapped["clean_read_bytes"] == 0 and mapped["clean_waits"] > 0  # nothing read
    assert read["clean_read_bytes"] > 0 and read["clean_read_requests"] > 0
    np.testing.assert_array_equal(runs[0][1].view(np.uint8), runs[1][1].view(np.uint8))
    for s, _, _ in runs:
        dsa_core.close(s)
    a = dsa_core.open(tmp_path / "mapped", mode="r")
    b = dsa_core.open(tmp_path / "read", mode="r")
    np.testing.assert_array_equal(records(a), records(b))
    dsa_core.close(a)
    dsa_core.close(b)


def test_read_plan_coalesces_and_bounds_requests():
    ks = np.array([0, 1, 2, 5, 40, 41], np.int64)
    plan = _log_read.read_plan(ks, 100, gap=300, chunk=200)  # gaps < 300 bytes read through
    assert plan == [(0, 2, 0, 2), (2, 4, 2, 3), (4, 6, 3, 4), (40, 42, 4, 6)]
    assert _log_read.read_plan(ks, 100, gap=0) == [(0, 3, 0, 3), (5, 6, 3, 4),
                                                    (40, 42, 4, 6)]
    assert _log_read.read_plan(ks, 100) == [(0, 42, 0, 6)]  # one span, no limit
    assert _log_read.read_plan(ks[:0], 100) == []
    # every wanted record is in exactly one request, and no request exceeds the chunk
    rng = np.random.default_rng(3)
    for _ in range(50):
        ks = np.unique(rng.integers(0, 5000, int(rng.integers(1, 400))))
        gap, chunk = int(rng.integers(0, 20000)), int(rng.integers(1, 50000))
        plan = _log_read.read_plan(ks, 96, gap, chunk)
        got = np.concatenate([ks[i0:i1] for _, _, i0, i1 in plan])
        np.testing.assert_array_equal(got, ks)
        for k0, k1, i0, i1 in plan:
            assert (k1 - k0) * 96 <= max(chunk, 96) and k0 <= ks[i0] and ks[i1 - 1] < k1


def test_cleaning_reads_buffers_failures_and_bounds(tmp_path):
    recs = (np.arange(64 * 6, dtype=np.float32).reshape(64, 6) % 251)
    f = tmp_path / "seg"
    f.write_bytes(b"h" * 100 + recs.tobytes())
    out = np.empty((3, 6), np.float32)
    np.testing.assert_array_equal(_log_read.read_file_into(f, 100, out), recs[:3])
    with pytest.raises(OSError, match="bytes short"):  # a truncated file is an error
        _log_read.read_file_into(f, 101 + recs.nbytes, out)
    r = _log_read.CleaningReads(held_bytes=40 * 32, chunk=5 * 24, gap=2 * 24)
    try:
        ks = np.array([0, 1, 2, 7, 30, 31, 33, 63], np.int64)
        assert r.get(1) is None  # none started
        assert r.ahead(1, f, 100, ks, 6, np.float32)
        r.join()
        assert r.ready(1) and r.held == ks.shape[0] * (24 + 8)  # records and their numbers
        buf, ks0 = r.get(1)  # from the read ahead
        np.testing.assert_array_equal(buf, recs[ks])
        assert ks0 is ks
        plan = _log_read.read_plan(ks, 24, 2 * 24, 5 * 24)
        assert r.requests == len(plan)  # one request per piece, each at most 5 records
        assert r.bytes_read == sum((k1 - k0) * 24 for k0, k1, _, _ in plan)
        r.release(1)
        assert r.held == 0 and not r.has(1)
        again = r.now(1, f, 100, ks[:2], 6, np.float32)  # read on this thread, held
        np.testing.assert_array_equal(again, recs[:2])
        assert r.ready(1) and r.held == 2 * 32
        r.release(1)
        many = np.arange(30, dtype=np.int64)
        assert r.ahead(2, f, 100, many, 6, np.float32)
        assert not r.ahead(3, f, 100, many[:11], 6, np.float32)  # past held_bytes: refused
        assert r.now(3, f, 100, many[:11], 6, np.float32) is None
        assert r.ahead(3, f, 100, many[:10], 6, np.float32) and r.held == 40 * 32
        r.forget(2)
        r.join()
        assert r.room(30 * 32) and r.held == 10 * 32 and not r.has(2)
        gone = tmp_path / "gone"
        gone.write_bytes(f.read_bytes())
        r.ahead(5, gone, 100, ks, 6, np.float32)
        r.join()  # read before the file went: still its records
        os.unlink(gone)
        np.testing.assert_array_equal(r.get(5)[0], recs[ks])
        with pytest.raises(FileNotFoundError):  # a failed read is not hidden
            r.now(6, gone, 100, ks, 6, np.float32)
        assert not r.has(6)
    finally:
        r.close()

def test_cleaning_reads_are_paced_off_the_disk(tmp_path, monkeypatch):
    """The reading thread rests ``t * (1 - CLEAN_DUTY) / CLEAN_DUTY`` after a request that
    took ``t`` (out of core, unpaced cleaning reads ran back to back after each seal and
    the steps' reads waited twice as long): the records are the same, a read on the
    caller's thread (``now``: a seal that must not wait) is not paced, and ``close`` ends
    a rest at once. The disk is a 20 ms sleep per request here, so the bounds hold on a
    loaded machine too (a slower request only lengthens the rest after it)."""
    import time

    recs = (np.arange(64 * 6, dtype=np.float32).reshape(64, 6) % 251)
    f = tmp_path / "seg"
    f.write_bytes(b"h" * 100 + recs.tobytes())
    real = _log_read._pread_full

    def slow(*a):
        time.sleep(0.02)
        real(*a)

    monkeypatch.setattr(_log_read, "_pread_full", slow)
    ks = np.arange(0, 64, 2, dtype=np.int64)  # 32 records, in requests of 8 records
    for duty, rests in ((1.0, 0), (0.5, 3)):
        monkeypatch.setattr(_log_read, "CLEAN_DUTY", duty)
        r = _log_read.CleaningReads(held_bytes=64 * 32, chunk=16 * 24, gap=24)
        try:
            t0 = time.perf_counter()
            assert r.ahead(1, f, 100, ks, 6, np.float32)
            r.join()
            wall = time.perf_counter() - t0
            assert r.requests == 4
            np.testing.assert_array_equal(r.get(1)[0], recs[ks])
            if not rests:
                assert r.rested == 0.0
            else:  # a rest of at least one request's time before each request but the first
                assert r.rested >= rests * 0.02 * 0.95 and wall >= 4 * 0.02 + rests * 0.019
            rested = r.rested
            np.testing.assert_array_equal(r.now(2, f, 100, ks, 6, np.float32), recs[ks])
            assert r.rested == rested  # the caller's own read is not paced
        finally:
            r.close()
    monkeypatch.setattr(_log_read, "CLEAN_DUTY", 0.01)  # a rest of 99 requests' time (~2 s)
    # ends the rests: the next seal (hurry_all), a seal waiting for a read queued behind
    # another (get), close
    for end in ("hurry_all", "get", "close"):
        r = _log_read.CleaningReads(held_bytes=64 * 32, chunk=16 * 24, gap=24)
        try:
            assert r.ahead(1, f, 100, ks, 6, np.float32)
            assert r.ahead(2, f, 100, ks[:8], 6, np.float32)  # queued behind the first
            time.sleep(0.1)  # the first request done, resting before the second
            t0 = time.perf_counter()
            if end == "hurry_all":
                r.hurry_all()
                r.join()
            elif end == "get":
                np.testing.assert_array_equal(r.get(2)[0], recs[ks[:8]])
            else:
                r.close()
            assert time.perf_counter() - t0 < 1.0, end
        finally:
            r.close()


def test_a_fault_on_a_segment_reads_its_own_page_only(tmp_path):
    """The whole segment file is mapped MADV_RANDOM -- its rows and sums as well as its
    records: a fault on one record's sum must not read around it (with the device's
    read-ahead, up to several MiB of the file per fault; out of core on an aged store those
    reads thrashed the page cache, 2.6 reads per updated row instead of ~1)."""
    from dsa_core._log import format as _format
    from dsa_core._os import PAGE, mincore_addr

    n_rows = 40_000  # a segment of several MiB: room for read-around to show
    s = dsa_core.create(tmp_path / "log", n_rows, D, storage="log")
    s = dsa_core.step(s, np.arange(n_rows), np.ones((n_rows, D), np.float32))
    dsa_core.close(s)
    segs = sorted(p for p in (tmp_path / "log").iterdir() if p.name.startswith("seg-"))
    path = max(segs, key=lambda p: p.stat().st_size)
    size = path.stat().st_size
    gc.collect()
    _evict_segments(tmp_path / "log")
    rec = 3 * D * 4
    n = next(m for m in range(1, n_rows + 1)
             if _format.segment_geometry(m, 3 * D, 4)[3] == size)
    seg = _format.map_segment(path, 1, n, 3 * D, np.dtype(np.float32))
    base = np.asarray(seg.records).__array_interface__["data"][0] - \
        _format.segment_geometry(n, 3 * D, 4)[2]
    pages = -(-size // PAGE)
    vec = np.zeros(pages, np.uint8)

    def resident():
        assert mincore_addr(base, pages * PAGE, vec.ctypes.data) == 0
        return int((vec & 1).sum())

    if resident():
        pytest.skip("this filesystem keeps the pages cached (tmpfs?): nothing is read")
    assert n * rec > 64 * PAGE
    _ = int(seg.steps[n // 2]), int(seg.rows[n // 3])  # two faults, away from the records
    _ = float(seg.records[n // 2, 0])
    assert resident() <= 3 * 2  # each fault its own page (and a neighbour at most)
    del seg
    gc.collect()


def test_background_read_ahead_waits_for_the_foreground_reads(monkeypatch):
    """Reads a caller waits for go first (read's docstring): a background hint issues its
    requests in chunks, none while a foreground read runs, and is never held past
    ``HINT_WAIT`` per chunk."""
    import threading
    import time

    calls = []
    monkeypatch.setattr(_log_read, "_advise_spans", lambda lo, hi, advice: calls.append(
        lo.shape[0]) or lo.shape[0])
    monkeypatch.setattr(_log_read, "HINT_CHUNK", 4)
    fg = _log_read.Foreground()
    addrs = np.arange(10, dtype=np.int64) * 8192  # ten records two pages apart: ten spans
    done = []
    with fg:
        assert fg.busy
        t = threading.Thread(target=lambda: done.append(
            _log_read.advise(addrs, 100, yield_to=fg)))
        t.start()
        time.sleep(0.3)
        assert not calls and t.is_alive()  # held while the foreground read runs
    t.join(5)
    assert not fg.busy and calls == [4, 4, 2] and done == [10]
    # unhinted calls (a foreground read's own) never wait
    calls.clear()
    with fg:
        assert _log_read.advise(addrs, 100) == 10 and calls == [10]
    # a foreground read that never ends delays each chunk by HINT_WAIT at most
    monkeypatch.setattr(_log_read, "HINT_WAIT", 0.05)
    calls.clear()
    with fg:
        t0 = time.perf_counter()
        assert _log_read.advise(addrs, 100, yield_to=fg) == 10
        assert time.perf_counter() - t0 < 2.0 and calls == [4, 4, 2]


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "on-disk"])
@pytest.mark.parametrize("what", ["gather", "step"])
def test_the_engine_reads_its_misses_as_foreground_reads(tmp_path, monkeypatch, what, cold):
    """``Segments.read_into`` (a gather's and a step's misses): a read whose sampled records
    are cached holds ``FOREGROUND`` while it copies and queues no reads; one that finds them
    on the disk queues the reads of its records and their sums and holds nothing (read's
    docstring); only while it runs, and the values are the same."""
    from dsa_core._log import segments as _segments

    s = create(tmp_path / "log", N, D, **LOG, slots=500)
    s = train(s, 40, batch=B)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    want = records(r)
    dsa_core.close(r)
    s = dsa_core.open(tmp_path / "log", memory=log_memory(s.layout, 500))
    copies, hints = [], []
    real_copy, real_advise = _segments.run_chunked, _log_read.advise
    monkeypatch.setattr(_segments, "cold", lambda *a, **k: cold)
    monkeypatch.setattr(_segments, "run_chunked", lambda *a, **k: (
        copies.append(_log_read.FOREGROUND.busy), real_copy(*a, **k))[1])
    monkeypatch.setattr(_log_read, "advise", lambda a, nbytes, *r, **k: (
        hints.append((nbytes, a.shape[0], _log_read.FOREGROUND.busy)),
        real_advise(a, nbytes, *r, **k))[1])
    rows = np.arange(0, N, 11)
    if what == "gather":
        np.testing.assert_array_equal(dsa_core.gather(s, rows), want[rows, :D])
    else:
        s = dsa_core.step(s, rows[:200], np.zeros((200, D), np.float32))
    assert copies and all(busy == (not cold) for busy in copies)
    if cold:  # the records' reads, then their sums' (those in the file: maybe none), not held
        assert hints[0][0] > 8 and hints[0][1] > 0 and hints[1][0] == 8
        assert not any(busy for _, _, busy in hints)
    else:
        assert not hints
    assert not _log_read.FOREGROUND.busy
    dsa_core.close(s)
