"""Cleaning a log store off the step's path (dsa_core._log.cleaner): exact, bounded, counted.

A store aged to its space bound cleans at almost every seal. Its values must be bit-identical to
a numpy reference whether the victims' reads are done when the seal comes (the seal copies from
memory) or not (past the slack it waits, or reads now); after every seal the live segments
hold at most ``space_ratio x live + slack`` records; the waits are counted; kill -9 inside a
cleaning seal and a full disk during one leave the store exactly at its last flush.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
import time
import weakref
import zlib
from pathlib import Path

import numpy as np
import pytest

from dsa_core import _layout, _log
from dsa_core._log import budget
from dsa_core._log import cleaner as _cleaner
from dsa_core._log import commit as _commit
from dsa_core._log import format as _format
from dsa_core._log import read as _read
from dsa_core._log import segments as _segments

N, DIM, BATCH, SLOTS = 3000, 8, 100, 400


def _lay():
    return _layout.make_layout(N, DIM, np.float32, 0.0, True, 0)


def _update(rec: np.ndarray, t: int, rows: np.ndarray) -> np.ndarray:
    return rec * np.float32(0.5) + np.float32(t) + (rows % 7).astype(np.float32)[:, None]


def _rows(t: int, dist: str) -> np.ndarray:
    rng = np.random.default_rng([9, t])
    if dist == "uniform":
        rows = rng.integers(0, N, BATCH)
    else:
        p = 1.0 / (np.arange(N) + 1.0) ** 1.1
        rows = rng.choice(N, size=BATCH, p=p / p.sum())
    rows = np.unique(rows)
    return rows[rng.permutation(rows.shape[0])]


def _create(path, ratio=1.5, policy="greedy"):
    eng = _log.create(path, _lay(), memory_bytes=_log.memory_for(_lay(), SLOTS),
                      init="normal", init_scale=0.1, seed=3, space_ratio=ratio)
    eng._cleaner.policy = policy
    return eng


class _Bound:
    """Wraps an engine's seals: after each one the live segments must be within the bound,
    and a seal may have waited for cleaning only if it would have left them past the
    slack."""

    def __init__(self, eng):
        self.eng, self.seals, self.worst, self.waited = eng, 0, -10**9, 0
        real = eng._commit.seal
        choose = eng._cleaner.choose

        def checked_choose(n_seal, n_new_loc, ep):
            c = eng._cleaner
            before, waits = c.excess(n_seal, n_new_loc), c.stats["clean_waits"]
            out = choose(n_seal, n_new_loc, ep)
            if c.stats["clean_waits"] > waits:
                self.waited += 1
                assert before > c.slack, (before, c.slack)  # only past the slack
            return out

        eng._cleaner.choose = checked_choose

        def seal(*a, **k):
            real(*a, **k)
            self.seals += 1
            segs = eng._segments
            over = segs.total_records - eng._cleaner.bound()
            self.worst = max(self.worst, over)
            assert over <= 0, (segs.total_records, eng._cleaner.bound())

        eng._commit.seal = seal


def _train(eng, ref, t0, t1, dist, *, join=False, flush_every=0, check_every=0):
    everything = np.arange(N)
    for t in range(t0, t1):
        rows = _rows(t, dist)
        slots = eng.acquire(rows)
        eng._pool.region[slots] = _update(eng._pool.region[slots], t, rows)
        ref[rows] = _update(ref[rows], t, rows)
        eng._commit.count = t
        if join and eng._cleaner.reads is not None:
            eng._cleaner.reads.join()
        if check_every and t % check_every == 0:
            np.testing.assert_array_equal(eng.read(everything), ref, err_msg=f"step {t}")
        if flush_every and t % flush_every == 0:
            eng.flush()


def _never_ready(monkeypatch):
    """No victim is ever read when its seal comes: every cleaning goes past the slack."""
    monkeypatch.setattr(_cleaner.Cleaner, "ready", lambda self, sid: False)


def _slow_reads(monkeypatch, seconds=0.002):
    real = _read._pread_full

    def slow(*a):
        time.sleep(seconds)
        return real(*a)

    monkeypatch.setattr(_read, "_pread_full", slow)


# -- exactness, the bound, the waits -------------------------------------------------------------
@pytest.mark.parametrize("regime", ["ready", "slow", "never-ready", "no-room"])
@pytest.mark.parametrize("dist,policy", [("uniform", "greedy"), ("zipf", "cost-benefit")])
def test_cleaning_is_exact_and_bounded_whatever_the_reads(tmp_path, monkeypatch, regime, dist,
                                                          policy):
    if regime == "never-ready":
        _never_ready(monkeypatch)
    elif regime == "slow":
        _slow_reads(monkeypatch)
    elif regime == "no-room":  # no buffer: nothing read ahead, every victim via its mapping
        monkeypatch.setattr(_read, "CLEAN_HELD_BYTES", 0)
    eng = _create(tmp_path / "s", policy=policy)
    bound = _Bound(eng)
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 241, dist, join=regime == "ready", flush_every=60, check_every=20)
    st = eng.log_stats()
    assert st["cleaned_segments"] > 20 and bound.seals > 50, st  # at the bound, cleaning
    assert eng._cleaner.fallbacks == 0 and eng.check_index() == []
    if regime == "ready":  # every victim read ahead and done: no seal waited
        assert st["clean_waits"] == 0 and st["clean_wait_s"] == 0.0
        assert st["clean_read_bytes"] > 0
    assert bound.waited == st["clean_waits"]
    if regime in ("never-ready", "no-room"):  # every clean went past the slack and waited
        assert st["clean_waits"] > 10 and st["clean_wait_s"] > 0.0
        assert bound.worst > -st["clean_slack_records"]  # it did run into the slack
    if regime == "no-room":
        assert st["clean_read_bytes"] == 0
    assert st["total_clean_waits"] == st["clean_waits"]
    eng.close()
    eng = _log.open(tmp_path / "s", memory_bytes=_log.memory_for(_lay(), SLOTS))
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.log_stats()["total_clean_waits"] == st["clean_waits"]  # committed with the flush
    assert eng.log_stats()["clean_waits"] == 0  # this open's
    eng.close()


def test_files_on_disk_stay_within_the_bound(tmp_path, monkeypatch):
    """After every flush the segment files hold at most the bound's records (plus each
    file's header and padding), also when every clean waits."""
    _never_ready(monkeypatch)
    eng = _create(tmp_path / "s", ratio=1.3)
    ref = eng.read(np.arange(N))
    for t0 in range(1, 241, 20):
        _train(eng, ref, t0, t0 + 20, "uniform")
        eng.flush()
        st = eng.log_stats()
        files = sorted((tmp_path / "s").glob("seg-*.dsl"))
        on_disk = sum(f.stat().st_size for f in files)
        # no dead file left after the flush but the spares (reused by the next seals)
        assert on_disk == st["segment_bytes"] + st["spare_bytes"]
        # a header page, and at most a page of padding after each of rows, steps, records,
        # sums
        overhead = len(files) * 5 * 4096
        assert on_disk - st["spare_bytes"] <= st["space_bound_records"] * eng.rec_bytes \
            + overhead, st
        assert st["spare_segments"] <= _segments.SPARE_SEGMENTS
    assert st["cleaned_segments"] > 10
    eng.close()


