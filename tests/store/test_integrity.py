"""Damage on disk is detected where it is read, named, and never served nor "repaired".

Issue 25, "every on-disk structure is checksummed and checked where it is read" and
"damage is named, never repaired by deletion". Each test damages one structure the way a
disk (a flipped bit or byte), a crash (a truncated tail) or a person (a deleted file) would,
on both store kinds where the structure exists and with and without ``durability="step"``,
and shows that the damage is either reported (a clear error naming the file and the
remedy, with the files left as they were) or recovered exactly. Every test here fails on
the code before this change (which served, laundered, silently dropped or deleted), except
the few marked as compatibility checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from helpers import batches, create, train
from dsa_core._files import json_checksum
from dsa_core._log import format as F
from dsa_core._log.sums import record_sums, split_sums
from dsa_core.__main__ import main as cli

N, D = 2000, 8
KINDS = ["inplace", "log"]
DURABILITY = ["flush", "step"]


# the stores (helpers.create), by kind: dsa_core.create's init_scale, seed 3; a log store's
# memory a region of 774 slots
STORE = {"inplace": {"init_scale": 0.01, "seed": 3},
         "log": {"init_scale": 0.01, "seed": 3, "memory": "292KiB"}}
# the steps (helpers.batches / train with these and a seed): 200 distinct ids, sorted
SORTED = {"batch": 200, "unique": True, "sort": True}


def _trained(tmp_path, kind, durability="flush", steps=20, name="s"):
    """A closed store of ``kind`` after ``steps`` steps (a log store: many segments)."""
    s = create(tmp_path / name, N, D, kind, **STORE[kind], durability=durability)
    s = train(s, steps, seed=0, **SORTED)
    dsa_core.close(s)
    return tmp_path / name


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.name != "writer.lock"}


def _flip(path: Path, offset: int, mask: int = 0x04) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= mask
    path.write_bytes(bytes(raw))


def _verify(path, capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli(["verify", "--quiet", str(path)])
    return rc, capsys.readouterr().out


def _segment_record(path: Path, row_of=None):
    """(segment file, record index, its row, offset of its bytes) of a live record."""
    r = dsa_core.open(path, mode="r")
    eng = r.store
    disk = eng._pool.disk_locations()
    dsa_core.close(r)
    for seg in sorted(path.glob("seg-*.dsl")):
        h = F.read_header(seg)
        rows = np.fromfile(seg, np.int64, h["n"], offset=4096)
        for k in range(h["n"]):
            if disk[rows[k]] == ((h["id"] << 32) | k) + 1 and (row_of is None
                                                               or rows[k] == row_of):
                return seg, k, int(rows[k]), F.record_offset(h, k)
    raise AssertionError("no live record found")


# -- 1. manifests: checksummed, settings checked --------------------------------------------
@pytest.mark.parametrize("durability", DURABILITY)
@pytest.mark.parametrize(("kind", "field"), [("inplace", "count"), ("log", "count"),
                                             ("log", "seed")])
def test_a_flipped_bit_in_the_manifest_is_named(tmp_path, kind, durability, field, capsys):
    """Was: a flipped bit in "count" opened at 13 instead of 12, in "seed" changed every
    never-written row; verify passed."""
    p = _trained(tmp_path, kind, durability, steps=12)
    man = p / "manifest.json"
    text = man.read_text()
    key = {"count": '"count": 12', "seed": '"seed": 3'}[field]
    at = text.index(key) + len(key) - 1
    _flip(man, at, 0x01)  # '2' -> '3', '3' -> '2'
    before = _files(p)
    for mode in ("r+", "r"):
        with pytest.raises(ValueError, match=r"manifest\.json.* is damaged: its checksum does "
                                             r"not match .* restore the store from a checkpoint"):
            dsa_core.open(p, mode=mode)
    rc, out = _verify(p, capsys)
    assert rc == 1 and "manifest.json" in out and "checksum does not match" in out
    assert _files(p) == before  # nothing deleted, nothing rewritten


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hp", [("lr", 0.0), ("eps", 0.0), ("betas", [0.9, 1.0])])
def test_settings_create_refuses_are_refused_at_open(tmp_path, kind, hp):
    """Was: "lr": 0.0 in a manifest (with a consistent checksum, or none) opened."""
    p = _trained(tmp_path, kind, steps=2)
    m = json.loads((p / "manifest.json").read_text())
    (m["meta"] if kind == "log" else m)["hparams"][hp[0]] = hp[1]
    m["checksum"] = json_checksum(m)
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"records hyperparameters that create refuses .* "
                                         "restore the store from a checkpoint"):
        dsa_core.open(p)


def test_log_manifest_settings_are_checked_with_creates_rules(tmp_path):
    p = _trained(tmp_path, "log", steps=2)
    for key, bad in (("space_ratio", 1.0), ("init", "ones"), ("init_scale", -1.0),
                     ("seed", -5), ("next_segment", 0)):
        m = json.loads((p / "manifest.json").read_text())
        good = m[key]
        m[key] = bad
        m["checksum"] = json_checksum(m)
        (p / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(ValueError, match="holds a setting that create refuses"):
            dsa_core.open(p)
        m[key] = good
        m["checksum"] = json_checksum(m)
        (p / "manifest.json").write_text(json.dumps(m))
    dsa_core.close(dsa_core.open(p))


@pytest.mark.parametrize("kind", KINDS)
def test_a_log_store_manifest_without_its_checksum_is_refused(tmp_path, kind):
    """Format 3 log manifests must carry a checksum (a bit flip in its key is not an
    "old manifest"); in-place manifests keep their version, so one without is accepted."""
    p = _trained(tmp_path, kind, steps=2)
    m = json.loads((p / "manifest.json").read_text())
    del m["checksum"]
    (p / "manifest.json").write_text(json.dumps(m))
    if kind == "log":
        with pytest.raises(ValueError, match="checksum does not match .*stored None"):
            dsa_core.open(p)
    else:  # compatibility: written before checksums; the next flush adds one
        s = dsa_core.open(p)
        dsa_core.flush(s)
        dsa_core.close(s)
        assert json.loads((p / "manifest.json").read_text())["checksum"].startswith("crc32:")


# -- 2. the index ----------------------------------------------------------------------------
@pytest.mark.parametrize("durability", DURABILITY)
def test_a_flipped_bit_in_the_index_is_named_by_verify_file_by_file(tmp_path, durability,
                                                                    capsys):
    p = _trained(tmp_path, "log", durability)
    idx = sorted(p.glob("index-*.bin"))[-1]
    _flip(idx, 8 * 17 + 2)
    before = _files(p)
    with pytest.raises(ValueError, match=f"index file .*{idx.name}.* is corrupt"):
        dsa_core.open(p)
    rc, out = _verify(p, capsys)
    assert rc == 1
    assert f"PROBLEM: the store does not check out: {idx.name}: " in out
    assert "file manifest.json: ok" in out and "file seg-00000001.dsl: ok" in out
    assert _files(p) == before


# -- 3. the commit log -----------------------------------------------------------------------
def _logged(tmp_path, steps=4):
    """A durability="step" log store with ``steps`` logged steps after its last flush, its
    writer gone as after kill -9; and the reference records after each step."""
    s = create(tmp_path / "w", N, D, "log", **STORE["log"], durability="step")
    plan = batches(6 + steps, N, D, seed=5, **SORTED)
    for idx, g in plan[:6]:
        s = dsa_core.step(s, idx, g)
    dsa_core.flush(s)
    refs = [dsa_core.read_records(s, np.arange(N))]
    for idx, g in plan[6:]:
        s = dsa_core.step(s, idx, g)
        refs.append(dsa_core.read_records(s, np.arange(N)))
    m = json.loads((s.path / "manifest.json").read_text())
    assert m["count"] == 6 and m["wal"]
    s.store.abandon()  # kill -9: nothing more reaches the files
    wal = s.path / m["wal"]
    offsets = [0]
    with wal.open("rb") as f:  # where each entry starts (4096-aligned, sequential)
        size = os.fstat(f.fileno()).st_size
    from dsa_core._log import wal as W
    for e in W.read_entries(wal, m["wal_salt"], 7, m["layout"]["stride"], np.float32, N):
        offsets.append(e.next_offset)
    assert len(offsets) == steps + 1 and offsets[-1] <= size + 4096
    return s.path, wal, offsets, refs


@pytest.mark.parametrize("where", ["header", "rows", "records", "trailer"])
def test_a_damaged_commit_log_entry_before_valid_ones_is_refused(tmp_path, where, capsys):
    """Was: replay stopped at the first bad entry, the later committed steps were dropped
    silently, verify said ok, and the writer's reopen flushed the log away."""
    p, wal, offsets, _ = _logged(tmp_path)
    start = offsets[1]  # the entry of step 8, with 9 and 10 after it
    n_rows = 200 if where != "header" else 0
    off = {"header": 20, "rows": 48 + 8 * 7, "records": 48 + 8 * n_rows + 33,
           "trailer": 48 + n_rows * (8 + 3 * D * 4) + 1}[where]
    _flip(wal, start + off)
    before = _files(p)
    for mode in ("r+", "r"):
        with pytest.raises(ValueError, match=f"commit log .*{wal.name}.* is damaged: the entry "
                                             "of step 8 .* Restore the store from a checkpoint"):
            dsa_core.open(p, mode=mode)
    rc, out = _verify(p, capsys)
    assert rc == 1 and wal.name in out and "step 8" in out
    assert _files(p) == before  # the log was not flushed away, nothing deleted


