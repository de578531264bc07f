"""The DSA article's API (DiskSparseRiemannianAdam) on log-structured stores (storage="log").

The article's loop reads rows through ``optimizer.state_files["emb"]["w"][idx]``; on a log
store that is a ``RowView`` which reads the rows asked for. Training must be bit-identical
to the in-place adapter, and the views must index exactly as the in-place numpy views do.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core
from adapters.torch import DiskSparseRiemannianAdam
from dsa_core import _layout

N, D = 400, 16
SLOTS = 80  # region slots of each log store: a batch has at most 64 distinct rows


def memory(dtype=np.float32, curvature: float = 0.0) -> int:
    lay = _layout.make_layout(N, D, np.dtype(dtype), curvature, True, 0)
    return dsa_core.region_memory(lay, SLOTS)


def digest(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(Path(path).rglob("*")) if f.is_file()}


def article_loop(optimizer, steps: int, seed: int = 0, wd_from: int | None = None) -> None:
    """The article's quick start: read rows, loss in torch, hand back the gradients."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(D, generator=gen) * 0.1
    for t in range(steps):
        batch_indices = torch.randint(0, N, (64,), generator=gen)
        batch_indices[:6] = 7  # a hub row, several times in the batch
        w = optimizer.state_files["emb"]["w"][batch_indices.numpy()].copy()
        current_weights = torch.from_numpy(w).requires_grad_(True)
        ((current_weights - target) ** 2).sum().backward()
        if wd_from is not None and t == wd_from:
            optimizer.param_groups[0]["weight_decay"] = 0.01  # read at every step
        optimizer.step(updates={"emb": (batch_indices, current_weights.grad)})


def pair(tmp_path: Path, k: float, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    table = (torch.randn(N, D, generator=gen, dtype=dtype) * (0.05 if k else 1.0))
    mem = memory(np.float64 if dtype == torch.float64 else np.float32, k)
    return {kind: DiskSparseRiemannianAdam(params={"emb": table}, lr=0.01, k=k,
                                           disk_dir=str(tmp_path / kind), **kw)
            for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem}))}


def records(opt) -> np.ndarray:
    st = opt.store("emb")
    return dsa_core.read_records(st, np.arange(st.num_rows))


@pytest.mark.parametrize("k, dtype", [(0.0, torch.float32), (1.0, torch.float32),
                                      (1.0, torch.float64)])
def test_article_loop_on_log_matches_inplace(tmp_path, k, dtype):
    opts = pair(tmp_path, k, dtype)
    for opt in opts.values():
        article_loop(opt, 30, wd_from=20)
    a, b = opts["inplace"], opts["log"]
    st = b.store("emb")
    assert st.storage == "log" and st.count == a.store("emb").count == 30
    eng = st.store.engine.stats()
    assert eng["segments"] > 0 and eng["slots"] < N  # rows were evicted and read back
    np.testing.assert_array_equal(records(a).view(np.uint8), records(b).view(np.uint8))
    for part in "wmv":  # the views: every row, read in chunks
        for lo in range(0, N, 150):
            np.testing.assert_array_equal(b.state_files["emb"][part][lo:lo + 150],
                                          a.state_files["emb"][part][lo:lo + 150])
    for opt in opts.values():
        opt.shutdown()


KEYS = [
    3, -1, np.int64(17), [5, 2, 5, -3], np.array([[1, 2], [399, 0]]), torch.tensor([9, 4, 9]),
    slice(None, 10), slice(395, None), slice(None, None, -97), slice(10, 3),
    (np.arange(N) % 7 == 0), ([4, 1, 4], 2), ([4, 1, 4], slice(3, 9)), (slice(2, 6), -1),
    ([4, 1], [0, 15]), (np.array([[3], [8]]), np.array([0, 1, 2])), (7, slice(None, 4)),
    ([2, 3], ...), np.array([], np.int64),
]