def test_reads_ahead_cover_what_cleaning_copies(tmp_path):
    """Reads ahead hold every record a seal copies from a victim (none through the mapping),
    and read only the victims' live records, coalesced."""
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 201, "uniform", join=True)
    st = eng.log_stats()
    c = eng._cleaner
    assert c.fallbacks == 0 and st["clean_waits"] == 0
    assert 0 < st["clean_read_bytes"] < c.victim_records * eng._segments.rec_pitch  # < whole
    assert st["clean_read_requests"] > 0
    eng.close()


class _Tracked:
    """``numpy`` for ``read``: every array its ``np.empty`` makes (the cleaning reads'
    buffers and request buffers) is counted while it lives; ``peak``: the most at once."""

    def __init__(self):
        self.live = self.peak = self.made = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(np, name)

    def _gone(self, nbytes):
        with self._lock:
            self.live -= nbytes

    def empty(self, *a, **k):
        arr = np.empty(*a, **k)
        with self._lock:
            self.live += arr.nbytes
            self.peak = max(self.peak, self.live)
            self.made += 1
        weakref.finalize(arr, self._gone, arr.nbytes)
        return arr


@pytest.mark.parametrize("regime", ["ready", "slow"])
def test_cleaning_reads_stay_within_the_budgets_share(tmp_path, monkeypatch, regime):
    """At a small budget, on a store aged to its bound, what the cleaning reads hold at any
    moment (buffers read ahead or by a seal, and request buffers) is at most the
    ``cleaning_buffers`` part of the budget's split."""
    tracked = _Tracked()
    monkeypatch.setattr(_read, "np", tracked)
    if regime == "slow":  # reads still running when seals come: read now, forgotten reads
        _slow_reads(monkeypatch)
    eng = _create(tmp_path / "s")
    share = budget.split(_lay(), eng.memory_bytes)["cleaning_buffers"]
    assert share < _read.CLEAN_HELD_BYTES // 1000  # far below the cleaner's own defaults
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 241, "uniform", join=regime == "ready", flush_every=60)
    st = eng.log_stats()
    assert st["cleaned_segments"] > 20 and st["clean_read_bytes"] > 0, st
    assert st["clean_read_requests"] > st["cleaned_segments"]  # request buffers were used
    assert tracked.made > 20 and 0 < tracked.peak <= share, (tracked.peak, share)
    assert eng.check_index() == []
    eng.close()


