"""Adagrad and row-wise Adagrad against their anchors and against Adam (issue 43's benchmarks).

    python -m benchmarks.adagrad warm --rows 1000000            # vs torch.optim.Adagrad
    python -m benchmarks.adagrad ooc --rows 4000000 --cap 1G    # row-wise Adagrad vs Adam
    python -m benchmarks.adagrad quality --epochs 100           # Kinships MRR vs PBG's update
    python -m benchmarks.adagrad --smoke                        # seconds: all three, tiny

``warm``: one process, the same uniform batches of ``--batch`` ids (64 batches cycled, as the
guard's warm step: after the first pass every row was changed since the last flush, so an
in-place store's undo file is not in the figure) and gradients (float32, dim 128), every table
in RAM: ``torch.optim.Adagrad`` on an ``nn.Embedding(sparse=True)``
(its ``sum`` pre-touched; the timed call is ``opt.step()`` on a prepared sparse gradient),
``torch.optim.SparseAdam`` the same way, and ``dsa_core.step`` on in-place stores of
``optimizer="adagrad"``, ``"rowwise_adagrad"`` and Adam (every page touched first). Prints
the median rows/s of each and each DSA one over ``torch.optim.Adagrad``.

``ooc``: a log store (``storage="log"``, ``memory=--memory``) of ``--rows`` x 128 per
optimizer, every row written once, then ``--steps`` uniform steps of ``--batch`` ids timed,
each optimizer in a child process under a memory cgroup of ``--cap`` (the repo's
``benchmarks/memcap.sh``; uncapped where no cgroup can be made, and it says so). Prints the
rows/s and the bytes read and written per row touched (``/proc/self/io``) of row-wise Adagrad
(a record of ``dim + 1`` floats) and Adam (``3 x dim``), and their ratios.

``quality``: TransE (dim ``--dim``) on PyKEEN's Kinships through ``pipeline()`` (sLCWA,
``--epochs``, batches of 256, seed 0), trained by ``adapters.pykeen.DiskAdagrad(rowwise=True)``
(state on disk) and by PyTorch-BigGraph's ``RowAdagrad`` update in memory (a transcription of
``torchbiggraph/row_adagrad.py`` as a torch optimizer, below); prints both test MRRs and
Hits@10. Writes ``benchmarks/results/adagrad_{warm,ooc,quality}[_smoke].{json,csv}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from ._common import batches, machine, predirty, print_table, rewrite_rows, timed, write_results

ROOT = Path(__file__).resolve().parents[1]
MEMCAP = Path(__file__).resolve().parent / "memcap.sh"
DIM = 128


def _io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused at the storage layer."""
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k] = int(v)
    return out["read_bytes"], out["write_bytes"]


# -- warm ----------------------------------------------------------------------------------
def warm(a) -> list[dict]:
    import torch

    import dsa_core

    torch.set_num_threads(dsa_core.get_num_threads())
    dsa_core.warmup(("float32",))
    cyc = batches(a.rows, a.batch, 64, "uniform", seed=0)  # cycled, as the guard's warm:
    ids = [cyc[k % 64] for k in range(a.steps + a.warmup)]  # rows already changed
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((a.batch, DIM), dtype=np.float32) * 1e-2 for _ in range(8)]
    rows = []

    def torch_run(name, make_opt):
        emb = torch.nn.Embedding(a.rows, DIM, sparse=True)
        opt = make_opt(emb.parameters())
        sparse = [torch.sparse_coo_tensor(torch.from_numpy(i)[None], torch.from_numpy(
            grads[k % len(grads)]), (a.rows, DIM)) for k, i in enumerate(ids)]
        emb.weight.grad = sparse[0]
        opt.step()  # the state tensors made (and touched: dense zeros)

        def one(g):
            emb.weight.grad = g
            opt.step()

        ts = timed(one, sparse, a.warmup)
        rows.append({"impl": name, "rows_per_s": a.batch / float(np.median(ts)),
                     "p50_ms": 1e3 * float(np.median(ts))})

    with warnings.catch_warnings():  # torch's own sparse Adagrad warns at every step
        warnings.filterwarnings("ignore", "Sparse invariant checks")
        torch_run("torch Adagrad", lambda p: torch.optim.Adagrad(p, lr=1e-2))
        torch_run("torch SparseAdam", lambda p: torch.optim.SparseAdam(p, lr=1e-3))
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for opt in ("adagrad", "rowwise_adagrad", "adam"):
            kw = {"lr": 1e-3} if opt == "adam" else {"lr": 1e-2, "optimizer": opt}
            st = dsa_core.create(f"{tmp}/{opt}", a.rows, DIM, storage="inplace",
                                 init="uniform", init_scale=1e-3, progress=False, **kw)
            predirty(st)
            box = [st]
            ks = iter(range(10**9))

            def one(i):
                box[0] = dsa_core.step(box[0], i, grads[next(ks) % len(grads)])

            ts = timed(one, ids, a.warmup)
            dsa_core.close(box[0])
            rows.append({"impl": f"dsa {opt}", "rows_per_s": a.batch / float(np.median(ts)),
                         "p50_ms": 1e3 * float(np.median(ts))})
    base = rows[0]["rows_per_s"]
    for r in rows:
        r["x_torch_adagrad"] = r["rows_per_s"] / base
    return rows


