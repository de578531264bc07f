"""Imports of whole tables (an ``nn.Embedding`` weight into a ``DiskEmbedding``, a
``torch.optim.SparseAdam`` state into ``DiskSparseAdam``) go through the stores' write path on
both kinds: a process that dies after the import and before a flush reopens at the last
flush (never the imported rows under the old count), and a ``first_moment="bfloat16"``
store takes SparseAdam's ``exp_avg`` rounded to the nearest bfloat16 on either kind."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import KINDS  # noqa: E402

import dsa_core  # noqa: E402
from adapters.torch import DiskEmbedding, DiskSparseAdam  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[3]


def _sparse_adam_state(rows: int, dim: int):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(rows, dim, sparse=True)
    ref = torch.optim.SparseAdam(emb.parameters(), lr=0.01)
    for _ in range(3):
        emb(torch.randint(0, rows, (2 * rows,))).pow(2).sum().backward()
        ref.step()
        ref.zero_grad()
    return emb, ref.state_dict()


@pytest.mark.parametrize("kind", KINDS)
def test_sparse_adam_state_into_a_bfloat16_store(tmp_path, kind):
    """m to the nearest bfloat16, v exact, on both kinds (a log store's import wrote m's
    float32 values over its packed bfloat16 columns and the first half of v)."""
    emb, sd = _sparse_adam_state(40, 6)
    opt = DiskSparseAdam(emb.parameters(), lr=0.01, state_dir=tmp_path / "opt",
                         storage=kind, first_moment="bfloat16")
    opt.load_state_dict(sd)
    st = opt.store_for(emb.weight)
    rec = dsa_core.read_records(st, np.arange(40))
    lay = st.layout
    raw = rec[:, lay["m"]:lay["m"] + lay["m_width"]].copy().view(np.uint16)[:, :6]
    m = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
    want_m = sd["state"][0]["exp_avg"].to(torch.bfloat16).float().numpy()
    want_v = sd["state"][0]["exp_avg_sq"].numpy()
    np.testing.assert_array_equal(m, want_m)
    np.testing.assert_array_equal(rec[:, lay["v"]:lay["v"] + lay["v_width"]], want_v)
    opt.close()


_WORKER = textwrap.dedent('''
    import os, sys
    import numpy as np, torch
    from adapters.torch import DiskEmbedding, DiskSparseAdam
    root, kind, what = sys.argv[1], sys.argv[2], sys.argv[3]
    emb = DiskEmbedding(300, 8, state_dir=root + "/emb", storage=kind, seed=1)
    opt = DiskSparseAdam(emb.parameters(), lr=0.01)
    emb(torch.arange(0, 300, 3)).pow(2).sum().backward(); opt.step(); opt.zero_grad()
    opt.flush()
    if what == "weight":
        emb.load_state_dict({"weight": torch.full((300, 8), 7.0)}, strict=False)
    else:
        sd = {"state": {0: {"step": torch.tensor(5.0), "exp_avg": torch.full((300, 8), 3.0),
                            "exp_avg_sq": torch.full((300, 8), 9.0)}},
              "param_groups": [dict(opt.param_groups[0], params=[0])]}
        sd["param_groups"][0].pop("params", None)
        sd["param_groups"][0]["params"] = [0]
        opt.load_state_dict(sd)
    os._exit(0)  # kill -9 / the OOM killer: no exit handler, no flush
''')


# the optimizer's import ends with a flush (whole either way): slow, to keep make test short
@pytest.mark.parametrize("what", ["weight", pytest.param("optimizer", marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_death_after_an_import_reopens_at_the_last_flush(tmp_path, kind, what):
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    r = subprocess.run([sys.executable, str(worker), str(tmp_path), kind, what],
                       cwd=ROOT, capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    # what the store held at its flush: the same run, stopped there, in another directory
    ref = tmp_path / "ref"
    emb_r = DiskEmbedding(300, 8, state_dir=ref / "emb", storage=kind, seed=1)
    opt_r = DiskSparseAdam(emb_r.parameters(), lr=0.01)
    emb_r(torch.arange(0, 300, 3)).pow(2).sum().backward()
    opt_r.step()
    want = dsa_core.read_records(emb_r.store, np.arange(300))
    opt_r.close()
    emb_r.close()
    emb = DiskEmbedding(300, 8, state_dir=tmp_path / "emb", storage=kind, seed=1, resume=True)
    got = dsa_core.read_records(emb.store, np.arange(300))
    if what == "weight":  # not flushed: the store reopens at its last flush, whole
        assert emb.store.count == 1
        np.testing.assert_array_equal(got, want)
    else:  # DiskSparseAdam.load_state_dict ends with a flush: the import is whole
        lay = emb.store.layout
        assert emb.store.count == 5
        np.testing.assert_array_equal(got[:, lay["w"]:lay["w"] + 8], want[:, :8])
        assert (got[:, lay["m"]:lay["m"] + 8] == 3.0).all()
        assert (got[:, lay["v"]:lay["v"] + 8] == 9.0).all()
    emb.close()
