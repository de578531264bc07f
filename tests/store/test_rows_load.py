"""``dsa_core.load_rows`` / ``release_rows``: a row set brought into a store's memory, on both
kinds.

What is checked: no value changes whatever loads and releases run between the steps (both
kinds); the loaded rows are in memory (in place: the page cache; a log store: its region, where
they stay pinned while other rows cycle the region, and a step then misses none of them); a
log store counts the union of loaded ranges and row sets, releases only what no other load
holds, and refuses a set that cannot fit with nothing changed; bad input is refused clearly
with nothing changed; and kill -9 while a row load is in flight reopens at exactly the last
flush (or the last step, with ``durability="step"``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import batches, create, log_memory, records, train

import dsa_core

N, D, B = 3000, 8, 64
LAYOUT = {"num_rows": N, "stride": 3 * D, "dtype": "float32"}


# the stores (helpers.create; a log store's region holds slots= records), by kind:
# dsa_core.create's init_scale, seed 5; in place paged from disk
STORE = {"inplace": {"init_scale": 0.01, "seed": 5, "access": "disk"},
         "log": {"init_scale": 0.01, "seed": 5}}


def _stats(s):
    return s.store.log_stats()


def _on_disk(s):
    """Every row on disk, none in memory: a log store seals and frees its region, an
    in-place store writes its pages back and drops them."""
    dsa_core.release_range(s, 0, N, wait=True)


# -- both kinds -----------------------------------------------------------------------------
def test_row_loads_and_releases_never_change_a_value(tmp_path, kind):
    """Loads and releases of row sets (unsorted, with duplicates, overlapping each other and
    a loaded range, some never waited for) between the steps: every byte as the same steps
    without them; a gather right before and after a load or release gives the same rows."""
    rng = np.random.default_rng(7)
    plan = batches(90, N, D, batch=B, seed=rng)  # drawn first; rng then picks the loaded rows
    a, b = (create(tmp_path / n, N, D, kind, **STORE[kind], slots=900) for n in "ab")
    held: list[np.ndarray] = []
    all_rows = np.arange(N)
    for t, (idx, g) in enumerate(plan):
        a = dsa_core.step(a, idx, g)
        if t % 3 == 0:
            before = dsa_core.gather(b, all_rows)
            if len(held) == 2:
                dsa_core.release_rows(b, held.pop(0))
            rows = rng.integers(0, N, 150)  # unsorted, duplicates
            rows[:20] = idx[:20]  # rows this very step touches
            held.append(rows)
            dsa_core.load_rows(b, rows, wait=t % 2 == 0)
            np.testing.assert_array_equal(dsa_core.gather(b, all_rows), before)
        if t == 30:
            dsa_core.load_range(b, 100, 400)
        if t == 60:
            dsa_core.release_range(b, 100, 400)
        b = dsa_core.step(b, idx, g)
    for rows in held:
        dsa_core.release_rows(b, rows)
    dsa_core.wait_ranges(b)
    np.testing.assert_array_equal(records(a).view(np.uint8), records(b).view(np.uint8))
    if kind == "log":
        assert _stats(b)["row_loads"] == 30 and _stats(b)["range_pinned"] == 0
        assert b.store.check_index() == []
    dsa_core.close(a)
    dsa_core.close(b)
    ra, rb = (dsa_core.open(tmp_path / n, mode="r") for n in "ab")
    assert ra.count == rb.count == 90
    np.testing.assert_array_equal(records(ra).view(np.uint8), records(rb).view(np.uint8))
    dsa_core.close(ra)
    dsa_core.close(rb)


def test_loaded_rows_are_in_memory(tmp_path, kind):
    s = create(tmp_path / "s", N, D, kind, **STORE[kind], slots=1200)
    s = train(s, 30, batch=B)
    _on_disk(s)
    rows = np.sort(np.random.default_rng(2).choice(N, 200, replace=False))
    if kind == "inplace" and dsa_core.residency(s, rows) == 1.0:
        dsa_core.close(s)
        pytest.skip("this filesystem keeps released pages cached (tmpfs?)")
    assert dsa_core.residency(s, rows) < 1.0
    dsa_core.load_rows(s, rows, wait=True)
    assert dsa_core.residency(s, rows) == 1.0
    if kind == "log":
        st = _stats(s)
        assert st["row_loads"] == 1 and st["range_pinned"] == 200
        assert st["range_records"] == 200 and st["slots_dirty"] == 0  # clean until stepped
        assert dsa_core.residency(s, np.setdiff1d(np.arange(N), rows)) == 0.0  # only them
    dsa_core.release_rows(s, rows)
    dsa_core.close(s)


@pytest.mark.parametrize("bad, error, words", [
    (np.array([1.0, 2.0]), TypeError, "integer row ids"),
    (np.array([True, False]), TypeError, "integer row ids"),
    ("12", TypeError, "integer row ids"),
    (np.zeros((2, 2), np.int64), ValueError, "must be 1-D"),
    (np.array([0, N]), IndexError, f"[0, {N})"),
    (np.array([-1, 5]), IndexError, f"[0, {N})"),
])
@pytest.mark.parametrize("fn", ["load_rows", "release_rows"])
def test_bad_rows_are_refused_and_change_nothing(tmp_path, kind, store_digest, bad, error,
                                                 words, fn):
    s = create(tmp_path / "s", N, D, kind, **STORE[kind], slots=600)
    s = train(s, 3, batch=B)
    dsa_core.flush(s)
    dsa_core.load_rows(s, [1, 2, 3], wait=True)
    want, files = records(s), store_digest(tmp_path / "s")
    st = _stats(s) if kind == "log" else None
    with pytest.raises(error) as e:
        getattr(dsa_core, fn)(s, bad)
    assert words in str(e.value) and "rows" in str(e.value), e.value
    np.testing.assert_array_equal(records(s), want)
    assert store_digest(tmp_path / "s") == files
    if kind == "log":
        assert _stats(s) == st  # nothing pinned, loaded or released
    with pytest.raises(TypeError, match="dsa_core.State"):
        getattr(dsa_core, fn)(s.store, [1])
    dsa_core.close(s)
    with pytest.raises(ValueError, match="closed"):
        getattr(dsa_core, fn)(s, [1])


def test_empty_and_outdated_states(tmp_path, kind):
    s = create(tmp_path / "s", N, D, kind, **STORE[kind], slots=600)
    old = s
    s = train(s, 2, batch=B)
    dsa_core.load_rows(old, [], wait=True)  # nothing
    dsa_core.load_rows(old, np.array([5, 5, 9], np.int32), wait=True)  # an outdated State
    assert dsa_core.residency(s, [5, 9]) == 1.0
    dsa_core.release_rows(old, [9, 5, 5], wait=True)
    dsa_core.release_rows(s, [])
    if kind == "log":
        assert _stats(s)["range_pinned"] == 0 and _stats(s)["row_loads"] == 1
    dsa_core.close(s)


# -- a log store's region ---------------------------------------------------------------------
def test_loaded_rows_stay_in_the_region_while_others_cycle_it(tmp_path):
    s = create(tmp_path / "log", N, D, "log", **STORE["log"], slots=600)
    s = train(s, 30, batch=B)
    _on_disk(s)
    rows = np.sort(np.random.default_rng(3).choice(N, 300, replace=False))
    others = np.setdiff1d(np.arange(N), rows)
    dsa_core.load_rows(s, rows, wait=True)
    st = _stats(s)
    # 5,120 touches of 2,700 other rows in 300 free slots
    s = train(s, 80, batch=B, rows=others, seed=4)
    st2 = _stats(s)
    assert st2["seals"] > st["seals"] and st2["misses"] - st["misses"] > 1000  # cycled
    assert st2["range_pins_dropped"] == 0 and st2["range_pinned"] == 300
    assert dsa_core.residency(s, rows) == 1.0
    s = train(s, 10, batch=B, rows=rows, seed=5)
    assert _stats(s)["misses"] == st2["misses"]  # no step read one of them
    want = records(s)
    dsa_core.release_rows(s, rows)
    st = _stats(s)
    assert st["range_pinned"] == 0 and dsa_core.residency(s, rows) == 0.0  # sealed, freed
    np.testing.assert_array_equal(records(s), want)
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_ranges_and_row_sets_count_and_hold_their_union(tmp_path):
    s = create(tmp_path / "log", N, D, "log", **STORE["log"], slots=900)
    s = train(s, 10, batch=B)
    _on_disk(s)
    eng = s.store
    a = np.arange(200, 500, 2)  # 150 rows, 50 of them inside [0, 300)
    b = np.arange(400, 700)  # 300 rows, 50 of them in a
    dsa_core.load_range(s, 0, 300)
    dsa_core.load_rows(s, a)
    dsa_core.load_rows(s, b, wait=True)
    union = np.union1d(np.union1d(np.arange(300), a), b)
    assert eng._pool.pinned_with() == union.shape[0] == _stats(s)["range_pinned"] == 650
    assert dsa_core.residency(s, union) == 1.0
    dsa_core.release_range(s, 0, 300)  # the rows of a in it stay
    assert dsa_core.residency(s, a) == 1.0
    assert dsa_core.residency(s, np.setdiff1d(np.arange(300), a)) == 0.0
    dsa_core.release_rows(s, a[:10])  # inside a set, not a whole one: no set ends
    assert dsa_core.residency(s, a) == 1.0 and _stats(s)["range_pinned"] == 400
    dsa_core.release_rows(s, a[::-1])  # a ends (any order); its rows in b stay
    assert dsa_core.residency(s, b) == 1.0
    assert dsa_core.residency(s, np.setdiff1d(a, b)) == 0.0
    assert _stats(s)["range_pinned"] == 300
    dsa_core.load_rows(s, b)  # the same set twice: two releases
    dsa_core.release_rows(s, b)
    assert dsa_core.residency(s, b) == 1.0 and _stats(s)["range_pinned"] == 300
    dsa_core.release_rows(s, b)
    assert _stats(s)["range_pinned"] == 0 and dsa_core.residency(s, b) == 0.0
    assert eng.check_index() == []
    dsa_core.close(s)


def test_a_row_set_that_cannot_fit_is_refused_and_changes_nothing(tmp_path, store_digest):
    s = create(tmp_path / "log", N, D, "log", **STORE["log"], slots=500)
    s = train(s, 5, batch=B)
    dsa_core.flush(s)
    dsa_core.load_range(s, 0, 200)
    first = np.arange(1000, 3000, 10)  # 200 rows
    dsa_core.load_rows(s, first, wait=True)
    before, st, files = records(s), _stats(s), store_digest(tmp_path / "log")
    rows = np.arange(100, 3000, 29)  # 100 rows, 10 of them loaded already: 490 in all
    with pytest.raises(ValueError) as e:
        dsa_core.load_rows(s, rows)  # 490 pinned + a batch of 64 > 500
    msg = str(e.value)
    covered = np.union1d(np.union1d(np.arange(200), first), rows).shape[0]
    assert covered == 490
    for part in (f"load_rows of {rows.shape[0]} rows", f"cover {covered} rows",
                 "room for 64 more", "holds 500 rows", "Nothing was changed",
                 "dsa_core.release_rows", f"memory={log_memory(LAYOUT, covered + 64)}",
                 "dsa_core.buckets.fit"):
        assert part in msg, (part, msg)
    np.testing.assert_array_equal(records(s), before)
    assert _stats(s) == st and store_digest(tmp_path / "log") == files
    assert len(s.store._pool.row_sets) == 1
    dsa_core.release_rows(s, first)
    dsa_core.load_rows(s, rows, wait=True)  # fits once the first set is released
    assert dsa_core.residency(s, rows) == 1.0
    dsa_core.close(s)


def test_a_step_waits_for_the_row_load_it_needs(tmp_path):
    """A step that misses rows of a set still loading installs that load first: it reads
    none of them itself (``misses``)."""
    s = create(tmp_path / "log", N, D, "log", **STORE["log"], slots=1500)
    s = train(s, 30, batch=B)
    _on_disk(s)
    rows = np.sort(np.random.default_rng(6).choice(N, 1000, replace=False))
    m = _stats(s)["misses"]
    dsa_core.load_rows(s, rows)  # not waited for
    s = dsa_core.step(s, rows[::10], np.ones((100, D), np.float32))
    assert _stats(s)["misses"] == m
    assert dsa_core.residency(s, rows) == 1.0
    dsa_core.close(s)


def test_a_read_only_store_reads_row_sets_ahead_and_releases_nothing(tmp_path, kind):
    s = create(tmp_path / "s", N, D, kind, **STORE[kind], slots=600)
    s = train(s, 10, batch=B)
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "s", mode="r")
    want = records(r)
    dsa_core.load_rows(r, [3, 2000, 7], wait=True)
    dsa_core.release_rows(r, [3, 2000, 7], wait=True)
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


# -- kill -9 while a row load is in flight ----------------------------------------------------
_SCRIPT = """
import os, signal, numpy as np, dsa_core
N, D, B = {N}, {D}, {B}
kind, durability = {kind!r}, {durability!r}
rng = np.random.default_rng(0)
kw = dict(storage="log", memory=dsa_core.region_memory(
    {{"num_rows": N, "stride": 3 * D, "dtype": "float32"}}, {slots})) if kind == "log" else \\
    dict(storage="inplace", access="disk")
