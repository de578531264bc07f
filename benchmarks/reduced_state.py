"""Reduced state: what row-wise v and a bfloat16 m cost in accuracy (speed: ``warm``, ``ooc``).

    python -m benchmarks.reduced_state                 # 50k x 64, two tasks, uniform and zipf
    python -m benchmarks.reduced_state --smoke         # seconds; CI runs this

A planted regression task, the shape of an embedding under a fixed read-out: a hidden table
``X`` (num_rows x dim), samples ``(i, c)`` with row ``i`` drawn uniformly or Zipf(1.1) and a
context vector ``c ~ N(0, diag(s²)/dim)``, target ``y = <X_i, c>``, loss
``mean((<E_i, c> - y)^2)``. ``isotropic``: s = 1 for every coordinate, where one v per row
loses nothing; ``anisotropic``: s spread log-uniformly over 100x, where per-coordinate v is
what lets Adam move the small-gradient coordinates -- the case row-wise state pays for.
Every optimizer gets the same samples and computes its gradient (NumPy) from its own
weights, so the runs differ only in the optimizer:

- ``torch.optim.SparseAdam`` (the anchor),
- ``dsa_core`` elementwise (SparseAdam's update: its curve must sit on the anchor's),
- ``dsa_core`` rowwise (docs/algorithms.md §7.3: one v per row from the mean of ``g²``),
- ``dsa_core`` bf16m (docs/algorithms.md §6: m stored as bfloat16 with stochastic
  rounding), and both.

Reported: the held-out loss (fixed samples) at checkpoints and at the end, and relative to
SparseAdam's; the final train loss (mean of the last 10% of steps); how well the hidden rows
were recovered (RMSE of ``E - X`` over the rows seen, and over the quarter of coordinates
with the smallest context scale, which the loss weighs least); the state bytes per row; and
each run's weights' distance from the elementwise ones after ``--dev-steps`` steps, relative
to how far the elementwise weights moved (the docs/algorithms.md §6 measure used for bf16). Writes
``benchmarks/results/reduced_state.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import machine, print_table, write_results, zipf_sampler


def make_task(n, d, rows, steps, dist, spread, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, d)).astype(np.float32)
    E0 = (0.1 * rng.standard_normal((n, d))).astype(np.float32)
    scale = (np.logspace(0, np.log10(spread), d) / np.sqrt(d)).astype(np.float32)
    if dist == "zipf":
        draw = zipf_sampler(n, 1.1, rng)
    else:
        def draw(k):
            return rng.integers(0, n, k)

    def sample(k):
        return draw(k), rng.standard_normal((k, d)).astype(np.float32) * scale

    return X, E0, [sample(rows) for _ in range(steps)], sample(20_000)


def sample_loss(E, X, i, c):
    r = np.einsum("bd,bd->b", E[i], c) - np.einsum("bd,bd->b", X[i], c)
    return float(np.mean(r.astype(np.float64) ** 2))


def batch_grad(E_i, X, i, c):
    """The batch's row ids and their loss gradients (float32), and the batch loss."""
    r = np.einsum("bd,bd->b", E_i, c) - np.einsum("bd,bd->b", X[i], c)
    g = (r * np.float32(2.0 / i.shape[0]))[:, None] * c
    return i, g.astype(np.float32), float(np.mean(r.astype(np.float64) ** 2))


class Torch:
    name = "torch.optim.SparseAdam"

    def __init__(self, E0, lr, root):
        import torch

        self.torch = torch
        self.p = torch.nn.Parameter(torch.from_numpy(E0.copy()))
        self.opt = torch.optim.SparseAdam([self.p], lr=lr)
        self.state_bytes_per_row = 2 * E0.shape[1] * 4

    def weights(self):
        return self.p.detach().numpy()

    def apply(self, idx, g):
        t = self.torch
        self.p.grad = t.sparse_coo_tensor(t.from_numpy(idx)[None], t.from_numpy(g),
                                          self.p.shape, check_invariants=False)
        self.opt.step()
        self.p.grad = None

    def close(self):
        pass


class Dsa:
    def __init__(self, E0, lr, root, key, second_moment="elementwise", first_moment="full"):
        import dsa_core

        self.dsa = dsa_core
        self.name = f"dsa_core {key}"
        self.state = dsa_core.create(Path(root) / key, E0.shape[0], E0.shape[1], init=E0,
                                     lr=lr, second_moment=second_moment,
                                     first_moment=first_moment, progress=False,
                                     storage="inplace")
        lay = self.state.store.layout
        self.state_bytes_per_row = (lay.stride - E0.shape[1]) * lay.dtype.itemsize

    def weights(self):
        return self.state.weights

    def apply(self, idx, g):
        self.state = self.dsa.step(self.state, idx, g)

    def close(self):
        self.dsa.close(self.state)


IMPLS = {
    "torch": lambda E0, lr, root: Torch(E0, lr, root),
    "elementwise": lambda E0, lr, root: Dsa(E0, lr, root, "elementwise"),
    "rowwise": lambda E0, lr, root: Dsa(E0, lr, root, "rowwise", second_moment="rowwise"),
    "bf16m": lambda E0, lr, root: Dsa(E0, lr, root, "bf16m", first_moment="bfloat16"),
    "rowwise+bf16m": lambda E0, lr, root: Dsa(E0, lr, root, "rowwise+bf16m",
                                               second_moment="rowwise",
                                               first_moment="bfloat16"),
}


