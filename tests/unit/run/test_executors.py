"""Executors by name: each declares its own options, read from the pipeline file under its name."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eyrie_testing import eyrie
from pipeline.run import EXECUTORS, grid, slurm
from pipeline.run.executor import (
    AttemptStillRunning,
    ExecutorError,
    ExecutorUnavailable,
    Launch,
    executor_class,
)
from pipeline.run.grid import merge_reports
from pipeline.run.host_gpus import host_gpus
from pipeline.run.slurm import SlurmOptions, batch_script, parse_exit_code, parse_job_record, sbatch_argv
from pipeline.run.spec import PipelineError, load_pipeline
from pipeline.run.verdict import Verdict, decide
from tests.fakes.fake_slurm import FakeSlurm


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    return path


def test_every_registered_executor_is_a_class_with_its_own_options():
    for name in EXECUTORS:
        cls = executor_class(name)
        assert cls.name == name
        assert isinstance(cls.admits_by_memory, bool)
        cls.Options()  # every option has a default
    with pytest.raises(ExecutorError, match="unknown executor; choose one of local, docker, slurm"):
        executor_class("k8s")
    assert not issubclass(ExecutorError, PipelineError)  # an engine's fault is not the pipeline file's


def test_the_command_line_lists_the_registered_executors():
    help_text = eyrie("run", "--help", check=True).stdout
    assert all(name in help_text for name in EXECUTORS)


def test_options_of_the_pipeline_and_of_a_step_merge_under_the_executors_name(tmp_path):
    spec = load_pipeline(
        write(
            tmp_path,
            """
slurm: {partition: gpu, account: ml, sbatch_args: [--qos=high]}
docker: {image: eyrie-pipeline:site}
steps:
  - name: prep
    command: [eyrie, prep]
    memory: 1GiB
  - name: train
    command: [eyrie, train]
    memory: 32GiB
    gpus: 8
    slurm: {partition: long, nodes: 2}
    docker: {image: eyrie-pipeline:train}
""",
        )
    )
    assert spec.executor_options("slurm", "prep") == SlurmOptions(
        partition="gpu", account="ml", sbatch_args=["--qos=high"]
    )
    assert spec.executor_options("slurm", "train") == SlurmOptions(
        partition="long", account="ml", nodes=2, sbatch_args=["--qos=high"]
    )
    assert spec.executor_options("docker", "prep").image == "eyrie-pipeline:site"
    assert spec.executor_options("docker", "train").image == "eyrie-pipeline:train"
    assert spec.executor_options("local", "train") == executor_class("local").Options()
    assert spec.executor_options("a-test-executor", "train") is None


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ("    slurm: {partiton: gpu}\n", "steps[0] (a).slurm.partiton: unknown key"),
        ("    slurm: {nodes: 0}\n", "steps[0] (a).slurm.nodes: Input should be greater than or equal to 1"),
        ("    slurm: {sbatch_args: [--mem=4G]}\n", "--mem is set by eyrie"),
        ("    docker: {image: [a]}\n", "steps[0] (a).docker.image: Input should be a valid string"),
        ("    image: eyrie-pipeline:x\n", "steps[0] (a).image: unknown key"),  # now under docker:
    ],
)
def test_a_wrong_executor_option_is_one_line_naming_file_and_key(tmp_path, block, expected):
    path = write(tmp_path, "steps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n" + block)
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert str(path) in str(info.value) and expected in str(info.value) and "\n" not in str(info.value)


def test_an_unknown_executor_is_one_line_before_the_file_is_read(tmp_path):
    result = eyrie("run", str(tmp_path / "missing.yaml"), "--executor", "k8s")
    assert result.returncode == 2
    assert "--executor 'k8s': unknown executor; choose one of local, docker, slurm" in result.stderr


# -- the Slurm job, as submitted and as judged ----------------------------------------------


def launch(tmp_path: Path, options: SlurmOptions, **fields) -> Launch:
    logs = tmp_path / ".eyrie" / "logs" / "train"
    return Launch(
        run_id="r1",
        step="train",
        attempt=2,
        argv=["eyrie", "train", "--data", "a b"],
        cwd=tmp_path / "train",
        env=fields.pop("env", {}),
        limit_bytes=3 * 2**30 + 1,
        stdout_path=logs / "attempt-2.stdout.log",
        stderr_path=logs / "attempt-2.stderr.log",
        options=options,
        **fields,
    )


@pytest.fixture
def attempts(monkeypatch):
    """Every SlurmAttempt a test makes, finished at its end: no log follower or squeue watcher
    outlives the test."""
    made: list[slurm.SlurmAttempt] = []
    original = slurm.SlurmAttempt.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(slurm.SlurmAttempt, "__init__", init)
    yield made
    for attempt in made:
        attempt.finish()
        attempt._executor.watcher.close()


@pytest.fixture
def cluster(tmp_path, monkeypatch, attempts) -> FakeSlurm:
    """A fake of Slurm's commands on PATH, and patience in fractions of a second."""
    fake = FakeSlurm(tmp_path)
    for name, value in fake.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(slurm.controller, "ANSWER_WAITS_S", (0, 0.05, 0.05))
    monkeypatch.setattr(slurm.controller, "COMMAND_TIMEOUT_S", 2.0)
    monkeypatch.setattr(grid, "REAP_WAIT_S", 1.5)
    monkeypatch.setattr(grid, "POLL_S", 0.1)
    return fake


