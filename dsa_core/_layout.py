"""On-disk format of a DSA store: names, header, record layout, manifest.

A store is a directory holding two files:

``rows.dsa``
    A 4096-byte header followed by ``num_rows`` fixed-size records, one per
    embedding row, in the store dtype (little-endian float32 or float64)::

        header (4096 B): b"DSASTORE" | uint32 format version | uint32 n | JSON layout | zero padding
                         | b"DSAHCRC1" | uint32 crc32 of the bytes before the padding | 4 zeros
                         | 8-byte unclean marker (the header's last 8 bytes)
        record r       : [ w (dim) | m (dim, or m_width) | v (dim, or 1) | t_r | last | padding ]
        Adagrad record : [ w (dim) | acc (dim, or 1 for row-wise) | padding ]

    The unclean marker is ``UNCLEAN_MARK`` while rows may have changed since the last flush
    (``durability="flush"``: set and fdatasync'd before the first row of a flush interval
    changes, cleared once ``flush``/``close`` has synced the rows and written the manifest),
    else zeros. A store found marked with no writer holding it was stopped uncleanly (kill -9,
    power loss, ``os._exit``): ``open`` refuses it unless told ``unclean="accept"`` (see
    ``_inplace.store.Store.mark_unclean``). Readers older than the marker ignore it (it lies in the
    padding), so it does not change the format version. The header CRC (``HEADER_CRC_TAG``,
    16 bytes before the marker) is checked at every open (:func:`parse_header`); it too lies
    in the padding, so older readers ignore it. A header written before it has zeros there:
    it is read as before (its JSON and layout are still checked against the manifest), and a
    writer's open adds the CRC.

    v is one scalar per row when ``curvature > 0`` (the ball's Riemannian second moment) or when
    the layout says ``"second_moment": "rowwise"`` (docs/algorithms.md §7.3). With
    ``"first_moment": "bfloat16"`` m holds ``dim`` bfloat16 values packed two per float32 slot.

    The two per-row counters exist only in stores created with the option that needs them, each
    one element slot at the offset the layout names: ``"row_step"`` (``per_row_step=True``:
    the row's own update count t_r, docs/algorithms.md §7.2) and ``"last_step"``
    (``decay_missed_steps=True``: the global step of the row's last update, 0 for never,
    docs/algorithms.md §7.1). A counter is an integer stored in the slot's bits: int32 in a
    float32 slot, int64 in a float64 slot (the int view of the records,
    ``data.view(counter_dtype(dtype))``, has the records' shape, so the element offset is the
    same in both views). Counters start at 0 (the file is created zero-filled).

    A store created with ``optimizer="adagrad"`` or ``"rowwise_adagrad"`` (docs/algorithms.md
    §7.5) has no m: its record is the weights and one accumulator (torch's ``"sum"``), ``dim``
    values (elementwise) or one (row-wise), at the offset ``"v"`` with ``"v_width"`` values;
    its layout says ``"optimizer"`` and has no ``"m"`` key (format version 5). An accumulator of
    exactly 0 reads as the initial accumulator value, so the file starts zero-filled.

    The weight block is absent for stores created with ``weights=False``. Any
    numpy can read the weights without this package::

        lay = json.load(open("store/manifest.json"))["layout"]
        rec = np.memmap("store/rows.dsa", dtype=lay["dtype"], mode="r",
                        offset=4096, shape=(lay["num_rows"], lay["stride"]))
        w = rec[:, lay["w"]:lay["w"] + lay["dim"]]

``manifest.json``
    Format name and version, the layout (repeated from the header), the
    hyperparameters and the step count, and ``"checksum": "crc32:<hex>"`` of the rest
    (``_files.json_checksum``), checked at every read (a manifest written before checksums
    has none and is read as before; the next flush adds it). It is replaced atomically
    (temporary file, fsync, rename, fsync of the directory) on every flush.

``undo.dsa`` (only with ``durability="flush"``, while a writer has changed rows since a flush)
    The old records of the rows changed since the last flush, not synced: after a process
    stops between flushes (SIGTERM, kill -9, an OOM kill) a writer's ``open`` on the same
    boot writes them back, so the store reopens exactly at its last flush
    (``_inplace.undo``). Emptied at a clean close.

``journal.dsa`` (only with ``durability="step"``)
    The undo record of the step in progress: ``b"DSAJRNL1" | count_before | n | crc32`` then
    the ``n`` row ids (int64) and their records as they were before the step. See
    :func:`journal_write` for the commit protocol.

``base.dsa`` and ``delta-NNNN.dsa`` (only in a snapshot that is a chain)
    A snapshot of an in-place store may hold, instead of ``rows.dsa``, the data file of an
    earlier snapshot (``base.dsa``, a hard link) and the rows changed since, in delta files
    that its manifest names in order (``"chain"``; manifest version 4, which older readers
    refuse). The format and the rules are in ``_inplace.snapshots``. A writer's ``open``
    turns such a snapshot into a plain store first.

One process at a time may open a store for writing: the writer holds an exclusive ``flock``
on ``writer.lock`` for as long as the store is open. (Not on ``rows.dsa`` itself: ``mmap``
duplicates the data file's descriptor, which would keep such a lock alive until the mapping
is garbage-collected.) Read-only opens take no lock.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._files import CHECKSUM_KEY, check_json_checksum, write_json

MAGIC = b"DSASTORE"
FORMAT_NAME = "dsa-store"
# newest version this module reads and writes: layout_version's (5: an Adagrad store), and
# at least 4 for a manifest that names a snapshot chain (``_inplace.snapshots``; its data file
# header keeps its layout's)
FORMAT_VERSION = 5
HEADER_BYTES = 4096
UNCLEAN_OFFSET = HEADER_BYTES - 8  # the unclean marker: the header's last 8 bytes
UNCLEAN_MARK = b"DSAUNCLN"         # there: rows may differ from the manifest's count
HEADER_CRC_OFFSET = UNCLEAN_OFFSET - 16  # b"DSAHCRC1" | u32 crc32 | 4 zeros
HEADER_CRC_TAG = b"DSAHCRC1"
DATA_FILE = "rows.dsa"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "writer.lock"
JOURNAL_FILE = "journal.dsa"
UNDO_FILE = "undo.dsa"  # the old records of the rows changed since the last flush (_inplace.undo)

__all__ = [
    "DATA_FILE",
    "FIRST_MOMENTS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "HEADER_BYTES",
    "HEADER_CRC_OFFSET",
    "JOURNAL_FILE",
    "LOCK_FILE",
    "Layout",
    "MANIFEST_FILE",
    "OPTIMIZERS",
    "SECOND_MOMENTS",
    "UNCLEAN_MARK",
    "UNCLEAN_OFFSET",
    "UNDO_FILE",
    "counter_dtype",
    "header_bytes",
    "header_crc",
    "parse_header",
    "layout_version",
    "make_layout",
    "read_manifest",
    "write_manifest",
]


SECOND_MOMENTS = ("elementwise", "rowwise")
FIRST_MOMENTS = ("full", "bfloat16")
# what a store's records hold state for (docs/algorithms.md §2, §7.5): Adam's m and v, or
# Adagrad's accumulator (one per coordinate, or one per row)
OPTIMIZERS = ("adam", "adagrad", "rowwise_adagrad")


def layout_version(layout: dict[str, Any]) -> int:
    """The format version a store of ``layout`` is written with: the oldest that reads it.

    1: the original records. 2: records with a row-wise second moment for ``curvature == 0``
    (``"second_moment": "rowwise"``) or a bfloat16 first moment (``"first_moment":
    "bfloat16"``), which a version-1 reader would misread (v past the record, m as float32);
    it refuses version 2 with "upgrade dsa_core". 3: records with per-row counters
    (``"row_step"``, ``"last_step"``), which a version-2 reader would ignore (it would run the
    global bias correction and no catch-up decay on a store made for them). Stores without
    these options keep their version: their bytes are those of version 1 or 2. 4 is taken by
    manifests that name a snapshot chain (``_inplace.snapshots``). 5: Adagrad records
    (``"optimizer": "adagrad"`` or ``"rowwise_adagrad"``), which an older reader would take
    for Adam's (no m, the accumulator where v sits).
    """
    if layout.get("optimizer", "adam") != "adam":
        return 5
    if "row_step" in layout or "last_step" in layout:
        return 3
    if layout.get("second_moment") == "rowwise" or layout.get("first_moment") == "bfloat16":
        return 2
    return 1


def counter_dtype(dtype: np.dtype) -> np.dtype:
    """The integer type of the per-row counters of a store of ``dtype``: int32 in float32
    slots, int64 in float64 slots (same width, so one view of the records holds both)."""
    return np.dtype(np.int32) if np.dtype(dtype).itemsize == 4 else np.dtype(np.int64)


def make_layout(num_rows: int, dim: int, dtype: np.dtype, curvature: float,
                has_weights: bool, align: int,
                second_moment: str = "elementwise",
                first_moment: str = "full", *, per_row_step: bool = False,
                decay_missed_steps: bool = False, optimizer: str = "adam") -> dict[str, Any]:
    """Column offsets and record stride (in elements) of one row record.

    ``second_moment="rowwise"`` (``curvature == 0`` only) gives v one element per row and
    adds the key ``"second_moment": "rowwise"``. ``first_moment="bfloat16"`` (float32,
    ``curvature == 0``) packs m as ``dim`` bfloat16 values into ``m_width = ceil(dim / 2)``
    float32 slots (little-endian: the uint16 view of the record holds m at ``2 * m``) and
    adds ``"first_moment": "bfloat16"`` and ``"m_width"``. ``per_row_step`` and
    ``decay_missed_steps`` each add one counter slot after v, at the offsets ``"row_step"``
    and ``"last_step"`` (format version 3). ``optimizer="adagrad"`` / ``"rowwise_adagrad"``
    (``curvature == 0``, none of the Adam options): ``[w | acc | padding]``, the accumulator
    (``dim`` values, or 1) at ``"v"``, no ``"m"`` key, ``"optimizer"`` added (format version
    5). Other layouts are unchanged from format version 1.
    """
    itemsize = np.dtype(dtype).itemsize
    if optimizer != "adam":
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        w_off = 0 if has_weights else None
        a_off = dim if has_weights else 0
        a_width = 1 if optimizer == "rowwise_adagrad" else dim
        used = a_off + a_width
        stride = used
        if align:
            stride = -(-used * itemsize // align) * align // itemsize
        return {"num_rows": int(num_rows), "dim": int(dim), "dtype": np.dtype(dtype).name,
                "curvature": 0.0, "stride": int(stride), "w": w_off, "v": int(a_off),
                "v_width": int(a_width), "align": int(align), "optimizer": optimizer}
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
    rs_off = ls_off = None
    if per_row_step:
        rs_off, used = used, used + 1
    if decay_missed_steps:
        ls_off, used = used, used + 1
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
    if rs_off is not None:
        layout["row_step"] = int(rs_off)
    if ls_off is not None:
        layout["last_step"] = int(ls_off)
    return layout


@dataclass(frozen=True, slots=True, eq=False)
class Layout:
    """A store's record layout as one frozen value, built once per open store from its layout
    dict (``make_layout``; the dict is what the header and the manifest hold, and
    :meth:`as_dict` gives it back unchanged). The step reads these fields at every step: plain
    attributes of a slotted object, no dict lookups.

    >>> lay = Layout.from_dict(make_layout(10, 4, np.float32, 0.0, True, 0, "rowwise"))
    >>> (lay.stride, lay.w_off, lay.m_off, lay.v_off, lay.rowwise, lay.rs_off)
    (9, 0, 4, 8, True, -1)
    >>> lay.as_dict()["second_moment"], lay == Layout.from_dict(lay.as_dict())
    ('rowwise', True)
    """

    num_rows: int
    dim: int
    dtype: np.dtype
    curvature: float
    stride: int            # elements per record
    w_off: int | None      # element offsets of the record's parts (None: no weights)
    m_off: int
    v_off: int
    v_width: int           # elements of v: dim, or 1 (one v per row)
    m_width: int           # elements of the record m occupies (dim; ceil(dim/2) for bfloat16)
    rowwise: bool          # one v per row at c == 0 (``"second_moment": "rowwise"``)
    m_bf16: bool           # m packed as bfloat16 (``"first_moment": "bfloat16"``)
    rs_off: int            # per-row counters (docs/algorithms.md §7.1, §7.2): element
    ls_off: int            #   offsets of t_r (per_row_step) and of the last step, -1: absent
    optimizer: str         # "adam", or "adagrad" / "rowwise_adagrad" (no m: m_off -1; the
    #                        accumulator at v_off, v_width values)
    _items: tuple[tuple[str, Any], ...] = field(repr=False)  # the dict, in its order

    @classmethod
    def from_dict(cls, layout: dict[str, Any]) -> Layout:
        dim = int(layout["dim"])
        w = layout["w"]
        opt = str(layout.get("optimizer", "adam"))
        if opt not in OPTIMIZERS:
            raise ValueError(f"the layout names optimizer {opt!r}, not one of {OPTIMIZERS}; "
                             "the store is damaged, or was written by a newer dsa_core "
                             "(upgrade dsa_core to open it)")
        adam = opt == "adam"
        return cls(num_rows=int(layout["num_rows"]), dim=dim, dtype=np.dtype(layout["dtype"]),
                   curvature=float(layout["curvature"]), stride=int(layout["stride"]),
                   w_off=None if w is None else int(w),
                   m_off=int(layout["m"]) if adam else -1,
                   v_off=int(layout["v"]), v_width=int(layout["v_width"]),
                   m_width=int(layout.get("m_width", dim)) if adam else 0,
                   rowwise=layout.get("second_moment") == "rowwise",
                   m_bf16=layout.get("first_moment") == "bfloat16",
                   rs_off=int(layout.get("row_step", -1)),
                   ls_off=int(layout.get("last_step", -1)), optimizer=opt,
                   _items=tuple(layout.items()))

    def as_dict(self) -> dict[str, Any]:
        """The layout dict it was built from (a new copy): what the manifest records."""
        return dict(self._items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(frozenset(self._items))


def header_crc(head: bytes) -> bytes:
    """The 16 bytes at ``HEADER_CRC_OFFSET`` that check the header ``head`` (its magic,
    version, length and JSON layout)."""
    n = struct.unpack("<I", head[12:16])[0]
    return HEADER_CRC_TAG + struct.pack("<I", zlib.crc32(head[:16 + n])) + bytes(4)


def header_bytes(layout: dict[str, Any]) -> bytes:
    body = json.dumps(layout, sort_keys=True).encode()
    head = MAGIC + struct.pack("<II", layout_version(layout), len(body)) + body
    if len(head) > HEADER_CRC_OFFSET:  # pragma: no cover - layouts are tiny
        raise ValueError("layout does not fit in the store header")
    head += b"\0" * (HEADER_CRC_OFFSET - len(head))
    head += header_crc(head)
    return head + b"\0" * (HEADER_BYTES - len(head))


def parse_header(path: Path, head: bytes) -> tuple[int, dict[str, Any], bool]:
    """``(version, layout, has_crc)`` of the data-file header ``head`` (read from ``path``),
    or a ``ValueError`` naming the file: a wrong magic, a CRC mismatch (a flipped byte), a
    layout that is not JSON. A header written before the CRC (zeros there) is read as
    before: ``has_crc`` False."""
    fix = ("Nothing was changed; restore the store from a checkpoint (a flipped byte on disk, "
           "or the file was edited)")
    if len(head) < HEADER_BYTES:
        raise ValueError(f"{str(path)!r} is torn: {len(head)} bytes, shorter than its "
                         f"{HEADER_BYTES}-byte header. {fix}")
    if head[:8] != MAGIC:
        raise ValueError(f"{str(path)!r} is not a DSA data file: magic is {head[:8]!r}, "
                         f"expected {MAGIC!r}")
    version, n = struct.unpack("<II", head[8:16])
    tag = head[HEADER_CRC_OFFSET:HEADER_CRC_OFFSET + 16]
    has_crc = tag[:8] == HEADER_CRC_TAG
    if has_crc or any(tag):
        if 16 + n > HEADER_CRC_OFFSET or tag != header_crc(head):
            raise ValueError(f"the header of {str(path)!r} is damaged: its CRC does not match "
                             f"its bytes. {fix}")
    if 16 + n > HEADER_CRC_OFFSET:
        raise ValueError(f"the header of {str(path)!r} is damaged: it announces a {n}-byte "
                         f"layout, more than the header holds. {fix}")
    try:
        layout = json.loads(head[16:16 + n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"the header of {str(path)!r} is damaged: its layout is not valid "
                         f"JSON ({exc}). {fix}") from None
    return version, layout, has_crc


def write_manifest(directory: Path, manifest: dict[str, Any], durable: bool = True) -> None:
    """Replace ``manifest.json`` atomically (temp file + fsync + rename + dir fsync;
    ``durable=False``: without the syncs, see ``_files.write_json``), with its checksum
    (``_files.json_checksum``, checked by :func:`read_manifest`)."""
    manifest.pop(CHECKSUM_KEY, None)
    write_json(Path(directory) / MANIFEST_FILE, manifest, shared=False,  # one writer: the lock
               checksum=True, durable=durable)


def read_manifest(directory: Path) -> dict[str, Any]:
    """Read and check ``manifest.json`` (its checksum: a manifest written before checksums
    has none and is accepted); clear errors for anything that is not a store."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"no DSA store at {str(directory)!r}: the directory does not exist; "
            "create one with dsa_core.create(path, num_rows=..., dim=...)")
    mpath = directory / MANIFEST_FILE
    if not mpath.is_file() and ((directory / DATA_FILE).is_file()
                                or (directory / JOURNAL_FILE).is_file()):
        found = DATA_FILE if (directory / DATA_FILE).is_file() else JOURNAL_FILE
        raise FileNotFoundError(
            f"store {str(directory)!r} is damaged: its data file {found} is there but "
            f"its {MANIFEST_FILE} is missing (deleted?), so the rows cannot be interpreted. "
            "Restore the store from a checkpoint, or replace it with "
            "dsa_core.create(path, ..., overwrite=True)")
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
    check_json_checksum(mpath, manifest, required=False)
    return manifest
