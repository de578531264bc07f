"""On-disk format of a DSA store: the only module that touches files.

A store is a directory holding two files:

``rows.dsa``
    A 4096-byte header followed by ``num_rows`` fixed-size records, one per
    embedding row, in the store dtype (little-endian float32 or float64)::

        header (4096 B): b"DSASTORE" | uint32 format version | uint32 n | JSON layout | zero padding
        record r       : [ w (dim) | m (dim, or m_width) | v (dim, or 1) | padding ]

    v is one scalar per row when ``curvature > 0`` (the ball's Riemannian second moment) or
    when the layout says ``"second_moment": "rowwise"`` (spec §7.3). With ``"first_moment":
    "bfloat16"`` m holds ``dim`` bfloat16 values packed two per float32 slot.

    The weight block is absent for stores created with ``weights=False``. Any
    numpy can read the weights without this package::

        lay = json.load(open("store/manifest.json"))["layout"]
        rec = np.memmap("store/rows.dsa", dtype=lay["dtype"], mode="r",
                        offset=4096, shape=(lay["num_rows"], lay["stride"]))
        w = rec[:, lay["w"]:lay["w"] + lay["dim"]]

``manifest.json``
    Format name and version, the layout (repeated from the header), the
    hyperparameters and the step count. It is replaced atomically (temporary
    file, fsync, rename, fsync of the directory) on every flush.

``journal.dsa`` (only with ``durability="step"``)
    The undo record of the step in progress: ``b"DSAJRNL1" | count_before | n | crc32`` then
    the ``n`` row ids (int64) and their records as they were before the step. See
    :func:`journal_write` for the commit protocol.

One process at a time may open a store for writing: the writer holds an exclusive ``flock``
on ``writer.lock`` for as long as the store is open. (Not on ``rows.dsa`` itself: ``mmap``
duplicates the data file's descriptor, which would keep such a lock alive until the mapping
is garbage-collected.) Read-only opens take no lock.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import mmap
import os
import shutil
import struct
import weakref
import zlib
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"DSASTORE"
FORMAT_NAME = "dsa-store"
FORMAT_VERSION = 2  # newest version this module reads and writes; see layout_version
HEADER_BYTES = 4096
DATA_FILE = "rows.dsa"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "writer.lock"
JOURNAL_FILE = "journal.dsa"
JOURNAL_MAGIC = b"DSAJRNL1"
_JHEAD = struct.Struct("<8sQQI")

__all__ = [
    "DATA_FILE",
    "FIRST_MOMENTS",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "MANIFEST_FILE",
    "SECOND_MOMENTS",
    "Store",
    "StoreLockedError",
    "commit_dir",
    "copy_store",
    "layout_version",
    "make_layout",
    "read_manifest",
    "staged_dir",
    "write_manifest",
]


ACCESS_MODES = ("auto", "ram", "disk")
RAM_FRACTION = 0.7  # "auto" maps a store as "ram" when it fits in this share of memory


def check_access(access: Any) -> str:
    """Validate the ``access`` hint of ``create``/``open``.

    ``"ram"``: the table is expected to stay in the page cache (2 MiB huge folios, PMD
    mappings). ``"disk"``: the table is larger than memory and rows come from disk at random
    (``MADV_RANDOM``: one 4 KiB page per fault, no read-around). ``"auto"`` (default): see
    :func:`auto_access`. The environment variable
    ``DSA_ACCESS`` replaces "auto" (for adapters and scripts that do not pass ``access``).
    """
    if access not in ACCESS_MODES:
        raise ValueError(f"access must be one of {ACCESS_MODES}, got {access!r}: 'ram' when "
                         "the table fits in memory, 'disk' when it does not, 'auto' to choose "
                         "by size")
    if access == "auto":
        env = os.environ.get("DSA_ACCESS", "auto")
        if env not in ACCESS_MODES:
            raise ValueError(f"DSA_ACCESS must be one of {ACCESS_MODES}, got {env!r}")
        access = env
    return access


def memory_limit() -> int:
    """Bytes of memory this process may use: physical memory, capped by its cgroup(s)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, rel = parts
        if hier == "0":  # cgroup v2
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in ctrls.split(","):
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        rel_path = Path(rel.lstrip("/"))
        for p in [rel_path, *rel_path.parents]:
            try:
                txt = (base / p / name).read_text().strip()
            except OSError:
                continue
            if txt.isdigit():
                limit = min(limit, int(txt))
    return limit


