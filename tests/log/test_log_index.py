"""A log store's index on disk: a base plus the segments sealed after it (``index_from``).

A flush writes the records it changed and a manifest, not 8 bytes per row of the table: an
open applies the row ids of the segments from ``index_from`` on over the index base, and a
new base is written only when those segments hold more than ``BASE_REPLAY_SHARE`` records
per row. Whatever the base's age, every open (writer, reader, checkpoint) sees exactly the
flushed records.
"""

from __future__ import annotations

import gc
import json
import os

import numpy as np
import pytest

import dsa_core
from dsa_core._files import write_json
from dsa_core._log import commit as _commit
from dsa_core._log import format as _format
from dsa_core._log import check_files
from helpers import batches, create, records, train

N, D = 4000, 4


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _index_files(path):
    return sorted(p.name for p in path.glob("index-*.bin"))


def _reopened(path):
    r = dsa_core.open(path, mode="r")
    try:
        return records(r)
    finally:
        dsa_core.close(r)


def test_a_flush_of_few_rows_writes_no_index_base_until_the_replay_share(tmp_path):
    """Flushes below the share write segments and a manifest only; the flush past it writes
    a base, moves index_from to the next segment, and removes the old base after the commit.
    Every reopen in between sees exactly the flushed records."""
    p = tmp_path / "s"
    s = create(p, N, D, "log", slots=300)
    share = _commit.BASE_REPLAY_SHARE * N  # 1000 records
    bases, froms = [], []
    for k in range(12):
        s = train(s, batches(4, N, D, batch=32, seed=k))  # <= 128 rows per flush
        dsa_core.flush(s)
        want = records(s)
        m = _manifest(p)
        assert m["version"] >= _format.FORMAT_VERSION_INDEX_FROM
        assert _index_files(p) == ([] if m["index"] is None else [m["index"]])
        bases.append(m["index"])
        froms.append(m["index_from"])
        np.testing.assert_array_equal(_reopened(p), want)
        assert s.store._commit.replay_records() <= share  # else this flush wrote a base
    assert bases[0] is None and froms[0] == 1  # the first flushes: no base at all
    assert bases[-1] is not None  # a base was written once the segments passed the share
    assert len(set(froms)) >= 2 and froms == sorted(froms)
    dsa_core.close(s)
    s = dsa_core.open(p)  # the writer's open applies the same segments
    np.testing.assert_array_equal(records(s), want)
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_a_flush_writes_its_records_not_the_index_of_the_table(tmp_path):
    """A table of 2M rows: a flush of 64 changed rows adds one small segment, no index."""
    p = tmp_path / "big"
    n = 2_000_000
    s = dsa_core.create(p, n, D, storage="log", memory="48MiB", init="normal", seed=1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        idx = rng.choice(n, 64, replace=False)
        s = dsa_core.step(s, idx, rng.standard_normal((64, D)).astype(np.float32))
        before = {q.name: q.stat().st_size for q in p.iterdir()}
        dsa_core.flush(s)
        added = {q.name: q.stat().st_size for q in p.iterdir() if q.name not in before}
        assert not any(k.startswith("index-") for k in added)
        assert sum(added.values()) < 64 * 1024  # a segment of 64 records, not 16 MB of index
    want = dsa_core.gather(s, np.arange(n - 10, n))
    dsa_core.close(s)
    r = dsa_core.open(p, mode="r")
    np.testing.assert_array_equal(dsa_core.gather(r, np.arange(n - 10, n)), want)
    dsa_core.close(r)


def test_a_checkpoint_links_the_base_and_outlives_the_live_store_moving_on(tmp_path,
                                                                           monkeypatch):
    """The checkpoint links the (immutable) base and segments; the live store then writes a
    new base and deletes the old one; the checkpoint still opens at its own state."""
    monkeypatch.setattr(_commit, "BASE_REPLAY_SHARE", 0.01)  # a base at almost every flush
    p = tmp_path / "s"
    s = train(create(p, N, D, "log", slots=300), 20, batch=32)
    ck = dsa_core.checkpoint(s, tmp_path / "ck")
    want = records(s)
    base = _manifest(ck)["index"]
    assert base is not None and os.stat(ck / base).st_nlink == 2  # shared with the store
    s = train(s, batches(20, N, D, batch=32, seed=9))
    dsa_core.flush(s)
    assert _manifest(p)["index"] != base and not (p / base).exists()
    assert os.stat(ck / base).st_nlink == 1
    np.testing.assert_array_equal(_reopened(ck), want)
    dsa_core.close(s)


def test_a_checkpoint_before_any_base_replays_every_segment(tmp_path):
    p = tmp_path / "s"
    s = train(create(p, N, D, "log", slots=300), 3, batch=32)
    ck = dsa_core.checkpoint(s, tmp_path / "ck")
    m = _manifest(ck)
    assert m["index"] is None and m["index_from"] == 1 and m["segments"]
    np.testing.assert_array_equal(_reopened(ck), records(s))
    dsa_core.close(s)


def test_an_older_manifest_without_index_from_takes_its_base_as_the_whole_index(tmp_path,
                                                                                monkeypatch):
    """A version-3 manifest (before index_from) names a base that is the whole index: the
    open applies no segment over it; the writer's next flush rewrites it as the current version."""
    monkeypatch.setattr(_commit, "BASE_REPLAY_SHARE", 0.0)  # every flush writes a base
    p = tmp_path / "s"
    s = train(create(p, N, D, "log", slots=300), 10, batch=32)
    want = records(s)
    dsa_core.close(s)
    m = _manifest(p)
    assert m["index"] is not None and m["index_from"] == m["next_segment"]
    m.pop("checksum")
    m.pop("index_from")
    m["version"] = _format.FORMAT_VERSION_SUMS
    write_json(p / "manifest.json", m, shared=False, checksum=True)
    np.testing.assert_array_equal(_reopened(p), want)
    s = dsa_core.open(p)
    s = train(s, 2, batch=32)
    dsa_core.close(s)
    assert _manifest(p)["version"] == _format.FORMAT_VERSION_SPARSE_INDEX


@pytest.mark.parametrize("bad", [0, "next+1", "3", True])
def test_a_manifest_with_a_bad_index_from_is_refused_and_left_alone(tmp_path, bad):
    p = tmp_path / "s"
    s = train(create(p, N, D, "log", slots=300), 3, batch=32)
    dsa_core.close(s)
    m = _manifest(p)
    m.pop("checksum")
    m["index_from"] = m["next_segment"] + 1 if bad == "next+1" else bad
    write_json(p / "manifest.json", m, shared=False, checksum=True)
    files = {q.name: q.read_bytes() for q in p.iterdir() if q.is_file()}
    with pytest.raises(ValueError, match=r"index_from must be an int in \[1, next_segment="):
        dsa_core.open(p)
    assert {q.name: q.read_bytes() for q in p.iterdir() if q.is_file()} == files


# -- a mapped index (more rows than memory= / 16) ---------------------------------------------
NM = 50_000  # rows: a small region makes the index mapped (budget.index_mapped)


def _pair(tmp_path):
    """A store whose index is mapped (a region of 600 slots) and one whose index is in
    memory (memory= large enough), same table."""
    a = create(tmp_path / "mapped", NM, D, "log", slots=600)
    b = create(tmp_path / "flat", NM, D, "log", memory="16MiB")
    assert a.store.log_stats()["index_mapped"] and not b.store.log_stats()["index_mapped"]
    return a, b


def _same(a, b):
    np.testing.assert_array_equal(records(a).view(np.uint32), records(b).view(np.uint32))


@pytest.fixture(params=["dense", "sparse"])
def base_kind(request, monkeypatch):
    """Every index base written dense, or sparse (``format.sparse_base`` picks by the rows
    with a location; here both kinds are made whatever the count)."""
    monkeypatch.setattr(_format, "sparse_base", lambda located, rows: request.param == "sparse")
    return request.param


def _listed_in(m, kind):
    """The manifest ``m`` names a base of ``kind``."""
    return ("index_entries" in m) == (kind == "sparse")


def test_a_mapped_index_trains_to_the_same_bits_and_rebases_within_its_delta(tmp_path,
                                                                             base_kind):
    """Bit-for-bit the in-memory index's results, through rebases (a full delta written
    with the base as the next base file), flushes, reopens; the delta never holds more
    rows than the budget pays for, and an open reads no page of the base."""
    a, b = _pair(tmp_path)
    cap = a.store._pool.index.capacity
    for k in range(6):
        steps = batches(8, NM, D, batch=512, seed=20 + k)
        a, b = train(a, steps), train(b, steps)
        st = a.store.log_stats()
        assert st["index_delta_rows"] <= cap
        dsa_core.flush(a)
        dsa_core.flush(b)
        _same(a, b)
    assert a.store.log_stats()["index_rebases"] >= 2
    m = _manifest(tmp_path / "mapped")
    assert m["index"] is not None and m["index_pages"] == 512 and len(m["live"]) == len(
        m["segments"]) and _listed_in(m, base_kind)
    assert _index_files(tmp_path / "mapped") == [m["index"]]  # uncommitted bases deleted
    want = records(b)
    for s in (a, b):
        dsa_core.close(s)
    a = dsa_core.open(tmp_path / "mapped", memory=a.store.memory_bytes)
    idx = a.store._pool.index
    assert idx.mapped and not idx.checked.any()  # the open read no page of the base
    got = dsa_core.gather(a, np.arange(0, NM, 997))
    np.testing.assert_array_equal(got, want[::997, :D])
    assert 0 < idx.checked.sum() <= 51
    rows = np.arange(0, NM, 997)
    a = dsa_core.step(a, rows, np.zeros((rows.shape[0], D), np.float32))  # now resident
    want[rows] = records(a)[rows]
    idx.checked[:] = False
    dsa_core.gather(a, rows)  # served from the region: no page of the base read
    assert not idx.checked.any()
    np.testing.assert_array_equal(records(a), want)
    assert a.store.check_index() == []
    dsa_core.close(a)
    r = dsa_core.open(tmp_path / "mapped", mode="r")  # a reader with the index in memory
    np.testing.assert_array_equal(records(r), want)
    dsa_core.close(r)


def _uncache(path):
    """Drop a file's pages from the page cache (clean pages: nothing is lost)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_a_mapped_base_reads_the_pages_a_batch_needs_ahead_and_prefetch_one_call_early(
        tmp_path, base_kind):
    """Uncached index pages are hinted (read at depth), counted, and change no value: a
    lookup hints its rows' pages before reading them; ``prefetch`` hints a batch's index
    pages and looks up (and reads ahead) its records at the next hint or at ``wait``."""
    a, b = _pair(tmp_path)
    a = train(a, batches(30, NM, D, batch=512, seed=5))
    assert a.store.log_stats()["index_rebases"] >= 1
    budget = a.store.memory_bytes
    want = records(a)
    dsa_core.close(a)
    dsa_core.close(b)
    del a, b  # a closed State still maps the base: a page mapped is not dropped
    gc.collect()
    p = tmp_path / "mapped"
    base = p / _manifest(p)["index"]
    _uncache(base)
    s = dsa_core.open(p, memory=budget)
    assert s.store.log_stats()["index_page_reads"] == 0
    rows = np.arange(3, NM, 211)  # 237 rows over all 98 pages
    np.testing.assert_array_equal(dsa_core.gather(s, rows), want[rows, :D])
    got = s.store.log_stats()["index_page_reads"]
    assert 0 < got <= 98, got  # what the page cache lacked, once
    np.testing.assert_array_equal(dsa_core.gather(s, rows), want[rows, :D])
    assert s.store.log_stats()["index_page_reads"] == got  # cached now: nothing hinted
    dsa_core.close(s)
    del s
    gc.collect()
    _uncache(base)
    s = dsa_core.open(p, memory=budget)
    eng = s.store
    first, second = np.arange(7, NM, 409), np.arange(11, NM, 401)
    dsa_core.prefetch(s, first)  # pages hinted, records not yet
    assert eng.log_stats()["index_page_reads"] > 0
    np.testing.assert_array_equal(eng._hint_next, first)
    dsa_core.prefetch(s, second)  # now the first batch's records, the second's pages
    np.testing.assert_array_equal(eng._hint_next, second)
    dsa_core.prefetch(s, second, wait=True)  # everything hinted, nothing left behind
    assert eng._hint_next is None
    for r in (first, second):
        np.testing.assert_array_equal(dsa_core.gather(s, r), want[r, :D])
    s = dsa_core.step(s, first, np.ones((first.shape[0], D), np.float32))
    dsa_core.prefetch(s, second)
    dsa_core.close(s)  # with a hint pending: nothing of it is kept or written
    s = dsa_core.open(p, memory=budget)
    np.testing.assert_array_equal(dsa_core.gather(s, second), want[second, :D])
    assert s.store.check_index() == []
    dsa_core.close(s)


def test_a_seal_learns_the_old_locations_from_its_slots_not_from_the_index(tmp_path,
                                                                           monkeypatch):
    """Each slot remembers its row's on-disk location: a seal (here every flush and
    eviction) looks up no row in the index (a mapped base would read a page per row, again,
    since the miss that brought the row in). A slot that does not know (-1) is looked up;
    ``check_index`` finds a slot that remembers wrong."""
    a, b = _pair(tmp_path)
    first = batches(10, NM, D, batch=512, seed=8)
    a, b = train(a, first), train(b, first)  # rows on disk, rebased
    pool = a.store._pool
    asked = []
    real = pool.index.get

    def get(rows):
        asked.append(np.asarray(rows).copy())
        return real(rows)

    monkeypatch.setattr(pool.index, "get", get)  # this store's index only
    misses = a.store.log_stats()["misses"]
    steps = batches(12, NM, D, batch=512, seed=9)
    a, b = train(a, steps), train(b, steps)
    looked_up = sum(r.shape[0] for r in asked)
    assert a.store.log_stats()["misses"] - misses == looked_up > 0  # the misses', only
    asked.clear()
    dsa_core.flush(a)  # seals every dirty slot
    assert sum(r.shape[0] for r in asked) == 0
    dsa_core.flush(b)
    _same(a, b)
    monkeypatch.undo()
    assert a.store.check_index() == []
    used = np.flatnonzero(pool.slot_row >= 0)
    pool.slot_loc[used[:3]] = -1  # forgotten: looked up again, the same result
    assert a.store.check_index() == []
    a = train(a, batches(3, NM, D, batch=512, seed=10))
    dsa_core.flush(a)
    b = train(b, batches(3, NM, D, batch=512, seed=10))
    _same(a, b)
    used = np.flatnonzero(pool.slot_row >= 0)
    pool.slot_loc[used[0]] += 1  # remembered wrong: check_index says so
    assert any("remember on-disk locations" in p for p in a.store.check_index())
    pool.slot_loc[used[0]] = -1
    for s in (a, b):
        dsa_core.close(s)


def test_a_mapped_open_reads_segment_headers_only_and_checks_the_rest_before_use(tmp_path):
    """An open with a mapped index reads each segment's header, not its row ids and steps
    (an open's time grew with the segments: 1.2 s after 6M records): those are checked,
    once, before cleaning or a check first uses them. A damaged row-id part is then named
    where it is used, nothing is served from it, nothing on disk changes; a full check at
    open that checks everything (``dsa verify``) still finds it there."""
    a, b = _pair(tmp_path)
    a = train(a, batches(30, NM, D, batch=512, seed=3))
    budget = a.store.memory_bytes
    want = records(a)
    for s in (a, b):
        dsa_core.close(s)
    p = tmp_path / "mapped"
    m = _manifest(p)
    old = min(int(x) for x in m["segments"] if int(x) < m["index_from"])
    seg = p / _format.seg_name(old)
    s = dsa_core.open(p, memory=budget)
    segs = s.store._segments
    assert all(x.unchecked for x in segs.segs.values())  # headers only
    np.testing.assert_array_equal(records(s), want)  # records need no row ids
    assert s.store.check_index() == []  # checks them: each once
    assert not any(x.unchecked for x in segs.segs.values())
    dsa_core.close(s)
    del s, segs
    gc.collect()
    raw = bytearray(seg.read_bytes())
    raw[4096 + 8 * 3 + 1] ^= 0x04  # a row id of its record 3
    seg.write_bytes(bytes(raw))
    files = {q.name: q.read_bytes() for q in p.iterdir() if q.is_file()}
    s = dsa_core.open(p, memory=budget)  # opens: the part is not read
    np.testing.assert_array_equal(records(s), want)
    problems = s.store.check_index()
    assert any(f"{seg.name}' is corrupt: the CRC of its row ids" in q for q in problems)
    with pytest.raises(_format.SegmentError, match="CRC of its row ids"):
        for k in range(400):  # until cleaning needs that segment
            s = train(s, batches(1, NM, D, batch=512, seed=100 + k))
    assert old in s.store._segments.segs  # not cleaned: refused before anything moved
    s.store.abandon()
    for name, data in files.items():
        if name != "manifest.json" and (p / name).exists():
            assert (p / name).read_bytes() == data, name
    found = [f for f, problem, _ in check_files(p) if problem and "CRC of its row ids" in problem]
    assert found == [seg.name]  # dsa verify reads every part of every segment


def test_a_damaged_page_of_a_mapped_base_is_refused_where_it_is_read(tmp_path, base_kind):
    a, _ = _pair(tmp_path)
    a = train(a, batches(30, NM, D, batch=512, seed=3))
    assert a.store.log_stats()["index_rebases"] >= 1
    dsa_core.close(a)
    p = tmp_path / "mapped"
    m = _manifest(p)
    assert _listed_in(m, base_kind)
    base = p / m["index"]
    raw = bytearray(base.read_bytes())
    if base_kind == "dense":
        raw[8 * 600 + 3] ^= 0x10  # row 600's location: page 1
        first, inside = 512, 700  # page 1's first row, one of its rows
    else:
        raw[4096 + 8 * 256 + 3] ^= 0x10  # page 1's first location
        rows = np.frombuffer(bytes(raw[:2 * 4096]), np.int64)
        first, inside = int(rows[512]), int(rows[512 + 100])
    base.write_bytes(bytes(raw))
    files = {q.name: q.read_bytes() for q in p.iterdir() if q.is_file()}
    s = dsa_core.open(p, memory=a.store.memory_bytes)
    dsa_core.gather(s, np.arange(0, first))  # page 0: fine
    with pytest.raises(ValueError, match=r"index file .* is corrupt: page\(s\) \[1\]"):
        dsa_core.gather(s, np.array([inside]))
    dsa_core.close(s)
    for name, data in files.items():  # nothing on disk changed (the close flushed nothing)
        if name != "manifest.json":
            assert (p / name).read_bytes() == data


def test_kill_9_at_a_rebase_reopens_at_the_last_flush(tmp_path, base_kind):
    """SIGKILL while a rebase writes the next base (between flushes): the store reopens at
    its last flush, bit for bit, and the unnamed base file is removed at the open."""
    from dsa_core._log import format as log_format

    a, b = _pair(tmp_path)
    dsa_core.close(b)
    steps = batches(40, NM, D, batch=512, seed=5)
    a = train(a, steps[:4])
    dsa_core.flush(a)
    budget = a.store.memory_bytes
    dsa_core.close(a)
    mem = _manifest(tmp_path / "mapped")
    pid = os.fork()
    if pid == 0:  # the child trains on and dies at its first rebase
        try:
            log_format.set_crash("rebase", 1)
            train(dsa_core.open(tmp_path / "mapped", memory=budget), steps[4:])
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == -9
    assert len(_index_files(tmp_path / "mapped")) == 1 + (mem["index"] is not None)
    s = dsa_core.open(tmp_path / "mapped", memory=budget)
    assert s.count == 4 and _index_files(tmp_path / "mapped") == (
        [mem["index"]] if mem["index"] else [])
    ref = train(dsa_core.open(tmp_path / "flat"), steps[:4])
    _same(s, ref)
    dsa_core.close(s)
    dsa_core.close(ref)


def test_a_base_of_few_written_rows_lists_them_and_takes_disk_for_them_only(tmp_path):
    """A table of 20M rows, 240k of them written: the rebases write a sparse base (the rows
    with a location and theirs, 16 bytes each, not 8 bytes per row of the table: 160 MB), in
    pages the lookups read and check as they go; it reopens to the same values (mapped, and
    read whole into memory), and ``dsa verify`` checks every page of it."""
    p, n = tmp_path / "s", 20_000_000
    s = dsa_core.create(p, n, D, storage="log", memory="8MiB", init="normal", seed=1)
    rng = np.random.default_rng(0)
    seen = []
    while s.store.log_stats()["index_rebases"] < 2:
        rows = np.unique(rng.integers(0, n, 2048))
        seen.append(rows)
        s = dsa_core.step(s, rows, rng.standard_normal((rows.shape[0], D)).astype(np.float32))
    dsa_core.flush(s)
    rows = np.unique(np.concatenate(seen))
    probe = np.concatenate([rows[::97], np.arange(0, n, n // 50)])  # written and never
    want = dsa_core.gather(s, probe)
    dsa_core.close(s)
    m = _manifest(p)
    listed = m["index_entries"]
    assert 0 < listed <= rows.shape[0] and listed * _format.SPARSE_SHARE < n
    st = os.stat(p / m["index"])
    assert st.st_size == _format.index_geometry(n, listed)[2] <= 17 * listed + 8192
    for memory in ("8MiB", "1GiB"):  # the base mapped, and read whole
        s = dsa_core.open(p, memory=memory, mode="r")
        assert s.store.log_stats()["index_mapped"] == (memory == "8MiB")
        np.testing.assert_array_equal(dsa_core.gather(s, probe), want)
        assert s.store.check_index() == []
        dsa_core.close(s)
    assert [f for f, problem, _ in check_files(p) if problem] == []
    raw = bytearray((p / m["index"]).read_bytes())
    raw[st.st_size - 5] ^= 0x01  # the fence
    (p / m["index"]).write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="CRC of its page checksums does not match"):
        dsa_core.open(p, memory="8MiB")
    assert [f for f, problem, _ in check_files(p) if problem] == [m["index"]]


@pytest.mark.parametrize("sparse", [False, True])
def test_a_base_reads_back_every_location_at_page_edges(tmp_path, sparse, monkeypatch):
    """Bases of random locations at sizes around page edges (rows and listed entries at,
    below and above multiples of 512 / 256), mapped: every row's lookup (``RowIndex.get``),
    the entries a rebase writes from (``RowIndex.located``, with a delta over the base) and
    the base read whole agree with the locations written."""
    from dsa_core._log import index as _index

    monkeypatch.setattr(_format, "sparse_base", lambda located, rows: sparse)
    rng = np.random.default_rng(3)
    for n in (1, 511, 512, 513, 2048, 5000):
        for listed in sorted({0, 1, min(n, 255), min(n, 256), min(n, 257), n // 3, n}):
            locs = np.zeros(n, np.int64)
            rows = np.sort(rng.choice(n, listed, replace=False)).astype(np.int64)
            locs[rows] = rng.integers(1, 1 << 40, listed)
            path = tmp_path / f"b{n}_{listed}.bin"
            crc, got = _format.write_index(path, n, [_format.dense_entries(locs)], listed)
            assert got == (listed if sparse else None)
            idx = _index.RowIndex(n, capacity=10**6)
            idx.map(path, *_format.map_index(path, n, crc, got))
            np.testing.assert_array_equal(idx.get(np.arange(n, dtype=np.int64)), locs)
            np.testing.assert_array_equal(_format.read_index(path, n, crc, listed=got), locs)
            moved = rng.choice(n, min(n, 7), replace=False).astype(np.int64)
            new = rng.integers(1, 1 << 40, moved.shape[0])
            idx.set(moved, new)  # a delta over the base: rows with and without a location
            want = locs.copy()
            want[moved] = new
            for piece in (1, 300, 10**6):
                parts = list(idx.located(piece))
                r = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
                v = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
                np.testing.assert_array_equal(r, np.flatnonzero(want))
                np.testing.assert_array_equal(v, want[want > 0])
            np.testing.assert_array_equal(idx.get(np.arange(n, dtype=np.int64)), want)
