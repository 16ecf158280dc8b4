"""``eyrie provision`` and ``eyrie verify``: what the user sees."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from pipeline.provision.runner import (
    DEFAULT_DATA_DIR,
    REPO,
    EventTally,
    ProvisionError,
    ProvisionResult,
    provision,
)

HOST_TESTS = REPO / "tests" / "host"


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
    data_dir: Path = DEFAULT_DATA_DIR,
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
        console.print(f"[red]eyrie provision: {exc}[/red]")
        return 2
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


def verify_command(host: str | None, inventory: Path | None, extra: list[str]) -> int:
    """Run the testinfra suite (tests/host) against one host over SSH, or every host of an inventory."""
    console = Console(stderr=True)
    if (host is None) == (inventory is None):
        console.print("[red]eyrie verify: give exactly one of --host NAME or --inventory FILE[/red]")
        return 2
    if host is not None:
        target = [f"--hosts=ssh://{host}"]
    else:
        if not inventory.exists():
            console.print(f"[red]eyrie verify: inventory {inventory} does not exist[/red]")
            return 2
        target = ["--hosts=ansible://gpu_hosts", f"--ansible-inventory={inventory.resolve()}"]
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
    # testinfra's ansible backend runs `ansible-inventory`: the one installed beside this Python.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "PATH": path}
    return subprocess.run(command, cwd=REPO, env=env, check=False).returncode
