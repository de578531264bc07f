"""Partition-ordered training with ``stores=[...]`` on both storage kinds: the partitions of the
buffer are in memory while their buckets train, and the trained values are those of the same
loop without stores.

In place "in memory" is the page cache (``dsa_core.residency``: mincore of the mapping); on a
log store it is the region, where the loaded partitions are pinned: no step misses a row of
them and none is evicted (the engine's ``misses`` and ``range_pins_dropped`` counters).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import log_memory

import dsa_core
from dsa_core import buckets

N, D, P, C, B, K = 4000, 16, 4, 2, 100, 2


def _edges(E=4000, seed=0):
    return np.random.default_rng(seed).integers(0, N, size=(E, 2))


def _store(kind, path, slots=None, pool=0):
    """A store of N rows; a log store's region holds the c + 1 partitions, two negatives'
    pools of ``pool`` rows and one step (or ``slots`` rows)."""
    layout = {"num_rows": N, "stride": 3 * D, "dtype": "float32"}
    if kind == "inplace":
        s = dsa_core.create(path, N, D, init="normal", seed=3, lr=0.05, storage="inplace",
                            access="disk")
    else:
        held = slots or min(C + 1, P) * (N // P) + 2 * pool + B * (2 + K)
        s = dsa_core.create(path, N, D, init="normal", seed=3, lr=0.05, storage="log",
                            memory=log_memory(layout, held))
    # every row written once, then handed back: each load reads from disk
    for lo in range(0, N, 400):  # in batches no larger than the training's
        s = dsa_core.step(s, np.arange(lo, lo + 400), np.full((400, D), 1e-3, np.float32))
    dsa_core.release_range(s, 0, N, wait=True)
    return s


def _grads(b):
    ids = np.concatenate([b.edges[:, 0], b.edges[:, 1], b.negatives.ravel()])
    g = np.random.default_rng(int(ids.sum()) % 2**32).standard_normal((ids.shape[0], D))
    return ids, g.astype(np.float32)


def test_the_buffer_is_in_memory_while_its_buckets_train(kind, tmp_path):
    p = buckets.plan(_edges(), N, partitions=P, buffer=C, seed=1)
    s = _store(kind, tmp_path / "s")
    order = p.order(0)
    rows = [np.arange(p.bounds[q], p.bounds[q + 1]) for q in range(P)]
    if kind == "log":
        eng = s.store
        assert eng.slots < N  # out of core: the region holds less than the table
        misses = eng.log_stats()["misses"]
    # pool=0: every negative from the buffer, so that no step needs a row outside it (the
    # default pool's rows come from all partitions; they are prefetched, not loaded)
    it = p.batches(B, negatives=K, stores=[s], pool=0)
    for b in it:
        if kind == "inplace":
            dsa_core.wait_ranges(s)  # the page cache is filled in the background
        s = dsa_core.step(s, *_grads(b))
        for q in order.buffers[b.position[1]]:
            assert dsa_core.residency(s, rows[q]) == 1.0, (q, b.position)
    if kind == "log":
        st = eng.log_stats()
        assert st["misses"] == misses  # no step read a row: each was loaded before it
        assert st["range_pins_dropped"] == 0 and st["range_loads"] == it.loads > 0
        assert eng.check_index() == []
    dsa_core.close(s)


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_values_are_identical_with_and_without_stores(kind, tmp_path, mix):
    """With the negatives' pools loaded and released too (pool=200: a log store's region
    holds two of them beside the partitions, still less than the table)."""
    p = buckets.plan(_edges(seed=2), N, partitions=P, buffer=C, seed=2)
    out = []
    for name, use in (("with", True), ("without", False)):
        s = _store(kind, tmp_path / name, pool=200)
        for b in p.batches(B, negatives=K, epochs=2, stores=[s] if use else (), mix=mix,
                           pool=200):
            s = dsa_core.step(s, *_grads(b))
        dsa_core.wait_ranges(s)
        out.append(s)
    a, b = (dsa_core.read_records(s, np.arange(N)) for s in out)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for s in out:
        dsa_core.close(s)


def test_a_log_region_too_small_for_the_buffer_is_refused_up_front(tmp_path):
    p = buckets.plan(_edges(), N, partitions=P, buffer=C)
    s = _store("log", tmp_path / "s", slots=2 * (N // P))
    with pytest.raises(ValueError) as e:
        p.batches(B, negatives=K, stores=[s], pool=0)
    msg = str(e.value)
    need = dsa_core.region_memory(s, 3 * (N // P) + B * (2 + K))
    for part in ("3 partitions at once", "c = 2 resident and the next one read ahead",
                 f"memory={need}", "partitions=8 or more", "dsa_core.buckets.fit"):
        assert part in msg, (part, msg)
    assert "2 * pool" not in msg and "smaller pool=" not in msg
    # the two negatives' pools count too: the message says so, and how to do without them
    with pytest.raises(ValueError) as e:
        p.batches(B, negatives=K, stores=[s], pool=100)
    msg = str(e.value)
    need = dsa_core.region_memory(s, 3 * (N // P) + 200 + B * (2 + K))
    for part in ("3 partitions at once", "2 * pool = 200 rows", f"memory={need}",
                 "partitions=9 or more", "smaller pool= (pool=0", "fit (pass it pool=)"):
        assert part in msg, (part, msg)
    # the default pool (4096 >= N: every row) can only count the rows outside the partitions
    with pytest.raises(ValueError, match=r"of which only the 1,000 outside the partitions"):
        p.batches(B, negatives=K, stores=[s])
    st = s.store.log_stats()
    assert st["range_loads"] == st["row_loads"] == 0  # nothing was loaded
    p8 = buckets.plan(_edges(), N, partitions=8, buffer=C)
    # as the message says: it fits (3 partitions of 500, 2 pools of 50, a step of 400)
    for b in p8.batches(B, negatives=K, stores=[s], pool=50):
        s = dsa_core.step(s, *_grads(b))
    st = s.store.log_stats()
    assert st["range_pins_dropped"] == 0 and st["row_loads"] > 0
    dsa_core.close(s)


def test_the_default_pool_is_in_a_log_region_while_its_state_trains(tmp_path):
    """The negatives' pools (the default pool=, a proper subset of the nodes here) are loaded
    into a small log store's region beside the partitions: every step finds its rows there
    (no miss, no pin given up), each pool is resident while its state trains, and the batch
    stream and the trained values are those of the same loop without stores."""
    n, P8, d = 24_000, 8, 4
    layout = {"num_rows": n, "stride": 3 * d, "dtype": "float32"}
    edges = np.random.default_rng(5).integers(0, n, size=(6_000, 2))
    p = buckets.plan(edges, n, partitions=P8, buffer=C, seed=4)
    assert buckets.DEFAULT_POOL * 4 < n
    slots = min(C + 1, P8) * (n // P8) + 2 * buckets.DEFAULT_POOL + B * (2 + K)
    mem = log_memory(layout, slots)
    out, streams = [], []
    for name, use in (("with", True), ("without", False)):
        s = dsa_core.create(tmp_path / name, n, d, init="normal", seed=3, lr=0.05,
                            storage="log", memory=mem)
        for lo in range(0, n, 400):  # every row written once, then handed back
            s = dsa_core.step(s, np.arange(lo, lo + 400), np.full((400, d), 1e-3, np.float32))
        dsa_core.release_range(s, 0, n, wait=True)
        eng = s.store
        assert eng.slots < n
        misses = eng.log_stats()["misses"]
        it = p.batches(B, negatives=K, stores=[s] if use else ())
        assert it.pool == buckets.DEFAULT_POOL
        stream = []
        for b in it:
            stream.append((b.position, b.edges, b.negatives, b.pool, b.weight, b.partitions))
            ids = np.concatenate([b.edges[:, 0], b.edges[:, 1], b.negatives.ravel()])
            g = np.random.default_rng(int(ids.sum()) % 2**32).standard_normal((ids.shape[0], d))
            s = dsa_core.step(s, ids, g.astype(np.float32))
            if use:
                assert dsa_core.residency(s, b.pool) == 1.0, b.position
        st = eng.log_stats()
        if use:
            assert st["misses"] == misses  # no step read a pool row (or any row) itself
            assert st["range_pins_dropped"] == 0
            assert st["row_loads"] == len({bt[3].tobytes() for bt in stream}) > 2
            assert st["range_pinned"] == 0  # everything released at the end
            assert eng.check_index() == []
        else:
            assert st["misses"] > misses
        streams.append(stream)
        out.append(s)
    assert len(streams[0]) == len(streams[1])
    for x, y in zip(*streams, strict=True):
        assert x[0] == y[0] and x[5] == y[5]
        for u, v in zip(x[1:5], y[1:5], strict=True):
            np.testing.assert_array_equal(u, v)
    a, b = (dsa_core.read_records(s, np.arange(n)) for s in out)
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    for s in out:
        dsa_core.close(s)
