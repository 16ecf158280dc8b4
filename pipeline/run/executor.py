"""What every executor takes (a Launch) and gives back (an Outcome), and the executors by name.

An executor starts one attempt of one step somewhere — a local cgroup, a
container, a Slurm job — and reports the raw facts of how it ended. It does not
judge: ``pipeline.run.verdict.decide`` turns an Outcome plus the state of the
outputs into a verdict, the same way for every executor.

Executors are registered by name in ``pipeline.run.EXECUTORS``, each one module under
``pipeline/run/`` whose class declares its own per-step options (``Options``, a
pydantic model): the pipeline file takes them under the executor's name, for the
whole pipeline and per step. The command line, the pipeline file's schema and
the help text all read this one table.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import signal as signals
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from pipeline.memory import Budget
from pipeline.run import EXECUTORS

LineSink = Callable[[str, str], None]
"""Called with (stream name 'stdout'|'stderr', line without newline) for each output line."""

STDERR_TAIL_LINES = 40
STOP_GRACE_S = 5.0
"""How long an attempt's processes get to end after SIGTERM (or a main process's leftovers after
SIGKILL) before they are killed, or given up on, by every executor and the container init."""


class ExecutorError(RuntimeError):
    """An executor cannot do what was asked: its engine or cluster is unreachable or refused.

    Not the pipeline file's fault (that is ``PipelineError``); the message names the step or
    the engine, what it said, and what to check.
    """


class ExecutorUnavailable(ExecutorError):
    """The engine or controller did not answer, though it was asked again for a while: nothing was
    learned (a job may or may not have been submitted; one that runs, runs on). Worth trying again."""


class StepOptions(BaseModel):
    """An executor's per-step options; this base has none (the local executor's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def fingerprint(self) -> dict[str, Any]:
        """What of these options changes a step's results, and so belongs in its fingerprint."""
        return {}


def executor_class(name: str) -> type[Executor]:
    """The class registered as ``name``; an unknown name is an ExecutorError listing the known ones."""
    try:
        module_name, class_name = EXECUTORS[name].split(":")
    except KeyError:
        raise ExecutorError(
            f"--executor {name!r}: unknown executor; choose one of {', '.join(EXECUTORS)}"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)


@dataclass(frozen=True)
class Launch:
    """One attempt of one step, fully resolved."""

    run_id: str
    step: str
    attempt: int
    argv: list[str]
    cwd: Path
    env: dict[str, str]
    limit_bytes: int
    stdout_path: Path
    stderr_path: Path
    gpus: int = 0
    timeout: float | None = None
    """The step's timeout in seconds; the runner enforces it (a scheduler may be told it too)."""
    options: StepOptions | None = None
    """The executor's own options for this step (its ``Options``), the pipeline's merged with the step's."""
    step_env: frozenset[str] = frozenset()
    """The names in ``env`` set for the step (its ``env``, eyrie's variables), not merely inherited
    from the runner's environment."""
    on_line: LineSink | None = None


@dataclass
class Outcome:
    """Raw facts of how an attempt ended, as the executor observed them."""

    exit_code: int | None
    """The main process's exit status; None when it died of a signal."""
    signal: int | None
    oom_kills_before: int
    oom_kills_after: int
    oom_at: float | None
    """Wall-clock time at which the OOM-kill counter was first seen to rise."""
    peak_bytes: int | None
    anon_peak_bytes: int | None
    started_at: float
    ended_at: float
    timeline: list[tuple[float, int, int]] = field(default_factory=list)
    """(seconds since start, total bytes, anonymous bytes), about one point a second."""
    stopped_by: str | None = None
    """'timeout' or 'cancel' when the runner (or a scheduler's time limit or scancel) stopped the
    attempt; 'preempted' or 'node_failed' when a scheduler took its node away."""
    stderr_tail: list[str] = field(default_factory=list)
    where: str = ""
    """Where it ran: the cgroup path or container id."""
    runner_error: str | None = None
    """Set when waiting for or stopping the attempt raised: how it really ended is unknown."""
    evidence: str | None = None
    """Where the facts came from when not from the step's own cgroup (an engine's or scheduler's view)."""
    thrash: str | None = None
    """Set when the runner killed the attempt for thrashing at its memory limit: the evidence."""
    log_error: str | None = None
    """Set when its output could not all be kept in its log files (a full disk): which, and why."""

    @classmethod
    def unwatched(cls, started_at: float, **known: Any) -> Outcome:
        """An end, now, that no cgroup of the attempt's own saw: what is ``known`` of it (an engine's
        or a scheduler's exit status, the runner's error), and past that no exit status, OOM kill
        or peak."""
        nothing = {
            "exit_code": None,
            "signal": None,
            "oom_kills_before": 0,
            "oom_kills_after": 0,
            "oom_at": None,
            "peak_bytes": None,
            "anon_peak_bytes": None,
            "ended_at": time.time(),
        }
        return cls(started_at=started_at, **{**nothing, **known})

    @property
    def oom_kills(self) -> int:
        return self.oom_kills_after - self.oom_kills_before

    def ledger_fields(self, records: int | None = None) -> dict[str, Any]:
        """These facts as the ledger's attempt row holds them (``records``: what its manifest counted)."""
        return {
            "peak_bytes": self.peak_bytes,
            "anon_peak_bytes": self.anon_peak_bytes,
            "oom_kills": self.oom_kills,
            "oom_kills_before": self.oom_kills_before,
            "oom_kills_after": self.oom_kills_after,
            "oom_at": self.oom_at,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "started_at": self.started_at,
            "ended_at": self.ended_at,
            "records": records,
            "stderr_tail": json.dumps(self.stderr_tail),
        }

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return signals.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


