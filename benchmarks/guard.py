"""The headline guard: the headline ratios in a few minutes, against the last recorded run.

    python -m benchmarks.guard                    # the quick set (~7 min on the 2-core VM)
    python -m benchmarks.guard --record           # ... and make it the new reference
    python -m benchmarks.guard --only warm,ooc --workdir /var/tmp/guard --keep
    python -m benchmarks.guard --lib /path/to/other/checkout   # that checkout's dsa_core
    python -m benchmarks.guard --smoke            # seconds: CI's smoke test

Run it before a change to the step, read or write path lands (docs/benchmarks.md, "The
headline guard"). Each measure is a ratio to an anchor measured in the same run, in its
own child process (its memory and page cache its own); each figure is the median of
``--repeats`` runs (3), taken back to back:

- ``warm``: ``dsa_core.step`` rows/s on a ``--rows`` x 128 in-place store held in RAM
  (``access="ram"``, every page dirtied first), batches of 2048 uniform ids, after warm-up
  steps, against the **memory-limit probe**: a Numba ``parallel=True`` kernel on the same
  threads (``dsa_core.get_num_threads()``) that reads and writes each id's whole record
  (w, m, v: 3 x dim floats) once per batch of the same ids, no Adam math, on a NumPy array
  of that layout (``benchmarks/probes.py``); the anchor is the faster of that kernel and
  the same loop on one thread (a ``prange`` barrier waits a scheduler quantum for a thread
  that other work descheduled, which would flatter the ratio). Each run is a pair, probes
  then step. Target >= 0.95. ``warm after a flush``: then, per run, ``dsa_core.flush`` and 30
  batches of new uniform ids (median), against the same run's probe: most of their rows are
  updated for the first time since the flush, and the in-place store saves each such row's
  record in its undo file first (the state right after a create, a flush or a checkpoint,
  which ``benchmarks.warm``'s plain rows measure; the ``warm`` row's store has every row
  written since its last flush). No target; flagged when it falls 10%.
- ``torch 100%`` / ``torch 25%``: the torch loop (``benchmarks/torch_e2e.py``'s worker) at
  ``--torch-rows`` x 128: ``DiskSparseAdam`` on a log store with a region of 100% / 25% of
  the state (``dsalog``) against ``torch.optim.SparseAdam``, in rounds of the three. At 10M
  the targets are 3x / 1.5x; at the quick size the ratios are only reported. The 25% store
  has every row written once before its timed steps (``torch_e2e --written``: the table
  after an epoch), so rows that leave its region are read back as in a long run; a new
  store would compute them from its seed instead (references recorded before 2026-12-06
  measured that first pass).
- ``ooc``: a log store of ``--ooc-rows`` x 128 with every row written once (built once
  like ``benchmarks/random_loop.py``'s create phase, then a fresh snapshot of it,
  ``dsa_core.checkpoint``, for every run, so that every run starts from the same fresh
  store), evicted from the page cache, stepped under a memory cgroup of ``--ooc-cap``
  (``benchmarks/memcap.sh``) with a region of ``--ooc-region`` and
  ``dsa_core.prefetch`` of the next two batches: rows/s against the drive's own random
  4 KiB read rate at queue depth 256 (``benchmarks/drive_probe.c``, O_DIRECT, over the
  store's segment files), measured right before each run. Target >= 0.9. Shown beside it:
  ``ooc beside its writes``, the same rows/s against the QD256 rate measured right after
  the run while one more thread writes a file sequentially at the run's own write rate
  (``drive_probe.c --write``; the disk's bytes written during the timed steps: the seals),
  since a log store writes every updated row back, and beside writes this virtual disk
  gives reads 0-17% less, depending on the moment (docs/notebook.md, 2026-12-07).
- ``random``: ``benchmarks/random_loop.py``'s training loop (``DiskEmbedding``, LINE loss,
  under ``--random-cap``) on a fresh snapshot of the same store: rows touched/s against the
  drive's QD256 rate, and read I/Os per row touched (target <= 1.1); edges/s beside them.

The table: measure, value, anchor, ratio, target, the reference's ratio, the change, and a
flag where a ratio fell more than 10% below the reference (``SLOWER``; ``MORE I/O`` where
I/Os per row rose 10%). Rows without an anchor (the drive's rates, edges/s) compare their
values and are never flagged. The exit status is 0 whatever the figures (it is a report)
and 1 when a measure failed. Results: ``benchmarks/results/guard_last.json``;
``--record`` also writes the new reference, ``benchmarks/results/guard.json``
(``--reference`` names another file: for an A/B of two commits, record one with ``--lib``
and compare the other with it). The children use only the public API that existed at
c9744fb, and ``torch_e2e``'s worker (which also pre-touches a log store's region through
``store.engine.region``, as it could at c9744fb), so ``--lib`` may point at any checkout
since then.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import _common
from ._common import batches, wait_disk_quiet
from .random_loop import _evict

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MEMCAP = HERE / "memcap.sh"
MEASURES = ("warm", "torch", "ooc", "random")
THRESHOLD = 0.10  # a ratio this far below the reference is flagged

QUICK = {"rows": 1_000_000, "torch_rows": 2_000_000, "ooc_rows": 2_000_000, "dim": 128,
         "batch": 2048, "warm_steps": 1000, "warm_warmup": 50, "warm_flushed_steps": 30,
         "torch_steps": 300, "torch_warmup": 300, "ooc_seconds": 15.0, "ooc_warmup": 30,
         "ooc_cap": "512M", "ooc_region": "256MiB", "ahead": 2, "random_seconds": 20.0,
         "random_warmup": 5, "random_cap": "1G", "random_batch": 4096, "negatives": 4,
         "disk_seconds": 4.0, "quiet_seconds": 30.0, "write_probe_mib": 512}
SMOKE = {**QUICK, "rows": 20_000, "torch_rows": 20_000, "ooc_rows": 20_000, "dim": 8,
         "batch": 64, "warm_steps": 20, "warm_warmup": 3, "warm_flushed_steps": 3,
         "torch_steps": 5, "torch_warmup": 2, "ooc_seconds": 0.3, "ooc_warmup": 2,
         "ooc_region": "1MiB", "random_seconds": 0.3, "random_warmup": 1, "random_cap": "512M",
         "random_batch": 64, "disk_seconds": 0.2, "quiet_seconds": 0.0, "write_probe_mib": 4}
# the measure -> (better, target, what the target is) of each compared row
TARGETS = {"warm": ("higher", 0.95, ">= 0.95"), "warm after a flush": ("higher", None, ""),
           "torch 100%": ("higher", None, "3x at 10M"),
           "torch 25%": ("higher", None, "1.5x at 10M"), "ooc": ("higher", 0.9, ">= 0.9"),
           "ooc beside its writes": ("higher", None, ""),
           "random": ("higher", None, ""), "random I/O": ("lower", 1.1, "<= 1.1")}


# -- the comparison (no timing: tests/tools/test_benchmarks_smoke.py checks it) -----------------
def compare(rows: list[dict], reference: dict | None, threshold: float = THRESHOLD) -> list[dict]:
    """Fill each row's ``reference`` (the reference run's ratio, or value for a row without
    an anchor), ``change`` (relative) and ``flag``, matching rows by ``measure``.

    A compared row (``better`` "higher" or "lower") is flagged ``SLOWER`` when its ratio fell
    more than ``threshold`` below the reference's (``MORE I/O`` for a "lower" row that rose
    as much), ``FAILED`` when it has no figure; info rows (``better`` None) never are.
    """
    ref = {r["measure"]: r for r in (reference or {}).get("rows", [])}
    for r in rows:
        key = "value" if r.get("better") is None or r.get("ratio") is None else "ratio"
        old = ref.get(r["measure"], {}).get(key)
        mine = r.get(key)
        r["reference"], r["change"], r["flag"] = old, None, ""
        if r.get("error"):
            r["flag"] = "FAILED"
            continue
        if old is None or mine is None or not np.isfinite(old) or not old:
            continue
        r["change"] = mine / old - 1.0
        if r.get("better") == "higher" and r["change"] < -threshold:
            r["flag"] = "SLOWER"
        elif r.get("better") == "lower" and r["change"] > threshold:
            r["flag"] = "MORE I/O"
    return rows


def _fmt(x, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    if unit == "MB/s":
        return f"{x:.0f} {unit}"
    if unit in ("rows/s", "reads/s", "edges/s"):
        for div, suf in ((1e6, "M"), (1e3, "k")):
            if abs(x) >= div:
                return f"{x / div:.3g}{suf} {unit}"
        return f"{x:.0f} {unit}"
    return f"{x:.3f}" + (f" {unit}" if unit else "")


def table(rows: list[dict]) -> str:
    """The printed table (one line per row)."""
    cols = ["measure", "value", "anchor", "ratio", "target", "reference", "change", "flag"]
    cells = []
    for r in rows:
        anchor = "-" if r.get("anchor") is None else \
            f"{r.get('anchor_name', '')} {_fmt(r['anchor'], r.get('anchor_unit', ''))}".strip()
        info = r.get("better") is None
        cells.append([
            r["measure"], "FAILED" if r.get("error") else _fmt(r.get("value"), r.get("unit", "")),
            anchor, "-" if info or r.get("ratio") is None else f"{r['ratio']:.3f}",
            r.get("target_text", "") or "-",
            "-" if r.get("reference") is None else
            (_fmt(r["reference"], r.get("unit", "")) if info or r.get("ratio") is None
             else f"{r['reference']:.3f}"),
            "-" if r.get("change") is None else f"{r['change']:+.1%}" + (" (value)" if info
                                                                        else ""),
            r.get("flag", "")])
    width = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c)
             for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, width, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(x, width, strict=True)).rstrip()
              for x in cells]
    return "\n".join(lines)


def _row(measure: str, value, unit: str, anchor=None, anchor_name: str = "", ratio=None,
         runs=None, anchor_unit: str | None = None, **extra) -> dict:
    better, target, text = TARGETS.get(measure, (None, None, ""))
    return {"measure": measure, "value": value, "unit": unit, "anchor": anchor,
            "anchor_name": anchor_name, "anchor_unit": anchor_unit or unit, "ratio": ratio,
            "better": better, "target": target, "target_text": text, "runs": runs or [], **extra}


def _median(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


# -- the children (each measure in its own process) ----------------------------------------------
def _child_warm_create(s: dict) -> dict:
    """The warm measure's in-place store: reused (``keep``) when it opens with the shape."""
    import dsa_core

    path = Path(s["path"])
    if s["keep"] and path.exists():
        try:
            st = dsa_core.open(path, mode="r")
            ok = (st.num_rows, st.dim, st.storage) == (s["rows"], s["dim"], "inplace")
            dsa_core.close(st)
            if ok:
                return {"created": False}
        except Exception as exc:  # noqa: BLE001 - rebuilt below, and said why
            print(f"warm store not reusable ({exc}); building it again", file=sys.stderr)
    t0 = time.perf_counter()
    st = dsa_core.create(path, s["rows"], s["dim"], lr=1e-3, init="uniform", init_scale=1e-3,
                         storage="inplace", access="ram", overwrite=True, progress=False)
    dsa_core.close(st)
    return {"created": True, "create_s": time.perf_counter() - t0}


