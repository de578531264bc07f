"""dsa_core.buckets.fit: choosing P and c that fit in a memory budget, the framework's included.

The oracle is the memory rule written out again here, independently of the module: the
iterator holds ``min(c + 1, P)`` partitions of ``ceil(num_rows / P)`` rows of every table
(the buffer and the one read ahead) plus one bucket's edges and their shuffle plus two
negatives' pools (``min(2 * pool, num_rows)`` rows). A choice
must fit in ``memory - reserve``, with P the smallest that fits for its c and c the largest
in ``[2, max_buffer]`` that fits at all.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import dsa_core
from dsa_core import _paging, buckets
from helpers import memcap, memcap_unavailable

MiB = 1 << 20


def _held(N, rec, P, c, E=0, cols=2, pool=buckets.DEFAULT_POOL):
    return (min(c + 1, P) * -(-N // P) * rec + -(-E // (P * P)) * (8 * cols + 8)
            + min(2 * pool, N) * rec)  # the negatives' pools: this state's and the next's


GRID = list(itertools.product(
    [1, 7, 1_000, 123_457, 10_000_000],          # num_rows
    [64, 1_536],                                  # record bytes per row
    [64 * MiB, 700 * MiB, 4096 * MiB, 64 << 30],  # memory
    [0, 512 * MiB],                               # reserve
    [0, 10**8],                                   # edges
))


@pytest.mark.parametrize("N,rec,M,R,E", GRID)
def test_choice_fits_and_is_tight(N, rec, M, R, E):
    avail = M - R
    if avail <= 0 or _held(N, rec, N, 2, E) > avail:
        with pytest.raises(ValueError, match="memory"):
            buckets.fit([(N, rec)], memory=M, reserve=R, num_edges=E)
        return
    f = buckets.fit([(N, rec)], memory=M, reserve=R, num_edges=E)
    P, c = f.partitions, f.buffer
    assert 2 <= c <= 8 and min(c, N) <= P <= N
    assert f.buffer_bytes == _held(N, rec, P, c, E)
    assert f.buffer_bytes + f.reserve <= f.memory == M and f.reserve == R
    assert f.partition_bytes == -(-N // P) * rec
    # P is the smallest >= c that fits, c the largest that fits at any P
    assert P == min(c, N) or _held(N, rec, P - 1, c, E) > avail
    if c < 8:
        assert all(_held(N, rec, p, c + 1, E) > avail for p in range(c + 1, N + 1)
                   ) if N < 2_000 else _held(N, rec, N, c + 1, E) > avail


@pytest.mark.parametrize("N,rec", [(1_000, 64), (123_457, 1_536), (10_000_000, 1_536)])
@pytest.mark.parametrize("c", [None, 2, 5])
def test_more_memory_never_more_partitions(N, rec, c):
    mems = [int(m) for m in np.geomspace(N * rec / 50, 4 * N * rec, 40)]
    got = []
    for M in mems:
        try:
            f = buckets.fit([(N, rec)], memory=M, reserve=0, buffer=c)
        except ValueError:
            assert not got, "a larger memory failed where a smaller one fitted"
            continue
        got.append((f.buffer, f.partitions))
    assert got
    cs = [g[0] for g in got]
    assert cs == sorted(cs)  # c never shrinks as memory grows
    for (c1, p1), (c2, p2) in zip(got, got[1:]):
        if c1 == c2:
            assert p2 <= p1


def test_fixed_partitions_or_buffer():
    N, rec, M = 1_000_000, 1_536, 1 << 30
    f = buckets.fit([(N, rec)], memory=M, reserve=0, partitions=40)
    assert f.partitions == 40 and _held(N, rec, 40, f.buffer) <= M
    assert f.buffer == 8 or _held(N, rec, 40, f.buffer + 1) > M
    g = buckets.fit([(N, rec)], memory=M, reserve=0, partitions=40, buffer=3)
    assert (g.partitions, g.buffer) == (40, 3)
    whole = buckets.fit([(N, rec)], memory=2 * M, reserve=0, partitions=1)  # all at once
    assert (whole.partitions, whole.buffer, whole.buffer_bytes) == (1, 2, _held(N, rec, 1, 2))
    with pytest.raises(ValueError, match=r"no P and c fit.*P = 2, c = 2; P = 2 given"):
        buckets.fit([(N, rec)], memory=M, reserve=0, partitions=2)
    with pytest.raises(ValueError, match="drop the fixed"):
        buckets.fit([(N, rec)], memory=M, reserve=0, partitions=4, buffer=3)
    with pytest.raises(ValueError, match="partitions must be <= num_rows = 10"):
        buckets.fit([(10, 8)], memory=M, partitions=11)


def test_several_tables_and_mix():
    one = buckets.fit([(100_000, 1_536)], memory=256 * MiB, reserve=0)
    two = buckets.fit([(100_000, 1_536), (100_000, 1_536)], memory=256 * MiB, reserve=0)
    assert two.partition_bytes == -(-100_000 // two.partitions) * 3_072
    assert two.partitions >= one.partitions
    assert buckets.fit((100_000, 1_536), memory=256 * MiB, reserve=0) == one  # one pair
    b = buckets.fit([(100_000, 64)], memory=64 * MiB, reserve=0, num_edges=10**8, buffer=4)
    m = buckets.fit([(100_000, 64)], memory=64 * MiB, reserve=0, num_edges=10**8, buffer=4,
                    mix="buffer")
    assert m.edge_bytes == -(-10**8 // m.partitions**2) * 24 * 16 and m.partitions > b.partitions


def test_errors_say_what_and_how():
    with pytest.raises(ValueError, match=r"reserve 512 MiB >= memory 256 MiB; give more "
                                         r"memory= or a smaller reserve="):
        buckets.fit([(1000, 8)], memory="256MiB")
    with pytest.raises(ValueError, match=r"no P and c fit: .*\(P = 1000000000, c = 2\) "
                                         r"needs 0.0 MiB"):
        buckets.fit([(10**9, 1_536)], memory=513 * MiB + 3 * 1_536 - 1, reserve="513MiB",
                    pool=0)
    with pytest.raises(ValueError, match="same number of rows"):
        buckets.fit([(1000, 8), (999, 8)], memory="1GiB")
    with pytest.raises(ValueError, match="at least one table"):
        buckets.fit([], memory="1GiB")
    with pytest.raises(TypeError, match="reserve must be"):
        buckets.fit([(1000, 8)], memory="1GiB", reserve=0.5)
    with pytest.raises(ValueError, match="reserve must be >= 0 bytes, got -1"):
        buckets.fit([(1000, 8)], memory="1GiB", reserve=-1)
    with pytest.raises(ValueError, match="memory must be > 0 bytes"):
        buckets.fit([(1000, 8)], memory=0)
    with pytest.raises(ValueError, match="memory must be"):
        buckets.fit([(1000, 8)], memory="lots")
    with pytest.raises(TypeError, match=r"tables\[0\] must be"):
        buckets.fit(["t"], memory="1GiB")
    with pytest.raises(ValueError, match="max_buffer must be an int >= 2"):
        buckets.fit([(1000, 8)], memory="1GiB", max_buffer=1)
    with pytest.raises(ValueError, match="mix must be"):
        buckets.fit([(1000, 8)], memory="1GiB", mix="all")
    with pytest.raises(ValueError, match="buffer must be an int >= 2"):
        buckets.fit([(1000, 8)], memory="1GiB", buffer=1)


def test_default_memory_is_the_cgroup_limit(monkeypatch):
    """Without memory= the limit is the machine's memory capped by the process's cgroup."""
    cap = 3 << 30
    monkeypatch.setattr(_paging, "_cgroups", lambda: [_paging._Cgroup(cap, None, None)])
    assert _paging.memory_limit() == min(cap, _paging._physical_bytes())
    f = buckets.fit([(10_000_000, 1_536)])
    assert f.memory == min(cap, _paging._physical_bytes())
    assert f == buckets.fit([(10_000_000, 1_536)], memory=f.memory)
    monkeypatch.setattr(_paging, "_cgroups", lambda: [_paging._Cgroup(600 * MiB, None, None)])
    assert buckets.fit([(10_000_000, 1_536)]).memory == 600 * MiB


def test_states_and_the_iterator_accept_the_choice(tmp_path):
    """A State counts its whole record; plan() and batches() take the returned P and c, and
    the iterator never holds more than the fit counted."""
    N, D = 3_000, 8
    s = dsa_core.create(tmp_path / "s", N, D, storage="inplace")
    rec = s.layout["stride"] * s.dtype.itemsize
    assert rec == 3 * D * 4  # weights, m and v
    M = 6 * -(-N // 10) * rec + 2 * 100 * rec  # 6 partitions of P = 10 and 2 pools of 100
    f = buckets.fit([s], memory=M, reserve=0, max_buffer=5, pool=100)
    assert (f.partitions, f.buffer) == (10, 5) and f == buckets.fit(
        [(N, rec)], memory=M, reserve=0, max_buffer=5, pool=100)
    assert f.pool_bytes == 200 * rec
    edges = np.random.default_rng(0).integers(0, N, size=(2_000, 2))
    p = buckets.plan(edges, N, partitions=f.partitions, buffer=f.buffer)
    held, most = set(), 0
    load, release = dsa_core.load_range, dsa_core.release_range

    def on_load(st, lo, hi):
        held.add(lo)
        return load(st, lo, hi)

    def on_release(st, lo, hi):
        held.discard(lo)
        return release(st, lo, hi)

    mp = pytest.MonkeyPatch()
    mp.setattr(dsa_core, "load_range", on_load)
    mp.setattr(dsa_core, "release_range", on_release)
    try:
        n = 0
        for b in p.batches(256, negatives=2, stores=[s], pool=100):
            assert len(b.pool) == 100
            most = max(most, len(held))
            n += len(b.edges)
    finally:
        mp.undo()
    dsa_core.wait_ranges(s)
    assert n == len(edges) and f.buffer <= most
    assert most * f.partition_bytes + f.pool_bytes <= f.buffer_bytes
    dsa_core.close(s)


def test_a_log_store_gets_the_memory_its_region_needs(tmp_path):
    """A log store holds the partitions in its region: fit returns the memory= that region
    needs (index and buffers included) instead of counting its records as page cache, the
    iterator accepts a store reopened with it, and one byte less is refused."""
    N, D, B, K = 20_000, 8, 64, 2
    s = dsa_core.create(tmp_path / "l", N, D, storage="log", memory="2MiB")
    with pytest.raises(ValueError, match="batch_size="):
        buckets.fit([s], memory="64MiB", reserve="1MiB")
    f = buckets.fit([s], memory="64MiB", reserve="1MiB", batch_size=B, negatives=K, pool=0)
    (m,) = f.store_memory
    rows = min(f.buffer + 1, f.partitions) * -(-N // f.partitions) + B * (2 + K)
    assert m == dsa_core.region_memory(s, rows)
    assert f.buffer_bytes == m and f.buffer_bytes <= f.memory - f.reserve
    assert f.reserve == MiB  # the store's present memory= does not count
    assert "log stores' memory=" in str(f)
    pair = buckets.fit([(N, s.layout["stride"] * 4)], memory="64MiB", reserve="1MiB", pool=0)
    assert pair.store_memory == (None,)
    dsa_core.close(s)
    edges = np.random.default_rng(0).integers(0, N, size=(3_000, 2))
    p = buckets.plan(edges, N, partitions=f.partitions, buffer=f.buffer)
    s = dsa_core.open(tmp_path / "l", memory=m - 1)
    with pytest.raises(ValueError, match="memory="):
        p.batches(B, negatives=K, stores=[s], pool=0)
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "l", memory=m)
    for b in p.batches(B, negatives=K, stores=[s], pool=0):
        s = dsa_core.step(s, *_ids_grads(b, D))
    assert s.store.log_stats()["range_pins_dropped"] == 0
    dsa_core.close(s)


def _ids_grads(b, D):
    ids = np.concatenate([b.edges[:, 0], b.edges[:, 1], b.negatives.ravel()])
    return ids, np.full((ids.shape[0], D), 1e-3, np.float32)


_TRAIN_UNDER_CAP = """
import sys, numpy as np, dsa_core
from dsa_core import buckets
kind, where = sys.argv[1], sys.argv[2]
N, D, B, K = 1_000_000, 64, 1024, 2          # 0.77 GB of [w | m | v]: 1.5x the cap
s = dsa_core.create(where + "/t", N, D, storage=kind, memory="64MiB" if kind == "log" else None)
f = buckets.fit([s], reserve="256MiB", batch_size=B, negatives=K)  # memory=: the cgroup's
print(f.memory, f.partitions, f.buffer, f.store_memory, flush=True)
if kind == "log":
    dsa_core.close(s)
    s = dsa_core.open(where + "/t", memory=f.store_memory[0])
