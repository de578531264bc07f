"""The random-order torch loop out of core: ``DiskEmbedding`` with the defaults, LINE loss.

    python -m benchmarks.random_loop --rows 4000000 --cap 2G --seconds 60
    python -m benchmarks.random_loop --rows 8000000 --cap 2G --seconds 120   # issue 44's run
    python -m benchmarks.random_loop --smoke
    python benchmarks/random_loop.py --lib /path/to/old/checkout ...   # an older commit's code

What every user without an edge list meets: a ``DiskEmbedding(rows, dim, state_dir=...)``
with the defaults (``storage="auto"``, the default memory budget) stepped by
``DiskSparseAdam(emb.parameters())``, batches of ``--batch`` uniform random edges (source,
destination) with ``--negatives`` uniform negatives each, the LINE (skip-gram) loss
``softplus(-u.v) + sum softplus(u.n)``, and ``emb.prefetch`` of the next batch's ids before
each step. Two children, ``create`` builds the store and writes every record back once (the table after an epoch: a log store's
never-written rows are computed from the seed and read nothing from disk; ``--fresh``
skips this), outside any cgroup
(``storage="auto"`` then follows the machine's memory: an in-place store for a table that
fits in RAM; ``--create-capped`` builds it under the cap too, which gives a log store;
``--storage`` forces a kind); ``train``, inside a memory cgroup of ``--cap``
(``benchmarks/memcap.sh``; without a writable cgroup the run is refused unless
``--no-cgroup``), reopens it (``resume=True``), runs
``--warmup`` steps, then steps for ``--seconds``, then closes (the final flush is timed
apart). Before ``train`` the store's files are evicted from the page cache and the disk is
left to go quiet.

Per run: edges/s; rows touched per edge (distinct ids per batch / edges); read I/Os and
bytes per edge and per row touched (``/proc/diskstats`` of the store's disk, system-wide:
run on a quiet machine); the child's major page faults (``getrusage``) per row touched; the
cgroup's peak (memcap's line). The script itself uses only the adapters' public API that
existed on 2026-12-02 (c9744fb), so ``--lib`` can point it at a worktree of an older commit
for a back-to-back A/B. Writes ``benchmarks/results/random_loop[_smoke].json`` (not with
``--lib``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MEMCAP = HERE / "memcap.sh"


def _disk_of(path: Path) -> str | None:
    """The whole-disk name in /proc/diskstats that holds ``path``."""
    dev = os.stat(path).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None
    real = sys_dev.resolve()
    if (real / "partition").exists():
        real = real.parent
    return real.name


def _diskstats(disk: str | None) -> list[int] | None:
    """``disk``'s counters in /proc/diskstats (reads completed first), None if not there."""
    if disk is None:
        return None
    for ln in Path("/proc/diskstats").read_text().splitlines():
        f = ln.split()
        if f[2] == disk:
            return [int(x) for x in f[3:]]
    return None


def _disk_reads(disk: str | None) -> tuple[int, int]:
    """(read I/Os completed, bytes read) of ``disk`` so far."""
    f = _diskstats(disk)
    return (0, 0) if f is None else (f[0], f[2] * 512)


def _disk_written(disk: str | None) -> int:
    """Bytes written to ``disk`` so far (sectors written x 512)."""
    f = _diskstats(disk)
    return 0 if f is None else f[6] * 512


def _evict(path: Path) -> None:
    for p in path.rglob("*"):
        if p.is_file():
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _wait_quiet(disk: str | None, window: float = 2.0, most: float = 60.0) -> None:
    """Until the disk reads and writes (almost) nothing for ``window`` seconds."""
    if disk is None:
        return
    t0 = time.time()

    def ios():
        for ln in Path("/proc/diskstats").read_text().splitlines():
            f = ln.split()
            if f[2] == disk:
                return int(f[3]) + int(f[7])
        return 0
    while time.time() - t0 < most:
        a = ios()
        time.sleep(window)
        if ios() - a < 20 * window:
            return


