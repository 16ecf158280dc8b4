"""``eyrie memory``: what this process really has, cgroup by cgroup."""

from __future__ import annotations

import json

from rich.table import Table

from pipeline.memory import format_size, memory_budget
from pipeline.report.console import wide_console

# The budget bounds steps that run here; a cluster's scheduler admits its jobs itself.
CLUSTER_NOTE = (
    "under --executor slurm this budget does not apply: steps run on the cluster's nodes, "
    "admitted by Slurm by their --mem (each limit is checked against the largest node)"
)


def memory_command(json_output: bool) -> int:
    budget = memory_budget()
    if json_output:
        print(json.dumps({**budget.as_dict(), "note": CLUSTER_NOTE}, indent=2))
        return 0
    console = wide_console()
    version = f"cgroup v{budget.cgroup_version}" if budget.cgroup_version else "no memory cgroup"
    table = Table(title=f"memory — {version}", title_justify="left")
    for column in ("where", "limit", "usage", "working set", "headroom"):
        table.add_column(column, justify="left" if column == "where" else "right")
    for reading in budget.cgroups:
        table.add_row(
            reading.path,
            format_size(reading.limit) if reading.limit is not None else "none",
            format_size(reading.usage),
            format_size(reading.working_set),
            format_size(reading.headroom) if reading.headroom is not None else "-",
        )
    table.add_row(
        "/proc/meminfo MemAvailable",
        format_size(budget.mem_total) + " total",
        "",
        "",
        format_size(budget.mem_available),
    )
    console.print(table)
    console.print(
        f"budget: [bold]{format_size(budget.available)}[/] (set by {budget.binding}); "
        "psutil and /proc/meminfo alone would say "
        f"{format_size(budget.mem_available)}",
        highlight=False,
    )
    console.print(f"[dim]{CLUSTER_NOTE}[/]", highlight=False)
    return 0
