"""Checkpoints of every table of an optimizer state: ``checkpoint`` and ``restore``.

Private; the public names live in :mod:`adapters.jax`.

A checkpoint is one directory, committed by one atomic rename (``dsa_core.checkpoint_many``):
one ``dsa_core.checkpoint`` per table, named after the table's key in the stores pytree,
plus ``checkpoint.json`` with the count and the tables.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

import dsa_core

from ._jax_state import (
    DiskTable,
    flatten_tables,
    one_dsa_state,
    prefix,
    replace_dsa_state,
)
from ._jax_step import check_tables

__all__ = ["CHECKPOINT_MANIFEST", "checkpoint", "restore"]

CHECKPOINT_MANIFEST = "checkpoint.json"
_CHECKPOINT_FORMAT = "dsa-jax-checkpoint"
_CHECKPOINT = "adapters.jax.checkpoint"
_RESTORE = "adapters.jax.restore"


def _table_names(tables: list[DiskTable]) -> list[str]:
    """Directory names for the tables of a checkpoint: the key path, made file-name safe.

    ``"['user']"`` -> ``user``, ``"['a'][0]"`` -> ``a_0``, a lone store -> ``store``;
    a clash gets a ``-<position>`` suffix.
    """
    names: list[str] = []
    for k, t in enumerate(tables):
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", t.name).strip("_.") or "store"
        if name in names:
            name = f"{name}-{k}"
        names.append(name)
    return names


def checkpoint(state: Any, dest, *, overwrite: bool = False) -> Path:
    """Write a consistent snapshot of every table to ``dest``; training may go on afterwards.

    ``dest`` receives one ``dsa_core.checkpoint`` per table (named after its key in the stores
    pytree: ``{"user": ..., "item": ...}`` gives ``dest/user`` and ``dest/item``; a lone store
    gives ``dest/store``) and ``checkpoint.json`` (the count and the table names). Everything
    is built in a temporary sibling directory, fsync'd and renamed into place at once: a
    crash at any moment leaves either no ``dest`` or a complete one. Replacing an existing
    checkpoint needs ``overwrite=True`` (swapped atomically where the filesystem allows).

    Resume with :func:`restore` (copies the snapshots into the live stores of an optimizer
    state), or open the snapshots themselves (``dsa_core.open(dest / "user")``, then
    ``tx.init``; training then continues *in* the checkpoint). ``state`` is sparse_adam's
    state or any optax state that holds one (``optax.chain``, ``multi_transform``, ...);
    the optax state's other parts (a dense optimizer's moments) are arrays: save them
    with your usual checkpointing.

    Returns
    -------
    Path
        ``dest``.

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> tx = dsa_jax.sparse_adam(1e-2)
    >>> opt_state = tx.init({"user": dsa_core.create(d / "u", 10, 4)})
    >>> _, opt_state = tx.update({"user": ([1], np.ones((1, 4), np.float32))}, opt_state)
    >>> sorted(p.name for p in dsa_jax.checkpoint(opt_state, d / "ckpt").iterdir())
    ['checkpoint.json', 'user']
    >>> dsa_jax.close(opt_state)
    """
    state = one_dsa_state(state, _CHECKPOINT)
    tables, _ = flatten_tables(state.stores)
    cores = [t.core_state for t in tables]  # waits for steps dispatched inside jit
    count = int(np.asarray(state.count))
    dest = Path(dest)
    check_tables(_CHECKPOINT, tables, count)
    names = _table_names(tables)
    manifest = {"format": _CHECKPOINT_FORMAT, "version": 1, "count": count,
                "tables": [{"key": t.name, "name": n, "num_rows": c.num_rows, "dim": c.dim,
                            "dtype": c.dtype.name, "curvature": c.curvature}
                           for t, n, c in zip(tables, names, cores)]}
    with dsa_core.checkpoint_many(dest, dict(zip(names, cores)), overwrite=overwrite,
                                  what=_CHECKPOINT) as tmp:
        dsa_core.tools.write_json(tmp / CHECKPOINT_MANIFEST, manifest, checksum=True)
    return dest


def _read_manifest(src: Path) -> dict:
    mpath = src / CHECKPOINT_MANIFEST
    if not mpath.is_file():
        raise FileNotFoundError(f"{_RESTORE}: {str(src)!r} is not an adapters.jax checkpoint: "
                                f"it has no {CHECKPOINT_MANIFEST}; write one with "
                                "checkpoint(opt_state, dest)")
    try:
        manifest = dsa_core.tools.read_json(mpath)  # its checksum checked
    except ValueError as exc:
        raise ValueError(f"{_RESTORE}: {str(mpath)!r} is not a checkpoint manifest: "
                         f"{exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != _CHECKPOINT_FORMAT:
        raise ValueError(f"{_RESTORE}: {str(mpath)!r} is not an adapters.jax checkpoint "
                         "manifest")
    return manifest


def restore(state: Any, src) -> Any:
    """Copy the checkpoint at ``src`` (from :func:`checkpoint`) into the stores of ``state``.

    Tables are matched by their key in the stores pytree and must have the same layout
    (shape, dtype, curvature, weights), of either store kind (an in-place snapshot restores
    into a log store and the reverse); everything is checked before anything is written.
    Then every table's records (weights, m, v) are copied in (``dsa_core.restore``), its
    count set to the checkpoint's and the store flushed. Returns the optimizer state to
    continue with (the given one becomes stale). The checkpoint is never modified. Not
    atomic: after a crash during a restore, restore again. ``state`` may be any optax state
    that holds sparse_adam's; the same structure comes back, its sparse_adam part replaced.

    Examples
    --------
    >>> import tempfile, pathlib, numpy as np, dsa_core
    >>> from adapters import jax as dsa_jax
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> tx = dsa_jax.sparse_adam(1e-2)
    >>> opt_state = tx.init(dsa_core.create(d / "emb", 10, 4))
    >>> _, opt_state = tx.update(([1], np.ones((1, 4), np.float32)), opt_state)
    >>> _ = dsa_jax.checkpoint(opt_state, d / "ckpt")          # at step 1
    >>> _, opt_state = tx.update(([2], np.ones((1, 4), np.float32)), opt_state)
    >>> opt_state = dsa_jax.restore(opt_state, d / "ckpt")     # back to step 1
    >>> int(opt_state.count), dsa_jax.core_states(opt_state).count
    (1, 1)
    >>> dsa_jax.close(opt_state)
    """
    outer, state = state, one_dsa_state(state, _RESTORE)
    tables, _ = flatten_tables(state.stores)
    src = Path(src)
    manifest = _read_manifest(src)
    count = int(manifest["count"])
    entries = {t["key"]: t for t in manifest["tables"]}
    keys = [t.name for t in tables]
    if sorted(entries) != sorted(keys):
        raise ValueError(f"{_RESTORE}: the checkpoint holds the tables {sorted(entries)}, the "
                         f"optimizer state {sorted(keys)}; restore into stores of the same "
                         "structure")
    for t in tables:
        t.sync()
    plans = []
    try:
        for t in tables:
            lab = prefix(_RESTORE, t)
            core = t._core
            if not core.writable:
                raise ValueError(f"{lab}store {str(core.path)!r} is "
                                 f"{'closed' if core.closed else 'read-only'}")
            if not core.current:  # another optimizer state has stepped this store since
                raise dsa_core.StaleStateError(
                    f"{lab}the table's dsa_core.State is stale: another optimizer state (a "
                    "second init on the same store) has stepped the store since; restore "
                    "into the optimizer state that trains it")
            snap_path = src / entries[t.name]["name"]
            if snap_path.resolve() == core.path.resolve():
                if core.count != count:
                    raise ValueError(f"{lab}the optimizer trains in the checkpoint store "
                                     f"{str(snap_path)!r} itself, now at step {core.count}, "
                                     f"not {count}; it is no longer that checkpoint")
                plans.append((t, None))
                continue
            snap = dsa_core.open(snap_path, mode="r")
            plans.append((t, snap))
            have, want = core.layout, snap.layout
            if have != want:
                raise ValueError(f"{lab}the checkpoint store {str(snap_path)!r} has layout "
                                 f"{want}, the live store {str(core.path)!r} {have}; restore "
                                 "into a store created the same way")
            if snap.count != count:
                raise ValueError(f"{lab}the checkpoint store {str(snap_path)!r} is at step "
                                 f"{snap.count}, but the checkpoint says {count}; it was "
                                 "modified after it was written")
        for t, snap in plans:
            if snap is not None:
                t._core = dsa_core.restore(t._core, snap)  # snap.count == count, checked
    finally:
        for _, snap in plans:
            if snap is not None:
                dsa_core.close(snap)
    in_jit = any(t._async for t in tables)
    new_count = jnp.asarray(count, jnp.int32) if in_jit else np.asarray(count, np.int32)
    return replace_dsa_state(outer, type(state)(new_count, state.stores))
