"""A full or failing disk, on both kinds and without root: faults injected at the OS layer.

``helpers.os_fault`` makes one write or sync call of ``dsa_core._os`` (``pwrite_all``,
``pwritev_all``, ``fsync_path``, ``fsync_fd``, ``fdatasync_fd``: every ``pwrite``,
``pwritev``, ``fsync`` and ``fdatasync`` of the package goes through them) fail from its
``nth`` call on -- ENOSPC, EIO, or a short write (half the bytes written, then ENOSPC; on a
sync, EIO) -- until the fault is removed, as a full disk stays full until space is freed. A
counting pass finds which files each call reaches during a step, a flush and a checkpoint
of each kind and durability (segments, the index, the commit log and its header, manifests,
the checkpoint's data file, directories; in place the data file's unclean marker and its
syncs, the undo journal and the undo file), and a trial then makes the first call to each
of them fail. Every trial checks that

* the operation raises an ``OSError`` of that errno, whose message says what failed --
  except for two writes that no commit waits for, whose failure is not raised: the unclean
  marker's clear after a flush's manifest (a lost clear; the flush stood) and, with
  ``durability="flush"``, the undo file (the interval goes on without undo);
* the store's directory reopens (as after a ``kill -9`` right then: ``helpers.on_disk``)
  exactly at its last commit -- the last flush, or with ``durability="step"`` the last step
  that returned -- bit for bit; an ``InDoubtError`` (the directory sync after a manifest's
  rename failed) at the commit it was making; after a failed undo file write, there or
  refusing with an ``UncleanStopError`` that names the undo (a stop in an interval without
  undo is refused, docs/storage.md), never at a wrong count or with mixed rows;
* a failed checkpoint leaves no checkpoint, or a complete one, and no temporary files;
* once the fault is gone, the same State steps on, flushes and checkpoints, and ends with
  the records of a run that met no fault.

The sweeps run in a tmpfs (``/dev/shm``, where syncs cost nothing: on a disk they take most
of the time); ``-m slow`` runs them on the disk too, where the checkpoint's copy reads with
``O_DIRECT`` (a tmpfs refuses it). The sweeps start with the in-place unclean marker set
(the store was stepped since its flush): setting it, before the first change after a
flush, has a test of its own. The real small-filesystem trials (root only) are in
test_reliability.py. Not reached here: the write-back of mapped pages (the in-place rows,
``msync`` and the kernel's own write-back, whose errors surface at the next sync), the
creation and growth of files (``posix_fallocate``, ``ftruncate``, ``copy_file_range``,
reflinks), renames, and the calls made when a store is created or opened (those run before
the operations swept here).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from dsa_core._files import InDoubtError
from helpers import (FAULTS, OS_SYNCS, OS_WRITES, assert_same_bits, batches, create, on_disk,
                     os_fault, records, train)

N, D, B = 400, 4, 40
SLOTS = 60  # a log store's region: far fewer slots than rows, so steps seal segments
FLUSHED, STEPPED, END = 5, 8, 11  # the last flush, the count before the operation, the end
BATCHES = batches(END, N, D, batch=B, seed=5)
OPS = ("step", "flush", "checkpoint")
DURABILITIES = ("flush", "step")


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    """The records after 0 .. END steps of a run that meets no fault."""
    with tempfile.TemporaryDirectory() as tmp:
        s = create(Path(tmp) / "ref", N, D)
        out = [records(s)]
        for idx, g in BATCHES:
            s = dsa_core.step(s, idx, g)
            out.append(records(s))
        dsa_core.close(s)
    return out


SHM = Path("/dev/shm")


@pytest.fixture(params=["tmpfs", pytest.param("disk", marks=pytest.mark.slow)])
def root(request, tmp_path):
    """Where the stores of a sweep live: a tmpfs where there is one, else (and with
    ``-m slow``, also) ``tmp_path``."""
    if request.param == "disk" or not (SHM.is_dir() and os.access(SHM, os.W_OK)):
        yield tmp_path
        return
    where = Path(tempfile.mkdtemp(prefix="dsa-faults-", dir=SHM))
    try:
        yield where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _label(name: str) -> str:
    """A write target without its numbers: ``seg-00000015.dsl`` -> ``seg-#.dsl``."""
    return re.sub(r"\d+", "#", name)


def _prepared(root: Path, kind: str, durability: str):
    """A store flushed at FLUSHED, then stepped to STEPPED."""
    s = train(create(root / "s", N, D, kind, slots=SLOTS, durability=durability),
              BATCHES[:FLUSHED])
    dsa_core.flush(s)
    return train(s, BATCHES[FLUSHED:STEPPED])


