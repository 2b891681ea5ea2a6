"""The package's folders are its architecture: each imports only the folders below it.

``LAYERS`` is the order, bottom first; ``docs/design.md`` opens with the same list. A module
may import modules of its own layer (no cycle among them) and of any layer below, never one
above, not even for a type hint under ``TYPE_CHECKING`` or inside a function.
"""

from __future__ import annotations

import ast
import re
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


# ---------------------------------------------------------------- typed records, honest names
#
# Issue 46, points 5 and 6: values that travel together are a record, not a long signature;
# a Protocol says what a caller may use, so it names no private member; a name one module
# keeps private is not imported by another; the planner's and the engine's entry points say
# what they take and give; dated figures live in docs/ and benchmarks/results/, not in src/.

MAX_PARAMETERS = 12
# "module.function": why it keeps more than MAX_PARAMETERS parameters.
MANY_PARAMETERS: dict[str, str] = {
    "ramflow.api.offload": "the model and twelve independent keyword-only options users "
    "write by name; a record would break their keywords (docs/design.md, 'Records, not long "
    "signatures')",
}
# the entry points whose docstrings must have Args (and Returns, where they return a value),
# besides every public function of the folders in DOCUMENTED_FOLDERS
DOCUMENTED = (
    "ramflow.planner.plan.make_plan",
    "ramflow.planner.predict.predict_step",
    "ramflow.train.loop.run_loop",
    "ramflow.engine.engine.Engine.__init__",
)
DOCUMENTED_FOLDERS = ("ramflow.planner", "ramflow.engine")
# A figure with a date, a results folder, or a timing on a named GPU or "measured".
DATED = re.compile(
    r"\b20\d\d-[01]\d(?:-[0-3]\d)?\b(?!-?\d)"  # 2026-11-22 or 2026-11 (not a range 2023-2024)
    r"|benchmarks/results"
    r"|\b(?:[HAB]\d00|[Mm]easured)\b[^.;]*?\d(?:\.\d+)?\s*(?:ms|GB/s|GiB/s|TFLOP/s|x\b)"
    r"|\d(?:\.\d+)?\s*(?:ms|GB/s|GiB/s|TFLOP/s)\b[^.;]*?\b[HAB]\d00\b"
)
LICENCE = re.compile(r"copyright|licen[cs]e|spdx", re.IGNORECASE)


def _sources(package: Path, root: Path):
    """(module name, path, parsed tree) of every ``.py`` file under ``package``."""
    for path in sorted(package.rglob("*.py")):
        yield module_name(path, root), path, ast.parse(path.read_text(), filename=str(path))


def _functions(tree: ast.AST, prefix: str):
    """(qualified name, node) of every function in ``tree``, methods as ``Class.method``."""
    stack: list[tuple[ast.AST, str]] = [(tree, prefix)]
    while stack:
        node, name = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                yield f"{name}.{child.name}", child
                stack.append((child, f"{name}.{child.name}"))
            elif isinstance(child, ast.ClassDef):
                stack.append((child, f"{name}.{child.name}"))
            else:
                stack.append((child, name))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def long_signatures(package: Path = PACKAGE, root: Path = SRC) -> list[str]:
    """Every function outside ``kernels/`` with more than ``MAX_PARAMETERS`` parameters
    (``self``/``cls`` not counted; ``*args`` and ``**kwargs`` count one each), as
    'module.function N'."""
    out = []
    for module, _, tree in _sources(package, root):
        if module.split(".")[1:2] == ["kernels"]:
            continue
        for name, f in _functions(tree, module):
            a = f.args
            names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
            n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
            n -= bool(names) and names[0] in ("self", "cls")
            if n > MAX_PARAMETERS:
                out.append(f"{name} {n}")
    return sorted(out)


