"""durability="step" on log-structured stores: every step committed to a commit log.

Parity: the same records as durability="flush" (bit for bit), through evictions, seals, the
log's own flushes and simulated crashes. Failures: a failed append leaves the State usable at
the old count with nothing of the step visible, and the failed step is never replayed.
Crashes: a forked trainer killed at chosen points and at random moments reopens at exactly
its last completed step (or the step in flight, once its entry is in the log).
"""

from __future__ import annotations

import errno
import json
import os
import signal
import struct
import time

import numpy as np
import pytest
from helpers import PARITY, PARITY_D as D, PARITY_LAYOUT as LAYOUT, PARITY_N as N
from helpers import assert_same_store, log_memory, parity_batches, parity_init, records

import dsa_core
from dsa_core._files import json_checksum
from dsa_core._log import format as _log_format
from dsa_core._log import wal as _log_wal
from dsa_core.__main__ import main as cli

SMALL = log_memory(LAYOUT, 72)  # a region of 72 slots for the float32 layout
BOUND = 5 * 4096  # log bytes: a batch's entry is one or two pages, so the log flushes often


def _memory(state, rows=72):
    return log_memory(state.layout, rows)


def _abandon(state) -> None:
    """What ``kill -9`` leaves of the writer of ``state``: its files as they are (page cache
    included), no flush, the lock released."""
    state.store.abandon()


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _pair(tmp_path, weights=True, **kw):
    """A durability='flush' and a durability='step' log store, same init, small regions."""
    dt = kw.get("dtype", "float32")
    init = parity_init(dt, scale=0.05 if kw.get("curvature", 0) else 0.1) if weights else None
    a = dsa_core.create(tmp_path / "flush", N, D, init=init, storage="log", memory="1MiB",
                        weights=weights, **kw)
    mem = _memory(a)
    dsa_core.close(a)
    a = dsa_core.open(tmp_path / "flush", memory=mem)
    b = dsa_core.create(tmp_path / "step", N, D, init=init, storage="log", memory=mem,
                        weights=weights, durability="step", **kw)
    b.store._commit.wal_bound = BOUND
    return a, b


def _reopen(state, mem):
    """Simulate a crash of ``state``'s writer and reopen the store (the log is replayed)."""
    _abandon(state)
    s = dsa_core.open(state.path, memory=mem)
    s.store._commit.wal_bound = BOUND
    return s


@pytest.mark.parametrize("name", ["float32", "bf16m_decoupled_missed_rowstep", "poincare64",
                                  "rowwise", "skip_row", "maximize"])
def test_step_durability_is_bit_identical_to_flush(tmp_path, name):
    kw = dict(PARITY[name])
    a, b = _pair(tmp_path, **kw)
    assert b.durability == "step" and a.durability == "flush"
    mem = _memory(a)
    for k, (idx, g) in enumerate(parity_batches(a.dtype, nan_every=7 if "skip_row" in name else 0)):
        lr = None if k % 5 else 0.02
        a = dsa_core.step(a, idx, g, lr=lr)
        b = dsa_core.step(b, idx, g, lr=lr)
        if k in (17, 41):  # a crash: the reopened store replays its log
            b = _reopen(b, mem)
            assert_same_store(a, b)
    assert_same_store(a, b)
    eng = b.store
    assert eng.log_stats()["seals"] > 0 and eng.check_index() == []
    assert 0 < _manifest(b.path)["count"] < b.count  # the log flushed itself on the way
    assert eng._commit.wal_bytes() <= BOUND
    final = records(a)
    dsa_core.close(a)
    dsa_core.close(b)
    r = dsa_core.open(tmp_path / "step", mode="r")
    assert r.durability == "step" and r.count == a.count
    np.testing.assert_array_equal(records(r).view(np.uint8), final.view(np.uint8))
    dsa_core.close(r)


@pytest.mark.parametrize("how", ["params", "table"])
def test_weights_false_step_durability_is_bit_identical(tmp_path, how):
    a, b = _pair(tmp_path, weights=False)
    Wa = parity_init()
    Wb = Wa.copy()
    for k, (idx, g) in enumerate(parity_batches(np.float32)):
        if how == "params":
            pa, pb = Wa[idx], Wb[idx]
            a = dsa_core.step(a, idx, g, params=pa)
            b = dsa_core.step(b, idx, g, params=pb)
            Wa[idx], Wb[idx] = pa, pb
        else:
            a = dsa_core.step(a, idx, g, table=Wa)
            b = dsa_core.step(b, idx, g, table=Wb)
        if k == 30:
            b = _reopen(b, _memory(a))
    np.testing.assert_array_equal(Wa, Wb)
    assert_same_store(a, b)
    dsa_core.close(a)
    dsa_core.close(b)


def test_every_completed_step_survives_a_crash_and_a_reader_sees_it(tmp_path, store_digest):
    _, b = _pair(tmp_path)
    b.store._commit.wal_bound = 1 << 30  # no flush of its own: everything stays in the log
    live = {0: records(b)}
    for idx, g in parity_batches(np.float32, steps=9):
        b = dsa_core.step(b, idx, g)
        live[b.count] = records(b)
    b = dsa_core.step(b, np.array([], np.int64), np.zeros((0, D), np.float32))  # counts too
    assert _manifest(b.path)["count"] == 0 and b.count == 10
    _abandon(b)
    before = store_digest(b.path)
    r = dsa_core.open(b.path, mode="r")  # replays into its own memory, writes nothing
    assert r.count == 10 and r.durability == "step"
    np.testing.assert_array_equal(records(r), live[9])
    assert r.store.check_index() == []
    dsa_core.close(r)
    assert store_digest(b.path) == before
    s = dsa_core.open(b.path, memory=SMALL)
    assert s.count == 10 and _manifest(s.path)["count"] == 10  # replayed, then flushed
    np.testing.assert_array_equal(records(s), live[9])
    dsa_core.close(s)


def _fail(monkeypatch, what):
    """Make the commit log's next write (half of the entry written) or sync fail."""
    real = getattr(os, what)

    def boom(fd, *args):
        if what == "pwritev":
            bufs, off = args
            os.pwrite(fd, b"".join(bytes(b) for b in bufs)[:200], off)
        else:
            real(fd)  # the whole entry reached the file; its sync reports an error
        raise OSError(errno.EIO, "injected I/O error")

    monkeypatch.setattr(os, what, boom)


@pytest.mark.parametrize("what", ["pwritev", "fdatasync"])
@pytest.mark.parametrize("weights", [True, False])
def test_a_failed_append_changes_nothing_and_training_goes_on(tmp_path, monkeypatch, what,
                                                              weights):
    a, b = _pair(tmp_path, weights=weights)
    Wa = parity_init()
    Wb = Wa.copy()
    kw_a, kw_b = ({}, {}) if weights else ({"table": Wa}, {"table": Wb})
    batches = list(parity_batches(np.float32, steps=14))
    for idx, g in batches[:6]:
        a = dsa_core.step(a, idx, g, **kw_a)
        b = dsa_core.step(b, idx, g, **kw_b)
    before, W_before = records(b), Wb.copy()
    _fail(monkeypatch, what)
    with pytest.raises(OSError, match="injected"):
        dsa_core.step(b, *batches[6], **kw_b)
    monkeypatch.undo()
    assert b.current and b.count == 6
    np.testing.assert_array_equal(records(b), before)  # nothing of the step is visible
    np.testing.assert_array_equal(Wb, W_before)          # the caller's table is restored
    for idx, g in batches[6:]:  # the next steps give exactly the crash-free result
        a = dsa_core.step(a, idx, g, **kw_a)
        b = dsa_core.step(b, idx, g, **kw_b)
    assert_same_store(a, b)
    np.testing.assert_array_equal(Wa, Wb)
    b = _reopen(b, _memory(a))
    assert_same_store(a, b)
    dsa_core.close(a)
    dsa_core.close(b)