def dirty_background_bytes() -> int:
    """The kernel's background-writeback threshold, in bytes.

    ``vm.dirty_background_bytes`` when set, else ``vm.dirty_background_ratio`` percent of the
    memory available for page cache (MemAvailable, as the kernel's dirtyable memory).
    """
    try:
        with open("/proc/sys/vm/dirty_background_bytes") as f:
            fixed = int(f.read())
        if fixed:
            return fixed
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read())
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
        return avail * ratio // 100
    except (OSError, ValueError, StopIteration):
        return 1 << 30


_RAM_STORES: weakref.WeakSet = weakref.WeakSet()  # open stores of this process mapped "ram"


def ram_bytes_held() -> int:
    """Bytes of the stores this process holds open with ``access="ram"``."""
    return sum(st.nbytes for st in list(_RAM_STORES) if not st.closed)


def auto_access(nbytes: int) -> str:
    """"ram" when the store fits in memory *and* may be dirty in full without writeback.

    Fits: ``nbytes <= RAM_FRACTION * memory_limit()``. Without writeback: ``nbytes <=
    dirty_background_bytes()``. The second matters because the kernel writes a dirty huge
    folio back whole: at 10M x 128 rows (stores of 10 and 15.4 GB, past the 2.3 GB threshold
    here) the torch training loop took 421-467 ms per step with huge pages, 9-14 ms with
    4 KiB pages (measured). Both limits
    are shared by every store of the process, so the "ram" stores it already holds open count
    against them: of two stores that each fit alone but not together, the second gets "disk".
    """
    total = nbytes + ram_bytes_held()
    if total > RAM_FRACTION * memory_limit():
        return "disk"
    return "ram" if total <= dirty_background_bytes() else "disk"


class StoreLockedError(RuntimeError):
    """Another writer holds the store."""


SECOND_MOMENTS = ("elementwise", "rowwise")
FIRST_MOMENTS = ("full", "bfloat16")


def layout_version(layout: dict[str, Any]) -> int:
    """The format version a store of ``layout`` is written with: the oldest that reads it.

    1: the original records. 2: records with a row-wise second moment for ``curvature == 0``
    (``"second_moment": "rowwise"``) or a bfloat16 first moment (``"first_moment":
    "bfloat16"``), which a version-1 reader would misread (v past the record, m as float32);
    it refuses version 2 with "upgrade dsa_core".
    """
    if layout.get("second_moment") == "rowwise" or layout.get("first_moment") == "bfloat16":
        return 2
    return 1


