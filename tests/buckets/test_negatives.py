"""The negatives of ``plan.batches``: the buffer's share and the pool's (``pool=``,
``pool_share=``), their determinism and resume, the old behaviour (``pool=0``), the
arguments, the pool's read-ahead with stores, and ``fit`` counting the pool."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import dsa_core
from dsa_core import buckets


def _plan(N=300, P=6, c=3, E=6000, seed=2, cols=2):
    e = np.random.default_rng(seed).integers(0, N, size=(E, cols))
    return buckets.plan(e, N, partitions=P, buffer=c, seed=seed)


def _old_negatives(p, b, K):
    """The negatives the iterator drew before the pool existed (written out again): uniform
    over the resident partitions' rows, from the generator of (seed, epoch, bucket, batch)."""
    e, k, t = b.position
    res = np.array(b.partitions, np.int64)
    rsz = p.bounds[res + 1] - p.bounds[res]
    rcum = np.concatenate([[0], np.cumsum(rsz)])
    rng = np.random.default_rng([p.seed, e, k, t, 3])
    u = rng.integers(0, rcum[-1], size=(len(b.edges), K), dtype=np.int64)
    at = np.searchsorted(rcum, u, side="right") - 1
    return p.bounds[res[at]] + (u - rcum[at])


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_pool_share_from_all_partitions_the_rest_from_the_buffer(mix):
    p = _plan()
    K, S = 16, 40
    outside, pooled, total = 0, 0, 0
    pools, prev = [], None
    for b in p.batches(100, negatives=K, mix=mix, pool=S, pool_share=0.5, epochs=2):
        assert b.pool.shape == (S,) and b.pool.dtype == np.int64 and not b.pool.flags.writeable
        assert (np.diff(b.pool) > 0).all() and 0 <= b.pool[0] and b.pool[-1] < p.num_nodes
        if prev is not None and (prev.position[0], prev.partitions) == (b.position[0],
                                                                        b.partitions):
            assert b.pool is prev.pool  # one pool per buffer state
        else:
            pools.append(b.pool)
        prev = b
        part = p.partition_of(b.negatives)
        resident = np.isin(part, b.partitions)
        in_pool = np.isin(b.negatives, b.pool)
        assert (resident | in_pool).all()  # from the buffer or from the pool, nothing else
        outside += int((~resident).sum())
        pooled += int(in_pool.sum())
        total += b.negatives.size
    # the pools are drawn from every partition, and differ between states
    allpool = np.concatenate(pools)
    assert set(p.partition_of(allpool).tolist()) == set(range(p.num_partitions))
    assert len({a.tobytes() for a in pools}) == len(pools) > 10
    # a pool negative is outside the buffer with probability about 1 - c/P = 1/2: with
    # share 1/2 about a quarter of all negatives are outside the buffer
    assert 0.18 < outside / total < 0.32, outside / total
    assert pooled / total > 0.45


def test_share_one_all_from_the_pool_share_zero_none():
    p = _plan()
    for b in p.batches(100, negatives=8, pool=25, pool_share=1.0):
        assert np.isin(b.negatives, b.pool).all()
    counts = np.bincount(np.concatenate([b.negatives.ravel() for b in
                                         p.batches(100, negatives=8, pool=25, pool_share=1.0,
                                                   epochs=4)]), minlength=p.num_nodes)
    # uniform over all nodes in expectation: every partition gets about 1/P of them
    per = np.add.reduceat(counts, p.bounds[:-1]) / counts.sum()
    assert np.abs(per - 1 / p.num_partitions).max() < 0.05, per
    none = list(p.batches(100, negatives=8, pool=25, pool_share=0.0))
    old = list(p.batches(100, negatives=8, pool=0))
    assert all(b.pool.size == 0 for b in none + old)
    for a, b in zip(none, old, strict=True):
        np.testing.assert_array_equal(a.negatives, b.negatives)


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_pool_zero_is_the_old_behaviour_bit_for_bit(mix):
    p = _plan(cols=3)
    got = list(p.batches(64, negatives=5, mix=mix, pool=0, epochs=2))
    for b in got:
        np.testing.assert_array_equal(b.negatives, _old_negatives(p, b, 5))
    # with a pool, the buffer's negatives are drawn first from the same generator: the ones
    # not replaced by a pool row are the old ones
    for a, b in zip(got, p.batches(64, negatives=5, mix=mix, epochs=2), strict=True):
        np.testing.assert_array_equal(a.edges, b.edges)
        keep = ~np.isin(b.negatives, b.pool) | (a.negatives == b.negatives)
        assert (a.negatives[keep] == b.negatives[keep]).all()


