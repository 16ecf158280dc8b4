"""Runs a pipeline: order, memory-bounded parallelism, resume, retry, and the ledger.

Steps whose needs are met run side by side while the sum of their memory
limits fits the budget. Each attempt's outcome becomes a verdict
(``verdict.decide``) and a ledger row. A rerun in the same run directory skips
steps whose manifest matches their inputs; a runner killed without warning
leaves attempts marked ``running``: the next run watches again those its
executor can hand back (a Slurm job outlives its runner) and closes the others
as ``cancelled``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.memory import format_size
from pipeline.run import EXECUTORS
from pipeline.run.executor import AttemptStillRunning, Executor, Launch, Outcome, RunningAttempt
from pipeline.run.host_sampler import HostSampler
from pipeline.run.layout import STATE_DIR, attempt_logs
from pipeline.run.ledger import AttemptRow, Ledger
from pipeline.run.manifest import (
    FINGERPRINT_ENV,
    MANIFEST_NAME,
    PIPELINE_DIR_ENV,
    RUN_DIR_ENV,
    STEP_DIR_ENV,
    STEP_NAME_ENV,
    check_manifest,
    invalidate_manifest,
    manifest_digest,
    read_manifest,
    sha256_file,
    write_manifest,
)
from pipeline.run.spec import PipelineError, PipelineSpec, StepSpec, UnknownVariable, substitute
from pipeline.run.verdict import DONE_VERDICTS, TRANSIENT_VERDICTS, Decision, Verdict, decide

_MIB = 1024 * 1024
STOP_WAIT_S = 30.0  # after an error: how long stopped attempts get to end (executors kill after 5 s)
TRANSIENT_RETRIES = 3  # a step whose node was taken away runs again up to this often, besides `retries`


class Reporter(Protocol):
    """What the runner tells whoever watches it (the console, a test)."""

    def line(self, step: str, stream: str, text: str) -> None: ...
    def started(self, step: str, attempt: int, limit_bytes: int, limit_reason: str | None) -> None: ...
    def ended(self, step: str, attempt: int, decision: Decision, outcome: Outcome) -> None: ...
    def skipped(self, step: str, reason: str) -> None: ...
    def blocked(self, step: str, reason: str) -> None: ...
    def note(self, text: str) -> None: ...


class RunDirBusy(RuntimeError):
    pass


@dataclass
class RunResult:
    run_id: str
    state: str  # succeeded | failed | cancelled

    @property
    def exit_code(self) -> int:
        return {"succeeded": 0, "cancelled": 130}.get(self.state, 1)


@dataclass
class _Running:
    step: StepSpec
    attempt: int
    attempt_id: int
    launch: Launch
    handle: RunningAttempt
    fingerprint: str
    started_at: float


def eyrie_commit() -> str | None:
    """The git commit of the eyrie source this runs from, when it runs from a checkout."""
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        )  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


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

    # -- public ----------------------------------------------------------------------
    def run(self) -> RunResult:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._lock_run_dir():
            ledger = Ledger(self.run_dir)
            try:
                return self._run(ledger)
            finally:
                ledger.close()

    def cancel(self) -> None:
        """Ask the run to stop: running attempts are stopped and recorded as cancelled."""
        self._cancel.set()

    # -- the loop ----------------------------------------------------------------------
    def _run(self, ledger: Ledger) -> RunResult:
        resumed = self._close_orphans(ledger)
        budget = self.executor.memory_budget()
        pool = min(budget.available, self.spec.budget or budget.available)
        binding = budget.binding if pool == budget.available else "the pipeline's budget"
        where = "a step can have" if self.executor.admits_by_memory else "this host really has"
        for step in self.spec.steps:
            if step.memory > pool:
                raise PipelineError(
                    f"{self.pipeline_path}: steps ({step.name}).memory: {format_size(step.memory)} "
                    f"exceeds the {format_size(pool)} {where} (set by {binding}); "
                    "lower it or free memory"
                )
        for step in self.spec.steps:
            self._check_inputs(step)
        options = {s.name: self.spec.executor_options(self.executor.name, s.name) for s in self.spec.steps}
        self.executor.preflight(self.run_dir, options)
        argvs = {s.name: self._expand(s) for s in self.spec.steps}
        order = [s.name for s in self.spec.order()]
        ledger.start_run(self.run_id, str(self.pipeline_path), self.executor.name, order, pool, binding,
                         host_sampled=self.executor.host_memory is not None)  # fmt: skip
        host = HostSampler(ledger, self.run_id, self.executor.host_memory).start()
        self.reporter.note(
            f"run {self.run_id}: {len(order)} steps, budget {format_size(pool)} (set by {binding}), "
            f"executor {self.executor.name}"
        )
        states = {name: "pending" for name in order}
        limits = {s.name: s.memory for s in self.spec.steps}
        limit_reasons: dict[str, str | None] = {name: None for name in order}
        attempts_made = {name: 0 for name in order}
        transient_retries = {name: 0 for name in order}
        for running in resumed:
            name = running.step.name
            states[name], attempts_made[name] = "running", 1
            limits[name] = running.launch.limit_bytes
            ledger.set_step_state(self.run_id, name, "running")
            self._watch(running)

        def launch_ready() -> None:
            progress = True
            while progress and not self._cancel.is_set():
                progress = False
                in_use = sum(r.launch.limit_bytes for r in self._running.values())
                for name in order:
                    step = self.spec.step(name)
                    if states[name] != "pending" or not all(
                        states[n] in ("done", "skipped") for n in step.needs
                    ):
                        continue
                    fingerprint = self._fingerprint(step, argvs[name])
                    up_to_date, why = self._up_to_date(step, fingerprint)
                    if up_to_date and attempts_made[name] == 0:
                        states[name] = "skipped"
                        ledger.set_step_state(self.run_id, name, "skipped", why)
                        self.reporter.skipped(name, why)
                        progress = True
                        continue
                    if not self.executor.admits_by_memory and in_use + limits[name] > pool:
                        continue
                    attempts_made[name] += 1
                    self._start(ledger, step, argvs[name], fingerprint, limits[name], limit_reasons[name])
                    states[name] = "running"
                    ledger.set_step_state(self.run_id, name, "running")
                    in_use += limits[name]
                    progress = True

        def finish(name: str, state: str, detail: str) -> None:
            states[name] = state
            ledger.set_step_state(self.run_id, name, state, detail)
            if state in ("failed", "cancelled"):
                for dependent in self.spec.dependents(name):
                    if states[dependent] == "pending":
                        states[dependent] = "blocked"
                        why = f"not run: {name} ended {detail.split(':')[0]}"
                        ledger.set_step_state(self.run_id, dependent, "blocked", why)
                        self.reporter.blocked(dependent, why)

        stopping = False
        try:
            launch_ready()
            while self._running:
                try:
                    running, outcome = self._results.get(timeout=0.2)
                except queue.Empty:
                    if self._cancel.is_set() and not stopping:
                        stopping = True
                        self._stop_all()
                    continue
                del self._running[running.step.name]
                step = running.step
                decision = self._record(ledger, running, outcome)
                name = step.name
                if decision.verdict in DONE_VERDICTS:
                    finish(name, "done", str(decision.verdict))
                elif decision.verdict == Verdict.CANCELLED or self._cancel.is_set():
                    finish(name, "cancelled", str(decision.verdict))
                elif decision.verdict in TRANSIENT_VERDICTS and transient_retries[name] < TRANSIENT_RETRIES:
                    transient_retries[name] += 1
                    attempts_made[name] -= 1  # not counted against `retries`: nothing was learned
                    states[name] = "pending"
                    self.reporter.note(f"{name}: running it again ({decision.verdict}, limit unchanged)")
                elif decision.verdict in step.retry_on and attempts_made[name] <= step.retries:
                    new_limit, why = self._next_limit(step, decision.verdict, limits[name], outcome, pool)
                    if new_limit is None:
                        finish(name, "failed", f"{decision.verdict}: {why}")
                    else:
                        limits[name], limit_reasons[name] = new_limit, why
                        states[name] = "pending"
                        self.reporter.note(f"{name}: retrying ({why})")
                else:
                    finish(name, "failed", f"{decision.verdict}: {decision.reason}")
                launch_ready()
        except BaseException as exc:
            # The runner itself failed: its steps must not run on unwatched, nor stay 'running'.
            error = f"the run stopped on an error: {exc}"
            for name, decision in self._stop_and_record(ledger).items():
                states[name] = "done" if decision.verdict in DONE_VERDICTS else "cancelled"
                ledger.set_step_state(self.run_id, name, states[name], f"{decision.verdict}: {error}")
            for name, state in states.items():
                if state in ("pending", "running"):
                    states[name] = "cancelled"
                    ledger.set_step_state(self.run_id, name, "cancelled", f"cancelled: {error}")
            host.stop()
            ledger.end_run(self.run_id, "failed")
            raise

        for name, state in states.items():
            if state == "pending":  # only when cancelled before it could start
                finish(name, "cancelled", "cancelled: the run was cancelled before it started")
        if self._cancel.is_set():
            run_state = "cancelled"
        elif all(s in ("done", "skipped") for s in states.values()):
            run_state = "succeeded"
        else:
            run_state = "failed"
        host.stop()
        ledger.end_run(self.run_id, run_state)
        return RunResult(self.run_id, run_state)

    def _stop_all(self) -> None:
        for r in list(self._running.values()):
            threading.Thread(target=r.handle.stop, args=("cancel",), daemon=True).start()

    def _stop_and_record(self, ledger: Ledger) -> dict[str, Decision]:
        """Stop every running attempt and record how each ended; those not seen to end within
        STOP_WAIT_S stay 'running' in the ledger, for the next run to end what is left of them."""
        self._stop_all()
        decisions = {}
        deadline = time.monotonic() + STOP_WAIT_S
        while self._running and time.monotonic() < deadline:
            try:
                running, outcome = self._results.get(timeout=0.2)
            except queue.Empty:
                continue
            del self._running[running.step.name]
            decisions[running.step.name] = self._record(ledger, running, outcome)
        return decisions

    # -- one attempt ---------------------------------------------------------------------
    def _launch(self, step: StepSpec, attempt: int, argv: list[str], fingerprint: str, limit: int) -> Launch:
        stdout_path, stderr_path = attempt_logs(self.run_dir, step.name, attempt)
        return Launch(
            run_id=self.run_id,
            step=step.name,
            attempt=attempt,
            argv=argv,
            cwd=self.run_dir / step.name,
            env={**os.environ, **self._eyrie_env(step), **step.env, FINGERPRINT_ENV: fingerprint},
            limit_bytes=limit,
            stdout_path=stdout_path,
            stderr_path=stderr_path,
            gpus=step.gpus,
            timeout=step.timeout,
            options=self.spec.executor_options(self.executor.name, step.name),
            on_line=lambda stream, text, name=step.name: self.reporter.line(name, stream, text),
        )

    def _start(self, ledger: Ledger, step: StepSpec, argv: list[str], fingerprint: str,
               limit: int, limit_reason: str | None) -> None:  # fmt: skip
        step_dir = self.run_dir / step.name
        step_dir.mkdir(parents=True, exist_ok=True)
        invalidate_manifest(step_dir)  # an earlier attempt's manifest must not make this one look complete
        attempt = ledger.next_attempt_number(step.name)
        host = self.executor.host_memory() if self.executor.host_memory else None  # None: not seen here
        launch = self._launch(step, attempt, argv, fingerprint, limit)
        attempt_id = ledger.begin_attempt(
            run_id=self.run_id, step=step.name, attempt=attempt, executor=self.executor.name,
            limit_bytes=limit, limit_reason=limit_reason, argv=argv,
            host_mem_available=None if host is None else host.mem_available,
            host_mem_total=None if host is None else host.mem_total,
            image=self._image(launch), commit_id=self.commit, outputs=step.outputs,
        )  # fmt: skip
        self.reporter.started(step.name, attempt, limit, limit_reason)
        started_at = time.time()
        try:
            handle = self.executor.start(launch)
        except BaseException as exc:
            ledger.end_attempt(
                attempt_id, verdict=Verdict.FAILED.value,
                reason=f"the {self.executor.name} executor could not start it: {exc}",
                fields={"ended_at": time.time(), "stderr_tail": json.dumps([str(exc)])}, timeline=[],
            )  # fmt: skip
            raise
        ledger.attempt_started(attempt_id, handle.pid, handle.where)
        self._watch(_Running(step, attempt, attempt_id, launch, handle, fingerprint, started_at))

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
    def _lost(running: _Running, error: str) -> Outcome:
        """The outcome of an attempt whose end the runner could not see: stopped if it can be."""
        with contextlib.suppress(Exception):  # best effort: the error above is what gets recorded
            running.handle.stop("cancel")
        return Outcome(
            exit_code=None, signal=None, oom_kills_before=0, oom_kills_after=0, oom_at=None,
            peak_bytes=None, anon_peak_bytes=None, started_at=running.started_at, ended_at=time.time(),
            stderr_tail=[f"eyrie: lost track of the attempt: {error}"], where=running.handle.where,
            runner_error=error,
        )  # fmt: skip

    def _record(self, ledger: Ledger, running: _Running, outcome: Outcome) -> Decision:
        step, step_dir = running.step, running.launch.cwd
        complete, detail = check_manifest(step_dir, step.outputs)
        if not complete and outcome.exit_code == 0 and read_manifest(step_dir) is None:
            # A plain command does not write a manifest: on success the runner writes it.
            try:
                write_manifest(step_dir, step.outputs, step=step.name, fingerprint=running.fingerprint)
                complete, detail = check_manifest(step_dir, step.outputs)
            except FileNotFoundError as exc:
                detail = str(exc)
        decision = decide(outcome, complete, detail)
        manifest = read_manifest(step_dir) if complete else None
        if decision.verdict not in DONE_VERDICTS:
            # e.g. exit 0 after a child's OOM kill: a manifest would let a rerun skip the step.
            (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
        ledger.end_attempt(
            running.attempt_id,
            verdict=decision.verdict.value,
            reason=decision.reason,
            fields={
                "peak_bytes": outcome.peak_bytes,
                "anon_peak_bytes": outcome.anon_peak_bytes,
                "oom_kills": outcome.oom_kills,
                "oom_kills_before": outcome.oom_kills_before,
                "oom_kills_after": outcome.oom_kills_after,
                "oom_at": outcome.oom_at,
                "exit_code": outcome.exit_code,
                "signal": outcome.signal,
                "started_at": outcome.started_at,
                "ended_at": outcome.ended_at,
                "records": manifest.records() if manifest else None,
                "stderr_tail": json.dumps(outcome.stderr_tail),
            },
            timeline=outcome.timeline,
        )
        self.reporter.ended(step.name, running.attempt, decision, outcome)
        return decision

    @staticmethod
    def _next_limit(step: StepSpec, verdict: Verdict, limit: int, outcome: Outcome,
                    pool: int) -> tuple[int | None, str]:  # fmt: skip
        if verdict not in (Verdict.OOM_KILLED, Verdict.CHILD_OOM_KILLED, Verdict.MEMORY_ERROR):
            return limit, f"attempt after {verdict}, retry_on names it; limit unchanged"
        basis = max(limit, outcome.peak_bytes or 0)
        wanted = math.ceil(basis * step.memory_growth / _MIB) * _MIB
        new = min(wanted, pool)
        if new <= limit:
            return (
                None,
                f"cannot raise the limit above {format_size(limit)}: the budget is {format_size(pool)}",
            )
        capped = " (capped by the budget)" if new < wanted else ""
        return new, (
            f"limit raised from {format_size(limit)} to {format_size(new)}{capped} after {verdict}: "
            f"peak {format_size(outcome.peak_bytes)} × {step.memory_growth}"
        )

    # -- inputs, fingerprints, resume --------------------------------------------------------
    def _eyrie_env(self, step: StepSpec) -> dict[str, str]:
        # Steps find the same `python3` and `eyrie` as the runner (its virtual environment first).
        interpreter_bin = str(Path(sys.executable).parent)
        return {
            "PATH": os.pathsep.join([interpreter_bin, os.environ.get("PATH", os.defpath)]),
            RUN_DIR_ENV: str(self.run_dir),
            STEP_DIR_ENV: str(self.run_dir / step.name),
            STEP_NAME_ENV: step.name,
            PIPELINE_DIR_ENV: str(self.pipeline_path.parent),
        }

    def _expand(self, step: StepSpec) -> list[str]:
        """The step's argv with the runner's variables and the step's ``env`` expanded
        (settings from the environment were expanded when the file was loaded)."""
        variables = {**self._eyrie_env(step), **step.env}

        def lookup(name: str, default: str | None) -> str:
            if variables.get(name):
                return variables[name]
            if default is not None:
                return default
            if name in variables:
                return ""
            raise UnknownVariable(name)

        try:
            return [substitute(arg, lookup) for arg in step.command]
        except UnknownVariable as exc:
            raise PipelineError(
                f"{self.pipeline_path}: steps ({step.name}).command: unknown variable ${{{exc.args[0]}}}; "
                f"known here: {', '.join(sorted(variables))}"
            ) from None

    def _missing_input(self, step: StepSpec, path: Path) -> PipelineError:
        what = "is not a file" if path.exists() else "does not exist"
        return PipelineError(
            f"{self.pipeline_path}: steps ({step.name}).inputs: {path} {what} (inputs are files beside "
            "the pipeline file, or written by a step it needs: create it or fix the path)"
        )

    def _check_inputs(self, step: StepSpec) -> None:
        """Before anything starts: every input exists, unless a step it needs is to write it."""
        upstream_dirs = [self.run_dir / name for name in self.spec.upstream(step.name)]
        for rel in step.inputs:
            path = (self.pipeline_path.parent / rel).resolve()
            if not path.is_file() and not any(d in path.parents for d in upstream_dirs):
                raise self._missing_input(step, path)

    def _fingerprint(self, step: StepSpec, argv: list[str]) -> str:
        inputs = {}
        for rel in step.inputs:
            path = self.pipeline_path.parent / rel
            if not path.is_file():
                raise self._missing_input(step, path)
            inputs[rel] = sha256_file(path)
        payload = {
            "argv": argv,
            "env": step.env,
            "outputs": step.outputs,
            "needs": {n: manifest_digest(self.run_dir / n) for n in step.needs},
            "inputs": inputs,
        }
        for executor in EXECUTORS:  # e.g. a step's Docker image: other options leave results as they are
            payload.update(self.spec.executor_options(executor, step.name).fingerprint())
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()

    def _up_to_date(self, step: StepSpec, fingerprint: str) -> tuple[bool, str]:
        step_dir = self.run_dir / step.name
        manifest = read_manifest(step_dir)
        if manifest is None:
            return False, "no manifest"
        if manifest.fingerprint != fingerprint:
            return False, "its command, inputs or upstream outputs changed"
        complete, detail = check_manifest(step_dir, step.outputs)
        if not complete:
            return False, detail
        return True, "up to date: its manifest matches its outputs and inputs"

    # -- crash safety ----------------------------------------------------------------------
    def _lock_run_dir(self):
        state = self.run_dir / STATE_DIR
        state.mkdir(parents=True, exist_ok=True)
        lock_path = state / "lock"
        fh = open(lock_path, "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "another process"
            fh.close()
            raise RunDirBusy(
                f"{self.run_dir} is in use by eyrie pid {holder}; wait for it, or use another --run-dir"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        return _Unlock(fh)

    def _close_orphans(self, ledger: Ledger) -> list[_Running]:
        """Attempts still 'running' belong to a runner that died. Those the executor can watch
        again (a Slurm job, found by its id) are handed back, to be waited for like any other, when
        their step is unchanged; what is left of the others is ended where the ledger says they ran
        and recorded cancelled. One that cannot be stopped stays 'running', and nothing starts."""
        resumed, stuck = [], []
        for row in ledger.running_attempts():
            running, why_not = self._resume(row)
            if running is not None:
                resumed.append(running)
                self.reporter.note(
                    f"{row.step} attempt {row.attempt}: the runner (pid {row.orchestrator_pid}) stopped "
                    f"before it ended; found it again ({running.handle.where}), waiting for it"
                )
                continue
            try:
                killed = self.executor.reap(row.location, row.pid, row.started_at) if row.location else 0
            except AttemptStillRunning as exc:
                stuck.append(f"{row.step} attempt {row.attempt} of an earlier run: {exc}")
                continue
            reason = (
                f"the runner (pid {row.orchestrator_pid}) stopped before this attempt ended; "
                f"found at the next run{why_not}, {killed} leftover process(es) killed"
            )
            ledger.end_attempt(row.id, verdict=Verdict.CANCELLED.value, reason=reason,
                               fields={"ended_at": time.time()}, timeline=[])  # fmt: skip
            self.reporter.note(f"{row.step} attempt {row.attempt}: {reason}")
        if stuck:
            raise RunDirBusy(f"{self.run_dir} is in use: {'; '.join(stuck)}")
        latest = ledger.latest_run()
        if latest and latest["state"] == "running":
            ledger.end_run(latest["run_id"], "cancelled")
        return resumed

    def _resume(self, row: AttemptRow) -> tuple[_Running | None, str]:
        """The attempt of a dead runner watched again, or None and why not (for the cancel reason)."""
        if row.executor != self.executor.name or not row.location:
            return None, ""
        try:
            step = self.spec.step(row.step)
        except KeyError:
            return None, " (its step is no longer in the pipeline)"
        argv = self._expand(step)
        if json.loads(row.argv) != argv:
            return None, " (its step's command changed)"
        fingerprint = self._fingerprint(step, argv)
        launch = self._launch(step, row.attempt, argv, fingerprint, row.limit_bytes)
        handle = self.executor.resume(row.location, launch)
        if handle is None:
            return None, ""
        return _Running(step, row.attempt, row.id, launch, handle, fingerprint, row.started_at), ""


class _Unlock:
    def __init__(self, fh) -> None:
        self.fh = fh

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fh, fcntl.LOCK_UN)
        self.fh.close()
