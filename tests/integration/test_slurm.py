"""A real Slurm cluster: the scenario suite, the demo, stopping, a killed runner, srun.

`.ci/slurm.sh` starts a single-node cluster from Debian's packages, memory
enforced through cgroups, and sets EYRIE_REQUIRE_SLURM=1: then a cluster that
does not answer is a failure. Elsewhere these tests skip without one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eyrie_testing import (
    REAL_JOB_CPU_SETTINGS,
    REAL_JOB_SUCCEEDED,
    REPO,
    SCENARIOS,
    attempts_json,
    eyrie,
    kill_target_mid_generate,
    run_real_job,
)

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]
SCENARIO = REPO / "tests" / "scenarios" / "scenario.py"
TINY_DEMO = REPO / "pipeline" / "embedded" / "tiny.yaml"


def _cluster_problem() -> str | None:
    if shutil.which("sbatch") is None:
        return "Slurm's commands are not installed"
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if "UP" not in ping.stdout:
        return f"no Slurm controller answers: {(ping.stdout + ping.stderr).strip()}"
    nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True).stdout.split()
    if not any(state.rstrip("*~#") in ("idle", "mixed", "allocated") for state in nodes):
        return f"no Slurm node is up (sinfo: {nodes})"
    return None


@pytest.fixture(scope="session")
def cluster() -> None:
    problem = _cluster_problem()
    if problem:
        if os.environ.get("EYRIE_REQUIRE_SLURM") == "1":
            pytest.fail(f"EYRIE_REQUIRE_SLURM=1 but {problem}")
        pytest.skip(problem)


def _jobs(name_prefix: str = "eyrie-") -> list[tuple[str, str, str]]:
    """(id, name, state) of every job Slurm still lists, ended ones included."""
    out = subprocess.run(["squeue", "-h", "--states=all", "-o", "%i|%j|%T"], capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    rows = [tuple(line.split("|")) for line in out.splitlines() if line]
    return [row for row in rows if row[1].startswith(name_prefix)]


def _active(run_dir: Path) -> list[str]:
    ids = {a["location"].split()[-1] for a in attempts_json(run_dir) if a["location"]}
    return [job for job, _, state in _jobs() if job in ids and state in ("PENDING", "RUNNING", "COMPLETING")]


def _facts(run_dir: Path) -> dict[str, tuple]:
    return {
        a["step"]: (a["verdict"], a["exit_code"], a["signal"], a["oom_kills"]) for a in attempts_json(run_dir)
    }


def write_pipeline(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(body.replace("SCENARIO", str(SCENARIO)).replace("PYTHON", sys.executable))
    return path


@pytest.mark.usefixtures("real_cgroups", "cluster")
def test_slurm_executor_gives_the_local_executors_verdicts(tmp_path):
    local_dir, slurm_dir = tmp_path / "local", tmp_path / "slurm"
    eyrie("run", str(SCENARIOS), "--run-dir", str(local_dir))
    result = eyrie("run", str(SCENARIOS), "--run-dir", str(slurm_dir), "--executor", "slurm")
    assert result.returncode == 1, result.stdout + result.stderr  # some steps fail on purpose
    local, slurm = _facts(local_dir), _facts(slurm_dir)
    assert slurm == local
    # the table's verdicts, not merely equal to each other
    assert slurm["oom_killed"] == ("oom_killed", None, signal.SIGKILL, 1)
    # Slurm itself ends this job OUT_OF_MEMORY: the in-job report says the main process exited 0
    assert slurm["child_oom_killed"] == ("child_oom_killed", 0, None, 1)
    assert slurm["crashed_kill9"] == ("crashed", None, signal.SIGKILL, 0)
    assert slurm["timed_out"] == ("timed_out", None, signal.SIGTERM, 0)

    attempts = {a["step"]: a for a in attempts_json(slurm_dir)}
    assert all(a["executor"] == "slurm" for a in attempts.values())
    assert attempts["oom_killed"]["peak_bytes"] >= 90 * 2**20  # the job's cgroup, read inside the job
    assert attempts["oom_killed"]["limit_bytes"] == 96 * 2**20
    job = attempts["child_oom_killed"]["location"].split()[-1]
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout
    assert "JobState=OUT_OF_MEMORY" in shown and "MinMemoryNode=96M" in shown  # --mem is the step's limit
    assert "(decided from" not in attempts["child_oom_killed"]["reason"]  # the report decided, not Slurm
    assert "ValueError: row 17" in (slurm_dir / ".eyrie/logs/failed/attempt-1.stderr.log").read_text()
    assert _active(slurm_dir) == []


@pytest.mark.usefixtures("cluster")
def test_slurms_view_decides_only_when_the_in_job_report_is_missing(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
slurm: {report_wait: 3s}  # no report will come: the runner waits for it only this long
steps:
  - name: wrapper_killed
    # SIGKILL to the in-job wrapper (the step's parent): the job ends with no report
    command: [sh, -c, "kill -9 $PPID; sleep 5"]
    memory: 64MiB
""",
    )
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "slurm")
    assert result.returncode == 1, result.stdout + result.stderr
    (attempt,) = attempts_json(run_dir)
    assert (attempt["verdict"], attempt["signal"], attempt["peak_bytes"]) == ("crashed", signal.SIGKILL, None)
    job = attempt["location"].split()[-1]
    assert (
        f"decided from Slurm's state FAILED, ExitCode 0:9 for job {job} (scontrol; 1 of 1 in-job"
        in (attempt["reason"])
    )
    assert not (run_dir / ".eyrie/logs/wrapper_killed/attempt-1.slurm.json").exists()


