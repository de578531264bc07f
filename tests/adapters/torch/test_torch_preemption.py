"""Runs that end by preemption (SIGTERM) or kill -9 resume, the same on both store kinds.

A torch loop checkpoints the README way (``opt.checkpoint(dir, extra={"model": ...,
"step": ...})`` every few steps) and is stopped at a random moment by SIGTERM (what Slurm,
``docker stop``, Kubernetes and spot reclaim send; its default action ends the process with
no exit handler) or SIGKILL (kill -9, the OOM killer). A new process then builds the same
objects with ``resume=True`` and no other step: the store reopens exactly at its last
flush (the newest checkpoint flushed it), on both kinds. It loads the newest checkpoint,
trains on to the end, and must hold exactly what an uninterrupted run holds: the weights,
the optimizer's moments and count.

Two models: ``nn.Embedding(sparse=True)`` stepped by ``DiskSparseAdam`` (m and v on disk),
and a ``DiskEmbedding`` (weights, m and v on disk). One SIGTERM trial per kind by default; 8 per kind and
signal with ``-m slow``.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from crash_server import CrashServer  # noqa: E402
from helpers import KINDS  # noqa: E402

import dsa_core  # noqa: E402
from adapters.torch import DiskEmbedding, DiskSparseAdam  # noqa: E402

pytestmark = pytest.mark.torch

ROWS, DIM, STEPS, EVERY, BATCH = 3000, 16, 200, 10, 256

WORKER = r'''
import json, sys
cfg = json.loads(sys.argv[1])
sys.path.insert(0, cfg["tests"])
from test_torch_preemption import train
train(cfg["root"], cfg["kind"], cfg["model"], resume=False, say=True)
'''


def _build(root: Path, kind: str, model: str, resume: bool):
    kw = dict(storage=kind, resume=resume)
    if kind == "log":
        kw["memory"] = "4MiB"
    torch.manual_seed(0)
    if model == "nn":
        emb = torch.nn.Embedding(ROWS, DIM, sparse=True)
        opt = DiskSparseAdam(emb.parameters(), lr=1e-2, state_dir=root / "opt", **kw)
    else:
        emb = DiskEmbedding(ROWS, DIM, state_dir=root / "emb", seed=0, **kw)
        opt = DiskSparseAdam(emb.parameters(), lr=1e-2)
    return emb, opt


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, ROWS, (BATCH,), generator=g)


def train(root, kind: str, model: str, resume: bool, say: bool = False, start: int = 0):
    """The README loop from ``start`` to ``STEPS`` (a checkpoint every ``EVERY`` steps);
    returns (emb, opt) open. ``resume``: build with ``resume=True``, load the newest
    checkpoint first."""
    root = Path(root)
    emb, opt = _build(root, kind, model, resume)
    if resume:
        # complete checkpoints only: a stop inside one leaves its staging directory
        ckpts = sorted((p for p in (root / "ckpts").glob("s*") if p.name[1:].isdigit()),
                       key=lambda p: int(p.name[1:]))
        if ckpts:
            extra = opt.load_checkpoint(ckpts[-1])
            emb.load_state_dict(extra["model"])
            start = extra["step"]
    for step in range(start + 1, STEPS + 1):
        loss = (emb(_batch(step)) - 0.5).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % EVERY == 0:
            opt.checkpoint(root / "ckpts" / f"s{step}",
                           extra={"model": emb.state_dict(), "step": step})
            if say:
                print("ckpt", step, flush=True)
    return emb, opt


def _state(emb, opt) -> tuple[np.ndarray, np.ndarray, int]:
    """The weights, the whole records of the optimizer's store (m, v; the weights too for a
    DiskEmbedding), and its count."""
    p = next(iter(emb.parameters()))
    s = opt.store_for(p)
    rec = dsa_core.read_records(s, np.arange(ROWS))
    if isinstance(emb, DiskEmbedding):
        w = emb.to_tensor().numpy()
    else:
        w = emb.weight.detach().numpy().copy()
    return w, rec, s.count


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = CrashServer(tmp_path_factory.mktemp("preempt_runs"),
                      preload="import torch, adapters.torch")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's end state, per (kind, model)."""
    got = {}

    def at_end(kind: str, model: str):
        if (kind, model) not in got:
            root = tmp_path_factory.mktemp(f"ref-{kind}-{model}")
            emb, opt = train(root, kind, model, resume=False)
            got[kind, model] = _state(emb, opt)
            opt.close()
            if isinstance(emb, DiskEmbedding):
                emb.close()
        return got[kind, model]
    return at_end


def _trials(server, reference, tmp: Path, kind: str, sig: int, trials: int, seed: int):
    rng = np.random.default_rng(seed)
    resumed_at = []
    for k in range(trials):
        model = ("nn", "disk")[k % 2]
        root = tmp / f"t{k}"
        root.mkdir()
        cfg = dict(root=str(root), kind=kind, model=model,
                   tests=str(Path(__file__).resolve().parent))
        job = server.start(json.dumps(cfg), code=WORKER)
        assert job.expect("ckpt", timeout=120) == EVERY  # training, checkpoints taken
        # a random moment of the run, whatever the machine's speed: past a random checkpoint
        # (two or more before the end), within one checkpoint interval of it (a fixed 0-0.6 s
        # outlived the whole run on a fast day: the worker ended before the signal)
        t0 = time.monotonic()
        last = job.expect("ckpt", timeout=120)
        interval = time.monotonic() - t0
        target = int(rng.integers(2, STEPS // EVERY - 2)) * EVERY
        while last < target:
            last = job.expect("ckpt", timeout=120)
        time.sleep(rng.uniform(0.0, interval))
        lines = job.kill(sig)
        reported = max([last] + [int(x[1]) for x in lines if x[0] == "ckpt"])
        # resume=True and nothing else: the store is exactly at its last flush (a checkpoint)
        emb, opt = _build(root, kind, model, resume=True)
        count = opt.store_for(next(iter(emb.parameters()))).count
        # (one past the newest complete checkpoint: killed inside it, after its flush)
        assert count % EVERY == 0 and reported <= count <= reported + EVERY, (count, reported)
        opt.close()
        if isinstance(emb, DiskEmbedding):
            emb.close()
        # the README's resume: the newest checkpoint, then on to the end
        emb, opt = train(root, kind, model, resume=True)
        w, rec, n = _state(emb, opt)
        want_w, want_rec, want_n = reference(kind, model)
        assert n == want_n == STEPS
        np.testing.assert_array_equal(w, want_w)
        np.testing.assert_array_equal(rec, want_rec)
        opt.close()
        if isinstance(emb, DiskEmbedding):
            emb.close()
        resumed_at.append(count)
    return resumed_at


SIGNALS = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}


def test_preempted_loop_resumes_exactly_few(server, reference, tmp_path, kind):
    """SIGTERM once per kind by default (the slow test below: 8 per kind and signal)."""
    got = _trials(server, reference, tmp_path, kind, signal.SIGTERM, trials=1,
                  seed=KINDS.index(kind))
    print(f"\n{kind} sigterm: resumed at {got}")


@pytest.mark.slow
@pytest.mark.parametrize("sig", SIGNALS)
def test_preempted_loop_resumes_exactly_many(server, reference, tmp_path, kind, sig):
    got = _trials(server, reference, tmp_path, kind, SIGNALS[sig], trials=8,
                  seed=100 + KINDS.index(kind) * 10 + len(sig))
    print(f"\n{kind} {sig}: resumed at {got}")
    assert len(set(got)) > 1  # the stops landed at different moments