def _timed_steps(st, ids: list, grads: list, skip: int) -> tuple:
    """``dsa_core.step`` on each batch of ``ids`` (gradients taken in turn from ``grads``):
    the store's last State and the seconds of each step after the first ``skip``."""
    import dsa_core

    times = []
    for j, x in enumerate(ids):
        t0 = time.perf_counter()
        st = dsa_core.step(st, x, grads[j % len(grads)])
        if j >= skip:
            times.append(time.perf_counter() - t0)
    return st, times


def _child_warm(s: dict) -> dict:
    """Pairs of (memory probe, step) on the same ids; the store's pages dirtied first."""
    import dsa_core

    from . import probes

    st = dsa_core.open(s["path"], access="ram")
    n, d, b = st.num_rows, st.dim, s["batch"]
    _common.write_every_row(st)  # every page dirty: a long run's state (see warm.py)
    threads = dsa_core.get_num_threads()
    probe_threads = probes.set_probe_threads(threads)
    table_ = np.zeros((n, 3 * d), np.float32)  # the record layout: w, m, v
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((b, d), dtype=np.float32) for _ in range(8)]
    dsa_core.warmup(("float32",))
    runs = []
    for k in range(s["repeats"]):
        ids = batches(n, b, s["warmup"] + s["steps"], "uniform", seed=100 + k)
        par = probes.memory_probe_rows_per_s(table_, ids, s["warmup"])
        one = probes.memory_probe_rows_per_s(table_, ids, s["warmup"], parallel=False)
        st, times = _timed_steps(st, ids, grads, s["warmup"])
        runs.append({"step_rows_per_s": b / float(np.median(times)),
                     "probe_rows_per_s": max(par, one), "probe_parallel_rows_per_s": par,
                     "probe_one_thread_rows_per_s": one})
    # right after a flush: the in-place store saves each row's record in its undo file at its
    # first update since the flush, and most of a few batches' rows are such rows
    flushed = []
    for k in range(s["repeats"]):
        dsa_core.flush(st)
        st, times = _timed_steps(st, batches(n, b, s["flushed_steps"], "uniform",
                                             seed=200 + k), grads, 0)
        flushed.append(b / float(np.median(times)))
    dsa_core.close(st)
    return {"runs": runs, "flushed": flushed, "threads": threads,
            "probe_threads": probe_threads}


