"""The cleaner of a log store: keeps the segments' records within ``space_ratio`` of the live.

A record is live when its row's location (``index``) points at it. A live record never comes back once dead (a row's location only moves to a
newer record), so the live records of a segment at any moment are a subset of those at any
earlier moment.

What a seal cleans (:meth:`Cleaner.choose`)
    With ``excess`` = the records the segments would hold after the seal minus
    ``space_ratio`` times the rows that have a location, a seal with ``excess > 0`` cleans
    victims (segments with a dead record, in the order of ``policy``: the lowest live
    fraction first, or LFS's cost-benefit ``age * (1 - u) / (1 + u)``): their live records
    join the seal unchanged (a resident row's newest record comes from its slot), which
    frees the whole victim. It takes only victims whose live records are **already in
    memory** (read in the background, or a segment still being written), until the bound
    holds or ``CLEAN_UNITS * max(seal_unit, records sealed)`` records have moved. So the
    store may run above ``space_ratio`` while cleaning reads are in flight, by at most
    ``slack`` = ``SLACK_UNITS`` seal units of records: only a seal that would leave more than
    that **waits**, taking victims whether read or not (waiting for their reads, or reading
    them now) until ``excess <= slack``, with no cap. That is a hard bound: after every seal
    the live segments hold at most ``space_ratio * live + slack`` records (records superseded
    by a seal of more than ``(space_ratio - 1) * live + slack`` rows at once, a batch that is
    a large part of a small table, excepted: they are cleaned by the seals after it). The
    waits are counted (``stats``: ``clean_waits`` seals that waited, ``clean_wait_us``).
Reading ahead (:meth:`Cleaner.read_ahead`)
    At the end of every seal that leaves the segments within ``READ_LEAD_UNITS`` seal units
    of the bound, the next victims' live records (on disk, or behind a *clean* resident slot:
    the row may leave the region before the clean; a dirty slot's record is never copied
    from the file) are handed to ``read.CleaningReads``, which reads them in a background
    thread, one request of at most ``request`` bytes at a time (dead records between
    live ones read through up to ``CLEAN_GAP_BYTES``), into buffers of at most ``held``
    bytes in all, resting between requests (``read.CLEAN_DUTY``: the disk serves the steps
    first) until the next seal, which lets the reads it finds unfinished run without rests.
    Paced by the seals: each seal starts the reads of the victims that the
    next ``1 + AHEAD_SEALS`` seals will clean. A seal past the slack that needs a victim not
    read ahead reads it itself into a buffer within the same room; a victim with more than
    ``whole`` bytes of live records, or one that would not fit the room, is copied through
    the segment's mapping after a read-ahead hint. The ids, steps and sums of the
    ``HINT_SEGMENTS`` victims after those are asked for (``MADV_WILLNEED``) one seal
    before their scan, which then finds them in memory instead of waiting for the disk.
Memory
    ``whole``, ``held`` and ``request`` are the memory budget's (``budget.cleaning_limits``
    of the store's seal unit, the ``cleaning_buffers`` part of ``budget.split``), capped by
    ``read.WHOLE_MAX``, ``read.CLEAN_HELD_BYTES`` and ``read.CLEAN_READ_BYTES`` (which only
    lower them): the reads hold at most ``held`` bytes of buffers and two request buffers.

The cleaner only reads: the seal writes, moves the locations and frees the victims.
"""

from __future__ import annotations

import os
import time

import numpy as np
from numba import njit

from . import read as _read
from .budget import cleaning_limits
from .format import Segment, crash_point, records_of, segment_geometry, sums_of
from .pool import Pool
from .read import CleaningReads, advise, advise_whole
from .index import loc_of, prefetch_loc
from .resident import AHEAD, find_one, prefetch_home
from .segments import Segments

__all__ = ["AHEAD_SEALS", "CLEAN_UNITS", "HINT_SEGMENTS", "POLICIES", "READ_LEAD_UNITS",
           "SLACK_UNITS", "Cleaner", "Copy"]

