"""Argument checks of the log engine's entry points: a clear error before anything changes."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from .._init import INIT_KINDS

__all__ = ["check_count", "check_init_settings", "check_layout", "check_meta"]


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


def check_init_settings(layout: dict[str, Any], init: Any, init_scale: Any, seed: Any,
                        ball_maxnorm: Any, space_ratio: Any) -> tuple:
    """``(init, init_scale, seed, ball_maxnorm, space_ratio)`` checked (``create``'s rules,
    also applied to a manifest at open), or a clear error."""
    if init not in INIT_KINDS:
        raise ValueError(f"init must be one of {INIT_KINDS} (a log store computes a row's "
                         f"initial weights from (seed, row)), got {init!r}")
    if init != "zeros" and layout["w"] is None:
        raise ValueError("init sets the weights, but this layout has none (weights=False); "
                         "use init='zeros'")
    if isinstance(init_scale, (bool, np.bool_, str)):
        raise ValueError(f"init_scale must be finite and >= 0, got {init_scale!r}")
    init_scale = float(init_scale)
    if not (math.isfinite(init_scale) and init_scale >= 0):
        raise ValueError(f"init_scale must be finite and >= 0, got {init_scale}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    if ball_maxnorm is not None:
        if isinstance(ball_maxnorm, (bool, np.bool_, str)):
            raise ValueError(f"ball_maxnorm must be a finite float > 0 or None, got "
                             f"{ball_maxnorm!r}")
        ball_maxnorm = float(ball_maxnorm)
        if not (math.isfinite(ball_maxnorm) and ball_maxnorm > 0):
            raise ValueError(f"ball_maxnorm must be a finite float > 0 (the ball's projection "
                             f"radius) or None, got {ball_maxnorm}")
    if isinstance(space_ratio, (bool, np.bool_, str)):
        raise ValueError(f"space_ratio must be a finite float > 1, got {space_ratio!r}")
    space_ratio = float(space_ratio)
    if not (math.isfinite(space_ratio) and space_ratio > 1.0):
        raise ValueError(f"space_ratio must be a finite float > 1 (segment records as a "
                         f"multiple of the live ones; 2.0 by default), got {space_ratio}")
    return init, init_scale, int(seed), ball_maxnorm, space_ratio
