"""A store stopped between a step and the next flush reopens exactly at that flush, or is
refused; never silently mixed.

With ``durability="flush"`` an in-place store's rows reach its file whenever the kernel writes
the mapped pages back, so after ``kill -9`` they may hold steps past the manifest's count. Its
header's unclean marker (set durably before the first row of a flush interval changes,
cleared by the flush) says so, and its undo file (the old record of each row changed in the
interval, in the page cache) puts the rows back at the last flush when the next open runs on
the same boot: both kinds reopen exactly at their last flush after a process dies. After a
reboot (simulated here by another boot id: ``rebooted``) the undo file is not trusted and
``open`` refuses the store (``UncleanStopError``) unless told ``unclean="accept"``; ``dsa
verify`` reports it. A log store reopens exactly at its last flush either way.

The kill trials run ``tests/crash_worker.py flushk`` (flush every K steps) in a subprocess,
SIGKILL it at random moments and compare what reopens, bit for bit, with a replay of that
many steps. A few trials by default, more with ``-m slow``. A kill cannot lose the page
cache: these tests see what the next process sees after ``kill -9`` or an OOM kill.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import crash_worker as cw
import numpy as np
import pytest
from crash_server import CrashServer
from helpers import KINDS, run_worker

import dsa_core
import dsa_core.__main__ as dsa_cli
from dsa_core._inplace import undo as undo_file

REPO = Path(__file__).resolve().parents[2]
N, D = cw.NUM_ROWS, cw.DIM

INIT = (np.random.default_rng(3).standard_normal((N, D)) * 0.1).astype(np.float32)


def make_store(path: Path, kind: str, **kw) -> None:
    """A closed store at count 0 (an init array: the same records in both kinds)."""
    dsa_core.close(dsa_core.create(path, N, D, lr=cw.LR, init=INIT, storage=kind,
                                   progress=False, **kw))


def all_records(state) -> bytes:
    return dsa_core.read_records(state, np.arange(N)).tobytes()


class Reference:
    """The records after ``count`` steps of crash_worker.batch without any crash."""

    def __init__(self, root: Path, kind: str, **kw):
        self.root, self.kind, self.made, self.kw = root, kind, 0, kw
        self.state = None

    def at(self, count: int) -> bytes:
        if self.state is None or self.state.count > count:
            if self.state is not None:
                dsa_core.close(self.state)
            self.made += 1
            path = self.root / f"ref{self.made}"
            make_store(path, self.kind, **self.kw)
            self.state = dsa_core.open(path)
        while self.state.count < count:
            self.state = dsa_core.step(self.state, *cw.batch(self.state.count + 1))
        return all_records(self.state)

    def close(self):
        if self.state is not None:
            dsa_core.close(self.state)


def manifest_count(path: Path) -> int:
    return json.loads((path / "manifest.json").read_text())["count"]


def dsa(*args) -> subprocess.CompletedProcess:
    """``python -m dsa_core ARGS`` run in this process (the CLI's ``main``: the same code
    without an interpreter that imports dsa_core and numba per call; tests/cli runs the
    command itself): its exit status and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = dsa_cli.main([str(a) for a in args])
    return subprocess.CompletedProcess(["dsa", *args], rc, out.getvalue(), "")


def verify(path: Path) -> subprocess.CompletedProcess:
    return dsa("verify", path, "--quiet")


@pytest.fixture
def rebooted(monkeypatch):
    """The machine restarted since the files were written (another boot id): an undo file
    kept in the page cache is then not trusted, as after a power cut."""
    monkeypatch.setattr(undo_file, "boot_id", lambda: "another-boot")


def is_marked(path: Path) -> bool:
    """The data file's unclean marker is set (a writer changed rows since its last flush);
    False for a log store (no such file)."""
    if not (path / "rows.dsa").is_file():
        return False
    with open(path / "rows.dsa", "rb") as f:
        f.seek(4096 - 8)
        return f.read(8) == b"DSAUNCLN"


