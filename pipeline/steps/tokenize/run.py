"""``eyrie tokenize``: conversations in, parquet shards out.

A shard row is ``input_ids``, ``loss_mask``, ``source``, ``id`` (the conversation's, as in
conversations.jsonl and prompts.jsonl) and ``source_id`` (its row in the dataset, as prep
found it), so every training row traces back to its conversation and its dataset row.

The loss mask marks what the assistant produces (reasoning, text, tool calls,
its end-of-turn token) and nothing else. It comes from ONE rendering and ONE
tokenization per conversation: the chat template yields the character spans of
the assistant's output, the tokenizer yields each token's character offsets, and
a single sweep over both marks the tokens that overlap a span. Cost is linear in
the conversation's length; no prefix is ever tokenized again.

Spans come from ``{% generation %}`` markers when the template has them (the
shipped Kimi-K2-style template does). A template without markers (Kimi-K2.5's
own) gets them from per-message probes, each at most two messages long, checked
against the whole rendering (still linear); a conversation the template does not
render message by message falls back to rendered prefixes, and the manifest says
which method ran.

A tiktoken-based slow tokenizer (Kimi-K2.5's) is converted to a fast one once and
cached (``fast.py``), then checked token for token against it on the step's first
conversations before anything is written.

Rendering is Python (Jinja), tokenizing is Rust: batches of conversations go to
forked worker processes that render, tokenize and mask them, as many as the
step's memory budget and CPUs allow; the main process keeps the order, counts
and writes the shards.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections import Counter, deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pipeline.memory import parse_size, plan_workers
from pipeline.run.step_contract import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    atomic_path,
    invalidate_manifest,
    step_dir_from_env,
    write_manifest,
)
from pipeline.steps.chat_format import kimi_tool_call_ids
from pipeline.steps.records import position_id, record_id, tokenized_schema, tokens_key
from pipeline.steps.target import TargetError, load_tokenizer
from pipeline.steps.tokenize.fast import fast_from_tiktoken
from pipeline.steps.tokenize.pieces import Pieces

TEMPLATES_DIR = Path(__file__).with_name("templates")
SHIPPED_TEMPLATES = {"kimi-k2": TEMPLATES_DIR / "kimi_k2.jinja"}
"""``kimi-k2`` is Kimi-K2-style with generation markers, not Kimi-K2.5's own template: a Kimi-K2.5
target uses its own (``--chat-template tokenizer``)."""
# The special tokens the Kimi-K2-style template writes: a tokenizer used with it must hold each as one token.
KIMI_K2_SPECIAL_TOKENS = [
    "<|im_system|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]
SHARDS = "shards"
DEFAULT_MAX_LENGTH = 4096
DEFAULT_SHARD_ROWS = 8192
BATCH = 256
DEFAULT_WORKER_MEMORY = "256MiB"
CHECKED_CONVERSATIONS = 256
"""A converted tokenizer is checked against the target's own on this many conversations of each
file before any is tokenized: one batch, enough for a split pattern that differs to show (contractions,
digits and whitespace runs are in nearly every conversation), and a few seconds of the slow
tokenizer at most, where checking every row would cost more than tokenizing it."""
OWN_TEMPLATE = "tokenizer"
"""``--chat-template`` for the template the tokenizer's folder ships (the default)."""
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Special tokens a template writes literally; each must be ONE token of the tokenizer,
# or the rendered markup would be split into pieces the target never saw.
_MARKUP_RE = re.compile(r"<\|[A-Za-z0-9_]+\|>")

console = Console(stderr=True)
if not console.is_terminal:  # logs: wide enough that the counts table keeps one line per source
    console.width = max(console.width, 150)


class TokenizeError(RuntimeError):
    """Tokenization cannot proceed; the message is one line saying what and how to fix it."""


class InputError(TokenizeError):
    """An input file that is not what tokenize reads (the input's to fix: the step exits as bad input)."""


@dataclass
class ChatTemplate:
    name: str
    source: str
    markers: bool
    names_calls_by_id: bool = False
    """It writes a tool call's id where other templates write the function's name (Kimi's do):
    conversations get Kimi's ids, ``functions.NAME:IDX``, before it renders them."""

    @property
    def method(self) -> str:
        """How the spans are found: ``generation_markers``, else ``message_probes`` (linear), which
        falls back to ``prefix_render`` for a conversation the template does not render message by
        message (the manifest counts those)."""
        return "generation_markers" if self.markers else "message_probes"


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


