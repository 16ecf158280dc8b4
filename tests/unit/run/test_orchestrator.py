"""The orchestrator's bookkeeping, with an executor that only pretends: resume, start-up checks, errors."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import pytest
import yaml

from pipeline.contract.step import MANIFEST_NAME
from pipeline.memory import Budget
from pipeline.run import grid, orchestrator, slurm
from pipeline.run.executor import ExecutorError, ExecutorUnavailable, Launch, Outcome, StepOptions
from pipeline.run.ledger import Ledger
from pipeline.run.orchestrator import Orchestrator, RunResult
from pipeline.run.recovery import RunDirBusy
from pipeline.run.services import check_placement
from pipeline.run.spec import PipelineError, PipelineSpec, load_pipeline
from tests.fakes.fake_slurm import FakeSlurm

pytestmark = pytest.mark.timeout(60)  # a run that never ends fails here instead of hanging


def outcome(
    exit_code: int | None = 0, *, sig: int | None = None, oom_kills: int = 0, stopped_by: str | None = None
) -> Outcome:
    now = time.time()
    return Outcome(
        exit_code=exit_code,
        signal=sig,
        oom_kills_before=0,
        oom_kills_after=oom_kills,
        oom_at=None,
        peak_bytes=2**20,
        anon_peak_bytes=2**20,
        started_at=now,
        ended_at=now,
        stopped_by=stopped_by,
    )


class FakeAttempt:
    """Ends with ``result`` at once, or (``result`` None) runs until it is stopped."""

    def __init__(self, launch: Launch, result: Outcome | None) -> None:
        self.launch, self.result = launch, result
        self.pid, self.where = 4242, f"fake:{launch.step}-{launch.attempt}"
        self.stopped = threading.Event()
        self.stop_reason: str | None = None

    def wait(self, timeout: float | None = None) -> Outcome | None:
        if self.result is not None:
            return self.result
        if not self.stopped.wait(timeout):
            return None
        return outcome(None, sig=signal.SIGTERM, stopped_by=self.stop_reason)

    def stop(self, reason: str) -> None:
        self.stop_reason = reason
        self.stopped.set()


Behaviour = Callable[[Launch], FakeAttempt]


def ends(result: Outcome) -> Behaviour:
    return lambda launch: FakeAttempt(launch, result)


def runs_until_stopped(launch: Launch) -> FakeAttempt:
    return FakeAttempt(launch, None)


class FakeExecutor:
    name = "fake"
    Options = StepOptions
    runs_here = False
    admits_by_memory = False
    detached = False
    host_memory = None  # its steps run nowhere: the runner writes heartbeats only

    def __init__(
        self,
        behaviours: dict[str, Behaviour],
        resumable: dict[str, Outcome] | None = None,
        detached: bool = False,
    ) -> None:
        self.detached = detached
        self.behaviours = behaviours
        self.attempts: list[FakeAttempt] = []
        self.resumable = resumable or {}  # where -> how the attempt a dead runner left ends
        self.reaped: list[str] = []

    def memory_budget(self) -> Budget:
        return Budget(available=2**34, mem_total=2**35, mem_available=2**34, cgroup_version=None)

    def preflight(self, run_dir: Path, options: dict) -> None:
        return None

    def resume(self, where: str, launch: Launch) -> FakeAttempt | None:
        if where not in self.resumable:
            return None
        attempt = FakeAttempt(launch, self.resumable[where])
        attempt.where = where
        return attempt

    def start(self, launch: Launch) -> FakeAttempt:
        attempt = self.behaviours[launch.step](launch)
        self.attempts.append(attempt)
        return attempt

    def reap(self, where: str, pid: int | None, started_at: float) -> int:
        self.reaped.append(where)
        return 0

    def started(self, step: str) -> list[FakeAttempt]:
        return [a for a in self.attempts if a.launch.step == step]


class QuietReporter:
    def __init__(self) -> None:
        self.skipped_steps: list[str] = []

    def line(self, step, stream, text): ...
    def started(self, step, attempt, limit_bytes, limit_reason): ...
    def ended(self, step, attempt, decision, outcome): ...
    def skipped(self, step, reason):
        self.skipped_steps.append(step)

    def blocked(self, step, reason): ...
    def note(self, text): ...


def write_pipeline(tmp_path: Path, steps: list[dict]) -> tuple[PipelineSpec, Path]:
    for step in steps:
        step.setdefault("command", ["true"])
        step.setdefault("memory", "64MiB")
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"steps": steps}))
    return PipelineSpec.model_validate({"steps": steps}), path


def run(
    tmp_path: Path, steps: list[dict], executor: FakeExecutor, reporter: QuietReporter | None = None
) -> RunResult:
    spec, path = write_pipeline(tmp_path, steps)
    return Orchestrator(spec, path, tmp_path / "run", executor, reporter or QuietReporter()).run()


def ledger_of(tmp_path: Path) -> Ledger:
    return Ledger(tmp_path / "run", create=False)


def test_a_step_that_exits_0_after_a_child_was_oom_killed_runs_again_on_a_rerun(tmp_path):
    steps = [{"name": "prep"}]
    executor = FakeExecutor({"prep": ends(outcome(0, oom_kills=1))})
    assert run(tmp_path, steps, executor).state == "failed"
    assert [a.verdict for a in ledger_of(tmp_path).attempts()] == ["child_oom_killed"]
    assert not (tmp_path / "run" / "prep" / MANIFEST_NAME).exists()

    reporter = QuietReporter()
    run(tmp_path, steps, executor, reporter)
    assert reporter.skipped_steps == []
    assert len(executor.started("prep")) == 2


def test_a_step_that_succeeded_is_skipped_on_a_rerun(tmp_path):
    steps = [{"name": "prep"}]
    executor = FakeExecutor({"prep": ends(outcome(0))})
    assert run(tmp_path, steps, executor).state == "succeeded"
    reporter = QuietReporter()
    assert run(tmp_path, steps, executor, reporter).state == "succeeded"
    assert reporter.skipped_steps == ["prep"] and len(executor.started("prep")) == 1


def test_a_step_runs_again_when_a_setting_it_expands_changes(tmp_path):
    _, path = write_pipeline(tmp_path, [{"name": "train", "command": ["train", "--steps", "${STEPS:-10}"]}])
    executor = FakeExecutor({"train": ends(outcome(0))})

    def run_with(environ: dict[str, str]) -> QuietReporter:
        reporter = QuietReporter()
        spec = load_pipeline(path, environ=environ)
        assert Orchestrator(spec, path, tmp_path / "run", executor, reporter).run().state == "succeeded"
        return reporter

    run_with({})
    assert run_with({"STEPS": "10"}).skipped_steps == ["train"]  # the default, written out: same argv
    assert run_with({"STEPS": "20"}).skipped_steps == []
    assert [a.launch.argv for a in executor.started("train")] == [
        ["train", "--steps", "10"],
        ["train", "--steps", "20"],
    ]


def test_a_missing_input_stops_the_run_before_any_step_starts(tmp_path):
    steps = [
        {"name": "serve"},
        {"name": "prep"},
        {"name": "train", "needs": ["prep"], "inputs": ["train.yaml"]},
    ]
    executor = FakeExecutor({"serve": runs_until_stopped, "prep": ends(outcome(0))})
    with pytest.raises(PipelineError, match=r"steps \(train\)\.inputs: .*train\.yaml does not exist"):
        run(tmp_path, steps, executor)
    assert executor.attempts == []
    assert not (tmp_path / "run").exists()  # a refused run leaves no run folder, no ledger


def write_output(name: str) -> Behaviour:
    def start(launch: Launch) -> FakeAttempt:
        (launch.cwd / name).write_text("made by the step\n")
        return FakeAttempt(launch, outcome(0))

    return start


def test_an_input_written_by_a_step_it_needs_may_not_exist_yet(tmp_path):
    steps = [
        {"name": "prep", "outputs": ["prompts.jsonl"]},
        {"name": "train", "needs": ["prep"], "inputs": ["run/prep/prompts.jsonl"]},
    ]
    executor = FakeExecutor({"prep": write_output("prompts.jsonl"), "train": ends(outcome(0))})
    assert run(tmp_path, steps, executor).state == "succeeded"


def test_an_error_in_the_run_stops_its_steps_and_ends_the_run(tmp_path):
    # prep needs to write what train reads, and does not: the run stops while serve runs.
    steps = [
        {"name": "serve"},
        {"name": "prep"},
        {"name": "train", "needs": ["prep"], "inputs": ["run/prep/prompts.jsonl"]},
    ]
    executor = FakeExecutor({"serve": runs_until_stopped, "prep": ends(outcome(0))})
    with pytest.raises(PipelineError, match="prompts.jsonl does not exist"):
        run(tmp_path, steps, executor)
    (serve,) = executor.started("serve")
    assert serve.stop_reason == "cancel"
    ledger = ledger_of(tmp_path)
    assert ledger.running_attempts() == []
    assert {a.step: a.verdict for a in ledger.attempts()} == {"serve": "cancelled", "prep": "succeeded"}
    run_row = ledger.latest_run()
    assert run_row["state"] == "failed"
    states = ledger.step_states(run_row["run_id"])
    assert {name: state["state"] for name, state in states.items()} == {
        "serve": "cancelled",
        "prep": "done",
        "train": "cancelled",
    }
    assert "the run stopped on an error" in states["train"]["detail"]


def refuses_to_start(launch: Launch) -> FakeAttempt:
    raise ExecutorError(f"step {launch.step}: Docker could not start its container: no such network")


def test_an_attempt_that_could_not_start_is_ended_and_the_run_stops(tmp_path):
    steps = [{"name": "serve"}, {"name": "prep"}]
    executor = FakeExecutor({"serve": runs_until_stopped, "prep": refuses_to_start})
    with pytest.raises(ExecutorError, match="no such network"):
        run(tmp_path, steps, executor)
    ledger = ledger_of(tmp_path)
    assert ledger.running_attempts() == []
    prep = ledger.attempts("prep")[-1]
    assert (
        prep.verdict == "failed" and "could not start it" in prep.reason and "no such network" in prep.reason
    )
    assert ledger.attempts("serve")[-1].verdict == "cancelled"
    assert ledger.latest_run()["state"] == "failed"


class BrokenAttempt(FakeAttempt):
    """Waiting for it (or stopping it) raises, as a lost connection to the engine would."""

    def __init__(self, launch: Launch, *, wait_raises: bool) -> None:
        super().__init__(launch, None)
        self.wait_raises = wait_raises

    def wait(self, timeout: float | None = None) -> Outcome | None:
        if self.wait_raises:
            raise ConnectionResetError("the engine closed the connection")
        return super().wait(timeout)

    def stop(self, reason: str) -> None:
        super().stop(reason)
        if not self.wait_raises:
            raise ConnectionResetError("the engine closed the connection")


@pytest.mark.parametrize("wait_raises", [True, False], ids=["wait raises", "stop raises"])
def test_an_attempt_the_runner_lost_track_of_ends_failed(tmp_path, wait_raises):
    steps = [{"name": "train", "timeout": 0.2}, {"name": "after", "needs": ["train"]}]
    executor = FakeExecutor({"train": lambda launch: BrokenAttempt(launch, wait_raises=wait_raises)})
    assert run(tmp_path, steps, executor).state == "failed"
    (attempt,) = ledger_of(tmp_path).attempts()
    assert attempt.verdict == "failed" and "the engine closed the connection" in attempt.reason
    assert "ConnectionResetError: the engine closed the connection" in attempt.as_json()["stderr_tail"][-1]


def in_turn(*behaviours: Behaviour) -> Behaviour:
    pending = list(behaviours)
    return lambda launch: pending.pop(0)(launch)


def test_a_preempted_attempt_runs_again_without_using_up_the_retries(tmp_path):
    preempted = ends(outcome(None, sig=signal.SIGTERM, stopped_by="preempted"))
    lost_node = ends(outcome(None, stopped_by="node_failed"))
    executor = FakeExecutor({"train": in_turn(preempted, lost_node, ends(outcome(0, sig=None)))})
    assert run(tmp_path, [{"name": "train", "memory": "1GiB"}], executor).state == "succeeded"
    attempts = ledger_of(tmp_path).attempts()
    assert [a.verdict for a in attempts] == ["preempted", "node_failed", "succeeded"]
    assert {a.limit_bytes for a in attempts} == {2**30}  # nothing was learned about its memory


def test_a_step_preempted_again_and_again_ends_failed(tmp_path):
    executor = FakeExecutor({"train": ends(outcome(None, sig=signal.SIGTERM, stopped_by="preempted"))})
    assert run(tmp_path, [{"name": "train"}], executor).state == "failed"
    assert [a.verdict for a in ledger_of(tmp_path).attempts()] == ["preempted"] * 4  # 1 + TRANSIENT_RETRIES


def leave_running(
    tmp_path: Path,
    steps: list[dict],
    where: str,
    argv: list[str],
    executor: str = "fake",
    host: str | None = None,
) -> None:
    """What a runner killed with SIGKILL leaves: its run (on ``host``) and one attempt marked running."""
    spec, path = write_pipeline(tmp_path, steps)
    ledger = Ledger(tmp_path / "run")
    with mock.patch("socket.gethostname", return_value=host or socket.gethostname()):
        ledger.start_run("dead-run", str(path), executor, [s["name"] for s in steps], 2**34, "test")
    attempt = ledger.begin_attempt(
        run_id="dead-run",
        step="train",
        attempt=1,
        executor=executor,
        limit_bytes=2**26,
        limit_reason=None,
        argv=argv,
        host_mem_available=0,
        host_mem_total=0,
        image=None,
        commit_id=None,
    )
    ledger.attempt_started(attempt, None, where)
    ledger.close()


def test_an_attempt_a_killed_runner_left_is_waited_for_not_started_again(tmp_path):
    steps = [{"name": "train", "command": ["train", "--fast"]}, {"name": "after", "needs": ["train"]}]
    leave_running(tmp_path, steps, "job 41", ["train", "--fast"])
    executor = FakeExecutor({"after": ends(outcome(0))}, resumable={"job 41": outcome(0)})
    assert run(tmp_path, steps, executor).state == "succeeded"
    attempts = ledger_of(tmp_path).attempts()
    assert sorted((a.step, a.attempt, a.verdict, a.location) for a in attempts) == [
        ("after", 1, "succeeded", "fake:after-1"),
        ("train", 1, "succeeded", "job 41"),
    ]
    assert executor.started("train") == [] and executor.reaped == []


def test_an_attempt_left_by_a_killed_runner_whose_step_changed_is_cancelled_and_run_again(tmp_path):
    steps = [{"name": "train", "command": ["train", "--slow"]}]
    leave_running(tmp_path, steps, "job 41", ["train", "--fast"])
    executor = FakeExecutor({"train": ends(outcome(0))}, resumable={"job 41": outcome(0)})
    assert run(tmp_path, steps, executor).state == "succeeded"
    first, second = ledger_of(tmp_path).attempts()
    assert first.verdict == "cancelled" and "its step's command changed" in first.reason
    assert second.verdict == "succeeded" and executor.reaped == ["job 41"]


def test_an_attempt_left_by_a_runner_on_another_host_is_refused_not_taken_for_gone(tmp_path):
    steps = [{"name": "train", "command": ["train"]}]
    leave_running(tmp_path, steps, "/sys/fs/cgroup/memory/eyrie/dead-run-train-1", ["train"], host="gpu07")
    executor = FakeExecutor({"train": ends(outcome(0))})
    with pytest.raises(RunDirBusy) as info:
        run(tmp_path, steps, executor)
    message = str(info.value)
    assert "train attempt 1 of an earlier run ran on gpu07" in message and "run again on gpu07" in message
    assert "\n" not in message and executor.reaped == [] and executor.attempts == []
    assert len(ledger_of(tmp_path).running_attempts()) == 1


# -- a detached executor's attempts (Slurm jobs) outlive the runner's troubles --------------------


def unanswered_once(then: Behaviour) -> Behaviour:
    calls = []

    def start(launch: Launch) -> FakeAttempt:
        calls.append(launch)
        if len(calls) == 1:
            raise ExecutorUnavailable("step train: the Slurm controller did not answer sbatch for 60 s")
        assert launch == calls[0], "the same attempt, under the same name, is submitted again"
        return then(launch)

    return start


def test_a_submission_without_answer_waits_and_is_tried_again_while_the_rest_runs_on(tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator, "SUBMIT_RETRY_S", 0.3)
    steps = [{"name": "serve"}, {"name": "train"}]
    serving = []
    executor = FakeExecutor(
        {
            "serve": lambda launch: serving.append(FakeAttempt(launch, None)) or serving[-1],
            "train": unanswered_once(ends(outcome(0))),
        },
        detached=True,
    )
    runner = threading.Thread(target=lambda: run(tmp_path, steps, executor))
    runner.start()
    deadline = time.monotonic() + 10
    while not any(a.verdict == "succeeded" for a in Ledger(tmp_path / "run").attempts("train")):
        assert time.monotonic() < deadline, "train was never submitted again"
        time.sleep(0.1)
    assert not serving[0].stopped.is_set()  # the other job runs on
    serving[0].stop("cancel")
    runner.join(10)
    (train,) = ledger_of(tmp_path).attempts("train")  # one attempt, submitted twice
    assert train.verdict == "succeeded"


def test_a_runner_error_leaves_detached_attempts_running_for_the_next_run(tmp_path):
    steps = [
        {"name": "serve"},
        {"name": "prep"},
        {"name": "train", "needs": ["prep"], "inputs": ["run/prep/prompts.jsonl"]},
    ]
    executor = FakeExecutor({"serve": runs_until_stopped, "prep": ends(outcome(0))}, detached=True)
    with pytest.raises(PipelineError, match="prompts.jsonl does not exist"):
        run(tmp_path, steps, executor)
    (serve,) = executor.started("serve")
    assert not serve.stopped.is_set()  # hours of training are not cancelled for the runner's error
    ledger = ledger_of(tmp_path)
    assert [a.step for a in ledger.running_attempts()] == ["serve"]
    states = ledger.step_states(ledger.latest_run()["run_id"])
    assert states["serve"]["state"] == "running"
    assert "left running (fake:serve-1)" in states["serve"]["detail"]


def test_a_detached_attempt_the_runner_lost_and_cannot_stop_stays_running(tmp_path):
    steps = [{"name": "train", "timeout": 0.2}]
    executor = FakeExecutor({"train": lambda launch: BrokenAttempt(launch, wait_raises=False)}, detached=True)
    assert run(tmp_path, steps, executor).state == "failed"
    ledger = ledger_of(tmp_path)
    assert [a.step for a in ledger.running_attempts()] == ["train"]  # the next run resumes or reaps it
    states = ledger.step_states(ledger.latest_run()["run_id"])
    assert "left running (fake:train-1)" in states["train"]["detail"]


# -- an attempt is resumed or reaped by the executor that started it ------------------------------


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """A fake of Slurm's commands on PATH; every Slurm executor made meanwhile stops asking at the end."""
    fake = FakeSlurm(tmp_path)
    for name, value in fake.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm.controller, "ANSWER_WAITS_S", (0, 0.05, 0.05))
    monkeypatch.setattr(grid, "POLL_S", 0.1)
    made: list[slurm.SlurmExecutor] = []
    original = slurm.SlurmExecutor.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(slurm.SlurmExecutor, "__init__", init)
    yield fake
    for executor in made:
        executor.watcher.close()


