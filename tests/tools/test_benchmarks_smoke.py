"""Every benchmark runs end to end at tiny size, so the scripts never rot.

These check that each script runs and writes its table; the figures of a smoke run mean
nothing (the real runs and their numbers are in the README). Each benchmark's ``main(argv)``
runs in this process, as ``python -m benchmarks.<name>`` would run it, with the temp dir, the
working directory and PYTHONPATH its children need; the child processes a benchmark starts
(``ooc``, ``buckets_ooc``, ``torch_e2e``, ``distributed``) are real processes, started with
``python -m benchmarks.<name>`` as in a real run. Running in-process saves an interpreter
with torch, jax and numba per benchmark; it also turns a warning a benchmark's code raises
into a failure (the suite's ``filterwarnings = error``).
"""

import gc
import importlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

# argv of each benchmark's main, the name its results are written under (None: none) and a
# column of the table it prints. The sizes are
# the smallest that still run each code path: e.g. ooc runs one id distribution (the other
# only draws other ids; ``warm`` draws all three) and every store path -- prefetch (the
# in-place step with read-ahead; ``random`` is the same without it), the log store and the
# log probe; torch_e2e runs one share of the log region (the shares differ in the budget
# only) and the implementations that together run every branch of its worker (``dsalog`` and
# ``diskemb`` only combine the branches of ``dsa`` and ``diskemblog``): the first in its own
# child, the others in this process (``--in-process``: an interpreter with torch per worker
# saved).
SMOKES = {
    "warm": (["--smoke"], "warm_smoke", "rows_per_s"),
    "breakdown": (["--smoke"], "breakdown_smoke", "full step"),
    "ooc": (["--smoke", "--dist", "uniform", "--modes", "prefetch", "logprobe", "logprefetch",
             "--kernel-stacks"], "ooc_smoke", "rows_per_s"),
    "torch_e2e": (["--smoke", "--dim", "16", "--batch", "256", "--log-shares", "0.25",
                   "--impls", "torch,dsa,diskemblog,dsaauto", "--in-process"],
                  "torch_e2e_smoke", "rows_per_s"),
    "jax_overhead": (["--ks", "8", "--rows", "2000", "--dim", "8", "--steps", "20",
                      "--warmup", "5"], None, "in jit (rows)"),  # prints its table only
    "durability": (["--smoke"], "durability_smoke", "p50_ms"),
    "group_flush": (["--smoke"], "group_flush_smoke", "x_one"),
    "reduced_state": (["--smoke"], "reduced_state_smoke", "final_heldout"),
    "folio_check": (["--smoke"], "folio_check_smoke", "kib_per_row"),
    "distributed": (["--smoke", "--worlds", "2"], "distributed_smoke", "rows_per_s"),
    "decay_quality": (["--smoke"], "decay_quality_smoke", "test_mse"),
    "log_warm": (["--smoke"], None, "median_ms"),  # writes no result files in smoke mode
    "log_store": (["--smoke"], "log_store_smoke", "write_amplification"),
    "options_cost": (["--smoke", "--kinds", "euclid", "ball", "--options", "adamw", "all"],
                     "options_cost_smoke", "cost_p50"),
    "state_dict_cost": (["--smoke"], None, "state_dict1_s"),
    "step_modules": (["--smoke"], None, "modules"),  # prints its table only
    "parity_sha": (["--smoke"], None, "configurations"),  # prints its count only
    "record_checks": (["--smoke"], "record_checks_smoke", "rows_per_s"),
    "pykeen_parity": (["--smoke"], "pykeen_parity_smoke", "max_abs_dw"),
    "pykeen_ooc": (["--smoke"], "pykeen_ooc_smoke", "first_step_s"),
    "write_path": (["--smoke"], "write_path_smoke", "ms_per_mib"),
    "clean_sim": (["--smoke"], "clean_sim_smoke", "read_per_user"),
    "memory_budget": (["--smoke"], "memory_budget_smoke", "aged_over_base_mib"),
    "seal_tail": (["--smoke"], "seal_tail_smoke", "sealing_median_ms"),
    "undo_cost": (["--smoke"], None, "interval5_ms_per_step"),  # no result files in smoke
    "state_dict_disk": (["--smoke"], None, "run_dir"),  # writes no result files in smoke
    "step_ab": (["--smoke"], None, "rows_per_s"),  # prints its figures only
    "adagrad": (["--smoke"], "adagrad_ooc_smoke", "x_adam_bytes"),
    "big_index": (["--rows", "20000", "--dim", "4", "--steps", "2", "--memory", "16MiB",
                   "--cap", "none", "--no-drop-caches", "--name", "big_index_smoke"],
                  "big_index_smoke", "open (median of 3)"),
    # the index mapped (16 B x 20,000 rows > 300 KiB); one case (zipf: the uniform case only
    # draws other ids), uncapped (the cgroup limit is what the real run adds)
    "big_ooc": (["--rows", "20000", "--dim", "4", "--memory", "300KiB", "--batch", "64",
                 "--steps", "3", "--warmup", "2", "--caches", "0.1", "--dists", "zipf",
                 "--probe-seconds", "0.2", "--cap-none", "--no-drop-caches",
                 "--name", "big_ooc_smoke"], "big_ooc_smoke", "rows_per_s"),
    # the in-process measure (its reference, comparison and results files): ~5 s; every
    # measure once, the out-of-core ones with their cgroup and drive probe (~25 s):
    # test_guard_smoke_every_measure (slow). Without a cgroup or a compiler it falls back
    # (and says so)
    "guard": (["--smoke", "--only", "warm"], "guard_smoke_last", "ratio"),
}
WORKDIR = {"warm": "--workdir", "ooc": "--workdir", "breakdown": "--workdir",
           "reduced_state": "--workdir", "folio_check": "--workdir", "log_store": "--workdir",
           "log_warm": "--workdir", "options_cost": "--workdir", "decay_quality": "--workdir",
           "record_checks": "--workdir", "distributed": "--dir", "torch_e2e": "--dir",
           "durability": "--dir", "group_flush": "--dir", "pykeen_parity": "--workdir",
           "pykeen_ooc": "--workdir",
           "write_path": "--workdir", "clean_sim": "--workdir", "memory_budget": "--workdir",
           "seal_tail": "--workdir", "undo_cost": "--dir", "state_dict_disk": "--dir",
           "guard": "--workdir", "step_ab": "--workdir", "adagrad": "--workdir",
           "big_index": "--workdir", "big_ooc": "--workdir"}