def _child_torch(s: dict) -> dict:
    """``torch_e2e``'s worker for each configuration in ``s["configs"]``, in turn."""
    from . import torch_e2e

    out = []
    for impl, share in s["configs"]:
        ns = argparse.Namespace(
            worker=impl, log_share=share, rows=s["rows"], dim=s["dim"], batch=s["batch"],
            steps=s["steps"], warmup=s["warmup"], dist="uniform", device="cpu", dir=s["dir"],
            pace_mib=-1.0, cache_mib=-1.0, fill=False, written=impl != "torch" and share < 1,
            predirty=False, compile=False,
            second_moment="elementwise", first_moment="full")
        out.append(torch_e2e._worker(ns))
    return {"results": out}


def _child_log_check(s: dict) -> dict:
    """Whether the kept log store opens with the shape asked for."""
    import dsa_core

    try:
        st = dsa_core.open(s["path"], mode="r")
        ok = (st.num_rows, st.dim, st.storage) == (s["rows"], s["dim"], "log")
        dsa_core.close(st)
        return {"ok": ok, "why": "" if ok else "another shape or kind"}
    except Exception as exc:  # noqa: BLE001 - reported, and the store built again
        return {"ok": False, "why": str(exc)[:300]}


def _child_snapshot(s: dict) -> dict:
    """A fresh snapshot of the built store for one run (hard-linked segments: cheap)."""
    import dsa_core

    st = dsa_core.open(s["src"], mode="r+")
    try:
        dsa_core.checkpoint(st, s["dest"], overwrite=True)
    finally:
        dsa_core.close(st)
    return {}


