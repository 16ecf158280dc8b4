"""Shared fixtures: where real cgroups can be used, and how to run the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "tests" / "scenarios" / "scenarios.yaml"


def _cgroups_writable() -> str | None:
    """None when this process can create memory-limited child cgroups, else why not."""
    try:
        from pipeline.memory import CgroupError, step_parent

        parent = step_parent()
        probe = parent.child("eyrie-probe")
        probe.create()
        probe.set_limit(64 * 1024 * 1024)
        probe.remove()
    except (CgroupError, OSError) as exc:
        return f"cannot create memory-limited cgroups here: {exc}"
    return None


@pytest.fixture(scope="session")
def real_cgroups() -> None:
    reason = _cgroups_writable()
    if reason:
        pytest.skip(reason)


def eyrie(*args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the real `eyrie` command line in a subprocess."""
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"eyrie {' '.join(args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def attempts_json(run_dir: Path) -> list[dict]:
    return json.loads(eyrie("status", "--run-dir", str(run_dir), "--json", check=True).stdout)