@pytest.mark.parametrize("what", ["pwritev", "fdatasync"])
def test_a_failed_step_is_never_replayed(tmp_path, monkeypatch, what):
    """Even when the failed entry reached the file whole (only its sync failed), a crash
    right after the failure reopens at the old count."""
    _, b = _pair(tmp_path)
    batches = list(parity_batches(np.float32, steps=5))
    for idx, g in batches[:4]:
        b = dsa_core.step(b, idx, g)
    before = records(b)
    _fail(monkeypatch, what)
    with pytest.raises(OSError, match="injected"):
        dsa_core.step(b, *batches[4])
    monkeypatch.undo()
    s = _reopen(b, SMALL)
    assert s.count == 4
    np.testing.assert_array_equal(records(s), before)
    dsa_core.close(s)


def test_a_kernel_error_changes_nothing(tmp_path):
    _, b = _pair(tmp_path, weights=False)
    W = parity_init()
    b = dsa_core.step(b, [1, 2], np.ones((2, D), np.float32), table=W)
    before, W_before = records(b), W.copy()
    bad = W[:, :3].copy()  # a params array of the wrong shape fails before any change
    with pytest.raises(ValueError, match="params must be"):
        dsa_core.step(b, [1, 2], np.ones((2, D), np.float32), params=bad)
    assert b.current and b.count == 1
    np.testing.assert_array_equal(records(b), before)
    np.testing.assert_array_equal(W, W_before)
    dsa_core.close(b)


def test_switching_durability_with_replace(tmp_path):
    """A flush-mode log store stepped through ``_replace(durability="step")`` starts a
    commit log (flushing first the steps it had not logged); back to "flush", the next flush
    drops the log."""
    ref, b = _pair(tmp_path)
    dsa_core.close(b)
    batches = list(parity_batches(np.float32, steps=12))
    for idx, g in batches[:3]:
        ref = dsa_core.step(ref, idx, g)
    c = dsa_core.create(tmp_path / "c", N, D, init=parity_init(), storage="log", memory=SMALL)
    for idx, g in batches[:3]:
        c = dsa_core.step(c, idx, g)
    assert _manifest(c.path).get("wal") is None and c.durability == "flush"
    c = c._replace(durability="step")
    for idx, g in batches[3:6]:
        c = dsa_core.step(c, idx, g)
        ref = dsa_core.step(ref, idx, g)
    m = _manifest(c.path)
    assert m["wal"] and m["version"] == 7 and m["count"] == 3  # flushed before step 4
    assert m["meta"]["durability"] == "step"
    c = _reopen(c, SMALL)
    assert c.count == 6 and c.durability == "step"
    assert_same_store(ref, c)
    c = c._replace(durability="flush")
    for idx, g in batches[6:]:
        c = dsa_core.step(c, idx, g)
        ref = dsa_core.step(ref, idx, g)
    dsa_core.flush(c)
    m = _manifest(c.path)
    assert m["wal"] is None and m["version"] == 7 and m["meta"]["durability"] == "flush"
    assert not list(c.path.glob("wal-*"))
    assert_same_store(ref, c)
    dsa_core.close(c)
    dsa_core.close(ref)


def test_unlogged_writes_are_flushed_before_the_next_logged_step(tmp_path):
    """write_records changes rows without a step: the next logged step flushes first, so
    that a replay never lays logged steps over a state that lacks the write."""
    _, b = _pair(tmp_path)
    b.store._commit.wal_bound = 1 << 30
    b = dsa_core.step(b, [1, 2], np.ones((2, D), np.float32))
    rec = np.full((1, 3 * D), 0.25, np.float32)
    dsa_core.write_records(b, [7], rec)
    b = dsa_core.step(b, [1, 3], np.ones((2, D), np.float32))
    live = records(b)
    assert _manifest(b.path)["count"] == 1
    s = _reopen(b, SMALL)
    assert s.count == 2
    np.testing.assert_array_equal(records(s), live)
    np.testing.assert_array_equal(dsa_core.read_records(s, [7]), rec)
    dsa_core.close(s)


