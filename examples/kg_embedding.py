"""Knowledge-graph embedding with DiskSparseAdam vs torch.optim.SparseAdam.

A ComplEx model (Trouillon et al. 2016; DistMult with ``--model distmult``) with reciprocal
relations is trained on a small benchmark graph that ships inside PyKEEN's wheel (UMLS by
default; see :mod:`examples._kg`), twice from the same initial weights and with the same
batches and negative samples:

* ``dsa``: the entity and relation tables are :class:`adapters.torch.DiskEmbedding` modules,
  so their weights **and** the Adam moments live in dsa_core stores on disk, stepped by
  :class:`adapters.torch.DiskSparseAdam` (``--table ram`` keeps the weights in an
  ``nn.Embedding`` and only the moments on disk);
* ``sparse_adam``: ``nn.Embedding(sparse=True)`` tables in RAM and ``torch.optim.SparseAdam``.

Each query ``(h, r, ?)`` is scored against its true tail and ``--neg`` entities drawn
uniformly at random (1-vs-K softmax cross-entropy), plus an N3 penalty on the batch's rows
(Lacroix et al. 2018), so every step touches only the rows of its batch. DiskSparseAdam is
numerically ``torch.optim.SparseAdam`` (same update, same operation order), so both runs
reach the same filtered MRR up to float rounding.

Run::

    python -m examples.kg_embedding                      # UMLS, both optimizers, ~35 s
    python -m examples.kg_embedding --dataset kinships --epochs 60
    python -m examples.kg_embedding --only dsa --table ram

Prints the filtered test MRR / Hits@k of both runs next to the exactly computed expectation
of random scoring, the memory each used (optimizer state in RAM vs on disk, RssAnon growth),
and writes both loss curves to ``<out>/loss.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from . import _kg
from ._common import RssPeak, dir_bytes, fmt_bytes, state_bytes, warm_up_torch

__all__ = ["Config", "main", "run", "train"]

OPTIMIZERS = ("dsa", "sparse_adam")
LABELS = {"dsa": "DiskSparseAdam (state on disk)", "sparse_adam": "torch.optim.SparseAdam (RAM)"}


@dataclasses.dataclass
class Config:
    """Hyperparameters of one training run (the same for both optimizers)."""

    dataset: str = "umls"
    model: str = "complex"     # "complex" or "distmult"
    dim: int = 128             # real coordinates per row (ComplEx: dim/2 complex numbers)
    epochs: int = 40
    batch: int = 256           # queries per step (each triple gives two: tail and head)
    neg: int = 32              # negatives per query, uniform over entities
    lr: float = 0.02
    reg: float = 3e-3          # N3 weight on the batch's rows
    init_scale: float = 0.1    # N(0, init_scale^2) initial weights
    seed: int = 0
    table: str = "disk"        # dsa: "disk" (DiskEmbedding) or "ram" (nn.Embedding)
    progress: bool = True


# --- the model: plain functions of embedding rows --------------------------------------------
def query_vectors(model: str, h: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``q`` such that score(h, r, t) = <q, t>: DistMult h*r, ComplEx Re(h*r) | Im(h*r)."""
    if model == "distmult":
        return h * r
    hr, hi = h.chunk(2, -1)
    rr, ri = r.chunk(2, -1)
    return torch.cat([hr * rr - hi * ri, hr * ri + hi * rr], -1)


def n3(*xs: torch.Tensor, model: str) -> torch.Tensor:
    """Nuclear 3-norm penalty (Lacroix et al. 2018): mean over the batch of sum |x|^3."""
    out = 0.0
    for x in xs:
        if model == "complex":
            a, b = x.chunk(2, -1)
            out = out + ((a * a + b * b) ** 1.5).sum(-1).mean()
        else:
            out = out + (x.abs() ** 3).sum(-1).mean()
    return out


