"""Knowledge-graph embedding in JAX, with the Adam state (and the tables) on disk.

The JAX version of :mod:`examples.kg_embedding`: the same ComplEx/DistMult model, data,
initial weights, batches and negatives, trained with :mod:`adapters.jax`:

1. the entity and relation tables are ``dsa_core`` stores (weights, m and v on disk);
2. each step, :func:`adapters.jax.gather_batch` deduplicates the batch's ids and puts only their
   rows on the device (padded to a power of two, so the jitted loss sees few shapes);
3. a jitted ``value_and_grad`` of the loss with respect to those rows gives the row
   gradients (duplicates summed);
4. ``update`` of :func:`adapters.jax.sparse_adam` applies one lazy Adam step to those rows in
   the stores (``dsa_core.step``), outside ``jit``.

``--compare-torch`` also trains the torch model with ``torch.optim.SparseAdam`` from the same
initial weights and batches: the optimizer is the same, so the MRRs agree up to the float
rounding of two frameworks' gradient kernels.

Run::

    python -m examples.jax_kg                         # UMLS, small: CPU only
    python -m examples.jax_kg --compare-torch
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from adapters import jax as dsa_jax

from . import _kg
from .kg_embedding import Config, _initial_weights

__all__ = ["main", "train"]


def query_vectors(model: str, h, r):
    """As :func:`examples.kg_embedding.query_vectors`, in jax.numpy."""
    if model == "distmult":
        return h * r
    hr, hi = jnp.split(h, 2, -1)
    rr, ri = jnp.split(r, 2, -1)
    return jnp.concatenate([hr * rr - hi * ri, hr * ri + hi * rr], -1)


def n3(x, model: str):
    if model == "complex":
        a, b = jnp.split(x, 2, -1)
        return jnp.mean(jnp.sum((a * a + b * b) ** 1.5, -1))
    return jnp.mean(jnp.sum(jnp.abs(x) ** 3, -1))


@functools.partial(jax.jit, static_argnames=("model", "reg"))
def loss_and_grads(ent_rows, rel_rows, ent_inv, rel_inv, hit, *, model: str, reg: float):
    """Loss of a batch and its gradients with respect to the gathered (unique) rows."""
    b, k1 = hit.shape

    def loss_fn(ent_rows, rel_rows):
        h = ent_rows[ent_inv[:b]]
        c = ent_rows[ent_inv[b:].reshape(b, k1)]
        r = rel_rows[rel_inv]
        logits = jnp.einsum("bd,bkd->bk", query_vectors(model, h, r), c)
        logits = jnp.where(hit, -jnp.inf, logits)
        loss = -jnp.mean(jax.nn.log_softmax(logits)[:, 0])
        if reg:
            loss = loss + reg * (n3(h, model) + n3(r, model) + n3(c[:, 0], model))
        return loss

    return jax.value_and_grad(loss_fn, argnums=(0, 1))(ent_rows, rel_rows)


def train(cfg: Config, kg: _kg.KG, work: Path) -> dict:
    """Train with adapters.jax over dsa_core stores; returns metrics and the loss curve."""
    init_e, init_r = _initial_weights(cfg, kg)     # the torch example's initial weights
    # a fresh run every time: overwrite=True replaces the stores of an earlier run
    stores = {"ent": dsa_jax.create_store(work / "entities", *init_e.shape, init=init_e,
                                          progress=False, overwrite=True),
              "rel": dsa_jax.create_store(work / "relations", *init_r.shape, init=init_r,
                                          progress=False, overwrite=True)}
    tx = dsa_jax.sparse_adam(cfg.lr, return_rows=False)
    opt_state = tx.init(stores)
    queries = _kg.reciprocal(kg.train, kg.num_relations)
    rng = np.random.default_rng(cfg.seed + 1)      # the torch example's batches
    losses, step_losses = [], []
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.epochs), desc="jax+dsa", unit="epoch", disable=not cfg.progress,
               file=sys.stdout, dynamic_ncols=True)
    try:
        for _ in bar:
            total = 0.0
            for qb, negs in _kg.batches(queries, kg.num_entities, cfg.batch, cfg.neg, rng):
                cand = np.concatenate([qb[:, 2:], negs], 1)
                hit = np.concatenate([np.zeros((len(qb), 1), bool), negs == qb[:, 2:]], 1)
                be = dsa_jax.gather_batch(opt_state.stores["ent"],
                                    np.concatenate([qb[:, 0], cand.reshape(-1)]),
                                    buckets="pow2")
                br = dsa_jax.gather_batch(opt_state.stores["rel"], qb[:, 1], buckets="pow2")
                loss, (ge, gr) = loss_and_grads(be.rows, br.rows, be.inverse, br.inverse,
                                                hit, model=cfg.model, reg=cfg.reg)
                _, opt_state = tx.update({"ent": (be.idx, ge), "rel": (br.idx, gr)},
                                         opt_state)
                step_losses.append(float(loss))
                total += step_losses[-1] * len(qb)
            losses.append(total / len(queries))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
        seconds = time.perf_counter() - t0
        core = dsa_jax.core_states(opt_state)
        ent, rel = np.array(core["ent"].weights), np.array(core["rel"].weights)
        score_q = jax.jit(lambda h, r, e: query_vectors(cfg.model, h, r) @ e.T)
        metrics = _kg.evaluate(lambda e, r: np.asarray(score_q(ent[e], rel[r], ent)), kg)
    finally:
        bar.close()
        dsa_jax.close(opt_state)
    return {"optimizer": "jax+dsa", "metrics": metrics, "losses": losses,
            "step_losses": step_losses, "seconds": seconds, "steps": int(opt_state.count)}


def main(argv=None) -> dict:
    from .kg_embedding import common_parser, config_from

    p = common_parser("python -m examples.jax_kg", __doc__.split("\n\n")[0], Config())
    p.add_argument("--compare-torch", action="store_true",
                   help="also train the torch model with torch.optim.SparseAdam")
    a = p.parse_args(argv)
    cfg, compare = config_from(a, Config()), a.compare_torch
    kg = _kg.load(cfg.dataset)
    dsa_jax.warmup(("float32",))
    with tempfile.TemporaryDirectory(prefix="dsa-jax-kg-") as tmp:
        res = train(cfg, kg, Path(tmp) / "jax")
        ref = None
        if compare:
            from . import kg_embedding

            kg_embedding.warm_up_torch()
            ref = kg_embedding.train("sparse_adam", cfg, kg, Path(tmp) / "torch")
    rnd = _kg.random_baseline(kg)
    print(f"\n{cfg.model} on {kg.name} with JAX + adapters.jax.sparse_adam (tables and Adam "
          f"state in dsa_core stores), dim {cfg.dim}, {cfg.epochs} epochs, batch {cfg.batch}, "
          f"{cfg.neg} negatives, lr {cfg.lr}, seed {cfg.seed}")
    print(f"{'':34} {'MRR':>7} {'Hits@1':>7} {'Hits@3':>7} {'Hits@10':>8} {'time':>7}")
    rows = [("JAX + DSA sparse_adam (disk)", res)]
    if ref is not None:
        rows.append(("torch + SparseAdam (RAM)", ref))
    for name, r in rows:
        m = r["metrics"]
        print(f"{name:34} {m['mrr']:7.4f} {m['hits@1']:7.4f} {m['hits@3']:7.4f} "
              f"{m['hits@10']:8.4f} {r['seconds']:6.1f}s")
    print(f"{'random scores (expected, exact)':34} {rnd['mrr']:7.4f} {'':7} {'':7} "
          f"{rnd['hits@10']:8.4f}")
    print(f"training loss: first epoch {res['losses'][0]:.4f}, last {res['losses'][-1]:.4f}")
    return {"kg": kg, "result": res, "torch": ref, "random": rnd}


if __name__ == "__main__":
    main()
