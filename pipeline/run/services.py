"""Services: the servers a pipeline declares for its steps (DESIGN.md, "Services").

A service starts when the first step that uses it is otherwise ready to start, its replicas in
parallel, each on a port the runner chose. It is ready once every replica's health path answered
200; only then do the steps that use it start, with its URLs in their environment. Each replica
is an attempt in the ledger, judged from the same evidence as a step's. A replica that ends while
the service is in use is started again on the same port within the service's ``retries``; where it
answers then is written to the run directory (``service_urls_path``), for its users to follow it
to another node. A service stops once the last step using it has ended, and when
the run ends.
"""

from __future__ import annotations

import enum
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from pipeline.contract.atomic import atomic_write_text
from pipeline.contract.step import SERVICE_PORT_ENV, service_urls_path
from pipeline.memory import format_duration, format_size
from pipeline.run.executor import Executor, Launch, LineSink, Outcome, RunningAttempt, StepOptions
from pipeline.run.layout import attempt_logs
from pipeline.run.ledger import Ledger
from pipeline.run.spec import PipelineError, PipelineSpec, ServiceSpec
from pipeline.run.step_inputs import expand_argv, runner_env
from pipeline.run.verdict import Decision, decide_service

HEALTH_POLL_S = 0.5
HEALTH_REQUEST_S = 2.0


class ServiceState(str, enum.Enum):
    IDLE = "idle"
    """Not started: no step that uses it was ready yet."""
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    """A replica could not be kept running within ``retries``: its users cannot start."""
    STOPPED = "stopped"


def free_port() -> int:
    """A TCP port nothing listens on now, for a replica to listen on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def service_argv(pipeline_path: Path, service: ServiceSpec, variables: dict[str, str]) -> list[str]:
    """The service's argv with the runner's variables (its port among them) and its ``env``."""
    return expand_argv(pipeline_path, service, variables)


def replica_launch(
    pipeline_path: Path,
    run_dir: Path,
    run_id: str,
    service: ServiceSpec,
    *,
    attempt: int,
    port: int,
    options: StepOptions | None,
    on_line: LineSink | None = None,
) -> Launch:
    """One attempt of a replica listening on ``port``, fully resolved."""
    step_dir = run_dir / service.name
    step_dir.mkdir(parents=True, exist_ok=True)
    env = {**runner_env(pipeline_path, run_dir, service), SERVICE_PORT_ENV: str(port), **service.env}
    stdout_path, stderr_path = attempt_logs(run_dir, service.name, attempt)
    return Launch(
        run_id=run_id,
        step=service.name,
        attempt=attempt,
        argv=service_argv(pipeline_path, service, env),
        cwd=step_dir,
        env={**os.environ, **env},
        step_env=frozenset(env),
        limit_bytes=service.memory,
        stdout_path=stdout_path,
        stderr_path=stderr_path,
        gpus=service.gpus,
        options=options,
        on_line=on_line,
    )


def recorded_port(pipeline_path: Path, run_dir: Path, service: ServiceSpec, argv: list[str]) -> int | None:
    """The port of a replica started with ``argv``, if that is the service's command as the file
    says it now (with some port); None when the command changed."""
    marker = "\x00port\x00"
    variables = {**runner_env(pipeline_path, run_dir, service), SERVICE_PORT_ENV: marker, **service.env}
    try:
        template = service_argv(pipeline_path, service, variables)
    except PipelineError:
        return None
    if len(template) != len(argv):
        return None
    ports = set()
    for want, got in zip(template, argv, strict=True):
        pattern = "^" + re.escape(want).replace(re.escape(marker), "([0-9]+)") + "$"
        if (match := re.match(pattern, got)) is None:
            return None
        ports.update(match.groups())
    return int(ports.pop()) if len(ports) == 1 else None


@dataclass
class AdoptedReplica:
    """A replica a runner that died left running, found again by its executor with its command
    unchanged: the service starts with it instead of a new one."""

    service: str
    index: int
    port: int
    attempt_id: int
    launch: Launch
    handle: RunningAttempt


def check_placement(
    spec: PipelineSpec, pipeline_path: Path, executor: Executor, pool: int, binding: str
) -> None:
    """Refuse, before anything starts, services ``executor`` cannot run, or whose replicas and
    largest user do not fit in ``pool`` together; under a scheduler that admits by memory (Slurm),
    a replica whose memory exceeds what one of its jobs can have (the largest node of its partition)."""
    started = [s for s in spec.services if not s.external]
    if started and getattr(executor, "service_host", None) is None:
        raise PipelineError(
            f"{pipeline_path}: services: the {executor.name} executor does not run services; "
            "run with --executor local, or start the server yourself and give the steps its URL"
        )
    for service in started:
        options = spec.executor_options(executor.name, service.name)
        _check_gpus(pipeline_path, executor, service, options)
        if executor.admits_by_memory:
            own = executor.memory_budget(options)
            if service.memory > own.available:
                raise PipelineError(
                    f"{service.at(pipeline_path, 'memory')}: {format_size(service.memory)} "
                    f"exceeds the {format_size(own.available)} a replica can have (set by {own.binding}); "
                    "lower it, or give the service a partition with larger nodes"
                )
            continue
        users = [spec.step(name) for name in spec.users(service.name)]
        need = service.memory * service.replicas + max((u.memory for u in users), default=0)
        if need > pool:
            raise PipelineError(
                f"{service.at(pipeline_path)}: {service.replicas} replica(s) of "
                f"{format_size(service.memory)} beside its largest user need {format_size(need)}, more "
                f"than the {format_size(pool)} this host really has (set by {binding}); lower "
                "its replicas or memory"
            )


def _check_gpus(
    pipeline_path: Path, executor: Executor, service: ServiceSpec, options: StepOptions | None
) -> None:
    """Refuse replicas that ask for more GPUs than there are: together on one host (local, docker),
    or each in a job of its own (Slurm)."""
    if not service.gpus:
        return
    have, where = executor.gpu_capacity(options)
    if executor.admits_by_memory:
        need, asked = service.gpus, f"{service.gpus} per replica"
    else:
        need = service.gpus * service.replicas
        asked = f"{service.replicas} replica(s) of {service.gpus} need {need}"
    if need > have:
        raise PipelineError(
            f"{service.at(pipeline_path, 'gpus')}: {asked}, more than the {have} GPU(s) "
            f"{where}; lower its gpus or replicas"
        )


def answers_health(url: str, timeout: float = HEALTH_REQUEST_S) -> bool:
    """Whether GET ``url`` answers 200 now."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - our own http URL
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass
class Replica:
    service: ServiceSpec
    index: int
    """1-based, as shown."""
    port: int
    url: str = ""
    ready: bool = False
    handle: RunningAttempt | None = None
    starts: int = 0
    adopted: AdoptedReplica | None = None
    """A dead runner's replica it goes on with, before it starts any of its own."""

    @property
    def label(self) -> str:
        """As the ledger's rows name it (``AttemptRow.label``): a replica, even the only one."""
        return f"{self.service.name}[{self.index}]"