class _Tables:
    """Entity and relation tables of one run, with their optimizer."""

    def __init__(self, kind: str, cfg: Config, init_e: np.ndarray, init_r: np.ndarray,
                 work: Path):
        from adapters.torch import DiskEmbedding, DiskSparseAdam

        self.kind = kind
        self.dirs: list[Path] = []
        if kind == "dsa" and cfg.table == "disk":
            self.dirs = [work / "entities", work / "relations"]
            self.ent = DiskEmbedding(*init_e.shape, state_dir=self.dirs[0], init=init_e,
                                     overwrite=True)
            self.rel = DiskEmbedding(*init_r.shape, state_dir=self.dirs[1], init=init_r,
                                     overwrite=True)
        else:
            self.ent = torch.nn.Embedding.from_pretrained(torch.tensor(init_e), freeze=False,
                                                          sparse=True)
            self.rel = torch.nn.Embedding.from_pretrained(torch.tensor(init_r), freeze=False,
                                                          sparse=True)
        params = [*self.ent.parameters(), *self.rel.parameters()]
        if kind == "sparse_adam":
            self.opt = torch.optim.SparseAdam(params, lr=cfg.lr)
        elif kind == "dsa":
            sd = None
            if cfg.table == "ram":
                sd = work / "opt"
                shutil.rmtree(sd, ignore_errors=True)
                self.dirs = [sd]
            self.opt = DiskSparseAdam(params, lr=cfg.lr, state_dir=sd)
        else:
            raise ValueError(f"unknown optimizer {kind!r}; choose one of {OPTIMIZERS}")

    def full(self, which: str) -> torch.Tensor:
        emb = self.ent if which == "ent" else self.rel
        if hasattr(emb, "store"):   # DiskEmbedding: read every row (the tables are small)
            return emb.weight_rows(np.arange(emb.num_embeddings))
        return emb.weight.detach()

    def memory(self) -> dict[str, int]:
        """Bytes of weights and Adam moments in RAM (anonymous) and on disk."""
        on_disk = sum(dir_bytes(d) for d in self.dirs)
        state = state_bytes(self.opt)
        weights = 0 if hasattr(self.ent, "store") else sum(
            e.weight.nbytes for e in (self.ent, self.rel))
        return {"state_ram": state, "weights_ram": weights, "disk": on_disk}

    def close(self) -> None:
        if self.kind == "dsa":
            self.opt.close()
        for e in (self.ent, self.rel):
            if hasattr(e, "close"):
                e.close()


def _initial_weights(cfg: Config, kg: _kg.KG) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(cfg.seed)
    init_e = rng.standard_normal((kg.num_entities, cfg.dim), dtype=np.float32)
    init_r = rng.standard_normal((2 * kg.num_relations, cfg.dim), dtype=np.float32)
    return init_e * np.float32(cfg.init_scale), init_r * np.float32(cfg.init_scale)


def train(kind: str, cfg: Config, kg: _kg.KG, work: Path) -> dict:
    """Train one model with optimizer ``kind``; returns metrics, loss curve and memory."""
    if cfg.model not in ("complex", "distmult") or (cfg.model == "complex" and cfg.dim % 2):
        raise ValueError("model must be 'distmult' or 'complex' (with an even dim)")
    init_e, init_r = _initial_weights(cfg, kg)
    meter = RssPeak()
    tables = _Tables(kind, cfg, init_e, init_r, work)
    queries = _kg.reciprocal(kg.train, kg.num_relations)
    rng = np.random.default_rng(cfg.seed + 1)   # batches and negatives: same for both runs
    steps = -(-len(queries) // cfg.batch)
    losses, step_losses = [], []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.epochs), desc=f"{kind:>11}", unit="epoch", disable=not cfg.progress,
               file=sys.stdout, dynamic_ncols=True, leave=True)
    try:
        for _ in bar:
            total = 0.0
            for qb, negs in _kg.batches(queries, kg.num_entities, cfg.batch, cfg.neg, rng):
                qb, negs = torch.from_numpy(qb), torch.from_numpy(negs)
                b = len(qb)
                cand = torch.cat([qb[:, 2:], negs], 1)                  # true answer first
                rows = tables.ent(torch.cat([qb[:, 0], cand.reshape(-1)]))
                h, c = rows[:b], rows[b:].view(b, cfg.neg + 1, -1)
                r = tables.rel(qb[:, 1])
                logits = torch.einsum("bd,bkd->bk", query_vectors(cfg.model, h, r), c)
                hit = torch.cat([torch.zeros(b, 1, dtype=torch.bool), negs == qb[:, 2:]], 1)
                logits = logits.masked_fill(hit, float("-inf"))       # a drawn true answer
                loss = torch.nn.functional.cross_entropy(logits,
                                                         torch.zeros(b, dtype=torch.long))
                if cfg.reg:
                    loss = loss + cfg.reg * n3(h, r, c[:, 0], model=cfg.model)
                tables.opt.zero_grad()
                loss.backward()
                tables.opt.step()
                step_losses.append(float(loss.detach()))
                total += step_losses[-1] * b
            losses.append(total / len(queries))
            meter.sample()
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        seconds = time.perf_counter() - t0
        ent, rel = tables.full("ent"), tables.full("rel")

        @torch.no_grad()
        def score(e, r):
            q = query_vectors(cfg.model, ent[torch.from_numpy(e)], rel[torch.from_numpy(r)])
            return (q @ ent.T).numpy()

        metrics = _kg.evaluate(score, kg, "test")
        meter.sample()
        mem = tables.memory()
    finally:
        bar.close()
        tables.close()
    return {"optimizer": kind, "metrics": metrics, "losses": losses,
            "step_losses": step_losses, "seconds": seconds,
            "steps": steps * cfg.epochs, "memory": mem, "rss_anon_growth": meter.growth}