@pytest.mark.parametrize("cut", ["inside", "header"])
def test_a_torn_last_commit_log_entry_reopens_exactly_before_it(tmp_path, cut):
    """Not damage: a torn tail is a crash during the last append (recovered exactly, as
    before this change; it passes on the old code too: the other half of the rule)."""
    p, wal, offsets, refs = _logged(tmp_path)
    last = offsets[3]  # the entry of step 10
    with wal.open("r+b") as f:
        f.truncate(last + (500 if cut == "inside" else 20))
    s = dsa_core.open(p)
    assert s.count == 9
    np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)), refs[3])
    dsa_core.close(s)


# -- 4. segment records ------------------------------------------------------------------------
@pytest.mark.parametrize("durability", DURABILITY)
def test_a_damaged_record_is_never_served(tmp_path, durability, capsys):
    """Was: open checked headers only; gather returned the flipped byte."""
    p = _trained(tmp_path, "log", durability)
    seg, k, row, at = _segment_record(p)
    _flip(seg, at + 1, 0x20)
    before = _files(p)
    for mode in ("r", "r+"):
        s = dsa_core.open(p, mode=mode)
        with pytest.raises(F.SegmentError, match=f"{seg.name}.* is damaged: record {k} \\(row "
                                                 f"{row}\\) does not match its checksum"):
            dsa_core.gather(s, [row])
        with pytest.raises(F.SegmentError, match=f"row {row}"):
            dsa_core.read_records(s, np.arange(N))
        other = (row + 1) % N
        dsa_core.gather(s, [other])  # the rest of the store still reads
        if mode == "r+":
            with pytest.raises(F.SegmentError, match=f"row {row}"):
                dsa_core.step(s, [row, other], np.ones((2, D), np.float32))
            assert s.store.check_index() == []  # the engine is as before the step
            s = dsa_core.step(s, [other], np.ones((1, D), np.float32))  # others still train
        s.store.abandon()
    rc, out = _verify(p, capsys)
    assert rc == 1 and seg.name in out and f"row {row}" in out
    after = _files(p)  # the step of the other row went to the commit log, nothing else
    assert {k: v for k, v in after.items() if not k.startswith("wal-")} == \
        {k: v for k, v in before.items() if not k.startswith("wal-")}


