"""The README's quickstart code runs as written, and the docs point only at files that exist.

Every ```python block under a quickstart heading of README.md (and under "Coming from the DSA
article") is extracted from the file and executed in a fresh namespace, in a temporary working
directory, so the README cannot drift from the code. The blocks use small sizes on purpose.
A failing block is reported with its heading and its line in README.md.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = [README, ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# headings (## level) whose python blocks must run, by their start
RUNNABLE = ("Quickstart", "Coming from the DSA article")
EXPECTED = ("Quickstart: dsa_core", "Quickstart: PyTorch", "Quickstart: JAX",
            "Coming from the DSA article")
# files a user of the repository does not have, and the old name of the algorithm reference
FORBIDDEN = ("shared/", "spec §", "STYLE.md", "STORAGE.md", "ANCHORS.md", "ALGORITHMS.md")
MAX_README_LINES = 250


def python_blocks(path: Path) -> list[tuple[str, int, str]]:
    """``(heading, first code line, code)`` for every ```python block of ``path``."""
    blocks, heading, buf, start = [], "", None, 0
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if buf is not None:
            if line.strip() == "```":
                blocks.append((heading, start, "\n".join(buf) + "\n"))
                buf = None
            else:
                buf.append(line)
        elif line.startswith("## "):
            heading = line[3:].strip()
        elif line.strip() == "```python":
            buf, start = [], lineno + 1
    assert buf is None, f"{path.name}: unterminated ```python block from line {start}"
    return blocks


def quickstart_blocks() -> list[tuple[str, int, str]]:
    return [b for b in python_blocks(README) if b[0].startswith(RUNNABLE)]


QUICKSTARTS = quickstart_blocks()


def _imports(code: str, module: str) -> bool:
    """Whether an import line of ``code`` names ``module`` (``import jax``, ``from adapters
    import jax``, ``from adapters.torch import ...``)."""
    return any(re.match(r"\s*(import|from)\s", line) and re.search(rf"\b{module}\b", line)
               for line in code.splitlines())


@pytest.mark.parametrize(
    ("heading", "lineno", "code"), QUICKSTARTS,
    ids=[f"{h} (line {n})" for h, n, _ in QUICKSTARTS])
def test_quickstart_block_runs(heading, lineno, code, tmp_path, monkeypatch):
    for module in ("torch", "jax"):
        if _imports(code, module):
            pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    # pad with newlines so that tracebacks give README.md's own line numbers
    compiled = compile("\n" * (lineno - 1) + code, str(README), "exec")
    try:
        exec(compiled, {"__name__": "__readme__"})
    except Exception:
        pytest.fail(f"README.md block under '## {heading}' (line {lineno}) failed:\n"
                    f"{traceback.format_exc()}", pytrace=False)


def test_every_quickstart_has_code():
    headings = [h for h, _, _ in QUICKSTARTS]
    missing = [e for e in EXPECTED if not any(h.startswith(e) for h in headings)]
    assert not missing, f"README.md has no runnable python block under: {missing}"


def test_readme_is_a_landing_page():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, (f"README.md has {n} lines (at most {MAX_README_LINES}); "
                                   "move details into docs/")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(p.relative_to(ROOT)) for p in DOCS])
def test_doc_links_resolve(doc):
    text = doc.read_text()
    bad = [s for s in FORBIDDEN if s in text]
    assert not bad, f"{doc.relative_to(ROOT)} mentions {bad}: files a user does not have"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):  # http(s), mailto
            continue
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to nothing: {broken}"
