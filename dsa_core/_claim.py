"""How a kernel's threads share a batch: chunks of rows claimed with an atomic counter.

Every row kernel runs rows ``lo:hi`` of a batch, and :mod:`._pool` runs it on several
threads at once. The kernel claims its own chunks, without the GIL: each thread calls it once
with the job's control array ``ctl`` (:func:`control`), and the kernel loops::

    c0, c1 = first_span(ctl, lo, hi)
    while c0 < c1:
        for i in range(c0, c1):
            ...                          # the row's update
        c0, c1 = next_span(ctl, lo, hi, c0, c1)

``first_span`` / ``next_span`` take the next ``chunk`` rows from ``ctl[CLAIMED]`` (an
atomic fetch-and-add) and count the finished ones in ``ctl[DONE]``; called without ``ctl``
(``None``, or the argument omitted: the tests' and the references' calls) the loop is the
plain ``range(lo, hi)``, compiled apart (numba specialises on the type).

Before this, the pool handed out chunks from Python: every chunk was a kernel call that
needed the GIL, and at each chunk's end the two threads met at the GIL. On the project's
2-vCPU VM a thread that waits for the GIL sleeps, and a sleeping vCPU wakes ~150 us later
(``haltpoll.guest_halt_poll_ns=0``), so two threads ran a warm 2048-row kernel only
1.1-1.3x faster than one, at times slower (docs/notebook.md, "The kernel pool's chunks
without the GIL").

The caller waits for the last chunks another thread holds by spinning on ``ctl[DONE]``
(:func:`spin_until_done`, GIL released, a bounded number of rounds) before it falls back to
sleeping: a chunk is ~20 us of work, far below a sleeping thread's wake-up here. The spins
count rounds of a ``pause`` loop (:func:`spin`), timed once per process
(:func:`spins_per_second`): no clock is read inside them.

Note for numba's cache (as for ``_intrinsics``): a cached kernel is invalidated by changes to
its own source file only, and the two span helpers are compiled into every kernel, so after
editing them clear the ``__pycache__/*.nb[ic]`` files of ``dsa_core`` and ``dsa_core/_log``.
"""

from __future__ import annotations

import platform
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

__all__ = ["CLAIMED", "DONE", "ENTERED", "POSTED", "control", "first_span", "next_span", "spin",
           "spin_for_job", "spin_until_done", "spins_per_second", "stop_claims"]

# ``ctl``: int64 [rows claimed (from ``lo``), rows done, rows per chunk]
CLAIMED, DONE, CHUNK = 0, 1, 2
# the pool's posting board (:func:`spin_for_job`): int64 [jobs posted, jobs whose caller is
# entering its kernel]
POSTED, ENTERED = 0, 1
# the spins' hint instruction exists on x86 only
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def control(chunk: int) -> np.ndarray:
    """A job's control array: nothing claimed or done yet, ``chunk`` rows per claim."""
    return np.array([0, 0, max(1, int(chunk))], np.int64)


def stop_claims(ctl: np.ndarray, n: int) -> None:
    """No chunk is claimed from ``ctl`` after this (a thread's kernel raised): its counter
    is set to ``n`` (a claim racing with this still gets a real chunk, or nothing)."""
    ctl[CLAIMED] = max(int(n), int(ctl[CLAIMED]))


def _elem_ptr(context, builder, aty, arr, idx):
    ary = context.make_array(aty)(context, builder, arr)
    return cgutils.get_item_pointer(context, builder, aty, ary, [idx], wraparound=False)


def _int64_vector(arr) -> bool:
    return isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype == types.int64


