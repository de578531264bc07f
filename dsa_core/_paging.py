"""Paging policy: how much memory this process may use and how a store's mapping is advised.

``access="ram"`` keeps a table in the page cache with 2 MiB folios; ``"disk"`` pages it in
4 KiB at random for tables larger than memory; ``"auto"`` chooses by size (see
:func:`auto_access`). The registry of this process's "ram" stores lives here, so that
several stores share one budget.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, NamedTuple

__all__ = ["ACCESS_MODES", "auto_access", "auto_storage", "check_access",
           "dirty_background_bytes", "memory_available", "memory_limit", "paging_limits",
           "ram_bytes_held"]

ACCESS_MODES = ("auto", "ram", "disk")
RAM_FRACTION = 0.7  # "auto" maps a store as "ram" when it fits in this share of memory


def check_access(access: Any) -> str:
    """Validate the ``access`` hint of ``create``/``open``.

    ``"ram"``: the table is expected to stay in the page cache (2 MiB huge folios, PMD
    mappings). ``"disk"``: the table is larger than memory and rows come from disk at random
    (``MADV_RANDOM``: one 4 KiB page per fault, no read-around). ``"auto"`` (default): see
    :func:`auto_access`. The environment variable
    ``DSA_ACCESS`` replaces "auto" (for adapters and scripts that do not pass ``access``).
    """
    if access not in ACCESS_MODES:
        raise ValueError(f"access must be one of {ACCESS_MODES}, got {access!r}: 'ram' when "
                         "the table fits in memory, 'disk' when it does not, 'auto' to choose "
                         "by size")
    if access == "auto":
        env = os.environ.get("DSA_ACCESS", "auto")
        if env not in ACCESS_MODES:
            raise ValueError(f"DSA_ACCESS must be one of {ACCESS_MODES}, got {env!r}")
        access = env
    return access


# -- what the process may use: /proc and the memory cgroup files ------------------------------
def _read_text(path: str) -> str | None:
    """The text of a /proc or /sys file, or None if it cannot be read (every reader below
    goes through here)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _physical_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes (``"MemAvailable"``), or None."""
    for line in (_read_text("/proc/meminfo") or "").splitlines():
        if line.startswith(field + ":"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    return None


def _number(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None  # "max" (no limit) and errors: None


class _Cgroup(NamedTuple):
    """One level of this process's memory cgroup (the innermost first), in bytes."""

    limit: int | None   # memory.max / memory.high (v2), memory.limit_in_bytes (v1); None: none
    usage: int | None   # memory.current (v2), memory.usage_in_bytes (v1): charged, cache too
    file: int | None    # page cache charged to it (active + inactive file, with descendants)


