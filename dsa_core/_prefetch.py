"""Out-of-core read-ahead: ask the store to bring the *next* batch's rows in while this one steps.

The calls here check the ids and hand them to the store's engine (``submit("hint", ...)``,
``residency``): an in-place store hints the kernel to read the rows' pages into the page
cache (``dsa_core._inplace.readahead``), a log store reads its on-disk records ahead. Read-ahead
only warms a cache, so it can never return a stale row or lose a write, whatever its timing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from ._engine import closed_error
from ._validation import as_index

__all__ = ["prefetch", "prefetched", "residency"]


def prefetch(state, idx: Any, *, wait: bool = False) -> None:
    """Start reading the records of rows ``idx`` into the page cache, in the background.

    Call it with the *next* batch's ids right before ``step`` on the current one. Cheap
    (the ids are checked, de-duplicated and queued) and always safe: it only warms the
    cache. ``wait=True`` returns once the hints have been issued (for tests and benchmarks).

    On a log-structured store (``storage="log"``) the rows that are neither in its memory
    region nor never written are read ahead from their segments into the page cache (the
    ``step`` that needs them copies them into the region without waiting on the disk).
    """
    st = state.store
    if state.closed:
        raise closed_error(st)
    rows = as_index(idx, st.layout.num_rows)
    if rows.size:
        st.submit("hint", rows, wait)


def prefetched(state, batches: Iterable[Any], *, ahead: int = 2, key=None) -> Iterator[Any]:
    """Yield ``batches`` unchanged while read-ahead runs ``ahead`` batches in front.

    ``key(batch)`` extracts the row ids (default: the batch itself, or its first element if it
    is a tuple). ``ahead=2`` keeps the disk busy while one batch is stepped; more batches ahead
    only compete for the page cache (figures: docs/notebook.md, design measurements). Typical
    use::

        for idx, grad in dsa_core.prefetched(state, loader):
            state = dsa_core.step(state, idx, grad)

    The ``state`` passed in only locates the store; stepping with newer states is fine.
    """
    if key is None:
        def key(b):
            return b[0] if isinstance(b, tuple) else b
    window: list[Any] = []
    for b in batches:
        window.append(b)
        prefetch(state, key(b))
        if len(window) > ahead:
            yield window.pop(0)
    yield from window


def residency(state, idx: Any) -> float:
    """Fraction of the pages holding rows ``idx`` that are in the page cache now (mincore).

    A page-cache hit rate for benchmarks; 1.0 for an empty batch. On a log-structured store
    (``storage="log"``): the fraction of the rows that are resident in its memory region.
    """
    st = state.store
    if state.closed:
        raise closed_error(st)
    rows = np.unique(as_index(idx, st.layout.num_rows))
    if rows.size == 0:
        return 1.0
    return st.residency(rows)


