"""Runs a pipeline: order, memory-bounded parallelism, resume, retry, and the ledger.

Steps whose needs are met run side by side while the sum of their memory
limits fits the budget. Each attempt's outcome becomes a verdict
(``verdict.decide``) and a ledger row; a verdict its step's ``retry_on`` names
runs it again (``next_limit``). A rerun in the same run directory skips
steps whose manifest matches their inputs (``fingerprint``); a runner killed
without warning leaves attempts marked ``running``: the next run watches again
those its executor can hand back (a Slurm job outlives its runner) and closes
the others as ``cancelled`` (``recovery``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import queue
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.contract.step import (
    FINGERPRINT_ENV,
    MANIFEST_NAME,
    SERVICE_PORT_ENV,
    STATE_DIR,
    check_manifest,
    invalidate_manifest,
    read_manifest,
    service_urls_env,
    write_manifest,
)
from pipeline.memory import Budget, CgroupError, format_size
from pipeline.run.disk import RunDirFull, no_space_note, space_left
from pipeline.run.executor import (
    Executor,
    ExecutorError,
    ExecutorUnavailable,
    Launch,
    Outcome,
    RunningAttempt,
)
from pipeline.run.fingerprint import check_up_to_date, digest, fingerprint_parts
from pipeline.run.host_sampler import HostSampler
from pipeline.run.layout import attempt_logs
from pipeline.run.ledger import (
    LEDGER_FILES,
    LEDGER_NAME,
    RESERVE_BYTES,
    Ledger,
    LedgerFull,
    LedgerUnreadable,
    RunState,
    StepState,
    ledger_lost,
)
from pipeline.run.next_limit import next_limit
from pipeline.run.recovery import Resumed, close_orphans, lock_run_dir
from pipeline.run.services import AdoptedReplica, Services, ServiceState, check_placement, service_argv
from pipeline.run.spec import PipelineError, PipelineSpec, StepSpec
from pipeline.run.step_inputs import check_inputs, check_program, expand_command, runner_env
from pipeline.run.verdict import DONE_VERDICTS, TRANSIENT_VERDICTS, Decision, Verdict, decide

STOP_WAIT_S = 30.0  # after an error: how long stopped attempts get to end (executors: STOP_GRACE_S)
TRANSIENT_RETRIES = 3  # a step whose node was taken away runs again up to this often, besides `retries`
SUBMIT_RETRY_S = 60.0  # a submission that got no answer (a detached executor's) is tried again after this
SUBMIT_PATIENCE_S = 3600.0  # and for this long, before the run stops on it
# A step in one of these states lets the steps that need it start.
SETTLED_STATES = frozenset({StepState.DONE, StepState.SKIPPED})


class Reporter(Protocol):
    """What the runner tells whoever watches it (the console, a test)."""

    def line(self, step: str, stream: str, text: str) -> None: ...
    def started(self, step: str, attempt: int, limit_bytes: int, limit_reason: str | None) -> None: ...
    def ended(self, step: str, attempt: int, decision: Decision, outcome: Outcome) -> None: ...
    def skipped(self, step: str, reason: str) -> None: ...
    def blocked(self, step: str, reason: str) -> None: ...
    def note(self, text: str) -> None: ...


@dataclass
class RunResult:
    run_id: str
    state: RunState

    @property
    def exit_code(self) -> int:
        return self.state.exit_code


@dataclass
class _StepRun:
    """One step's bookkeeping in this run."""

    spec: StepSpec
    argv: list[str]
    limit: int
    """The limit of its next attempt: the step's memory, raised after an OOM kill."""
    limit_reason: str | None = None
    state: StepState = StepState.PENDING
    attempts: int = 0
    """Attempts counted against its ``retries`` (one a scheduler took away is not)."""
    transient_retries: int = 0
    unsubmitted: _Unsubmitted | None = None
    """Its attempt whose submission got no answer, while it waits to be submitted again."""

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass
class _Running:
    step: StepSpec
    attempt: int
    attempt_id: int
    launch: Launch
    handle: RunningAttempt
    fingerprint: str
    started_at: float
    detached: bool = False
    """It runs on without the runner (its executor's ``detached``): a runner error leaves it running."""