@pytest.mark.parametrize("k", [0.0, 1.0])
def test_state_files_index_as_the_numpy_views(tmp_path, k):
    """A log store's state_files index exactly as the in-place numpy views (v of the ball
    broadcast over the columns included); bad indices raise the same error types."""
    opts = pair(tmp_path, k)
    for opt in opts.values():
        article_loop(opt, 8)
    a, b = (opts[kind].state_files["emb"] for kind in ("inplace", "log"))
    for part in "wmv":
        va, vb = a[part], b[part]
        assert (vb.shape, vb.dtype, len(vb), vb.ndim, vb.size) == \
            (va.shape, va.dtype, len(va), va.ndim, va.size)
        for key in KEYS:
            np_key = key.numpy() if isinstance(key, torch.Tensor) else key
            got, want = vb[key], va[np_key]
            assert np.shape(got) == np.shape(want), (part, key)
            np.testing.assert_array_equal(got, want)
        for bad, exc in ((N, IndexError), (-N - 1, IndexError), ([1, N], IndexError),
                         (np.array([0.5]), IndexError), (np.ones(3, bool), IndexError),
                         (([1, 2], 16), IndexError)):
            with pytest.raises(exc):
                va[bad]
            with pytest.raises(exc):
                vb[bad]
    for opt in opts.values():
        opt.shutdown()


def test_state_files_of_a_log_store_refuse_writes_and_whole_arrays(tmp_path):
    opt = pair(tmp_path, 0.0)["log"]
    w = opt.state_files["emb"]["w"]
    rows = w[[1, 2]]
    rows[:] = 5.0  # a copy: nothing changes in the store
    assert not (w[[1, 2]] == 5.0).any()
    before = digest(tmp_path / "log")
    with pytest.raises(ValueError, match="read-only: rows change only through the "
                                         "optimizer's step"):
        w[1] = 0.0
    with pytest.raises(TypeError, match=r"reads rows on indexing .* view\[lo:hi\]"):
        np.asarray(w)
    with pytest.raises(IndexError, match="whole table"):
        w[...]
    assert "read on indexing" in repr(w)
    assert digest(tmp_path / "log") == before
    opt.shutdown()
    with pytest.raises(ValueError, match="is closed"):  # the store is closed: reads raise
        w[[1]]
    pair(tmp_path / "other", 0.0)["inplace"].shutdown()


def test_resume_state_dict_and_refusals_on_log(tmp_path):
    """A log disk_dir reopens (with a warning) and resumes as in place; a store of the
    other kind and bad storage options are refused, nothing written."""
    opts = pair(tmp_path, 1.0)
    for opt in opts.values():
        article_loop(opt, 10)
        sd = opt.state_dict()
        opt.shutdown()
    assert sd["dsa_manifest"]["tables"]["emb"]["count"] == 10
    table = torch.zeros(N, D)
    mem = memory(curvature=1.0)
    resumed = {}
    for kind, kw in (("inplace", {}), ("log", {"storage": "log", "memory": mem})):
        with pytest.warns(UserWarning, match="reopened and training resumes"):
            opt = DiskSparseRiemannianAdam(params={"emb": table}, lr=0.01, k=1.0,
                                           disk_dir=str(tmp_path / kind), **kw)
        if kind == "log":
            opt.load_state_dict(sd)
        assert opt.store("emb").count == 10 and opt.store("emb").storage == kind
        article_loop(opt, 5, seed=3)
        resumed[kind] = records(opt)
        opt.shutdown()
    np.testing.assert_array_equal(resumed["inplace"].view(np.uint8),
                                  resumed["log"].view(np.uint8))
    before = {k: digest(tmp_path / k) for k in ("inplace", "log")}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused before any reopen warning
        with pytest.raises(ValueError, match=r"DiskSparseRiemannianAdam\['emb'\]: the existing "
                                             r"store .* is a storage='log' store, but "
                                             r"storage='inplace'"):
            DiskSparseRiemannianAdam(params={"emb": table}, k=1.0,
                                     disk_dir=str(tmp_path / "log"), storage="inplace")
        with pytest.raises(ValueError, match="storage='inplace' store, but storage='log'"):
            DiskSparseRiemannianAdam(params={"emb": table}, k=1.0,
                                     disk_dir=str(tmp_path / "inplace"), storage="log")
        for kw, match in (({"storage": "inplace", "memory": mem},
                           "^DiskSparseRiemannianAdam: memory= is for storage='log'"),
                          ({"storage": "lsm"}, "storage must be one of")):
            with pytest.raises(ValueError, match=match):
                DiskSparseRiemannianAdam(params={"emb": table}, disk_dir=str(tmp_path / "new"),
                                         **kw)
    assert {k: digest(tmp_path / k) for k in ("inplace", "log")} == before
    assert not (tmp_path / "new").exists()
