"""Reading one source: open it (local JSON as it is, the rest through HF ``datasets``, streaming),
adapt each row, count everything.

A source runs in one worker process, or, when workers outnumber sources, in
several, each reading a contiguous slice of it (its files or parquet row
groups); each slice writes one part file. A part line is
``<dedup key>\\t<source id>\\t<the record's other members>``, so the merge can
dedup and shuffle across slices and sources without parsing records again. Every
row is counted: read, accepted, duplicate, or rejected under a reason.

Every record keeps ``source_id``: the dataset's own id of its row (a column of
``ID_COLUMNS``), or ``#N``, the row's index in the source (its data files in
order), when it has none. A slice knows only the indexes of its own rows: for
such a row ``<source id>`` is that index, a bare number, which the merge turns
into the index in the source; a row with an id of its own has it there as a JSON
string. Either way the record's line is made in one place, ``record_line``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import resource
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.contract.atomic import atomic_path
from pipeline.memory.units import KIB
from pipeline.steps.prep.adapters import (
    ADAPTERS,
    Conversation,
    Reject,
    Tokenized,
    expected_keys,
    found_keys,
)
from pipeline.steps.prep.catalog import ID_FIELD, LOCAL_SUFFIXES, Source
from pipeline.steps.prep.json_files import JsonFileError, JsonRows
from pipeline.steps.records import position_id, record_id, tokenized_schema, tokens_key

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
TOKENIZED_BATCH = 1024
ROW_BATCH = 256


class SourceError(RuntimeError):
    """One source could not be prepared; the message is one line naming the source."""


@dataclass
class SourceResult:
    name: str
    adapter: str
    native: bool
    kind: str
    """``prompts``, ``native`` (conversations) or ``tokenized``."""
    parts: list[str] = field(default_factory=list)
    """The part files, in the source's order."""
    part_rows: list[int] = field(default_factory=list)
    """Rows read into each part: where the next part's row indexes start."""
    read: int = 0
    accepted: int = 0
    duplicates: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    unknown_roles: dict[str, int] = field(default_factory=dict)
    """Speaker names the role map lacks, with the rows they cost."""
    cut_short: list[str] = field(default_factory=list)
    """Each of its files that ends inside a record: where, and the bytes left unread."""
    error: str | None = None
    bad_input: bool = False
    """Whether ``error`` is the catalog's or the data's (fixed there), not a failure a rerun may not meet."""
    seconds: float = 0.0
    worker_peak_rss: int = 0

    def as_stats(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "native": self.native,
            "kind": self.kind,
            "read": self.read,
            "accepted": self.accepted,
            "duplicates": self.duplicates,
            "rejected": dict(sorted(self.rejected.items())),
            "unknown_roles": dict(sorted(self.unknown_roles.items())),
            "cut_short": self.cut_short,
            "error": self.error,
            "seconds": round(self.seconds, 3),
            "worker_peak_rss": self.worker_peak_rss,
        }

    def absorb(self, other: SourceResult) -> None:
        """Add the counts and part of a later slice of the same source."""
        self.parts += other.parts
        self.part_rows += other.part_rows
        self.read += other.read
        self.accepted += other.accepted
        self.duplicates += other.duplicates
        self.rejected = dict(Counter(self.rejected) + Counter(other.rejected))
        self.unknown_roles = dict(Counter(self.unknown_roles) + Counter(other.unknown_roles))
        self.cut_short += other.cut_short
        if self.error is None:
            self.error, self.bad_input = other.error, other.bad_input
        self.seconds = max(self.seconds, other.seconds)
        self.worker_peak_rss = max(self.worker_peak_rss, other.worker_peak_rss)


def part_records(part: str | Path) -> Iterator[dict]:
    """The records of a conversation part file of a source's first (or only) slice, in its order."""
    with open(part, "rb") as fh:
        for line in fh:
            _, source_id, rest = line.split(b"\t", 2)
            yield json.loads(record_line(part_source_id(source_id, 0), rest))


def part_source_id(field: bytes, start: int) -> bytes:
    """The ``source_id``, as a JSON string, of a part line's source id: the row's own id as it is,
    or its index in its slice, after the ``start`` rows of the source's slices before it."""
    if field.startswith(b'"'):
        return field
    return json.dumps(position_id(start + int(field))).encode()


