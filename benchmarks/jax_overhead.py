"""Per-step cost of the JAX adapter: host update outside jit vs ordered io_callback inside jit.

Run from the repository root::

    python -m benchmarks.jax_overhead                  # K = 8 and K = 2000 rows x 64, float32
    python -m benchmarks.jax_overhead --ks 8 500 2000 --steps 400

Each step is the part of a training step the two paths do differently: the gradient of a
``(K_pad, dim)`` block (``jax.grad`` of ``sum(tanh(rows[inv]) * x)``, jitted) plus the Adam
step on the store, blocking on the result every step. The batch's rows are gathered once per
K (the gather is the same in both paths and is timed on its own). Rows:

* ``grad only``: the jitted gradient alone (the floor);
* ``host update``: ``tx.update`` alone on a precomputed gradient (no JAX work);
* ``outside jit``: jitted gradient, then ``tx.update`` on the host (the default);
* ``in jit``: one jitted function with the gradient and ``tx.update`` of an
  ``in_jit=True`` transform (an ordered ``io_callback``);
* ``overhead``: ``in jit`` minus ``outside jit`` (of the medians, and of the 10th percentiles).

Each with the updated rows returned (``return_rows=True``, the default) and without.
Times are medians (p90 in brackets) in microseconds; on a shared machine they vary by tens
of percent from run to run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import dsa_core
from adapters import jax as dsa_jax


def _loss(rows, inv, x):
    return jnp.sum(jnp.tanh(rows[inv]) * x)


def _interleaved(fns: dict, steps: int, warm: int) -> dict[str, tuple[float, float, float]]:
    """Time every callable once per round, round after round, so that load from other
    processes hits every path alike. Returns {name: (p10, median, p90)} in microseconds."""
    names = list(fns)
    for _ in range(warm):
        for n in names:
            fns[n]()
    ts: dict[str, list[float]] = {n: [] for n in names}
    for i in range(steps):
        for n in names[i % len(names):] + names[:i % len(names)]:  # rotate the order
            t0 = time.perf_counter()
            fns[n]()
            ts[n].append(time.perf_counter() - t0)
    out = {}
    for n, v in ts.items():
        v.sort()
        out[n] = (v[int(0.1 * (len(v) - 1))] * 1e6, statistics.median(v) * 1e6,
                  v[int(0.9 * (len(v) - 1))] * 1e6)
    return out


class _Path:
    """One timed path with its own store, so the paths never share a count."""

    def __init__(self, tx, core, kind: str, grad_fn, batch, g, x):
        self.tx, self.state, self.kind = tx, tx.init(core), kind
        self.grad_fn, self.batch, self.g, self.x = grad_fn, batch, g, x
        if kind == "in jit":
            self.train_step = jax.jit(
                lambda opt_state, rows, idx, inv, x: tx.update(
                    (idx, jax.grad(_loss)(rows, inv, x)), opt_state))

    def __call__(self) -> None:
        b = self.batch
        if self.kind == "host update":  # the host step alone, on a precomputed gradient
            _, self.state = self.tx.update((b.idx, self.g), self.state)
        elif self.kind == "outside jit":  # jitted gradient, then the host update
            gg = self.grad_fn(b.rows, b.inverse, self.x)
            rows, self.state = self.tx.update((b.idx, gg), self.state)
            if rows is not None:
                rows.block_until_ready()
        else:  # gradient and update in one jitted function (ordered io_callback)
            rows, self.state = self.train_step(self.state, b.rows, b.idx, b.inverse, self.x)
            jax.block_until_ready((rows, self.state.count))


def run_k(k: int, dim: int, num_rows: int, steps: int, warm: int, tmp: Path) -> dict:
    rng = np.random.default_rng(k)
    grad_fn = jax.jit(jax.grad(_loss))
    ids = np.sort(rng.choice(num_rows, size=k, replace=False))
    x = jnp.asarray(rng.standard_normal((k, dim)), jnp.float32)

    def store(name: str) -> dsa_core.State:
        return dsa_core.create(tmp / f"k{k}-{name}", num_rows, dim, init="normal",
                               progress=False)

    probe = store("probe")
    batch = dsa_jax.gather_batch(probe, ids, buckets="pow2")
    g = grad_fn(batch.rows, batch.inverse, x).block_until_ready()
    fns = {"gather": lambda: dsa_jax.gather_batch(probe, ids, buckets="pow2"),
           "grad only": lambda: grad_fn(batch.rows, batch.inverse, x).block_until_ready()}
    paths = []
    for return_rows in (True, False):
        tag = "rows" if return_rows else "no rows"
        for kind in ("host update", "outside jit", "in jit"):
            tx = dsa_jax.sparse_adam(1e-3, in_jit=kind == "in jit", return_rows=return_rows)
            p = _Path(tx, store(f"{kind}-{tag}".replace(" ", "_")), kind, grad_fn, batch, g, x)
            fns[f"{kind} ({tag})"] = p
            paths.append(p)
    row = {"K": k, "K_pad": batch.rows.shape[0]}
    row.update(_interleaved(fns, steps, warm))
    for p in paths:
        dsa_jax.close(p.state)
    dsa_core.close(probe)
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ks", type=int, nargs="+", default=[8, 2000])
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--rows", type=int, default=50_000, help="num_rows of the store")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1,
                    help="numba threads for the store kernels (default 1: steadier timings)")
    args = ap.parse_args(argv)
    dsa_jax.warmup(("float32",))
    old_threads = dsa_core.get_num_threads()
    dsa_core.set_num_threads(args.threads)
    try:
        with tempfile.TemporaryDirectory(prefix="dsa-jax-bench-") as tmp:
            res = [run_k(k, args.dim, args.rows, args.steps, args.warmup, Path(tmp))
                   for k in args.ks]
    finally:
        dsa_core.set_num_threads(old_threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {os.cpu_count()} cpus, "
          f"load {load:.1f}; numba threads {args.threads}; store {args.rows} x {args.dim} "
          f"float32; {args.steps} interleaved rounds after {args.warmup} warm-up")
    print("per step, microseconds: median (p10-p90)\n")
    cols = [f"K={r['K']} (pad {r['K_pad']})" for r in res]
    names = ["gather", "grad only"]
    for tag in ("rows", "no rows"):
        names += [f"host update ({tag})", f"outside jit ({tag})", f"in jit ({tag})",
                  f"overhead ({tag})"]
    width = max(len(n) for n in names) + 2
    cw = 22
    print("| " + "path".ljust(width) + " | " + " | ".join(c.rjust(cw) for c in cols) + " |")
    print("|" + "-" * (width + 2) + "|" + "|".join("-" * (cw + 2) for _ in cols) + "|")
    for n in names:
        cells = []
        for r in res:
            if n.startswith("overhead"):
                tag = n[len("overhead "):]
                lo = r[f"in jit {tag}"][0] - r[f"outside jit {tag}"][0]
                med = r[f"in jit {tag}"][1] - r[f"outside jit {tag}"][1]
                cells.append(f"{med:+.0f} (p10 {lo:+.0f})".rjust(cw))
            else:
                p10, med, p90 = r[n]
                cells.append(f"{med:.0f} ({p10:.0f}-{p90:.0f})".rjust(cw))
        print("| " + n.ljust(width) + " | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
