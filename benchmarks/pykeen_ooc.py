"""PyKEEN out of core: docs/pykeen.md's out-of-core example at a chosen size, under memory caps.

    python -m benchmarks.pykeen_ooc --entities 4320000 --dim 128 --triples 200000 \
        --caps 1G 768M 512M
    python -m benchmarks.pykeen_ooc --entities 1000000 --caps none      # no cap: peaks only
    python -m benchmarks.pykeen_ooc --smoke                               # seconds

Each run is a child process that trains and evaluates TransE through PyKEEN's ``pipeline()``
exactly as the out-of-core example of docs/pykeen.md does (``disk_representations(root)``,
``DiskAdam``, ``automatic_memory_optimization=False``, evaluation in slices of ``--slice``
entities, ``--eval-batch`` triples a batch), on a random knowledge graph of ``--entities``
entities, ``--relations`` relations and ``--triples`` triples (the last ``--test-triples`` of
them are the test set; seeded, so every run gets the same one). Each child runs inside its
own memory cgroup of the cap (page cache + anonymous memory together, swap off where the
kernel lets a cgroup turn it off): a cgroup v2 or v1 directory made here when this process may
(root), else ``systemd-run --scope -p MemoryMax=...``; ``--caps none`` (and ``--smoke`` where
no cgroup can be made) runs uncapped. The caps run largest first; a cap under which the child
is killed or fails is reported as such and the smaller ones still run, and the smallest cap
under which a run trained and evaluated is printed at the end.

Per run: the seconds from the ``pipeline()`` call to the start of the first optimizer step
(building the model, PyKEEN's resets, the table's first write, the first forward and
backward), to the end of training and to the end of the evaluation; the bytes this process
wrote before its first step (``/proc/self/io`` ``write_bytes``: what the tables' first
writes cost; the store of the entity table is created as a sparse file, so nothing else of
its size is written), the peak resident memory (``ru_maxrss``), the peak anonymous memory
(``RssAnon``, sampled) and the peak of the cgroup
(``memory.peak`` / ``memory.max_usage_in_bytes``, which counts page cache too), the number of
OOM kills in the cgroup, and the MRR. Writes ``benchmarks/results/pykeen_ooc.{json,csv}``.
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

from ._common import machine, own_cgroup, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
SMOKE = dict(entities=2000, relations=20, triples=6000, test_triples=50, dim=8, batch=512,
             slice=500, eval_batch=16, chunk_rows=300)


# -- the child: the docs' example -----------------------------------------------------------
def _graph(a):
    """The random knowledge graph: (training, testing) triples factories."""
    import numpy as np
    import torch
    from pykeen.triples import CoreTriplesFactory

    rng = np.random.default_rng(a.seed)
    t = np.stack([rng.integers(0, a.entities, a.triples),
                  rng.integers(0, a.relations, a.triples),
                  rng.integers(0, a.entities, a.triples)], axis=1)
    cut = a.triples - a.test_triples

    def factory(x):
        return CoreTriplesFactory.create(torch.as_tensor(x, dtype=torch.long),
                                         num_entities=a.entities, num_relations=a.relations)

    return factory(t[:cut]), factory(t[cut:])


def _written() -> int:
    """Bytes this process has caused to be written to storage (``/proc/self/io``)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cgroup_peak(cg: Path | None) -> int:
    for name in ("memory.peak", "memory.max_usage_in_bytes"):
        try:
            return int((cg / name).read_text().split()[0])
        except (OSError, ValueError, TypeError):
            continue
    return 0


