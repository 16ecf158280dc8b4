"""Helpers shared by the test suites: where the repository is, and the real `eyrie` command line.

A module of its own (not conftest.py) so that every test imports the same one,
whatever other conftest.py files pytest has loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "scenarios" / "scenarios.yaml"


def eyrie(*args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `eyrie` command line in a subprocess."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"eyrie {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def attempts_json(run_dir: Path) -> list[dict]:
    return json.loads(eyrie("status", "--run-dir", str(run_dir), "--json", check=True).stdout)
