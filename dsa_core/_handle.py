"""One :class:`Handle` per open store: what the core keeps about it, beside its engine.

``create``/``open`` make the Handle (``_state``); every ``State`` of the store points at it
(``State.handle``; ``State.store`` is ``handle.store``, the engine), the way
``torch.optim.Optimizer`` keeps per-parameter state in ``self.state[p]`` rather than on the
tensors. The engine (``_engine.Engine``) knows nothing of it: no States, no groups, no
settings to remember, no buffers of the core's.

The Handle is the one home of:

* the newest State's ``count`` (``State.current`` compares with it) and the ``meta`` its
  last step or flush committed (what ``close`` of an outdated State records);
* the open-time ``settings`` the store remembers (written with every commit point);
* its commit group: ``group_ref``, the group its manifest names, and ``group``, the open
  group that commits it (``_group``, which talks to Handles);
* ``scratch``, the core's reused buffers (one writer, steps one after another: safe);
* ``closed``: whether ``dsa_core.close`` closed it (every close of an open store goes
  through the core; the engine's exit-time flush of a store nobody closed runs only once
  no State of it is left, or at exit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Committer", "Handle"]


class Committer(Protocol):
    """What ``_state`` asks of the open group a store belongs to (``_group._Core``): its
    flush, checkpoint and close go through the group while the store is a member."""

    def note(self, states: Sequence[Any]) -> None:
        """``states`` are their stores' newest States."""

    def stepped_since(self) -> bool:
        """Has a member stepped since the group's last commit?"""

    def flush(self, states: Sequence[Any] = ()) -> None:
        """One commit of every member at its newest step."""

    def leave(self, handle: Handle) -> None:
        """The store commits on its own from now on."""


class Handle:
    """An open store as the core keeps it (see the module docstring). ``store``: the engine;
    None only while ``create`` makes it."""

    __slots__ = ("store", "count", "meta", "settings", "group_ref", "group", "scratch",
                 "closed")

    def __init__(self, store: Any, count: int, settings: dict[str, Any],
                 group_ref: dict[str, Any] | None = None):
        self.store = store
        self.count = int(count)        # the newest State's count
        self.meta: dict[str, Any] | None = None  # committed with it by the last step or
        #                                          flush (None: none since the open)
        self.settings = settings       # open-time settings to remember (``_settings``)
        self.group_ref = group_ref     # the commit group its manifest names, or None
        self.group: Committer | None = None  # the open group that commits it
        self.scratch: dict[str, Any] = {}    # the core's reused buffers (``_engine.scratch``)
        self.closed = False                  # ``dsa_core.close`` closed it

    def __repr__(self) -> str:
        return f"Handle({self.store!r}, count={self.count})"