def test_deterministic_per_seed_and_different_across_seeds():
    p = _plan(N=5000, E=8000)
    a = list(p.batches(128, negatives=4, pool=64))
    b = list(p.batches(128, negatives=4, pool=64))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.negatives, y.negatives)
        np.testing.assert_array_equal(x.pool, y.pool)
    other = _plan(N=5000, E=8000, seed=3)
    assert not np.array_equal(next(iter(other.batches(128, negatives=4, pool=64))).pool,
                              a[0].pool)
    # the default pool: min(DEFAULT_POOL, num_nodes) rows, here all of them on a small
    # table; the default share min(1, POOL_RATE * pool / num_nodes)
    assert (buckets.DEFAULT_POOL, buckets.DEFAULT_POOL_SHARE, buckets.POOL_RATE) == (4096,
                                                                                    None, 16)
    it = p.batches(128, negatives=4)
    assert (it.pool, it.pool_share) == (4096, 1.0)
    big = buckets.plan(np.zeros((1, 2), np.int64), 200_000, partitions=8)
    it = big.batches(128, negatives=4)
    assert (it.pool, it.pool_share) == (4096, 16 * 4096 / 200_000)
    it = big.batches(128, negatives=4, pool=20_000)
    assert (it.pool, it.pool_share) == (20_000, 1.0)
    assert big.batches(128, negatives=4, pool=20_000, pool_share=0.25).pool_share == 0.25
    small = _plan(N=300)
    b0 = next(iter(small.batches(128, negatives=4)))
    np.testing.assert_array_equal(b0.pool, np.arange(300))


@pytest.mark.parametrize("mix", ["bucket", "buffer"])
def test_resume_mid_epoch_gives_the_same_batches(mix):
    p = _plan(N=2000, E=5000, cols=3)
    kw = dict(negatives=6, epochs=2, mix=mix, pool=50, pool_share=0.7)
    full = list(p.batches(64, **kw))
    for n in (1, len(full) // 3, len(full) // 2 + 1, len(full) - 1):
        it = p.batches(64, **kw)
        for _ in range(n):
            next(it)
        sd = json.loads(json.dumps(it.state_dict()))
        assert (sd["pool"], sd["pool_share"], sd["version"]) == (50, 0.7, 2)
        rest = list(p.batches(64, **kw, start=sd))
        assert len(rest) == len(full) - n
        for a, b in zip(rest, full[n:], strict=True):
            assert a.position == b.position
            np.testing.assert_array_equal(a.edges, b.edges)
            np.testing.assert_array_equal(a.negatives, b.negatives)
            np.testing.assert_array_equal(a.pool, b.pool)
    it = p.batches(64, **kw)
    next(it)
    sd = it.state_dict()
    for change, text in (({"pool": 49}, "pool 50 != 49"),
                         ({"pool_share": 0.5}, "pool_share 0.7 != 0.5")):
        with pytest.raises(ValueError, match=f"saved != now.*{text}"):
            p.batches(64, **{**kw, **change}, start=sd)


def test_a_state_dict_saved_before_the_pool_resumes_the_old_negatives_or_is_refused():
    p = _plan()
    it = p.batches(64, negatives=2, pool=0)
    next(it)
    old = {k: v for k, v in it.state_dict().items() if k not in ("pool", "pool_share")}
    old["version"] = 1  # as the code before the pool saved it
    with pytest.raises(ValueError, match=r"pool 0 != 300.*saved before pool= existed.*pass "
                                         r"pool=0 to resume it"):
        p.batches(64, negatives=2, start=old)  # the defaults now draw from a pool
    a = list(p.batches(64, negatives=2, pool=0, start=old))
    b = list(p.batches(64, negatives=2, pool=0, start=it.state_dict()))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.negatives, y.negatives)
        np.testing.assert_array_equal(x.negatives, _old_negatives(p, x, 2))
    # without negatives the pool plays no part: an old state dict resumes with the defaults
    it0 = p.batches(64)
    next(it0)
    old0 = {k: v for k, v in it0.state_dict().items() if k not in ("pool", "pool_share")}
    old0["version"] = 1
    assert len(list(p.batches(64, start=old0))) == len(it0) - 1
    for v in (3, None, "2"):
        with pytest.raises(ValueError, match=r"state dict version .*reads 1 to 2"):
            p.batches(64, negatives=2, pool=0, start={**old, "version": v})


