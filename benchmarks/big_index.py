"""A log store's index at large row counts: the baseline of issue 40 ("a paged index").

    python -m benchmarks.big_index --workdir /work/tmp/bigidx   # 100M x 16, memory=1GiB, cap 2G
    python -m benchmarks.big_index --workdir /work/tmp/bigidx --memory 256MiB --cap 1G \
        --name big_index_2026-12-07_256MiB    # refused at create today (the index alone: 763 MiB)
    python -m benchmarks.big_index --rows 20000 --dim 4 --steps 2 --cap none   # the smoke size

A log store keeps its index ``loc`` (8 bytes per row of the table) in memory, paid from
``memory=``, writes it whole at every flush and checkpoint and reads it whole at open
(docs/log-index-plan.md). For a table of ``--rows`` x ``--dim`` float32 (Adam, weights in the
store, ``init="normal"``) this measures, in one process (inside a memory cgroup of ``--cap``,
``benchmarks/memcap.sh``: the script runs itself again as a child under it; ``--cap none``
runs in this process, uncapped):

1. ``create``: its time and the bytes on disk after it (allocated blocks of the store's files).
2. The smallest ``memory=`` the store takes, from the store's own budget
   (``dsa_core.region_memory``, the figure its refusal names): for one row (the least that
   opens it at all) and for a batch of ``--batch`` rows; with the index's share. A ``memory=``
   below that is refused at ``create``: the run then reports the store's message and stops.
3. ``--steps`` steps of ``dsa_core.step`` (``--batch`` unique ids per step, uniform, or Zipf
   of exponent ``--zipf`` over ranks scattered by a multiplicative hash; random gradients),
   then ``flush``: its time, the bytes the process wrote (``write_bytes`` of
   ``/proc/self/io``, the background writer thread included), the sizes of the files it left
   that were not there before, and the bytes of the records it had to write (distinct rows
   stepped since the last flush x record bytes).
4. ``--steps`` more steps, then ``dsa_core.checkpoint`` into a new directory: the same figures,
   and the checkpoint's disk not shared with the store (its hard links are not counted).
5. ``close``, then ``open`` three times (the median time reported), the page cache dropped
   before each (``sync; echo 1 > /proc/sys/vm/drop_caches``) when running as root unless
   ``--no-drop-caches``; the process's RssAnon before the open, right after it and after one
   step (the largest of the three opens). Each open is closed again after its step (that
   close flushes: not measured).

Prints one table of these figures and writes ``benchmarks/results/big_index_<date>.json``
(``--name``; not with ``--no-save``). The store and the checkpoint are deleted at the end
unless ``--keep``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import (child_reply, disk_bytes, machine, mem, print_table, result_args,
                      write_results)

HERE = Path(__file__).resolve().parent
MEMCAP = HERE / "memcap.sh"
MIB = 2**20


def proc_io() -> dict[str, int]:
    """This process's I/O counters (``/proc/self/io``: all its threads), empty if unknown."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (ln.split(":") for ln in f if ":" in ln)}
    except OSError:
        return {}


def files(path: Path) -> dict[str, tuple[int, int]]:
    """``{name: (size, allocated bytes)}`` of the files in ``path``."""
    out = {}
    for e in os.scandir(path):
        if e.is_file(follow_symlinks=False):
            st = e.stat(follow_symlinks=False)
            out[e.name] = (st.st_size, st.st_blocks * 512)
    return out


def drop_caches(enabled: bool) -> bool:
    """``sync; echo 1 > /proc/sys/vm/drop_caches`` (root only); whether it did."""
    os.sync()
    if not enabled:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def id_sampler(n: int, b: int, alpha: float, rng: np.random.Generator):
    """``draw()``: up to ``b`` distinct ids in [0, n). ``alpha == 0``: ``b`` uniform ones;
    else ``b`` draws of a bounded power law p(rank) ~ rank^-alpha (the continuous inverse CDF,
    O(b) memory at any n: ``_common.zipf_sampler`` holds two arrays of n floats), made unique
    (so fewer than ``b``), ranks scattered by a multiplicative hash as ``_common`` does."""
    if alpha == 0:
        return lambda: rng.choice(n, b, replace=False)
    mult = 2654435761 % n or 1
    while np.gcd(mult, n) != 1:
        mult += 1

    def draw() -> np.ndarray:
        u = rng.random(b)
        if abs(alpha - 1.0) < 1e-9:
            x = np.power(float(n + 1), u)
        else:
            e = 1.0 - alpha
            x = np.power(1.0 + u * ((n + 1.0) ** e - 1.0), 1.0 / e)
        rank = np.minimum(np.floor(x).astype(np.int64) - 1, n - 1)
        ids = (np.unique(rank) * mult) % n
        return rng.permutation(ids)

    return draw


