"""Argument checks shared by ``dsa_core`` and its adapters: one implementation per rule.

Each check returns the normalised value or raises ``TypeError`` / ``ValueError`` with a
message that says what must hold, what came, and how to fix it. Every check takes an
optional ``what`` (e.g. ``"DiskSparseAdam"``) that prefixes its message, so an adapter
names itself without a second copy of the rule.

>>> from dsa_core.tools import validation
>>> validation.check_curvature(1)
1.0
>>> validation.check_second_moment("rowwise", 1.0, what="DiskEmbedding")
Traceback (most recent call last):
    ...
ValueError: DiskEmbedding: second_moment='rowwise' is for curvature == 0: ...
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ._coalesce import bounds
from ._layout import FIRST_MOMENTS, OPTIMIZERS, SECOND_MOMENTS
from ._paging import ACCESS_MODES, check_access

__all__ = [
    "ACCESS_MODES",
    "as_index",
    "DURABILITY_MODES",
    "FIRST_MOMENTS",
    "INIT_NAMES",
    "NONFINITE_MODES",
    "OPTIMIZERS",
    "SECOND_MOMENTS",
    "UNCLEAN_CHOICES",
    "check_access",
    "check_adagrad_hparams",
    "check_adagrad_options",
    "check_curvature",
    "check_dtype",
    "check_first_moment",
    "check_hparams",
    "check_lr",
    "check_memory_arg",
    "check_optimizer",
    "check_positive_int",
    "check_second_moment",
    "check_seed",
    "check_storage",
    "check_unclean",
    "check_weight_decay",
    "check_weight_decay_options",
]

NONFINITE_MODES = ("propagate", "skip_row", "raise")
DURABILITY_MODES = ("flush", "step")
INIT_NAMES = ("zeros", "normal", "uniform")
STORAGE_KINDS = ("inplace", "log")
STORAGE_CHOICES = ("auto", *STORAGE_KINDS)


def _p(what: str) -> str:
    return f"{what}: " if what else ""


def as_index(idx: Any, num_rows: int, name: str = "idx") -> np.ndarray:
    """Check and convert row ids to a 1-D C-contiguous int64 array in ``[0, num_rows)``.

    The one row-id rule of the core (``step``, ``gather``, ``read_records``, the hints and
    the engines all take ids through it).
    """
    arr = np.asarray(idx)
    if arr.dtype == np.bool_ or arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integer row ids, got dtype {arr.dtype}; "
                        f"convert with {name}.astype(np.int64) (floats are not rounded for you)")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one row id per gradient row), got shape "
                         f"{arr.shape}; flatten it with {name}.reshape(-1) and reshape the "
                         "gradient to (len(idx), dim) to match")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    if not arr.flags.writeable:  # e.g. np.asarray(jax.Array): keep one numba specialisation
        arr = arr.copy()
    if arr.shape[0]:
        lo, hi = bounds(arr)
        if lo < 0 or hi >= num_rows:
            bad = lo if lo < 0 else hi
            raise IndexError(f"{name} must lie in [0, num_rows) = [0, {num_rows}); got "
                             f"{bad} (min {lo}, max {hi})")
    return arr


def check_lr(lr: Any, *, allow_zero: bool = False, what: str = "") -> float:
    """A finite lr > 0 (or >= 0 for a per-step value: schedules may reach 0)."""
    try:
        lr = float(lr)
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}lr must be a real number > 0, got {lr!r}") from None
    if not (math.isfinite(lr) and (lr >= 0.0 if allow_zero else lr > 0.0)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{_p(what)}Invalid learning rate: {lr}; lr must be a finite number "
                         f"{bound}")
    return lr


def _check_eps(eps, zero_row: str, example: str, what: str) -> float:
    """``eps`` as a float, finite and > 0, or torch's "Invalid epsilon value" naming why (eps
    = 0 divides 0 by 0 for ``zero_row``) and ``example``."""
    try:
        eps = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}eps must be a real number > 0, got {eps!r}") from None
    if not (math.isfinite(eps) and eps > 0.0):
        raise ValueError(f"{_p(what)}Invalid epsilon value: {eps}; eps must be a finite "
                         f"number > 0 (eps = 0 divides 0 by 0 for {zero_row}){example}")
    return eps


def check_hparams(lr, betas, eps, maximize, nonfinite, *, what: str = "") -> tuple:
    """``(lr, (b1, b2), eps, maximize, nonfinite)`` checked and normalised, torch's order."""
    lr = check_lr(lr, what=what)
    eps = _check_eps(eps, "a row with a zero gradient", "", what)
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}betas must be a pair of floats in [0, 1), got "
                        f"{betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{_p(what)}Invalid beta parameter at index {i}: {b}; betas "
                             "must lie in [0, 1), e.g. betas=(0.9, 0.999)")
    if not isinstance(maximize, (bool, np.bool_)):
        raise TypeError(f"{_p(what)}maximize must be a bool, got {maximize!r}")
    check_nonfinite(nonfinite, what=what)
    return lr, (b1, b2), eps, bool(maximize), nonfinite


