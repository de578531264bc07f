"""Range load / release: bring a contiguous block of rows into memory, or give it back.

The public calls check the range and hand it to the store's engine (``submit`` of a
``slice``, ``wait_ranges``): an in-place store reads the rows' bytes in file order into the
page cache and writes them back the same way (``dsa_core._inplace.ranges``); a log store
reads the range's records sequentially into its memory region and keeps them there, pinned,
until the release, which seals the changed ones in row order (``dsa_core._log.ranges``). On
both no value can change, go stale or get lost whatever the timing.

``load_rows`` / ``release_rows`` do the same for a *set* of rows anywhere in the table (the
engine's ``submit`` of sorted ids): partition-ordered training loads each buffer state's
negatives' pool with them (``dsa_core.buckets``).
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from ._engine import closed_error
from ._validation import as_index

__all__ = ["load_range", "load_rows", "release_range", "release_rows", "wait_ranges"]


# -- public API -----------------------------------------------------------------------------
def _store_of(state: Any, *, open_: bool = False):
    """The engine of ``state``; ``open_``: a ``ValueError`` if the store is closed."""
    st = getattr(state, "store", None)
    if st is None or not hasattr(st, "layout"):
        raise TypeError(f"state must be a dsa_core.State (from dsa_core.create/open), got "
                        f"{type(state).__name__}")
    if open_ and state.closed:
        raise closed_error(st)
    return st


def _bound(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int row index, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int row index, got {type(value).__name__} "
                        f"{value!r}; convert it with int(...)") from None


def _check_range(st, start: Any, stop: Any) -> tuple[int, int]:
    start, stop = _bound("start", start), _bound("stop", stop)
    n = st.layout.num_rows
    if not 0 <= start <= stop <= n:
        raise ValueError(f"the row range must satisfy 0 <= start <= stop <= num_rows = "
                         f"{n}, got start={start}, stop={stop}; rows [start, stop) "
                         "are loaded or released")
    return start, stop


def _submit(kind: str, state: Any, start: Any, stop: Any, wait: bool) -> None:
    st = _store_of(state, open_=True)
    start, stop = _check_range(st, start, stop)
    st.submit(kind, slice(start, stop), wait)


def load_range(state: Any, start: int, stop: int, *, wait: bool = False) -> None:
    """Start bringing the records of rows ``[start, stop)`` into memory, in the background.

    The rows' bytes are read **sequentially**, in large reads, on this store's range thread
    (one per store; its requests run in submission order), so that the steps which then touch
    these rows find them in memory instead of faulting them in one at a time. On an
    in-place store "memory" is the page cache: a loaded range occupies about
    ``(stop - start) * record bytes`` of it until :func:`release_range` gives it back (or
    the kernel reclaims it under pressure). On a log-structured store (``storage="log"``)
    it is the store's memory region: the range's on-disk records are read in record order
    (rows released together were sealed together) into staging buffers and put into the
    region, clean, at the next step, range call or :func:`wait_ranges`; the range's rows
    are pinned there -- never evicted -- until :func:`release_range`, and a step that needs
    rows of a range still being read waits for that load. The region must hold the loaded
    ranges beside one step's rows: a range that cannot fit is refused (``ValueError``).

    No value changes: steps may touch any row at any time -- before, during or after the
    load -- and always read and write the current data (a row a step changed before its
    record arrived keeps the step's value).

    Parameters
    ----------
    state : State
        Any State of the store (an outdated one is fine: it only locates the store).
    start, stop : int
        The rows ``[start, stop)``, with ``0 <= start <= stop <= num_rows``. An empty range
        does nothing.
    wait : bool, default False
        Return only once the rows have been read (and every earlier request of this store is
        done).

    Raises
    ------
    ValueError
        The store is closed, or the range is out of bounds. On a log store also, with
        nothing changed, when the rows of the ranges loaded and not yet released plus this
        one, beside the largest batch stepped since the store was opened, do not fit in its
        region; the message gives the ``memory=`` that would.
    TypeError
        ``start``/``stop`` are not integers.
    OSError
        An earlier background request of this store failed. Each such error is raised once,
        by the next ``load_range``/``release_range``/``wait_ranges`` call on the store:
        before that call queues anything, or (``wait=True``) once its own request is done.

    Examples
    --------
    >>> import tempfile, pathlib, dsa_core
    >>> state = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", 2000, 8)
    >>> dsa_core.load_range(state, 0, 1000, wait=True)
    >>> dsa_core.residency(state, range(1000))
    1.0
    >>> dsa_core.close(state)
    """
    _submit("load", state, start, stop, wait)


def release_range(state: Any, start: int, stop: int, *, wait: bool = False) -> None:
    """Start writing rows ``[start, stop)`` back to disk and dropping them from memory.

    In the background, on this store's range thread (after every earlier request): the
    dirty pages of the range are written **sequentially**, in file order, and waited for;
    then the kernel is asked to drop the range's (now clean) pages, giving that memory back.
    On a log-structured store (``storage="log"``) the release runs at once, in the
    calling thread: the load of the range ends (its rows are unpinned; a load still in
    flight stops), the range's dirty rows in the region are sealed together (sequential
    writes, in row order) and its region slots are freed for other rows; rows that another
    loaded range still covers stay. ``wait`` changes nothing there. A read-only log store
    has nothing to release.

    A hint: no value changes and no update is lost. A step may write these rows while the
    release runs, or after it: the kernel never drops a page without writing its changes, so
    such a row simply stays (or comes back) in memory. The write-back is not a flush: the
    manifest (step count, hyper-parameters) is only made durable by :func:`dsa_core.flush`.
    A read-only store may release too (it has nothing to write).

    Parameters
    ----------
    state : State
        Any State of the store (an outdated one is fine).
    start, stop : int
        The rows ``[start, stop)``, with ``0 <= start <= stop <= num_rows``. An empty range
        does nothing.
    wait : bool, default False
        Return only once the range has been written and dropped (and every earlier request
        of this store is done).

    Raises
    ------
    ValueError, TypeError, OSError
        As :func:`load_range`. A write error of the release (e.g. ``EIO``) is raised once by
        the next call on the store, and also by the store's next ``flush``/``close``.

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> state = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", 2000, 8)
    >>> state = dsa_core.step(state, np.arange(100), np.ones((100, 8), np.float32))
    >>> before = dsa_core.gather(state, np.arange(2000))
    >>> dsa_core.release_range(state, 0, 1000, wait=True)   # written back, then dropped
    >>> bool((dsa_core.gather(state, np.arange(2000)) == before).all())   # values unchanged
    True
    >>> dsa_core.close(state)
    """
    _submit("release", state, start, stop, wait)


def _check_rows(st, rows: Any) -> np.ndarray:
    """The row set as the engines take it: sorted, unique int64 ids in ``[0, num_rows)``."""
    arr = np.asarray(rows)
    if arr.shape == (0,):  # [] reads as float64: no row, whatever the dtype
        arr = arr.astype(np.int64)
    arr = as_index(arr, st.layout.num_rows, "rows")
    if arr.shape[0] > 1 and not (arr[1:] > arr[:-1]).all():
        arr = np.unique(arr)
    elif arr is rows:  # the engine keeps the set: never the caller's array, which may change
        arr = arr.copy()
    arr.flags.writeable = False
    return arr


def _submit_rows(kind: str, state: Any, rows: Any, wait: bool) -> None:
    st = _store_of(state, open_=True)
    st.submit(kind, _check_rows(st, rows), wait)


def load_rows(state: Any, rows: Any, *, wait: bool = False) -> None:
    """Start bringing the records of the rows ``rows`` -- a set, anywhere in the table --
    into memory, in the background: :func:`load_range` for rows that are not contiguous.

    On an in-place store the pages holding the rows are read into the page cache, all asked
    for at once (reads at queue depth, not one fault at a time) and mapped, on this store's
    range thread (in order with its range requests). On a log-structured store
    (``storage="log"``) the rows become a loaded *row set*: their on-disk records are read
    in the background from where they lie (per segment in file order) into the store's
    memory region and stay there, pinned -- never evicted -- until :func:`release_rows`,
    exactly like a loaded range's rows; a step that needs rows of a set still being read
    waits for that load. The region must hold the union of the loaded ranges, the loaded row
    sets and these rows beside one step's rows: a set that cannot fit is refused
    (``ValueError``, nothing changed). Partition-ordered training loads each buffer state's
    negatives' pool this way (``dsa_core.buckets``).

    No value changes: steps may touch any row at any time -- before, during or after the
    load -- and always read and write the current data.

    Parameters
    ----------
    state : State
        Any State of the store (an outdated one is fine: it only locates the store).
    rows : 1-D array-like of int
        Row ids in ``[0, num_rows)``, any order; duplicates are allowed (the set of rows is
        what is loaded). Empty: nothing is loaded.
    wait : bool, default False
        Return only once the rows have been read (and every earlier request of this store is
        done).

    Raises
    ------
    TypeError
        ``rows`` does not hold integers (floats are not rounded for you).
    ValueError
        The store is closed, or ``rows`` is not 1-D. On a log store also, with nothing
        changed, when the loaded ranges and row sets not yet released plus these rows,
        beside the largest batch stepped since the store was opened, do not fit in its
        region; the message gives the ``memory=`` that would.
    IndexError
        A row id outside ``[0, num_rows)``.
    OSError
        An earlier background request of this store failed (as :func:`load_range`).

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> state = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", 2000, 8)
    >>> rows = np.array([3, 700, 1999, 5])
    >>> dsa_core.load_rows(state, rows, wait=True)
    >>> dsa_core.residency(state, rows)
    1.0
    >>> dsa_core.release_rows(state, rows)
    >>> dsa_core.close(state)
    """
    _submit_rows("load", state, rows, wait)


def release_rows(state: Any, rows: Any, *, wait: bool = False) -> None:
    """Give back the memory of a row set loaded with :func:`load_rows`.

    On a log-structured store (``storage="log"``), at once, in the calling thread: the
    loaded row set equal to ``rows`` ends (else every loaded row set whose rows all lie in
    ``rows``; a set loaded twice is released twice); the rows of ``rows`` that no other
    loaded range or row set still holds are unpinned, the dirty ones sealed together (in
    row order) and their region slots freed. Rows another load holds stay pinned: release a
    whole set, not the part of it that no other load holds. A load of the set still in
    flight stops. ``wait`` changes nothing there; a read-only log store has nothing to
    release.

    On an in-place store nothing is dropped: the rows' pages stay in the page cache, like
    any page a step touched, until the kernel reclaims them (dropping a scattered row's page
    would drop the rows that share it too, say of a loaded partition; the kernel writes the
    changes back by itself). ``wait=True`` waits for the store's earlier requests.

    A hint: no value changes and no update is lost; not a flush (only
    :func:`dsa_core.flush` makes the manifest durable).

    Parameters
    ----------
    state : State
        Any State of the store (an outdated one is fine).
    rows : 1-D array-like of int
        As :func:`load_rows` (any order, duplicates allowed).
    wait : bool, default False
        Return only once the release is done (and every earlier request of this store).

    Raises
    ------
    TypeError, ValueError, IndexError, OSError
        As :func:`load_rows`. A write error of a log store's seal is raised by this call
        (as by :func:`release_range`).

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> state = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", 2000, 8,
    ...                         storage="log")
    >>> rows = np.array([3, 700, 1999])
    >>> dsa_core.load_rows(state, rows, wait=True)
    >>> state = dsa_core.step(state, rows, np.ones((3, 8), np.float32))
    >>> before = dsa_core.gather(state, rows)
    >>> dsa_core.release_rows(state, rows)       # sealed, slots freed
    >>> bool((dsa_core.gather(state, rows) == before).all())   # values unchanged
    True
    >>> dsa_core.close(state)
    """
    _submit_rows("release", state, rows, wait)


def wait_ranges(state: Any) -> None:
    """Block until every load/release queued so far on this store is done (row sets'
    included).

    Raises the first error a background request met since the last call that reported one
    (see :func:`load_range`). Returns at once if none was queued, and when the store is
    closed meanwhile (``close`` drops the queued requests).

    >>> import tempfile, pathlib, dsa_core
    >>> state = dsa_core.create(pathlib.Path(tempfile.mkdtemp()) / "emb", 2000, 8)
    >>> dsa_core.load_range(state, 0, 2000)
    >>> dsa_core.wait_ranges(state)
    >>> dsa_core.close(state)
    """
    _store_of(state).wait()


