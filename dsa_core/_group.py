"""Several stores that train together: one step over all of them, one commit for all of them.

An optimizer steps several tables per step (two embedding tables, the shards of one table,
the stores of a JAX optimizer state). Two promises hold for them as for one store:

* **One step over several stores is all or nothing** (:func:`step_many`): every store's
  step is checked first, then every store's kernels run, then every store commits. An
  exception anywhere before the commits (a kernel, a full disk, the second table's batch)
  puts every store back as it was, the first table included (its records are saved before
  its kernels run); a Ctrl-C that arrives meanwhile takes effect right after the step
  (:func:`deferred_sigint`), so the stores are never left one step apart in memory.
* **The stores that train together commit together** (:class:`Group`, made by
  :func:`join`): its flush is one commit of every member. Each member first makes its new
  state durable without installing it (``Engine.prepare_commit``), then the group's commit
  file (``_group_file``: one small JSON file holding every member's new manifest) replaces
  the previous one atomically -- the commit point -- and only then does each member install
  its manifest. After ``kill -9`` at any moment every member reopens at the same commit:
  before the commit file's rename, each member's new files are garbage and it reopens at the
  previous commit; after it, ``dsa_core.open`` rolls a member whose manifest is behind
  forward (``_group_file.recover``). An in-place store stepped since its last flush still
  refuses to open after a kill (``UncleanStopError``): its rows may mix steps; the group
  never hides that. With ``durability="step"`` each group step first records the count
  every member must reach (a ``"step"`` commit file), then the members commit one by one:
  a kill between two members' commits leaves them one step apart, and :func:`join` (the
  adapters' resume) refuses such a group (:class:`GroupMismatchError`) instead of going on.

The cost of a group flush is that of its members' flushes plus one small file written and
synced (``benchmarks/group_flush.py`` measures it); the members prepare in parallel threads
(their syncs overlap).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from . import _exit, _group_file
from ._engine import sync_commit
from ._handle import Handle
from ._state import State, flush, newest_meta, newest_state, require_current, state_meta
from ._files import InDoubtError
from ._step import StepPlan, abort_step, begin_step, commit_step, in_doubt, plan_step, run_step

__all__ = ["GROUP_FILE", "Group", "GroupCommitError", "GroupMismatchError", "deferred_sigint",
           "flush_many", "join", "step_many", "step_many_into"]

GROUP_FILE = "commit-group.json"  # the default name of a group's commit file


class GroupMismatchError(RuntimeError):
    """The stores of a group are not at the steps their last group commit recorded."""


class GroupCommitError(RuntimeError):
    """A group commit or a group step failed after its commit point: some members have it,
    others not yet. The group refuses to go on; reopening the stores settles it."""


# -- Ctrl-C ----------------------------------------------------------------------------------
@contextlib.contextmanager
def deferred_sigint() -> Iterator[None]:
    """Run the block with SIGINT deferred: a Ctrl-C that arrives inside takes effect when it
    ends (the previous handler is called then, ``KeyboardInterrupt`` for Python's own). A
    second Ctrl-C inside the block takes effect at once (a way out of a step that hangs,
    at the price of what the deferral protects).

    Only in the main thread (Python delivers signals there) and only where SIGINT has a
    Python handler; the previous handler is restored on the way out. Nested blocks defer
    to the outermost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        prev = signal.getsignal(signal.SIGINT)
    except (ValueError, OSError):  # pragma: no cover - no signals here
        yield
        return
    if not callable(prev) or getattr(prev, "_dsa_deferring", False):
        yield  # SIG_IGN / SIG_DFL / a C handler, or already deferred by an outer block
        return
    caught: list[tuple[int, Any]] = []

    def _defer(signum, frame):
        caught.append((signum, frame))
        if len(caught) > 1:  # insisted: now
            signal.signal(signal.SIGINT, prev)
            prev(signum, frame)

    _defer._dsa_deferring = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, _defer)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)
    if caught:
        prev(*caught[0])


# -- one step over several stores -----------------------------------------------------------
def _stores_of(states: Sequence[State]) -> None:
    seen: set[int] = set()
    for s in states:
        if id(s.handle) in seen:
            raise ValueError(f"store {str(s.path)!r} appears twice in one step of several "
                             "stores; step each store once (concatenate its ids and "
                             "gradients)")
        seen.add(id(s.handle))


