"""Kiln's layering: no import cycle between modules or between packages, and each package imports only the
packages below it (docs/architecture.md lists them). Every import counts: module-level, function-local, and those
under `if TYPE_CHECKING:`, because a cycle hidden behind a local import is still a cycle in the design."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "kiln"

# Lowest first. A package (or top-level module) may import the ones before it, never those after it.
LAYERS = [
    "core",
    "platform",
    "distributed",
    "sampling_params",
    "layers",
    "models",
    "loader",
    "text",
    "structured",
    "config_compat",
    "config",
    "memory",
    "runner",
    "speculative",
    "scheduler",
    "engine",
    "server",
    "plan",
    "wait",
    "bench",
    "cli",
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def kiln_modules() -> dict[str, Path]:
    return {module_name(p): p for p in ROOT.rglob("*.py")}


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The Kiln modules `name` imports anywhere in its body. `from a.b import c` counts as importing a.b.c when c
    is a module, else a.b; relative imports are resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = kiln_modules()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def layer_of(module: str) -> str:
    """`kiln.memory.ledger` -> memory; `kiln.plan` -> plan; the root package `kiln` -> kiln."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kiln"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node, or with a self-edge (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = defaultdict(set)
    for source, targets in graph.items():
        for target in targets:
            if layer_of(source) != layer_of(target):
                packages[layer_of(source)].add(layer_of(target))
    return packages


def test_no_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_cycle_between_packages():
    assert cycles(package_graph(import_graph())) == []


def test_every_package_is_placed_in_a_layer():
    placed = set(LAYERS) | {"kiln"}
    assert {layer_of(m) for m in kiln_modules()} <= placed


def test_each_package_imports_only_packages_below_it():
    rank = {name: i for i, name in enumerate(LAYERS)}
    rank["kiln"] = len(LAYERS)  # the root package (kiln.Engine) sits on top
    upward = sorted(
        f"{source} imports {target}"
        for source, targets in import_graph().items()
        for target in targets
        if rank[layer_of(target)] > rank[layer_of(source)]
    )
    assert upward == []


def test_core_imports_nothing_else_of_kiln():
    graph = import_graph()
    assert {
        t for m, ts in graph.items() if layer_of(m) == "core" for t in ts if layer_of(t) != "core"
    } == set()


# ------------------------------------------------------------------------------ the checker itself


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    def make(files: dict[str, str]) -> dict[str, set[str]]:
        root = tmp_path / "kiln"
        for rel, text in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
        return import_graph()

    return make


def test_a_cycle_behind_a_function_local_import_is_found(fake_tree):
    graph = fake_tree(
        {
            "__init__.py": "",
            "a/__init__.py": "",
            "a/x.py": "from kiln.b.y import f\n",
            "b/__init__.py": "",
            "b/y.py": "def f():\n    from kiln.a import x\n",
        }
    )
    assert cycles(graph) == [["kiln.a.x", "kiln.b.y"]]
    assert cycles(package_graph(graph)) == [["a", "b"]]


def test_a_cycle_behind_type_checking_and_relative_imports_is_found(fake_tree):
    graph = fake_tree(
        {
            "__init__.py": "",
            "m/__init__.py": "",
            "m/p.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .q import Q\n",
            "m/q.py": "from . import p\n",
        }
    )
    assert cycles(graph) == [["kiln.m.p", "kiln.m.q"]]
