"""The one background worker (``dsa_core._os.Worker``) that every engine thread is made of:
order, back-pressure, join, close that drains or drops, an error handed over once, fork.

Its users (the log store's writer, read-ahead, range loads and unmapper; the in-place
store's read-ahead lanes and range requests) are tested with their stores; the last tests
here check the fork and exit paths through the stores of both kinds.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from helpers import REPO, create, train, wait_forked

import dsa_core
from dsa_core._os import Worker


def _recorder(**kw):
    """A worker that appends its items to a list (``gate``: each item waits for it)."""
    got: list = []
    gate = kw.pop("gate", None)

    def run(item):
        if gate is not None:
            gate.wait(10)
        got.append(item)

    return Worker("dsa-test", run, **kw), got


def test_items_run_in_order_on_one_named_daemon_thread():
    names = []
    w = Worker("dsa-test-order", lambda item: names.append((item,
                                                           threading.current_thread().name)))
    assert w.thread.name == "dsa-test-order" and w.thread.daemon and w.thread.is_alive()
    for i in range(100):
        w.submit(i)
    w.join()
    assert names == [(i, "dsa-test-order") for i in range(100)]
    w.close()
    assert not w.thread.is_alive() and w.stopping


@pytest.mark.parametrize("simple", [False, True])
def test_the_queue_kind(simple):
    w, got = _recorder(simple=simple)
    assert isinstance(w._q, queue.SimpleQueue if simple else queue.Queue)
    w.submit("a")
    w.join()
    assert got == ["a"]
    w.close()


def test_a_bounded_queue_makes_submit_wait():
    gate = threading.Event()
    w, got = _recorder(maxsize=2, gate=gate)
    w.submit(0)  # taken by the thread, which waits at the gate
    deadline = time.monotonic() + 10
    while w._q.qsize() and time.monotonic() < deadline:
        time.sleep(0.001)
    w.submit(1)
    w.submit(2)  # the queue is full now
    late = threading.Thread(target=w.submit, args=(3,))
    late.start()
    late.join(0.2)
    assert late.is_alive()  # back-pressure: waits for room
    gate.set()
    late.join(10)
    w.join()
    assert got == [0, 1, 2, 3]
    w.close()


def test_close_runs_what_is_queued_first():
    gate = threading.Event()
    w, got = _recorder(gate=gate)
    for i in range(5):
        w.submit(i)
    threading.Timer(0.1, gate.set).start()
    w.close()
    assert got == [0, 1, 2, 3, 4] and not w.thread.is_alive()


def test_close_drop_drops_what_is_queued_and_ends_the_running_item_early():
    started, dropped, exits = threading.Event(), [], []
    seen = []

    def run(item):
        started.set()
        while not w.stopping:  # a long item that checks ``stopping``
            time.sleep(0.001)
        seen.append(item)

    w = Worker("dsa-test-drop", run, on_drop=dropped.append,
               on_exit=lambda: exits.append(threading.current_thread().name))
    for i in range(4):
        w.submit(i)
    assert started.wait(10)
    w.close(drop=True)
    assert seen == [0] and dropped == [1, 2, 3]
    assert exits == ["dsa-test-drop"]  # on the thread, as it ends


@pytest.mark.parametrize("drop", [False, True])
def test_close_without_waiting_then_close_again(drop):
    """A stop that does not wait (a store's finalizer), then the close that waits (the
    store's ``close``): the second waits for the first's stop, whatever it drops."""
    gate, dropped = threading.Event(), []
    w, got = _recorder(gate=gate, on_drop=dropped.append)
    w.submit(1)
    w.submit(2)
    deadline = time.monotonic() + 10
    while w._q.qsize() > 1 and time.monotonic() < deadline:
        time.sleep(0.001)  # 1 is running
    w.close(drop=drop, wait=False)
    assert w.thread.is_alive()  # still running its item
    gate.set()
    w.close(drop=drop)  # waits only
    w.close(drop=drop)  # and again: nothing
    assert not w.thread.is_alive()
    assert (got, dropped) == (([1], [2]) if drop else ([1, 2], []))
    w.submit(3)  # after a close: never runs, and nothing waits for it
    w.join()
    assert 3 not in got


def test_close_from_the_thread_itself_does_not_wait_for_itself():
    done = threading.Event()

    def run(item):
        w.close()  # e.g. a store's finalizer run by a collection on this thread
        done.set()

    w = Worker("dsa-test-self", run)
    w.submit(1)
    assert done.wait(10)
    w.thread.join(10)
    assert not w.thread.is_alive()


def test_an_error_is_kept_and_handed_over_once():
    def run(item):
        if item in (2, 3):
            raise OSError(5, f"item {item} failed")
        got.append(item)

    got: list = []
    w = Worker("dsa-test-error", run)
    for i in range(5):
        w.submit(i)
    with pytest.raises(OSError, match="item 2 failed"):  # the first, not the second
        w.join()
    assert got == [0, 1, 4]  # the thread went on
    w.join()  # handed over once
    assert w.error() is None
    w.submit(3)  # fails again: kept until taken
    deadline = time.monotonic() + 10
    while w._error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    item, exc = w.error()
    assert item == 3 and "item 3 failed" in str(exc)
    assert w.error() is None
    w.raise_error()  # nothing left
    w.close()


def test_join_returns_once_the_thread_is_gone():
    w, got = _recorder()
    w.close()
    w.join()  # nothing would take a marker: returns
    w.raise_error()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_neither_joins_nor_closes_the_parents_worker():
    """The parent's thread is not in a forked child: there ``join`` and ``close`` return at
    once (they would wait for ever), and the parent's worker goes on."""
    gate = threading.Event()
    w, got = _recorder(gate=gate)
    w.submit(1)  # running, waits at the gate: the child would wait for it forever
    w.submit(2)
    assert not w.forked
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            ok = w.forked and not w.thread.is_alive()
            w.join()
            w.close()
            w.close(drop=True)
            code = 0 if ok and w.error() is None else 2
        finally:
            os._exit(code)
    assert wait_forked(pid, 30, "the forked child waited for its parent's worker") == 0
    gate.set()
    w.submit(3)
    w.join()
    assert got == [1, 2, 3] and w.thread.is_alive()
    w.close()


def test_a_worker_never_keeps_the_interpreter_alive():
    """A daemon thread: a process that exits with an item still running and more queued
    (a forgotten close) ends at once."""
    code = ("import time; from dsa_core._os import Worker\n"
            "w = Worker('dsa-test-exit', lambda item: time.sleep(60))\n"
            "w.submit(1); w.submit(2); print('left')\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)},
                       check=False)
    assert r.returncode == 0 and r.stdout.strip() == "left", r.stderr
    assert time.monotonic() - t0 < 30


# -- through the stores ------------------------------------------------------------------------
N, D = 400, 8


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("kind", ["inplace", "log"])
def test_a_forked_child_prefetches_on_threads_of_its_own(tmp_path, kind):
    """A store's read-ahead thread (the log store's ``dsa-log-readahead``, the in-place
    store's ``dsa-prefetch`` lane) started in the parent is not in a forked child: the
    child's prefetch makes its own, and waiting for it does not hang."""
    s = create(tmp_path / "s", N, D, kind, slots=N // 2)
    s = train(s, 6, batch=40, seed=1)
    dsa_core.prefetch(s, np.arange(0, N, 3), wait=True)
    names = {t.name for t in threading.enumerate()}
    assert ("dsa-log-readahead" if kind == "log" else "dsa-prefetch") in names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            for _ in range(8):  # more than the queue holds
                dsa_core.prefetch(s, np.arange(0, N, 5))
            dsa_core.prefetch(s, np.arange(N), wait=True)
            code = 0
        finally:
            os._exit(code)
    assert wait_forked(pid, 60, "the forked child hung on its parent's read-ahead thread") == 0
    dsa_core.prefetch(s, np.arange(N), wait=True)  # the parent's thread goes on
    dsa_core.close(s)


@pytest.mark.parametrize("kind", ["inplace", "log"])
def test_a_store_closed_stops_its_threads(tmp_path, kind):
    """Every engine thread a store started (read-ahead, range loads, writer) ends with its
    ``close``; the threads are the named daemons the tools look for."""
    before = set(threading.enumerate())
    s = create(tmp_path / "s", N, D, kind, slots=N // 2)
    s = train(s, 5, batch=40, seed=2)
    dsa_core.prefetch(s, np.arange(0, N, 3), wait=True)
    dsa_core.load_range(s, 0, N // 4, wait=True)
    dsa_core.release_range(s, 0, N // 4, wait=True)
    dsa_core.wait_ranges(s)
    mine = [t for t in set(threading.enumerate()) - before if t.name.startswith("dsa-")
            and not t.name.startswith("dsa-worker-")]  # the kernels' pool: not a store's
    want = {"dsa-log-readahead", "dsa-log-range-load"} if kind == "log" else \
        {"dsa-prefetch", "dsa-ranges"}
    assert want <= {t.name for t in mine} and all(t.daemon for t in mine)
    dsa_core.close(s)
    ended = [t for t in mine if t.name != "dsa-log-unmap"]  # the unmapper serves them all
    for t in ended:
        t.join(10)
    assert not [t.name for t in ended if t.is_alive()]
