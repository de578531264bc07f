"""Helpers shared by the test modules (``import helpers``: conftest.py puts tests/ on the path).

* Paths: ``REPO`` (the checkout), ``TESTS`` (this folder; ``crash_worker.py`` lives here).
* ``num_threads(n)`` (a context), ``digest(dir)`` (sha256 of every file of a store directory).
* Records: ``records(state)`` (every row's record), ``assert_same_store(a, b)`` (same count and
  the same records, bit for bit, NaN payloads included).
* Lock-step pairs: ``assert_matches_sparse_adam(state, torch_opt, param, tol)`` (a store
  against ``torch.optim.SparseAdam``'s state), ``assert_close``.
* Log budgets: ``log_memory(layout_or_state, slots)`` -- the ``memory=`` of a log store whose
  region holds ``slots`` records (``dsa_core.region_memory``, the public helper), and
  ``log_kw(kind, ...)`` -- the create/adapter keywords of a storage kind.
* Builders: ``create(path, num_rows, dim, kind, slots=...)`` (a store of either kind; a log
  store with a region of ``slots`` records), ``batches(steps, num_rows, dim, ...)`` (a list of
  random ``(idx, grad)`` pairs), ``train(state, steps, ...)`` (steps on such batches).
* What a kill leaves: ``on_disk(path, scratch)`` (the count and records that a store's
  directory reopens at, as after a ``kill -9`` now).
* Faults at the OS layer: ``os_fault(call, nth, error)`` (``dsa_core._os``'s write calls
  raise ENOSPC or EIO, or write short, from their ``nth`` call on).
* The crash harness: ``Worker`` / ``run_worker`` run ``tests/crash_worker.py`` in a
  subprocess (see test_reliability.py for what it trains and how the kills are checked).
* Parameter grids: ``sampled_grid(head, tail)`` -- every case of a full grid, the default run
  keeping each ``head`` combination once with one ``tail`` combination (rotating), the rest
  marked ``slow``.
* A real memory cgroup: ``memcap(limit, *command)`` (the command line that runs a command
  under ``benchmarks/memcap.sh``, the repo's own tool) and ``memcap_unavailable()`` (why it
  cannot run here, for a skip; None where it can).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import dsa_core

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "crash_worker.py"
KINDS = ("inplace", "log")
MEMCAP = REPO / "benchmarks" / "memcap.sh"


# -- a real memory cgroup ---------------------------------------------------------------------
def memcap(limit: str, *command: str) -> list[str]:
    """The command line that runs ``command`` in a fresh memory cgroup of ``limit`` bytes
    (``"512M"``): ``benchmarks/memcap.sh``, the cap the benchmarks run under."""
    return ["bash", str(MEMCAP), limit, *command]


def memcap_unavailable() -> str | None:
    """Why :func:`memcap` cannot run here (a reason for ``pytest.skip``), or None."""
    import shutil
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "benchmarks/memcap.sh needs root (it makes a memory cgroup)"
    if shutil.which("numfmt") is None:
        return "benchmarks/memcap.sh needs numfmt (coreutils)"
    v1, v2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")
    if v1.is_dir():
        ok = os.access(v1, os.W_OK)
    elif (v2 / "cgroup.controllers").is_file():
        try:
            ok = os.access(v2, os.W_OK) and "memory" in (v2 / "cgroup.subtree_control"
                                                         ).read_text().split()
        except OSError:
            ok = False
    else:
        ok = False
    return None if ok else "no writable memory cgroup on this machine"


# -- parameter grids ---------------------------------------------------------------------------
def sampled_grid(head: list, tail: list) -> list:
    """The cases of ``itertools.product(*head, *tail)`` as ``pytest.param`` s, ids joined
    with ``-`` as stacked ``parametrize`` decorators make them. The default run keeps every
    combination of the ``head`` axes once, paired with the tail combination numbered by the
    sum of its axes' indices (so beside each value of any head axis the tail combinations
    rotate, and every one runs where an axis has that many values); the other cases are marked ``slow`` (``make test-all`` runs the grid).

    >>> [p.id for p in sampled_grid([["a", "b"]], [[1, 2]]) if not p.marks]
    ['a-1', 'b-2']
    """
    import itertools

    import pytest

    tails = list(itertools.product(*tail))
    out = []
    for pos in itertools.product(*(range(len(a)) for a in head)):
        h = tuple(a[k] for a, k in zip(head, pos, strict=True))
        keep = sum(pos) % len(tails)  # the index sum: every tail beside each value of each axis
        for j, t in enumerate(tails):
            vals = (*h, *t)
            marks = () if j == keep else (pytest.mark.slow,)
            out.append(pytest.param(*vals, id="-".join(map(str, vals)), marks=marks))
    return out


# -- threads and digests -----------------------------------------------------------------------
@contextlib.contextmanager
def num_threads(n: int) -> Iterator[None]:
    """Run the block with ``dsa_core.set_num_threads(n)``, then restore the old count.

    Restored with where it came from: a count that followed torch (no explicit call) goes
    on following it after the block.
    """
    from dsa_core import _pool

    old = (_pool._POOL.threads, _pool._POOL.source)
    dsa_core.set_num_threads(n)
    try:
        yield
    finally:
        _pool._POOL.threads, _pool._POOL.source = old


def digest(path: Path) -> dict[str, str]:
    """sha256 of every file under a store directory (relative name -> hex digest)."""
    path = Path(path)
    out = {}
    for f in sorted(path.rglob("*")):
        if f.is_file():
            out[str(f.relative_to(path))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def assert_snapshot_files(dest: Path) -> str:
    """``dest`` holds exactly the files of a complete in-place snapshot, each checking out
    (``dsa verify``'s file checks): ``"plain"`` (``rows.dsa``) or ``"chain"`` (``base.dsa``
    and the deltas its manifest names), and the writer lock if it was ever opened for
    writing. Returns which."""
    from dsa_core._inplace import store as inplace

    names = sorted(n for n in os.listdir(dest) if n != "writer.lock")
    checked = inplace.check_files(Path(dest))
    assert [p for _, p, _ in checked if p is not None] == [], checked
    if names == ["manifest.json", "rows.dsa"]:
        return "plain"
    chain = json.loads((Path(dest) / "manifest.json").read_text())["chain"]
    assert names == sorted(["manifest.json", "base.dsa",
                            *(e["file"] for e in chain["deltas"])]), names
    return "chain"


# -- records ------------------------------------------------------------------------------------
def records(state) -> np.ndarray:
    """Every row's record (``dsa_core.read_records`` of all rows)."""
    return dsa_core.read_records(state, np.arange(state.num_rows))


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    """The same arrays, bit for bit (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def assert_same_store(a, b) -> None:
    """Same count and the same records, bit for bit (NaN payloads included)."""
    assert a.count == b.count
    ra, rb = records(a), records(b)
    assert ra.dtype == rb.dtype and ra.shape == rb.shape
    np.testing.assert_array_equal(ra.view(np.uint8), rb.view(np.uint8))


# -- lock-step pairs: torch.optim.SparseAdam beside DSA ------------------------------------------
def assert_close(a, b, tol: dict) -> None:
    """``np.testing.assert_allclose`` of two arrays or tensors with ``tol`` (rtol / atol)."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), **tol)


