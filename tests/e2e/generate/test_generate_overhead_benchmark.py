"""The driver-overhead benchmark runs end to end (a few rows; its figures are in benchmarks/README.md)."""

from __future__ import annotations

import subprocess
import sys

from generate_helpers import REPO


def test_the_overhead_benchmark_compares_the_driver_with_bare_clients():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.generate_overhead",
            "--rows",
            "300",
            "--concurrency",
            "8",
            "--repeats",
            "1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for client in ("bare", "bare-orjson", "eyrie", "eyrie / bare", "eyrie / bare-orjson"):
        (row,) = [line for line in lines if line.startswith(f"| {client} |")]
        assert len(row.split("|")) == 7, row  # the client and its four figures
