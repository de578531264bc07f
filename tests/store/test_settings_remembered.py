"""A store remembers its open-time settings: ``access=`` in place, ``memory=`` for a log store.

Recorded in the manifest when given (at create, or at an open that passes one: it replaces
the recorded one from the next flush on); ``open()`` without them uses the recorded ones, else
the default. Stores written before settings were recorded open with the defaults.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsa_core
from dsa_core._log import store as _log_store

N, D = 20_000, 8  # 1.9 MB of records: the default budget (the whole table) is not 1 MiB
MiB = 1 << 20


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("DSA_ACCESS", raising=False)
    monkeypatch.delenv("DSA_STORAGE", raising=False)


def _manifest(path):
    return json.loads((path / "manifest.json").read_text())


def _rewrite(path, edit):
    """Edit a store's manifest in place (an old store, a damaged one)."""
    m = _manifest(path)
    edit(m)
    if "checksum" in m:  # a consistent manifest that says what the test wants it to say
        from dsa_core._files import json_checksum
        m["checksum"] = json_checksum(m)
    (path / "manifest.json").write_text(json.dumps(m))


def _default(path):
    return _log_store.default_memory(_manifest(path)["layout"])


# -- in place: access= -------------------------------------------------------------------------
def test_access_is_remembered_in_place(tmp_path):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D, access="disk", init="normal")
    assert s.access == "disk" and _manifest(p)["settings"] == {"access": "disk"}
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    dsa_core.close(s)
    s = dsa_core.open(p)  # tiny: "auto" would say "ram"
    assert s.access == "disk" and s.count == 1
    dsa_core.close(s)
    r = dsa_core.open(p, mode="r")
    assert r.access == "disk"
    dsa_core.close(r)
    s = dsa_core.open(p, access="ram")  # given: replaces it, remembered from the flush on
    assert s.access == "ram"
    dsa_core.flush(s)
    assert _manifest(p)["settings"] == {"access": "ram"}
    dsa_core.close(s)
    s = dsa_core.open(p)
    assert s.access == "ram"
    dsa_core.close(s)


def test_auto_records_nothing_and_old_stores_open_by_size(tmp_path):
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, N, D))
    assert "settings" not in _manifest(p)
    s = dsa_core.open(p)
    assert s.access == "ram"  # chosen by size: tiny
    dsa_core.close(s)
    assert "settings" not in _manifest(p)
    dsa_core.close(dsa_core.create(p, N, D, access="disk", overwrite=True))
    _rewrite(p, lambda m: m.pop("settings"))  # as written before settings were recorded
    s = dsa_core.open(p)
    assert s.access == "ram"
    dsa_core.close(s)


def test_the_environment_does_not_replace_a_remembered_access(tmp_path, monkeypatch):
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, N, D, access="disk"))
    monkeypatch.setenv("DSA_ACCESS", "ram")  # it replaces "auto" only
    s = dsa_core.open(p)
    assert s.access == "disk"
    dsa_core.close(s)


def test_a_checkpoint_remembers_the_access(tmp_path):
    s = dsa_core.create(tmp_path / "s", N, D, access="disk")
    dsa_core.checkpoint(s, tmp_path / "ckpt")
    dsa_core.close(s)
    c = dsa_core.open(tmp_path / "ckpt")
    assert c.access == "disk"
    dsa_core.close(c)


# -- log stores: memory= -----------------------------------------------------------------------
@pytest.mark.parametrize("durability", ["flush", "step"])
def test_memory_is_remembered_by_a_log_store(tmp_path, durability):
    p = tmp_path / "s"
    s = dsa_core.create(p, N, D, storage="log", memory="1MiB", durability=durability)
    assert s.store.memory_bytes == MiB and _default(p) != MiB
    assert _manifest(p)["meta"]["settings"] == {"memory": MiB}  # the bytes, normalised
    s = dsa_core.step(s, [1, 2], np.ones((2, D), np.float32))
    dsa_core.close(s)
    s = dsa_core.open(p)
    assert s.store.memory_bytes == MiB and s.count == 1
    dsa_core.close(s)
    s = dsa_core.open(p, memory=1_500_000)  # given: replaces it
    assert s.store.memory_bytes == 1_500_000
    s = dsa_core.step(s, [3], np.ones((1, D), np.float32))
    dsa_core.close(s)
    assert _manifest(p)["meta"]["settings"] == {"memory": 1_500_000}
    s = dsa_core.open(p)
    assert s.store.memory_bytes == 1_500_000 and s.count == 2
    dsa_core.close(s)


