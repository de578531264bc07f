"""A log store's anonymous memory against its ``memory=``, fresh and aged (issue 28).

    python -m benchmarks.memory_budget                  # 4M x 128, memory=256MiB, 65,536-row batches
    python -m benchmarks.memory_budget --rows 10000000 --memory 1GiB --batch 16384
    python -m benchmarks.memory_budget --smoke          # tiny, seconds

Each configuration runs in a child process: it imports everything and compiles the kernels
on a tiny store first, takes the process's ``RssAnon`` then as its baseline, creates the
store (``storage="log"``, ``memory=``), and steps uniform random batches (unique ids, the
same gradient every step) until ``--passes`` times the table's rows have been updated --
two passes bring a store with the default ``space_ratio=2`` to its space bound, where every
seal cleans -- then flushes. A thread reads ``RssAnon`` from ``/proc/self/status`` every
2 ms; the table gives its highest value over the baseline, against ``memory=`` (the goal:
at most ``memory=`` + 64 MiB), for the first pass (fresh) and the rest (aged). A batch the
budget cannot hold is refused by the first step: the table then says so and gives the error
(never an OOM kill). The batch's ids and gradients are the caller's (made before the
baseline). Under a memory cgroup, run it inside one, e.g.
``systemd-run --scope -p MemoryMax=1G python -m benchmarks.memory_budget``.
Writes ``benchmarks/results/memory_budget.{json,csv}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ._common import machine, mem, print_table, write_results


class _Peak:
    """A thread that keeps the highest RssAnon seen (every ``every`` seconds)."""

    def __init__(self, every: float = 0.002):
        self.high, self.every, self._stop = 0, every, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.high = max(self.high, mem()["RssAnon"])
            time.sleep(self.every)

    def take(self) -> int:
        """The highest value since the last ``take`` (then start again from now)."""
        high, self.high = max(self.high, mem()["RssAnon"]), mem()["RssAnon"]
        return high

    def stop(self) -> None:
        self._stop.set()
        self._t.join()


def _child(a) -> dict:
    import dsa_core

    root = a.workdir
    rng = np.random.default_rng(0)
    g = np.full((a.batch, a.dim), 0.01, np.float32)
    warm = dsa_core.create(os.path.join(root, "warm"), 1000, a.dim, storage="log",
                           memory="4MiB")
    for _ in range(3):
        warm = dsa_core.step(warm, rng.choice(1000, 100, replace=False), g[:100])
    dsa_core.close(warm)
    shutil.rmtree(os.path.join(root, "warm"))
    base = mem()["RssAnon"]
    peak = _Peak()
    s = dsa_core.create(os.path.join(root, "s"), a.rows, a.dim, storage="log", memory=a.memory)
    budget = int(s.store.info.memory_bytes)
    out = {"rows": a.rows, "dim": a.dim, "batch": a.batch, "memory_mib": budget / 2**20,
           "base_anon_mib": round(base / 2**20, 1)}
    updates, per_pass, fresh = 0, a.rows, None
    try:
        while updates < a.passes * a.rows:
            s = dsa_core.step(s, rng.choice(a.rows, a.batch, replace=False), g)
            updates += a.batch
            if fresh is None and updates >= per_pass:
                fresh = peak.take()
        dsa_core.flush(s)
    except ValueError as exc:  # the budget cannot hold a batch: refused, never an OOM kill
        out["refused"] = str(exc).split(". memory=")[0]  # what came, what would hold it
        peak.stop()
        dsa_core.close(s)
        return out
    aged = peak.take()
    peak.stop()
    st = s.store.stats()
    out.update({
        "fresh_over_base_mib": round(((fresh or aged) - base) / 2**20, 1),
        "aged_over_base_mib": round((aged - base) / 2**20, 1),
        "aged_over_memory_mib": round((aged - base - budget) / 2**20, 1),
        "space_used": st["space_used"],
        "region_slots": st["region_slots"],
        "split_mib": {k.removeprefix("memory_").removesuffix("_bytes"): round(v / 2**20, 1)
                      for k, v in st.items() if k.startswith("memory_") and k.endswith("_bytes")},
    })
    dsa_core.close(s)
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--memory", nargs="+", default=["256MiB"], help="one run per budget")
    ap.add_argument("--batch", type=int, nargs="+", default=[65_536], help="one run per size")
    ap.add_argument("--passes", type=float, default=3.0,
                    help="updates as a multiple of the rows (2+: aged to the space bound)")
    ap.add_argument("--workdir", default=None, help="where the stores go (default: TMPDIR)")
    ap.add_argument("--smoke", action="store_true", help="20k x 16 rows, seconds")
    ap.add_argument("--name", default=None, help="results file name (default: memory_budget)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.memory, a.batch = a.memory[0], a.batch[0]
        print(json.dumps(_child(a)))
        return []
    if a.smoke:
        a.rows, a.dim, a.memory, a.batch, a.passes = 20_000, 16, ["3MiB"], [256, 8192], 2.5
    rows = []
    for memory in a.memory:
        for batch in a.batch:
            work = tempfile.mkdtemp(prefix="dsa_memory_budget_", dir=a.workdir)
            cmd = [sys.executable, "-m", "benchmarks.memory_budget", "--child", "--rows",
                   str(a.rows), "--dim", str(a.dim), "--memory", memory, "--batch",
                   str(batch), "--passes", str(a.passes), "--workdir", work]
            try:
                res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if res.returncode != 0:
                rows.append({"memory_mib": memory, "batch": batch,
                             "refused": f"exit status {res.returncode} (killed?): "
                                        f"{res.stderr[-300:]}"})
                continue
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print_table(rows, ["memory_mib", "batch", "base_anon_mib", "fresh_over_base_mib",
                       "aged_over_base_mib", "aged_over_memory_mib", "space_used", "refused"])
    write_results("memory_budget_smoke" if a.smoke else (a.name or "memory_budget"), rows,
                  {"machine": machine(), "args": vars(a)})
    return rows


if __name__ == "__main__":
    main()
