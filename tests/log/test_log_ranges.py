"""Range loads on a log store: ``load_range`` reads a range's records sequentially into the region
and pins them there until ``release_range``; values never change because of a load.

What is checked: the reads are few and large and the rows then step without a miss; loaded rows
are never evicted while pinned; resident (dirty) rows are not overwritten, records that moved
since they were read are read again, never-written rows load as their initial record; a range
that cannot fit is refused with nothing changed; and kill -9, Ctrl-C, a forgotten close and a
full disk between a load and its release lose nothing that was flushed (or, at a normal exit,
nothing at all).
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import batches, create, log_memory, records, train

import dsa_core

N, D = 3000, 8
LAYOUT = {"num_rows": N, "stride": 3 * D, "dtype": "float32"}
B = 64


# the stores (helpers.create with slots=): dsa_core.create's init_scale, seed 5
LOG = {"kind": "log", "init_scale": 0.01, "seed": 5}


def _stats(s):
    return s.store.log_stats()


@pytest.mark.parametrize("span", ["sequential", "scattered"])
def test_a_load_reads_the_range_in_a_few_large_reads_then_steps_do_not_miss(tmp_path, span,
                                                                              monkeypatch):
    from dsa_core._log import ranges
    if span == "sequential":  # this table's segments are small: make them count as large
        monkeypatch.setattr(ranges, "SPAN_BYTES", 4096)
    s = create(tmp_path / "log", N, D, **LOG, slots=1200)
    s = train(s, 40, batch=B)
    dsa_core.release_range(s, 0, N)  # every row sealed in row order, none resident
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "log", memory=log_memory(LAYOUT, 1200))
    want = records(s)
    assert dsa_core.residency(s, np.arange(N)) == 0.0
    loc = s.store._pool.index.get(np.arange(1000, 2000))
    files = np.unique((loc[loc > 0] - 1) >> 32).shape[0]  # segments holding the range
    never = int(np.count_nonzero(loc == 0))  # never written: their initial records
    dsa_core.load_range(s, 1000, 2000, wait=True)
    st = _stats(s)
    rec = LAYOUT["stride"] * 4
    assert dsa_core.residency(s, np.arange(1000, 2000)) == 1.0
    assert st["range_records"] == 1000 and st["range_pinned"] == 1000
    assert st["range_read_bytes"] >= 1000 * rec or span == "scattered"
    if span == "sequential":  # sealed together: one read per segment file (of 150 records)
        assert 1 <= st["range_reads"] <= files < 20 and st["range_mapped_records"] == 0
    else:  # spans under SPAN_BYTES: hinted at queue depth, copied from the mappings
        assert st["range_reads"] == 0 and st["range_mapped_records"] == 1000 - never
    assert st["slots_dirty"] == 0  # loaded rows are clean until a step writes them
    misses = st["misses"]
    s = train(s, 10, batch=B, rows=np.arange(1000, 2000))
    assert _stats(s)["misses"] == misses  # every row was there
    np.testing.assert_array_equal(records(s)[:1000], want[:1000])
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_loaded_rows_are_never_evicted_until_released(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=600)
    s = train(s, 30, batch=B)
    dsa_core.load_range(s, 0, 400)
    # many misses elsewhere: CLOCK runs all the time
    s = train(s, 60, batch=B, rows=np.arange(400, N), seed=2)
    st = _stats(s)
    assert st["seals"] > 0 and st["range_pins_dropped"] == 0
    assert dsa_core.residency(s, np.arange(400)) == 1.0
    m = st["misses"]
    s = train(s, 5, batch=B, rows=np.arange(400), seed=3)
    assert _stats(s)["misses"] == m
    dsa_core.release_range(s, 0, 400)
    st = _stats(s)
    assert st["range_pinned"] == 0 and dsa_core.residency(s, np.arange(400)) == 0.0
    assert st["slots_dirty"] == int(np.count_nonzero(s.store._pool.dirty))
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_a_load_keeps_resident_dirty_rows_and_loads_never_written_ones(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=1000)
    init = records(s)  # nothing written yet: every row reads as its initial record
    s = dsa_core.step(s, np.arange(100, 150), np.ones((50, D), np.float32))  # dirty, resident
    dsa_core.release_range(s, 0, 100)  # (nothing there)
    want = records(s)
    assert not np.array_equal(want[100:150], init[100:150])
    dsa_core.load_range(s, 0, 500, wait=True)
    eng = s.store
    slots = eng._pool.slots_of(np.arange(100, 150))
    assert (slots >= 0).all()
    assert (eng._pool.dirty[slots] == 1).all()  # still the step's records, still dirty
    np.testing.assert_array_equal(records(s), want)
    np.testing.assert_array_equal(records(s)[:100], init[:100])  # the initial records
    assert _stats(s)["range_records"] == 450
    dsa_core.release_range(s, 0, 500)
    np.testing.assert_array_equal(records(s), want)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def test_an_install_never_puts_back_a_stale_record(tmp_path):
    """Records read before the row moved (a seal or the cleaner) or became resident: the
    install compares locations and reads the moved rows again; resident ones are kept."""
    s = create(tmp_path / "log", N, D, **LOG, slots=1000)
    s = train(s, 20, batch=B)
    dsa_core.release_range(s, 0, N)
    eng = s.store
    pool = eng._pool
    rows = np.arange(0, 300, dtype=np.int64)
    read_at = pool.index.get(rows)  # where the loader read them
    s = dsa_core.step(s, np.arange(0, 100), np.ones((100, D), np.float32))  # resident now
    dsa_core.release_range(s, 50, 100)  # sealed again: they moved
    pool.pin_range(0, 300)  # the range is active, as load_range makes it
    want = records(s)
    garbage = np.full((300, LAYOUT["stride"]), np.nan, np.float32)
    fresh = np.flatnonzero(read_at[100:] == pool.index.get(np.arange(100, 300))) + 100
    garbage[fresh] = want[fresh]  # what the loader would have read for the unmoved ones
    n = pool.install_loaded(rows, read_at, garbage, eng._commit.make_room)
    assert n == 250  # rows 0-49 were resident: kept
    np.testing.assert_array_equal(records(s), want)  # the moved rows were read again
    assert _stats(s)["range_rereads"] == 50
    assert eng.check_index() == []
    dsa_core.close(s)


def test_loads_racing_steps_seals_and_cleaning_change_no_value(tmp_path):
    plan = batches(150, N, D, batch=B, seed=4)
    out = []
    for name, loads in (("plain", False), ("loaded", True)):
        s = create(tmp_path / name, N, D, **LOG, slots=400, space_ratio=1.3)
        held = []
        for k, (idx, g) in enumerate(plan):
            if loads and k % 5 == 0:
                if len(held) == 2:
                    dsa_core.release_range(s, *held.pop(0))
                lo = (k * 131) % (N - 150)
                held.append((lo, lo + 150))
                dsa_core.load_range(s, *held[-1])  # never waited for
            s = dsa_core.step(s, idx, g)
        assert s.store.check_index() == []
        out.append(s)
    st = _stats(out[1])
    assert st["cleaned_segments"] > 0 and st["range_records"] > 0
    np.testing.assert_array_equal(records(out[0]).view(np.uint8),
                                  records(out[1]).view(np.uint8))
    for s in out:
        dsa_core.close(s)


def test_a_range_that_cannot_fit_is_refused_and_changes_nothing(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=500)
    s = train(s, 5, batch=B)
    dsa_core.load_range(s, 0, 300)
    before, st = records(s), _stats(s)
    with pytest.raises(ValueError) as e:
        dsa_core.load_range(s, 300, 450)  # 450 pinned + a batch of 64 > 500
    msg = str(e.value)
    for part in ("cover 450 rows", "room for 64 more", "holds 500 rows", "Nothing was changed",
                 "release_range", f"memory={log_memory(LAYOUT, 514)}",
                 "dsa_core.buckets.fit"):
        assert part in msg, (part, msg)
    np.testing.assert_array_equal(records(s), before)
    assert _stats(s)["range_pinned"] <= 300 and _stats(s)["range_loads"] == st["range_loads"]
    dsa_core.release_range(s, 0, 300)
    dsa_core.load_range(s, 300, 450)  # fits once the first range is released
    dsa_core.close(s)


def test_a_batch_that_does_not_fit_beside_the_pins_unpins_them(tmp_path):
    """A load was checked against the batches stepped so far; a larger batch later must not
    fail because of it: the pins yield (counted), the values are those of any step."""
    s = create(tmp_path / "log", N, D, **LOG, slots=300)
    dsa_core.load_range(s, 0, 250, wait=True)
    want = train(create(tmp_path / "ref", N, D, **LOG, slots=300), 1, batch=200)
    s = train(s, 1, batch=200)
    assert _stats(s)["range_pins_dropped"] == 1
    np.testing.assert_array_equal(records(s), records(want))
    assert s.store.check_index() == []
    dsa_core.close(s)
    dsa_core.close(want)


def test_close_with_a_load_in_flight(tmp_path):
    s = create(tmp_path / "log", N, D, **LOG, slots=2500)
    s = train(s, 20, batch=B)
    dsa_core.release_range(s, 0, N)
    want = records(s)
    dsa_core.load_range(s, 0, 2000)  # not waited for
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "log", mode="r")
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


# -- crashes between a load and its release ---------------------------------------------------
_SCRIPT = """
import os, signal, sys, time, numpy as np, dsa_core
rng = np.random.default_rng(0)
mem = dsa_core.region_memory({{"num_rows": {N}, "stride": {S}, "dtype": "float32"}}, 1500)
s = dsa_core.create({path!r}, {N}, {D}, storage="log", memory=mem, init="normal")
def steps(s, n, lo, hi):
    for _ in range(n):
        s = dsa_core.step(s, rng.integers(lo, hi, {B}),
                          rng.standard_normal(({B}, {D})).astype(np.float32))
    return s
