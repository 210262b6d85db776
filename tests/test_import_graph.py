"""The package's modules import one another in one direction: no cycle.

The graph is read from the sources with `ast`, without importing anything: an edge for every
import of a specserve module, at module level or inside a function (a lazy import that closes a
cycle only hides it until that function runs), but not under `if TYPE_CHECKING:`. Importing
a.b.c runs the packages a and a.b first, so it is an edge to them as well (but for the
importer's own packages, which have started already). Imports by a computed name
(`importlib.import_module`, the CLI's benchmarks) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specserve"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_nodes(node: ast.AST):
    """Every Import and ImportFrom under node, but for the bodies of `if TYPE_CHECKING:`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from import_nodes(ast.Module(body=[stmt], type_ignores=[]))
        else:
            yield from import_nodes(child)


def _ancestors(name: str):
    while "." in name:
        name = name.rpartition(".")[0]
        yield name


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import} over the package at root."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = set(_ancestors(name))
        edges: dict[str, int] = {}
        for node in import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            for target in targets:
                while target and target not in paths:  # a name inside a module: the module
                    target = target.rpartition(".")[0]
                if not target:
                    continue  # not ours
                for module in (target, *(p for p in _ancestors(target) if p not in own)):
                    if module != name:
                        edges.setdefault(module, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) -> {b}" for a, b in zip(cycle, cycle[1:]))


def test_the_package_imports_in_one_direction():
    graph = import_graph()
    assert len(graph) > 50 and "specserve.engine" in graph  # the whole package was read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + describe(cycle, graph)


def test_a_cycle_is_found_wherever_its_imports_are(tmp_path):
    """A lazy import inside a function closes a cycle as well; one under TYPE_CHECKING does
    not; a relative import and the packages an import runs first are edges too."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import os\nfrom pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                      "    from pkg import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b": 2, "pkg.sub": 2} and find_cycle(graph) is None
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    graph = import_graph(pkg)
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.a"]
    assert "pkg.a (line 2) -> pkg.sub.b" in describe(find_cycle(graph), graph)
    (pkg / "sub" / "b.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("import pkg.a\n")  # a runs sub/__init__ first
    assert find_cycle(import_graph(pkg)) == ["pkg.a", "pkg.sub", "pkg.a"]
