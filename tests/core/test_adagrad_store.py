"""Adagrad and row-wise Adagrad stores (``dsa_core.create(optimizer=...)``, docs/algorithms.md
§7.5) on both store kinds: ``dsa_core.step`` against ``torch.optim.Adagrad`` on
``nn.Embedding(sparse=True)`` gradients and against PyTorch-BigGraph's ``RowAdagrad``
(tests/core/test_adagrad_kernels.py's transcription); a log store with a small region gives
the in-place store's bytes; persistence (flush, reopen, checkpoint, restore, convert); a
full disk; the optimizer remembered by the store; and the refusals, which change nothing.

The kernels themselves (every rounding) are tests/core/test_adagrad_kernels.py's; the kill -9
trials with Adagrad layouts are tests/inplace/test_unclean_inplace.py's.
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import assert_same_bits, create, on_disk, os_fault, records
from test_adagrad_kernels import pbg_run, torch_adagrad_run, ulps

import dsa_core

N, D = 80, 16
OPTS = ("adagrad", "rowwise_adagrad")
SLOTS = 30  # a log store's region: fewer slots than rows, so steps evict and seal
TORCH_CFGS = {
    "default": {"lr": 0.01},
    "decay-iav-max": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.05,
                      "maximize": True, "eps": 1e-3},
}


def init_weights(dtype, seed=0, n=N, d=D):
    return (0.1 * np.random.default_rng(seed).standard_normal((n, d))).astype(dtype)


def acc(state) -> np.ndarray:
    """The accumulators of every row (read_records: both kinds)."""
    lay = state.layout
    return records(state)[:, lay["v"]:lay["v"] + lay["v_width"]]


def weights(state) -> np.ndarray:
    return dsa_core.gather(state, np.arange(state.num_rows))


def make(path, kind, optimizer, init, **kw):
    return create(path, init.shape[0], init.shape[1], kind, slots=SLOTS, init=init,
                  optimizer=optimizer, dtype=init.dtype.name, **kw)


def stream(dtype, seed=1, steps=12, n=N, d=D):
    """Batches of at most 24 ids (a log store's region of SLOTS holds any of them): unsorted
    with duplicates, sorted unique, empty, one id repeated; gradient scales 1e-3 to 10."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        kind = t % 4
        if kind == 0:
            idx = rng.integers(0, n, 24)
        elif kind == 1:
            idx = np.sort(rng.choice(n, 20, replace=False))
        elif kind == 2:
            idx = np.full(5, rng.integers(n)) if t % 8 == 2 else np.empty(0, np.int64)
        else:
            idx = rng.integers(0, n, 16)
        scale = 10.0 ** rng.uniform(-3, 1)
        out.append((idx.astype(np.int64),
                    (scale * rng.standard_normal((idx.size, d))).astype(dtype)))
    return out


# -- parity with the anchors ---------------------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("cfg", TORCH_CFGS)
@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_step_is_torch_adagrad(tmp_path, kind, dt, cfg):
    """``dsa_core.step`` on an Adagrad store against ``torch.optim.Adagrad`` over 12 steps
    (duplicates, empty batches, lr_decay, initial_accumulator_value, maximize), fed torch's
    coalesced gradient: accumulators bit for bit (a row at 0 reads as fl(iav), as torch's
    sum holds it), weights within 3 ulp of the largest weight (torch's square root is not
    correctly rounded: test_adagrad_kernels.py measured at most 0.92 ulp), float64 within
    1e-10."""
    dtype = np.dtype(dt)
    init = init_weights(dtype)
    kw = TORCH_CFGS[cfg]
    s = make(tmp_path / "s", kind, "adagrad", init, **kw)
    iav = dtype.type(kw.get("initial_accumulator_value", 0.0))
    for t, (W, Sum, ui, gv) in enumerate(torch_adagrad_run(init, stream(dtype), **kw), 1):
        s = dsa_core.step(s, ui, gv)
        a = acc(s)
        a = np.where(a == 0, iav, a)
        np.testing.assert_array_equal(a, Sum, err_msg=f"t={t}")
    assert s.count == 12
    P = weights(s)
    diff = np.abs(P.astype(np.float64) - W).max()
    assert diff <= 3 * np.finfo(dtype).eps * np.abs(W).max(), diff
    if dtype == np.float64:
        np.testing.assert_allclose(P, W, rtol=0, atol=1e-10)
    dsa_core.close(s)


@pytest.mark.torch
@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_step_is_pbg_row_adagrad(tmp_path, kind, dt):
    """A ``rowwise_adagrad`` store against PBG's ``RowAdagrad`` (the kernel tests'
    transcription, with lr_decay) over 12 steps: accumulators within 8 ulp, weights within
    6 ulp of the largest (the kernel tests' measured bounds: torch's row mean and square
    root)."""
    dtype = np.dtype(dt)
    init = init_weights(dtype, seed=2, d=37)
    kw = {"lr": 0.1, "lr_decay": 0.01}
    s = make(tmp_path / "s", kind, "rowwise_adagrad", init, **kw)
    for idx, G in stream(dtype, seed=3, d=37):
        s = dsa_core.step(s, idx, G)
    *_, (W, Sum, _, _) = pbg_run(init, stream(dtype, seed=3, d=37), **kw)
    assert ulps(acc(s), Sum) <= 8
    diff = np.abs(weights(s).astype(np.float64) - W).max()
    assert diff <= 6 * np.finfo(dtype).eps * np.abs(W).max(), diff
    dsa_core.close(s)


@pytest.mark.parametrize("opt", OPTS)
def test_log_store_with_evictions_is_in_place_bytes(tmp_path, opt):
    """The same steps on an in-place store and on a log store whose region holds 30 of 80
    rows (records leave it and come back from segments): the same records, bit for bit, and
    after a reopen too. weights=False: the caller's rows updated alike."""
    init = init_weights(np.float32, seed=4)
    kw = {"lr": 0.05, "initial_accumulator_value": 0.1,
          **({"weight_decay": 0.01} if opt == "rowwise_adagrad" else {})}
    a = make(tmp_path / "a", "inplace", opt, init, **kw)
    b = make(tmp_path / "b", "log", opt, init, **kw)
    for idx, G in stream(np.float32, seed=5, steps=18):
        a, b = dsa_core.step(a, idx, G), dsa_core.step(b, idx, G)
    assert_same_bits(records(a), records(b))
    assert b.store.stats()["segments"] >= 1
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "b", memory=b.store.memory_bytes)
    assert_same_bits(records(a), records(b))
    assert (b.optimizer, b.lr, b.initial_accumulator_value) == (opt, 0.05, 0.1)
    dsa_core.close(a)
    dsa_core.close(b)


