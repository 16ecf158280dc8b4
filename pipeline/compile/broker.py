"""The build broker: admits compile jobs by memory and runs each in a cgroup of its own.

Mechanism, and why: an nvcc stand-in set as ``PYTORCH_NVCC`` (see
``nvcc_wrapper``) forwards every compile job of an unmodified setup.py here.
The alternative, a GNU make 4.4 fifo jobserver that ninja ≥ 1.13 joins, hands
out anonymous tokens: it cannot tell a 4 GiB forward kernel from a 7 GiB
backward one, so it could only admit by the worst case; it cannot put a job in
a cgroup of its own or record its peak; an OOM-killed job fails ninja's whole
build; and it needs MAX_JOBS non-numeric (else torch passes ``-j`` and ninja
ignores the jobserver). The wrapper sees the job's command line (source file,
archs, ``--threads``), so it admits by that job's measured peak, runs it under
an executor taken by name from ``pipeline.run.EXECUTORS``, as the runner takes its
own (by default the local one: own cgroup, limit = its reservation, peak and wall
time into the ledger) and re-runs it after an OOM kill before ninja sees any
failure. flash-attn's own limiter is skipped because MAX_JOBS is set; MAX_JOBS
only says how many stand-ins wait at once — the scheduler's look-ahead.

Every job's cgroup is a child of one build cgroup whose limit is the budget,
so even a wrong prediction cannot take more than the budget from the host.
Once a job's measured peak is behind it (``ShapeWatch``, checked every second),
its cgroup limit is lowered to what its shape still needs and the scheduler
admits waiting jobs into the difference; each job's reservation over time is
in the ledger's ``reservations`` table.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socketserver
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.compile.profile import JobKey, Profile, parse_nvcc_argv
from pipeline.compile.scheduler import AdmissionScheduler, BudgetTooSmall, Job, ShapeWatch
from pipeline.compile.unconfined import UnconfinedExecutor, tree_anon_bytes
from pipeline.memory import (
    Cgroup,
    CgroupError,
    CgroupV2,
    format_size,
    memory_budget,
    read_meminfo,
    step_parent,
)
from pipeline.run.executor import Launch, Outcome, executor_class
from pipeline.run.host_sampler import HostSampler
from pipeline.run.ledger import Ledger, RunState
from pipeline.run.verdict import MEMORY_VERDICTS, Verdict, decide

WRAPPER = Path(__file__).with_name("nvcc_wrapper.py")
SOCKET_ENV = "EYRIE_BUILD_SOCKET"
WATCH_S = 1.0
"""How often running jobs' memory is read against their shapes (the ledger's timeline step)."""


@dataclass
class JobRecord:
    name: str
    key: JobKey
    verdicts: list[str] = field(default_factory=list)
    reservations: list[int] = field(default_factory=list)
    anon_peak: int | None = None
    wall_s: float | None = None
    exit_code: int | None = None


@dataclass
class BuildReport:
    jobs: list[JobRecord]
    peak_reserved: int
    budget: int

    @property
    def oom_kills(self) -> int:
        return sum(v in {m.value for m in MEMORY_VERDICTS} for j in self.jobs for v in j.verdicts)

    @property
    def failed(self) -> list[JobRecord]:
        return [j for j in self.jobs if j.exit_code not in (0, None) or not j.verdicts]


class BuildBroker:
    """Serves the nvcc stand-ins of one build on a Unix socket."""

    def __init__(
        self,
        *,
        nvcc: str,
        nvcc_version: str,
        package: str,
        profile: Profile,
        budget: int,
        cpu_slots: int,
        run_dir: Path,
        run_id: str | None = None,
        cxx_standard: str | None = None,
        executor: str = "local",
    ) -> None:
        """``executor``: the name of the executor that runs each job, given the build's cgroup as the
        parent of the jobs' own; where no cgroup can be created (inside ``docker build``) jobs run as
        plain process trees instead (``unconfined.py``)."""
        self.executor_class = executor_class(executor)  # an unknown name is said before anything starts
        self.nvcc = nvcc
        self.package = package
        self.cxx_standard = cxx_standard  # replaces a -std=c++17 the build asks for
        self.nvcc_version = nvcc_version
        self.profile = profile
        self.budget = budget
        self.scheduler = AdmissionScheduler(budget, cpu_slots)
        self.run_dir = Path(run_dir)
        self.run_id = run_id or time.strftime("build-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4]
        self.ledger = Ledger(self.run_dir)
        self.records: dict[str, JobRecord] = {}
        self.fatal: str | None = None
        self._lock = threading.Lock()
        self._socket_dir = tempfile.mkdtemp(prefix="eyrie-build-")
        self.socket_path = os.path.join(self._socket_dir, "broker.sock")
        self.cgroup: Cgroup | None = None
        self.confinement = ""
        self._running: set = set()
        self._live: dict[Job, tuple[object, int]] = {}  # running job -> (its attempt, its ledger id)
        self._stop_watch = threading.Event()
        self._server: socketserver.ThreadingUnixStreamServer | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> BuildBroker:
        try:
            self.cgroup = step_parent().child(self.run_id)
            self.cgroup.create()
            self.cgroup.set_limit(self.budget)
            if isinstance(self.cgroup, CgroupV2):
                self.cgroup.enable_memory_for_children()
            self.executor = self.executor_class(parent=self.cgroup)
            self.confinement = f"each job in its own cgroup under {self.cgroup.path}"
        except CgroupError as exc:
            if self.cgroup is not None:
                self.cgroup.remove()
            self.cgroup = None
            self.executor = UnconfinedExecutor()
            self.confinement = (
                f"no cgroup can be created here ({exc}); jobs are admitted by prediction and "
                "run as plain processes, peaks read from /proc"
            )
        self.ledger.start_run(self.run_id, "eyrie build", self.executor.name, [], self.budget, "build budget")
        self.host = HostSampler(self.ledger, self.run_id, memory_budget).start()  # jobs share this budget
        broker = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                request = json.loads(self.rfile.readline())
                reply = broker.handle(request)
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        self._server = socketserver.ThreadingUnixStreamServer(self.socket_path, Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="build-broker", daemon=True).start()
        threading.Thread(target=self._watch, name="build-shapes", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop_watch.set()
        for attempt in list(self._running):  # the build command ended (or was interrupted) first
            attempt.stop("cancel")
        deadline = time.monotonic() + 10
        while self._running and time.monotonic() < deadline:  # let their handlers record them
            time.sleep(0.1)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        failed = exc[0] is not None or self.fatal is not None or bool(self.report().failed)
        self.host.stop()
        self.ledger.end_run(self.run_id, RunState.FAILED if failed else RunState.SUCCEEDED)
        self.ledger.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        Path(self.socket_path).unlink(missing_ok=True)
        os.rmdir(self._socket_dir)

    def env(self) -> dict[str, str]:
        """What a build command needs in its environment to send its nvcc jobs here."""
        return {
            "PYTORCH_NVCC": f"{sys.executable} -S -I {WRAPPER}",
            SOCKET_ENV: self.socket_path,
        }

    def report(self) -> BuildReport:
        return BuildReport(list(self.records.values()), self.scheduler.peak_reserved, self.budget)

    # -- one job ------------------------------------------------------------------------
    def handle(self, request: dict) -> dict:
        argv: list[str] = request["argv"]
        source, archs, threads = parse_nvcc_argv(argv)
        if source is None:  # not a compile (e.g. a device link): run it, admitted as a default job
            source = "nvcc-" + "-".join(Path(a).name for a in argv[:2])
        # The job's name in the ledger (and in its cgroup's name): the file it compiles.
        name = Path(source).name
        key = JobKey(name, archs, threads, self.nvcc_version, self.package)
        with self._lock:
            record = self.records.setdefault(name, JobRecord(name, key))
        if self.fatal:
            return {"exit": 1, "stdout": "", "stderr": f"eyrie build: not compiled: {self.fatal}\n"}
        job = Job(name, 0, slots=key.archs_in_flight, key=key)
        self._predict(job)
        self.scheduler.submit(job)
        while True:
            job.admitted.wait()
            if self.fatal:
                # ninja starts nothing after a failure but waits for what it started: the
                # stand-ins still waiting here end at once instead of compiling for nothing.
                self.scheduler.release(job)
                return {"exit": 1, "stdout": "", "stderr": f"eyrie build: not compiled: {self.fatal}\n"}
            try:
                outcome, decision, output = self._run(job, argv, request, record)
            except Exception as exc:  # a cgroup or ledger failure: the build cannot go on honestly
                self.fatal = f"{name} could not be run: {exc}"
                self.scheduler.release(job)
                self.scheduler.abort()
                return {"exit": 1, "stdout": "", "stderr": f"eyrie build: {self.fatal}\n"}
            if decision.verdict in MEMORY_VERDICTS:
                observed = max(outcome.peak_bytes or 0, outcome.anon_peak_bytes or 0)
                try:
                    self.scheduler.requeue_after_oom(job, observed)
                except BudgetTooSmall as exc:
                    self.fatal = str(exc)
                    self.scheduler.abort()
                    return {"exit": 1, "stdout": "", "stderr": f"eyrie build: {exc}\n"}
                continue
            if outcome.exit_code == 0 and outcome.anon_peak_bytes:
                self.profile.observe(key, outcome.anon_peak_bytes, record.wall_s or 0.0, outcome.timeline)
            if outcome.exit_code != 0 and self.fatal is None:
                self.fatal = f"{name} failed first: {_first_error(output[1]) or decision.reason}"
                self.scheduler.abort()
            self.scheduler.release(job, self._predict)
            exit_code = outcome.exit_code if outcome.exit_code is not None else 128 + (outcome.signal or 0)
            return {"exit": exit_code, "stdout": output[0], "stderr": output[1]}

    def _predict(self, job: Job) -> int:
        """Set a first attempt's reservation, basis, wall time and shape from the profile's prediction."""
        prediction = self.profile.predict(job.key)
        job.reservation, job.wall_s = prediction.peak_bytes, prediction.wall_s
        job.expected = prediction.expected_bytes
        job.basis = prediction.basis
        if prediction.peak_bytes > self.budget:
            left = self.budget / prediction.expected_bytes if prediction.expected_bytes else None
            job.basis += f"; cut to the budget {format_size(self.budget, 'GiB')}" + (
                f", {left:.2f}× the expected peak" if left else ""
            )
        job.watch = (
            ShapeWatch(prediction.expected_bytes, prediction.shape, self.profile.margin)
            if prediction.expected_bytes and prediction.shape
            else None
        )
        return prediction.peak_bytes

    def _watch(self) -> None:
        """Every second: shrink the reservation of each running job whose peak is behind it."""
        while not self._stop_watch.wait(WATCH_S):
            for job, (running, attempt_id) in list(self._live.items()):
                if job.watch is None:
                    continue
                try:
                    confined = self.cgroup is not None
                    anon = running.cgroup.sample().anon if confined else tree_anon_bytes(running.pid)
                    shape_rest = job.watch.rest(anon)
                    if shape_rest is None:
                        continue
                    # The limit counts page cache too, which the shape does not: never below usage.
                    rest = max(shape_rest, running.cgroup.usage()) if confined else shape_rest
                    if rest >= job.reservation:
                        continue
                    if confined:
                        running.cgroup.set_limit(rest)  # a job that outgrows its shape now is the one killed
                except (OSError, CgroupError):  # it ended meanwhile, or the kernel kept its limit: next time
                    continue
                if job not in self._live:  # it ended while its memory was read
                    continue
                job.watch = None  # one shrink: from its peak down to its tail
                tail = math.ceil(shape_rest / self.profile.margin)
                reason = (
                    f"peak passed ({format_size(anon, 'GiB')} in use): the rest of its shape needs "
                    f"{format_size(tail, 'GiB')} × {self.profile.margin} margin"
                )
                if rest > shape_rest:
                    reason += f", held at its cgroup's usage {format_size(rest, 'GiB')} (page cache included)"
                self.ledger.reserve(attempt_id, rest, tail, reason)
                self.scheduler.shrink(job, rest)

    def _run(self, job: Job, argv: list[str], request: dict, record: JobRecord):
        attempt = self.ledger.next_attempt_number(job.name)
        logs = self.run_dir / "logs"
        stem = f"{Path(record.key.source).stem}.{attempt}"
        # nvcc leaves its intermediates in TMPDIR when it is killed: one folder per attempt, removed after.
        scratch = tempfile.mkdtemp(prefix=f"eyrie-nvcc-{stem}-")
        command = [self.nvcc, *with_standard(argv, self.cxx_standard)]
        launch = Launch(
            run_id=self.run_id,
            step=job.name,
            attempt=attempt,
            argv=command,
            cwd=Path(request["cwd"]),
            env={**request["env"], "TMPDIR": scratch},
            limit_bytes=job.reservation,
            stdout_path=logs / f"{stem}.out",
            stderr_path=logs / f"{stem}.err",
        )
        attempt_id = self._begin_attempt(launch, job.basis)
        try:
            running = self.executor.start(launch)
        except Exception as exc:
            reason = f"could not start: {exc}"
            self.ledger.end_attempt(
                attempt_id,
                verdict=Verdict.FAILED.value,
                reason=reason,
                fields={"ended_at": time.time()},
                timeline=[],
            )
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        self._running.add(running)
        self.ledger.attempt_started(attempt_id, running.pid, running.where)
        self.ledger.reserve(attempt_id, job.reservation, job.expected, job.basis)
        self._live[job] = (running, attempt_id)
        try:
            outcome: Outcome = running.wait()
        finally:
            self._live.pop(job, None)
            self._running.discard(running)
            shutil.rmtree(scratch, ignore_errors=True)
        output_file = _output_of(argv, Path(request["cwd"]))
        complete = outcome.exit_code == 0 and output_file is not None and output_file.is_file()
        decision = decide(outcome, complete, f"{output_file} written" if complete else "no object file")
        self.ledger.end_attempt(
            attempt_id,
            verdict=decision.verdict.value,
            reason=decision.reason,
            fields=_ledger_fields(outcome),
            timeline=outcome.timeline,
        )
        with self._lock:
            record.verdicts.append(decision.verdict.value)
            record.reservations.append(launch.limit_bytes)  # what it was admitted with, before any shrink
            record.anon_peak = outcome.anon_peak_bytes
            record.wall_s = outcome.ended_at - outcome.started_at
            record.exit_code = outcome.exit_code
        output = (_read(launch.stdout_path), _read(launch.stderr_path))
        return outcome, decision, output

    def _begin_attempt(self, launch: Launch, limit_reason: str) -> int:
        """The ledger's record of an attempt about to start, with the host's memory now; its id."""
        meminfo = read_meminfo()
        return self.ledger.begin_attempt(
            run_id=launch.run_id,
            step=launch.step,
            attempt=launch.attempt,
            executor=self.executor.name,
            limit_bytes=launch.limit_bytes,
            limit_reason=limit_reason,
            argv=launch.argv,
            host_mem_available=meminfo.get("MemAvailable", 0),
            host_mem_total=meminfo.get("MemTotal", 0),
            image=None,
            commit_id=None,
        )


def _ledger_fields(outcome: Outcome) -> dict[str, object]:
    """What the ledger keeps of a finished attempt's outcome."""
    return {
        "peak_bytes": outcome.peak_bytes,
        "anon_peak_bytes": outcome.anon_peak_bytes,
        "oom_kills": outcome.oom_kills,
        "oom_kills_before": outcome.oom_kills_before,
        "oom_kills_after": outcome.oom_kills_after,
        "oom_at": outcome.oom_at,
        "exit_code": outcome.exit_code,
        "signal": outcome.signal,
        "ended_at": outcome.ended_at,
        "stderr_tail": json.dumps(outcome.stderr_tail),
    }


def _output_of(argv: list[str], cwd: Path) -> Path | None:
    for i, arg in enumerate(argv[:-1]):
        if arg == "-o":
            return cwd / argv[i + 1]
    return None


def with_standard(argv: list[str], standard: str | None) -> list[str]:
    """The nvcc command with ``-std=c++17`` raised to ``standard`` (see flash_attn.cxx_standard)."""
    if standard is None:
        return argv
    return [f"-std={standard}" if arg == "-std=c++17" else arg for arg in argv]


def _first_error(stderr: str) -> str | None:
    for line in stderr.splitlines():
        if "error" in line.lower():
            return line.strip()[:300]
    return None


def _read(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return text