class ServiceReporter(Protocol):
    """What the services tell whoever watches the run (the run's reporter does all of it)."""

    def line(self, step: str, stream: str, text: str) -> None: ...
    def started(self, step: str, attempt: int, limit_bytes: int, limit_reason: str | None) -> None: ...
    def ended(self, step: str, attempt: int, decision: Decision, outcome: Outcome) -> None: ...
    def note(self, text: str) -> None: ...


class Services:
    """Every service of one run: started on demand, watched, recorded, stopped. ``changed`` is set
    whenever a service becomes ready or fails, for the scheduling loop to look again."""

    def __init__(
        self,
        services: list[ServiceSpec],
        *,
        pipeline_path: Path,
        run_dir: Path,
        run_id: str,
        executor: Executor,
        ledger: Ledger,
        options: Callable[[str], StepOptions | None],
        reporter: ServiceReporter,
        commit: str | None,
        adopted: list[AdoptedReplica] | None = None,
    ) -> None:
        self._specs = {s.name: s for s in services}
        self._pipeline_path, self._run_dir, self._run_id = pipeline_path, run_dir, run_id
        self._executor, self._ledger, self._options = executor, ledger, options
        self._reporter, self._commit = reporter, commit
        self._state = {name: ServiceState.IDLE for name in self._specs}
        self._failure: dict[str, str] = {}
        self._replicas: dict[str, list[Replica]] = {}
        self._retired: set[str] = set()
        self._served: set[str] = set()
        """The services that were ready once: stopped after, they succeeded."""
        self._cancelled = False
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.changed = threading.Event()
        self._adopted = {(a.service, a.index): a for a in adopted or []}

    # -- what the scheduling loop asks --------------------------------------------------
    def state(self, name: str) -> ServiceState:
        return self._state[name]

    def failure(self, name: str) -> str:
        return self._failure.get(name, "")

    def urls(self, name: str) -> list[str]:
        return [r.url for r in self._replicas.get(name, [])]

    def bytes_of(self, name: str) -> int:
        """What starting ``name`` adds to the memory in use: its replicas' limits (an external
        server's memory is not this host's)."""
        spec = self._specs[name]
        return 0 if spec.external else spec.memory * spec.replicas

    def held_bytes(self) -> int:
        """The limits of the replicas started and not stopped: they count against the budget."""
        return sum(
            self.bytes_of(name)
            for name, state in self._state.items()
            if state in (ServiceState.STARTING, ServiceState.READY)
        )

    def starting(self) -> bool:
        return any(state == ServiceState.STARTING for state in self._state.values())

    def running(self) -> list[str]:
        return [n for n, s in self._state.items() if s in (ServiceState.STARTING, ServiceState.READY)]

    def adopted(self) -> list[str]:
        """The services a dead runner left replicas of, which this run goes on with."""
        return sorted({name for name, _ in self._adopted})

    # -- life ---------------------------------------------------------------------------
    def start(self, name: str) -> None:
        """Start every replica of ``name`` (once): each on a free port, watched by a thread of its own."""
        if self._state[name] != ServiceState.IDLE:
            return
        spec = self._specs[name]
        if spec.external:
            self._replicas[name] = [Replica(spec, i + 1, 0, url) for i, url in enumerate(spec.external)]
            self._publish(name)  # over what an earlier run that started it left
            self._state[name] = ServiceState.READY
            self._reporter.note(f"{name}: the external server at {', '.join(spec.external)}; nothing started")
            self.changed.set()
            return
        self._state[name] = ServiceState.STARTING
        self._replicas[name] = []
        for index in range(1, spec.replicas + 1):
            if (found := self._adopted.pop((name, index), None)) is not None:
                self._replicas[name].append(Replica(spec, index, found.port, adopted=found))
            else:
                self._replicas[name].append(Replica(spec, index, free_port()))
        self._reporter.note(
            f"{name}: starting {spec.replicas} replica{'s' if spec.replicas > 1 else ''} (a service)"
        )
        for replica in self._replicas[name]:
            thread = threading.Thread(target=self._keep, args=(replica,), name=f"service-{replica.label}")
            thread.daemon = True
            self._threads.append(thread)
            thread.start()

    def retire(self, name: str, why: str) -> None:
        """Stop ``name``'s replicas: it served its last user (or the run ends)."""
        if self._state[name] not in (ServiceState.STARTING, ServiceState.READY):
            return
        self._retired.add(name)
        self._state[name] = ServiceState.STOPPED
        if self._specs[name].external:
            return  # not ours to stop
        self._reporter.note(f"{name}: stopping it ({why})")
        for replica in self._replicas[name]:
            if replica.handle is not None:
                threading.Thread(target=replica.handle.stop, args=("cancel",), daemon=True).start()

    def stop_all(self, why: str, *, cancelled: bool = False, wait_s: float = 30.0) -> None:
        """Stop every service and wait (up to ``wait_s``) for each replica's end to be recorded."""
        self._cancelled = self._cancelled or cancelled
        for name in list(self._state):
            self.retire(name, why)
        deadline = time.monotonic() + wait_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    # -- one replica ----------------------------------------------------------------------
    def _keep(self, replica: Replica) -> None:
        """Run the replica until its service is retired, starting it again within ``retries``."""
        spec, name = replica.service, replica.service.name
        while name not in self._retired:
            replica.starts += 1
            try:
                decision = self._run_once(replica)
            except Exception as exc:  # noqa: BLE001 - the loop must hear that the service cannot run
                self._fail(name, f"{replica.label} could not be started: {exc}")
                return
            if name in self._retired:
                return
            if replica.starts > spec.retries:
                self._fail(name, f"{replica.label} {decision.verdict}: {decision.reason}")
                return
            self._reporter.note(
                f"{replica.label}: {decision.verdict} ({decision.reason}); starting it again "
                f"({replica.starts} of {spec.retries} retries), at {replica.url or 'the same port'}"
            )

    def _run_once(self, replica: Replica) -> Decision:
        spec = replica.service
        # Started again: ready once it answers again, where it runs now (the same port; under Slurm
        # it may be another node).
        replica.ready, replica.url = False, ""
        if (found := replica.adopted) is not None:
            replica.adopted = None
            launch, attempt_id, handle = found.launch, found.attempt_id, found.handle
            self._reporter.note(f"{replica.label}: found again ({handle.where}), its command unchanged")
        else:
            launch, attempt_id = self._begin(replica)
            handle = self._executor.start(launch)
            self._ledger.attempt_started(attempt_id, handle.pid, handle.where)
        replica.handle = handle
        if spec.name in self._retired:  # retired while it started: the stop above missed it
            handle.stop("cancel")
        outcome, not_ready = self._await_ready(replica, handle)
        if outcome is None:
            outcome = handle.wait()
        # Stopped once no longer needed, by a service that served: a replica started again since may
        # not have been seen ready, yet it served as much as it was asked.
        served = spec.name in self._retired and spec.name in self._served and not self._cancelled
        decision = decide_service(outcome, served=served, not_ready=None if served else not_ready)
        self._ledger.end_attempt(
            attempt_id,
            verdict=decision.verdict.value,
            reason=decision.reason,
            fields=outcome.ledger_fields(),
            timeline=outcome.timeline,
        )
        self._reporter.ended(replica.label, launch.attempt, decision, outcome)
        return decision

    def _begin(self, replica: Replica) -> tuple[Launch, int]:
        """The replica's next attempt, begun in the ledger (one at a time: attempt numbers are per name)."""
        spec, name = replica.service, replica.service.name
        with self._lock:
            attempt = self._ledger.next_attempt_number(name)
            launch = replica_launch(
                self._pipeline_path,
                self._run_dir,
                self._run_id,
                spec,
                attempt=attempt,
                port=replica.port,
                options=self._options(name),
                on_line=lambda stream, text, label=replica.label: self._reporter.line(label, stream, text),
            )
            attempt_id = self._ledger.begin_attempt(
                run_id=self._run_id,
                step=name,
                attempt=attempt,
                executor=self._executor.name,
                limit_bytes=spec.memory,
                limit_reason=None,
                argv=launch.argv,
                host_mem_available=None,
                host_mem_total=None,
                image=None,
                commit_id=self._commit,
                outputs=[],
                replica=replica.index,
            )
        self._reporter.started(replica.label, attempt, spec.memory, None)
        return launch, attempt_id

    def _await_ready(self, replica: Replica, handle: RunningAttempt) -> tuple[Outcome | None, str | None]:
        """Poll the replica's health path until it answers 200, the replica ends, the service is
        retired or its startup timeout passes (then it is stopped). The outcome if it ended; and why
        it never got ready, if it did not. Its URL is known once the executor can say where it runs
        (a Slurm job: once it left the queue), so the timeout counts from its submission."""
        spec = replica.service
        began = time.monotonic()
        # What it waits for, said as it ended before it and as it did not come in time.
        awaited, missed = "its executor said where it runs", "its executor did not say where it runs"
        while spec.name not in self._retired:
            if not replica.url and (host := self._executor.service_host(handle)) is not None:
                replica.url = f"http://{host}:{replica.port}"
                awaited = f"{replica.url}{spec.health} answered 200"
                missed = f"{replica.url}{spec.health} did not answer 200"
            outcome = handle.wait(HEALTH_POLL_S)
            if outcome is not None:
                return outcome, None if replica.ready else f"it ended before {awaited}"
            if replica.ready:
                continue
            if replica.url and answers_health(replica.url + spec.health):
                replica.ready = True
                took = format_duration(time.monotonic() - began)
                self._reporter.note(f"{replica.label}: ready at {replica.url} ({spec.health} in {took})")
                self._publish(spec.name)
                self._became_ready(spec.name)
            elif time.monotonic() - began > spec.startup_timeout:
                handle.stop("timeout")
                limit = format_duration(spec.startup_timeout)
                return handle.wait(), f"not ready: {missed} within its startup_timeout ({limit})"
        return None, None if replica.ready else "it was stopped before it was ready"

    def _publish(self, name: str) -> None:
        """Write where ``name``'s replicas answer now, once each has a URL: a step that uses it reads
        this when a replica stops answering (``pipeline.contract.step.service_urls``)."""
        with self._lock:
            if all(urls := self.urls(name)):
                atomic_write_text(service_urls_path(self._run_dir, name), "\n".join(urls) + "\n")

    def _became_ready(self, name: str) -> None:
        with self._lock:
            if self._state[name] == ServiceState.STARTING and all(r.ready for r in self._replicas[name]):
                self._state[name] = ServiceState.READY
                self._served.add(name)
                self._reporter.note(f"{name}: ready ({', '.join(self.urls(name))})")
                self.changed.set()

    def _fail(self, name: str, why: str) -> None:
        with self._lock:
            if name in self._retired:
                return
            self._failure[name] = why
            self._state[name] = ServiceState.FAILED
            self._retired.add(name)
        self._reporter.note(f"{name}: the service failed: {why}")
        for replica in self._replicas.get(name, []):
            if replica.handle is not None:
                threading.Thread(target=replica.handle.stop, args=("cancel",), daemon=True).start()
        self.changed.set()
