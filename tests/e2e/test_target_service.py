"""The target as a pipeline's service, for real: `eyrie serve --engine transformers` serves the tiny
target in a cgroup of its own, `eyrie generate` asks it through the URL the runner gives it, and a
replica killed with SIGKILL mid-generate is started again with no row lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from eyrie_testing import REAL_JOB_CPU_SETTINGS, REAL_JOB_SUCCEEDED, REPO, run_real_job
from pipeline.run.ledger import Ledger

pytestmark = pytest.mark.timeout(900)
PROMPTS = 60


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    from pipeline.embedded.tiny import ensure_tiny_target

    return ensure_tiny_target(tmp_path_factory.mktemp("target") / "model")


def running_replica(run_dir: Path) -> int | None:
    """The pid of the target's replica while its attempt runs, once the ledger has it."""
    try:
        ledger = Ledger(run_dir, create=False)
    except (FileNotFoundError, sqlite3.Error):
        return None
    try:
        rows = [r for r in ledger.attempts("target") if r.verdict is None and r.pid]
    finally:
        ledger.close()
    return rows[-1].pid if rows else None


@pytest.mark.usefixtures("real_cgroups")
def test_a_replica_killed_mid_generate_is_started_again_and_no_row_is_lost_or_repeated(tmp_path, tiny_target):
    prompts = tmp_path / "prompts.jsonl"
    asked = [{"id": f"p{i:03d}", "source": "t", "messages": [{"role": "user", "content": f"q {i}"}]}
             for i in range(PROMPTS)]  # fmt: skip
    prompts.write_text("".join(json.dumps(row) + "\n" for row in asked))
    spec = {
        "name": "target-service",
        "services": [
            {
                "name": "target",
                "command": ["eyrie", "serve", str(tiny_target), "--engine", "transformers"],
                "memory": "3GiB",
                "startup_timeout": "5m",
                "retries": 1,
            }
        ],
        "steps": [
            {
                "name": "generate",
                "command": ["eyrie", "generate", str(prompts), "--max-tokens", "32", "--seed", "7",
                            "--concurrency", "2", "--health-timeout", "5m", "--retry-base", "0.2"],
                "memory": "1GiB",
                "uses": ["target"],
                "outputs": ["conversations.jsonl", "errors.jsonl"],
            }
        ],
    }  # fmt: skip
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    runner = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "run", str(pipeline), "--run-dir", str(run_dir)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    # generate appends rows to its partial file as they are answered: kill the server once a few
    # are in; the file is renamed conversations.jsonl when the step completes.
    partial = run_dir / "generate" / "conversations.partial.jsonl"
    rows = run_dir / "generate" / "conversations.jsonl"
    deadline = time.monotonic() + 600
    answered = 0
    while runner.poll() is None and time.monotonic() < deadline:
        answered = partial.read_bytes().count(b"\n") if partial.exists() else 0
        if answered >= 5 and (pid := running_replica(run_dir)):
            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"no replica to kill mid-generate:\n{runner.communicate()[0]}")
    out, _ = runner.communicate(timeout=600)
    assert runner.returncode == 0, out
    assert answered < PROMPTS, "generate had answered every prompt before the kill"

    ids = [json.loads(line)["id"] for line in rows.read_text().splitlines()]
    assert sorted(ids) == [f"p{i:03d}" for i in range(PROMPTS)]  # none lost, none twice
    ledger = Ledger(run_dir, create=False)
    try:
        first, second = ledger.attempts("target")
    finally:
        ledger.close()
    assert (first.verdict, first.signal, first.replica) == ("crashed", signal.SIGKILL, 1)
    assert second.verdict == "succeeded" and second.replica == 1 and second.peak_bytes
    assert "target[1]: crashed" in out and "starting it again (1 of 1 retries)" in out


@pytest.mark.usefixtures("real_cgroups")
def test_the_real_pipeline_file_serves_its_target_itself_and_stops_it_after_generate(tmp_path, tiny_target):
    run_dir = tmp_path / "run"
    settings = {**REAL_JOB_CPU_SETTINGS, "EYRIE_TARGET_MODEL": str(tiny_target)}
    rows = run_real_job(run_dir, {**settings, "EYRIE_CACHE_DIR": str(tmp_path / "cache")}, timeout=1200)
    assert {(a["step"], a["replica"]): a["verdict"] for a in rows} == REAL_JOB_SUCCEEDED
    ledger = Ledger(run_dir, create=False)
    try:
        attempts = {row.label: row for row in ledger.attempts()}
    finally:
        ledger.close()
    # Started for generate, stopped once it ended: train found nothing of it running.
    replica, generate, train = attempts["target[1]"], attempts["generate"], attempts["train"]
    assert replica.started_at < generate.started_at
    assert generate.ended_at <= replica.ended_at <= train.started_at
    assert json.loads(replica.argv)[:3] == ["eyrie", "serve", str(tiny_target)]
    report = [sys.executable, "-m", "pipeline.cli", "report", "--run-dir", str(run_dir)]
    subprocess.run(report, cwd=REPO, check=True, capture_output=True)
    assert 'data-series="host-target"' in (run_dir / "report.html").read_text()
