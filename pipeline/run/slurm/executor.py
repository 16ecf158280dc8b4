"""The Slurm executor: each attempt is one Slurm job, submitted with ``sbatch``.

Slurm's own command-line tools, not a Python client: they are the interface
every cluster and release has (``sbatch --parsable``, ``squeue -o``,
``scontrol show job -o``, ``scancel``), as Nextflow drives Slurm. pyslurm binds
to libslurm and is built for one Slurm release at a time; submitit runs pickled
Python callables, not commands, and reads job states through ``sacct``, which
needs slurmdbd.

The job: ``--mem`` = the attempt's limit, ``--gres=gpu:N`` for ``gpus: N``, the
partition, account, CPUs and further sbatch arguments from the pipeline's
``slurm:`` options, the step's directory as working directory, and its output
and error in the attempt's log files, which the runner follows. The run
directory must be on a filesystem the nodes share (checked before anything
starts). The batch script runs the step under the wrapper a step container has
(``pipeline.run.container_init``): from inside the job it reads the job's own
cgroup — the OOM-kill counter before and after, the peak, the timeline, the
main process's exact wait status — and writes that report beside the logs,
because Slurm removes the job's cgroups when it ends.

Evidence, as for every executor, the report first:

- Slurm's final state (``scontrol show job`` while the controller remembers the
  job, else ``sacct``) says who stopped a job: its time limit (TIMEOUT), someone
  else's ``scancel`` (CANCELLED), preemption (PREEMPTED), a lost node
  (NODE_FAIL);
- where the report is missing, that state stands in for it: OUT_OF_MEMORY is an
  OOM kill (Slurm cannot say whose: it reports it as well when only a child was
  killed and the step exited 0), ExitCode its exit status or signal;
- MaxRSS is never read: Slurm samples it.

With ``nodes: N`` the batch script runs the step through ``srun``, one task per
node, each under the wrapper (one report per node), with torchrun's rendezvous
taken from Slurm's environment (the allocation's first node; a port from the
job id). The attempt's peak is then the largest node's, its OOM kills the sum,
and its exit status that of the node that failed first.

The runner watches its jobs with one ``squeue`` a second for all of them. A
step's ``timeout`` counts from the moment its job's script starts (Slurm creates
its log files first), not while it waits in the queue or its node sets it up;
``--time`` is set a minute beyond it, so that a job whose runner died still
ends. Steps run side by side as far as the cluster admits them.

A controller that does not answer is asked again, for about a minute, by every
command; its silence is never taken for an answer ("the job is gone", "no such
job was submitted"), but raised as an ExecutorUnavailable for the runner to
wait on or refuse with.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from pipeline.memory import MIB, Budget, parse_duration
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
from pipeline.run.layout import attempt_name

POLL_S = 1.0
"""How often the runner asks ``squeue`` about its jobs (one call for all of them)."""
TIME_LIMIT_MARGIN_S = 60.0
"""``--time`` is the step's timeout plus this: the runner stops a step at its timeout itself."""
COMMAND_TIMEOUT_S = 60.0
"""A Slurm command that has not answered in this time counts as the controller's silence."""
ANSWER_WAITS_S = (0, 1, 2, 4, 8, 15, 30)
"""Waits before asking a controller that did not answer again, for every command (sbatch, squeue,
scontrol, scancel): about a minute; silence for longer is an ExecutorUnavailable, never an answer."""
SILENT_CONTROLLER_PATIENCE_S = 3600.0
"""How long the runner keeps asking a silent controller how a job ended when the job's report is
missing, rather than deciding without it."""
REAP_WAIT_S = 120.0
"""How long a dead runner's job gets to end after ``scancel`` (Slurm's KillWait is 30 s by default)."""
REPORT_WAIT_S = 270.0
"""How long the runner waits, after a job ended, for its report to show on the shared filesystem
(NFS caches attributes and missing names for up to a minute): as Nextflow's exitReadTimeout."""
LOG_FOLLOW_S = 0.2
RENDEZVOUS_PORT_BASE = 20000
WRAPPER = [sys.executable, "-m", "pipeline.run.container_init"]