def test_bad_arguments_are_refused_clearly():
    p = _plan()
    for pool, err, text in ((-1, ValueError, "pool must be an int >= 0, got -1"),
                            (1.5, TypeError, "pool must be an int >= 0, got 1.5"),
                            (True, TypeError, "pool must be an int >= 0, got True"),
                            ("4096", TypeError, "pool must be an int >= 0")):
        with pytest.raises(err, match=text):
            p.batches(64, negatives=2, pool=pool)
    for share, err in ((1.5, ValueError), (-0.1, ValueError), (math.nan, ValueError),
                       ("0.5", TypeError), (True, TypeError), ("auto", TypeError)):
        with pytest.raises(err, match=r"pool_share must (lie in|be a number in) \[0, 1\]"):
            p.batches(64, negatives=2, pool_share=share)
    with pytest.raises(ValueError, match="pool must be an int >= 0"):
        buckets.fit([(1000, 8)], memory="1GiB", pool=-1)
    # accepted: numpy ints and floats, a pool larger than the table (capped), share 0 and 1
    it = p.batches(64, negatives=2, pool=np.int64(10**9), pool_share=np.float32(1.0))
    assert (it.pool, it.pool_share) == (p.num_nodes, 1.0)
    assert p.batches(64, negatives=2, pool=5, pool_share=0).pool == 0
    assert "pool=300, pool_share=1" in repr(it)


def test_fit_counts_two_pools():
    N, rec = 1_000_000, 1_536
    base = buckets.fit([(N, rec)], memory="1GiB", reserve=0, pool=0, buffer=4)
    f = buckets.fit([(N, rec)], memory="1GiB", reserve=0, buffer=4)  # the default pool
    assert base.pool_bytes == 0 and f.pool_bytes == 2 * buckets.DEFAULT_POOL * rec
    assert f.partitions >= base.partitions
    g = buckets.fit([(N, rec)], memory="1GiB", reserve=0, buffer=4,
                    partitions=base.partitions, pool=1000)
    assert g.buffer_bytes - base.buffer_bytes == g.pool_bytes == 2_000 * rec
    assert "negatives' pools 2.9 MiB" in str(g)
    small = buckets.fit([(3000, rec)], memory="1GiB", reserve=0)  # two pools: the table
    assert small.pool_bytes == 3000 * rec
    # a budget that holds the partitions only fits once the pool is left out
    tight = base.buffer_bytes
    with pytest.raises(ValueError, match="no P and c fit"):
        buckets.fit([(N, rec)], memory=tight, reserve=0, buffer=4,
                    partitions=base.partitions)
    assert buckets.fit([(N, rec)], memory=tight, reserve=0, buffer=4,
                       partitions=base.partitions, pool=0) == base._replace(memory=tight)


def test_with_stores_the_pools_are_loaded_a_state_ahead_and_released(tmp_path, monkeypatch):
    N = 2000
    p = _plan(N=N, P=5, c=2, E=3000)
    s = dsa_core.create(tmp_path / "s", N, 4, storage="inplace")
    calls: list[tuple[str, bytes]] = []
    for name in ("load_rows", "release_rows"):
        real = getattr(dsa_core, name)
        monkeypatch.setattr(dsa_core, name, lambda st, rows, _n=name, _f=real, **kw: (
            calls.append((_n, np.array(rows).tobytes())), _f(st, rows, **kw)))
    order = p.order(0)
    states = [b for n, b in enumerate(order.buffers) if n == 0 or order.buffers[n - 1] != b]
    got = list(p.batches(100, negatives=3, stores=[s], pool=30, mix="buffer"))
    dsa_core.wait_ranges(s)
    pools = list(dict.fromkeys(b.pool.tobytes() for b in got))
    assert len(pools) == len(states) > 2
    # the first state's pool and the next one's; then at each state the next one's, after
    # the ended state's is released; at the end the last one's is released
    want = [("load_rows", pools[0]), ("load_rows", pools[1])]
    for n in range(1, len(pools)):
        want.append(("release_rows", pools[n - 1]))
        if n + 1 < len(pools):
            want.append(("load_rows", pools[n + 1]))
    want.append(("release_rows", pools[-1]))
    assert calls == want
    calls.clear()
    list(p.batches(100, negatives=3, pool=30))  # no stores: nothing asked
    list(p.batches(100, negatives=0, stores=[s]))  # no negatives: no pool
    assert calls == []
    # a pool of every row is the same at every state: loaded once, released at the end
    it = p.batches(100, negatives=3, stores=[s], pool=N, epochs=2)
    list(it)
    every = np.arange(N).tobytes()
    assert calls == [("load_rows", every), ("release_rows", every)]
    calls.clear()
    # stopped early: close() releases the pools held, like the partitions
    with p.batches(100, negatives=3, stores=[s], pool=30) as it:
        next(it)
    assert [c[0] for c in calls] == ["load_rows", "load_rows", "release_rows", "release_rows"]
    dsa_core.close(s)
