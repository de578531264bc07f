"""The adapters speak the core's recovery: ``unclean=`` at a resume.

A store left unclean (its writer ended between flushes and its rows could not be brought back
to the last flush) is refused by ``dsa_core.open`` with ``UncleanStopError`` unless
``unclean="accept"``. The torch adapters (``DiskSparseAdam``, ``DiskEmbedding``), the JAX
``create_store`` and PyKEEN's ``disk_representations`` take ``unclean=`` (default
``"refuse"``), pass it to the core, and re-raise the error (same type) naming the cause and the
adapter's remedy; ``dsa export --unclean accept`` exports such a store's rows. Only in-place
stores can be unclean (a log store reopens at its last flush): the unclean store here is the
copy of an in-place store taken between a step and the next flush.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import dsa_core
import dsa_core.__main__ as dsa_cli

torch = pytest.importorskip("torch")

from adapters.torch import DiskEmbedding, DiskSparseAdam  # noqa: E402

N, D = 50, 4
CAUSE = (r"left unclean: its writer process ended between flushes \(SIGTERM, kill -9, an OOM "
         r"kill, power loss\).*the machine restarted \(power loss\) or the store's undo "
         r"record was unavailable.*Nothing was changed")


def unclean_copy(live: Path, dest: Path) -> None:
    """Copy the store directory ``live`` (stepped since its last flush) to ``dest``: a store
    whose writer stopped between flushes. Where the copy would be recovered (an undo record
    of the same boot), the undo record is left out: the store's undo record unavailable."""
    shutil.copytree(live, dest, ignore=shutil.ignore_patterns("writer.lock"))
    try:
        dsa_core.close(dsa_core.open(dest, mode="r"))
    except dsa_core.UncleanStopError:
        return
    for f in dest.iterdir():
        if "undo" in f.name or "journal" in f.name:
            f.unlink()
    with pytest.raises(dsa_core.UncleanStopError):
        dsa_core.open(dest, mode="r")


def trained_embedding(root: Path) -> Path:
    """An in-place DiskEmbedding store at ``root/live``, copied unclean to ``root/emb``
    (count 1 on disk, a second step's rows maybe in the file); the checkpoint ``root/ck`` at
    step 1."""
    emb = DiskEmbedding(N, D, state_dir=root / "live", seed=0, storage="inplace")
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    for t in range(2):
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        opt.zero_grad()
        if t == 0:
            opt.checkpoint(root / "ck")
    unclean_copy(root / "live", root / "emb")
    opt.close()
    emb.close()
    return root / "emb"


def test_torch_adapters_refuse_or_accept_an_unclean_store(tmp_path):
    path = trained_embedding(tmp_path)
    before = {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()}
    with pytest.raises(dsa_core.UncleanStopError,
                       match=CAUSE + r".*resume=True, unclean=\"accept\", then .*"
                       r"opt\.load_checkpoint\(CKPT\).*pass unclean=\"accept\""):
        DiskEmbedding(N, D, state_dir=path, resume=True)
    assert {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()} == before
    with pytest.raises(ValueError, match=r"unclean must be 'refuse' .* or 'accept' .*got "
                                         r"'yes'"):
        DiskEmbedding(N, D, state_dir=path, resume=True, unclean="yes")
    # the remedy the message names: accept, then go back to the checkpoint
    emb = DiskEmbedding(N, D, state_dir=path, resume=True, unclean="accept")
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    opt.load_checkpoint(tmp_path / "ck")
    assert emb.store.count == 1
    opt.close()
    emb.close()
    assert dsa_core.open(path, mode="r").count == 1  # clean again


def test_disk_sparse_adam_unclean_own_store(tmp_path):
    p = torch.nn.Parameter(torch.zeros(N, D))
    opt = DiskSparseAdam([p], lr=0.1, state_dir=tmp_path / "live", storage="inplace")
    for _ in range(2):
        p.grad = torch.sparse_coo_tensor(torch.tensor([[1, 2]]), torch.ones(2, D), (N, D),
                                         check_invariants=False)
        opt.step()
        if opt.state[p]["step"] == 1:
            opt.flush()
    unclean_copy(tmp_path / "live" / "group0_param0", tmp_path / "opt" / "group0_param0")
    opt.close()
    q = torch.nn.Parameter(torch.zeros(N, D))
    with pytest.raises(dsa_core.UncleanStopError, match=CAUSE + r".*opt\.load_checkpoint"):
        DiskSparseAdam([q], lr=0.1, state_dir=tmp_path / "opt", resume=True)
    opt = DiskSparseAdam([q], lr=0.1, state_dir=tmp_path / "opt", resume=True,
                         unclean="accept")
    assert opt.state[q]["step"] == 1
    opt.close()


def test_jax_create_store_unclean(tmp_path):
    pytest.importorskip("jax")
    from adapters import jax as dsa_jax
    path = trained_embedding(tmp_path)
    with pytest.raises(dsa_core.UncleanStopError,
                       match=CAUSE + r".*resume=True, unclean=\"accept\"\), then "
                                     r"adapters\.jax\.restore"):
        dsa_jax.create_store(path, N, D, resume=True)
    st = dsa_jax.create_store(path, N, D, resume=True, unclean="accept")
    assert st.count == 1
    dsa_core.close(st)


def test_dsa_export_unclean_accept(tmp_path, capsys):
    path = trained_embedding(tmp_path)
    with pytest.raises(SystemExit, match=r"pass --unclean accept"):
        dsa_cli.main(["export", str(path), str(tmp_path / "w.npy"), "--quiet"])
    assert not (tmp_path / "w.npy").exists()
    assert dsa_cli.main(["export", str(path), str(tmp_path / "w.npy"), "--quiet",
                         "--unclean", "accept"]) == 0
    st = dsa_core.open(path, mode="r", unclean="accept")
    np.testing.assert_array_equal(np.load(tmp_path / "w.npy"), dsa_core.gather(st, range(N)))
    dsa_core.close(st)
    assert "exporting its rows as they are" in capsys.readouterr().err
