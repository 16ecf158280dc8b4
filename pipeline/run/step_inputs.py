"""What a step runs with, as the runner gives it: its command with the runner's variables expanded,
and, before anything starts, its program and input files found.

A program or input need not exist yet when a step it needs is to write it (under that step's
directory in the run directory).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from pipeline.contract.step import PIPELINE_DIR_ENV, RUN_DIR_ENV, STEP_DIR_ENV, STEP_NAME_ENV
from pipeline.run.spec import PipelineError, PipelineSpec, ServiceSpec, StepSpec, UnknownVariable, substitute

# What exec takes (Linux): one argument or environment string of at most 32 pages, and all of them
# together (the environment too) at most ARG_MAX.
MAX_ARG_STRLEN = 32 * os.sysconf("SC_PAGE_SIZE")
ARG_MAX = os.sysconf("SC_ARG_MAX")


def runner_env(pipeline_path: Path, run_dir: Path, step: StepSpec | ServiceSpec) -> dict[str, str]:
    """The variables the runner sets for every step and service: its place in the run (the step
    contract's EYRIE_* names), and a PATH on which it finds the same `python3` and `eyrie` as the
    runner (its virtual environment first)."""
    interpreter_bin = str(Path(sys.executable).parent)
    return {
        "PATH": os.pathsep.join([interpreter_bin, os.environ.get("PATH", os.defpath)]),
        RUN_DIR_ENV: str(run_dir),
        STEP_DIR_ENV: str(run_dir / step.name),
        STEP_NAME_ENV: step.name,
        PIPELINE_DIR_ENV: str(pipeline_path.parent),
    }


def expand_command(pipeline_path: Path, run_dir: Path, step: StepSpec) -> list[str]:
    """The step's argv with the runner's variables and the step's ``env`` expanded
    (settings from the environment were expanded when the file was loaded)."""
    variables = {**runner_env(pipeline_path, run_dir, step), **step.env}
    return expand_argv(pipeline_path, step, variables)


def expand_argv(pipeline_path: Path, item: StepSpec | ServiceSpec, variables: dict[str, str]) -> list[str]:
    """The command of ``item`` (a step or service) with each ``${NAME}`` of ``variables`` filled in;
    a PipelineError naming where it is written and the variables known for one it cannot fill."""

    def lookup(name: str, default: str | None) -> str:
        if variables.get(name):
            return variables[name]
        if default is not None:
            return default
        if name in variables:
            return ""
        raise UnknownVariable(name)

    try:
        argv = [substitute(arg, lookup) for arg in item.command]
    except UnknownVariable as exc:
        raise PipelineError(
            f"{item.at(pipeline_path, 'command')}: unknown variable ${{{exc.args[0]}}}; "
            f"known here: {', '.join(sorted(variables))}"
        ) from None
    _check_argv_size(pipeline_path, item, argv, {**os.environ, **variables})
    return argv


def _check_argv_size(
    pipeline_path: Path, item: StepSpec | ServiceSpec, argv: list[str], env: dict[str, str]
) -> None:
    """A PipelineError for an argv the kernel would refuse to exec ("Argument list too long")."""
    sizes = [len(os.fsencode(arg)) + 1 for arg in argv]  # as exec counts them: with their NUL
    for i, size in enumerate(sizes):
        if size > MAX_ARG_STRLEN:
            raise PipelineError(
                f"{item.at(pipeline_path, f'command[{i}]')}: {size:,} bytes, over the {MAX_ARG_STRLEN:,} "
                "bytes Linux takes in one argument (MAX_ARG_STRLEN); pass it in a file, and its path"
            )
    total = sum(sizes) + sum(len(os.fsencode(f"{k}={v}")) + 1 for k, v in env.items())
    if total > ARG_MAX:
        raise PipelineError(
            f"{item.at(pipeline_path, 'command')}: {total:,} bytes with its environment, over the "
            f"{ARG_MAX:,} bytes this system takes in a command's arguments (ARG_MAX); pass them in a file"
        )


def missing_input(pipeline_path: Path, step: StepSpec, path: Path) -> PipelineError:
    what = "is not a file" if path.exists() else "does not exist"
    return PipelineError(
        f"{step.at(pipeline_path, 'inputs')}: {path} {what} (inputs are files beside "
        "the pipeline file, or written by a step it needs: create it or fix the path)"
    )


def check_inputs(spec: PipelineSpec, pipeline_path: Path, run_dir: Path, step: StepSpec) -> None:
    """Before anything starts: every input exists, unless a step it needs is to write it."""
    upstream_dirs = [run_dir / name for name in spec.upstream(step.name)]
    for rel in step.inputs:
        path = (pipeline_path.parent / rel).resolve()
        if not path.is_file() and not any(d in path.parents for d in upstream_dirs):
            raise missing_input(pipeline_path, step, path)


def check_program(
    spec: PipelineSpec, pipeline_path: Path, run_dir: Path, step: StepSpec, argv: list[str]
) -> None:
    """The step's program exists: on its PATH, or a path (from its directory) that exists or that
    a step it needs is to write."""
    program = argv[0]
    if "/" in program:
        path = (run_dir / step.name / program).resolve()
        upstream_dirs = [run_dir / name for name in spec.upstream(step.name)]
        found = path.exists() or any(d in path.parents for d in upstream_dirs)
    else:
        path = step.env.get("PATH") or runner_env(pipeline_path, run_dir, step)["PATH"]
        found = shutil.which(program, path=path) is not None
    if not found:
        where = "no such file" if "/" in program else "not found on the step's PATH"
        raise PipelineError(
            f"{step.at(pipeline_path, 'command')}: {program!r}: {where}; install it, or give its full path"
        )
