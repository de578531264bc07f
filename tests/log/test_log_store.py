"""The log-structured store (create(storage="log")) through the public core API: what only a log
store has or does (its region, its memory budget, no whole-table view, read-only readers that
see the last flush, the CLI's segment report, kill -9 / exit / fork with a region in memory).

Its parity with in-place stores is in store/test_store_kinds.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import (
    PARITY_B as B,
    PARITY_D as D,
    PARITY_LAYOUT as LAYOUT,
    PARITY_N as N,
    assert_same_store,
    log_memory,
    parity_batches,
    parity_init,
    parity_pair,
    records,
)

import dsa_core
from dsa_core.__main__ import main as cli


def test_unflushed_steps_are_not_in_a_reader(tmp_path):
    _, b = parity_pair(tmp_path)
    dsa_core.flush(b)
    before = records(b)
    for idx, g in parity_batches(np.float32, steps=5):
        b = dsa_core.step(b, idx, g)
    r = dsa_core.open(tmp_path / "log", mode="r")
    assert r.count == 0
    np.testing.assert_array_equal(records(r), before)
    dsa_core.close(r)
    dsa_core.close(b)


def test_remove_and_named_init(tmp_path):
    s = dsa_core.create(tmp_path / "n", N, D, storage="log", init="normal", seed=3,
                        init_scale=0.5)
    w = dsa_core.gather(s, np.arange(N))
    assert np.isfinite(w).all() and 0.3 < w.std() < 0.7  # N(0, 0.5**2), per (seed, row)
    dsa_core.close(s)
    again = dsa_core.open(tmp_path / "n", mode="r")
    np.testing.assert_array_equal(dsa_core.gather(again, np.arange(N)), w)
    dsa_core.close(again)
    dsa_core.remove(tmp_path / "n")
    assert not (tmp_path / "n").exists()


def test_properties_and_views(tmp_path):
    _, b = parity_pair(tmp_path, per_row_step=True, decoupled_weight_decay=True,
                 decay_missed_steps=True)
    assert b.storage == "log" and b.access == "log" and b.shape == (N, D)
    assert b.has_weights and b.per_row_step and b.decay_missed_steps
    assert b.second_moment == "elementwise" and b.first_moment == "full"
    before = records(b)
    for view in ("weights", "exp_avg", "exp_avg_sq", "row_steps", "last_steps"):
        with pytest.raises(ValueError, match="no whole-table view.*dsa_core.gather.*convert"):
            getattr(b, view)
    with pytest.raises(ValueError, match="no whole-table view"):
        b.store.data
    np.testing.assert_array_equal(records(b), before)
    # set_exp_avg works on every kind: the m columns replaced, the others' bits kept
    m = np.arange(N * D, dtype=np.float32).reshape(N, D)
    b.set_exp_avg(m)
    after = records(b)
    lay = b.layout
    np.testing.assert_array_equal(after[:, lay["m"]:lay["m"] + D], m)
    keep = np.ones(after.shape[1], bool)
    keep[lay["m"]:lay["m"] + D] = False
    np.testing.assert_array_equal(after[:, keep].view(np.uint32), before[:, keep].view(np.uint32))
    dsa_core.close(b)


@pytest.mark.parametrize("kw, exc, match", [
    ({"storage": "lsm"}, ValueError, "storage must be one of"),
    ({"storage": "log", "memory": "lots"}, ValueError, "memory must be a number of bytes"),
    ({"storage": "log", "memory": "12 parsecs"}, ValueError, "memory must be a number"),
    ({"storage": "log", "memory": -5}, ValueError, "memory must be > 0"),
    ({"storage": "log", "memory": 1.5}, TypeError, "memory must be"),
    ({"storage": "inplace", "memory": "1GiB"}, ValueError, "memory= is for storage='log'"),
    ({"storage": "log", "durability": "always"}, ValueError, "durability must be one of"),
    ({"storage": "log", "access": "ram"}, ValueError, "access='ram' is for in-place"),
    ({"storage": "log", "memory": 10}, ValueError, "raise the budget"),
    ({"storage": "log", "init": np.zeros((N, D + 1))}, ValueError, "init must have shape"),
    ({"storage": "log", "weights": False, "init": "normal"}, ValueError, "weights=False"),
])
def test_bad_create_arguments_write_nothing(tmp_path, kw, exc, match):
    with pytest.raises(exc, match=match):
        dsa_core.create(tmp_path / "s", N, D, **kw)
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").iterdir())


def test_memory_strings():
    check_memory_arg = dsa_core.tools.validation.check_memory_arg
    assert check_memory_arg("4GiB") == 4 << 30
    assert check_memory_arg("512 MiB") == 512 << 20
    assert check_memory_arg("1.5G") == 1_500_000_000
    assert check_memory_arg("64k") == 64_000
    assert check_memory_arg("2Ki") == 2048
    assert check_memory_arg(np.int64(100)) == 100
    assert check_memory_arg(None) is None


def test_batch_larger_than_region_is_refused_before_writing(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, storage="log", memory=log_memory(LAYOUT, 10))
    s = dsa_core.step(s, np.arange(8), np.ones((8, D), np.float32))
    before, stats = records(s), s.store.log_stats()
    idx = np.concatenate([np.arange(11), np.arange(11)])  # 11 unique rows > 10 slots
    with pytest.raises(ValueError, match="a batch needs 11: raise the budget"):
        dsa_core.step(s, idx, np.ones((22, D), np.float32))
    assert s.current and s.count == 1
    np.testing.assert_array_equal(records(s), before)
    assert s.store.log_stats()["seals"] == stats["seals"]
    s = dsa_core.step(s, np.repeat(np.arange(10), 2), np.ones((20, D), np.float32))  # fits
    assert s.count == 2
    # check_batch: the same answer without a step (for callers that step several stores)
    before, stats = records(s), s.store.log_stats()
    with pytest.raises(ValueError, match="a batch needs 11: raise the budget"):
        dsa_core.check_batch(s, idx)
    dsa_core.check_batch(s, np.repeat(np.arange(10), 2))  # 20 ids, 10 distinct rows: fits
    dsa_core.check_batch(s, np.array([], np.int64))
    with pytest.raises(IndexError, match=rf"\[0, {N}\); got {N}"):
        dsa_core.check_batch(s, [N])
    np.testing.assert_array_equal(records(s), before)
    assert s.store.log_stats()["acquires"] == stats["acquires"] and s.count == 2
    dsa_core.close(s)
    t = dsa_core.create(tmp_path / "t", N, D)  # an in-place store takes any batch
    dsa_core.check_batch(t, np.arange(N))
    dsa_core.close(t)


def test_open_refuses_inplace_options_and_memory_mismatch(tmp_path):
    _, b = parity_pair(tmp_path)
    slots = b.store.slots
    dsa_core.close(b)
    with pytest.raises(ValueError, match="access='disk' is for in-place"):
        dsa_core.open(tmp_path / "log", access="disk")
    with pytest.raises(ValueError, match="memory= is for storage='log'"):
        dsa_core.open(tmp_path / "inplace", memory="1GiB")
    s = dsa_core.open(tmp_path / "log")  # the budget given to create (remembered)
    assert s.store.slots == slots < N
    dsa_core.close(s)
    s = dsa_core.create(tmp_path / "log", N, D, storage="log", overwrite=True)
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "log")  # default budget
    assert s.store.slots == N  # the whole (small) table fits: capped at one slot per row
    with pytest.raises(dsa_core.StoreLockedError):
        dsa_core.open(tmp_path / "log", memory="1MiB")
    dsa_core.close(s)


def test_hints_change_no_value_and_residency_counts_region_rows(tmp_path):
    _, b = parity_pair(tmp_path)
    before = records(b)
    res = dsa_core.residency(b, np.arange(N))
    assert res < 1.0  # the region is smaller than the table
    dsa_core.prefetch(b, np.arange(N), wait=True)
    assert dsa_core.residency(b, np.arange(N)) == res  # read-ahead: the region is unchanged
    k = b.store.slots - 1  # no step yet: a load must leave room for one row
    dsa_core.load_range(b, 0, k, wait=True)
    dsa_core.wait_ranges(b)
    assert dsa_core.residency(b, np.arange(k)) == 1.0  # a load loads (and pins)
    with pytest.raises(ValueError, match=r"cannot keep its rows.*Nothing was changed"):
        dsa_core.load_range(b, k, N)  # more than the region holds: refused
    np.testing.assert_array_equal(records(b), before)
    dsa_core.release_range(b, 0, N, wait=True)
    assert dsa_core.residency(b, np.arange(N)) == 0.0  # a release empties the region
    np.testing.assert_array_equal(records(b), before)
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        dsa_core.load_range(b, 5, N + 1)
    b = dsa_core.step(b, [1, 2, 3], np.ones((3, D), np.float32))
    assert dsa_core.residency(b, [1, 2, 3]) == 1.0
    assert dsa_core.residency(b, [1, 2, 3, 4]) == 0.75 + dsa_core.residency(b, [4]) / 4
    res45 = dsa_core.residency(b, [4, 5])
    dsa_core.gather(b, [4, 5])  # gather never changes residency
    assert dsa_core.residency(b, [4, 5]) == res45
    assert list(dsa_core.prefetched(b, [[1], [2]])) == [[1], [2]]
    np.testing.assert_array_equal(records(b)[4:], before[4:])
    dsa_core.close(b)
    with pytest.raises(ValueError, match="closed"):
        dsa_core.load_range(b, 0, 1)
    with pytest.raises(ValueError, match="closed"):
        dsa_core.prefetch(b, [0])


def test_buckets_with_a_log_store(tmp_path):
    from dsa_core import buckets
    rng = np.random.default_rng(0)
    edges = rng.integers(0, N, (600, 2))
    plan = buckets.plan(edges, N, partitions=4, buffer=2, seed=1)
    # c + 1 partitions of N / 4 rows and two negatives' pools of 20 rows beside a batch of 32
    # edges with 2 negatives each
    mem = log_memory(LAYOUT, 3 * (N // 4) + 2 * 20 + 32 * 4)
    runs = []
    for name, use in (("with", True), ("without", False)):
        s = dsa_core.create(tmp_path / name, N, D, init=parity_init(), storage="log", memory=mem)
        it = plan.batches(32, negatives=2, stores=[s] if use else (), pool=20)
        for bt in it:
            ids = np.concatenate([bt.edges[:, 0], bt.edges[:, 1], bt.negatives.ravel()])
            g = np.ones((ids.shape[0], D), np.float32) * 0.1
            s = dsa_core.step(s, ids, g)
        runs.append(s)
    assert runs[0].count == runs[1].count > 0
    assert_same_store(runs[0], runs[1])
    for s in runs:
        dsa_core.close(s)


def test_cli_info_and_verify(tmp_path, capsys):
    _, b = parity_pair(tmp_path)
    for idx, g in parity_batches(np.float32, steps=10):
        b = dsa_core.step(b, idx, g)
    dsa_core.flush(b)
    assert cli(["info", "--json", str(tmp_path / "log")]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["storage"] == "log" and info["count"] == 10
    assert info["segments"] >= 1 and info["live_bytes"] > 0
    for k in ("region_budget_bytes", "dead_bytes", "write_amplification"):
        assert k in info
    assert cli(["verify", "--quiet", str(tmp_path / "log")]) == 0
    assert "CRCs checked" in capsys.readouterr().out
    assert cli(["export", "--quiet", str(tmp_path / "log"), str(tmp_path / "w.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"),
                                  dsa_core.gather(b, np.arange(N)))  # flushed: the same rows
    dsa_core.close(b)
    # a damaged segment is reported by verify
    from dsa_core._log.format import read_header, segment_geometry
    seg = sorted((tmp_path / "log").glob("seg-*.dsl"))[-1]
    head = read_header(seg)
    rec_off = segment_geometry(head["n"], head["stride"], head["itemsize"])[2]
    raw = bytearray(seg.read_bytes())
    raw[rec_off + 3] ^= 0xFF  # a bit of the first record
    seg.write_bytes(bytes(raw))
    assert cli(["verify", "--quiet", str(tmp_path / "log")]) == 1
    assert "PROBLEM" in capsys.readouterr().out


def test_kill_9_reopens_at_the_last_flush(tmp_path):
    import subprocess
    import sys
    import textwrap
    mem = log_memory(LAYOUT, 3 * B)
    code = textwrap.dedent(f"""
        import os, signal, numpy as np, dsa_core
        rng = np.random.default_rng(0)
        s = dsa_core.create({str(tmp_path / 'log')!r}, {N}, {D}, storage="log",
                            memory={mem},
                            init=rng.standard_normal(({N}, {D})).astype(np.float32))
        for k in range(40):
            s = dsa_core.step(s, rng.integers(0, {N}, {B}),
                              rng.standard_normal(({B}, {D})).astype(np.float32))
            if k == 19:
                dsa_core.flush(s)
                np.save({str(tmp_path / 'flushed.npy')!r},
                        dsa_core.read_records(s, np.arange({N})))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr
    s = dsa_core.open(tmp_path / "log", memory="1MiB")  # the dead writer's lock is gone
    assert s.count == 20
    np.testing.assert_array_equal(records(s), np.load(tmp_path / "flushed.npy"))
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_a_store_left_open_is_flushed_at_normal_exit(tmp_path):
    """Forgetting close() must not silently lose the steps since the last flush: an in-place
    store's rows reach its file through the mapping, a log store's live in its region, so
    the interpreter's exit flushes it (as Python flushes open files)."""
    import subprocess
    import sys
    import textwrap
    code = textwrap.dedent(f"""
        import numpy as np, dsa_core
        rng = np.random.default_rng(0)
        s = dsa_core.create({str(tmp_path / 'log')!r}, {N}, {D}, storage="log",
                            memory="1MiB", init="normal")
        for k in range(7):
            s = dsa_core.step(s, rng.integers(0, {N}, {B}),
                              rng.standard_normal(({B}, {D})).astype(np.float32))
        np.save({str(tmp_path / 'live.npy')!r}, dsa_core.read_records(s, np.arange({N})))
        # no flush, no close: the program just ends
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    s = dsa_core.open(tmp_path / "log", memory="1MiB")
    assert s.count == 7
    np.testing.assert_array_equal(records(s), np.load(tmp_path / "live.npy"))
    dsa_core.close(s)


def test_a_store_dropped_unclosed_is_flushed_when_collected(tmp_path):
    import gc

    def train():
        s = dsa_core.create(tmp_path / "log", N, D, storage="log", memory="1MiB")
        rng = np.random.default_rng(0)
        for _ in range(5):
            s = dsa_core.step(s, rng.integers(0, N, B),
                              rng.standard_normal((B, D)).astype(np.float32))
        return dsa_core.read_records(s, np.arange(N))  # s goes out of scope unclosed

    live = train()
    gc.collect()
    s = dsa_core.open(tmp_path / "log", memory="1MiB")  # the lock was released too
    assert s.count == 5
    np.testing.assert_array_equal(records(s), live)
    dsa_core.close(s)


def test_a_forked_child_never_flushes_the_parents_store(tmp_path):
    """A forked child (a data-loader worker) holds a copy of the region: when it exits
    normally, its copy must not be flushed into the parent's store."""
    import os
    import sys
    s = dsa_core.create(tmp_path / "log", N, D, storage="log", memory="1MiB")
    rng = np.random.default_rng(0)
    for _ in range(3):
        s = dsa_core.step(s, rng.integers(0, N, B),
                          rng.standard_normal((B, D)).astype(np.float32))
    dsa_core.flush(s)
    before = sorted(p.name for p in (tmp_path / "log").iterdir())
    manifest = (tmp_path / "log" / "manifest.json").read_bytes()
    pid = os.fork()
    if pid == 0:  # the child steps its copy, then runs what a normal exit runs
        code = 1
        try:
            dsa_core.step(s, rng.integers(0, N, B),
                          rng.standard_normal((B, D)).astype(np.float32))
            import atexit
            atexit._run_exitfuncs()  # weakref.finalize's exit hook among them
            code = 0
        finally:
            sys.stdout.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert sorted(p.name for p in (tmp_path / "log").iterdir()) == before
    assert (tmp_path / "log" / "manifest.json").read_bytes() == manifest
    dsa_core.close(s)