edges = np.random.default_rng(0).integers(0, N, size=(400_000, 2))
it = buckets.plan(edges, N, partitions=f.partitions, buffer=f.buffer).batches(
    B, negatives=K, stores=[s])
states, steps, last = 0, 0, None
for b in it:
    if b.partitions != last:
        states, last = states + 1, b.partitions
        if states > 3:
            break
    ids = np.concatenate([b.edges.ravel(), b.negatives.ravel()])
    s = dsa_core.step(s, ids, np.full((ids.shape[0], D), 1e-3, np.float32))
    steps += 1
it.close()
dsa_core.close(s)
print("ok", steps, states, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["inplace", "log"])
@pytest.mark.skipif(memcap_unavailable() is not None, reason=str(memcap_unavailable()))
def test_the_choice_trains_under_a_real_cgroup(tmp_path, kind):
    """fit's P and c (memory= read from the cgroup, a reserve for the interpreter) train
    three buffer states of a table 1.5x larger than a real 512 MiB memory cgroup, with the
    default negatives' pool, without the cgroup killing the process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ,
               PYTHONPATH=str(__import__("pathlib").Path(dsa_core.__file__).parents[1]))
    r = subprocess.run(memcap("512M", sys.executable, "-c", _TRAIN_UNDER_CAP, kind,
                              str(tmp_path)), capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode and "no writable memory cgroup" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, (r.stdout, r.stderr)  # 137: killed by the cgroup
    first, last = r.stdout.split("\n")[0].split(), r.stdout.split()[-3:]
    assert int(first[0]) == 512 * MiB  # fit read the cgroup's limit
    assert last[0] == "ok" and int(last[2]) == 4 and int(last[1]) > 0