s = dsa_core.create({path!r}, N, D, init="normal", durability=durability, **kw)
def steps(s, n, rows):
    for _ in range(n):
        s = dsa_core.step(s, rng.choice(rows, B),
                          rng.standard_normal((B, D)).astype(np.float32))
    return s
s = steps(s, 30, np.arange(N))
dsa_core.release_range(s, 0, N, wait=True)
dsa_core.flush(s)
np.save({flushed!r}, dsa_core.read_records(s, np.arange(N)))
a = np.arange(0, N, 7)
dsa_core.load_rows(s, a)
stepped = kind == "log" or durability == "step"  # an in-place store stepped since its last
if stepped:                                      # flush is refused at open (an unclean stop)
    s = steps(s, 13, a[:3000])  # (they wait for the load)
dsa_core.release_rows(s, a)
np.save({live!r}, dsa_core.read_records(s, np.arange(N)))
dsa_core.load_rows(s, np.arange(3, N, 5))  # scattered, mostly never written: in flight
print("loaded", s.count, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("durability", ["flush", "step"])
def test_kill_9_with_a_row_load_in_flight(tmp_path, kind, durability):
    """``durability="flush"``: exactly the last flush; ``"step"``: exactly the last step."""
    n, slots = 200_000, 45_000  # rows enough for the last load to take a while
    script = textwrap.dedent(_SCRIPT.format(
        N=n, D=D, B=B, kind=kind, durability=durability, path=str(tmp_path / "s"),
        slots=slots, flushed=str(tmp_path / "flushed.npy"), live=str(tmp_path / "live.npy")))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    stepped = kind == "log" or durability == "step"
    live = 43 if stepped else 30
    assert proc.stdout.split() == ["loaded", str(live)]
    lay = {"num_rows": n, "stride": 3 * D, "dtype": "float32"}
    kw = {"memory": log_memory(lay, slots)} if kind == "log" else {}
    s = dsa_core.open(tmp_path / "s", **kw)
    got, count = dsa_core.read_records(s, np.arange(n)), s.count
    if kind == "log":
        assert s.store.check_index() == []
    dsa_core.close(s)
    if durability == "flush":
        assert count == 30
        np.testing.assert_array_equal(got, np.load(tmp_path / "flushed.npy"))
    else:
        assert count == live
        np.testing.assert_array_equal(got, np.load(tmp_path / "live.npy"))
    if stepped:  # the steps since the flush changed rows: the two states differ
        assert not np.array_equal(np.load(tmp_path / "flushed.npy"),
                                  np.load(tmp_path / "live.npy"))


def test_the_store_keeps_its_own_copy_of_a_loaded_set(tmp_path):
    """A caller that reuses its array after ``load_rows`` changes nothing the store holds."""
    s = create(tmp_path / "log", N, D, "log", **STORE["log"], slots=900)
    rows = np.arange(100, 400, dtype=np.int64)  # sorted, unique, int64: taken as it is
    dsa_core.load_rows(s, rows, wait=True)
    rows[:] = np.arange(1000, 1300)  # the caller's buffer, refilled
    dsa_core.release_rows(s, np.arange(100, 400))  # the set loaded is the one released
    assert _stats(s)["range_pinned"] == 0 and s.store._pool.row_sets == []
    assert s.store.check_index() == []
    dsa_core.close(s)
