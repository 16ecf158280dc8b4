"""A real run for the report's tests: a server holding memory, and jobs that die beside it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eyrie_testing import REPO, eyrie

SCENARIO = REPO / "tests" / "scenarios" / "scenario.py"

# The incident behind eyrie, replayed small: a server holds its memory while jobs run beside it;
# one writes all its output and aborts at teardown, one segfaults, and one really runs out.
NEIGHBOURS = """
name: neighbours
steps:
  - name: server
    command: [PYTHON, SCENARIO, hold, "150", "7"]
    memory: 256MiB
    outputs: [result.txt]
  - name: prep-a
    command: [sh, -c, "sleep 1 && exec PYTHON SCENARIO hold 40 2 write_then_abort"]
    memory: 96MiB
    outputs: [result.txt]
  - name: prep-b
    command: [sh, -c, "sleep 1 && exec PYTHON SCENARIO hold 50 3 segfault"]
    memory: 96MiB
  - name: grows
    command: [sh, -c, "sleep 2 && exec PYTHON SCENARIO oom"]
    memory: 128MiB
"""


@pytest.fixture(scope="session")
def neighbours_run(tmp_path_factory, real_cgroups) -> Path:
    """The run directory of NEIGHBOURS, run for real under cgroups."""
    root = tmp_path_factory.mktemp("neighbours")
    pipeline = root / "pipeline.yaml"
    pipeline.write_text(NEIGHBOURS.replace("PYTHON", sys.executable).replace("SCENARIO", str(SCENARIO)))
    result = eyrie("run", str(pipeline), "--run-dir", str(root / "run"))
    assert result.returncode == 1, result.stdout + result.stderr  # three of them fail on purpose
    return root / "run"