def test_a_replaced_budget_is_remembered_by_any_flush(tmp_path):
    """Also the flush of a store that is never closed (at garbage collection)."""
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, N, D, storage="log", memory="1MiB"))
    s = dsa_core.open(p, memory="2MiB")
    s.store.close()  # the engine's own flush, as the unclosed-store finaliser runs it
    s = dsa_core.open(p)
    assert s.store.memory_bytes == 2 * MiB
    dsa_core.close(s)


def test_a_log_store_without_a_recorded_budget_gets_the_default(tmp_path):
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, N, D, storage="log"))
    assert "settings" not in _manifest(p)["meta"]
    s = dsa_core.open(p)
    assert s.store.memory_bytes == _default(p)
    dsa_core.close(s)
    assert "settings" not in _manifest(p)["meta"]  # nothing recorded by a plain reopen
    dsa_core.close(dsa_core.create(p, N, D, storage="log", memory="1MiB", overwrite=True))
    _rewrite(p, lambda m: m["meta"].pop("settings"))  # written before settings were recorded
    s = dsa_core.open(p)
    assert s.store.memory_bytes == _default(p)
    dsa_core.close(s)


@pytest.mark.parametrize("storage, name, bad, good", [
    ("inplace", "access", "fast", {"access": "disk"}),
    ("log", "memory", -5, {"memory": "1MiB"}),
    ("log", "memory", "1MiB", {"memory": MiB}),
])
def test_a_damaged_setting_is_a_clear_error_that_passing_one_fixes(tmp_path, storage, name,
                                                                   bad, good):
    p = tmp_path / "s"
    dsa_core.close(dsa_core.create(p, N, D, storage=storage))
    where = (lambda m: m) if storage == "inplace" else (lambda m: m["meta"])
    _rewrite(p, lambda m: where(m).update(settings={name: bad}))
    before = (p / "manifest.json").read_bytes()
    with pytest.raises(ValueError, match=f"records {name}={bad!r} in its manifest's settings"
                                         f".*Pass {name}= to dsa_core.open"):
        dsa_core.open(p)
    assert (p / "manifest.json").read_bytes() == before
    s = dsa_core.open(p, **good)
    dsa_core.close(s)
    r = dsa_core.open(p, mode="r")
    assert r.count == 0
    dsa_core.close(r)


# -- convert -----------------------------------------------------------------------------------
def test_convert_keeps_the_settings_of_the_new_kind(tmp_path):
    src = dsa_core.create(tmp_path / "log", N, D, storage="log", memory="1MiB")
    t = dsa_core.convert(src, tmp_path / "log2", storage="log")  # keeps the budget
    assert t.store.memory_bytes == MiB
    dsa_core.close(t)
    t = dsa_core.open(tmp_path / "log2")
    assert t.store.memory_bytes == MiB
    dsa_core.close(t)
    t = dsa_core.convert(src, tmp_path / "log3", storage="log", memory="2MiB")  # replaces it
    assert t.store.memory_bytes == 2 * MiB
    dsa_core.close(t)
    t = dsa_core.convert(src, tmp_path / "ip", storage="inplace")  # a budget is not its
    assert t.access == "ram" and "settings" not in _manifest(tmp_path / "ip")
    dsa_core.close(t)
    dsa_core.close(src)
    src = dsa_core.create(tmp_path / "disk", N, D, access="disk")
    t = dsa_core.convert(src, tmp_path / "disk2", storage="inplace")
    assert t.access == "disk"
    dsa_core.close(t)
    t = dsa_core.convert(src, tmp_path / "log4", storage="log")  # access is not a log store's
    assert t.store.memory_bytes == _default(tmp_path / "log4")
    dsa_core.close(t)
    dsa_core.close(src)
    t = dsa_core.open(tmp_path / "disk2")
    assert t.access == "disk"
    dsa_core.close(t)


# -- adapters ----------------------------------------------------------------------------------
def test_an_adapter_resumes_a_log_store_with_its_budget(tmp_path):
    pytest.importorskip("torch")
    import torch

    from adapters.torch import DiskEmbedding, DiskSparseAdam

    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", seed=0, storage="log", memory="1MiB")
    lin = torch.nn.Embedding(N, D, sparse=True)
    opt = DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "opt", storage="log",
                         memory="1MiB")
    emb.close()
    opt.close()
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", resume=True)  # no memory=
    opt = DiskSparseAdam(lin.parameters(), state_dir=tmp_path / "opt", resume=True)
    assert emb.store.storage == "log" and emb.store.store.memory_bytes == MiB
    assert [s.store.memory_bytes for s in opt.stores.values()] == [MiB]
    emb.close()
    opt.close()
