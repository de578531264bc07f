"""storage="auto" (the default of dsa_core.create and of every adapter): the kind by size."""

from __future__ import annotations

import numpy as np
import pytest

import dsa_core
from dsa_core import _paging

N, D = 500, 8
TABLE = N * 3 * D * 4  # bytes of the float32 records [w | m | v]


@pytest.fixture
def threshold(monkeypatch):
    """Set the kernel's background-writeback threshold that "auto" compares with."""
    def set_to(nbytes):
        monkeypatch.setattr(_paging, "dirty_background_bytes", lambda: nbytes)
    monkeypatch.delenv("DSA_STORAGE", raising=False)
    return set_to


@pytest.mark.parametrize("limit, kind", [(TABLE, "inplace"), (TABLE - 1, "log")])
def test_auto_picks_log_past_the_writeback_threshold(tmp_path, threshold, limit, kind):
    threshold(limit)
    s = dsa_core.create(tmp_path / "s", N, D, init="normal")
    assert s.storage == kind
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    dsa_core.close(s)
    r = dsa_core.open(tmp_path / "s", mode="r")  # the kind is the store's, not re-chosen
    assert r.storage == kind and r.count == 1
    dsa_core.close(r)


def test_a_budget_or_a_paging_mode_decides(tmp_path, threshold):
    threshold(1 << 40)  # the size rule alone would say in place
    s = dsa_core.create(tmp_path / "a", N, D, memory="1MiB")
    assert s.storage == "log" and s.store.memory_bytes == 1 << 20
    dsa_core.close(s)
    s = dsa_core.create(tmp_path / "b", N, D, space_ratio=1.5)
    assert s.storage == "log"
    dsa_core.close(s)
    threshold(1)  # the size rule alone would say log
    s = dsa_core.create(tmp_path / "c", N, D, access="disk")
    assert s.storage == "inplace"
    dsa_core.close(s)
    with pytest.raises(ValueError, match="access='disk' is for in-place stores"):
        dsa_core.create(tmp_path / "d", N, D, access="disk", memory="1MiB")
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("env", ["inplace", "log"])
def test_dsa_storage_replaces_the_size_rule(tmp_path, threshold, monkeypatch, env):
    threshold(1 if env == "inplace" else 1 << 40)
    monkeypatch.setenv("DSA_STORAGE", env)
    s = dsa_core.create(tmp_path / "s", N, D)
    assert s.storage == env
    dsa_core.close(s)
    monkeypatch.setenv("DSA_STORAGE", "lsm")
    with pytest.raises(ValueError, match="DSA_STORAGE must be one of"):
        dsa_core.create(tmp_path / "t", N, D)


def test_convert_takes_a_kind_not_auto(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, storage="inplace")
    with pytest.raises(ValueError, match=r"storage must be one of \('inplace', 'log'\)"):
        dsa_core.convert(s, tmp_path / "t", storage="auto")
    assert not (tmp_path / "t").exists()
    dsa_core.close(s)


def test_adapters_default_to_auto(tmp_path, threshold):
    torch = pytest.importorskip("torch")
    from adapters.torch import DiskEmbedding, DiskSparseAdam

    threshold(N * 2 * D * 4 - 1)  # an optimizer's m and v of an N x D table: just past it
    lin = torch.nn.Embedding(N, D, sparse=True)
    opt = DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "opt")
    assert [s.storage for s in opt.stores.values()] == ["log"]
    opt.close()
    threshold(1 << 40)
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb")
    assert emb.store.storage == "inplace"
    emb.close()
