"""A DataLoader worker (forked) that reads a ``DiskEmbedding`` while the main process trains.

The worker is forked when the loader starts; with ``persistent_workers=True`` it reads the
second epoch after the main process trained on. In place it reads the current rows (the
mapping is shared with the worker); a log store's worker raises ``dsa_core.ForkedReadError``
(re-raised in the main process by the loader) instead of silently reading the rows as of the
fork. A worker forked after training reads them.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dsa_core

from adapters.torch import DiskEmbedding, DiskSparseAdam

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                                reason="needs the fork start method")

N, D = 64, 4


class Rows(torch.utils.data.Dataset):
    """Item ``i``: the embedding's row ``i``, read in the worker."""

    def __init__(self, emb: DiskEmbedding):
        self.emb = emb

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.emb.weight_rows(torch.tensor([i]))[0]


def _loader(emb: DiskEmbedding) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(Rows(emb), batch_size=8, num_workers=1,
                                       persistent_workers=True, multiprocessing_context="fork")


def _train(emb: DiskEmbedding, opt: DiskSparseAdam, steps: int) -> None:
    gen = torch.Generator().manual_seed(steps)
    for _ in range(steps):
        opt.zero_grad()
        emb(torch.randint(0, 8, (16,), generator=gen)).pow(2).sum().backward()
        opt.step()


def test_a_dataloader_worker_reads_current_rows_or_refuses(tmp_path, kind):
    emb = DiskEmbedding(N, D, state_dir=tmp_path / "emb", seed=0, storage=kind)
    opt = DiskSparseAdam(emb.parameters(), lr=0.1)
    _train(emb, opt, 2)
    loader = _loader(emb)
    first = next(iter(loader))  # forks the worker: nothing trained since
    torch.testing.assert_close(first, emb.weight_rows(torch.arange(8)), rtol=0, atol=0)
    _train(emb, opt, 3)
    now = emb.weight_rows(torch.arange(8))
    assert not torch.equal(now, first)
    if kind == "inplace":
        got = next(iter(loader))  # the same worker, after the training
        torch.testing.assert_close(got, now, rtol=0, atol=0)
    else:
        with pytest.raises(dsa_core.ForkedReadError, match="DataLoader worker"):
            next(iter(loader))
    del loader
    loader = _loader(emb)  # a worker forked after the training (evaluation): reads them
    torch.testing.assert_close(next(iter(loader)), now, rtol=0, atol=0)
    del loader
    opt.close()
    emb.close()
