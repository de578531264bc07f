"""Collection rules for the docstring examples (``--doctest-modules`` over the packages).

The PyKEEN integration's modules import PyKEEN, an optional extra (``pip install
"dsa-core[pykeen]"``; ``make test`` installs it): without it they are not collected, as
``tests/adapters/pykeen/test_pykeen.py`` skips itself.
"""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("pykeen") else ["adapters/*pykeen*.py"]


import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _temporary_files_under_pytests_own(tmp_path_factory):
    """``tempfile.mkdtemp()`` and friends (the docstring examples make their stores that way,
    as a user would) write under this run's own temporary directory, which pytest prunes
    (it keeps the last three runs), instead of leaving a directory in /tmp per example per
    run (800 of them after a day of runs)."""
    import tempfile

    old = tempfile.tempdir
    tempfile.tempdir = str(tmp_path_factory.mktemp("tempfile"))
    yield
    tempfile.tempdir = old
