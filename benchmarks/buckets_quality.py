"""Partition-ordered (bucket) training against random order: held-out link-prediction quality.

    python -m benchmarks.buckets_quality --no-timing-run --kg-diagnostics   # ~12 min
    python -m benchmarks.buckets_quality --mix bucket   # the first comparison (+ the pool)
    python -m benchmarks.buckets_quality --no-graph --kg kinships --kg-lrs 0.005 \
        --kg-diagnostics --mix bucket --pool-arms default   # the pool on Kinships, ~8 min
    python -m benchmarks.buckets_quality --smoke        # seconds; the tests run this

Trains the node embeddings of :mod:`examples.graph_buckets` (first-order LINE-style loss,
``DiskEmbedding`` + ``DiskSparseAdam``) on the example's power-law graph once per order and
seed, with the same epochs, batch size, negatives per edge, lr and initial table:

* ``random``: the edges shuffled every epoch, negatives uniform over all nodes;
* ``bucket``: ``dsa_core.buckets.plan(...).batches(..., mix="bucket", pool=0,
  stores=[emb.store])``: bucket by bucket in BETA order with a buffer of ``--buffer`` of
  ``--partitions`` partitions, each bucket's edges shuffled, negatives uniform over the
  partitions in the buffer (``pool=0``: the negatives before the pool existed), each
  entering partition loaded and each leaving one released in the background;
* ``bucket_mixed``: the same order of buffer states with ``mix="buffer"``: the edges of all
  the buckets of one buffer state shuffled together, so consecutive batches are no longer
  drawn from one bucket (same loads, same negatives' partitions);
* ``bucket_pool``: bucket by bucket with the library's default negatives (``pool=`` and
  ``pool_share=`` not passed): each negative from a pool of rows drawn from all partitions
  per buffer state with probability ``pool_share``, else from the buffer. ``--pool-arms``
  adds arms with other ``pool_share[:pool]`` (``bucket_pool_s<share>_n<pool>``) and, with
  ``mixed``, the default negatives with ``mix="buffer"`` (``bucket_pool_mixed``).

``--mix bucket buffer`` (the default) runs both buffer-negative arms; ``--mix bucket`` runs
the first comparison only (``random`` and ``bucket``), whose figures do not depend on the
other arms (every run is seeded on its own); ``--mix`` alone runs none of them.
``--pool-arms`` alone runs no pool arm; ``--no-graph`` skips the graph, ``--name`` names
the result files.

A seed fixes the graph, the held-out edges and non-edges and the initial table, so each seed
is a paired comparison. Reported per seed: the AUC of the held-out edges against as many
random non-edges, and the relative difference ``(bucket - random) / random``; over seeds,
the mean, standard deviation and range of that difference, next to the seed-to-seed spread
of each order's AUC (``bucket_mixed`` likewise). Also timed, seed 0 only (skipped with
``--no-timing-run``): the first bucket arm with no stores given to the iterator (the same
batches; its final table must be bit-identical to the hinted run's: the loads and releases
only hint), so the time the hints add or save on a table that fits in memory is measured.

The knowledge-graph part (``--kg umls``, the default; ``--kg none`` skips it) trains
``examples.kg_embedding``'s ComplEx (reciprocal relations, 1-vs-``--kg-neg`` softmax, N3)
with an entity and a relation ``DiskEmbedding`` on a KG that ships in PyKEEN's wheel, per
seed in the arms ``random``, ``bucket`` (the reciprocal queries ``(h, r, t)`` bucketed by
the partitions of ``h`` and ``t``; negatives from the buffer; the entity store given to the
iterator), ``bucket_mixed`` (the same with ``mix="buffer"``) and two diagnostics, both
bucket by bucket: ``bucket_global_neg`` (the bucket run's batches with negatives redrawn
over all entities) and ``bucket_all_resident`` (2 partitions and a buffer of 2: every
entity always resident, so the negatives are global and only the bucket-by-bucket order of
the queries differs from ``random``). ``random`` and the bucket arms run at each lr of
``--kg-lrs`` (the first, 0.02, is the demo's, tuned for random order; the diagnostics run
there), and each order's lr is also chosen by its mean validation MRR over the seeds. It
reports the filtered test MRR.

The verdicts printed last: is each bucket arm within 2% of ``random`` on every seed, at the
random order's lr, on both tasks (the graph's one lr; the KG's lr that random order's
validation MRR chooses)?

Writes ``<out>/<name>.{json,csv}`` (``<out>`` defaults to ``benchmarks/results``, ``<name>``
to ``buckets_quality``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import RESULTS, machine, print_table

NAME = "buckets_quality"
DIAGNOSTICS = ("bucket_global_neg", "bucket_all_resident")
ARM_OF_MIX = {"bucket": "bucket", "buffer": "bucket_mixed"}   # --mix -> the arm's name
POOL_ARM = "bucket_pool"   # the library's defaults (pool=, pool_share= not passed)
# each bucket arm's keywords of plan.batches (the buffer-only arms pass pool=0: the
# negatives of the first comparison, before the pool existed); pool sweep arms are added by
# pool_arm()
BATCH_KW: dict[str, dict] = {
    "bucket": {"mix": "bucket", "pool": 0}, "bucket_mixed": {"mix": "buffer", "pool": 0},
    "bucket_global_neg": {"mix": "bucket", "pool": 0},
    "bucket_all_resident": {"mix": "bucket", "pool": 0}, POOL_ARM: {"mix": "bucket"}}


def pool_arm(spec: str) -> str:
    """The arm of a ``--pool-arms`` item: ``default`` (the library's defaults), ``mixed``
    (the same with ``mix="buffer"``) or ``SHARE[:ROWS]`` (``pool_share=SHARE``,
    ``pool=ROWS``, default rows the library's)."""
    if spec == "default":
        return POOL_ARM
    if spec == "mixed":  # the default negatives with mix="buffer"
        BATCH_KW[f"{POOL_ARM}_mixed"] = {"mix": "buffer"}
        return f"{POOL_ARM}_mixed"
    from dsa_core import buckets

    share, _, rows = spec.partition(":")
    kw = {"mix": "bucket", "pool_share": float(share),
          "pool": int(rows) if rows else buckets.DEFAULT_POOL}
    name = f"{POOL_ARM}_s{kw['pool_share']:g}_n{kw['pool']}"
    BATCH_KW[name] = kw
    return name


def _mix_of(arm: str) -> str | None:
    return BATCH_KW[arm]["mix"] if arm in BATCH_KW else None


def _pool_of(arm: str, num_nodes: int) -> tuple:
    """``(pool, pool_share)`` the arm's batches use on ``num_nodes`` rows (the library's
    defaults where the arm passes none, as the iterator resolves them), for the result
    rows; ``(None, None)`` for random order."""
    if arm not in BATCH_KW:
        return None, None
    from dsa_core import buckets

    kw = {k: v for k, v in BATCH_KW[arm].items() if k != "mix"}
    it = buckets.plan(np.zeros((1, 2), np.int64), num_nodes, partitions=1).batches(
        1, negatives=1, **kw)
    return it.pool, it.pool_share


def _loadavg() -> list[str]:
    try:
        return Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        return []


class _ArmPlan:
    """A ``dsa_core.buckets.Plan`` whose ``batches`` always pass an arm's keywords
    (``mix=``, ``pool=``, ...): how the example's training loop (which calls
    ``plan.batches(...)`` with the library's defaults) is run as a given arm."""

    def __init__(self, plan, kw: dict) -> None:
        self._plan, self._kw = plan, kw

    def __getattr__(self, name):
        return getattr(self._plan, name)

    def batches(self, *args, **kwargs):
        return self._plan.batches(*args, **self._kw, **kwargs)


@contextlib.contextmanager
def _example_arm(gb, kw: dict):
    """``examples.graph_buckets`` batching its plans with ``kw`` while the block runs."""
    make = gb.make_plan

    def make_plan(cfg, train):
        plan = make(cfg, train)
        return None if plan is None else _ArmPlan(plan, kw)

    gb.make_plan = make_plan
    try:
        yield
    finally:
        gb.make_plan = make


def one_run(cfg, workdir: Path, arm: str = "bucket") -> dict:
    """One graph run: random order (``cfg.order``) or the bucket ``arm`` (without stores
    given to the iterator when ``cfg.hints`` is off: then the row's order is
    ``bucket_no_hints``)."""
    from examples import graph_buckets as gb

    with tempfile.TemporaryDirectory(prefix="dsa-bq-", dir=workdir) as tmp, \
            _example_arm(gb, BATCH_KW[arm]):
        r = gb.run(cfg, Path(tmp))
    k = max(1, len(r["losses"]) // 20)
    if cfg.order != "bucket":
        order = "random"
    elif not cfg.hints:
        order = "bucket_no_hints"
    else:
        order = arm
    row = {"seed": cfg.seed, "order": order,
           "mix": None if order == "random" else _mix_of(arm),
           "pool": _pool_of(arm, cfg.nodes)[0] if order != "random" else None,
           "pool_share": _pool_of(arm, cfg.nodes)[1] if order != "random" else None,
           "auc": round(float(r["auc"]), 5),
           "auc_degree": round(float(r["auc_degree"]), 5),
           "loss_last": round(float(np.mean(r["losses"][-k:])), 5), "steps": r["steps"],
           "partition_loads": r["loads"] if order != "random" else None,
           "train_s": round(r["seconds"]["train"], 2),
           "plan_s": round(r["seconds"]["plan"], 2), "digest": r["digest"][:16],
           "arm": arm if order == "bucket_no_hints" else None}
    return row


def summarise(rows: list[dict]) -> dict:
    """The bucket arms against random order (``rel_diff*``: ``bucket``, as in the first
    comparison; ``bucket_mixed``: the same statistics under its own key)."""
    by = {(r["seed"], r["order"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    arms = [o for o in dict.fromkeys(r["order"] for r in rows)
            if o not in ("random", "bucket_no_hints")]
    out: dict = {"seeds": seeds}
    for o in arms:
        rel = _rel([by[s, o]["auc"] for s in seeds], [by[s, "random"]["auc"] for s in seeds])
        above = np.array([(by[s, o]["auc"] - by[s, "random"]["auc"])
                          / (by[s, "random"]["auc"] - 0.5) for s in seeds])
        st = {**_stats(rel), "rel_diff_above_chance_mean": float(above.mean())}
        if o == "bucket":
            out.update(st)
        else:
            out[f"{o}_vs_random"] = st
    for o in ("random", *arms):
        a = np.array([by[s, o]["auc"] for s in seeds])
        out[f"auc_{o}_mean"] = float(a.mean())
        out[f"auc_{o}_std"] = float(a.std(ddof=1)) if len(a) > 1 else 0.0
        out[f"train_s_{o}_mean"] = float(np.mean([by[s, o]["train_s"] for s in seeds]))
    nh = by.get((seeds[0], "bucket_no_hints"))
    if nh is not None:
        out["no_hints_train_s"] = nh["train_s"]
        out["no_hints_identical"] = nh["digest"] == by[seeds[0], nh["arm"]]["digest"]
    return out


class GlobalNegatives:
    """Diagnostic: bucket-order batches with their negatives redrawn over all nodes.

    The same edges in the same order as the bucket run, only the negatives differ: uniform
    over every node instead of the buffer's partitions (seeded by the batch's position).
    What separates this arm from ``bucket`` is the restriction of the negatives; what
    separates it from ``random`` is the order of the edges.
    """

    def __init__(self, it, num_nodes: int, seed: int) -> None:
        self.it, self.num_nodes, self.seed = it, num_nodes, seed

    @property
    def loads(self) -> int:
        return self.it.loads

    def __iter__(self):
        for b in self.it:
            rng = np.random.default_rng([self.seed, *b.position, 7])
            yield b._replace(negatives=rng.integers(0, self.num_nodes, b.negatives.shape))


def kg_run(order: str, a, seed: int, kg, workdir: Path, lr: float) -> dict:
    """ComplEx on a PyKEEN KG (``examples.kg_embedding``'s model and loss), one order."""
    import torch

    from adapters.torch import DiskEmbedding, DiskSparseAdam
    from dsa_core import buckets
    from examples import _kg
    from examples.graph_buckets import RandomBatches
    from examples.kg_embedding import n3, query_vectors

    rng = np.random.default_rng(seed)
    scale = np.float32(0.1)
    init_e = rng.standard_normal((kg.num_entities, a.kg_dim), dtype=np.float32) * scale
    init_r = rng.standard_normal((2 * kg.num_relations, a.kg_dim), dtype=np.float32) * scale
    queries = _kg.reciprocal(kg.train, kg.num_relations)   # (h, r, t): h asks, t answers
    with tempfile.TemporaryDirectory(prefix="dsa-bq-kg-", dir=workdir) as tmp:
        ent = DiskEmbedding(*init_e.shape, state_dir=Path(tmp) / "ent", init=init_e)
        rel = DiskEmbedding(*init_r.shape, state_dir=Path(tmp) / "rel", init=init_r)
        opt = DiskSparseAdam([*ent.parameters(), *rel.parameters()], lr=lr)
        if order == "random":
            it = RandomBatches(queries, kg.num_entities, a.kg_batch, negatives=a.kg_neg,
                               epochs=a.kg_epochs, seed=seed)
        else:
            # bucket_all_resident: 2 partitions, both always in the buffer: the negatives
            # are over all entities and only the bucket-by-bucket order remains
            p, c = (2, 2) if order == "bucket_all_resident" else (a.kg_partitions, a.kg_buffer)
            plan = buckets.plan(queries, kg.num_entities, partitions=p, buffer=c, seed=seed)
            it = plan.batches(a.kg_batch, negatives=a.kg_neg, epochs=a.kg_epochs,
                              stores=[ent.store], **BATCH_KW[order])
            if order == "bucket_global_neg":
                it = GlobalNegatives(it, kg.num_entities, seed)
        steps, t0 = 0, time.perf_counter()
        for batch in it:
            qb, negs = torch.from_numpy(batch.edges), torch.from_numpy(batch.negatives)
            b = len(qb)
            cand = torch.cat([qb[:, 2:], negs], 1)                      # true answer first
            rows = ent(torch.cat([qb[:, 0], cand.reshape(-1)]))
            h, c = rows[:b], rows[b:].view(b, a.kg_neg + 1, -1)
            r = rel(qb[:, 1])
            logits = torch.einsum("bd,bkd->bk", query_vectors("complex", h, r), c)
            hit = torch.cat([torch.zeros(b, 1, dtype=torch.bool), negs == qb[:, 2:]], 1)
            logits = logits.masked_fill(hit, float("-inf"))
            loss = torch.nn.functional.cross_entropy(logits, torch.zeros(b, dtype=torch.long))
            loss = loss + a.kg_reg * n3(h, r, c[:, 0], model="complex")
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        train_s = time.perf_counter() - t0
        loads = getattr(it, "loads", None)
        E = ent.weight_rows(np.arange(kg.num_entities))
        R = rel.weight_rows(np.arange(2 * kg.num_relations))
        opt.close()
        ent.close()
        rel.close()

    @torch.no_grad()
    def score(e, r):
        return (query_vectors("complex", E[torch.from_numpy(e)], R[torch.from_numpy(r)])
                @ E.T).numpy()

    m = _kg.evaluate(score, kg, "test")
    v = _kg.evaluate(score, kg, "valid")
    return {"seed": seed, "order": order, "mix": _mix_of(order),
            "pool": _pool_of(order, kg.num_entities)[0],
            "pool_share": _pool_of(order, kg.num_entities)[1], "lr": lr,
            "mrr": round(m["mrr"], 5),
            "valid_mrr": round(v["mrr"], 5),
            "hits@1": round(m["hits@1"], 5), "hits@10": round(m["hits@10"], 5),
            "steps": steps, "partition_loads": loads, "train_s": round(train_s, 2)}


def _rel(x, y) -> np.ndarray:
    return (np.asarray(x) - np.asarray(y)) / np.asarray(y)


def _stats(rel: np.ndarray) -> dict:
    return {"rel_diff": rel.tolist(), "rel_diff_mean": float(rel.mean()),
            "rel_diff_std": float(rel.std(ddof=1)) if len(rel) > 1 else 0.0,
            "rel_diff_min": float(rel.min()), "rel_diff_max": float(rel.max()),
            "within_2pct": bool(np.all(np.abs(rel) <= 0.02))}


def summarise_kg(rows: list[dict], lrs: list[float]) -> dict:
    """Per lr: each arm's test MRR and its difference to random; then each order at its own
    lr, chosen by the mean validation MRR over the seeds."""
    by = {(r["seed"], r["order"], r["lr"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out: dict = {"seeds": seeds, "lrs": lrs, "per_lr": {}}
    all_arms = list(dict.fromkeys(r["order"] for r in rows))
    for lr in lrs:
        d = {}
        for o in all_arms:
            if (seeds[0], o, lr) not in by:
                continue
            v = np.array([by[s, o, lr]["mrr"] for s in seeds])
            d[o] = {"mrr_mean": float(v.mean()),
                    "mrr_std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
                    "valid_mrr_mean": float(np.mean([by[s, o, lr]["valid_mrr"]
                                                     for s in seeds]))}
            if o != "random":
                d[o].update(_stats(_rel(v, [by[s, "random", lr]["mrr"] for s in seeds])))
        out["per_lr"][str(lr)] = d
    best = {}
    arms = ["random"] + [o for o in all_arms if o not in ("random", *DIAGNOSTICS)
                         and all((seeds[0], o, lr) in by for lr in lrs)]
    for o in arms:
        best[o] = max(lrs, key=lambda lr, o=o: out["per_lr"][str(lr)][o]["valid_mrr_mean"])
    out["best_lr"] = best
    for o in arms[1:]:
        out[f"best_lr_{o}_vs_random"] = _stats(_rel(
            [by[s, o, best[o]]["mrr"] for s in seeds],
            [by[s, "random", best["random"]]["mrr"] for s in seeds]))
        # at the random order's (validation-chosen) lr: the comparison the default rests on
        out[f"random_lr_{o}_vs_random"] = out["per_lr"][str(best["random"])][o]
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
    ap.add_argument("--mix", nargs="*", default=["bucket", "buffer"], choices=["bucket",
                    "buffer"], help="the bucket arms with every negative from the buffer "
                    "(pool=0): mix='bucket' (arm 'bucket') and/or mix='buffer' (arm "
                    "'bucket_mixed'); none: pass the flag alone")
    ap.add_argument("--pool-arms", nargs="*", default=["default"],
                    help="arms with a negatives' pool: 'default' (arm 'bucket_pool': "
                    "plan.batches' defaults), 'mixed' (arm 'bucket_pool_mixed': the same with "
                    "mix='buffer') or SHARE[:ROWS] (bucket by bucket with pool_share, pool; "
                    "arm 'bucket_pool_s<SHARE>_n<ROWS>'); none: pass the flag alone")
    ap.add_argument("--kg", default="umls", help="a PyKEEN KG (umls, kinships, nations) "
                    "for the filtered-MRR comparison, or 'none'")
    ap.add_argument("--kg-lrs", nargs="+", type=float, default=[0.02, 0.01, 0.005],
                    help="lrs of the KG runs; the first is the shared one (the demo's, "
                         "tuned for random order), where the diagnostics run too")
    ap.add_argument("--kg-diagnostics", nargs="*", default=list(DIAGNOSTICS),
                    choices=DIAGNOSTICS, help="diagnostic arms at the first lr (none: "
                    "pass the flag alone)")
    ap.add_argument("--kg-partitions", type=int, default=4)
    ap.add_argument("--kg-buffer", type=int, default=2)
    ap.add_argument("--kg-epochs", type=int, default=40)
    ap.add_argument("--kg-dim", type=int, default=128)
    ap.add_argument("--kg-batch", type=int, default=256)
    ap.add_argument("--kg-neg", type=int, default=32)
    ap.add_argument("--kg-reg", type=float, default=3e-3)
    ap.add_argument("--no-timing-run", action="store_true",
                    help="skip the bucket run without stores (seed 0)")
    ap.add_argument("--workdir", default=None, help="where the stores go (default: TMPDIR)")
    ap.add_argument("--out", default=str(RESULTS), help="directory of the result files")
    ap.add_argument("--no-graph", action="store_true", help="skip the power-law graph")
    ap.add_argument("--name", default=NAME, help="stem of the result files")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, one seed and one KG learning rate (tests)")
    a = ap.parse_args(argv)
    name = a.name
    if a.smoke:
        a.nodes, a.holdout, a.epochs, a.partitions, a.seeds = 3000, 300, 1, 4, 1
        a.kg_epochs, a.kg_dim, a.kg_lrs = 1, 16, [0.02]
        name = a.name + "_smoke"
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
    arms = list(dict.fromkeys([ARM_OF_MIX[m] for m in a.mix]
                              + [pool_arm(x) for x in a.pool_arms]))
    if not arms:
        ap.error("no bucket arm: give --mix or --pool-arms a value")
    for seed in range(0 if a.no_graph else a.seeds):
        for order, arm in [("random", "bucket")] + [("bucket", m) for m in arms]:
            rows.append(one_run(dataclasses.replace(base, seed=seed, order=order), workdir,
                                arm))
            print(f"seed {seed} {rows[-1]['order']:12s}: AUC {rows[-1]['auc']:.4f}, "
                  f"{rows[-1]['steps']} steps, {rows[-1]['train_s']:.1f} s", flush=True)
    if not (a.no_timing_run or a.no_graph):
        rows.append(one_run(dataclasses.replace(base, seed=0, order="bucket", hints=False),
                            workdir, arms[0]))
        print(f"seed 0 {arms[0]}, no stores given: {rows[-1]['train_s']:.1f} s",
              flush=True)
    s = summarise(rows) if rows else {}
    from dsa_core import buckets

    # the fewest partition loads of one epoch with this buffer (independent of the edges)
    lb = buckets.plan(np.zeros((1, 2), np.int64), a.nodes, partitions=a.partitions,
                      buffer=a.buffer).order(0).lower_bound
    if rows:
        print()
        print_table(rows, ["seed", "order", "mix", "pool", "pool_share", "auc", "auc_degree",
                           "loss_last", "steps", "partition_loads", "train_s"])
        print(f"\nAUC (mean ± sd over {len(s['seeds'])} seeds): " + ", ".join(
            f"{o} {s[f'auc_{o}_mean']:.4f} ± {s[f'auc_{o}_std']:.4f}"
            for o in ["random", *arms]))
        for o in arms:
            x = s if o == "bucket" else s[f"{o}_vs_random"]
            print(f"{o} vs random, relative: mean {x['rel_diff_mean']:+.2%}, sd "
                  f"{x['rel_diff_std']:.2%}, range [{x['rel_diff_min']:+.2%}, "
                  f"{x['rel_diff_max']:+.2%}]; within 2% on every seed: {x['within_2pct']}")
    if "no_hints_train_s" in s:
        print(f"{arms[0]} without stores (seed 0): {s['no_hints_train_s']:.1f} s of "
              f"training; final table bit-identical to the hinted run: "
              f"{s['no_hints_identical']}")
    kg_rows, kg_sum = [], None
    if a.kg != "none":
        from examples import _kg

        try:
            kg = _kg.load(a.kg)
        except FileNotFoundError as exc:
            print(f"\nKG comparison skipped: {exc}")
        else:
            print(f"\n{a.kg}: ComplEx, filtered MRR ({kg.num_entities} entities, "
                  f"{a.kg_partitions} partitions, a buffer of {a.kg_buffer})")
            runs = [(lr, o) for lr in a.kg_lrs for o in ("random", *arms)]
            runs += [(a.kg_lrs[0], o) for o in a.kg_diagnostics]
            for seed in range(a.seeds):
                for lr, order in runs:
                    kg_rows.append({"task": a.kg,
                                    **kg_run(order, a, seed, kg, workdir, lr)})
                    print(f"seed {seed} lr {lr:<6g} {order:19s}: MRR "
                          f"{kg_rows[-1]['mrr']:.4f} (valid {kg_rows[-1]['valid_mrr']:.4f}), "
                          f"{kg_rows[-1]['train_s']:.1f} s", flush=True)
            print()
            print_table(kg_rows, ["seed", "lr", "order", "mix", "pool", "pool_share", "mrr",
                                  "valid_mrr", "hits@1", "hits@10", "steps",
                                  "partition_loads", "train_s"])
            kg_sum = summarise_kg(kg_rows, a.kg_lrs)
            print()
            for lr, d in kg_sum["per_lr"].items():
                for o, x in d.items():
                    line = (f"lr {lr:<6s} {o:19s}: test MRR {x['mrr_mean']:.4f} ± "
                            f"{x['mrr_std']:.4f}")
                    if o != "random":
                        line += (f"; vs random: mean {x['rel_diff_mean']:+.2%}, sd "
                                 f"{x['rel_diff_std']:.2%}, range [{x['rel_diff_min']:+.2%}, "
                                 f"{x['rel_diff_max']:+.2%}]")
                    print(line)
            b = kg_sum["best_lr"]
            for o in arms:
                x = kg_sum[f"best_lr_{o}_vs_random"]
                print(f"each order at its lr chosen on validation (random {b['random']:g}, "
                      f"{o} {b[o]:g}): {o} vs random {x['rel_diff_mean']:+.2%}, sd "
                      f"{x['rel_diff_std']:.2%}, range [{x['rel_diff_min']:+.2%}, "
                      f"{x['rel_diff_max']:+.2%}]")
    verdicts = {}
    for o in arms:  # within 2% of random on every seed, at random order's lr, on each task
        g = (s if o == "bucket" else s.get(f"{o}_vs_random", {})).get("within_2pct")
        k = None
        if kg_sum is not None:
            k = kg_sum[f"random_lr_{o}_vs_random"]["within_2pct"]
        verdicts[o] = {"graph_within_2pct": g, "kg_within_2pct_at_random_lr": k}
    if verdicts:
        print("\nwithin 2% of random on every seed at random order's lr: " + "; ".join(
            f"{o}: graph {v['graph_within_2pct']}, {a.kg} {v['kg_within_2pct_at_random_lr']}"
            for o, v in verdicts.items())
            + (f" (lr {kg_sum['best_lr']['random']:g})" if kg_sum is not None else ""))
    verdict = None
    if "bucket_mixed_vs_random" in s:
        graph_ok = s["bucket_mixed_vs_random"]["within_2pct"]
        kg_ok = None
        if kg_sum is not None:
            kg_ok = kg_sum["random_lr_bucket_mixed_vs_random"]["within_2pct"]
        verdict = {"graph_within_2pct": graph_ok, "kg_within_2pct_at_random_lr": kg_ok,
                   "both": bool(graph_ok and kg_ok) if kg_ok is not None else None}
        print(f"\nbucket_mixed within 2% of random on every seed at random order's lr: "
              f"graph {graph_ok}, KG {kg_ok}"
              + (f" (lr {kg_sum['best_lr']['random']:g})" if kg_sum is not None else ""))
    meta = {"machine": machine(), "args": vars(a), "summary": s, "summary_kg": kg_sum,
            "verdict_mixed": verdict, "verdicts": verdicts,
            "partition_loads_lower_bound_per_epoch": lb,
            "config": dataclasses.asdict(base), "dsa_core": dsa_core.__version__,
            "loadavg_start": load0, "loadavg_end": _loadavg(),
            "wall_s": time.perf_counter() - t0}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    task = f"powerlaw_{a.nodes}"
    _write(out / name, [{"task": task, **r} for r in rows] + kg_rows, meta)
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
