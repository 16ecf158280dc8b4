"""prep under a memory limit too small for its worker: the worker is OOM-killed, prep names the sources
it lost and writes nothing, and the ledger records the child OOM kill (real cgroup, real OOM killer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


def eyrie(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, timeout=600, cwd=REPO
    )


@pytest.mark.usefixtures("real_cgroups")
def test_worker_oom_kill_is_named_and_recorded(tmp_path):
    pipeline = tmp_path / "pipeline.yaml"
    step = {
        "name": "prep",
        "command": ["eyrie", "prep", "--offline", "--workers", "1"],
        "memory": "120MiB",
        "timeout": "5m",
        "outputs": ["prompts.jsonl", "native.jsonl", "native_tokenized.parquet"],
    }
    pipeline.write_text(yaml.safe_dump({"name": "prep-oom", "steps": [step]}))
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    assert "its worker process died (killed by a signal, e.g. the OOM killer)" in out
    assert "prep failed: 10 of 10 sources; no output written" in out
    assert not (run_dir / "prep" / "prompts.jsonl").exists()
    status = eyrie("status", "--run-dir", str(run_dir), "--json")
    (attempt,) = json.loads(status.stdout)
    assert attempt["verdict"] == "child_oom_killed" and attempt["exit_code"] == 1