def _child_ooc(s: dict) -> dict:
    """Steps on the evicted log store (run under the memory cgroup): rows/s, reads per row."""
    from collections import deque

    import dsa_core

    from .random_loop import _disk_of, _disk_reads, _disk_written

    st = dsa_core.open(s["path"], memory=s["region"])
    n, d, b = st.num_rows, st.dim, s["batch"]
    rng = np.random.default_rng(s["seed"])
    grads = [rng.standard_normal((b, d), dtype=np.float32) for _ in range(4)]
    dsa_core.warmup(("float32",))

    def draw():
        return rng.integers(0, n, b, dtype=np.int64)

    ahead = deque(draw() for _ in range(s["ahead"]))
    for ids in ahead:
        dsa_core.prefetch(st, ids)
    disk = _disk_of(Path(s["path"]))
    times, k, t_start, r0, w0 = [], 0, None, (0, 0), 0
    while True:
        if k == s["warmup"]:
            t_start, r0, w0 = time.perf_counter(), _disk_reads(disk), _disk_written(disk)
        nxt = draw()
        dsa_core.prefetch(st, nxt)  # the batches ahead read while this one steps
        ahead.append(nxt)
        ids = ahead.popleft()
        t0 = time.perf_counter()
        st = dsa_core.step(st, ids, grads[k % 4])
        dt = time.perf_counter() - t0
        if t_start is not None:
            times.append(dt)
            if time.perf_counter() - t_start >= s["seconds"] and len(times) >= 2:
                break
        k += 1
    wall = time.perf_counter() - t_start
    r1, w1 = _disk_reads(disk), _disk_written(disk)
    t0 = time.perf_counter()
    dsa_core.close(st)
    rows = len(times) * b
    return {"rows_per_s": rows / wall, "steps": len(times), "seconds": wall,
            "p50_ms": 1e3 * float(np.median(times)),
            "p99_ms": 1e3 * float(np.percentile(times, 99)),
            "read_ios_per_row": (r1[0] - r0[0]) / rows, "close_s": time.perf_counter() - t0,
            "written_mb_per_s": (w1 - w0) / wall / 1e6}


def _segment_files(store: Path) -> list[Path]:
    """The files the drive probes read: a log store's segments (else every file of it)."""
    return sorted(store.glob("seg-*")) or sorted(p for p in store.iterdir() if p.is_file())


CHILDREN = {"warm_create": _child_warm_create, "warm": _child_warm, "torch": _child_torch,
            "log_check": _child_log_check, "snapshot": _child_snapshot, "ooc": _child_ooc}


def child_main(name: str, spec: dict) -> None:
    lib = spec.get("lib")
    if lib:  # before anything imports dsa_core: that checkout's dsa_core and adapters
        sys.path.insert(0, str(Path(lib).resolve()))
    import dsa_core

    where = Path(dsa_core.__file__).resolve().parent
    if lib and Path(lib).resolve() not in where.parents:
        raise SystemExit(f"dsa_core came from {where}, not from --lib {lib}")
    out = CHILDREN[name](spec)
    out["dsa_core"] = str(where)
    print(json.dumps(out))


class ChildFailed(RuntimeError):
    pass


def run_child(name: str, spec: dict, cap: str | None = None) -> dict:
    """``python -m benchmarks.guard --child NAME`` (inside ``memcap.sh CAP`` when ``cap``)."""
    cmd = [sys.executable, "-m", "benchmarks.guard", "--child", name, "--spec", json.dumps(spec)]
    if cap:
        cmd = ["bash", str(MEMCAP), cap, *cmd]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, check=False)
    if r.returncode != 0:
        raise ChildFailed(f"{name} child failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise ChildFailed(f"{name} child printed no result:\n{r.stdout[-1000:]}"
                          f"{r.stderr[-2000:]}") from None
    capline = [ln for ln in r.stderr.splitlines() if ln.startswith("memcap:")]
    if capline:
        out["memcap"] = capline[-1]
    return out


