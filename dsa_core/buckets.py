"""Partition-ordered training: edge buckets, a near-optimal bucket order, streamed batches.

A step that touches random rows of a table larger than memory runs at the disk's random-read
rate. For edge-list workloads (skip-gram / Node2Vec walks, TransE, DistMult, ComplEx) the
rows a batch touches can be chosen instead: split the node ids into ``P`` contiguous
partitions and the edges into ``P * P`` buckets (bucket ``(i, j)``: source in partition
``i``, destination in partition ``j``), keep ``c`` partitions in memory, and train bucket by
bucket in an order that swaps few partitions (BETA, from Marius). Partitions entering the
buffer are read sequentially ahead of use and leaving ones written back sequentially
(``dsa_core.load_range`` / ``dsa_core.release_range``), so the disk sees streams, not seeks.

>>> import numpy as np
>>> from dsa_core import buckets
>>> edges = np.random.default_rng(0).integers(0, 100, size=(1000, 2))
>>> plan = buckets.plan(edges, 100, partitions=4, buffer=2)
>>> plan.bounds
array([  0,  25,  50,  75, 100])
>>> plan.order(epoch=0)
Order(P=4, c=2, buckets=16, loads=7, lower_bound=7)
>>> seen = 0
>>> for batch in plan.batches(128, negatives=5):
...     src, dst = batch.edges[:, 0], batch.edges[:, 1]   # all from bucket batch.bucket
...     seen += len(batch.edges)
>>> seen, batch.negatives.shape[1]
(1000, 5)

With stores (``plan.batches(..., stores=[state])``) the iterator issues the loads and
releases of each store's partitions itself, and of the negatives' pools
(``dsa_core.load_rows`` / ``dsa_core.release_rows``). The user guide is ``docs/buckets.md``.
"""

from __future__ import annotations

import json
import operator
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

import dsa_core

from . import _bucket_order, _paging
from . import _validation as validation
from ._os import fsync_fd, fsync_path

__all__ = ["DEFAULT_POOL", "DEFAULT_POOL_SHARE", "DEFAULT_RESERVE", "POOL_RATE", "Batch",
           "BatchIterator", "Fit", "Order", "Plan", "fit", "open_plan", "plan"]

_PLAN_FORMAT = "dsa_core.buckets.plan"
_ITER_KIND = "dsa_core.buckets.BatchIterator"
_ITER_VERSION = 2  # 2: pool and pool_share (a version 1 state dict drew no pool)
# stream tags of the seeded generators, last and nonzero so that no two streams share a seed
_ORDER, _SHUFFLE, _NEGATIVES, _POOL = 1, 2, 3, 4
# The negatives' pool (Plan.batches' pool=, pool_share=): rows drawn from all partitions per
# buffer state, and the share of each edge's negatives drawn from it. The default share (None)
# is min(1, POOL_RATE * pool / num_nodes): a pool row is then drawn as a negative at most
# POOL_RATE times as often, during its state, as a row is in random order. Measured in
# docs/notebook.md ("Partition-ordered training: negatives from a pool").
DEFAULT_POOL = 4096
DEFAULT_POOL_SHARE = None
POOL_RATE = 16


