"""dsa_core.load_range / release_range / wait_ranges: sequential range hints.

They never change a value (steps racing with them included), a loaded range is resident, a
released one is written back and dropped, bad arguments queue nothing, background errors are
raised once, and close() with requests in flight is clean.
"""

from __future__ import annotations

import errno
import gc
import os
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from dsa_core._inplace import ranges as _ranges
from helpers import wait_forked

N, D = 20_000, 16


def _fs_type(path: Path) -> str:
    """The type of the filesystem holding ``path`` (longest mount-point prefix)."""
    best, kind = "", ""
    real = os.path.realpath(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, parts[2]
    return kind


@pytest.fixture
def disk_path(tmp_path):
    """tmp_path, on a filesystem whose clean pages the kernel can drop (not tmpfs)."""
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("the temporary directory is on tmpfs: its pages have no disk to go to")
    return tmp_path


def _batches(seed: int, steps: int, n: int = N, b: int = 256):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        lo = (t * n // steps) // 2  # a window moving over the table, like partitions
        ids = rng.integers(lo, min(n, lo + n // 3), b)
        out.append((ids, rng.standard_normal((b, D)).astype(np.float32)))
    return out


def _on_disk(path: Path, st) -> np.ndarray:
    """The records as a fresh read of the data file returns them (no mapping involved)."""
    raw = np.fromfile(path / "rows.dsa", dtype=np.uint8)[4096:]
    return raw.view(st.dtype).reshape(st.num_rows, st.store.layout.stride)


def _manifest_count(path: Path) -> int:
    import json
    return json.loads((path / "manifest.json").read_text())["count"]


# -- values ---------------------------------------------------------------------------------
@pytest.mark.parametrize("access", ["ram", "disk"])
def test_hints_never_change_a_value(tmp_path, access, monkeypatch):
    """Loads and releases interleaved with the steps (releases of the rows being stepped,
    never waited for) leave every byte as the same steps without any hint."""
    monkeypatch.setattr(_ranges, "LOAD_CHUNK", 3 * 4096)      # many chunks: more interleaving
    monkeypatch.setattr(_ranges, "RELEASE_CHUNK", 5 * 4096)
    kw = dict(init="normal", seed=3, access=access, lr=1e-2)
    a = dsa_core.create(tmp_path / "a", N, D, **kw)
    b = dsa_core.create(tmp_path / "b", N, D, **kw)
    rng = np.random.default_rng(0)
    for t, (ids, g) in enumerate(_batches(1, 60)):
        a = dsa_core.step(a, ids, g)
        lo = int(rng.integers(0, N))
        hi = int(rng.integers(lo, N + 1))
        if t % 3 == 0:
            dsa_core.load_range(b, lo, hi)
        else:
            dsa_core.release_range(b, lo, hi)
        if t % 10 == 5:
            dsa_core.release_range(b, 0, N)  # the whole table, rows being stepped included
        b = dsa_core.step(b, ids, g)  # races with the requests just queued
    dsa_core.release_range(b, 0, N)
    b = dsa_core.step(b, *_batches(2, 1)[0])
    a = dsa_core.step(a, *_batches(2, 1)[0])
    dsa_core.wait_ranges(b)
    assert b.store._ranges.released_bytes > 0 and b.store._ranges.loaded_bytes > 0
    np.testing.assert_array_equal(a.store.data.view(np.uint8), b.store.data.view(np.uint8))
    dsa_core.close(a)
    dsa_core.close(b)
    ra, rb = dsa_core.open(tmp_path / "a", mode="r"), dsa_core.open(tmp_path / "b", mode="r")
    assert ra.count == rb.count == 61
    assert (tmp_path / "a" / "rows.dsa").read_bytes() == (tmp_path / "b" / "rows.dsa").read_bytes()
    dsa_core.close(ra)
    dsa_core.close(rb)


def test_steps_from_another_thread_during_releases_lose_nothing(tmp_path, monkeypatch):
    """A thread keeps releasing the whole table while the training thread steps it."""
    monkeypatch.setattr(_ranges, "RELEASE_CHUNK", 4 * 4096)
    a = dsa_core.create(tmp_path / "a", N, D, init="normal", seed=5, access="disk")
    b = dsa_core.create(tmp_path / "b", N, D, init="normal", seed=5, access="disk")
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            dsa_core.release_range(b, 0, N, wait=True)
            dsa_core.load_range(b, 0, N // 2, wait=True)

    th = threading.Thread(target=churn)
    th.start()
    try:
        for ids, g in _batches(7, 40):
            a = dsa_core.step(a, ids, g)
            b = dsa_core.step(b, ids, g)
    finally:
        stop.set()
        th.join()
    np.testing.assert_array_equal(a.store.data.view(np.uint8), b.store.data.view(np.uint8))
    dsa_core.close(a)
    dsa_core.close(b)


# -- residency, write-back ------------------------------------------------------------------
@pytest.mark.parametrize("access", ["ram", "disk"])
def test_load_makes_resident_and_release_writes_back_and_drops(disk_path, access):
    s = dsa_core.create(disk_path / "s", N, D, init="normal", access=access)
    dsa_core.flush(s)
    rows = np.arange(2_000, 12_000)
    dsa_core.release_range(s, 0, N, wait=True)
    assert dsa_core.residency(s, rows) < 0.5  # a clean table is dropped too
    dsa_core.load_range(s, 2_000, 12_000, wait=True)
    assert dsa_core.residency(s, rows) == 1.0
    s = dsa_core.step(s, rows, np.ones((rows.size, D), np.float32))  # dirty the range
    stepped = s.store.data.copy()
    assert dsa_core.residency(s, rows) == 1.0
    dsa_core.release_range(s, 2_000, 12_000, wait=True)
    if not s.store._ranges._can_pageout:
        pytest.skip("this kernel has no MADV_PAGEOUT: mapped pages are not dropped")
    # dirty pages cannot be dropped: a range that left memory was written back first
    assert dsa_core.residency(s, rows) < 0.5
    assert _manifest_count(disk_path / "s") == 0  # no flush happened
    np.testing.assert_array_equal(_on_disk(disk_path / "s", s), stepped)
    np.testing.assert_array_equal(s.store.data, stepped)  # and the mapping reads them back
    dsa_core.close(s)


def test_a_load_stays_inside_its_range_and_a_release_spares_its_neighbours(disk_path):
    """Partitions are contiguous ranges: loading one must not read the next one in (kernel
    read-ahead past the range's end), and releasing one must not drop the page it shares
    with a resident neighbour (page rounding)."""
    s = dsa_core.create(disk_path / "s", N, D, init="normal", access="disk")
    dsa_core.flush(s)
    dsa_core.release_range(s, 0, N, wait=True)
    if not s.store._ranges._can_pageout:
        pytest.skip("this kernel has no MADV_PAGEOUT: mapped pages are not dropped")
    dsa_core.load_range(s, 1_000, 2_000, wait=True)
    assert dsa_core.residency(s, np.arange(1_000, 2_000)) == 1.0
    assert dsa_core.residency(s, np.arange(3_000, 8_000)) < 0.05
    dsa_core.load_range(s, 2_000, 3_001, wait=True)  # row 2,000 shares a page with 1,999
    dsa_core.release_range(s, 2_000, 3_001, wait=True)
    assert dsa_core.residency(s, np.arange(1_000, 2_000)) == 1.0
    assert dsa_core.residency(s, np.arange(2_100, 2_900)) < 0.5
    dsa_core.close(s)


def test_requests_run_in_submission_order(disk_path):
    s = dsa_core.create(disk_path / "s", N, D, access="disk")
    rows = np.arange(N)
    for _ in range(3):
        dsa_core.load_range(s, 0, N)
        dsa_core.release_range(s, 0, N, wait=True)  # waits for the load before it, too
        assert dsa_core.residency(s, rows) < 0.5
        dsa_core.release_range(s, 0, N)
        dsa_core.load_range(s, 0, N)
        dsa_core.wait_ranges(s)
        assert dsa_core.residency(s, rows) == 1.0
    dsa_core.close(s)


@pytest.mark.parametrize("access", ["ram", "disk"])
def test_read_only_store_may_load_and_release(disk_path, access):
    s = dsa_core.create(disk_path / "s", N, D, init="normal")
    s = dsa_core.step(s, np.arange(100), np.ones((100, D), np.float32))
    dsa_core.close(s)
    del s  # its mapping too: pages another mapping still maps are not dropped
    gc.collect()
    before = (disk_path / "s" / "rows.dsa").read_bytes()
    r = dsa_core.open(disk_path / "s", mode="r", access=access)
    assert r.access == access
    values = r.store.data.copy()
    dsa_core.load_range(r, 0, N, wait=True)
    assert dsa_core.residency(r, np.arange(N)) == 1.0
    dsa_core.release_range(r, 0, N, wait=True)
    assert dsa_core.residency(r, np.arange(N)) < 0.5
    np.testing.assert_array_equal(r.store.data, values)
    dsa_core.close(r)
    assert (disk_path / "s" / "rows.dsa").read_bytes() == before


# -- arguments ------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [dsa_core.load_range, dsa_core.release_range])
def test_bad_ranges_are_refused_and_queue_nothing(tmp_path, fn):
    s = dsa_core.create(tmp_path / "s", 100, D)
    cases = [
        ((5, 3), ValueError, r"0 <= start <= stop <= num_rows = 100, got start=5, stop=3"),
        ((0, 101), ValueError, r"stop <= num_rows = 100, got start=0, stop=101"),
        ((-1, 4), ValueError, r"got start=-1, stop=4"),
        ((1.0, 4), TypeError, r"start must be an int row index, got float 1.0"),
        ((0, np.float32(4)), TypeError, r"stop must be an int row index"),
        ((True, 4), TypeError, r"start must be an int row index, got True"),
        ((0, None), TypeError, r"stop must be an int row index, got NoneType"),
    ]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            fn(s, *args)
    assert s.store._ranges is None  # nothing queued, no thread started
    fn(s, 7, 7, wait=True)  # an empty range is a no-op
    assert s.store._ranges is None
    fn(s, np.int64(10), np.int32(20), wait=True)  # numpy ints are fine
    w = s.store._ranges
    done = (w.loaded_bytes, w.released_bytes)
    with pytest.raises(ValueError):
        fn(s, 50, 10, wait=True)
    dsa_core.wait_ranges(s)
    assert (w.loaded_bytes, w.released_bytes) == done and w._worker._q.empty()
    with pytest.raises(TypeError, match="state must be a dsa_core.State"):
        fn(s.store, 0, 1)
    dsa_core.close(s)
    for call in (lambda: fn(s, 0, 10), lambda: fn(s, 0, 0), lambda: dsa_core.wait_ranges(s)):
        with pytest.raises(ValueError, match=r"is closed; reopen it with dsa_core.open"):
            call()


def test_wait_ranges_on_a_closed_store_that_never_loaded(tmp_path):
    s = dsa_core.create(tmp_path / "s", 100, D)
    dsa_core.wait_ranges(s)  # nothing queued: returns
    dsa_core.close(s)
    with pytest.raises(ValueError, match="is closed"):
        dsa_core.wait_ranges(s)


def test_an_outdated_state_locates_the_store(tmp_path):
    s0 = dsa_core.create(tmp_path / "s", N, D)
    s1 = dsa_core.step(s0, [1, 2], np.ones((2, D), np.float32))
    assert not s0.current
    dsa_core.load_range(s0, 0, N, wait=True)
    dsa_core.release_range(s0, 0, 10, wait=True)
    dsa_core.wait_ranges(s0)
    assert s0.store._ranges is s1.store._ranges  # one worker per store
    dsa_core.close(s1)


def test_one_thread_per_store(tmp_path):
    a = dsa_core.create(tmp_path / "a", 1000, D)
    b = dsa_core.create(tmp_path / "b", 1000, D)
    for _ in range(3):
        dsa_core.load_range(a, 0, 1000)
        dsa_core.load_range(b, 0, 1000)
    wa, wb = a.store._ranges, b.store._ranges
    assert wa is not wb and wa._worker.thread is not wb._worker.thread
    dsa_core.close(a)
    assert not wa._worker.thread.is_alive() and wb._worker.thread.is_alive()
    dsa_core.close(b)
    assert not wb._worker.thread.is_alive()


# -- errors in the background ---------------------------------------------------------------
def test_a_background_error_is_raised_once_by_the_next_call(tmp_path, monkeypatch):
    s = dsa_core.create(tmp_path / "s", 1000, D)
    dsa_core.load_range(s, 0, 10, wait=True)

    def broken(self, start, stop):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_ranges.RangeWorker, "_release", broken)
    with pytest.raises(OSError, match=r"background release_range\(rows \[0, 500\)\) of store "
                       r".* failed: Input/output error") as info:
        dsa_core.release_range(s, 0, 500, wait=True)
    assert info.value.errno == errno.EIO
    dsa_core.wait_ranges(s)  # reported once
    dsa_core.load_range(s, 0, 10, wait=True)
    dsa_core.release_range(s, 0, 500)  # fails in the background: the next waited call says so
    with pytest.raises(OSError, match=r"background release_range\(rows \[0, 500\)\)"):
        dsa_core.load_range(s, 0, 10, wait=True)
    dsa_core.release_range(s, 0, 10)
    with pytest.raises(OSError, match=r"background release_range\(rows \[0, 10\)\)"):
        dsa_core.wait_ranges(s)
    dsa_core.wait_ranges(s)
    dsa_core.close(s)


# -- close ----------------------------------------------------------------------------------
def test_close_with_requests_in_flight_is_clean(tmp_path, monkeypatch):
    monkeypatch.setattr(_ranges, "LOAD_CHUNK", 4096)
    monkeypatch.setattr(_ranges, "RELEASE_CHUNK", 4096)
    s = dsa_core.create(tmp_path / "s", N, D, init="normal", seed=1)
    for ids, g in _batches(3, 5):
        s = dsa_core.step(s, ids, g)
    expected = s.store.data.copy()
    for _ in range(20):
        dsa_core.release_range(s, 0, N)
        dsa_core.load_range(s, 0, N)
    waiter_done = threading.Event()

    def waiter():
        dsa_core.wait_ranges(s)
        waiter_done.set()

    th = threading.Thread(target=waiter)
    th.start()
    w = s.store._ranges
    dsa_core.close(s)  # drops the queue, stops the running request at its next chunk
    assert not w._worker.thread.is_alive() and w._fd == -1
    th.join(timeout=10)
    assert waiter_done.is_set()  # a waiter is released by the close
    r = dsa_core.open(tmp_path / "s", mode="r")
    assert r.count == 5
    np.testing.assert_array_equal(r.store.data, expected)
    dsa_core.close(r)


def test_a_store_dropped_unclosed_stops_its_thread(tmp_path):
    s = dsa_core.create(tmp_path / "s", 1000, D)
    dsa_core.load_range(s, 0, 1000, wait=True)
    th = s.store._ranges._worker.thread
    del s
    gc.collect()
    th.join(timeout=10)
    assert not th.is_alive()
    # the store was flushed and its descriptors and writer lock released with its last State
    dsa_core.close(dsa_core.open(tmp_path / "s"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_its_own_worker(tmp_path):
    """The parent's thread does not exist in a forked child: the child must not wait on it."""
    s = dsa_core.create(tmp_path / "s", 1000, D)
    dsa_core.load_range(s, 0, 1000, wait=True)
    parent_worker = s.store._ranges
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            dsa_core.load_range(s, 0, 1000, wait=True)
            dsa_core.release_range(s, 0, 500, wait=True)
            dsa_core.wait_ranges(s)
            code = 0 if s.store._ranges is not parent_worker else 2
            dsa_core.close(s)
        finally:
            os._exit(code)
    assert wait_forked(pid, 30, "the forked child hung on a range request") == 0
    assert s.store._ranges is parent_worker and parent_worker._worker.thread.is_alive()
    dsa_core.load_range(s, 0, 1000, wait=True)  # the parent's worker goes on
    dsa_core.close(s)


def _pmd_mapped_kib(file: Path) -> int:
    """KiB of ``file``'s mapping(s) in this process mapped by 2 MiB page-table entries."""
    total, inside = 0, False
    name = os.path.realpath(file)
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
                inside = line.rstrip("\n").endswith(name)
            elif inside and head[0] == "FilePmdMapped:":
                total += int(head[1])
    return total


def test_a_ram_store_loads_into_huge_page_mappings(disk_path):
    """A "ram" store is loaded through its mapping: the rows come back in 2 MiB mappings, as
    faults would bring them, not 4 KiB ones (kept for the rest of the mapping's life)."""
    s = dsa_core.create(disk_path / "s", N, 64, access="ram")
    dsa_core.flush(s)
    file = disk_path / "s" / "rows.dsa"
    dsa_core.release_range(s, 0, N, wait=True)
    dsa_core.gather(s, np.arange(N))  # read faults: the kernel's own choice of mapping
    by_faults = _pmd_mapped_kib(file)
    if by_faults == 0:
        dsa_core.close(s)
        pytest.skip("this kernel/filesystem maps the file in 4 KiB pages only")
    for _ in range(2):
        dsa_core.release_range(s, 0, N, wait=True)
        assert _pmd_mapped_kib(file) == 0
        dsa_core.load_range(s, 0, N, wait=True)
        assert dsa_core.residency(s, np.arange(N)) == 1.0
        assert _pmd_mapped_kib(file) >= 0.9 * by_faults
    dsa_core.close(s)