# -- the parent --------------------------------------------------------------------------------
class Guard:
    def __init__(self, a, cfg: dict, workdir: Path):
        self.a, self.cfg, self.wd = a, cfg, workdir
        self.t0 = time.perf_counter()
        self.notes: list[str] = []
        self.lib = str(Path(a.lib).resolve()) if a.lib else None
        self.drive: list[dict] = []
        self.capped, self.cap_why = self._cgroup()
        self.probe_bin = None
        self.probe_how = ""

    def say(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:5.0f} s] {msg}", flush=True)

    def note(self, msg: str) -> None:
        self.notes.append(msg)
        self.say("NOTE: " + msg)

    def spec(self, **kw) -> dict:
        return {"lib": self.lib, **kw}

    def quiet(self) -> None:
        if self.cfg["quiet_seconds"] > 0:
            waited = wait_disk_quiet(self.cfg["quiet_seconds"])
            if waited >= self.cfg["quiet_seconds"]:
                self.note(f"the disk was not quiet after {waited:.0f} s; measured anyway")

    def _cgroup(self) -> tuple[bool, str]:
        if self.a.no_cgroup:
            return False, "not used (--no-cgroup)"
        r = subprocess.run(["bash", str(MEMCAP), "64M", "true"], capture_output=True,
                           text=True, check=False)
        if r.returncode != 0:
            return False, "no writable memory cgroup (memcap.sh needs root and cgroup v1/v2)"
        return True, "memcap.sh"

    # warm ------------------------------------------------------------------------------------
    def warm(self) -> list[dict]:
        c = self.cfg
        path = self.wd / f"warm_{c['rows']}x{c['dim']}"
        self.say(f"warm: the {c['rows']:,} x {c['dim']} in-place store")
        made = run_child("warm_create", self.spec(path=str(path), rows=c["rows"], dim=c["dim"],
                                                  keep=self.a.keep))
        self.say("warm: " + (f"created in {made['create_s']:.0f} s" if made["created"]
                             else "reusing the kept store"))
        self.quiet()
        self.say(f"warm: {self.a.repeats} x (memory probe, step), {c['warm_steps']} batches each")
        out = run_child("warm", self.spec(path=str(path), batch=c["batch"], steps=c["warm_steps"],
                                          warmup=c["warm_warmup"], repeats=self.a.repeats,
                                          flushed_steps=c["warm_flushed_steps"]))
        runs = out["runs"]
        step = _median(r["step_rows_per_s"] for r in runs)
        probe = _median(r["probe_rows_per_s"] for r in runs)
        ratio = _median(r["step_rows_per_s"] / r["probe_rows_per_s"] for r in runs)
        if out["probe_threads"] != out["threads"]:
            self.note(f"the probe ran on {out['probe_threads']} threads, the step on "
                      f"{out['threads']} (Numba's pool is smaller)")
        if not self.a.keep:
            shutil.rmtree(path, ignore_errors=True)
        flushed = out.get("flushed") or []
        rows = [_row("warm", step, "rows/s", probe, "memory probe", ratio, runs,
                     threads=out["threads"], dsa_core=out["dsa_core"])]
        if flushed:  # against the same probes, run for run
            rows.append(_row("warm after a flush", _median(flushed), "rows/s", probe,
                             "memory probe", _median(f / r["probe_rows_per_s"]
                                                     for f, r in zip(flushed, runs)),
                             [{"step_rows_per_s": f} for f in flushed]))
        return rows

    # torch -----------------------------------------------------------------------------------
    def torch(self) -> list[dict]:
        c = self.cfg
        configs = [("torch", 1.0), ("dsalog", 1.0), ("dsalog", 0.25)]
        spec = dict(rows=c["torch_rows"], dim=c["dim"], batch=c["batch"], steps=c["torch_steps"],
                    warmup=c["torch_warmup"], dir=str(self.wd))
        rounds = []
        for k in range(self.a.repeats):
            self.quiet()
            self.say(f"torch: round {k + 1}/{self.a.repeats}: SparseAdam, DiskSparseAdam on a "
                     f"log store (region 100%, 25%), {c['torch_rows']:,} x {c['dim']}")
            if self.a.smoke:  # one interpreter with torch for the three (seconds, not tens)
                got = run_child("torch", self.spec(configs=configs, **spec))["results"]
            else:  # each in its own process, as torch_e2e runs them
                got = [run_child("torch", self.spec(configs=[cf], **spec))["results"][0]
                       for cf in configs]
            rounds.append({r["impl"]: r["rows_per_s"] for r in got})
        torch_rate = _median(r["torch"] for r in rounds)
        rows = []
        for share in ("100%", "25%"):
            impl = f"dsalog@{share}"
            rows.append(_row(f"torch {share}", _median(r[impl] for r in rounds), "rows/s",
                             torch_rate, "SparseAdam", _median(r[impl] / r["torch"]
                                                               for r in rounds), rounds))
        return rows

    # the log store, the drive, ooc and random -----------------------------------------------
    def log_store(self) -> Path:
        """The built log store (every row written once); kept with ``--keep``."""
        c = self.cfg
        base = self.wd / f"log_{c['ooc_rows']}x{c['dim']}"
        store = base / "pristine" / "emb"
        if self.a.keep and (store / "manifest.json").exists():
            chk = run_child("log_check", self.spec(path=str(store), rows=c["ooc_rows"],
                                                   dim=c["dim"]))
            if chk["ok"]:
                self.say("log store: reusing the kept store")
                return store
            self.say(f"log store: the kept store is not reusable ({chk['why']}); building it")
        shutil.rmtree(base / "pristine", ignore_errors=True)
        from . import random_loop

        self.say(f"log store: creating {c['ooc_rows']:,} x {c['dim']}, every row written once")
        try:  # outside the cgroup, as random_loop builds it
            made = random_loop.run_child(self._random_args(base / "pristine"), "create")
        except SystemExit as exc:  # run_child's way of saying the child failed
            raise ChildFailed(str(exc)) from None
        self.say(f"log store: created in {made['create_s'] + made.get('write_all_s', 0):.0f} s")
        return store

    def snapshot(self, store: Path) -> Path:
        """A fresh copy of the built store to run on (the last run's copy removed first)."""
        live = store.parent.parent / "live"
        shutil.rmtree(live, ignore_errors=True)
        run_child("snapshot", self.spec(src=str(store), dest=str(live / "emb")))
        return live

    def probe_drive(self, store: Path) -> dict:
        """QD32 and QD256 over the store's segment files, once the disk is quiet."""
        from . import probes

        if self.probe_bin is None and not self.probe_how:
            self.probe_bin, self.probe_how = probes.build_drive_probe(self.wd, not self.a.no_cc)
            if self.probe_bin is None:
                self.note(f"drive probe: {self.probe_how}; Python O_DIRECT threads instead "
                          "(they read less than the drive can at QD256)")
        files = _segment_files(store)
        self.quiet()
        got = {"files": len(files), "gb": sum(f.stat().st_size for f in files) / 1e9}
        for qd in (32, 256):
            r = probes.drive_rate(files, qd, self.cfg["disk_seconds"], self.probe_bin)
            got[f"qd{qd}"], got["tool"] = r["reads_per_s"], r["tool"]
            if not r["direct"]:
                self.note("drive probe: no O_DIRECT on this filesystem (page-cache reads)")
        self.say(f"drive: QD32 {got['qd32']:,.0f}, QD256 {got['qd256']:,.0f} reads/s "
                 f"({got['tool']}, {got['files']} files, {got['gb']:.1f} GB)")
        self.drive.append(got)
        return got

    def probe_beside_writes(self, store: Path, mb_per_s: float) -> dict | None:
        """QD256 over the store's segment files while a thread writes a file of the workdir
        sequentially at ``mb_per_s`` (an ooc run's own write rate: its seals): what the
        drive gives the reads of a run that also writes. None without the C probe."""
        from . import probes

        if self.probe_bin is None or mb_per_s <= 0:
            return None
        wfile = self.wd / "write_probe.dat"
        size = self.cfg["write_probe_mib"] << 20  # the span written round
        if not wfile.exists() or wfile.stat().st_size < size:
            chunk = np.zeros(1 << 20, np.uint8).tobytes()
            with open(wfile, "wb") as f:
                for _ in range(size >> 20):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
        files = _segment_files(store)
        self.quiet()
        r = probes.drive_rate(files, 256, self.cfg["disk_seconds"], self.probe_bin,
                              write=(wfile, mb_per_s))
        if r is not None:
            self.say(f"drive beside writes: QD256 {r['reads_per_s']:,.0f} reads/s while "
                     f"{r['written_mb_per_s']:.0f} MB/s were written")
        return r

    def ooc_and_random(self, which: set[str]) -> list[dict]:
        c = self.cfg
        store = self.log_store()
        if not self.capped:
            self.note(f"memory cgroup: {self.cap_why}; ooc and random run uncapped (out of "
                      "core only if the table is larger than RAM)")
        rows = []
        ooc = []
        for k in range(self.a.repeats if "ooc" in which else 0):
            drive = self.probe_drive(store)
            live = self.snapshot(store)
            os.sync()  # written back first: dirty pages are not dropped by the eviction
            _evict(live)
            self.quiet()
            self.say(f"ooc: run {k + 1}/{self.a.repeats}, {c['ooc_seconds']:g} s"
                     + (f" under {c['ooc_cap']}" if self.capped else " (uncapped)"))
            r = run_child("ooc", self.spec(path=str(live / "emb"), region=c["ooc_region"],
                                           batch=c["batch"], seconds=c["ooc_seconds"],
                                           warmup=c["ooc_warmup"], ahead=c["ahead"],
                                           seed=1000 + k),
                          cap=c["ooc_cap"] if self.capped else None)
            r["qd256"] = drive["qd256"]
            cap = f"; {r['memcap']}" if r.get("memcap") else ""
            self.say(f"ooc: {r['rows_per_s']:,.0f} rows/s, {r['read_ios_per_row']:.2f} read "
                     f"I/Os per row, p50 {r['p50_ms']:.1f} ms, {r['written_mb_per_s']:.0f} MB/s "
                     f"written{cap}")
            mixed = self.probe_beside_writes(store, r["written_mb_per_s"])
            r["qd256_beside_writes"] = mixed["reads_per_s"] if mixed else None
            ooc.append(r)
        if not self.drive:  # random alone: its anchor still comes from this run
            for _ in range(self.a.repeats):
                self.probe_drive(store)
        qd256 = _median(d["qd256"] for d in self.drive)
        if ooc:
            rows.append(_row("ooc", _median(r["rows_per_s"] for r in ooc), "rows/s",
                             _median(r["qd256"] for r in ooc), "drive QD256",
                             _median(r["rows_per_s"] / r["qd256"] for r in ooc), ooc,
                             anchor_unit="reads/s", capped=self.capped))
            mixed = [r for r in ooc if r.get("qd256_beside_writes")]
            if mixed:
                rows.append(_row("ooc beside its writes",
                                 _median(r["rows_per_s"] for r in mixed), "rows/s",
                                 _median(r["qd256_beside_writes"] for r in mixed),
                                 "QD256 + its writes",
                                 _median(r["rows_per_s"] / r["qd256_beside_writes"]
                                         for r in mixed), mixed, anchor_unit="reads/s",
                                 capped=self.capped))
            rows.append(_row("ooc read I/Os per row", _median(r["read_ios_per_row"] for r in ooc),
                             "I/Os"))
            rows.append(_row("ooc written", _median(r["written_mb_per_s"] for r in ooc), "MB/s"))
        rnd = []
        for k in range(self.a.repeats if "random" in which else 0):
            live = self.snapshot(store)
            self.say(f"random: run {k + 1}/{self.a.repeats}, {c['random_seconds']:g} s"
                     + (f" under {c['random_cap']}" if self.capped else " (uncapped)"))
            rnd.append(self._random(live))
        if rnd:
            touched = [r["edges_per_s"] * r["rows_touched_per_edge"] for r in rnd]
            rows.append(_row("random", _median(touched), "rows/s", qd256, "drive QD256",
                             _median(touched) / qd256, rnd, anchor_unit="reads/s",
                             capped=self.capped))
            rows.append(_row("random I/O", _median(r["read_ios_per_row"] for r in rnd),
                             "I/Os per row", ratio=_median(r["read_ios_per_row"] for r in rnd)))
            rows.append(_row("random edges/s", _median(r["edges_per_s"] for r in rnd),
                             "edges/s"))
        rows.append(_row("drive QD32", _median(d["qd32"] for d in self.drive), "reads/s",
                         tool=self.drive[0]["tool"]))
        rows.append(_row("drive QD256", qd256, "reads/s", tool=self.drive[0]["tool"]))
        shutil.rmtree(store.parent.parent / "live", ignore_errors=True)
        if not self.a.keep:
            shutil.rmtree(store.parent.parent, ignore_errors=True)
        return rows

    def _random_args(self, directory: Path) -> argparse.Namespace:
        """``benchmarks/random_loop.py``'s arguments, for its children (create, train)."""
        c = self.cfg
        return argparse.Namespace(
            rows=c["ooc_rows"], dim=c["dim"], batch=c["random_batch"], negatives=c["negatives"],
            seconds=c["random_seconds"], warmup=c["random_warmup"], threads=_cores(),
            dir=str(directory), storage="log", report_every=0.0, fresh=False, lib=self.lib,
            no_cgroup=not self.capped, create_capped=False, cap=c["random_cap"], seed=1)

    def _random(self, live: Path) -> dict:
        """One run of random_loop's training child on the snapshot ``live`` (evicted, the
        disk quiet), inside its memory cgroup."""
        from . import random_loop

        os.sync()
        _evict(live)
        self.quiet()
        try:
            t = random_loop.run_child(self._random_args(live), "train")
        except SystemExit as exc:  # run_child's way of saying the child failed
            raise ChildFailed(str(exc)) from None
        self.say(f"random: {t['edges_per_s']:,.0f} edges/s, {t['rows_touched_per_edge']:.2f} "
                 f"rows touched per edge, {t['read_ios_per_row']:.2f} read I/Os per row "
                 f"touched, {t['majflt_per_row']:.2f} major faults"
                 + (f"; {t['memcap']}" if t.get("memcap") else ""))
        return t


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _git(path: str | Path) -> str:
    try:
        head = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True,
                               check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine_info(path: Path) -> dict:
    """Cores, CPU, memory, kernel and the disk under ``path``."""
    info = {**_common.machine(), "cores_usable": _cores(), "kernel": platform.release()}
    try:
        dev = os.stat(path).st_dev
        sys_dev = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        disk = sys_dev.parent if (sys_dev / "partition").exists() else sys_dev
        model = disk / "device" / "model"
        info["disk"] = {
            "name": disk.name,
            "model": model.read_text().strip() if model.exists() else "",
            "rotational": (disk / "queue" / "rotational").read_text().strip() == "1",
            "size_gb": round(int((disk / "size").read_text()) * 512 / 1e9, 1),
            "scheduler": (disk / "queue" / "scheduler").read_text().strip()}
        best = ""
        for ln in Path("/proc/mounts").read_text().splitlines():
            f = ln.split()
            if len(f) > 2 and str(path.resolve()).startswith(f[1]) and len(f[1]) >= len(best):
                best, info["disk"]["fs"] = f[1], f[2]
    except (OSError, ValueError):
        pass
    return info


