"""The Adagrad kernels (docs/algorithms.md §7.5) against their oracles and their anchors.

Three links, each tested on its own:

* the NumPy oracles (``_reference.adagrad_step``, ``rowwise_adagrad_step``) against the anchors,
  ``torch.optim.Adagrad`` on ``nn.Embedding(sparse=True)`` gradients and a torch transcription
  of PyTorch-BigGraph's ``RowAdagrad``, **bit for bit** when the oracle is handed torch's own
  square root (and, row-wise, torch's row mean): this pins the order of operations and every
  rounding, the fused multiply-add of torch's sparse add included;
* the Numba kernels against the oracles, **bit for bit** (correctly rounded sqrt in both);
* the kernels against the anchors directly: the accumulators equal (elementwise: bit for bit,
  they do not depend on the square root), the weights within the spread of torch's square root,
  which is not correctly rounded on CPU (MKL's vector sqrt: ~17% of float32 and ~1.3% of
  float64 values one ulp off, measured on this machine), and the measured spread is asserted.

And the mutations that the comparisons must catch (eps inside the sqrt, an unfused final add,
PBG's ``(-clr*g)/std`` regrouped) are shown to be caught.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import num_threads
from kernel_oracle import batch_stream

from dsa_core import _kernels_adagrad as K
from dsa_core import _pool
from dsa_core import _reference as R
from dsa_core._intrinsics import NO_OPTIONS, WD_DECOUPLED, WD_L2, WD_NONE

N = 40
DTYPES = {"f32": np.float32, "f64": np.float64}
KINDS = ("elementwise", "rowwise", "rowwise_l2")
CONFIGS = {  # the kernels' hyperparameters (adagrad_hparams keywords, t aside)
    "default": {"lr": 0.01},
    "decay-iav": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.05},
    "max-eps": {"lr": 0.5, "eps": 1e-3, "maximize": True, "initial_accumulator_value": 0.1},
}
WD = 0.05  # the L2 coefficient of the "rowwise_l2" kind
PAD = 2  # slots after the state in each test record, filled with CANARY: never written
CANARY = 7.0


# -- the kernels on test records -------------------------------------------------------------------
def kernel_of(kind):
    if kind == "elementwise":
        return K.adagrad_rows
    return K.rowwise_adagrad_options_kernel(WD_L2 if kind == "rowwise_l2" else WD_NONE)


def acc_width(kind, dim):
    return dim if kind == "elementwise" else 1


def hyper(kind, cfg):
    kw = dict(CONFIGS[cfg])
    if kind == "rowwise_l2":
        kw["weight_decay"] = WD
    return kw


class Records:
    """Test records ``[ w (dim) | acc (dim or 1) | pad ]`` (``weights=True``) or ``[ acc | pad
    ]`` with the weights in a separate table ``W`` (``weights=False``), as the stores lay them
    out; the accumulators start zero-filled (``fl(iav)`` lazily)."""

    def __init__(self, kind, init, *, weights=True):
        n, d = init.shape
        a = acc_width(kind, d)
        self.kind, self.d, self.a = kind, d, a
        self.woff = 0
        self.aoff = d if weights else 0
        self.data = np.full((n, self.aoff + a + PAD), CANARY, init.dtype)
        self.data[:, self.aoff:self.aoff + a] = 0
        if weights:
            self.data[:, :d] = init
            self.W = self.data
        else:
            self.W = init.copy()

    @property
    def P(self):
        return self.W[:, self.woff:self.woff + self.d]

    @property
    def S(self):
        return self.data[:, self.aoff:self.aoff + self.a]

    def step(self, idx, G, t, *, chunked=False, skip=False, **kw):
        if len(idx) == 0:
            return
        uidx, Gc = R.coalesce_ref(idx, G)  # the glue's front end: unique sorted rows
        hp = K.adagrad_hparams(self.data.dtype, t=t, **kw)
        args = (self.W, uidx, self.woff, self.data, uidx, self.aoff, Gc, hp, skip, NO_OPTIONS)
        kernel = kernel_of(self.kind)
        if chunked:  # 2 threads, chunks of 1 row and up: 16 chunks for the pool to share
            with num_threads(2):
                _pool.run_chunked(kernel, args, uidx.shape[0], min_chunk=1)
        else:
            kernel(*args, 0, uidx.shape[0])

    def canaries_intact(self):
        return (self.data[:, self.aoff + self.a:] == CANARY).all()


def oracle_step(kind, P, S, idx, G, t, **kw):
    with np.errstate(all="ignore"):  # NaN/Inf cases are intended
        if kind == "elementwise":
            R.adagrad_step(P, S, idx, G, t, **kw)
        else:
            R.rowwise_adagrad_step(P, S, idx, G, t, **kw)


def init_weights(rng, n, dim, dtype):
    return (0.1 * rng.standard_normal((n, dim))).astype(dtype)


# -- torch: the anchors ----------------------------------------------------------------------------
def torch_sqrt(a):
    """torch's square root of a T array (what the anchors use; not correctly rounded)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).sqrt().numpy()