def make_layout(num_rows: int, dim: int, dtype: np.dtype, curvature: float,
                has_weights: bool, align: int,
                second_moment: str = "elementwise",
                first_moment: str = "full") -> dict[str, Any]:
    """Column offsets and record stride (in elements) of one row record.

    ``second_moment="rowwise"`` (``curvature == 0`` only) gives v one element per row and
    adds the key ``"second_moment": "rowwise"``. ``first_moment="bfloat16"`` (float32,
    ``curvature == 0``) packs m as ``dim`` bfloat16 values into ``m_width = ceil(dim / 2)``
    float32 slots (little-endian: the uint16 view of the record holds m at ``2 * m``) and
    adds ``"first_moment": "bfloat16"`` and ``"m_width"``. Other layouts are unchanged from
    format version 1.
    """
    itemsize = np.dtype(dtype).itemsize
    rowwise = second_moment == "rowwise" and curvature == 0
    v_width = 1 if (curvature > 0 or rowwise) else dim
    col = 0
    w_off = None
    if has_weights:
        w_off, col = 0, dim
    bf16 = first_moment == "bfloat16" and curvature == 0
    m_width = (dim + 1) // 2 if bf16 else dim
    m_off = col
    v_off = m_off + m_width
    used = v_off + v_width
    stride = used
    if align:
        rec_bytes = -(-used * itemsize // align) * align
        stride = rec_bytes // itemsize
    layout = {
        "num_rows": int(num_rows),
        "dim": int(dim),
        "dtype": np.dtype(dtype).name,
        "curvature": float(curvature),
        "stride": int(stride),
        "w": w_off,
        "m": int(m_off),
        "v": int(v_off),
        "v_width": int(v_width),
        "align": int(align),
    }
    if rowwise:
        layout["second_moment"] = "rowwise"
    if bf16:
        layout["first_moment"] = "bfloat16"
        layout["m_width"] = int(m_width)
    return layout


def _header_bytes(layout: dict[str, Any]) -> bytes:
    body = json.dumps(layout, sort_keys=True).encode()
    head = MAGIC + struct.pack("<II", layout_version(layout), len(body)) + body
    if len(head) > HEADER_BYTES:  # pragma: no cover - layouts are tiny
        raise ValueError("layout does not fit in the store header")
    return head + b"\0" * (HEADER_BYTES - len(head))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Replace ``manifest.json`` atomically (temp file + fsync + rename + dir fsync)."""
    directory = Path(directory)
    tmp = directory / (MANIFEST_FILE + ".tmp")
    data = memoryview(json.dumps(manifest, indent=1, sort_keys=True).encode())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while data:  # os.write may write less than asked (a nearly full disk)
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, directory / MANIFEST_FILE)
    _fsync_dir(directory)


def read_manifest(directory: Path) -> dict[str, Any]:
    """Read and check ``manifest.json``; clear errors for anything that is not a store."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no DSA store at {str(directory)!r}: the directory does not exist; "
            "create one with dsa_core.create(path, num_rows=..., dim=...)")
    mpath = directory / MANIFEST_FILE
    if not mpath.is_file():
        raise FileNotFoundError(
            f"{str(directory)!r} is not a DSA store: it has no {MANIFEST_FILE}; "
            "create one with dsa_core.create(path, num_rows=..., dim=...)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(
            f"{str(mpath)!r} is not a DSA manifest (expected JSON with "
            f"format={FORMAT_NAME!r}): {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(
            f"{str(mpath)!r} is not a DSA manifest: format is {found!r}, "
            f"expected {FORMAT_NAME!r}")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        raise ValueError(
            f"store {str(directory)!r} has format version {version!r}; this dsa_core reads "
            f"versions 1..{FORMAT_VERSION}. Upgrade dsa_core to open it")
    return manifest


