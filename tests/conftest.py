"""Shared fixtures for the dsa_core tests.

* ``spec_batches`` / ``spec_init``: the reference-test recipe of docs/algorithms.md §5 (Zipf-like
  ids with forced patterns, N(0,1) float32 gradients scaled by 1e-3 at every 7th step, and the
  Euclidean / ball initialisations).
* ``store_digest``: sha256 of every file of a store directory, to prove that a rejected call
  left the store byte-identical.
* ``kind``: the storage kind, ``"inplace"`` and ``"log"`` -- a behaviour test that takes it runs
  on both kinds (the storage kind is a performance choice, never a behaviour).

Plain helpers (records, digests, log budgets, the crash harness, ...) are in helpers.py.

The objects that exist once the tests are collected (torch, JAX, PyKEEN and the test modules
imported) are frozen out of the garbage collector's way (``gc.freeze``): a full collection
in a process holding them took ~0.3-0.5 s, and the automatic ones come often in a long run.

The Ctrl-C tests need Python's own SIGINT handler: a shell that starts a job in the background
(``make test &``, some CI runners) starts it with SIGINT ignored, which Python then keeps and
every child process inherits, so a SIGINT would do nothing. The handler is put back here, in
the test process and (through it) in every process a test starts.
"""

from __future__ import annotations

import gc
import math
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import KINDS, digest, num_threads  # noqa: F401  (num_threads: re-exported)

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

SPEC_N = 1000
SPEC_B = 64
SPEC_STEPS = 200
ROW1_STEPS = (1, 150, 200)


def make_spec_batches(seed: int, dim: int, *, num_rows: int = SPEC_N, steps: int = SPEC_STEPS,
                      batch: int = SPEC_B) -> list[tuple[np.ndarray, np.ndarray]]:
    """The §5 batch stream: ``steps`` pairs ``(idx int64 (B,), vals float32 (B, dim))``.

    Ids are i.i.d. with p(r) ~ 1/(r+1)^1.1 (row 1 excluded from the random draws), then the
    forced patterns overwrite a few slots: row 0 in every batch, row 1 only at steps 1, 150
    and 200, row 2 three times in every 10th batch. The slots are then shuffled, so the forced
    ids sit anywhere in the (uncoalesced, unsorted) batch. Step numbers are 1-based.
    """
    rng = np.random.default_rng(seed)
    p = 1.0 / (np.arange(num_rows) + 1.0) ** 1.1
    p[1] = 0.0
    p /= p.sum()
    out = []
    for t in range(1, steps + 1):
        idx = rng.choice(num_rows, size=batch, p=p).astype(np.int64)
        idx[0] = 0
        if t in ROW1_STEPS:
            idx[1] = 1
        if t % 10 == 0:
            idx[2:5] = 2
        idx = idx[rng.permutation(batch)]
        vals = rng.standard_normal((batch, dim), dtype=np.float32)
        if t % 7 == 0:
            vals *= np.float32(1e-3)
        out.append((idx, vals))
    return out


def make_spec_init(seed: int, dim: int, curvature: float, *, num_rows: int = SPEC_N,
                   dtype=np.float32) -> np.ndarray:
    """§5 initial weights in ``dtype``.

    c == 0: N(0, 0.1^2) drawn in float32. c > 0: random direction times a radius
    U(0, 0.9)/sqrt(c); row 3 at 0.995/sqrt(c), row 4 at 0.9999/sqrt(c) (beyond the float32
    projection radius), row 5 at the origin.
    """
    rng = np.random.default_rng(10_000 + seed)
    if curvature == 0:
        return (rng.standard_normal((num_rows, dim), dtype=np.float32)
                * np.float32(0.1)).astype(dtype)
    direc = rng.standard_normal((num_rows, dim))
    direc /= np.linalg.norm(direc, axis=1, keepdims=True)
    radius = rng.uniform(0.0, 0.9, num_rows)
    radius[3] = 0.995
    radius[4] = 0.9999
    radius[5] = 0.0
    return (direc * (radius / math.sqrt(curvature))[:, None]).astype(dtype)


def touched_rows(batches, num_rows: int = SPEC_N) -> np.ndarray:
    """Boolean mask of the rows that appear in at least one batch."""
    mask = np.zeros(num_rows, bool)
    for idx, _ in batches:
        mask[idx] = True
    return mask


@pytest.fixture(scope="session")
def spec_batches() -> Callable[..., list[tuple[np.ndarray, np.ndarray]]]:
    """``spec_batches(seed, dim, steps=200)`` -> the §5 batch stream (cached per call args)."""
    cache: dict = {}

    def get(seed: int, dim: int, steps: int = SPEC_STEPS):
        key = (seed, dim, steps)
        if key not in cache:
            cache[key] = make_spec_batches(seed, dim, steps=steps)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def spec_init() -> Callable[..., np.ndarray]:
    """``spec_init(seed, dim, curvature, dtype)`` -> §5 initial weights."""
    return lambda seed, dim, curvature, dtype=np.float32: make_spec_init(
        seed, dim, curvature, dtype=dtype)


@pytest.fixture(scope="session")
def spec_touched() -> Callable[..., np.ndarray]:
    """``spec_touched(batches)`` -> mask of rows that appear in some batch."""
    return touched_rows


@pytest.fixture(scope="session")
def store_digest() -> Callable[[Path], dict[str, str]]:
    """``store_digest(dir)`` -> {file name: sha256} for every file of a store directory."""
    return digest


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    """The storage kind of a behaviour test: every test that takes it runs on both kinds."""
    return request.param


def pytest_collection_finish(session) -> None:
    """Collected: everything imported so far goes to the permanent generation (module
    docstring); what the tests make is collected as before."""
    gc.collect()
    gc.freeze()
