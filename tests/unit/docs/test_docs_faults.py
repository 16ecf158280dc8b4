"""The documentation says what eyrie guarantees when things go wrong, and how to keep a secret out of
the ledger and a long run alive: the operator reads it there before the bad day, not in the code after
it."""

from __future__ import annotations

import re

from eyrie_testing import docs_section


def section(page: str, title: str) -> str:
    """The text of the section ``title`` of page ``docs/PAGE.md``, on one line."""
    return " ".join(docs_section(page, title).split())


def test_reading_the_ledger_says_what_holds_under_each_fault():
    text = section("ledger", "Reading the ledger")
    faults = [
        "the runner is killed",
        "two runners in one run directory",
        "a damaged ledger",
        "a folder output changed after its run",
        "a full disk",
        "`eyrie report --out` naming a folder",
        "a secret in a step's `command`",
    ]
    for fault in faults:
        assert f"| {fault}" in text, fault
    assert "no space left on device under RUN_DIR/STEP" in text and "never left `running`" in text
    assert "hidden ones included (no name is left out)" in text


def test_running_a_pipeline_says_where_a_secret_goes_and_how_a_long_run_outlives_its_shell():
    text = section("running", "Running a pipeline")
    assert "A `${NAME}` in a step's `command` is part of its argv" in text
    assert "by design" in text and "through the step's `env`" in text and "a file the step reads" in text
    for way in ("tmux", "nohup eyrie run", "systemd-run"):
        assert way in text, way


def test_the_verdict_table_says_when_a_command_that_wrote_its_outputs_and_aborted_is_crashed():
    text = section("ledger", "Reading the ledger")
    crashed = re.search(r"\| `crashed` \|([^|]*)\|", text).group(1)
    assert "A plain command that wrote its outputs and then aborted is `crashed` too, not" in crashed
    assert "no manifest written before it exited" in crashed and "only after exit 0" in crashed
    completed = re.search(r"\| `completed_then_crashed` \|([^|]*)\|", text).group(1)
    assert "a manifest the step wrote before it exited" in completed
