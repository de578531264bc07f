"""The buffer pool of a log store: the region of record slots, CLOCK, and who is where.

In memory
    ``region`` (S, stride) records, anonymous memory (``np.zeros``: faulted in on first use,
    never written back behind our back). ``index`` (``index.RowIndex``): the location of
    each row's newest on-disk record (0: never written, the row reads as its initial
    record, ``_init``); for a resident row it may be older than the slot (the slot is
    dirty). ``table``: which rows are resident, in which slot (``resident``: a map
    sized by the region, not by the table). Per slot: ``slot_row`` (-1 when free),
    ``dirty``, a CLOCK reference bit, the pin mark (the current :meth:`Pool.acquire`'s
    epoch, or ``RANGE_PIN``: held by a loaded range) and the mark of the seal a slot is
    going into, and the free-slot stack.
Acquiring
    :meth:`Pool.acquire` makes the rows of a batch resident and dirty. When the free slots do
    not cover its misses, the caller's ``make_room`` runs (``commit``): :meth:`Pool.evict`
    (CLOCK, second chance) picks victims among the slots not used by this call until
    ``misses + seal_unit`` slots are free: clean victims are dropped at once (their row's
    index points at their record), dirty ones are returned to be sealed together. Misses
    are then read from their segment (``segments``) or initialised.
Reading
    :meth:`Pool.read` copies records without changing residency: from the region, from the
    segments, or the initial record of a never-written row.
Range pins
    A range loaded with ``dsa_core.load_range`` (``ranges``: the log engine's range loads)
    is *active* until its ``release_range``: every slot holding a row of an active range is
    pinned (``pin == RANGE_PIN``), so CLOCK never picks it, until the release. Records read
    ahead for a range are put into free slots by :meth:`Pool.install_loaded`, clean, and
    only where the row still lies at the location that was read (a row that became
    resident, or moved since, is never overwritten with an older record). Should a batch
    not fit beside the pinned slots (a caller that skipped ``load_range``'s check), the
    range pins yield (``range_pins_dropped``): a step never fails because of a load.

    A row set loaded with ``dsa_core.load_rows`` is pinned the same way until its
    ``release_rows``: ``row_sets`` holds the active sets (sorted unique arrays, one per
    load), ``row_union`` their union; :meth:`Pool.in_ranges` and :meth:`Pool.pinned_with`
    count the union of the active ranges and row sets (``searchsorted`` on sorted arrays),
    so a row held by both stays pinned until neither holds it.

The pool never writes a file: sealing is ``commit``'s, with the slots and marks kept here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from .._coalesce import _dedup, gather_rows
from .._init import InitSpec, initial_records
from .._pool import run_chunked
from .._validation import as_index
from .budget import check_memory, delta_capacity, index_mapped, index_piece_rows, slots_for
from .format import Segment, SegmentError
from .index import RowIndex
from .resident import find as _find
from .resident import insert as _insert
from .resident import new_table, slots_of
from .resident import remove as _remove
from .resident import remove_one as _remove_one
from .segments import Segments

__all__ = ["RANGE_PIN", "Pool", "gather_records"]

RANGE_PIN = -1  # ``pin`` of a slot held by an active loaded range or row set (epochs > 0)
READER_INDEX_BYTES = 256 << 20  # a reader without memory= maps an index larger than this
_NO_ROWS = np.empty(0, np.int64)


def _merged(spans) -> tuple[np.ndarray, np.ndarray]:
    """``(lo, hi)``: the union of the ``(start, stop)`` spans as sorted disjoint spans."""
    spans = sorted((lo, hi) for lo, hi in spans if hi > lo)
    out: list[list[int]] = []
    for lo, hi in spans:
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    arr = np.array(out, np.int64).reshape(-1, 2)
    return arr[:, 0].copy(), arr[:, 1].copy()


def _in_spans(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` lies in one of the sorted disjoint spans ``[lo, hi)``."""
    if not lo.shape[0]:
        return np.zeros(rows.shape[0], bool)
    k = np.searchsorted(lo, rows, side="right") - 1
    return (k >= 0) & (rows < hi[np.maximum(k, 0)])


