"""No import cycle between modules of src/ddtree at module level.

The graph: every module under src/ddtree, ast-parsed; an edge for each top-level ``import ddtree...`` /
``from ddtree... import name`` (``name`` resolved to a submodule when it is one, else the module itself).
Decided: imports inside functions and under ``if TYPE_CHECKING:`` are not edges. Python runs them after both
modules are loaded, so they cannot fail at import time; they are the accepted way to keep a heavy dependency lazy
(``ddtree.engine`` imports the engine on first use). Cycles among them that remain (lab.client <-> lab.engines,
lab.sweep.grid <-> profiles, cells <-> runner) are design debt, not import failures.
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


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only (see the docstring)
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


def test_src_ddtree_has_no_module_level_import_cycle():
    modules = _modules()
    assert "ddtree.engine.scheduler" in modules
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # the graph really was built
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
