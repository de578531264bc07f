"""adapters.pykeen: PyKEEN's own pipeline and training loops with DiskAdam and sparse tables.

* Parity: a PyKEEN model whose tables are ``SparseEmbedding`` (weights in RAM) or
  ``DiskBackedEmbedding`` (weights on disk), trained by ``DiskAdam`` through ``pipeline()``,
  ends with the weights (max abs diff, printed) and the MRR / Hits@10 of the same model with
  ``SparseEmbedding`` tables trained by ``torch.optim.SparseAdam`` through the same pipeline,
  on Nations (ships inside PyKEEN), for TransE, DistMult, ComplEx and RotatE, sLCWA and LCWA.
* The constrainer on the batch's rows gives PyKEEN's whole-table result; initializers are
  PyKEEN's (same seed, same first weights, a pretrained one sliced per chunk).
* The optimizer rebuild of PyKEEN's training loop: the old optimizer is closed (never two
  writers), a second train() starts afresh as SparseAdam does, continue_training goes on.
* PyKEEN's checkpoints resume a run exactly.
* A table of several chunks waits for its first read to write a reset, so pipeline() writes it
  once, with the weights of the same run whose resets are written at once; every read, save,
  load, close, garbage collection and the interpreter's exit write a pending reset first.
* Process ends of the PyKEEN path: a forgotten close flushes (weights, constraints, counts),
  Ctrl-C leaves a store that opens cleanly, kill -9 after a flush keeps every flushed step,
  on both store kinds (one child: the entity table in place, the relation table a log store).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pykeen")
import torch  # noqa: E402
from pykeen.datasets import Nations  # noqa: E402
from pykeen.models import TransE  # noqa: E402
from pykeen.nn.init import init_phases, xavier_uniform_, xavier_uniform_norm_  # noqa: E402
from pykeen.pipeline import pipeline  # noqa: E402
from pykeen.training import SLCWATrainingLoop  # noqa: E402

import dsa_core  # noqa: E402
from adapters import pykeen as dsa  # noqa: E402
from adapters.torch import StoreLockedError  # noqa: E402

pytestmark = pytest.mark.torch
ROOT = Path(__file__).resolve().parents[3]
logging.getLogger("pykeen").setLevel(logging.ERROR)
logging.getLogger("torch_max_mem").setLevel(logging.ERROR)

TRAIN = dict(num_epochs=2, batch_size=128, use_tqdm=False, pin_memory=False)
EVAL = dict(slice_size=5, use_tqdm=False)
NATIONS_TRAIN = 1592  # training triples of Nations


@pytest.fixture(scope="module", autouse=True)
def _frozen_heap():
    """PyKEEN's training loop calls ``gc.collect()`` after every epoch (and after its sub-batch
    probe); in a test process holding torch, torch._dynamo, PyKEEN and earlier tests' objects
    each call took ~0.5 s, most of this module's time. Before each test of this module the
    objects that survive a collection go to the permanent generation (gc.freeze, see
    ``_refrozen``), so those calls scan only what the test makes; nothing else changes, and
    everything is unfrozen (and collectable again) after the module. torch._dynamo, which
    torch's first optimizer imports, is imported before, not inside, the first test."""
    import torch._dynamo  # noqa: F401
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def _refrozen(_frozen_heap):
    gc.collect()
    gc.freeze()