def load_template(choice: str, tokenizer: Any) -> ChatTemplate:
    """``tokenizer`` (the folder's own template), a shipped name (``kimi-k2``) or a ``.jinja`` path."""
    if choice == OWN_TEMPLATE:
        source = tokenizer.chat_template
        if isinstance(source, dict):
            source = source.get("default")
        if not source:
            raise TokenizeError(
                "the tokenizer folder has no chat template; pass --chat-template kimi-k2 or a .jinja file"
            )
        name = OWN_TEMPLATE
    else:
        path = SHIPPED_TEMPLATES.get(choice, Path(choice))
        if not path.is_file():
            raise TokenizeError(
                f"chat template {choice!r} is neither 'tokenizer', a shipped template "
                f"({', '.join(SHIPPED_TEMPLATES)}) nor an existing .jinja file"
            )
        source, name = path.read_text(encoding="utf-8"), choice
    vocab = tokenizer.get_vocab()
    missing = sorted({t for t in _MARKUP_RE.findall(source) if t not in vocab})
    if missing:
        raise TokenizeError(
            f"chat template {name!r} writes {', '.join(missing)}, which the tokenizer does not have as "
            f"tokens; use the target's own template (--chat-template tokenizer) or its tokenizer"
        )
    template = ChatTemplate(name, source, bool(_GENERATION_RE.search(source)))
    template.names_calls_by_id = _names_calls_by_id(template, dict(tokenizer.special_tokens_map))
    return template


def _names_calls_by_id(template: ChatTemplate, special: dict) -> bool:
    """Whether the template names a tool call only by its id: a probe call's id is in the text, its
    function's name is not."""
    call = {"id": "call_probe_id", "type": "function", "function": {"name": "probe_name", "arguments": "{}"}}
    probe = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "!"},
    ]
    try:
        text, _ = _render(template, probe, None, special=special)
    except Exception:  # a template that cannot render tool calls has no names to lose
        return False
    return call["id"] in text and call["function"]["name"] not in text


def _render_all(
    template: ChatTemplate,
    conversations: list[list[dict]],
    tools: Any,
    generation_prompt: bool = False,
    special: dict | None = None,
) -> tuple[list[str], list[list[tuple[int, int]]]]:
    # The renderer behind apply_chat_template, called directly: it returns the {% generation %}
    # character spans, takes this conversation's own tools, and renders many in one call.
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, indices = render_jinja_template(
        conversations=conversations,
        tools=tools,
        chat_template=template.source,
        return_assistant_tokens_mask=template.markers,
        add_generation_prompt=generation_prompt,
        **(special or {}),
    )
    return texts, [[tuple(span) for span in spans] for spans in indices] if template.markers else []


def _render(
    template: ChatTemplate,
    messages: list[dict],
    tools: Any,
    generation_prompt: bool = False,
    special: dict | None = None,
) -> tuple[str, list[tuple[int, int]]]:
    texts, indices = _render_all(template, [messages], tools, generation_prompt, special)
    return texts[0], indices[0] if template.markers else []


def _prefixes_differ(template: ChatTemplate) -> TokenizeError:
    return TokenizeError(
        f"chat template {template.name!r} renders a conversation's prefixes differently from the "
        "whole; add {% generation %} markers around the assistant's output"
    )


def prefix_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict, text: str
) -> list[tuple[int, int]]:
    """Each assistant message's span from the conversation rendered up to it (with the generation
    prompt) and through it: exact for any template whose prefixes render as the whole begins,
    but the rendering grows with the square of the turns."""
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, _ = _render(template, messages[:i], tools, generation_prompt=True, special=special)
        through, _ = _render(template, messages[: i + 1], tools, special=special)
        if not (text.startswith(through) and through.startswith(before)):
            raise _prefixes_differ(template)
        spans.append((len(before), len(through)))
    return spans


PROBE_WINDOWS = (0, 1)
"""How many messages before each one its probe renders, tried in turn: none (one short render per
message), then the one before it (for templates that render a message by the one before it)."""


