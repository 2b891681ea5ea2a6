"""The source layout of ``src/ramflow`` (issue 13): imports run one way, files stay short."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ramflow"
MAX_LINES = 800


def _module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str], root: Path = SRC) -> set[str]:
    """The modules in ``known`` that ``path`` (under ``root``) imports, at any place in the
    file (imports under ``TYPE_CHECKING`` and inside functions included)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target in known:
                out.add(target)
            for alias in node.names:  # ``from . import api`` imports the module api
                if f"{target}.{alias.name}" in known:
                    out.add(f"{target}.{alias.name}")
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the ramflow modules it imports. A package's ``__init__`` is left out:
    importing any submodule runs it, so it would close a trivial cycle with every
    submodule it re-exports."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    packages = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}
    modules = set(files) - packages
    return {m: _imports(files[m], modules) - {m} for m in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_find_cycle_finds_a_type_only_cycle(tmp_path):
    """The checker itself: an import under TYPE_CHECKING closes a cycle too."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    pkg = tmp_path / "ramflow"
    pkg.mkdir()
    (pkg / "_low.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ._high import X\n"
    )
    (pkg / "_high.py").write_text("from ._low import Y\n")
    known = {"ramflow._low", "ramflow._high"}
    graph = {m: _imports(pkg / f"{m.split('.')[1]}.py", known, tmp_path) for m in known}
    assert find_cycle(graph) == ["ramflow._high", "ramflow._low", "ramflow._high"]


def test_no_import_cycle_in_ramflow():
    graph = import_graph()
    assert "ramflow._engine" in graph and graph["ramflow._engine"]  # the parser sees imports
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


@pytest.mark.parametrize("part", ["_window", "_host_store", "_stepper", "_gradients"])
def test_engine_parts_import_no_upper_module(part):
    """The parts below the engine never import the engine, the optimizers, the data-parallel
    state or the layers (they name them through ``ramflow._interfaces``)."""
    upper = {"ramflow._engine", "ramflow.optim", "ramflow._dist", "ramflow._linear", "ramflow.api"}
    assert not import_graph()[f"ramflow.{part}"] & upper


def test_no_source_file_over_the_limit():
    long = {
        str(p.relative_to(SRC)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"
