"""Every command's --help reads as a user writes: no Python types, no type on a flag, help on every
option, one name for an output folder, durations as they are typed; no option's or variable's name
cut, at 80 columns, in a pipe, or in a wide terminal's panels."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from pipeline import cli
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
    assert {
        "",
        "run",
        "train",
        "generate",
        "prep",
        "tokenize",
        "accept",
        "build flash-attn",
        "embedded target",
    } <= names


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


def test_a_flag_shows_no_value_and_a_range_is_in_words(monkeypatch):
    for panels in (True, False):  # a wide terminal's panels, and plain lines
        monkeypatch.setattr(cli, "rich_help", lambda panels=panels: panels)
        result = CliRunner().invoke(app, ["prep", "--help"], env={"COLUMNS": "200"})
        assert re.search(r"--quota\s+N\b", result.output) and "at least 0]" in result.output, result.output
        check = next(
            line
            for line in CliRunner().invoke(app, ["run", "--help"]).output.splitlines()
            if "--check" in line
        )
        assert re.search(r"--check\s+Only", check), check


def names_of(command) -> list[str]:
    """Every option name and environment variable ``command``'s help shows."""
    names = []
    for param in command.get_params(typer.Context(command)):
        if isinstance(param, typer.core.TyperOption):
            names += [*param.opts, *param.secondary_opts]
            names += [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or [])
    return [name for name in names if name.startswith(("--", "EYRIE_"))]


def cut_names(text: str, command) -> list[str]:
    """The names of ``command`` its help ``text`` does not show whole, and every name broken at the
    end of a line (``--batch-`` then ``tokens``)."""
    whole = [n for n in names_of(command) if not re.search(re.escape(n) + r"(?![\w-])", text)]
    return whole + re.findall(r"(?:--|EYRIE_)[\w-]*[-_]$", text, re.M)


@pytest.mark.parametrize("words,command", COMMANDS, ids=[" ".join(w) or "eyrie" for w, _ in COMMANDS])
def test_no_name_is_cut_at_80_columns_nor_in_a_pipe(words, command):
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert not cut_names(result.output, command), result.output
    assert max(map(len, result.output.splitlines())) <= 80, result.output


@pytest.mark.parametrize("words,command", COMMANDS, ids=[" ".join(w) or "eyrie" for w, _ in COMMANDS])
def test_no_name_is_cut_in_the_panels_of_a_terminal_wide_enough_for_them(monkeypatch, words, command):
    monkeypatch.setattr(cli, "rich_help", lambda: True)
    width = str(cli.RICH_HELP_COLUMNS)
    result = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": width})
    assert "╭─ Options" in result.output or not names_of(command), result.output
    assert not cut_names(result.output, command), result.output


def test_panels_only_on_a_terminal_wide_enough_for_them(monkeypatch):
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    for columns, panels in ((80, False), (cli.RICH_HELP_COLUMNS - 1, False), (cli.RICH_HELP_COLUMNS, True)):
        monkeypatch.setenv("COLUMNS", str(columns))
        assert cli.rich_help() is panels, columns
    monkeypatch.setattr(sys.stdout, "isatty", lambda: False)
    assert cli.rich_help() is False  # a pipe or a log


def test_help_piped_to_a_log_keeps_every_name_whole():
    """What a user gets from `eyrie train --help | less` (no COLUMNS: a pipe is 80 wide)."""
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    for words in (["train"], ["serve"], ["generate"]):
        shown = subprocess.run(
            [sys.executable, "-m", "pipeline.cli", *words, "--help"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        command = dict((" ".join(w), c) for w, c in COMMANDS)[" ".join(words)]
        assert not cut_names(shown, command), shown


@pytest.mark.parametrize(
    "seconds,text", [(600, "10m"), (5400, "1h30m"), (45, "45s"), (3661, "1h1m1s"), (0.5, "0.5s")]
)
def test_duration_text_is_what_parse_duration_reads(seconds, text):
    assert duration_text(seconds) == text
    assert parse_duration(text) == seconds
