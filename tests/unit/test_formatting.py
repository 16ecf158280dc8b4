"""The code is as the linter and the formatter leave it: `ruff check` and `ruff format --check` run
here, so a change that skips them fails the suite instead of drifting (a `# fmt: skip  # why` keeps a
hand-laid table where it reads better; the formatter honours it only with nothing but a comment after it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pipeline", "tests", "benchmarks"]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_finds_nothing_to_change(command):
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *SOURCES], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
