"""Row-sharded disk embeddings over ``torch.distributed``: :class:`ShardedDiskEmbedding`.

Private; the public names live in :mod:`adapters.torch_dist`. The on-disk format (ownership
plan, ``shard.json``, checkpoint manifests) is defined in :mod:`adapters._torch_shards`,
which the offline resharder (:mod:`adapters.torch_reshard`) shares.

Exchange protocol of one training step, per rank (W ranks, U distinct ids in this rank's
batch, R ids received by this rank as an owner)::

    forward   counts  all_to_all_single  W int64      (how many ids go to each owner)
              ids     all_to_all_single  U int64      (owner-local row ids, grouped by owner)
              rows    all_to_all_single  R x d        (owners send the rows back)
    backward  grads   all_to_all_single  U x d        (row gradients to their owners)
    step      none: each owner steps its own shard (DiskSparseAdam), every rank every step

A rank that refuses its batch (ids out of range, wrong dtype) sends counts of -1, so every
rank raises at the same collective and the process group stays usable. Construction and
checkpoints follow the same rule: every rank first looks (no writes), the ranks exchange what
they found, and all go on or all raise the same error.
"""

from __future__ import annotations

import os
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dsa_core
from dsa_core.tools import validation

from ._storage import STORAGE_DEFAULT, check_kind, check_storage_args, zero_weight_row
from ._torch_common import (
    SharedState,
    check_table_args,
    close_quietly,
    move_disk_weight,
    np_dtype,
)
from ._torch_embedding import DiskWeight
from ._torch_shards import (
    MANIFEST_FILE,
    ShardPlan,
    check_shard_meta,
    describe_plan,
    manifest,
    read_manifest,
    read_shard_meta,
    shard_meta,
    shard_path,
    store_settings,
    table_of,
    write_manifest,
    write_shard_meta,
)

__all__ = [
    "ShardExchangeError",
    "ShardedDiskEmbedding",
    "ddp_ignore",
]

_WHO = "ShardedDiskEmbedding"
_EXTRA_FORMAT = "dsa-torch-sharded-embedding"
_EXCHANGES = ("all_to_all", "all_gather")
_REFUSED = {-1: IndexError, -2: TypeError, -3: ValueError, -4: RuntimeError}
_CODES = {IndexError: -1, TypeError: -2, ValueError: -3}


class ShardExchangeError(RuntimeError):
    """A collective of a :class:`ShardedDiskEmbedding` failed: a peer died, hung or diverged.

    The process group is unusable afterwards; end every rank and restart them from the last
    complete checkpoint (``resume_from=``). Checkpoints are never modified by a failure.
    """


# -- the collectives ------------------------------------------------------------------------------
class _Route:
    """Split sizes of one exchange: ``send[j]`` items to rank j, ``recv[j]`` from rank j.

    ``mat`` (all_gather mode only) is the full W x W matrix, ``mat[s][d]`` = items s -> d.
    """

    __slots__ = ("mat", "recv", "send")

    def __init__(self, send: list[int], recv: list[int], mat: list[list[int]] | None):
        self.send, self.recv, self.mat = send, recv, mat

    def reverse(self) -> _Route:
        mat = None if self.mat is None else [list(c) for c in zip(*self.mat)]
        return _Route(self.recv, self.send, mat)


_WHAT = {"ids": "ids (forward)", "rows": "rows (forward)",
         "grads": "row gradients (backward)"}


class _Comm:
    """The exchanges of one ShardedDiskEmbedding: all_to_all_single (or all_gather) on a group."""

    def __init__(self, group, rank: int, world: int, device: torch.device, method: str,
                 timeout: timedelta | None):
        self.group, self.rank, self.world = group, rank, world
        self.device, self.method, self.timeout = device, method, timeout
        self.last_checkpoint: str | None = None
        self.stats = {"counts": 0, "ids": 0, "rows": 0, "grads": 0, "self": 0, "lookups": 0,
                      "backwards": 0}

    # every collective goes through here: bounded wait, clear error
    def _run(self, what: str, fn, *args, bounded: bool = True, **kwargs):
        try:
            if self.timeout is None or not bounded:  # all_gather_object has no async_op
                return fn(*args, group=self.group, **kwargs)
            work = fn(*args, group=self.group, async_op=True, **kwargs)
            work.wait(timeout=self.timeout)
            return None
        except ShardExchangeError:
            raise
        except RuntimeError as exc:  # DistBackendError and gloo/NCCL errors are RuntimeErrors
            raise self.error(what, exc) from exc

    def error(self, what: str, exc: BaseException) -> ShardExchangeError:
        what = _WHAT.get(what, what)
        bound = (f"{self.timeout.total_seconds():g} s (this module's timeout)" if self.timeout
                 else "the process group's timeout (init_process_group(timeout=...))")
        last = (f"the last complete checkpoint of this run is {self.last_checkpoint!r}"
                if self.last_checkpoint else "no checkpoint was written by this process")
        return ShardExchangeError(
            f"ShardedDiskEmbedding (rank {self.rank} of {self.world}): the {what} exchange "
            f"failed: {str(exc).strip()}\nAnother rank has most likely died, or stopped calling "
            f"forward/backward/checkpoint in step with this one; a collective waits at most "
            f"{bound}. This process group cannot be used any more: end every rank and restart "
            f"them all from the last complete checkpoint (ShardedDiskEmbedding(..., "
            f"resume_from=CHECKPOINT)); a failure never modifies a checkpoint ({last}).")

    def gather_objects(self, obj: Any, what: str) -> list[Any]:
        out: list[Any] = [None] * self.world
        if self.world == 1:
            return [obj]
        self._run(what, dist.all_gather_object, out, obj, bounded=False)
        return out

    def route(self, send_counts: torch.Tensor, refused: int = 0) -> _Route:
        """Exchange the split sizes; ``refused < 0`` tells every rank this one refuses."""
        w = self.world
        vec = send_counts.to(self.device, torch.int64)
        if refused:
            vec = torch.full((w,), refused, dtype=torch.int64, device=self.device)
        if w == 1:
            send = vec.tolist()
            mat, recv = [send], send
        elif self.method == "all_to_all":
            out = torch.empty_like(vec)
            self._run("split sizes (forward)", dist.all_to_all_single, out, vec)
            send, recv, mat = vec.tolist(), out.tolist(), None
        else:
            bufs = [torch.empty_like(vec) for _ in range(w)]
            self._run("split sizes (forward)", dist.all_gather, bufs, vec)
            mat = [b.tolist() for b in bufs]
            send, recv = mat[self.rank], [mat[s][self.rank] for s in range(w)]
        self.stats["counts"] += 8 * (w - 1)
        bad = [s for s in range(w) if recv[s] < 0 and s != self.rank]
        if bad and not refused:
            code = recv[bad[0]]
            raise _REFUSED.get(code, RuntimeError)(
                f"ShardedDiskEmbedding (rank {self.rank}): rank(s) {bad} refused their batch "
                f"(see the error on that rank); no rank changed anything, the process group "
                "is still usable")
        return _Route(send, recv, mat)

    def send(self, x: torch.Tensor, route: _Route, kind: str) -> torch.Tensor:
        """Send ``x`` (rows grouped by destination, ``route.send`` rows each); receive rows."""
        x = x.to(self.device).contiguous()
        item = int(np.prod(x.shape[1:], dtype=np.int64)) * x.element_size()
        self.stats[kind] += item * (sum(route.send) - route.send[self.rank])
        self.stats["self"] += item * route.send[self.rank]
        shape = (sum(route.recv),) + tuple(x.shape[1:])
        if self.world == 1:
            return x
        if self.method == "all_to_all":
            out = torch.empty(shape, dtype=x.dtype, device=self.device)
            self._run(kind, dist.all_to_all_single, out, x, route.recv, route.send)
            return out
        # all_gather fallback: every rank broadcasts its whole send buffer (padded to the
        # longest one); each keeps its own slice of each. W times the traffic of all_to_all.
        mat = route.mat
        longest = max(sum(r) for r in mat)
        pad = torch.zeros((longest,) + tuple(x.shape[1:]), dtype=x.dtype, device=self.device)
        pad[:x.shape[0]] = x
        bufs = [torch.empty_like(pad) for _ in range(self.world)]
        self._run(kind, dist.all_gather, bufs, pad)
        parts = []
        for s in range(self.world):
            lo = sum(mat[s][:self.rank])
            parts.append(bufs[s][lo:lo + mat[s][self.rank]])
        return torch.cat(parts)


