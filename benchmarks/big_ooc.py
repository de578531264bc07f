"""Out-of-core training of a log store with far more rows than memory (issue 40's target).

    python -m benchmarks.big_ooc --workdir /work/tmp/bigooc --keep      # 100M x 16, memory=256MiB
    python -m benchmarks.big_ooc --workdir /work/tmp/bigooc --keep --rows 5000000 \
        --memory 16MiB --steps 200 --name big_ooc_5M       # a medium size, a few minutes
    python -m benchmarks.big_ooc --rows 20000 --dim 4 --memory 300KiB --batch 64 --steps 3 \
        --warmup 2 --caches 0.1 --probe-seconds 0.2 --cap-none --no-drop-caches --no-save
                                                            # the smoke size (seconds)

Issue 40: "out of core at 100M x 16, uniform and Zipf, index cache 1% / 10% / 100% of the
index: rows/s and disk reads per row, against the same run's QD32 probe; goal >= 0.8 of the
probe with a 10% cache on Zipf". A log store of ``--rows`` x ``--dim`` float32 (Adam,
``storage="log"``) opened with ``memory=--memory`` keeps its row index (8 bytes per row: where
each row's newest record lies) *mapped* from its base file (``index-*.bin``) once 16 bytes per
row pass ``memory=`` (``dsa_core/_log/budget.py``, ``index_mapped``): the index's pages are page
cache, read from disk as rows are looked up. "The index cache" is the page cache room the
process has for that file, set here by its memory cgroup's limit.

1. **Build** (once; ``--workdir W`` with ``--keep`` reuses ``W/store`` when ``W/store.built.json``
   names the same rows and dim, unless ``--rebuild``): a log store with *every* row's record
   on disk (a row never written reads as its initial value and costs no read): the records of
   each chunk of rows (``read_records`` of never-written rows: their ``init="normal"`` values,
   no disk read) written back with ``write_records`` (as ``_common.rewrite_rows``), then
   ``close`` (the region sealed, the index base written). The build opens the store with
   ``--build-memory`` (default 16 bytes per row + 256 MiB: the index in memory, so that the
   build writes no index rebases). Refused, before anything is written, when the free disk
   (``shutil.disk_usage``) cannot take the records, two index bases and 1 GiB. Reports the
   build's time and the store's allocated bytes.
2. **The drive's probe**, before the cases: ``probes.drive_rate`` (``drive_probe.c``: 4 KiB
   random ``O_DIRECT`` reads, every page of the files equally likely) over the store's own
   segment files at QD32 and QD1, ``--probe-seconds`` each. Each case's rows/s is reported
   over the QD32 reads/s (``vs_qd32``).
3. **One case** per id distribution (``uniform``: ``--batch`` distinct ids; ``zipf``: ``--batch``
   draws of p(rank) ~ rank^-``--zipf`` made unique, ranks scattered by a multiplicative hash:
   ``big_index.id_sampler``; exponent 1.1 as ``ooc.py``'s Zipf) and index cache share
   (``--caches``), each in a fresh child process inside its own memory cgroup
   (``benchmarks/memcap.sh``, started with a limit of ``--cap-start``). Before each, the store's
   files are written back and dropped from the page cache (``posix_fadvise(DONTNEED)``, and
   ``echo 1 > /proc/sys/vm/drop_caches`` as root unless ``--no-drop-caches``). The child:

   - opens the store with ``memory=--memory`` and steps (``dsa_core.step``, random gradients)
     over batches fed through ``dsa_core.prefetched`` (``--ahead`` batches read ahead, as a
     training loop would): at least ``--warmup`` steps, and on until the region has sealed
     once since the open (full: a steady state of evictions; at most ``--max-warmup`` steps);
   - sets its cgroup's limit (v1 ``memory.limit_in_bytes``, v2 ``memory.max``) to
     ``not_file + share * index_file_bytes + --slack``: ``not_file`` is the cgroup's charge
     that is not page cache (``memory.usage_in_bytes - cache`` or ``memory.current - file``:
     anonymous memory and kernel memory, the region included), the slack is room for the
     record pages in flight (the misses' reads, the seals' writes); the page cache room of
     the index is thus about ``share`` of its file (its pages compete with the segments'
     pages in one LRU: the share is an upper bound);
   - drops the page cache again (as above; the index's pages mapped by the process stay until
     the limit reclaims them), then times ``--steps`` steps.

   The room is thus ``share * index_file_bytes + --slack``: where the slack is not small
   against the index (a small table, or a 1% share), the index's pages may take the slack
   too, and the shares differ less than their names say (the table's ``room_mib``).

   Per case: rows/s over the whole timed loop (rows stepped, the unique ids, over its wall
   time: id draws and read-ahead submission included; ``step_rows_per_s_median``: the median
   of the per-step rates, the step call alone), read I/Os per row (reads completed by the
   store's block device, ``/sys/dev/block/M:m/stat``: *device-wide*, so another process's
   reads on that disk count too), KB read per row (``read_bytes`` of ``/proc/self/io``: this
   process's threads alone), the store's own counters per row (``log_stats``: ``misses``, the
   records read from segments, and ``index_page_reads``, index pages found not cached at
   lookup, where this dsa_core reports it; else None), major faults per row
   (``getrusage``: the mapped index's pages read at fault time), the cgroup limit, and
   ``not_file`` at the start and the end of the timed steps (a growth eats the cache room).
   ``close`` (a flush: untimed) ends the case; the store ages by what each case writes.

Prints one table (a line per case) and writes ``benchmarks/results/big_ooc_<date>.json``
(``--name``; not with ``--no-save``). Without a writable memory cgroup (not root), or with
``--cap-none``, the children run uncapped: the cache share is then only a label (the whole
index may stay cached) and the table says ``limit_mib`` 0. The smoke size's index is mapped
too (16 bytes x 20,000 rows > 300 KiB); its figures mean nothing. The store is deleted at
the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import (
    child_reply,
    disk_bytes,
    disk_stat_file,
    machine,
    mem,
    own_cgroup,
    print_table,
    result_args,
    write_results,
)
from .big_index import drop_caches, id_sampler, proc_io

HERE = Path(__file__).resolve().parent
MEMCAP = HERE / "memcap.sh"
MIB = 2**20
GIB = 2**30
MARKER = "store.built.json"


def parse_bytes(s: str) -> int:
    """``"256MiB"``, ``"64M"``, ``"1G"``, ``"4096"`` -> bytes (powers of 1024)."""
    t = str(s).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def log(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)


def store_files(path: Path) -> tuple[list[Path], Path | None]:
    """The store's segment files (those its manifest lists) and its index base file (or
    None), from the manifest as the format documents it (docs/storage.md)."""
    man = json.loads((path / "manifest.json").read_text())
    segs = [path / f"seg-{int(s):08d}.dsl" for s in man["segments"]]
    idx = path / man["index"] if man.get("index") else None
    return segs, idx


def evict(path: Path, drop: bool) -> str:
    """Write back and drop the store's files from the page cache (``ooc.evict``:
    ``fadvise(DONTNEED)``, pages mapped by a process stay), and drop the whole page cache too
    when ``drop`` and root; says what it did."""
    from .ooc import evict as evict_files

    evict_files(path)
    if drop_caches(drop and os.geteuid() == 0):
        return "drop_caches"
    return "fadvise"


# -- the build -----------------------------------------------------------------------------------
def record_bytes(workdir: Path, dim: int) -> int:
    """The record bytes of a log store of ``dim`` (from a one-row store)."""
    import dsa_core

    one = dsa_core.create(workdir / "one-row", 1, dim, storage="log", overwrite=True)
    rb = int(one.store.layout.stride) * one.store.layout.dtype.itemsize
    dsa_core.close(one)
    shutil.rmtree(workdir / "one-row")
    return rb


def ensure_store(a, work: Path) -> dict:
    """The store at ``work/store`` with every row on disk (built, or reused); its figures."""
    import dsa_core

    path, marker = work / "store", work / MARKER
    if a.keep and not a.rebuild and marker.exists() and (path / "manifest.json").exists():
        got = json.loads(marker.read_text())
        if got.get("rows") == a.rows and got.get("dim") == a.dim:
            log(f"reusing {path} (built in {got['build_s']:.0f} s)")
            return {**got, "reused": True, "store_disk": disk_bytes(path)}
    rec = record_bytes(work, a.dim)
    need = a.rows * rec + 2 * 8 * a.rows + GIB
    free = shutil.disk_usage(work).free
    if free < need:
        raise SystemExit(f"not enough free disk in {work}: a {a.rows:,} x {a.dim} log store "
                         f"takes about {need / 1e9:.1f} GB ({rec} B records, two index bases "
                         f"and 1 GiB), {free / 1e9:.1f} GB free; pass a smaller --rows or "
                         "another --workdir")
    marker.unlink(missing_ok=True)
    bmem = parse_bytes(a.build_memory) if a.build_memory != "auto" else 16 * a.rows + 256 * MIB
    bmem = max(bmem, parse_bytes(a.memory))
    t0 = time.perf_counter()
    st = dsa_core.create(path, a.rows, a.dim, storage="log", memory=bmem, init="normal",
                         seed=a.seed, overwrite=True)
    slots = int(st.store.stats()["region_slots"])
    chunk = max(1, min(a.build_chunk, slots // 2))
    done, shown = 0, 0.0
    while done < a.rows:  # rewrite_rows, in pieces, with progress
        n = min(a.rows - done, max(chunk, a.rows // 20))
        _rewrite(st, done, n, chunk)
        done += n
        if done / a.rows >= shown + 0.1 or done == a.rows:
            shown = done / a.rows
            log(f"build: {done:,} of {a.rows:,} rows written, {time.perf_counter() - t0:.0f} s")
    live = int(st.store.log_stats()["live_records"])
    dsa_core.close(st)  # the region sealed, the index base written
    dt = time.perf_counter() - t0
    res = {"rows": a.rows, "dim": a.dim, "record_bytes": rec, "build_memory": bmem,
           "build_chunk_rows": chunk, "build_s": dt, "live_records_before_close": live,
           "store_disk": disk_bytes(path), "reused": False}
    marker.write_text(json.dumps(res))
    log(f"built {path}: {res['store_disk'] / 1e9:.2f} GB in {dt:.0f} s")
    return res


def _rewrite(st, lo: int, n: int, chunk: int) -> None:
    """``_common.rewrite_rows`` over rows ``[lo, lo + n)``: each chunk's records (never
    written: their initial values, no read) written back."""
    import dsa_core

    for s in range(lo, lo + n, chunk):
        ids = np.arange(s, min(lo + n, s + chunk), dtype=np.int64)
        dsa_core.write_records(st, ids, dsa_core.read_records(st, ids))


# -- one case (the child) --------------------------------------------------------------------
def cg_files(cg: Path) -> tuple[Path, Path, str, str]:
    """(usage file, limit file, page cache key of memory.stat, failures file) of ``cg``."""
    if (cg / "memory.max").exists():  # v2
        return cg / "memory.current", cg / "memory.max", "file", cg / "memory.events"
    return (cg / "memory.usage_in_bytes", cg / "memory.limit_in_bytes", "cache",
            cg / "memory.failcnt")


def cg_not_file(cg: Path) -> tuple[int, int]:
    """(charge that is not page cache, page cache) of cgroup ``cg``, in bytes."""
    usage, _, key, _ = cg_files(cg)
    stat = dict(ln.split() for ln in (cg / "memory.stat").read_text().splitlines())
    cache = int(stat.get(key, 0))
    return int(usage.read_text()) - cache, cache


def cg_failures(cg: Path) -> int:
    f = cg_files(cg)[3]
    txt = f.read_text()
    if f.name == "memory.failcnt":
        return int(txt)
    return int(dict(ln.split() for ln in txt.splitlines()).get("max", 0))


def device_reads(stat: Path | None) -> tuple[int, int]:
    """(reads completed, bytes read) of a block device's ``stat`` file; (0, 0) without."""
    if stat is None:
        return 0, 0
    x = stat.read_text().split()
    return int(x[0]), int(x[2]) * 512


