"""A job run as a plain process tree ends whole: no compiler child outlives a stop or its parent."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from pipeline.build.unconfined import UnconfinedExecutor
from pipeline.run.executor import Launch
from pipeline.run.verdict import Verdict, decide


def launch(tmp_path: Path, script: str) -> Launch:
    return Launch(run_id="r", step="job", attempt=1, argv=["sh", "-c", script], cwd=tmp_path, env={},
                  limit_bytes=2**30, stdout_path=tmp_path / "out", stderr_path=tmp_path / "err")  # fmt: skip


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
