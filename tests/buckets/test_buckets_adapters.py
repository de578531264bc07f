"""Partition-ordered training from the adapters: bucketed batches consumed by torch and JAX.

``dsa_core.buckets`` batches go unchanged into a ``DiskEmbedding`` + ``DiskSparseAdam`` loop,
into ``DiskSparseAdam`` over an in-RAM ``nn.Embedding`` (its moments store comes from
``opt.stores``) and into the JAX transform, with the stores given to the iterator so that it
loads and releases their partitions. Oracles:

* the same loop with no stores given (no range hints): identical stores, bit for bit (the
  loads and releases only hint, they never change a value);
* ``torch.optim.SparseAdam`` on an ``nn.Embedding`` fed the same batches (float rounding);
* an uninterrupted run, for a run checkpointed mid-epoch with ``opt.checkpoint(extra=)`` and
  resumed with ``load_checkpoint`` + ``plan.batches(start=...)``: bit for bit (weights,
  m, v, step count);
* the torch run, for the JAX transform on the same batches (two frameworks' gradient
  kernels round differently).

The example (``examples.graph_buckets``) and the benchmark (``benchmarks.buckets_quality``)
run at tiny sizes at the end.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from adapters.torch import DiskEmbedding, DiskSparseAdam
from dsa_core import buckets

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:   # examples/ and benchmarks/ are directories of the checkout
    sys.path.insert(0, str(ROOT))

N, D, E = 600, 8, 2500   # nodes, dim, edges
P, C = 4, 2              # partitions, buffer
B, K = 64, 3             # batch, negatives per edge
LR = 0.02
TOL = {"rtol": 1e-5, "atol": 3e-6}


@pytest.fixture(autouse=True)
def one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def make_plan(seed: int = 0, columns: int = 2) -> buckets.Plan:
    rng = np.random.default_rng(seed)
    edges = rng.integers(0, N, (E, 2))
    if columns == 3:   # (head, relation, tail)
        edges = np.stack([edges[:, 0], rng.integers(0, 5, E), edges[:, 1]], 1)
    return buckets.plan(edges, N, partitions=P, buffer=C, seed=seed)


def init_weights(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((N, D)) * 0.1).astype(np.float32)


def loss_of(rows: torch.Tensor, b: int) -> torch.Tensor:
    """LINE-style logistic loss; ``rows`` = the embeddings of [src, dst, negatives]."""
    eu, ev, en = rows[:b], rows[b:2 * b], rows[2 * b:].view(b, K, -1)
    pos = (eu * ev).sum(-1)
    neg = torch.bmm(en, eu.unsqueeze(-1)).squeeze(-1)
    return (torch.nn.functional.softplus(-pos)
            + torch.nn.functional.softplus(neg).sum(-1)).mean()


def batch_ids(batch) -> np.ndarray:
    return np.concatenate([batch.edges[:, 0], batch.edges[:, -1],
                           batch.negatives.reshape(-1)])


def train_step(emb, opt, batch) -> float:
    """One step; the batch is used as it comes (only ``edges`` and ``negatives``)."""
    loss = loss_of(emb(torch.from_numpy(batch_ids(batch))), len(batch.edges))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def records(state: dsa_core.State) -> bytes:
    return np.ascontiguousarray(state.store.data).tobytes()


def snapshot(state: dsa_core.State) -> dict[str, np.ndarray]:
    return {"weights": state.weights.copy(), "exp_avg": state.exp_avg.copy(),
            "exp_avg_sq": state.exp_avg_sq.copy()}


# --- torch: DiskEmbedding + DiskSparseAdam -----------------------------------------------------
def test_disk_embedding_on_bucketed_batches(tmp_path):
    """Hints invisible, every batch stepped, untouched rows untouched, = SparseAdam."""
    plan = make_plan()
    w0 = init_weights()
    runs = {}
    for name, give_stores in (("hinted", True), ("plain", False)):
        emb = DiskEmbedding(N, D, state_dir=tmp_path / name, init=w0)
        opt = DiskSparseAdam(emb.parameters(), lr=LR)
        it = plan.batches(B, negatives=K, epochs=2, stores=[emb.store] if give_stores else ())
        seen = np.zeros(N, bool)
        losses, count = [], 0
        for batch in it:
            assert batch.edges.dtype == np.int64 and batch.negatives.shape == (len(batch.edges), K)
            seen[batch_ids(batch)] = True
            losses.append(train_step(emb, opt, batch))
            count += 1
        dsa_core.wait_ranges(emb.store)
        st = emb.store
        assert st.count == count                          # one step per batch, none dropped
        assert it.loads >= P                              # partitions were requested
        np.testing.assert_array_equal(st.weights[~seen], w0[~seen])   # lazy: never touched
        assert not st.exp_avg[~seen].any()
        assert np.abs(st.weights[seen] - w0[seen]).max() > 0
        assert np.mean(losses[-10:]) < np.mean(losses[:10])
        runs[name] = (records(st), losses)
        opt.close()
        emb.close()
    assert runs["hinted"][0] == runs["plain"][0]           # bit for bit
    assert runs["hinted"][1] == runs["plain"][1]

    # the same batches through torch.optim.SparseAdam on an in-RAM table
    ref = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(torch.from_numpy(w0))
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=LR)
    losses = [train_step(ref, o_ref, b) for b in plan.batches(B, negatives=K, epochs=2)]
    np.testing.assert_allclose(losses, runs["plain"][1], rtol=1e-5)
    with DiskEmbedding(N, D, state_dir=tmp_path / "plain", resume=True) as emb:
        st = emb.store
        np.testing.assert_allclose(st.weights, ref.weight.detach().numpy(), **TOL)
        np.testing.assert_allclose(st.exp_avg, o_ref.state[ref.weight]["exp_avg"], **TOL)
        np.testing.assert_allclose(st.exp_avg_sq, o_ref.state[ref.weight]["exp_avg_sq"], **TOL)


def test_relation_column_and_outdated_store_state(tmp_path):
    """(head, relation, tail) batches; the State given at the start goes stale: still fine."""
    plan = make_plan(seed=3, columns=3)
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "e", init=init_weights(3))
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    first = emb.store                       # outdated after the first step
    n = 0
    for batch in plan.batches(B, negatives=K, stores=[first]):
        assert batch.edges.shape[1] == 3
        train_step(emb, opt, batch)
        n += 1
    dsa_core.wait_ranges(first)
    assert emb.store.count == n == sum(-(-int(s) // B) for s in plan.bucket_sizes.ravel())
    with pytest.raises(dsa_core.StaleStateError):
        dsa_core.flush(first)               # stale for writing, but it located the store
    opt.close()
    emb.close()


def stop_at(plan) -> int:
    """A step in the middle of a bucket of epoch 0 (batch_index > 0 next), past a swap."""
    it = plan.batches(B, negatives=K, epochs=2)
    for n, batch in enumerate(it, 1):
        e, k, t = it.position
        if e == 0 and k >= P and t >= 1:
            return n
    raise AssertionError("no bucket with two batches")


def test_resume_mid_epoch_is_bit_for_bit(tmp_path):
    plan = make_plan(seed=1)
    w0 = init_weights(1)
    stop = stop_at(plan)

    # uninterrupted
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "full", init=w0)
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    full = [batch_ids(b) for b in plan.batches(B, negatives=K, epochs=2)]
    for b in plan.batches(B, negatives=K, epochs=2, stores=[emb.store]):
        train_step(emb, opt, b)
    want, want_count = snapshot(emb.store), emb.store.count
    opt.close()
    emb.close()

    # interrupted mid-epoch, checkpointed with the position
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "run", init=w0)
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    it = plan.batches(B, negatives=K, epochs=2, stores=[emb.store])
    for n, b in enumerate(it, 1):
        train_step(emb, opt, b)
        if n == stop:
            break
    assert it.position[0] == 0 and it.position[2] >= 1         # mid-bucket, mid-epoch
    opt.checkpoint(tmp_path / "ck", extra={"order": it.state_dict()})
    train_step(emb, opt, next(it))                             # a step the checkpoint lacks
    it.close()                                                 # stop: release the buffer
    opt.close()
    emb.close()

    # a new process would do this: fresh objects, the checkpoint, start=
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "run", overwrite=True, seed=99)
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    extra = opt.load_checkpoint(tmp_path / "ck")
    assert emb.store.count == stop
    with pytest.raises(ValueError, match="batch_size"):        # another iteration's position
        plan.batches(B + 1, negatives=K, epochs=2, start=extra["order"])
    it = plan.batches(B, negatives=K, epochs=2, stores=[emb.store], start=extra["order"])
    rest = []
    for b in it:
        rest.append(batch_ids(b))
        train_step(emb, opt, b)
    assert len(rest) == len(full) - stop
    assert all(np.array_equal(a, b) for a, b in zip(rest, full[stop:], strict=True))
    got = snapshot(emb.store)
    assert emb.store.count == want_count
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    opt.close()
    emb.close()


# --- torch: DiskSparseAdam over an in-RAM nn.Embedding -------------------------------------------
def test_ram_embedding_moments_store_and_resume(tmp_path):
    plan = make_plan(seed=2)
    w0 = torch.from_numpy(init_weights(2))
    stop = stop_at(plan)

    def build(state_dir, **kw):
        emb = torch.nn.Embedding(N, D, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(w0)
        return emb, DiskSparseAdam(emb.parameters(), lr=LR, state_dir=state_dir, **kw)

    # uninterrupted, with the optimizer's store hinted; and SparseAdam on the same batches
    emb, opt = build(tmp_path / "full")
    (name, store), = opt.stores.items()
    assert store.num_rows == N and not store.has_weights
    ref = torch.nn.Embedding(N, D, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(w0)
    o_ref = torch.optim.SparseAdam(ref.parameters(), lr=LR)
    for b in plan.batches(B, negatives=K, epochs=2, stores=list(opt.stores.values())):
        train_step(emb, opt, b)
        train_step(ref, o_ref, b)
    st = opt.stores[name]
    np.testing.assert_allclose(emb.weight.detach(), ref.weight.detach(), **TOL)
    np.testing.assert_allclose(st.exp_avg, o_ref.state[ref.weight]["exp_avg"], **TOL)
    want_w = emb.weight.detach().clone()
    want = {"exp_avg": st.exp_avg.copy(), "exp_avg_sq": st.exp_avg_sq.copy(),
            "count": st.count}
    opt.close()

    # interrupted; the model's weights go into extra, next to the position
    emb, opt = build(tmp_path / "run")
    it = plan.batches(B, negatives=K, epochs=2, stores=list(opt.stores.values()))
    for n, b in enumerate(it, 1):
        train_step(emb, opt, b)
        if n == stop:
            break
    opt.checkpoint(tmp_path / "ck", extra={"model": emb.state_dict(), "order": it.state_dict()})
    it.close()
    opt.close()

    emb, opt = build(tmp_path / "run", overwrite=True)
    with torch.no_grad():
        emb.weight.normal_()                 # whatever the new process starts from
    extra = opt.load_checkpoint(tmp_path / "ck")
    emb.load_state_dict(extra["model"])
    for b in plan.batches(B, negatives=K, epochs=2, stores=list(opt.stores.values()),
                          start=extra["order"]):
        train_step(emb, opt, b)
    st = opt.stores[name]
    assert st.count == want["count"]
    assert torch.equal(emb.weight.detach(), want_w)
    np.testing.assert_array_equal(st.exp_avg, want["exp_avg"])
    np.testing.assert_array_equal(st.exp_avg_sq, want["exp_avg_sq"])
    opt.close()


# --- JAX: the sparse_adam transform ------------------------------------------------------------
@pytest.mark.jax
def test_jax_transform_on_bucketed_batches(tmp_path):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from adapters import jax as dj

    # every bucket holds exactly 2 batches, so every batch has B edges: with the unique rows
    # padded to a power of two, the jitted loss compiles for a few shapes only
    rng = np.random.default_rng(4)
    bounds = np.arange(P + 1) * N // P
    edges = np.concatenate([
        np.stack([rng.integers(bounds[i], bounds[i + 1], 2 * B),
                  rng.integers(bounds[j], bounds[j + 1], 2 * B)], 1)
        for i in range(P) for j in range(P)])
    plan = buckets.plan(rng.permutation(edges), N, partitions=P, buffer=C, seed=4)
    assert (plan.bucket_sizes == 2 * B).all()
    w0 = init_weights(4)
    store = dj.create_store(tmp_path / "jax", N, D, init=w0, progress=False)
    tx = dj.sparse_adam(LR)
    opt_state = tx.init(store)

    @jax.jit
    def value_and_grad(rows, inverse):
        def loss(rows):
            r = rows[inverse]
            b = r.shape[0] // (2 + K)
            eu, ev, en = r[:b], r[b:2 * b], r[2 * b:].reshape(b, K, -1)
            pos = (eu * ev).sum(-1)
            neg = jnp.einsum("bkd,bd->bk", en, eu)
            return (jax.nn.softplus(-pos) + jax.nn.softplus(neg).sum(-1)).mean()
        return jax.value_and_grad(loss)(rows)

    losses = []
    it = plan.batches(B, negatives=K, stores=[dj.core_states(opt_state)])
    for b in it:
        batch = dj.gather_batch(opt_state.stores, batch_ids(b), buckets="pow2")
        loss, g = value_and_grad(batch.rows, batch.inverse)
        _, opt_state = tx.update((batch.idx, g), opt_state)
        losses.append(float(loss))
    core = dj.core_states(opt_state)
    dsa_core.wait_ranges(core)
    assert core.count == int(opt_state.count) == len(losses)

    emb = DiskEmbedding(N, D, state_dir=tmp_path / "torch", init=w0)
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    ref = [train_step(emb, opt, b) for b in plan.batches(B, negatives=K)]
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    np.testing.assert_allclose(core.weights, emb.store.weights, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(core.exp_avg, emb.store.exp_avg, rtol=1e-4, atol=1e-6)
    opt.close()
    emb.close()
    dj.close(opt_state)


# --- examples.graph_buckets ------------------------------------------------------------------
def test_random_order_batches_and_resume():
    from examples.graph_buckets import RandomBatches

    edges = np.random.default_rng(0).integers(0, 50, (103, 2))
    it = RandomBatches(edges, 50, 10, negatives=2, epochs=2, seed=5)
    got = list(it)
    assert len(got) == 2 * 11 and it.position == (2, 0, 0)
    for e in range(2):   # every edge once per epoch, a new shuffle each epoch
        ep = np.concatenate([b.edges for b in got[11 * e:11 * (e + 1)]])
        assert sorted(map(tuple, ep.tolist())) == sorted(map(tuple, edges.tolist()))
    assert not np.array_equal(got[0].edges, got[11].edges)
    assert all(b.negatives.shape == (len(b.edges), 2) and b.negatives.max() < 50 for b in got)
    it = RandomBatches(edges, 50, 10, negatives=2, epochs=2, seed=5)
    gen = iter(it)
    for _ in range(14):
        next(gen)
    sd = it.state_dict()
    again = list(RandomBatches(edges, 50, 10, negatives=2, epochs=2, seed=5, start=sd))
    assert len(again) == 8
    for a, b in zip(again, got[14:], strict=True):
        assert np.array_equal(a.edges, b.edges) and np.array_equal(a.negatives, b.negatives)
    with pytest.raises(ValueError, match="seed"):
        RandomBatches(edges, 50, 10, negatives=2, epochs=2, seed=6, start=sd)


@pytest.mark.parametrize("order", ["random", "bucket"])
def test_graph_buckets_example(order, tmp_path):
    from examples import graph_buckets as gb

    cfg = gb.Config(nodes=4000, holdout=400, epochs=2, order=order, progress=False)
    full = gb.run(cfg, tmp_path / "a")
    assert full["auc"] > 0.7, full["auc"]           # random scores: 0.5
    assert np.mean(full["losses"][-10:]) < np.mean(full["losses"][:10])
    assert full["steps"] == full["steps_total"]
    g = gb.make_graph(cfg)                           # every batch of every epoch was stepped
    plan = gb.make_plan(cfg, g["train"])
    assert full["steps"] == cfg.epochs * gb.steps_per_epoch(cfg, g["train"], plan)
    if order == "bucket":
        assert full["loads"] >= cfg.partitions
    assert "AUC" in gb.report(full)

    # stopped part-way with a checkpoint, then resumed in fresh objects: the same table
    ck = str(tmp_path / "ck")
    part = gb.run(dataclasses.replace(cfg, checkpoint=ck, stop_after=full["steps"] // 2 + 1,
                                      checkpoint_every=7), tmp_path / "b")
    assert part["stopped"] and part["steps"] == full["steps"] // 2 + 1
    rest = gb.run(dataclasses.replace(cfg, checkpoint=ck, resume=True), tmp_path / "c")
    assert part["steps"] + rest["steps"] == full["steps"]
    assert rest["digest"] == full["digest"] and rest["auc"] == full["auc"]


def test_graph_buckets_cli(tmp_path, capsys):
    from examples import graph_buckets as gb

    gb.main(["--nodes", "2000", "--holdout", "200", "--epochs", "1", "--partitions", "3",
             "--buffer", "2", "--no-progress", "--dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "AUC" in out and "3 partitions" in out
    with pytest.raises(SystemExit):
        gb.main(["--order", "sideways", "--no-progress"])
    with pytest.raises(ValueError, match="buffer"):   # refused before a store is created
        gb.train(gb.Config(nodes=100, buffer=1, progress=False),
                 {"train": np.zeros((4, 2), np.int64)}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


# --- benchmarks.buckets_quality ----------------------------------------------------------------
