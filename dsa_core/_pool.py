"""A tiny work-claiming thread pool for the (nogil, serial) Numba kernels.

Why not ``prange``: numba's parallel loop splits the rows statically between its threads and
then waits at a barrier for all of them. When another process -- or torch's own OpenMP threads,
still spinning after the forward/backward pass -- holds the cores, one of numba's threads is not
scheduled for a few milliseconds, and every step waits for it: a sub-millisecond step became a
many-millisecond one after each torch matmul (figures: docs/notebook.md, design measurements).

Here the calling thread starts working at once and idle workers are woken to join it; each
thread calls the kernel once, and the kernel claims chunks of rows itself with an atomic
counter, the GIL released throughout (:mod:`._claim`). The caller only waits for chunks that
a worker has actually claimed, never for a worker that has not started: under contention a
step degrades to the serial speed instead of to a scheduler quantum. It waits for those last
chunks spinning for a bounded time (:data:`SPIN_S`), then sleeping.

After a job whose kernel was followed soon by the next job the last time it ran (within
:data:`LINGER_S`: steps back to back, a create's blocks, the kernel after a step's gather of
its misses), the workers wait for the next job spinning, GIL released, for up to
``LINGER_S`` (``_claim.spin_for_job``), then sleep. A sleeping worker is woken by an event,
which on the project's 2-vCPU VM takes ~150 us (an idle vCPU halts at once there:
``haltpoll.guest_halt_poll_ns=0``), most of a 2,048-row warm step. After a kernel that the
next job followed late (a training loop's last kernel of a step, before the next forward
and backward pass) they sleep at once: their spinning would take a core from torch's
threads and the store's writer. Measured on a warm 1M x 128 step (the guard's ``warm``):
4.9M rows/s with chunks handed out under the GIL, 5.8M with the claims in the kernel, 6.9M
lingering (docs/notebook.md, "The kernel pool's chunks without the GIL").
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from ._claim import (
    ENTERED,
    POSTED,
    control,
    spin_for_job,
    spin_until_done,
    spins_per_second,
    stop_claims,
)

__all__ = ["follow_threads", "get_num_threads", "run_chunked", "set_num_threads"]


# how long the caller spins for the chunks other threads still run before it sleeps: a chunk
# is ~20 us of work, a sleeping thread's wake-up ~150 us on the project's VM
SPIN_S = 200e-6
# how long the workers wait for the next job spinning, after a kernel whose last job the next
# one followed within as long (module docstring); 0: never. DSA_LINGER_US overrides it (for
# A/B runs; not a setting users need)
def _linger_s() -> float:
    try:
        return max(0.0, float(os.environ.get("DSA_LINGER_US", "300"))) * 1e-6
    except ValueError:
        return 300e-6


LINGER_S = _linger_s()

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
    """One kernel over ``[0, n)``: its threads claim ``chunk`` rows at a time (``ctl``)."""

    __slots__ = ("active", "args", "cond", "ctl", "error", "fn", "linger", "n")

    def __init__(self, fn, args, n, chunk, linger):
        self.fn, self.args, self.n = fn, args, n
        self.linger = linger  # whether the workers wait for the next job spinning after it
        self.ctl = control(chunk)
        self.active = 0  # threads inside the kernel
        self.cond = threading.Condition()
        self.error: BaseException | None = None

    def work(self, board=None) -> None:
        """Run chunks until none is left to claim (in the kernel, GIL released); the
        caller's ``board`` says the job's caller is entering its kernel (workers spinning
        for it then take the GIL back)."""
        with self.cond:
            self.active += 1
        if board is not None:
            board[ENTERED] = board[POSTED]
        try:
            self.fn(*self.args, 0, self.n, self.ctl)
        except BaseException as exc:  # handed to the caller; no chunk is claimed after it
            self.error = exc
            stop_claims(self.ctl, self.n)
        finally:
            with self.cond:
                self.active -= 1
                if self.active == 0:
                    self.cond.notify_all()

    def wait(self, spin_rounds: int) -> None:
        """Once the caller's own ``work`` returned (every chunk claimed): wait until no
        thread runs one (spinning on the count of rows done, then sleeping)."""
        if self.error is None and spin_until_done(self.ctl, self.n, spin_rounds):
            return
        with self.cond:
            while self.active:
                self.cond.wait()


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
        self._board = np.zeros(2, np.int64)  # jobs posted, entered (_claim.spin_for_job)
        # the last job's kernel and end, and per kernel how soon the job after its last one
        # came (perf_counter seconds): the workers linger after a kernel followed soon.
        # Kernels by id: no reference kept (a closure's arrays may be a store's mapping)
        self._last: tuple = (None, 0.0)
        self._gap_after: dict[int, float] = {}
        self.spin_rounds = self.linger_rounds = 0  # SPIN_S, LINGER_S in spin rounds

    def _ensure_workers(self) -> None:
        if len(self._workers) < self.threads - 1 and not self.spin_rounds:
            rate = spins_per_second()
            self.spin_rounds = max(1, int(SPIN_S * rate))
            self.linger_rounds = int(LINGER_S * rate)
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
            while True:
                seen = int(self._board[POSTED])  # read before the job: a later one is seen
                job = self._job
                if job is None:
                    break
                linger = job.linger
                job.work()
                # drop the job's arguments now: they hold views of a store's mapping, and a
                # closed store must be unmappable (evictable, its file's space freed) at once
                job = None
                if not (linger and spin_for_job(self._board, seen, self.linger_rounds)):
                    break

    def run(self, fn, args: tuple, n: int, min_chunk: int) -> None:
        helpers = min(self.threads, -(-n // max(1, min_chunk))) - 1
        if helpers <= 0:  # with a control array too: the threads' compiled code, one chunk
            fn(*args, 0, n, control(n))
            return
        # 8 chunks per thread: a worker that wakes late (an idle vCPU takes ~150 us here)
        # still finds work, and the caller waits for at most one small chunk at the end
        # (figures: docs/notebook.md, design measurements).
        with self._lock:  # one job at a time per process (steps are sequential anyway)
            self._ensure_workers()
            now = time.perf_counter()
            last_fn, last_end = self._last
            if last_fn is not None:
                if len(self._gap_after) > 256:  # the kernels are few; other callables not
                    self._gap_after.clear()
                self._gap_after[last_fn] = now - last_end
            job = self._job = _Job(fn, args, n, -(-n // (8 * (helpers + 1))),
                                   self._gap_after.get(id(fn), LINGER_S) < LINGER_S)
            self._board[POSTED] += 1  # after the job: a spinning worker then finds it
            for ev in self._wake[:helpers]:
                ev.set()
            job.work(self._board)
            job.wait(self.spin_rounds)
            self._job = None
            self._last = (id(fn), time.perf_counter())
        if job.error is not None:
            raise job.error


_POOL = _Pool()


def run_chunked(fn, args: tuple, n: int, min_chunk: int = 64) -> None:
    """Run ``fn(*args, 0, n, ctl)`` on the pool's threads, which claim chunks of ``[0, n)``
    through ``ctl`` (:mod:`._claim`); returns when all ran."""
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
