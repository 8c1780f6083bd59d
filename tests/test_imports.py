"""Imports run one way: no cycle between any two modules, and each module imports
only its own package (at its layer or below) and packages of lower layers, never
another package of its own layer (see docs/design.md, Import layers). Every import
counts, also those inside functions; generated ``*_pb2`` modules are not checked."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "protos", "protocol", "shards", "transport", "sharder", "clients", "decode", "feeder", "launcher",
            "trainer", "cli", "bench")
# Bottom to top. A module may import its own package and the layers below its own.
LAYERS = {
    "core": 0, "protos": 0,
    "shards": 1, "protocol": 1,
    "transport": 2, "sharder": 2,
    "clients": 3, "decode": 3,
    "feeder": 4,
    "launcher": 5, "trainer": 5,
    "cli": 6,
    "bench": 7,
    "feeder.__main__": 7,  # python -m feeder: an entry point that runs cli's command, imported by nothing
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules imported anywhere in the module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                child = f"{base}.{alias.name}"
                targets.add(child if child in modules else base)
    return {t for t in targets if t in modules and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
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
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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


def _layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rpartition(".")[0]
    return LAYERS[module]


def test_no_import_cycles() -> None:
    assert _cycles(_graph()) == []


@pytest.mark.slow
def test_packages_import_only_downwards() -> None:
    wrong = []
    for module, targets in _graph().items():
        for target in targets:
            same_package = module.split(".")[0] == target.split(".")[0]
            if _layer(target) > _layer(module) or (not same_package and _layer(target) == _layer(module)):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_the_checker_sees_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_decode_engine_imports_nothing_of_the_daemon() -> None:
    upward = sorted(f"{module} -> {target}" for module, targets in _graph().items() if module.startswith("decode.")
                    for target in targets if target.split(".")[0] == "feeder")
    assert upward == []
