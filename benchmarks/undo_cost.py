"""What the in-place store's undo file costs (the old record of each row's first change in a
flush interval, written to the page cache so that a process that dies between flushes
reopens exactly at the last flush).

    python -m benchmarks.undo_cost                      # 1M x 128 float32, batch 2048
    python -m benchmarks.undo_cost --rows 1000000 --intervals 10 100 --rounds 3
    python -m benchmarks.undo_cost --smoke              # seconds

Two in-place stores of the same size in one process, one with the undo file and one without
(``dsa_core._inplace.undo.ENABLED``, switched per store at its first change; without it a
kill is refused at the next open, as before the undo file), stepped alternately on the same
batches so that the machine's load hits both:

- ``warm``: the steady warm step (every row of the batches already saved in the interval:
  the cost is the check of which rows are new), median of ``--steps`` steps;
- ``interval K``: ``flush``, then ``K`` steps of fresh uniform ids (each row's first change
  in the interval pays its copy), the steps' time only (the flush is the same in both).

Prints each ratio (with / without) per round and their medians; writes
``benchmarks/results/undo_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

import dsa_core
from dsa_core._inplace import undo as undo_file

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=300, help="timed warm steps per round")
    ap.add_argument("--intervals", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="undo_cost")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.steps, a.intervals, a.rounds = 20_000, 20, [5], 1
    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    B, D = a.batch, a.dim
    g = (rng.standard_normal((B, D)) * 1e-2).astype(np.float32)
    cycled = [np.sort(rng.choice(a.rows, B, replace=False)) for _ in range(64)]
    out: dict = {"rows": a.rows, "dim": D, "batch": B, "rounds": []}
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        states = {}
        for mode in ("without", "with"):
            undo_file.ENABLED = mode == "with"
            s = dsa_core.create(f"{tmp}/{mode}", a.rows, D, init="uniform", init_scale=1e-3,
                                storage="inplace", progress=False)
            s = dsa_core.step(s, cycled[0], g)  # the first change: the undo file (or not)
            for k in range(1, 64):
                s = dsa_core.step(s, cycled[k], g)
            states[mode] = s
        undo_file.ENABLED = True
        for r in range(a.rounds):
            row: dict = {}
            for K in a.intervals:
                fresh = [rng.integers(0, a.rows, B) for _ in range(K)]
                for mode in ("without", "with"):
                    s = states[mode]
                    dsa_core.flush(s)
                    t0 = time.perf_counter()
                    for ids in fresh:
                        s = dsa_core.step(s, ids, g)
                    row[f"interval{K}_{mode}_ms_per_step"] = \
                        1e3 * (time.perf_counter() - t0) / K
                    states[mode] = s
                row[f"interval{K}_ratio"] = (row[f"interval{K}_with_ms_per_step"]
                                             / row[f"interval{K}_without_ms_per_step"])
            for mode in ("without", "with"):
                s = states[mode]
                for ids in cycled:  # every row of these batches saved in this interval
                    s = dsa_core.step(s, ids, g)
                ts = []
                for k in range(a.steps):
                    t0 = time.perf_counter()
                    s = dsa_core.step(s, cycled[k % 64], g)
                    ts.append(time.perf_counter() - t0)
                row[f"warm_{mode}_p50_ms"] = 1e3 * float(np.median(ts))
                states[mode] = s
            row["warm_ratio"] = row["warm_with_p50_ms"] / row["warm_without_p50_ms"]
            out["rounds"].append(row)
            print(f"round {r}: " + ", ".join(f"{k}={v:.3f}" for k, v in row.items()),
                  flush=True)
        undo_bytes = (Path(tmp) / "with" / "undo.dsa").stat().st_size
        for s in states.values():
            dsa_core.close(s)
    keys = [k for k in out["rounds"][0] if k.endswith("ratio")]
    out["median"] = {k: float(np.median([r[k] for r in out["rounds"]])) for k in keys}
    out["undo_file_bytes_high_water"] = undo_bytes
    print("medians:", ", ".join(f"{k}={v:.3f}" for k, v in out["median"].items()))
    if not a.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