def run(n, d, rows, steps, tasks, dists, lr, dev_steps, workdir, evals=10):
    out, curves = [], []
    for task in tasks:
        spread = 1.0 if task == "isotropic" else 100.0
        for dist in dists:
            X, E0, batches, hold = make_task(n, d, rows, steps, dist, spread)
            snap = {}
            for key, make in IMPLS.items():
                root = Path(tempfile.mkdtemp(dir=workdir, prefix=f"reduced_{key}_"))
                impl = make(E0, lr, root)
                train, opt_s = [], 0.0
                every = max(1, steps // evals)
                for s, (i, c) in enumerate(batches, start=1):
                    idx, g, loss = batch_grad(impl.weights()[i], X, i, c)
                    train.append(loss)
                    t0 = time.perf_counter()
                    impl.apply(idx, g)
                    opt_s += time.perf_counter() - t0
                    if s == dev_steps:
                        snap[key] = impl.weights().copy()
                    if s % every == 0 or s == steps:
                        curves.append({"task": task, "dist": dist, "impl": impl.name,
                                       "step": s,
                                       "heldout_loss": sample_loss(impl.weights(), X, *hold)})
                tail = max(1, steps // 10)
                seen = np.unique(np.concatenate([b[0] for b in batches]))
                err = (impl.weights()[seen] - X[seen]).astype(np.float64) ** 2
                q = max(1, d // 4)  # the quarter of coordinates with the smallest contexts
                out.append({
                    "task": task, "dist": dist, "impl": impl.name, "key": key, "steps": steps,
                    "initial_heldout": sample_loss(E0, X, *hold),
                    "final_heldout": sample_loss(impl.weights(), X, *hold),
                    "final_train": float(np.mean(train[-tail:])),
                    "rmse_E_X": float(np.sqrt(err.mean())),
                    "rmse_E_X_small_quarter": float(np.sqrt(err[:, :q].mean())),
                    "state_B_per_row": impl.state_bytes_per_row,
                    "opt_ms_per_step": opt_s / steps * 1e3,
                })
                print(f"  {task:<11} {dist:<7} {impl.name:<24} held-out "
                      f"{out[-1]['final_heldout']:.4g} (from {out[-1]['initial_heldout']:.4g})",
                      flush=True)
                impl.close()
                shutil.rmtree(root, ignore_errors=True)
            if "elementwise" in snap:
                moved = np.linalg.norm(snap["elementwise"] - E0)
                for r in out:
                    if (r["task"], r["dist"]) == (task, dist):
                        r[f"dev_vs_elementwise_at_{dev_steps}"] = float(
                            np.linalg.norm(snap[r["key"]] - snap["elementwise"]) / moved)
    for r in out:  # the accuracy cost: final held-out loss relative to SparseAdam's
        ref = next(x for x in out if (x["task"], x["dist"]) == (r["task"], r["dist"])
                   and x["impl"].startswith("torch"))
        r["heldout_vs_torch"] = r["final_heldout"] / ref["final_heldout"]
    return out, curves


def plot(plt, curves):
    cfgs = list(dict.fromkeys((c["task"], c["dist"]) for c in curves))
    fig, axes = plt.subplots(1, len(cfgs), figsize=(4.5 * len(cfgs), 3.6), squeeze=False)
    for ax, (task, dist) in zip(axes[0], cfgs):
        for name in dict.fromkeys(c["impl"] for c in curves):
            pts = [(c["step"], c["heldout_loss"]) for c in curves
                   if (c["task"], c["dist"]) == (task, dist) and c["impl"] == name]
            ax.plot(*zip(*pts), marker="o", ms=3, label=name,
                    ls="--" if "elementwise" in name else "-")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out loss")
        ax.set_title(f"{task}, {dist} rows", fontsize=10)
        ax.legend(fontsize=7)
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=50_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048, help="samples (rows) per batch")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--tasks", nargs="+", default=["isotropic", "anisotropic"],
                    choices=["isotropic", "anisotropic"])
    ap.add_argument("--dist", nargs="+", default=["uniform", "zipf"],
                    choices=["uniform", "zipf"])
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--dev-steps", type=int, default=200)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    ap.add_argument("--name", default="reduced_state")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.dev_steps = 2000, 8, 64, 30, 10
        a.name = "reduced_state_smoke"
    workdir = a.workdir or tempfile.gettempdir()
    import dsa_core

    dsa_core.warmup(("float32",))  # compile outside the timed steps
    print(f"reduced-state benchmark: {a.rows:,} rows x {a.dim}, batch {a.batch}, "
          f"{a.steps} steps, lr {a.lr}")
    rows, curves = run(a.rows, a.dim, a.batch, a.steps, a.tasks, a.dist, a.lr, a.dev_steps,
                       workdir)
    print()
    print_table(rows, ["task", "dist", "impl", "initial_heldout", "final_heldout",
                       "heldout_vs_torch", "final_train", "rmse_E_X",
                       "rmse_E_X_small_quarter", f"dev_vs_elementwise_at_{a.dev_steps}",
                       "state_B_per_row",
                       "opt_ms_per_step"])
    meta = {"machine": machine(), "args": vars(a), "curves": curves}
    base = write_results(a.name, rows, meta, lambda plt, _rows: plot(plt, curves))
    print(f"\nwrote {base}.json/.csv/.png")


if __name__ == "__main__":
    main()