def test_a_slurm_job_left_running_is_waited_for_even_by_a_run_of_another_executor(tmp_path, fake_slurm):
    steps = [{"name": "train", "command": ["train"]}, {"name": "after", "needs": ["train"]}]
    leave_running(tmp_path, steps, "slurm job 812", ["train"], executor="slurm")
    fake_slurm.add_job("812", "RUNNING", name="eyrie-dead-run-train-1")
    report = tmp_path / "run" / ".eyrie" / "logs" / "train" / "attempt-1.slurm.json"

    def job_ends() -> None:
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(
            json.dumps(
                {
                    "exit_code": 0,
                    "signal": None,
                    "started_at": 1.0,
                    "ended_at": 2.0,
                    "oom_kills_before": 0,
                    "oom_kills_after": 0,
                    "oom_at": None,
                    "peak_bytes": 2**20,
                    "anon_peak_bytes": 2**20,
                    "timeline": [],
                }
            )
        )
        with fake_slurm.changing() as cluster:
            cluster["jobs"]["812"]["state"] = "COMPLETED"

    threading.Timer(1.0, job_ends).start()
    executor = FakeExecutor({"after": ends(outcome(0))})  # `--executor local` given by mistake
    assert run(tmp_path, steps, executor).state == "succeeded"
    attempts = ledger_of(tmp_path).attempts()
    assert [(a.step, a.verdict, a.location) for a in attempts] == [
        ("train", "succeeded", "slurm job 812"),
        ("after", "succeeded", "fake:after-1"),
    ]
    assert executor.started("train") == [] and fake_slurm.calls("scancel") == []


