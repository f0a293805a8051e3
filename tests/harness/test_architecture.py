"""The shape the README's architecture section promises: small files, no import cycles, source free of lab-notebook prose.

These read the source tree only (no imports of the packages), so they run in a second.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = [ROOT / "packages", ROOT / "apps"]
MAX_LINES = 600

# A date, a numbered session or round of measurement, or the moved performance log: history
# belongs in docs/design/ and docs/history/, not in the code a user reads.
NOTEBOOK = re.compile(
    r"20\d\d-\d\d-\d\d"
    r"|\bsession\b"
    r"|docs/performance\.md"
    r"|\b(first|second|third|\w+th)\s+(round|run|call|pass) of measurement"
    r"|\b(ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth"
    r"|eighteenth|nineteenth|twentieth)\s+(session|round|call|run)\b"
    r"|\b(call|round) \d+\b",
    re.IGNORECASE,
)


def _source_files(*suffixes: str) -> list[Path]:
    return sorted(
        path
        for root in SOURCE_DIRS
        for path in root.rglob("*")
        if path.suffix in suffixes and ".venv" not in path.parts and path.is_file()
    )


def _package_roots() -> list[Path]:
    """``src/<package>`` of every workspace member."""
    return sorted(
        p for root in SOURCE_DIRS for p in root.glob("*/src/*") if (p / "__init__.py").exists()
    )


def _module_name(path: Path, package_root: Path) -> str:
    parts = [package_root.name, *path.relative_to(package_root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, module: str, is_package: bool) -> set[str]:
    """Modules imported at module level (function-level imports are how a lazy edge is made)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    base = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                target = f"{anchor}.{node.module}" if node.module else anchor
            else:
                target = node.module
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _import_graph(package_root: Path) -> dict[str, set[str]]:
    modules = {_module_name(path, package_root): path for path in package_root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        imports = _top_level_imports(path, name, path.name == "__init__.py")
        # An import of a.b.c also runs a and a.b; the edge that matters is the deepest module.
        graph[name] = {m for m in imports if m in modules and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle that does not pass through a package ``__init__`` re-export, or None.

    ``pkg/__init__.py`` importing its submodules and a submodule importing a sibling through the
    package is Python's normal layout, not a cycle a reader has to untangle; edges into a
    package's ``__init__`` are therefore left out.
    """
    packages = {name for name in graph if any(other.startswith(name + ".") for other in graph)}
    edges = {name: {m for m in deps if m not in packages} for name, deps in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_source_file_is_longer_than_a_reader_holds():
    long = {
        str(path.relative_to(ROOT)): n
        for path in _source_files(".py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concern): {long}"


@pytest.mark.parametrize("package_root", _package_roots(), ids=lambda p: p.name)
def test_no_import_cycle_within_a_package(package_root):
    cycle = _cycle(_import_graph(package_root))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle():
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert _cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert _cycle({"p.a": {"p.b"}, "p.b": set()}) is None


def test_source_has_no_dates_sessions_or_numbered_rounds():
    hits = [
        f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
        for path in _source_files(".py", ".md", ".toml")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if NOTEBOOK.search(line)
    ]
    assert not hits, (
        "history belongs in docs/design/ or docs/history/, not in packages/ or apps/:\n"
        + "\n".join(hits)
    )


def test_the_notebook_pattern_catches_what_it_is_for():
    for text in (
        "(2026-11-30)",
        "the tenth session",
        "docs/performance.md",
        "call 7",
        "Round 3",
        "the twelfth round",
        "(twentieth run)",
    ):
        assert NOTEBOOK.search(text), text
    for text in (
        "a sessionless call",
        "recall 7 rows",
        "docs/history/performance.md",
        "a sixteenth of a clock",
    ):
        assert not NOTEBOOK.search(text), text
