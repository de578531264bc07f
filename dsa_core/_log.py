"""The engine of a log-structured store: records in immutable segments, a region in memory.

The in-place store (``_store``) updates each row where it lies in one big mapped file: once
the dirty rows exceed the kernel's write-back budget, or the table exceeds RAM, every
updated row costs a random read and later a random 4 KiB write-back. This engine keeps the
same records (``_layout``: ``[w | m | v | counters]``) but never overwrites one on disk:

* updates happen in place in an in-memory **region** of ``S`` record slots;
* a slot leaving the region while dirty is appended, with many others, to a new immutable
  **segment** file in one sequential write (a *seal*);
* an **index** maps each row to the newest record of it in a segment (or to nothing: the
  row then reads as its deterministic initial record, ``_init``);
* a **cleaner** copies the still-live records of the emptiest segments into the next seal so
  that the segments hold at most ``space_ratio`` times the live records;
* a **flush** seals every dirty slot, fsyncs the new segments, writes a new index generation
  and commits a new manifest (``_log_format`` describes the files).

It is an internal module: ``dsa_core.create/step/gather`` do not use it yet. The intended
use by ``step``: coalesce the batch's ids as today, ``slots = eng.acquire(unique_rows)``,
run today's kernels on ``eng.region`` with ``slots`` in place of the row ids (the kernels
only index records by the ids they are given), then ``eng.count = t``.

In memory
    ``region`` (S, stride) records, anonymous memory (``np.zeros``: faulted in on first use,
    never written back behind our back). ``loc`` (num_rows,) int64: ``< 0`` means resident
    in slot ``-loc - 1``; ``>= 0`` is the row's location on disk as in the index file.
    Per slot: ``slot_row`` (-1 when free), ``slot_disk`` (the location of the row's newest
    on-disk record, 0 if none; it may be older than the slot when the slot is dirty),
    ``dirty``, a CLOCK reference bit, the pin and seal marks of the current call, and the
    free-slot stack.
Memory budget
    The budget pays for ``loc`` (8 bytes per row of the table) first, then for the slots:
    ``S = (memory_bytes - 8 * num_rows) // (stride * itemsize + SLOT_OVERHEAD)`` with
    ``SLOT_OVERHEAD = 42`` bytes (five int64 and two uint8 arrays per slot). On top of the
    budget: per segment a few counters and its read-only mapping (page cache,
    reclaimable), and during a seal the records of one write chunk (at most 8 MiB) plus a
    few int64 per sealed record (row ids, steps, locations). A batch of ``M`` rows needs
    ``S >= M``: :func:`check_memory` (called by :func:`create` and :func:`open` with
    ``max_batch``, and by every :meth:`acquire`) says by how much to raise the budget.
Eviction and seals
    :meth:`acquire` makes the rows of a batch resident. When the free slots do not cover its
    misses, CLOCK (second chance) picks victims among the slots not used by this call until
    ``misses + seal_unit`` slots are free (``seal_unit = min(S // 8, 32 MiB of records)``,
    at least 1): clean victims are dropped (their row's location is their ``slot_disk``),
    dirty ones are sealed together as one new segment, after which their rows point at it.
    So each seal is one large sequential write of about ``seal_unit`` records.
Cleaning
    A record is live when its row's location (``loc``, or the ``slot_disk`` of a resident
    row) points at it. Every seal first checks the space bound: when the records of all
    segments would exceed ``space_ratio`` times the rows that have a location, the segments
    with the lowest live fraction are cleaned: their live records join the seal unchanged
    (a resident row's newest record comes from its slot) until the bound holds or
    ``2 * max(seal_unit, records sealed)`` records have moved (the last segment is taken
    whole), so that no single seal stalls for long; the next seal continues. A segment whose
    records are all dead is dropped at once; its *file* goes at once if no manifest lists it,
    else right after the next manifest that no longer lists it is committed, so a crash
    before that reopens the previous flush intact.
Durability
    Only :meth:`flush` (and :meth:`checkpoint`, :meth:`close`) make anything durable: unlike
    the in-place store, whose mapped pages reach the file even without a flush, updates since
    the last flush live in the region only and are gone if the process ends without one. After
    ``kill -9`` at any moment :func:`open` returns exactly the state of the last completed
    flush: segments and index generations that no manifest lists are removed, and the files
    of the last manifest are never modified nor deleted before a newer manifest is durable.
Deterministic init
    A never-written row reads as ``_init.initial_records``: a pure function of
    ``(seed, row)``, the same bits on every machine, and the values the in-place store
    writes at create for the same arguments.
Concurrency
    No background threads in this stage: seals and cleaning run synchronously inside
    :meth:`acquire` and :meth:`flush`, so no read can see a half-moved record. One writer
    per store (an exclusive ``flock`` on ``writer.lock`` in ``mode="r+"``); readers
    (``mode="r"``) map the files of the manifest they read and never write.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
from numba import njit

from ._coalesce import _dedup, bounds, gather_rows
from ._files import copy_file, fsync_dir, staged_dir
from ._log_format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSION_WAL,
    LOCK_FILE,
    MANIFEST_FILE,
    MAX_SEGMENT_ID,
    Segment,
    SegmentError,
    segment_geometry,
    check_segment,
    crash_point,
    index_name,
    map_segment,
    parse_name,
    read_index,
    read_manifest,
    seg_name,
    write_index,
    write_manifest,
    write_segment,
)
from ._init import INIT_KINDS, InitSpec, initial_records
from ._log_read import WHOLE_MAX, CleaningReads, advise_whole, hint_uncached
from ._log_writer import DEPTH, SegmentWriter, WriteJob
from ._log_wal import WalWriter, read_entries, wal_bound, wal_name
from ._paging import memory_limit
from ._pool import run_chunked
from ._store import StoreLockedError

__all__ = ["SLOT_OVERHEAD", "LogEngine", "check_memory", "create", "memory_for", "open",
           "slots_for"]

SLOT_OVERHEAD = 42       # bytes per slot besides its record: see the module docstring
SEAL_BYTES = 32 << 20    # a seal unit holds at most this many bytes of records
CLEAN_UNITS = 2          # a seal copies at most this many seal units of records for cleaning
# seals up to this size (its records, the cleaning copies, the last cleaned segment taken
# whole) are written in the background; larger ones (a flush, a range release) at once
BEHIND_BYTES = (2 + CLEAN_UNITS) * SEAL_BYTES
# written segments whose pages stay in the page cache (the newest, as one window): this share
# of the memory the process may use (_paging.memory_limit, cgroup-aware); older ones are
# dropped (_log_writer)
CACHE_SHARE = 0.125
_CHUNK_BYTES = 8 << 20   # records per pwrite of a seal
_LOCK_TRIES, _LOCK_WAIT_S = 5, 0.01
_LOW32 = np.int64(0xFFFFFFFF)
# write counters kept over the store's life (committed with every flush, "totals")
_TOTALS = ("seals", "cleaned_segments", "user_records", "sealed_records", "cleaned_records",
           "file_bytes_written")


# -- the memory budget ----------------------------------------------------------------------
def _rec_bytes(layout: dict[str, Any]) -> int:
    return int(layout["stride"]) * np.dtype(layout["dtype"]).itemsize


def _index_bytes(layout: dict[str, Any]) -> int:
    """The in-memory index (``loc``): 8 bytes per row of the table, paid from the budget."""
    return 8 * int(layout.get("num_rows", 0))


def slots_for(layout: dict[str, Any], memory_bytes: int) -> int:
    """Record slots of the region that ``memory_bytes`` pays for (see the module docstring)."""
    return max(0, int(memory_bytes) - _index_bytes(layout)) // (_rec_bytes(layout)
                                                                + SLOT_OVERHEAD)


def memory_for(layout: dict[str, Any], batch: int) -> int:
    """The smallest ``memory_bytes`` whose region holds ``batch`` records (with the index)."""
    return int(batch) * (_rec_bytes(layout) + SLOT_OVERHEAD) + _index_bytes(layout)


def check_memory(layout: dict[str, Any], memory_bytes: int, batch: int) -> None:
    """Raise ``ValueError`` unless a region of ``memory_bytes`` holds a batch of ``batch`` rows.

    >>> lay = {"num_rows": 100, "stride": 12, "dtype": "float32"}
    >>> check_memory(lay, 800 + 90 * 10, 10)
    >>> check_memory(lay, 900, 10)
    Traceback (most recent call last):
    ...
    ValueError: memory budget holds 1 records, a batch needs 10: raise the budget (memory=)
    to at least 1700 bytes (0.00 MiB: 90 bytes per record slot, plus 800 for the index of
    the table's 100 rows)
    """
    have, per = slots_for(layout, memory_bytes), _rec_bytes(layout) + SLOT_OVERHEAD
    if batch > have:
        need = memory_for(layout, batch)
        raise ValueError(f"memory budget holds {have} records, a batch needs {batch}: raise "
                         f"the budget (memory=) to at least {need} bytes ({need / 2**20:.2f} "
                         f"MiB: {per} bytes per record slot, plus {_index_bytes(layout)} for "
                         f"the index of the table's {int(layout.get('num_rows', 0))} rows)")


def _check_memory_bytes(memory_bytes: Any, layout: dict[str, Any]) -> int:
    if isinstance(memory_bytes, (bool, np.bool_)) or not isinstance(memory_bytes,
                                                                    (int, np.integer)):
        raise TypeError(f"memory_bytes must be an int (bytes of the in-memory region), got "
                        f"{type(memory_bytes).__name__}")
    need = memory_for(layout, 1)
    if memory_bytes < need:
        raise ValueError(f"memory_bytes must pay for the index and at least one record slot "
                         f"({need} bytes: 8 per row of the table, a {_rec_bytes(layout)}-byte "
                         f"record + {SLOT_OVERHEAD} bytes of bookkeeping), got "
                         f"{memory_bytes}; give the store more memory")
    return int(memory_bytes)


# -- numba kernels ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _evict(target, hand, slot_row, slot_disk, ref, dirty, pin, epoch, mark, ep, loc, free,
           nfree, victims):
    """CLOCK until ``nfree + victims >= target``; returns ``(hand, nfree, n_victims)``.

    Slots pinned by this call (``pin == epoch``) or already chosen (``mark == ep``) are
    skipped; a referenced slot loses its bit and is passed over once. A clean victim is freed
    at once (its row points at its on-disk record again); a dirty one is marked ``ep`` and
    returned in ``victims`` for the seal. ``n_victims < 0``: the target cannot be met (the
    caller asked for more than the unpinned slots), nothing more was chosen.
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
        if r < 0 or pin[s] == epoch or mark[s] == ep:
            continue
        if ref[s]:
            ref[s] = 0
            continue
        if dirty[s]:
            mark[s] = ep
            victims[nv] = s
            nv += 1
        else:
            loc[r] = slot_disk[s]
            slot_row[s] = -1
            free[nfree] = s
            nfree += 1
    return hand, nfree, nv


def gather_records(src: np.ndarray, idx: np.ndarray, out: np.ndarray) -> None:
    """``out[:len(idx)] = src[idx]`` for whole records, on the kernel pool: a gather of
    random records is bound by memory latency, which the prefetching gather of
    ``_coalesce`` hides (32k records of 1 KiB: np.take 22 ms, this 3-4 ms on 2 threads)."""
    run_chunked(gather_rows, (src, idx, 0, out[:idx.shape[0]]), idx.shape[0], 1024)


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


@njit(cache=True, nogil=True)
def _disk_index(loc, slot_disk, out):
    """The on-disk location of every row: ``loc``, or the ``slot_disk`` of a resident row."""
    for r in range(loc.shape[0]):
        lr = loc[r]
        out[r] = lr if lr >= 0 else slot_disk[-lr - 1]


# -- argument checks ---------------------------------------------------------------------------
def _check_layout(layout: Any) -> dict[str, Any]:
    need = ("num_rows", "dim", "dtype", "stride", "w")
    if not isinstance(layout, dict) or any(k not in layout for k in need):
        raise ValueError(f"layout must be a record layout dict (dsa_core._layout.make_layout) "
                         f"with the keys {need}, got {layout!r}")
    if np.dtype(layout["dtype"]) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"layout dtype must be float32 or float64, got {layout['dtype']!r}")
    if int(layout["num_rows"]) < 1 or int(layout["stride"]) < 1:
        raise ValueError(f"layout must have num_rows >= 1 and stride >= 1, got "
                         f"{layout['num_rows']} and {layout['stride']}")
    return dict(layout)


