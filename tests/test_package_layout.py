"""The package's floors: no module of model/ imports, at any depth and from anywhere in it (function bodies
included), a module that imports it back."""

from __future__ import annotations

import ast
from pathlib import Path

MODEL = Path(__file__).resolve().parents[1] / "model"


def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in MODEL.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name in mods:
        deps: set[str] = set()
        for node in ast.walk(ast.parse((MODEL / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("clover_batch.model."):
                deps.add(node.module.split(".")[2])
        graph[name] = deps & mods - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def test_no_import_circle_in_the_model_package():
    graph = _graph()
    assert {"engine", "slots", "state", "layers", "pages"} <= graph.keys()
    assert "state" in graph["slots"] and "slots" not in graph["state"]  # the circle issue 36 named, gone
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []
