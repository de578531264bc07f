"""dsa_core: out-of-core sparse Adam for huge embedding tables (numpy + numba only).

The Adam state (and, optionally, the weights) of an embedding table lives in one file of
fixed-size row records, mapped into memory; each step updates only the rows of its batch,
in place, with Numba kernels.

>>> import tempfile, pathlib, numpy as np, dsa_core
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> state = dsa_core.create(tmp / "emb", num_rows=1000, dim=8, lr=1e-2)
>>> state = dsa_core.step(state, np.array([3, 7, 3]), np.ones((3, 8), np.float32))
>>> dsa_core.gather(state, [3]).shape, state.count
((1, 8), 1)
>>> dsa_core.close(state)

``step`` returns a new ``State`` (count + 1) and the one passed in becomes outdated: keep
the returned value. The core never imports torch or jax; ``adapters.torch`` and
``adapters.jax`` sit on this public API.
"""

from . import validation
from ._files import ForkedReadError, link_files, read_json, staged_dir, write_json
from ._layout import FORMAT_VERSION
from ._log.store import region_memory
from ._paging import ACCESS_MODES, check_access, paging_limits
from ._pool import follow_threads, get_num_threads, set_num_threads
from ._prefetch import prefetch, prefetched, residency
from ._ranges import load_range, load_rows, release_range, release_rows, wait_ranges
from ._state import (
    StaleStateError,
    State,
    checkpoint,
    checkpoint_many,
    close,
    convert,
    create,
    flush,
    open,
    read_records,
    remove,
    restore,
    set_count,
    write_records,
)
from ._step import check_batch, gather, step, warmup
from ._group import (
    GROUP_FILE,
    Group,
    GroupCommitError,
    GroupMismatchError,
    deferred_sigint,
    flush_many,
    join,
    step_many,
)
from ._inplace.store import StoreLockedError, UncleanStopError
from . import buckets  # noqa: E402  (last: it looks dsa_core.* up when called)

__version__ = "0.1.0"

__all__ = [
    "ACCESS_MODES",
    "FORMAT_VERSION",
    "ForkedReadError",
    "GROUP_FILE",
    "Group",
    "GroupCommitError",
    "GroupMismatchError",
    "StaleStateError",
    "State",
    "StoreLockedError",
    "UncleanStopError",
    "buckets",
    "check_access",
    "check_batch",
    "checkpoint",
    "checkpoint_many",
    "close",
    "convert",
    "create",
    "deferred_sigint",
    "flush",
    "flush_many",
    "follow_threads",
    "gather",
    "join",
    "get_num_threads",
    "load_range",
    "load_rows",
    "open",
    "paging_limits",
    "prefetch",
    "prefetched",
    "read_json",
    "read_records",
    "region_memory",
    "release_range",
    "release_rows",
    "remove",
    "residency",
    "restore",
    "set_count",
    "set_num_threads",
    "link_files",
    "staged_dir",
    "step",
    "step_many",
    "validation",
    "wait_ranges",
    "warmup",
    "write_json",
    "write_records",
]