def _in_sorted(rows: np.ndarray, sorted_rows: np.ndarray) -> np.ndarray:
    """Whether each of ``rows`` is one of the sorted ``sorted_rows``."""
    if not sorted_rows.shape[0]:
        return np.zeros(rows.shape[0], bool)
    k = np.minimum(np.searchsorted(sorted_rows, rows), sorted_rows.shape[0] - 1)
    return sorted_rows[k] == rows


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The union of two sorted unique row arrays (sorted, unique)."""
    if not a.shape[0]:
        return b
    if not b.shape[0]:
        return a
    return np.union1d(a, b)


@njit(cache=True, nogil=True)
def _evict(target, hand, slot_row, ref, dirty, pin, epoch, mark, ep, table, free,
           nfree, victims):
    """CLOCK until ``nfree + victims >= target``; returns ``(hand, nfree, n_victims)``.

    Slots pinned by this call (``pin == epoch``) or by a loaded range (``pin < 0``) or
    already chosen (``mark == ep``) are skipped; a referenced slot loses its bit and is
    passed over once. A clean victim is freed at once (its row leaves ``table``: the
    index points at its record); a dirty one is marked ``ep`` and returned in ``victims`` for the seal.
    ``n_victims < 0``: the target cannot be met (the caller asked for more than the unpinned
    slots), nothing more was chosen.
    """
    S = slot_row.shape[0]
    nv = 0
    guard = 0
    while nfree + nv < target:
        guard += 1
        if guard > 3 * S + 3:
            return hand, nfree, -1 - nv
        s = hand
        hand += 1
        if hand == S:
            hand = 0
        r = slot_row[s]
        if r < 0 or pin[s] == epoch or pin[s] < 0 or mark[s] == ep:
            continue
        if ref[s]:
            ref[s] = 0
            continue
        if dirty[s]:
            mark[s] = ep
            victims[nv] = s
            nv += 1
        else:
            _remove_one(table, r)
            slot_row[s] = -1
            free[nfree] = s
            nfree += 1
    return hand, nfree, nv


def gather_records(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:len(idx)] = src[idx]`` for whole records, on the kernel pool: a gather of
    random records is bound by memory latency, which the prefetching gather of
    ``_coalesce`` hides (32k records of 1 KiB: np.take 22 ms, this 3-4 ms on 2 threads)."""
    run_chunked(gather_rows, (src, idx, 0, out[:idx.shape[0]]), idx.shape[0], 1024)


