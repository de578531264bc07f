"""Small A/B probes of ``dsa_core.step`` for any checkout (issue 44's split of the step's time).

    python -m benchmarks.step_ab warm --tree TREE [--ids cycled|new]   # in place, 1M x 128
    python -m benchmarks.step_ab warm --storage log --curvature 1 --rows 500000 \
        --warmup 300 --steps 2000 --no-predirty                        # 11-30's A/B runs
    python -m benchmarks.step_ab split                                 # the warm step's phases
    python -m benchmarks.step_ab log --tree TREE [--cache-mib 32]      # log store, 25% region

``warm``: a ``--rows`` x 128 float32 store of kind ``--storage`` (default in place, with the
defaults: huge pages where the table fits) and curvature ``--curvature``, every page of an
in-place table dirtied first (``--no-predirty``: not), ``--warmup`` steps (50), then the
median of ``--steps`` steps (1,000) of 2048 uniform ids: ``--ids cycled`` (64 batches
cycled, as the guard's ``warm``: after the first pass every row was already changed since the
last flush) or ``new`` (a new batch every step: most rows are first changes, which the
in-place store's undo file saves before they change). The warm-step A/B runs of 2026-11-30
(docs/notebook.md) used ``--rows 500000 --warmup 300 --steps 2000 --no-predirty``.

``split``: the same store held in RAM (``access="ram"``), the median ms of each phase of a
step (``plan_step``, ``begin_step``, ``run_step``, ``commit_step``, the new State) and of the
Adam kernel alone on the pool and on one thread, beside the guard's memory-limit probe.

``log``: a log store of ``--rows`` x 128 whose region is ``--share`` of the state, stepped
``--warm`` times (every row sealed about once: the state of a long run), then the mean of
600 steps; ``--cache-mib`` caps the page-cache window of written segments (an A/B of
``segments.CACHE_MAX``). ``--tree`` imports ``dsa_core`` from that checkout; alternate runs of
two checkouts so that the shared machine's load hits both, and compare. ``--smoke`` runs all
three at tiny sizes (the test suite's check that the code runs).
"""

from __future__ import annotations

import argparse
import inspect
import sys
import tempfile
import time


def _median_ms(fn, n: int) -> float:
    import numpy as np

    ts = []
    for k in range(n):
        t0 = time.perf_counter()
        fn(k)
        ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))


def warm(a) -> None:
    import numpy as np

    import dsa_core

    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    b, d = 2048, 128
    nb = 64 if a.ids == "cycled" else 1100
    ids = [rng.integers(0, a.rows, b) for _ in range(nb)]
    g = rng.standard_normal((b, d), dtype=np.float32) * 1e-2
    kw = {"storage": a.storage} if "storage" in inspect.signature(dsa_core.create).parameters \
        else {}
    if a.curvature:
        kw["curvature"] = a.curvature
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        st = dsa_core.create(f"{tmp}/s", a.rows, d, init="uniform", init_scale=1e-3,
                             progress=False, **kw)
        if a.predirty and a.storage == "inplace":
            data = st.store.data
            chunk = max(1, (1 << 26) // data[0].nbytes)
            for lo in range(0, data.shape[0], chunk):  # every page dirtied, values unchanged
                blk = data[lo:lo + chunk].view(np.uint8)
                blk |= 0
            del data, blk
        for k in range(a.warmup):
            st = dsa_core.step(st, ids[k % nb], g)
        box = [st]

        def one(k):
            box[0] = dsa_core.step(box[0], ids[(a.warmup + k) % nb], g)

        p50 = _median_ms(one, a.steps)
        dsa_core.close(box[0])
    print(f"warm tree={a.tree or '.'} storage={a.storage} curvature={a.curvature:g} "
          f"ids={a.ids} rows={a.rows} p50_ms={p50:.3f}")


def split(a) -> None:
    import numpy as np

    import dsa_core
    from dsa_core import _pool, _step
    from dsa_core._intrinsics import NO_OPTIONS
    from dsa_core._kernels_euclid import adam_rows_euclid, euclid_hparams

    from .probes import memory_probe_kernel, memory_probe_kernel_one

    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    b, d = 2048, 128
    ids = [rng.integers(0, a.rows, b) for _ in range(64)]
    g = rng.standard_normal((b, d), dtype=np.float32) * 1e-2
    out = {}
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        st = dsa_core.create(f"{tmp}/s", a.rows, d, init="uniform", init_scale=1e-3,
                             storage="inplace", access="ram", progress=False)
        for k in range(300):
            st = dsa_core.step(st, ids[k % 64], g)
        phases = {k: [] for k in ("plan", "begin", "run", "commit", "state", "step")}
        for k in range(300 + a.steps):
            c = time.perf_counter
            t0 = c()
            plan = _step.plan_step(st, ids[k % 64], g)
            t1 = c()
            _step.begin_step(plan)
            t2 = c()
            _step.run_step(plan)
            t3 = c()
            _step.commit_step(plan)
            t4 = c()
            st = st._replace(count=plan.t)
            t5 = c()
            if k >= 300:
                for key, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4,
                                           t5 - t0), strict=True):
                    phases[key].append(v)
        out.update({k: 1e3 * float(np.median(v)) for k, v in phases.items()})
        s = st.store
        data, lay = s.data, s.layout
        hp = euclid_hparams(np.dtype(np.float32), lr=1e-3, betas=(0.9, 0.999), bc1=0.5,
                            bc2=0.5, eps=1e-8, maximize=False, weight_decay=0.0)
        uq = [np.unique(i) for i in ids]
        chunk = _step._min_chunk(d)

        def args(u):
            return (data, u, lay.w_off, data, u, lay.m_off, lay.v_off, g, hp, False, NO_OPTIONS)

        out["kernel_pool"] = _median_ms(lambda k: _pool.run_chunked(
            adam_rows_euclid, args(uq[k % 64]), uq[k % 64].shape[0], chunk), a.steps)
        out["kernel_one"] = _median_ms(lambda k: adam_rows_euclid(
            *args(uq[k % 64]), 0, uq[k % 64].shape[0]), a.steps)
        del data
        dsa_core.close(st)
    table = np.ones((a.rows, 3 * d), np.float32)
    c = np.float32(1e-7)
    for k in range(50):
        memory_probe_kernel(table, ids[k % 64], c)
        memory_probe_kernel_one(table, ids[k % 64], c)
    out["probe_parallel"] = _median_ms(lambda k: memory_probe_kernel(table, ids[k % 64], c),
                                       a.steps)
    out["probe_one"] = _median_ms(lambda k: memory_probe_kernel_one(table, ids[k % 64], c),
                                  a.steps)
    print("split (ms per batch of 2048): " + ", ".join(f"{k} {v:.3f}" for k, v in out.items()))


