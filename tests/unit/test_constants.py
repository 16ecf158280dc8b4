"""Each constant once: byte units come from memory/units.py, the exit statuses eyrie gives
meaning to (failed, bad input, interrupted) from contract/exits.py, an attempt's engine name
from run/layout.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pipeline"
UNITS = PACKAGE / "memory" / "units.py"
# Standard library only (it starts by the hundred during a build) and a stand-in for nvcc: its
# exit statuses are nvcc's, read by ninja, not an eyrie command's.
NVCC_WRAPPER = PACKAGE / "compile" / "nvcc_wrapper.py"
BYTE_UNITS = {1024**k for k in range(2, 5)}
EXIT_STATUSES = ("EXIT_FAILED", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED")
INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for Ctrl-C


def _modules(*skip: Path) -> list[tuple[Path, ast.Module]]:
    return [(p, ast.parse(p.read_text(), str(p))) for p in sorted(PACKAGE.rglob("*.py")) if p not in skip]


def _int(node: ast.AST) -> int | None:
    return node.value if isinstance(node, ast.Constant) and type(node.value) is int else None


def _byte_unit(node: ast.AST) -> bool:
    """``1024 * 1024``, ``1024**2``, ``2**30``, ``1 << 20``, or a product with a literal 1024."""
    if not isinstance(node, ast.BinOp):
        return False
    left, right = _int(node.left), _int(node.right)
    if isinstance(node.op, ast.Mult) and 1024 in (left, right):
        return True
    if left is None or right is None:
        return False
    ops = {ast.Pow: lambda a, b: a**b, ast.LShift: lambda a, b: a << b, ast.Mult: lambda a, b: a * b}
    compute = ops.get(type(node.op))
    return compute is not None and right < 64 and compute(left, right) in BYTE_UNITS


def _exit_values(node: ast.AST) -> list[ast.AST]:
    """What ``node`` ends with: a ``return``'s value, the status of ``typer.Exit(…)`` or ``sys.exit(…)``."""
    if isinstance(node, ast.Return):
        return [] if node.value is None else [node.value]
    if isinstance(node, ast.Call) and node.args:
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return [node.args[0]] if name in ("Exit", "exit") else []
    return []


def _assigned(node: ast.AST) -> list[ast.AST]:
    """The names ``node`` assigns: ``A = B = 1`` and ``A: int = 1`` alike."""
    if isinstance(node, ast.Assign):
        return node.targets
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def _exits_2(node: ast.AST) -> bool:
    """``return 2``, ``raise typer.Exit(2)``, ``sys.exit(2)``."""
    return any(_int(value) == 2 for value in _exit_values(node))


def _exits_interrupted(node: ast.AST) -> bool:
    """A literal 130 anywhere in what ``node`` returns, exits with or assigns: ``return 130``, but also
    ``{CANCELLED: 130}.get(state, 1)`` and ``STOPPED = 130``, as a second name for it would be."""
    values = _exit_values(node)
    if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
        values = [node.value]
    return any(_int(inner) == INTERRUPTED for value in values for inner in ast.walk(value))


def test_byte_units_are_defined_in_memory_units_only():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)} (use KIB, MIB, GIB or TIB)"
        for path, tree in _modules(UNITS)
        for node in ast.walk(tree)
        if _byte_unit(node)
    ]
    assert not found, "\n".join(found)


def test_bad_input_exits_through_the_one_exit_status():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)} (use EXIT_BAD_INPUT)"
        for path, tree in _modules(NVCC_WRAPPER)
        for node in ast.walk(tree)
        if _exits_2(node)
    ]
    assert not found, "\n".join(found)


def test_an_interrupted_command_exits_through_the_one_exit_status():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {ast.unparse(node)} (use EXIT_INTERRUPTED)"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if _exits_interrupted(node)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("name", EXIT_STATUSES)
def test_each_exit_status_is_defined_once_beside_the_step_contract(name):
    definitions = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if any(getattr(target, "id", "") == name for target in _assigned(node))
    ]
    assert len(definitions) == 1 and definitions[0].startswith("pipeline/contract/exits.py:"), definitions


def test_an_attempts_engine_name_is_made_in_one_place():
    made = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
        for path, tree in _modules()
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)
        and isinstance(node.values[0], ast.Constant)
        and node.values[0].value == "eyrie-"
    ]
    assert len(made) == 1 and made[0].startswith("pipeline/run/layout.py:"), made