def torch_row_mean(g):
    """PBG's ``(g * g).mean(1)`` in torch, as an ``(rows, 1)`` T array."""
    import torch

    x = torch.from_numpy(np.ascontiguousarray(g))
    return (x * x).mean(1).numpy()[:, None]


def torch_adagrad_run(init, batches, **kw):
    """``torch.optim.Adagrad`` on an ``nn.Embedding(sparse=True)``: after each step yields
    ``(weights, sums, indices, values)``, the last two torch's coalesced gradient (what the
    torch adapter hands dsa_core, so that both see the same sums of duplicates)."""
    torch = pytest.importorskip("torch")
    n, d = init.shape
    emb = torch.nn.Embedding(n, d, sparse=True, dtype=torch.from_numpy(init).dtype)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    opt = torch.optim.Adagrad(emb.parameters(), **kw)
    for idx, G in batches:
        opt.zero_grad()
        emb(torch.from_numpy(idx)).backward(torch.from_numpy(G))
        g = emb.weight.grad.coalesce()
        with torch.sparse.check_sparse_tensor_invariants():  # Adagrad builds sparse tensors
            opt.step()
        yield (emb.weight.detach().numpy(), opt.state[emb.weight]["sum"].numpy(),
               g.indices()[0].numpy().copy(), g.values().numpy().copy())


class PBGRowAdagrad:
    """PyTorch-BigGraph's ``RowAdagrad.step``, sparse branch, transcribed in torch
    (``torchbiggraph/row_adagrad.py`` as of be2e21a, unchanged at the 2024 head): one float
    of state per row, ``sum[r] += (g*g).mean(1)``, ``std = sqrt(sum[r]) + eps``, ``p[r] +=
    -clr * g / std``. Plus what this library adds around it: ``lr_decay`` as PBG had it
    before 4c6557c (torch's ``clr``), ``eps`` (PBG: 1e-10) and ``maximize`` (torch's: g
    negated first)."""

    def __init__(self, weight, *, lr, lr_decay=0.0, eps=1e-10, maximize=False):
        self.p, self.lr, self.lr_decay, self.eps = weight, lr, lr_decay, eps
        self.maximize = maximize
        self.sum = weight.new_zeros((weight.shape[0],))
        self.t = 0

    def step(self, grad_indices, grad_values):
        """One step on a coalesced gradient (its row ids and rows)."""
        self.t += 1
        if grad_indices.numel() == 0:
            return
        if self.maximize:
            grad_values = -grad_values
        clr = self.lr / (1 + (self.t - 1) * self.lr_decay)
        local_G = self.sum[grad_indices]  # _sparse_mask
        delta_G = (grad_values * grad_values).mean(1)
        self.sum.index_add_(0, grad_indices, delta_G)
        local_G += delta_G
        std_values = local_G.sqrt_().add_(self.eps).unsqueeze(1)
        self.p.index_add_(0, grad_indices, -clr * grad_values / std_values)


