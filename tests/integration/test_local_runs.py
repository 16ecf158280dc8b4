"""Real runs under real cgroups: every verdict, resume, retry, budget, and a killed runner."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyrie_testing import REPO, SCENARIOS, attempts_json, eyrie
from pipeline.run.ledger import Ledger

pytestmark = pytest.mark.usefixtures("real_cgroups")
SCENARIO = REPO / "tests" / "scenarios" / "scenario.py"

EXPECTED = {
    "succeeded": ("succeeded", 0, None),
    "oom_killed": ("oom_killed", None, signal.SIGKILL),
    "child_oom_killed": ("child_oom_killed", 0, None),
    "completed_then_crashed": ("completed_then_crashed", None, signal.SIGABRT),
    "crashed_segfault": ("crashed", None, signal.SIGSEGV),
    "failed": ("failed", 1, None),
    "timed_out": ("timed_out", None, signal.SIGTERM),
    "crashed_kill9": ("crashed", None, signal.SIGKILL),
    "memory_error": ("memory_error", 1, None),
}


def write_pipeline(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(body.replace("SCENARIO", str(SCENARIO)).replace("PYTHON", sys.executable))
    return path


def test_every_scenario_gets_its_verdict(tmp_path):
    result = eyrie("run", str(SCENARIOS), "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr  # some steps fail on purpose
    attempts = {a["step"]: a for a in attempts_json(tmp_path)}
    assert set(attempts) == set(EXPECTED)
    for step, (verdict, exit_code, sig) in EXPECTED.items():
        got = attempts[step]
        assert (got["verdict"], got["exit_code"], got["signal"]) == (verdict, exit_code, sig), got
        assert got["limit_bytes"] == 96 * 2**20
        assert got["peak_bytes"] and got["started_at"] < got["ended_at"]
    assert attempts["oom_killed"]["oom_kills"] == 1
    assert attempts["child_oom_killed"]["oom_kills"] == 1
    assert attempts["crashed_kill9"]["oom_kills"] == 0  # SIGKILL from a process, not the OOM killer
    assert attempts["oom_killed"]["peak_bytes"] >= 90 * 2**20
    assert attempts["oom_killed"]["oom_at"] <= attempts["oom_killed"]["ended_at"] + 1

    oom = eyrie("explain", "oom_killed", "--run-dir", str(tmp_path), check=True).stdout
    assert "OOM-killed" in oom and "oom_kill went 0→1" in oom and "SIGKILL" in oom
    assert "of 96.00 MiB limit" in oom
    child = eyrie("explain", "child_oom_killed", "--run-dir", str(tmp_path), check=True).stdout
    assert "main process was not the one killed" in child
    crashed = eyrie("explain", "crashed_kill9", "--run-dir", str(tmp_path), check=True).stdout
    assert "no OOM kill was counted" in crashed
    failed = eyrie("explain", "failed", "--run-dir", str(tmp_path), check=True).stdout
    assert "ValueError: row 17" in failed
    status = eyrie("status", "--run-dir", str(tmp_path), check=True).stdout
    assert "completed_then_crashed" in status and "SIGABRT" in status


def test_rerun_skips_complete_steps_and_reruns_changed_ones(tmp_path):
    (tmp_path / "input.txt").write_text("v1")
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: first
    command: [PYTHON, SCENARIO, succeed]
    memory: 96MiB
    inputs: [input.txt]
    outputs: [result.txt]
  - name: second
    command: [PYTHON, SCENARIO, succeed]
    memory: 96MiB
    needs: [first]
    outputs: [result.txt]
""",
    )
    run_dir = tmp_path / "run"
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert len(attempts_json(run_dir)) == 2
    again = eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert again.stdout.count("skipped") == 2
    assert len(attempts_json(run_dir)) == 2
    (tmp_path / "input.txt").write_text("v2")
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert [(a["step"], a["attempt"]) for a in attempts_json(run_dir)][2:] == [("first", 2)]
    # `second` reran too only if first's outputs changed; they did not, so it stays up to date
    (run_dir / "second" / "result.txt").write_text("tampered")
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert attempts_json(run_dir)[-1]["step"] == "second"