def probe_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict, text: str, window: int = 0
) -> list[tuple[int, int]] | None:
    """The prefix method's spans in linear time, or None where this conversation cannot have them so.

    Each message is rendered after the ``window`` messages before it alone (the first after
    nothing): what it adds to that short context is its own text; for an assistant message,
    what the generation prompt adds to the message before it alone is its header. The whole
    conversation must then read as the first message's rendering followed by the others'
    texts, character for character, and each assistant text must open with its header; only
    then are the spans (each assistant text less its header, at its place in the whole) the
    ones the prefix method finds. No probe is longer than ``window + 1`` messages, whatever
    the conversation's length.
    """
    if not messages:
        return []

    def key(start: int, end: int) -> tuple[int, int]:
        return (start, end) if end > start else (0, 0)  # every empty context renders alike

    assistant = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
    ahead = [max(0, j - window) for j in range(len(messages))]
    wanted = {key(ahead[j], j + 1) for j in range(len(messages))}
    wanted |= {key(ahead[j], j) for j in range(1, len(messages))}
    wanted |= {key(max(0, j - 1), j) for j in assistant if j}
    plain_keys = sorted(wanted)
    prompt_keys = [key(max(0, j - 1), j) for j in assistant]
    try:
        rendered, _ = _render_all(template, [messages[a:b] for a, b in plain_keys], tools, special=special)
        prompts = _render_all(template, [messages[a:b] for a, b in prompt_keys], tools, True, special)[0]
    except Exception:  # a context the template cannot open with (e.g. it reads messages[0] of none)
        return None
    plain = dict(zip(plain_keys, rendered, strict=True))
    pieces = [plain[key(0, 1)]]  # the first message with all that comes before it (system, tools)
    for j in range(1, len(messages)):
        through, context = plain[key(ahead[j], j + 1)], plain[key(ahead[j], j)]
        if not through.startswith(context):
            return None
        pieces.append(through[len(context) :])
    if "".join(pieces) != text:
        return None
    spans, offset = [], 0
    headers = dict(zip(assistant, prompts, strict=True))
    for j, piece in enumerate(pieces):
        if j in headers:
            context = plain[key(j - 1, j)] if j else ""
            if not headers[j].startswith(context):
                return None
            header = headers[j][len(context) :]
            if not piece.startswith(header):
                return None
            spans.append((offset + len(header), offset + len(piece)))
        offset += len(piece)
    return spans


def assistant_spans(
    template: ChatTemplate, messages: list[dict], tools: Any, special: dict
) -> tuple[str, list[tuple[int, int]], bool]:
    """The rendered conversation, the character spans of the assistant's output in order, and
    whether they took the rendered prefixes (a template that does not render message by message)."""
    text, spans = _render(template, messages, tools, special=special)
    if template.markers:
        return text, spans, False
    for window in PROBE_WINDOWS:
        probed = probe_spans(template, messages, tools, special, text, window)
        if probed is not None:
            return text, probed, False
    return text, prefix_spans(template, messages, tools, special, text), True


def mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for every token overlapping a span; one sweep, as both lists are in order."""
    mask = [0] * len(offsets)
    span = 0
    for index, (start, end) in enumerate(offsets):
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        if span == len(spans):
            break
        if end > spans[span][0]:
            mask[index] = 1
    return mask


def span_mask(encoding: Any, spans: list[tuple[int, int]]) -> list[int]:
    """The mask of one encoding: per span, the tokens holding its first and last characters and all
    between. Same rule as ``mask_from_offsets`` in O(spans) lookups instead of a pass over all
    offsets; a character no token covers (a normalizer dropped it) falls back to the sweep."""
    mask = [0] * len(encoding.ids)
    for start, end in spans:
        if start >= end:
            continue
        first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
        if first is None or last is None:
            return mask_from_offsets(encoding.offsets, spans)
        mask[first : last + 1] = [1] * (last + 1 - first)
    return mask


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


class ShardWriter:
    """Tables into ``shard-00000.parquet``, ``shard-00001.parquet``, … of ``shard_rows`` rows each."""

    def __init__(self, folder: Path, shard_rows: int):
        self.folder = folder
        self.shard_rows = shard_rows
        self.schema = tokenized_schema()
        self.writer = None
        self.in_shard = 0
        self.shards = 0
        self.rows = 0

    def write(self, table) -> None:
        import pyarrow.parquet as pq

        start = 0
        while start < table.num_rows:
            if self.writer is None or self.in_shard >= self.shard_rows:
                self.close()
                name = self.folder / f"shard-{self.shards:05d}.parquet"
                self.writer = pq.ParquetWriter(str(name), self.schema)
                self.shards += 1
                self.in_shard = 0
            take = min(table.num_rows - start, self.shard_rows - self.in_shard)
            self.writer.write_table(table.slice(start, take))
            self.in_shard += take
            self.rows += take
            start += take

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _ships_code(folder: Path) -> bool:
    """The tokenizer names a class of its own (``auto_map``), to be loaded through AutoTokenizer."""
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return "auto_map" in config


class Tokenizer:
    """The target's tokenizer plus a chat template: conversations to (ids, mask)."""

    def __init__(self, target: str, chat_template: str, trust_remote_code: bool = False):
        folder = Path(target)
        self.own: Any | None = None
        """The slow tokenizer the fast one was converted from: what it must agree with."""
        self.converted: Path | None = None
        """The cached ``tokenizer.json`` of that conversion."""
        if (folder / "tokenizer.json").is_file() and not _ships_code(folder):
            # A folder with tokenizer.json loads as a fast tokenizer directly; AutoTokenizer would
            # first import torch (seconds) for nothing.
            from transformers import PreTrainedTokenizerFast

            try:
                self.hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
            except (OSError, ValueError) as exc:
                raise TokenizeError(
                    f"cannot load a tokenizer from {folder} ({type(exc).__name__}); "
                    "pass the target model's folder with --tokenizer"
                ) from None
        else:  # a hub id, a folder without tokenizer.json, or a tokenizer class of its own
            try:
                self.hf = load_tokenizer(target, trust_remote_code=trust_remote_code)
                if not self.hf.is_fast:
                    converted = fast_from_tiktoken(self.hf, target)
                    if converted is None:
                        raise TokenizeError(
                            f"the tokenizer of {target} is neither a fast tokenizer (no character offsets) "
                            "nor a tiktoken one to convert; pass a target with a tokenizer.json"
                        )
                    self.own = self.hf
                    self.hf, self.converted = converted
            except TargetError as exc:
                raise TokenizeError(str(exc)) from None
        self.backend = self.hf.backend_tokenizer
        # A tokenizer.json may carry truncation or padding; a conversation is cut only by --max-length.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.pieces = Pieces.for_tokenizer(self.hf)
        self.template = load_template(chat_template, self.hf)
        self.special = dict(self.hf.special_tokens_map)
        self.vocab_size = len(self.hf)

    def render(self, messages: list[dict], tools: Any) -> tuple[str, list[tuple[int, int]], bool]:
        """The rendered conversation, its assistant spans, and whether they took rendered prefixes."""
        if self.template.names_calls_by_id:
            messages = kimi_tool_call_ids(messages)
        return assistant_spans(self.template, messages, tools, self.special)

    def check_against_own(self, lines: Iterable[Line]) -> int:
        """The converted fast tokenizer against the slow one it came from, token for token, on the
        conversations of ``lines`` as the template renders them; returns how many were compared.
        Raises on the first that differs, naming it and the first token where the two part."""
        if self.own is None:
            return 0
        compared = 0
        for line in lines:
            record = parse_conversation(line)
            try:
                text, _, _ = self.render(record.messages, record.tools)
            except TokenizeError:
                raise
            except Exception:  # rejected as render_error when tokenized; nothing to compare
                continue
            fast = self.backend.encode(text, add_special_tokens=False).ids
            own = self.own.encode(text, add_special_tokens=False)
            compared += 1
            if fast != own:
                same = (a == b for a, b in zip(fast, own, strict=False))
                at = next((i for i, equal in enumerate(same) if not equal), min(len(fast), len(own)))
                piece = [self.own.decode(ids[at : at + 1]) for ids in (fast, own)]
                raise TokenizeError(
                    f"{line[0]}:{line[1]}: the fast tokenizer converted from the target's own "
                    f"({self.converted}) differs from it at token {at} ({piece[0]!r} where it has "
                    f"{piece[1]!r}, after {self.own.decode(own[max(0, at - 8) : at])!r}); delete that "
                    "file to convert again, and report the target if it persists"
                )
        return compared

    def encode_batch(
        self, conversations: list[tuple[list[dict], Any]]
    ) -> list[tuple[list[int], list[int], bool] | str]:
        """Per conversation: ``(input_ids, loss_mask, tokenized in pieces)``, or the reason it was
        rejected. A conversation whose span edges all touch added tokens is tokenized in pieces,
        without offsets (see ``pieces.py``); any other, whole, with offsets."""
        return self._encode(conversations)[0]

    def _encode(
        self, conversations: list[tuple[list[dict], Any]]
    ) -> tuple[list[tuple[list[int], list[int], bool] | str], list[bool]]:
        """``encode_batch``'s results, and per conversation whether its spans took rendered prefixes."""
        out: list = []
        by_prefix: list[bool] = []
        whole: list[tuple[int, str, list[tuple[int, int]]]] = []
        cut: list[tuple[int, str, list]] = []
        for messages, tools in conversations:
            try:
                text, spans, prefixed = self.render(messages, tools)
            except TokenizeError:
                raise
            except Exception:  # a message the template cannot render (wrong types, missing keys)
                out.append("render_error")
                by_prefix.append(False)
                continue
            by_prefix.append(prefixed)
            pieces = self.pieces.cut(text, spans) if self.pieces else None
            if pieces is None:
                whole.append((len(out), text, spans))
            else:
                cut.append((len(out), text, pieces))
            out.append(None)
        if whole:
            encodings = self.backend.encode_batch([text for _, text, _ in whole], add_special_tokens=False)
            for (slot, _, spans), encoding in zip(whole, encodings, strict=True):
                out[slot] = (encoding.ids, span_mask(encoding, spans), False)
        if cut:
            texts = [text[start:end] for _, text, pieces in cut for start, end, _ in pieces]
            encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
            first = 0
            for slot, _, pieces in cut:
                ids: list[int] = []
                mask: list[int] = []
                for (_, _, value), encoding in zip(
                    pieces, encodings[first : first + len(pieces)], strict=True
                ):
                    piece = encoding.ids
                    ids += piece
                    mask += [value] * len(piece)
                first += len(pieces)
                out[slot] = (ids, mask, True)
        return out, by_prefix

    def encode_lines(self, lines: list[Line], max_length: int) -> tuple[Any, dict[str, Counts]]:
        """The rows of a batch of conversation lines, in order, as an Arrow table, and their counts."""
        parsed = [parse_conversation(line) for line in lines]
        rows = Rows(max_length)
        results, by_prefix = self._encode([(record.messages, record.tools) for record in parsed])
        for record, result, prefixed in zip(parsed, results, by_prefix, strict=True):
            if isinstance(result, str):
                rows.reject(record.source, result)
            else:
                rows.keep(record, *result, by_prefix=prefixed)
        return rows.table(), rows.counts