def measure(a) -> dict:
    """Every figure of the module docstring, as one dict (``refused`` set if create refused)."""
    import dsa_core

    if a.threads:
        dsa_core.set_num_threads(a.threads)
    work = Path(a.workdir)
    path, ckpt = work / "store", work / "ckpt"
    for p in (path, ckpt):
        shutil.rmtree(p, ignore_errors=True)
    # the record layout of this dim, from a one-row store (the table's may be refused)
    one = dsa_core.create(work / "one-row", 1, a.dim, storage="log")
    lay = {"num_rows": a.rows, "stride": int(one.store.layout.stride), "dtype": "float32"}
    dsa_core.close(one)
    shutil.rmtree(work / "one-row")
    rec_bytes = int(lay["stride"]) * 4
    res = {"rows": a.rows, "dim": a.dim, "memory": a.memory, "batch": a.batch,
           "steps": a.steps, "zipf": a.zipf, "record_bytes": rec_bytes,
           "index_bytes": 8 * a.rows,
           "need_open_bytes": dsa_core.region_memory(lay, 1),
           "need_batch_bytes": dsa_core.region_memory(lay, a.batch)}

    def log(msg):
        print(f"  {msg}", file=sys.stderr, flush=True)

    # 1. create (2. a too-small budget is refused here, by the store's own check)
    io0, t0 = proc_io(), time.perf_counter()
    try:
        st = dsa_core.create(path, a.rows, a.dim, storage="log", memory=a.memory,
                             init="normal", seed=0)
    except ValueError as e:
        res["refused"] = str(e)
        log(f"create refused: {e}")
        return res
    res["create_s"] = time.perf_counter() - t0
    res["create_written"] = proc_io().get("write_bytes", 0) - io0.get("write_bytes", 0)
    res["create_disk"] = disk_bytes(path)
    res["memory_bytes"] = int(st.store.stats()["region_budget_bytes"])
    res["region_slots"] = int(st.store.stats()["region_slots"])
    assert dsa_core.region_memory(st, 1) == res["need_open_bytes"]
    log(f"created in {res['create_s']:.1f} s, {res['create_disk'] / MIB:.2f} MiB on disk")

    rng = np.random.default_rng(a.seed)
    draw = id_sampler(a.rows, a.batch, a.zipf, rng)

    def train(state, steps):
        ts, seen = [], []
        for _ in range(steps):
            ids = draw()
            grad = rng.standard_normal((ids.size, a.dim), dtype=np.float32)
            seen.append(ids)
            t = time.perf_counter()
            state = dsa_core.step(state, ids, grad)
            ts.append(time.perf_counter() - t)
        touched = np.unique(np.concatenate(seen)).size if seen else 0
        return state, touched, ts

    def committed(what, fn, where):
        """Run ``fn`` (a flush or a checkpoint) and measure what it wrote."""
        before = files(where) if where.exists() else {}
        io0, t0 = proc_io(), time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        io1 = proc_io()
        after = files(where)
        new = {k: v for k, v in after.items() if before.get(k) != v}
        res[f"{what}_s"] = dt
        res[f"{what}_written"] = io1.get("write_bytes", 0) - io0.get("write_bytes", 0)
        res[f"{what}_wchar"] = io1.get("wchar", 0) - io0.get("wchar", 0)
        res[f"{what}_new_files"] = {k: v[0] for k, v in sorted(new.items())}
        res[f"{what}_new_file_bytes"] = sum(v[0] for v in new.values())
        log(f"{what}: {dt:.2f} s, wrote {res[f'{what}_written'] / MIB:.1f} MiB, new files "
            f"{res[f'{what}_new_files']}")

    # 3. steps, then flush
    st, touched, ts = train(st, a.steps)
    res["step_ms_median"] = 1e3 * statistics.median(ts) if ts else 0.0
    res["flush_dirty_rows"] = touched
    res["flush_dirty_bytes"] = touched * rec_bytes
    committed("flush", lambda: dsa_core.flush(st), path)

    # 4. more steps, then a checkpoint into a new directory
    st, touched, ts = train(st, a.steps)
    res["checkpoint_dirty_rows"] = touched
    res["checkpoint_dirty_bytes"] = touched * rec_bytes
    committed("checkpoint", lambda: dsa_core.checkpoint(st, ckpt), ckpt)
    ls = st.store.log_stats()
    res.update(index_mapped=bool(ls.get("index_mapped", False)),
               index_rebases=int(ls.get("index_rebases", 0)),
               index_memory_bytes=int(ls.get("index_memory_bytes", 8 * a.rows)),
               index_delta_rows=int(ls.get("index_delta_rows", 0)))
    seen: set = set()
    disk_bytes(path, seen=seen)
    res["checkpoint_own_disk"] = disk_bytes(ckpt, seen=seen)  # not shared with the store
    res["store_disk"] = disk_bytes(path)

    # 5. close, then open three times
    t0 = time.perf_counter()
    dsa_core.close(st)
    res["close_s"] = time.perf_counter() - t0
    del st
    opens, rss_before, rss_open, rss_step, dropped = [], [], [], [], []
    for _ in range(3):
        dropped.append(drop_caches(not a.no_drop_caches and os.geteuid() == 0))
        rss_before.append(mem()["RssAnon"])
        io0, t0 = proc_io(), time.perf_counter()
        st = dsa_core.open(path, memory=a.memory)
        opens.append(time.perf_counter() - t0)
        res.setdefault("open_read", proc_io().get("read_bytes", 0) - io0.get("read_bytes", 0))
        rss_open.append(mem()["RssAnon"])
        ids = draw()
        st = dsa_core.step(st, ids, rng.standard_normal((ids.size, a.dim), dtype=np.float32))
        rss_step.append(mem()["RssAnon"])
        dsa_core.close(st)  # flushes the one step (not timed)
        del st
        log(f"open {opens[-1]:.2f} s (caches dropped: {dropped[-1]}), RssAnon "
            f"{rss_before[-1] / MIB:.0f} -> {rss_open[-1] / MIB:.0f} -> {rss_step[-1] / MIB:.0f}"
            " MiB")
    res.update({"open_s": opens, "open_s_median": statistics.median(opens),
                "caches_dropped": all(dropped), "rss_anon_before_open": max(rss_before),
                "rss_anon_after_open": max(rss_open), "rss_anon_after_step": max(rss_step)})
    return res