def test_a_policy_outside_the_list_is_refused(tmp_path):
    eng = _create(tmp_path / "s")
    with pytest.raises(ValueError, match="policy must be one of"):
        _cleaner.Cleaner(eng._pool, eng._segments, 1.5, policy="fifo")
    eng.close()


# -- the mappings of cleaned segments --------------------------------------------------------------
def _mapped(store) -> set[str]:
    """The files of ``store`` that this process maps."""
    prefix = str(store) + os.sep
    return {line.split(prefix, 1)[1].strip() for line in
            Path("/proc/self/maps").read_text().splitlines() if prefix in line}


@pytest.fixture
def munmaps(monkeypatch) -> list[str]:
    """The names of the threads that unmap the segments mapped from now on, in order."""
    threads: list[str] = []
    real = _format.munmap_fn

    def munmap(addr, size):
        threads.append(threading.current_thread().name)
        return real(addr, size)

    monkeypatch.setattr(_format, "munmap_fn", munmap)  # taken by each mapping when made
    return threads


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_cleaned_segments_are_unmapped_off_the_steps_thread(tmp_path, munmaps):
    """A segment that seals leave without a live record is unmapped by the unmapper thread,
    never by the thread that steps (there ``munmap`` of a segment took 25-120 ms, out of
    core); once that thread has run, no dropped segment is still mapped, and ``close``
    returns with nothing of the store mapped."""
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 121, "uniform", flush_every=40)
    assert eng.log_stats()["cleaned_segments"] > 10
    _format.unmap_pending()
    assert munmaps and set(munmaps) == {"dsa-log-unmap"}, munmaps
    live = {_format.seg_name(sid) for sid in eng._segments.segs}
    assert _mapped(tmp_path / "s") <= live
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    eng.close()
    assert _mapped(tmp_path / "s") == set()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_unmaps_in_its_own_thread(tmp_path, munmaps):
    """A child forked after the unmapping thread started has no such thread: its segments
    are unmapped by the thread that drops them, and its close does not wait for a thread
    that is not there."""
    calls = munmaps
    eng = _create(tmp_path / "parent")
    _train(eng, eng.read(np.arange(N)), 1, 61, "uniform")
    eng.close()
    assert calls and set(calls) == {"dsa-log-unmap"}  # the parent's thread runs
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            calls.clear()
            child = _create(tmp_path / "child")
            ref = child.read(np.arange(N))
            _train(child, ref, 1, 61, "uniform")
            ok = np.array_equal(child.read(np.arange(N)), ref)
            child.close()
            code = 0 if ok and calls and set(calls) == {"MainThread"} else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_victims_ids_are_asked_for_a_seal_before_their_scan(tmp_path, monkeypatch):
    """The ids (steps, sums) of the victims after those read ahead are hinted one seal before
    the next seal scans them: a scan of ids still on the disk waits for them on the step's
    thread, a page at a time (the segments are mapped MADV_RANDOM)."""
    eng = _create(tmp_path / "s")
    seals = [0]
    real_seal = eng._commit.seal

    def seal(*a, **k):
        seals[0] += 1
        return real_seal(*a, **k)

    eng._commit.seal = seal

    def sid_of(rows) -> int | None:
        return next((sid for sid, sg in eng._segments.segs.items() if sg.rows is rows), None)

    first_hint: dict[int, int] = {}
    scans: list[tuple[int, int]] = []
    real_advise, real_live = _cleaner.advise_whole, _cleaner._live_records

    def advise(arr, *a):
        sid = sid_of(arr)
        if sid is not None:
            first_hint.setdefault(sid, seals[0])
        return real_advise(arr, *a)

    def live(rows, *a):
        scans.append((sid_of(rows), seals[0]))
        return real_live(rows, *a)

    monkeypatch.setattr(_cleaner, "advise_whole", advise)
    monkeypatch.setattr(_cleaner, "_live_records", live)
    ref = eng.read(np.arange(N))
    # the reads joined every step: which victims are read when a seal comes is then the
    # same in every run (a busy machine otherwise leaves more of them unread)
    _train(eng, ref, 1, 121, "uniform", join=True, flush_every=40)
    later = scans[10:]  # the first victims: cleaning starts, nothing could be hinted yet
    early = [sid for sid, at in later if first_hint.get(sid, at) < at]
    assert len(later) > 40 and len(early) >= 0.8 * len(later), (len(early), len(later))
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    eng.close()


