"""The ``eyrie`` command line.

Each step's module owns its command and options (``pipeline/steps/*/cli.py``, the build's
``pipeline/compile/cli.py``); this module adds them, by name, beside the commands that run and
read pipelines. A step's module is imported only when its command runs (or ``eyrie --help``
lists it), and every command imports its implementation lazily, so the light commands stay fast
and none pulls in torch or transformers before it runs.
"""

from __future__ import annotations

import importlib
import subprocess
import typing
from pathlib import Path
from typing import Annotated

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from pipeline.run import EXECUTORS

STEP_COMMANDS = {
    "prep": "pipeline.steps.prep.cli:prep",
    "generate": "pipeline.steps.generate.cli:generate",
    "tokenize": "pipeline.steps.tokenize.cli:tokenize",
    "train": "pipeline.steps.train.cli:train",
    "accept": "pipeline.steps.accept.cli:accept",
    "serve": "pipeline.steps.target_server:serve",
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


def plain_params(params: list) -> list:
    """``params`` with :class:`PlainOption` and :class:`PlainArgument` help, in place."""
    for param in params:
        if type(param) is TyperOption:
            param.__class__ = PlainOption
        elif type(param) is TyperArgument:
            param.__class__ = PlainArgument
            param.metavar = param.metavar or param.name.upper()
    return params


def plain_help(command: TyperCommand | TyperGroup) -> TyperCommand | TyperGroup:
    """``command`` and its subcommands with plain help (:func:`plain_params`)."""
    plain_params(command.get_params(typer.Context(command)))
    for subcommand in getattr(command, "commands", {}).values():
        plain_help(subcommand)
    return command


class EyrieCommands(TyperGroup):
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


def eyrie_problem(args: list[str]) -> str | None:
    """What ``eyrie ARGS`` would be refused for as its options are read (a missing or wrong option),
    found by parsing them, not running the command; None when they parse."""
    import contextlib
    import io

    from typer._click.exceptions import UsageError

    command: TyperCommand | TyperGroup = typer.main.get_command(app)
    words, path = list(args), ["eyrie"]
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # what an option's own check says
            while isinstance(command, TyperGroup):
                if not words or (found := command.get_command(typer.Context(command), words[0])) is None:
                    return f"{' '.join(path)}: no command {words[0] if words else ''!r}".replace(" ''", "")
                command, path = found, [*path, words.pop(0)]
            command.make_context(" ".join(path), words)
    except UsageError as exc:
        return f"{' '.join(path)}: {exc.format_message()}"
    except typer.Exit as exc:
        if exc.exit_code:
            return f"{' '.join(path)}: {said.getvalue().strip().removeprefix('error: ')}"
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
            help="Only check the file (keys, needs, each step's command and an eyrie command's options); "
            "run nothing, write nothing.",
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
    from pipeline.run.step_contract import manifest_command

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


embedded_app = typer.Typer(help="The embedded default: the tiny target and its data.", no_args_is_help=True)
app.add_typer(embedded_app, name="embedded")


@embedded_app.command("target")
def embedded_target(
    out_dir: Annotated[Path, typer.Option(help="Folder for the model and tokenizer.")] = Path("model"),
) -> None:
    """Write the tiny target (a small Llama and its BPE tokenizer, made from the bundled samples)."""
    from pipeline.embedded.tiny import target_command

    raise typer.Exit(target_command(out_dir))


if __name__ == "__main__":
    app()
