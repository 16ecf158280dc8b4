"""Memory cgroups, v1 and v2, read and written through their files.

Every class takes the filesystem paths it reads as arguments (``mount``,
``proc``), so the same code runs on a real host and against a directory tree
laid out as the kernel lays it out.
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass
from pathlib import Path

UNLIMITED_V1 = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX pages: anything this large


class CgroupError(RuntimeError):
    """A cgroup could not be read, created or written; the message says how to fix it."""


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED_V1 else value


def _read_keyed(path: Path) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control)."""
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return {}
    out: dict[str, int] = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[key] = int(value)
    return out


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except PermissionError as exc:
        raise CgroupError(
            f"cannot write {path}: permission denied; run eyrie as root, or under "
            "`systemd-run --user --scope -p Delegate=yes eyrie …` so it owns a delegated cgroup"
        ) from exc
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


@dataclass(frozen=True)
class MemorySample:
    """One reading of a cgroup. ``total`` includes page cache; ``anon`` is anonymous memory only;
    ``major_faults`` counts, since the cgroup began, pages its processes had to read back in."""

    total: int
    anon: int
    file: int
    major_faults: int = 0


class Cgroup:
    """A memory cgroup: its directory under the memory controller's mount."""

    version: int
    path: Path
    mount: Path

    def __init__(self, mount: Path, relative: str = "/") -> None:
        self.mount = Path(mount)
        self.relative = "/" + relative.strip("/")
        self.path = self.mount / relative.strip("/") if relative.strip("/") else self.mount

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cgroup) and (self.version, self.path) == (other.version, other.path)

    def __hash__(self) -> int:
        return hash((self.version, self.path))

    # -- reading -------------------------------------------------------------------------
    def limit(self) -> int | None:
        raise NotImplementedError

    def usage(self) -> int:
        raise NotImplementedError

    def peak(self) -> int | None:
        """The high-water mark of ``usage`` (page cache included); None where the kernel has none."""
        raise NotImplementedError

    def oom_kills(self) -> int:
        """Processes the OOM killer has killed in this cgroup (and below, where the kernel counts so)."""
        raise NotImplementedError

    def stat(self) -> dict[str, int]:
        return _read_keyed(self.path / "memory.stat")

    def sample(self) -> MemorySample:
        raise NotImplementedError

    def working_set(self) -> int:
        """Usage less inactive page cache: what the kernel cannot simply drop (as the kubelet counts it)."""
        raise NotImplementedError

    def procs(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def exists(self) -> bool:
        return self.path.is_dir()

    def parent(self) -> Cgroup | None:
        if self.relative == "/":
            return None
        return type(self)(self.mount, str(Path(self.relative).parent))

    def ancestors(self) -> list[Cgroup]:
        """This cgroup and every ancestor up to the mount's root, nearest first."""
        chain: list[Cgroup] = [self]
        while (up := chain[-1].parent()) is not None:
            chain.append(up)
        return chain

    # -- writing -------------------------------------------------------------------------
    def child(self, name: str) -> Cgroup:
        return type(self)(self.mount, f"{self.relative.rstrip('/')}/{name}")

    def create(self) -> None:
        try:
            self.path.mkdir()
        except FileExistsError:
            pass
        except PermissionError as exc:
            raise CgroupError(
                f"cannot create cgroup {self.path}: permission denied; run eyrie as root, or under "
                "`systemd-run --user --scope -p Delegate=yes eyrie …` so it owns a delegated cgroup"
            ) from exc
        except OSError as exc:
            raise CgroupError(f"cannot create cgroup {self.path}: {exc.strerror}") from exc

    def set_limit(self, limit_bytes: int) -> None:
        """Limit memory and memory+swap to the same figure: a step never swaps."""
        raise NotImplementedError

    def add_process(self, pid: int) -> None:
        _write(self.path / "cgroup.procs", str(pid))

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """Signal every process in the cgroup; returns how many were signalled."""
        count = 0
        for pid in self.procs():
            try:
                os.kill(pid, sig)
                count += 1
            except ProcessLookupError:
                pass
        return count

    def remove(self) -> None:
        """Remove the (empty) cgroup directory; a cgroup with live processes is left alone."""
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise


class CgroupV1(Cgroup):
    version = 1

    def limit(self) -> int | None:
        return _read_int(self.path / "memory.limit_in_bytes")

    def usage(self) -> int:
        return _read_int(self.path / "memory.usage_in_bytes") or 0

    def peak(self) -> int | None:
        return _read_int(self.path / "memory.max_usage_in_bytes")

    def oom_kills(self) -> int:
        return _read_keyed(self.path / "memory.oom_control").get("oom_kill", 0)

    def sample(self) -> MemorySample:
        stat = self.stat()
        # total_* are hierarchical (this cgroup and its children); plain keys are not.
        anon = stat.get("total_rss", stat.get("rss", 0))
        file = stat.get("total_cache", stat.get("cache", 0))
        faults = stat.get("total_pgmajfault", stat.get("pgmajfault", 0))
        return MemorySample(total=self.usage(), anon=anon, file=file, major_faults=faults)

    def working_set(self) -> int:
        stat = self.stat()
        inactive = stat.get("total_inactive_file", stat.get("inactive_file", 0))
        return max(0, self.usage() - inactive)

    def set_limit(self, limit_bytes: int) -> None:
        limit = self.path / "memory.limit_in_bytes"
        memsw = self.path / "memory.memsw.limit_in_bytes"
        has_memsw = memsw.exists()
        # memsw must stay >= limit at every moment: order the writes by direction.
        current = self.limit() or UNLIMITED_V1
        if has_memsw and limit_bytes > current:
            _write(memsw, str(limit_bytes))
            _write(limit, str(limit_bytes))
        else:
            _write(limit, str(limit_bytes))
            if has_memsw:
                _write(memsw, str(limit_bytes))
        if not has_memsw:
            _write(self.path / "memory.swappiness", "0")


class CgroupV2(Cgroup):
    version = 2

    def limit(self) -> int | None:
        return _read_int(self.path / "memory.max")

    def usage(self) -> int:
        return _read_int(self.path / "memory.current") or 0

    def peak(self) -> int | None:
        return _read_int(self.path / "memory.peak")  # kernel 5.19+

    def oom_kills(self) -> int:
        return _read_keyed(self.path / "memory.events").get("oom_kill", 0)

    def sample(self) -> MemorySample:
        stat = self.stat()
        return MemorySample(
            total=self.usage(),
            anon=stat.get("anon", 0),
            file=stat.get("file", 0),
            major_faults=stat.get("pgmajfault", 0),
        )

    def working_set(self) -> int:
        return max(0, self.usage() - self.stat().get("inactive_file", 0))

    def set_limit(self, limit_bytes: int) -> None:
        _write(self.path / "memory.max", str(limit_bytes))
        if (self.path / "memory.swap.max").exists():
            _write(self.path / "memory.swap.max", "0")

    def controllers(self) -> set[str]:
        try:
            return set((self.path / "cgroup.controllers").read_text().split())
        except FileNotFoundError:
            return set()

    def subtree_controllers(self) -> set[str]:
        try:
            return set((self.path / "cgroup.subtree_control").read_text().split())
        except FileNotFoundError:
            return set()

    def enable_memory_for_children(self) -> None:
        if "memory" not in self.subtree_controllers():
            _write(self.path / "cgroup.subtree_control", "+memory")


@dataclass(frozen=True)
class Hierarchy:
    """Where the memory controller is mounted, which version it is, and which cgroup the
    mount shows as its root (a container sees its own cgroup as ``/``)."""

    version: int
    mount: Path
    mount_root: str = "/"


def _mounts(proc: Path) -> list[tuple[str, str, str, str]]:
    """(root within the hierarchy, mount point, fs type, super options) from mountinfo."""
    out = []
    for line in (proc / "self" / "mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 5 and len(rfields) >= 3:
            out.append((fields[3], fields[4].replace("\\040", " "), rfields[0], rfields[2]))
    return out


def detect_hierarchy(proc: Path = Path("/proc"), root: Path = Path("/")) -> Hierarchy:
    """The memory controller's hierarchy: v1 if a v1 ``memory`` mount exists, else the v2 mount."""
    v2 = None
    for mount_root, mount_point, fstype, options in _mounts(proc):
        if fstype == "cgroup" and "memory" in options.split(","):
            return Hierarchy(1, root / mount_point.lstrip("/"), mount_root)
        if fstype == "cgroup2" and v2 is None:
            v2 = Hierarchy(2, root / mount_point.lstrip("/"), mount_root)
    if v2 is not None:
        return v2
    raise CgroupError(
        "no memory cgroup is mounted (neither a cgroup v1 'memory' hierarchy nor cgroup2); "
        "mount one, e.g. `mount -t cgroup2 none /sys/fs/cgroup`"
    )


def cgroup_of(pid: int | str = "self", proc: Path = Path("/proc"), root: Path = Path("/")) -> Cgroup:
    """The memory cgroup a process is in."""
    hierarchy = detect_hierarchy(proc, root)
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hierarchy.mount_root != "/" and path.startswith(hierarchy.mount_root):
            path = path[len(hierarchy.mount_root) :] or "/"
        if hierarchy.version == 1 and "memory" in controllers.split(","):
            return CgroupV1(hierarchy.mount, path)
        if hierarchy.version == 2 and hid == "0":
            return CgroupV2(hierarchy.mount, path)
    raise CgroupError(f"{proc / str(pid) / 'cgroup'} names no memory cgroup")


def cgroup_at(path: str | Path) -> Cgroup | None:
    """The cgroup whose directory is ``path`` (as a ledger records it), read on its own: its
    ancestors are not known. None when the directory is gone or is no memory cgroup (a container
    id, say)."""
    path = Path(path)
    if not path.is_absolute():
        return None
    if (path / "memory.current").is_file():
        return CgroupV2(path)
    if (path / "memory.usage_in_bytes").is_file():
        return CgroupV1(path)
    return None


def current_cgroup(proc: Path = Path("/proc"), root: Path = Path("/")) -> Cgroup:
    return cgroup_of("self", proc, root)


SUPERVISOR_LEAF = "eyrie-supervisor"
STEPS_GROUP = "eyrie"


def step_parent(own: Cgroup | None = None) -> Cgroup:
    """The cgroup under which per-step cgroups are created, made ready for them.

    v1: a child ``eyrie`` of this process's cgroup. v2 forbids processes in a cgroup
    that hands controllers to children ("no internal processes"), so the processes of
    this cgroup first move into a leaf ``eyrie-supervisor``; then ``+memory`` is enabled
    in ``cgroup.subtree_control`` and steps become siblings of that leaf.
    """
    own = own or current_cgroup()
    if isinstance(own, CgroupV1):
        parent = own.child(STEPS_GROUP)
        parent.create()
        return parent
    assert isinstance(own, CgroupV2)
    if own.path.name == SUPERVISOR_LEAF and own.parent() is not None:
        return own.parent()  # already moved by an earlier call in this process
    if "memory" not in own.controllers():
        raise CgroupError(
            f"the memory controller is not available in {own.path} (cgroup.controllers lacks "
            "'memory'); run eyrie under `systemd-run --user --scope -p Delegate=yes eyrie …` "
            "or as root in a cgroup whose parent delegates memory"
        )
    if "memory" not in own.subtree_controllers():
        leaf = own.child(SUPERVISOR_LEAF)
        leaf.create()
        for pid in own.procs():
            try:
                leaf.add_process(pid)
            except CgroupError:
                if pid == os.getpid():
                    raise
                # a process that exited meanwhile, or a kernel thread: nothing to move
        own.enable_memory_for_children()
    return own
