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
from typing import Any

__all__ = ["ACCESS_MODES", "auto_access", "auto_storage", "check_access",
           "dirty_background_bytes", "memory_limit", "paging_limits", "ram_bytes_held"]

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


def memory_limit() -> int:
    """Bytes of memory this process may use: physical memory, capped by its cgroup(s)."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return limit
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, ctrls, rel = parts
        if hier == "0":  # cgroup v2
            base, name = Path("/sys/fs/cgroup"), "memory.max"
        elif "memory" in ctrls.split(","):
            base, name = Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"
        else:
            continue
        rel_path = Path(rel.lstrip("/"))
        for p in [rel_path, *rel_path.parents]:
            try:
                txt = (base / p / name).read_text().strip()
            except OSError:
                continue
            if txt.isdigit():
                limit = min(limit, int(txt))
    return limit


def dirty_background_bytes() -> int:
    """The kernel's background-writeback threshold, in bytes.

    ``vm.dirty_background_bytes`` when set, else ``vm.dirty_background_ratio`` percent of the
    memory available for page cache (MemAvailable, as the kernel's dirtyable memory).
    """
    try:
        with open("/proc/sys/vm/dirty_background_bytes") as f:
            fixed = int(f.read())
        if fixed:
            return fixed
        with open("/proc/sys/vm/dirty_background_ratio") as f:
            ratio = int(f.read())
        with open("/proc/meminfo") as f:
            avail = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable"))
        return avail * ratio // 100
    except (OSError, ValueError, StopIteration):
        return 1 << 30


_RAM_STORES: weakref.WeakSet = weakref.WeakSet()  # open stores of this process mapped "ram"


def ram_bytes_held() -> int:
    """Bytes of the stores this process holds open with ``access="ram"``."""
    return sum(st.nbytes for st in list(_RAM_STORES) if not st.closed)


def auto_access(nbytes: int) -> str:
    """"ram" when the store fits in memory *and* may be dirty in full without writeback.

    Fits: ``nbytes <= RAM_FRACTION * memory_limit()``. Without writeback: ``nbytes <=
    dirty_background_bytes()``. The second matters because the kernel writes a dirty huge
    folio back whole: a store past the threshold, mapped with huge pages, writes 2 MiB back
    for every row a step changes, and its steps become tens of times slower than with 4 KiB
    pages (figures: docs/benchmarks.md, design measurements). Both limits
    are shared by every store of the process, so the "ram" stores it already holds open count
    against them: of two stores that each fit alone but not together, the second gets "disk".
    """
    total = nbytes + ram_bytes_held()
    if total > RAM_FRACTION * memory_limit():
        return "disk"
    return "ram" if total <= dirty_background_bytes() else "disk"


def auto_storage(nbytes: int, memory_given: bool, access: str) -> str:
    """The store kind ``storage="auto"`` picks for a table of ``nbytes`` of records.

    ``"log"`` when the table is larger than the kernel's background-writeback threshold
    (``dirty_background_bytes()``, about 10% of available memory): past it the kernel writes
    an in-place store's scattered dirty pages back one 4 KiB page at a time, and its steps
    become disk-bound (10M x 128 on 24 GiB: 0.13x ``torch.optim.SparseAdam``), while a log
    store writes sequentially. Below it ``"inplace"``, which is the faster of the two when
    the table stays in memory (docs/benchmarks.md). A ``memory=`` budget is only a log
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
    """The figures ``access="auto"`` decides by, as read now (bytes).

    ``memory_limit``: the memory this process may use (physical, capped by its cgroups);
    ``ram_fraction``: the share of it a "ram" store may take; ``dirty_background_bytes``:
    the kernel's background-writeback threshold; ``ram_bytes_held``: what this process's
    open "ram" stores already take of both.

    >>> sorted(paging_limits())
    ['dirty_background_bytes', 'memory_limit', 'ram_bytes_held', 'ram_fraction']
    """
    return {"memory_limit": memory_limit(), "ram_fraction": RAM_FRACTION,
            "dirty_background_bytes": dirty_background_bytes(),
            "ram_bytes_held": ram_bytes_held()}
