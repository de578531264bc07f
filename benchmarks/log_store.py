"""The log-structured store's own costs: create, checkpoint, and disk use over many passes.

Three measurements, each printed with the baseline it is compared with in the same run:

``create``
    ``dsa_core.create(storage="log")`` of a ``--create-rows`` x ``--dim`` table (default 100M
    x 128, 153.6 GB of records) with a named init: no row is written (rows read as their
    deterministic init until first written), so it takes the same time for any size.
    Baseline: ``dsa_core.create`` of an in-place store of ``--inplace-rows`` rows with the same
    init (it writes every row), and its time scaled to the big table.
``checkpoint``
    A ``--rows`` x ``--dim`` log store (default 10M x 128) with every row written (converted
    from an in-place store), trained for ``--steps`` batches with a region of ``--memory``:
    ``dsa_core.checkpoint`` right after those steps (its flush seals the dirty region) and
    again right after a flush (the snapshot alone: hard links and an index copy). Baseline:
    a full copy of the in-place data file (``shutil.copyfile``), the in-place store's
    checkpoint. Extra disk = the blocks of the checkpoint's files that it shares with no
    other file (hard-linked segments are shared with the live store), against the index's
    size; the flush's new segment belongs to the live store and is reported apart.
``passes``
    ``--passes`` passes over a ``--pass-rows`` table (``--pass-order permutation``: every
    row once per pass, in a fresh random order; ``uniform``: as many ids drawn uniformly with
    replacement, so some rows are updated twice and some not at all, which leaves segments
    partly live and makes the cleaner work), batches of ``--batch``, with a region of
    ``--pass-memory-share`` of the state: after each pass, the disk the store's files use (``du``) against the live
    records, and the write amplification (bytes the seals and the cleaner wrote per byte
    of updated records).

Run::

    python -m benchmarks.log_store                    # all three (needs ~40 GB of disk)
    python -m benchmarks.log_store --only passes
    python -m benchmarks.log_store --smoke            # tiny, for CI

Writes ``benchmarks/results/log_store[_smoke].{json,csv}``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import dsa_core

from ._common import disk_bytes, machine, print_table, wait_disk_quiet, write_results


def own_bytes(path: Path) -> int:
    """Bytes of disk held only by files under ``path`` (not hard-linked elsewhere)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            st = os.stat(os.path.join(root, f))
            if st.st_nlink == 1:
                total += st.st_blocks * 512
    return total


def bench_create(a, root: Path) -> list[dict]:
    t0 = time.perf_counter()
    s = dsa_core.create(root / "create_log", a.create_rows, a.dim, init="normal",
                        storage="log", memory="1GiB")  # the index: 8 B per row
    t_log = time.perf_counter() - t0
    dsa_core.close(s)
    log_du = disk_bytes(root / "create_log")
    dsa_core.remove(root / "create_log")
    t0 = time.perf_counter()
    s = dsa_core.create(root / "create_inplace", a.inplace_rows, a.dim, init="normal",
                        progress=False, storage="inplace")
    dsa_core.flush(s)
    t_in = time.perf_counter() - t0
    dsa_core.close(s)
    dsa_core.remove(root / "create_inplace")
    scaled = t_in * a.create_rows / a.inplace_rows
    print(f"create: log {a.create_rows:,} rows in {t_log:.3f} s ({log_du:,} bytes on disk); "
          f"in-place {a.inplace_rows:,} rows in {t_in:.1f} s -> {scaled:.0f} s at "
          f"{a.create_rows:,} rows", flush=True)
    return [{"what": "create", "rows": a.create_rows, "log_s": t_log, "log_disk_bytes": log_du,
             "inplace_rows": a.inplace_rows, "inplace_s": t_in, "inplace_s_scaled": scaled}]


