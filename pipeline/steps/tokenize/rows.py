"""What the tokenizer reads and what it hands on: the lines of a conversations file as records,
and the rows made of them on their way to a shard, with the per-source counts of what was kept
and why not."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.steps.records import tokenized_schema
from pipeline.steps.tokenize.chat_template import TokenizeError


class InputError(TokenizeError):
    """An input file that is not what tokenize reads (the input's to fix: the step exits as bad input)."""


Line = tuple[str, int, str]
"""``(file, line number, JSON text)`` of one conversation record."""


class Record(NamedTuple):
    """One conversation to tokenize, and what its shard row keeps of where it came from."""

    source: str
    id: str | None
    source_id: str | None
    messages: list[dict]
    tools: Any


def read_lines(path: Path) -> Iterator[Line]:
    with open(path, "rb") as fh:
        for number, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(
                    f"{path}:{number} is not UTF-8 ({exc.reason} at byte {exc.start + 1} of the line); "
                    "re-encode that file as UTF-8, or regenerate it"
                ) from None
            if line.strip():
                yield str(path), number, line


def parse_conversation(line: Line) -> Record:
    """One line of a SpecForge-style conversations file."""
    path, number, text = line
    try:
        record = json.loads(text)
        messages = record["conversations"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise InputError(
            f"{path}:{number} is not a conversation record ({{id, conversations: [...]}}); "
            "regenerate that file"
        ) from None
    source = record.get("source") or Path(path).stem
    return Record(source, record.get("id"), record.get("source_id"), messages, record.get("tools"))


@dataclass
class Counts:
    conversations: int = 0
    rows: int = 0
    tokens: int = 0
    assistant_tokens: int = 0
    truncated: int = 0
    assistant_tokens_truncated: int = 0
    """Assistant tokens past ``--max-length``, dropped with the rest of their row."""
    in_pieces: int = 0
    prefix_rendered: int = 0
    rejected: Counter[str] = field(default_factory=Counter)

    def as_stats(self) -> dict[str, Any]:
        return {
            "conversations": self.conversations,
            "rows": self.rows,
            "tokens": self.tokens,
            "assistant_tokens": self.assistant_tokens,
            "truncated": self.truncated,
            "assistant_tokens_truncated": self.assistant_tokens_truncated,
            "tokenized_in_pieces": self.in_pieces,
            "spans_from_prefixes": self.prefix_rendered,
            "rejected": dict(sorted(self.rejected.items())),
        }

    def add(self, other: Counts) -> None:
        self.conversations += other.conversations
        self.rows += other.rows
        self.tokens += other.tokens
        self.assistant_tokens += other.assistant_tokens
        self.truncated += other.truncated
        self.assistant_tokens_truncated += other.assistant_tokens_truncated
        self.in_pieces += other.in_pieces
        self.prefix_rendered += other.prefix_rendered
        self.rejected.update(other.rejected)


class Rows:
    """Rows on their way to a shard, with the per-source counts of what was kept and why not."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.ids: list[list[int]] = []
        self.masks: list[list[int]] = []
        self.sources: list[str] = []
        self.record_ids: list[str | None] = []
        self.source_ids: list[str | None] = []
        self.counts: dict[str, Counts] = {}

    def reject(self, source: str, reason: str) -> None:
        entry = self.counts.setdefault(source, Counts())
        entry.conversations += 1
        entry.rejected[reason] += 1

    def keep(
        self,
        record: Record,
        ids: list[int],
        mask: list[int],
        in_pieces: bool = False,
        by_prefix: bool = False,
    ) -> None:
        """Truncated to ``max_length``; a row left with no assistant token is rejected."""
        source = record.source
        entry = self.counts.setdefault(source, Counts())
        entry.conversations += 1
        entry.in_pieces += in_pieces
        entry.prefix_rendered += by_prefix
        if len(ids) > self.max_length:
            entry.assistant_tokens_truncated += sum(mask[self.max_length :])
            ids, mask = ids[: self.max_length], mask[: self.max_length]
            entry.truncated += 1
        assistant = sum(mask)
        if not assistant:
            entry.rejected["no_assistant_tokens"] += 1
            return
        entry.rows += 1
        entry.tokens += len(ids)
        entry.assistant_tokens += assistant
        self.ids.append(ids)
        self.masks.append(mask)
        self.sources.append(source)
        self.record_ids.append(record.id)
        self.source_ids.append(record.source_id)

    def table(self):
        """The kept rows as an Arrow table of the shard schema (cheap to send between processes)."""
        import pyarrow as pa

        columns = {
            "input_ids": self.ids,
            "loss_mask": self.masks,
            "source": self.sources,
            "id": self.record_ids,
            "source_id": self.source_ids,
        }
        return pa.table(columns, schema=tokenized_schema())