def _steps(epochs: int, batch: int) -> int:
    return epochs * -(-NATIONS_TRAIN // batch)


def _tables(model) -> list[torch.Tensor]:
    """Every row of each representation (complex as real pairs), as PyKEEN reads them."""
    out = []
    for rep in (*model.entity_representations, *model.relation_representations):
        with torch.no_grad():
            x = rep._plain_forward(torch.arange(rep.max_id))
        out.append(torch.view_as_real(x) if x.is_complex() else x.clone())
    return out


def _run(tmp: Path, model: str, loop: str, how: str, train=TRAIN):
    if how == "sparseadam":
        reps, opt, okw = dsa.sparse_representations(), torch.optim.SparseAdam, {}
    elif how == "ram":
        reps, opt, okw = dsa.sparse_representations(), dsa.DiskAdam, {"state_dir": tmp / "opt"}
    else:
        reps, opt, okw = dsa.disk_representations(tmp / "tables", storage=how), dsa.DiskAdam, {}
    r = pipeline(dataset="Nations", model=model, random_seed=0, training_loop=loop,
                 model_kwargs=dict(embedding_dim=8, **reps), optimizer=opt,
                 optimizer_kwargs=dict(lr=1e-2, **okw), training_kwargs=train,
                 evaluation_kwargs=EVAL)
    out = (_tables(r.model), r.get_metric("mrr"), r.get_metric("hits@10"))
    dsa.close(r.model, r.training_loop.optimizer)
    return out


# the default suite: each interaction kind once (translational, complex, rotational) and LCWA
PARITY = [("TransE", "sLCWA"), ("ComplEx", "sLCWA"), ("RotatE", "sLCWA"), ("TransE", "LCWA"),
          *(pytest.param(m, lo, marks=pytest.mark.slow) for m, lo in (
              ("DistMult", "sLCWA"), ("DistMult", "LCWA"), ("ComplEx", "LCWA"),
              ("RotatE", "LCWA")))]


@pytest.mark.parametrize("model, loop", PARITY)
def test_pipeline_parity_with_sparseadam(tmp_path, model, loop):
    base = _run(tmp_path / "b", model, loop, "sparseadam")
    hows = ["ram", "inplace", "log"] if loop == "sLCWA" else ["ram", "inplace"]
    for how in hows:
        w, mrr, h10 = _run(tmp_path / how, model, loop, how)
        diff = max(float((a - b).abs().max()) for a, b in zip(w, base[0]))
        print(f"{model} {loop} {how}: max|dw| {diff:.2e}  MRR {mrr:.6f} vs {base[1]:.6f}  "
              f"Hits@10 {h10:.6f} vs {base[2]:.6f}")
        assert diff <= 1e-6, (how, diff)
        assert mrr == pytest.approx(base[1], abs=1e-6) and h10 == base[2], how


def _run_adagrad(tmp: Path, how: str, rowwise: bool = False):
    """TransE on Nations through ``pipeline()`` with Adagrad: torch's (``"torch"``), or
    DiskAdagrad with SparseEmbedding tables (``"ram"``) or DiskBackedEmbedding tables of a
    store kind (``"inplace"``, ``"log"``)."""
    kind = "rowwise_adagrad" if rowwise else "adagrad"
    if how == "torch":
        reps, opt, okw = dsa.sparse_representations(), torch.optim.Adagrad, {}
    elif how == "ram":
        reps, opt = dsa.sparse_representations(), dsa.DiskAdagrad
        okw = {"state_dir": tmp / "opt", "rowwise": rowwise}
    else:
        reps = dsa.disk_representations(tmp / "tables", storage=how, optimizer=kind)
        opt, okw = dsa.DiskAdagrad, {"rowwise": rowwise}
    r = pipeline(dataset="Nations", model="TransE", random_seed=0,
                 model_kwargs=dict(embedding_dim=8, **reps), optimizer=opt,
                 optimizer_kwargs=dict(lr=5e-2, lr_decay=1e-3, **okw), training_kwargs=TRAIN,
                 evaluation_kwargs=EVAL)
    out = (_tables(r.model), r.get_metric("mrr"), r.get_metric("hits@10"))
    dsa.close(r.model, r.training_loop.optimizer)
    if how != "torch":  # the stores hold the optimizer's state (pipeline() drops the optimizer)
        made = set()
        for m in tmp.rglob("manifest.json"):
            st = dsa_core.open(m.parent, mode="r")
            made.add(st.optimizer)
            dsa_core.close(st)
        assert made == {kind}
    return out


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch's own Adagrad
@pytest.mark.parametrize("hows", [("ram", "log"), pytest.param(("inplace",),
                                                              marks=pytest.mark.slow)])
def test_pipeline_adagrad_parity_with_torch_adagrad(tmp_path, hows):
    """DiskAdagrad through PyKEEN's pipeline (which rebuilds it before training) trains to
    torch.optim.Adagrad's weights: the accumulators are torch's bit for bit, the weights
    differ where torch's float32 sqrt is not correctly rounded (docs/algorithms.md §7.5), by
    a few ulp of the largest weight (8.9e-8 after 2 epochs, 2026-12-06)."""
    base = _run_adagrad(tmp_path / "b", "torch")
    for how in hows:
        w, mrr, h10 = _run_adagrad(tmp_path / how, how)
        diff = max(float((a - b).abs().max()) for a, b in zip(w, base[0]))
        print(f"adagrad {how}: max|dw| {diff:.2e}  MRR {mrr:.6f} vs {base[1]:.6f}")
        assert diff <= 1e-6, (how, diff)  # measured 8.9e-8 (2026-12-06)
        assert mrr == pytest.approx(base[1], abs=1e-6) and h10 == base[2], how


@pytest.mark.slow  # three pipelines (~12 s); the kernels' and stores' row-wise tests run always
def test_pipeline_rowwise_adagrad_same_on_every_table_kind(tmp_path):
    """Row-wise Adagrad (PyTorch-BigGraph's RowAdagrad) through the pipeline: the optimizer's
    own store (SparseEmbedding tables) and the tables' records (both kinds) agree."""
    runs = {how: _run_adagrad(tmp_path / how, how, rowwise=True)
            for how in ("ram", "inplace", "log")}
    for how in ("inplace", "log"):
        diff = max(float((a - b).abs().max()) for a, b in zip(runs[how][0], runs["ram"][0]))
        assert diff <= 1e-6, (how, diff)


def test_disk_adagrad_on_tables_made_for_adam_names_the_option(tmp_path):
    reps = dsa.disk_representations(tmp_path / "t")  # optimizer="adam" tables
    with pytest.raises(ValueError, match="optimizer="):
        pipeline(dataset="Nations", model="TransE", random_seed=0,
                 model_kwargs=dict(embedding_dim=8, **reps), optimizer=dsa.DiskAdagrad,
                 optimizer_kwargs=dict(lr=1e-2), training_kwargs=TRAIN,
                 evaluation_kwargs=EVAL)


def _sparse_pykeen_embedding():
    """PyKEEN's own Embedding made sparse: its constrainer rewrites the whole table."""
    from pykeen.nn.representation import Embedding

    class Whole(Embedding):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self._embeddings.sparse = True

    return Whole


def test_row_constrainer_equals_whole_table_constrainer(tmp_path):
    whole = _sparse_pykeen_embedding()
    res = []
    for reps in ({"entity_representations": whole, "relation_representations": whole},
                 dsa.disk_representations(tmp_path / "t")):
        r = pipeline(dataset="Nations", model="TransE", random_seed=0,
                     model_kwargs=dict(embedding_dim=8, **reps),
                     optimizer=torch.optim.SparseAdam if "entity_representations" in reps
                     and reps["entity_representations"] is whole else dsa.DiskAdam,
                     optimizer_kwargs=dict(lr=1e-2), training_kwargs=TRAIN,
                     evaluation_kwargs=EVAL)
        res.append(_tables(r.model))
        dsa.close(r.model, r.training_loop.optimizer)
    ent = res[1][0]
    assert torch.allclose(ent.norm(dim=-1), torch.ones(ent.shape[0]), atol=1e-6)  # constrained
    diff = max(float((a - b).abs().max()) for a, b in zip(*res))
    print(f"batch-row constrainer vs PyKEEN's whole-table one: max|dw| {diff:.2e}")
    assert diff <= 1e-6


def test_pretrained_initializer_and_chunks(tmp_path):
    from pykeen.nn.init import PretrainedInitializer

    x = torch.randn(14, 6)
    rep = dsa.DiskBackedEmbedding(max_id=14, shape=6, state_dir=tmp_path / "p", chunk_rows=4,
                                  initializer=PretrainedInitializer(x))
    rep.reset_parameters()
    assert torch.equal(rep.weight_rows(np.arange(14)), x)
    rep.close()
    # a complex table of several chunks, PyKEEN's RotatE initializer and constrainer
    rep = dsa.DiskBackedEmbedding(max_id=10, shape=3, state_dir=tmp_path / "c", chunk_rows=3,
                                  dtype=torch.cfloat, initializer="init_phases",
                                  constrainer="complex_normalize")
    rep.reset_parameters()
    rep.post_parameter_update()
    z = rep.weight_rows(np.arange(10))
    assert z.is_complex() and torch.allclose(z.abs(), torch.ones(10, 3), atol=1e-6)
    rep.close()


def test_full_table_read_over_the_limit_names_slice_size(tmp_path):
    rep = dsa.DiskBackedEmbedding(max_id=20, shape=4, state_dir=tmp_path / "e", max_full_rows=10)
    with pytest.raises(ValueError, match="slice_size"):
        rep(None)
    assert rep(torch.tensor([1, 19])).shape == (2, 4)  # indexed reads are not limited
    rep.close()
    with pytest.raises(ValueError, match="disk_representations"):
        dsa.DiskBackedEmbedding(max_id=20, shape=4)
    with pytest.raises(FileExistsError):  # an existing store is never silently reused
        dsa.DiskBackedEmbedding(max_id=20, shape=4, state_dir=tmp_path / "e")


# -- the optimizer rebuild of PyKEEN's training loop ----------------------------------------
def _loop(tmp: Path, opt, okw, reps):
    torch.manual_seed(0)
    tf = Nations().training
    model = TransE(triples_factory=tf, embedding_dim=8, random_seed=0, **reps)
    return tf, SLCWATrainingLoop(model=model, triples_factory=tf, optimizer=opt,
                                 optimizer_kwargs=dict(lr=1e-2, **okw))


def _train(loop, tf, epochs, **kw):
    torch.manual_seed(1)
    loop.train(triples_factory=tf, num_epochs=epochs, batch_size=512, use_tqdm=False,
               pin_memory=False, **kw)


@pytest.mark.parametrize("tables", ["ram", "disk"])
def test_rebuild_takes_over_never_two_writers(tmp_path, tables):
    reps = (dsa.sparse_representations() if tables == "ram"
            else dsa.disk_representations(tmp_path / "t"))
    tf, loop = _loop(tmp_path, dsa.DiskAdam, {"state_dir": tmp_path / "opt"}, reps)
    first = loop.optimizer
    _train(loop, tf, 1)
    assert loop.optimizer is not first  # PyKEEN rebuilt it ...
    with pytest.raises(RuntimeError, match="closed"):  # ... and the old one writes no more
        first.step()
    with pytest.raises(StoreLockedError):  # the new one steps the stores alone
        if tables == "ram":
            dsa.DiskAdam(torch.nn.Embedding(3, 2, sparse=True).parameters(),
                         state_dir=tmp_path / "opt")
        else:
            dsa.DiskAdam(loop.model.get_grad_params())
    counts = [st.count for st in loop.optimizer.stores.values()]
    assert len(counts) == 2 and set(counts) == {_steps(1, 512)}  # every step, none lost
    dsa.close(loop.model, loop.optimizer)


def _three_trainings(tmp: Path, how: str):
    reps = (dsa.disk_representations(tmp / "t") if how == "disk"
            else dsa.sparse_representations())
    opt, okw = ((torch.optim.SparseAdam, {}) if how == "sparseadam"
                else (dsa.DiskAdam, {"state_dir": tmp / "opt"}))
    tf, loop = _loop(tmp, opt, okw, reps)
    _train(loop, tf, 2)
    # continue_training=False: PyKEEN resets the model, rebuilds the optimizer and runs
    # epochs 3 and 4 (it counts epochs on) from the fresh weights
    _train(loop, tf, 4)
    again = _tables(loop.model)
    _train(loop, tf, 6, continue_training=True)  # no rebuild: epochs 5 and 6 go on
    out = again, _tables(loop.model), loop.optimizer
    return out


@pytest.mark.parametrize("how", [pytest.param("ram", marks=pytest.mark.slow), "disk"])
def test_second_train_starts_afresh_and_continue_goes_on_as_sparseadam(tmp_path, how):
    base = _three_trainings(tmp_path / "b", "sparseadam")
    got = _three_trainings(tmp_path / how, how)
    for a, b in ((got[0], base[0]), (got[1], base[1])):
        assert max(float((x - y).abs().max()) for x, y in zip(a, b)) <= 1e-6
    sa_steps = {int(s["step"]) for s in base[2].state.values()}
    # steps since the rebuild
    assert {st.count for st in got[2].stores.values()} == sa_steps == {_steps(4, 512)}
    got[2].close()


def test_a_rebuild_without_the_token_or_a_second_optimizer_is_refused(tmp_path):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    a = dsa.DiskAdam(emb.parameters(), lr=1e-2, state_dir=tmp_path / "o")
    kw = a.state_dict()["param_groups"][0]
    assert kw["state_dir"] == str(tmp_path / "o") and kw["dsa_lineage"]
    kw.pop("params")
    kw.pop("dsa_lineage")
    with pytest.raises(StoreLockedError):  # a plain second optimizer never takes over
        dsa.DiskAdam(params=emb.parameters(), **kw)
    a.close()
    with pytest.raises(FileExistsError):  # and never reuses stores it was not asked to
        dsa.DiskAdam(params=emb.parameters(), **kw)
    b = dsa.DiskAdam(params=emb.parameters(), resume=True, **kw)
    emb(torch.tensor([1, 1, 2])).sum().backward()
    b.step()
    # the rebuild of b (PyKEEN's idiom) flushes and closes b, then starts afresh (b stepped)
    kw = {k: v for k, v in b.state_dict()["param_groups"][0].items() if k != "params"}
    c = dsa.DiskAdam(params=emb.parameters(), **kw)
    assert b._closed and [st.count for st in c.stores.values()] == [0]
    assert "state_dir" not in c.param_groups[0]  # settings travel in state dicts only
    c.close()


# -- process ends ---------------------------------------------------------------------------
# One interpreter start serves the three tests: CHILD imports torch, PyKEEN, torch._dynamo
# (which the first optimizer imports) and the adapter, then forks one process per request
# ("run ROOT MODE" on its stdin; it answers "pid N"), before any torch computation (torch's
# thread pool does not exist yet; numba's registries are loaded by a plain kernel). The
# forked process leaves the request loop and runs the training below as a script's main code,
# its stdout and stderr in ROOT/out and ROOT/err, so it ends as a script ends: at the end of
# the code (an interpreter exit), by an uncaught KeyboardInterrupt, or killed. "wait N"
# answers "status CODE" (a Popen-style return code).
CHILD = textwrap.dedent("""
    import gc, logging, os, signal, sys, time, torch, torch._dynamo
    logging.disable(logging.WARNING)
    from pykeen.datasets import Nations
    from pykeen.models import TransE
    from pykeen.training import SLCWATrainingLoop
    from pykeen.training.callbacks import TrainingCallback
    from adapters import pykeen as dsa
    from dsa_core.tools import validation
    as_index = validation.as_index
    as_index([0], 1)  # numba's first kernel load (its registries: ~1 s) once, here; a plain
    # kernel (not parallel): no numba thread starts
    gc.collect()
    gc.freeze()  # PyKEEN's gc.collect() after each epoch then skips the imported modules
    mode = None
    while mode is None:
        req = sys.stdin.readline().split()
        if not req:  # this process opened no store; its interpreter teardown takes seconds
            os._exit(0)
        if req[0] == "wait":
            _, status = os.waitpid(int(req[1]), 0)
            print("status", os.waitstatus_to_exitcode(status), flush=True)
            continue
        pid = os.fork()
        if pid:
            print("pid", pid, flush=True)
            continue
        root, mode = req[1], req[2]
        for fd, name in ((0, os.devnull), (1, root + "/out"), (2, root + "/err")):
            os.dup2(os.open(name, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_CREAT), fd)
    tf = Nations().training
    if mode == "pending":  # built (its resets waiting for a first read), never read or closed
        model = TransE(triples_factory=tf, embedding_dim=8, random_seed=0,
                       **dsa.disk_representations(root + "/t", chunk_rows=4))
        raise SystemExit  # the interpreter exits: the tables are written then
    torch.manual_seed(0)
    # both store kinds in one run: the entity table in place, the relation table a log store
    model = TransE(triples_factory=tf, embedding_dim=8,
                   entity_representations=dsa.DiskBackedEmbedding.at(root + "/t/entities",
                                                                     storage="inplace"),
                   relation_representations=dsa.DiskBackedEmbedding.at(root + "/t/relations",
                                                                       storage="log"))
    loop = SLCWATrainingLoop(model=model, triples_factory=tf, optimizer=dsa.DiskAdam,
                             optimizer_kwargs=dict(lr=1e-2, state_dir=root + "/opt"))
    ent, rel = model.entity_representations[0], model.relation_representations[0]

    class Report(TrainingCallback):
        def post_epoch(self, epoch, epoch_loss, **kw):
            if epoch != 2:
                return
            if mode == "kill":
                self.optimizer.flush()
            print("epoch2", *(f"{r.table.store.count} "
                              f"{float(r.weight_rows(list(range(r.max_id))).double().sum())!r}"
                              for r in (ent, rel)), flush=True)
            if mode in ("kill", "int"):
                time.sleep(600)

    loop.train(triples_factory=tf, num_epochs=2 if mode == "forget" else 50, batch_size=64,
               use_tqdm=False, pin_memory=False, callbacks=Report())
    # mode "forget": no close; the interpreter exits
""")


class _Child:
    """A process forked by CHILD's interpreter (see above) to train in ``root`` in ``mode``."""

    def __init__(self, forker: subprocess.Popen, root: Path, mode: str):
        self.forker, self.root, self.returncode = forker, root, None
        self.pid = int(self._ask(f"run {root} {mode}", "pid"))

    def _ask(self, request: str, answer: str) -> str:
        self.forker.stdin.write(request + "\n")
        self.forker.stdin.flush()
        line = self.forker.stdout.readline()
        assert line.startswith(answer + " "), (line, self.forker.err.read_text())
        return line.split()[1]

    def err(self) -> str:
        return (self.root / "err").read_text()

    def reported(self) -> list[tuple[int, float]]:
        """The epoch-2 line: (count, sum of the weights) of each table."""
        deadline = time.monotonic() + 120
        while True:
            ended = self._ended()  # before the read: the text of an ended process is whole
            text = (self.root / "out").read_text()
            if "\n" in text or ended or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        line = text.partition("\n")[0]
        assert line.startswith("epoch2"), (text, self.err())
        v = line.split()[1:]
        return [(int(v[0]), float(v[1])), (int(v[2]), float(v[3]))]

    def _ended(self) -> bool:
        """Exited (a zombie until waited for) or gone."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rpartition(")")[2].split()[0] in ("Z", "X")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = int(self._ask(f"wait {self.pid}", "status"))
        return self.returncode

    def kill(self) -> None:
        """A child that outlives a failure would hold the stores (and sleep 600 s)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()


@pytest.fixture(scope="module")
def forker(tmp_path_factory):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    err = tmp_path_factory.mktemp("forker") / "err"  # a file: a full pipe would block it
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=f, text=True, env=env)
    proc.err = err
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)
    proc.stdout.close()


