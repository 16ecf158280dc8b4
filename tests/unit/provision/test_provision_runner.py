"""The ansible-runner driver, against real Ansible: inventories, failures named by host and task."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.provision import ProvisionError, host_inventory, provision, runner
from pipeline.provision.runner import REPO, SITE_VARS

SITE = yaml.safe_load(SITE_VARS.read_text())


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
    written = yaml.safe_load((tmp_path / "inventory" / "host.yml").read_text())
    assert written == {"gpu_hosts": {"hosts": {"eyrie-no-such-host.invalid": {"ansible_user": "root"}}}}
    # The site's variables apply to a single host too.
    assert (
        _variables(result, "eyrie-no-such-host.invalid")["host_expected_gpu_count"]
        == SITE["host_expected_gpu_count"]
    )


def _variables(result, host: str) -> dict:
    """A host's variables, read by ansible-inventory from the inventory sources the run was given."""
    command = json.loads((result.artifacts / "command").read_text())["command"]
    sources = [command[i + 1] for i, arg in enumerate(command) if arg == "-i"]
    inventory_command = Path(sys.executable).parent / "ansible-inventory"
    listed = subprocess.run(
        [str(inventory_command), *(f"-i{s}" for s in sources), "--host", host],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(listed.stdout)


def test_an_inventory_anywhere_gets_the_site_variables_below_its_own(tmp_path, monkeypatch):
    site = tmp_path / "site" / "gpu_hosts.yml"
    site.parent.mkdir()
    site.write_text(yaml.safe_dump({name: "site" for name in ("only_site", "in_all", "in_group", "in_host")}))
    monkeypatch.setattr(runner, "SITE_VARS", site)
    inventory = tmp_path / "elsewhere" / "hosts.yml"  # not beside ansible/inventory/group_vars
    inventory.parent.mkdir()
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {"vars": {"in_all": "inventory all"}},
                "gpu_hosts": {
                    "hosts": {"gpu-gone.invalid": {"in_host": "inventory host"}},
                    "vars": {"in_group": "inventory group"},
                },
            }
        )
    )
    result = provision(inventory=inventory, data_dir=tmp_path / "data")
    assert not result.succeeded  # the host does not exist; its variables are what counts
    variables = _variables(result, "gpu-gone.invalid")
    assert {name: variables[name] for name in ("only_site", "in_all", "in_group", "in_host")} == {
        "only_site": "site",
        "in_all": "inventory all",
        "in_group": "inventory group",
        "in_host": "inventory host",
    }


def _command(result) -> list[str]:
    return json.loads((result.artifacts / "command").read_text())["command"]


def test_a_run_uses_only_the_options_its_own_command_gives(tmp_path):
    """Check mode, tags and extra variables of one run never reach the next (ansible-runner keeps
    them in its private data dir's env/ and reads them back when a later run gives none)."""
    # What an earlier eyrie left in its data dir: a plain run must not read it either.
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "cmdline").write_text("--check --diff")
    (tmp_path / "env" / "extravars").write_text('{"cuda_toolkit_version": "13.9"}')
    host = "root@eyrie-no-such-host.invalid"
    first = provision(
        host=host, data_dir=tmp_path, check=True, tags=["docker"], extravars={"docker_version": "28.5.2"}
    )
    assert {"--check", "--diff", "--tags", "docker"} <= set(_command(first)), _command(first)
    plain = provision(host=host, data_dir=tmp_path)
    command = _command(plain)
    for option in ("--check", "--diff", "--tags", "-e", "--extra-vars"):
        assert option not in command, command
    assert not any("13.9" in arg or "docker_version" in arg for arg in command), command
    assert first.artifacts != plain.artifacts  # each run keeps its own artifacts


def test_a_site_file_that_is_not_a_mapping_stops_the_run(tmp_path, monkeypatch):
    site = tmp_path / "gpu_hosts.yml"
    site.write_text("- a list\n")
    monkeypatch.setattr(runner, "SITE_VARS", site)
    with pytest.raises(ProvisionError, match="must map variable names to values"):
        provision(host="gpu01", data_dir=tmp_path / "data")


def test_cli_exits_non_zero_naming_host_and_task(tmp_path):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump({"gpu_hosts": {"hosts": {"gpu-gone": {"ansible_host": "192.0.2.1"}}}})
    )
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "provision", "--inventory", str(inventory)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env={"COLUMNS": "200", "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "ANSIBLE_TIMEOUT": "3"},
    )
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


def test_verify_of_an_unreachable_host_is_one_line_naming_it():
    result = subprocess.run(
        ["make", "--no-print-directory", "verify", "host=eyrie-no-such-host.invalid"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("eyrie verify:")]
    assert said == [
        "eyrie verify: eyrie-no-such-host.invalid: cannot be reached over SSH: ssh: Could not resolve "
        "hostname eyrie-no-such-host.invalid: Name or service not known"
    ], result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "test session starts" not in result.stdout, "the suite must not run against it"
