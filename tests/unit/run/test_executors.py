"""Executors by name: each declares its own options, read from the pipeline file under its name."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from eyrie_testing import eyrie
from pipeline.run import EXECUTORS, slurm
from pipeline.run.executor import ExecutorError, Launch, executor_class
from pipeline.run.slurm import SlurmOptions, _exit_status, _merge, batch_script, parse_job_record, sbatch_argv
from pipeline.run.spec import PipelineError, load_pipeline
from pipeline.run.verdict import Verdict, decide


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
    spec = load_pipeline(write(tmp_path, """
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
"""))
    assert spec.executor_options("slurm", "prep") == SlurmOptions(partition="gpu", account="ml",
                                                                  sbatch_args=["--qos=high"])  # fmt: skip
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
    return Launch(run_id="r1", step="train", attempt=2, argv=["eyrie", "train", "--data", "a b"],
                  cwd=tmp_path / "train", env={}, limit_bytes=3 * 2**30 + 1,
                  stdout_path=logs / "attempt-2.stdout.log", stderr_path=logs / "attempt-2.stderr.log",
                  options=options, **fields)  # fmt: skip


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
    record = parse_job_record("JobId=7 JobName=eyrie-x JobState=OUT_OF_MEMORY Reason=OutOfMemory "
                              "ExitCode=0:125 NodeList=gpu01")  # fmt: skip
    assert (record["JobState"], record["ExitCode"]) == ("OUT_OF_MEMORY", "0:125")
    assert _exit_status("1:0") == (1, None)
    assert _exit_status("0:9") == (None, signal.SIGKILL)
    assert _exit_status("") == (None, None)


def test_several_nodes_reports_are_one_outcome():
    def report(node: int, exit_code, sig, ended_at, peak, kills):
        return {"exit_code": exit_code, "signal": sig, "started_at": 10.0 + node, "ended_at": ended_at,
                "oom_kills_before": 0, "oom_kills_after": kills, "oom_at": ended_at if kills else None,
                "peak_bytes": peak, "anon_peak_bytes": peak // 2,
                "timeline": [[1.0, peak, peak // 2]]}  # fmt: skip

    merged = _merge([
        report(0, None, signal.SIGKILL, 30.0, 5 * 2**30, 0),  # killed by srun after node 1 failed
        report(1, None, signal.SIGKILL, 20.0, 8 * 2**30, 1),  # OOM-killed first
        report(2, 0, None, 25.0, 2 * 2**30, 0),
    ])  # fmt: skip
    assert (merged["signal"], merged["oom_kills_after"]) == (signal.SIGKILL, 1)
    assert merged["peak_bytes"] == 8 * 2**30
    assert merged["oom_at"] == 20.0 and merged["started_at"] == 10.0 and merged["ended_at"] == 30.0
    assert merged["timeline"] == [[1.0, 8 * 2**30, 4 * 2**30]]


@pytest.mark.parametrize(
    ("slurm_says", "report", "verdict", "reason"),
    [
        (("OUT_OF_MEMORY", "0:125", "scontrol"), None, Verdict.OOM_KILLED,
         "decided from Slurm's state OUT_OF_MEMORY, ExitCode 0:125 for job 812 (scontrol; 1 of 1 in-job "
         "report(s) missing)"),
        (("TIMEOUT", "0:15", "sacct"), {"exit_code": None, "signal": signal.SIGTERM}, Verdict.TIMED_OUT,
         "decided from Slurm's state TIMEOUT for job 812 (sacct) and the job's cgroup"),
        (("NODE_FAIL", "0:0", "scontrol"), None, Verdict.NODE_FAILED, "its node failed"),
        (None, None, Verdict.FAILED, "ended with its in-job report missing, and Slurm no longer knows it"),
        # Slurm ends a job OUT_OF_MEMORY when a child alone was killed: the report says what happened
        (("OUT_OF_MEMORY", "0:125", "scontrol"), {"exit_code": 0, "signal": None, "oom_kills_after": 1},
         Verdict.CHILD_OOM_KILLED, "the main process was not the one killed"),
    ],
)  # fmt: skip
def test_slurms_final_state_says_who_stopped_a_job_and_stands_in_for_a_missing_report(
    tmp_path, monkeypatch, slurm_says, report, verdict, reason
):
    monkeypatch.setattr(slurm, "final_state", lambda job_id: slurm_says)
    attempt_launch = launch(tmp_path, SlurmOptions())
    if report is not None:
        facts = {"exit_code": 0, "signal": None, "started_at": 1.0, "ended_at": 2.0, "oom_kills_before": 0,
                 "oom_kills_after": 0, "oom_at": None, "peak_bytes": 2**20, "anon_peak_bytes": 2**20,
                 "timeline": []}  # fmt: skip
        path = slurm.report_path(attempt_launch)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({**facts, **report}))
    executor = SimpleNamespace(watcher=slurm._Watcher())
    attempt = slurm.SlurmAttempt(executor, attempt_launch, "812", time.time())
    decision = decide(attempt._outcome(), False, "no manifest")
    assert decision.verdict == verdict and reason in decision.reason, decision.reason