def run_case(a) -> dict:
    """One case (module docstring, 3.): its figures as a dict."""
    import dsa_core

    if a.threads:
        dsa_core.set_num_threads(a.threads)
    dsa_core.warmup(("float32",))
    path = Path(a.workdir) / "store"
    segs, idx_file = store_files(path)
    index_bytes = os.path.getsize(idx_file) if idx_file is not None else 0
    cg = None if a.cap_none else own_cgroup("dsa_memcap_")
    res = {"ids": a.dist, "cache": a.share, "index_file_bytes": index_bytes,
           "cgroup": str(cg) if cg else None}
    t0 = time.perf_counter()
    st = dsa_core.open(path, memory=a.memory)
    res["open_s"] = time.perf_counter() - t0
    ls0 = st.store.log_stats()
    res.update(index_mapped=bool(ls0.get("index_mapped", False)),
               live_records=int(ls0["live_records"]), slots=int(ls0["slots"]))
    if res["live_records"] < a.rows:
        log(f"warning: only {res['live_records']:,} of {a.rows:,} rows have a record on disk")
    rng = np.random.default_rng(a.seed)
    draw = id_sampler(a.rows, a.batch, 0.0 if a.dist == "uniform" else a.zipf, rng)
    grads = [rng.standard_normal((a.batch, a.dim), dtype=np.float32) for _ in range(4)]

    def batches():
        k = 0
        while True:
            ids = draw()
            yield ids, grads[k % 4][: ids.size]
            k += 1

    dev = disk_stat_file(segs[0]) if segs else None
    warm, timed, ts, rows = 0, False, [], 0
    deadline = None
    for ids, g in dsa_core.prefetched(st, batches(), ahead=a.ahead):
        if not timed:
            st = dsa_core.step(st, ids, g)
            warm += 1
            if warm < a.warmup or (warm % 10 and warm < a.max_warmup):
                continue
            ls = st.store.log_stats()
            if ls["seals"] == ls0["seals"] and warm < a.max_warmup:
                continue  # the region has not filled yet: its memory is still growing
            # the cap: what is not page cache now, plus the index's share, plus the slack
            res["warmup_steps"] = warm
            res["region_sealed_in_warmup"] = ls["seals"] > ls0["seals"]
            res["rss_anon_before"] = mem()["RssAnon"]
            if cg is not None:
                not_file, cache = cg_not_file(cg)
                limit = not_file + int(a.share * index_bytes) + parse_bytes(a.slack)
                res.update(not_file_before=not_file, cache_before_limit=cache, limit=limit)
                try:
                    cg_files(cg)[1].write_text(str(limit))
                except OSError as e:  # v1: EBUSY when it cannot reclaim down to it
                    res["limit_error"] = str(e)
                    log(f"could not set the cgroup limit to {limit / MIB:.0f} MiB: {e}")
                res["failures_before"] = cg_failures(cg)
            res["caches_dropped"] = evict(path, not a.no_drop_caches)
            ls1, io1, ru1 = st.store.log_stats(), proc_io(), resource.getrusage(
                resource.RUSAGE_SELF)
            dv1 = device_reads(dev)
            timed = True
            deadline = time.perf_counter() + a.max_seconds
            t_start = time.perf_counter()
            continue
        t0 = time.perf_counter()
        st = dsa_core.step(st, ids, g)
        dt = time.perf_counter() - t0
        ts.append((ids.size, dt))
        rows += ids.size
        if len(ts) >= a.steps or time.perf_counter() > deadline:
            break
    wall = time.perf_counter() - t_start
    ls2, io2, ru2 = st.store.log_stats(), proc_io(), resource.getrusage(resource.RUSAGE_SELF)
    dv2 = device_reads(dev)
    res["rss_anon_after"] = mem()["RssAnon"]
    if cg is not None:
        res["not_file_after"], res["cache_after"] = cg_not_file(cg)
        res["failures"] = cg_failures(cg) - res["failures_before"]
    ipr = "index_page_reads"
    res.update({
        "steps": len(ts), "rows": rows, "wall_s": wall, "rows_per_s": rows / wall,
        "step_rows_per_s_median": statistics.median(n / dt for n, dt in ts),
        "step_ms_median": 1e3 * statistics.median(dt for _, dt in ts),
        # the loop's time outside the step calls: id draws, read-ahead submission
        "outside_steps_s": wall - sum(dt for _, dt in ts),
        "timed_out": len(ts) < a.steps,
        "read_ios_per_row": (dv2[0] - dv1[0]) / rows,
        "device_kb_read_per_row": (dv2[1] - dv1[1]) / rows / 1e3,
        "kb_read_per_row": (io2.get("read_bytes", 0) - io1.get("read_bytes", 0)) / rows / 1e3,
        "misses_per_row": (ls2["misses"] - ls1["misses"]) / rows,
        "index_page_reads_per_row": (ls2[ipr] - ls1[ipr]) / rows if ipr in ls2 else None,
        "majflt_per_row": (ru2.ru_majflt - ru1.ru_majflt) / rows,
        "seals": ls2["seals"] - ls1["seals"],
        "cleaned_segments": ls2["cleaned_segments"] - ls1["cleaned_segments"],
        "index_rebases": ls2.get("index_rebases", 0) - ls1.get("index_rebases", 0)})
    t0 = time.perf_counter()
    dsa_core.close(st)  # a flush; the next case opens the store again
    res["close_s"] = time.perf_counter() - t0
    return res


