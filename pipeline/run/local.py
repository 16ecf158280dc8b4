"""The local executor: each attempt is a process tree in a child cgroup of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from pipeline.memory import Budget, Cgroup, CgroupError, current_cgroup, memory_budget, step_parent
from pipeline.run.executor import (
    STOP_GRACE_S,
    AttemptStillRunning,
    Launch,
    LineCapture,
    Outcome,
    StepOptions,
)
from pipeline.run.host_gpus import host_gpus
from pipeline.run.liveness import START_SLACK_S, alive, proc_stat
from pipeline.run.liveness import started_at as process_started_at
from pipeline.run.monitor import CgroupMonitor

# A recorded pid is the attempt's own only if that process began with the attempt (not a later
# process given the same pid): within this many seconds of the recorded start.
PID_START_MATCH_S = 10.0

# The process joins its cgroup before it execs the step, so nothing the step
# allocates is ever charged elsewhere; `exec` keeps the step's pid = this pid.
_TRAMPOLINE = 'echo $$ > "$1" || exit 126; shift; exec "$@"'


class LocalAttempt:
    def __init__(self, launch: Launch, cgroup: Cgroup) -> None:
        self.launch = launch
        self.cgroup = cgroup
        self.where = str(cgroup.path)
        self._stopped_by: str | None = None
        self.started_at = time.time()
        env = {**launch.env, "PYTHONUNBUFFERED": "1"}
        self.monitor = CgroupMonitor(cgroup, on_thrash=lambda: cgroup.kill_all(signal.SIGKILL))
        self.proc = subprocess.Popen(
            ["/bin/sh", "-c", _TRAMPOLINE, "eyrie-step", str(cgroup.path / "cgroup.procs"), *launch.argv],
            cwd=launch.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the console's Ctrl-C reaches the runner, which stops steps itself
        )
        self.pid: int | None = self.proc.pid
        self.monitor.start()
        self._out = LineCapture(self.proc.stdout, launch.stdout_path, "stdout", launch.on_line)
        self._err = LineCapture(self.proc.stderr, launch.stderr_path, "stderr", launch.on_line)

    def wait(self, timeout: float | None = None) -> Outcome | None:
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        ended_at = time.time()
        # Children may outlive the main process; they belong to the attempt and end with it.
        if self.cgroup.procs():
            self.cgroup.kill_all(signal.SIGKILL)
            self._wait_empty(STOP_GRACE_S)
        self._out.join(idle=2)
        self._err.join(idle=2)
        report = self.monitor.finish()
        self.cgroup.remove()
        return Outcome(
            exit_code=status if status >= 0 else None,
            signal=-status if status < 0 else None,
            oom_kills_before=report.oom_kills_before,
            oom_kills_after=report.oom_kills_after,
            oom_at=report.oom_at,
            peak_bytes=report.peak_bytes,
            anon_peak_bytes=report.anon_peak_bytes,
            started_at=self.started_at,
            ended_at=ended_at,
            timeline=report.timeline,
            stopped_by=self._stopped_by,
            stderr_tail=list(self._err.tail),
            where=self.where,
            thrash=report.thrash,
            log_error=self._out.write_error or self._err.write_error,
        )

    def stop(self, reason: str) -> None:
        self._stopped_by = self._stopped_by or reason
        self.cgroup.kill_all(signal.SIGTERM)
        if not self._wait_empty(STOP_GRACE_S):
            self.cgroup.kill_all(signal.SIGKILL)

    def _wait_empty(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not self.cgroup.procs():
                return True
            time.sleep(0.05)
        return False


class LocalExecutor:
    """Runs attempts as local processes, each in ``<this cgroup>/eyrie/<run>-<step>-<attempt>``."""

    name = "local"
    Options = StepOptions
    runs_here = True
    admits_by_memory = False
    detached = False

    def __init__(self, options: StepOptions | None = None, parent: Cgroup | None = None) -> None:
        self.parent = parent or step_parent()

    def cgroup_for(self, launch: Launch) -> Cgroup:
        return self.parent.child(f"{launch.run_id}-{launch.step}-{launch.attempt}")

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """Steps run under this process's cgroup: they share what this process really has."""
        return memory_budget()

    host_memory = memory_budget

    @staticmethod
    def gpu_capacity(options: StepOptions | None = None) -> tuple[int, str]:
        """The steps and services share this host's GPUs."""
        return host_gpus(), "this host has (its PCI bus)"

    @staticmethod
    def service_host(handle: object) -> str:
        """A replica is a process on this host: reached on its loopback."""
        return "127.0.0.1"

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        """Kill what is left in the attempt's cgroup, at the path recorded (the runner that starts
        again may run in another cgroup: another SSH session, another systemd scope); where that
        cgroup is gone, its main process's group: the main process too if it is still the same one.
        (The orchestrator sees first that the ledger's run ran on this host.)"""
        cgroup = self._recorded_cgroup(where)
        if cgroup is not None and cgroup.exists():
            killed = cgroup.kill_all()
            left = _wait_gone(cgroup.procs)
            cgroup.remove()
        elif pid is not None and (not alive(pid) or _started_within(pid, started_at, PID_START_MATCH_S)):
            # The step was started in a session of its own: its children share its process group,
            # whose id is the main process's pid. Linux gives no new process a pid still in use as
            # a group's id, so the group's members are the attempt's, even once the main process died.
            members = sorted({*([pid] if alive(pid) else []), *_group_members(pid)})
            killed = _kill(members)
            left = _wait_gone(lambda: [p for p in members if alive(p)])
        else:
            return 0
        if left:
            raise AttemptStillRunning(left, where)
        return killed

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        return None  # nothing to check before a step starts

    def resume(self, where: str, launch: Launch) -> None:
        """A step process whose runner died cannot be waited for (it is not our child): reap it."""
        return None

    def _recorded_cgroup(self, where: str) -> Cgroup | None:
        """The cgroup at the recorded path, if it is one a step ran in: under this hierarchy's mount,
        not this process's own cgroup or an ancestor of it, and with no cgroups of its own."""
        try:
            relative = Path(where).relative_to(self.parent.mount)
        except ValueError:
            return None
        cgroup = type(self.parent)(self.parent.mount, str(relative))
        if cgroup in current_cgroup().ancestors() or any(p.is_dir() for p in cgroup.path.glob("*/")):
            return None
        return cgroup

    def start(self, launch: Launch) -> LocalAttempt:
        cgroup = self.cgroup_for(launch)
        if cgroup.exists():  # left by a crashed earlier runner with the same run id
            cgroup.kill_all()
            cgroup.remove()
        cgroup.create()
        try:
            cgroup.set_limit(launch.limit_bytes)
        except CgroupError:
            cgroup.remove()
            raise
        launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        os.makedirs(launch.cwd, exist_ok=True)
        return LocalAttempt(launch, cgroup)


def _wait_gone(members, seconds: float = STOP_GRACE_S) -> list[int]:
    """Wait until ``members()`` lists no process; what it still lists after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := members()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _started_within(pid: int, started_at: float, seconds: float) -> bool:
    began = process_started_at(pid)
    return began is not None and started_at - START_SLACK_S <= began <= started_at + seconds


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return [pid for pid in members if alive(pid)]


def _kill(pids: list[int]) -> int:
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed
