"""ShardedDiskEmbedding and the resharder on log-structured shards (storage="log").

Every log shard gets a region far smaller than its rows, so rows are evicted, sealed into
segments and read back during the runs. The oracle is the same run on in-place shards:
training, checkpoints, resumes and reshards must give the same records, bit for bit.

Scenario L (2 gloo processes, launched as in ``tests/test_distributed.py``): in-place and log
shards trained side by side on the same batches, both checkpointed at step K1; the log run
resumed from its checkpoint in a new state_dir; resuming a store of the other kind refused on
every rank. The in-process tests use a gloo group of one rank.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import dsa_core
from dsa_core import _layout

from test_distributed import Launch, join_group, one_rank, result, tree  # noqa: F401

HERE = Path(__file__).resolve()
N, D, PAD = 200, 8, 5
K1, K = 3, 6
LR = 0.05
SLOTS = 48  # region slots of each log shard: a step brings a shard at most 48 distinct rows


def memory(slots: int = SLOTS, **opts) -> int:
    """A region budget of ``slots`` records of a weights-and-moments float32 store."""
    lay = _layout.make_layout(N, D, np.dtype(np.float32), 0.0, True, 0, **opts)
    return dsa_core.region_memory(lay, slots)


def init_table() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal((N, D)) * 0.5).astype(np.float32)


def batch(step: int, rank: int) -> np.ndarray:
    """24 ids of ``rank`` at ``step``, duplicates within and across ranks, the padding row."""
    ids = np.random.default_rng([step, rank]).integers(0, N, (6, 4), dtype=np.int64)
    ids[0, :2] = 0
    ids[1, 0] = PAD
    return ids


def loss_of(x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    tgt = np.random.default_rng([1000 + step, rank]).standard_normal(tuple(x.shape))
    return (x.tanh() * torch.from_numpy(tgt.astype(np.float32))).sum()


def train(emb, opt, steps, rank: int = 0) -> None:
    for step in steps:
        loss_of(emb(torch.from_numpy(batch(step, rank))), step, rank).backward()
        opt.step()
        opt.zero_grad()


def records(root: Path, world: int, plan: str = "mod") -> tuple[np.ndarray, list, list]:
    """The global table's whole records, and each shard's count and kind, under ``root``."""
    from adapters.torch_dist import ShardPlan

    sp = ShardPlan(N, world, plan)
    out, counts, kinds = None, [], []
    for k in range(world):
        st = dsa_core.open(root / f"rank{k}", mode="r")
        rec = dsa_core.read_records(st, np.arange(st.num_rows))
        if out is None:
            out = np.zeros((N, rec.shape[1]), rec.dtype)
        out[sp.global_ids(k, np.arange(st.num_rows))] = rec
        counts.append(st.count)
        kinds.append(st.storage)
        dsa_core.close(st)
    return out, counts, kinds


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))  # bit for bit


def evicted(state) -> bool:
    st = state.store.engine.stats()
    return st["segments"] > 0 and st["slots"] < state.num_rows


# -- scenario L: 2 processes ----------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, tmp: Path) -> None:
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    join_group(rank, world, port)
    out: dict = {"refused": []}
    log = {"storage": "log", "memory": memory()}
    ei = ShardedDiskEmbedding(N, D, state_dir=tmp / "Li", padding_idx=PAD, init=init_table())
    el = ShardedDiskEmbedding(N, D, state_dir=tmp / "Ll", padding_idx=PAD, init=init_table(),
                              **log)
    oi = DiskSparseAdam(ei.parameters(), lr=LR)
    ol = DiskSparseAdam(el.parameters(), lr=LR)
    for step in range(1, K + 1):
        train(ei, oi, [step], rank)
        train(el, ol, [step], rank)
        if step == K1:
            ei.checkpoint(tmp / "ckLi")
            el.checkpoint(tmp / "ckLl")
    out["storage"] = [ei.store.storage, el.store.storage]
    out["evicted"] = evicted(el.store)
    for x in (oi, ol, ei, el):
        x.close()
    # the log checkpoint resumed in a new state_dir: the same steps again
    er = ShardedDiskEmbedding(N, D, state_dir=tmp / "Lr", padding_idx=PAD,
                              resume_from=tmp / "ckLl", **log)
    out["resumed_at"] = er.store.count
    opt = DiskSparseAdam(er.parameters(), lr=LR)
    train(er, opt, range(K1 + 1, K + 1), rank)
    out["resumed_storage"] = er.store.storage
    opt.close()
    er.close()
    # a store of the other kind: refused on every rank, nothing written
    for kw in ({"state_dir": tmp / "Ll", "resume": True, "storage": "inplace"},
               {"state_dir": tmp / "Lx", "resume_from": tmp / "ckLi", **log}):
        try:
            ShardedDiskEmbedding(N, D, padding_idx=PAD, **kw).close()
            out["refused"].append(None)
        except ValueError as exc:
            out["refused"].append(str(exc))
    e = ShardedDiskEmbedding(N, D, state_dir=tmp / "Ll", padding_idx=PAD, resume=True, **log)
    out["count"] = e.store.count
    e.close()
    (tmp / f"L_rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)  # as scenario R of test_distributed.py: no teardown after refused builds


def test_two_processes_log_shards_match_inplace(tmp_path):
    """2 gloo processes: log shards == in-place shards (training, checkpoint, resume_from),
    a store of the other kind is refused on every rank, and both checkpoints reshard to the
    same records."""
    from adapters.torch_reshard import reshard

    t0 = time.monotonic()
    launch = Launch("L", 2, tmp_path, script=HERE)
    try:
        assert launch.wait(t0 + 90) == [0, 0], launch.output()
    finally:
        launch.close()
    res = [result(tmp_path, "L", r) for r in range(2)]
    for r in range(2):
        assert res[r]["storage"] == ["inplace", "log"] and res[r]["evicted"]
        assert res[r]["resumed_at"] == K1 and res[r]["resumed_storage"] == "log"
        assert res[r]["count"] == K
        live, ckpt = res[r]["refused"]
        assert "storage='log' store, but storage='inplace' was asked for" in live
        assert "storage='inplace' store, but storage='log' was asked for" in ckpt
        assert "torch_reshard" in ckpt and "nothing was written" in ckpt
    assert not (tmp_path / "Lx").exists()
    ref, counts, kinds = records(tmp_path / "Li", 2)
    assert counts == [K, K] and kinds == ["inplace"] * 2
    for root in ("Ll", "Lr"):
        got, counts, kinds = records(tmp_path / root, 2)
        assert counts == [K, K] and kinds == ["log"] * 2
        assert_same(got, ref)
    snap = dsa_core.open(tmp_path / "Li" / "rank1", mode="r")
    lay = snap.layout
    dsa_core.close(snap)
    assert not ref[PAD, lay["w"]:lay["w"] + D].any()  # the padding row: zeroed, never stepped
    ck_i, _, _ = records(tmp_path / "ckLi", 2)
    ck_l, counts, kinds = records(tmp_path / "ckLl", 2)
    assert counts == [K1, K1] and kinds == ["log"] * 2
    assert_same(ck_l, ck_i)
    # offline reshards of the two checkpoints: 2 -> 3 (range) and 2 -> 1, each keeps its kind
    for world, plan in ((3, "range"), (1, "mod")):
        for kind in ("i", "l"):
            reshard(tmp_path / f"ckL{kind}", tmp_path / f"rs{kind}{world}", world, plan)
        a, ca, ka = records(tmp_path / f"rsi{world}", world, plan)
        b, cb, kb = records(tmp_path / f"rsl{world}", world, plan)
        assert ca == cb == [K1] * world
        assert ka == ["inplace"] * world and kb == ["log"] * world
        assert_same(a, ck_i)
        assert_same(b, ck_i)


# -- one rank, in this process (the fixture one_rank of test_distributed.py) ---------------------
def build(root: Path, kind: str, **kw):
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    log = {"storage": "log", "memory": memory()} if kind == "log" else {}
    emb = ShardedDiskEmbedding(N, D, state_dir=root, padding_idx=PAD, **log, **kw)
    return emb, DiskSparseAdam(emb.parameters(), lr=LR)


def test_one_rank_log_shard_resume_and_state_dict(tmp_path, one_rank):
    """One rank: resume=True and resume_from= on log shards continue exactly as in-place
    shards do; the state dict entry and extra_repr work the same."""
    runs = {}
    for kind in ("inplace", "log"):
        emb, opt = build(tmp_path / kind, kind, init=init_table())
        train(emb, opt, range(1, 4))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        train(emb, opt, range(4, 6))
        sd = emb.state_dict()
        assert sd["_extra_state"]["count"] == 5
        opt.close()
        emb.close()
        emb, opt = build(tmp_path / kind, kind, resume=True)  # continues at step 5
        emb.load_state_dict(sd)
        train(emb, opt, range(6, 8))
        assert emb.store.storage == kind and emb.store.count == 7
        runs[kind] = dsa_core.read_records(emb.store, np.arange(N))
        if kind == "log":
            assert evicted(emb.store)
        opt.close()
        emb.close()
        emb, opt = build(tmp_path / f"from-{kind}", kind, resume_from=tmp_path / f"ck-{kind}")
        train(emb, opt, range(4, 8))
        assert emb.store.count == 7
        assert_same(dsa_core.read_records(emb.store, np.arange(N)), runs[kind])
        opt.close()
        emb.close()
    assert_same(runs["log"], runs["inplace"])


@pytest.mark.parametrize("kw, exc, match", [
    ({"storage": "inplace", "memory": "1MiB"}, ValueError, "memory= is for storage='log'"),
    ({"storage": "lsm"}, ValueError, "storage must be one of"),
    ({"storage": "log", "memory": "lots"}, ValueError, "memory must be a number of bytes"),
])
def test_bad_storage_options_write_nothing(tmp_path, one_rank, kw, exc, match):
    from adapters.torch_dist import ShardedDiskEmbedding

    with pytest.raises(exc, match=match) as err:
        ShardedDiskEmbedding(N, D, state_dir=tmp_path / "emb", **kw)
    assert "ShardedDiskEmbedding" in str(err.value)
    assert not (tmp_path / "emb").exists()


def test_other_kind_is_refused_and_nothing_written(tmp_path, one_rank):
    """resume=True and resume_from= on a store of the other kind: refused, untouched."""
    from adapters.torch_dist import ShardedDiskEmbedding

    for kind in ("inplace", "log"):
        emb, opt = build(tmp_path / kind, kind, init=init_table())
        train(emb, opt, range(1, 3))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        opt.close()
        emb.close()
    before = tree(tmp_path)
    for have, want in (("inplace", "log"), ("log", "inplace")):
        log = {"storage": "log", "memory": memory()} if want == "log" else {"storage": "inplace"}
        for kw in ({"state_dir": tmp_path / have, "resume": True},
                   {"state_dir": tmp_path / want, "resume_from": tmp_path / f"ck-{have}"}):
            with pytest.raises(ValueError, match=rf"storage='{have}' store, but "
                                                 rf"storage='{want}' was asked for"):
                ShardedDiskEmbedding(N, D, padding_idx=PAD, **log, **kw)
    assert tree(tmp_path) == before
    for have in ("inplace", "log"):  # storage="auto" (the default) resumes either kind
        mem = {"memory": memory()} if have == "log" else {}
        emb = ShardedDiskEmbedding(N, D, state_dir=tmp_path / have, padding_idx=PAD,
                                   resume=True, **mem)
        assert emb.store.storage == have and emb.store.count == 2
        emb.close()
    # overwrite=True replaces a shard of the other kind
    emb = ShardedDiskEmbedding(N, D, state_dir=tmp_path / "inplace", padding_idx=PAD,
                               overwrite=True, storage="log", memory=memory(), init="zeros")
    assert emb.store.storage == "log" and emb.store.count == 0
    emb.close()


def test_reshard_between_kinds_and_resume(tmp_path, one_rank):
    """reshard keeps a checkpoint's kind or converts it (--storage), bit for bit; a
    converted checkpoint resumes and trains as the original; mixed kinds are refused."""
    from adapters.torch_reshard import main, reshard

    for kind in ("inplace", "log"):
        emb, opt = build(tmp_path / kind, kind, init=init_table())
        train(emb, opt, range(1, 4))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        train(emb, opt, range(4, 7))
        opt.close()
        emb.close()
    ref, _, _ = records(tmp_path / "inplace", 1)
    ck, _, _ = records(tmp_path / "ck-inplace", 1)
    # the CLI: in-place -> log, 1 -> 3 ranks; log -> in-place, 1 -> 2 ranks (range)
    assert main([str(tmp_path / "ck-inplace"), str(tmp_path / "to-log3"), "--world-size", "3",
                 "--storage", "log", "--memory", "1MiB"]) == 0
    reshard(tmp_path / "ck-log", tmp_path / "to-ip2", 2, "range", storage="inplace")
    for root, world, plan, kind in (("to-log3", 3, "mod", "log"),
                                    ("to-ip2", 2, "range", "inplace")):
        got, counts, kinds = records(tmp_path / root, world, plan)
        assert counts == [3] * world and kinds == [kind] * world
        assert_same(got, ck)
    # same world size, other kind: a converted checkpoint that resumes on one rank
    reshard(tmp_path / "ck-inplace", tmp_path / "conv", 1, storage="log")
    emb, opt = build(tmp_path / "resumed", "log", resume_from=tmp_path / "conv")
    train(emb, opt, range(4, 7))
    assert emb.store.storage == "log"
    assert_same(dsa_core.read_records(emb.store, np.arange(N)), ref)
    opt.close()
    emb.close()
    # refused before anything is written
    with pytest.raises(ValueError, match="memory= is for storage='log'"):
        reshard(tmp_path / "ck-inplace", tmp_path / "bad1", 2, memory="1MiB")
    with pytest.raises(ValueError, match="storage must be one of"):
        reshard(tmp_path / "ck-inplace", tmp_path / "bad2", 2, storage="lsm")
    mixed = tmp_path / "mixed"
    reshard(tmp_path / "ck-log", mixed, 2)
    shutil.rmtree(mixed / "rank1")
    reshard(tmp_path / "ck-inplace", tmp_path / "ip2", 2)
    shutil.copytree(tmp_path / "ip2" / "rank1", mixed / "rank1")
    with pytest.raises(ValueError, match="different store kinds"):
        reshard(mixed, tmp_path / "bad3", 3)
    assert not any((tmp_path / b).exists() for b in ("bad1", "bad2", "bad3"))


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "worker":
    _worker(*map(int, sys.argv[3:6]), Path(sys.argv[6]))