# -- out of core -------------------------------------------------------------------------
def ooc_child(a) -> dict:
    import dsa_core

    dsa_core.warmup(("float32",))
    kw = {"lr": 1e-3} if a.optimizer == "adam" else {"lr": 1e-2, "optimizer": a.optimizer}
    path = Path(a.root) / a.optimizer
    st = dsa_core.create(path, a.rows, DIM, storage="log", memory=a.memory, init="uniform",
                         init_scale=1e-3, progress=False, **kw)
    rewrite_rows(st, chunk_rows=1024)  # every row written once: the state of a long run
    dsa_core.flush(st)
    ids = batches(a.rows, a.batch, a.steps + a.warmup, "uniform", seed=0)
    g = np.random.default_rng(1).standard_normal((a.batch, DIM), dtype=np.float32) * 1e-2
    box = [st]
    marks = {}

    def one(i):
        if len(marks) == 0 and one.k == a.warmup:
            marks["io"], marks["t"] = _io(), time.perf_counter()
        box[0] = dsa_core.step(box[0], i, g)
        one.k += 1

    one.k = 0
    ts = timed(one, ids, a.warmup)
    dsa_core.flush(box[0])
    r1, w1 = _io()
    wall = time.perf_counter() - marks["t"]
    rec_bytes = box[0].layout["stride"] * 4
    dsa_core.close(box[0])
    touched = a.batch * a.steps
    return {"optimizer": a.optimizer, "record_bytes": rec_bytes,
            "rows_per_s": touched / wall, "p50_ms": 1e3 * float(np.median(ts)),
            "read_bytes_per_row": (r1 - marks["io"][0]) / touched,
            "written_bytes_per_row": (w1 - marks["io"][1]) / touched}