@pytest.fixture
def bench_env(tmp_path, monkeypatch):
    """What ``python -m benchmarks.X`` with TMPDIR=tmp_path from the repository root gives,
    with the results written to ``tmp_path / "results"`` (never benchmarks/results); the
    thread counts a benchmark sets are restored afterwards."""
    from benchmarks import _common

    import dsa_core

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.chdir(ROOT)
    results = tmp_path / "results"
    monkeypatch.setattr(_common, "RESULTS", results)
    threads = dsa_core.get_num_threads()
    torch = importlib.import_module("torch")
    torch_threads = torch.get_num_threads()
    # the objects of this process so far (torch, jax, pykeen, ... imported) out of the
    # collector's way: a benchmark's gc.collect() (warm and folio_check call it ~15-25 times
    # to unmap the stores they closed) then walks only what the benchmark made, not the
    # whole test process (~0.3 s a call here). Garbage that earlier tests left is collected
    # after the unfreeze (a full collection first would cost as much per test)
    gc.freeze()
    try:
        yield results
    finally:
        gc.unfreeze()
        dsa_core.set_num_threads(threads)
        torch.set_num_threads(torch_threads)


@pytest.mark.parametrize("name", sorted(SMOKES))
def test_benchmark_smoke(name, bench_env, tmp_path, capsys):
    if name == "jax_overhead":
        pytest.importorskip("jax")
    if name in ("pykeen_parity", "pykeen_ooc", "adagrad"):  # the pykeen extra
        pytest.importorskip("pykeen")
    if name == "warm":  # geoopt's import warns (torch.jit.script is deprecated): not ours
        pytest.importorskip("geoopt")
    argv, result, column = SMOKES[name]
    argv = [*argv, WORKDIR[name], str(tmp_path)] if name in WORKDIR else list(argv)
    importlib.import_module(f"benchmarks.{name}").main(argv)
    out = capsys.readouterr().out
    assert column in out, out[-3000:]  # its table was printed
    if result is not None:  # and written
        assert json.loads((bench_env / f"{result}.json").read_text())["rows"], out[-3000:]

