"""Reliability: checkpoints, journaled steps under SIGKILL, one writer, disk space, reopening.

* Crash harness: ``tests/crash_worker.py`` trains in a child process (forked from one warm
  interpreter: tests/crash_server.py) on batches that are a pure function of the step
  number; the test SIGKILLs it (at random moments, or at a chosen point of the commit
  protocol), reopens the store and compares it, bit for bit, with a store replayed for
  ``count`` steps without crashes (:class:`Replay`). A few trials run by
  default; ``-m slow`` runs >= 100 per scenario. The random kills run on both kinds (of
  journaled training, of core checkpoints and of the torch adapter's checkpoints); the
  chosen points of the commit protocol, the undo journal (a restore voiding a stale one
  included) and the small-filesystem trials are the in-place store's (docs/storage.md; the
  log store's crash points and disk faults are in tests/log/test_log_engine.py and
  store/test_faults.py).
* Checkpoints of the core and of both adapters (torch optimizer, DiskEmbedding, JAX), on
  both kinds: resume exactly, refuse to clobber, and hold a store of the kind checkpointed.
* Space: stores on a 4 MiB tmpfs (skipped where mounting is not allowed), in-place.
* Property: closing and reopening (or checkpointing and resuming) at random points changes
  nothing (in-place stores only so far: it compares their rows.dsa files).

A process kill cannot lose the page cache, so these tests check the ordering of the commit
protocol as seen by the next process (what a ``kill -9`` or an OOM kill does), not what a
power loss does to unsynced pages.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

import crash_worker as cw
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from crash_server import CrashServer

import dsa_core
from helpers import assert_snapshot_files, on_disk, records

REPO = Path(__file__).resolve().parents[2]
N, D = cw.NUM_ROWS, cw.DIM


# -- the crash harness (tests/crash_server.py: crash_worker.py runs forked from one warm
# interpreter per module; every run here ends by SIGKILL or after dsa_core.close) -------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = CrashServer(tmp_path_factory.mktemp("crash_runs"))
    yield srv
    srv.close()


class Replay:
    """A store stepped through crash_worker.batch(1..count) without any crash (the oracle)."""

    def __init__(self, path: Path, curvature: float = 0.0):
        self.state = dsa_core.create(path, N, D, curvature=curvature, **cw.STORE_KW)

    def to(self, count: int) -> Replay:
        assert count >= self.state.count, "counts only move forward in these tests"
        while self.state.count < count:
            self.state = dsa_core.step(self.state, *cw.batch(self.state.count + 1))
        return self

    def torn_rows(self, data) -> int:
        """Rows whose bytes differ from the replay's (NaN-safe: bytes, not values); ``data``
        is a State of either kind or its records."""
        if isinstance(data, dsa_core.State):
            data = records(data)
        a = np.ascontiguousarray(data).view(np.uint8).reshape(N, -1)
        b = np.ascontiguousarray(records(self.state)).view(np.uint8).reshape(N, -1)
        return int((a != b).any(axis=1).sum())

    def close(self):
        dsa_core.close(self.state)


def manifest_count(path: Path) -> int:
    return json.loads((path / "manifest.json").read_text())["count"]


def journal_pending(path: Path, count: int) -> bool:
    """Does the journal hold an intact undo record of step ``count + 1`` (rollback due)?"""
    j = path / "journal.dsa"
    if not j.exists():
        return False
    raw = j.read_bytes()
    if len(raw) < 28 or raw[:8] != b"DSAJRNL1":
        return False
    return struct.unpack_from("<Q", raw, 8)[0] == count


def new_step_store(path: Path, curvature: float = 0.0, kind: str = "inplace") -> None:
    dsa_core.close(dsa_core.create(path, N, D, curvature=curvature, durability="step",
                                   **cw.store_kw(kind)))


def step_trials(server, tmp: Path, trials: int, seed: int, curvature: float, window: float,
                probe_every: int, kind: str = "inplace") -> Counter:
    """(a) kill a journaled training process at random moments; after every kill the store
    must open to exactly a completed step. The next worker resumes by reopening."""
    rng = np.random.default_rng(seed)
    store = tmp / "store"
    new_step_store(store, curvature, kind)
    ref = Replay(tmp / "ref", curvature)
    stats = Counter()
    last = 0
    try:
        for k in range(trials):
            w = server.start("train", store)
            opened = w.expect("open")
            assert opened == last  # the previous trial's reopen left exactly that count
            if k % probe_every == 0:
                # one writer: a second one is refused, a reader may open while steps run
                with pytest.raises(dsa_core.StoreLockedError, match="already open for writing"):
                    dsa_core.open(store)
                ro = dsa_core.open(store, mode="r")
                assert ro.count >= opened
                assert ro.num_rows == N
                dsa_core.close(ro)
                stats["reader opens during training"] += 1
            time.sleep(rng.uniform(0.0, window))
            w.kill()
            count = manifest_count(store)
            pending = journal_pending(store, count)
            ro = dsa_core.open(store, mode="r")  # no recovery: what the kill left
            ref.to(count)
            torn_before = ref.torn_rows(ro)
            dsa_core.close(ro)
            s = dsa_core.open(store)  # rolls an interrupted step back
            if kind == "log":  # its commit log, not the manifest, holds the last steps
                count = s.count
                ref.to(count)
            assert s.count == count
            torn = ref.torn_rows(s)
            assert torn == 0, (f"trial {k}: {torn} rows differ from the replay of {count} "
                               f"steps after recovery")
            assert not (store / "journal.dsa").exists()
            dsa_core.close(s)
            assert count >= last
            stats["trials"] += 1
            stats["steps"] += count - last
            stats["killed mid-step (journal pending)"] += pending
            stats["rolled back torn rows"] += torn_before > 0
            stats["max torn rows before recovery"] = max(
                stats["max torn rows before recovery"], torn_before)
            last = count
    finally:
        ref.close()
    stats["final count"] = last
    return stats


def ckpt_trials(server, tmp: Path, trials: int, seed: int, window: float, every: int = 4,
                mode: str = "ckpt", kind: str = "inplace") -> Counter:
    """(b) kill a process that trains and checkpoints at random moments: the checkpoint is
    either absent (none ever completed) or complete, at a multiple of ``every``, at least the
    last one the worker reported, and bit-identical to the replay of that many steps."""
    rng = np.random.default_rng(seed)
    live, dest = tmp / "live", tmp / "ckpt"
    if mode == "ckpt":
        ref = Replay(tmp / "ref")
    else:
        ref = TorchReplay(tmp / "ref", kind)
    stats = Counter()
    claimed = last = 0
    try:
        for _ in range(trials):
            w = server.start(mode, live, dest, "--every", every, "--storage", kind)
            assert w.expect("open") == last  # resumed from the checkpoint
            time.sleep(rng.uniform(0.0, window))
            for line in w.kill():
                if line[0] == "ckpt":
                    claimed = max(claimed, int(line[1]))
            leftovers = [p for p in tmp.iterdir() if p.name.startswith("ckpt.")]
            stats["kills leaving a ckpt.tmp-* leftover"] += bool(leftovers)
            for p in leftovers:
                shutil.rmtree(p)
            if not dest.exists():
                assert claimed == 0, "a completed checkpoint disappeared"
                stats["no checkpoint yet"] += 1
                continue
            if mode == "ckpt":  # in place: a full copy, or a chain on the one it replaced
                if kind == "inplace":
                    stats[f"{assert_snapshot_files(dest)} checkpoints"] += 1
                snap = dsa_core.open(dest, mode="r")
            else:
                snap = check_torch_checkpoint(dest)
            assert snap.storage == kind
            count = snap.count
            assert count % every == 0 and count >= max(claimed, last), (count, claimed, last)
            ref.to(count)
            assert ref.torn_rows(snap) == 0
            if mode == "ckpt":
                assert (snap.lr, snap.betas, snap.eps) == (cw.LR, (0.9, 0.999), 1e-8)
            dsa_core.close(snap)
            stats["trials"] += 1
            stats["checkpoints advanced"] += count > last
            last = count
    finally:
        ref.close()
    stats["final checkpoint count"] = last
    return stats


class TorchReplay(Replay):
    """The oracle of the torch-ckpt worker: the same DiskEmbedding + DiskSparseAdam code
    (on a store of the same kind)."""

    def __init__(self, path: Path, kind: str = "inplace"):
        self.emb, self.opt = cw.torch_model(path, None, kind)

    @property
    def state(self):
        return self.emb.store

    def to(self, count: int) -> TorchReplay:
        assert count >= self.state.count
        while self.state.count < count:
            cw.torch_step(self.emb, self.opt, self.state.count + 1)
        return self

    def close(self):
        self.opt.close()
        self.emb.close()


def check_torch_checkpoint(dest: Path) -> dsa_core.State:
    torch = pytest.importorskip("torch")
    from adapters.torch import MANIFEST_KEY

    assert sorted(os.listdir(dest)) == ["group0_param0", "optimizer.pt"]
    sd = torch.load(dest / "optimizer.pt", weights_only=True)
    man = sd[MANIFEST_KEY]
    snap = dsa_core.open(dest / "group0_param0", mode="r")
    assert man["params"][0]["count"] == snap.count
    assert man["checkpoint"] == str(dest.resolve())
    return snap


# -- (a) journaled stores killed mid-training ------------------------------------------------
@pytest.mark.parametrize("curvature", [0.0, 1.0])
def test_sigkill_journaled_training_few(server, tmp_path, curvature, kind):
    stats = step_trials(server, tmp_path, trials=2, seed=int(curvature), curvature=curvature,
                        window=0.25, probe_every=1, kind=kind)
    assert stats["trials"] == 2
    assert stats["final count"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("curvature", [0.0, 1.0])
def test_sigkill_journaled_training_many(server, tmp_path, curvature, kind):
    stats = step_trials(server, tmp_path, trials=60, seed=100 + int(curvature),
                        curvature=curvature, window=0.3, probe_every=10, kind=kind)
    print(f"\njournaled training, {kind}, c={curvature}: {dict(stats)}")
    assert stats["trials"] == 60
    assert stats["final count"] > 60
    if kind == "inplace":
        # the kills did land inside steps, and rollbacks of half-written rows were needed
        assert stats["killed mid-step (journal pending)"] > 10
        assert stats["rolled back torn rows"] > 3


# -- (b) checkpoints killed mid-checkpoint ----------------------------------------------------
def test_sigkill_during_checkpoints_few(server, tmp_path, kind):
    stats = ckpt_trials(server, tmp_path, trials=3, seed=7, window=0.15, kind=kind)
    assert stats["trials"] + stats["no checkpoint yet"] == 3


@pytest.mark.slow
def test_sigkill_during_checkpoints_many(server, tmp_path, kind):
    # a log store's checkpoint is a flush and hard links (it copied the 8-byte-per-row index
    # before the index base was linked): 8 and 10 of 120 kills landed inside one, so the
    # log kind takes twice the trials for the same > 10
    trials = 120 if kind == "inplace" else 240
    stats = ckpt_trials(server, tmp_path, trials=trials, seed=8, window=0.15, kind=kind)
    print(f"\ncheckpoints, {kind}: {dict(stats)}")
    assert stats["trials"] + stats["no checkpoint yet"] == trials
    assert stats["kills leaving a ckpt.tmp-* leftover"] > 10  # kills inside checkpoints
    assert stats["checkpoints advanced"] > 10
    if kind == "inplace":
        assert stats["chain checkpoints"] > 10  # snapshots on the last one, killed too


def test_sigkill_during_torch_checkpoints_few(server, tmp_path, kind):
    pytest.importorskip("torch")
    stats = ckpt_trials(server, tmp_path, trials=1, seed=9, window=0.4, mode="torch-ckpt",
                        kind=kind)
    assert stats["trials"] + stats["no checkpoint yet"] == 1


@pytest.mark.slow
def test_sigkill_during_torch_checkpoints_many(server, tmp_path, kind):
    pytest.importorskip("torch")
    stats = ckpt_trials(server, tmp_path, trials=25, seed=10, window=0.4, mode="torch-ckpt",
                        kind=kind)
    print(f"\ntorch checkpoints, {kind}: {dict(stats)}")
    assert stats["trials"] + stats["no checkpoint yet"] == 25
    assert stats["checkpoints advanced"] > 5


# -- deterministic kill points of the commit protocol -----------------------------------------
KILL_STEP = 7  # unsorted ids with duplicates, B > 0
# point -> (count after recovery, are rows torn before recovery?)
STEP_POINTS = {
    "journal-torn": (KILL_STEP - 1, False),
    "journal": (KILL_STEP - 1, False),
    "mid-kernel": (KILL_STEP - 1, True),
    "kernel": (KILL_STEP - 1, True),
    "data-sync": (KILL_STEP - 1, True),
    "manifest-tmp": (KILL_STEP - 1, True),
    "manifest-renamed": (KILL_STEP, False),
}


@pytest.mark.parametrize("point", list(STEP_POINTS))
def test_kill_at_each_point_of_a_journaled_step(server, tmp_path, point):
    count_after, torn_expected = STEP_POINTS[point]
    store = tmp_path / "store"
    new_step_store(store)
    rc, lines, err = server.run("train", store, "--steps", 50, "--kill-at", point,
                                "--kill-step", KILL_STEP)
    assert rc == -signal.SIGKILL, err
    assert lines == [["open", "0"]]
    assert manifest_count(store) == count_after
    ref = Replay(tmp_path / "ref").to(count_after)
    ro = dsa_core.open(store, mode="r")
    torn_before = ref.torn_rows(ro.store.data)
    dsa_core.close(ro)
    assert (torn_before > 0) == torn_expected, torn_before
    if point == "mid-kernel":  # half of the batch's unique rows were written
        n_unique = np.unique(cw.batch(KILL_STEP)[0]).size
        assert torn_before == max(1, n_unique // 2)
    s = dsa_core.open(store)
    assert s.count == count_after
    assert ref.torn_rows(s.store.data) == 0
    assert not (store / "journal.dsa").exists()
    dsa_core.close(s)
    ref.close()


def test_kill_during_recovery_then_resume(server, tmp_path):
    """A kill inside open's rollback (before the journal is removed) is harmless: the next
    open rolls back again; training then resumes to the same bytes as the replay."""
    store = tmp_path / "store"
    new_step_store(store)
    rc, _, err = server.run("train", store, "--kill-at", "kernel", "--kill-step", KILL_STEP)
    assert rc == -signal.SIGKILL, err
    rc, lines, err = server.run("train", store, "--kill-at", "recover")
    assert rc == -signal.SIGKILL, err
    assert lines == []  # died inside dsa_core.open
    assert journal_pending(store, KILL_STEP - 1)
    rc, lines, err = server.run("train", store, "--steps", KILL_STEP + 5)
    assert rc == 0, err
    assert lines == [["open", str(KILL_STEP - 1)], ["done", str(KILL_STEP + 5)]]
    ref = Replay(tmp_path / "ref").to(KILL_STEP + 5)
    s = dsa_core.open(store, mode="r")
    assert s.count == KILL_STEP + 5
    assert ref.torn_rows(s.store.data) == 0
    dsa_core.close(s)
    ref.close()


# point, step at which it strikes, expected checkpoint count afterwards (None: no dest)
CKPT_POINTS = [
    ("ckpt-manifest", 4, None),   # first checkpoint: plain rename path
    ("ckpt-commit", 4, None),
    ("ckpt-manifest", 8, 4),      # replacing a checkpoint: RENAME_EXCHANGE path
    ("ckpt-commit", 8, 4),
    ("ckpt-cleanup", 8, 8),
]


@pytest.mark.parametrize(("point", "at", "expect"), CKPT_POINTS)
def test_kill_at_each_point_of_a_checkpoint(server, tmp_path, point, at, expect):
    live, dest = tmp_path / "live", tmp_path / "ckpt"
    rc, lines, err = server.run("ckpt", live, dest, "--every", 4, "--steps", 40,
                                "--kill-at", point, "--kill-step", at)
    assert rc == -signal.SIGKILL, err
    assert lines[-1] == (["open", "0"] if at == 4 else ["ckpt", "4"])
    # the temporary directory (new data, or the old snapshot after the swap) is left behind
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
    assert len(leftovers) == 1
    if expect is None:
        assert not dest.exists()
        return
    assert_snapshot_files(dest)
    snap = dsa_core.open(dest, mode="r")
    assert snap.count == expect
    ref = Replay(tmp_path / "ref").to(expect)
    assert ref.torn_rows(snap.store.data) == 0
    dsa_core.close(snap)
    if point != "ckpt-commit":
        ref.close()
        return
    # the next run resumes from the checkpoint and carries on to the same bytes
    shutil.rmtree(tmp_path / leftovers[0])
    rc, lines, err = server.run("ckpt", live, dest, "--every", 4, "--steps", 12)
    assert rc == 0, err
    assert lines[0] == ["open", str(expect)] and lines[-1] == ["done", "12"]
    snap = dsa_core.open(dest, mode="r")
    assert snap.count == 12
    assert ref.to(12).torn_rows(snap.store.data) == 0
    dsa_core.close(snap)
    ref.close()


# -- journaled mode in process ----------------------------------------------------------------
@pytest.mark.parametrize("curvature", [0.0, 1.0])
def test_journaled_steps_equal_plain_steps_and_commit_each_count(tmp_path, curvature, kind):
    j = dsa_core.create(tmp_path / "j", N, D, curvature=curvature, durability="step",
                        **cw.store_kw(kind))
    ref = Replay(tmp_path / "ref", curvature)
    for t in range(1, 15):
        j = dsa_core.step(j, *cw.batch(t))
        if t in (1, 5, 13, 14):  # the first, a sorted-unique, an empty batch, the last
            count, recs = on_disk(tmp_path / "j", tmp_path / "killed")  # as a kill leaves it
            assert count == t  # committed without any flush
            assert ref.to(t).torn_rows(recs) == 0
    ref.to(14)
    assert ref.torn_rows(j) == 0
    assert j.durability == "step"
    dsa_core.close(j)
    again = dsa_core.open(tmp_path / "j")
    assert (again.durability, again.count) == ("step", 14)
    dsa_core.close(again)
    ref.close()


def test_garbage_journal_is_ignored_and_removed(tmp_path):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D, durability="step", **cw.STORE_KW)
    s = dsa_core.step(s, *cw.batch(1))
    dsa_core.close(s)
    before = (p / "rows.dsa").read_bytes()
    for junk in (b"", b"DSAJRNL1", b"not a journal at all" * 10,
                 b"DSAJRNL1" + struct.pack("<QQI", 1, 3, 0) + b"\0" * 40):
        (p / "journal.dsa").write_bytes(junk)
        s = dsa_core.open(p)
        assert s.count == 1
        assert not (p / "journal.dsa").exists()
        dsa_core.close(s)
        assert (p / "rows.dsa").read_bytes() == before


def test_flush_voids_a_stale_journal(tmp_path):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D, durability="step", **cw.STORE_KW)
    for t in range(1, 4):  # the journal now holds step 3's undo record (count_before 2)
        s = dsa_core.step(s, *cw.batch(t))
    other = Replay(tmp_path / "other", curvature=0.0)
    other.state = dsa_core.step(other.state, *cw.batch(40))
    other.state = dsa_core.step(other.state, *cw.batch(41))
    s.store.data[:] = other.state.store.data  # restore another run's rows at count 2
    s = dsa_core.set_count(s, 2)  # flushes
    dsa_core.close(s)
    again = dsa_core.open(p)
    kept = other.torn_rows(again.store.data)
    dsa_core.close(again)
    other.close()
    assert kept == 0, f"open() rolled {kept} rows back over the flushed ones"


# -- core checkpoints -------------------------------------------------------------------------
@pytest.mark.parametrize("durability", ["flush", "step"])
def test_checkpoint_resumes_exactly_and_training_goes_on(tmp_path, durability, kind):
    live = dsa_core.create(tmp_path / "live", N, D, curvature=0.5, durability=durability,
                           nonfinite="skip_row", **cw.store_kw(kind))
    for t in range(1, 11):
        live = dsa_core.step(live, *cw.batch(t))
    live = live._replace(lr=0.02, betas=(0.8, 0.99))
    assert dsa_core.checkpoint(live, tmp_path / "ck") == tmp_path / "ck"
    if kind == "inplace":  # the in-place format; a log checkpoint holds its segments
        assert sorted(os.listdir(tmp_path / "ck")) == ["manifest.json", "rows.dsa"]
    for t in range(11, 16):  # training continues on the live store
        live = dsa_core.step(live, *cw.batch(t))
    snap = dsa_core.open(tmp_path / "ck")
    assert (snap.count, snap.lr, snap.betas, snap.durability, snap.nonfinite) == (
        10, 0.02, (0.8, 0.99), durability, "skip_row")
    assert snap.storage == kind
    for t in range(11, 16):
        snap = dsa_core.step(snap, *cw.batch(t))
    assert records(snap).tobytes() == records(live).tobytes()
    assert snap.count == live.count == 15
    dsa_core.close(snap)
    # overwrite replaces the snapshot; nothing else is left next to it
    dsa_core.checkpoint(live, tmp_path / "ck", overwrite=True)
    assert dsa_core.open(tmp_path / "ck", mode="r").count == 15
    assert sorted(os.listdir(tmp_path)) == ["ck", "live"]
    dsa_core.close(live)


def test_checkpoint_refusals(tmp_path, store_digest, kind):
    live = dsa_core.create(tmp_path / "live", 100, 4, storage=kind)
    live = dsa_core.step(live, [1, 2], np.ones((2, 4), np.float32))
    dsa_core.checkpoint(live, tmp_path / "ck")
    before = store_digest(tmp_path)
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        dsa_core.checkpoint(live, tmp_path / "ck")
    with pytest.raises(ValueError, match="is the live store itself"):
        dsa_core.checkpoint(live, tmp_path / "live", overwrite=True)
    ro = dsa_core.open(tmp_path / "live", mode="r")
    with pytest.raises(ValueError, match="read-only"):
        dsa_core.checkpoint(ro, tmp_path / "ck2")
    assert store_digest(tmp_path) == before
    assert not (tmp_path / "ck2").exists()
    dsa_core.close(live)
    with pytest.raises(ValueError, match="is closed"):
        dsa_core.checkpoint(live, tmp_path / "ck3")


# -- adapters: checkpoints ----------------------------------------------------------------------
def _torch_run(emb, opt, steps, t0, sched=None):
    import torch

    for t in range(t0, t0 + steps):
        idx, grad = cw.batch(t, num_rows=emb.num_embeddings, dim=emb.embedding_dim)
        (emb(torch.from_numpy(idx)) * torch.from_numpy(grad)).sum().backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def test_torch_optimizer_checkpoint_and_load_checkpoint(tmp_path, store_digest, kind):
    torch = pytest.importorskip("torch")
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    def build(state_dir, emb_dir, resume=False):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(400, 8, sparse=True)
        de = DiskEmbedding(300, 8, state_dir=emb_dir, init="normal", seed=1, resume=resume,
                           storage=kind)
        opt = DiskSparseAdam([{"params": [emb.weight]}, {"params": [de.weight], "lr": 0.03}],
                             lr=0.02, state_dir=state_dir, resume=resume, storage=kind)
        return emb, de, opt, torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)

    def run(emb, de, opt, sched, t0, steps):
        for t in range(t0, t0 + steps):
            i1, g1 = cw.batch(t, num_rows=400, dim=8)
            i2, g2 = cw.batch(t + 1000, num_rows=300, dim=8)
            loss = (emb(torch.from_numpy(i1)) * torch.from_numpy(g1)).sum() \
                + (de(torch.from_numpy(i2)) * torch.from_numpy(g2)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    emb, de, opt, sched = build(tmp_path / "opt", tmp_path / "de")
    run(emb, de, opt, sched, 1, 7)
    weights_at_7 = emb.weight.detach().clone()
    sched_at_7 = sched.state_dict()
    lrs_at_7 = [g["lr"] for g in opt.param_groups]
    ck = opt.checkpoint(tmp_path / "ck")
    assert sorted(os.listdir(ck)) == ["group0_param0", "group1_param0", "optimizer.pt"]
    for p in ("group0_param0", "group1_param0"):
        snap = dsa_core.open(ck / p, mode="r")
        assert snap.storage == kind
        dsa_core.close(snap)
    assert dsa_core.open(ck / "group1_param0", mode="r").has_weights  # the DiskEmbedding's
    run(emb, de, opt, sched, 8, 6)  # the reference continuation

    # resume into another optimizer (own state_dir, a fresh DiskEmbedding) from the checkpoint
    moved = shutil.move(str(ck), str(tmp_path / "moved"))  # a moved checkpoint works too
    if kind == "inplace":  # its one data file
        ck_bytes = {p: (Path(moved) / p / "rows.dsa").read_bytes()
                    for p in ("group0_param0", "group1_param0")}
    else:  # a log checkpoint has no rows.dsa: its segments, index base and manifest, each
        ck_bytes = {p: store_digest(Path(moved) / p) for p in ("group0_param0", "group1_param0")}
    emb2, de2, opt2, sched2 = build(tmp_path / "opt2", tmp_path / "de2")
    with torch.no_grad():
        emb2.weight.copy_(weights_at_7)  # plain parameters come from the model's state dict
    opt2.load_checkpoint(moved)
    sched2.load_state_dict(sched_at_7)
    assert opt2.store_for(de2.weight).count == 7 and opt2.state[emb2.weight]["step"] == 7
    assert [g["lr"] for g in opt2.param_groups] == lrs_at_7
    assert lrs_at_7 != [0.02, 0.03]  # the scheduler had moved them
    run(emb2, de2, opt2, sched2, 8, 6)
    assert torch.equal(emb2.weight, emb.weight)
    for p, q in ((emb.weight, emb2.weight), (de.weight, de2.weight)):
        a, b = opt.store_for(p), opt2.store_for(q)
        assert a.count == b.count == 13
        assert records(a).tobytes() == records(b).tobytes()
    for p, raw in ck_bytes.items():  # the checkpoint was not modified
        if kind == "inplace":
            assert (Path(moved) / p / "rows.dsa").read_bytes() == raw
        else:
            assert store_digest(Path(moved) / p) == raw
    opt2.close()
    de2.close()

    # resume by training *in* the checkpoint: an optimizer built with state_dir=checkpoint
    emb3, de3, opt3, sched3 = build(moved, Path(moved) / "group1_param0", resume=True)
    with torch.no_grad():
        emb3.weight.copy_(weights_at_7)
    opt3.load_checkpoint(moved)  # its stores are the snapshots themselves: nothing copied
    sched3.load_state_dict(sched_at_7)
    run(emb3, de3, opt3, sched3, 8, 6)
    assert torch.equal(emb3.weight, emb.weight)
    assert records(opt3.store_for(de3.weight)).tobytes() == \
        records(opt.store_for(de.weight)).tobytes()
    for o, d in ((opt, de), (opt3, de3)):
        o.close()
        d.close()


def test_torch_checkpoint_refusals(tmp_path, store_digest, kind):
    torch = pytest.importorskip("torch")
    from adapters.torch import DiskSparseAdam

    emb = torch.nn.Embedding(50, 4, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1, state_dir=tmp_path / "opt", storage=kind)
    _torch_run(emb, opt, 2, 1)
    opt.checkpoint(tmp_path / "ck")
    before = store_digest(tmp_path)
    with pytest.raises(FileExistsError, match="exists; pass overwrite=True"):
        opt.checkpoint(tmp_path / "ck")
    for bad in (tmp_path / "opt", tmp_path):
        with pytest.raises(ValueError, match="would replace or contain the live store"):
            opt.checkpoint(bad, overwrite=True)
    with pytest.raises(FileNotFoundError, match="is not a DiskSparseAdam checkpoint"):
        opt.load_checkpoint(tmp_path / "opt")
    assert store_digest(tmp_path) == before
    other = torch.nn.Embedding(51, 4, sparse=True)
    o2 = DiskSparseAdam(other.parameters(), lr=0.1, state_dir=tmp_path / "o2", storage=kind)
    before2 = store_digest(tmp_path)
    with pytest.raises(ValueError, match="is 50 x 4 float32 with curvature 0.0, but the "
                                         "parameter in its position has a 51 x 4"):
        o2.load_checkpoint(tmp_path / "ck")
    assert store_digest(tmp_path) == before2
    o2.close()
    _torch_run(emb, opt, 1, 3)
    opt.checkpoint(tmp_path / "ck", overwrite=True)
    assert torch.load(tmp_path / "ck" / "optimizer.pt", weights_only=True)[
        "dsa_manifest"]["params"][0]["count"] == 3
    snap = dsa_core.open(tmp_path / "ck" / "group0_param0", mode="r")
    assert (snap.count, snap.storage) == (3, kind)
    dsa_core.close(snap)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    opt.close()


def test_disk_embedding_checkpoint(tmp_path, kind):
    pytest.importorskip("torch")
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    de = DiskEmbedding(200, 6, state_dir=tmp_path / "de", init="uniform", seed=2, storage=kind)
    opt = DiskSparseAdam(de.parameters(), lr=0.05)
    _torch_run(de, opt, 5, 1)
    de.checkpoint(tmp_path / "ck")
    _torch_run(de, opt, 4, 6)
    # a fresh table restored from the checkpoint
    de2 = DiskEmbedding(200, 6, state_dir=tmp_path / "de2", init="zeros", storage=kind)
    opt2 = DiskSparseAdam(de2.parameters(), lr=0.05)
    de2.load_checkpoint(tmp_path / "ck")
    assert de2.store.count == 5
    _torch_run(de2, opt2, 4, 6)
    assert records(de2.store).tobytes() == records(de.store).tobytes()
    # or a table opened on the checkpoint itself
    opt2.close()
    de2.close()
    de3 = DiskEmbedding(200, 6, state_dir=tmp_path / "ck", resume=True, storage=kind)
    opt3 = DiskSparseAdam(de3.parameters(), lr=0.05)
    assert (de3.store.count, de3.store.storage) == (5, kind)
    _torch_run(de3, opt3, 4, 6)
    assert records(de3.store).tobytes() == records(de.store).tobytes()
    wrong = DiskEmbedding(201, 6, state_dir=tmp_path / "wrong", storage=kind)
    with pytest.raises(ValueError, match="holds a 200 x 6 float32 table"):
        wrong.load_checkpoint(tmp_path / "ck")
    with pytest.raises(FileExistsError):
        de.checkpoint(tmp_path / "ck")
    for x in (opt, opt3, de, de3, wrong):
        x.close()


@pytest.mark.parametrize("in_jit", [False, True])
def test_jax_checkpoint_and_restore(tmp_path, in_jit, kind):
    pytest.importorskip("jax")
    from adapters import jax as dj

    def stores(root, durability="flush"):
        return {"user": dsa_core.create(root / "u", 300, 8, init="normal", seed=1,
                                        durability=durability, storage=kind),
                "item": dsa_core.create(root / "i", 200, 8, init="normal", seed=2,
                                        curvature=1.0, init_scale=0.01, storage=kind)}

    def run(tx, state, t0, steps):
        for t in range(t0, t0 + steps):
            iu, gu = cw.batch(t, num_rows=300, dim=8)
            ii, gi = cw.batch(t + 500, num_rows=200, dim=8)
            _, state = tx.update({"user": (iu, gu), "item": (ii, gi)}, state)
        return state

    tx = dj.sparse_adam(1e-2, in_jit=in_jit)
    st1 = tx.init(stores(tmp_path / "a"))
    st1 = run(tx, st1, 1, 6)
    assert dj.checkpoint(st1, tmp_path / "ck") == tmp_path / "ck"
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.json", "item", "user"]
    for k in ("user", "item"):
        snap = dsa_core.open(tmp_path / "ck" / k, mode="r")
        assert (snap.count, snap.storage) == (6, kind)
        dsa_core.close(snap)
    st1 = run(tx, st1, 7, 5)
    # restore into other stores (a journaled one among them) and replay the same batches
    st2 = tx.init(stores(tmp_path / "b", durability="step"))
    st2 = run(tx, st2, 100, 3)  # they have moved on elsewhere: restore replaces all of it
    st2 = dj.restore(st2, tmp_path / "ck")
    assert int(st2.count) == 6
    st2 = run(tx, st2, 7, 5)
    a, b = dj.core_states(st1), dj.core_states(st2)
    for k in ("user", "item"):
        assert a[k].count == b[k].count == 11
        assert records(a[k]).tobytes() == records(b[k]).tobytes()
    dj.close(st2)
    again = dsa_core.open(tmp_path / "b" / "u")  # nothing rolled back by a stale journal
    assert (again.count, again.storage) == (11, kind)
    assert records(again).tobytes() == records(a["user"]).tobytes()
    dsa_core.close(again)
    with pytest.raises(FileExistsError):
        dj.checkpoint(st1, tmp_path / "ck")
    with pytest.raises(ValueError, match="would replace or contain the live store"):
        dj.checkpoint(st1, tmp_path / "a", overwrite=True)
    dj.checkpoint(st1, tmp_path / "ck", overwrite=True)
    assert json.loads((tmp_path / "ck" / "checkpoint.json").read_text())["count"] == 11
    lone = tx.init(dsa_core.create(tmp_path / "lone", 300, 8, storage=kind))
    with pytest.raises(ValueError, match="the checkpoint holds the tables"):
        dj.restore(lone, tmp_path / "ck")
    dj.checkpoint(lone, tmp_path / "ck-lone")
    assert sorted(os.listdir(tmp_path / "ck-lone")) == ["checkpoint.json", "store"]
    dj.close(lone)
    dj.close(st1)


def test_restore_voids_a_stale_journal(tmp_path):
    """Restoring an older count into a journaled store must not let open() "roll back" the
    last step's journal over the restored rows (the adapters truncate the journal)."""
    pytest.importorskip("jax")
    from adapters import jax as dj

    tx = dj.sparse_adam(1e-2)
    state = tx.init(dsa_core.create(tmp_path / "s", 300, 8, init="normal", durability="step"))
    other = tx.init(dsa_core.create(tmp_path / "o", 300, 8, init="uniform", seed=5))
    other = _jax_steps(tx, other, 1, 2)
    dj.checkpoint(other, tmp_path / "ck")  # count 2
    state = _jax_steps(tx, state, 60, 3)  # the journal holds step 3's undo (count_before 2)
    assert journal_pending(tmp_path / "s", 2)  # would be, after a restore to count 2
    state = dj.restore(state, tmp_path / "ck")
    restored = dj.core_states(state).store.data.tobytes()
    dj.close(state)
    s = dsa_core.open(tmp_path / "s")
    assert s.count == 2
    assert s.store.data.tobytes() == restored
    dsa_core.close(s)
    dj.close(other)


