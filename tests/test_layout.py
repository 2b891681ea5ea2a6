"""The package's folders are its architecture: each imports only the folders below it.

``LAYERS`` is the order, bottom first; ``docs/design.md`` opens with the same list. A module
may import modules of its own layer (no cycle among them) and of any layer below, never one
above, not even for a type hint under ``TYPE_CHECKING`` or inside a function.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "ramflow"

# Bottom first. A folder's name stands for every module in it; a root module is named whole.
LAYERS: list[tuple[str, ...]] = [
    ("ramflow.sizes", "ramflow._quiet", "ramflow.choices"),
    ("ramflow.kernels",),
    ("ramflow.formats",),
    ("ramflow.units",),
    ("ramflow.io",),
    ("ramflow.transfer",),
    ("ramflow.planner",),
    ("ramflow.activations",),
    ("ramflow.engine",),
    ("ramflow.layers",),
    ("ramflow.optim",),
    ("ramflow.distributed",),
    ("ramflow.api", "ramflow.helpers"),
    ("ramflow.memory",),
    ("ramflow",),  # the package's __init__: the public surface
    ("ramflow.compat",),
    ("ramflow.train",),
    ("ramflow.cli", "ramflow.__main__", "ramflow.build_kernels"),
]
MAX_ROOT_MODULES = 10


def module_name(path: Path, root: Path = SRC) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str], root: Path = SRC) -> set[str]:
    """The modules in ``known`` that ``path`` (under ``root``) imports, at any place in the
    file (imports under ``TYPE_CHECKING`` and inside functions included)."""
    name = module_name(path, root)
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


def import_graph(package: Path = PACKAGE, root: Path = SRC) -> dict[str, set[str]]:
    """Module (packages' ``__init__`` included) -> the ramflow modules it imports."""
    files = {module_name(p, root): p for p in package.rglob("*.py")}
    known = set(files)
    return {m: imports_of(files[m], known, root) - {m} for m in known}


def layer_of(module: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    """The index in ``layers`` of the longest name that is ``module`` or a folder above it
    (the package itself, ``ramflow``, stands for its ``__init__`` alone)."""
    best, best_len = -1, -1
    for i, names in enumerate(layers):
        for n in names:
            inside = "." in n and module.startswith(n + ".")
            if (module == n or inside) and len(n) > best_len:
                best, best_len = i, len(n)
    if best < 0:
        raise LookupError(f"{module} is in no layer of tests/test_layout.py's LAYERS")
    return best


def upward_imports(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Every import of a module by one in a lower layer, as 'importer -> imported'. A
    package's ``__init__`` may import its own folder's modules (it re-exports them)."""
    bad = []
    for m, deps in graph.items():
        for d in deps:
            if layer_of(d, layers) > layer_of(m, layers):
                bad.append(f"{m} -> {d}")
    return sorted(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None. A
    package's ``__init__`` is left out: importing any submodule runs it, so it would close a
    trivial cycle with every submodule it re-exports."""
    packages = {m for m in graph if any(o.startswith(m + ".") for o in graph)}
    g = {m: deps - packages for m, deps in graph.items() if m not in packages}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(g.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def _write(pkg: Path, name: str, text: str) -> None:
    path = pkg.joinpath(*name.split(".")[1:]).with_suffix(".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in [path.parent, *path.parent.parents]:
        if parent == pkg.parent:
            break
        (parent / "__init__.py").touch()
    path.write_text(text)


def test_the_checker_sees_a_type_only_import_upward_and_a_cycle(tmp_path):
    """The checker itself, on a made-up package: an import under TYPE_CHECKING or inside a
    function counts; a cycle inside one layer is found."""
    pkg = tmp_path / "ramflow"
    _write(
        pkg,
        "ramflow.low.a",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high.b import X\n",
    )
    _write(pkg, "ramflow.high.b", "X = 1\n")
    _write(pkg, "ramflow.high.c", "from .d import Y\n")
    _write(pkg, "ramflow.high.d", "from . import c\n")
    layers = [("ramflow.low",), ("ramflow.high",), ("ramflow",)]
    graph = import_graph(pkg, tmp_path)
    assert upward_imports(graph, layers) == ["ramflow.low.a -> ramflow.high.b"]
    assert find_cycle(graph) == ["ramflow.high.c", "ramflow.high.d", "ramflow.high.c"]
    with pytest.raises(LookupError, match="ramflow.elsewhere"):
        layer_of("ramflow.elsewhere", layers)


def test_every_module_has_a_layer_and_imports_none_above_it():
    graph = import_graph()
    assert graph["ramflow.engine.engine"]  # the parser sees imports
    bad = upward_imports(graph)
    assert not bad, "imports of a higher layer (see LAYERS):\n" + "\n".join(bad)


def test_no_import_cycle_in_ramflow():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_few_modules_at_the_root_and_every_folder_says_what_it_owns():
    root = [p.name for p in PACKAGE.glob("*.py")]
    assert len(root) <= MAX_ROOT_MODULES, sorted(root)
    for init in PACKAGE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and ("May import" in doc or init.parent.name in ("compat",)), init


def test_import_ramflow_loads_no_torch_until_a_name_is_used():
    """``import ramflow`` (and so ``ramflow --help``) stays light: the public names load on
    first use, and then resolve to the objects their modules define."""
    code = (
        "import sys, ramflow\n"
        "assert 'torch' not in sys.modules, 'import ramflow imported torch'\n"
        "from ramflow.api import offload\n"
        "assert ramflow.offload is offload and 'offload' in dir(ramflow)\n"
        "assert ramflow.optim.AdamW.__module__ == 'ramflow.optim.adamw'\n"
        "try:\n    ramflow.no_such_name\nexcept AttributeError:\n    pass\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["train", "--help"], ["plan", "--help"], ["train", "--host-precision", "bogus"]],
    ids=["help", "train-help", "plan-help", "usage-error"],
)
def test_the_command_answers_help_and_usage_errors_without_torch(argv):
    """``ramflow --help``, a command's ``--help`` and a usage error answer before PyTorch
    is imported: the parser reads only ``ramflow.choices`` and ``ramflow.train.presets``.
    ``-X importtime`` lists every module the process imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ramflow", *argv],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == (2 if "bogus" in argv else 0), proc.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "ramflow.cli.main" in imported  # the listing is there to read
    assert "torch" not in imported, sorted(m for m in imported if m.startswith("ramflow"))
    if "bogus" in argv:
        assert "invalid choice: 'bogus'" in proc.stderr


def test_import_ramflow_train_loads_no_torch_until_a_name_is_used():
    """``ramflow.train``'s public names load on first use too (its ``presets`` are read by
    the command's parser), and then resolve to the objects their modules define."""
    code = (
        "import sys, ramflow.train\n"
        "from ramflow.train.presets import PRESETS\n"
        "assert 'torch' not in sys.modules, 'import ramflow.train imported torch'\n"
        "from ramflow.train import TrainConfig\n"
        "assert TrainConfig.__module__ == 'ramflow.train.config'\n"
        "assert ramflow.train.PRESETS is PRESETS and 'train' in dir(ramflow.train)\n"
        "try:\n    ramflow.train.no_such_name\nexcept AttributeError:\n    pass\n"
        "else:\n    raise SystemExit('no AttributeError')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
