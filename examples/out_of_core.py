"""Out of core: train a table whose weights and Adam state exceed the memory budget given.

One :class:`adapters.torch.DiskEmbedding` of ``--rows`` x ``--dim`` float32 (its state,
weights + m + v, is ``3 x rows x dim x 4`` bytes: 1.4 GiB by default) in a log-structured
store (``storage="log"``) with a memory budget ``--memory`` (128 MiB by default, 8.7% of
the state: the store's index and its in-memory region, which holds 7.3% of the rows),
stepped by :class:`adapters.torch.DiskSparseAdam`. Rows that leave the region are written to
the store's segment files and read back from them when a batch needs them again. Then the
same table, from the same (zero) weights, on the same batches, with
``nn.Embedding(sparse=True)`` + ``torch.optim.SparseAdam``, which hold the whole state in RAM
(``--no-sparse-adam`` leaves that run out).

* **objective**: every row has a fixed pseudo-random target in ``[-1, 1)^dim`` computed from
  its id (:func:`targets`); the loss of a batch is the mean over its ids of
  ``||emb(id) - target(id)||^2``. Each epoch visits every row once, in a new random order, so
  from the second epoch on nearly every row comes back from the segment files: the loss
  only keeps falling if rows and moments come back as they left. The loss per epoch is
  printed for both optimizers; they are the same optimizer on the same batches, so the
  losses agree to float rounding.
* **memory**: each run is a child process that reports its own figures from
  ``/proc/self/status``: ``VmHWM`` as it ends (the peak of its resident set: anonymous
  *and* file-backed pages), and ``RssAnon`` / ``RssFile`` sampled after every step, with
  ``RssAnon`` once more before the table is created ("ready": after the imports and one
  warm-up step, so torch's and numba's one-time costs are not charged to the table). A
  child that only runs ``import torch`` gives the floor of any torch process. A log store
  reads the rows that left its region through read-only mappings of its segment files and
  keeps its newest segments in the page cache (up to 1/8 of the memory the process may
  use); those pages count in ``RssFile`` and in the peak although the kernel can drop them
  at any time, so ``RssAnon`` is the memory the process holds.
* **throughput**: ids per second (and steps per second) of the whole loop: targets,
  forward, backward, optimizer step, ``zero_grad``. The store's creation (milliseconds: a
  log store writes no row until it is updated) and the final ``close`` (the flush that seals
  the region out) are timed separately.

The store goes to ``--dir`` (default ``runs/ooc``: on the disk, where ``/tmp`` may be memory)
and is removed at the end unless ``--keep``.

    python -m examples.out_of_core                  # 2M x 64, memory 128 MiB, 3 epochs, ~40 s
    python -m examples.out_of_core --smoke          # tiny sizes, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ._common import (
    add_config_args,
    config_from_args,
    dir_bytes,
    fmt_bytes,
    proc_status,
    warm_up_torch,
)

__all__ = ["SMOKE", "Config", "main", "report", "run", "targets"]


@dataclasses.dataclass
class Config:
    rows: int = 2_000_000
    dim: int = 64
    memory: str = "128MiB"      # the log store's budget: region + index (8 bytes per row)
    batch: int = 8192
    epochs: int = 3
    lr: float = 0.1
    seed: int = 0
    sparse_adam: bool = True    # also run torch.optim.SparseAdam at the same size
    progress: bool = True


SMOKE = Config(rows=20_000, dim=16, memory="1MiB", batch=512, epochs=2, lr=0.1)

_P = 2_147_483_629            # a prime below 2**31: the targets' hash modulus
_A, _B, _C = 1_103_515_245, 40_503, 2_654_435_761 % _P


def targets(ids, dim: int):
    """The target rows of ``ids`` (int64 tensor): fixed pseudo-random values in ``[-1, 1)``.

    ``h = ((id * A + col * B) mod P) * C mod P`` scaled to ``[-1, 1)``: integer arithmetic,
    exact for ids below 2**32 (every product stays below 2**63), so the same ids give the
    same targets in every process.
    """
    import torch

    cols = torch.arange(dim, dtype=torch.int64)
    h = (ids.reshape(-1, 1) * _A + cols * _B) % _P
    h = (h * _C) % _P
    return (h.to(torch.float64) * (2.0 / _P) - 1.0).to(torch.float32)


def _batches(cfg: Config):
    """``(epoch, ids)`` for every step: each epoch a new permutation of the rows."""
    rng = np.random.default_rng(cfg.seed)
    for epoch in range(cfg.epochs):
        order = rng.permutation(cfg.rows)
        for lo in range(0, cfg.rows, cfg.batch):
            yield epoch, order[lo:lo + cfg.batch]


# -- one run (in a child process) ------------------------------------------------------------
def _train(kind: str, cfg: Config, store_dir: Path) -> dict:
    import torch

    torch.set_num_threads(1)  # as the other examples: 2 torch threads next to numba's are slower
    # the process's one-time costs first (torch.optim's first optimizer imports torch._dynamo;
    # dsa_core loads its kernels), so that "ready" is the process before the table
    if kind == "dsa":
        import dsa_core
        from adapters.torch import DiskEmbedding, DiskSparseAdam

        warm_up_torch()
    else:  # the torch half of warm_up_torch: not importing numba keeps this child torch's own
        e = torch.nn.Embedding(4, 2, sparse=True)
        o = torch.optim.SparseAdam(e.parameters())
        e(torch.tensor([0, 1, 1])).sum().backward()
        o.step()
        del e, o
    ready = {"anon": proc_status("RssAnon"), "rss": proc_status("VmRSS")}
    t0 = time.perf_counter()
    opt_close = emb_close = None
    if kind == "dsa":
        emb = DiskEmbedding(cfg.rows, cfg.dim, state_dir=store_dir, init="zeros",
                            storage="log", memory=cfg.memory, overwrite=True)
        opt = DiskSparseAdam(emb.parameters(), lr=cfg.lr)
        opt_close, emb_close = opt.close, emb.close
    else:
        emb = torch.nn.Embedding(cfg.rows, cfg.dim, sparse=True)
        with torch.no_grad():
            emb.weight.zero_()
        opt = torch.optim.SparseAdam(emb.parameters(), lr=cfg.lr)
    create_s = time.perf_counter() - t0
    steps = -(-cfg.rows // cfg.batch) * cfg.epochs
    epoch_loss = np.zeros(cfg.epochs)
    step_loss = []
    peak_anon = peak_file = 0
    hits = []
    t0 = time.perf_counter()
    for k, (epoch, ids) in enumerate(_batches(cfg)):
        ids = torch.from_numpy(ids)
        if kind == "dsa" and k % 16 == 0:  # share of the batch's rows held by the region
            hits.append(dsa_core.residency(emb.store, ids.numpy()))
        loss = (emb(ids) - targets(ids, cfg.dim)).pow(2).sum(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_loss.append(float(loss.detach()))
        epoch_loss[epoch] += step_loss[-1] * len(ids)
        peak_anon = max(peak_anon, proc_status("RssAnon") or 0)
        peak_file = max(peak_file, proc_status("RssFile") or 0)
        if cfg.progress and (k + 1) % max(1, steps // 10) == 0:
            print(f"  {kind}: step {k + 1}/{steps}, loss {step_loss[-1]:.3f}", file=sys.stderr,
                  flush=True)
    train_s = time.perf_counter() - t0
    out = {"kind": kind, "steps": len(step_loss), "ids": cfg.rows * cfg.epochs,
           "epoch_loss": (epoch_loss / cfg.rows).tolist(), "first_step_loss": step_loss[0],
           "last_step_loss": step_loss[-1], "create_s": create_s, "train_s": train_s,
           "peak_rss_anon": peak_anon, "peak_rss_file": peak_file,
           "ready_rss_anon": ready["anon"], "ready_rss": ready["rss"]}
    if kind == "dsa":
        stats = emb.store.store.log_stats()
        out.update(region_rows=int(stats["slots"]), seals=int(stats["seals"]),
                   region_hit=float(np.mean(hits)),
                   written_bytes=int(stats["file_bytes_written"]))
        t0 = time.perf_counter()
        opt_close()
        emb_close()
        out["close_s"] = time.perf_counter() - t0
        out["disk_bytes"] = dir_bytes(store_dir)
    out["peak_rss"] = proc_status("VmHWM")  # the whole run's, close included
    return out


def _child(argv: list[str]) -> dict:
    """Run ``python argv...`` as a child process; its last stdout line, parsed as JSON.

    The children report their own peak memory (``VmHWM``). ``ru_maxrss`` of a child, from
    ``os.wait4``, would not do: it also counts the parent's resident set at the fork, which
    after part 1 of the demo is larger than an ``import torch`` child's.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env=env,
                       check=False)
    if p.returncode != 0:
        raise RuntimeError(f"child {' '.join(argv)} failed with status {p.returncode}")
    return json.loads(p.stdout.strip().splitlines()[-1])


