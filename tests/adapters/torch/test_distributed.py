"""adapters.torch_dist: ShardedDiskEmbedding over torch.distributed (gloo on loopback).

The multi-process tests spawn worker processes running this very file (``python
tests/adapters/torch/test_distributed.py worker SCENARIO RANK WORLD PORT TMP``), rendezvous
through a ``TCPStore`` owned by the test (port chosen by the OS, 127.0.0.1 only), and compare
what they leave on disk with a single process training a ``DiskEmbedding`` on the concatenation
of all ranks' batches. Every wait is bounded and every worker is killed in ``finally``.

Scenarios (run as ``A``, then ``B`` and ``C`` side by side):

A  2 ranks, DDP dense layer, ``grad_reduce="mean"``, K steps; checkpoint at step K1.
B  2 ranks resume from A's checkpoint (exact: bit-identical to A), checkpoint at step K, then
   rank 1 ``os._exit``\\ s after a forward and rank 0's backward must raise
   ShardExchangeError within the timeout.
C  3 ranks: the 2-rank checkpoint and state_dir (resume=True) are refused, and so is a
   re-run on that state_dir without resume=True (FileExistsError); a refused batch on one rank
   raises on all and leaves the group usable; then resume from the checkpoint resharded
   offline to 3 ranks (plan "range", bag mode "sum", ``grad_reduce="sum"``, an empty batch
   on one rank) and match the single-process run; the all_gather fallback exchange agrees
   with all_to_all. Finally rank 2 gets stuck (sleeps) and ranks 0 and 1 raise
   ShardExchangeError after the module's timeout.
R  2 ranks with the reduced state: row-wise v, then row-wise v + bfloat16 m; a checkpoint,
   and reopening with the other settings refused without writing.
L  2 ranks, in-place and log-structured shards side by side (see its section).

The in-process tests use a gloo group of one rank (a ``HashStore``, no sockets): re-runs that
need ``resume=True`` or ``overwrite=True``, outdated States, the shard format module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import dsa_core
from dsa_core import _layout
from helpers import assert_same_bits, evicted

N, D, B, F = 40, 8, 5, 3          # table rows, dim, bags per rank, ids per bag
K1, K = 3, 6                      # checkpoint step, last step
PAD = 5
LR_EMB, LR_DENSE = 0.05, 0.01
HANG = 6.0                        # seconds a stuck rank sleeps (scenario C)
GROUP_TIMEOUT = 20.0              # seconds: the process group's timeout in the workers
TOL = {"rtol": 1e-5, "atol": 3e-6}
HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]


# -- the data (identical in workers and reference) ------------------------------------------------
def batch(step: int, rank: int, world: int) -> np.ndarray:
    """Ids (B, F) of ``rank`` at ``step``: duplicates within and across ranks, the padding
    row, a step where every id belongs to rank 0 (the other shards get no row), and an empty
    batch on rank 2 at step 5."""
    rng = np.random.default_rng([step, rank, world])
    ids = rng.integers(0, N, (B, F), dtype=np.int64)
    ids[0, :2] = 0                 # on every rank, twice
    ids[1, 0] = 7 + step % 2
    ids[2, 0] = PAD
    if step in (2, 5):
        ids = (ids // world) * world
    if world == 3 and step == 5 and rank == 2:
        ids = ids[:0]
    return ids


def target(step: int, rank: int, world: int, rows: int) -> np.ndarray:
    rng = np.random.default_rng([1000 + step, rank, world])
    return rng.standard_normal((rows, 2)).astype(np.float32)


def init_table() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal((N, D)) * 0.5).astype(np.float32)


class Net(torch.nn.Module):
    """The sharded embedding and a small dense layer (DDP-wrapped as a whole)."""

    def __init__(self, emb):
        super().__init__()
        self.emb, self.dense = emb, make_dense()

    def forward(self, ids):
        return self.dense(self.emb(ids)).reshape(-1, 2)


def make_dense():
    torch.manual_seed(0)
    return torch.nn.Linear(D, 2)


def world_of(scenario: str, step: int) -> int:
    return 3 if scenario == "C" and step > K1 else 2


# -- the worker -----------------------------------------------------------------------------------
def join_group(rank: int, world: int, port: int, backend: str = "gloo") -> None:
    """Join the workers' process group through the test's TCPStore (bounded waits)."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=GROUP_TIMEOUT))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=GROUP_TIMEOUT))


def _worker(scenario: str, rank: int, world: int, port: int, tmp: Path) -> None:
    from adapters.torch_dist import (
        DiskSparseAdam,
        ShardedDiskEmbedding,
        ShardExchangeError,
        ddp_ignore,
    )

    join_group(rank, world, port)
    out: dict = {"losses": {}}

    def save():
        (tmp / f"{scenario}_rank{rank}.json").write_text(json.dumps(out))

    common = {"padding_idx": PAD, "init": init_table()}
    if scenario == "C":
        common.update(plan="range", mode="sum", grad_reduce="sum")
        # the 2-rank checkpoint, the 2-rank state_dir resumed, and re-run without resume=True
        for state_dir, kwargs in (("C", {"resume_from": tmp / "ckpt"}),
                                  ("A", {"resume": True}), ("A", {})):
            try:
                ShardedDiskEmbedding(N, D, state_dir=tmp / state_dir, **common, **kwargs)
                out.setdefault("refused", []).append(None)
            except (ValueError, FileExistsError) as exc:
                out.setdefault("refused", []).append([type(exc).__name__, str(exc)])
        emb = ShardedDiskEmbedding(N, D, state_dir=tmp / "C", resume_from=tmp / "ckpt3",
                                   **common)
        bad = torch.tensor([1, 2, N + 3 if rank == 1 else 3])  # rank 1 refuses its batch
        try:
            emb.lookup(bad)
            out["bad_batch"] = None
        except IndexError as exc:
            out["bad_batch"] = str(exc)
    else:
        common["grad_reduce"] = "mean"
        if scenario == "A":  # bounded waits (async_op + Work.wait) on every exchange
            emb = ShardedDiskEmbedding(N, D, state_dir=tmp / "A", timeout=GROUP_TIMEOUT,
                                       **common)
        else:
            emb = ShardedDiskEmbedding(N, D, state_dir=tmp / "B", resume_from=tmp / "ckpt",
                                       **common)
    net = Net(emb)
    assert ddp_ignore(net) == ["emb.weight"]  # DDP for the dense part only
    first = 1
    dopt = torch.optim.Adam(net.dense.parameters(), lr=LR_DENSE)
    if scenario != "A":
        saved = torch.load(tmp / "dense_K1.pt")
        net.dense.load_state_dict(saved["dense"])
        dopt.load_state_dict(saved["opt"])
        first = K1 + 1
    ddp = torch.nn.parallel.DistributedDataParallel(net)
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    for step in range(first, K + 1):
        ids = torch.from_numpy(batch(step, rank, world))
        tgt = torch.from_numpy(target(step, rank, world, B if emb.mode else B * F))
        y = ddp(ids)
        loss = (y.tanh() * tgt[:y.shape[0]]).sum()
        loss.backward()
        opt.step()
        dopt.step()
        opt.zero_grad()
        dopt.zero_grad()
        out["losses"][step] = float(loss.detach())
        if scenario == "A" and step == K1:
            emb.checkpoint(tmp / "ckpt")
            if rank == 0:
                torch.save({"dense": net.dense.state_dict(), "opt": dopt.state_dict()},
                           tmp / "dense_K1.pt")
            dist.barrier()
    out["count"] = emb.store.count
    out["stats"] = emb.comm_stats
    out["dense"] = net.dense.weight.detach().tolist()
    if scenario == "C":
        np.save(tmp / f"C_lookup{rank}.npy", emb.lookup(torch.arange(N)).numpy())
        comm = emb._core.comm  # the all_gather fallback must route exactly as all_to_all
        rng = np.random.default_rng(rank)
        counts = torch.from_numpy(rng.integers(0, 4, world))
        x = torch.from_numpy(rng.standard_normal((int(counts.sum()), 3)).astype(np.float32))
        r1 = comm.route(counts)
        y1 = comm.send(x, r1, "ids")
        comm.method = "all_gather"
        r2 = comm.route(counts)
        y2 = comm.send(x, r2, "ids")
        back = comm.send(y2, r2.reverse(), "ids")
        comm.method = "all_to_all"
        out["fallback_ok"] = bool(torch.equal(y1, y2) and torch.equal(back, x)
                                  and r1.recv == r2.recv)
        # a stuck (not dead) rank: the others give up after the module's timeout
        emb.flush()
        save()
        if rank == 2:
            time.sleep(HANG)
            os._exit(0)
        comm.timeout = timedelta(seconds=HANG / 3)
        t0 = time.monotonic()
        try:
            emb.lookup(torch.arange(3))
            out["hang"] = None
        except ShardExchangeError as exc:
            out["hang"] = {"message": str(exc), "seconds": time.monotonic() - t0}
        save()
        os._exit(0)
    if scenario == "B":
        emb.checkpoint(tmp / "ckptB")
        save()
        x = emb(torch.from_numpy(batch(K + 1, rank, world)))  # both ranks: forward
        if rank == 1:
            os._exit(3)  # dies in the middle of a step, after its checkpoint
        t0 = time.monotonic()
        try:
            x.sum().backward()  # the gradient exchange finds rank 1 gone
            out["dead"] = None
        except ShardExchangeError as exc:
            out["dead"] = {"message": str(exc), "seconds": time.monotonic() - t0}
        save()
        os._exit(0)  # the group is broken: no orderly teardown
    emb.close()
    save()
    dist.destroy_process_group()