@pytest.mark.usefixtures("cluster")
def test_sigterm_cancels_the_runs_jobs_and_records_them_cancelled(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: long
    command: [PYTHON, SCENARIO, sleep]
    memory: 64MiB
  - name: queued
    command: [PYTHON, SCENARIO, sleep]
    memory: 64MiB
    slurm: {sbatch_args: [--begin=now+1hour]}   # stays PENDING: cancelled before it ever runs
""",
    )
    run_dir = tmp_path / "run"
    runner = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir",
                               str(run_dir), "--executor", "slurm"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _wait_for_state(run_dir, "long", "RUNNING")
    _wait_for_script(run_dir, "long")  # the controller says RUNNING while the node still sets the job up
    runner.send_signal(signal.SIGTERM)
    output = runner.communicate(timeout=120)[0]
    assert runner.returncode == 130, output
    attempts = {a["step"]: a for a in attempts_json(run_dir)}
    assert attempts["long"]["verdict"] == "cancelled" and attempts["long"]["signal"] == signal.SIGTERM
    assert attempts["queued"]["verdict"] == "cancelled"
    assert "Slurm's state CANCELLED" in attempts["queued"]["reason"]  # no report: it never ran
    assert _active(run_dir) == []


def _wait_for_state(run_dir: Path, step: str, state: str, seconds: float = 60) -> str:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for job, name, job_state in _jobs():
            if name.endswith(f"-{step}-1") and job_state == state and str(run_dir) in _workdir(job):
                return job
        time.sleep(0.3)
    raise AssertionError(f"no job of step {step} reached {state} within {seconds} s: {_jobs()}")


def _wait_for_script(run_dir: Path, step: str, seconds: float = 60) -> None:
    """Until the node started the step's job script (Slurm creates its log first), and a moment more
    for the wrapper to take its signals."""
    log = run_dir / ".eyrie" / "logs" / step / "attempt-1.stdout.log"
    deadline = time.monotonic() + seconds
    while not log.exists():
        assert time.monotonic() < deadline, f"the job of step {step} never started its script"
        time.sleep(0.2)
    time.sleep(2)


def _workdir(job: str) -> str:
    return next((t.split("=", 1)[1] for t in _show(job).split() if t.startswith("WorkDir=")), "")


@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize("rerun_with", ["slurm", "local"])  # local: `--executor slurm` forgotten
def test_a_killed_runner_finds_its_job_again_and_records_it_without_a_duplicate(
    tmp_path, request, rerun_with
):
    if rerun_with == "local":
        request.getfixturevalue("real_cgroups")  # the step after it runs here
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: slow
    command: [sh, -c, "sleep 8; echo done > result.txt"]
    memory: 64MiB
    outputs: [result.txt]
  - name: after
    command: [PYTHON, SCENARIO, succeed]
    memory: 64MiB
    needs: [slow]
    outputs: [result.txt]
""",
    )
    run_dir = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir",
                              str(run_dir), "--executor", "slurm"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    job = _wait_for_state(run_dir, "slow", "RUNNING")
    first.kill()  # no chance to cancel anything: the job runs on without its runner
    first.wait()
    assert f"running (slurm job {job})" in eyrie("status", "--run-dir", str(run_dir), check=True).stdout
    again = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", rerun_with, check=True)
    assert f"found it again (slurm job {job})" in again.stdout  # by the executor that started it
    attempts = attempts_json(run_dir)
    assert [(a["step"], a["attempt"], a["verdict"]) for a in attempts] == [
        ("slow", 1, "succeeded"), ("after", 1, "succeeded"),
    ]  # fmt: skip
    assert attempts[0]["location"] == f"slurm job {job}"
    assert [j for j in _jobs() if j[1].endswith("-slow-1") and str(run_dir) in _workdir(j[0])] == [
        (job, _jobs_name(job), "COMPLETED")
    ], "one job for the step, never a second"
    assert (run_dir / "slow" / "result.txt").read_text() == "done\n"