def check_refused(path: Path, count: int) -> None:
    """``open`` refuses the store in both modes with the message the user needs."""
    for mode in ("r+", "r"):
        with pytest.raises(dsa_core.UncleanStopError) as e:
            dsa_core.open(path, mode=mode)
        msg = str(e.value)
        for words in (f"stepped after its last flush (count {count}", "kill -9",
                      "dsa_core.restore", "unclean='accept'"):
            assert words in msg, (words, msg)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The workers that end by SIGKILL or os._exit, forked from one warm interpreter
    (tests/crash_server.py); a normal interpreter exit runs a real one (helpers.run_worker)."""
    srv = CrashServer(tmp_path_factory.mktemp("crash_runs"))
    yield srv
    srv.close()


def kill_trials(server, tmp: Path, kind: str, trials: int, seed: int, every: int = 7,
                window: float = 0.3, probe_every: int = 0, reboot=None) -> Counter:
    """SIGKILL a worker that flushes every ``every`` steps at a random moment; the store must
    reopen exactly at its last flush (a multiple of ``every``, at least the last flush the
    worker reported), or, after ``reboot`` (a monkeypatch: the boot id changes before the
    reopen), be refused; never at a count with rows of later steps."""
    rng = np.random.default_rng(seed)
    ref = Reference(tmp, kind)
    stats = Counter()
    try:
        for k in range(trials):
            store = tmp / f"s{k}"
            make_store(store, kind)
            w = server.start("flushk", store, "--every", every)
            assert w.expect("open") == 0
            time.sleep(rng.uniform(0.0, window))
            lines = w.kill()
            reported = max([int(x[1]) for x in lines if x[0] == "flush"], default=0)
            stats["steps flushed"] += reported
            if kind == "inplace" and is_marked(store):
                stats["killed inside an interval"] += 1
            if reboot is not None:
                reboot.setattr(undo_file, "boot_id", lambda: "another-boot")
            try:
                s = dsa_core.open(store)
            except dsa_core.UncleanStopError:
                assert kind == "inplace", "a log store reopens at its last flush"
                count = manifest_count(store)
                assert count % every == 0 and count >= reported, (count, reported)
                check_refused(store, count)
                stats["refused"] += 1
                if probe_every and k % probe_every == 0:
                    r = verify(store)
                    assert r.returncode == 1 and "unclean stop" in r.stdout, r.stdout
                    s = dsa_core.open(store, unclean="accept")  # the rows as they are
                    assert s.count == count and s.store.unclean
                    mixed = all_records(s) != ref.at(count)
                    stats["accepted rows that differ from the replay"] += mixed
                    dsa_core.close(s)  # flushes: the mark is cleared
                    if reboot is not None:
                        reboot.undo()
                    s = dsa_core.open(store)
                    assert s.count == count and not s.store.unclean
                    dsa_core.close(s)
                    assert verify(store).returncode == 0
                    stats["verified and accepted"] += 1
                if reboot is not None:
                    reboot.undo()
                shutil.rmtree(store)
                continue
            finally:
                if reboot is not None:
                    reboot.undo()
            count = s.count
            assert count % every == 0 and count >= reported, (count, reported)
            assert all_records(s) == ref.at(count), (
                f"trial {k}: the {kind} store reopened at count {count} with rows that differ "
                "from the replay of that many steps (a silent mix)")
            dsa_core.close(s)
            stats["exact at the last flush"] += 1
            shutil.rmtree(store)
    finally:
        ref.close()
    stats["trials"] = trials
    return stats


# -- random kills ------------------------------------------------------------------------------
def test_sigkill_reopens_exact_few(server, tmp_path, kind):
    """A process death is no power cut: both kinds reopen exactly at the last flush."""
    stats = kill_trials(server, tmp_path, kind, trials=3, seed=1 + KINDS.index(kind))
    print(f"\n{kind}: {dict(stats)}")
    assert stats["steps flushed"] > 0  # the kills landed while the worker trained
    assert stats["exact at the last flush"] == 3
    if kind == "inplace":  # a kill lands inside a flush interval nearly always
        assert stats["killed inside an interval"] >= 1


def test_sigkill_then_reboot_reopens_exact_or_refused_few(server, tmp_path, kind, monkeypatch):
    stats = kill_trials(server, tmp_path, kind, trials=3, seed=1 + KINDS.index(kind),
                        probe_every=2, reboot=monkeypatch)
    print(f"\n{kind}: {dict(stats)}")
    if kind == "log":
        assert stats["exact at the last flush"] == 3
    else:
        assert stats["refused"] >= 1 and stats["verified and accepted"] >= 1


@pytest.mark.slow
def test_sigkill_reopens_exact_many(server, tmp_path, kind):
    stats = kill_trials(server, tmp_path, kind, trials=30, seed=10 + KINDS.index(kind),
                        window=0.5)
    print(f"\n{kind}: {dict(stats)}")
    assert stats["exact at the last flush"] == 30
    if kind == "inplace":
        assert stats["killed inside an interval"] >= 20


@pytest.mark.slow
def test_sigkill_then_reboot_reopens_exact_or_refused_many(server, tmp_path, kind, monkeypatch):
    stats = kill_trials(server, tmp_path, kind, trials=30, seed=10 + KINDS.index(kind),
                        window=0.5, probe_every=5, reboot=monkeypatch)
    print(f"\n{kind}: {dict(stats)}")
    if kind == "log":
        assert stats["exact at the last flush"] == 30
    else:
        assert stats["refused"] >= 20
        # what the refusal protects against: the accepted rows were mixed
        assert stats["accepted rows that differ from the replay"] >= 1


# -- deterministic ends ------------------------------------------------------------------------
@pytest.mark.parametrize(("end", "optimizer"), [
    pytest.param("kill", "adam", marks=pytest.mark.slow), ("os_exit", "adam"),
    ("sigterm", "adam"), ("kill", "adagrad"), ("kill", "rowwise_adagrad")])
def test_stop_after_steps_past_a_flush(server, tmp_path, kind, end, optimizer):
    """Steps 1..10, a flush at 7, then SIGKILL, SIGTERM or os._exit: exact at 7, both
    kinds; the undo file is emptied by the recovery. (SIGKILL at random moments by default:
    the trials above.) These ends skip every exit handler: a child forked by the server
    stops as a process of its own would. The Adagrad layouts (docs/algorithms.md §7.5) are
    killed too: the recovery is the engines', which know no optimizer."""
    store = tmp_path / "s"
    make_store(store, kind, optimizer=optimizer)
    rc, lines, err = server.run("flushk", store, "--every", 7, "--steps", 10, "--end", end)
    want = {"kill": -signal.SIGKILL, "sigterm": -signal.SIGTERM, "os_exit": 0}[end]
    assert rc == want, err
    assert lines[-2:] == [["flush", "7"], ["done", "10"]]
    assert is_marked(store) == (kind == "inplace")
    assert verify(store).returncode == 0  # recoverable on this boot: no problem
    ref = Reference(tmp_path, kind, optimizer=optimizer)
    try:
        r = dsa_core.open(store, mode="r")  # a reader puts the rows back in its own copy
        assert r.count == 7 and all_records(r) == ref.at(7)
        dsa_core.close(r)
        assert is_marked(store) == (kind == "inplace")  # the reader changed no file
        s = dsa_core.open(store)
        assert s.count == 7 and all_records(s) == ref.at(7)
        assert not getattr(s.store, "unclean", False)
        for t in range(8, 11):  # trains on to the same rows as the run without a stop
            s = dsa_core.step(s, *cw.batch(t))
        assert all_records(s) == ref.at(10)
        dsa_core.close(s)
        assert not is_marked(store)
        if kind == "inplace":
            assert (store / "undo.dsa").stat().st_size == 0  # a clean close empties it
    finally:
        ref.close()


