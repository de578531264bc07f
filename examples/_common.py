"""Small helpers shared by the examples: anonymous memory, byte formatting, store sizes."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

__all__ = ["RssPeak", "add_config_args", "config_from_args", "dir_bytes", "fmt_bytes",
           "proc_status", "rss_anon", "state_bytes", "warm_up_torch"]


def proc_status(key: str) -> int | None:
    """A ``kB`` field of /proc/self/status in bytes (e.g. ``"RssAnon"``); None if absent."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_anon() -> int | None:
    """This process's anonymous resident memory in bytes (``RssAnon`` of /proc/self/status).

    Anonymous memory is what the process owns (heap, tensors, numpy arrays); the page cache
    that backs a memory-mapped store is *file-backed* (``RssFile``) and reclaimable, so it
    is not counted here. Returns None where /proc is not available (not Linux).
    """
    return proc_status("RssAnon")


class RssPeak:
    """Largest ``RssAnon`` growth over a baseline, sampled with :meth:`sample`."""

    def __init__(self) -> None:
        self.base = rss_anon()
        self.peak = self.base

    def sample(self) -> None:
        now = rss_anon()
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now

    @property
    def growth(self) -> int | None:
        if self.base is None or self.peak is None:
            return None
        return self.peak - self.base


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``; None -> ``'n/a'``."""
    if n is None:
        return "n/a"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def dir_bytes(path: str | os.PathLike) -> int:
    """Bytes allocated on disk by the files under ``path`` (st_blocks, so sparse-aware)."""
    total = 0
    for p in Path(path).rglob("*"):
        if p.is_file():
            total += p.stat().st_blocks * 512
    return total


def warm_up_torch(curvatures=(0.0,)) -> None:
    """Pay the one-time costs of a process before anything is timed or its memory measured.

    The first ``torch.optim`` optimizer built in a process imports ``torch._dynamo`` (about
    65 MiB of anonymous memory, measured with torch 2.13), and the first dsa_core step loads
    the Numba kernels from their cache (about 20 MiB, and seconds the first time they are
    compiled). Neither depends on the table size; both would otherwise be charged to
    whichever optimizer happens to run first. One step on a throwaway 4-row table each.
    """
    import tempfile

    import torch

    from adapters.torch import DiskEmbedding, DiskSparseAdam

    e = torch.nn.Embedding(4, 2, sparse=True)
    o = torch.optim.SparseAdam(e.parameters())
    e(torch.tensor([0, 1, 1])).sum().backward()
    o.step()
    with tempfile.TemporaryDirectory(prefix="dsa-warmup-") as tmp:
        for i, c in enumerate(curvatures):
            with DiskEmbedding(4, 2, state_dir=f"{tmp}/{i}", curvature=c, seed=0) as d:
                opt = DiskSparseAdam(d.parameters(), lr=1e-3)
                d(torch.tensor([0, 1, 1])).sum().backward()
                opt.step()
                opt.close()


def state_bytes(opt) -> int:
    """Bytes of the tensors in a torch optimizer's per-parameter state, i.e. held in RAM.

    m and v for ``torch.optim.SparseAdam`` and geoopt; 0 for ``DiskSparseAdam``, whose
    per-parameter state is only the step count (the moments are in its stores).
    """
    import torch

    return sum(t.nbytes for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor))


def add_config_args(p: argparse.ArgumentParser, cls, skip=()) -> None:
    """One ``--flag`` per field of the dataclass ``cls`` (typed by its default), plus
    ``--no-progress`` for its ``progress`` field; fields in ``skip`` are left to the caller."""
    d = cls()
    for f in dataclasses.fields(cls):
        if f.name != "progress" and f.name not in skip:
            p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)),
                           default=getattr(d, f.name))
    p.add_argument("--no-progress", action="store_true")


def config_from_args(cls, a: argparse.Namespace):
    """The dataclass ``cls`` from arguments parsed with :func:`add_config_args`."""
    return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)
                  if f.name != "progress"}, progress=not a.no_progress)
