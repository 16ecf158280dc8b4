"""The documentation's commands for the real job on a CPU read its settings from compose/cpu.env, the file the
tests' CPU runs read: compose's as its --env-file, and the one command without Docker, `make cpu`,
which runs the real pipeline file with every setting of that file (one from the environment or
given to make winning), on a target `eyrie run --check` accepts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from eyrie_testing import REAL_JOB, REAL_JOB_CPU_SETTINGS, REPO, docs_section, eyrie

# Stands in for eyrie under `make cpu`: each call's arguments and environment, one JSON a line.
RECORDER = """#!{python}
import json, os, sys
with open({calls!r}, "a") as out:
    print(json.dumps([sys.argv[1:], dict(os.environ)]), file=out)
"""


def commands(text: str) -> list[str]:
    """The lines of the code blocks in ``text``, comments cut."""
    blocks = re.findall(r"^```\n(.*?)^```", text, re.M | re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]


def test_the_docs_run_the_real_job_on_a_cpu_from_cpu_env():
    lines = commands(docs_section("gpu-host", "The real job"))
    assert "make cpu" in lines  # without Docker
    compose = [line for line in lines if line.startswith("docker compose") and "compose.cpu.yaml" in line]
    assert compose and all("--env-file compose/cpu.env" in line for line in compose), compose


def test_make_cpu_runs_the_real_job_on_the_settings_of_cpu_env(tmp_path):
    recorder, calls, run_dir = tmp_path / "eyrie", tmp_path / "calls.jsonl", tmp_path / "run"
    recorder.write_text(RECORDER.format(python=sys.executable, calls=str(calls)))
    recorder.chmod(0o755)
    # none of the developer's settings, but the cache where the tiny target is made once
    environ = {k: v for k, v in os.environ.items() if not k.startswith("EYRIE_") or k == "EYRIE_CACHE_DIR"}
    done = subprocess.run(
        [
            "make",
            "--no-print-directory",
            "-o",
            "venv",
            "cpu",
            f"EYRIE={recorder}",
            f"CPU_RUN_DIR={run_dir}",
            "EYRIE_QUOTA=3",
        ],
        cwd=REPO,
        env={**environ, "EYRIE_MAX_STEPS": "12"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (run_args, env), (status_args, _) = [json.loads(line) for line in calls.read_text().splitlines()]
    assert run_args == ["run", "pipeline/jobs/eagle3.yaml", "--run-dir", str(run_dir)]
    assert status_args == ["status", "--run-dir", str(run_dir)]
    # the file's settings, one in the environment and one given to make winning
    given = {name: env.get(name) for name in REAL_JOB_CPU_SETTINGS}
    assert given == {**REAL_JOB_CPU_SETTINGS, "EYRIE_MAX_STEPS": "12", "EYRIE_QUOTA": "3"}
    # the tiny target, made once, which the run it starts serves and trains for
    target = Path(env["EYRIE_TARGET_MODEL"])
    assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
    settings = {k: v for k, v in env.items() if k.startswith(("EYRIE_", "HF_", "OMP_"))}
    check = eyrie("run", "--check", str(REAL_JOB), "--run-dir", str(run_dir), settings=settings)
    assert check.returncode == 0 and "ok" in check.stdout, check.stdout + check.stderr
