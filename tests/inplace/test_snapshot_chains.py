"""Snapshots of an in-place store share disk: a base and forward deltas (issue 39).

A snapshot (``dsa_core.checkpoint``, the adapters' state dicts) of an in-place store on the
writer's last snapshot is a chain: ``base.dsa`` (a hard link to an earlier snapshot's data
file) and delta files of the rows changed since (``dsa_core/_inplace/snapshots.py``). Here:

* every snapshot of a chain opens read-only and restores to exactly the records the store had
  at its count, whichever path saw the changes (the undo file through the page cache or with
  O_DIRECT, journaled steps, ``write_records``, a restore), and together they take the table
  about once on disk;
* deleting, moving and copying snapshot directories leaves every other one whole;
* the rebase rule (a full copy when the deltas would outgrow the table), the merging of small
  deltas, and the full copy where the writer cannot know what changed (a new open, a writable
  view handed out, no undo file, the last snapshot changed or moved away);
* a damaged or missing chain file is refused at open, naming it, nothing changed;
  ``dsa verify`` reports it;
* a writer's open of a snapshot gives it a data file of its own (a chain materialized, a
  shared data file copied): the other snapshots never change; a kill -9 in the middle of
  that, or of writing a delta, leaves a whole snapshot and a live store at its last flush.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import crash_worker as cw
import numpy as np
import pytest
from crash_server import CrashServer
from helpers import assert_snapshot_files, records

import dsa_core
import dsa_core.__main__ as dsa_cli
from benchmarks._common import disk_bytes
from dsa_core import _files
from dsa_core._inplace import snapshots as snaps
from dsa_core._inplace import undo as undo_file

REPO = Path(__file__).resolve().parents[2]
N, D = 20_000, 8
INIT = (np.random.default_rng(5).standard_normal((N, D)) * 0.1).astype(np.float32)


def make(path: Path, **kw) -> dsa_core.State:
    return dsa_core.create(path, N, D, init=INIT, lr=0.01, storage="inplace", progress=False,
                           **kw)


def train(s: dsa_core.State, rng, steps: int = 3, batch: int = 60) -> dsa_core.State:
    """Steps on random rows, duplicates included."""
    for _ in range(steps):
        idx = rng.integers(0, N, batch)
        idx[: batch // 4] = idx[batch // 4: batch // 2]  # duplicates, coalesced by step
        s = dsa_core.step(s, idx, rng.standard_normal((batch, D)).astype(np.float32))
    return s


def chain_of(d: Path) -> dict | None:
    return json.loads((d / "manifest.json").read_text()).get("chain")


def assert_opens_as(d: Path, count: int, rec: np.ndarray) -> None:
    snap = dsa_core.open(d, mode="r")
    try:
        assert snap.count == count
        np.testing.assert_array_equal(records(snap).view(np.uint32), rec.view(np.uint32))
    finally:
        dsa_core.close(snap)


@pytest.fixture(autouse=True)
def no_reflink(monkeypatch):
    """The chain is what this file tests: no reflink, as on ext4, whatever the filesystem."""
    monkeypatch.setattr(_files, "reflink", lambda src, dst: False)


# -- a chain of snapshots -----------------------------------------------------------------------
@pytest.mark.parametrize("durability", ["flush", "step"])
@pytest.mark.parametrize("undo_direct", [False, True], ids=["undo-cached", "undo-direct"])
def test_each_snapshot_of_a_chain_opens_and_restores_exactly(tmp_path, monkeypatch,
                                                            undo_direct, durability):
    """Six snapshots taken between steps (and a flush, and a write_records, in between):
    the first a full copy, the next five chains; each opens read-only at its count with
    exactly the records the store had then, each restores them, and all six take little
    more disk than the table once. Below and above the undo file's O_DIRECT threshold."""
    if undo_direct:
        monkeypatch.setattr(undo_file, "DIRECT_MIN_BYTES", 0)
    rng = np.random.default_rng(1)
    s = make(tmp_path / "live", durability=durability)
    taken = []
    for i in range(6):
        s = train(s, rng)
        if i == 2:  # a flush between two snapshots: two undo intervals
            dsa_core.flush(s)
            s = train(s, rng, steps=2)
        if i == 3:  # a whole-record write, not a step
            idx = np.array([7, 11, 19_999])
            dsa_core.write_records(s, idx, np.full((3, s.layout["stride"]), 0.5, np.float32))
        d = dsa_core.checkpoint(s, tmp_path / f"snap{i}")
        taken.append((d, s.count, records(s)))
    assert [assert_snapshot_files(d) for d, _, _ in taken] == ["plain"] + ["chain"] * 5
    for d, count, rec in taken:
        assert_opens_as(d, count, rec)
    table = (tmp_path / "live" / "rows.dsa").stat().st_size
    assert disk_bytes(*(d for d, _, _ in taken)) < 1.3 * table
    for d, count, rec in reversed(taken):  # each restores the live store exactly
        snap = dsa_core.open(d, mode="r")
        s = dsa_core.restore(s, snap)
        dsa_core.close(snap)
        assert s.count == count
        np.testing.assert_array_equal(records(s).view(np.uint32), rec.view(np.uint32))
    dsa_core.close(s)