# the reduced-state settings of scenario R, by state_dir
REDUCED = {"R1": ("rowwise", "full"), "R2": ("rowwise", "bfloat16")}


def reduced_loss(x: torch.Tensor, step: int, rank: int, world: int) -> torch.Tensor:
    """A loss of the looked-up rows only (no dense layer): the same in worker and reference."""
    x = x.reshape(-1, D)
    return (x[:, :2].tanh() * torch.from_numpy(target(step, rank, world, len(x)))).sum()


def _reduced_worker(rank: int, world: int, port: int, tmp: Path) -> None:
    import hashlib

    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    join_group(rank, world, port)
    out: dict = {"refused": []}
    for name, (sm, fm) in REDUCED.items():
        emb = ShardedDiskEmbedding(N, D, state_dir=tmp / name, padding_idx=PAD,
                                   init=init_table(), second_moment=sm, first_moment=fm)
        opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
        for step in range(1, K + 1):
            ids = torch.from_numpy(batch(step, rank, world))
            reduced_loss(emb(ids), step, rank, world).backward()
            opt.step()
            opt.zero_grad()
            if name == "R2" and step == K1:
                emb.checkpoint(tmp / "ckptR")
        out[name] = {"second_moment": emb.store.second_moment,
                     "first_moment": emb.store.first_moment, "count": emb.store.count}
        opt.close()
        emb.close()

    def digest():
        return hashlib.sha256((tmp / "R2" / f"rank{rank}" / "rows.dsa").read_bytes()).hexdigest()

    before = digest()
    for kw in ({"second_moment": "elementwise", "first_moment": "bfloat16", "resume": True},
               {"second_moment": "rowwise", "resume": True},
               {"second_moment": "rowwise", "first_moment": "bfloat16",
                "resume_from": tmp / "ckptR", "curvature": 0.5}):
        try:
            ShardedDiskEmbedding(N, D, state_dir=tmp / "R2", padding_idx=PAD, **kw).close()
            out["refused"].append(None)
        except ValueError as exc:
            out["refused"].append(str(exc))
    out["unchanged"] = digest() == before
    (tmp / f"R_rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    # Like B and C, no orderly teardown: after the refused constructions, a rank sometimes
    # aborted inside destroy_process_group / interpreter exit ("terminate called without an
    # active exception"), with its results already written: 2-3 runs in 10 without this
    # barrier, and once in a full clean-clone suite run with it. Not DSA's code (nothing is
    # written by a refused construction); cause not found.
    os._exit(0)


# -- process management ---------------------------------------------------------------------------
class Launch:
    """``world`` workers of one scenario around a TCPStore of this process.

    The workers run ``script`` (this file by default) as
    ``python SCRIPT worker SCENARIO RANK WORLD PORT TMP``.
    """

    def __init__(self, scenario: str, world: int, tmp: Path, script: Path = HERE):
        self.scenario, self.world = scenario, world
        self.store = dist.TCPStore("127.0.0.1", 0, world, is_master=True,
                                   wait_for_workers=False, timeout=timedelta(seconds=30))
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1",
                   MASTER_ADDR="127.0.0.1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
                   GLOO_SOCKET_IFNAME="lo0" if sys.platform == "darwin" else "lo")
        self.procs = []
        self.logs = []
        for r in range(world):
            log = (tmp / f"{scenario}_rank{r}.log").open("w+")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, str(script), "worker", scenario, str(r), str(world),
                 str(self.store.port), str(tmp)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))

    def wait(self, deadline: float) -> list[int]:
        rcs = []
        try:
            for p in self.procs:
                rcs.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            pytest.fail(f"scenario {self.scenario}: workers still running at the deadline\n"
                        + self.output())
        finally:
            self.kill()
        return rcs

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        for log in self.logs:
            log.close()

    def output(self) -> str:
        text = []
        for r, log in enumerate(self.logs):
            log.flush()
            log.seek(0)
            text.append(f"--- {self.scenario} rank {r} ---\n{log.read()[-4000:]}")
        return "\n".join(text)


def result(tmp: Path, scenario: str, rank: int) -> dict:
    return json.loads((tmp / f"{scenario}_rank{rank}.json").read_text())


def assemble(root: Path, world: int, plan: str = "mod") -> dict[str, np.ndarray]:
    """The global table (weights, m, v) and counts from the shards under ``root``."""
    import dsa_core
    from adapters.torch_dist import ShardPlan

    sp = ShardPlan(N, world, plan)
    out = {"w": np.zeros((N, D), np.float32), "m": np.zeros((N, D), np.float32),
           "v": np.zeros((N, D), np.float32), "counts": []}
    for k in range(world):
        st = dsa_core.open(root / f"rank{k}", mode="r")
        g = sp.global_ids(k, np.arange(st.num_rows))
        out["w"][g], out["m"][g], out["v"][g] = st.weights, st.exp_avg, st.exp_avg_sq
        out["counts"].append(st.count)
        dsa_core.close(st)
    return out


