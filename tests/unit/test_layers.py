"""DESIGN.md's layers, read from the imports: arrows point down only, every folder and module of
pipeline/ has its place among them, a step knows nothing about executors, and an executor nothing
about steps; no import circle, and no function longer than a reader holds at once."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"

# What each layer may import of ours, besides itself: a folder of pipeline/, or a module beside
# them by its name. Bottom up: the contract is what every layer above memory shares (a step's
# environment, its manifest, atomic files, exit statuses); cli.py is the command line, on top.
ALLOWED = {
    "__init__": set(),  # imported before any module of ours: it may import none
    "memory": set(),
    "contract": {"memory"},
    "run": {"contract", "memory"},
    "compile": {"run", "contract", "memory"},
    "steps": {"contract", "memory"},
    "report": {"run", "contract", "memory"},
    "provision": {"contract"},
    "embedded": {"steps", "contract", "memory"},
    "cli": {"embedded", "provision", "report", "steps", "compile", "run", "contract", "memory"},
}


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
    """A folder layer's modules, or a module layer itself."""
    folder = PACKAGE / layer
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{layer}.py"]


def layers_on_disk() -> set[str]:
    """Every folder of pipeline/ that holds Python, and every module beside them, by its name."""
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    return folders | {p.stem for p in PACKAGE.glob("*.py")}


def test_every_folder_and_module_of_the_package_has_its_layer():
    """A new folder (or module beside them) fails here until its place among the layers is declared."""
    undeclared = sorted(layers_on_disk() - ALLOWED.keys())
    assert not undeclared, f"no layer declared in ALLOWED for pipeline/: {', '.join(undeclared)}"
    gone = sorted(ALLOWED.keys() - layers_on_disk())
    assert not gone, f"ALLOWED declares what pipeline/ no longer has: {', '.join(gone)}"


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_a_layer_imports_only_the_layers_below_it(layer):
    wrong = [
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in layer_files(layer)
        for name in sorted(imports(path))
        if name.split(".")[1:2] and name.split(".")[1] not in ALLOWED[layer] | {layer}
    ]
    assert not wrong, "\n".join(wrong)


def test_the_layers_point_down_only():
    """The table itself has no circle: each layer's allowed imports are declared layers, each below it."""

    def below(layer: str) -> set[str]:
        found, todo = set(), list(ALLOWED[layer])
        while todo:
            if (name := todo.pop()) not in found:
                found.add(name)
                todo.extend(ALLOWED[name])
        return found

    assert all(ALLOWED[layer] <= ALLOWED.keys() and layer not in below(layer) for layer in ALLOWED)


def test_steps_know_nothing_about_executors():
    """A step sees what runs it only through the contract; the runner runs a step as any command."""
    assert "run" not in ALLOWED["steps"] and "steps" not in ALLOWED["run"]


@pytest.mark.parametrize(
    ("layer", "module", "upward"),
    [
        ("memory", "memory/bad.py", "pipeline.run.ledger"),
        ("contract", "contract/bad.py", "pipeline.run.layout"),
        ("steps", "steps/bad.py", "pipeline.run.orchestrator"),
        ("provision", "provision/bad.py", "pipeline.steps.options"),
        ("__init__", "__init__.py", "pipeline.memory"),
    ],
)
def test_the_check_sees_an_upward_import(tmp_path, monkeypatch, layer, module, upward):
    """The checks above pass only because the imports are right, not because they read nothing."""
    fake = tmp_path / "pipeline"
    (fake / module).parent.mkdir(parents=True, exist_ok=True)
    (fake / module).write_text(f"def f():\n    from {upward} import x\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match=f"pipeline/{module} imports {upward}"):
        test_a_layer_imports_only_the_layers_below_it(layer)


def test_the_check_sees_an_undeclared_folder(tmp_path, monkeypatch):
    fake = tmp_path / "pipeline"
    for layer in ALLOWED:
        path = fake / (f"{layer}.py" if (PACKAGE / f"{layer}.py").exists() else f"{layer}/__init__.py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
    (fake / "newcomer").mkdir()
    (fake / "newcomer" / "__init__.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    with pytest.raises(AssertionError, match="no layer declared in ALLOWED for pipeline/: newcomer"):
        test_every_folder_and_module_of_the_package_has_its_layer()


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