def pbg_run(init, batches, **kw):
    """:class:`PBGRowAdagrad` on torch-coalesced batches; yields ``(weights, sums (n, 1),
    indices, values)`` after each step."""
    torch = pytest.importorskip("torch")
    p = torch.from_numpy(init.copy())
    opt = PBGRowAdagrad(p, **kw)
    for idx, G in batches:
        g = torch.sparse_coo_tensor(torch.from_numpy(idx)[None], torch.from_numpy(G),
                                    (init.shape[0], init.shape[1]),
                                    check_invariants=True).coalesce()
        opt.step(g.indices()[0], g.values())
        yield (p.numpy(), opt.sum.numpy()[:, None], g.indices()[0].numpy().copy(),
               g.values().numpy().copy())


def torch_kw(cfg):
    """The torch keywords of a config (torch's names are the kernels')."""
    return dict(CONFIGS[cfg])


def pbg_kw(cfg):
    """A config for :class:`PBGRowAdagrad` (no initial accumulator: PBG's starts at 0)."""
    return {k: v for k, v in CONFIGS[cfg].items() if k != "initial_accumulator_value"}


def ulps(a, b):
    """The largest distance in units in the last place between two arrays of one dtype."""
    i = np.int32 if a.dtype == np.float32 else np.int64
    return int(np.abs(a.view(i).astype(np.int64) - b.view(i).astype(np.int64)).max())


# -- the oracles are the anchors, given the anchors' sqrt ------------------------------------------
# dim 37 (odd, one past a SIMD width) by default; 1, 5 and 16 with -m slow
_ORACLE_DIMS = [37, pytest.param(5, marks=pytest.mark.slow),
                pytest.param(1, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)]


@pytest.mark.torch
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dim", _ORACLE_DIMS)
@pytest.mark.parametrize("dt", DTYPES)
def test_adagrad_oracle_is_torch_bit_for_bit(dt, dim, cfg):
    """The oracle with torch's sqrt is torch.optim.Adagrad bit for bit, over 8 steps with
    duplicates (up to 5 copies of one row), an empty batch (the step count still moves: clr
    with lr_decay), lr_decay, initial_accumulator_value and maximize."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([dim, len(cfg), len(dt)])
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype)
    P, S = init.copy(), np.zeros_like(init)  # zero-filled: fl(iav) lazily
    for t, (W, Sum, ui, gv) in enumerate(torch_adagrad_run(init, batches, **torch_kw(cfg)), 1):
        R.adagrad_step(P, S, ui, gv, t, sqrt=torch_sqrt, **CONFIGS[cfg])
        touched = S != 0
        np.testing.assert_array_equal(S[touched], Sum[touched], err_msg=f"t={t}")
        iav = dtype(CONFIGS[cfg].get("initial_accumulator_value", 0.0))
        assert (Sum[~touched] == iav).all()  # untouched: torch's full_like(p, iav)
        np.testing.assert_array_equal(P, W, err_msg=f"t={t}")


@pytest.mark.torch
@pytest.mark.parametrize("dt", DTYPES)
def test_torch_order_mutations_are_caught(dt):
    """The parity above is sharp: one reordering or one more rounding breaks it. Wrong
    variants, each with torch's sqrt: the final add unfused (``p + fl(-clr)*(g/std)``, two
    roundings), eps inside the square root, and ``clr`` applied before the division."""
    dtype = DTYPES[dt]
    T = dtype
    rng = np.random.default_rng(5)
    dim, kw = 16, CONFIGS["decay-iav"]
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype)
    eps = 1e-3  # large enough that its placement shows

    def unfused(P, s2, ui, g, clr):
        P[ui] = P[ui] + T(-clr) * (g / (torch_sqrt(s2) + T(eps)))

    def eps_inside(P, s2, ui, g, clr):
        P[ui] = R.fma(T(-clr), g / torch_sqrt(s2 + T(eps)), P[ui])

    def clr_first(P, s2, ui, g, clr):
        P[ui] = P[ui] + (T(-clr) * g) / (torch_sqrt(s2) + T(eps))

    variants = {"unfused": unfused, "eps_inside": eps_inside, "clr_first": clr_first}
    states = {k: (init.copy(), np.full_like(init, T(kw["initial_accumulator_value"])))
              for k in variants}
    P_ok, S_ok = init.copy(), np.zeros_like(init)
    for t, (W, _, ui, gv) in enumerate(torch_adagrad_run(init, batches, eps=eps, **kw), 1):
        R.adagrad_step(P_ok, S_ok, ui, gv, t, sqrt=torch_sqrt, eps=eps, **kw)
        clr = kw["lr"] / (1 + (t - 1) * kw["lr_decay"])
        for name, update in variants.items():
            P, S = states[name]
            if ui.size:
                S[ui] = S[ui] + gv * gv
                update(P, S[ui], ui, gv, clr)
    np.testing.assert_array_equal(P_ok, W)
    for name, (P, _) in states.items():
        assert not np.array_equal(P, W), f"{name} was not caught"


@pytest.mark.torch
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dim", _ORACLE_DIMS)
@pytest.mark.parametrize("dt", DTYPES)
def test_rowwise_oracle_is_pbg_bit_for_bit(dt, dim, cfg):
    """The row-wise oracle with torch's sqrt and row mean is PBG's RowAdagrad bit for bit."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([dim, len(cfg), len(dt), 1])
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype)
    kw = pbg_kw(cfg)
    P, S = init.copy(), np.zeros((N, 1), dtype)
    for t, (W, Sum, ui, gv) in enumerate(pbg_run(init, batches, **kw), 1):
        R.rowwise_adagrad_step(P, S, ui, gv, t, sqrt=torch_sqrt, row_mean=torch_row_mean, **kw)
        np.testing.assert_array_equal(S, Sum, err_msg=f"t={t}")
        np.testing.assert_array_equal(P, W, err_msg=f"t={t}")


