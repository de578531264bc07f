"""Shared pieces of the torch adapter: store handles, the state-dir lock, host transfers.

Private; the public names live in :mod:`adapters.torch`.
"""

from __future__ import annotations

import contextlib
import fcntl
import numbers
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import dsa_core

from ._storage import check_kind, check_storage_args, unclean_error

__all__ = [
    "DirLock",
    "SharedState",
    "check_device",
    "check_existing",
    "check_reopen",
    "check_storage_args",
    "check_table_args",
    "check_torch_hparams",
    "close_quietly",
    "manifold_curvature",
    "move_disk_weight",
    "np_dtype",
    "peek_existing",
    "reopen",
    "row_options",
    "set_columns",
    "store_second_moment",
    "to_device",
    "to_host",
]

_NP_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}
LOCK_FILE = ".dsa-torch.lock"


def np_dtype(dtype: torch.dtype, what: str) -> np.dtype:
    """The store dtype for a torch dtype; float32 and float64 only (docs/algorithms.md §6)."""
    try:
        return _NP_DTYPES[dtype]
    except KeyError:
        raise TypeError(
            f"{what} has dtype {dtype}; disk stores hold float32 or float64 rows (float16 and "
            "bfloat16 break Adam: eps=1e-8 rounds to 0 and the 0.999 decay is lost, "
            "docs/algorithms.md §6). Keep the table in float32") from None


def check_torch_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any = 0.0,
                        decoupled_weight_decay: Any = False) -> None:
    """``torch.optim.SparseAdam``'s constructor checks, word for word and in its order, then
    ``torch.optim.Adam``'s for ``weight_decay`` (SparseAdam has none).

    ``decoupled_weight_decay`` must be a bool (torch takes anything truthy; a flag that is
    stored in every store's manifest is checked instead).
    """
    # torch compares these with numbers and fails on anything else with "'<' not supported
    # between instances of 'float' and 'str'": name the argument instead. Never converted
    # (torch refuses a string lr too; a config file's "0.01" is a mistake to fix there)
    try:
        pair = len(betas) == 2
    except TypeError:
        pair = False
    if not pair:
        raise TypeError(f"betas must be a pair of numbers (beta1, beta2), such as (0.9, 0.999);"
                        f" got the {type(betas).__name__} {betas!r}")
    for name, value in (("lr", lr), ("betas[0]", betas[0]), ("betas[1]", betas[1]),
                        ("eps", eps), ("weight_decay", weight_decay)):
        if not isinstance(value, (numbers.Real, torch.Tensor)):
            fix = (f"pass {name}={float(value)!r}, a number (in a config file: without quotes),"
                   " or convert it with float() where it is read"
                   if isinstance(value, str) and _is_float(value) else
                   f"pass a number as {name}")
            raise TypeError(
                f"{name} must be a number (a float, or a 1-element tensor), got the "
                f"{type(value).__name__} {value!r}; torch's optimizers refuse it too: {fix}")
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
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not isinstance(decoupled_weight_decay, (bool, np.bool_)):
        raise TypeError(f"decoupled_weight_decay must be a bool, got "
                        f"{decoupled_weight_decay!r}")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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


def check_device(device: Any, dtype: torch.dtype, what: str) -> None:
    """``ValueError`` unless tensors of ``dtype`` can live on ``device`` here (None: CPU).

    Checked before a store is created, so a device this machine lacks (``"cuda"`` without
    CUDA) leaves nothing on disk and the same call on another device can follow.
    """
    if device is None:
        return
    try:
        torch.empty(0, dtype=dtype, device=device)
    except (RuntimeError, AssertionError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{what}: device={str(device)!r} cannot be used on this machine ({exc}); "
            "nothing was created. Pass a device that exists here (device='cpu', or "
            "leave it out); the store on disk is the same whatever the device") from None


