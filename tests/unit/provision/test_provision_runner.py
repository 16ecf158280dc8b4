"""The ansible-runner driver, against real Ansible: inventories, failures named by host and task."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pipeline.provision import ProvisionError, host_inventory, provision
from pipeline.provision.runner import REPO


def test_host_inventory_reads_user_and_port():
    assert host_inventory("gpu01") == {"gpu_hosts": {"hosts": {"gpu01": None}}}
    assert host_inventory("ubuntu@10.0.0.5:2222") == {
        "gpu_hosts": {"hosts": {"10.0.0.5": {"ansible_user": "ubuntu", "ansible_port": 2222}}}
    }
    with pytest.raises(ProvisionError, match="port"):
        host_inventory("gpu01:ssh")
    with pytest.raises(ProvisionError, match="no host name"):
        host_inventory("root@")


def test_exactly_one_target_is_required(tmp_path):
    with pytest.raises(ProvisionError, match="exactly one"):
        provision(data_dir=tmp_path)
    with pytest.raises(ProvisionError, match="does not exist"):
        provision(inventory=tmp_path / "missing.yml", data_dir=tmp_path)


def test_unreachable_host_is_named_with_its_task(tmp_path):
    result = provision(host="root@eyrie-no-such-host.invalid", data_dir=tmp_path)
    assert not result.succeeded
    assert result.recap["eyrie-no-such-host.invalid"]["dark"] == 1
    [failure] = result.failures
    assert (failure.host, failure.task, failure.unreachable) == (
        "eyrie-no-such-host.invalid",
        "Gathering Facts",
        True,
    )
    assert "eyrie-no-such-host.invalid" in failure.message
    # The run's artifacts are kept: events, stdout, rc.
    assert (result.artifacts / "rc").read_text().strip() == str(result.rc)
    assert list((result.artifacts / "job_events").glob("*.json"))
    # The site's group_vars apply to a single host too.
    written = yaml.safe_load((tmp_path / "inventory" / "host.yml").read_text())
    assert written == {"gpu_hosts": {"hosts": {"eyrie-no-such-host.invalid": {"ansible_user": "root"}}}}
    assert (tmp_path / "inventory" / "group_vars" / "gpu_hosts.yml").exists()


def test_cli_exits_non_zero_naming_host_and_task(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump({"gpu_hosts": {"hosts": {"gpu-gone": {"ansible_host": "192.0.2.1"}}}})
    )
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "provision", "--inventory", str(inventory)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={"COLUMNS": "200", "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "ANSIBLE_TIMEOUT": "3"},
    )  # fmt: skip
    assert result.returncode != 0
    assert "gpu-gone: unreachable at task 'Gathering Facts'" in result.stderr, result.stderr
    # Artifacts go to the private data dir under the working directory.
    assert list((tmp_path / ".eyrie" / "ansible" / "artifacts").iterdir())


def test_verify_needs_a_target():
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "verify"], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 2
    assert "give exactly one of --host NAME or --inventory FILE" in result.stderr
