"""Files written whole or not at all: through a temporary name, fsynced, renamed into place.

What a reader finds under the final name is complete, after a crash or a power loss too; a write
killed midway leaves only its temporary, which :func:`final_name_of` recognizes.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """Every file under ``path`` (a file or a folder), then each folder bottom-up: after a power
    loss the renamed name holds what was written, not a file of zeros or a missing entry."""
    if not path.is_dir():
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
        return
    for root, _, files in os.walk(path, topdown=False):
        for name in files:
            with open(os.path.join(root, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(Path(root))


def temporary_name(path: str | os.PathLike[str]) -> str:
    """What :func:`atomic_path` names ``path`` while it is written (a hidden sibling, this process's)."""
    return f".{Path(path).name}.tmp-{os.getpid()}"


_TEMPORARY = re.compile(r"^\.(?P<final>.+)\.tmp-\d+$")


def final_name_of(temporary: str) -> str | None:
    """The name a temporary of :func:`atomic_path` (any process's) stands for; None for another name.

    A write killed midway leaves its temporary behind: the one process that writes a folder removes
    what it finds this way before writing again.
    """
    match = _TEMPORARY.match(temporary)
    return match.group("final") if match else None


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success it is fsynced and renamed onto ``path``.

    A folder is fsynced whole (every file in it, and the folder) before the rename, and the parent
    after it. On an exception the temporary file or folder is removed, so nothing half-written
    ever sits under the final name. A folder at ``path`` is replaced only by a folder (an earlier
    write of the same output); a file written where a folder is raises IsADirectoryError, and the
    folder is left as it was.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(temporary_name(final))
    _remove(tmp)
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.is_dir() and not final.is_symlink() and not tmp.is_dir():
            raise IsADirectoryError(f"{final} is a folder; write the file under another name")
        if tmp.is_dir():
            _remove(final)  # a folder cannot be renamed over; a file is swapped in, its name never missing
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        _remove(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        for child in sorted(path.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() and not child.is_symlink() else child.unlink()
        path.rmdir()
    elif path.exists() or path.is_symlink():
        path.unlink()


__all__ = ["atomic_path", "atomic_write_text", "final_name_of", "fsync_dir", "temporary_name"]
