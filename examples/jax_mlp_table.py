"""A JAX model with dense parameters and a table on disk, trained by one optax chain.

The model scores an id by an MLP over its embedding row: ``mlp(table[id])``. The MLP's
weights are ordinary JAX arrays, trained by ``optax.adam``; the table is a ``dsa_core``
store (weights, m and v on disk), trained by :func:`adapters.jax.sparse_adam`. One optax
transform does both, with the whole gradient clipped first::

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),                  # over the MLP and the table rows
        optax.multi_transform({"dense": optax.adam(1e-3),
                               "sparse": dsa_jax.sparse_adam(1e-2)},
                              {"mlp": "dense", "emb": "sparse"}))
    opt_state = tx.init({"mlp": mlp_params, "emb": store})

Each step gathers the batch's rows (:func:`adapters.jax.gather_batch`), differentiates the
loss with respect to the MLP and those rows (jitted), and passes the table's gradient as
``row_grads(batch.idx, g)``: its ids are not a pytree leaf, so the clip sees only gradient
values. ``update`` returns the MLP's updates (apply them with ``optax.apply_updates``) and
the table's new rows (already written to the store).

The data are synthetic: each id has a hidden vector and the target is a fixed function of
it, so the loss falls as both parts learn.

Run::

    python -m examples.jax_mlp_table
    python -m examples.jax_mlp_table --smoke
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from adapters import jax as dsa_jax

__all__ = ["main", "train"]


def mlp_init(key, dim: int, hidden: int) -> dict:
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (dim, hidden)) / np.sqrt(dim),
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden,)) / np.sqrt(hidden),
            "b2": jnp.zeros(())}


def mlp_apply(p: dict, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


@jax.jit
def loss_and_grads(mlp, rows, inverse, y):
    def loss(mlp, rows):
        return jnp.mean((mlp_apply(mlp, rows[inverse]) - y) ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1))(mlp, rows)


def train(directory, *, num_ids: int = 20_000, dim: int = 16, hidden: int = 32,
          batch: int = 256, steps: int = 300, seed: int = 0) -> dict:
    """Train the model; returns the mean loss of the first and the last tenth of the steps."""
    rng = np.random.default_rng(seed)
    hidden_vec = rng.normal(size=(num_ids, 4)).astype(np.float32)
    target = np.sin(hidden_vec).sum(1).astype(np.float32)
    store = dsa_jax.create_store(Path(directory) / "emb", num_ids, dim, init="normal",
                                 init_scale=0.1, seed=seed)
    mlp = mlp_init(jax.random.PRNGKey(seed), dim, hidden)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.multi_transform({"dense": optax.adam(1e-3),
                               "sparse": dsa_jax.sparse_adam(1e-2)},
                              {"mlp": "dense", "emb": "sparse"}))
    opt_state = tx.init({"mlp": mlp, "emb": store})
    losses = []
    try:
        for _ in range(steps):
            ids = rng.integers(0, num_ids, batch)
            b = dsa_jax.gather_batch(store, ids, buckets="pow2")
            loss, (g_mlp, g_rows) = loss_and_grads(mlp, b.rows, b.inverse,
                                                   jnp.asarray(target[ids]))
            updates, opt_state = tx.update(
                {"mlp": g_mlp, "emb": dsa_jax.row_grads(b.idx, g_rows)}, opt_state)
            mlp = optax.apply_updates(mlp, updates["mlp"])  # updates["emb"]: the new rows
            losses.append(float(loss))
    finally:
        dsa_jax.close(opt_state)  # finds sparse_adam's state inside the chain
    tenth = max(1, steps // 10)
    return {"first": float(np.mean(losses[:tenth])), "last": float(np.mean(losses[-tenth:])),
            "steps": steps}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="a few seconds, tiny sizes")
    ap.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    a = ap.parse_args(argv)
    kw = {"num_ids": 2_000, "steps": 60, "batch": 128} if a.smoke else {}
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        res = train(d, **kw)
    print(f"loss over the first tenth of {res['steps']} steps: {res['first']:.4f}, "
          f"over the last tenth: {res['last']:.4f}")
    return res


if __name__ == "__main__":
    main()