class Store:
    """The open files of one store: the mapped records, the lock, the layout.

    ``data`` is a plain ``numpy.ndarray`` of shape ``(num_rows, stride)`` over a
    shared ``mmap`` of ``rows.dsa`` (writes reach the file). The object is shared
    by every ``State`` derived from the one returned by ``create``/``open``.
    """

    def __init__(self, directory: Path, layout: dict[str, Any], mode: str,
                 access: str = "auto"):
        self.path = Path(directory)
        self.access_request = check_access(access)
        self.access = ""  # "ram" or "disk" once mapped
        self.layout = layout
        self.mode = mode
        self.num_rows = layout["num_rows"]
        self.dim = layout["dim"]
        self.dtype = np.dtype(layout["dtype"])
        self.curvature = layout["curvature"]
        self.stride = layout["stride"]
        self.w_off = layout["w"]
        self.m_off = layout["m"]
        self.v_off = layout["v"]
        self.v_width = layout["v_width"]
        self.rowwise = layout.get("second_moment") == "rowwise"  # c == 0, one v per row
        self.m_bf16 = layout.get("first_moment") == "bfloat16"  # m packed as bfloat16
        self.m_width = layout.get("m_width", self.dim)  # elements of the record m occupies
        self.closed = False
        self._fd = -1
        self._jfd = -1
        self._lockfd = -1
        self._mm: mmap.mmap | None = None
        self.data: np.ndarray | None = None
        self._prefetcher = None  # dsa_core._prefetch.Prefetcher, created on first prefetch
        self.scratch: dict[str, np.ndarray] = {}  # step's reused buffers (dsa_core._step)

    # -- opening ---------------------------------------------------------------------------
    @property
    def file(self) -> Path:
        return self.path / DATA_FILE

    @property
    def nbytes(self) -> int:
        return HEADER_BYTES + self.num_rows * self.stride * self.dtype.itemsize

    def _lock(self) -> None:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreLockedError(
                f"store {str(self.path)!r} is already open for writing (by this or another "
                "process); a store has one writer at a time. Close the other optimizer/state "
                "(dsa_core.close) or open this one read-only with mode='r'") from None
        self._lockfd = fd

    def advise(self, access: str) -> None:
        """Tell the kernel how the mapping will be used (see :func:`check_access`)."""
        access = check_access(access)
        _RAM_STORES.discard(self)  # not counted against its own "auto" decision
        resolved = access if access != "auto" else auto_access(self.nbytes)
        if resolved == "ram":
            _RAM_STORES.add(self)
        if resolved == "ram" and hasattr(mmap, "MADV_HUGEPAGE"):
            # The table stays in the page cache: 2 MiB folios, mapped by PMD entries (one
            # TLB entry and one fault per 2 MiB instead of 512). A fault reads (or, on never
            # written space, zero-fills) its whole 2 MiB. Measured on 1M x 128 float32,
            # warm, 2048 unique ids, A/B in one process: 0.52 -> 0.44 ms per step; 2.3 ->
            # 1.1 ms while the kernel writes dirty pages back.
            if hasattr(mmap, "MADV_NORMAL"):
                self._mm.madvise(mmap.MADV_NORMAL)
            self._mm.madvise(mmap.MADV_HUGEPAGE)
        elif hasattr(mmap, "MADV_RANDOM"):
            # Rows are touched in random order: the default read-around would read up to
            # 32 pages per fault (measured 262 rows/s vs 20k rows/s out of core).
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                self._mm.madvise(mmap.MADV_NOHUGEPAGE)
            self._mm.madvise(mmap.MADV_RANDOM)
        self.access = resolved

    def _map(self) -> None:
        writable = self.mode == "r+"
        self._mm = mmap.mmap(self._fd, self.nbytes,
                             access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
        self.advise(self.access_request)
        arr = np.frombuffer(self._mm, dtype=self.dtype,
                            count=self.num_rows * self.stride, offset=HEADER_BYTES)
        self.data = arr.reshape(self.num_rows, self.stride)
        if not writable:
            self.data.flags.writeable = False

    @classmethod
    def create_file(cls, directory: Path, layout: dict[str, Any],
                    access: str = "auto") -> Store:
        """Create ``rows.dsa`` (zeros, space reserved), lock it and map it."""
        st = cls(directory, layout, "r+", access)
        tmp = st.path / (DATA_FILE + ".tmp")
        st._lock()
        st._fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(st._fd, 0, st.nbytes)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise OSError(
                        exc.errno,
                        f"not enough disk space for the store: it needs {st.nbytes:,} bytes "
                        f"({st.nbytes / 2**30:.2f} GiB) at {str(st.path)!r}; free space or "
                        "choose another directory") from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(st._fd, st.nbytes)  # filesystem without fallocate
            os.pwrite(st._fd, _header_bytes(layout), 0)
            st._map()
        except BaseException:
            st._release()
            tmp.unlink(missing_ok=True)
            raise
        return st

    def commit_new_file(self) -> None:
        """Make the new data file durable and give it its final name."""
        self.sync()
        os.replace(self.path / (DATA_FILE + ".tmp"), self.file)
        _fsync_dir(self.path)

    @classmethod
    def open_file(cls, directory: Path, layout: dict[str, Any], mode: str,
                  access: str = "auto") -> Store:
        """Open an existing ``rows.dsa``, check its header and size, lock (r+) and map it."""
        st = cls(directory, layout, mode, access)
        if not st.file.is_file():
            raise FileNotFoundError(
                f"store {str(st.path)!r} has a manifest but no {DATA_FILE}; the store is "
                "incomplete (an interrupted create?). Recreate it with dsa_core.create")
        if mode == "r+":
            st._lock()
        try:
            st._fd = os.open(st.file, os.O_RDWR if mode == "r+" else os.O_RDONLY)
            head = os.pread(st._fd, HEADER_BYTES, 0)
            if head[:8] != MAGIC:
                raise ValueError(
                    f"{str(st.file)!r} is not a DSA data file: magic is {head[:8]!r}, "
                    f"expected {MAGIC!r}")
            version, n = struct.unpack("<II", head[8:16])
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"{str(st.file)!r} has format version {version}; this dsa_core reads "
                    f"versions 1..{FORMAT_VERSION}. Upgrade dsa_core to open it")
            on_disk = json.loads(head[16:16 + n])
            if on_disk != layout:
                raise ValueError(
                    f"{str(st.file)!r} header layout {on_disk} does not match the manifest "
                    f"layout {layout}; the store is damaged or its files were mixed up")
            size = os.fstat(st._fd).st_size
            if size != st.nbytes:
                raise ValueError(
                    f"{str(st.file)!r} is truncated or padded: it has {size:,} bytes, the "
                    f"layout needs {st.nbytes:,} ({st.num_rows} rows x {st.stride} x "
                    f"{st.dtype.itemsize} B + {HEADER_BYTES} B header)")
            st._map()
        except BaseException:
            st._release()
            raise
        return st

    # -- the undo journal (durability="step") -------------------------------------------
    def journal_write(self, rows, count_before: int) -> np.ndarray:
        """Save the records of ``rows`` as they are now, durably, before a step changes them.

        Commit protocol of one journaled step ``t = count_before + 1``:

        1. this journal (old records + ``count_before`` + crc32) is written and fdatasync'd;
        2. the kernel updates the rows in the mapping;
        3. the data file is fdatasync'd;
        4. the manifest with ``count = t`` replaces the old one atomically  <- commit point.

        On ``open``, a valid journal whose ``count_before`` equals the manifest's count
        belongs to a step that never committed: its records are written back (roll back).
        A torn journal (bad crc) means the crash came before step 2: the data is untouched.
        Returns the saved records (the in-process undo if a later stage of the step fails).
        """
        rec = np.ascontiguousarray(self.data[rows])
        ids = np.ascontiguousarray(rows, dtype=np.int64)
        crc = zlib.crc32(rec.data, zlib.crc32(ids.data))
        head = _JHEAD.pack(JOURNAL_MAGIC, int(count_before), ids.shape[0], crc)
        if self._jfd < 0:
            self._jfd = os.open(self.path / JOURNAL_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        total = len(head) + ids.nbytes + rec.nbytes
        try:  # reserve the journal's space: a full disk fails here, before any row changes
            os.posix_fallocate(self._jfd, 0, total)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        written = os.pwritev(self._jfd, [head, ids.data, rec.data], 0)
        if written != total:  # a short write would leave a journal that cannot roll back
            raise OSError(errno.ENOSPC, f"short write of the undo journal of "
                          f"{str(self.path)!r} ({written} of {total} bytes); no row was "
                          "changed")
        os.fdatasync(self._jfd)
        return rec

    def journal_void(self) -> None:
        """Truncate the undo journal durably: no journal may roll back past a flush."""
        jpath = self.path / JOURNAL_FILE
        if self._jfd < 0 and not jpath.exists():
            return
        fd = self._jfd if self._jfd >= 0 else os.open(jpath, os.O_RDWR)
        try:
            os.ftruncate(fd, 0)
            os.fdatasync(fd)
        finally:
            if fd != self._jfd:
                os.close(fd)

    def data_sync(self) -> None:
        """fdatasync the data file: every row written through the mapping is on disk."""
        os.fdatasync(self._fd)

    def journal_recover(self, manifest_count: int) -> str:
        """Roll back an uncommitted journaled step; returns what was done (for messages)."""
        jpath = self.path / JOURNAL_FILE
        if not jpath.exists():
            return "none"
        raw = jpath.read_bytes()
        action = "torn"
        if len(raw) >= _JHEAD.size:
            magic, count_before, n, crc = _JHEAD.unpack_from(raw)
            nbytes = n * 8 + n * self.stride * self.dtype.itemsize
            body = raw[_JHEAD.size:_JHEAD.size + nbytes]
            if magic == JOURNAL_MAGIC and len(body) == nbytes:
                ids = np.frombuffer(body, np.int64, n)
                rec = np.frombuffer(body, self.dtype, offset=n * 8).reshape(n, self.stride)
                if zlib.crc32(rec.data, zlib.crc32(ids.data)) == crc:
                    if count_before == manifest_count:
                        self.data[ids] = rec
                        self.data_sync()
                        action = "rolled back"
                    else:
                        action = "committed"
        jpath.unlink()
        _fsync_dir(self.path)
        return action

    # -- lifetime ----------------------------------------------------------------------------
    def sync(self) -> None:
        """msync the mapping: every row written so far is on disk when this returns."""
        if self._mm is not None and self.mode == "r+" and not self.closed:
            self._mm.flush()

    def close(self) -> None:
        """Release the writer lock; the mapping lives on until the arrays are collected."""
        if self.closed:
            return
        if self._prefetcher is not None:
            self._prefetcher.close()
        self.sync()
        self.closed = True
        if self.data is not None:
            self.data.flags.writeable = False
        self._release()

    def _release(self) -> None:
        _RAM_STORES.discard(self)
        for name in ("_jfd", "_fd", "_lockfd"):  # the lock goes last
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return (f"Store({str(self.path)!r}, rows={self.num_rows}, dim={self.dim}, "
                f"dtype={self.dtype.name}, curvature={self.curvature}, {state})")


_COPY_CHUNK = 16 << 20


def _copy_direct(src: Path, fo) -> bool:
    """Copy ``src`` into the open file ``fo`` reading with ``O_DIRECT``; False if unsupported.

    Why not ``copy_file_range``/``read``: they read through the page cache, whose read-ahead
    fills it with large folios (up to 2 MiB on ext4 with large-folio support). A store whose
    cache holds such folios writes a whole folio back for every row a step changes: measured
    1.6 MB written per dirtied 4 KiB page after a copy_file_range of the file, against 4 KiB
    after plain mapping faults (``python -m benchmarks.folio_check``). ``O_DIRECT`` leaves the
    source's cache as it was. The caller has flushed the mapping, so the disk holds the rows.
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    if flags == os.O_RDONLY:  # pragma: no cover - no O_DIRECT on this platform
        return False
    try:
        fd = os.open(src, flags)
    except OSError:
        return False
    buf = mmap.mmap(-1, _COPY_CHUNK)  # page-aligned, as O_DIRECT needs
    try:
        size = os.fstat(fd).st_size
        off = 0
        while off < size:
            try:
                n = os.preadv(fd, [buf], off)
            except OSError as exc:
                if off == 0 and exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                    return False  # the filesystem refuses direct reads: use the cache path
                raise
            if n <= 0:
                raise OSError(errno.EIO, f"{str(src)!r} ended at {off:,} of {size:,} bytes")
            fo.write(memoryview(buf)[:n])
            off += n
            if n < _COPY_CHUNK and off < size:  # a short read left an unaligned offset:
                with src.open("rb") as rest:    # the rest through the cache (rare, small)
                    rest.seek(off)
                    shutil.copyfileobj(rest, fo, 1 << 24)
                break
        return True
    finally:
        buf.close()
        os.close(fd)


def _copy_file(src: Path, dst: Path) -> None:
    """Copy a file: reflink (FICLONE) where the filesystem can, else direct reads of ``src``
    (see :func:`_copy_direct`), else ``copy_file_range``. ``dst`` is fsync'd and then dropped
    from the page cache, so a store opened from it starts with small folios too."""
    with src.open("rb") as fi, dst.open("wb") as fo:
        try:
            FICLONE = 0x40049409
            fcntl.ioctl(fo.fileno(), FICLONE, array.array("i", [fi.fileno()])[0])
        except OSError:
            if not _copy_direct(src, fo):
                size = os.fstat(fi.fileno()).st_size
                off = 0
                while off < size:
                    try:
                        n = os.copy_file_range(fi.fileno(), fo.fileno(),
                                               min(1 << 30, size - off), off, off)
                    except OSError:
                        n = 0
                    if n <= 0:  # no copy_file_range here: plain copy of the rest
                        fi.seek(off)
                        fo.seek(off)
                        shutil.copyfileobj(fi, fo, 1 << 24)
                        break
                    off += n
        fo.flush()
        os.fsync(fo.fileno())
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fo.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (renameat2 RENAME_EXCHANGE); False where unsupported."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    AT_FDCWD, RENAME_EXCHANGE = -100, 2
    r = fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE)
    return r == 0


def commit_dir(tmp: Path, dest: Path, overwrite: bool) -> None:
    """Give the complete directory ``tmp`` the name ``dest`` in one atomic step (fsync'd).

    An existing ``dest`` (only with ``overwrite``) is swapped with ``tmp`` atomically
    (renameat2 RENAME_EXCHANGE) where the filesystem allows, so ``dest`` always names one
    complete snapshot; the old one is deleted afterwards. Used by every checkpoint writer
    (``dsa_core.checkpoint`` and the adapters' multi-store checkpoints).
    """
    tmp, dest = Path(tmp), Path(dest)
    _fsync_dir(tmp)
    if dest.exists():
        if not overwrite:
            raise FileExistsError(f"{str(dest)!r} exists; pass overwrite=True to replace it")
        if not _exchange(tmp, dest):  # no atomic swap here: a short window without dest
            old = dest.with_name(f"{dest.name}.old-{os.getpid()}")
            os.rename(dest, old)
            os.rename(tmp, dest)
            tmp = old
        _fsync_dir(dest.parent)
        shutil.rmtree(tmp)
    else:
        os.rename(tmp, dest)
        _fsync_dir(dest.parent)


@contextlib.contextmanager
def staged_dir(dest: Path, overwrite: bool):
    """Build a directory in ``dest.tmp-<pid>``; on success commit it as ``dest`` (``commit_dir``).

    On any error the temporary directory is removed and ``dest`` is left as it was. The
    snapshot writers (``dsa_core.checkpoint`` and the adapters' multi-store checkpoints)
    write their files into the yielded path.
    """
    dest = Path(dest)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        commit_dir(tmp, dest, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_store(src: Path, dest: Path, manifest: dict[str, Any], overwrite: bool) -> None:
    """Write a store snapshot at ``dest``: files copied and fsync'd, then one atomic rename.

    ``dest`` appears complete or not at all: the copy is built in ``dest.tmp-<pid>`` and
    renamed into place; a crash leaves at most that temporary directory behind. Replacing
    an older snapshot swaps the two directories atomically (renameat2 RENAME_EXCHANGE) where
    the filesystem allows, so ``dest`` always holds one complete snapshot.
    """
    with staged_dir(dest, overwrite) as tmp:
        _copy_file(Path(src) / DATA_FILE, tmp / DATA_FILE)
        write_manifest(tmp, manifest)
