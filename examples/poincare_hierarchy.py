"""Poincaré embedding of a hierarchy, with the Riemannian Adam state on disk.

Nickel & Kiela (2017), "Poincaré Embeddings for Learning Hierarchical Representations": the
transitive closure of a tree (a complete tree, ``--branching`` children per node, ``--depth``
levels below the root; 4 and 5 give 1,365 nodes and 6,372 closure edges) is embedded in
the Poincaré ball of curvature -1 (``curvature=1``) so that related nodes are close in the
hyperbolic distance

    d(u, v) = arcosh(1 + 2 |u - v|^2 / ((1 - |u|^2) (1 - |v|^2))).

Loss (N&K eq. 6): for each related pair (u, v), a softmax over the negated distances from u
to v and to ``--neg`` nodes v' drawn uniformly among those not related to u:
``-log exp(-d(u, v)) / sum_{v'' in {v} + negatives} exp(-d(u, v''))``. Related means
ancestor or descendant (the closure as an undirected graph: the distance is symmetric).

The same model is trained twice from the same initial points (uniform in [-1e-3, 1e-3], as
N&K) with the same batches and negatives:

* ``dsa``: an :class:`adapters.torch.DiskEmbedding` with ``curvature=1``: the points and the
  Riemannian Adam state (m, and one second-moment scalar per row) live in a dsa_core store,
  stepped by :class:`adapters.torch.DiskSparseAdam` (geoopt's ``SparseRiemannianAdam``
  semantics: Riemannian gradient, retraction, projection, transported momentum);
* ``geoopt``: a ``geoopt.ManifoldParameter`` on ``Stereographic(k=-1)`` (geoopt's
  ``PoincareBall(c=1)``) in RAM, stepped by ``geoopt.optim.SparseRiemannianAdam``.

Points are float64 by default: in float32 both optimizers project the points to
``|x| <= 0.996`` (geoopt's margin), at most 6.2 from the origin, which crowds the leaves of
a deep tree (``--dtype float32`` to see it).

Both use a burn-in (N&K §3): the first ``--burnin`` epochs at ``lr / 10``.

Metrics (N&K §4.1, reconstruction): for every node u and every node v related to u, the rank
of d(u, v) among the distances from u to all nodes *not* related to u (1 is best), averaged
over all pairs: **mean rank**; and the mean over u of the average precision of ranking all
other nodes by distance from u: **MAP**. The root is related to every node, so it has no
negatives and is left out of both.

Run::

    python -m examples.poincare_hierarchy                    # ~30 s on 2 cores
    python -m examples.poincare_hierarchy --branching 3 --depth 4 --epochs 30
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from ._common import (
    add_config_args,
    config_from_args,
    dir_bytes,
    fmt_bytes,
    state_bytes,
    warm_up_torch,
)

__all__ = ["Config", "Hierarchy", "main", "poincare_distance", "reconstruction", "run",
           "tree_closure"]

OPTIMIZERS = ("dsa", "geoopt")
LABELS = {"dsa": "DiskSparseAdam curvature=1 (disk)",
          "geoopt": "geoopt SparseRiemannianAdam (RAM)"}
DTYPES = ("float32", "float64")


@dataclasses.dataclass
class Config:
    branching: int = 4
    depth: int = 5
    dim: int = 10
    epochs: int = 50
    burnin: int = 5        # epochs at lr / 10 first
    batch: int = 256       # related pairs per step
    neg: int = 50          # negatives per pair
    lr: float = 0.1
    dtype: str = "float64"  # float32 caps the ball at |x| <= 0.996 (distance 6.2 from 0)
    seed: int = 0
    progress: bool = True


@dataclasses.dataclass
class Hierarchy:
    """A tree's transitive closure: ``related`` (n, n) bool, symmetric, False on the diagonal."""

    n: int
    depth: np.ndarray       # (n,) level of each node (root 0)
    closure: np.ndarray     # (m, 2) int64 (descendant, ancestor) pairs
    related: np.ndarray     # (n, n) bool


def tree_closure(branching: int, depth: int) -> Hierarchy:
    """The complete tree in BFS order (children of i: ``b*i + 1 .. b*i + b``) and its closure."""
    if branching < 1 or depth < 1:
        raise ValueError("branching and depth must be >= 1")
    n = sum(branching ** k for k in range(depth + 1))
    parent = (np.arange(n) - 1) // branching
    parent[0] = -1
    level = np.zeros(n, np.int64)
    for i in range(1, n):
        level[i] = level[parent[i]] + 1
    pairs = []
    anc = parent.copy()
    while True:
        ok = anc >= 0
        if not ok.any():
            break
        pairs.append(np.stack([np.flatnonzero(ok), anc[ok]], 1))
        anc = np.where(ok, parent[np.maximum(anc, 0)], -1)
    closure = np.concatenate(pairs).astype(np.int64)
    related = np.zeros((n, n), bool)
    related[closure[:, 0], closure[:, 1]] = True
    related[closure[:, 1], closure[:, 0]] = True
    return Hierarchy(n, level, closure, related)


