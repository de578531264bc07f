"""What cleaning a log store costs, counted (not timed): victim choice and what is read.

    python -m benchmarks.clean_sim             # uniform and Zipf ids, both policies, 4 read plans
    python -m benchmarks.clean_sim --smoke         # seconds; CI runs this so the code never rots

Runs the real log engine (``dsa_core._log``) on a small store aged to its space bound (the
steps until it first cleaned, plus ``--warm-passes`` passes over the rows) and counts, per
updated record, over the next ``--passes`` passes: the records cleaning
copied (``cleaned_per_user``), the records and requests its reads cost
(``read_per_user``, ``requests_per_1k_user``) and the records read per record copied
(``read_per_cleaned``, 1.0: only live records read), and what reading every victim whole
would have cost (``whole_segments_per_user``). Every count is deterministic: the
cleaning reads are waited for after every step, so each seal finds the victims read ahead
ready (the regime where the disk keeps up; what a slow disk changes is when a seal waits,
which ``benchmarks.ooc`` measures).

Compared:

* victim choice (``--policies``): ``greedy`` (the lowest live fraction first) against LFS's
  cost-benefit (``age * (1 - u) / (1 + u)``, age in seals since the segment was written);
* what a victim's read covers (``--gaps``, in records of dead data between two live ones that
  are read through rather than skipped): ``whole`` (first to last live record, one span),
  and ``64``, ``8``, ``0`` records. The read request size is capped at an eighth of a seal
  unit (at full size: 4 MiB of 32 MiB segments), as the engine caps it.

A record here is 96 bytes (dim 8): the segments hold a seal unit of ``--slots / 8`` records,
so the gaps are to be read relative to that (a 32 MiB segment of 1,536-byte records holds
21,845; 64 records of its gap are 96 KiB).
Writes ``benchmarks/results/<name>.{json,csv}``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ._common import batches, machine, print_table, write_results


def _step(eng, b: np.ndarray, t: int) -> None:
    rows = np.unique(b)
    slots = eng.acquire(rows)
    eng._pool.region[slots] += 1.0
    eng._commit.count = t
    r = eng._cleaner.reads
    if r is not None:
        r.join()  # every read ahead done before the next seal: deterministic


def run(workdir: Path, dist: str, policy: str, gap: str, a) -> dict:
    from dsa_core import _layout, _log
    from dsa_core._log import read as _read

    lay = _layout.make_layout(a.rows, a.dim, np.float32, 0.0, True, 0)
    path = workdir / f"sim_{dist}_{policy}_{gap}"
    shutil.rmtree(path, ignore_errors=True)
    eng = _log.create(path, lay, memory_bytes=_log.memory_for(lay, a.slots),
                      space_ratio=a.ratio)
    rb = eng.rec_bytes
    saved = (_read.CLEAN_GAP_BYTES, _read.CLEAN_READ_BYTES)
    _read.CLEAN_GAP_BYTES = (1 << 62) if gap == "whole" else int(gap) * rb
    _read.CLEAN_READ_BYTES = max(1, eng.seal_unit // 8) * rb
    eng._cleaner.policy = policy
    steps_per_pass = a.rows // a.batch
    warm = batches(a.rows, a.batch, steps_per_pass * a.max_warm_passes, dist, seed=a.seed)
    counted = batches(a.rows, a.batch, steps_per_pass * a.passes, dist, seed=a.seed + 1)
    try:
        t, aged_at = 0, None
        for b in warm:  # age: until the store has cleaned, then --warm-passes more passes
            t += 1
            _step(eng, b, t)
            if aged_at is None and eng.log_stats()["cleaned_segments"]:
                aged_at = t
            if aged_at is not None and t >= aged_at + steps_per_pass * a.warm_passes:
                break
        st0, v0 = eng.log_stats(), eng._cleaner.victim_records
        for b in counted:
            t += 1
            _step(eng, b, t)
        st, victims = eng.log_stats(), eng._cleaner.victim_records - v0
        assert eng._cleaner.fallbacks == 0
    finally:
        _read.CLEAN_GAP_BYTES, _read.CLEAN_READ_BYTES = saved
        eng.abandon()
        shutil.rmtree(path, ignore_errors=True)
    user = (st["user_bytes"] - st0["user_bytes"]) / rb
    cleaned = (st["cleaned_bytes"] - st0["cleaned_bytes"]) / rb
    read = (st["clean_read_bytes"] - st0["clean_read_bytes"]) / rb
    req = st["clean_read_requests"] - st0["clean_read_requests"]
    return {"dist": dist, "policy": policy, "gap_records": gap,
            "cleaned_per_user": cleaned / user, "read_per_user": read / user,
            "requests_per_1k_user": 1e3 * req / user,
            "read_per_cleaned": read / cleaned if cleaned else float("nan"),
            # what reading every victim whole (the code before issue 28) would have read
            "whole_segments_per_user": victims / user,
            "segments_cleaned": st["cleaned_segments"] - st0["cleaned_segments"],
            "space_used": st["space_used"], "clean_waits": st["clean_waits"],
            "seal_unit": eng.seal_unit, "user_records": int(user),
            "aged_after_steps": aged_at}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--slots", type=int, default=10_000, help="region slots (10%% of rows)")
    ap.add_argument("--batch", type=int, default=1000)
    ap.add_argument("--ratio", type=float, default=2.0, help="space_ratio")
    ap.add_argument("--warm-passes", type=int, default=1,
                    help="passes after the store first cleaned, before counting")
    ap.add_argument("--max-warm-passes", type=int, default=40)
    ap.add_argument("--passes", type=int, default=4, help="passes counted")
    ap.add_argument("--dists", nargs="+", default=["uniform", "zipf"])
    ap.add_argument("--policies", nargs="+", default=["greedy", "cost-benefit"])
    ap.add_argument("--gaps", nargs="+", default=["whole", "64", "8", "0"])
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default="clean_sim")
    a = ap.parse_args(argv)
    if a.smoke:
        a.rows, a.slots, a.batch, a.warm_passes, a.passes = 4000, 400, 100, 1, 1
        a.dists, a.gaps, a.name = ["zipf"], ["whole", "0"], "clean_sim_smoke"
    workdir = Path(tempfile.mkdtemp(dir=a.workdir))
    results = []
    try:
        for dist in a.dists:
            for policy in a.policies:
                for gap in a.gaps:
                    res = run(workdir, dist, policy, gap, a)
                    results.append(res)
                    print(f"  {dist:<7} {policy:<12} gap {gap:>5}: cleaned "
                          f"{res['cleaned_per_user']:.3f} / user record, read "
                          f"{res['read_per_user']:.3f} records and "
                          f"{res['requests_per_1k_user']:.2f} requests per 1k user records "
                          f"({res['read_per_cleaned']:.2f} read per copied)", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print()
    print_table(results, ["dist", "policy", "gap_records", "cleaned_per_user", "read_per_user",
                          "whole_segments_per_user",
                          "requests_per_1k_user", "read_per_cleaned", "segments_cleaned",
                          "space_used", "clean_waits"])
    base = write_results(a.name, results, {"machine": machine(), "args": vars(a)})
    print(f"wrote {base}.json/.csv")


if __name__ == "__main__":
    main()
