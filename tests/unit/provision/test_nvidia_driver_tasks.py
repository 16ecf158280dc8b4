"""The nvidia_driver role's tasks that decide (reboot, Fabric Manager, headers), run by real Ansible here.

The tasks read the loaded driver, the PCI bus and the installed packages from
files and programs the test puts in place of /proc/driver/nvidia/version,
/sys and dpkg; nothing on this machine is changed.
"""

from __future__ import annotations

import json
import os
import re
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
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )


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
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"{boot}/initrd.img-6.8.0-45-generic"]


def _play(tmp_path: Path, tasks: list[dict], variables: dict, hosts: int = 1) -> subprocess.CompletedProcess:
    """``tasks`` with the role's defaults and vars, on ``hosts`` local hosts; ``variables`` as extra vars."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Role tasks",
                    "hosts": "all",
                    "gather_facts": False,
                    "vars_files": [str(ROLE / "defaults" / "main.yml"), str(ROLE / "vars" / "main.yml")],
                    "tasks": tasks,
                }
            ]
        )
    )
    inventory = ",".join(f"host{i}" for i in range(hosts)) + ","
    extra = {"ansible_python_interpreter": sys.executable, **variables}
    return subprocess.run(
        [
            str(BIN / "ansible-playbook"),
            "-i",
            inventory,
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
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"},
    )


def _pci_device(root: Path, address: str, vendor: str, pci_class: str) -> None:
    device = root / address
    device.mkdir(parents=True)
    (device / "vendor").write_text(f"{vendor}\n")
    (device / "class").write_text(f"{pci_class}\n")


HGX_H100 = [
    ("0000:18:00.0", "0x10de", "0x030200"),  # H100 SXM: 3D controller
    ("0000:05:00.0", "0x10de", "0x068000"),  # NVSwitch: other bridge
    ("0000:06:00.0", "0x10de", "0x068000"),
    ("0000:01:00.0", "0x15b3", "0x020700"),  # ConnectX-7
]
PCIE_GPUS = [("0000:18:00.0", "0x10de", "0x030000"), ("0000:19:00.0", "0x10de", "0x040300")]


@pytest.mark.parametrize(
    ("devices", "switch_management", "setting", "needed", "found"),
    [
        (HGX_H100, False, "auto", True, "NVSwitch devices found on the PCI bus"),
        (PCIE_GPUS, True, "auto", True, "NVLink 5 switch-management ports found"),
        (PCIE_GPUS, False, "auto", False, "no NVSwitch found"),
        (PCIE_GPUS, False, "install", True, "nvidia_driver_fabric_manager is install"),
        (HGX_H100, False, "skip", False, "nvidia_driver_fabric_manager is skip"),
    ],
    ids=["hgx-nvswitch", "nvlink5", "pcie-only", "forced-install", "forced-skip"],
)
def test_fabric_manager_is_wanted_on_nvswitch_systems_or_when_forced(
    tmp_path, devices, switch_management, setting, needed, found
):
    pci, infiniband = tmp_path / "pci", tmp_path / "infiniband"
    pci.mkdir()
    for address, vendor, pci_class in devices:
        _pci_device(pci, address, vendor, pci_class)
    (infiniband / "mlx5_0" / "device").mkdir(parents=True)
    vpd = b"\x82\x10NVIDIA ConnectX-7\x90\x20PN:MCX75310;" + (b"V3:SW_MNG;" if switch_management else b"")
    (infiniband / "mlx5_0" / "device" / "vpd").write_bytes(vpd)
    result = _play(
        tmp_path,
        [{"ansible.builtin.import_tasks": str(ROLE / "tasks" / "fabric_manager.yml")}],
        {
            "nvidia_driver_pci_devices": str(pci),
            "nvidia_driver_infiniband_devices": str(infiniband),
            "nvidia_driver_fabric_manager": setting,
            "nvidia_driver_installed": {"stdout": "", "rc": 1},  # nothing is installed here
        },
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    out = " ".join(result.stdout.split())
    verdict = "Fabric Manager is installed" if needed else "Fabric Manager is not installed"
    assert f"host0: {found}; {verdict}." in out, result.stdout[-3000:]


@pytest.mark.parametrize(
    ("batch", "hosts", "at_once"),
    [("25%", 3, 1), ("25%", 10, 3), ("2", 8, 2), (3, 8, 3)],
)
def test_the_reboot_batch_becomes_how_many_hosts_reboot_at_once(tmp_path, batch, hosts, at_once):
    result = _play(
        tmp_path,
        [{"name": "Show", "ansible.builtin.debug": {"msg": "throttle={{ nvidia_driver_reboot_throttle }}"}}],
        {"nvidia_driver_reboot_batch": batch},
        hosts=hosts,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert re.findall(r"msg: throttle=(\d+)", result.stdout) == [str(at_once)] * hosts, result.stdout[-3000:]
    # The reboot task is the one throttled by it.
    [reboot] = [t for t in _tasks("reboot.yml") if "ansible.builtin.reboot" in t]
    assert reboot["throttle"] == "{{ nvidia_driver_reboot_throttle }}"


@pytest.mark.parametrize("batch", ["0", "a quarter", "25 %", "-1"])
def test_a_reboot_batch_that_is_no_count_or_share_stops_the_role_first(tmp_path, batch):
    [check] = [t for t in _tasks("main.yml") if t["name"] == "Check nvidia_driver_reboot_batch"]
    assert _tasks("main.yml").index(check) == 0
    result = _play(tmp_path, [check], {"nvidia_driver_reboot_batch": batch})
    assert result.returncode != 0
    assert f"nvidia_driver_reboot_batch is {batch}: give a number of hosts" in " ".join(result.stdout.split())


def _headers_script(tmp_path: Path, installed: dict[str, str], known: set[str]) -> list[str]:
    """The task's script with dpkg-query and apt-cache answering from ``installed`` and ``known``."""
    [find] = [t for t in _tasks("install.yml") if t["name"].startswith("Find the headers metapackages")]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    listing = "".join(f"{status} {name}\n" for name, status in installed.items())
    (bin_dir / "dpkg-query").write_text(f"#!/bin/sh\nprintf '%s' '{listing}'\n")
    # apt-cache show --no-all-versions NAME: found or not
    names = " ".join(sorted(known))
    (bin_dir / "apt-cache").write_text(
        f'#!/bin/sh\nfor name in {names}; do [ "$name" = "$3" ] && exit 0; done\nexit 100\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    result = subprocess.run(
        ["bash", "-c", find["ansible.builtin.shell"]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_headers_metapackage_follows_each_installed_kernel_image_metapackage(tmp_path):
    installed = {
        "linux-image-generic-hwe-24.04": "installed",
        "linux-image-6.11.0-19-generic": "installed",  # a kernel, not a metapackage
        "linux-image-unsigned-6.11.0-19-generic": "installed",
        "linux-image-extra-virtual": "installed",  # no headers twin
        "linux-image-aws": "config-files",  # removed
        "linux-image-amd64-dbg": "installed",
    }
    known = {"linux-headers-generic-hwe-24.04", "linux-headers-aws", "linux-headers-generic"}
    assert _headers_script(tmp_path, installed, known) == ["linux-headers-generic-hwe-24.04"]


def test_without_a_kernel_image_metapackage_the_distributions_headers_are_installed(tmp_path):
    kernel_only = {"linux-image-6.1.0-25-amd64": "installed"}
    assert _headers_script(tmp_path, kernel_only, {"linux-headers-amd64"}) == []
    [install] = [t for t in _tasks("install.yml") if t["name"].startswith("Install DKMS and the kernel")]
    for facts, expected in (
        ({"distribution": "Debian", "architecture": "x86_64"}, "linux-headers-amd64"),
        ({"distribution": "Ubuntu", "architecture": "x86_64"}, "linux-headers-generic"),
    ):
        result = _play(
            tmp_path,
            [
                {
                    "name": "Show",
                    "vars": install["vars"],
                    "ansible.builtin.debug": {"msg": "{{ nvidia_driver_headers_metapackages | join(',') }}"},
                }
            ],
            {"ansible_facts": facts, "nvidia_driver_headers_found": {"stdout_lines": []}},
        )
        assert result.returncode == 0, result.stdout[-3000:]
        assert f"msg: {expected}\n" in result.stdout, result.stdout[-2000:]
