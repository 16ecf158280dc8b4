"""A full disk, said as a fact: which filesystem ran out, and how much it had left."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

from pipeline.memory import format_size

NO_SPACE = os.strerror(errno.ENOSPC)  # "No space left on device", as a step's tools print it


class RunDirFull(RuntimeError):
    """A run cannot start: its run directory's filesystem has no space left."""


def mount_point(path: str | os.PathLike[str]) -> Path:
    """The mount point of the filesystem ``path`` is on."""
    here = Path(os.path.abspath(path))
    while not here.exists() or (not os.path.ismount(here) and here != here.parent):
        here = here.parent
    return here


def space_left(path: str | os.PathLike[str]) -> str:
    """Where ``path``'s filesystem is mounted and what it has free now: ``/mnt/run had 0 B free of
    2.00 MiB``."""
    mount = mount_point(path)
    fs = os.statvfs(mount)
    free, size = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    return f"{mount} had {format_size(free)} free of {format_size(size)}"


def no_space_note(
    path: str | os.PathLike[str], log_error: str | None, lines: Iterable[str], given_back: int = 0
) -> str | None:
    """What an attempt's reason adds when it ran out of disk: its log could not be written for want of
    space (``log_error``), or its own output says so; None otherwise. ``path``: its directory;
    ``given_back``: what the runner freed since to record it (the ledger's reserve), counted free."""
    said = any(NO_SPACE.lower() in line.lower() for line in lines)
    if not said and not (log_error and NO_SPACE in log_error):
        return None
    note = f"no space left on device under {path}: {space_left(path)} when it ended"
    if given_back:
        note += f" ({format_size(given_back)} of it the ledger's reserve, given back to record this)"
    return note + (f"; {log_error}" if log_error else "")
