"""The memory budget of a log store's region: how many record slots ``memory_bytes`` pays for.

The budget pays for the in-memory index (``loc``: 8 bytes per row of the table) first, then
for the slots: ``S = (memory_bytes - 8 * num_rows) // (stride * itemsize + SLOT_OVERHEAD)``
with ``SLOT_OVERHEAD = 42`` bytes (five int64 and two uint8 arrays per slot, ``pool``). On
top of the budget: per segment a few counters and its read-only mapping (page cache,
reclaimable), and during a seal the records of one write chunk (at most 8 MiB) or of one
background seal (``commit``) plus a few int64 per sealed record (row ids, steps,
locations). A batch of ``M`` rows needs ``S >= M``: :func:`check_memory` says by how much to
raise the budget.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SEAL_BYTES", "SLOT_OVERHEAD", "check_memory", "check_memory_bytes", "memory_for",
           "seal_unit_for", "slots_for"]

SLOT_OVERHEAD = 42       # bytes per slot besides its record: see the module docstring
SEAL_BYTES = 32 << 20    # a seal unit holds at most this many bytes of records


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


def seal_unit_for(slots: int, rec_bytes: int) -> int:
    """Records per seal: ``min(slots // 8, SEAL_BYTES of records)``, at least 1."""
    return max(1, min(slots // 8, SEAL_BYTES // rec_bytes))


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


def check_memory_bytes(memory_bytes: Any, layout: dict[str, Any]) -> int:
    """``memory_bytes`` as an int, or a clear error unless it is an int that pays for the
    index and at least one slot."""
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
