"""Node embeddings trained partition by partition (bucket order) or in random order.

First-order LINE-style embeddings (Tang et al. 2015; skip-gram with negative sampling over
the edges, Mikolov et al. 2013) of one :class:`adapters.torch.DiskEmbedding` table, stepped
by :class:`adapters.torch.DiskSparseAdam`, on the power-law graph of
:mod:`examples.graph_embedding` (degree-corrected planted partition; a random ``--holdout``
of its edges is removed for link prediction). Every undirected edge is trained in both
directions; for a directed edge ``(u, v)`` with negatives ``n_1 .. n_k`` the loss is
``softplus(-<e_u, e_v>) + sum_i softplus(<e_u, e_{n_i}>)`` (the logistic loss of the true
neighbour against ``k`` sampled nodes), averaged over the batch.

Two orders of the same edges, with the same batch size, negatives per edge, epochs and lr;
the training step consumes their batches unchanged (it only reads ``batch.edges`` and
``batch.negatives``):

* ``--order random``: the edges shuffled every epoch, negatives uniform over all nodes.
  Every step touches rows spread over the whole table: on a table larger than RAM each row
  is a random read.
* ``--order bucket``: :func:`dsa_core.buckets.plan` splits the nodes into ``--partitions``
  contiguous ranges of rows and the edges into ``P x P`` buckets (PyTorch-BigGraph); its
  batches come bucket by bucket in an order that swaps few partitions in and out of a
  buffer of ``--buffer`` partitions, and negatives are drawn from the partitions in the
  buffer or from a small pool of rows of all partitions (the library's default
  ``pool=``/``pool_share=``; docs/buckets.md, "Negatives"). Given the embedding's store,
  the iterator reads each entering partition ahead of use, sequentially
  (``dsa_core.load_range``), and writes each leaving one back (``dsa_core.release_range``),
  so only ``buffer + 1`` partitions (and two small pools) need to fit in memory.

Checkpoints: ``--checkpoint DIR`` writes ``opt.checkpoint(DIR, extra={"order":
it.state_dict()})`` every ``--checkpoint-every`` steps and when training stops
(``--stop-after N`` stops after N steps, as an interruption would); ``--resume`` restores
the table, its moments and the position in the order from ``DIR`` and trains on: the
batches after the resume point are exactly those of an uninterrupted run, so the final
table is too.

Evaluation: link-prediction AUC of the held-out edges against as many random non-edges
(dot-product score), next to the degree-only preferential-attachment score.

The defaults were chosen in random order at 20k nodes, 5 epochs (AUC): lr 0.005 with
``--init-scale 0.01`` and 2 negatives per edge 0.907 (1 negative 0.916, 5 negatives 0.856;
lr 0.01 0.906 with 1; init scale 0.1 0.873 with 1). More negatives per edge hurt: with lazy
Adam a row drawn once as a negative moves by about ``lr`` whatever its gradient.

Run::

    python -m examples.graph_buckets                       # 20k nodes, bucket order, seconds
    python -m examples.graph_buckets --order random        # the same in random order
    python -m examples.graph_buckets --nodes 1000000 --holdout 10000 \\
        --partitions 16 --buffer 4 --access disk           # 1M nodes, 9M directed edges

At 1M nodes (the table, m and v: 384 MiB) a buffer of 4 of 16 partitions keeps under a third
of the store in memory at a time (the buffer and the partition read ahead). On a table that
fits in memory the loads and releases have nothing to save (a released partition is dropped
from the page cache and read again when it comes back); ``--no-hints`` trains the same
batches without them, to the same bits.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm.auto import tqdm

from ._common import RssPeak, add_config_args, config_from_args, dir_bytes, fmt_bytes, \
    warm_up_torch
from .graph_embedding import auc, non_edges, power_law_graph

__all__ = ["Config", "RandomBatches", "batches", "main", "make_graph", "make_plan", "report",
           "run", "steps_per_epoch", "table_digest", "train", "train_step"]

ORDERS = ("random", "bucket")


@dataclasses.dataclass
class Config:
    """One training run; ``order`` is the only difference between the two orders' runs."""

    nodes: int = 20_000
    avg_degree: float = 10.0
    community_size: int = 1000
    mix: float = 0.1            # fraction of edges between communities
    gamma: float = 2.5          # power-law exponent of the degree distribution
    holdout: int = 2000         # edges removed for link prediction
    dim: int = 32
    epochs: int = 5
    batch: int = 1024           # directed edges per step
    negatives: int = 2          # per edge
    lr: float = 0.005           # measured at 20k nodes, random order (see the docstring)
    init_scale: float = 0.01
    order: str = "bucket"       # "random" or "bucket"
    partitions: int = 4         # bucket order: P node partitions, P*P edge buckets
    buffer: int = 2             # bucket order: partitions resident at a time
    hints: bool = True          # bucket order: give the store to the iterator (load/release)
    seed: int = 0
    access: str = "auto"        # the store's paging: "auto", "ram" or "disk"
    checkpoint: str = ""        # directory of the checkpoint ("": none)
    checkpoint_every: int = 0   # steps between checkpoints (0: only when training stops)
    stop_after: int = 0         # stop after this many steps of this run (0: train to the end)
    resume: bool = False        # continue from --checkpoint
    progress: bool = True