def _print_machine(m: dict) -> str:
    d = m.get("disk", {})
    disk = (f"disk {' '.join(filter(None, [d.get('name', '?'), d.get('model')]))} "
            f"{d.get('size_gb', '?')} GB "
            f"{'rotational' if d.get('rotational') else 'non-rotational'} "
            f"({d.get('fs', '?')}, {d.get('scheduler', '?')})") if d else "disk unknown"
    return (f"{m.get('cores_usable')} cores ({m.get('cpu', '?')}), {m.get('mem_total_gib')} GiB, "
            f"kernel {m.get('kernel')}, Python {m.get('python')}; {disk}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (CI's smoke test)")
    ap.add_argument("--only", default=",".join(MEASURES),
                    help="comma-separated measures out of warm,torch,ooc,random")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each measure, back to back; the medians are reported "
                         "(default 3; 1 with --smoke)")
    ap.add_argument("--workdir", default=None,
                    help="where the stores go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true",
                    help="reuse the stores left in --workdir and leave them there")
    ap.add_argument("--record", action="store_true",
                    help="also write the results as the new reference")
    ap.add_argument("--reference", default=None,
                    help="the reference file (default benchmarks/results/guard.json; "
                         "guard_smoke.json with --smoke)")
    ap.add_argument("--lib", default=None,
                    help="import dsa_core and adapters from this checkout (an A/B of commits)")
    ap.add_argument("--rows", type=int, default=None, help="rows of the warm store (1M)")
    ap.add_argument("--torch-rows", type=int, default=None, help="rows of the torch loop (2M)")
    ap.add_argument("--ooc-rows", type=int, default=None,
                    help="rows of the log store of ooc and random (2M)")
    ap.add_argument("--ooc-seconds", type=float, default=None, help="each ooc run (15)")
    ap.add_argument("--ooc-cap", default=None, help="the ooc runs' memory cgroup (512M)")
    ap.add_argument("--ooc-region", default=None,
                    help="the ooc runs' log region, dsa_core.open(memory=...) (256MiB)")
    ap.add_argument("--random-cap", default=None, help="the random runs' memory cgroup (1G)")
    ap.add_argument("--random-seconds", type=float, default=None, help="each random run (20)")
    ap.add_argument("--disk-seconds", type=float, default=None,
                    help="each drive probe, per queue depth (4)")
    ap.add_argument("--quiet-seconds", type=float, default=None,
                    help="the longest wait for a quiet disk before a timed phase (30)")
    ap.add_argument("--no-cgroup", action="store_true",
                    help="run ooc and random without a memory cgroup")
    ap.add_argument("--no-cc", action="store_true",
                    help="probe the drive with Python threads, not drive_probe.c")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child_main(a.child, json.loads(a.spec))
        return {}
    which = {x.strip() for x in a.only.split(",") if x.strip()}
    if not which or which - set(MEASURES):
        ap.error(f"--only takes measures out of {','.join(MEASURES)}, got {a.only!r}")
    if a.lib and not (Path(a.lib) / "dsa_core" / "__init__.py").is_file():
        ap.error(f"--lib {a.lib}: no dsa_core/__init__.py there")
    cfg = dict(SMOKE if a.smoke else QUICK)
    for key in ("rows", "torch_rows", "ooc_rows", "ooc_seconds", "ooc_cap", "ooc_region",
                "random_cap", "random_seconds", "disk_seconds", "quiet_seconds"):
        if getattr(a, key) is not None:
            cfg[key] = getattr(a, key)
    if a.repeats is not None and a.repeats < 1:
        ap.error("--repeats must be at least 1")
    a.repeats = a.repeats or (1 if a.smoke else 3)
    name = "guard_smoke" if a.smoke else "guard"
    results = _common.RESULTS
    ref_path = Path(a.reference) if a.reference else results / f"{name}.json"
    last_path = results / f"{name}_last.json"
    tmp = None
    if a.workdir:
        workdir = Path(a.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tmp := tempfile.mkdtemp(prefix="dsa_guard_"))
    command = shlex.join([sys.executable, "-m", "benchmarks.guard",
                          *(sys.argv[1:] if argv is None else argv)])
    mach = machine_info(workdir)
    g = Guard(a, cfg, workdir)
    print(f"command: {command}")
    print(f"machine: {_print_machine(mach)}")
    print(f"code: dsa_core from {g.lib or ROOT} ({_git(g.lib or ROOT)}); "
          f"benchmarks from {ROOT} ({_git(ROOT)})")
    print(f"measures: {', '.join(m for m in MEASURES if m in which)}; {a.repeats} run(s) each; "
          f"workdir {workdir}{' (kept)' if a.keep else ''}", flush=True)
    rows, failed = [], []
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        for m in ("warm", "torch"):
            if m in which:
                try:
                    rows += getattr(g, m)()
                except ChildFailed as exc:
                    failed.append(m)
                    g.say(f"{m} FAILED: {exc}")
                    rows.append({**_row(m, None, ""), "error": str(exc)[-2000:]})
        if which & {"ooc", "random"}:
            try:
                rows += g.ooc_and_random(which)
            except ChildFailed as exc:
                failed.append("ooc/random")
                g.say(f"ooc/random FAILED: {exc}")
                for m in sorted(which & {"ooc", "random"}):
                    rows.append({**_row(m, None, ""), "error": str(exc)[-2000:]})
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    reference = None
    if ref_path.is_file():
        reference = json.loads(ref_path.read_text())
    compare(rows, reference)
    meta = {"command": command, "argv": list(sys.argv[1:] if argv is None else argv),
            "machine": mach, "sizes": cfg, "repeats": a.repeats, "smoke": a.smoke,
            "lib": g.lib, "lib_commit": _git(g.lib) if g.lib else None,
            "commit": _git(ROOT), "started": started.isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - g.t0, 1), "cgroup": g.cap_why,
            "capped": g.capped, "drive": g.drive, "drive_probe": g.probe_how,
            "notes": g.notes, "reference": str(ref_path) if reference else None,
            "failed": failed}
    print()
    print(f"dsa_core {g.lib or ROOT}; {a.repeats} run(s) each, medians; "
          f"{time.perf_counter() - g.t0:.0f} s in all")
    if reference is None:
        print(f"no reference at {ref_path}: nothing to compare with (--record makes one)")
    else:
        rm = reference.get("meta", {})
        print(f"reference: {ref_path} ({rm.get('started', '?')}, commit {rm.get('commit', '?')}"
              + (f", lib {rm['lib']} {rm.get('lib_commit')}" if rm.get("lib") else "") + ")")
        # a size the reference does not name is one added since (its default then): not a
        # difference of the runs
        diff = {k: (rm["sizes"][k], v) for k, v in cfg.items()
                if k in (rm.get("sizes") or {}) and rm["sizes"][k] != v}
        if diff:
            print(f"NOTE: the reference ran at other sizes (reference, now): {diff}")
        if rm.get("machine", {}).get("cpu") != mach.get("cpu"):
            print("NOTE: the reference ran on another CPU")
    print(table(rows))
    slower = [r["measure"] for r in rows if r.get("flag") in ("SLOWER", "MORE I/O")]
    if slower:
        print(f"{len(slower)} measure(s) more than {THRESHOLD:.0%} worse than the reference: "
              f"{', '.join(slower)}")
    for n in g.notes:
        print("note:", n)
    out = {"meta": meta, "rows": rows}
    results.mkdir(parents=True, exist_ok=True)
    last_path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"wrote {last_path}")
    if a.record:
        if failed:
            print(f"not recorded as the reference: {', '.join(failed)} failed")
        else:
            ref_path.parent.mkdir(parents=True, exist_ok=True)
            ref_path.write_text(json.dumps(out, indent=1, default=str) + "\n")
            print(f"recorded {ref_path} as the reference")
    if failed:
        raise SystemExit(1)
    return out


if __name__ == "__main__":
    main()