CLEAN_UNITS = 2  # a seal copies at most this many seal units of records from ready victims
SLACK_UNITS = 4  # the segments may exceed space_ratio x live by this many seal units
READ_LEAD_UNITS = 2  # reads ahead start this many seal units below the bound
POLICIES = ("greedy", "cost-benefit")
AHEAD_SEALS = 1  # reads ahead cover the next seal and this many more
HINT_SEGMENTS = 2  # victims after those read ahead whose ids are asked for a seal early


@njit(cache=True, nogil=True, inline="always")
def _prefetch_row(ibase, ifence, idelta, table, row):
    """Hint the entries a scan reads for ``row``: its index entries and its home in the
    region's map (a victim's rows are random ones: 2-3 cache misses each, 21k per segment)."""
    prefetch_loc(ibase, ifence, idelta, row)
    prefetch_home(table, row)


@njit(cache=True, nogil=True)
def _scan_segment(seg_rows, at, ibase, ifence, idelta, table, mark, ep, out_k, out_slots):
    """The live records of one segment (locations ``at + k``; the index is ``ibase`` and
    ``ifence`` and ``idelta``: ``index.loc_of``): returns ``(nk, ns)``.

    ``out_k[:nk]``: records whose row points at them and is not resident (to be copied
    from the segment). ``out_slots[:ns]``: the slots of resident rows that point at them and
    that are not already in the seal (``mark != ep``; they are marked now): their newest
    record comes from the region.
    """
    nk = 0
    ns = 0
    m = seg_rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:  # each lookup is a cache miss: the row's entries AHEAD on asked for
            _prefetch_row(ibase, ifence, idelta, table, seg_rows[k + AHEAD])
        r = seg_rows[k]
        if loc_of(ibase, ifence, idelta, r) != at + k:
            continue
        s = find_one(table, r)
        if s < 0:
            out_k[nk] = k
            nk += 1
        elif mark[s] != ep:
            mark[s] = ep
            out_slots[ns] = s
            ns += 1
    return nk, ns


@njit(cache=True, nogil=True)
def _live_records(seg_rows, at, ibase, ifence, idelta, table, dirty, out):
    """The live records of one segment that a seal cleaning it later may copy from it:
    ``out[:n]``. Those on disk, and those behind a *clean* resident slot (the row may leave
    the region before the clean, pointing at its record again). A dirty slot's record is
    never copied: the slot is in the region at the clean (its record comes from there), or
    it was sealed before (its record is dead)."""
    n = 0
    m = seg_rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            _prefetch_row(ibase, ifence, idelta, table, seg_rows[k + AHEAD])
        r = seg_rows[k]
        if loc_of(ibase, ifence, idelta, r) == at + k:
            s = find_one(table, r)
            if s < 0 or dirty[s] == 0:
                out[n] = k
                n += 1
    return n


def _rows_ahead(seg: Segment) -> None:
    """Ask for a victim's row ids, steps and sums all at once before a scan reads the ids
    and a seal copies the ids, steps and sums of its live records: the segment is mapped
    ``MADV_RANDOM`` (``format.map_segment``), so each would otherwise fault its pages in one
    4 KiB read at a time, on the step's thread."""
    if seg.sums is not None:  # in a file (a pending segment's are in memory)
        advise_whole(seg.rows)
        advise_whole(seg.steps)
        advise_whole(seg.sums)


class Copy:
    """One victim of a seal: its live records ``ks`` (not resident) are ``records[idx]``."""

    __slots__ = ("buffered", "idx", "ks", "records", "seg", "sums")

    def __init__(self, seg: Segment, ks: np.ndarray, records: np.ndarray, idx: np.ndarray,
                 buffered: bool, sums: np.ndarray | None = None):
        self.seg, self.ks, self.records, self.idx = seg, ks, records, idx
        self.buffered = buffered  # from a CleaningReads buffer (released after the seal)
        self.sums = sums  # the sums read with them (``sums[idx]``), else the segment's

    def sums_of(self, lo: int = 0, hi: int | None = None) -> np.ndarray | None:
        """The sums to check the copies of ``ks[lo:hi]`` against (None: the segment's)."""
        return None if self.sums is None else self.sums[self.idx[lo:hi]]


