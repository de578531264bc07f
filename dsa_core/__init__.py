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
``adapters.jax`` sit on this public API and on ``dsa_core.tools`` (atomic JSON files and
directories, the paging hint, the shared argument checks: tooling, not the user's API).
"""

from ._files import ForkedReadError, InDoubtError
from ._layout import FORMAT_VERSION
from ._log.store import region_memory
from ._pool import get_num_threads, set_num_threads
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
from ._group import Group, GroupCommitError, GroupMismatchError, flush_many, join, step_many
from ._inplace.store import StoreLockedError, UncleanStopError
from . import tools  # noqa: E402  (the adapters' and the CLI's face: docs/CORE_API.md)
from . import buckets  # noqa: E402  (last: it looks dsa_core.* up when called)

__version__ = "0.1.0"

# what docs/CORE_API.md documents for users (tests/core/test_public_face.py pins it)
__all__ = [
    "FORMAT_VERSION",
    "ForkedReadError",
    "Group",
    "GroupCommitError",
    "GroupMismatchError",
    "InDoubtError",
    "StaleStateError",
    "State",
    "StoreLockedError",
    "UncleanStopError",
    "buckets",
    "check_batch",
    "checkpoint",
    "checkpoint_many",
    "close",
    "convert",
    "create",
    "flush",
    "flush_many",
    "gather",
    "get_num_threads",
    "join",
    "load_range",
    "load_rows",
    "open",
    "prefetch",
    "prefetched",
    "read_records",
    "region_memory",
    "release_range",
    "release_rows",
    "remove",
    "residency",
    "restore",
    "set_count",
    "set_num_threads",
    "step",
    "step_many",
    "tools",
    "wait_ranges",
    "warmup",
    "write_records",
]
