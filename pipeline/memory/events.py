"""Being woken when a cgroup's memory events change, instead of waiting for the next poll.

v2: inotify on ``memory.events`` (the kernel sends IN_MODIFY when a counter
such as ``oom_kill`` changes). v1: an eventfd registered for
``memory.oom_control`` through ``cgroup.event_control`` (signalled when the
cgroup goes out of memory). Either way the caller selects on ``fileno()``
and then reads the counters; the notification carries no data of its own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select

from pipeline.memory.cgroup import Cgroup, CgroupV1, CgroupV2

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC


class EventNotifier:
    """A file descriptor that becomes readable when the cgroup's memory events change."""

    def __init__(self, fd: int, keep_open: list[int]) -> None:
        self._fd = fd
        self._keep_open = keep_open  # v1: the oom_control fd must stay open for the registration

    def fileno(self) -> int:
        return self._fd

    def wait(self, timeout: float) -> bool:
        """True if an event arrived within ``timeout`` seconds (and drain it)."""
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return False
        self.drain()
        return True

    def drain(self) -> None:
        """Consume the pending notification so the descriptor waits for the next one."""
        try:
            os.read(self._fd, 4096)
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in [self._fd, *self._keep_open]:
            try:
                os.close(fd)
            except OSError:
                pass


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _inotify(path: str) -> EventNotifier:
    libc = _libc()
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1 failed")
    if libc.inotify_add_watch(fd, path.encode(), _IN_MODIFY) < 0:
        err = ctypes.get_errno()
        os.close(fd)
        raise OSError(err, f"inotify_add_watch({path}) failed")
    return EventNotifier(fd, [])


def _oom_eventfd(cgroup: CgroupV1) -> EventNotifier:
    efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    control = os.open(cgroup.path / "memory.oom_control", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with open(cgroup.path / "cgroup.event_control", "w") as fh:
            fh.write(f"{efd} {control}")
    except OSError:
        os.close(efd)
        os.close(control)
        raise
    return EventNotifier(efd, [control])


def event_notifier(cgroup: Cgroup) -> EventNotifier | None:
    """A notifier for the cgroup's memory events, or None where the kernel offers none (then poll)."""
    try:
        if isinstance(cgroup, CgroupV2):
            return _inotify(str(cgroup.path / "memory.events"))
        if isinstance(cgroup, CgroupV1):
            return _oom_eventfd(cgroup)
    except OSError:
        return None
    return None