def step_many(updates: Sequence[tuple]) -> list[State]:
    """One Adam step of several stores, all or nothing; returns their new States in order.

    ``updates``: ``(state, idx, grad)`` or ``(state, idx, grad, kwargs)`` tuples, ``kwargs``
    the keyword arguments of :func:`dsa_core.step` (``lr``, ``params``, ``table``); each
    store at most once. Every step is checked (and its batch coalesced) before any store
    changes; then every store's kernels run, then every store commits. An exception before
    the last commit puts every store back (records, counts and the caller's ``params`` /
    ``table`` rows); a Ctrl-C meanwhile takes effect after the step (:func:`deferred_sigint`).

    With ``durability="step"`` each commit is durable on its own: if a later store's commit
    fails after an earlier one's succeeded, the earlier store keeps its step and
    :class:`GroupCommitError` says so (a :class:`Group` records what each store must reach,
    so that a resume refuses such stores instead of going on).
    """
    ups = [u if len(u) == 4 else (*u, {}) for u in updates]
    if not ups:
        return []
    groups = {id(u[0].handle.group): u[0].handle.group for u in ups}
    only = next(iter(groups.values()))
    if len(groups) == 1 and only is not None:  # members of one group: it records the step
        return only.step(ups)
    return _step_many(ups)


def step_many_into(updates: Sequence[tuple], adopt: Callable[[list[State]], None]) -> None:
    """:func:`step_many`, its new States handed to ``adopt``: also, before it propagates,
    when an :class:`InDoubtError` says the step stood (its commit point passed, a directory
    sync failed; the error carries the States), so that a caller holding States (an
    adapter's tables) is at the stores' step whatever the outcome."""
    try:
        new = step_many(updates)
    except InDoubtError as exc:
        states = getattr(exc, "states", None)
        if states is None:  # raised before a commit point: nothing stood
            raise
        adopt(states)
        raise
    adopt(new)


def _step_many(ups: list[tuple], _before_commit=None) -> list[State]:
    """:func:`step_many` of ``(state, idx, grad, kwargs)`` tuples; ``_before_commit(plans)``
    runs after every kernel and before the first commit (a group's step record)."""
    _stores_of([u[0] for u in ups])
    undo = len(ups) > 1
    plans: list[StepPlan] = [plan_step(s, i, g, undo=undo, **kw) for s, i, g, kw in ups]
    with deferred_sigint():
        committed: list[StepPlan] = []
        try:
            for p in plans:
                begin_step(p)
                run_step(p)
            if _before_commit is not None:
                _before_commit(plans)
            for p in plans:
                try:
                    commit_step(p)
                except InDoubtError as exc:
                    if p.begun:  # raised before its commit point: aborted below
                        raise
                    committed.append(p)  # past its commit point: the step stands
                    if len(committed) == len(plans):  # every store has it: no harm done
                        raise in_doubt(exc, plans) from exc
                    raise
                committed.append(p)
        except BaseException as exc:
            if isinstance(exc, InDoubtError) and hasattr(exc, "states"):
                raise
            durable = [p for p in committed if p.state.durability == "step"]
            for p in reversed(plans):
                if p in durable:
                    continue
                if p in committed:  # an in-memory commit (durability="flush"): taken back
                    p.state.handle.count = p.t - 1  # (the engine's: by its abort_step)
                abort_step(p)
            if durable:
                done = ", ".join(f"{str(p.state.path)!r} (step {p.t})" for p in durable)
                left = ", ".join(f"{str(p.state.path)!r} (step {p.t - 1})"
                                 for p in plans if p not in durable)
                raise GroupCommitError(
                    f"a step of several stores failed after some of them had committed it "
                    f"durably (durability='step'): {done} have the step, {left} do not "
                    f"({exc!r}). They are now one step apart; do not train on. A group "
                    "(dsa_core.join, the adapters' optimizers) refuses to resume them: "
                    "restore every store of the group from the last checkpoint") from exc
            raise
    return [p.state._replace(count=p.t) for p in plans]


# -- the group --------------------------------------------------------------------------------
class _Member:
    """A store of a group: its Handle and what the group's commit file records for it."""

    __slots__ = ("handle", "key", "count", "unsynced")

    def __init__(self, handle: Handle, key: str, count: int):
        self.handle = handle
        self.key = key
        self.count = count  # what the group's commit file records for it
        self.unsynced = False  # its last install was not synced (the commit file holds it)

    def sync(self) -> None:
        """Make its last installed manifest durable: before the commit file that holds it
        is replaced."""
        if self.unsynced and not self.handle.closed:
            sync_commit(self.handle.store)
        self.unsynced = False


