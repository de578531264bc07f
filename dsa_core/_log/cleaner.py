"""The cleaner of a log store: keeps the segments' records within ``space_ratio`` of the live.

A record is live when its row's location (``loc``, or the ``slot_disk`` of a resident row)
points at it. Every seal (``commit``) first asks :meth:`Cleaner.choose`: when the records
of all segments would exceed ``space_ratio`` times the rows that have a location, the
segments with the lowest live fraction are cleaned: their live records join the seal
unchanged (a resident row's newest record comes from its slot) until the bound holds or
``CLEAN_UNITS * max(seal_unit, records sealed)`` records have moved (the last segment is
taken whole), so that no single seal stalls for long; the next seal continues.

The records to copy come from :meth:`Cleaner.source`: a segment read whole into a buffer
with sequential reads (``read.CleaningReads``), started one seal ahead in a background
thread for the next seal's candidates (:meth:`Cleaner.read_ahead_next`); a pending
segment's records are in memory already; one larger than ``WHOLE_MAX`` is read through its
mapping, with read-ahead. The cleaner only reads: the seal writes and moves the locations.
"""

from __future__ import annotations

import os

import numpy as np
from numba import njit

from .format import Segment, segment_geometry
from .pool import Pool
from .read import WHOLE_MAX, CleaningReads, advise_whole
from .segments import Segments

__all__ = ["CLEAN_UNITS", "Cleaner"]

CLEAN_UNITS = 2  # a seal copies at most this many seal units of records for cleaning


@njit(cache=True, nogil=True)
def _scan_segment(seg_rows, base, loc, slot_disk, mark, ep, out_k, out_slots):
    """The live records of one segment (locations ``base + k``): returns ``(nk, ns)``.

    ``out_k[:nk]``: records whose row is not resident and points at them (to be copied from
    the mapping). ``out_slots[:ns]``: resident slots whose ``slot_disk`` points at them and
    that are not already in the seal (``mark != ep``; they are marked now): their newest
    record comes from the region.
    """
    nk = 0
    ns = 0
    for k in range(seg_rows.shape[0]):
        L = base + k
        lr = loc[seg_rows[k]]
        if lr == L:
            out_k[nk] = k
            nk += 1
        elif lr < 0:
            s = -lr - 1
            if slot_disk[s] == L and mark[s] != ep:
                mark[s] = ep
                out_slots[ns] = s
                ns += 1
    return nk, ns


class Cleaner:
    """Chooses the segments a seal cleans and reads their records (module docstring)."""

    def __init__(self, pool: Pool, segments: Segments, space_ratio: float):
        self.pool = pool
        self.segments = segments
        self.space_ratio = space_ratio
        self.reads: CleaningReads | None = None  # segments read whole for cleaning
        self.next_clean: list[int] = []  # the next seal's cleaning candidates, read ahead

    def choose(self, n_seal: int, n_new_loc: int, ep: int):
        """The segments to clean in a seal of ``n_seal`` records (``n_new_loc`` of them rows
        without a location yet) marked ``ep``: ``(resident slots, [(seg, ks), ...])``."""
        segs, pool = self.segments, self.pool
        self.next_clean = []
        live_after = segs.live_total + n_new_loc
        excess = segs.total_records + n_seal - self.space_ratio * live_after
        res: list[np.ndarray] = []
        copies: list[tuple[Segment, np.ndarray]] = []
        if excess <= -2 * pool.seal_unit or not segs.segs:
            return res, copies
        ids = np.fromiter(segs.segs, np.int64, len(segs.segs))
        frac = segs.live[ids] / segs.seg_n[ids]
        order = ids[np.argsort(frac, kind="stable")].tolist()
        cap = CLEAN_UNITS * max(pool.seal_unit, n_seal)
        moved = 0
        for i, sid in enumerate(order):
            seg = segs.segs[sid]
            if excess <= 0 or moved >= cap or segs.live[sid] >= seg.n:
                # done (a fully live segment frees nothing, nor any after it). The next
                # seal's candidates are read ahead once this seal is done (commit), so that
                # its copies find them in memory instead of waiting for the disk
                self.next_clean = [nxt for nxt in order[i:i + max(1, len(copies))]
                                   if segs.live[nxt] < segs.seg_n[nxt]]
                break
            out_k = np.empty(seg.n, np.int64)
            out_s = np.empty(seg.n, np.int64)
            nk, ns = _scan_segment(seg.rows, np.int64((sid << 32) + 1), pool.loc,
                                   pool.slot_disk, pool.mark, ep, out_k, out_s)
            copies.append((seg, out_k[:nk]))
            res.append(out_s[:ns])
            moved += nk + ns
            excess -= seg.n - (nk + ns)
        return res, copies

    def source(self, seg: Segment, now: bool = True) -> np.ndarray | None:
        """The records of ``seg``, which cleaning copies from: read whole into a buffer with
        sequential reads (``now=False``: start that read in the background, for the next
        seal). A pending segment's records are in memory already; one too large for a buffer
        is read through its mapping, with read-ahead (read)."""
        if seg.id in self.segments.pending or seg.records.nbytes > WHOLE_MAX:
            if seg.id not in self.segments.pending:
                advise_whole(seg.records)
            return seg.records
        r = self.reads
        if r is None or r.pid != os.getpid():
            r = self.reads = CleaningReads()
        pool = self.pool
        off = segment_geometry(seg.n, pool.stride, pool.dtype.itemsize)[2]
        shape = (seg.n, pool.stride)
        if now:
            return r.records(seg.id, seg.path, off, shape, pool.dtype)
        r.ahead(seg.id, seg.path, off, shape, pool.dtype)
        return None

    def done_with(self, records: np.ndarray, seg: Segment) -> None:
        """The seal has copied from ``records`` (what :meth:`source` gave for ``seg``)."""
        if records is not seg.records:
            self.reads.release(records)

    def read_ahead_next(self) -> None:
        """Start reading the next seal's candidates (into the buffers just released)."""
        for nxt in self.next_clean:
            if nxt in self.segments.segs:
                self.source(self.segments.segs[nxt], now=False)

    def forget(self, sid: int) -> None:
        """Segment ``sid`` died: a read ahead of it is not needed."""
        if self.reads is not None and self.reads.pid == os.getpid():
            self.reads.forget(sid)

    def stop(self) -> None:
        """Stop this process's cleaning-read thread (a forked child's is its parent's)."""
        r, self.reads = self.reads, None
        if r is not None and r.pid == os.getpid():
            r.close()
