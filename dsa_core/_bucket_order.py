"""Bucket orders for partition-ordered training: BETA, its lower bound, an LRU baseline.

The node set is split into P partitions and the edges into P*P buckets; a buffer holds c
partitions, and bucket (i, j) can train only while i and j are both in it. An order is a
sequence of *buffer states* (sets of at most c partitions), consecutive states differing by
one swap (one partition out, one in), and each bucket is assigned to the first state that
holds both of its partitions. Its cost is the number of partition loads.

BETA (the buffer-aware edge traversal of Marius, Mohoney et al., OSDI 2021) fills the buffer
with c partitions, then keeps c - 1 of them fixed and cycles the last slot through every
partition not yet paired with them. The fixed partitions are then done (every pair with them
has co-resided) and leave; the partition that was swapped in last stays and becomes one of the
next fixed set, c - 2 more are loaded, and the cycle repeats on the partitions left, until at
most c remain, which are loaded together. Where the order of the loads is free, the partition
evicted most recently is loaded first: it often left at the previous swap, and a reader that
holds one partition beside the buffer (the iterator's read-ahead slot) then keeps it instead of
writing it back and reading it again.

Everything here works on partition *positions* 0..P-1; the caller maps them to labels through
a random permutation, so that epochs differ.
"""

from __future__ import annotations

import numpy as np

__all__ = ["beta_loads", "beta_states", "lower_bound", "lru_loads", "order_buckets"]


def lower_bound(P: int, c: int) -> int:
    """The fewest partition loads any order with a ``c``-partition buffer needs for ``P``.

    Every pair of partitions must co-reside once; the initial fill brings c(c-1)/2 pairs
    together and each later load at most c - 1 new ones (the new partition with the c - 1
    others). For P <= c each partition is loaded once.

    >>> lower_bound(8, 2), lower_bound(8, 3), lower_bound(3, 4)
    (29, 16, 3)
    """
    if P <= c:
        return P
    pairs = P * (P - 1) // 2 - c * (c - 1) // 2
    return c + -(-pairs // (c - 1))


def beta_states(P: int, c: int) -> list[tuple[int, ...]]:
    """BETA's buffer states (tuples of slot contents, positions 0..P-1), in order.

    The first state is the initial fill; each later one differs from its predecessor in one
    slot (one load). ``len(states) - 1 + min(P, c)`` is the epoch's number of loads.
    """
    if P <= c:
        return [tuple(range(P))]
    buf = list(range(c))
    states = [tuple(buf)]
    open_ = list(range(P))  # partitions some of whose pairs have not co-resided yet
    fixed_slots, swap_slot = list(range(c - 1)), c - 1
    left_at: dict[int, int] = {}  # partition -> the swap that evicted it last

    def put(slot: int, x: int) -> None:
        left_at[buf[slot]] = len(states)
        buf[slot] = x
        states.append(tuple(buf))

    def waiting() -> list[int]:
        """The open partitions not resident, the most recently evicted first: the one that
        left at the last swap then comes back at the next, and a reader that keeps one
        partition beside the buffer (the read-ahead slot) need not read it again."""
        out = [p for p in open_ if p not in buf]
        return sorted(out, key=lambda p: -left_at.get(p, -1))

    while True:
        fixed = {buf[s] for s in fixed_slots}
        for x in waiting():  # cycle the swap slot through every open partition not resident
            put(swap_slot, x)
        open_ = [p for p in open_ if p not in fixed]  # every pair with them has co-resided
        todo = waiting()                              # all but the one swapped in last
        if len(open_) <= c:                           # the rest fits: load it, done
            for s, x in zip(fixed_slots, todo, strict=False):
                put(s, x)
            return states
        # the last swapped-in partition stays, c - 2 more join it as the next fixed set, and
        # the remaining old fixed slot becomes the swap slot
        for s, x in zip(fixed_slots[:c - 2], todo, strict=False):
            put(s, x)
        fixed_slots, swap_slot = [swap_slot] + fixed_slots[:c - 2], fixed_slots[c - 2]


def beta_loads(P: int, c: int) -> int:
    """Partition loads of one BETA epoch (the same for every relabelling).

    >>> beta_loads(8, 3), lower_bound(8, 3)
    (17, 16)
    """
    return min(P, c) + len(beta_states(P, c)) - 1


def order_buckets(P: int, c: int, rng: np.random.Generator):
    """A BETA epoch on a random relabelling of the partitions.

    Returns ``(buckets, state_of, states, loads)``: ``buckets`` (P*P, 2) int64 partition
    labels in training order, ``state_of`` (P*P,) the index of the buffer state each bucket
    trains in, ``states`` the sorted label tuples of the buffer states, ``loads`` the number
    of partitions entering the buffer (initial fill included). Buckets that become available
    at the same swap are shuffled with ``rng``.
    """
    perm = rng.permutation(P).astype(np.int64)
    done = np.zeros((P, P), bool)
    out, state_of, states = [], [], []
    prev: set[int] = set()
    loads = 0
    for slots in beta_states(P, c):
        members = set(slots)
        loads += len(members - prev)
        prev = members
        idx = np.array(sorted(members), np.int64)
        a, b = np.meshgrid(idx, idx, indexing="ij")
        new = ~done[a, b]
        pairs = np.stack([a[new], b[new]], axis=1)
        done[a, b] = True
        pairs = perm[pairs[rng.permutation(len(pairs))]]
        states.append(tuple(sorted(int(perm[p]) for p in members)))
        out.append(pairs)
        state_of.append(np.full(len(pairs), len(states) - 1, np.int64))
    buckets = np.concatenate(out).astype(np.int64)
    assert len(buckets) == P * P and done.all(), (P, c)  # every bucket exactly once
    return buckets, np.concatenate(state_of), states, loads


def lru_loads(buckets, c: int) -> int:
    """Loads of the bucket sequence ``buckets`` with a ``c``-slot buffer evicting the least
    recently used partition (the baseline BETA is compared against).

    >>> lru_loads([(0, 0), (0, 1), (1, 0), (1, 1)], 2)
    2
    """
    slots: list[int] = []  # least recently used first
    loads = 0
    for i, j in buckets:
        for p in (int(i), int(j)):
            if p in slots:
                slots.remove(p)
            else:
                loads += 1
                if len(slots) == c:  # evict the least recently used, never the partner
                    partner = int(j) if p == int(i) else int(i)
                    slots.remove(next(q for q in slots if q != partner))
            slots.append(p)
    return loads
