"""torch's state-dict convention on both store kinds: ``torch.save(opt.state_dict())`` is a
checkpoint.

``state_dict()`` (the optimizer's and the DiskEmbedding module's) snapshots every store, in
place or log-structured (a copy of the data file; hard links to a log store's immutable
segments), and names the snapshot; ``load_state_dict`` restores exactly that point: rows, m,
v, counts and param groups, bit for bit, after further training (on a log store after the
cleaner has deleted segments from the live store), and in a new process. A snapshot being
taken when the process is killed or interrupted leaves nothing a state dict could name.
Every test runs on both kinds (``kind``, or a loop over ``KINDS`` where one child process
serves both); every log store gets a region far smaller than its table, so rows are evicted,
sealed and cleaned.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from helpers import KINDS

from adapters.torch import DiskEmbedding, DiskSparseAdam
from adapters.torch import DiskWeight
from benchmarks._common import disk_bytes

nn = torch.nn
SMALL = DiskWeight.read_limit  # tables of at most this many bytes: rows in the state dict


@pytest.fixture(autouse=True)
def snapshotted(monkeypatch):
    """These tests are about snapshots: every table counts as large (its state dicts name
    snapshots); a test of small tables sets DiskWeight.read_limit back to SMALL."""
    monkeypatch.setattr(DiskWeight, "read_limit", 0)
N, D = 300, 8
SLOTS = 40
REPO = Path(__file__).resolve().parents[3]
SNAP = ".dsa-snapshots"


def region(weights=True) -> int:
    """A region of SLOTS records for an N x D float32 store (weights and moments, or
    moments only)."""
    stride = (3 if weights else 2) * D
    return dsa_core.region_memory({"num_rows": N, "stride": stride, "dtype": "float32"}, SLOTS)


def kind_args(kind: str, weights=True) -> dict:
    """The store-kind arguments of a table: a small region for a log store."""
    if kind == "log":
        return {"storage": "log", "memory": region(weights)}
    return {"storage": "inplace"}


def build(root: Path, kind: str, resume=False, **kw):
    """A DiskEmbedding and an nn.Embedding, both on stores of ``kind`` (``"mixed"``: the
    table in place, the optimizer's own store a log store), under one DiskSparseAdam with
    two param groups and an LR scheduler."""
    ek, ok = ("inplace", "log") if kind == "mixed" else (kind, kind)
    emb = DiskEmbedding(N, D, state_dir=root / "emb", seed=1, resume=resume,
                        **kind_args(ek), **kw)
    lin = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(2)))
    opt = DiskSparseAdam([{"params": [emb.weight]}, {"params": [lin.weight], "lr": 0.02}],
                         lr=0.05, state_dir=root / "opt", resume=resume,
                         **kind_args(ok, weights=False), **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return emb, lin, opt, sched


def batches(steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, N, (4, 8), generator=gen) for _ in range(steps)]


def run(emb, lin, opt, sched, xs):
    for x in xs:
        (emb(x).pow(2).sum() + (lin(x) - 1).pow(2).sum()).backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def stores(opt) -> list:
    return list(opt.stores.values())


def snapshot_of(opt) -> list:
    """Everything load_state_dict must bring back: each store's count and records (bytes)."""
    return [(s.count, dsa_core.read_records(s, np.arange(s.num_rows)).tobytes())
            for s in stores(opt)]


def segment_files(path: Path) -> set[str]:
    return {p.name for p in path.glob("seg-*")}


@pytest.mark.parametrize("kind", [*KINDS, "mixed"])
def test_optimizer_state_dict_is_a_checkpoint(tmp_path, kind):
    emb, lin, opt, sched = build(tmp_path / "run", kind)
    ref = build(tmp_path / "ref", kind)
    xs = batches(30)
    run(emb, lin, opt, sched, xs[:5])
    run(*ref, xs[:5])
    f = tmp_path / "ck.pt"
    torch.save({"opt": opt.state_dict(), "lin": lin.state_dict(),
                "sched": sched.state_dict()}, f)
    saved = snapshot_of(opt)
    groups = [dict(g, params=None) for g in opt.param_groups]
    snaps = [tmp_path / "run" / "opt" / SNAP / "group1_param0",
             tmp_path / "run" / SNAP / "emb"]
    assert all(len(list(p.glob("opt-*"))) == 1 for p in snaps)
    assert [s.storage for s in stores(opt)] == (["inplace", "log"] if kind == "mixed"
                                                else [kind, kind])
    # training goes on (on a log table, far enough that the cleaner deletes segments the
    # snapshot links; an in-place table's rows are overwritten where they lie)
    first = segment_files(next(snaps[1].glob("opt-*")))
    run(emb, lin, opt, sched, batches(20, seed=7))
    opt.flush()  # a committed segment's file goes once a newer manifest no longer lists it
    if kind == "log":
        assert first - segment_files(tmp_path / "run" / "emb"), "no segment was deleted"
    assert all(s.store.log_stats()["segments"] for s in stores(opt) if s.storage == "log")
    assert [s.count for s in stores(opt)] == [25, 25]
    assert snapshot_of(opt) != saved
    # back to step 5, exactly
    ck = torch.load(f, weights_only=True)
    opt.load_state_dict(ck["opt"])
    lin.load_state_dict(ck["lin"])
    sched.load_state_dict(ck["sched"])
    assert snapshot_of(opt) == saved  # counts and every record, bit for bit
    assert [dict(g, params=None) for g in opt.param_groups] == groups
    assert [opt.state[p]["step"] for p in (emb.weight, lin.weight)] == [5, 5]
    # and training from there is the uninterrupted run's
    run(emb, lin, opt, sched, xs[5:12])
    run(*ref, xs[5:12])
    assert snapshot_of(opt) == snapshot_of(ref[2])
    assert torch.equal(lin.weight, ref[1].weight)
    for o in (opt, ref[2]):
        o.close()
    for e in (emb, ref[0]):
        e.close()


def test_module_state_dict_is_a_checkpoint(tmp_path, kind):
    emb, lin, opt, sched = build(tmp_path, kind)
    run(emb, lin, opt, sched, batches(4))
    msd = emb.state_dict()
    assert msd["_extra_state"]["state_snapshot"]["count"] == 4
    at4 = dsa_core.read_records(emb.store, np.arange(N))
    run(emb, lin, opt, sched, batches(6, seed=3))
    emb.load_state_dict(msd)
    assert emb.store.count == 4
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)), at4)
    # the module's snapshots and the optimizer's are kept apart (one save takes both)
    opt.state_dict()
    root = tmp_path / SNAP / "emb"
    assert len(list(root.glob("emb-*"))) == 1 and len(list(root.glob("opt-*"))) == 1
    opt.close()
    emb.close()


CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[2])
    sys.path.insert(0, sys.argv[3])  # tests/: helpers
    sys.path.insert(0, sys.argv[3] + "/adapters/torch")  # this module
    from pathlib import Path
    import numpy as np, torch, dsa_core
    from test_torch_snapshots import batches, build, run, stores
    from adapters.torch import DiskWeight
    DiskWeight.read_limit = 0  # every table large: snapshots
    for kind in sys.argv[4:]:  # each kind in its own directory
        root = Path(sys.argv[1]) / kind
        root.mkdir()
        emb, lin, opt, sched = build(root / "run", kind)
        run(emb, lin, opt, sched, batches(4))
        torch.save({"opt": opt.state_dict(), "model": emb.state_dict(),
                    "lin": lin.state_dict()}, root / "ck.pt")
        np.savez(root / "at4.npz", *[dsa_core.read_records(s, np.arange(s.num_rows))
                                     for s in stores(opt)])
        run(emb, lin, opt, sched, batches(8, seed=5))
        opt.close(); emb.close()
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)  # every store is closed; the interpreter teardown would take ~2 s
""")


def test_state_dict_across_a_process_restart(tmp_path):
    """State dicts saved in another process (one child process runs both kinds, each in its
    own directory) load here: the optimizer's brings every store back to its step, the
    module's the table alone."""
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(REPO),
                        str(REPO / "tests"), *KINDS], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    for kind in KINDS:
        root = tmp_path / kind
        emb, lin, opt, sched = build(root / "run", kind, resume=True)
        assert [s.storage for s in stores(opt)] == [kind, kind]
        assert [s.count for s in stores(opt)] == [12, 12], kind
        ck = torch.load(root / "ck.pt", weights_only=True)
        opt.load_state_dict(ck["opt"])
        at4 = np.load(root / "at4.npz")
        for s, k in zip(stores(opt), at4.files):
            assert s.count == 4, kind
            np.testing.assert_array_equal(
                dsa_core.read_records(s, np.arange(N)).view(np.uint32),
                at4[k].view(np.uint32), err_msg=kind)
        # the module's state dict from the other process restores the table alone, too
        run(emb, lin, opt, sched, batches(2, seed=8))
        emb.load_state_dict(ck["model"])
        np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)),
                                      at4[at4.files[0]], err_msg=kind)
        opt.close()
        emb.close()


