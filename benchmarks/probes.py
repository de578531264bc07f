"""The guard's anchors that are not another optimizer: the memory's and the drive's limits.

- :func:`memory_probe_kernel`: a Numba ``@njit(parallel=True)`` kernel that reads and
  writes each id's whole record once (adds a constant; no Adam math) -- what the memory
  system allows a step on the same ids and record layout, with the same threads.
  :func:`memory_probe_kernel_one` is the same loop on one thread: ``prange`` splits the ids
  statically and waits at a barrier for every thread, so on a machine where other work
  holds a core the parallel probe waits a scheduler quantum for a descheduled thread
  (measured here: 8 ms for a 64-id batch that takes 0.1 ms on a quiet machine); the guard
  takes the faster of the two as the anchor, so a loaded machine cannot make the anchor
  slow and the ratio flattering.
- :func:`drive_rate`: the drive's random 4 KiB read rate at a queue depth, from
  ``benchmarks/drive_probe.c`` (compiled at run time into a work directory with
  ``cc -O2 -pthread``), or, where no compiler works, from Python threads doing
  ``os.preadv`` on ``O_DIRECT`` descriptors (``benchmarks.ooc.disk_pread``: threads in up
  to 4 processes; it reads less than the drive does at high queue depths, so the result
  says which tool measured it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

HERE = Path(__file__).resolve().parent
DRIVE_PROBE_C = HERE / "drive_probe.c"


@njit(parallel=True, cache=True, nogil=True)
def memory_probe_kernel(table, ids, c):
    """Add ``c`` to every float of the records ``table[ids]``, in parallel over ``ids``: each
    record read and written once (duplicates race: the time, not the values, is what
    counts)."""
    width = table.shape[1]
    for i in prange(ids.shape[0]):
        row = table[ids[i]]
        for j in range(width):
            row[j] += c


@njit(cache=True, nogil=True)
def memory_probe_kernel_one(table, ids, c):
    """:func:`memory_probe_kernel` on the calling thread alone."""
    width = table.shape[1]
    for i in range(ids.shape[0]):
        row = table[ids[i]]
        for j in range(width):
            row[j] += c


def set_probe_threads(n: int) -> int:
    """Run the probe on ``n`` threads (at most Numba's pool); returns the count set."""
    import numba

    n = max(1, min(int(n), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(n)
    return n


def memory_probe_rows_per_s(table: np.ndarray, batches: list[np.ndarray], warmup: int,
                            parallel: bool = True) -> float:
    """Rows/s of the probe (``parallel``: on Numba's threads, else on this one): the batch
    size over the median time of a batch after ``warmup``."""
    kernel = memory_probe_kernel if parallel else memory_probe_kernel_one
    c = table.dtype.type(1e-7)
    times = []
    for k, ids in enumerate(batches):
        t0 = time.perf_counter()
        kernel(table, ids, c)
        dt = time.perf_counter() - t0
        if k >= warmup:
            times.append(dt)
    return batches[0].shape[0] / float(np.median(times))


# -- the drive ---------------------------------------------------------------------------------
def build_drive_probe(workdir: Path, allow: bool = True) -> tuple[Path | None, str]:
    """Compile ``drive_probe.c`` into ``workdir``; returns (binary or None, what happened)."""
    if not allow:
        return None, "compiler not used (--no-cc)"
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, "no C compiler (cc, gcc, clang) found"
    out = Path(workdir) / "drive_probe"
    r = subprocess.run([cc, "-O2", "-pthread", "-o", str(out), str(DRIVE_PROBE_C)],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return None, f"{Path(cc).name} failed: {r.stderr.strip()[-300:]}"
    return out, f"built with {Path(cc).name} -O2 -pthread"


def drive_rate(files: list[Path], qd: int, seconds: float, binary: Path | None,
               write: tuple[Path, float] | None = None) -> dict:
    """4 KiB random O_DIRECT reads at queue depth ``qd`` over ``files`` for ``seconds``:
    ``{"reads_per_s", "tool", "direct"}``; the C probe where ``binary`` is given, else
    Python threads. ``write=(file, mb_per_s)``: meanwhile the C probe writes ``file``
    sequentially at that rate (``drive_probe.c --write``; the result then also holds
    ``written_mb_per_s``); without the C probe a ``write`` probe returns None."""
    files = [str(f) for f in files if os.path.getsize(f) >= 4096]
    if not files:
        raise ValueError("no file of at least 4 KiB to probe the drive with")
    if binary is not None:
        extra = ["--write", str(write[0]), repr(float(write[1]))] if write else []
        r = subprocess.run([str(binary), str(qd), repr(float(seconds)), *extra, *files],
                           capture_output=True, text=True, check=False,
                           timeout=seconds + 120)
        if r.returncode == 0:
            f = r.stdout.split()
            got = dict(zip(f[::2], f[1::2], strict=False))
            out = {"reads_per_s": float(got["reads_per_s"]), "tool": "drive_probe.c",
                   "direct": got.get("direct") == "1"}
            if write:
                out["written_mb_per_s"] = float(got["written_mb_per_s"])
            return out
        print(f"drive_probe failed ({r.stderr.strip()[-300:]}); "
              + ("no probe beside writes" if write else "Python threads instead"), flush=True)
    if write:
        return None
    from .ooc import disk_pread

    return {"reads_per_s": disk_pread([Path(f) for f in files], qd, seconds),
            "tool": "python O_DIRECT threads", "direct": True}