# Job states in which a job has ended (squeue --states=all shows them for MinJobAge seconds).
ENDED_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "PREEMPTED",
    "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
})  # fmt: skip
# Who stopped a job, when Slurm's final state says it was not the step itself.
STOPPED_BY_STATE = {
    "TIMEOUT": "timeout",
    "DEADLINE": "timeout",
    "CANCELLED": "cancel",
    "PREEMPTED": "preempted",
    "NODE_FAIL": "node_failed",
    "BOOT_FAIL": "node_failed",
}
# Filesystems that several hosts mount: a run directory on one of them can be shared with the nodes.
SHARED_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs", "fuse.glusterfs",
    "panfs", "wekafs", "fuse.juicefs", "cifs", "smb3", "virtiofs", "9p",
})  # fmt: skip
# What eyrie sets on every job itself (or what would fight it): refused in `sbatch_args`, in full,
# abbreviated (sbatch takes any unambiguous prefix of a long option) or, short, with its value
# attached (-N2).
MANAGED_SBATCH_OPTIONS = (
    "--mem", "--mem-per-cpu", "--mem-per-gpu", "--output", "--error", "--chdir", "--job-name",
    "--parsable", "--wrap", "--array", "--export", "--export-file", "--requeue", "--no-requeue",
    "--open-mode", "--time", "--nodes", "--partition", "--account", "--cpus-per-task", "--gres",
    "--gpus", "--gpus-per-node", "--gpus-per-task", "--gpus-per-socket",
)  # fmt: skip
# What a job gets of the runner's environment besides the step's own variables (`--export` names
# them; sbatch would otherwise send the whole environment, API keys and tokens included, into the
# job's record on the controller). A pipeline adds names or patterns with `slurm: {export: […]}`.
EXPORTED_ENV = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR", "TERM",
    "PYTHON*", "VIRTUAL_ENV", "CONDA_*", "LD_LIBRARY_PATH", "CUDA_*", "NCCL_*", "NVIDIA_*", "OMP_*",
    "MKL_*", "TORCH_*", "TOKENIZERS_PARALLELISM", "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE",
    "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN_PATH", "SSL_CERT_FILE",
    "REQUESTS_CA_BUNDLE", "EYRIE_*",
)  # fmt: skip
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


