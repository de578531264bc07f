"""The public seam of dsa_core: stale States, restore, set_count, records, State properties,
and the rule that nothing outside dsa_core imports its private modules."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import dsa_core
from helpers import log_memory, records

ROOT = Path(__file__).resolve().parents[2]
N, D = 50, 4


def _g(k: int = 1, scale: float = 1.0) -> np.ndarray:
    return np.full((k, D), scale, np.float32)


def _files(p: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(p.iterdir()) if f.is_file()}


# -- a stale State may not step, flush, checkpoint or close -----------------------------------
@pytest.mark.parametrize("durability", ["flush", "step"])
def test_stale_state_cannot_step(tmp_path, durability):
    s0 = dsa_core.create(tmp_path / "s", N, D, init="normal", durability=durability)
    s1 = dsa_core.step(s0, [3], _g())
    assert s1.current and not s0.current
    before = _files(tmp_path / "s")
    with pytest.raises(dsa_core.StaleStateError,
                       match=r"outdated: it is at step 0, but the store has moved on to step 1"):
        dsa_core.step(s0, [3], _g())
    assert _files(tmp_path / "s") == before  # nothing written
    s2 = dsa_core.step(s1, [3], _g())  # the current State goes on
    assert s2.count == 2
    dsa_core.close(s2)
    assert dsa_core.open(tmp_path / "s", mode="r").count == 2


@pytest.mark.parametrize("op", ["step", "flush", "checkpoint", "write_records", "set_count"])
def test_stale_state_cannot_flush_checkpoint_or_close(tmp_path, kind, op):
    """On both kinds (a log store with a region smaller than the table): refused, nothing on
    disk or in the records changes, the current State goes on."""
    kw = {"storage": "log", "memory": log_memory({"num_rows": N, "stride": 3 * D,
                                                  "dtype": "float32"}, 10)} \
        if kind == "log" else {"storage": "inplace"}
    s0 = dsa_core.create(tmp_path / "s", N, D, init="normal", **kw)
    s1 = dsa_core.step(s0, [1, 2], _g(2))
    dsa_core.flush(s1)
    s2 = dsa_core.step(s1, [1], _g())
    before = records(s2)
    manifest = (tmp_path / "s" / "manifest.json").read_text()
    calls = {
        "step": lambda: dsa_core.step(s1, [3], _g()),
        "flush": lambda: dsa_core.flush(s1),
        "checkpoint": lambda: dsa_core.checkpoint(s1, tmp_path / "ck"),
        "write_records": lambda: dsa_core.write_records(s1, [0], dsa_core.read_records(s1, [5])),
        "set_count": lambda: dsa_core.set_count(s1, 7),
    }
    with pytest.raises(dsa_core.StaleStateError, match="outdated.*keep the returned value"):
        calls[op]()
    assert (tmp_path / "s" / "manifest.json").read_text() == manifest  # count 1 on disk
    assert not (tmp_path / "ck").exists()
    np.testing.assert_array_equal(records(s2), before)
    assert not s2.closed and s2.current  # a refused call leaves the store open for s2
    assert s2.storage == kind
    dsa_core.close(s2)
    assert json.loads(manifest)["count"] == 1
    assert dsa_core.open(tmp_path / "s", mode="r").count == 2


def test_replace_of_hyperparameters_stays_current(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D)
    s = dsa_core.step(s, [1], _g())
    t = s._replace(lr=0.5, betas=(0.8, 0.99))
    assert t.current
    t = dsa_core.step(t, [1], _g())
    dsa_core.close(t)
    r = dsa_core.open(tmp_path / "s", mode="r")
    assert (r.count, r.lr, r.betas) == (2, 0.5, (0.8, 0.99))


def test_replace_of_count_is_refused_use_set_count(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D)
    with pytest.raises(dsa_core.StaleStateError):
        dsa_core.step(s._replace(count=5), [1], _g())
    s = dsa_core.set_count(s, 5)
    assert json.loads((tmp_path / "s" / "manifest.json").read_text())["count"] == 5  # durable
    s = dsa_core.step(s, [1], _g())
    assert s.count == 6
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        dsa_core.set_count(s, -1)
    with pytest.raises(ValueError, match="count must be an int >= 0"):
        dsa_core.set_count(s, 2.0)
    dsa_core.close(s)


def test_two_opens_of_one_store_are_refused_by_the_lock_not_the_count(tmp_path):
    """The count lives in the store object: a second writer is the lock's business."""
    s = dsa_core.create(tmp_path / "s", N, D)
    with pytest.raises(dsa_core.StoreLockedError):
        dsa_core.open(tmp_path / "s")
    r = dsa_core.open(tmp_path / "s", mode="r")
    s = dsa_core.step(s, [1], _g())
    assert r.current  # a reader never steps; its count is the manifest's
    dsa_core.close(s)


