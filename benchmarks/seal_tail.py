"""The tail of a log store's steps: what a step that seals spends, and where.

One log store (float32, weights in it, ``init="normal"``) whose region holds ``--share`` of
the table; every row is stepped once (a zero gradient), then ``--age-passes`` passes of
random batches age it to its space bound (every seal cleans), then ``--steps`` timed steps
of uniform random ids, each batch read ahead two steps early (``dsa_core.prefetched``). The
segment writer drops written segments from the page cache, so with a small region the misses
are read from the disk: out of core at any table size.

Per step it records the time and whether the step sealed; per sealing step the time spent in
the seal's parts (the engine's methods wrapped with timers: eviction, the cleaner's choice
and read-ahead, the gather of the records, the hand-over to the writer, the segment
bookkeeping) and in the step's reads of its misses. It prints the step time's mean, p50, p90
and p99, the median step that sealed against the median one that did not, and the parts.

Switches for A/B runs of the choices this measured (each restores the old behaviour):
``--pace-mib 0`` (the writer writes a segment at once), ``--no-hints`` (victims' ids not
hinted a seal early), ``--inline-unmap`` (segments unmapped in the thread that drops them),
``--seal-mib`` (a smaller seal unit than 32 MiB), ``--no-recycle`` (every dead segment file
deleted instead of kept for the next seals to overwrite). Where the workdir's block device
has a ``stat`` file in ``/sys/dev/block``, the time the disk spent on discards during each
step is counted too (the whole device's, not this process's alone; a filesystem mounted with
``discard`` sends one when a deleted file's blocks are freed).

Run::

    python -m benchmarks.seal_tail                      # 1M x 128, region 25%, 500 steps
    python -m benchmarks.seal_tail --pace-mib 0         # A/B: the segment written at once
    python -m benchmarks.seal_tail --smoke              # tiny, for CI
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

import dsa_core
from dsa_core._log import budget as _budget
from dsa_core._log import cleaner as _cleaner
from dsa_core._log import commit as _commit
from dsa_core._log import format as _format
from dsa_core._log import pool as _pool
from dsa_core._log import segments as _segments
from dsa_core._log import writer as _writer

from ._common import disk_stat_file, machine, print_table, write_results

PARTS = [(_commit.Commit, "seal", "seal"), (_pool.Pool, "evict", "evict"),
         (_pool.Pool, "gather_slots", "gather"), (_cleaner.Cleaner, "choose", "choose"),
         (_cleaner.Cleaner, "read_ahead", "read_ahead"),
         (_segments.Segments, "write_behind", "write_behind"),
         (_segments.Segments, "settle", "settle"), (_segments.Segments, "kill", "kill"),
         (_segments.Segments, "drop", "drop"), (_pool.Pool, "free_slots", "free_slots"),
         (_segments.Segments, "read_into", "read_into")]


def _timed(acc: dict[str, float]) -> list[tuple[object, str, object]]:
    """Wrap PARTS with timers adding to ``acc``; returns what to restore."""
    saved = []
    for owner, name, label in PARTS:
        f = getattr(owner, name)
        saved.append((owner, name, f))

        def g(*a, _f=f, _label=label, **k):
            t0 = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                acc[_label] += time.perf_counter() - t0

        setattr(owner, name, g)
    return saved


def _inline_del(self):  # the old _ReadOnlyMap.__del__: unmapped by whoever drops it
    if self._addr:
        self._munmap(self._addr, self._size)
        self._addr = 0


def _discard_ms(stat: Path | None) -> int:
    """Milliseconds the device has spent on discards since boot (0 without a stat file)."""
    return int(stat.read_text().split()[14]) if stat is not None else 0


def run(a) -> list[dict]:
    saved = [(_writer, "PACE_BYTES", _writer.PACE_BYTES),
             (_cleaner, "HINT_SEGMENTS", _cleaner.HINT_SEGMENTS),
             (_budget, "SEAL_BYTES", _budget.SEAL_BYTES),
             (_segments, "SPARE_SEGMENTS", _segments.SPARE_SEGMENTS),
             (_format._ReadOnlyMap, "__del__", _format._ReadOnlyMap.__del__)]
    _writer.PACE_BYTES = int(a.pace_mib * (1 << 20))
    if a.no_hints:
        _cleaner.HINT_SEGMENTS = 0
    if a.seal_mib:
        _budget.SEAL_BYTES = int(a.seal_mib * (1 << 20))
    if a.no_recycle:
        _segments.SPARE_SEGMENTS = 0
    if a.inline_unmap:
        _format._ReadOnlyMap.__del__ = _inline_del
    acc: dict[str, float] = collections.defaultdict(float)
    saved += _timed(acc)
    root = Path(tempfile.mkdtemp(prefix="dsa_seal_tail_", dir=a.workdir))
    n, d, b = a.rows, a.dim, a.batch
    disk = disk_stat_file(root)
    st = dsa_core.create(root / "log", n, d, lr=1e-3, init="normal", storage="log",
                         memory=int(n * (3 * d * 4 + 64) * a.share), progress=False)
    try:
        for lo in range(0, n, b):
            ids = np.arange(lo, min(n, lo + b))
            st = dsa_core.step(st, ids, np.zeros((ids.size, d), np.float32))
        rng = np.random.default_rng(1)
        g = rng.standard_normal((b, d)).astype(np.float32)
        ageing = [rng.integers(0, n, b) for _ in range(int(a.age_passes * n / b))]
        for idx in dsa_core.prefetched(st, ageing):
            st = dsa_core.step(st, idx, g)
        eng = st.store
        work = [rng.integers(0, n, b) for _ in range(a.steps)]
        times, sealed, parts, discard = [], [], [], []
        for idx in dsa_core.prefetched(st, work):
            s0 = eng.log_stats()["seals"]
            acc.clear()
            d0 = _discard_ms(disk)
            t0 = time.perf_counter()
            st = dsa_core.step(st, idx, g)
            times.append(time.perf_counter() - t0)
            discard.append(_discard_ms(disk) - d0)
            sealed.append(eng.log_stats()["seals"] > s0)
            parts.append(dict(acc))
        stats = eng.log_stats()
    finally:
        dsa_core.close(st)
        shutil.rmtree(root, ignore_errors=True)
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
    t = np.array(times) * 1e3
    s = np.array(sealed)
    row = {"rows": n, "dim": d, "batch": b, "share": a.share, "steps": a.steps,
           "pace_mib": a.pace_mib, "hints": not a.no_hints, "inline_unmap": a.inline_unmap,
           "seal_mib": a.seal_mib or _budget.SEAL_BYTES / (1 << 20),
           "mean_ms": float(t.mean()), "p50_ms": float(np.median(t)),
           "p90_ms": float(np.percentile(t, 90)), "p99_ms": float(np.percentile(t, 99)),
           "p99_over_p50": float(np.percentile(t, 99) / np.median(t)),
           "max_ms": float(t.max()), "steps_over_100ms": int((t > 100).sum()),
           "sealing_steps": int(s.sum()),
           "sealing_median_ms": float(np.median(t[s])) if s.any() else float("nan"),
           "other_median_ms": float(np.median(t[~s])) if (~s).any() else float("nan"),
           "clean_waits": int(stats["clean_waits"]), "cleaned_segments":
           int(stats["cleaned_segments"]), "space_used": float(stats["space_used"]),
           "recycled_segments": int(stats["recycled_segments"]),
           "disk_discard_ms": float(sum(discard)) if disk else float("nan")}
    for _, _, label in PARTS:
        v = np.array([p.get(label, 0.0) for p in parts]) * 1e3
        row[f"{label}_sealing_ms"] = float(v[s].mean()) if s.any() else 0.0
        row[f"{label}_other_ms"] = float(v[~s].mean()) if (~s).any() else 0.0
    worst = np.argsort(t)[::-1][:5]
    row["worst"] = "; ".join(
        f"{t[i]:.0f} ms" + (" seal" if s[i] else "")
        + (f" (disk discarding {discard[i]:.0f} ms)" if discard[i] else "") + "".join(
            f" {k}={v * 1e3:.0f}" for k, v in sorted(parts[i].items(), key=lambda kv: -kv[1])[:3])
        for i in worst)
    return [row]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--share", type=float, default=0.25, help="the region's share of the state")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--age-passes", type=float, default=2.0)
    ap.add_argument("--pace-mib", type=float, default=_writer.PACE_BYTES / (1 << 20))
    ap.add_argument("--no-hints", action="store_true")
    ap.add_argument("--inline-unmap", action="store_true")
    ap.add_argument("--seal-mib", type=float, default=0.0)
    ap.add_argument("--no-recycle", action="store_true",
                    help="delete every dead segment file (no spares to overwrite)")
    ap.add_argument("--workdir", default=None, help="where the store goes (default: a temp dir)")
    ap.add_argument("--name", default=None, help="results name (default: seal_tail)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CI)")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.dim, a.batch, a.steps, a.age_passes = 20_000, 16, 256, 40, 2.0
    rows = run(a)
    print_table(rows, ["mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms", "sealing_median_ms",
                       "other_median_ms", "clean_waits", "recycled_segments",
                       "disk_discard_ms"])
    print("slowest steps (top parts, ms):", rows[0]["worst"])
    print_table([{"part": label, "sealing step ms": rows[0][f"{label}_sealing_ms"],
                  "other step ms": rows[0][f"{label}_other_ms"]} for _, _, label in PARTS],
                ["part", "sealing step ms", "other step ms"])
    name = "seal_tail_smoke" if a.smoke else (a.name or "seal_tail")
    path = write_results(name, rows, {"machine": machine(), "args": vars(a)})
    print(f"wrote {path}.json/.csv")


if __name__ == "__main__":
    main()
