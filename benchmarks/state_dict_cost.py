"""What ``opt.state_dict()`` costs on each store kind (it snapshots every store).

    python -m benchmarks.state_dict_cost                    # 1M x 128 float32 DiskEmbedding
    python -m benchmarks.state_dict_cost --rows 1000000 --dim 128 --memory 256MiB
    python -m benchmarks.state_dict_cost --smoke            # seconds

For each kind (``storage="inplace"``, ``storage="log"``) a fresh ``DiskEmbedding`` (weights,
m and v in one store) stepped by ``DiskSparseAdam`` in the directory ``--dir`` (default: a
temporary one): one pass of steps over every row (the log store then holds the whole table
in segments), then three rounds of ``--steps`` random steps of ``--batch`` rows, each round
followed by ``opt.flush()`` (timed) and ``opt.state_dict()`` (timed; with the default
``keep_snapshots=3``), then one ``opt.load_state_dict`` of the first state dict (timed).
Reported per kind: the times, and the disk the three kept snapshots take beyond the live
store (allocated blocks of files that are not the live store's: hard-linked segments count
once). The in-place snapshot copies the data file with a reflink where the filesystem
supports it (``"reflink"`` in the output says whether it did here), else in full.

I/O bound: run it on an otherwise idle disk; the disk is waited quiet before each timing.
Writes ``benchmarks/results/state_dict_cost.{json,csv}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ._common import disk_bytes, machine, print_table, wait_disk_quiet, write_results


def _reflinked(a: Path, b: Path) -> bool | None:
    """Whether two files share extents (FIEMAP's shared flag on b's first extent)."""
    try:
        import fcntl
        import struct

        with open(b, "rb") as f:
            buf = bytearray(32 + 56)
            struct.pack_into("QQIIII", buf, 0, 0, 1 << 62, 0, 0, 1, 0)
            fcntl.ioctl(f.fileno(), 0xC020660B, buf)  # FS_IOC_FIEMAP
            n = struct.unpack_from("I", buf, 20)[0]
            if not n:
                return None
            flags = struct.unpack_from("I", buf, 32 + 40)[0]
            return bool(flags & 0x2000)  # FIEMAP_EXTENT_SHARED
    except OSError:
        return None


def run_kind(root: Path, kind: str, a) -> dict:
    """One kind's run, its table taken as large whatever its size: its state dicts name
    snapshots (what this measures) instead of holding the rows, as small tables' do."""
    from adapters.torch import DiskWeight

    limit, DiskWeight.read_limit = DiskWeight.read_limit, 0
    try:
        return _run_kind(root, kind, a)
    finally:
        DiskWeight.read_limit = limit


def _run_kind(root: Path, kind: str, a) -> dict:
    import torch

    from adapters.torch import DiskEmbedding, DiskSparseAdam

    kw = {"storage": "log", "memory": a.memory} if kind == "log" else {"storage": "inplace"}
    emb = DiskEmbedding(a.rows, a.dim, state_dir=root / "emb", seed=0, **kw)
    opt = DiskSparseAdam(emb.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)

    def step(ids):
        emb(torch.from_numpy(ids)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()

    for lo in range(0, a.rows, a.batch):  # every row once: the log store's segments hold all
        step(np.arange(lo, min(a.rows, lo + a.batch), dtype=np.int64))
    row = {"storage": kind, "rows": a.rows, "dim": a.dim,
           "table_GB": emb.store.layout["stride"] * a.rows * 4 / 1e9}
    sds = []
    for r in range(3):
        for _ in range(a.steps):
            step(rng.integers(0, a.rows, a.batch))
        wait_disk_quiet(a.quiet_seconds)
        t0 = time.perf_counter()
        opt.flush()
        t1 = time.perf_counter()
        sds.append(opt.state_dict())
        t2 = time.perf_counter()
        row[f"flush{r + 1}_s"] = t1 - t0
        row[f"state_dict{r + 1}_s"] = t2 - t1
    live = Path(emb.store.path)
    snaps = live.parent / ".dsa-snapshots" / live.name
    seen: set = set()
    row["live_GB"] = disk_bytes(live, seen=seen) / 1e9
    row["snapshots_GB"] = disk_bytes(snaps, seen=seen) / 1e9
    if kind == "inplace":
        first = Path(sds[0]["dsa_manifest"]["params"][0]["state_snapshot"]["path"])
        row["reflink"] = _reflinked(live / "rows.dsa", first / "rows.dsa")
    wait_disk_quiet(a.quiet_seconds)
    t0 = time.perf_counter()
    opt.load_state_dict(sds[0])
    row["load_state_dict_s"] = time.perf_counter() - t0
    opt.close()
    emb.close()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=5, help="random steps before each state dict")
    ap.add_argument("--memory", default="256MiB", help="the log store's region")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    ap.add_argument("--quiet-seconds", type=float, default=60.0,
                    help="wait up to this long for the disk to go quiet before each timing")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.smoke:  # tiny, no waits: only that the code runs
        a.rows, a.dim, a.batch, a.steps, a.memory = 20_000, 16, 2048, 2, "2MiB"
        a.quiet_seconds = 0.0
    base = Path(tempfile.mkdtemp(prefix="dsa-sdcost-", dir=a.dir))
    rows = []
    try:
        for kind in ("inplace", "log"):
            rows.append(run_kind(base / kind, kind, a))
            shutil.rmtree(base / kind)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cols = ["storage", "rows", "table_GB", "flush1_s", "state_dict1_s", "state_dict2_s",
            "state_dict3_s", "load_state_dict_s", "live_GB", "snapshots_GB", "reflink"]
    print_table(rows, cols)
    if not a.smoke:
        out = write_results("state_dict_cost", rows, {"args": vars(a), "machine": machine()})
        print(f"wrote {out}.json")


if __name__ == "__main__":
    main()