def _anon_mib() -> float:
    """This process's resident anonymous memory now (``RssAnon``), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class _AnonPeak:
    """The peak of ``RssAnon``, sampled every 0.2 s on a daemon thread (``ru_maxrss`` counts
    the store's mapped file pages too, which the kernel reclaims under a cap)."""

    def __init__(self, trace: str | None = None):
        import threading

        self.peak = _anon_mib()
        self.trace = open(trace, "w") if trace else None  # noqa: SIM115 - the thread's
        self.t0 = time.perf_counter()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        k = 0
        while True:
            now = _anon_mib()
            self.peak = max(self.peak, now)
            if self.trace is not None:  # a line per sample (0.2 s): t, RssAnon MiB
                self.trace.write(f"{time.perf_counter() - self.t0:.1f} {now:.0f}\n")
                self.trace.flush()
            k += 1
            time.sleep(0.2)


def child(a) -> dict:
    import logging

    import torch
    from pykeen.pipeline import pipeline
    from pykeen.training.callbacks import TrainingCallback

    from adapters import pykeen as dsa

    for name in ("pykeen", "torch_max_mem"):
        logging.getLogger(name).setLevel(logging.ERROR)
    anon = _AnonPeak(a.anon_trace)
    training, testing = _graph(a)
    marks: dict[str, float] = {}
    step = dsa.DiskAdam.step

    def first_step(opt, closure=None):  # the clock stops before the first step starts
        if "first_step" not in marks:
            marks["first_step"], marks["written"] = time.perf_counter(), _written()
        return step(opt, closure)

    dsa.DiskAdam.step = first_step

    class Trained(TrainingCallback):
        def post_train(self, losses, **kwargs):
            marks["trained"] = time.perf_counter()

    options = {"chunk_rows": a.chunk_rows} if a.chunk_rows else {}
    if a.storage:
        options["storage"] = a.storage
    if a.memory:
        options["memory"] = a.memory
    root = Path(a.root)
    w0, t0 = _written(), time.perf_counter()
    # docs/pykeen.md, "Quickstart", the example for tables larger than memory
    result = pipeline(
        training=training, testing=testing, model="TransE", random_seed=0,
        model_kwargs=dict(embedding_dim=a.dim,
                          **dsa.disk_representations(root / "tables", overwrite=True,
                                                     **options)),
        optimizer=dsa.DiskAdam, optimizer_kwargs=dict(lr=1e-2),
        training_loop_kwargs=dict(automatic_memory_optimization=False),
        training_kwargs=dict(num_epochs=a.epochs, batch_size=a.batch, use_tqdm=False,
                             callbacks=Trained()),
        evaluation_kwargs=dict(slice_size=a.slice, batch_size=a.eval_batch, use_tqdm=False),
        # the metrics the docs' example keeps: the rank-adjusted ones (PyKEEN's defaults)
        # each allocate float64 arrays of num_entities when the evaluation ends
        evaluator_kwargs=({} if a.all_metrics else
                          dict(metrics=["mrr", "hits@k"], add_defaults=False)),
    )
    done = time.perf_counter()
    mrr = float(result.get_metric("mrr"))
    ent = result.model.entity_representations[0].table.store
    store_bytes = sum(p.stat().st_size for p in Path(ent.path).rglob("*") if p.is_file())
    dsa.close(result.model, result.training_loop.optimizer)
    cg = own_cgroup()
    return {
        "first_step_s": marks.get("first_step", done) - t0,
        "train_s": marks.get("trained", done) - t0,
        "total_s": done - t0,
        "written_before_first_step_mib": (marks.get("written", _written()) - w0) / 2**20,
        "weights_mib": a.entities * a.dim * 4 / 2**20,
        "entity_store_mib": store_bytes / 2**20,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_anon_mib": max(anon.peak, _anon_mib()),
        "cgroup_peak_mib": _cgroup_peak(cg) / 2**20,
        "mrr": mrr,
    }


# -- the parent: caps -----------------------------------------------------------------------
def parse_size(s: str) -> int:
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in units else (s, "")
    return int(float(num) * units[unit])


class Cgroup:
    """A memory cgroup of ``limit`` bytes made here (root): v2, or v1's memory hierarchy."""

    def __init__(self, limit: int, name: str):
        v1 = Path("/sys/fs/cgroup/memory")
        if v1.is_dir():
            self.path, self.v2 = v1 / name, False
        elif Path("/sys/fs/cgroup/cgroup.controllers").is_file():
            self.path, self.v2 = Path("/sys/fs/cgroup") / name, True
        else:
            raise OSError("no memory cgroup hierarchy")
        self.path.mkdir()
        try:
            (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(
                str(limit))
            swap = self.path / ("memory.swap.max" if self.v2 else "memory.memsw.limit_in_bytes")
            if swap.exists():  # no way around the cap through swap
                try:
                    swap.write_text("0" if self.v2 else str(limit))
                except OSError:
                    pass
        except BaseException:
            self.remove()
            raise

    def enter(self) -> None:
        """Move the calling process into the cgroup (a ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def oom_kills(self) -> int:
        try:
            if self.v2:
                for line in (self.path / "memory.events").read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
            else:
                for line in (self.path / "memory.oom_control").read_text().splitlines():
                    if line.startswith("oom_kill "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def remove(self) -> None:
        for _ in range(50):  # empty once its processes are gone
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def cap_method() -> str:
    """How caps are applied here: "cgroup" (made here), "systemd-run" or "" (none)."""
    try:
        Cgroup(64 << 20, f"dsa_pykeen_ooc_probe_{os.getpid()}").remove()
        return "cgroup"
    except OSError:
        pass
    if shutil.which("systemd-run"):
        r = subprocess.run(["systemd-run", "--scope", "--quiet", "-p", "MemoryMax=64M",
                            "true"], check=False, capture_output=True)
        if r.returncode == 0:
            return "systemd-run"
    return ""


def run_one(a, cap: str, method: str, root: Path) -> dict:
    args = ["--child", "--root", str(root)] + [
        x for k in ("entities", "relations", "triples", "test_triples", "dim", "epochs",
                    "batch", "slice", "eval_batch", "chunk_rows", "seed")
        for x in (f"--{k.replace('_', '-')}", str(getattr(a, k)))]
    if a.storage:
        args += ["--storage", a.storage]
    if a.memory:
        args += ["--memory", a.memory]
    if a.anon_trace:
        args += ["--anon-trace", a.anon_trace]
    if a.all_metrics:
        args += ["--all-metrics"]
    cmd = [sys.executable, "-m", "benchmarks.pykeen_ooc", *args]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    cg, pre = None, None
    if cap != "none" and method == "cgroup":
        cg = Cgroup(parse_size(cap), f"dsa_pykeen_ooc_{os.getpid()}_{time.monotonic_ns()}")
        pre = cg.enter
    elif cap != "none" and method == "systemd-run":
        cmd = ["systemd-run", "--scope", "--quiet", "-p", f"MemoryMax={parse_size(cap)}",
               "-p", "MemorySwapMax=0", *cmd]
    try:
        t0 = time.perf_counter()
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env,
                           preexec_fn=pre, cwd=ROOT)
        wall = time.perf_counter() - t0
    finally:
        kills = cg.oom_kills() if cg is not None else 0
        if cg is not None:
            cg.remove()
    row = {"cap": cap, "ok": r.returncode == 0, "exit": r.returncode, "oom_kills": kills,
           "wall_s": wall}
    if r.returncode == 0:
        row.update(json.loads(r.stdout.strip().splitlines()[-1]))
    else:
        row["error"] = (r.stderr.strip().splitlines() or [""])[-1][-300:]
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--entities", type=int, default=1_000_000)
    ap.add_argument("--relations", type=int, default=1000)
    ap.add_argument("--triples", type=int, default=2_000_000)
    ap.add_argument("--test-triples", type=int, default=8,
                    help="each evaluation batch reads the whole entity table, per side")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--slice", type=int, default=4096, help="evaluation slice (entities); "
                    "TransE holds eval-batch x slice x dim floats per slice")
    ap.add_argument("--eval-batch", type=int, default=4,
                    help="evaluation batch (triples); each holds eval-batch x entities scores")
    ap.add_argument("--chunk-rows", type=int, default=0, help="0: the adapter's default")
    ap.add_argument("--memory", default=None, help="disk_representations(memory=...): the "
                    "tables' log-store budget (default: the adapter's, from the cgroup)")
    ap.add_argument("--storage", choices=("auto", "inplace", "log"), default=None,
                    help="the tables' store kind (default: the adapter's, auto)")
    ap.add_argument("--seed", type=int, default=0, help="of the random graph")
    ap.add_argument("--all-metrics", action="store_true", help="PyKEEN's default metrics "
                    "(with the rank-adjusted ones, whose expectations take a few float64 "
                    "arrays of num_entities at the end) instead of the docs' MRR and Hits@k")
    ap.add_argument("--anon-trace", default=None, help="write the child's RssAnon (MiB) every 0.2 "
                    "s to this file (a cap's run overwrites the one before)")
    ap.add_argument("--caps", nargs="+", default=["1G", "768M", "512M"],
                    help="memory caps to run under, e.g. 2G 1.5G 768M; 'none': uncapped")
    ap.add_argument("--workdir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="a tiny graph: runs in seconds")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)), flush=True)
        return
    method = cap_method()
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
        a.caps = ["1G"] if method else ["none"]
    caps = sorted(a.caps, key=lambda c: float("inf") if c == "none" else parse_size(c),
                  reverse=True)
    if not method and any(c != "none" for c in caps):
        raise SystemExit("no memory cgroup can be made here (needs root and a cgroup v1/v2 "
                         "hierarchy, or systemd-run); pass --caps none to run uncapped")
    print(f"TransE {a.entities:,} x {a.dim} entities ({a.entities * a.dim * 4 / 2**30:.2f} "
          f"GiB of weights), {a.relations:,} relations, {a.triples:,} triples; caps "
          f"{' '.join(caps)} ({method or 'none'})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=a.workdir, prefix="dsa_pykeen_ooc_") as tmp:
        for cap in caps:
            row = run_one(a, cap, method, Path(tmp))
            rows.append(row)
            print(f"  cap {cap}: " + (
                f"first step after {row['first_step_s']:.1f} s, trained after "
                f"{row['train_s']:.1f} s, evaluated after {row['total_s']:.1f} s; wrote "
                f"{row['written_before_first_step_mib']:,.0f} MiB before the first step "
                f"(entity store {row['entity_store_mib']:,.0f} MiB); peak RSS "
                f"{row['peak_rss_mib']:,.0f} MiB, anonymous {row['peak_anon_mib']:,.0f} MiB, "
                f"cgroup {row['cgroup_peak_mib']:,.0f} MiB; "
                f"MRR {row['mrr']:.4f}" if row["ok"] else
                f"FAILED (exit {row['exit']}, OOM kills {row['oom_kills']}): {row['error']}"),
                flush=True)
    print_table(rows, ["cap", "ok", "first_step_s", "train_s", "total_s",
                       "written_before_first_step_mib", "entity_store_mib", "peak_rss_mib",
                       "peak_anon_mib", "cgroup_peak_mib", "oom_kills", "mrr"])
    passed = [r["cap"] for r in rows if r["ok"] and r["cap"] != "none"]
    if passed:
        print(f"smallest cap that trained and evaluated: {passed[-1]}")
    meta = {"machine": machine(), "cap_method": method,
            "args": {k: v for k, v in vars(a).items() if k not in ("workdir", "root", "child")}}
    write_results("pykeen_ooc_smoke" if a.smoke else "pykeen_ooc", rows, meta)


if __name__ == "__main__":
    main()