# -- a full disk during a cleaning seal ----------------------------------------------------------
@pytest.mark.parametrize("path", ["behind", "streamed"])
def test_full_disk_during_a_cleaning_seal(tmp_path, monkeypatch, path):
    """ENOSPC while a cleaning seal's segment is written (in the background, or at once for
    a large seal): the steps that fail change nothing, values stay exact, and once there is
    room again the store goes on and reopens exactly."""
    if path == "streamed":
        monkeypatch.setattr(_commit, "BEHIND_BYTES", 0)  # every seal written at once
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 101, "uniform", flush_every=50)
    real = _format.pwrite_all
    full = {"on": False, "armed": True, "hits": 0, "cleaning": 0}
    choose = eng._cleaner.choose

    def cleaning_fills_the_disk(*a):  # the disk fills up in the first seal that cleans
        res, copies = choose(*a)
        if copies and full["armed"]:
            full["on"], full["armed"] = True, False
            full["cleaning"] += 1
        return res, copies

    eng._cleaner.choose = cleaning_fills_the_disk

    def pwrite_all(*a, **k):
        if full["on"]:
            full["hits"] += 1
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(*a, **k)

    monkeypatch.setattr(_format, "pwrite_all", pwrite_all)
    failed, t = 0, 101
    for _ in range(12):
        rows = _rows(t, "uniform")
        try:
            slots = eng.acquire(rows)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC or "ENOSPC" in repr(exc.__cause__) \
                or "No space" in str(exc)
            failed += 1
            assert eng.check_index() == []
            np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
            continue
        eng._pool.region[slots] = _update(eng._pool.region[slots], t, rows)
        ref[rows] = _update(ref[rows], t, rows)
        eng._commit.count = t
        t += 1
    assert failed > 0 and full["hits"] > 0 and full["cleaning"] > 0
    with pytest.raises(OSError):
        eng.flush()
    full["on"] = False
    _train(eng, ref, t, t + 30, "uniform")
    eng.flush()
    assert eng.check_index() == []
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    eng.close()
    eng = _log.open(tmp_path / "s", memory_bytes=_log.memory_for(_lay(), SLOTS))
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.check_index() == []
    eng.close()


