"""Facts about memory: cgroup v1/v2 limits, usage, peaks, OOM kills, the budget a process has, and
how many workers of a given size it holds.

This layer uses nothing else of eyrie's.
"""

from pipeline.memory.budget import Budget, CgroupReading, memory_budget, plan_workers, read_meminfo
from pipeline.memory.cgroup import (
    Cgroup,
    CgroupError,
    CgroupV1,
    CgroupV2,
    MemorySample,
    cgroup_at,
    cgroup_of,
    current_cgroup,
    detect_hierarchy,
    step_parent,
)
from pipeline.memory.units import GIB, KIB, MIB, TIB, format_duration, format_size, parse_duration, parse_size

__all__ = [
    "GIB",
    "KIB",
    "MIB",
    "TIB",
    "Budget",
    "Cgroup",
    "CgroupError",
    "CgroupReading",
    "CgroupV1",
    "CgroupV2",
    "MemorySample",
    "cgroup_at",
    "cgroup_of",
    "current_cgroup",
    "detect_hierarchy",
    "format_duration",
    "format_size",
    "memory_budget",
    "parse_duration",
    "parse_size",
    "plan_workers",
    "read_meminfo",
    "step_parent",
]