def write_report(attempt_launch: Launch, **facts) -> None:
    path = slurm.report_path(attempt_launch)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
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
                **facts,
            }
        )
    )


def later(seconds: float, action) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(seconds), action()), daemon=True)
    thread.start()
    return thread


def test_the_job_asks_for_the_steps_limit_gpus_time_partition_and_account(tmp_path):
    options = SlurmOptions(partition="gpu", account="ml", cpus=16, sbatch_args=["--qos=high"])
    argv = sbatch_argv(launch(tmp_path, options, gpus=8, timeout=3600.0), tmp_path / "job.sbatch")
    assert "--mem=3073M" in argv  # rounded up to whole MiB: never below the step's limit
    assert "--gres=gpu:8" in argv and "--time=61" in argv  # a minute beyond the runner's own timeout
    assert {"--partition=gpu", "--account=ml", "--cpus-per-task=16", "--no-requeue"} <= set(argv)
    assert argv[-2:] == ["--qos=high", str(tmp_path / "job.sbatch")]
    assert f"--chdir={tmp_path / 'train'}" in argv and "--job-name=eyrie-r1-train-2" in argv
    bare = sbatch_argv(launch(tmp_path, SlurmOptions()), tmp_path / "job.sbatch")
    assert not [a for a in bare if a.startswith(("--time", "--gres", "--partition", "--nodes"))]


def test_the_job_gets_the_steps_variables_not_the_runners_secrets(tmp_path):
    env = {
        "PATH": "/usr/bin",
        "HOME": "/home/me",
        "LC_ALL": "C.UTF-8",
        "EYRIE_RUN_DIR": "/shared/run",
        "HF_TOKEN": "hf_secret",
        "OPENAI_API_KEY": "sk-secret",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "WANDB_API_KEY": "wandb",
        "TRAIN_NOTE": "set by the step",
        "SLURM_JOB_ID": "41",
    }
    options = SlurmOptions(export=["WANDB_*"])
    argv = sbatch_argv(launch(tmp_path, options, env=env, step_env=frozenset({"TRAIN_NOTE"})), tmp_path / "j")
    (export,) = [a for a in argv if a.startswith("--export")]
    assert export == "--export=EYRIE_RUN_DIR,HOME,LC_ALL,PATH,TRAIN_NOTE,WANDB_API_KEY"
    # srun inside the job would pass on only those names: the rendezvous must reach the tasks too
    assert "SLURM_EXPORT_ENV=ALL" in batch_script(launch(tmp_path, SlurmOptions(nodes=2)))


def test_the_batch_script_wraps_the_step_and_uses_srun_when_it_asks_for_nodes(tmp_path):
    single = batch_script(launch(tmp_path, SlurmOptions()))
    assert "-m pipeline.run.container_init" in single
    assert "attempt-2.slurm.json -- eyrie train --data 'a b'" in single
    assert "srun" not in single
    several = batch_script(launch(tmp_path, SlurmOptions(nodes=4)))
    assert "exec srun --nodes=4 --ntasks-per-node=1" in several
    assert 'PET_RDZV_ENDPOINT="$first:$port"' in several and "PET_RDZV_BACKEND=c10d" in several
    assert '"$0.node-$SLURM_NODEID.json"' in several  # one report per node


def test_slurms_view_of_a_job():
    record = parse_job_record(
        "JobId=7 JobName=eyrie-x JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125 NodeList=gpu01"
    )
    assert (record["JobState"], record["ExitCode"]) == ("OUT_OF_MEMORY", "0:125")
    assert parse_exit_code("1:0") == (1, None)
    assert parse_exit_code("0:9") == (None, signal.SIGKILL)
    assert parse_exit_code("") == (None, None)


