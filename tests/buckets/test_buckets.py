"""dsa_core.buckets: bucketing, the BETA order and its load count, batches, resume, store hints.

The oracles are independent of the module's bookkeeping: the multiset of yielded edges against
the input, bucket membership from the partition bounds, load counts recounted from the
resident sets, resumed runs against uninterrupted ones, and recorded load/release calls
checked against the buffer protocol (each partition requested before its first bucket, at
most c + 1 partitions held, all given back).
"""

from __future__ import annotations

import json
import re
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from dsa_core import _bucket_order, buckets

ROOT = Path(__file__).resolve().parents[2]


def _edges(E=3000, N=200, cols=2, seed=0, dtype=np.int64):
    rng = np.random.default_rng(seed)
    e = rng.integers(0, N, size=(E, cols)).astype(dtype)
    if cols == 3:
        e[:, 1] = rng.integers(0, 7, size=E)
    e[E // 2:E // 2 + 50] = e[:50]  # duplicate edges: each copy must come out once
    return e


def _rows(a: np.ndarray) -> np.ndarray:
    """The rows of an int array as one sorted multiset (a structured view)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    return np.sort(a.view([(f"f{k}", "i8") for k in range(a.shape[1])]).ravel())


# -- bucketing -------------------------------------------------------------------------
@pytest.mark.parametrize("cols", [2, 3])
def test_plan_sorts_edges_stably_by_bucket(cols):
    e = _edges(cols=cols)
    N, P = 200, 6
    p = buckets.plan(e, N, partitions=P, chunk_edges=317)
    bounds = p.bounds
    assert bounds[0] == 0 and bounds[-1] == N and np.ptp(np.diff(bounds)) <= 1
    part = np.searchsorted(bounds, e, side="right") - 1
    bid = part[:, 0] * P + part[:, -1]
    np.testing.assert_array_equal(p.edges, e[np.argsort(bid, kind="stable")])
    np.testing.assert_array_equal(p.bucket_sizes.ravel(), np.bincount(bid, minlength=P * P))
    assert p.offsets[0] == 0 and p.offsets[-1] == len(e) == p.num_edges
    for i in range(P):
        for j in range(P):
            b = p.edges[p.offsets[i * P + j]:p.offsets[i * P + j + 1]]
            assert (p.partition_of(b[:, 0]) == i).all() and (p.partition_of(b[:, -1]) == j).all()
    assert p.edges.dtype == e.dtype


def test_partition_of_matches_bounds():
    p = buckets.plan([[0, 1]], 103, partitions=10)
    ids = np.arange(103)
    part = p.partition_of(ids)
    for q in range(10):
        assert (part[p.bounds[q]:p.bounds[q + 1]] == q).all()
    with pytest.raises(ValueError, match=r"node ids must lie in \[0, num_nodes=103\), got 103"):
        p.partition_of([5, 103])


# -- the order ---------------------------------------------------------------------------
CASES = [(1, 2), (1, 5), (2, 2), (3, 2), (3, 3), (3, 7), (4, 2), (4, 3), (5, 3), (5, 4),
         (7, 3), (8, 2), (8, 4), (9, 5), (12, 3), (16, 4), (16, 8), (17, 6), (24, 2)]


def _entering(buffers) -> int:
    """Partitions entering the buffer over a sequence of resident sets."""
    loads, prev = 0, set()
    for b in buffers:
        loads += len(set(b) - prev)
        prev = set(b)
    return loads


def _states(plan, epochs, first=0):
    """The buffer states of ``epochs`` epochs in order (repeats of one state merged)."""
    out = []
    for e in range(first, first + epochs):
        for b in plan.order(e).buffers:
            if not out or set(b) != out[-1]:
                out.append(set(b))
    return out


def _issued(states) -> int:
    """Loads an iterator with one read-ahead slot issues over ``states``: every partition
    entering, less one at each swap whose leaving partition comes back at the next swap (it
    stays in the read-ahead slot)."""
    keeps = sum(bool((a - b) & (c - b)) for a, b, c in zip(states, states[1:], states[2:]))
    return _entering(states) - keeps


@pytest.mark.parametrize(("P", "c"), CASES)
def test_order_covers_every_bucket_once_within_its_buffer(P, c):
    p = buckets.plan([[0, 0]], 2 * P, partitions=P, buffer=c, seed=3)
    o = p.order(epoch=1)
    assert o.buckets.shape == (P * P, 2) and o.buckets.dtype == np.int64
    assert sorted(map(tuple, o.buckets.tolist())) == [(i, j) for i in range(P) for j in range(P)]
    assert len(o.buffers) == P * P
    for (i, j), buf in zip(o.buckets.tolist(), o.buffers, strict=True):
        assert i in buf and j in buf and len(buf) <= c and len(set(buf)) == len(buf)
    # consecutive resident sets differ by one swap (one in, one out) or not at all
    for a, b in zip(o.buffers, o.buffers[1:]):
        assert len(set(b) - set(a)) <= 1
    assert o.loads == _entering(o.buffers)
    assert o.lower_bound == _bucket_order.lower_bound(P, c)
    assert o.lower_bound <= o.loads <= 1.2 * o.lower_bound
    if P <= c:
        assert o.loads == o.lower_bound == P


def test_lower_bound_formula():
    assert [_bucket_order.lower_bound(P, 2) for P in (1, 2, 3, 4, 8)] == [1, 2, 4, 7, 29]
    # 8 partitions, 3 slots: 3 + ceil((28 - 3) / 2)
    assert _bucket_order.lower_bound(8, 3) == 16
    assert _bucket_order.lower_bound(5, 8) == 5


@pytest.mark.parametrize(("P", "c"), [(4, 2), (8, 2), (8, 3), (16, 4), (32, 8)])
def test_beta_beats_a_row_major_lru_order(P, c):
    o = buckets.plan([[0, 0]], P, partitions=P, buffer=c).order()
    naive = _bucket_order.lru_loads([(i, j) for i in range(P) for j in range(P)], c)
    assert o.loads < naive
    assert o.loads < 0.7 * naive if P >= 8 else True


def test_epochs_and_seeds_change_the_order_deterministically():
    p = buckets.plan([[0, 0]], 64, partitions=8, buffer=3, seed=5)
    a, b = p.order(0), p.order(1)
    assert not np.array_equal(a.buckets, b.buckets)
    np.testing.assert_array_equal(a.buckets, p.order(0).buckets)
    np.testing.assert_array_equal(
        a.buckets, buckets.plan([[1, 1]], 64, partitions=8, buffer=3, seed=5).order(0).buckets)
    other = buckets.plan([[0, 0]], 64, partitions=8, buffer=3, seed=6).order(0)
    assert not np.array_equal(a.buckets, other.buckets)
    assert a.loads == b.loads  # a relabelling keeps the cost


def test_reprs():
    p = buckets.plan(_edges(), 200, partitions=8, buffer=3)
    assert re.fullmatch(r"Plan\(num_nodes=200, num_edges=3,000, P=8, c=3, seed=0, columns=2, "
                        r"largest bucket=\d+ edges, epoch loads=17 \(lower bound 16\), edges in "
                        r"memory\)", repr(p)), repr(p)
    assert repr(p.order()) == "Order(P=8, c=3, buckets=64, loads=17, lower_bound=16)"
    small = buckets.plan(_edges(), 200, partitions=3, buffer=5).order()
    assert repr(small) == "Order(P=3, c>=3, buckets=9, loads=3, lower_bound=3)"


# -- batches -----------------------------------------------------------------------------
@pytest.mark.parametrize(("P", "c", "cols"), [(1, 2, 2), (4, 2, 3), (5, 3, 2), (6, 8, 2)])
def test_every_edge_once_per_epoch_each_batch_in_one_bucket(P, c, cols):
    e = _edges(cols=cols, seed=P)
    p = buckets.plan(e, 200, partitions=P, buffer=c, seed=1)
    B = 64
    got = list(p.batches(B, epoch=2, epochs=2, mix="bucket"))
    for epoch in (2, 3):
        bs = [b for b in got if b.position[0] == epoch]
        np.testing.assert_array_equal(_rows(np.concatenate([b.edges for b in bs])), _rows(e))
        order = p.order(epoch)
        for b in bs:
            i, j = b.bucket
            assert b.edges.dtype == np.int64 and 1 <= len(b.edges) <= B
            assert (p.partition_of(b.edges[:, 0]) == i).all()
            assert (p.partition_of(b.edges[:, -1]) == j).all()
            assert tuple(order.buckets[b.position[1]]) == (i, j)
            assert b.partitions == order.buffers[b.position[1]]
            assert b.negatives.shape == (len(b.edges), 0)
            assert b.weight.dtype == np.float32 and (b.weight == 1).all()
            assert b.weight.shape == (len(b.edges),)
        # positions increase; only a bucket's last batch is short
        pos = [b.position for b in bs]
        assert pos == sorted(pos) and len(set(pos)) == len(pos)
        for a, nxt in zip(bs, bs[1:]):
            if nxt.position[1] == a.position[1]:
                assert len(a.edges) == B and nxt.position[2] == a.position[2] + 1
    if cols == 3:  # the relation column is carried with its edge
        pairs = {(h, t): set() for h, _, t in e.tolist()}
        for h, r, t in e.tolist():
            pairs[(h, t)].add(r)
        for b in got:
            for h, r, t in b.edges.tolist():
                assert r in pairs[(h, t)]


def test_edges_are_shuffled_within_buckets_and_epochs_differ():
    p = buckets.plan(_edges(E=5000), 200, partitions=2, buffer=2)
    a = list(p.batches(10_000, epoch=0, mix="bucket"))
    b = list(p.batches(10_000, epoch=1, mix="bucket"))
    bucket = {x.bucket: x.edges for x in a}
    for x in b:  # same bucket, same multiset, another order
        np.testing.assert_array_equal(_rows(x.edges), _rows(bucket[x.bucket]))
        assert not np.array_equal(x.edges, bucket[x.bucket])
    i, j = a[0].bucket
    assert not np.array_equal(a[0].edges, p.edges[p.offsets[i * 2 + j]:p.offsets[i * 2 + j + 1]])


def test_negatives_come_from_the_resident_partitions_and_cover_them():
    N, P, c = 300, 6, 3
    p = buckets.plan(_edges(E=6000, N=N), N, partitions=P, buffer=c, seed=2)
    order = p.order(0)
    k = 16
    seen: dict[int, set] = {}
    for b in p.batches(200, negatives=k, mix="bucket", pool=0):  # the buffer's negatives only
        assert b.negatives.shape == (len(b.edges), k) and b.negatives.dtype == np.int64
        resident = order.buffers[b.position[1]]
        part = p.partition_of(b.negatives)
        assert np.isin(part, resident).all()
        seen.setdefault(b.position[1], set()).update(part.ravel().tolist())
    for pos, parts in seen.items():  # every resident partition is drawn from
        assert parts == set(order.buffers[pos]), (pos, parts)
    # uniform over the union of rows: within a bucket's resident rows, no row is favoured
    q = buckets.plan(_edges(E=4000, N=N), N, partitions=P, buffer=c)
    big = max(q.batches(4000, negatives=200, mix="bucket", pool=0),
              key=lambda b: len(b.edges))
    rows = np.concatenate([np.arange(q.bounds[r], q.bounds[r + 1])
                           for r in q.order(0).buffers[big.position[1]]])
    counts = np.bincount(big.negatives.ravel(), minlength=N)[rows]
    mean = big.negatives.size / len(rows)
    assert abs(counts.mean() - mean) < 1e-9 and counts.std() < 3 * np.sqrt(mean)


def _state_of(order) -> list[int]:
    """For each bucket of the order, the first bucket of its buffer state."""
    out = []
    for q, buf in enumerate(order.buffers):
        out.append(q if q == 0 or order.buffers[q - 1] != buf else out[-1])
    return out


@pytest.mark.parametrize(("P", "c", "cols"), [(1, 2, 2), (4, 2, 3), (5, 3, 2), (6, 8, 2),
                                              (7, 3, 2)])
def test_mix_buffer_shuffles_the_buckets_of_each_buffer_state_together(P, c, cols):
    e = _edges(cols=cols, seed=P)
    p = buckets.plan(e, 200, partitions=P, buffer=c, seed=1)
    B, K = 64, 3
    it = p.batches(B, negatives=K, epoch=2, epochs=2, mix="buffer", pool=0)
    n_batches = len(it)
    got = list(it)
    assert len(got) == n_batches
    part = p.partition_of(e[:, [0, -1]])
    mixed = 0
    for epoch in (2, 3):
        bs = [b for b in got if b.position[0] == epoch]
        np.testing.assert_array_equal(_rows(np.concatenate([b.edges for b in bs])), _rows(e))
        order = p.order(epoch)
        first = _state_of(order)
        states = sorted({b.position[1] for b in bs})
        for k in states:
            assert first[k] == k  # positions name a state's first bucket
            sb = [b for b in bs if b.position[1] == k]
            assert [b.position[2] for b in sb] == list(range(len(sb)))
            # the state's edges: those of every bucket that trains in it, recounted
            mine = [tuple(order.buckets[q]) for q in range(len(first)) if first[q] == k]
            want = e[np.isin(part[:, 0] * P + part[:, 1], [i * P + j for i, j in mine])]
            np.testing.assert_array_equal(_rows(np.concatenate([b.edges for b in sb])),
                                          _rows(want))
            assert len(sb) == -(-len(want) // B)
            assert all(len(b.edges) == B for b in sb[:-1]) and 1 <= len(sb[-1].edges) <= B
            for b in sb:
                assert b.bucket is None and b.partitions == order.buffers[k]
                assert np.isin(p.partition_of(b.edges[:, [0, -1]]), b.partitions).all()
                assert b.negatives.shape == (len(b.edges), K)
                assert np.isin(p.partition_of(b.negatives), b.partitions).all()
                assert b.weight.shape == (len(b.edges),) and (b.weight == 1).all()
                seen = p.partition_of(b.edges[:, [0, -1]])
                mixed += len({(x, y) for x, y in seen.tolist()}) > 1
            # every resident partition is drawn from as a negative
            negs = np.concatenate([b.negatives.ravel() for b in sb])
            if len(negs) >= 50 * len(order.buffers[k]):
                assert set(p.partition_of(negs).tolist()) == set(order.buffers[k])
        pos = [b.position for b in bs]
        assert pos == sorted(pos) and len(set(pos)) == len(pos)
    if P > 1:
        assert mixed > len(got) // 2  # most batches hold edges of several buckets


def test_mix_buffer_equals_random_order_when_everything_is_resident():
    """P <= c: one buffer state per epoch, so the epoch is one shuffle of all the edges and
    the negatives are uniform over all nodes."""
    e = _edges(E=2000, N=200)
    p = buckets.plan(e, 200, partitions=3, buffer=4, seed=2)
    got = list(p.batches(500, negatives=50, mix="buffer", pool=0))
    assert [b.position for b in got] == [(0, 0, t) for t in range(4)]
    assert all(b.partitions == (0, 1, 2) for b in got)
    assert len({(x, y) for x, y in p.partition_of(got[0].edges).tolist()}) == 9
    counts = np.bincount(np.concatenate([b.negatives.ravel() for b in got]), minlength=200)
    assert counts.min() > 0 and abs(counts.mean() - 500) < 1e-9


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
@pytest.mark.parametrize(("P", "c"), [(7, 3), (4, 2), (9, 4), (3, 5)])
def test_loads_count_the_partitions_entering_the_buffer(P, c, mix):
    p = buckets.plan(_edges(), 200, partitions=P, buffer=c)
    it = p.batches(100, mix=mix)
    list(it)
    order = p.order(0)
    assert order.loads == _entering(_states(p, 1))
    assert it.loads == _issued(_states(p, 1)) <= order.loads
    if P > c:  # the order loads the partition that left last first: some come straight back
        assert it.loads < order.loads
    # several epochs: each epoch's swaps, and at each boundary the partitions that enter
    it = p.batches(100, epochs=3, mix=mix)
    list(it)
    assert it.loads == _issued(_states(p, 3))


@pytest.mark.parametrize("bad", [-1, 200])
def test_out_of_range_ids_are_refused_with_the_first_bad_edge(tmp_path, bad):
    e = _edges()
    e[1234, 1] = bad
    e[2000, 0] = bad
    with pytest.raises(ValueError, match=rf"node ids must lie in \[0, num_nodes=200\); edge "
                       rf"1234 is \(\d+, {bad}\): its destination/tail {bad} is out of range"):
        buckets.plan(e, 200, partitions=4, out=tmp_path / "plan", chunk_edges=100)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left
    e3 = _edges(cols=3)
    e3[7, 0] = bad
    with pytest.raises(ValueError, match=rf"edge 7 is \({bad}, \d+, \d+\): its source/head"):
        buckets.plan(e3, 200, partitions=4)


@pytest.mark.parametrize(("kwargs", "exc", "msg"), [
    ({"partitions": 0}, ValueError, r"partitions must be an int >= 1, got 0"),
    ({"partitions": 201}, ValueError, r"partitions must be <= num_nodes = 200 .*got 201"),
    ({"partitions": 2.0}, TypeError, r"partitions must be an int >= 1, got 2.0"),
    ({"partitions": 4, "buffer": 1}, ValueError, r"buffer must be an int >= 2, got 1; the "),
    ({"partitions": 4, "seed": -1}, ValueError, r"seed must be an int >= 0, got -1"),
    ({"partitions": 4, "chunk_edges": 0}, ValueError, r"chunk_edges must be an int >= 1"),
    ({"partitions": True}, TypeError, r"partitions must be an int >= 1, got True"),
])
def test_bad_plan_parameters(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        buckets.plan(_edges(), 200, **kwargs)


@pytest.mark.parametrize(("edges", "exc", "msg"), [
    (np.zeros((5, 4), np.int64), ValueError, r"\(E, 2\) array .* or an \(E, 3\) .*got shape "
     r"\(5, 4\)"),
    (np.zeros(10, np.int64), ValueError, r"got shape \(10,\)"),
    (np.zeros((2, 5, 2), np.int64), ValueError, r"got shape \(2, 5, 2\)"),
    (np.zeros((5, 2), np.float32), TypeError, r"edges must hold integer node ids, got dtype "
     r"float32; convert them with edges.astype\(np.int64\)"),
    (np.zeros((5, 2), bool), TypeError, r"got dtype bool"),
])
def test_bad_edges(edges, exc, msg):
    with pytest.raises(exc, match=msg):
        buckets.plan(edges, 200, partitions=4)
    with pytest.raises(ValueError, match=r"num_nodes must be an int >= 1, got 0"):
        buckets.plan(np.zeros((5, 2), np.int64), 0, partitions=1)


@pytest.mark.parametrize(("kwargs", "exc", "msg"), [
    ({"batch_size": 0}, ValueError, r"batch_size must be an int >= 1, got 0"),
    ({"batch_size": 1.5}, TypeError, r"batch_size must be an int >= 1, got 1.5"),
    ({"batch_size": 8, "negatives": -1}, ValueError, r"negatives must be an int >= 0, got -1"),
    ({"batch_size": 8, "epoch": -1}, ValueError, r"epoch must be an int >= 0, got -1"),
    ({"batch_size": 8, "stores": 3}, TypeError, r"stores must be a sequence of dsa_core.State"),
    ({"batch_size": 8, "stores": [object()]}, TypeError, r"stores\[0\] must be a "
     r"dsa_core.State, got object"),
    ({"batch_size": 8, "mix": "state"}, ValueError, r"mix must be 'bucket' \(each batch from "
     r"one bucket\) or 'buffer' .*got 'state'"),
    ({"batch_size": 8, "mix": None}, ValueError, r"mix must be 'bucket' .*got None"),
    ({"batch_size": 8, "pad": 1}, TypeError, r"pad must be True or False, got 1 \(int\)"),
])
def test_bad_batch_parameters(kwargs, exc, msg):
    p = buckets.plan(_edges(), 200, partitions=4)
    with pytest.raises(exc, match=msg):
        p.batches(**kwargs)


def test_stores_of_the_wrong_size_or_closed_are_refused(tmp_path):
    p = buckets.plan(_edges(), 200, partitions=4)
    s = dsa_core.create(tmp_path / "s", 199, 4)
    with pytest.raises(ValueError, match=r"stores\[0\] must have num_rows == plan.num_nodes = "
                       r"200 .*got 199"):
        p.batches(8, stores=[s])
    with pytest.raises(TypeError, match=r"got one State; pass stores=\[state\]"):
        p.batches(8, stores=s)
    dsa_core.close(s)
    t = dsa_core.create(tmp_path / "t", 200, 4)
    dsa_core.close(t)
    with pytest.raises(ValueError, match=r"stores\[0\] .* is closed"):
        p.batches(8, stores=[t])


# -- memmaps and out= --------------------------------------------------------------------
def test_memmap_input_and_out_equal_the_in_memory_plan(tmp_path):
    e = _edges(E=4000, cols=3, dtype=np.int32)
    mm = np.lib.format.open_memmap(tmp_path / "in.npy", mode="w+", dtype=np.int32, shape=e.shape)
    mm[:] = e
    mm.flush()
    src = np.load(tmp_path / "in.npy", mmap_mode="r")
    ref = buckets.plan(e, 200, partitions=5, buffer=3, seed=4)
    disk = buckets.plan(src, 200, partitions=5, buffer=3, seed=4, out=tmp_path / "plan",
                        chunk_edges=333)
    assert isinstance(disk.edges, np.memmap) and not disk.edges.flags.writeable
    assert disk.edges.dtype == np.int32 and disk.path == tmp_path / "plan"
    np.testing.assert_array_equal(disk.edges, ref.edges)
    np.testing.assert_array_equal(disk.offsets, ref.offsets)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["in.npy", "plan"]
    again = buckets.open_plan(tmp_path / "plan")
    for q in (disk, again):
        for a, b in zip(q.batches(128, negatives=3, epochs=2), ref.batches(128, negatives=3,
                                                                              epochs=2),
                        strict=True):
            np.testing.assert_array_equal(a.edges, b.edges)
            np.testing.assert_array_equal(a.negatives, b.negatives)
            assert (a.bucket, a.position) == (b.bucket, b.position)
    four = buckets.open_plan(tmp_path / "plan", buffer=4, seed=1)  # another order, same buckets
    assert (four.buffer, four.seed, four.order().loads) == (4, 1, _bucket_order.beta_loads(5, 4))
    np.testing.assert_array_equal(four.edges, ref.edges)
    with pytest.raises(FileExistsError, match="holds a plan: open it with buckets.open_plan"):
        buckets.plan(e, 200, partitions=5, out=tmp_path / "plan")
    (tmp_path / "empty").mkdir()
    assert buckets.plan(e, 200, partitions=5, out=tmp_path / "empty").num_edges == len(e)
    with pytest.raises(FileNotFoundError, match="holds no bucketed plan"):
        buckets.open_plan(tmp_path / "nothing")


def test_no_edges(tmp_path):
    for out in (None, tmp_path / "p"):
        p = buckets.plan(np.zeros((0, 2), np.int64), 10, partitions=3, out=out)
        assert p.num_edges == 0 and p.bucket_sizes.sum() == 0
        it = p.batches(4, negatives=2)
        assert list(it) == [] and it.position == (1, 0, 0) and it.loads == _issued(_states(p, 1))


def test_bucketing_and_iteration_stream_a_memmap(tmp_path):
    """Memory: O(P*P + chunk) to bucket, one bucket (plus its shuffle) to iterate."""
    E, N, P = 120_000, 1000, 8
    mm = np.lib.format.open_memmap(tmp_path / "in.npy", mode="w+", dtype=np.int64, shape=(E, 2))
    rng = np.random.default_rng(0)
    for lo in range(0, E, 10_000):
        mm[lo:lo + 10_000] = rng.integers(0, N, size=(10_000, 2))
    mm.flush()
    del mm
    src = np.load(tmp_path / "in.npy", mmap_mode="r")
    whole = E * 2 * 8
    tracemalloc.start()
    try:
        p = buckets.plan(src, N, partitions=P, out=tmp_path / "plan", chunk_edges=2000)
        _, peak = tracemalloc.get_traced_memory()
        assert peak < whole / 10, (peak, whole)
        tracemalloc.reset_peak()
        n = sum(len(b.edges) for b in p.batches(256, negatives=4, mix="bucket"))
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        m = sum(len(b.edges) for b in p.batches(256, negatives=4, mix="buffer"))
        _, peak_mixed = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == m == E
    bucket = int(p.bucket_sizes.max()) * (2 * 8 + 8)  # its int64 edges and its permutation
    pools = 3 * 8 * min(buckets.DEFAULT_POOL, N)  # the negatives' pools (two cached)
    assert peak < 2 * bucket + pools + (1 << 16) and peak < whole / 10, (peak, bucket, whole)
    # mixed over a buffer state: the edges of the state's buckets (c*c of them in the first
    # state, at most 2c - 1 in a later one), recounted from the order's resident sets
    order = p.order(0)
    sizes = p.bucket_sizes[order.buckets[:, 0], order.buckets[:, 1]]
    per_state: dict = {}
    for q, buf in enumerate(order.buffers):
        key = (buf, next(r for r in range(q, -1, -1) if r == 0 or order.buffers[r - 1] != buf))
        per_state[key] = per_state.get(key, 0) + int(sizes[q])
    state = max(per_state.values()) * (2 * 8 + 8)
    assert state < whole / 5, (state, whole)
    assert peak_mixed < 2 * state + pools + (1 << 16), (peak_mixed, state, whole)


# -- resume ------------------------------------------------------------------------------
def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.bucket, x.position, x.partitions) == (y.bucket, y.position, y.partitions)
        np.testing.assert_array_equal(x.edges, y.edges)
        np.testing.assert_array_equal(x.negatives, y.negatives)
        np.testing.assert_array_equal(x.weight, y.weight)
        np.testing.assert_array_equal(x.pool, y.pool)


@pytest.mark.parametrize(("mix", "pad"), [("bucket", False), ("buffer", False),
                                          ("buffer", True)])
def test_resume_anywhere_reproduces_the_rest(mix, pad):
    p = buckets.plan(_edges(E=2500, cols=3), 200, partitions=5, buffer=3, seed=9)
    kw = dict(negatives=4, epoch=1, epochs=3, mix=mix, pad=pad)
    full = list(p.batches(64, **kw))
    assert len(full) == len(p.batches(64, **kw))
    pos = [b.position for b in full]
    assert (p.bucket_sizes > 0).all()
    kinds = {  # a group: a bucket (mix="bucket") or a buffer state (mix="buffer")
        "group start": [n for n, q in enumerate(pos) if q[2] == 0 and q[1] > 0],
        "mid-group": [n for n, q in enumerate(pos) if q[2] == 1],
        "last batch of a group": [n for n in range(len(pos) - 1)
                                   if pos[n + 1][:2] != pos[n][:2] and pos[n][2] > 0],
        "epoch start": [n for n in range(1, len(pos)) if pos[n][0] != pos[n - 1][0]],
        "first and last": [0, len(pos) - 1],
    }
    assert all(len(v) >= 2 for v in kinds.values()), kinds
    for n in sorted({n for v in kinds.values() for n in (v[0], v[len(v) // 2], v[-1])}):
        it = p.batches(64, **kw)
        for _ in range(n):
            next(it)
        sd = json.loads(json.dumps(it.state_dict()))  # JSON-able: ints, strs, pool_share
        assert all(isinstance(v, int | str) for k, v in sd.items() if k != "pool_share")
        assert sd["pool_share"] == 1.0  # the default share: the pool holds all 200 rows
        assert (sd["epoch"], sd["bucket_index"], sd["batch_index"]) == it.position == pos[n]
        assert sd["mix"] == mix
        resumed = p.batches(64, **kw, start=sd)
        assert len(resumed) == len(full) - n
        _same(list(resumed), full[n:])
        _same(list(p.batches(64, **kw, start=it.position)), full[n:])
        _same(list(it), full[n:])  # and the interrupted one goes on the same
    it = p.batches(64, **kw)
    list(it)
    assert it.position == (4, 0, 0)
    assert list(p.batches(64, **kw, start=it.state_dict())) == []
    # an iterator per epoch resumes the same way: epoch 2 from its middle
    per_epoch = [b for b in full if b.position[0] == 2]
    one = dict(negatives=4, epoch=2, mix=mix, pad=pad)
    it = p.batches(64, **one)
    for _ in range(7):
        next(it)
    _same(list(p.batches(64, **one, start=it.state_dict())), per_epoch[7:])
    if mix == "buffer":  # a position inside a state, between its buckets, is no position
        bufs = p.order(1).buffers
        k = next(k for k in range(1, 25) if bufs[k] == bufs[k - 1])
        with pytest.raises(ValueError, match=r"bucket_index the first bucket of a buffer "
                           r"state \(mix='buffer'\)"):
            p.batches(64, **kw, start=(1, k, 0))


def test_a_state_dict_of_another_plan_or_parameters_is_refused():
    p = buckets.plan(_edges(), 200, partitions=5, buffer=3)
    it = p.batches(64, negatives=2, mix="bucket")
    next(it)
    sd = it.state_dict()
    others = {
        "num_partitions 5 != 4": (buckets.plan(_edges(), 200, partitions=4, buffer=3), {}),
        "buffer 3 != 2": (buckets.plan(_edges(), 200, partitions=5, buffer=2), {}),
        "seed 0 != 1": (buckets.plan(_edges(), 200, partitions=5, buffer=3, seed=1), {}),
        "num_edges 3000 != 2999": (buckets.plan(_edges()[:-1], 200, partitions=5, buffer=3),
                                   {}),
        "buckets_crc32": (buckets.plan(_edges(seed=1), 200, partitions=5, buffer=3), {}),
        "batch_size 64 != 65": (p, {"batch_size": 65}),
        "negatives 2 != 0": (p, {"negatives": 0}),
        "mix 'bucket' != 'buffer'": (p, {"mix": "buffer"}),
    }
    for text, (q, kw) in others.items():
        args = {"batch_size": 64, "negatives": 2, "mix": "bucket", **kw}
        with pytest.raises(ValueError, match=r"start was saved by another plan or with other "
                           rf"batch parameters \(saved != now\): .*{re.escape(text)}"):
            q.batches(args.pop("batch_size"), **args, start=sd)
    # a state dict saved before mix= existed came from the bucket-by-bucket order
    old = {k: v for k, v in sd.items() if k != "mix"}
    _same(list(p.batches(64, negatives=2, mix="bucket", start=old)),
          list(p.batches(64, negatives=2, mix="bucket", start=sd)))
    with pytest.raises(ValueError, match=r"mix 'bucket' != 'buffer'; resume with the plan, "
                       r"batch_size, negatives, mix, pool and pool_share it was saved with"):
        p.batches(64, negatives=2, mix="buffer", start=old)
    with pytest.raises(ValueError, match=r"start must be a BatchIterator.state_dict\(\)"):
        p.batches(64, start={"epoch": 0})
    with pytest.raises(ValueError, match=r"start position \(3, 0, 0\) is not in this "
                       r"iteration: epochs \[0, 1\)"):
        p.batches(64, start=(3, 0, 0))
    with pytest.raises(ValueError, match=r"start position \(0, 25, 0\)"):
        p.batches(64, start=(0, 25, 0))
    with pytest.raises(ValueError, match=r"start position \(0, 0, 99\)"):
        p.batches(64, start=(0, 0, 99))
    with pytest.raises(ValueError, match=r"start must be a state_dict or a position"):
        p.batches(64, start=(0, -1, 0))


# -- padding to fixed shapes ---------------------------------------------------------------
def _softplus_grads(W, edges, neg, weight):
    """The gradient with respect to the table ``W`` of the weighted LINE-style loss
    ``sum_i w_i (softplus(-<u_i, v_i>) + sum_k softplus(<u_i, n_ik>)) / sum_i w_i``, and the
    ids it touches (every id of the batch)."""
    src, dst = edges[:, 0], edges[:, -1]
    u, v, w = W[src], W[dst], W[neg]
    a = 1 / (1 + np.exp((u * v).sum(1)))                     # sigmoid(-<u, v>)
    sn = 1 / (1 + np.exp(-(u[:, None] * w).sum(2)))          # sigmoid(<u, n>)
    scale = (weight / weight.sum()).astype(np.float64)
    G = np.zeros_like(W)
    np.add.at(G, src, scale[:, None] * (-a[:, None] * v + (sn[..., None] * w).sum(1)))
    np.add.at(G, dst, scale[:, None] * (-a[:, None] * u))
    np.add.at(G, neg.ravel(), (scale[:, None, None] * sn[..., None] * u[:, None])
              .reshape(-1, W.shape[1]))
    return G, np.unique(np.concatenate([src, dst, neg.ravel()]))


@pytest.mark.parametrize(("mix", "B"), [("bucket", 64), ("buffer", 64), ("buffer", 700),
                                        ("bucket", 300)])
def test_pad_repeats_a_short_batch_own_rows_with_weight_zero(mix, B):
    e = _edges(E=2500, cols=3, seed=4)
    p = buckets.plan(e, 200, partitions=5, buffer=3, seed=3)
    kw = dict(negatives=4, epochs=2, mix=mix)
    plain = list(p.batches(B, **kw))
    padded = list(p.batches(B, **kw, pad=True))
    assert len(plain) == len(padded) == len(p.batches(B, **kw, pad=True))
    short = 0
    for x, y in zip(plain, padded, strict=True):
        n = len(x.edges)
        short += n < B
        assert (x.bucket, x.position, x.partitions) == (y.bucket, y.position, y.partitions)
        assert y.edges.shape == (B, 3) and y.negatives.shape == (B, 4)
        assert y.weight.dtype == np.float32 and y.weight.shape == (B,)
        assert (y.weight[:n] == 1).all() and (y.weight[n:] == 0).all()
        # the real rows are the unpadded batch, unchanged (edges and their negatives)
        np.testing.assert_array_equal(y.edges[:n], x.edges)
        np.testing.assert_array_equal(y.negatives[:n], x.negatives)
        # each padding row is a real edge together with that edge's negatives
        real = {tuple(r) for r in np.hstack([x.edges, x.negatives]).tolist()}
        assert {tuple(r) for r in np.hstack([y.edges[n:], y.negatives[n:]]).tolist()} <= real
        # so a padded batch touches exactly the ids of the unpadded one
        ids = (lambda b: set(np.concatenate([b.edges[:, [0, -1]].ravel(),
                                             b.negatives.ravel()]).tolist()))
        assert ids(y) == ids(x)
        assert set(y.edges[:, 1].tolist()) == set(x.edges[:, 1].tolist())  # relations too
    assert short >= 5  # the last batch of a group (B=700: most batches) is padded
    for epoch in (0, 1):  # every edge exactly once per epoch with weight 1
        real = [b.edges[b.weight == 1] for b in padded if b.position[0] == epoch]
        np.testing.assert_array_equal(_rows(np.concatenate(real)), _rows(e))


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_a_weighted_loss_of_a_padded_batch_has_the_unpadded_gradients(mix):
    N, D = 200, 8
    p = buckets.plan(_edges(E=1500, N=N), N, partitions=4, buffer=2, seed=5)
    W = np.random.default_rng(0).standard_normal((N, D)) * 0.3
    plain = list(p.batches(64, negatives=3, mix=mix))
    padded = list(p.batches(64, negatives=3, mix=mix, pad=True))
    checked = 0
    for x, y in zip(plain, padded, strict=True):
        if len(x.edges) == 64:
            continue
        g_plain, ids_plain = _softplus_grads(W, x.edges, x.negatives, x.weight)
        g_pad, ids_pad = _softplus_grads(W, y.edges, y.negatives, y.weight)
        np.testing.assert_allclose(g_pad, g_plain, rtol=1e-12, atol=1e-15)
        np.testing.assert_array_equal(ids_pad, ids_plain)
        # without the weights the repeated rows would count twice (the mean of the padded
        # batch differs unless the short batch's length divides 64): the check can tell
        if 64 % len(x.edges):
            g_bad, _ = _softplus_grads(W, y.edges, y.negatives, np.ones(64))
            assert not np.allclose(g_bad, g_plain, rtol=1e-6, atol=0)
            checked += 1
    assert checked >= 4


# -- the buffer protocol with stores -------------------------------------------------------
class _Recorder:
    """Stands in for dsa_core.load_range / release_range and records the calls."""

    def __init__(self, plan, events):
        self.plan, self.events = plan, events

    def make(self, kind):
        def call(state, start, stop, *, wait=False):
            p = int(np.searchsorted(self.plan.bounds, start, side="right") - 1)
            assert (start, stop) == (self.plan.bounds[p], self.plan.bounds[p + 1])
            assert not wait  # the iterator never waits
            self.events.append((kind, p, state.path))
        return call


def _check_protocol(events, c, stores):  # noqa: C901 - one replay, read top to bottom
    """Replay the recorded calls and batches: ``[(kind, partition, path) | ("batch", batch,
    resident, next_resident)]``. Returns the calls of the first store."""
    held: set[int] = set()
    paths = [s.path for s in stores]
    per_store: dict = {}
    for ev in events:
        if ev[0] == "batch":
            b, resident, nxt = ev[1], ev[2], ev[3]
            assert b.partitions == tuple(resident)
            if b.bucket is None:  # mixed over the state: every resident partition, always
                assert set(resident) <= held, (b.position, held, resident)
            else:
                # the bucket's partitions are requested before it, and with negatives every
                # resident one (they are drawn from all; without, one that no later bucket
                # of the state needs may be handed back early)
                assert set(b.bucket) <= held, (b.position, held, resident)
                if b.negatives.shape[1]:
                    assert set(resident) <= held, (b.position, held, resident)
            entering = set(nxt) - set(resident)
            if entering:  # the next swap's partition is read ahead while this one trains
                assert entering & held, (b.position, held, nxt)
            # a partition that left was handed back before this state's first batch
            assert held - set(resident) <= entering, (b.position, held, resident, nxt)
            assert len(held) <= c + 1, (b.position, held)
            continue
        kind, part, path = ev
        per_store.setdefault(path, []).append((kind, part))
        if path != paths[0]:
            continue
        if kind == "load":
            assert part not in held
            held.add(part)
        else:
            assert part in held
            held.discard(part)
    assert held == set()  # everything handed back at the end
    assert all(v == per_store[paths[0]] for v in per_store.values())  # each store the same
    return per_store[paths[0]]


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
@pytest.mark.parametrize(("P", "c", "negatives", "epochs"),
                         [(6, 2, 3, 1), (7, 3, 0, 2), (8, 4, 5, 2), (3, 4, 2, 2), (1, 2, 0, 1)])
def test_the_iterator_loads_before_use_reads_ahead_and_releases(tmp_path, monkeypatch, P, c,
                                                                negatives, epochs, mix):
    p = buckets.plan(_edges(E=2000), 200, partitions=P, buffer=c, seed=P)
    stores = [dsa_core.create(tmp_path / f"s{n}", 200, 4) for n in range(2)]
    events: list = []
    rec = _Recorder(p, events)
    monkeypatch.setattr(dsa_core, "load_range", rec.make("load"), raising=False)
    monkeypatch.setattr(dsa_core, "release_range", rec.make("release"), raising=False)
    it = p.batches(50, negatives=negatives, epochs=epochs, stores=stores, mix=mix)
    orders = [p.order(e) for e in range(epochs)]

    def next_state(e, k):  # the resident set after this buffer state (the next epoch's first)
        buf = orders[e].buffers[k]
        later = [b for b in orders[e].buffers[k:] if b != buf]
        return later[0] if later else orders[e + 1].buffers[0] if e + 1 < epochs else ()

    for b in it:
        e, k, _ = b.position
        assert np.isin(p.partition_of(b.edges[:, [0, -1]]), b.partitions).all()
        events.append(("batch", b, orders[e].buffers[k], next_state(e, k)))
    calls = _check_protocol(events, c, stores)
    assert it.loads == sum(1 for kind, _ in calls if kind == "load")
    assert it.loads == _issued(_states(p, epochs))
    for s in stores:
        dsa_core.close(s)


def test_resume_re_establishes_the_buffer(tmp_path, monkeypatch):
    p = buckets.plan(_edges(E=2000), 200, partitions=6, buffer=3, seed=1)
    s = dsa_core.create(tmp_path / "s", 200, 4)
    events: list = []
    rec = _Recorder(p, events)
    monkeypatch.setattr(dsa_core, "load_range", rec.make("load"), raising=False)
    monkeypatch.setattr(dsa_core, "release_range", rec.make("release"), raising=False)
    order = p.order(0)
    k = next(k for k in range(1, 36) if order.buffers[k] == order.buffers[k - 1]
             and order.buffers[k] != order.buffers[0] and p.bucket_sizes[tuple(order.buckets[k])])
    it = p.batches(40, start=(0, k, 0), stores=[s], mix="bucket")
    first = next(it)
    assert first.position == (0, k, 0)
    loads = [part for kind, part, _ in events if kind == "load"]
    assert set(order.buffers[k]) <= set(loads) and len(loads) <= len(order.buffers[k]) + 1
    assert not [e for e in events if e[0] == "release"]
    dsa_core.close(s)


def _train(p, stores_of, tmp_path, name, negatives=3, mix="bucket"):
    """A tiny skip-gram-like run: pull the endpoints together, push negatives away."""
    s = dsa_core.create(tmp_path / name, p.num_nodes, 8, lr=0.05, init="normal", seed=3)
    it = p.batches(64, negatives=negatives, epochs=2, stores=stores_of(s), mix=mix)
    for b in it:
        src, dst, neg = b.edges[:, 0], b.edges[:, -1], b.negatives
        u, v, w = (dsa_core.gather(s, x.ravel()) for x in (src, dst, neg))
        w = w.reshape(*neg.shape, 8)
        gu = (1 / (1 + np.exp((u * v).sum(1, keepdims=True))) * -v
              + (w / (1 + np.exp(-(u[:, None] * w).sum(2, keepdims=True)))).sum(1))
        idx = np.concatenate([src, dst])
        s = dsa_core.step(s, idx, np.concatenate([gu, -gu]).astype(np.float32))
    return s, it


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_hints_never_change_the_trained_values(tmp_path, mix):
    p = buckets.plan(_edges(E=1500), 200, partitions=5, buffer=2)
    a, _ = _train(p, lambda s: [], tmp_path, "a", mix=mix)
    b, it = _train(p, lambda s: [s], tmp_path, "b", mix=mix)
    dsa_core.wait_ranges(b)
    assert it.loads == _issued(_states(p, 2))
    np.testing.assert_array_equal(dsa_core.read_records(a, np.arange(200)),
                                  dsa_core.read_records(b, np.arange(200)))
    for s in (a, b):
        dsa_core.close(s)


def test_released_partitions_leave_memory_loaded_ones_are_resident(tmp_path, monkeypatch):
    """The effect of the hints: the partitions of each bucket's buffer are in the page cache
    when it trains, and each partition the iterator releases is written back and dropped
    (measured as the release completes: a later load's kernel read-ahead may bring
    neighbouring pages back, which is the load's business)."""
    N, P, c = 4000, 4, 2
    p = buckets.plan(_edges(E=4000, N=N), N, partitions=P, buffer=c, seed=1)
    s = dsa_core.create(tmp_path / "s", N, 64, access="disk")
    dsa_core.release_range(s, 0, N, wait=True)
    order = p.order(0)
    rows = [np.arange(p.bounds[q], p.bounds[q + 1]) for q in range(P)]
    real = dsa_core.release_range
    dropped = []

    def release(state, start, stop, *, wait=False):
        real(state, start, stop, wait=wait)
        dsa_core.wait_ranges(state)
        dropped.append(dsa_core.residency(state, np.arange(start, stop)))

    monkeypatch.setattr(dsa_core, "release_range", release)
    for b in p.batches(10_000, stores=[s]):
        dsa_core.wait_ranges(s)
        for q in order.buffers[b.position[1]]:
            assert dsa_core.residency(s, rows[q]) == 1.0, (q, b.position)
        s = dsa_core.step(s, b.edges[:, 0], np.ones((len(b.edges), 64), np.float32))
    assert len(dropped) >= P and max(dropped) < 0.05, dropped
    dsa_core.close(s)


def test_close_hands_back_the_buffer_and_keeps_the_position(tmp_path):
    N, P = 4000, 4
    p = buckets.plan(_edges(E=4000, N=N), N, partitions=P, buffer=2, seed=1)
    s = dsa_core.create(tmp_path / "s", N, 64, access="disk")
    dsa_core.release_range(s, 0, N, wait=True)
    # pool=0: a pool of rows from all partitions (here: all of them) is prefetched, not loaded
    with p.batches(100, negatives=2, stores=[s], pool=0) as it:
        seen = [next(it) for _ in range(7)]
        dsa_core.wait_ranges(s)
        held = dsa_core.residency(s, np.arange(N))
        pos = it.position
    dsa_core.wait_ranges(s)
    assert held >= 0.5 and dsa_core.residency(s, np.arange(N)) < 0.05
    assert it.position == pos and list(it) == []  # closed: nothing more, position kept
    it.close()  # twice is fine
    rest = list(p.batches(100, negatives=2, start=it.state_dict(), pool=0))
    full = list(p.batches(100, negatives=2, pool=0))
    assert len(seen) + len(rest) == len(full)
    for a, b in zip(seen + rest, full, strict=True):
        np.testing.assert_array_equal(a.edges, b.edges)
        np.testing.assert_array_equal(a.negatives, b.negatives)
    dsa_core.close(s)


def test_closing_the_store_first_then_the_iterator(tmp_path):
    p = buckets.plan(_edges(E=500, N=200), 200, partitions=4, buffer=2)
    s = dsa_core.create(tmp_path / "s", 200, 8)
    it = p.batches(50, stores=[s])
    next(it)
    dsa_core.close(s)
    it.close()  # no error: the closed store is skipped


# -- the user guide's example runs -----------------------------------------------------------
def test_the_user_guide_examples_run(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "buckets.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", text, flags=re.S | re.M)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "docs/buckets.md", "exec"), {"__name__": "__docs__"})