def _jobs_name(job: str) -> str:
    return next(name for job_id, name, _ in _jobs() if job_id == job)


@pytest.mark.usefixtures("cluster")
def test_a_preempted_step_runs_again_with_the_same_limit(tmp_path):
    # .ci/slurm.sh: jobs of partition `low` are cancelled by any job of `debug` needing their memory
    partitions = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True).stdout.split()
    if "low" not in partitions:
        pytest.skip("this cluster has no preemptible partition `low` (.ci/slurm.sh makes one)")
    pipeline = write_pipeline(
        tmp_path,
        """
slurm: {partition: low, report_wait: 3s}
steps:
  - name: modest
    command: [sh, -c, "sleep 6; echo done > result.txt"]
    memory: 256MiB
    outputs: [result.txt]
""",
    )
    run_dir = tmp_path / "run"
    runner = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir",
                               str(run_dir), "--executor", "slurm"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    _wait_for_state(run_dir, "modest", "RUNNING")
    node = subprocess.run(["sinfo", "-h", "-N", "-p", "low", "-o", "%N"], capture_output=True,
                          text=True).stdout.split()[0]  # fmt: skip
    shown = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True).stdout
    fields = dict(t.partition("=")[::2] for t in shown.split())
    memory = {k: int(fields[k]) for k in ("RealMemory", "AllocMem")}
    # all that is free, and the step's 256 MiB: it fits only once the step's job is gone
    needed = memory["RealMemory"] - memory["AllocMem"] + 256
    subprocess.run(["sbatch", "-p", "debug", f"--mem={needed}M", "-J", "eyrie-test-preemptor", "-o",
                    "/dev/null", "--wrap", "sleep 2"], check=True, capture_output=True)  # fmt: skip
    output = runner.communicate(timeout=300)[0]
    assert runner.returncode == 0, output
    first, second = attempts_json(run_dir)
    assert first["verdict"] == "preempted" and "Slurm's state PREEMPTED" in first["reason"], first
    assert second["verdict"] == "succeeded" and second["limit_bytes"] == first["limit_bytes"]
    assert "modest: running it again (preempted, limit unchanged)" in output


