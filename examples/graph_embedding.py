"""Node embeddings of a 1M-node power-law graph, with the table and Adam state on disk.

DeepWalk-style training (Perozzi et al. 2014; skip-gram with negative sampling, Mikolov et
al. 2013) of one :class:`adapters.torch.DiskEmbedding` table, stepped by
:class:`adapters.torch.DiskSparseAdam`:

* **graph**: a synthetic degree-corrected planted-partition graph: node weights drawn from
  a power law (degree exponent ``--gamma``), communities of about 1,000 nodes, a fraction
  ``--mix`` of the edges between communities; generated with vectorised numpy. A random
  ``--holdout`` of its edges is removed before training, for link prediction.
* **walks**: short uniform random walks (``--walk-length``), generated batch by batch by a
  Numba kernel from the CSR adjacency; skip-gram pairs within ``--window``. Negatives are
  a pool of ``--pool`` uniformly drawn nodes shared by the whole step, and each pair's
  negative term is ``--neg`` times its mean over the pool. (With lazy Adam, a row touched
  once as a negative moves by about ``lr`` whatever its gradient's size, so drawing ``neg``
  negatives per pair mostly adds noise; a shared pool touches few rows, each with the
  summed gradient of the step: measured AUC 0.72 -> 0.88 at 20k nodes.) Nothing of size
  ``num_nodes x dim`` is ever allocated: the rows of a batch are read from the store, and
  the step writes them back.
* **memory**: the process's anonymous memory (``RssAnon``) is sampled after every step;
  its growth over training stays O(batch) while the table (weights, m and v: ``3 x nodes x
  dim x 4`` bytes) lives in the store. The pages of the mapped store that the kernel keeps
  in RAM are page cache (``RssFile``), which the kernel can drop at any time.
* **link prediction**: AUC of the dot-product score of the held-out edges against as many
  random non-edges, next to the AUC of the degree-only preferential-attachment score.

A small graph trains for few steps, while Adam's bias correction still shrinks the steps
(by sqrt(1 - 0.999^t)), so it wants a larger ``--lr``: 0.05 at 20k nodes (AUC 0.87, vs 0.82
with 0.02).

Run::

    python -m examples.graph_embedding                          # 1M nodes, 4.5M edges, ~2.5 min
    python -m examples.graph_embedding --nodes 20000 --lr 0.05  # a few seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np
import torch
from tqdm.auto import tqdm

from ._common import (
    RssPeak,
    add_config_args,
    config_from_args,
    dir_bytes,
    fmt_bytes,
    warm_up_torch,
)

__all__ = ["Config", "auc", "main", "power_law_graph", "random_walks", "run"]


@dataclasses.dataclass
class Config:
    nodes: int = 1_000_000
    avg_degree: float = 10.0
    community_size: int = 1000
    mix: float = 0.1            # fraction of edges between communities
    gamma: float = 2.5          # power-law exponent of the degree distribution
    holdout: int = 10_000       # edges removed for link prediction
    dim: int = 32
    walk_length: int = 8
    window: int = 2
    epochs: int = 2             # walks per node
    batch_walks: int = 256      # walks per step (x ~13 skip-gram pairs)
    pool: int = 512             # shared negatives per step
    neg: float = 5.0            # weight of the negative term (negatives per positive)
    lr: float = 0.02            # measured at 200k nodes: 0.01 0.874, 0.02 0.903, 0.05 0.870 AUC
    init_scale: float = 0.1
    seed: int = 0
    progress: bool = True


# --- graph -----------------------------------------------------------------------------------
def _sample(cum: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Indices i with cum[i-1] <= u < cum[i] (inverse-CDF sampling, vectorised)."""
    return np.minimum(np.searchsorted(cum, u, side="right"), len(cum) - 1)