def test_a_damaged_record_is_never_laundered_by_cleaning(tmp_path, capsys):
    """Was: training rewrote the damaged record into a fresh segment with a valid CRC and
    verify passed 60 steps later. Now the cleaning copy checks it first."""
    p = _trained(tmp_path, "log")
    seg, k, row, at = _segment_record(p)
    _flip(seg, at + 5, 0x80)
    s = dsa_core.open(p)
    with pytest.raises(F.SegmentError, match=f"{seg.name}.* record {k} \\(row {row}\\)"):
        others = np.setdiff1d(np.arange(N), [row])  # never the damaged row itself
        for idx, g in batches(400, N, D, seed=9, rows=others, **SORTED):
            s = dsa_core.step(s, idx, g)
    s.store.abandon()
    rc, out = _verify(p, capsys)
    assert rc == 1 and f"row {row}" in out  # still there, still named


def test_a_damaged_record_is_not_exported_nor_converted(tmp_path, capsys):
    p = _trained(tmp_path, "log")
    seg, _, row, at = _segment_record(p)
    _flip(seg, at)
    s = dsa_core.open(p, mode="r")
    with pytest.raises(F.SegmentError, match=f"row {row}"):
        dsa_core.convert(s, tmp_path / "ip", storage="inplace")
    dsa_core.close(s)
    with pytest.raises((SystemExit, F.SegmentError)):
        cli(["export", "--quiet", str(p), str(tmp_path / "w.npy")])
    assert not (tmp_path / "w.npy").exists()


