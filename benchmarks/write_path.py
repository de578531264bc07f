"""What writing one log segment costs, piece by piece: the writer thread's CPU (issue 28).

    python -m benchmarks.write_path                 # 32 MiB (one segment), 7 rounds each
    python -m benchmarks.write_path --smoke         # 1 MiB, seconds

A log store seals a segment (up to 32 MiB of records) into a new file: it computes the
segment's CRC32 and the per-record sums, copies the records, and writes the file with
``pwrite`` through the page cache, then syncs it. This times each of those on the same
bytes, and the alternatives for the write itself:

- ``buffered, new file, kept``: what the writer does today, files kept as segments are (the
  page cache grows by each file: on a VM, pages the guest has not used yet may first have
  to come from the host);
- ``buffered, new file, previous deleted``: the same, each file deleted before the next is
  written (the page cache reuses the pages just freed);
- ``buffered, cached pages``: the same bytes over an existing file whose pages are cached
  (the cost of the copy alone, without the allocation);
- ``O_DIRECT, new file``: no page cache (the buffer is page-aligned, every write a multiple
  of 4 KiB);

each without and with the ``fsync`` that makes the segment durable. Medians over
``--rounds``; the kept files are deleted at the end (disk: ``2 x rounds`` files at most).
Writes ``benchmarks/results/write_path.{json,csv}``.

``--store`` measures the log store's own segment writer instead: a store of ``--rows`` x
``--dim`` stepped with uniform batches of ``--batch`` rows until ``--segments`` segments
have been written, and the CPU time of the writer thread (``time.thread_time`` around each
write, as ``SegmentWriter.cpu_s`` counts it) divided by the segments it wrote. Twice, each
in a child process, the stores of both kept until the end (neither reuses the other's freed
pages): with the page-cache window of written segments uncapped (12.5% of the memory the
process may use: GiBs on a large machine, every segment grows the page cache until it is
full; the default again since 2026-12-06) and capped at one seal unit (32 MiB, the default
from 2026-12-03 to 12-06)::

    python -m benchmarks.write_path --store                      # 1M x 128, 96 segments
    python -m benchmarks.write_path --store --rows 10000000 --memory 4GiB
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
import time
import zlib

import numpy as np

from ._common import machine, print_table, write_results

_CHUNK = 8 << 20  # bytes per pwrite, as the segment writer's chunks


def _pwrite_all(fd: int, raw: memoryview) -> None:
    off = 0
    while off < len(raw):
        off += os.pwrite(fd, raw[off:off + _CHUNK], off)


def _median_ms(fn, rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts) * 1e3)


def _store_child(a) -> None:
    """One store run (``--store-child``): prints a JSON line with the writer's CPU."""
    import dsa_core
    from dsa_core._log import segments

    segments.CACHE_MAX = a.cache_max  # the window's cap
    s = dsa_core.create(os.path.join(a.workdir, a.name), a.rows, a.dim, storage="log",
                        memory=a.memory)
    eng = s.store
    rng = np.random.default_rng(0)
    g = rng.standard_normal((a.batch, a.dim)).astype(np.float32)
    t0, steps = time.perf_counter(), 0
    while eng._segments.writer is None or eng._segments.writer.jobs < a.segments:
        s = dsa_core.step(s, rng.choice(a.rows, a.batch, replace=False), g)
        steps += 1
    eng._segments.settle(block=True)
    w = eng._segments.writer
    out = {"cache_bytes": w.cache_bytes, "segments": w.jobs, "steps": steps,
           "seal_mib": round(eng.seal_unit * eng.rec_bytes / 2**20, 2),
           "writer_cpu_ms_per_segment": round(1e3 * w.cpu_s / w.jobs, 2),
           "wall_s": round(time.perf_counter() - t0, 2)}
    eng.abandon()  # the files stay until the parent removes them
    print(json.dumps(out))


