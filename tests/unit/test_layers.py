"""DESIGN.md's layers, read from the imports: arrows point down only, a step knows nothing about
executors, and an executor nothing about steps; no import circle, and no function longer than a
reader holds at once."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"

# What each layer may import of ours, besides itself.
ALLOWED = {
    "memory": set(),
    "run": {"memory"},
    "compile": {"run", "memory"},
    "steps": {"run", "memory"},
    "report": {"run", "memory"},
}
# All a step needs of run/: the contract with whatever runs it, and where the run keeps its state.
STEP_SIDE_OF_RUN = {"pipeline.run.step_contract", "pipeline.run.layout"}


def imports(path: Path) -> set[str]:
    """The modules of ours that ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] == "pipeline"}


def layer_files(layer: str) -> list[Path]:
    return sorted((PACKAGE / layer).rglob("*.py"))


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    wrong = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in layer_files(layer)
        for name in sorted(imports(path))
        if name.split(".")[1:2] and name.split(".")[1] not in ALLOWED[layer] | {layer}
    ]
    assert not wrong, "\n".join(wrong)


def test_steps_know_nothing_about_executors():
    wrong = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in layer_files("steps")
        for name in sorted(imports(path))
        if name.startswith("pipeline.run") and name not in STEP_SIDE_OF_RUN
    ]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path, monkeypatch):
    """The checks above pass only because the imports are right, not because they read nothing."""
    fake = tmp_path / "pipeline"
    (fake / "memory").mkdir(parents=True)
    (fake / "memory" / "bad.py").write_text("def f():\n    from pipeline.run.ledger import Ledger\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="pipeline/memory/bad.py imports pipeline.run.ledger"):
        test_a_layer_imports_only_the_layers_below_it("memory")


def step_packages() -> list[str]:
    """The steps: the folders of steps/ with a command of their own (what they share sits beside them)."""
    return sorted(p.parent.name for p in (PACKAGE / "steps").glob("*/cli.py"))


def test_a_step_shares_through_steps_not_through_another_step():
    """A step's modules import no other step's, and what the steps share imports none."""
    steps = step_packages()
    assert {"prep", "generate", "tokenize", "train", "accept"} <= set(steps)

    def step_of(name: str) -> str | None:
        parts = name.split(".")
        return parts[2] if parts[1:2] == ["steps"] and parts[2:3] and parts[2] in steps else None

    wrong = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in layer_files("steps")
        for name in sorted(imports(path))
        if step_of(name) and step_of(name) != step_of(".".join(path.relative_to(PACKAGE.parent).parts))
    ]
    assert not wrong, "\n".join(wrong)


def modules() -> dict[str, set[str]]:
    """Each module of ours by its dotted name (a package by its own), with the modules of ours it imports."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = imports(path)
    return found


def circle_through(start: str, graph: dict[str, set[str]]) -> tuple[str, ...] | None:
    """The shortest chain of imports that leads from ``start`` back to it, begun at its first module
    in order (so that each circle reads one way); None when there is none."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        reached = []
        for module in frontier:
            for name in sorted(graph[module] & graph.keys()):
                if name == start:  # back: start, …, module
                    chain = [module]
                    while chain[-1] != start:
                        chain.append(came_from[chain[-1]])
                    circle = chain[::-1]
                    first = circle.index(min(circle))
                    return tuple(circle[first:] + circle[:first])
                if name not in came_from:
                    came_from[name] = module
                    reached.append(name)
        frontier = reached
    return None


def test_no_import_circle_among_our_modules():
    """No module leads back to itself through what it imports, at the top or inside a function."""
    graph = modules()
    circles = {circle for start in graph if (circle := circle_through(start, graph))}
    assert not circles, "\n".join(" -> ".join((*c, c[0])) for c in sorted(circles))


LONGEST_FUNCTION = 80  # lines: what a reader holds at once


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = node.end_lineno - node.lineno + 1
                if length > LONGEST_FUNCTION:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_function_is_longer_than_a_reader_holds():
    assert not long_functions(PACKAGE), "\n".join(long_functions(PACKAGE))


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(LONGEST_FUNCTION))
    (tmp_path / "pkg" / "long.py").write_text(f"def long():\n{body}\n")
    assert long_functions(tmp_path / "pkg") == [f"pkg/long.py:1 long: {LONGEST_FUNCTION + 1} lines"]
