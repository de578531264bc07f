"""The commit log's file format (dsa_core._log.wal): entries written, read back, and every way
a log can end (torn, corrupt, another generation, out of sequence) stops the reading there."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from dsa_core._log.wal import (
    HEADER_BYTES,
    TRAILER_BYTES,
    WalError,
    WalWriter,
    read_entries,
    wal_bound,
    wal_name,
)

STRIDE, DT, ROWS = 5, np.dtype(np.float32), 1000
SALT = 0x1234_5678_9ABC_DEF0


def _entry(t: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(t)
    rows = rng.choice(ROWS, n, replace=False).astype(np.int64)
    return rows, rng.standard_normal((n, STRIDE)).astype(DT)


def _write(path, ts, sizes, salt=SALT, recycle=None) -> WalWriter:
    w = WalWriter.start(path, salt, STRIDE, DT, recycle=recycle)
    for t, n in zip(ts, sizes, strict=True):
        w.append(t, *_entry(t, n))
    return w


def _read(path, first_t=1, salt=SALT):
    return list(read_entries(path, salt, first_t, STRIDE, DT, ROWS))


def test_entries_round_trip_on_page_boundaries(tmp_path):
    p = tmp_path / wal_name(1)
    sizes = [3, 0, 700, 1, 64]
    w = _write(p, range(1, 6), sizes)
    got = _read(p)
    assert [e.t for e in got] == [1, 2, 3, 4, 5]
    for e, n in zip(got, sizes, strict=True):
        rows, rec = _entry(e.t, n)
        np.testing.assert_array_equal(e.rows, rows)
        assert e.records.dtype == DT and e.records.shape == (n, STRIDE)
        np.testing.assert_array_equal(e.records.view(np.uint8), rec.view(np.uint8))
        assert e.next_offset % 4096 == 0
    assert got[-1].next_offset == w.offset
    with pytest.raises(WalError, match="entry of step 2 .* goes on with step 3"):
        _read(p, first_t=2)  # the first entry must be the manifest's count + 1: damage
    assert _read(p, salt=SALT + 1) == []   # another generation's salt
    w.close()


def test_torn_tails_stop_before_the_torn_entry(tmp_path):
    p = tmp_path / wal_name(1)
    w = _write(p, range(1, 4), [10, 20, 30])
    w.close()
    raw = p.read_bytes()
    last = _read(p)[1].next_offset  # where entry 3 starts
    end = last + HEADER_BYTES + 30 * (8 + STRIDE * DT.itemsize) + TRAILER_BYTES
    assert len(raw) == end
    for cut in (last + 1, last + HEADER_BYTES - 1, last + HEADER_BYTES, last + HEADER_BYTES + 7,
                end - TRAILER_BYTES, end - 1):
        p.write_bytes(raw[:cut])
        assert [e.t for e in _read(p)] == [1, 2], cut
    # every page of the last entry written but one (a disk writes pages in any order)
    for page in range(last, end, 4096):
        torn = bytearray(raw)
        torn[page:min(page + 4096, end)] = bytes(min(4096, end - page))
        p.write_bytes(bytes(torn))
        assert [e.t for e in _read(p)] == [1, 2], page


@pytest.mark.parametrize("where", ["magic", "t", "header_crc", "rows", "records", "trailer"])
def test_a_flipped_bit_stops_the_reading_there(tmp_path, where):
    """In the last entry: a torn tail, reading stops there. In an entry with valid ones
    after it: damage, an error naming the file and the step (was: a silent stop)."""
    p = tmp_path / wal_name(1)
    _write(p, range(1, 4), [10, 20, 30]).close()
    second, third = _read(p)[0].next_offset, _read(p)[1].next_offset
    for start, n, want in ((third, 30, [1, 2]), (second, 20, None)):
        off = {"magic": 0, "t": 8, "header_crc": 44, "rows": HEADER_BYTES + 3,
               "records": HEADER_BYTES + n * 8 + 11,
               "trailer": HEADER_BYTES + n * (8 + STRIDE * DT.itemsize) + 2}[where]
        raw = bytearray(p.read_bytes())
        raw[start + off] ^= 0x10
        p.write_bytes(bytes(raw))
        if want is not None:
            assert [e.t for e in _read(p)] == want
        else:
            with pytest.raises(WalError, match=f"{p.name}.* is damaged: the entry of step 2 "):
                _read(p)
        raw[start + off] ^= 0x10
        p.write_bytes(bytes(raw))


def test_a_gap_in_the_sequence_ends_the_log(tmp_path):
    p = tmp_path / wal_name(1)
    w = _write(p, [1, 2, 4, 5], [4, 4, 4, 4])
    with pytest.raises(WalError, match="entry of step 3 .* goes on with step 5"):
        _read(p)  # a gap is never written: damage, not a tail
    w.close()
    w = _write(p, [1, 2, 4], [4, 4, 4])
    assert [e.t for e in _read(p)] == [1, 2]  # the out-of-sequence entry is the tail
    w.close()


def test_a_recycled_file_never_yields_the_old_generations_entries(tmp_path):
    old, new = tmp_path / wal_name(1), tmp_path / wal_name(3)
    _write(old, range(1, 9), [50] * 8, salt=1).close()
    size = old.stat().st_size
    w = _write(new, [101, 102], [50, 50], salt=2, recycle=old)  # same size entries: aligned
    assert not old.exists() and new.stat().st_size == size       # reused, not regrown
    assert [e.t for e in _read(new, first_t=101, salt=2)] == [101, 102]
    # the old generation's entry 3 now sits where entry 103 would go: never read as it
    assert [e.t for e in _read(new, first_t=3, salt=1)] == []
    w.append(103, *_entry(103, 50))
    assert [e.t for e in _read(new, first_t=101, salt=2)] == [101, 102, 103]
    w.close()


def test_a_valid_entry_with_bad_rows_is_an_error_not_a_stop(tmp_path):
    p = tmp_path / wal_name(1)
    w = WalWriter.start(p, SALT, STRIDE, DT)
    w.append(1, *_entry(1, 3))
    w.append(2, np.array([5, ROWS], np.int64), np.zeros((2, STRIDE), DT))
    with pytest.raises(WalError, match=r"entry of step 2 checks out .* out of \[0, 1000\)"):
        _read(p)
    w.close()
    w = WalWriter.start(p, SALT, STRIDE, DT)
    w.append(1, np.array([5, 5], np.int64), np.zeros((2, STRIDE), DT))
    with pytest.raises(WalError, match="or repeat"):
        _read(p)
    w.close()


def test_missing_log_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="commit log .* named by the manifest is "
                                                "missing"):
        _read(tmp_path / wal_name(7))


@pytest.mark.parametrize("fail", ["pwritev", "fdatasync"])
def test_a_failed_append_is_not_read_and_breaks_the_writer(tmp_path, monkeypatch, fail):
    p = tmp_path / wal_name(1)
    w = _write(p, [1, 2], [6, 6])
    real = getattr(os, fail)

    def boom(fd, *args):
        if fail == "pwritev":  # half of the entry reaches the file, then the disk is full
            bufs, off = args
            os.pwrite(fd, b"".join(bytes(b) for b in bufs)[:100], off)
        else:  # the whole entry is in the file (page cache), its sync fails
            real(fd)
        raise OSError(errno.EIO if fail == "fdatasync" else errno.ENOSPC, "injected")

    monkeypatch.setattr(os, fail, boom)
    offset = w.offset
    with pytest.raises(OSError, match="injected"):
        w.append(3, *_entry(3, 6))
    monkeypatch.undo()
    assert w.broken and w.offset == offset
    assert [e.t for e in _read(p)] == [1, 2]  # its header was zeroed: never replayed
    with pytest.raises(RuntimeError, match="new generation must be started"):
        w.append(3, *_entry(3, 6))
    w.close()


def test_short_pwritev_is_finished(tmp_path, monkeypatch):
    p = tmp_path / wal_name(1)
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: real(fd, bufs[:1], off) - 5)
    w = _write(p, [1, 2], [9, 9])
    monkeypatch.undo()
    assert [e.t for e in _read(p)] == [1, 2]
    w.close()


def test_wal_bound():
    assert wal_bound(1) == 256 << 20
    assert wal_bound(10**6) == 256 << 20
    assert wal_bound(10**7) == 320_000_000
    assert wal_bound(10**8) == 32 * 10**8


def test_bad_records_are_refused_before_writing(tmp_path):
    p = tmp_path / wal_name(1)
    w = WalWriter.start(p, SALT, STRIDE, DT)
    with pytest.raises(ValueError, match=r"records must be \(2, 5\) float32"):
        w.append(1, np.arange(2), np.zeros((2, STRIDE), np.float64))
    assert p.stat().st_size == 0 and not w.broken
    w.close()