# -- dead segment files overwritten, not deleted --------------------------------------------------
def _seg_files(path) -> set[str]:
    return {f.name for f in Path(path).glob("seg-*.dsl")}


def _listed_files(path) -> set[str]:
    """The names of the segment files the store's manifest lists."""
    return {_format.seg_name(int(i)) for i in _format.read_manifest(path)["segments"]}


def _close_exact(eng, ref, path) -> None:
    """The values are ``ref`` and consistent; closed, the directory holds exactly the
    segment files its manifest lists (no spare, no dead file left)."""
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.check_index() == []
    eng.close()
    assert _seg_files(path) == _listed_files(path)


@pytest.fixture
def deleted(monkeypatch) -> list[str]:
    """The names of the segment files deleted from now on (``os.unlink``, Path.unlink)."""
    names: list[str] = []
    real = os.unlink

    def unlink(path, *a, **k):
        if Path(path).name.startswith("seg-"):
            names.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)  # Path.unlink calls os.unlink
    return names


@pytest.mark.parametrize("spares", [_segments.SPARE_SEGMENTS, 0])
def test_dead_private_segments_are_overwritten_not_deleted(tmp_path, monkeypatch, deleted,
                                                           spares):
    """A segment that dies before any manifest listed it keeps its file as a spare, which a
    later seal renames and overwrites: between flushes an aged store deletes (and so makes
    the disk discard) few segment files. The values stay exact, the directory holds the
    live segments and the spares, and ``close`` leaves only what the manifest lists."""
    monkeypatch.setattr(_segments, "SPARE_SEGMENTS", spares)
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 101, "uniform")  # aged: every seal cleans
    eng.flush()
    before = eng.log_stats()
    deleted.clear()
    _train(eng, ref, 101, 301, "uniform", check_every=50)
    st = eng.log_stats()
    seals = st["seals"] - before["seals"]
    recycled = st["recycled_segments"] - before["recycled_segments"]
    assert st["cleaned_segments"] - before["cleaned_segments"] > 50
    segs = eng._segments
    assert st["spare_segments"] == len(segs.spares) <= spares
    # a pending background write renames its spare into place when it runs: wait for them
    # (else a slow writer leaves the spare's old name on disk beside the new segment's id)
    segs.settle(block=True)
    assert _seg_files(tmp_path / "s") == (  # live, dead that the manifest lists, spares
        {_format.seg_name(sid) for sid in set(segs.segs) | segs.doomed}
        | {p.name for p, _ in segs.spares})
    if spares:
        assert recycled > seals // 2, (recycled, seals)
        # deleted: the spares past the cap and the dead segments the last flush committed
        assert len(deleted) < recycled // 2, (len(deleted), recycled)
    else:
        assert recycled == 0 and len(deleted) > seals // 2
    _close_exact(eng, ref, tmp_path / "s")
    eng = _log.open(tmp_path / "s", memory_bytes=_log.memory_for(_lay(), SLOTS))
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    eng.close()