def test_each_record_is_followed_by_its_two_sums_and_its_bytes_are_left_alone(tmp_path):
    """Segment version 3: the records part holds each record as it was (what parity_sha
    compares), then its sums -- of its weights and of the rest -- so that a read of a record
    from disk reads its sums with it, and gather hashes the weights alone."""
    p = _trained(tmp_path, "log", steps=3)
    s = dsa_core.open(p, mode="r")
    assert s.store.layout.w_off == 0
    for seg in sorted(p.glob("seg-*.dsl")):
        h = F.read_header(seg)
        assert h["version"] == 3 and h["head"] == 4 * D  # the weights' bytes
        n, stride = h["n"], h["stride"]
        _, _, rec_off, size = F.segment_geometry(n, stride, 4)
        assert size == seg.stat().st_size
        pitch = F.record_pitch(stride, 4)
        raw = np.frombuffer(seg.read_bytes(), np.uint8)
        part = raw[rec_off:rec_off + n * pitch].reshape(n, pitch)
        assert zlib.crc32(part) == h["crc_records"]
        rec = part[:, :stride * 4].copy().view(np.float32)
        sums = part[:, pitch - 16:].copy().view(np.uint64)
        np.testing.assert_array_equal(sums, split_sums(rec, 4 * D))
        rows = raw[4096:4096 + 8 * n].view(np.int64)
        live = s.store._pool.disk_locations()[rows] == ((h["id"] << 32) | np.arange(n)) + 1
        np.testing.assert_array_equal(
            rec[live].view(np.uint32), dsa_core.read_records(s, rows[live]).view(np.uint32))
    dsa_core.close(s)


@pytest.mark.parametrize("part", ["weights", "state", "sum of the weights", "sum of the rest"])
def test_gather_checks_the_weights_it_serves_a_whole_read_checks_everything(tmp_path, part):
    """Check what is served: a flipped bit in a record's Adam state does not stop ``gather``
    of its (intact, checked) weights, and is caught by every read of the whole record (a
    step, read_records); one in its weights, or in the weights' sum, is caught by both."""
    p = _trained(tmp_path, "log")
    seg, k, row, at = _segment_record(p)
    h = F.read_header(seg)
    pitch = F.record_pitch(h["stride"], 4)
    where = {"weights": 1, "state": 4 * D + 2, "sum of the weights": pitch - 16 + 3,
             "sum of the rest": pitch - 8 + 5}[part]
    s = dsa_core.open(p, mode="r")
    want = dsa_core.read_records(s, [row])[0, :D]
    dsa_core.close(s)
    _flip(seg, at + where)
    s = dsa_core.open(p)
    if part in ("state", "sum of the rest"):
        np.testing.assert_array_equal(dsa_core.gather(s, [row])[0], want)
    else:
        with pytest.raises(F.SegmentError, match=f"record {k} \\(row {row}\\)"):
            dsa_core.gather(s, [row])
    with pytest.raises(F.SegmentError, match=f"row {row}"):
        dsa_core.read_records(s, [row])
    with pytest.raises(F.SegmentError, match=f"row {row}"):
        dsa_core.step(s, [row], np.ones((1, D), np.float32))
    assert s.store.check_index() == []
    s.store.abandon()


