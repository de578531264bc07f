"""The exit-time flush of stores that were never closed, and its failure as an exit status.

A store opened for writing and never closed is flushed when its last ``State`` is
garbage-collected or when the interpreter exits (``_store._flush_unclosed``,
``_log_store._flush_unclosed``), so that a forgotten ``close`` loses nothing. At exit that
flush must run while the store's background machinery still works: Python shuts the thread
pools of ``concurrent.futures`` down *before* the ``atexit`` callbacks (and so before the
``weakref.finalize`` callbacks that run at exit) -- a flush run there that needs a cleaning
read fails with "cannot schedule new futures after shutdown". So every exit flush is
registered here (:func:`watch`) and run by one hook registered with
``threading._register_atexit``, which Python calls before it shuts those pools (its
callbacks run newest first, and this module registers after importing the pools), then by
groups first (:func:`watch_group`: stores that commit together flush together).

A failed exit flush cannot raise anywhere: it is printed to stderr (:func:`report`) and the
process then ends with exit status 1 instead of 0 (:func:`_exit_status`, an ``atexit``
callback registered at import, so that it runs after the callbacks registered later). A
flush that fails when a store is garbage-collected earlier is printed only (as before).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (registers its pools' shutdown first)
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EXIT_STATUS_ON_FAILURE", "failed", "report", "store_gone", "watch",
           "watch_group"]

EXIT_STATUS_ON_FAILURE = 1

_stores: list[weakref.finalize] = []   # the exit flushes of unclosed stores, oldest first
_groups: list[weakref.finalize] = []   # the exit flushes of commit groups (run first)
_failures: list[str] = []
_exiting = [False]  # the exit hook has started: a failure from now on sets the exit status


def watch(obj: Any, fn: Callable[..., Any], *args: Any) -> weakref.finalize:
    """``weakref.finalize(obj, fn, *args)``, also run by the exit hook (before the pools
    shut down). Returns the finalizer (``detach`` it when the store is closed)."""
    f = weakref.finalize(obj, fn, *args)
    _stores[:] = [x for x in _stores if x.alive]
    _stores.append(f)
    return f


def watch_group(obj: Any, fn: Callable[..., Any], *args: Any) -> weakref.finalize:
    """As :func:`watch`, for a commit group: groups flush before lone stores."""
    f = weakref.finalize(obj, fn, *args)
    _groups[:] = [x for x in _groups if x.alive]
    _groups.append(f)
    return f


def report(message: str) -> None:
    """Print a failed flush of a store nobody closed to stderr; at exit, the process then
    ends with :data:`EXIT_STATUS_ON_FAILURE`."""
    if _exiting[0]:
        _failures.append(message)
    print(message, file=sys.stderr, flush=True)


def store_gone(path: Any, lockfd: int, manifest: str = "manifest.json") -> str | None:
    """Is the store opened at ``path`` still there for its exit flush (``_flush_unclosed`` of
    both kinds)? None when its writer lock file (``lockfd``: ``writer.lock``, inside the
    store's directory) is still linked, also when the store was moved: its flush runs, or
    says why it failed. Once that file is unlinked (``st_nlink == 0``: the directory was
    deleted, as ``shutil.rmtree`` or the end of a ``tempfile.TemporaryDirectory`` do):

    * ``"removed"`` when ``path`` holds no ``manifest`` now (the path is gone, or an empty
      directory was made there since, even one that reuses the old inode number): nothing
      to save, and no failure;
    * ``"replaced"`` when it does: another store (or this one with its lock file removed)
      stands there, which the flush must not write into: a failure to report.
    """
    if lockfd < 0:
        return None
    try:
        if os.fstat(lockfd).st_nlink > 0:
            return None
    except OSError:  # not ours to judge: let the flush say what is wrong
        return None
    return "replaced" if os.path.lexists(os.path.join(os.fspath(path), manifest)) \
        else "removed"


def failed() -> bool:
    """Has an exit-time flush failed in this process?"""
    return bool(_failures)


def _flush_all() -> None:
    """The exit hook: every group's flush, then every lone store's (newest first)."""
    _exiting[0] = True
    for lst in (_groups, _stores):
        for f in reversed(list(lst)):
            try:
                f()  # runs once: the weakref.finalize is dead afterwards
            except BaseException as exc:  # noqa: BLE001 - nowhere to raise to: say so
                report(f"dsa_core: exit-time flush failed: {exc!r}")


def _exit_status() -> None:
    """Last of the atexit callbacks that matter: a failed flush makes the exit status 1."""
    if _failures:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - closed or broken: nothing more to say
                pass
        os._exit(EXIT_STATUS_ON_FAILURE)


atexit.register(_exit_status)  # registered early: runs after the callbacks added later
try:
    threading._register_atexit(_flush_all)  # before concurrent.futures shuts its pools
except (AttributeError, RuntimeError):  # pragma: no cover - another Python, or at shutdown
    atexit.register(_flush_all)
