"""The torch adapters on log-structured stores (storage="log"): bit-identical to in-place.

Every log store here gets a region far smaller than its table, so rows are evicted, sealed
into segments and read back during the run.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core


from adapters.torch import DiskEmbedding, DiskSparseAdam

nn = torch.nn
N, D = 300, 8
SLOTS = 60  # region slots of each log store: a batch has at most 48 distinct rows


def small_memory(num_rows=N, dim=D, **kw) -> int:
    """A budget of SLOTS record slots for a store of this shape (far fewer than N rows)."""
    probe = dsa_core.create(kw.pop("_path"), num_rows, dim, storage="log",
                            memory="1MiB", **kw)
    try:
        return dsa_core.region_memory(probe.layout, SLOTS)
    finally:
        dsa_core.close(probe)


@pytest.fixture
def mem(tmp_path):
    """The region budget of a weights-and-moments store of N x D float32 rows."""
    return small_memory(_path=tmp_path / "probe_w")


def batches(steps, seed=0, n=N):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, n, (6, 8), generator=gen)
        x[0, :4] = 3  # duplicates
        x[1, :3] = 5  # the padding row
        yield x


def all_rows(state):
    idx = np.arange(state.num_rows)
    return dsa_core.gather(state, idx), dsa_core.read_records(state, idx)


def assert_same_store(a, b):
    assert a.count == b.count
    wa, ra = all_rows(a)
    wb, rb = all_rows(b)
    np.testing.assert_array_equal(wa, wb)
    np.testing.assert_array_equal(ra.view(np.uint8), rb.view(np.uint8))  # bit for bit


def evicted(state) -> bool:
    st = state.store.engine.stats()
    return st["segments"] > 0 and st["slots"] < state.num_rows


def train(emb, opt, xs):
    for x in xs:
        emb(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("opts", [
    {},
    {"decay_missed_steps": True, "wd": 0.1},
    {"per_row_step": True, "mode": "sum"},
    {"curvature": 1.0},
    {"first_moment": "bfloat16"},
    {"first_moment": "bfloat16", "second_moment": "rowwise", "per_row_step": True},
    {"dtype": torch.float64, "decay_missed_steps": True, "wd": 0.1},
])
def test_disk_embedding_log_matches_inplace(tmp_path, mem, opts):
    opts = dict(opts)
    wd = opts.pop("wd", 0.0)
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(1)) * 0.1
    if opts.get("dtype") == torch.float64:
        init = init.double()
        mem = small_memory(_path=tmp_path / "probe64", dtype="float64", **{
            k: v for k, v in opts.items() if k == "decay_missed_steps"},
            decoupled_weight_decay=True)
    embs, opts_ = [], []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = DiskEmbedding(N, D, state_dir=tmp_path / kind, init=init, padding_idx=5,
                          **opts, **kw)
        o = DiskSparseAdam(e.parameters(), lr=0.05, weight_decay=wd,
                           decoupled_weight_decay=bool(opts.get("decay_missed_steps")))
        train(e, o, batches(15))
        embs.append(e)
        opts_.append(o)
    a, b = embs[0].store, embs[1].store
    assert b.storage == "log" and a.storage == "inplace"
    assert evicted(b)
    assert_same_store(a, b)
    np.testing.assert_array_equal(all_rows(b)[0][5], 0)  # padding row zeroed, never updated
    for o in opts_:
        o.close()
    for e in embs:
        e.close()


def test_optimizer_own_log_stores_match_inplace(tmp_path):
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(2))
    mem = small_memory(_path=tmp_path / "probe", weights=False)
    runs = []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = nn.Embedding(N, D, sparse=True, padding_idx=5)
        with torch.no_grad():
            e.weight.copy_(init)
        o = DiskSparseAdam(e.parameters(), lr=0.05, state_dir=tmp_path / kind, **kw)
        train(e, o, batches(15, seed=4))
        runs.append((e, o))
    (ea, oa), (eb, ob) = runs
    assert torch.equal(ea.weight, eb.weight)
    sa, sb = oa.store_for(ea.weight), ob.store_for(eb.weight)
    assert sb.storage == "log" and evicted(sb)
    ra = dsa_core.read_records(sa, np.arange(N))
    rb = dsa_core.read_records(sb, np.arange(N))
    np.testing.assert_array_equal(ra.view(np.uint32), rb.view(np.uint32))
    oa.close()
    ob.close()


def test_state_dicts_on_log_stores(tmp_path, mem):
    # keep_snapshots=0: a state dict is a description (on either kind)
    e0 = DiskEmbedding(N, D, state_dir=tmp_path / "e0", seed=0, storage="log", memory=mem,
                       keep_snapshots=0)
    o0 = DiskSparseAdam(e0.parameters(), lr=0.05, keep_snapshots=0)
    train(e0, o0, batches(4))
    sd0 = {"model": e0.state_dict(), "opt": o0.state_dict()}
    assert "state_snapshot" not in sd0["model"]["_extra_state"]
    assert not (tmp_path / ".dsa-snapshots").exists()
    e0.load_state_dict(sd0["model"])  # same step: accepted, nothing changes
    o0.load_state_dict(sd0["opt"])
    train(e0, o0, batches(1, seed=9))
    with pytest.raises(RuntimeError, match="taken at step 4"):
        e0.load_state_dict(sd0["model"])  # a description of step 4 is no snapshot
    with pytest.raises(ValueError, match="taken at step 4"):
        o0.load_state_dict(sd0["opt"])
    o0.close()
    e0.close()
    # by default a log store's state dict is a snapshot (tests/test_torch_snapshots.py)
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", seed=0, storage="log", memory=mem)
    opt = DiskSparseAdam(emb.parameters(), lr=0.05)
    train(emb, opt, batches(4))
    f = tmp_path / "sd.pt"
    torch.save({"model": emb.state_dict(), "opt": opt.state_dict()}, f)
    sd = torch.load(f, weights_only=True)
    at4 = dsa_core.read_records(emb.store, np.arange(N))
    train(emb, opt, batches(1, seed=9))
    emb.load_state_dict(sd["model"])  # back to step 4
    assert emb.store.count == 4
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)), at4)
    # An nn.Embedding state dict: its weights are copied into the log store, m and v kept
    before = dsa_core.read_records(emb.store, np.arange(N))
    w = torch.randn(N, D, generator=torch.Generator().manual_seed(3))
    emb.load_state_dict({"weight": w})
    after = dsa_core.read_records(emb.store, np.arange(N))
    np.testing.assert_array_equal(dsa_core.gather(emb.store, np.arange(N)), w.numpy())
    lay = emb.store.layout
    np.testing.assert_array_equal(np.delete(after, np.s_[lay["w"]:lay["w"] + D], axis=1),
                                  np.delete(before, np.s_[lay["w"]:lay["w"] + D], axis=1))
    opt.close()
    emb.close()


@pytest.mark.parametrize("rows", [{}, {"decay_missed_steps": True}])
def test_sparse_adam_state_dict_import_into_log(tmp_path, rows):
    """A torch.optim.SparseAdam state dict (exp_avg, exp_avg_sq, step) into own stores."""
    ref = nn.Embedding(N, D, sparse=True)
    ropt = torch.optim.SparseAdam(ref.parameters(), lr=0.05)
    train(ref, ropt, batches(3))
    sd = ropt.state_dict()
    mem = small_memory(_path=tmp_path / "probe", weights=False, **rows,
                       decoupled_weight_decay=bool(rows))
    stores = []
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        e = nn.Embedding(N, D, sparse=True)
        o = DiskSparseAdam(e.parameters(), lr=0.05, state_dir=tmp_path / kind,
                           decoupled_weight_decay=bool(rows), **rows, **kw)
        o.load_state_dict(sd)
        stores.append(o)
    sa = stores[0].store_for(stores[0].param_groups[0]["params"][0])
    sb = stores[1].store_for(stores[1].param_groups[0]["params"][0])
    assert sb.count == sa.count == 3
    np.testing.assert_array_equal(dsa_core.read_records(sa, np.arange(N)).view(np.uint32),
                                  dsa_core.read_records(sb, np.arange(N)).view(np.uint32))
    m = ropt.state[ref.weight]["exp_avg"].numpy()
    v = ropt.state[ref.weight]["exp_avg_sq"].numpy()
    lay, rec = sb.layout, dsa_core.read_records(sb, np.arange(N))
    np.testing.assert_array_equal(rec[:, lay["m"]:lay["m"] + D], m)
    np.testing.assert_array_equal(rec[:, lay["v"]:lay["v"] + D], v)
    if rows:  # SparseAdam decayed nothing: every row's last decay is the imported step
        np.testing.assert_array_equal(rec.view(np.int32)[:, lay["last_step"]], 3)
    for o in stores:
        o.close()


def test_checkpoint_and_resume_on_log_stores(tmp_path, mem):
    """opt.checkpoint / load_checkpoint and resume=True on log stores, against in-place."""
    init = torch.randn(N, D, generator=torch.Generator().manual_seed(5)) * 0.1
    own = small_memory(_path=tmp_path / "probe", weights=False)

    def build(root, kind, resume=False):
        kw = {} if kind == "inplace" else {"storage": "log", "memory": mem}
        okw = {} if kind == "inplace" else {"storage": "log", "memory": own}
        emb = DiskEmbedding(N, D, state_dir=root / "emb", init=init, resume=resume, **kw)
        lin = nn.Embedding(N, D, sparse=True)
        with torch.no_grad():
            lin.weight.copy_(init)
        opt = DiskSparseAdam([emb.weight, lin.weight], lr=0.05, state_dir=root / "opt",
                             resume=resume, **okw)
        return emb, lin, opt

    def run(emb, lin, opt, xs):
        for x in xs:
            (emb(x).pow(2).sum() + lin(x).pow(3).sum()).backward()
            opt.step()
            opt.zero_grad()

    # the reference: 12 uninterrupted steps in place
    ref = build(tmp_path / "ref", "inplace")
    run(*ref, batches(12))
    # the log run: 5 steps, checkpoint, 3 other steps, back to the checkpoint, 3 steps,
    # restart with resume=True, 4 steps: the same 12 steps as the reference
    emb, lin, opt = build(tmp_path / "log2", "log")
    xs = list(batches(12))
    run(emb, lin, opt, xs[:5])
    opt.checkpoint(tmp_path / "ck", extra={"lin": lin.state_dict()})
    run(emb, lin, opt, batches(3, seed=11))
    extra = opt.load_checkpoint(tmp_path / "ck")
    lin.load_state_dict(extra["lin"])
    assert emb.store.count == 5
    run(emb, lin, opt, xs[5:8])
    # and a restart with resume=True
    lin_w = lin.state_dict()
    opt.close()
    emb.close()
    emb, lin, opt = build(tmp_path / "log2", "log", resume=True)
    lin.load_state_dict(lin_w)
    assert emb.store.count == 8 and emb.store.storage == "log"
    run(emb, lin, opt, xs[8:])
    assert torch.equal(lin.weight, ref[1].weight)
    assert_same_store(ref[0].store, emb.store)
    for p_ref, p in zip(ref[2].param_groups[0]["params"], opt.param_groups[0]["params"]):
        sa, sb = ref[2].store_for(p_ref), opt.store_for(p)
        assert sb.storage == "log"
        np.testing.assert_array_equal(
            dsa_core.read_records(sa, np.arange(N)).view(np.uint32),
            dsa_core.read_records(sb, np.arange(N)).view(np.uint32))
    # emb.checkpoint / load_checkpoint of the log table alone
    emb.checkpoint(tmp_path / "eck")
    snap = dsa_core.read_records(emb.store, np.arange(N))
    run(emb, lin, opt, batches(2, seed=12))
    emb.load_checkpoint(tmp_path / "eck")
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)), snap)
    for o in (ref[2], opt):
        o.close()
    for e in (ref[0], emb):
        e.close()


def test_resume_of_the_other_kind_is_refused(tmp_path, mem):
    DiskEmbedding(N, D, state_dir=tmp_path / "a", seed=0).close()
    with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
        DiskEmbedding(N, D, state_dir=tmp_path / "a", resume=True, storage="log")
    DiskEmbedding(N, D, state_dir=tmp_path / "b", seed=0, storage="log", memory=mem).close()
    with pytest.raises(ValueError, match="storage='log' store, but storage='inplace'"):
        DiskEmbedding(N, D, state_dir=tmp_path / "b", resume=True, storage="inplace")
    e = DiskEmbedding(N, D, state_dir=tmp_path / "b", resume=True, storage="log", memory=mem)
    assert e.store.storage == "log"
    e.close()
    for name, kind in (("a", "inplace"), ("b", "log")):  # "auto" (the default): either kind
        e = DiskEmbedding(N, D, state_dir=tmp_path / name, resume=True)
        assert e.store.storage == kind
        e.close()
    lin = nn.Embedding(N, D, sparse=True)
    DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "o").close()
    with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
        DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "o", resume=True,
                       storage="log")


@pytest.mark.parametrize("kw, match", [
    ({"storage": "inplace", "memory": "1MiB"}, "memory= is for storage='log'"),
    ({"storage": "lsm"}, "storage must be one of"),
    ({"storage": "log", "access": "ram"}, "access='ram' is for in-place stores"),
    ({"storage": "log", "memory": "lots"}, "memory must be a number of bytes"),
])
def test_bad_storage_options(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        DiskEmbedding(N, D, state_dir=tmp_path / "e", **kw)
    with pytest.raises(ValueError, match=match):
        DiskSparseAdam(nn.Embedding(N, D, sparse=True).parameters(),
                       state_dir=tmp_path / "o", **kw)
    assert not (tmp_path / "e").exists()
    assert not any((tmp_path / "o").glob("group*"))
