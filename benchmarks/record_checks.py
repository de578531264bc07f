"""The cost of checking every record a log store reads from a segment file (issue 25).

    python -m benchmarks.record_checks                  # 2M x 128 float32, 256 MiB region
    python -m benchmarks.record_checks --smoke

A log store's segments carry one checksum per record (``dsa_core/_log/sums.py``); every
record read back from a file -- a miss of ``step``, ``gather``, a cleaning copy -- is hashed
and compared. This measures what that costs on the out-of-core read path, where it is paid:

1. creates a ``--rows`` x ``--dim`` float32 log store with a ``--memory`` region much
   smaller than the table, writes every row once and flushes (every record then lies in a
   segment file);
2. for ``--rounds`` rounds, alternating the two modes so that the machine's load hits
   both: ``checked`` (the default engine) and ``unchecked`` (``dsa_core._log.format.
   CHECK_RECORDS = False``, which only this benchmark sets), it drops the segment files
   from the page cache (``--cold``, default: the reads then come from the disk, as out of
   core) and times ``--batches`` random batches of ``--batch`` rows of
   ``gather`` (reads only) and of ``step`` (misses, seals and cleaning);
3. prints rows/s per mode and operation (medians over rounds) and the checked/unchecked
   ratio, plus the hash's own speed in memory (GB/s).

Run it on a quiet machine; the figures of ``--smoke`` mean nothing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._common import machine, print_table, rewrite_rows, write_results


def _drop_cache(directory: Path) -> None:
    for p in directory.glob("seg-*.dsl"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--memory", default="256MiB", help="the log store's region budget")
    ap.add_argument("--batch", type=int, default=8192)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per round and op")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                    help="drop the segment files from the page cache before each timing")
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
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        path = Path(tmp) / "s"
        st = dsa_core.create(path, a.rows, a.dim, storage="log", memory=a.memory,
                             init="uniform", init_scale=1e-3, progress=False)
        # every row once: all records in segments
        rewrite_rows(st, chunk_rows=max(1, (16 << 20) // (st.store.layout.stride * 4)))
        dsa_core.flush(st)
        g = (rng.standard_normal((a.batch, a.dim)) * 1e-3).astype(np.float32)
        out = np.empty((a.batch, a.dim), np.float32)
        times: dict[tuple[str, str], list[float]] = {}
        for r in range(a.rounds):
            modes = ("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")
            for mode in modes:
                log_format.CHECK_RECORDS = mode == "checked"
                try:
                    for op in ("gather", "step"):
                        ids = [np.sort(rng.choice(a.rows, a.batch, replace=False))
                               for _ in range(a.batches)]
                        if a.cold:
                            _drop_cache(path)
                        t0 = time.perf_counter()
                        for idx in ids:
                            if op == "gather":
                                dsa_core.gather(st, idx, out=out)
                            else:
                                st = dsa_core.step(st, idx, g)
                        times.setdefault((mode, op), []).append(time.perf_counter() - t0)
                finally:
                    log_format.CHECK_RECORDS = True
        dsa_core.close(st)
    rows = []
    for op in ("gather", "step"):
        rate = {m: a.batches * a.batch / float(np.median(times[(m, op)]))
                for m in ("checked", "unchecked")}
        for m in ("checked", "unchecked"):
            rows.append({"op": op, "mode": m, "rows_per_s": round(rate[m]),
                         "checked_over_unchecked": round(rate["checked"] / rate["unchecked"], 4)})
    blk = rng.standard_normal((65536, 3 * a.dim)).astype(np.float32)
    record_sums(blk[:8])
    t0 = time.perf_counter()
    for _ in range(5):
        record_sums(blk)
    gbs = 5 * blk.nbytes / (time.perf_counter() - t0) / 1e9
    print_table(rows, ["op", "mode", "rows_per_s", "checked_over_unchecked"])
    print(f"record hash in memory: {gbs:.2f} GB/s ({3 * a.dim * 4} B records)")
    meta = {"rows": a.rows, "dim": a.dim, "memory": a.memory, "batch": a.batch,
            "batches": a.batches, "rounds": a.rounds, "cold": a.cold, "hash_gb_s": gbs,
            "machine": machine()}
    name = "record_checks_smoke" if a.smoke else f"record_checks_{a.rows}x{a.dim}"
    write_results(name, rows, meta)
    return rows


if __name__ == "__main__":
    main()
