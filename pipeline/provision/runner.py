"""Runs the provisioning playbook through ansible-runner and turns its events into facts.

The data dir (``eyrie provision --data-dir``) keeps ``inventory/`` (the site's
variables as an inventory source, and the one-host inventory ``--host``
writes) and ``artifacts/<ident>/`` (job events, stdout, rc, status, the
command, kept for the last runs). ansible-runner's private data dir is a new,
empty folder for every run: ansible-runner reads options left in its
``env/`` folder (``cmdline``, ``extravars``) by an earlier run, and a run
must do exactly what its own command says.
Every event updates a per-host tally; failures and unreachable hosts are kept
with the task that hit them, so the caller can name host and task.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipeline.provision.errors import ProvisionError
from pipeline.provision.inventory import (
    Inventory,
    ansible_env,
    declared_variables,
    describe_hosts,
    read_inventory,
    role_prefixes,
    unknown_variables,
)

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_DIR = Path(os.environ.get("EYRIE_ANSIBLE_DIR", REPO / "ansible"))
PLAYBOOK = "playbooks/provision.yml"
HOST_GROUP = "gpu_hosts"
# The site's values for every GPU host (make verify reads the same file).
SITE_VARS = ANSIBLE_DIR / "inventory" / "group_vars" / f"{HOST_GROUP}.yml"
KEPT_ARTIFACTS = 20


@dataclass
class HostTally:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: bool = False
    current_task: str = ""


@dataclass
class Failure:
    host: str
    task: str
    message: str
    unreachable: bool = False

    def line(self) -> str:
        what = "unreachable" if self.unreachable else "failed"
        return f"{self.host}: {what} at task '{self.task}': {self.message}"


@dataclass
class ProvisionResult:
    status: str
    rc: int
    check: bool
    hosts: dict[str, HostTally]
    failures: list[Failure]
    recap: dict[str, dict[str, int]]
    artifacts: Path
    changed_tasks: list[tuple[str, str]] = field(default_factory=list)
    """(host, task) of every change, so "converge again: 0 changed" can name what moved."""

    @property
    def succeeded(self) -> bool:
        return self.rc == 0 and not self.failures and self.status == "successful"

    def changed(self) -> int:
        return sum(counts.get("changed", 0) for counts in self.recap.values())


def host_inventory(host: str) -> dict[str, Any]:
    """A one-host inventory in the playbook's group; ``user@host[:port]`` sets user and port."""
    user, _, address = host.rpartition("@")
    name, _, port = address.partition(":")
    if not name:
        raise ProvisionError(f"--host {host!r}: no host name; give NAME, USER@NAME or USER@NAME:PORT")
    hostvars: dict[str, Any] = {}
    if user:
        hostvars["ansible_user"] = user
    if port:
        if not port.isdigit():
            raise ProvisionError(f"--host {host!r}: port {port!r} is not a number")
        hostvars["ansible_port"] = int(port)
    return {HOST_GROUP: {"hosts": {name: hostvars or None}}}


def site_inventory() -> dict[str, Any]:
    """The site's variables as an inventory source, given to Ansible before the user's inventory.

    They are the ``all`` group's variables there, so precedence is: role defaults,
    then the site's file, then anything the user's inventory sets (its ``all``,
    its groups, its hosts) — the order ``make verify`` reads them in.
    """
    if not SITE_VARS.exists():
        return {"all": {}}
    try:
        variables = yaml.safe_load(SITE_VARS.read_text())
    except yaml.YAMLError as exc:
        raise ProvisionError(f"{SITE_VARS}: not valid YAML: {exc}") from exc
    if not variables:
        return {"all": {}}
    if not isinstance(variables, dict):
        kind = type(variables).__name__
        raise ProvisionError(f"{SITE_VARS}: must map variable names to values, not a {kind}")
    return {"all": {"vars": variables}}


def _message(result: dict[str, Any]) -> str:
    """The one line that says why a task failed."""
    for key in ("msg", "stderr", "stdout", "module_stderr", "reason"):
        value = result.get(key)
        if value:
            text = str(value).strip().splitlines()
            return text[-1] if key in ("stderr", "module_stderr") else " ".join(text)[:500]
    return "no message (see the artifacts)"


