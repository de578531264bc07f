"""The process that tests/store/test_reliability.py kills with SIGKILL.

Run with ``sys.executable tests/crash_worker.py MODE ...``; it trains a small store on batches
that are a pure function of the step number (:func:`batch`), so the test can replay any
number of steps without crashes and compare bit for bit. It prints one line per event
(``open <count>``, ``ckpt <count>``, ``done <count>``), flushed at once, for the parent to
time its kill.

Modes
-----
``train STORE --steps N``
    A ``durability="step"`` store of either kind (created by the parent with
    :func:`store_kw`): ``dsa_core.open`` (which rolls
    back a step that a kill interrupted), then steps ``count + 1 .. N``.
``ckpt LIVE DEST --steps N --every K [--storage KIND]``
    Resume from the checkpoint: ``LIVE`` is replaced by a copy of ``DEST`` (or created fresh,
    of ``KIND``: :func:`store_kw`, when there is no ``DEST`` yet), then steps with
    ``dsa_core.checkpoint(state, DEST, overwrite=True)`` after every ``K``-th step.
``torch-ckpt LIVE DEST --steps N --every K [--storage KIND]``
    The same through ``adapters.torch``: a ``DiskEmbedding`` of ``KIND`` (:func:`store_kw`'s
    ``storage`` and ``memory``) stepped by ``DiskSparseAdam``,
    ``opt.checkpoint(DEST, overwrite=True)`` every ``K`` steps, ``opt.load_checkpoint(DEST)``
    on start.
``flushk STORE --steps N --every K --end HOW``
    A ``durability="flush"`` store of either kind (created by the parent,
    tests/inplace/test_unclean_inplace.py): ``dsa_core.open``, then steps ``count + 1 .. N`` with
    ``dsa_core.flush`` after every ``K``-th step (``flush <count>`` printed after each).
    Then ``--end``: ``close`` (``dsa_core.close``), ``exit`` (a normal interpreter exit
    without ``close``), ``os_exit`` (``os._exit(0)``: no exit handlers), ``kill`` (SIGKILL
    itself), ``sigterm`` (SIGTERM itself, its default action: what preemption sends) or
    ``sigterm_exit`` (SIGTERM after a handler that calls ``sys.exit(143)``).

``--kill-at POINT --kill-step K`` makes the worker SIGKILL itself at a chosen point of the
journaled commit protocol of step ``K`` (or of a checkpoint), see :data:`KILL_POINTS`: the
in-place store's protocol (the log store's crash points are tests/log/test_log_engine.py's).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import numpy as np

NUM_ROWS = 5000
DIM = 16
MAX_BATCH = 300
LR = 0.01
SEED = 20240611
STORE_KW = {"lr": LR, "init": "normal", "init_scale": 0.1, "seed": 3, "progress": False}
LOG_SLOTS = 1000  # a log store's region: a fifth of the rows, so steps seal segments


def store_kw(kind: str = "inplace") -> dict:
    """:data:`STORE_KW` for a store of ``kind`` (a log store with a region of
    :data:`LOG_SLOTS` records)."""
    if kind == "inplace":
        return {**STORE_KW, "storage": "inplace"}
    import dsa_core

    lay = {"num_rows": NUM_ROWS, "stride": 3 * DIM, "dtype": "float32"}
    return {**STORE_KW, "storage": kind, "memory": dsa_core.region_memory(lay, LOG_SLOTS)}

# where --kill-at can strike (see install_kill)
KILL_POINTS = (
    "journal-torn",      # half of the journal written (pwritev cut short)
    "journal",           # journal written and fdatasync'd, rows not touched yet
    "mid-kernel",        # the kernel has updated the first half of the batch's rows
    "kernel",            # every row updated in the mapping, not fdatasync'd
    "data-sync",         # rows fdatasync'd, manifest not replaced yet
    "manifest-tmp",      # new manifest written to manifest.json.tmp, not renamed
    "manifest-renamed",  # manifest replaced (commit point passed), directory not fsync'd
    "recover",           # open() rolled a step back but died before removing the journal
    "ckpt-manifest",     # checkpoint: data copied into DEST.tmp-<pid>, no manifest yet
    "ckpt-commit",       # checkpoint: complete in DEST.tmp-<pid>, not renamed into place
    "ckpt-cleanup",      # checkpoint: new DEST in place, the old one not deleted yet
    "ckpt-delta",        # checkpoint on the last one: half of its delta file written
)


def batch(t: int, num_rows: int = NUM_ROWS, dim: int = DIM) -> tuple[np.ndarray, np.ndarray]:
    """The batch of step ``t`` (1-based): a pure function of ``t``.

    Unsorted ids with duplicates (the coalescing path), every 13th step empty (a step that
    only commits the count), every 5th step sorted-unique (the no-copy path).
    """
    rng = np.random.default_rng([SEED, t])
    b = 0 if t % 13 == 0 else int(rng.integers(1, MAX_BATCH + 1))
    idx = rng.integers(0, num_rows, b).astype(np.int64)
    if t % 5 == 0:
        idx = np.unique(idx)
    grad = rng.standard_normal((idx.shape[0], dim)).astype(np.float32)
    return idx, grad


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


CURRENT = [0]  # the step being taken (the hooks strike at step --kill-step)
KILL_AT: list[str] = []  # the --kill-at point, if any


def install_kill(point: str, at: int) -> None:
    """Patch dsa_core so that this process kills itself at ``point`` of step ``at``."""
    import dsa_core._files as files
    import dsa_core._layout as fmt
    import dsa_core._inplace.store as store
    import dsa_core._step as stp

    now = lambda: CURRENT[0] == at
    if point == "journal-torn":
        real = os.pwritev

        def pwritev(fd, bufs, offset):
            if not now():
                return real(fd, bufs, offset)
            data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            os.pwrite(fd, data[:len(data) // 2], offset)
            _die()
        os.pwritev = pwritev
    elif point == "journal":
        real_j = store.Store.journal_write

        def journal_write(self, rows, count_before):
            real_j(self, rows, count_before)
            if now():
                _die()
        store.Store.journal_write = journal_write
    elif point in ("mid-kernel", "kernel"):
        real_a = stp._apply

        def _apply(state, t, lr, srows, G, inv, params, table, *, data, drows):
            if now() and point == "mid-kernel":
                h = max(1, srows.shape[0] // 2)
                real_a(state, t, lr, srows[:h], G[:h], inv, params, table, data=data,
                       drows=drows[:h])
                _die()
            real_a(state, t, lr, srows, G, inv, params, table, data=data, drows=drows)
            if now():
                _die()
        stp._apply = _apply
    elif point == "data-sync":
        real_s = store.Store.data_sync

        def data_sync(self):
            real_s(self)
            if now():
                _die()
        store.Store.data_sync = data_sync
    elif point in ("manifest-tmp", "manifest-renamed"):
        real_r = os.replace

        def replace(src, dst, *a, **k):
            hit = now() and Path(dst).name == fmt.MANIFEST_FILE
            if hit and point == "manifest-tmp":
                _die()
            real_r(src, dst, *a, **k)
            if hit:
                _die()
        os.replace = replace
    elif point == "recover":
        real_u = Path.unlink

        def unlink(self, *a, **k):
            if self.name == fmt.JOURNAL_FILE:
                _die()
            real_u(self, *a, **k)
        Path.unlink = unlink
    elif point == "ckpt-manifest":
        real_w = fmt.write_manifest

        def write_manifest(directory, manifest):
            if now() and ".tmp-" in Path(directory).name:
                _die()
            real_w(directory, manifest)
        fmt.write_manifest = write_manifest
    elif point in ("ckpt-commit", "ckpt-cleanup"):
        real_x, real_rn, real_rm = files._exchange, os.rename, shutil.rmtree

        def exchange(a, b):
            if now() and point == "ckpt-commit":
                _die()
            ok = real_x(a, b)
            if ok and now():
                _die()
            return ok

        def rename(src, dst, *a, **k):
            if now() and ".tmp-" in Path(src).name and point == "ckpt-commit":
                _die()
            real_rn(src, dst, *a, **k)

        def rmtree(path, *a, **k):
            if now() and point == "ckpt-cleanup":
                _die()
            real_rm(path, *a, **k)
        files._exchange, os.rename, shutil.rmtree = exchange, rename, rmtree
    elif point == "ckpt-delta":
        import dsa_core._inplace.snapshots as snaps
        real_d = snaps._write_delta

        def write_delta(path, data, rows, count):
            if not now():
                return real_d(path, data, rows, count)
            body = np.ascontiguousarray(data[rows]).tobytes()
            Path(path).write_bytes(bytes(64) + body[:len(body) // 2])  # no header yet
            _die()
        snaps._write_delta = write_delta
    else:
        raise SystemExit(f"unknown kill point {point!r}; one of {KILL_POINTS}")


def say(*words) -> None:
    print(*words, flush=True)


def train(store: str, steps: int) -> None:
    import dsa_core

    if not KILL_AT:
        dsa_core.warmup(("float32",), readonly=False)  # so that "open" means: stepping now
    state = dsa_core.open(store)
    say("open", state.count)
    while state.count < steps:
        t = state.count + 1
        CURRENT[0] = t
        idx, grad = batch(t)
        state = dsa_core.step(state, idx, grad)
    say("done", state.count)
    dsa_core.close(state)


KEEP: list = []  # states left open until the interpreter exits (--end exit)


def flushk(store: str, steps: int, every: int, end: str) -> None:
    import dsa_core

    dsa_core.warmup(("float32",), readonly=False)  # so that "open" means: stepping now
    state = dsa_core.open(store)
    say("open", state.count)
    while state.count < steps:
        t = state.count + 1
        state = dsa_core.step(state, *batch(t))
        if t % every == 0:
            dsa_core.flush(state)
            say("flush", t)
    say("done", state.count)
    if end == "close":
        dsa_core.close(state)
    elif end == "os_exit":
        os._exit(0)
    elif end == "kill":
        _die()
    elif end == "sigterm":  # the default action: the process ends, no exit handler runs
        sys.stdout.flush()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    elif end == "sigterm_exit":  # the docs' recipe: SIGTERM as a normal exit (flushes)
        KEEP.append(state)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
    else:  # "exit": the interpreter exits with the store open, its State still referenced
        KEEP.append(state)


def _resume_live(live: Path, dest: Path, curvature: float, storage: str):
    import dsa_core

    shutil.rmtree(live, ignore_errors=True)
    if dest.exists():
        shutil.copytree(dest, live)
        return dsa_core.open(live)
    return dsa_core.create(live, NUM_ROWS, DIM, curvature=curvature, **store_kw(storage))


def ckpt(live: Path, dest: Path, steps: int, every: int, curvature: float,
         storage: str = "inplace") -> None:
    import dsa_core

    if not KILL_AT:
        dsa_core.warmup(("float32",), readonly=False)
    state = _resume_live(live, dest, curvature, storage)
    say("open", state.count)
    while state.count < steps:
        t = state.count + 1
        idx, grad = batch(t)
        state = dsa_core.step(state, idx, grad)
        if t % every == 0:
            CURRENT[0] = t
            dsa_core.checkpoint(state, dest, overwrite=True)
            say("ckpt", t)
    say("done", state.count)
    dsa_core.close(state)


def torch_model(live: Path, dest: Path | None, storage: str = "inplace"):
    """A DiskEmbedding of kind ``storage`` (a log one with :func:`store_kw`'s region)
    stepped by DiskSparseAdam; resumed from ``dest`` when given."""
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    init = np.random.default_rng(7).standard_normal((NUM_ROWS, DIM)).astype(np.float32) * 0.1
    kw = store_kw(storage)
    emb = DiskEmbedding(NUM_ROWS, DIM, state_dir=live, init=init, overwrite=True,
                        storage=kw["storage"], memory=kw.get("memory"))
    opt = DiskSparseAdam(emb.parameters(), lr=LR)
    if dest is not None and dest.exists():
        opt.load_checkpoint(dest)
    return emb, opt


def torch_step(emb, opt, t: int) -> None:
    """Step t of the torch run: loss = sum(emb(ids) * grad) gives exactly batch(t)'s rows."""
    import torch

    idx, grad = batch(t)
    out = emb(torch.from_numpy(idx))
    (out * torch.from_numpy(grad)).sum().backward()
    opt.step()
    opt.zero_grad()


def torch_ckpt(live: Path, dest: Path, steps: int, every: int,
               storage: str = "inplace") -> None:
    import torch

    import dsa_core

    if not KILL_AT:  # compile/load the kernels and warm autograd, so "open" means stepping
        dsa_core.warmup(("float32",), readonly=False)
        w = torch.nn.Embedding(4, 2, sparse=True)
        w(torch.tensor([1, 1])).sum().backward()
    emb, opt = torch_model(live, dest, storage)
    count = emb.store.count
    say("open", count)
    while count < steps:
        t = count + 1
        torch_step(emb, opt, t)
        count = emb.store.count
        if t % every == 0:
            CURRENT[0] = t
            opt.checkpoint(dest, overwrite=True)
            say("ckpt", t)
    say("done", count)
    opt.close()
    emb.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["train", "ckpt", "torch-ckpt", "flushk"])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--steps", type=int, default=10**9)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--curvature", type=float, default=0.0)
    ap.add_argument("--storage", choices=["inplace", "log"], default="inplace")
    ap.add_argument("--kill-at", choices=KILL_POINTS)
    ap.add_argument("--kill-step", type=int, default=0)
    ap.add_argument("--end", choices=["close", "exit", "os_exit", "kill", "sigterm",
                                            "sigterm_exit"], default="close")
    a = ap.parse_args(argv)
    if a.kill_at:
        KILL_AT.append(a.kill_at)
        install_kill(a.kill_at, a.kill_step)
    if a.mode == "train":
        train(a.paths[0], a.steps)
    elif a.mode == "flushk":
        flushk(a.paths[0], a.steps, a.every, a.end)
    elif a.mode == "ckpt":
        ckpt(Path(a.paths[0]), Path(a.paths[1]), a.steps, a.every, a.curvature, a.storage)
    else:
        torch_ckpt(Path(a.paths[0]), Path(a.paths[1]), a.steps, a.every, a.storage)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # adapters/ for torch-ckpt
    main()
