"""Weight decay and per-row steps: held-out quality on a recommender task with late rows.

    python -m benchmarks.decay_quality                 # two tasks, 3 seeds, ~6 min on 2 cores
    python -m benchmarks.decay_quality --smoke         # seconds; CI runs this

The options of docs/algorithms.md §7.1 (L2 and decoupled weight decay, lazily or with
``decay_missed_steps``) and §7.2 (``per_row_step``) against ``torch.optim.SparseAdam`` on
the same batches. Writes ``benchmarks/results/decay_quality.{json,csv}``.

**The task.** Matrix factorisation with a planted low-rank structure: ``--users`` x
``--items`` true factors of rank ``--rank`` (entries ``N(0, rank**-0.5)``, so a rating has
variance about 1), ratings ``<u*, v*> + N(0, noise²)``. Items arrive over time: a share
``--late`` of them is released at uniformly random steps of the log (the rest at step 0),
and each event draws its item from the items released so far with Zipf(1.1) popularity (a
random popularity rank per item), its user uniformly. Many rows are therefore first seen
late, some of them popular. The model: user and item tables of ``--dim`` columns
(``N(0, 0.1²)`` init), prediction ``<U_u, V_i>``, loss the batch mean of the squared error;
its gradient rows go to one optimizer with the same options for both tables. Two tasks:

- ``stream``: a log of ``--steps`` batches read once in time order (online training; no
  event is seen twice),
- ``epochs``: a log of ``--steps / --epochs`` batches read ``--epochs`` times in time order
  (the same number of steps on 1/``--epochs`` of the data: the model can overfit).

Held-out: fresh events from the same process at uniformly random times of the log
(validation for choosing hyperparameters, test for the figures). ``late`` is the test MSE on
the events of items first seen in the second half of the log (of training, for ``stream``),
the rows ``per_row_step`` is for (``early``: the other test events, including the few of
items never trained); the noise floor of the MSE is ``noise²``.

**The runs**, all on the same batches and initial tables (a seed fixes the data and the
init): SparseAdam (``nn.Embedding(sparse=True)``), DSA default (must give SparseAdam's
figures: a sanity row), ``per_row_step`` at SparseAdam's lr and at its own best lr, L2,
decoupled (AdamW, lazy), decoupled + ``decay_missed_steps``, and ``per_row_step`` with the
best decay. lr and weight decay are chosen on the validation split of seed 0 (grids in the
JSON and the docs); seeds 1.. rerun the chosen settings on fresh data. Train time is the
whole loop (forward, backward, both optimizer steps), ``opt_ms`` the two optimizer steps.

**The schedule caveat** (second section): ``decay_missed_steps`` decays a revisited row by
``(1 - lr_t*wd)**(t - last)`` at the current lr, exact for a constant lr. For a row idle for
``k`` steps under constant / cosine / step schedules it compares the row's weights after the
revisit with (a) the same lazy step with the exact decay ``prod_s (1 - lr_s*wd)`` (the
schedule error alone) and (b) dense ``torch.optim.AdamW`` fed zero gradients while the row
is idle (the dense reference; it also keeps moving the row on its momentum, which lazy
Adam never does). float64, one row of 16.
"""

from __future__ import annotations

import argparse
import math
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import machine, print_table, write_results

ZIPF = 1.1


# -- the task ---------------------------------------------------------------------------------