def test_a_step_whose_child_was_oom_killed_is_not_skipped_on_a_rerun(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: parent
    command: [PYTHON, SCENARIO, child_oom]
    memory: 96MiB
""",
    )
    run_dir = tmp_path / "run"
    assert eyrie("run", str(pipeline), "--run-dir", str(run_dir)).returncode == 1
    again = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert again.returncode == 1 and "skipped" not in again.stdout
    assert [a["verdict"] for a in attempts_json(run_dir)] == ["child_oom_killed"] * 2


def test_oom_retry_raises_the_limit_from_the_peak(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: grows
    command: [PYTHON, SCENARIO, allocate, "120"]
    memory: 64MiB
    retries: 3
    outputs: [result.txt]
""",
    )
    result = eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 0, result.stdout + result.stderr
    attempts = attempts_json(tmp_path / "run")
    verdicts = [a["verdict"] for a in attempts]
    assert verdicts[-1] == "succeeded" and set(verdicts[:-1]) == {"oom_killed"}
    limits = [a["limit_bytes"] for a in attempts]
    assert limits == sorted(limits) and limits[-1] >= 120 * 2**20
    assert "after oom_killed" in attempts[1]["limit_reason"]
    # Each raised limit is said once, in the line that starts the attempt it applies to.
    assert result.stdout.count("limit raised from") == len(attempts) - 1, result.stdout
    assert "grows: retrying after oom_killed" in result.stdout
    # In a pipe the closing line, and the command it suggests, stays one line.
    assert f"see `eyrie status --run-dir {tmp_path / 'run'}`" in result.stdout.splitlines()[-1]


def test_a_step_thrashing_at_its_limit_is_killed_out_of_memory_not_left_to_live_lock(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: thrashes
    command: [PYTHON, SCENARIO, thrash, "200", "240"]
    memory: 256MiB
    retries: 0
    outputs: [result.txt]
""",
    )
    started = time.monotonic()
    result = eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"), timeout=200)
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - started < 120  # not the scenario's own 240 s
    [attempt] = attempts_json(tmp_path / "run")
    assert (attempt["verdict"], attempt["signal"], attempt["oom_kills"]) == ("oom_killed", signal.SIGKILL, 0)
    assert "the runner killed it out of memory" in attempt["reason"]
    assert "thrashing" in attempt["reason"] and "of its 256.00 MiB limit" in attempt["reason"]


def test_failed_step_is_not_retried_blindly_and_blocks_dependents(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: broken
    command: [PYTHON, SCENARIO, exception]
    memory: 64MiB
    retries: 3
  - name: after
    command: [PYTHON, SCENARIO, succeed]
    memory: 64MiB
    needs: [broken]
""",
    )
    result = eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 1
    assert [a["step"] for a in attempts_json(tmp_path / "run")] == ["broken"]
    assert "not run: broken ended failed" in result.stdout
    assert "blocked" in eyrie("status", "--run-dir", str(tmp_path / "run"), check=True).stdout