def record_line(source_id: bytes, rest: bytes) -> bytes:
    """A record as written out: ``source_id`` (a JSON string) first, then ``rest``, its other members
    as ``conversation_record`` gives them (with the closing brace, and the line's end if any)."""
    return b'{"source_id": ' + source_id + b", " + rest


def kind_of(source: Source) -> str:
    if source.format == "tokenized":
        return "tokenized"
    return "native" if source.native else "prompts"


def local_files(location: str, source: Source) -> list[Path] | None:
    """The source's local data files, in order and of one kind; None when ``location`` is a hub id."""
    path = Path(location)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_SUFFIXES)
        kinds = {_BUILDERS[p.suffix] for p in files}
        if len(kinds) != 1:
            raise SourceError(
                f"source {source.name!r}: folder {path} must hold .jsonl/.json or .parquet files "
                f"of one kind (found {len(files)} files of kinds {sorted(kinds) or 'none'})"
            )
        return files
    if path.is_file():
        if path.suffix not in _BUILDERS:
            raise SourceError(f"source {source.name!r}: {path} is not .jsonl, .json or .parquet; convert it")
        return [path]
    if location.startswith("/"):
        raise SourceError(f"source {source.name!r}: {location} does not exist; fix data: in the catalog")
    return None


def open_rows(location: str, source: Source, piece: tuple[int, int] = (0, 1)) -> Iterable[dict]:
    """The rows of slice ``piece = (index, count)`` of the source, as dicts. Local JSON files are
    read as they are, so that one cut short keeps its complete records (``JsonRows``); parquet
    files and hub ids stream through HF ``datasets``."""
    files = local_files(location, source)
    if files and _BUILDERS[files[0].suffix] == "json":
        return JsonRows(_contiguous(files, *piece))
    import datasets

    datasets.disable_progress_bars()
    if files:
        rows = datasets.load_dataset(
            "parquet", data_files=list(map(str, files)), split="train", streaming=True
        )
    else:
        rows = datasets.load_dataset(location, name=source.config, split=source.split, streaming=True)
    return _python_rows(_slice(rows, *piece))


def _contiguous(files: list[Path], index: int, count: int) -> list[Path]:
    """Slice ``index`` of ``count`` contiguous slices of ``files``, the first ones a file longer
    when they do not divide evenly (as ``datasets`` shards a source's files)."""
    size, longer = divmod(len(files), count)
    start = index * size + min(index, longer)
    return files[start : start + size + (index < longer)]


def _is_empty(message: dict) -> bool:
    return not (
        message.get("content", "").strip() or message.get("reasoning_content") or message.get("tool_calls")
    )


def _chars(messages: list[dict]) -> int:
    total = 0
    for m in messages:
        total += len(m.get("content", "")) + len(m.get("reasoning_content", ""))
        total += sum(len(c["function"]["arguments"]) for c in m.get("tool_calls", []))
    return total


def row_source_id(row: dict, source: Source, position: int) -> tuple[str, bool]:
    """``(source_id, whether it is the row's position)``: the row's own id, or ``#position``.

    A column the catalog names (``fields: {id: …}``) must be there; of the usual id columns, the
    first with a value is taken."""
    for column in source.id_columns():
        value = row.get(column)
        if isinstance(value, str) and value.strip() or isinstance(value, int) and not isinstance(value, bool):
            return str(value), False
    if ID_FIELD in source.fields:
        raise Reject("missing_id")
    return position_id(position), True


def conversation_record(conv: Conversation, source: Source, source_id: str) -> tuple[str, dict, str]:
    """``(dedup key, record, the record's members after its source_id)``: a prompt (ends before the
    answer) or, for native sources, a conversation; ``record_line`` makes the line. The id hashes the
    source and the content; the dedup key hashes the content alone, lowercased with whitespace
    collapsed, so copies are found across sources."""
    messages = [m for m in conv.messages if not _is_empty(m)]
    if source.native:
        # An answer before any question answers nothing the conversation holds: it is dropped.
        first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
        messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:]
        while messages and messages[-1]["role"] != "assistant":
            messages.pop()
        if not messages:
            raise Reject("no_assistant_turn")
        if not any(m["role"] == "user" for m in messages):
            raise Reject("empty_prompt")
    else:
        if source.prompt == "first_turn":  # the system messages before it stay; an opening answer does not
            first_user = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages))
            messages = [m for m in messages[:first_user] if m["role"] == "system"] + messages[first_user:][:1]
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not any(m["role"] == "user" for m in messages) or messages[-1]["role"] == "system":
            raise Reject("empty_prompt")
    chars = _chars(messages)
    if chars < source.min_chars:
        raise Reject("too_short")
    if source.max_chars is not None and chars > source.max_chars:
        raise Reject("too_long")
    body: dict[str, Any] = {"conversations" if source.native else "messages": messages}
    if conv.tools:
        body["tools"] = conv.tools
    canonical = json.dumps(body, ensure_ascii=False, sort_keys=True)
    identifier = record_id(source.name, canonical)
    key = hashlib.blake2b(" ".join(canonical.lower().split()).encode(), digest_size=16).hexdigest()
    # the line reuses the canonical body instead of serializing the record a second time
    rest = f'"id": "{identifier}", "source": {json.dumps(source.name)}, {canonical[1:]}'
    return key, {"source_id": source_id, "id": identifier, "source": source.name, **body}, rest


