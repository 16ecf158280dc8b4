"""Every command's --help reads as a user writes: no Python types, no type on a flag, help on every
option, one name for an output folder, durations as they are typed."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.memory.units import duration_text, parse_duration


def every_command() -> list[tuple[list[str], object]]:
    """(words after ``eyrie``, command) for the root and every command and subcommand under it."""
    root = typer.main.get_command(app)
    found, pending = [], [([], root)]
    while pending:
        words, command = pending.pop()
        found.append((words, command))
        if isinstance(command, typer.core.TyperGroup):
            for name in command.list_commands(typer.Context(command)):
                pending.append(([*words, name], command.get_command(typer.Context(command), name)))
    return found


COMMANDS = every_command()


def test_every_command_is_found():
    names = {" ".join(words) for words, _ in COMMANDS}
    assert {"", "run", "train", "generate", "prep", "tokenize", "accept", "build flash-attn",
            "embedded target"} <= names  # fmt: skip


@pytest.mark.parametrize("words", [w for w, _ in COMMANDS], ids=lambda w: " ".join(w) or "eyrie")
def test_help_shows_no_python_type(words):
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.output
    leaks = re.findall(r"<\w[\w\[\], ]*>|list\[|\brange\b|\[x[<>]=|\bbool\b|\bstr\b", text)
    assert not leaks, f"eyrie {' '.join(words)} --help shows {leaks}"
    assert not re.search(r"\d+m00s|\d+h00m", text), "a duration default is not written as it is typed"


@pytest.mark.parametrize("words,command", COMMANDS, ids=[" ".join(w) or "eyrie" for w, _ in COMMANDS])
def test_every_option_has_help_and_output_folders_are_out_dir(words, command):
    for param in command.get_params(typer.Context(command)):
        if isinstance(param, typer.core.TyperOption):
            assert param.help, f"eyrie {' '.join(words)} {param.opts[0]} has no help"
            # A folder of outputs is --out-dir in every command (report's --out is one file).
            assert "--out" not in param.opts or words == ["report"], f"eyrie {' '.join(words)} --out"


def test_a_flag_shows_no_value_and_a_range_is_in_words():
    result = CliRunner().invoke(app, ["prep", "--help"], env={"COLUMNS": "200"})
    quota = next(line for line in result.output.splitlines() if "--quota" in line)
    assert re.search(r"--quota\s+N \[at least 0\]", quota), quota
    check = next(line for line in CliRunner().invoke(app, ["run", "--help"]).output.splitlines()
                 if "--check" in line)  # fmt: skip
    assert re.search(r"--check\s+Only", check), check


@pytest.mark.parametrize(
    "seconds,text", [(600, "10m"), (5400, "1h30m"), (45, "45s"), (3661, "1h1m1s"), (0.5, "0.5s")]
)
def test_duration_text_is_what_parse_duration_reads(seconds, text):
    assert duration_text(seconds) == text
    assert parse_duration(text) == seconds
