"""The kind of the adapters' stores (``storage=``, ``memory=``): one default, shared checks.

Private, and free of torch and JAX: the torch adapters (:mod:`adapters._torch_common`), the
sharded embedding and the JAX adapter share it.

Every adapter that creates stores takes ``storage`` (``"auto"``, ``"inplace"`` or ``"log"``,
passed on to ``dsa_core.create``) and ``memory`` (the region budget of a log store, passed on to
``dsa_core.create`` and ``dsa_core.open``). Their default is :data:`STORAGE_DEFAULT`, here
only; the adapters pass whatever they were given through to the core, without special
cases for one kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import dsa_core
from dsa_core.tools import validation

__all__ = ["STORAGE_DEFAULT", "check_kind", "check_storage_args", "check_unclean_arg",
           "unclean_error", "zero_weight_row"]

STORAGE_DEFAULT = "auto"
"""The store kind an adapter creates when none is asked for (``dsa_core.create``'s kinds)."""


def check_storage_args(storage: Any, memory: Any, access: str,
                       what: str) -> tuple[str, int | None]:
    """``storage`` and ``memory`` checked against each other and the other store options.

    Returns ``(storage, memory in bytes or None)``. ``memory`` is for ``storage="log"`` only;
    a log store has no mapping, so it takes ``access="auto"`` only. Both are refused here,
    before anything is opened or written; ``what`` names the caller in the messages.
    """
    storage = validation.check_storage(storage, what=what)
    memory = validation.check_memory_arg(memory, storage, what=what)
    if storage == "log":
        if access != "auto":
            raise ValueError(
                f"{what}: access={access!r} is for in-place stores; a log store "
                "(storage='log') has no mapping to page and sizes its in-memory region with "
                "memory= instead. Leave access='auto', or use storage='inplace'")
    return storage, memory


def check_kind(state: dsa_core.State, storage: str, what: str,
               fix: str | None = None) -> None:
    """``ValueError`` unless the existing store ``state`` is of the kind ``storage``.

    A resumed store must be of the kind asked for: resuming an in-place store as a log one
    (or the reverse) would silently give the run another memory behaviour than it asked for.
    ``"auto"`` takes the kind the store has (it was chosen when the store was created).
    ``what`` names the store; ``fix`` replaces the default remedy (convert it, or overwrite).
    """
    if storage != "auto" and state.storage != storage:
        if fix is None:
            fix = (f"copy it into the other kind with dsa_core.convert(state, dest, "
                   f"storage={storage!r}) and resume that, or overwrite=True to replace it")
        raise ValueError(
            f"{what} is a storage={state.storage!r} store, but storage={storage!r} was asked "
            f"for. Pass storage={state.storage!r} to resume it, {fix}")


def zero_weight_row(state: dsa_core.State, row: int) -> None:
    """Set the weights of row ``row`` to zero (a padding row), its m and v kept.

    Through its whole record (``dsa_core.read_records`` / ``write_records``), so it works on
    every kind of store, including those without a whole-table view (log stores). Durable
    at the next flush.
    """
    rec = dsa_core.read_records(state, np.array([row], np.int64))
    o = state.layout["w"]
    rec[:, o:o + state.dim] = 0
    dsa_core.write_records(state, np.array([row], np.int64), rec)


def check_unclean_arg(unclean: Any, what: str) -> str:
    """``unclean=``: ``"refuse"`` (the default) or ``"accept"``, as ``dsa_core.open``."""
    if unclean not in ("refuse", "accept"):
        raise ValueError(f"{what}: unclean must be 'refuse' (the default: a store left "
                         "unclean is refused) or 'accept' (open its rows as they are), got "
                         f"{unclean!r}")
    return unclean


def unclean_error(exc: Exception, what: str, path: Any, remedy: str) -> Exception:
    """The core's ``UncleanStopError`` at a resume, said at the adapter's level: the cause
    and the adapter's remedy (``remedy``: how to go back to a checkpoint)."""
    return dsa_core.UncleanStopError(
        f"{what}: the store at {str(path)!r} was left unclean: its writer process ended "
        "between flushes (SIGTERM, kill -9, an OOM kill, power loss) and its rows could not "
        "be brought back to the last flush (the machine restarted (power loss) or the "
        "store's undo record was unavailable), so they may hold steps past its count. "
        f"Nothing was changed. To go back to a checkpoint: {remedy}. To take the rows as "
        f"they are: pass unclean=\"accept\". (dsa_core: {exc})")
