"""One attempt as one Slurm job: followed while it runs, then told from its evidence, the in-job
reports first, Slurm's final state saying who stopped the job or standing in for a missing report."""

from __future__ import annotations

import os
import signal
import time
from typing import Any, Protocol

import pipeline.run.slurm.controller as controller
from pipeline.run import grid
from pipeline.run.executor import ExecutorUnavailable, Launch, Outcome
from pipeline.run.grid import JobWatcher, LogFollower, merge_reports
from pipeline.run.slurm.options import options_of
from pipeline.run.slurm.script import report_path

SILENT_CONTROLLER_PATIENCE_S = 3600.0
"""How long the runner keeps asking a silent controller how a job ended when the job's report is
missing, rather than deciding without it."""

# Who stopped a job, when Slurm's final state says it was not the step itself.
STOPPED_BY_STATE = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancel",
    "PREEMPTED": "preempted",
    "NODE_FAIL": "node_failed",
    "BOOT_FAIL": "node_failed",
}


class WatchesJobs(Protocol):
    """What an attempt needs of its executor: the one watcher of all the executor's jobs."""

    watcher: JobWatcher


class SlurmAttempt:
    def __init__(self, executor: WatchesJobs, launch: Launch, job_id: str, submitted_at: float) -> None:
        self.launch = launch
        self.job_id = job_id
        self.where = f"slurm job {job_id}"
        self.pid: int | None = None  # the step runs on a node, not here
        self.started_at = submitted_at
        self._executor = executor
        self._stopped_by: str | None = None
        self._running_since: float | None = None
        self._out = LogFollower(launch.stdout_path, "stdout", launch.on_line)
        self._err = LogFollower(launch.stderr_path, "stderr", launch.on_line)
        executor.watcher.watch(job_id)

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The outcome once the job ended; None once its script has *run* ``timeout`` seconds (time
        in the queue, or while the node starts the job, does not count)."""
        watcher = self._executor.watcher
        while not watcher.ended(self.job_id):
            if self._running_since is None and watcher.state(self.job_id) not in ("PENDING", "CONFIGURING"):
                if self._launched():
                    self._running_since = time.monotonic()
            if timeout is not None and self._running_since is not None:
                if time.monotonic() - self._running_since >= timeout:
                    return None
            watcher.wait_change(grid.POLL_S)
        reports = self._await_reports()
        self.finish()
        outcome = self._outcome(reports)
        watcher.forget(self.job_id)
        return outcome

    def finish(self) -> None:
        """Read the rest of the job's logs and stop following them."""
        self._out.finish()
        self._err.finish()

    def stop(self, reason: str) -> None:
        self._stopped_by = self._stopped_by or reason
        controller.cancel(self.job_id)

    # -- evidence ----------------------------------------------------------------------
    def _expected_reports(self) -> int:
        return options_of(self.launch).nodes or 1

    def _reports(self) -> list[dict[str, Any]]:
        return grid.read_reports(report_path(self.launch))

    def _launched(self) -> bool:
        """Whether the node started the job's script: Slurm creates its log files first (the folder is
        listed, so that NFS looks again for names it lately found missing)."""
        try:
            names = os.listdir(self.launch.stdout_path.parent)
        except FileNotFoundError:
            return False
        return self.launch.stdout_path.name in names or self.launch.stderr_path.name in names

    def _await_reports(self) -> list[dict[str, Any]]:
        """The job's reports, waited for (``report_wait``) when its script started. A job cancelled
        before its script started (in the queue, or while its node set it up) wrote none."""
        wait_s = options_of(self.launch).report_wait if self._launched() else 0
        return grid.await_reports(report_path(self.launch), self._expected_reports(), wait_s)

    def _outcome(self, reports: list[dict[str, Any]]) -> Outcome:
        expected = self._expected_reports()
        complete = len(reports) >= expected
        unavailable = None
        if complete:
            # The reports decide; Slurm's state only says who stopped the job, if it can say it.
            try:
                slurm = controller.final_state(self.job_id)
            except ExecutorUnavailable as exc:
                slurm, unavailable = None, str(exc)
        else:
            # Nothing else can decide: a silent controller is waited for, not guessed at.
            slurm = controller.final_state(self.job_id, SILENT_CONTROLLER_PATIENCE_S)
        state, code, told_by = slurm if slurm else (None, "", None)
        stopped_by = self._stopped_by or STOPPED_BY_STATE.get(state or "")
        stopped_by_slurm = self._stopped_by is None and stopped_by is not None
        common = {"stderr_tail": list(self._err.tail), "where": self.where, "stopped_by": stopped_by}
        if complete:
            facts = merge_reports(reports)
            evidence = None
            if stopped_by_slurm:
                evidence = f"Slurm's state {state} for job {self.job_id} ({told_by}) and the job's cgroup"
            elif unavailable:
                evidence = f"the job's cgroup; Slurm's state was unavailable: {unavailable}"
            return Outcome(
                exit_code=facts["exit_code"],
                signal=facts["signal"],
                oom_kills_before=facts["oom_kills_before"],
                oom_kills_after=facts["oom_kills_after"],
                oom_at=facts["oom_at"],
                peak_bytes=facts["peak_bytes"],
                anon_peak_bytes=facts["anon_peak_bytes"],
                started_at=facts["started_at"],
                ended_at=facts["ended_at"],
                timeline=[tuple(p) for p in facts["timeline"]],
                thrash=facts.get("thrash"),
                evidence=evidence,
                **common,
            )
        missing = f"{expected - len(reports)} of {expected} in-job report(s) missing"
        if state is None:
            return Outcome.unwatched(
                self.started_at,
                runner_error=(
                    f"job {self.job_id} ended with its in-job report missing, and Slurm no longer "
                    "knows it (scontrol has forgotten it; sacct has no accounting)"
                ),
                **common,
            )
        exit_code, sig = controller.parse_exit_code(code)
        oom = state == "OUT_OF_MEMORY"
        return Outcome.unwatched(
            self.started_at,
            exit_code=None if oom else exit_code,
            signal=signal.SIGKILL if oom else sig,
            oom_kills_after=1 if oom else 0,
            evidence=f"Slurm's state {state}, ExitCode {code} for job {self.job_id} ({told_by}; {missing})",
            **common,
        )
