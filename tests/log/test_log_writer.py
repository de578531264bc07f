"""Seals written in the background (dsa_core._log.writer): never a stale read, never a loss.

The writer is slowed down so that many segments are still being written while the steps
read their rows back (misses), the cleaner copies them and drops them; the records must be
exactly those of the same run with every seal written synchronously.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import dsa_core
from helpers import batches, create, log_memory, records, train
from dsa_core import _log
from dsa_core._log import format as _log_format
from dsa_core._log import writer as _log_writer

N, D, B = 2000, 8, 64


# the stores (helpers.create): a region of 3 * B records, the weights one fixed draw
INIT = (np.random.default_rng(0).standard_normal((N, D)) * 0.1).astype(np.float32)
INIT.flags.writeable = False  # one array for every store: none may change it
LOG = {"kind": "log", "slots": 3 * B, "init": INIT}
# the steps (helpers.train, batch=B, rows=HOT): ids from a hot set a third larger than the
# region, so its rows leave and come back all the time and young segments die (all their
# records rewritten) within a few seals
HOT = np.arange(4 * B)


def _reference(tmp_path, monkeypatch):
    """The same run with every seal written at once, in the seal (no writer thread)."""
    with monkeypatch.context() as m:
        m.setattr(_log.commit, "BEHIND_BYTES", 0)
        s = train(create(tmp_path / "sync", N, D, **LOG, space_ratio=1.05), 150, batch=B, rows=HOT)
        assert s.store._segments.writer is None
        want = records(s)
        dsa_core.close(s)
    return want


def test_slow_background_writes_read_clean_and_drop_pending_segments(tmp_path, monkeypatch):
    want = _reference(tmp_path, monkeypatch)
    seen = {"pending_reads": 0, "pending_dropped": 0}
    real_write = _log_writer.write_segment

    def slow_write(*a, **kw):
        time.sleep(0.02)  # the writer lags behind the steps
        return real_write(*a, **kw)

    real_read = _log.segments.Segments.read_into

    def counting_read(self, locs, *a, **kw):
        sids = set(((locs - 1) >> 32).tolist())
        seen["pending_reads"] += len(sids & set(self.pending))
        return real_read(self, locs, *a, **kw)

    real_drop = _log.segments.Segments.drop

    def counting_drop(self, ids):
        seen["pending_dropped"] += len(set(ids) & set(self.pending))
        return real_drop(self, ids)

    monkeypatch.setattr(_log_writer, "write_segment", slow_write)
    monkeypatch.setattr(_log_writer, "DEPTH", 8)  # more segments pending at once
    monkeypatch.setattr(_log.segments, "WRITE_BUFFERS", 8)  # (more buffers than the budget's)
    monkeypatch.setattr(_log.segments.Segments, "read_into", counting_read)
    monkeypatch.setattr(_log.segments.Segments, "drop", counting_drop)
    s = train(create(tmp_path / "behind", N, D, **LOG, space_ratio=1.05), 150, batch=B,
              rows=HOT)
    eng = s.store
    assert eng._segments.writer is not None and eng.log_stats()["cleaned_segments"] > 0
    assert seen["pending_reads"] > 0 and seen["pending_dropped"] > 0  # the races happened
    assert eng.check_index() == []
    np.testing.assert_array_equal(records(s).view(np.uint8), want.view(np.uint8))
    dsa_core.close(s)
    assert not eng._segments.pending
    names = set(os.listdir(tmp_path / "behind"))
    m = _log_format.read_manifest(tmp_path / "behind")
    assert {n for n in names if n.startswith("seg-")} == {_log_format.seg_name(i)
                                                           for i in m["segments"]}
    r = dsa_core.open(tmp_path / "behind", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_a_failed_background_write_is_retried_and_a_second_failure_changes_nothing(
        tmp_path, monkeypatch):
    want = _reference(tmp_path, monkeypatch)
    real_write = _log_writer.write_segment
    # the next segment written behind (armed): its writes fail this many times. Not simply
    # the next segment: a seal with more records than a write buffer is written at once
    fail = {"sid": None, "left": 0, "armed": False}
    lock = threading.Lock()

    def flaky_write(path, sid, *a, **kw):
        with lock:
            if fail["armed"]:
                fail.update(sid=sid, armed=False)
            if sid == fail["sid"] and fail["left"]:
                fail["left"] -= 1
                raise OSError(28, "No space left on device")
        return real_write(path, sid, *a, **kw)

    monkeypatch.setattr(_log_writer, "write_segment", flaky_write)
    s = create(tmp_path / "flaky", N, D, **LOG, space_ratio=1.05)
    plan = batches(150, N, D, batch=B, rows=HOT)  # the reference's steps
    k, failures, arm = 0, 0, {40: 1, 90: 2}
    while k < len(plan):
        if k in arm:  # once: the retry succeeds; twice (background, retry): it raises
            fail.update(sid=None, armed=True, left=arm.pop(k))  # armed once, not per retry
        before = s.count
        try:
            s = dsa_core.step(s, *plan[k])
        except OSError as exc:
            assert "the next seal or flush tries again" in str(exc)
            failures += 1
            assert s.current and s.count == before  # nothing of the step happened
            continue  # the same batch again: the store must end as the reference
        k += 1
    assert failures == 1 and fail["left"] == 0
    assert s.store.check_index() == []
    np.testing.assert_array_equal(records(s).view(np.uint8), want.view(np.uint8))
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "flaky", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_kill_during_a_background_write_reopens_at_the_last_flush(tmp_path):
    s = train(create(tmp_path / "k", N, D, **LOG, space_ratio=1.05), 30, batch=B, rows=HOT)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "k", mode="r")
    want = records(r)
    dsa_core.close(r)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            _log_format.set_crash("seal-chunk", 3)  # the third record block written...
            s2 = dsa_core.open(tmp_path / "k", memory=log_memory(
                {"num_rows": N, "stride": 3 * D, "dtype": "float32"}, 3 * B))
            train(s2, 100, batch=B, rows=HOT, seed=5)  # ...by the writer thread, which kills us
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status)
    r = dsa_core.open(tmp_path / "k", memory="1MiB")  # the writer: removes the garbage
    assert r.count == 30
    np.testing.assert_array_equal(records(r), want)
    assert r.store.check_index() == []
    dsa_core.close(r)


def test_the_writer_keeps_a_window_of_recent_segments_cached(tmp_path, monkeypatch):
    """Written segments stay in the page cache up to ``cache_bytes``, newest first; the
    oldest beyond it are dropped (an engine's window: ``CACHE_SHARE`` of its memory)."""
    dropped = []
    monkeypatch.setattr(_log_writer, "_drop_cached", dropped.append)
    rec = np.ones((64, 3 * D), np.float32)
    size = _log_format.segment_geometry(64, 3 * D, 4)[3]
    w = _log_writer.SegmentWriter(cache_bytes=int(2.5 * size))
    paths = [tmp_path / _log_format.seg_name(i) for i in range(1, 6)]
    jobs = [w.submit(_log_writer.WriteJob(p, i, np.arange(64), np.zeros(64, np.int64), rec, 1))
            for i, p in enumerate(paths, 1)]
    w.close()
    assert all(j.error is None and j.size == size for j in jobs)
    assert dropped == paths[:3]  # the newest two (2 x size <= 2.5 x size) stay cached
    s = create(tmp_path / "eng", N, D, **LOG)
    s = train(s, 20, batch=B, rows=HOT)
    eng = s.store
    assert eng._segments.writer is not None
    segs = _log.segments
    # the share alone (no smaller cap): rows that leave the region are read back from memory
    assert segs.CACHE_MAX is None
    assert eng._segments.writer.cache_bytes == int(segs.CACHE_SHARE * segs.memory_limit())
    assert segs.cache_window() == eng._segments.writer.cache_bytes
    dsa_core.close(s)


def _segment_args(n=100, seed=3):
    """Row ids, steps, records and stride of an ``n``-record segment."""
    rng = np.random.default_rng(seed)
    stride = 3 * D
    rows, steps = rng.permutation(N)[:n].astype(np.int64), np.full(n, 7, np.int64)
    return rows, steps, rng.standard_normal((n, stride)).astype(np.float32), stride


def _spare(path, n=100):
    """A dead segment file of ``n`` records at ``path`` (other rows and records than
    ``_segment_args()``'s), to be written over."""
    rows, steps, recs, stride = _segment_args(n, seed=9)
    _log_format.write_segment(path, 2, rows, steps, [recs], stride, np.dtype(np.float32), 3)
    return path


def test_a_segment_is_written_back_a_block_at_a_time(tmp_path, monkeypatch):
    """The background writer puts a segment's records on the disk ``PACE_BYTES`` at a time,
    each block written back before the next is written (the steps' reads queue behind one
    block of writes at most, not a whole segment's): the blocks cover the records in order,
    none larger than the pace, and the file is byte for byte the one written at once."""
    waits = []
    real = _log_format.write_back

    def write_back(fd, offset=0, nbytes=0, path=None):
        waits.append((offset, nbytes))
        return real(fd, offset, nbytes, path)

    monkeypatch.setattr(_log_format, "write_back", write_back)
    monkeypatch.setattr(_log_writer, "PACE_BYTES", 4096)
    rows, steps, recs, stride = _segment_args()
    n = rows.shape[0]
    # a seal's buffer: each record followed by room for its sums, as in the file
    raw = _log_format.laid_out(recs, stride, np.dtype(np.float32))
    pitch = raw.shape[1]
    job = _log_writer.WriteJob(tmp_path / "paced.dsl", 5, rows, steps, raw, 7, None, 0,
                               stride, np.float32)
    job.run()
    assert job.error is None
    rec_off = _log_format.segment_geometry(n, stride, 4)[2]
    per = 4096 // pitch
    assert [w[0] for w in waits] == [rec_off + lo * pitch for lo in range(0, n, per)]
    assert all(0 < w[1] <= 4096 for w in waits) and sum(w[1] for w in waits) == n * pitch
    _log_format.write_segment(tmp_path / "once.dsl", 5, rows, steps, [recs], stride,
                              np.dtype(np.float32), 7)
    assert (tmp_path / "paced.dsl").read_bytes() == (tmp_path / "once.dsl").read_bytes()


@pytest.mark.parametrize("old_n", [40, 100, 160])  # the spare smaller, as large, larger
def test_a_segment_written_over_a_spare_is_the_segment_written_fresh(tmp_path, old_n):
    """A seal written over a dead segment's file (renamed, overwritten in place, grown or
    cut to size) keeps that file's inode and is byte for byte the file written fresh; the
    spare's name is gone."""
    f32 = np.dtype(np.float32)
    inode = os.stat(_spare(tmp_path / "old.dsl", old_n)).st_ino
    rows, steps, recs, stride = _segment_args()
    job = _log_writer.WriteJob(tmp_path / "new.dsl", 5, rows, steps, recs, 7,
                               recycle=tmp_path / "old.dsl")
    job.run()
    assert job.error is None and job.recycle is None
    assert not (tmp_path / "old.dsl").exists()
    assert os.stat(tmp_path / "new.dsl").st_ino == inode
    _log_format.write_segment(tmp_path / "fresh.dsl", 5, rows, steps, [recs], stride, f32, 7)
    assert (tmp_path / "new.dsl").read_bytes() == (tmp_path / "fresh.dsl").read_bytes()
    seg = _log_format.map_segment(tmp_path / "new.dsl", 5, 100, stride, f32)
    np.testing.assert_array_equal(seg.records, recs)


def test_a_spare_linked_elsewhere_is_never_overwritten(tmp_path):
    """A spare that has a second name (a hard link, as a checkpoint makes) is passed over:
    the seal goes to a new file and the linked bytes stay as they were."""
    f32 = np.dtype(np.float32)
    os.link(_spare(tmp_path / "old.dsl"), tmp_path / "kept.dsl")
    kept = (tmp_path / "kept.dsl").read_bytes()
    rows, steps, recs, stride = _segment_args()
    _log_format.write_segment(tmp_path / "new.dsl", 5, rows, steps, [recs], stride, f32, 7,
                              recycle=tmp_path / "old.dsl")
    assert (tmp_path / "kept.dsl").read_bytes() == kept
    assert os.stat(tmp_path / "new.dsl").st_ino != os.stat(tmp_path / "kept.dsl").st_ino
    seg = _log_format.map_segment(tmp_path / "new.dsl", 5, 100, stride, f32)
    np.testing.assert_array_equal(seg.records, recs)


def test_a_full_disk_while_overwriting_a_spare_leaves_no_file(tmp_path, monkeypatch):
    """ENOSPC in the middle of a seal written over a spare: the error is the job's, the
    half-overwritten file is removed under both names, and the retry writes a new file."""
    _spare(tmp_path / "old.dsl")
    real, calls = _log_format.pwrite_all, []

    def pwrite_all(fd, buf, off):
        calls.append(off)
        if len(calls) == 3:  # the header zeroed, the row ids written, then the disk is full
            raise OSError(28, "No space left on device (injected)")
        return real(fd, buf, off)

    monkeypatch.setattr(_log_format, "pwrite_all", pwrite_all)
    rows, steps, recs, stride = _segment_args()
    job = _log_writer.WriteJob(tmp_path / "new.dsl", 5, rows, steps, recs, 7,
                               recycle=tmp_path / "old.dsl")
    job.run()
    assert isinstance(job.error, OSError) and job.error.errno == 28
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    job.run()  # the engine's retry, with room again
    assert job.error is None
    seg = _log_format.map_segment(tmp_path / "new.dsl", 5, 100, stride, np.dtype(np.float32))
    np.testing.assert_array_equal(seg.records, recs)


def test_a_failed_flush_leaves_no_segment_write_running(tmp_path, monkeypatch):
    """A full disk met by a flush while a seal is being written behind: the error reaches
    the caller only once no background segment write is running (``Segments.quiesce``). The
    writer thread removes the file of a write that fails, so a caller that copies the
    directory after the error (a backup, or a test's look at what a kill -9 would leave:
    ``test_full_disk_at_a_flush`` met a segment vanishing mid-copy 3 times in 24) must see
    a still one."""
    from helpers import os_fault

    real_run = _log_writer.WriteJob.run

    def slow_run(self, drop=True):  # the writer thread's attempts end after the caller's
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)
        return real_run(self, drop)

    s = create(tmp_path / "s", N, D, **LOG)
    s = train(s, 40, batch=B, rows=HOT)
    segs = s.store._segments
    monkeypatch.setattr(_log_writer.WriteJob, "run", slow_run)
    rng = np.random.default_rng(5)

    def new_rows(s):  # rows the region does not hold: evictions, seals written behind
        idx = rng.choice(s.num_rows, B, replace=False)
        return dsa_core.step(s, idx, np.ones((B, s.dim), np.float32))

    while not any(not job.done.is_set() for job in segs.pending.values()):
        s = new_rows(s)  # until a write is running in the writer thread
    with os_fault("pwrite_all", 1) as f:
        with pytest.raises(OSError):
            dsa_core.flush(s)
        assert f.failed
        running = [sid for sid, job in segs.pending.items() if not job.done.is_set()]
        assert not running, f"segment writes still running after the error: {running}"
    dsa_core.close(s)
