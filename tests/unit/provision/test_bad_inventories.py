"""A bad inventory stops the run before Ansible starts, with one line naming the file and the fix.

Real Ansible reads each inventory (``ansible-inventory``); no host is contacted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.provision import ProvisionError, provision, runner

HOST = {"ansible_host": "192.0.2.1"}  # TEST-NET-1: never reached, every case stops before


def _inventory(tmp_path: Path, tree: dict | str, name: str = "hosts.yml") -> Path:
    path = tmp_path / name
    path.write_text(tree if isinstance(tree, str) else yaml.safe_dump(tree))
    return path


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "provision", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={"COLUMNS": "80", "PATH": f"{sys.prefix}/bin:/usr/bin:/bin"},
    )


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("variable", "closest"),
    [
        ("nvidia_drivr_branch", "nvidia_driver_branch"),
        ("cuda_toolkit_versoin", "cuda_toolkit_version"),
        ("docker_user", "docker_users"),
    ],
)
def test_a_misspelled_role_variable_is_named_with_the_closest_declared_one(tmp_path, variable, closest):
    inventory = _inventory(tmp_path, {"gpu_hosts": {"hosts": {"gpu01": HOST}, "vars": {variable: "595"}}})
    line = _one_line(_cli(tmp_path, "--inventory", str(inventory)))
    assert line == (
        f"eyrie provision: inventory {inventory}: {variable} (set for gpu01) is not a variable "
        f"of any role; did you mean {closest}?"
    )
    assert not (tmp_path / ".eyrie" / "ansible" / "artifacts").exists(), "Ansible must not have run"


def test_every_misspelling_is_reported_once_with_the_hosts_that_set_it(tmp_path):
    hosts = {f"gpu0{i}": HOST for i in range(1, 6)}
    hosts["gpu01"] = {**HOST, "host_swp": "off"}
    inventory = _inventory(tmp_path, {"gpu_hosts": {"hosts": hosts, "vars": {"nvidia_drivr_branch": "595"}}})
    with pytest.raises(ProvisionError) as raised:
        provision(inventory=inventory, data_dir=tmp_path / "data")
    assert str(raised.value).splitlines() == [
        f"inventory {inventory}: host_swp (set for gpu01) is not a variable of any role; "
        "did you mean host_swap?",
        f"inventory {inventory}: nvidia_drivr_branch (set for gpu01, gpu02, gpu03 and 2 more) is not "
        "a variable of any role; did you mean nvidia_driver_branch?",
    ]


def test_variables_of_the_site_file_and_extra_variables_are_checked_too(tmp_path, monkeypatch):
    site = _inventory(tmp_path, {"nvidia_driver_brnch": "590"}, "gpu_hosts.yml")
    monkeypatch.setattr(runner, "SITE_VARS", site)
    with pytest.raises(
        ProvisionError,
        match=rf"^{site}: nvidia_driver_brnch is not a variable of any role; "
        "did you mean nvidia_driver_branch\\?$",
    ):
        provision(host="gpu01", data_dir=tmp_path / "data")
    monkeypatch.undo()
    with pytest.raises(ProvisionError, match="^extra variables: cuda_tolkit_version is not a variable"):
        provision(host="gpu01", data_dir=tmp_path / "data", extravars={"cuda_tolkit_version": "13.1"})


def test_declared_and_unrelated_variables_pass_the_check(tmp_path):
    inventory = _inventory(
        tmp_path,
        {
            "gpu_hosts": {
                "hosts": {"gpu01": {**HOST, "ansible_user": "ubuntu", "rack": "r12"}},
                "vars": {"nvidia_driver_branch": "590", "docker_users": ["ops"], "host_swap": "off"},
            }
        },
    )
    result = provision(inventory=inventory, data_dir=tmp_path / "data", limit="gpu01")
    assert [f.host for f in result.failures] == ["gpu01"]  # it ran, and found the host unreachable


def test_a_group_that_is_not_gpu_hosts_is_named_with_the_fix(tmp_path):
    inventory = _inventory(tmp_path, {"gpu_host": {"hosts": {"gpu01": HOST}}})
    line = _one_line(_cli(tmp_path, "--inventory", str(inventory)))
    assert line == (
        f"eyrie provision: inventory {inventory}: group gpu_hosts has no hosts, and only gpu_hosts is "
        "provisioned (its groups: gpu_host); rename group 'gpu_host' to 'gpu_hosts'"
    )


def test_a_limit_that_matches_no_host_is_an_error(tmp_path):
    inventory = _inventory(tmp_path, {"gpu_hosts": {"hosts": {"gpu01": HOST, "gpu02": HOST}}})
    line = _one_line(_cli(tmp_path, "--inventory", str(inventory), "--limit", "gpu03"))
    assert line == (
        f"eyrie provision: --limit 'gpu03' leaves no host of group gpu_hosts in inventory {inventory}; "
        "give a pattern that matches some of its hosts"
    )


@pytest.mark.parametrize(
    ("name", "text", "ansible_says"),
    [
        (
            "hosts.yml",
            "gpu_hosts:\n  hosts:\n    gpu01:\n      ansible_host: [192.0.2.1\n",
            "did not find expected ',' or ']'",
        ),
        ("hosts.yml", "- gpu01\n- gpu02\n", "YAML inventory has invalid structure"),
        ("hosts.ini", "[gpu_hosts]\ngpu01 ansible_port\n", "Expected key=value host variable assignment"),
    ],
    ids=["yaml-syntax", "yaml-structure", "ini"],
)
def test_an_inventory_ansible_cannot_parse_carries_ansibles_own_error(tmp_path, name, text, ansible_says):
    inventory = _inventory(tmp_path, text, name)
    line = _one_line(_cli(tmp_path, "--inventory", str(inventory)))
    assert line.startswith(f"eyrie provision: inventory {inventory}: Ansible cannot parse it: "), line
    assert ansible_says in line, line