def test_deleting_moving_and_copying_snapshots_leaves_the_rest_whole(tmp_path):
    """Every snapshot directory holds its own links to its chain: the oldest (whose data
    file is the chain's base) and a middle one deleted, one moved, one copied elsewhere and
    one carried into a checkpoint folder (link_files) that is then moved and copied: every
    other snapshot still opens exactly."""
    rng = np.random.default_rng(2)
    s = make(tmp_path / "live")
    taken = {}
    for i in range(6):
        s = train(s, rng)
        d = dsa_core.checkpoint(s, tmp_path / "snaps" / f"s{i}")
        taken[d] = (s.count, records(s))
    dsa_core.close(s)
    sd = tmp_path / "snaps"
    dsa_core.remove(sd / "s0")        # the base's own directory (as the adapters prune)
    shutil.rmtree(sd / "s2")          # a middle one, by hand
    os.rename(sd / "s3", tmp_path / "moved")
    shutil.copytree(sd / "s4", tmp_path / "copied")
    shutil.rmtree(sd / "s4")
    ck = tmp_path / "ckpt"
    ck.mkdir()
    dsa_core.tools.link_files(sd / "s5", ck / "s5")
    dsa_core.remove(sd / "s5")
    os.rename(ck, tmp_path / "ckpt-moved")
    shutil.copytree(tmp_path / "ckpt-moved", tmp_path / "ckpt-copied")
    where = {"s1": sd / "s1", "s3": tmp_path / "moved", "s4": tmp_path / "copied",
             "s5": tmp_path / "ckpt-copied" / "s5"}
    for name, d in where.items():
        count, rec = taken[sd / name]
        assert_opens_as(d, count, rec)
    assert_opens_as(tmp_path / "ckpt-moved" / "s5", *taken[sd / "s5"])