def _slurm(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
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


def _waits(patience_s: float):
    """The waits before each try: ANSWER_WAITS_S, then its last wait again until ``patience_s``."""
    waited = 0.0
    for delay in ANSWER_WAITS_S:
        yield delay
        waited += delay
    while 0 < ANSWER_WAITS_S[-1] and waited + ANSWER_WAITS_S[-1] <= patience_s:
        yield ANSWER_WAITS_S[-1]
        waited += ANSWER_WAITS_S[-1]


def _asked(*argv: str, patience_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """A Slurm command's answer, asked again while the controller does not answer (the command
    hangs, or says it cannot reach it): silence is no answer. ExecutorUnavailable once it stayed
    silent for ``patience_s`` (default: ANSWER_WAITS_S, about a minute)."""
    patience_s = sum(ANSWER_WAITS_S) if patience_s is None else patience_s
    said = ""
    for delay in _waits(patience_s):
        time.sleep(delay)
        try:
            result = _slurm(*argv)
        except ExecutorUnavailable as exc:
            said = str(exc)
            continue
        said = _said(result)
        if result.returncode == 0 or not _unreachable(said):
            return result
    raise ExecutorUnavailable(
        f"the Slurm controller did not answer {shlex.join(argv[:2])} … for {patience_s:.0f} s "
        f"({said}); check scontrol ping, then run again"
    )


def job_state(job_id: str) -> str | None:
    """Slurm's state of a job (an ended one while the controller remembers it), or None only when
    Slurm says it does not know the job. A controller that stays silent is an ExecutorUnavailable."""
    result = _asked("squeue", "-h", "--states=all", "-j", job_id, "-o", "%T")
    if result.returncode == 0:
        states = result.stdout.split()
        return states[0] if states else None
    if "invalid job id" in result.stderr.lower():
        return None
    raise ExecutorUnavailable(f"squeue could not say what became of job {job_id}: {_said(result)}")


def _said(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
    return lines[-1] if lines else f"exit {result.returncode}"


def _unreachable(message: str) -> bool:
    """The controller did not answer (worth asking again), as opposed to refusing."""
    message = message.lower()
    return any(
        words in message
        for words in ("unable to contact slurm controller", "socket timed out", "connection refused",
                      "temporarily unavailable", "connection timed out")
    )  # fmt: skip


def _job_id(where: str) -> str:
    return where.rsplit(" ", 1)[-1]


def parse_job_record(line: str) -> dict[str, str]:
    """``scontrol show job -o``'s one line as a dict (values never hold spaces, except Command's tail)."""
    record: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep:
            record[key] = value
    return record


def final_state(job_id: str, patience_s: float | None = None) -> tuple[str, str, str] | None:
    """(state, ExitCode 'code:signal', which command said so) once the job ended, or None when
    Slurm no longer knows it (the controller forgot it, and there is no accounting). A controller
    that does not answer is asked again for ``patience_s``: its silence is no answer."""
    shown = _asked("scontrol", "show", "job", "-o", job_id, patience_s=patience_s)
    if shown.returncode == 0 and shown.stdout.strip():
        record = parse_job_record(shown.stdout)
        state = record.get("JobState", "")
        if state in ENDED_STATES:
            return state, record.get("ExitCode", ""), "scontrol"
    accounted = _slurm("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode")
    if accounted.returncode == 0 and accounted.stdout.strip():
        state, _, code = accounted.stdout.strip().splitlines()[0].partition("|")
        return state.split()[0], code, "sacct"  # "CANCELLED by 1000" -> CANCELLED
    return None


class _Follower:
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


class _Watcher:
    """One ``squeue`` a second for every job the runner waits for: their states, as Slurm says them."""

    def __init__(self) -> None:
        self._states: dict[str, str | None] = {}
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def watch(self, job_id: str) -> None:
        with self._changed:
            self._states.setdefault(job_id, "PENDING")
            if self._thread is None:
                self._thread = threading.Thread(target=self._poll, name="squeue", daemon=True)
                self._thread.start()

    def state(self, job_id: str) -> str | None:
        """The job's last state seen; None once Slurm no longer lists it (ended and forgotten)."""
        with self._changed:
            return self._states[job_id]

    def ended(self, job_id: str) -> bool:
        state = self.state(job_id)
        return state is None or state in ENDED_STATES

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
                ids = [job for job, state in self._states.items() if state and state not in ENDED_STATES]
            if ids:
                self._ask(ids)
            self._closed.wait(POLL_S)

    def _ask(self, ids: list[str]) -> None:
        try:
            result = _slurm("squeue", "-h", "--states=all", "-j", ",".join(ids), "-o", "%i|%T")
        except ExecutorError:
            return  # no answer this time: ask again, never conclude from silence
        if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
            return  # the controller did not answer
        listed = dict(line.split("|", 1) for line in result.stdout.split() if "|" in line)
        with self._changed:
            for job in ids:
                self._states[job] = listed.get(job)  # not listed: ended, and already forgotten
            self._changed.notify_all()


class SlurmAttempt:
    def __init__(self, executor: SlurmExecutor, launch: Launch, job_id: str, submitted_at: float) -> None:
        self.launch = launch
        self.job_id = job_id
        self.where = f"slurm job {job_id}"
        self.pid: int | None = None  # the step runs on a node, not here
        self.started_at = submitted_at
        self._executor = executor
        self._stopped_by: str | None = None
        self._running_since: float | None = None
        self._out = _Follower(launch.stdout_path, "stdout", launch.on_line)
        self._err = _Follower(launch.stderr_path, "stderr", launch.on_line)
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
        _asked("scancel", self.job_id)

    # -- evidence ----------------------------------------------------------------------
    def _expected_reports(self) -> int:
        options = self.launch.options
        return (options.nodes if isinstance(options, SlurmOptions) else None) or 1

    def _reports(self) -> list[dict[str, Any]]:
        report = report_path(self.launch)
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

    def _launched(self) -> bool:
        """Whether the node started the job's script: Slurm creates its log files first (the folder is
        listed, so that NFS looks again for names it lately found missing)."""
        try:
            names = os.listdir(self.launch.stdout_path.parent)
        except FileNotFoundError:
            return False
        return self.launch.stdout_path.name in names or self.launch.stderr_path.name in names

    def _await_reports(self) -> list[dict[str, Any]]:
        """The job's reports, waited for (``report_wait``) when its script started: on a shared
        filesystem a file the node wrote last may show here only later. A job cancelled before its
        script started (in the queue, or while its node set it up) wrote none."""
        options = self.launch.options if isinstance(self.launch.options, SlurmOptions) else SlurmOptions()
        deadline = time.monotonic() + (options.report_wait if self._launched() else 0)
        while len(reports := self._reports()) < self._expected_reports() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return reports

    def _outcome(self, reports: list[dict[str, Any]]) -> Outcome:
        expected = self._expected_reports()
        complete = len(reports) >= expected
        unavailable = None
        if complete:
            # The reports decide; Slurm's state only says who stopped the job, if it can say it.
            try:
                slurm = final_state(self.job_id)
            except ExecutorUnavailable as exc:
                slurm, unavailable = None, str(exc)
        else:
            # Nothing else can decide: a silent controller is waited for, not guessed at.
            slurm = final_state(self.job_id, SILENT_CONTROLLER_PATIENCE_S)
        state, code, told_by = slurm if slurm else (None, "", None)
        stopped_by = self._stopped_by or STOPPED_BY_STATE.get(state or "")
        stopped_by_slurm = self._stopped_by is None and stopped_by is not None
        common = {"stderr_tail": list(self._err.tail), "where": self.where, "stopped_by": stopped_by}
        if complete:
            facts = _merge(reports)
            evidence = None
            if stopped_by_slurm:
                evidence = f"Slurm's state {state} for job {self.job_id} ({told_by}) and the job's cgroup"
            elif unavailable:
                evidence = f"the job's cgroup; Slurm's state was unavailable: {unavailable}"
            return Outcome(
                exit_code=facts["exit_code"], signal=facts["signal"],
                oom_kills_before=facts["oom_kills_before"], oom_kills_after=facts["oom_kills_after"],
                oom_at=facts["oom_at"], peak_bytes=facts["peak_bytes"],
                anon_peak_bytes=facts["anon_peak_bytes"], started_at=facts["started_at"],
                ended_at=facts["ended_at"], timeline=[tuple(p) for p in facts["timeline"]],
                thrash=facts.get("thrash"), evidence=evidence, **common,
            )  # fmt: skip
        missing = f"{expected - len(reports)} of {expected} in-job report(s) missing"
        if state is None:
            return Outcome(
                exit_code=None, signal=None, oom_kills_before=0, oom_kills_after=0, oom_at=None,
                peak_bytes=None, anon_peak_bytes=None, started_at=self.started_at, ended_at=time.time(),
                runner_error=(
                    f"job {self.job_id} ended with its in-job report missing, and Slurm no longer "
                    "knows it (scontrol has forgotten it; sacct has no accounting)"
                ),
                **common,
            )  # fmt: skip
        exit_code, sig = _exit_status(code)
        oom = state == "OUT_OF_MEMORY"
        return Outcome(
            exit_code=None if oom else exit_code,
            signal=signal.SIGKILL if oom else sig,
            oom_kills_before=0,
            oom_kills_after=1 if oom else 0,
            oom_at=None,
            peak_bytes=None,
            anon_peak_bytes=None,
            started_at=self.started_at,
            ended_at=time.time(),
            evidence=f"Slurm's state {state}, ExitCode {code} for job {self.job_id} ({told_by}; {missing})",
            **common,
        )


def _exit_status(code: str) -> tuple[int | None, int | None]:
    """Slurm's ExitCode 'code:signal' as (exit code, signal)."""
    exit_text, _, signal_text = code.partition(":")
    try:
        exit_code, sig = int(exit_text), int(signal_text or 0)
    except ValueError:
        return None, None
    if sig:
        return None, sig
    return exit_code, None


def _merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
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


def report_path(launch: Launch) -> Path:
    """Where the in-job wrapper writes its report (with ``nodes``: one per node, ``….node-N.json``)."""
    return launch.stderr_path.with_name(f"attempt-{launch.attempt}.slurm.json")


def batch_script(launch: Launch) -> str:
    """The job's script: the step under the in-job wrapper, through srun when it asks for nodes."""
    options = launch.options if isinstance(launch.options, SlurmOptions) else SlurmOptions()
    report = report_path(launch)
    step = shlex.join(launch.argv)
    lines = ["#!/bin/sh", f"# eyrie: run {launch.run_id}, step {launch.step}, attempt {launch.attempt}"]
    if options.nodes is None:
        lines.append(f"exec {shlex.join([*WRAPPER, str(report), '--'])} {step}")
        return "\n".join(lines) + "\n"
    # torchrun's rendezvous (c10d) on the allocation's first node; every node runs one launcher.
    # srun would pass on only the names sbatch exported (SLURM_EXPORT_ENV), not the rendezvous.
    per_node = f'exec {shlex.join(WRAPPER)} "$0.node-$SLURM_NODEID.json" -- "$@"'
    lines += [
        'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"port=$(({RENDEZVOUS_PORT_BASE} + SLURM_JOB_ID % 10000))",
        'export MASTER_ADDR="$first" MASTER_PORT="$port" PET_RDZV_BACKEND=c10d '
        'PET_RDZV_ENDPOINT="$first:$port" PET_RDZV_ID="$SLURM_JOB_ID" SLURM_EXPORT_ENV=ALL',
        f"exec srun --nodes={options.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 "
        f"sh -c {shlex.quote(per_node)} {shlex.quote(str(report))} {step}",
    ]
    return "\n".join(lines) + "\n"


def sbatch_argv(launch: Launch, script: Path) -> list[str]:
    options = launch.options if isinstance(launch.options, SlurmOptions) else SlurmOptions()
    name = attempt_name(launch.run_id, launch.step, launch.attempt)
    argv = [
        "sbatch", "--parsable", f"--job-name={name}", f"--chdir={launch.cwd}",
        f"--output={launch.stdout_path}", f"--error={launch.stderr_path}", "--open-mode=append",
        f"--mem={math.ceil(launch.limit_bytes / MIB)}M", "--no-requeue",
        f"--export={','.join(exported_names(launch, options)) or 'NONE'}",
    ]  # fmt: skip
    if launch.timeout is not None:
        argv.append(f"--time={math.ceil((launch.timeout + TIME_LIMIT_MARGIN_S) / 60)}")
    if launch.gpus:
        argv.append(f"--gres=gpu:{launch.gpus}")
    for flag, value in (("--partition", options.partition), ("--account", options.account),
                        ("--nodes", options.nodes), ("--cpus-per-task", options.cpus)):  # fmt: skip
        if value is not None:
            argv.append(f"{flag}={value}")
    return [*argv, *options.sbatch_args, str(script)]


def exported_names(launch: Launch, options: SlurmOptions) -> list[str]:
    """The variables of the launch's environment the job gets: the step's own, and those the
    runner's environment may pass on (EXPORTED_ENV and the pipeline's ``export``)."""
    patterns = (*EXPORTED_ENV, *options.export)
    return sorted(
        name for name in launch.env
        if not name.startswith("SLURM_")
        and (name in launch.step_env or any(fnmatch.fnmatchcase(name, p) for p in patterns))
    )  # fmt: skip


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(mount point, filesystem type, source) of the mount that holds ``path``."""
    best = ("/", "", "")
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        point = left.split()[4].replace("\\040", " ")
        fstype, source = (right.split() + ["", ""])[:2]
        if (path == Path(point) or Path(point) in path.parents) and len(point) >= len(best[0]):
            best = (point, fstype, source)
    return best


def _short(host: str) -> str:
    return host.split(".", 1)[0]


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
        self.watcher = _Watcher()
        self._unanswered: set[str] = set()
        """Names of jobs whose submission got no answer: looked up before they are submitted again."""

    # -- before anything starts --------------------------------------------------------
    def _default_partition(self) -> str:
        result = _asked("sinfo", "-h", "-o", "%P")
        if result.returncode != 0:
            raise ExecutorError(f"cannot ask Slurm for its partitions (sinfo: {_said(result)})")
        default = [p.rstrip("*") for p in result.stdout.split() if p.endswith("*")]
        if not default:
            raise ExecutorError("Slurm has no default partition: set slurm: {partition: …} in the pipeline")
        return default[0]

    def _nodes(self, partitions: set[str | None]) -> list[tuple[str, str, int]]:
        """(node name, node hostname, memory MiB) of every node in ``partitions`` (None: the default)."""
        named = sorted({p or self._default_partition() for p in partitions})
        result = _asked("sinfo", "-h", "-N", "-p", ",".join(named), "-o", "%N|%n|%m")
        if result.returncode != 0:
            raise ExecutorError(f"cannot ask Slurm for its nodes (sinfo: {_said(result)})")
        nodes = []
        for line in result.stdout.splitlines():
            name, hostname, memory = (line.split("|") + ["", ""])[:3]
            nodes.append((name, hostname, int(memory.rstrip("+")) if memory.rstrip("+").isdigit() else 0))
        if not nodes:
            raise ExecutorError(
                f"Slurm lists no node in partition {', '.join(named)}; check slurm: partition in the pipeline"
            )
        return nodes

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """What one step can have: the largest node's memory in its partition (``options``'s, else
        the pipeline's, else Slurm's default). Slurm admits jobs by their --mem."""
        own = options.partition if isinstance(options, SlurmOptions) else None
        partition = own or self.options.partition or self._default_partition()
        largest = max(memory for _, _, memory in self._nodes({partition})) * MIB
        where = f"partition {partition}"
        return Budget(
            available=largest, mem_total=largest, mem_available=largest, cgroup_version=None,
            binding=f"the largest node in Slurm's {where}; the cluster admits steps by their --mem",
        )  # fmt: skip

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        """The run directory must be one the nodes see: on a shared filesystem, or the nodes are this host."""
        point, fstype, source = _mount_of(run_dir.resolve())
        if fstype in SHARED_FILESYSTEMS:
            return
        partitions = {o.partition if isinstance(o, SlurmOptions) else None for o in options.values()}
        me = {_short(socket.gethostname()), _short(socket.getfqdn())}
        others = sorted({name for name, hostname, _ in self._nodes(partitions) if _short(hostname) not in me})
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
        report = report_path(launch)
        for stale in [report, *report.parent.glob(f"{report.name}.node-*.json")]:
            stale.unlink(missing_ok=True)
        script = launch.stderr_path.with_name(f"attempt-{launch.attempt}.sbatch")
        script.write_text(batch_script(launch), encoding="utf-8")
        # The job gets the runner's environment (its own SLURM_* variables would mislead the job).
        env = {k: v for k, v in launch.env.items() if not k.startswith("SLURM_")}
        name = attempt_name(launch.run_id, launch.step, launch.attempt)
        submitted_at = time.time()
        if name in self._unanswered:  # asked before without an answer: it may be there already
            found = self._job_named(name)
            if found:
                return SlurmAttempt(self, launch, found, submitted_at)
        said = ""
        for delay in _waits(sum(ANSWER_WAITS_S)):
            time.sleep(delay)
            try:
                result = _slurm(*sbatch_argv(launch, script), env=env)
            except ExecutorUnavailable as exc:
                said = str(exc)
            else:
                if result.returncode == 0:
                    self._unanswered.discard(name)
                    return SlurmAttempt(self, launch, result.stdout.strip().split(";")[0], submitted_at)
                said = _said(result)
                if not _unreachable(said):
                    raise ExecutorError(
                        f"step {launch.step}: sbatch refused its job: {said} (check the pipeline file's "
                        "slurm: options: partition, account, sbatch_args)"
                    )
            # A submission without an answer may have reached the controller: never submit it twice.
            self._unanswered.add(name)
            found = self._job_named(name)
            if found:
                self._unanswered.discard(name)
                return SlurmAttempt(self, launch, found, submitted_at)
        raise ExecutorUnavailable(
            f"step {launch.step}: the Slurm controller did not answer sbatch for "
            f"{sum(ANSWER_WAITS_S):.0f} s ({said})"
        )

    def _job_named(self, name: str) -> str | None:
        """The id of the job of that name, or None when Slurm lists none; ExecutorUnavailable when
        the controller cannot say (then nobody knows whether it was submitted)."""
        result = _asked("squeue", "-h", "--states=all", f"--name={name}", "-o", "%i")
        if result.returncode != 0:
            raise ExecutorUnavailable(
                f"squeue could not say whether job {name} was submitted: {_said(result)}"
            )
        ids = result.stdout.split()
        return ids[0] if ids else None

    def resume(self, where: str, launch: Launch) -> SlurmAttempt | None:
        """The job of a runner that died, by its id: watched again while Slurm knows it or its
        report is there (it may have ended meanwhile); else None. ExecutorUnavailable while the
        controller cannot say."""
        job_id = _job_id(where)
        if job_state(job_id) is None and not report_path(launch).exists():
            return None
        # What the job wrote while nobody followed its logs was shown then by nobody: shown now.
        return SlurmAttempt(self, launch, job_id, time.time())

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        """``scancel`` the job, and wait until Slurm says it ended (AttemptStillRunning if it does
        not). The job id is the attempt's identity; its processes live on the nodes."""
        job_id = _job_id(where)
        state = job_state(job_id)
        if state is None or state in ENDED_STATES:
            return 0
        cancelled = _asked("scancel", job_id)
        deadline = time.monotonic() + REAP_WAIT_S
        while (state := job_state(job_id)) is not None and state not in ENDED_STATES:
            if cancelled.returncode != 0:  # refused, and not because the job had ended meanwhile
                refused = f"{where} is {state}; scancel refused: {_said(cancelled)}"
                raise AttemptStillRunning([], where, refused)
            if time.monotonic() >= deadline:
                raise AttemptStillRunning(
                    [], where, f"{where} is still {state} {REAP_WAIT_S:.0f} s after scancel and may still "
                    "write its outputs; end it (scancel, or ask the cluster's admins), then run again",
                )  # fmt: skip
            time.sleep(POLL_S)
        return 1