def _as_version(p: Path, version: int) -> None:
    """Rewrite a closed log store's segments as this code's predecessors wrote them:
    version 2 (the records, then a part of their sums, ``DSASUM01``), or version 1 (no sums
    at all); the manifest as version 5, or as version 1 without a checksum."""
    for seg in p.glob("seg-*.dsl"):
        h = F.read_header(seg)
        if h["version"] != 3:  # an older one already
            continue
        n, stride, isz = h["n"], h["stride"], h["itemsize"]
        raw = np.frombuffer(seg.read_bytes(), np.uint8)
        rec_off = F.segment_geometry(n, stride, isz)[2]
        pitch = F.record_pitch(stride, isz)
        rec = np.ascontiguousarray(
            raw[rec_off:rec_off + n * pitch].reshape(n, pitch)[:, :stride * isz])
        out = np.zeros(F.segment_geometry(n, stride, isz, version)[3], np.uint8)
        out[4096:rec_off] = raw[4096:rec_off]  # rows, steps
        out[rec_off:rec_off + rec.nbytes] = rec.reshape(-1)
        head = F._HEAD.pack(F.SEG_MAGIC, h["id"], n, stride, isz, h["count"], h["crc_rows"],
                            h["crc_steps"], zlib.crc32(rec))
        head += F._HCRC.pack(zlib.crc32(head))
        if version == 2:
            sums = record_sums(rec.view(np.float32))
            off = F.sums_offset(n, stride, isz)
            out[off:off + 8 * n] = sums.view(np.uint8)
            head += F._HEXT.pack(F.SUM_MAGIC, zlib.crc32(sums))
            head += F._HCRC.pack(zlib.crc32(head))
        out[:len(head)] = np.frombuffer(head, np.uint8)
        seg.write_bytes(out.tobytes())
        assert F.read_header(seg)["version"] == version
    m = json.loads((p / "manifest.json").read_text())
    m.pop("checksum")
    m["version"] = 1 if version == 1 else 5
    if version != 1:
        m["checksum"] = json_checksum(m)
    (p / "manifest.json").write_text(json.dumps(m))


def _as_format_1(p: Path) -> None:
    _as_version(p, 1)


def test_a_version_2_store_reads_checks_and_trains_on(tmp_path):
    """Compatibility: a store of the version before (sums in a part of their own) opens,
    reads the same records, catches a damaged record, and trains on (its new segments are
    version 3; the old ones stay until cleaned)."""
    p = _trained(tmp_path, "log", steps=6)
    s = dsa_core.open(p, mode="r")
    ref = dsa_core.read_records(s, np.arange(N))
    dsa_core.close(s)
    _as_version(p, 2)
    q = tmp_path / "copy"
    shutil.copytree(p, q)
    s = dsa_core.open(p, mode="r")
    np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)), ref)
    dsa_core.close(s)
    s = dsa_core.open(p)
    s = train(s, 40, seed=4, **SORTED)
    ref2 = dsa_core.read_records(s, np.arange(N))
    assert s.store.check_index() == []
    dsa_core.close(s)
    assert {F.read_header(f)["version"] for f in p.glob("seg-*.dsl")} >= {3}
    s = dsa_core.open(p, mode="r")
    np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)), ref2)
    dsa_core.close(s)
    seg, k, row, at = _segment_record(q)
    _flip(seg, at + 2)
    s = dsa_core.open(q, mode="r")
    with pytest.raises(F.SegmentError, match=f"record {k} \\(row {row}\\)"):
        dsa_core.gather(s, [row])
    dsa_core.close(s)


