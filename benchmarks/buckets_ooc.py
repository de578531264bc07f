"""Out-of-core speed of partition-ordered (bucket) training against random-order training.

    python -m benchmarks.buckets_ooc                  # 10M x 128 (15.4 GB), 100M edges, 2 GiB cap
    python -m benchmarks.buckets_ooc --nodes 8000000 --edges 80000000   # issue 27's run
    python -m benchmarks.buckets_ooc --nodes 1000000 --dim 64 --edges 10000000 --cap 256M \\
        --random-seconds 30 --bucket-fraction 0.1
    python -m benchmarks.buckets_ooc --smoke          # seconds; CI runs it so the code never rots
    python -m benchmarks.buckets_ooc --smoke --storage log   # the same on a log store
    python -m benchmarks.buckets_ooc --optimizer rowwise_adagrad ...  # issue 43: vs Adam

One model, two orders of the same edges, on one store many times larger than the memory the
training process may use, with the defaults a user gets: the store ``dsa_core.create`` makes
with ``storage="auto"`` (a log store at these sizes; ``--storage`` forces a kind), and P and c
from ``dsa_core.buckets.fit``:

- The model: one embedding table (weights, m and v in a ``dsa_core`` store), skip-gram
  logistic loss on each edge (source, destination) with ``k`` negatives per edge,
  ``-log s(u.v) - sum log s(-u.n)``, computed in numpy on rows from ``dsa_core.gather`` and
  stepped with ``dsa_core.step`` (one step per batch; duplicate ids summed by the core).
- Random order: the edges in a random permutation (chunks of 1M edges in random order, each
  chunk shuffled), negatives uniform over all nodes, ``dsa_core.prefetched`` read-ahead two
  batches in front -- the in-place store's best random path.
- Bucket order: ``dsa_core.buckets.plan(...).batches(batch, negatives=k, stores=[state])``:
  P partitions, a buffer of c; entering partitions are read sequentially (ahead of use),
  leaving ones written back sequentially; negatives drawn from the resident partitions.
- In RAM: the bucket order's loop on the same store opened with everything in memory (a log
  store's region holding every row, an in-place store with ``access="ram"``), the whole table
  loaded before the clock starts, no memory cap: what out of core is compared with.

Steps of the run:

1. Checks the free disk space, creates the store (every row written once: an in-place store's
   pages, a log store's records sealed in row order, as after an epoch) and the edges (uniform
   random (source, destination) pairs, an int32 memmap in the scratch directory). A store
   with a memory region of its own (a log store) is opened by both training phases with the
   ``memory=`` the bucket order's iterator needs (``c + 1`` partitions and two negatives'
   pools beside a batch's rows: what its error message asks a user to set); the same for
   both orders.
2. Buckets the edges (``buckets.plan(..., out=scratch)``) in a child process under the memory
   cap, timed on its own, before any timed phase.
3. Measures the disk once it is quiet: sequential reads (1 MiB, ``O_DIRECT``) and 4 KiB random
   reads at queue depth 32, each for ``--disk-seconds`` (fio if installed, else ``pread``).
4. Bucket order over the first ``--bucket-fraction`` of the epoch's buckets (initial loads
   included; first, on the table as written: each partition's rows together, as after an
   epoch of bucket order, since random order scatters the rows it evicts over new segments),
   then random order for ``--random-seconds``, then (unless ``--no-ram`` or the machine
   lacks the memory) the same buckets in RAM, each in its own child, the first two inside a
   memory cgroup (``memcap``; without one the files are only evicted from the page cache and
   the runs are labelled ``cold``), on the same store, the store and edge files evicted and
   the disk quiet before each. Each phase ends with ``dsa_core.flush`` (and, for
   the bucket order, ``it.close()``, which writes the partitions still held back as an
   epoch's end does, and ``dsa_core.wait_ranges``) inside its timed window.
5. Measures the QD32 random-read rate again.

Per phase: edges/s, row updates/s (ids passed to ``step`` per second, duplicates included:
``2 + k`` per edge), steps, partition loads, disk reads and writes (bytes and I/Os, from
``/proc/diskstats``, whole disks, system-wide; also per edge), the child's major page faults
(``getrusage``) and the peak memory of the cgroup; the ratios bucket / random and bucket /
in RAM of the edge rates; and the time a full epoch would take in each order,
**extrapolated** from the phase's edge rate, and the cgroup's peak anonymous memory, page
cache, dirty and writeback pages with its file refaults and major faults (sampled every
0.25 s: refaults mean the working set did not fit). Partition choice:
``dsa_core.buckets.fit([(nodes, record_bytes)], memory=cap, reserve=--reserve,
num_edges=edges)`` (its largest c up to ``--max-buffer`` and the smallest P for it whose
``c + 1`` partitions and a bucket's edges fit in ``cap - reserve``); ``--partitions`` /
``--buffer`` fix P or c (fit then chooses the other, or checks both). A store whose region
holds the partitions (a log store) is given to fit itself, with the batch size and the
negatives: fit counts the ``memory=`` its region needs for ``c + 1`` partitions and the two
negatives' pools the iterator loads (``--pool``) beside a batch's rows
(``dsa_core.region_memory``: its index and its buffers included) instead of the partitions'
records, and both training phases open the store with that ``memory=``.

Writes ``benchmarks/results/buckets_ooc.{json,csv}`` for a run at the default sizes, otherwise
``<workdir>/buckets_ooc_<nodes>x<dim>.{json,csv}`` (``--results`` chooses the directory).
The scratch directory (store, edges, buckets) is removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from ._common import RESULTS, machine, own_cgroup, print_table, wait_disk_quiet, write_results
from .ooc import cgroup_ok, disk_fio, disk_pread, find_memcap

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"nodes": 10_000_000, "dim": 128, "edges": 100_000_000}
MIN_BATCHES = 2      # the automatic buffer keeps buckets at >= this many batches on average
EDGE_CHUNK = 1 << 20  # edges per chunk of the random order (shuffled within, chunks permuted)
SECTOR = 512          # /proc/diskstats counts 512-byte sectors


# -- small helpers -----------------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"2G"``, ``"256M"``, ``"1.5GiB"`` or a byte count -> bytes (powers of 1024)."""
    t = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in mult:
            return int(float(t[:-1]) * mult[t[-1]])
        return int(t)
    except ValueError:
        raise ValueError(f"a size must be a number with an optional K/M/G/T suffix "
                         f"(e.g. 2G, 256M), got {text!r}") from None


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.1f} h"
    return f"{seconds / 60:,.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def disk_counters() -> dict[str, int]:
    """Reads/writes completed and bytes read/written by the whole disks since boot."""
    out = {"read_ios": 0, "read_bytes": 0, "write_ios": 0, "write_bytes": 0}
    try:
        disks = {p.name for p in Path("/sys/block").iterdir() if (p / "device").exists()}
        with open("/proc/diskstats") as f:
            for line in f:
                x = line.split()
                if len(x) > 9 and x[2] in disks:
                    out["read_ios"] += int(x[3])
                    out["read_bytes"] += int(x[5]) * SECTOR
                    out["write_ios"] += int(x[7])
                    out["write_bytes"] += int(x[9]) * SECTOR
    except (OSError, ValueError):
        pass
    return out