def assert_matches_sparse_adam(state, opt_ref, p_ref, tol: dict, weights=None) -> None:
    """A DSA store (in place: its whole-table views) stepped in lock step with
    ``torch.optim.SparseAdam`` on ``p_ref``: the count is SparseAdam's step, and the weights
    (``weights`` when the table is the caller's, else the store's), m and v agree within
    ``tol``."""
    ref = opt_ref.state[p_ref]
    assert state.count == ref["step"]
    assert_close(state.weights if weights is None else weights, p_ref.detach(), tol)
    assert_close(state.exp_avg, ref["exp_avg"], tol)
    assert_close(state.exp_avg_sq, ref["exp_avg_sq"], tol)


# -- log budgets --------------------------------------------------------------------------------
def log_memory(layout, slots: int) -> int:
    """``memory=`` of a log store whose region holds ``slots`` records of ``layout`` (a State or
    a layout dict with num_rows, stride and dtype)."""
    return dsa_core.region_memory(layout, slots)


def log_kw(kind: str, memory=None) -> dict:
    """The ``storage=`` (and, for a log store, ``memory=`` when given) keywords of ``kind``."""
    if kind == "inplace":
        return {"storage": "inplace"}
    return {"storage": "log", **({} if memory is None else {"memory": memory})}


def evicted(state) -> bool:
    """A log store whose rows really left the region: sealed segments, fewer slots than rows."""
    st = state.store.log_stats()
    return st["segments"] > 0 and st["slots"] < state.num_rows


