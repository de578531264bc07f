"""The cost of durability per step: ``durability="flush"`` vs ``durability="step"``.

    python -m benchmarks.durability                         # 200k x 128 float32, batch 2048
    python -m benchmarks.durability --rows 200000 --dim 128 --batch 2048 --steps 200
    python -m benchmarks.durability --storage log           # the log-structured store only
    python -m benchmarks.durability --smoke                 # seconds

Ways to run the same steps on the same batches, each on its own fresh store (the in-place
store's pages are in the page cache, the log store's table fits its region: this isolates
the cost of the disk syncs). In-place (``--storage inplace``):

- ``flush``: the default mode, ``dsa_core.step`` only; rows reach the disk whenever the OS
  writes them back, and ``flush``/``checkpoint`` make them durable;
- ``flush+flush()``: the default mode with ``dsa_core.flush`` after every step (msync of the
  dirty rows + the manifest): durable at every step, but not atomic;
- ``step``: ``durability="step"``: undo journal + fdatasync, the step, fdatasync of the data,
  then the manifest rename (the commit point): every step atomic under a crash.

Log-structured (``--storage log``; ``storage="log"``, weights in the store, a region that
holds the whole table unless ``--memory`` says otherwise, every row made resident first):

- ``log:flush``: ``durability="flush"``: steps update the region only, durable at flush;
- ``log:step``: ``durability="step"``: each step's new records appended to the commit log
  with one write + one fdatasync; the store flushes by itself when the log passes its bound
  (256 MiB here), and those steps are in the p99 (``log_flushes`` counts them).

I/O bound: run it on an otherwise idle disk. Uniform ids (one record per id, most in
distinct pages). ``--storage both`` (default) runs all five in one process. Writes
``benchmarks/results/durability.{json,csv}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import batches, machine, print_table, rewrite_rows, write_results

MODES = {"inplace": ("flush", "flush+flush()", "step"), "log": ("log:flush", "log:step")}


def _dir_name(mode: str) -> str:
    return mode.replace("+", "_").replace("()", "").replace(":", "_")


def run_mode(mode: str, root: Path, n: int, d: int, ids: list[np.ndarray],
             grads: list[np.ndarray], warmup: int, memory=None) -> dict:
    import dsa_core

    durability = "step" if mode.endswith("step") else "flush"
    log = mode.startswith("log:")
    state = dsa_core.create(root / _dir_name(mode), n, d, lr=1e-3, init="uniform",
                            init_scale=1e-2, durability=durability, progress=False,
                            **({"storage": "log", "memory": memory} if log
                               else {"storage": "inplace"}))
    if log:  # every row resident in the region (as the in-place store's pages are cached)
        rewrite_rows(state, chunk_rows=1 << 14)
    dsa_core.flush(state)
    per_step_flush = mode == "flush+flush()"
    eng = state.store if log else None
    times, flushes = [], 0
    for k, idx in enumerate(ids):
        g = grads[k % len(grads)]
        before = eng._commit.wal_bytes() if log else 0
        t0 = time.perf_counter()
        state = dsa_core.step(state, idx, g)
        if per_step_flush:
            dsa_core.flush(state)
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
            flushes += log and eng._commit.wal_bytes() < before  # the log flushed and started anew
    t_close = time.perf_counter()
    dsa_core.close(state)  # the flush a "flush"-mode run still owes
    close_ms = (time.perf_counter() - t_close) * 1e3
    ms = np.asarray(times) * 1e3
    rec_bytes = state.store.layout.stride * state.dtype.itemsize
    return {
        "mode": mode,
        "rows": n,
        "dim": d,
        "batch": int(ids[0].shape[0]),
        "steps": len(times),
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "max_ms": float(ms.max()),
        "close_ms": close_ms,
        "journal_bytes_per_step": (int(np.mean([28 + np.unique(i).size * (8 + rec_bytes)
                                                for i in ids]))
                                   if mode == "step" else
                                   int(np.mean([48 + np.unique(i).size * (8 + rec_bytes)
                                                for i in ids]))
                                   if mode == "log:step" else 0),
        "log_flushes": int(flushes),
        "region_bytes": int(state.store.info.memory_bytes) if log else 0,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--storage", choices=("inplace", "log", "both"), default="both",
                    help="which store kinds to run (default both, in one process)")
    ap.add_argument("--memory", default=None,
                    help="region budget of the log stores (default: the whole table)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--name", default=None, help="results file name (default: durability)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.warmup = 5000, 16, 256, 20, 2
    name = a.name or ("durability_smoke" if a.smoke else
                      "durability" if a.storage == "both" else f"durability_{a.storage}")

    import dsa_core

    dsa_core.warmup(("float32",), readonly=False)
    total = a.steps + a.warmup
    ids = batches(a.rows, a.batch, total, "uniform", seed=0)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((a.batch, a.dim), dtype=np.float32) for _ in range(8)]
    root = Path(tempfile.mkdtemp(prefix="dsa-durability-", dir=a.dir))
    kinds = ("inplace", "log") if a.storage == "both" else (a.storage,)
    memory = a.memory
    if memory is None:  # a slot per row (record + the engine's 42 B, rounded up): all resident
        memory = a.rows * (3 * a.dim * 4 + 64)
    rows = []
    try:
        for mode in [m for k in kinds for m in MODES[k]]:
            rows.append(run_mode(mode, root, a.rows, a.dim, ids, grads, a.warmup, memory))
            shutil.rmtree(root / _dir_name(mode), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = {r["mode"]: r["p50_ms"] for r in rows}
    for r in rows:  # against the plain step of the same store kind
        r["p50_vs_flush"] = r["p50_ms"] / base["log:flush" if r["mode"].startswith("log:")
                                                else "flush"]
    print_table(rows, ["mode", "rows", "dim", "batch", "steps", "p50_ms", "p90_ms", "p99_ms",
                       "mean_ms", "max_ms", "p50_vs_flush", "journal_bytes_per_step",
                       "log_flushes"])
    meta = {"machine": machine(), "args": vars(a), "store_dir": str(root.parent),
            "note": "page-cache-warm stores; times are per step (step + flush() for "
                    "flush+flush())"}
    out = write_results(name, rows, meta)
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
