"""Where a warm dsa_core step spends its time: the pieces of one Euclidean step, measured alone.

    python -m benchmarks.breakdown                 # 1M x 128, batch 2048
    python -m benchmarks.breakdown --smoke         # seconds; CI runs this so the code never rots

Rows (median of ``--reps`` calls, milliseconds):

- ``full step``: ``dsa_core.step`` on the store (unique ids, pages pre-dirtied);
- ``validate + dedup``: ``as_index`` + the hash coalescing of the same ids and gradient;
- ``kernel, random rows``: the Adam kernel alone on the store's mapping, 2048 random rows,
  one thread and the thread pool;
- ``kernel, cached rows``: the same kernel on a 2048-row table that sits in the CPU caches --
  the compute bound;
- ``gather``: ``dsa_core.gather`` of the batch's weight rows.

The gap between "random rows" and "cached rows" is the memory system (DRAM latency and
bandwidth for 3 MB of records in and out per step). Writes
``benchmarks/results/breakdown[_smoke].{json,csv}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import batches, machine, predirty, print_table, write_results


def _median_ms(fn, items, reps: int) -> float:
    ts = []
    for k in range(reps):
        it = items[k % len(items)]
        t = time.perf_counter()
        fn(it)
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.reps = 20_000, 20

    import dsa_core
    from dsa_core import _pool
    from dsa_core._coalesce import coalesce
    from dsa_core._intrinsics import NO_OPTIONS
    from dsa_core._kernels_euclid import adam_rows_euclid, euclid_hparams
    from dsa_core._step import as_index

    dsa_core.warmup(("float32",), readonly=False)
    rng = np.random.default_rng(0)
    ids = batches(a.rows, a.batch, 50, "unique", seed=1)
    items = [(i, rng.standard_normal((a.batch, a.dim), dtype=np.float32)) for i in ids]
    root = Path(tempfile.mkdtemp(prefix="breakdown_", dir=a.workdir))
    try:
        st = dsa_core.create(root / "s", a.rows, a.dim, init="uniform", init_scale=1e-3,
                             progress=False, storage="inplace")
        predirty(st)
        S = st.store
        lay = S.layout
        hp = euclid_hparams(np.float32, lr=1e-3, betas=(0.9, 0.999), bc1=1.0, bc2=1.0,
                            eps=1e-8, maximize=False)
        consts = (hp, False, NO_OPTIONS)  # skip_nonfinite, op: no option on
        holder = [st]

        def full(it):
            holder[0] = dsa_core.step(holder[0], it[0], it[1])

        def prep(it):
            coalesce(as_index(it[0], a.rows), it[1])

        def kernel(data, rows_of, pooled):
            def run(it):
                r = rows_of(it)
                args = (data, r, lay.w_off, data, r, lay.m_off, lay.v_off, it[1], *consts)
                if pooled:
                    _pool.run_chunked(adam_rows_euclid, args, r.shape[0], 128)
                else:
                    adam_rows_euclid(*args, 0, r.shape[0])
            return run

        hot = np.full((a.batch, lay.stride), 0.01, np.float32)
        hot_rows = np.arange(a.batch, dtype=np.int64)
        full(items[0])
        rows = [
            ("full step", _median_ms(full, items, a.reps)),
            ("validate + dedup", _median_ms(prep, items, a.reps)),
            ("kernel, random rows, 1 thread",
             _median_ms(kernel(S.data, lambda it: it[0], False), items, a.reps)),
            ("kernel, random rows, pool",
             _median_ms(kernel(S.data, lambda it: it[0], True), items, a.reps)),
            ("kernel, cached rows, 1 thread",
             _median_ms(kernel(hot, lambda it: hot_rows, False), items, a.reps)),
            ("kernel, cached rows, pool",
             _median_ms(kernel(hot, lambda it: hot_rows, True), items, a.reps)),
            ("gather", _median_ms(lambda it: dsa_core.gather(holder[0], it[0]), items,
                                  a.reps)),
        ]
        access = S.access
        dsa_core.close(holder[0])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = [{"part": p, "ms": ms, "rows": a.rows, "batch": a.batch, "dim": a.dim,
            "threads": _pool.get_num_threads(), "access": access} for p, ms in rows]
    print(f"warm step breakdown, {a.rows:,} x {a.dim} float32, batch {a.batch} unique ids, "
          f"{_pool.get_num_threads()} threads, access={access!r}")
    print_table(out, ["part", "ms"])
    base = write_results("breakdown_smoke" if a.smoke else "breakdown", out,
                         {"machine": machine(), "args": vars(a)})
    print(f"wrote {base}.json / .csv")


if __name__ == "__main__":
    main()