def make_task(users, items, rank, log_steps, batch, late, noise, seed, heldout):
    """Planted factors, the training log (time order) and the held-out events."""
    rng = np.random.default_rng(seed)
    scale = rank ** -0.25
    us_true = (scale * rng.standard_normal((users, rank))).astype(np.float32)
    vs_true = (scale * rng.standard_normal((items, rank))).astype(np.float32)
    n0 = items - int(round(items * late))
    release = np.zeros(items, np.int64)  # items in release order
    release[n0:] = np.sort(rng.integers(0, log_steps, items - n0))
    cdf = np.cumsum(1.0 / (rng.permutation(items) + 1.0) ** ZIPF)

    def events(steps):
        avail = np.searchsorted(release, steps, side="right")  # items released by then
        it = np.searchsorted(cdf, rng.random(steps.shape[0]) * cdf[avail - 1], side="right")
        it = np.minimum(it, avail - 1)
        us = rng.integers(0, users, steps.shape[0])
        r = np.einsum("bd,bd->b", us_true[us], vs_true[it], dtype=np.float64)
        r += noise * rng.standard_normal(steps.shape[0])
        return us.astype(np.int64), it.astype(np.int64), r.astype(np.float32)

    train = events(np.repeat(np.arange(log_steps), batch))
    val = events(rng.integers(0, log_steps, heldout // 2))
    test = events(rng.integers(0, log_steps, heldout))
    first = np.full(items, log_steps, np.int64)  # first step of each item in the log
    np.minimum.at(first, train[1], np.repeat(np.arange(log_steps), batch))
    return {"train": train, "val": val, "test": test, "first": first,
            "log_steps": log_steps, "batch": batch, "users": users, "items": items,
            "seed": seed}


def initial_tables(task, dim):
    rng = np.random.default_rng(10_000 + task["seed"])
    return ((0.1 * rng.standard_normal((task["users"], dim))).astype(np.float32),
            (0.1 * rng.standard_normal((task["items"], dim))).astype(np.float32))


def heldout_mse(P, Q, ev, mask=None):
    us, it, r = ev
    if mask is not None:
        us, it, r = us[mask], it[mask], r[mask]
    if us.shape[0] == 0:
        return float("nan")
    pred = np.einsum("bd,bd->b", P[us], Q[it], dtype=np.float64)
    return float(np.mean((pred - r) ** 2))


# -- the optimizers ---------------------------------------------------------------------------

class TorchSparseAdam:
    """Two ``nn.Embedding(sparse=True)`` tables and one ``torch.optim.SparseAdam``."""

    def __init__(self, U0, V0, lr, root):
        import torch

        self.torch = torch
        self.eu = torch.nn.Embedding(*U0.shape, sparse=True)
        self.ei = torch.nn.Embedding(*V0.shape, sparse=True)
        with torch.no_grad():
            self.eu.weight.copy_(torch.from_numpy(U0))
            self.ei.weight.copy_(torch.from_numpy(V0))
        self.opt = torch.optim.SparseAdam([self.eu.weight, self.ei.weight], lr=lr)

    def train_step(self, u, i, y):
        t = self.torch
        a, b = self.eu(t.from_numpy(u)), self.ei(t.from_numpy(i))
        loss = ((a * b).sum(1) - t.from_numpy(y)).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        t0 = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - t0

    def tables(self):
        return self.eu.weight.detach().numpy(), self.ei.weight.detach().numpy()

    def close(self):
        pass


class Dsa:
    """Two ``dsa_core`` stores (weights in the store); torch computes the gradient rows."""

    def __init__(self, U0, V0, lr, root, **options):
        import torch

        import dsa_core

        self.torch, self.dsa = torch, dsa_core
        self.su = dsa_core.create(Path(root) / "users", *U0.shape, init=U0, lr=lr,
                                  progress=False, **options)
        self.si = dsa_core.create(Path(root) / "items", *V0.shape, init=V0, lr=lr,
                                  progress=False, **options)

    def train_step(self, u, i, y):
        t = self.torch
        a = t.from_numpy(self.su.weights[u]).requires_grad_()
        b = t.from_numpy(self.si.weights[i]).requires_grad_()
        loss = ((a * b).sum(1) - t.from_numpy(y)).pow(2).mean()
        loss.backward()
        t0 = time.perf_counter()
        self.su = self.dsa.step(self.su, u, a.grad.numpy())
        self.si = self.dsa.step(self.si, i, b.grad.numpy())
        return time.perf_counter() - t0

    def tables(self):
        return self.su.weights, self.si.weights

    def close(self):
        self.dsa.close(self.su)
        self.dsa.close(self.si)


def train(task, dim, epochs, impl, lr, options, workdir, keep_tables=False):
    """Train one model; return its held-out figures (and, if asked, a copy of its tables)."""
    U0, V0 = initial_tables(task, dim)
    root = Path(tempfile.mkdtemp(dir=workdir, prefix="decay_quality_"))
    try:
        opt = (TorchSparseAdam(U0, V0, lr, root) if impl == "torch"
               else Dsa(U0, V0, lr, root, **options))
        us, it, r = task["train"]
        b, n = task["batch"], task["log_steps"]
        opt_s = 0.0
        t0 = time.perf_counter()
        for e in range(epochs):
            for s in range(n):
                sl = slice(s * b, (s + 1) * b)
                opt_s += opt.train_step(us[sl], it[sl], r[sl])
        train_s = time.perf_counter() - t0
        P, Q = opt.tables()
        late = task["first"] >= n // 2
        late &= task["first"] < n  # seen at all
        test_late = late[task["test"][1]]
        out = {"val_mse": heldout_mse(P, Q, task["val"]),
               "test_mse": heldout_mse(P, Q, task["test"]),
               "test_mse_late": heldout_mse(P, Q, task["test"], test_late),
               "test_mse_early": heldout_mse(P, Q, task["test"], ~test_late),
               "train_s": train_s, "opt_ms": opt_s / (epochs * n) * 1e3}
        if keep_tables:
            out["tables"] = (P.copy(), Q.copy())
        opt.close()
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- the experiment ---------------------------------------------------------------------------

DECAYS = {  # name: (options, weight-decay grid)
    "L2": ({"decoupled_weight_decay": False}, (3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3)),
    "AdamW lazy": ({"decoupled_weight_decay": True}, (0.03, 0.1, 0.3, 1.0, 3.0)),
    "AdamW + decay_missed_steps": ({"decoupled_weight_decay": True, "decay_missed_steps": True},
                                   (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)),
}
LRS = (2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2)


def run_task(name, a, seeds, workdir, log):
    epochs = 1 if name == "stream" else a.epochs
    log_steps = a.steps // epochs

    def task_for(seed):
        return make_task(a.users, a.items, a.rank, log_steps, a.batch, a.late, a.noise, seed,
                         a.heldout)

    def go(task, impl, lr, options, **kw):
        r = train(task, a.dim, epochs, impl, lr, options, workdir, **kw)
        log(f"  {name:<7} seed {task['seed']}  {impl:<5} lr {lr:<7g} "
            f"{_opts(options):<48} val {r['val_mse']:.4f} test {r['test_mse']:.4f} "
            f"late {r['test_mse_late']:.4f}  {r['train_s']:.1f} s")
        return r

    task = task_for(seeds[0])
    n_late = int(((task["first"] >= log_steps // 2) & (task["first"] < log_steps)).sum())
    info = {"task": name, "epochs": epochs, "log_steps": log_steps,
            "items_first_seen_late": n_late,
            "items_never_seen": int((task["first"] >= log_steps).sum()),
            "test_share_late": float(np.mean(
                (task["first"] >= log_steps // 2)[task["test"][1]]
                & (task["first"] < log_steps)[task["test"][1]]))}
    log(f"{name}: {a.users:,} user rows x {a.items:,} item rows x {a.dim}, "
        f"{log_steps} batches of {a.batch} x {epochs} epoch(s); {n_late:,} items first seen "
        f"in the second half, {info['test_share_late']:.1%} of the test events")

    # 1. choose on seed 0's validation split: lr for the default and for per_row_step ...
    grid = []

    def pick(label, lrs, wds, options):
        best = None
        for lr in lrs:
            for wd in wds:
                opts = dict(options, **({"weight_decay": wd} if wd else {}))
                r = go(task, "dsa", lr, opts)
                grid.append({"task": name, "config": label, "lr": lr, "weight_decay": wd,
                             "val_mse": r["val_mse"], "test_mse": r["test_mse"],
                             "test_mse_late": r["test_mse_late"]})
                if best is None or r["val_mse"] < best[0]["val_mse"]:
                    best = (r, lr, opts)
        return best

    lrs = a.lrs
    base = pick("default", lrs, [0.0], {})
    prs = pick("per_row_step", lrs, [0.0], {"per_row_step": True})
    lr0 = base[1]
    decays = {k: pick(k, [lr0], grid_wd, opts) for k, (opts, grid_wd) in a.decays.items()}
    best_decay = min(decays, key=lambda k: decays[k][0]["val_mse"])
    opts_d, grid_d = a.decays[best_decay]
    combo = pick(f"per_row_step + {best_decay}", [prs[1]], grid_d,
                 dict(opts_d, per_row_step=True))

    configs = [  # (label, impl, lr, options, seed-0 result if already run)
        ("torch.optim.SparseAdam", "torch", lr0, {}, None),
        ("DSA default", "dsa", lr0, {}, base[0]),
        ("DSA per_row_step (same lr)", "dsa", lr0, {"per_row_step": True}, None),
        ("DSA per_row_step (own lr)", "dsa", prs[1], prs[2], prs[0]),
        *((f"DSA {k}", "dsa", lr0, v[2], v[0]) for k, v in decays.items()),
        (f"DSA per_row_step + {best_decay}", "dsa", combo[1], combo[2], combo[0]),
    ]
    if prs[1] == lr0:  # the same run twice
        configs = [c for c in configs if c[0] != "DSA per_row_step (same lr)"]

    # 2. the chosen settings on every seed (seed 0's runs reused); the sanity comparison
    runs = []
    for seed in seeds:
        tk = task if seed == seeds[0] else task_for(seed)
        tables = {}
        for label, impl, lr, opts, r0 in configs:
            sanity = seed == seeds[0] and label in ("torch.optim.SparseAdam", "DSA default")
            r = r0 if (seed == seeds[0] and r0 is not None and not sanity) else \
                go(tk, impl, lr, opts, keep_tables=sanity)
            if sanity:
                tables[label] = r.pop("tables")
            runs.append(dict(task=name, seed=seed, config=label, lr=lr,
                             weight_decay=opts.get("weight_decay", 0.0), options=_opts(opts),
                             **r))
        if tables:
            (Pt, Qt), (Pd, Qd) = tables["torch.optim.SparseAdam"], tables["DSA default"]
            info["sanity_max_abs_diff"] = float(max(np.abs(Pt - Pd).max(),
                                                    np.abs(Qt - Qd).max()))
            info["sanity_max_abs_weight"] = float(max(np.abs(Pt).max(), np.abs(Qt).max()))
        del tk
    return summarise(name, runs, configs), runs, grid, info


def summarise(name, runs, configs):
    rows = []
    ref = {r["seed"]: r for r in runs if r["config"] == "torch.optim.SparseAdam"}
    for label, _impl, lr, opts, _r in configs:
        rs = [r for r in runs if r["config"] == label]
        row = {"task": name, "config": label, "lr": lr,
               "weight_decay": opts.get("weight_decay", 0.0), "seeds": len(rs)}
        for key in ("test_mse", "test_mse_late", "test_mse_early"):
            x = np.array([r[key] for r in rs])
            rel = np.array([r[key] / ref[r["seed"]][key] - 1.0 for r in rs])
            row[key] = float(x.mean())
            row[f"{key}_sd"] = float(x.std(ddof=1)) if len(x) > 1 else 0.0
            row[f"{key}_vs_sparseadam"] = float(rel.mean())
            row[f"{key}_vs_sparseadam_min"] = float(rel.min())
            row[f"{key}_vs_sparseadam_max"] = float(rel.max())
        row["train_s"] = float(np.mean([r["train_s"] for r in rs]))
        row["opt_ms"] = float(np.mean([r["opt_ms"] for r in rs]))
        rows.append(row)
    return rows


def _opts(o):
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else k for k, v in o.items()
                     if v not in (False, 0.0)) or "-"


# -- the schedule caveat ----------------------------------------------------------------------

def lr_at(schedule, t, total, lr0):
    if schedule == "constant":
        return lr0
    if schedule == "cosine":
        return lr0 * 0.5 * (1.0 + math.cos(math.pi * (t - 1) / total))
    if schedule == "step":  # x0.1 at half-way
        return lr0 * (0.1 if t > total // 2 else 1.0)
    raise ValueError(schedule)


def schedule_check(total, lr0, wds, windows, dim, workdir, seed=0):
    """Weights of a row idle for k steps, then revisited: DSA vs exact decay vs dense AdamW."""
    import torch

    import dsa_core

    out = []
    b1, b2, eps = 0.9, 0.999, 1e-8
    for schedule in ("constant", "cosine", "step"):
        for wd in wds:
            for s0, k in windows:
                rng = np.random.default_rng(seed)
                p0 = rng.standard_normal(dim)
                grads = {t: rng.standard_normal(dim) for t in list(range(1, s0 + 1))
                         + [s0 + k + 1]}
                root = Path(tempfile.mkdtemp(dir=workdir, prefix="decay_sched_"))
                st = dsa_core.create(root / "s", 1, dim, dtype="float64", init=p0[None],
                                     lr=lr0, weight_decay=wd, decoupled_weight_decay=True,
                                     decay_missed_steps=True, progress=False)
                p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
                dense = torch.optim.AdamW([p], lr=lr0, betas=(b1, b2), eps=eps, weight_decay=wd)
                # the exact-decay lazy oracle (SparseAdam's update, docs/algorithms.md §2.2)
                q, m, v, last = p0.copy(), np.zeros(dim), np.zeros(dim), 0
                lrs = {}
                for t in range(1, s0 + k + 2):
                    lr = lrs[t] = lr_at(schedule, t, total, lr0)
                    g = grads.get(t)
                    if g is None:
                        st = dsa_core.step(st, np.zeros(0, np.int64), np.zeros((0, dim)), lr=lr)
                        p.grad = torch.zeros(dim, dtype=torch.float64)
                    else:
                        st = dsa_core.step(st, [0], g[None], lr=lr)
                        p.grad = torch.from_numpy(g.copy())
                        q *= np.prod([1.0 - lrs[s] * wd for s in range(last + 1, t + 1)])
                        m += (g - m) * (1 - b1)
                        v += (g * g - v) * (1 - b2)
                        s = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                        q -= s * m / (np.sqrt(v) + eps)
                        last = t
                    for grp in dense.param_groups:
                        grp["lr"] = lr
                    dense.step()
                w = np.array(st.weights[0], np.float64)
                dsa_core.close(st)
                shutil.rmtree(root, ignore_errors=True)
                pd = p.detach().numpy()
                t = s0 + k + 1
                exact = np.prod([1.0 - lrs[s] * wd for s in range(s0 + 1, t + 1)])
                used = (1.0 - lrs[t] * wd) ** (k + 1)
                out.append({"schedule": schedule, "weight_decay": wd, "lr": lr0,
                            "idle_from": s0, "idle_steps": k,
                            "decay_factor_exact": float(exact),
                            "decay_factor_used": float(used),
                            "rel_err_vs_exact_decay": float(np.linalg.norm(w - q)
                                                            / np.linalg.norm(q)),
                            "rel_err_vs_dense_adamw": float(np.linalg.norm(w - pd)
                                                            / np.linalg.norm(pd))})
    return out


def _loadavg():
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


# -- main -------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--users", type=int, default=50_000)
    ap.add_argument("--items", type=int, default=20_000)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8, help="rank of the planted factors")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3000, help="training steps of each run")
    ap.add_argument("--epochs", type=int, default=5, help="passes of the 'epochs' task")
    ap.add_argument("--late", type=float, default=0.5, help="share of items released late")
    ap.add_argument("--noise", type=float, default=0.5, help="rating noise (sd)")
    ap.add_argument("--heldout", type=int, default=200_000, help="test events (val: half)")
    ap.add_argument("--tasks", nargs="+", default=["stream", "epochs"],
                    choices=["stream", "epochs"])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch and dsa_core threads")
    ap.add_argument("--schedule-steps", type=int, default=3000)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one seed (CI)")
    ap.add_argument("--name", default="decay_quality")
    a = ap.parse_args(argv)
    a.lrs, a.decays = LRS, DECAYS
    windows = [(0, 10), (0, 100), (0, 1000), (1000, 10), (1000, 100), (1000, 1000)]
    if a.smoke:
        a.users, a.items, a.dim, a.batch, a.steps, a.epochs = 2000, 1000, 8, 128, 40, 2
        a.heldout, a.seeds, a.schedule_steps, a.name = 2000, 1, 60, "decay_quality_smoke"
        a.lrs = (1e-2,)
        a.decays = {k: (o, g[2:3]) for k, (o, g) in DECAYS.items()}
        windows = [(0, 10), (10, 20)]
    workdir = a.workdir or tempfile.gettempdir()
    import torch

    import dsa_core

    torch.set_num_threads(a.threads)
    dsa_core.set_num_threads(a.threads)
    dsa_core.warmup(("float32", "float64"))

    def log(msg):
        print(msg, flush=True)

    load0 = _loadavg()
    t0 = time.perf_counter()
    rows, runs, grid, infos = [], [], [], []
    seeds = list(range(a.seeds))
    for name in a.tasks:
        r, x, g, info = run_task(name, a, seeds, workdir, log)
        rows += r
        runs += x
        grid += g
        infos.append(info)
    log("\nschedule caveat (decay_missed_steps with a schedule, float64):")
    sched = schedule_check(a.schedule_steps, 1e-2, (0.01, 0.1), windows, 16, workdir)
    print_table(sched, ["schedule", "weight_decay", "idle_from", "idle_steps",
                        "decay_factor_exact", "decay_factor_used", "rel_err_vs_exact_decay",
                        "rel_err_vs_dense_adamw"])
    print()
    print_table(rows, ["task", "config", "lr", "weight_decay", "test_mse",
                       "test_mse_vs_sparseadam", "test_mse_late", "test_mse_late_vs_sparseadam",
                       "train_s", "opt_ms"])
    for info in infos:
        print(f"{info['task']}: SparseAdam vs DSA default, largest weight difference "
              f"{info.get('sanity_max_abs_diff', float('nan')):.3g} "
              f"(largest weight {info.get('sanity_max_abs_weight', float('nan')):.3g})")
    load = _loadavg()
    meta = {"machine": machine(), "args": {k: v for k, v in vars(a).items() if k != "decays"},
            "decay_grids": {k: list(g) for k, (_o, g) in a.decays.items()},
            "tasks": infos, "grid": grid, "runs": runs, "schedule": sched,
            "loadavg_start": load0, "loadavg_end": load, "wall_s": time.perf_counter() - t0}
    base = write_results(a.name, rows, meta)
    print(f"\nwrote {base}.json/.csv ({meta['wall_s']:.0f} s, load {' '.join(load)})")


if __name__ == "__main__":
    main()