class AttemptStillRunning(RuntimeError):
    """What is left of an earlier attempt could not be stopped: its processes outlived SIGKILL
    (uninterruptible sleep, a frozen cgroup) or refused the signal."""

    def __init__(self, pids: list[int], where: str, message: str | None = None) -> None:
        super().__init__(
            message
            or f"process(es) {', '.join(map(str, pids))} ({where}) still run after SIGKILL and may still "
            "write its outputs; end them (a frozen cgroup must be thawed), then run again"
        )
        self.pids = pids


class RunningAttempt(Protocol):
    pid: int | None
    where: str

    def wait(self, timeout: float | None = None) -> Outcome | None:
        """The Outcome once the attempt ended, or None if ``timeout`` passed first."""

    def stop(self, reason: str) -> None:
        """Stop the attempt ('timeout' or 'cancel'): terminate, then kill what remains."""


class Executor(Protocol):
    name: str
    Options: type[StepOptions]
    """Its per-step options, taken from the pipeline file under its name."""
    runs_here: bool
    """True when a step's command runs on this host, in its filesystem (a process here, not in a
    container or on a cluster's node): the runner then finds each command before the run starts."""
    admits_by_memory: bool
    """True when a scheduler admits attempts by their memory (Slurm): the runner then starts every
    ready step, and checks each limit only against ``memory_budget()``, not their sum."""
    detached: bool
    """True when an attempt runs on without its runner and any host that reaches the same scheduler
    finds it again (a Slurm job): a runner error leaves it running, for the next run to resume,
    instead of stopping it; a submission that got no answer is tried again later. False when an
    attempt belongs to the host that started it (a process tree, a container on its engine)."""

    def memory_budget(self, options: StepOptions | None = None) -> Budget:
        """The memory the steps this executor starts share (what running steps' limits must fit);
        given a step's ``options``, what that step can have (a Slurm step: the largest node of its
        own partition)."""

    def gpu_capacity(self, options: StepOptions | None = None) -> tuple[int, str]:
        """The GPUs this executor's attempts share (local, docker: the host's), or, under a
        scheduler that admits by memory, the most one attempt can have (a Slurm job: the largest
        node of its partition); and the words a refusal ends with: "more than the N GPU(s) {those}"."""

    service_host: Callable[[RunningAttempt], str] | None
    """Where a service's replica this executor started is reached: the host of its URL (its port is
    the one the runner chose). None when this executor does not run services."""

    host_memory: Callable[[], Budget] | None
    """What the run's host samples read, four times a second: the memory its running steps share, as
    it sees it now (usually ``memory_budget``); None when its steps run on machines this one cannot
    see (Slurm's nodes), where no sample would be true."""

    def preflight(self, run_dir: Path, options: dict[str, StepOptions]) -> None:
        """Before anything starts: refuse, with an ExecutorError, what cannot work (``options``: each
        step's own, by step name), so that no step runs in a run that cannot finish."""

    def start(self, launch: Launch) -> RunningAttempt: ...

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        """End what is left of an attempt whose runner died, from what the ledger recorded: where it
        ran, its main process, when it began. Returns how many processes were killed; raises
        AttemptStillRunning when some could not be stopped."""

    def resume(self, where: str, launch: Launch) -> RunningAttempt | None:
        """An attempt a runner that died left behind, watched again when it can be (a Slurm job
        outlives its runner), else None: the runner then reaps it and records it cancelled."""


class LineCapture:
    """Copies one output stream to its log file and the line sink; keeps the last lines."""

    def __init__(self, stream, log_path: Path, name: str, sink: LineSink | None) -> None:
        self._stream, self._name, self._sink, self._path = stream, name, sink, log_path
        self._log = open(log_path, "a", encoding="utf-8", errors="replace")
        self.tail: list[str] = []
        self.write_error: str | None = None
        """Why the log file stopped being written (a full disk), if it did: the lines go on to the
        tail and the sink, so the step is never blocked on a pipe nobody reads."""
        self._lines = 0
        self._thread = threading.Thread(target=self._pump, name=f"capture-{name}", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._lines += 1
            self._keep(line)
            self.tail.append(line)
            if len(self.tail) > STDERR_TAIL_LINES:
                del self.tail[0]
            if self._sink is not None:
                self._sink(self._name, line)
        with contextlib.suppress(OSError):  # what could not be flushed was said in write_error
            self._log.close()

    def _keep(self, line: str) -> None:
        if self.write_error is not None:
            return
        try:
            self._log.write(line + "\n")
            self._log.flush()
        except OSError as exc:
            self.write_error = (
                f"its {self._name} log {self._path} was cut short at line {self._lines}: {exc.strerror}"
            )

    def join(self, idle: float) -> None:
        join_while_reading(self._thread, lambda: self._lines, idle)


def join_while_reading(pump: threading.Thread, lines_read: Callable[[], int], idle: float) -> None:
    """Wait for an output stream's pump to reach the end for as long as lines keep coming: a step
    that ended with thousands of lines still in its pipe has them all in its tail. Only a stream
    silent for ``idle`` seconds before its end (a pipe a stray process holds open) ends the wait."""
    read = -1
    while pump.is_alive() and lines_read() != read:
        read = lines_read()
        pump.join(idle)
