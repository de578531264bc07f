"""The kernels' default thread count honours the environment (issue "Drop-in means drop-in").

Before: ``dsa_core.get_num_threads()`` was the CPU count whatever ``OMP_NUM_THREADS`` or
``NUMBA_NUM_THREADS`` said (only ``DSA_NUM_THREADS`` counted, uncapped, and an invalid one
made ``import dsa_core`` fail), so several processes on one machine oversubscribed it. Now:
the first of DSA_NUM_THREADS, NUMBA_NUM_THREADS, OMP_NUM_THREADS that is set, capped by the
CPU affinity; an invalid value warns and is skipped. (The torch adapter's following of
``torch.get_num_threads()``: tests/adapters/torch/test_torch_threads.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import dsa_core
from dsa_core import _pool
from helpers import REPO

ENV = ("DSA_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def _threads_in_child(**env):
    base = {k: v for k, v in os.environ.items() if k not in ENV}
    base["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c",
                        "import dsa_core; print(dsa_core.get_num_threads())"],
                       env={**base, **env}, capture_output=True, text=True, cwd=REPO,
                       check=False)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]), r.stderr


def test_omp_num_threads_sets_the_count_at_import():
    n, err = _threads_in_child(OMP_NUM_THREADS="1")
    assert n == 1 and not err


def test_an_invalid_variable_warns_and_is_skipped():
    n, err = _threads_in_child(DSA_NUM_THREADS="four", OMP_NUM_THREADS="1")
    assert n == 1  # the next variable applies
    assert "RuntimeWarning: dsa_core: DSA_NUM_THREADS='four' is ignored" in err
    assert "must be a whole number >= 1" in err and "set_num_threads" in err


@pytest.fixture
def cpus(monkeypatch):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(_pool, "_cpus", lambda: 8)
    return 8


@pytest.mark.parametrize(("env", "want"), [
    ({}, 8),
    ({"OMP_NUM_THREADS": "3"}, 3),
    ({"OMP_NUM_THREADS": "3,2"}, 3),          # a nested-levels list: its first entry
    ({"NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "3"}, 2),
    ({"DSA_NUM_THREADS": "5", "NUMBA_NUM_THREADS": "2", "OMP_NUM_THREADS": "3"}, 5),
    ({"DSA_NUM_THREADS": "", "OMP_NUM_THREADS": "3"}, 3),  # empty counts as unset
    ({"DSA_NUM_THREADS": "64"}, 8),           # capped by the CPUs this process may use
])
def test_default_count_precedence(cpus, monkeypatch, env, want):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _pool._default_setting()[0] == want


@pytest.mark.parametrize("bad", ["0", "-2", "2.5", "x"])
def test_invalid_values_warn(cpus, monkeypatch, bad):
    monkeypatch.setenv("NUMBA_NUM_THREADS", bad)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with pytest.warns(RuntimeWarning, match=rf"NUMBA_NUM_THREADS='{bad}' is ignored"):
        assert _pool._default_setting()[0] == 3


def test_set_num_threads_none_goes_back_to_the_default(cpus, monkeypatch):
    old = (_pool._POOL.threads, _pool._POOL.source)
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        dsa_core.set_num_threads(5)
        assert dsa_core.get_num_threads() == 5 and _pool._POOL.source == "explicit"
        dsa_core.tools.follow_threads(1)  # an explicit count wins
        assert dsa_core.get_num_threads() == 5
        dsa_core.set_num_threads(None)
        assert dsa_core.get_num_threads() == 3 and _pool._POOL.source is None
        dsa_core.tools.follow_threads(2)
        assert dsa_core.get_num_threads() == 2
        dsa_core.tools.follow_threads(100)  # capped by the CPUs
        assert dsa_core.get_num_threads() == 8
        monkeypatch.setenv("DSA_NUM_THREADS", "4")  # DSA's own variable: not overridden
        dsa_core.set_num_threads(None)
        dsa_core.tools.follow_threads(1)
        assert dsa_core.get_num_threads() == 4
    finally:
        _pool._POOL.threads, _pool._POOL.source = old