# -- the shard and its lookups --------------------------------------------------------------------
class _Core:
    """What forward and backward need: the local shard, the plan, the exchanges."""

    def __init__(self, handle: SharedState, plan: ShardPlan, comm: _Comm, rank: int,
                 padding_idx: int | None, grad_scale: float | None):
        self.handle, self.plan, self.comm, self.rank = handle, plan, comm, rank
        self.pad_local = None
        if padding_idx is not None and int(plan.owner(padding_idx)) == rank:
            self.pad_local = int(plan.local(padding_idx))
        self.grad_scale = grad_scale

    def lookup(self, uniq: torch.Tensor):
        """Rows of the sorted unique global ids ``uniq`` (every rank calls it together).

        Returns ``(rows on uniq's device, saved)``; ``saved`` routes the gradient back.
        """
        comm, plan, st = self.comm, self.plan, self.handle.state
        refused, err = 0, None
        try:
            if st.closed:
                raise ValueError(f"the shard store {str(st.path)!r} is closed; create a new "
                                 "ShardedDiskEmbedding on the same state_dir with "
                                 "resume=True to continue")
            if uniq.numel():
                lo, hi = torch.stack([uniq[0], uniq[-1]]).tolist()
                if lo < 0 or hi >= plan.num_rows:
                    raise IndexError(f"ShardedDiskEmbedding: ids {lo}..{hi} in the batch of "
                                     f"rank {self.rank}; they must lie in [0, {plan.num_rows})")
            ids = uniq.to(comm.device)
            owner = plan.owner(ids)
            order = None
            if plan.kind == "mod" and plan.world_size > 1:
                order = torch.argsort(owner, stable=True)
                ids, owner = ids[order], owner[order]
            counts = torch.bincount(owner, minlength=plan.world_size)
            local = plan.local(ids)
        except (IndexError, TypeError, ValueError) as exc:
            refused, err = _CODES[type(exc)], exc
            counts = torch.zeros(plan.world_size, dtype=torch.int64)
        route = comm.route(counts, refused)
        if err is not None:
            raise err
        comm.stats["lookups"] += 1
        recv_local = comm.send(local, route, "ids")
        host_ids = recv_local.cpu().numpy()
        if comm.device.type == "cuda":
            buf = torch.empty((host_ids.shape[0], st.dim), dtype=_TORCH[st.dtype.name],
                              pin_memory=True)
            dsa_core.gather(st, host_ids, out=buf.numpy())
            rows_out = buf.to(comm.device, non_blocking=True)
        else:
            rows_out = torch.from_numpy(dsa_core.gather(st, host_ids))
        rows = comm.send(rows_out, route.reverse(), "rows")
        if order is not None:
            rows = torch.empty_like(rows).index_copy_(0, order, rows)
        return rows.to(uniq.device), (route, order, recv_local)

    def push_grads(self, grad_rows: torch.Tensor, saved, shape, dev) -> torch.Tensor:
        """Send row gradients to their owners; return this shard's row-sparse gradient."""
        route, order, recv_local = saved
        comm = self.comm
        g = grad_rows.to(comm.device)
        if order is not None:
            g = g.index_select(0, order)
        if self.grad_scale is not None:
            g = g * self.grad_scale
        comm.stats["backwards"] += 1
        recv = comm.send(g, route, "grads")
        ids = recv_local
        if self.pad_local is not None:  # nn.Embedding leaves the padding row out
            keep = ids != self.pad_local
            ids, recv = ids[keep], recv[keep]
        return torch.sparse_coo_tensor(ids.to(dev)[None], recv.to(dev), shape,
                                       check_invariants=False)


_TORCH = {"float32": torch.float32, "float64": torch.float64}


class _ShardedRows(torch.autograd.Function):
    """rows = table[uniq] from their owners; backward: the owners' row-sparse gradients."""

    @staticmethod
    def forward(ctx, weight, uniq, core):
        rows, saved = core.lookup(uniq)
        ctx.core, ctx.saved = core, saved
        ctx.shape, ctx.weight_device = weight.shape, weight.device
        return rows

    @staticmethod
    def backward(ctx, grad_rows):
        grad = ctx.core.push_grads(grad_rows, ctx.saved, ctx.shape, ctx.weight_device)
        ctx.saved = None
        return grad, None, None