@pytest.mark.parametrize("end", [pytest.param("kill", marks=pytest.mark.slow), "os_exit"])
def test_stop_after_steps_past_a_flush_then_reboot(server, tmp_path, kind, end, monkeypatch):
    """As above, but the machine restarted before the reopen: exact at 7 (log), or refused
    (in place: its undo file lived in the page cache)."""
    store = tmp_path / "s"
    make_store(store, kind)
    rc, lines, err = server.run("flushk", store, "--every", 7, "--steps", 10, "--end", end)
    assert rc == (-signal.SIGKILL if end == "kill" else 0), err
    assert lines[-2:] == [["flush", "7"], ["done", "10"]]
    monkeypatch.setattr(undo_file, "boot_id", lambda: "another-boot")
    ref = Reference(tmp_path, kind)
    try:
        if kind == "inplace":
            check_refused(store, 7)
            r = verify(store)
            assert r.returncode == 1, r.stdout
            assert "unclean stop: the manifest says count 7" in r.stdout
            info = dsa("info", "--json", store)
            assert info.returncode == 0
            assert json.loads(info.stdout)["unclean_stop"] is True
            s = dsa_core.open(store, unclean="accept")
            assert s.count == 7 and s.store.unclean
            assert all_records(s) != ref.at(7)  # the rows of steps 8..10 are in the file
            assert all_records(s) == ref.at(10)  # (a kill loses no page-cache page)
        else:
            assert verify(store).returncode == 0
            s = dsa_core.open(store, unclean="accept")  # accepted, and means nothing here
            assert s.count == 7 and all_records(s) == ref.at(7)
        # training on from the accepted rows; the next flush clears the mark
        for t in range(s.count + 1, s.count + 4):
            s = dsa_core.step(s, *cw.batch(t))
        dsa_core.flush(s)
        assert not getattr(s.store, "unclean", False)
        again = dsa_core.open(store, mode="r")
        assert again.count == s.count
        dsa_core.close(again)
        dsa_core.close(s)
        assert verify(store).returncode == 0
    finally:
        ref.close()


