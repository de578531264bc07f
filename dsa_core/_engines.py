"""The storage engines by kind: the one place where a kind's name meets its engine.

``dsa_core.create``/``open``/``remove``/``convert`` look an engine up here by the kind
``storage=`` names (``"inplace"``, ``"log"``) or by what a directory's manifest says
(:func:`kind_of`). Each engine module provides the same life cycle:

* ``SETTINGS``: the open-time settings it takes and remembers;
* ``check_settings(layout, *, access, memory, space_ratio)``: a new store's settings, a clear
  error for the other kind's;
* ``create_store(directory, layout, settings, *, init, init_scale, seed, ball_maxnorm, meta,
  overwrite, progress, space_ratio)``: the open engine of a new store, its first commit point
  written;
* ``open_store(directory, mode, *, access, memory, unclean)``: ``(engine, count, meta,
  settings)`` (the settings to remember: the core keeps them in the store's ``Handle``);
* ``remove_store(directory)``;
* ``check_files(directory)``: ``(file, problem or None, what was checked)`` for each of a
  store's files, checked without opening it (``dsa verify``);
* ``owns_file(name)``: whether a file name is one of its stores' own files (a directory
  holding such files but no manifest is a damaged store, :func:`orphaned_files`).
* ``read_group_ref(directory)``: the commit group its manifest names (``_group``), or None;
* ``roll_forward(directory, payload)``: install the manifest its group committed for it.
* ``warmup()``: compile (or load from numba's cache) the engine's own kernels.
* ``check_batch(layout, memory_bytes, rows)``: raise the kind's error for a step of more
  distinct rows than ``info.max_batch`` (``_step.refuse_batch``), if it has its own.

The open engines implement :class:`dsa_core._engine.Engine`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType

from ._inplace import store as inplace_store
from ._log import store as log_store
from ._files import lock_writer
from ._layout import MANIFEST_FILE

__all__ = ["ENGINES", "kind_of", "orphaned_files", "orphans_error", "remove_orphans",
           "warmup_engines"]

ENGINES: dict[str, ModuleType] = {"inplace": inplace_store, "log": log_store}


def warmup_engines() -> None:
    """Every engine's own kernels compiled (``dsa_core.warmup``)."""
    for engine in ENGINES.values():
        engine.warmup()


def orphaned_files(directory: Path) -> list[str]:
    """The store files (of any kind) in ``directory`` when it has no manifest: a store whose
    manifest is missing is damaged, not empty. Empty when it has a manifest or none exist."""
    directory = Path(directory)
    if not directory.is_dir() or (directory / MANIFEST_FILE).exists():
        return []
    return sorted(e for e in os.listdir(directory)
                  if any(m.owns_file(e) for m in ENGINES.values()))


def orphans_error(directory: Path, files: list[str]) -> FileExistsError:
    """``create``'s refusal of a directory that holds a store's files but no manifest."""
    more = f" and {len(files) - 1} more" if len(files) > 1 else ""
    return FileExistsError(
        f"{str(directory)!r} holds a data file ({files[0]}{more}) but no {MANIFEST_FILE}: a "
        "damaged store (its manifest was deleted?) that cannot be opened, and a new store "
        "over it would delete its files. Nothing was changed; restore the store from a "
        "checkpoint, or pass overwrite=True to replace it with a new store")


def remove_orphans(directory: Path) -> None:
    """Delete the store files of a directory without a manifest (``create(...,
    overwrite=True)``), under the writer lock (refused while a writer holds it)."""
    files = orphaned_files(directory)
    if not files:
        return
    fd = lock_writer(Path(directory))
    try:
        for name in files:
            (Path(directory) / name).unlink(missing_ok=True)
    finally:
        os.close(fd)


def kind_of(directory: Path) -> str | None:
    """``"log"`` or ``"inplace"`` from the manifest's format field; None without a manifest
    and without store files. A directory holding store files but no manifest is the kind
    that owns them (:func:`orphaned_files`): that engine's open says the store is damaged.

    Both kinds keep a ``manifest.json``; its ``"format"`` tells them apart (``"dsa-log"``
    for log stores, anything else is left to the in-place reader and its checks).
    """
    try:
        manifest = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    except FileNotFoundError:
        files = orphaned_files(directory)
        for kind, engine in ENGINES.items():
            if any(engine.owns_file(f) for f in files):
                return kind
        return None
    except (OSError, ValueError, UnicodeDecodeError):
        return "inplace"  # let the in-place reader report what is wrong with it
    if isinstance(manifest, dict) and manifest.get("format") == log_store.LOG_FORMAT:
        return "log"
    return "inplace"
