"""The docker role's preflight, run by real Ansible on this machine with the distribution facts given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ANSIBLE = Path(__file__).resolve().parents[3] / "ansible"
BIN = Path(sys.executable).parent
DEBIAN_12 = {"distribution": "Debian", "distribution_version": "12.7"}
UBUNTU_24 = {"distribution": "Ubuntu", "distribution_version": "24.04"}


def _preflight(tmp_path: Path, facts: dict, **variables) -> subprocess.CompletedProcess:
    """The role's preflight as the playbook's pre_tasks include it: the role's defaults, then these."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Preflight",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Check the Docker settings",
                            "ansible.builtin.include_role": {"name": "docker", "tasks_from": "preflight"},
                        }
                    ],
                }
            ]
        )
    )
    extra = {"ansible_facts": facts, "ansible_python_interpreter": sys.executable, **variables}
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            json.dumps(extra),
            str(playbook),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"),
            "ANSIBLE_NOCOLOR": "1",
        },
    )


def test_distribution_docker_on_debian_stops_before_anything_is_installed(tmp_path):
    result = _preflight(tmp_path, DEBIAN_12, docker_source="distribution")
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    assert "localhost: docker_source: distribution installs docker-compose-v2" in out, result.stdout[-3000:]
    assert "Debian 12.7 has none" in out
    assert "Set docker_source: docker for this host" in out


@pytest.mark.parametrize(
    ("facts", "variables"),
    [
        (DEBIAN_12, {}),  # the default: Docker's repository
        (UBUNTU_24, {"docker_source": "distribution"}),
        (
            DEBIAN_12,
            {"docker_source": "distribution", "docker_packages_by_source": {"distribution": ["docker.io"]}},
        ),
    ],
    ids=["debian-docker", "ubuntu-distribution", "debian-distribution-without-compose-v2"],
)
def test_sources_that_have_their_packages_pass(tmp_path, facts, variables):
    result = _preflight(tmp_path, facts, **variables)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_the_playbook_checks_before_the_first_role():
    [play] = yaml.safe_load((ANSIBLE / "playbooks" / "provision.yml").read_text())
    includes = [task.get("ansible.builtin.include_role", {}) for task in play["pre_tasks"]]
    assert {"name": "docker", "tasks_from": "preflight"}.items() <= includes[0].items()
    main = yaml.safe_load((ANSIBLE / "roles" / "docker" / "tasks" / "main.yml").read_text())
    assert main[0].get("ansible.builtin.import_tasks") == "preflight.yml"  # the role alone checks too


def test_docker_version_with_the_distributions_docker_stops_before_anything_is_installed(tmp_path):
    result = _preflight(tmp_path, UBUNTU_24, docker_source="distribution", docker_version="28.5.2")
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    assert "localhost: docker_version 28.5.2 pins Docker" in out, out[-2000:]  # YAML doubles the quote
    assert "(docker-ce), but docker_source is distribution. Set docker_source: docker" in out


def test_a_docker_user_that_does_not_exist_stops_the_run_instead_of_being_created(tmp_path):
    """users.yml as the role runs it; the user module is never reached, so nothing here changes."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Users",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Add the docker_users",
                            "ansible.builtin.include_role": {"name": "docker", "tasks_from": "users"},
                        }
                    ],
                }
            ]
        )
    )
    extra = {"ansible_python_interpreter": sys.executable, "docker_users": ["root", "eyrie-no-such-user"]}
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            json.dumps(extra),
            str(playbook),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={
            **os.environ,
            "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
            "ANSIBLE_ROLES_PATH": str(ANSIBLE / "roles"),
            "ANSIBLE_NOCOLOR": "1",
        },
    )
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    missing = "docker_users: eyrie-no-such-user is not a user on localhost; create it first, or correct"
    assert missing in out, out[-3000:]
    assert "changed=0" in out, "nothing on this machine may change"