@pytest.fixture
def child(forker, tmp_path):
    """``child(mode)`` starts the training in ``mode``; killed at the end if still running."""
    made = []

    def start(mode: str) -> _Child:
        (tmp_path / "out").touch()
        made.append(_Child(forker, tmp_path, mode))
        return made[-1]

    yield start
    for c in made:
        c.kill()


def _check_stores(tmp: Path, reported: list[tuple[int, float]]) -> None:
    """Both tables hold what the child reported (count, sum of the weights) and reopen
    cleanly; then nothing holds a lock."""
    for name, (count, total) in zip(("entities", "relations"), reported):
        st = dsa_core.open(tmp / "t" / name)  # raises UncleanStopError if not flushed
        try:
            w = dsa_core.gather(st, np.arange(st.num_rows))
            assert st.count == count and float(w.astype(np.float64).sum()) == total, name
            if name == "entities":  # TransE: unit rows, the constraints were flushed too
                assert np.allclose(np.linalg.norm(w, axis=1), 1.0, atol=1e-6)
        finally:
            dsa_core.close(st)
        dsa.DiskBackedEmbedding(max_id=st.num_rows, shape=8, state_dir=tmp / "t" / name,
                                overwrite=True).close()


@pytest.mark.slow  # a child that imports PyKEEN (~30 s here); the exit flush itself is the
# core's, tested on both kinds in the default suite (tests/store/test_exit_flush.py)
def test_forgotten_close_flushes(tmp_path, child):
    proc = child("forget")
    reported = proc.reported()
    assert proc.wait() == 0, proc.err()
    assert [c for c, _ in reported] == [_steps(2, 64)] * 2
    _check_stores(tmp_path, reported)


