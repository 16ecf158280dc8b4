"""A run directory between runners: one at a time, and what a runner killed without warning left.

The lock (``lock_run_dir``) keeps two runners out of one run directory; should its file be removed,
the runner the ledger records as running, alive on this host, still does. A runner that died leaves
attempts marked ``running`` in the ledger: the next run (``close_orphans``) watches again those
their executor can hand back (a Slurm job outlives its runner) and closes the others as
``cancelled``, after ending what is left of them.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.contract.step import STATE_DIR
from pipeline.memory import CgroupError
from pipeline.run.executor import (
    AttemptStillRunning,
    Executor,
    ExecutorError,
    Launch,
    RunningAttempt,
    executor_class,
)
from pipeline.run.fingerprint import step_fingerprint
from pipeline.run.ledger import AttemptRow, Ledger, RunState
from pipeline.run.liveness import runner_alive_here
from pipeline.run.services import AdoptedReplica, recorded_port, replica_launch
from pipeline.run.spec import PipelineSpec, StepSpec
from pipeline.run.step_inputs import expand_command
from pipeline.run.verdict import Verdict

LaunchFor = Callable[[StepSpec, int, list[str], str, int, Executor], Launch]
"""What an attempt is launched with: (step, attempt, argv, fingerprint, limit, executor)."""


class RunDirBusy(RuntimeError):
    pass


@dataclass
class Resumed:
    """An attempt of a runner that died, handed back by its executor, to be waited for again."""

    row: AttemptRow
    step: StepSpec
    launch: Launch
    handle: RunningAttempt
    fingerprint: str
    detached: bool


def lock_run_dir(run_dir: Path) -> _Unlock:
    """Hold the run directory for this process (its pid in the lock file, for whoever finds it
    busy), or raise RunDirBusy naming the pid that holds it."""
    _lock_path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    fh = open(_lock_path(run_dir), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        fh.close()
        raise RunDirBusy(
            f"{run_dir} is in use by eyrie pid {holder}; wait for it, or use another --run-dir"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(str(os.getpid()))
    fh.flush()
    return _Unlock(fh)


def _lock_path(run_dir: Path) -> Path:
    return run_dir / STATE_DIR / "lock"


def refuse_beside_a_live_runner(ledger: Ledger, run_dir: Path) -> None:
    """Raise RunDirBusy when the ledger holds a run whose runner still runs on this host, though
    this process got the lock: its lock file was removed. Its attempts are not orphans."""
    for run in ledger.runs():
        pid = run["orchestrator_pid"]
        # This process holds the lock: a run under its own pid (an earlier one in it) has ended.
        if run["state"] == RunState.RUNNING and pid != os.getpid() and runner_alive_here(run):
            raise RunDirBusy(
                f"{run_dir} is in use by eyrie pid {pid}, running {run['run_id']}, though its lock "
                f"{_lock_path(run_dir)} was removed; wait for it, or stop it (kill -TERM {pid}), then "
                "run again"
            )


class _Unlock:
    def __init__(self, fh) -> None:
        self.fh = fh

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()


def close_orphans(
    ledger: Ledger,
    spec: PipelineSpec,
    pipeline_path: Path,
    run_dir: Path,
    executor: Executor,
    launch: LaunchFor,
    note: Callable[[str], None],
) -> list[Resumed | AdoptedReplica]:
    """Attempts still 'running' belong to a runner that died. Each is seen to by the executor
    that started it (whatever this run's, ``executor``, is). Those it can watch again (a Slurm job,
    found by its id) are handed back, to be waited for like any other, when their step is unchanged
    (a service's replica, when its service's command is: it goes on serving); what is left of the
    others is ended where the ledger says they ran and recorded cancelled. One that cannot be
    stopped, or that ran on another host, stays 'running', and nothing starts."""
    refuse_beside_a_live_runner(ledger, run_dir)
    executors = {executor.name: executor}
    resumed: list[Resumed | AdoptedReplica] = []
    stuck = []
    hosts = {run["run_id"]: run["host"] for run in ledger.runs()}
    for row in ledger.running_attempts():
        row_executor = _executor_of(row, spec, executors)
        host = hosts.get(row.run_id)
        if not row_executor.detached and host and host != socket.gethostname():
            here = socket.gethostname()
            stuck.append(
                f"{row.step} attempt {row.attempt} of an earlier run ran on {host} ({row.location}) "
                f"and may still run there, where this host ({here}) cannot see it; run again on {host}"
            )
            continue
        try:
            if row.replica is None:
                found, why_not = _resume(row, row_executor, spec, pipeline_path, run_dir, launch)
            else:
                found, why_not = _adopt(row, row_executor, spec, pipeline_path, run_dir)
            if found is not None:
                resumed.append(found)
                note(
                    f"{row.label} attempt {row.attempt}: the runner (pid {row.orchestrator_pid}) stopped "
                    f"before it ended; found it again ({found.handle.where}), waiting for it"
                )
                continue
            killed = row_executor.reap(row.location, row.pid, row.started_at) if row.location else 0
        except AttemptStillRunning as exc:
            stuck.append(f"{row.step} attempt {row.attempt} of an earlier run: {exc}")
            continue
        except ExecutorError as exc:  # e.g. a controller that does not answer: it may still run
            raise ExecutorError(
                f"{row.step} attempt {row.attempt} of an earlier run ({row.location}) may still run, "
                f"and cannot be checked: {exc}"
            ) from None
        reason = (
            f"the runner (pid {row.orchestrator_pid}) stopped before this attempt ended; "
            f"found at the next run{why_not}, {killed} leftover process(es) killed"
        )
        ledger.end_attempt(
            row.id,
            verdict=Verdict.CANCELLED.value,
            reason=reason,
            fields={"ended_at": time.time()},
            timeline=[],
        )
        note(f"{row.step} attempt {row.attempt}: {reason}")
    if stuck:
        raise RunDirBusy(f"{run_dir} is in use: {'; '.join(stuck)}")
    latest = ledger.latest_run()
    if latest and latest["state"] == RunState.RUNNING:
        ledger.end_run(latest["run_id"], RunState.CANCELLED)
    return resumed


def _executor_of(row: AttemptRow, spec: PipelineSpec, executors: dict[str, Executor]) -> Executor:
    """The executor that started an attempt (by its name in the registry): no other can see it.
    Each is made once, and kept in ``executors``."""
    if row.executor not in executors:
        try:
            cls = executor_class(row.executor)
            executors[row.executor] = cls(spec.executor_options(row.executor))
        except (ExecutorError, CgroupError) as exc:
            raise ExecutorError(
                f"{row.step} attempt {row.attempt} of an earlier run ran under the {row.executor} "
                f"executor ({row.location}) and may still run, but that executor cannot be used here "
                f"({exc}); run again with --executor {row.executor}"
            ) from None
    return executors[row.executor]


def _resume(
    row: AttemptRow,
    executor: Executor,
    spec: PipelineSpec,
    pipeline_path: Path,
    run_dir: Path,
    launch: LaunchFor,
) -> tuple[Resumed | None, str]:
    """The attempt of a dead runner watched again, or None and why not (for the cancel reason)."""
    if not row.location:
        return None, ""
    try:
        step = spec.step(row.step)
    except KeyError:
        return None, " (its step is no longer in the pipeline)"
    argv = expand_command(pipeline_path, run_dir, step)
    if json.loads(row.argv) != argv:
        return None, " (its step's command changed)"
    fingerprint = step_fingerprint(spec, pipeline_path, run_dir, step, argv)
    attempt_launch = launch(step, row.attempt, argv, fingerprint, row.limit_bytes, executor)
    handle = executor.resume(row.location, attempt_launch)
    if handle is None:
        return None, ""
    return Resumed(row, step, attempt_launch, handle, fingerprint, executor.detached), ""


def _adopt(
    row: AttemptRow, executor: Executor, spec: PipelineSpec, pipeline_path: Path, run_dir: Path
) -> tuple[AdoptedReplica | None, str]:
    """A dead runner's service replica, to go on with when its executor finds it again (a Slurm job)
    and its command is the file's (with some port); or None and why not (for the cancel reason)."""
    if not row.location:
        return None, ""
    try:
        service = spec.service(row.step)
    except KeyError:
        return None, " (its service is no longer in the pipeline)"
    port = None if service.external else recorded_port(pipeline_path, run_dir, service, json.loads(row.argv))
    if port is None or row.replica > service.replicas:
        return None, " (its service's command or replicas changed)"
    options = spec.executor_options(executor.name, service.name)
    launch = replica_launch(
        pipeline_path, run_dir, row.run_id, service, attempt=row.attempt, port=port, options=options
    )
    handle = executor.resume(row.location, launch)
    if handle is None:
        return None, ""
    return AdoptedReplica(service.name, row.replica, port, row.id, launch, handle), ""