def reference(tmp: Path, scenario: str) -> dict:
    """One process, DiskEmbedding + DiskSparseAdam on the concatenated batches."""
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    emb = DiskEmbedding(N, D, state_dir=tmp / f"ref{scenario}", padding_idx=PAD,
                        init=init_table())
    dense = make_dense()
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    dopt = torch.optim.Adam(dense.parameters(), lr=LR_DENSE)
    losses = {}
    for step in range(1, K + 1):
        w = world_of(scenario, step)
        c_phase = scenario == "C" and step > K1
        emb.mode = "sum" if c_phase else None
        ids = [batch(step, r, w) for r in range(w)]
        tgt = [target(step, r, w, len(i) if c_phase else len(i) * F) for r, i in
               enumerate(ids)]
        x = emb(torch.from_numpy(np.concatenate(ids)))
        y = dense(x).reshape(-1, 2)
        loss = (y.tanh() * torch.from_numpy(np.concatenate(tgt))).sum()
        s_emb = 1.0 if c_phase else 1.0 / w  # grad_reduce "sum" in C, "mean" in A/B
        (loss * s_emb).backward()
        for p in dense.parameters():  # DDP averages the dense gradients
            p.grad.mul_((1.0 / w) / s_emb)
        opt.step()
        dopt.step()
        opt.zero_grad()
        dopt.zero_grad()
        losses[str(step)] = float(loss.detach())
    st = emb.store
    out = {"w": st.weights.copy(), "m": st.exp_avg.copy(), "v": st.exp_avg_sq.copy(),
           "count": st.count, "losses": losses, "dense": dense.weight.detach().numpy()}
    opt.close()
    emb.close()
    return out


def reduced_reference(tmp: Path, name: str) -> dict:
    """One process, DiskEmbedding + DiskSparseAdam with scenario R's settings."""
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    sm, fm = REDUCED[name]
    emb = DiskEmbedding(N, D, state_dir=tmp / f"ref{name}", padding_idx=PAD,
                        init=init_table(), second_moment=sm, first_moment=fm)
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    for step in range(1, K + 1):
        ids = [batch(step, r, 2) for r in range(2)]
        loss = sum(reduced_loss(emb(torch.from_numpy(i)), step, r, 2) for r, i in enumerate(ids))
        loss.backward()
        opt.step()
        opt.zero_grad()
    st = emb.store
    out = {"w": st.weights.copy(), "m": st.exp_avg.copy(), "v": st.exp_avg_sq.copy()}
    opt.close()
    emb.close()
    return out


def close_(a, b, tol=TOL):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


# -- tests ----------------------------------------------------------------------------------------
def test_plans_and_paths(tmp_path):
    from adapters.torch_dist import ShardPlan, shard_path

    for kind in ("mod", "range"):
        for n, w in ((10, 3), (40, 2), (7, 7), (11, 4)):
            sp = ShardPlan(n, w, kind)
            ids = np.arange(n)
            own, loc = sp.owner(ids), sp.local(ids)
            assert sum(sp.local_rows(k) for k in range(w)) == n
            for k in range(w):
                g = sp.global_ids(k, np.arange(sp.local_rows(k)))
                assert (own[g] == k).all() and (loc[g] == np.arange(len(g))).all()
            t = torch.arange(n)  # torch tensors give the same plan
            assert torch.equal(sp.owner(t), torch.from_numpy(own))
    assert ShardPlan(10, 3).local_rows(0) == 4 and ShardPlan(10, 3, "range").local_rows(2) == 2
    with pytest.raises(ValueError, match="own no row"):
        ShardPlan(9, 4, "range")
    with pytest.raises(ValueError, match="own no row"):
        ShardPlan(2, 3)
    assert shard_path(tmp_path, 2, 4) == tmp_path / "rank2"
    assert shard_path("/x/r{rank}of{world_size}", 1, 3) == Path("/x/r1of3")