def test_ctrl_c_leaves_clean_stores(tmp_path, child):
    proc = child("int")
    reported = proc.reported()
    proc.signal(signal.SIGINT)
    assert proc.wait() != 0 and "KeyboardInterrupt" in proc.err()
    _check_stores(tmp_path, reported)


def test_kill9_keeps_every_flushed_step(tmp_path, child):
    proc = child("kill")
    try:
        reported = proc.reported()
        time.sleep(0.2)
    finally:
        proc.signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    _check_stores(tmp_path, reported)


# -- PyKEEN's checkpoints -------------------------------------------------------------------
@pytest.mark.parametrize("tables", [pytest.param("ram", marks=pytest.mark.slow), "disk",
                                    "chunked"])
def test_pykeen_checkpoint_resumes_exactly(tmp_path, tables):
    """A run stopped after 1 epoch and resumed from PyKEEN's checkpoint (a new model and a new
    DiskAdam, the stores overwritten, then the checkpoint's state dicts loaded) ends where an
    uninterrupted run ends; the resumed run's other seed proves it did not start over.
    ``chunked``: tables of several chunks, whose reset waits for the first read: the load
    writes it first, so it never overwrites what the checkpoint brought back."""
    def run(sub, epochs, seed, ck):
        root = tmp_path / sub
        if tables in ("disk", "chunked"):
            opts = {"chunk_rows": 4} if tables == "chunked" else {}
            reps, okw = dsa.disk_representations(root / "t", overwrite=True, **opts), {}
        else:
            reps, okw = dsa.sparse_representations(), {"state_dir": root / "o", "overwrite": True}
        train = dict(TRAIN, num_epochs=epochs)
        if ck:
            train.update(checkpoint_name="c.pt", checkpoint_directory=tmp_path / "ck",
                         checkpoint_frequency=0)
        r = pipeline(dataset="Nations", model="TransE", random_seed=seed,
                     model_kwargs=dict(embedding_dim=8, **reps), optimizer=dsa.DiskAdam,
                     optimizer_kwargs=dict(lr=1e-2, **okw), training_kwargs=train,
                     evaluation_kwargs=EVAL)
        out = _tables(r.model)
        dsa.close(r.model, r.training_loop.optimizer)
        return out

    full = run("full", 3, 0, False)
    run("a", 1, 0, True)
    resumed = run("a", 3, 7, True)
    assert max(float((x - y).abs().max()) for x, y in zip(full, resumed)) == 0.0
    assert max(float((x - y).abs().max()) for x, y in zip(full, run("b", 3, 7, False))) > 0.1


