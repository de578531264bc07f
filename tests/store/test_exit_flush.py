"""A store never closed loses nothing at interpreter exit, whatever runs in the background.

Each case runs a short training loop in a subprocess that ends without ``close`` while one
background activity of the store is on: the log store's segment writer (seals written
behind), its cleaning reads (a small region and a tight ``space_ratio``, so every seal
cleans and reads the next segment ahead on a thread pool), its read-ahead of the next batch
(``dsa_core.prefetch``), its commit log (``durability="step"``); the in-place store's
read-ahead and undo journal. The store must then reopen at the last step, bit for bit the
rows of a run that closed properly. If the exit-time flush fails (a full disk, injected),
the process says so on stderr and exits non-zero, and the store reopens at its last flush
(log) or refuses as an unclean stop (in place): never silently behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dsa_core

ROOT = Path(__file__).resolve().parents[2]
ROWS, DIM, BATCH = 2000, 16, 60

WORKER = r'''
import json, sys, numpy as np, dsa_core


def run(cfg):
    path, kind, mode = cfg["path"], cfg["kind"], cfg["mode"]
    kw = dict(storage="inplace")
    if kind == "log":
        kw = dict(storage="log", memory=cfg["memory"])
        if mode == "cleaning":
            kw["space_ratio"] = 1.2
    if mode == "step":
        kw["durability"] = "step"
    s = dsa_core.create(path, cfg["rows"], cfg["dim"], init="normal", seed=3, **kw)
    rng = np.random.default_rng(7)
    for i in range(cfg["steps"]):
        idx = rng.choice(cfg["rows"], cfg["batch"], replace=False)
        g = rng.standard_normal((cfg["batch"], cfg["dim"])).astype(np.float32)
        s = dsa_core.step(s, idx, g)
        if cfg["flush_every"] and (i + 1) % cfg["flush_every"] == 0:
            dsa_core.flush(s)
        if mode == "prefetch":  # the last read-ahead is still queued at exit
            dsa_core.prefetch(s, rng.choice(cfg["rows"], cfg["batch"], replace=False))
    if kind == "log" and mode == "cleaning":
        assert s.store.log_stats()["cleaned_segments"] > 0, "the store did not clean"
    print("stepped", path, s.count, flush=True)
    return s


def full_disk(*a, **k):
    raise OSError(28, "No space left on device (injected)")


cfgs = json.loads(sys.argv[1])
keep = [run(cfg) for cfg in cfgs]  # every store left open: the exit must flush them all
if any(cfg.get("fail") for cfg in cfgs):
    import dsa_core._layout
    import dsa_core._log.commit
    dsa_core._log.commit.write_manifest = full_disk
    dsa_core._layout.write_manifest = full_disk
# no close: the interpreter's exit must flush
'''


def _cfg(tmp_path: Path, kind: str, mode: str, **extra) -> dict:
    """One store of the worker: ``kind`` with the background activity ``mode`` on."""
    probe = dsa_core.create(tmp_path / "probe", ROWS, DIM, storage="log", memory="1MiB",
                            overwrite=True)
    memory = dsa_core.region_memory(probe, BATCH + 4)  # a small region: seals and cleaning
    dsa_core.close(probe)
    cfg = dict(path=str(tmp_path / f"{kind}-{mode}"), kind=kind, mode=mode, rows=ROWS, dim=DIM,
               batch=BATCH, steps=57, flush_every=20, memory=memory)
    cfg.update(extra)
    return cfg


def _run(cfgs: list[dict]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", WORKER, json.dumps(cfgs)], env=env,
                          capture_output=True, text=True, timeout=300)


def _reference(tmp_path: Path, cfg: dict, steps: int) -> np.ndarray:
    """The rows after ``steps`` steps of the same stream, in an in-place store closed."""
    s = dsa_core.create(tmp_path, cfg["rows"], cfg["dim"], init="normal", seed=3)
    rng = np.random.default_rng(7)
    for _ in range(cfg["steps"]):
        idx = rng.choice(cfg["rows"], cfg["batch"], replace=False)
        g = rng.standard_normal((cfg["batch"], cfg["dim"])).astype(np.float32)
        if s.count < steps:
            s = dsa_core.step(s, idx, g)
        if cfg["mode"] == "prefetch":
            rng.choice(cfg["rows"], cfg["batch"], replace=False)
    out = dsa_core.read_records(s, np.arange(cfg["rows"]))
    dsa_core.close(s)
    return out


CASES = [("log", "writer"), ("log", "cleaning"), ("log", "prefetch"), ("log", "step"),
         ("inplace", "writer"), ("inplace", "prefetch"), ("inplace", "step")]


def test_exit_without_close_reopens_at_last_step(tmp_path):
    """Every case's store in one process (one interpreter start): each left open."""
    cfgs = [_cfg(tmp_path, kind, mode) for kind, mode in CASES]
    r = _run(cfgs)
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr, r.stderr
    for cfg in cfgs:
        s = dsa_core.open(cfg["path"], mode="r")
        try:
            assert s.count == cfg["steps"], cfg
            got = dsa_core.read_records(s, np.arange(ROWS))
        finally:
            dsa_core.close(s)
        ref = _reference(tmp_path / cfg["kind"] / cfg["mode"], cfg, cfg["steps"])
        np.testing.assert_array_equal(got, ref, err_msg=str(cfg))


