"""Proves a provisioned host is right: run with `make verify host=NAME` or `inventory=FILE`.

Expectations come from the variables the roles use: role defaults
(ansible/roles/*/defaults/main.yml), then the site's
ansible/inventory/group_vars/gpu_hosts.yml, then, against an inventory
(``--hosts=ansible://…``), that host's own inventory variables. The fixtures
live here, not in a conftest.py, so no second module named ``conftest``
shadows the suite's own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

pytestmark = pytest.mark.host

ANSIBLE = Path(__file__).resolve().parents[2] / "ansible"
SITE_VARS = ANSIBLE / "inventory" / "group_vars" / "gpu_hosts.yml"
# The expectations the checks read; rendered with the others as context.
EXPECTED = (
    "nvidia_driver_branch",
    "nvidia_driver_packages",
    "nvidia_driver_fabric_manager",
    "nvidia_driver_fabric_manager_package",
    "cuda_toolkit_version",
    "cuda_toolkit_home",
    "nvidia_container_toolkit_version",
    "nvidia_container_toolkit_packages",
    "nvidia_container_toolkit_cdi_spec",
    "host_require_cgroup_v2",
    "host_expected_gpu_count",
    "docker_daemon_options",
)


def _render(value: Any, context: dict[str, Any], env: jinja2.Environment) -> Any:
    if isinstance(value, str) and "{{" in value:
        return _render(env.from_string(value).render(context), context, env)
    if isinstance(value, list):
        return [_render(v, context, env) for v in value]
    if isinstance(value, dict):
        return {k: _render(v, context, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def expected(host) -> dict[str, Any]:
    variables: dict[str, Any] = {}
    for defaults in sorted(ANSIBLE.glob("roles/*/defaults/main.yml")):
        variables.update(yaml.safe_load(defaults.read_text()) or {})
    variables.update(yaml.safe_load(SITE_VARS.read_text()) or {})
    if host.backend.NAME == "ansible":
        variables.update(host.ansible.get_variables())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    rendered = {name: _render(variables[name], variables, env) for name in EXPECTED}
    # YAML "false" in an inventory may arrive as a string through ansible-inventory.
    for name in ("host_require_cgroup_v2",):
        if isinstance(rendered[name], str):
            rendered[name] = rendered[name].strip().lower() in ("1", "true", "yes", "on")
    rendered["host_expected_gpu_count"] = int(rendered["host_expected_gpu_count"])
    return rendered


@pytest.fixture(scope="module")
def driver_loaded(host) -> str:
    """The loaded driver's version line; skips GPU checks where no NVIDIA module is loaded."""
    version = host.file("/proc/driver/nvidia/version")
    if not version.exists:
        pytest.skip(
            "no NVIDIA kernel module is loaded (/proc/driver/nvidia/version absent): "
            "no GPU here, or the host still needs its reboot"
        )
    return version.content_string


@pytest.fixture(scope="module")
def driver_loaded_or_none(host) -> str | None:
    """The loaded driver's version line, or None: for checks that hold either way, and more when loaded."""
    version = host.file("/proc/driver/nvidia/version")
    return version.content_string if version.exists else None


def _policy(host, package: str) -> tuple[str, str]:
    """(installed, candidate) versions as apt, with the pins in force, sees them."""
    out = host.check_output(f"apt-cache policy {package}")
    installed = re.search(r"Installed: (\S+)", out)
    candidate = re.search(r"Candidate: (\S+)", out)
    return (installed.group(1) if installed else "", candidate.group(1) if candidate else "")


def test_driver_installed_from_the_pinned_branch(host, expected):
    branch = expected["nvidia_driver_branch"]
    for package in expected["nvidia_driver_packages"]:
        installed, candidate = _policy(host, package)
        assert installed.startswith(f"{branch}."), f"{package} {installed} is not of branch {branch}"
        # A newer branch in the repository must not be what an upgrade would take.
        assert candidate.startswith(f"{branch}."), f"apt would move {package} to {candidate}"


def test_driver_pin_and_unattended_upgrades_guard(host, expected):
    pin = host.file("/etc/apt/preferences.d/eyrie-nvidia-driver")
    assert pin.exists
    assert f"Pin: version {expected['nvidia_driver_branch']}.*" in pin.content_string
    guard = host.file("/etc/apt/apt.conf.d/51eyrie-nvidia-driver")
    assert guard.exists
    assert '"nvidia-";' in guard.content_string
    # apt itself must read the blacklist, not just find a file.
    dump = host.check_output("apt-config dump Unattended-Upgrade::Package-Blacklist")
    assert "nvidia-" in dump


def test_headers_of_future_kernels_come_with_them(host):
    # A headers metapackage (no kernel version in its name) pulls each new kernel's headers,
    # so DKMS builds the module before the host boots that kernel.
    listed = host.check_output(
        "dpkg-query --showformat='${db:Status-Status} ${Package}\\n' --show 'linux-headers-*' || true"
    )
    metapackages = [
        line.split()[1]
        for line in listed.splitlines()
        if line.startswith("installed ") and not re.search(r"\d+\.\d+\.\d+", line)
    ]
    assert metapackages, f"no kernel headers metapackage is installed:\n{listed}"