def test_a_format_1_store_is_read_and_its_records_checked(tmp_path):
    """Compatibility: stores written before record checksums open, read the same records,
    and a damaged record in one is still caught (open reads such segments whole)."""
    p = _trained(tmp_path, "log", steps=6)
    s = dsa_core.open(p, mode="r")
    ref = dsa_core.read_records(s, np.arange(N))
    dsa_core.close(s)
    _as_format_1(p)
    s = dsa_core.open(p)
    np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(N)), ref)
    s = train(s, 5, seed=4, **SORTED)
    dsa_core.close(s)
    m = json.loads((p / "manifest.json").read_text())
    assert m["version"] == 7 and m["checksum"]  # upgraded by the writer's flush
    _as_format_1(p)
    seg, _, row, at = _segment_record(p)
    _flip(seg, at)
    with pytest.raises(F.SegmentError, match=f"{seg.name}.* corrupt: the CRC of its records"):
        dsa_core.open(p, mode="r")


# -- 5. in-place headers -------------------------------------------------------------------
@pytest.mark.parametrize("durability", DURABILITY)
@pytest.mark.parametrize("at", [20, 40, 13])  # inside the JSON layout; the JSON's length
def test_a_flipped_byte_in_an_inplace_header_is_named(tmp_path, durability, at, capsys):
    """Was: a bare JSONDecodeError naming no file (open and verify)."""
    p = _trained(tmp_path, "inplace", durability, steps=3)
    _flip(p / "rows.dsa", at, 0x40)
    before = _files(p)
    for mode in ("r+", "r"):
        with pytest.raises(ValueError, match=r"header of .*rows\.dsa.* is damaged: .* restore "
                                             "the store from a checkpoint"):
            dsa_core.open(p, mode=mode)
    rc, out = _verify(p, capsys)
    assert rc == 1 and "rows.dsa" in out and "is damaged" in out
    assert _files(p) == before


def test_an_inplace_header_without_its_crc_gets_one(tmp_path):
    """Compatibility: a header written before the CRC opens; a writer's open adds it."""
    p = _trained(tmp_path, "inplace", steps=2)
    raw = bytearray((p / "rows.dsa").read_bytes())
    crc = bytes(raw[4072:4088])
    raw[4072:4088] = bytes(16)
    (p / "rows.dsa").write_bytes(bytes(raw))
    dsa_core.close(dsa_core.open(p, mode="r"))
    assert (p / "rows.dsa").read_bytes()[4072:4088] == bytes(16)
    dsa_core.close(dsa_core.open(p))
    assert (p / "rows.dsa").read_bytes()[4072:4088] == crc


# -- 6. a deleted manifest: damaged, not empty; garbage only when proven --------------------
@pytest.mark.parametrize("durability", DURABILITY)
@pytest.mark.parametrize("kind", KINDS)
def test_a_store_without_its_manifest_is_damaged_and_kept(tmp_path, kind, durability,
                                                          capsys):
    """Was (log): open said "not a DSA store ... create one", create accepted the directory
    and the next writer open deleted every segment as garbage."""
    p = _trained(tmp_path, kind, durability)
    (p / "manifest.json").unlink()
    before = _files(p)
    for mode in ("r+", "r"):
        with pytest.raises(FileNotFoundError, match=r"is damaged: its data file .* is there "
                           r"but its manifest\.json is missing|is damaged: its manifest\.json "
                           r"is missing .* restore the store from a checkpoint"):
            dsa_core.open(p, mode=mode)
    for other in KINDS:
        with pytest.raises(FileExistsError, match=r"holds a data file .* but no manifest\.json: "
                                                  r"a damaged store .* pass overwrite=True"):
            create(p, N, D, other, **STORE[other])
    with pytest.raises(SystemExit, match="damaged"):
        cli(["verify", "--quiet", str(p)])
    assert _files(p) == before
    s = dsa_core.create(p, N, D, storage=kind, overwrite=True)  # asked for: replaced
    dsa_core.close(s)
    assert not [f for f in before if f.startswith("seg-") and (p / f).exists()
                and f not in _files(p)]