class _ShardInit:
    """The rows of one shard of a full-table init (array, tensor, memmap or callable).

    dsa_core.create reads ``init[lo:hi]`` in chunks, so a 100 GB memmapped init never
    enters memory at once.
    """

    def __init__(self, full: Any, plan: ShardPlan, rank: int, dim: int):
        self.full, self.plan, self.rank = full, plan, rank
        self.shape = (plan.local_rows(rank), dim)
        self.dtype = np.dtype(np.float64)
        if not callable(full):
            if tuple(full.shape) != (plan.num_rows, dim):
                raise ValueError(f"init must have shape (num_embeddings, dim) = "
                                 f"({plan.num_rows}, {dim}), got {tuple(full.shape)}")
            dt = full.dtype
            self.dtype = np.dtype(str(dt).replace("torch.", "")) if isinstance(
                dt, torch.dtype) else np.dtype(dt)

    def __getitem__(self, sl: slice) -> np.ndarray:
        lo, hi, _ = sl.indices(self.shape[0])
        gids = self.plan.global_ids(self.rank, np.arange(lo, hi))
        if callable(self.full):
            out = self.full(gids)
        elif isinstance(self.full, torch.Tensor):
            out = self.full.detach()[torch.from_numpy(gids)].cpu().numpy()
        else:
            out = self.full[gids]
        out = np.asarray(out)
        if out.shape != (hi - lo, self.shape[1]):
            raise ValueError(f"init({hi - lo} ids) returned shape {out.shape}, expected "
                             f"({hi - lo}, {self.shape[1]})")
        return out


