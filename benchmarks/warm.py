"""Warm benchmark: every implementation's state is in RAM / the page cache.

    python -m benchmarks.warm                      # 1M and 10M rows x 128; unique, uniform, zipf
    python -m benchmarks.warm --rows 1000000 --dist uniform --steps 300
    python -m benchmarks.warm --smoke              # seconds; CI runs this so the code never rots

Implementations, in one process, on the same batches and gradients:

- ``torch.optim.SparseAdam`` (moments pre-touched),
- ``geoopt SparseRiemannianAdam`` on ``PoincareBall(1)`` (the Poincaré anchor),
- ``seed-style``: the original DSA package's design -- three separate memmaps w/m/v, numpy
  fancy indexing, ``torch.unique`` + ``index_add_`` for duplicates, Adam math in torch,
- ``dsa_core`` Euclidean and Poincaré, and Euclidean with ``second_moment="rowwise"`` (one
  v per row, docs/algorithms.md §7.3: not SparseAdam's update; ``benchmarks.reduced_state``
  measures what it costs in accuracy).

Rows/s counts the batch's ids (duplicates included) per second of ``step``. Memory columns are
this process's RssAnon / RssFile growth while the implementation was alive. Writes
``benchmarks/results/warm.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ._common import (
    batches,
    machine,
    mem,
    predirty,
    print_table,
    timed,
    wait_disk_quiet,
    write_every_row,
    write_results,
)

LR = 1e-3


class DsaCore:
    """dsa_core on a fresh store; ``dirty=True`` pre-touches every page for writing.

    ``create`` ends with an msync, which leaves every page clean and write-protected: the
    first update of each page then takes a write fault (measured ~2x slower steps until the
    rows have been touched). A long run is in the other state -- writeback cleans a page
    about every 30 s -- so the warm rows pre-dirty the store, as torch's moments are
    pre-touched; the ``clean pages`` row shows the cost right after a flush or checkpoint.

    ``saved=True`` (``dsa_euclid_saved``) also writes every row once before the timed steps.
    The in-place store saves a row's record in its undo file at the row's first update since
    the last flush (docs/storage.md), so a new store's steps -- the plain rows here -- pay
    that on nearly every row; the saved store is the state between flushes once the rows
    were touched (the guard's ``warm`` measures that one too).
    """

    def __init__(self, n, d, root, curvature=0.0, dirty=True, second_moment="elementwise",
                 first_moment="full", saved=False):
        import dsa_core

        self.dsa = dsa_core
        self.state = dsa_core.create(Path(root) / "dsa", n, d, curvature=curvature, lr=LR,
                                     init="uniform", init_scale=1e-3, progress=False,
                                     second_moment=second_moment, first_moment=first_moment,
                                     storage="inplace")
        dirty = dirty and predirty(self.state)
        if saved:  # every row written once since the create (its flush): no undo image left
            write_every_row(self.state)
        self.name = ("dsa_core poincare" if curvature else "dsa_core euclid") + \
            (" rowwise" if second_moment == "rowwise" else "") + \
            (" bf16m" if first_moment == "bfloat16" else "") + \
            ("" if dirty else ", clean pages") + (", undo saved" if saved else "")

    def step(self, item):
        idx, g = item
        self.state = self.dsa.step(self.state, idx, g)

    def close(self):
        self.dsa.close(self.state)


class TorchSparseAdam:
    """``torch.optim.SparseAdam`` on an in-RAM table; moments pre-touched after one step."""

    name, anchor = "torch.optim.SparseAdam", "torch"

    def __init__(self, n, d, root):
        import torch

        self.torch = torch
        self.shape = (n, d)
        self.p, self.opt = self._build(torch.empty(n, d).uniform_(-1e-3, 1e-3))
        self.step((np.array([0]), np.zeros((1, d), np.float32)))
        st = self.opt.state[self.p]
        st["exp_avg"].fill_(0)  # pre-touch: zeros_like pages are mapped lazily
        st["exp_avg_sq"].fill_(0)

    def _build(self, init):
        p = self.torch.nn.Parameter(init)
        return p, self.torch.optim.SparseAdam([p], lr=LR)

    def step(self, item):
        idx, g = item
        t = self.torch
        self.p.grad = t.sparse_coo_tensor(t.from_numpy(idx)[None], t.from_numpy(g), self.shape,
                                          check_invariants=False)
        self.opt.step()

    def close(self):
        del self.opt, self.p


class GeooptSparseRAdam(TorchSparseAdam):
    """geoopt ``SparseRiemannianAdam`` on ``PoincareBall(1)``, driven the same way."""

    name, anchor = "geoopt SparseRiemannianAdam", "geoopt"

    def _build(self, init):
        import geoopt

        p = geoopt.ManifoldParameter(init, manifold=geoopt.PoincareBall(c=1.0))
        return p, geoopt.optim.SparseRiemannianAdam([p], lr=LR)


class SeedStyle:
    """The original DSA package's step: three memmaps, fancy indexing, Adam in torch."""

    name, anchor = "seed-style 3 memmaps", "torch"

    def __init__(self, n, d, root):
        import torch

        self.torch = torch
        self.files = {}
        for k in "wmv":
            a = np.lib.format.open_memmap(Path(root) / f"{k}.npy", mode="w+", dtype=np.float32,
                                          shape=(n, d))
            a[:] = 0  # every page really written
            self.files[k] = a
        self.t = 0

    def step(self, item):
        idx, g = item
        torch = self.torch
        uniq, inv = torch.unique(torch.from_numpy(idx), return_inverse=True)
        grad = torch.zeros(len(uniq), g.shape[1]).index_add_(0, inv, torch.from_numpy(g))
        u = uniq.numpy()
        w = torch.from_numpy(self.files["w"][u].copy())
        m = torch.from_numpy(self.files["m"][u].copy())
        v = torch.from_numpy(self.files["v"][u].copy())
        self.t += 1
        m.mul_(0.9).add_(grad, alpha=0.1)
        v.mul_(0.999).addcmul_(grad, grad, value=0.001)
        mhat = m / (1 - 0.9**self.t)
        vhat = v / (1 - 0.999**self.t)
        w -= LR * mhat / (vhat.sqrt() + 1e-8)
        self.files["w"][u] = w.numpy()
        self.files["m"][u] = m.numpy()
        self.files["v"][u] = v.numpy()

    def close(self):
        for a in self.files.values():
            a.flush()
        self.files.clear()


IMPLS = {
    "dsa_euclid": lambda n, d, r: DsaCore(n, d, r, 0.0),
    "dsa_euclid_clean": lambda n, d, r: DsaCore(n, d, r, 0.0, dirty=False),
    "dsa_euclid_saved": lambda n, d, r: DsaCore(n, d, r, 0.0, saved=True),
    "dsa_euclid_rowwise": lambda n, d, r: DsaCore(n, d, r, 0.0, second_moment="rowwise"),
    "dsa_euclid_rowwise_bf16m": lambda n, d, r: DsaCore(n, d, r, 0.0, second_moment="rowwise",
                                                        first_moment="bfloat16"),
    "dsa_poincare": lambda n, d, r: DsaCore(n, d, r, 1.0),
    "torch": TorchSparseAdam,
    "geoopt": GeooptSparseRAdam,
    "seed": SeedStyle,
}


def run(rows_list, dists, impls, steps, batch, dim, workdir, slow_steps, max_seconds=120.0,
        on_row=None, quiet_seconds=60.0):
    """Each implementation is built once per table size and runs every id distribution.

    Before each timed run the disk is left to go quiet (``quiet_seconds`` at most): the
    writeback of the previous implementation's store, or of this one's ``create``, would
    otherwise run during the timed steps of the next.
    """
    out = []
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((batch, dim), dtype=np.float32) for _ in range(8)]
    for n in rows_list:
        plans = {}
        for dist in dists:
            ids = batches(n, batch, steps + 10, dist)
            plans[dist] = ([(ids[k], grads[k % 8]) for k in range(len(ids))],
                           float(np.mean([np.unique(b).size for b in ids])))
        for key in impls:
            root = Path(tempfile.mkdtemp(dir=workdir, prefix=f"warm_{key}_"))
            gc.collect()
            m0 = mem()
            impl = IMPLS[key](n, dim, root)
            k = slow_steps if key == "geoopt" else steps
            for dist, (items, uniq) in plans.items():
                wait_disk_quiet(quiet_seconds)
                ts = timed(impl.step, items[: k + 10], warmup=10, max_seconds=max_seconds)
                m1 = mem()
                med = float(np.median(ts))
                name = getattr(impl, "name", None) or _name(key)
                out.append({
                    "rows": n, "dist": dist, "impl": name, "steps": len(ts),
                    "batch": batch, "unique_per_batch": uniq, "rows_per_s": batch / med,
                    "p50_ms": med * 1e3, "p99_ms": float(np.percentile(ts, 99)) * 1e3,
                    "rss_anon_mib": (m1["RssAnon"] - m0["RssAnon"]) / 2**20,
                    "rss_file_mib": (m1["RssFile"] - m0["RssFile"]) / 2**20,
                })
                print(f"  {n:>10,} {dist:<7} {name:<28} {batch / med:>12,.0f} rows/s "
                      f"p50 {med * 1e3:7.2f} ms  ({len(ts)} steps)", flush=True)
                if on_row is not None:  # keep partial results of a long run
                    on_row(out)
            impl.close()
            del impl
            gc.collect()
            shutil.rmtree(root, ignore_errors=True)
    for r in out:  # ratios against the anchor measured in the same run, same batches
        anchor = "geoopt SparseRiemannianAdam" if "poincare" in r["impl"] else \
            "torch.optim.SparseAdam"
        ref = [x for x in out if x["rows"] == r["rows"] and x["dist"] == r["dist"]
               and x["impl"] == anchor]
        r["vs_anchor"] = r["rows_per_s"] / ref[0]["rows_per_s"] if ref else float("nan")
    return out