def check_weight_decay(weight_decay: Any, *, what: str = "") -> float:
    """A finite ``weight_decay >= 0`` (0 turns it off), torch's message for a bad value."""
    try:
        if isinstance(weight_decay, (bool, np.bool_, str, bytes)):
            raise TypeError
        wd = float(weight_decay)  # a Python or numpy number, a 1-element tensor
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}weight_decay must be a real number >= 0, got "
                        f"{weight_decay!r}") from None
    if not (math.isfinite(wd) and wd >= 0.0):
        raise ValueError(f"{_p(what)}Invalid weight_decay value: {wd}; weight_decay must be a "
                         "finite number >= 0 (0 turns it off), e.g. weight_decay=1e-2")
    return wd


def check_weight_decay_options(weight_decay: Any, decoupled_weight_decay: Any = False,
                               decay_missed_steps: Any = False, per_row_step: Any = False, *,
                               what: str = "") -> tuple[float, bool, bool, bool]:
    """``(weight_decay, decoupled_weight_decay, decay_missed_steps, per_row_step)`` checked.

    The flags must be bools. ``decay_missed_steps=True`` (decay a revisited row for every step
    it missed, docs/algorithms.md §7.1) is a form of decoupled decay: it needs
    ``decoupled_weight_decay=True`` (with L2 decay the decay goes through the gradient, and
    a step the row missed has no gradient to go through).
    """
    wd = check_weight_decay(weight_decay, what=what)
    for name, flag in (("decoupled_weight_decay", decoupled_weight_decay),
                       ("decay_missed_steps", decay_missed_steps),
                       ("per_row_step", per_row_step)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{_p(what)}{name} must be a bool, got {flag!r}")
    if decay_missed_steps and not decoupled_weight_decay:
        raise ValueError(
            f"{_p(what)}decay_missed_steps=True needs decoupled_weight_decay=True: it applies "
            "AdamW's decay p <- p*(1 - lr*weight_decay) of every step a row missed when the "
            "row comes back, and L2 decay (weight_decay alone, added to the gradient) has no "
            "gradient on the steps a row misses. Pass decoupled_weight_decay=True, or drop "
            "decay_missed_steps")
    return wd, bool(decoupled_weight_decay), bool(decay_missed_steps), bool(per_row_step)


def check_optimizer(optimizer: Any, *, what: str = "") -> str:
    """One of :data:`OPTIMIZERS`: what the store's records hold state for."""
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"{_p(what)}optimizer must be one of {OPTIMIZERS} (Adam's m and v, "
                         "or Adagrad's accumulator per coordinate or per row), got "
                         f"{optimizer!r}")
    return optimizer


def _nonneg(name: str, value: Any, label: str, what: str) -> float:
    try:
        if isinstance(value, (bool, np.bool_, str, bytes)):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}{name} must be a real number >= 0, got {value!r}") from None
    if not (math.isfinite(x) and x >= 0.0):
        raise ValueError(f"{_p(what)}Invalid {label} value: {x}; {name} must be a finite "
                         "number >= 0")
    return x


