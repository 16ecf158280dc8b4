"""What every executor that hands its attempts to a cluster's batch engine (Slurm; PBS or LSF alike)
needs, whatever the engine: its steps run on the cluster's nodes, and the runner sees them only
through the engine's controller and through the run directory, on a filesystem the nodes share.

An engine is one ``GridEngine``: what it writes is only its own —

- ``directives``: what a job asks of it (memory, time, GPUs, its name and logs), in its options;
- ``submit``: hand it the job's script with them, and read the job's id from its answer;
- ``queue``: ask it once about many jobs, its state names read as the grid's (``Phase``);
- ``cancel``: end a job;

and, where it has them, its accounting of how a job ended (``final_state``), a job script of its
own (several nodes), and how many nodes a step asks for. The rest is here, the same for every
engine, as Nextflow's ``AbstractGridExecutor`` and ``GridTaskHandler`` hold it:

- The run directory must be on a filesystem the nodes share (``mount_of``, ``SHARED_FILESYSTEMS``).
- The job's script runs the step under the in-job wrapper (``job_script``), which writes its report
  beside the logs.
- The runner asks the engine about all its jobs at once, every ``POLL_S`` (``JobWatcher``).
- It follows the logs a job writes (``LogFollower``), and once the job ended waits for the in-job
  wrapper's report (``await_reports``): on NFS a file a node wrote last may show here only later.
- An attempt's outcome (``GridAttempt``): the reports decide; the engine's final state only says who
  stopped the job (its time limit, someone's cancel, preemption, a lost node), or stands in for a
  missing report; a step's timeout counts from when its script started, not while it waited.
- Submitting, taking up the job of a runner that died, and cancelling it (``GridExecutor``).
"""

from __future__ import annotations

import enum
import json
import os
import shlex
import signal
import socket
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from pipeline.contract.step import SERVICE_PORT_ENV
from pipeline.run.executor import (
    STDERR_TAIL_LINES,
    AttemptStillRunning,
    ExecutorError,
    ExecutorUnavailable,
    Launch,
    LineSink,
    Outcome,
    StepOptions,
)

POLL_S = 1.0
"""How often the runner asks the batch engine about its jobs (one call for all of them)."""
REPORT_WAIT_S = 270.0
"""How long the runner waits, after a job ended, for its report to show on the shared filesystem
(NFS caches attributes and missing names for up to a minute): as Nextflow's exitReadTimeout."""
SILENT_CONTROLLER_PATIENCE_S = 3600.0
"""How long the runner keeps asking a silent controller how a job ended when the job's report is
missing, rather than deciding without it."""
REAP_WAIT_S = 120.0
"""How long the job of a runner that died gets to end after it was cancelled (Slurm's KillWait,
from its SIGTERM to its SIGKILL, is 30 s by default)."""
LOG_FOLLOW_S = 0.2
WRAPPER = [sys.executable, "-m", "pipeline.run.container_init"]
"""The in-job wrapper (the one a step container has): it reads the job's own cgroup from inside,
and writes its report, because the engine removes that cgroup when the job ends."""

# Filesystems that several hosts mount: a run directory on one of them can be shared with the nodes.
SHARED_FILESYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "lustre",
        "gpfs",
        "beegfs",
        "cephfs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "panfs",
        "wekafs",
        "fuse.juicefs",
        "cifs",
        "smb3",
        "virtiofs",
        "9p",
    }
)


def mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount that holds ``path``."""
    best = ("/", "", "")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].replace("\\040", " ")
        fstype, source = (right.split() + ["", ""])[:2]
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best[0]):
            best = (point, fstype, source)
    return best


def short_hostname(host: str) -> str:
    return host.split(".", 1)[0]


# -- what an engine says, in the grid's words -----------------------------------------------------


class Phase(enum.Enum):
    """Where a job is, whatever the engine calls it."""

    QUEUED = "queued"
    """Waiting for its node, or its node still sets it up: its script has not started."""
    RUNNING = "running"
    """Its script may have started (the runner looks for the log files the job opens first)."""
    ENDED = "ended"


class JobState(NamedTuple):
    phase: Phase
    said: str
    """The engine's own name for the state (Slurm's CONFIGURING), for what the runner says."""


class JobEnd(NamedTuple):
    """How the engine says a job ended, once it ended (Slurm's accounting)."""

    state: str
    """The engine's own name for its final state (Slurm's OUT_OF_MEMORY)."""
    exit_status: str
    """Its exit status in the engine's words (``ExitCode 0:125``)."""
    told_by: str
    """Which of its commands said so."""
    exit_code: int | None
    signal: int | None
    oom: bool
    """The engine says memory ended the job; it cannot say whose (a child's OOM kill alike)."""
    stopped_by: str | None
    """Who stopped the job when not the step itself: 'timeout' (its time limit), 'cancel' (someone
    else's), 'preempted', 'node_failed'."""


class GridEngine(ABC):
    """A cluster's batch engine, as the grid asks it. ``submit``, ``queue`` and ``cancel`` are each
    engine's own; the rest has defaults that suit an engine without accounting or several nodes.

    A controller that does not answer is asked again, for a while, by every method: its silence is
    never taken for an answer ("the job is gone", "no such job was submitted"), but raised as an
    ExecutorUnavailable (``queue`` alone answers None: the watcher asks again a second later).
    """

    name: str
    """Its attempts' ``where`` (``slurm job 812``), and its files' names (``attempt-2.slurm.json``)."""
    title: str
    """Its name in what the runner says (``Slurm's state TIMEOUT``)."""
    cancel_command = "cancel"
    """What ends a job, in what the runner says (``scancel``)."""
    forgets = "it no longer lists the job, and keeps no accounting"
    """Why the engine may no longer know how a job ended."""

    def directives(self, launch: Launch) -> list[str]:
        """What the job asks of the engine (memory, time limit, GPUs, its name, working directory and
        logs), as the engine's options, for ``submit``. None asked: the engine's defaults."""
        return []

    @abstractmethod
    def submit(self, launch: Launch, script: Path, directives: list[str]) -> str:
        """Hand the job's ``script`` to the engine with its ``directives``: the job's id. Never twice:
        a submission whose answer was lost is looked for before it is made again."""

    @abstractmethod
    def queue(self, job_ids: list[str]) -> dict[str, JobState] | None:
        """One question for all of ``job_ids``: the states of those the engine lists (one it no
        longer lists has ended and been forgotten), or None when it did not answer."""

    @abstractmethod
    def cancel(self, job_id: str) -> str | None:
        """End the job: None once the engine took the cancel; what it said when it refused."""

    def job_state(self, job_id: str) -> JobState | None:
        """The job's state, or None only when the engine says it does not know the job."""
        listed = self.queue([job_id])
        if listed is None:
            raise ExecutorUnavailable(f"{self.title} did not say what became of job {job_id}")
        return listed.get(job_id)

    def final_state(self, job_id: str, patience_s: float | None = None) -> JobEnd | None:
        """How the job ended, or None when the engine no longer knows it (or keeps no accounting).
        A controller that does not answer is asked again for ``patience_s``."""
        return None

    def nodes(self, launch: Launch) -> int:
        """On how many nodes the step runs: one in-job report each."""
        return 1

    def report_wait(self, launch: Launch) -> float:
        """How long to wait, after the job ended, for its reports to show on the shared filesystem."""
        return REPORT_WAIT_S

    def report_path(self, launch: Launch) -> Path:
        """Where the in-job wrapper writes its report (several nodes: one each, ``….node-N.json``)."""
        return launch.stderr_path.with_name(f"attempt-{launch.attempt}.{self.name}.json")

    def script_path(self, launch: Launch) -> Path:
        """Where the job's script is written, beside its logs."""
        return launch.stderr_path.with_name(f"attempt-{launch.attempt}.{self.name}.sh")

    def job_script(self, launch: Launch) -> str:
        """The job's script: the step under the in-job wrapper, on one node."""
        return job_script(launch, self.report_path(launch))


class JobWatcher:
    """The states of every job the runner waits for, as the engine says them: one question for all
    of them every ``POLL_S`` (``engine.queue``). An engine that does not answer changes nothing:
    silence is no answer."""

    def __init__(self, engine: GridEngine) -> None:
        self.engine = engine
        self._states: dict[str, JobState | None] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, job_id: str) -> None:
        with self._changed:
            self._states.setdefault(job_id, JobState(Phase.QUEUED, "submitted"))
            if self._thread is None:
                name = f"{self.engine.name}-queue"
                self._thread = threading.Thread(target=self._poll, name=name, daemon=True)
                self._thread.start()

    def state(self, job_id: str) -> JobState | None:
        """The job's last state seen; None once the engine no longer lists it (ended and forgotten)."""
        with self._changed:
            return self._states[job_id]

    def ended(self, job_id: str) -> bool:
        state = self.state(job_id)
        return state is None or state.phase is Phase.ENDED

    def wait_change(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def forget(self, job_id: str) -> None:
        with self._changed:
            self._states.pop(job_id, None)

    def close(self) -> None:
        """Stop asking (the runner is done with its jobs)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join()

    def _poll(self) -> None:
        while not self._closed.is_set():
            with self._changed:
                ids = [
                    job
                    for job, state in self._states.items()
                    if state is not None and state.phase is not Phase.ENDED
                ]
            if ids:
                self._ask(ids)
            self._closed.wait(POLL_S)

    def _ask(self, ids: list[str]) -> None:
        listed = self.engine.queue(ids)
        if listed is None:
            return  # no answer this time: ask again, never conclude from silence
        with self._changed:
            for job in ids:
                self._states[job] = listed.get(job)  # not listed: ended, and already forgotten
            self._changed.notify_all()


class LogFollower:
    """Follows a log file a job writes on the shared filesystem: lines to the sink, last lines kept."""

    def __init__(self, path: Path, name: str, sink: LineSink | None) -> None:
        self._path, self._name, self._sink = path, name, sink
        self.tail: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._follow, name=f"follow-{name}", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        handle = None
        pending = b""
        reopened = False
        while True:
            finishing = self._done.is_set()
            if finishing and not reopened:
                # A handle opened while the node wrote may not see its last writes on NFS: opening
                # the file again revalidates it (close-to-open), and the read goes on where it was.
                reopened = True
                offset = handle.tell() if handle is not None else 0
                if handle is not None:
                    handle.close()
                handle = _open_fresh(self._path)
                if handle is not None:
                    handle.seek(offset)
            if handle is None and not finishing and self._path.exists():
                handle = open(self._path, "rb")
            chunk = handle.read() if handle is not None else b""
            if chunk:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    self._emit(raw.decode("utf-8", errors="replace"))
            elif finishing:
                break
            else:
                time.sleep(LOG_FOLLOW_S)
        if pending:
            self._emit(pending.decode("utf-8", errors="replace"))
        if handle is not None:
            handle.close()

    def _emit(self, line: str) -> None:
        self.tail.append(line)
        if len(self.tail) > STDERR_TAIL_LINES:
            del self.tail[0]
        if self._sink is not None:
            self._sink(self._name, line)

    def finish(self, timeout: float = 5.0) -> None:
        """Read what is left (the job has ended) and stop."""
        self._done.set()
        self._thread.join(timeout)


def _open_fresh(path: Path):
    """``path`` opened for reading after listing its folder, so that NFS looks again for a name it
    lately found missing; None when it is not there."""
    try:
        if path.name not in os.listdir(path.parent):
            return None
        return open(path, "rb")
    except FileNotFoundError:
        return None


# -- the job's script -------------------------------------------------------------------------


def address_path(launch: Launch) -> Path:
    """Where a service's job writes the address of the node it runs on, once it runs there."""
    return launch.stderr_path.with_name(f"attempt-{launch.attempt}.address")


def _say_address(launch: Launch) -> str:
    """The line that writes the node's own address (its first IP; its name where it has none), so
    that a replica's URL never rests on the login node resolving the node's name."""
    target = shlex.quote(str(address_path(launch)))
    return (
        "addr=$(hostname -I 2>/dev/null | awk '{print $1}'); [ -n \"$addr\" ] || addr=$(hostname -f); "
        f'printf "%s\\n" "$addr" > {target}.tmp && mv {target}.tmp {target}'
    )


def script_head(launch: Launch) -> list[str]:
    """The first lines of every job's script: what it is, and, for a service's replica, where it listens."""
    lines = ["#!/bin/sh", f"# eyrie: run {launch.run_id}, step {launch.step}, attempt {launch.attempt}"]
    if SERVICE_PORT_ENV in launch.step_env:
        lines.append(_say_address(launch))
    return lines


def job_script(launch: Launch, report: Path) -> str:
    """A job's script that runs the step on one node, under the in-job wrapper."""
    run = f"exec {shlex.join([*WRAPPER, str(report), '--'])} {shlex.join(launch.argv)}"
    return "\n".join([*script_head(launch), run]) + "\n"


# -- the in-job wrapper's reports: ``report``, or with several nodes one per node, ``<report>.node-N.json``


def remove_reports(report: Path) -> None:
    """Remove an earlier try's reports, so that none is taken for this attempt's."""
    for stale in [report, *report.parent.glob(f"{report.name}.node-*.json")]:
        stale.unlink(missing_ok=True)


def read_reports(report: Path) -> list[dict[str, Any]]:
    """The reports there are now: the per-node ones, else ``report`` itself."""
    try:  # listing the folder makes NFS look again for names it lately found missing
        names = os.listdir(report.parent)
    except FileNotFoundError:
        return []
    per_node = sorted(n for n in names if n.startswith(f"{report.name}.node-") and n.endswith(".json"))
    reports = []
    for name in per_node or [report.name]:
        try:
            reports.append(json.loads((report.parent / name).read_text(encoding="utf-8")))
        except (FileNotFoundError, ValueError):
            continue
    return reports


def await_reports(report: Path, expected: int, wait_s: float) -> list[dict[str, Any]]:
    """The reports, waited for up to ``wait_s`` until ``expected`` of them are there (a job that
    ended may show its last files on the shared filesystem only later)."""
    deadline = time.monotonic() + wait_s
    while len(reports := read_reports(report)) < expected and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return reports


def merge_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One node's report, or several nodes' as one: the node that failed first decides the exit
    status, OOM kills add up, the peak and timeline are the largest node's."""
    if len(reports) == 1:
        return reports[0]
    failed = [r for r in reports if r["exit_code"] != 0]
    decisive = min(failed, key=lambda r: r["ended_at"]) if failed else reports[0]
    largest = max(reports, key=lambda r: r["peak_bytes"] or 0)
    ooms = [r["oom_at"] for r in reports if r["oom_at"] is not None]
    return {
        "exit_code": decisive["exit_code"],
        "signal": decisive["signal"],
        "oom_kills_before": sum(r["oom_kills_before"] for r in reports),
        "oom_kills_after": sum(r["oom_kills_after"] for r in reports),
        "oom_at": min(ooms) if ooms else None,
        "peak_bytes": largest["peak_bytes"],
        "anon_peak_bytes": max((r["anon_peak_bytes"] or 0) for r in reports) or None,
        "started_at": min(r["started_at"] for r in reports),
        "ended_at": max(r["ended_at"] for r in reports),
        "timeline": largest["timeline"],
        "thrash": next((r["thrash"] for r in reports if r.get("thrash")), None),
    }


# -- one attempt as one job ---------------------------------------------------------------------


class WatchesJobs(Protocol):
    """What an attempt needs of its executor: the one watcher of all the executor's jobs (which
    knows the engine it asks)."""

    watcher: JobWatcher


def job_id_of(where: str) -> str:
    """The job's id in an attempt's ``where`` (``slurm job 812``)."""
    return where.rsplit(" ", 1)[-1]


class GridAttempt:
    """One attempt as one job: followed while it runs, then told from its evidence, the in-job
    reports first, the engine's final state saying who stopped the job or standing in for a
    missing report."""

    def __init__(self, executor: WatchesJobs, launch: Launch, job_id: str, submitted_at: float) -> None:
        self.launch = launch
        self.job_id = job_id
        self._executor = executor
        self._engine = executor.watcher.engine
        self.where = f"{self._engine.name} job {job_id}"
        self.pid: int | None = None  # the step runs on a node, not here
        self.started_at = submitted_at
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
            if self._running_since is None and self._may_run(watcher.state(self.job_id)):
                if self._launched():
                    self._running_since = time.monotonic()
            if timeout is not None and self._running_since is not None:
                if time.monotonic() - self._running_since >= timeout:
                    return None
            watcher.wait_change(POLL_S)
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
        self._engine.cancel(self.job_id)

    # -- evidence ----------------------------------------------------------------------
    @staticmethod
    def _may_run(state: JobState | None) -> bool:
        return state is None or state.phase is not Phase.QUEUED

    def _reports(self) -> list[dict[str, Any]]:
        return read_reports(self._engine.report_path(self.launch))

    def _launched(self) -> bool:
        """Whether the node started the job's script: the engine creates its log files first (the
        folder is listed, so that NFS looks again for names it lately found missing)."""
        try:
            names = os.listdir(self.launch.stdout_path.parent)
        except FileNotFoundError:
            return False
        return self.launch.stdout_path.name in names or self.launch.stderr_path.name in names

    def _await_reports(self) -> list[dict[str, Any]]:
        """The job's reports, waited for (``report_wait``) when its script started. A job cancelled
        before its script started (in the queue, or while its node set it up) wrote none."""
        wait_s = self._engine.report_wait(self.launch) if self._launched() else 0
        return await_reports(self._engine.report_path(self.launch), self._engine.nodes(self.launch), wait_s)

    def _outcome(self, reports: list[dict[str, Any]]) -> Outcome:
        expected = self._engine.nodes(self.launch)
        unavailable = None
        if len(reports) >= expected:
            # The reports decide; the engine's state only says who stopped the job, if it can say it.
            try:
                end = self._engine.final_state(self.job_id)
            except ExecutorUnavailable as exc:
                end, unavailable = None, str(exc)
        else:
            # Nothing else can decide: a silent controller is waited for, not guessed at.
            end = self._engine.final_state(self.job_id, SILENT_CONTROLLER_PATIENCE_S)
        stopped_by = self._stopped_by or (end.stopped_by if end else None)
        common = {"stderr_tail": list(self._err.tail), "where": self.where, "stopped_by": stopped_by}
        if len(reports) >= expected:
            evidence = None
            if self._stopped_by is None and stopped_by is not None:
                evidence = f"{self._engine.title}'s state {end.state} for job {self.job_id} ({end.told_by}) "
                evidence += "and the job's cgroup"
            elif unavailable:
                evidence = f"the job's cgroup; {self._engine.title}'s state was unavailable: {unavailable}"
            return _reported(merge_reports(reports), evidence, common)
        missing = f"{expected - len(reports)} of {expected} in-job report(s) missing"
        return self._told_by_engine(end, missing, common)

    def _told_by_engine(self, end: JobEnd | None, missing: str, common: dict[str, Any]) -> Outcome:
        """The outcome of a job whose reports are ``missing``: the engine's final state stands in."""
        if end is None:
            return Outcome.unwatched(
                self.started_at,
                runner_error=(
                    f"job {self.job_id} ended with its in-job report missing, and {self._engine.title} "
                    f"no longer knows it ({self._engine.forgets})"
                ),
                **common,
            )
        return Outcome.unwatched(
            self.started_at,
            exit_code=None if end.oom else end.exit_code,
            signal=signal.SIGKILL if end.oom else end.signal,
            oom_kills_after=1 if end.oom else 0,
            evidence=(
                f"{self._engine.title}'s state {end.state}, {end.exit_status} for job {self.job_id} "
                f"({end.told_by}; {missing})"
            ),
            **common,
        )


def _reported(facts: dict[str, Any], evidence: str | None, common: dict[str, Any]) -> Outcome:
    """The outcome the in-job reports (merged) tell."""
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


# -- the executor -------------------------------------------------------------------------------


class GridExecutor:
    """Runs attempts as jobs of a batch engine. An engine's executor adds its name, its ``Options``,
    and what it knows of the cluster's nodes (``memory_budget``, ``gpu_capacity``, ``node_hosts``)."""

    runs_here = False
    admits_by_memory = True
    detached = True
    host_memory = None  # the steps run on the nodes: nothing on this host tells their memory

    def __init__(self, engine: GridEngine) -> None:
        self.engine = engine
        self.watcher = JobWatcher(engine)

    def node_hosts(self, options: dict[str, StepOptions]) -> list[tuple[str, str]] | None:
        """(name, host name) of every node the steps (their ``options``) may run on; None when the
        engine cannot say, and then only a run directory on a shared filesystem will do."""
        return None

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        """The run directory must be one the nodes see: on a shared filesystem, or the nodes are this host."""
        point, fstype, source = mount_of(run_dir.resolve())
        if fstype in SHARED_FILESYSTEMS:
            return
        me = {short_hostname(socket.gethostname()), short_hostname(socket.getfqdn())}
        nodes = self.node_hosts(options)
        if nodes is None:
            shown = "the cluster's nodes"
        else:
            others = sorted({name for name, host in nodes if short_hostname(host) not in me})
            if not others:
                return
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            shown = f"{self.engine.title}'s nodes {shown}"
        raise ExecutorError(
            f"the run directory {run_dir} is on {fstype or 'a local filesystem'} ({source or point}) "
            f"of {socket.gethostname()}, which {shown} cannot see; put it on a "
            "filesystem the nodes share (NFS, Lustre, GPFS, BeeGFS, CephFS): --run-dir /shared/…"
        )

    def start(self, launch: Launch) -> GridAttempt:
        engine = self.engine
        launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        os.makedirs(launch.cwd, exist_ok=True)
        remove_reports(engine.report_path(launch))
        address_path(launch).unlink(missing_ok=True)
        script = engine.script_path(launch)
        script.write_text(engine.job_script(launch), encoding="utf-8")
        submitted_at = time.time()
        job_id = engine.submit(launch, script, engine.directives(launch))
        return GridAttempt(self, launch, job_id, submitted_at)

    @staticmethod
    def service_host(handle: GridAttempt) -> str | None:
        """A replica's node, by the address its job wrote once it ran there; None while it waits in
        the queue."""
        try:
            return address_path(handle.launch).read_text(encoding="utf-8").strip() or None
        except FileNotFoundError:
            return None

    def resume(self, where: str, launch: Launch) -> GridAttempt | None:
        """The job of a runner that died, by its id: watched again while the engine knows it or its
        report is there (it may have ended meanwhile); else None. ExecutorUnavailable while the
        controller cannot say."""
        job_id = job_id_of(where)
        if self.engine.job_state(job_id) is None and not self.engine.report_path(launch).exists():
            return None
        # What the job wrote while nobody followed its logs was shown then by nobody: shown now.
        return GridAttempt(self, launch, job_id, time.time())

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        """Cancel the job, and wait until the engine says it ended (AttemptStillRunning if it does
        not). The job id is the attempt's identity; its processes live on the nodes."""
        engine, job_id = self.engine, job_id_of(where)
        state = engine.job_state(job_id)
        if state is None or state.phase is Phase.ENDED:
            return 0
        refused = engine.cancel(job_id)
        deadline = time.monotonic() + REAP_WAIT_S
        while (state := engine.job_state(job_id)) is not None and state.phase is not Phase.ENDED:
            if refused is not None:  # refused, and not because the job had ended meanwhile
                said = f"{where} is {state.said}; {engine.cancel_command} refused: {refused}"
                raise AttemptStillRunning([], where, said)
            if time.monotonic() >= deadline:
                raise AttemptStillRunning(
                    [],
                    where,
                    f"{where} is still {state.said} {REAP_WAIT_S:.0f} s after {engine.cancel_command} and "
                    f"may still write its outputs; end it ({engine.cancel_command}, or ask the cluster's "
                    "admins), then run again",
                )
            time.sleep(POLL_S)
        return 1