def test_needs_a_process_group(tmp_path):
    from adapters.torch_dist import ShardedDiskEmbedding

    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedDiskEmbedding(10, 4, state_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.fixture
def one_rank():
    """A gloo process group of one rank in this process (no sockets: a HashStore)."""
    if dist.is_initialized():
        pytest.skip("a process group is initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tree(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``root``: size, mtime and contents (to show nothing was touched)."""
    return {str(f.relative_to(root)): (f.stat().st_size, f.stat().st_mtime_ns, f.read_bytes())
            for f in sorted(root.rglob("*")) if f.is_file()}


def train_one_step(emb, opt, ids=(1, 2, 2, 7)) -> None:
    (emb(torch.tensor(ids)) ** 2).sum().backward()
    opt.step()
    opt.zero_grad()


def test_rerun_needs_resume_or_overwrite(tmp_path, one_rank):
    """Existing shards are refused unless resume=True or overwrite=True says what to do
    (nothing on disk touched by a refusal); resume_from still replaces them by a checkpoint."""
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    root = tmp_path / "emb"
    emb = ShardedDiskEmbedding(N, D, state_dir=root, init=init_table())
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    train_one_step(emb, opt)
    emb.checkpoint(tmp_path / "ckpt")
    train_one_step(emb, opt)
    rows = emb.store.weights.copy()
    opt.close()
    emb.close()

    before = tree(tmp_path)
    with pytest.raises(FileExistsError) as err:
        ShardedDiskEmbedding(N, D, state_dir=root, init=init_table())
    msg = str(err.value)
    assert "resume=True" in msg and "overwrite=True" in msg and "Nothing was written" in msg
    assert str(root / "rank0") in msg
    for kw, exc, words in (({"resume": True, "overwrite": True}, ValueError, "contradict"),
                           ({"resume_from": tmp_path / "ckpt", "overwrite": True}, ValueError,
                            "pass one of them"),
                           ({"resume": 1}, TypeError, "True or False"),
                           ({"resume": True, "embedding_dim": D + 1}, ValueError,
                            "shard of another table")):
        kw = {"embedding_dim": D, **kw}
        with pytest.raises(exc, match=words):
            ShardedDiskEmbedding(N, state_dir=root, **kw)
    assert tree(tmp_path) == before  # every refusal: nothing written, nothing renamed

    emb = ShardedDiskEmbedding(N, D, state_dir=root, resume=True)  # continues: count 2
    assert emb.store.count == 2
    np.testing.assert_array_equal(emb.store.weights, rows)
    emb.close()
    emb = ShardedDiskEmbedding(N, D, state_dir=root, resume_from=tmp_path / "ckpt")
    assert emb.store.count == 1  # the checkpoint replaced the live shard
    emb.close()
    emb = ShardedDiskEmbedding(N, D, state_dir=root, overwrite=True, init="zeros")
    assert emb.store.count == 0 and not emb.store.weights.any()
    emb.close()
    fresh = tmp_path / "fresh"  # resume=True where there is nothing yet: creates
    emb = ShardedDiskEmbedding(N, D, state_dir=fresh, resume=True, init="zeros")
    assert emb.store.count == 0 and (fresh / "rank0" / "shard.json").exists()
    emb.close()


def test_stale_state_through_the_module(tmp_path, one_rank):
    """``emb.store`` read before an ``opt.step()`` is outdated, and stepping a shard behind
    the optimizer's back makes the module's own State outdated: both are refused."""
    import dsa_core
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding, read_manifest

    emb = ShardedDiskEmbedding(N, D, state_dir=tmp_path / "emb", init=init_table())
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    old = emb.store
    train_one_step(emb, opt)
    assert not old.current and emb.store.current and emb.store.count == 1
    with pytest.raises(dsa_core.StaleStateError):
        dsa_core.flush(old)
    with pytest.raises(dsa_core.StaleStateError):
        dsa_core.checkpoint(old, tmp_path / "old")
    assert not (tmp_path / "old").exists()

    dsa_core.step(emb.store, np.array([3]), np.ones((1, D), np.float32))  # behind its back
    with pytest.raises(dsa_core.StaleStateError, match="outdated"):
        emb.checkpoint(tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "ckpt")
    with pytest.raises(dsa_core.StaleStateError):
        train_one_step(emb, opt)
    opt.close()
    emb.close()


def test_row_options_in_shards(tmp_path, one_rank):
    """``per_row_step`` / ``decay_missed_steps`` are recorded in every shard description and
    checkpoint manifest, must match on resume (nothing written by a refusal), and the
    per-row fields move with their rows through a reshard."""
    import dsa_core
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding, read_manifest
    from adapters.torch_reshard import reshard

    rows = {"per_row_step": True, "decay_missed_steps": True}
    root = tmp_path / "emb"
    emb = ShardedDiskEmbedding(N, D, state_dir=root, init=init_table(), **rows)
    assert emb.store.per_row_step and emb.store.decay_missed_steps
    with pytest.raises(ValueError, match="decoupled_weight_decay=False"):
        DiskSparseAdam(emb.parameters(), lr=LR_EMB, weight_decay=0.1)
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB, weight_decay=0.1,
                         decoupled_weight_decay=True)
    train_one_step(emb, opt)
    train_one_step(emb, opt, ids=(3, 7))
    emb.checkpoint(tmp_path / "ckpt")
    st = emb.store
    assert st.row_steps[[1, 2, 3, 7, 0]].tolist() == [1, 1, 1, 2, 0]
    assert st.last_steps[[1, 2, 3, 7, 0]].tolist() == [1, 1, 2, 2, 0]
    assert emb.get_extra_state()["per_row_step"] is True
    meta = json.loads((root / "rank0" / "shard.json").read_text())
    man = read_manifest(tmp_path / "ckpt")
    for m in (meta, man):
        assert (m["per_row_step"], m["decay_missed_steps"]) == (True, True)
    opt.close()
    emb.close()
    before = tree(tmp_path)
    for kw in ({"resume": True, "per_row_step": False},
               {"resume_from": tmp_path / "ckpt", "decay_missed_steps": False}):
        (name, _), = [(k, v) for k, v in kw.items() if k in rows]
        with pytest.raises(ValueError, match=rf"shard of another table: {name} True there, "
                                             rf"False here"):
            ShardedDiskEmbedding(N, D, state_dir=root, **{**rows, **kw})
    assert tree(tmp_path) == before
    emb = ShardedDiskEmbedding(N, D, state_dir=root, resume=True, **rows)
    assert emb.store.count == 2 and emb.store.row_steps[7] == 2
    sd = emb.state_dict()
    emb.close()
    other = ShardedDiskEmbedding(N, D, state_dir=tmp_path / "other", init=init_table())
    with pytest.raises(RuntimeError, match=r"per_row_step \(saved True, here False\)"):
        other.load_state_dict(sd)
    other.close()
    # reshard (per-row shards): the row counts and last steps move with their rows, and the
    # new shards keep the weight decay that decay_missed_steps needs
    emb = ShardedDiskEmbedding(N, D, state_dir=tmp_path / "prs", init=init_table(),
                               per_row_step=True, decay_missed_steps=True)
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB, weight_decay=0.01,
                         decoupled_weight_decay=True)
    for ids in ((1, 2, 2, 7), (2, 30), (2,)):
        train_one_step(emb, opt, ids=ids)
    emb.checkpoint(tmp_path / "ck1")
    steps, last = emb.store.row_steps.copy(), emb.store.last_steps.copy()
    opt.close()
    emb.close()
    reshard(tmp_path / "ck1", tmp_path / "ck2", 2, "mod")
    assert read_manifest(tmp_path / "ck2")["per_row_step"] is True
    for k in range(2):
        sk = dsa_core.open(tmp_path / "ck2" / f"rank{k}", mode="r")
        assert sk.per_row_step and sk.decay_missed_steps and sk.count == 3
        assert (sk.weight_decay, sk.decoupled_weight_decay) == (0.01, True)
        np.testing.assert_array_equal(sk.row_steps, steps[k::2])
        np.testing.assert_array_equal(sk.last_steps, last[k::2])
        dsa_core.close(sk)


def test_shard_format(tmp_path):
    """The format module: manifests and shard descriptions are checked when read."""
    from adapters._torch_shards import (
        ShardPlan,
        manifest,
        read_manifest,
        read_shard_meta,
        shard_meta,
        write_manifest,
        write_shard_meta,
    )

    table = {"num_embeddings": N, "embedding_dim": D, "dtype": "float32", "curvature": 0.0,
             "padding_idx": PAD}  # written before the reduced state: its defaults apply
    plan = ShardPlan(N, 3, "range")
    assert ShardPlan.from_json(plan.to_json()) == plan
    with pytest.raises(ValueError, match="not a shard plan"):
        ShardPlan.from_json({"kind": "mod", "world_size": 2})
    man = manifest(plan, table, count=4)
    assert (man["second_moment"], man["first_moment"]) == ("elementwise", "full")
    assert man["local_rows"] == [14, 14, 12] and man["shards"] == ["rank0", "rank1", "rank2"]
    write_manifest(tmp_path, man)
    assert read_manifest(tmp_path) == man
    for bad, words in (({**man, "version": 2}, "format version 2"),
                       ({**man, "world_size": 2}, "contradicts itself"),
                       ({k: v for k, v in man.items() if k != "count"}, "lacks count"),
                       ({**man, "format": "other"}, "not a sharded-embedding manifest")):
        write_manifest(tmp_path, bad)
        with pytest.raises(ValueError, match=words):
            read_manifest(tmp_path)
    write_manifest(tmp_path, man)  # a flipped digit in the count: named, never read as 5
    text = (tmp_path / "dsa-sharded.json").read_text()
    (tmp_path / "dsa-sharded.json").write_text(text.replace('"count": 4', '"count": 5'))
    with pytest.raises(ValueError, match=r"dsa-sharded\.json.*checksum") as err:
        read_manifest(tmp_path)
    assert str(err.value).count("restore") == 1, err.value  # the remedy said once
    (tmp_path / "dsa-sharded.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON.*restore it from a checkpoint"):
        read_manifest(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a complete sharded checkpoint"):
        read_manifest(tmp_path / "nowhere")
    meta = shard_meta(plan, 2, table)
    assert (meta["rank"], meta["local_rows"]) == (2, 12)
    write_shard_meta(tmp_path, meta)
    assert read_shard_meta(tmp_path) == meta
    text = (tmp_path / "shard.json").read_text()
    (tmp_path / "shard.json").write_text(text.replace('"rank": 2', '"rank": 1'))
    with pytest.raises(ValueError, match=r"shard\.json.*checksum"):
        read_shard_meta(tmp_path)
    write_shard_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="no shard.json"):
        read_shard_meta(tmp_path / "nowhere")
    assert not list(tmp_path.glob("*.tmp*"))  # dsa_core.tools.write_json left no temporary


def test_public_seams_only():
    """The distributed modules import no private name of another module (the shard format
    is a module of its own) and no private dsa_core module."""
    import ast

    for name in ("_torch_dist", "_torch_shards", "torch_dist", "torch_reshard"):
        tree_ = ast.parse((ROOT / "adapters" / f"{name}.py").read_text())
        for node in ast.walk(tree_):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                assert not mod.startswith("dsa_core._"), (name, mod)
                assert not (name == "torch_reshard" and mod == "._torch_dist"), mod
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert mod == "__future__" or not private, (name, mod, private)
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("dsa_core._") for a in node.names), name
            elif isinstance(node, ast.Attribute) and node.attr in ("data", "layout"):
                base = node.value
                assert not (isinstance(base, ast.Attribute) and base.attr == "store"), \
                    (name, ast.unparse(node))