def ooc(a) -> list[dict]:
    capped = MEMCAP.is_file() and a.cap != "none" and subprocess.run(
        ["bash", str(MEMCAP), "64M", "true"], check=False, capture_output=True).returncode == 0
    if not capped:
        print("no memory cgroup here: running uncapped (the page cache may hold the tables)")
    rows = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for opt in ("rowwise_adagrad", "adam"):
            cmd = [sys.executable, "-m", "benchmarks.adagrad", "ooc-child", "--optimizer", opt,
                   "--root", tmp, "--rows", str(a.rows), "--batch", str(a.batch),
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--memory", a.memory]
            if capped:
                cmd = ["bash", str(MEMCAP), a.cap, *cmd]
            r = subprocess.run(cmd, check=False, capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                raise SystemExit(f"the {opt} child failed ({r.returncode}): {r.stderr[-800:]}")
            row = json.loads(r.stdout.strip().splitlines()[-1])
            row["cap"] = a.cap if capped else "none"
            rows.append(row)
            shutil.rmtree(Path(tmp) / opt, ignore_errors=True)
    ada, adam = rows
    for r in rows:
        r["x_adam_rows_per_s"] = r["rows_per_s"] / adam["rows_per_s"]
        r["x_adam_bytes"] = ((r["read_bytes_per_row"] + r["written_bytes_per_row"])
                             / max(1.0, adam["read_bytes_per_row"]
                                   + adam["written_bytes_per_row"]))
    return rows


# -- quality ------------------------------------------------------------------------------
def _pbg_row_adagrad():
    """PyTorch-BigGraph's ``RowAdagrad`` (``torchbiggraph/row_adagrad.py``), sparse branch, as
    a torch optimizer PyKEEN can rebuild from its param groups: one float of state per row,
    ``sum[r] += mean(g*g)``, ``p[r] -= clr * g / (sqrt(sum[r]) + eps)``."""
    import torch

    class RowAdagrad(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-2, lr_decay=0.0, eps=1e-10):
            super().__init__(params, {"lr": lr, "lr_decay": lr_decay, "eps": eps})

        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    st = self.state[p]
                    if not st:
                        st["step"], st["sum"] = 0, p.new_zeros((p.shape[0],))
                    st["step"] += 1
                    clr = group["lr"] / (1 + (st["step"] - 1) * group["lr_decay"])
                    g = p.grad.coalesce()
                    idx, val = g.indices()[0], g.values()
                    local = st["sum"][idx]
                    delta = (val * val).mean(1)
                    st["sum"].index_add_(0, idx, delta)
                    std = (local + delta).sqrt_().add_(group["eps"]).unsqueeze(1)
                    p.index_add_(0, idx, -clr * val / std)

    return RowAdagrad


def quality(a) -> list[dict]:
    import logging

    from pykeen.pipeline import pipeline

    from adapters import pykeen as dsa

    for name in ("pykeen", "torch_max_mem"):
        logging.getLogger(name).setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        for how in ("pbg in memory", "dsa DiskAdagrad rowwise"):
            pbg = how.startswith("pbg")
            opt = _pbg_row_adagrad() if pbg else dsa.DiskAdagrad
            okw = {"lr": a.lr} if pbg else {"lr": a.lr, "rowwise": True,
                                            "state_dir": f"{tmp}/opt"}
            t0 = time.perf_counter()
            r = pipeline(dataset="Kinships", model="TransE", random_seed=0,
                         model_kwargs=dict(embedding_dim=a.dim,
                                           **dsa.sparse_representations()),
                         optimizer=opt, optimizer_kwargs=okw,
                         training_kwargs=dict(num_epochs=a.epochs, batch_size=256,
                                              use_tqdm=False),
                         evaluation_kwargs=dict(use_tqdm=False))
            rows.append({"update": how, "epochs": a.epochs, "mrr": r.get_metric("mrr"),
                         "hits_at_10": r.get_metric("hits@10"),
                         "seconds": time.perf_counter() - t0})
            dsa.close(r.model, r.training_loop.optimizer)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("warm", "ooc", "quality", "ooc-child"))
    ap.add_argument("--rows", type=int, default=None, help="1M (warm), 4M (ooc)")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=None, help="timed steps: 1000 (warm), 300 (ooc)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--memory", default="64MiB", help="ooc: the log stores' budget")
    ap.add_argument("--cap", default="1G", help="ooc: the memory cgroup ('none': uncapped)")
    ap.add_argument("--epochs", type=int, default=100, help="quality")
    ap.add_argument("--dim", type=int, default=64, help="quality: TransE's dimension")
    ap.add_argument("--lr", type=float, default=0.1, help="quality")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true", help="both measures, tiny sizes")
    ap.add_argument("--optimizer", default="adam", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.what == "ooc-child":
        print(json.dumps(ooc_child(a)), flush=True)
        return
    whats = ["warm", "ooc", "quality"] if a.smoke else [a.what]
    if whats == [None]:
        ap.error("say what to measure: warm or ooc (or --smoke)")
    for what in whats:
        if a.smoke:
            a.rows, a.steps, a.warmup = (5000 if what == "warm" else 20_000), 10, 3
            a.memory, a.cap, a.epochs, a.dim = "16MiB", "256M", 1, 8
        if what == "quality":
            rows = quality(a)
            cols = ["update", "epochs", "mrr", "hits_at_10", "seconds"]
        else:
            a.rows = a.rows or (1_000_000 if what == "warm" else 4_000_000)
            a.steps = a.steps or (1000 if what == "warm" else 300)
            rows = warm(a) if what == "warm" else ooc(a)
            cols = (["impl", "rows_per_s", "p50_ms", "x_torch_adagrad"] if what == "warm"
                    else ["optimizer", "cap", "record_bytes", "rows_per_s", "p50_ms",
                          "read_bytes_per_row", "written_bytes_per_row", "x_adam_rows_per_s",
                          "x_adam_bytes"])
        print_table(rows, cols)
        meta = {"machine": machine(), "args": {k: v for k, v in vars(a).items()
                                               if k not in ("workdir", "root", "optimizer")}}
        write_results(f"adagrad_{what}" + ("_smoke" if a.smoke else ""), rows, meta)
        if a.smoke:
            a.rows = a.steps = None


if __name__ == "__main__":
    main()
