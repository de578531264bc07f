"""How many bytes a step writes back per changed row, depending on how the store got cached.

    python -m benchmarks.folio_check                  # a 2 GB store, 500 changed rows
    python -m benchmarks.folio_check --smoke          # seconds; CI runs this

Linux may back a file's page cache with large folios (up to 2 MiB on ext4 with large-folio
support) when it reads the file through ``read``/``copy_file_range`` read-ahead. A folio is
written back whole: a step that changes one 1.5 KB row in a large folio writes megabytes.
Pages faulted in through a ``MADV_RANDOM`` mapping (``access="disk"``) are 4 KiB folios.

For each way of filling the cache, the store is first evicted (fsync +
``posix_fadvise(DONTNEED)``, and ``drop_caches`` when run as root, unless
``--no-drop-caches``), then filled that way, then ``--rows`` random rows are stepped
(``dsa_core.step``, ``access="disk"``) and flushed;
the bytes the store's block device wrote during step + flush (``/proc/diskstats``, after the
device has been idle for a second) per changed row are reported:

- ``mapping faults only``: nothing but the step's own faults;
- ``dsa_core.prefetch``: the out-of-core read-ahead of exactly those rows
  (``posix_fadvise(WILLNEED)`` per record);
- ``read() of the file``: e.g. ``cp``/``cat``/a backup tool read it first;
- ``copy_file_range``: what ``dsa_core.checkpoint`` did before it read with ``O_DIRECT``;
- ``dsa_core.checkpoint``: the current checkpoint.

Writes ``benchmarks/results/folio_check[_smoke].{json,csv}``.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import machine, print_table, write_results


def _device(path: Path) -> str | None:
    """The /proc/diskstats name of the block device holding ``path`` (None if unknown)."""
    st = os.stat(path)
    try:
        uevent = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/uevent")
        for line in uevent.read_text().splitlines():
            if line.startswith("DEVNAME="):
                return line.split("=", 1)[1]
    except OSError:
        pass
    return None


def _written_bytes(dev: str | None) -> int:
    if dev is None:
        return 0
    with open("/proc/diskstats") as f:
        for line in f:
            p = line.split()
            if p[2] == dev:
                return int(p[9]) * 512
    return 0


def _settle(dev: str | None, quiet_s: float = 1.0, limit_s: float = 60.0) -> None:
    """Wait until the device has written nothing for ``quiet_s`` (metadata of the copies, ...)."""
    end = time.monotonic() + limit_s
    last = _written_bytes(dev)
    while time.monotonic() < end:
        time.sleep(quiet_s)
        now = _written_bytes(dev)
        if now == last:
            return
        last = now


def _evict(file: Path, drop_all: bool = True, pause: float = 0.5) -> None:
    """Drop ``file``'s cached pages. DONTNEED skips folios still under writeback, so it is
    repeated after the fsync settles (``pause`` s), and (``drop_all``) the whole clean page
    cache is dropped when allowed."""
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(2):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            time.sleep(pause)
    finally:
        os.close(fd)
    if not drop_all:
        return
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError:
        pass  # not root: DONTNEED alone


def _resident(path: Path) -> float:
    """Share of the store's record pages in the page cache (``dsa_core.residency`` of every
    row, through a read-only ``access="disk"`` mapping, unmapped again before returning)."""
    import dsa_core

    st = dsa_core.open(path, mode="r", access="disk")
    try:
        return dsa_core.residency(st, np.arange(st.num_rows))
    finally:
        dsa_core.close(st)
        del st
        gc.collect()


def _read_all(file: Path) -> None:
    with open(file, "rb") as f:
        while f.read(1 << 24):
            pass


def _copy_file_range(file: Path, dest: Path) -> None:
    with open(file, "rb") as fi, open(dest, "wb") as fo:
        size, off = os.fstat(fi.fileno()).st_size, 0
        while off < size:
            off += os.copy_file_range(fi.fileno(), fo.fileno(), size - off, off, off)
        os.fsync(fo.fileno())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=2.0, help="store size")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=500, help="rows changed per case")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cases", nargs="+", default=None, help="a subset, by index (0-4)")
    ap.add_argument("--waits", type=float, default=1.0,
                    help="scales every wait for the device: the 6 s for ext4's journal, the 1 s "
                         "of idle device (at most 60 s) before evicting and stepping, the "
                         "pauses of an eviction (0 in --smoke)")
    ap.add_argument("--no-drop-caches", action="store_true",
                    help="evict the store's pages only, never the machine's whole page cache "
                         "(which a run as root drops otherwise; set by --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="a small store, few rows, no waiting: checks the code, not the figures")
    a = ap.parse_args(argv)
    if a.smoke:
        a.gb, a.rows, a.waits, a.no_drop_caches = 0.01, 50, 0.0, True
    import dsa_core

    root = Path(tempfile.mkdtemp(prefix="folio_check_", dir=a.workdir))
    n = int(a.gb * 1e9 // (3 * a.dim * 4))
    path = root / "s"
    st = dsa_core.create(path, n, a.dim, init="uniform", init_scale=1e-3, access="disk",
                         progress=False)
    dsa_core.close(st)
    del st
    gc.collect()  # unmap: mapped pages cannot be evicted
    file = path / "rows.dsa"
    dev = _device(file)
    print(f"store {n:,} x {a.dim} ({file.stat().st_size / 1e9:.2f} GB) on "
          f"{dev or 'an unknown device'}; {a.rows} rows changed per case")
    rng = np.random.default_rng(0)
    g = rng.standard_normal((a.rows, a.dim)).astype(np.float32)

    def checkpoint():
        s = dsa_core.open(path, access="disk")
        dsa_core.checkpoint(s, root / "ckpt", overwrite=True)
        dsa_core.close(s)
        del s
        gc.collect()

    pre_idx = {}

    def prefetch():  # dsa_core.prefetch of exactly the rows the step will change
        s = dsa_core.open(path, access="disk")
        dsa_core.prefetch(s, pre_idx["idx"], wait=True)
        dsa_core.close(s)
        del s
        gc.collect()

    cases = {
        "mapping faults only": lambda: None,
        "dsa_core.prefetch": prefetch,
        "read() of the file": lambda: _read_all(file),
        "copy_file_range": lambda: _copy_file_range(file, root / "copy.bin"),
        "dsa_core.checkpoint": checkpoint,
    }
    if a.cases:
        cases = {k: v for i, (k, v) in enumerate(cases.items()) if str(i) in a.cases}
    out = []
    try:
        for name, fill in cases.items():
            idx = np.sort(rng.choice(n, a.rows, replace=False))
            pre_idx["idx"] = idx
            _settle(dev, a.waits, 60 * a.waits)
            time.sleep(6 * a.waits)  # ext4's journal commit (5 s) releases the pages it pins
            _evict(file, drop_all=not a.no_drop_caches, pause=0.5 * a.waits)
            evicted = _resident(path)
            fill()
            filled = _resident(path)
            for extra in (root / "copy.bin", root / "ckpt" / "rows.dsa"):
                if extra.exists():  # its own dirty pages must not count below
                    _evict(extra, drop_all=False, pause=0.5 * a.waits)
            _settle(dev, a.waits, 60 * a.waits)
            st = dsa_core.open(path, access="disk")
            resident = dsa_core.residency(st, idx)  # what the fill left cached of these rows
            w0 = _written_bytes(dev)
            st = dsa_core.step(st, idx, g)
            dsa_core.flush(st)
            w1 = _written_bytes(dev)
            dsa_core.close(st)
            del st
            gc.collect()
            per_row = (w1 - w0) / a.rows
            out.append({"cache filled by": name, "rows": a.rows, "cached_after_evict": evicted,
                        "cached_after_fill": filled, "rows_resident": resident,
                        "bytes_written": w1 - w0, "kib_per_row": per_row / 1024})
            print(f"  {name:<22} {per_row / 1024:10,.1f} KiB written per changed row "
                  f"(file cached: {evicted:.2f} after evict, {filled:.2f} after the fill; "
                  f"rows resident at the step: {resident:.2f})", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print()
    print_table(out, ["cache filled by", "rows", "cached_after_evict", "cached_after_fill",
                      "rows_resident", "bytes_written", "kib_per_row"])
    base = write_results("folio_check_smoke" if a.smoke else "folio_check", out,
                         {"machine": machine(), "args": vars(a), "device": dev})
    print(f"wrote {base}.json / .csv")


if __name__ == "__main__":
    main()
