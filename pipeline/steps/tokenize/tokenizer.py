"""The target's tokenizer plus a chat template: conversations to ``(input_ids, loss_mask)``.

A tiktoken-based slow tokenizer (Kimi-K2.5's) is converted to a fast one once and cached
(``fast.py``), then checked token for token against it (``Tokenizer.check_against_own``) before
anything is written. A conversation whose span edges all touch added tokens is tokenized in pieces
(``pieces.py``); any other, whole, with character offsets (``loss_mask.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pipeline.steps.chat_format import kimi_tool_call_ids
from pipeline.steps.target import TargetError, load_tokenizer
from pipeline.steps.tokenize.chat_template import TokenizeError, load_template
from pipeline.steps.tokenize.fast import fast_from_tiktoken
from pipeline.steps.tokenize.loss_mask import assistant_spans, span_mask
from pipeline.steps.tokenize.pieces import Pieces
from pipeline.steps.tokenize.rows import Counts, Line, Rows, parse_conversation


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
        self, conversations: list[tuple[list[dict], Any]], where: list[str] | None = None
    ) -> tuple[list[tuple[list[int], list[int], bool] | str], list[bool]]:
        """``encode_batch``'s results, and per conversation whether its spans took rendered prefixes;
        ``where`` (FILE:LINE of each) goes before a TokenizeError, so it names the conversation."""
        out: list = []
        by_prefix: list[bool] = []
        whole: list[tuple[int, str, list[tuple[int, int]]]] = []
        cut: list[tuple[int, str, list]] = []
        for index, (messages, tools) in enumerate(conversations):
            try:
                text, spans, prefixed = self.render(messages, tools)
            except TokenizeError as exc:
                if where is None:
                    raise
                raise type(exc)(f"{where[index]}: {exc}") from None
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
        where = [f"{file}:{number}" for file, number, _ in lines]
        results, by_prefix = self._encode([(record.messages, record.tools) for record in parsed], where)
        for record, result, prefixed in zip(parsed, results, by_prefix, strict=True):
            if isinstance(result, str):
                rows.reject(record.source, result)
            else:
                rows.keep(record, *result, by_prefix=prefixed)
        return rows.table(), rows.counts
