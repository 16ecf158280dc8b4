"""What is submitted for an attempt: its batch script (the grid's, through ``srun`` on several nodes),
and the ``sbatch`` command line that asks for the job (memory, time, GPUs, partition, the
environment it gets)."""

from __future__ import annotations

import fnmatch
import math
import shlex
from pathlib import Path

from pipeline.memory import MIB
from pipeline.run import grid
from pipeline.run.executor import Launch
from pipeline.run.layout import attempt_name
from pipeline.run.slurm.options import SlurmOptions, options_of

TIME_LIMIT_MARGIN_S = 60.0
"""``--time`` is the step's timeout plus this: the runner stops a step at its timeout itself."""
RENDEZVOUS_PORT_BASE = 20000
SBATCH = ("sbatch", "--parsable")
"""sbatch, answering the job's id alone (``812``, or ``812;cluster``)."""

# What a job gets of the runner's environment besides the step's own variables (`--export` names
# them; sbatch would otherwise send the whole environment, API keys and tokens included, into the
# job's record on the controller). A pipeline adds names or patterns with `slurm: {export: […]}`.
EXPORTED_ENV = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "TZ",
    "TMPDIR",
    "TERM",
    "PYTHON*",
    "VIRTUAL_ENV",
    "CONDA_*",
    "LD_LIBRARY_PATH",
    "CUDA_*",
    "NCCL_*",
    "NVIDIA_*",
    "OMP_*",
    "MKL_*",
    "TORCH_*",
    "TOKENIZERS_PARALLELISM",
    "HF_HOME",
    "HF_HUB_CACHE",
    "HF_DATASETS_CACHE",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_TOKEN_PATH",
    "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE",
    "EYRIE_*",
)


def report_path(launch: Launch) -> Path:
    """Where the in-job wrapper writes its report (with ``nodes``: one per node, ``….node-N.json``)."""
    return launch.stderr_path.with_name(f"attempt-{launch.attempt}.slurm.json")


def script_path(launch: Launch) -> Path:
    """Where the job's batch script is written, beside its logs."""
    return launch.stderr_path.with_name(f"attempt-{launch.attempt}.sbatch")


def batch_script(launch: Launch) -> str:
    """The job's script: the step under the in-job wrapper, through srun when it asks for nodes."""
    options = options_of(launch)
    report = report_path(launch)
    if options.nodes is None:
        return grid.job_script(launch, report)
    # torchrun's rendezvous (c10d) on the allocation's first node; every node runs one launcher.
    # srun would pass on only the names sbatch exported (SLURM_EXPORT_ENV), not the rendezvous.
    per_node = f'exec {shlex.join(grid.WRAPPER)} "$0.node-$SLURM_NODEID.json" -- "$@"'
    lines = [
        *grid.script_head(launch),
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=$(({RENDEZVOUS_PORT_BASE} + SLURM_JOB_ID % 10000))",
        'export MASTER_ADDR="$first" MASTER_PORT="$port" PET_RDZV_BACKEND=c10d '
        'PET_RDZV_ENDPOINT="$first:$port" PET_RDZV_ID="$SLURM_JOB_ID" SLURM_EXPORT_ENV=ALL',
        f"exec srun --nodes={options.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"sh -c {shlex.quote(per_node)} {shlex.quote(str(report))} {shlex.join(launch.argv)}",
    ]
    return "\n".join(lines) + "\n"


def sbatch_directives(launch: Launch) -> list[str]:
    """What the job asks of Slurm, as sbatch's options: its name, working directory and logs, the
    step's memory limit, time, GPUs, the environment it gets, the pipeline's ``slurm:`` options."""
    options = options_of(launch)
    name = attempt_name(launch.run_id, launch.step, launch.attempt)
    argv = [
        f"--job-name={name}",
        f"--chdir={launch.cwd}",
        f"--output={launch.stdout_path}",
        f"--error={launch.stderr_path}",
        "--open-mode=append",
        f"--mem={math.ceil(launch.limit_bytes / MIB)}M",
        "--no-requeue",
        f"--export={','.join(exported_names(launch, options)) or 'NONE'}",
    ]
    if launch.timeout is not None:
        argv.append(f"--time={math.ceil((launch.timeout + TIME_LIMIT_MARGIN_S) / 60)}")
    if launch.gpus:
        argv.append(f"--gres=gpu:{launch.gpus}")
    for flag, value in (
        ("--partition", options.partition),
        ("--account", options.account),
        ("--nodes", options.nodes),
        ("--cpus-per-task", options.cpus),
    ):
        if value is not None:
            argv.append(f"{flag}={value}")
    return [*argv, *options.sbatch_args]


def sbatch_command(script: Path, directives: list[str]) -> list[str]:
    return [*SBATCH, *directives, str(script)]


def sbatch_argv(launch: Launch, script: Path) -> list[str]:
    """The command line that submits the launch's job."""
    return sbatch_command(script, sbatch_directives(launch))


def exported_names(launch: Launch, options: SlurmOptions) -> list[str]:
    """The variables of the launch's environment the job gets: the step's own, and those the
    runner's environment may pass on (EXPORTED_ENV and the pipeline's ``export``)."""
    patterns = (*EXPORTED_ENV, *options.export)
    return sorted(
        name
        for name in launch.env
        if not name.startswith("SLURM_")
        and (name in launch.step_env or any(fnmatch.fnmatchcase(name, p) for p in patterns))
    )


def job_env(launch: Launch) -> dict[str, str]:
    """The environment sbatch runs in: the runner's (its own SLURM_* variables would mislead the job)."""
    return {k: v for k, v in launch.env.items() if not k.startswith("SLURM_")}
