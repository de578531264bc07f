"""The log-structured storage engine (a package; see ``engine`` for how a store works).

Re-exports the names that code outside the package uses; everything else is imported from
its module (``format``, ``wal``, ``writer``, ``read``, ...).
"""

from .engine import (
    SLOT_OVERHEAD,
    LogEngine,
    check_memory,
    create,
    gather_records,
    memory_for,
    open,
    remove,
    slots_for,
)
from .format import read_manifest

__all__ = ["SLOT_OVERHEAD", "LogEngine", "check_memory", "create", "gather_records",
           "memory_for", "open", "read_manifest", "remove", "slots_for"]
