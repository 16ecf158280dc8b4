"""cgroup v2 and v1 code paths against directory trees laid out as the kernel lays them out.

The development and CI machines run cgroup v1, so the v2 paths are proven here
on trees with the files and contents an Ubuntu 24.04 host shows.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipeline.memory import CgroupV1, CgroupV2, current_cgroup, detect_hierarchy, memory_budget, step_parent
from pipeline.memory.cgroup import SUPERVISOR_LEAF

GiB, MiB = 2**30, 2**20

MEMINFO = """MemTotal:       263846912 kB
MemFree:        200000000 kB
MemAvailable:   251658240 kB
Buffers:          102400 kB
"""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_cgroup_files(
    directory: Path,
    *,
    limit: str,
    current: int,
    anon: int,
    inactive_file: int,
    oom_kill: int = 0,
    peak: int | None = None,
    procs: str = "",
) -> None:
    _write(directory / "memory.max", limit + "\n")
    _write(directory / "memory.current", f"{current}\n")
    _write(
        directory / "memory.stat",
        f"anon {anon}\nfile {current - anon}\nkernel 0\n"
        f"inactive_file {inactive_file}\nactive_file {current - anon - inactive_file}\n",
    )
    _write(
        directory / "memory.events",
        f"low 0\nhigh 0\nmax {oom_kill * 3}\noom {oom_kill}\noom_kill {oom_kill}\noom_group_kill 0\n",
    )
    _write(directory / "memory.swap.max", "max\n")
    if peak is not None:
        _write(directory / "memory.peak", f"{peak}\n")
    _write(directory / "cgroup.controllers", "cpu io memory pids\n")
    _write(directory / "cgroup.subtree_control", "\n")
    _write(directory / "cgroup.procs", procs)


@pytest.fixture
def v2_host(tmp_path: Path) -> Path:
    """An Ubuntu 24.04 host: cgroup2 at /sys/fs/cgroup, eyrie in system.slice/eyrie.service (8 GiB)."""
    root = tmp_path
    _write(
        root / "proc/self/mountinfo",
        "24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n"
        "31 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
        "rw,nsdelegate,memory_recursiveprot\n",
    )
    _write(root / "proc/self/cgroup", "0::/system.slice/eyrie.service\n")
    _write(root / "proc/meminfo", MEMINFO)
    cg = root / "sys/fs/cgroup"
    _write(cg / "cgroup.controllers", "cpuset cpu io memory hugetlb pids rdma misc\n")
    _write(cg / "cgroup.subtree_control", "cpu io memory pids\n")
    v2_cgroup_files(cg / "system.slice", limit="max", current=3 * GiB, anon=2 * GiB, inactive_file=GiB // 2)
    v2_cgroup_files(
        cg / "system.slice/eyrie.service",
        limit=str(8 * GiB),
        current=GiB,
        anon=600 * MiB,
        inactive_file=256 * MiB,
        oom_kill=2,
        peak=5 * GiB,
        procs="1234\n5678\n",
    )
    return root


def test_v2_detects_hierarchy_and_own_cgroup(v2_host: Path):
    hierarchy = detect_hierarchy(v2_host / "proc", v2_host)
    assert hierarchy.version == 2 and hierarchy.mount == v2_host / "sys/fs/cgroup"
    own = current_cgroup(v2_host / "proc", v2_host)
    assert isinstance(own, CgroupV2)
    assert own.path == v2_host / "sys/fs/cgroup/system.slice/eyrie.service"
    assert own.limit() == 8 * GiB
    assert own.usage() == GiB
    assert own.peak() == 5 * GiB
    assert own.oom_kills() == 2
    sample = own.sample()
    assert (sample.total, sample.anon) == (GiB, 600 * MiB)
    assert own.procs() == [1234, 5678]
    assert [c.relative for c in own.ancestors()] == ["/system.slice/eyrie.service", "/system.slice", "/"]
    assert own.parent().limit() is None  # "max"


def test_v2_budget_is_the_tightest_ancestor_not_meminfo(v2_host: Path):
    budget = memory_budget(v2_host / "proc", v2_host)
    assert budget.cgroup_version == 2
    assert budget.mem_available == 240 * GiB
    # 8 GiB limit less the working set (1 GiB usage less 256 MiB inactive page cache)
    assert budget.available == 8 * GiB - (GiB - 256 * MiB)
    assert budget.binding.endswith("system.slice/eyrie.service")


def test_v2_budget_falls_back_to_memavailable(v2_host: Path):
    (v2_host / "sys/fs/cgroup/system.slice/eyrie.service/memory.max").write_text("max\n")
    budget = memory_budget(v2_host / "proc", v2_host)
    assert budget.available == 240 * GiB and budget.binding == "MemAvailable"


def test_v2_step_parent_moves_processes_to_a_leaf_and_delegates_memory(v2_host: Path):
    own = current_cgroup(v2_host / "proc", v2_host)
    parent = step_parent(own)
    assert parent == own
    leaf = own.path / SUPERVISOR_LEAF
    assert leaf.is_dir()
    # the kernel moves one pid per write; this tree keeps the last one written
    assert (leaf / "cgroup.procs").read_text() == "5678"
    assert (own.path / "cgroup.subtree_control").read_text() == "+memory"
    # once moved, this process's cgroup is the leaf: the parent is found again
    assert step_parent(CgroupV2(own.mount, own.relative + "/" + SUPERVISOR_LEAF)) == own


def test_v2_step_parent_without_memory_controller_says_how_to_fix(v2_host: Path):
    own = current_cgroup(v2_host / "proc", v2_host)
    (own.path / "cgroup.controllers").write_text("pids\n")
    with pytest.raises(Exception, match="Delegate=yes"):
        step_parent(own)


def test_v2_set_limit_disables_swap(v2_host: Path):
    own = current_cgroup(v2_host / "proc", v2_host)
    child = own.child("step-1")
    child.create()
    v2_cgroup_files(child.path, limit="max", current=0, anon=0, inactive_file=0)  # as the kernel fills it
    child.set_limit(512 * MiB)
    assert (child.path / "memory.max").read_text() == str(512 * MiB)
    assert (child.path / "memory.swap.max").read_text() == "0"


def test_v1_inside_a_container_sees_its_own_cgroup_as_root(tmp_path: Path):
    """Docker on cgroup v1: /proc/self/cgroup names /docker/<id>, the mount's root is that cgroup."""
    root = tmp_path
    _write(
        root / "proc/self/mountinfo",
        "700 690 0:32 /docker/abc123 /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
        "701 690 0:33 /docker/abc123 /sys/fs/cgroup/pids ro,nosuid - cgroup cgroup rw,pids\n",
    )
    _write(root / "proc/self/cgroup", "5:pids:/docker/abc123\n4:memory:/docker/abc123\n")
    _write(root / "proc/meminfo", MEMINFO)
    mem = root / "sys/fs/cgroup/memory"
    _write(mem / "memory.limit_in_bytes", f"{2 * GiB}\n")
    _write(mem / "memory.usage_in_bytes", f"{GiB}\n")
    _write(mem / "memory.max_usage_in_bytes", f"{GiB + MiB}\n")
    _write(
        mem / "memory.stat",
        f"cache {MiB}\nrss {GiB - MiB}\ntotal_cache {MiB}\ntotal_rss {GiB - MiB}\n"
        f"total_inactive_file {MiB}\n",
    )
    _write(mem / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    own = current_cgroup(root / "proc", root)
    assert isinstance(own, CgroupV1) and own.path == mem and own.relative == "/"
    assert own.oom_kills() == 3 and own.peak() == GiB + MiB
    budget = memory_budget(root / "proc", root)
    assert budget.available == 2 * GiB - (GiB - MiB)


def test_v1_unlimited_reads_as_none(tmp_path: Path):
    _write(tmp_path / "memory.limit_in_bytes", "9223372036854771712\n")
    assert CgroupV1(tmp_path).limit() is None


def test_real_cgroup_of_this_process_is_readable():
    own = current_cgroup()
    assert own.exists()
    assert own.usage() > 0
    assert os.getpid() in own.procs()
