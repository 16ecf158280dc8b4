"""The Slurm executor: the checks before a run starts, submitting an attempt's job, and taking up
or ending the jobs a runner that died left behind."""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pipeline.run.slurm.controller as controller
from pipeline.memory import MIB, Budget
from pipeline.run import grid
from pipeline.run.executor import AttemptStillRunning, ExecutorError, ExecutorUnavailable, Launch, StepOptions
from pipeline.run.layout import attempt_name
from pipeline.run.slurm.attempt import SlurmAttempt
from pipeline.run.slurm.options import SlurmOptions
from pipeline.run.slurm.script import (
    address_path,
    batch_script,
    job_env,
    report_path,
    sbatch_argv,
    script_path,
)

REAP_WAIT_S = 120.0
"""How long a dead runner's job gets to end after ``scancel`` (Slurm's KillWait is 30 s by default)."""


def _job_id(where: str) -> str:
    return where.rsplit(" ", 1)[-1]


class SlurmExecutor:
    """Runs attempts as Slurm jobs, through the cluster's own commands on this host's PATH."""

    name = "slurm"
    Options = SlurmOptions
    runs_here = False
    admits_by_memory = True
    detached = True
    host_memory = None  # the steps run on the nodes: nothing on this host tells their memory

    def __init__(self, options: SlurmOptions | None = None) -> None:
        self.options = options or SlurmOptions()
        for command in ("sbatch", "squeue", "scontrol", "scancel", "sinfo"):
            if shutil.which(command) is None:
                raise ExecutorError(
                    f"{command} is not on PATH: run eyrie where Slurm's commands are (a login node "
                    "of the cluster), or install the Slurm client"
                )
        self.watcher = controller.squeue_watcher()
        self._unanswered: set[str] = set()
        """Names of jobs whose submission got no answer: looked up before they are submitted again."""

    # -- before anything starts --------------------------------------------------------
    def _partition(self, options: StepOptions | None) -> str:
        """A step's partition: its ``options``'s, else the pipeline's, else Slurm's default."""
        own = options.partition if isinstance(options, SlurmOptions) else None
        return own or self.options.partition or controller.default_partition()

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """What one step can have: the largest node's memory in its partition. Slurm admits jobs by
        their --mem."""
        partition = self._partition(options)
        largest = max(node.memory_mib for node in controller.nodes_of({partition})) * MIB
        return Budget(
            available=largest,
            mem_total=largest,
            mem_available=largest,
            cgroup_version=None,
            binding=f"the largest node in Slurm's partition {partition}; the cluster admits steps by "
            "their --mem",
        )

    def gpu_capacity(self, options: StepOptions | None = None) -> tuple[int, str]:
        """The most GPUs one job can have: those of the node of its partition with the most (its
        Gres); and the words a refusal ends with."""
        partition = self._partition(options)
        gpus = max(node.gpus for node in controller.nodes_of({partition}))
        return gpus, f"a node of Slurm's partition {partition} has at most (its Gres)"

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        """The run directory must be one the nodes see: on a shared filesystem, or the nodes are this host."""
        point, fstype, source = grid.mount_of(run_dir.resolve())
        if fstype in grid.SHARED_FILESYSTEMS:
            return
        partitions = {o.partition if isinstance(o, SlurmOptions) else None for o in options.values()}
        me = {grid.short_hostname(socket.gethostname()), grid.short_hostname(socket.getfqdn())}
        nodes = controller.nodes_of(partitions)
        others = sorted({node.name for node in nodes if grid.short_hostname(node.hostname) not in me})
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise ExecutorError(
                f"the run directory {run_dir} is on {fstype or 'a local filesystem'} ({source or point}) "
                f"of {socket.gethostname()}, which Slurm's nodes {shown} cannot see; put it on a "
                "filesystem the nodes share (NFS, Lustre, GPFS, BeeGFS, CephFS): --run-dir /shared/…"
            )

    # -- attempts ----------------------------------------------------------------------
    def start(self, launch: Launch) -> SlurmAttempt:
        launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        os.makedirs(launch.cwd, exist_ok=True)
        grid.remove_reports(report_path(launch))
        address_path(launch).unlink(missing_ok=True)
        script = script_path(launch)
        script.write_text(batch_script(launch), encoding="utf-8")
        env = job_env(launch)
        name = attempt_name(launch.run_id, launch.step, launch.attempt)
        submitted_at = time.time()
        if name in self._unanswered:  # asked before without an answer: it may be there already
            found = controller.job_named(name)
            if found:
                return SlurmAttempt(self, launch, found, submitted_at)
        said = ""
        for delay in controller.retry_delays(sum(controller.ANSWER_WAITS_S)):
            time.sleep(delay)
            try:
                result = controller.run_once(*sbatch_argv(launch, script), env=env)
            except ExecutorUnavailable as exc:
                said = str(exc)
            else:
                if result.returncode == 0:
                    self._unanswered.discard(name)
                    return SlurmAttempt(self, launch, result.stdout.strip().split(";")[0], submitted_at)
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
                return SlurmAttempt(self, launch, found, submitted_at)
        raise ExecutorUnavailable(
            f"step {launch.step}: the Slurm controller did not answer sbatch for "
            f"{sum(controller.ANSWER_WAITS_S):.0f} s ({said})"
        )

    @staticmethod
    def service_host(handle: SlurmAttempt) -> str | None:
        """A replica's node, by the address its job wrote once it ran there; None while it waits in
        the queue."""
        try:
            return address_path(handle.launch).read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def resume(self, where: str, launch: Launch) -> SlurmAttempt | None:
        """The job of a runner that died, by its id: watched again while Slurm knows it or its
        report is there (it may have ended meanwhile); else None. ExecutorUnavailable while the
        controller cannot say."""
        job_id = _job_id(where)
        if controller.job_state(job_id) is None and not report_path(launch).exists():
            return None
        # What the job wrote while nobody followed its logs was shown then by nobody: shown now.
        return SlurmAttempt(self, launch, job_id, time.time())

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        """``scancel`` the job, and wait until Slurm says it ended (AttemptStillRunning if it does
        not). The job id is the attempt's identity; its processes live on the nodes."""
        job_id = _job_id(where)
        state = controller.job_state(job_id)
        if state is None or state in controller.ENDED_STATES:
            return 0
        cancelled = controller.cancel(job_id)
        deadline = time.monotonic() + REAP_WAIT_S
        while (state := controller.job_state(job_id)) is not None and state not in controller.ENDED_STATES:
            if cancelled.returncode != 0:  # refused, and not because the job had ended meanwhile
                refused = f"{where} is {state}; scancel refused: {controller.last_line(cancelled)}"
                raise AttemptStillRunning([], where, refused)
            if time.monotonic() >= deadline:
                raise AttemptStillRunning(
                    [],
                    where,
                    f"{where} is still {state} {REAP_WAIT_S:.0f} s after scancel and may still "
                    "write its outputs; end it (scancel, or ask the cluster's admins), then run again",
                )
            time.sleep(grid.POLL_S)
        return 1