# -- builders -----------------------------------------------------------------------------------
def create(path, num_rows: int, dim: int, kind: str = "inplace", *, slots: int | None = None,
           **kw):
    """``dsa_core.create`` of ``kind`` with ``init="normal"``, ``init_scale=0.1``, ``seed=3``
    unless ``kw`` says otherwise. A log store's region holds ``slots`` records (``None``: the
    kind's default region, which holds a small table whole); ``slots`` is ignored in place."""
    kw = {"init": "normal", "init_scale": 0.1, "seed": 3, **kw}
    if kw.get("init") is None or not isinstance(kw["init"], str):
        kw.pop("init_scale")
        kw.pop("seed")
    if kind == "log" and slots is not None and "memory" not in kw:
        from dsa_core._layout import make_layout
        lay = make_layout(num_rows, dim, np.dtype(kw.get("dtype", "float32")),
                          kw.get("curvature", 0.0), kw.get("weights", True), kw.get("align", 0),
                          kw.get("second_moment", "elementwise"),
                          "bfloat16" if kw.get("first_moment") == "bfloat16" else "full",
                          per_row_step=kw.get("per_row_step", False),
                          decay_missed_steps=kw.get("decay_missed_steps", False),
                          optimizer=kw.get("optimizer", "adam"))
        kw["memory"] = log_memory(lay, slots)
    return dsa_core.create(path, num_rows, dim, storage=kind, **kw)


def batches(steps: int, num_rows: int, dim: int, *, batch: int, seed=1, rows=None,
            unique: bool = False, sort: bool = False, dtype=np.float32) -> list:
    """``steps`` random ``(idx, grad)`` pairs of ``batch`` ids each: drawn from
    ``range(num_rows)`` (or from ``rows``), with duplicates unless ``unique``, sorted if
    ``sort``; standard-normal gradients of ``dtype``. ``seed`` is an int or a
    ``np.random.Generator``, which the draws then continue (and advance): a test's own stream.
    Per step the ids are drawn first, then the gradients: with duplicates, the same values as
    ``rng.integers(0, num_rows, batch)`` then ``rng.standard_normal((batch, dim))``."""
    rng = np.random.default_rng(seed)
    pool = num_rows if rows is None else np.asarray(rows)
    out = []
    for _ in range(steps):
        idx = rng.choice(pool, batch, replace=not unique)
        if sort:
            idx = np.sort(idx)
        out.append((idx, rng.standard_normal((batch, dim)).astype(dtype)))
    return out


def train(state, steps, *, batch: int = 32, **kw):
    """``state`` stepped through ``steps`` (a list of ``(idx, grad)`` pairs, or a number of
    :func:`batches` of ``batch`` ids drawn with ``kw``); returns the last State."""
    if isinstance(steps, int):
        steps = batches(steps, state.num_rows, state.dim, batch=batch,
                        dtype=np.dtype(state.dtype), **kw)
    for idx, g in steps:
        state = dsa_core.step(state, idx, g)
    return state