def table_rows(r: dict) -> list[dict]:
    """The figures of ``measure``'s dict as rows of (figure, value, unit)."""
    def row(figure, value, unit=""):
        return {"figure": figure, "value": value, "unit": unit}

    out = [row("table", f"{r['rows']:,} x {r['dim']} float32, record {r['record_bytes']} B"),
           row("memory= given", r["memory"]),
           row("index (8 B/row)", r["index_bytes"] / MIB, "MiB"),
           row("smallest memory= to open", r["need_open_bytes"] / MIB, "MiB"),
           row("index mapped (else in memory)", r.get("index_mapped", False)),
           row("index memory after training", r.get("index_memory_bytes", 0) / MIB,
               f"MiB (delta {r.get('index_delta_rows', 0):,} rows, "
               f"{r.get('index_rebases', 0)} rebases)"),
           row(f"smallest memory= for a batch of {r['batch']}", r["need_batch_bytes"] / MIB,
               "MiB")]
    if "refused" in r:
        return [*out, row("create", "REFUSED (the store's message below)")]
    out += [row("create", r["create_s"], "s"),
            row("disk after create", r["create_disk"] / MIB, "MiB"),
            row("region slots at memory=", r["region_slots"], "rows"),
            row("step (median)", r["step_ms_median"], "ms")]
    for what in ("flush", "checkpoint"):
        out += [row(f"{what}", r[f"{what}_s"], "s"),
                row(f"{what}: records dirtied", r[f"{what}_dirty_bytes"] / MIB,
                    f"MiB ({r[f'{what}_dirty_rows']:,} rows)"),
                row(f"{what}: bytes written (/proc/self/io)", r[f"{what}_written"] / MIB,
                    "MiB"),
                row(f"{what}: " + ("new or changed files" if what == "flush" else
                                   "its files (links included)"),
                    r[f"{what}_new_file_bytes"] / MIB,
                    "MiB (" + ", ".join(r[f"{what}_new_files"]) + ")"),
                row(f"{what}: written / dirtied",
                    r[f"{what}_written"] / max(1, r[f"{what}_dirty_bytes"]), "x")]
    out += [row("checkpoint: disk not shared with the store", r["checkpoint_own_disk"] / MIB,
                "MiB"),
            row("store on disk at the end", r["store_disk"] / MIB, "MiB"),
            row("close", r["close_s"], "s"),
            row("open (median of 3)", r["open_s_median"], "s, caches dropped: "
                f"{r['caches_dropped']}; " + ", ".join(f"{t:.2f}" for t in r["open_s"])),
            row("open: bytes read from disk (first)", r["open_read"] / MIB, "MiB"),
            row("RssAnon before open", r["rss_anon_before_open"] / MIB, "MiB"),
            row("RssAnon after open", r["rss_anon_after_open"] / MIB, "MiB"),
            row("RssAnon after one step", r["rss_anon_after_step"] / MIB, "MiB")]
    return out