def _store(a) -> list[dict]:
    """Both windows, each in a child process (see the module docstring)."""
    from dsa_core._log.budget import SEAL_BYTES

    root = tempfile.mkdtemp(prefix="dsa_write_path_store_", dir=a.workdir)
    rows = []
    try:
        for what, cap in (("window uncapped (the default)", 1 << 62),
                          ("window capped at one seal unit", SEAL_BYTES)):
            cmd = [sys.executable, "-m", "benchmarks.write_path", "--store-child",
                   "--cache-max", str(cap), "--name", f"s{len(rows)}", "--workdir", root,
                   "--rows", str(a.rows), "--dim", str(a.dim), "--batch", str(a.batch),
                   "--memory", str(a.memory), "--segments", str(a.segments)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
            rows.append({"what": what, **json.loads(res.stdout.strip().splitlines()[-1])})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, ["what", "cache_bytes", "segments", "seal_mib",
                       "writer_cpu_ms_per_segment", "wall_s"])
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=32, help="bytes written per round, in MiB")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--workdir", default=None, help="where the files go (default: TMPDIR)")
    ap.add_argument("--smoke", action="store_true", help="1 MiB, 2 rounds: checks it runs")
    ap.add_argument("--store", action="store_true",
                    help="the log store's writer thread: CPU per segment, before and now")
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16_384)
    ap.add_argument("--memory", default="1GiB", help="the store's memory= (--store)")
    ap.add_argument("--segments", type=int, default=96, help="segments to write (--store)")
    ap.add_argument("--store-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache-max", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--name", default="s", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.store_child:
        _store_child(a)
        return []
    if a.smoke:
        a.mib, a.rounds = 1, 2
        a.rows, a.dim, a.batch, a.memory, a.segments = 20_000, 8, 512, "2MiB", 4
    if a.store:
        rows = _store(a)
        write_results("write_path_store_smoke" if a.smoke else "write_path_store", rows,
                      {"machine": machine(), "args": vars(a)})
        return rows
    size = a.mib << 20
    from dsa_core._log.sums import record_sums

    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(np.random.default_rng(0).bytes(size))
    raw = memoryview(buf)
    arr = np.frombuffer(buf, np.float32)
    recs = arr[: arr.size // 384 * 384].reshape(-1, 384)  # 1,536-byte records
    root = tempfile.mkdtemp(prefix="dsa_write_path_", dir=a.workdir)
    n = [0]

    def write(flags: int, sync: bool, keep: bool = False) -> None:
        n[0] += 1
        fd = os.open(os.path.join(root, f"f{n[0]}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                     | flags, 0o644)
        try:
            _pwrite_all(fd, raw)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if not keep:
            os.unlink(os.path.join(root, f"f{n[0]}"))

    cached = os.path.join(root, "cached")
    fd_cached = os.open(cached, os.O_RDWR | os.O_CREAT, 0o644)
    _pwrite_all(fd_cached, raw)
    os.fsync(fd_cached)
    direct = getattr(os, "O_DIRECT", None)
    rows = []
    try:
        def add(what: str, ms: float) -> None:
            rows.append({"what": what, "mib": a.mib, "median_ms": round(ms, 2),
                         "ms_per_mib": round(ms / a.mib, 3)})

        add("zlib.crc32", _median_ms(lambda: zlib.crc32(raw), a.rounds))
        add("record sums (64-bit hash per record)", _median_ms(lambda: record_sums(recs),
                                                               a.rounds))
        add("numpy copy", _median_ms(lambda: arr.copy(), a.rounds))
        for sync in (False, True):
            tag = " + fsync" if sync else ""
            add("pwrite, buffered, new file, kept" + tag,
                _median_ms(lambda: write(0, sync, keep=True), a.rounds))
            add("pwrite, buffered, new file, previous deleted" + tag,
                _median_ms(lambda: write(0, sync), a.rounds))
            add("pwrite, buffered, cached pages" + tag,
                _median_ms(lambda: (_pwrite_all(fd_cached, raw),
                                    os.fsync(fd_cached) if sync else None), a.rounds))
            if direct is not None:
                try:
                    add("pwrite, O_DIRECT, new file" + tag,
                        _median_ms(lambda: write(direct, sync), a.rounds))
                except OSError as exc:  # a filesystem without O_DIRECT (tmpfs)
                    print(f"O_DIRECT: {exc}")
    finally:
        os.close(fd_cached)
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows, ["what", "mib", "median_ms", "ms_per_mib"])
    write_results("write_path_smoke" if a.smoke else "write_path", rows,
                  {"machine": machine(), "args": vars(a)})
    if a.smoke:  # the store's part too, at tiny size
        store_rows = _store(a)
        write_results("write_path_store_smoke", store_rows, {"machine": machine(),
                                                             "args": vars(a)})
    return rows


if __name__ == "__main__":
    main()
