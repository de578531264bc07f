"""The durable file operations every store kind shares (``dsa_core._files``, ``_os``,
``_group_file``): the one JSON writer and what a failed write leaves, the one copy routine of
checkpoints and the page cache it leaves, the multi-store checkpoint of the adapters
(``dsa_core.checkpoint_many``), and the one closed-store error."""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from dsa_core import _files, _group_file, _os
from helpers import log_kw, os_fault


# -- the one JSON writer ------------------------------------------------------------------------
class _FailingOs:
    """``os`` as ``_files`` sees it, with one call failing."""

    def __init__(self, name: str, err: int):
        self._name, self._err = name, err

    def __getattr__(self, name):
        if name == self._name:
            def fail(*a, **k):
                raise OSError(self._err, os.strerror(self._err))
            return fail
        return getattr(os, name)


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp" in p.name)


@pytest.mark.parametrize("writer", ["write_json", "group_file"])
@pytest.mark.parametrize(("call", "err"), [("write", errno.ENOSPC), ("fsync", errno.EIO),
                                           ("replace", errno.EIO)])
def test_a_failed_json_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch,
                                                                   writer, call, err):
    """A full disk or an I/O error before the rename: the old file is intact and the
    temporary is gone (the group commit file's writer used to leave it behind)."""
    path = tmp_path / "f.json"
    rec = {"id": "ab", "seq": 1, "kind": "flush", "members": {}}

    def write(seq):
        if writer == "write_json":
            _files.write_json(path, dict(rec, seq=seq), shared=False, checksum=True)
        else:
            _group_file.write(path, dict(rec, seq=seq))
    write(1)
    old = path.read_bytes()
    with contextlib.ExitStack() as stack:
        if call == "write":  # the write goes through the OS layer: half of it, then ENOSPC
            stack.enter_context(os_fault("pwrite_all", 1, "short"))
        elif call == "fsync":  # so does the file's fsync (an I/O error)
            stack.enter_context(os_fault("fsync_fd", 1, "EIO"))
        else:
            monkeypatch.setattr(_files, "os", _FailingOs(call, err))
        with pytest.raises(OSError) as info:
            write(2)
        monkeypatch.undo()
    assert info.value.errno == err and not isinstance(info.value, _files.InDoubtError)
    assert path.read_bytes() == old
    assert _leftovers(tmp_path) == []
    if writer == "group_file":
        assert _group_file.read(path)["seq"] == 1


@pytest.mark.parametrize("writer", ["write_json", "group_file"])
def test_a_failed_directory_sync_after_the_rename_is_in_doubt(tmp_path, monkeypatch, writer):
    """The rename happened, its durability is unknown: InDoubtError (an OSError), which the
    group turns into a stop (``_group``); the new file is in place, no temporary."""
    path = tmp_path / "f.json"

    def no_sync(p):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(_files, "fsync_path", no_sync)
    rec = {"id": "ab", "seq": 7, "kind": "flush", "members": {}}
    with pytest.raises(_group_file.InDoubtError, match=r"renamed into place but its directory "
                                                        r"could not be synced"):
        if writer == "write_json":
            _files.write_json(path, rec)
        else:
            _group_file.write(path, rec)
    assert _group_file.InDoubtError is _files.InDoubtError
    assert dsa_core.tools.read_json(path)["seq"] == 7
    assert _leftovers(tmp_path) == []


