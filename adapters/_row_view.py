"""A read-only, array-like window on one column block of a store: :class:`RowView`.

Private; torch-free. An in-place store has whole-table numpy views (``state.weights``,
``exp_avg``, ``exp_avg_sq``); a log-structured store has none (its records live in an
in-memory region and in immutable segments). ``RowView`` stands in for such a view where an
API promised one (the DSA article's ``optimizer.state_files[name]["w"]``): indexing it
reads only the rows asked for, through the public calls ``dsa_core.gather`` (weights) and
``dsa_core.read_records`` (moments), from the store's *current* State, and returns a new
numpy array with numpy's indexing semantics.

>>> import tempfile, numpy as np, dsa_core
>>> st = dsa_core.create(tempfile.mkdtemp() + "/t", 10, 3, init=np.arange(30.).reshape(10, 3),
...                      storage="log", memory="1MiB")
>>> w = RowView(lambda: st, "w")
>>> w.shape, w[[4, 1]].tolist(), w[2, 1], w[8:, 0].tolist()
((10, 3), [[12.0, 13.0, 14.0], [3.0, 4.0, 5.0]], np.float32(7.0), [24.0, 27.0])
>>> w[0] = 1.0
Traceback (most recent call last):
    ...
ValueError: this view of store '...' is read-only: ...
>>> dsa_core.close(st)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import dsa_core

__all__ = ["RowView"]

_PARTS = {"w": "weights", "m": "first moments (m)", "v": "second moments (v)"}


class RowView:
    """Rows of the weights (``"w"``), m (``"m"``) or v (``"v"``) of a store, read on demand.

    ``current()`` returns the store's current ``dsa_core.State`` (it changes at every step);
    every read goes to it, so a read after a step sees the new rows. ``shape`` is
    ``(num_rows, dim)``; a v of one value per row (the ball, row-wise v) is shown broadcast
    over the ``dim`` columns, as the in-place views are.

    Indexing: ``view[ids]`` (an integer array or list of any shape, negative ids counting
    from the end), ``view[i]``, ``view[lo:hi:step]``, a boolean mask of length
    ``num_rows``, and any of those followed by column indices (``view[ids, 0]``,
    ``view[ids, 1:3]``) with numpy's semantics. Only the rows named are read; the result is
    a new array (writing to it changes nothing on disk).

    Not supported (a clear error): writes (``view[ids] = x``; rows change through the
    optimizer's ``step``), and turning the whole view into an array (``np.asarray(view)``:
    the table may be larger than memory; read ``view[lo:hi]`` in chunks instead). Reads
    need the store open: after the store is closed they raise.
    """

    __slots__ = ("_current", "_part")

    def __init__(self, current: Callable[[], dsa_core.State], part: str):
        if part not in _PARTS:
            raise ValueError(f"part must be one of {sorted(_PARTS)}, got {part!r}")
        self._current, self._part = current, part

    # -- array-like attributes ----------------------------------------------------------
    @property
    def shape(self) -> tuple[int, int]:
        st = self._current()
        return (st.num_rows, st.dim)

    @property
    def dtype(self) -> np.dtype:
        return self._current().dtype

    ndim = 2

    @property
    def size(self) -> int:
        n, d = self.shape
        return n * d

    def __len__(self) -> int:
        return self._current().num_rows

    def __repr__(self) -> str:
        st = self._current()
        return (f"RowView({_PARTS[self._part]} of {str(st.path)!r}, shape={self.shape}, "
                f"dtype={st.dtype.name}, read on indexing)")

    # -- reads ----------------------------------------------------------------------------
    def __getitem__(self, key: Any) -> Any:
        st = self._current()
        rows_key, rest = (key[0], key[1:]) if isinstance(key, tuple) and key else (key, ())
        rows, local = self._rows(rows_key, st.num_rows)
        block = self._read(st, rows)  # (len(rows), dim): the distinct rows named, sorted
        return block[(local,) + rest]

    def _rows(self, key: Any, n: int) -> tuple[np.ndarray, Any]:
        """The sorted distinct rows ``key`` names, and ``key`` as positions among them."""
        if isinstance(key, slice):
            ids = np.arange(n, dtype=np.int64)[key]
            rows = np.unique(ids)
            return rows, np.searchsorted(rows, ids)
        if isinstance(key, (int, np.integer)) and not isinstance(key, (bool, np.bool_)):
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for axis 0 with size {n}")
            return np.array([i % n], np.int64), 0
        if key is None or key is Ellipsis:
            raise IndexError(f"{key!r} as the row index would read the whole table; index "
                             "rows with ids, a slice or a boolean mask")
        ids = np.asarray(key)
        if ids.dtype == np.bool_:
            if ids.shape != (n,):
                raise IndexError(f"a boolean row mask must have shape ({n},), got "
                                 f"{ids.shape}")
            ids = np.flatnonzero(ids)
        elif ids.dtype.kind not in "iu":
            raise IndexError(f"row indices must be integers, a slice or a boolean mask, got "
                             f"dtype {ids.dtype}")
        ids = ids.astype(np.int64, copy=False)
        if ids.size and (ids.min() < -n or ids.max() >= n):
            bad = int(ids.min()) if ids.min() < -n else int(ids.max())
            raise IndexError(f"index {bad} is out of bounds for axis 0 with size {n}")
        ids = np.where(ids < 0, ids + n, ids)
        rows = np.unique(ids)
        return rows, np.searchsorted(rows, ids)

    def _read(self, st: dsa_core.State, rows: np.ndarray) -> np.ndarray:
        if self._part == "w":
            return dsa_core.gather(st, rows)
        if st.optimizer != "adam":
            raise ValueError(f"store {str(st.path)!r} holds {st.optimizer}'s accumulator, not "
                             f"Adam's m and v; read it with State.accumulator or "
                             f"dsa_core.read_records (its layout's \"v\" offset)")
        if self._part == "m" and st.first_moment != "full":
            raise ValueError(f"store {str(st.path)!r} keeps m as {st.first_moment}; this view "
                             "reads a full-precision m only")
        lay = st.layout
        rec = dsa_core.read_records(st, rows)
        if self._part == "m":
            return rec[:, lay["m"]:lay["m"] + st.dim]
        v = rec[:, lay["v"]:lay["v"] + lay["v_width"]]
        return v if v.shape[1] == st.dim else np.broadcast_to(v, (rows.shape[0], st.dim))

    # -- refused --------------------------------------------------------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        raise ValueError(f"this view of store {str(self._current().path)!r} is read-only: "
                         "rows change only through the optimizer's step()")

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        n, d = self.shape
        raise TypeError(
            f"this view of the {_PARTS[self._part]} of store {str(self._current().path)!r} "
            f"(a log-structured store, {n} x {d}) reads rows on indexing and is not turned "
            "into a whole array (the table may be larger than memory): index it, "
            "view[ids] or view[lo:hi], in chunks")
