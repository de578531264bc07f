"""Where each row's newest on-disk record lies: a log store's row index.

A location is ``((segment_id << 32) | k) + 1`` for record ``k`` of a segment, 0 for a row
never written (it reads as its initial record, ``_init``). Whether a row is resident is not
the index's business (``resident``): a row keeps its location while it is in the region.

Two parts, read through one lookup (:func:`loc_of`, for the kernels; :meth:`RowIndex.get`):

``base``
    dense: ``(num_rows,)`` int64, the locations of every row; an empty array stands for all
    0. Sparse (a mapped base file that lists its rows, ``format.write_index``): its pages
    flat, each the ids of 256 rows ascending then their locations, with ``fence`` (in
    memory) the first row of each page: a lookup finds the page by the fence and the row in
    it (:func:`loc_of`); a row not listed is at 0.
``delta``
    a map row -> location (``resident``'s table, its values locations) of the rows whose
    location changed since the base was written, kept only while the base is read-only.

Two ways to hold the base (``budget``: which one ``memory=`` pays for):

in memory
    an array (``np.zeros``, or the base file read whole and checked at open) that changes
    in place: :meth:`RowIndex.set` writes it, the delta stays empty. 8 bytes per row.
mapped (*paged*)
    the base file mapped read-only (``format.map_index``: page cache, read as rows are
    looked up); each 4 KiB page is checked against its sum the first time a lookup reads
    it. Changes go to the delta, which holds at most ``capacity`` rows: a seal that would
    pass it first writes a new base file of base and delta together
    (``commit.Commit.rebase``) and maps that. Memory: the delta (32 bytes per entry), the
    sums (8 bytes per 512 rows) and a bit per page, whatever the number of rows.

**A mapped base's pages are read ahead, not faulted one by one.** Looking up a batch's rows
in a base whose pages are not in the page cache would fault them in one at a time (queue
depth one: ~19k reads/s on this machine's drive, against ~90k at depth 32 and more), once
before each miss's record read. :meth:`RowIndex.hint` hands the pages a set of rows needs,
those ``mincore`` finds uncached, to the kernel with ``madvise(MADV_WILLNEED)`` (queued,
not waited for), as ``read`` does for records; :meth:`RowIndex.get` does so before it
looks up, so that the lookups wait for reads already in flight all at once; the engine's
read-ahead (``dsa_core.prefetch``) hints a batch's index pages one call before it looks up
that batch's records (``LogEngine._read_ahead``). A hint never changes a value.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .._intrinsics import prefetch_line_addr
from .._os import MADV_WILLNEED, PAGE, madvise_addr, mincore_addr
from .format import INDEX_PAGE_ENTRIES, INDEX_PAGE_ROWS, check_pages, dense_entries, sparse_rows
from .resident import AHEAD, LOAD, MIN_ENTRIES, find_one, prefetch_home, probe

__all__ = ["HINT_SAMPLE", "RowIndex", "loc_of", "locs_of"]

HINT_SAMPLE = 16  # pages probed with mincore before deciding whether to look at them all
_PAGE_BYTES = 8 * INDEX_PAGE_ROWS  # an index page (4 KiB)
_PAGE_ROWS, _PAGE_ENTRIES = INDEX_PAGE_ROWS, INDEX_PAGE_ENTRIES  # numba: module constants
_NO_FENCE = np.zeros(0, np.int64)


@njit(cache=True, nogil=True)
def _listed(base, fence, row):
    """The location a sparse base (its pages flat, ``fence`` their first rows) lists for
    ``row``, 0 if none: the page by the fence (in memory), the row by its page."""
    lo, hi = 0, fence.shape[0]  # the last page whose first row <= row
    while lo < hi:
        mid = (lo + hi) >> 1
        if fence[mid] <= row:
            lo = mid + 1
        else:
            hi = mid
    if lo == 0:
        return 0
    o = (lo - 1) * _PAGE_ROWS
    a, b = o, o + _PAGE_ENTRIES
    while a < b:
        mid = (a + b) >> 1
        if base[mid] < row:
            a = mid + 1
        else:
            b = mid
    if a < o + _PAGE_ENTRIES and base[a] == row:
        return base[a + _PAGE_ENTRIES]
    return 0


@njit(cache=True, nogil=True)
def loc_of(base, fence, delta, row):
    """The location of ``row``: its delta entry, else its base entry (0 without a base):
    ``base[row]`` of a dense base, what a sparse one (``fence`` not empty) lists."""
    v = find_one(delta, row)
    if v >= 0:
        return v
    if fence.shape[0]:
        return _listed(base, fence, row)
    if base.shape[0]:
        return base[row]
    return 0


@njit(cache=True, nogil=True, inline="always")
def prefetch_loc(base, fence, delta, row):
    """Hint that :func:`loc_of` will soon read ``row``'s entries: its delta entry and, for a
    dense base, its base entry (each one cache miss; no fault, no effect beyond the cache)."""
    prefetch_home(delta, row)
    if fence.shape[0] == 0 and base.shape[0] > 0:
        prefetch_line_addr(base.ctypes.data + row * base.strides[0])


@njit(cache=True, nogil=True)
def locs_of(base, fence, delta, rows, out):
    """``out[i]`` = the location of ``rows[i]``; the entries of the row ``AHEAD`` on are
    prefetched (:func:`prefetch_loc`)."""
    m = rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            prefetch_loc(base, fence, delta, rows[k + AHEAD])
        out[k] = loc_of(base, fence, delta, rows[k])


@njit(cache=True, nogil=True)
def _upsert(delta, rows, locs):
    """Set the delta entry of each of ``rows`` to ``locs``; returns the new entries made."""
    made = 0
    m = rows.shape[0]
    for k in range(m):
        if k + AHEAD < m:
            prefetch_home(delta, rows[k + AHEAD])
        i = probe(delta, rows[k])
        if delta[i, 0] != rows[k]:
            delta[i, 0] = rows[k]
            made += 1
        delta[i, 1] = locs[k]
    return made


# Not cache=True: the ctypes function addresses are baked into the machine code and change from
# process to process (ASLR), so a cached build would call a stale address.
@njit(nogil=True)
def _uncached_pages(addr0, pages, vec, advise):
    """How many of the index pages ``pages`` (sorted page numbers of a base mapped at
    ``addr0``) are not in the page cache; with ``advise``, each of them is also handed to
    ``madvise(MADV_WILLNEED)`` (its read queued, not waited for). ``vec``: one byte, the
    ``mincore`` result."""
    ptr = vec.ctypes.data
    mask = ~np.int64(PAGE - 1)
    n = 0
    last = np.int64(-1)
    for i in range(pages.shape[0]):
        a = (addr0 + pages[i] * _PAGE_BYTES) & mask  # the OS page holding it
        if a == last:
            continue
        last = a
        if mincore_addr(a, PAGE, ptr) != 0 or not (vec[0] & 1):
            n += 1
            if advise:
                madvise_addr(a, PAGE, MADV_WILLNEED)
    return n


def _overlay(rows, locs, drows, dlocs):
    """The sorted entries ``rows``/``locs`` with the sorted ``drows``/``dlocs`` over them (a
    row in both takes its ``dlocs`` location)."""
    r = np.concatenate([rows, drows])
    v = np.concatenate([locs, dlocs])
    o = np.argsort(r, kind="stable")  # a base entry before the delta's of its row
    r, v = r[o], v[o]
    last = np.ones(r.shape[0], bool)
    last[:-1] = r[1:] != r[:-1]
    return r[last], v[last]


def _table(entries: int) -> np.ndarray:
    return np.full((max(MIN_ENTRIES, LOAD * int(entries)), 2), -1, np.int64)


class RowIndex:
    """The row index of one open store (module docstring)."""

    def __init__(self, num_rows: int, capacity: int | None = None):
        self.num_rows = int(num_rows)
        self.base = np.zeros(self.num_rows, np.int64)  # anonymous: untouched pages cost 0
        self.delta = _table(0)
        self.entries = 0  # rows in the delta
        self.capacity = capacity  # rows the delta may hold (mapped); None: no bound
        self.path = None          # the mapped base file
        self.pages = self.sums = self.checked = None  # mapped: pages, their sums, checked
        self.fence = _NO_FENCE    # a sparse base: each page's first row (else empty)
        self.page_reads = 0  # mapped: index pages hinted because they were not cached
        self._vec = np.zeros(1, np.uint8)

    @property
    def mapped(self) -> bool:
        """Whether the base is a read-only mapping of its file (the delta takes changes)."""
        return self.pages is not None

    # -- lookups ---------------------------------------------------------------------------
    def _idle(self, rows: np.ndarray) -> bool:
        """No page to read or check for ``rows``: an index in memory, a mapped one without
        a base file yet, or no rows."""
        return self.checked is None or not rows.shape[0] or not self.base.shape[0]

    def hint(self, rows: np.ndarray) -> int:
        """Queue the reads of the mapped base's pages that ``rows`` (checked ids) need and the
        page cache lacks (``madvise(MADV_WILLNEED)``; nothing is waited for); returns their
        number. Nothing to do for an index in memory, or when a sample of
        :data:`HINT_SAMPLE` of the pages is cached (a hot set: a few syscalls per batch)."""
        if self._idle(rows):
            return 0
        return self._hint_pages(np.unique(self._pages_of(rows)))

    def _pages_of(self, rows: np.ndarray) -> np.ndarray:
        """The pages of the mapped base that hold ``rows`` (or would list them: sparse)."""
        if not self.fence.shape[0]:
            return rows // INDEX_PAGE_ROWS
        p = np.searchsorted(self.fence, rows, "right") - 1
        return p[p >= 0]

    def _hint_pages(self, pages: np.ndarray) -> int:
        """:meth:`hint` for the sorted unique index pages ``pages``."""
        addr0 = self.pages.ctypes.data
        if pages.shape[0] > HINT_SAMPLE:
            pick = pages[np.linspace(0, pages.shape[0] - 1, HINT_SAMPLE).astype(np.int64)]
            if not _uncached_pages(addr0, pick, self._vec, False):
                return 0
        n = int(_uncached_pages(addr0, pages, self._vec, True))
        self.page_reads += n
        return n

    def prepare(self, rows: np.ndarray) -> None:
        """Before looking up ``rows`` (checked int64 ids) in the base directly (the kernels
        of ``cleaner``): their pages read ahead (:meth:`hint`) and checked
        (:meth:`check_rows`), the pages found once for both."""
        if self._idle(rows):
            return
        pages = np.unique(self._pages_of(rows))
        self._hint_pages(pages)
        self._check_pages(pages)

    def check_rows(self, rows: np.ndarray) -> None:
        """Check the mapped base's pages that ``rows`` need and no lookup has checked yet
        against their sums (each page once per open); raise ``ValueError`` on damage."""
        if self._idle(rows):
            return
        p = self._pages_of(rows)
        self._check_pages(np.unique(p[~self.checked[p]]))

    def _check_pages(self, pages: np.ndarray) -> None:
        """:meth:`check_rows` for the sorted unique index pages ``pages``."""
        p = pages[~self.checked[pages]]
        if not p.shape[0]:
            return
        check_pages(self.path, p, self.pages[p], self.sums, self.fence, self.num_rows)
        self.checked[p] = True

    def get(self, rows: np.ndarray) -> np.ndarray:
        """The location of each of ``rows`` (checked int64 ids)."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        self.prepare(rows)
        out = np.empty(rows.shape[0], np.int64)
        locs_of(self.base, self.fence, self.delta, rows, out)
        return out

    def located(self, piece: int):
        """Every row with a location and its location, ``(rows, locations)`` in ascending
        row order, in pieces of about ``piece`` rows' bytes of locations (what a base file
        is written from: ``format.write_index``): the base's, each overridden by its delta
        entry, and the delta's other rows. A mapped base is read a span of pages at a time
        (read ahead whole, checked); only a dense base costs a scan of every row."""
        keyed = self.delta[:, 0] >= 0
        order = np.argsort(self.delta[keyed, 0], kind="stable")
        drows, dlocs = self.delta[keyed, 0][order], self.delta[keyed, 1][order]
        piece = max(1, int(piece) // 2)  # an entry is 16 bytes where a location was 8
        if not self.base.shape[0]:  # no base: the delta is the index
            for a in range(0, drows.shape[0], piece):
                yield drows[a:a + piece], dlocs[a:a + piece]
            return
        sparse = self.fence.shape[0] > 0
        npages = self.pages.shape[0] if self.mapped else 0
        step = max(1, piece // (INDEX_PAGE_ENTRIES if sparse else INDEX_PAGE_ROWS))
        spans = range(0, npages, step) if self.mapped else range(0, self.num_rows, piece)
        for lo in spans:
            if self.mapped:
                p1 = min(npages, lo + step)
                a = (self.pages.ctypes.data + lo * _PAGE_BYTES) & ~(PAGE - 1)
                madvise_addr(a, self.pages.ctypes.data + p1 * _PAGE_BYTES - a, MADV_WILLNEED)
                self._check_pages(np.arange(lo, p1, dtype=np.int64))
                got = self.pages[lo:p1]
                if sparse:
                    r0 = int(self.fence[lo]) if lo else 0
                    r1 = int(self.fence[p1]) if p1 < npages else self.num_rows
                    rows, locs = sparse_rows(self.path, got, self.num_rows)
                else:
                    r0, r1 = lo * INDEX_PAGE_ROWS, min(self.num_rows, p1 * INDEX_PAGE_ROWS)
                    rows, locs = dense_entries(got.reshape(-1)[:r1 - r0], r0)
            else:  # in memory: changes in place, the delta is empty
                r0, r1 = lo, min(self.num_rows, lo + piece)
                rows, locs = dense_entries(self.base[r0:r1], r0)
            a, b = np.searchsorted(drows, [r0, r1])
            if a < b:
                rows, locs = _overlay(rows, locs, drows[a:b], dlocs[a:b])
            yield rows, locs

    def all(self) -> np.ndarray:
        """Every row's location, as one array (checks)."""
        return self.get(np.arange(self.num_rows, dtype=np.int64))

    # -- changes ---------------------------------------------------------------------------
    def set(self, rows: np.ndarray, locs: np.ndarray) -> None:
        """Rows ``rows`` (unique) now lie at ``locs``."""
        rows = np.ascontiguousarray(rows, dtype=np.int64)
        if not rows.shape[0]:
            return
        if self.base.flags.writeable and self.base.shape[0]:
            self.base[rows] = locs
            return
        need = self.entries + rows.shape[0]
        if LOAD * need > self.delta.shape[0]:  # grow: at most half full
            self._regrow(max(need, 2 * self.entries))
        self.entries += _upsert(self.delta, rows, np.ascontiguousarray(locs, np.int64))

    def _regrow(self, entries: int) -> None:
        old = self.delta
        self.delta = _table(entries)
        keyed = old[:, 0] >= 0
        self.entries = _upsert(self.delta, old[keyed, 0].copy(), old[keyed, 1].copy())

    def full(self, more: int) -> bool:
        """A mapped index whose delta would pass its capacity with ``more`` rows."""
        return (self.mapped and self.capacity is not None
                and self.entries + int(more) > self.capacity)

    def adopt(self, base: np.ndarray) -> None:
        """Take ``base`` (checked: every row's location, writable) as the base, in memory,
        with an empty delta (an open)."""
        self.base = base
        self.fence = _NO_FENCE
        self.delta = _table(0)
        self.entries = 0
        self.path = self.pages = self.sums = self.checked = None

    def map(self, path, pages: np.ndarray, sums: np.ndarray, fence: np.ndarray) -> None:
        """Take the mapped base file ``path`` (``format.map_index``: its pages, sums and, if
        sparse, fence) as the base, with an empty delta (an open, or after a rebase wrote
        it)."""
        self.base = pages.reshape(-1) if fence.shape[0] else pages.reshape(-1)[:self.num_rows]
        self.fence = np.ascontiguousarray(fence, np.int64) if fence.shape[0] else _NO_FENCE
        self.delta = _table(0)
        self.entries = 0
        self.path, self.pages, self.sums = path, pages, sums
        self.checked = np.zeros(pages.shape[0], bool)

    def unmapped(self) -> None:
        """A mapped index without a base file yet: every row at 0 but for the delta."""
        self.base = np.zeros(0, np.int64)
        self.fence = _NO_FENCE
        self.delta = _table(0)
        self.entries = 0
        self.path = None
        self.pages = np.zeros((0, INDEX_PAGE_ROWS), np.int64)
        self.sums = np.zeros(0, np.uint64)
        self.checked = np.zeros(0, bool)

    def memory_bytes(self) -> int:
        """Anonymous memory the index holds now (the mapped base's pages are page cache)."""
        own = self.delta.nbytes
        if self.mapped:
            return own + self.sums.nbytes + self.checked.nbytes + self.fence.nbytes
        return own + self.base.nbytes
