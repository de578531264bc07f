"""Argument checks of the log engine's entry points: a clear error before anything changes."""

from __future__ import annotations

import json
from typing import Any

import numpy as np


__all__ = ["check_count", "check_layout", "check_meta"]


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