def _name(key):
    return {"dsa_euclid": "dsa_core euclid", "dsa_poincare": "dsa_core poincare",
            "dsa_euclid_clean": "dsa_core euclid, clean pages",
            "dsa_euclid_saved": "dsa_core euclid, undo saved",
            "dsa_euclid_rowwise": "dsa_core euclid rowwise",
            "dsa_euclid_rowwise_bf16m": "dsa_core euclid rowwise bf16m",
            "torch": "torch.optim.SparseAdam", "geoopt": "geoopt SparseRiemannianAdam",
            "seed": "seed-style 3 memmaps"}[key]


def plot(plt, rows):
    cfgs = list(dict.fromkeys((r["rows"], r["dist"]) for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(impls)
    for i, name in enumerate(impls):
        vals = [next((r["rows_per_s"] / 1e6 for r in rows
                      if (r["rows"], r["dist"]) == c and r["impl"] == name), 0) for c in cfgs]
        ax.bar(np.arange(len(cfgs)) + i * width, vals, width, label=name)
    ax.set_xticks(np.arange(len(cfgs)) + 0.4 - width / 2)
    ax.set_xticklabels([f"{n / 1e6:g}M x 128\n{d}" for n, d in cfgs])
    ax.set_ylabel("million rows / s (batch 2048)")
    ax.set_title("Warm step throughput (state in RAM / page cache)")
    ax.legend(fontsize=8)
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 10_000_000])
    ap.add_argument("--dist", nargs="+", default=["unique", "uniform", "zipf"],
                    choices=["unique", "uniform", "zipf"])
    ap.add_argument("--impls", nargs="+", choices=list(IMPLS),
                    default=[k for k in IMPLS if k != "dsa_euclid_clean"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--geoopt-steps", type=int, default=40)
    ap.add_argument("--max-seconds", type=float, default=120.0,
                    help="cap on one implementation x distribution run (its rows say how many "
                         "steps were timed)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--quiet-seconds", type=float, default=60.0,
                    help="longest wait for the disk to go quiet before each timed run")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, a few steps, no waiting for the disk (CI)")
    ap.add_argument("--name", default="warm")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.steps, a.geoopt_steps, a.batch, a.dim = [5000], 5, 3, 64, 16
        a.name, a.quiet_seconds = "warm_smoke", 0.0
    workdir = a.workdir or tempfile.gettempdir()
    import dsa_core

    print(f"warm benchmark: rows {a.rows}, dist {a.dist}, batch {a.batch}, dim {a.dim}, "
          f"dsa_core threads {dsa_core.get_num_threads()}")
    meta = {"machine": machine(), "args": vars(a), "dsa_threads": dsa_core.get_num_threads()}
    rows = run(a.rows, a.dist, a.impls, a.steps, a.batch, a.dim, workdir, a.geoopt_steps,
               a.max_seconds, on_row=lambda r: write_results(a.name, r, meta),
               quiet_seconds=a.quiet_seconds)
    print()
    print_table(rows, ["rows", "dist", "impl", "rows_per_s", "vs_anchor", "p50_ms", "p99_ms",
                       "rss_anon_mib", "rss_file_mib"])
    by = {(r["rows"], r["dist"], r["impl"]): r for r in rows}
    for dist in a.dist:
        for name in ("dsa_core euclid", "dsa_core euclid rowwise",
                     "dsa_core euclid rowwise bf16m", "dsa_core poincare"):
            small, big = by.get((1_000_000, dist, name)), by.get((10_000_000, dist, name))
            if small and big:
                print(f"{name} {dist}: p50 at 10M / 1M = {big['p50_ms'] / small['p50_ms']:.2f}")
    base = write_results(a.name, rows, meta, plot)
    print(f"wrote {base}.json/.csv/.png")


if __name__ == "__main__":
    main()
