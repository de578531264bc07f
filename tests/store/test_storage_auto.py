"""storage="auto" (the default of dsa_core.create and of every adapter): the kind by size."""

from __future__ import annotations

import numpy as np
import pytest

import dsa_core
from dsa_core import _paging
from helpers import memcap, memcap_unavailable

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


# -- what the process may use: the memory cgroup -----------------------------------------------
GiB, MiB = 1 << 30, 1 << 20


def _fake_machine(monkeypatch, files, phys):
    """Let ``_paging`` read ``files`` (path -> text) instead of /proc and /sys."""
    monkeypatch.setattr(_paging, "_read_text", lambda path: files.get(str(path)))
    monkeypatch.setattr(_paging, "_physical_bytes", lambda: phys)
    monkeypatch.setattr(_paging, "ram_bytes_held", lambda: 0)  # stores other tests left open
    monkeypatch.delenv("DSA_STORAGE", raising=False)
    monkeypatch.delenv("DSA_ACCESS", raising=False)


def _proc(avail, ratio=10, fixed=0, cgroup="0::/\n"):
    return {"/proc/meminfo": f"MemTotal: {24 * GiB // 1024} kB\nMemFree: 1 kB\n"
                             f"MemAvailable: {avail // 1024} kB\n",
            "/proc/sys/vm/dirty_background_ratio": f"{ratio}\n",
            "/proc/sys/vm/dirty_background_bytes": f"{fixed}\n",
            "/proc/self/cgroup": cgroup}


def _cgroup_768(version, fixed=0):
    """A job under a 768 MiB memory cgroup on a 24 GiB machine (22 GiB available): torch
    holds 0.4 GiB, Python 80 MiB more, 20 MiB of page cache."""
    usage, file = 400 * MiB + 80 * MiB + 20 * MiB, 20 * MiB
    if version == 2:
        files = _proc(22 * GiB, fixed=fixed, cgroup="0::/job\n")
        d = "/sys/fs/cgroup/job/"
        files.update({d + "memory.max": f"{768 * MiB}\n", d + "memory.high": "max\n",
                      d + "memory.current": f"{usage}\n",
                      d + "memory.stat": f"anon {usage - file}\nfile {file}\nactive_file "
                                         f"{file // 4}\ninactive_file {file - file // 4}\n",
                      "/sys/fs/cgroup/memory.stat": "active_file 1\ninactive_file 2\n"})
    else:
        files = _proc(22 * GiB, fixed=fixed, cgroup="5:memory:/job\n0::/\n")
        d, root = "/sys/fs/cgroup/memory/job/", "/sys/fs/cgroup/memory/"
        files.update({d + "memory.limit_in_bytes": f"{768 * MiB}\n",
                      d + "memory.usage_in_bytes": f"{usage}\n",
                      d + "memory.stat": f"cache {file}\ntotal_active_file {file // 4}\n"
                                         f"total_inactive_file {file - file // 4}\n",
                      root + "memory.limit_in_bytes": "9223372036854771712\n",
                      root + "memory.usage_in_bytes": f"{6 * GiB}\n"})
    return files


@pytest.mark.parametrize("version", [1, 2])
def test_a_768mib_cgroup_with_tensors_picks_log_and_disk(monkeypatch, version):
    """The case seen: a 0.46 GB table under a 768 MiB cgroup where torch held 0.4 GiB got
    "ram" (70% of the 768 MiB limit) and an in-place store (10% of the machine's memory)."""
    _fake_machine(monkeypatch, _cgroup_768(version), 24 * GiB)
    assert _paging.memory_limit() == 768 * MiB
    room = 768 * MiB - 500 * MiB + 20 * MiB  # limit - usage + the reclaimable page cache
    assert _paging.memory_available() == room
    assert _paging.dirty_background_bytes() == room // 10  # 10% of the cgroup's dirtyable
    table = 460_000_000
    assert _paging.auto_access(table) == "disk"
    assert _paging.auto_storage(table, False, "auto") == "log"
    small = 20 * MiB  # under both: in place, in RAM
    assert _paging.auto_access(small) == "ram"
    assert _paging.auto_storage(small, False, "auto") == "inplace"


def test_dirty_background_bytes_is_scaled_to_the_cgroup(monkeypatch):
    _fake_machine(monkeypatch, _cgroup_768(2, fixed=GiB), 24 * GiB)
    room = 768 * MiB - 500 * MiB + 20 * MiB
    assert _paging.dirty_background_bytes() == GiB * room // (22 * GiB)  # the kernel's scaling


@pytest.mark.parametrize("fixed", [0, GiB])
def test_a_large_ram_box_without_a_limit_decides_by_the_machine(monkeypatch, fixed):
    files = _proc(480 * GiB, fixed=fixed, cgroup="0::/user.slice/job\n")
    for d in ("/sys/fs/cgroup/user.slice/job/", "/sys/fs/cgroup/user.slice/"):
        files.update({d + "memory.max": "max\n", d + "memory.high": "max\n",
                      d + "memory.current": f"{30 * GiB}\n",
                      d + "memory.stat": f"active_file {GiB}\ninactive_file {GiB}\n"})
    _fake_machine(monkeypatch, files, 512 * GiB)
    assert _paging.memory_limit() == 512 * GiB
    assert _paging.memory_available() == 480 * GiB
    bg = fixed or 48 * GiB
    assert _paging.dirty_background_bytes() == bg
    assert _paging.auto_storage(bg, False, "auto") == "inplace"
    assert _paging.auto_storage(bg + 1, False, "auto") == "log"
    assert _paging.auto_access(bg) == "ram"
    assert _paging.auto_access(bg + 1) == "disk"
    limits = dsa_core.tools.paging_limits()
    assert (limits["memory_available"], limits["dirty_background_bytes"]) == (480 * GiB, bg)


def test_unreadable_files_fall_back(monkeypatch):
    _fake_machine(monkeypatch, {}, 8 * GiB)
    assert _paging.memory_limit() == 8 * GiB
    assert _paging.memory_available() == 8 * GiB
    assert _paging.dirty_background_bytes() == 1 << 30


_PICK = """
import sys, numpy as np, dsa_core
from dsa_core import _paging
held = np.ones(400 << 20, np.uint8)  # 400 MiB of anonymous memory, as tensors would hold
rows = 460_000_000 // (3 * 128 * 4)  # a 0.46 GB float32 table of [w | m | v], dim 128
t = dsa_core.create(sys.argv[1] + "/inplace", rows, 128, storage="inplace")
s = dsa_core.create(sys.argv[1] + "/auto", rows, 128)
u = dsa_core.create(sys.argv[1] + "/small", 10_000, 128)  # 15 MB
print(s.storage, t.access, u.storage, u.access, _paging.paging_limits())
"""


@pytest.mark.slow
@pytest.mark.skipif(memcap_unavailable() is not None, reason=str(memcap_unavailable()))
def test_auto_under_a_real_768mib_cgroup(tmp_path):
    """storage="auto" and access="auto" inside ``benchmarks/memcap.sh 768M`` (a real memory
    cgroup)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(__import__("pathlib").Path(dsa_core.__file__).parents[1]))
    env.pop("DSA_STORAGE", None)
    env.pop("DSA_ACCESS", None)
    r = subprocess.run(memcap("768M", sys.executable, "-c", _PICK, str(tmp_path)),
                       capture_output=True, text=True, env=env, timeout=300)
    if r.returncode and "no writable memory cgroup" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:4] == ["log", "disk", "inplace", "ram"], r.stdout