def poincare_distance(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """d(u, v) = arcosh(1 + 2z) = 2 asinh(sqrt(z)), z = |u-v|^2 / ((1-|u|^2)(1-|v|^2)).

    The asinh form is the same function, without arcosh's cancellation near 1 in float32.
    """
    sq = ((u - v) ** 2).sum(-1)
    den = (1 - (u * u).sum(-1)) * (1 - (v * v).sum(-1))
    z = sq / den.clamp_min(1e-15)
    return 2 * torch.asinh(torch.sqrt(z.clamp_min(1e-15)))


def poincare_distance_np(u: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Distances (float64) from one point ``u`` (dim,) to every row of ``x`` (n, dim)."""
    u, x = u.astype(np.float64), x.astype(np.float64)
    sq = ((x - u) ** 2).sum(1)
    den = (1 - (u * u).sum()) * (1 - (x * x).sum(1))
    return 2 * np.arcsinh(np.sqrt(np.maximum(sq / np.maximum(den, 1e-300), 0.0)))


def reconstruction(emb: np.ndarray, h: Hierarchy) -> dict[str, float]:
    """Mean rank and MAP of the closure's pairs among each node's non-related nodes."""
    ranks, aps = [], []
    for u in range(h.n):
        rel = h.related[u]
        non = ~rel
        non[u] = False
        if not rel.any() or not non.any():
            continue   # the root: related to everyone, nothing to rank against
        d = poincare_distance_np(emb[u], emb)
        dr, dn = np.sort(d[rel]), np.sort(d[non])
        below = np.searchsorted(dn, dr, side="left")          # non-related strictly closer
        ties = np.searchsorted(dn, dr, side="right") - below
        ranks.append(1 + below + ties / 2)
        # average precision: the i-th closest related node (0-based) sits at position
        # i + 1 + (non-related closer than it) in the ranking of all other nodes
        i = np.arange(1, len(dr) + 1)
        aps.append(np.mean(i / (i + below + ties / 2)))
    r = np.concatenate(ranks)
    return {"mean_rank": float(r.mean()), "map": float(np.mean(aps)),
            "pairs": len(r), "nodes": len(aps)}


def _training_pairs(h: Hierarchy) -> np.ndarray:
    """Every related (u, v), both directions, for each u that has negatives (not the root)."""
    pairs = np.concatenate([h.closure, h.closure[:, ::-1]])
    has_neg = (~h.related).sum(1) > 1          # more than u itself
    return pairs[has_neg[pairs[:, 0]]]


def _negatives(h: Hierarchy, u: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """``k`` uniform draws per u among the nodes not related to u (and not u)."""
    out = rng.integers(0, h.n, (len(u), k))
    bad = h.related[u[:, None], out] | (out == u[:, None])
    while bad.any():
        out[bad] = rng.integers(0, h.n, int(bad.sum()))
        bad = h.related[u[:, None], out] | (out == u[:, None])
    return out


class _Model:
    def __init__(self, kind: str, init: np.ndarray, cfg: Config, work: Path):
        self.kind = kind
        if kind == "dsa":
            from adapters.torch import DiskEmbedding, DiskSparseAdam

            self.emb = DiskEmbedding(*init.shape, state_dir=work / "points", curvature=1.0,
                                     init=init, dtype=getattr(torch, cfg.dtype),
                                     overwrite=True)
            self.opt = DiskSparseAdam(self.emb.parameters(), lr=cfg.lr)
        elif kind == "geoopt":
            import geoopt

            # Stereographic(k=-1) is PoincareBall(c=1); built from a tensor of the points'
            # dtype, so that float64 points get a float64 curvature (docs/algorithms.md §3.6)
            ball = geoopt.Stereographic(k=torch.tensor(-1.0, dtype=getattr(torch, cfg.dtype)))
            self.w = geoopt.ManifoldParameter(torch.tensor(init), manifold=ball)
            self.opt = geoopt.optim.SparseRiemannianAdam([self.w], lr=cfg.lr)
        else:
            raise ValueError(f"unknown optimizer {kind!r}; choose one of {OPTIMIZERS}")
        self.work = work

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kind == "dsa":
            return self.emb(ids)
        return torch.nn.functional.embedding(ids, self.w, sparse=True).as_subclass(
            torch.Tensor)

    def points(self) -> np.ndarray:
        if self.kind == "dsa":
            return self.emb.weight_rows(np.arange(self.emb.num_embeddings)).numpy()
        return self.w.detach().numpy().copy()

    def set_lr(self, lr: float) -> None:
        for g in self.opt.param_groups:
            g["lr"] = lr

    def memory(self) -> dict[str, int]:
        disk = dir_bytes(self.work / "points") if self.kind == "dsa" else 0
        return {"state_ram": state_bytes(self.opt), "disk": disk}

    def close(self) -> None:
        if self.kind == "dsa":
            self.opt.close()
            self.emb.close()


def train(kind: str, cfg: Config, h: Hierarchy, init: np.ndarray, work: Path) -> dict:
    model = _Model(kind, init, cfg, work)
    pairs = _training_pairs(h)
    rng = np.random.default_rng(cfg.seed + 1)          # same batches for both optimizers
    losses, step_losses = [], []
    bar = tqdm(range(cfg.epochs), desc=f"{kind:>6}", unit="epoch", disable=not cfg.progress,
               file=sys.stdout, dynamic_ncols=True)
    t0 = time.perf_counter()
    try:
        for epoch in bar:
            model.set_lr(cfg.lr / 10 if epoch < cfg.burnin else cfg.lr)
            perm = rng.permutation(len(pairs))
            total = 0.0
            for lo in range(0, len(pairs), cfg.batch):
                pb = pairs[perm[lo:lo + cfg.batch]]
                negs = _negatives(h, pb[:, 0], cfg.neg, rng)
                b = len(pb)
                rows = model(torch.from_numpy(np.concatenate([pb[:, 0], pb[:, 1],
                                                              negs.reshape(-1)])))
                u, others = rows[:b], rows[b:]
                v = torch.cat([others[:b, None], others[b:].view(b, cfg.neg, -1)], 1)
                d = poincare_distance(u[:, None], v)                      # (b, 1 + neg)
                loss = torch.nn.functional.cross_entropy(-d, torch.zeros(b, dtype=torch.long))
                model.opt.zero_grad()
                loss.backward()
                model.opt.step()
                step_losses.append(float(loss.detach()))
                total += step_losses[-1] * b
            losses.append(total / len(pairs))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        seconds = time.perf_counter() - t0
        pts = model.points()
        mem = model.memory()
    finally:
        bar.close()
        model.close()
    radius = 2 * np.arctanh(np.minimum(np.linalg.norm(pts.astype(np.float64), axis=1),
                                       1 - 1e-16))     # hyperbolic distance from the origin
    return {"optimizer": kind, "metrics": reconstruction(pts, h), "losses": losses,
            "step_losses": step_losses, "seconds": seconds, "memory": mem,
            "radius_by_depth": [float(radius[h.depth == k].mean())
                              for k in range(int(h.depth.max()) + 1)],
            "points": pts}


def run(cfg: Config, optimizers=OPTIMIZERS, work: Path | None = None) -> dict:
    h = tree_closure(cfg.branching, cfg.depth)
    init = np.random.default_rng(cfg.seed).uniform(-1e-3, 1e-3, (h.n, cfg.dim)).astype(
        cfg.dtype)
    warm_up_torch(curvatures=(1.0,))
    with tempfile.TemporaryDirectory(prefix="dsa-poincare-") as tmp:
        base = Path(tmp) if work is None else Path(work)
        results = [train(k, cfg, h, init, base / k) for k in optimizers]
    return {"hierarchy": h, "init": reconstruction(init, h), "results": results}


def report(cfg: Config, out: dict) -> str:
    h = out["hierarchy"]
    lines = [(f"\nPoincaré embedding (curvature 1, dim {cfg.dim}) of the transitive closure of a "
             f"complete tree, branching {cfg.branching}, depth {cfg.depth}: {h.n:,} nodes, "
             f"{len(h.closure):,} closure edges; {cfg.dtype}, {cfg.epochs} epochs "
             f"({cfg.burnin} burn-in at lr/10), batch {cfg.batch}, {cfg.neg} negatives, "
             f"lr {cfg.lr}, seed {cfg.seed}"),
             f"{'':36} {'mean rank':>9} {'MAP':>7} {'time':>7}   mean d(0, x) by depth"]
    for r in out["results"]:
        m = r["metrics"]
        nd = " ".join(f"{x:.1f}" for x in r["radius_by_depth"])
        lines.append(f"{LABELS[r['optimizer']]:36} {m['mean_rank']:9.3f} {m['map']:7.4f} "
                     f"{r['seconds']:6.1f}s   {nd}")
    m = out["init"]
    lines.append(f"{'initial points (random)':36} {m['mean_rank']:9.3f} {m['map']:7.4f}")
    res = out["results"]
    if len(res) == 2:
        a, b = res[0]["points"], res[1]["points"]
        lines.append(f"DiskSparseAdam vs geoopt: |MAP difference| "
                     f"{abs(res[0]['metrics']['map'] - res[1]['metrics']['map']):.2e}, "
                     f"max |point difference| {np.abs(a - b).max():.2e}")
    for r in res:
        mem = r["memory"]
        lines.append(f"memory, {LABELS[r['optimizer']]}: Riemannian Adam state in RAM "
                     f"{fmt_bytes(mem['state_ram'])}, store on disk {fmt_bytes(mem['disk'])}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m examples.poincare_hierarchy",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, Config, skip=("dtype",))
    p.add_argument("--dtype", default=Config.dtype, choices=DTYPES)
    p.add_argument("--only", choices=OPTIMIZERS)
    a = p.parse_args(argv)
    cfg = config_from_args(Config, a)
    torch.set_num_threads(1)
    out = run(cfg, (a.only,) if a.only else OPTIMIZERS)
    print(report(cfg, out))
    return out


if __name__ == "__main__":
    main()