def prepare_source(
    source: Source, location: str, part: Path, probe_rows: int, piece: tuple[int, int] = (0, 1)
) -> SourceResult:
    """Read, adapt, filter and dedup one source, or slice ``piece = (index, count)`` of it, into
    ``part``; never raises (errors go in the result). Only the first slice holds the source's first
    rows, so only it probes them for a schema mismatch."""
    import time

    started = time.monotonic()
    result = SourceResult(source.name, source.format, source.native, kind_of(source))
    rejected: Counter[str] = Counter()
    unknown_roles: Counter[str] = Counter()
    try:
        _run(source, location, part, probe_rows, piece, result, rejected, unknown_roles)
        result.parts, result.part_rows = [str(part)], [result.read]
    except SourceError as exc:
        result.error, result.bad_input = str(exc), True
    except JsonFileError as exc:
        result.error, result.bad_input = f"source {source.name!r}: {exc}", True
    except Exception as exc:  # a reader or adapter failure: name the source, keep one line
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        result.error = f"source {source.name!r} ({location}): {type(exc).__name__}: {first_line}"
    result.rejected = dict(rejected)
    result.unknown_roles = dict(unknown_roles)
    result.seconds = time.monotonic() - started
    result.worker_peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * KIB
    return result


def _run(
    source: Source,
    location: str,
    part: Path,
    probe_rows: int,
    piece: tuple[int, int],
    result: SourceResult,
    rejected: Counter[str],
    unknown_roles: Counter[str],
) -> None:
    adapter = ADAPTERS[source.format]
    rows = open_rows(location, source, piece)
    probing = piece[0] == 0
    iterator = iter(rows)
    seen: set[str] = set()
    first_row: dict | None = None
    try:
        with atomic_path(part) as tmp:
            writer = _TokenizedWriter(tmp, source.name) if result.kind == "tokenized" else None
            with open(tmp, "w", encoding="utf-8") if writer is None else writer as out:
                for row in iterator:
                    position = result.read
                    result.read += 1
                    first_row = first_row or row
                    try:
                        source_id, positional = row_source_id(row, source, position)
                        adapted = adapter(row, source)
                        if isinstance(adapted, Tokenized):
                            key = tokens_key(adapted.input_ids, adapted.loss_mask)
                        else:
                            key, _, rest = conversation_record(adapted, source, source_id)
                    except Reject as reject:
                        rejected[reject.reason] += 1
                        unknown_roles.update(reject.names)
                    except (TypeError, ValueError, AttributeError, KeyError) as exc:
                        # a row shaped unlike anything the adapter knows (a role that is a list, a
                        # number where text belongs): counted under the exception, never silent
                        rejected[f"malformed_{type(exc).__name__}"] += 1
                    else:
                        if key in seen:
                            result.duplicates += 1
                        else:
                            seen.add(key)
                            result.accepted += 1
                            slice_position = position if positional else None
                            if writer is not None:
                                writer.add(key, adapted, source_id, slice_position)
                            else:
                                known = json.dumps(source_id, ensure_ascii=False)
                                out.write(f"{key}\t{known if slice_position is None else position}\t{rest}\n")
                            if source.quota is not None and result.accepted >= source.quota:
                                break
                    if probing and result.read == probe_rows and result.accepted == 0:
                        break
                if probing and result.accepted == 0 and result.read:
                    mismatch = _mismatch(source, result.read, rejected, unknown_roles, first_row or {})
                    raise SourceError(mismatch)
        result.cut_short = getattr(rows, "cut_short", [])
    finally:
        # Close the streaming iterator and collect it now, while pyarrow is fully alive: a
        # half-consumed reader left to interpreter shutdown is how the exit-134 crash
        # (huggingface/datasets#7566) happens after all the work is done.
        close = getattr(iterator, "close", None)
        if close is not None:
            close()
        del iterator, rows
        gc.collect()


