"""The tooling of dsa_core: what the adapters, the CLI and the benchmarks build on.

A training program needs only ``dsa_core`` itself (``create``, ``step``, ``checkpoint``, ...:
``docs/CORE_API.md``). This module is the second face, for code that builds on the core the
way the adapters do: atomic JSON files and directories, linking a snapshot's files, the
paging hint and its figures, deferring Ctrl-C over a multi-store step and stepping stores
whose States the caller holds (``step_many_into``), restoring a store from records held in
memory (``restore_records``: a state dict's rows), following a framework's thread count,
the shared argument checks, how often a batch's ids repeat (``max_repeats``). It only
re-exports; each name is documented where it is defined.

>>> from dsa_core import tools
>>> tools.check_access("disk")
'disk'
"""

from . import _validation as validation
from ._coalesce import max_repeats
from ._files import link_files, read_json, staged_dir, write_json
from ._group import GROUP_FILE, deferred_sigint, step_many_into
from ._paging import ACCESS_MODES, check_access, paging_limits
from ._pool import follow_threads
from ._state import restore_records

__all__ = ["ACCESS_MODES", "GROUP_FILE", "check_access", "deferred_sigint", "follow_threads",
           "link_files", "max_repeats", "paging_limits", "read_json", "restore_records",
           "staged_dir", "step_many_into", "validation", "write_json"]
