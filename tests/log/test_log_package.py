"""The log engine's package layout (dsa_core._log): it imports, and its imports point one way.

Every module of the package imports in a fresh interpreter; no module of it imports the
in-place engine (``_inplace``) or the core's glue above the engines (``_prefetch``,
``_ranges``, ``_state``, ``_step``); the package's imports have no cycle, inside
it or through the rest of dsa_core; the OS layer (``dsa_core._os``) imports nothing of
dsa_core. The imports are read with ``ast`` (lazy imports inside functions included).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dsa_core

CORE = Path(dsa_core.__file__).parent
PKG = CORE / "_log"
MODULES = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
FORBIDDEN = {"_prefetch", "_ranges", "_state", "_step", "_inplace", "_inplace.store",
             "_inplace.readahead", "_inplace.ranges"}


def _name_of(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    """Every module of dsa_core (the package's included) by dotted name."""
    return {_name_of(p): p for p in sorted(CORE.rglob("*.py"))}


def _imports(path: Path, known: set[str]) -> set[str]:
    """The dsa_core modules that ``path`` imports (explicitly: not the parent packages that
    Python imports on the way)."""
    name = _name_of(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # "from .. import _log_init" imports a module; "from .x import y" module x
            subs = {f"{mod}.{a.name}" for a in node.names} & known
            out |= subs or ({mod} & known)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) for m, p in mods.items()}


def test_every_module_of_the_package_imports_in_a_fresh_interpreter():
    code = ("import importlib, sys\n"
            f"for m in {MODULES!r}:\n"
            "    importlib.import_module('dsa_core._log.' + m)\n"
            "import dsa_core._log as L\n"
            "missing = [n for n in L.__all__ if not hasattr(L, n)]\n"
            "assert not missing, missing\n"
            "print('ok', len(sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=CORE.parent, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")
    assert {"engine", "pool", "segments", "cleaner", "commit", "recovery", "format", "wal",
            "writer", "read"} <= set(MODULES)


def _ours(graph: dict[str, set[str]]) -> list[str]:
    return [m for m in graph if m == "dsa_core._log" or m.startswith("dsa_core._log.")]


def test_no_module_of_the_package_imports_the_other_engine_or_the_core_glue():
    graph = _graph()
    ours = _ours(graph)
    assert len(ours) == len(MODULES) + 1  # and the package's __init__
    forbidden = {f"dsa_core.{f}" for f in FORBIDDEN}
    assert {m: sorted(graph[m] & forbidden) for m in ours if graph[m] & forbidden} == {}


def test_the_os_layer_imports_nothing_of_dsa_core():
    assert _graph()["dsa_core._os"] == set()


def test_no_import_cycle_runs_through_the_package():
    """No module of the package is on an import cycle: not inside the package, and not
    through the rest of dsa_core (what the package imports never imports it back)."""
    graph = _graph()
    for start in _ours(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            assert m != start, f"{start} imports itself through {sorted(seen)}"
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
