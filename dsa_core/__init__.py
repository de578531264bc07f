"""dsa_core: out-of-core sparse Adam for huge embedding tables (numpy + numba only).

The Adam state (and, optionally, the weights) of an embedding table lives in one file of
fixed-size row records, mapped into memory; each step updates only the rows of its batch,
in place, with Numba kernels.

>>> import numpy as np, dsa_core
>>> state = dsa_core.create(tmp / "emb", num_rows=1000, dim=8, lr=1e-2)   # doctest: +SKIP
>>> state = dsa_core.step(state, np.array([3, 7, 3]), np.ones((3, 8), np.float32))  # +SKIP
>>> dsa_core.gather(state, [3]).shape, state.count                          # doctest: +SKIP
((1, 8), 1)

The core never imports torch or jax; ``adapters.torch`` and ``adapters.jax`` sit on it.
"""

from ._format import ACCESS_MODES, FORMAT_VERSION, StoreLockedError, check_access
from ._pool import get_threads
from ._prefetch import prefetch, prefetched, residency
from ._state import State, checkpoint, close, create, flush, open, remove
from ._step import gather, step, threads, warmup

__version__ = "0.1.0"

__all__ = [
    "ACCESS_MODES",
    "FORMAT_VERSION",
    "State",
    "StoreLockedError",
    "check_access",
    "checkpoint",
    "close",
    "create",
    "flush",
    "gather",
    "get_threads",
    "open",
    "prefetch",
    "prefetched",
    "remove",
    "residency",
    "step",
    "threads",
    "warmup",
]