def test_garbage_at_open_only_when_a_checksummed_manifest_proves_it(tmp_path):
    p = _trained(tmp_path, "log", steps=8)
    m = json.loads((p / "manifest.json").read_text())
    nxt = m["next_segment"]
    listed = set(m["segments"])
    old = next((i for i in range(1, nxt) if i not in listed), 0)  # older than the manifest
    src = p / F.seg_name(min(listed))
    for sid in (old, nxt + 3):
        (p / F.seg_name(sid)).write_bytes(src.read_bytes())
    del m["checksum"]  # as written before checksums: proves only what is newer than it
    m["version"] = 2
    (p / "manifest.json").write_text(json.dumps(m))
    dsa_core.close(dsa_core.open(p))
    assert (p / F.seg_name(old)).exists()       # older than the manifest: not proven garbage
    assert not (p / F.seg_name(nxt + 3)).exists()  # newer than the commit: garbage
    dsa_core.close(dsa_core.open(p))  # the open above wrote it again with its checksum
    assert not (p / F.seg_name(old)).exists()


# -- 7. checkpoints that share no blocks -----------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_checkpoint_shares_no_blocks_and_survives_damage(tmp_path, kind, capsys):
    s = create(tmp_path / "s", N, D, kind, **STORE[kind])
    s = train(s, 12, seed=0, **SORTED)
    link = dsa_core.checkpoint(s, tmp_path / "link")
    full = dsa_core.checkpoint(s, tmp_path / "full", copy=True)
    ref = dsa_core.read_records(s, np.arange(N))
    dsa_core.close(s)
    live = {f.name: f.stat().st_ino for f in (tmp_path / "s").iterdir()}
    for f in full.iterdir():
        assert f.stat().st_nlink == 1 and f.stat().st_ino != live.get(f.name)
    for snap in (link, full):
        r = dsa_core.open(snap, mode="r")
        np.testing.assert_array_equal(dsa_core.read_records(r, np.arange(N)), ref)
        dsa_core.close(r)
    if kind == "log":  # a hard-linked checkpoint shares a damaged segment; verify says so
        seg, _, row, at = _segment_record(tmp_path / "s")
        _flip(seg, at)
        assert _verify(tmp_path / "s", capsys)[0] == 1
        rc, out = _verify(link, capsys)
        assert rc == 1 and seg.name in out
        assert _verify(full, capsys)[0] == 0  # the copy is intact
        r = dsa_core.open(full, mode="r")
        np.testing.assert_array_equal(dsa_core.read_records(r, np.arange(N)), ref)
        dsa_core.close(r)
    with pytest.raises(TypeError, match="copy must be a bool"):
        s = dsa_core.open(tmp_path / "full")
        try:
            dsa_core.checkpoint(s, tmp_path / "x", copy="yes")
        finally:
            dsa_core.close(s)


# -- 8. verify reports file by file ------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_verify_names_every_file_it_checked(tmp_path, kind, capsys):
    p = _trained(tmp_path, kind, "step")
    rc, out = _verify(p, capsys)
    assert rc == 0
    assert "file manifest.json: ok (checksum" in out
    if kind == "log":
        segs = sorted(f.name for f in p.glob("seg-*.dsl"))
        assert segs and all(f"file {n}: ok (header, rows, steps and " in out for n in segs)
        assert "each against its checksum" in out
        assert "file index-" in out
    else:
        assert "file rows.dsa: ok (header CRC, layout and size" in out