def test_weights_false_store_updates_the_callers_rows(tmp_path, kind):
    """``weights=False``: the accumulator is the whole record; ``params=`` rows (duplicates
    all receive the new row) and ``table=`` give the weights-in-store result."""
    init = init_weights(np.float32, seed=6)
    full = make(tmp_path / "full", kind, "adagrad", init, lr=0.1)
    bare = create(tmp_path / "bare", N, D, kind, init=None, weights=False, optimizer="adagrad",
                  lr=0.1)
    assert bare.layout["stride"] == D and bare.layout["v"] == 0
    table = init.copy()
    for idx, G in stream(np.float32, seed=7, steps=6):
        full = dsa_core.step(full, idx, G)
        rows = table[idx].copy()
        bare = dsa_core.step(bare, idx, G, params=rows)
        table[idx] = rows
    assert_same_bits(table, weights(full))
    assert_same_bits(acc(bare), acc(full))
    dsa_core.close(full)
    dsa_core.close(bare)


# -- persistence -----------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", OPTS)
def test_reopen_checkpoint_restore_convert(tmp_path, kind, opt):
    """Flush + reopen resumes with the recorded hyperparameters and count (the next step as
    without the reopen); a checkpoint restores bit for bit; convert to the other kind gives
    the same bytes and trains identically; read_records/write_records move records."""
    init = init_weights(np.float64, seed=8)
    kw = {"lr": 0.2, "lr_decay": 0.05, "initial_accumulator_value": 0.01, "eps": 1e-6,
          "maximize": True, "nonfinite": "skip_row"}
    steps = stream(np.float64, seed=9, steps=10)
    ref = make(tmp_path / "ref", kind, opt, init, **kw)
    for idx, G in steps:
        ref = dsa_core.step(ref, idx, G)
    s = make(tmp_path / "s", kind, opt, init, **kw)
    for idx, G in steps[:4]:
        s = dsa_core.step(s, idx, G)
    ck = dsa_core.checkpoint(s, tmp_path / "ck")
    dsa_core.close(s)
    s = dsa_core.open(tmp_path / "s", optimizer=opt)
    assert (s.count, s.optimizer, s.betas) == (4, opt, None)
    assert (s.lr, s.lr_decay, s.initial_accumulator_value, s.eps, s.maximize, s.nonfinite) \
        == (0.2, 0.05, 0.01, 1e-6, True, "skip_row")
    for idx, G in steps[4:]:
        s = dsa_core.step(s, idx, G)
    assert_same_bits(records(s), records(ref))
    snap = dsa_core.open(ck, mode="r")
    s = dsa_core.restore(s, snap)
    dsa_core.close(snap)
    assert s.count == 4
    other = "log" if kind == "inplace" else "inplace"
    c = dsa_core.convert(s, tmp_path / "c", storage=other)
    assert (c.storage, c.optimizer, c.count, c.lr_decay) == (other, opt, 4, 0.05)
    assert_same_bits(records(c), records(s))
    for idx, G in steps[4:]:
        s, c = dsa_core.step(s, idx, G), dsa_core.step(c, idx, G)
    assert_same_bits(records(s), records(ref))
    assert_same_bits(records(c), records(ref))
    rec = dsa_core.read_records(ref, [3, 7])
    dsa_core.write_records(s, [7, 3], rec[::-1])
    assert_same_bits(dsa_core.read_records(s, [3, 7]), rec)
    for st in (s, c, ref):
        dsa_core.close(st)


