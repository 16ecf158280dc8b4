"""`eyrie --version`: the package's version, and the commit of the checkout it runs from."""

from __future__ import annotations

import subprocess
from importlib.metadata import version

from eyrie_testing import REPO, eyrie


def test_version_names_the_package_version_and_the_checkouts_commit():
    result = eyrie("--version", check=True)
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    line = result.stdout.strip()
    assert line.startswith(f"eyrie {version('eyrie')} (commit {commit}"), line
    assert len(result.stdout.splitlines()) == 1


def test_help_still_describes_eyrie():
    assert "EAGLE-3 draft-model factory" in eyrie("--help", check=True).stdout