class Pool:
    """The region and its slot bookkeeping (see the module docstring).

    ``segments`` is the store's segment table (misses are read from it), ``init`` the
    initial records of never-written rows, ``stats`` the engine's counters (``acquires``,
    ``user_records``, ``misses``, ``evicted_clean`` are counted here). ``memory_bytes``: the
    caller's budget, which every batch is checked against (a reader's region may be larger).
    """

    def __init__(self, path: Path, layout: dict[str, Any], slots: int, seal_unit: int,
                 memory_bytes: int | None, init: InitSpec, segments: Segments,
                 stats: dict[str, int]):
        self.path = path
        self.layout = layout
        self.num_rows = int(layout["num_rows"])
        self.stride = int(layout["stride"])
        self.dtype = np.dtype(layout["dtype"])
        self.memory_bytes = memory_bytes
        self._batch_cap: tuple[int, int] | None = None  # (memory_bytes, rows it holds)
        self.init = init
        self.segments = segments
        self.stats = stats
        S = self.slots = slots
        self.seal_unit = seal_unit
        # anonymous memory; numpy advises large allocations MADV_HUGEPAGE (2 MiB pages where
        # the kernel allows: a first touch fills 2 MiB, and fewer TLB misses)
        self.region = np.zeros((S, self.stride), self.dtype)
        self.slot_row = np.full(S, -1, np.int64)
        # the on-disk location of each slot's row (what the index says; -1: not known, look
        # it up): a seal learns the old locations it kills without reading index pages
        self.slot_loc = np.full(S, -1, np.int64)
        self.table = new_table(S)  # resident rows -> their slots
        self.pin = np.zeros(S, np.int64)
        self.mark = np.zeros(S, np.int64)
        self.free = np.arange(S - 1, -1, -1, dtype=np.int64)  # a stack: pops take slot 0 first
        self.nfree = S
        self.dirty = np.zeros(S, np.uint8)
        self.ref = np.zeros(S, np.uint8)
        self.hand = 0
        self.epoch = 0       # one per acquire: pins
        self.seal_epoch = 0  # one per seal: marks the slots going into it
        # the row index: in memory, or mapped (``budget.index_mapped``; a reader without a
        # budget maps an index of more than READER_INDEX_BYTES)
        self.index_mapped = (index_mapped(layout, memory_bytes) if memory_bytes is not None
                             else 8 * self.num_rows > READER_INDEX_BYTES)
        self.index = RowIndex(self.num_rows, delta_capacity(layout, memory_bytes)
                              if self.index_mapped and memory_bytes is not None else None)
        if self.index_mapped:
            self.index.unmapped()  # no base file yet (an open maps the manifest's)
        self.ranges: list[tuple[int, int]] = []  # active loaded ranges, in load order
        self.row_sets: list[np.ndarray] = []     # active loaded row sets (sorted, unique)
        self.row_union = _NO_ROWS                # their union (sorted, unique)
        self.range_pinned = 0                    # slots with pin == RANGE_PIN

    def check_batch(self, batch: int) -> None:
        """Raise ``ValueError`` unless the region holds a batch of ``batch`` rows. The rows
        the budget holds are found once (``budget.slots_for`` searches the budget's split:
        ~0.3 ms, a quarter of a warm step when it ran twice per step)."""
        m = self.memory_bytes or 0
        if self._batch_cap is None or self._batch_cap[0] != m:
            self._batch_cap = (m, slots_for(self.layout, m))
        if batch > self._batch_cap[1]:
            check_memory(self.layout, m, int(batch))  # raises, saying what to set

    # -- reading ----------------------------------------------------------------------------
    def initial_into(self, rows: np.ndarray, out: np.ndarray, out_idx: np.ndarray,
                     cols: slice = slice(None)) -> None:
        """``out[out_idx] =`` the initial records of ``rows`` (columns ``cols``)."""
        if not rows.shape[0]:
            return
        if self.init.kind == "zeros" or self.init.w_off is None:
            out[out_idx] = 0
        else:
            out[out_idx] = initial_records(rows, self.init)[:, cols]

    def read(self, rows: Any, cols: slice | None = None) -> np.ndarray:
        """A copy of the records of ``rows`` (see ``LogStore.read``)."""
        rows = as_index(rows, self.num_rows, "rows")
        if cols is None:
            cols = slice(None)
        if not isinstance(cols, slice) or cols.step not in (None, 1):
            raise ValueError(f"cols must be a slice of record columns with step 1, got {cols!r}")
        width = len(range(*cols.indices(self.stride)))
        n = rows.shape[0]
        out = np.empty((n, width), self.dtype)
        sl = self.slots_of(rows)
        res = sl >= 0
        if res.any():
            out[res] = self.region[sl[res], cols]
        lr = self.disk_locs(rows, res)  # -1: served from the region
        disk = np.flatnonzero(lr > 0)
        self.segments.read_into(lr[disk], out, disk, cols)
        never = np.flatnonzero(lr == 0)
        self.initial_into(rows[never], out, never, cols)
        return out

    def slots_of(self, rows: np.ndarray) -> np.ndarray:
        """The slot of each of ``rows`` (checked ids), -1 where it is not resident."""
        return slots_of(self.table, rows)

    def slot_locs(self, slots: np.ndarray) -> np.ndarray:
        """The on-disk location of the rows of resident ``slots`` (0: never written), from
        what each slot remembers; looked up in the index only where it does not know."""
        locs = self.slot_loc[slots]
        unknown = np.flatnonzero(locs < 0)
        if unknown.shape[0]:
            locs[unknown] = self.index.get(self.slot_row[slots[unknown]])
        return locs

    def disk_locs(self, rows: np.ndarray, resident: np.ndarray | None = None) -> np.ndarray:
        """The location of each of ``rows`` (checked ids) that is not resident, -1 for the
        resident ones (``resident``: their mask, if known). Only the others are looked up:
        a mapped index reads (and checks) no page for a row served from the region."""
        if resident is None:
            resident = self.resident(rows)
        out = np.full(rows.shape[0], -1, np.int64)
        away = ~resident
        out[away] = self.index.get(rows[away])
        return out

    def resident(self, rows: np.ndarray) -> np.ndarray:
        """Whether each of ``rows`` (checked ids) is resident."""
        return self.slots_of(rows) >= 0

    def residency(self, rows: np.ndarray) -> float:
        """The fraction of ``rows`` (checked ids) resident in the region."""
        return float(self.resident(rows).mean()) if rows.shape[0] else float("nan")

    def readahead(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[Segment]]:
        """Where the on-disk records of ``rows`` (checked ids) lie (see
        ``LogStore.readahead``)."""
        lr = self.disk_locs(rows)
        return self.segments.addresses(lr[lr > 0])

    def disk_entries(self, rows: int | None = None):
        """Every row with an on-disk location and its location (what an index base file is
        written from: ``RowIndex.located``) in pieces of about ``rows`` rows (default: the
        budget's ``index_piece_rows``), written in turn by a flush or a rebase."""
        if rows is None:
            rows = index_piece_rows(self.slots, self.stride * self.dtype.itemsize)
        return self.index.located(rows)

    def disk_locations(self) -> np.ndarray:
        """The on-disk location of every row, as one array (checks and tests)."""
        return self.index.all()

    # -- acquiring ----------------------------------------------------------------------------
    def acquire(self, rows: Any, make_room: Callable[[int, int], None], *, load: bool = True,
                check: bool = True) -> np.ndarray:
        """Make ``rows`` resident and dirty; returns their slots (see ``LogStore.acquire``).

        ``make_room(need, pinned)``: called when the free slots do not cover the ``need``
        misses; it must free at least that many slots without touching the ``pinned`` slots
        of this call (``commit``: :meth:`evict`, then seal the dirty victims).
        """
        if check:
            rows = as_index(rows, self.num_rows, "rows")
            if rows.shape[0] > 1 and _dedup(rows)[2] != rows.shape[0]:
                u, c = np.unique(rows, return_counts=True)
                raise ValueError(f"rows must be unique in acquire (each row gets one slot); "
                                 f"{u[c > 1][:5].tolist()} repeat. Coalesce the batch first")
        else:
            rows = np.ascontiguousarray(rows, dtype=np.int64)
        n = rows.shape[0]
        self.check_batch(n)
        slots = np.empty(n, np.int64)
        if not n:
            return slots
        self.epoch += 1
        _find(self.table, rows, slots)
        hit = slots >= 0
        hslots = slots[hit]
        hpin = self.pin[hslots]
        ranged = hpin < 0  # held by a loaded range: stays so (and stays pinned)
        self.pin[hslots[~ranged]] = self.epoch
        miss = np.flatnonzero(~hit)
        need = miss.shape[0]
        if need > self.nfree:
            pinned = n - need + self.range_pinned - int(np.count_nonzero(ranged))
            if need > self.slots - pinned:  # the loaded ranges leave no room: they yield
                self.drop_range_pins()
                self.pin[hslots] = self.epoch  # this call's hits stay pinned
                pinned = n - need
            make_room(need, pinned)
        mrows = rows[miss]
        old = self.index.get(mrows)  # after the seal: cleaning may have moved them
        top = self.nfree
        mslots = self.free[top - need:top][::-1].copy()
        self.nfree = top - need
        if load:
            try:
                ondisk = np.flatnonzero(old > 0)
                self.segments.read_into(old[ondisk], self.region, mslots[ondisk])
                fresh = np.flatnonzero(old == 0)
                self.initial_into(mrows[fresh], self.region, mslots[fresh])
            except BaseException:  # e.g. a damaged record (SegmentError): nothing changed,
                self.nfree = top   # the slots only read into go back to the free stack
                raise
        self.slot_row[mslots] = mrows
        self.slot_loc[mslots] = old
        _insert(self.table, mrows, mslots)
        if self.loads_active:  # rows of an active load read before its load came: pinned
            held = mslots[self.in_ranges(mrows)]
            self.pin[held] = RANGE_PIN
            self.range_pinned += held.shape[0]
        slots[miss] = mslots
        self.ref[slots] = 1
        self.dirty[slots] = 1  # last: a seal inside this call may have cleaned a hit
        st = self.stats
        st["acquires"] += 1
        st["user_records"] += n
        st["misses"] += need
        return slots

    def write(self, rows: Any, records: Any, make_room: Callable[[int, int], None]) -> None:
        """Overwrite the whole records of ``rows`` (see ``LogStore.write``)."""
        rows = as_index(rows, self.num_rows, "rows")
        rec = np.asarray(records)
        if rec.dtype != self.dtype or rec.shape != (rows.shape[0], self.stride):
            raise ValueError(f"records must be a ({rows.shape[0]}, {self.stride}) "
                             f"{self.dtype.name} array (whole records of this layout), got "
                             f"{rec.shape} {rec.dtype}")
        if rows.shape[0] > 1 and _dedup(rows)[2] != rows.shape[0]:
            raise ValueError("rows must not repeat in write (which record would win is "
                             "undefined); pass unique row ids")
        if not self.slots:
            self.check_batch(1)
        for lo in range(0, rows.shape[0], self.slots):
            slots = self.acquire(rows[lo:lo + self.slots], make_room, load=False, check=False)
            self.region[slots] = rec[lo:lo + self.slots]

    def release(self, rows: Any, seal_all: Callable[[np.ndarray, bool], None]) -> int:
        """Write the resident records of ``rows`` out and make their slots free (see
        ``LogStore.release``); ``seal_all(slots, evict)`` seals dirty slots (``commit``)."""
        rows = np.unique(as_index(rows, self.num_rows, "rows"))
        slots = self.slots_of(rows)
        slots = slots[slots >= 0]  # in row order
        if not slots.shape[0]:
            return 0
        dirty = self.dirty[slots] != 0
        if dirty.any():
            seal_all(slots[dirty], True)
        self.free_slots(slots[~dirty])  # after the seal: cleaning may have moved them
        return int(slots.shape[0])

    # -- sealing (``commit.Commit.seal``) --------------------------------------------------
    def next_seal_epoch(self) -> int:
        """A new seal mark (slots marked with it are going into that seal)."""
        self.seal_epoch += 1
        return self.seal_epoch

    def mark_sealing(self, slots: np.ndarray, ep: int) -> None:
        """``slots`` go into the seal of mark ``ep`` (the cleaner's scan skips them)."""
        self.mark[slots] = ep

    def rows_of_slots(self, slots: np.ndarray) -> np.ndarray:
        """The row each of ``slots`` (resident) holds."""
        return self.slot_row[slots]

    def gather_slots(self, slots: np.ndarray, out: np.ndarray) -> None:
        """``out[i]`` = the record in slot ``slots[i]`` (``out``: records, any layout)."""
        gather_records(self.region, slots, out)

    def put_slots(self, slots: np.ndarray, records: np.ndarray) -> None:
        """The records of ``slots`` (resident, dirty) become ``records``."""
        self.region[slots] = records

    def sealed_slots(self, slots: np.ndarray, locs: np.ndarray) -> int:
        """``slots`` were written at ``locs`` (a seal): they are clean and remember where;
        returns how many of them were dirty (the user's changes, not cleaning's)."""
        n_user = int(np.count_nonzero(self.dirty[slots]))
        self.slot_loc[slots] = locs
        self.dirty[slots] = 0
        return n_user

    def occupancy(self) -> tuple[int, int]:
        """``(slots used, slots dirty)`` of the region."""
        return self.slots - self.nfree, int(np.count_nonzero(self.dirty))

    # -- eviction ---------------------------------------------------------------------------
    def evict(self, need: int, pinned: int) -> tuple[np.ndarray, int]:
        """CLOCK until ``need + seal_unit`` slots (at most all but the ``pinned`` ones) are
        free or chosen: returns the dirty victims, marked for a new seal, and that seal's
        mark. Clean victims are free already."""
        target = min(need + self.seal_unit, self.slots - pinned)
        ep = self.next_seal_epoch()
        victims = np.empty(max(target, 1), np.int64)
        before = self.nfree
        self.hand, self.nfree, nv = _evict(
            target, self.hand, self.slot_row, self.ref, self.dirty, self.pin, self.epoch,
            self.mark, ep, self.table, self.free, self.nfree, victims)
        if nv < 0:  # pragma: no cover - acquire checks the batch against the region first
            raise RuntimeError(f"log store {str(self.path)!r}: eviction could not free "
                               f"{target} slots of {self.slots} ({pinned} pinned)")
        self.stats["evicted_clean"] += self.nfree - before
        return victims[:nv].copy(), ep

    def dirty_slots(self) -> np.ndarray:
        """The slots changed since their last seal, in slot order."""
        return np.flatnonzero(self.dirty)

    def adopt_index(self, index: np.ndarray) -> None:
        """Take ``index`` (checked: per row its on-disk location, 0 for none) as the rows'
        locations (an open, ``recovery.load``)."""
        self.index.adopt(index)

    def free_slots(self, slots: np.ndarray) -> None:
        """Make clean resident ``slots`` free: their rows are read from their location again."""
        _remove(self.table, self.slot_row[slots])
        self.slot_row[slots] = -1
        self.ref[slots] = 0
        held = self.pin[slots] < 0
        if held.any():
            self.pin[slots[held]] = 0
            self.range_pinned -= int(np.count_nonzero(held))
        k = slots.shape[0]
        self.free[self.nfree:self.nfree + k] = slots
        self.nfree += k

    # -- range pins and loaded records (``ranges``) --------------------------------------------
    @property
    def loads_active(self) -> bool:
        """Whether a loaded range or row set is active (its rows are pinned)."""
        return bool(self.ranges or self.row_sets)

    def in_ranges(self, rows: np.ndarray, ranges=None) -> np.ndarray:
        """Whether each of ``rows`` lies in one of ``ranges`` (default: the active ranges and
        row sets). Sorted arrays and ``searchsorted``: no Python loop over rows."""
        if ranges is None:
            lo, hi = _merged(self.ranges)
            held = _in_spans(rows, lo, hi)
            if self.row_union.shape[0]:
                held |= _in_sorted(rows, self.row_union)
            return held
        lo, hi = _merged(ranges)
        return _in_spans(rows, lo, hi)

    def pinned_with(self, start: int = 0, stop: int = 0, rows: np.ndarray | None = None
                    ) -> int:
        """Rows the active ranges and row sets cover together with ``[start, stop)`` and
        the sorted unique ``rows`` (their union)."""
        lo, hi = _merged([*self.ranges, (start, stop)])
        total = int((hi - lo).sum())
        extra = self.row_union if rows is None else _union(self.row_union, rows)
        if extra.shape[0]:
            total += int(np.count_nonzero(~_in_spans(extra, lo, hi)))
        return total

    def _pin_resident(self, rows: np.ndarray) -> None:
        """Pin the slots of the resident ones of ``rows`` that are not pinned yet."""
        slots = self.slots_of(rows)
        slots = slots[slots >= 0]
        slots = slots[self.pin[slots] >= 0]
        self.pin[slots] = RANGE_PIN
        self.range_pinned += slots.shape[0]

    def _unpin_free(self, rows: np.ndarray) -> None:
        """Unpin the resident ones of ``rows`` that no active range or row set holds."""
        sl = self.slots_of(rows)
        res = np.flatnonzero(sl >= 0)
        slots = sl[res]
        free = (self.pin[slots] < 0) & ~self.in_ranges(rows[res])
        self.pin[slots[free]] = 0
        self.range_pinned -= int(np.count_nonzero(free))

    def pin_range(self, start: int, stop: int) -> None:
        """``[start, stop)`` becomes active: its resident rows are pinned from now on, and so
        are its rows that become resident, until :meth:`unpin_range`."""
        self.ranges.append((start, stop))
        self._pin_resident(np.arange(start, stop, dtype=np.int64))

    def unpin_range(self, start: int, stop: int) -> None:
        """``[start, stop)`` is released: the active range equal to it (else every active
        range inside it) ends; its rows that no other active range or row set holds are
        unpinned."""
        if (start, stop) in self.ranges:
            self.ranges.remove((start, stop))
        else:
            self.ranges = [(lo, hi) for lo, hi in self.ranges if not start <= lo <= hi <= stop]
        self._unpin_free(np.arange(start, stop, dtype=np.int64))

    def pin_rows(self, rows: np.ndarray) -> None:
        """The sorted unique ``rows`` become an active row set: pinned like a range's rows
        (resident ones now, the others as they become resident) until :meth:`unpin_rows`."""
        self.row_sets.append(rows)
        self.row_union = _union(self.row_union, rows)
        self._pin_resident(rows)

    def unpin_rows(self, rows: np.ndarray) -> list[np.ndarray]:
        """The sorted unique ``rows`` are released: the active row set equal to them (else
        every active row set inside them) ends; their rows that no other active range or row
        set holds are unpinned. Returns the row sets that ended."""
        same = [n for n, r in enumerate(self.row_sets) if np.array_equal(r, rows)]
        if same:
            ended = [same[0]]
        else:
            ended = [n for n, r in enumerate(self.row_sets)
                     if r.shape[0] and _in_sorted(r, rows).all()]
        gone = [self.row_sets[n] for n in ended]
        self.row_sets = [r for n, r in enumerate(self.row_sets) if n not in ended]
        self.row_union = (np.unique(np.concatenate(self.row_sets)) if self.row_sets
                          else _NO_ROWS)
        self._unpin_free(rows)
        return gone

    def drop_range_pins(self) -> None:
        """Unpin every slot (the ranges stay active: rows read later are pinned again)."""
        held = self.pin < 0
        self.pin[held] = 0
        self.range_pinned = 0
        self.stats["range_pins_dropped"] += 1

    def install_loaded(self, rows: np.ndarray, locs: np.ndarray, records: np.ndarray,
                       make_room: Callable[[int, int], None]) -> int:
        """Put the records read ahead for an active range into free slots, clean and pinned.

        ``records[i]`` is the record that lay at location ``locs[i]`` of ``rows[i]`` (0: its
        initial record) when it was read. A row is installed only if it is in an active
        range and not resident; one that still lies at ``locs[i]`` takes ``records[i]``,
        one that moved meanwhile (a seal, the cleaner) is read again from where it lies now:
        no resident record (maybe dirty) is overwritten, none goes stale. Returns the rows
        installed; fewer than asked when the free and unpinned slots run out (the rest are
        read when a step needs them).
        """
        if not rows.shape[0]:
            return 0
        want = np.flatnonzero(~self.resident(rows) & self.in_ranges(rows))
        if not want.shape[0]:
            return 0
        need = want.shape[0]
        if need > self.nfree:
            room = self.slots - self.range_pinned
            if room > self.nfree:
                self.epoch += 1  # pins nothing: a new epoch no slot carries
                make_room(min(need, room), self.range_pinned)
            # making room seals and may clean: rows can have moved (never become resident)
            want = want[:self.nfree]
            need = want.shape[0]
            if not need:
                return 0
        r = rows[want]
        now = self.index.get(r)
        top = self.nfree
        slots = self.free[top - need:top][::-1].copy()
        same = now == locs[want]
        moved = np.flatnonzero(~same)
        if moved.shape[0]:  # an error here (a damaged record) changes nothing: the slots
            ondisk = moved[now[moved] > 0]  # are still on the free stack
            self.segments.read_into(now[ondisk], self.region, slots[ondisk])
            fresh = moved[now[moved] == 0]
            self.initial_into(r[fresh], self.region, slots[fresh])
        keep = np.flatnonzero(same)
        self.region[slots[keep]] = records[want[keep]]
        self.nfree = top - need
        self.slot_row[slots] = r
        self.slot_loc[slots] = now
        _insert(self.table, r, slots)
        self.dirty[slots] = 0
        self.ref[slots] = 1
        self.pin[slots] = RANGE_PIN
        self.range_pinned += need
        st = self.stats
        st["range_records"] += need
        st["range_rereads"] += moved.shape[0]
        return need

    # -- a reader's commit log ----------------------------------------------------------------
    def install(self, rows: np.ndarray, records: np.ndarray) -> None:
        """Put ``records`` of ``rows`` (unique) into the region, dirty, taking free slots for
        the rows not resident yet (a read-only open's commit-log entries: nothing is
        written)."""
        n = rows.shape[0]
        if not n:
            return
        slots = self.slots_of(rows)
        new = slots < 0
        k = int(np.count_nonzero(new))
        if k > self.nfree:  # the writer reused the file meanwhile: read again
            raise SegmentError(f"commit log of {str(self.path)!r} changed while it was read")
        fresh = self.free[self.nfree - k:self.nfree][::-1].copy()
        self.nfree -= k
        slots[new] = fresh
        self.slot_row[fresh] = rows[new]
        self.slot_loc[fresh] = -1  # a reader's: never sealed
        _insert(self.table, rows[new], fresh)
        self.region[slots] = records
        self.dirty[slots] = 1

    # -- checking -----------------------------------------------------------------------------
    def verify(self) -> tuple[list[str], bool]:
        """Residency (``table`` <-> ``slot_row``) and the free-slot stack must agree: returns
        the problems found and whether the locations can be checked further (not when a row
        is resident past the region; the segments' part is ``recovery.verify``'s)."""
        problems: list[str] = []
        S = self.slots
        keyed = self.table[:, 0] >= 0
        resident, rslot = self.table[keyed, 0], self.table[keyed, 1]
        bad = (rslot >= S) | (rslot < 0)
        if bad.any():
            problems.append(f"rows {resident[bad][:5].tolist()} are resident in slots "
                            f"past the region ({S})")
            return problems, False
        if resident.shape[0] > 1 and np.unique(resident).shape[0] != resident.shape[0]:
            problems.append("rows are resident in two slots at once")
        wrong = self.slot_row[rslot] != resident
        if wrong.any():
            problems.append(f"rows {resident[wrong][:5].tolist()} are resident in slots that "
                            "hold other rows")
        used = np.flatnonzero(self.slot_row >= 0)
        back = self.slots_of(self.slot_row[used]) != used
        if back.any():
            problems.append(f"slots {used[back][:5].tolist()} hold rows whose location is "
                            "elsewhere")
        free = np.sort(self.free[:self.nfree])
        if not np.array_equal(free, np.flatnonzero(self.slot_row < 0)):
            problems.append("the free-slot stack does not list exactly the unused slots")
        if self.dirty[self.slot_row < 0].any():
            problems.append("free slots are marked dirty")
        known = used[self.slot_loc[used] >= 0]
        stale = self.slot_loc[known] != self.index.get(self.slot_row[known])
        if stale.any():
            problems.append(f"slots {known[stale][:5].tolist()} remember on-disk locations "
                            "their rows' index does not hold")
        held = self.pin < 0
        if int(np.count_nonzero(held)) != self.range_pinned or (self.slot_row[held] < 0).any():
            problems.append(f"{int(np.count_nonzero(held))} slots are pinned by loaded ranges "
                            f"(some free?), {self.range_pinned} counted")
        return problems, True
