"""The log-structured engine as the registry (``dsa_core._engines``) sees it: its settings,
its life cycle (create, open, check, remove, a group's roll-forward) and its budgets.

The open store itself is one :class:`LogStore` (``engine``): it implements the ``Engine``
protocol (``dsa_core._engine``) directly over its components (``pool``, ``segments``,
``commit``, ``cleaner``, the range loads and the read-ahead). ``durability="step"`` is its
commit log (``wal``; ``_step`` drives it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from . import budget, recovery
from . import engine as log_engine
from . import format as log_format
from .budget import DEFAULT_MEMORY_SHARE, MIN_BATCH_ROWS, default_memory
from .engine import LogStore
from .._init import INIT_CHUNK_BYTES, chunks, progress_bar
from .format import FORMAT_NAME as LOG_FORMAT
from .format import MANIFEST_FILE, parse_name
from .._settings import remembered, settings_field
from .._validation import check_memory_arg

__all__ = ["DEFAULT_MEMORY_SHARE", "LOG_FORMAT", "MIN_BATCH_ROWS", "SETTINGS", "LogStore",
           "check_settings", "create_store", "default_memory", "open_store", "region_memory",
           "remove_store"]


def region_memory(layout: Any, rows: int) -> int:
    """The smallest ``memory=`` of a log store whose region holds ``rows`` records.

    ``layout`` is a ``State`` or its ``state.layout``. ``memory=`` is all the memory the
    store keeps: the index of the table (8 bytes per row: the row locations), each record
    slot (the record plus 42 bytes of bookkeeping), and buffers that grow with the region
    (background writes, cleaning reads, a seal's staging; at most about 210-250 MiB
    together, docs/storage.md "Memory"). One step's distinct rows must fit in the region.

    >>> import tempfile, dsa_core
    >>> s = dsa_core.create(tempfile.mkdtemp() + "/t", 1000, 8, storage="log", memory="1MiB")
    >>> need = dsa_core.region_memory(s, 100)
    >>> need > 1000 * 16 + 100 * (s.layout["stride"] * 4 + 42)  # the buffers come on top
    True
    >>> dsa_core.close(s)
    """
    lay = layout.layout if hasattr(layout, "layout") else layout
    if isinstance(rows, (bool, np.bool_)) or not isinstance(rows, (int, np.integer)) \
            or rows < 1:
        raise ValueError(f"rows must be an int >= 1 (the records the region must hold), got "
                         f"{rows!r}")
    return budget.memory_for(dict(lay), int(rows))


# -- the engine's life cycle (dsa_core._engines) ----------------------------------------------
SETTINGS = ("memory",)  # the open-time settings a log store takes and remembers


def check_settings(layout: dict[str, Any], *, access: str, memory: Any,
                   space_ratio: Any) -> dict[str, Any]:
    """The settings of a new log store (``memory``), refusing an in-place store's; the
    budget (given or default) must hold at least one record."""
    if access != "auto":
        raise ValueError(f"access={access!r} is for in-place stores (how their mapping is "
                         "paged); a log store (storage='log') has no mapping and takes "
                         "memory= instead: leave access='auto'")
    memory = check_memory_arg(memory, "log")
    budget.check_memory(layout, default_memory(layout) if memory is None else memory, 1)
    return {} if memory is None else {"memory": memory}


def create_store(directory: Path, layout: dict[str, Any], settings: dict[str, Any], *,
                 init: Any, init_scale: float, seed: int, ball_maxnorm: float | None,
                 meta: dict[str, Any], overwrite: bool, progress: bool | None,
                 space_ratio: float | None) -> LogStore:
    """A new log store at ``directory`` (arguments checked by ``dsa_core.create``). Named
    inits are computed when a row is first read (``_init``); an init array is written in
    chunks; the first flush commits it. On any error its files are removed."""
    memory = settings.get("memory") or default_memory(layout)
    named = init if isinstance(init, str) else "zeros"
    dt = np.dtype(layout["dtype"])
    eng = log_engine.create(directory, layout, memory_bytes=memory, init=named,
                      init_scale=float(init_scale), seed=int(seed), ball_maxnorm=ball_maxnorm,
                      space_ratio=2.0 if space_ratio is None else space_ratio,
                      overwrite=overwrite)
    eng._memory_setting = settings.get("memory")
    eng._commit_meta(meta)  # the first flush names a commit log if durability="step"
    try:
        if init is not None and not isinstance(init, str):
            lay = eng.layout
            o, d = lay.w_off, lay.dim
            rows = max(1, INIT_CHUNK_BYTES // (lay.stride * dt.itemsize))
            blocks = list(chunks(lay.num_rows, rows))
            bar = progress_bar(len(blocks), progress, f"init {directory.name}")
            try:
                for lo, hi in blocks:
                    rec = np.zeros((hi - lo, lay.stride), dt)
                    rec[:, o:o + d] = np.asarray(init[lo:hi], dtype=dt)
                    eng.write(np.arange(lo, hi, dtype=np.int64), rec)
                    if bar is not None:
                        bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        eng.flush(0)
    except BaseException:
        eng.abandon()  # nothing of this create is worth keeping: drop it unflushed
        for entry in os.listdir(directory):  # only the log store's own files
            if parse_name(entry) is not None or entry.startswith(MANIFEST_FILE):
                (directory / entry).unlink(missing_ok=True)
        raise
    eng._watch()
    return eng


def check_batch(layout: dict[str, Any], memory_bytes: int, rows: int) -> None:
    """Raise the budget's ``ValueError`` for a step of ``rows`` distinct rows that the
    region of ``memory_bytes`` cannot hold: it names the ``memory=`` that would."""
    budget.check_memory(layout, memory_bytes, rows)


def warmup() -> None:
    """Nothing of its own to compile beyond the core's kernels (``dsa_core.warmup``)."""


