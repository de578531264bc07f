"""End-to-end torch benchmark: forward + backward + step of an embedding table on CPU.

    python -m benchmarks.torch_e2e --smoke                 # seconds, tiny sizes
    python -m benchmarks.torch_e2e --rows 1000000 --steps 200
    python -m benchmarks.torch_e2e --rows 10000000 --dir /mnt/nvme/tmp
    python -m benchmarks.torch_e2e --device cuda --rows 1000000   # table on the GPU
    python -m benchmarks.torch_e2e --smoke --impls torch,diskemb --compile   # torch.compile

Implementations, each in its own child process (so memory readings are its own), on the
same batches of ids (seeded) and the same loss, ``mean((emb(ids) - target)**2)``:

- ``torch``: ``nn.Embedding(rows, dim, sparse=True)`` + ``torch.optim.SparseAdam``. Its
  moments are pre-touched after the first step (``zeros_like`` pages are mapped lazily; a
  long run touches them all), so its memory is what a trained table holds.
- ``dsa``: the same ``nn.Embedding`` + ``adapters.torch.DiskSparseAdam`` (m and v on disk).
- ``diskemb``: ``adapters.torch.DiskEmbedding`` (weights, m and v on disk) +
  ``DiskSparseAdam``.
- ``dsaauto``: ``dsa`` with the adapter's default ``storage="auto"`` and default budget
  (what a user gets without choosing; ``store`` says which kind that was).
- ``dsalog`` / ``diskemblog``: ``dsa`` / ``diskemb`` on log-structured stores
  (``storage="log"``), once per ``--log-shares`` value: the region's budget ``memory`` is that
  share of the state's bytes (rows x record bytes; the region's slots also pay ~42 bytes of
  bookkeeping each, so a share of 1.0 holds ~96% of the rows). Labelled ``dsalog@100%``...
  ``close_s`` is the final ``close`` (the flush that seals the region out), not in rows/s.
  Their regions are pre-touched before the timed steps, as torch's moments are (a long run
  touches them all: a region fills one slot after another, and each first touch of its
  memory is a page fault); ``--fill`` leaves them untouched, to measure the filling phase.

Rows/s counts the batch's ids (duplicates included) per second of a whole training step
(forward, backward, optimizer step, zero_grad). Memory: RssAnon / RssFile of the child
(``/proc/self/status``), ``*_peak`` the largest value sampled after each step, ``*_delta``
relative to the child before the table was built. ``opt_p50_ms`` is the optimizer step
alone (synchronised on CUDA), ``fwdbwd_p99_ms`` the 99th percentile of the rest of the
step (forward, backward, ``zero_grad``). ``written_pages_per_step``: pages the kernel wrote back
(``/proc/vmstat nr_written``, system-wide) per timed step -- on a quiet machine, the
writeback that a store larger than the dirty limits causes. ``--second-moment rowwise``
builds the DSA rows with the row-wise second moment (docs/algorithms.md §7.3; not
SparseAdam's update), ``--first-moment bfloat16`` with m stored as bfloat16
(docs/algorithms.md §6). With ``--device cuda`` the
table and the ids live on the GPU (ids copied from pinned memory, as a ``pin_memory`` data
loader does) and ``xfer_ms`` is the bare cost of the step's transfers: the coalesced
gradient (ids + rows) to pinned host memory and the new rows back, timed alone.
``--omp-wait-policy passive`` starts the workers with ``OMP_WAIT_POLICY=PASSIVE`` (torch's
idle OpenMP threads then sleep instead of spinning; the column says which each ran with).
``--compile`` runs the forward and the loss through ``torch.compile`` (default backend; a
``DiskEmbedding``'s gather is a graph break) and labels the rows ``impl+compile``; the
compilation falls in the warm-up steps (give at least one). Writes
``benchmarks/results/torch_e2e[_smoke|_cuda].{json,csv}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from ._common import (batches, machine, mem, pages_written, predirty, print_table,
                      rewrite_rows, write_results)

IMPLS = ("torch", "dsa", "diskemb", "dsalog", "diskemblog", "dsaauto")
LR = 1e-3
MB = 2**20


def _worker(args) -> dict:
    import torch

    import dsa_core
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    torch.manual_seed(0)
    dsa_core.warmup(("float32",))
    if args.pace_mib >= 0:  # an A/B of the log store's segment writer (writer.PACE_BYTES)
        from dsa_core._log import writer as _log_writer

        _log_writer.PACE_BYTES = int(args.pace_mib * (1 << 20))
    if args.cache_mib >= 0:  # an A/B of the window of written segments kept in the page cache
        from dsa_core._log import segments as _log_segments

        _log_segments.CACHE_MAX = int(args.cache_mib * (1 << 20))
    items = batches(args.rows, args.batch, args.warmup + args.steps, args.dist, seed=1)
    dev = torch.device(args.device)
    target = torch.randn(args.dim).to(dev)
    root = tempfile.mkdtemp(prefix="torch_e2e_", dir=args.dir)
    base = mem()
    t0 = time.perf_counter()
    log = args.worker.endswith("log")
    # the state's bytes: w, m, v (DiskEmbedding) or m, v (DiskSparseAdam), float32
    rec = (3 if args.worker.startswith("diskemb") else 2) * args.dim * 4
    store_kw = {"storage": "log", "memory": int(args.log_share * args.rows * rec)} if log \
        else {} if args.worker == "dsaauto" else {"storage": "inplace"}
    try:
        if args.worker.startswith("diskemb"):
            emb = DiskEmbedding(args.rows, args.dim, state_dir=f"{root}/emb", init="uniform",
                                init_scale=1e-3, seed=0,
                                second_moment=args.second_moment,
                                first_moment=args.first_moment, **store_kw).to(dev)
            opt = DiskSparseAdam(emb.parameters(), lr=LR)
        else:
            emb = torch.nn.Embedding(args.rows, args.dim, sparse=True)
            with torch.no_grad():
                emb.weight.uniform_(-1e-3, 1e-3)
            emb = emb.to(dev)
            if args.worker == "torch":
                opt = torch.optim.SparseAdam(emb.parameters(), lr=LR)
            else:
                opt = DiskSparseAdam(emb.parameters(), lr=LR, state_dir=f"{root}/opt",
                                     second_moment=args.second_moment,
                                     first_moment=args.first_moment, **store_kw)
        build_s = time.perf_counter() - t0
        if args.written and args.worker != "torch":  # the table after an epoch: a new log
            for st in opt.stores.values():  # store computes a never-written row from its seed
                rewrite_rows(st, chunk_rows=1 << 15)  # and reads nothing back for it
                dsa_core.flush(st)
        if args.worker != "torch" and not args.fill:  # a long run's steady state: every
            for st in opt.stores.values():                 # log region page touched
                if st.storage == "log":
                    _populate(st.store._pool.region)
        if args.predirty and args.worker in ("dsa", "diskemb"):  # the steady state of a long run
            for st in opt.stores.values():
                predirty(st)

        cuda = dev.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        opt_times = []

        def loss_of(ids):
            return ((emb(ids) - target) ** 2).mean()

        if args.compile:
            loss_of = torch.compile(loss_of)

        def step(ids):
            ids = torch.from_numpy(ids)
            if cuda:
                ids = ids.pin_memory().to(dev, non_blocking=True)
            loss_of(ids).backward()
            sync()
            t = time.perf_counter()
            opt.step()
            sync()
            opt_times.append(time.perf_counter() - t)
            opt.zero_grad()

        times, peak = [], dict(base)
        written0 = pages_written()
        for k, ids in enumerate(items):
            if k == args.warmup:
                written0 = pages_written()
            t = time.perf_counter()
            step(ids)
            sync()
            dt = time.perf_counter() - t
            if k == 0 and args.worker == "torch":
                st = opt.state[emb.weight]
                st["exp_avg"].add_(0)  # pre-touch (see module docstring)
                st["exp_avg_sq"].add_(0)
            if k >= args.warmup:
                times.append(dt)
            now = mem()
            peak = {key: max(peak[key], now[key]) for key in peak}
        end = mem()
        written = pages_written() - written0
        kind = "" if args.worker == "torch" else \
            next(iter(opt.stores.values())).storage
        t_close = time.perf_counter()
        if args.worker != "torch":
            opt.close()
        if args.worker.startswith("diskemb"):
            emb.close()
        close_s = time.perf_counter() - t_close
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ts = np.asarray(times)
    rest = ts - np.asarray(opt_times[args.warmup:])  # forward, backward, zero_grad
    extra = {"opt_p50_ms": 1e3 * float(np.median(opt_times[args.warmup:])),
             "fwdbwd_p99_ms": 1e3 * float(np.percentile(rest, 99)),
             "written_pages_per_step": written / max(1, len(ts)),
             "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "").lower() or "-",
             "second_moment": "elementwise" if args.worker == "torch" else args.second_moment,
             "first_moment": "full" if args.worker == "torch" else args.first_moment}
    if dev.type == "cuda":
        extra["xfer_ms"] = _transfer_ms(torch, dev, args.batch, args.dim)
        extra["gpu"] = torch.cuda.get_device_name(dev)
        extra["gpu_peak_mb"] = torch.cuda.max_memory_allocated(dev) / MB
    return {
        "impl": (f"{args.worker}@{args.log_share:.0%}" if log else args.worker)
        + ("+compile" if args.compile else ""),
        "store": kind, "rows": args.rows, "dim": args.dim, "batch": args.batch,
        "close_s": close_s,
        "steps": args.steps, "dist": args.dist,
        "rows_per_s": args.batch * len(ts) / ts.sum(),
        "p50_ms": 1e3 * float(np.percentile(ts, 50)),
        "p99_ms": 1e3 * float(np.percentile(ts, 99)),
        "build_s": build_s,
        "anon_delta_peak_mb": (peak["RssAnon"] - base["RssAnon"]) / MB,
        "anon_peak_mb": peak["RssAnon"] / MB,
        "file_peak_mb": peak["RssFile"] / MB,
        "anon_end_mb": end["RssAnon"] / MB,
        "file_end_mb": end["RssFile"] / MB,
        **extra,
    }


def _populate(arr) -> None:
    """Fault every page of an anonymous array in without changing it (MADV_POPULATE_WRITE,
    Linux 5.14+; elsewhere a write of its own zeros to one element per page)."""
    import ctypes

    addr, n = arr.__array_interface__["data"][0], arr.nbytes
    a = addr & ~4095
    if ctypes.CDLL(None).madvise(ctypes.c_void_p(a), ctypes.c_size_t(addr + n - a), 23) != 0:
        flat = arr.reshape(-1)
        flat[::4096 // arr.itemsize] = 0  # a fresh region is all zeros: nothing changes


def _transfer_ms(torch, dev, batch: int, dim: int, reps: int = 50) -> float:
    """Median time of one step's bare transfers: ids + rows to pinned host, rows back."""
    ids = torch.randint(0, 1 << 20, (batch,), device=dev)
    rows = torch.randn(batch, dim, device=dev)
    h_ids = torch.empty(batch, dtype=ids.dtype, pin_memory=True)
    h_rows = torch.empty(batch, dim, pin_memory=True)
    back = torch.empty_like(rows)
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        h_ids.copy_(ids, non_blocking=True)
        h_rows.copy_(rows, non_blocking=True)
        torch.cuda.synchronize()
        back.copy_(h_rows, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


def _child(impl: str, args, share: float = 1.0) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.torch_e2e", "--worker", impl,
           "--log-share", str(share),
           "--rows", str(args.rows), "--dim", str(args.dim), "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--dist", args.dist,
           "--device", args.device]
    if args.predirty:
        cmd.append("--predirty")
    if args.fill:
        cmd.append("--fill")
    if args.written:
        cmd.append("--written")
    if args.compile:
        cmd.append("--compile")
    cmd += ["--second-moment", args.second_moment, "--first-moment", args.first_moment]
    if args.dir:
        cmd += ["--dir", args.dir]
    cmd += ["--pace-mib", str(args.pace_mib), "--cache-mib", str(args.cache_mib)]
    env = dict(os.environ)
    if args.omp_wait_policy:  # read by libgomp when torch loads it: the child's environment
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    r = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{impl} worker failed:\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--dist", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds")
    ap.add_argument("--predirty", action="store_true",
                    help="pre-dirty the dsa stores (pages writable, as in a long run; only when "
                         "they fit the kernel's dirty budget), as torch's moments are pre-touched")
    ap.add_argument("--device", default="cpu", help="where the table lives: cpu or cuda")
    ap.add_argument("--second-moment", choices=("elementwise", "rowwise"),
                    default="elementwise",
                    help="of the DSA stores (rowwise: docs/algorithms.md §7.3)")
    ap.add_argument("--first-moment", choices=("full", "bfloat16"), default="full",
                    help="of the DSA stores (bfloat16: docs/algorithms.md §6)")
    ap.add_argument("--name", default=None, help="results file name (default: torch_e2e...)")
    ap.add_argument("--fill", action="store_true",
                    help="leave the log regions untouched before the timed steps (the filling "
                         "phase: each first touch of region memory is a page fault)")
    ap.add_argument("--written", action="store_true",
                    help="write every row of the DSA stores once before the timed steps (the "
                         "table after an epoch: rows that leave a small region are read back)")
    ap.add_argument("--log-shares", default="1.0,0.25",
                    help="region budgets of the log impls, as shares of the state's bytes")
    ap.add_argument("--in-process", action="store_true",
                    help="run every worker after the first in this process (the smoke test: "
                         "an interpreter instead of one per worker; their memory columns then "
                         "describe the shared process)")
    ap.add_argument("--pace-mib", type=float, default=-1.0,
                    help="log stores: the segment writer's pace in MiB (0: a segment written "
                         "at once; default: the engine's, 4)")
    ap.add_argument("--cache-mib", type=float, default=-1.0,
                    help="log stores: the most MiB of written segments kept in the page cache "
                         "(default: the engine's, 1/8 of the memory the process may use)")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the forward and the loss (default backend)")
    ap.add_argument("--omp-wait-policy", choices=("passive", "active"), default=None,
                    help="OMP_WAIT_POLICY of the workers (default: this environment's): "
                         "passive makes torch's idle OpenMP threads sleep instead of spinning "
                         "on a core (docs/benchmarks.md, torch loop on two cores)")
    ap.add_argument("--worker", choices=IMPLS, help=argparse.SUPPRESS)
    ap.add_argument("--log-share", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        args.rows, args.steps, args.warmup = 20_000, 5, 2
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    if args.omp_wait_policy and args.in_process:
        ap.error("--omp-wait-policy applies to the workers' processes: leave out --in-process")
    shares = [float(x) for x in args.log_shares.split(",")]
    runs = [(impl, share) for impl in args.impls.split(",")
            for share in (shares if impl.endswith("log") else [1.0])]
    rows = []
    for k, (impl, share) in enumerate(runs):
        if args.in_process and k > 0:  # the first still runs as a child: that path stays run
            rows.append(_worker(argparse.Namespace(**{**vars(args), "worker": impl,
                                                      "log_share": share})))
        else:
            rows.append(_child(impl, args, share))
    ref = next((r["rows_per_s"] for r in rows if r["impl"].split("+")[0] == "torch"), None)
    for r in rows:
        r["ratio_vs_torch"] = r["rows_per_s"] / ref if ref else float("nan")
    print(f"forward+backward+step, {args.rows:,} x {args.dim} float32, batch {args.batch}, "
          f"{args.steps} steps ({args.dist} ids), {args.device}"
          + (", torch.compile" if args.compile else ""))
    cols = ["impl", "store", "rows_per_s", "ratio_vs_torch", "p50_ms", "p99_ms", "opt_p50_ms",
            "fwdbwd_p99_ms", "omp_wait_policy",
            "written_pages_per_step", "anon_delta_peak_mb", "anon_peak_mb", "file_peak_mb",
            "build_s", "close_s"]
    if args.device != "cpu":
        cols[7:7] = ["xfer_ms", "gpu_peak_mb"]
    print_table(rows, cols)
    name = "torch_e2e_smoke" if args.smoke else "torch_e2e"
    if args.device != "cpu":
        name += "_" + args.device.split(":")[0]
    if args.compile:
        name += "_compile"
    if args.name and not args.smoke:
        name = args.name
    base = write_results(name, rows, {"machine": machine(), "args": vars(args)})
    print(f"wrote {base}.json / .csv")


if __name__ == "__main__":
    main()