@pytest.mark.parametrize("end, status", [("exit", 0), ("sigterm_exit", 143)])
def test_normal_exit_without_close_reopens_at_the_last_step(tmp_path, kind, end, status):
    """A forgotten close is no unclean stop: the store is flushed at interpreter exit; so is
    it after SIGTERM with the docs' recipe for a final flush (a handler calling sys.exit)."""
    store = tmp_path / "s"
    make_store(store, kind)
    rc, lines, err = run_worker("flushk", store, "--every", 7, "--steps", 10, "--end", end)
    assert rc == status, err
    assert err == ""  # no failure printed by the exit-time flush
    assert lines[-1] == ["done", "10"]
    s = dsa_core.open(store)
    ref = Reference(tmp_path, kind)
    assert s.count == 10 and all_records(s) == ref.at(10)
    dsa_core.close(s)
    ref.close()
    assert verify(store).returncode == 0


def test_garbage_collected_state_is_flushed_and_released(tmp_path, kind):
    store = tmp_path / "s"
    make_store(store, kind)
    s = dsa_core.open(store)
    for t in range(1, 6):
        s = dsa_core.step(s, *cw.batch(t))
    del s
    gc.collect()
    s = dsa_core.open(store)  # the writer lock was released with the last State
    ref = Reference(tmp_path, kind)
    assert s.count == 5 and all_records(s) == ref.at(5)
    dsa_core.close(s)
    ref.close()


FORK_SCRIPT = """
import os, sys
sys.path.insert(0, sys.argv[2])
import crash_worker as cw, dsa_core
s = dsa_core.open(sys.argv[1])
s = dsa_core.step(s, *cw.batch(1))
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child exits normally: exit handlers run, the store's finalizer too
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status), flush=True)
os._exit(0)  # the parent stops uncleanly
"""


def test_forked_child_never_flushes_the_parents_store(tmp_path, monkeypatch):
    store = tmp_path / "s"
    make_store(store, "inplace")
    r = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(store), str(REPO / "tests")],
                       capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0 and r.stdout == "child 0\n", r.stderr
    assert r.stderr == ""
    assert manifest_count(store) == 0  # the child wrote no manifest and cleared no mark
    assert is_marked(store) and (store / "undo.dsa").stat().st_size > 0  # nor emptied the undo
    snapshot_files(store, tmp_path / "copy")
    monkeypatch.setattr(undo_file, "boot_id", lambda: "another-boot")
    check_refused(tmp_path / "copy", 0)
    monkeypatch.undo()
    s = dsa_core.open(store)  # the parent's step undone: the rows of count 0
    assert s.count == 0 and all_records(s) == INIT_RECORDS(tmp_path)
    dsa_core.close(s)