def test_retention_release_and_a_snapshot_that_is_gone(tmp_path, kind):
    emb, lin, opt, sched = build(tmp_path, kind, keep_snapshots=2)
    sds = []
    for k in range(3):
        run(emb, lin, opt, sched, batches(2, seed=k))
        sds.append(opt.state_dict())
    root = tmp_path / "opt" / SNAP / "group1_param0"
    kept = sorted(p.name for p in root.glob("opt-*"))
    assert kept == sorted(e["state_snapshot"]["id"] for sd in sds[1:]
                          for e in sd["dsa_manifest"]["params"][1:])
    before = snapshot_of(opt)
    with pytest.raises(ValueError, match=r"taken at step 2 and names the snapshot .* which "
                                         r"is gone .*keep_snapshots=2 here.* Nothing was changed"):
        opt.load_state_dict(sds[0])
    assert snapshot_of(opt) == before
    opt.load_state_dict(sds[1])  # still kept
    assert [s.count for s in stores(opt)] == [4, 4]
    assert opt.release_snapshots(keep=1) == 2  # one per store
    with pytest.raises(ValueError, match="which is gone"):
        opt.load_state_dict(sds[1])
    opt.load_state_dict(sds[2])
    assert opt.release_snapshots() == 2
    assert not (tmp_path / "opt" / SNAP).exists() and not (tmp_path / SNAP).exists()
    with pytest.raises(ValueError, match="which is gone"):
        opt.load_state_dict(sds[2])
    msd = emb.state_dict()
    assert emb.release_snapshots() == 1
    with pytest.raises(RuntimeError, match="which is gone"):
        emb.load_state_dict(msd)
    # checkpoints are no state-dict snapshots: opt.checkpoint takes none
    opt.checkpoint(tmp_path / "ck")
    assert not (tmp_path / "opt" / SNAP).exists() and not (tmp_path / SNAP).exists()
    with pytest.raises(ValueError, match="keep_snapshots must be an int >= 0"):
        opt.release_snapshots(keep=-1)
    opt.close()
    emb.close()


def test_a_moved_state_dir_finds_its_snapshots(tmp_path, kind):
    emb, lin, opt, sched = build(tmp_path / "a", kind)
    run(emb, lin, opt, sched, batches(3))
    sd = opt.state_dict()
    saved = snapshot_of(opt)
    run(emb, lin, opt, sched, batches(3, seed=4))
    opt.close()
    emb.close()
    os.rename(tmp_path / "a", tmp_path / "b")
    emb, lin, opt, sched = build(tmp_path / "b", kind, resume=True)
    opt.load_state_dict(sd)  # the state dict names /a/...; the snapshots are now under /b
    assert snapshot_of(opt) == saved
    opt.close()
    emb.close()


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_bad_keep_snapshots(tmp_path, bad):
    with pytest.raises(ValueError, match="keep_snapshots must be an int >= 0"):
        DiskEmbedding(N, D, state_dir=tmp_path / "e", keep_snapshots=bad)
    with pytest.raises(ValueError, match="keep_snapshots must be an int >= 0"):
        DiskSparseAdam(nn.Embedding(N, D, sparse=True).parameters(), state_dir=tmp_path / "o",
                       keep_snapshots=bad)
    assert not (tmp_path / "e").exists() and not any((tmp_path / "o").glob("group*"))


