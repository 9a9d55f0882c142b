"""The package's modules import only downward, and no two modules import each other, however
indirectly: errors.py at the bottom, then _format/, _tiers/, _loop/, and the public modules on top
(cli.py, hf.py, lightning.py, dcp.py, __init__.py). Every import counts -- at the top of a module,
inside a function, or under TYPE_CHECKING -- since each is a dependency a reader must follow."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

LAYERS = {"errors": 0, "_format": 1, "_tiers": 2, "_loop": 3}  # anything else in the package: the top
TOP = 4
MAX_LINES = 600  # a module past this owns more than one thing: split it by what it owns


def module_names(package: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, names: dict) -> set[str]:
    """The package's modules an import statement in module ``name`` reads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in names}
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in names:  # from . import saving: the module itself
            found.add(f"{source}.{alias.name}")
        elif source in names:
            found.add(source)
    return found


def import_graph(package: Path) -> dict[str, set[str]]:
    names = module_names(package)
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _targets(node, name, path.name == "__init__.py", names)
        # a package's __init__ is imported on the way to any of its modules: not a dependency
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every set of modules that import each other (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(name: str) -> int:
    parts = name.split(".")
    return LAYERS.get(parts[1], TOP) if len(parts) > 1 else TOP


def upward(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a in sorted(graph) for b in sorted(graph[a])
            if layer(b) > layer(a)]


def test_no_two_modules_import_each_other():
    assert cycles(import_graph(ROOT / "tieredckpt")) == []


def test_every_import_goes_downward():
    assert upward(import_graph(ROOT / "tieredckpt")) == []


def test_no_module_has_outgrown_one_thing():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "tieredckpt").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_checks_find_a_circle_through_a_type_checking_import_and_an_upward_import(tmp_path):
    """The checks above would fail on what they guard against: a circle through a TYPE_CHECKING
    import and a function-level one (dcp.py and store.py were one), and a lower layer reaching up."""
    package = tmp_path / "tieredckpt"
    for sub in ("_loop", "_format"):
        (package / sub).mkdir(parents=True)
        (package / sub / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "_loop" / "store.py").write_text("def f():\n    from .dcp import Writer\n")
    (package / "_loop" / "dcp.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from .store import Store\n")
    (package / "_format" / "codec.py").write_text("from .._loop import store\n")
    graph = import_graph(package)
    assert cycles(graph) == [["tieredckpt._loop.dcp", "tieredckpt._loop.store"]]
    assert upward(graph) == ["tieredckpt._format.codec (1) imports tieredckpt._loop.store (3)"]
