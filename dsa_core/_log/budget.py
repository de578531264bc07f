"""The memory budget of a log store: what ``memory_bytes`` pays for, and the region it leaves.

``memory_bytes`` (``memory=``) is all the anonymous memory the store's data takes, not only
its region. It is split, for a region of ``S`` slots and seal unit ``u`` records
(``u = min(S // 8, SEAL_BYTES // record bytes)``, at least 1), into:

``index``
    where each row's newest record lies (``index.RowIndex``). While its 8 bytes per row
    take at most half of ``memory_bytes`` it is in memory, 8 bytes per row (a flush writes
    a base in pieces, ``Pool.disk_location_chunks``, not as a second whole array: a piece
    of :func:`index_piece_rows` rows fits in the staging share, which no seal uses while a
    flush writes it; at open the base is read before any slot of the region has been
    touched, so the open's own copies fit in the region's share). Past that (a table of
    more rows than ``memory_bytes / 16``) the index is *mapped* (:func:`index_mapped`):
    half of ``memory_bytes`` pays for the mapped base's page sums and checked bits (8 bytes
    + 1 bit per 512 rows) and a delta of :func:`delta_capacity` rows (32 bytes each), and
    the base's pages are page cache, not charged (reclaimable).
``region``
    ``S * (record bytes + SLOT_OVERHEAD)``: the slots' records and their bookkeeping
    (``SLOT_OVERHEAD = 74``: five int64 and two uint8 arrays per slot, ``pool``, and the
    resident map's 32 bytes per slot, ``resident``).
``write_buffers``
    ``WRITE_BUFFERS`` buffers of ``BEHIND_UNITS * u`` records each: a seal up to that size is
    gathered into a buffer and written in the background (``writer``); the segment table
    holds at most ``WRITE_BUFFERS`` of them, written, being written or spare (``segments``).
    A larger seal (a flush, a range release, a large batch's eviction) is streamed to its
    file instead, from the region in chunks.
``cleaning_buffers``
    what the cleaner's reads (``read.CleaningReads``) may hold, :func:`cleaning_limits`:
    ``held`` = ``CLEAN_BUFFERS * whole`` bytes of buffers of the victims' live records (and
    their record numbers, 8 bytes each), read ahead or read by a seal (``whole`` = ``min(WHOLE_MAX, BEHIND_UNITS * u * record bytes)``:
    a victim with more live bytes than that is copied through its mapping, page cache, which
    is not charged: it is reclaimable), plus ``CLEAN_REQUESTS`` request buffers of
    ``request`` bytes (``min(CLEAN_READ_BYTES, whole // 8)`` in whole records, at least one:
    the reading thread's, for a request with dead records between live ones, and a seal's
    own read). At most 64 + 2 x 4 MiB.
``staging``
    what a seal allocates besides: one chunk of a streamed seal (``STAGING_CHUNK``, or the
    region if smaller) and ``SEAL_META`` bytes per record of a written-behind seal (its row
    ids, steps, new locations, the file's rows/steps part). Seals lay their records out as
    the segment file holds them, each followed by its sums (``sums.record_pitch``: 16-23
    bytes more per record), so the write buffers and a streamed chunk are charged that. A flush
    writes the index in pieces of at most that size (:func:`index_piece_rows`). (Misses are
    copied straight into place through one record of scratch: ``segments.read_into``.)

Who keeps to it, each from the same function here: the segment table holds at most
``WRITE_BUFFERS`` write buffers of ``behind_records(u)`` records (``segments``);
``commit`` writes behind only seals of at most ``Segments.behind_bytes`` (larger ones are
streamed in ``STAGING_CHUNK`` pieces) and copies cleaned records straight into the seal's
buffer; the cleaner gives its reads the ``held`` and ``request`` of
:func:`cleaning_limits` (``cleaner.Cleaner``), and ``CleaningReads`` refuses a read that
would hold more (the victim is then copied through its mapping).

:func:`split` gives the parts for a budget, :func:`slots_for` the slots ``S`` (the largest
region whose parts all fit), :func:`memory_for` the smallest budget whose region holds a
batch (``S >= batch``), and :func:`check_memory` the error a too-small budget raises: what
must hold, what came, and the budget (or the batch) that would work. Not charged: the
interpreter and the libraries, the page cache of the segment files (reclaimable), and the
caller's own arrays (a batch's ids and gradients).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._paging import memory_limit
from .sums import record_pitch

__all__ = ["BEHIND_UNITS", "CLEAN_BUFFERS", "CLEAN_READ_BYTES", "CLEAN_REQUESTS",
           "DELTA_ENTRY", "INDEX_BYTES", "MIN_DELTA", "SEAL_BYTES", "SEAL_META",
           "SLOT_OVERHEAD", "delta_capacity", "index_mapped",
           "STAGING_CHUNK", "WHOLE_MAX", "WRITE_BUFFERS", "behind_records", "check_memory",

           "check_memory_bytes", "cleaning_limits", "describe", "index_piece_rows",
           "memory_for",
           "seal_unit_for", "slots_for", "split"]

SLOT_OVERHEAD = 74       # bytes per slot besides its record: see the module docstring
DELTA_ENTRY = 32         # bytes per row of a mapped index's delta (``index``: 2 entries)
MIN_DELTA = 4096         # rows a mapped index's delta holds at least
SEAL_BYTES = 32 << 20    # a seal unit holds at most this many bytes of records
INDEX_BYTES = 8          # per row: ``loc`` (a flush writes the index in pieces)
BEHIND_UNITS = 2         # a seal of at most this many seal units is written behind
WRITE_BUFFERS = 2        # seal buffers held at once (= writer.DEPTH: written or spare)
CLEAN_BUFFERS = 2        # victims' buffers of the largest size (whole) the cleaning reads hold
WHOLE_MAX = 32 << 20     # live bytes of a victim read into a buffer at most (else mapped)
CLEAN_READ_BYTES = 4 << 20  # one cleaning read request at most (the disk's queue: steps first)
CLEAN_REQUESTS = 2       # request buffers: the reading thread's and a seal's own read
STAGING_CHUNK = 8 << 20  # records per pwrite of a streamed seal (commit's chunk)
SEAL_META = 64           # bytes per record of a seal besides its record (module docstring)


def _rec_bytes(layout: dict[str, Any]) -> int:
    return int(layout["stride"]) * np.dtype(layout["dtype"]).itemsize


def _flat_index(layout: dict[str, Any]) -> int:
    return INDEX_BYTES * int(layout.get("num_rows", 0))


def _mapped_floor(layout: dict[str, Any]) -> int:
    """The smallest budget whose half pays for a mapped index with ``MIN_DELTA`` rows."""
    return 2 * (_mapped_fixed(layout) + MIN_DELTA * DELTA_ENTRY)


def index_mapped(layout: dict[str, Any], memory_bytes: int) -> bool:
    """Whether a store of ``layout`` with ``memory_bytes`` keeps its index mapped: its 8
    bytes per row would take more than half the budget, and half the budget pays for a
    delta of at least ``MIN_DELTA`` rows (else the index is in memory, as it fits or not)."""
    m = int(memory_bytes)
    return 2 * _flat_index(layout) > m >= _mapped_floor(layout)


def _mapped_fixed(layout: dict[str, Any]) -> int:
    """A mapped index's bytes besides its delta: a sum and a checked flag per page."""
    pages = -(-int(layout.get("num_rows", 0)) // 512)
    return 9 * pages


def delta_capacity(layout: dict[str, Any], memory_bytes: int) -> int:
    """Rows the delta of a mapped index holds with ``memory_bytes`` (0: not mapped)."""
    if not index_mapped(layout, memory_bytes):
        return 0
    return max(0, (int(memory_bytes) // 2 - _mapped_fixed(layout)) // DELTA_ENTRY)


def _index_bytes(layout: dict[str, Any], memory_bytes: int) -> int:
    """The index's part of ``memory_bytes`` (module docstring)."""
    if index_mapped(layout, memory_bytes):
        return int(memory_bytes) // 2
    return _flat_index(layout)


def seal_unit_for(slots: int, rec_bytes: int) -> int:
    """Records per seal: ``min(slots // 8, SEAL_BYTES of segment file)`` (each record there
    followed by its sums: ``sums.record_pitch``), at least 1."""
    return max(1, min(slots // 8, SEAL_BYTES // record_pitch(rec_bytes)))


def behind_records(seal_unit: int) -> int:
    """The largest seal (records) gathered into a buffer and written in the background."""
    return BEHIND_UNITS * int(seal_unit)


def index_piece_rows(slots: int, rec_bytes: int) -> int:
    """Rows per piece of the index a flush writes: 8 bytes each, within a seal's staging
    chunk (``min(STAGING_CHUNK, slots * rec_bytes)``, ``split``), at least one."""
    return max(1, min(STAGING_CHUNK, int(slots) * int(rec_bytes)) // 8)


def cleaning_limits(seal_unit: int, rec_bytes: int) -> dict[str, int]:
    """What the cleaning reads of a store with seal unit ``seal_unit`` may hold, in bytes:
    ``whole`` (a victim's live records read into one buffer at most), ``held`` (all the
    buffers of the reads), ``request`` (one read request, whole records) and ``total``
    (``held + CLEAN_REQUESTS * request``, the ``cleaning_buffers`` part of :func:`split`).

    Records are read as the segment file holds them, each followed by its sums
    (``sums.record_pitch``: ``rec_bytes`` 128 -> 144 bytes).

    >>> cleaning_limits(1 << 20, 128)  # a large store: 2 x 32 MiB, requests of 4 MiB
    {'whole': 33554432, 'held': 67108864, 'request': 4194288, 'total': 75497440}
    >>> cleaning_limits(10, 96)  # a small one: two write buffers' worth, requests of 1 record
    {'whole': 2240, 'held': 4480, 'request': 224, 'total': 4928}
    """
    rb = record_pitch(int(rec_bytes))
    whole = min(WHOLE_MAX, behind_records(seal_unit) * rb)
    request = max(1, min(CLEAN_READ_BYTES, whole // 8) // rb) * rb
    held = CLEAN_BUFFERS * whole
    return {"whole": whole, "held": held, "request": request,
            "total": held + CLEAN_REQUESTS * request}


def split(layout: dict[str, Any], memory_bytes: int, slots: int | None = None
          ) -> dict[str, int]:
    """The parts of ``memory_bytes`` (module docstring), in bytes, for the largest region
    they allow (or for ``slots`` slots): ``index``, ``region``, ``write_buffers``,
    ``cleaning_buffers``, ``staging``, ``total`` (their sum, at most ``memory_bytes`` when
    ``slots`` is not given), ``slots`` and ``seal_unit`` (records)."""
    S = slots_for(layout, memory_bytes) if slots is None else int(slots)
    parts = {"index": _index_bytes(layout, memory_bytes) if memory_bytes else
             _flat_index(layout), **_rest_parts(layout, S)}
    parts["total"] = sum(parts.values())
    parts["slots"], parts["seal_unit"] = S, seal_unit_for(S, _rec_bytes(layout))
    return parts


def _rest_parts(layout: dict[str, Any], S: int) -> dict[str, int]:
    """The parts besides the index, for a region of ``S`` slots."""
    rb = _rec_bytes(layout)
    pitch = record_pitch(rb)  # a record as a seal writes it: with its sums after it
    u = seal_unit_for(S, rb)
    behind = behind_records(u) * pitch
    return {"region": S * (rb + SLOT_OVERHEAD),
             "write_buffers": WRITE_BUFFERS * behind,
             "cleaning_buffers": cleaning_limits(u, rb)["total"],
             "staging": min(STAGING_CHUNK, S * pitch) + SEAL_META * behind_records(u)}


def _rest(layout: dict[str, Any], slots: int) -> int:
    return sum(_rest_parts(layout, slots).values())


def slots_for(layout: dict[str, Any], memory_bytes: int) -> int:
    """Record slots of the region that ``memory_bytes`` pays for: the largest ``S`` whose
    parts (module docstring) add up to at most ``memory_bytes``; 0 if not even one fits
    (or a mapped index's delta would hold fewer than ``MIN_DELTA`` rows)."""
    m = int(memory_bytes)
    avail = m - _index_bytes(layout, m)
    lo, hi = 0, max(0, avail) // (_rec_bytes(layout) + SLOT_OVERHEAD) + 1  # rest(hi) > avail
    if _rest(layout, 1) > avail:
        return 0
    lo = 1
    while hi - lo > 1:  # rest(lo) <= avail < rest(hi); rest grows with S
        mid = (lo + hi) // 2
        if _rest(layout, mid) <= avail:
            lo = mid
        else:
            hi = mid
    return lo


def memory_for(layout: dict[str, Any], batch: int) -> int:
    """The smallest ``memory_bytes`` whose region holds ``batch`` records (at least one),
    every other part included: with the index in memory, or mapped when that is smaller
    (the budget left beside the index grows with ``memory_bytes`` either way)."""
    batch = max(1, int(batch))
    rest = _rest(layout, batch)
    flat = _flat_index(layout)
    switch, floor = 2 * flat, _mapped_floor(layout)  # mapped: floor <= m < switch
    cands = [max(switch, flat + rest)]  # in memory past the switch: always enough
    if not floor <= flat + rest < switch:
        cands.append(flat + rest)  # in memory below the mapped range
    mapped = max(2 * rest - 1, floor)  # the budget's other half (rounded up) holds rest
    if mapped < switch:
        cands.append(mapped)
    m = min(cands)
    while slots_for(layout, m) < batch:  # rounding: a few bytes at most
        m += 1
    return m


def _mib(n: int) -> str:
    """``n`` bytes for a reader: MiB, or KiB / bytes when small."""
    if n >= 1 << 20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 1 << 10 else f"{n} bytes"


def describe(parts: dict[str, int]) -> str:
    """One line naming the parts of a :func:`split`."""
    return (f"index {_mib(parts['index'])}, region {_mib(parts['region'])} "
            f"({parts['slots']} slots), write buffers {_mib(parts['write_buffers'])}, "
            f"cleaning buffers {_mib(parts['cleaning_buffers'])}, seal staging "
            f"{_mib(parts['staging'])}")


def check_memory(layout: dict[str, Any], memory_bytes: int, batch: int) -> None:
    """Raise ``ValueError`` unless a region of ``memory_bytes`` holds a batch of ``batch`` rows.

    >>> lay = {"num_rows": 100, "stride": 12, "dtype": "float32"}
    >>> need = memory_for(lay, 10)
    >>> check_memory(lay, need, 10)
    >>> check_memory(lay, need - 1, 10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: memory budget holds 9 records, a batch needs 10: raise the budget (memory=) to at
    least 3428 bytes (3.3 KiB), or pass batches of at most 9 rows. memory=3427 (3.3 KiB) ...
    """
    have = slots_for(layout, memory_bytes)
    if batch > have:
        need = memory_for(layout, batch)
        rows = int(layout.get("num_rows", 0))
        raise ValueError(
            f"memory budget holds {have} records, a batch needs {batch}: raise the budget "
            f"(memory=) to at least {need} bytes ({_mib(need)})"
            + (f", or pass batches of at most {have} rows" if have else
               " (this budget holds no record at all)")
            + f". memory={int(memory_bytes)} ({_mib(int(memory_bytes))}) covers "
            f"everything the store keeps in memory, its region of one slot per row of a "
            f"batch and the rest; at {need} bytes: {describe(split(layout, need))} (the "
            f"index: {INDEX_BYTES} bytes per row of the table's {rows} while that is at most "
            f"half the budget, else half the budget, mapped; the write and the "
            f"cleaning buffers grow with the region, up to "
            f"{_mib(WRITE_BUFFERS * BEHIND_UNITS * SEAL_BYTES)} and "
            f"{_mib(CLEAN_BUFFERS * WHOLE_MAX + CLEAN_REQUESTS * CLEAN_READ_BYTES)})")


def check_memory_bytes(memory_bytes: Any, layout: dict[str, Any]) -> int:
    """``memory_bytes`` as an int, or a clear error unless it is an int that pays for the
    index, the buffers and at least one slot (the smallest budget that works)."""
    if isinstance(memory_bytes, (bool, np.bool_)) or not isinstance(memory_bytes,
                                                                    (int, np.integer)):
        raise TypeError(f"memory_bytes must be an int (bytes of memory the store may take), "
                        f"got {type(memory_bytes).__name__}")
    need = memory_for(layout, 1)
    if memory_bytes < need:
        raise ValueError(f"memory_bytes must pay for the index and at least one record slot, "
                         f"with its buffers: at least {need} bytes ({_mib(need)}), the "
                         "smallest budget that works for this table "
                         f"({describe(split(layout, need))}; "
                         f"{INDEX_BYTES} bytes per row of the table for the index (or half "
                         "the budget, mapped, when that is less), a "
                         f"{_rec_bytes(layout)}-byte record + {SLOT_OVERHEAD} bytes per slot), "
                         f"got {memory_bytes}; give the store more memory")
    return int(memory_bytes)


DEFAULT_MEMORY_SHARE = 0.25  # of _paging.memory_limit(): the default region budget
MIN_BATCH_ROWS = 4096        # the default budget always holds a batch of this many rows


def default_memory(layout: dict[str, Any]) -> int:
    """The default region budget of a log store, in bytes.

    ``DEFAULT_MEMORY_SHARE`` (25%) of the memory this process may use
    (``_paging.memory_limit()``: physical memory, capped by its cgroup), but never more than
    the whole table needs (one slot per row) and never less than a batch of
    ``MIN_BATCH_ROWS`` (4096) rows needs (or the whole table, if smaller).
    """
    n = int(layout["num_rows"])
    share = int(DEFAULT_MEMORY_SHARE * memory_limit())
    whole = memory_for(layout, n)
    floor = memory_for(layout, min(MIN_BATCH_ROWS, n))
    return max(floor, min(share, whole))