def check_adagrad_hparams(lr, lr_decay, eps, initial_accumulator_value, maximize, nonfinite,
                          *, what: str = "") -> tuple:
    """``(lr, lr_decay, eps, initial_accumulator_value, maximize, nonfinite)`` of an Adagrad
    store, checked in ``torch.optim.Adagrad``'s order with its messages' start ("Invalid
    learning rate", "Invalid lr_decay value", "Invalid initial_accumulator_value value",
    "Invalid epsilon value"). Stricter than torch where the core is for Adam too: ``lr > 0``
    at creation (a step's ``lr`` may be 0) and ``eps > 0`` (eps = 0 divides 0 by 0 for a
    row whose accumulator and gradient are 0)."""
    lr = check_lr(lr, what=what)
    lr_decay = _nonneg("lr_decay", lr_decay, "lr_decay", what)
    iav = _nonneg("initial_accumulator_value", initial_accumulator_value,
                  "initial_accumulator_value", what)
    eps = _check_eps(eps, "a row whose accumulator and gradient are 0",
                     ", e.g. eps=1e-10 (Adagrad's default)", what)
    if not isinstance(maximize, (bool, np.bool_)):
        raise TypeError(f"{_p(what)}maximize must be a bool, got {maximize!r}")
    check_nonfinite(nonfinite, what=what)
    return lr, lr_decay, eps, iav, bool(maximize), nonfinite


def check_adagrad_options(optimizer: str, *, curvature: float = 0.0, betas: Any = None,
                          second_moment: str = "elementwise", first_moment: str = "full",
                          weight_decay: Any = 0.0, decoupled_weight_decay: Any = False,
                          decay_missed_steps: Any = False, per_row_step: Any = False,
                          what: str = "") -> float:
    """The Adam-only options refused for ``optimizer`` ("adagrad" or "rowwise_adagrad"),
    each with what came, what must hold and the fix; returns the checked ``weight_decay``
    (row-wise only: L2, FBGEMM's; elementwise refuses it as ``torch.optim.Adagrad`` does
    with sparse gradients)."""
    head = f"{_p(what)}optimizer={optimizer!r}"
    wd = check_weight_decay(weight_decay, what=what)
    if curvature != 0:
        raise ValueError(f"{head} is Euclidean: curvature must be 0, got {curvature!r}; the "
                         "Poincaré ball (curvature > 0) has Riemannian Adam only, use "
                         "optimizer='adam'")
    if betas is not None:
        raise ValueError(f"{head} has no betas (they are Adam's moments' decay rates), got "
                         f"betas={betas!r}; drop betas, or use optimizer='adam'")
    if second_moment != "elementwise":
        raise ValueError(f"{head} takes second_moment='elementwise' only, got "
                         f"{second_moment!r}: second_moment='rowwise' is Adam's row-wise v. "
                         "For one accumulator per row use optimizer='rowwise_adagrad'")
    if first_moment != "full":
        raise ValueError(f"{head} has no first moment, so first_moment must be 'full', got "
                         f"{first_moment!r}; drop first_moment")
    for name, flag in (("decoupled_weight_decay", decoupled_weight_decay),
                       ("decay_missed_steps", decay_missed_steps),
                       ("per_row_step", per_row_step)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{_p(what)}{name} must be a bool, got {flag!r}")
        if flag:
            why = {"decoupled_weight_decay": "decoupled (AdamW's) weight decay is Adam's; "
                   "row-wise Adagrad takes L2 weight_decay (FBGEMM's), elementwise none",
                   "decay_missed_steps": "it catches up AdamW's decay, which Adagrad has not",
                   "per_row_step": "it is the per-row bias correction of Adam, and Adagrad "
                   "has no bias correction"}[name]
            raise ValueError(f"{head} does not take {name}=True: {why}. Drop {name}, or use "
                             "optimizer='adam'")
    if wd and optimizer == "adagrad":
        raise ValueError(f"{head}: weight_decay option is not compatible with sparse "
                         f"gradients (torch.optim.Adagrad refuses it too), got weight_decay="
                         f"{wd}; use optimizer='rowwise_adagrad' (L2, FBGEMM's), or "
                         "weight_decay=0")
    return wd


def check_nonfinite(nonfinite: Any, *, what: str = "") -> str:
    """What a NaN/Inf gradient does: one of :data:`NONFINITE_MODES`."""
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"{_p(what)}nonfinite must be one of {NONFINITE_MODES} (spread as "
                         "torch does, skip that row, or raise before writing), got "
                         f"{nonfinite!r}")
    return nonfinite