# -- the module -----------------------------------------------------------------------------------
class ShardedDiskEmbedding(nn.Module):
    r"""A :class:`~adapters.torch.DiskEmbedding` whose rows are sharded over the ranks of a
    ``torch.distributed`` process group (gloo on CPU, NCCL on GPUs).

    Row ``r`` belongs to rank ``r % W`` (``plan="mod"``; ``"range"``: contiguous blocks), at
    local row ``r // W`` of that rank's shard: an ordinary dsa_core store on the rank's local
    disk (``state_dir/rank{k}``, or ``state_dir`` formatted with ``{rank}``), so
    ``dsa_core.open``, ``dsa info`` and every single-process tool work on a shard.

    ``forward`` sends each distinct id of this rank's batch to its owner (one
    ``all_to_all_single`` of split sizes, one of ids), the owners read the rows from disk and
    send them back; ``backward`` sends the row gradients to their owners, where the
    contributions of all ranks are summed (docs/algorithms.md §1.1) into the row-sparse
    gradient of :attr:`weight`, the rank's **shard**. :class:`~adapters.torch.DiskSparseAdam`
    steps it like any DiskEmbedding, so the training loop is unchanged. Under ``torchrun``
    each process calls ``dist.init_process_group("gloo", timeout=timedelta(seconds=60))``;
    this example is one process, a group of one rank:

    >>> import tempfile, torch, torch.distributed as dist
    >>> from adapters.torch_dist import DiskSparseAdam, ShardedDiskEmbedding
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> tmp = tempfile.mkdtemp()
    >>> emb = ShardedDiskEmbedding(1000, 8, state_dir=tmp)    # this rank's shard: tmp/rank0
    >>> opt = DiskSparseAdam(emb.parameters(), lr=1e-2)      # steps this rank's shard
    >>> loss = emb(torch.tensor([[1, 2], [2, 999]])).square().sum()
    >>> loss.backward(); opt.step(); opt.zero_grad()
    >>> emb.store.count, emb.checkpoint(f"{tmp}/ckpt").name
    (1, 'ckpt')
    >>> opt.close(); emb.close()

    Running the script again must say what it wants from the shards it finds: ``resume=True``
    continues them (their rows, moments and step count), ``overwrite=True`` replaces them,
    ``resume_from=`` a checkpoint copies that checkpoint over them:

    >>> ShardedDiskEmbedding(1000, 8, state_dir=tmp)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
        ...
    FileExistsError: ShardedDiskEmbedding: ... Pass resume=True ... or overwrite=True ...
    >>> emb = ShardedDiskEmbedding(1000, 8, state_dir=tmp, resume=True)
    >>> emb.store.count
    1
    >>> emb.close(); dist.destroy_process_group()

    Every rank's shard gets a gradient at every backward (possibly with no row), so every
    shard steps at every ``opt.step()`` and the step counts ``t`` stay equal
    (docs/algorithms.md §1.2). The result equals one process training a
    :class:`DiskEmbedding` on the concatenation of all ranks' batches (with
    ``grad_reduce="sum"``; the order of the duplicate sums may differ at ulp level).

    **Collective calls.** Construction, ``forward`` (with or without grad), ``backward``,
    :meth:`lookup` and :meth:`checkpoint` exchange data: every rank of the group must call
    them, in the same order (as with DDP). A rank with an empty batch still calls them.

    Parameters
    ----------
    num_embeddings, embedding_dim : int
        Shape of the **global** table.
    state_dir : str or Path
        Root of the shards (``state_dir/rank{k}``), or a template holding ``{rank}`` (and
        optionally ``{world_size}``) for per-rank paths such as ``/local/ssd/emb/rank{rank}``.
        Shards already there are refused unless ``resume=True`` or ``overwrite=True`` says
        what to do with them (or ``resume_from=`` replaces them by a checkpoint).
    process_group : ProcessGroup, optional
        The group to shard over (default: the default group, which must be initialized).
    plan : "mod" or "range"
        Ownership plan (see :class:`ShardPlan`); recorded in every shard.
    padding_idx, mode, include_last_offset, curvature, init_scale, dtype, device :
        As :class:`~adapters.torch.DiskEmbedding` (``scale_grad_by_freq`` and ``max_norm``
        are not supported: they depend on the whole global batch).
    init : "normal", "uniform", "zeros", array-like/tensor of shape (n, dim), or callable
        Initial weights of new shards. Named inits draw each shard from its own seed
        (derived from ``seed`` and the rank), so they are not the rows a single process
        would draw with that seed. A full-table array (a ``np.memmap`` is fine: read in
        chunks) or a callable ``init(global_ids: np.ndarray) -> (len, dim) array`` gives the
        same rows at every world size.
    seed : int, optional
        Seed of the named inits (default: drawn from rank 0's torch generator).
    grad_reduce : "sum" or "mean"
        ``"sum"`` (default): the gradient of row r is the sum over ranks, as one process on
        the concatenated batch with the sum of the ranks' losses. ``"mean"``: divided by
        the world size, as DDP does for dense parameters (one process on the concatenated
        batch with the mean of the ranks' losses).
    resume : bool, default False
        Continue the shards found in ``state_dir`` (``init`` and ``seed`` are then unused);
        create them where there are none. They must have been written by a run with this
        world size, plan and table settings (shards of another world size or plan are
        refused: see :mod:`adapters.torch_reshard`). Without ``resume``, ``overwrite`` or
        ``resume_from``, existing shards raise ``FileExistsError``: re-running a script must
        not silently pair a fresh dense model with the old rows and moments.
    resume_from : str or Path, optional
        A checkpoint written by :meth:`checkpoint`: each rank copies its shard from
        ``resume_from/rank{k}`` over its live shard (replacing it as one directory), then
        training resumes exactly from it. It must have this world size and plan (checked
        on every rank before anything is written). Not with ``overwrite``.
    overwrite : bool, default False
        Replace existing shards with new ones. Not with ``resume`` or ``resume_from``.
    exchange : "all_to_all" or "all_gather"
        ``all_to_all_single`` with split sizes (default; gloo and NCCL both have it), or a
        fallback through ``all_gather`` for backends without it (W times the traffic).
    timeout : float (seconds) or timedelta, optional
        Bound on each wait for an exchange of forward/backward (``Work.wait(timeout)``); by
        default, and always for construction and checkpoints (``all_gather_object``), the
        process group's own timeout applies (``init_process_group(timeout=)``, which gloo
        honours too). Either way a dead or stuck peer raises :class:`ShardExchangeError`
        instead of hanging.
    durability : "flush" or "step"
        Passed to ``dsa_core.create`` for new shards.
    second_moment : "elementwise" or "rowwise", default "elementwise"
        As :class:`~adapters.torch.DiskEmbedding`: ``"rowwise"`` keeps one v per row
        (docs/algorithms.md §7.3, ``curvature == 0``). Recorded in every shard; every rank
        must pass the same, and existing shards and checkpoints must match it.
    first_moment : "full" or "bfloat16", default "full"
        As :class:`~adapters.torch.DiskEmbedding`: ``"bfloat16"`` stores m as bfloat16
        (float32, ``curvature == 0``). The stochastic rounding draws its bits from each
        shard's *local* row number, so the rounding (not the math) differs from one process
        and between world sizes, as it does between any two seeds.
    per_row_step, decay_missed_steps : bool, default False
        As :class:`~adapters.torch.DiskEmbedding`: each row's own step count for the bias
        correction, and the catch-up of the decoupled weight decay a row missed. Recorded in
        every shard; every rank must pass the same, and existing shards and checkpoints
        must match. The per-row fields move with their rows when a checkpoint is resharded.
        The weight decay itself is the optimizer's (``DiskSparseAdam(...,
        weight_decay=..., decoupled_weight_decay=...)``); give every rank's optimizer the
        same.
    storage : "auto", "inplace" or "log", default "auto"
        The kind of every shard store (``dsa_core.create``'s ``storage``; every rank must
        pass the same). ``"auto"`` (the default): ``dsa_core.create``'s rule -- a log store when the
        table is larger than the kernel's background-writeback threshold or ``memory`` is
        given, else in place; a resumed store keeps whatever kind it has. ``"log"``: log-structured
        shards, whose in-memory
        region of at most ``memory`` bytes takes the steps and writes evicted rows to disk
        in large sequential appends; training, checkpoints and reshards are bit-identical
        to in-place shards (``durability="step"`` too: each step committed by one append
        to the shard's commit log). Their named
        inits (``"normal"``, ``"uniform"``) are a function of (seed, row), not the rows an
        in-place shard draws (an array or callable ``init`` gives the same rows in both).
        A shard or checkpoint resumed (``resume=True``, ``resume_from=``) must be of the
        kind asked for; ``python -m adapters.torch_reshard ... --storage KIND`` rewrites a
        checkpoint as the other kind.
    memory : int or str, optional
        ``storage="log"`` only: the memory budget of **this rank's shard store** (index,
        buffers and region: docs/storage.md, "Memory"), bytes or
        a string such as ``"4GiB"`` (default: the core's, 25% of this process's memory at
        most). Each rank passes its own (it is not compared across ranks); the unique rows
        a shard receives in one step must fit in it. Refused with ``storage="inplace"``.
    optimizer : "adam", "adagrad" or "rowwise_adagrad", default "adam"
        Whose state the shards' records hold beside the weights (as for
        ``DiskEmbedding``): step the table with ``DiskSparseAdam``, or with
        ``DiskSparseAdagrad`` (``rowwise=True`` for ``"rowwise_adagrad"``). Recorded in every
        shard description and checkpoint manifest; a resume must match it.

    Attributes
    ----------
    weight : DiskWeight
        The data-less stand-in parameter of **this rank's shard**, shape
        ``(local_rows, dim)``; give it (``emb.parameters()``) to DiskSparseAdam. Exclude it
        from DDP (:func:`ddp_ignore`), whose parameters must be the same on every rank.
    store : dsa_core.State
        This rank's shard, as of now: each ``opt.step()`` replaces it by a newer State, and
        the one read before is then outdated (``dsa_core`` refuses to step, flush or
        checkpoint it: :class:`dsa_core.StaleStateError`). Read ``emb.store`` again
        instead of keeping it.
    plan : ShardPlan
    comm_stats : dict
        Cumulative bytes this rank sent to **other** ranks, per kind (``counts``, ``ids``,
        ``rows``, ``grads``), bytes it copied to itself (``self``), and call counts.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, state_dir,
                 process_group=None, plan: str = "mod", padding_idx: int | None = None,
                 mode: str | None = None, curvature: float = 0.0, init: Any = "normal",
                 init_scale: float | None = None, seed: int | None = None,
                 dtype: torch.dtype = torch.float32, include_last_offset: bool = False,
                 device: Any = None, grad_reduce: str = "sum", resume: bool = False,
                 resume_from=None, overwrite: bool = False, exchange: str = "all_to_all",
                 timeout: float | timedelta | None = None, durability: str = "flush",
                 second_moment: str = "elementwise", first_moment: str = "full",
                 per_row_step: bool = False, decay_missed_steps: bool = False,
                 storage: str = STORAGE_DEFAULT, memory: int | str | None = None,
                 optimizer: str = "adam"):
        super().__init__()
        n, d, padding_idx = check_table_args(num_embeddings, embedding_dim, mode, padding_idx)
        storage, memory = check_storage_args(storage, memory, "auto", _WHO)
        if grad_reduce not in ("sum", "mean"):
            raise ValueError(f"grad_reduce must be 'sum' or 'mean', got {grad_reduce!r}")
        if exchange not in _EXCHANGES:
            raise ValueError(f"exchange must be one of {_EXCHANGES}, got {exchange!r}")
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=float(timeout))
        dt = np_dtype(dtype, _WHO)
        c = validation.check_curvature(curvature, what=_WHO)
        optimizer = validation.check_optimizer(optimizer, what=_WHO)
        if optimizer != "adam":
            validation.check_adagrad_options(
                optimizer, curvature=c, second_moment=second_moment, first_moment=first_moment,
                per_row_step=per_row_step, decay_missed_steps=decay_missed_steps, what=_WHO)
        second_moment = validation.check_second_moment(second_moment, c, what=_WHO)
        first_moment = validation.check_first_moment(first_moment, c, dt, what=_WHO)
        for name, flag in (("per_row_step", per_row_step),
                           ("decay_missed_steps", decay_missed_steps)):
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{_WHO}: {name} must be a bool, got {flag!r}")
        rows = {"per_row_step": bool(per_row_step),
                "decay_missed_steps": bool(decay_missed_steps)}
        _check_intent(resume, resume_from, overwrite)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedDiskEmbedding needs torch.distributed: call "
                               "dist.init_process_group(...) first (torchrun sets the "
                               "environment), or use DiskEmbedding in a single process")
        group = process_group if process_group is not None else dist.group.WORLD
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError("this process is not a member of process_group; every rank of "
                             "the group (and only those) builds the ShardedDiskEmbedding")
        backend = str(dist.get_backend(group)).lower()
        comm_device = (torch.device("cuda", torch.cuda.current_device())
                       if "nccl" in backend else torch.device("cpu"))
        comm = _Comm(group, rank, world, comm_device, exchange, timeout)
        sp = ShardPlan(n, world, plan)
        path = shard_path(state_dir, rank, world)
        if init_scale is None:
            init_scale = 1.0 if c == 0 else 1e-3
        meta = shard_meta(sp, rank, {
            "num_embeddings": n, "embedding_dim": d, "dtype": dt.name, "curvature": c,
            "padding_idx": padding_idx, "second_moment": second_moment,
            "first_moment": first_moment, **rows, "optimizer": optimizer})

        # phase 1: look (no writes), agree on what every rank found
        args = (n, d, dt.name, c, plan, padding_idx, grad_reduce, exchange, bool(resume),
                None if resume_from is None else os.fspath(resume_from), bool(overwrite),
                second_moment, first_moment, rows["per_row_step"], rows["decay_missed_steps"],
                storage, optimizer)
        my_seed = int(torch.randint(0, 2**62, (), dtype=torch.int64)) if seed is None \
            else int(seed)
        try:
            found = _inspect(path, meta, resume, resume_from, overwrite, rank, storage)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by _decide
            found = {"error": f"{type(exc).__name__}: {exc}"}
        infos = comm.gather_objects({"args": args, "seed": my_seed, "found": found,
                                     "path": str(path)}, "construction")
        action = _decide(infos, resume, resume_from, overwrite, state_dir)
        shard_seed = int(np.random.SeedSequence([infos[0]["seed"], rank]).generate_state(
            1, np.uint64)[0] % (1 << 62))

        # phase 2: act, then agree that every rank succeeded
        state, err, created = None, None, False
        try:
            if action == "resume_from":
                _copy_shard(shard_path(resume_from, rank, world), path, memory)
                state = _open_checked(path, meta, storage, memory)
            elif action == "open":
                state = _open_checked(path, meta, storage, memory)
            else:
                state = _create_shard(path, sp, rank, d, dt, c, init, init_scale, shard_seed,
                                      padding_idx, overwrite, durability, second_moment,
                                      first_moment, rows, storage, memory, optimizer)
                created = True
                write_shard_meta(path, meta)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            err = f"rank {rank}: {type(exc).__name__}: {exc}"
        oks = comm.gather_objects({"error": err, "count": None if state is None
                                   else int(state.count)}, "construction")
        errors = [o["error"] for o in oks if o["error"]]
        counts = {o["count"] for o in oks}
        if not errors and len(counts) > 1:
            errors = [(f"the shards are at different steps ({[o['count'] for o in oks]} by "
                       "rank): the live state_dir was left inconsistent by a failure; restart "
                       "from a checkpoint with resume_from=CHECKPOINT")]
        if errors:
            if state is not None:
                dsa_core.close(state)
                if created:
                    dsa_core.remove(path)
            raise ValueError("ShardedDiskEmbedding could not be set up on every rank (the "
                             "shards this call created were removed again):\n  "
                             + "\n  ".join(errors))
        if resume_from is not None:
            comm.last_checkpoint = os.fspath(resume_from)

        self._handle = SharedState(state)
        self._finalizer = weakref.finalize(self, close_quietly, [self._handle])
        self._core = _Core(self._handle, sp, comm, rank, padding_idx,
                           None if grad_reduce == "sum" else 1.0 / world)
        self.num_embeddings, self.embedding_dim = n, d
        self.padding_idx, self.mode = padding_idx, mode
        self.include_last_offset = bool(include_last_offset)
        self.grad_reduce = grad_reduce
        self.rank, self.world_size = rank, world
        self.process_group = group
        self.state_dir = os.fspath(state_dir)
        self._meta = meta
        self.weight = DiskWeight(self._handle, dtype, device, what=_WHO, readable=False)

    # -- access ---------------------------------------------------------------------------
    @property
    def store(self) -> dsa_core.State:
        """This rank's shard (``dsa_core.State``; its ``count`` is the step ``t``).

        The current State: read it again after ``opt.step()`` rather than keeping it (the
        one read before is outdated and ``dsa_core`` refuses to step, flush or checkpoint it).
        """
        return self._handle.state

    @property
    def plan(self) -> ShardPlan:
        return self._core.plan

    @property
    def comm_stats(self) -> dict[str, int]:
        """Cumulative bytes sent to other ranks per kind, ``self`` copies, call counts."""
        return dict(self._core.comm.stats)

    def local_ids(self) -> np.ndarray:
        """Global ids of this rank's shard rows, in shard order."""
        return self.plan.global_ids(self.rank, np.arange(self.plan.local_rows(self.rank)))

    def lookup(self, ids) -> torch.Tensor:
        """Rows of global ``ids`` (this rank's own ids), without autograd. **Collective.**"""
        ids = torch.as_tensor(ids)
        flat = ids.reshape(-1).to(torch.int64)
        uniq, inv = torch.unique(flat, sorted=True, return_inverse=True)
        with torch.no_grad():
            rows, _ = self._core.lookup(uniq)
        return rows[inv.to(rows.device)].reshape(tuple(ids.shape) + (self.embedding_dim,))

    def flush(self) -> None:
        """Make this shard's steps durable (local, not collective)."""
        self._handle.flush()

    def close(self) -> None:
        """Flush and close this rank's shard (local). Safe to call twice."""
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def extra_repr(self) -> str:
        s = (f"{self.num_embeddings}, {self.embedding_dim}, rank={self.rank}, "
             f"world_size={self.world_size}, plan={self.plan.kind!r}, "
             f"shard={str(self.store.path)!r}")
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.mode is not None:
            s += f", mode={self.mode!r}"
        if self.store.curvature:
            s += f", curvature={self.store.curvature}"
        return s

    # -- forward --------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """As ``DiskEmbedding.forward`` (``nn.Embedding`` / ``nn.EmbeddingBag``). **Collective.**"""
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64,
                                                                      torch.int32):
            got = input.dtype if isinstance(input, torch.Tensor) else type(input).__name__
            raise TypeError(f"ShardedDiskEmbedding expects integer ids (torch.long or "
                            f"torch.int), got {got}")
        if self.mode is None and (offsets is not None or per_sample_weights is not None):
            raise ValueError("offsets and per_sample_weights are for bag modes; this "
                             "ShardedDiskEmbedding has mode=None")
        uniq, inv = torch.unique(input.reshape(-1), sorted=True, return_inverse=True)
        uniq = uniq.to(torch.int64)
        pad = None
        if self.padding_idx is not None and uniq.numel():
            pos = int(torch.searchsorted(uniq, self.padding_idx))
            if pos < uniq.numel() and int(uniq[pos]) == self.padding_idx:
                pad = pos
        rows = _ShardedRows.apply(self.weight, uniq, self._core)
        inv = inv.view(input.shape)
        if self.mode is None:
            return F.embedding(inv, rows, pad)
        if offsets is not None:
            offsets = offsets.to(torch.int64)
        return F.embedding_bag(inv, rows, offsets, None, 2.0, False, self.mode, False,
                               per_sample_weights, self.include_last_offset, pad)

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint(self, dest, *, overwrite: bool = False) -> Path:
        """Write a consistent snapshot of every shard under ``dest``. **Collective.**

        Each rank writes ``dest/rank{k}`` (``dsa_core.checkpoint``: copy, fsync, atomic
        rename) plus its ``shard.json``; once every rank succeeded, each writes
        ``dest/dsa-sharded.json`` (world size, plan, count), the mark of a complete
        checkpoint. On several machines, each machine's ``dest`` holds its ranks' shards and
        a copy of the manifest. Resume with ``ShardedDiskEmbedding(..., resume_from=dest)``.
        Prefer a new ``dest`` per checkpoint: ``overwrite=True`` first withdraws the old
        manifest, so a failure in the middle leaves no complete checkpoint there.
        """
        comm, st = self._core.comm, self._handle.state
        dest = Path(dest)
        mine = dest / f"rank{self.rank}"
        err: Exception | None = None
        if st.closed:
            err = ValueError("the shard is closed")
        elif not st.current:
            err = dsa_core.StaleStateError(
                f"the shard's State is outdated (step {st.count}; the store has moved on "
                "through a State that this module never saw, e.g. dsa_core.step(emb.store, "
                "...)): step shards only with DiskSparseAdam. Close it and build the module "
                "again with resume=True, or resume_from=CHECKPOINT")
        elif (mine.exists() or (dest / MANIFEST_FILE).exists()) and not overwrite:
            err = FileExistsError(f"{str(dest)!r} already holds a checkpoint; pass "
                                  "overwrite=True or choose a new directory")
        _agree(comm, err, "checkpoint")
        if overwrite:
            try:
                (dest / MANIFEST_FILE).unlink(missing_ok=True)
                err = None
            except OSError as exc:
                err = exc
            _agree(comm, err, "checkpoint")
        try:
            dsa_core.checkpoint(st, mine, overwrite=overwrite)
            write_shard_meta(mine, self._meta)
            err = None
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            err = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        counts = comm.gather_objects({"error": err, "count": int(st.count)}, "checkpoint")
        errors = [c["error"] for c in counts if c["error"]]
        if len({c["count"] for c in counts}) > 1:
            errors.append(f"the shards are at different steps: {[c['count'] for c in counts]}")
        if errors:
            raise RuntimeError("sharded checkpoint failed (no manifest written; it is not "
                               "a complete checkpoint):\n  " + "\n  ".join(errors))
        try:
            write_manifest(dest, manifest(self.plan, self._meta, st.count))
            err = None
        except OSError as exc:
            err = exc
        _agree(comm, err, "checkpoint")
        comm.last_checkpoint = str(dest)
        return dest

    # -- module plumbing ------------------------------------------------------------------
    def _apply(self, fn, recurse=True):
        """``to()`` / ``cuda()`` move :attr:`weight`; the shard stays on disk."""
        return move_disk_weight(self, fn, _WHO)

    def get_extra_state(self) -> dict:
        """This rank's shard manifest (flushed first); rows never enter a state dict."""
        self._handle.flush()
        m = dict(self._meta)
        m.update(format=_EXTRA_FORMAT, path=str(self._handle.state.path),
                 count=int(self._handle.state.count))
        return m

    def set_extra_state(self, state: Any) -> None:
        """Check that a saved manifest describes this shard (same table, rank and plan)."""
        if not isinstance(state, dict) or state.get("format") != _EXTRA_FORMAT:
            raise ValueError("not a ShardedDiskEmbedding state dict entry")
        keys = ("world_size", "rank", "plan", "num_embeddings", "embedding_dim", "dtype",
                "curvature", "second_moment", "first_moment", "per_row_step",
                "decay_missed_steps")
        have, want = self._meta, {**state, **table_of(state)}
        bad = [k for k in keys if have[k] != want.get(k)]
        if bad:
            raise ValueError("the saved ShardedDiskEmbedding differs in " + ", ".join(
                f"{k} (saved {want.get(k)!r}, here {have[k]!r})" for k in bad))

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "_extra_state"
        try:
            if key in state_dict:
                self.set_extra_state(state_dict[key])
            elif strict:
                missing_keys.append(key)
        except ValueError as exc:
            error_msgs.append(str(exc))
        if strict:
            for k in state_dict:
                if k.startswith(prefix) and k != key and "." not in k[len(prefix):]:
                    unexpected_keys.append(k)


