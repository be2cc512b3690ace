"""No import cycle among the storage node's modules (kvpool.server, issue 24): each module's
imports of another kvpool.server module, wherever they are (top level, inside a function,
under TYPE_CHECKING), read from the source with ast, form a graph without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool.server

PACKAGE = "kvpool.server"
ROOT = Path(kvpool.server.__file__).parent


def server_imports(path: Path, modules: set[str]) -> set[str]:
    """The kvpool.server modules ``path`` imports (absolute or relative, any scope)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from . import x / from .x import y
                base = ".".join([PACKAGE, base] if base else [PACKAGE])
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found.update(name for name in names if name in modules)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {f"{PACKAGE}.{p.stem}": p for p in ROOT.glob("*.py") if p.stem != "__init__"}
    return {name: server_imports(path, set(files)) - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_checker_finds_a_cycle_and_reads_every_kind_of_import(tmp_path: Path) -> None:
    mods = {f"{PACKAGE}.{n}" for n in ("a", "b", "c")}
    (tmp_path / "a.py").write_text("from kvpool.server.b import X\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from . import c\n")
    (tmp_path / "c.py").write_text("def f():\n    import kvpool.server.a\n")
    graph = {f"{PACKAGE}.{n}": server_imports(tmp_path / f"{n}.py", mods) for n in "abc"}
    assert graph == {f"{PACKAGE}.a": {f"{PACKAGE}.b"}, f"{PACKAGE}.b": {f"{PACKAGE}.c"},
                     f"{PACKAGE}.c": {f"{PACKAGE}.a"}}
    assert find_cycle(graph) == [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a"]
    graph[f"{PACKAGE}.c"] = set()
    assert find_cycle(graph) is None


def test_no_import_cycle_among_the_node_modules() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.connection" in graph and f"{PACKAGE}.store" in graph
    assert graph[f"{PACKAGE}.node"] >= {f"{PACKAGE}.connection", f"{PACKAGE}.store"}
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"
