"""`eyrie manifest OUTPUT…`: a plain command declares its outputs complete, as the Python API does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from pipeline.contract.step import (
    FINGERPRINT_ENV,
    STEP_DIR_ENV,
    STEP_NAME_ENV,
    check_manifest,
    declare_outputs,
)


def eyrie_manifest(folder: Path, *outputs: str) -> subprocess.CompletedProcess:
    """`eyrie manifest OUTPUTS…` run by hand in ``folder`` (no runner around it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EYRIE_")}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "manifest", *outputs],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_runners_step_dir_name_and_fingerprint_go_in_the_manifest(tmp_path, monkeypatch):
    step = tmp_path / "run" / "prep"
    (step / "parts").mkdir(parents=True)
    (step / "prompts.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    (step / "parts" / "x.bin").write_bytes(b"xyz")
    monkeypatch.chdir(step)
    monkeypatch.setenv(STEP_DIR_ENV, str(step))
    monkeypatch.setenv(STEP_NAME_ENV, "prep")
    monkeypatch.setenv(FINGERPRINT_ENV, "f" * 64)
    manifest = declare_outputs(["prompts.jsonl", step / "parts"])
    assert (manifest.step, manifest.fingerprint) == ("prep", "f" * 64)
    assert manifest.outputs["prompts.jsonl"]["."].records == 2
    assert manifest.outputs["parts"]["x.bin"].bytes == 3
    assert check_manifest(step, ["prompts.jsonl", "parts"]) == (True, "manifest matches the files")


def test_a_missing_or_outside_output_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "out.txt").write_text("x\n")
    for bad, message in [
        ("nope.txt", "nope.txt: no such file or folder in"),
        ("/etc/passwd", "/etc/passwd: not inside the step directory"),
    ]:
        result = eyrie_manifest(tmp_path, "out.txt", bad)
        assert result.returncode == 2
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: ") and message in line
        assert not (tmp_path / "manifest.json").exists()
    result = eyrie_manifest(tmp_path, "out.txt")
    assert result.returncode == 0 and "1 output(s), 1 file(s), 2 bytes" in result.stdout
    assert json.loads((tmp_path / "manifest.json").read_text())["outputs"]["out.txt"]["."]["bytes"] == 2