def test_a_spare_is_not_overwritten_while_its_mapping_is_held(tmp_path, monkeypatch):
    """A dead segment whose mapping something in this process still holds (a range load's
    thread reading it as it died) is not overwritten: its bytes stay its own (checked
    against its sums) and its file is not cut under the mapping (SIGBUS in CI once). Once
    the mapping is let go the spare is reused again, and the values stay exact."""
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 101, "uniform")  # aged: every seal cleans
    eng.flush()
    held, taken = [], []
    real_drop, real_take = _segments.Segments.drop, _segments.Segments.take_spare

    def drop(self, ids):  # hold each dying segment, as a range load's job does
        held.extend(self.segs[i] for i in ids)
        real_drop(self, ids)

    def take_spare(self, nbytes):
        path = real_take(self, nbytes)
        taken.append(path)
        return path

    monkeypatch.setattr(_segments.Segments, "drop", drop)
    monkeypatch.setattr(_segments.Segments, "take_spare", take_spare)
    _train(eng, ref, 101, 201, "uniform")
    mapped = [sg for sg in held if _segments._mapping_of(sg.records) is not None]
    paths = {sg.path for sg in mapped}
    assert len(mapped) > 10  # real mappings of dead files were held
    assert not paths & set(taken)  # none of their files reused
    for sg in mapped:  # every byte still the segment's own
        _format.check_records(sg, np.arange(sg.n), np.asarray(sg.records))
    monkeypatch.setattr(_segments.Segments, "drop", real_drop)
    held.clear()
    mapped.clear()
    taken.clear()
    _train(eng, ref, 201, 301, "uniform")
    assert paths & set(taken)  # let go: the spares that waited are reused
    np.testing.assert_array_equal(eng.read(np.arange(N)), ref)
    assert eng.check_index() == []
    eng.close()


def test_a_forked_child_neither_takes_nor_deletes_the_parents_spares(tmp_path):
    """The spare files belong to the process that kept them: a child forked while the store
    has spares (a data-loader worker, say) takes none of them for a seal of its own, deletes
    a dead file of its own instead of keeping it, and its ``delete_spares`` leaves the
    parent's files alone. The parent then goes on reusing them, exactly."""
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 101, "uniform")  # aged: every seal cleans
    eng.flush()
    segs, t = eng._segments, 101
    while not segs.spares:  # until the parent keeps some (seals take them as they come)
        _train(eng, ref, t, t + 20, "uniform")
        t += 20
        assert t < 1000, "no dead private segment was kept as a spare"
    spares = [p for p, _ in segs.spares]
    own = tmp_path / "s" / _format.seg_name(10**6)  # a dead file of the child's own
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            own.write_bytes(b"x" * 4096)
            took = segs.take_spare(4096)
            segs.retire(own, 4096)
            kept = [p for p, _ in segs.spares]
            segs.delete_spares()
            code = 0 if (took is None and not own.exists() and kept == spares
                         and all(p.exists() for p in spares)) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert all(p.exists() for p in spares) and [p for p, _ in segs.spares] == spares
    before = eng.log_stats()["recycled_segments"]
    _train(eng, ref, t, t + 60, "uniform")
    assert eng.log_stats()["recycled_segments"] > before  # the parent still reuses them
    _close_exact(eng, ref, tmp_path / "s")


def test_committed_segments_are_never_overwritten(tmp_path):
    """Files a manifest listed are never reused, only deleted: a reader opened at a flush and
    a checkpoint made there still read exactly that flush's values after the writer has
    cleaned every segment of it (and reused other dead files meanwhile)."""
    eng = _create(tmp_path / "s")
    ref = eng.read(np.arange(N))
    _train(eng, ref, 1, 81, "uniform")
    eng.flush()
    at_flush = ref.copy()
    listed = set(eng._segments.committed)
    eng.checkpoint(tmp_path / "ck")
    reader = _log.open(tmp_path / "s", mode="r")
    before = eng.log_stats()["recycled_segments"]
    t = 81
    while listed & set(eng._segments.segs):  # until every segment of that flush is dead
        _train(eng, ref, t, t + 20, "uniform")
        t += 20
        assert t < 2000, "the flush's segments never died"
    _train(eng, ref, t, t + 20, "uniform")
    assert eng.log_stats()["recycled_segments"] > before
    np.testing.assert_array_equal(reader.read(np.arange(N)), at_flush)
    assert reader.check_index() == []
    reader.close()
    eng.close()
    ck = _log.open(tmp_path / "ck", mode="r")
    np.testing.assert_array_equal(ck.read(np.arange(N)), at_flush)
    assert ck.check_index() == []
    ck.close()