def disk_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def evict_file(path: Path) -> None:
    """Write a file's dirty pages and drop it from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def evict_tree(*paths: Path) -> None:
    for p in paths:
        if p.is_file():
            evict_file(p)
        elif p.is_dir():
            for q in sorted(p.rglob("*")):
                if q.is_file():
                    evict_file(q)


def _optimizer_kw(optimizer: str) -> dict:
    """``dsa_core.create``'s optimizer arguments for ``--optimizer`` (Adam: none)."""
    return {} if optimizer == "adam" else {"optimizer": optimizer}


def record_bytes(dim: int, optimizer: str = "adam") -> int:
    """Bytes of one record of the benchmark's store (created empty once, then removed)."""
    import dsa_core

    tmp = Path(tempfile.mkdtemp(prefix="dsa_rec_"))
    try:
        st = dsa_core.create(tmp / "s", 1, dim, progress=False, **_optimizer_kw(optimizer))
        n = st.store.layout.stride * st.store.layout.dtype.itemsize
        dsa_core.close(st)
        return n
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def choose_partitions(nodes: int, rec: int, cap: int, reserve: int, edges: int,
                      max_buffer: int, partitions: int | None, buffer: int | None,
                      store: Path | None = None, batch: int = 0, k: int = 0,
                      pool: int | None = None):
    """(P, c, rule text, the store's memory= or None) from ``dsa_core.buckets.fit`` (see the
    module doc); ``store``: a store with a memory region (a log store), given to fit itself,
    which sizes its ``memory=`` for ``c + 1`` partitions and two negatives' pools beside a
    batch's rows."""
    import dsa_core
    from dsa_core import buckets

    st = dsa_core.open(store) if store is not None else None
    try:
        f = buckets.fit([st if st is not None else (nodes, rec)], memory=cap, reserve=reserve,
                        num_edges=edges, partitions=partitions, buffer=buffer,
                        max_buffer=max_buffer, batch_size=batch, negatives=k,
                        pool=pool_rows(pool, k))
    except ValueError as exc:
        raise SystemExit(f"dsa_core.buckets.fit found no P and c for this cap: {exc}") from None
    finally:
        if st is not None:
            dsa_core.close(st)
    given = [f"{n} = {v}" for n, v in (("P", partitions), ("c", buffer)) if v is not None]
    table = nodes * rec
    rule = (f"rule: dsa_core.buckets.fit(memory={cap / 2**20:,.0f} MiB, reserve="
            f"{reserve / 2**20:,.0f} MiB, num_edges={edges:,}, max_buffer={max_buffer}): {f}"
            f"\n  table {table / 1e9:.2f} GB, {f.partitions ** 2:,} buckets of "
            f"{edges / f.partitions ** 2:,.0f} edges on average")
    if given:
        rule += f" ({', '.join(given)} from the command line)"
    return f.partitions, f.buffer, rule, f.store_memory[0]


