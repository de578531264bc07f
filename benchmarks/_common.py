"""Shared helpers of the benchmark scripts: batches, memory readings, timing, output files."""

from __future__ import annotations

import csv
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def mem() -> dict[str, int]:
    """RssAnon and RssFile of this process, in bytes (from /proc/self/status)."""
    out = {"RssAnon": 0, "RssFile": 0}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in out:
                    out[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def pages_written() -> int:
    """Pages the kernel has written back since boot, system-wide (``nr_written``); 0 if unknown.

    The delta over a timed loop, per step, shows how much of a step's cost is writeback on
    a quiet machine.
    """
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("nr_written "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def own_cgroup(named: str = "") -> Path | None:
    """This process's memory cgroup directory (v2, or v1's memory hierarchy) whose path
    contains ``named`` (e.g. ``"memcap_"``: the cap's own), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, ctrls, rel = line.split(":", 2)
        if named not in rel:
            continue
        if hier == "0":
            return Path("/sys/fs/cgroup") / rel.lstrip("/")
        if "memory" in ctrls.split(","):
            return Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
    return None


def disk_ios() -> tuple[int, int]:
    """Reads and writes completed by the machine's disks since boot (``/proc/diskstats``).

    Whole disks only (those in ``/sys/block`` with a ``device`` link: no partitions, loop or
    RAM devices), system-wide; (0, 0) where unknown. The delta over a timed loop on an
    otherwise idle machine is the I/O that loop caused.
    """
    try:
        disks = {p.name for p in Path("/sys/block").iterdir() if (p / "device").exists()}
        reads = writes = 0
        with open("/proc/diskstats") as f:
            for line in f:
                x = line.split()
                if len(x) > 7 and x[2] in disks:
                    reads += int(x[3])
                    writes += int(x[7])
        return reads, writes
    except (OSError, ValueError):
        return 0, 0


def disk_stat_file(path) -> Path | None:
    """The ``stat`` file of the block device holding ``path`` (None where there is none):
    ``/sys/dev/block/M:m/stat``, the kernel's counters of that device (``Documentation/
    ABI/stable/sysfs-block``: reads, merges, sectors, ms reading, the same for writes, in
    flight, ms busy, ms queued, then discards)."""
    dev = os.stat(path).st_dev
    f = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat")
    return f if f.is_file() and len(f.read_text().split()) >= 15 else None


def wait_disk_quiet(max_seconds: float = 120.0, window: float = 2.0,
                    ios_per_s: float = 200.0) -> float:
    """Wait until the disks do fewer than ``ios_per_s`` I/Os per second over ``window`` s.

    Writeback of an earlier run (or of a freshly created store) otherwise competes with the
    next measurement. Returns the seconds waited (``max_seconds`` if it never got quiet).
    """
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_seconds:
        a = sum(disk_ios())
        time.sleep(window)
        if sum(disk_ios()) - a < ios_per_s * window:
            break
    return time.perf_counter() - t0


def dirty_background_bytes() -> int:
    """The kernel's background writeback threshold (as ``dsa_core`` reads it)."""
    import dsa_core

    return int(dsa_core.tools.paging_limits()["dirty_background_bytes"])


def write_every_row(state, block_bytes: int = 64 << 20) -> None:
    """Write every row of a dsa_core store once, unchanged (``write_records`` of what
    ``read_records`` gives, ``block_bytes`` of records at a time): every page dirty, and in
    an in-place store every row's undo image saved since its last flush -- the state between
    flushes of a run that touched all its rows."""
    import dsa_core

    n = state.num_rows
    block = max(1, block_bytes // state.store.data[0].nbytes)
    for lo in range(0, n, block):
        ids = np.arange(lo, min(n, lo + block), dtype=np.int64)
        dsa_core.write_records(state, ids, dsa_core.read_records(state, ids))


def predirty(state) -> bool:
    """Write every page of a dsa_core store (values unchanged), as torch's moments are pre-touched.

    Returns False (and does nothing) for a store beyond the kernel's background-writeback
    threshold: pre-dirtying it would only start writeback and throttle the timed steps.
    """
    data = state.store.data
    if state.store.info.nbytes > dirty_background_bytes():
        return False
    step = max(1, (1 << 26) // data[0].nbytes)
    for lo in range(0, data.shape[0], step):
        blk = data[lo:lo + step].view(np.uint8)
        blk |= 0  # OR with 0: every byte rewritten, nothing changed
    return True


def disk_bytes(*paths, seen: set | None = None) -> int:
    """Allocated bytes of the files under ``paths``, each inode counted once (hard links,
    a base shared by snapshots); ``seen``: inodes already counted (updated), so that two
    calls split a total without counting a shared file twice."""
    seen = set() if seen is None else seen
    total = 0
    for root in paths:
        for d, _, files in os.walk(root):
            for name in files:
                st = os.lstat(os.path.join(d, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def rewrite_rows(state, chunk_rows: int | None = None) -> None:
    """Write every row's record back unchanged, once, in row order: a log store's records
    all sealed in segments, an in-place store's pages all dirtied -- a table after an epoch.
    ``chunk_rows``: rows per call (default: 64 MiB of records); a log store's region must
    hold a chunk."""
    import dsa_core

    n = state.num_rows
    if chunk_rows is None:
        chunk_rows = max(1, (64 << 20) // dsa_core.read_records(state, [0]).nbytes)
    for lo in range(0, n, chunk_rows):
        ids = np.arange(lo, min(n, lo + chunk_rows), dtype=np.int64)
        dsa_core.write_records(state, ids, dsa_core.read_records(state, ids))


def zipf_sampler(n: int, s: float, rng: np.random.Generator):
    """Ids with p(rank) ~ 1/(rank+1)^s, ranks scattered over [0, n) by a fixed permutation.

    The scatter (a multiplicative hash) keeps hot rows from sharing pages, as real ids do.
    """
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    cdf = np.cumsum(w)
    cdf /= cdf[-1]
    mult = 2654435761 % n or 1
    while np.gcd(mult, n) != 1:
        mult += 1

    def draw(b: int) -> np.ndarray:
        rank = np.searchsorted(cdf, rng.random(b), side="right")
        return (rank.astype(np.int64) * mult) % n

    return draw


def batches(n: int, b: int, steps: int, dist: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        return [rng.integers(0, n, b, dtype=np.int64) for _ in range(steps)]
    if dist == "zipf":
        draw = zipf_sampler(n, 1.1, rng)
        return [draw(b) for _ in range(steps)]
    if dist == "unique":  # b distinct ids, unsorted (the "2048 unique rows")
        return [rng.choice(n, b, replace=False) for _ in range(steps)]
    raise ValueError(f"dist must be 'uniform', 'zipf' or 'unique', got {dist!r}")


def timed(fn, items, warmup: int, max_seconds: float = float("inf")) -> np.ndarray:
    """Call ``fn(item)`` for each item; return the step times (s) after ``warmup`` calls.

    Stops early once ``max_seconds`` have passed (at least one timed call when possible).
    """
    ts = []
    stop = time.perf_counter() + max_seconds
    for k, it in enumerate(items):
        t0 = time.perf_counter()
        fn(it)
        dt = time.perf_counter() - t0
        if k >= warmup:
            ts.append(dt)
        if ts and time.perf_counter() > stop:
            break
    return np.asarray(ts)


def machine() -> dict[str, object]:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(),
            "machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def write_results(name: str, rows: list[dict], meta: dict, plot=None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    base = RESULTS / name
    with open(base.with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    if rows:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        with open(base.with_suffix(".csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
    if plot is not None and rows:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
        else:
            fig = plot(plt, rows)
            fig.savefig(base.with_suffix(".png"), dpi=110, bbox_inches="tight")
            plt.close(fig)
    return base


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    width = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, width, strict=True)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, width, strict=True)))


def result_args(ap, default_name: str) -> None:
    """``--name``, ``--no-save`` and the hidden ``--child`` of a benchmark that writes one
    result file and runs each case in a child process of its own (under a memory cgroup)."""
    import argparse

    ap.add_argument("--name", default=None, help="result file benchmarks/results/NAME.json "
                    f"(default: {default_name})")
    ap.add_argument("--no-save", action="store_true", help="write no result file")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def child_reply(a, run) -> bool:
    """In a ``--child`` process: print ``run(a)`` as one JSON line (the parent reads it) and
    return True; else False."""
    if not a.child:
        return False
    import json

    print(json.dumps(run(a)), flush=True)
    return True