@intrinsic
def fetch_add(typingctx, arr, i, v):
    """``arr[i] += v`` atomically (sequentially consistent); returns the old value."""
    if not _int64_vector(arr):
        return None
    sig = types.int64(arr, types.intp, types.int64)

    def codegen(context, builder, signature, args):
        ptr = _elem_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, arr, i):
    """``arr[i]``, read atomically with acquire order (sees what the writer wrote before)."""
    if not _int64_vector(arr):
        return None
    sig = types.int64(arr, types.intp)

    def codegen(context, builder, signature, args):
        ptr = _elem_ptr(context, builder, signature.args[0], args[0], args[1])
        return builder.load_atomic(ptr, "acquire", 8)

    return sig, codegen


@intrinsic
def cpu_relax(typingctx):
    """x86's ``pause`` (a spin-wait hint: frees the core's pipeline for its sibling thread
    and saves power); nothing elsewhere."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


def first_span(ctl, lo, hi):
    """The first rows ``[c0, c1)`` this call of a kernel runs (``c0 >= c1``: none)."""
    raise NotImplementedError("first_span is for numba-compiled kernels")


def next_span(ctl, lo, hi, c0, c1):
    """Count ``[c0, c1)`` done; the next rows to run (``c0 >= c1``: none left)."""
    raise NotImplementedError("next_span is for numba-compiled kernels")


def _no_control(ctl) -> bool:
    return isinstance(ctl, (types.NoneType, types.Omitted)) or ctl is None


@overload(first_span, inline="always")
def _first_span(ctl, lo, hi):
    if _no_control(ctl):
        return lambda ctl, lo, hi: (lo, hi)

    def claim(ctl, lo, hi):
        c0 = lo + fetch_add(ctl, CLAIMED, ctl[CHUNK])
        return c0, min(hi, c0 + ctl[CHUNK])

    return claim


@overload(next_span, inline="always")
def _next_span(ctl, lo, hi, c0, c1):
    if _no_control(ctl):
        return lambda ctl, lo, hi, c0, c1: (hi, hi)

    def claim(ctl, lo, hi, c0, c1):
        fetch_add(ctl, DONE, c1 - c0)
        c0 = lo + fetch_add(ctl, CLAIMED, ctl[CHUNK])
        return c0, min(hi, c0 + ctl[CHUNK])

    return claim


@njit(cache=True, nogil=True)
def spin(rounds):
    """``rounds`` rounds of the spin loops' wait (16 x :func:`cpu_relax`), GIL released."""
    for _ in range(rounds):
        for _ in range(16):
            cpu_relax()


def spins_per_second(rounds: int = 4096) -> float:
    """The rounds of the spin loops' wait that take a second on this CPU (measured once per
    process by the pool: bounding the spins by a count of rounds needs no clock in them)."""
    spin(1)  # compiled or loaded before it is timed
    t0 = time.perf_counter()
    spin(rounds)
    return rounds / max(time.perf_counter() - t0, 1e-9)


@njit(cache=True, nogil=True)
def spin_until_done(ctl, n, max_rounds):
    """Wait (spinning, GIL released) until ``ctl`` counts ``n`` rows done, for at most
    ``max_rounds`` rounds (:func:`spins_per_second`); True if they are."""
    for _ in range(max_rounds):
        if load_acquire(ctl, DONE) >= n:
            return True
        for _ in range(16):
            cpu_relax()
    return load_acquire(ctl, DONE) >= n


@njit(cache=True, nogil=True)
def spin_for_job(board, seen, max_rounds):
    """A worker's wait for the next job (spinning, GIL released): True once ``board``'s
    count of jobs posted passed ``seen`` and that job's caller is entering its kernel (the
    GIL is free then, or nearly: a worker that took the GIL back earlier would sleep on it,
    and a sleeping thread wakes ~150 us late here); False after ``max_rounds`` rounds."""
    k = 0
    while load_acquire(board, POSTED) == seen:
        k += 1
        if k > max_rounds:
            return False
        for _ in range(16):
            cpu_relax()
    for _ in range(16 * max_rounds):
        if load_acquire(board, ENTERED) == load_acquire(board, POSTED):
            break
        cpu_relax()
    return True
