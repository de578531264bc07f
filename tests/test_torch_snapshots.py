"""torch's state-dict convention on log stores: ``torch.save(opt.state_dict())`` is a checkpoint.

A log store's ``state_dict()`` (the optimizer's and the DiskEmbedding module's) snapshots the
store (hard links to its immutable segments) and names the snapshot; ``load_state_dict``
restores exactly that point: rows, m, v, counts and param groups, bit for bit, after the
cleaner has deleted segments from the live store, and in a new process. Every log store here
gets a region far smaller than its table, so rows are evicted, sealed and cleaned.
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
from dsa_core import _log

from adapters.torch import DiskEmbedding, DiskSparseAdam

nn = torch.nn
N, D = 300, 8
SLOTS = 40
REPO = Path(__file__).resolve().parents[1]
SNAP = ".dsa-snapshots"


def region(weights=True) -> int:
    """A region of SLOTS records for an N x D float32 store (weights and moments, or
    moments only)."""
    stride = (3 if weights else 2) * D
    return _log.memory_for({"num_rows": N, "stride": stride, "dtype": "float32"}, SLOTS)


def build(root: Path, resume=False, **kw):
    """A DiskEmbedding and an nn.Embedding, both on log stores, under one DiskSparseAdam
    with two param groups and an LR scheduler."""
    emb = DiskEmbedding(N, D, state_dir=root / "emb", seed=1, storage="log",
                        memory=region(), resume=resume, **kw)
    lin = nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(N, D, generator=torch.Generator().manual_seed(2)))
    opt = DiskSparseAdam([{"params": [emb.weight]}, {"params": [lin.weight], "lr": 0.02}],
                         lr=0.05, state_dir=root / "opt", storage="log",
                         memory=region(weights=False), resume=resume, **kw)
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


def test_optimizer_state_dict_is_a_checkpoint_on_log_stores(tmp_path):
    emb, lin, opt, sched = build(tmp_path / "run")
    ref = build(tmp_path / "ref")
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
    # training goes on far enough that the cleaner deletes segments the snapshot links
    first = segment_files(next(snaps[1].glob("opt-*")))
    run(emb, lin, opt, sched, batches(20, seed=7))
    opt.flush()  # a committed segment's file goes once a newer manifest no longer lists it
    assert first - segment_files(tmp_path / "run" / "emb"), "no segment was deleted"
    assert all(s.store.engine.stats()["segments"] for s in stores(opt))
    assert [s.count for s in stores(opt)] == [25, 25]
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


def test_module_state_dict_of_a_log_table_is_a_checkpoint(tmp_path):
    emb, lin, opt, sched = build(tmp_path)
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
    import sys
    sys.path.insert(0, sys.argv[2])
    sys.path.insert(0, sys.argv[3])
    from pathlib import Path
    import numpy as np, torch, dsa_core
    from test_torch_snapshots import batches, build, run, stores
    root = Path(sys.argv[1])
    emb, lin, opt, sched = build(root / "run")
    run(emb, lin, opt, sched, batches(4))
    torch.save({"opt": opt.state_dict(), "model": emb.state_dict(),
                "lin": lin.state_dict()}, root / "ck.pt")
    np.savez(root / "at4.npz", *[dsa_core.read_records(s, np.arange(s.num_rows))
                                 for s in stores(opt)])
    run(emb, lin, opt, sched, batches(8, seed=5))
    opt.close(); emb.close()
""")


def test_state_dict_across_a_process_restart(tmp_path):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(REPO),
                        str(REPO / "tests")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    emb, lin, opt, sched = build(tmp_path / "run", resume=True)
    assert [s.count for s in stores(opt)] == [12, 12]
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    opt.load_state_dict(ck["opt"])
    at4 = np.load(tmp_path / "at4.npz")
    for s, k in zip(stores(opt), at4.files):
        assert s.count == 4
        np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)).view(np.uint32),
                                      at4[k].view(np.uint32))
    # the module's state dict from the other process restores the table alone, too
    run(emb, lin, opt, sched, batches(2, seed=8))
    emb.load_state_dict(ck["model"])
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)),
                                  at4[at4.files[0]])
    opt.close()
    emb.close()


def test_retention_release_and_a_snapshot_that_is_gone(tmp_path):
    emb, lin, opt, sched = build(tmp_path, keep_snapshots=2)
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


def test_a_moved_state_dir_finds_its_snapshots(tmp_path):
    emb, lin, opt, sched = build(tmp_path / "a")
    run(emb, lin, opt, sched, batches(3))
    sd = opt.state_dict()
    saved = snapshot_of(opt)
    run(emb, lin, opt, sched, batches(3, seed=4))
    opt.close()
    emb.close()
    os.rename(tmp_path / "a", tmp_path / "b")
    emb, lin, opt, sched = build(tmp_path / "b", resume=True)
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


def test_in_place_stores_take_no_snapshots(tmp_path):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", seed=0)
    opt = DiskSparseAdam(emb.parameters(), lr=0.05)
    emb(torch.tensor([1, 2])).sum().backward()
    opt.step()
    sd, msd = opt.state_dict(), emb.state_dict()
    assert "state_snapshot" not in sd["dsa_manifest"]["params"][0]
    assert "state_snapshot" not in msd["_extra_state"]
    assert not (tmp_path / SNAP).exists()
    assert opt.release_snapshots() == 0 and emb.release_snapshots() == 0
    opt.close()
    emb.close()
