"""The product packages' import graph: no circle, and the layers point one way.

    store  ←  engine  ←  publisher  ←  runner

A module may import its own package and the packages to its left, never one to its right, and
no chain of imports may come back to where it started (STYLE.md, "where new code lives").

What counts as an import: every `import` and `from … import` anywhere in a module, read with
`ast` — at module level, inside functions, and inside `if TYPE_CHECKING:` blocks. A function-level
import only defers a circle to the first call, and a `TYPE_CHECKING` import is a circle of
*knowledge* (each module must know the other to be read); both are the coupling this test keeps
out, so both count. What does not count: the implicit import of a parent package
(`engine.sandbox.local` runs `engine/__init__` first), which would make every package a circle
with its own `__init__`; and names in string annotations, which import nothing.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("store", "engine", "publisher", "runner")


@dataclass(frozen=True, slots=True)
class Import:
    target: str
    where: str  # "path:line", for the failure message


def modules(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (file, is a package `__init__`), for every module of `packages`."""
    found: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for file in sorted((root / package).rglob("*.py")):
            parts = list(file.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            found[name] = (file, is_package)
    return found


def _owner(name: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    """The known module that `name` lives in (`store.errors.RunfleetError` → `store.errors`)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, list[Import]]:
    known = modules(root, packages)
    graph: dict[str, list[Import]] = {}
    for name, (file, is_package) in known.items():
        edges: list[Import] = []
        where = file.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(file.read_text(), filename=str(file))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    here = here[: len(here) - node.level + 1]
                    base = ".".join([*here, base] if base else here)
                # `from pkg import sub` imports the submodule when there is one
                targets = [f"{base}.{alias.name}" for alias in node.names]
                targets = [t if t in known else base for t in targets]
            else:
                continue
            for target in targets:
                owner = _owner(target, known)
                if owner is not None and owner != name:
                    edges.append(Import(owner, f"{where}:{node.lineno}"))
        graph[name] = edges
    return graph


def circles(graph: dict[str, list[Import]]) -> list[list[Import]]:
    """One shortest circle per strongly connected group of modules (Tarjan, then a BFS)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(start: str) -> None:  # iterative, so a deep graph cannot hit the recursion limit
        work = [(start, 0)]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, i = work.pop()
            edges = graph[node]
            if i < len(edges):
                work.append((node, i + 1))
                nxt = edges[i].target
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, 0))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                group: set[str] = set()
                while True:
                    member = stack.pop()
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return [_shortest_circle(graph, group) for group in groups]


def _shortest_circle(graph: dict[str, list[Import]], group: set[str]) -> list[Import]:
    start = min(group)
    came: dict[str, list[Import]] = {start: []}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for edge in graph[node]:
            if edge.target == start:
                return [*came[node], edge]
            if edge.target in group and edge.target not in came:
                came[edge.target] = [*came[node], edge]
                queue.append(edge.target)
    raise AssertionError(f"{sorted(group)} is not a strongly connected group")


def upward_imports(graph: dict[str, list[Import]], layers: tuple[str, ...]) -> list[str]:
    rank = {package: i for i, package in enumerate(layers)}
    return [
        f"{edge.where}: {module} imports {edge.target}"
        for module, edges in sorted(graph.items())
        for edge in edges
        if rank[edge.target.split(".")[0]] > rank[module.split(".")[0]]
    ]


def describe(start: str, circle: list[Import]) -> str:
    return start + "".join(f" -> {edge.target} ({edge.where})" for edge in circle)


def test_no_import_circle_among_the_product_modules() -> None:
    graph = import_graph(ROOT, LAYERS)
    assert len(graph) > 50, "the walk found too few modules to be the product packages"
    found = [describe(circle[-1].target, circle) for circle in circles(graph)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_layers_store_engine_publisher_runner_have_no_arrow_pointing_back_up() -> None:
    upward = upward_imports(import_graph(ROOT, LAYERS), LAYERS)
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_the_check_sees_function_level_and_type_checking_imports(tmp_path: Path) -> None:
    """The two import forms a circle hides behind are edges too, and relative imports resolve."""
    (tmp_path / "low").mkdir()
    (tmp_path / "high").mkdir()
    (tmp_path / "low" / "__init__.py").write_text("")
    (tmp_path / "high" / "__init__.py").write_text("")
    (tmp_path / "low" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from low.b import B\n"
    )
    (tmp_path / "low" / "b.py").write_text("def f():\n    from . import a\n")
    (tmp_path / "low" / "c.py").write_text("import high\n")
    graph = import_graph(tmp_path, ("low", "high"))
    assert [describe("low.a", c) for c in circles(graph)] == [
        "low.a -> low.b (low/a.py:3) -> low.a (low/b.py:2)"
    ]
    assert upward_imports(graph, ("low", "high")) == ["low/c.py:1: low.c imports high"]
