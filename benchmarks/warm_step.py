"""The median warm ``dsa_core.step`` of one store kind and geometry, for A/B runs.

    python benchmarks/warm_step.py --repo OLD_TREE --storage inplace --curvature 0
    python -m benchmarks.warm_step --storage inplace --curvature 0

Creates a ``--rows`` x 128 float32 store (uniform init), steps it 300 times (pages touched,
the region filled), then times ``--steps`` steps of batch 2048 (uniform ids, 64 batches
cycled) and prints the median in ms. Alternate runs of two checkouts (``--repo``) so that
the shared machine's load hits both; compare medians.
"""
import argparse
import sys
import tempfile
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=None, help="import dsa_core from this tree")
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--storage", default="inplace", choices=("inplace", "log"))
    ap.add_argument("--curvature", type=float, default=0.0)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.steps = 5000, 20
    if a.repo:
        sys.path.insert(0, a.repo)
    import numpy as np

    import dsa_core

    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    B, D = 2048, 128
    ids = [rng.integers(0, a.rows, B) for _ in range(64)]
    g = rng.standard_normal((B, D), dtype=np.float32) * 1e-2
    with tempfile.TemporaryDirectory() as tmp:
        st = dsa_core.create(f"{tmp}/s", a.rows, D, curvature=a.curvature, init="uniform",
                             init_scale=1e-3, storage=a.storage, progress=False)
        for k in range(300):
            st = dsa_core.step(st, ids[k % 64], g)
        ts = []
        for k in range(a.steps):
            t0 = time.perf_counter()
            st = dsa_core.step(st, ids[k % 64], g)
            ts.append(time.perf_counter() - t0)
        dsa_core.close(st)
    p50 = 1e3 * float(np.median(ts))
    print(f"storage={a.storage} curvature={a.curvature:g} rows={a.rows} p50_ms={p50:.4f}")
    return p50


if __name__ == "__main__":
    main()