def test_failed_exit_flush_says_so_and_exits_nonzero(tmp_path):
    """Both kinds in one process; their exit flushes fail (a full disk, injected)."""
    cfgs = [_cfg(tmp_path, "log", "cleaning", fail=True),
            _cfg(tmp_path, "inplace", "writer", fail=True)]
    r = _run(cfgs)
    for cfg in cfgs:
        assert f"stepped {cfg['path']} {cfg['steps']}" in r.stdout, r.stderr
    assert r.returncode != 0, (r.returncode, r.stderr)
    assert "No space left on device" in r.stderr
    for cfg in cfgs:
        assert "flushing unclosed" in r.stderr and cfg["path"] in r.stderr, r.stderr
    for cfg in cfgs:  # both kinds: exactly the last flush (in place: from its undo file)
        last_flush = cfg["steps"] // cfg["flush_every"] * cfg["flush_every"]
        for mode in ("r", "r+"):
            s = dsa_core.open(cfg["path"], mode=mode)
            try:
                assert s.count == last_flush
                got = dsa_core.read_records(s, np.arange(ROWS))
            finally:
                dsa_core.close(s)
            np.testing.assert_array_equal(
                got, _reference(tmp_path / f"ref-{cfg['kind']}-{mode}", cfg, last_flush))


GONE = r'''
import os, shutil, sys, tempfile, numpy as np, dsa_core


def train(path, kind):
    s = dsa_core.create(path, 50, 4, storage=kind, init="normal", seed=1)
    return dsa_core.step(s, np.arange(5), np.ones((5, 4), np.float32))


case, base = sys.argv[1], sys.argv[2]
keep = []
for kind in ("inplace", "log"):
    if case == "gone":
        with tempfile.TemporaryDirectory(dir=base) as d:  # left without close: deleted
            keep.append(train(os.path.join(d, "t"), kind))
        path = os.path.join(base, kind + "-recreated")
        keep.append(train(path, kind))
        shutil.rmtree(path)
        os.mkdir(path)  # deleted and recreated empty: still nothing to lose
        path = os.path.join(base, kind + "-collected")
        s = train(path, kind)
        shutil.rmtree(path)
        del s  # the garbage-collection flush of a deleted store
    elif case == "replaced":  # deleted, and another store made at its path
        path = os.path.join(base, kind)
        keep.append(train(path, kind))
        shutil.rmtree(path)
        dsa_core.close(dsa_core.create(path, 50, 4, storage=kind, seed=9))
    else:  # "moved": a real store, no longer at its path: its steps are lost, say so
        path = os.path.join(base, kind)
        keep.append(train(path, kind))
        os.rename(path, path + "-moved")
print("trained", case, flush=True)
# no close: the interpreter's exit flushes whatever is left
'''


def _run_gone(tmp_path: Path, case: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", GONE, case, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=120)


def test_exit_flush_of_a_deleted_store_is_no_failure(tmp_path):
    """Both kinds: a store left open in a TemporaryDirectory (deleted at the end of the
    ``with``), one whose directory was deleted and recreated empty, and one deleted then
    garbage-collected: nothing can be lost, so the process prints nothing and exits 0, and
    the empty directory stays empty (no partial store is written into it)."""
    r = _run_gone(tmp_path, "gone")
    assert "trained gone" in r.stdout, r.stderr
    assert r.stderr == "" and r.returncode == 0, (r.returncode, r.stderr)
    for kind in ("inplace", "log"):
        assert os.listdir(tmp_path / f"{kind}-recreated") == []
        assert not (tmp_path / f"{kind}-collected").exists()


def test_exit_flush_of_a_moved_store_still_fails(tmp_path):
    """Both kinds: a store whose directory was moved away is real (its lock file is still
    linked), so its exit flush is not skipped: it fails, says so and exits 1."""
    r = _run_gone(tmp_path, "moved")
    assert "trained moved" in r.stdout, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)
    for kind in ("inplace", "log"):
        assert f"flushing unclosed" in r.stderr and str(tmp_path / kind) in r.stderr, r.stderr


def test_exit_flush_never_writes_into_another_store_at_its_path(tmp_path):
    """Both kinds: a store deleted while open, and a new store created at its path: the old
    one's exit flush must not write its rows or count into the new one (it used to: the new
    store silently became the old one's partial state, or took its count). It says so and
    exits 1; the new store reopens as created."""
    r = _run_gone(tmp_path, "replaced")
    assert "trained replaced" in r.stdout, r.stderr
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Not flushing into it" in r.stderr and "another store now stands" in r.stderr, \
        r.stderr
    for kind in ("inplace", "log"):
        s = dsa_core.open(tmp_path / kind, mode="r")
        try:
            assert s.count == 0
            want = dsa_core.create(tmp_path / f"ref-{kind}", 50, 4, storage=kind, seed=9)
            np.testing.assert_array_equal(dsa_core.read_records(s, np.arange(50)),
                                          dsa_core.read_records(want, np.arange(50)))
            dsa_core.close(want)
        finally:
            dsa_core.close(s)