def ensure_store(path: Path, nodes: int, dim: int, storage: str, keep: bool,
                 optimizer: str = "adam") -> str:
    """The benchmark's store, made as a user would (``storage="auto"`` unless forced), every
    row written once; returns its kind (for the report only)."""
    import dsa_core

    if keep and (path / "manifest.json").exists():
        st = dsa_core.open(path, mode="r")
        same = ((st.num_rows, st.dim, st.optimizer) == (nodes, dim, optimizer)
                and storage in ("auto", st.storage))
        kind = st.storage
        dsa_core.close(st)
        if same:
            print(f"reusing store {path} ({kind})")
            return kind
    t0 = time.perf_counter()
    st = dsa_core.create(path, nodes, dim, init="uniform", init_scale=1e-3, lr=1e-3,
                         overwrite=True, progress=True, storage=storage,
                         **_optimizer_kw(optimizer))
    if st.store.info.memory_bytes is not None:  # a region: write every row, sealed in row order
        chunk = 1 << 16
        for lo in range(0, nodes, chunk):
            hi = min(nodes, lo + chunk)
            rows = np.arange(lo, hi)
            dsa_core.write_records(st, rows, dsa_core.read_records(st, rows))
            dsa_core.release_range(st, lo, hi)
    kind = st.storage
    dsa_core.close(st)  # every row on disk: an in-place store's pages, a log store's records
    dt = time.perf_counter() - t0
    gb = nodes * st.store.layout.stride * st.store.layout.dtype.itemsize / 1e9
    print(f"created {path} ({kind}): {gb:.1f} GB in {dt:.0f} s ({gb / dt:.2f} GB/s)")
    return kind


def has_region(path: Path) -> bool:
    """Whether the store keeps rows in a memory region of its own (``memory_bytes``)."""
    import dsa_core

    st = dsa_core.open(path)
    try:
        return st.store.info.memory_bytes is not None
    finally:
        dsa_core.close(st)


def pool_rows(pool: int | None, k: int) -> int:
    """The negatives' pool the iterator draws (``--pool``, else the library's default; none
    without negatives)."""
    from dsa_core import buckets

    return 0 if not k else buckets.DEFAULT_POOL if pool is None else pool