def run_capped(a, argv: list[str]) -> dict:
    """This script again, as a child in a memory cgroup of ``a.cap``; its figures, with the
    cgroup's peak."""
    r = subprocess.run(["bash", str(MEMCAP), "64M", "true"], capture_output=True, check=False)
    if r.returncode != 0:
        raise SystemExit("no writable memory cgroup here (benchmarks/memcap.sh needs root and "
                         "cgroup v1 or v2); pass --cap none to run uncapped")
    cmd = ["bash", str(MEMCAP), a.cap, sys.executable, "-m", "benchmarks.big_index", *argv,
           "--workdir", str(a.workdir), "--child"]  # the last --workdir wins: the parent's
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [
        env.get("PYTHONPATH")])])
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=HERE.parent)
    lines = []
    for ln in p.stderr:  # progress as it comes; the memcap line at the end
        print(ln, end="", file=sys.stderr, flush=True)
        lines.append(ln)
    out = p.stdout.read()
    if p.wait() != 0:
        raise SystemExit(f"child failed (exit {p.returncode}):\n{''.join(lines)[-4000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    cap = [ln.strip() for ln in lines if ln.startswith("memcap:")]
    res["memcap"] = cap[-1] if cap else ""
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--memory", default="1GiB", help="the log store's memory= (its budget)")
    ap.add_argument("--cap", default="2G", help="memory cgroup limit of the measuring child "
                    "(benchmarks/memcap.sh); 'none': run in this process, uncapped")
    ap.add_argument("--batch", type=int, default=2048, help="ids per step")
    ap.add_argument("--steps", type=int, default=50, help="steps before the flush, and again "
                    "before the checkpoint")
    ap.add_argument("--zipf", type=float, default=0.0, help="Zipf exponent of the ids "
                    "(0: uniform)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: dsa_core's "
                    "default)")
    ap.add_argument("--workdir", default=None, help="where the store and the checkpoint go "
                    "(default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the store and the checkpoint")
    ap.add_argument("--no-drop-caches", action="store_true", help="never drop the page cache "
                    "before an open (default: dropped when running as root)")
    result_args(ap, "big_index_<date>")
    raw = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(raw)
    if child_reply(a, measure):
        return {}
    tmp = None
    if a.workdir is None:
        a.workdir = tmp = tempfile.mkdtemp(prefix="dsa_big_index_")
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    try:
        if a.cap == "none":
            res = measure(a)
        else:
            res = run_capped(a, raw)
    finally:
        if not a.keep:
            for sub in ("store", "ckpt"):
                shutil.rmtree(Path(a.workdir) / sub, ignore_errors=True)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    res["cap"] = a.cap
    rows = table_rows(res)
    if res.get("memcap"):
        rows.append({"figure": "cgroup", "value": res["memcap"], "unit": ""})
    print_table(rows, ["figure", "value", "unit"])
    if "refused" in res:
        print(f"create refused: {res['refused']}")
    if not a.no_save:
        name = a.name or f"big_index_{datetime.date.today():%Y-%m-%d}"
        meta = {"machine": machine(), "argv": raw, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "results": res}
        print(f"wrote {write_results(name, rows, meta).with_suffix('.json')}")
    return res


if __name__ == "__main__":
    main()
