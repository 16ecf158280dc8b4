"""A job run as a plain process tree ends whole: no compiler child outlives a stop or its parent."""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.compile.unconfined import UnconfinedExecutor
from pipeline.run.executor import Launch
from pipeline.run.verdict import Verdict, decide


def launch(tmp_path: Path, script: str) -> Launch:
    return Launch(
        run_id="r",
        step="job",
        attempt=1,
        argv=["sh", "-c", script],
        cwd=tmp_path,
        env={},
        limit_bytes=2**30,
        stdout_path=tmp_path / "out",
        stderr_path=tmp_path / "err",
    )


def child_pid(tmp_path: Path) -> int:
    """The pid the job's shell wrote for its background child."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = (tmp_path / "child.pid").read_text() if (tmp_path / "child.pid").exists() else ""
        if text.endswith("\n"):
            return int(text)
        time.sleep(0.02)
    raise AssertionError("the job never started its child")


def running(pid: int) -> bool:
    """Alive and not a zombie awaiting its reaper."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state == "Z":
            return False
        time.sleep(0.02)
    return True


def test_stop_ends_the_children_too_and_is_recorded_as_cancelled(tmp_path: Path) -> None:
    attempt = UnconfinedExecutor().start(launch(tmp_path, "sleep 300 & echo $! > child.pid; wait"))
    child = child_pid(tmp_path)
    attempt.stop("cancel")
    outcome = attempt.wait(10)
    assert outcome is not None and outcome.signal == signal.SIGTERM
    assert not running(child)
    # Recorded as the broker's stop, not as a crash by SIGTERM.
    assert decide(outcome, False, "no object file").verdict == Verdict.CANCELLED


def test_children_left_behind_by_the_main_process_end_with_the_job(tmp_path: Path) -> None:
    attempt = UnconfinedExecutor().start(launch(tmp_path, "sleep 300 & echo $! > child.pid"))
    child = child_pid(tmp_path)
    outcome = attempt.wait(10)
    assert outcome is not None and outcome.exit_code == 0
    assert not running(child)


@pytest.mark.parametrize(
    ("script", "verdict"),
    [
        ("exit 0", Verdict.SUCCEEDED),  # another job's compiler was the one killed
        ("exit 1", Verdict.FAILED),  # a compile error while another job was killed
        ("kill -9 $$", Verdict.OOM_KILLED),
        ("sh -c 'kill -9 $$'; exit $?", Verdict.CHILD_OOM_KILLED),  # how nvcc reports a killed cicc: 137
    ],
)
def test_the_shared_oom_counter_counts_only_against_a_job_that_lost_a_process_to_sigkill(
    tmp_path: Path, script: str, verdict: Verdict
) -> None:
    executor = UnconfinedExecutor()
    # The builder's cgroup, shared by every job: its oom_kill counter rises during each attempt.
    executor.enclosing = SimpleNamespace(
        path=Path("/sys/fs/cgroup/builder"), oom_kills=itertools.count(3).__next__
    )
    outcome = executor.start(launch(tmp_path, script)).wait(10)
    assert outcome is not None
    assert decide(outcome, outcome.exit_code == 0, "object file written").verdict == verdict