# -- the marker in process (a copy of a live store's files is what a kill leaves) ---------------
def snapshot_files(src: Path, dest: Path) -> Path:
    """The files of a live store as a kill -9 would leave them (page cache included)."""
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("writer.lock"))
    return dest


def INIT_RECORDS(tmp: Path) -> bytes:
    """The records of a new store (count 0)."""
    make_store(tmp / "init", "inplace")
    s = dsa_core.open(tmp / "init", mode="r")
    out = all_records(s)
    dsa_core.close(s)
    return out


def test_create_open_flush_and_close_leave_clean_stores(tmp_path, monkeypatch):
    s = dsa_core.create(tmp_path / "s", N, D, init="normal", progress=False)
    dsa_core.close(dsa_core.open(snapshot_files(s.path, tmp_path / "c0")))  # after create
    s = dsa_core.step(s, *cw.batch(1))
    dsa_core.flush(s)
    at1 = all_records(s)
    dsa_core.close(dsa_core.open(snapshot_files(s.path, tmp_path / "c1")))  # after a flush
    s = dsa_core.step(s, np.zeros(0, np.int64), np.zeros((0, D), np.float32))  # no row
    dsa_core.close(dsa_core.open(snapshot_files(s.path, tmp_path / "c2")))
    s = dsa_core.step(s, *cw.batch(3))
    snapshot_files(s.path, tmp_path / "c3")
    snapshot_files(s.path, tmp_path / "c4")
    c3 = dsa_core.open(tmp_path / "c3")  # the same boot: back at the flush, exactly
    assert c3.count == 1 and all_records(c3) == at1 != all_records(s)
    dsa_core.close(c3)
    monkeypatch.setattr(undo_file, "boot_id", lambda: "another-boot")
    check_refused(tmp_path / "c4", 1)  # after a reboot: refused
    monkeypatch.undo()
    ro = dsa_core.open(s.path, mode="r")  # a reader beside the live writer: no stop
    dsa_core.close(ro)
    dsa_core.close(s)
    again = dsa_core.open(tmp_path / "s")
    assert again.count == 3
    dsa_core.close(again)


def test_whole_record_writes_mark_the_store(tmp_path, monkeypatch):
    """write_records, restore and set_exp_avg change rows outside a step: a stop before the
    flush that follows them is an unclean stop too, undone on the same boot."""
    s = dsa_core.create(tmp_path / "s", N, D, progress=False, init="normal")
    at0 = all_records(s)
    dsa_core.write_records(s, [3], np.ones((1, s.layout["stride"]), np.float32))
    snapshot_files(s.path, tmp_path / "c0")
    s.set_exp_avg(np.full((N, D), 0.5, np.float32))
    snapshot_files(s.path, tmp_path / "c1")
    snapshot_files(s.path, tmp_path / "c2")
    for c in ("c0", "c1"):
        back = dsa_core.open(tmp_path / c)
        assert back.count == 0 and all_records(back) == at0
        dsa_core.close(back)
    monkeypatch.setattr(undo_file, "boot_id", lambda: "another-boot")
    check_refused(tmp_path / "c2", 0)
    monkeypatch.undo()
    s = dsa_core.set_count(s, 0)  # flushes
    dsa_core.close(dsa_core.open(snapshot_files(s.path, tmp_path / "c3")))
    dsa_core.close(s)


def test_the_marker_costs_one_fdatasync_per_flush_interval(tmp_path, monkeypatch):
    s = dsa_core.create(tmp_path / "s", N, D, progress=False)
    calls = []
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append(fd), real(fd))[1])
    per_step = []
    for t in range(1, 16):
        before = len(calls)
        s = dsa_core.step(s, *cw.batch(t))
        per_step.append(len(calls) - before)
        if t % 5 == 0:
            dsa_core.flush(s)
    monkeypatch.undo()
    dsa_core.close(s)
    assert per_step == [1, 0, 0, 0, 0] * 3