# -- the one copy routine of checkpoints ----------------------------------------------------------
def _evict(path: Path) -> np.ndarray:
    """Drop the file's pages (those no process maps; synced first: dirty pages stay) and
    return which stay cached."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return _os.page_residency(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _cached(path: Path) -> np.ndarray:
    fd = os.open(path, os.O_RDONLY)
    try:
        return _os.page_residency(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _direct_reads(d: Path) -> bool:
    """Does the filesystem of ``d`` take O_DIRECT reads?"""
    probe = d / "probe"
    probe.write_bytes(b"x" * 8192)
    try:
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        import mmap
        buf = mmap.mmap(-1, 4096)
        try:
            os.preadv(fd, [buf], 0)
            return True
        except OSError:
            return False
        finally:
            buf.close()
    finally:
        os.close(fd)
        probe.unlink()


def _data_files(live: Path, snap: Path) -> list[str]:
    """The files a copy checkpoint copied from the live store (not the manifest it wrote)."""
    return sorted(p.name for p in snap.iterdir()
                  if p.is_file() and p.name != "manifest.json" and (live / p.name).exists())


def test_a_copy_checkpoint_leaves_the_page_cache_as_it_found_it(tmp_path, kind):
    """docs/storage.md: a checkpoint reads the live files with O_DIRECT, so the pages of an
    evicted store are still not cached afterwards (a buffered read would fill the cache
    with large folios, written back whole by every later step); the copy is byte for
    byte the live file. Both kinds, a data file whose size is no multiple of 4 KiB."""
    rng = np.random.default_rng(0)
    n, d = 3001, 7  # rows.dsa: a header and 3001 records of 21 floats: an unaligned tail
    s = dsa_core.create(tmp_path / "live", n, d, init="uniform", **log_kw(kind))
    for _ in range(3):
        idx = np.unique(rng.integers(0, n, 500))
        s = dsa_core.step(s, idx, rng.standard_normal((idx.shape[0], d), np.float32))
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "live")
    dsa_core.flush(s)
    live = tmp_path / "live"
    before = {p.name: _evict(p) for p in live.iterdir() if p.is_file()}
    snap = dsa_core.checkpoint(s, tmp_path / "snap", copy=True)
    names = _data_files(live, snap)
    assert names, sorted(p.name for p in snap.iterdir())
    if kind == "inplace":
        assert "rows.dsa" in names and (live / "rows.dsa").stat().st_size % 4096
    direct = _direct_reads(tmp_path)
    for name in names:
        new = _cached(live / name) & ~before[name]
        if direct or not new.any():
            assert not new.any(), (name, int(new.sum()), new.shape[0])
        else:  # pragma: no cover - a filesystem that refuses O_DIRECT and keeps its pages
            pytest.skip("this filesystem refuses O_DIRECT reads and keeps dropped pages")
    for name in names:
        assert (snap / name).read_bytes() == (live / name).read_bytes(), name
    c = dsa_core.open(snap, mode="r")
    assert np.array_equal(dsa_core.read_records(c, np.arange(n)),
                          dsa_core.read_records(s, np.arange(n)))
    dsa_core.close(c)
    dsa_core.close(s)


@pytest.mark.parametrize("share", [True, False])
def test_the_fallback_copy_drops_only_the_pages_it_brought_in(tmp_path, monkeypatch, share):
    """Where O_DIRECT reads are refused, the copy goes through the cache, then drops the
    source's pages that were not cached before; the ones that were stay."""
    size = (8 << 20) + 123
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(np.random.default_rng(1).integers(0, 256, size, np.uint8).tobytes())
    monkeypatch.setattr(_files.fcntl, "ioctl", _no_reflink)
    monkeypatch.setattr(_files, "_copy_direct", lambda s, fd_out: 0)  # refused
    _evict(src)
    fd = os.open(src, os.O_RDONLY)  # the first 2 MiB cached by a reader (no read-ahead,
    try:                            # which would go on filling the cache after it)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, 2 << 20, 0)
    finally:
        os.close(fd)
    before = _cached(src)
    if before.all() or not before.any():
        pytest.skip("this filesystem does not drop a file's pages on request (tmpfs?)")
    _files.copy_file(src, dst, share=share)
    after = _cached(src)
    assert not (after & ~before).any(), int((after & ~before).sum())
    assert after[before].all()
    assert dst.read_bytes() == src.read_bytes()


def _no_reflink(*a):
    raise OSError(errno.EOPNOTSUPP, "no reflink")


def test_page_residency_and_drop_pages(tmp_path):
    """mincore through a mapping that reads nothing; dropping only the pages not kept."""
    p = tmp_path / "f"
    p.write_bytes(b"\1" * (63 * _os.PAGE + 10))  # 64 pages, the last one partly
    fd = os.open(p, os.O_RDONLY)
    try:
        os.fsync(fd)
        assert _os.page_residency(fd, 0).shape == (0,)
        os.pread(fd, 64 * _os.PAGE, 0)
        got = _os.page_residency(fd, 63 * _os.PAGE + 10)
        assert got.shape == (64,) and got.all()
        keep = np.arange(64) < 32
        _os.drop_pages(fd, keep)
        got = _os.page_residency(fd, 63 * _os.PAGE + 10)
        if got.all():
            pytest.skip("this filesystem does not drop a file's pages on request (tmpfs?)")
        assert got[keep].all() and not got[~keep].any()
        _os.drop_pages(fd)
        assert not _os.page_residency(fd, 63 * _os.PAGE + 10).any()
    finally:
        os.close(fd)


# -- the multi-store checkpoint of the adapters ---------------------------------------------------
def test_checkpoint_many_writes_every_store_and_the_block_at_once(tmp_path, kind):
    u = dsa_core.create(tmp_path / "u", 40, 4, init="uniform", **log_kw(kind))
    i = dsa_core.create(tmp_path / "i", 30, 4, init="uniform", **log_kw(kind))
    u = dsa_core.step(u, [1, 3], np.ones((2, 4), np.float32))
    with dsa_core.checkpoint_many(tmp_path / "ck", {"user": u, "item": i}) as staged:
        assert not (tmp_path / "ck").exists()
        assert sorted(p.name for p in staged.iterdir()) == ["item", "user"]
        dsa_core.tools.write_json(staged / "meta.json", {"count": 1})
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["item", "meta.json", "user"]
    for name, live in (("user", u), ("item", i)):
        c = dsa_core.open(tmp_path / "ck" / name, mode="r")
        assert c.count == live.count
        assert np.array_equal(dsa_core.read_records(c, np.arange(c.num_rows)),
                              dsa_core.read_records(live, np.arange(c.num_rows)))
        dsa_core.close(c)
    # an error in the block leaves the checkpoint as it was, and no staging directory
    before = sorted(p.name for p in (tmp_path / "ck").iterdir())
    with pytest.raises(RuntimeError, match="boom"), \
            dsa_core.checkpoint_many(tmp_path / "ck", {"user": u}, overwrite=True) as staged:
        raise RuntimeError("boom")
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == before
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    dsa_core.close(u)
    dsa_core.close(i)