@pytest.mark.slow  # 36 s: three gloo launches; test_two_processes_log_shards_match_inplace
def test_two_and_three_processes(tmp_path):  # keeps two processes in the default suite
    """2 and 3 gloo processes == one process; exact resume; refusal; dead rank; reshard."""
    import dsa_core
    from adapters.torch_dist import read_manifest
    from adapters.torch_reshard import reshard

    t_start = time.monotonic()
    launches: list[Launch] = []
    try:
        a = Launch("A", 2, tmp_path)
        launches.append(a)
        assert a.wait(t_start + 60) == [0, 0], a.output()
        t_a = time.monotonic() - t_start
        # offline reshard of the step-K1 checkpoint: mod over 2 -> range over 3, bit-exact rows
        reshard(tmp_path / "ckpt", tmp_path / "ckpt3", 3, "range")
        b = Launch("B", 2, tmp_path)
        launches.append(b)
        c = Launch("C", 3, tmp_path)
        launches.append(c)
        rc_b = b.wait(time.monotonic() + 60)
        rc_c = c.wait(time.monotonic() + 60)
        assert rc_b == [0, 3], b.output()
        assert rc_c == [0, 0, 0], c.output()
    finally:
        for ln in launches:
            ln.close()
    t_bc = time.monotonic() - t_start - t_a
    print(f"scenario A {t_a:.1f} s, B and C {t_bc:.1f} s")

    # A: 2 processes == one process on the concatenated batches (dense DDP part included)
    ref = reference(tmp_path, "A")
    got = assemble(tmp_path / "A", 2)
    assert got["counts"] == [K, K]
    for key in "wmv":
        close_(got[key], ref[key])
    assert (got["w"][PAD] == 0).all()
    ra = [result(tmp_path, "A", r) for r in range(2)]
    for step in range(1, K + 1):
        close_(sum(r["losses"][str(step)] for r in ra), ref["losses"][str(step)],
               {"rtol": 1e-5, "atol": 1e-5})
    close_(ra[0]["dense"], ref["dense"])
    assert ra[0]["dense"] == ra[1]["dense"]
    # bytes sent to the other rank, as counted by the module == the exchange model
    for r in range(2):
        remote_ids = remote_rows = 0
        for step in range(1, K + 1):
            u = np.unique(batch(step, r, 2))
            remote_ids += int((u % 2 != r).sum())
            v = np.unique(batch(step, 1 - r, 2))
            remote_rows += int((v % 2 == r).sum())
        st = ra[r]["stats"]
        assert st["ids"] == 8 * remote_ids and st["grads"] == 4 * D * remote_ids
        assert st["rows"] == 4 * D * remote_rows
        assert st["counts"] == 8 * K and st["lookups"] == K and st["backwards"] == K

    # B: resumed with the same world size == A, bit for bit; its checkpoint is complete
    got_b = assemble(tmp_path / "B", 2)
    for key in "wmv":
        np.testing.assert_array_equal(got_b[key], got[key])
    rb = [result(tmp_path, "B", r) for r in range(2)]
    for r in range(2):
        for step in range(K1 + 1, K + 1):
            assert rb[r]["losses"][str(step)] == ra[r]["losses"][str(step)]
        assert rb[r]["dense"] == ra[r]["dense"]
    ck = read_manifest(tmp_path / "ckptB")
    assert (ck["world_size"], ck["count"], ck["plan"]["kind"]) == (2, K, "mod")
    got_ck = assemble(tmp_path / "ckptB", 2)
    for key in "wmv":
        np.testing.assert_array_equal(got_ck[key], got[key])
    assert read_manifest(tmp_path / "ckpt")["count"] == K1  # never touched by resumes
    # B: rank 1 died; rank 0 raised a clear error, quickly
    dead = rb[0]["dead"]
    assert dead is not None, b.output()
    assert dead["seconds"] < GROUP_TIMEOUT
    assert "rank 0 of 2" in dead["message"] and "resume_from" in dead["message"]
    assert "ckptB" in dead["message"]  # names the last complete checkpoint

    # reshard: the same global rows, bit for bit
    old, new = assemble(tmp_path / "ckpt", 2), assemble(tmp_path / "ckpt3", 3, "range")
    for key in "wmv":
        np.testing.assert_array_equal(old[key], new[key])
    assert new["counts"] == [K1] * 3 and read_manifest(tmp_path / "ckpt3")["world_size"] == 3
    snap = dsa_core.open(tmp_path / "ckpt3" / "rank2", mode="r")  # a plain dsa_core store
    assert (snap.count, snap.num_rows) == (K1, N - 2 * 14)
    dsa_core.close(snap)

    # C: refusals on every rank, then 3 processes == one process
    rc = [result(tmp_path, "C", r) for r in range(3)]
    for r in range(3):
        (ckpt_t, ckpt_msg), (dir_t, dir_msg), (rerun_t, rerun_msg) = rc[r]["refused"]
        assert ckpt_t == "ValueError" and "world size 2" in ckpt_msg
        assert "torch_reshard" in ckpt_msg
        assert dir_t == "ValueError" and "world size 2" in dir_msg
        # a re-run on existing shards (ranks 0 and 1 have one, rank 2 none) is refused on
        # every rank with the same error, which offers both ways on
        assert rerun_t == "FileExistsError" and "ranks [0, 1] found one" in rerun_msg
        assert "resume=True" in rerun_msg and "overwrite=True" in rerun_msg
        assert rc[r]["bad_batch"] and ("refused" in rc[r]["bad_batch"] or r == 1)
        assert rc[r]["fallback_ok"]
        assert rc[r]["count"] == K
    assert f"[0, {N})" in rc[1]["bad_batch"]
    for r in (0, 1):
        hang = rc[r]["hang"]
        assert hang is not None and HANG / 3 - 0.5 < hang["seconds"] < HANG, c.output()
        assert f"rank {r} of 3" in hang["message"] and "this module's timeout" in hang["message"]
    ref_c = reference(tmp_path, "C")
    got_c = assemble(tmp_path / "C", 3, "range")
    assert got_c["counts"] == [K] * 3
    for key in "wmv":
        close_(got_c[key], ref_c[key])
    for step in range(K1 + 1, K + 1):
        close_(sum(r["losses"][str(step)] for r in rc), ref_c["losses"][str(step)],
               {"rtol": 1e-5, "atol": 1e-5})
    close_(rc[0]["dense"], ref_c["dense"])
    for r in range(3):  # lookup() of the whole table from every rank
        np.testing.assert_array_equal(np.load(tmp_path / f"C_lookup{r}.npy"), got_c["w"])
    assert time.monotonic() - t_start < 120