# -- argument checks -----------------------------------------------------------------------
def _int(value: Any, name: str, low: int, hint: str = "") -> int:
    """``value`` as an int >= ``low`` (bools refused), else a TypeError / ValueError."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an int >= {low}, got {value!r}{hint}")
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int >= {low}, got {value!r} "
                        f"({type(value).__name__}){hint}") from None
    if v < low:
        raise ValueError(f"{name} must be an int >= {low}, got {v}{hint}")
    return int(v)


def _check_edges(edges: Any):
    if not isinstance(edges, np.ndarray):  # np.memmap is an ndarray: never copied here
        edges = np.asarray(edges)
    if edges.ndim != 2 or edges.shape[1] not in (2, 3):
        raise ValueError("edges must be an (E, 2) array of (source, destination) or an (E, 3) "
                         f"array of (head, relation, tail), got shape {edges.shape}")
    if not np.issubdtype(edges.dtype, np.integer):
        raise TypeError(f"edges must hold integer node ids, got dtype {edges.dtype}; convert "
                        "them with edges.astype(np.int64) (after checking they are whole)")
    return edges


def _check_pool(pool: Any, share: Any, negatives: int, num_nodes: int) -> tuple[int, float]:
    """``(rows in the pool, share)`` as the iterator uses them: ``(0, 0.0)`` when no
    negative comes from a pool (no negatives, ``pool=0`` or ``pool_share=0``)."""
    pool = _int(pool, "pool", 0, " (rows in the negatives' pool; 0: negatives from the "
                "buffer only)")
    if share is None:  # the default: as much of the pool as keeps its rows' rate bounded
        pool = min(pool, num_nodes)
        share = min(1.0, POOL_RATE * pool / num_nodes)
    if isinstance(share, bool | np.bool_) or not isinstance(share, int | float | np.integer
                                                            | np.floating):
        raise TypeError(f"pool_share must be a number in [0, 1] (the probability that a "
                        f"negative comes from the pool), got {share!r} "
                        f"({type(share).__name__})")
    share = float(share)
    if not 0.0 <= share <= 1.0:  # NaN fails too
        raise ValueError(f"pool_share must lie in [0, 1] (the probability that a negative "
                         f"comes from the pool), got {share!r}")
    if not (negatives and pool and share):
        return 0, 0.0
    return min(pool, num_nodes), share


# -- the plan ------------------------------------------------------------------------------
class Order(NamedTuple):
    """One epoch's bucket order (see :meth:`Plan.order`).

    Attributes
    ----------
    buckets : ndarray
        ``(P*P, 2)`` int64 partition pairs ``(i, j)`` in training order, each once.
    buffers : list of tuple
        For each bucket, the sorted partitions resident while it trains (at most ``c``,
        both of its partitions among them).
    loads : int
        Partition loads of the epoch, the initial fill included.
    lower_bound : int
        The fewest loads any order with a ``c``-partition buffer can have.
    """

    buckets: np.ndarray
    buffers: list
    loads: int
    lower_bound: int

    def __repr__(self) -> str:
        P = int(round(len(self.buckets) ** 0.5))
        c = max((len(b) for b in self.buffers), default=0)  # all P resident: any c >= P
        return (f"Order(P={P}, c{'>=' if c == P else '='}{c}, buckets={len(self.buckets)}, "
                f"loads={self.loads}, lower_bound={self.lower_bound})")


class Plan:
    """Edges bucketed by partition pair, with the partition bounds and the bucket order.

    Made by :func:`plan` (or :func:`open_plan` for one saved with ``out=``).

    Attributes
    ----------
    num_nodes, num_partitions, buffer, seed, num_edges : int
        ``num_partitions`` is P, ``buffer`` is c.
    bounds : ndarray
        ``(P+1,)`` int64: partition ``p`` holds node (table row) ids
        ``[bounds[p], bounds[p+1])``; sizes differ by at most 1.
    edges : ndarray or np.memmap
        ``(E, 2|3)`` in the input dtype, sorted by bucket (stable: edges of one bucket keep
        their input order); a read-only memmap when the plan was built with ``out=``.
    offsets : ndarray
        ``(P*P + 1,)`` int64: bucket ``(i, j)`` is ``edges[offsets[i*P+j]:offsets[i*P+j+1]]``.
    bucket_sizes : ndarray
        ``(P, P)`` int64 edges per bucket.
    path : Path or None
        The ``out`` directory holding ``edges``, or None when they are in memory.
    """

    def __init__(self, *, num_nodes, num_partitions, buffer, seed, edges, offsets, path=None):
        self.num_nodes = int(num_nodes)
        self.num_partitions = int(num_partitions)
        self.buffer = int(buffer)
        self.seed = int(seed)
        self.edges = edges
        self.offsets = np.asarray(offsets, np.int64)
        self.num_edges = int(self.offsets[-1])
        self.path = None if path is None else Path(path)
        P = self.num_partitions
        self.bounds = _bounds(self.num_nodes, P)
        self.bucket_sizes = np.diff(self.offsets).reshape(P, P)
        self._orders: dict[int, tuple] = {}

    def __repr__(self) -> str:
        where = "in memory" if self.path is None else f"at {str(self.path)!r}"
        sizes = self.bucket_sizes
        return (f"Plan(num_nodes={self.num_nodes:,}, num_edges={self.num_edges:,}, "
                f"P={self.num_partitions}, c={self.buffer}, seed={self.seed}, "
                f"columns={self.edges.shape[1]}, largest bucket={int(sizes.max()):,} edges, "
                f"epoch loads={_bucket_order.beta_loads(self.num_partitions, self.buffer)} "
                f"(lower bound "
                f"{_bucket_order.lower_bound(self.num_partitions, self.buffer)}), "
                f"edges {where})")

    def partition_of(self, ids) -> np.ndarray:
        """Partition index of each node id (same shape as ``ids``).

        >>> p = plan([[0, 9]], 10, partitions=3)
        >>> p.bounds, p.partition_of([0, 2, 3, 9])
        (array([ 0,  3,  6, 10]), array([0, 0, 1, 2]))
        """
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must be integer node ids, got dtype {ids.dtype}")
        bad = (ids < 0) | (ids >= self.num_nodes)
        if bad.any():
            first = ids.ravel()[np.flatnonzero(bad.ravel())[0]]
            raise ValueError(f"node ids must lie in [0, num_nodes={self.num_nodes}), got "
                             f"{int(first)}")
        return np.searchsorted(self.bounds, ids.astype(np.int64), side="right") - 1

    def _epoch_order(self, epoch: int) -> tuple:
        """``(buckets, state_of, states, loads)`` of ``epoch`` (cached: a few recent ones)."""
        got = self._orders.get(epoch)
        if got is None:
            rng = np.random.default_rng([self.seed, epoch, _ORDER])
            got = _bucket_order.order_buckets(self.num_partitions, self.buffer, rng)
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = got
        return got

    def order(self, epoch: int = 0) -> Order:
        """The bucket order of ``epoch``: BETA on a permutation of the partition labels
        seeded by ``(seed, epoch)``; buckets that become available at the same swap are
        shuffled. Same ``(seed, epoch)``, same order.

        >>> o = plan([[0, 1]], 40, partitions=8, buffer=3).order(epoch=2)
        >>> len(o.buckets), o.loads, o.lower_bound
        (64, 17, 16)
        """
        epoch = _int(epoch, "epoch", 0)
        buckets, state_of, states, loads = self._epoch_order(epoch)
        return Order(buckets.copy(), [states[s] for s in state_of], loads,
                     _bucket_order.lower_bound(self.num_partitions, self.buffer))

    def batches(self, batch_size: int, *, negatives: int = 0, epoch: int = 0,
                epochs: int = 1, stores: Sequence = (), start=None, mix: str = "bucket",
                pad: bool = False, pool: int = DEFAULT_POOL,
                pool_share: float | None = DEFAULT_POOL_SHARE) -> BatchIterator:
        """Iterate over the edges buffer state by buffer state, ``epochs`` epochs from
        ``epoch``.

        Parameters
        ----------
        batch_size : int
            Edges per batch (>= 1); the last batch of a bucket (``mix="bucket"``) or of a
            buffer state (``mix="buffer"``) may be shorter, unless ``pad``.
        negatives : int
            Negative node ids drawn per edge (>= 0), i.i.d.: each from the pool with
            probability ``pool_share``, else uniform over the rows of the partitions
            resident in the buffer.
        epoch, epochs : int
            The first epoch (its number seeds the order and the shuffles) and how many.
        stores : sequence of dsa_core.State
            Stores whose rows are the node ids (``num_rows == num_nodes``): the iterator
            requests each partition's rows with ``dsa_core.load_range`` before its first
            bucket (the partition entering at the next swap while the current buffer
            trains: plan for c + 1 partitions of memory) and hands leaving ones back with
            ``dsa_core.release_range``. It never waits on them. Hints only: the values
            trained are the same with or without stores.
        start : dict or tuple, optional
            Resume from ``it.state_dict()`` (checked against this plan and these
            parameters) or from a position ``(epoch, bucket_index, batch_index)``.
        mix : {"bucket", "buffer"}
            ``"bucket"``: bucket by bucket, each bucket's edges shuffled, no batch mixes
            buckets. ``"buffer"``: the edges of all the buckets that train during one buffer
            state (consecutive buckets of the order with the same resident partitions) are
            shuffled together, so a batch mixes those buckets; it still touches only
            resident partitions. Memory: one state's edges (``c*c`` buckets for the first
            state of an epoch, at most ``2c - 1`` for each later one) instead of one
            bucket's, and a leaving partition is released at the swap, not earlier.
        pad : bool
            Pad every short batch to exactly ``batch_size`` rows (fixed shapes for a jitted
            loss) by repeating its own edges with their negatives; ``Batch.weight`` is 0 on
            those rows. A weighted loss then has the gradients of the unpadded batch, and
            no id outside the real rows is touched.
        pool : int
            Rows in the negatives' pool (>= 0; at most ``num_nodes`` are used): for each
            buffer state, ``min(pool, num_nodes)`` distinct rows drawn uniformly from all
            partitions, the same for every batch of the state (``Batch.pool``, sorted). A
            pool negative is uniform over the pool, so over the states uniform over all
            nodes: it restores what negatives restricted to the buffer lose (docs/buckets.md,
            "Negatives"). With stores, the iterator loads each state's pool with
            ``dsa_core.load_rows`` (a log store pins it in its region like a partition) a
            state ahead -- the next state's while the current one trains, both at the first
            -- and releases it (``dsa_core.release_rows``) when its state ends: ``2 * pool``
            rows of memory beside the partitions (``fit(..., pool=)`` counts them; a log
            store's region must hold them, or the iterator refuses it up front). ``0``:
            every negative from the buffer (the behaviour before the pool existed).
        pool_share : float or None
            In ``[0, 1]``: the probability that a negative comes from the pool (``0``: none
            does, as ``pool=0``; ``1``: all do, uniform over all nodes in expectation).
            None (the default): ``min(1, POOL_RATE * min(pool, num_nodes) / num_nodes)``
            with ``POOL_RATE = 16``: all negatives from the pool when it holds at least
            1/16 of the nodes, else a share that keeps each pool row's rate as a negative,
            during its state, at most 16 times what random order gives every row (a higher
            rate cost quality in the measurements). ``it.pool_share`` is the share used.

        Returns
        -------
        BatchIterator
            Yields :class:`Batch` ``(edges, negatives, bucket, position, partitions,
            weight, pool)``.

        Examples
        --------
        >>> edges = np.random.default_rng(0).integers(0, 100, size=(1000, 2))
        >>> p = plan(edges, 100, partitions=4, buffer=2)
        >>> b = next(p.batches(128, negatives=3, mix="buffer"))
        >>> b.bucket, b.position, b.partitions    # the first state: partitions 1 and 3
        (None, (0, 0, 0), (1, 3))
        >>> sorted({tuple(q) for q in p.partition_of(b.edges).tolist()})  # its 4 buckets mixed
        [(1, 1), (1, 3), (3, 1), (3, 3)]
        >>> len(p.batches(128)), len(p.batches(128, mix="buffer"))  # fewer short batches
        (16, 10)
        >>> padded = list(p.batches(128, mix="buffer", pad=True))
        >>> {len(b.edges) for b in padded}, int(sum(b.weight.sum() for b in padded))
        ({128}, 1000)
        """
        return BatchIterator(self, batch_size, negatives=negatives, epoch=epoch,
                             epochs=epochs, stores=stores, start=start, mix=mix, pad=pad,
                             pool=pool, pool_share=pool_share)


def _bounds(num_nodes: int, P: int) -> np.ndarray:
    return (np.arange(P + 1, dtype=np.int64) * num_nodes) // P


def plan(edges, num_nodes: int, *, partitions: int, buffer: int = 2, seed: int = 0,
         out=None, chunk_edges: int = 1 << 22) -> Plan:
    """Bucket ``edges`` by partition pair for partition-ordered training.

    Parameters
    ----------
    edges : array_like or np.memmap
        ``(E, 2)`` (source, destination) or ``(E, 3)`` (head, relation, tail) integer node
        ids in ``[0, num_nodes)``; the relation column is carried unchanged. A memmap may be
        larger than memory: it is read ``chunk_edges`` rows at a time.
    num_nodes : int
        Rows of the tables the ids index (>= 1).
    partitions : int
        P, in ``[1, num_nodes]``: partition ``p`` is the contiguous id range
        ``[p*num_nodes//P, (p+1)*num_nodes//P)``.
    buffer : int
        c >= 2, the partitions held in memory at once (c >= P: all of them, one state).
    seed : int
        Seeds the partition relabelling of each epoch's order, the shuffles and negatives.
    out : path, optional
        A directory (absent or empty) for the bucketed copy of the edges, written as
        ``edges.npy`` (opened as a read-only memmap), ``offsets.npy`` and ``plan.json``; it
        appears complete or not at all. None keeps the copy in memory.
    chunk_edges : int
        Edges read per chunk of the two passes (memory: O(P*P + chunk_edges)).

    Returns
    -------
    Plan

    Raises
    ------
    ValueError, TypeError
        Bad shapes, dtypes or parameters, and any id out of range (the first one and its
        edge index named), before anything is written.

    Notes
    -----
    A stable counting sort in two chunked passes: the first checks the ids and counts each
    bucket, the second writes each chunk's edges at their bucket's cursor.
    """
    num_nodes = _int(num_nodes, "num_nodes", 1)
    P = _int(partitions, "partitions", 1)
    if P > num_nodes:
        raise ValueError(f"partitions must be <= num_nodes = {num_nodes} (each partition "
                         f"needs a node), got {P}")
    c = _int(buffer, "buffer", 2, "; the buffer holds the two partitions of a bucket at "
             "least")
    seed = _int(seed, "seed", 0)
    chunk = _int(chunk_edges, "chunk_edges", 1)
    edges = _check_edges(edges)
    out = None if out is None else Path(out)
    if out is not None and out.exists() and (not out.is_dir() or any(out.iterdir())):
        hint = ("; it holds a plan: open it with buckets.open_plan(out)"
                if (out / "plan.json").exists() else "")
        raise FileExistsError(f"out must be a new or empty directory, {str(out)!r} is not"
                              f"{hint}; or pass another path")
    E, cols = edges.shape
    bounds = _bounds(num_nodes, P)

    def chunks():
        for lo in range(0, E, chunk):
            ch = np.asarray(edges[lo:lo + chunk])
            yield lo, ch, _bucket_ids(ch, lo, bounds, num_nodes, P)

    counts = np.zeros(P * P, np.int64)  # pass 1: check every id, count every bucket
    for _, _, b in chunks():
        counts += np.bincount(b, minlength=P * P)
    offsets = np.zeros(P * P + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])

    def fill(target):  # pass 2: stable scatter of each chunk at its buckets' cursors
        cursor = offsets[:-1].copy()
        for _, ch, b in chunks():
            order = np.argsort(b, kind="stable")
            bs = b[order]
            cnt = np.bincount(b, minlength=P * P)
            first = np.cumsum(cnt) - cnt
            target[cursor[bs] + (np.arange(len(bs)) - first[bs])] = ch[order]
            cursor += cnt

    meta = {"format": _PLAN_FORMAT, "version": 1, "num_nodes": num_nodes,
            "num_partitions": P, "buffer": c, "seed": seed, "num_edges": E, "columns": cols,
            "dtype": edges.dtype.str}
    if out is None:
        target = np.empty((E, cols), edges.dtype)
        fill(target)
        return Plan(num_nodes=num_nodes, num_partitions=P, buffer=c, seed=seed,
                    edges=target, offsets=offsets)
    with dsa_core.tools.staged_dir(out, overwrite=out.exists()) as tmp:
        if E:
            target = np.lib.format.open_memmap(tmp / "edges.npy", mode="w+",
                                               dtype=edges.dtype, shape=(E, cols))
            fill(target)
            target.flush()
            del target
        else:  # a zero-length file cannot be mapped
            np.save(tmp / "edges.npy", np.empty((0, cols), edges.dtype))
        fsync_path(tmp / "edges.npy")
        with open(tmp / "offsets.npy", "wb") as f:
            np.save(f, offsets)
            f.flush()
            fsync_fd(f.fileno())
        dsa_core.tools.write_json(tmp / "plan.json", meta)
    return open_plan(out)


def _bucket_ids(ch: np.ndarray, lo: int, bounds: np.ndarray, n: int, P: int) -> np.ndarray:
    """Bucket index ``i*P + j`` of each edge of the chunk starting at edge ``lo``."""
    src, dst = ch[:, 0], ch[:, -1]
    bad = (src < 0) | (src >= n) | (dst < 0) | (dst >= n)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        row = tuple(int(v) for v in ch[k])
        col = 0 if not 0 <= row[0] < n else -1
        what = "source/head" if col == 0 else "destination/tail"
        raise ValueError(f"node ids must lie in [0, num_nodes={n}); edge {lo + k} is {row}: "
                         f"its {what} {row[col]} is out of range (the first such id; the "
                         "relation column is not checked); fix the ids or num_nodes")
    src = np.searchsorted(bounds, src.astype(np.int64), side="right") - 1
    dst = np.searchsorted(bounds, dst.astype(np.int64), side="right") - 1
    return src * P + dst


def open_plan(path, *, buffer: int | None = None, seed: int | None = None) -> Plan:
    """Open a plan saved with ``plan(..., out=path)`` (its edges as a read-only memmap).

    ``buffer`` / ``seed``: None keeps the saved ones; others change the order (not the
    buckets).
    """
    path = Path(path)
    try:
        meta = json.loads((path / "plan.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{str(path)!r} holds no bucketed plan (no plan.json); make "
                                "one with buckets.plan(edges, num_nodes, partitions=..., "
                                "out=path)") from None
    if meta.get("format") != _PLAN_FORMAT:
        raise ValueError(f"{str(path / 'plan.json')!r} is not a buckets plan")
    edges = np.load(path / "edges.npy", mmap_mode="r" if meta["num_edges"] else None)
    offsets = np.load(path / "offsets.npy")
    P = int(meta["num_partitions"])
    if (edges.shape != (meta["num_edges"], meta["columns"]) or offsets.shape != (P * P + 1,)
            or int(offsets[-1]) != meta["num_edges"]):
        raise ValueError(f"the plan at {str(path)!r} is damaged: edges {edges.shape}, "
                         f"offsets {offsets.shape} do not match plan.json")
    c = meta["buffer"] if buffer is None else _int(buffer, "buffer", 2)
    seed = meta["seed"] if seed is None else _int(seed, "seed", 0)
    return Plan(num_nodes=meta["num_nodes"], num_partitions=P, buffer=c, seed=seed,
                edges=edges, offsets=offsets, path=path)


# -- choosing P and c ----------------------------------------------------------------------
DEFAULT_RESERVE = 512 << 20  # the framework's own memory: see fit()'s ``reserve``


class Fit(NamedTuple):
    """What :func:`fit` chose, with the figures it chose by (bytes).

    Attributes
    ----------
    partitions, buffer : int
        P and c: pass them to :func:`plan` (``partitions=``, ``buffer=``).
    partition_bytes : int
        The records of the largest partition (``ceil(num_rows / P)`` rows) of all the
        tables together.
    buffer_bytes : int
        What the iterator holds at once: ``min(c + 1, P)`` partitions (the buffer and the
        one read ahead) plus one bucket's edges and their shuffle (``edge_bytes``) plus the
        negatives' pools (``pool_bytes``).
    edge_bytes : int
        The edge term of ``buffer_bytes`` (0 when ``num_edges`` was not given).
    memory, reserve : int
        The memory it fitted into and the part of it left to the framework:
        ``buffer_bytes <= memory - reserve``.
    pool_bytes : int
        The pool term of ``buffer_bytes``: the records, in the tables held as page cache,
        of ``min(2 * pool, num_rows)`` rows (the current buffer state's pool and the next
        one's, loaded ahead). A log store's pools are in its ``store_memory``.
    store_memory : tuple of (int or None)
        Per table, the ``memory=`` to open it with when it is a log store (whose region
        holds the loaded partitions and the two loaded pools: ``dsa_core.region_memory(
        state, H + min(2 * pool, num_rows - H) + batch_size * (2 + negatives))`` with
        ``H = min(c + 1, P) * ceil(num_rows / P)``, the index and the store's buffers
        included); None for an in-place store or a ``(num_rows, record_bytes)`` pair,
        whose partitions are counted as page cache. Their sum is part of
        ``buffer_bytes``.
    """

    partitions: int
    buffer: int
    partition_bytes: int
    buffer_bytes: int
    edge_bytes: int
    memory: int
    reserve: int
    pool_bytes: int = 0
    store_memory: tuple = ()

    def __str__(self) -> str:
        mib = 1 << 20
        logs = [m for m in self.store_memory if m is not None]
        stores = (f", log stores' memory= {', '.join(f'{m / mib:,.1f}' for m in logs)} MiB"
                  if logs else "")
        return (f"P = {self.partitions}, c = {self.buffer}: partitions of "
                f"{self.partition_bytes / mib:,.1f} MiB, {self.buffer_bytes / mib:,.1f} MiB "
                f"held (of which edges {self.edge_bytes / mib:,.1f} MiB, negatives' pools "
                f"{self.pool_bytes / mib:,.1f} MiB{stores}) within memory "
                f"{self.memory / mib:,.0f} MiB - reserve {self.reserve / mib:,.0f} MiB")


def _bytes(value: Any, name: str, allow_zero: bool = False) -> int:
    """An int of bytes or a size string ("4GiB", "512M"), as ``memory=`` of ``create``."""
    if allow_zero and isinstance(value, int | np.integer) and not isinstance(value, bool) \
            and value <= 0:
        if value < 0:
            raise ValueError(f"buckets.fit: {name} must be >= 0 bytes, got {value}")
        return 0
    try:
        return validation.check_memory_arg(value, what="buckets.fit")
    except (TypeError, ValueError) as exc:  # the message names memory=: name ours instead
        raise type(exc)(str(exc).replace("memory ", f"{name} ", 1)) from None


def _tables(tables) -> tuple[int, int, int, list]:
    """``(num_rows, record bytes per row of all tables, of the tables held as page cache,
    [the tables with a memory region of their own (log stores), or None per table])``."""
    if isinstance(tables, dsa_core.State) or (isinstance(tables, tuple) and len(tables) == 2
                                              and not isinstance(tables[0], tuple | list)
                                              and not isinstance(tables[0], dsa_core.State)):
        tables = [tables]
    try:
        tables = list(tables)
    except TypeError:
        raise TypeError("tables must be a sequence of dsa_core.State or of (num_rows, "
                        f"record_bytes) pairs, got {type(tables).__name__}") from None
    if not tables:
        raise ValueError("tables must name at least one table: the States the iterator "
                         "loads (stores=[...]) or (num_rows, record_bytes) pairs")
    rows, per_row, paged, regioned = [], 0, 0, []
    for n, t in enumerate(tables):
        if isinstance(t, dsa_core.State):
            if t.closed:
                raise ValueError(f"tables[{n}] ({str(t.path)!r}) is closed; pass an open "
                                 "store or (num_rows, record_bytes)")
            rows.append(t.num_rows)
            b = t.layout["stride"] * t.dtype.itemsize  # weights, m and v: a record
            per_row += b
            # a store with a memory region of its own (a log store) holds the partitions it
            # loads there; one without (in place) holds them as page cache
            region = t.store.info.memory_bytes is not None
            regioned.append(t if region else None)
            paged += 0 if region else b
        else:
            try:
                r, b = t
            except (TypeError, ValueError):
                raise TypeError(f"tables[{n}] must be a dsa_core.State or a (num_rows, "
                                f"record_bytes) pair, got {t!r}") from None
            rows.append(_int(r, f"tables[{n}] num_rows", 1))
            b = _int(b, f"tables[{n}] record_bytes", 1)
            per_row += b
            paged += b
            regioned.append(None)
    if len(set(rows)) != 1:
        raise ValueError("the tables must have the same number of rows (their rows are the "
                         f"node ids the partitions split), got num_rows {rows}")
    return rows[0], per_row, paged, regioned


def fit(tables, *, memory=None, reserve=DEFAULT_RESERVE, partitions: int | None = None,
        buffer: int | None = None, max_buffer: int = 8, num_edges: int = 0,
        columns: int = 2, mix: str = "bucket", pool: int = DEFAULT_POOL,
        batch_size: int | None = None, negatives: int = 0) -> Fit:
    """Choose P and c so that the partitions held during training fit in memory.

    Takes the largest buffer ``c`` in ``[2, max_buffer]`` (a larger buffer moves fewer
    bytes per epoch: docs/buckets.md, "Choosing P and c") and for it the smallest ``P >= c``
    whose ``min(c + 1, P)`` partitions -- the ``c`` resident and the one the iterator reads
    ahead -- plus one bucket's edges fit in ``memory - reserve``. Pure arithmetic on the
    sizes and the memory limit: it opens, reads and allocates nothing.

    Parameters
    ----------
    tables : State, or sequence of State or of ``(num_rows, record_bytes)``
        The tables indexed by node id (the stores passed to ``plan.batches(stores=)``),
        all with the same ``num_rows``. A row of the buffer is a store's whole record,
        weights and Adam's moments: ``state.layout["stride"] * state.dtype.itemsize``
        bytes (1,536 for a 128-dim float32 table), summed over the tables. An in-place
        store (or a pair) holds its partitions as page cache: their records count. A log
        store holds them in its memory region: what counts is the ``memory=`` whose region
        holds them beside one step's rows (``dsa_core.region_memory``: the index and the
        store's buffers included), returned in ``Fit.store_memory`` -- reopen the store
        with it (``dsa_core.open(path, memory=...)``); the ``memory=`` it has now does not
        count.
    memory : int or str, optional
        The memory the process may use, bytes or a size string (``"8GiB"``). Default: the
        machine's physical memory capped by the process's memory cgroup(s)
        (``dsa_core.tools.paging_limits()["memory_limit"]``). On a machine shared with other
        processes pass what this one may really take.
    reserve : int or str
        The part of ``memory`` the framework needs besides the partitions: the
        interpreter, numpy and numba (about 100 MiB), torch (220-280 MiB resident after
        ``import torch`` on CPU; more with CUDA), the model's other tensors, the batches
        and the page cache of the bucketed edges as they stream. Default 512 MiB, for a
        CPU torch process; raise it for a larger model or CUDA, lower it (0 allowed) for a
        numpy-only loop.
    partitions, buffer : int, optional
        Fix P or c (or both: then only checked); the other is chosen as above.
    max_buffer : int
        The largest c considered (>= 2). Each step of c costs more, smaller buckets
        (``P**2`` of them, each ending with a short batch) for less traffic.
    num_edges, columns, mix : optional
        With ``num_edges`` (E) given, one bucket's edges and their shuffle,
        ``ceil(E / P**2) * (8 * columns + 8)`` bytes, count too (uniform buckets assumed;
        ``plan.bucket_sizes.max()`` is the real largest), ``min(c*c, P*P)`` buckets of
        them with ``mix="buffer"``.
    pool : int
        The ``pool=`` of ``plan.batches`` (default: its default): two pools are held at
        once (this buffer state's and the next one's, loaded ahead), so the records of
        ``min(2 * pool, num_rows)`` rows of the tables held as page cache count too, and a
        log store's ``store_memory`` holds ``2 * pool`` more rows in its region (at most the
        rows outside the partitions). Pass 0 for ``pool=0``, ``pool_share=0`` or
        ``negatives=0``.
    batch_size, negatives : int
        The ``plan.batches`` arguments: a log store's region must hold one step's rows,
        ``batch_size * (2 + negatives)`` node ids, beside the partitions. Required when a
        table is a log store.

    Returns
    -------
    Fit
        ``(partitions, buffer, partition_bytes, buffer_bytes, edge_bytes, memory,
        reserve, pool_bytes, store_memory)``; ``print(fit)`` says it in MiB.

    Raises
    ------
    ValueError
        Nothing fits: the reserve takes all of ``memory``, or not even three partitions of
        one row each (c = 2, P = num_rows; or the given P or c) fit: the message gives
        both figures and what to change. Also tables of different ``num_rows``.
    TypeError, ValueError
        A bad argument (a float where an int belongs, a negative size, ``max_buffer < 2``).

    Examples
    --------
    >>> f = fit([(10_000_000, 1536)], memory="4GiB")     # 10M x 128 float32: 15.4 GB
    >>> f.partitions, f.buffer, f.buffer_bytes <= f.memory - f.reserve
    (37, 8, True)
    >>> print(f)
    P = 37, c = 8: partitions of 395.9 MiB, 3,575.1 MiB held (of which edges 0.0 MiB, \
negatives' pools 12.0 MiB) within memory 4,096 MiB - reserve 512 MiB
    >>> fit([(10_000_000, 1536)], memory="4GiB", buffer=2)[:2]   # c fixed: P for it
    (13, 2)
    >>> p = plan(np.zeros((1, 2), np.int64), 10_000_000, partitions=f.partitions,
    ...          buffer=f.buffer)
    >>> fit([(10_000_000, 1536)], memory="1GiB", reserve="1GiB")
    Traceback (most recent call last):
        ...
    ValueError: memory - reserve must leave room for the partitions: reserve 1,024 MiB >= ...
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be 'bucket' or 'buffer', got {mix!r}")
    N, rec, paged, regioned = _tables(tables)
    logs = [t for t in regioned if t is not None]
    total = _bytes(_paging.memory_limit() if memory is None else memory, "memory")
    reserve = _bytes(reserve, "reserve", allow_zero=True)
    max_c = _int(max_buffer, "max_buffer", 2)
    E = _int(num_edges, "num_edges", 0)
    cols = _int(columns, "columns", 2)
    if cols > 3:
        raise ValueError(f"columns must be 2 or 3 (the edges' columns), got {cols}")
    pool = _int(pool, "pool", 0)
    pool_b = min(2 * pool, N) * paged  # this state's pool and the next's, as page cache
    P_fixed = None if partitions is None else _int(partitions, "partitions", 1)
    c_fixed = None if buffer is None else _int(buffer, "buffer", 2)
    if P_fixed is not None and P_fixed > N:
        raise ValueError(f"partitions must be <= num_rows = {N} (each partition needs a "
                         f"row), got {P_fixed}")
    if logs and batch_size is None:
        raise ValueError(f"tables {[str(t.path) for t in logs]} are log stores, whose memory "
                         "region must hold one step's rows beside the partitions: pass "
                         "batch_size= (and negatives=) as given to plan.batches")
    step = min(_int(0 if batch_size is None else batch_size, "batch_size", 0)
               * (2 + _int(negatives, "negatives", 0)), N)
    held = reserve
    if held >= total:
        raise ValueError(f"memory - reserve must leave room for the partitions: reserve "
                         f"{reserve / 2**20:,.0f} MiB >= memory {total / 2**20:,.0f} MiB; "
                         "give more memory= or a smaller reserve=")
    avail = total - held

    def store_memory(P: int, c: int) -> tuple:  # a log store's region holds the pools too
        parts = min(c + 1, P) * -(-N // P)
        rows = parts + _pool_rows_held(pool, parts, N) + step
        return tuple(None if t is None else dsa_core.region_memory(t, max(rows, 1))
                     for t in regioned)

    def need(P: int, c: int) -> tuple[int, int, int]:
        part = -(-N // P) * rec
        per_bucket = -(-E // (P * P))
        edge = per_bucket * (8 * cols + 8) * (1 if mix == "bucket" else min(c * c, P * P))
        regions = sum(m for m in store_memory(P, c) if m is not None) if logs else 0
        return part, min(c + 1, P) * -(-N // P) * paged + regions + edge + pool_b, edge

    def smallest_P(c: int) -> int | None:
        """The smallest P >= c that fits with buffer c (None: none up to num_rows)."""
        if P_fixed is not None:
            return P_fixed if need(P_fixed, c)[1] <= avail else None
        lo = min(c, N)
        if need(lo, c)[1] <= avail:
            return lo
        lo += 1  # past P = c the need only falls as P grows: bisect
        if lo > N or need(N, c)[1] > avail:
            return None
        hi = N
        while lo < hi:
            mid = (lo + hi) // 2
            if need(mid, c)[1] <= avail:
                hi = mid
            else:
                lo = mid + 1
        return lo

    cs = [c_fixed] if c_fixed is not None else range(max_c, 1, -1)
    for c in cs:
        if P_fixed is not None and c > max(P_fixed, 2) and c_fixed is None:
            continue  # c > P holds what c = P holds: report the smallest
        P = smallest_P(c)
        if P is not None:
            part, buf, edge = need(P, c)
            return Fit(P, c, part, buf, edge, total, held, pool_b, store_memory(P, c))
    c = 2 if c_fixed is None else c_fixed
    P = N if P_fixed is None else P_fixed
    buf = need(P, c)[1]
    given = ", ".join(f"{k} = {v}" for k, v in (("P", P_fixed), ("c", c_fixed))
                      if v is not None)
    raise ValueError(f"no P and c fit: min(c + 1, P) partitions of the tables (c >= 2) must "
                     f"fit in memory - reserve = {avail / 2**20:,.1f} MiB, and the smallest "
                     f"(P = {P}, c = {c}{'; ' + given + ' given' if given else ''}) needs "
                     f"{buf / 2**20:,.1f} MiB; give more memory=, a smaller reserve="
                     + (", or drop the fixed partitions=/buffer=" if given else ""))


# -- iteration ---------------------------------------------------------------------------
MIXES = ("bucket", "buffer")


_NO_POOL = np.empty(0, np.int64)
_NO_POOL.flags.writeable = False


class Batch(NamedTuple):
    """One batch of :meth:`Plan.batches`.

    Attributes
    ----------
    edges : ndarray
        ``(b, 2|3)`` int64 global ids (and relations): with ``mix="bucket"`` all from
        ``bucket``; with ``mix="buffer"`` from any bucket of the buffer state. With
        ``pad=True``, ``b == batch_size`` always: the rows after the real ones repeat real
        rows (``weight`` 0).
    negatives : ndarray
        ``(b, negatives)`` int64 node ids: each from ``pool`` with probability
        ``pool_share``, else uniform over the resident partitions' rows (a padding row
        repeats the negatives of the row it copies).
    bucket : tuple of int or None
        ``(i, j)`` with ``mix="bucket"``; None with ``mix="buffer"`` (the batch mixes the
        buckets of its buffer state).
    position : tuple of int
        ``(epoch, bucket_index, batch_index)`` of this batch; with ``mix="buffer"``,
        ``bucket_index`` is the state's first bucket and ``batch_index`` counts within the
        state.
    partitions : tuple of int
        The partitions resident in the buffer for this batch (sorted); every id of
        ``edges`` lies in them, and every negative in them or in ``pool``.
    weight : ndarray
        ``(b,)`` float32: 1 for a real edge, 0 for a padding row (all ones without padding).
    pool : ndarray
        ``(min(pool, num_nodes),)`` int64, sorted, read-only: the negatives' pool of this
        batch's buffer state (rows from all partitions), the same array for every batch of
        the state; empty without a pool (``pool=0``, ``pool_share=0`` or no negatives).
        The rows a step may touch are those of ``partitions`` and these.
    """

    edges: np.ndarray
    negatives: np.ndarray
    bucket: tuple | None
    position: tuple
    partitions: tuple
    weight: np.ndarray
    pool: np.ndarray = _NO_POOL


_EXHAUSTED: Any = iter(())  # a closed iterator's generator


class BatchIterator:
    """The batches of a :class:`Plan`, in bucket order (made by :meth:`Plan.batches`).

    ``position`` is ``(epoch, bucket_index, batch_index)`` of the next batch,
    ``state_dict()`` that position with the parameters a resume must match, ``loads`` the
    partition loads issued so far (counted with or without stores), and ``len(it)`` the
    number of batches it yields from its start position to its end. Every batch is a
    deterministic function of (seed, epoch, bucket index, batch index), so a resumed
    iterator yields exactly the batches the uninterrupted one would have.
    """

    def __init__(self, plan: Plan, batch_size, *, negatives=0, epoch=0, epochs=1,
                 stores=(), start=None, mix="bucket", pad=False, pool=DEFAULT_POOL,
                 pool_share=DEFAULT_POOL_SHARE):
        self.plan = plan
        self.batch_size = _int(batch_size, "batch_size", 1)
        self.negatives = _int(negatives, "negatives", 0)
        self.pool, self.pool_share = _check_pool(pool, pool_share, self.negatives,
                                                 plan.num_nodes)
        self.epoch = _int(epoch, "epoch", 0)
        self.epochs = _int(epochs, "epochs", 0)
        if not isinstance(mix, str) or mix not in MIXES:
            raise ValueError(f"mix must be 'bucket' (each batch from one bucket) or 'buffer' "
                             f"(the edges of one buffer state shuffled together), got {mix!r}")
        self.mix = mix
        if not isinstance(pad, bool | np.bool_):
            raise TypeError(f"pad must be True or False, got {pad!r} ({type(pad).__name__})")
        self.pad = bool(pad)
        self.stores = _check_stores(stores, plan.num_nodes)
        _check_regions(self.stores, plan, self.batch_size, self.negatives, self.pool)
        self._groups_of: dict[int, tuple] = {}
        self._pools: dict[tuple, np.ndarray] = {}
        self._pos = self._start(start)
        self._len = self._count_from(self._pos)
        self.loads = 0
        self._gen: Iterator[Batch] | None = None

    # -- position and resume ---------------------------------------------------------
    @property
    def position(self) -> tuple:
        """``(epoch, bucket_index, batch_index)`` of the next batch."""
        return self._pos

    def __len__(self) -> int:
        """Batches this iterator yields from its start position (``start=``, or the first
        epoch's beginning) to its end; fixed at construction."""
        return self._len

    def _params(self) -> dict:
        p = self.plan
        return {"kind": _ITER_KIND, "version": _ITER_VERSION, "num_nodes": p.num_nodes,
                "num_partitions": p.num_partitions, "buffer": p.buffer, "seed": p.seed,
                "num_edges": p.num_edges, "columns": int(p.edges.shape[1]),
                "buckets_crc32": zlib.crc32(p.offsets.astype("<i8").tobytes()),
                "batch_size": self.batch_size, "negatives": self.negatives, "mix": self.mix,
                "pool": self.pool, "pool_share": self.pool_share}

    def state_dict(self) -> dict:
        """JSON-able: the next batch's position and the parameters a resume must match."""
        e, k, t = self._pos
        return {**self._params(), "epoch": e, "bucket_index": k, "batch_index": t}

    def _groups(self, epoch: int) -> tuple:
        """``(first, stop, edges)`` of the epoch's groups of buckets batched together, in
        order: one bucket each with ``mix="bucket"``, one buffer state each with
        ``mix="buffer"``; ``edges`` is the number of edges of each group."""
        got = self._groups_of.get(epoch)
        if got is None:
            buckets, state_of = self.plan._epoch_order(epoch)[:2]
            sizes = self.plan.bucket_sizes[buckets[:, 0], buckets[:, 1]]
            P2 = len(buckets)
            if self.mix == "bucket":
                first = np.arange(P2, dtype=np.int64)
            else:
                first = np.flatnonzero(np.diff(state_of, prepend=-1)).astype(np.int64)
            stop = np.append(first[1:], P2).astype(np.int64)
            n = np.add.reduceat(sizes, first) if P2 else np.zeros(0, np.int64)
            if len(self._groups_of) >= 4:
                self._groups_of.pop(next(iter(self._groups_of)))
            got = self._groups_of[epoch] = (first, stop, n.astype(np.int64))
        return got

    def _num_batches(self, epoch: int, k: int) -> int | None:
        """Batches of the group starting at bucket ``k`` (None: no group starts there)."""
        first, _, n = self._groups(epoch)
        g = int(np.searchsorted(first, k))
        if g == len(first) or first[g] != k:
            return None
        return -(-int(n[g]) // self.batch_size)

    def _count_from(self, pos: tuple) -> int:
        e0, k0, t0 = pos
        total = 0
        for e in range(e0, self.epoch + self.epochs):
            first, _, n = self._groups(e)
            nb = -(-n // self.batch_size)
            if e == e0:
                g = int(np.searchsorted(first, k0))
                total += int(nb[g:].sum()) - t0
            else:
                total += int(nb.sum())
        return total

    def _start(self, start) -> tuple:
        P2 = self.plan.num_partitions ** 2
        end = self.epoch + self.epochs
        if start is None:
            return (self.epoch, 0, 0) if self.epochs else (end, 0, 0)
        if isinstance(start, dict):
            mine = self._params()
            if start.get("kind") != _ITER_KIND:
                raise ValueError("start must be a BatchIterator.state_dict() or a position "
                                 f"(epoch, bucket_index, batch_index), got a dict with keys "
                                 f"{sorted(start)}")
            saved_version = start.get("version")
            if not isinstance(saved_version, int) or not 1 <= saved_version <= _ITER_VERSION:
                raise ValueError(f"start was saved by another dsa_core (state dict version "
                                 f"{saved_version!r}; this one reads 1 to {_ITER_VERSION}); "
                                 "resume it with the dsa_core that saved it")
            # a state dict saved before mix= existed was saved by the bucket-by-bucket order,
            # one saved before pool= existed (version 1) drew every negative from the buffer
            start = {"mix": "bucket", "pool": 0, "pool_share": 0.0, **start,
                     "version": _ITER_VERSION}
            diff = [f"{key} {start.get(key)!r} != {val!r}" for key, val in mine.items()
                    if start.get(key) != val]
            if diff:
                old = saved_version == 1 and (self.pool, self.pool_share) != (0, 0.0)
                raise ValueError("start was saved by another plan or with other batch "
                                 f"parameters (saved != now): {'; '.join(diff)}; resume with "
                                 "the plan, batch_size, negatives, mix, pool and pool_share "
                                 "it was saved with" + (
                                     " (this state dict was saved before pool= existed, "
                                     "with every negative from the buffer: pass pool=0 to "
                                     "resume it)" if old else ""))
            start = (start["epoch"], start["bucket_index"], start["batch_index"])
        try:
            e, k, t = (_int(v, "start position", 0) for v in start)
        except (TypeError, ValueError) as exc:
            raise ValueError("start must be a state_dict or a position (epoch, "
                             f"bucket_index, batch_index) of ints >= 0, got {start!r}"
                             ) from exc
        ok = (e == end and k == 0 and t == 0)
        if not ok and self.epoch <= e < end and k < P2:
            nb = self._num_batches(e, k)
            ok = nb is not None and t < max(1, nb)
        if not ok:
            where = ("bucket_index < " + str(P2) if self.mix == "bucket" else
                     "bucket_index the first bucket of a buffer state (mix='buffer')")
            raise ValueError(f"start position {(e, k, t)} is not in this iteration: epochs "
                             f"[{self.epoch}, {end}), {where}, batch_index below that "
                             f"{'bucket' if self.mix == 'bucket' else 'state'}'s batch count "
                             f"(or the end, {(end, 0, 0)}); pass the epoch/epochs and mix it "
                             "was saved under")
        return (e, k, t)

    # -- iteration -------------------------------------------------------------------
    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        if self._gen is _EXHAUSTED:
            raise StopIteration
        if self._gen is None:
            self._gen = self._batches()
        return next(self._gen)

    def close(self) -> None:
        """Stop early: release the partitions this iterator holds (in the background).

        ``position`` and ``state_dict()`` stay where iteration stopped, so a later
        ``plan.batches(..., start=it.state_dict())`` resumes there (and loads its buffer
        again). Called at the end of a ``with`` block; safe twice. Stores closed before the
        iterator are skipped.
        """
        if self._gen is not None and self._gen is not _EXHAUSTED:
            self._gen.close()
        self._gen = _EXHAUSTED

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _hint(self, fn, p: int, skip_closed: bool = False) -> None:
        lo, hi = int(self.plan.bounds[p]), int(self.plan.bounds[p + 1])
        for s in self.stores:
            if not (skip_closed and s.closed):
                fn(s, lo, hi)

    def _batches(self) -> Iterator[Batch]:  # noqa: C901 - one walk over states and groups
        plan, B, K = self.plan, self.batch_size, self.negatives
        S, share = self.pool, self.pool_share
        P, P2 = plan.num_partitions, plan.num_partitions ** 2
        bounds, end = plan.bounds, self.epoch + self.epochs
        by_bucket = self.mix == "bucket"
        e0, k0, t0 = self._pos
        loaded: set[int] = set()  # partitions loaded (or being) and not released since
        pools: dict = {}  # negatives' pools loaded (or being) and not released: key -> rows

        def load(p):
            loaded.add(p)
            self.loads += 1
            self._hint(dsa_core.load_range, p)

        def release(p, skip_closed=False):  # at close: skip stores the caller closed first
            loaded.discard(p)
            self._hint(dsa_core.release_range, p, skip_closed)

        def read(k_lo, k_hi):
            """The edges of buckets [k_lo, k_hi) of the order as one int64 copy: one
            sequential read of each bucket's slice (also of a memmap)."""
            parts = []
            for q in range(k_lo, k_hi):
                b = int(buckets[q, 0]) * P + int(buckets[q, 1])
                if sizes[q]:
                    parts.append(plan.edges[plan.offsets[b]:plan.offsets[b + 1]])
            if len(parts) == 1:
                return np.array(parts[0], np.int64)
            return np.concatenate(parts).astype(np.int64, copy=False)

        try:
            for e in range(e0, end):
                buckets, state_of, states, _ = plan._epoch_order(e)
                sizes = plan.bucket_sizes[buckets[:, 0], buckets[:, 1]]
                first, stop, group_n = self._groups(e)
                g0 = int(np.searchsorted(first, k0)) if e == e0 else 0
                for g in range(g0, len(first)):
                    k, k_hi = int(first[g]), int(stop[g])
                    s = state_of[k]
                    if (e, k) == (e0, k0) or k == 0 or s != state_of[k - 1]:
                        # a new buffer state: hand back what left, load what entered, and read
                        # ahead one partition of the next swap: one already held if there is
                        # one (it left at this swap and comes back at the next: it stays)
                        here = set(states[s])
                        nxt, nxt2 = self._after(e, s, end)
                        ahead = nxt - here
                        target = min(ahead & loaded or ahead, default=None)
                        for p in sorted(loaded - here - {target}):
                            release(p)
                        # the negatives' pools: this state's (loaded a state ahead, or now at
                        # the first) and the next state's, loaded now; the ended state's goes
                        keep = self._pool_keys(e, s, end)
                        for key in [key for key in pools if key not in keep]:
                            self._pool_hint(dsa_core.release_rows, pools.pop(key))
                        for p in sorted(here - loaded):
                            load(p)
                        if target is not None and target not in loaded:
                            load(target)
                        for key in keep:
                            if key not in pools:
                                pools[key] = self._pool_rows(*key)
                                self._pool_hint(dsa_core.load_rows, pools[key])
                        # bucket by bucket, when each partition leaving at the next swap is
                        # last needed (by its edges, or by every batch's negatives); the one
                        # the swap after brings back is kept instead. Mixed over the state,
                        # every batch may need any of them: they leave at the swap.
                        last_use: dict[int, int] = {}
                        if by_bucket:
                            back = (here - nxt) & (nxt2 - nxt)
                            leaving = here - nxt - {min(back, default=None)}
                            last_use = {p: -1 for p in leaving}
                            for q in range(k, P2):
                                if state_of[q] != s:
                                    break
                                if sizes[q]:
                                    for p in leaving:
                                        if K or p in buckets[q]:
                                            last_use[p] = q
                        resident = tuple(states[s])
                        res = np.array(resident, np.int64)
                        rsz = bounds[res + 1] - bounds[res]
                        rcum = np.concatenate([[0], np.cumsum(rsz)])
                        pool_ids = self._pool_rows(e, s)
                    n = int(group_n[g])
                    if not n:
                        continue
                    for p in [p for p, q in last_use.items() if q < k and p in loaded]:
                        release(p)  # no batch from here to the swap needs it
                    bucket = (int(buckets[k, 0]), int(buckets[k, 1])) if by_bucket else None
                    edges = read(k, k_hi)
                    perm = np.random.default_rng([plan.seed, e, k, _SHUFFLE]).permutation(n)
                    nb = -(-n // B)
                    for t in range(t0 if (e, k) == (e0, k0) else 0, nb):
                        batch = edges[perm[t * B:(t + 1) * B]]
                        b = len(batch)
                        if K:
                            rng = np.random.default_rng([plan.seed, e, k, t, _NEGATIVES])
                            u = rng.integers(0, rcum[-1], size=(b, K), dtype=np.int64)
                            at = np.searchsorted(rcum, u, side="right") - 1
                            neg = bounds[res[at]] + (u - rcum[at])
                            if S:  # each negative from the pool with probability share
                                from_pool = rng.random((b, K)) < share
                                j = rng.integers(0, S, size=(b, K), dtype=np.int64)
                                neg = np.where(from_pool, pool_ids[j], neg)
                        else:
                            neg = np.empty((b, 0), np.int64)
                        weight = np.ones(b, np.float32)
                        if self.pad and b < B:  # repeat real rows: no id that is not there
                            rep = np.arange(B - b) % b
                            batch = np.concatenate([batch, batch[rep]])
                            neg = np.concatenate([neg, neg[rep]])
                            weight = np.concatenate([weight, np.zeros(B - b, np.float32)])
                        self._pos = ((e, k, t + 1) if t + 1 < nb else
                                     (e, k_hi, 0) if k_hi < P2 else (e + 1, 0, 0))
                        yield Batch(batch, neg, bucket, (e, k, t), resident, weight,
                                    pool_ids)
                    del edges, perm
                self._pos = (e + 1, 0, 0)
        finally:  # the end, close() or garbage collection: hand back what is held
            for p in sorted(loaded):
                release(p, skip_closed=True)
            for rows in pools.values():
                self._pool_hint(dsa_core.release_rows, rows, skip_closed=True)

    # -- the negatives' pool -----------------------------------------------------------
    def _pool_rows(self, e: int, s: int) -> np.ndarray:
        """The pool of buffer state ``s`` of epoch ``e``: ``self.pool`` distinct rows drawn
        uniformly from all partitions by a generator seeded by ``(seed, e, s)``, sorted
        (read-only; cached: the two most recent). Empty without a pool."""
        if not self.pool:
            return _NO_POOL
        got = self._pools.get((e, s))
        if got is None:
            N = self.plan.num_nodes
            if self.pool >= N:
                got = np.arange(N, dtype=np.int64)
            else:
                rng = np.random.default_rng([self.plan.seed, e, s, _POOL])
                got = np.sort(rng.choice(N, size=self.pool, replace=False)).astype(np.int64)
            got.flags.writeable = False
            if len(self._pools) >= 2:  # this state's and the next one's
                self._pools.pop(next(iter(self._pools)))
            self._pools[e, s] = got
        return got

    def _pool_keys(self, e: int, s: int, end: int) -> list:
        """The pools the stores hold from buffer state ``(e, s)`` on: this state's and the
        next one's (none past the end), as keys of :meth:`_pool_rows`; none without stores
        or a pool. A pool of every row is the same at every state: held once."""
        if not (self.pool and self.stores):
            return []
        if self.pool >= self.plan.num_nodes:
            return [(self.epoch, 0)]  # every row: any key gives them
        keys = [(e, s)]
        if s + 1 < len(self.plan._epoch_order(e)[2]):
            keys.append((e, s + 1))
        elif e + 1 < end:
            keys.append((e + 1, 0))
        return keys

    def _pool_hint(self, fn, rows: np.ndarray, skip_closed: bool = False) -> None:
        """``fn`` (``dsa_core.load_rows`` / ``release_rows``) of a pool on every store."""
        for st in self.stores:
            if not (skip_closed and st.closed):
                fn(st, rows)

    def _after(self, e: int, s: int, end: int) -> tuple[set, set]:
        """The two buffer states after state ``s`` of epoch ``e`` (crossing into the next
        epochs below ``end``); an empty set past the end."""
        out: list[set] = []
        while len(out) < 2:
            states = self.plan._epoch_order(e)[2]
            if s + 1 < len(states):
                s += 1
            elif e + 1 < end:
                e, s = e + 1, 0
                states = self.plan._epoch_order(e)[2]
            else:
                break
            out.append(set(states[s]))
        return (*out, set(), set())[:2]

    def __repr__(self) -> str:
        return (f"BatchIterator(batch_size={self.batch_size}, negatives={self.negatives}, "
                f"pool={self.pool}, pool_share={self.pool_share:g}, "
                f"mix={self.mix!r}, pad={self.pad}, "
                f"epochs [{self.epoch}, {self.epoch + self.epochs}), position={self._pos}, "
                f"stores={len(self.stores)}, loads={self.loads})")


def _check_stores(stores, num_nodes: int) -> tuple:
    if isinstance(stores, dsa_core.State):
        raise TypeError("stores must be a sequence of dsa_core.State, got one State; pass "
                        "stores=[state]")
    try:
        stores = tuple(stores)
    except TypeError:
        raise TypeError(f"stores must be a sequence of dsa_core.State, got "
                        f"{type(stores).__name__}") from None
    for n, s in enumerate(stores):
        if not isinstance(s, dsa_core.State):
            raise TypeError(f"stores[{n}] must be a dsa_core.State, got {type(s).__name__}")
        if s.closed:
            raise ValueError(f"stores[{n}] ({str(s.path)!r}) is closed; pass an open store")
        if s.num_rows != num_nodes:
            raise ValueError(f"stores[{n}] must have num_rows == plan.num_nodes = "
                             f"{num_nodes} (its rows are the node ids), got {s.num_rows}")
    return stores


def _check_regions(stores: tuple, plan: Plan, batch_size: int, negatives: int,
                   pool: int = 0) -> None:
    """Each store that keeps loaded rows in a memory region of its own (a log store: its
    ``memory_bytes``) must hold what the iterator loads at once -- the ``c`` resident
    partitions and the one read ahead, ``min(c + 1, P)`` of the largest, and the negatives'
    pools of two buffer states (this one's and the next one's, ``2 * pool`` rows, at most
    the rows outside the partitions) -- beside one step's rows (``batch_size * (2 +
    negatives)`` node ids at most); else say what to set, before anything is loaded. A store
    without a region (in place: the page cache) is not checked here (``fit`` sizes P and c
    for it)."""
    sizes = np.sort(np.diff(plan.bounds))[::-1]
    k = min(plan.buffer + 1, plan.num_partitions)
    parts = int(sizes[:k].sum())
    pools = _pool_rows_held(pool, parts, plan.num_nodes)
    held = parts + pools
    step = min(batch_size * (2 + negatives), plan.num_nodes)
    for n, s in enumerate(stores):
        have = s.store.info.memory_bytes
        if have is None:
            continue
        need = dsa_core.region_memory(s, held + step)
        if have < need:
            mib = 1 << 20
            slots = s.store.info.max_batch  # the rows its region holds
            part = (slots - step - 2 * pool) // k  # rows per partition that would fit
            c = plan.buffer
            smaller = (f"plan with partitions={-(-plan.num_nodes // part)} or more (buffer="
                       f"{c}), " if part >= 1 and -(-plan.num_nodes // part) >= c else "")
            with_pools = "" if not pool else (
                f" and the negatives' pools of two buffer states (this one's and the next "
                f"one's: 2 * pool = {2 * pool:,} rows" + (
                    f", of which only the {pools:,} outside the partitions count)"
                    if pools < 2 * pool else ")"))
            fewer = ("pass a smaller pool= (pool=0: every negative from the buffer), "
                     if pool else "")
            raise ValueError(
                f"stores[{n}] ({str(s.path)!r}) keeps the partitions it loads in a memory "
                f"region of {have / mib:,.1f} MiB (memory={have}: {slots:,} rows), but this "
                f"iteration holds {k} partitions at once (c = {c} resident and the next one "
                f"read ahead: {parts:,} rows){with_pools}, {held:,} rows in all, beside one "
                f"step's rows (batch_size * (2 + negatives) = {step:,}): that needs "
                f"memory={need} ({need / mib:,.1f} MiB). "
                f"Reopen the store with dsa_core.open(path, memory={need}) or more, "
                f"{smaller}{fewer}or take a smaller batch; dsa_core.buckets.fit (pass it "
                "pool=) chooses P and c for the memory the process may use")


def _pool_rows_held(pool: int, parts: int, num_rows: int) -> int:
    """The rows two negatives' pools of ``pool`` rows add to ``parts`` partition rows held
    in a region: ``2 * pool``, at most the rows outside the partitions."""
    return min(2 * pool, max(num_rows - parts, 0))
