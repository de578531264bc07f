"""The cost of checking every record a log store reads from a segment file (issue 25).

    python -m benchmarks.record_checks                  # 2M x 128 float32, 256 MiB region
    python -m benchmarks.record_checks --smoke

A log store's segments carry one checksum per record (``dsa_core/_log/sums.py``); every
record read back from a file -- a miss of ``step``, ``gather``, a cleaning copy -- is hashed
and compared. This measures what that costs on the out-of-core read path, where it is paid:

1. creates a ``--rows`` x ``--dim`` float32 log store with a ``--memory`` region much
   smaller than the table, writes every row once and closes it (every record then lies in
   a segment file); reopens it and runs one batch of each operation in each mode, not
   timed (first calls' one-off costs);
2. for ``--rounds`` rounds, alternating the order of the two modes round by round so that
   the machine's load hits both: ``checked`` (the default engine) and ``unchecked``
   (``dsa_core._log.format.CHECK_RECORDS = False``, which only this benchmark sets), and
   for each of ``gather`` (reads only) and ``step`` (misses, seals and cleaning): with the
   store closed (every segment unmapped), drops every file of the store from the page
   cache (``--cold``, default: ``posix_fadvise(DONTNEED)`` on the segment, index and other
   files), reopens it (empty region; not timed) and times ``--batches`` random batches of
   ``--batch`` rows, then closes it again (a ``step`` run's flush: not timed);
3. prints rows/s per mode and operation (medians over rounds), the checked/unchecked
   ratio, the share of the checked time that the checks take (``check_share`` = 1 -
   unchecked time / checked time, of the medians, with its range over the rounds'
   checked/unchecked pairs), the process's CPU time per row (all threads: what the checks
   add, less exposed than wall time to a busy machine), and the proof that the rounds
   were cold: the store's bytes still in the page cache after the drop (``mincore``) and
   the bytes this process read from the disk per timed row (``/proc/self/io``
   ``read_bytes``, medians); plus the hash's own speed in memory (GB/s).

Why the store is closed before each drop: the kernel does not drop a page some process
maps, and an open store maps its segments (``format.map_segment``), so a drop with the
store open left every page a timed run had touched cached, and later runs read them from
memory (before 2026-12-07: ``gather`` checked/unchecked wandered 0.76-1.0 run to run).

Run it on a quiet machine; the figures of ``--smoke`` mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import machine, print_table, rewrite_rows, write_results


def _store_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


def _drop_cache(directory: Path) -> None:
    """Every file of the (closed) store out of the page cache: written back, then dropped."""
    for p in _store_files(directory):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # a dirty page is not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached_bytes(directory: Path) -> tuple[int, int]:
    """``(bytes of the store's files in the page cache, bytes of its files)`` (mincore)."""
    from dsa_core._os import PAGE, page_residency

    cached = total = 0
    for p in _store_files(directory):
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            total += size
            cached += int(page_residency(fd, size).sum()) * PAGE
        finally:
            os.close(fd)
    return cached, total


def _read_bytes() -> int:
    """Bytes this process (all its threads) has had read from a block device."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - no task I/O accounting
        pass
    return -1


def _released(st) -> None:
    """Close the store and wait until its segment mappings are gone (a mapped page is never
    dropped from the page cache)."""
    import dsa_core
    from dsa_core._log.format import unmap_pending

    dsa_core.close(st)
    del st
    gc.collect()
    unmap_pending()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--memory", default="256MiB", help="the log store's region budget")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per round and op")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                    help="drop the store's files from the page cache before each timing")
    ap.add_argument("--workdir", default=None, help="where the store goes (default: TMPDIR)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: checks it runs")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.memory, a.batch, a.batches, a.rounds = 6000, 16, "400KiB", 256, 3, 1

    import dsa_core
    from dsa_core._log import format as log_format
    from dsa_core._log.sums import record_sums

    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    n_rows = a.batches * a.batch  # timed rows per run
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        path = Path(tmp) / "s"
        st = dsa_core.create(path, a.rows, a.dim, storage="log", memory=a.memory,
                             init="uniform", init_scale=1e-3, progress=False)
        # every row once: all records in segments
        rewrite_rows(st, chunk_rows=max(1, (16 << 20) // (st.store.layout.stride * 4)))
        g = (rng.standard_normal((a.batch, a.dim)) * 1e-3).astype(np.float32)
        out = np.empty((a.batch, a.dim), np.float32)
        _released(st)
        # one batch of each, in each mode, not timed, on the store reopened cold: the first
        # calls' one-off costs out of the first round (at --smoke the first gather took
        # ~1.7 s, and the first one after a reopen 0.09 s: the read-ahead's kernels, compiled
        # when first some record is not cached)
        if a.cold:
            _drop_cache(path)
        st = dsa_core.open(path, memory=a.memory)
        for check in (True, False):
            log_format.CHECK_RECORDS = check
            try:
                idx = np.sort(rng.choice(a.rows, a.batch, replace=False))
                dsa_core.gather(st, idx, out=out)
                st = dsa_core.step(st, idx, g)
            finally:
                log_format.CHECK_RECORDS = True
        _released(st)
        for r in range(a.rounds):
            modes = ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")
            for mode in modes:
                for op in ("gather", "step"):
                    ids = [np.sort(rng.choice(a.rows, a.batch, replace=False))
                           for _ in range(a.batches)]
                    if a.cold:
                        _drop_cache(path)
                    cached_drop, store_bytes = _cached_bytes(path)
                    st = dsa_core.open(path, memory=a.memory)
                    cached_open = _cached_bytes(path)[0]
                    log_format.CHECK_RECORDS = mode == "checked"
                    try:
                        io0 = _read_bytes()
                        c0, t0 = time.process_time(), time.perf_counter()
                        for idx in ids:
                            if op == "gather":
                                dsa_core.gather(st, idx, out=out)
                            else:
                                st = dsa_core.step(st, idx, g)
                        t = time.perf_counter() - t0
                        cpu = time.process_time() - c0
                        io1 = _read_bytes()
                    finally:
                        log_format.CHECK_RECORDS = True
                    _released(st)  # a step run's flush: not timed
                    runs.setdefault((mode, op), []).append({
                        "round": r, "seconds": t, "cpu_seconds": cpu,
                        "disk_read_bytes": io1 - io0,
                        "cached_after_drop": cached_drop, "cached_after_open": cached_open,
                        "store_bytes": store_bytes})
    rows = []
    for op in ("gather", "step"):
        t = {m: np.array([x["seconds"] for x in runs[(m, op)]]) for m in ("checked", "unchecked")}
        med = {m: float(np.median(t[m])) for m in t}
        share = 1 - med["unchecked"] / med["checked"]
        per_round = 1 - t["unchecked"] / t["checked"]  # the same round's pair
        for m in ("checked", "unchecked"):
            rs = runs[(m, op)]
            rows.append({
                "op": op, "mode": m, "rows_per_s": round(n_rows / med[m]),
                "checked_over_unchecked": round(med["unchecked"] / med["checked"], 4),
                "check_share": round(share, 4),
                "check_share_min": round(float(per_round.min()), 4),
                "check_share_max": round(float(per_round.max()), 4),
                "cpu_us_per_row": round(float(np.median(
                    [x["cpu_seconds"] for x in rs])) / n_rows * 1e6, 3),
                "disk_bytes_per_row": round(float(np.median(
                    [x["disk_read_bytes"] for x in rs])) / n_rows, 1),
                "cached_mib_after_drop": round(max(x["cached_after_drop"] for x in rs) / 2**20, 2),
                "cached_mib_after_open": round(max(x["cached_after_open"] for x in rs) / 2**20, 2),
                "store_mib": round(rs[-1]["store_bytes"] / 2**20, 1),
                "seconds": [round(x["seconds"], 4) for x in rs],
                "cpu_seconds": [round(x["cpu_seconds"], 4) for x in rs],
            })
    blk = rng.standard_normal((65536, 3 * a.dim)).astype(np.float32)
    record_sums(blk[:8])
    t0 = time.perf_counter()
    for _ in range(5):
        record_sums(blk)
    gbs = 5 * blk.nbytes / (time.perf_counter() - t0) / 1e9
    print_table(rows, ["op", "mode", "rows_per_s", "checked_over_unchecked", "check_share",
                       "check_share_min", "check_share_max", "cpu_us_per_row",
                       "disk_bytes_per_row",
                       "cached_mib_after_drop", "cached_mib_after_open", "store_mib"])
    print(f"check_share = 1 - unchecked/checked time (medians of {a.rounds} rounds; min/max: "
          f"each round's pair); cpu_us_per_row: this process's CPU time (all threads) of "
          f"the timed batches per row; disk_bytes_per_row: /proc/self/io read_bytes of the timed "
          f"batches / {n_rows:,} rows; cached_mib: the store's pages in the page cache "
          f"(mincore, the largest over rounds) after the drop and after the reopen")
    print(f"record hash in memory: {gbs:.2f} GB/s ({3 * a.dim * 4} B records)")
    meta = {"rows": a.rows, "dim": a.dim, "memory": a.memory, "batch": a.batch,
            "batches": a.batches, "rounds": a.rounds, "cold": a.cold, "hash_gb_s": gbs,
            "machine": machine()}
    name = "record_checks_smoke" if a.smoke else f"record_checks_{a.rows}x{a.dim}"
    write_results(name, rows, meta)
    return rows


if __name__ == "__main__":
    main()