def ddp_ignore(model: nn.Module) -> list[str]:
    """Tell DDP to leave every ShardedDiskEmbedding's weight of ``model`` alone.

    Call it before ``DistributedDataParallel(model)``: the shards differ from rank to rank
    (DDP would refuse them, or average them). Returns the ignored names.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    for mname, m in model.named_modules():
        if isinstance(m, ShardedDiskEmbedding):
            fqn = f"{mname}.weight" if mname else "weight"
            if fqn not in names:
                names.append(fqn)
    DDP._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


# -- construction helpers -------------------------------------------------------------------------
def _agree(comm: _Comm, err: Exception | None, what: str) -> None:
    """Every rank learns every rank's error; all raise together, or none does.

    All raise the type of the first rank's error (a ``FileExistsError``, ``ValueError`` or
    ``StaleStateError`` keeps its type; anything else becomes a ``RuntimeError``), with every
    rank's message.
    """
    mine = None if err is None else (type(err).__name__, f"rank {comm.rank}: {err}")
    errs = [e for e in comm.gather_objects(mine, what) if e]
    if errs:
        exc_type = _AGREED.get(errs[0][0], RuntimeError)
        raise exc_type(f"sharded {what} refused on every rank:\n  "
                       + "\n  ".join(m for _, m in errs))


_AGREED = {"FileExistsError": FileExistsError, "ValueError": ValueError,
           "StaleStateError": dsa_core.StaleStateError}


def _check_intent(resume: Any, resume_from: Any, overwrite: Any) -> None:
    """What to do with shards already on disk: at most one of the three ways."""
    for name, v in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(v, bool):
            raise TypeError(f"{_WHO}: {name} must be True or False, got {v!r}")
    if resume and overwrite:
        raise ValueError(f"{_WHO}: resume=True and overwrite=True contradict each other: "
                         "resume continues the shards in state_dir, overwrite replaces them "
                         "with new ones. Pass one of them")
    if overwrite and resume_from is not None:
        raise ValueError(f"{_WHO}: resume_from= copies a checkpoint over the shards in "
                         "state_dir and overwrite=True starts new ones: pass one of them")


def _join(errors: list[tuple[int, str]]) -> str:
    """One line per distinct message, with the ranks that gave it."""
    by: dict[str, list[int]] = {}
    for k, msg in errors:
        by.setdefault(msg, []).append(k)
    return "\n  ".join(f"rank {ks[0]}: {m}" if len(ks) == 1 else f"ranks {ks}: {m}"
                       for m, ks in by.items())


def _inspect(path: Path, meta: dict, resume: bool, resume_from, overwrite: bool,
             rank: int, storage: str) -> dict:
    """What this rank finds on disk; reads only (nothing when it will not use the shard).

    A shard or checkpoint shard to be continued must match this run's table settings and
    be of the store kind asked for (``storage``).
    """
    out: dict[str, Any] = {}
    if resume_from is not None:
        man = read_manifest(resume_from)
        if man["plan"] != meta["plan"]:
            raise ValueError(
                f"checkpoint {os.fspath(resume_from)!r} was written with {describe_plan(man)}; "
                f"this run has {describe_plan(meta)}. Reshard it offline first: python -m "
                f"adapters.torch_reshard {os.fspath(resume_from)} NEW_DIR --world-size "
                f"{meta['world_size']}, then resume_from=NEW_DIR")
        src = shard_path(resume_from, rank, meta["world_size"])
        if src.resolve() == path.resolve():
            raise ValueError(f"resume_from {os.fspath(resume_from)!r} is the state_dir itself; "
                             "resume into another state_dir (the checkpoint is copied), or "
                             "pass state_dir=CHECKPOINT, resume=True (without resume_from) "
                             "to train in it")
        check_shard_meta(f"checkpoint shard {str(src)!r}", read_shard_meta(src), meta)
        snap = dsa_core.open(src, mode="r")
        try:
            _check_kind(snap, storage, f"checkpoint shard {str(src)!r}")
            if snap.count != man["count"] or snap.num_rows != meta["local_rows"]:
                raise ValueError(
                    f"checkpoint shard {str(src)!r} is at step {snap.count} with "
                    f"{snap.num_rows} rows; the manifest says step {man['count']} with "
                    f"{meta['local_rows']} rows (was the checkpoint modified after it was "
                    "written?)")
        finally:
            dsa_core.close(snap)
        out["count"] = man["count"]
        return out
    out["exists"] = (path / "manifest.json").exists()
    if out["exists"] and resume:  # only a shard to be continued needs to match this run
        check_shard_meta(f"shard {str(path)!r}", read_shard_meta(path), meta)
        snap = dsa_core.open(path, mode="r")
        try:
            _check_kind(snap, storage, f"shard {str(path)!r}")
        finally:
            dsa_core.close(snap)
    return out


def _check_kind(state: dsa_core.State, storage: str, where: str) -> None:
    """``ValueError`` unless a shard (or checkpoint shard) is of the kind ``storage``
    (``"auto"``: any kind, the one chosen when the shard was created)."""
    check_kind(state, storage, where, fix=(
        f"or rewrite a checkpoint as the other kind: python -m adapters.torch_reshard SRC "
        f"DEST --world-size W --storage {storage} (W: the same or another world size), then "
        "resume_from=DEST; or overwrite=True to start new shards"))


def _decide(infos: list[dict], resume: bool, resume_from, overwrite: bool,
            state_dir) -> str:
    """What every rank does, from what every rank found (the same on every rank)."""
    args = {repr(i["args"]) for i in infos}
    if len(args) > 1:
        raise ValueError("the ranks built ShardedDiskEmbedding with different arguments "
                         f"({sorted(args)}); every rank must pass the same ones")
    errors = [(k, i["found"]["error"]) for k, i in enumerate(infos) if "error" in i["found"]]
    if errors:
        raise ValueError("ShardedDiskEmbedding refused (checked on every rank; nothing "
                         "was written):\n  " + _join(errors))
    if resume_from is not None:
        return "resume_from"
    found = [i["found"]["exists"] for i in infos]
    have = [k for k, f in enumerate(found) if f]
    miss = [k for k, f in enumerate(found) if not f]
    if overwrite or not have:
        return "create"
    if not resume:
        ranks = "every rank" if not miss else f"ranks {have}"
        raise FileExistsError(
            f"{_WHO}: state_dir {os.fspath(state_dir)!r} already holds shards ({ranks} found "
            f"one, e.g. {infos[have[0]]['path']!r}). Pass resume=True to continue training "
            "them (their rows, moments and step count; init is then unused), or "
            "overwrite=True to replace them with new shards; or give this run another "
            "state_dir. Nothing was written")
    if not miss:
        return "open"
    raise ValueError(
        f"{_WHO} refused: ranks {have} found their shards but ranks {miss} found none "
        f"(e.g. {infos[miss[0]]['path']!r}). The state_dir was written by a run with fewer "
        "ranks, or some machine lacks its shards; resume from a checkpoint (resuming with "
        "another world size needs python -m adapters.torch_reshard), or pass overwrite=True "
        "to start afresh. Nothing was written")


def _open_checked(path: Path, meta: dict, storage: str,
                  memory: int | None) -> dsa_core.State:
    """Open a shard for writing (``memory``: a log store's region budget) and check it."""
    st = dsa_core.open(path, memory=memory)  # memory is None unless storage == "log"
    try:
        _check_kind(st, storage, f"shard {str(path)!r}")
    except BaseException:
        dsa_core.close(st)
        raise
    have = (st.num_rows, st.dim, st.dtype.name, st.curvature, st.has_weights,
            *store_settings(st).values())
    want = (meta["local_rows"], meta["embedding_dim"], meta["dtype"], meta["curvature"], True,
            meta["second_moment"], meta["first_moment"], meta["per_row_step"],
            meta["decay_missed_steps"], meta.get("optimizer", "adam"))
    if have != want:
        dsa_core.close(st)
        raise ValueError(f"shard {str(path)!r} holds a {have[0]} x {have[1]} {have[2]} store "
                         f"(curvature {have[3]}, weights {have[4]}, second_moment "
                         f"{have[5]!r}, first_moment {have[6]!r}, per_row_step {have[7]}, "
                         f"decay_missed_steps {have[8]}, optimizer {have[9]!r}); expected "
                         f"{want}")
    return st


def _kind_of(path: Path) -> str:
    """The kind of the store at ``path`` (``"inplace"`` or ``"log"``), read-only."""
    snap = dsa_core.open(path, mode="r", unclean="accept")  # replaced: its rows do not matter
    try:
        return snap.storage
    finally:
        dsa_core.close(snap)


def _copy_shard(src: Path, dest: Path, memory: int | None) -> None:
    """Copy a checkpoint shard over the live one; the source is untouched.

    Built beside ``dest`` and swapped in as one directory (``dsa_core.checkpoint_many``:
    its files copied with the checkpoint copy, which reads the source with ``O_DIRECT``,
    fsyncs the copies and leaves the page cache as it found it), so ``dest`` is the old
    shard or the checkpoint's, never a mix. A live shard that another writer holds is
    refused (``StoreLockedError``) before the swap (a live log shard is opened for that
    with ``memory``, its region budget).
    """
    with dsa_core.checkpoint_many(dest, {".": src}, overwrite=True) as tmp:
        if (dest / "manifest.json").exists():  # raises while another writer holds it
            live_mem = memory if _kind_of(dest) == "log" else None
            dsa_core.close(dsa_core.open(dest, memory=live_mem, unclean="accept"))


def _create_shard(path: Path, plan: ShardPlan, rank: int, d: int, dt: np.dtype, c: float,
                  init: Any, init_scale: float, seed: int, padding_idx: int | None,
                  overwrite: bool, durability: str, second_moment: str = "elementwise",
                  first_moment: str = "full", rows: dict | None = None,
                  storage: str = STORAGE_DEFAULT, memory: int | None = None,
                  optimizer: str = "adam") -> dsa_core.State:
    n = plan.local_rows(rank)
    rows = rows or {"per_row_step": False, "decay_missed_steps": False}
    if isinstance(init, str):
        if init not in validation.INIT_NAMES:
            raise ValueError(f"init must be 'normal', 'uniform', 'zeros', an array of shape "
                             f"(num_embeddings, dim) or a callable; got {init!r}")
        src = None if init == "zeros" else init
    elif init is None:
        src = None
    else:
        src = _ShardInit(init, plan, rank, d)
    st = dsa_core.create(path, n, d, curvature=c, dtype=dt.name, weights=True, init=src,
                         init_scale=init_scale, seed=seed, overwrite=overwrite,
                         durability=durability, progress=False, second_moment=second_moment,
                         first_moment=first_moment, **rows, storage=storage, memory=memory,
                         # the optimizer sets the decay at each step; a store that catches
                         # up decay is created with the decoupled kind
                         decoupled_weight_decay=rows["decay_missed_steps"],
                         optimizer=optimizer)
    if padding_idx is not None and int(plan.owner(padding_idx)) == rank:
        zero_weight_row(st, int(plan.local(padding_idx)))
    return st
