"""Shared pieces of the torch adapter: store handles, the state-dir lock, host transfers.

Private; the public names live in :mod:`adapters.torch`.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dsa_core

__all__ = [
    "DirLock",
    "SharedState",
    "check_first_moment",
    "check_second_moment",
    "check_torch_hparams",
    "manifold_curvature",
    "np_dtype",
    "open_existing",
    "store_second_moment",
    "to_host",
]

_NP_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
LOCK_FILE = ".dsa-torch.lock"


def np_dtype(dtype: torch.dtype, what: str) -> np.dtype:
    """The store dtype for a torch dtype; float32 and float64 only (spec §6)."""
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"{what} has dtype {dtype}; disk stores hold float32 or float64 rows (float16 and "
            "bfloat16 break Adam: eps=1e-8 rounds to 0 and the 0.999 decay is lost, spec §6). "
            "Keep the table in float32") from None


def check_torch_hparams(lr: Any, betas: Any, eps: Any) -> None:
    """``torch.optim.SparseAdam``'s constructor checks, word for word and in its order."""
    if isinstance(lr, torch.Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 < lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 < eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")


def check_table_args(num_embeddings: Any, embedding_dim: Any, mode: str | None,
                     padding_idx: int | None) -> tuple[int, int, int | None]:
    """The checks that ``DiskEmbedding`` and ``ShardedDiskEmbedding`` share.

    Returns ``(num_embeddings, embedding_dim, padding_idx)`` with the padding index made
    non-negative, as ``nn.Embedding`` does.
    """
    n, d = int(num_embeddings), int(embedding_dim)
    if n <= 0 or d <= 0:
        raise ValueError(f"num_embeddings and embedding_dim must be positive, got {n} and {d}")
    if mode not in (None, "sum", "mean"):
        raise ValueError(f"mode must be None (nn.Embedding), 'sum' or 'mean' "
                         f"(nn.EmbeddingBag), got {mode!r}; 'max' bags are not supported")
    if padding_idx is not None:
        if not -n <= padding_idx < n:
            raise ValueError("Padding_idx must be within num_embeddings")
        padding_idx = int(padding_idx) % n
    return n, d, padding_idx


def check_curvature(curvature: Any) -> float:
    try:
        c = float(curvature)
    except (TypeError, ValueError):
        raise TypeError(f"curvature must be a real number >= 0, got {curvature!r}") from None
    if not (math.isfinite(c) and c >= 0.0):
        raise ValueError(f"Invalid curvature: {curvature}; curvature must be finite and >= 0 "
                         "(0: Euclidean SparseAdam, c > 0: Poincaré ball of curvature -c)")
    return c


def manifold_curvature(p: torch.Tensor) -> float | None:
    """The ball curvature ``c`` of a geoopt ``ManifoldParameter``, or None for other tensors.

    geoopt is never imported here: a tensor can only carry a geoopt manifold if geoopt is
    already in ``sys.modules``. ``PoincareBall(c)`` gives ``float(manifold.c)`` (what geoopt
    itself computes with), ``Stereographic(k)`` with ``k < 0`` gives ``-float(k)``, and the
    ``Euclidean`` manifold gives 0 (torch SparseAdam semantics, spec §4). Anything else
    (spheres, ``k >= 0`` stereographic models, the ``*Exact`` exp-map variants, products)
    is refused: the disk kernels implement the ball with geoopt's default retraction only.
    """
    geoopt = sys.modules.get("geoopt")
    manifold = getattr(p, "manifold", None)
    if geoopt is None or manifold is None:
        return None
    m = geoopt.manifolds
    name = type(manifold).__name__
    if isinstance(manifold, m.Euclidean):
        return 0.0
    if isinstance(manifold, m.StereographicExact):
        raise TypeError(
            f"{name} retracts with the exponential map; the disk kernels implement geoopt's "
            "default retraction (project(x + u)). Use geoopt.PoincareBall / Stereographic")
    if isinstance(manifold, m.PoincareBall):
        return float(manifold.c)
    if isinstance(manifold, m.Stereographic):
        k = float(manifold.k)
        if k < 0:
            return -k
        raise ValueError(
            f"{name} with k={k} is not a Poincaré ball (k must be < 0); the disk kernels "
            "support the ball only (curvature c = -k > 0)")
    raise TypeError(
        f"parameters on geoopt manifold {name} are not supported; DiskSparseAdam handles "
        "row-wise Euclidean tables and the Poincaré ball (PoincareBall / Stereographic k<0)")


class SharedState:
    """The one current ``dsa_core.State`` of a store that several torch objects use.

    A :class:`DiskEmbedding` owns its store and a ``DiskSparseAdam`` steps it; both hold this
    cell. ``dsa_core.step`` returns a new ``State`` (count + 1) and the old one becomes
    outdated (the core refuses to step or flush it), so whoever steps writes the new State
    back here, and every holder flushes, checkpoints and closes the current one.
    """

    __slots__ = ("__weakref__", "borrower", "state")

    def __init__(self, state: dsa_core.State):
        self.state = state
        self.borrower = None  # weakref to the optimizer that steps a DiskEmbedding's store

    @property
    def closed(self) -> bool:
        return self.state.closed

    def flush(self) -> None:
        if not self.closed:
            dsa_core.flush(self.state)

    def close(self) -> None:
        dsa_core.close(self.state)


def close_quietly(handles, lock: DirLock | None = None) -> None:
    """Close stores (and a lock) at garbage collection or interpreter exit; never raises."""
    for h in list(handles):
        with contextlib.suppress(Exception):  # best effort at exit
            h.close()
    if lock is not None:
        lock.release()


class DirLock:
    """An exclusive ``flock`` on ``<directory>/.dsa-torch.lock`` (one optimizer per state_dir).

    The lock is taken before any store in the directory is opened or created, so a second
    optimizer on the same ``state_dir`` fails at construction, with nothing on disk touched
    (the lock file is empty and is never written).
    """

    def __init__(self, directory: Path, what: str):
        self.path = Path(directory) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise dsa_core.StoreLockedError(
                f"state_dir {str(directory)!r} is already used by another {what} (in this or "
                "another process): its stores have one writer at a time. Call .close() on the "
                "other optimizer (or let it be garbage-collected), or give this one a "
                "different state_dir") from None
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def check_second_moment(second_moment: Any, curvature: float, what: str) -> str:
    """``"elementwise"`` or ``"rowwise"`` (spec §7.3, c == 0 only), checked before any I/O."""
    if second_moment not in ("elementwise", "rowwise"):
        raise ValueError(f"{what}: second_moment must be 'elementwise' (SparseAdam's v) or "
                         f"'rowwise' (one v per row), got {second_moment!r}")
    if second_moment == "rowwise" and curvature > 0:
        raise ValueError(f"{what}: second_moment='rowwise' is for curvature == 0; the ball "
                         f"(curvature {curvature}) already keeps one second-moment scalar per "
                         "row. Leave second_moment at 'elementwise'")
    return second_moment


def check_first_moment(first_moment: Any, curvature: float, dtype: np.dtype, what: str) -> str:
    """``"full"`` or ``"bfloat16"`` (spec §6: float32 stores, c == 0), before any I/O."""
    if first_moment not in ("full", "bfloat16"):
        raise ValueError(f"{what}: first_moment must be 'full' (m in the table's dtype) or "
                         f"'bfloat16' (m stored as bfloat16), got {first_moment!r}")
    if first_moment == "bfloat16" and (curvature > 0 or np.dtype(dtype) != np.float32):
        raise ValueError(f"{what}: first_moment='bfloat16' is for float32 tables with "
                         f"curvature == 0, not {np.dtype(dtype).name} with curvature "
                         f"{curvature}. Leave first_moment at 'full'")
    return first_moment


def store_second_moment(second_moment: str, curvature: float) -> str:
    """What ``State.second_moment`` reports for a store made with these settings."""
    return "riemannian" if curvature > 0 else second_moment


def open_existing(path: Path, *, num_rows: int, dim: int, dtype: np.dtype, curvature: float,
                  weights: bool, what: str, access: str = "auto",
                  second_moment: str = "elementwise",
                  first_moment: str = "full") -> dsa_core.State | None:
    """Open the store at ``path`` for writing (resume), or return None if there is none.

    An existing store must have the expected shape, dtype, curvature, weight layout and
    second moment, otherwise it is closed again, untouched, and a ``ValueError`` names the
    mismatch. A store held by another writer raises ``dsa_core.StoreLockedError``.
    """
    try:
        state = dsa_core.open(path, access=access)
    except FileNotFoundError:
        # no store yet (an incomplete one makes create raise FileExistsError, with advice)
        return None
    have = (state.num_rows, state.dim, state.dtype.name, state.curvature, state.has_weights)
    want = (num_rows, dim, dtype.name, curvature, weights)
    if have != want:
        dsa_core.close(state)
        raise ValueError(
            f"{what}: the existing store at {str(path)!r} holds a {have[0]} x {have[1]} "
            f"{have[2]} table with curvature {have[3]} (weights stored: {have[4]}), but "
            f"{want[0]} x {want[1]} {want[2]} with curvature {want[3]} (weights stored: "
            f"{want[4]}) is needed. Use a fresh directory, or the same tables, order and "
            "settings as the run that created it")
    want_sm = store_second_moment(second_moment, curvature)
    if state.second_moment != want_sm:
        dsa_core.close(state)
        raise ValueError(
            f"{what}: the existing store at {str(path)!r} keeps a {state.second_moment} "
            f"second moment, but second_moment={second_moment!r} was asked for. A store's "
            "second moment is fixed when it is created: pass the same second_moment, or use "
            "a fresh directory")
    if state.first_moment != first_moment:
        dsa_core.close(state)
        raise ValueError(
            f"{what}: the existing store at {str(path)!r} keeps its first moment as "
            f"{state.first_moment!r}, but first_moment={first_moment!r} was asked for. It is "
            "fixed when the store is created: pass the same first_moment, or use a fresh "
            "directory")
    return state


def move_disk_weight(module, fn, what: str):
    """``nn.Module._apply`` for a disk-backed embedding: move the stand-in weight only.

    ``to()`` / ``cuda()`` / ``cpu()`` move ``module.weight`` (a zero-strided stand-in of the
    table's shape); the rows stay on disk. A dtype change is refused: the store's dtype is fixed.
    """
    w = module.weight
    probe = fn(torch.empty(0, dtype=w.dtype, device=w.device))
    if probe.dtype != w.dtype:
        raise TypeError(f"a {what}'s dtype is fixed by its store ({w.dtype}); it cannot be "
                        f"converted to {probe.dtype}. Cast its output instead")
    if probe.device != w.device:
        st = module._handle.state
        w.data = torch.zeros((), dtype=w.dtype, device=probe.device).expand(st.num_rows,
                                                                             st.dim)
        if w.grad is not None:
            w.grad = w.grad.to(probe.device)
    return module


def to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """Copy tensors of one device to host memory; returns ``(host tensors, needs_sync)``.

    CPU tensors come back as they are (zero copy). CUDA tensors are copied into freshly
    allocated **pinned** buffers with ``non_blocking=True`` (torch's caching host allocator
    recycles the buffers and keeps each one alive until its copy has completed); the caller
    must synchronize the stream before reading them (STYLE.md §3.3). Other devices use a
    blocking ``.cpu()``.
    """
    if not tensors or tensors[0].device.type == "cpu":
        return tensors, False
    if tensors[0].device.type == "cuda":
        out = []
        for t in tensors:
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            out.append(h)
        return out, True
    return [t.cpu() for t in tensors], False


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` (non-blocking from pinned memory on CUDA)."""
    if device.type == "cpu":
        return t
    return t.to(device, non_blocking=t.is_pinned())
