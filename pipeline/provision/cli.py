"""``eyrie provision`` and ``eyrie verify``: what the user sees."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.contract.exits import EXIT_BAD_INPUT
from pipeline.provision.errors import ProvisionError
from pipeline.provision.inventory import ansible_env, read_inventory
from pipeline.provision.runner import (
    ANSIBLE_DIR,
    HOST_GROUP,
    REPO,
    EventTally,
    ProvisionResult,
    provision,
)

HOST_TESTS = REPO / "tests" / "host"
# ssh's own exit status when it could not connect (the remote command's otherwise).
SSH_FAILED = 255


def _print_errors(console: Console, command: str, text: str) -> None:
    """One red line per problem, never wrapped or marked up (paths and names stay whole)."""
    for line in text.splitlines():
        console.print(f"eyrie {command}: {line}", style="red", markup=False, highlight=False, soft_wrap=True)


def _progress_table(tally: EventTally) -> Table:
    table = Table(title=f"task: {tally.task}" if tally.task else "gathering facts", title_justify="left")
    for column in ("host", "ok", "changed", "failed", "skipped", "now"):
        table.add_column(
            column, justify="right" if column in ("ok", "changed", "failed", "skipped") else "left"
        )
    for name, host in sorted(tally.hosts.items()):
        now = "UNREACHABLE" if host.unreachable else host.current_task
        table.add_row(name, str(host.ok), str(host.changed), str(host.failed), str(host.skipped), now)
    return table


def _recap_table(result: ProvisionResult) -> Table:
    table = Table(
        title="recap" + (" (check mode: nothing was changed)" if result.check else ""), title_justify="left"
    )
    columns = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
    table.add_column("host")
    for column in columns:
        table.add_column(column, justify="right")
    keys = {"unreachable": "dark", "failed": "failures"}
    for name, counts in sorted(result.recap.items()):
        table.add_row(name, *(str(counts.get(keys.get(c, c), 0)) for c in columns))
    return table


def provision_command(
    host: str | None,
    inventory: Path | None,
    check: bool,
    tags: list[str] | None,
    limit: str | None,
    data_dir: Path,
) -> int:
    console = Console(stderr=True)
    live = Live(console=console, refresh_per_second=4, transient=True)
    try:
        with live:
            result = provision(
                host=host,
                inventory=inventory,
                check=check,
                tags=tags,
                limit=limit,
                data_dir=data_dir,
                on_change=lambda tally: live.update(_progress_table(tally)),
            )
    except ProvisionError as exc:
        _print_errors(console, "provision", str(exc))
        return EXIT_BAD_INPUT
    console.print(_recap_table(result))
    console.print(f"artifacts: {result.artifacts}")
    for failure in result.failures:
        console.print(f"[red]{failure.line()}[/red]")
    if result.succeeded:
        console.print(
            f"[green]{'check passed' if check else 'provisioned'}: "
            f"{len(result.recap)} host(s), {result.changed()} change(s)[/green]"
        )
        return 0
    if not result.failures:
        console.print(
            f"[red]ansible-playbook ended {result.status} (rc {result.rc}) with no failed task; "
            f"see {result.artifacts}/stdout[/red]"
        )
    return result.rc or 1


def _testinfra_options(extra: list[str]) -> dict:
    """The connection options among the arguments passed on to pytest, as testinfra reads them."""
    parser = argparse.ArgumentParser(add_help=False)
    for option in ("--connection", "--ssh-config", "--ssh-identity-file", "--ssh-extra-args", "--sudo-user"):
        parser.add_argument(option)
    parser.add_argument("--force-ansible", action="store_true")
    known, _ = parser.parse_known_args(extra)
    return {name: value for name, value in vars(known).items() if value}


def unreachable_hosts(hostspecs: list[str], ansible_inventory: Path | None, extra: list[str]) -> list[str]:
    """One line per host the suite could not run commands on (over SSH, with sudo), saying why."""
    import testinfra

    options = _testinfra_options(extra)
    if ansible_inventory is not None:
        options["ansible_inventory"] = str(ansible_inventory)
    hosts = testinfra.get_hosts(hostspecs, sudo=True, **options)

    def probe(host) -> str | None:
        name = host.backend.get_pytest_id().split("://")[-1]
        try:
            result = host.run("true")
        except RuntimeError as exc:  # testinfra's SSH backends raise when ssh itself fails (exit 255)
            result = exc.args[0] if exc.args and hasattr(exc.args[0], "rc") else None
            if result is None:
                return f"{name}: cannot be reached: {' '.join(str(exc).split())}"
        said = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        reason = said[-1] if said else f"exit status {result.rc}"
        if result.rc == SSH_FAILED:
            return f"{name}: cannot be reached over SSH: {reason}"
        if result.rc != 0:
            return f"{name}: reached, but `sudo true` failed (the checks run with sudo): {reason}"
        return None

    with ThreadPoolExecutor(max_workers=min(16, max(1, len(hosts)))) as pool:
        return [line for line in pool.map(probe, hosts) if line]


def verify_command(host: str | None, inventory: Path | None, extra: list[str]) -> int:
    """Run the testinfra suite (tests/host) against one host over SSH, or every host of an inventory."""
    console = Console(stderr=True)

    def error(text: str) -> None:
        _print_errors(console, "verify", text)

    if (host is None) == (inventory is None):
        error("give exactly one of --host NAME or --inventory FILE")
        return EXIT_BAD_INPUT
    if host is not None:
        hostspecs, ansible_inventory = [f"ssh://{host}"], None
        target = [f"--hosts=ssh://{host}"]
    else:
        if not inventory.exists():
            error(f"inventory {inventory} does not exist")
            return EXIT_BAD_INPUT
        ansible_inventory = inventory.resolve()
        try:
            read_inventory(
                [ansible_inventory], user_source=inventory, group=HOST_GROUP, ansible_dir=ANSIBLE_DIR
            )
        except ProvisionError as exc:
            error(str(exc))
            return EXIT_BAD_INPUT
        hostspecs = [f"ansible://{HOST_GROUP}"]
        target = [f"--hosts=ansible://{HOST_GROUP}", f"--ansible-inventory={ansible_inventory}"]
    # testinfra's ansible backend runs `ansible-inventory`, here and in pytest: the one beside this Python.
    os.environ["PATH"] = ansible_env(ANSIBLE_DIR)["PATH"]
    unreachable = unreachable_hosts(hostspecs, ansible_inventory, extra)
    if unreachable:
        error("\n".join(unreachable))
        return 1
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(HOST_TESTS),
        "-m",
        "host",
        "--sudo",
        "-p",
        "no:cacheprovider",
        *target,
        *extra,
    ]
    return subprocess.run(command, cwd=REPO, check=False).returncode