def _python_rows(rows):
    """The rows as dicts, converted from Arrow a batch at a time (row by row costs more). Columns
    that ``datasets`` stores as extension types (JSON values of mixed types) are decoded its way."""
    import datasets

    for table in rows.with_format("arrow").iter(batch_size=ROW_BATCH):
        if not any(_has_extension(f.type) for f in table.schema):
            yield from table.to_pylist()
            continue
        features = datasets.Features.from_arrow_schema(table.schema)
        batch = datasets.formatting.PythonFormatter(features=features).format_batch(table)
        keys = list(batch)
        for values in zip(*batch.values(), strict=True):
            yield dict(zip(keys, values, strict=True))


def _has_extension(kind) -> bool:
    import pyarrow as pa

    if isinstance(kind, pa.BaseExtensionType):
        return True
    return any(_has_extension(kind.field(i).type) for i in range(kind.num_fields))


def _slice(rows, index: int, count: int):
    """Slice ``index`` of ``count`` contiguous slices of the source's shards (files, or parquet row
    groups once resharded); a source with fewer shards than slices leaves the last slices empty."""
    if count == 1:
        return rows
    if rows.num_shards < count:  # split files into row groups only when there are too few files
        rows = rows.reshard()
    usable = min(count, rows.num_shards)
    return rows.shard(usable, index, contiguous=True) if index < usable else rows.take(0)


def _mismatch(
    source: Source, read: int, rejected: Counter[str], unknown_roles: Counter[str], row: dict
) -> str:
    reasons = ", ".join(f"{k} {v}" for k, v in rejected.most_common())
    message = (
        f"source {source.name!r}: the first {read} rows gave no record with adapter "
        f"{source.format!r} (rejected: {reasons})"
    )
    if unknown_roles:
        message += "; " + unknown_roles_hint(source, unknown_roles)
    if set(rejected) != {"unknown_role"}:
        message += (
            f"; rows have keys [{found_keys(row, source)}], the adapter expects {expected_keys(source)}; "
            "fix format:/fields:/roles: in the catalog"
        )
    return message


def unknown_roles_hint(source: Source, unknown_roles: dict[str, int]) -> str:
    """Which speakers the role map lacks, which it knows, and the catalog lines that would map them."""
    known = source.role_map()
    guesses = {name: known[name.lower()] for name in sorted(unknown_roles) if name.lower() in known}
    example = ", ".join(f"{name}: {role}" for name, role in guesses.items()) or "NAME: user"
    return (
        f"roles {', '.join(map(repr, sorted(unknown_roles)))} are not in the role map, which knows "
        f"{', '.join(sorted(known))}; map them under roles: in the catalog, e.g. roles: {{{example}}}"
    )


class _TokenizedWriter:
    """Pre-tokenized rows into a parquet part: the shard columns, plus the dedup ``key`` and the
    row's ``position`` in the slice when it has no id of its own."""

    def __init__(self, path: Path, source_name: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._pa = pa
        self.schema = tokenized_schema(part=True)
        self.writer = pq.ParquetWriter(str(path), self.schema)
        self.source = source_name
        self.rows: list[tuple[str, Tokenized, str, str, int | None]] = []

    def add(self, key: str, item: Tokenized, source_id: str, position: int | None) -> None:
        self.rows.append((key, item, record_id(self.source, key), source_id, position))
        if len(self.rows) >= TOKENIZED_BATCH:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        pa = self._pa
        keys, items, record_ids, source_ids, positions = zip(*self.rows, strict=True)
        batch = pa.table(
            {
                "input_ids": pa.array([r.input_ids for r in items], pa.list_(pa.int32())),
                "loss_mask": pa.array([r.loss_mask for r in items], pa.list_(pa.int8())),
                "source": pa.array([self.source] * len(items), pa.string()),
                "id": pa.array(record_ids, pa.string()),
                "source_id": pa.array(source_ids, pa.string()),
                "key": pa.array(keys, pa.string()),
                "position": pa.array(positions, pa.int64()),
            },
            schema=self.schema,
        )
        self.writer.write_table(batch)
        self.rows = []

    def __enter__(self) -> _TokenizedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()
        self.writer.close()
