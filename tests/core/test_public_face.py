"""The two faces of dsa_core: ``dsa_core`` is the user's API (what docs/CORE_API.md documents
for users), ``dsa_core.tools`` the tooling the adapters, the CLI and the benchmarks build on.
A name added to either face, or moved between them, changes this file and the docs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import dsa_core
from dsa_core import tools

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "CORE_API.md").read_text()
USER_DOC, _, TOOLS_DOC = DOC.partition("## Tooling (`dsa_core.tools`)")

USER_FACE = {
    # a store's life and its steps
    "State", "create", "open", "step", "gather", "check_batch", "convert", "flush",
    "checkpoint", "close", "remove", "warmup", "FORMAT_VERSION",
    # hints and range loads
    "prefetch", "prefetched", "residency", "load_range", "release_range", "load_rows",
    "release_rows", "wait_ranges",
    # settings users pass
    "region_memory", "set_num_threads", "get_num_threads",
    # several stores
    "step_many", "join", "Group", "flush_many", "checkpoint_many",
    # records and counts (importers, resharding)
    "restore", "set_count", "read_records", "write_records",
    # errors
    "StaleStateError", "StoreLockedError", "UncleanStopError", "ForkedReadError",
    "GroupMismatchError", "GroupCommitError", "InDoubtError",
    # submodules
    "buckets", "tools",
}
TOOLS_FACE = {"ACCESS_MODES", "GROUP_FILE", "check_access", "deferred_sigint", "follow_threads",
              "link_files", "max_repeats", "paging_limits", "read_json", "restore_records",
              "staged_dir", "step_many_into", "validation", "write_json"}


def test_the_user_face_is_pinned():
    assert len(dsa_core.__all__) == len(set(dsa_core.__all__)) == 42
    assert set(dsa_core.__all__) == USER_FACE
    public = {n for n in dir(dsa_core) if not n.startswith("_")}
    assert public == USER_FACE, "public names outside __all__ (an alias left behind?)"


def test_each_user_name_is_documented_for_users():
    missing = [n for n in dsa_core.__all__
               if not re.search(rf"\bdsa_core\.{re.escape(n)}\b", USER_DOC)]
    assert not missing, f"not in docs/CORE_API.md (before its Tooling section): {missing}"


def test_the_tools_face_exists_and_is_documented():
    assert set(tools.__all__) == TOOLS_FACE
    assert not TOOLS_FACE & USER_FACE
    assert [n for n in tools.__all__ if not hasattr(tools, n)] == []
    missing = [n for n in tools.__all__ if not re.search(rf"\btools\.{re.escape(n)}\b",
                                                          TOOLS_DOC)]
    assert not missing, f"not in docs/CORE_API.md's Tooling section: {missing}"


def test_tools_only_re_exports():
    """Like ``dsa_core._log``'s face: imports and ``__all__``, no code of its own."""
    tree = ast.parse((ROOT / "dsa_core" / "tools.py").read_text())
    kinds = {type(node).__name__ for node in tree.body}
    assert kinds <= {"Expr", "ImportFrom", "Assign"}, kinds
    assigned = [t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets]
    assert assigned == ["__all__"]


def test_max_repeats_counts_the_most_frequent_id():
    """``tools.max_repeats``: one hash pass over any order; a repeat anywhere, however far
    apart, is counted (the torch adapter coalesces with torch only from three copies on)."""
    import numpy as np

    assert tools.max_repeats(np.empty(0, np.int64)) == 0
    assert tools.max_repeats(np.array([7])) == 1
    assert tools.max_repeats(np.array([5, 1, 9, 0])) == 1
    assert tools.max_repeats(np.array([5, 1, 5])) == 2
    assert tools.max_repeats(np.array([5, 1, 5, 2, 5, 1])) == 3
    rng = np.random.default_rng(0)
    ids = rng.permutation(1 << 20)[:4096]
    assert tools.max_repeats(ids) == tools.max_repeats(ids.astype(np.int32)) == 1
    ids[4095] = ids[0]
    assert tools.max_repeats(ids) == 2
    ids[2000] = ids[0]
    assert tools.max_repeats(ids) == 3
    assert tools.max_repeats(np.array([2**62, 3, 2**62], np.int64)) == 2
