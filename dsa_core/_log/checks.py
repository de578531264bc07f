"""Argument checks of the log engine's entry points: a clear error before anything changes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .._coalesce import bounds

__all__ = ["check_count", "check_layout", "check_meta", "check_rows"]


def check_layout(layout: Any) -> dict[str, Any]:
    """A copy of ``layout`` (a record layout dict), or a clear error."""
    need = ("num_rows", "dim", "dtype", "stride", "w")
    if not isinstance(layout, dict) or any(k not in layout for k in need):
        raise ValueError(f"layout must be a record layout dict (dsa_core._layout.make_layout) "
                         f"with the keys {need}, got {layout!r}")
    if np.dtype(layout["dtype"]) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"layout dtype must be float32 or float64, got {layout['dtype']!r}")
    if int(layout["num_rows"]) < 1 or int(layout["stride"]) < 1:
        raise ValueError(f"layout must have num_rows >= 1 and stride >= 1, got "
                         f"{layout['num_rows']} and {layout['stride']}")
    return dict(layout)


def check_rows(rows: Any, num_rows: int, name: str = "rows") -> np.ndarray:
    """``rows`` as a C-contiguous 1-D int64 array of ids in ``[0, num_rows)``."""
    arr = np.asarray(rows)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row ids, got dtype {arr.dtype}; convert "
                        f"with {name}.astype(np.int64)")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}; flatten it with "
                         f"{name}.reshape(-1)")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if arr.shape[0]:
        lo, hi = bounds(arr)
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name} must lie in [0, num_rows) = [0, {num_rows}); got {bad} "
                             f"(min {lo}, max {hi})")
    return arr


def check_meta(meta: Any) -> dict[str, Any]:
    """A JSON round-trip copy of ``meta`` (a dict), or a clear error before anything is
    written."""
    if not isinstance(meta, dict):
        raise TypeError(f"meta must be a dict (stored in the manifest), got "
                        f"{type(meta).__name__}")
    try:
        return json.loads(json.dumps(meta))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"meta must be JSON-serialisable (it is stored in the manifest): "
                        f"{exc}") from None


def check_count(count: Any) -> int:
    """``count`` (the number of completed steps) as an int >= 0, or a clear error."""
    if isinstance(count, (bool, np.bool_)) or not isinstance(count, (int, np.integer)) \
            or count < 0:
        raise ValueError(f"count must be an int >= 0 (the number of completed steps), got "
                         f"{count!r}")
    return int(count)
