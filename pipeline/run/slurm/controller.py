"""What the runner asks Slurm's controller, through its commands (``squeue``, ``scontrol``,
``sacct``, ``scancel``, ``sinfo``), and how it asks again; submitting with ``sbatch``, which must
never submit a job twice, is the engine's (``engine``), as is reading Slurm's answers as the grid's.

A controller that does not answer is asked again, for about a minute, by every
command; its silence is never taken for an answer ("the job is gone", "no such
job was submitted"), but raised as an ExecutorUnavailable for the runner to
wait on or refuse with.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import time
from typing import NamedTuple

from pipeline.run.executor import ExecutorError, ExecutorUnavailable

COMMAND_TIMEOUT_S = 60.0
"""A Slurm command that has not answered in this time counts as the controller's silence."""
ANSWER_WAITS_S = (0, 1, 2, 4, 8, 15, 30)
"""Waits before asking a controller that did not answer again, for every command (sbatch, squeue,
scontrol, scancel): about a minute; silence for longer is an ExecutorUnavailable, never an answer."""

# Job states in which a job has ended (squeue --states=all shows them for MinJobAge seconds).
ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)


def run_once(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One Slurm command, asked once; a command missing is an ExecutorError, one hanging an
    ExecutorUnavailable (it may have reached the controller all the same)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, env=env)
    except FileNotFoundError:
        raise ExecutorError(
            f"{argv[0]} is not on PATH: run eyrie where Slurm's commands are (a login node of the cluster)"
        ) from None
    except subprocess.TimeoutExpired:
        raise ExecutorUnavailable(f"{argv[0]} did not answer within {COMMAND_TIMEOUT_S:.0f} s") from None


def retry_delays(patience_s: float):
    """The waits before each try: ANSWER_WAITS_S, then its last wait again until ``patience_s``."""
    waited = 0.0
    for delay in ANSWER_WAITS_S:
        yield delay
        waited += delay
    while 0 < ANSWER_WAITS_S[-1] and waited + ANSWER_WAITS_S[-1] <= patience_s:
        yield ANSWER_WAITS_S[-1]
        waited += ANSWER_WAITS_S[-1]