def test_commit_log_damage_is_found_in_a_recycled_file(tmp_path):
    """A recycled log holds an older generation's entries after the current ones: damage
    before a valid current entry is still refused, a torn tail before the old entries is a
    tail (the scan stops at the first old header)."""
    from dsa_core._log.wal import WalError, WalWriter, read_entries, wal_name

    stride, rows = 3 * D, N
    rng = np.random.default_rng(1)

    def entry():
        r = np.sort(rng.choice(rows, 40, replace=False)).astype(np.int64)
        return r, rng.standard_normal((40, stride)).astype(np.float32)

    old, new = tmp_path / wal_name(1), tmp_path / wal_name(3)
    w = WalWriter.start(old, 11, stride, np.float32)
    for t in range(1, 9):
        w.append(t, *entry())
    w.close()
    w = WalWriter.start(new, 22, stride, np.float32, recycle=old)
    offs = [w.offset]
    for t in (101, 102, 103):
        w.append(t, *entry())
        offs.append(w.offset)
    w.close()

    def read():
        return [e.t for e in read_entries(new, 22, 101, stride, np.float32, rows)]

    assert read() == [101, 102, 103]
    _flip(new, offs[2] + 100)  # the last current entry: a tail, old entries after it
    assert read() == [101, 102]
    _flip(new, offs[2] + 100)
    _flip(new, offs[1] + 100)  # the middle one: damage
    with pytest.raises(WalError, match="entry of step 102 .* goes on with step 103"):
        read()


def test_an_interrupted_create_is_no_damaged_store(tmp_path):
    """A guard of this change, not a damage case (passes on the old code too): only the data
    file's temporary (an interrupted create) is no store's file; create again just works."""
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "rows.dsa.tmp").write_bytes(b"\0" * 64)
    dsa_core.close(create(tmp_path / "s", N, D, "inplace", **STORE["inplace"]))
    r = dsa_core.open(tmp_path / "s", mode="r")
    assert r.count == 0
    dsa_core.close(r)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("damage", ["digit", "truncate"])
def test_a_damaged_group_commit_file_is_named_at_open(tmp_path, kind, damage):
    """Two stores that commit together (``dsa_core.join``): a changed digit in their group
    commit file, or a torn one, is refused at the open of a member, naming the file and the
    remedy, and neither store's files are touched."""
    a, b = (create(tmp_path / n, N, D, kind, **STORE[kind]) for n in "ab")
    dsa_core.join([a, b])
    for idx, g in batches(3, N, D, seed=0, **SORTED):
        a, b = dsa_core.step_many([(a, idx, g), (b, idx, g)])
    dsa_core.flush_many([a, b])
    dsa_core.close(a)
    dsa_core.close(b)
    gfile = tmp_path / "a" / "commit-group.json"
    text = gfile.read_text()
    if damage == "digit":  # the first digit of the sequence number
        i = re.search(r'"seq":\s*\d', text).end() - 1
        text = text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:]
    else:
        text = text[: len(text) // 2]
    gfile.write_text(text)
    before = {p: _files(tmp_path / p) for p in ("a", "b")}
    for p in ("a", "b"):
        with pytest.raises(ValueError, match=r"commit-group\.json.*damaged.*checkpoint"):
            dsa_core.open(tmp_path / p)
    assert {p: _files(tmp_path / p) for p in ("a", "b")} == before


def test_read_json_checks_a_checksum_where_there_is_one(tmp_path):
    """dsa_core.tools.write_json(checksum=True) / read_json: the adapters' manifests (JAX
    checkpoints, sharded tables) are checked where they are read; a changed digit is named."""
    p = tmp_path / "m.json"
    dsa_core.tools.write_json(p, {"format": "x", "count": 12}, checksum=True)
    assert dsa_core.tools.read_json(p)["count"] == 12
    p.write_text(p.read_text().replace("12", "13"))
    with pytest.raises(ValueError, match=r"m\.json.*damaged.*checksum"):
        dsa_core.tools.read_json(p)
    dsa_core.tools.write_json(p, {"count": 12})  # written without one (older files): read as is
    assert dsa_core.tools.read_json(p) == {"count": 12}
    p.write_text('{"count": 1')
    with pytest.raises(ValueError, match=r"m\.json.*damaged.*not valid JSON"):
        dsa_core.tools.read_json(p)