def private_protocol_members(package: Path = PACKAGE, root: Path = SRC) -> list[str]:
    """Every member (method, attribute, property) of a ``typing.Protocol`` whose name is
    private, as 'module.Protocol.member'."""
    out = []
    for module, _, tree in _sources(package, root):
        for cls in ast.walk(tree):
            bases = [
                b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                for b in getattr(cls, "bases", [])
            ]
            if not isinstance(cls, ast.ClassDef) or "Protocol" not in bases:
                continue
            for item in cls.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    name = item.name
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                else:
                    continue
                if _private(name):
                    out.append(f"{module}.{cls.name}.{name}")
    return sorted(out)


def private_imports(package: Path = PACKAGE, root: Path = SRC) -> list[str]:
    """Every private name of one ramflow module that another takes: ``from m import _x``
    or ``m._x`` on a module bound by an import, as 'importer: module._x'. A private module
    (``ramflow._quiet``) may be imported; what it defines privately may not."""
    files = {module_name(p, root) for p in package.rglob("*.py")}
    out = []
    for module, path, tree in _sources(package, root):
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        bound: dict[str, str] = {}  # local name -> ramflow module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in files:
                        bound[alias.asname or alias.name] = f"{target}.{alias.name}"
                    elif target in files and target != module and _private(alias.name):
                        out.append(f"{module}: {target}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in files and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and bound[node.value.id] != module
                and _private(node.attr)
            ):
                out.append(f"{module}: {bound[node.value.id]}.{node.attr}")
    return sorted(set(out))


def missing_args_returns(
    names: tuple[str, ...] = DOCUMENTED, package: Path = PACKAGE, root: Path = SRC
) -> list[str]:
    """Each of ``names`` ('module.function' or 'module.Class.method') whose docstring lacks
    an ``Args:`` section, or a ``Returns:`` (or ``Yields:``) section where the function
    returns a value, as 'name: what is missing'."""
    trees = {m: tree for m, _, tree in _sources(package, root)}
    out = []
    for name in names:
        module = max((m for m in trees if name.startswith(m + ".")), key=len)
        found = dict(_functions(trees[module], module)).get(name)
        if found is None:
            out.append(f"{name}: not found")
            continue
        doc = ast.get_docstring(found) or ""
        if found.name == "__init__":  # a class documents its constructor's arguments
            cls = next(
                c
                for c in ast.walk(trees[module])
                if isinstance(c, ast.ClassDef) and found in c.body
            )
            doc += "\n" + (ast.get_docstring(cls) or "")
        returns = any(
            isinstance(n, ast.Return)
            and n.value is not None
            and not (isinstance(n.value, ast.Constant) and n.value.value is None)
            for n in ast.walk(found)
            if not any(
                n in ast.walk(inner)
                for inner in found.body
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            )
        )
        if not re.search(r"^\s*Args:\s*$", doc, re.MULTILINE):
            out.append(f"{name}: Args")
        if returns and not re.search(r"^\s*(Returns|Yields):", doc, re.MULTILINE):
            out.append(f"{name}: Returns")
    return out


def dated_figures(package: Path = PACKAGE) -> list[str]:
    """Every line of the package's sources (Python, C++) with a dated figure, a results
    path or a timing on a named GPU, as 'path:line: text'; licence headers are left alone."""
    out = []
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".cpp", ".h")):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if DATED.search(line) and not LICENCE.search(line):
                out.append(f"{path.relative_to(package.parent)}:{i}: {line.strip()}")
    return out