def test_reduced_state_shards(tmp_path):
    """Shards with row-wise v (and bfloat16 m) train as one process does, keep their settings
    through checkpoint and reshard, and refuse to reopen with other settings."""
    import dsa_core
    from adapters.torch_dist import read_manifest
    from adapters.torch_reshard import reshard

    launch = Launch("R", 2, tmp_path)
    try:
        assert launch.wait(time.monotonic() + 90) == [0, 0], launch.output()
    finally:
        launch.close()
    res = [result(tmp_path, "R", r) for r in range(2)]
    for r in range(2):
        assert res[r]["R1"] == {"second_moment": "rowwise", "first_moment": "full",
                                "count": K}
        assert res[r]["R2"] == {"second_moment": "rowwise", "first_moment": "bfloat16",
                                "count": K}
        sm_msg, fm_msg, curv_msg = res[r]["refused"]
        assert sm_msg and "second_moment 'rowwise' there, 'elementwise' here" in sm_msg
        assert fm_msg and "first_moment 'bfloat16' there, 'full' here" in fm_msg
        assert curv_msg and "curvature" in curv_msg  # rowwise on the ball: refused up front
        assert res[r]["unchanged"]
    # row-wise v: one process on the concatenated batches, up to the duplicate-sum order
    got, ref = assemble(tmp_path / "R1", 2), reduced_reference(tmp_path, "R1")
    close_(got["w"], ref["w"])
    close_(got["m"], ref["m"])
    close_(got["v"][:, :1], ref["v"])
    # + bfloat16 m: the stochastic rounding draws from each shard's local row numbers, so
    # only the rounding differs. Each step's stored m is within one bfloat16 ulp (2^-7) of
    # its value, b1 = 0.9 decays older gaps (m apart by under 0.041 of its scale after K
    # steps), and a row-wise v lets a coordinate's |m_hat| / sqrt(v_hat) reach sqrt(D):
    # weights apart by under K * lr * 0.041 * sqrt(D) = 0.035
    got2, ref2 = assemble(tmp_path / "R2", 2), reduced_reference(tmp_path, "R2")
    assert np.abs(got2["w"] - ref2["w"]).max() < K * LR_EMB * 0.041 * np.sqrt(D)
    assert not np.array_equal(got2["m"], got["m"])  # it did store the rounded m
    assert (got2["m"].view(np.uint32) & 0xFFFF == 0).all()  # bfloat16 values
    man = read_manifest(tmp_path / "ckptR")
    assert (man["second_moment"], man["first_moment"], man["count"]) == \
        ("rowwise", "bfloat16", K1)
    # reshard keeps the settings and the rows, bit for bit
    reshard(tmp_path / "ckptR", tmp_path / "ckptR3", 3, "range")
    old, new = assemble(tmp_path / "ckptR", 2), assemble(tmp_path / "ckptR3", 3, "range")
    for key in "wmv":
        np.testing.assert_array_equal(old[key], new[key])
    st = dsa_core.open(tmp_path / "ckptR3" / "rank1", mode="r")
    assert (st.second_moment, st.first_moment) == ("rowwise", "bfloat16")
    dsa_core.close(st)