class EventTally:
    """Feeds on ansible-runner events: per-host counts, current task, failures."""

    def __init__(self, on_change: Callable[[EventTally], None] | None = None) -> None:
        self.hosts: dict[str, HostTally] = {}
        self.failures: list[Failure] = []
        self.changed_tasks: list[tuple[str, str]] = []
        self.task = ""
        self._on_change = on_change

    def host(self, name: str) -> HostTally:
        return self.hosts.setdefault(name, HostTally())

    def __call__(self, event: dict[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        task = data.get("task", "")
        if kind == "playbook_on_task_start":
            self.task = task
            for tally in self.hosts.values():
                if not tally.unreachable:
                    tally.current_task = task
        elif host and kind in ("runner_on_start",):
            self.host(host).current_task = task
        elif host and kind == "runner_on_ok":
            tally = self.host(host)
            tally.ok += 1
            if data.get("res", {}).get("changed"):
                tally.changed += 1
                self.changed_tasks.append((host, task))
        elif host and kind == "runner_on_skipped":
            self.host(host).skipped += 1
        elif host and kind == "runner_on_failed":
            tally = self.host(host)
            if data.get("ignore_errors"):
                tally.ok += 1
            else:
                tally.failed += 1
                self.failures.append(Failure(host, task, _message(data.get("res", {}))))
        elif host and kind == "runner_on_unreachable":
            tally = self.host(host)
            tally.unreachable = True
            self.failures.append(Failure(host, task, _message(data.get("res", {})), unreachable=True))
        if self._on_change is not None:
            self._on_change(self)
        return True  # keep the event in the artifacts


def check_variables(inventory: Inventory, source: str, extravars: dict[str, Any]) -> None:
    """Every role-like variable set anywhere for the run is one a role declares; else one line each."""
    roles = ANSIBLE_DIR / "roles"
    declared, prefixes = declared_variables(roles), role_prefixes(roles)
    site = site_inventory()["all"].get("vars", {})
    where = {
        str(SITE_VARS): {"all": site},
        f"inventory {source}": {
            host: [name for name in names if name not in site] for host, names in inventory.hostvars.items()
        },
        "extra variables": {"--extra-vars": extravars},
    }
    problems = []
    for label, names_by_host in where.items():
        for name, hosts, closest in unknown_variables(names_by_host, declared, prefixes):
            setter = f" (set for {describe_hosts(hosts)})" if label.startswith("inventory") else ""
            problems.append(f"{label}: {name}{setter} is not a variable of any role; did you mean {closest}?")
    if problems:
        raise ProvisionError("\n".join(problems))


def provision(
    *,
    host: str | None = None,
    inventory: Path | None = None,
    check: bool = False,
    tags: list[str] | None = None,
    limit: str | None = None,
    extravars: dict[str, Any] | None = None,
    data_dir: Path,
    on_change: Callable[[EventTally], None] | None = None,
) -> ProvisionResult:
    """Run the provisioning playbook against one host or an inventory; never raises on host failures."""
    import ansible_runner

    if (host is None) == (inventory is None):
        raise ProvisionError("give exactly one of --host NAME or --inventory FILE")
    data_dir = data_dir.resolve()
    site_path, inventory_path, source = _write_inventories(data_dir / "inventory", host, inventory)
    playbook = ANSIBLE_DIR / PLAYBOOK
    if not playbook.exists():
        raise ProvisionError(f"playbook {playbook} is missing; set EYRIE_ANSIBLE_DIR to the ansible/ folder")
    sources = [site_path, inventory_path]  # later sources win
    targets = read_inventory(
        sources,
        user_source=Path(inventory or inventory_path),
        group=HOST_GROUP,
        limit=limit,
        ansible_dir=ANSIBLE_DIR,
    )
    check_variables(targets, source, extravars or {})

    tally = EventTally(on_change)
    ident = f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}" + ("-check" if check else "")
    with tempfile.TemporaryDirectory(prefix="eyrie-ansible-runner-") as private_data_dir:
        runner = ansible_runner.run(
            private_data_dir=private_data_dir,
            artifact_dir=str(data_dir / "artifacts"),
            suppress_env_files=True,
            project_dir=str(ANSIBLE_DIR),
            playbook=str(playbook),
            inventory=[str(path) for path in sources],
            limit=limit,
            tags=",".join(tags) if tags else None,
            extravars=extravars or None,
            cmdline="--check --diff" if check else None,
            envvars=ansible_env(ANSIBLE_DIR),
            ident=ident,
            rotate_artifacts=KEPT_ARTIFACTS,
            event_handler=tally,
            quiet=True,
        )
    return ProvisionResult(
        status=runner.status,
        rc=runner.rc if runner.rc is not None else 1,
        check=check,
        hosts=tally.hosts,
        failures=tally.failures,
        recap=_recap(runner.stats),
        artifacts=Path(runner.config.artifact_dir),
        changed_tasks=tally.changed_tasks,
    )


def _write_inventories(generated: Path, host: str | None, inventory: Path | None) -> tuple[Path, Path, str]:
    """The run's inventory sources in ``generated``: the site's variables, then ``--host``'s one-host
    inventory or the user's ``--inventory`` (checked to exist); and how the command named its hosts."""
    generated.mkdir(parents=True, exist_ok=True)
    # A group_vars link left here by an earlier eyrie would add the site's file at
    # group_vars precedence, above the user's inventory: it goes.
    if (generated / "group_vars").is_symlink():
        (generated / "group_vars").unlink()
    if host is not None:
        inventory_path = generated / "host.yml"
        inventory_path.write_text(yaml.safe_dump(host_inventory(host), sort_keys=False))
        source = f"--host {host}"
    else:
        inventory_path = Path(inventory).resolve()
        if not inventory_path.exists():
            raise ProvisionError(f"inventory {inventory} does not exist; copy ansible/inventory/example.yml")
        source = str(inventory)
    # The site's variables apply to an inventory run as to a one-host run, wherever the inventory lives.
    site_path = generated / "site.yml"
    site_path.write_text(yaml.safe_dump(site_inventory(), sort_keys=False))
    return site_path, inventory_path, source


def _recap(stats: dict[str, Any] | None) -> dict[str, dict[str, int]]:
    """ansible-runner's play recap (count name -> host -> count) turned to host -> count name -> count."""
    recap: dict[str, dict[str, int]] = {}
    for key, per_host in (stats or {}).items():
        if isinstance(per_host, dict):
            for name, count in per_host.items():
                recap.setdefault(name, {})[key] = count
    return recap