@pytest.mark.torch
@pytest.mark.parametrize("dt", DTYPES)
def test_pbg_order_mutations_are_caught(dt):
    """PBG's ``(-clr*g)/std`` regrouped as ``-clr*(g/std)``, or eps inside the square root:
    both break the bit-for-bit parity."""
    dtype = DTYPES[dt]
    T = dtype
    rng = np.random.default_rng(6)
    dim, eps = 16, 1e-3
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype)
    regrouped, inside = (init.copy(), np.zeros((N, 1), dtype)), (init.copy(),
                                                                  np.zeros((N, 1), dtype))
    for t, (W, _, ui, gv) in enumerate(pbg_run(init, batches, lr=0.1, eps=eps), 1):
        if not ui.size:
            continue
        for P, S in (regrouped, inside):
            S[ui] = S[ui] + torch_row_mean(gv)
        P, S = regrouped
        P[ui] = P[ui] + T(-0.1) * (gv / (torch_sqrt(S[ui]) + T(eps)))
        P, S = inside
        P[ui] = P[ui] + (T(-0.1) * gv) / torch_sqrt(S[ui] + T(eps))
    assert not np.array_equal(regrouped[0], W)
    assert not np.array_equal(inside[0], W)


# -- the kernels are the oracles -------------------------------------------------------------------
# the default run: one record layout (a separate table, 16 chunks) at dim 37 (odd, past a
# SIMD width); test_separate_weights_and_chunks_give_the_same_bytes pins the other layouts
# to these bytes. ``-m slow`` runs every combination.
_LAYOUTS = [pytest.param(True, False, id="weights-one-call", marks=pytest.mark.slow),
            pytest.param(False, True, id="no-weights-chunked"),
            pytest.param(True, True, id="weights-chunked", marks=pytest.mark.slow),
            pytest.param(False, False, id="no-weights-one-call", marks=pytest.mark.slow)]


