"""Append-only JSONL that survives ``kill -9``: the generation step's resume state.

Rows are appended in batches, each batch flushed and fsynced. A kill can only tear
the tail, so on open everything after the last newline is cut off and the ids of
the complete lines are the rows already done. Completion order does not matter:
resume is by id.

Rows arrive encoded (``json_text.utf8_json``), one by one before they join a batch:
text that is not valid Unicode is refused for that row alone, never in the middle of
writing a batch.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.contract.atomic import fsync_dir
from pipeline.memory.units import MIB
from pipeline.steps.generate.json_text import loads

_CHUNK = MIB


class StoreError(RuntimeError):
    pass


def repair_tail(path: Path) -> int:
    """Cut a partly written last line off ``path``; returns the bytes removed."""
    if not path.exists():
        return 0
    size = path.stat().st_size
    with open(path, "rb+") as fh:
        end = size
        while end > 0:
            start = max(0, end - _CHUNK)
            fh.seek(start)
            chunk = fh.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        else:
            keep = 0
        if keep != size:
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
    return size - keep


def read_ids(path: Path) -> list[str]:
    """The ids of every line of ``path`` (after ``repair_tail``), in file order."""
    ids: list[str] = []
    if not path.exists():
        return ids
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            try:
                ids.append(loads(line)["id"])
            except (ValueError, KeyError, TypeError) as exc:
                raise StoreError(
                    f"{path}:{number} is not a complete row ({exc}); only the last line can be "
                    "torn by a kill, so this file was edited or damaged: move it away to start over"
                ) from None
    return ids


class JsonlAppender:
    """Appends lines to a JSONL file; ``write_lines`` returns once they are on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        existed = path.exists()
        self._fh = open(path, "ab")
        if not existed:
            fsync_dir(path.parent)

    def write_lines(self, lines: list[bytes]) -> None:
        """Append ``lines`` (encoded rows, each ending in a newline), flushed and fsynced."""
        if not lines:
            return
        self._fh.write(b"".join(lines))
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        self._fh.close()
