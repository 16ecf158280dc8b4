"""Why a step runs again, said where a user looks: the console as it starts, `status --json`'s
`run_reason`, and `explain`: which input, output or setting changed, or how its last attempt ended."""

from __future__ import annotations

import json
from pathlib import Path

from eyrie_testing import eyrie

PIPELINE = """
steps:
  - name: hog
    command: [sh, -c, "cat ${EYRIE_PIPELINE_DIR}/words.txt > out.txt; test ${MODE:-ok} = ok"]
    memory: 64MiB
    inputs: [words.txt]
    outputs: [out.txt]
  - name: after
    command: [sh, -c, "cat ../hog/out.txt > copy.txt"]
    memory: 64MiB
    needs: [hog]
    outputs: [copy.txt]
"""


def run(tmp_path: Path, **settings: str) -> str:
    """`eyrie run` once more; what it printed."""
    path = tmp_path / "p.yaml"
    result = eyrie("run", str(path), "--run-dir", str(tmp_path / "run"), settings=settings)
    return result.stdout


def reasons(tmp_path: Path) -> list[tuple[str, int, str]]:
    shown = eyrie("status", "--json", "--run-dir", str(tmp_path / "run"), check=True).stdout
    return [(a["step"], a["attempt"], a["run_reason"]) for a in json.loads(shown)]


def test_each_rerun_says_what_changed(tmp_path):
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "words.txt").write_text("one\n")
    run(tmp_path)
    assert reasons(tmp_path) == [
        ("hog", 1, "it has not run in this run directory"),
        ("after", 1, "it has not run in this run directory"),
    ]

    (tmp_path / "words.txt").write_text("two\n")  # an input
    said = run(tmp_path)
    assert "hog runs again: input words.txt changed" in said, said
    assert "after runs again: the outputs of step hog changed" in said, said

    (tmp_path / "run" / "after" / "copy.txt").write_text("edited\n")  # an output
    said = run(tmp_path)
    assert f"after runs again: an output changed: {tmp_path / 'run' / 'after' / 'copy.txt'} changed" in said

    said = run(tmp_path, MODE="strict")  # a setting: the command it expands to changed, and fails
    assert "hog runs again: its command changed at argument 2: " in said and "test strict = ok'" in said, said
    said = run(tmp_path, MODE="strict")  # the last attempt's verdict
    assert "hog runs again: its last attempt (3) ended failed" in said, said

    assert reasons(tmp_path)[-1] == ("hog", 4, "its last attempt (3) ended failed")
    explained = eyrie("explain", "hog", "--run-dir", str(tmp_path / "run"), check=True).stdout
    assert "It ran because its last attempt (3) ended failed." in explained, explained
