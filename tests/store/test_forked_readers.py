"""Readers in processes forked from a store's writer never silently see older rows.

A forked child (a data-loader worker, a ``multiprocessing`` worker with the "fork" start
method) inherits the parent's open store. An in-place store's rows are a shared mapping of its
file: the child reads the rows as the parent changes them. A log store's current rows live in
the parent's memory region, of which the child holds a copy as of the fork: once the parent has
changed rows, every read in the child (``gather``, ``read_records``, ``convert``) raises
``dsa_core.ForkedReadError`` instead of returning the older rows; while the parent has changed
none (evaluation workers forked after training), the child reads them. Real forks, both kinds.
"""

from __future__ import annotations

import multiprocessing
import os
import traceback

import numpy as np
import pytest
from helpers import log_kw, log_memory, train

import dsa_core

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

N, D, B = 300, 8, 40


def _trained(path, kind: str, steps: int = 12, **kw):
    """A store trained ``steps`` steps; a log store with a small region (its rows are spread
    over the region and segments that the seals cleaned)."""
    s = dsa_core.create(path, N, D, init="normal", seed=2, **log_kw(kind), **kw)
    if kind == "log":
        dsa_core.close(s)
        s = dsa_core.open(path, memory=log_memory(s, 2 * B))
    return train(s, steps, batch=B, seed=0, unique=True)


