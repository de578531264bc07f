"""The open-time settings a store remembers: ``access`` in place, ``memory`` for a log store.

Given to ``create``, or to an ``open`` (replacing the recorded one), a setting is recorded in
the store's manifest (``"settings"``; a log store's inside its ``meta``) at the next flush;
``open`` without it uses the recorded one, else the default. The core keeps the current ones
in the store's ``Handle.settings`` (a dict; ``_handle``); ``_state`` writes them with every
manifest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["remembered", "settings_field"]


def settings_field(settings: dict[str, Any] | None) -> dict[str, Any]:
    """``{"settings": {...}}`` with the open-time settings a store remembers (``access``
    in place, ``memory`` for a log store), or nothing when there are none (as old stores)."""
    return {"settings": dict(settings)} if settings else {}


def remembered(directory: Path, recorded: Any, name: str, given: Any) -> dict[str, Any]:
    """The settings a store opens with and remembers: those its manifest records, ``name``
    replaced by ``given`` unless that is None. A recorded value is checked (``access`` one of
    "ram"/"disk", ``memory`` bytes > 0) unless ``given`` replaces it."""
    settings = dict(recorded) if isinstance(recorded, dict) else {}
    if given is not None:
        settings[name] = given
        return settings
    if name not in settings:
        return settings
    v = settings[name]
    ok = v in ("ram", "disk") if name == "access" else (
        isinstance(v, int) and not isinstance(v, bool) and v > 0)
    if not ok:
        raise ValueError(f"store {str(directory)!r} records {name}={v!r} in its manifest's "
                         f"settings, which is not a valid {name}; the manifest is damaged. "
                         f"Pass {name}= to dsa_core.open to replace it")
    return settings