def run_until_answered(*argv: str, patience_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """A Slurm command's answer, asked again while the controller does not answer (the command
    hangs, or says it cannot reach it): silence is no answer. ExecutorUnavailable once it stayed
    silent for ``patience_s`` (default: ANSWER_WAITS_S, about a minute)."""
    patience_s = sum(ANSWER_WAITS_S) if patience_s is None else patience_s
    said = ""
    for delay in retry_delays(patience_s):
        time.sleep(delay)
        try:
            result = run_once(*argv)
        except ExecutorUnavailable as exc:
            said = str(exc)
            continue
        said = last_line(result)
        if result.returncode == 0 or not controller_unreachable(said):
            return result
    raise ExecutorUnavailable(
        f"the Slurm controller did not answer {shlex.join(argv[:2])} … for {patience_s:.0f} s "
        f"({said}); check scontrol ping, then run again"
    )


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    """What a command said, for a message: its stderr's last line (else stdout's), else its exit status."""
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


def controller_unreachable(message: str) -> bool:
    """The controller did not answer (worth asking again), as opposed to refusing."""
    message = message.lower()
    return any(
        words in message
        for words in (
            "unable to contact slurm controller",
            "socket timed out",
            "connection refused",
            "temporarily unavailable",
            "connection timed out",
        )
    )


# -- jobs ---------------------------------------------------------------------------------------


def job_state(job_id: str) -> str | None:
    """Slurm's state of a job (an ended one while the controller remembers it), or None only when
    Slurm says it does not know the job. A controller that stays silent is an ExecutorUnavailable."""
    result = run_until_answered("squeue", "-h", "--states=all", "-j", job_id, "-o", "%T")
    if result.returncode == 0:
        states = result.stdout.split()
        return states[0] if states else None
    if "invalid job id" in result.stderr.lower():
        return None
    raise ExecutorUnavailable(f"squeue could not say what became of job {job_id}: {last_line(result)}")


def listed_states(ids: list[str]) -> dict[str, str] | None:
    """One ``squeue``, asked once, for all of ``ids``: the states of those Slurm lists, or None when
    the controller did not answer."""
    try:
        result = run_once("squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i|%T")
    except ExecutorError:
        return None
    if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
        return None
    return dict(line.split("|", 1) for line in result.stdout.split() if "|" in line)


def job_named(name: str) -> str | None:
    """The id of the job of that name, or None when Slurm lists none; ExecutorUnavailable when
    the controller cannot say (then nobody knows whether it was submitted)."""
    result = run_until_answered("squeue", "-h", "--states=all", f"--name={name}", "-o", "%i")
    if result.returncode != 0:
        raise ExecutorUnavailable(
            f"squeue could not say whether job {name} was submitted: {last_line(result)}"
        )
    ids = result.stdout.split()
    return ids[0] if ids else None


def cancel(job_id: str) -> subprocess.CompletedProcess[str]:
    """``scancel`` the job, asked again while the controller does not answer."""
    return run_until_answered("scancel", job_id)


def parse_job_record(line: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as a dict (values never hold spaces, except Command's tail)."""
    record: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            record[key] = value
    return record


def parse_exit_code(code: str) -> tuple[int | None, int | None]:
    """Slurm's ExitCode 'code:signal' as (exit code, signal)."""
    exit_text, _, signal_text = code.partition(":")
    try:
        exit_code, sig = int(exit_text), int(signal_text or 0)
    except ValueError:
        return None, None
    if sig:
        return None, sig
    return exit_code, None


def final_state(job_id: str, patience_s: float | None = None) -> tuple[str, str, str] | None:
    """(state, ExitCode 'code:signal', which command said so) once the job ended, or None when
    Slurm no longer knows it (the controller forgot it, and there is no accounting). A controller
    that does not answer is asked again for ``patience_s``: its silence is no answer."""
    shown = run_until_answered("scontrol", "show", "job", "-o", job_id, patience_s=patience_s)
    if shown.returncode == 0 and shown.stdout.strip():
        record = parse_job_record(shown.stdout)
        state = record.get("JobState", "")
        if state in ENDED_STATES:
            return state, record.get("ExitCode", ""), "scontrol"
    accounted = run_once("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode")
    if accounted.returncode == 0 and accounted.stdout.strip():
        state, _, code = accounted.stdout.strip().splitlines()[0].partition("|")
        return state.split()[0], code, "sacct"  # "CANCELLED by 1000" -> CANCELLED
    return None


# -- partitions and nodes -----------------------------------------------------------------------


def default_partition() -> str:
    result = run_until_answered("sinfo", "-h", "-o", "%P")
    if result.returncode != 0:
        raise ExecutorError(f"cannot ask Slurm for its partitions (sinfo: {last_line(result)})")
    default = [p.rstrip("*") for p in result.stdout.split() if p.endswith("*")]
    if not default:
        raise ExecutorError("Slurm has no default partition: set slurm: {partition: …} in the pipeline")
    return default[0]


class Node(NamedTuple):
    name: str
    hostname: str
    memory_mib: int
    gpus: int
    """Its generic resources' GPUs (``Gres=gpu:8``, ``gpu:a100:4``): what ``--gres=gpu:N`` can ask."""


def gres_gpus(gres: str) -> int:
    """The GPUs in a node's generic resources as sinfo's ``%G`` shows them (``gpu:a100:4(S:0-1),
    gpu:v100:2`` has 6; ``(null)`` none)."""
    return sum(int(count) for count in re.findall(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres))


def nodes_of(partitions: set[str | None]) -> list[Node]:
    """Every node in ``partitions`` (None: the default)."""
    named = sorted({p or default_partition() for p in partitions})
    result = run_until_answered("sinfo", "-h", "-N", "-p", ",".join(named), "-o", "%N|%n|%m|%G")
    if result.returncode != 0:
        raise ExecutorError(f"cannot ask Slurm for its nodes (sinfo: {last_line(result)})")
    nodes = []
    for line in result.stdout.splitlines():
        name, hostname, memory, gres = (line.split("|") + ["", "", ""])[:4]
        memory_mib = int(memory.rstrip("+")) if memory.rstrip("+").isdigit() else 0
        nodes.append(Node(name, hostname, memory_mib, gres_gpus(gres)))
    if not nodes:
        raise ExecutorError(
            f"Slurm lists no node in partition {', '.join(named)}; check slurm: partition in the pipeline"
        )
    return nodes