def test_several_nodes_reports_are_one_outcome():
    def report(node: int, exit_code, sig, ended_at, peak, kills):
        return {
            "exit_code": exit_code,
            "signal": sig,
            "started_at": 10.0 + node,
            "ended_at": ended_at,
            "oom_kills_before": 0,
            "oom_kills_after": kills,
            "oom_at": ended_at if kills else None,
            "peak_bytes": peak,
            "anon_peak_bytes": peak // 2,
            "timeline": [[1.0, peak, peak // 2]],
        }

    merged = merge_reports(
        [
            report(0, None, signal.SIGKILL, 30.0, 5 * 2**30, 0),  # killed by srun after node 1 failed
            report(1, None, signal.SIGKILL, 20.0, 8 * 2**30, 1),  # OOM-killed first
            report(2, 0, None, 25.0, 2 * 2**30, 0),
        ]
    )
    assert (merged["signal"], merged["oom_kills_after"]) == (signal.SIGKILL, 1)
    assert merged["peak_bytes"] == 8 * 2**30
    assert merged["oom_at"] == 20.0 and merged["started_at"] == 10.0 and merged["ended_at"] == 30.0
    assert merged["timeline"] == [[1.0, 8 * 2**30, 4 * 2**30]]


@pytest.mark.parametrize(
    ("slurm_says", "report", "verdict", "reason"),
    [
        (
            ("OUT_OF_MEMORY", "0:125", "scontrol"),
            None,
            Verdict.OOM_KILLED,
            "decided from Slurm's state OUT_OF_MEMORY, ExitCode 0:125 for job 812 (scontrol; 1 of 1 in-job "
            "report(s) missing)",
        ),
        (
            ("TIMEOUT", "0:15", "sacct"),
            {"exit_code": None, "signal": signal.SIGTERM},
            Verdict.TIMED_OUT,
            "decided from Slurm's state TIMEOUT for job 812 (sacct) and the job's cgroup",
        ),
        (("NODE_FAIL", "0:0", "scontrol"), None, Verdict.NODE_FAILED, "its node failed"),
        (None, None, Verdict.FAILED, "ended with its in-job report missing, and Slurm no longer knows it"),
        # Slurm ends a job OUT_OF_MEMORY when a child alone was killed: the report says what happened
        (
            ("OUT_OF_MEMORY", "0:125", "scontrol"),
            {"exit_code": 0, "signal": None, "oom_kills_after": 1},
            Verdict.CHILD_OOM_KILLED,
            "the main process was not the one killed",
        ),
    ],
)
def test_slurms_final_state_says_who_stopped_a_job_and_stands_in_for_a_missing_report(
    tmp_path, monkeypatch, attempts, slurm_says, report, verdict, reason
):
    monkeypatch.setattr(slurm.controller, "final_state", lambda job_id, patience_s=None: slurm_says)
    attempt_launch = launch(tmp_path, SlurmOptions())
    if report is not None:
        facts = {
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
        path = slurm.report_path(attempt_launch)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({**facts, **report}))
    executor = SimpleNamespace(watcher=slurm.squeue_watcher())
    attempt = slurm.SlurmAttempt(executor, attempt_launch, "812", time.time())
    decision = decide(attempt._outcome(attempt._reports()), False, "no manifest")
    assert decision.verdict == verdict and reason in decision.reason, decision.reason


# -- a controller that does not answer is no answer -------------------------------------------


def test_a_silent_controller_never_makes_a_running_job_look_gone(tmp_path, cluster):
    cluster.add_job("812", "RUNNING")
    cluster.set(down=True)
    executor = slurm.SlurmExecutor()
    with pytest.raises(ExecutorUnavailable, match="did not answer squeue -h … for 0 s"):
        executor.resume("slurm job 812", launch(tmp_path, SlurmOptions()))
    with pytest.raises(ExecutorUnavailable, match="did not answer"):
        executor.reap("slurm job 812", None, time.time())
    assert cluster.calls("scancel") == [] and len(cluster.calls("squeue")) == 6  # three tries each


def test_reaping_a_job_waits_until_slurm_says_it_ended(tmp_path, cluster):
    cluster.add_job("812", "RUNNING")
    assert slurm.SlurmExecutor().reap("slurm job 812", None, time.time()) == 1
    assert cluster.job("812")["state"] == "CANCELLED" and cluster.calls("scancel") == [["812"]]
    assert slurm.SlurmExecutor().reap("slurm job 812", None, time.time()) == 0  # ended: nothing to do

    cluster.add_job("813", "RUNNING")
    cluster.set(scancel_ends_jobs=False)  # scancel said yes, and the job runs on
    with pytest.raises(AttemptStillRunning, match="slurm job 813 is still RUNNING 2 s after scancel"):
        slurm.SlurmExecutor().reap("slurm job 813", None, time.time())


# -- the end of a job: the report decides, Slurm's state only where it is missing ----------------


def test_a_complete_report_decides_while_the_controller_is_silent(tmp_path, cluster, attempts):
    cluster.add_job("812", "COMPLETED")
    attempt_launch = launch(tmp_path, SlurmOptions())
    write_report(attempt_launch, exit_code=0)
    cluster.set(down=["scontrol"])  # squeue saw it end; then the controller went quiet
    outcome = slurm.SlurmAttempt(slurm.SlurmExecutor(), attempt_launch, "812", time.time()).wait()
    decision = decide(outcome, True, "1 output matches its manifest")
    assert decision.verdict == Verdict.SUCCEEDED, decision.reason
    assert "the job's cgroup; Slurm's state was unavailable: the Slurm controller did not answer" in (
        decision.reason
    )


def test_with_the_report_missing_a_silent_controller_is_waited_for(tmp_path, cluster, attempts):
    cluster.add_job("812", "OUT_OF_MEMORY", exit_code="0:125")
    cluster.set(down=["scontrol"])
    later(1.0, lambda: cluster.set(down=False))  # a controller restart: a second, not a verdict
    attempt_launch = launch(tmp_path, SlurmOptions(report_wait=0.2))
    outcome = slurm.SlurmAttempt(slurm.SlurmExecutor(), attempt_launch, "812", time.time()).wait()
    decision = decide(outcome, False, "no manifest")
    assert decision.verdict == Verdict.OOM_KILLED
    assert "decided from Slurm's state OUT_OF_MEMORY, ExitCode 0:125 for job 812 (scontrol" in decision.reason


def test_a_report_and_log_lines_that_show_late_on_the_shared_filesystem_still_decide(
    tmp_path, cluster, attempts
):
    # Slurm says OUT_OF_MEMORY for a child's OOM kill too; only the report tells them apart,
    # and it shows here seconds after squeue said the job ended (NFS caches a missing name).
    cluster.add_job("812", "OUT_OF_MEMORY", exit_code="0:125")
    attempt_launch = launch(tmp_path, SlurmOptions(report_wait=20))
    attempt_launch.stderr_path.parent.mkdir(parents=True)
    attempt_launch.stderr_path.write_text("loading\n")

    def node_writes_its_last_lines() -> None:
        with open(attempt_launch.stderr_path, "a") as log:
            log.write("Traceback (most recent call last):\nMemoryError\n")

    later(0.5, node_writes_its_last_lines)
    later(1.5, lambda: write_report(attempt_launch, exit_code=0, oom_kills_after=1))
    outcome = slurm.SlurmAttempt(slurm.SlurmExecutor(), attempt_launch, "812", time.time()).wait()
    decision = decide(outcome, False, "no manifest")
    assert decision.verdict == Verdict.CHILD_OOM_KILLED, decision.reason
    assert outcome.stderr_tail[-1] == "MemoryError"


def test_a_job_cancelled_before_its_script_started_is_not_waited_for(tmp_path, cluster, attempts):
    cluster.add_job("812", "CANCELLED")  # its node never started it (no log file): no report will come
    attempt = slurm.SlurmAttempt(slurm.SlurmExecutor(), launch(tmp_path, SlurmOptions()), "812", time.time())
    began = time.monotonic()
    outcome = attempt.wait()
    assert time.monotonic() - began < 5 and outcome.stopped_by == "cancel"


def test_a_steps_timeout_counts_from_when_its_script_starts_not_from_its_allocation(
    tmp_path, cluster, attempts
):
    # RUNNING for the controller while the node still sets the job up (seconds on a busy node)
    cluster.add_job("812", "RUNNING")
    attempt_launch = launch(tmp_path, SlurmOptions())
    attempt = slurm.SlurmAttempt(slurm.SlurmExecutor(), attempt_launch, "812", time.time())

    def script_starts() -> None:  # slurmstepd opens the job's log files, then runs its script
        attempt_launch.stdout_path.parent.mkdir(parents=True, exist_ok=True)
        attempt_launch.stdout_path.touch()

    began = time.monotonic()
    later(1.5, script_starts)
    assert attempt.wait(timeout=0.5) is None
    assert time.monotonic() - began >= 2.0  # 1.5 s of setting up, then 0.5 s of running


# -- submission ---------------------------------------------------------------------------------


def test_a_submission_whose_answer_was_lost_is_found_by_its_name_not_submitted_twice(tmp_path, cluster):
    cluster.set(sbatch="hang_after_queueing")  # the job is queued; sbatch's answer never comes
    attempt = slurm.SlurmExecutor().start(launch(tmp_path, SlurmOptions(), env=cluster.env))
    assert attempt.job_id == "800" and len(cluster.calls("sbatch")) == 1


def test_a_submission_nobody_can_confirm_is_not_made_again_until_slurm_says_it_is_not_there(
    tmp_path, cluster
):
    cluster.set(down=True)
    executor = slurm.SlurmExecutor()
    attempt_launch = launch(tmp_path, SlurmOptions(), env=cluster.env)
    with pytest.raises(ExecutorUnavailable):
        executor.start(attempt_launch)
    assert len(cluster.calls("sbatch")) == 1  # squeue could not say: never a second sbatch
    # The first sbatch reached the controller after all; once it answers, the job is found by name.
    cluster.add_job("812", "RUNNING", name="eyrie-r1-train-2")
    cluster.set(down=False)
    assert executor.start(attempt_launch).job_id == "812" and len(cluster.calls("sbatch")) == 1


def test_a_refused_submission_is_one_line_naming_the_step(tmp_path, cluster):
    cluster.set(sbatch="refuse")
    refused = "step train: sbatch refused its job: .*Invalid partition"
    with pytest.raises(ExecutorError, match=refused) as info:
        slurm.SlurmExecutor().start(launch(tmp_path, SlurmOptions(), env=cluster.env))
    assert not isinstance(info.value, ExecutorUnavailable) and len(cluster.calls("sbatch")) == 1


@pytest.mark.parametrize(
    ("arg", "named"),
    [
        ("-N2", "-N"),
        ("-pgpu", "-p"),
        ("--mem-per-cpu=4G", "--mem-per-cpu"),
        ("--mem-per-gpu=80G", "--mem-per-gpu"),
        ("--gpus=8", "--gpus"),
        ("--gpus-per-node=4", "--gpus-per-node"),
        ("-G8", "-G"),
        ("--part=gpu", "--part (short for --partition)"),
        ("--me=4G", "--me (short for --mem or --mem-per-cpu"),
        ("--tim=60", "--tim (short for --time)"),
    ],
)
def test_sbatch_args_that_would_set_what_eyrie_sets_are_refused_up_front(tmp_path, arg, named):
    path = write(
        tmp_path,
        f"slurm: {{sbatch_args: [{arg}]}}\nsteps:\n  - name: a\n    command: [true]\n    memory: 64MiB\n",
    )
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert f"{named}" in str(info.value) and "is set by eyrie" in str(info.value), str(info.value)
    assert "\n" not in str(info.value)


def test_sbatch_args_eyrie_does_not_set_pass_through():
    args = [
        "--qos=high",
        "--constraint=h100",
        "--begin=now+1hour",
        "--exclusive",
        "--mem-bind=local",
        "--gres-flags=enforce-binding",
        "--time-min=30",
        "--nodelist=gpu01",
        "-q",
        "high",
    ]
    assert SlurmOptions(sbatch_args=args).sbatch_args == args


# -- GPUs: what services' replicas are checked against ------------------------------------------


def test_the_hosts_gpus_are_the_nvidia_display_and_3d_controllers_on_its_pci_bus(tmp_path):
    devices = tmp_path / "bus" / "pci" / "devices"
    for address, vendor, klass in [
        ("0000:17:00.0", "0x10de", "0x030200"),  # an H200: a 3D controller
        ("0000:65:00.0", "0x10de", "0x030000"),  # a workstation GPU: VGA
        ("0000:c0:00.0", "0x10de", "0x068000"),  # an NVSwitch: a bridge
        ("0000:00:02.0", "0x8086", "0x030000"),  # the board's own graphics
    ]:
        (devices / address).mkdir(parents=True)
        (devices / address / "vendor").write_text(vendor + "\n")
        (devices / address / "class").write_text(klass + "\n")
    assert host_gpus(tmp_path) == 2
    assert host_gpus(tmp_path / "no-sysfs") == 0


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:8", 8),
        ("gpu:h200:4(S:0-1)", 4),
        ("gpu:a100:4(S:0-1),gpu:v100:2", 6),
        ("mps:100,gpu:2", 2),
        ("(null)", 0),
        ("", 0),
    ],
)
def test_a_nodes_gpus_are_read_from_its_gres_as_sinfo_shows_it(gres, gpus):
    assert slurm.controller.gres_gpus(gres) == gpus
