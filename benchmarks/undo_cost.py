"""What the in-place store's undo file costs (the old record of each row's first change in a
flush interval, written so that a process that dies between flushes reopens exactly at the
last flush).

    python -m benchmarks.undo_cost                      # 1M x 128 float32, batch 2048
    python -m benchmarks.undo_cost --rows 1000000 --intervals 10 100 1000 --runs 3
    python -m benchmarks.undo_cost --smoke              # seconds

Each run is a child process with one new in-place store, with the undo file or without it
(``dsa_core._inplace.undo.ENABLED``: without it a kill is refused at the next open, as before
the undo file); the two kinds of child alternate, ``--runs`` of each, on the same batches.
(Two stores in one process do not compare: the one created second steps up to 2x slower
after a flush on this VM, its mapping having got fewer huge pages.) In each child:

- ``interval K``: ``flush``, then ``K`` steps of fresh uniform ids (each row's first change
  in the interval pays its copy), the steps' time only, mean over the intervals; the
  intervals come one after another in the order given (the first one also grows the undo
  file, later ones overwrite it);
- ``warm``: then 64 batches stepped once and ``--steps`` timed steps cycling them (every
  row already saved in the interval: the cost is the check of which rows are new), median.

Prints each child's figures and, per figure, the ratio of the medians (with / without)
(``--smoke`` measures both kinds in the calling process, at a tiny size);
writes ``benchmarks/results/undo_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def child(a) -> dict:
    import dsa_core
    from dsa_core._inplace import undo as undo_file

    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    B, D = a.batch, a.dim
    g = (rng.standard_normal((B, D)) * 1e-2).astype(np.float32)
    cycled = [np.sort(rng.choice(a.rows, B, replace=False)) for _ in range(64)]
    undo_file.ENABLED = a.child == "with"
    out: dict = {"mode": a.child}
    try:
        _measure(a, dsa_core, rng, g, cycled, out)
    finally:
        undo_file.ENABLED = True  # the default again (--smoke measures in the calling process)
    return out


def _measure(a, dsa_core, rng, g, cycled, out: dict) -> None:
    B, D = a.batch, a.dim
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        s = dsa_core.create(f"{tmp}/s", a.rows, D, init="uniform", init_scale=1e-3,
                            storage="inplace", progress=False)
        for ids in cycled:
            s = dsa_core.step(s, ids, g)
        for K in a.intervals:
            ts = []
            for _ in range(a.rounds):
                dsa_core.flush(s)
                fresh = [rng.integers(0, a.rows, B) for _ in range(K)]
                t0 = time.perf_counter()
                for ids in fresh:
                    s = dsa_core.step(s, ids, g)
                ts.append((time.perf_counter() - t0) / K)
            out[f"interval{K}_ms_per_step"] = 1e3 * float(np.mean(ts))
        for ids in cycled:  # every row of these batches saved in this interval
            s = dsa_core.step(s, ids, g)
        ts = []
        for k in range(a.steps):
            t0 = time.perf_counter()
            s = dsa_core.step(s, cycled[k % 64], g)
            ts.append(time.perf_counter() - t0)
        out["warm_p50_ms"] = 1e3 * float(np.median(ts))
        dsa_core.close(s)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=1000, help="timed warm steps")
    ap.add_argument("--intervals", type=int, nargs="*", default=[10, 100])
    ap.add_argument("--rounds", type=int, default=3, help="intervals of each length")
    ap.add_argument("--runs", type=int, default=3, help="children of each kind")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="undo_cost")
    ap.add_argument("--child", choices=("with", "without"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.steps, a.intervals, a.rounds, a.runs = 20_000, 20, [5], 1, 1
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return {}
    args = ["--rows", a.rows, "--dim", a.dim, "--batch", a.batch, "--steps", a.steps,
            "--rounds", a.rounds, "--intervals", *a.intervals]
    if a.dir:
        args += ["--dir", a.dir]
    runs: dict = {"without": [], "with": []}
    for r in range(a.runs):
        for mode in (("without", "with") if r % 2 == 0 else ("with", "without")):
            if a.smoke:  # the code at the smallest size, in this process (no interpreter each)
                got = child(argparse.Namespace(**{**vars(a), "child": mode}))
            else:
                p = subprocess.run([sys.executable, "-m", "benchmarks.undo_cost", "--child",
                                    mode, *map(str, args)], capture_output=True, text=True,
                                   check=True)
                got = json.loads(p.stdout.strip().splitlines()[-1])
            runs[mode].append(got)
            print(f"run {r} {mode}: " + ", ".join(f"{k}={v:.3f}" for k, v in got.items()
                                                  if k != "mode"), flush=True)
    keys = [k for k in runs["with"][0] if k != "mode"]
    med = {m: {k: float(np.median([x[k] for x in runs[m]])) for k in keys} for m in runs}
    ratio = {k: med["with"][k] / med["without"][k] for k in keys}
    print("ratio of the medians (with / without): "
          + ", ".join(f"{k}={v:.3f}" for k, v in ratio.items()))
    out = {"rows": a.rows, "dim": a.dim, "batch": a.batch, "runs": runs, "median": med,
           "ratio": ratio}
    if not a.smoke:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{a.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
