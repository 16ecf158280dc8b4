"""The ledger read by someone who may only read it: `eyrie status`, `explain` and `report` never write."""

from __future__ import annotations

import hashlib
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from eyrie_testing import REPO
from pipeline.run.ledger import LEDGER_NAME, Ledger


def make_ledger(run_dir: Path) -> Ledger:
    ledger = Ledger(run_dir)
    ledger.start_run("r1", "p.yaml", "local", ["prep"], 2**30, "MemAvailable")
    attempt = ledger.begin_attempt(
        run_id="r1",
        step="prep",
        attempt=1,
        executor="local",
        limit_bytes=2**26,
        limit_reason=None,
        argv=["true"],
        host_mem_available=2**30,
        host_mem_total=2**31,
        image=None,
        commit_id=None,
    )
    ledger.end_attempt(attempt, verdict="succeeded", reason="exit 0", fields={"exit_code": 0}, timeline=[])
    return ledger


def test_opening_to_read_never_writes(tmp_path):
    make_ledger(tmp_path).close()
    path = tmp_path / LEDGER_NAME
    before = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns)
    reader = Ledger(tmp_path, create=False)
    assert [row.step for row in reader.attempts()] == ["prep"]
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        reader.start_run("r2", "p.yaml", "local", ["prep"], None, None)
    reader.close()
    assert (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns) == before


# A read-only bind mount of the run directory in a mount namespace of its own: what a user who
# may only read the ledger sees, and one that root, who ignores file modes, cannot write through.
_READ_ONLY = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'


def read_only_eyrie(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "sh",
            "-c",
            _READ_ONLY,
            "sh",
            str(run_dir),
            sys.executable,
            "-m",
            "pipeline.cli",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )


@pytest.fixture
def read_only_mounts(tmp_path):
    probe = read_only_eyrie(tmp_path, "--help")
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only bind mount here: {probe.stderr.strip()[-200:]}")


@pytest.mark.usefixtures("read_only_mounts")
def test_status_of_a_ledger_on_a_read_only_folder(tmp_path):
    make_ledger(tmp_path).close()
    result = read_only_eyrie(tmp_path, "status", "--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "succeeded" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [LEDGER_NAME]


@pytest.mark.usefixtures("read_only_mounts")
def test_explain_on_a_read_only_folder_while_a_run_writes(tmp_path):
    writer = make_ledger(tmp_path)  # still open: its rows are in the -wal file
    try:
        result = read_only_eyrie(tmp_path, "explain", "prep", "--run-dir", str(tmp_path))
        assert result.returncode == 0, result.stderr
        assert "Succeeded: exit 0." in result.stdout
    finally:
        writer.close()


def test_one_runs_attempts_are_read_alone_oldest_first(tmp_path):
    ledger = make_ledger(tmp_path)  # r1: prep attempt 1
    ledger.start_run("r2", "p.yaml", "local", ["prep", "train"], 2**30, "MemAvailable")
    for step, attempt in [("train", 1), ("prep", 2), ("train", 2)]:
        ledger.begin_attempt(
            run_id="r2",
            step=step,
            attempt=attempt,
            executor="local",
            limit_bytes=2**26,
            limit_reason=None,
            argv=["true"],
            host_mem_available=2**30,
            host_mem_total=2**31,
            image=None,
            commit_id=None,
        )
    ledger.close()
    reader = Ledger(tmp_path, create=False)
    try:
        assert [(r.run_id, r.step, r.attempt) for r in reader.attempts_of("r2")] == [
            ("r2", "train", 1),
            ("r2", "prep", 2),
            ("r2", "train", 2),
        ]
        assert [(r.step, r.attempt) for r in reader.attempts_of("r1")] == [("prep", 1)]
        assert reader.attempts_of("r3") == []
        assert reader.run("r2")["steps"] == '["prep", "train"]' and reader.run("r3") is None
    finally:
        reader.close()
