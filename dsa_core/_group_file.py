"""The commit file of a group of stores that commit together, and the roll-forward at open.

A group (``dsa_core._group``) commits its stores in two phases. Each member first makes its
new state durable without installing it (``Engine.prepare_commit``: an in-place store syncs
its rows, a log store seals and syncs its segments and writes its next index), and hands
back the manifest that would commit it. Then this module writes the **group commit file**,
one small JSON file holding every member's new manifest (:func:`write`: ``_files.write_json``,
a temporary file, fsync, rename, fsync of the directory): that rename is the group's commit
point (a failed sync of the directory after it: ``_files.InDoubtError``, re-exported here).
Only then does each member install its manifest (``Engine.install_commit``).

Every member's manifest names its group (``"group": {"file", "id", "seq"}``, written with its
commits), so that :func:`recover`, run by ``dsa_core.open`` before the engine opens, can
finish a commit that a crash interrupted: a member whose manifest is older than the
group's last commit gets the manifest the group recorded for it (``roll_forward`` of its
engine module), before anything else looks at its files.

The file::

    {"format": "dsa-group", "version": 1, "id": "<hex>", "seq": int,
     "kind": "flush" | "step",
     "members": {"<member directory relative to the file's>": {"count": int,
                                                               "payload": manifest | null}},
     "checksum": "crc32:<hex>" of the JSON of everything else (sorted keys, no spaces;
                 ``_files.json_checksum``, as a manifest's)}

``kind="flush"``: a group commit, every payload set. ``kind="step"``: written before the
members of a ``durability="step"`` group commit one step each, with the count each member
must hold after it (no payload): a resume that finds another count refuses
(``_group.GroupMismatchError``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ._engines import ENGINES, kind_of
from ._files import CHECKSUM_KEY, InDoubtError, StoreLockedError, json_checksum, write_json

__all__ = ["GROUP_FORMAT", "GroupFileError", "InDoubtError", "member_key", "read", "recover",
           "write"]

GROUP_FORMAT = "dsa-group"
GROUP_VERSION = 1


class GroupFileError(ValueError):
    """A group commit file that is not one (damaged, foreign, or of a newer version)."""


def member_key(file: Path, member: Path) -> str:
    """How the group file names a member: its directory relative to the file's."""
    return os.path.relpath(Path(member).resolve(), Path(file).resolve().parent)


def read(file: Path) -> dict[str, Any] | None:
    """The group commit file's record, None if there is none, or a clear error."""
    file = Path(file)
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        return None
    remedy = ("restore every store of the group from the last checkpoint; if you know the "
              f"stores are consistent, delete {str(file)!r} to start a new group")
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise GroupFileError(f"group commit file {str(file)!r} is not valid JSON ({exc}); "
                             f"it is damaged: {remedy}") from None
    if not isinstance(rec, dict) or rec.get("format") != GROUP_FORMAT:
        raise GroupFileError(f"{str(file)!r} is not a DSA group commit file (format "
                             f"{rec.get('format') if isinstance(rec, dict) else None!r}); "
                             f"{remedy}")
    if rec.get("version") != GROUP_VERSION:
        raise GroupFileError(f"group commit file {str(file)!r} has version "
                             f"{rec.get('version')!r}; this dsa_core reads version "
                             f"{GROUP_VERSION}: upgrade dsa_core")
    if rec.get(CHECKSUM_KEY) != json_checksum(rec) or not isinstance(rec.get("members"), dict) \
            or not isinstance(rec.get("seq"), int) or rec.get("kind") not in ("flush", "step"):
        raise GroupFileError(f"group commit file {str(file)!r} fails its checksum or lacks a "
                             f"field; it is damaged: {remedy}")
    return rec


def write(file: Path, record: dict[str, Any]) -> None:
    """Replace the group commit file (``_files.write_json``: temporary file, fsync, rename,
    fsync of the directory; its checksum over the record with its format and version).

    A failure before the rename leaves the old file and no temporary (the commit did not
    happen); :class:`InDoubtError` if the directory sync fails after it (the commit may or
    may not be durable)."""
    write_json(file, dict(record, format=GROUP_FORMAT, version=GROUP_VERSION), shared=False,
               checksum=True)


def recover(directory: Path) -> None:
    """Finish the group commit a crash interrupted for the store at ``directory``.

    Called by ``dsa_core.open`` before its engine opens. Does nothing unless the store's
    manifest names a group whose file exists with the same id and records a later commit
    (``kind="flush"``) with a manifest for this store: that manifest is then installed
    (``roll_forward``; the files it references were durable before the group committed).
    Skipped while another writer holds the store (it is committing: it installs it)."""
    directory = Path(directory)
    kind = kind_of(directory)
    if kind is None:
        return
    engine = ENGINES[kind]
    try:
        ref = engine.read_group_ref(directory)
    except Exception:  # noqa: BLE001 - the engine's open reports a bad manifest
        return
    if not ref or not isinstance(ref.get("file"), str):
        return
    gfile = directory / ref["file"]
    rec = read(gfile)
    if rec is None or rec.get("id") != ref.get("id") or rec["kind"] != "flush" \
            or not isinstance(ref.get("seq"), int) or rec["seq"] <= ref["seq"]:
        return
    entry = rec["members"].get(member_key(gfile, directory))
    if not isinstance(entry, dict) or not isinstance(entry.get("payload"), dict):
        return
    try:
        engine.roll_forward(directory, entry["payload"])
    except StoreLockedError:
        return
