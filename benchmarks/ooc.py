"""Out-of-core benchmark: the store is many times larger than the memory the process may use.

    python -m benchmarks.ooc                       # 10M x 128 (15.4 GB), 2 GiB cap, 1000 steps
    python -m benchmarks.ooc --rows 2000000 --cap 512M --steps 300
    python -m benchmarks.ooc --smoke               # seconds; CI runs this so the code never rots

1. Creates (or reuses, ``--keep``) a store whose every page has really been written.
2. Measures the disk once it is quiet (no writeback of an earlier run in progress): 4 KiB
   random reads at queue depth 1 and 32 (fio if installed, else O_DIRECT preads from threads
   in up to 4 processes); with a log mode, QD32 also over the log store's own segment files.
3. For each mode and id distribution, evicts the store from the page cache, waits for the disk
   to be quiet, then runs the training loop in a child process inside a memory cgroup
   (a cgroup v2 ``memory.max``: page cache + anonymous memory capped). Without a
   writable cgroup the store is only evicted (``posix_fadvise(DONTNEED)``) and the run is
   labelled ``cold``. The child counts the disk I/Os of its timed steps (``/proc/diskstats``,
   system-wide): reads and writes per updated row, and the disk I/Os per second they add up
   to. Writes still dirty in the cache when the timed steps end are not counted.
4. Measures the QD32 read rate again after the runs; ``vs_qd32_reads`` is the rows/s over
   the higher of the two QD32 figures (a throttled probe cannot flatter the ratio), and
   ``vs_qd32_own_files`` the same over the higher of the two probes of the log store's files
   (an aged log store's files hold ``space_ratio`` times its live records: its misses spread
   over twice the disk a fresh store's do).

An aged log store (one whose every seal cleans): ``--clean off`` runs the log modes with
cleaning off (the space bound out of reach: the store grows by what the run writes, so run it
after the runs with cleaning, or on a copy), so that the steps' reads with and without
cleaning running can be compared on the same store;
``--clean-read-bytes`` sets the largest cleaning read request (one at a time; default 4 MiB;
it only lowers the store's own, ``budget.cleaning_limits``, which is at most 4 MiB);
``--clean-gap-bytes`` the dead stretch between live records that a cleaning read reads
through rather than skips (default 256 KiB; 0: the live records alone).
Each log run prints the timed steps' misses per second (the steps' record reads), what
cleaning read (MiB/s, requests) and how often and how long seals waited for it.

``--kernel-stacks`` (root only) also samples where the run's threads wait in the kernel
(``/proc/self/task/*/stack`` every 0.2 s) and prints the most frequent top frames: a disk-bound
run shows reads in flight (``filemap_read_folio``) and a full device queue (``blk_mq_get_tag``).

Modes: ``plain`` (mapping with the OS default read-around), ``random`` (``MADV_RANDOM``, the
dsa_core default), ``prefetch`` (``MADV_RANDOM`` + ``dsa_core.prefetch`` of the next batch while
this step runs), ``log`` and ``logprefetch`` (the log-structured store, ``storage="log"``,
converted from the in-place store once, with a region of ``--log-memory``; without and with
``dsa_core.prefetch`` of the batches ahead), ``pipeline`` (read-ahead plus write-back hints, ``sync_file_range``, for
each finished batch; an experiment that measured slower, kept to show it), ``logprobe`` (an
experiment, not a design: the ceiling of a log-structured write path -- see ``LogProbe``).
Hit rate = share of the batch's pages that were resident before its read-ahead was issued
(mincore), i.e. what the page cache alone gave; on a log store, the share of the batch's rows
in its region. ``with_flush`` figures count the final ``close`` (flush) in the time and the
I/Os: the in-place store's dirty pages, the log store's region sealed out.
Writes ``benchmarks/results/ooc.{json,csv,png}``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ._common import (
    batches,
    disk_ios,
    disk_stat_file,
    machine,
    print_table,
    wait_disk_quiet,
    write_results,
)

MEMCAP_CANDIDATES = [Path(__file__).resolve().parent / "memcap.sh"]  # the repo's own cgroup cap


# -- the store ---------------------------------------------------------------------------------
def ensure_store(path: Path, rows: int, dim: int, keep: bool, align: int = 0,
                 second_moment: str = "elementwise", first_moment: str = "full"):
    import dsa_core

    if keep and (path / "manifest.json").exists():
        st = dsa_core.open(path, mode="r")
        if st.num_rows == rows and st.dim == dim and st.layout["align"] == align \
                and st.second_moment == second_moment and st.first_moment == first_moment:
            dsa_core.close(st)
            print(f"reusing store {path}")
            return
        dsa_core.close(st)
    t0 = time.perf_counter()
    st = dsa_core.create(path, rows, dim, init="uniform", init_scale=1e-3, lr=1e-3,
                         align=align, overwrite=True, progress=True, storage="inplace",
                         second_moment=second_moment, first_moment=first_moment)
    dsa_core.close(st)  # msync: every page written to disk, no sparse holes
    dt = time.perf_counter() - t0
    gb = st.store.info.nbytes / 1e9
    print(f"created {path}: {gb:.1f} GB in {dt:.0f} s ({gb / dt:.2f} GB/s)")


def ensure_log_store(src: Path, path: Path, keep: bool) -> None:
    """A log store holding every record of the in-place store ``src`` (each row written)."""
    import dsa_core

    if keep and (path / "manifest.json").exists():
        st = dsa_core.open(path, mode="r")
        same = st.num_rows == dsa_core.open(src, mode="r").num_rows
        dsa_core.close(st)
        if same:
            print(f"reusing log store {path}")
            return
    t0 = time.perf_counter()
    s = dsa_core.open(src, mode="r")
    dsa_core.close(dsa_core.convert(s, path, storage="log", memory="1GiB", overwrite=True))
    dsa_core.close(s)
    print(f"converted to a log store {path} in {time.perf_counter() - t0:.0f} s")


def evict(path: Path) -> None:
    """Write back and drop from the page cache every file of a store (either kind)."""
    for name in os.listdir(path):
        if not (name == "rows.dsa" or name.startswith(("seg-", "index-"))):
            continue
        fd = os.open(path / name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rss_anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# -- the disk ----------------------------------------------------------------------------------
FIO_MAX_VALUE = 4096  # fio refuses an option value longer ("value exceeds max length")


def fio_filenames(files: list[Path]) -> tuple[str | None, int]:
    """``--filename``'s value for ``files`` and the step ``k`` it takes them by: all of them
    (``k == 1``), or, where their list would be longer than fio takes, every k-th (the first
    and the spread kept: the reads still land over the whole of the store's files); ``(None,
    0)`` where even one name is too long."""
    names = [str(f) for f in files]
    for k in range(1, len(names) + 1):
        value = ":".join(names[::k])
        if len(value) <= FIO_MAX_VALUE:
            return value, k
    return None, 0  # a single name longer than that: no fio probe


def disk_fio(file: Path | list[Path], qd: int, seconds: float) -> float | None:
    if not shutil.which("fio"):
        return None
    files, k = fio_filenames(file) if isinstance(file, list) else (str(file), 1)
    if files is None:
        print(f"fio cannot name these files in {FIO_MAX_VALUE} characters; using pread")
        return None
    if k > 1:
        print(f"fio reads one file in {k} of the {len(file)} (its --filename takes "
              f"{FIO_MAX_VALUE} characters)")
    cmd = ["fio", "--name=r", f"--filename={files}", "--rw=randread", "--bs=4k", "--direct=1",
           "--ioengine=libaio", f"--iodepth={qd}", f"--runtime={max(1, round(seconds * 1000))}ms", "--time_based",
           "--readonly", "--output-format=json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60)
        return float(json.loads(out.stdout)["jobs"][0]["read"]["iops"])
    except subprocess.CalledProcessError as exc:
        print(f"fio failed (exit {exc.returncode}: {exc.stderr.strip()[-300:]}); falling back "
              "to pread")
        return None
    except (subprocess.SubprocessError, KeyError, ValueError) as exc:
        print(f"fio failed ({str(exc)[-300:]}); falling back to pread")
        return None


_PREAD_WORKER = r"""
import bisect, itertools, mmap, os, random, sys, threading, time
files, pages, threads, start, seconds, seed = (sys.argv[1].split("\n"),
    [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), float(sys.argv[4]),
    float(sys.argv[5]), int(sys.argv[6]))