def _cgroups() -> list[_Cgroup]:
    """The levels of this process's memory cgroup, from its own up to the root.

    cgroup v2 (``0::/path`` in /proc/self/cgroup, files under /sys/fs/cgroup) and v1 (the
    ``memory`` controller, under /sys/fs/cgroup/memory). A file that cannot be read (not
    mounted, no memory controller) leaves its figure None.
    """
    out: list[_Cgroup] = []
    for line in (_read_text("/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, rel = parts
        if hier == "0":
            base, v2 = Path("/sys/fs/cgroup"), True
        elif "memory" in ctrls.split(","):
            base, v2 = Path("/sys/fs/cgroup/memory"), False
        else:
            continue
        rel_path = Path(rel.lstrip("/"))
        for p in [rel_path, *rel_path.parents]:
            d = base / p
            if v2:
                caps = [x for x in (_number(_read_text(str(d / "memory.max"))),
                                    _number(_read_text(str(d / "memory.high")))) if x is not None]
                limit = min(caps) if caps else None
                usage = _number(_read_text(str(d / "memory.current")))
                keys = ("active_file", "inactive_file")
            else:
                limit = _number(_read_text(str(d / "memory.limit_in_bytes")))
                usage = _number(_read_text(str(d / "memory.usage_in_bytes")))
                keys = ("total_active_file", "total_inactive_file")
            stat = {}
            for ln in (_read_text(str(d / "memory.stat")) or "").splitlines():
                k, _, v = ln.partition(" ")
                if k in keys and v.strip().isdigit():
                    stat[k] = int(v)
            file = sum(stat.values()) if len(stat) == len(keys) else None
            if limit is not None or usage is not None or file is not None:
                out.append(_Cgroup(limit, usage, file))
    return out


def memory_limit() -> int:
    """Bytes of memory this process may use: physical memory, capped by its cgroup(s)."""
    limit = _physical_bytes()
    for cg in _cgroups():
        if cg.limit is not None:
            limit = min(limit, cg.limit)
    return limit


def memory_available() -> int:
    """Bytes this process may still take: ``MemAvailable``, capped by its memory cgroup.

    At every level of the cgroup that has a limit: ``limit - usage + file``. ``usage``
    counts the page cache charged to the cgroup as well as its anonymous memory; the page
    cache (``file``: active + inactive file pages, this process's stores included) is
    what the kernel reclaims when the cgroup needs room, so it counts as available, as
    ``MemAvailable`` counts the file LRU of the whole machine. What stays unavailable is
    the cgroup's anonymous memory (tensors, the Python heap), which can only be swapped.
    Capped by ``MemAvailable`` and by :func:`memory_limit`, since a generous cgroup limit
    does not make the machine's memory larger.
    """
    avail = _meminfo("MemAvailable")
    avail = memory_limit() if avail is None else min(avail, memory_limit())
    for cg in _cgroups():
        if cg.limit is not None and cg.usage is not None:
            avail = min(avail, max(0, cg.limit - cg.usage) + (cg.file or 0))
    return max(0, avail)


def dirty_background_bytes() -> int:
    """The kernel's background-writeback threshold for this process's dirty pages, in bytes.

    Globally ``vm.dirty_background_bytes`` when set, else ``vm.dirty_background_ratio``
    percent of the memory available for page cache (``MemAvailable``, as the kernel's
    dirtyable memory). Inside a memory cgroup with a limit the kernel keeps a second,
    smaller domain (``mm/page-writeback.c``, cgroup v2 writeback): the same ratio applies to
    the cgroup's dirtyable memory, its page cache plus its headroom (limit - usage, the
    smallest over its levels, at most the global figure); ``dirty_background_bytes`` is
    scaled by the share that memory is of the global one. Writeback starts past either
    threshold, so this returns the smaller. cgroup v1 keeps no per-cgroup dirty threshold,
    but there dirty pages that fill the cgroup are written back by its reclaim, page by
    page in the faulting path, which is worse: the same scaled threshold is used for both.
    """
    fixed = _number(_read_text("/proc/sys/vm/dirty_background_bytes"))
    ratio = _number(_read_text("/proc/sys/vm/dirty_background_ratio"))
    avail = _meminfo("MemAvailable")
    if fixed is None or ratio is None or avail is None:
        return 1 << 30
    glob = fixed if fixed else avail * ratio // 100
    cgs = _cgroups()
    heads = [max(0, cg.limit - cg.usage) for cg in cgs
             if cg.limit is not None and cg.usage is not None and cg.limit < _physical_bytes()]
    if not heads:
        return glob
    file = next((cg.file for cg in cgs if cg.file is not None), 0)  # the innermost level's
    dirtyable = file + min(min(heads), avail)
    local = fixed * dirtyable // max(1, avail) if fixed else dirtyable * ratio // 100
    return min(glob, local)


_RAM_STORES: weakref.WeakSet = weakref.WeakSet()  # open stores of this process mapped "ram"


def ram_bytes_held() -> int:
    """Bytes of the stores this process holds open with ``access="ram"``."""
    return sum(st.info.nbytes for st in list(_RAM_STORES))  # a store leaves it as it closes


def auto_access(nbytes: int) -> str:
    """"ram" when the store fits in memory *and* may be dirty in full without writeback.

    Fits: ``nbytes <= RAM_FRACTION * memory_available()``: the memory this process may
    still take (its cgroup's limit less what the cgroup holds beyond reclaimable page cache,
    capped by ``MemAvailable``), so memory that tensors already hold does not count.
    Without writeback: ``nbytes <= dirty_background_bytes()`` (scaled to the cgroup's
    memory inside one). The second matters because the kernel writes a dirty huge
    folio back whole: a store past the threshold, mapped with huge pages, writes 2 MiB back
    for every row a step changes, and its steps become tens of times slower than with 4 KiB
    pages (figures: docs/notebook.md, design measurements). Both limits
    are shared by every store of the process, so the "ram" stores it already holds open count
    against them: of two stores that each fit alone but not together, the second gets "disk".
    """
    total = nbytes + ram_bytes_held()
    if total > RAM_FRACTION * memory_available():
        return "disk"
    return "ram" if total <= dirty_background_bytes() else "disk"


def auto_storage(nbytes: int, memory_given: bool, access: str) -> str:
    """The store kind ``storage="auto"`` picks for a table of ``nbytes`` of records.

    ``"log"`` when the table is larger than the kernel's background-writeback threshold
    (``dirty_background_bytes()``, about 10% of available memory, or of the memory cgroup's
    dirtyable memory inside one): past it the kernel writes
    an in-place store's scattered dirty pages back one 4 KiB page at a time, and its steps
    become disk-bound (10M x 128 on 24 GiB: 0.13x ``torch.optim.SparseAdam``), while a log
    store writes sequentially. Below it ``"inplace"``, which is the faster of the two when
    the table stays in memory (docs/notebook.md, "Warm step, 1M x 128: the in-place store
    stays the default"). A ``memory=`` budget is only a log
    store's, and ``access=`` other than "auto" only an in-place store's: either one given
    decides. The environment variable ``DSA_STORAGE`` (``inplace``/``log``) replaces the
    size rule.

    >>> auto_storage(1 << 20, False, "auto"), auto_storage(1 << 20, True, "auto")
    ('inplace', 'log')
    """
    if memory_given:
        return "log"
    if access != "auto":
        return "inplace"
    env = os.environ.get("DSA_STORAGE", "auto")
    if env not in ("auto", "inplace", "log"):
        raise ValueError(f"DSA_STORAGE must be one of ('auto', 'inplace', 'log'), got {env!r}")
    if env != "auto":
        return env
    return "log" if nbytes > dirty_background_bytes() else "inplace"


def paging_limits() -> dict[str, int | float]:
    """The figures ``access="auto"`` and ``storage="auto"`` decide by, as read now (bytes).

    ``memory_limit``: the memory this process may use (physical, capped by its cgroups);
    ``memory_available``: what it may still take (see :func:`memory_available`);
    ``ram_fraction``: the share of that a "ram" store may take; ``dirty_background_bytes``:
    the kernel's background-writeback threshold (cgroup-aware); ``ram_bytes_held``: what
    this process's open "ram" stores already take of both.

    >>> sorted(paging_limits())
    ['dirty_background_bytes', 'memory_available', 'memory_limit', 'ram_bytes_held', \
'ram_fraction']
    """
    return {"memory_limit": memory_limit(), "memory_available": memory_available(),
            "ram_fraction": RAM_FRACTION, "dirty_background_bytes": dirty_background_bytes(),
            "ram_bytes_held": ram_bytes_held()}
