"""Offline reshard of a ShardedDiskEmbedding checkpoint to another world size or plan.

    python -m adapters.torch_reshard SRC DEST --world-size N [--plan mod|range]
                                     [--storage inplace|log] [--memory BYTES]

``SRC`` is a complete checkpoint written by ``ShardedDiskEmbedding.checkpoint`` (its
``dsa-sharded.json`` and every ``rank{k}`` shard in one directory: on several machines, copy
the shards together first). ``DEST`` (new) receives N shards holding the same rows, bit for
bit (weights, m and v of every global row moved to its new owner), the same step count and
hyperparameters, and a manifest; ``ShardedDiskEmbedding(..., resume_from=DEST)`` with N
processes then continues exactly where the SRC run stopped. Runs in one process, reading
and writing in chunks of whole records (``dsa_core.read_records`` / ``write_records``: memory
O(chunk), and it works on every kind of store); SRC is opened read-only and never modified.
DEST is built beside it and appears complete or not at all (``dsa_core.checkpoint_many``). The
new shards are of SRC's store kind, or of the one ``--storage`` names: resharding to the
same world size with ``--storage log`` (or ``inplace``) rewrites a checkpoint as the other
kind, bit for bit. The format it reads and writes is :mod:`adapters._torch_shards`.

>>> import tempfile, pathlib, numpy as np, dsa_core
>>> from adapters._torch_shards import (ShardPlan, manifest, shard_meta, write_manifest,
...                                     write_shard_meta)
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> table = {"num_embeddings": 10, "embedding_dim": 4, "dtype": "float32", "curvature": 0.0,
...          "padding_idx": None, "second_moment": "elementwise", "first_moment": "full"}
>>> two = ShardPlan(10, 2)                   # a 2-rank checkpoint, made by hand here
>>> for k in range(2):
...     st = dsa_core.create(tmp / "ckpt" / f"rank{k}", two.local_rows(k), 4, weights=True,
...                          init=two.global_ids(k, np.arange(5))[:, None] * np.ones(4))
...     st = dsa_core.set_count(st, 7); dsa_core.close(st)
...     write_shard_meta(tmp / "ckpt" / f"rank{k}", shard_meta(two, k, table))
>>> write_manifest(tmp / "ckpt", manifest(two, table, count=7))
>>> reshard(tmp / "ckpt", tmp / "ckpt3", 3, "range").name
'ckpt3'
>>> st = dsa_core.open(tmp / "ckpt3" / "rank1", mode="r")   # rows 4..7 of the table
>>> st.count, dsa_core.gather(st, range(4))[:, 0].tolist()
(7, [4.0, 5.0, 6.0, 7.0])
>>> dsa_core.close(st)
>>> _ = reshard(tmp / "ckpt", tmp / "ckpt-log", 2, storage="log")   # same rows, log shards
>>> st = dsa_core.open(tmp / "ckpt-log" / "rank1", mode="r")
>>> st.storage, st.count, dsa_core.gather(st, range(3))[:, 0].tolist()
('log', 7, [1.0, 3.0, 5.0])
>>> dsa_core.close(st)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import dsa_core
from dsa_core.tools import validation

from ._torch_shards import (
    ShardPlan,
    manifest,
    read_manifest,
    read_shard_meta,
    shard_meta,
    store_settings,
    table_of,
    write_manifest,
    write_shard_meta,
)

__all__ = ["reshard"]

_CHUNK_BYTES = 1 << 24  # records copied per chunk: memory stays O(chunk), not O(table)


def reshard(src, dest, world_size: int, plan: str = "mod", *, storage: str | None = None,
            memory: int | str | None = None, progress: bool = False) -> Path:
    """Rewrite checkpoint ``src`` as ``world_size`` shards with ownership ``plan`` at ``dest``.

    ``dest`` must not exist. Every shard of ``src`` is checked against its manifest (rank,
    step, rows, record layout, one store kind for all) before anything is written.
    ``storage`` is the kind of the new shards (``"inplace"`` or ``"log"``; default: the
    kind of ``src``'s shards), ``memory`` the region budget of each new log shard while it
    is written (``storage="log"`` only; default: the core's). A run resumes the new
    checkpoint with that kind (``ShardedDiskEmbedding(..., storage=...)``).
    """
    what = "torch_reshard"
    if storage is not None:
        storage = validation.check_storage(storage, what=what)
        memory = validation.check_memory_arg(memory, storage, what=what)
    src, dest = Path(src), Path(dest)
    man = read_manifest(src)
    old = ShardPlan.from_json(man["plan"])
    new = ShardPlan(man["num_embeddings"], int(world_size), plan)
    if dest.exists():
        raise FileExistsError(f"{str(dest)!r} exists; reshard writes a new directory")
    olds = []
    try:
        for k in range(old.world_size):
            path = src / f"rank{k}"
            meta = read_shard_meta(path)
            st = dsa_core.open(path, mode="r")
            olds.append(st)
            if meta["rank"] != k or meta["plan"] != man["plan"] or st.count != man["count"] \
                    or st.num_rows != old.local_rows(k):
                raise ValueError(f"shard {str(path)!r} does not match the manifest of "
                                 f"{str(src)!r} (rank {meta['rank']}, step {st.count}, "
                                 f"{st.num_rows} rows); the checkpoint was modified")
        kinds = sorted({st.storage for st in olds})
        if len(kinds) > 1:
            have = ", ".join(f"rank{k}: {st.storage}" for k, st in enumerate(olds))
            raise ValueError(f"the shards of {str(src)!r} are of different store kinds "
                             f"({have}); the checkpoint was modified")
        if storage is None:
            storage = kinds[0]
            memory = validation.check_memory_arg(memory, storage, what=what)
        lay0 = _without_rows(olds[0].layout)
        for st in olds[1:]:
            if _without_rows(st.layout) != lay0:
                raise ValueError(f"the shards of {str(src)!r} have different record layouts "
                                 f"({str(olds[0].path)!r}: {lay0}, {str(st.path)!r}: "
                                 f"{_without_rows(st.layout)}); the checkpoint was modified")
        table = table_of(man)
        with dsa_core.checkpoint_many(dest, {}) as tmp:  # the new shards are made in it
            _write_shards(olds, old, new, table, int(man["count"]), tmp, progress,
                          storage, memory)
            write_manifest(tmp, manifest(new, table, man["count"], resharded_from={
                "path": str(src.resolve()), "world_size": old.world_size,
                "plan": old.to_json()}))
    finally:
        for st in olds:
            dsa_core.close(st)
    return dest


def _without_rows(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k != "num_rows"}


def _write_shards(olds: list[dsa_core.State], old: ShardPlan, new: ShardPlan, table: dict,
                  count: int, root: Path, progress: bool, storage: str,
                  memory: int | None) -> None:
    s0 = olds[0]
    lay = s0.layout
    rows = max(1, _CHUNK_BYTES // (lay["stride"] * s0.dtype.itemsize))
    for j in range(new.world_size):
        n_j = new.local_rows(j)
        opt = ({} if s0.optimizer == "adam" else  # the optimizer is in store_settings
               {"lr_decay": s0.lr_decay, "initial_accumulator_value":
                s0.initial_accumulator_value})
        st = dsa_core.create(root / f"rank{j}", n_j, lay["dim"], curvature=lay["curvature"],
                             lr=s0.lr, betas=s0.betas, eps=s0.eps, maximize=s0.maximize, **opt,
                             weights=True, init=None, dtype=lay["dtype"],
                             ball_eps=s0.ball_eps if lay["curvature"] > 0 else None,
                             nonfinite=s0.nonfinite, align=lay["align"],
                             durability=s0.durability,
                             progress=False,
                             weight_decay=s0.weight_decay,
                             decoupled_weight_decay=s0.decoupled_weight_decay,
                             storage=storage, memory=memory, **store_settings(s0))
        try:
            if _without_rows(st.layout) != _without_rows(lay):
                raise ValueError(f"the new shard's record layout {st.layout} differs from the "
                                 f"checkpoint's {lay}; cannot move records between them")
            for lo in range(0, n_j, rows):
                hi = min(n_j, lo + rows)
                gids = new.global_ids(j, np.arange(lo, hi))
                own, loc = old.owner(gids), old.local(gids)
                for k in np.unique(own):
                    sel = own == k
                    dsa_core.write_records(st, np.arange(lo, hi)[sel],
                                           dsa_core.read_records(olds[k], loc[sel]))
            st = dsa_core.set_count(st, count)  # flushes the rows and the count
            write_shard_meta(root / f"rank{j}", shard_meta(new, j, table))
        finally:
            dsa_core.close(st)
        if progress:
            print(f"rank{j}: {n_j} rows", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adapters.torch_reshard",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a complete sharded checkpoint (holds dsa-sharded.json)")
    ap.add_argument("dest", help="new directory for the resharded checkpoint")
    ap.add_argument("--world-size", type=int, required=True,
                    help="number of shards (ranks) of the new checkpoint")
    ap.add_argument("--plan", choices=("mod", "range"), default="mod",
                    help="ownership of the new shards: row r on rank r %% N (mod, default) "
                         "or contiguous blocks of rows (range)")
    ap.add_argument("--storage", choices=validation.STORAGE_KINDS, default=None,
                    help="store kind of the new shards (default: that of SRC's shards)")
    ap.add_argument("--memory", default=None,
                    help="log shards only: region budget while each is written, bytes or "
                         "e.g. 4GiB (default: the core's)")
    a = ap.parse_args(argv)
    try:
        out = reshard(a.src, a.dest, a.world_size, a.plan, storage=a.storage,
                      memory=a.memory, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise SystemExit(f"torch_reshard: {exc}") from None
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