def plot(results: list[dict], path: Path, title: str) -> Path:
    """Both loss curves in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    styles = {"dsa": {"color": "C0", "lw": 2.5, "alpha": 0.6},
              "sparse_adam": {"color": "C1", "lw": 1.0, "ls": "--"}}
    for r in results:
        st = styles[r["optimizer"]]
        y = np.asarray(r["step_losses"])
        ax.plot(np.arange(1, len(y) + 1) * (len(r["losses"]) / len(y)), y, lw=0.5,
                alpha=0.25, color=st["color"])
        ax.plot(np.arange(len(r["losses"])) + 0.5, r["losses"], marker="o", ms=3,
                label=f"{LABELS[r['optimizer']]}: test MRR {r['metrics']['mrr']:.3f}", **st)
    ax.set_xlabel("epoch (faint: every step; markers: epoch means)")
    ax.set_ylabel("training loss (softmax CE + N3)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def run(cfg: Config, optimizers=OPTIMIZERS, out: Path | None = None,
        work: Path | None = None, noise_seeds: int = 0) -> dict:
    """Train with each optimizer; returns ``{"results": [...], "random": {...}, "png": path}``.

    ``noise_seeds``: also train ``torch.optim.SparseAdam`` from that many other seeds (other
    initial weights and batches), to show how much the MRR moves from seed to seed.
    """
    kg = _kg.load(cfg.dataset)
    warm_up_torch()
    tmp = None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="dsa-kg-")
        work = Path(tmp.name)
    try:
        # one untimed epoch first: the allocator's heap grows to the batch's temporaries
        # once per process; without this the first measured run would be charged for it
        train("sparse_adam", dataclasses.replace(cfg, epochs=1, progress=False), kg,
              Path(work) / "warmup")
        results = [train(kind, cfg, kg, Path(work) / kind) for kind in optimizers]
        noise = [train("sparse_adam", dataclasses.replace(cfg, seed=cfg.seed + 1000 * (i + 1)),
                       kg, Path(work) / f"noise{i}")["metrics"]["mrr"]
                 for i in range(noise_seeds)]
    finally:
        if tmp is not None:
            tmp.cleanup()
    png = None
    if out is not None:
        png = plot(results, Path(out) / "loss.png",
                   f"{cfg.model} on {cfg.dataset.upper()} ({kg.num_entities} entities, "
                   f"{len(kg.train)} train triples), dim {cfg.dim}")
    return {"kg": kg, "results": results, "random": _kg.random_baseline(kg, "test"),
            "png": png, "noise": noise}


def report(cfg: Config, out: dict) -> str:
    """The printed summary: metrics side by side, then memory."""
    kg, res, rnd = out["kg"], out["results"], out["random"]
    lines = [(f"\n{cfg.model} on {kg.name} ({kg.num_entities} entities, "
             f"{kg.num_relations} relations, {len(kg.train)}/{len(kg.valid)}/{len(kg.test)} "
             f"train/valid/test), dim {cfg.dim}, {cfg.epochs} epochs, batch {cfg.batch}, "
             f"{cfg.neg} negatives, lr {cfg.lr}, seed {cfg.seed}"),
             f"{'':34} {'MRR':>7} {'Hits@1':>7} {'Hits@3':>7} {'Hits@10':>8} {'time':>7}"]
    for r in res:
        m = r["metrics"]
        lines.append(f"{LABELS[r['optimizer']]:34} {m['mrr']:7.4f} {m['hits@1']:7.4f} "
                     f"{m['hits@3']:7.4f} {m['hits@10']:8.4f} {r['seconds']:6.1f}s")
    lines.append(f"{'random scores (expected, exact)':34} {rnd['mrr']:7.4f} {'':7} {'':7} "
                 f"{rnd['hits@10']:8.4f}")
    if len(res) == 2:
        d = abs(res[0]["metrics"]["mrr"] - res[1]["metrics"]["mrr"])
        lines.append(f"|MRR difference| DiskSparseAdam vs SparseAdam: {d:.2e} (same optimizer, "
                     "same initial weights and batches: float rounding only)")
    if out.get("noise"):
        mrrs = [r["metrics"]["mrr"] for r in res if r["optimizer"] == "sparse_adam"]
        mrrs += out["noise"]
        lines.append(f"seed-to-seed noise: SparseAdam MRR over {len(mrrs)} seeds "
                     f"{' '.join(f'{m:.4f}' for m in mrrs)}: std {np.std(mrrs, ddof=1):.4f}, "
                     f"range {max(mrrs) - min(mrrs):.4f}")
    lines.append("(filtered ranks, head and tail prediction, ties counted half)")
    lines.append("\nmemory (RssAnon = the process's anonymous memory; at this table size its "
                 "growth over a run is the batch's temporaries and allocator noise)")
    lines.append(f"{'':34} {'Adam state in RAM':>18} {'weights in RAM':>15} "
                 f"{'store on disk':>14} {'RssAnon growth':>15}")
    for r in res:
        m = r["memory"]
        lines.append(f"{LABELS[r['optimizer']]:34} {fmt_bytes(m['state_ram']):>18} "
                     f"{fmt_bytes(m['weights_ram']):>15} {fmt_bytes(m['disk']):>14} "
                     f"{fmt_bytes(r['rss_anon_growth']):>15}")
    sa = [r for r in res if r["optimizer"] == "sparse_adam"]
    if sa:
        per_row = sa[0]["memory"]["state_ram"] / (kg.num_entities + 2 * kg.num_relations)
        lines.append(f"SparseAdam's state is 2 x rows x dim x 4 bytes in RAM ({per_row:.0f} B a "
                     f"row here): {fmt_bytes(per_row * 10_000_000)} for a 10M-row table of "
                     "this width. DiskSparseAdam's is in the store, whatever the table size.")
    if out["png"] is not None:
        lines.append(f"\nloss curves: {out['png']}")
    return "\n".join(lines)


def common_parser(prog: str, description: str, d: Config) -> argparse.ArgumentParser:
    """The hyperparameter flags shared by the torch and JAX KG examples."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--dataset", default=d.dataset, choices=_kg.DATASETS)
    p.add_argument("--model", default=d.model, choices=("complex", "distmult"))
    for name in ("dim", "epochs", "batch", "neg", "seed"):
        p.add_argument(f"--{name}", type=int, default=getattr(d, name))
    for name in ("lr", "reg", "init_scale"):
        p.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    p.add_argument("--no-progress", action="store_true")
    return p