_BASELINE = ("import torch, json; print(json.dumps({l.split(':')[0]: int(l.split()[1]) * 1024 "
             "for l in open('/proc/self/status') if l.startswith(('VmHWM', 'RssAnon'))}))")


def _child_args(cfg: Config) -> list[str]:
    return [f"--{f.name.replace('_', '-')}={getattr(cfg, f.name)}"
            for f in dataclasses.fields(Config) if f.name not in ("progress", "sparse_adam")] \
        + ([] if cfg.progress else ["--no-progress"])


def run(cfg: Config, work: Path, keep: bool = False) -> dict:
    """The baseline, DSA and (``cfg.sparse_adam``) SparseAdam runs, each in a child."""
    import dsa_core

    work = Path(work)
    store = work / "table"
    me = ["-m", "examples.out_of_core"]
    made = not work.exists()
    t0 = time.perf_counter()
    base = _child(["-c", _BASELINE])["VmHWM"]
    try:
        dsa = _child([*me, "--worker", "dsa", "--store", str(store), *_child_args(cfg)])
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
            if made:
                with contextlib.suppress(OSError):
                    work.rmdir()  # unless something else was put there meanwhile
    res = {"cfg": cfg, "torch_baseline": base, "dsa": dsa,
           "state_bytes": 3 * cfg.rows * cfg.dim * 4,
           "budget": dsa_core.tools.validation.check_memory_arg(cfg.memory, "log", what="memory"),
           "memory_limit": dsa_core.tools.paging_limits()["memory_limit"],
           "kept": str(store) if keep else None}
    if cfg.sparse_adam:
        res["sparse_adam"] = _child([*me, "--worker", "sparse_adam", *_child_args(cfg)])
    res["seconds"] = time.perf_counter() - t0
    return res