@pytest.mark.usefixtures("cluster")
def test_a_step_whose_node_failed_runs_again(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
slurm: {report_wait: 3s}  # a lost node writes no report
steps:
  - name: steady
    command: [sh, -c, "sleep 6; echo done > result.txt"]
    memory: 64MiB
    outputs: [result.txt]
""",
    )
    run_dir = tmp_path / "run"
    runner = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir",
                               str(run_dir), "--executor", "slurm"], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)  # fmt: skip
    job = _wait_for_state(run_dir, "steady", "RUNNING")
    node = next(t.split("=", 1)[1] for t in _show(job).split() if t.startswith("NodeList="))
    try:
        # The node is lost under the job: Slurm ends it NODE_FAIL; the retry waits for the node.
        down = ["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=eyrie-test"]
        subprocess.run(down, check=True)
        deadline = time.monotonic() + 60
        while "JobState=NODE_FAIL" not in _show(job) and time.monotonic() < deadline:
            time.sleep(0.3)
    finally:
        # (ReturnToService=2 may have brought it back already: then RESUME is refused, and not needed)
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True)
    output = runner.communicate(timeout=300)[0]
    assert runner.returncode == 0, output
    first, second = attempts_json(run_dir)
    assert first["verdict"] == "node_failed" and "Slurm's state NODE_FAIL" in first["reason"], first
    assert second["verdict"] == "succeeded"


def _show(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True).stdout


@pytest.mark.usefixtures("cluster")
def test_nodes_runs_the_step_through_srun_with_a_torchrun_rendezvous(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "allreduce.py").write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "t = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "if dist.get_rank() == 0:\n"
        "    open('sum.txt', 'w').write(f\"{int(t.item())} {os.environ['PET_RDZV_ENDPOINT']}\\n\")\n"
        "dist.destroy_process_group()\n"
    )
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: ddp
    # torchrun's rendezvous comes from the job's environment (PET_RDZV_*), as for `eyrie train --nnodes`
    command: [PYTHON, -m, torch.distributed.run, --nnodes=1, --nproc-per-node=2,
              "${EYRIE_PIPELINE_DIR}/allreduce.py"]
    memory: 2GiB
    outputs: [sum.txt]
    slurm: {nodes: 1}
  - name: oom
    command: [PYTHON, SCENARIO, oom]
    memory: 96MiB
    slurm: {nodes: 1}
""",
    )
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "slurm")
    assert result.returncode == 1, result.stdout + result.stderr
    facts = _facts(run_dir)
    assert facts["ddp"] == ("succeeded", 0, None, 0), result.stdout
    total, endpoint = (run_dir / "ddp" / "sum.txt").read_text().split()
    assert total == "3"  # ranks 0 and 1 met: 1 + 2
    node = subprocess.run(["sinfo", "-h", "-N", "-p", "debug", "-o", "%n"], capture_output=True,
                          text=True).stdout.split()  # fmt: skip
    assert endpoint.rsplit(":", 1)[0] in node  # the allocation's first node
    assert facts["oom"] == ("oom_killed", None, signal.SIGKILL, 1)  # the node's report, read inside srun
    logs = run_dir / ".eyrie" / "logs"
    assert (logs / "ddp" / "attempt-1.slurm.json.node-0.json").exists()
    assert "exec srun --nodes=1" in (logs / "ddp" / "attempt-1.sbatch").read_text()


@pytest.mark.usefixtures("cluster")
def test_a_run_directory_the_nodes_cannot_see_is_refused_before_anything_runs(tmp_path):
    # .ci/slurm.sh declares a node on another host (down) in partition `elsewhere`
    pipeline = write_pipeline(
        tmp_path,
        """
slurm: {partition: elsewhere}
steps:
  - name: a
    command: [PYTHON, SCENARIO, succeed]
    memory: 64MiB
""",
    )
    partitions = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True).stdout.split()
    if "elsewhere" not in partitions:
        pytest.skip("this cluster has no partition `elsewhere` (.ci/slurm.sh makes one)")
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "slurm")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"the run directory {run_dir}" in lines[0], result.stderr
    assert "cannot see" in lines[0] and "shared" in lines[0]
    assert not (run_dir / "a").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