# -- restore, records --------------------------------------------------------------------
def test_restore_copies_every_record_and_the_count(tmp_path):
    a = dsa_core.create(tmp_path / "a", N, D, init="normal", seed=1)
    for t in range(3):
        a = dsa_core.step(a, [t, 10 + t], _g(2))
    ck = dsa_core.checkpoint(a, tmp_path / "ck")
    a = dsa_core.step(a, [20], _g())
    b = dsa_core.create(tmp_path / "b", N, D, init="normal", seed=2)
    b_old = dsa_core.step(b, [0], _g())
    snap = dsa_core.open(ck, mode="r")
    b = dsa_core.restore(b_old, snap)
    assert b.count == 3 and not b_old.current
    np.testing.assert_array_equal(dsa_core.read_records(b, np.arange(N)),
                                  dsa_core.read_records(snap, np.arange(N)))
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["count"] == 3
    dsa_core.close(snap)
    for s in (a, b):
        dsa_core.close(s)


def test_restore_refuses_another_layout_before_writing(tmp_path):
    a = dsa_core.create(tmp_path / "a", N, D)
    other = dsa_core.create(tmp_path / "o", N, D + 1)
    before = _files(tmp_path / "a")
    with pytest.raises(ValueError, match=r"records move only between stores created the same"):
        dsa_core.restore(a, other)
    assert _files(tmp_path / "a") == before
    for s in (a, other):
        dsa_core.close(s)


def test_records_round_trip_and_bad_records_write_nothing(tmp_path):
    a = dsa_core.create(tmp_path / "a", N, D, init="normal")
    a = dsa_core.step(a, [1, 2], _g(2))
    b = dsa_core.create(tmp_path / "b", N, D)
    rec = dsa_core.read_records(a, [2, 1])
    assert rec.shape == (2, a.layout["stride"])
    dsa_core.write_records(b, [7, 8], rec)
    np.testing.assert_array_equal(dsa_core.gather(b, [7, 8]), dsa_core.gather(a, [2, 1]))
    np.testing.assert_array_equal(b.exp_avg[[7, 8]], a.exp_avg[[2, 1]])
    before = b.store.data.copy()
    with pytest.raises(ValueError, match=r"records must be a \(2, 12\) float32 array"):
        dsa_core.write_records(b, [0, 1], rec[:, :5])
    with pytest.raises(ValueError, match="must not repeat a row"):
        dsa_core.write_records(b, [0, 0], rec)
    with pytest.raises(IndexError, match=r"idx must lie in \[0, num_rows\)"):
        dsa_core.write_records(b, [0, N], rec)
    np.testing.assert_array_equal(b.store.data, before)
    for s in (a, b):
        dsa_core.close(s)


def test_state_properties(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, access="disk")
    assert s.shape == (N, D) and s.writable and not s.closed and s.access == "disk"
    lay = s.layout
    lay["dim"] = 99  # a copy: the store's layout is unchanged
    assert s.layout["dim"] == D
    r = dsa_core.open(tmp_path / "s", mode="r")
    assert not r.writable
    dsa_core.close(s)
    assert s.closed and not s.writable


# -- newcomer traps of issue 18 §5 ---------------------------------------------------------------
def test_init_zeros_is_accepted(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, init="zeros")
    assert not s.weights.any()
    with pytest.raises(ValueError, match=r"one of \('zeros', 'normal', 'uniform'\)"):
        dsa_core.create(tmp_path / "t", N, D, init="ones")
    dsa_core.close(s)


