"""A tiny work-claiming thread pool for the (nogil, serial) Numba kernels.

Why not ``prange``: numba's parallel loop splits the rows statically between its threads and
then waits at a barrier for all of them. When another process -- or torch's own OpenMP threads,
still spinning after the forward/backward pass -- holds the cores, one of numba's threads is not
scheduled for a few milliseconds, and every step waits for it: a sub-millisecond step became a
many-millisecond one after each torch matmul (figures: docs/notebook.md, design measurements).

Here the calling thread starts working at once and claims chunks of rows from a shared
iterator (``next`` on a ``range`` iterator is atomic under the GIL); idle workers are woken and
claim chunks too, releasing the GIL inside the kernel. The caller only waits for chunks that a
worker has actually claimed, never for a worker that has not started: under contention a step
degrades to the serial speed instead of to a scheduler quantum.
"""

from __future__ import annotations

import os
import threading

import numpy as np

__all__ = ["follow_threads", "get_num_threads", "run_chunked", "set_num_threads"]


# Where the default thread count comes from, first set wins: DSA's own variable, numba's (the
# kernels are numba's; a job that sized numba for its share of the cores meant these too),
# then OpenMP's (what torch, numpy's BLAS and job launchers such as torchrun set per process).
THREAD_ENV = ("DSA_NUM_THREADS", "NUMBA_NUM_THREADS", "OMP_NUM_THREADS")


def _cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def _env_threads(name: str) -> int | None:
    """The thread count ``name`` asks for; None if unset or empty; a warning if invalid.

    An invalid value warns and is skipped (the next variable, else the CPU count, applies)
    rather than raising: it is read when ``dsa_core`` is imported, often from a variable
    set for another library, and an import error would stop programs that never call DSA.
    ``OMP_NUM_THREADS`` may be a list for nested levels (``"4,2"``): its first entry counts.
    """
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    text = raw.split(",")[0].strip() if name == "OMP_NUM_THREADS" else raw.strip()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n >= 1:
        return n
    import warnings

    warnings.warn(f"dsa_core: {name}={raw!r} is ignored: the kernels' thread count must be "
                  "a whole number >= 1. Set it to one (e.g. export "
                  f"{name}=4), unset it, or call dsa_core.set_num_threads(n)",
                  RuntimeWarning, stacklevel=2)
    return None


def _default_setting() -> tuple[int, str | None]:
    """The default count and who set it: the first of :data:`THREAD_ENV` that is set,
    capped by the CPUs, else the CPUs; ``"env"`` when that was DSA's or numba's variable
    (which the torch adapter does not override), else None."""
    cpus = _cpus()
    for name in THREAD_ENV:
        n = _env_threads(name)
        if n is not None:
            return min(n, cpus), ("env" if name in THREAD_ENV[:2] else None)
    return cpus, None


class _Job:
    __slots__ = ("args", "chunk", "done", "error", "fn", "it", "left", "lock", "n")

    def __init__(self, fn, args, n, chunk, nchunks):
        self.fn, self.args, self.n, self.chunk = fn, args, n, chunk
        self.it = iter(range(nchunks))
        self.left = nchunks
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        """Claim and run chunks until none is left."""
        while True:
            c = next(self.it, None)
            if c is None:
                return
            lo = c * self.chunk
            try:
                if self.error is None:
                    self.fn(*self.args, lo, min(self.n, lo + self.chunk))
            except BaseException as exc:  # handed to the caller
                self.error = exc
            finally:
                with self.lock:
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()


