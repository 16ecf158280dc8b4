"""`eyrie status --follow` while a real run goes on: from another process, as JSON lines and in a terminal."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eyrie_testing import REPO, eyrie
from pipeline.run.host_sampler import HostSampler
from pipeline.run.ledger import LEDGER_NAME, HostSample, Ledger

pytestmark = pytest.mark.usefixtures("real_cgroups")
MIB = 2**20

# A step that prints a line and grows a little every 0.7 s, and a quiet one beside it.
PIPELINE = """
steps:
  - name: talker
    command: [PYTHON, -u, -c, "import time\\nheld = []\\nfor i in range(8):\\n    held.append(b'1' * (16 * 2**20))\\n    print(f'row {i} of 8')\\n    time.sleep(0.7)"]
    memory: 256MiB
  - name: quiet
    command: [PYTHON, -c, "import time; held = b'1' * (64 * 2**20); time.sleep(3)"]
    memory: 96MiB
"""  # noqa: E501


def start_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """`eyrie run` in the background; returns once its ledger holds the run."""
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(PIPELINE.replace("PYTHON", sys.executable))
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if (run_dir / LEDGER_NAME).exists():
            ledger = Ledger(run_dir, create=False)
            try:
                if ledger.latest_run():
                    return runner, run_dir
            except sqlite3.OperationalError:
                pass  # created a moment ago, its tables not yet
            finally:
                ledger.close()
        time.sleep(0.1)
    runner.kill()
    raise AssertionError("the run did not start within 30 s")


def test_follow_json_lines_show_each_step_live_and_end_with_the_run(tmp_path):
    runner, run_dir = start_run(tmp_path)
    try:
        result = eyrie("status", "--follow", "--json", "--run-dir", str(run_dir), timeout=60)
    finally:
        runner.wait(60)
    assert result.returncode == 0, result.stderr
    views = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(views) >= 3 and all(not v["ended"] for v in views[:-1]) and views[-1]["ended"]
    assert views[-1]["state"] == "succeeded"
    assert {s["step"]: s["verdict"] for s in views[-1]["steps"]} == {
        "talker": "succeeded",
        "quiet": "succeeded",
    }
    talking = [s for v in views for s in v["steps"] if s["step"] == "talker" and s["state"] == "running"]
    assert talking, "the talker was never seen running"
    seen = talking[-1]
    assert 16 * MIB <= seen["usage_bytes"] <= seen["limit_bytes"] == 256 * MIB, seen
    assert seen["peak_bytes"] >= seen["usage_bytes"] and seen["elapsed_s"] > 0
    assert seen["last_line"].startswith("row ") and seen["last_line"].endswith(" of 8"), seen
    live = next(v for v in views if v["reserved_bytes"])
    assert live["host"]["mem_total"] >= live["host"]["mem_available"] >= live["host"]["available"] > 0
    assert live["budget_bytes"] > 0 and live["reserved_bytes"] in (256 * MIB, 352 * MIB)


def test_follow_in_a_terminal_redraws_and_leaves_the_final_table(tmp_path):
    runner, run_dir = start_run(tmp_path)
    primary, secondary = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
    follower = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "status", "--follow", "--run-dir", str(run_dir)],
        cwd=REPO,
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    screen = b""
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # the terminal closed: the follower ended
                    break
                if not chunk:
                    break
                screen += chunk
            elif follower.poll() is not None:
                break
        assert follower.wait(10) == 0
    finally:
        os.close(primary)
        runner.wait(60)
    text = screen.decode("utf-8", errors="replace")
    assert "\x1b[" in text and "\x1b[1A" in text, "not drawn as a live view (no cursor movement)"
    assert "running" in text and "━" in text, "no step seen running with its memory bar"
    assert "MemAvailable" in text and "budget" in text
    assert "row " in text  # the talker's last line
    final = text.rsplit("\x1b[1A", 1)[-1]  # the last frame: after the last cursor move up
    for step in ("talker", "quiet"):
        assert re.search(rf"{step}\s*│\s*\x1b\[32msucceeded", final), final
    assert "run " in final and "succeeded" in final.splitlines()[0]


def _open_run(run_dir: Path, *, executor: str = "local", last_seen_ago: float) -> None:
    """A run that never ended, whose runner (by its pid, this very process: a pid reused) was last
    seen ``last_seen_ago`` seconds ago, on another host."""
    ledger = Ledger(run_dir)
    ledger.start_run(
        "r1", "p.yaml", executor, ["prep"], 2**30, "MemAvailable", host_sampled=executor != "slurm"
    )
    ledger.close()
    db = sqlite3.connect(run_dir / LEDGER_NAME)
    db.execute(
        "UPDATE runs SET orchestrator_pid = ?, host = 'node-elsewhere', started_at = ?",
        (os.getpid(), time.time() - last_seen_ago),
    )
    db.commit()
    db.close()


def test_follow_ends_when_the_runner_is_gone_whatever_its_pid_has_become(tmp_path):
    _open_run(tmp_path, last_seen_ago=60)
    ledger = Ledger(tmp_path)
    ledger.add_host_sample("r1", HostSample(time.time() - 40, 16 * 2**30, 8 * 2**30, 8 * 2**30))
    ledger.close()
    result = eyrie("status", "--follow", "--json", "--run-dir", str(tmp_path), timeout=30)
    assert result.returncode == 1
    (view,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert view["ended"] and view["state"] == "running", view
    assert re.fullmatch(
        rf"the runner \(pid {os.getpid()} on node-elsewhere\) is gone since \d\d:\d\d:\d\d, its last "
        r"sign of life 4\d\.\ds ago; the run did not end cleanly: rerun to resume",
        view["note"],
    ), view["note"]
    assert view["steps"] == [
        {
            "step": "prep",
            "state": "pending",
            "attempt": None,
            "verdict": None,
            "usage_bytes": None,
            "limit_bytes": None,
            "peak_bytes": None,
            "records": None,
            "elapsed_s": None,
            "last_line": None,
        }
    ]


def test_follow_goes_on_while_a_runner_that_samples_nothing_beats(tmp_path):
    _open_run(tmp_path, executor="slurm", last_seen_ago=60)  # started long ago: only its heartbeats
    ledger = Ledger(tmp_path)
    sampler = HostSampler(ledger, "r1", None).start()  # as a Slurm runner's: heartbeats only
    follower = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "status", "--follow", "--json", "--run-dir", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        live = [follower.stdout.readline() for _ in range(3)]  # three seconds of a live run
    finally:
        sampler.stop()
        ledger.end_run("r1", "succeeded")
        ledger.close()
    out, err = follower.communicate(timeout=30)
    assert follower.returncode == 0, err
    views = [json.loads(line) for line in [*live, *out.splitlines()]]
    assert not any(v["ended"] for v in views[:3]), "the follower took a beating runner for a dead one"
    assert not any(v["note"] for v in views), views
    assert views[-1]["ended"] and views[-1]["state"] == "succeeded"
    assert all(v["host"] is None and not v["host_sampled"] for v in views)