def _fork(child) -> tuple[int, int]:
    """Fork a child that waits for a byte on a pipe, then runs ``child()`` and exits with its
    return value (1 on an exception, printed). Returns ``(pid, write end of the pipe)``."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(w)
            os.read(r, 1)
            code = child()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(r)
    return pid, w


def _finish(pid: int, w: int) -> int:
    """Let the child run; its exit code."""
    os.write(w, b"x")
    os.close(w)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.parametrize("change", ["step", "write_records", "logged step"])
def test_a_forked_reader_sees_the_current_rows_or_refuses(tmp_path, kind, change):
    """The parent changes rows after the fork (a step, ``write_records``, a step of a
    ``durability="step"`` store) and flushes; the child then reads. In place: the current
    rows. Log: a ``ForkedReadError`` that says why and what to do, from every read; and the
    way out it names works (open ``mode="r"`` in the child: the parent's last flush)."""
    kw = {"durability": "step"} if change == "logged step" else {}
    s = _trained(tmp_path / "s", kind, **kw)
    ids = np.arange(N)

    def child():  # the parent's current rows come in files (this process's memory is old)
        weights, records = (np.load(tmp_path / f"{n}.npy") for n in ("weights", "records"))
        if kind == "inplace":
            ok = np.array_equal(dsa_core.gather(s, ids), weights)
            return 0 if ok and np.array_equal(dsa_core.read_records(s, ids), records) else 2
        for read in (lambda: dsa_core.gather(s, ids), lambda: dsa_core.gather(s, [0]),
                     lambda: dsa_core.read_records(s, ids[5:9]),
                     lambda: dsa_core.convert(s, tmp_path / "copy", storage="inplace")):
            with pytest.raises(dsa_core.ForkedReadError) as e:
                read()
            msg = str(e.value)
            assert "forked" in msg and "changed rows" in msg and "mode='r'" in msg, msg
            assert "storage='inplace'" in msg and str(tmp_path / "s") in msg, msg
        r = dsa_core.open(tmp_path / "s", mode="r")
        ok = np.array_equal(dsa_core.read_records(r, ids), records)
        dsa_core.close(r)
        return 0 if ok else 3

    pid, w = _fork(child)
    before = dsa_core.read_records(s, ids)
    if change == "write_records":
        rec = dsa_core.read_records(s, ids[:7])
        rec[:, :D] += 1.0
        dsa_core.write_records(s, ids[:7], rec)
    else:
        s = train(s, 1, batch=B, seed=1, unique=True)
    dsa_core.flush(s)
    np.save(tmp_path / "weights.npy", dsa_core.gather(s, ids))
    np.save(tmp_path / "records.npy", dsa_core.read_records(s, ids))
    assert not np.array_equal(np.load(tmp_path / "records.npy"), before)  # rows changed
    assert _finish(pid, w) == 0
    dsa_core.close(s)


def test_a_forked_reader_reads_while_the_parent_changes_no_rows(tmp_path, kind):
    """Evaluation workers forked after training (and a flush): while the parent flushes,
    reads, prefetches and loads and releases a range, changing no row, the child reads the
    current rows, whole or in pieces, from the region and the segments."""
    s = _trained(tmp_path / "s", kind, steps=30)
    dsa_core.flush(s)
    ids = np.arange(N)
    want = dsa_core.read_records(s, ids)

    def child():
        ok = np.array_equal(dsa_core.read_records(s, ids), want)
        ok &= np.array_equal(dsa_core.gather(s, ids[::-1]), want[::-1, :D])
        return 0 if ok else 2

    pid, w = _fork(child)
    dsa_core.flush(s)
    dsa_core.gather(s, ids)
    dsa_core.prefetch(s, ids[:B])
    dsa_core.load_range(s, 0, B, wait=True)
    dsa_core.release_range(s, 0, B)
    assert _finish(pid, w) == 0
    dsa_core.close(s)


def test_a_forked_reader_refuses_once_the_parent_rewrites_a_segment_file(tmp_path):
    """Log: forked with rows still dirty, the parent then seals them (flush, a range's
    release) without changing a value, and its cleaning overwrites dead segment files that
    the child's copy of the index still points into. The child reads the current rows or
    refuses with ``ForkedReadError``, never anything else (the overwritten records used to
    fail their checksums in the child: a SegmentError blaming the disk)."""
    s = _trained(tmp_path / "s", "log", steps=30)
    ids = np.arange(N)
    want = dsa_core.read_records(s, ids)

    def child():
        try:
            ok = np.array_equal(dsa_core.read_records(s, ids), want)
        except dsa_core.ForkedReadError:
            return 0
        return 4 if ok else 2

    pid, w = _fork(child)
    segs = s.store._segments
    recycled = segs.recycled
    dsa_core.flush(s)
    dsa_core.load_range(s, 0, B, wait=True)
    dsa_core.release_range(s, 0, B)
    assert segs.recycled > recycled, "no segment file was overwritten: nothing tested"
    assert _finish(pid, w) == 0
    np.testing.assert_array_equal(dsa_core.read_records(s, ids), want)
    dsa_core.close(s)


def _mp_read(state, ids, out):
    """A ``multiprocessing`` worker: gather ``ids``, or the error's type name."""
    try:
        out.put(dsa_core.gather(state, ids))
    except Exception as exc:  # noqa: BLE001 - handed to the parent to check
        out.put(type(exc).__name__ + ": " + str(exc))


def test_a_multiprocessing_fork_worker(tmp_path, kind):
    """A ``multiprocessing`` "fork" worker started before a step reads after it: the current
    rows (in place) or ``ForkedReadError`` (log); one started after the step reads them."""
    ctx = multiprocessing.get_context("fork")
    s = _trained(tmp_path / "s", kind)
    ids = np.arange(N)
    q, go = ctx.Queue(), ctx.Event()

    def late_read(state, ids, out):
        go.wait(30)
        _mp_read(state, ids, out)

    p = ctx.Process(target=late_read, args=(s, ids, q))
    p.start()
    s = train(s, 1, batch=B, seed=1, unique=True)
    go.set()
    got = q.get(timeout=30)
    p.join(30)
    if kind == "inplace":
        np.testing.assert_array_equal(got, dsa_core.gather(s, ids))
    else:
        assert isinstance(got, str) and got.startswith("ForkedReadError"), got
    p = ctx.Process(target=_mp_read, args=(s, ids, q))  # forked after the step
    p.start()
    got = q.get(timeout=30)
    p.join(30)
    np.testing.assert_array_equal(got, dsa_core.gather(s, ids))
    dsa_core.close(s)