def test_chunked_tables_train_and_evaluate_in_slices(tmp_path):
    """The paths of a table larger than its chunks and than max_full_rows, at Nations' size:
    per-chunk init and constraints, sLCWA training, evaluation in slices (an unsliced one
    would raise)."""
    r = pipeline(dataset="Nations", model="TransE", random_seed=0,
                 model_kwargs=dict(embedding_dim=8, **dsa.disk_representations(
                     tmp_path / "t", chunk_rows=4, max_full_rows=10)),
                 optimizer="DiskAdam", optimizer_kwargs=dict(lr=1e-2), training_kwargs=TRAIN,
                 evaluation_kwargs=EVAL)
    ent = r.model.entity_representations[0]
    w = ent.weight_rows(np.arange(ent.max_id))
    assert ent.table.store.count == _steps(2, 128) and torch.allclose(
        w.norm(dim=-1), torch.ones(ent.max_id), atol=1e-6)
    assert 0 < r.get_metric("mrr") <= 1
    dsa.close(r.model, r.training_loop.optimizer)


# -- the table written once: a reset waits for the first read --------------------------------
def _eagerly(f):
    """``f`` as an initializer that does not replay (a function of this module): its reset
    is written at once, as every reset was before resets waited for the first read."""
    return lambda x: f(x)