def test_keep_snapshots_0_state_dicts_are_descriptions(tmp_path, kind):
    """keep_snapshots=0: no snapshot on either kind; a state dict loads at its own step
    and is refused, nothing changed, once the stores have stepped on."""
    emb, lin, opt, sched = build(tmp_path, kind, keep_snapshots=0)
    run(emb, lin, opt, sched, batches(2))
    sd, msd = opt.state_dict(), emb.state_dict()
    assert all("state_snapshot" not in e for e in sd["dsa_manifest"]["params"])
    assert "state_snapshot" not in msd["_extra_state"]
    assert not (tmp_path / SNAP).exists() and not (tmp_path / "opt" / SNAP).exists()
    opt.load_state_dict(sd)  # the same step: accepted
    emb.load_state_dict(msd)
    run(emb, lin, opt, sched, batches(1, seed=9))
    before = snapshot_of(opt)
    with pytest.raises(ValueError, match=r"taken at step 2 of parameter \[0, 0\] .* is at "
                                         r"step 3.*nothing was changed.*names no snapshot "
                                         r"\(taken with keep_snapshots=0"):
        opt.load_state_dict(sd)
    with pytest.raises(RuntimeError, match=r"taken at step 2, but its store .* is at step 3.*"
                                           r"names no snapshot \(taken with "
                                           r"keep_snapshots=0"):
        emb.load_state_dict(msd)
    assert snapshot_of(opt) == before
    assert opt.release_snapshots() == 0 and emb.release_snapshots() == 0
    opt.close()
    emb.close()


