"""Converge a real Debian 12 host (a systemd container) with the real roles, through ansible-runner.

No GPU and no NVIDIA/Docker registry exist here, so the container installs
stand-in packages (test fixtures, tests/fixtures/provision/) from local signed
apt repositories laid out like NVIDIA's and Docker's, served over HTTP. The
roles, apt, systemd, SSH, ansible-runner and testinfra are all real:

1. converge -> succeeds; 2. converge again -> 0 changed; 3. `make provision
check=1` -> 0 changed; 4. `make verify inventory=…` (testinfra over SSH)
passes; 5. a broken variable fails with host and task named.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "fixtures" / "provision"))
import standin_repos  # noqa: E402
from ci_host import ci_host, docker, docker_engine_missing  # noqa: E402

from pipeline.provision import provision  # noqa: E402

pytestmark = [pytest.mark.docker, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def test_host(tmp_path_factory):
    reason = docker_engine_missing()
    if reason:
        pytest.skip(reason)
    with ci_host(tmp_path_factory.mktemp("provision")) as host:
        yield host


@pytest.fixture(scope="module")
def first_converge(test_host):
    return provision(inventory=test_host.inventory, data_dir=test_host.data_dir)


def _failures(result) -> str:
    lines = [f.line() for f in result.failures]
    return "\n".join(lines) or f"status {result.status}, rc {result.rc}; see {result.artifacts}/stdout"


def test_first_converge_succeeds(test_host, first_converge):
    assert first_converge.succeeded, _failures(first_converge)
    assert first_converge.changed() > 10, first_converge.recap
    # The repository carries a newer branch and toolkit: the pins, not their absence, kept them out.
    madison = docker(
        "exec", test_host.container, "apt-cache", "madison", "nvidia-open", "nvidia-container-toolkit"
    )
    assert standin_repos.NEWER_BRANCH_DRIVER in madison and standin_repos.NEWER_TOOLKIT in madison
    installed = docker(
        "exec", test_host.container, "dpkg-query", "-W", "nvidia-open", "nvidia-container-toolkit"
    )
    assert standin_repos.DRIVER in installed and standin_repos.TOOLKIT in installed, installed


def test_second_converge_changes_nothing(test_host, first_converge):
    assert first_converge.succeeded, "first converge failed"
    again = provision(inventory=test_host.inventory, data_dir=test_host.data_dir)
    assert again.succeeded, _failures(again)
    assert again.changed() == 0, f"changed on the second run: {again.changed_tasks}"


def test_check_mode_through_make_changes_nothing(test_host, first_converge):
    assert first_converge.succeeded, "first converge failed"
    result = subprocess.run(
        ["make", "--no-print-directory", "provision", f"inventory={test_host.inventory}", "check=1"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check passed: 1 host(s), 0 change(s)" in " ".join(result.stderr.split()), result.stderr[-3000:]


def test_make_verify_passes_against_the_host(test_host, first_converge):
    assert first_converge.succeeded, "first converge failed"
    result = subprocess.run(
        ["make", "--no-print-directory", "verify", f"inventory={test_host.inventory}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    # Checks that need a loaded kernel module skip here, and cgroup v2 is not required
    # on this v1 machine; every other check ran and passed.
    assert "7 passed, 4 skipped" in result.stdout, result.stdout[-4000:]
    assert result.stdout.count("no NVIDIA kernel module is loaded") == 3, result.stdout[-4000:]


def test_verify_one_host_over_ssh(test_host, first_converge, tmp_path):
    assert first_converge.succeeded, "first converge failed"
    address = docker("inspect", test_host.container, "--format", "{{.NetworkSettings.IPAddress}}")
    ssh_config = tmp_path / "ssh_config"
    ssh_config.write_text(
        f"Host {address}\n  User root\n  IdentityFile {test_host.inventory.parent / 'id_ed25519'}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
    )
    # With --host the expectations are the site's (cgroup v2 required), which this
    # cgroup v1 machine cannot meet: that one check is left out here.
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "verify", "--host", address,
         f"--ssh-config={ssh_config}", "-k", "not cgroup_v2"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "7 passed, 3 skipped, 1 deselected" in result.stdout, result.stdout[-4000:]


def test_a_failing_task_is_named_with_its_host(test_host, first_converge):
    assert first_converge.succeeded, "first converge failed"
    result = provision(
        inventory=test_host.inventory, data_dir=test_host.data_dir,
        tags=["cuda_toolkit"], extravars={"cuda_toolkit_version": "13.9"},
    )  # fmt: skip
    assert not result.succeeded
    assert [(f.host, f.task) for f in result.failures] == [("gpu-ci", "Install cuda-toolkit-13-9")]
    assert "cuda-toolkit-13-9" in result.failures[0].message