# "auto" (an in-place store at this size) runs the same script as "log" but for the store's
# kind; in-place stores under bucket order are the default suite's in tests/buckets (12 s here)
@pytest.mark.parametrize("storage", [pytest.param("auto", marks=pytest.mark.slow), "log"])
def test_buckets_ooc_smoke(bench_env, tmp_path, capsys, storage):
    """The partition-ordered benchmark end to end at tiny size, on the store "auto" picks (in
    place at this size) and on a log store: the three phases train (random order, bucket
    order, the bucket order in RAM), the bucket phases step exactly the edges of the buckets
    they finished, the results go to the workdir (never benchmarks/results) and the scratch
    directory is removed."""
    from benchmarks import buckets_ooc

    results = ROOT / "benchmarks" / "results"
    before = {p.name: p.stat().st_mtime_ns for p in results.glob("buckets_ooc*")}
    buckets_ooc.main(["--smoke", "--storage", storage, "--workdir", str(tmp_path)])
    printed = capsys.readouterr().out
    assert "bucket order / random order" in printed and "in RAM" in printed
    out = json.loads((tmp_path / "buckets_ooc_20000x16.json").read_text())
    rnd, bkt, ram = out["rows"]
    assert (rnd["phase"], bkt["phase"], ram["phase"]) == ("random", "bucket", "ram")
    assert out["meta"]["storage"] == ("inplace" if storage == "auto" else "log")
    assert bool(out["meta"]["open_kw"]["train"]) == (storage == "log")  # a region is sized
    assert rnd["steps"] > 0 and rnd["edges_done"] > 0 and rnd["loads"] == 0
    for b in (bkt, ram):
        assert b["steps"] > 0 and b["loads"] > 0 and b["buckets_done"] >= 1
        assert b["edges_done"] == b["edges_expected"]
        assert b["row_updates"] == b["edges_done"] * (2 + b["negatives"])
        assert b["read_ios_per_edge"] >= 0 and "majfaults" in b
    assert out["meta"]["bucketing"]["edges"] == bkt["num_edges"]
    assert not (tmp_path / "dsa_buckets_ooc_20000x16").exists()
    after = {p.name: p.stat().st_mtime_ns for p in results.glob("buckets_ooc*")}
    assert after == before