def test_hyperparameters_of_a_logged_step_are_committed(tmp_path):
    _, b = _pair(tmp_path)
    b = dsa_core.step(b, [1], np.ones((1, D), np.float32))
    b = b._replace(lr=0.5)
    b = dsa_core.step(b, [2], np.ones((1, D), np.float32))
    s = _reopen(b, SMALL)
    assert s.count == 2 and s.lr == 0.5
    dsa_core.close(s)


def test_checkpoint_and_convert_of_a_step_store(tmp_path):
    a, b = _pair(tmp_path)
    batches = list(parity_batches(np.float32, steps=10))
    for idx, g in batches[:5]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.checkpoint(b, tmp_path / "ck")
    assert _manifest(tmp_path / "ck")["wal"] is None  # flushed: the snapshot needs no log
    assert not list((tmp_path / "ck").glob("wal-*"))
    c = dsa_core.open(tmp_path / "ck", memory=SMALL)
    assert c.durability == "step" and c.count == 5
    d = dsa_core.convert(b, tmp_path / "inplace", storage="inplace")
    assert d.durability == "step" and d.storage == "inplace"
    for idx, g in batches[5:]:
        a = dsa_core.step(a, idx, g)
        c = dsa_core.step(c, idx, g)
        d = dsa_core.step(d, idx, g)
    c = _reopen(c, SMALL)
    assert_same_store(a, c)
    assert_same_store(a, d)
    for s in (a, b, c, d):
        dsa_core.close(s)


def test_commit_log_files_garbage_and_reuse(tmp_path):
    _, b = _pair(tmp_path)
    path = b.path
    for idx, g in parity_batches(np.float32, steps=30):  # several log generations (BOUND)
        b = dsa_core.step(b, idx, g)
    m = _manifest(path)
    gen = _log_format.parse_name(m["wal"])[1]
    spare = _log_wal.wal_name(gen + 1)  # the retired log, kept for the next generation
    assert sorted(p.name for p in path.glob("wal-*")) == sorted([m["wal"], spare])
    junk = _log_wal.wal_name(gen + 50)
    (path / junk).write_bytes(b"left by a crash")
    _abandon(b)
    r = dsa_core.open(path, mode="r")
    assert (path / junk).exists()  # a reader removes nothing
    dsa_core.close(r)
    s = dsa_core.open(path, memory=SMALL)
    assert not (path / junk).exists()
    names = {p.name for p in path.glob("wal-*")}
    m2 = _manifest(path)
    assert m2["wal"] in names and len(names) <= 2
    dsa_core.close(s)


def test_damaged_commit_log_names_are_clear_errors(tmp_path):
    _, b = _pair(tmp_path)
    b = dsa_core.step(b, [1], np.ones((1, D), np.float32))
    _abandon(b)
    m = _manifest(b.path)
    (b.path / m["wal"]).rename(b.path / "moved.log")
    with pytest.raises(FileNotFoundError, match="commit log .* is missing"):
        dsa_core.open(b.path, memory=SMALL)
    (b.path / "moved.log").rename(b.path / m["wal"])
    m["wal"] = "journal.txt"
    m["checksum"] = json_checksum(m)  # a consistent manifest that names a wrong file
    (b.path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="names the commit log 'journal.txt'"):
        dsa_core.open(b.path, memory=SMALL)