ends = list(itertools.accumulate(pages))
tot = ends[-1]
counts = [0] * threads

def worker(k):
    fds = [os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0)) for f in files]
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    rng = random.Random(seed * 1000 + k)
    todo = []
    for _ in range(1 << 14):
        p = rng.randrange(tot)
        j = bisect.bisect_right(ends, p)
        todo.append((fds[j], (p - (ends[j] - pages[j])) * 4096))
    while time.time() < start:
        time.sleep(0.001)
    stop, i = start + seconds, 0
    while time.time() < stop:
        fd, off = todo[i & 0x3FFF]
        os.preadv(fd, [buf], off)
        i += 1
    counts[k] = i

th = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
for t in th:
    t.start()
for t in th:
    t.join()
print(sum(counts))
"""


def disk_pread(file: Path | list[Path], qd: int, seconds: float) -> float:
    """4 KiB O_DIRECT random preads at queue depth ``qd``: ``qd`` threads spread over up to 4
    processes (threads of one process contend for its interpreter lock and drew about half
    the disk's rate on 2 cores), all counting over the same ``seconds``.

    Over one file, or over several (a log store's segment files): every page of them
    equally likely, so the reads spread over the disk as a uniform step's misses do.
    """
    files = [str(f) for f in (file if isinstance(file, list) else [file])]
    pages = [os.path.getsize(f) // 4096 for f in files]
    procs = min(4, qd)
    start = time.time() + 1.0  # after every worker has started
    workers = [subprocess.Popen(
        [sys.executable, "-c", _PREAD_WORKER, "\n".join(files), ",".join(map(str, pages)),
         str(qd // procs + (k < qd % procs)), repr(start), repr(seconds), str(k)],
        stdout=subprocess.PIPE, text=True) for k in range(procs)]
    total = sum(int(w.communicate(timeout=seconds + 60)[0]) for w in workers)
    return total / seconds


def measure_disk(file: Path | list[Path], seconds: float, qds=(1, 32), what: str = "") -> dict:
    out = {}
    for qd in qds:
        iops = disk_fio(file, qd, seconds)
        tool = "fio"
        if iops is None:
            iops, tool = disk_pread(file, qd, seconds), "pread"
        out[f"qd{qd}_iops"] = iops
        out["disk_tool"] = tool
        print(f"disk: 4 KiB random read QD{qd}{what}: {iops:,.0f} IOPS ({tool})", flush=True)
    return out


def log_files(path: Path) -> list[Path]:
    """The files a log store's reads land in: the segment files its manifest lists."""
    from dsa_core._log.format import read_manifest, seg_name

    return [path / seg_name(int(s)) for s in read_manifest(path)["segments"]]


# -- one run (child process) ---------------------------------------------------------------------
def read_ahead(mode: str, ahead: int) -> int:
    """Batches read ahead in ``mode``: none for the bare mappings, ``--ahead`` otherwise."""
    return 0 if mode in ("plain", "random", "log") else ahead


class StackSampler:
    """Where this process's threads wait in the kernel: ``/proc/self/task/*/stack`` every
    ``period`` s (root only; otherwise it samples nothing).

    Counts, per thread name, the top four kernel frames of each thread per sample
    (``name: inner<caller<...``), or ``(user space)`` for a thread outside the kernel, leaving out threads idle in a futex
    (pool workers between jobs) and the sampler itself.
    """

    def __init__(self, period: float = 0.2):
        self.period, self.counts, self.samples = period, {}, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        top = sorted(self.counts.items(), key=lambda kv: -kv[1])
        return {"samples": self.samples, "top": top[:16]}

    def _run(self):
        me = threading.get_native_id()
        while not self._stop.wait(self.period):
            self.samples += 1
            threads = {t.native_id: t for t in threading.enumerate()}
            names = {n: t.name for n, t in threads.items()}
            frames = sys._current_frames()
            for task in Path("/proc/self/task").iterdir():
                if int(task.name) == me:
                    continue
                try:
                    lines = (task / "stack").read_text().split("\n")
                except OSError:
                    return  # not root: nothing to sample
                fns = [ln.split()[1].split("+")[0] for ln in lines if len(ln.split()) > 1]
                if fns and fns[0].startswith("futex"):
                    continue
                who = names.get(int(task.name), "other")
                key = who + ": " + ("<".join(fns[:4]) if fns else "(user space)")
                t = threads.get(int(task.name))
                f = frames.get(t.ident) if t is not None else None
                where = []
                while f is not None and len(where) < 3:  # the innermost dsa_core frames
                    if "dsa_core" in f.f_code.co_filename:
                        where.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno}")
                    f = f.f_back
                if where:
                    key += " @ " + " < ".join(where)
                self.counts[key] = self.counts.get(key, 0) + 1


class LogProbe:
    """What a log-structured write path could reach out of core: an upper bound, measured.

    Each step reads the batch's records through the store's mapping (opened read-only, so
    the store is never modified), applies a stand-in update to the copy, and appends the
    updated records to a circular 4 GiB log file next to the store: one sequential write per
    step, started with ``sync_file_range`` and its pages dropped from the cache two steps
    later. Nothing is written in place. Left out, so the figure is a ceiling: the row ->
    log-position index, reading rows from the log, cleaning the log, crash consistency.
    """

    LOG_BYTES = 4 << 30
    WAIT_BEFORE, WAIT_AFTER = 1, 4  # SYNC_FILE_RANGE_WAIT_BEFORE / _WAIT_AFTER

    def __init__(self, st, path: Path):
        from dsa_core import _os

        self.st, self.pf, self.path = st, _os, path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.pos, self.inflight = 0, []

    def step(self, idx, g):
        u = np.unique(idx)
        rec = self.st.store.data[u]  # the random reads (prefetched like the real step)
        d = self.st.dim
        rec[:, :d] -= np.float32(1e-3) * g[: len(u)]  # stand-in for the Adam update
        buf = rec.view(np.uint8).reshape(-1)
        if self.pos + buf.size > self.LOG_BYTES:
            self.pos = 0
        os.pwrite(self.fd, buf, self.pos)
        write = self.pf.SYNC_FILE_RANGE_WRITE
        self.pf.sync_file_range(self.fd, self.pos, buf.size, write)
        self.inflight.append((self.pos, buf.size))
        if len(self.inflight) > 2:  # written by now (or waited for): leave the cache
            p0, n0 = self.inflight.pop(0)
            self.pf.sync_file_range(self.fd, p0, n0,
                                     self.WAIT_BEFORE | write | self.WAIT_AFTER)
            os.posix_fadvise(self.fd, p0, n0, os.POSIX_FADV_DONTNEED)
        self.pos += buf.size

    def close(self):
        os.close(self.fd)
        self.path.unlink(missing_ok=True)


def child(args) -> None:
    import dsa_core
    from dsa_core._inplace import readahead as _prefetch

    probe = None
    if args.mode == "logprobe":
        st = dsa_core.open(args.store, mode="r")  # never written: the log takes the updates
        probe = LogProbe(st, Path(args.store).parent / f"logprobe_{os.getpid()}.log")
    elif args.mode in ("log", "logprefetch"):
        st = dsa_core.open(args.store, memory=args.log_memory)
        tune_cleaning(st, args)
    else:
        st = dsa_core.open(args.store)
    if args.mode == "plain":
        st.store._mm.madvise(mmap.MADV_NORMAL)  # the OS default: read-around on every fault
    ids = batches(st.num_rows, args.batch, args.steps + args.warmup, args.dist, seed=args.seed)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal((args.batch, st.dim), dtype=np.float32) for _ in range(4)]
    dsa_core.warmup(("float32",))
    times, hits, all_times, rss = [], [], [], [rss_anon_mb()]
    # a log store's seal counter (a step that sealed: its seal and its cleaning were on it)
    seals = (lambda: st.store._stats["seals"]) if st.storage == "log" else (lambda: 0)
    sealed = []
    # the store's disk, per timed step: reads, KiB read, ms reading, MiB written
    stat = disk_stat_file(args.store)
    per_step = []

    def counters():
        if stat is None:
            return None
        x = stat.read_text().split()
        return np.array([int(x[0]), int(x[2]) // 2, int(x[3]), int(x[6])], np.int64)
    deadline = time.perf_counter() + args.max_seconds
    ahead = read_ahead(args.mode, args.ahead)
    write_behind = args.mode == "pipeline"
    for j in range(min(ahead, len(ids))):
        dsa_core.prefetch(st, ids[j])
    t_start, io0, sampler, ls0 = None, (0, 0), None, None
    for k in range(len(ids)):
        if k == args.warmup:
            t_start, io0 = time.perf_counter(), disk_ios()
            ls0 = st.store.log_stats() if st.storage == "log" else None
            if args.kernel_stacks:
                sampler = StackSampler().start()
        j = k + ahead
        if j < len(ids) and k % args.hit_every == 0:
            # what the page cache alone holds of that batch, before its read-ahead
            hits.append(dsa_core.residency(st, ids[j]))
        if ahead and j < len(ids):
            dsa_core.prefetch(st, ids[j])
        n_seals = seals()
        c0 = counters() if k >= args.warmup else None
        t0 = time.perf_counter()
        if probe is not None:
            probe.step(ids[k], grads[k % 4])
        else:
            st = dsa_core.step(st, ids[k], grads[k % 4])
        dt = time.perf_counter() - t0
        if write_behind:
            _prefetch.writeback(st, ids[k])
        all_times.append(dt)
        if k >= args.warmup:
            times.append(dt)
            sealed.append(seals() != n_seals)
            if c0 is not None:
                per_step.append(counters() - c0)
        if k % args.hit_every == 0:
            rss.append(rss_anon_mb())
        if time.perf_counter() > deadline:
            break
    wall = time.perf_counter() - (t_start or time.perf_counter())
    io1 = disk_ios()
    stacks = sampler.stop() if sampler is not None else None
    if probe is not None:
        probe.close()
    log_stats = st.store.log_stats() if st.storage == "log" else None
    # the timed steps' own figures: misses (the steps' random reads of records), cleaning
    if log_stats is not None and ls0 is not None and wall > 0:
        log_stats["timed"] = {
            "misses_per_s": (log_stats["misses"] - ls0["misses"]) / wall,
            "clean_read_mb_per_s": (log_stats["clean_read_bytes"] - ls0["clean_read_bytes"])
            / wall / 2**20,
            "clean_read_requests": log_stats["clean_read_requests"]
            - ls0["clean_read_requests"],
            "clean_read_s": log_stats["clean_read_s"] - ls0["clean_read_s"],
            "clean_rest_s": log_stats["clean_rest_s"] - ls0["clean_rest_s"],
            "clean_waits": log_stats["clean_waits"] - ls0["clean_waits"],
            "clean_wait_s": log_stats["clean_wait_s"] - ls0["clean_wait_s"],
            "cleaned_segments": log_stats["cleaned_segments"] - ls0["cleaned_segments"],
            "seals": log_stats["seals"] - ls0["seals"]}
    t_close = time.perf_counter()
    dsa_core.close(st)  # the final flush: the in-place store's dirty pages, the log's region
    wall_flush = wall + time.perf_counter() - t_close
    io2 = disk_ios()
    warm_only = not times  # too slow to finish the warm-up in time: report what it did
    if warm_only:
        times, wall = all_times, float(np.sum(all_times))
    ts = np.asarray(times) if times else np.asarray([np.nan])
    # one entry per timed step (none counted when only the warm-up ran)
    sl = np.zeros(ts.shape[0], bool) if warm_only or not times else np.asarray(sealed, bool)
    print(json.dumps({
        "steps": len(times), "warmup_only": warm_only,
        "rows_per_s": len(times) * args.batch / wall if times else 0.0,
        "p50_ms": float(np.median(ts)) * 1e3, "p99_ms": float(np.percentile(ts, 99)) * 1e3,
        "mean_ms": float(np.mean(ts)) * 1e3, "p90_ms": float(np.percentile(ts, 90)) * 1e3,
        # the steps that sealed (log stores: a seal, and cleaning when the store is at its
        # bound, ran inside them) against the others: where an aged store's time goes
        "seal_steps": int(sl.sum()),
        "seal_step_mean_ms": float(np.mean(ts[sl])) * 1e3 if sl.any() else float("nan"),
        "other_step_mean_ms": float(np.mean(ts[~sl])) * 1e3 if (~sl).any() else float("nan"),
        "seal_steps_share_of_time": float(ts[sl].sum() / ts.sum()) if sl.any() else 0.0,
        **disk_by_step(per_step, sl),
        "hit_rate": float(np.mean(hits)) if hits else float("nan"),
        "hit_rate_final": float(np.mean(hits[len(hits) // 2:])) if hits else float("nan"),
        "timed_out": bool(time.perf_counter() > deadline),
        # disk I/Os completed during the timed steps, per updated row (batch rows)
        "reads_per_row": (io1[0] - io0[0]) / (len(times) * args.batch) if times else 0.0,
        "writes_per_row": (io1[1] - io0[1]) / (len(times) * args.batch) if times else 0.0,
        # the same with the final flush (close) counted in time and I/Os
        "rows_per_s_with_flush": len(times) * args.batch / wall_flush if times else 0.0,
        "flush_s": wall_flush - wall,
        "reads_per_row_with_flush": (io2[0] - io0[0]) / (len(times) * args.batch)
        if times else 0.0,
        "writes_per_row_with_flush": (io2[1] - io0[1]) / (len(times) * args.batch)
        if times else 0.0,
        "rss_anon_max_mb": float(np.nanmax(rss)),
        # part of that RssAnon: this script's list of every batch's ids (not the store's)
        "batch_ids_mb": sum(b.nbytes for b in ids) / 2**20,
        "log_stats": log_stats,
        "kernel_stacks": stacks,
    }))


def disk_by_step(per_step: list, sealed: np.ndarray) -> dict:
    """The disk's counters (the whole device's) per timed step, in the steps that sealed
    and in the others: read I/Os and KiB per step, the mean time a read took (ms spent
    reading over reads completed: its wait in the queue included), MiB written per step."""
    if not per_step or len(per_step) != sealed.shape[0]:
        return {}
    c = np.asarray(per_step, np.float64)
    out = {}
    for name, m in (("seal", sealed), ("other", ~sealed)):
        if not m.any():
            continue
        x = c[m]
        out[f"{name}_step_reads"] = float(x[:, 0].mean())
        out[f"{name}_step_read_kib"] = float(x[:, 1].mean())
        out[f"{name}_step_read_ms"] = float(x[:, 2].sum() / max(1.0, x[:, 0].sum()))
        out[f"{name}_step_write_mib"] = float(x[:, 3].mean() * 512 / 2**20)
    return out


def tune_cleaning(st, args) -> None:
    """The log store's cleaning for this run (``--clean``, ``--clean-read-bytes``,
    ``--clean-gap-bytes``, ``--clean-duty``): the steps' reads with and without cleaning
    running, and with other cleaning request sizes, gaps and pacing."""
    from dsa_core._log import read as _log_read

    if args.clean_read_bytes:  # read by the cleaning reads when they start (first clean)
        _log_read.CLEAN_READ_BYTES = int(args.clean_read_bytes)
    if args.clean_gap_bytes >= 0:  # idem: dead bytes read through between live records
        _log_read.CLEAN_GAP_BYTES = int(args.clean_gap_bytes)
    if args.clean_duty > 0:  # the share of the time the cleaning reads may hold the disk
        _log_read.CLEAN_DUTY = float(args.clean_duty)
    if args.clean == "off":  # the bound out of reach: no seal cleans, nothing is read
        st.store._cleaner.space_ratio = 1e9


def find_memcap() -> Path | None:
    for p in MEMCAP_CANDIDATES:
        if p.is_file():
            return p
    return None


def cgroup_ok(memcap: Path | None) -> bool:
    if memcap is None:
        return False
    r = subprocess.run(["bash", str(memcap), "64M", "true"], check=False, capture_output=True)
    return r.returncode == 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--cap", default="2G")
    ap.add_argument("--dist", nargs="+", default=["uniform", "zipf"])
    ap.add_argument("--modes", nargs="+", default=["plain", "random", "prefetch"],
                    choices=["plain", "random", "prefetch", "log", "logprefetch", "pipeline",
                             "logprobe"])
    ap.add_argument("--log-memory", default="1GiB",
                    help="region budget of the log store (modes log, logprefetch)")
    ap.add_argument("--ahead", type=int, default=2, help="read-ahead depth (prefetch/pipeline)")
    ap.add_argument("--align", type=int, default=0,
                    help="record alignment in bytes (dsa_core.create(align=...)); 0 packs")
    ap.add_argument("--second-moment", choices=("elementwise", "rowwise"),
                    default="elementwise",
                    help="rowwise: one v per row (docs/algorithms.md §7.3), 1,028-byte "
                         "records at dim 128")
    ap.add_argument("--first-moment", choices=("full", "bfloat16"), default="full",
                    help="bfloat16: m stored as bfloat16 (docs/algorithms.md §6)")
    ap.add_argument("--clean", choices=("on", "off"), default="on",
                    help="log store: off runs with cleaning off (the store grows by what the "
                         "run writes, past its space bound: the next run with cleaning waits "
                         "in its first seals until the store is back within it; run it last "
                         "or on a copy), to compare the steps' reads with and without it")
    ap.add_argument("--clean-read-bytes", type=int, default=0,
                    help="log store: the largest cleaning read request (default: the "
                         "engine's, at most 4 MiB, which this can only lower; one request "
                         "at a time)")
    ap.add_argument("--clean-gap-bytes", type=int, default=-1,
                    help="log store: dead bytes between two live records that a cleaning "
                         "read reads through rather than skips (default: the engine's, "
                         "256 KiB; 0 reads the live records alone)")
    ap.add_argument("--clean-duty", type=float, default=0.0,
                    help="log modes: the share of the time the cleaning reads may hold the "
                         "disk (1: unpaced; default: the store's, read.CLEAN_DUTY)")
    ap.add_argument("--max-seconds", type=float, default=240.0,
                    help="stop a run after this long (the plain mode needs hours otherwise)")
    ap.add_argument("--disk-seconds", type=float, default=10.0)
    ap.add_argument("--quiet-seconds", type=float, default=120.0,
                    help="longest wait for the disk to go quiet before a probe or a run")
    ap.add_argument("--hit-every", type=int, default=10)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="reuse an existing store of that shape")
    ap.add_argument("--kernel-stacks", action="store_true",
                    help="sample where the run's threads wait in the kernel (root only)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="ooc")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=7, help=argparse.SUPPRESS)
    ap.add_argument("--seed-base", type=int, default=None,
                    help="ids of run k are drawn with seed SEED_BASE + k (default: random, "
                         "recorded in the results)")
    a = ap.parse_args(argv)
    if a.seed_base is None:
        a.seed_base = int.from_bytes(os.urandom(3), "little")
    if a.child:
        a.dist = a.dist[0]
        return child(a)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.warmup = 20_000, 16, 64, 20, 2
        a.cap, a.disk_seconds, a.max_seconds, a.name = "256M", 0.2, 20, "ooc_smoke"
        a.quiet_seconds = 0.0  # the smoke run checks the code, not the figures
        a.log_memory = "2MiB"  # a region of a tenth of the table
    workdir = Path(a.workdir or tempfile.gettempdir())
    store = workdir / (f"dsa_ooc_{a.rows}x{a.dim}" + (f"_a{a.align}" if a.align else "")
                       + ("_rowwise" if a.second_moment == "rowwise" else "")
                       + ("_bf16m" if a.first_moment == "bfloat16" else ""))
    ensure_store(store, a.rows, a.dim, a.keep, a.align, a.second_moment, a.first_moment)
    log_store = store.with_name(store.name + "_log")
    if any(m in ("log", "logprefetch") for m in a.modes):
        ensure_log_store(store, log_store, a.keep)
    waited = wait_disk_quiet(a.quiet_seconds)
    print(f"disk quiet after {waited:.0f} s")
    disk = measure_disk(store / "rows.dsa", a.disk_seconds)
    logs = any(m.startswith("log") for m in a.modes)
    if logs:  # the same reads over the log store's own files, where its misses land
        disk["log_files_qd32_iops"] = measure_disk(
            log_files(log_store), a.disk_seconds, qds=(32,),
            what=" over the log store's segment files")["qd32_iops"]
    memcap = find_memcap()
    capped = cgroup_ok(memcap)
    label = f"cap {a.cap}" if capped else "cold (evicted, no cgroup)"
    size_gb = os.path.getsize(store / "rows.dsa") / 1e9
    print(f"store {size_gb:.1f} GB, {label}")
    results = []
    for run, (dist, mode) in enumerate((d, m) for d in a.dist for m in a.modes):
        path = log_store if mode in ("log", "logprefetch") else store
        evict(path)
        wait_disk_quiet(a.quiet_seconds)
        cmd = [sys.executable, "-m", "benchmarks.ooc", "--child", "--store", str(path),
               "--mode", mode, "--dist", dist, "--steps", str(a.steps), "--warmup",
               str(a.warmup), "--batch", str(a.batch), "--max-seconds", str(a.max_seconds),
               "--hit-every", str(a.hit_every), "--ahead", str(a.ahead),
               "--log-memory", str(a.log_memory), "--clean", a.clean,
               "--clean-read-bytes", str(a.clean_read_bytes),
               "--clean-gap-bytes", str(a.clean_gap_bytes),
               "--clean-duty", str(a.clean_duty),
               # fresh ids for every run, also across invocations (--keep reuses the stores):
               # a log store lays records out in the order they leave its region, so
               # replaying an earlier run's batches would read them sequentially and flatter it
               "--seed", str(a.seed_base + run)]
        if a.kernel_stacks:
            cmd.append("--kernel-stacks")
        if capped:
            cmd = ["bash", str(memcap), a.cap, *cmd]
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            print(r.stdout, r.stderr)
            raise SystemExit(f"child failed for {mode}/{dist}")
        res = json.loads(r.stdout.strip().splitlines()[-1])
        peak = [ln for ln in r.stderr.splitlines() if ln.startswith("memcap:")]
        res.update({"rows": a.rows, "dist": dist, "mode": mode, "memory": label,
                    "align": a.align, "second_moment": a.second_moment,
                    "first_moment": a.first_moment,
                    "ahead": read_ahead(mode, a.ahead),
                    "log_memory": a.log_memory if mode.startswith("log") else "",
                    "clean": a.clean if mode.startswith("log") else "",
                    "clean_duty": a.clean_duty if mode.startswith("log") else "",
                    "memcap": peak[-1] if peak else ""})
        results.append(res)
        print(f"  {dist:<7} {mode:<8} {res['rows_per_s']:>10,.0f} rows/s  p50 "
              f"{res['p50_ms']:7.1f} ms  p99 {res['p99_ms']:7.1f} ms  hit "
              f"{res['hit_rate']:.3f}  steps {res['steps']}  I/O per row "
              f"{res['reads_per_row']:.2f} r + {res['writes_per_row']:.2f} w; with the "
              f"final flush ({res['flush_s']:.1f} s) {res['rows_per_s_with_flush']:,.0f} "
              f"rows/s, {res['reads_per_row_with_flush']:.2f} r + "
              f"{res['writes_per_row_with_flush']:.3f} w; RssAnon max "
              f"{res['rss_anon_max_mb']:.0f} MiB (the batch ids "
              f"{res['batch_ids_mb']:.0f} MiB of it)", flush=True)
        if res["seal_steps"]:
            print(f"    {res['seal_steps']} steps sealed: {res['seal_step_mean_ms']:.1f} ms "
                  f"each on average, the others {res['other_step_mean_ms']:.1f} ms; "
                  f"{res['seal_steps_share_of_time']:.0%} of the time", flush=True)
            if "seal_step_reads" in res and "other_step_reads" in res:
                print("    the disk per step, sealed / other: "
                      f"{res['seal_step_reads']:,.0f} / {res['other_step_reads']:,.0f} reads, "
                      f"{res['seal_step_read_kib'] / 1024:.1f} / "
                      f"{res['other_step_read_kib'] / 1024:.1f} MiB read, "
                      f"{res['seal_step_read_ms']:.2f} / {res['other_step_read_ms']:.2f} ms a "
                      f"read, {res['seal_step_write_mib']:.1f} / "
                      f"{res['other_step_write_mib']:.1f} MiB written", flush=True)
        if res.get("log_stats"):
            ls = res["log_stats"]
            print(f"    log: write amplification {ls['write_amplification']:.2f}, "
                  f"{ls['seals']} seals, {ls['cleaned_segments']} segments cleaned, "
                  f"space used {ls['space_used']:.2f}x live (bound "
                  f"{ls['space_bound_records'] / max(ls['live_records'], 1):.2f}x)",
                  flush=True)
            tm = ls.get("timed")
            if tm:
                print(f"    timed steps: {tm['misses_per_s']:,.0f} misses/s (the steps' "
                      f"record reads), cleaning {tm['cleaned_segments']} segments in "
                      f"{tm['seals']} seals, read {tm['clean_read_mb_per_s']:.1f} MiB/s in "
                      f"{tm['clean_read_requests']} requests taking {tm['clean_read_s']:.1f} s "
                      f"(resting {tm['clean_rest_s']:.1f} s); seals waited for cleaning "
                      f"{tm['clean_waits']} times, {tm['clean_wait_s']:.2f} s", flush=True)
        if res.get("kernel_stacks"):
            ks = res["kernel_stacks"]
            print(f"    where the threads were ({ks['samples']} samples; idle threads left out):")
            for fn, c in ks["top"][:8]:
                print(f"      {c:5d}  {fn}")
    wait_disk_quiet(a.quiet_seconds)
    after = measure_disk(store / "rows.dsa", a.disk_seconds, qds=(32,))
    disk["qd32_iops_after"] = after["qd32_iops"]
    qd32 = max(disk["qd32_iops"], disk["qd32_iops_after"])
    if logs:
        disk["log_files_qd32_iops_after"] = measure_disk(
            log_files(log_store), a.disk_seconds, qds=(32,),
            what=" over the log store's segment files")["qd32_iops"]
        own = max(disk["log_files_qd32_iops"], disk["log_files_qd32_iops_after"])
    for res in results:
        res["vs_qd32_reads"] = res["rows_per_s"] / qd32
        # a log store's rate against the disk's rate over its own files (an aged store's
        # files take space_ratio x the live records, spread wider over the disk)
        res["vs_qd32_own_files"] = res["rows_per_s"] / own if res["mode"].startswith("log") \
            else float("nan")
        res["vs_qd32_reads_with_flush"] = res["rows_per_s_with_flush"] / qd32
        # the disk I/Os per second the run caused, reads and writes together
        res["disk_ios_per_s"] = res["rows_per_s"] * (res["reads_per_row"] + res["writes_per_row"])
    print()
    print_table(results, ["rows", "dist", "mode", "clean", "second_moment", "first_moment",
                          "align", "ahead", "rows_per_s", "vs_qd32_reads", "vs_qd32_own_files",
                          "reads_per_row",
                          "writes_per_row", "rows_per_s_with_flush", "vs_qd32_reads_with_flush",
                          "writes_per_row_with_flush", "rss_anon_max_mb", "disk_ios_per_s",
                          "p50_ms", "p99_ms", "hit_rate", "steps", "memory"])
    meta = {"machine": machine(), "args": vars(a), "disk": disk, "store_gb": size_gb,
            "memory": label}

    def plot(plt, rows):
        fig, ax = plt.subplots(figsize=(7, 4))
        labels = [f"{r['dist']}\n{r['mode']}" for r in rows]
        ax.bar(range(len(rows)), [r["rows_per_s"] for r in rows])
        ax.axhline(qd32, color="k", ls="--", lw=1, label="disk QD32 4K reads/s")
        ax.axhline(0.8 * qd32, color="tab:red", ls="--", lw=1, label="target: 80% of QD32")
        ax.axhline(disk["qd1_iops"], color="gray", ls=":", lw=1, label="disk QD1 4K reads/s")
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("rows / s")
        ax.set_title(f"Out of core: {a.rows / 1e6:g}M x {a.dim} ({size_gb:.1f} GB), {label}")
        ax.legend(fontsize=8)
        return fig

    base = write_results(a.name, results, meta, plot)
    print(f"wrote {base}.json/.csv/.png")
    if not a.keep:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(log_store, ignore_errors=True)


if __name__ == "__main__":
    main()
