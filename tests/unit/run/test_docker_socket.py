"""The engine's socket mounted but not ours to use is said so, with the fix, not "not mounted".

A real Unix socket stands for the engine's, owned by root and mode 0660;
`eyrie run --executor docker` runs as an unprivileged user outside its group
(as the compose pipeline service did with a wrong DOCKER_GID).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("docker")  # the `docker` extra

NOBODY = 65534


@pytest.fixture
def folder():
    """A folder an unprivileged user can reach (pytest's own tmp_path is root's alone)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run eyrie as another user")
    with tempfile.TemporaryDirectory(prefix="eyrie-socket-") as name:
        os.chmod(name, 0o755)
        path = Path(name)
        pipeline = "steps:\n  - name: hello\n    command: [echo, hi]\n    memory: 64MiB\n"
        (path / "pipeline.yaml").write_text(pipeline)
        yield path


def _eyrie_run_as_nobody(folder: Path, docker_host: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            str(folder / "pipeline.yaml"),
            "--run-dir",
            str(folder / "run"),
            "--executor",
            "docker",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={**os.environ, "DOCKER_HOST": docker_host, "HOME": "/nonexistent", "COLUMNS": "400"},
    )


def test_a_socket_this_user_may_not_use_is_named_with_its_group_and_the_fix(folder):
    path = folder / "docker.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as engine:
        engine.bind(str(path))
        engine.listen()
        path.chmod(0o660)  # root:root, as root:docker is for a user outside that group
        result = _eyrie_run_as_nobody(folder, f"unix://{path}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines() == [
        f"error: the Docker engine's socket {path} is mounted here, but this process (uid {NOBODY}, "
        "groups []) may not use it: it belongs to uid 0, gid 0, mode 660. Run with group 0 added "
        "(docker run --group-add 0; compose/compose.yaml adds it itself; on a host, usermod -aG docker "
        "USER and log in again)"
    ]
    assert not (folder / "run").exists()


def test_a_missing_socket_still_says_to_start_the_engine_or_mount_it(folder):
    result = _eyrie_run_as_nobody(folder, f"unix://{folder / 'absent.sock'}")
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("error: cannot reach the Docker engine (")
    assert line.endswith(
        "start dockerd, or mount its socket (/var/run/docker.sock) into this container, or set DOCKER_HOST"
    )