def test_persistenced_enabled_in_persistence_mode(host, driver_loaded_or_none):
    service = host.service("nvidia-persistenced")
    assert service.is_enabled
    exec_start = host.check_output("systemctl show --property=ExecStart nvidia-persistenced")
    assert "--no-persistence-mode" not in exec_start, exec_start
    if driver_loaded_or_none:
        assert service.is_running


def test_fabric_manager_at_the_drivers_version_on_nvswitch_systems(host, expected, driver_loaded_or_none):
    # NVSwitch chips on the PCI bus (NVIDIA, class 0x0680), or NVLink 5 switch-management ports.
    nvswitch = host.run(
        "grep -qs SW_MNG /sys/class/infiniband/*/device/vpd || "
        "for d in /sys/bus/pci/devices/*; do grep -qx 0x10de $d/vendor && grep -q '^0x0680' $d/class "
        "&& exit 0; done; exit 1"
    )
    wanted = expected["nvidia_driver_fabric_manager"]
    if wanted == "skip" or (wanted == "auto" and nvswitch.rc != 0):
        pytest.skip(f"no Fabric Manager expected here (nvidia_driver_fabric_manager: {wanted})")
    package = host.package(expected["nvidia_driver_fabric_manager_package"])
    driver = host.package(expected["nvidia_driver_packages"][0])
    assert package.is_installed, f"{package.name} is missing on an NVSwitch system"
    assert package.version == driver.version, "Fabric Manager starts only at exactly the driver's version"
    service = host.service("nvidia-fabricmanager")
    assert service.is_enabled
    if driver_loaded_or_none:
        assert service.is_running


def test_open_kernel_module_of_the_branch(host, expected, driver_loaded):
    assert "Open Kernel Module" in driver_loaded, driver_loaded
    assert re.search(rf"\b{expected['nvidia_driver_branch']}\.\d+", driver_loaded), driver_loaded
    assert host.check_output("modinfo -F license nvidia") == "Dual MIT/GPL"


def test_nvidia_smi_lists_the_gpus(host, expected, driver_loaded):
    rows = host.check_output("nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader")
    gpus = [row for row in rows.splitlines() if row.strip()]
    if expected["host_expected_gpu_count"]:
        assert len(gpus) == expected["host_expected_gpu_count"], rows
    assert gpus and all(
        row.split(",")[-1].strip().startswith(f"{expected['nvidia_driver_branch']}.") for row in gpus
    ), rows


def test_nouveau_blacklisted_and_not_loaded(host):
    assert "blacklist nouveau" in host.file("/etc/modprobe.d/eyrie-blacklist-nouveau.conf").content_string
    # Every loaded module has a directory in /sys/module.
    assert not host.file("/sys/module/nouveau").exists


def test_nvcc_reports_the_pinned_cuda(host, expected):
    nvcc = f"{expected['cuda_toolkit_home']}/bin/nvcc"
    out = host.check_output(f"{nvcc} --version")
    assert f"release {expected['cuda_toolkit_version']}," in out, out
    # Login shells find the same nvcc, and the libraries are in the linker path.
    assert host.check_output("bash -lc 'command -v nvcc'") == nvcc
    assert (
        f"{expected['cuda_toolkit_home']}/lib64"
        in host.file("/etc/ld.so.conf.d/eyrie-cuda.conf").content_string
    )


def test_container_toolkit_pinned_to_one_version(host, expected):
    version = expected["nvidia_container_toolkit_version"]
    for package in expected["nvidia_container_toolkit_packages"]:
        installed, candidate = _policy(host, package)
        assert installed == version, f"{package} is {installed}, expected {version}"
        assert candidate == version, f"apt would move {package} to {candidate}"


def test_docker_running_with_nvidia_runtime(host):
    docker = host.service("docker")
    assert docker.is_enabled
    assert docker.is_running
    runtimes = json.loads(host.check_output("docker info --format '{{json .Runtimes}}'"))
    assert "nvidia" in runtimes, runtimes


def test_daemon_json_keeps_every_owner(host, expected):
    daemon = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert "nvidia" in daemon.get("runtimes", {}), daemon
    for key, value in expected["docker_daemon_options"].items():
        assert daemon.get(key) == value, f"daemon.json {key}={daemon.get(key)!r}, expected {value!r}"


def test_cdi_spec_exists(host, expected, driver_loaded):
    spec = host.file(expected["nvidia_container_toolkit_cdi_spec"])
    assert spec.exists
    assert "nvidia.com/gpu" in spec.content_string


def test_cgroup_v2_with_memory_controller(host, expected):
    memory = [
        line.split()
        for line in host.file("/proc/cgroups").content_string.splitlines()
        if line.startswith("memory")
    ]
    assert memory and memory[0][-1] == "1", "memory accounting is off"
    if not expected["host_require_cgroup_v2"]:
        pytest.skip("host_require_cgroup_v2 is false for this host: cgroup v1 is accepted")
    assert host.check_output("stat -fc %T /sys/fs/cgroup") == "cgroup2fs"
    assert "memory" in host.file("/sys/fs/cgroup/cgroup.controllers").content_string