def on_disk(path, scratch) -> tuple[int, np.ndarray]:
    """The count and records that the store at ``path`` reopens at if its writer is killed now
    (``kill -9``: the page cache stays): its directory as it is now is copied to ``scratch``
    and opened there (recovery included), read and closed."""
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(path, scratch, ignore=shutil.ignore_patterns("writer.lock"))
    s = dsa_core.open(scratch)
    try:
        return s.count, records(s)
    finally:
        dsa_core.close(s)


# -- faults at the OS layer ---------------------------------------------------------------------
# the write calls of dsa_core._os; every module of dsa_core that imported one by name is patched
OS_WRITES = ("pwrite_all", "pwritev_all", "fsync_path", "fsync_fd", "fdatasync_fd")
OS_SYNCS = ("fsync_path", "fsync_fd", "fdatasync_fd")  # a "short" fault on these is EIO
FAULTS = ("ENOSPC", "EIO", "short")


def _fd_name(fd) -> str:
    """The base name of the file open as ``fd`` (the fd's number where /proc cannot say)."""
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return str(fd)


class OsFault:
    """Calls of one write call of ``dsa_core._os`` (:data:`OS_WRITES`), counted from 1; from
    the ``nth`` on (``None``: never) each one fails, as a full disk or a failing one does,
    until :meth:`clear`:

    * ``"ENOSPC"`` / ``"EIO"``: raises ``OSError`` of that errno, writing nothing;
    * ``"short"`` (a write call): writes the first half of its bytes, then raises ENOSPC (a
      disk that filled up during the write); on a sync (:data:`OS_SYNCS`) it is EIO.

    ``seen`` lists the file (base name; of a descriptor, the file it is open on) of every
    call, failed or not; ``failed`` those that failed. Thread-safe: the log store's writer
    thread writes segments."""

    def __init__(self, call: str, nth: int | None, error: str = "ENOSPC"):
        from dsa_core import _os

        if call not in OS_WRITES or error not in FAULTS:
            raise ValueError(f"call one of {OS_WRITES}, error one of {FAULTS}")
        self.call, self.nth, self.error = call, nth, error
        self.real = getattr(_os, call)
        self.seen: list[str] = []
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._patched: list[tuple[object, str]] = []

    def _fails(self, name: str) -> bool:
        with self._lock:
            self.seen.append(name)
            hit = self.nth is not None and len(self.seen) >= self.nth
            if hit:
                self.failed.append(name)
            return hit

    def _raise(self, name: str, code: int):
        raise OSError(code, f"{os.strerror(code)} (a fault injected at call {len(self.seen)} "
                            f"of _os.{self.call}, {name!r})")

    def _wrapper(self):
        real, code = self.real, errno.EIO if self.error == "EIO" else errno.ENOSPC
        if self.call == "fsync_path":
            def fsync_path(path):
                name = os.path.basename(str(path))
                if self._fails(name):
                    self._raise(name, errno.EIO if self.error == "short" else code)
                return real(path)
            return fsync_path
        if self.call in OS_SYNCS:  # fsync_fd, fdatasync_fd
            def sync_fd(fd):
                name = _fd_name(fd)
                if self._fails(name):
                    self._raise(name, errno.EIO if self.error == "short" else code)
                return real(fd)
            return sync_fd
        if self.call == "pwrite_all":
            def pwrite_all(fd, data, offset):
                name = _fd_name(fd)
                if self._fails(name):
                    if self.error == "short":
                        view = memoryview(data).cast("B")
                        real(fd, view[:view.nbytes // 2], offset)
                    self._raise(name, code)
                return real(fd, data, offset)
            return pwrite_all

        def pwritev_all(fd, views, offset):
            name = _fd_name(fd)
            if self._fails(name):
                if self.error == "short":
                    data = b"".join(bytes(memoryview(v).cast("B")) for v in views)
                    self.real(fd, [memoryview(data[:len(data) // 2])], offset)
                self._raise(name, code)
            return real(fd, views, offset)
        return pwritev_all

    def install(self) -> OsFault:
        from dsa_core import _os

        fake = self._wrapper()
        for name, mod in list(sys.modules.items()):
            if (name == "dsa_core" or name.startswith("dsa_core.")) \
                    and getattr(mod, self.call, None) is self.real:
                setattr(mod, self.call, fake)
                self._patched.append((mod, self.call))
        assert any(m is _os for m, _ in self._patched)
        return self

    def clear(self) -> None:
        """The fault is gone (space freed, the disk back): every call goes through again."""
        with self._lock:
            self.nth = None

    def remove(self) -> None:
        for mod, attr in self._patched:
            setattr(mod, attr, self.real)
        self._patched.clear()


@contextlib.contextmanager
def os_fault(call: str, nth: int | None, error: str = "ENOSPC") -> Iterator[OsFault]:
    """:class:`OsFault` installed for the block (``nth=None`` counts the calls only)."""
    f = OsFault(call, nth, error).install()
    try:
        yield f
    finally:
        f.remove()


# -- step streams -------------------------------------------------------------------------------
def _grad(b, dim=4, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal((b, dim)).astype(dtype)


def varied_steps(state, dtype, params_of=None):
    """Steps that differ in every way the glue canonicalises: sorted/unsorted/duplicate ids,
    int32/uint16/list ids, B, empty batches, a Fortran-ordered grad, an lr override."""
    d = state.dim
    calls = [
        (np.array([5, 1, 5, 9]), _grad(4, d, dtype, 1), {}),
        (np.array([0, 2, 3]), _grad(3, d, dtype, 2), {}),
        ([7, 7, 7], _grad(3, d, dtype, 3), {"lr": 0.5}),
        (np.array([8, 1], np.int32), np.asfortranarray(_grad(2, d, dtype, 4)), {}),
        (np.empty(0, np.int64), np.empty((0, d), dtype), {}),
        (np.array([4], np.uint16), _grad(1, d, dtype, 5), {}),
    ]
    for idx, g, kw in calls:
        if params_of is not None:
            kw = {**kw, "params": params_of(idx)}
        state = dsa_core.step(state, idx, g, **kw)
    return state


# -- the kind-parity recipe (store/test_store_kinds.py, log/, ...) -------------------------------
# A small table trained on batches full of duplicates, under every option combination
# (PARITY): an in-place and a log store with a small region must end with the same bits.
PARITY_N, PARITY_D, PARITY_B = 240, 6, 24  # rows, dim, ids per batch (with duplicates)
PARITY_STEPS = 60
PARITY_LAYOUT = {"num_rows": PARITY_N, "stride": 3 * PARITY_D, "dtype": "float32"}  # [w|m|v]


def parity_init(dtype="float32", scale=0.1, seed=0, n=PARITY_N, d=PARITY_D):
    return (np.random.default_rng(seed).standard_normal((n, d)) * scale).astype(dtype)


def parity_batches(dtype, steps=PARITY_STEPS, seed=1, nan_every=0):
    N, B, D = PARITY_N, PARITY_B, PARITY_D
    rng = np.random.default_rng(seed)
    for k in range(steps):
        idx = rng.integers(0, N, B)
        idx[: B // 4] = idx[B // 4: B // 2]  # plenty of duplicates
        g = rng.standard_normal((B, D)).astype(dtype)
        if nan_every and k % nan_every == 0:
            g[rng.integers(0, B), rng.integers(0, D)] = np.nan
        yield idx, g


PARITY = {
    "float32": {},
    "float64": {"dtype": "float64"},
    "rowwise": {"second_moment": "rowwise"},
    "poincare": {"curvature": 1.0},
    "poincare64": {"curvature": 0.5, "dtype": "float64"},
    "l2": {"weight_decay": 0.01},
    "decoupled_missed_rowstep": {"weight_decay": 0.02, "decoupled_weight_decay": True,
                                 "decay_missed_steps": True, "per_row_step": True},
    "rowstep_poincare": {"curvature": 1.0, "per_row_step": True},
    "skip_row": {"nonfinite": "skip_row"},
    "maximize": {"maximize": True, "lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6},
    "align": {"align": 64, "second_moment": "rowwise"},
    # bfloat16 m: the stochastic rounding is keyed by the row id, not by the region slot the
    # record sits in, so the log store rounds every value exactly as the in-place store
    "bf16m": {"first_moment": "bfloat16"},
    "bf16m_rowwise": {"first_moment": "bfloat16", "second_moment": "rowwise"},
    "bf16m_l2_skip_row": {"first_moment": "bfloat16", "weight_decay": 0.01,
                          "nonfinite": "skip_row"},
    "bf16m_decoupled_missed_rowstep": {"first_moment": "bfloat16", "weight_decay": 0.02,
                                       "decoupled_weight_decay": True,
                                       "decay_missed_steps": True, "per_row_step": True},
    "bf16m_rowwise_rowstep_maximize": {"first_moment": "bfloat16", "second_moment": "rowwise",
                                       "per_row_step": True, "maximize": True, "lr": 0.01},
}


def parity_memory(state, rows=3 * PARITY_B) -> int:
    """A region of ``rows`` slots: far fewer than the table, so that rows are evicted."""
    return log_memory(state.layout, rows)


def parity_pair(tmp_path, **kw):
    """An in-place store (``tmp_path/inplace``) and a log store with a small region
    (``tmp_path/log``) created from the same init array."""
    dt = kw.get("dtype", "float32")
    init = kw.pop("init", None)
    if init is None and kw.get("weights", True):
        init = parity_init(dt, scale=0.05 if kw.get("curvature", 0) else 0.1)
    a = dsa_core.create(tmp_path / "inplace", PARITY_N, PARITY_D, init=init, **kw)
    b = dsa_core.create(tmp_path / "log", PARITY_N, PARITY_D, init=init, storage="log",
                        memory=parity_memory(a), **kw)
    return a, b


# -- the crash harness -----------------------------------------------------------------------
class Worker:
    """``crash_worker.py`` in a subprocess; its stdout lines arrive on a queue."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *map(str, args)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=REPO)
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        with self.proc.stdout:
            for line in self.proc.stdout:
                if not line.endswith("\n"):  # killed mid-line (unbuffered stdout writes
                    break                     # print's pieces one by one): no event
                self.lines.put(line.split())
        self.lines.put(None)

    def _finish(self, timeout: float) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        with self.proc.stderr:
            err = self.proc.stderr.read()
        return rc, err

    def expect(self, word: str, timeout: float = 120.0) -> int:
        """Wait for the next line ``word <count>``; returns the count."""
        try:
            got = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"worker printed nothing for {timeout} s") from None
        if got is None or got[0] != word:
            _, err = self._finish(60)
            raise AssertionError(f"worker: expected {word!r}, got {got!r}; stderr:\n{err}")
        self.seen.append(" ".join(got))
        return int(got[1])

    def kill(self) -> list[list[str]]:
        """SIGKILL it (it must still be running); returns the lines printed meanwhile."""
        self.proc.send_signal(signal.SIGKILL)
        rc, err = self._finish(60)
        assert rc == -signal.SIGKILL, f"worker ended by itself (rc {rc}) before the kill:\n{err}"
        return self.drain()

    def wait(self, timeout: float = 300.0) -> tuple[int, str]:
        return self._finish(timeout)

    def drain(self) -> list[list[str]]:
        out = []
        while True:
            try:
                got = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if got is None:
                break
            out.append(got)
        return out


def run_worker(*args, timeout: float = 300.0) -> tuple[int, list[list[str]], str]:
    w = Worker(*args)
    rc, err = w.wait(timeout)
    return rc, w.drain(), err


def wait_forked(pid: int, timeout: float, hang: str) -> int:
    """The exit code of the forked child ``pid``, waited for at most ``timeout`` seconds; a
    child still running then is killed and the test fails with ``hang`` (what it hung on)."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail(hang)
        time.sleep(0.01)