def test_the_record_checkers_catch_what_they_forbid(tmp_path):
    """The four checkers below, on a made-up package that breaks each rule once, and keeps
    each rule once where a naive check would cry wolf."""
    pkg = tmp_path / "ramflow"
    many = ", ".join(f"a{i}" for i in range(MAX_PARAMETERS))
    _write(
        pkg,
        "ramflow.engine.part",
        "from typing import Protocol\n"
        "class Opt(Protocol):\n    _depth: int\n    def _holds(self, p): ...\n    def step(self): ...\n"
        f"class C:\n    def method(self, {many}): ...\n"
        f"def wide({many}, *, b): ...\n"
        "def _private_here(): ...\n"
        "def use(): return _private_here()\n",
    )
    _write(pkg, "ramflow.kernels.k", f"def native({many}, b): ...\n_SECRET = 1\n")
    _write(
        pkg,
        "ramflow.planner.plan",
        "from ..kernels.k import _SECRET\nfrom ..kernels import k as _k\nfrom .. import _quiet\n"
        "def make_plan(x):\n"
        '    """Plan.\n\n    Args:\n        x: a thing.\n    """\n'
        "    return x\n"
        "def no_value(x):\n"
        '    """Nothing back.\n\n    Args:\n        x: a thing.\n    """\n'
        "    def inner():\n        return 1\n"
        "    return None\n"
        "def read():\n    return _k._SECRET + _k.native\n",
    )
    _write(pkg, "ramflow._quiet", "# Copyright 2023-2024 someone; licensed MIT\n")
    _write(
        pkg,
        "ramflow.units.notes",
        "# 4 x H100, 2026-11-27: 3.90x one GPU\n"
        "# see benchmarks/results/some-run\n"
        "# 70 ms on an H100\n"
        "# measured at 12.5 GB/s\n"
        "# the bytes autograd saves, measured; a ring of 2 units\n"
        "# Copyright 2024-11 a licence line\n",
    )
    assert long_signatures(pkg, tmp_path) == [
        "ramflow.engine.part.wide 13",
    ]
    assert private_protocol_members(pkg, tmp_path) == [
        "ramflow.engine.part.Opt._depth",
        "ramflow.engine.part.Opt._holds",
    ]
    assert private_imports(pkg, tmp_path) == [
        "ramflow.planner.plan: ramflow.kernels.k._SECRET",
    ]
    names = (
        "ramflow.planner.plan.make_plan",
        "ramflow.planner.plan.no_value",
        "ramflow.planner.plan.read",
    )
    assert missing_args_returns(names, pkg, tmp_path) == [
        "ramflow.planner.plan.make_plan: Returns",
        "ramflow.planner.plan.read: Args",
        "ramflow.planner.plan.read: Returns",
    ]
    assert [line.split(": ", 1)[0] for line in dated_figures(pkg)] == [
        f"ramflow/units/notes.py:{i}" for i in (1, 2, 3, 4)
    ]


def test_no_function_outside_kernels_takes_more_than_12_parameters():
    """More than a handful of values travelling together is a record (a small frozen
    dataclass); the kernels' entry points mirror their C signatures and are exempt."""
    bad = [s for s in long_signatures() if s.split()[0] not in MANY_PARAMETERS]
    assert not bad, "pass a frozen dataclass instead:\n" + "\n".join(bad)
    stale = set(MANY_PARAMETERS) - {s.split()[0] for s in long_signatures()}
    assert not stale, f"MANY_PARAMETERS lists functions that no longer need it: {stale}"


def test_no_protocol_names_a_private_member():
    bad = private_protocol_members()
    assert not bad, "a Protocol is a public contract; make these public:\n" + "\n".join(bad)


def test_no_module_takes_another_module_s_private_name():
    bad = private_imports()
    assert not bad, (
        "make the name public inside the package, or move it where it is used:\n" + "\n".join(bad)
    )


def public_functions(folders: tuple[str, ...], package: Path = PACKAGE, root: Path = SRC):
    """The public module-level functions (with parameters) of the modules under ``folders``."""
    out = []
    for module, _, tree in _sources(package, root):
        if not any(module == f or module.startswith(f + ".") for f in folders):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.FunctionDef)
                and not _private(node.name)
                and (node.args.args or node.args.kwonlyargs or node.args.posonlyargs)
            ):
                out.append(f"{module}.{node.name}")
    return tuple(out)


def test_the_entry_points_document_their_arguments_and_results():
    names = DOCUMENTED + public_functions(DOCUMENTED_FOLDERS)
    assert "ramflow.planner.costs.unit_costs" in names
    bad = missing_args_returns(names)
    assert not bad, "add the docstring sections:\n" + "\n".join(bad)


def test_no_dated_figure_in_the_sources():
    """Dated measurements and results paths belong in docs/ and benchmarks/results/."""
    bad = dated_figures()
    assert not bad, "move these figures to docs/ or benchmarks/results/:\n" + "\n".join(bad)