def check_dtype(dtype: Any, *, what: str = "") -> np.dtype:
    """float32 or float64; float16 and bfloat16 are refused with the reason."""
    try:
        name = np.dtype(dtype).name
    except TypeError:
        name = getattr(dtype, "name", None) or str(dtype)
    if name in ("float16", "half", "bfloat16", "torch.float16", "torch.bfloat16"):
        raise ValueError(
            f"{_p(what)}dtype {name} is not supported: float16 rounds eps=1e-8 to 0 and "
            "underflows (1-beta2)*g^2, and bfloat16 loses the 0.999 decay (docs/algorithms.md "
            "§6); use dtype='float32'")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{_p(what)}dtype must be 'float32' or 'float64', got "
                        f"{dtype!r}") from None
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"{_p(what)}dtype must be 'float32' or 'float64', got {dt.name!r}")
    return dt


def check_curvature(curvature: Any, *, what: str = "") -> float:
    """A finite curvature ``c >= 0``: 0 is Euclidean, ``c > 0`` the ball of curvature -c."""
    try:
        c = float(curvature)
    except (TypeError, ValueError):
        raise TypeError(f"{_p(what)}curvature must be a real number >= 0, got "
                        f"{curvature!r}") from None
    if not (math.isfinite(c) and c >= 0.0):
        raise ValueError(
            f"{_p(what)}Invalid curvature: {curvature!r}; curvature must be finite and >= 0 "
            "(0: Euclidean SparseAdam, c > 0: Poincaré ball of curvature -c)")
    return c


def check_second_moment(second_moment: Any, curvature: float, *, what: str = "") -> str:
    """``"elementwise"`` or ``"rowwise"``; row-wise applies to the Euclidean kernel only."""
    if second_moment not in SECOND_MOMENTS:
        raise ValueError(f"{_p(what)}second_moment must be one of {SECOND_MOMENTS} "
                         f"(SparseAdam's v, or one v per row), got {second_moment!r}")
    if second_moment == "rowwise" and curvature > 0:
        raise ValueError(
            f"{_p(what)}second_moment='rowwise' is for curvature == 0: the ball kernel "
            f"(curvature {curvature}) already keeps one second-moment scalar per row (the "
            "Riemannian norm, docs/algorithms.md §3.2); leave second_moment at 'elementwise'")
    return second_moment


def check_first_moment(first_moment: Any, curvature: float, dtype: Any, *,
                       what: str = "") -> str:
    """``"full"`` or ``"bfloat16"``; bfloat16 m is for float32 Euclidean stores."""
    if first_moment not in FIRST_MOMENTS:
        raise ValueError(f"{_p(what)}first_moment must be one of {FIRST_MOMENTS} (m in the "
                         f"table's dtype, or stored as bfloat16), got {first_moment!r}")
    if first_moment == "bfloat16" and (curvature > 0 or np.dtype(dtype) != np.float32):
        raise ValueError(
            f"{_p(what)}first_moment='bfloat16' is for float32 stores with curvature == 0 "
            f"(got dtype {np.dtype(dtype).name}, curvature {curvature}): the ball transports "
            "m, and a float64 store keeps full precision on purpose. Use first_moment='full'")
    return first_moment


