"""`eyrie --help` and the light commands start at once: the heavy libraries are imported only inside
the commands that use them, counted with ``python -X importtime``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from eyrie_testing import REPO

HEAVY = ("torch", "transformers", "datasets", "pyarrow", "aiohttp", "docker")
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def imports(*args: str) -> dict[str, int]:
    """Every module ``eyrie ARGS`` imports, with its own import time in microseconds."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    found = {}
    for line in result.stderr.splitlines():
        match = LINE.match(line)
        if match:
            found[match[4]] = int(match[1])
    assert found, "python -X importtime printed no imports"
    return found


@pytest.mark.parametrize("args", [("--help",), ("run", "--help"), ("status", "--help"), ("--version",)])
def test_light_commands_import_no_heavy_library(args):
    imported = imports(*args)
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"eyrie {' '.join(args)} imports {', '.join(heavy[:10])}"


def test_help_imports_take_under_a_second():
    # The best of three, so that a busy machine's one slow start does not count.
    seconds = min(sum(imports("--help").values()) for _ in range(3)) / 1e6
    assert seconds < 1, f"{seconds:.2f} s of imports"
