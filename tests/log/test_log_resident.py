"""The resident map (row -> slot, open addressing with backward-shift removal) and the row
index's delta against a dict, through random inserts, removals and lookups: wrap-around at
the table's end, chains that a removal must close, a table at its load limit."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_core._log import resident as R
from dsa_core._log.index import RowIndex


@pytest.mark.parametrize("slots", [1, 3, 8, 100, 2000])
def test_the_map_agrees_with_a_dict(slots):
    rng = np.random.default_rng(slots)
    table = R.new_table(slots)
    assert table.shape[0] >= 2 * slots  # at most half full
    ref: dict[int, int] = {}
    free = list(range(slots))
    ids = np.arange(4 * slots + 8, dtype=np.int64)
    for it in range(6000):
        if free and (not ref or rng.random() < 0.55):
            row = int(rng.integers(0, ids.shape[0]))
            if row in ref:
                continue
            s = free.pop()
            R.insert(table, np.array([row]), np.array([s]))
            ref[row] = s
        else:
            row = list(ref)[int(rng.integers(len(ref)))]
            R.remove(table, np.array([row]))
            free.append(ref.pop(row))
        if it % 53 == 0 or len(ref) == slots:
            want = np.array([ref.get(int(r), -1) for r in ids])
            np.testing.assert_array_equal(R.slots_of(table, ids), want)
    assert int((table[:, 0] >= 0).sum()) == len(ref)


def test_the_delta_of_a_mapped_index_overrides_its_base_and_grows():
    idx = RowIndex(10_000)
    idx.unmapped()  # a mapped index without a base file: every row at 0 but the delta's
    rng = np.random.default_rng(0)
    ref = np.zeros(10_000, np.int64)
    for _ in range(40):
        rows = rng.choice(10_000, 300, replace=False)
        locs = rng.integers(1, 1 << 40, 300)
        idx.set(rows, locs)
        ref[rows] = locs
    np.testing.assert_array_equal(idx.all(), ref)
    assert idx.entries == int(np.count_nonzero(ref))
    assert idx.delta.shape[0] >= 2 * idx.entries