@pytest.mark.parametrize("opt", OPTS)
def test_full_disk_at_a_flush(tmp_path, kind, opt):
    """ENOSPC at the first ``_os.pwrite_all`` of a flush (the log store's segment or index,
    the in-place store's manifest): the error says so, the directory reopens (as after a
    kill -9 then) at the last flush bit for bit, and once space is back the same State
    flushes and ends with the records of a run that met no fault."""
    init = init_weights(np.float32, seed=10)
    steps = stream(np.float32, seed=11, steps=9)
    ref = make(tmp_path / "ref", kind, opt, init, lr=0.1)
    at = []
    for idx, G in steps:
        ref = dsa_core.step(ref, idx, G)
        at.append(records(ref))
    s = make(tmp_path / "s", kind, opt, init, lr=0.1)
    for idx, G in steps[:3]:
        s = dsa_core.step(s, idx, G)
    dsa_core.flush(s)
    for idx, G in steps[3:6]:
        s = dsa_core.step(s, idx, G)
    with os_fault("pwrite_all", 1) as f, pytest.raises(OSError) as e:
        dsa_core.flush(s)
    assert f.failed and e.value.errno == errno.ENOSPC, e.value
    count, recs = on_disk(tmp_path / "s", tmp_path / "disk")
    assert count == 3
    assert_same_bits(recs, at[2])
    for idx, G in steps[6:]:
        s = dsa_core.step(s, idx, G)
    dsa_core.flush(s)
    assert_same_bits(records(s), at[-1])
    dsa_core.close(s)
    count, recs = on_disk(tmp_path / "s", tmp_path / "disk")
    assert count == 9
    assert_same_bits(recs, at[-1])
    dsa_core.close(ref)


