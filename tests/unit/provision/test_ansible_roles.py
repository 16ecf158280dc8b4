"""The roles themselves: lint-clean (production profile), every variable documented, playbook valid."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from eyrie_testing import PLAYBOOK, playbook_roles

ANSIBLE = Path(__file__).resolve().parents[3] / "ansible"
ROLES = sorted(p.name for p in (ANSIBLE / "roles").iterdir() if p.is_dir())
BIN = Path(sys.executable).parent


def test_the_playbook_applies_every_role_under_its_own_tag():
    assert sorted(playbook_roles()) == ROLES, "ansible/roles/ and the playbook's roles differ"
    (play,) = yaml.safe_load(PLAYBOOK.read_text())
    for entry in play["roles"]:
        assert entry["tags"] == [entry["role"]], f"{entry['role']}: `make provision tags=ROLE` needs its tag"


@pytest.mark.parametrize("role", ROLES)
def test_every_default_is_documented_in_argument_specs(role):
    defaults = yaml.safe_load((ANSIBLE / "roles" / role / "defaults" / "main.yml").read_text())
    specs = yaml.safe_load((ANSIBLE / "roles" / role / "meta" / "argument_specs.yml").read_text())
    options = specs["argument_specs"]["main"].get("options", {})
    assert set(defaults) - set(options) == set(), f"{role}: defaults missing from argument_specs"
    assert set(options) - set(defaults) == set(), f"{role}: argument_specs options without a default"
    for name, spec in options.items():
        assert spec.get("description"), f"{role}: {name} has no description"


def test_playbook_syntax():
    result = subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "--syntax-check",
            "-i",
            "inventory/example.yml",
            "playbooks/provision.yml",
        ],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg")},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ansible_lint_production_profile_is_clean():
    result = subprocess.run(
        [str(BIN / "ansible-lint"), "--profile", "production", "--offline", "--nocolor"],
        cwd=ANSIBLE,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