# -- kill -9 inside a cleaning seal ---------------------------------------------------------------
STEPS, FLUSH = 120, 10


def _child(path, point: str, nth: int, never_ready: bool, flush: int = FLUSH) -> None:
    code = 1
    try:
        if never_ready:  # every clean waits: the waiting path's crash points are reached
            _cleaner.Cleaner.ready = lambda self, sid: False
        _format.set_crash(point, nth)
        eng = _log.open(path, memory_bytes=_log.memory_for(_lay(), SLOTS))
        for t in range(eng.count + 1, STEPS + 1):
            rows = _rows(t, "uniform")
            slots = eng.acquire(rows)
            eng._pool.region[slots] = _update(eng._pool.region[slots], t, rows)
            eng._commit.count = t
            if t % flush == 0:
                eng.flush()
        eng.close()
        code = 0
    except BaseException:  # noqa: BLE001 - report and leave; never return into pytest
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def _references(flush: int = FLUSH) -> dict[int, np.ndarray]:
    eng_init = _log_init_records()
    ref, out = eng_init.copy(), {0: eng_init.copy()}
    for t in range(1, STEPS + 1):
        rows = _rows(t, "uniform")
        ref[rows] = _update(ref[rows], t, rows)
        if t % flush == 0:
            out[t] = ref.copy()
    return out


def _log_init_records() -> np.ndarray:
    from dsa_core import _init

    lay = _lay()
    spec = _init.InitSpec("normal", 0.1, 3, None, lay["dim"], lay["w"], lay["stride"],
                          np.dtype(lay["dtype"]))
    return _init.initial_records(np.arange(N), spec)


@pytest.mark.parametrize("point,never_ready,flush", [
    ("clean", False, FLUSH), ("clean-copied", False, FLUSH), ("clean-wait", True, FLUSH),
    ("clean", True, FLUSH), ("clean-copied", True, FLUSH),
    # a seal written over a dead segment's file (flushes far apart: such files are many)
    ("seal-recycled", False, 40), ("seal-chunk", False, 40)])
def test_kill_inside_a_cleaning_seal_reopens_at_the_last_flush(tmp_path, point, never_ready,
                                                               flush):
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    refs = _references(flush)
    path = tmp_path / "s"
    _create(path).close()
    rng = np.random.default_rng(zlib.crc32(f"{point}:{never_ready}".encode()))
    count, kills = 0, 0
    for _ in range(4):
        nth = int(rng.integers(1, 25))
        pid = os.fork()
        if pid == 0:
            _child(path, point, nth, never_ready, flush)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status)
        if killed:
            assert os.WTERMSIG(status) == signal.SIGKILL
            kills += 1
        else:
            assert os.WEXITSTATUS(status) == 0, (point, nth)
        eng = _log.open(path, memory_bytes=_log.memory_for(_lay(), SLOTS))
        # the killed writer's spares, half-written and unlisted segments are gone
        assert _seg_files(path) == _listed_files(path), (point, nth)
        assert eng.count in refs and eng.count >= count, (point, nth, eng.count)
        np.testing.assert_array_equal(eng.read(np.arange(N)), refs[eng.count],
                                      err_msg=f"{point}:{nth} at {eng.count}")
        assert eng.check_index() == []
        count = eng.count
        eng.close()
        if count == STEPS:
            shutil.rmtree(path)
            _create(path).close()
            count = 0
    assert kills > 0, point