# -- the optimizer is the store's -------------------------------------------------------------
def _files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_another_optimizer_is_refused_and_nothing_changes(tmp_path, kind):
    """Opening, restoring, converting with another optimizer: clear errors, and the store's
    files are byte-identical afterwards."""
    s = create(tmp_path / "g", N, D, kind, optimizer="adagrad", lr=0.1)
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    a = create(tmp_path / "a", N, D, kind)
    a = dsa_core.step(a, [1, 2], np.ones((2, D), np.float32))
    dsa_core.flush(a)
    dsa_core.close(s)
    before = _files(tmp_path / "g")
    for want in ("adam", "rowwise_adagrad"):
        with pytest.raises(ValueError, match=f"created with optimizer='adagrad', not '{want}'"):
            dsa_core.open(tmp_path / "g", optimizer=want)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        dsa_core.open(tmp_path / "g", optimizer="sgd")
    g = dsa_core.open(tmp_path / "g", mode="r", optimizer="adagrad")
    with pytest.raises(ValueError, match="holds adagrad's state .* records move only"):
        dsa_core.restore(a, g)
    with pytest.raises(ValueError, match="convert: store .* optimizer='adagrad', not 'adam'"):
        dsa_core.convert(g, tmp_path / "c", storage="log", optimizer="adam")
    assert not (tmp_path / "c").exists()
    if kind == "inplace":  # the whole-table views (a log store has none)
        with pytest.raises(ValueError, match="optimizer='adagrad' and keeps no exp_avg"):
            g.exp_avg  # noqa: B018
        with pytest.raises(ValueError, match="keeps no Adagrad accumulator"):
            a.accumulator  # noqa: B018
    dsa_core.close(g)
    assert _files(tmp_path / "g") == before
    dsa_core.close(a)


def _manifest_versions(tmp_path, storage: str) -> tuple[int, int]:
    """The manifest versions of a row-wise Adagrad store ``g`` and an Adam store ``a`` of
    ``storage``, made (and closed) in ``tmp_path``."""
    out = []
    for name, opt in (("g", "rowwise_adagrad"), ("a", "adam")):
        dsa_core.close(dsa_core.create(tmp_path / name, N, D, optimizer=opt, storage=storage))
        out.append(json.loads((tmp_path / name / "manifest.json").read_text())["version"])
    return out[0], out[1]


def test_format_version_5_and_older_readers(tmp_path, monkeypatch):
    """An Adagrad store is format version 5 (manifest and data-file header); Adam stores keep
    theirs. A dsa_core that reads only versions up to 4 refuses it with "Upgrade dsa_core"."""
    from dsa_core import _layout
    from dsa_core._inplace import store as inplace_store

    assert _manifest_versions(tmp_path, "inplace") == (5, 1)
    head = (tmp_path / "g" / "rows.dsa").read_bytes()[:16]
    assert int.from_bytes(head[8:12], "little") == 5
    assert _layout.FORMAT_VERSION == 5
    monkeypatch.setattr(_layout, "FORMAT_VERSION", 4)
    monkeypatch.setattr(inplace_store, "FORMAT_VERSION", 4)
    with pytest.raises(ValueError, match="format version 5.*Upgrade dsa_core"):
        dsa_core.open(tmp_path / "g")


def test_log_store_manifest_names_no_betas(tmp_path):
    """A log store's manifest keeps its own format version, so an Adagrad log store records
    Adagrad's hyperparameters without Adam's betas: a dsa_core from before Adagrad (which
    reads betas) refuses its manifest rather than stepping Adam on an accumulator."""
    s = dsa_core.create(tmp_path / "g", N, D, optimizer="adagrad", storage="log")
    dsa_core.close(s)
    m = json.loads((tmp_path / "g" / "manifest.json").read_text())
    hp = m["meta"]["hparams"] if "meta" in m else m["hparams"]
    assert hp["optimizer"] == "adagrad" and "betas" not in hp
    assert m["layout"]["optimizer"] == "adagrad" and "m" not in m["layout"]