s = steps(s, 30, 0, {N})
dsa_core.release_range(s, 0, {N})
dsa_core.flush(s)
np.save({flushed!r}, dsa_core.read_records(s, np.arange({N})))
dsa_core.load_range(s, 0, 1000)
s = steps(s, 10, 0, 1000)
dsa_core.load_range(s, 1000, 1400)          # in flight, maybe
s = steps(s, 3, 1000, 1400)
np.save({live!r}, dsa_core.read_records(s, np.arange({N})))
print("loaded", s.count, flush=True)
end = {end!r}
if end == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
elif end == "sleep":
    time.sleep(60)
# "exit": no release, no flush, no close: the program just ends
"""


def _script(tmp_path, end):
    return textwrap.dedent(_SCRIPT.format(
        N=N, D=D, B=B, S=LAYOUT["stride"], path=str(tmp_path / "log"), end=end,
        flushed=str(tmp_path / "flushed.npy"), live=str(tmp_path / "live.npy")))


def _reopened(tmp_path):
    s = dsa_core.open(tmp_path / "log", memory=log_memory(LAYOUT, 1500))
    got = records(s), s.count
    assert s.store.check_index() == []
    dsa_core.close(s)
    return got


def test_kill_9_between_load_and_release_reopens_at_the_last_flush(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _script(tmp_path, "kill")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.split() == ["loaded", "43"]
    got, count = _reopened(tmp_path)
    assert count == 30
    np.testing.assert_array_equal(got, np.load(tmp_path / "flushed.npy"))


def test_a_store_left_open_with_loads_is_flushed_at_exit(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _script(tmp_path, "exit")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got, count = _reopened(tmp_path)
    assert count == 43
    np.testing.assert_array_equal(got, np.load(tmp_path / "live.npy"))


def test_ctrl_c_between_load_and_release_flushes_at_exit(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _script(tmp_path, "sleep")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().split() == ["loaded", "43"]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Python ends by SIGINT itself after the traceback and the exit handlers
    assert proc.returncode in (1, -signal.SIGINT) and "KeyboardInterrupt" in err, err
    got, count = _reopened(tmp_path)
    assert count == 43
    np.testing.assert_array_equal(got, np.load(tmp_path / "live.npy"))


def test_a_full_disk_in_a_release_loses_nothing(tmp_path):
    from store.test_reliability import fill, small_fs
    with small_fs(tmp_path / "fs", "8m") as fs:
        s = create(fs / "log", N, D, **LOG, slots=1500)
        s = train(s, 30, batch=B)
        dsa_core.release_range(s, 0, N)
        dsa_core.flush(s)
        dsa_core.load_range(s, 0, 1000, wait=True)
        s = train(s, 20, batch=B, rows=np.arange(1000), seed=7)  # the range is dirty now
        want = records(s)
        filler = fill(fs)
        with pytest.raises(OSError) as e:
            dsa_core.release_range(s, 0, 1000)  # its seal finds no space
            dsa_core.flush(s)  # (or the flush that waits for the seal's background write)
        assert "No space left" in str(e.value) or e.value.errno == errno.ENOSPC, e.value
        np.testing.assert_array_equal(records(s), want)  # nothing lost
        os.remove(filler)
        dsa_core.release_range(s, 0, 1000)
        dsa_core.flush(s)
        np.testing.assert_array_equal(records(s), want)
        assert s.store.check_index() == []
        dsa_core.close(s)
        gc.collect()
        r = dsa_core.open(fs / "log", mode="r")
        np.testing.assert_array_equal(records(r), want)
        dsa_core.close(r)


def test_a_damaged_record_is_never_loaded_and_its_error_is_raised_once(tmp_path):
    from dsa_core._log.format import SegmentError, read_header, record_offset, seg_name
    s = create(tmp_path / "log", N, D, **LOG, slots=1200)
    s = train(s, 40, batch=B)
    dsa_core.release_range(s, 0, N)
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "log", mode="r")
    want = records(s)
    row = int(np.flatnonzero(s.store._pool.disk_locations()[1000:] > 0)[0]) + 1000
    loc = int(s.store._pool.disk_locations()[row]) - 1
    dsa_core.close(s)
    seg = tmp_path / "log" / seg_name(loc >> 32)
    head = read_header(seg)
    raw = bytearray(seg.read_bytes())
    raw[record_offset(head, loc & 0xFFFFFFFF) + 3] ^= 0xFF  # a bit of its record
    seg.write_bytes(bytes(raw))
    s = dsa_core.open(tmp_path / "log", memory=log_memory(LAYOUT, 1200))
    dsa_core.load_range(s, row - 300, row + 600)
    with pytest.raises(SegmentError):
        dsa_core.wait_ranges(s)
    dsa_core.wait_ranges(s)  # reported once
    assert dsa_core.residency(s, [row]) == 0.0  # never installed
    ok = np.setdiff1d(np.arange(N), [row])
    np.testing.assert_array_equal(dsa_core.read_records(s, ok), want[ok])
    with pytest.raises(SegmentError):  # a step that needs it reads it and refuses it
        dsa_core.step(s, [row], np.ones((1, D), np.float32))
    assert s.store.check_index() == []
    dsa_core.close(s)