def test_a_slurm_job_left_running_where_slurm_cannot_be_reached_is_refused_in_one_line(
    tmp_path, fake_slurm, monkeypatch
):
    steps = [{"name": "train", "command": ["train"]}]
    leave_running(tmp_path, steps, "slurm job 812", ["train"], executor="slurm")
    fake_slurm.add_job("812", "RUNNING", name="eyrie-dead-run-train-1")
    fake_slurm.set(down=True)
    executor = FakeExecutor({"train": ends(outcome(0))})
    with pytest.raises(ExecutorError) as info:
        run(tmp_path, steps, executor)
    assert (
        "train attempt 1 of an earlier run (slurm job 812) may still run, and cannot be checked: the "
        "Slurm controller did not answer squeue" in str(info.value)
    )
    assert "\n" not in str(info.value)
    assert executor.attempts == [] and executor.reaped == [] and fake_slurm.calls("scancel") == []
    assert len(ledger_of(tmp_path).running_attempts()) == 1

    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # a host without Slurm's commands
    with pytest.raises(ExecutorError) as info:
        run(tmp_path, steps, executor)
    assert "train attempt 1 of an earlier run ran under the slurm executor (slurm job 812)" in str(info.value)
    assert "run again with --executor slurm" in str(info.value)
    assert executor.attempts == []