@pytest.mark.timeout(1200)
def test_the_tiny_demo_runs_end_to_end_under_slurm(tmp_path):
    # Every step of the tiny target's demo file, training cut to 4 steps: what counts is that each
    # step runs as a Slurm job. Slow: the real pipeline file's run under Slurm, in the default
    # suite, runs each of its steps as a job too.
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "pipeline.cli", "run", str(TINY_DEMO), "--run-dir", str(run_dir),
            "--executor", "slurm"]  # fmt: skip
    shorter = {**os.environ, "EYRIE_DEMO_MAX_STEPS": "4"}
    result = subprocess.run(argv, cwd=REPO, env=shorter, capture_output=True, text=True, timeout=1100)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "step 4/4" in (run_dir / ".eyrie" / "logs" / "train" / "attempt-1.stdout.log").read_text()
    attempts = attempts_json(run_dir)
    steps = [s["name"] for s in yaml.safe_load(TINY_DEMO.read_text())["steps"]]
    assert sorted(a["step"] for a in attempts) == sorted(steps)
    assert {a["verdict"] for a in attempts} == {"succeeded"}
    assert all(a["executor"] == "slurm" and a["location"].startswith("slurm job ") for a in attempts)
    assert (run_dir / "train" / "draft" / "model.safetensors").exists()


@pytest.mark.usefixtures("cluster")
def test_each_replica_of_a_service_is_a_job_its_users_reach_on_the_node_it_runs_on(tmp_path):
    server = REPO / "tests" / "scenarios" / "server.py"
    path = write_pipeline(
        tmp_path,
        f"""
services:
  - name: web
    command: [PYTHON, {server}, "${{EYRIE_SERVICE_PORT}}"]
    memory: 128MiB
    replicas: 2
    startup_timeout: 120s
steps:
  - name: ask
    command: [PYTHON, -c, "import os, urllib.request as r; [print(r.urlopen(u + '/').read().decode())
              for u in os.environ['EYRIE_SERVICE_WEB_URLS'].split(',')]"]
    memory: 64MiB
    uses: [web]
""",
    )
    run_dir = tmp_path / "run"
    result = eyrie("run", str(path), "--run-dir", str(run_dir), "--executor", "slurm")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = attempts_json(run_dir)
    replicas = [a for a in rows if a["step"] == "web"]
    assert sorted(a["replica"] for a in replicas) == [1, 2]
    assert all(a["verdict"] == "succeeded" and a["executor"] == "slurm" for a in replicas)
    assert all(a["location"].startswith("slurm job") or a["location"] for a in replicas)
    logs = run_dir / ".eyrie" / "logs"
    addresses = [(logs / "web" / f"attempt-{a['attempt']}.address").read_text().strip() for a in replicas]
    answers = (logs / "ask" / "attempt-1.stdout.log").read_text().splitlines()
    assert len(answers) == 2 and all('"path": "/"' in line for line in answers)
    assert all(f"http://{address}:" in result.stdout for address in addresses)  # the node's own address
    assert _active(run_dir) == []  # every replica's job ended with the run


@pytest.mark.usefixtures("cluster")
def test_the_real_pipeline_file_runs_its_target_service_as_a_job_with_no_server_started_by_hand(tmp_path):
    from pipeline.embedded.tiny import ensure_tiny_target

    target = ensure_tiny_target(tmp_path / "target")
    settings = {**REAL_JOB_CPU_SETTINGS, "EYRIE_TARGET_MODEL": str(target), "EYRIE_CACHE_DIR": str(tmp_path)}
    run_dir = tmp_path / "run"
    rows = run_real_job(run_dir, settings, "--executor", "slurm")
    assert {(a["step"], a["replica"]): a["verdict"] for a in rows} == REAL_JOB_SUCCEEDED
    assert all(a["executor"] == "slurm" and a["location"] for a in rows)  # the target too: a job
    assert _active(run_dir) == []


def _serving_in_job(run_dir: Path) -> int | None:
    """The pid of the server in the target replica's running job, as the node lists it (the one
    node is this host): the process the job's wrapper started (`eyrie serve`, which became the
    server). None before the job runs."""
    if not (run_dir / ".eyrie").exists():
        return None
    jobs = [a["location"].split()[-1] for a in attempts_json(run_dir)
            if a["step"] == "target" and a["verdict"] is None and a["location"]]  # fmt: skip
    for job in jobs:
        listed = subprocess.run(["scontrol", "listpids", job], capture_output=True, text=True).stdout
        parents = {}
        for pid in (int(line.split()[0]) for line in listed.splitlines() if line.split()[0].isdigit()):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            parents[pid] = (int(re.search(r"^PPid:\s+(\d+)", status, re.M).group(1)), argv)
        wrappers = {pid for pid, (_, argv) in parents.items() if b"pipeline.run.container_init" in argv}
        served = [pid for pid, (parent, _) in parents.items() if parent in wrappers]
        if served:
            return served[0]
    return None