def power_law_graph(cfg: Config, rng: np.random.Generator) -> np.ndarray:
    """Undirected edges ``(m, 2)`` int32, ``u < v``, no duplicates or self loops.

    Degree-corrected planted partition (Karrer & Newman 2011): node ``i`` has weight
    ``w_i ~ Pareto(gamma - 1)`` (so degrees follow a power law with exponent ``gamma``) and a
    random community. Each edge picks ``u`` with probability proportional to ``w``, then
    ``v`` proportional to ``w`` inside ``u``'s community (probability ``1 - mix``) or in the
    whole graph (``mix``).
    """
    n = cfg.nodes
    w = rng.pareto(cfg.gamma - 1.0, n) + 1.0
    w = np.minimum(w, np.sqrt(n * cfg.avg_degree))          # no node above ~sqrt(2m)
    comm = rng.integers(0, max(1, n // cfg.community_size), n)
    m = int(n * cfg.avg_degree / 2)
    cum = np.cumsum(w)
    u = _sample(cum, rng.random(m) * cum[-1])
    v = _sample(cum, rng.random(m) * cum[-1])
    inside = rng.random(m) >= cfg.mix
    order = np.argsort(comm, kind="stable")                  # nodes grouped by community
    ccum = np.cumsum(w[order])
    bounds = np.searchsorted(comm[order], np.arange(comm.max() + 2))
    lo = np.where(bounds[:-1] > 0, ccum[np.maximum(bounds[:-1] - 1, 0)], 0.0)
    hi = ccum[bounds[1:] - 1]
    cu = comm[u[inside]]
    pick = lo[cu] + rng.random(len(cu)) * (hi[cu] - lo[cu])
    v[inside] = order[_sample(ccum, pick)]
    a, b = np.minimum(u, v), np.maximum(u, v)
    keep = a != b
    key = np.unique(a[keep].astype(np.int64) * n + b[keep])
    return np.stack([key // n, key % n], 1).astype(np.int32)


def csr(n: int, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric CSR adjacency ``(indptr int64 (n+1,), indices int32 (2m,))``."""
    src = np.concatenate([edges[:, 0], edges[:, 1]])
    dst = np.concatenate([edges[:, 1], edges[:, 0]])
    order = np.argsort(src, kind="stable")
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n), out=indptr[1:])
    return indptr, dst[order].astype(np.int32)


@numba.njit(cache=True, nogil=True)
def random_walks(indptr, indices, starts, length, seed):
    """Uniform random walks ``(len(starts), length)`` int32; -1 after a dead end."""
    np.random.seed(seed)
    out = np.full((starts.shape[0], length), -1, np.int32)
    for i in range(starts.shape[0]):
        cur = starts[i]
        out[i, 0] = cur
        for j in range(1, length):
            lo = indptr[cur]
            deg = indptr[cur + 1] - lo
            if deg == 0:
                break
            cur = indices[lo + np.random.randint(deg)]
            out[i, j] = cur
    return out


def skipgram_pairs(walks: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(center, context) pairs at distance 1..window along each walk, both int64."""
    us, vs = [], []
    for o in range(1, window + 1):
        a, b = walks[:, :-o].reshape(-1), walks[:, o:].reshape(-1)
        ok = (a >= 0) & (b >= 0)
        us.append(a[ok])
        vs.append(b[ok])
    return np.concatenate(us).astype(np.int64), np.concatenate(vs).astype(np.int64)


def auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties half."""
    s = np.concatenate([pos, neg])
    order = np.argsort(s, kind="stable")
    ranks = np.empty(len(s))
    ranks[order] = np.arange(1, len(s) + 1)
    _, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
    if counts.max() > 1:   # average the ranks of tied scores
        sums = np.bincount(inv, weights=ranks)
        ranks = (sums / counts)[inv]
    return float((ranks[:len(pos)].sum() - len(pos) * (len(pos) + 1) / 2)
                 / (len(pos) * len(neg)))


def non_edges(n: int, count: int, edges: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``count`` uniformly random node pairs ``u < v`` that are not edges of the graph."""
    known = np.sort(edges[:, 0].astype(np.int64) * n + edges[:, 1])
    out = np.empty((0, 2), np.int64)
    while len(out) < count:
        p = rng.integers(0, n, (2 * count, 2))
        p = np.sort(p, 1)
        key = p[:, 0] * n + p[:, 1]
        pos = np.minimum(np.searchsorted(known, key), len(known) - 1)
        p = p[(p[:, 0] != p[:, 1]) & (known[pos] != key)]
        out = np.concatenate([out, p])
    return out[:count]


# --- training --------------------------------------------------------------------------------
def run(cfg: Config, work: Path) -> dict:
    """Build the graph, train, evaluate; returns metrics, memory and timings."""
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    rng = np.random.default_rng(cfg.seed)
    t0 = time.perf_counter()
    edges = power_law_graph(cfg, rng)
    test_idx = rng.choice(len(edges), size=min(cfg.holdout, len(edges) // 10), replace=False)
    mask = np.ones(len(edges), bool)
    mask[test_idx] = False
    test_pos, train_edges = edges[test_idx].astype(np.int64), edges[mask]
    test_neg = non_edges(cfg.nodes, len(test_pos), edges, rng)
    indptr, indices = csr(cfg.nodes, train_edges)
    deg = np.diff(indptr)
    t_graph = time.perf_counter() - t0

    warm_up_torch()
    random_walks(indptr, indices, np.zeros(1, np.int32), 2, 0)   # compile (or load) first
    t0 = time.perf_counter()
    emb = DiskEmbedding(cfg.nodes, cfg.dim, state_dir=work / "nodes", init="normal",
                        init_scale=cfg.init_scale, seed=cfg.seed, overwrite=True)
    t_create = time.perf_counter() - t0
    opt = DiskSparseAdam(emb.parameters(), lr=cfg.lr)
    meter = RssPeak()
    steps_per_epoch = -(-cfg.nodes // cfg.batch_walks)
    losses, rows_per_step, pairs, max_pairs = [], [], 0, 0
    bar = tqdm(total=cfg.epochs * steps_per_epoch, desc="skip-gram", unit="step",
               disable=not cfg.progress, file=sys.stdout, dynamic_ncols=True, mininterval=0.5)
    t0 = time.perf_counter()
    try:
        for epoch in range(cfg.epochs):
            order = rng.permutation(cfg.nodes).astype(np.int32)
            for s in range(steps_per_epoch):
                starts = order[s * cfg.batch_walks:(s + 1) * cfg.batch_walks]
                walks = random_walks(indptr, indices, starts, cfg.walk_length,
                                     cfg.seed * 1_000_003 + epoch * steps_per_epoch + s)
                u, v = skipgram_pairs(walks, cfg.window)
                p = len(u)
                pool = rng.integers(0, cfg.nodes, cfg.pool)
                rows = emb(torch.from_numpy(np.concatenate([u, v, pool])))
                eu, ev, en = rows[:p], rows[p:2 * p], rows[2 * p:]
                pos = (eu * ev).sum(-1)
                loss = (torch.nn.functional.softplus(-pos).mean()
                        + cfg.neg * torch.nn.functional.softplus(eu @ en.T).mean())
                opt.zero_grad()
                loss.backward()
                rows_per_step.append(emb.weight.grad._nnz())
                max_pairs = max(max_pairs, p)
                opt.step()
                losses.append(float(loss.detach()))
                pairs += p
                meter.sample()
                bar.update()
                if s % 50 == 0:
                    bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
        t_train = time.perf_counter() - t0
        bar.close()
        with torch.no_grad():
            def score(pr):
                return (emb.weight_rows(pr[:, 0]) * emb.weight_rows(pr[:, 1])).sum(1).numpy()

            auc_emb = auc(score(test_pos), score(test_neg))
        meter.sample()
        import dsa_core

        cached = dsa_core.residency(emb.store, np.arange(cfg.nodes))
        store_bytes = dir_bytes(work / "nodes")
    finally:
        bar.close()
        opt.close()
        emb.close()
    deg_all = np.bincount(edges.reshape(-1), minlength=cfg.nodes).astype(np.float64)
    auc_pa = auc(deg[test_pos[:, 0]] * deg[test_pos[:, 1]] + 0.0,
                 deg[test_neg[:, 0]] * deg[test_neg[:, 1]] + 0.0)
    k = max(1, len(losses) // 20)
    return {"cfg": cfg, "edges": len(edges), "train_edges": len(train_edges),
            "max_degree": int(deg_all.max()), "mean_degree": float(deg_all.mean()),
            "auc": auc_emb, "auc_degree": auc_pa, "loss_first": float(np.mean(losses[:k])),
            "loss_last": float(np.mean(losses[-k:])), "steps": len(losses), "pairs": pairs,
            "rows_per_step": float(np.mean(rows_per_step)),
            "max_rows_per_step": int(np.max(rows_per_step)), "max_pairs": max_pairs,
            "rss_anon_base": meter.base, "rss_anon_growth": meter.growth,
            "cached": cached, "store_bytes": store_bytes, "holdout": len(test_pos),
            "table_bytes": 3 * cfg.nodes * cfg.dim * 4,
            "seconds": {"graph": t_graph, "create": t_create, "train": t_train}}


def report(r: dict) -> str:
    c = r["cfg"]
    sec = r["seconds"]
    batch_bytes = r["max_rows_per_step"] * c.dim * 4
    return "\n".join([
        (f"\ngraph: {c.nodes:,} nodes, {r['edges']:,} edges (mean degree {r['mean_degree']:.1f}, "
        f"max {r['max_degree']:,}; power law gamma {c.gamma}, communities of ~"
        f"{c.community_size}, {c.mix:.0%} of edges between them), built in {sec['graph']:.1f}s; "
        f"{r['holdout']:,} edges held out"),
        (f"training: DiskEmbedding({c.nodes:,}, {c.dim}) + DiskSparseAdam(lr={c.lr}), "
        f"{r['steps']:,} steps, {r['pairs']:,} skip-gram pairs (walks of {c.walk_length}, "
        f"window {c.window}, {c.pool} shared negatives), {r['rows_per_step']:,.0f} "
        f"distinct rows per step on average, {sec['train']:.1f}s "
        f"({r['pairs'] / sec['train']:,.0f} pairs/s); store created in {sec['create']:.1f}s"),
        f"loss: {r['loss_first']:.4f} (first 5% of steps) -> {r['loss_last']:.4f} (last 5%)",
        (f"link prediction AUC (held-out edges vs random non-edges): {r['auc']:.4f} "
        f"(dot product of the embeddings); degree-only preferential attachment: "
        f"{r['auc_degree']:.4f}; random: 0.5"),
        "memory:",
        (f"  table + Adam state on disk (weights, m, v):  {fmt_bytes(r['store_bytes'])} "
        f"(torch.optim.SparseAdam in RAM would hold {fmt_bytes(r['table_bytes'])} of "
        "weights, m and v)"),
        (f"  RssAnon before training:                    {fmt_bytes(r['rss_anon_base'])} "
        "(interpreter, torch, the graph's CSR arrays)"),
        (f"  RssAnon growth during training (peak):      {fmt_bytes(r['rss_anon_growth'])} "
        f"(O(batch): at most {r['max_rows_per_step']:,} distinct rows per step, "
        f"{fmt_bytes(batch_bytes)} a copy; the pairs x pool score matrix, "
        f"{fmt_bytes(r['max_pairs'] * c.pool * 4)} a copy, dominates)"),
        (f"  page cache holding the store at the end:    {r['cached']:.0%} of its pages "
        "(file-backed, reclaimable: not anonymous memory)"),
    ])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m examples.graph_embedding",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, Config)
    p.add_argument("--dir", default=None,
                   help="where the store goes (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    cfg = config_from_args(Config, a)
    torch.set_num_threads(1)  # measured: 2 torch threads next to numba's are 3x slower on 2 cores
    if a.dir is not None:
        r = run(cfg, Path(a.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="dsa-graph-") as tmp:
            r = run(cfg, Path(tmp))
    print(report(r))
    return r


if __name__ == "__main__":
    main()