def test_each_slurm_step_is_checked_against_the_nodes_of_its_own_partition(tmp_path, fake_slurm):
    host = os.uname().nodename
    fake_slurm.set(partitions={"debug": [["node1", host, 8192]], "fat": [["fat1", host, 65536]]})
    steps = [
        {"name": "train", "memory": "32GiB", "slurm": {"partition": "fat"}},  # fits a node of `fat`
        {"name": "prep", "memory": "16GiB"},  # the default partition's nodes have 8 GiB
    ]
    _, path = write_pipeline(tmp_path, steps)
    runner = Orchestrator(load_pipeline(path), path, tmp_path / "run", slurm.SlurmExecutor(), QuietReporter())
    with pytest.raises(PipelineError) as info:
        runner.run()
    refused = (
        "steps[1] (prep).memory: 16.00 GiB exceeds the 8.00 GiB a step can have (set by the largest node"
    )
    assert f"{refused} in Slurm's partition debug" in str(info.value)
    assert fake_slurm.calls("sbatch") == []


def test_a_slurm_replica_asking_for_more_gpus_than_any_node_of_its_partition_has_is_refused(
    tmp_path, fake_slurm
):
    host = os.uname().nodename
    gpu_nodes = [["gpu1", host, 65536, "gpu:h200:4(S:0-1)"], ["gpu2", host, 65536, "gpu:h200:8(S:0-1)"]]
    fake_slurm.set(partitions={"debug": [["node1", host, 8192]], "gpu": gpu_nodes})
    service = {"name": "target", "command": ["serve"], "memory": "1GiB", "replicas": 4}
    steps = [{"name": "generate", "command": ["true"], "memory": "64MiB", "uses": ["target"]}]
    path = tmp_path / "pipeline.yaml"

    def check(**fields) -> str | None:
        path.write_text(yaml.safe_dump({"services": [{**service, **fields}], "steps": steps}))
        try:
            check_placement(load_pipeline(path), path, slurm.SlurmExecutor(), 2**40, "the cluster")
        except PipelineError as exc:
            return str(exc)
        return None

    # Each replica is a job of its own: 4 replicas of 8 GPUs pass where the largest node has 8.
    assert check(gpus=8, slurm={"partition": "gpu"}) is None
    assert check(gpus=9, slurm={"partition": "gpu"}) == (
        f"{path}:4: services[0] (target).gpus: 9 per replica, more than the 8 GPU(s) a node of Slurm's "
        "partition gpu has at most (its Gres); lower its gpus or replicas"
    )
    assert "more than the 0 GPU(s) a node of Slurm's partition debug" in check(gpus=1)
    assert fake_slurm.calls("sbatch") == []