@dataclass
class _Unsubmitted:
    """An attempt begun in the ledger, not yet handed to its executor. One a detached executor could
    not submit for want of an answer is submitted again under the same name (the executor looks for
    it first) once ``due``, until SUBMIT_PATIENCE_S after it was ``first_tried``."""

    attempt: int
    attempt_id: int
    launch: Launch
    fingerprint: str
    first_tried: float
    due: float = 0.0


def eyrie_commit() -> str | None:
    """The git commit of the eyrie source this runs from, when it runs from a checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


CHECK_PORT = "1"
"""A service replica's port under ``--check``, where none is chosen: its command and its users'
URLs are checked with it."""


@contextlib.contextmanager
def _collected(into: list[PipelineError | ExecutorError]) -> Iterator[None]:
    """The PipelineError or ExecutorError the block raises, appended to ``into``."""
    try:
        yield
    except (PipelineError, ExecutorError) as exc:
        into.append(exc)


class Orchestrator:
    def __init__(
        self,
        spec: PipelineSpec,
        pipeline_path: Path,
        run_dir: Path,
        executor: Executor,
        reporter: Reporter,
    ) -> None:
        self.spec = spec
        self.pipeline_path = pipeline_path.resolve()
        self.run_dir = run_dir.resolve()
        self.executor = executor
        self.reporter = reporter
        self.run_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
        self.commit = eyrie_commit()
        self._results: queue.Queue[tuple[_Running, Outcome]] = queue.Queue()
        self._running: dict[str, _Running] = {}
        self._cancel = threading.Event()
        self._cancelled_by: str | None = None
        # Set when the run starts: its ledger, the memory its steps share, each step's bookkeeping.
        self._ledger: Ledger
        self._pool = 0
        self._steps: dict[str, _StepRun] = {}
        self._step_budgets: dict[str, Budget] = {}
        self._services: Services | None = None
        self._started = False
        """Whether the run began (its ledger holds it), past the checks that refuse it."""

    # -- public ----------------------------------------------------------------------
    def run(self) -> RunResult:
        made = self._made_by_run()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            with lock_run_dir(self.run_dir):
                if lost := ledger_lost(self.run_dir):
                    self.reporter.note(lost)
                self._ledger = Ledger(self.run_dir)
                try:
                    self._ledger.hold_reserve()
                    return self._run()
                finally:
                    self._ledger.close()
        except (PipelineError, ExecutorError, CgroupError, LedgerUnreadable, LedgerFull, OSError) as exc:
            if self._started:
                raise
            for path in made:  # refused before it began: it leaves nothing behind
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                raise RunDirFull(
                    f"no space left on device in {self.run_dir}: {space_left(self.run_dir)}; "
                    "free some space, then run again"
                ) from None
            raise

    def _made_by_run(self) -> list[Path]:
        """What starting a run in ``run_dir`` creates that is not there yet: the run directory (the
        topmost folder of it that is missing), or its ledger and state folder."""
        if not self.run_dir.exists():
            top = self.run_dir
            while not top.parent.exists():
                top = top.parent
            return [top]
        made = [self.run_dir / STATE_DIR] if not (self.run_dir / STATE_DIR).exists() else []
        if not (self.run_dir / LEDGER_NAME).exists():
            made += [self.run_dir / name for name in LEDGER_FILES]
        return made

    def check(self, eyrie_problem: Callable[[list[str], dict[str, str]], str | None]) -> list[str]:
        """What ``eyrie run --check`` finds wrong, one line per problem, with nothing made or run
        (the file's keys and its needs were checked as it was read): a variable the runner cannot
        fill; for an ``eyrie`` command, what ``eyrie_problem`` says of its options in the
        environment the runner gives it; then what the run refuses before it starts
        (:meth:`_refusals`)."""
        problems, argvs = [], {}
        for step in self.spec.order():
            try:
                argvs[step.name] = argv = expand_command(self.pipeline_path, self.run_dir, step)
            except PipelineError as exc:
                problems.append(str(exc))
                continue
            if Path(argv[0]).name == "eyrie" and (problem := eyrie_problem(argv[1:], self._check_env(step))):
                problems.append(f"{step.at(self.pipeline_path, 'command')}: {problem}")
        for service in (s for s in self.spec.services if not s.external):
            variables = {
                **runner_env(self.pipeline_path, self.run_dir, service),
                SERVICE_PORT_ENV: CHECK_PORT,
                **service.env,
            }
            try:
                argv = service_argv(self.pipeline_path, service, variables)
            except PipelineError as exc:
                problems.append(str(exc))
                continue
            if Path(argv[0]).name == "eyrie" and (problem := eyrie_problem(argv[1:], variables)):
                problems.append(f"{service.at(self.pipeline_path, 'command')}: {problem}")
        try:
            binding = self._measure_pool()
        except (ExecutorError, CgroupError) as exc:
            return [*problems, str(exc)]
        return problems + [str(refusal) for refusal in self._refusals(binding, argvs)]

    def _check_env(self, step: StepSpec) -> dict[str, str]:
        """What the runner adds to a step's environment, for ``--check``: a service it uses that is
        started answers at a URL that does not exist yet, written as a replica on CHECK_PORT."""
        urls = {
            service_urls_env(s.name): ",".join(s.external) or f"http://127.0.0.1:{CHECK_PORT}"
            for s in self.spec.services
            if s.name in step.uses
        }
        return {**runner_env(self.pipeline_path, self.run_dir, step), **urls, **step.env}

    def cancel(self, by: str | None = None) -> None:
        """Ask the run to stop: running attempts are stopped and recorded as cancelled (``by``: what
        asked, e.g. Ctrl-C, said in their reason)."""
        self._cancelled_by = self._cancelled_by or by
        self._cancel.set()

    # -- the loop ----------------------------------------------------------------------
    def _run(self) -> RunResult:
        found = close_orphans(
            self._ledger,
            self.spec,
            self.pipeline_path,
            self.run_dir,
            self.executor,
            self._launch,
            self.reporter.note,
        )
        binding = self._measure_pool()
        argvs = {s.name: expand_command(self.pipeline_path, self.run_dir, s) for s in self.spec.steps}
        for refusal in self._refusals(binding, argvs):
            raise refusal
        ordered = self.spec.order()
        self._steps = {s.name: _StepRun(s, argvs[s.name], s.memory) for s in ordered}
        self._started = True
        self._ledger.start_run(
            self.run_id,
            str(self.pipeline_path),
            self.executor.name,
            list(self._steps),
            self._pool,
            binding,
            host_sampled=self.executor.host_memory is not None,
        )
        self._services = Services(
            self.spec.services,
            pipeline_path=self.pipeline_path,
            run_dir=self.run_dir,
            run_id=self.run_id,
            executor=self.executor,
            ledger=self._ledger,
            options=lambda name: self.spec.executor_options(self.executor.name, name),
            reporter=self.reporter,
            commit=self.commit,
            adopted=[f for f in found if isinstance(f, AdoptedReplica)],
        )
        host = HostSampler(self._ledger, self.run_id, self.executor.host_memory).start()
        steps = f"{len(ordered)} step" + ("s" if len(ordered) != 1 else "")
        if services := len(self.spec.services):
            steps += f", {services} service" + ("s" if services != 1 else "")
        self.reporter.note(
            f"run {self.run_id}: {steps}, budget {format_size(self._pool)} (set by {binding}), "
            f"executor {self.executor.name}"
        )
        self._watch_resumed([f for f in found if isinstance(f, Resumed)])
        for name in self._services.adopted():  # go on serving what a dead runner left, while needed
            self._services.start(name)
        self._retire_unused_services()
        try:
            self._loop()
        except BaseException as exc:
            # The runner itself failed: its steps must not run on unwatched, nor stay 'running'.
            # A full ledger fails each write: the steps and services are stopped all the same.
            with contextlib.suppress(LedgerFull):
                self._stop_on_error(f"the run stopped on an error: {exc}")
            with contextlib.suppress(LedgerFull):
                self._services.stop_all("the run stopped on an error")
            host.stop()
            with contextlib.suppress(LedgerFull):
                self._ledger.end_run(self.run_id, RunState.FAILED)
            raise
        run_state = self._final_state()
        self._services.stop_all("the run ended", cancelled=self._cancel.is_set())
        host.stop()
        self._ledger.end_run(self.run_id, run_state)
        return RunResult(self.run_id, run_state)

    def _watch_resumed(self, resumed: list[Resumed]) -> None:
        """Wait again for the attempts a dead runner left that their executor found again."""
        for orphan in resumed:
            step = self._steps[orphan.step.name]
            step.attempts, step.limit = 1, orphan.launch.limit_bytes
            self._set_state(step, StepState.RUNNING)
            self._watch(
                _Running(
                    orphan.step,
                    orphan.row.attempt,
                    orphan.row.id,
                    orphan.launch,
                    orphan.handle,
                    orphan.fingerprint,
                    orphan.row.started_at,
                    orphan.detached,
                )
            )

    def _final_state(self) -> RunState:
        """How the run ended, once nothing runs; a step still pending was cancelled before it started."""
        for step in self._steps.values():
            if step.state == StepState.PENDING:  # only when cancelled before it could start
                self._drop_unsubmitted(step, "the run was cancelled")
                by = f" by {self._cancelled_by}" if self._cancelled_by else ""
                self._finish(
                    step, StepState.CANCELLED, f"cancelled: the run was cancelled{by} before it started"
                )
        if self._cancel.is_set():
            return RunState.CANCELLED
        if all(s.state in SETTLED_STATES for s in self._steps.values()):
            return RunState.SUCCEEDED
        return RunState.FAILED

    def _measure_pool(self) -> str:
        """Set the memory the steps share (what the executor's host has, within the pipeline's
        budget); what sets it."""
        budget = self.executor.memory_budget()
        self._pool = min(budget.available, self.spec.budget or budget.available)
        return budget.binding if self._pool == budget.available else "the pipeline's budget"

    def _refusals(self, binding: str, argvs: dict[str, list[str]]) -> Iterator[PipelineError | ExecutorError]:
        """What cannot run, found before anything starts (``run`` refuses the first, ``--check``
        says each): a limit above the pool, services that do not fit or ask for GPUs that are not
        there, a missing input, a command (of those in ``argvs``) not found, what the executor
        cannot do."""
        where = "a step can have" if self.executor.admits_by_memory else "this host really has"
        for step in self.spec.steps:
            pool, by = self._step_pool(step), binding
            if pool != self._pool:  # a step on a partition of its own
                own = self._step_budgets[step.name]
                by = own.binding if pool == own.available else "the pipeline's budget"
            if step.memory > pool:
                yield PipelineError(
                    f"{step.at(self.pipeline_path, 'memory')}: {format_size(step.memory)} "
                    f"exceeds the {format_size(pool)} {where} (set by {by}); lower it or free memory"
                )
            if step.gpus:
                options = self.spec.executor_options(self.executor.name, step.name)
                have, gpus_where = self.executor.gpu_capacity(options)
                if step.gpus > have:
                    yield PipelineError(
                        f"{step.at(self.pipeline_path, 'gpus')}: {step.gpus}, more than the {have} GPU(s) "
                        f"{gpus_where}; lower its gpus"
                    )
        refused: list[PipelineError | ExecutorError] = []
        with _collected(refused):
            check_placement(self.spec, self.pipeline_path, self.executor, self._pool, binding)
        for step in self.spec.steps:
            with _collected(refused):
                check_inputs(self.spec, self.pipeline_path, self.run_dir, step)
                if self.executor.runs_here and step.name in argvs:
                    check_program(self.spec, self.pipeline_path, self.run_dir, step, argvs[step.name])
        options = {s.name: self.spec.executor_options(self.executor.name, s.name) for s in self.spec.steps}
        with _collected(refused):
            self.executor.preflight(self.run_dir, options)
        yield from refused

    def _step_pool(self, step: StepSpec) -> int:
        """The most one step's limit may be: the pool, or under a scheduler that admits by memory,
        what the step's own options (a Slurm partition) give it, within the pipeline's budget."""
        if not self.executor.admits_by_memory:
            return self._pool
        if step.name not in self._step_budgets:
            options = self.spec.executor_options(self.executor.name, step.name)
            self._step_budgets[step.name] = self.executor.memory_budget(options)
        available = self._step_budgets[step.name].available
        return min(available, self.spec.budget or available)

    def _loop(self) -> None:
        """Start what is ready, then settle each attempt as it ends, until none runs and none can start."""
        stopping = False
        self._start_ready()
        while self._waiting():
            try:
                running, outcome = self._results.get(timeout=0.2)
            except queue.Empty:
                if self._cancel.is_set() and not stopping:
                    stopping = True
                    self._stop_all()
                elif any(u.due <= time.monotonic() for u in self._unsubmitted()):
                    self._start_ready()
                elif self._services.changed.is_set():  # one became ready, or failed
                    self._services.changed.clear()
                    self._start_ready()
                continue
            del self._running[running.step.name]
            step = self._steps[running.step.name]
            if outcome is None:
                self._leave_running(step, running)
            else:
                self._settle(step, self._record(running, outcome), outcome)
            self._retire_unused_services()
            self._start_ready()

    def _waiting(self) -> bool:
        """Whether the loop has something to wait for: an attempt running, or (unless cancelled) one
        to submit again or a service starting. A service may have become ready, or failed, since the
        loop last looked: with nothing else to wait for, what that lets start starts (or fails with
        it) now, so that the run never ends with a user of the service still pending."""
        if self._running:
            return True
        if self._cancel.is_set():
            return False
        if not (self._unsubmitted() or self._services.starting()):
            self._services.changed.clear()
            self._start_ready()
        return bool(self._running or self._unsubmitted() or self._services.starting())

    def _start_ready(self) -> None:
        """Skip the steps that are up to date and start those whose needs are met, while their limits
        fit the pool (unless the executor's scheduler admits by memory)."""
        progress = True
        while progress and not self._cancel.is_set():
            progress = False
            in_use = sum(r.launch.limit_bytes for r in self._running.values()) + self._services.held_bytes()
            for step in self._steps.values():
                if step.state != StepState.PENDING or not all(
                    self._steps[n].state in SETTLED_STATES for n in step.spec.needs
                ):
                    continue
                parts = fingerprint_parts(self.spec, self.pipeline_path, self.run_dir, step.spec, step.argv)
                earlier = self._ledger.attempts(step.name)
                up_to_date, why = check_up_to_date(self.run_dir, step.spec, parts, earlier)
                if up_to_date and step.attempts == 0:
                    self._set_state(step, StepState.SKIPPED, why)
                    self.reporter.skipped(step.name, why)
                    progress = True
                    continue
                if not self.executor.admits_by_memory and in_use + step.limit > self._pool:
                    continue
                if not self._services_ready(step, in_use):
                    progress = step.state != StepState.PENDING  # failed with its service
                    continue
                if (waiting := step.unsubmitted) is not None:
                    if waiting.due > time.monotonic():
                        continue
                    step.unsubmitted = None  # until it is handed back again: ended, if _submit raises
                    step.unsubmitted = self._submit(step.spec, waiting)
                else:
                    if step.attempts == 0 and earlier:  # a retry's note has said why already
                        self.reporter.note(f"{step.name} runs again: {why}")
                    step.attempts += 1
                    step.unsubmitted = self._start(step, parts, why)
                if step.unsubmitted is not None:
                    continue
                self._set_state(step, StepState.RUNNING)
                in_use += step.limit
                progress = True

    def _services_ready(self, step: _StepRun, in_use: int) -> bool:
        """Whether every service ``step`` uses is ready; starts those not started yet while their
        replicas fit beside it; fails the step when one of them failed."""
        ready = True
        for name in step.spec.uses:
            state = self._services.state(name)
            if state == ServiceState.FAILED:
                self._finish(
                    step, StepState.FAILED, f"its service {name} failed: {self._services.failure(name)}"
                )
                return False
            if state == ServiceState.IDLE:
                extra = self._services.bytes_of(name)
                if self.executor.admits_by_memory or in_use + extra + step.limit <= self._pool:
                    self._services.start(name)
                    in_use += extra
            ready = ready and self._services.state(name) == ServiceState.READY  # an external one: at once
        return ready

    def _retire_unused_services(self) -> None:
        """Stop each service whose users have all ended."""
        for name in self._services.running():
            users = [self._steps[u] for u in self.spec.users(name)]
            if all(u.state not in (StepState.PENDING, StepState.RUNNING) for u in users):
                self._services.retire(name, "its last user ended")

    def _settle(self, step: _StepRun, decision: Decision, outcome: Outcome) -> None:
        """What follows an attempt's verdict: the step is done, cancelled or failed, or it runs again."""
        verdict = decision.verdict
        if verdict in DONE_VERDICTS:
            self._finish(step, StepState.DONE, str(verdict))
        elif verdict == Verdict.CANCELLED or self._cancel.is_set():
            self._finish(step, StepState.CANCELLED, str(verdict))
        elif verdict in TRANSIENT_VERDICTS and step.transient_retries < TRANSIENT_RETRIES:
            step.transient_retries += 1
            step.attempts -= 1  # not counted against `retries`: nothing was learned
            step.state = StepState.PENDING
            self.reporter.note(f"{step.name}: running it again ({verdict}, limit unchanged)")
        elif verdict in step.spec.retry_on and step.attempts <= step.spec.retries:
            pool = self._step_pool(step.spec)
            new_limit, why = next_limit(step.spec, verdict, step.limit, outcome, pool)
            if new_limit is None:
                self._finish(step, StepState.FAILED, f"{verdict}: {why}")
            else:
                step.limit, step.limit_reason = new_limit, why
                step.state = StepState.PENDING
                # the new limit and why: in the line that starts the attempt, said once
                self.reporter.note(f"{step.name}: retrying after {verdict}")
        else:
            self._finish(step, StepState.FAILED, f"{verdict}: {decision.reason}")

    def _set_state(self, step: _StepRun, state: StepState, detail: str = "") -> None:
        step.state = state
        self._ledger.set_step_state(self.run_id, step.name, state, detail)

    def _finish(self, step: _StepRun, state: StepState, detail: str) -> None:
        """Settle the step; when it failed or was cancelled, the steps waiting for it are blocked."""
        self._set_state(step, state, detail)
        if state not in (StepState.FAILED, StepState.CANCELLED):
            return
        for name in self.spec.dependents(step.name):
            dependent = self._steps[name]
            if dependent.state == StepState.PENDING:
                why = f"not run: {step.name} ended {detail.split(':')[0]}"
                self._set_state(dependent, StepState.BLOCKED, why)
                self.reporter.blocked(name, why)

    def _stop_on_error(self, error: str) -> None:
        """Stop and record what runs, and cancel what has not ended, giving ``error`` as the reason.
        A detached attempt (a Slurm job) is not stopped: it runs on, for the next run to find again."""
        for name, decision in self._stop_and_record().items():
            state = StepState.DONE if decision.verdict in DONE_VERDICTS else StepState.CANCELLED
            self._set_state(self._steps[name], state, f"{decision.verdict}: {error}")
        for step in self._steps.values():
            if step.name in self._running:
                where = self._running[step.name].handle.where
                self._set_state(step, StepState.RUNNING, f"left running ({where}), for the next run: {error}")
            elif step.state in (StepState.PENDING, StepState.RUNNING):
                self._drop_unsubmitted(step, error)
                self._set_state(step, StepState.CANCELLED, f"cancelled: {error}")

    def _stop_all(self, detached_too: bool = True) -> None:
        for r in list(self._running.values()):
            if detached_too or not r.detached:
                threading.Thread(target=r.handle.stop, args=("cancel",), daemon=True).start()

    def _stop_and_record(self) -> dict[str, Decision]:
        """Stop every running attempt but the detached ones and record how each ended; those not
        seen to end within STOP_WAIT_S stay 'running' in the ledger, for the next run to end what is
        left of them (or, detached, to find them again)."""
        self._stop_all(detached_too=False)
        decisions = {}
        deadline = time.monotonic() + STOP_WAIT_S
        while any(not r.detached for r in self._running.values()) and time.monotonic() < deadline:
            try:
                running, outcome = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            del self._running[running.step.name]
            if outcome is not None:
                decisions[running.step.name] = self._record(running, outcome)
        return decisions

    def _unsubmitted(self) -> list[_Unsubmitted]:
        return [s.unsubmitted for s in self._steps.values() if s.unsubmitted is not None]

    def _drop_unsubmitted(self, step: _StepRun, why: str) -> None:
        """End the attempt the step waited to submit again: it never ran (as far as anyone knows)."""
        if (waiting := step.unsubmitted) is None:
            return
        step.unsubmitted = None
        self._ledger.end_attempt(
            waiting.attempt_id,
            verdict=Verdict.CANCELLED.value,
            reason=f"never submitted: the scheduler did not answer, then {why}",
            fields={"ended_at": time.time()},
            timeline=[],
        )

    def _leave_running(self, step: _StepRun, running: _Running) -> None:
        """An attempt whose end the runner could not see, and that it could not stop: it stays
        'running' in the ledger, for the next run to find again or end."""
        where = running.handle.where
        self.reporter.note(f"{step.name}: lost track of {where} and could not stop it; the next run finds it")
        self._finish(step, StepState.FAILED, f"left running ({where}): the runner lost track of it")

    # -- one attempt ---------------------------------------------------------------------
    def _launch(
        self,
        step: StepSpec,
        attempt: int,
        argv: list[str],
        fingerprint: str,
        limit: int,
        executor: Executor | None = None,
    ) -> Launch:
        stdout_path, stderr_path = attempt_logs(self.run_dir, step.name, attempt)
        runner = runner_env(self.pipeline_path, self.run_dir, step)
        if self._services is not None:
            runner |= {service_urls_env(n): ",".join(self._services.urls(n)) for n in step.uses}
        return Launch(
            run_id=self.run_id,
            step=step.name,
            attempt=attempt,
            argv=argv,
            cwd=self.run_dir / step.name,
            env={**os.environ, **runner, **step.env, FINGERPRINT_ENV: fingerprint},
            step_env=frozenset({*runner, *step.env, FINGERPRINT_ENV}),
            limit_bytes=limit,
            stdout_path=stdout_path,
            stderr_path=stderr_path,
            gpus=step.gpus,
            timeout=step.timeout,
            options=self.spec.executor_options((executor or self.executor).name, step.name),
            on_line=lambda stream, text, name=step.name: self.reporter.line(name, stream, text),
        )

    def _start(self, run: _StepRun, parts: dict, run_reason: str) -> _Unsubmitted | None:
        """Start ``run``'s next attempt, its fingerprint made of ``parts``, for ``run_reason``."""
        step, argv, limit, limit_reason = run.spec, run.argv, run.limit, run.limit_reason
        fingerprint = digest(parts)
        step_dir = self.run_dir / step.name
        step_dir.mkdir(parents=True, exist_ok=True)
        invalidate_manifest(step_dir)  # an earlier attempt's manifest must not make this one look complete
        attempt = self._ledger.next_attempt_number(step.name)
        host = self.executor.host_memory() if self.executor.host_memory else None  # None: not seen here
        launch = self._launch(step, attempt, argv, fingerprint, limit)
        attempt_id = self._ledger.begin_attempt(
            run_id=self.run_id,
            step=step.name,
            attempt=attempt,
            executor=self.executor.name,
            limit_bytes=limit,
            limit_reason=limit_reason,
            argv=argv,
            host_mem_available=None if host is None else host.mem_available,
            host_mem_total=None if host is None else host.mem_total,
            image=self._image(launch),
            commit_id=self.commit,
            outputs=step.outputs,
            run_reason=run_reason,
            fingerprint_parts=parts,
        )
        self.reporter.started(step.name, attempt, limit, limit_reason)
        return self._submit(step, _Unsubmitted(attempt, attempt_id, launch, fingerprint, time.monotonic()))

    def _submit(self, step: StepSpec, pending: _Unsubmitted) -> _Unsubmitted | None:
        """Hand the attempt to the executor. A detached executor's submission that got no answer is
        handed back, to be tried again later (the step waits, nothing else stops); any other failure
        ends the attempt and stops the run."""
        started_at = time.time()
        try:
            handle = self.executor.start(pending.launch)
        except ExecutorUnavailable as exc:
            if self.executor.detached and time.monotonic() - pending.first_tried < SUBMIT_PATIENCE_S:
                self.reporter.note(f"{step.name}: {exc}; submitting it again in {SUBMIT_RETRY_S:.0f} s")
                return dataclasses.replace(pending, due=time.monotonic() + SUBMIT_RETRY_S)
            self._end_unstarted(pending.attempt_id, exc)
            raise
        except BaseException as exc:
            self._end_unstarted(pending.attempt_id, exc)
            raise
        self._ledger.attempt_started(pending.attempt_id, handle.pid, handle.where)
        self._watch(
            _Running(
                step,
                pending.attempt,
                pending.attempt_id,
                pending.launch,
                handle,
                pending.fingerprint,
                started_at,
                self.executor.detached,
            )
        )
        return None

    def _end_unstarted(self, attempt_id: int, exc: BaseException) -> None:
        self._ledger.end_attempt(
            attempt_id,
            verdict=Verdict.FAILED.value,
            reason=f"the {self.executor.name} executor could not start it: {exc}",
            fields={"ended_at": time.time(), "stderr_tail": json.dumps([str(exc)])},
            timeline=[],
        )

    @staticmethod
    def _image(launch: Launch) -> str | None:
        """The image a step names, for the ledger (its options' fingerprint holds it, as for Docker's)."""
        return launch.options.fingerprint().get("image") if launch.options is not None else None

    def _watch(self, running: _Running) -> None:
        self._running[running.step.name] = running
        name = running.step.name
        threading.Thread(target=self._wait, args=(running,), name=f"wait-{name}", daemon=True).start()

    def _wait(self, running: _Running) -> None:
        try:
            outcome = running.handle.wait(running.step.timeout)
            if outcome is None:
                running.handle.stop("timeout")
                outcome = running.handle.wait()
        except Exception as exc:  # noqa: BLE001 - the run loop must hear of every attempt's end
            outcome = self._lost(running, f"{type(exc).__name__}: {exc}")
        self._results.put((running, outcome))

    @staticmethod
    def _lost(running: _Running, error: str) -> Outcome | None:
        """The outcome of an attempt whose end the runner could not see: stopped if it can be. A
        detached one that cannot be stopped either has no outcome (None): it may still run."""
        try:
            running.handle.stop("cancel")
        except Exception:  # noqa: BLE001 - the error above is what gets recorded
            if running.detached:
                return None
        return Outcome.unwatched(
            running.started_at,
            stderr_tail=[f"eyrie: lost track of the attempt: {error}"],
            where=running.handle.where,
            runner_error=error,
        )

    def _record(self, running: _Running, outcome: Outcome) -> Decision:
        step, step_dir = running.step, running.launch.cwd
        complete, detail = check_manifest(step_dir, step.outputs)
        if not complete and outcome.exit_code == 0 and read_manifest(step_dir) is None:
            # A plain command does not write a manifest: on success the runner writes it.
            try:
                write_manifest(step_dir, step.outputs, step=step.name, fingerprint=running.fingerprint)
                complete, detail = check_manifest(step_dir, step.outputs)
            except FileNotFoundError as exc:
                detail = str(exc)
        decision = decide(outcome, complete, detail, self._cancelled_by)
        given_back = RESERVE_BYTES if self._ledger.reserve_given_back else 0
        if no_space := no_space_note(step_dir, outcome.log_error, outcome.stderr_tail, given_back):
            decision = Decision(decision.verdict, f"{decision.reason}; {no_space}")
        manifest = read_manifest(step_dir) if complete else None
        if decision.verdict not in DONE_VERDICTS:
            # e.g. exit 0 after a child's OOM kill: a manifest would let a rerun skip the step.
            (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
        self._ledger.end_attempt(
            running.attempt_id,
            verdict=decision.verdict.value,
            reason=decision.reason,
            fields=outcome.ledger_fields(manifest.records() if manifest else None),
            timeline=outcome.timeline,
        )
        self.reporter.ended(step.name, running.attempt, decision, outcome)
        return decision