# -- a snapshot cut short ----------------------------------------------------------------------
def cut_copy(action):
    """A stand-in for ``dsa_core._files.copy_file`` that copies the first half of the file
    (an in-place store's data file), then calls ``action()`` (a SIGKILL, or raising
    KeyboardInterrupt)."""
    def copy_file(src, dst):
        data = Path(src).read_bytes()
        Path(dst).write_bytes(data[:len(data) // 2])
        action()
    return copy_file


def cut_link(action):
    """A stand-in for ``dsa_core._log.commit._link_or_copy`` (a log store's snapshot links its
    segments and index base) that links the first file, then calls ``action()``."""
    def link_or_copy(src, dst, share=True):
        os.link(src, dst)
        action()
    return link_or_copy


def cut_delta(action):
    """A stand-in for ``dsa_core._inplace.snapshots._write_delta`` (an in-place snapshot on
    an earlier one: the rows changed since) that writes the first half of the delta file,
    then calls ``action()``."""
    def write_delta(path, data, rows, count):
        Path(path).write_bytes(np.ascontiguousarray(data[rows]).tobytes()[:rows.shape[0] // 2])
        action()
    return write_delta


def commit_cut(action):
    """A stand-in for ``dsa_core._files.commit_dir``: the staged snapshot is complete
    (manifest written, fsync'd), ``action()`` strikes before its rename."""
    def commit_dir(tmp, dest, overwrite):
        action()
    return commit_dir


def patch_cut(where: str, action) -> None:
    """Make the next snapshot stop at ``where`` ("copy" or "commit") with ``action``."""
    from dsa_core import _files
    from dsa_core._inplace import snapshots as _snapshots
    from dsa_core._inplace import store as _store
    from dsa_core._log import commit
    if where == "copy":  # the copies of the in-place engine's and the log engine's snapshots
        _store.copy_file = _snapshots.copy_file = cut_copy(action)
        commit._link_or_copy = cut_link(action)
        _snapshots._write_delta = cut_delta(action)  # an in-place snapshot on an earlier one
    else:
        _files.commit_dir = commit_cut(action)


def snapshot_dirs(root: Path) -> tuple[list[str], list[str]]:
    """(snapshot ids, staged leftovers) under both snapshot roots of a ``build`` in root."""
    names = [n for r in (root / SNAP / "emb", root / "opt" / SNAP / "group1_param0")
             if r.is_dir() for n in os.listdir(r)]
    return (sorted(n for n in names if ".tmp-" not in n),
            sorted(n for n in names if ".tmp-" in n))


def named(sd) -> list[str]:
    return sorted(e["state_snapshot"]["id"] for e in sd["dsa_manifest"]["params"])


KILL_CHILD = textwrap.dedent("""
    import os, signal, sys, traceback
    sys.path.insert(0, sys.argv[2])
    sys.path.insert(0, sys.argv[3])  # tests/: helpers
    sys.path.insert(0, sys.argv[3] + "/adapters/torch")  # this module
    from pathlib import Path
    import numpy as np, torch, torch._dynamo, dsa_core
    from test_torch_snapshots import batches, build, patch_cut, run, stores
    from adapters.torch import DiskWeight
    DiskWeight.read_limit = 0  # every table large: snapshots
    from dsa_core.tools import validation
    as_index = validation.as_index
    as_index([0], 1)  # numba's first kernel load (its registries: ~1 s) once, here; a plain
    # kernel (not parallel): no numba thread starts
    # one interpreter start for every case: each case is a process forked from this one
    # before it ran any torch computation (torch's thread pool does not exist yet;
    # torch._dynamo, which the first optimizer imports, is imported here once)
    for case in sys.argv[4:]:
        kind, where = case.split("-")
        pid = os.fork()
        if pid == 0:
            try:
                root = Path(sys.argv[1]) / case
                root.mkdir()
                emb, lin, opt, sched = build(root, kind)
                run(emb, lin, opt, sched, batches(3))
                torch.save({"opt": opt.state_dict(), "lin": lin.state_dict()}, root / "at3.pt")
                np.savez(root / "at3.npz", *[dsa_core.read_records(s, np.arange(s.num_rows))
                                             for s in stores(opt)])
                run(emb, lin, opt, sched, batches(2, seed=6))
                patch_cut(where, lambda: os.kill(os.getpid(), signal.SIGKILL))
                print("cutting", case, flush=True)
                opt.state_dict()
                print("survived", case, flush=True)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print("status", case, os.waitstatus_to_exitcode(status), flush=True)
    os._exit(0)  # this process opened no store; its interpreter teardown would take ~2 s
""")

KILL_CASES = [f"{kind}-{where}" for kind in KINDS for where in ("copy", "commit")]


def test_kill_9_while_a_snapshot_is_taken_leaves_none_to_name(tmp_path):
    """SIGKILL while opt.state_dict() snapshots a store (data half copied, or staged complete
    but not renamed), on each kind: no snapshot id appears that a state dict could name, the
    earlier state dict loads exactly, and the next snapshot deletes the dead process's
    leftover. (One child process; each case is a process it forks, killed by SIGKILL.)"""
    r = subprocess.run([sys.executable, "-c", KILL_CHILD, str(tmp_path), str(REPO),
                        str(REPO / "tests"), *KILL_CASES], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout.splitlines()
    for case in KILL_CASES:
        assert (f"cutting {case}" in out and f"survived {case}" not in out
                and f"status {case} -9" in out), (case, r.stdout, r.stderr[-2000:])
        kind, where = case.split("-")
        _check_after_kill(tmp_path / case, kind, where)


def _check_after_kill(root: Path, kind: str, where: str) -> None:
    ck = torch.load(root / "at3.pt", weights_only=True)
    ids, staged = snapshot_dirs(root)
    assert ids == named(ck["opt"])  # only the complete snapshots of step 3
    assert len(staged) == 1  # the one being taken, under its staging name
    leftover = next(p for p in (root / SNAP / "emb").iterdir() if ".tmp-" in p.name)
    assert (leftover / "manifest.json").is_file() == (where == "commit")
    emb, lin, opt, sched = build(root, kind, resume=True)
    assert [s.storage for s in stores(opt)] == [kind, kind]
    assert [s.count for s in stores(opt)] == [5, 5]  # state_dict() flushed before it died
    # a state dict naming the staged directory (none can: take() never returned) is refused
    forged = {**ck["opt"], "dsa_manifest": {**ck["opt"]["dsa_manifest"], "params": [
        dict(e) for e in ck["opt"]["dsa_manifest"]["params"]]}}
    e0 = forged["dsa_manifest"]["params"][0]
    e0["state_snapshot"] = {**e0["state_snapshot"], "id": leftover.name,
                            "path": str(leftover), "count": 5}
    e0["count"] = 5
    with pytest.raises(ValueError, match="which is gone"):
        opt.load_state_dict(forged)
    opt.load_state_dict(ck["opt"])
    at3 = np.load(root / "at3.npz")
    for s, k in zip(stores(opt), at3.files):
        assert s.count == 3
        np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)).view(np.uint32),
                                      at3[k].view(np.uint32))
    opt.state_dict()  # the next snapshot of that store deletes the dead process's leftover
    assert snapshot_dirs(root)[1] == []
    opt.close()
    emb.close()


@pytest.mark.parametrize("where", ["copy", "commit"])
def test_ctrl_c_while_a_snapshot_is_taken(tmp_path, kind, where, monkeypatch):
    """KeyboardInterrupt inside opt.state_dict(): the staged directory is removed, no
    snapshot appears, the stores train on, earlier state dicts load, later ones are taken."""
    from dsa_core import _files
    from dsa_core._inplace import snapshots as _snapshots
    from dsa_core._inplace import store as _store
    from dsa_core._log import commit
    emb, lin, opt, sched = build(tmp_path, kind)
    run(emb, lin, opt, sched, batches(3))
    sd3 = opt.state_dict()
    saved = snapshot_of(opt)
    run(emb, lin, opt, sched, batches(2, seed=6))

    def interrupt():
        raise KeyboardInterrupt

    for mod, name in ((_store, "copy_file"), (commit, "_link_or_copy"), (_files, "commit_dir"),
                      (_snapshots, "copy_file"), (_snapshots, "_write_delta")):
        monkeypatch.setattr(mod, name, getattr(mod, name))  # undone at the end of the test
    patch_cut(where, interrupt)
    with pytest.raises(KeyboardInterrupt):
        opt.state_dict()
    assert snapshot_dirs(tmp_path) == (named(sd3), [])
    monkeypatch.undo()
    run(emb, lin, opt, sched, batches(1, seed=8))
    sd6 = opt.state_dict()
    at6 = snapshot_of(opt)
    opt.load_state_dict(sd3)
    assert snapshot_of(opt) == saved
    opt.load_state_dict(sd6)
    assert snapshot_of(opt) == at6
    opt.close()
    emb.close()


# -- a checkpoint carries the snapshots its extra= names -----------------------------------------
def test_readme_checkpoints_restore_from_the_oldest_after_a_move(tmp_path, kind):
    """The README pattern, five epochs of opt.checkpoint(f"ckpts/ep{e}", extra={"model":
    model.state_dict(), ...}); then the run directory is deleted and the checkpoint folder
    moved (a rename) and copied (another disk): the OLDEST checkpoint restores exactly, into
    a new state_dir and into the old path made afresh."""
    import shutil
    run_dir = tmp_path / "run"
    emb, lin, opt, sched = build(run_dir, kind)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    at = []
    for e in range(5):
        run(emb, lin, opt, sched, batches(2, seed=e))
        extra = {"model": model.state_dict(), "sched": sched.state_dict()}
        before = extra["model"]["emb._extra_state"]["state_snapshot"]["path"]
        opt.checkpoint(tmp_path / "ckpts" / f"ep{e}", extra=extra)
        assert extra["model"]["emb._extra_state"]["state_snapshot"]["path"] == before
        at.append((snapshot_of(opt), lin.weight.detach().clone()))
    opt.close()
    emb.close()
    shutil.rmtree(run_dir)
    (tmp_path / "moved").mkdir()
    os.rename(tmp_path / "ckpts", tmp_path / "moved" / "ckpts")
    shutil.copytree(tmp_path / "moved" / "ckpts", tmp_path / "copied")
    for ck, root in ((tmp_path / "moved" / "ckpts" / "ep0", tmp_path / "new"),
                     (tmp_path / "copied" / "ep0", run_dir)):
        emb, lin, opt, sched = build(root, kind)
        model = nn.ModuleDict({"emb": emb, "lin": lin})
        run(emb, lin, opt, sched, batches(3, seed=9))  # somewhere else than epoch 0
        extra = opt.load_checkpoint(ck)
        model.load_state_dict(extra["model"])
        sched.load_state_dict(extra["sched"])
        assert snapshot_of(opt) == at[0][0]
        assert torch.equal(lin.weight.detach(), at[0][1])
        opt.close()
        emb.close()


def test_a_checkpoint_refuses_an_extra_whose_snapshot_is_gone(tmp_path, kind):
    emb, lin, opt, sched = build(tmp_path / "run", kind, keep_snapshots=1)
    run(emb, lin, opt, sched, batches(1))
    old = emb.state_dict()
    run(emb, lin, opt, sched, batches(1, seed=1))
    emb.state_dict()  # keep_snapshots=1: old's snapshot is pruned
    with pytest.raises(ValueError, match=r"names the snapshot .* which is gone.*Nothing was "
                                         r"written.*just before the checkpoint"):
        opt.checkpoint(tmp_path / "ck", extra={"model": old})
    assert not (tmp_path / "ck").exists() and not list(tmp_path.glob("ck.tmp-*"))
    opt.close()
    emb.close()


# -- best.pt: torch.save(model.state_dict()) and later state dicts -------------------------------
def epochs_of_state_dicts(root: Path, kind: str, tmp: Path):
    """Epoch 0 saved to best.pt (model and optimizer), then four more epochs each taking the
    model's and the optimizer's state dicts (as logging or a Lightning callback would)."""
    emb, lin, opt, sched = build(root, kind)
    model = nn.ModuleDict({"emb": emb, "lin": lin})
    run(emb, lin, opt, sched, batches(2))
    torch.save(model.state_dict(), tmp / "best.pt")
    torch.save(opt.state_dict(), tmp / "best-opt.pt")
    best = (snapshot_of(opt), lin.weight.detach().clone())
    for e in range(4):
        run(emb, lin, opt, sched, batches(2, seed=e + 1))
        model.state_dict()
        opt.state_dict()
    return emb, lin, opt, sched, model, best


def test_best_pt_of_a_small_table_holds_its_rows(tmp_path, kind, monkeypatch):
    """A small table (at most DiskWeight.read_limit bytes of weights) puts its rows into the
    state dicts, as nn.Embedding and SparseAdam do: best.pt loads exactly after four more
    epochs of state dicts, and no snapshot is taken."""
    monkeypatch.setattr(DiskWeight, "read_limit", SMALL)
    emb, lin, opt, sched, model, best = epochs_of_state_dicts(tmp_path / "run", kind, tmp_path)
    assert not (tmp_path / "run" / SNAP).exists()
    assert not (tmp_path / "run" / "opt" / SNAP).exists()
    sd = torch.load(tmp_path / "best.pt", weights_only=True)
    assert sd["emb.weight"].shape == (N, D)  # the weights, where nn.Embedding has them
    model.load_state_dict(sd)
    opt.load_state_dict(torch.load(tmp_path / "best-opt.pt", weights_only=True))
    assert snapshot_of(opt) == best[0]
    assert torch.equal(lin.weight.detach(), best[1])
    # the module's state dict alone restores the table (weights, m, v, count) too
    run(emb, lin, opt, sched, batches(1, seed=7))
    model.load_state_dict(sd)
    assert snapshot_of(opt)[0] == best[0][0]
    assert torch.equal(model.state_dict()["emb.weight"], emb.to_tensor())
    # a state dict of the snapshot format (taken as a large table) still loads
    monkeypatch.setattr(DiskWeight, "read_limit", 0)
    old = model.state_dict()
    assert "state_snapshot" in old["emb._extra_state"] and "emb.weight" not in old
    monkeypatch.setattr(DiskWeight, "read_limit", SMALL)
    run(emb, lin, opt, sched, batches(1, seed=8))
    model.load_state_dict(old)
    assert snapshot_of(opt)[0] == best[0][0]
    # a state dict of another table is refused, nothing changed
    bad = type(sd)(sd)
    bad._metadata = sd._metadata  # the rest of the records (m, v) rides in the metadata
    bad["emb.weight"] = sd["emb.weight"][:, :-1]
    with pytest.raises(RuntimeError, match=r"rows must be the 300 x \d+ float32 records"):
        model.load_state_dict(bad)
    with pytest.raises(RuntimeError, match=r"size mismatch for emb.weight|size mismatch for "
                                           r"weight: .* \(300, 7\), the DiskEmbedding is"):
        model.load_state_dict(dict(bad))  # a plain dict: an nn.Embedding's weight, checked
    assert snapshot_of(opt)[0] == best[0][0]
    opt.close()
    emb.close()


def test_best_pt_of_a_large_table_says_why_it_is_gone(tmp_path, kind):
    """A large table's best.pt names a snapshot that four more epochs of state dicts pruned
    (keep_snapshots=3): loading it fails, nothing changed, with the snapshot, how many newer
    ones pruned it, and what to do (keep_snapshots=, opt.checkpoint)."""
    emb, lin, opt, sched, model, best = epochs_of_state_dicts(tmp_path / "run", kind, tmp_path)
    before = snapshot_of(opt)
    sd = torch.load(tmp_path / "best.pt", weights_only=True)
    sid = sd["emb._extra_state"]["state_snapshot"]["id"]
    with pytest.raises(RuntimeError, match=rf"names the snapshot '{sid}' .* which is gone .*"
                                           r"pruned after 3 newer state dict\(s\) "
                                           r".*keep_snapshots=3.*Nothing was changed"
                                           r".*opt\.checkpoint\(dest"):
        model.load_state_dict(sd)
    with pytest.raises(ValueError, match=r"pruned after 3 newer state dict\(s\).*opt\.checkpoint"):
        opt.load_state_dict(torch.load(tmp_path / "best-opt.pt", weights_only=True))
    assert snapshot_of(opt) == before
    opt.close()
    emb.close()


def test_in_place_state_dicts_and_checkpoints_share_the_table(tmp_path):
    """Five epochs of model + optimizer state dicts and checkpoints of a large in-place
    DiskEmbedding take the table about once on disk (each snapshot after the first: a chain
    on the last one, the rows changed since), not a copy per snapshot; the oldest checkpoint
    and the newest state dict still restore exactly."""
    rows = 20_000
    emb = DiskEmbedding(rows, D, state_dir=tmp_path / "run" / "emb", seed=1, storage="inplace")
    opt = DiskSparseAdam(emb.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    at = []
    for e in range(5):
        for _ in range(2):
            emb(torch.randint(0, rows, (64,), generator=gen)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        torch.save({"model": emb.state_dict(), "optim": opt.state_dict()},
                   tmp_path / f"sd{e}.pt")
        opt.checkpoint(tmp_path / "ckpts" / f"ep{e}", extra={"model": emb.state_dict()})
        st = stores(opt)[0]
        at.append((st.count, dsa_core.read_records(st, np.arange(rows)).tobytes()))
    table = (tmp_path / "run" / "emb" / "rows.dsa").stat().st_size
    used = disk_bytes(tmp_path / "run" / SNAP, tmp_path / "ckpts")  # not the live store
    assert used < 1.5 * table, (used, table)  # a copy per snapshot: 20 tables
    emb.load_state_dict(torch.load(tmp_path / "sd4.pt", weights_only=True)["model"])
    st = stores(opt)[0]
    assert (st.count, dsa_core.read_records(st, np.arange(rows)).tobytes()) == at[4]
    opt.load_checkpoint(tmp_path / "ckpts" / "ep0")
    st = stores(opt)[0]
    assert (st.count, dsa_core.read_records(st, np.arange(rows)).tobytes()) == at[0]
    opt.close()
    emb.close()