def _operate(got: list, op: str, root: Path) -> None:
    """The operation under the fault on the State ``got[0]``; ``got[0]`` is then the last
    State the caller got back (a step that raised returned none)."""
    if op == "step":
        while got[0].count < END:
            try:
                got[0] = dsa_core.step(got[0], *BATCHES[got[0].count])
            except InDoubtError as exc:  # past its commit point: the step stands
                got[0] = exc.state
                raise
    elif op == "flush":
        dsa_core.flush(got[0])
    else:
        dsa_core.checkpoint(got[0], root / "ck")


_TARGETS: dict = {}


def _targets(where: Path, kind: str, durability: str, op: str, call: str) -> dict:
    """{target: the number of the call that first reaches it} of ``call`` during ``op``
    (a counting pass on a store of its own; cached: the runs are deterministic)."""
    key = (kind, durability, op, call, where.is_relative_to(SHM))
    if key not in _TARGETS:
        where = where / "-".join(("count", *key[:4]))
        where.mkdir(parents=True)
        got = [_prepared(where, kind, durability)]
        with os_fault(call, None) as f:
            _operate(got, op, where)
        dsa_core.close(got[0])
        first: dict = {}
        for k, name in enumerate(f.seen, 1):
            first.setdefault(_label(name), k)
        _TARGETS[key] = first
    return _TARGETS[key]


def _trial(root: Path, kind: str, durability: str, op: str, call: str, nth: int, error: str,
           reference) -> str:
    """One fault (module docstring); returns the target that failed."""
    root.mkdir()
    got = [_prepared(root, kind, durability)]
    committed = STEPPED if durability == "step" else FLUSHED
    with os_fault(call, nth, error) as f:
        try:
            _operate(got, op, root)
        except OSError as exc:
            err = exc
        else:
            err = None
    assert f.failed, "the fault never struck"
    undo_only = set(f.failed) == {"undo.dsa"}
    if err is None:  # only a write that no commit waits for fails unraised (docstring)
        assert undo_only or (op == "flush" and f.failed == ["rows.dsa"]), (op, f.failed)
        if not undo_only:  # the marker's clear, past the flush's commit: the flush stood
            committed = STEPPED
    else:
        code = errno.EIO if error == "EIO" or (error == "short" and call in OS_SYNCS) \
            else errno.ENOSPC
        assert err.errno == code, err
        assert os.strerror(code) in str(err), err
    # the directory reopens at the last commit, bit for bit
    if op == "step" and durability == "step":
        committed = got[0].count
    making = STEPPED if op != "step" else committed + 1  # the commit being made
    try:
        count, recs = on_disk(root / "s", root / "disk")
    except dsa_core.UncleanStopError as exc:  # no undo for the interval: a stop is refused
        assert undo_only and "undo" in str(exc), exc
        count = None
    if count is not None:
        if isinstance(err, InDoubtError):  # a step's: the State it carries is at that step
            assert count == (committed if op == "step" else making), (count, committed,
                                                                       making)
        elif err is not None and op == "checkpoint":  # its flush may have committed
            assert count in (committed, STEPPED), count
        else:
            assert count == committed, (count, committed)
        assert_same_bits(recs, reference[count])
    # no checkpoint, or a complete one; no temporary file anywhere
    if (root / "ck").exists():
        ck = dsa_core.open(root / "ck", mode="r")
        assert ck.count == STEPPED
        assert_same_bits(records(ck), reference[STEPPED])
        dsa_core.close(ck)
    left = [p.name for p in [*root.iterdir(), *(root / "s").iterdir()] if ".tmp" in p.name]
    assert left == [], left
    # the fault is gone: the same State goes on to the end of a run that met none
    s = got[0]
    while s.count < END:
        s = dsa_core.step(s, *BATCHES[s.count])
    dsa_core.flush(s)
    dsa_core.checkpoint(s, root / "ck", overwrite=True)
    assert_same_bits(records(s), reference[END])
    dsa_core.close(s)
    for where in (root / "s", root / "ck"):
        count, recs = on_disk(where, root / "disk")
        assert count == END
        assert_same_bits(recs, reference[END])
    return f.failed[0]


# ENOSPC at every operation, EIO and a short write at a flush; the rest with -m slow
@pytest.mark.parametrize(("error", "op"), [
    pytest.param(e, o, marks=() if e == "ENOSPC" or o == "flush" else pytest.mark.slow)
    for e in FAULTS for o in OPS])