def test_journaled_stores_keep_their_own_recovery(tmp_path):
    """durability='step' commits every step: never marked, reopens exactly after a kill."""
    s = dsa_core.create(tmp_path / "s", N, D, durability="step", progress=False)
    for t in range(1, 4):
        s = dsa_core.step(s, *cw.batch(t))
    copy = dsa_core.open(snapshot_files(s.path, tmp_path / "c"))
    assert copy.count == 3 and all_records(copy) == all_records(s)
    dsa_core.close(copy)
    dsa_core.close(s)


def test_unclean_argument_is_checked(tmp_path):
    make_store(tmp_path / "s", "inplace")
    with pytest.raises(ValueError, match="unclean must be one of"):
        dsa_core.open(tmp_path / "s", unclean="ignore")


@pytest.mark.parametrize("how", ["direct", "buffered", "direct_refused_at_write"])
def test_undo_file_either_write_path(tmp_path, monkeypatch, how):
    """The undo file is written with O_DIRECT where the filesystem takes it, else through
    the page cache (a filesystem without O_DIRECT, or one that opens it and refuses its
    writes): either way a stop is put back exactly at the last flush."""
    monkeypatch.setattr(undo_file, "DIRECT_MIN_BYTES", 0)  # a small table, as a large one
    if how == "buffered":
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    elif how == "direct_refused_at_write":
        real = os.pwrite

        def pwrite(fd, data, off):
            if fcntl_flags(fd) & getattr(os, "O_DIRECT", 0):
                raise OSError(22, "Invalid argument (injected: O_DIRECT refused)")
            return real(fd, data, off)
        monkeypatch.setattr(undo_file.os, "pwrite", pwrite)
    s = dsa_core.create(tmp_path / "s", N, D, progress=False, init="normal")
    for t in range(1, 4):
        s = dsa_core.step(s, *cw.batch(t))
    dsa_core.flush(s)
    at3 = all_records(s)
    for t in range(4, 9):  # batches that share rows: each row saved once per interval
        s = dsa_core.step(s, *cw.batch(t))
    undo = s.store._f.undo
    assert undo.direct == (how == "direct"), (how, undo.direct)
    copy = snapshot_files(s.path, tmp_path / "copy")
    back = dsa_core.open(copy)
    assert back.count == 3 and all_records(back) == at3
    dsa_core.close(back)
    dsa_core.close(s)


def fcntl_flags(fd: int) -> int:
    import fcntl
    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_large_interval_does_not_keep_its_undo_blocks(tmp_path, monkeypatch):
    """An O_DIRECT undo file keeps its blocks between intervals, but not the blocks of a
    one-off large interval (a pass over every row): two intervals later the file is back to
    what the small intervals use, and a stop is still put back exactly at the last flush."""
    monkeypatch.setattr(undo_file, "DIRECT_MIN_BYTES", 0)  # a small table, as a large one
    monkeypatch.setattr(undo_file, "TRIM_MIN_BYTES", 8 * undo_file.PAGE)
    s = dsa_core.create(tmp_path / "s", N, D, progress=False, init="normal")
    ids = np.arange(N, dtype=np.int64)
    s = dsa_core.step(s, ids, np.ones((N, D), np.float32))  # every row: a large interval
    big = os.path.getsize(s.path / undo_file.UNDO_FILE)
    for t in range(2, 5):  # three small intervals
        dsa_core.flush(s)
        s = dsa_core.step(s, *cw.batch(t))
    small = os.path.getsize(s.path / undo_file.UNDO_FILE)
    if not s.store._f.undo.direct:
        pytest.skip("this filesystem refuses O_DIRECT: the file is emptied at every interval")
    assert small <= max(8 * undo_file.PAGE, big // 4), (small, big)
    dsa_core.flush(s)
    at = all_records(s)
    s = dsa_core.step(s, *cw.batch(9))
    copy = snapshot_files(s.path, tmp_path / "copy")
    back = dsa_core.open(copy)
    assert back.count == 4 and all_records(back) == at
    dsa_core.close(back)
    dsa_core.close(s)