def store_settings(path: Path, nodes: int, P: int, c: int, batch: int, k: int,
                   memory: int | None, pool: int | None = None) -> dict:
    """The open keywords of the training phases: a store with a memory region of its own
    gets ``memory`` (fit's ``store_memory``: ``min(c + 1, P)`` partitions and two negatives'
    pools, the current state's and the next one's, beside ``batch * (2 + k)`` rows, what the
    bucket order's iterator loads); an in-place store none. Also the in-RAM phase's."""
    import dsa_core

    st = dsa_core.open(path)
    try:
        if st.store.info.memory_bytes is None:
            return {"train": {}, "ram": {"access": "ram"}, "region_rows": 0}
        parts = min(c + 1, P) * -(-nodes // P)
        pools = min(2 * pool_rows(pool, k), max(nodes - parts, 0))
        rows = parts + pools + min(batch * (2 + k), nodes)
        assert memory == dsa_core.region_memory(st, rows), (memory, rows)
        return {"train": {"memory": memory},
                "ram": {"memory": dsa_core.region_memory(st, nodes + min(batch * (2 + k),
                                                                         nodes))},
                "region_rows": rows}
    finally:
        dsa_core.close(st)


def biggest_file(directory: Path) -> Path:
    """The store's largest file (an in-place store's data file, a log store's largest
    segment): what the disk is measured on."""
    return max((p for p in directory.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)


def mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def ensure_edges(path: Path, nodes: int, edges: int, seed: int, keep: bool) -> None:
    """Uniform random (source, destination) pairs as an (E, 2) int32 memmap."""
    meta = path.with_suffix(".json")
    want = {"nodes": nodes, "edges": edges, "seed": seed}
    if keep and path.exists() and meta.exists() and json.loads(meta.read_text()) == want:
        print(f"reusing edges {path}")
        return
    t0 = time.perf_counter()
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.int32, shape=(edges, 2))
    rng = np.random.default_rng(seed)
    for lo in range(0, edges, 1 << 22):
        hi = min(edges, lo + (1 << 22))
        mm[lo:hi] = rng.integers(0, nodes, (hi - lo, 2), dtype=np.int32)
    mm.flush()
    del mm
    meta.write_text(json.dumps(want))
    dt = time.perf_counter() - t0
    print(f"wrote {edges:,} edges ({edges * 8 / 1e9:.2f} GB, int32) in {dt:.0f} s", flush=True)


class CgroupSampler:
    """Samples this process's memory cgroup (``memcap``'s) every ``period`` s: the peak of
    its anonymous memory, page cache, dirty and writeback pages, and the file refaults and
    major faults over the sampled window. Samples nothing outside a ``memcap`` cgroup."""

    KEYS = {"anon": ("rss", "anon"), "file": ("cache", "file"),
            "dirty": ("dirty", "file_dirty"), "writeback": ("writeback", "file_writeback"),
            "refaults": ("workingset_refault_file",), "majfaults": ("pgmajfault",)}

    def __init__(self, period: float = 0.25):
        self.period, self.stat = period, self._find()
        self.peak = {k: 0 for k in ("anon", "file", "dirty", "writeback")}
        self._first = self._last = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _find() -> Path | None:
        cg = own_cgroup("memcap_")
        return None if cg is None else cg / "memory.stat"

    def _read(self) -> dict | None:
        try:
            raw = dict(ln.split()[:2] for ln in self.stat.read_text().splitlines())
        except (OSError, ValueError):
            return None
        return {k: int(next((raw[n] for n in names if n in raw), 0))
                for k, names in self.KEYS.items()}

    def start(self):
        if self.stat is not None:
            self._first = self._read()
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            x = self._read()
            if x is None:
                return
            self._last = x
            for k in self.peak:
                self.peak[k] = max(self.peak[k], x[k])

    def stop(self) -> dict:
        if self.stat is None:
            return {}
        self._stop.set()
        self._thread.join()
        last = self._read() or self._last or self._first
        for k in self.peak:  # a phase shorter than one period still gets its sample
            self.peak[k] = max(self.peak[k], (last or {}).get(k, 0))
        out = {f"cg_peak_{k}": v for k, v in self.peak.items()}
        if self._first and last:
            out["cg_refaults"] = last["refaults"] - self._first["refaults"]
            out["cg_majfaults"] = last["majfaults"] - self._first["majfaults"]
        return out


# -- the disk ----------------------------------------------------------------------------------
def disk_seq_fio(file: Path, seconds: int) -> float | None:
    if not shutil.which("fio"):
        return None
    cmd = ["fio", "--name=s", f"--filename={file}", "--rw=read", "--bs=1M", "--direct=1",
           "--ioengine=libaio", "--iodepth=8", f"--runtime={seconds}", "--time_based",
           "--readonly", "--output-format=json"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             timeout=seconds + 60)
        return float(json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"])
    except (subprocess.SubprocessError, KeyError, ValueError) as exc:
        print(f"fio failed ({exc}); falling back to pread")
        return None


def disk_seq_pread(file: Path, seconds: float, block: int = 1 << 20) -> float:
    """1 MiB ``O_DIRECT`` reads in file order (wrapping around), one thread, bytes/s."""
    size = os.path.getsize(file) // block * block
    fd = os.open(file, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buf = mmap.mmap(-1, block)  # page-aligned for O_DIRECT
    done, off = 0, 0
    t0 = time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds:
            n = os.preadv(fd, [buf], off)
            done += n
            off = off + block if off + block < size else 0
    finally:
        os.close(fd)
    return done / (time.perf_counter() - t0)


def measure_disk(file: Path, seconds: int, seq: bool = True) -> dict:
    out = {}
    if seq:
        bw, tool = disk_seq_fio(file, seconds), "fio"
        if bw is None:
            bw, tool = disk_seq_pread(file, seconds), "pread"
        out["seq_read_bytes_per_s"], out["seq_tool"] = bw, tool
        print(f"disk: sequential 1 MiB reads: {bw / 1e6:,.0f} MB/s for {seconds} s ({tool})",
              flush=True)
    iops, tool = disk_fio(file, 32, seconds), "fio"
    if iops is None:
        iops, tool = disk_pread(file, 32, seconds), "pread"
    out["qd32_iops"], out["rand_tool"] = iops, tool
    print(f"disk: 4 KiB random reads QD32: {iops:,.0f} IOPS for {seconds} s ({tool})",
          flush=True)
    return out


# -- the model ---------------------------------------------------------------------------------
def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # no overflow for large |x|


def skipgram_step(dsa_core, state, edges: np.ndarray, neg: np.ndarray, lr: float):
    """One step of the skip-gram logistic loss on ``edges`` (b, 2+) with negatives (b, k).

    Returns ``(state, loss, rows)``: the new State, the batch's mean loss, the ids stepped.
    """
    b, k = neg.shape
    idx = np.concatenate([edges[:, 0], edges[:, -1], neg.reshape(-1)])
    rows = dsa_core.gather(state, idx)
    d = rows.shape[1]
    u, v, n = rows[:b], rows[b:2 * b], rows[2 * b:].reshape(b, k, d)
    s = np.einsum("bd,bd->b", u, v)
    sn = np.einsum("bd,bkd->bk", u, n)
    ps, pn = _sigmoid(s), _sigmoid(sn)
    loss = float(np.mean(-np.log(np.maximum(ps, 1e-30))
                         - np.log(np.maximum(1.0 - pn, 1e-30)).sum(1)))
    gs = (ps - 1.0) / b          # d loss / d s   (mean over the batch)
    gn = pn / b                  # d loss / d sn
    grad = np.empty_like(rows)
    grad[:b] = gs[:, None] * v + np.einsum("bk,bkd->bd", gn, n)
    grad[b:2 * b] = gs[:, None] * u
    grad[2 * b:] = (gn[:, :, None] * u[:, None, :]).reshape(b * k, d)
    state = dsa_core.step(state, idx, grad, lr=lr)
    return state, loss, idx.shape[0]


def random_batches(edges_mm, nodes: int, batch: int, k: int, seed: int):
    """The edges in a random permutation, chunked; negatives uniform over all nodes.

    Yields ``(ids, edges, negatives)``; ``ids`` (what ``step`` will touch) comes first, as
    ``dsa_core.prefetched`` expects.
    """
    rng = np.random.default_rng(seed)
    E = edges_mm.shape[0]
    for c in rng.permutation(-(-E // EDGE_CHUNK)):
        block = np.asarray(edges_mm[c * EDGE_CHUNK:(c + 1) * EDGE_CHUNK], dtype=np.int64)
        block = block[rng.permutation(block.shape[0])]
        for lo in range(0, block.shape[0], batch):
            e = block[lo:lo + batch]
            neg = rng.integers(0, nodes, (e.shape[0], k), dtype=np.int64)
            yield np.concatenate([e[:, 0], e[:, 1], neg.reshape(-1)]), e, neg


# -- the children ------------------------------------------------------------------------------
def open_plan(args):
    """The plan the ``plan`` child wrote to ``args.plan_dir``."""
    from dsa_core import buckets

    return buckets.open_plan(args.plan_dir)


def child_plan(args) -> dict:
    from dsa_core import buckets

    edges = np.load(args.edges_file, mmap_mode="r")
    t0 = time.perf_counter()
    io0 = disk_counters()
    plan = buckets.plan(edges, args.nodes, partitions=args.partitions, buffer=args.buffer,
                        seed=args.seed, out=args.plan_dir, chunk_edges=args.chunk_edges)
    dt = time.perf_counter() - t0
    order = plan.order(0)
    return {"phase": "bucketing", "seconds": dt, "edges": int(plan.num_edges),
            "edges_per_s": plan.num_edges / dt, "epoch_loads": int(order.loads),
            "lower_bound": int(order.lower_bound),
            **disk_delta(io0, disk_counters())}


def _open_kw(args) -> dict:
    return json.loads(args.open_kw) if args.open_kw else {}


def majfaults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def child_random(args) -> dict:
    import dsa_core

    st = dsa_core.open(args.store, **_open_kw(args))
    dsa_core.warmup(("float32",))
    edges = np.load(args.edges_file, mmap_mode="r")
    gen = random_batches(edges, st.num_rows, args.batch, args.negatives, args.seed + 1)
    steps = n_edges = n_rows = 0
    losses = []
    sampler = CgroupSampler().start()
    t0 = time.perf_counter()
    io0, mf0 = disk_counters(), majfaults()
    stop = t0 + args.seconds
    for _idx, e, neg in dsa_core.prefetched(st, gen, ahead=2):
        st, loss, r = skipgram_step(dsa_core, st, e, neg, args.lr)
        steps, n_edges, n_rows = steps + 1, n_edges + e.shape[0], n_rows + r
        losses.append(loss)
        if time.perf_counter() > stop:
            break
    t_steps = time.perf_counter() - t0
    dsa_core.flush(st)
    wall = time.perf_counter() - t0
    io = disk_delta(io0, disk_counters())
    io.update(sampler.stop(), majfaults=majfaults() - mf0)
    dsa_core.close(st)
    return {"phase": "random", "seconds": wall, "flush_s": wall - t_steps, "steps": steps,
            "edges_done": n_edges, "row_updates": n_rows, "loads": 0,
            "loss_first": float(np.mean(losses[:10])), "loss_last": float(np.mean(losses[-10:])),
            **io}


def child_bucket(args, ram: bool = False) -> dict:
    """The bucket order's loop (``ram``: on the store opened with everything in memory, the
    whole table loaded before the clock starts)."""
    import dsa_core

    plan = open_plan(args)
    st = dsa_core.open(args.store, **_open_kw(args))
    dsa_core.warmup(("float32",))
    if ram:  # every row into memory (a log store's region, an in-place store's page cache)
        t_load = time.perf_counter()
        dsa_core.load_range(st, 0, st.num_rows, wait=True)
        t_load = time.perf_counter() - t_load
    P = plan.num_partitions
    limit = max(1, math.ceil(args.fraction * P * P))
    steps = n_edges = n_rows = 0
    losses = []
    sampler = CgroupSampler().start()
    t0 = time.perf_counter()
    io0, mf0 = disk_counters(), majfaults()
    stop = t0 + args.seconds if args.seconds > 0 else float("inf")
    pool = {} if args.pool is None else {"pool": args.pool}
    it = plan.batches(args.batch, negatives=args.negatives, stores=[st], **pool)
    buckets_done = 0
    for b in it:
        st, loss, r = skipgram_step(dsa_core, st, b.edges, b.negatives, args.lr)
        steps, n_edges, n_rows = steps + 1, n_edges + b.edges.shape[0], n_rows + r
        losses.append(loss)
        e, k, _ = it.position
        buckets_done = k if e == 0 else P * P  # buckets of epoch 0 finished
        if buckets_done >= limit or (it.position[2] == 0 and time.perf_counter() > stop):
            break
    t_steps = time.perf_counter() - t0
    it.close()  # as at an epoch's end: the partitions held are written back sequentially
    dsa_core.wait_ranges(st)
    t_wait = time.perf_counter() - t0
    dsa_core.flush(st)
    wall = time.perf_counter() - t0
    io = disk_delta(io0, disk_counters())
    io.update(sampler.stop(), majfaults=majfaults() - mf0)
    if ram:
        io["preload_s"] = t_load
    loads = int(it.loads)
    # the store's own counters (Engine.stats, what `dsa info` prints): a log store's range
    # loads, free of other processes' disk traffic
    io.update({k: v for k, v in st.store.stats().items()
               if k.startswith("range_") and isinstance(v, int) or k == "misses"})
    lay = st.store.layout
    part = int(np.max(np.diff(plan.bounds))) * lay.stride * lay.dtype.itemsize
    dsa_core.close(st)
    order = plan.order(0)
    # the edges of the buckets trained, from the plan: what the phase must have stepped
    done = order.buckets[:buckets_done]
    expected = int(plan.bucket_sizes[done[:, 0], done[:, 1]].sum())
    return {"phase": "ram" if ram else "bucket", "seconds": wall, "flush_s": wall - t_wait,
            "wait_ranges_s": t_wait - t_steps, "steps": steps, "edges_done": n_edges,
            "row_updates": n_rows, "loads": loads, "buckets_done": buckets_done,
            "buckets": P * P, "epoch_loads": int(order.loads), "edges_expected": expected,
            "partition_bytes": part,
            "loss_first": float(np.mean(losses[:10])), "loss_last": float(np.mean(losses[-10:])),
            **io}


def child_ram(args) -> dict:
    return child_bucket(args, ram=True)


CHILDREN = {"plan": child_plan, "random": child_random, "bucket": child_bucket,
            "ram": child_ram}


def run_child(phase: str, a, scratch: Path, memcap: Path | None, capped: bool,
              open_kw: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.buckets_ooc", "--child", phase,
           "--store", str(scratch / "store"), "--edges-file", str(scratch / "edges.npy"),
           "--plan-dir", str(scratch / "plan"), "--nodes", str(a.nodes),
           "--partitions", str(a.partitions), "--buffer", str(a.buffer),
           "--seed", str(a.seed), "--batch", str(a.batch), "--negatives", str(a.negatives),
           "--lr", str(a.lr), "--fraction", str(a.bucket_fraction),
           "--chunk-edges", str(a.chunk_edges),
           "--seconds", str(a.random_seconds if phase == "random" else a.bucket_seconds),
           "--open-kw", json.dumps(open_kw or {})]
    if a.pool is not None:
        cmd += ["--pool", str(a.pool)]
    if capped:
        cmd = ["bash", str(memcap), a.cap, *cmd]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(r.stdout[-4000:], r.stderr[-4000:])
        raise SystemExit(f"the {phase} child failed (exit {r.returncode})")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    peak = [ln for ln in r.stderr.splitlines() if ln.startswith("memcap:")]
    res["memcap"] = peak[-1] if peak else ""
    if peak and "peak " in peak[-1]:
        try:
            res["peak_bytes"] = parse_size(peak[-1].split("peak ")[1].split(",")[0])
        except ValueError:
            pass
    return res


# -- the parent --------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=DEFAULTS["nodes"])
    ap.add_argument("--dim", type=int, default=DEFAULTS["dim"])
    ap.add_argument("--edges", type=int, default=DEFAULTS["edges"])
    ap.add_argument("--cap", default="2G", help="memory cap of the training children (cgroup)")
    ap.add_argument("--storage", default="auto", choices=("auto", "inplace", "log"),
                    help="the store's kind (default: what storage='auto' picks, as a user "
                         "gets)")
    ap.add_argument("--reserve", default="512M",
                    help="fit's reserve: memory the training process needs besides the "
                         "partitions (default: fit's own)")
    ap.add_argument("--max-buffer", type=int, default=8, help="fit's largest c")
    ap.add_argument("--pool", type=int, default=None,
                    help="plan.batches' pool= (the negatives' pool; default: the library's)")
    ap.add_argument("--partitions", type=int, default=None,
                    help="P (default: dsa_core.buckets.fit's)")
    ap.add_argument("--buffer", type=int, default=None,
                    help="c (default: dsa_core.buckets.fit's)")
    ap.add_argument("--no-ram", action="store_true",
                    help="skip the in-RAM phase (it needs the whole table in memory)")
    ap.add_argument("--batch", type=int, default=4096, help="edges per step")
    ap.add_argument("--negatives", type=int, default=4, help="negatives per edge (k)")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--optimizer", default="adam",
                    choices=("adam", "adagrad", "rowwise_adagrad"),
                    help="whose state the store's records hold (the step follows the store)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-seconds", type=float, default=120.0,
                    help="time budget of the random-order phase")
    ap.add_argument("--bucket-fraction", type=float, default=0.25,
                    help="share of the epoch's buckets the bucket-order phase trains")
    ap.add_argument("--bucket-seconds", type=float, default=0.0,
                    help="also stop the bucket phase at the first bucket boundary after this "
                         "long (0: no time limit)")
    ap.add_argument("--disk-seconds", type=int, default=20,
                    help="seconds of each disk measurement")
    ap.add_argument("--quiet-seconds", type=float, default=120.0,
                    help="longest wait for the disk to go quiet before a measurement or phase")
    ap.add_argument("--workdir", default=None, help="where the scratch directory goes")
    ap.add_argument("--results", default=None,
                    help="directory of the JSON/CSV (default: benchmarks/results at the "
                         "default sizes, else the workdir)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the scratch directory (and reuse a store/edges of that shape)")
    ap.add_argument("--no-cgroup", action="store_true",
                    help="run the phases without the memory cgroup (evicted files only)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--child", default=None, choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    for hidden in ("--store", "--edges-file", "--plan-dir"):
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fraction", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--chunk-edges", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--open-kw", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(CHILDREN[a.child](a)))
        return None
    if a.smoke:
        a.nodes, a.dim, a.edges, a.cap, a.batch = 20_000, 16, 200_000, "256M", 512
        a.partitions, a.buffer, a.reserve = a.partitions or 8, a.buffer or 3, "128M"
        # no waiting for the disk: the smoke run checks the code, not the figures
        a.random_seconds, a.bucket_fraction, a.disk_seconds, a.quiet_seconds = 0.5, 0.25, 1, 0.0
    for name, v, lo in (("--nodes", a.nodes, 2), ("--dim", a.dim, 1), ("--edges", a.edges, 1),
                        ("--batch", a.batch, 1), ("--disk-seconds", a.disk_seconds, 1)):
        if v < lo:
            raise SystemExit(f"{name} must be >= {lo}, got {v}")
    if a.negatives < 0:
        raise SystemExit(f"--negatives must be >= 0, got {a.negatives}")
    if not 0 < a.bucket_fraction <= 1:
        raise SystemExit(f"--bucket-fraction must be in (0, 1], got {a.bucket_fraction}")
    if a.edges >= 2**31 or a.nodes >= 2**31:
        raise SystemExit("--nodes and --edges must be < 2**31 (int32 edge file)")
    cap = parse_size(a.cap)
    # bucketing holds ~60 bytes per edge of a chunk at once: a chunk within ~1/4 of the cap
    a.chunk_edges = min(1 << 22, 1 << max(10, (cap // 256).bit_length() - 1))
    rec = record_bytes(a.dim, a.optimizer)
    fixed = (a.partitions, a.buffer)

    workdir = Path(a.workdir or tempfile.gettempdir())
    workdir.mkdir(parents=True, exist_ok=True)
    scratch = workdir / f"dsa_buckets_ooc_{a.nodes}x{a.dim}"
    full = (a.nodes, a.dim, a.edges) == tuple(DEFAULTS.values()) and not a.smoke
    results_dir = Path(a.results) if a.results else (RESULTS if full else workdir)
    table = a.nodes * rec
    # store (a log store's segments may hold up to space_ratio = 2 times the table), int32
    # edges, int64 buckets
    need = table * (1 if a.storage == "inplace" else 2) + a.edges * 8 + a.edges * 16 + (64 << 20)
    have = shutil.disk_usage(workdir).free
    existing = sum(p.stat().st_size for p in scratch.rglob("*") if p.is_file()) \
        if scratch.exists() else 0
    if have + existing < need * 1.05:
        raise SystemExit(f"not enough disk space in {workdir}: the run needs ~{need / 1e9:.1f} "
                         f"GB (store {table / 1e9:.1f} GB, edges {a.edges * 8 / 1e9:.1f} GB, "
                         f"their bucketed copy <= {a.edges * 16 / 1e9:.1f} GB), "
                         f"{have / 1e9:.1f} GB free; pass --workdir on a larger disk or "
                         "fewer --nodes/--edges")
    scratch.mkdir(parents=True, exist_ok=True)
    memcap = find_memcap()
    capped = not a.no_cgroup and cgroup_ok(memcap)
    label = f"cap {a.cap}" if capped else "cold (evicted, no cgroup)"
    try:
        kind = ensure_store(scratch / "store", a.nodes, a.dim, a.storage, a.keep,
                            a.optimizer)
        ensure_edges(scratch / "edges.npy", a.nodes, a.edges, a.seed, a.keep)
        print(f"table + state {table / 1e9:.2f} GB = {table / cap:.1f}x the cap ({a.cap}); "
              f"{label}", flush=True)
        reserve = parse_size(a.reserve)
        region = scratch / "store" if has_region(scratch / "store") else None
        a.partitions, a.buffer, rule, store_mem = choose_partitions(
            a.nodes, rec, cap, reserve, a.edges, a.max_buffer, *fixed, store=region,
            batch=a.batch, k=a.negatives, pool=a.pool)
        print(rule, flush=True)
        kw = store_settings(scratch / "store", a.nodes, a.partitions, a.buffer, a.batch,
                            a.negatives, store_mem, a.pool)
        if kw["train"]:
            print(f"{kind} store: both orders open it with memory={kw['train']['memory']:,} "
                  f"({kw['train']['memory'] / 2**20:,.0f} MiB: a region of "
                  f"{kw['region_rows']:,} rows, c + 1 partitions and two negatives' pools "
                  "beside a batch's rows, as the iterator requires)", flush=True)
        ram_ok = not a.no_ram and mem_available() > 1.1 * table + (1 << 30)
        if not a.no_ram and not ram_ok:
            print(f"no in-RAM phase: {mem_available() / 2**30:.1f} GiB available, the table "
                  f"needs {table / 2**30:.1f} GiB in memory (--no-ram skips it)", flush=True)
        shutil.rmtree(scratch / "plan", ignore_errors=True)
        evict_tree(scratch)
        wait_disk_quiet(a.quiet_seconds)
        bucketing = run_child("plan", a, scratch, memcap, capped)
        print(f"bucketing: {bucketing['edges']:,} edges in {bucketing['seconds']:.1f} s "
              f"({bucketing['edges_per_s'] / 1e6:.1f} M edges/s, chunks of {a.chunk_edges:,} "
              f"edges), {label}; an epoch needs "
              f"{bucketing['epoch_loads']} partition loads (lower bound "
              f"{bucketing['lower_bound']})", flush=True)
        evict_tree(scratch)
        wait_disk_quiet(a.quiet_seconds)
        disk = measure_disk(biggest_file(scratch / "store"), a.disk_seconds)
        rows = []
        # bucket order first, on the table as written (each partition's rows together, as
        # after an epoch of bucket order); random order then scatters the rows it evicts
        for phase in ("bucket", "random", *(("ram",) if ram_ok else ())):
            evict_tree(scratch)
            waited = wait_disk_quiet(a.quiet_seconds)
            res = run_child(phase, a, scratch, memcap, capped and phase != "ram",
                            kw["ram" if phase == "ram" else "train"])
            res.update(quiet_wait_s=waited, memory=label if phase != "ram" else "in RAM",
                       nodes=a.nodes, dim=a.dim, num_edges=a.edges, P=a.partitions,
                       c=a.buffer, batch=a.batch, negatives=a.negatives, storage=kind)
            res["edges_per_s"] = res["edges_done"] / res["seconds"]
            for key in ("read_ios", "read_bytes", "write_ios", "write_bytes", "majfaults"):
                res[f"{key}_per_edge"] = res[key] / max(1, res["edges_done"])
            res["row_updates_per_s"] = res["row_updates"] / res["seconds"]
            res["epoch_s_extrapolated"] = a.edges / res["edges_per_s"]
            rows.insert(0, res) if phase == "random" else rows.append(res)
            print(f"  {phase:<6} {res['edges_per_s']:>12,.0f} edges/s  "
                  f"{res['row_updates_per_s']:>12,.0f} row updates/s  steps {res['steps']}  "
                  f"{res['seconds']:.1f} s (flush {res['flush_s']:.1f} s)  loads "
                  f"{res['loads']}  read {res['read_bytes'] / 1e9:.2f} GB / "
                  f"{res['read_ios']:,} I/Os  written {res['write_bytes'] / 1e9:.2f} GB / "
                  f"{res['write_ios']:,} I/Os  major faults {res['majfaults']:,}  "
                  f"{res['memcap']}", flush=True)
            if "range_loads" in res:
                print(f"         store: {res['range_loads']} range loads, "
                      f"{res['range_records']:,} rows loaded, sequential reads "
                      f"{res['range_read_bytes'] / 1e9:.2f} GB in {res['range_reads']:,} "
                      f"reads, {res['range_mapped_records']:,} scattered records read at "
                      f"queue depth, {res['misses']:,} rows missed by steps", flush=True)
            if "cg_peak_anon" in res:
                print(f"         cgroup peaks: anon {res['cg_peak_anon'] / 2**20:,.0f} MiB, page "
                      f"cache {res['cg_peak_file'] / 2**20:,.0f} MiB, dirty "
                      f"{res['cg_peak_dirty'] / 2**20:,.0f} MiB, writeback "
                      f"{res['cg_peak_writeback'] / 2**20:,.0f} MiB; file refaults "
                      f"{res.get('cg_refaults', 0):,}, major faults "
                      f"{res.get('cg_majfaults', 0):,}", flush=True)
        wait_disk_quiet(a.quiet_seconds)
        after = measure_disk(biggest_file(scratch / "store"), a.disk_seconds, seq=False)
        disk["qd32_iops_after"] = after["qd32_iops"]
    finally:
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    rnd, bkt = rows[:2]
    ram = rows[2] if len(rows) > 2 else None
    ratio = bkt["edges_per_s"] / rnd["edges_per_s"] if rnd["edges_per_s"] else float("inf")
    qd32 = max(disk["qd32_iops"], disk["qd32_iops_after"])
    for r in rows:
        r["ratio_vs_random"] = r["edges_per_s"] / rnd["edges_per_s"] if rnd["edges_per_s"] \
            else float("inf")
        r["read_MBps"] = r["read_bytes"] / r["seconds"] / 1e6
        r["write_MBps"] = r["write_bytes"] / r["seconds"] / 1e6
        r["read_iops"] = r["read_ios"] / r["seconds"]
    print()
    print_table(rows, ["phase", "edges_per_s", "row_updates_per_s", "ratio_vs_random", "steps",
                       "seconds", "flush_s", "loads", "read_MBps", "read_iops", "write_MBps",
                       "epoch_s_extrapolated", "peak_bytes", "memory"])
    print()
    print_table(rows, ["phase", "read_ios_per_edge", "read_bytes_per_edge",
                       "write_ios_per_edge", "write_bytes_per_edge", "majfaults",
                       "majfaults_per_edge", "loads", "storage"])
    print(f"\n{kind} store. bucket order / random order: {ratio:.1f}x edges/s (issue target "
          ">= 10x)")
    if ram is not None:
        print(f"bucket order out of core / the same loop in RAM: "
              f"{bkt['edges_per_s'] / ram['edges_per_s']:.2f}x edges/s (issue target >= 0.8x; "
              f"the in-RAM run loaded the table in {ram['preload_s']:.0f} s before its clock)")
    print(f"disk: sequential reads {disk['seq_read_bytes_per_s'] / 1e6:,.0f} MB/s, "
          f"4 KiB random reads QD32 {qd32:,.0f} IOPS (higher of before/after)")
    print(f"a full epoch of {a.edges:,} edges, extrapolated from each phase's edge rate: "
          f"random order {duration(rnd['epoch_s_extrapolated'])}, bucket order "
          f"{duration(bkt['epoch_s_extrapolated'])} (the bucket phase did {bkt['loads']} "
          f"of the epoch's {bkt['epoch_loads']} partition loads over {bkt['buckets_done']} of "
          f"{bkt['buckets']} buckets)")
    meta = {"machine": machine(), "args": vars(a), "rule": rule, "disk": disk, "storage": kind,
            "open_kw": kw,
            "bucketing": bucketing, "table_bytes": table, "record_bytes": rec,
            "memory": label, "ratio": ratio, "extrapolated": "epoch_s_extrapolated = edges / "
            "the phase's edges/s"}
    results_dir.mkdir(parents=True, exist_ok=True)
    name = "buckets_ooc" if full else f"buckets_ooc_{a.nodes}x{a.dim}"
    base = write_results(str((results_dir / name).resolve()), rows, meta)
    print(f"wrote {base}.json/.csv")
    return None


if __name__ == "__main__":
    main()