def test_the_rebase_rule_and_merged_deltas(tmp_path):
    """A chain grows by one delta per snapshot up to MERGE_FROM deltas (the kept snapshots
    share them all); then a new delta takes in the newest ones no larger than it (40
    snapshots of one row each leave a few deltas), and at MAX_DELTAS the newest whatever its
    size (deltas that shrink: the chain stops at MAX_DELTAS). A delta that would make the
    chain's deltas larger than the table makes a full copy instead, the base of the chains
    after it. Every snapshot opens exactly."""
    rng = np.random.default_rng(3)
    s = make(tmp_path / "live")
    dsa_core.checkpoint(s, tmp_path / "c0")
    lengths = []
    for i in range(1, 41):
        s = dsa_core.step(s, [int(rng.integers(0, N))], np.ones((1, D), np.float32))
        last = dsa_core.checkpoint(s, tmp_path / f"c{i}")
        lengths.append(len(chain_of(last)["deltas"]))
    assert lengths[:snaps.MERGE_FROM] == list(range(1, snaps.MERGE_FROM + 1))
    assert lengths[snaps.MERGE_FROM] == 1 and max(lengths) <= 6, lengths  # all merged, then
    assert_opens_as(last, s.count, records(s))
    for i in range(1, 41, 7):
        count = json.loads((tmp_path / f"c{i}" / "manifest.json").read_text())["count"]
        assert count == i
    # shrinking deltas never merge by size: the chain grows to MAX_DELTAS, no further
    lengths = []
    for i in range(1, snaps.MAX_DELTAS + 4):
        rows = rng.choice(N, 200 - 5 * i, replace=False)
        s = dsa_core.step(s, rows, np.ones((rows.shape[0], D), np.float32))
        last = dsa_core.checkpoint(s, tmp_path / f"d{i}")
        lengths.append(len(chain_of(last)["deltas"]))
        assert_opens_as(last, s.count, records(s))
    assert max(lengths) == snaps.MAX_DELTAS, lengths
    # more than the table changes: a full copy, then chains on it again
    s = dsa_core.step(s, np.arange(N), np.ones((N, D), np.float32))
    full = dsa_core.checkpoint(s, tmp_path / "full")
    assert assert_snapshot_files(full) == "plain"
    s = train(s, rng)
    after = dsa_core.checkpoint(s, tmp_path / "after")
    assert assert_snapshot_files(after) == "chain"
    assert os.path.samefile(after / "base.dsa", full / "rows.dsa")
    assert_opens_as(after, s.count, records(s))
    # a delta that alone outgrows the budget left by the chain: a full copy
    s = dsa_core.step(s, np.arange(0, N, 2), np.ones((N // 2, D), np.float32))
    mid = dsa_core.checkpoint(s, tmp_path / "mid")
    s = dsa_core.step(s, np.arange(1, N, 2), np.ones((N // 2, D), np.float32))
    rebased = dsa_core.checkpoint(s, tmp_path / "rebased")
    assert [assert_snapshot_files(mid), assert_snapshot_files(rebased)] == ["chain", "plain"]
    assert_opens_as(rebased, s.count, records(s))
    dsa_core.close(s)


def test_no_row_changed_links_the_last_snapshot(tmp_path):
    """A snapshot with no row changed since the last (the model's and the optimizer's state
    dicts of one save) is the same files, linked again; a count-only step changes none."""
    rng = np.random.default_rng(4)
    s = make(tmp_path / "live")
    a = dsa_core.checkpoint(s, tmp_path / "a")
    b = dsa_core.checkpoint(s, tmp_path / "b")
    assert os.path.samefile(a / "rows.dsa", b / "rows.dsa")
    s = train(s, rng)
    c = dsa_core.checkpoint(s, tmp_path / "c")
    s = dsa_core.step(s, np.empty(0, np.int64), np.empty((0, D), np.float32))
    e = dsa_core.checkpoint(s, tmp_path / "e")
    assert chain_of(e) == chain_of(c)
    assert os.path.samefile(c / "delta-0001.dsa", e / "delta-0001.dsa")
    assert_opens_as(e, s.count, records(s))
    dsa_core.close(s)


# -- when the writer cannot know what changed: a full copy ---------------------------------------
REOPENED = textwrap.dedent("""
    import sys
    from pathlib import Path
    import numpy as np, dsa_core
    live, out = Path(sys.argv[1]), Path(sys.argv[2])
    s = dsa_core.open(live)
    dsa_core.checkpoint(s, out / "first")
    s = dsa_core.step(s, [1, 2, 2], np.ones((3, s.dim), np.float32))
    dsa_core.checkpoint(s, out / "second")
    dsa_core.close(s)
""")


def test_a_store_reopened_takes_a_full_copy_first(tmp_path):
    """A new process (or a new open) has no snapshot in memory: its first snapshot is a full
    copy, the next a chain on it."""
    rng = np.random.default_rng(6)
    s = train(make(tmp_path / "live"), rng)
    dsa_core.checkpoint(s, tmp_path / "before")
    dsa_core.close(s)
    r = subprocess.run([sys.executable, "-c", REOPENED, str(tmp_path / "live"), str(tmp_path)],
                       capture_output=True, text=True, timeout=300, check=False,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert assert_snapshot_files(tmp_path / "first") == "plain"
    assert assert_snapshot_files(tmp_path / "second") == "chain"
    s = dsa_core.open(tmp_path / "live", mode="r")
    assert_opens_as(tmp_path / "second", s.count, records(s))
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "live")  # the same in this process
    assert assert_snapshot_files(dsa_core.checkpoint(s, tmp_path / "third")) == "plain"
    dsa_core.close(s)


def test_full_copies_where_changes_go_unseen(tmp_path, monkeypatch):
    """A writable whole-table view handed out (rows may change through it), no undo file,
    and a last snapshot that changed (opened for writing) or moved away: full copies, each
    exact. A copy=True snapshot is never a base."""
    rng = np.random.default_rng(7)
    s = train(make(tmp_path / "live"), rng)
    dsa_core.checkpoint(s, tmp_path / "a")
    s.weights[5] = 3.0  # through the view: no undo record sees it
    s = train(s, rng)
    b = dsa_core.checkpoint(s, tmp_path / "b")
    assert assert_snapshot_files(b) == "plain"
    assert_opens_as(b, s.count, records(s))
    s = train(s, rng)
    assert assert_snapshot_files(dsa_core.checkpoint(s, tmp_path / "b2")) == "plain"  # sticky
    dsa_core.close(s)

    monkeypatch.setattr(undo_file, "ENABLED", False)  # (from the open on: no undo file)
    s = train(dsa_core.open(tmp_path / "live"), rng)
    dsa_core.checkpoint(s, tmp_path / "c")
    s = train(s, rng)
    d = dsa_core.checkpoint(s, tmp_path / "d")
    assert assert_snapshot_files(d) == "plain"
    assert_opens_as(d, s.count, records(s))
    dsa_core.close(s)
    monkeypatch.setattr(undo_file, "ENABLED", True)

    s = train(dsa_core.open(tmp_path / "live"), rng)
    dsa_core.checkpoint(s, tmp_path / "e")
    s = train(s, rng)
    cp = dsa_core.checkpoint(s, tmp_path / "copy", copy=True)
    assert assert_snapshot_files(cp) == "plain"
    f = dsa_core.checkpoint(s, tmp_path / "f")  # on "e", not on the copy
    assert os.path.samefile(f / "base.dsa", tmp_path / "e" / "rows.dsa")
    os.rename(tmp_path / "f", tmp_path / "f-moved")  # moved away: not found, a full copy
    s = train(s, rng)
    assert assert_snapshot_files(dsa_core.checkpoint(s, tmp_path / "g")) == "plain"
    t = dsa_core.open(tmp_path / "g")  # opened for writing and stepped: changed
    dsa_core.close(train(t, rng))
    s = train(s, rng)
    h = dsa_core.checkpoint(s, tmp_path / "h")
    assert assert_snapshot_files(h) == "plain"
    assert_opens_as(h, s.count, records(s))
    dsa_core.close(s)


def test_a_snapshot_renamed_by_a_staged_commit_is_still_the_base(tmp_path):
    """An adapter's checkpoint writes the stores' snapshots into a staged directory renamed
    into place (``commit_dir``): the store follows its last snapshot there."""
    rng = np.random.default_rng(8)
    s = train(make(tmp_path / "live"), rng)
    with _files.staged_dir(tmp_path / "ck", overwrite=False) as tmp:
        dsa_core.checkpoint(s, tmp / "emb")
    s = train(s, rng)
    nxt = dsa_core.checkpoint(s, tmp_path / "next")
    assert os.path.samefile(nxt / "base.dsa", tmp_path / "ck" / "emb" / "rows.dsa")
    assert_opens_as(nxt, s.count, records(s))
    dsa_core.close(s)


# -- reading a chain ------------------------------------------------------------------------------
def chain_dirs(tmp_path: Path, n: int = 3):
    rng = np.random.default_rng(9)
    s = make(tmp_path / "live")
    out = []
    for i in range(n):
        s = train(s, rng)
        d = dsa_core.checkpoint(s, tmp_path / f"k{i}")
        out.append((d, s.count, records(s)))
    dsa_core.close(s)
    return out


@pytest.mark.parametrize("damage", ["flip", "missing delta", "missing base", "truncated"])
def test_a_damaged_chain_is_refused_naming_the_file(tmp_path, damage, store_digest, capsys):
    taken = chain_dirs(tmp_path)
    d, _, _ = taken[-1]
    delta = d / chain_of(d)["deltas"][-1]["file"]
    if damage == "flip":
        raw = bytearray(delta.read_bytes())
        raw[-3] ^= 0x10
        os.unlink(delta)  # a file of its own: the other snapshots keep theirs intact
        delta.write_bytes(bytes(raw))
        name, why = delta.name, "is damaged: the CRC of its rows"
    elif damage == "missing delta":
        os.unlink(delta)
        name, why = delta.name, "is missing"
    elif damage == "missing base":
        os.unlink(d / "base.dsa")
        name, why = "base.dsa", "is missing"
    else:
        raw = delta.read_bytes()
        os.unlink(delta)
        delta.write_bytes(raw[:-100])
        name, why = delta.name, "does not match the manifest's entry"
    def files():  # (a writer's open creates its lock file: no change of the snapshot)
        return {k: v for k, v in store_digest(d).items() if k != "writer.lock"}
    before = files()
    for mode in ("r", "r+"):
        with pytest.raises(snaps.ChainError, match=rf"'{name}' {why}.*Nothing was changed"):
            dsa_core.open(d, mode=mode)
        assert files() == before
    assert dsa_cli.main(["verify", str(d), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM: the store does not check out: {name}:" in out
    assert files() == before
    for other, count, rec in taken[:-1]:  # the others hold their own links
        assert_opens_as(other, count, rec)


def test_cli_info_verify_export_on_a_chain(tmp_path, capsys):
    d, count, rec = chain_dirs(tmp_path)[-1]
    assert dsa_cli.main(["verify", str(d), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "file base.dsa: ok" in out and "file delta-" in out and f"count {count}" in out
    assert dsa_cli.main(["info", str(d), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["count"] == count and info["snapshot_chain"]["base"] == "base.dsa"
    out_npy = tmp_path / "w.npy"
    assert dsa_cli.main(["export", str(d), str(out_npy), "--quiet"]) == 0
    np.testing.assert_array_equal(np.load(out_npy), rec[:, :D])


def test_a_chain_too_large_for_memory_opens_from_a_temporary_file(tmp_path, monkeypatch):
    """When the pages the deltas change would take more than the memory share, a read-only
    open builds the table in an unlinked temporary file: the same records, no file left."""
    taken = chain_dirs(tmp_path)
    monkeypatch.setattr(snaps, "memory_available", lambda: 0)
    d, count, rec = taken[-1]
    names = sorted(os.listdir(d))
    snap = dsa_core.open(d, mode="r")
    assert "temporary file" in snap.store.stats()["snapshot_chain"]["opened"]
    np.testing.assert_array_equal(records(snap).view(np.uint32), rec.view(np.uint32))
    dsa_core.close(snap)
    assert sorted(os.listdir(d)) == names


# -- a writer's open of a snapshot -----------------------------------------------------------------
def test_a_writer_open_of_a_snapshot_never_changes_another(tmp_path, store_digest):
    """Opening a chain for writing materializes it (its own rows.dsa, no chain in its
    manifest); opening a snapshot whose data file other directories share (the base of a
    chain, a carried copy) copies it first: training in either changes no other snapshot."""
    taken = chain_dirs(tmp_path, 4)
    digests = {d: store_digest(d) for d, _, _ in taken}
    carried = dsa_core.tools.link_files(taken[0][0], tmp_path / "carried")
    rng = np.random.default_rng(10)
    for d, count, rec in (taken[2], taken[0]):  # a chain; the plain base of the chain
        t = dsa_core.open(d)
        assert assert_snapshot_files(d) == "plain" and os.stat(d / "rows.dsa").st_nlink == 1
        assert t.count == count
        np.testing.assert_array_equal(records(t).view(np.uint32), rec.view(np.uint32))
        dsa_core.close(train(t, rng))
        digests.pop(d)
    for d, count, rec in (taken[1], taken[3]):
        assert store_digest(d) == digests[d]
        assert_opens_as(d, count, rec)
    assert_opens_as(carried, *taken[0][1:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = CrashServer(tmp_path_factory.mktemp("chain_crash_runs"))
    yield srv
    srv.close()


MATERIALIZE_KILL = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import dsa_core
    from dsa_core import _layout
    from dsa_core._inplace import snapshots
    snap, point = Path(sys.argv[1]), sys.argv[2]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if point == "built":            # rows.dsa.tmp complete, not renamed
        real_r = os.replace
        def replace(a, b, *k, **kw):
            if Path(b).name == "rows.dsa":
                die()
            return real_r(a, b, *k, **kw)
        os.replace = replace
    elif point == "renamed":        # rows.dsa in place, the manifest still names the chain
        snapshots._layout.write_manifest = lambda *a, **k: die()
    else:                           # the manifest rewritten, the chain's files not deleted
        real_w = _layout.write_manifest
        def write_manifest(*a, **k):
            real_w(*a, **k)
            die()
        snapshots._layout.write_manifest = write_manifest
    dsa_core.open(snap)
""")


@pytest.mark.parametrize("point", ["built", "renamed", "committed"])
def test_kill_9_while_a_chain_is_materialized(server, tmp_path, point, store_digest):
    taken = chain_dirs(tmp_path)
    d, count, rec = taken[-1]
    others = {o: store_digest(o) for o, _, _ in taken[:-1]}
    rc, _, err = server.run(str(d), point, code=MATERIALIZE_KILL)
    assert rc == -signal.SIGKILL, err
    assert_opens_as(d, count, rec)   # as it was, or materialized
    t = dsa_core.open(d)             # the writer's open finishes the job
    assert sorted(os.listdir(d)) == ["manifest.json", "rows.dsa", "writer.lock"]
    np.testing.assert_array_equal(records(t).view(np.uint32), rec.view(np.uint32))
    dsa_core.close(t)
    assert {o: store_digest(o) for o in others} == others


def test_kill_9_while_a_delta_is_written(server, tmp_path):
    """SIGKILL in the middle of a delta file (the checkpoint at step 8, on the one at step 4,
    replacing it): the checkpoint is the whole one of step 4, the staged leftover is no
    snapshot, and the live store reopens at its last flush (the checkpoint's, step 8)."""
    live, dest = tmp_path / "live", tmp_path / "ckpt"
    rc, lines, err = server.run("ckpt", live, dest, "--every", 4, "--steps", 40,
                                "--kill-at", "ckpt-delta", "--kill-step", 8)
    assert rc == -signal.SIGKILL, err
    assert lines[-1] == ["ckpt", "4"]
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
    assert len(leftovers) == 1 and not (leftovers[0] / "manifest.json").exists()
    assert assert_snapshot_files(dest) == "plain"
    ref = dsa_core.create(tmp_path / "ref", cw.NUM_ROWS, cw.DIM, **cw.STORE_KW)
    for t in range(1, 9):
        ref = dsa_core.step(ref, *cw.batch(t))
        if t == 4:
            at4 = records(ref)
    assert_opens_as(dest, 4, at4)
    s = dsa_core.open(live)
    assert s.count == 8
    np.testing.assert_array_equal(records(s).view(np.uint32), records(ref).view(np.uint32))
    dsa_core.close(s)
    dsa_core.close(ref)


def test_links_refused_make_a_full_copy(tmp_path, monkeypatch):
    """Where the last snapshot's files cannot be linked (another filesystem: EXDEV, too many
    links: EMLINK) the snapshot is a full copy, exact, and the staged directory holds no
    half-made chain."""
    rng = np.random.default_rng(11)
    s = train(make(tmp_path / "live"), rng)
    dsa_core.checkpoint(s, tmp_path / "a")
    s = train(s, rng)

    def refuse(src, dst, *a, **k):
        raise OSError(18, "Invalid cross-device link")
    monkeypatch.setattr(snaps.os, "link", refuse)
    b = dsa_core.checkpoint(s, tmp_path / "b")
    assert assert_snapshot_files(b) == "plain"
    assert_opens_as(b, s.count, records(s))
    dsa_core.close(s)
