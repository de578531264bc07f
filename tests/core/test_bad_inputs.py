"""One table of bad inputs across dsa_core, adapters.torch and adapters.jax.

Every row names a call that must be refused: the exception type, the message, and -- checked
by the test, not by the row -- that every file and directory under the test's root is
byte-identical afterwards (sha256 of each file, before and after) and that no store's step
count moved. The stores were trained a little and flushed first, so "unchanged" has teeth.

The whole matrix runs twice, on in-place stores and on log-structured ones (``storage="log"``).
A log store keeps the steps since its last flush in an in-memory region, so unchanged files
alone would not show a write that has not been flushed yet: the test also compares every
record of every open store (``dsa_core.read_records``), bit for bit. A case whose answer on
a log store differs says so in ``LOG_ANSWERS``; a case that cannot apply to one kind is
skipped with the reason.

dsa_core's own, longer matrix (create/step/open/damaged files) is in store/test_store.py; this
one spans the three layers with the inputs a user is most likely to get wrong.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import dsa_core

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

from adapters import jax as dj
from adapters.torch import DiskEmbedding, DiskSparseAdam, DiskWeight

NAN = float("nan")
REPO = Path(__file__).resolve().parents[2]
STORAGES = ("inplace", "log")
LOG_MEMORY = "1MiB"   # holds every row of the small tables here
TIGHT_ROWS = 4        # the region of the "tight" log stores: 4 records


def tree(root: Path) -> tuple[dict[str, str], list[str]]:
    """sha256 of every file plus the name of every directory under ``root``."""
    files = {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(root.rglob("*")) if p.is_file()}
    dirs = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir())
    return files, dirs


def _sparse(ids, rows, size):
    return torch.sparse_coo_tensor(torch.tensor([ids]), torch.ones(len(ids), rows), size,
                                   check_invariants=False)


def _tight_memory(root: Path, rows: int, **kw) -> int:
    """A log-store budget of TIGHT_ROWS record slots for a ``rows`` x 4 float32 store like
    ``kw`` (the budget pays for the store's index too)."""

    probe = dsa_core.create(root / "probe", rows, 4, storage="log", memory=LOG_MEMORY, **kw)
    try:
        return dsa_core.region_memory(probe.layout, TIGHT_ROWS)
    finally:
        dsa_core.close(probe)
        dsa_core.remove(root / "probe")


@pytest.fixture(scope="module", params=STORAGES)
def env(request, tmp_path_factory):
    """Trained, flushed stores of all three layers, plus a few prepared directories.

    Every store is of the kind ``request.param``; on log stores also two tables whose
    region holds only TIGHT_ROWS records (for batches that do not fit)."""
    storage = request.param
    root = tmp_path_factory.mktemp(f"bad-inputs-{storage}")
    e = SimpleNamespace(root=root, storage=storage)
    e.kind = {} if storage == "inplace" else {"storage": "log", "memory": LOG_MEMORY}
    kind = e.kind
    # dsa_core
    e.core = dsa_core.create(root / "core", 10, 4, init="normal", init_scale=0.1, **kind)
    e.core = dsa_core.step(e.core, [1, 3, 1], np.ones((3, 4), np.float32))
    dsa_core.flush(e.core)
    (root / "foreign").mkdir()
    (root / "foreign" / "manifest.json").write_text(json.dumps({"format": "parquet"}))
    # torch: an nn.Embedding stepped by DiskSparseAdam, and a DiskEmbedding
    torch.manual_seed(0)
    e.emb = torch.nn.Embedding(20, 4, sparse=True)
    e.opt = DiskSparseAdam(e.emb.parameters(), lr=0.01, state_dir=root / "opt", **kind)
    e.de = DiskEmbedding(30, 4, state_dir=root / "de", init="normal", seed=1, **kind)
    e.opt_de = DiskSparseAdam(e.de.parameters(), lr=0.01)
    # at step 0: outdated after this; taken as of large tables, whose state dicts name
    # snapshots (a small table's hold its rows)
    limit, DiskWeight.read_limit = DiskWeight.read_limit, 0
    try:
        e.sd0, e.msd0 = e.opt.state_dict(), e.de.state_dict()
    finally:
        DiskWeight.read_limit = limit
    for m, o in ((e.emb, e.opt), (e.de, e.opt_de)):
        m(torch.tensor([1, 2, 2, 5])).sum().backward()
        o.step()
        o.zero_grad()
    e.opt.checkpoint(root / "torch-ckpt")
    e.opt.flush()
    e.de.flush()
    # the step-0 state dicts name snapshots (on both kinds): delete them
    assert e.opt.release_snapshots() == 1 and e.de.release_snapshots() == 1
    closed_opt = DiskSparseAdam([torch.nn.Parameter(torch.zeros(20, 4))],
                                state_dir=root / "opt-closed", **kind)
    closed_opt.close()
    DiskEmbedding(30, 4, state_dir=root / "de-closed", **kind).close()
    e.opt21 = DiskSparseAdam([torch.nn.Parameter(torch.zeros(21, 4))], state_dir=root / "o21",
                             **kind)
    # jax: one table, a stale state kept, a float64 store
    e.tx = dj.sparse_adam(1e-2)
    e.js0 = e.tx.init(dsa_core.create(root / "jax", 25, 4, init="normal", **kind))
    _, e.js = e.tx.update((np.array([2, 4]), np.ones((2, 4), np.float32)), e.js0)
    dj.checkpoint(e.js, root / "jax-ckpt")
    dj.flush(e.js)
    e.core64 = dsa_core.create(root / "core64", 10, 4, dtype="float64", **kind)
    e.tight = []  # log stores only: regions of TIGHT_ROWS records, two tables per optimizer
    if storage == "log":
        tight = {"storage": "log", "memory": _tight_memory(root.parent / f"{root.name}-p",
                                                           20, weights=False)}
        e.tight_params = [torch.nn.Parameter(torch.zeros(20, 4)) for _ in range(2)]
        e.opt2 = DiskSparseAdam(e.tight_params, lr=0.01, state_dir=root / "opt2", **tight)
        for p in e.tight_params:
            p.grad = _sparse([1, 2], 4, (20, 4))
        e.opt2.step()
        e.opt2.zero_grad(set_to_none=True)
        e.opt2.flush()
        wmem = _tight_memory(root.parent / f"{root.name}-p", 25)
        e.tx2 = dj.sparse_adam(1e-2)
        _, e.js2 = e.tx2.update(
            {k: (np.array([1, 2]), G2) for k in "ab"},
            e.tx2.init({k: dsa_core.create(root / f"jax2{k}", 25, 4, init="normal",
                                           storage="log", memory=wmem) for k in "ab"}))
        dj.flush(e.js2)
        e.tight = [e.opt2.store_for(p) for p in e.tight_params] + list(
            dj.core_states(e.js2).values())
    yield e
    for o in (e.opt, e.opt_de, e.de, e.opt21):
        o.close()
    dj.close(e.js)
    dsa_core.close(e.core)
    dsa_core.close(e.core64)
    if storage == "log":
        e.opt2.close()
        dj.close(e.js2)


def stores(e) -> list:
    """The current State of every open store of the environment."""
    out = [e.core, e.opt.store_for(e.emb.weight), e.de.store, dj.core_states(e.js), e.core64]
    if e.storage == "log":
        out += [e.opt2.store_for(p) for p in e.tight_params]
        out += list(dj.core_states(e.js2).values())
    return out


def counts(e) -> tuple:
    extra = (int(e.js2.count),) if e.storage == "log" else ()
    return (int(e.js.count), *extra, *(s.count for s in stores(e)))


def records(e) -> list[bytes]:
    """Every record of every open store, as bytes: a log store's unflushed steps are in its
    region, not in its files."""
    return [dsa_core.read_records(s, np.arange(s.num_rows)).tobytes() for s in stores(e)]


def _reset(e) -> None:
    """Undo what a case set up in memory (gradients, a changed lr); nothing on disk."""
    e.opt.zero_grad(set_to_none=True)
    e.opt_de.zero_grad(set_to_none=True)
    for o in (e.opt, e.opt_de):
        o.param_groups[0]["lr"] = 0.01
    if e.storage == "log":
        e.opt2.zero_grad(set_to_none=True)


def _grad_step(make_grad):
    def call(e):
        e.emb.weight.grad = make_grad()
        e.opt.step()
    return call


def _group_lr_step(lr):
    def call(e):
        e.opt.param_groups[0]["lr"] = lr
        e.emb(torch.tensor([1, 2])).sum().backward()
        e.opt.step()
    return call


def _read_only_step(e):
    ro = dsa_core.open(e.root / "core", mode="r")
    try:
        dsa_core.step(ro, [1], np.ones((1, 4), np.float32))
    finally:
        dsa_core.close(ro)


def _jax_init_read_only(e):
    ro = dsa_core.open(e.root / "jax", mode="r")
    try:
        dj.sparse_adam(1e-2).init(ro)
    finally:
        dsa_core.close(ro)


def _jax_init_closed(e):
    s = dsa_core.open(e.root / "core", mode="r")
    dsa_core.close(s)
    dj.sparse_adam(1e-2).init(s)


def _jax_update(idx, grad, tx=None):
    def call(e):
        (tx or e.tx).update((np.asarray(idx), grad), e.js)
    return call


def _gather64(e):
    with jax.enable_x64(False):
        dj.gather_batch(e.core64, np.array([1, 2]))


def _embedding(where="new", **kw):
    def call(e):
        DiskEmbedding(**{"num_embeddings": 30, "embedding_dim": 4,
                         "state_dir": e.root / where, **e.kind, **kw})
    return call


def _optimizer(param=None, where="new", **kw):
    def call(e):
        p = param() if param is not None else torch.nn.Parameter(torch.zeros(20, 4))
        DiskSparseAdam([p], state_dir=e.root / where, **e.kind, **kw)
    return call


def _create(**kw):
    def call(e):
        args = {"num_rows": 10, "dim": 4, **e.kind, **kw}
        dsa_core.create(e.root / "new", args.pop("num_rows"), args.pop("dim"), **args)
    return call


def _create_inplace(**kw):
    def call(e):
        dsa_core.create(e.root / "new", 10, 4, **kw)
    return call


def _tight_torch_step(e):
    """Two log stores of one optimizer: the first table's batch fits its region, the
    second's (6 distinct rows) does not; nothing may be written to either."""
    a, b = e.tight_params
    a.grad = _sparse([1, 2], 4, (20, 4))
    b.grad = _sparse([0, 1, 2, 3, 4, 5], 4, (20, 4))
    e.opt2.step()


def _tight_jax_update(e):
    e.tx2.update({"a": (np.array([1, 2]), G2),
                  "b": (np.arange(6), np.ones((6, 4), np.float32))}, e.js2)


def _restore_other_layout(e):
    snap = dsa_core.open(e.root / "core64", mode="r")
    try:
        dsa_core.restore(e.core, snap)
    finally:
        dsa_core.close(snap)


G1 = np.ones((1, 4), np.float32)
G2 = np.ones((2, 4), np.float32)

# (id, call(env), exception, message regex)
CASES = [
    # -- dsa_core ---------------------------------------------------------------------------
    ("core-id-out-of-range", lambda e: dsa_core.step(e.core, [10], G1), IndexError,
     r"idx must lie in \[0, num_rows\) = \[0, 10\); got 10"),
    ("core-id-negative", lambda e: dsa_core.step(e.core, [2, -1], G2), IndexError,
     r"got -1 \(min -1, max 2\)"),
    ("core-id-float", lambda e: dsa_core.step(e.core, np.array([1.0]), G1), TypeError,
     r"idx must hold integer row ids, got dtype float64"),
    ("core-id-2d", lambda e: dsa_core.step(e.core, [[1, 2]], G2), ValueError,
     r"idx must be 1-D"),
    ("core-grad-shape", lambda e: dsa_core.step(e.core, [1, 2], np.ones((2, 5), np.float32)),
     ValueError, r"grad must have shape \(len\(idx\), dim\) = \(2, 4\), got \(2, 5\)"),
    ("core-grad-dtype", lambda e: dsa_core.step(e.core, [1, 2], G2.astype(np.float64)),
     TypeError, r"grad must have the store dtype float32, got float64"),
    ("core-lr-zero", _create(lr=0.0), ValueError, r"Invalid learning rate: 0\.0"),
    ("core-lr-negative-per-step", lambda e: dsa_core.step(e.core, [1], G1, lr=-1e-3),
     ValueError, r"Invalid learning rate: -0\.001"),
    ("core-eps-zero", _create(eps=0.0), ValueError, r"Invalid epsilon value: 0\.0"),
    ("core-beta-one", _create(betas=(0.9, 1.0)), ValueError,
     r"Invalid beta parameter at index 1: 1\.0"),
    ("core-curvature-negative", _create(curvature=-1.0), ValueError,
     r"curvature must be finite and >= 0"),
    ("core-curvature-nan", _create(curvature=NAN), ValueError,
     r"curvature must be finite and >= 0"),
    ("core-float16", _create(dtype="float16"), ValueError,
     r"dtype float16 is not supported: float16 rounds eps=1e-8 to 0"),
    ("core-init-shape", _create(init=np.zeros((10, 5))), ValueError,
     r"init must have shape \(num_rows, dim\) = \(10, 4\), got \(10, 5\)"),
    ("core-init-outside-ball", _create(curvature=1.0, init=np.full((10, 4), 0.5)), ValueError,
     r"init points must lie inside the Poincaré ball.*row 0 has norm 1\b"),
    ("core-existing-store", lambda e: dsa_core.create(e.root / "core", 10, 4, **e.kind),
     FileExistsError, r"a store already exists at .*pass overwrite=True"),
    ("core-missing-store", lambda e: dsa_core.open(e.root / "nope"), FileNotFoundError,
     r"no DSA store at .*the directory does not exist"),
    ("core-foreign-store", lambda e: dsa_core.open(e.root / "foreign"), ValueError,
     r"is not a DSA manifest: format is 'parquet'"),
    ("core-second-writer", lambda e: dsa_core.open(e.root / "core"),
     dsa_core.StoreLockedError, r"already open for writing .* open this one read-only"),
    ("core-read-only-then-step", _read_only_step, ValueError,
     r"was opened read-only \(mode='r'\); open it with mode='r\+' to train"),
    ("core-checkpoint-onto-itself",
     lambda e: dsa_core.checkpoint(e.core, e.root / "core", overwrite=True), ValueError,
     r"is the live store itself"),
    ("core-convert-onto-itself",
     lambda e: dsa_core.convert(e.core, e.root / "core", storage="inplace", overwrite=True),
     ValueError, r"convert destination .* is the source store itself"),
    ("core-convert-existing", lambda e: dsa_core.convert(e.core, e.root / "core64",
                                                         storage="inplace"),
     FileExistsError, r"a store already exists at .*core64.*overwrite=True"),
    ("core-restore-other-layout", _restore_other_layout, ValueError,
     r"holds a 10 x 4 float64 table .* records move only between stores created the same way"),
    ("core-write-records-repeat", lambda e: dsa_core.write_records(
        e.core, [1, 1], np.zeros((2, e.core.layout["stride"]), np.float32)), ValueError,
     r"idx must not repeat a row in write_records"),
    ("core-write-records-shape", lambda e: dsa_core.write_records(
        e.core, [1, 2], np.zeros((2, 3), np.float32)), ValueError,
     r"records must be a \(2, \d+\) float32 array"),
    ("core-write-records-out-of-range", lambda e: dsa_core.write_records(
        e.core, [10], np.zeros((1, e.core.layout["stride"]), np.float32)), IndexError,
     r"\[0, 10\); got 10"),
    ("core-memory-for-inplace", _create_inplace(storage="inplace", memory="1MiB"), ValueError,
     r"memory= is for storage='log'"),
    ("core-log-access-ram", _create(access="ram"), ValueError,
     r"access='ram' is for in-place stores"),
    ("core-log-memory-string", _create(memory="lots"), ValueError,
     r"memory must be a number of bytes"),
    ("core-log-memory-below-one-slot", _create(memory=16), ValueError,
     r"memory budget holds 0 records, a batch needs 1"),
    ("core-log-batch-over-region", lambda e: dsa_core.step(
        e.tight[0], np.arange(6), np.ones((6, 4), np.float32),
        params=np.zeros((6, 4), np.float32)), ValueError,
     r"memory budget holds 4 records, a batch needs 6"),
    # -- adapters.torch ---------------------------------------------------------------------
    ("torch-lr-zero", _optimizer(lr=0.0), ValueError, r"^Invalid learning rate: 0\.0$"),
    ("torch-lr-negative", _optimizer(lr=-0.1), ValueError, r"^Invalid learning rate: -0\.1$"),
    ("torch-eps-zero", _optimizer(eps=0.0), ValueError, r"^Invalid epsilon value: 0\.0$"),
    ("torch-eps-negative", _optimizer(eps=-1e-8), ValueError,
     r"^Invalid epsilon value: -1e-08$"),
    ("torch-beta0-negative", _optimizer(betas=(-0.1, 0.999)), ValueError,
     r"^Invalid beta parameter at index 0: -0\.1$"),
    ("torch-beta1-one", _optimizer(betas=(0.9, 1.0)), ValueError,
     r"^Invalid beta parameter at index 1: 1\.0$"),
    ("torch-curvature-negative", _optimizer(curvature=-1.0), ValueError,
     r"Invalid curvature: -1\.0; curvature must be finite and >= 0"),
    ("torch-curvature-nan", _optimizer(curvature=NAN), ValueError, r"Invalid curvature: nan"),
    ("torch-float16-param", _optimizer(lambda: torch.nn.Parameter(
        torch.zeros(20, 4, dtype=torch.float16))), TypeError,
     r"has dtype torch\.float16; disk stores hold float32 or float64 rows"),
    ("torch-1d-param", _optimizer(lambda: torch.nn.Parameter(torch.zeros(20))), ValueError,
     r"needs 2-D \(num_rows, dim\) parameters"),
    ("torch-no-state-dir", lambda e: DiskSparseAdam([torch.nn.Parameter(torch.zeros(3, 2))]),
     ValueError, r"DiskSparseAdam needs state_dir=\.\.\."),
    ("torch-grad-id-out-of-range", _grad_step(lambda: _sparse([3, 20], 4, (20, 4))),
     IndexError, r"has row ids 3\.\.20; they must lie in \[0, 20\)"),
    ("torch-grad-sparse-dim-2", _grad_step(lambda: torch.sparse_coo_tensor(
        torch.tensor([[1, 3], [0, 2]]), torch.tensor([1.0, 2.0]), (20, 4),
        check_invariants=True)), ValueError, r"must have sparse_dim == 1"),
    ("torch-dense-grad", _grad_step(lambda: torch.ones(20, 4)), RuntimeError,
     r"^SparseAdam does not support dense gradients, please consider Adam instead$"),
    ("torch-group-lr-negative", _group_lr_step(-1.0), ValueError,
     r"^Invalid learning rate: -1\.0$"),
    ("torch-group-lr-nan", _group_lr_step(NAN), ValueError, r"^Invalid learning rate: nan$"),
    ("torch-second-optimizer", lambda e: DiskSparseAdam(e.emb.parameters(),
                                                        state_dir=e.root / "opt", **e.kind),
     dsa_core.StoreLockedError, r"state_dir .* is already used by another DiskSparseAdam"),
    ("torch-store-of-other-shape", _optimizer(lambda: torch.nn.Parameter(torch.zeros(21, 4)),
                                              where="opt-closed"), ValueError,
     r"parameter \[0, 0\]: the existing store .* holds a 20 x 4 float32 table"),
    ("torch-diskembedding-stepped-twice", lambda e: DiskSparseAdam(e.de.parameters()),
     dsa_core.StoreLockedError, r"already stepped by another DiskSparseAdam"),
    ("torch-load-checkpoint-other-shape", lambda e: e.opt21.load_checkpoint(
        e.root / "torch-ckpt"), ValueError,
     (r"checkpoint store 'group0_param0' is 20 x 4 float32 with curvature 0\.0, but the "
      r"parameter in its position has a 21 x 4 float32 store")),
    ("torch-checkpoint-exists", lambda e: e.opt.checkpoint(e.root / "torch-ckpt"),
     FileExistsError, r"checkpoint destination .* exists; pass overwrite=True"),
    ("torch-checkpoint-over-state-dir",
     lambda e: e.opt.checkpoint(e.root / "opt", overwrite=True), ValueError,
     r"would replace or contain the live store directory"),
    ("torch-load-checkpoint-not-one", lambda e: e.opt.load_checkpoint(e.root / "jax-ckpt"),
     FileNotFoundError, r"is not a DiskSparseAdam checkpoint: it has no optimizer\.pt"),
    ("torch-load-outdated-state-dict", lambda e: e.opt.load_state_dict(e.sd0), ValueError,
     r"parameter \[0, 0\]: this state dict was taken at step 0 and names the snapshot .* "
     r"which is gone"),
    ("torch-log-batch-over-region-of-second-table", _tight_torch_step, ValueError,
     r"memory budget holds 4 records, a batch needs 6"),
    ("emb-init-shape", _embedding(init=np.zeros((30, 5))), ValueError,
     r"init must have shape \(num_rows, dim\) = \(30, 4\), got \(30, 5\)"),
    ("emb-init-outside-ball", _embedding(curvature=1.0, init=np.full((30, 4), 0.6)),
     ValueError, r"inside the Poincaré ball of curvature -1\.0.*row 0 has norm 1\.2"),
    ("emb-curvature-negative", _embedding(curvature=-2.0), ValueError,
     r"Invalid curvature: -2\.0"),
    ("emb-float16", _embedding(dtype=torch.float16), TypeError,
     r"DiskEmbedding has dtype torch\.float16"),
    ("emb-existing-other-shape", _embedding("de-closed", num_embeddings=31), ValueError,
     r"DiskEmbedding\(31, 4\): the existing store .* holds a 30 x 4 float32 table"),
    ("emb-second-writer", lambda e: DiskEmbedding(30, 4, state_dir=e.root / "de", resume=True,
                                                  **e.kind),
     dsa_core.StoreLockedError, r"already open for writing"),
    ("emb-foreign-store", lambda e: DiskEmbedding(30, 4, state_dir=e.root / "foreign"),
     ValueError, r"is not a DSA manifest: format is 'parquet'"),
    ("emb-float-ids", lambda e: e.de(torch.tensor([1.0, 2.0])), TypeError,
     r"DiskEmbedding expects integer ids as input \(a torch\.long or torch\.int tensor, a "
     r"numpy integer array or a list of ints\), got a tensor of torch\.float32\. Convert it "
     r"with input\.long\(\)"),
    ("emb-float-numpy-ids", lambda e: e.de(np.array([1.0, 2.0])), TypeError,
     r"as input .*got a numpy array of float64\. Pass integer ids"),
    ("emb-ragged-list-ids", lambda e: e.de([[1, 2], [3]]), TypeError,
     r"as input .*got a list that is not a rectangular array"),
    ("emb-id-out-of-range", lambda e: e.de(torch.tensor([3, 30])), IndexError,
     r"idx must lie in \[0, num_rows\) = \[0, 30\); got 30"),
    ("emb-id-negative", lambda e: e.de(torch.tensor([-1, 3])), IndexError,
     r"got -1 \(min -1, max 3\)"),
    ("emb-padding-idx", _embedding(padding_idx=30), ValueError,
     r"^Padding_idx must be within num_embeddings$"),
    ("emb-mode-max", _embedding(mode="max"), ValueError, r"'max' bags are not supported"),
    ("emb-offsets-without-bag-mode",
     lambda e: e.de(torch.tensor([1, 2]), torch.tensor([0])), ValueError,
     r"offsets and per_sample_weights are for bag modes"),
    ("emb-load-outdated-state-dict", lambda e: e.de.load_state_dict(e.msd0), RuntimeError,
     r"this state dict was taken at step 0 and names the snapshot .* which is gone"),
    ("emb-checkpoint-exists", lambda e: e.de.checkpoint(e.root / "torch-ckpt"),
     FileExistsError, r"exists; pass overwrite=True"),
    # -- adapters.jax -----------------------------------------------------------------------
    ("jax-id-out-of-range", _jax_update([2, 25], G2), IndexError,
     r"idx must lie in \[0, num_rows\) = \[0, 25\); got 25"),
    ("jax-id-negative", _jax_update([-1, 2], G2), IndexError,
     r"got -1 \(min -1, max 2\); padding ids \(-1\) are allowed only as a trailing block"),
    ("jax-id-float", _jax_update(np.array([1.0, 2.0]), G2), TypeError,
     r"idx must hold integer row ids, got dtype float64"),
    ("jax-id-2d", _jax_update([[1, 2]], G2), ValueError, r"idx must be 1-D"),
    ("jax-grad-shape", _jax_update([1, 2], np.ones((2, 5), np.float32)), ValueError,
     r"grad_rows must have shape \(len\(idx\), dim\) = \(2, 4\), got \(2, 5\)"),
    ("jax-grad-dtype", _jax_update([1, 2], G2.astype(np.float64)), TypeError,
     r"grad_rows must have the store dtype float32, got float64"),
    ("jax-grad-int", _jax_update([1, 2], jnp.ones((2, 4), jnp.int32)), TypeError,
     r"store dtype float32, got int32"),
    ("jax-dense-grad", lambda e: e.tx.update(jnp.zeros((25, 4)), e.js), TypeError,
     r"update takes row gradients \(idx, grad_rows\), got a dense table gradient"),
    ("jax-padding-with-gradient", _jax_update([1, -1], G2), ValueError,
     r"padding rows \(id -1\) must have a zero gradient"),
    ("jax-lr-zero", lambda e: dj.sparse_adam(0.0), ValueError,
     r"Invalid learning rate: 0\.0; lr must be a finite number > 0"),
    ("jax-lr-nan", lambda e: dj.sparse_adam(NAN), ValueError, r"Invalid learning rate: nan"),
    ("jax-schedule-negative", _jax_update([1], G1, dj.sparse_adam(lambda c: -0.5)),
     ValueError, r"learning-rate schedule at count 1\): Invalid learning rate: -0\.5"),
    ("jax-eps-negative", lambda e: dj.sparse_adam(1e-2, eps=-1e-8), ValueError,
     r"Invalid epsilon value: -1e-08"),
    ("jax-b1-one", lambda e: dj.sparse_adam(1e-2, b1=1.0), ValueError,
     r"Invalid beta parameter b1: 1\.0; it must lie in \[0, 1\)"),
    ("jax-b2-negative", lambda e: dj.sparse_adam(1e-2, b2=-0.5), ValueError,
     r"Invalid beta parameter b2: -0\.5"),
    ("jax-stale-state", lambda e: e.tx.update((np.array([1]), G1), e.js0), RuntimeError,
     r"stale optimizer state: its count is 0 but the store has made 1 steps"),
    ("jax-init-read-only", _jax_init_read_only, ValueError,
     r"is read-only; open it with dsa_core\.open\(path\) \(mode 'r\+'\) to train"),
    ("jax-init-closed", _jax_init_closed, ValueError, r"is closed; open it"),
    ("jax-init-not-a-store", lambda e: dj.sparse_adam(1e-2).init(np.zeros((25, 4))),
     TypeError, r"init takes open dsa_core stores"),
    ("jax-gather-float-ids", lambda e: dj.gather_batch(e.js.stores, np.array([1.5])), TypeError,
     r"ids must hold integer row ids, got dtype float64"),
    ("jax-gather-out-of-range", lambda e: dj.gather_batch(e.js.stores, np.array([[0, 25]])),
     IndexError, r"\[0, 25\); got 25"),
    ("jax-gather-float64-without-x64", _gather64, TypeError,
     r"the store is float64 but JAX is in 32-bit mode"),
    ("jax-checkpoint-exists", lambda e: dj.checkpoint(e.js, e.root / "jax-ckpt"),
     FileExistsError, r"checkpoint destination .* exists; pass overwrite=True"),
    ("jax-checkpoint-stale", lambda e: dj.checkpoint(e.js0, e.root / "new"), RuntimeError,
     r"stale optimizer state: its count is 0"),
    ("jax-restore-not-a-checkpoint", lambda e: dj.restore(e.js, e.root / "torch-ckpt"),
     FileNotFoundError, r"is not an adapters\.jax checkpoint: it has no checkpoint\.json"),
    ("jax-log-batch-over-region-of-second-table", _tight_jax_update, ValueError,
     r"memory budget holds 4 records, a batch needs 6"),
]

_NO_REGION = "an in-place store has no memory region: every batch fits"
_LOG_OPTION = "a log-store option; valid (or not refused) on in-place stores"
# How a case answers on each kind where it is not the row's answer: (exception, regex) or
# a reason to skip it there.
INPLACE_ANSWERS = {
    "core-log-access-ram": _LOG_OPTION,
    "core-log-memory-string": "memory= on an in-place store has its own row "
                              "(core-memory-for-inplace)",
    "core-log-memory-below-one-slot": "memory= on an in-place store has its own row "
                                      "(core-memory-for-inplace)",
    "core-log-batch-over-region": _NO_REGION,
    "torch-log-batch-over-region-of-second-table": _NO_REGION,
    "jax-log-batch-over-region-of-second-table": _NO_REGION,
}
LOG_ANSWERS = {
    "core-memory-for-inplace": "memory= is what a log store takes: nothing to refuse",
    # a log store over an in-place one names both kinds
    "core-convert-existing": (FileExistsError,
                              r"a store already exists at .*core64.*storage='log'.*"
                              r"overwrite=True"),
}


def _answer(case_id: str, storage: str, exc, match):
    """The (exception, regex) a case must give on ``storage``, or skip it there."""
    alt = (INPLACE_ANSWERS if storage == "inplace" else LOG_ANSWERS).get(case_id)
    if isinstance(alt, str):
        pytest.skip(f"{case_id} on {storage} stores: {alt}")
    return alt if alt is not None else (exc, match)


@pytest.mark.parametrize(("case_id", "call", "exc", "match"),
                         [pytest.param(i, c, x, m, id=i) for i, c, x, m in CASES])
def test_bad_input_is_refused_and_writes_nothing(env, case_id, call, exc, match):
    exc, match = _answer(case_id, env.storage, exc, match)
    before = tree(env.root)
    n_before = counts(env)
    rec_before = records(env)
    try:
        with pytest.raises(exc, match=match):
            call(env)
    finally:
        _reset(env)
    assert tree(env.root) == before
    assert counts(env) == n_before
    assert records(env) == rec_before  # also what a log store holds in its region only
    assert all(s.storage == env.storage for s in stores(env))


def test_every_answer_names_a_case():
    ids = {i for i, *_ in CASES}
    assert set(INPLACE_ANSWERS) <= ids and set(LOG_ANSWERS) <= ids


def test_the_table_is_big_enough():
    layers = {i.split("-")[0] for i, *_ in CASES}
    assert {"core", "torch", "emb", "jax"} <= layers
    assert len(CASES) >= 25
    assert len({i for i, *_ in CASES}) == len(CASES)


# -- a negative row id in a torch sparse gradient ------------------------------------------------
NEGATIVE_ID_SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    sys.path.insert(0, sys.argv[2])
    from adapters.torch import DiskSparseAdam
    warnings.simplefilter("ignore")
    emb = torch.nn.Embedding(20, 4, sparse=True)
    opt = DiskSparseAdam(emb.parameters(), state_dir=sys.argv[1])
    emb.weight.grad = torch.sparse_coo_tensor(torch.tensor([[3, -1, 3]]), torch.ones(3, 4),
                                              (20, 4), check_invariants=False)
    try:
        opt.step()
    except IndexError as exc:
        print("IndexError:", exc)
""")


def test_negative_row_id_in_a_torch_sparse_gradient(tmp_path):
    r = subprocess.run([sys.executable, "-c", NEGATIVE_ID_SCRIPT, str(tmp_path / "opt"),
                        str(REPO)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, f"rc {r.returncode}: {r.stderr[-300:]}"
    assert "IndexError:" in r.stdout and "must lie in [0, 20)" in r.stdout


# -- a read-only directory ------------------------------------------------------------------------
@contextlib.contextmanager
def read_only_view(src: Path, where: Path):
    """``src`` seen through a read-only path: a read-only bind mount (root ignores file
    modes), or ``chmod 0o555`` for other users. Skips where neither is possible."""
    if os.geteuid() != 0:
        mode = src.stat().st_mode
        os.chmod(src, 0o555)
        try:
            yield src
        finally:
            os.chmod(src, mode)
        return
    where.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(where)],
                        capture_output=True, check=False).returncode == 0
    if not ok:
        pytest.skip("cannot bind-mount here")
    try:
        if subprocess.run(["mount", "-o", "remount,bind,ro", str(where)],
                          capture_output=True, check=False).returncode != 0:
            pytest.skip("cannot remount read-only here")
        yield where
    finally:  # lazily where a mapping still pins it; never leave the mount behind
        if subprocess.run(["umount", str(where)], capture_output=True,
                          check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.mark.parametrize("storage", STORAGES)
def test_read_only_directory(tmp_path, storage):
    """A store in a directory nobody may write: writers are refused with the OS's message,
    nothing is written, and read-only access still works (dsa_core and both adapters)."""
    kind = {} if storage == "inplace" else {"storage": "log", "memory": LOG_MEMORY}
    rw = tmp_path / "rw"
    s = dsa_core.create(rw / "core", 10, 4, init="normal", **kind)
    s = dsa_core.step(s, [1, 2], G2)
    dsa_core.close(s)
    DiskEmbedding(30, 4, state_dir=rw / "de", **kind).close()
    DiskSparseAdam([torch.nn.Parameter(torch.zeros(20, 4))], state_dir=rw / "opt",
                   **kind).close()
    before = tree(rw)
    with read_only_view(rw, tmp_path / "ro") as ro:
        erofs = r"(Read-only file system|Permission denied)"
        with pytest.raises(OSError, match=erofs):
            dsa_core.open(ro / "core")
        with pytest.raises(OSError, match=erofs):
            dsa_core.create(ro / "new", 10, 4, **kind)
        with pytest.raises(OSError, match=erofs):
            DiskEmbedding(30, 4, state_dir=ro / "de", resume=True, **kind)
        with pytest.raises(OSError, match=erofs):
            DiskSparseAdam([torch.nn.Parameter(torch.zeros(20, 4))], state_dir=ro / "opt",
                           **kind)
        reader = dsa_core.open(ro / "core", mode="r")
        assert reader.count == 1 and reader.storage == storage
        w = reader.layout["w"]
        np.testing.assert_array_equal(dsa_core.gather(reader, [1, 2]),
                                      dsa_core.read_records(reader, [1, 2])[:, w:w + 4])
        with pytest.raises(ValueError, match="is read-only"):
            dj.sparse_adam(1e-2).init(reader)
        with pytest.raises(ValueError, match=r"opened read-only \(mode='r'\)"):
            dsa_core.step(reader, [1], G1)
        dsa_core.close(reader)
        del reader
        gc.collect()  # drop the mapping, so that the mount can go
    assert tree(rw) == before