def log(a) -> None:  # noqa: A001 - the subcommand's name
    import numpy as np

    import dsa_core

    if a.cache_mib >= 0:
        from dsa_core._log import segments

        segments.CACHE_MAX = int(a.cache_mib * (1 << 20))
    dsa_core.warmup(("float32",))
    rng = np.random.default_rng(0)
    b, d = 2048, 128
    g = rng.standard_normal((b, d), dtype=np.float32) * 1e-2
    mem = int(a.rows * 3 * d * 4 * a.share)
    with tempfile.TemporaryDirectory(dir=a.workdir) as tmp:
        st = dsa_core.create(f"{tmp}/s", a.rows, d, init="uniform", init_scale=1e-3,
                             storage="log", memory=mem, progress=False)
        for _ in range(a.warm):
            st = dsa_core.step(st, rng.integers(0, a.rows, b), g)
        ts = []
        for _ in range(a.steps if a.smoke else 600):
            i = rng.integers(0, a.rows, b)
            t0 = time.perf_counter()
            st = dsa_core.step(st, i, g)
            ts.append(time.perf_counter() - t0)
        dsa_core.close(st)
    ts = 1e3 * np.array(ts)
    print(f"log tree={a.tree or '.'} share={a.share:g} cache_mib={a.cache_mib:g} "
          f"p50_ms={np.median(ts):.2f} mean_ms={ts.mean():.2f} "
          f"rows_per_s={b / ts.mean() * 1e3:,.0f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", nargs="?", choices=("warm", "split", "log"))
    ap.add_argument("--tree", default=None, help="import dsa_core from this checkout")
    ap.add_argument("--rows", type=int, default=None, help="1M (warm, split), 2M (log)")
    ap.add_argument("--ids", choices=("cycled", "new"), default="cycled")
    ap.add_argument("--share", type=float, default=0.25)
    ap.add_argument("--warm", type=int, default=1500)
    ap.add_argument("--cache-mib", type=float, default=-1.0)
    ap.add_argument("--storage", choices=("inplace", "log"), default="inplace", help="warm")
    ap.add_argument("--curvature", type=float, default=0.0, help="warm")
    ap.add_argument("--warmup", type=int, default=50, help="warm: steps before the timed ones")
    ap.add_argument("--steps", type=int, default=1000, help="warm, split: timed steps")
    ap.add_argument("--no-predirty", dest="predirty", action="store_false",
                    help="warm: do not dirty every page of an in-place table first")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true", help="all three, tiny sizes")
    a = ap.parse_args(argv)
    if a.smoke:
        for what, rows in (("warm", 5000), ("split", 5000), ("log", 40_000)):
            a.what, a.rows, a.warm, a.steps, a.warmup = what, rows, 20, 20, 5
            {"warm": warm, "split": split, "log": log}[what](a)
        return
    if a.what is None:
        ap.error("say what to measure: warm, split or log (or --smoke)")
    if a.rows is None:
        a.rows = 2_000_000 if a.what == "log" else 1_000_000
    if a.tree:
        sys.path.insert(0, a.tree)
    {"warm": warm, "split": split, "log": log}[a.what](a)


if __name__ == "__main__":
    main()