def report(r: dict) -> str:
    c, d, ref = r["cfg"], r["dsa"], r.get("sparse_adam")
    state, budget, base = r["state_bytes"], r["budget"], r["torch_baseline"]
    runs = [("DiskSparseAdam, log store", d)] + ([("torch.optim.SparseAdam", ref)] if ref else [])
    lines = [
        (f"table: {c.rows:,} x {c.dim} float32; state (weights + m + v) {fmt_bytes(state)} "
         f"({state / 1e9:.3g} GB); log store, memory budget {fmt_bytes(budget)} "
         f"({budget / state:.1%} of the state): its region holds {d['region_rows']:,} rows "
         f"({d['region_rows'] / c.rows:.1%} of the table)"),
        (f"training: {c.epochs} epochs x {c.rows:,} rows (a new permutation each), batch "
         f"{c.batch}, lr {c.lr}, {d['steps']:,} steps; loss = mean over the ids of "
         "||row - target||^2"),
        "",
        (f"{'memory of each child process':<32}{'peak RSS':>11}{'RssAnon ready':>15}"
         f"{'RssAnon peak':>14}{'growth':>12}{'RssFile peak':>14}"),
        f"{'  empty `import torch`':<32}{fmt_bytes(base):>11}",
    ]
    for name, x in runs:
        lines.append(f"{'  ' + name:<32}{fmt_bytes(x['peak_rss']):>11}"
                     f"{fmt_bytes(x['ready_rss_anon']):>15}{fmt_bytes(x['peak_rss_anon']):>14}"
                     f"{fmt_bytes(x['peak_rss_anon'] - x['ready_rss_anon']):>12}"
                     f"{fmt_bytes(x['peak_rss_file']):>14}")
    lines += ["", f"{'throughput (whole training loop)':<32}{'ids/s':>11}{'steps/s':>15}"
              f"{'train':>14}"]
    for name, x in runs:
        lines.append(f"{'  ' + name:<32}{x['ids'] / x['train_s']:>11,.0f}"
                     f"{x['steps'] / x['train_s']:>15.1f}{x['train_s']:>13.1f}s")
    grew = d["peak_rss_anon"] - d["ready_rss_anon"]
    lines += [
        "",
        (f"torch.optim.SparseAdam holds {state / 1e9:.3g} GB (weights + m + v, dense) in RAM"
         + (f": its process's anonymous memory grew by "
            f"{fmt_bytes(ref['peak_rss_anon'] - ref['ready_rss_anon'])}." if ref else ".")),
        (f"DiskSparseAdam's grew by {fmt_bytes(grew)} ({grew / state:.0%} of the state): the "
         f"{fmt_bytes(budget)} budget (region + index) and the step's working memory beside "
         "it (the batch's rows, gradients and targets, buffers of segments being written)."),
    ]
    if ref and d["peak_rss"] > ref["peak_rss"]:
        lines.append(
            f"Its peak RSS is nevertheless higher than SparseAdam's: it counts the page cache "
            f"of the store's segments mapped into the process (RssFile peak "
            f"{fmt_bytes(d['peak_rss_file'])}, below).")
    lines += [
        "",
        ("peak RSS: VmHWM of each child (/proc/self/status, read as it ends): the high-water "
         "mark of its resident set, anonymous and file-backed pages together."),
        ("RssAnon (the process's own memory) and RssFile: /proc/self/status, sampled after "
         "every step; ready = before the table was created, after imports and one warm-up "
         "step."),
        ("RssFile: shared libraries (as in any torch process) and, for DiskSparseAdam, the "
         "store's segment files mapped for reading. The store keeps its newest segments in "
         "the page cache, up to 1/8 of the memory the process may use "
         f"({fmt_bytes(r['memory_limit'] / 8)} here), and drops older ones; it is page "
         "cache, which the kernel reclaims when memory is short."),
        (f"rows in the region when their batch came: {d['region_hit']:.1%}; the others were "
         "read back from the segment files (from the page cache where the kernel still "
         f"held them). {d['seals']} seals wrote {fmt_bytes(d['written_bytes'])}; store on "
         f"disk at the end {fmt_bytes(d['disk_bytes'])}; create {d['create_s']:.3f} s, close "
         f"(the final flush) {d['close_s']:.1f} s."),
        "",
        "loss per epoch (mean over the epoch's ids):",
    ]
    for name, x in runs:
        lines.append(f"  {name:<30}" + "".join(f"{v:>10.4f}" for v in x["epoch_loss"]))
    if ref:
        diff = max(abs(a - b) / max(abs(b), 1e-12)
                   for a, b in zip(d["epoch_loss"], ref["epoch_loss"]))
        lines.append(f"  largest relative difference {diff:.1e} (same zero initial weights, "
                     "same batches)")
    if r.get("kept"):
        lines.append(f"store kept in {r['kept']}")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(prog="python -m examples.out_of_core",
                                description=__doc__.split("\n\n")[0])
    add_config_args(p, Config, skip=("sparse_adam",))
    p.add_argument("--no-sparse-adam", action="store_true",
                   help="leave out the torch.optim.SparseAdam run")
    p.add_argument("--dir", default="runs/ooc", help="where the store goes (default: runs/ooc)")
    p.add_argument("--keep", action="store_true", help="keep the store")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--worker", choices=("dsa", "sparse_adam"), help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.sparse_adam = not a.no_sparse_adam
    cfg = config_from_args(Config, a)
    if a.smoke:
        cfg = dataclasses.replace(SMOKE, progress=cfg.progress, sparse_adam=cfg.sparse_adam)
    if a.worker:
        print(json.dumps(_train(a.worker, cfg, Path(a.store or "."))))
        return None
    r = run(cfg, Path(a.dir), keep=a.keep)
    print(report(r))
    return r


if __name__ == "__main__":
    main()