class _Core:
    """A group's state, apart from the :class:`Group` (its exit flush holds only this).

    It talks to its members' Handles (``_handle``): their newest count and meta, their
    commit group (``group_ref``, and ``group``: this core while they are members)."""

    def __init__(self, file: Path, gid: str, seq: int, members: list[_Member]):
        self.file = file
        self.id = gid
        self.seq = seq
        self.members = members
        self.broken: str | None = None
        self.closed = False
        self.pid = os.getpid()
        self.group: Group | None = None  # the Group object (kept alive with its stores)

    # -- helpers ------------------------------------------------------------------------------
    def live(self) -> list[_Member]:
        keep = [m for m in self.members if not m.handle.closed]
        for m in self.members:
            if m.handle.closed:
                m.handle.group = None
        self.members = keep
        return keep

    def ref(self, m: _Member, seq: int) -> dict[str, Any]:
        return {"file": os.path.relpath(self.file.resolve(), m.handle.store.path.resolve()),
                "id": self.id, "seq": int(seq)}

    def check(self) -> None:
        if self.broken is not None:
            raise GroupCommitError(self.broken)
        if self.closed:
            raise ValueError(f"the group of {str(self.file)!r} is closed")

    def stepped_since(self) -> bool:
        """Has a member stepped since the group's last commit?"""
        return any(m.handle.count != m.count for m in self.live())

    def leave(self, handle: Handle) -> None:
        """The store of ``handle`` commits on its own from now on (it was closed, say)."""
        self.members = [m for m in self.members if m.handle is not handle]
        if handle.group is self:
            handle.group = None

    def note(self, states: Sequence[State]) -> None:
        """``states`` (current) are their stores' newest States: their hyperparameters are
        what the next group commit records (a step records its own)."""
        for s in states:
            if s.handle.group is self:
                s.handle.meta = state_meta(s)

    # -- flush: the group commit ----------------------------------------------------------------
    def flush(self, states: Sequence[State] = ()) -> None:
        self.check()
        for s in states:
            require_current(s)
        self.note(states)
        members = self.live()
        if not members:
            return
        seq = self.seq + 1
        with deferred_sigint():
            old_refs = [m.handle.group_ref for m in members]
            counts = [m.handle.count for m in members]
            payloads: list[dict | None] = [None] * len(members)
            errors: list[BaseException | None] = [None] * len(members)

            def prepare(k: int) -> None:
                h = members[k].handle
                try:
                    members[k].sync()  # the commit file that holds its last install goes next
                    h.group_ref = self.ref(members[k], seq)
                    payloads[k] = h.store.prepare_commit(counts[k], newest_meta(h))
                except BaseException as exc:  # noqa: BLE001 - raised below
                    errors[k] = exc

            try:
                _in_parallel(prepare, len(members))
            except BaseException as exc:  # a second Ctrl-C, say: nothing is committed
                errors[0] = errors[0] or exc
            failed = [e for e in errors if e is not None]
            if failed:
                for k, m in enumerate(members):
                    if payloads[k] is not None:
                        m.handle.store.cancel_commit()
                    m.handle.group_ref = old_refs[k]
                raise failed[0]
            record = {"id": self.id, "seq": seq, "kind": "flush",
                      "members": {m.key: {"count": c, "payload": p}
                                  for m, c, p in zip(members, counts, payloads, strict=True)}}
            try:
                _group_file.write(self.file, record)
            except _group_file.InDoubtError as exc:
                self.broken = (f"the group commit of {str(self.file)!r} is in doubt ({exc}); "
                               "stop this process: dsa_core.open settles every store at the "
                               "commit that is on disk")
                raise GroupCommitError(self.broken) from exc
            except BaseException:
                for k, m in enumerate(members):
                    m.handle.store.cancel_commit()
                    m.handle.group_ref = old_refs[k]
                raise
            self.seq = seq
            for m, c in zip(members, counts, strict=True):
                m.count = c
            bad = []
            for m in members:
                # the commit file holds the manifest until the next one replaces it (each
                # member syncs its manifest first): no sync here, so a group flush costs its
                # members' data syncs (overlapping) and one commit file. A durability="step"
                # store's manifest names the commit log its next step appends to: synced
                durable = m.handle.meta["durability"] == "step"
                try:
                    m.handle.store.install_commit(durable)
                    m.unsynced = not durable
                except BaseException as exc:  # noqa: BLE001 - reported below
                    bad.append((m, exc))
            if bad:
                names = ", ".join(f"{str(m.handle.store.path)!r} ({e!r})" for m, e in bad)
                self.broken = (f"the group commit {seq} of {str(self.file)!r} is durable, but "
                               f"{names} could not install it; stop this process: "
                               "dsa_core.open installs it (the stores reopen at the same step)")
                raise GroupCommitError(self.broken) from bad[0][1]

    # -- steps ------------------------------------------------------------------------------------
    def step(self, updates: Sequence[tuple]) -> list[State]:
        self.check()
        ups = [u if len(u) == 4 else (*u, {}) for u in updates]
        by = {id(m.handle) for m in self.members}
        for u in ups:
            if id(u[0].handle) not in by:
                raise ValueError(f"store {str(u[0].path)!r} is not a member of this group")
        logged = any(u[0].durability == "step" for u in ups)
        hook = self.record_step if logged else None
        try:
            new = _step_many(ups, _before_commit=hook)
        except GroupCommitError as exc:
            self.broken = str(exc)
            raise
        return new  # (each commit_step recorded its State's meta in its Handle)

    def record_step(self, plans: list[StepPlan]) -> None:
        """Before the members of a ``durability="step"`` group step commit: the count each
        must hold afterwards, in the group's commit file (a resume compares)."""
        after = {id(p.state.handle): p.t for p in plans
                 if p.state.durability == "step"}
        members = self.live()
        counts = {}
        for m in members:
            if id(m.handle) in after:
                counts[m.key] = after[id(m.handle)]
            elif m.handle.meta["durability"] == "step":
                counts[m.key] = m.handle.count
            else:
                counts[m.key] = m.count
        record = {"id": self.id, "seq": self.seq + 1, "kind": "step",
                  "members": {k: {"count": c, "payload": None}
                              for k, c in counts.items()}}
        for m in members:  # this file replaces the one holding their manifests
            m.sync()
        _group_file.write(self.file, record)
        self.seq += 1
        for m in members:
            m.count = counts[m.key]

    # -- exit -----------------------------------------------------------------------------------
    def exit_flush(self) -> None:
        """Flush at garbage collection or interpreter exit (``_exit``), in this process."""
        if os.getpid() != self.pid or self.closed or self.broken is not None \
                or not self.stepped_since():
            return
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - nowhere to raise to: say so
            _exit.report(f"dsa_core: flushing the unclosed group of {str(self.file)!r} "
                         f"failed, its steps since the last flush are lost: {exc!r}")

    def detach(self) -> None:
        self.closed = True
        for m in self.members:
            try:
                m.sync()  # on their own from now on: their manifests must be durable
            except OSError as exc:
                _exit.report(f"dsa_core: syncing the manifest of "
                             f"{str(m.handle.store.path)!r} failed: {exc!r}")
            if m.handle.group is self:
                m.handle.group = None
        self.group = None


