"""A second batch engine is one thin class: ``FakeQueueEngine`` writes only ``submit``, ``queue`` and
``cancel`` (its jobs are their scripts, run as processes of this host), and the grid's executor and
attempt tell every outcome from the in-job report and the engine's answers, as they do for Slurm."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline.run import grid
from pipeline.run.executor import Launch, Outcome
from pipeline.run.verdict import Verdict, decide

FAKE_WRAPPER = Path(__file__).resolve().parents[2] / "fakes" / "fake_job_wrapper.py"


class FakeQueueEngine(grid.GridEngine):
    """A batch engine of the test's own: a job is its script, run as a process of this host, its
    logs opened before it starts (as Slurm opens them)."""

    name = "fake"
    title = "the fake queue"

    def __init__(self) -> None:
        self.jobs: dict[str, subprocess.Popen] = {}
        self.submitted: list[tuple[Path, list[str]]] = []

    def submit(self, launch: Launch, script: Path, directives: list[str]) -> str:
        job_id = str(len(self.jobs) + 1)
        self.submitted.append((script, directives))
        with open(launch.stdout_path, "ab") as out, open(launch.stderr_path, "ab") as err:
            self.jobs[job_id] = subprocess.Popen(
                ["/bin/sh", str(script)],
                cwd=launch.cwd,
                env=launch.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )
        return job_id

    def queue(self, job_ids: list[str]) -> dict[str, grid.JobState]:
        running, ended = grid.JobState(grid.Phase.RUNNING, "R"), grid.JobState(grid.Phase.ENDED, "E")
        return {
            job: running if self.jobs[job].poll() is None else ended for job in job_ids if job in self.jobs
        }

    def cancel(self, job_id: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.jobs[job_id].pid, signal.SIGTERM)


@pytest.fixture
def executor(monkeypatch) -> Iterator[grid.GridExecutor]:
    monkeypatch.setattr(grid, "WRAPPER", [sys.executable, str(FAKE_WRAPPER)])
    monkeypatch.setattr(grid, "POLL_S", 0.05)
    monkeypatch.setattr(grid, "REPORT_WAIT_S", 0.5)
    monkeypatch.setattr(grid, "REAP_WAIT_S", 5.0)
    engine = FakeQueueEngine()
    executor = grid.GridExecutor(engine)
    yield executor
    executor.watcher.close()
    for job in engine.jobs.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()


def launch(tmp_path: Path, *argv: str, lines: list[str] | None = None) -> Launch:
    logs = tmp_path / ".eyrie" / "logs" / "train"
    sink = None if lines is None else (lambda stream, line: lines.append(f"{stream}: {line}"))
    return Launch(
        run_id="r1",
        step="train",
        attempt=1,
        argv=list(argv),
        cwd=tmp_path / "train",
        env={**os.environ, "FAKE_OOM_KILLS": str(tmp_path / "oom_kill")},
        limit_bytes=2**30,
        stdout_path=logs / "attempt-1.stdout.log",
        stderr_path=logs / "attempt-1.stderr.log",
        on_line=sink,
    )


def run(executor: grid.GridExecutor, attempt_launch: Launch) -> Outcome:
    outcome = executor.start(attempt_launch).wait(timeout=30)
    assert outcome is not None, "the job did not end"
    return outcome


def test_a_job_that_succeeds_is_told_by_its_report_and_its_logs_are_followed(tmp_path, executor):
    lines: list[str] = []
    attempt_launch = launch(tmp_path, "sh", "-c", "echo made it; echo a warning >&2", lines=lines)
    outcome = run(executor, attempt_launch)
    assert (outcome.exit_code, outcome.signal, outcome.oom_kills, outcome.where) == (0, None, 0, "fake job 1")
    assert outcome.stopped_by is None and outcome.evidence is None and outcome.runner_error is None
    assert outcome.stderr_tail == ["a warning"]
    assert sorted(lines) == ["stderr: a warning", "stdout: made it"]
    assert decide(outcome, True, "1 output matches its manifest").verdict == Verdict.SUCCEEDED
    # The grid wrote the job's script (the step under the in-job wrapper) and asked for no directives.
    ((script, directives),) = executor.engine.submitted
    assert script == attempt_launch.stderr_path.with_name("attempt-1.fake.sh") and directives == []
    assert f"{FAKE_WRAPPER} {tmp_path}/.eyrie/logs/train/attempt-1.fake.json -- sh -c" in script.read_text()


def test_a_failing_exit_status_is_the_steps(tmp_path, executor):
    outcome = run(executor, launch(tmp_path, "sh", "-c", "echo 'no such file: data.jsonl' >&2; exit 3"))
    assert (outcome.exit_code, outcome.signal) == (3, None)
    decision = decide(outcome, False, "no manifest")
    assert decision.verdict == Verdict.FAILED
    assert decision.reason == "the main process exited with 3: no such file: data.jsonl"


def test_an_oom_kill_in_the_jobs_cgroup_is_told_from_the_report(tmp_path, executor):
    # the kernel's OOM killer: the cgroup's counter rises, and the main process dies of SIGKILL
    killed = run(executor, launch(tmp_path / "a", "sh", "-c", 'echo 1 > "$FAKE_OOM_KILLS"; kill -KILL $$'))
    assert (killed.signal, killed.oom_kills) == (signal.SIGKILL, 1)
    assert decide(killed, False, "no manifest").verdict == Verdict.OOM_KILLED
    # a child was killed, and the main process exited 0
    child = run(executor, launch(tmp_path / "b", "sh", "-c", 'echo 1 > "$FAKE_OOM_KILLS"; exit 0'))
    assert (child.exit_code, child.oom_kills) == (0, 1)
    assert decide(child, True, "1 output matches its manifest").verdict == Verdict.CHILD_OOM_KILLED


def until_started(lines: list[str]) -> None:
    """Until the step said it started (then the wrapper passes a SIGTERM on to it)."""
    deadline = time.monotonic() + 20
    while "stdout: started" not in lines:
        assert time.monotonic() < deadline, "the step did not start"
        time.sleep(0.02)


@pytest.mark.parametrize(
    ("reason", "verdict"), [("timeout", Verdict.TIMED_OUT), ("cancel", Verdict.CANCELLED)]
)
def test_a_job_the_runner_stops_is_cancelled_through_the_engine(tmp_path, executor, reason, verdict):
    lines: list[str] = []
    attempt = executor.start(launch(tmp_path, "sh", "-c", "echo started; exec sleep 30", lines=lines))
    began = time.monotonic()
    assert attempt.wait(timeout=0.3) is None  # its script has run 0.3 s
    until_started(lines)
    attempt.stop(reason)
    outcome = attempt.wait(timeout=30)
    assert time.monotonic() - began < 20
    assert (outcome.stopped_by, outcome.signal) == (reason, signal.SIGTERM)
    assert decide(outcome, False, "no manifest").verdict == verdict


def test_a_job_that_ended_without_its_report_is_not_guessed_at(tmp_path, executor):
    # the wrapper itself dies (a node lost, say): no report, and this engine keeps no accounting
    outcome = run(executor, launch(tmp_path, "sh", "-c", "kill -KILL $PPID"))
    decision = decide(outcome, False, "no manifest")
    assert decision.verdict == Verdict.FAILED
    assert decision.reason == (
        "the runner lost track of it: job 1 ended with its in-job report missing, and the fake queue no "
        "longer knows it (it no longer lists the job, and keeps no accounting)"
    )


def test_the_job_of_a_runner_that_died_is_taken_up_or_cancelled_and_waited_for(tmp_path, executor):
    lines: list[str] = []
    attempt_launch = launch(tmp_path, "sh", "-c", "echo started; exec sleep 30", lines=lines)
    started = executor.start(attempt_launch)
    until_started(lines)
    resumed = executor.resume(started.where, attempt_launch)
    assert resumed is not None and resumed.job_id == started.job_id
    assert executor.reap(started.where, None, time.time()) == 1
    assert executor.engine.jobs["1"].poll() is not None
    assert executor.reap(started.where, None, time.time()) == 0  # ended: nothing to do
    assert resumed.wait(timeout=30).signal == signal.SIGTERM
    started.finish()
    again = executor.resume(started.where, attempt_launch)  # ended: taken up, to be told from its report
    assert again is not None
    again.finish()