def _check_rows(rows: Any, num_rows: int, name: str = "rows") -> np.ndarray:
    arr = np.asarray(rows)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row ids, got dtype {arr.dtype}; convert "
                        f"with {name}.astype(np.int64)")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}; flatten it with "
                         f"{name}.reshape(-1)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.shape[0]:
        lo, hi = bounds(arr)
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name} must lie in [0, num_rows) = [0, {num_rows}); got {bad} "
                             f"(min {lo}, max {hi})")
    return arr


def _check_meta(meta: Any) -> dict[str, Any]:
    """A JSON round-trip copy of ``meta`` (a dict), or a clear error before anything is
    written."""
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict (stored in the manifest), got "
                        f"{type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable (it is stored in the manifest): "
                        f"{exc}") from None


def _check_count(count: Any) -> int:
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) \
            or count < 0:
        raise ValueError(f"count must be an int >= 0 (the number of completed steps), got "
                         f"{count!r}")
    return int(count)


def _lock(directory: Path) -> int:
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    for attempt in range(_LOCK_TRIES):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if attempt + 1 < _LOCK_TRIES:
                time.sleep(_LOCK_WAIT_S)
    os.close(fd)
    raise StoreLockedError(
        f"log store {str(directory)!r} is already open for writing (by this or another "
        "process); a store has one writer at a time. Close the other engine or open this one "
        "read-only with mode='r'")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link ``src`` as ``dst`` (immutable files: the link is a snapshot); copy where the
    filesystem refuses links (another device, no link support, too many links)."""
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP,
                             errno.EOPNOTSUPP, errno.EACCES):
            raise
        copy_file(src, dst)


# -- the engine ---------------------------------------------------------------------------------
class LogEngine:
    """An open log-structured store: the region, the index, the mapped segments.

    Obtain one with :func:`create` or :func:`open`. Attributes used by callers: ``region``
    (S, stride) records that :meth:`acquire`'s slots index, ``count`` (the step count that
    seals record and :meth:`flush` commits; set it after each step), ``meta`` (a JSON-able
    dict committed with every flush: the caller's hyperparameters), ``layout``,
    ``num_rows``, ``stride``, ``dtype``, ``slots`` (S), ``seal_unit``, ``mode``, ``closed``.
    """

    def __init__(self, directory: Path, manifest: dict[str, Any], mode: str,
                 memory_bytes: int | None, lockfd: int):
        self.path = Path(directory)
        self.mode = mode
        self.closed = False
        self._lockfd = lockfd
        lay = self.layout = dict(manifest["layout"])
        self.num_rows = int(lay["num_rows"])
        self.stride = int(lay["stride"])
        self.dtype = np.dtype(lay["dtype"])
        self.rec_bytes = self.stride * self.dtype.itemsize
        self.count = int(manifest["count"])
        self.meta = dict(manifest.get("meta", {}))
        self.space_ratio = float(manifest["space_ratio"])
        mn = manifest["ball_maxnorm"]
        self.init = InitSpec(str(manifest["init"]), float(manifest["init_scale"]),
                             int(manifest["seed"]), None if mn is None else float(mn),
                             int(lay["dim"]), lay["w"], self.stride, self.dtype)
        S = 0 if memory_bytes is None else slots_for(lay, memory_bytes)
        self.memory_bytes = memory_bytes
        self.slots = S
        self.seal_unit = max(1, min(S // 8, SEAL_BYTES // self.rec_bytes))
        # anonymous memory; numpy advises large allocations MADV_HUGEPAGE (2 MiB pages where
        # the kernel allows: a first touch fills 2 MiB, and fewer TLB misses)
        self.region = np.zeros((S, self.stride), self.dtype)
        self.slot_row = np.full(S, -1, np.int64)
        self.slot_disk = np.zeros(S, np.int64)
        self._pin = np.zeros(S, np.int64)
        self._mark = np.zeros(S, np.int64)
        self._free = np.arange(S - 1, -1, -1, dtype=np.int64)  # a stack: pops take slot 0 first
        self._nfree = S
        self.dirty = np.zeros(S, np.uint8)
        self._ref = np.zeros(S, np.uint8)
        self._hand = 0
        self._epoch = 0       # one per acquire: pins
        self._seal_epoch = 0  # one per seal: marks the slots going into it
        self.loc = np.zeros(self.num_rows, np.int64)
        self.segs: dict[int, Segment] = {}          # live segments (>= 1 live record), mapped
        self._live = np.zeros(16, np.int64)         # live records per segment id
        self._seg_n = np.zeros(16, np.int64)        # records per segment id
        self._seg_addr = np.zeros(16, np.int64)     # address of its mapped records, 0: none
        self.total_records = 0                      # records of the live segments
        self.live_total = 0                         # rows with an on-disk location
        self._committed: set[int] = set()           # segments the last manifest lists
        self._doomed: set[int] = set()              # of those, dead: delete after next commit
        self._unsynced: set[int] = set()            # written since the last flush
        self._pending: dict[int, WriteJob] = {}     # segments still being written (_log_writer)
        self._writer: SegmentWriter | None = None
        self._clean_reads: CleaningReads | None = None  # segments read whole for cleaning
        self._next_clean: list[int] = []  # the next seal's cleaning candidates, read ahead
        self._spare: list[np.ndarray] = []          # seal buffers to reuse (no page faults)
        self.next_segment = int(manifest["next_segment"])
        # no index file (None): no row has been written yet, every row reads as its initial
        # record (create writes nothing of size num_rows: O(1))
        kind = ("index", 0) if manifest["index"] is None else parse_name(str(manifest["index"]))
        if kind is None or kind[0] != "index":
            raise ValueError(f"manifest of {str(directory)!r} names the index "
                             f"{manifest['index']!r}, not an index-<gen>.bin file; the store "
                             "is damaged")
        self._gen = kind[1]
        self._manifest = dict(manifest)             # the last committed manifest
        self._index_dirty = False                   # disk locations changed since the flush
        self._stats = dict.fromkeys(("seals", "cleaned_segments", "user_records",
                                     "sealed_records", "cleaned_records", "file_bytes_written",
                                     "acquires", "misses", "evicted_clean"), 0)
        # the write counters of earlier writers, committed by their flushes (see stats())
        self._totals_base = {k: int(manifest.get("totals", {}).get(k, 0)) for k in _TOTALS}
        # the commit log (durability="step"; _log_wal, and step_ready & co. below)
        wal = manifest.get("wal")
        wkind = None if wal is None else parse_name(str(wal))
        if wal is not None and (wkind is None or wkind[0] != "wal"
                                or not isinstance(manifest.get("wal_salt"), int)):
            raise ValueError(f"manifest of {str(directory)!r} names the commit log {wal!r} "
                             f"(salt {manifest.get('wal_salt')!r}), not a wal-<gen>.log file "
                             "with an int salt; the store is damaged")
        self.wal_on = wal is not None            # flushes start a new commit-log generation
        self.wal_bound = wal_bound(self.num_rows)  # log bytes that make the next step flush
        self._wal: WalWriter | None = None       # the writer's open generation
        self._wal_gen = 0 if wkind is None else wkind[1]
        self._wal_count = self.count             # the count that manifest + log hold
        self._wal_acquires = 0                   # acquire calls that they reflect
        self._wal_spare: Path | None = None      # a retired log file, reused next

    # -- opening helpers ------------------------------------------------------------------
    def _ensure_id(self, seg_id: int) -> None:
        if seg_id >= self._live.shape[0]:
            size = max(2 * self._live.shape[0], seg_id + 1)
            for name in ("_live", "_seg_n", "_seg_addr"):
                old = getattr(self, name)
                new = np.zeros(size, np.int64)
                new[:old.shape[0]] = old
                setattr(self, name, new)

    def _map(self, path: Path, sid: int, n: int) -> None:
        """Map segment ``sid`` (``n`` records) and note where its records start."""
        seg = self.segs[sid] = map_segment(path, sid, n, self.stride, self.dtype)
        self._seg_addr[sid] = seg.records.__array_interface__["data"][0]

    def _load(self, manifest: dict[str, Any], full_check: bool) -> None:
        """Check and map the manifest's segments, load its index, count live records."""
        listed = [int(s) for s in manifest["segments"]]
        ns = {}
        for sid in listed:
            if not 0 < sid < self.next_segment:
                raise ValueError(f"manifest of {str(self.path)!r} lists segment {sid} outside "
                                 f"[1, next_segment={self.next_segment}); the store is damaged")
            ns[sid] = check_segment(self.path / seg_name(sid), sid, self.stride,
                                    self.dtype.itemsize, self.num_rows, full_check)
        index = np.zeros(self.num_rows, np.int64) if manifest["index"] is None else \
            read_index(self.path / manifest["index"], self.num_rows, manifest.get("index_crc32"))
        self._ensure_id(self.next_segment)
        used = index[index > 0] - 1
        sids, ks = used >> 32, used & _LOW32
        problems = []
        if (index < 0).any():
            problems.append(f"rows {np.flatnonzero(index < 0)[:5].tolist()} have negative "
                            "locations")
        known = np.zeros(self._live.shape[0], bool)
        known[list(ns)] = True
        outside = (sids >= known.shape[0]) | ~known[np.minimum(sids, known.shape[0] - 1)]
        if outside.any():
            rows = np.flatnonzero(index > 0)[outside][:5].tolist()
            problems.append(f"rows {rows} point at segments the manifest does not list")
        for sid, n in ns.items():
            self._seg_n[sid] = n
        if not problems and ks.shape[0] and (ks >= self._seg_n[sids]).any():
            rows = np.flatnonzero(index > 0)[ks >= self._seg_n[sids]][:5].tolist()
            problems.append(f"rows {rows} point past the end of their segments")
        if problems:
            raise ValueError(f"index {manifest['index']!r} of log store {str(self.path)!r} does "
                             f"not match its segments: {'; '.join(problems)}; restore the store "
                             "from a checkpoint")
        live = np.bincount(sids, minlength=self._live.shape[0]) if sids.shape[0] else \
            np.zeros(self._live.shape[0], np.int64)
        self._live[:] = live[:self._live.shape[0]]
        self.loc = index
        self.live_total = int(used.shape[0])
        self._committed = set(ns)
        for sid, n in ns.items():
            if self._live[sid] > 0:
                self._map(self.path / seg_name(sid), sid, n)
                self.total_records += n
            else:  # listed but dead (an older writer's choice): goes at the next flush
                self._doomed.add(sid)
        bad = self._check_rows_of_records(index)
        if bad:
            raise ValueError(f"index {manifest['index']!r} of log store {str(self.path)!r} "
                             f"does not match its segments: {bad[0]}; restore the store from a "
                             "checkpoint")

    def _check_rows_of_records(self, disk: np.ndarray) -> list[str]:
        """Each located row's record must carry that row's id (one pass per segment)."""
        problems = []
        rows = np.flatnonzero(disk > 0)
        used = disk[rows] - 1
        order = np.argsort(used, kind="stable")
        used, rows = used[order], rows[order]
        sids = used >> 32
        cuts = np.flatnonzero(sids[1:] != sids[:-1]) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), sids.shape[0]], strict=True):
            if a == b:
                continue
            sid = int(sids[a])
            seg = self.segs.get(sid)
            if seg is None:
                problems.append(f"rows {rows[a:b][:5].tolist()} point at segment {sid}, which "
                                "has no live mapping")
                continue
            ks = used[a:b] & _LOW32
            if (ks >= seg.n).any():
                problems.append(f"rows {rows[a:b][ks >= seg.n][:5].tolist()} point past the end "
                                f"of segment {sid} ({seg.n} records)")
                continue
            wrong = seg.rows[ks] != rows[a:b]
            if wrong.any():
                i = int(np.flatnonzero(wrong)[0])
                problems.append(f"row {int(rows[a + i])} points at record {int(ks[i])} of "
                                f"segment {sid}, which holds row {int(seg.rows[ks[i]])}")
        return problems

    # -- guards ---------------------------------------------------------------------------
    def _require_open(self) -> None:
        if self.closed:
            raise ValueError(f"log store {str(self.path)!r} is closed; reopen it with "
                             "dsa_core._log.open(path, memory_bytes=...)")

    def _require_writable(self) -> None:
        self._require_open()
        if self.mode != "r+":
            raise ValueError(f"log store {str(self.path)!r} was opened read-only (mode='r'); "
                             "open it with mode='r+' to change it")

    def check_batch(self, batch: int) -> None:
        """Raise ``ValueError`` unless the region holds a batch of ``batch`` rows."""
        check_memory(self.layout, self.memory_bytes or 0, int(batch))

    # -- reading ----------------------------------------------------------------------------
    def _read_disk(self, locs: np.ndarray, out: np.ndarray, out_idx: np.ndarray,
                   cols: slice = slice(None)) -> None:
        """``out[out_idx[i]] = record at locs[i]`` (locations > 0; columns ``cols``), one pass
        per segment in record order."""
        if not locs.shape[0]:
            return
        order = np.argsort(locs, kind="stable")
        used = locs[order] - 1
        sids = used >> 32
        ks = used & _LOW32
        # queue the reads of records not in the page cache all at once (queue depth), then
        # copy: the copy waits only for reads already in flight (_log_read)
        hint_uncached(self._seg_addr[sids] + ks * self.rec_bytes, self.rec_bytes)
        cuts = np.flatnonzero(sids[1:] != sids[:-1]) + 1
        for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), sids.shape[0]], strict=True):
            sid = int(sids[a])
            seg = self.segs.get(sid)
            if seg is None:  # pragma: no cover - an engine bug: verify() would report it
                raise RuntimeError(f"log store {str(self.path)!r}: a location points at "
                                   f"segment {sid}, which is not live; run verify()")
            out[out_idx[order[a:b]]] = seg.records[ks[a:b], cols]

    def readahead(self, rows: np.ndarray) -> tuple[np.ndarray, list[Segment]]:
        """Where the on-disk records of ``rows`` (checked ids) lie, for read-ahead.

        Returns ``(addresses, segments)``: the mapped address of the newest record of each
        row that is neither resident nor never written, and the segments they lie in (hold
        them while the hint runs: their mappings stay valid). A hint only (``_log_read``):
        a row that moves or becomes resident afterwards is still read correctly.
        """
        self._require_open()
        lr = self.loc[rows]
        used = lr[lr > 0] - 1
        sids = used >> 32
        addrs = self._seg_addr[sids] + (used & _LOW32) * self.rec_bytes
        keep = [self.segs[int(s)] for s in np.unique(sids)]
        return addrs, keep

    def _initial_into(self, rows: np.ndarray, out: np.ndarray, out_idx: np.ndarray,
                      cols: slice = slice(None)) -> None:
        if not rows.shape[0]:
            return
        if self.init.kind == "zeros" or self.init.w_off is None:
            out[out_idx] = 0
        else:
            out[out_idx] = initial_records(rows, self.init)[:, cols]

    def read(self, rows: Any, cols: slice | None = None) -> np.ndarray:
        """A copy of the records of ``rows``: shape ``(len(rows), stride)``, store dtype.

        Any rows, duplicates allowed. Resident rows come from the region, others from their
        segment's mapping or, never written, as their initial record. Residency is not
        changed (for gather and export). ``cols``: a ``slice`` of record columns to copy
        (e.g. the weights ``slice(w, w + dim)`` for gather); the result then has that many
        columns.
        """
        self._require_open()
        rows = _check_rows(rows, self.num_rows)
        if cols is None:
            cols = slice(None)
        if not isinstance(cols, slice) or cols.step not in (None, 1):
            raise ValueError(f"cols must be a slice of record columns with step 1, got {cols!r}")
        width = len(range(*cols.indices(self.stride)))
        n = rows.shape[0]
        out = np.empty((n, width), self.dtype)
        lr = self.loc[rows]
        res = lr < 0
        if res.any():
            out[res] = self.region[-lr[res] - 1, cols]
        disk = np.flatnonzero(lr > 0)
        self._read_disk(lr[disk], out, disk, cols)
        never = np.flatnonzero(lr == 0)
        self._initial_into(rows[never], out, never, cols)
        return out

    # -- acquiring ----------------------------------------------------------------------------
    def acquire(self, rows: Any, *, load: bool = True, check: bool = True) -> np.ndarray:
        """Make ``rows`` resident and dirty; returns their slots (``region[slots[i]]`` is the
        record of ``rows[i]``, to be updated in place by the caller).

        Parameters
        ----------
        rows : 1-D int array
            Unique row ids (any order), at most ``slots`` of them.
        load : bool, default True
            ``False`` leaves the records of rows that were not resident undefined: for a
            caller that overwrites them whole (:meth:`write`).
        check : bool, default True
            ``False`` skips the range and uniqueness checks (the caller guarantees them,
            e.g. ``step`` after coalescing). The batch size is always checked.

        Misses are read from their segment (or initialised); making room may evict and seal
        other rows, never one of ``rows``. The returned array is the caller's.
        """
        self._require_writable()
        if check:
            rows = _check_rows(rows, self.num_rows)
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
        self._epoch += 1
        lr = self.loc[rows]
        hit = lr < 0
        hslots = -lr[hit] - 1
        slots[hit] = hslots
        self._pin[hslots] = self._epoch
        miss = np.flatnonzero(~hit)
        need = miss.shape[0]
        if need > self._nfree:
            self._make_room(need, n - need)
        mrows = rows[miss]
        old = self.loc[mrows]  # read again: cleaning during the seal may have moved them
        top = self._nfree
        mslots = self._free[top - need:top][::-1].copy()
        self._nfree = top - need
        if load:
            ondisk = np.flatnonzero(old > 0)
            self._read_disk(old[ondisk], self.region, mslots[ondisk])
            fresh = np.flatnonzero(old == 0)
            self._initial_into(mrows[fresh], self.region, mslots[fresh])
        self.slot_row[mslots] = mrows
        self.slot_disk[mslots] = old
        self.loc[mrows] = -mslots - 1
        slots[miss] = mslots
        self._ref[slots] = 1
        self.dirty[slots] = 1  # last: a seal inside this call may have cleaned a hit
        st = self._stats
        st["acquires"] += 1
        st["user_records"] += n
        st["misses"] += need
        return slots

    def write(self, rows: Any, records: Any) -> None:
        """Overwrite the whole records of ``rows`` (unique ids) with ``records``.

        ``records``: shape ``(len(rows), stride)`` in the store dtype. Checked before anything
        changes; goes through :meth:`acquire` in chunks of at most ``slots`` rows, without
        reading the old records. Durable at the next flush.
        """
        self._require_writable()
        rows = _check_rows(rows, self.num_rows)
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
            slots = self.acquire(rows[lo:lo + self.slots], load=False, check=False)
            self.region[slots] = rec[lo:lo + self.slots]

    # -- eviction, seals, cleaning ---------------------------------------------------------------
    def _make_room(self, need: int, pinned: int) -> None:
        target = min(need + self.seal_unit, self.slots - pinned)
        self._seal_epoch += 1
        ep = self._seal_epoch
        victims = np.empty(max(target, 1), np.int64)
        before = self._nfree
        self._hand, self._nfree, nv = _evict(
            target, self._hand, self.slot_row, self.slot_disk, self._ref, self.dirty,
            self._pin, self._epoch, self._mark, ep, self.loc, self._free, self._nfree,
            victims)
        if nv < 0:  # pragma: no cover - acquire checks the batch against the region first
            raise RuntimeError(f"log store {str(self.path)!r}: eviction could not free "
                               f"{target} slots of {self.slots} ({pinned} pinned)")
        self._stats["evicted_clean"] += self._nfree - before
        if nv:
            self._seal(victims[:nv].copy(), evict=True, ep=ep)

    def _choose_cleaning(self, n_seal: int, n_new_loc: int, ep: int):
        """The segments to clean in this seal: ``(resident slots, [(seg, ks), ...])``."""
        self._next_clean = []
        live_after = self.live_total + n_new_loc
        excess = self.total_records + n_seal - self.space_ratio * live_after
        res: list[np.ndarray] = []
        copies: list[tuple[Segment, np.ndarray]] = []
        if excess <= -2 * self.seal_unit or not self.segs:
            return res, copies
        ids = np.fromiter(self.segs, np.int64, len(self.segs))
        frac = self._live[ids] / self._seg_n[ids]
        order = ids[np.argsort(frac, kind="stable")].tolist()
        cap = CLEAN_UNITS * max(self.seal_unit, n_seal)
        moved = 0
        for i, sid in enumerate(order):
            seg = self.segs[sid]
            if excess <= 0 or moved >= cap or self._live[sid] >= seg.n:
                # done (a fully live segment frees nothing, nor any after it). The next
                # seal's candidates are read ahead once this seal is done (_seal), so that
                # its copies find them in memory instead of waiting for the disk
                self._next_clean = [nxt for nxt in order[i:i + max(1, len(copies))]
                                    if self._live[nxt] < self._seg_n[nxt]]
                break
            out_k = np.empty(seg.n, np.int64)
            out_s = np.empty(seg.n, np.int64)
            nk, ns = _scan_segment(seg.rows, np.int64((sid << 32) + 1), self.loc,
                                   self.slot_disk, self._mark, ep, out_k, out_s)
            copies.append((seg, out_k[:nk]))
            res.append(out_s[:ns])
            moved += nk + ns
            excess -= seg.n - (nk + ns)
        return res, copies

    def _seal(self, slots: np.ndarray, evict: bool, ep: int | None = None) -> None:
        """Write the records of ``slots`` (dirty) as one new segment, plus cleaning copies.

        ``evict``: the slots leave the region afterwards (their rows point at the new
        segment); else they stay resident, clean.
        """
        self._settle_writes(block=False)  # raises a failed background write, changing nothing
        if ep is None:
            self._seal_epoch += 1
            ep = self._seal_epoch
        self._mark[slots] = ep
        n_new_loc = int(np.count_nonzero(self.slot_disk[slots] == 0))
        res, copies = self._choose_cleaning(slots.shape[0], n_new_loc, ep)
        if copies:
            crash_point("clean")
        rslots = np.concatenate([slots, *res]) if res else slots
        m = rslots.shape[0]
        crow = [seg.rows[ks] for seg, ks in copies]
        n = m + sum(ks.shape[0] for _, ks in copies)
        if n == 0:
            return
        sid = self.next_segment
        if sid > MAX_SEGMENT_ID:  # pragma: no cover - 2**31 seals
            raise OverflowError(f"log store {str(self.path)!r} ran out of segment ids")
        rows = np.concatenate([self.slot_row[rslots], *crow]) if crow else self.slot_row[rslots]
        steps = np.concatenate([np.full(m, self.count, np.int64),
                                *[seg.steps[ks] for seg, ks in copies]])
        # each cleaned segment read whole, sequentially (read ahead by the previous seal)
        src = [self._read_for_cleaning(seg, now=True) for seg, _ in copies]
        path = self.path / seg_name(sid)
        if n * self.rec_bytes <= BEHIND_BYTES:
            # write-behind (_log_writer): gather the records into a buffer of the segment's
            # own, which serves its reads until the file is written and mapped
            recs = self._seal_buffer(n)
            gather_records(self.region, rslots, recs)
            off = m
            for rec, (_, ks) in zip(src, copies, strict=True):
                recs[off:off + ks.shape[0]] = rec[ks]
                off += ks.shape[0]
            recs.flags.writeable = False  # as the mapping that replaces it
            self._write_behind(WriteJob(path, sid, rows, steps, recs, self.count))
            size = segment_geometry(n, self.stride, self.dtype.itemsize)[3]
            self.segs[sid] = Segment(sid, n, path, rows, steps, recs, size)
            self._seg_addr[sid] = recs.__array_interface__["data"][0]
        else:  # a large seal (a flush, a range release): streamed in chunks, written now
            chunk = max(1, _CHUNK_BYTES // self.rec_bytes)

            def blocks():
                for lo in range(0, m, chunk):
                    yield self.region[rslots[lo:lo + chunk]]
                for rec, (_, ks) in zip(src, copies, strict=True):
                    for lo in range(0, ks.shape[0], chunk):
                        yield rec[ks[lo:lo + chunk]]

            size = write_segment(path, sid, rows, steps, blocks(), self.stride, self.dtype,
                                 self.count)
            self._map(path, sid, n)
        for rec, (seg, _) in zip(src, copies, strict=True):
            if rec is not seg.records:
                self._clean_reads.release(rec)
        self.next_segment = sid + 1
        self._ensure_id(sid + 1)
        self._unsynced.add(sid)
        self._seg_n[sid] = n
        self._live[sid] = n
        self.total_records += n
        self._index_dirty = True
        crash_point("sealed")
        # the old on-disk copies of everything in the seal are dead now
        newloc = np.int64((sid << 32) + 1) + np.arange(n, dtype=np.int64)
        old = [self.slot_disk[rslots]]
        n_user = int(np.count_nonzero(self.dirty[rslots]))
        self.live_total += int(np.count_nonzero(old[0] == 0))
        self.slot_disk[rslots] = newloc[:m]
        self.dirty[rslots] = 0
        off = m
        for (seg, ks), r in zip(copies, crow, strict=True):
            old.append(np.int64((seg.id << 32) + 1) + ks)
            self.loc[r] = newloc[off:off + ks.shape[0]]
            off += ks.shape[0]
        dead = np.concatenate(old)
        dead = dead[dead > 0] - 1
        if dead.shape[0]:
            ids, cnt = np.unique(dead >> 32, return_counts=True)
            self._live[ids] -= cnt
            gone = ids[self._live[ids] == 0].tolist()
            if gone:
                self._drop_segments(gone)
        for seg, _ in copies:  # a cleaned segment has no live record left
            if self._live[seg.id] != 0:  # pragma: no cover - an engine bug
                raise RuntimeError(f"log store {str(self.path)!r}: cleaned segment {seg.id} "
                                   f"still has {self._live[seg.id]} live records")
        if evict:
            self._free_slots(slots)
        for nxt in self._next_clean:  # into the buffers just released
            if nxt in self.segs:
                self._read_for_cleaning(self.segs[nxt], now=False)
        st = self._stats
        st["seals"] += 1
        st["cleaned_segments"] += len(copies)
        st["sealed_records"] += n_user
        st["cleaned_records"] += n - n_user
        st["file_bytes_written"] += size

    def _read_for_cleaning(self, seg: Segment, now: bool) -> np.ndarray | None:
        """The records of ``seg``, which cleaning copies from: read whole into a buffer with
        sequential reads (``now=False``: start that read in the background, for the next
        seal). A pending segment's records are in memory already; one too large for a buffer
        is read through its mapping, with read-ahead (_log_read)."""
        if seg.id in self._pending or seg.records.nbytes > WHOLE_MAX:
            if seg.id not in self._pending:
                advise_whole(seg.records)
            return seg.records
        r = self._clean_reads
        if r is None or r.pid != os.getpid():
            r = self._clean_reads = CleaningReads()
        off = segment_geometry(seg.n, self.stride, self.dtype.itemsize)[2]
        shape = (seg.n, self.stride)
        if now:
            return r.records(seg.id, seg.path, off, shape, self.dtype)
        r.ahead(seg.id, seg.path, off, shape, self.dtype)
        return None

    def _seal_all(self, slots: np.ndarray, evict: bool) -> None:
        """Seal many dirty slots (a flush, a range release) as segments of at most a seal
        unit each, in order: a segment as large as the region would later have to be
        cleaned in one piece, its live records copied in one seal (seconds)."""
        for lo in range(0, slots.shape[0], self.seal_unit):
            self._seal(slots[lo:lo + self.seal_unit], evict=evict)

    def _write_behind(self, job: WriteJob) -> None:
        """Hand ``job`` to this process's writer thread (a forked child writes at once)."""
        w = self._writer
        if w is None or w.pid != os.getpid():
            if w is None:
                w = self._writer = SegmentWriter(
                    cache_bytes=int(CACHE_SHARE * memory_limit()))
            else:  # inherited through fork: its thread is the parent's
                job.run()
                if job.error is not None:
                    raise job.error
                return
        self._pending[job.sid] = w.submit(job)

    def _wait_job(self, job: WriteJob) -> None:
        """Wait for a background write; a writer thread that ended without finishing it (it
        cannot, short of an interpreter bug) is an error, not a hang."""
        while not job.done.wait(1.0):
            w = self._writer
            if w is None or not w.alive:  # pragma: no cover - see the docstring
                raise RuntimeError(
                    f"log store {str(self.path)!r}: the segment writer thread ended before "
                    f"writing segment {job.sid}; abandon this state and open the store again "
                    "(it reopens at its last flush)")

    def _seal_buffer(self, n: int) -> np.ndarray:
        """An ``(n, stride)`` buffer for a background seal: a spare one when it is large
        enough (fresh memory costs a page fault per page, as much as the copy itself)."""
        for i, buf in enumerate(self._spare):
            if buf.shape[0] >= n:
                return self._spare.pop(i)[:n]
        cap = max(n, self.seal_unit + self.seal_unit // 2)
        return np.empty((cap, self.stride), self.dtype)[:n]

    def _reuse(self, records: np.ndarray) -> None:
        """Keep the buffer behind a written segment's records for the next seals."""
        base = records.base if records.base is not None else records
        if len(self._spare) <= DEPTH and isinstance(base, np.ndarray) and base.ndim == 2:
            self._spare.append(base)

    def _stop_threads(self) -> None:
        """Stop this process's writer and cleaning-read threads (a forked child's are its
        parent's: left alone)."""
        w, self._writer = self._writer, None
        if w is not None and w.pid == os.getpid():
            w.close()
        self._pending.clear()
        r, self._clean_reads = self._clean_reads, None
        if r is not None and r.pid == os.getpid():
            r.close()

    def _settle_writes(self, block: bool) -> None:
        """Map the segments whose background writes are done (all of them with ``block``).

        A write that failed is retried here, synchronously, from its buffer; if it fails
        again its error is raised and nothing else changes (the segment stays pending and
        readable: the next seal or flush retries it).
        """
        for sid, job in list(self._pending.items()):
            if not job.done.is_set():
                if not block:
                    continue
                self._wait_job(job)
            if job.error is not None:
                job.run()
                if job.error is not None:
                    raise OSError(f"log store {str(self.path)!r}: writing segment {sid} "
                                  f"failed ({job.error!r}); its records are kept in memory "
                                  "and the next seal or flush tries again") from job.error
            del self._pending[sid]
            seg = self.segs.get(sid)
            if seg is not None and seg.records is job.records:  # still live: map the file
                self._map(job.path, sid, seg.n)
            self._reuse(job.records)

    def _free_slots(self, slots: np.ndarray) -> None:
        """Make clean resident ``slots`` free: their rows point at their on-disk records."""
        self.loc[self.slot_row[slots]] = self.slot_disk[slots]
        self.slot_row[slots] = -1
        self._ref[slots] = 0
        k = slots.shape[0]
        self._free[self._nfree:self._nfree + k] = slots
        self._nfree += k

    def release(self, rows: Any) -> int:
        """Write the resident records of ``rows`` out and make their slots free.

        The dirty ones are sealed together, in row order, in segments of a seal unit (so that a
        later read of the same rows is one sequential read), the clean ones just leave the
        region. For a caller that is done with a range of rows for a while (the bucket
        order's partitions): nothing changes but residency. Returns the rows released.
        """
        self._require_writable()
        rows = np.unique(_check_rows(rows, self.num_rows))
        lr = self.loc[rows]
        slots = -lr[lr < 0] - 1  # in row order
        if not slots.shape[0]:
            return 0
        dirty = self.dirty[slots] != 0
        if dirty.any():
            self._seal_all(slots[dirty], evict=True)
        self._free_slots(slots[~dirty])  # after the seal: cleaning may have moved them
        return int(slots.shape[0])

    def _drop_segments(self, ids: list[int]) -> None:
        """Segments without a live record: unmap; delete the file now if no manifest lists
        it, else after the next commit."""
        for sid in ids:
            seg = self.segs.pop(sid)
            self._seg_addr[sid] = 0
            if self._clean_reads is not None and self._clean_reads.pid == os.getpid():
                self._clean_reads.forget(sid)
            job = self._pending.pop(sid, None)
            if job is not None:  # let its write end before the file goes
                self._wait_job(job)
                self._reuse(job.records)
            self.total_records -= seg.n
            if sid in self._committed:
                self._doomed.add(sid)
            else:
                self._unsynced.discard(sid)
                try:
                    os.unlink(seg.path)
                except FileNotFoundError:  # pragma: no cover
                    pass

    # -- flushing -------------------------------------------------------------------------
    def _disk_locations(self) -> np.ndarray:
        out = np.empty(self.num_rows, np.int64)
        _disk_index(self.loc, self.slot_disk, out)
        return out

    def flush(self, count: int | None = None) -> None:
        """Make everything so far durable, at step ``count`` (default: ``self.count``).

        Seals every dirty slot (segments of a seal unit, with cleaning as any seal), fsyncs the new
        segments, writes the next index generation (fsync'd), starts the next commit-log
        generation when ``wal_on``, commits the manifest, then deletes the previous index
        generation and the segments that no manifest lists any more, and retires the
        previous commit log (kept for reuse while ``wal_on``, else deleted). After a flush
        every slot is clean (and still resident).
        """
        self._require_writable()
        count = self.count if count is None else _check_count(count)
        meta = _check_meta(self.meta)
        self.count = count
        dirty = np.flatnonzero(self.dirty)
        if dirty.shape[0]:
            self._seal_all(dirty, evict=False)
        self._settle_writes(block=True)  # every background write done (or retried) first
        crash_point("flush-sealed")
        if not self._index_dirty and self.count == self._manifest["count"] \
                and meta == self._manifest.get("meta", {}) and not self._wal_rotation_due():
            return
        for sid in sorted(self._unsynced):
            fd = os.open(self.path / seg_name(sid), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._unsynced.clear()
        crash_point("flush-synced")
        manifest = dict(self._manifest)
        gen = self._gen
        if self._index_dirty:
            gen += 1
            manifest["index"] = index_name(gen)
            manifest["index_crc32"] = write_index(self.path / index_name(gen),
                                                  self._disk_locations())
            crash_point("flush-index")
        new_wal = self._start_wal() if self.wal_on else None
        fsync_dir(self.path)  # the new files' names are durable before the manifest is
        manifest.update(totals=self._totals(), count=int(self.count), segments=sorted(self.segs),
                        next_segment=int(self.next_segment), meta=meta)
        _name_wal(manifest, new_wal)
        try:
            write_manifest(self.path, manifest)
        except BaseException:
            if new_wal is not None:  # not named by any manifest: the next generation's file
                new_wal.close()
                self._wal_spare = new_wal.path
            raise
        crash_point("flush-committed")
        old_gen, self._gen = self._gen, gen
        old_wal = self._manifest.get("wal")
        self._manifest = manifest
        self._committed = set(self.segs)
        self._index_dirty = False
        if old_gen != gen:
            (self.path / index_name(old_gen)).unlink(missing_ok=True)
        for sid in sorted(self._doomed):
            (self.path / seg_name(sid)).unlink(missing_ok=True)
            crash_point("flush-deleted")
        self._doomed.clear()
        self._retire_wal(old_wal, new_wal)

    def checkpoint(self, dest, count: int | None = None, *, overwrite: bool = False) -> Path:
        """Flush, then write a snapshot of the flushed state to ``dest``; returns ``dest``.

        The snapshot is built in a temporary directory (hard links to the manifest's
        segments, which are immutable, or copies where links are refused; a copy of the
        index generation and of the manifest) and renamed into place: ``dest`` is complete
        or absent. It opens as a log store with exactly the flushed state and stays valid
        while this store trains, cleans and deletes (those only unlink its own names). It
        names no commit log (everything is in its segments); a writer that opens it starts
        one at its first logged step.
        """
        self._require_writable()
        dest = Path(dest)
        if dest.resolve() == self.path.resolve():
            raise ValueError(f"checkpoint destination {str(dest)!r} is the live store itself; "
                             "choose another directory")
        if dest.exists() and not overwrite:
            raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                                  "overwrite=True to replace it")
        self.flush(count)
        manifest = dict(self._manifest)
        _name_wal(manifest, None)  # flushed: the snapshot needs no commit log
        dest.parent.mkdir(parents=True, exist_ok=True)
        with staged_dir(dest, overwrite) as tmp:
            for sid in manifest["segments"]:
                _link_or_copy(self.path / seg_name(sid), tmp / seg_name(sid))
                crash_point("ckpt-link")
            if manifest["index"] is not None:
                copy_file(self.path / manifest["index"], tmp / manifest["index"])
            write_manifest(tmp, manifest)
            crash_point("ckpt-staged")
        return dest

    # -- the commit log (durability="step") -----------------------------------------------
    # A store that commits every step logs it: begin_step (a flush first, unless the log can
    # take the step), acquire the rows, compute their new records outside the region,
    # commit_step (one append + fdatasync to the commit log, then the region), so the region
    # only ever holds committed steps. Each flush starts a new log generation that its
    # manifest names; open replays the named log's valid entries (_log_wal). After kill -9
    # at any moment, open returns the state after the last step whose entry is in the file:
    # the last step that returned, or the one in flight if its entry was written in full.
    def step_ready(self, count: int, meta: dict[str, Any] | None = None) -> bool:
        """True when step ``count + 1`` may be logged now (:meth:`commit_step`).

        That is: a commit-log generation is open and healthy, ``count`` is the engine's
        count and the last one the manifest plus the log hold, no :meth:`acquire` (hence
        no :meth:`write`, no unlogged step) changed the region since, the log is under
        ``wal_bound`` bytes, and ``meta`` (when given) is the committed one. Then the
        state that a replay rebuilds is exactly the current one, and an entry appended now
        replays onto it.
        """
        w = self._wal
        return (w is not None and not w.broken and self.wal_on
                and self.count == int(count) == self._wal_count
                and self._stats["acquires"] == self._wal_acquires
                and w.offset < self.wal_bound
                and (meta is None or _check_meta(meta) == self._manifest.get("meta", {})))

    def begin_step(self, count: int, meta: dict[str, Any]) -> None:
        """Prepare to log step ``count + 1``: unless :meth:`step_ready`, turn ``wal_on``
        on and flush at ``count`` with ``meta`` (which starts a fresh commit-log
        generation). Nothing of the step has changed yet, so an error here (a failed flush)
        leaves the caller at ``count``.
        """
        self._require_writable()
        if self.step_ready(count, meta):
            return
        self.wal_on = True
        self.meta = meta
        self.flush(count)

    def commit_step(self, t: int, rows: np.ndarray, slots: np.ndarray,
                    records: np.ndarray) -> None:
        """Commit step ``t``: append ``(rows, records)`` to the commit log (one write, one
        fdatasync), then copy ``records`` into ``region[slots]`` and set ``count = t``.

        ``rows``: the step's unique rows, ``slots`` their slots from the :meth:`acquire`
        made after :meth:`begin_step` (the only acquire since), ``records``: their
        C-contiguous new records. On any error (the log's write or sync) the region is left
        as it was and the log marked broken: the next :meth:`begin_step` flushes (a new
        generation), so the failed step is never replayed.
        """
        self._require_writable()
        if self._wal is None or int(t) != self._wal_count + 1 or self.count != self._wal_count:
            raise RuntimeError(f"log store {str(self.path)!r}: commit_step({t}) without "
                               f"begin_step({int(t) - 1}) (the log holds step "
                               f"{self._wal_count}, the engine is at {self.count})")
        self._wal.append(int(t), rows, records)
        if slots.shape[0]:
            self.region[slots] = records
        self.count = self._wal_count = int(t)
        self._wal_acquires = self._stats["acquires"]

    def wal_bytes(self) -> int:
        """Bytes of the open commit-log generation holding entries (0 without one)."""
        return 0 if self._wal is None else self._wal.offset

    def _wal_rotation_due(self) -> bool:
        """A flush must start a new commit-log generation even if nothing else changed."""
        if self.wal_on != (self._manifest.get("wal") is not None):
            return True
        w = self._wal
        return self.wal_on and (w is None or w.broken or w.offset > 0)

    def _start_wal(self) -> WalWriter:
        """The next generation's file, empty for readers (a fresh salt); not yet named."""
        path = self.path / wal_name(self._wal_gen + 1)
        spare, self._wal_spare = self._wal_spare, None
        w = WalWriter.start(path, int.from_bytes(os.urandom(8), "little"), self.stride,
                            self.dtype, recycle=spare)
        crash_point("wal-started")
        return w

    def _retire_wal(self, old_name: str | None, new: WalWriter | None) -> None:
        """After a commit: the previous generation's log is no longer named. Kept under the
        name of the generation after ``new`` for reuse (:meth:`_start_wal`), or deleted
        when no log is kept (``wal_on`` off)."""
        if self._wal is not None:
            self._wal.close()
        self._wal = new
        self._wal_count = self.count
        self._wal_acquires = self._stats["acquires"]
        if new is not None:
            self._wal_gen = parse_name(new.path.name)[1]
        if old_name is None:
            return
        old = self.path / old_name
        if new is not None:
            spare = self.path / wal_name(self._wal_gen + 1)
            try:
                os.replace(old, spare)
                self._wal_spare = spare
            except FileNotFoundError:  # pragma: no cover - removed by hand
                pass
        else:
            old.unlink(missing_ok=True)
            if self._wal_spare is not None:
                self._wal_spare.unlink(missing_ok=True)
                self._wal_spare = None
        crash_point("wal-retired")

    def _recover_wal(self) -> int:
        """Writer at open: replay the commit log's valid entries through :meth:`write`, then
        flush once (a new generation: the replayed log and its torn tail are never read
        again); with none to replay, append to the named log from its start. Returns the
        number of steps replayed."""
        name = self._manifest.get("wal")
        if name is None:
            return 0
        spare = self.path / wal_name(self._wal_gen + 1)
        self._wal_spare = spare if spare.exists() else None
        done = 0
        for e in _log_entries(self.path, self._manifest):
            self.write(e.rows, e.records)
            self.count = e.t
            done += 1
            crash_point("wal-replayed")
        if done:
            self.flush()
        else:
            self._wal = WalWriter.resume(self.path / name, int(self._manifest["wal_salt"]), 0,
                                         self.stride, self.dtype)
            self._wal_count, self._wal_acquires = self.count, self._stats["acquires"]
        return done

    def _install_log(self, limit: int) -> None:
        """Read-only open: put the commit log's first ``limit`` entries into the region
        (sized by :func:`open` to hold all their rows), so that reads see the state after
        the last logged step. Nothing is written."""
        for e in itertools.islice(_log_entries(self.path, self._manifest), limit):
            n = e.rows.shape[0]
            if n:
                lr = self.loc[e.rows]
                new = lr >= 0
                k = int(np.count_nonzero(new))
                if k > self._nfree:  # the writer reused the file meanwhile: read again
                    raise SegmentError(f"commit log of {str(self.path)!r} changed while it "
                                       "was read")
                slots = np.empty(n, np.int64)
                slots[~new] = -lr[~new] - 1
                fresh = self._free[self._nfree - k:self._nfree][::-1].copy()
                self._nfree -= k
                slots[new] = fresh
                self.slot_row[fresh] = e.rows[new]
                self.slot_disk[fresh] = lr[new]
                self.loc[e.rows[new]] = -fresh - 1
                self.region[slots] = e.records
                self.dirty[slots] = 1
            self.count = e.t

    # -- inspection ------------------------------------------------------------------------
    def _totals(self) -> dict[str, int]:
        """The write counters over the store's life: earlier writers' plus this open's."""
        return {k: self._totals_base[k] + int(self._stats[k]) for k in _TOTALS}

    def stats(self) -> dict[str, Any]:
        """Space, memory and write figures (the write counters since this open).

        ``segments``/``segment_records``/``segment_bytes``: the live segments (records, and
        their files' bytes with headers and padding); ``live_records``/``live_bytes``: rows
        with an on-disk record (record bytes); ``dead_bytes``: record bytes of superseded
        records in live segments; ``pending_delete``: dead segments whose files wait for
        the next commit; ``space_used``: ``segment_records / live_records``;
        ``slots``/``slots_used``/``slots_dirty``; ``sealed_bytes`` (updated records written
        by seals), ``cleaned_bytes`` (records copied by cleaning), ``file_bytes_written``
        (everything appended, headers and padding included), ``user_bytes`` (records handed
        out by acquire: ``len(rows) * record bytes`` per call); ``write_amplification`` =
        ``(sealed_bytes + cleaned_bytes) / user_bytes`` and ``cleaning_overhead`` =
        ``(sealed_bytes + cleaned_bytes) / sealed_bytes``. ``total_*``: the same over the
        store's life (every writer's counters as of its last flush, plus this open's):
        ``total_user_bytes``, ``total_written_bytes`` (seals and cleaning),
        ``total_file_bytes_written``, ``total_write_amplification``.
        """
        self._require_open()
        st, rb = self._stats, self.rec_bytes
        written = (st["sealed_records"] + st["cleaned_records"]) * rb
        user = st["user_records"] * rb
        tot = self._totals()
        t_written = (tot["sealed_records"] + tot["cleaned_records"]) * rb
        t_user = tot["user_records"] * rb
        return {
            "segments": len(self.segs),
            "segment_records": int(self.total_records),
            "segment_bytes": int(sum(s.nbytes for s in self.segs.values())),
            "live_records": int(self.live_total),
            "live_bytes": int(self.live_total) * rb,
            "dead_bytes": int(self.total_records - self.live_total) * rb,
            "pending_delete": len(self._doomed),
            "space_used": self.total_records / self.live_total if self.live_total else 0.0,
            "space_ratio": self.space_ratio,
            "slots": self.slots,
            "slots_used": self.slots - self._nfree,
            "slots_dirty": int(np.count_nonzero(self.dirty)),
            "seal_unit": self.seal_unit,
            "seals": st["seals"],
            "cleaned_segments": st["cleaned_segments"],
            "sealed_bytes": st["sealed_records"] * rb,
            "cleaned_bytes": st["cleaned_records"] * rb,
            "file_bytes_written": st["file_bytes_written"],
            "user_bytes": user,
            "write_amplification": written / user if user else 0.0,
            "cleaning_overhead": written / (st["sealed_records"] * rb)
            if st["sealed_records"] else 0.0,
            "misses": st["misses"],
            "acquires": st["acquires"],
            "total_user_bytes": t_user,
            "total_written_bytes": t_written,
            "total_file_bytes_written": tot["file_bytes_written"],
            "total_write_amplification": t_written / t_user if t_user else 0.0,
        }

    def verify(self) -> list[str]:
        """Check the index against the segments and the region; returns the problems found.

        Every location (``loc``, or a resident row's ``slot_disk``) must point inside a live
        segment at a record that carries that row; live counts, record totals, residency
        (``loc`` <-> ``slot_row``) and the free-slot stack must agree. An empty list: all
        consistent.
        """
        self._require_open()
        problems: list[str] = []
        S = self.slots
        resident = np.flatnonzero(self.loc < 0)
        rslot = -self.loc[resident] - 1
        if resident.shape[0] and (rslot >= S).any():
            problems.append(f"rows {resident[rslot >= S][:5].tolist()} are resident in slots "
                            f"past the region ({S})")
            return problems
        wrong = self.slot_row[rslot] != resident
        if wrong.any():
            problems.append(f"rows {resident[wrong][:5].tolist()} are resident in slots that "
                            "hold other rows")
        used = np.flatnonzero(self.slot_row >= 0)
        back = self.loc[self.slot_row[used]] != -used - 1
        if back.any():
            problems.append(f"slots {used[back][:5].tolist()} hold rows whose location is "
                            "elsewhere")
        free = np.sort(self._free[:self._nfree])
        if not np.array_equal(free, np.flatnonzero(self.slot_row < 0)):
            problems.append("the free-slot stack does not list exactly the unused slots")
        if self.dirty[self.slot_row < 0].any():
            problems.append("free slots are marked dirty")
        disk = self._disk_locations() if S else self.loc.copy()
        problems += self._check_rows_of_records(disk)
        located = disk[disk > 0] - 1
        live = np.bincount(located >> 32, minlength=self._live.shape[0]) \
            if located.shape[0] else np.zeros(self._live.shape[0], np.int64)
        for sid in sorted(self.segs):
            if live[sid] != self._live[sid]:
                problems.append(f"segment {sid}: {self._live[sid]} live records counted, "
                                f"{live[sid]} located")
        stray = [int(s) for s in np.flatnonzero(live) if int(s) not in self.segs]
        if stray:
            problems.append(f"rows point at segments {stray[:5]} that are not live")
        if self.live_total != located.shape[0]:
            problems.append(f"{self.live_total} located rows counted, {located.shape[0]} found")
        total = sum(s.n for s in self.segs.values())
        if total != self.total_records:
            problems.append(f"{self.total_records} segment records counted, {total} mapped")
        return problems

    # -- closing ------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush (when writable and anything changed) and release the lock. Safe twice."""
        if self.closed:
            return
        if self.mode == "r+":
            self.flush()  # a failed flush leaves the engine open: fix the cause, close again
        if self._wal is not None:
            self._wal.close()
        self._stop_threads()
        self.closed = True
        self.segs.clear()
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def abandon(self) -> None:
        """Close without flushing: the descriptors and the lock released, nothing written
        (what a crash leaves; for cleaning up after a failed create or open, and tests).
        Safe twice."""
        if self.closed:
            return
        self._stop_threads()  # its segment files are garbage for the next open
        self.closed = True
        self.segs.clear()
        if self._wal is not None:
            self._wal.close()
        if self._lockfd >= 0:
            os.close(self._lockfd)
            self._lockfd = -1

    def __enter__(self) -> LogEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return (f"LogEngine({str(self.path)!r}, rows={self.num_rows}, stride={self.stride}, "
                f"dtype={self.dtype.name}, slots={self.slots}, count={self.count}, {state})")


# -- create / open ------------------------------------------------------------------------------
def _name_wal(manifest: dict[str, Any], wal: WalWriter | None) -> None:
    """Name the commit log ``wal`` (or none) in ``manifest``, with the format version that
    says whether it has one (an older reader must refuse a store whose log it would ignore)."""
    manifest.update(wal=None if wal is None else wal.path.name,
                    wal_salt=None if wal is None else wal.salt,
                    version=FORMAT_VERSION if wal is None else FORMAT_VERSION_WAL)


def _log_entries(directory: Path, manifest: dict[str, Any]):
    """The valid commit-log entries of ``manifest`` (steps ``count + 1``, ...); none if it
    names no log."""
    name = manifest.get("wal")
    if name is None:
        return iter(())
    lay = manifest["layout"]
    return read_entries(Path(directory) / name, int(manifest["wal_salt"]),
                        int(manifest["count"]) + 1, int(lay["stride"]),
                        np.dtype(lay["dtype"]), int(lay["num_rows"]))


def _remove_garbage(directory: Path, manifest: dict[str, Any]) -> None:
    """Delete the store's own files that the manifest does not reference (writer only).

    The commit log the manifest names stays, and so does a retired one kept under the next
    generation's name (reused by the next flush)."""
    keep_segs = {int(s) for s in manifest["segments"]}
    keep_wal = set()
    if manifest.get("wal") is not None:
        gen = parse_name(manifest["wal"])[1]
        keep_wal = {manifest["wal"], wal_name(gen + 1)}
    removed = False
    for entry in sorted(os.listdir(directory)):
        kind = parse_name(entry)
        stale = (kind is not None and ((kind[0] == "seg" and kind[1] not in keep_segs)
                                       or (kind[0] == "index" and entry != manifest["index"])
                                       or (kind[0] == "wal" and entry not in keep_wal)))
        if stale or entry == MANIFEST_FILE + ".tmp":  # write_json's, from a torn commit
            os.unlink(directory / entry)
            removed = True
            crash_point("open-clean")
    if removed:
        fsync_dir(directory)


def create(path, layout: dict[str, Any], *, memory_bytes: int, init: str = "zeros",
           init_scale: float = 1e-2, seed: int = 0, ball_maxnorm: float | None = None,
           space_ratio: float = 2.0, count: int = 0, max_batch: int | None = None,
           meta: dict[str, Any] | None = None, overwrite: bool = False) -> LogEngine:
    """Create an empty log store at ``path`` (every row at its initial record); returns it
    open for writing.

    Parameters
    ----------
    layout : dict
        A record layout (``dsa_core._layout.make_layout``).
    memory_bytes : int
        Budget of the in-memory region (see the module docstring for what it pays for).
    init, init_scale, seed, ball_maxnorm
        The deterministic initial weights (``_init``): ``"zeros"``, ``"normal"``
        (``N(0, init_scale**2)``) or ``"uniform"`` (``U(-init_scale, init_scale)``); rows
        beyond ``ball_maxnorm`` (Poincaré stores) are scaled onto it.
    space_ratio : float > 1, default 2.0
        Bound on the segments' records as a multiple of the live records (the cleaner's
        target): lower saves disk, costs more cleaning writes.
    count : int, default 0
        The initial step count.
    max_batch : int, optional
        Check now that the region holds batches of this many rows.
    meta : dict, optional
        JSON-able caller data committed with every flush (``LogEngine.meta``).
    overwrite : bool
        Replace an existing log store (refused while a writer holds it).

    All arguments are checked before anything is written.
    """
    lay = _check_layout(layout)
    memory_bytes = _check_memory_bytes(memory_bytes, lay)
    if max_batch is not None:
        check_memory(lay, memory_bytes, int(max_batch))
    if init not in INIT_KINDS:
        raise ValueError(f"init must be one of {INIT_KINDS} (a log store computes a row's "
                         f"initial weights from (seed, row)), got {init!r}")
    if init != "zeros" and lay["w"] is None:
        raise ValueError("init sets the weights, but this layout has none (weights=False); "
                         "use init='zeros'")
    init_scale = float(init_scale)
    if not (math.isfinite(init_scale) and init_scale >= 0):
        raise ValueError(f"init_scale must be finite and >= 0, got {init_scale}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if ball_maxnorm is not None:
        ball_maxnorm = float(ball_maxnorm)
        if not (math.isfinite(ball_maxnorm) and ball_maxnorm > 0):
            raise ValueError(f"ball_maxnorm must be a finite float > 0 (the ball's projection "
                             f"radius) or None, got {ball_maxnorm}")
    space_ratio = float(space_ratio)
    if not (math.isfinite(space_ratio) and space_ratio > 1.0):
        raise ValueError(f"space_ratio must be a finite float > 1 (segment records as a "
                         f"multiple of the live ones; 2.0 by default), got {space_ratio}")
    count = _check_count(count)
    meta = _check_meta({} if meta is None else meta)
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{str(directory)!r} exists and is not a directory")
    if (directory / MANIFEST_FILE).exists():
        if not overwrite:
            raise FileExistsError(f"a store already exists at {str(directory)!r}; open it or "
                                  "pass overwrite=True to replace it")
        fd = _lock(directory)
        try:
            for entry in os.listdir(directory):
                if parse_name(entry) is not None or entry.startswith(MANIFEST_FILE):
                    os.unlink(directory / entry)
        finally:
            os.close(fd)
    directory.mkdir(parents=True, exist_ok=True)
    lockfd = _lock(directory)
    try:
        manifest = {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "layout": lay, "count": count,
            "seed": int(seed), "init": init, "init_scale": init_scale,
            "ball_maxnorm": ball_maxnorm, "index": None, "index_crc32": None, "segments": [],
            "next_segment": 1, "space_ratio": space_ratio, "meta": meta,
        }
        write_manifest(directory, manifest)
        eng = LogEngine(directory, manifest, "r+", memory_bytes, lockfd)
    except BaseException:
        os.close(lockfd)
        raise
    return eng


def open(path, mode: str = "r+", *, memory_bytes: int | None = None,
         max_batch: int | None = None, check: str = "full") -> LogEngine:  # noqa: A001
    """Open a log store: the state of its last completed flush, plus the steps of its
    commit log (``durability="step"``), if the manifest names one.

    ``mode="r+"`` takes the writer lock, removes files no manifest references (left by a
    crash), replays the commit log's valid entries through :meth:`LogEngine.write` and, if
    there were any, flushes once; ``memory_bytes`` is then required. ``mode="r"`` maps the
    files read-only without a lock and writes nothing (``memory_bytes`` optional: only
    :meth:`LogEngine.read` is available); the commit log's rows are read into a region of
    their own, as large as they need (at most the log's size).
    ``check="full"`` verifies the CRC of every referenced segment's records (a sequential
    read of the whole store); ``"headers"`` checks headers, sizes, row ids and their CRCs
    only. A missing, torn or corrupt referenced file is a clear error naming it.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' (read-only) or 'r+' (read-write), got {mode!r}")
    if check not in ("full", "headers"):
        raise ValueError(f"check must be 'full' or 'headers', got {check!r}")
    directory = Path(path)
    manifest = read_manifest(directory)
    lay = _check_layout(manifest["layout"])
    if mode == "r+" and memory_bytes is None:
        raise ValueError("memory_bytes is required to open a log store for writing (mode="
                         "'r+'): the budget of its in-memory region")
    if memory_bytes is not None:
        memory_bytes = _check_memory_bytes(memory_bytes, lay)
        if max_batch is not None:
            check_memory(lay, memory_bytes, int(max_batch))
    lockfd = _lock(directory) if mode == "r+" else -1
    try:
        for attempt in range(5):
            if mode == "r+" or attempt:
                manifest = read_manifest(directory)  # under the lock: the newest commit
            try:
                logged, mem = 0, memory_bytes
                if mode == "r":  # the region must hold every row of the commit log
                    rows = [e.rows for e in _log_entries(directory, manifest)]
                    logged = len(rows)
                    if logged:
                        need = np.unique(np.concatenate(rows)).shape[0]
                        mem = max(memory_bytes or 0, memory_for(lay, max(need, 1)))
                eng = LogEngine(directory, manifest, mode, mem, lockfd)
                eng.memory_bytes = memory_bytes
                eng._load(manifest, check == "full")
                if logged:
                    eng._install_log(logged)
                break
            except (FileNotFoundError, SegmentError):
                # a reader can lose a race with the writer deleting files after a newer
                # commit: read the manifest again and retry; a writer cannot
                if mode == "r+" or attempt == 4:
                    raise
                time.sleep(0.01)
        if mode == "r+":
            _remove_garbage(directory, manifest)
            eng._recover_wal()
    except BaseException:
        if lockfd >= 0:
            os.close(lockfd)
        raise
    return eng


def remove(path) -> None:
    """Delete a log store directory (refused while a writer holds it)."""
    directory = Path(path)
    read_manifest(directory)
    os.close(_lock(directory))
    shutil.rmtree(directory)
