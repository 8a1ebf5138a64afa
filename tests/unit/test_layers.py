"""The package's layers, read from the source (ast): every import counts, at the top of a file, inside a
function or under TYPE_CHECKING. Layers point down (DESIGN.md): the run (pipeline/run/, commands.py) ->
objectives -> (train, eval, data, model) -> (remote, dist, signals, config); no import closes a loop, none
climbs a layer, no module imports another's private names, and no file is longer than a reader can hold."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pipeline"
MAX_LINES = 450

RUN = ("pipeline.run", "pipeline.commands")
# (the modules, what they may not import): each rule a layer that must not climb.
RULES = [
    (("pipeline.data", "pipeline.train"), ("pipeline.objectives", *RUN)),
    (("pipeline.model", "pipeline.eval"), ("pipeline.objectives", "pipeline.train", *RUN)),
    (("pipeline.objectives",), RUN),
]
BOTTOM = "pipeline.remote"  # imports nothing of the package but itself


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path) -> list[tuple[str, str, int]]:
    """(module imported, name imported from it or "", line) for every import in the file, anywhere in it.
    `from pkg import sub` where pkg.sub is a module is an import of that module, not of pkg's __init__."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.append((sub, "", node.lineno) if sub in MODULES else (base, alias.name, node.lineno))
    return [x for x in out if x[0] == "pipeline" or x[0].startswith("pipeline.")]


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
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
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_in_functions_and_under_type_checking(tmp_path):
    """The reader itself: an import inside a function, one under TYPE_CHECKING and a relative one all count."""
    src = tmp_path / "x.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.run import trainer\n"
                   "def f():\n    from ..objectives import base\n    from . import tario\n")
    found = {m for m, _, _ in imports("pipeline.data.x", src)}
    assert {"pipeline.run.trainer", "pipeline.objectives.base", "pipeline.data.tario"} <= found
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = {name: {m for m, _, _ in found if m in MODULES} for name, found in GRAPH.items()}
    assert not cycles(graph), "import cycles (counting imports in functions and under TYPE_CHECKING)"


@pytest.mark.parametrize("modules,forbidden", RULES, ids=lambda x: "+".join(p.rpartition(".")[2] for p in x))
def test_no_layer_imports_one_above_it(modules, forbidden):
    climbs = [f"{name}:{line} imports {target}" for name, found in GRAPH.items() if within(name, modules)
              for target, _, line in found if within(target, forbidden)]
    assert not climbs


def test_remote_is_the_bottom():
    above = [f"{name}:{line} imports {target}" for name, found in GRAPH.items() if within(name, (BOTTOM,))
             for target, _, line in found if not within(target, (BOTTOM,))]
    assert not above


def test_no_module_imports_another_modules_private_names():
    private = [f"{name}:{line} imports {what} from {target}" for name, found in GRAPH.items()
               for target, what, line in found if what.startswith("_") and target != name]
    assert not private


def test_no_file_is_longer_than_a_reader_can_hold():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"
