"""Partition-ordered (bucket) training against random order: held-out link-prediction quality.

    python -m benchmarks.buckets_quality              # 200k nodes, 3 seeds, ~8 min on 2 cores
    python -m benchmarks.buckets_quality --smoke      # seconds; the tests run this

Trains the node embeddings of :mod:`examples.graph_buckets` (first-order LINE-style loss,
``DiskEmbedding`` + ``DiskSparseAdam``) on the example's power-law graph twice per seed,
with the same epochs, batch size, negatives per edge, lr and initial table:

* ``random``: the edges shuffled every epoch, negatives uniform over all nodes;
* ``bucket``: ``dsa_core.buckets.plan(...).batches(..., stores=[emb.store])``: bucket by
  bucket in BETA order with a buffer of ``--buffer`` of ``--partitions`` partitions,
  negatives uniform over the partitions in the buffer, each entering partition loaded and
  each leaving one released in the background.

A seed fixes the graph, the held-out edges and non-edges and the initial table, so each seed
is a paired comparison. Reported per seed: the AUC of the held-out edges against as many
random non-edges, and the relative difference ``(bucket - random) / random``; over seeds,
the mean, standard deviation and range of that difference, next to the seed-to-seed spread
of each order's AUC. Also timed, seed 0 only: the bucket order with no stores given to the
iterator (the same batches; its final table must be bit-identical to the hinted run's: the
loads and releases only hint), so the time the hints add or save on a table that fits in
memory is measured. Writes ``<out>/buckets_quality.{json,csv}`` (``<out>`` defaults to
``benchmarks/results``).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import RESULTS, machine, print_table

NAME = "buckets_quality"


def _loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


def one_run(cfg, workdir: Path) -> dict:
    from examples import graph_buckets as gb

    with tempfile.TemporaryDirectory(prefix="dsa-bq-", dir=workdir) as tmp:
        r = gb.run(cfg, Path(tmp))
    k = max(1, len(r["losses"]) // 20)
    order = "bucket" if cfg.order == "bucket" else "random"
    row = {"seed": cfg.seed, "order": order if cfg.hints or order == "random"
           else "bucket_no_hints", "auc": round(float(r["auc"]), 5),
           "auc_degree": round(float(r["auc_degree"]), 5),
           "loss_last": round(float(np.mean(r["losses"][-k:])), 5), "steps": r["steps"],
           "partition_loads": r["loads"] if order == "bucket" else None,
           "train_s": round(r["seconds"]["train"], 2),
           "plan_s": round(r["seconds"]["plan"], 2), "digest": r["digest"][:16]}
    return row


def summarise(rows: list[dict]) -> dict:
    by = {(r["seed"], r["order"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    rel = np.array([(by[s, "bucket"]["auc"] - by[s, "random"]["auc"]) / by[s, "random"]["auc"]
                    for s in seeds])
    above = np.array([(by[s, "bucket"]["auc"] - by[s, "random"]["auc"])
                      / (by[s, "random"]["auc"] - 0.5) for s in seeds])
    out = {"seeds": seeds, "rel_diff": rel.tolist(), "rel_diff_mean": float(rel.mean()),
           "rel_diff_std": float(rel.std(ddof=1)) if len(rel) > 1 else 0.0,
           "rel_diff_min": float(rel.min()), "rel_diff_max": float(rel.max()),
           "rel_diff_above_chance_mean": float(above.mean()),
           "within_2pct": bool(np.all(np.abs(rel) <= 0.02))}
    for o in ("random", "bucket"):
        a = np.array([by[s, o]["auc"] for s in seeds])
        out[f"auc_{o}_mean"] = float(a.mean())
        out[f"auc_{o}_std"] = float(a.std(ddof=1)) if len(a) > 1 else 0.0
        out[f"train_s_{o}_mean"] = float(np.mean([by[s, o]["train_s"] for s in seeds]))
    nh = by.get((seeds[0], "bucket_no_hints"))
    if nh is not None:
        out["no_hints_train_s"] = nh["train_s"]
        out["no_hints_identical"] = nh["digest"] == by[seeds[0], "bucket"]["digest"]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--avg-degree", type=float, default=10.0)
    ap.add_argument("--holdout", type=int, default=10_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--negatives", type=int, default=2)
    ap.add_argument("--lr", type=float, default=0.005)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--buffer", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-timing-run", action="store_true",
                    help="skip the bucket run without stores (seed 0)")
    ap.add_argument("--workdir", default=None, help="where the stores go (default: TMPDIR)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the result files")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, two seeds (tests)")
    a = ap.parse_args(argv)
    name = NAME
    if a.smoke:
        a.nodes, a.holdout, a.epochs, a.partitions, a.seeds = 3000, 300, 1, 4, 2
        name = NAME + "_smoke"
    import torch

    import dsa_core
    from examples import graph_buckets as gb
    from examples._common import warm_up_torch

    torch.set_num_threads(1)   # as the examples: torch's threads and numba's fight on 2 cores
    warm_up_torch()
    workdir = Path(a.workdir or tempfile.gettempdir())
    base = gb.Config(nodes=a.nodes, avg_degree=a.avg_degree, holdout=a.holdout, dim=a.dim,
                     epochs=a.epochs, batch=a.batch, negatives=a.negatives, lr=a.lr,
                     partitions=a.partitions, buffer=a.buffer, progress=False)
    load0, t0 = _loadavg(), time.perf_counter()
    rows = []
    for seed in range(a.seeds):
        for order in ("random", "bucket"):
            rows.append(one_run(dataclasses.replace(base, seed=seed, order=order), workdir))
            print(f"seed {seed} {order:6s}: AUC {rows[-1]['auc']:.4f}, "
                  f"{rows[-1]['train_s']:.1f} s", flush=True)
    if not a.no_timing_run:
        rows.append(one_run(dataclasses.replace(base, seed=0, order="bucket", hints=False),
                            workdir))
        print(f"seed 0 bucket, no stores given: {rows[-1]['train_s']:.1f} s", flush=True)
    print()
    print_table(rows, ["seed", "order", "auc", "auc_degree", "loss_last", "steps",
                       "partition_loads", "train_s"])
    s = summarise(rows)
    from dsa_core import buckets

    # the fewest partition loads of one epoch with this buffer (independent of the edges)
    lb = buckets.plan(np.zeros((1, 2), np.int64), a.nodes, partitions=a.partitions,
                      buffer=a.buffer).order(0).lower_bound
    print(f"\nAUC random {s['auc_random_mean']:.4f} ± {s['auc_random_std']:.4f}, bucket "
          f"{s['auc_bucket_mean']:.4f} ± {s['auc_bucket_std']:.4f} (mean ± sd over "
          f"{len(s['seeds'])} seeds)")
    print(f"bucket vs random, relative: mean {s['rel_diff_mean']:+.2%}, sd "
          f"{s['rel_diff_std']:.2%}, range [{s['rel_diff_min']:+.2%}, "
          f"{s['rel_diff_max']:+.2%}]; within 2% on every seed: {s['within_2pct']}")
    if "no_hints_train_s" in s:
        print(f"bucket order without stores (seed 0): {s['no_hints_train_s']:.1f} s of "
              f"training; final table bit-identical to the hinted run: "
              f"{s['no_hints_identical']}")
    meta = {"machine": machine(), "args": vars(a), "summary": s,
            "partition_loads_lower_bound_per_epoch": lb,
            "config": dataclasses.asdict(base), "dsa_core": dsa_core.__version__,
            "loadavg_start": load0, "loadavg_end": _loadavg(),
            "wall_s": time.perf_counter() - t0}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / name, rows, meta)
    print(f"\nwrote {out / name}.json/.csv ({meta['wall_s']:.0f} s, load "
          f"{' '.join(meta['loadavg_end'])})")


def _write(base: Path, rows: list[dict], meta: dict) -> None:
    import csv
    import json

    with open(base.with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(base.with_suffix(".csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