EAGER = {"TransE": dict(entity_initializer=_eagerly(xavier_uniform_),
                        relation_initializer=_eagerly(xavier_uniform_norm_)),
         "RotatE": dict(entity_initializer=_eagerly(xavier_uniform_),
                        relation_initializer=_eagerly(init_phases))}
NO_PROBE = dict(automatic_memory_optimization=False)  # no sub-batch probe (docs/pykeen.md)


class _Writes(dict):
    """Rows written to each store (by its directory's name) by ``dsa_core.write_records``
    (resets and constraints; steps write through ``dsa_core.step``) before the first step of
    a DiskAdam since :meth:`clear`."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.stepped = False
        write, step = dsa_core.write_records, dsa.DiskAdam.step

        def counted(state, idx, records):
            if not self.stepped:
                self[state.path.name] = self.get(state.path.name, 0) + len(idx)
            return write(state, idx, records)

        def first_step(opt, closure=None):
            self.stepped = True
            return step(opt, closure)

        monkeypatch.setattr(dsa_core, "write_records", counted)
        monkeypatch.setattr(dsa.DiskAdam, "step", first_step)

    def clear(self):
        super().clear()
        self.stepped = False


@pytest.mark.parametrize("model", ["TransE", "RotatE"])
def test_pipeline_writes_a_chunked_table_once_with_the_same_weights(tmp_path, monkeypatch,
                                                                    model):
    """pipeline() resets the model when it builds it and again when it trains; tables of
    several chunks are written once, at the first read (TransE's entity table constrained in
    the same pass), and end with the weights, MRR and Hits@10 of the same run whose resets
    are written at once (initializers that do not replay; before, every initializer's
    were): two writes of each table (two resets), four of a constrained one (TransE's entity
    and RotatE's relation table: a constraint after each reset)."""
    rows = _Writes(monkeypatch)
    out = {}
    for how in ("deferred", "eager"):
        rows.clear()
        r = pipeline(dataset="Nations", model=model, random_seed=0,
                     model_kwargs=dict(embedding_dim=8, **(EAGER[model] if how == "eager"
                                                           else {}),
                                       **dsa.disk_representations(tmp_path / how,
                                                                  chunk_rows=4)),
                     optimizer=dsa.DiskAdam, optimizer_kwargs=dict(lr=1e-2),
                     training_kwargs=dict(TRAIN, num_epochs=1),
                     training_loop_kwargs=NO_PROBE, evaluation_kwargs=EVAL)
        out[how] = dict(rows), _tables(r.model), r.get_metric("mrr"), r.get_metric("hits@10")
        dsa.close(r.model, r.training_loop.optimizer)
    n_ent, n_rel = Nations().num_entities, Nations().num_relations
    assert out["deferred"][0] == {"entities": n_ent, "relations": n_rel}
    assert out["eager"][0] == {"entities": (4 if model == "TransE" else 2) * n_ent,
                               "relations": (2 if model == "TransE" else 4) * n_rel}
    assert all(torch.equal(a, b) for a, b in zip(out["deferred"][1], out["eager"][1]))
    assert out["deferred"][2:] == out["eager"][2:]


def _reps(model) -> tuple:
    return (*model.entity_representations, *model.relation_representations)


def _transe(root: Path, eager: bool = False):
    kw = EAGER["TransE"] if eager else {}
    return TransE(triples_factory=Nations().training, embedding_dim=8, random_seed=0, **kw,
                  **dsa.disk_representations(root, chunk_rows=4))


def _on_disk(rep) -> torch.Tensor:
    """The rows in the store, read past the representation (which would write them)."""
    st = rep.table._handle.state
    return torch.from_numpy(dsa_core.gather(st, np.arange(st.num_rows)))


def _first_rows(tmp: Path) -> list[torch.Tensor]:
    """The rows each table of ``_transe`` starts from, written at once."""
    model = _transe(tmp / "eager", eager=True)
    out = [_on_disk(rep) for rep in _reps(model)]
    dsa.close(model)
    return out


def _stores(root: Path, names=("entities", "relations")) -> list[torch.Tensor]:
    out = []
    for name in names:
        st = dsa_core.open(root / name, mode="r")
        try:
            out.append(torch.from_numpy(dsa_core.gather(st, np.arange(st.num_rows))))
        finally:
            dsa_core.close(st)
    return out


def _read(model, how: str, tmp: Path) -> list[torch.Tensor]:
    """Read, save or close ``model`` (its resets pending) in the way ``how``; returns each
    table's rows as that way gives them."""
    reps = _reps(model)
    if how == "forward":
        return [rep(torch.arange(rep.max_id)).detach() for rep in reps]
    if how == "weight_rows":
        return [rep.weight_rows(np.arange(rep.max_id)) for rep in reps]
    if how == "weight":  # a value read of the stand-in weight (a copy of the table)
        return [rep.table.weight.detach().clone() for rep in reps]
    if how == "weight.data":
        return [rep.table.weight.data * 1 for rep in reps]
    if how == "to_tensor":
        return [rep.table.to_tensor() for rep in reps]
    if how == "export":
        return [torch.from_numpy(np.load(rep.table.export(tmp / f"{i}.npy")))
                for i, rep in enumerate(reps)]
    if how == "state_dict":  # small tables: their rows are in the state dict
        sd = model.state_dict()
        return [sd[k] for k in ("entity_representations.0.table.weight",
                                "relation_representations.0.table.weight")]
    if how == "checkpoint":
        for i, rep in enumerate(reps):
            rep.table.checkpoint(tmp / "ck" / ("entities", "relations")[i])
        return _stores(tmp / "ck")
    if how == "optimizer checkpoint":
        opt = dsa.DiskAdam(model.get_grad_params(), lr=1e-2)
        opt.checkpoint(tmp / "ock")
        opt.close()
        return _stores(tmp / "ock", ("group0_param0", "group0_param1"))  # by position
    if how == "flush":
        for rep in reps:
            rep.flush()
        return [_on_disk(rep) for rep in reps]
    if how == "close":
        dsa.close(model)
        return _stores(tmp / "t")
    raise AssertionError(how)


WAYS = ["forward", "weight_rows", "weight", "weight.data", "to_tensor", "export",
        "state_dict", "checkpoint", "optimizer checkpoint", "flush", "close"]


@pytest.mark.parametrize("how", WAYS)
def test_a_pending_reset_is_written_before_anything_reads_or_keeps_the_rows(tmp_path, how):
    """A built model's tables (several chunks each) hold zeros until their first read; every
    way to read, save or close them writes them first, with the rows a reset written at once
    gives (TransE's entity table constrained)."""
    first = _first_rows(tmp_path)
    model = _transe(tmp_path / "t")
    assert all(not _on_disk(rep).any() for rep in _reps(model))
    got = _read(model, how, tmp_path)
    for a, b in zip(got, first):
        assert torch.equal(a.reshape(b.shape), b), how
    if how != "close":  # written to the store, not only handed out
        assert all(torch.equal(_on_disk(rep), b) for rep, b in zip(_reps(model), first))
    assert torch.allclose(first[0].norm(dim=-1), torch.ones(first[0].shape[0]))
    dsa.close(model)


@pytest.mark.parametrize("how", ["model.load_state_dict", "table.load_checkpoint",
                                 "optimizer.load_checkpoint", "optimizer.load_state_dict"])
def test_a_load_is_never_undone_by_a_pending_reset(tmp_path, how):
    """Rows loaded into tables whose reset is pending stay: the reset is written before the
    load, not over it at the next read."""
    a = _transe(tmp_path / "a")
    want = [rep.weight_rows(np.arange(rep.max_id)) for rep in _reps(a)]
    torch.manual_seed(1)
    b = TransE(triples_factory=Nations().training, embedding_dim=8,  # other first rows
               **dsa.disk_representations(tmp_path / "b", chunk_rows=4))
    if how == "model.load_state_dict":
        b.load_state_dict(a.state_dict())
    elif how == "table.load_checkpoint":
        for i, (x, y) in enumerate(zip(_reps(a), _reps(b))):
            y.table.load_checkpoint(x.table.checkpoint(tmp_path / f"ck{i}"))
    else:
        opt_a = dsa.DiskAdam(a.get_grad_params(), lr=1e-2)
        opt_b = dsa.DiskAdam(b.get_grad_params(), lr=1e-2)
        if how == "optimizer.load_checkpoint":
            opt_b.load_checkpoint(opt_a.checkpoint(tmp_path / "ock"))
        else:  # a state dict of a stepped optimizer names snapshots of its stores
            a.score_hrt(torch.tensor([[0, 0, 1]])).sum().backward()
            opt_a.step()
            want = [rep.weight_rows(np.arange(rep.max_id)) for rep in _reps(a)]
            opt_b.load_state_dict(opt_a.state_dict())
        opt_a.close()
        opt_b.close()
    got = [rep(torch.arange(rep.max_id)).detach() for rep in _reps(b)]
    assert all(torch.equal(x.reshape(y.shape), y) for x, y in zip(got, want))
    dsa.close(a)
    dsa.close(b)


def test_a_pending_reset_is_written_at_garbage_collection(tmp_path):
    first = _first_rows(tmp_path)
    _transe(tmp_path / "t")  # dropped at once
    gc.collect()
    assert all(torch.equal(a, b) for a, b in zip(_stores(tmp_path / "t"), first))


def test_a_pending_reset_is_written_at_exit(tmp_path, child):
    """A model whose tables (several chunks) were never read nor closed: the interpreter's
    exit writes them, with the rows a reset written at once gives."""
    first = _first_rows(tmp_path)
    proc = child("pending")
    assert proc.wait() == 0, proc.err()
    assert all(torch.equal(a, b) for a, b in zip(_stores(tmp_path / "t"), first))


def test_replaying_initializers():
    """The initializers whose reset waits for the first read: PyKEEN's and torch's (also
    bound to keywords, and PyKEEN's compositions), and pretrained tensors; anything else,
    or a generator of its own, is written at once."""
    import functools

    from pykeen.nn.init import PretrainedInitializer, xavier_normal_norm_

    from adapters._pykeen_repr import replays

    assert replays(xavier_uniform_) and replays(torch.nn.init.normal_)
    assert replays(xavier_normal_norm_) and replays(init_phases)
    assert replays(functools.partial(torch.nn.init.normal_, std=0.1))
    assert replays(PretrainedInitializer(torch.zeros(3, 2)))
    assert not replays(functools.partial(torch.nn.init.normal_, generator=torch.Generator()))
    assert not replays(_eagerly(xavier_uniform_)) and not replays(None)


# -- refusals: what came, what must hold, the fix -------------------------------------------
def test_dense_gradient_of_a_plain_model_names_the_sparse_tables(tmp_path):
    """A PyKEEN model with its default (dense-gradient) Embedding tables: DiskAdam's message
    names sparse_representations / disk_representations, not SparseAdam's "consider Adam"."""
    tf = Nations().training
    model = TransE(triples_factory=tf, embedding_dim=4, random_seed=0)
    opt = dsa.DiskAdam(model.get_grad_params(), lr=1e-2, state_dir=tmp_path / "o")
    model.score_hrt(tf.mapped_triples[:8]).sum().backward()
    with pytest.raises(RuntimeError, match=r"dense.*sparse_representations\(\).*"
                                           r"disk_representations\(root\)") as exc:
        opt.step()
    assert "consider Adam" not in str(exc.value)
    assert {st.count for st in opt.stores.values()} == {0}  # nothing was written
    opt.close()


@pytest.mark.parametrize(("make", "state", "disk_args"), [
    (lambda p, d: dsa.DiskAdam(p, state_dir=d), "m and v", "root"),
    (lambda p, d: dsa.DiskAdagrad(p, state_dir=d), "the Adagrad accumulators",
     "root, optimizer='adagrad'"),
    (lambda p, d: dsa.DiskAdagrad(p, state_dir=d, rowwise=True),
     "the row-wise Adagrad accumulators", "root, optimizer='rowwise_adagrad'"),
], ids=["adam", "adagrad", "rowwise_adagrad"])
def test_dense_gradient_message_names_the_optimizers_state(tmp_path, make, state, disk_args):
    """The dense-gradient message says what sparse_representations() keeps in state_dir for
    this optimizer (Adam's m and v, Adagrad's accumulators: it named m and v for both) and
    the disk tables it needs (an Adagrad one is made with optimizer=)."""
    emb = torch.nn.Embedding(5, 3)
    opt = make(emb.parameters(), tmp_path / "o")
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError) as exc:
        opt.step()
    assert f"(weights in RAM, {state} in state_dir)" in str(exc.value)
    assert f"disk_representations({disk_args})) (weights on disk too)" in str(exc.value)
    opt.close()


