"""The nvidia_driver role's tasks that decide about the reboot, run by real Ansible on this machine.

The tasks read the loaded driver from a file the test writes in place of
/proc/driver/nvidia/version; nothing on this machine is changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ANSIBLE = Path(__file__).resolve().parents[3] / "ansible"
ROLE = ANSIBLE / "roles" / "nvidia_driver"
BIN = Path(sys.executable).parent
LOADED_590 = (
    "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  590.44.01  Release Build  "
    "(dvs-builder@U22-I3-AE18-23-3)  Mon Nov 17 20:08:27 UTC 2025\n"
    "GCC version:  gcc version 13.3.0 (Ubuntu 13.3.0-6ubuntu2~24.04)\n"
)


def _tasks(name: str) -> list[dict]:
    return yaml.safe_load((ROLE / "tasks" / name).read_text())


def _run_loaded_check(tmp_path: Path, proc_version: Path) -> subprocess.CompletedProcess:
    """loaded.yml with the role's vars, as it runs after a reboot that installed 590.44.01-1."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "After the reboot",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars_files": [str(ROLE / "vars" / "main.yml")],
                    "vars": {
                        "nvidia_driver_installed": {"stdout": "590.44.01-1", "rc": 0},
                        "nvidia_driver_secure_boot_enabled": True,
                    },
                    "tasks": [{"ansible.builtin.import_tasks": str(ROLE / "tasks" / "loaded.yml")}],
                }
            ]
        )
    )
    extra = {"nvidia_driver_proc_version": str(proc_version), "ansible_python_interpreter": sys.executable}
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", "localhost,", "-c", "local", "-e", json.dumps(extra),
         str(playbook)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip


def test_the_installed_driver_loaded_after_the_reboot_passes(tmp_path):
    proc_version = tmp_path / "version"
    proc_version.write_text(LOADED_590)
    result = _run_loaded_check(tmp_path, proc_version)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "failed=0" in result.stdout


@pytest.mark.parametrize(
    "loaded", [None, LOADED_590.replace("590.44.01", "580.95.05")], ids=["absent", "another_version"]
)
def test_a_driver_not_loaded_after_the_reboot_stops_the_run_and_says_where_to_look(tmp_path, loaded):
    proc_version = tmp_path / "version"
    if loaded is not None:
        proc_version.write_text(loaded)
    result = _run_loaded_check(tmp_path, proc_version)
    assert result.returncode != 0
    out = " ".join(result.stdout.split())
    assert "localhost rebooted, but driver 590.44.01 is not loaded" in out, result.stdout[-3000:]
    if loaded is None:
        assert f"(no NVIDIA module is loaded: {proc_version} is absent)" in out
    else:
        assert "(the loaded one is 580.95.05)" in out
    for hint in ("`dkms status`", "Secure Boot, on", "mokutil --test-key", "nouveau, not loaded"):
        assert hint in out, hint


def test_the_check_runs_right_after_the_reboot_and_only_then():
    tasks = _tasks("reboot.yml")
    [reboot] = [i for i, t in enumerate(tasks) if "ansible.builtin.reboot" in t]
    check = tasks[reboot + 1]
    assert check.get("ansible.builtin.import_tasks") == "loaded.yml"
    assert f"{tasks[reboot]['register']} is changed" in check["when"]
    assert "not ansible_check_mode" in check["when"]
