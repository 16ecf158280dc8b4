"""The target as a pipeline's service, for real: `eyrie serve --engine transformers` serves the tiny
target in a cgroup of its own, `eyrie generate` asks it through the URL the runner gives it, and a
replica killed with SIGKILL mid-generate is started again with no row lost or repeated."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from eyrie_testing import (
    REAL_JOB_CPU_SETTINGS,
    REAL_JOB_SUCCEEDED,
    REPO,
    kill_target_mid_generate,
    run_real_job,
)
from pipeline.run.ledger import Ledger

pytestmark = pytest.mark.timeout(900)


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
    kill_target_mid_generate(tmp_path, tiny_target, running_replica)
    ledger = Ledger(tmp_path / "run", create=False)
    try:
        assert ledger.attempts("target")[1].peak_bytes  # its own cgroup, watched
    finally:
        ledger.close()


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
