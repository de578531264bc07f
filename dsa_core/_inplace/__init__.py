"""The in-place storage engine: one mapped file of fixed-size records, updated where they lie.

``store`` (:class:`Store`, its life cycle ``create_store``/``open_store``/``remove_store`` and
the unclean-stop marker) on ``readahead`` (``prefetch`` and ``residency`` through the page
cache), ``ranges`` (``load_range``/``release_range`` as sequential reads and write-backs),
``undo`` (the old records of the rows changed since the last flush) and ``snapshots``
(snapshots that share disk: a base file and deltas of the rows changed since the last one);
system calls go through ``dsa_core._os``.

This module re-exports what the registry (``dsa_core._engines``) and the core's policy use;
anything else is imported from its module.
"""

from .store import (
    SETTINGS,
    Store,
    StoreLockedError,
    UncleanStopError,
    check_settings,
    create_store,
    open_store,
    remove_store,
)

__all__ = ["SETTINGS", "Store", "StoreLockedError", "UncleanStopError", "check_settings",
           "create_store", "open_store", "remove_store"]
