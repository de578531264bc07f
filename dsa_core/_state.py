"""The ``State`` value and the store's life cycle: create, open, flush, close.

Policy only: argument checks, initialisation and the manifest contents. The bytes on
disk are ``_format``'s business.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import _format
from ._format import Store

NONFINITE_MODES = ("propagate", "skip_row", "raise")
DURABILITY_MODES = ("flush", "step")
_INIT_CHUNK_BYTES = 1 << 24  # 16 MiB of records per initialisation chunk


class State(NamedTuple):
    """An open store plus the optimizer's scalars; a small immutable value.

    ``store`` is the open files (shared by every ``State`` derived from one ``create`` or
    ``open``): :func:`dsa_core.step` updates its mapped rows **in place** and returns a new
    ``State`` whose ``count`` is one higher. Keep using the returned value.
    """

    store: Store            # open files: mapped records (num_rows, stride), lock, layout
    count: int              # completed steps: the global t of the spec (bias correction)
    lr: float               # default learning rate (``step(..., lr=...)`` overrides it)
    betas: tuple[float, float]
    eps: float
    maximize: bool
    ball_eps: float         # projection margin of the ball (c > 0); 0.0 for c == 0
    nonfinite: str          # "propagate" | "skip_row" | "raise"
    durability: str = "flush"  # "flush": durable at flush(); "step": every step is atomic

    # -- read-only conveniences ------------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.store.path

    @property
    def num_rows(self) -> int:
        return self.store.num_rows

    @property
    def dim(self) -> int:
        return self.store.dim

    @property
    def dtype(self) -> np.dtype:
        return self.store.dtype

    @property
    def curvature(self) -> float:
        return self.store.curvature

    @property
    def second_moment(self) -> str:
        """``"elementwise"`` (SparseAdam's v), ``"rowwise"`` (spec §7.3) or, for c > 0,
        ``"riemannian"`` (the ball's one scalar per row)."""
        if self.store.curvature > 0:
            return "riemannian"
        return "rowwise" if self.store.rowwise else "elementwise"

    @property
    def has_weights(self) -> bool:
        return self.store.w_off is not None

    @property
    def weights(self) -> np.ndarray:
        """A (num_rows, dim) view of the stored weights (no copy; writes reach the file)."""
        if self.store.w_off is None:
            raise ValueError(
                f"store {str(self.path)!r} was created with weights=False and holds no "
                "weights; the caller keeps them (pass them to step(..., params=rows))")
        o = self.store.w_off
        return self.store.data[:, o:o + self.dim]

    @property
    def first_moment(self) -> str:
        """``"full"`` (m in the store dtype) or ``"bfloat16"`` (m packed, spec §6)."""
        return "bfloat16" if self.store.m_bf16 else "full"

    @property
    def exp_avg(self) -> np.ndarray:
        """A (num_rows, dim) view of the first moments m.

        For ``first_moment="bfloat16"`` stores: a decoded float32 **copy** (read-only; it is
        num_rows x dim x 4 bytes), since the file holds bfloat16.
        """
        st = self.store
        o = st.m_off
        if st.m_bf16:
            raw = st.data[:, o:o + st.m_width].view(np.uint16)[:, :self.dim]
            out = (raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
            out.flags.writeable = False
            return out
        return st.data[:, o:o + self.dim]

    def set_exp_avg(self, m: Any) -> None:
        """Write the first moments: ``m`` of shape (num_rows, dim), any real dtype.

        For a full store this is ``state.exp_avg[...] = m``. A ``first_moment="bfloat16"``
        store takes each value rounded to the nearest bfloat16 (ties to even, as
        ``torch.Tensor.to(torch.bfloat16)``; NaN stays NaN): a one-time conversion wants the
        smallest error, not the step's stochastic rounding. Checked before anything is written.
        """
        st = self.store
        m = np.asarray(m)
        if m.shape != (self.num_rows, self.dim) or not (
                np.issubdtype(m.dtype, np.floating) or np.issubdtype(m.dtype, np.integer)):
            raise ValueError(f"exp_avg must be a real ({self.num_rows}, {self.dim}) array for "
                             f"store {str(self.path)!r}; got {m.dtype} of shape {m.shape}")
        if not st.data.flags.writeable:
            raise ValueError(f"store {str(self.path)!r} is open read-only (mode='r'); open it "
                             "with dsa_core.open(path) (mode='r+', the writer) to set its moments")
        if not st.m_bf16:
            self.exp_avg[...] = m
            return
        o = st.m_off
        step = max(1, (1 << 22) // max(1, self.dim))  # rows per chunk: 16 MiB of float32
        for lo in range(0, self.num_rows, step):
            x = np.ascontiguousarray(m[lo:lo + step], dtype=np.float32)
            raw = st.data[lo:lo + step, o:o + st.m_width].view(np.uint16)[:, :self.dim]
            raw[...] = bf16_nearest_even(x)

    @property
    def exp_avg_sq(self) -> np.ndarray:
        """A view of the second moments v: (num_rows, dim) for elementwise stores, (num_rows, 1)
        for ``second_moment="rowwise"`` and for c > 0."""
        o = self.store.v_off
        return self.store.data[:, o:o + self.store.v_width]

    def __repr__(self) -> str:
        return (f"dsa_core.State(path={str(self.path)!r}, num_rows={self.num_rows}, "
                f"dim={self.dim}, dtype={self.dtype.name}, curvature={self.curvature}, "
                f"count={self.count}, lr={self.lr}, betas={self.betas}, eps={self.eps}, "
                f"maximize={self.maximize})")


def bf16_nearest_even(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bits (uint16) nearest to float32 ``x``, ties to even; NaN stays NaN."""
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a NaN (rounding could carry its mantissa into inf)
        r[nan] = ((b[nan] >> 16) | 0x40).astype(np.uint16)
    return r


# -- validation ------------------------------------------------------------------------------
def check_lr(lr: Any, *, allow_zero: bool = False) -> float:
    """A finite lr > 0 (or >= 0 for a per-step value: schedules may reach 0)."""
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"lr must be a real number > 0, got {lr!r}") from None
    if not (math.isfinite(lr) and (lr >= 0.0 if allow_zero else lr > 0.0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"Invalid learning rate: {lr}; lr must be a finite number {bound}")
    return lr


def check_hparams(lr, betas, eps, maximize, nonfinite) -> tuple:
    lr = check_lr(lr)
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps must be a real number > 0, got {eps!r}") from None
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"Invalid epsilon value: {eps}; eps must be a finite number > 0 "
                         "(eps = 0 divides 0 by 0 for a row with a zero gradient)")
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise TypeError(f"betas must be a pair of floats in [0, 1), got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}; betas must lie "
                             "in [0, 1), e.g. betas=(0.9, 0.999)")
    if not isinstance(maximize, (bool, np.bool_)):
        raise TypeError(f"maximize must be a bool, got {maximize!r}")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_MODES}, got {nonfinite!r}")
    return lr, (b1, b2), eps, bool(maximize), nonfinite


def check_dtype(dtype: Any) -> np.dtype:
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = getattr(dtype, "name", None) or str(dtype)
    if name in ("float16", "half", "bfloat16", "torch.float16", "torch.bfloat16"):
        raise ValueError(
            f"dtype {name} is not supported: float16 rounds eps=1e-8 to 0 and underflows "
            "(1-beta2)*g^2, and bfloat16 loses the 0.999 decay (spec §6); use dtype='float32'")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"dtype must be 'float32' or 'float64', got {dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dt.name!r}")
    return dt


def check_curvature(curvature: Any) -> float:
    try:
        c = float(curvature)
    except (TypeError, ValueError):
        raise TypeError(f"curvature must be a real number >= 0, got {curvature!r}") from None
    if not (math.isfinite(c) and c >= 0.0):
        raise ValueError(
            f"curvature must be finite and >= 0 (0: Euclidean SparseAdam, c > 0: Poincaré "
            f"ball of curvature -c), got {curvature!r}")
    return c


def check_second_moment(second_moment: Any, curvature: float) -> str:
    """``"elementwise"`` or ``"rowwise"``; row-wise applies to the Euclidean kernel only."""
    if second_moment not in _format.SECOND_MOMENTS:
        raise ValueError(f"second_moment must be one of {_format.SECOND_MOMENTS}, got "
                         f"{second_moment!r}")
    if second_moment == "rowwise" and curvature > 0:
        raise ValueError(
            "second_moment='rowwise' is for curvature == 0: the ball kernel (curvature "
            f"{curvature}) already keeps one second-moment scalar per row (the Riemannian "
            "norm, spec §3.2); leave second_moment at 'elementwise'")
    return second_moment


def check_first_moment(first_moment: Any, curvature: float, dtype: np.dtype) -> str:
    """``"full"`` or ``"bfloat16"``; bfloat16 m is for float32 Euclidean stores."""
    if first_moment not in _format.FIRST_MOMENTS:
        raise ValueError(f"first_moment must be one of {_format.FIRST_MOMENTS}, got "
                         f"{first_moment!r}")
    if first_moment == "bfloat16" and (curvature > 0 or np.dtype(dtype) != np.float32):
        raise ValueError(
            "first_moment='bfloat16' is for float32 stores with curvature == 0 (got dtype "
            f"{np.dtype(dtype).name}, curvature {curvature}): the ball transports m, and a "
            "float64 store keeps full precision on purpose. Use first_moment='full'")
    return first_moment


def default_ball_eps(dtype: np.dtype) -> float:
    """geoopt's projection margin: 4e-3 for float32, 1e-5 for float64 (spec §3.1)."""
    return 4e-3 if np.dtype(dtype) == np.float32 else 1e-5


def maxnorm(c: float, ball_eps: float, dtype: np.dtype):
    """The projection radius in T: fl(1/sqrt(c + 1e-15)) * fl(1 - ball_eps) (spec §4)."""
    T = np.dtype(dtype).type
    return (T(1) / np.sqrt(T(c) + T(1e-15))) * T(1 - ball_eps)


def _check_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


# -- initialisation ----------------------------------------------------------------------------
def _chunks(n: int, rows: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, rows):
        yield lo, min(n, lo + rows)


def _progress(total: int, enabled: bool | None, desc: str):
    if enabled is None:
        enabled = total > 8
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="chunk")


def _validate_init_array(init: Any, num_rows: int, dim: int, curvature: float,
                         chunk_rows: int) -> Any:
    if not hasattr(init, "shape"):
        init = np.asarray(init)
    shape = tuple(init.shape)
    if shape != (num_rows, dim):
        raise ValueError(f"init must have shape (num_rows, dim) = ({num_rows}, {dim}), "
                         f"got {shape}; pass an array of that shape or a named init")
    kind = np.dtype(getattr(init, "dtype", np.float64)).kind if hasattr(init, "dtype") else "f"
    if kind not in "fiu":
        raise TypeError(f"init must hold real numbers, got dtype {init.dtype}")
    radius2 = 1.0 / curvature if curvature > 0 else math.inf
    for lo, hi in _chunks(num_rows, chunk_rows):
        blk = np.asarray(init[lo:hi], dtype=np.float64)
        if not np.isfinite(blk).all():
            bad = lo + int(np.argwhere(~np.isfinite(blk))[0, 0])
            raise ValueError(f"init must be finite; row {bad} holds NaN or Inf")
        if curvature > 0:
            sq = np.einsum("ij,ij->i", blk, blk)
            out = np.nonzero(sq >= radius2)[0]
            if out.size:
                r = lo + int(out[0])
                raise ValueError(
                    f"init points must lie inside the Poincaré ball of curvature -{curvature} "
                    f"(norm < 1/sqrt(c) = {math.sqrt(radius2):.6g}); row {r} has norm "
                    f"{math.sqrt(sq[out[0]]):.6g} ({out.size} such rows in rows {lo}..{hi - 1}). "
                    "Scale the init down or project it first")
    return init


def _fill(store: Store, init: Any, init_scale: float, seed: int, ball_eps: float,
          progress: bool | None) -> None:
    """Write the initial weights in chunks (m and v stay zero from fallocate)."""
    if init is None or store.w_off is None:
        return
    T = store.dtype.type
    d, o = store.dim, store.w_off
    rows = max(1, _INIT_CHUNK_BYTES // (store.stride * store.dtype.itemsize))
    chunks = list(_chunks(store.num_rows, rows))
    bar = _progress(len(chunks), progress, f"init {store.path.name}")
    named = init if isinstance(init, str) else None
    rng = np.random.default_rng(seed) if named else None
    mn = maxnorm(store.curvature, ball_eps, store.dtype) if store.curvature > 0 else None
    try:
        for lo, hi in chunks:
            if named == "normal":
                blk = rng.standard_normal((hi - lo, d), dtype=np.float64) * init_scale
            elif named == "uniform":
                blk = rng.uniform(-init_scale, init_scale, (hi - lo, d))
            else:
                blk = np.asarray(init[lo:hi])
            blk = np.asarray(blk, dtype=store.dtype)
            if mn is not None and named:
                nrm = np.sqrt(np.einsum("ij,ij->i", blk, blk, dtype=np.float64)).astype(T)
                over = nrm > mn
                if over.any():  # named inits start inside the usable ball
                    blk[over] = (blk[over] / nrm[over, None]) * mn
            store.data[lo:hi, o:o + d] = blk
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()


# -- life cycle ----------------------------------------------------------------------------------
def _manifest(state: State) -> dict[str, Any]:
    return {
        "format": _format.FORMAT_NAME,
        "version": _format.layout_version(state.store.layout),
        "layout": state.store.layout,
        "count": int(state.count),
        "hparams": {
            "lr": state.lr,
            "betas": list(state.betas),
            "eps": state.eps,
            "maximize": state.maximize,
            "ball_eps": state.ball_eps,
            "nonfinite": state.nonfinite,
        },
        "durability": state.durability,
    }


def create(path, num_rows: int, dim: int, *, curvature: float = 0.0, lr: float = 1e-3,
           betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
           maximize: bool = False, weights: bool = True, init: Any = None,
           init_scale: float = 1e-2, seed: int = 0, dtype: Any = "float32",
           ball_eps: float | None = None, nonfinite: str = "propagate", align: int = 0,
           durability: str = "flush", overwrite: bool = False, access: str = "auto",
           second_moment: str = "elementwise", first_moment: str = "full",
           progress: bool | None = None) -> State:
    """Create a store at ``path`` and return its open ``State`` (count 0).

    Parameters
    ----------
    path : str or Path
        Directory of the store (created if missing).
    num_rows, dim : int
        Shape of the embedding table.
    curvature : float, default 0.0
        ``0``: Euclidean lazy Adam, exactly ``torch.optim.SparseAdam``. ``c > 0``: Riemannian
        Adam on the Poincaré ball of curvature ``-c`` (geoopt ``SparseRiemannianAdam``).
    lr, betas, eps, maximize : as in ``torch.optim.SparseAdam``
        Stored in the manifest; ``lr`` can be overridden on every ``step``.
    weights : bool, default True
        ``False``: only m and v live here; the caller passes its weight rows to
        ``step(..., params=rows)``, which updates them in place.
    init : None, array-like of shape (num_rows, dim), "normal" or "uniform"
        Initial weights. ``None`` means zeros. Named inits draw ``N(0, init_scale^2)`` or
        ``U(-init_scale, init_scale)`` with ``numpy.random.default_rng(seed)``, in chunks;
        for ``c > 0`` rows beyond the projection radius are projected onto it. An array is
        checked (shape, finite, inside the ball for ``c > 0``) before anything is written.
    dtype : "float32" or "float64"
        Storage dtype of weights and state. float16/bfloat16 are refused (spec §6).
    ball_eps : float, optional
        Projection margin for ``c > 0``; default 4e-3 (float32) or 1e-5 (float64), as geoopt.
    nonfinite : "propagate", "skip_row" or "raise"
        What a NaN/Inf gradient does: spread as in torch/geoopt (default), leave that row and
        its state untouched, or raise before anything is written.
    align : int, default 0
        Pad each record to a multiple of this many bytes (e.g. 512 or 4096); 0 packs them.
    durability : "flush" or "step"
        ``"flush"`` (default): rows are written through the mapping and made durable by
        :func:`flush`, :func:`close` and :func:`checkpoint`; after a crash, steps taken since
        the last flush may be partly on disk (the OS writes dirty pages back at any time)
        while the manifest's count is the flushed one -- resume from a checkpoint then.
        ``"step"``: every step is atomic (undo journal + fdatasync + manifest commit): after
        a crash, ``open`` rolls back to exactly the last completed step and ``count`` says
        which. Costs two fdatasyncs and a manifest rename per step.
    overwrite : bool, default False
        Replace an existing store at ``path`` (refused while another writer holds it).
    second_moment : "elementwise" or "rowwise", default "elementwise"
        ``curvature == 0`` only. ``"elementwise"``: SparseAdam's v, one per coordinate
        (parity). ``"rowwise"``: one v per row from the mean of ``g²`` over the row (FBGEMM's
        partial row-wise Adam, spec §7.3): the state shrinks from ``2*dim`` to ``dim + 1``
        values per row, the update is no longer SparseAdam's (m still is, bit for bit). See
        :func:`dsa_core.step` for the formula. Stores written with it are format version 2.
    first_moment : "full" or "bfloat16", default "full"
        float32 stores with ``curvature == 0`` only. ``"bfloat16"``: m is stored as
        bfloat16 with stochastic rounding (spec §6; v stays float32), 2 bytes per
        coordinate instead of 4. The step computes in float32 from the stored m and rounds
        the new m up or down with probability by its distance (random bits from a hash of
        the step, row and coordinate: reproducible, independent of threads and batch
        order); the weight update uses the unrounded new m. Format version 2.
    access : "auto", "ram" or "disk", default "auto"
        How the mapping is paged (not stored; pass it again to :func:`open`). ``"ram"``:
        the table stays in the page cache -- 2 MiB huge folios mapped by PMD entries, far
        fewer TLB misses and page faults (a fault reads or zero-fills 2 MiB). ``"disk"``: the
        table is larger than memory -- ``MADV_RANDOM``, one 4 KiB page per fault, no
        read-around; pair it with :func:`prefetch`. ``"auto"``: "ram" when the data file fits
        in 70% of the memory this process may use (physical memory, capped by its cgroup)
        *and* under the kernel's background-writeback threshold (``vm.dirty_background_*``:
        a dirty huge folio is written back whole, 2 MiB for one row), else "disk"; the
        environment variable ``DSA_ACCESS`` overrides "auto". The resolved
        value is ``state.store.access``.
    progress : bool, optional
        Show a tqdm bar while writing a named/array init (default: for large tables).

    Returns
    -------
    State
        Open for writing; this process holds the store's writer lock until ``close``.
    """
    num_rows = _check_int("num_rows", num_rows)
    dim = _check_int("dim", dim)
    dt = check_dtype(dtype)
    c = check_curvature(curvature)
    lr, betas, eps, maximize, nonfinite = check_hparams(lr, betas, eps, maximize, nonfinite)
    second_moment = check_second_moment(second_moment, c)
    first_moment = check_first_moment(first_moment, c, dt)
    if ball_eps is None:
        ball_eps = default_ball_eps(dt) if c > 0 else 0.0
    ball_eps = float(ball_eps)
    if c > 0 and not 0.0 <= ball_eps < 1.0:
        raise ValueError(f"ball_eps must lie in [0, 1), got {ball_eps}")
    if not isinstance(weights, (bool, np.bool_)):
        raise TypeError(f"weights must be a bool, got {weights!r}")
    if durability not in DURABILITY_MODES:
        raise ValueError(f"durability must be one of {DURABILITY_MODES}, got {durability!r}")
    _format.check_access(access)
    if isinstance(align, (bool, np.bool_)) or not isinstance(align, (int, np.integer)) \
            or align < 0 or (align and align % dt.itemsize):
        raise ValueError(f"align must be 0 or a positive multiple of {dt.itemsize} bytes, "
                         f"got {align!r}")
    layout = _format.make_layout(num_rows, dim, dt, c, bool(weights), int(align),
                                 second_moment, first_moment)
    if init is not None:
        if not weights:
            raise ValueError("init sets the weights, but weights=False stores hold none; "
                             "drop init or use weights=True")
        if isinstance(init, str):
            if init not in ("normal", "uniform"):
                raise ValueError(f"init must be None, an array of shape ({num_rows}, {dim}), "
                                 f"'normal' or 'uniform'; got {init!r}")
            init_scale = float(init_scale)
            if not (math.isfinite(init_scale) and init_scale >= 0):
                raise ValueError(f"init_scale must be finite and >= 0, got {init_scale}")
        else:
            rows = max(1, _INIT_CHUNK_BYTES // (layout["stride"] * dt.itemsize))
            init = _validate_init_array(init, num_rows, dim, c, rows)

    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{str(directory)!r} exists and is not a directory")
    existing = [p for p in (_format.MANIFEST_FILE, _format.DATA_FILE)
                if (directory / p).exists()]
    if existing and not overwrite:
        raise FileExistsError(
            f"a store already exists at {str(directory)!r} ({', '.join(existing)}); "
            "open it with dsa_core.open(path) or pass overwrite=True to replace it")
    directory.mkdir(parents=True, exist_ok=True)
    if existing:
        # refuse to replace a store that a writer holds: take its lock first
        probe = Store(directory, layout, "r+")
        probe._lock()
        probe._release()
        (directory / _format.MANIFEST_FILE).unlink(missing_ok=True)
        (directory / _format.DATA_FILE).unlink(missing_ok=True)
        (directory / _format.JOURNAL_FILE).unlink(missing_ok=True)

    store = Store.create_file(directory, layout, access)
    try:
        _fill(store, init, init_scale, seed, ball_eps, progress)
        store.commit_new_file()
        state = State(store, 0, lr, betas, eps, maximize, ball_eps, nonfinite, durability)
        _format.write_manifest(directory, _manifest(state))
    except BaseException:
        store.close()
        (directory / (_format.DATA_FILE + ".tmp")).unlink(missing_ok=True)
        (directory / _format.DATA_FILE).unlink(missing_ok=True)
        raise
    return state


def open(path, mode: str = "r+", *, access: str = "auto") -> State:
    """Open an existing store; the state resumes with the stored hyperparameters and count.

    ``mode="r+"`` (default) takes the store's writer lock (a second writer gets a clear
    error); ``mode="r"`` maps it read-only, without a lock, for inspection and export while
    a training process writes. ``access`` is the paging hint, as for :func:`create`.
    """
    if mode not in ("r", "r+"):
        raise ValueError(f"mode must be 'r' (read-only) or 'r+' (read-write), got {mode!r}")
    _format.check_access(access)
    directory = Path(path)
    manifest = _format.read_manifest(directory)
    try:
        layout = manifest["layout"]
        hp = manifest["hparams"]
        count = int(manifest["count"])
        store = Store.open_file(directory, layout, mode, access)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"manifest of {str(directory)!r} is missing a field ({exc}); "
                         "the store is damaged") from None
    if mode == "r+":
        store.journal_recover(count)  # roll back a journaled step that never committed
    return State(store, count, float(hp["lr"]), tuple(float(b) for b in hp["betas"]),
                 float(hp["eps"]), bool(hp["maximize"]), float(hp["ball_eps"]),
                 str(hp.get("nonfinite", "propagate")), str(manifest.get("durability", "flush")))


def flush(state: State) -> None:
    """Make every step so far durable: msync the rows, then replace the manifest (count)."""
    _require_writable(state)
    state.store.sync()
    state.store.journal_void()  # a stale undo record must never roll back flushed rows
    _format.write_manifest(state.store.path, _manifest(state))


def checkpoint(state: State, dest, *, overwrite: bool = False) -> Path:
    """Write a consistent snapshot of the store to ``dest``; training may go on afterwards.

    Flushes the live store, copies its data file (reflink where the filesystem supports it),
    writes the manifest with the current count and hyperparameters, fsyncs both and renames
    the directory into place: a ``kill -9`` at any moment leaves either no ``dest`` or a
    complete one. ``dsa_core.open(dest)`` resumes from it exactly. Replacing an existing
    snapshot needs ``overwrite=True`` (swapped atomically where the filesystem allows).
    """
    _require_writable(state)
    dest = Path(dest)
    if dest.resolve() == state.store.path.resolve():
        raise ValueError(f"checkpoint destination {str(dest)!r} is the live store itself; "
                         "choose another directory")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"checkpoint destination {str(dest)!r} exists; pass "
                              "overwrite=True to replace it")
    flush(state)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _format.copy_store(state.store.path, dest, _manifest(state), overwrite)
    return dest


_RESTORE_CHUNK_BYTES = 1 << 24  # 16 MiB of records per copy chunk


def restore_rows(live: State, snap: State) -> State:
    """Copy every record of the snapshot ``snap`` into ``live``; returns ``live`` at its count.

    Used by the adapters to resume from a checkpoint into their own stores (same layout,
    checked by the caller). The undo journal is voided first: a journal of the last step
    could otherwise "roll back" restored rows at the next ``open``. Then the records are
    copied in chunks through the mapping and ``live`` is flushed with the snapshot's count.
    Not atomic: a crash in the middle leaves ``live`` mixed; run the restore again.
    """
    _require_writable(live)
    live.store.journal_void()
    dst, src = live.store.data, snap.store.data
    rows = max(1, _RESTORE_CHUNK_BYTES // (dst.shape[1] * dst.itemsize))
    for lo in range(0, dst.shape[0], rows):
        dst[lo:lo + rows] = src[lo:lo + rows]
    new = live._replace(count=snap.count)
    flush(new)
    return new


def close(state: State) -> None:
    """Flush (if writable) and release the writer lock. Safe to call twice."""
    st = state.store
    if st.closed:
        return
    if st.mode == "r+":
        flush(state)
    st.close()


def _require_writable(state: State) -> None:
    st = state.store
    if st.closed:
        raise ValueError(f"store {str(st.path)!r} is closed; reopen it with dsa_core.open(path)")
    if st.mode != "r+":
        raise ValueError(f"store {str(st.path)!r} was opened read-only (mode='r'); "
                         "open it with mode='r+' to train")


def remove(path) -> None:
    """Delete a store directory (refused while a writer holds it)."""
    directory = Path(path)
    manifest = _format.read_manifest(directory)
    st = Store.open_file(directory, manifest["layout"], "r+")
    st.close()
    shutil.rmtree(directory)
