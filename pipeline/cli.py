"""The ``eyrie`` command line.

Each command imports its implementation lazily, so ``eyrie --help`` and the
light commands stay fast and never pull in torch or transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(
    name="eyrie",
    help="An EAGLE-3 draft-model factory: run pipelines whose every memory outcome is recorded.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

RunDir = Annotated[
    Path,
    typer.Option("--run-dir", "-d", help="Run directory holding step outputs and the ledger."),
]
DEFAULT_RUN_DIR = Path("runs/default")


@app.command()
def run(
    pipeline_file: Annotated[Path, typer.Argument(help="Pipeline YAML file.")],
    run_dir: RunDir = DEFAULT_RUN_DIR,
    executor: Annotated[
        str, typer.Option(help="Where steps run: 'local' (a cgroup per step) or 'docker'.")
    ] = "local",
) -> None:
    """Run a pipeline: each step in its own memory-limited cgroup, every attempt in the ledger."""
    from pipeline.run.cli import run_command

    raise typer.Exit(run_command(pipeline_file, run_dir, executor))


@app.command()
def status(
    run_dir: RunDir = DEFAULT_RUN_DIR,
    json_output: Annotated[bool, typer.Option("--json", help="Print attempts as JSON.")] = False,
) -> None:
    """Show every attempt of every step: verdict, exit, peak/limit, OOM kills, duration."""
    from pipeline.report.status import status_command

    raise typer.Exit(status_command(run_dir, json_output))


@app.command()
def explain(
    step: Annotated[str, typer.Argument(help="Step name.")],
    run_dir: RunDir = DEFAULT_RUN_DIR,
    attempt: Annotated[Optional[int], typer.Option(help="Attempt number (default: last).")] = None,
) -> None:
    """Say in plain words why a step's attempt ended as it did, with the evidence."""
    from pipeline.report.status import explain_command

    raise typer.Exit(explain_command(run_dir, step, attempt))


@app.command()
def memory(
    json_output: Annotated[bool, typer.Option("--json", help="Print as JSON.")] = False,
) -> None:
    """Show the memory this process really has: cgroup limits, usage, MemAvailable, budget."""
    from pipeline.report.memory import memory_command

    raise typer.Exit(memory_command(json_output))


if __name__ == "__main__":
    app()