def _in_parallel(fn, n: int) -> None:
    """``fn(k)`` for ``k < n``, in threads when ``n > 1`` (their syncs overlap)."""
    if n == 1:
        fn(0)
        return
    threads = []
    try:
        for k in range(1, n):
            t = threading.Thread(target=fn, args=(k,), name=f"dsa-group-{k}", daemon=True)
            try:
                t.start()
            except RuntimeError:  # no new threads at interpreter shutdown (newer Pythons)
                fn(k)
                continue
            threads.append(t)
        fn(0)
    finally:  # every thread done before the caller decides (even on a KeyboardInterrupt)
        pending = None
        for t in threads:
            while t.is_alive():
                try:
                    t.join()
                except KeyboardInterrupt as exc:  # wait for it all the same, then raise
                    pending = exc
        if pending is not None:
            raise pending


class Group:
    """Open stores that step and commit together (:func:`join` makes one).

    ``step(updates)`` is :func:`step_many` over members; ``flush()`` is one group commit
    (also what ``dsa_core.flush``/``checkpoint``/``close`` of any member do while the group
    is open); ``close()`` flushes and releases the members (they stay open). A group never
    closed is flushed at garbage collection or interpreter exit, before its lone stores.
    """

    def __init__(self, core: _Core):
        self._core = core
        core.group = self  # alive as long as its stores are (their Handles reach it: .group)
        self._finalizer = _exit.watch_group(self, core.exit_flush)

    @property
    def file(self) -> Path:
        """The group's commit file."""
        return self._core.file

    @property
    def states(self) -> list[State]:
        """The members' newest States, in the order given to :func:`join`."""
        return [newest_state(m.handle) for m in self._core.members]

    def step(self, updates: Sequence[tuple]) -> list[State]:
        """One step of several members, all or nothing (:func:`step_many`)."""
        return self._core.step(updates)

    def flush(self, states: Sequence[State] = ()) -> None:
        """Commit every member at its newest step, as one commit (``states``: members'
        newest States, if stepped outside :meth:`step`)."""
        self._core.flush(states)

    def close(self) -> None:
        """Flush, then release the members (they stay open, on their own). Safe twice."""
        core = self._core
        if core.closed:
            return
        try:
            if core.broken is None:
                core.flush()
        finally:
            core.detach()
            self._finalizer.detach()

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Group({str(self._core.file)!r}, {len(self._core.members)} stores, "
                f"commit {self._core.seq})")


