"""A step's Slurm job as the pipeline file asks for it (``slurm:``), checked before anything starts."""

from __future__ import annotations

from pydantic import Field, field_validator

from pipeline.memory import parse_duration
from pipeline.run.executor import Launch, StepOptions
from pipeline.run.grid import REPORT_WAIT_S

# What eyrie sets on every job itself (or what would fight it): refused in `sbatch_args`, in full,
# abbreviated (sbatch takes any unambiguous prefix of a long option) or, short, with its value
# attached (-N2).
MANAGED_SBATCH_OPTIONS = (
    "--mem",
    "--mem-per-cpu",
    "--mem-per-gpu",
    "--output",
    "--error",
    "--chdir",
    "--job-name",
    "--parsable",
    "--wrap",
    "--array",
    "--export",
    "--export-file",
    "--requeue",
    "--no-requeue",
    "--open-mode",
    "--time",
    "--nodes",
    "--partition",
    "--account",
    "--cpus-per-task",
    "--gres",
    "--gpus",
    "--gpus-per-node",
    "--gpus-per-task",
    "--gpus-per-socket",
)
MANAGED_SHORT_SBATCH_OPTIONS = ("-o", "-e", "-D", "-J", "-a", "-t", "-N", "-p", "-A", "-c", "-G")


def managed_sbatch_option(arg: str) -> str | None:
    """The option eyrie sets that ``arg`` would set, or None."""
    if arg.startswith("--"):
        name = arg.split("=", 1)[0]
        if len(name) < 3:
            return None
        if name in MANAGED_SBATCH_OPTIONS:
            return name
        abbreviated = [option for option in MANAGED_SBATCH_OPTIONS if option.startswith(name)]
        return f"{name} (short for {' or '.join(abbreviated)})" if abbreviated else None
    if arg.startswith("-") and arg[:2] in MANAGED_SHORT_SBATCH_OPTIONS:
        return arg[:2]
    return None


class SlurmOptions(StepOptions):
    """A step's job, under ``slurm:`` in the pipeline file (the pipeline's, with the step's on top)."""

    partition: str | None = None
    account: str | None = None
    nodes: int | None = Field(None, ge=1)
    """Run the step through ``srun`` on this many nodes, one task per node (torchrun steps)."""
    cpus: int | None = Field(None, ge=1)
    """``--cpus-per-task`` (default: the partition's)."""
    sbatch_args: list[str] = []
    """Further sbatch options, e.g. ``[--qos=high, --constraint=h100]``."""
    export: list[str] = []
    """More of the runner's environment for the job, by name or pattern (``[WANDB_*, HTTPS_PROXY]``),
    beyond what a step needs to run (``EXPORTED_ENV``) and the step's own ``env``."""
    report_wait: float = Field(REPORT_WAIT_S, ge=0)
    """How long to wait, after a job ended, for its in-job report to show on the shared filesystem
    (a duration: ``90s``, ``5m``)."""

    @field_validator("report_wait", mode="before")
    @classmethod
    def _duration(cls, value: str | float) -> float:
        return parse_duration(value)

    @field_validator("sbatch_args")
    @classmethod
    def _not_managed(cls, args: list[str]) -> list[str]:
        for arg in args:
            if (name := managed_sbatch_option(arg)) is not None:
                raise ValueError(
                    f"{name} is set by eyrie (memory, time, partition, account, nodes, cpus and gpus "
                    "have fields of their own); remove it from sbatch_args"
                )
        return args


def options_of(launch: Launch) -> SlurmOptions:
    """The launch's Slurm options; the defaults when it has none."""
    return launch.options if isinstance(launch.options, SlurmOptions) else SlurmOptions()