def check_positive_int(name: str, value: Any, *, what: str = "") -> int:
    """A Python or numpy integer > 0 (bools are refused)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{_p(what)}{name} must be a positive int, got {value!r}")
    if value <= 0:
        raise ValueError(f"{_p(what)}{name} must be a positive int, got {value}")
    return int(value)


def check_seed(seed: Any, *, what: str = "") -> int:
    """The seed of a named init: an int in ``[0, 2**64)`` (numpy integers too, bools not).

    Both store kinds compute a row's initial weights from ``(seed, row)`` (``dsa_core._init``).

    >>> check_seed(7), check_seed(2**64 - 1) == 2**64 - 1
    (7, True)
    >>> check_seed(-1)
    Traceback (most recent call last):
        ...
    ValueError: seed must be an int in [0, 2**64) ... got -1; pass e.g. seed=0
    """
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) \
            or not 0 <= seed < 2**64:
        raise ValueError(f"{_p(what)}seed must be an int in [0, 2**64) (a store's named inits "
                         f"are a function of (seed, row)), got {seed!r}; pass e.g. seed=0")
    return int(seed)


def check_storage(storage: Any, *, what: str = "", auto: bool = True) -> str:
    """``"auto"`` (chosen by size at create), ``"inplace"`` (one mapped file of records) or
    ``"log"`` (log-structured, with a memory budget); ``auto=False``: a kind, not "auto".

    >>> check_storage("log"), check_storage("auto")
    ('log', 'auto')
    >>> check_storage("lsm")
    Traceback (most recent call last):
        ...
    ValueError: storage must be one of ('auto', 'inplace', 'log') ...
    """
    kinds = STORAGE_CHOICES if auto else STORAGE_KINDS
    if storage not in kinds:
        raise ValueError(f"{_p(what)}storage must be one of {kinds} ("
                         + ("'auto': chosen by the table's size, the default; " if auto else "")
                         + "'inplace': one mapped file updated in place; 'log': the "
                         f"log-structured store with a memory budget), got {storage!r}")
    return str(storage)


_SUFFIXES = {"": 1, "b": 1,
             "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
             "t": 10**12, "tb": 10**12,
             "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
             "ti": 2**40, "tib": 2**40}


UNCLEAN_CHOICES = ("refuse", "accept")  # open(..., unclean=): what to do with an unclean stop


def check_unclean(unclean: str) -> str:
    """The ``unclean=`` argument of ``dsa_core.open``, checked."""
    if not isinstance(unclean, str) or unclean not in UNCLEAN_CHOICES:
        raise ValueError(f"unclean must be one of {UNCLEAN_CHOICES} (what open does with a "
                         "store whose writer stopped without flushing: 'refuse' raises "
                         "UncleanStopError, 'accept' opens its rows as they are), got "
                         f"{unclean!r}")
    return unclean


def check_memory_arg(memory: Any, storage: str = "log", *, what: str = "") -> int | None:
    """The memory budget of a log store in bytes, or None (the default budget).

    ``memory`` is an int (bytes) or a string: a number followed by an SI suffix (``k``,
    ``M``, ``G``, ``T``, optionally with ``B``: powers of 1000) or an IEC one (``Ki``,
    ``Mi``, ``Gi``, ``Ti``, optionally with ``B``: powers of 1024); case does not matter.
    Only log stores take one (``storage="log"``).

    >>> check_memory_arg("512MiB"), check_memory_arg("1.5G"), check_memory_arg(4096)
    (536870912, 1500000000, 4096)
    >>> check_memory_arg("lots")
    Traceback (most recent call last):
        ...
    ValueError: memory must be a number of bytes: ... got 'lots'
    >>> check_memory_arg("1GiB", "inplace")
    Traceback (most recent call last):
        ...
    ValueError: memory= is for storage='log' ...
    """
    if memory is None:
        return None
    if storage == "inplace":
        raise ValueError(f"{_p(what)}memory= is for storage='log' (the budget of the log "
                         f"store's in-memory region); an in-place store (storage={storage!r}) "
                         "uses the page cache and takes no budget: drop memory= or pass "
                         "storage='log'")
    hint = ("a number of bytes: an int, or a string such as '4GiB', '512MiB', '1.5G' "
            "(SI suffixes k/M/G/T are powers of 1000, IEC Ki/Mi/Gi/Ti powers of 1024)")
    if isinstance(memory, (bool, np.bool_)):
        raise TypeError(f"{_p(what)}memory must be {hint}, got {memory!r}")
    if isinstance(memory, (int, np.integer)):
        value = int(memory)
    elif isinstance(memory, str):
        text = memory.strip().replace("_", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ")
        suffix = text[len(num):].strip().lower()
        try:
            number = float(num)
        except ValueError:
            number = math.nan
        if suffix not in _SUFFIXES or not math.isfinite(number):
            raise ValueError(f"{_p(what)}memory must be {hint}, got {memory!r}")
        value = int(number * _SUFFIXES[suffix])
    else:
        raise TypeError(f"{_p(what)}memory must be {hint}, got {type(memory).__name__}")
    if value <= 0:
        raise ValueError(f"{_p(what)}memory must be > 0 bytes, got {memory!r}")
    return value