def config_from(a: argparse.Namespace, d: Config) -> Config:
    return Config(dataset=a.dataset, model=a.model, dim=a.dim, epochs=a.epochs, batch=a.batch,
                  neg=a.neg, lr=a.lr, reg=a.reg, init_scale=a.init_scale, seed=a.seed,
                  table=getattr(a, "table", d.table), progress=not a.no_progress)


def parse_args(argv=None, defaults: Config | None = None) -> tuple[Config, argparse.Namespace]:
    d = defaults or Config()
    p = common_parser("python -m examples.kg_embedding", __doc__.split("\n\n")[0], d)
    p.add_argument("--table", default=d.table, choices=("disk", "ram"),
                   help="dsa run: weights in a DiskEmbedding (disk) or an nn.Embedding (ram)")
    p.add_argument("--only", choices=OPTIMIZERS, help="train with one optimizer only")
    p.add_argument("--noise-seeds", type=int, default=0, metavar="N",
                   help="also train SparseAdam from N other seeds (seed-to-seed MRR spread)")
    p.add_argument("--out", default="runs/kg", help="directory of loss.png")
    a = p.parse_args(argv)
    return config_from(a, d), a


def main(argv=None, defaults: Config | None = None) -> dict:
    cfg, a = parse_args(argv, defaults)
    torch.set_num_threads(1)  # measured on 2 busy cores: 2 torch threads were up to 5x slower
    opts = (a.only,) if a.only else OPTIMIZERS
    out = run(cfg, opts, out=Path(a.out), noise_seeds=a.noise_seeds)
    print(report(cfg, out))
    return out


if __name__ == "__main__":
    main()
