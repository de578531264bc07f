"""The same bits on both store kinds, through the public core API.

Every test trains an in-place store and a log store from the same initial records on the same
batches (duplicates included) and asks for bit-identical records; the log store gets a small
region so that eviction, seals and cleaning happen during the run (the recipe and the option
combinations, PARITY, are in helpers.py). Converting, restoring and replacing between the kinds
keep the bits too. These tests compare the kinds side by side, so they build both themselves.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import (
    PARITY,
    PARITY_B as B,
    PARITY_D as D,
    PARITY_N as N,
    assert_same_store,
    parity_batches,
    parity_init,
    parity_memory,
    parity_pair,
    records,
)

import dsa_core


@pytest.mark.parametrize("name", sorted(PARITY))
def test_parity_with_inplace(tmp_path, name):
    kw = dict(PARITY[name])
    a, b = parity_pair(tmp_path, **kw)
    assert a.storage == "inplace" and b.storage == "log"
    assert b.layout == a.layout
    assert_same_store(a, b)
    dt = a.dtype
    for k, (idx, g) in enumerate(parity_batches(dt, nan_every=7 if "skip_row" in name else 0)):
        lr = None if k % 5 else 0.02  # a per-step lr now and then
        a = dsa_core.step(a, idx, g, lr=lr)
        b = dsa_core.step(b, idx, g, lr=lr)
    assert_same_store(a, b)
    probe = np.array([0, 5, 5, N - 1, 17])
    np.testing.assert_array_equal(dsa_core.gather(a, probe), dsa_core.gather(b, probe))
    st = b.store.log_stats()
    assert st["seals"] > 0 and st["misses"] > 3 * B  # rows really left and came back
    assert b.store.check_index() == []
    dsa_core.close(a)
    dsa_core.close(b)


def test_cleaning_happens_and_parity_holds(tmp_path):
    a, b = parity_pair(tmp_path)
    for idx, g in parity_batches(a.dtype, steps=200, seed=3):
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
        if a.count % 50 == 0:
            dsa_core.flush(a)
            dsa_core.flush(b)
    assert_same_store(a, b)
    st = b.store.log_stats()
    assert st["cleaned_segments"] > 0
    assert b.store.check_index() == []
    dsa_core.close(a)
    dsa_core.close(b)


@pytest.mark.parametrize("how", ["params", "table"])
def test_parity_weights_false(tmp_path, how):
    a, b = parity_pair(tmp_path, weights=False)
    Wa = parity_init()
    Wb = Wa.copy()
    for idx, g in parity_batches(np.float32):
        if how == "params":
            pa, pb = Wa[idx], Wb[idx]
            a = dsa_core.step(a, idx, g, params=pa)
            b = dsa_core.step(b, idx, g, params=pb)
            Wa[idx], Wb[idx] = pa, pb
        else:
            a = dsa_core.step(a, idx, g, table=Wa)
            b = dsa_core.step(b, idx, g, table=Wb)
    np.testing.assert_array_equal(Wa, Wb)
    assert_same_store(a, b)
    with pytest.raises(ValueError, match="weights=False"):
        dsa_core.gather(b, [0])
    dsa_core.close(a)
    dsa_core.close(b)


def test_empty_batch_counts_a_step(tmp_path):
    a, b = parity_pair(tmp_path)
    a = dsa_core.step(a, np.array([], np.int64), np.zeros((0, D), np.float32))
    b = dsa_core.step(b, np.array([], np.int64), np.zeros((0, D), np.float32))
    assert b.count == 1
    assert_same_store(a, b)
    dsa_core.close(a)
    dsa_core.close(b)


def test_flush_close_open_keeps_values_count_and_hyperparameters(tmp_path):
    kw = {"lr": 0.03, "betas": (0.85, 0.995), "eps": 1e-7, "weight_decay": 0.01,
          "decoupled_weight_decay": True, "nonfinite": "skip_row", "maximize": True}
    a, b = parity_pair(tmp_path, **kw)
    batches = list(parity_batches(np.float32, steps=40))
    for idx, g in batches[:20]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.flush(b)
    dsa_core.close(b)
    assert b.closed
    b = dsa_core.open(tmp_path / "log", memory=parity_memory(a))
    assert b.storage == "log" and b.count == 20
    for k in ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "nonfinite",
              "maximize", "ball_eps", "durability"):
        assert getattr(b, k) == getattr(a, k), k
    assert_same_store(a, b)
    for idx, g in batches[20:]:  # training resumes identically
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert_same_store(a, b)
    dsa_core.close(b)
    r = dsa_core.open(tmp_path / "log", mode="r")  # read-only: no memory needed
    assert not r.writable and r.count == 40
    assert_same_store(a, r)
    dsa_core.close(r)
    dsa_core.close(a)


def test_checkpoint_then_training_goes_on(tmp_path):
    a, b = parity_pair(tmp_path)
    batches = list(parity_batches(np.float32, steps=30))
    for idx, g in batches[:15]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    at_ckpt = records(a)
    assert dsa_core.checkpoint(b, tmp_path / "ckpt") == tmp_path / "ckpt"
    with pytest.raises(FileExistsError, match="overwrite=True"):
        dsa_core.checkpoint(b, tmp_path / "ckpt")
    for idx, g in batches[15:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert_same_store(a, b)
    snap = dsa_core.open(tmp_path / "ckpt", mode="r")
    assert snap.storage == "log" and snap.count == 15 and snap.lr == b.lr
    np.testing.assert_array_equal(records(snap), at_ckpt)
    # restore the snapshot into the live log store: back to the checkpoint exactly
    b = dsa_core.restore(b, snap)
    assert b.count == 15
    np.testing.assert_array_equal(records(b), at_ckpt)
    dsa_core.close(snap)
    dsa_core.close(b)
    dsa_core.close(a)


@pytest.mark.parametrize("direction", ["inplace->log", "log->inplace"])
def test_convert_gives_identical_records_and_training(tmp_path, direction):
    a, b = parity_pair(tmp_path, per_row_step=True, weight_decay=0.01)
    batches = list(parity_batches(np.float32, steps=30))
    for idx, g in batches[:15]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    src, kind = (a, "log") if direction == "inplace->log" else (b, "inplace")
    mem = parity_memory(a) if kind == "log" else None
    c = dsa_core.convert(src, tmp_path / "conv", storage=kind, memory=mem)
    assert c.storage == kind and c.count == 15 and c.layout == a.layout
    assert (c.lr, c.betas, c.weight_decay) == (a.lr, a.betas, a.weight_decay)
    assert_same_store(a, c)
    for idx, g in batches[15:]:
        a = dsa_core.step(a, idx, g)
        c = dsa_core.step(c, idx, g)
    assert_same_store(a, c)
    with pytest.raises(FileExistsError):
        dsa_core.convert(src, tmp_path / "conv", storage=kind, memory=mem)
    for s in (a, b, c):
        dsa_core.close(s)


def test_bf16m_convert_and_reopen_with_another_region_keep_parity(tmp_path):
    # bfloat16 m through convert (in-place -> log) and a reopen with a different region
    # budget: the rows land in other slots each time, and the rounding must not notice
    a = dsa_core.create(tmp_path / "inplace", N, D, init=parity_init(), first_moment="bfloat16",
                        weight_decay=0.01)
    batches = list(parity_batches(np.float32, steps=40, seed=5))
    for idx, g in batches[:10]:
        a = dsa_core.step(a, idx, g)
    b = dsa_core.convert(a, tmp_path / "log", storage="log", memory=parity_memory(a))
    assert b.first_moment == "bfloat16" and b.layout == a.layout
    assert_same_store(a, b)
    for idx, g in batches[10:25]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert_same_store(a, b)
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "log", memory=parity_memory(a, rows=B + 5))
    for idx, g in batches[25:]:
        a = dsa_core.step(a, idx, g)
        b = dsa_core.step(b, idx, g)
    assert_same_store(a, b)
    assert b.store.log_stats()["misses"] > 3 * B
    dsa_core.close(a)
    dsa_core.close(b)


def test_create_replaces_the_other_kind_only_with_overwrite(tmp_path):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D)
    dsa_core.close(s)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        dsa_core.create(p, N, D, storage="log", memory="1MiB")
    s = dsa_core.create(p, N, D, storage="log", memory="1MiB", overwrite=True)
    assert s.storage == "log" and not (p / "rows.dsa").exists()
    dsa_core.close(s)
    s = dsa_core.create(p, N, D, overwrite=True)
    assert s.storage == "inplace" and not list(p.glob("seg-*"))
    dsa_core.close(s)
    dsa_core.remove(p)
    assert not p.exists()


def test_write_records_and_set_count(tmp_path):
    a, b = parity_pair(tmp_path)
    rec = dsa_core.read_records(a, [7, 3])
    rec[:, 0] = 42.0
    dsa_core.write_records(a, [3, 7], rec)
    dsa_core.write_records(b, [3, 7], rec)
    a = dsa_core.set_count(a, 9)
    b = dsa_core.set_count(b, 9)
    assert_same_store(a, b)
    with pytest.raises(ValueError, match="must not repeat"):
        dsa_core.write_records(b, [1, 1], dsa_core.read_records(b, [1, 1]))
    with pytest.raises(ValueError, match="records must be a"):
        dsa_core.write_records(b, [1], np.zeros((1, 3), np.float32))
    assert_same_store(a, b)
    dsa_core.close(b)
    assert json.loads((tmp_path / "log" / "manifest.json").read_text())["count"] == 9
    dsa_core.close(a)


def test_restore_between_kinds(tmp_path):
    a, b = parity_pair(tmp_path)
    for idx, g in parity_batches(np.float32, steps=10):
        a = dsa_core.step(a, idx, g)
    b = dsa_core.restore(b, a)  # in-place snapshot -> live log store
    assert_same_store(a, b)
    for idx, g in parity_batches(np.float32, steps=10, seed=5):
        b = dsa_core.step(b, idx, g)
    a = dsa_core.restore(a, b)  # log store -> live in-place store
    assert_same_store(a, b)
    dsa_core.close(a)
    dsa_core.close(b)
