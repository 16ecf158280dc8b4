"""Slurm as the grid's batch engine (``pipeline.run.grid.GridEngine``): its sbatch options, its
``sbatch`` (never twice), its ``squeue`` read as the grid's states, its ``scancel``, and its final
state (``scontrol show job``, else ``sacct``) read as how a job ended and who stopped it."""

from __future__ import annotations

import time
from pathlib import Path

import pipeline.run.slurm.controller as controller
from pipeline.run.executor import ExecutorError, ExecutorUnavailable, Launch
from pipeline.run.grid import GridAttempt, GridEngine, JobEnd, JobState, JobWatcher, Phase
from pipeline.run.layout import attempt_name
from pipeline.run.slurm.options import options_of
from pipeline.run.slurm.script import (
    batch_script,
    job_env,
    report_path,
    sbatch_command,
    sbatch_directives,
    script_path,
)

# Slurm's states of a job whose script has not started: waiting, or its node still setting it up.
QUEUED_STATES = frozenset({"PENDING", "CONFIGURING"})
# Who stopped a job, when Slurm's final state says it was not the step itself.
STOPPED_BY_STATE = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancel",
    "PREEMPTED": "preempted",
    "NODE_FAIL": "node_failed",
    "BOOT_FAIL": "node_failed",
}

SlurmAttempt = GridAttempt
"""One attempt as one Slurm job: the grid's attempt, told by Slurm through its engine."""


def job_state_of(state: str) -> JobState:
    """Slurm's name for a job's state, read as the grid's."""
    if state in controller.ENDED_STATES:
        return JobState(Phase.ENDED, state)
    return JobState(Phase.QUEUED if state in QUEUED_STATES else Phase.RUNNING, state)


class SlurmEngine(GridEngine):
    """Slurm, through its commands on this host's PATH."""

    name = "slurm"
    title = "Slurm"
    cancel_command = "scancel"
    forgets = "scontrol has forgotten it; sacct has no accounting"

    def __init__(self) -> None:
        self._unanswered: set[str] = set()
        """Names of jobs whose submission got no answer: looked up before they are submitted again."""

    def directives(self, launch: Launch) -> list[str]:
        return sbatch_directives(launch)

    def job_script(self, launch: Launch) -> str:
        return batch_script(launch)

    def report_path(self, launch: Launch) -> Path:
        return report_path(launch)

    def script_path(self, launch: Launch) -> Path:
        return script_path(launch)

    def nodes(self, launch: Launch) -> int:
        return options_of(launch).nodes or 1

    def report_wait(self, launch: Launch) -> float:
        return options_of(launch).report_wait

    def submit(self, launch: Launch, script: Path, directives: list[str]) -> str:
        name = attempt_name(launch.run_id, launch.step, launch.attempt)
        if name in self._unanswered:  # asked before without an answer: it may be there already
            found = controller.job_named(name)
            if found:
                return found
        env = job_env(launch)
        said = ""
        for delay in controller.retry_delays(sum(controller.ANSWER_WAITS_S)):
            time.sleep(delay)
            try:
                result = controller.run_once(*sbatch_command(script, directives), env=env)
            except ExecutorUnavailable as exc:
                said = str(exc)
            else:
                if result.returncode == 0:
                    self._unanswered.discard(name)
                    return result.stdout.strip().split(";")[0]
                said = controller.last_line(result)
                if not controller.controller_unreachable(said):
                    raise ExecutorError(
                        f"step {launch.step}: sbatch refused its job: {said} (check the pipeline file's "
                        "slurm: options: partition, account, sbatch_args)"
                    )
            # A submission without an answer may have reached the controller: never submit it twice.
            self._unanswered.add(name)
            found = controller.job_named(name)
            if found:
                self._unanswered.discard(name)
                return found
        raise ExecutorUnavailable(
            f"step {launch.step}: the Slurm controller did not answer sbatch for "
            f"{sum(controller.ANSWER_WAITS_S):.0f} s ({said})"
        )

    def queue(self, job_ids: list[str]) -> dict[str, JobState] | None:
        listed = controller.listed_states(job_ids)
        return None if listed is None else {job: job_state_of(state) for job, state in listed.items()}

    def cancel(self, job_id: str) -> str | None:
        result = controller.cancel(job_id)
        return None if result.returncode == 0 else controller.last_line(result)

    def job_state(self, job_id: str) -> JobState | None:
        state = controller.job_state(job_id)
        return None if state is None else job_state_of(state)

    def final_state(self, job_id: str, patience_s: float | None = None) -> JobEnd | None:
        said = controller.final_state(job_id, patience_s)
        if not said:
            return None
        state, code, told_by = said
        exit_code, sig = controller.parse_exit_code(code)
        oom = state == "OUT_OF_MEMORY"
        return JobEnd(state, f"ExitCode {code}", told_by, exit_code, sig, oom, STOPPED_BY_STATE.get(state))


def squeue_watcher() -> JobWatcher:
    """One ``squeue`` a second for every job the runner waits for: their states, read as the grid's."""
    return JobWatcher(SlurmEngine())