# --- data ------------------------------------------------------------------------------------
def make_graph(cfg: Config) -> dict[str, np.ndarray]:
    """The graph of ``cfg.seed``, its held-out edges and non-edges, the directed train edges.

    Returns ``train`` ((2 m_train, 2) int64: every training edge in both directions),
    ``test_pos`` / ``test_neg`` ((holdout, 2) int64) and ``degree`` (of the training graph).
    The same ``cfg`` gives the same arrays in every process (a resumed run rebuilds them).
    """
    rng = np.random.default_rng(cfg.seed)
    edges = power_law_graph(cfg, rng)
    test_idx = rng.choice(len(edges), size=min(cfg.holdout, len(edges) // 10), replace=False)
    mask = np.ones(len(edges), bool)
    mask[test_idx] = False
    test_pos = edges[test_idx].astype(np.int64)
    test_neg = non_edges(cfg.nodes, len(test_pos), edges, rng)
    und = edges[mask].astype(np.int64)
    train = np.concatenate([und, und[:, ::-1]])
    degree = np.bincount(und.reshape(-1), minlength=cfg.nodes)
    return {"train": np.ascontiguousarray(train), "test_pos": test_pos, "test_neg": test_neg,
            "degree": degree, "edges": len(edges)}


class RandomBatch(NamedTuple):
    """A batch of :class:`RandomBatches`, shaped like a ``dsa_core.buckets.Batch``."""

    edges: np.ndarray       # (b, 2) int64
    negatives: np.ndarray   # (b, negatives) int64, uniform over all nodes
    bucket: None
    position: tuple[int, int, int]  # (epoch, 0, batch_index)


class RandomBatches:
    """The random order: each epoch a fresh shuffle of the edges, negatives over all nodes.

    The counterpart of ``dsa_core.buckets.Plan.batches`` for the comparison, with the same
    interface where the training loop uses it: iterating yields batches with ``edges`` and
    ``negatives``; :attr:`position` is ``(epoch, 0, batch_index)`` of the next batch
    (one "bucket" per epoch); :meth:`state_dict` / ``start=`` resume exactly. The shuffle
    of epoch ``e`` is seeded by ``(seed, e)`` and the negatives of a batch by ``(seed, e,
    batch_index)``, so a resumed iterator yields what the uninterrupted one would have.
    """

    def __init__(self, edges: np.ndarray, num_nodes: int, batch_size: int, *,
                 negatives: int = 0, epoch: int = 0, epochs: int = 1, seed: int = 0,
                 start: Any = None) -> None:
        if batch_size < 1 or negatives < 0 or epochs < 1 or num_nodes < 1:
            raise ValueError(f"need batch_size >= 1, negatives >= 0, epochs >= 1 and "
                             f"num_nodes >= 1; got {batch_size}, {negatives}, {epochs}, "
                             f"{num_nodes}")
        self.edges, self.num_nodes = edges, int(num_nodes)
        self.batch_size, self.negatives = int(batch_size), int(negatives)
        self.first, self.epochs, self.seed = int(epoch), int(epochs), int(seed)
        self._pos = (self.first, 0, 0)
        if start is not None:
            self._pos = self._check_start(start)

    def _check_start(self, start: Any) -> tuple[int, int, int]:
        if isinstance(start, dict):
            want = self.state_dict()
            for k in ("order", "seed", "num_edges", "batch_size", "negatives"):
                if start.get(k) != want[k]:
                    raise ValueError(f"start= is the position of another order: its {k} is "
                                     f"{start.get(k)!r}, this iterator's {want[k]!r}; resume "
                                     "with the parameters the checkpoint was written with")
            start = start["position"]
        e, b, i = (int(x) for x in start)
        if not (self.first <= e <= self.first + self.epochs and b == 0 and i >= 0):
            raise ValueError(f"start position {tuple(start)} is outside epochs "
                             f"[{self.first}, {self.first + self.epochs})")
        return e, 0, i

    @property
    def position(self) -> tuple[int, int, int]:
        """``(epoch, 0, batch_index)`` of the next batch."""
        return self._pos

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch and the parameters a resume must match."""
        return {"order": "random", "position": list(self._pos), "seed": self.seed,
                "num_edges": len(self.edges), "batch_size": self.batch_size,
                "negatives": self.negatives}

    def close(self) -> None:
        """Stop early (as ``BatchIterator.close``; nothing to release here)."""

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-len(self.edges) // self.batch_size)

    def __iter__(self):
        n, b = len(self.edges), self.batch_size
        e0, _, i0 = self._pos
        for e in range(e0, self.first + self.epochs):
            perm = np.random.default_rng([self.seed, e]).permutation(n)
            for i in range(i0 if e == e0 else 0, len(self)):
                part = self.edges[perm[i * b:(i + 1) * b]]
                neg = np.random.default_rng([self.seed, e, i]).integers(
                    0, self.num_nodes, (len(part), self.negatives))
                nxt = (e, 0, i + 1) if i + 1 < len(self) else (e + 1, 0, 0)
                self._pos = nxt
                yield RandomBatch(part, neg, None, (e, 0, i))


def make_plan(cfg: Config, train: np.ndarray):
    """The bucket plan of the directed training edges (``None`` for the random order)."""
    if cfg.order == "random":
        return None
    from dsa_core import buckets

    return buckets.plan(train, cfg.nodes, partitions=cfg.partitions, buffer=cfg.buffer,
                        seed=cfg.seed)


def batches(cfg: Config, train: np.ndarray, plan, stores=(), start=None):
    """The batch iterator of ``cfg.order``: ``plan.batches`` or :class:`RandomBatches`."""
    if plan is None:
        return RandomBatches(train, cfg.nodes, cfg.batch, negatives=cfg.negatives,
                             epochs=cfg.epochs, seed=cfg.seed, start=start)
    return plan.batches(cfg.batch, negatives=cfg.negatives, epochs=cfg.epochs,
                        stores=stores, start=start)


def steps_per_epoch(cfg: Config, train: np.ndarray, plan) -> int:
    """Batches per epoch: a bucket's last batch may be short, so the bucket order has more."""
    if plan is None:
        return -(-len(train) // cfg.batch)
    return int((-(-plan.bucket_sizes // cfg.batch)).sum())


def table_digest(state, chunk: int = 1 << 16) -> str:
    """sha256 of the table's weights, m and v (the rows' records), read in chunks.

    Two runs end with the same digest only if every bit of every row agrees.
    """
    h = hashlib.sha256()
    data = state.store.data
    for lo in range(0, state.num_rows, chunk):
        h.update(np.ascontiguousarray(data[lo:lo + chunk]).tobytes())
    return h.hexdigest()


# --- training --------------------------------------------------------------------------------
def train_step(emb, opt, edges: np.ndarray, negatives: np.ndarray) -> float:
    """One step of the LINE-style loss on ``edges`` (b, 2|3) and their ``negatives`` (b, k).

    The first column is the source, the last the destination (a middle relation column is
    not used by this model). Returns the batch's loss.
    """
    b, k = negatives.shape
    src, dst = edges[:, 0], edges[:, -1]
    ids = torch.from_numpy(np.concatenate([src, dst, negatives.reshape(-1)]))
    rows = emb(ids)
    eu, ev, en = rows[:b], rows[b:2 * b], rows[2 * b:].view(b, k, -1)
    pos = (eu * ev).sum(-1)
    neg = torch.bmm(en, eu.unsqueeze(-1)).squeeze(-1)
    loss = (torch.nn.functional.softplus(-pos)
            + torch.nn.functional.softplus(neg).sum(-1)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return float(loss.detach())


def train(cfg: Config, graph: dict, work: Path) -> dict:
    """Train (or resume) one run; returns losses, timings, the store's final weights' AUC."""
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    if cfg.order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {cfg.order!r}")
    if cfg.resume and not cfg.checkpoint:
        raise ValueError("resume=True needs checkpoint= (the directory to resume from)")
    ck = Path(cfg.checkpoint) if cfg.checkpoint else None
    t0 = time.perf_counter()
    plan = make_plan(cfg, graph["train"])   # bad partitions/buffer: refused before any store
    t_plan = time.perf_counter() - t0
    emb = DiskEmbedding(cfg.nodes, cfg.dim, state_dir=work / "nodes", init="normal",
                        init_scale=cfg.init_scale, seed=cfg.seed, overwrite=True,
                        access=cfg.access)
    opt = DiskSparseAdam(emb.parameters(), lr=cfg.lr)
    start = None
    if cfg.resume:
        start = opt.load_checkpoint(ck)["order"]
    meter = RssPeak()
    losses: list[float] = []
    it = None
    try:
        it = batches(cfg, graph["train"], plan, [emb.store] if cfg.hints else (), start)
        total = cfg.epochs * steps_per_epoch(cfg, graph["train"], plan)
        bar = tqdm(total=total, initial=emb.store.count, desc=cfg.order,
                   unit="step", disable=not cfg.progress, file=sys.stdout,
                   dynamic_ncols=True, mininterval=0.5)
        stopped = False
        t0 = time.perf_counter()
        for batch in it:
            losses.append(train_step(emb, opt, batch.edges, batch.negatives))
            meter.sample()
            bar.update()
            n = len(losses)
            if ck is not None and cfg.checkpoint_every and n % cfg.checkpoint_every == 0:
                opt.checkpoint(ck, overwrite=True, extra={"order": it.state_dict()})
            if cfg.stop_after and n >= cfg.stop_after:
                stopped = True
                break
        t_train = time.perf_counter() - t0
        bar.close()
        if ck is not None:
            opt.checkpoint(ck, overwrite=True, extra={"order": it.state_dict()})
        with torch.no_grad():
            def score(pairs):
                return (emb.weight_rows(pairs[:, 0])
                        * emb.weight_rows(pairs[:, 1])).sum(1).numpy()

            auc_emb = auc(score(graph["test_pos"]), score(graph["test_neg"]))
        digest = table_digest(emb.store)
        store_bytes = dir_bytes(work / "nodes")
        steps_total = emb.store.count
    finally:
        if it is not None:
            it.close()   # stopped early: the bucket iterator releases the partitions it holds
        opt.close()
        emb.close()
    return {"auc": auc_emb, "losses": losses, "steps": len(losses),
            "steps_total": steps_total, "stopped": stopped,
            "position": list(it.position) if it is not None else None,
            "loads": getattr(it, "loads", None), "digest": digest,
            "rss_anon_growth": meter.growth, "store_bytes": store_bytes,
            "seconds": {"plan": t_plan, "train": t_train}}


def run(cfg: Config, work: Path) -> dict:
    """Build the graph, train in ``cfg.order``, evaluate; the metrics and timings."""
    t0 = time.perf_counter()
    graph = make_graph(cfg)
    t_graph = time.perf_counter() - t0
    warm_up_torch()
    r = train(cfg, graph, work)
    deg = graph["degree"].astype(np.float64)
    tp, tn = graph["test_pos"], graph["test_neg"]
    r.update({"cfg": cfg, "edges": graph["edges"], "train_edges": len(graph["train"]),
              "holdout": len(tp),
              "auc_degree": auc(deg[tp[:, 0]] * deg[tp[:, 1]], deg[tn[:, 0]] * deg[tn[:, 1]]),
              "table_bytes": 3 * cfg.nodes * cfg.dim * 4})
    r["seconds"]["graph"] = t_graph
    return r


def report(r: dict) -> str:
    c = r["cfg"]
    s = r["seconds"]
    k = max(1, len(r["losses"]) // 20)
    losses = r["losses"] or [float("nan")]
    order = ("random (edges shuffled each epoch, negatives over all nodes)"
             if c.order == "random" else
             f"bucket ({c.partitions} partitions, {c.partitions ** 2} buckets, a buffer of "
             f"{c.buffer}; {r['loads']} partition loads; plan built in {s['plan']:.1f}s)")
    lines = [
        (f"\ngraph: {c.nodes:,} nodes, {r['edges']:,} edges ({r['train_edges']:,} directed "
         f"training edges), {r['holdout']:,} held out; built in {s['graph']:.1f}s"),
        f"order: {order}",
        (f"training: DiskEmbedding({c.nodes:,}, {c.dim}) + DiskSparseAdam(lr={c.lr}), batch "
         f"{c.batch}, {c.negatives} negatives per edge, {c.epochs} epoch"
         f"{'s' if c.epochs != 1 else ''}: {r['steps']:,} "
         f"steps in this run ({r['steps_total']:,} in all), {s['train']:.1f}s"
         + (" (stopped early: --stop-after)" if r["stopped"] else "")),
        (f"loss: {np.mean(losses[:k]):.4f} (first 5% of this run's steps) -> "
         f"{np.mean(losses[-k:]):.4f} (last 5%)"),
        (f"link prediction AUC (held-out edges vs random non-edges): {r['auc']:.4f}; "
         f"degree-only preferential attachment: {r['auc_degree']:.4f}; random: 0.5"),
        (f"memory: table + Adam state on disk {fmt_bytes(r['store_bytes'])}; RssAnon growth "
         f"during training {fmt_bytes(r['rss_anon_growth'])}"),
    ]
    if c.checkpoint:
        lines.append(f"checkpoint (table, moments, position {r['position']}): {c.checkpoint}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m examples.graph_buckets",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, Config, skip=("resume", "hints"))
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint at --checkpoint")
    p.add_argument("--no-hints", dest="hints", action="store_false",
                   help="bucket order without giving the store to the iterator: the same "
                        "batches and results, no partition loads/releases")
    p.add_argument("--dir", default=None,
                   help="where the store goes (default: a temporary directory, removed)")
    a = p.parse_args(argv)
    cfg = config_from_args(Config, a)
    if a.order not in ORDERS:
        p.error(f"--order must be one of {ORDERS}, got {a.order!r}")
    torch.set_num_threads(1)  # 2 torch threads next to numba's are much slower on 2 cores
    if a.dir is not None:
        r = run(cfg, Path(a.dir))
    else:
        with tempfile.TemporaryDirectory(prefix="dsa-buckets-") as tmp:
            r = run(cfg, Path(tmp))
    print(report(r))
    return r


if __name__ == "__main__":
    main()