def open_store(directory: Path, mode: str, *, access: str, memory: Any,
               unclean: str) -> tuple[LogStore, int, dict[str, Any], dict[str, Any]]:
    """Open a log store at its last flush (a writer replays its commit log):
    ``(store, count, meta, settings)`` (the settings to remember: ``memory`` if recorded or
    given). ``unclean`` changes nothing: a log store never reopens mixed."""
    memory = check_memory_arg(memory, "log")
    if access != "auto":
        raise ValueError(f"access={access!r} is for in-place stores; {str(directory)!r} is "
                         "a log store (storage='log'): leave access='auto' and size its "
                         "region with memory=")
    manifest = log_format.read_manifest(directory)
    meta = manifest.get("meta")
    settings = remembered(directory, meta.get("settings") if isinstance(meta, dict) else None,
                          "memory", memory)
    if mode == "r+" and memory is None:  # the recorded budget, else the default
        memory = settings.get("memory") or default_memory(manifest["layout"])
    eng = log_engine.open(directory, mode, memory_bytes=memory, check="headers")
    eng._memory_setting = settings.get("memory")
    c = eng._commit
    c.meta = {**c.meta, **settings_field(settings)}  # any flush remembers a new one
    eng._watch()
    return eng, eng.count, c.meta, settings


def check_files(directory: Path) -> list[tuple[str, str | None, str]]:
    """Every file of the log store checked on its own, without opening it (``dsa verify``):
    ``(file, problem or None, what was checked)``; see ``_log.recovery.check_files``."""
    return recovery.check_files(directory)


def owns_file(name: str) -> bool:
    """One of a log store's own files (segments, index and log generations)."""
    return parse_name(name) is not None


def read_group_ref(directory: Path) -> dict[str, Any] | None:
    """The commit group a log store's manifest names (inside its ``meta``), or None."""
    meta = log_format.read_manifest(directory).get("meta")
    ref = meta.get("group") if isinstance(meta, dict) else None
    return ref if isinstance(ref, dict) else None


def roll_forward(directory: Path, payload: dict[str, Any]) -> None:
    """Install the manifest a group committed for this store (``dsa_core._group``): its
    files were made durable before the group's commit point; the writer lock is held."""
    fd = recovery.lock(directory)
    try:
        log_format.write_manifest(directory, payload)
    finally:
        os.close(fd)


def remove_store(directory: Path) -> None:
    """Delete a log store's directory (refused while a writer holds it)."""
    log_engine.remove(directory)
