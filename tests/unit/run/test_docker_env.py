"""What a step container inherits of the runner's environment."""

from __future__ import annotations

import pytest

docker_executor = pytest.importorskip("pipeline.run.docker")


def test_container_env_keeps_what_the_runner_and_step_set_and_drops_the_host():
    own = {
        "PATH": "/venv/bin:/usr/bin",
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "HF_TOKEN": "t",
        "SECRET_ONLY_ON_HOST": "x",
    }
    launch_env = {
        **own,
        "PATH": "/work/.venv/bin:/venv/bin:/usr/bin",  # the runner puts its venv first
        "EYRIE_RUN_DIR": "/runs/a",
        "EYRIE_STEP_NAME": "prep",
        "BATCH": "8",  # the step's env:
    }
    env = docker_executor.container_env(launch_env, own)
    assert env == {"HF_TOKEN": "t", "EYRIE_RUN_DIR": "/runs/a", "EYRIE_STEP_NAME": "prep", "BATCH": "8"}