@pytest.mark.gpu
def test_nccl(tmp_path):
    """NCCL (tensors on the GPU): one rank per GPU, same results as one process."""
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs CUDA and NCCL")
    world = min(2, torch.cuda.device_count())
    t0 = time.monotonic()
    ln = Launch("N", world, tmp_path)
    try:
        assert ln.wait(t0 + 120) == [0] * world, ln.output()
    finally:
        ln.close()
    ids = [np.concatenate([batch(s, r, world) for r in range(world)]) for s in (1, 2, 3)]
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    emb = DiskEmbedding(N, D, state_dir=tmp_path / "refN", padding_idx=PAD, init=init_table())
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    for i in ids:
        (emb(torch.from_numpy(i)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    got = assemble(tmp_path / "N", world)
    close_(got["w"], emb.store.weights)
    close_(got["m"], emb.store.exp_avg)
    opt.close()
    emb.close()


def _nccl_worker(rank: int, world: int, port: int, tmp: Path) -> None:
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    torch.cuda.set_device(rank)
    join_group(rank, world, port, "nccl")
    emb = ShardedDiskEmbedding(N, D, state_dir=tmp / "N", padding_idx=PAD, init=init_table(),
                               device="cuda")
    opt = DiskSparseAdam(emb.parameters(), lr=LR_EMB)
    for step in (1, 2, 3):
        ids = torch.from_numpy(batch(step, rank, world)).cuda()
        (emb(ids) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    emb.close()
    dist.destroy_process_group()


# -- log-structured shards (was test_distributed_log.py) -------------------------------------------
# Every log shard gets a region far smaller than its rows, so rows are evicted, sealed into
# segments and read back during the runs. The oracle is the same run on in-place shards:
# training, checkpoints, resumes and reshards must give the same records, bit for bit.
# Scenario L (2 processes): in-place and log shards trained side by side on the same batches,
# both checkpointed at step K1; the log run resumed from its checkpoint in a new state_dir;
# resuming a store of the other kind refused on every rank.
NL = 200  # rows of the log scenario's table (D, PAD, K1, K as above)
LR = LR_EMB
SLOTS = 48  # region slots of each log shard: a step brings a shard at most 48 distinct rows


def lmemory(slots: int = SLOTS, **opts) -> int:
    """A region budget of ``slots`` records of a weights-and-moments float32 store."""
    lay = _layout.make_layout(NL, D, np.dtype(np.float32), 0.0, True, 0, **opts)
    return dsa_core.region_memory(lay, slots)


def linit_table() -> np.ndarray:
    return (np.random.default_rng(7).standard_normal((NL, D)) * 0.5).astype(np.float32)


def lbatch(step: int, rank: int) -> np.ndarray:
    """24 ids of ``rank`` at ``step``, duplicates within and across ranks, the padding row."""
    ids = np.random.default_rng([step, rank]).integers(0, NL, (6, 4), dtype=np.int64)
    ids[0, :2] = 0
    ids[1, 0] = PAD
    return ids


def lloss_of(x: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    tgt = np.random.default_rng([1000 + step, rank]).standard_normal(tuple(x.shape))
    return (x.tanh() * torch.from_numpy(tgt.astype(np.float32))).sum()


def ltrain(emb, opt, steps, rank: int = 0) -> None:
    for step in steps:
        lloss_of(emb(torch.from_numpy(lbatch(step, rank))), step, rank).backward()
        opt.step()
        opt.zero_grad()


def lrecords(root: Path, world: int, plan: str = "mod") -> tuple[np.ndarray, list, list]:
    """The global table's whole records, and each shard's count and kind, under ``root``."""
    from adapters.torch_dist import ShardPlan

    sp = ShardPlan(NL, world, plan)
    out, counts, kinds = None, [], []
    for k in range(world):
        st = dsa_core.open(root / f"rank{k}", mode="r")
        rec = dsa_core.read_records(st, np.arange(st.num_rows))
        if out is None:
            out = np.zeros((NL, rec.shape[1]), rec.dtype)
        out[sp.global_ids(k, np.arange(st.num_rows))] = rec
        counts.append(st.count)
        kinds.append(st.storage)
        dsa_core.close(st)
    return out, counts, kinds


# -- scenario L: 2 processes, log shards -----------------------------------------------------------
def _log_worker(rank: int, world: int, port: int, tmp: Path) -> None:
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    join_group(rank, world, port)
    out: dict = {"refused": []}
    log = {"storage": "log", "memory": lmemory()}
    ei = ShardedDiskEmbedding(NL, D, state_dir=tmp / "Li", padding_idx=PAD, init=linit_table())
    el = ShardedDiskEmbedding(NL, D, state_dir=tmp / "Ll", padding_idx=PAD, init=linit_table(),
                              **log)
    oi = DiskSparseAdam(ei.parameters(), lr=LR)
    ol = DiskSparseAdam(el.parameters(), lr=LR)
    for step in range(1, K + 1):
        ltrain(ei, oi, [step], rank)
        ltrain(el, ol, [step], rank)
        if step == K1:
            ei.checkpoint(tmp / "ckLi")
            el.checkpoint(tmp / "ckLl")
    out["storage"] = [ei.store.storage, el.store.storage]
    out["evicted"] = evicted(el.store)
    for x in (oi, ol, ei, el):
        x.close()
    # the log checkpoint resumed in a new state_dir: the same steps again
    er = ShardedDiskEmbedding(NL, D, state_dir=tmp / "Lr", padding_idx=PAD,
                              resume_from=tmp / "ckLl", **log)
    out["resumed_at"] = er.store.count
    opt = DiskSparseAdam(er.parameters(), lr=LR)
    ltrain(er, opt, range(K1 + 1, K + 1), rank)
    out["resumed_storage"] = er.store.storage
    opt.close()
    er.close()
    # a store of the other kind: refused on every rank, nothing written
    for kw in ({"state_dir": tmp / "Ll", "resume": True, "storage": "inplace"},
               {"state_dir": tmp / "Lx", "resume_from": tmp / "ckLi", **log}):
        try:
            ShardedDiskEmbedding(NL, D, padding_idx=PAD, **kw).close()
            out["refused"].append(None)
        except ValueError as exc:
            out["refused"].append(str(exc))
    e = ShardedDiskEmbedding(NL, D, state_dir=tmp / "Ll", padding_idx=PAD, resume=True, **log)
    out["count"] = e.store.count
    e.close()
    (tmp / f"L_rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    os._exit(0)  # as scenario R: no teardown after refused builds


def test_two_processes_log_shards_match_inplace(tmp_path):
    """2 gloo processes: log shards == in-place shards (training, checkpoint, resume_from),
    a store of the other kind is refused on every rank, and both checkpoints reshard to the
    same records."""
    from adapters.torch_reshard import reshard

    t0 = time.monotonic()
    launch = Launch("L", 2, tmp_path)
    try:
        assert launch.wait(t0 + 90) == [0, 0], launch.output()
    finally:
        launch.close()
    res = [result(tmp_path, "L", r) for r in range(2)]
    for r in range(2):
        assert res[r]["storage"] == ["inplace", "log"] and res[r]["evicted"]
        assert res[r]["resumed_at"] == K1 and res[r]["resumed_storage"] == "log"
        assert res[r]["count"] == K
        live, ckpt = res[r]["refused"]
        assert "storage='log' store, but storage='inplace' was asked for" in live
        assert "storage='inplace' store, but storage='log' was asked for" in ckpt
        assert "torch_reshard" in ckpt and "nothing was written" in ckpt
    assert not (tmp_path / "Lx").exists()
    ref, counts, kinds = lrecords(tmp_path / "Li", 2)
    assert counts == [K, K] and kinds == ["inplace"] * 2
    for root in ("Ll", "Lr"):
        got, counts, kinds = lrecords(tmp_path / root, 2)
        assert counts == [K, K] and kinds == ["log"] * 2
        assert_same_bits(got, ref)
    snap = dsa_core.open(tmp_path / "Li" / "rank1", mode="r")
    lay = snap.layout
    dsa_core.close(snap)
    assert not ref[PAD, lay["w"]:lay["w"] + D].any()  # the padding row: zeroed, never stepped
    ck_i, _, _ = lrecords(tmp_path / "ckLi", 2)
    ck_l, counts, kinds = lrecords(tmp_path / "ckLl", 2)
    assert counts == [K1, K1] and kinds == ["log"] * 2
    assert_same_bits(ck_l, ck_i)
    # offline reshards of the two checkpoints: 2 -> 3 (range) and 2 -> 1, each keeps its kind
    for world, plan in ((3, "range"), (1, "mod")):
        for kind in ("i", "l"):
            reshard(tmp_path / f"ckL{kind}", tmp_path / f"rs{kind}{world}", world, plan)
        a, ca, ka = lrecords(tmp_path / f"rsi{world}", world, plan)
        b, cb, kb = lrecords(tmp_path / f"rsl{world}", world, plan)
        assert ca == cb == [K1] * world
        assert ka == ["inplace"] * world and kb == ["log"] * world
        assert_same_bits(a, ck_i)
        assert_same_bits(b, ck_i)


# -- log shards on one rank, in this process (the fixture one_rank) ---------------------
def lbuild(root: Path, kind: str, **kw):
    from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding

    log = {"storage": "log", "memory": lmemory()} if kind == "log" else {}
    emb = ShardedDiskEmbedding(NL, D, state_dir=root, padding_idx=PAD, **log, **kw)
    return emb, DiskSparseAdam(emb.parameters(), lr=LR)


def test_one_rank_log_shard_resume_and_state_dict(tmp_path, one_rank):
    """One rank: resume=True and resume_from= on log shards continue exactly as in-place
    shards do; the state dict entry and extra_repr work the same."""
    runs = {}
    for kind in ("inplace", "log"):
        emb, opt = lbuild(tmp_path / kind, kind, init=linit_table())
        ltrain(emb, opt, range(1, 4))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        ltrain(emb, opt, range(4, 6))
        sd = emb.state_dict()
        assert sd["_extra_state"]["count"] == 5
        opt.close()
        emb.close()
        emb, opt = lbuild(tmp_path / kind, kind, resume=True)  # continues at step 5
        emb.load_state_dict(sd)
        ltrain(emb, opt, range(6, 8))
        assert emb.store.storage == kind and emb.store.count == 7
        runs[kind] = dsa_core.read_records(emb.store, np.arange(NL))
        if kind == "log":
            assert evicted(emb.store)
        opt.close()
        emb.close()
        emb, opt = lbuild(tmp_path / f"from-{kind}", kind, resume_from=tmp_path / f"ck-{kind}")
        ltrain(emb, opt, range(4, 8))
        assert emb.store.count == 7
        assert_same_bits(dsa_core.read_records(emb.store, np.arange(NL)), runs[kind])
        opt.close()
        emb.close()
    assert_same_bits(runs["log"], runs["inplace"])


@pytest.mark.parametrize("kw, exc, match", [
    ({"storage": "inplace", "memory": "1MiB"}, ValueError, "memory= is for storage='log'"),
    ({"storage": "lsm"}, ValueError, "storage must be one of"),
    ({"storage": "log", "memory": "lots"}, ValueError, "memory must be a number of bytes"),
])
def test_bad_storage_options_write_nothing(tmp_path, one_rank, kw, exc, match):
    from adapters.torch_dist import ShardedDiskEmbedding

    with pytest.raises(exc, match=match) as err:
        ShardedDiskEmbedding(NL, D, state_dir=tmp_path / "emb", **kw)
    assert "ShardedDiskEmbedding" in str(err.value)
    assert not (tmp_path / "emb").exists()


def test_other_kind_is_refused_and_nothing_written(tmp_path, one_rank):
    """resume=True and resume_from= on a store of the other kind: refused, untouched."""
    from adapters.torch_dist import ShardedDiskEmbedding

    for kind in ("inplace", "log"):
        emb, opt = lbuild(tmp_path / kind, kind, init=linit_table())
        ltrain(emb, opt, range(1, 3))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        opt.close()
        emb.close()
    before = tree(tmp_path)
    for have, want in (("inplace", "log"), ("log", "inplace")):
        log = {"storage": "log", "memory": lmemory()} if want == "log" else {"storage": "inplace"}
        for kw in ({"state_dir": tmp_path / have, "resume": True},
                   {"state_dir": tmp_path / want, "resume_from": tmp_path / f"ck-{have}"}):
            with pytest.raises(ValueError, match=rf"storage='{have}' store, but "
                                                 rf"storage='{want}' was asked for"):
                ShardedDiskEmbedding(NL, D, padding_idx=PAD, **log, **kw)
    assert tree(tmp_path) == before
    for have in ("inplace", "log"):  # storage="auto" (the default) resumes either kind
        mem = {"memory": lmemory()} if have == "log" else {}
        emb = ShardedDiskEmbedding(NL, D, state_dir=tmp_path / have, padding_idx=PAD,
                                   resume=True, **mem)
        assert emb.store.storage == have and emb.store.count == 2
        emb.close()
    # overwrite=True replaces a shard of the other kind
    emb = ShardedDiskEmbedding(NL, D, state_dir=tmp_path / "inplace", padding_idx=PAD,
                               overwrite=True, storage="log", memory=lmemory(), init="zeros")
    assert emb.store.storage == "log" and emb.store.count == 0
    emb.close()


def test_reshard_between_kinds_and_resume(tmp_path, one_rank):
    """reshard keeps a checkpoint's kind or converts it (--storage), bit for bit; a
    converted checkpoint resumes and trains as the original; mixed kinds are refused."""
    from adapters.torch_reshard import main, reshard

    for kind in ("inplace", "log"):
        emb, opt = lbuild(tmp_path / kind, kind, init=linit_table())
        ltrain(emb, opt, range(1, 4))
        emb.checkpoint(tmp_path / f"ck-{kind}")
        ltrain(emb, opt, range(4, 7))
        opt.close()
        emb.close()
    ref, _, _ = lrecords(tmp_path / "inplace", 1)
    ck, _, _ = lrecords(tmp_path / "ck-inplace", 1)
    # the CLI: in-place -> log, 1 -> 3 ranks; log -> in-place, 1 -> 2 ranks (range)
    assert main([str(tmp_path / "ck-inplace"), str(tmp_path / "to-log3"), "--world-size", "3",
                 "--storage", "log", "--memory", "1MiB"]) == 0
    reshard(tmp_path / "ck-log", tmp_path / "to-ip2", 2, "range", storage="inplace")
    for root, world, plan, kind in (("to-log3", 3, "mod", "log"),
                                    ("to-ip2", 2, "range", "inplace")):
        got, counts, kinds = lrecords(tmp_path / root, world, plan)
        assert counts == [3] * world and kinds == [kind] * world
        assert_same_bits(got, ck)
    # same world size, other kind: a converted checkpoint that resumes on one rank
    reshard(tmp_path / "ck-inplace", tmp_path / "conv", 1, storage="log")
    emb, opt = lbuild(tmp_path / "resumed", "log", resume_from=tmp_path / "conv")
    ltrain(emb, opt, range(4, 7))
    assert emb.store.storage == "log"
    assert_same_bits(dsa_core.read_records(emb.store, np.arange(NL)), ref)
    opt.close()
    emb.close()
    # refused before anything is written
    with pytest.raises(ValueError, match="memory= is for storage='log'"):
        reshard(tmp_path / "ck-inplace", tmp_path / "bad1", 2, memory="1MiB")
    with pytest.raises(ValueError, match="storage must be one of"):
        reshard(tmp_path / "ck-inplace", tmp_path / "bad2", 2, storage="lsm")
    mixed = tmp_path / "mixed"
    reshard(tmp_path / "ck-log", mixed, 2)
    shutil.rmtree(mixed / "rank1")
    reshard(tmp_path / "ck-inplace", tmp_path / "ip2", 2)
    shutil.copytree(tmp_path / "ip2" / "rank1", mixed / "rank1")
    with pytest.raises(ValueError, match="different store kinds"):
        reshard(mixed, tmp_path / "bad3", 3)
    assert not any((tmp_path / b).exists() for b in ("bad1", "bad2", "bad3"))


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "worker":
    _scen, _rank, _world, _port, _tmp = sys.argv[2], *map(int, sys.argv[3:6]), Path(sys.argv[6])
    if _scen == "N":
        _nccl_worker(_rank, _world, _port, _tmp)
    elif _scen == "R":
        _reduced_worker(_rank, _world, _port, _tmp)
    elif _scen == "L":
        _log_worker(_rank, _world, _port, _tmp)
    else:
        _worker(_scen, _rank, _world, _port, _tmp)


def test_adagrad_shards(tmp_path, one_rank):
    """A ShardedDiskEmbedding made for Adagrad (``optimizer=``) steps as DiskEmbedding with
    DiskSparseAdagrad does, records the optimizer in its shard description and checkpoint
    manifest, refuses a resume as another optimizer (nothing written), and a reshard keeps
    the optimizer, its hyperparameters and the accumulators with their rows."""
    import dsa_core
    from adapters.torch import DiskEmbedding, DiskSparseAdagrad
    from adapters.torch_dist import ShardedDiskEmbedding, read_manifest
    from adapters.torch_reshard import reshard

    kw = dict(lr=0.1, lr_decay=0.01, rowwise=True, weight_decay=0.01)
    emb = ShardedDiskEmbedding(N, D, state_dir=tmp_path / "emb", init=init_table(),
                               optimizer="rowwise_adagrad")
    ref = DiskEmbedding(N, D, state_dir=tmp_path / "ref", init=init_table(),
                        optimizer="rowwise_adagrad")
    opt, opt_ref = DiskSparseAdagrad(emb.parameters(), **kw), DiskSparseAdagrad(
        ref.parameters(), **kw)
    for ids in ((1, 2, 2, 7), (2, 30), (7,)):
        train_one_step(emb, opt, ids=ids)
        train_one_step(ref, opt_ref, ids=ids)
    assert emb.store.optimizer == "rowwise_adagrad"
    np.testing.assert_array_equal(dsa_core.read_records(emb.store, np.arange(N)),
                                  dsa_core.read_records(ref.store, np.arange(N)))
    emb.checkpoint(tmp_path / "ckpt")
    assert json.loads((tmp_path / "emb" / "rank0" / "shard.json").read_text())[
        "optimizer"] == "rowwise_adagrad"
    assert read_manifest(tmp_path / "ckpt")["optimizer"] == "rowwise_adagrad"
    recs = dsa_core.read_records(emb.store, np.arange(N))
    for o in (opt, opt_ref):
        o.close()
    emb.close()
    ref.close()
    before = tree(tmp_path)
    with pytest.raises(ValueError, match="shard of another table: optimizer "
                                         "'rowwise_adagrad' there, 'adam' here"):
        ShardedDiskEmbedding(N, D, state_dir=tmp_path / "emb", resume=True)
    assert tree(tmp_path) == before
    reshard(tmp_path / "ckpt", tmp_path / "ck2", 2, "mod")
    assert read_manifest(tmp_path / "ck2")["optimizer"] == "rowwise_adagrad"
    for k in range(2):
        sk = dsa_core.open(tmp_path / "ck2" / f"rank{k}", mode="r")
        assert (sk.optimizer, sk.count, sk.lr_decay) == ("rowwise_adagrad", 3, 0.01)
        np.testing.assert_array_equal(dsa_core.read_records(sk, np.arange(sk.num_rows)),
                                      recs[k::2])
        dsa_core.close(sk)
