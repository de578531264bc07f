"""Every benchmark runs end to end at tiny size, so the scripts never rot.

These check that each script runs and writes its table; the figures of a smoke run mean
nothing (the real runs and their numbers are in the README).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKES = {
    "warm": ["--smoke"],
    "breakdown": ["--smoke"],
    "ooc": ["--smoke", "--modes", "random", "prefetch", "logprobe", "logprefetch",
            "--kernel-stacks"],
    "torch_e2e": ["--smoke"],
    "jax_overhead": ["--ks", "8", "--rows", "2000", "--dim", "8", "--steps", "20",
                     "--warmup", "5"],
    "durability": ["--smoke"],
    "reduced_state": ["--smoke"],
    "folio_check": ["--smoke"],
    "distributed": ["--smoke"],  # writes distributed_smoke.*, never the committed results
    "decay_quality": ["--smoke"],  # its stores go to TMPDIR (tmp_path)
    "log_warm": ["--smoke"],  # writes no result files in smoke mode
    "log_store": ["--smoke"],
    "state_dict_cost": ["--smoke"],  # its stores go to TMPDIR (tmp_path)
}


@pytest.mark.parametrize("name", sorted(SMOKES))
def test_benchmark_smoke(name, tmp_path):
    if name == "jax_overhead":
        pytest.importorskip("jax")
    args = list(SMOKES[name])
    if name in ("warm", "ooc", "breakdown", "reduced_state", "folio_check", "log_store"):
        args += ["--workdir", str(tmp_path)]
    if name == "distributed":
        args += ["--dir", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=env, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rows" in r.stdout.lower() or "µs" in r.stdout or "us" in r.stdout


def test_buckets_ooc_smoke(tmp_path):
    """The partition-ordered benchmark end to end at tiny size: both phases train, the bucket
    phase steps exactly the edges of the buckets it finished, the results go to the workdir
    (never benchmarks/results) and the scratch directory is removed."""
    import json

    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("buckets_ooc*")}
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-m", "benchmarks.buckets_ooc", "--smoke",
                        "--workdir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env=env, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bucket order / random order" in r.stdout
    out = json.loads((tmp_path / "buckets_ooc_20000x16.json").read_text())
    rnd, bkt = out["rows"]
    assert (rnd["phase"], bkt["phase"]) == ("random", "bucket")
    assert rnd["steps"] > 0 and rnd["edges_done"] > 0 and rnd["loads"] == 0
    assert bkt["steps"] > 0 and bkt["loads"] > 0 and bkt["buckets_done"] >= 1
    assert bkt["edges_done"] == bkt["edges_expected"]
    assert bkt["row_updates"] == bkt["edges_done"] * (2 + bkt["negatives"])
    assert out["meta"]["bucketing"]["edges"] == bkt["num_edges"]
    assert not (tmp_path / "dsa_buckets_ooc_20000x16").exists()
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("buckets_ooc*")}
    assert after == before