@pytest.mark.parametrize(("weights", "chunked"), _LAYOUTS)
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dim", [37, pytest.param(1, marks=pytest.mark.slow),
                                 pytest.param(3, marks=pytest.mark.slow),
                                 pytest.param(16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_oracle(kind, dt, dim, cfg, weights, chunked):
    """Bit for bit over a mixed stream (duplicates, sorted, empty, one id 5 times, single
    rows; gradients from 1e-3 to 10), weights in the record or in a separate table, in one
    call or in 16 chunks on 2 threads. Rows outside a batch stay untouched, and the kernel
    writes nothing past the state."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([dim, len(cfg), len(dt), len(kind)])
    init = init_weights(rng, N, dim, dtype)
    rec = Records(kind, init, weights=weights)
    P, S = init.copy(), np.zeros((N, acc_width(kind, dim)), dtype)
    kw = hyper(kind, cfg)
    for t, (idx, G) in enumerate(batch_stream(rng, N, dim, dtype, steps=10), 1):
        before = rec.data.copy(), rec.W.copy()
        rec.step(idx, G, t, chunked=chunked, **kw)
        oracle_step(kind, P, S, idx, G, t, **kw)
        np.testing.assert_array_equal(rec.S, S, err_msg=f"t={t} S")
        np.testing.assert_array_equal(rec.P, P, err_msg=f"t={t} P")
        out = np.ones(N, bool)
        out[idx] = False
        np.testing.assert_array_equal(rec.data[out].view(np.uint8), before[0][out].view(np.uint8))
        np.testing.assert_array_equal(rec.W[out].view(np.uint8), before[1][out].view(np.uint8))
        assert rec.canaries_intact()


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_separate_weights_and_chunks_give_the_same_bytes(kind, dt):
    """``weights=False`` (the weights in the caller's table) and any chunking give the same
    bits as weights in the record and one call: each row is one thread's, start to end."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([len(kind), len(dt), 9])
    n, dim = 600, 16
    init = init_weights(rng, n, dim, dtype)
    batches = [(rng.integers(0, n, 512), rng.standard_normal((512, dim)).astype(dtype))
               for _ in range(5)]
    runs = []
    for weights, chunked in ((True, False), (False, False), (True, True), (False, True)):
        rec = Records(kind, init, weights=weights)
        for t, (idx, G) in enumerate(batches, 1):
            rec.step(idx, G, t, chunked=chunked, **hyper(kind, "decay-iav"))
        runs.append((rec.P.tobytes(), rec.S.tobytes()))
    assert all(r == runs[0] for r in runs[1:])


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_zero_filled_accumulator_is_the_initial_value(kind, dt):
    """A zero-filled accumulator and one filled with ``fl(iav)`` (torch's ``full_like``) give
    the same bits, step after step; and iav matters (0 gives other weights)."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(11)
    init = init_weights(rng, N, 8, dtype)
    batches = batch_stream(rng, N, 8, dtype)
    kw = hyper(kind, "decay-iav")
    lazy, full, none = (Records(kind, init) for _ in range(3))
    full.S[...] = dtype(kw["initial_accumulator_value"])
    for t, (idx, G) in enumerate(batches, 1):
        lazy.step(idx, G, t, **kw)
        full.step(idx, G, t, **kw)
        none.step(idx, G, t, **{**kw, "initial_accumulator_value": 0.0})
    touched = lazy.S != 0
    np.testing.assert_array_equal(lazy.S[touched], full.S[touched])
    assert (full.S[~touched] == dtype(kw["initial_accumulator_value"])).all()
    np.testing.assert_array_equal(lazy.P, full.P)
    assert not np.array_equal(lazy.P, none.P)


def _nonfinite_batch(rng, dim, dtype):
    idx = np.array([3, 8, 12, 20, 3, 25], np.int64)
    G = rng.standard_normal((6, dim)).astype(dtype)
    G[1, 0] = np.nan  # row 8
    G[2, -1] = np.inf  # row 12
    G[3, dim // 2] = -np.inf  # row 20
    return idx, G, [8, 12, 20]


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_rows(kind, dt):
    """``skip_nonfinite``: a row whose gradient holds NaN or Inf keeps its record and weights
    bit for bit, the others update as the oracle on the batch without it. Without it the
    values spread (elementwise: per coordinate, as torch; row-wise: through the row mean)
    exactly as the oracle spreads them."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(13)
    dim = 6
    init = init_weights(rng, N, dim, dtype)
    idx, G, bad = _nonfinite_batch(rng, dim, dtype)
    kw = hyper(kind, "decay-iav")
    warm = batch_stream(rng, N, dim, dtype, steps=2)
    skip, spread = Records(kind, init), Records(kind, init)
    P, S = init.copy(), np.zeros((N, acc_width(kind, dim)), dtype)
    P2, S2 = init.copy(), S.copy()
    for t, (i, g) in enumerate(warm, 1):
        for rec in (skip, spread):
            rec.step(i, g, t, **kw)
        oracle_step(kind, P, S, i, g, t, **kw)
        oracle_step(kind, P2, S2, i, g, t, **kw)
    before = skip.data[bad].copy(), skip.W[bad].copy()
    skip.step(idx, G, 3, skip=True, **kw)
    spread.step(idx, G, 3, **kw)
    good = ~np.isin(idx, bad)
    oracle_step(kind, P, S, idx[good], G[good], 3, **kw)
    oracle_step(kind, P2, S2, idx, G, 3, **kw)
    np.testing.assert_array_equal(skip.data[bad].view(np.uint8), before[0].view(np.uint8))
    np.testing.assert_array_equal(skip.W[bad].view(np.uint8), before[1].view(np.uint8))
    np.testing.assert_array_equal(skip.P, P)
    np.testing.assert_array_equal(skip.S, S)
    np.testing.assert_array_equal(spread.P, P2)  # NaN where the oracle has NaN, else equal
    np.testing.assert_array_equal(spread.S, S2)
    assert not np.isfinite(spread.P[bad]).all()


@pytest.mark.parametrize("dt", DTYPES)
def test_oracle_mutation_is_caught(dt):
    """The kernel/oracle comparison is sharp too: an oracle whose last add is unfused (two
    roundings) differs from the kernel."""
    dtype = DTYPES[dt]
    T = dtype
    rng = np.random.default_rng(17)
    init = init_weights(rng, N, 16, dtype)
    rec = Records("elementwise", init)
    P, S = init.copy(), np.zeros_like(init)
    for t, (idx, G) in enumerate(batch_stream(rng, N, 16, dtype), 1):
        rec.step(idx, G, t, lr=0.1)
        if len(idx):
            ui, g = R.coalesce_ref(idx, G)
            S[ui] = S[ui] + g * g
            P[ui] = P[ui] + T(-0.1) * (g / (np.sqrt(S[ui]) + T(1e-10)))
    np.testing.assert_array_equal(rec.S, S)
    assert not np.array_equal(rec.P, P)


# -- the kernels against the anchors directly ------------------------------------------------------
@pytest.mark.torch
@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dt", DTYPES)
def test_adagrad_kernel_vs_torch(dt, cfg):
    """The kernel against torch.optim.Adagrad over 30 steps: the accumulators bit for bit (no
    sqrt in them), the weights within the spread of torch's square root, at most 3 ulp of the
    largest weight (measured over 6 seeds, d = 16 and 37: at most 0.92 ulp, i.e. 2.4e-7 in
    float32 with weights up to 2.2 and lr 0.5, 4.4e-16 in float64)."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([len(cfg), len(dt), 3])
    dim, steps = 16, 30
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype, steps=steps)
    rec = Records("elementwise", init)
    for t, (W, Sum, ui, gv) in enumerate(torch_adagrad_run(init, batches, **torch_kw(cfg)), 1):
        rec.step(ui, gv, t, **CONFIGS[cfg])
        touched = rec.S != 0
        np.testing.assert_array_equal(rec.S[touched], Sum[touched], err_msg=f"t={t}")
    diff = np.abs(rec.P.astype(np.float64) - W).max()
    assert diff <= 3 * np.finfo(dtype).eps * np.abs(W).max(), diff
    if dtype == np.float64:
        np.testing.assert_allclose(rec.P, W, rtol=0, atol=1e-10)  # the float64 bar


@pytest.mark.torch
def test_nonfinite_propagate_like_torch():
    """Without skipping, NaN and Inf reach exactly the coordinates torch's reach, in the
    accumulator and in the weights."""
    dtype = np.float32
    rng = np.random.default_rng(19)
    dim = 6
    init = init_weights(rng, N, dim, dtype)
    idx, G, _ = _nonfinite_batch(rng, dim, dtype)
    batches = [(idx, G)] + batch_stream(rng, N, dim, dtype, steps=3)
    rec = Records("elementwise", init)
    kw = CONFIGS["decay-iav"]
    with np.errstate(all="ignore"):
        for t, (W, Sum, ui, gv) in enumerate(torch_adagrad_run(init, batches, **kw), 1):
            rec.step(ui, gv, t, **kw)
            touched = rec.S != 0
            np.testing.assert_array_equal(rec.S[touched], Sum[touched])
            np.testing.assert_array_equal(np.isnan(rec.P), np.isnan(W))
            np.testing.assert_array_equal(np.isinf(rec.P), np.isinf(W))
    assert np.isnan(rec.P).any()


@pytest.mark.torch
@pytest.mark.parametrize("cfg", ["default", "decay-iav", "max-eps"])
@pytest.mark.parametrize("dt", DTYPES)
def test_rowwise_kernel_vs_pbg(dt, cfg):
    """The row-wise kernel against PBG's RowAdagrad over 30 steps. Two things differ, both at
    the last bit: torch's square root, and torch's row mean (a sum in torch's cascade order
    and in T; the kernel sums in float64 and rounds once). Asserted: accumulators within 8
    ulp, weights within 6 ulp of the largest weight (measured over 6 seeds, d = 16 and 37:
    4 ulp and 1.85 ulp, i.e. 4.8e-7 in float32 with weights up to 2.2 and lr 0.5, 8.9e-16
    in float64)."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng([len(cfg), len(dt), 4])
    dim, steps = 37, 30
    init = init_weights(rng, N, dim, dtype)
    batches = batch_stream(rng, N, dim, dtype, steps=steps)
    rec = Records("rowwise", init)
    kw = pbg_kw(cfg)
    for t, (W, Sum, ui, gv) in enumerate(pbg_run(init, batches, **kw), 1):
        rec.step(ui, gv, t, **kw)
        assert ulps(rec.S, Sum) <= 8, f"t={t}"  # the sums are >= 0: ulps compare
    diff = np.abs(rec.P.astype(np.float64) - W).max()
    assert diff <= 6 * np.finfo(dtype).eps * np.abs(W).max(), diff


@pytest.mark.parametrize("dt", DTYPES)
def test_rowwise_l2_is_fbgemms(dt):
    """L2 decay row-wise is FBGEMM's ``ROWWISE_ADAGRAD`` with ``weight_decay_mode=1``: the
    accumulator takes the mean square of ``g + wd*w``, and ``w <- (1 - mult*wd)*w - mult*g``
    with ``mult = lr/(sqrt(G)+eps)`` (its CPU code, transcribed here in float64) -- the same
    update as ours in exact arithmetic (``w - mult*(g + wd*w)``), which rounds differently.
    And L2 changes the trajectory."""
    dtype = DTYPES[dt]
    rng = np.random.default_rng(21)
    dim, lr, wd, eps = 16, 0.1, 0.3, 1e-10
    init = init_weights(rng, N, dim, dtype) * 10  # weights that make the decay show
    batches = batch_stream(rng, N, dim, dtype, steps=10)
    rec, plain = Records("rowwise_l2", init), Records("rowwise", init)
    w, G = init.astype(np.float64), np.zeros(N)
    for t, (idx, g) in enumerate(batches, 1):
        rec.step(idx, g, t, lr=lr, eps=eps, weight_decay=wd)
        plain.step(idx, g, t, lr=lr, eps=eps)
        if not len(idx):
            continue
        ui, gc = R.coalesce_ref(idx, g)  # FBGEMM's CPU rowwise_adagrad, per row:
        gc = gc.astype(np.float64)
        y = gc + wd * w[ui]  # grad += weight_decay * w (L2); grad_buffer keeps g
        G[ui] += (y * y).sum(axis=1) / dim  # new_sum_square_grads = momentum1 + g_avg_square
        mult = lr / (np.sqrt(G[ui]) + eps)
        correction = 1.0 - mult * wd
        w[ui] = correction[:, None] * w[ui] - gc * mult[:, None]
    # measured over 6 seeds: at most a tenth of these (the float32 kernel's own roundings
    # against a float64 transcription; in float64 the two roundings of the regrouped update)
    tol = {"rtol": 2e-6, "atol": 2e-7} if dtype == np.float32 else {"rtol": 1e-14, "atol": 1e-15}
    np.testing.assert_allclose(rec.P, w, **tol)
    np.testing.assert_allclose(rec.S[:, 0], G, rtol=8 * np.finfo(dtype).eps, atol=0)
    assert np.abs(plain.P - rec.P).max() > 1e-3


# -- the pieces ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES)
def test_hparams_are_rounded_once(dt):
    dtype = DTYPES[dt]
    hp = K.adagrad_hparams(dtype, lr=0.1, t=5, lr_decay=0.01, eps=1e-10,
                           initial_accumulator_value=0.05, maximize=True, weight_decay=0.3)
    assert hp.dtype == dtype and hp.shape == (K.HP_SIZE,)
    assert hp[K.HP_NEG_CLR] == dtype(-(0.1 / (1 + 4 * 0.01)))
    assert K.adagrad_clr(0.1, 0.0, 1000) == 0.1  # no decay: lr itself
    assert (hp[K.HP_EPS], hp[K.HP_SGN]) == (dtype(1e-10), -1)
    assert (hp[K.HP_IAV], hp[K.HP_WD]) == (dtype(0.05), dtype(0.3))
    assert K.adagrad_hparams(dtype, lr=0.1, t=1)[K.HP_SGN] == 1


def test_rowwise_refuses_decoupled_decay():
    with pytest.raises(ValueError, match=r"row-wise Adagrad takes weight-decay mode WD_NONE "
                                         r"\(0\) or WD_L2 \(1\), got 2"):
        K.rowwise_adagrad_options_kernel(WD_DECOUPLED)


@pytest.mark.parametrize("dt", DTYPES)
def test_fma_oracle_rounds_once(dt):
    """The oracle's fused multiply-add against exact rationals on the hard cases: ``a*x`` is
    half an ulp of ``y`` times ``1 - eps**2``, so ``a*x + y`` lies a hair off a halfway point
    of T. There an unfused evaluation, or a float32 one through double (two roundings), goes
    the wrong way in half of the cases (measured: 1008 of 2000 float32 cases, 512 of 2000
    float64); then Inf and NaN."""
    from fractions import Fraction

    dtype = DTYPES[dt]
    rng = np.random.default_rng(29)
    e = np.finfo(dtype).eps
    a = dtype(1 - e)
    y = (rng.uniform(1, 2, 2000) * 2.0 ** rng.integers(-20, 20, 2000)).astype(dtype)
    y *= rng.choice([-1, 1], y.shape).astype(dtype)
    x = (np.spacing(np.abs(y)) / 2 * dtype(1 + e) * rng.choice([-1, 1], y.shape)).astype(dtype)
    want = np.array([_round(Fraction(float(a)) * Fraction(float(u)) + Fraction(float(v)),
                            dtype) for u, v in zip(x, y, strict=True)], dtype)
    np.testing.assert_array_equal(R.fma(a, x, y), want)
    assert (a * x + y != want).sum() > 400  # the cases are hard: one more rounding shows
    with np.errstate(all="ignore"):
        special = R.fma(dtype(2), np.array([np.inf, np.nan, 1], dtype),
                        np.array([1, 1, -np.inf], dtype))
    np.testing.assert_array_equal(special, np.array([np.inf, np.nan, -np.inf], dtype))


def _round(q, dtype):
    """The rational ``q`` rounded to nearest-even in ``dtype`` (float64 first is exact for
    float64; for float32 compare the neighbours)."""
    from fractions import Fraction

    c = dtype(float(q))
    if dtype == np.float64:
        return c
    cands = [c, np.nextafter(c, dtype(np.inf)), np.nextafter(c, dtype(-np.inf))]
    return min(cands, key=lambda z: (abs(Fraction(float(z)) - q),
                                     int(np.array(z).view(np.uint32)) & 1))
