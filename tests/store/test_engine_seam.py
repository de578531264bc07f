"""The seam between the core and its storage engines (dsa_core/_engine.py), guarded.

* No storage-kind switch outside the engines: code outside them never asks which kind of
  store it holds (``state.storage == "log"``, ``getattr(st, "storage")``) and never reaches
  into an engine (``.engine``, ``._readahead``, ``LogStore``): a switch there is a missing
  method of the ``Engine`` protocol.
* No import cycle inside ``dsa_core`` (lazy imports inside functions count too: they are
  how cycles hide).
* Both engines implement the protocol.

The checks read the source with ``ast``/regular expressions; they are fast and need no store.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "dsa_core"

# The engines and the seam itself: the only places that may know a kind's internals.
ENGINE_FILES = {"_engine.py", "_engines.py"}


def _is_engine(path: Path) -> bool:
    rel = path.relative_to(ROOT).as_posix()
    return (path.name in ENGINE_FILES and rel.startswith("dsa_core/")) \
        or rel.startswith("dsa_core/_log/") or rel.startswith("dsa_core/_inplace/")


# What a kind switch or a reach into an engine looks like in code outside the engines.
SWITCHES = [
    (re.compile(r"\.storage\s*[!=]=|[!=]=\s*[\w.]+\.storage\b"), "compares a store's kind"),
    (re.compile(r"getattr\([^)]*[\"']storage[\"']"), "asks a store's kind"),
    (re.compile(r"\b(?:st|store|state\.store)\.kind\s*[!=]=|[!=]=\s*(?:st|store)\.kind\b"),
     "compares an engine's kind"),
    (re.compile(r"\.engine\b"), "reaches into the log engine"),
    (re.compile(r"\._readahead\b"), "reaches into the log store's read-ahead"),
    (re.compile(r"\bLogStore\b|\bLogEngine\b"), "names a log-store class"),
    (re.compile(r"\bloc\s*\[.*<\s*0"), "reads the log region's index"),
]

# Deliberate exceptions, each with its reason. Keep this short.
ALLOWED = {
    # compares an existing store's kind with the kind the user asked for (resume checks)
    ("adapters/_storage.py", "state.storage != storage"),
    # the CLI's own arguments (`a` is its argparse namespace), not a store
    ("dsa_core/__main__.py", 'a.memory is not None and a.storage != "log"'),
}


def _code_lines(path: Path):
    """(line number, code) for every line that is not a comment or inside a docstring."""
    src = path.read_text()
    tree = ast.parse(src)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None),
                                                        ast.Constant) \
                and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    for no, line in enumerate(src.splitlines(), 1):
        code = line.split("#", 1)[0]
        if no in doc_lines or not code.strip():
            continue
        yield no, code


def _outside_engines():
    for base in (CORE, ROOT / "adapters"):
        for path in sorted(base.rglob("*.py")):
            if not _is_engine(path):
                yield path


def test_no_kind_switch_outside_the_engines():
    found = []
    for path in _outside_engines():
        rel = path.relative_to(ROOT).as_posix()
        for no, code in _code_lines(path):
            for rx, what in SWITCHES:
                if rx.search(code) and not any(rel == f and frag in code for f, frag in ALLOWED):
                    found.append(f"{rel}:{no}: {what}: {code.strip()}")
    assert not found, ("storage-kind switches outside the engines (add a method to "
                       "dsa_core._engine.Engine instead):\n" + "\n".join(found))


def test_the_guard_catches_a_switch(tmp_path):
    """The patterns above do match the switches they are meant to catch."""
    samples = ['if state.storage == "log":', 'if getattr(st, "storage", "inplace") == "log":',
               "st.engine.read(idx)", "ra = st._readahead", "(st.engine.loc[rows] < 0)",
               "if st.kind != 'inplace':", 'if "log" == st.storage:']
    for code in samples:
        assert any(rx.search(code) for rx, _ in SWITCHES), code


def _imports(path: Path, package: str) -> set[str]:
    """The dsa_core modules ``path`` imports (top-level and lazy), as module names."""
    me = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    if path.name == "__init__.py":
        me = me.rsplit(".", 1)[0]
    pkg = me if path.name == "__init__.py" else me.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith(package):
                continue
            for alias in node.names:  # `from . import _log` names a module
                sub = f"{mod}.{alias.name}"
                out.add(sub if _module_path(sub) is not None else mod)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith(package + "."))
    out.discard(me)
    return out


def _module_path(name: str) -> Path | None:
    p = ROOT / name.replace(".", "/")
    if p.with_suffix(".py").is_file():
        return p.with_suffix(".py")
    if (p / "__init__.py").is_file():
        return p / "__init__.py"
    return None


def test_no_import_cycle_in_dsa_core():
    """Tarjan's strongly connected components over the modules of dsa_core. The package's
    ``__init__`` (which re-exports everything) and ``__main__`` are left out: nothing in the
    core imports them, except ``buckets``' call-time ``dsa_core.*`` look-ups."""
    graph: dict[str, set[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        if name in ("dsa_core.__init__", "dsa_core.__main__"):
            continue
        name = name.removesuffix(".__init__")
        graph[name] = {m for m in _imports(path, "dsa_core") if m != "dsa_core"}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles inside dsa_core: {cycles}"


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_both_engines_implement_the_protocol(tmp_path, storage):
    import dsa_core
    from dsa_core._engine import Engine

    st = dsa_core.create(tmp_path / "s", 16, 4, storage=storage)
    try:
        assert isinstance(st.store, Engine)
        assert st.store.kind == st.storage == storage
        missing = [n for n in Engine.__annotations__ if not hasattr(type(st.store), n)
                   and n not in vars(st.store)]
        assert not missing
    finally:
        dsa_core.close(st)


# the 14 attributes that repeated the layout dict (stride, offsets, ...) became one frozen
# ``Layout`` value (issue 41): 57 members before, 43 after. Then the core's own state left
# for its ``_handle.Handle`` (group, group_ref, scratch, settings, access_request; unclean
# became a stat): 37; read/write take a slice for a range (read_range and write_range
# went): 35; one submit of a hint (prefetch) or a load or release of a range or a row set
# (submit_range, submit_rows): 33. A seam the width of a pager: what it is as one frozen
# Info (table_view, reads_last_flush, access, nbytes, memory_bytes, max_batch); the core
# refuses a batch over info.max_batch (check_batch), flushes with prepare_commit(lone=True)
# + install_commit (flush), syncs the manifest (sync_commit) and owns the life cycle in its
# Handle (closed); a range write voids the undo journal (before_restore), read(view=True)
# hands a table view out (view_handed_out); wait_ranges is the wait verb: 22. A new member
# changes this count
ENGINE_MEMBERS = 22
# what the core keeps in its Handle, never on an engine (issue 41)
CORE_STATE = ("group", "group_ref", "scratch", "settings", "access_request", "closed")
# what became data in the engine's Info, or the core's (issue 41)
GONE = ("table_view", "reads_last_flush", "access", "nbytes", "memory_bytes", "max_batch",
        "check_batch", "flush", "sync_commit", "closed", "before_restore", "view_handed_out",
        "wait_ranges")
LAYOUT_FIELDS = ("num_rows", "dim", "dtype", "curvature", "stride", "w_off", "m_off", "v_off",
                 "v_width", "m_width", "rowwise", "m_bf16", "rs_off", "ls_off")


def test_the_engine_protocol_size_is_pinned():
    from dsa_core._engine import Engine

    tree = ast.parse((ROOT / "dsa_core" / "_engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    members = [n.target.id if isinstance(n, ast.AnnAssign) else n.name for n in cls.body
               if isinstance(n, (ast.AnnAssign, ast.FunctionDef))]
    assert len(members) == len(set(members)) == ENGINE_MEMBERS, len(members)
    assert Engine.__annotations__["layout"] == "Layout"
    assert not set(LAYOUT_FIELDS) & set(members)
    assert not set(CORE_STATE) & set(members) and "unclean" not in members  # a stat now
    assert not set(GONE) & set(members)
    assert Engine.__annotations__["info"] == "Info"


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_what_an_engine_is_is_one_frozen_info(tmp_path, storage):
    import dataclasses

    import dsa_core
    from dsa_core._engine import Info

    st = dsa_core.create(tmp_path / "s", 16, 4, storage=storage)
    try:
        info = st.store.info
        assert type(info) is Info and not hasattr(info, "__dict__")
        with pytest.raises(dataclasses.FrozenInstanceError):
            info.max_batch = 1
        assert (info.table_view, info.reads_last_flush) == (storage == "inplace",
                                                            storage == "log")
        assert st.access == info.access and st.has_table_view == info.table_view
        assert info.max_batch == 16 if storage == "inplace" else 0 < info.max_batch <= 16
    finally:
        dsa_core.close(st)
    assert st.closed and st.handle.closed


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_the_core_keeps_its_state_in_one_handle_per_store(tmp_path, storage):
    """One Handle per open store, shared by its States and owned by the core: the newest
    count and meta, settings, group and buffers live there; the engine holds none of them."""
    import numpy as np

    import dsa_core
    from dsa_core._handle import Handle

    s0 = dsa_core.create(tmp_path / "s", 16, 4, storage=storage)
    try:
        h = s0.handle
        assert type(h) is Handle and s0.store is h.store
        s1 = dsa_core.step(s0, [1, 2], np.ones((2, 4), np.float32))
        s2 = s1._replace(lr=0.5)
        assert s1.handle is s2.handle is h and (h.count, s1.count) == (1, 1)
        assert h.meta["hparams"]["lr"] == s1.lr and s1.current and not s0.current
        dsa_core.flush(s2)
        assert h.meta["hparams"]["lr"] == 0.5 and h.store.count == 1
        g = dsa_core.join([s2])
        assert h.group is not None and h.group_ref is not None
        g.close()
        assert h.group is None
        for name in CORE_STATE:
            assert name not in vars(h.store) and not hasattr(type(h.store), name), name
    finally:
        dsa_core.close(s0)


@pytest.mark.parametrize("storage", ["inplace", "log"])
def test_the_layout_is_one_frozen_value_the_manifest_unchanged(tmp_path, storage):
    import dataclasses
    import json

    import dsa_core
    from dsa_core._layout import Layout

    st = dsa_core.create(tmp_path / "s", 16, 4, storage=storage, per_row_step=True)
    try:
        lay = st.store.layout
        assert type(lay) is Layout and not hasattr(lay, "__dict__")  # slotted
        with pytest.raises(dataclasses.FrozenInstanceError):
            lay.stride = 1
        assert not [n for n in LAYOUT_FIELDS if n in vars(st.store)]  # not unpacked again
        assert (lay.stride, lay.rs_off, lay.ls_off, lay.w_off) == (13, 12, -1, 0)
        dsa_core.flush(st)
        on_disk = json.loads((tmp_path / "s" / "manifest.json").read_text())["layout"]
        assert on_disk == lay.as_dict() == st.layout
    finally:
        dsa_core.close(st)