def _jax_steps(tx, state, t0, steps):
    for t in range(t0, t0 + steps):
        _, state = tx.update(cw.batch(t, num_rows=300, dim=8), state)
    return state


# -- space --------------------------------------------------------------------------------------
@contextlib.contextmanager
def small_fs(where: Path, size: str = "4m"):
    """A fresh tmpfs of ``size`` at ``where``; skips the test where mounting is not allowed."""
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        gc.collect()  # mappings of closed stores go with their arrays
        if subprocess.run(["umount", str(where)], check=False,
                          capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(fs: Path) -> Path:
    """Write a filler file until the filesystem is full."""
    filler = fs / "filler"
    chunk = b"\xff" * (1 << 16)
    with open(filler, "wb", buffering=0) as f:
        while True:
            try:
                if f.write(chunk) < len(chunk):
                    break
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        for small in (4096, 512, 1):  # whatever partial page is left
            with contextlib.suppress(OSError):
                while f.write(b"\xff" * small) == small:
                    pass
    assert shutil.disk_usage(fs).free < 4096
    return filler


def test_create_on_a_too_small_filesystem_fails_clearly(tmp_path):
    with small_fs(tmp_path / "fs") as fs:
        free = shutil.disk_usage(fs).free
        need = 4096 + 40_000 * 3 * 16 * 4
        with pytest.raises(OSError, match=rf"not enough disk space for the store: it needs "
                                          rf"{need:,} bytes") as e:
            dsa_core.create(fs / "s", 40_000, 16)
        assert e.value.errno == errno.ENOSPC
        assert not (fs / "s" / "rows.dsa").exists()
        assert not (fs / "s" / "rows.dsa.tmp").exists()
        assert not (fs / "s" / "manifest.json").exists()
        assert shutil.disk_usage(fs).free == free  # the reservation was given back
        with pytest.raises(FileNotFoundError):
            dsa_core.open(fs / "s")
        s = dsa_core.create(fs / "s", 10_000, 16)  # a store that fits can be made there
        dsa_core.close(s)


FULL_FS_SCRIPT = textwrap.dedent("""
    import errno, os, sys
    sys.path.insert(0, sys.argv[3])
    import dsa_core, crash_worker as cw
    store, filler = sys.argv[1], sys.argv[2]
    s = dsa_core.open(store)
    for t in range(1, 21):                 # the file's space was reserved: no SIGBUS
        s = dsa_core.step(s, *cw.batch(t, num_rows=s.num_rows))
    try:
        dsa_core.flush(s)                  # the manifest needs a new block: a clean error
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
        print("flush ENOSPC")
    assert dsa_core.open(store, mode="r").count == 0   # the old manifest is intact
    os.remove(filler)
    dsa_core.flush(s)
    dsa_core.close(s)
    print("done", s.count)
""")


def test_steps_on_a_full_filesystem_do_not_sigbus(server, tmp_path):
    with small_fs(tmp_path / "fs") as fs:
        n = 15_000  # 2.9 MB of 4 MiB
        s = dsa_core.create(fs / "s", n, D, **cw.STORE_KW)
        dsa_core.close(s)
        filler = fill(fs)
        rc, lines, err = server.run(fs / "s", filler, REPO / "tests", code=FULL_FS_SCRIPT)
        assert rc == 0, f"rc {rc} (SIGBUS is -7):\n{err}"
        assert [" ".join(x) for x in lines[:2]] == ["flush ENOSPC", "done 20"]
        ref = dsa_core.create(tmp_path / "ref", n, D, **cw.STORE_KW)
        for t in range(1, 21):
            ref = dsa_core.step(ref, *cw.batch(t, num_rows=n))
        s = dsa_core.open(fs / "s", mode="r")
        assert s.count == 20
        assert s.store.data.tobytes() == ref.store.data.tobytes()
        dsa_core.close(s)
        dsa_core.close(ref)


def test_journaled_step_on_a_full_filesystem_writes_nothing(tmp_path, store_digest):
    """The journal of a first step needs new space: ENOSPC before any row is touched."""
    with small_fs(tmp_path / "fs") as fs:
        s = dsa_core.create(fs / "s", 15_000, D, durability="step", **cw.STORE_KW)
        filler = fill(fs)
        before = store_digest(fs / "s")
        with pytest.raises(OSError) as e:
            dsa_core.step(s, *cw.batch(1, num_rows=15_000))
        assert e.value.errno == errno.ENOSPC
        after = store_digest(fs / "s")
        after.pop("journal.dsa", None)  # created (empty) before the write failed
        assert after == before
        filler.unlink()
        s = dsa_core.step(s, *cw.batch(1, num_rows=15_000))  # and works once there is room
        assert s.count == 1
        dsa_core.close(s)


def test_journaled_step_that_fails_at_commit_can_be_retried(tmp_path):
    with small_fs(tmp_path / "fs") as fs:
        n = 15_000
        s = dsa_core.create(fs / "s", n, D, durability="step", **cw.STORE_KW)
        idx, g = cw.batch(1, num_rows=n)
        s = dsa_core.step(s, idx, g)  # the journal file now has room for a same-size step
        filler = fill(fs)
        idx2 = idx  # the same rows: the journal needs no new space
        g2 = cw.batch(2, num_rows=n, dim=D)[1][:idx.size]
        g2 = np.resize(g2, g.shape).astype(np.float32)
        with pytest.raises(OSError) as e:
            dsa_core.step(s, idx2, g2)
        assert e.value.errno == errno.ENOSPC
        filler.unlink()
        s = dsa_core.step(s, idx2, g2)  # the retry
        ref = dsa_core.create(tmp_path / "ref", n, D, **cw.STORE_KW)
        ref = dsa_core.step(dsa_core.step(ref, idx, g), idx2, g2)
        same = s.store.data.tobytes() == ref.store.data.tobytes()
        dsa_core.close(s)
        dsa_core.close(ref)
        assert same


SHORT_JOURNAL_SCRIPT = textwrap.dedent("""
    import errno, os, signal, sys
    sys.path.insert(0, sys.argv[3])
    import dsa_core, crash_worker as cw
    s = dsa_core.open(sys.argv[1])
    filler = sys.argv[2]
    os.truncate(filler, os.path.getsize(filler) - 8192)   # room for two pages only
    try:
        dsa_core.step(s, *cw.batch(1, num_rows=s.num_rows))
    except OSError as exc:
        print("step failed", errno.errorcode.get(exc.errno), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)                  # then the process dies
""")


def test_short_journal_write_on_a_nearly_full_filesystem_is_safe(server, tmp_path):
    with small_fs(tmp_path / "fs") as fs:
        n = 15_000
        s = dsa_core.create(fs / "s", n, D, durability="step", **cw.STORE_KW)
        dsa_core.close(s)
        filler = fill(fs)
        rc, lines, err = server.run(fs / "s", filler, REPO / "tests", code=SHORT_JOURNAL_SCRIPT)
        assert rc == -signal.SIGKILL, err
        filler.unlink()
        s = dsa_core.open(fs / "s")
        ref = dsa_core.create(tmp_path / "ref", n, D, **cw.STORE_KW)
        ref = dsa_core.step(ref, *cw.batch(1, num_rows=n)) if s.count == 1 else ref
        same = s.store.data.tobytes() == ref.store.data.tobytes()
        dsa_core.close(s)
        dsa_core.close(ref)
        assert same, f"count {s.count}, rows differ from the replay ({lines})"


# -- property: reopening changes nothing ---------------------------------------------------------
ACTIONS = ("none", "none", "none", "reopen", "flush", "checkpoint", "read-only")


@st.composite
def reopen_plans(draw):
    c = draw(st.sampled_from([0.0, 1.0]))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    durability = draw(st.sampled_from(["flush", "step"]))
    n = draw(st.integers(1, 30))
    dim = draw(st.sampled_from([1, 3, 8]))
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        b = draw(st.integers(0, 12))
        idx = draw(st.lists(st.integers(0, n - 1), min_size=b, max_size=b))
        steps.append((np.array(idx, np.int64), draw(st.integers(0, 2**32 - 1)),
                      draw(st.sampled_from(ACTIONS))))
    return c, dtype, durability, n, dim, steps


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=reopen_plans())
def test_property_reopening_changes_nothing(tmp_path, plan):
    """close/open (or flush, or checkpoint then continue in the checkpoint) between steps at
    random positions gives a store bit-identical to one never reopened."""
    c, dtype, durability, n, dim, steps = plan
    root = tmp_path / uuid.uuid4().hex
    kw = {"curvature": c, "dtype": dtype, "durability": durability, "lr": 0.05,
          "init": "uniform", "init_scale": 0.3 if c else 1.0, "seed": n}
    a = dsa_core.create(root / "a", n, dim, **kw)
    b = dsa_core.create(root / "b", n, dim, **kw)
    for k, (idx, seed, action) in enumerate(steps):
        g = np.random.default_rng(seed).standard_normal((idx.size, dim)).astype(dtype)
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
        if action == "reopen":
            dsa_core.close(b)
            b = dsa_core.open(b.path)
        elif action == "flush":
            dsa_core.flush(b)
        elif action == "checkpoint":
            dest = root / f"ck{k}"
            dsa_core.checkpoint(b, dest)
            dsa_core.close(b)
            b = dsa_core.open(dest)  # training continues in the snapshot
        elif action == "read-only":
            ro = dsa_core.open(b.path, mode="r")
            assert ro.store.data.tobytes() == a.store.data.tobytes()
            dsa_core.close(ro)
        assert b.count == a.count == k + 1
    assert b.store.data.tobytes() == a.store.data.tobytes()
    pa, pb = a.path, b.path
    dsa_core.close(a)
    dsa_core.close(b)
    assert (pa / "rows.dsa").read_bytes() == (pb / "rows.dsa").read_bytes()
    assert json.loads((pa / "manifest.json").read_text()) == \
        json.loads((pb / "manifest.json").read_text())
