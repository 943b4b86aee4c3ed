"""The package's import graph: no circle, counting imports written inside functions, and none of
fxacct's own modules imported inside a function (they are only for optional dependencies). The
layer order itself is pyproject's import-linter contract, which CI runs (`lint-imports`)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fxacct"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]):
    """(imported fxacct module, inside a function?) for every import statement of the file."""
    tree = ast.parse(path.read_text())  # every import counts, one under TYPE_CHECKING too
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    inside = {id(sub) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
              for sub in ast.walk(fn)}
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name in modules and name != here:
                yield name, id(node) in inside


def _graph():
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {_module(f) for f in files}
    graph, in_functions = nx.DiGraph(), []
    for f in files:
        for target, in_function in _imports(f, modules):
            graph.add_edge(_module(f), target)
            if in_function:
                in_functions.append(f"{_module(f)} -> {target}")
    return graph, in_functions


def test_no_import_circle_counting_function_level_imports():
    graph, _ = _graph()
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert circles == []
    assert graph.number_of_edges() > 100  # the walk saw the package's imports (a broken walk sees none)


def test_no_fxacct_module_is_imported_inside_a_function():
    assert _graph()[1] == []


def test_the_walk_finds_a_circle_and_a_function_level_import(tmp_path, monkeypatch):
    """The checks above can fail: a two-module package importing each other, one inside a function."""
    pkg = tmp_path / "fxacct"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from fxacct.b import g\n" + "\n".join(f"from fxacct import m{i}" for i in range(101)))
    (pkg / "b.py").write_text("def g():\n    from fxacct.a import x\n")
    for i in range(101):
        (pkg / f"m{i}.py").write_text("")
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "PACKAGE", pkg)
    monkeypatch.setattr(__import__(__name__, fromlist=["x"]), "ROOT", tmp_path)
    graph, inside = _graph()
    assert [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1] == [["fxacct.a", "fxacct.b"]]
    assert inside == ["fxacct.b -> fxacct.a"]