def manifold_curvature(p: torch.Tensor) -> float | None:
    """The ball curvature ``c`` of a geoopt ``ManifoldParameter``, or None for other tensors.

    geoopt is never imported here: a tensor can only carry a geoopt manifold if geoopt is
    already in ``sys.modules``. ``PoincareBall(c)`` gives ``float(manifold.c)`` (what geoopt
    itself computes with), ``Stereographic(k)`` with ``k < 0`` gives ``-float(k)``, and the
    ``Euclidean`` manifold gives 0 (torch SparseAdam semantics, docs/algorithms.md §4).
    Anything else (spheres, ``k >= 0`` stereographic models, the ``*Exact`` exp-map variants,
    products) is refused: the disk kernels implement the ball with geoopt's default
    retraction only.
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


def store_second_moment(second_moment: str, curvature: float) -> str:
    """What ``State.second_moment`` reports for a store made with these settings."""
    return "riemannian" if curvature > 0 else second_moment


def check_reopen(resume: Any, overwrite: Any, what: str) -> tuple[bool, bool]:
    """``resume`` and ``overwrite`` as bools; both True is refused (they contradict)."""
    for name, value in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{what}: {name} must be a bool, got {value!r}")
    if resume and overwrite:
        raise ValueError(
            f"{what}: resume=True and overwrite=True contradict each other: resume=True "
            "continues from the existing state, overwrite=True deletes it and starts afresh. "
            "Pass one of them")
    return bool(resume), bool(overwrite)


def check_existing(state: dsa_core.State, *, num_rows: int, dim: int, dtype: np.dtype,
                   curvature: float, weights: bool, what: str,
                   second_moment: str = "elementwise", first_moment: str = "full",
                   per_row_step: bool = False, decay_missed_steps: bool = False,
                   storage: str | None = None, optimizer: str = "adam") -> None:
    """``ValueError`` unless the open store ``state`` is what a resumed run needs.

    Shape, dtype, curvature, weight layout, second and first moment, per-row step counts and
    the catch-up of missed weight decay are fixed when a store is created; a store that
    differs cannot be resumed, only replaced (``overwrite=True``). ``storage`` (when given)
    is the store kind asked for (``"inplace"`` or ``"log"``); a store of the other kind is
    refused too (``dsa_core.convert`` copies a store into the other kind). ``optimizer``
    (``"adam"``, ``"adagrad"``, ``"rowwise_adagrad"``) is what its records hold state for;
    an Adagrad store's moment settings follow from it (not checked).
    """
    path = str(state.path)
    if storage is not None:
        check_kind(state, storage, f"{what}: the existing store at {path!r}")
    have = (state.num_rows, state.dim, state.dtype.name, state.curvature, state.has_weights)
    want = (num_rows, dim, dtype.name, curvature, weights)
    if have != want:
        raise ValueError(
            f"{what}: the existing store at {path!r} holds a {have[0]} x {have[1]} "
            f"{have[2]} table with curvature {have[3]} (weights stored: {have[4]}), but "
            f"{want[0]} x {want[1]} {want[2]} with curvature {want[3]} (weights stored: "
            f"{want[4]}) is needed. Use a fresh directory, the same tables, order and "
            "settings as the run that created it, or overwrite=True to replace it")
    if state.optimizer != optimizer:
        raise ValueError(
            f"{what}: the existing store at {path!r} was created with "
            f"optimizer={state.optimizer!r} (its records hold {state.optimizer}'s state), but "
            f"optimizer={optimizer!r} was asked for. A store's optimizer is fixed when it is "
            "created: use the same optimizer as the run that created it, a fresh directory, "
            "or overwrite=True to replace it")
    if optimizer != "adam":
        return  # an Adagrad store has no moment options, and no per-row counters
    want_sm = store_second_moment(second_moment, curvature)
    if state.second_moment != want_sm:
        raise ValueError(
            f"{what}: the existing store at {path!r} keeps a {state.second_moment} "
            f"second moment, but second_moment={second_moment!r} was asked for. A store's "
            "second moment is fixed when it is created: pass the same second_moment, use "
            "a fresh directory, or overwrite=True to replace it")
    if state.first_moment != first_moment:
        raise ValueError(
            f"{what}: the existing store at {path!r} keeps its first moment as "
            f"{state.first_moment!r}, but first_moment={first_moment!r} was asked for. It is "
            "fixed when the store is created: pass the same first_moment, use a fresh "
            "directory, or overwrite=True to replace it")
    have_ro = row_options(state)
    want_ro = {"per_row_step": bool(per_row_step),
               "decay_missed_steps": bool(decay_missed_steps)}
    bad = [k for k in have_ro if have_ro[k] != want_ro[k]]
    if bad:
        raise ValueError(
            f"{what}: the existing store at {path!r} was created with "
            f"{', '.join(f'{k}={have_ro[k]}' for k in bad)}, but "
            f"{', '.join(f'{k}={want_ro[k]}' for k in bad)} was asked for. These options "
            "shape each row's record and are fixed when a store is created: pass the store's "
            "values, use a fresh directory, or overwrite=True to replace it")


def row_options(state: dsa_core.State) -> dict[str, bool]:
    """The per-row layout options of a store: ``per_row_step`` and ``decay_missed_steps``."""
    return {"per_row_step": bool(state.per_row_step),
            "decay_missed_steps": bool(state.decay_missed_steps)}


_REMEDY = ("build it again with resume=True, unclean=\"accept\", then load your checkpoint: "
           "opt.load_checkpoint(CKPT) (a DiskEmbedding alone: emb.load_checkpoint(CKPT))")


def peek_existing(path: Path, unclean: str = "refuse", remedy: str | None = None,
                  **expect: Any) -> int | None:
    """The step count of the store at ``path``, or None if there is none; writes nothing.

    The store is opened read-only (no lock, no journal recovery) and checked with
    :func:`check_existing` (``expect`` are its keyword arguments), so a run can be refused
    (``resume=False``) or a mismatch reported before anything on disk changes. A directory
    without a store, or a damaged one whose manifest is missing, gives None: creating a
    store there then raises ``FileExistsError`` with advice if a data file is in the way.
    """
    try:
        snap = dsa_core.open(path, mode="r", unclean=unclean)
    except FileNotFoundError:
        return None
    except dsa_core.UncleanStopError as exc:
        raise unclean_error(exc, expect.get("what", "resume"), path, remedy or (
            _REMEDY)) from None
    try:
        check_existing(snap, **expect)
        return int(snap.count)
    finally:
        dsa_core.close(snap)


def reopen(path: Path, *, access: str = "auto", memory: int | None = None,
           unclean: str = "refuse", **expect: Any) -> dsa_core.State:
    """Open the store at ``path`` for writing (resume) and check it again once locked.

    ``memory`` is the region budget of a log store (``dsa_core.open``'s ``memory``; None
    for an in-place store). A store held by another writer raises
    ``dsa_core.StoreLockedError``; a mismatch closes it again and raises ``ValueError``
    (see :func:`check_existing`).
    """
    try:
        state = dsa_core.open(path, access=access, memory=memory, unclean=unclean)
    except dsa_core.UncleanStopError as exc:
        raise unclean_error(exc, expect.get("what", "resume"), path,
                            _REMEDY) from None
    try:
        check_existing(state, **expect)
    except BaseException:
        dsa_core.close(state)
        raise
    return state


_CHUNK_BYTES = 1 << 24  # ~16 MiB of records per read/modify/write chunk of a log store


def set_columns(state: dsa_core.State, off: int, width: int, source, *,
                as_int: bool = False) -> None:
    """Overwrite columns ``[off, off + width)`` of every record of ``state``, in chunks.

    The row-wise way to write a whole column block (weights, m, v, a per-row counter) of
    a store that has no whole-table view (a log store): each chunk of records is read with
    ``dsa_core.read_records``, its columns replaced, and written back with
    ``dsa_core.write_records``; the other columns keep their bits. ``source(lo, hi)`` gives
    the values of rows ``[lo, hi)``: an array broadcastable to ``(hi - lo, width)``, cast to
    the store dtype, or with ``as_int`` to the store's counter integers (int32 in float32
    records, int64 in float64 ones), stored bit for bit. Durable at the next flush.
    """
    dt = state.dtype
    ints = np.dtype(np.int32) if dt.itemsize == 4 else np.dtype(np.int64)
    stride = int(state.layout["stride"])
    rows = max(1, _CHUNK_BYTES // (stride * dt.itemsize))
    for lo in range(0, state.num_rows, rows):
        hi = min(state.num_rows, lo + rows)
        idx = np.arange(lo, hi, dtype=np.int64)
        rec = dsa_core.read_records(state, idx)
        val = np.asarray(source(lo, hi))
        if as_int:
            rec.view(ints)[:, off:off + width] = val.astype(ints, copy=False)
        else:
            rec[:, off:off + width] = val.astype(dt, copy=False)
        dsa_core.write_records(state, idx, rec)


def move_disk_weight(module, fn, what: str, compute_dtype: torch.dtype | None = None,
                     on_dtype=None):
    """``nn.Module._apply`` for a disk-backed embedding: move the stand-in weight only.

    ``to()`` / ``cuda()`` / ``cpu()`` move ``module.weight`` (a zero-strided stand-in of the
    table's shape); the rows stay on disk. The store's dtype is fixed: a dtype change
    (``double()``, ``half()``, ``to(dtype)``) is refused, or, given ``on_dtype``, handed to
    it (``on_dtype(new_dtype)``) and the weight keeps its dtype. ``compute_dtype`` (default:
    the weight's) is the dtype the module's outputs have now, the one a change is seen from.
    """
    w = module.weight
    cur = compute_dtype or w.dtype
    probe = fn(torch.empty(0, dtype=cur, device=w.device))
    if probe.dtype != cur and on_dtype is not None:
        on_dtype(probe.dtype)
    elif probe.dtype != cur:
        raise TypeError(f"a {what}'s dtype is fixed by its store ({w.dtype}); it cannot be "
                        f"converted to {probe.dtype}. Cast its output instead")
    if probe.device != w.device:
        st = module._handle.state
        with torch._C.DisableTorchFunctionSubclass():  # a DiskWeight refuses a user's .data=
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
    must synchronize the stream before reading them (the copies are asynchronous: reading
    earlier could see a buffer that is still being filled). Other devices use a blocking
    ``.cpu()``.
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