def test_a_store_without_its_manifest_gets_one_consistent_answer(tmp_path):
    """Was a loop: open said "not a store, create one", create said "exists, open it"."""
    s = dsa_core.create(tmp_path / "s", N, D)
    dsa_core.close(s)
    (tmp_path / "s" / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="is damaged: its data file rows.dsa is there "
                       "but its manifest.json is missing"):
        dsa_core.open(tmp_path / "s")
    with pytest.raises(FileExistsError, match="holds a data file .* but no manifest.json: a "
                       "damaged store .* pass overwrite=True"):
        dsa_core.create(tmp_path / "s", N, D)
    s = dsa_core.create(tmp_path / "s", N, D, overwrite=True)  # the way out it names
    dsa_core.close(s)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_during_create_leaves_no_partial_file(tmp_path):
    """Ctrl-C ran the cleanup, SIGTERM did not: rows.dsa.tmp (possibly GBs) stayed behind."""
    code = textwrap.dedent(f"""
        import sys, dsa_core
        from dsa_core._inplace import store as _store
        real = _store._fill
        def slow_fill(*a, **k):
            print("filling", flush=True)
            import time; time.sleep(30)
            real(*a, **k)
        _store._fill = slow_fill
        dsa_core.create({str(tmp_path / 's')!r}, 1000, 8, init="normal")
    """)
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                          cwd=ROOT) as p:
        assert p.stdout.readline().strip() == "filling"
        assert (tmp_path / "s" / "rows.dsa.tmp").exists()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=30)
    assert rc == -signal.SIGTERM  # still ended by the signal, as without the handler
    left = sorted(f.name for f in (tmp_path / "s").iterdir())
    assert "rows.dsa.tmp" not in left and "rows.dsa" not in left, left


def test_sigterm_handler_of_the_program_is_left_alone(tmp_path):
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGTERM, mine)
    try:
        s = dsa_core.create(tmp_path / "s", N, D, init="normal")
        assert signal.getsignal(signal.SIGTERM) is mine
        dsa_core.close(s)
    finally:
        signal.signal(signal.SIGTERM, old)
    assert signal.getsignal(signal.SIGTERM) is old


# -- the seam ------------------------------------------------------------------------------
def _private_core_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        private = [n for n in names if n.split(".")[0] == "dsa_core"
                   and any(p.startswith("_") for p in n.split(".")[1:])]
        if private:
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {private[-1]}")
    return bad


# On purpose under the seam: benchmarks/breakdown.py times the stages inside one step
# (coalescing, the kernel); benchmarks/ooc.py's experiment modes change the store's paging
# ("plain") and write a log beside it ("logprobe"); benchmarks/record_checks.py turns the
# log store's record checks off for its baseline (no public switch on purpose);
# benchmarks/write_path.py times the log store's record sums beside the writes of a seal;
# benchmarks/clean_sim.py drives the log engine to count what its cleaner copies and reads;
# benchmarks/seal_tail.py times the parts of a seal and switches the writer's pace, the
# cleaner's hints and the unmapping thread off for its A/B runs; benchmarks/torch_e2e.py's
# --pace-mib and --cache-mib set the log store's writer pace and its window of cached
# segments for an A/B (its default run uses neither); benchmarks/undo_cost.py turns the
# in-place store's undo file off for its baseline (no public switch on purpose);
# benchmarks/step_ab.py times the phases of one step and the kernel alone, and caps the log
# store's window of cached segments for its A/B. The tests are white-box tests of the core.
# Everything else uses the public API.
INTERNALS_ON_PURPOSE = {"benchmarks/breakdown.py", "benchmarks/ooc.py",
                        "benchmarks/record_checks.py", "benchmarks/write_path.py",
                        "benchmarks/clean_sim.py", "benchmarks/seal_tail.py",
                        "benchmarks/torch_e2e.py", "benchmarks/undo_cost.py",
                        "benchmarks/step_ab.py"}


@pytest.mark.parametrize("folder", ["adapters", "examples", "benchmarks"])
def test_nothing_outside_dsa_core_imports_its_private_modules(folder):
    """The adapters, examples and benchmarks use dsa_core's public API only."""
    bad = [b for f in sorted((ROOT / folder).rglob("*.py"))
           if str(f.relative_to(ROOT)) not in INTERNALS_ON_PURPOSE
           for b in _private_core_imports(f)]
    assert not bad, "private dsa_core imports:\n" + "\n".join(bad)


def test_the_seam_check_catches_a_private_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import dsa_core\nfrom dsa_core._state import restore\nimport dsa_core._step\n"
                 "from dsa_core import _layout\n")
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert len(_private_core_imports(f)) == 3
    finally:
        ROOT = old


def test_no_reference_to_files_users_do_not_have():
    """Docs and docstrings point into docs/, never at the product owner's folder."""
    bad = []
    for f in [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/*.md"),
              *ROOT.glob("dsa_core/*.py"), *ROOT.glob("adapters/*.py"),
              *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py"), ROOT / "Makefile"]:
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if any(k in line for k in ("shared/", "STYLE.md", "STORAGE.md", "ANCHORS.md",
                                       "ALGORITHMS.md", "spec §")):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)

