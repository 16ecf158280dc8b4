"""`eyrie explain` on what the host had when a step died, on stderr frames, and on which run it reads."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyrie_testing import REPO, eyrie, eyrie_in_small_cgroup
from pipeline.memory import read_meminfo
from pipeline.run.ledger import HostSample, Ledger

MIB, GIB = 2**20, 2**30


def test_two_jobs_dead_beside_a_server_on_a_roomy_host_were_not_out_of_memory(neighbours_run):
    for step, verdict in (("prep-a", "Completed, then crashed"), ("prep-b", "Crashed")):
        out = eyrie("explain", step, "--run-dir", str(neighbours_run), check=True).stdout
        assert verdict in out, out
        assert re.search(
            r"At \d\d:\d\d:\d\d, when it ended, the host had [\d.]+ [GM]iB in use and "
            r"[\d.]+ GiB MemAvailable of [\d.]+ GiB\.",
            out,
        ), out
        beside = re.search(r"Beside it ran: (.*)\n", out).group(1)
        server = re.search(r"server ([\d.]+) MiB of its 256\.00 MiB limit", beside)
        assert server and 140 <= float(server.group(1)) <= 256, beside  # the server held 150 MiB
        assert "Memory was not short" in out and "memory did not end it" in out, out
        assert "Over its own limit" not in out and "host was full" not in out
    grows = eyrie("explain", "grows", "--run-dir", str(neighbours_run), check=True).stdout
    assert "when its OOM kill was counted" in grows
    assert (
        "Over its own limit: its memory, page cache included, reached 128.00 MiB of its 128.00 MiB limit"
        in grows
    )
    assert "Raise its memory (the step's memory:) or make it use less." in grows
    assert "Beside it ran: server" in grows


# The seed's incident: a prep writes all it has, then aborts at teardown at a quarter of its limit.
ABORTS_AT_TEARDOWN = """
steps:
  - name: prep
    command: [PYTHON, SCENARIO, hold, "40", "1", write_then_abort]
    memory: 160MiB
    outputs: [result.txt]
