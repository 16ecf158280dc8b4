"""The testinfra host suite: expectations come from the variables the roles use.

Role defaults (ansible/roles/*/defaults/main.yml), then the site's
ansible/inventory/group_vars/gpu_hosts.yml, then, against an inventory
(``--hosts=ansible://…``), that host's own inventory variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml

ANSIBLE = Path(__file__).resolve().parents[2] / "ansible"
SITE_VARS = ANSIBLE / "inventory" / "group_vars" / "gpu_hosts.yml"
# The expectations the checks read; rendered with the others as context.
EXPECTED = (
    "nvidia_driver_branch",
    "nvidia_driver_packages",
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