def test_a_submission_without_answer_for_too_long_ends_failed_and_stops_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(orchestrator, "SUBMIT_RETRY_S", 0.1)
    monkeypatch.setattr(orchestrator, "SUBMIT_PATIENCE_S", 0.5)

    def never_answered(launch: Launch) -> FakeAttempt:
        raise ExecutorUnavailable("step train: the Slurm controller did not answer sbatch for 60 s")

    executor = FakeExecutor({"train": never_answered}, detached=True)
    with pytest.raises(ExecutorUnavailable):
        run(tmp_path, [{"name": "train"}], executor)
    (train,) = ledger_of(tmp_path).attempts()  # one attempt, tried again and again, then given up
    assert train.verdict == "failed" and "could not start it" in train.reason, train.reason


class SeeingExecutor(FakeExecutor):
    host_memory = FakeExecutor.memory_budget  # its steps share what this budget says


def test_an_attempt_records_the_memory_its_executor_sees_and_none_it_cannot(tmp_path):
    (tmp_path / "nodes").mkdir()
    (tmp_path / "seen").mkdir()
    run(tmp_path / "nodes", [{"name": "prep"}], FakeExecutor({"prep": ends(outcome(0))}))
    (blind,) = ledger_of(tmp_path / "nodes").attempts()
    assert (blind.host_mem_available, blind.host_mem_total) == (None, None)  # not the runner's host
    run(tmp_path / "seen", [{"name": "prep"}], SeeingExecutor({"prep": ends(outcome(0))}))
    (seen,) = ledger_of(tmp_path / "seen").attempts()
    assert (seen.host_mem_available, seen.host_mem_total) == (2**34, 2**35)