def bench_checkpoint(a, root: Path) -> list[dict]:
    src = root / "ck_inplace"
    s = dsa_core.create(src, a.rows, a.dim, init="uniform", init_scale=1e-3, progress=True,
                        storage="inplace")
    dsa_core.flush(s)
    t0 = time.perf_counter()
    shutil.copyfile(src / "rows.dsa", root / "copy.dsa")
    fd = os.open(root / "copy.dsa", os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    t_copy = time.perf_counter() - t0
    data_bytes = os.path.getsize(src / "rows.dsa")
    os.unlink(root / "copy.dsa")
    print(f"full copy of the in-place data file ({data_bytes / 1e9:.1f} GB): {t_copy:.1f} s",
          flush=True)
    log = dsa_core.convert(s, root / "ck_log", storage="log", memory=a.memory)
    dsa_core.close(s)
    dsa_core.remove(src)
    rng = np.random.default_rng(0)
    g = rng.standard_normal((a.batch, a.dim)).astype(np.float32)
    for _ in range(a.steps):
        log = dsa_core.step(log, rng.integers(0, a.rows, a.batch), g)
    dirty = log.store.log_stats()["slots_dirty"]
    index_bytes = 8 * a.rows
    out = []
    for label in ("after steps (region dirty)", "after a flush"):
        if label == "after a flush":
            dsa_core.flush(log)
            dirty = 0
        dest = root / f"ck_{len(out)}"
        wait_disk_quiet(a.quiet_seconds)
        sealed0 = log.store.log_stats()["file_bytes_written"]
        t0 = time.perf_counter()
        dsa_core.checkpoint(log, dest)
        t = time.perf_counter() - t0
        extra = own_bytes(dest)
        sealed = log.store.log_stats()["file_bytes_written"] - sealed0
        print(f"checkpoint {label}: {t:.2f} s = {t / t_copy:.3f} of the full copy; disk "
              f"{extra / 1e6:,.0f} MB of its own (index {index_bytes / 1e6:,.0f} MB); its "
              f"flush sealed {dirty:,} dirty rows ({sealed / 1e6:,.0f} MB)", flush=True)
        out.append({"what": "checkpoint", "when": label, "rows": a.rows, "seconds": t,
                    "full_copy_s": t_copy, "vs_full_copy": t / t_copy,
                    "extra_disk_bytes": extra, "index_bytes": index_bytes,
                    "data_bytes": data_bytes, "dirty_rows": dirty, "flush_bytes": sealed,
                    "extra_beyond_index_vs_data": (extra - index_bytes) / data_bytes})
        shutil.rmtree(dest)
    dsa_core.close(log)
    dsa_core.remove(root / "ck_log")
    return out


def bench_passes(a, root: Path) -> list[dict]:
    n, d, b = a.pass_rows, a.dim, a.batch
    # memory= pays for the index and the buffers too: the budget whose region holds the
    # share of the rows (a region of that share of the state)
    lay = {"num_rows": n, "stride": 3 * d, "dtype": "float32"}
    s = dsa_core.create(root / "passes", n, d, init="normal", storage="log",
                        memory=dsa_core.region_memory(lay, max(b, int(a.pass_memory_share * n))),
                        space_ratio=a.space_ratio)
    rng = np.random.default_rng(1)
    g = rng.standard_normal((b, d)).astype(np.float32)
    out = []
    for p in range(1, a.passes + 1):
        t0 = time.perf_counter()
        order = rng.permutation(n) if a.pass_order == "permutation" else rng.integers(0, n, n)
        for lo in range(0, n, b):
            idx = order[lo:lo + b]
            s = dsa_core.step(s, idx, g[:idx.shape[0]])
        dsa_core.flush(s)
        st = s.store.log_stats()
        disk = disk_bytes(root / "passes")
        out.append({"what": "passes", "order": a.pass_order, "pass": p, "rows": n,
                    "region_share": a.pass_memory_share, "space_ratio": a.space_ratio,
                    "seconds": time.perf_counter() - t0, "disk_bytes": disk,
                    "live_bytes": st["live_bytes"], "disk_vs_live": disk / st["live_bytes"],
                    "write_amplification": st["write_amplification"],
                    "cleaning_overhead": st["cleaning_overhead"]})
        r = out[-1]
        print(f"pass {p}: disk {disk / 1e9:.2f} GB = {r['disk_vs_live']:.2f}x live, write "
              f"amplification {r['write_amplification']:.2f} (cleaning x"
              f"{r['cleaning_overhead']:.2f}), {r['seconds']:.0f} s", flush=True)
    dsa_core.close(s)
    dsa_core.remove(root / "passes")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=("create", "checkpoint", "passes"), action="append")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--create-rows", type=int, default=100_000_000)
    ap.add_argument("--inplace-rows", type=int, default=2_000_000)
    ap.add_argument("--rows", type=int, default=10_000_000, help="checkpoint table")
    ap.add_argument("--memory", default="2GiB", help="checkpoint store's region")
    ap.add_argument("--steps", type=int, default=300, help="steps before the checkpoint")
    ap.add_argument("--pass-rows", type=int, default=1_000_000)
    ap.add_argument("--pass-memory-share", type=float, default=0.25)
    ap.add_argument("--space-ratio", type=float, default=2.0)
    ap.add_argument("--passes", type=int, default=10)
    ap.add_argument("--pass-order", choices=("permutation", "uniform"), default="permutation")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--quiet-seconds", type=float, default=60.0,
                    help="longest wait for the disk to go quiet before each checkpoint")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default=None, help="results file name (default: log_store)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.dim, a.batch, a.create_rows, a.inplace_rows = 16, 256, 1_000_000, 20_000
        a.rows, a.memory, a.steps, a.pass_rows, a.passes = 20_000, "1MiB", 20, 5_000, 3
        a.quiet_seconds = 0.0
    parts = a.only or ["create", "checkpoint", "passes"]
    root = Path(tempfile.mkdtemp(prefix="dsa_log_store_", dir=a.workdir))
    rows: list[dict] = []
    try:
        for part in parts:
            rows += {"create": bench_create, "checkpoint": bench_checkpoint,
                     "passes": bench_passes}[part](a, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for what in parts:
        sel = [r for r in rows if r["what"] == what]
        print_table(sel, [k for k in sel[0] if k != "what"])
    name = "log_store_smoke" if a.smoke else (a.name or "log_store")
    base = write_results(name, rows, {"machine": machine(), "args": vars(a)})
    print(f"wrote {base}.json / .csv")


if __name__ == "__main__":
    main()
