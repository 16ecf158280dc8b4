"""`make demo` ends by saying how to run eyrie next: the venv's eyrie is not on PATH."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from eyrie_testing import REPO


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_ends_by_saying_how_to_run_eyrie():
    # -n: the recipe as make would run it, nothing run; the venv is taken as installed.
    dry = subprocess.run(
        ["make", "-n", "-o", "venv", "-o", ".venv/.installed-dev,ml,generate,docker,provision,quantized",
         "demo"],
        capture_output=True, text=True, cwd=REPO, check=True,
    ).stdout.splitlines()  # fmt: skip
    status = next(i for i, line in enumerate(dry) if "eyrie status --run-dir runs/demo" in line)
    after = "\n".join(dry[status + 1 :])
    assert ".venv/bin/eyrie explain train --run-dir runs/demo" in after
    assert "source .venv/bin/activate" in after
