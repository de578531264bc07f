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
from helpers import log_memory, records
from dsa_core import _log
from dsa_core._log import read as _log_read

N, D = 3000, 8
B = 64


def _create(path, slots, **kw):
    layout = {"num_rows": N, "stride": 3 * D, "dtype": "float32"}
    init = (np.random.default_rng(0).standard_normal((N, D)) * 0.1).astype(np.float32)
    return dsa_core.create(path, N, D, init=init, storage="log",
                           memory=log_memory(layout, slots), **kw)


def _batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, N, B), rng.standard_normal((B, D)).astype(np.float32))
            for _ in range(steps)]


def _evict_segments(path):
    """Drop the (clean, flushed) segment pages from the page cache."""
    for name in os.listdir(path):
        if name.startswith("seg-"):
            fd = os.open(os.path.join(path, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def test_readahead_reads_uncached_records_and_changes_nothing(tmp_path):
    s = _create(tmp_path / "log", slots=500)
    for idx, g in _batches(40):
        s = dsa_core.step(s, idx, g)
    dsa_core.close(s)  # flushed: every record is in a segment, none resident after reopen
    r = dsa_core.open(tmp_path / "log", mode="r")
    want = records(r)
    dsa_core.close(r)
    del r
    gc.collect()  # unmap the reader's segments: the kernel keeps pages that are mapped
    s = dsa_core.open(tmp_path / "log", memory=log_memory(s.layout, 500))
    rows = np.arange(0, N, 7)
    addrs, keep = s.store.engine.readahead(rows)
    assert addrs.shape[0] == rows.shape[0] and keep  # all on disk, none resident
    _evict_segments(tmp_path / "log")
    if not _log_read.sample_uncached(addrs, s.store.engine.rec_bytes):
        pytest.skip("this filesystem keeps the pages cached (tmpfs?): nothing to read ahead")
    dsa_core.prefetch(s, rows, wait=True)
    ra = s.store._readahead
    assert ra.tasks == 1 and ra.calls > 0  # the hints were issued
    # the engine's own reads hint too: gather of evicted rows, then a step that misses
    _evict_segments(tmp_path / "log")
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


@pytest.mark.parametrize("space_ratio", [1.3, 2.0])
def test_prefetch_and_releases_racing_steps_give_identical_records(tmp_path, space_ratio):
    """Read-ahead of future batches (a background thread) and range releases between steps,
    with a small region and a tight space bound (seals and cleaning all the time): the
    records are exactly those of the same run without any hint."""
    batches = _batches(120)
    runs = []
    for name, hints in (("plain", False), ("hinted", True)):
        s = _create(tmp_path / name, slots=2 * B, space_ratio=space_ratio)
        feed = dsa_core.prefetched(s, batches, ahead=3) if hints else batches
        for k, (idx, g) in enumerate(feed):
            s = dsa_core.step(s, idx, g)
            if hints and k % 7 == 0:
                lo = (k * 97) % N
                dsa_core.release_range(s, lo, min(N, lo + 500))
                dsa_core.load_range(s, (lo + 500) % N, min(N, (lo + 500) % N + 300))
        dsa_core.wait_ranges(s)
        assert s.store.engine.verify() == []
        runs.append(s)
    assert runs[1].store.engine.stats()["cleaned_segments"] > 0  # cleaning did run
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
    s = _create(tmp_path / "log", slots=1000)
    rows = np.random.default_rng(2).permutation(np.arange(100, 400))
    s = dsa_core.step(s, rows, np.ones((rows.shape[0], D), np.float32))
    s = dsa_core.step(s, [5, 6], np.ones((2, D), np.float32))
    dsa_core.flush(s)
    s = dsa_core.step(s, rows, np.ones((rows.shape[0], D), np.float32))  # dirty again
    want = records(s)
    eng = s.store.engine
    used = eng.stats()["slots_used"]
    resident = int((eng.loc[:450] < 0).sum())
    assert resident >= 302  # the 300 dirty rows and the clean 5, 6
    dsa_core.release_range(s, 0, 450)
    assert eng.stats()["slots_used"] == used - resident
    assert dsa_core.residency(s, np.arange(0, 450)) == 0.0
    loc = eng.loc[100:400]
    segs = ((loc - 1) >> 32).tolist()
    # the rows in row order, in consecutive segments of a seal unit each
    assert (loc > 0).all() and (np.diff(loc) > 0).all()
    assert len(set(segs)) == -(-300 // eng.seal_unit) and sorted(set(segs)) == list(
        range(segs[0], segs[0] + len(set(segs))))
    np.testing.assert_array_equal(records(s), want)
    assert eng.verify() == []
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_read_only_store_prefetches_and_ignores_releases(tmp_path):
    s = _create(tmp_path / "log", slots=500)
    for idx, g in _batches(10):
        s = dsa_core.step(s, idx, g)
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
    s = _create(tmp_path / "log", slots=2 * B, space_ratio=1.5)
    for idx, g in _batches(150):
        s = dsa_core.step(s, idx, g)
        st = s.store.engine.stats()
        assert st["segment_records"] <= 1.5 * st["live_records"]  # after every step
    assert st["space_ratio"] == 1.5 and st["cleaned_segments"] > 0
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    assert r.store.engine.space_ratio == 1.5
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
    assert sum(x.startswith("index-") for x in names) == 1  # the first flush that wrote a row
    r = dsa_core.open(tmp_path / "big", mode="r")
    got = dsa_core.gather(r, rows)
    np.testing.assert_array_equal(got[[0, 2]], first[[0, 2]])
    assert not np.array_equal(got[1], first[1])
    dsa_core.close(r)


def test_cleaning_reads_segments_whole_ahead_with_the_records_of_a_mapped_run(tmp_path,
                                                                              monkeypatch):
    """Cleaning copies from whole-segment reads (read ahead one seal earlier by a thread);
    the records are bit-identical to a run that copies through the mappings."""
    batches = _batches(150)
    served = {"ahead": 0, "now": 0}
    real = _log_read.CleaningReads.records

    def counted(self, sid, *a):
        served["ahead" if sid in self._ahead else "now"] += 1
        return real(self, sid, *a)

    runs = []
    for name, whole in (("mapped", 0), ("whole", _log_read.WHOLE_MAX)):
        with monkeypatch.context() as m:
            m.setattr(_log.cleaner, "WHOLE_MAX", whole)
            m.setattr(_log_read.CleaningReads, "records", counted)
            s = _create(tmp_path / name, slots=2 * B, space_ratio=1.3)
            for idx, g in batches:
                s = dsa_core.step(s, idx, g)
            assert s.store.engine.stats()["cleaned_segments"] > 0
            assert s.store.engine.verify() == []
            runs.append((s, records(s)))
        if name == "mapped":
            assert served == {"ahead": 0, "now": 0}  # never read whole
    assert served["ahead"] > 0  # most cleaned segments were read a seal ahead
    np.testing.assert_array_equal(runs[0][1].view(np.uint8), runs[1][1].view(np.uint8))
    for s, _ in runs:
        dsa_core.close(s)
    a = dsa_core.open(tmp_path / "mapped", mode="r")
    b = dsa_core.open(tmp_path / "whole", mode="r")
    np.testing.assert_array_equal(records(a), records(b))
    dsa_core.close(a)
    dsa_core.close(b)


def test_cleaning_reads_buffers_failures_and_bounds(tmp_path):
    data = np.arange(4096 * 3, dtype=np.uint8).reshape(3, 4096) % 251
    f = tmp_path / "seg"
    f.write_bytes(b"h" * 100 + data.tobytes())
    out = np.empty_like(data)
    np.testing.assert_array_equal(_log_read.read_file_into(f, 100, out), data)
    with pytest.raises(OSError, match="bytes short"):  # a truncated file is an error
        _log_read.read_file_into(f, 101, np.empty_like(data))
    r = _log_read.CleaningReads(keep=2)
    try:
        r.ahead(1, f, 100, data.shape, np.uint8)
        got = r.records(1, f, 100, data.shape, np.uint8)  # from the read ahead
        np.testing.assert_array_equal(got, data)
        r.release(got)
        again = r.records(1, f, 100, data.shape, np.uint8)  # none ahead: read now
        np.testing.assert_array_equal(again, data)
        assert again.__array_interface__["data"][0] == got.__array_interface__["data"][0]
        for sid in (2, 3, 4):
            r.ahead(sid, f, 100, data.shape, np.uint8)
        assert list(r._ahead) == [3, 4]  # at most `keep` held, the oldest dropped
        r.forget(3)
        assert list(r._ahead) == [4]
        gone = tmp_path / "gone"
        gone.write_bytes(f.read_bytes())
        r.ahead(5, gone, 100, data.shape, np.uint8)
        r._ahead[5].result()  # read before the file went: still its records
        os.unlink(gone)
        np.testing.assert_array_equal(r.records(5, gone, 100, data.shape, np.uint8), data)
        with pytest.raises(FileNotFoundError):  # a failed read is not hidden
            r.records(6, gone, 100, data.shape, np.uint8)
    finally:
        r.close()