def test_a_fault_at_each_write_target(root, kind, op, error, reference):
    """Each target (file or directory) that a write call of the OS layer reaches during
    ``op``, for both durabilities: its first call fails (module docstring)."""
    hit = set()
    for durability in DURABILITIES:
        for call in OS_WRITES:
            if error == "short" and call in OS_SYNCS:
                continue
            for nth in _targets(root / "t", kind, durability, op, call).values():
                failed = _trial(root / f"{durability}-{call}-{nth}", kind, durability,
                                op, call, nth, error, reference)
                hit.add((durability, _label(failed)))
    # every operation met faults at both durabilities (an in-place step with
    # durability="flush" writes its undo file only: its rows reach the disk at the next
    # flush)
    assert {d for d, _ in hit} == set(DURABILITIES), hit


def test_a_full_disk_during_a_checkpoint_copy_raises_enospc(tmp_path):
    """The copy of a checkpoint (``O_DIRECT`` reads where the filesystem allows them) meets
    a full disk: ENOSPC, not the ``BufferError`` that closing its read buffer raised in its
    place while the failed write's traceback still held views of it."""
    from dsa_core import _files

    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(bytes(range(256)) * 64)
    with os_fault("pwrite_all", 1) as f, pytest.raises(OSError) as e:
        _files.copy_file(src, dst)
    assert f.failed == ["dst"]
    assert e.value.errno == errno.ENOSPC and type(e.value) is OSError, repr(e.value)


def test_journaled_step_in_doubt_keeps_its_rows(tmp_path, kind, reference):
    """``durability="step"``: the directory sync after a step's manifest was renamed in
    fails (an ``InDoubtError``: the step may be durable or not). The step stands: the
    directory reopens at its count with its rows, and the error carries the State at that
    step, from which the process goes on (a power cut that loses the rename would leave the
    count before with the rows before: the journal rolls them back on open)."""
    got = [_prepared(tmp_path, kind, "step")]
    before = got[0].count
    with os_fault("fsync_path", 1) as f:
        try:
            _operate(got, "step", tmp_path)
        except InDoubtError as exc:
            assert exc.state is got[0] and exc.states == [got[0]]
            assert "The step was taken" in str(exc) and f"(step {before + 1})" in str(exc)
    assert kind == "inplace" or f.seen == [], f.seen  # the log kind's steps sync no directory
    if kind == "inplace":
        assert got[0].count == before + 1 and got[0].current
    count, recs = on_disk(tmp_path / "s", tmp_path / "disk")
    assert count == got[0].count
    assert_same_bits(recs, reference[count])
    s = got[0]  # goes on from the State the error carried
    while s.count < END:
        s = dsa_core.step(s, *BATCHES[s.count])
    assert_same_bits(records(s), reference[END])
    dsa_core.close(s)
    assert_same_bits(on_disk(tmp_path / "s", tmp_path / "disk")[1], reference[END])


@pytest.mark.parametrize("error", FAULTS)
@pytest.mark.parametrize("call", ["pwrite_all", "fdatasync_fd"])
def test_a_fault_setting_the_unclean_marker(tmp_path, call, error):
    """``durability="flush"``, in place: the first step after a flush sets the unclean
    marker in ``rows.dsa`` (a write, then an fdatasync) before any row changes; the sweep
    above starts past it. Its write or its sync fails: the step raises an error naming the
    marker and the file, the directory reopens at the flush with its rows, and the same
    State steps on once the fault is gone."""
    s = train(create(tmp_path / "s", N, D), BATCHES[:FLUSHED])
    dsa_core.flush(s)
    want = records(s)
    c = train(create(tmp_path / "c", N, D), BATCHES[:FLUSHED])
    dsa_core.flush(c)
    with os_fault(call, None) as f:  # which call of the step reaches the data file
        c = dsa_core.step(c, *BATCHES[FLUSHED])
    dsa_core.close(c)
    nth = f.seen.index("rows.dsa") + 1
    with os_fault(call, nth, error) as f, pytest.raises(OSError) as e:
        dsa_core.step(s, *BATCHES[FLUSHED])
    assert f.failed == ["rows.dsa"]
    code = errno.EIO if error == "EIO" or (error == "short" and call in OS_SYNCS) \
        else errno.ENOSPC
    assert e.value.errno == code and os.strerror(code) in str(e.value), e.value
    assert "unclean marker" in str(e.value) and "rows.dsa" in str(e.value), e.value
    count, recs = on_disk(tmp_path / "s", tmp_path / "disk")
    assert count == FLUSHED
    assert_same_bits(recs, want)
    s = dsa_core.step(s, *BATCHES[FLUSHED])
    assert s.count == FLUSHED + 1
    dsa_core.close(s)
