"""The command line: dsa info / export / verify / bench, and its errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

import dsa_core
from dsa_core.__main__ import main


def _store(path, c=0.0):
    st = dsa_core.create(path, 50, 4, curvature=c, init="normal", init_scale=0.1, seed=3)
    st = dsa_core.step(st, [1, 2, 2], np.ones((3, 4), np.float32))
    dsa_core.close(st)
    return st


def test_info_reports_the_store(tmp_path, capsys):
    _store(tmp_path / "s", c=1.0)
    assert main(["info", str(tmp_path / "s"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["num_rows"], info["dim"], info["dtype"]) == (50, 4, "float32")
    assert info["curvature"] == 1.0 and info["count"] == 1
    assert info["format_version"] == 1  # the ball's records have not changed since v1
    assert info["second_moment"] == "riemannian"
    assert info["size_on_disk_bytes"] > 4096


def test_export_writes_the_weights(tmp_path, capsys):
    _store(tmp_path / "s")
    out = tmp_path / "w.npy"
    assert main(["export", str(tmp_path / "s"), str(out), "--quiet"]) == 0
    st = dsa_core.open(tmp_path / "s", mode="r")
    np.testing.assert_array_equal(np.load(out), st.weights)
    with pytest.raises(SystemExit, match="exists"):
        main(["export", str(tmp_path / "s"), str(out), "--quiet"])


def test_verify_ok_and_detects_damage(tmp_path, capsys):
    _store(tmp_path / "s", c=1.0)
    assert main(["verify", str(tmp_path / "s"), "--quiet"]) == 0
    assert "inside the ball" in capsys.readouterr().out
    st = dsa_core.open(tmp_path / "s")
    st.weights[7] = 2.0            # outside the unit ball
    st.exp_avg[9, 0] = np.nan      # a non-finite moment
    dsa_core.close(st)
    assert main(["verify", str(tmp_path / "s"), "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "1 rows hold NaN or Inf" in out and "1 rows lie on or outside" in out


@pytest.mark.parametrize("cmd", ["info", "verify"])
def test_not_a_store_is_a_clear_error(tmp_path, cmd):
    with pytest.raises(SystemExit, match="not a DSA store"):
        main([cmd, str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        main([cmd, str(tmp_path / "missing")])


def test_bench_and_module_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dsa_core", "bench", "--rows", "2000", "--dim",
                        "8", "--batch", "64", "--steps", "5", "--workdir", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert "rows/s" in r.stdout and "torch.optim.SparseAdam" in r.stdout
