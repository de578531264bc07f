"""Scale-out benchmark: ShardedDiskEmbedding + DiskSparseAdam with 1, 2, ... gloo processes.

    python -m benchmarks.distributed                        # 1M x 64, batch 2048 per rank
    python -m benchmarks.distributed --smoke                # seconds, tiny sizes
    python -m benchmarks.distributed --rows 10000000 --worlds 1,2,4 --dir /mnt/nvme/tmp

For each world size W, W processes on this machine (gloo over 127.0.0.1, rendezvous through a
TCPStore of this process) each build their shard (``--init uniform``, the default, writes every
row, so the shard starts in the page cache and mapped: warm figures; ``--init zeros`` creates it
in no time but the first touch of each page then costs a fault: cold figures) and train
``--steps`` timed steps after ``--warmup`` ones, each rank on its
own batch of ``--batch`` ids (uniform or Zipf, seeded by rank):
``loss = mean((emb(ids) - 1)**2); loss.backward(); opt.step(); opt.zero_grad()``.

Reported per W: global rows/s (W x batch ids per second of a whole step, the slowest rank's
median step), the median times of forward, backward and optimizer step, and the bytes each
rank sent to the other ranks per step (counted by the module for every all_to_all), next to
the model of README's scale-out section::

    bytes/step/rank = 8 (W-1) + U (W-1)/W (8 + 2 d s)        U = distinct ids per rank batch

Threads: ``--threads`` numba and torch threads per process (default 1, so W processes use W
cores and the figures show scaling by processes; ``0``: ``cpus // W`` each, the whole machine
for every W). On a machine shared with other jobs the figures are noisy. Writes
``benchmarks/results/distributed[_smoke].{json,csv}``.
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
from datetime import timedelta

import numpy as np

from ._common import batches, machine, print_table, write_results


def model_bytes(u: float, d: int, s: int, w: int) -> float:
    """Bytes one rank sends to the others per step: split sizes, ids, rows back, grads."""
    return 8 * (w - 1) + u * (w - 1) / w * (8 + 2 * d * s)


def _worker(a) -> dict:
    import torch
    import torch.distributed as dist

    import dsa_core
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    threads = a.threads or max(1, (os.cpu_count() or 1) // a.world)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", a.port, a.world, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=60))
    t0 = time.perf_counter()
    emb = ShardedDiskEmbedding(a.rows, a.dim, state_dir=a.dir, init=a.init, init_scale=0.01,
                               overwrite=True, storage="inplace")
    opt = DiskSparseAdam(emb.parameters(), lr=1e-3)
    build = time.perf_counter() - t0
    ids = batches(a.rows, a.batch, a.warmup + a.steps, a.dist, seed=1000 + a.rank)
    uniq = [len(np.unique(i)) for i in ids[a.warmup:]]
    times = {"fwd": [], "bwd": [], "opt": [], "step": []}
    dsa_core.set_num_threads(threads)  # this worker process: its own thread count
    for k, i in enumerate(ids):
        if k == a.warmup:
            dist.barrier()
            stats0 = emb.comm_stats
        x = torch.from_numpy(i)
        t0 = time.perf_counter()
        loss = ((emb(x) - 1.0) ** 2).mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if k >= a.warmup:
            for key, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2),
                           ("step", t3 - t0)):
                times[key].append(v)
    stats = emb.comm_stats
    sent = {k: (stats[k] - stats0[k]) / a.steps for k in ("counts", "ids", "rows", "grads")}
    out = {"rank": a.rank, "build_s": build, "threads": threads, "count": emb.store.count,
           "median": {k: float(np.median(v)) for k, v in times.items()},
           "total_s": float(np.sum(times["step"])), "distinct_ids": float(np.mean(uniq)),
           "sent_per_step": sent, "self_per_step": (stats["self"] - stats0["self"]) / a.steps}
    emb.close()
    dist.destroy_process_group()
    return out


def _run_world(w: int, a, root: str) -> list[dict]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, w, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    threads = a.threads or max(1, (os.cpu_count() or 1) // w)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), NUMBA_NUM_THREADS=str(threads),
               GLOO_SOCKET_IFNAME="lo0" if sys.platform == "darwin" else "lo")
    procs = []
    try:
        for r in range(w):
            cmd = [sys.executable, "-m", "benchmarks.distributed", "--worker",
                   "--rank", str(r), "--world", str(w), "--port", str(store.port),
                   "--dir", os.path.join(root, f"w{w}"), "--rows", str(a.rows),
                   "--dim", str(a.dim), "--batch", str(a.batch), "--steps", str(a.steps),
                   "--warmup", str(a.warmup), "--dist", a.dist, "--init", a.init,
                   "--threads", str(a.threads)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            so, se = p.communicate(timeout=a.timeout)
            if p.returncode:
                raise RuntimeError(f"worker failed ({p.returncode}):\n{se[-3000:]}")
            outs.append(json.loads(so.strip().splitlines()[-1]))
        return outs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.distributed")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2048, help="ids per rank per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--dist", choices=("uniform", "zipf"), default="uniform")
    ap.add_argument("--init", choices=("uniform", "zeros"), default="uniform",
                    help="uniform: every row written at creation, so the shard is in the page "
                         "cache and mapped (warm); zeros: nothing touched (cold first steps)")
    ap.add_argument("--dir", default=None, help="where the shards go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=1,
                    help="numba/torch threads per process (0: cpus // W)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(_worker(a)))
        return
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.warmup = 10_000, 16, 256, 5, 2
    root = tempfile.mkdtemp(prefix="dsa-bench-dist-", dir=a.dir)
    rows = []
    try:
        for w in (int(x) for x in a.worlds.split(",")):
            outs = _run_world(w, a, root)
            step = max(o["median"]["step"] for o in outs)
            u = float(np.mean([o["distinct_ids"] for o in outs]))
            sent = float(np.mean([sum(o["sent_per_step"].values()) for o in outs]))
            model = model_bytes(u, a.dim, 4, w)
            rows.append({
                "world": w, "rows_per_s": w * a.batch / step, "step_ms": step * 1e3,
                "fwd_ms": max(o["median"]["fwd"] for o in outs) * 1e3,
                "bwd_ms": max(o["median"]["bwd"] for o in outs) * 1e3,
                "opt_ms": max(o["median"]["opt"] for o in outs) * 1e3,
                "threads": outs[0]["threads"], "distinct_ids": u,
                "sent_B_per_step": sent, "model_B_per_step": model,
                "model_error": (sent - model) / model if model else 0.0,
                "ids_B": float(np.mean([o["sent_per_step"]["ids"] for o in outs])),
                "rows_B": float(np.mean([o["sent_per_step"]["rows"] for o in outs])),
                "grads_B": float(np.mean([o["sent_per_step"]["grads"] for o in outs])),
                "self_B": float(np.mean([o["self_per_step"] for o in outs])),
                "build_s": max(o["build_s"] for o in outs)})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"ShardedDiskEmbedding {a.rows:,} x {a.dim} float32, batch {a.batch} per rank, "
          f"{a.steps} steps ({a.dist} ids), gloo on 127.0.0.1")
    print_table(rows, ["world", "rows_per_s", "step_ms", "fwd_ms", "bwd_ms", "opt_ms",
                       "sent_B_per_step", "model_B_per_step", "model_error"])
    name = "distributed_smoke" if a.smoke else "distributed"
    base = write_results(name, rows, {"machine": machine(), "args": vars(a),
                                      "time": time.strftime("%Y-%m-%d %H:%M:%S")})
    print(f"wrote {base}.json / .csv")


if __name__ == "__main__":
    main()
