"""What Ansible will make of an inventory, checked before a run starts.

Ansible itself accepts an inventory it cannot parse (a warning, then no
hosts), a group name that matches nothing ("no hosts matched", exit 0) and a
misspelled variable (silently unused). Each of these is one line here, naming
the file and what to change. The inventory is read by ``ansible-inventory``,
so every source Ansible supports (YAML, INI, scripts, plugins,
``group_vars/`` beside it) is read as the run would read it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from pipeline.provision.errors import ProvisionError

INVENTORY_TIMEOUT_S = 300  # a dynamic inventory (a cloud API) may take a while


@dataclass(frozen=True)
class Inventory:
    """The hosts a run would target, and every variable each of them gets."""

    hosts: list[str]
    hostvars: dict[str, dict]


def ansible_env(ansible_dir: Path) -> dict[str, str]:
    """What eyrie sets for every Ansible command: its config, and the tools beside this Python first."""
    return {
        "ANSIBLE_CONFIG": str(ansible_dir / "ansible.cfg"),
        "ANSIBLE_ROLES_PATH": str(ansible_dir / "roles"),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        # Without this, a source no plugin can parse is a warning and the run goes on with no hosts.
        "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }


def _parse_error(stderr: str, source: Path) -> str:
    """Ansible's own reason for not parsing ``source``, from the plugin that fits the file.

    Ansible tries every inventory plugin and warns once per plugin; the one
    that matters is the YAML plugin for a .yml/.yaml/.json file, a script for
    an executable, and the INI plugin otherwise.
    """
    # Ansible wraps warnings at 79 columns, cutting a long path anywhere: the path is not matched.
    text = " ".join(stderr.split())
    reasons = dict(
        re.findall(r"\* Failed to parse .*? with (\w+) plugin: (.*?)(?= \[WARNING\]:| ERROR!|$)", text)
    )
    if source.suffix in (".yml", ".yaml", ".json"):
        preferred = ["yaml", "auto"]
    elif source.is_file() and os.access(source, os.X_OK):
        preferred = ["script"]
    else:
        preferred = ["ini"]
    for plugin in preferred:
        if reasons.get(plugin):
            return f"{reasons[plugin]} ({plugin} plugin)"
    if reasons:
        return "; ".join(f"{plugin} plugin: {reason}" for plugin, reason in reasons.items())
    last = [line for line in stderr.splitlines() if line.strip()]
    return last[-1].removeprefix("ERROR! ") if last else "ansible-inventory failed with no message"


def _list(sources: list[Path], user_source: Path, ansible_dir: Path, limit: str | None) -> dict:
    """``ansible-inventory --list``: groups with their hosts and children, every host's variables."""
    command = [str(Path(sys.executable).parent / "ansible-inventory"), "--list"]
    for source in sources:
        command += ["-i", str(source)]
    if limit:
        command += ["--limit", limit]
    env = {**os.environ, **ansible_env(ansible_dir)}
    try:
        listed = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=INVENTORY_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise ProvisionError(
            f"inventory {user_source}: ansible-inventory gave no answer within {INVENTORY_TIMEOUT_S}s"
        ) from None
    if listed.returncode != 0:
        raise ProvisionError(
            f"inventory {user_source}: Ansible cannot parse it: {_parse_error(listed.stderr, user_source)}"
        )
    try:
        return json.loads(listed.stdout)
    except ValueError:
        raise ProvisionError(
            f"inventory {user_source}: ansible-inventory printed no inventory: {listed.stdout[:200]!r}"
        ) from None


def read_inventory(
    sources: list[Path], *, user_source: Path, group: str, ansible_dir: Path, limit: str | None = None
) -> Inventory:
    """The hosts of ``group`` (within ``limit``) and their variables; one-line errors otherwise."""
    tree = _list(sources, user_source, ansible_dir, limit)
    hosts = sorted(_members(tree, group))
    if hosts:
        hostvars = tree.get("_meta", {}).get("hostvars", {})
        return Inventory(hosts=hosts, hostvars={host: hostvars.get(host, {}) for host in hosts})
    if limit and _members(_list(sources, user_source, ansible_dir, None), group):
        raise ProvisionError(
            f"--limit {limit!r} leaves no host of group {group} in inventory {user_source}; "
            "give a pattern that matches some of its hosts"
        )
    groups = sorted(name for name in tree if name not in ("_meta", "all", "ungrouped"))
    closest = difflib.get_close_matches(group, groups, n=1)
    hint = (
        f"; rename group {closest[0]!r} to {group!r}"
        if closest
        else f"; put your hosts under {group}: hosts: (see ansible/inventory/example.yml)"
    )
    found = f"its groups: {', '.join(groups)}" if groups else "it lists no group"
    raise ProvisionError(
        f"inventory {user_source}: group {group} has no hosts, and only {group} is provisioned "
        f"({found}){hint}"
    )


def _members(tree: dict, group: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Hosts of ``group`` and of its children, as ansible-inventory lists them."""
    entry = tree.get(group, {})
    hosts = set(entry.get("hosts", []))
    for child in entry.get("children", []):
        if child not in seen:
            hosts |= _members(tree, child, seen | {group})
    return hosts


def declared_variables(roles_dir: Path) -> set[str]:
    """Every variable a role declares: the options of each entry point of its argument_specs."""
    declared: set[str] = set()
    for specs in sorted(roles_dir.glob("*/meta/argument_specs.yml")):
        entry_points = (yaml.safe_load(specs.read_text()) or {}).get("argument_specs", {})
        for entry in entry_points.values():
            declared |= set((entry or {}).get("options", {}))
    return declared


def role_prefixes(roles_dir: Path) -> tuple[str, ...]:
    """The namespaces role variables live in: each role name's first word (nvidia_, cuda_, docker_, host_)."""
    return tuple(sorted({p.name.split("_")[0] + "_" for p in roles_dir.iterdir() if p.is_dir()}))


def unknown_variables(
    names_by_host: dict[str, Iterable[str]], declared: set[str], prefixes: tuple[str, ...]
) -> list[tuple[str, list[str], str]]:
    """(variable, hosts setting it, the closest declared name) for each role-like name no role declares."""
    hosts_by_name: dict[str, list[str]] = {}
    for host, names in names_by_host.items():
        for name in names:
            if name.startswith(prefixes) and name not in declared:
                hosts_by_name.setdefault(name, []).append(host)
    return [
        (name, sorted(hosts), (difflib.get_close_matches(name, declared, n=1, cutoff=0) or ["?"])[0])
        for name, hosts in sorted(hosts_by_name.items())
    ]


def describe_hosts(hosts: list[str]) -> str:
    return ", ".join(hosts) if len(hosts) <= 3 else f"{', '.join(hosts[:3])} and {len(hosts) - 3} more"