_worker_tokenizer: Tokenizer | None = None
"""Set before the worker pool forks: every worker inherits the loaded tokenizer and template."""


def _worker_setup() -> None:
    # Each worker tokenizes one batch at a time on one core; Rust threads in every worker would
    # oversubscribe the CPUs the workers already share out.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _encode_in_worker(lines: list[Line], max_length: int) -> tuple[Any, dict[str, Counts]]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode_lines(lines, max_length)


class Encoders:
    """Batches of lines to results, in order: in this process, or in forked workers.

    The workers are forked before anything else starts a thread here (the progress bar,
    the tokenizer's Rust threads), and at most ``2 × workers`` batches are in flight, so
    memory stays flat however long the input is.
    """

    def __init__(self, tokenizer: Tokenizer, workers: int):
        global _worker_tokenizer
        self.tokenizer = tokenizer
        self.workers = workers
        self.pool: ProcessPoolExecutor | None = None
        if workers > 1:
            _worker_tokenizer = tokenizer
            self.pool = ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"), initializer=_worker_setup
            )
            self.pool.submit(int).result()  # fork every worker now

    def map(self, batches: Iterable[list[Line]], max_length: int) -> Iterator[tuple[Any, dict[str, Counts]]]:
        if self.pool is None:
            yield from (self.tokenizer.encode_lines(batch, max_length) for batch in batches)
            return
        pending: deque[Future] = deque()
        try:
            for batch in batches:
                pending.append(self.pool.submit(_encode_in_worker, batch, max_length))
                if len(pending) >= 2 * self.workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            raise TokenizeError(
                "a tokenize worker process died (killed by a signal, e.g. the OOM killer); give the step "
                "more memory, or pass --workers 1 or a larger --worker-memory"
            ) from None

    def __enter__(self) -> Encoders:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _batches(items: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def run_tokenize(
    target: str,
    conversations: list[Path],
    tokenized: list[Path],
    out_dir: Path | None = None,
    *,
    chat_template: str = OWN_TEMPLATE,
    max_length: int = DEFAULT_MAX_LENGTH,
    shard_rows: int = DEFAULT_SHARD_ROWS,
    workers: int | None = None,
    worker_memory: str = DEFAULT_WORKER_MEMORY,
    trust_remote_code: bool = False,
) -> int:
    """Run the step; returns the exit code. ``target``: a model folder or a hub id."""
    try:
        per_worker = _checked_inputs(conversations, tokenized, worker_memory)
        encoder = Tokenizer(target, chat_template, trust_remote_code)
        checked = encoder.check_against_own(
            line for path in conversations for line in islice(read_lines(path), CHECKED_CONVERSATIONS)
        )
    except TokenizeError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT
    worker_count, worker_facts = plan_workers(len(os.sched_getaffinity(0)), per_worker, workers)
    encoders = Encoders(encoder, worker_count)
    step_dir = Path(out_dir) if out_dir else step_dir_from_env()
    invalidate_manifest(step_dir)
    _say_how_it_tokenizes(encoder, checked)
    per_source: dict[str, Counts] = {}
    progress = Progress(
        TextColumn("tokenize"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    try:
        with encoders, progress:
            tables = _tables(encoders, conversations, tokenized, max_length, progress)
            writer = _write_shards(tables, step_dir / SHARDS, shard_rows, per_source)
    except TokenizeError as exc:
        _print_counts(per_source)
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        return EXIT_BAD_INPUT if isinstance(exc, InputError) else EXIT_FAILED
    _print_counts(per_source)
    totals = Counts()
    for entry in per_source.values():
        totals.add(entry)
    tokenizer_stats = {"converted": str(encoder.converted), "checked_conversations": checked}
    write_manifest(
        step_dir,
        [SHARDS],
        records={SHARDS: writer.rows},
        stats={
            "chat_template": encoder.template.name,
            "mask_method": _mask_method(encoder.template, totals),
            **({"tokenizer": tokenizer_stats} if encoder.converted is not None else {}),
            "max_length": max_length,
            "shards": writer.shards,
            "workers": worker_facts,
            "totals": totals.as_stats(),
            "sources": {name: c.as_stats() for name, c in sorted(per_source.items())},
        },
    )
    console.print(
        f"tokenize: {writer.rows} rows, {totals.tokens} tokens ({totals.assistant_tokens} assistant), "
        f"{totals.truncated} truncated ({totals.assistant_tokens_truncated} assistant tokens cut), "
        f"{writer.shards} shard(s) -> {step_dir / SHARDS}"
    )
    return 0


def _checked_inputs(conversations: list[Path], tokenized: list[Path], worker_memory: str) -> int:
    """The memory per worker; raises TokenizeError for a bad ``--worker-memory`` or input file list."""
    try:
        per_worker = parse_size(worker_memory)
    except ValueError as exc:
        raise TokenizeError(f"--worker-memory: {exc}") from None
    missing = [str(p) for p in [*conversations, *tokenized] if not Path(p).is_file()]
    if missing:
        raise TokenizeError(f"input file(s) {', '.join(missing)} do not exist; run the steps that make them")
    if not conversations and not tokenized:
        raise TokenizeError("nothing to tokenize: pass --conversations and/or --tokenized files")
    return per_worker


def _say_how_it_tokenizes(encoder: Tokenizer, checked: int) -> None:
    """What is not the plain case: a converted tokenizer, spans found without generation markers."""
    if encoder.converted is not None:
        console.print(
            f"tokenize: the target's tiktoken tokenizer as a fast one ({encoder.converted}), the same "
            f"tokens as its own on the first {checked} conversation(s)",
            markup=False,
        )
    if not encoder.template.markers:
        console.print(
            f"tokenize: chat template {encoder.template.name!r} has no {{% generation %}} markers; assistant "
            "spans come from each message rendered after the one before it, checked against the whole "
            "(a conversation that does not render so takes its rendered prefixes: the manifest counts them)",
            markup=False,
        )


def _tables(
    encoders: Encoders, conversations: list[Path], tokenized: list[Path], max_length: int, progress: Progress
) -> Iterator[tuple[Any, dict[str, Counts]]]:
    """The rows of every conversation file tokenized, then of every pre-tokenized file checked, as
    tables and their counts, in order."""
    task = progress.add_task("conversations", total=None)
    for path in conversations:
        progress.update(task, description=str(path.name))
        for table, counts in encoders.map(_batches(read_lines(path), BATCH), max_length):
            yield table, counts
            progress.advance(task, sum(c.conversations for c in counts.values()))
    for path in tokenized:
        progress.update(task, description=str(path.name))
        yield from _pass_through(path, encoders.tokenizer.vocab_size, max_length)


def _write_shards(
    tables: Iterable[tuple[Any, dict[str, Counts]]],
    shards: Path,
    shard_rows: int,
    per_source: dict[str, Counts],
) -> ShardWriter:
    """The tables into the ``shards`` folder, whole or not at all, their counts added to ``per_source``
    as they come; raises TokenizeError when no row is kept."""
    with atomic_path(shards) as tmp:
        tmp.mkdir()
        writer = ShardWriter(tmp, shard_rows)
        try:
            for table, counts in tables:
                writer.write(table)
                for source, entry in counts.items():
                    per_source.setdefault(source, Counts()).add(entry)
        finally:
            writer.close()
        if writer.rows == 0:
            raise TokenizeError("no conversation produced a row with assistant tokens; see the counts")
    return writer


def _mask_method(template: ChatTemplate, totals: Counts) -> str:
    """The template's method, with ``prefix_render`` where some or all spans took it."""
    if not totals.prefix_rendered:
        return template.method
    return "prefix_render" if totals.prefix_rendered == totals.rows else f"{template.method}+prefix_render"


def _pass_through(path: Path, vocab_size: int, max_length: int) -> Iterator[tuple[Any, dict[str, Counts]]]:
    """Pre-tokenized rows (``input_ids``, ``loss_mask``, ``source``): checked, truncated, kept. A file
    without ``id`` and ``source_id`` (not written by prep) gives each row the id prep would, and
    its index in the file."""
    import pyarrow.parquet as pq

    file = pq.ParquetFile(str(path))
    traced = {"id", "source_id"} <= set(file.schema_arrow.names)
    columns = ["input_ids", "loss_mask", "source", *(["id", "source_id"] if traced else [])]
    position = 0
    for batch in file.iter_batches(columns=columns):
        rows = Rows(max_length)
        values = [batch.column(name).to_pylist() for name in columns]
        for ids, mask, source, *origin in zip(*values, strict=True):
            if not traced:
                content = tokens_key(ids, mask)
                origin = [record_id(source, content), position_id(position)]
            position += 1
            if ids and max(ids) >= vocab_size:
                rows.reject(source, "id_out_of_vocab")
            else:
                rows.keep(Record(source, *origin, [], None), ids, mask)
        yield rows.table(), rows.counts


def _print_counts(per_source: dict[str, Counts]) -> None:
    from rich.table import Table

    table = Table(title="tokenize: per-source counts", title_justify="left")
    for column in ("source", "conversations", "rows", "tokens", "assistant", "truncated", "rejected"):
        table.add_column(column, justify="left" if column in ("source", "rejected") else "right")
    for name, c in sorted(per_source.items()):
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(c.rejected.items())) or "-"
        table.add_row(
            name,
            str(c.conversations),
            str(c.rows),
            str(c.tokens),
            str(c.assistant_tokens),
            str(c.truncated),
            rejected,
        )
    console.print(table)
