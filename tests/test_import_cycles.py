"""No import cycle between modules of src/ddtree, counting imports inside functions too.

The graph: every module under src/ddtree, ast-parsed; an edge for each ``import ddtree...`` /
``from ddtree... import name`` anywhere in the module, at module level or inside a function or class (``name``
resolved to a submodule when it is one, else the module itself). Only imports under ``if TYPE_CHECKING:`` are not
edges: they never run. A function-level import cannot fail at import time, but a cycle through one is still two
modules that each need the other, which is the design debt this test keeps out; a lazy import that only defers a
heavy dependency (``ddtree.engine`` loading the engine on first use) is fine as long as it makes no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddtree

ROOT = Path(ddtree.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("ddtree", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` or ``if typing.TYPE_CHECKING:``."""
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of ``tree`` at any depth, except in the body of an ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif _is_type_checking(node):
            todo.extend(node.orelse)  # the else branch runs
        else:
            todo.extend(ast.iter_child_nodes(node))
    return found


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in _imports(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("ddtree"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddtree"))
    return {m for m in found if m in modules and m != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None (depth-first search, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_are_edges_and_type_checking_ones_are_not(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ddtree.errors import ConfigError\n"
        "def f():\n    from ddtree.lab import client\n    import ddtree.version\n"
        "class C:\n    def g(self):\n        from ddtree.lab.engines import ENGINES\n"
    )
    modules = {"ddtree.errors": source, "ddtree.lab": source, "ddtree.lab.client": source,
               "ddtree.lab.engines": source, "ddtree.version": source}
    assert _edges("ddtree.m", source, modules) == {"ddtree.lab.client", "ddtree.version", "ddtree.lab.engines"}


def test_src_ddtree_has_no_import_cycle():
    modules = _modules()
    assert "ddtree.engine.scheduler" in modules
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the graph really was built
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