def test_checkpoint_many_refuses_before_anything_is_written(tmp_path, store_digest):
    u = dsa_core.create(tmp_path / "live" / "u", 10, 4)
    (tmp_path / "ck").mkdir()
    before = store_digest(tmp_path)
    with pytest.raises(FileExistsError, match=r"^x: checkpoint destination .* exists; pass "
                                              r"overwrite=True"):
        dsa_core.checkpoint_many(tmp_path / "ck", {"u": u}, what="x")
    for bad in (tmp_path / "live" / "u", tmp_path / "live"):
        with pytest.raises(ValueError, match="would replace or contain the live store "
                                             "directory"):
            dsa_core.checkpoint_many(bad, {"u": u}, overwrite=True)
    with pytest.raises(ValueError, match="would replace or contain the live store"):
        dsa_core.checkpoint_many(tmp_path / "live", {}, overwrite=True, live=[tmp_path / "live"])
    with pytest.raises(ValueError, match=r"the name '\.'"):
        dsa_core.checkpoint_many(tmp_path / "new", {".": tmp_path / "ck", "u": u})
    assert store_digest(tmp_path) == before
    dsa_core.close(u)


def test_checkpoint_many_copies_a_closed_store_into_dest_itself(tmp_path, kind):
    """``{".": directory}``: a checkpoint's store copied over a live one (the sharded
    module's resume_from): every file but the lock and leftovers, byte for byte, its
    source's page cache untouched where O_DIRECT reads are taken."""
    s = dsa_core.create(tmp_path / "snap", 50, 4, init="uniform", **log_kw(kind))
    s = dsa_core.step(s, [2, 9], np.ones((2, 4), np.float32))
    dsa_core.close(s)
    (tmp_path / "snap" / "manifest.json.tmp").write_text("a leftover")
    live = dsa_core.create(tmp_path / "live", 50, 4, **log_kw(kind))
    dsa_core.close(live)
    files = sorted(p.name for p in (tmp_path / "snap").iterdir()
                   if p.is_file() and p.name != "writer.lock" and ".tmp" not in p.name)
    before = {n: _evict(tmp_path / "snap" / n) for n in files}
    with dsa_core.checkpoint_many(tmp_path / "live", {".": tmp_path / "snap"},
                                  overwrite=True):
        pass
    got = sorted(p.name for p in (tmp_path / "live").iterdir() if p.is_file())
    assert got == files
    if _direct_reads(tmp_path):
        for n in files:
            assert not (_cached(tmp_path / "snap" / n) & ~before[n]).any(), n
    for n in files:
        assert (tmp_path / "live" / n).read_bytes() == (tmp_path / "snap" / n).read_bytes()
    st = dsa_core.open(tmp_path / "live")
    assert st.count == 1
    dsa_core.close(st)


# -- the one closed-store error -------------------------------------------------------------------
def test_every_call_on_a_closed_store_says_the_same(tmp_path, kind):
    s = dsa_core.create(tmp_path / "s", 10, 4, **log_kw(kind))
    live = dsa_core.create(tmp_path / "l", 10, 4, **log_kw(kind))
    dsa_core.close(s)
    where = str(tmp_path / "s")
    plain = rf"store '{where}' is closed; reopen it with dsa_core\.open\(path\)$"
    for call in (lambda: dsa_core.read_records(s, [1]),
                 lambda: dsa_core.write_records(s, [1], dsa_core.read_records(live, [1])),
                 lambda: dsa_core.prefetch(s, [1]),
                 lambda: dsa_core.residency(s, [1])):
        with pytest.raises(ValueError, match=plain):
            call()
    with pytest.raises(ValueError, match=rf"store '{where}' \(the snapshot\) is closed; reopen "
                                         r"it with dsa_core\.open\(path, mode='r'\)$"):
        dsa_core.restore(live, s)
    with pytest.raises(ValueError, match=rf"store '{where}' \(the source\) is closed; reopen "
                                         r"it with dsa_core\.open\(path, mode='r'\)$"):
        dsa_core.convert(s, tmp_path / "c", storage=kind)
    dsa_core.close(live)