def test_log_store_manifest_version_7_and_older_readers(tmp_path, monkeypatch):
    """Log manifests are version 7 (an index base that may list only its written rows),
    Adagrad's and Adam's: a dsa_core that reads log manifests up to version 3 (before
    Adagrad), 4 (before ``index_from``), 5 (before segment format 3) or 6 (before sparse
    index bases) refuses an Adagrad store with "Upgrade dsa_core"."""
    from dsa_core._log import format as log_format

    assert _manifest_versions(tmp_path, "log") == (7, 7)
    for upto in (3, 4, 5, 6):
        monkeypatch.setattr(log_format, "READ_VERSIONS", log_format.READ_VERSIONS[:upto])
        with pytest.raises(ValueError, match="format version 7.*Upgrade dsa_core"):
            dsa_core.open(tmp_path / "g")


# -- refusals at create and at step ----------------------------------------------------------------
@pytest.mark.parametrize(("kw", "match"), [
    ({"curvature": 1.0}, "curvature must be 0"),
    ({"per_row_step": True}, "does not take per_row_step=True: it is the per-row bias"),
    ({"decay_missed_steps": True}, "does not take decay_missed_steps=True"),
    ({"decoupled_weight_decay": True}, "does not take decoupled_weight_decay=True"),
    ({"first_moment": "bfloat16"}, "has no first moment"),
    ({"second_moment": "rowwise"}, "second_moment='rowwise' is Adam's.*rowwise_adagrad"),
    ({"betas": (0.9, 0.99)}, "has no betas"),
    ({"weight_decay": 0.1}, "weight_decay option is not compatible with sparse gradients"),
    ({"lr": -1.0}, "Invalid learning rate: -1.0"),
    ({"lr_decay": -0.1}, "Invalid lr_decay value: -0.1"),
    ({"initial_accumulator_value": -1}, "Invalid initial_accumulator_value value: -1.0"),
    ({"eps": -1e-10}, "Invalid epsilon value: -1e-10"),
    ({"eps": 0.0}, "Invalid epsilon value: 0.0"),
    ({"lr_decay": float("nan")}, "Invalid lr_decay value: nan"),
])
def test_create_refuses(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        dsa_core.create(tmp_path / "s", N, D, optimizer="adagrad", **kw)
    assert not (tmp_path / "s" / "manifest.json").exists()


def test_create_refuses_other_options(tmp_path):
    """Row-wise takes L2 weight decay (FBGEMM's) but not decoupled; Adam takes no Adagrad
    hyperparameters; an unknown optimizer names the three."""
    s = dsa_core.create(tmp_path / "r", N, D, optimizer="rowwise_adagrad", weight_decay=0.1)
    assert s.weight_decay == 0.1
    dsa_core.close(s)
    with pytest.raises(ValueError, match="decoupled_weight_decay=True: decoupled"):
        dsa_core.create(tmp_path / "x", N, D, optimizer="rowwise_adagrad", weight_decay=0.1,
                        decoupled_weight_decay=True)
    with pytest.raises(ValueError, match="lr_decay and initial_accumulator_value are Adagrad's"):
        dsa_core.create(tmp_path / "x", N, D, lr_decay=0.1)
    with pytest.raises(ValueError, match=r"optimizer must be one of \('adam', 'adagrad'"):
        dsa_core.create(tmp_path / "x", N, D, optimizer="sgd")
    # eps defaults per optimizer; Adam's default create is unchanged
    s = dsa_core.create(tmp_path / "e", N, D, optimizer="adagrad")
    a = dsa_core.create(tmp_path / "a", N, D)
    assert (s.eps, a.eps, a.betas, s.betas) == (1e-10, 1e-8, (0.9, 0.999), None)
    assert "optimizer" not in a.layout and a.optimizer == "adam"
    dsa_core.close(s)
    dsa_core.close(a)


def test_bad_step_changes_nothing(tmp_path, kind):
    """Refused steps (a bad id, a wrong dtype, weight decay put on an elementwise store, a
    negative lr_decay, nonfinite='raise') leave the store's records and count as they were."""
    s = create(tmp_path / "s", N, D, kind, optimizer="adagrad", lr=0.1, nonfinite="raise")
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    dsa_core.flush(s)
    before = records(s)
    bad = np.ones((1, D), np.float32)
    nan = bad.copy()
    nan[0, 3] = np.nan
    for state, idx, g, err, match in [
        (s, [N], bad, IndexError, "idx must lie in"),
        (s, [1], bad.astype(np.float64), TypeError, "store dtype float32"),
        (s._replace(weight_decay=0.1), [1], bad, ValueError, "not compatible with sparse"),
        (s._replace(lr_decay=-1.0), [1], bad, ValueError, "lr_decay .* >= 0"),
        (s, [1], nan, FloatingPointError, "NaN or Inf"),
    ]:
        with pytest.raises(err, match=match):
            dsa_core.step(state, idx, g)
    assert_same_bits(records(s), before)
    assert s.current and s.count == 1
    dsa_core.close(s)


def test_info_shows_the_optimizer(tmp_path):
    """``python -m dsa_core info`` names the optimizer and Adagrad's hyperparameters."""
    s = dsa_core.create(tmp_path / "g", N, D, optimizer="rowwise_adagrad", lr=0.1,
                        lr_decay=0.5, storage="inplace")
    dsa_core.close(s)
    r = subprocess.run([sys.executable, "-m", "dsa_core", "info", "--json", str(tmp_path / "g")],
                       capture_output=True, text=True, check=True)
    info = json.loads(r.stdout)
    assert info["optimizer"] == "rowwise_adagrad" and info["lr_decay"] == 0.5
    assert info["betas"] is None and info["format_version"] == 5
    assert info["geometry"] == "euclidean (row-wise Adagrad)"


def test_accumulator_view_and_warmup(tmp_path):
    """``State.accumulator`` is the in-place store's view of the sums; warmup compiles the
    Adagrad kernels (no new specialisation at the first step)."""
    from dsa_core import _kernels_adagrad as K

    dsa_core.warmup(("float32",), readonly=False)
    n = len(K.adagrad_rows.signatures)
    s = dsa_core.create(tmp_path / "s", N, D, optimizer="adagrad", storage="inplace")
    s = dsa_core.step(s, [3], np.ones((1, D), np.float32))
    assert len(K.adagrad_rows.signatures) == n
    assert s.accumulator.shape == (N, D) and (s.accumulator[3] == 1).all()
    assert s.second_moment == "elementwise"
    dsa_core.close(s)


@pytest.mark.parametrize("opt", OPTS)
def test_bucket_order_trains_an_adagrad_store(tmp_path, kind, opt):
    """``dsa_core.buckets`` loads and releases an Adagrad store's partitions (a log store's
    region holds c + 1 of them) and the hints change no value: the same batches without
    ``stores=`` give the same records."""
    from dsa_core import buckets

    n = 400
    edges = np.random.default_rng(12).integers(0, n, size=(1200, 2))
    plan = buckets.plan(edges, n, partitions=4, buffer=2, seed=0)
    kw = {"lr": 0.1, "init": "normal", "init_scale": 0.1, "optimizer": opt}
    if kind == "log":
        kw["memory"] = dsa_core.region_memory(
            {"num_rows": n, "stride": D + (D if opt == "adagrad" else 1), "dtype": "float32"},
            n // 4 * 3 + 128)  # c + 1 partitions beside one step's rows
    a = dsa_core.create(tmp_path / "a", n, D, storage=kind, **kw)
    b = dsa_core.create(tmp_path / "b", n, D, storage="inplace",
                        **{k: v for k, v in kw.items() if k != "memory"})
    rng = np.random.default_rng(13)
    for batch in plan.batches(64, stores=[a]):
        ids = batch.edges.ravel()
        g = rng.standard_normal((ids.size, D)).astype(np.float32)
        a, b = dsa_core.step(a, ids, g), dsa_core.step(b, ids, g)
    assert a.count == b.count > 0
    assert_same_bits(records(a), records(b))
    dsa_core.close(a)
    dsa_core.close(b)
