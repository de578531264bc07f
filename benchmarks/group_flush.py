"""The cost of a group commit: the flush of one store vs the flush of N stores together.

    python -m benchmarks.group_flush                    # 200k x 64 float32, N = 1, 2, 4
    python -m benchmarks.group_flush --stores 1 2 4 8 --rows 200000 --dim 64 --batch 4096
    python -m benchmarks.group_flush --storage log      # the log-structured store only
    python -m benchmarks.group_flush --smoke            # seconds

For each store kind and each N, N fresh stores of ``--rows`` x ``--dim`` take ``--steps``
steps of ``--batch`` uniform ids each between two flushes, ``--rounds`` times; only the
flushes are timed. Modes:

- ``group``: the N stores are one commit group (``dsa_core.join``); a flush is one group
  commit (every member prepares -- in parallel threads, so their syncs overlap -- then one
  commit file is written and synced, then every member installs its manifest);
- ``separate``: the same N stores with no group, flushed one after the other
  (``dsa_core.flush`` each: N independent commits, what the adapters did before groups);

``N = 1`` with ``separate`` is the flush of one store, the reference: the table prints
each flush's median against it (``x_one``). I/O bound: run it on an otherwise idle disk.
Writes ``benchmarks/results/group_flush.{json,csv}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import batches, machine, print_table, write_results


def run(kind: str, mode: str, n: int, root: Path, a, ids: list[np.ndarray],
        grads: list[np.ndarray]) -> dict:
    import dsa_core

    kw = {"storage": "log", "memory": a.memory} if kind == "log" else {"storage": "inplace"}
    states = [dsa_core.create(root / f"{kind}-{mode}-{n}-{k}", a.rows, a.dim, init="uniform",
                              init_scale=1e-2, progress=False, **kw) for k in range(n)]
    group = dsa_core.join(states, root / f"{kind}-{mode}-{n}.json") \
        if mode == "group" else None
    times = []
    it = 0
    try:
        for r in range(a.rounds + a.warmup):
            for _ in range(a.steps):
                ups = [(s, ids[it % len(ids)], grads[it % len(ids)]) for s in states]
                states = dsa_core.step_many(ups) if n > 1 else \
                    [dsa_core.step(states[0], ups[0][1], ups[0][2])]
                it += 1
            t0 = time.perf_counter()
            if group is not None:
                group.flush(states)
            else:
                for s in states:
                    dsa_core.flush(s)
            dt = time.perf_counter() - t0
            if r >= a.warmup:
                times.append(dt)
    finally:
        if group is not None:
            group.close()
        for s in states:
            dsa_core.close(s)
    t = np.asarray(times) * 1e3
    return {"kind": kind, "mode": mode, "stores": n, "flushes": len(times),
            "p50_ms": float(np.median(t)), "p90_ms": float(np.percentile(t, 90)),
            "mean_ms": float(t.mean())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5, help="steps between two flushes")
    ap.add_argument("--rounds", type=int, default=30, help="timed flushes per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--stores", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--storage", choices=("inplace", "log", "both"), default="both")
    ap.add_argument("--memory", default=None,
                    help="region budget of each log store (default: the whole table)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.rounds, a.warmup = 2000, 8, 64, 2, 2, 1
        a.stores = [1, 2]
    if a.memory is None:  # a slot per row: the table resident (isolates the flush)
        a.memory = a.rows * (3 * a.dim * 4 + 64)
    name = "group_flush_smoke" if a.smoke else "group_flush"

    import dsa_core

    dsa_core.warmup(("float32",), readonly=False)
    ids = [np.unique(b) for b in batches(a.rows, a.batch, 16, "uniform", seed=0)]
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((b.shape[0], a.dim), dtype=np.float32) for b in ids]
    root = Path(tempfile.mkdtemp(prefix="dsa-group-flush-", dir=a.dir))
    kinds = ("inplace", "log") if a.storage == "both" else (a.storage,)
    rows = []
    try:
        for kind in kinds:
            for n in a.stores:
                for mode in ("separate",) if n == 1 else ("group", "separate"):
                    rows.append(run(kind, mode, n, root, a, ids, grads))
                    for p in root.iterdir():
                        if p.is_dir():
                            shutil.rmtree(p, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    one = {r["kind"]: r["p50_ms"] for r in rows if r["stores"] == 1}
    for r in rows:
        r["x_one"] = round(r["p50_ms"] / one[r["kind"]], 3) if one.get(r["kind"]) else None
    print_table(rows, ["kind", "mode", "stores", "flushes", "p50_ms", "p90_ms", "x_one"])
    write_results(name, rows, {"machine": machine(), "rows": a.rows, "dim": a.dim,
                               "batch": a.batch, "steps_between_flushes": a.steps,
                               "memory": a.memory})


if __name__ == "__main__":
    main()