def test_buckets_quality_smoke(bench_env, tmp_path, capsys):
    """The bucket-order quality benchmark (which trains examples.graph_buckets) at tiny size:
    both orders and the no-hints arm run and their results are written."""
    from benchmarks import buckets_quality

    buckets_quality.main(["--smoke", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "bucket" in out and "random" in out
    assert (tmp_path / "buckets_quality_smoke.json").is_file()
    assert (tmp_path / "buckets_quality_smoke.csv").is_file()
    lines = (tmp_path / "buckets_quality_smoke.csv").read_text().splitlines()
    orders = {line.split(",")[lines[0].split(",").index("order")] for line in lines[1:]}
    # + the KG arms, with PyKEEN; bucket_pool: the library's default negatives (a pool)
    assert {"random", "bucket", "bucket_mixed", "bucket_pool", "bucket_no_hints"} <= orders


@pytest.mark.slow  # four measures in child processes (~25 s of CPU here)
def test_guard_smoke_every_measure(bench_env, tmp_path, capsys):
    importlib.import_module("benchmarks.guard").main(["--smoke", "--workdir", str(tmp_path)])
    out = capsys.readouterr().out
    for measure in ("warm", "torch 100%", "torch 25%", "ooc", "random"):
        assert measure in out, out[-3000:]
    assert json.loads((bench_env / "guard_smoke_last.json").read_text())["rows"]


def test_guard_compare_flags_what_fell():
    """The guard's comparison, nothing timed: a ratio more than 10% below the reference's is
    SLOWER (10% exactly is not), I/Os per row 10% above it MORE I/O, a failed measure
    FAILED; rows without an anchor compare their values and are never flagged; a measure
    the reference lacks, or no reference at all, has nothing to compare with."""
    from benchmarks.guard import _row, compare, table

    reference = {"rows": [
        _row("warm", 3.0e6, "rows/s", 3.0e6, "memory probe", 1.0),
        _row("torch 100%", 9e5, "rows/s", 3e5, "SparseAdam", 3.0),
        _row("ooc", 9e4, "rows/s", 1e5, "drive QD256", 0.95),
        _row("random I/O", 1.0, "I/Os per row", ratio=1.0),
        _row("drive QD256", 9e4, "reads/s"),
        _row("random", 5e4, "rows/s", 1e5, "drive QD256", 0.5)]}

    def rows():
        return [_row("warm", 2.6e6, "rows/s", 3.0e6, "memory probe", 0.85),  # -15%
                _row("torch 100%", 8.1e5, "rows/s", 3e5, "SparseAdam", 2.7),  # -10% exactly
                _row("ooc", 9.9e4, "rows/s", 1e5, "drive QD256", 0.99),  # faster
                _row("random I/O", 1.2, "I/Os per row", ratio=1.2),  # +20% I/Os
                _row("drive QD256", 4.5e4, "reads/s"),  # the drive at half: a value, no flag
                _row("torch 25%", 4e5, "rows/s", 3e5, "SparseAdam", 1.33),  # not in the ref
                {**_row("random", None, ""), "error": "random child failed"}]

    got = {r["measure"]: r for r in compare(rows(), reference)}
    assert {m: r["flag"] for m, r in got.items()} == {
        "warm": "SLOWER", "torch 100%": "", "ooc": "", "random I/O": "MORE I/O",
        "drive QD256": "", "torch 25%": "", "random": "FAILED"}
    assert got["warm"]["reference"] == 1.0 and abs(got["warm"]["change"] + 0.15) < 1e-12
    assert abs(got["ooc"]["change"] - (0.99 / 0.95 - 1)) < 1e-12
    assert got["drive QD256"]["reference"] == 9e4 and got["drive QD256"]["change"] == -0.5
    assert got["torch 25%"]["reference"] is None and got["torch 25%"]["change"] is None
    text = table(list(got.values()))
    for word in ("SLOWER", "MORE I/O", "FAILED", "-15.0%", "-50.0% (value)"):
        assert word in text, text
    # no reference: nothing flagged but the failure
    alone = compare(rows(), None)
    assert [r["flag"] for r in alone] == [""] * 6 + ["FAILED"]
    assert all(r["reference"] is None for r in alone)


def test_drive_probe_reads_beside_a_paced_writer(tmp_path):
    """``drive_probe.c`` (the guard's anchor for ``ooc``): random 4 KiB reads over the files
    given, and with ``--write`` a thread writing another file sequentially at a set rate at
    most, round within its size (the guard's ``ooc beside its writes``); a write file that
    is not there is refused and ``drive_rate`` says so with None."""
    from benchmarks import probes

    binary, how = probes.build_drive_probe(tmp_path)
    if binary is None:
        pytest.skip(f"no drive probe here: {how}")
    reads = tmp_path / "r.dat"
    reads.write_bytes(np.random.default_rng(0).bytes(1 << 20))
    wfile = tmp_path / "w.dat"
    wfile.write_bytes(bytes(2 << 20))
    alone = probes.drive_rate([reads], 4, 0.2, binary)
    assert alone["tool"] == "drive_probe.c" and alone["reads_per_s"] > 0
    assert "written_mb_per_s" not in alone
    both = probes.drive_rate([reads], 4, 0.3, binary, write=(wfile, 20.0))
    assert both["reads_per_s"] > 0
    # paced: 20 MB/s at most, plus the first 1 MiB write, which goes at once
    assert 0 < both["written_mb_per_s"] <= 20.0 + 1.05 / 0.3
    assert wfile.stat().st_size == 2 << 20  # written round inside the file, never past it
    assert reads.read_bytes() == np.random.default_rng(0).bytes(1 << 20)  # only read
    assert probes.drive_rate([reads], 4, 0.1, binary, write=(tmp_path / "none", 20.0)) is None


def test_torch_e2e_omp_wait_policy_reaches_its_workers(monkeypatch, tmp_path):
    """``--omp-wait-policy passive`` starts each worker with ``OMP_WAIT_POLICY=PASSIVE`` in
    its environment (libgomp reads it when torch loads: the worker's, not this process's);
    without the flag the worker inherits this environment unchanged; with ``--in-process``
    (workers in this process, torch already loaded) the flag is refused."""
    import subprocess

    from benchmarks import torch_e2e

    seen = []

    def fake_run(cmd, **kw):
        seen.append(kw["env"])
        row = {"rows_per_s": 1.0, "impl": cmd[cmd.index("--worker") + 1]}
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(row) + "\n", stderr="")

    monkeypatch.setattr(torch_e2e.subprocess, "run", fake_run)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    args = torch_e2e.argparse.Namespace(
        rows=10, dim=4, batch=2, steps=1, warmup=0, dist="uniform", device="cpu",
        predirty=False, fill=False, written=False, compile=False, second_moment="elementwise",
        first_moment="full", dir=str(tmp_path), pace_mib=-1.0, cache_mib=-1.0,
        omp_wait_policy="passive")
    torch_e2e._child("torch", args)
    args.omp_wait_policy = None
    torch_e2e._child("torch", args)
    assert seen[0]["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in seen[1] and seen[1]["PATH"] == os.environ["PATH"]
    with pytest.raises(SystemExit):
        torch_e2e.main(["--smoke", "--in-process", "--omp-wait-policy", "passive"])


def test_ooc_fio_names_fit_fios_limit():
    """fio refuses a ``--filename`` value over 4,096 characters (a log store's ~500 segment
    files): the probe then names every k-th file, the smallest k that fits, first file kept;
    a list that fits is named whole; a single name too long for fio gives no fio probe
    (the benchmark then probes with pread)."""
    from benchmarks.ooc import FIO_MAX_VALUE, fio_filenames

    few = [Path(f"/s/seg-{i:08d}.dsl") for i in range(10)]
    assert fio_filenames(few) == (":".join(map(str, few)), 1)
    many = [Path(f"/var/tmp/ooc/store_log/seg-{i:08d}.dsl") for i in range(527)]
    value, k = fio_filenames(many)
    assert len(value) <= FIO_MAX_VALUE < len(":".join(map(str, many[::k - 1])))
    assert value.split(":") == [str(f) for f in many[::k]] and k > 1
    assert fio_filenames([Path("/" + "x" * FIO_MAX_VALUE)]) == (None, 0)