def child(a) -> dict:
    if a.lib:
        sys.path.insert(0, a.lib)
    import numpy as np
    import torch
    from torch.nn.functional import softplus

    from adapters.torch import DiskEmbedding, DiskSparseAdam

    torch.set_num_threads(a.threads)
    path = Path(a.dir) / "emb"
    if a.phase == "create":
        t0 = time.perf_counter()
        kw = {} if a.storage == "auto" else {"storage": a.storage}
        emb = DiskEmbedding(a.rows, a.dim, state_dir=path, seed=0, **kw)
        emb.close()
        out = {"create_s": time.perf_counter() - t0}
        if not a.fresh:  # every record written once, in row order: the table after an epoch
            import dsa_core
            t0 = time.perf_counter()
            st = dsa_core.open(path, mode="r+")
            step = max(1, (64 << 20) // (a.dim * 4 * 3))
            for lo in range(0, a.rows, step):
                ids = np.arange(lo, min(a.rows, lo + step), dtype=np.int64)
                dsa_core.write_records(st, ids, dsa_core.read_records(st, ids))
            dsa_core.flush(st)
            dsa_core.close(st)
            out["write_all_s"] = time.perf_counter() - t0
        return out
    emb = DiskEmbedding(a.rows, a.dim, state_dir=path, resume=True)
    opt = DiskSparseAdam(emb.parameters(), lr=1e-3)
    store = getattr(emb, "store", None)
    kind = (getattr(store, "storage", None) or type(getattr(store, "store", None)).__module__
            .rsplit(".", 2)[-2].strip("_"))
    rng = np.random.default_rng(a.seed)
    B, K, N = a.batch, a.negatives, a.rows

    def draw():
        return torch.from_numpy(rng.integers(0, N, size=B * (2 + K), dtype=np.int64))

    phase_s = {"prefetch": 0.0, "forward": 0.0, "backward": 0.0, "step": 0.0}

    def one(ids):
        t = time.perf_counter()
        u = emb(ids[:B])
        v = emb(ids[B:2 * B])
        n = emb(ids[2 * B:]).view(B, K, -1)
        loss = softplus(-(u * v).sum(-1)).mean() + softplus((u[:, None] * n).sum(-1)).mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        phase_s["forward"] += t1 - t
        phase_s["backward"] += t2 - t1
        phase_s["step"] += t3 - t2

    nxt = draw()
    for _ in range(a.warmup):
        ids, nxt = nxt, draw()
        emb.prefetch(nxt)
        one(ids)
    disk = _disk_of(path)
    r0, b0 = _disk_reads(disk)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    steps = touched = 0
    for k in phase_s:
        phase_s[k] = 0.0
    t0 = time.perf_counter()
    last = (t0, 0, r0, f0, 0, b0)
    while time.perf_counter() - t0 < a.seconds or steps < 2:
        ids, nxt = nxt, draw()
        tp = time.perf_counter()
        emb.prefetch(nxt)
        phase_s["prefetch"] += time.perf_counter() - tp
        one(ids)
        steps += 1
        touched += int(np.unique(ids.numpy()).size)
        now = time.perf_counter()
        if a.report_every and now - last[0] >= a.report_every:  # the rates of the last window
            (r, b), f = _disk_reads(disk), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            n = max(1, touched - last[4])
            print(f"  {now - t0:5.0f} s: {(steps - last[1]) * B / (now - last[0]):8,.0f} "
                  f"edges/s; per row touched {(r - last[2]) / n:.2f} read I/Os, "
                  f"{(b - last[5]) / n / 1e3:.2f} KB, {(f - last[3]) / n:.3f} major faults",
                  file=sys.stderr, flush=True)
            last = (now, steps, r, f, touched, b)
    dt = time.perf_counter() - t0
    r1, b1 = _disk_reads(disk)
    f1 = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    t1 = time.perf_counter()
    opt.close()
    emb.close()
    edges = steps * B
    return {"store": kind, "steps": steps, "seconds": dt, "edges_per_s": edges / dt,
            "rows_touched_per_edge": touched / edges,
            "read_ios_per_edge": (r1 - r0) / edges, "read_kb_per_edge": (b1 - b0) / edges / 1e3,
            "read_ios_per_row": (r1 - r0) / max(1, touched),
            "read_kb_per_row": (b1 - b0) / max(1, touched) / 1e3,
            "majflt": f1 - f0, "majflt_per_row": (f1 - f0) / max(1, touched),
            "close_s": time.perf_counter() - t1,
            "ms_per_step": {k: 1e3 * v / steps for k, v in phase_s.items()}}


def run_child(a, phase: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", phase,
           "--rows", str(a.rows), "--dim", str(a.dim), "--batch", str(a.batch),
           "--negatives", str(a.negatives), "--seconds", str(a.seconds),
           "--warmup", str(a.warmup), "--threads", str(a.threads), "--dir", str(a.dir),
           "--storage", a.storage, "--report-every", str(a.report_every),
           "--seed", str(a.seed)]
    if a.fresh:
        cmd.append("--fresh")
    if a.lib:
        cmd += ["--lib", a.lib]
    if not a.no_cgroup and (phase == "train" or a.create_capped):
        cmd = ["bash", str(MEMCAP), a.cap, *cmd]
    env = dict(os.environ)
    root = a.lib or str(HERE.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env=env, check=False)
    for ln in r.stderr.splitlines():
        if ln.startswith("  "):
            print(ln, flush=True)
    if r.returncode != 0:
        raise SystemExit(f"{phase} child failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    cap = [ln for ln in r.stderr.splitlines() if ln.startswith("memcap:")]
    out["memcap"] = cap[-1] if cap else ""
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4096, help="edges per step")
    ap.add_argument("--negatives", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1,
                    help="the batches' seed: another one per run on a kept log store (a log "
                    "store writes the rows it stepped together, so a replay of the same "
                    "batches reads fewer pages)")
    ap.add_argument("--name", default="random_loop",
                    help="the result file benchmarks/results/NAME.json")
    ap.add_argument("--report-every", type=float, default=0.0,
                    help="print the last window's rates every this many seconds")
    ap.add_argument("--cap", default="2G", help="the cgroup's memory limit")
    ap.add_argument("--no-cgroup", action="store_true", help="run uncapped (not out of core "
                    "unless the table is larger than RAM)")
    ap.add_argument("--storage", default="auto", choices=["auto", "inplace", "log"],
                    help="the store's kind (default: the adapter's default, auto)")
    ap.add_argument("--fresh", action="store_true", help="train a new store as created: a "
                    "log store then reads nothing from disk until rows were written back "
                    "(never-written rows are computed from the seed); default: every row "
                    "written once first, as after an epoch")
    ap.add_argument("--create-capped", action="store_true", help="build the store inside the "
                    "cgroup too (default: outside, as a user builds a table on a machine whose "
                    "RAM holds it, so auto gives an in-place store, then trains under a cap)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="reuse a store left in --dir")
    ap.add_argument("--lib", default=None, help="import dsa_core/adapters from this checkout")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.phase = a.child
        print(json.dumps(child(a)))
        return {}
    if a.smoke:
        a.rows, a.dim, a.batch, a.seconds, a.warmup, a.cap = 20_000, 8, 64, 0.5, 1, "512M"
    if not a.no_cgroup:
        r = subprocess.run(["bash", str(MEMCAP), "64M", "true"], capture_output=True,
                           check=False)
        if r.returncode != 0:
            if a.smoke:
                a.no_cgroup = True
            else:
                raise SystemExit("no writable memory cgroup here (benchmarks/memcap.sh needs "
                                 "root and cgroup v1 or v2); pass --no-cgroup to run uncapped")
    tmp = None
    if a.dir is None:
        tmp = tempfile.mkdtemp(prefix="dsa_random_loop_")
        a.dir = tmp
    Path(a.dir).mkdir(parents=True, exist_ok=True)
    try:
        res = {"rows": a.rows, "dim": a.dim, "batch": a.batch, "negatives": a.negatives,
               "cap": None if a.no_cgroup else a.cap, "lib": a.lib, "seed": a.seed}
        if not (a.keep and (Path(a.dir) / "emb").exists()):
            shutil.rmtree(Path(a.dir) / "emb", ignore_errors=True)
            res["create"] = run_child(a, "create")
        os.sync()  # written back first: dirty pages are not dropped by the eviction
        _evict(Path(a.dir))  # pages cached outside the cgroup would serve reads uncharged
        _wait_quiet(_disk_of(Path(a.dir)))
        res["train"] = t = run_child(a, "train")
        print(f"{t['store']} store, {t['steps']} steps in {t['seconds']:.0f} s: "
              f"{t['edges_per_s']:,.0f} edges/s; per row touched: {t['read_ios_per_row']:.2f} "
              f"read I/Os, {t['read_kb_per_row']:.1f} KB, {t['majflt_per_row']:.2f} major "
              f"faults; per edge: {t['read_ios_per_edge']:.2f} I/Os, "
              f"{t['read_kb_per_edge']:.1f} KB; close {t['close_s']:.1f} s; {t['memcap']}; "
              "ms per step: " + ", ".join(f"{k} {v:.0f}" for k, v in t["ms_per_step"].items()),
              flush=True)
        if not a.lib:
            out = HERE / "results" / f"{a.name}{'_smoke' if a.smoke else ''}.json"
            out.parent.mkdir(exist_ok=True)
            out.write_text(json.dumps(res, indent=1) + "\n")
        return res
    finally:
        if tmp is not None and not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