def test_cli_shows_the_logged_count(tmp_path, capsys):
    _, b = _pair(tmp_path)
    b.store._commit.wal_bound = 1 << 30
    for idx, g in parity_batches(np.float32, steps=4):
        b = dsa_core.step(b, idx, g)
    assert cli(["info", str(b.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["count"] == 4 and info["durability"] == "step"
    assert cli(["verify", str(b.path), "--quiet"]) == 0
    assert "count 4" in capsys.readouterr().out
    dsa_core.close(b)


# -- kill -9 of a trainer ------------------------------------------------------------------------
KILL_STEPS = 40


def _kill_child(path, point, nth, report):
    """Forked: open the store (replaying its log), train to KILL_STEPS with dsa_core.step,
    report every completed count on the pipe, flush every 15 steps. Never returns."""
    code = 1
    try:
        if point is not None:
            _log_format.set_crash(point, nth)
        s = dsa_core.open(path, memory=SMALL)
        s.store._commit.wal_bound = BOUND
        batches = list(parity_batches(np.float32, steps=KILL_STEPS, seed=9))
        for idx, g in batches[s.count:]:
            s = dsa_core.step(s, idx, g, lr=0.01 * (1 + s.count % 3))
            os.write(report, struct.pack("<q", s.count))
            if s.count % 15 == 0:
                dsa_core.flush(s)
        dsa_core.close(s)
        code = 0
    except BaseException:  # noqa: BLE001 - report and leave; never return into pytest
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def test_kill_9_during_logged_steps_reopens_the_last_completed_step(tmp_path):
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    init = parity_init()
    ref = dsa_core.create(tmp_path / "ref", N, D, init=init, storage="log", memory=SMALL)
    refs = {0: records(ref)}
    for idx, g in parity_batches(np.float32, steps=KILL_STEPS, seed=9):
        ref = dsa_core.step(ref, idx, g, lr=0.01 * (1 + ref.count % 3))
        refs[ref.count] = records(ref)
    dsa_core.close(ref)
    path = tmp_path / "s"
    dsa_core.close(dsa_core.create(path, N, D, init=init, storage="log", memory=SMALL,
                                   durability="step"))
    rng = np.random.default_rng(5)
    points = ["wal-append", "wal-payload", "wal-written", "wal-synced", "wal-started",
              "wal-retired", "flush-committed", "seal-header", "wal-replayed", None, None]
    count, kills, in_flight = 0, 0, 0
    for trial in range(18):
        point = points[trial % len(points)]
        nth = int(rng.integers(1, 4))
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            _kill_child(path, point, nth, w)
        os.close(w)
        if point is None:
            time.sleep(float(rng.uniform(0.0, 0.3)))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        raw = b""
        while chunk := os.read(r, 4096):
            raw += chunk
        os.close(r)
        done = list(struct.unpack(f"<{len(raw) // 8}q", raw))
        assert done == list(range(count + 1, count + 1 + len(done)))
        last = done[-1] if done else count
        killed = os.WIFSIGNALED(status)
        kills += killed
        what = f"trial {trial}: {point}:{nth}, from {count}, completed up to {last}"
        if not killed:
            assert os.WEXITSTATUS(status) == 0, what
        rd = dsa_core.open(path, mode="r")
        got = rd.count
        if point in ("wal-written", "wal-synced") and killed:
            assert got == last + 1, what  # its entry was in the file: committed
        elif not killed or (point is not None and not point.startswith("seal-")):
            assert got == last, what
        else:  # a timed kill, or a seal's point hit by the background writer thread: at
            # any moment of the main thread, so also between a step's return and its report
            assert got in (last, last + 1), what
        in_flight += got == last + 1
        np.testing.assert_array_equal(records(rd).view(np.uint8), refs[got].view(np.uint8),
                                      err_msg=what)
        dsa_core.close(rd)
        if trial % 2:  # else the next child replays the log (and may be killed doing so)
            s = dsa_core.open(path, memory=SMALL)
            assert s.count == got
            np.testing.assert_array_equal(records(s), refs[got], err_msg=what)
            assert s.store.check_index() == []
            dsa_core.close(s)
        count = got
        if count == KILL_STEPS:
            dsa_core.remove(path)
            dsa_core.close(dsa_core.create(path, N, D, init=init, storage="log",
                                           memory=SMALL, durability="step"))
            count = 0
    assert kills >= 10 and in_flight >= 2