"""
SMALL_RUNNER = 512 * MIB  # the runner's own cgroup: far below a roomy host's memory


@pytest.mark.usefixtures("real_cgroups")
def test_a_runner_in_a_small_cgroup_on_a_roomy_host_does_not_call_the_host_full(tmp_path):
    if SMALL_RUNNER >= 0.05 * read_meminfo()["MemTotal"]:
        pytest.skip("this host is too small for a runner's cgroup to be far below its memory")
    pipeline = tmp_path / "p.yaml"
    scenario = str(REPO / "tests" / "scenarios" / "scenario.py")
    pipeline.write_text(ABORTS_AT_TEARDOWN.replace("PYTHON", sys.executable).replace("SCENARIO", scenario))
    run = eyrie_in_small_cgroup(SMALL_RUNNER, "run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert run.returncode == 0, run.stdout + run.stderr  # its outputs are complete: the run goes on
    out = eyrie("explain", "prep", "--run-dir", str(tmp_path / "run"), check=True).stdout
    assert "Completed, then crashed" in out, out
    # The steps share the runner's cgroup: it is what is judged, against its own limit.
    assert re.search(r"the cgroups eyrie runs in left it [\d.]+ MiB of their 512\.00 MiB limit", out), out
    assert "Memory was not short" in out and "the cgroup eyrie runs in had" in out, out
    assert "was full" not in out, out


def _recorded_run(
    run_dir: Path, *, host_available: int, with_host: bool = True, executor: str = "local"
) -> None:
    """A ledger as a runner writes it: a server at 12 GiB and a job killed beside it at t0 + 10 s."""
    ledger = Ledger(run_dir)
    t0 = time.time() - 60
    elsewhere = executor == "slurm"  # its steps run on nodes the runner does not see
    ledger.start_run(
        "r1", "p.yaml", executor, ["server", "job"], 15 * GIB, "MemAvailable", host_sampled=not elsewhere
    )
    killed = "the main process died of SIGKILL, and no OOM kill was counted in its cgroup"
    for step, limit, usage, seconds, verdict, reason, exit_code, signal in (
        ("server", 14 * GIB, 12 * GIB, 30, "succeeded", "exit 0", 0, None),
        ("job", 2 * GIB, 300 * MIB, 10, "crashed", killed, None, 9),
    ):
        attempt = ledger.begin_attempt(
            run_id="r1",
            step=step,
            attempt=1,
            executor=executor,
            limit_bytes=limit,
            limit_reason=None,
            argv=["x"],
            image=None,
            commit_id=None,
            host_mem_available=None if elsewhere else 15 * GIB,
            host_mem_total=None if elsewhere else 16 * GIB,
        )
        ledger.end_attempt(
            attempt,
            verdict=verdict,
            reason=reason,
            fields={
                "started_at": t0,
                "ended_at": t0 + seconds,
                "peak_bytes": usage,
                "anon_peak_bytes": usage,
                "exit_code": exit_code,
                "signal": signal,
            },
            timeline=[(float(s), usage, usage) for s in range(1, seconds + 1)],
        )
    if with_host:
        for s in range(31):
            available = host_available if 8 <= s <= 11 else 3 * GIB
            ledger.add_host_sample("r1", HostSample(t0 + s, 16 * GIB, available, available))
    ledger.end_run("r1", "failed")
    ledger.close()


def test_a_job_killed_while_the_host_was_full_is_told_apart_from_its_own_limit(tmp_path):
    _recorded_run(tmp_path, host_available=200 * MIB)
    out = eyrie("explain", "job", "--run-dir", str(tmp_path), check=True).stdout
    assert "the host had 15.80 GiB in use and 200.00 MiB MemAvailable of 16.00 GiB" in out, out
    assert "Beside it ran: server 12.00 GiB of its 14.00 GiB limit" in out
    assert "The host was full because of something else" in out and "the largest beside it: server" in out
    roomy = tmp_path / "roomy"
    _recorded_run(roomy, host_available=9 * GIB)
    out = eyrie("explain", "job", "--run-dir", str(roomy), check=True).stdout
    assert "Memory was not short" in out and "host was full" not in out, out


def test_steps_on_a_cluster_s_nodes_are_not_judged_by_the_runner_s_host(tmp_path):
    _recorded_run(tmp_path, host_available=0, with_host=False, executor="slurm")
    out = eyrie("explain", "job", "--run-dir", str(tmp_path), check=True).stdout
    assert "it ran on a node of the cluster (slurm executor" in out, out
    assert "only its own limit can be judged" in out and "its own limit did not stop it" in out, out
    assert "host had" not in out and "was full" not in out and "Beside it ran" not in out, out
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    chart = (tmp_path / "report.html").read_text()
    assert "Host memory: not sampled — the steps ran on the cluster&#x27;s nodes" in chart or (
        "Host memory: not sampled — the steps ran on the cluster's nodes" in chart
    ), chart
    assert 'data-series="host-' not in chart  # no host panel, nor steps stacked on the login node
    assert 'data-series="steps-job"' in chart


def test_a_ledger_written_before_host_sampling_is_still_read(tmp_path):
    _recorded_run(tmp_path, host_available=0, with_host=False)
    db = sqlite3.connect(tmp_path / "ledger.sqlite")
    db.execute("DROP TABLE host_samples")  # as a ledger of an earlier eyrie is
    for table, column in (("runs", "host_sampled"), ("runs", "heartbeat_at"), ("attempts", "outputs")):
        db.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
    db.commit()
    db.close()
    out = eyrie("explain", "job", "--run-dir", str(tmp_path), check=True).stdout
    assert "no record of the host's memory then" in out and "Beside it ran: server" in out, out
    assert "job" in eyrie("status", "--run-dir", str(tmp_path), check=True).stdout
    eyrie("report", "--run-dir", str(tmp_path), check=True)
    assert "no samples of the host" in (tmp_path / "report.html").read_text()


def _ledger_with_run(run_dir: Path, run_id: str) -> None:
    ledger = Ledger(run_dir)
    ledger.start_run(run_id, f"{run_id}.yaml", "local", ["prep"], GIB, "MemAvailable")
    attempt = ledger.begin_attempt(
        run_id=run_id,
        step="prep",
        attempt=1,
        executor="local",
        limit_bytes=64 * MIB,
        limit_reason=None,
        argv=["x"],
        host_mem_available=GIB,
        host_mem_total=2 * GIB,
        image=None,
        commit_id=None,
    )
    ledger.end_attempt(
        attempt, verdict="succeeded", reason=f"exit 0 in {run_id}", fields={"exit_code": 0}, timeline=[]
    )
    ledger.end_run(run_id, "succeeded")
    ledger.close()


def _eyrie_in(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )


def test_without_run_dir_the_most_recent_run_under_runs_is_read_and_named(tmp_path):
    _ledger_with_run(tmp_path / "runs" / "b-older", "older")
    time.sleep(0.05)
    _ledger_with_run(tmp_path / "runs" / "a-newer", "newer")  # first by name, last by time
    (tmp_path / "runs" / "broken").mkdir()
    (tmp_path / "runs" / "broken" / "ledger.sqlite").write_text("not a database")
    named = "the most recent run is in runs/a-newer (pass --run-dir for another)"
    status = _eyrie_in(tmp_path, "status")
    assert status.returncode == 0 and named in status.stderr, status.stderr
    assert "run newer" in status.stdout and "older" not in status.stdout
    explain = _eyrie_in(tmp_path, "explain", "prep")
    assert explain.returncode == 0 and "exit 0 in newer" in explain.stdout and named in explain.stderr
    report = _eyrie_in(tmp_path, "report")
    assert report.returncode == 0 and named in report.stderr
    assert (tmp_path / "runs" / "a-newer" / "report.html").is_file()


def test_without_run_dir_and_no_run_it_says_how_to_make_one(tmp_path):
    for command in (["status"], ["explain", "prep"], ["report"], ["status", "--follow"]):
        result = _eyrie_in(tmp_path, *command)
        assert result.returncode == 2, result
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert lines == [
            "error: no run under runs/: run a pipeline first (`eyrie run FILE`), or pass --run-dir"
        ]
