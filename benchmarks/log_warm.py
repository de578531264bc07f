"""Warm step of the log-structured store against the in-place store, in one process.

Three stores of the same table (float32, weights in the store, ``dsa_core.create`` with
``init="normal"``): the in-place store mapped as ``access="ram"``, and two log stores
(``storage="log"``) whose memory region holds the whole table or a quarter of it. Every row
is stepped once first (a zero gradient), so the in-place pages are resident and the log
regions full; then blocks of the same batches are stepped on each store in turn, round
after round, and the median step time per store is reported with its ratio to the in-place
store of the same run. The table fits in the page cache, so this measures the step's own
cost (with a quarter-size region it includes eviction, seals and cleaning, written to the
page cache), not the disk.

Run::

    python -m benchmarks.log_warm                     # 1M x 128, batch 2048, uniform ids
    python -m benchmarks.log_warm --dist zipf
    python -m benchmarks.log_warm --smoke             # tiny, for CI
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import dsa_core

from ._common import batches, machine, print_table, write_results


def run(a) -> list[dict]:
    root = Path(tempfile.mkdtemp(prefix="dsa_log_warm_", dir=a.workdir))
    n, d, b = a.rows, a.dim, a.batch
    rec = 3 * d * 4
    per_slot = rec + 64  # a slot's record plus the engine's bookkeeping (42 B), rounded up
    stores = {
        "inplace": dsa_core.create(root / "inplace", n, d, lr=1e-3, init="normal",
                                   access="ram", progress=False),
        "log, region 100%": dsa_core.create(root / "log100", n, d, lr=1e-3, init="normal",
                                            storage="log", memory=int(n * per_slot * 1.02)),
        "log, region 25%": dsa_core.create(root / "log25", n, d, lr=1e-3, init="normal",
                                           storage="log", memory=int(n * per_slot * 0.25)),
    }
    try:
        for k in stores:  # every row once: resident pages, full regions
            for lo in range(0, n, b):
                ids = np.arange(lo, min(n, lo + b))
                stores[k] = dsa_core.step(stores[k], ids, np.zeros((ids.size, d), np.float32))
        rng = np.random.default_rng(1)
        work = [(i, rng.standard_normal((b, d)).astype(np.float32))
                for i in batches(n, b, a.block, a.dist)]
        times: dict[str, list[float]] = {k: [] for k in stores}
        for _ in range(a.rounds):
            for k in stores:
                t0 = time.perf_counter()
                for idx, g in work:
                    stores[k] = dsa_core.step(stores[k], idx, g)
                times[k].append((time.perf_counter() - t0) / len(work))
        base = float(np.median(times["inplace"]))
        rows = []
        for k, ts in times.items():
            med = float(np.median(ts))
            row = {"store": k, "rows": n, "dim": d, "batch": b, "dist": a.dist,
                   "median_ms": med * 1e3, "rows_per_s": b / med, "vs_inplace": base / med,
                   "rounds": a.rounds, "steps_per_round": len(work)}
            if k != "inplace":
                st = stores[k].store.log_stats()
                row.update({f"log_{key}": st[key] for key in
                            ("segments", "seals", "misses", "write_amplification") if key in st})
            rows.append(row)
        return rows
    finally:
        for s in stores.values():
            dsa_core.close(s)
        shutil.rmtree(root, ignore_errors=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--dist", choices=["uniform", "zipf", "unique"], default="uniform")
    ap.add_argument("--block", type=int, default=40, help="steps per store per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.block, a.rounds = 20_000, 16, 256, 4, 2
    rows = run(a)
    print_table(rows, ["store", "median_ms", "rows_per_s", "vs_inplace"])
    if not a.smoke:
        path = write_results(f"log_warm_{a.dist}", rows, {"machine": machine(),
                                                          "args": vars(a)})
        print(f"wrote {path}.json/.csv")


if __name__ == "__main__":
    main()
