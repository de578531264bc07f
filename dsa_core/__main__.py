"""Command line: ``python -m dsa_core`` or ``dsa``.

    dsa info   STORE              shape, dtype, curvature, count, hyperparameters, size, format
    dsa export STORE OUT.npy      the weights as a .npy file, written in chunks
    dsa verify STORE              header, finite values, rows inside the ball (c > 0)
    dsa bench  [--rows N]         a quick warm benchmark of this machine

``info``, ``export`` and ``verify`` open the store read-only (no lock), so they can run while
a training process writes to it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHUNK_BYTES = 1 << 26


def _open(path):
    import dsa_core

    try:
        return dsa_core.open(path, mode="r")
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"dsa: {exc}") from None


def _chunks(n, row_bytes):
    rows = max(1, CHUNK_BYTES // max(1, row_bytes))
    for lo in range(0, n, rows):
        yield lo, min(n, lo + rows)


def _bar(total, desc, enabled=True):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="row", unit_scale=True, disable=not enabled)


def cmd_info(a) -> int:
    st = _open(a.store)
    from dsa_core import _format

    size = sum(p.stat().st_size for p in Path(a.store).iterdir() if p.is_file())
    info = {
        "path": str(st.path), "num_rows": st.num_rows, "dim": st.dim, "dtype": st.dtype.name,
        "curvature": st.curvature,
        "geometry": "poincare ball" if st.curvature > 0 else (
            "euclidean (SparseAdam)" if st.second_moment == "elementwise"
            else "euclidean (row-wise second moment)"),
        "second_moment": st.second_moment,
        "weights": st.has_weights, "count": st.count, "lr": st.lr, "betas": list(st.betas),
        "eps": st.eps, "maximize": st.maximize, "ball_eps": st.ball_eps,
        "nonfinite": st.nonfinite, "durability": st.durability,
        "record_bytes": st.store.stride * st.dtype.itemsize,
        "size_on_disk_bytes": size, "format_version": _format.layout_version(st.store.layout),
    }
    if a.json:
        print(json.dumps(info, indent=1))
    else:
        for k, v in info.items():
            if k == "size_on_disk_bytes":
                v = f"{v:,} ({v / 2**30:.2f} GiB)"
            print(f"{k:>18}: {v}")
    return 0


def cmd_export(a) -> int:
    st = _open(a.store)
    if not st.has_weights:
        raise SystemExit(f"dsa: store {a.store!r} holds no weights (created with weights=False)")
    out = Path(a.out)
    if out.exists() and not a.force:
        raise SystemExit(f"dsa: {str(out)!r} exists; pass --force to overwrite it")
    dst = np.lib.format.open_memmap(out, mode="w+", dtype=st.dtype, shape=(st.num_rows, st.dim))
    w = st.weights
    with _bar(st.num_rows, "export", not a.quiet) as bar:
        for lo, hi in _chunks(st.num_rows, st.dim * st.dtype.itemsize):
            dst[lo:hi] = w[lo:hi]
            bar.update(hi - lo)
    dst.flush()
    del dst
    print(f"wrote {out} ({st.num_rows} x {st.dim} {st.dtype.name}, count {st.count})")
    return 0


def cmd_verify(a) -> int:
    st = _open(a.store)
    problems = []
    bad_rows = 0
    outside = 0
    c = st.curvature
    data = st.store.data
    with _bar(st.num_rows, "verify", not a.quiet) as bar:
        for lo, hi in _chunks(st.num_rows, st.store.stride * st.dtype.itemsize):
            blk = np.asarray(data[lo:hi])
            fin = np.isfinite(blk).all(axis=1)
            bad_rows += int((~fin).sum())
            if c > 0 and st.has_weights:
                o = st.store.w_off
                w = blk[:, o:o + st.dim].astype(np.float64)
                sq = np.einsum("ij,ij->i", w, w)
                outside += int((sq * c >= 1.0).sum())
            bar.update(hi - lo)
    if bad_rows:
        problems.append(f"{bad_rows} rows hold NaN or Inf (weights or optimizer state)")
    if outside:
        problems.append(f"{outside} rows lie on or outside the Poincaré ball "
                        f"(norm >= 1/sqrt(c) = {1 / math.sqrt(c):.6g})")
    from dsa_core import _format

    version = _format.read_manifest(st.path)["version"]
    print(f"{st.path}: header and size ok, format v{version}, count {st.count}")
    for p in problems:
        print(f"  PROBLEM: {p}")
    if not problems:
        print("  ok: all values finite" + (", all rows inside the ball" if c > 0 else ""))
    return 1 if problems else 0


def cmd_bench(a) -> int:
    import dsa_core

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        st = dsa_core.create(Path(tmp) / "bench", a.rows, a.dim, curvature=a.curvature,
                             init="uniform", init_scale=1e-3, progress=False)
        ids = [rng.integers(0, a.rows, a.batch) for _ in range(a.steps + 10)]
        g = rng.standard_normal((a.batch, a.dim), dtype=np.float32)
        ts = []
        for k, idx in enumerate(ids):
            t0 = time.perf_counter()
            st = dsa_core.step(st, idx, g)
            if k >= 10:
                ts.append(time.perf_counter() - t0)
        dsa_core.close(st)
    med = float(np.median(ts))
    geo = "poincare" if a.curvature > 0 else "euclid"
    print(f"dsa_core {geo}: {a.rows:,} x {a.dim}, batch {a.batch}: {a.batch / med:,.0f} rows/s "
          f"(p50 {med * 1e3:.2f} ms, p99 {np.percentile(ts, 99) * 1e3:.2f} ms)")
    try:
        import torch
    except ImportError:
        return 0
    if a.curvature == 0:
        p = torch.nn.Parameter(torch.zeros(a.rows, a.dim))
        opt = torch.optim.SparseAdam([p], lr=1e-3)
        gt = torch.from_numpy(g)
        ts = []
        for k, idx in enumerate(ids):
            p.grad = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], gt, p.shape,
                                             check_invariants=False)
            t0 = time.perf_counter()
            opt.step()
            if k >= 10:
                ts.append(time.perf_counter() - t0)
        tmed = float(np.median(ts))
        print(f"torch.optim.SparseAdam, same batches: {a.batch / tmed:,.0f} rows/s "
              f"-> dsa_core is {tmed / med:.1f}x")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsa", description="Inspect and benchmark DSA stores.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("info", help="shape, dtype, curvature, count, hyperparameters, size")
    p.add_argument("store")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_info)
    p = sub.add_parser("export", help="write the weights to a .npy file (chunked)")
    p.add_argument("store")
    p.add_argument("out")
    p.add_argument("--force", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_export)
    p = sub.add_parser("verify", help="check finiteness and (c > 0) that rows are in the ball")
    p.add_argument("store")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_verify)
    p = sub.add_parser("bench", help="a quick warm benchmark of this machine")
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--curvature", type=float, default=0.0)
    p.add_argument("--workdir", default=None)
    p.set_defaults(fn=cmd_bench)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
