"""What the weight-decay and per-row-step options cost per warm step (docs/algorithms.md §7.1–§7.2).

    python -m benchmarks.options_cost                    # 1M x 128 float32, batch 2048, 1000 steps
    python -m benchmarks.options_cost --kinds euclid ball rowwise --dist uniform zipf
    python -m benchmarks.options_cost --smoke            # seconds; CI runs this

For each store kind and each option set, two stores live in one process -- one without the
option, one with it, same initial rows -- and the whole ``dsa_core.step`` of each is timed on
the same batch, alternately, step after step (which one goes first alternates too), so that
load from other processes hits both alike. Both stores are pre-dirtied (warm: every page
resident and writable, ``access="ram"``). Together they must stay under the kernel's
background-writeback threshold (``vm.dirty_background_*``, 2.4 GB on a 24 GiB machine):
past it the kernel writes pages back during the run and ``access="auto"`` maps the second
store as ``"disk"``, which would time paging, not the option. So the row count of a kind is
``--rows`` or, if two such stores do not fit, the largest count that does (printed and
recorded; e.g. 700k for the 1.5 KB records of ``euclid`` on that machine, while ``euclid_table``
-- ``weights=False`` with the caller's table, as ``DiskSparseAdam`` runs CPU parameters --
and ``ball`` fit 1M). Reported: the median step time of each and their ratio (the option's
cost), the ratio of the 10th percentiles, and the median of the per-round ratios. Writes
``benchmarks/results/options_cost.{json,csv}``.

Option sets: ``l2`` (``weight_decay``), ``adamw`` (``decoupled_weight_decay``), ``catch_up``
(AdamW with ``decay_missed_steps``), ``per_row`` (``per_row_step``), ``all`` (``per_row``
and ``catch_up`` together).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import batches, machine, predirty, print_table, wait_disk_quiet, write_results

OPTIONS = {
    "l2": {"weight_decay": 1e-2},
    "adamw": {"weight_decay": 1e-2, "decoupled_weight_decay": True},
    "catch_up": {"weight_decay": 1e-2, "decoupled_weight_decay": True,
                 "decay_missed_steps": True},
    "per_row": {"per_row_step": True},
    "all": {"weight_decay": 1e-2, "decoupled_weight_decay": True, "decay_missed_steps": True,
            "per_row_step": True},
}
KINDS = {
    "euclid": {},
    "euclid_table": {"weights": False},  # the caller's (num_rows, dim) table, step(table=)
    "rowwise": {"second_moment": "rowwise"},
    "bf16m": {"first_moment": "bfloat16"},
    "ball": {"curvature": 1.0},
}


def fitting_rows(n: int, d: int, kind: str, option: str) -> int:
    """``n``, or the largest row count for which both stores of a pair stay under 90% of the
    background-writeback threshold."""
    import dsa_core

    limit = 0.9 * dsa_core.tools.paging_limits()["dirty_background_bytes"]
    per_row = 0
    with tempfile.TemporaryDirectory() as tmp:  # the record sizes, from one-row stores
        for name, opts in (("a", {}), ("b", OPTIONS[option])):
            s = dsa_core.create(Path(tmp) / name, 1, d, progress=False, **KINDS[kind], **opts)
            per_row += s.layout["stride"] * 4
            dsa_core.close(s)
    return int(min(n, limit // per_row)) if limit else n


def _pair(root: Path, n: int, d: int, kind: str, option: str):
    import dsa_core

    common = {"lr": 1e-3, "init": "uniform", "init_scale": 1e-3, "progress": False,
              "access": "ram", **KINDS[kind]}
    if not common.get("weights", True):
        common.pop("init"), common.pop("init_scale")
    base = dsa_core.create(root / "base", n, d, **common)
    other = dsa_core.create(root / "opt", n, d, **common, **OPTIONS[option])
    warm = predirty(base) and predirty(other)
    return base, other, warm


def run_pair(root: Path, n: int, d: int, b: int, steps: int, warmup: int, kind: str,
             option: str, dist: str) -> dict:
    import dsa_core

    base, other, warm = _pair(root, n, d, kind, option)
    rng = np.random.default_rng(1)
    ids = batches(n, b, steps + warmup, dist, seed=2)
    grads = [rng.standard_normal((b, d), dtype=np.float32) for _ in range(8)]
    times = {"base": [], "opt": []}
    states = {"base": base, "opt": other}
    kw = {}
    if not base.has_weights:  # each store its own table, written once (pages resident)
        init = rng.uniform(-1e-3, 1e-3, (n, d)).astype(np.float32)
        kw = {"base": {"table": init}, "opt": {"table": init.copy()}}
    order = ["base", "opt"]
    for k, idx in enumerate(ids):
        g = grads[k % len(grads)]
        for name in order:
            extra = kw.get(name, {})
            t0 = time.perf_counter()
            states[name] = dsa_core.step(states[name], idx, g, **extra)
            dt = time.perf_counter() - t0
            if k >= warmup:
                times[name].append(dt)
        order.reverse()  # neither store always goes first
    for s in states.values():
        dsa_core.close(s)
    tb, to = np.asarray(times["base"]) * 1e3, np.asarray(times["opt"]) * 1e3
    return {
        "kind": kind, "option": option, "dist": dist, "rows": n, "dim": d, "batch": b,
        "steps": len(tb), "warm": warm, "threads": dsa_core.get_num_threads(),
        "base_p50_ms": round(float(np.median(tb)), 4),
        "opt_p50_ms": round(float(np.median(to)), 4),
        "cost_p50": round(float(np.median(to) / np.median(tb)), 4),
        "cost_p10": round(float(np.percentile(to, 10) / np.percentile(tb, 10)), 4),
        # per-step ratio (the two steps of a round ran back to back on the same batch)
        "cost_median_of_ratios": round(float(np.median(to / tb)), 4),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--kinds", nargs="+", default=["euclid", "euclid_table", "ball"],
                    choices=sorted(KINDS))
    ap.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--dist", nargs="+", default=["uniform"],
                    choices=["uniform", "zipf", "unique"])
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--name", default="options_cost")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.warmup = 2000, 16, 64, 20, 3
        a.name = "options_cost_smoke"

    import dsa_core

    dsa_core.warmup(("float32",), readonly=False)
    rows = []
    for kind in a.kinds:
        for dist in a.dist:
            for option in a.options:
                root = Path(tempfile.mkdtemp(prefix="options_cost_", dir=a.workdir))
                try:
                    if not a.smoke:
                        wait_disk_quiet(max_seconds=30)
                    n = fitting_rows(a.rows, a.dim, kind, option)
                    if n < a.rows:
                        print(f"{kind} + {option}: {n:,} rows (two stores of {a.rows:,} rows "
                              "would pass the background-writeback threshold)")
                    rows.append(run_pair(root, n, a.dim, a.batch, a.steps, a.warmup,
                                         kind, option, dist))
                finally:
                    gc.collect()
                    shutil.rmtree(root, ignore_errors=True)
                print_table(rows[-1:], ["kind", "option", "dist", "rows", "base_p50_ms",
                                        "opt_p50_ms",
                                        "cost_p50", "cost_p10", "cost_median_of_ratios"])
    print()
    print(f"up to {a.rows:,} rows x {a.dim} float32, batch {a.batch}, {a.steps} interleaved "
          f"steps each, {dsa_core.get_num_threads()} threads; cost = option / without")
    print_table(rows, ["kind", "option", "dist", "rows", "base_p50_ms", "opt_p50_ms",
                       "cost_p50",
                       "cost_p10", "cost_median_of_ratios", "warm"])
    meta = {"machine": machine(), "command": "python -m benchmarks.options_cost "
            + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "options": OPTIONS}
    print("wrote", write_results(a.name, rows, meta).with_suffix(".json"))


if __name__ == "__main__":
    main()
