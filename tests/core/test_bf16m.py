"""``first_moment="bfloat16"`` (docs/algorithms.md §6): m as bfloat16, stochastically rounded.

``test_core_kernels`` checks the kernel against the NumPy oracle bit for bit (both second
moments, every batch shape). These tests pin the rounding itself and the store's contract.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import dsa_core
from dsa_core import _layout
from dsa_core import _reference as R

N, D = 40, 8


def test_stochastic_rounding_is_unbiased_and_keeps_specials():
    """x between two bfloat16 neighbours rounds up with probability (x - lo) / (hi - lo)."""
    lo, ulp = np.float32(1.0), np.float32(2.0**-7)  # bfloat16 spacing at 1
    x = np.full((1, 1), lo + np.float32(2.0**-10), np.float32)  # 1/8 of the way up
    rounded = np.array([R.bf16_round(x, R.sr_bits(t, np.array([3]), 1))[0, 0]
                        for t in range(1, 20001)])
    assert set(np.unique(rounded)) == {lo, lo + ulp}
    p_up = float(np.mean(rounded == lo + ulp))
    assert abs(p_up - 0.125) < 4 * np.sqrt(0.125 * 0.875 / 20000)  # within 4 sigma
    assert abs(rounded.mean() - x[0, 0]) < 4 * ulp * np.sqrt(0.125 * 0.875 / 20000)
    special = np.array([[np.inf, -np.inf, np.nan, -0.0, 0.0]], np.float32)
    out = R.bf16_round(special, R.sr_bits(1, np.array([0]), 5))
    np.testing.assert_array_equal(out[0, :2], special[0, :2])
    assert np.isnan(out[0, 2])
    assert np.signbit(out[0, 3]) and out[0, 3] == 0 and not np.signbit(out[0, 4])
    exact = np.array([[1.0, -2.5, 2.0**127]], np.float32)  # bfloat16 values stay as they are
    np.testing.assert_array_equal(R.bf16_round(exact, R.sr_bits(9, np.array([1]), 3)), exact)


def _pair(tmp_path, **kw):
    init = (0.1 * np.random.default_rng(0).standard_normal((N, D))).astype(np.float32)
    full = dsa_core.create(tmp_path / "full", N, D, init=init, lr=0.05, **kw)
    half = dsa_core.create(tmp_path / "half", N, D, init=init, lr=0.05,
                           first_moment="bfloat16", **kw)
    return full, half


@pytest.mark.parametrize("second_moment", ["elementwise", "rowwise"])
def test_v_is_unchanged_and_m_stays_within_rounding(tmp_path, second_moment):
    """v depends on the gradients only: identical. m differs from the float32 m by the
    accumulated rounding: measured below 1% of max|m| here."""
    full, half = _pair(tmp_path, second_moment=second_moment)
    rng = np.random.default_rng(1)
    for _ in range(20):
        idx = rng.integers(0, N, 30)
        g = rng.standard_normal((30, D)).astype(np.float32)
        full = dsa_core.step(full, idx, g)
        half = dsa_core.step(half, idx, g)
    np.testing.assert_array_equal(half.exp_avg_sq, full.exp_avg_sq)
    err = np.abs(half.exp_avg - full.exp_avg).max()
    assert 0 < err < 0.01 * np.abs(full.exp_avg).max()
    m16 = half.exp_avg.view(np.uint32)
    assert not (m16 & np.uint32(0xFFFF)).any()  # every stored m is a bfloat16 value
    dsa_core.close(full)
    dsa_core.close(half)


@pytest.mark.parametrize(("second_moment", "weights", "expect"), [
    ("elementwise", True, 128 * 4 + 128 * 2 + 128 * 4),
    ("rowwise", True, 128 * 4 + 128 * 2 + 4),
    ("rowwise", False, 128 * 2 + 4),
    ("elementwise", False, 7 * 2 + 2 + 7 * 4),  # odd dim: m padded to 4 float32 slots
])
def test_record_sizes(tmp_path, second_moment, weights, expect):
    d = 7 if expect == 7 * 2 + 2 + 7 * 4 else 128
    st = dsa_core.create(tmp_path / "s", 10, d, weights=weights, second_moment=second_moment,
                         first_moment="bfloat16")
    assert st.store.layout.stride * 4 == expect
    assert st.first_moment == "bfloat16"
    assert st.exp_avg.shape == (10, d) and not st.exp_avg.flags.writeable
    dsa_core.close(st)


def test_resume_and_version(tmp_path, monkeypatch):
    full, half = _pair(tmp_path)
    dsa_core.close(full)
    b = dsa_core.create(tmp_path / "b", N, D, init=half.weights.copy(), lr=0.05,
                        first_moment="bfloat16")
    rng = np.random.default_rng(2)
    batches = [(rng.integers(0, N, 20), rng.standard_normal((20, D)).astype(np.float32))
               for _ in range(6)]
    for idx, g in batches[:3]:
        half = dsa_core.step(half, idx, g)
        b = dsa_core.step(b, idx, g)
    dsa_core.close(b)
    b = dsa_core.open(tmp_path / "b")
    assert b.first_moment == "bfloat16" and b.count == 3
    for idx, g in batches[3:]:
        half = dsa_core.step(half, idx, g)
        b = dsa_core.step(b, idx, g)
    assert half.store.data.tobytes() == b.store.data.tobytes()
    dsa_core.close(half)
    dsa_core.close(b)
    assert json.loads((tmp_path / "half" / "manifest.json").read_text())["version"] == 2
    monkeypatch.setattr(_layout, "FORMAT_VERSION", 1)
    with pytest.raises(ValueError, match="format version 2; this dsa_core reads versions"):
        dsa_core.open(tmp_path / "half")


@pytest.mark.parametrize(("kw", "msg"), [
    ({"first_moment": "bf16"}, r"first_moment must be one of \('full', 'bfloat16'\)"),
    ({"first_moment": "bfloat16", "dtype": "float64"},
     (r"first_moment='bfloat16' is for float32 stores with curvature == 0 \(got dtype "
      r"float64")),
    ({"first_moment": "bfloat16", "curvature": 1.0},
     (r"first_moment='bfloat16' is for float32 stores with curvature == 0 \(got dtype "
      r"float32, curvature 1\.0\)")),
])
def test_bad_first_moment_writes_nothing(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        dsa_core.create(tmp_path / "s", N, D, **kw)
    assert not (tmp_path / "s").exists()


def test_set_exp_avg_rounds_to_nearest_even(tmp_path):
    """``State.set_exp_avg`` (loading moments, e.g. a SparseAdam state dict) rounds to the
    nearest bfloat16, ties to even, as torch's own conversion; a full store takes the values
    as they are; a wrong shape writes nothing."""
    torch = pytest.importorskip("torch")
    st = dsa_core.create(tmp_path / "b", N, D, first_moment="bfloat16")
    rng = np.random.default_rng(4)
    m = (rng.standard_normal((N, D)) * 10.0 ** rng.integers(-30, 30, (N, D))).astype(np.float32)
    one = np.float32(1.0).view(np.uint32)
    m[0, :6] = np.array([one + 0x8000, one + 0x18000, one + 0x7FFF, one + 0x8001, 0x7F7FFFFF,
                         0x7FC00001], np.uint32).view(np.float32)  # ties, near-ties, max, NaN
    m[1, :4] = [np.inf, -np.inf, -0.0, np.float32(1e-45)]
    before = st.store.data.copy()
    with pytest.raises(ValueError, match=r"exp_avg must be a real \(40, 8\) array"):
        st.set_exp_avg(m[:, :4])
    np.testing.assert_array_equal(st.store.data, before)
    st.set_exp_avg(m)
    want = torch.from_numpy(m).to(torch.bfloat16).float().numpy()
    got = st.exp_avg
    assert np.isnan(got[0, 5]) and np.isnan(want[0, 5])
    got, want = got.copy(), want.copy()
    got[0, 5] = want[0, 5] = 0
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(st.exp_avg_sq, 0)  # v untouched
    dsa_core.close(st)
    ro = dsa_core.open(tmp_path / "b", mode="r")
    with pytest.raises(ValueError, match=r"open read-only \(mode='r'\); open it with "):
        ro.set_exp_avg(m)
    dsa_core.close(ro)
    full = dsa_core.create(tmp_path / "f", N, D)
    full.set_exp_avg(m)
    np.testing.assert_array_equal(full.exp_avg.view(np.uint32), m.view(np.uint32))
    dsa_core.close(full)