def flush_many(states: Sequence[State]) -> None:
    """Flush several stores: one group commit for the members of one group (:func:`join`)
    if any stepped since its last commit, ``dsa_core.flush`` of each otherwise."""
    states = list(states)
    groups = {id(s.handle.group): s.handle.group for s in states if not s.closed}
    only = next(iter(groups.values()), None)
    if len(groups) == 1 and only is not None and only.stepped_since():
        for s in states:
            require_current(s)
        only.flush(states)
        return
    for s in states:
        flush(s)


def join(states: Sequence[State], file=None, *, fresh: bool = False) -> Group:
    """Make the open stores ``states`` one :class:`Group`: they commit together from now on.

    ``file``: the group's commit file (default ``commit-group.json`` in the first store's
    directory). If it records an earlier commit of these stores, each store whose manifest
    names that group must be at the step it records for it (after ``dsa_core.open``
    finished an interrupted commit; a store created since names none):
    otherwise :class:`GroupMismatchError` (they did not stop together; restore them from
    the last checkpoint). ``fresh=True`` skips that check and starts a new group (after
    every store was restored from one checkpoint, say). Then a first group commit names the
    group in every store.
    """
    states = list(states)
    if not states:
        raise ValueError("join needs at least one store")
    for s in states:
        require_current(s)
    _stores_of(states)
    have = {id(s.handle.group): s.handle.group for s in states}
    core = next(iter(have.values()))
    if len(have) == 1 and core is not None and core.group is not None \
            and {id(m.handle) for m in core.live()} == {id(s.handle) for s in states} \
            and (file is None or Path(file).resolve() == core.file.resolve()):
        core.note(states)  # these stores already are one open group
        return core.group
    for s in states:
        if s.handle.group is not None:
            raise ValueError(f"store {str(s.path)!r} already belongs to an open group of "
                             "other stores; close that group (or the optimizer that made "
                             "it) first")
    file = Path(states[0].path) / GROUP_FILE if file is None else Path(file)
    rec = None if fresh else _group_file.read(file)
    keys = [_group_file.member_key(file, s.path) for s in states]
    if rec is not None:
        bad = []
        for s, k in zip(states, keys, strict=True):
            entry = rec["members"].get(k)
            ref = s.handle.group_ref  # a store its manifest does not name in this group
            # (new, replaced, or a snapshot copied in) was never committed by it: no check
            if isinstance(entry, dict) and isinstance(ref, dict) \
                    and ref.get("id") == rec["id"] and entry.get("count") != s.count:
                bad.append(f"{str(s.path)!r} at step {s.count} (the group recorded "
                           f"{entry.get('count')})")
        if bad:
            raise GroupMismatchError(
                f"the stores of the group {str(file)!r} did not stop together: "
                f"{'; '.join(bad)}. A crash between their commits (or a store trained on "
                "its own since) left them at different steps; training on would silently "
                "mix them. Restore every store of the group from the last checkpoint (e.g. "
                "DiskSparseAdam.load_checkpoint, or dsa_core.restore of each store); if you "
                f"know the stores are consistent, delete {str(file)!r} to start a new group")
    gid = rec["id"] if rec is not None else uuid.uuid4().hex
    seq = rec["seq"] if rec is not None else 0
    members = [_Member(s.handle, k, int(s.count)) for s, k in zip(states, keys, strict=True)]
    core = _Core(file, gid, seq, members)
    for m in members:
        m.handle.group = core
    core.note(states)
    group = Group(core)
    try:
        core.flush()
    except BaseException:
        core.detach()
        group._finalizer.detach()
        raise
    return group