def test_parallel_steps_stay_within_the_budget(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
budget: 200MiB
steps:
"""
        + "".join(
            f"""  - name: s{i}
    command: [PYTHON, SCENARIO, allocate, "20"]
    memory: 96MiB
    outputs: [result.txt]
"""
            for i in range(4)
        ),
    )
    eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"), check=True)
    attempts = attempts_json(tmp_path / "run")
    events = sorted([(a["started_at"], 1) for a in attempts] + [(a["ended_at"], -1) for a in attempts])
    concurrent = peak = 0
    for _, delta in events:
        concurrent += delta
        peak = max(peak, concurrent)
    assert peak == 2  # two 96 MiB steps fit in 200 MiB, three do not


def test_a_step_larger_than_the_budget_is_refused_up_front(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
budget: 100MiB
steps:
  - name: huge
    command: [PYTHON, SCENARIO, succeed]
    memory: 1GiB
""",
    )
    result = eyrie("run", str(pipeline), "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert "huge" in result.stderr and "exceeds" in result.stderr


def test_a_killed_runner_leaves_a_ledger_that_says_so(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: slow
    command: [PYTHON, SCENARIO, sleep]
    memory: 64MiB
""",
    )
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (run_dir / "ledger.sqlite").exists():
            rows = attempts_json(run_dir)
            if rows and rows[0]["pid"]:
                break
        time.sleep(0.2)
    else:
        pytest.fail("the step never started")
    step_pid = rows[0]["pid"]
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    os.kill(step_pid, 0)  # the orphaned step still runs in its cgroup
    assert attempts_json(run_dir)[0]["state"] == "running"
    assert "running (pid" in eyrie("status", "--run-dir", str(run_dir), check=True).stdout

    (pipeline).write_text(pipeline.read_text().replace("sleep]", "succeed]"))
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert "stopped before this attempt ended" in result.stdout
    first, second = attempts_json(run_dir)
    assert first["verdict"] == "cancelled" and "1 leftover process(es) killed" in first["reason"]
    assert second["verdict"] == "succeeded"
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(step_pid, 0)
            time.sleep(0.1)


def test_sigterm_cancels_running_steps(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: slow
    command: [PYTHON, SCENARIO, sleep]
    memory: 64MiB
  - name: later
    command: [PYTHON, SCENARIO, succeed]
    memory: 64MiB
    needs: [slow]
""",
    )
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    for line in runner.stdout:
        if "▶ attempt 1" in line:
            break
    time.sleep(0.5)
    runner.send_signal(signal.SIGTERM)
    output = runner.communicate(timeout=60)[0]
    assert runner.returncode == 130, output
    (attempt,) = attempts_json(run_dir)
    assert attempt["verdict"] == "cancelled"


def test_a_plain_script_declares_its_outputs_complete_with_eyrie_manifest(tmp_path):
    """The seeds' case in a shell: outputs written, then a crash at teardown. Declared complete first,
    it is completed_then_crashed and the pipeline goes on; undeclared, it is crashed, and explain
    says the outputs are there and how to declare them."""
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: declared
    command: [sh, -c, "echo x > out.txt && eyrie manifest out.txt && kill -ABRT $$"]
    memory: 96MiB
    outputs: [out.txt]
  - name: after
    command: [sh, -c, "cat ../declared/out.txt > copy.txt"]
    memory: 96MiB
    needs: [declared]
    outputs: [copy.txt]
  - name: undeclared
    command: [sh, -c, "echo x > out.txt && mkdir -p parts && echo y > parts/a.txt && kill -ABRT $$"]
    memory: 96MiB
    outputs: [out.txt, parts]
""",
    )
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert result.returncode == 1, result.stdout + result.stderr  # `undeclared` crashed
    attempts = {a["step"]: a for a in attempts_json(run_dir)}
    assert attempts["declared"]["verdict"] == "completed_then_crashed"
    assert attempts["declared"]["signal"] == signal.SIGABRT
    assert attempts["after"]["verdict"] == "succeeded"
    assert attempts["undeclared"]["verdict"] == "crashed"
    assert attempts["undeclared"]["outputs"] == ["out.txt", "parts"]  # as the run declared them

    # explain reads the ledger alone: the pipeline file edited since, its ${VAR} unset, changes nothing
    pipeline.write_text("steps:\n  - name: undeclared\n    command: [sh, -c, '${UNSET_SINCE}']\n")
    explained = " ".join(eyrie("explain", "undeclared", "--run-dir", str(run_dir), check=True).stdout.split())
    assert (
        "Every declared output was written during this attempt, but no manifest.json says they are complete"
        in explained
    )
    assert "out.txt (2 B, last written " in explained and "parts (2 B, last written " in explained
    assert "`eyrie manifest out.txt parts`" in explained and "completed_then_crashed" in explained
    declared = eyrie("explain", "declared", "--run-dir", str(run_dir), check=True).stdout
    assert "Every declared output" not in declared


def _cgroup_for_another_shell(name: str):
    """A memory cgroup beside this process's own, as another SSH session or systemd scope has."""
    from pipeline.memory import current_cgroup
    from pipeline.memory.cgroup import SUPERVISOR_LEAF

    own = current_cgroup()
    if own.path.name == SUPERVISOR_LEAF:  # v2: this process was moved into the leaf, steps beside it
        own = own.parent()
    other = own.child(name)
    other.create()
    return other


def _remove_tree(path: Path) -> None:
    """Remove a cgroup and those below it, deepest first (a cgroup still holding processes stays)."""
    for folder in [*sorted((p for p in path.rglob("*") if p.is_dir()), reverse=True), path]:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _start_then_kill_the_runner(pipeline: Path, run_dir: Path) -> int:
    """`eyrie run` until its step runs, then SIGKILL to the runner alone; the step's pid."""
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (run_dir / "ledger.sqlite").exists() and (rows := attempts_json(run_dir)) and rows[0]["pid"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail("the step never started")
    runner.send_signal(signal.SIGKILL)
    runner.wait()
    return rows[0]["pid"]


def _run_in(cgroup, *args: str) -> subprocess.CompletedProcess:
    """`eyrie ARGS…` started inside ``cgroup``."""
    return subprocess.run(
        [
            "sh",
            "-c",
            'echo $$ > "$0/cgroup.procs" && exec "$@"',
            str(cgroup.path),
            sys.executable,
            "-m",
            "pipeline.cli",
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


SLOW_STEP = """
steps:
  - name: slow
    command: [PYTHON, SCENARIO, sleep]
    memory: 64MiB
"""


def test_a_rerun_from_another_cgroup_ends_the_step_a_killed_runner_left(tmp_path):
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    step_pid = _start_then_kill_the_runner(pipeline, run_dir)
    left_in = Path(attempts_json(run_dir)[0]["location"])
    assert left_in.is_dir()
    other = _cgroup_for_another_shell(f"other-shell-{os.getpid()}")
    try:
        pipeline.write_text(pipeline.read_text().replace("sleep]", "succeed]"))
        result = _run_in(other, "run", str(pipeline), "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stdout + result.stderr
        first, second = attempts_json(run_dir)
        assert first["verdict"] == "cancelled" and "1 leftover process(es) killed" in first["reason"]
        assert second["verdict"] == "succeeded" and Path(second["location"]).parent != left_in.parent
        with pytest.raises(ProcessLookupError):
            for _ in range(50):
                os.kill(step_pid, 0)
                time.sleep(0.1)
        assert not left_in.exists()
    finally:
        _remove_tree(other.path)


def test_a_step_that_cannot_be_stopped_is_not_started_again(tmp_path):
    """A process that outlives SIGKILL (here: frozen by the v1 freezer, as in uninterruptible
    sleep) keeps its attempt 'running'; the next run refuses, naming it, and starts nothing."""
    freezer_root = Path("/sys/fs/cgroup/freezer")
    if not (freezer_root / "freezer.state").exists() and not (freezer_root / "cgroup.procs").exists():
        pytest.skip("no cgroup v1 freezer here (a v2 freezer lets SIGKILL through)")
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    step_pid = _start_then_kill_the_runner(pipeline, run_dir)
    frozen = freezer_root / f"eyrie-test-frozen-{os.getpid()}"
    frozen.mkdir()
    other = _cgroup_for_another_shell(f"other-shell-{os.getpid()}")
    try:
        (frozen / "cgroup.procs").write_text(str(step_pid))
        (frozen / "freezer.state").write_text("FROZEN")
        result = _run_in(other, "run", str(pipeline), "--run-dir", str(run_dir))
        assert result.returncode == 2, result.stdout + result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert f"slow attempt 1 of an earlier run: process(es) {step_pid} (" in line
        assert "still run after SIGKILL" in line
        (attempt,) = attempts_json(run_dir)  # nothing started beside it
        assert attempt["state"] == "running"

        (frozen / "freezer.state").write_text("THAWED")  # the pending SIGKILL now ends it
        pipeline.write_text(pipeline.read_text().replace("sleep]", "succeed]"))
        result = _run_in(other, "run", str(pipeline), "--run-dir", str(run_dir))
        assert result.returncode == 0, result.stdout + result.stderr
        first, second = attempts_json(run_dir)
        assert first["verdict"] == "cancelled" and second["verdict"] == "succeeded"
    finally:
        (frozen / "freezer.state").write_text("THAWED")
        for _ in range(50):
            if not (frozen / "cgroup.procs").read_text().split():
                break
            time.sleep(0.1)
        frozen.rmdir()
        _remove_tree(other.path)


def test_a_file_added_to_a_folder_output_runs_its_step_and_the_next_again(tmp_path):
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: gen
    command: [sh, -c, "mkdir -p dir && echo a > dir/a.txt && echo b > dir/.b"]
    memory: 64MiB
    outputs: [dir]
  - name: use
    command: [sh, -c, "cat ../gen/dir/* > all.txt"]
    memory: 64MiB
    needs: [gen]
    outputs: [all.txt]
""",
    )
    run_dir = tmp_path / "run"
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
    assert eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True).stdout.count("skipped") == 2
    for stray in ("c.txt", ".hidden"):
        (run_dir / "gen" / "dir" / stray).write_text("extra\n")
        again = eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)
        assert "skipped" not in again.stdout, again.stdout
        (run_dir / "gen" / "dir" / stray).unlink()  # gone again: gen writes no such file
    assert [a["step"] for a in attempts_json(run_dir)] == ["gen", "use"] * 3


def _start_runner(
    pipeline: Path, run_dir: Path, wrapper: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int]:
    """`eyrie run` (under ``wrapper``, e.g. nohup) until its step runs: the runner and the step's pid.

    The runner starts with SIGHUP's default action, whatever the suite inherited: a suite run under
    nohup would otherwise start every runner as if under nohup."""
    runner = subprocess.Popen(
        [*wrapper, sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (run_dir / "ledger.sqlite").exists() and (rows := attempts_json(run_dir)) and rows[0]["pid"]:
            return runner, rows[0]["pid"]
        time.sleep(0.2)
    runner.kill()
    pytest.fail("the step never started")


def test_a_removed_lock_does_not_let_a_second_runner_reap_a_live_run(tmp_path):
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    runner, step_pid = _start_runner(pipeline, run_dir)
    try:
        (run_dir / ".eyrie" / "lock").unlink()
        second = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
        assert second.returncode == 2, second.stdout + second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert f"{run_dir} is in use by eyrie pid {runner.pid}, running " in line
        assert "lock" in line and "was removed" in line
        os.kill(step_pid, 0)  # the live run's step was left alone
        (attempt,) = attempts_json(run_dir)
        assert attempt["state"] == "running" and attempt["pid"] == step_pid
    finally:
        runner.send_signal(signal.SIGTERM)
        output = runner.communicate(timeout=60)[0]
    assert runner.returncode == 130, output  # the first runner went on, and ends its run itself
    (attempt,) = attempts_json(run_dir)
    assert attempt["verdict"] == "cancelled" and "stopped before this attempt ended" not in attempt["reason"]


def test_status_and_explain_say_a_killed_runner_is_gone(tmp_path):
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    runner, _ = _start_runner(pipeline, run_dir)
    runner.kill()
    runner.communicate()
    time.sleep(2.5)  # past the sign of life a live runner writes each second
    gone = rf"the runner \(pid {runner.pid} on \S+\) is gone since \d\d:\d\d:\d\d, its last sign of life"
    status = " ".join(eyrie("status", "--run-dir", str(run_dir), check=True).stdout.split())
    assert re.search(gone, status) and "rerun to resume" in status, status
    explained = " ".join(eyrie("explain", "slow", "--run-dir", str(run_dir), check=True).stdout.split())
    assert re.search(gone.replace("the runner", "The runner"), explained), explained
    assert "rerun to resume" in explained
    pipeline.write_text(pipeline.read_text().replace("sleep]", "succeed]"))
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True)  # ends the orphaned step
    assert "is gone" not in eyrie("status", "--run-dir", str(run_dir), check=True).stdout


@pytest.mark.parametrize(
    "sig,said", [(signal.SIGINT, "Ctrl-C (SIGINT) to eyrie run"), (signal.SIGTERM, "SIGTERM to eyrie run")]
)
def test_a_cancelled_attempt_says_what_cancelled_it(tmp_path, sig, said):
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    runner, _ = _start_runner(pipeline, run_dir)
    runner.send_signal(sig)
    output = runner.communicate(timeout=60)[0]
    assert runner.returncode == 130, output
    (attempt,) = attempts_json(run_dir)
    assert attempt["verdict"] == "cancelled" and attempt["reason"].startswith(f"cancelled by {said}; ")
    assert f"cancelled by {said}" in eyrie("explain", "slow", "--run-dir", str(run_dir), check=True).stdout


def test_sighup_stops_the_run_as_sigterm_does(tmp_path):
    """An SSH session that drops sends SIGHUP: the run is recorded cancelled, not left running."""
    pipeline = write_pipeline(tmp_path, SLOW_STEP)
    run_dir = tmp_path / "run"
    runner, step_pid = _start_runner(pipeline, run_dir)
    runner.send_signal(signal.SIGHUP)
    output = runner.communicate(timeout=60)[0]
    assert runner.returncode == 130, output
    assert "SIGHUP: stopping the running steps" in output
    (attempt,) = attempts_json(run_dir)
    assert attempt["verdict"] == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.kill(step_pid, 0)


def test_under_nohup_sighup_leaves_the_run_going(tmp_path):
    pipeline = write_pipeline(tmp_path, SLOW_STEP.replace("sleep]", "hold, '10', '3']"))
    run_dir = tmp_path / "run"
    runner, _ = _start_runner(pipeline, run_dir, wrapper=("nohup",))
    runner.send_signal(signal.SIGHUP)
    output = runner.communicate(timeout=60)[0]
    assert runner.returncode == 0, output
    (attempt,) = attempts_json(run_dir)
    assert attempt["verdict"] == "succeeded"


def test_a_secret_given_through_env_stays_out_of_the_ledger_and_the_report(tmp_path):
    """As docs/running.md says: a ${NAME} in `command` is the argv, kept in the ledger
    by design; one in `env` reaches the step and nothing eyrie keeps."""
    secret = f"s3cr3t-{os.getpid()}"
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: call
    command: [sh, -c, 'test "$API_KEY" = "$EXPECTED" && echo called']
    memory: 64MiB
    env: {API_KEY: "${API_KEY}", EXPECTED: "${API_KEY}"}
  - name: leaky
    command: [echo, "${API_KEY}"]
    memory: 64MiB
    needs: [call]
""",
    )
    run_dir = tmp_path / "run"
    eyrie("run", str(pipeline), "--run-dir", str(run_dir), check=True, settings={"API_KEY": secret})
    call, leaky = attempts_json(run_dir)
    assert call["verdict"] == "succeeded" and secret not in json.dumps(call)
    assert leaky["argv"] == ["echo", secret]  # in the command: the argv, recorded as run
    pipeline.write_text(pipeline.read_text().split("  - name: leaky")[0])
    clean = tmp_path / "clean"
    eyrie("run", str(pipeline), "--run-dir", str(clean), check=True, settings={"API_KEY": secret})
    eyrie("report", "--run-dir", str(clean), check=True)
    kept = [p for p in clean.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert kept == [] and secret not in eyrie("status", "--json", "--run-dir", str(clean)).stdout


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MiB filesystem of its own (a tmpfs, as root here and in CI) for a run directory."""
    mount = tmp_path / "small"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_ends_the_attempt_with_a_verdict_that_says_so(small_disk, tmp_path):
    """A step writes 4 MiB into a 2 MiB run directory, then prints on: its pipe is drained though its
    log cannot be written, the ledger records why, and nothing is left 'running'."""
    pipeline = write_pipeline(
        tmp_path,
        """
steps:
  - name: gen
    command: [sh, -c, "dd if=/dev/zero of=big bs=1M count=4; seq 1 50000 >&2; exit 1"]
    memory: 64MiB
    timeout: 60s
  - name: after
    command: ["true"]
    memory: 64MiB
    needs: [gen]
""",
    )
    started = time.monotonic()
    result = eyrie("run", str(pipeline), "--run-dir", str(small_disk), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - started < 30  # never waits out the step's timeout on a full pipe
    assert "Traceback" not in result.stderr and result.stderr.strip() == "", result.stderr
    (said,) = [line for line in result.stdout.splitlines() if line.startswith("gen ✗")]
    assert "no space left on device" in said
    (gen,) = [a for a in attempts_json(small_disk) if a["step"] == "gen"]
    assert gen["verdict"] == "failed" and gen["state"] == "ended"
    assert re.search(
        rf"no space left on device under {small_disk}/gen: {small_disk} had [\d.]+ \w?i?B free of 2\.00 MiB "
        rf"when it ended.*its stderr log {small_disk}/\.eyrie/logs/gen/attempt-1\.stderr\.log was cut short",
        gen["reason"],
    ), gen["reason"]
    assert gen["stderr_tail"][-1] == "50000"  # read to its end, though not kept in the log
    status = eyrie("status", "--json", "--run-dir", str(small_disk), check=True)
    assert '"state": "running"' not in status.stdout
    ledger = Ledger(small_disk, create=False)
    assert ledger.latest_run()["state"] == "failed"
    ledger.close()
    (small_disk / "gen" / "big").unlink()  # space again: the next run starts, and runs gen again
    pipeline.write_text(pipeline.read_text().replace("count=4", "count=1").replace("exit 1", "exit 0"))
    assert eyrie("run", str(pipeline), "--run-dir", str(small_disk)).returncode == 0


@pytest.mark.parametrize("left", [0, 128 << 10], ids=["nothing left", "less than the ledger's reserve"])
def test_a_run_directory_with_no_space_left_is_refused_in_one_line(small_disk, tmp_path, left):
    pipeline = write_pipeline(tmp_path, 'steps:\n  - name: a\n    command: ["true"]\n    memory: 64MiB\n')
    filler = small_disk / "filler"
    with open(filler, "wb") as fh, contextlib.suppress(OSError):
        fh.write(bytes((2 << 20) - left))
    result = eyrie("run", str(pipeline), "--run-dir", str(small_disk / "run"))
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    free = rf"{small_disk} had [\d.]+ \w?i?B free of 2\.00 MiB"
    assert re.search(rf"no space left on device.*{free}", line), line
    assert "free some space, then run again" in line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # nothing half-made
