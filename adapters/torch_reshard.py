"""Offline reshard of a ShardedDiskEmbedding checkpoint to another world size or plan.

    python -m adapters.torch_reshard SRC DEST --world-size N [--plan mod|range]

``SRC`` is a complete checkpoint written by ``ShardedDiskEmbedding.checkpoint`` (its
``dsa-sharded.json`` and every ``rank{k}`` shard in one directory: on several machines, copy
the shards together first). ``DEST`` (new) receives N shards holding the same rows, bit for
bit (weights, m and v of every global row moved to its new owner), the same step count and
hyperparameters, and a manifest; ``ShardedDiskEmbedding(..., resume_from=DEST)`` with N
processes then continues exactly where the SRC run stopped. Runs in one process, reading
and writing in chunks of rows (memory O(chunk)); SRC is opened read-only and never
modified. DEST is built in ``DEST.tmp-<pid>`` and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

import dsa_core

from ._torch_dist import (
    _MANIFEST_FORMAT,
    MANIFEST_FILE,
    SHARD_FILE,
    ShardPlan,
    _read_shard_meta,
    _write_json,
    read_manifest,
)

__all__ = ["reshard"]

_CHUNK_BYTES = 1 << 24


def reshard(src, dest, world_size: int, plan: str = "mod", *, progress: bool = False) -> Path:
    """Rewrite checkpoint ``src`` as ``world_size`` shards with ownership ``plan`` at ``dest``."""
    src, dest = Path(src), Path(dest)
    man = read_manifest(src)
    old = ShardPlan(man["num_embeddings"], man["world_size"], man["plan"]["kind"])
    new = ShardPlan(man["num_embeddings"], int(world_size), plan)
    if dest.exists():
        raise FileExistsError(f"{str(dest)!r} exists; reshard writes a new directory")
    olds = []
    try:
        for k in range(old.world_size):
            path = src / f"rank{k}"
            meta = _read_shard_meta(path)
            st = dsa_core.open(path, mode="r")
            olds.append(st)
            if meta.get("rank") != k or st.count != man["count"] \
                    or st.num_rows != old.local_rows(k):
                raise ValueError(f"shard {str(path)!r} does not match the manifest of "
                                 f"{str(src)!r} (rank {meta.get('rank')}, step {st.count}, "
                                 f"{st.num_rows} rows); the checkpoint was modified")
        tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _write_shards(olds, old, new, man, tmp, progress)
            out = dict(man, world_size=new.world_size, plan=new.to_json(),
                       shards=[f"rank{j}" for j in range(new.world_size)],
                       local_rows=[new.local_rows(j) for j in range(new.world_size)],
                       format=_MANIFEST_FORMAT, resharded_from={
                           "path": str(src.resolve()), "world_size": old.world_size,
                           "plan": old.to_json()})
            _write_json(tmp / MANIFEST_FILE, out)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        for st in olds:
            dsa_core.close(st)
    return dest


def _write_shards(olds, old: ShardPlan, new: ShardPlan, man: dict, root: Path,
                  progress: bool) -> None:
    s0 = olds[0]
    lay = s0.store.layout
    meta0 = _read_shard_meta(s0.path)
    rows = max(1, _CHUNK_BYTES // (lay["stride"] * s0.dtype.itemsize))
    for j in range(new.world_size):
        n_j = new.local_rows(j)
        st = dsa_core.create(root / f"rank{j}", n_j, lay["dim"], curvature=lay["curvature"],
                             lr=s0.lr, betas=s0.betas, eps=s0.eps, maximize=s0.maximize,
                             weights=True, init=None, dtype=lay["dtype"],
                             ball_eps=s0.ball_eps if lay["curvature"] > 0 else None,
                             nonfinite=s0.nonfinite, align=lay["align"],
                             durability=s0.durability, progress=False,
                             second_moment=lay.get("second_moment", "elementwise"),
                             first_moment=lay.get("first_moment", "full"))
        try:
            dst = st.store.data
            for lo in range(0, n_j, rows):
                hi = min(n_j, lo + rows)
                gids = new.global_ids(j, np.arange(lo, hi))
                own, loc = old.owner(gids), old.local(gids)
                for k in np.unique(own):
                    sel = own == k
                    dst[lo:hi][sel] = olds[k].store.data[loc[sel]]
            st = st._replace(count=int(man["count"]))
            dsa_core.flush(st)
            meta = dict(meta0, rank=j, world_size=new.world_size, plan=new.to_json(),
                        local_rows=n_j)
            _write_json(root / f"rank{j}" / SHARD_FILE, meta)
        finally:
            dsa_core.close(st)
        if progress:
            print(f"rank{j}: {n_j} rows", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m adapters.torch_reshard",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a complete sharded checkpoint (holds dsa-sharded.json)")
    ap.add_argument("dest", help="new directory for the resharded checkpoint")
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--plan", choices=("mod", "range"), default="mod")
    a = ap.parse_args(argv)
    try:
        out = reshard(a.src, a.dest, a.world_size, a.plan, progress=True)
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise SystemExit(f"torch_reshard: {exc}") from None
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
