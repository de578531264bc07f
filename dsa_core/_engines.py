"""The storage engines by kind: the one place where a kind's name meets its engine.

``dsa_core.create``/``open``/``remove``/``convert`` look an engine up here by the kind
``storage=`` names (``"inplace"``, ``"log"``) or by what a directory's manifest says
(:func:`kind_of`). Each engine module provides the same life cycle:

* ``SETTINGS``: the open-time settings it takes and remembers;
* ``check_settings(layout, *, access, memory, space_ratio)``: a new store's settings, a clear
  error for the other kind's;
* ``create_store(directory, layout, settings, *, init, init_scale, seed, ball_maxnorm, meta,
  overwrite, progress, space_ratio)``: the open engine of a new store, its first commit point written;
* ``open_store(directory, mode, *, access, memory, unclean)``: ``(engine, count, meta)``;
* ``remove_store(directory)``;
* ``read_group_ref(directory)``: the commit group its manifest names (``_group``), or None;
* ``roll_forward(directory, payload)``: install the manifest its group committed for it.

The open engines implement :class:`dsa_core._engine.Engine`.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from . import _log_store, _store
from ._layout import MANIFEST_FILE

__all__ = ["ENGINES", "kind_of"]

ENGINES: dict[str, ModuleType] = {"inplace": _store, "log": _log_store}


def kind_of(directory: Path) -> str | None:
    """``"log"`` or ``"inplace"`` from the manifest's format field; None without a manifest.

    Both kinds keep a ``manifest.json``; its ``"format"`` tells them apart (``"dsa-log"``
    for log stores, anything else is left to the in-place reader and its checks).
    """
    try:
        manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        return "inplace"  # let the in-place reader report what is wrong with it
    if isinstance(manifest, dict) and manifest.get("format") == _log_store.LOG_FORMAT:
        return "log"
    return "inplace"