@pytest.mark.usefixtures("cluster")
def test_a_replica_job_killed_mid_generate_is_submitted_again_and_no_row_is_lost_or_repeated(tmp_path):
    from pipeline.embedded.tiny import ensure_tiny_target

    target = ensure_tiny_target(tmp_path / "target")
    out = kill_target_mid_generate(tmp_path, target, _serving_in_job, "--executor", "slurm")
    first, second = [a for a in attempts_json(tmp_path / "run") if a["step"] == "target"]
    assert first["location"] != second["location"]  # a job of its own
    assert _active(tmp_path / "run") == [], out


@pytest.mark.usefixtures("cluster")
def test_a_rerun_goes_on_with_the_replica_job_a_killed_runner_left_when_its_command_is_unchanged(tmp_path):
    server = REPO / "tests" / "scenarios" / "server.py"
    # The user asks the server for its pid before and after the runner is killed: the same server.
    ask = tmp_path / "ask.py"
    ask.write_text(
        "import json, os, time, urllib.request\n"
        "url = os.environ['EYRIE_SERVICE_WEB_URLS'] + '/'\n"
        "first = json.load(urllib.request.urlopen(url))['pid']\n"
        "time.sleep(15)\n"
        "print('pids', first, json.load(urllib.request.urlopen(url))['pid'])\n"
    )
    pipeline = write_pipeline(
        tmp_path,
        f"""
services:
  - name: web
    command: [PYTHON, {server}, "${{EYRIE_SERVICE_PORT}}"]
    memory: 128MiB
    startup_timeout: 120s
steps:
  - name: ask
    command: [PYTHON, {ask}]
    memory: 64MiB
    uses: [web]
""",
    )
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)]
    first = subprocess.Popen([*argv, "--executor", "slurm"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    _wait_for_state(run_dir, "ask", "RUNNING")  # the user started: the replica answered
    first.kill()  # the jobs run on without their runner
    first.wait()
    again = eyrie("run", str(pipeline), "--run-dir", str(run_dir), "--executor", "slurm", check=True)
    rows = attempts_json(run_dir)
    replicas = [a for a in rows if a["step"] == "web"]
    assert len(replicas) == 1, rows  # the rerun started no replica of its own
    (replica,) = replicas
    assert replica["verdict"] == "succeeded" and f"found it again ({replica['location']})" in again.stdout
    pids = (run_dir / ".eyrie" / "logs" / "ask" / "attempt-1.stdout.log").read_text().split()
    assert pids[0] == "pids" and pids[1] == pids[2]  # one server answered before and after
    assert _active(run_dir) == []


@pytest.mark.usefixtures("cluster")
@pytest.mark.parametrize(
    ("asks", "says"),
    [
        ("memory: 64TiB", "services[0] (web).memory: 64.00 TiB exceeds the"),
        ("memory: 64MiB\n    gpus: 4096", "services[0] (web).gpus: 4096 per replica, more than the"),
    ],
)
def test_a_replica_larger_than_any_node_is_refused_before_anything_is_submitted(tmp_path, asks, says):
    pipeline = write_pipeline(
        tmp_path,
        f"""
services:
  - name: web
    command: [PYTHON, -m, http.server, "${{EYRIE_SERVICE_PORT}}"]
    {asks}
steps:
  - name: ask
    command: ["true"]
    memory: 16MiB
    uses: [web]
""",
    )
    result = eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"), "--executor", "slurm")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert says in line and ("a replica can have" in line or "a node of Slurm's partition" in line), line
    assert not (tmp_path / "run").exists()  # nothing made, so nothing submitted
