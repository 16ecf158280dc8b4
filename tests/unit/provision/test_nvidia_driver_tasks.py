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


def _role_tasks_in_order(name: str = "main.yml") -> list[dict]:
    """The role's tasks as they run: imports expanded in place, blocks flattened."""
    ordered: list[dict] = []
    for task in _tasks(name):
        if "ansible.builtin.import_tasks" in task:
            ordered += _role_tasks_in_order(task["ansible.builtin.import_tasks"])
        elif "block" in task:
            ordered += task["block"]
        else:
            ordered.append(task)
    return ordered


def test_the_initramfs_is_rebuilt_by_a_task_before_the_reboot():
    # Handlers run after the play's roles, i.e. after this role's reboot, and never
    # when a later task fails: the blacklist must reach the initramfs before it.
    assert not (ROLE / "handlers").exists() or not yaml.safe_load(
        (ROLE / "handlers" / "main.yml").read_text()
    )
    tasks = _role_tasks_in_order()
    assert [t["name"] for t in tasks if "notify" in t] == []
    names = [t["name"] for t in tasks]
    assert names.index("Blacklist nouveau") < names.index("Rebuild the initramfs")
    assert names.index("Rebuild the initramfs") < names.index("Reboot into the new driver")


def test_initramfs_images_without_the_blacklist_are_found(tmp_path):
    """The task's own script, its two roots moved under tmp_path, with lsinitramfs reading a listing."""
    [find] = [
        t for t in _tasks("nouveau.yml") if t["name"] == "Find initramfs images without the nouveau blacklist"
    ]
    state, boot, bin_dir = tmp_path / "state", tmp_path / "boot", tmp_path / "bin"
    for folder in (state, boot, bin_dir):
        folder.mkdir()
    script = find["ansible.builtin.shell"].replace("/var/lib/initramfs-tools", str(state))
    script = script.replace("/boot/", f"{boot}/")
    lsinitramfs = bin_dir / "lsinitramfs"
    lsinitramfs.write_text('#!/bin/sh\ncat "$1"\n')
    lsinitramfs.chmod(0o755)
    listing = "\n".join(f"usr/lib/modules/x/kernel/file{i}.ko" for i in range(20000))
    blacklisted = "etc/modprobe.d/eyrie-blacklist-nouveau.conf"
    images = {
        "6.8.0-40-generic": f"{listing}\n{blacklisted}\n",  # rebuilt since the blacklist
        "6.8.0-45-generic": f"{listing}\netc/modprobe.d/other.conf\n",  # built before it
        "6.8.0-50-generic": f"./{blacklisted}\n{listing}\n",
        "6.8.0-51-generic": None,  # known to initramfs-tools, no image: nothing to check
    }
    for version, content in images.items():
        (state / version).touch()
        if content is not None:
            (boot / f"initrd.img-{version}").write_text(content)
    (boot / "initrd.img-6.8.0-40-generic.old-dkms").write_text(listing)  # DKMS's backup: not booted
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{boot}/initrd.img-6.8.0-45-generic"]
