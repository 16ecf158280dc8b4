"""A step's options checked as they are read: a URL without its scheme and a duration without its
unit are refused at once, in one line naming the option, exit 2 (not after a server's whole health
timeout, not as a traceback)."""

from __future__ import annotations

import pytest

from eyrie_testing import eyrie

DRAFT = ("--draft", "d", "--target", "t", "--data", "x")


@pytest.mark.parametrize(
    "args,line",
    [
        (
            ("generate", "p.jsonl", "--url", "localhost:30000"),
            "error: --url: 'localhost:30000' is not a server URL; write it with its scheme, "
            "e.g. http://localhost:30000",
        ),
        (
            ("accept", *DRAFT, "--release-target", "localhost:30000"),
            "error: --release-target: 'localhost:30000' is not a server URL; write it with its scheme, "
            "e.g. http://localhost:30000",
        ),
        (
            ("train", "--release-target", "gpu01:30000"),
            "error: --release-target: 'gpu01:30000' is not a server URL; write it with its scheme, "
            "e.g. http://gpu01:30000",
        ),
        (
            ("generate", "p.jsonl", "--url", "http://127.0.0.1:9", "--health-timeout", "5"),
            "error: --health-timeout: invalid duration '5' (write e.g. 30s, 10m, 2h, 1h30m)",
        ),
        (
            ("accept", *DRAFT, "--startup-timeout", "5"),
            "error: --startup-timeout: invalid duration '5' (write e.g. 30s, 10m, 2h, 1h30m)",
        ),
        (
            ("accept", *DRAFT, "--request-timeout", "ten"),
            "error: --request-timeout: invalid duration 'ten' (write e.g. 30s, 10m, 2h, 1h30m)",
        ),
    ],
)
def test_a_bad_option_is_one_line_naming_it(args, line):
    result = eyrie(*args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == line