def _buffered(seg: Segment, ks: np.ndarray, buf: np.ndarray, idx: np.ndarray,
              stride: int, dtype: np.dtype) -> Copy:
    """A copy from a cleaning read's buffer: records, or (a version-3 segment) the bytes of
    records and their sums as they lie in the file (``CleaningReads._buffer``)."""
    if buf.dtype == dtype:
        return Copy(seg, ks, buf, idx, True)
    return Copy(seg, ks, records_of(buf, stride, dtype), idx, True, sums_of(buf))


class Cleaner:
    """Chooses the segments a seal cleans and reads their records (module docstring)."""

    def __init__(self, pool: Pool, segments: Segments, space_ratio: float,
                 policy: str = "greedy"):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.pool = pool
        self.segments = segments
        self.space_ratio = space_ratio
        self.policy = policy
        self.slack = SLACK_UNITS * pool.seal_unit
        # what the reads may hold: the budget's share (module docstring, "Memory")
        self.limits = cleaning_limits(pool.seal_unit, segments.rec_bytes)
        self.reads: CleaningReads | None = None  # this process's cleaning reads
        # the engine's counters (commit.Commit shares its own; these are counted here)
        self.stats = {"clean_waits": 0, "clean_wait_us": 0}
        # bytes, requests, seconds of requests and of pacing rests of the reads objects
        # already closed
        self.read_base = [0, 0, 0.0, 0.0]
        self.victim_records = 0  # records of the segments cleaned (what whole reads read)
        self.fallbacks = 0  # copies through the mapping for lack of a record read ahead

    # -- the bound ----------------------------------------------------------------------------
    def excess(self, n_seal: int = 0, n_new_loc: int = 0) -> float:
        """Records above ``space_ratio x live`` after a seal of ``n_seal`` records (cleaning
        nothing), ``n_new_loc`` of them rows without a location yet."""
        segs = self.segments
        return (segs.total_records + n_seal
                - self.space_ratio * (segs.live_total + n_new_loc))

    def bound(self) -> int:
        """The most records the live segments hold after any seal (module docstring)."""
        return int(self.space_ratio * self.segments.live_total) + self.slack

    def order(self) -> np.ndarray:
        """The segments with a dead record, best victim first (``policy``)."""
        segs = self.segments
        ids = np.fromiter(segs.segs, np.int64, len(segs.segs))
        live, n = segs.live[ids], segs.seg_n[ids]
        keep = live < n
        ids, live, n = ids[keep], live[keep], n[keep]
        u = live / n
        if self.policy == "greedy":
            key = u
        else:  # LFS: the benefit (free space x its age) over the cost (read + write the live)
            age = (segs.next_segment - ids).astype(np.float64)
            key = -(age * (1.0 - u) / (1.0 + u))
        return ids[np.argsort(key, kind="stable")]

    # -- a seal's victims -------------------------------------------------------------------
    def _reader(self) -> CleaningReads:
        r = self.reads
        if r is None or r.pid != os.getpid():  # a forked child's is its parent's
            lim = self.limits
            r = self.reads = CleaningReads(
                held_bytes=min(lim["held"], _read.CLEAN_HELD_BYTES),
                chunk=min(lim["request"], _read.CLEAN_READ_BYTES))
        return r

    def whole(self) -> int:
        """The most live bytes of a victim read into a buffer (else: through its mapping)."""
        return min(self.limits["whole"], _read.WHOLE_MAX)

    def _offset(self, seg: Segment) -> int:
        pool = self.pool
        return segment_geometry(seg.n, pool.stride, pool.dtype.itemsize)[2]

    def ready(self, sid: int) -> bool:
        """The live records of segment ``sid`` are in memory: a pending write's buffer, or a
        cleaning read that is done."""
        if sid in self.segments.pending:
            return True
        r = self.reads
        return r is not None and r.pid == os.getpid() and r.ready(sid)

    def _source(self, seg: Segment, ks: np.ndarray) -> Copy:
        """Where the seal copies the records ``ks`` of ``seg`` from (waiting for a read that
        is not done, or reading now)."""
        if seg.id in self.segments.pending:
            return Copy(seg, ks, seg.records, ks, False)
        pool, segs = self.pool, self.segments
        pitch = int(segs.pitch[seg.id])
        r = self._reader()
        got = r.get(seg.id)
        if got is not None:
            buf, ks0 = got
            idx = np.searchsorted(ks0, ks)
            if not ks.shape[0] or (idx[-1] < ks0.shape[0] and np.array_equal(ks0[idx], ks)):
                return _buffered(seg, ks, buf, idx, pool.stride, pool.dtype)
            # pragma: no cover - a live record not read ahead: impossible (a live record
            # never comes back, a dirty slot's is never copied). Counted: the tests
            # require none; read again below
            self.fallbacks += 1
            r.release(seg.id)
        if ks.shape[0] * pitch <= self.whole():
            buf = r.now(seg.id, seg.path, self._offset(seg), ks, pool.stride, pool.dtype,
                        pitch)
            if buf is not None:
                return _buffered(seg, ks, buf, np.arange(ks.shape[0]), pool.stride,
                                 pool.dtype)
        # too large for the buffers' room: through the mapping, after a read-ahead hint
        advise(segs.seg_addr[seg.id] + ks * pitch, pitch)
        return Copy(seg, ks, seg.records, ks, False)

    def choose(self, n_seal: int, n_new_loc: int, ep: int) -> tuple[list[np.ndarray],
                                                                    list[Copy]]:
        """The victims of a seal of ``n_seal`` records (``n_new_loc`` of them rows without a
        location yet) marked ``ep``: ``(resident slots, copies)`` (module docstring)."""
        segs, pool = self.segments, self.pool
        excess = self.excess(n_seal, n_new_loc)
        res: list[np.ndarray] = []
        copies: list[Copy] = []
        if excess <= 0 or not segs.segs:
            return res, copies
        order = self.order().tolist()
        taken: set[int] = set()

        def take(sid: int) -> int:
            """Clean ``sid``: returns the records it frees (net of its copies)."""
            seg = segs.segs[sid]
            _rows_ahead(seg)
            segs.check_meta(seg)  # its row ids and steps, checked once since the open
            pool.index.prepare(seg.rows)  # a mapped base: its pages read ahead and checked
            out_k = np.empty(seg.n, np.int64)
            out_s = np.empty(seg.n, np.int64)
            idx = pool.index
            nk, ns = _scan_segment(seg.rows, np.int64((sid << 32) + 1), idx.base, idx.fence,
                                   idx.delta, pool.table, pool.mark, ep, out_k, out_s)
            copies.append(self._source(seg, out_k[:nk].copy()))
            self.victim_records += seg.n
            res.append(out_s[:ns].copy())
            taken.add(sid)
            return nk + ns

        cap = CLEAN_UNITS * max(pool.seal_unit, n_seal)
        moved = 0
        for sid in order:  # victims already in memory: no wait
            if excess <= 0 or moved >= cap:
                break
            if self.ready(sid):
                m = take(sid)
                moved += m
                excess -= segs.seg_n[sid] - m
        if excess > self.slack:  # past the slack: wait for (or do) the reads
            waited, any_wait = 0.0, False
            for sid in order:
                if excess <= self.slack:
                    break
                if sid in taken:
                    continue
                crash_point("clean-wait")
                t0 = time.perf_counter()
                was_ready = self.ready(sid)
                m = take(sid)
                if not was_ready:
                    waited += time.perf_counter() - t0
                    any_wait = True
                excess -= segs.seg_n[sid] - m
            if any_wait:
                self.stats["clean_waits"] += 1
                self.stats["clean_wait_us"] += int(waited * 1e6)
        return res, copies

    def done_with(self, copy: Copy) -> None:
        """The seal has copied (and committed to its segment) the records of ``copy``."""
        if copy.buffered:
            self.reads.release(copy.seg.id)
            # the buffer is free once released: the seal keeps ``copy`` (its seg and ks)
            # to the end, and starts the next reads before it ends
            copy.records = copy.idx = copy.sums = None

    # -- reading ahead --------------------------------------------------------------------------
    def read_ahead(self) -> int:
        """Start reading the victims of the next seals, if the segments are near the bound;
        returns the reads started.

        Paced by the seals: victims in order, until the records they would free cover what
        the next ``1 + AHEAD_SEALS`` seals of a seal unit each would add above the bound
        (victims read already, or in memory, count first), within the buffers' room."""
        segs, pool = self.segments, self.pool
        if self.reads is not None and self.reads.pid == os.getpid():
            self.reads.hurry_all()  # the reads of earlier seals: the next seal needs them
        excess = self.excess()
        if not segs.segs or excess <= -READ_LEAD_UNITS * pool.seal_unit:
            return 0
        need = excess + (1 + AHEAD_SEALS) * pool.seal_unit
        r = self._reader()
        started = 0
        order = self.order().tolist()
        stop = len(order)  # where the reads stopped: the victims after them are hinted
        for i, sid in enumerate(order):
            if need <= 0:
                stop = i
                break
            frees = int(segs.seg_n[sid] - segs.live[sid])
            if sid in segs.pending or r.has(sid):
                need -= frees
                continue
            nbytes = int(segs.live[sid]) * int(segs.pitch[sid])  # its live records, at most
            if nbytes > self.whole():
                continue
            if not r.room(nbytes + 8 * int(segs.live[sid])):  # its buffer and record numbers
                stop = i
                break  # the buffers are full: the reads of the next seals come first
            seg = segs.segs[sid]
            _rows_ahead(seg)
            segs.check_meta(seg)  # its row ids and steps, checked once since the open
            pool.index.prepare(seg.rows)  # a mapped base: its pages read ahead and checked
            out = np.empty(seg.n, np.int64)
            n = _live_records(seg.rows, np.int64((sid << 32) + 1), pool.index.base,
                              pool.index.fence, pool.index.delta, pool.table, pool.dirty, out)
            if not r.ahead(sid, seg.path, self._offset(seg), out[:n].copy(), pool.stride,
                           pool.dtype, int(segs.pitch[sid])):
                stop = i
                break
            need -= frees
            started += 1
        # the victims after these (enough read, or no room left): their ids, steps and sums
        # asked for now, so that the next seal's scan of them finds them in memory
        for later in order[stop:stop + HINT_SEGMENTS]:
            if later not in segs.pending and not r.has(later):
                _rows_ahead(segs.segs[later])
        return started

    def read_counts(self) -> tuple[int, int, float, float]:
        """Bytes and requests the cleaning reads of this open have read, the seconds their
        requests took and the seconds the reading thread rested (pacing)."""
        b, q, busy, rested = self.read_base
        r = self.reads
        if r is not None and r.pid == os.getpid():
            b, q, busy, rested = (b + r.bytes_read, q + r.requests, busy + r.busy,
                                  rested + r.rested)
        return b, q, busy, rested

    def forget(self, sid: int) -> None:
        """Segment ``sid`` died: a read ahead of it is not needed."""
        if self.reads is not None and self.reads.pid == os.getpid():
            self.reads.forget(sid)

    def stop(self) -> None:
        """Stop this process's cleaning-read thread (a forked child's is its parent's)."""
        r, self.reads = self.reads, None
        if r is not None and r.pid == os.getpid():
            r.close()
            self.read_base[0] += r.bytes_read
            self.read_base[1] += r.requests
            self.read_base[2] += r.busy
            self.read_base[3] += r.rested