# -- the parent --------------------------------------------------------------------------------
def cgroup_ok() -> bool:
    r = subprocess.run(["bash", str(MEMCAP), "64M", "true"], capture_output=True, check=False)
    return r.returncode == 0


def run_child(a, dist: str, share: float, seed: int, capped: bool) -> dict:
    """One case in a fresh process (under memcap.sh when ``capped``)."""
    cmd = [sys.executable, "-m", "benchmarks.big_ooc", "--child", "--workdir", str(a.workdir),
           "--rows", str(a.rows), "--dim", str(a.dim), "--memory", a.memory,
           "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--max-warmup", str(a.max_warmup), "--max-seconds", str(a.max_seconds),
           "--zipf", str(a.zipf), "--slack", a.slack, "--ahead", str(a.ahead),
           "--threads", str(a.threads), "--seed", str(seed), "--dist", dist,
           "--share", repr(share)]
    if a.no_drop_caches:
        cmd.append("--no-drop-caches")
    if not capped:
        cmd.append("--cap-none")
    else:
        cmd = ["bash", str(MEMCAP), a.cap_start, *cmd]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [
        env.get("PYTHONPATH")])])
    lines = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=HERE.parent) as p:
        for ln in p.stderr:  # progress as it comes (the child's JSON line is its only stdout)
            print(ln, end="", file=sys.stderr, flush=True)
            lines.append(ln)
        out = p.stdout.read()
    if p.returncode != 0:
        raise SystemExit(f"case {dist}/{share} failed (exit {p.returncode}):\n"
                         f"{''.join(lines)[-4000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    cap = [ln.strip() for ln in lines if ln.startswith("memcap:")]
    res["memcap"] = cap[-1] if cap else ""
    return res


COLS = ["ids", "cache", "limit_mib", "room_mib", "not_file_growth_mib", "rows_per_s", "vs_qd32",
        "read_ios_per_row", "kb_read_per_row", "index_page_reads_per_row", "misses_per_row",
        "majflt_per_row", "step_ms_median", "steps"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=100_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--memory", default="256MiB", help="the log store's memory= in the cases")
    ap.add_argument("--batch", type=int, default=2048, help="ids per step (Zipf: draws, made "
                    "unique)")
    ap.add_argument("--steps", type=int, default=300, help="timed steps per case")
    ap.add_argument("--warmup", type=int, default=100, help="steps before the timed ones, at "
                    "least (on until the region has sealed once)")
    ap.add_argument("--max-warmup", type=int, default=2000, help="warm-up steps at most")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="a case's timed steps "
                    "stop after this long")
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the zipf ids")
    ap.add_argument("--dists", default="uniform,zipf")
    ap.add_argument("--caches", default="0.01,0.1,1.0", help="page cache room for the index, "
                    "as shares of its file")
    ap.add_argument("--slack", default="64MiB", help="cgroup room besides the index's share: "
                    "the record pages in flight")
    ap.add_argument("--ahead", type=int, default=1, help="batches read ahead "
                    "(dsa_core.prefetched)")
    ap.add_argument("--cap-start", default="64G", help="the children's cgroup limit until "
                    "they set their own")
    ap.add_argument("--cap-none", action="store_true", help="no cgroup: the children run "
                    "uncapped (the smoke test; the cache shares are only labels)")
    ap.add_argument("--probe-seconds", type=float, default=10.0)
    ap.add_argument("--build-memory", default="auto", help="memory= of the build (auto: 16 B "
                    "per row + 256 MiB, the index in memory)")
    ap.add_argument("--build-chunk", type=int, default=1_000_000, help="rows per "
                    "write_records call of the build (at most half the region)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="kernel threads (0: dsa_core's "
                    "default)")
    ap.add_argument("--workdir", default=None, help="where the store goes (default: a "
                    "temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the store, and reuse one built "
                    "before with the same rows and dim")
    ap.add_argument("--rebuild", action="store_true", help="build the store even if one is "
                    "there")
    ap.add_argument("--no-drop-caches", action="store_true", help="no drop_caches (the store's "
                    "files are still dropped with fadvise)")
    result_args(ap, "big_ooc_<date>")
    ap.add_argument("--dist", default="uniform", help=argparse.SUPPRESS)
    ap.add_argument("--share", type=float, default=1.0, help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    a = ap.parse_args(raw)
    if child_reply(a, run_case):
        return {}
    from .probes import build_drive_probe, drive_rate

    tmp = None
    if a.workdir is None:
        a.workdir = tmp = tempfile.mkdtemp(prefix="dsa_big_ooc_")
    work = Path(a.workdir).resolve()
    a.workdir = str(work)
    work.mkdir(parents=True, exist_ok=True)
    capped = not a.cap_none and cgroup_ok()
    if not a.cap_none and not capped:
        log("no writable memory cgroup (benchmarks/memcap.sh needs root): the cases run "
            "uncapped, the cache shares are labels only")
    try:
        build = ensure_store(a, work)
        segs, idx_file = store_files(work / "store")
        build["index_file_bytes"] = os.path.getsize(idx_file) if idx_file else 0
        evict(work / "store", not a.no_drop_caches)
        binary, how = build_drive_probe(work)
        probe = {"tool_build": how}
        for qd in (32, 1):
            r = drive_rate(segs, qd, a.probe_seconds, binary)
            probe[f"qd{qd}_reads_per_s"] = r["reads_per_s"]
            probe.update(tool=r["tool"], direct=r["direct"])
            log(f"drive: 4 KiB random reads over the segment files at QD{qd}: "
                f"{r['reads_per_s']:,.0f}/s ({r['tool']}, O_DIRECT {r['direct']})")
        cases = []
        shares = [float(x) for x in a.caches.split(",")]
        for k, (dist, share) in enumerate((d, s) for d in a.dists.split(",") for s in shares):
            dropped = evict(work / "store", not a.no_drop_caches)
            r = run_child(a, dist, share, a.seed + 1 + k, capped)
            r["evicted_before_open"] = dropped
            r["limit_mib"] = r.get("limit", 0) / MIB
            # the page cache room the limit left (the index's share and the slack together:
            # the index's pages may take the slack too), and what the charge that is not page
            # cache grew by during the timed steps (taken from that room)
            r["room_mib"] = (r["limit"] - r["not_file_before"]) / MIB if "limit" in r else 0.0
            r["not_file_growth_mib"] = (r["not_file_after"] - r["not_file_before"]) / MIB \
                if "not_file_after" in r else 0.0
            r["vs_qd32"] = r["rows_per_s"] / probe["qd32_reads_per_s"]
            cases.append(r)
            log(f"{dist} cache {share:g}: {r['rows_per_s']:,.0f} rows/s "
                f"({r['vs_qd32']:.2f} of QD32), {r['read_ios_per_row']:.2f} reads/row, "
                f"{r['kb_read_per_row']:.1f} KB/row, misses/row {r['misses_per_row']:.2f}, "
                f"index page reads/row {r['index_page_reads_per_row']}, limit "
                f"{r['limit_mib']:.0f} MiB, warm-up {r['warmup_steps']} steps")
    finally:
        if not a.keep:
            shutil.rmtree(work / "store", ignore_errors=True)
            (work / MARKER).unlink(missing_ok=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    how = "reused" if build["reused"] else f"built in {build['build_s']:.0f} s"
    print(f"{a.rows:,} x {a.dim} log store, memory={a.memory}, batch {a.batch}: store "
          f"{build['store_disk'] / 1e9:.2f} GB ({how}), index file "
          f"{build['index_file_bytes'] / MIB:.1f} MiB; drive QD32 "
          f"{probe['qd32_reads_per_s']:,.0f} reads/s, QD1 {probe['qd1_reads_per_s']:,.0f} "
          f"({probe['tool']}); slack {a.slack}; "
          + ("capped" if capped else "UNCAPPED (no cgroup: cache shares are labels)"))
    print_table(cases, COLS)
    res = {"build": build, "probe": probe, "capped": capped, "slack": a.slack, "cases": cases}
    if not a.no_save:
        name = a.name or f"big_ooc_{datetime.date.today():%Y-%m-%d}"
        meta = {"machine": machine(), "argv": raw, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                "build": build, "probe": probe, "capped": capped, "slack": a.slack}
        print(f"wrote {write_results(name, cases, meta).with_suffix('.json')}")
    return res


if __name__ == "__main__":
    main()