class _Pool:
    def __init__(self) -> None:
        # who set ``threads``: None (the default), "env" (DSA's or numba's variable, which
        # the torch adapter does not override), or "explicit" (set_num_threads: nothing
        # overrides it)
        self.threads, self.source = _default_setting()
        self._workers: list[threading.Thread] = []
        self._wake: list[threading.Event] = []
        self._job: _Job | None = None
        self._lock = threading.Lock()

    def _ensure_workers(self) -> None:
        while len(self._workers) < self.threads - 1:
            ev = threading.Event()
            t = threading.Thread(target=self._loop, args=(ev,), daemon=True,
                                 name=f"dsa-worker-{len(self._workers)}")
            self._wake.append(ev)
            self._workers.append(t)
            t.start()

    def _loop(self, ev: threading.Event) -> None:
        while True:
            ev.wait()
            ev.clear()
            job = self._job
            if job is not None:
                job.work()
            # drop the job's arguments now: they hold views of a store's mapping, and a
            # closed store must be unmappable (evictable, its file's space freed) at once
            job = None

    def run(self, fn, args: tuple, n: int, min_chunk: int) -> None:
        helpers = min(self.threads, -(-n // max(1, min_chunk))) - 1
        if helpers <= 0:
            fn(*args, 0, n)
            return
        # 8 chunks per thread: a worker that wakes late (an idle vCPU takes tens of us)
        # still finds work, and the caller waits for at most one small chunk at the end.
        # Fewer chunks leave a late worker idle, more pay for dispatch under the GIL
        # (figures: docs/notebook.md, design measurements).
        nchunks = 8 * (helpers + 1)
        chunk = -(-n // nchunks)
        nchunks = -(-n // chunk)
        job = _Job(fn, args, n, chunk, nchunks)
        with self._lock:  # one job at a time per process (steps are sequential anyway)
            self._ensure_workers()
            self._job = job
            for ev in self._wake[:helpers]:
                ev.set()
            job.work()
            job.done.wait()
            self._job = None
        if job.error is not None:
            raise job.error


_POOL = _Pool()


def run_chunked(fn, args: tuple, n: int, min_chunk: int = 64) -> None:
    """Run ``fn(*args, lo, hi)`` over ``[0, n)`` in chunks on the pool; returns when all ran."""
    _POOL.run(fn, args, n, min_chunk)


def set_num_threads(n: int | None) -> None:
    """Run the kernels on ``n`` threads from now on (the calling thread included).

    As ``numba.set_num_threads`` and ``torch.set_num_threads``. Without a call the count is
    the first of ``DSA_NUM_THREADS``, ``NUMBA_NUM_THREADS`` and ``OMP_NUM_THREADS`` that is
    set, at most the number of CPUs this process may use (its affinity mask), else that
    number; an invalid value (not a whole number >= 1) warns and is skipped. The torch
    adapter makes the count follow ``torch.get_num_threads()`` at each step unless this
    was called (or ``DSA_NUM_THREADS`` / ``NUMBA_NUM_THREADS`` is set): an explicit count
    wins over everything, and is not capped. ``set_num_threads(None)`` goes back to the
    default (and to following torch). Results do not depend on it: each row is updated by
    one thread.
    """
    if n is None:
        _POOL.threads, _POOL.source = _default_setting()
        return
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"num_threads must be an int >= 1, got {n!r} (or None: back to "
                        "the default)")
    if n < 1:
        raise ValueError(f"num_threads must be >= 1, got {n}")
    _POOL.threads = int(n)
    _POOL.source = "explicit"


def get_num_threads() -> int:
    """The number of threads the kernels run on (see :func:`set_num_threads`)."""
    return _POOL.threads


def follow_threads(n: int) -> None:
    """Set the count to ``n`` (capped by the CPUs) unless the user chose one for DSA.

    For the adapters: the torch adapter calls it with ``torch.get_num_threads()`` at each
    step, so a process given its share of the cores (``torch.set_num_threads``,
    ``OMP_NUM_THREADS``) does not run DSA's kernels on all of them. An explicit
    :func:`set_num_threads` or ``DSA_NUM_THREADS`` / ``NUMBA_NUM_THREADS`` wins.
    """
    if _POOL.source is None:
        _POOL.threads = max(1, min(int(n), _cpus()))
