"""The package layers: imports flow one way, and no module imports itself back.

Read from the source with ``ast`` (function-level and TYPE_CHECKING imports count
too), so a lazy import cannot hide a cycle or an upward dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "editkit"

#: Bottom to top. A module may import its own package and any package of a lower layer, nothing else.
#: "" is editkit/__init__.py.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"", "_compat", "errors", "settings", "util"}),
    frozenset({"core"}),
    frozenset({"bank", "train", "models"}),
    frozenset({"merge", "data"}),
    frozenset({"eval"}),
    frozenset({"integrations"}),
    frozenset({"scenario"}),
    frozenset({"io"}),
    frozenset({"runs"}),
    frozenset({"cli"}),
    frozenset({"__main__"}),
)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    """editkit modules ``path`` imports (resolved to the longest known module name)."""
    is_package = path.name == "__init__.py"
    anchor_parts = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = node.module or ""
            if node.level:
                base = anchor_parts[: len(anchor_parts) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            names = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    known = set(files)
    graph = {m: _imports(p, m, known) for m, p in files.items()}
    # a package's __init__ re-exporting its own submodules is its face, not a dependency
    return {m: {d for d in deps if not (files[m].name == "__init__.py" and d.startswith(m + "."))}
            for m, deps in graph.items()}


def _area(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(area: str) -> int:
    for index, layer in enumerate(LAYERS):
        if area in layer:
            return index
    raise AssertionError(f"package editkit.{area} is in no layer: add it to LAYERS in {Path(__file__).name}")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
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
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, deps in sorted(graph.items()):
        area = _area(module)
        for dep in sorted(deps):
            dep_area = _area(dep)
            if dep_area != area and _layer(dep_area) >= _layer(area):
                wrong.append(f"{module} imports {dep} (layer {_layer(area)} -> {_layer(dep_area)})")
    return wrong


def test_imports_flow_down_the_layers():
    assert layer_violations(import_graph()) == []


@pytest.mark.parametrize("importer, imported", [("editkit.core.taujp", "editkit.train.runtime"),
                                                ("editkit.bank.store", "editkit.models.clip"),
                                                ("editkit.data.tasks", "editkit.eval.accuracy")])
def test_layer_rule_refuses_upward_and_sideways_imports(importer, imported):
    assert len(layer_violations({importer: {imported}})) == 1
    assert layer_violations({imported: {importer}}) == [] or _layer(_area(imported)) == _layer(_area(importer))


def test_every_package_has_a_layer():
    for module in import_graph():
        _layer(_area(module))
