"""Local JSON sources, read record by record as they are: JSON Lines, or one JSON array.

An array is decoded object by object from a bounded window of the file, never loaded whole
(ShareGPT V3 ships as one 125 MB array). A file cut short, as downloads and some shipped files
are, keeps every complete record; the bytes after the last one are counted and said, not fatal.
Anything else that is not JSON is named by file and line.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from pipeline.memory.units import MIB

CHUNK = MIB
"""Bytes read at a time; a record longer than what is held doubles the next read."""
_LITERALS = ("true", "false", "null")
_NUMBER_PREFIX = re.compile(r"-?[0-9]*\.?[0-9]*(?:[eE][-+]?[0-9]*)?")
_decoder = json.JSONDecoder()
_BOM = codecs.BOM_UTF8
_SPACE = re.compile(r"[ \t\n\r]*")


class JsonFileError(ValueError):
    """A local file that is not JSON records; the message is one line naming the file and line."""


def ends_early(exc: json.JSONDecodeError, text: str) -> bool:
    """Whether ``text`` failed to decode only because it ends inside a value (a file cut short),
    not because of a wrong character."""
    if exc.msg.startswith("Unterminated string"):  # the decoder met the end before the closing quote
        return True
    rest = text[exc.pos :].strip()
    if exc.msg.startswith("Invalid \\uXXXX escape"):  # the end came inside the escape's 4 hex digits
        return len(rest) <= len("uXXXX")
    partial_word = any(word.startswith(rest) for word in _LITERALS)
    return not rest or partial_word or bool(_NUMBER_PREFIX.fullmatch(rest))


class JsonRows:
    """The records of local JSON files in order; ``cut_short`` says, per file cut short, how many
    bytes at its end held no complete record."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.cut_short: list[str] = []

    def __iter__(self) -> Iterator[dict]:
        for path in self.files:
            with open(path, "rb") as fh:
                starts_array = fh.read(CHUNK).lstrip(_BOM + b" \t\r\n").startswith(b"[")
                fh.seek(0)
                yield from (_array if starts_array else _lines)(path, fh, self.cut_short)


def _record(path: Path, line: int, value: object) -> dict:
    if not isinstance(value, dict):
        raise JsonFileError(
            f"{path}:{line}: a JSON {type(value).__name__} where a record (an object) belongs; "
            "each line, or each element of the array, must be one object"
        )
    return value


def _not_utf8(path: Path, line: int, exc: UnicodeDecodeError) -> JsonFileError:
    return JsonFileError(
        f"{path}:{line}: not UTF-8 ({exc.reason}: {exc.object[exc.start : exc.end]!r}); "
        "re-encode the file as UTF-8"
    )


def _not_json(path: Path, line: int, exc: json.JSONDecodeError) -> JsonFileError:
    return JsonFileError(f"{path}:{line}: not JSON ({exc.msg}); fix or remove that record")


def _cut_short(path: Path, line: int, unread: int) -> str:
    if not unread:
        return f"{path} is cut short: its array never closes (every record in it was read)"
    return (
        f"{path} is cut short: the record at line {line} never ends, so its last {unread} bytes "
        "were not read (every complete record before them was)"
    )


def _lines(path: Path, fh: BinaryIO, cut_short: list[str]) -> Iterator[dict]:
    """JSON Lines: one object a line, blank lines skipped; only the last line may be cut short."""
    for number, raw in enumerate(fh, 1):
        try:
            text = raw.removeprefix(_BOM if number == 1 else b"").decode("utf-8")
            if not text.strip():
                continue
            value = json.loads(text)
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data":  # else the file ends inside a character
                raise _not_utf8(path, number, exc) from None
        except json.JSONDecodeError as exc:
            if not (ends_early(exc, text) and _only_space_left(fh)):
                raise _not_json(path, number, exc) from None
        else:
            yield _record(path, number, value)
            continue
        cut_short.append(_cut_short(path, number, len(raw)))
        return


def _only_space_left(fh: BinaryIO) -> bool:
    return all(not chunk.strip() for chunk in iter(lambda: fh.read(CHUNK), b""))


class _Window:
    """A sliding window of decoded text over a binary file: what has been read and not yet
    consumed, and which line a position in it is on."""

    def __init__(self, path: Path, fh: BinaryIO):
        self.path, self.fh = path, fh
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.text, self.eof, self.lines_read = "", False, 0
        self.mark, self.mark_line = 0, 1  # a position in ``text`` and its line, moved forward only

    def more(self, at_least: int = CHUNK) -> bool:
        """Read on (at least ``at_least`` bytes); False at the end of the file."""
        if self.eof:
            return False
        chunk = self.fh.read(max(CHUNK, at_least))
        self.eof = not chunk
        try:  # never final: a character the file ends inside is part of what is left unread
            self.text += self.utf8.decode(chunk)
        except UnicodeDecodeError as exc:
            line = self.lines_read + exc.object.count(b"\n", 0, exc.start) + 1
            raise _not_utf8(self.path, line, exc) from None
        self.lines_read += chunk.count(b"\n")
        return not self.eof

    def skip_space(self, pos: int) -> int:
        """The position of the next character that is not white space, reading on as needed
        (``len(text)`` at the end of the file)."""
        while True:
            pos = _SPACE.match(self.text, pos).end()
            if pos < len(self.text) or not self.more():
                return pos

    def drop(self, pos: int) -> None:
        """Forget the text before ``pos`` (a past element's end)."""
        self.line_at(pos)
        self.text, self.mark = self.text[pos:], 0

    def line_at(self, pos: int) -> int:
        self.mark_line += self.text.count("\n", self.mark, pos)
        self.mark = pos
        return self.mark_line

    def unread(self, pos: int) -> int:
        """Bytes from ``pos`` to the end of the file, the decoder's incomplete character included."""
        return len(self.text[pos:].encode("utf-8")) + len(self.utf8.getstate()[0])


def _array(path: Path, fh: BinaryIO, cut_short: list[str]) -> Iterator[dict]:
    """One JSON array, decoded element by element from a window of the file."""
    window = _Window(path, fh)
    window.more()
    window.text = window.text.removeprefix("\ufeff")
    pos = window.skip_space(0) + 1  # past the opening bracket
    first = True
    while True:
        pos = window.skip_space(pos)
        if window.text[pos : pos + 1] == "]":
            return
        if not first and window.text[pos : pos + 1] == ",":
            pos = window.skip_space(pos + 1)
        elif not first and pos < len(window.text):
            raise JsonFileError(f"{path}:{window.line_at(pos)}: not JSON (expecting ',' or ']')")
        decoded = _element(window, pos)
        if decoded is None:
            cut_short.append(_cut_short(path, window.line_at(pos), window.unread(pos)))
            return
        value, end = decoded
        yield _record(path, window.line_at(pos), value)
        first = False
        if end > CHUNK:
            window.drop(end)
            end = 0
        pos = end


def _element(window: _Window, pos: int) -> tuple[object, int] | None:
    """The element at ``pos`` and where it ends, reading on while it may go past the window;
    None when the file ends inside it."""
    while True:
        try:
            return _decoder.raw_decode(window.text, pos)
        except json.JSONDecodeError as exc:
            if not ends_early(exc, window.text):
                raise _not_json(window.path, window.line_at(exc.pos), exc) from None
            if not window.more(len(window.text) - pos):  # it may go on past the window
                return None
