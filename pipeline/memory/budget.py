"""The memory a process really has.

psutil and /proc/meminfo see the host. Inside a container, or under any
limited cgroup, what a process can still allocate is the minimum of the host's
MemAvailable and, for every ancestor cgroup with a limit, that limit less the
cgroup's working set (usage less the inactive page cache the kernel can drop).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.memory.cgroup import Cgroup, CgroupError, current_cgroup
from pipeline.memory.units import KIB


@dataclass(frozen=True)
class CgroupReading:
    path: str
    version: int
    limit: int | None
    usage: int
    working_set: int

    @property
    def headroom(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.working_set)


@dataclass(frozen=True)
class Budget:
    """What this process can still allocate, and which fact sets that figure."""

    available: int
    mem_total: int
    mem_available: int
    cgroup_version: int | None
    cgroups: list[CgroupReading] = field(default_factory=list)
    binding: str = "MemAvailable"

    def as_dict(self) -> dict:
        out = asdict(self)
        for reading, raw in zip(self.cgroups, out["cgroups"], strict=True):
            raw["headroom"] = reading.headroom
        return out


def read_meminfo(proc: Path = Path("/proc")) -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    for line in (proc / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * (KIB if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def read_cgroup_chain(cgroup: Cgroup) -> list[CgroupReading]:
    return [
        CgroupReading(
            path=str(c.path),
            version=c.version,
            limit=c.limit(),
            usage=c.usage(),
            working_set=c.working_set(),
        )
        for c in cgroup.ancestors()
        if c.exists()
    ]


def memory_budget(proc: Path = Path("/proc"), root: Path = Path("/"), cgroup: Cgroup | None = None) -> Budget:
    """The budget of the calling process (or of ``cgroup``), cgroup-aware."""
    meminfo = read_meminfo(proc)
    mem_available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    try:
        own = cgroup or current_cgroup(proc, root)
    except CgroupError:
        own = None
    readings = read_cgroup_chain(own) if own is not None else []
    available, binding = mem_available, "MemAvailable"
    for reading in readings:
        if reading.headroom is not None and reading.headroom < available:
            available, binding = reading.headroom, f"cgroup {reading.path}"
    return Budget(
        available=available,
        mem_total=meminfo.get("MemTotal", 0),
        mem_available=mem_available,
        cgroup_version=own.version if own else None,
        cgroups=readings,
        binding=binding,
    )


def plan_workers(tasks: int, worker_memory: int, requested: int | None) -> tuple[int, dict]:
    """How many worker processes of ``worker_memory`` bytes each run at once: what this process's
    budget holds, at most one per CPU (and per task), and at most ``requested``; with the facts
    that decided it."""
    budget = memory_budget()
    by_memory = max(1, budget.available // worker_memory)
    cpus = len(os.sched_getaffinity(0))
    workers = max(1, min(tasks, cpus, by_memory, requested or tasks))
    facts = {
        "workers": workers,
        "worker_memory": worker_memory,
        "budget_available": budget.available,
        "budget_binding": budget.binding,
        "cpus": cpus,
    }
    return workers, facts
