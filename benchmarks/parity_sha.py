"""The parity matrix as hashes: a restructuring must leave every store's bytes as they were.

    python benchmarks/parity_sha.py --repo OLD_TREE --out old.json   # e.g. a git worktree
    python benchmarks/parity_sha.py --out new.json --compare old.json

Trains 228 store configurations (kind x geometry x durability x how the weights are passed x
options x dtype) from the same init arrays and batches, with flushes, and records the sha256
of every store's records (read with ``dsa_core.read_records``) plus the caller's weights, and
of the in-place data file. ``--compare`` prints how many differ.
"""
import argparse
import hashlib
import itertools
import json
import sys
import tempfile
from pathlib import Path

def main(argv=None):
    ap = argparse.ArgumentParser(description="parity matrix as hashes")
    ap.add_argument("--repo", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", default=None)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.repo:
        sys.path.insert(0, a.repo)
    import numpy as np

    import dsa_core

    N, D, STEPS = 3000, 16, 40
    res = {}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for k, (storage, c, dur, wmode, opt, dt) in enumerate(itertools.product(
                ("inplace", "log"), (0.0, 0.5), ("flush", "step"), ("w", "params", "table"),
                ("plain", "wd", "adamw", "perrow", "rowwise", "bf16"), ("float32", "float64"))):
            if a.smoke and k % 24:
                continue
            if c > 0 and opt in ("rowwise", "bf16"):
                continue
            if opt == "bf16" and dt == "float64":
                continue
            kw = {}
            if opt == "wd": kw = dict(weight_decay=0.01)
            if opt == "adamw": kw = dict(weight_decay=0.01, decoupled_weight_decay=True, decay_missed_steps=True)
            if opt == "perrow": kw = dict(per_row_step=True)
            if opt == "rowwise": kw = dict(second_moment="rowwise")
            if opt == "bf16": kw = dict(first_moment="bfloat16")
            rng = np.random.default_rng(k)
            init = (rng.uniform(-0.1, 0.1, (N, D))).astype(dt)
            # a region of 200 slots of the widest record (3 x D float64 + 2 counters), its
            # index and buffers (memory= pays for them all)
            mem = {"memory": dsa_core.region_memory(
                {"num_rows": N, "stride": 3 * D + 2, "dtype": "float64"}, 200)} \
                if storage == "log" else {}
            s = dsa_core.create(f"{tmp}/s{k}", N, D, curvature=c, dtype=dt, durability=dur,
                                weights=(wmode == "w"), init=init if wmode == "w" else None,
                                storage=storage, **mem, **kw)
            table = init.copy()
            for t in range(STEPS):
                idx = rng.integers(0, N, 150)
                g = rng.standard_normal((150, D)).astype(dt)
                if wmode == "w":
                    s = dsa_core.step(s, idx, g, lr=1e-2)
                elif wmode == "table":
                    s = dsa_core.step(s, idx, g, lr=1e-2, table=table)
                else:
                    p = table[idx].copy()
                    s = dsa_core.step(s, idx, g, lr=1e-2, params=p)
                    table[idx] = p
                if t % 13 == 12:
                    dsa_core.flush(s)
            rec = dsa_core.read_records(s, np.arange(N))
            h = hashlib.sha256(rec.tobytes() + table.tobytes()).hexdigest()
            dsa_core.close(s)
            files = ""
            if storage == "inplace":
                files = hashlib.sha256(Path(f"{tmp}/s{k}/rows.dsa").read_bytes()).hexdigest()
            res[f"{storage}/{c}/{dur}/{wmode}/{opt}/{dt}"] = [h, files]
    print(len(res), "configurations")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=0)
    if a.compare:
        with open(a.compare) as f:
            old = json.load(f)
        recs = [k for k in res if old.get(k, [None])[0] != res[k][0]]
        files = [k for k in res if res[k][1] and old.get(k, [None, None])[1] != res[k][1]]
        print(f"records differ: {len(recs)} {recs[:8]}; in-place files differ: {len(files)} "
              f"{files[:8]}")
    return res


if __name__ == "__main__":
    main()