@pytest.mark.parametrize("kw, name", [(dict(lr="0.01"), "lr"), (dict(eps="1e-8"), "eps"),
                                      (dict(betas=("0.9", 0.999)), r"betas\[0\]")])
def test_a_string_hyperparameter_is_named(tmp_path, kw, name):
    emb = torch.nn.Embedding(5, 3, sparse=True)
    with pytest.raises(TypeError, match=rf"^{name} must be a number .*got the str '.*'.*"
                                        r"float\(\)"):
        dsa.DiskAdam(emb.parameters(), state_dir=tmp_path / "o", **kw)
    assert not (tmp_path / "o").exists()  # refused before anything was created


@pytest.mark.parametrize("make", [
    lambda root: dsa.disk_representations(root, memroy="64MiB"),
    lambda root: dsa.DiskBackedEmbedding.at(root, chunkrows=4)])
def test_an_unknown_table_option_is_refused_with_the_known_ones(tmp_path, make):
    with pytest.raises(TypeError, match=r"unknown option.*did you mean '(memory|chunk_rows)'"
                                        r".*storage, memory, access, max_full_rows"):
        make(tmp_path / "t")


@pytest.mark.parametrize("make", [
    lambda root: dsa.disk_representations(root, resume=True),
    lambda root: dsa.DiskBackedEmbedding(max_id=4, shape=2, state_dir=root, resume=True)])
def test_resume_is_refused_with_what_works(tmp_path, make):
    with pytest.raises(ValueError, match=r"resume=True is not supported: PyKEEN re-initial"
                                         r".*checkpoint_name.*overwrite=True"):
        make(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_a_rerun_on_an_existing_store_says_what_works(tmp_path):
    dsa.DiskBackedEmbedding(max_id=4, shape=2, state_dir=tmp_path / "e").close()
    with pytest.raises(FileExistsError, match=r"already holds the store of an earlier run "
                                              r"\(a 4 x 2 float32 table.*overwrite=True") as e:
        dsa.DiskBackedEmbedding.at(tmp_path / "e")(max_id=4, shape=2)
    assert "resume" not in str(e.value).replace("resumed store", "")
