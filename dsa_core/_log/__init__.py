"""The log-structured storage engine, a package cut along its concerns.

``engine`` (:class:`LogStore`, the ``Engine`` protocol in one class, and ``create``/
``open``/``remove``) composes ``pool`` (the region, CLOCK, acquire and read), ``segments``
(the live segments and their background writes), ``cleaner`` (the space bound), ``commit``
(seals, flushes, checkpoints, the commit log) and ``recovery`` (opening, replay, garbage,
verify); ``store`` is what the registry (``dsa_core._engines``) calls (settings, create,
open, remove); all on ``format`` (the files), ``wal`` (the commit log's file), ``writer``
(the segment writer thread), ``read`` (read-ahead and cleaning reads), ``budget`` and
``checks``; system calls go through ``dsa_core._os``.

This module re-exports the names that code outside the package uses (``_log.LogStore``,
``_log.create``, ...); anything else is imported from its module.
"""

from .budget import SLOT_OVERHEAD, check_memory, memory_for, slots_for
from .engine import LogStore, create, open, remove
from .format import read_manifest, write_manifest
from .pool import gather_records
from .recovery import check_files, lock

__all__ = ["SLOT_OVERHEAD", "LogStore", "check_files", "check_memory", "create",
           "gather_records", "lock", "memory_for", "open", "read_manifest", "remove",
           "slots_for", "write_manifest"]
