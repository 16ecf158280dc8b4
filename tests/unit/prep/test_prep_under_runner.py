"""prep and tokenize as steps of a pipeline run by the real runner (each step in its own cgroup)."""

from __future__ import annotations

import json
import re
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
    # the sources read before the worker died are done; the rest, from the one it died in, are lost
    assert re.search(r"prep failed: \d+ of 10 sources; no output written", out)
    assert not (run_dir / "prep" / "prompts.jsonl").exists()
    status = eyrie("status", "--run-dir", str(run_dir), "--json")
    (attempt,) = json.loads(status.stdout)
    assert attempt["verdict"] == "child_oom_killed" and attempt["exit_code"] == 1


@pytest.mark.usefixtures("real_cgroups")
def test_prep_then_tokenize_as_steps(tmp_path, tiny_tokenizer):
    run = "${EYRIE_RUN_DIR}"
    steps = [
        {
            "name": "prep",
            "command": ["eyrie", "prep", "--offline"],
            "memory": "1536MiB",
            "outputs": ["prompts.jsonl", "native.jsonl", "native_tokenized.parquet"],
        },
        {
            "name": "tokenize",
            "command": [
                "eyrie",
                "tokenize",
                "--tokenizer",
                str(tiny_tokenizer),
                "--conversations",
                f"{run}/prep/native.jsonl",
                "--tokenized",
                f"{run}/prep/native_tokenized.parquet",
                "--max-length",
                "2048",
            ],
            "needs": ["prep"],
            "memory": "1GiB",
            "outputs": ["shards"],
        },
    ]
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text(yaml.safe_dump({"name": "prep-tokenize", "steps": steps}))
    run_dir = tmp_path / "run"
    result = eyrie("run", str(pipeline), "--run-dir", str(run_dir))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    attempts = json.loads(eyrie("status", "--run-dir", str(run_dir), "--json").stdout)
    assert [(a["step"], a["verdict"]) for a in attempts] == [("prep", "succeeded"), ("tokenize", "succeeded")]
    manifest = json.loads((run_dir / "tokenize" / "manifest.json").read_text())
    assert manifest["stats"]["totals"]["rows"] == 50  # 26 native conversations + 24 pre-tokenized rows
