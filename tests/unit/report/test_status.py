"""`eyrie status` after a resumed run, and steps that did not run, in `status`, `explain` and the report."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from eyrie_testing import eyrie

# The second run skips the writer (up to date) and runs `after` again, which fails again.
RESUMED = """
steps:
  - name: writer
    command: [PYTHON, -c, "open('out.txt', 'w').write('x')"]
    memory: 64MiB
    outputs: [out.txt]
  - name: after
    command: [PYTHON, -c, "raise SystemExit(1)"]
    memory: 64MiB
    needs: [writer]
"""

# The writer crashes: `after`, and `last` behind it, never start.
BLOCKED = """
steps:
  - name: writer
    command: [PYTHON, -c, "import os; os.abort()"]
    memory: 64MiB
  - name: after
    command: [PYTHON, -c, "pass"]
    memory: 64MiB
    needs: [writer]
  - name: last
    command: [PYTHON, -c, "pass"]
    memory: 64MiB
    needs: [after]
"""


def _run(root: Path, pipeline: str, times: int) -> Path:
    (root / "p.yaml").write_text(pipeline.replace("PYTHON", sys.executable))
    for _ in range(times):
        result = eyrie("run", str(root / "p.yaml"), "--run-dir", str(root / "run"))
        assert result.returncode == 1, result.stdout + result.stderr  # a step fails on purpose
    return root / "run"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, real_cgroups) -> Path:
    return _run(tmp_path_factory.mktemp("resumed"), RESUMED, times=2)


@pytest.fixture(scope="module")
def blocked(tmp_path_factory, real_cgroups) -> Path:
    return _run(tmp_path_factory.mktemp("blocked"), BLOCKED, times=1)


def _rows(table: str) -> list[list[str]]:
    """The cells of each row of a status table (a reason wrapped onto more lines joined back)."""
    rows: list[list[str]] = []
    for line in table.splitlines():
        if not line.startswith("│"):
            continue
        cells = [cell.strip() for cell in line.strip("│").split("│")]
        if cells[0]:
            rows.append(cells)
        else:  # the same row, its reason wrapped
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells, strict=True)]
    return rows


def test_status_after_a_resumed_run_shows_the_latest_run_one_row_a_step_with_its_reason(resumed):
    out = eyrie("status", "--run-dir", str(resumed), check=True).stdout
    header = next(line for line in out.splitlines() if line.startswith("┃"))
    columns = [c.strip() for c in header.strip("┃").split("┃")]
    assert columns[-2:] == ["started", "reason"], columns
    rows = {cells[0]: dict(zip(columns, cells, strict=True)) for cells in _rows(out)}
    assert [cells[0] for cells in _rows(out)] == ["writer", "after"], out
    assert rows["writer"]["verdict"] == "skipped" and rows["writer"]["started"] == "", out
    assert rows["writer"]["reason"] == "up to date: its manifest matches its outputs and inputs", out
    # The latest run's attempt of `after`, not the first run's.
    assert rows["after"]["attempt"] == "2" and rows["after"]["verdict"] == "failed", out
    assert rows["after"]["reason"] == "the main process exited with 1", out


def test_status_all_keeps_the_history(resumed):
    out = eyrie("status", "--all", "--run-dir", str(resumed), check=True).stdout
    shown = [(cells[0], cells[1], cells[2]) for cells in _rows(out)]
    assert shown == [
        ("writer", "1", "succeeded"),
        ("after", "1", "failed"),
        ("after", "2", "failed"),
        ("writer", "-", "skipped"),
    ], out


def test_status_all_and_follow_are_refused_together_in_one_line(resumed):
    result = eyrie("status", "--all", "--follow", "--run-dir", str(resumed))
    assert result.returncode == 2 and result.stdout == "", result
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: status: --all and --follow") and "pass one of them" in line, line


def test_explain_says_why_a_blocked_step_did_not_run(blocked):
    for step in ("after", "last"):
        result = eyrie("explain", step, "--run-dir", str(blocked))
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"Blocked: {step} did not run: writer ended crashed." in result.stdout, result.stdout
    rows = {cells[0]: cells for cells in _rows(eyrie("status", "--run-dir", str(blocked), check=True).stdout)}
    assert rows["after"][2] == "blocked" and rows["after"][-1] == "not run: writer ended crashed"


def test_explain_of_a_skipped_step_says_so_then_explains_its_last_attempt(resumed):
    out = eyrie("explain", "writer", "--run-dir", str(resumed), check=True).stdout
    lines = out.splitlines()
    assert lines[1] == "Skipped: writer did not run: up to date: its manifest matches its outputs and inputs."
    assert lines[2].startswith("Its last attempt was in an earlier run, "), out
    assert "writer attempt 1" in out and "Succeeded:" in out, out


def test_explain_of_an_unknown_step_names_the_steps(blocked):
    result = eyrie("explain", "nope", "--run-dir", str(blocked))
    assert result.returncode == 2
    assert "no step 'nope'" in result.stderr and "pass one of its steps: after, last, writer" in result.stderr


def test_the_report_lists_the_steps_that_did_not_run_and_why(blocked):
    eyrie("report", "--run-dir", str(blocked), check=True)
    page = (blocked / "report.html").read_text()
    for step in ("after", "last"):
        assert f"<tr class='not-run' data-step='{step}' data-state='blocked'>" in page, page
        assert f"{step} did not run: writer ended crashed" in page
